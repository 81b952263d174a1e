"""The small definitions that issue 22's cell split put on their own (chapters 0, 7b, 7c), checked on parameters the
chapters do not show: the Gaussian operator is the expectation it claims to be, W_beta's score is the Gaussian kernel's
exponent, the Hermite basis of the AR(1) family and of `basis` is orthonormal, and a Boyan chain's rows are distributions
on the documented support."""
import math
import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st
from ictd.boyan import boyan_transitions, msve, random_boyan_chain, transitions_from_uniforms, weighted_error
from ictd.continuous import HERMITE, GaussianAR1, gaussian_moment, gaussian_operator, polyval
import ictd.experiments.continuous_sweeps  # noqa: F401  (patches `basis` onto the processes)

pytestmark = pytest.mark.unit
f64 = dict(dtype=torch.float64)

@given(st.floats(-1.5, 1.5), st.floats(0., 2.), st.integers(0, 6), st.integers(0, 2 ** 31 - 1))
def test_gaussian_operator_is_the_expectation_of_a_polynomial(c, tau, degree, seed):
    "E[f(c s + tau xi)] by 30-node Gauss-Hermite quadrature (exact to degree 59) against the operator's coefficients."
    w = torch.from_numpy(np.random.default_rng(seed).standard_normal(degree + 1))
    s = torch.linspace(-2, 2, 7, **f64)
    nodes, hw = np.polynomial.hermite_e.hermegauss(30)
    quad = (polyval(w, c * s[:, None] + tau * torch.from_numpy(nodes)) * torch.from_numpy(hw / hw.sum())).sum(1)
    torch.testing.assert_close(polyval(gaussian_operator(c, tau, degree) @ w, s), quad, rtol=1e-10, atol=1e-10)

def test_gaussian_moments_are_the_double_factorials():
    xi = np.polynomial.hermite_e.hermegauss(20)
    for p in range(12): assert math.isclose(gaussian_moment(p), (xi[0] ** p * xi[1]).sum() / xi[1].sum(), rel_tol=1e-12, abs_tol=1e-12)

@given(st.floats(0.01, 50.), st.floats(0.3, 3.), st.floats(-0.95, 0.95))
def test_ar1_score_matrix_is_the_gaussian_kernel_exponent(beta, sigma, a):
    proc, y, x = GaussianAR1(a=a, sigma=sigma), torch.linspace(-3, 3, 5, **f64), torch.linspace(-2.5, 4, 6, **f64)
    torch.testing.assert_close(proc.features(y) @ proc.score_matrix(beta) @ proc.features(x).T, -beta / 2 * (x[None] - y[:, None]) ** 2, rtol=1e-10, atol=1e-9)

def test_hermite_bases_are_orthonormal_under_the_stationary_law():
    nodes, hw = np.polynomial.hermite_e.hermegauss(16)
    w = torch.from_numpy(hw / hw.sum())
    H = HERMITE @ torch.from_numpy(nodes) ** torch.arange(4., dtype=torch.float64)[:, None]
    torch.testing.assert_close((H * w) @ H.T, torch.eye(4, **f64), rtol=0, atol=1e-12)
    proc = GaussianAR1(a=0.3, sigma=1.7)
    B = proc.basis(torch.from_numpy(nodes) * proc.std, 6)
    torch.testing.assert_close(B.mT @ (w[:, None] * B), torch.eye(7, **f64), rtol=0, atol=1e-10)

@given(st.integers(3, 12), st.integers(0, 2 ** 31 - 1))
def test_boyan_rows_are_distributions_on_the_documented_support(s, seed):
    P = boyan_transitions(s, np.random.default_rng(seed))
    np.testing.assert_allclose(P.sum(1), 1, rtol=0, atol=1e-14)
    i = np.arange(s - 2)
    assert (P[i, i + 1] >= 0.01).all() and (P[i, i + 1] <= 0.99).all()
    np.testing.assert_array_equal(P[i, i + 1] + P[i, i + 2], 1)
    mask = np.zeros((s, s), bool); mask[i, i + 1] = mask[i, i + 2] = mask[s - 2, s - 1] = True; mask[s - 1] = True
    assert (P[~mask] == 0).all() and (P[s - 1] > 0).all()
    np.testing.assert_array_equal(P, transitions_from_uniforms(np.random.default_rng(seed).random(2 * s - 2), s))

def test_msve_is_the_d_pi_weighted_error_of_each_estimate():
    mrp = random_boyan_chain(7, 3, seed=np.random.default_rng(123))
    v = torch.from_numpy(np.random.default_rng(5).standard_normal((4, 7)))
    torch.testing.assert_close(msve(v, mrp), torch.stack([weighted_error(x, mrp.v_pi, mrp.d_pi) for x in v]), rtol=0, atol=0)
    assert math.isclose(msve(v[0], mrp), float(((v[0] - mrp.v_pi) ** 2 * mrp.d_pi).sum()), rel_tol=1e-14)
