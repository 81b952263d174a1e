"""The engine's fast paths (issue 35) compute what the readable ones compute: the fused state-token pass equals
`token_predict` in values and gradients (float64, to rounding), and the stationary sampler's walk draws exactly what
`stationary_examples` draws from the same uniforms. Seeds not shown in the book."""
import pytest
import torch
from ictd.core import TaskBatch
from ictd.engine import PretrainConfig, _walk_examples, softmax_init, stationary_pools
from ictd.model import SoftmaxICTD
from ictd.state_tokens import fused_token_predict, model_params, state_tokens, token_predict
from ictd.tasks import random_tasks, stationary_examples

def values_and_grads(predict, theta, L, x):
    leaf = {k: v.detach().clone().requires_grad_() for k, v in theta.items()}
    v = predict(leaf, L, x)
    (v[..., 0] - 0.9 * v[..., -1].detach()).square().sum().backward()
    return v.detach(), [leaf[k].grad for k in ("A", "V_cur", "V_tgt")]

@pytest.mark.unit
@pytest.mark.parametrize("L,shared,d", [(3, False, 4), (2, True, 4), (4, False, 3)])
def test_fused_pass_equals_token_predict(L, shared, d):
    pools = TaskBatch.stack([random_tasks(6, d=d, seed=s) for s in (17, 23, 29)])
    ex = stationary_examples(pools, torch.rand(3, 20, 24, generator=torch.Generator().manual_seed(31), dtype=torch.float64))
    theta = {k: torch.cat([model_params(SoftmaxICTD(d, n_layers=L, shared=shared, init_gain=1.5, seed=s))[k] for s in (41, 43, 47)]).detach()
             for k in ("A", "V_cur", "V_tgt")}
    for queries in (torch.stack([ex.query, ex.successor], -1), torch.arange(10).expand(3, 20, 10)):
        x = state_tokens(pools, ex.task, ex.states, queries)
        (v0, g0), (v1, g1) = values_and_grads(token_predict, theta, L, x), values_and_grads(fused_token_predict, theta, L, x)
        assert v1.shape == v0.shape and (v1 - v0).abs().max() <= 1e-12 * max(1., v0.abs().max().item())
        for a, b in zip(g1, g0): assert (a - b).abs().max() <= 1e-12 * max(1., b.abs().max().item())

@pytest.mark.unit
def test_sampler_walk_draws_what_stationary_examples_draws():
    pools = stationary_pools(PretrainConfig(n_tasks=50), [7, 8])
    for seed in (53, 59):
        u = torch.rand(2, 40, 34, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        ref, fast = stationary_examples(pools, u), _walk_examples(pools, u)
        for k in ("task", "states", "query", "successor"): assert torch.equal(getattr(ref, k), getattr(fast, k)), k
