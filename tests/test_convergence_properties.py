"""Property tests of `ictd.convergence` on random inputs (hypothesis): the claims of chapter 5 that
hold for every input, not only for the chapter's examples."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from ictd.boyan import random_boyan_chain, sample_trajectory
from ictd.convergence import (count_deviation, empirical_attention, empirical_mrp, fixed_point, floor_bound, interior_cap,
                              kernel_attention, population_attention, rate_bound, span_bound, span_rate,
                              spectral_radius, sup_error, td_recursion)
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
    assert torch.linalg.matrix_norm(B, ord=float("inf")) <= rate_bound(M, gamma=gamma, alpha=alpha) + 1e-12
    assert spectral_radius(M, P, gamma=gamma, alpha=alpha) <= torch.linalg.matrix_norm(B, ord=float("inf")) + 1e-12

@settings(max_examples=30, deadline=None)
@given(seed=seeds, n=st.integers(2, 60), beta=st.floats(0., 5.), alpha=st.floats(0.05, 1.))
def test_recursion_is_the_transformer_iteration(seed, n, beta, alpha):
    "Aggregating weighted softmax TD by state is exact for any context, features and score matrix."
    mrp = random_boyan_chain(n_states=6, d=3, features="unit", seed=seed)
    W = beta * torch.from_numpy(np.random.default_rng(seed).normal(size=(3, 3)))
    states, rewards = sample_trajectory(mrp, n=n, seed=seed)
    v_tf = weighted_softmax_td(mrp.phi[states], rewards, W, alpha=alpha, gamma=mrp.gamma, n_iters=8, phi_queries=mrp.phi, return_all=True)
    _, P_hat, r_hat = empirical_mrp(states, rewards, 6)
    v = td_recursion(empirical_attention(mrp.phi, W, states), P_hat, r_hat, gamma=mrp.gamma, alpha=alpha, n_iters=8)
    torch.testing.assert_close(v_tf[:, -6:], v, rtol=0, atol=1e-12 * max(1., v.abs().max().item()))

@settings(max_examples=40, deadline=None)
@given(seed=seeds, n=st.integers(3, 200), beta=st.floats(0.5, 20.))
def test_fixed_point_solves_the_empirical_bellman_equation_on_keys(seed, n, beta):
    "At the fixed point the update M (r + gamma P v - v) vanishes, and the Bellman residual is zero on key states."
    mrp = random_boyan_chain(n_states=7, features="onehot", seed=seed)
    states, rewards = sample_trajectory(mrp, n=n, seed=seed)
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
    v32 = td_recursion(M.float(), mrp.P.float(), mrp.r.float(), gamma=mrp.gamma, alpha=0.5, n_iters=3)
    assert v32.dtype == torch.float32 and v32.shape == (4, 10)

@pytest.mark.parametrize("bad, msg", [(dict(alpha=0.), "`alpha` must lie in (0, 1]"), (dict(alpha=torch.tensor([0.5, 2.])), "`alpha` must lie in (0, 1]"),
                                      (dict(gamma=1.), "`gamma` must lie in [0, 1)"), (dict(n_iters=2.5), "`n_iters` must be a non-negative integer")])
def test_recursion_rejects_bad_arguments(bad, msg):
    mrp = random_boyan_chain(seed=0)
    kw = dict(M=torch.eye(10), P=mrp.P, r=mrp.r, gamma=0.9, alpha=0.5, n_iters=3) | bad
    with pytest.raises(ValueError, match=__import__("re").escape(msg)): td_recursion(**kw)

@settings(max_examples=60, deadline=None)
@given(seed=seeds, s=st.integers(2, 8), alpha=st.floats(0.01, 1.), gamma=st.floats(0., 0.99), zeros=st.floats(0., 0.8), k=st.integers(1, 6))
def test_span_bound_holds_for_any_stochastic_pair(seed, s, alpha, gamma, zeros, k):
    "Proposition 5.2: the error of the recursion stays under the span bound at every depth, for any M, P and start."
    rng = np.random.default_rng(seed)
    M, P = stochastic(rng, s, zeros), stochastic(rng, s, zeros)
    v_pi = torch.from_numpy(rng.normal(size=s))
    r = v_pi - gamma * P @ v_pi
    err = sup_error(td_recursion(M, P, r, gamma=gamma, alpha=alpha, n_iters=40), v_pi)
    bound = span_bound(M, P, gamma=gamma, alpha=alpha, e0=-v_pi, n_layers=40, k=k)
    assert (err <= bound * (1 + 1e-9) + 1e-12).all()
    B = torch.eye(s, dtype=torch.float64) - alpha * M @ (torch.eye(s, dtype=torch.float64) - gamma * P)
    assert span_rate(M, P, gamma=gamma, alpha=alpha) <= torch.linalg.matrix_norm(B, ord=float("inf")) + 1e-12
    assert span_rate(M, P, gamma=gamma, alpha=alpha, k=2 * k) <= span_rate(M, P, gamma=gamma, alpha=alpha, k=k) + 1e-12   # delta is submultiplicative

@settings(max_examples=40, deadline=None)
@given(seed=seeds, d=st.integers(2, 4), scale=st.sampled_from([0.3, 3., 30.]))
def test_no_score_matrix_beats_the_interior_cap(seed, d, scale):
    "Proposition 5.5: M(x, x) <= cap(x) for random score matrices, at every scale, for population and count weights."
    rng = np.random.default_rng(seed)
    phi, w = torch.from_numpy(rng.uniform(-1, 1, size=(8, d))), torch.from_numpy(rng.random(8) + 0.05)
    cap = interior_cap(phi, w)
    for _ in range(5):
        M = kernel_attention(phi, scale * torch.from_numpy(rng.normal(size=(d, d))), w)
        assert (M.diagonal() <= cap + 1e-12).all()

def test_interior_cap_is_one_on_one_hot_and_unit_features():
    "Linearly independent or unit-norm features have no state in the hull of the others."
    for feat in ("onehot", "unit"):
        mrp = random_boyan_chain(features=feat, seed=3)
        assert (interior_cap(mrp.phi, mrp.d_pi) == 1).all()

@settings(max_examples=30, deadline=None)
@given(seed=seeds, n=st.integers(30, 400), beta=st.floats(0., 20.))
def test_count_lemma_and_floor_identity(seed, n, beta):
    "Lemma 5.1 for any kernel, and Proposition 5.3's floor identity on contexts whose keys cover every state."
    mrp = random_boyan_chain(n_states=6, d=3, features="unit", seed=seed)
    states, rewards = sample_trajectory(mrp, n=n, seed=seed)
    N, P_hat, r_hat = empirical_mrp(states, rewards, 6)
    W = beta * torch.from_numpy(np.random.default_rng(seed).normal(size=(3, 3)))
    eps = count_deviation(N, mrp.d_pi)
    if eps < 1:
        M_hat, M = empirical_attention(mrp.phi, W, states), population_attention(mrp, W)
        assert (M_hat - M).abs().sum(1).max() <= 2 * eps / (1 - eps) + 1e-12
        assert (M_hat.diagonal() >= (1 - eps) / (1 + eps) * M.diagonal() - 1e-12).all()
    if (N > 0).all():
        v_hat = torch.linalg.solve(torch.eye(6, dtype=torch.float64) - mrp.gamma * P_hat, r_hat)
        gap = mrp.gamma * torch.linalg.solve(torch.eye(6, dtype=torch.float64) - mrp.gamma * P_hat, (P_hat - mrp.P) @ mrp.v_pi)
        torch.testing.assert_close(v_hat - mrp.v_pi, gap, rtol=0, atol=1e-10)
        assert sup_error(v_hat, mrp.v_pi) <= floor_bound(P_hat, mrp.P, mrp.v_pi, mrp.gamma) + 1e-12


@pytest.mark.unit
def test_theory_stands_apart_from_experiments():
    "Chapter 5's layering (issue 22): the theory module imports nothing from the experiments, the experiments import no private name from it, and no moved name is re-exported."
    import ast
    import ictd.convergence as theory, ictd.experiments.convergence as experiments
    def imported(mod):
        tree = ast.parse(open(mod.__file__).read())
        return [(n.module or '', a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
    assert not [m for m, _ in imported(theory) if 'experiments' in m]
    assert not [a for m, a in imported(experiments) if m.endswith('convergence') and a.startswith('_')]
    assert not set(experiments.__all__) & set(dir(theory))
