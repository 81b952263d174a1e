"""Tests of chapter 5's threshold, slow-mixing and finite-n results (Propositions 5.4, 5.6, 5.7, Lemma 5.1), on inputs the book
does not show."""
import math
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from ictd.boyan import random_boyan_chain, sample_trajectory
from ictd.convergence import (circulant_limit, circulant_pair, circulant_threshold, empirical_mrp, fixed_point, floor_hp_bound,
                              hitting_times, kernel_attention, missing_state_bound, relaxation_time, spectral_radius)
from ictd.experiments.worst_cases import check_certificate, diagonality_threshold, load_threshold_certificates, worst_case_pair

seeds = st.integers(0, 2**32 - 1)

def unit_property(n_examples, **strategies):
    "A fast hypothesis test: the `unit` marker, `n_examples` draws from `strategies`, no deadline."
    return lambda f: pytest.mark.unit(settings(max_examples=n_examples, deadline=None)(given(**strategies)(f)))

@unit_property(40, m=st.floats(0., 1.), s=st.integers(2, 9), a=st.integers(0, 8), b=st.integers(1, 8), gamma=st.floats(0., 0.99), alpha=st.floats(0.05, 1.))
def test_circulant_spectrum(m, s, a, b, gamma, alpha):
    "Proposition 5.7 item 1: the spectrum of B for a circulant pair is the set of Fourier multipliers (a wrong formula fails)."
    if math.gcd(b, s) != 1: return
    M, P = circulant_pair(m, s, a, b)
    w = np.exp(2j * np.pi * np.arange(s) / s)
    predicted = np.abs(1 - alpha * (m + (1 - m) * w ** a) * (1 - gamma * w ** b)).max()
    assert abs(spectral_radius(M, P, gamma=gamma, alpha=alpha).item() - predicted) < 1e-10

@unit_property(60, seed=seeds, gamma=st.floats(0., 0.99), alpha=st.floats(0.01, 1.))
def test_two_states_converge_above_one_half(seed, gamma, alpha):
    "Proposition 5.7 item 3: with two states, both diagonal entries above 1/2 imply spr(B) < 1, for every P."
    rng = np.random.default_rng(seed)
    a, b = rng.uniform(0.5 + 1e-6, 1, 2)
    p, q = rng.uniform(1e-6, 1, 2)
    M = torch.tensor([[a, 1 - a], [1 - b, b]], dtype=torch.float64)
    P = torch.tensor([[1 - p, p], [q, 1 - q]], dtype=torch.float64)
    assert spectral_radius(M, P, gamma=gamma, alpha=alpha) < 1

@pytest.mark.unit
def test_certificates_and_threshold():
    "Every stored certificate diverges; the certified threshold is monotone in s and alpha, 1/2 at two states, below (1 + gamma)/2."
    records = load_threshold_certificates()["records"]
    assert len(records) >= 40
    for r in records: assert check_certificate(r) >= 1
    for g in (0.5, 0.9, 0.99):
        for a in (0.25, 0.5, 1.):
            row = [diagonality_threshold(g, a, s) for s in range(2, 9)]
            assert row[0] == 0.5 and row == sorted(row) and row[-1] < (1 + g) / 2
            if a > 0.25: assert all(x >= y for x, y in zip(row, [diagonality_threshold(g, a / 2, s) for s in range(2, 9)]))
    assert diagonality_threshold(0.9, 1., 8) > 0.8                         # "self-attention dominates" is far from enough

@pytest.mark.unit
@pytest.mark.parametrize("gamma,alpha,s", [(0.9, 1., 4), (0.99, 0.5, 6), (0.5, 1., 5)])
def test_worst_case_pair_diverges_below_threshold(gamma, alpha, s):
    "The API contract: just below the certified threshold, worst_case_pair returns a valid pair that does not converge."
    m = circulant_threshold(gamma, alpha, s)["m"] - 2e-3
    M, P = worst_case_pair(m, gamma, alpha, s, seed=11, n_starts=2)
    assert M.dtype == P.dtype == torch.float64 and (M > 0).all() and (P > 0).all() and M.diagonal().min() >= m - 1e-12
    torch.testing.assert_close(M.sum(1), torch.ones(s, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(P.sum(1), torch.ones(s, dtype=torch.float64), rtol=0, atol=1e-12)
    assert spectral_radius(M, P, gamma=gamma, alpha=alpha) >= 1

@pytest.mark.unit
def test_circulant_limit_closed_form():
    "Proposition 5.7 item 4: the small-step limit 1 / (1 + sqrt(1 - gamma^2)) is reached by the circulant limit as alpha -> 0."
    for g in (0.5, 0.9):
        assert abs(circulant_limit(g, 1e-4) - 1 / (1 + math.sqrt(1 - g ** 2))) < 1e-3

@unit_property(60, seed=seeds, s=st.integers(2, 7), eps=st.floats(0.01, 0.9))
def test_lemma1_tight_bounds(seed, s, eps):
    "Lemma 5.1 (tightened): row error <= 2 eps / (1 + sqrt(1 - eps^2)) and the diagonal bound, for any kernel and counts within eps."
    rng = np.random.default_rng(seed)
    phi, W = rng.normal(size=(s, 3)), 3 * rng.normal(size=(3, 3))
    d = rng.dirichlet(np.ones(s))
    w = d * (1 + rng.choice([-1, 1], s) * eps * rng.uniform(0.5, 1, s))
    M, Mh = kernel_attention(phi, W, d), kernel_attention(phi, W, w)
    e = np.abs(w / d - 1).max()
    assert ((Mh - M).abs().sum(1) <= 2 * e / (1 + math.sqrt(1 - e ** 2)) + 1e-12).all()
    assert (Mh.diagonal() >= (1 - e) / (1 + e * (1 - 2 * M.diagonal())) * M.diagonal() - 1e-12).all()

@pytest.mark.unit
@pytest.mark.parametrize("seed", [21, 22, 23])
def test_lazy_chain_limit(seed):
    "Proposition 5.6: on a lazy chain the rate tends to 1 - alpha (1 - gamma) mu_min(M), above kappa_tab."
    mrp = random_boyan_chain(features="unit", seed=seed)
    M = kernel_attention(mrp.phi, 8 * torch.eye(mrp.d, dtype=torch.float64), mrp.d_pi)
    limit = 1 - 0.1 * torch.linalg.eigvals(M).real.min()
    P = (1 - 1e-6) * torch.eye(10, dtype=torch.float64) + 1e-6 * mrp.P
    assert abs(spectral_radius(M, P, gamma=0.9, alpha=1.) - limit) < 1e-4 and limit > 0.9 + 1e-4
    assert relaxation_time(P) > 1e5

@pytest.mark.unit
def test_hitting_times_against_simulation():
    "E_y[tau_x] from `hitting_times` matches a Monte Carlo estimate."
    mrp = random_boyan_chain(n_states=5, features="onehot", seed=31)
    H = hitting_times(mrp.P)
    rng, P = np.random.default_rng(0), mrp.P.numpy()
    times = []
    for _ in range(4000):
        x, t = 0, 0
        while x != 4: x, t = rng.choice(5, p=P[x]), t + 1
        times.append(t)
    assert abs(np.mean(times) - H[0, 4].item()) < 4 * np.std(times) / math.sqrt(len(times))

@pytest.mark.claims
def test_high_probability_floor_bounds_hold():
    "Proposition 5.4 items 1 and 3: over 300 contexts (seeds the book does not use) the failure rates stay within p_fail (`delta`) and the missing-state bound."
    from ictd.tasks import random_tasks, sample_trajectories
    tb = random_tasks(300, seed=9100, features="onehot")
    n = 150
    S = sample_trajectories(tb.P, tb.d_pi, n=n, seed=9100)
    N, P_hat, r_hat = empirical_mrp(S, tb.r.gather(1, S[:, :-1]), 10)
    keys = (N > 0).all(-1)
    v_fix = fixed_point(kernel_attention(tb.phi, 15 * torch.eye(10, dtype=torch.float64), N), P_hat, r_hat, tb.gamma, N)
    floor = (v_fix - tb.v_pi).abs().amax(-1)
    bound = floor_hp_bound(N.amin(-1), tb.v_pi, tb.gamma, n, delta=0.05)
    assert (floor[keys] > bound[keys]).double().mean() <= 0.05
    assert (1 - keys.double().mean()) <= missing_state_bound(tb.P, n).mean() + 0.05


@pytest.mark.unit
def test_threshold_without_certificates_says_so(monkeypatch, tmp_path):
    "Without the certificate file (an installed package) the threshold falls back to the circulant bound, with a warning, not silently."
    import ictd.experiments.worst_cases as conv
    monkeypatch.setattr(conv, "THRESHOLD_FILE", tmp_path / "missing.json")
    with pytest.warns(UserWarning, match="no certificate file"): m = conv.diagonality_threshold(0.9, 1., 3)
    assert m == conv.circulant_threshold(0.9, 1., 3)["m"]
