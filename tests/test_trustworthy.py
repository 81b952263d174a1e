"""Runs that cannot be trusted are refused: a cache from other source code, bad configurations and inputs, diverging training.
Each test here fails on the code before issue 22 (commit 2b06aed)."""
import dataclasses, math, shutil, subprocess, sys, textwrap
from pathlib import Path
import pytest
import torch
import ictd
from ictd.linear import LinearICTD
from ictd.pretrain import DivergenceError, pretrain_many
from ictd.engine import PretrainConfig, corrupted_rewards, register_protocol
from ictd.tasks import random_tasks, sample_trajectories

TINY = PretrainConfig(n_tasks=32, eval_tasks=4, n_steps=6, eval_every=3)

@pytest.mark.unit
def test_changed_source_recomputes(tmp_path):
    "A copy of the package trains and caches; run again it loads; after a change to one source file it recomputes (a new folder)."
    shutil.copytree(Path(ictd.__file__).parent, tmp_path / 'pkg' / 'ictd', ignore=shutil.ignore_patterns('__pycache__'))
    script = textwrap.dedent(f'''
        import ictd, ictd.pretrain as pt
        from ictd.engine import PretrainConfig
        assert ictd.__file__.startswith({str(tmp_path)!r})
        trained = []
        train = pt.train_loop
        pt.train_loop = lambda *a, **k: trained.append(1) or train(*a, **k)
        config = {TINY!r}
        pt.pretrain_many(config, [0], progress=False, cache_dir={str(tmp_path / 'cache')!r})
        print(len(trained), config.key())
        ''')
    def run():
        out = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, cwd=tmp_path, env={'PYTHONPATH': str(tmp_path / 'pkg'), 'OMP_NUM_THREADS': '1'})
        assert out.returncode == 0, out.stderr
        return out.stdout.split()
    first, again = run(), run()
    assert first[0] == '1' and again == ['0', first[1]]                      # trained, then loaded from the cache
    with open(tmp_path / 'pkg' / 'ictd' / 'boyan.py', 'a') as f: f.write('\n# a change to the source\n')
    changed = run()
    assert changed[0] == '1' and changed[1] != first[1]                      # recomputed, in another folder
    assert len(list((tmp_path / 'cache').iterdir())) == 2

@pytest.mark.unit
@pytest.mark.parametrize('make, field', [
    (lambda: PretrainConfig(features='cubic', n=-3), '`n`'),
    (lambda: PretrainConfig(features='cubic'), '`features`'),
    (lambda: LinearICTD(4, n_layers=0), '`n_layers`'),
    (lambda: LinearICTD.from_td(4, n_layers=2, alpha=math.nan), '`alpha`'),
    (lambda: sample_trajectories(random_tasks(2).P, torch.tensor([[1.5, -0.5] + [0.] * 8] * 2), n=5), '`d0`'),
])
def test_bad_configurations_and_inputs_raise(make, field):
    "Bad settings are refused with a ValueError naming the argument (each was accepted silently before)."
    with pytest.raises(ValueError, match=field): make()

@pytest.mark.unit
def test_a_diverging_run_stops_and_keeps_its_checkpoint(tmp_path):
    """At lr = 50 seeds 0 and 1 diverge at step 1 (Adam's first step moves every parameter by about 50, and their losses are then
    10^12 or more, four orders above the limit); a seed whose rewards become
    10^6 times too large at step 66 diverges at step 66 whatever its parameters: the run stops with an error naming the step,
    the seed and the learning rate, and its last checkpoint stays on disk. Both events are forced, not at the edge of stability."""
    with pytest.raises(DivergenceError, match=r'diverged at step 1 with lr = 50: seed\(s\) \[0, 1\]'): pretrain_many(dataclasses.replace(TINY, lr=50.), [0, 1], progress=False)
    register_protocol("test: seed 0 corrupted at step 66", corrupted_rewards([0], 66))
    config = dataclasses.replace(TINY, n_steps=300, eval_every=100, protocol="test: seed 0 corrupted at step 66")
    with pytest.raises(DivergenceError, match=r'diverged at step 66 with lr = 0.001: seed\(s\) \[0\]') as err:
        pretrain_many(config, [0, 1], progress=False, cache_dir=tmp_path, checkpoint_every=50)
    assert 'last checkpoint before it is kept' in str(err.value) and err.value.seeds == [0] and err.value.step == 66
    folder = tmp_path / config.key()
    assert list(folder.glob('checkpoint-*.pt')) and not list(folder.glob('seed-*.pt'))
    saved = torch.load(next(folder.glob('checkpoint-*.pt')), weights_only=True)
    assert saved['step'] == 50 and all(torch.isfinite(v).all() and v.abs().max() < 1e8 for v in saved['params'].values())

@pytest.mark.unit
def test_a_healthy_run_is_not_stopped():
    "The divergence check does not fire on the book's settings (lr = 1e-2)."
    r = pretrain_many(dataclasses.replace(TINY, lr=1e-2, n_steps=30, eval_every=10), [0], progress=False)[0]
    assert torch.isfinite(r.history['msve']).all()
