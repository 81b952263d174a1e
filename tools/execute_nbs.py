"""Execute chapters in place with execnb, as `nbdev_test` does, keeping every output for the book.

Cells flagged with one of `tst_flags` (e.g. `#| slow`) are skipped unless the flag is passed with
`--flags`; `#| eval: false` cells are never run. Sources are left exactly as they are.

So that executing the book twice writes the same notebooks, it runs with one thread for torch, MKL and OpenBLAS
and a fixed hash seed (it restarts itself with them when the caller's environment differs), each notebook in a
process of its own (what a chapter shows does not depend on which chapters ran before it), and a float that
a cell returns as its value is shown with `DIGITS` significant digits (IPython's plain-text formatter: bare
floats and floats in tuples, lists and dicts; the last digits of a float64 result vary between machines and
BLAS builds). What a cell prints itself, it formats itself.
Usage: python tools/execute_nbs.py nbs [--flags slow] [--jobs N]
"""
import argparse, os, subprocess, sys, time
from concurrent.futures import ThreadPoolExecutor
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

PINNED = {'PYTHONHASHSEED': '0', 'OMP_NUM_THREADS': '1', 'MKL_NUM_THREADS': '1', 'OPENBLAS_NUM_THREADS': '1'}
DIGITS = 6

def short_float(x, p, cycle):
    "IPython pretty-printer: a float with `DIGITS` significant digits, keeping a `.0` on whole numbers."
    s = f'{x:.{DIGITS}g}'
    p.text(s + '.0' if s.lstrip('-').isdigit() else s)

def execute(fn:Path, flags:set):
    nb, shell, skip = read_nb(fn), CaptureShell(fn), skip_cell(flags)
    for c in nb.cells:  # execnb stores a cell's outputs only when it has some: a cell that now shows nothing must not keep old ones
        if not skip(c): c.outputs = []
    shell.display_formatter.formatters['text/plain'].for_type(float, short_float)
    with working_directory(fn.parent): shell.run_all(nb, exc_stop=True, preproc=skip)
    write_nb(nb, fn)

if __name__ == '__main__':
    if any(os.environ.get(k) != v for k, v in PINNED.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **PINNED})
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument('paths', nargs='+')
    ap.add_argument('--flags', default='', help='space-separated test flags to run (default: none)')
    ap.add_argument('--jobs', type=int, default=os.cpu_count() or 1, help='notebooks executed at once, one process and one thread each (default: the number of cores)')
    a = ap.parse_args()
    flags = set(get_config().tst_flags.split()) - set(a.flags.split())
    # a folder's notebooks, scratch ones (`_name.ipynb`) left out; a notebook named explicitly always runs
    fns = sorted(q for p in map(Path, a.paths) for q in ([p] if p.is_file() else (q for q in p.glob('*.ipynb') if not q.name.startswith('_'))))
    if len(fns) > 1:  # one process per notebook, so that no chapter sees the state (torch's RNG, defaults) another left
        run_one = lambda fn: subprocess.run([sys.executable, __file__, str(fn), '--flags', a.flags]).returncode
        by_size = sorted(fns, key=lambda f: -f.stat().st_size)  # the big chapters first, so that the last to finish is short
        with ThreadPoolExecutor(a.jobs) as pool: codes = dict(zip(by_size, pool.map(run_one, by_size)))
        failed = [str(f) for f, c in codes.items() if c]
        sys.exit(f'failed: {" ".join(failed)}' if failed else 0)
    for fn in fns:
        t = time.time()
        execute(fn.resolve(), flags)
        print(f'executed {fn} in {time.time() - t:.1f}s', flush=True)
