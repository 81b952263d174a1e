"""Property tests of `ictd.wstd` (chapter 1) over hypothesis-drawn contexts.

The chapter checks each claim on seeded instances; these tests let hypothesis search for a
counterexample: the exact linear-TD reduction, the fixed point of the tabular case at every beta > 0,
the structure of the iteration (queries, batches, softmax shift invariance) and the classical
algorithms' own properties."""
import os
import numpy as np
import torch
from hypothesis import given, settings, strategies as st
from ictd.wstd import (weighted_softmax_td, batch_linear_td, batch_tabular_td, certainty_equivalence,
                       context_weights)

SETTINGS = settings(max_examples=int(os.environ.get("ICTD_EXAMPLES", 40)), deadline=None)   # ICTD_EXAMPLES=500 searches harder
seeds, gammas = st.integers(0, 2**32 - 1), st.floats(0, 0.99)

def rel_gap(a, b):
    "Largest difference relative to the scale of `b` (at least 1)."
    return ((a - b).abs().max() / b.abs().max().clamp(min=1)).item()

@SETTINGS
@given(seed=seeds, n=st.integers(1, 30), d=st.integers(1, 6), q=st.integers(0, 4), gamma=gammas,
       step=st.floats(0.01, 1.0), n_iters=st.integers(50, 80))
def test_linear_td_reduction(seed, n, d, q, gamma, step, n_iters):
    "log(phi^T phi) scores with rho = mean key similarity give batch linear TD at every iterate."
    rng = np.random.default_rng(seed)
    phi, R, Q = rng.uniform(0.1, 1, (n + 1, d)), rng.uniform(-1, 1, n), rng.uniform(0.1, 1, (q, d))
    alpha = step / d
    soft = weighted_softmax_td(phi, R, None, alpha=alpha, gamma=gamma, n_iters=n_iters, phi_queries=Q, return_all=True,
                               score=lambda k, x: torch.log(k @ x.mT), rho=lambda k, x: (k @ x.mT).mean(-2))
    lin = batch_linear_td(phi, R, alpha=alpha, gamma=gamma, n_iters=n_iters, phi_queries=Q, return_all=True)
    assert rel_gap(soft, lin) < 1e-12

def visiting_context(rng, n_states, n):
    "Random state sequence whose last state also starts a transition, and rewards."
    S = rng.integers(0, n_states, n + 1)
    S[-1] = S[rng.integers(0, n)]
    return torch.from_numpy(S), torch.from_numpy(rng.uniform(-1, 1, n))

@SETTINGS
@given(seed=seeds, n_states=st.integers(1, 8), n=st.integers(1, 40), gamma=gammas, beta=st.floats(0.05, 50))
def test_tabular_fixed_point_any_beta(seed, n_states, n, gamma, beta):
    "With scores beta 1[x=y], beta > 0, the certainty-equivalence value zeroes every target's weighted TD error."
    S, R = visiting_context(np.random.default_rng(seed), n_states, n)
    v = certainty_equivalence(S, R, n_states, gamma=gamma)[S]
    delta = R + gamma * v[1:] - v[:-1]
    K = context_weights(torch.eye(n_states, dtype=torch.float64)[S], beta * torch.eye(n_states, dtype=torch.float64))
    assert (delta @ K).abs().max() < 1e-12 * max(1., v.abs().max().item())

@SETTINGS
@given(seed=seeds, n_states=st.integers(1, 8), n=st.integers(1, 40), gamma=gammas)
def test_certainty_equivalence_is_empirical_bellman(seed, n_states, n, gamma):
    "The mean TD error of the transitions leaving each state vanishes; states never left have value 0."
    rng = np.random.default_rng(seed)
    S, R = torch.from_numpy(rng.integers(0, n_states, n + 1)), torch.from_numpy(rng.uniform(-1, 1, n))
    v = certainty_equivalence(S, R, n_states, gamma=gamma)
    delta = R + gamma * v[S[1:]] - v[S[:-1]]
    for x in range(n_states):
        leaving = S[:-1] == x
        if leaving.any(): assert abs(delta[leaving].mean().item()) < 1e-12 * max(1., v.abs().max().item())
        else: assert v[x] == 0

@SETTINGS
@given(seed=seeds, n_states=st.integers(1, 8), n=st.integers(1, 40), gamma=st.floats(0, 0.9), alpha=st.floats(0.1, 1))
def test_tabular_td_contracts_to_certainty_equivalence(seed, n_states, n, gamma, alpha):
    "Batch tabular TD's max-norm error to the CE value shrinks by at least 1 - alpha (1 - gamma) per iteration."
    rng = np.random.default_rng(seed)
    S, R = torch.from_numpy(rng.integers(0, n_states, n + 1)), torch.from_numpy(rng.uniform(-1, 1, n))
    err = (batch_tabular_td(S, R, n_states, alpha=alpha, gamma=gamma, n_iters=40, return_all=True) - certainty_equivalence(S, R, n_states, gamma=gamma)).abs().amax(-1)
    assert (err[1:] <= (1 - alpha * (1 - gamma)) * err[:-1] + 1e-13).all()

def random_context(rng, n, d, q):
    return rng.uniform(-1, 1, (n + 1, d)), rng.uniform(-1, 1, n), rng.uniform(-1, 1, (q, d)), 0.5 * rng.standard_normal((d, d))

@SETTINGS
@given(seed=seeds, n=st.integers(1, 15), d=st.integers(1, 4), q=st.integers(1, 4), gamma=gammas)
def test_queries_are_targets_only(seed, n, d, q, gamma):
    "Appending or permuting queries changes neither the trajectory values nor any query's value."
    rng = np.random.default_rng(seed)
    phi, R, Q, W = random_context(rng, n, d, q)
    base = weighted_softmax_td(phi, R, W, alpha=0.3, gamma=gamma, n_iters=10)
    full = weighted_softmax_td(phi, R, W, alpha=0.3, gamma=gamma, n_iters=10, phi_queries=Q)
    perm = rng.permutation(q)
    shuffled = weighted_softmax_td(phi, R, W, alpha=0.3, gamma=gamma, n_iters=10, phi_queries=Q[perm])
    assert rel_gap(full[:n + 1], base) < 1e-13
    assert rel_gap(shuffled[n + 1:], full[n + 1:][perm]) < 1e-13

@SETTINGS
@given(seed=seeds, B=st.integers(1, 5), n=st.integers(1, 12), d=st.integers(1, 4), q=st.integers(0, 3), gamma=gammas)
def test_batch_equals_loop(seed, B, n, d, q, gamma):
    "A batched call equals the loop of single calls, for weighted softmax TD and both classical algorithms."
    rng = np.random.default_rng(seed)
    phis, Rs, Qs, Ws = (np.stack(a) for a in zip(*[random_context(rng, n, d, q) for _ in range(B)]))
    S = rng.integers(0, 5, (B, n + 1))
    out = weighted_softmax_td(phis, Rs, Ws, alpha=0.3, gamma=gamma, n_iters=8, phi_queries=Qs, return_all=True)
    lin = batch_linear_td(phis, Rs, alpha=0.1, gamma=gamma, n_iters=8, phi_queries=Qs)
    tab = batch_tabular_td(S, Rs, 5, alpha=0.5, gamma=gamma, n_iters=8)
    for b in range(B):
        assert rel_gap(out[b], weighted_softmax_td(phis[b], Rs[b], Ws[b], alpha=0.3, gamma=gamma, n_iters=8, phi_queries=Qs[b], return_all=True)) < 1e-13
        assert rel_gap(lin[b], batch_linear_td(phis[b], Rs[b], alpha=0.1, gamma=gamma, n_iters=8, phi_queries=Qs[b])) < 1e-13
        assert rel_gap(tab[b], batch_tabular_td(S[b], Rs[b], 5, alpha=0.5, gamma=gamma, n_iters=8)) < 1e-13

@SETTINGS
@given(seed=seeds, n=st.integers(1, 15), d=st.integers(1, 4), shift=st.floats(-1e3, 1e3))
def test_score_callable_and_shift_invariance(seed, n, d, shift):
    "A `score` callable equal to phi^T W phi reproduces the W path; adding a per-target constant to the scores changes nothing."
    rng = np.random.default_rng(seed)
    phi, R, Q, W = random_context(rng, n, d, 2)
    Wt = torch.from_numpy(W)
    ref = weighted_softmax_td(phi, R, W, alpha=0.3, gamma=0.9, n_iters=10, phi_queries=Q)
    same = weighted_softmax_td(phi, R, None, alpha=0.3, gamma=0.9, n_iters=10, phi_queries=Q, score=lambda k, x: k @ Wt @ x.mT)
    shifted = weighted_softmax_td(phi, R, None, alpha=0.3, gamma=0.9, n_iters=10, phi_queries=Q, score=lambda k, x: k @ Wt @ x.mT + shift * x[..., 0])
    assert rel_gap(same, ref) < 1e-13
    assert rel_gap(shifted, ref) < 1e-9

@SETTINGS
@given(seed=seeds, n=st.integers(1, 15), d=st.integers(1, 4), scale=st.floats(1e3, 1e5))
def test_huge_scores_stay_finite(seed, n, d, scale):
    "Scores of order 1e3..1e5 give finite values in float32 and float64."
    rng = np.random.default_rng(seed)
    phi, R, Q, W = random_context(rng, n, d, 2)
    for dt in (torch.float32, torch.float64):
        v = weighted_softmax_td(torch.tensor(phi, dtype=dt), R, scale * W, alpha=0.3, gamma=0.9, n_iters=10, phi_queries=Q)
        assert v.dtype == dt and torch.isfinite(v).all()

@SETTINGS
@given(seed=seeds, n=st.integers(2, 30), d=st.integers(1, 5), eps=st.floats(1e-4, 1.))
def test_small_score_remainder_bound(seed, n, d, eps):
    "Proposition 1b: |sum K delta - mean delta - first-order term| <= eps^2 range(g)^2 range(delta) / 8 at every target."
    rng = np.random.default_rng(seed)
    phi, W, delta = rng.standard_normal((n + 1, d)), rng.standard_normal((d, d)), torch.from_numpy(rng.standard_normal(n))
    K = context_weights(phi, eps * W)
    g = torch.from_numpy(phi[:-1] @ W @ phi.T)
    first = delta.mean() + eps * ((g - g.mean(0)) * delta[:, None]).mean(0)
    bound = eps ** 2 * (g.amax(0) - g.amin(0)) ** 2 / 8 * (delta.max() - delta.min())
    assert ((delta @ K - first).abs() <= bound * (1 + 1e-9) + 1e-14).all()

@SETTINGS
@given(seed=seeds, n=st.integers(2, 20), d=st.integers(1, 4), q=st.integers(0, 3), gamma=gammas)
def test_centred_wstd_is_linear_to_first_order(seed, n, d, q, gamma):
    "Halving eps divides the gap between centred softmax TD (eps W) and centred linear TD (C = eps W^T) by at least about 4 (O(eps^2); a first-order error would give 2)."
    rng = np.random.default_rng(seed)
    phi, R, Q, W = random_context(rng, n, d, q)
    gap = lambda eps: (weighted_softmax_td(phi, R, eps * W, alpha=0.5, gamma=gamma, n_iters=5, phi_queries=Q, return_all=True, centred=True)
                       - batch_linear_td(phi, R, alpha=0.5, gamma=gamma, n_iters=5, phi_queries=Q, return_all=True, C=eps * W.T, centred=True)).abs().max().item()
    g1, g2 = gap(2e-3), gap(1e-3)
    assert g2 <= 1e-13 or g1 / g2 > 3.3, (g1, g2)

@SETTINGS
@given(seed=seeds, n_states=st.integers(1, 8), n=st.integers(1, 40), gamma=gammas, beta=st.floats(0.05, 30))
def test_tabular_fixed_point_unique_on_state_consistent_vectors(seed, n_states, n, gamma, beta):
    "Proposition 3: over functions of the state the fixed-point equations are nonsingular and solved by the CE value."
    S, R = visiting_context(np.random.default_rng(seed), n_states, n)
    I = torch.eye(n_states, dtype=torch.float64)
    K = context_weights(I[S], beta * I)
    D = torch.zeros(n, n + 1, dtype=torch.float64)
    D[range(n), range(n)], D[range(n), range(1, n + 1)] = -1., gamma
    states = torch.unique(S)
    E = (S[:, None] == states[None]).double()
    first = torch.tensor([int(torch.nonzero(S == x)[0]) for x in states])
    M, b = (K.T @ D @ E)[first], (-K.T @ R)[first]
    assert torch.linalg.matrix_rank(M) == len(states)
    v = certainty_equivalence(S, R, n_states, gamma=gamma)[states]
    assert (torch.linalg.solve(M, b) - v).abs().max() < 1e-9 * max(1., v.abs().max().item())
