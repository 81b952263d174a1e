"""Rebuilding the book leaves the repository as it was: re-executing a chapter as `make docs` does
(`tools/execute_nbs.py`, then `nbdev_clean`) writes the committed notebook byte for byte. Run on the chapters
that take under half a minute, on a copy beside the original so that relative paths resolve; a failure shows the
outputs that changed, which usually means a cell shows digits that vary from run to run or machine to machine. Figures
are compared as pixels: a rebuild on another CPU type may flip the anti-aliasing of a few pixels (`same_figure`)."""
import base64, difflib, io, json, os, shutil
import numpy as np
import pytest
from matplotlib.image import imread
from conftest import FAST, ROOT, run

# A figure redrawn from data that differs in the last bits (another CPU type's kernels) can flip the anti-aliasing of a
# few pixels by one level: such a figure is the same figure. Anything more, a moved curve or a new tick label, is not.
PIXEL_LEVELS, PIXEL_SHARE = 2 / 255, 5e-4


def outputs(nb):
    "Each code cell's outputs as text (images by their length and start), to show what a rebuild changed."
    lines = []
    for i, c in enumerate(nb['cells']):
        for o in c.get('outputs', []):
            for k, v in ({'text': o['text']} if 'text' in o else o.get('data', {})).items():
                v = ''.join(v) if isinstance(v, list) else str(v)
                lines.append(f'cell {i} {k}: ' + (v if k.startswith('text') else f'{len(v)} chars {v[:40]}'))
    return lines


def png_pixels(data):
    "The pixels of a base64 PNG as notebooks store it."
    return imread(io.BytesIO(base64.b64decode(''.join(data) if isinstance(data, list) else data)))


def same_figure(a, b)->bool:
    "Two PNGs that differ at most by anti-aliasing flips: same size, few pixels changed, each by at most `PIXEL_LEVELS`."
    pa, pb = png_pixels(a), png_pixels(b)
    if pa.shape != pb.shape: return False
    diff = np.abs(pa - pb).max(-1)
    return diff.max() <= PIXEL_LEVELS + 1e-6 and (diff > 0).mean() <= PIXEL_SHARE


def same_notebook(before:str, after:str)->bool:
    "Equal notebooks, every PNG compared by `same_figure` and everything else byte for byte."
    a, b = json.loads(before), json.loads(after)
    def strip(nb, out):
        for c in nb['cells']:
            for o in c.get('outputs', []):
                if 'image/png' in o.get('data', {}): out.append(o['data'].pop('image/png'))
        return out
    fa, fb = strip(a, []), strip(b, [])
    return a == b and len(fa) == len(fb) and all(same_figure(x, y) for x, y in zip(fa, fb))


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
    if after != before and not same_notebook(before, after):
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


def figure_png(y)->str:
    "A small line plot of `y`, as a notebook stores its PNG (base64)."
    import matplotlib; matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.semilogy(y); buf = io.BytesIO(); fig.savefig(buf, format='png'); plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.unit
def test_figures_compare_as_pixels():
    "Catches a comparison so loose that a moved curve passes, or so strict that anti-aliasing flips fail."
    y = np.geomspace(1, 1e-15, 50)
    base = figure_png(y)
    pixels = png_pixels(base)
    flipped = pixels.copy(); flipped[10, 10, :3] -= 1 / 255                  # one pixel one level darker
    buf = io.BytesIO(); __import__('matplotlib.image').image.imsave(buf, flipped, format='png')
    assert same_figure(base, base64.b64encode(buf.getvalue()).decode())
    assert not same_figure(base, figure_png(y * 1.5))                          # the curve moved
    assert not same_figure(base, figure_png(y[:-1]))                           # a point fewer
