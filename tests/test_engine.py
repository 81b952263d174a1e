"""The batched engine of chapter 6 (`ictd.pretrain.pretrain_many`): equal to independent one-seed runs, resumable
exactly, honestly cached, and extensible by registered model families and data protocols."""
import dataclasses, json, subprocess, sys, textwrap
from pathlib import Path
import pytest
import torch
from ictd.core import save_checked
import ictd
import ictd.engine as engine
import ictd.pretrain as pt
from ictd.engine import PretrainConfig
from ictd.pretrain import pretrain, pretrain_many

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'bench'))
from reference import one_seed_pretrain

SMALL = PretrainConfig(n_tasks=128, eval_tasks=16, n_steps=60, eval_every=20, lr=1e-2)

def assert_same_run(result, model, history, tol):
    "Parameters and every recorded metric of a result equal a model and history, entry by entry, to `tol`."
    for (k1, p), (k2, q) in zip(result.model.state_dict().items(), model.state_dict().items()):
        assert k1 == k2 and (p - q).abs().max() <= tol, (k1, (p - q).abs().max())
    assert set(result.history) == set(history)
    for k, v in history.items():
        assert result.history[k].shape == v.shape, (k, result.history[k].shape, v.shape)
        assert (result.history[k].double() - v.double()).nan_to_num().abs().max() <= tol, k

@pytest.mark.claims
@pytest.mark.parametrize('config', [SMALL, dataclasses.replace(SMALL, shared=True, n_layers=4, features='onehot', n=12)],
                         ids=['spec-shapes', 'shared-onehot'])
def test_batched_equals_the_pre_engine_loop(config):
    "Seeds trained together equal the pre-engine one-seed loop (SoftmaxICTD + torch.optim.Adam, full prompts), each seed."
    seeds = [3, 11, 0]
    results = pretrain_many(config, seeds, progress=False)
    for r, s in zip(results, seeds):
        assert r.config == dataclasses.replace(config, seed=s)
        model, history = one_seed_pretrain(r.config)
        assert_same_run(r, model, history, 1e-10)

@pytest.mark.unit
def test_float32_runs_and_stays_close():
    "float32 trains in float32 (metrics in float64) and stays near the float64 run over a short horizon."
    r64, r32 = pretrain(SMALL, progress=False), pretrain(dataclasses.replace(SMALL, dtype='float32'), progress=False)
    assert next(r32.model.parameters()).dtype == torch.float32 and r32.history['msve'].dtype == torch.float64
    gap = max((p.double() - q).abs().max().item() for p, q in zip(r32.model.parameters(), r64.model.parameters()))
    assert 0 < gap < 1e-3, gap

class Interrupt(Exception): pass

@pytest.mark.claims
def test_resume_after_an_interruption_is_exact(tmp_path):
    "A run stopped at step 47 and started again resumes from its step-40 checkpoint and ends bit for bit where an uninterrupted run ends."
    config = dataclasses.replace(SMALL, n_steps=90, eval_every=30)
    def stop(step):
        if step == 47: raise Interrupt
    with pytest.raises(Interrupt): pretrain_many(config, [1, 2], progress=False, cache_dir=tmp_path, checkpoint_every=20, callback=stop)
    folder = tmp_path / config.key()
    assert [p.name for p in folder.glob('checkpoint-*.pt')] and not list(folder.glob('seed-*.pt'))
    steps = []
    resumed = pretrain_many(config, [1, 2], progress=False, cache_dir=tmp_path, checkpoint_every=20, callback=steps.append)
    assert steps[0] == 41 and steps[-1] == 90                                  # resumed from the checkpoint at step 40
    assert not list(folder.glob('checkpoint-*.pt')) and sorted(p.name for p in folder.glob('seed-*.pt')) == ['seed-1.pt', 'seed-2.pt']
    straight = pretrain_many(config, [1, 2], progress=False)
    for a, b in zip(resumed, straight):
        for p, q in zip(a.model.parameters(), b.model.parameters()): assert torch.equal(p, q)
        for k in b.history: assert torch.equal(a.history[k].nan_to_num(), b.history[k].nan_to_num()), k

@pytest.mark.claims
def test_resume_after_a_killed_process_is_exact(tmp_path):
    "The same with the process killed (SIGKILL) in the middle of training."
    config = dataclasses.replace(SMALL, n_steps=400, eval_every=100)
    script = textwrap.dedent(f'''
        import os, signal, dataclasses
        from ictd.engine import PretrainConfig
        from ictd.pretrain import pretrain_many
        config = {config!r}
        def kill(step):
            if step == 250: os.kill(os.getpid(), signal.SIGKILL)
        pretrain_many(config, [5], progress=False, cache_dir={str(tmp_path)!r}, checkpoint_every=100, callback=kill)
        ''')
    proc = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == -9, proc.stderr
    resumed = pretrain_many(config, [5], progress=False, cache_dir=tmp_path, checkpoint_every=100)[0]
    straight = pretrain_many(config, [5], progress=False)[0]
    for p, q in zip(resumed.model.parameters(), straight.model.parameters()): assert torch.equal(p, q)
    assert torch.equal(resumed.history['msve'], straight.history['msve'])

@pytest.mark.unit
def test_cache_one_folder_per_configuration_and_version(tmp_path, monkeypatch, capsys):
    "Results are read back from `<cache>/<key>/seed-<s>.pt`; another version's file, or `force`, recomputes."
    config = dataclasses.replace(SMALL, n_steps=10, eval_every=5)
    first = pretrain_many(config, [0, 1], progress=False, cache_dir=tmp_path)
    folder = tmp_path / config.key()
    settings = json.loads((folder / 'config.json').read_text())
    assert settings['version'] == ictd.__version__ and settings['lr'] == config.lr and 'seed' not in settings
    calls, train = [], pt.train_loop
    monkeypatch.setattr(pt, 'train_loop', lambda *a, **k: calls.append(a[1]) or train(*a, **k))
    again = pretrain_many(config, [1, 0], progress=False, cache_dir=tmp_path)
    assert calls == [] and torch.equal(again[1].history['msve'], first[0].history['msve'])
    saved = torch.load(folder / 'seed-1.pt', weights_only=True)
    save_checked(dict(saved, version='0.0.0'), folder / 'seed-1.pt')
    pretrain_many(config, [0, 1], progress=False, cache_dir=tmp_path)
    assert calls == [[1]] and 'seed-1.pt: its version differs' in capsys.readouterr().out
    pretrain_many(config, [0, 1], progress=False, cache_dir=tmp_path, force=True)
    assert calls == [[1], [0, 1]]
    monkeypatch.setattr(ictd, '__version__', '99.0')
    assert config.key() != folder.name                                           # a new version, a new folder

@pytest.mark.unit
def test_a_registered_family_and_protocol_are_used():
    "A family and a protocol registered from outside chapter 6 are trained by the engine (here: the softmax family and the stationary protocol, wrapped)."
    base, calls = engine.get_family('softmax'), []
    def predict(config, params, x, n):
        calls.append(x.Z.shape[:2])
        return base.predict(config, params, x, n)
    engine.register_family('softmax-copy', dataclasses.replace(base, predict=predict))
    stationary = engine.get_protocol('stationary')
    def every_step_same_task(config, pool, gens, step, state):
        b = stationary.sample(config, pool, gens, step, state)
        state['steps'] = state.get('steps', 0) + 1
        return dataclasses.replace(b, x=dataclasses.replace(b.x, task=torch.zeros_like(b.x.task)))
    engine.register_protocol('one-task', dataclasses.replace(stationary, sample=every_step_same_task))
    try:
        config = dataclasses.replace(SMALL, attention='softmax-copy', protocol='one-task', n_steps=4, eval_every=2)
        r = pretrain_many(config, [0, 1], progress=False)
        assert (2, config.batch_size) in calls and len(r) == 2 and r[0].history['msve'].shape == (3, 1)
    finally:
        del engine.FAMILIES['softmax-copy'], engine.PROTOCOLS['one-task']
    with pytest.raises(ValueError, match='`protocol` must be one of'): pretrain_many(dataclasses.replace(SMALL, protocol='zigzag'), [0])
    with pytest.raises(ValueError, match='`protocol` must be a Protocol'): engine.register_protocol('bare', lambda *a: None)
