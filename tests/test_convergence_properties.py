"""Property tests of `ictd.convergence` on random inputs (hypothesis): the claims of chapter 5 that
hold for every input, not only for the chapter's examples."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from ictd.boyan import random_boyan_chain, sample_trajectory
from ictd.convergence import (empirical_attention, empirical_mrp, fixed_point, kernel_attention, population_attention,
                              rate_bound, spectral_radius, td_recursion)
from ictd.wstd import weighted_softmax_td

seeds = st.integers(0, 2**32 - 1)

def stochastic(rng, s, zeros=0.):
    "A random row-stochastic matrix, with entries set to zero at rate `zeros` (never a whole row)."
    A = rng.random((s, s)) * (rng.random((s, s)) >= zeros)
    A[np.arange(s), rng.integers(s, size=s)] += 0.1
    return torch.from_numpy(A / A.sum(1, keepdims=True))

@settings(max_examples=60, deadline=None)
@given(seed=seeds, s=st.integers(1, 8), d=st.integers(1, 5), scale=st.sampled_from([0., 1., 30., 1e4]))
def test_attention_is_row_stochastic(seed, s, d, scale):
    "Rows are probability vectors at every score scale, zero-weight states get exactly zero attention."
    rng = np.random.default_rng(seed)
    phi, W = rng.normal(size=(s, d)), scale * rng.normal(size=(d, d))
    w = rng.random(s) * (rng.random(s) < 0.7)
    w[rng.integers(s)] = 0.5
    M = kernel_attention(phi, W, w)
    assert torch.isfinite(M).all() and (M >= 0).all()
    torch.testing.assert_close(M.sum(-1), torch.ones(s, dtype=torch.float64), rtol=0, atol=1e-12)
    assert (M[:, torch.from_numpy(w == 0)] == 0).all()

@settings(max_examples=60, deadline=None)
@given(seed=seeds, s=st.integers(2, 8), alpha=st.floats(0.01, 1.), gamma=st.floats(0., 0.99), zeros=st.floats(0., 0.8))
def test_row_sum_bound(seed, s, alpha, gamma, zeros):
    "||I - alpha M (I - gamma P)||_inf <= rho for any row-stochastic M and P (the proposition's one step)."
    rng = np.random.default_rng(seed)
    M, P = stochastic(rng, s, zeros), stochastic(rng, s, zeros)
    B = torch.eye(s, dtype=torch.float64) - alpha * M @ (torch.eye(s, dtype=torch.float64) - gamma * P)
    assert torch.linalg.matrix_norm(B, ord=float("inf")) <= rate_bound(M, gamma, alpha) + 1e-12
    assert spectral_radius(M, P, gamma, alpha) <= torch.linalg.matrix_norm(B, ord=float("inf")) + 1e-12

@settings(max_examples=30, deadline=None)
@given(seed=seeds, n=st.integers(2, 60), beta=st.floats(0., 5.), alpha=st.floats(0.05, 1.))
def test_recursion_is_the_transformer_iteration(seed, n, beta, alpha):
    "Aggregating weighted softmax TD by state is exact for any context, features and score matrix."
    mrp = random_boyan_chain(n_states=6, d=3, features="unit", seed=seed)
    W = beta * torch.from_numpy(np.random.default_rng(seed).normal(size=(3, 3)))
    states, rewards = sample_trajectory(mrp, n, seed=seed)
    v_tf = weighted_softmax_td(mrp.phi[states], rewards, W, alpha, mrp.gamma, 8, phi_queries=mrp.phi, return_all=True)
    _, P_hat, r_hat = empirical_mrp(states, rewards, 6)
    v = td_recursion(empirical_attention(mrp.phi, W, states), P_hat, r_hat, mrp.gamma, alpha, 8)
    torch.testing.assert_close(v_tf[:, -6:], v, rtol=0, atol=1e-12 * max(1., v.abs().max().item()))

@settings(max_examples=40, deadline=None)
@given(seed=seeds, n=st.integers(3, 200), beta=st.floats(0.5, 20.))
def test_fixed_point_solves_the_empirical_bellman_equation_on_keys(seed, n, beta):
    "At the fixed point the update M (r + gamma P v - v) vanishes, and the Bellman residual is zero on key states."
    mrp = random_boyan_chain(n_states=7, features="onehot", seed=seed)
    states, rewards = sample_trajectory(mrp, n, seed=seed)
    N, P_hat, r_hat = empirical_mrp(states, rewards, 7)
    M = empirical_attention(mrp.phi, beta * torch.eye(7, dtype=torch.float64), states)
    v = fixed_point(M, P_hat, r_hat, mrp.gamma, N)
    residual = r_hat + mrp.gamma * P_hat @ v - v
    assert residual[N > 0].abs().max() < 1e-9 * max(1., v.abs().max().item())

def test_population_fixed_point_and_dtype():
    "The population fixed point is v_pi; float32 inputs give float32 outputs."
    mrp = random_boyan_chain(features="unit", seed=0)
    W = 5 * torch.eye(4, dtype=torch.float64)
    M = population_attention(mrp, W)
    torch.testing.assert_close(fixed_point(M, mrp.P, mrp.r, mrp.gamma), mrp.v_pi, rtol=0, atol=1e-10)
    v32 = td_recursion(M.float(), mrp.P.float(), mrp.r.float(), mrp.gamma, 0.5, 3)
    assert v32.dtype == torch.float32 and v32.shape == (4, 10)

@pytest.mark.parametrize("bad, msg", [(dict(alpha=0.), "`alpha` must lie in (0, 1]"), (dict(alpha=torch.tensor([0.5, 2.])), "`alpha` must lie in (0, 1]"),
                                      (dict(gamma=1.), "`gamma` must lie in [0, 1)"), (dict(n_iters=2.5), "`n_iters` must be a non-negative integer")])
def test_recursion_rejects_bad_arguments(bad, msg):
    mrp = random_boyan_chain(seed=0)
    kw = dict(M=torch.eye(10), P=mrp.P, r=mrp.r, gamma=0.9, alpha=0.5, n_iters=3) | bad
    with pytest.raises(ValueError, match=__import__("re").escape(msg)): td_recursion(**kw)
