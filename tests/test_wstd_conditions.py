"""Tests of the conditions and limits of chapter 1's reductions (issue 18), on seeds the book does not show.

- Proposition 1 needs positive inner products: the log score is refused on signed features, and no
  single head with rho >= 0 matches linear TD's first step there (Proposition 1a).
- Proposition 1c: two heads (shifted kernel minus a uniform head) give batch linear TD for any features.
- Proposition 1b holds at a fixed horizon only: the gap to centred linear TD grows with T.
- Proposition 5: run long, weighted softmax TD converges to the certainty-equivalence value of the
  context (two heads), or to it minus the constant fixed by the left null vector of B (centred)."""
import os
import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings, strategies as st
from ictd.boyan import random_boyan_chain, sample_trajectory
from ictd.wstd import (weighted_softmax_td, batch_linear_td, two_head_linear_td,
                       certainty_equivalence, context_weights)

SETTINGS = settings(max_examples=int(os.environ.get("ICTD_EXAMPLES", 30)), deadline=None)
seeds = st.integers(0, 2**32 - 1)

def rel_gap(a, b):
    "Largest difference relative to the scale of `b` (at least 1)."
    return ((a - b).abs().max() / b.abs().max().clamp(min=1)).item()

@pytest.mark.unit
@SETTINGS
@given(seed=seeds, n=st.integers(1, 30), d=st.integers(1, 6), q=st.integers(0, 4), gamma=st.floats(0, 0.99),
       step=st.floats(0.01, 1.0))
def test_two_head_linear_td_any_signs(seed, n, d, q, gamma, step):
    "Proposition 1c: the shifted-kernel head minus a uniform head is batch linear TD on U(-1, 1) features, every iterate."
    rng = np.random.default_rng(seed)
    phi, R, Q = rng.uniform(-1, 1, (n + 1, d)), rng.uniform(-1, 1, n), rng.uniform(-1, 1, (q, d))
    two = two_head_linear_td(phi, R, alpha=step / d, gamma=gamma, n_iters=60, phi_queries=Q, return_all=True)
    lin = batch_linear_td(phi, R, alpha=step / d, gamma=gamma, n_iters=60, phi_queries=Q, return_all=True)
    assert rel_gap(two, lin) < 1e-12

@pytest.mark.unit
def test_log_score_refused_on_signed_features():
    "Proposition 1's score log(phi^T phi) is undefined when an inner product is negative: an error, not NaN values."
    chain = random_boyan_chain(seed=123)
    S, R = sample_trajectory(chain, n=25, seed=123)
    phi = chain.phi[S]
    assert ((phi[:-1] @ phi.T) < 0).any()
    with pytest.raises(ValueError, match="NaN or"):
        weighted_softmax_td(phi, R, None, alpha=0.1, gamma=0.9, n_iters=3, score=lambda k, x: torch.log(k @ x.mT),
                            rho=lambda k, x: (k @ x.mT).mean(-2))

@pytest.mark.unit
@SETTINGS
@given(seed=seeds, n=st.integers(2, 20), d=st.integers(1, 5))
def test_no_single_head_matches_linear_td_on_a_negative_pair(seed, n, d):
    "Proposition 1a: with R = e_j and phi(S_{j-1})^T phi(x) < 0, linear TD's first value at x is negative, any softmax head's with rho >= 0 is not."
    rng = np.random.default_rng(seed)
    phi = rng.uniform(-1, 1, (n + 1, d))
    G = phi[:-1] @ phi.T
    assume((G < -1e-3).any())
    j, x = map(int, np.argwhere(G < -1e-3)[0])
    R = np.eye(n)[j]
    lin = batch_linear_td(phi, R, alpha=0.3, gamma=0.9, n_iters=1)[x].item()
    score = torch.from_numpy(rng.normal(scale=3, size=(n, n + 1)))
    rho = torch.from_numpy(rng.uniform(0, 5, n + 1))
    soft = weighted_softmax_td(phi, R, None, alpha=0.3, gamma=0.9, n_iters=1, score=lambda k, X: score, rho=rho)[x].item()
    assert lin < 0 <= soft

def boyan_context(seed, n=20, n_states=10):
    chain = random_boyan_chain(n_states=n_states, features="unit", seed=seed)
    S, R = sample_trajectory(chain, n=n, seed=seed)
    return S, chain.phi[S], R, chain.phi

@pytest.mark.unit
@pytest.mark.parametrize("seed", [4, 6])
def test_small_score_gap_grows_with_horizon(seed):
    "Proposition 1b is fixed-horizon: at eps = 0.03 the gap to centred linear TD at T = 20000 is > 30x the gap at T = 10."
    _, phi, R, Q = boyan_context(seed)
    W = 0.03 * torch.eye(4, dtype=torch.float64)
    soft = weighted_softmax_td(phi, R, W, alpha=0.5, gamma=0.9, n_iters=20_000, phi_queries=Q, return_all=True, centred=True)[[10, 20_000]]
    lin = batch_linear_td(phi, R, alpha=0.5, gamma=0.9, n_iters=20_000, phi_queries=Q, return_all=True, C=W, centred=True)[[10, 20_000]]
    gap = (soft - lin).abs().amax(-1)
    assert gap[0] < 1e-3 and gap[1] > 30 * gap[0], gap

def prop5_limit(S, R, phi, W, gamma, centred, n_states=10):
    "Proposition 5's limit at the trajectory states (CE value, minus kappa when centred) and the singular values of B."
    S = np.asarray(S)
    U, n = np.unique(S[:-1]), len(S) - 1
    K = context_weights(phi, W).numpy()
    key = [int(np.nonzero(S[:-1] == y)[0][0]) for y in U]
    col = [int(np.nonzero(S == x)[0][0]) for x in U]
    N = np.array([(S[:-1] == y).sum() for y in U])
    B = N[None, :] * (K[np.ix_(key, col)].T - centred / n)
    ce = certainty_equivalence(S, R, n_states, gamma=gamma).numpy()[U]
    if centred:
        ell = np.linalg.svd(B)[0][:, -1]
        ce = ce - ell @ ce / ell.sum()
    return ce[np.searchsorted(U, S)], np.linalg.svd(B, compute_uv=False)

@pytest.mark.unit
@pytest.mark.parametrize("centred", [False, True])
@pytest.mark.parametrize("seed", [4, 6, 8, 9])
def test_long_run_limit_is_certainty_equivalence(seed, centred):
    "Proposition 5 at scores of order 1 (W = 2I): the iterate after 4000 steps is the CE value (shifted by kappa when centred), not linear TD's."
    S, phi, R, _ = boyan_context(seed)
    assert set(S.tolist()) <= set(S[:-1].tolist())
    W = 2 * torch.eye(4, dtype=torch.float64)
    lim, sv = prop5_limit(S, R, phi, W, 0.9, centred)
    assert sv[-2 if centred else -1] > 1e-6
    v = weighted_softmax_td(phi, R, W, alpha=0.5, gamma=0.9, n_iters=4000, centred=centred).numpy()
    assert np.abs(v - lim).max() < 1e-8, np.abs(v - lim).max()
    lin = batch_linear_td(phi, R, alpha=0.5, gamma=0.9, n_iters=4000).numpy()
    assert np.abs(lin - lim).max() > 1e-2
