"""Rebuilding the book leaves the repository as it was: re-executing a chapter as `make docs` does
(`tools/execute_nbs.py`, then `nbdev_clean`) writes the committed notebook byte for byte. Run on the chapters
that take under half a minute, on a copy beside the original so that relative paths resolve; a failure shows the
outputs that changed, which usually means a cell shows digits that vary from run to run or machine to machine."""
import difflib, json, os, shutil
import pytest
from conftest import FAST, ROOT, run


def outputs(nb):
    "Each code cell's outputs as text (images by their length and start), to show what a rebuild changed."
    lines = []
    for i, c in enumerate(nb['cells']):
        for o in c.get('outputs', []):
            for k, v in ({'text': o['text']} if 'text' in o else o.get('data', {})).items():
                v = ''.join(v) if isinstance(v, list) else str(v)
                lines.append(f'cell {i} {k}: ' + (v if k.startswith('text') else f'{len(v)} chars {v[:40]}'))
    return lines


@pytest.mark.book
@pytest.mark.parametrize('name', FAST)
def test_rebuild_leaves_notebook_unchanged(name):
    src = ROOT / 'nbs' / name
    copy = src.with_name(f'_rebuild_{os.getpid()}_{name}')  # `_` notebooks are scratch: the site and the chapter list skip them
    try:
        shutil.copy(src, copy)
        run('python', ROOT / 'tools' / 'execute_nbs.py', copy)
        run('nbdev_clean', '--fname', copy)
        before, after = src.read_text(), copy.read_text()
    finally:
        copy.unlink(missing_ok=True)
    if after != before:
        diff = '\n'.join(difflib.unified_diff(outputs(json.loads(before)), outputs(json.loads(after)), 'committed', 'rebuilt', lineterm='', n=0))
        pytest.fail(f'{name} changes when re-executed:\n{diff or "(outside the outputs: metadata or sources)"}')


@pytest.mark.unit
def test_execution_drops_outputs_a_cell_no_longer_shows(tmp_path):
    "Catches stale outputs surviving re-execution: execnb keeps a cell's old outputs when the cell now shows nothing."
    nb = {'cells': [{'cell_type': 'code', 'execution_count': 1, 'id': 'a1', 'metadata': {}, 'source': 'x = 1',
                     'outputs': [{'name': 'stdout', 'output_type': 'stream', 'text': 'an old result\n'}]},
                    {'cell_type': 'code', 'execution_count': 2, 'id': 'a2', 'metadata': {}, 'source': 'x + 1', 'outputs': []},
                    {'cell_type': 'code', 'execution_count': 3, 'id': 'a3', 'metadata': {}, 'source': '#| eval: false\nx + 2',
                     'outputs': [{'name': 'stdout', 'output_type': 'stream', 'text': 'kept: not run\n'}]}],
          'metadata': {}, 'nbformat': 4, 'nbformat_minor': 5}
    fn = tmp_path / 'stale.ipynb'
    fn.write_text(json.dumps(nb))
    run('python', ROOT / 'tools' / 'execute_nbs.py', fn, cwd=ROOT)
    cells = json.loads(fn.read_text())['cells']
    assert cells[0]['outputs'] == [], cells[0]['outputs']
    assert ''.join(cells[1]['outputs'][0]['data']['text/plain']) == '2'
    assert ''.join(cells[2]['outputs'][0]['text']) == 'kept: not run\n'
