"""Issue 22 (modules of about 400 lines, one function per export cell): chapter 7's protocol lives in `ictd.sliding`
and chapter 7a's pretrained head-to-head in `ictd.experiments.head_to_head`. Each test catches one way the split
could break what readers and the command line rely on."""
import dataclasses, json, os, re, subprocess, sys
import pytest, torch
from conftest import ROOT

PAGES = ['07_linear.ipynb', '92_sliding.ipynb', '07a_linear_experiments.ipynb', '07b_linear_head_to_head.ipynb']
MODULES = ['linear.py', 'sliding.py', 'experiments/linear.py', 'experiments/head_to_head.py']


def fresh_python(code):
    "Run `code` in a new interpreter (nothing imported before it), with one torch thread; return its stdout."
    env = {**os.environ, 'PYTHONPATH': str(ROOT), 'OMP_NUM_THREADS': '1'}
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.unit
def test_importing_ictd_linear_alone_registers_family_and_protocol():
    "`import ictd.linear` alone must register the linear family and the sliding protocol: `pretrain_many(ICLR_LINEAR, ...)` trains."
    out = fresh_python(
        "import dataclasses, ictd.linear\n"
        "from ictd.pretrain import pretrain_many\n"
        "c = dataclasses.replace(ictd.linear.ICLR_LINEAR, n_tasks=10, n_steps=20, eval_every=20, eval_tasks=2)\n"
        "r = pretrain_many(c, [0], progress=False)\n"
        "print(sorted(r[0].history))")
    assert "'iws'" in out and "'vd'" in out, out


@pytest.mark.unit
def test_sliding_protocol_does_not_import_the_linear_family():
    "The protocol sits below the linear family (no import cycle): importing `ictd.sliding` leaves `ictd.linear` unloaded."
    out = fresh_python("import sys, ictd.sliding\nfrom ictd.engine import PROTOCOLS\nprint('ictd.linear' in sys.modules, 'sliding' in PROTOCOLS)")
    assert out.split() == ['False', 'True'], out


@pytest.mark.unit
def test_head_to_head_module_registers_the_linear_family():
    "`ictd.experiments.head_to_head` trains `attention='linear'`: importing it alone must make that family known to the engine."
    out = fresh_python("import ictd.experiments.head_to_head\nfrom ictd.engine import FAMILIES\nprint('linear' in FAMILIES)")
    assert out.split() == ['True'], out


@pytest.mark.unit
def test_moved_names_live_in_one_place():
    "No re-export shims: each moved name is defined in its new module only."
    import ictd.linear, ictd.sliding, ictd.experiments.linear, ictd.experiments.head_to_head
    for name in ('start_distributions', 'sliding_td_loss', 'fitted_td_step', 'td_semigradient_chunks', 'FIT_CHUNK', 'sliding_sample', 'sliding_eval_set'):
        assert name in ictd.sliding.__all__ and name not in ictd.linear.__all__, name
    assert 'sliding_windows' in ictd.linear.__all__ and 'ICLR_LINEAR' in ictd.linear.__all__
    for name in ('H2H_CONFIG', 'head_to_head', 'run_head_to_head', 'paired_test', 'seed_scores', 'plot_head_to_head'):
        assert name in ictd.experiments.head_to_head.__all__ and name not in ictd.experiments.linear.__all__, name


@pytest.mark.unit
def test_softmax_family_trains_on_the_sliding_protocol():
    "The sliding page says the protocol serves any family: the softmax family trains on it, on the linear family's held-out contexts."
    from ictd.engine import eval_set
    from ictd.linear import ICLR_LINEAR
    from ictd.pretrain import pretrain_many
    small = dataclasses.replace(ICLR_LINEAR, n_tasks=10, n_steps=20, eval_every=10, eval_tasks=3)
    soft = dataclasses.replace(small, attention='softmax', shared=False)
    run = pretrain_many(soft, [7], progress=False)[0]
    assert torch.isfinite(run.history['msve']).all() and run.history['step'].flatten().tolist() == [0, 10, 20]
    a, b = eval_set(small, [7]), eval_set(soft, [7])
    assert torch.equal(a.states, b.states) and torch.equal(a.tasks.P, b.tasks.P)


@pytest.mark.book
@pytest.mark.parametrize('module', MODULES)
def test_modules_stay_about_400_lines(module):
    "Issue 22: chapter 7's modules stay at about 400 lines or fewer."
    n = len((ROOT / 'ictd' / module).read_text().splitlines())
    assert n <= 420, (module, n)


@pytest.mark.book
@pytest.mark.parametrize('name', PAGES)
def test_one_public_definition_per_export_cell(name):
    "Issue 22, item 5: no `#| export` cell of chapter 7's pages defines two public functions or classes."
    nb = json.loads((ROOT / 'nbs' / name).read_text())
    srcs = [''.join(c['source']) for c in nb['cells'] if c['cell_type'] == 'code']
    bad = [s[:80] for s in srcs if re.match(r'#\|\s*export', s) and len(re.findall(r'^(?:def|class) [A-Za-z]', s, re.M)) >= 2]
    assert not bad, bad


@pytest.mark.book
def test_head_to_head_claim_is_recorded_on_its_own_page():
    "The head-to-head claim moved with its page: recorded for `linear_head_to_head`, no longer for `linear_experiments`."
    claims = ROOT / 'nbs' / 'data' / 'claims'
    assert 'head-to-head' in json.loads((claims / 'linear_head_to_head.json').read_text())
    assert 'head-to-head' not in json.loads((claims / 'linear_experiments.json').read_text())
