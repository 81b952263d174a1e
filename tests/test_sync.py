"""Notebooks are the source: the library, the cleaned notebooks and the py:percent twins must match them."""
import filecmp, shutil
import pytest
from conftest import ROOT, chapters, run

SCRATCH = shutil.ignore_patterns('_rebuild_*')  # test_rebuild's copies come and go in nbs/ while these tests run in parallel

def test_export_leaves_no_diff(tmp_path):
    "nbdev_export on a copy of the project reproduces `ictd/` exactly."
    for f in ('settings.ini', 'setup.py'): shutil.copy(ROOT / f, tmp_path / f)
    shutil.copytree(ROOT / 'nbs', tmp_path / 'nbs', ignore=SCRATCH)
    shutil.copytree(ROOT / 'ictd', tmp_path / 'ictd')
    for f in (tmp_path / 'ictd').rglob('*.py'):   # subpackages too (ictd/experiments/)
        if f.name != '__init__.py': f.unlink()
    run('nbdev_export', cwd=tmp_path)
    ours = sorted(str(p.relative_to(ROOT / 'ictd')) for p in (ROOT / 'ictd').rglob('*.py'))
    theirs = sorted(str(p.relative_to(tmp_path / 'ictd')) for p in (tmp_path / 'ictd').rglob('*.py'))
    assert ours == theirs, f'modules differ: {ours} vs {theirs}; run nbdev_export'
    _, mismatch, errors = filecmp.cmpfiles(ROOT / 'ictd', tmp_path / 'ictd', ours, shallow=False)
    assert not mismatch + errors, f'library out of sync with notebooks in {mismatch + errors}; run nbdev_export'

def test_clean_leaves_no_diff(tmp_path):
    "nbdev_clean changes no notebook: they were cleaned before committing."
    shutil.copy(ROOT / 'settings.ini', tmp_path / 'settings.ini')
    shutil.copytree(ROOT / 'nbs', tmp_path / 'nbs', ignore=SCRATCH)
    run('nbdev_clean', cwd=tmp_path)
    names = [p.relative_to(tmp_path / 'nbs') for p in (tmp_path / 'nbs').rglob('*.ipynb')]
    dirty = [str(n) for n in names if (ROOT / 'nbs' / n).read_bytes() != (tmp_path / 'nbs' / n).read_bytes()]
    assert not dirty, f'notebooks not clean: {dirty}; run nbdev_clean'

def _percent(nb)->str:
    "jupytext's py:percent rendering of a notebook, in this process (a `jupytext` subprocess per chapter cost 2 s of CPU each)."
    import jupytext
    return jupytext.writes(jupytext.read(nb), fmt='py:percent')

@pytest.mark.parametrize('nb', chapters(), ids=lambda p: p.name)
def test_text_twin_in_sync(nb):
    "Each chapter's py:percent twin under text/ equals jupytext's rendering of the notebook."
    twin = ROOT / 'text' / (nb.stem + '.py')
    assert twin.exists(), f'{twin} missing; run `make sync`'
    assert _percent(nb) == twin.read_text(), f'{twin.name} is out of sync with {nb.name}; run `make sync`'

def test_in_process_rendering_is_the_command_line_one():
    "The rendering above equals `jupytext --to py:percent` with the project's jupytext.toml (catches a config the library call ignores)."
    nb = ROOT / 'nbs' / '02_prompt.ipynb'
    assert _percent(nb) == run('jupytext', '--to', 'py:percent', '--output', '-', nb).stdout

def test_no_cell_ends_with_a_newline():
    """A cell whose source ends with a newline does not survive the py:percent round trip: on a fresh clone, where
    `jupytext --sync` may take the twin as the newer file, it comes back with a blank line, and the exported module
    no longer matches (found by the fresh-clone check: a cell of chapter A did this)."""
    import json
    bad = {p.name: [i for i, c in enumerate(json.loads(p.read_text())['cells']) if ''.join(c['source']).endswith('\n')]
           for p in sorted((ROOT / 'nbs').glob('*.ipynb'))}
    assert not {k: v for k, v in bad.items() if v}, bad
