"""Execute chapters in place with execnb, as `nbdev_test` does, keeping every output for the book.

Cells flagged with one of `tst_flags` (e.g. `#| slow`) are skipped unless the flag is passed with
`--flags`; `#| eval: false` cells are never run. Sources are left exactly as they are.
Usage: python tools/execute_nbs.py nbs [--flags slow]
"""
import argparse, time
from pathlib import Path
from execnb.nbio import read_nb, write_nb
from execnb.shell import CaptureShell
from fastcore.foundation import working_directory
from nbdev.config import get_config
from nbdev.process import extract_directives

def skip_cell(flags):
    "A predicate telling `CaptureShell.run_all` which cells not to run."
    def _skip(cell):
        if cell.cell_type != 'code' or 'nbdev_export(' in cell.source: return True
        direc = extract_directives(cell, remove=False)
        if direc.get('eval:', [''])[0].lower() == 'false': return True
        return bool(flags & direc.keys())
    return _skip

def execute(fn:Path, flags:set):
    nb = read_nb(fn)
    with working_directory(fn.parent): CaptureShell(fn).run_all(nb, exc_stop=True, preproc=skip_cell(flags))
    write_nb(nb, fn)

if __name__ == '__main__':
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument('paths', nargs='+')
    ap.add_argument('--flags', default='', help='space-separated test flags to run (default: none)')
    a = ap.parse_args()
    flags = set(get_config().tst_flags.split()) - set(a.flags.split())
    fns = sorted(q for p in map(Path, a.paths) for q in ([p] if p.is_file() else p.glob('*.ipynb')) if not q.name.startswith('_'))
    for fn in fns:
        t = time.time()
        execute(fn.resolve(), flags)
        print(f'executed {fn} in {time.time() - t:.1f}s', flush=True)
