"""One training loop: `pretrain_many` runs the predecessor's sliding-window protocol (chapter 7) and the continuous task families
(chapter 7a), and reproduces the side loops it replaced (frozen in bench/reference_loops.py) to 1e-10 in float64."""
import dataclasses, sys
from pathlib import Path
import pytest
import torch
from ictd.continuous import GaussianAR1Family, RotationFamily, family_config
from ictd.experiments.continuous import family_run
from ictd.linear import ICLR_LINEAR
from ictd.engine import Family, PretrainResult, register_family, stack_results
from ictd.pretrain import pretrain_many

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'bench'))
from reference_loops import pretrain_family, pretrain_linear_many

@pytest.mark.unit
@pytest.mark.parametrize('shared, n_layers', [(True, 3), (False, 2)])
def test_sliding_protocol_reproduces_the_old_linear_loop(shared, n_layers):
    "pretrain_many(ICLR_LINEAR-like config) equals the old `pretrain_linear_many` on fixed seeds: parameters and every measure, 1e-10 (two chunks of tasks)."
    config = dataclasses.replace(ICLR_LINEAR, n_tasks=30, n_steps=60, eval_every=20, eval_tasks=4, shared=shared, n_layers=n_layers)
    old = pretrain_linear_many(config, [0, 3])
    results = pretrain_many(config, [0, 3], progress=False)
    new = stack_results(results)
    assert all(isinstance(r, PretrainResult) for r in results)
    for k in ('P', 'Q'): assert (old[k] - new['params'][k]).abs().max() <= 1e-10, k
    for k, v in old['history'].items():
        if k == 'tasks': assert torch.equal(v, new['history']['step'][..., 0] * config.n_tasks / config.n_steps)
        else: assert (v.double() - new['history'][k][..., 0].double()).abs().max() <= 1e-10, k

@pytest.mark.unit
@pytest.mark.parametrize('family', [RotationFamily(), GaussianAR1Family()], ids=['rotation', 'ar1'])
@pytest.mark.parametrize('dtype', ['float64', 'float32'])
def test_family_protocol_reproduces_the_old_continuous_loop(family, dtype):
    "pretrain_many(family_config(family)) equals the old `pretrain_family`: MSVE and parameters at every evaluation (1e-10 in float64, exactly in float32)."
    kw = dict(n=12, n_layers=2, n_steps=20, eval_every=10, eval_tasks=8)
    old = pretrain_family(family, [0, 3], dtype=getattr(torch, dtype), **kw)
    new = family_run(pretrain_many(family_config(family, dtype=dtype, **kw), [0, 3], progress=False))
    for k in ('steps', 'msve', 'A', 'V_cur', 'V_tgt'): assert (old[k].double() - new[k].double()).abs().max() <= 1e-10, k
    for k in old['params']: assert (old['params'][k] - new['params'][k]).abs().max() <= 1e-10, k

@pytest.mark.unit
def test_a_family_registered_from_another_module_trains():
    "A model family defined outside ictd.engine (here a one-parameter value-per-feature model) registers itself and trains on the stationary protocol."
    def init(config, seeds, dtype): return dict(w=torch.zeros(len(seeds), config.feature_dim, dtype=dtype))
    def prompt(config, x): return x.features()[2]                                   # the query features (S, B, q, d)
    def predict(config, params, x, n): return (x.to(params['w']) * params['w'][:, None, None, :]).sum(-1)
    def module(config, params): return torch.nn.Linear(config.feature_dim, 1)
    register_family('per-feature', Family(init=init, prompt=prompt, predict=predict, module=module))
    from ictd.engine import FAMILIES, PretrainConfig
    try:
        config = PretrainConfig(attention='per-feature', features='onehot', n_tasks=32, eval_tasks=8, n_steps=40, eval_every=20, lr=0.05)
        r = pretrain_many(config, [1], progress=False)[0]
        assert r.params['w'].shape == (10,) and r.params['w'].abs().min() > 0 and sorted(r.history) == ['loss', 'msve', 'neu', 'step']
        h = r.held_out                                                          # the engine's MSVE is this family's: v(x) = w_x on one-hot features
        assert abs(((r.params['w'] - h.v_pi).square() * h.d_pi).sum(-1).mean() - r.history['msve'][-1, 0]) < 1e-12
    finally:
        del FAMILIES['per-feature']
