"""The engine's four training objectives and its initialisations (`PretrainConfig.objective`, `.init`, `.init_scale`)."""
import dataclasses, math, sys
from pathlib import Path
import pytest
import torch
import ictd.engine as engine
from ictd.engine import PretrainConfig
from ictd.model import SoftmaxICTD
from ictd.pretrain import pretrain_many, stack_pools
from ictd.tasks import task_pool

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / 'bench'))
from reference import one_seed_pretrain

TINY = PretrainConfig(n_tasks=64, eval_tasks=8, n_steps=12, eval_every=6, lr=1e-2)

def pool_and_batch(config, seeds=(4, 5)):
    "Each seed's training pool (stacked) and one stationary batch of it (its contexts)."
    pool = stack_pools([task_pool(config, config.n_tasks, 1000 + s) for s in seeds])
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    return pool, engine.stationary_sampler(config, pool, gens, 0, {})

@pytest.mark.unit
def test_td_objective_is_the_reference_loop():
    "objective='td' (the default) trains exactly as the pre-engine one-seed loop of bench/reference.py, to 1e-10 in float64."
    config = dataclasses.replace(TINY, objective='td')
    r = pretrain_many(config, [7], progress=False)[0]
    model, history = one_seed_pretrain(r.config)
    for p, q in zip(r.model.parameters(), model.parameters()): assert (p - q).abs().max() <= 1e-10
    for k, v in history.items(): assert (r.history[k].double() - v.double()).nan_to_num().abs().max() <= 1e-10, k

@pytest.mark.unit
def test_supervised_targets_are_true_values():
    "objective='supervised' regresses on v_pi(s_q) = ((I - gamma P)^{-1} r)(s_q), solved here independently per task."
    config = dataclasses.replace(TINY, objective='supervised', batch_size=32)
    pool, b = pool_and_batch(config)
    params = {k: v.requires_grad_() for k, v in engine.softmax_init(config, [4, 5], torch.float64).items()}
    v, target = engine.objective_values(config, params, b, [torch.Generator().manual_seed(0)] * 2)
    task, query = b.x.task, b.x.queries[..., 0]
    P, r = pool.P[torch.arange(2)[:, None], task], pool.r[torch.arange(2)[:, None], task]     # (S, B, s, s), (S, B, s)
    v_pi = torch.linalg.solve(torch.eye(10, dtype=torch.float64) - config.gamma * P, r)
    assert torch.allclose(target, v_pi.gather(-1, query[..., None])[..., 0], atol=1e-12, rtol=0)
    assert v.shape == target.shape == (2, 32) and v.requires_grad and not target.requires_grad

def joint_counts(query, successor, s=10):
    "(s, s) counts of (query, successor) pairs."
    return torch.zeros(s * s, dtype=torch.float64).index_add_(0, (query * s + successor).flatten(), torch.ones(query.numel(), dtype=torch.float64)).reshape(s, s)

@pytest.mark.unit
def test_td_independent_successors_ignore_the_query(monkeypatch):
    "objective='td-independent' draws s' from d_pi of the task, independently of s_q: on one task the (s_q, s') table is the product of its marginals; the stationary sampler's is not."
    config = dataclasses.replace(TINY, objective='td-independent', n_tasks=1, batch_size=20_000, n=2)
    pool, b = pool_and_batch(config, seeds=(3,))
    seen = []
    monkeypatch.setattr(engine, 'td_values', lambda config, params, b: seen.append(b) or (None, None))
    engine.objective_values(config, {}, b, [torch.Generator().manual_seed(1)])   # no parameters: td_values is replaced
    ind, b = seen[0].x, b.x
    assert torch.equal(ind.queries[..., 0], b.queries[..., 0]) and torch.equal(ind.states, b.states) and not torch.equal(ind.queries[..., 1], b.queries[..., 1])
    def dependence(q, s1):
        "Largest gap between the joint frequencies and the product of the marginals."
        J = joint_counts(q, s1) / q.numel()
        return (J - J.sum(1, keepdim=True) * J.sum(0, keepdim=True)).abs().max().item()
    (q, s1), (q0, s0) = ind.queries.unbind(-1), b.queries.unbind(-1)
    assert dependence(q, s1) < 0.005 < 0.05 < dependence(q0, s0)
    freq = torch.bincount(s1.flatten(), minlength=10) / s1.numel()
    assert (freq - pool.d_pi[0, 0]).abs().max() < 0.015                 # marginal: d_pi (standard error < 0.004)
    assert (pool.P[0, 0][q, s1] == 0).double().mean() > 0.3               # many transitions the chain cannot make

@pytest.mark.unit
def test_mc_returns_are_unbiased_for_v_pi():
    "objective='mc' regresses on rollouts of H = mc_horizon(gamma) steps, whose mean is v_pi(s) (bias <= gamma^H / (1 - gamma) < 1e-5)."
    config = dataclasses.replace(TINY, objective='mc', n_tasks=1)
    pool, _ = pool_and_batch(config, seeds=(2,))
    H, N, gen = engine.mc_horizon(config.gamma), 20_000, torch.Generator().manual_seed(0)
    assert config.gamma ** H <= 1e-6 < config.gamma ** (H - 1)
    for start in (0, 5, 9):
        g = engine.rollout_returns(pool, torch.zeros(1, N, dtype=torch.long), torch.full((1, N), start), torch.rand(1, N, H - 1, generator=gen, dtype=torch.float64))
        se = g.std().item() / math.sqrt(N)
        assert abs(g.mean().item() - pool.v_pi[0, 0, start].item()) < 4 * se + 1e-5, (start, g.mean(), pool.v_pi[0, 0, start])

@pytest.mark.unit
@pytest.mark.parametrize('objective', ['mc', 'supervised', 'td-independent'])
def test_every_objective_trains_with_the_same_data_and_measures(objective):
    "Each objective trains through the engine, records the same metrics as 'td', and starts from the same parameters and held-out tasks."
    td, other = (pretrain_many(dataclasses.replace(TINY, objective=o), [0, 1], progress=False) for o in ('td', objective))
    for a, b in zip(td, other):
        assert set(a.history) == set(b.history) and torch.equal(a.history['msve'][0], b.history['msve'][0])
        assert torch.equal(a.held_out.v_pi, b.held_out.v_pi)
        assert math.isfinite(b.history['loss'][-1].item()) and not torch.equal(a.history['msve'], b.history['msve'])

@pytest.mark.unit
@pytest.mark.parametrize('shared', [False, True])
def test_theta_star_init_is_from_theta_star(shared):
    "init='theta_star' starts every seed at SoftmaxICTD.from_theta_star(d, L, init_beta I, init_alpha, gamma)."
    config = PretrainConfig(n_tasks=8, eval_tasks=4, n_steps=0, eval_every=1, init='theta_star', init_beta=2.5, init_alpha=0.7, shared=shared, gamma=0.8)
    star = SoftmaxICTD.from_theta_star(4, 2.5 * torch.eye(4, dtype=torch.float64), n_layers=3, alpha=0.7, gamma=0.8, shared=shared)
    for r in pretrain_many(config, [0, 3], progress=False):
        assert r.model.state_dict().keys() == star.state_dict().keys()
        for k, v in star.state_dict().items(): assert torch.equal(r.model.state_dict()[k], v), k

@pytest.mark.unit
def test_init_scale_perturbs_with_that_std():
    "init_scale = c adds independent N(0, c^2) noise to every entry: the standardised differences have mean 0 and std 1; each seed its own."
    base = PretrainConfig(features='onehot', n_states=30, n_tasks=8, eval_tasks=4, n_steps=0, eval_every=1, init='theta_star')
    plain = pretrain_many(base, [0, 1], progress=False)
    noisy = pretrain_many(dataclasses.replace(base, init_scale=0.03), [0, 1], progress=False)
    diffs = [torch.cat([(p - q).flatten() for p, q in zip(a.model.parameters(), b.model.parameters())]) / 0.03 for a, b in zip(noisy, plain)]
    for z in diffs:
        assert z.numel() == 3 * 3 * 32 * 32 and abs(z.mean().item()) < 4 / math.sqrt(z.numel()) and abs(z.std().item() - 1) < 0.04
    assert (diffs[0] - diffs[1]).abs().max() > 1                                           # seeds draw different noise
    again = pretrain_many(dataclasses.replace(base, init_scale=0.03), [1], progress=False)[0]
    assert all(torch.equal(p, q) for p, q in zip(again.model.parameters(), noisy[1].model.parameters()))

@pytest.mark.unit
@pytest.mark.parametrize('field, value', [('objective', 'q'), ('init', 'zeros'), ('init_scale', -0.1), ('init_beta', math.nan),
                                          ('init_alpha', math.inf), ('features', 'cubic'), ('n', -3), ('lr', 0.), ('gamma', 1.),
                                          ('batch_size', 2.5), ('shared', 'yes'), ('dtype', 'float16'), ('attention', '')])
def test_every_config_field_is_validated(field, value):
    "PretrainConfig rejects a bad value of each field with a ValueError naming the field."
    with pytest.raises(ValueError, match=f'`{field}`'): PretrainConfig(**{field: value})
