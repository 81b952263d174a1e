"""Claims of the control pages (9, 9a, 9b, 9c), on MDPs and seeds the book does not show."""

import math
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from ictd.boyan import boyan_transitions
from ictd.control import (
    MDP,
    MDP_FEATURES,
    batch_tabular_q,
    boltzmann_backup,
    check_policy,
    context_features,
    greedy_policy,
    kernel_q_iteration,
    normalised_return,
    policy_return,
    q_pi,
    q_star,
    random_mdp,
    sample_mdp_trajectory,
    stationary_distribution,
    uniform_policy,
)
from ictd.control_model import ControlICTD, build_control_prompt, control_theta_star
from ictd.linear import linear_attention
from ictd.wstd import weighted_softmax_td

torch.set_num_threads(1)
F64 = torch.float64


def _context(seed, S=None, A=None, features=None, n=None):
    "A random MDP and context drawn from one seed (sizes drawn too unless given)."
    rng = np.random.default_rng(seed)
    S = S or int(rng.integers(2, 7))
    A = A or int(rng.integers(1, 4))
    features = features or MDP_FEATURES[int(rng.integers(0, 3))]
    m = random_mdp(
        S,
        A,
        features=features,
        seed=rng,
        d=None if features == "onehot" else int(rng.integers(1, 6)),
    )
    St, At, Rt = sample_mdp_trajectory(m, n or int(rng.integers(1, 30)), seed=rng)
    W = torch.from_numpy(rng.normal(scale=2 / np.sqrt(m.d), size=(m.d, m.d)))
    return m, St, At, Rt, W, rng


# ---------------------------------------------------------------- MDPs


@pytest.mark.unit
@settings(max_examples=25)
@given(
    seed=st.integers(1000, 10**6),
    S=st.integers(2, 8),
    A=st.integers(1, 4),
    gamma=st.floats(0.0, 0.95),
)
def test_q_star_is_optimal(seed, S, A, gamma):
    m = random_mdp(S, A, gamma=gamma, seed=seed)
    qs = q_star(m)
    torch.testing.assert_close(m.r + m.gamma * m.P @ qs.amax(-1), qs, atol=1e-11, rtol=0)
    torch.testing.assert_close(q_pi(m, greedy_policy(qs)), qs, atol=1e-10, rtol=0)
    pi = torch.softmax(
        torch.randn(S, A, generator=torch.Generator().manual_seed(seed), dtype=F64), -1
    )
    assert (q_pi(m, pi) <= qs + 1e-10).all()
    assert policy_return(m, pi) <= policy_return(m, greedy_policy(qs)) + 1e-10


@pytest.mark.unit
@settings(max_examples=20)
@given(seed=st.integers(1000, 10**6), S=st.integers(2, 9), A=st.integers(1, 4))
def test_family_shares_mdp_and_generalises_boyan(seed, S, A):
    kinds = [random_mdp(S, A, features=f, seed=seed) for f in MDP_FEATURES]
    for k in kinds[1:]:
        assert torch.equal(k.P, kinds[0].P) and torch.equal(k.r, kinds[0].r)
    assert np.array_equal(
        random_mdp(S, 1, seed=seed).P[:, 0].numpy(),
        boyan_transitions(S, np.random.default_rng(seed)),
    )
    pi = torch.softmax(
        torch.randn(S, A, generator=torch.Generator().manual_seed(seed), dtype=F64), -1
    )
    d = stationary_distribution(kinds[0], pi)
    assert (d > 0).all()  # every policy's chain is irreducible


@pytest.mark.unit
def test_trajectory_is_stationary_and_uses_behaviour():
    m = random_mdp(6, 2, seed=4242)
    b = torch.tensor([[0.9, 0.1]] * 6, dtype=F64)
    S, A, R = sample_mdp_trajectory(m, 60_000, behavior=b, seed=4242)
    assert torch.equal(R, m.r[S[:-1], A[:-1]])
    batches = torch.nn.functional.one_hot(S[:60_000], 6).double().reshape(60, 1000, 6).mean(1)
    z = (batches.mean(0) - stationary_distribution(m, b)).abs() / (batches.std(0) / math.sqrt(60))
    assert (z < 5).all(), z
    share = (A == 0).double().mean().item()
    assert abs(share - 0.9) < 5 * math.sqrt(0.09 / len(A))


@pytest.mark.unit
def test_normalised_return_bounds():
    for seed in range(500, 510):
        m = random_mdp(seed=seed)
        assert abs(normalised_return(m, greedy_policy(q_star(m))) - 1) < 1e-12
        assert abs(normalised_return(m, uniform_policy(m))) < 1e-12


@pytest.mark.unit
def test_bad_input_names_the_argument():
    m = random_mdp(4, 2, seed=1)
    for kw, msg in (
        (dict(n_states=1), "`n_states`"),
        (dict(n_actions=0), "`n_actions`"),
        (dict(features="x"), "`features`"),
        (dict(gamma=1.0), "`gamma`"),
        (dict(d=3), "`d`"),
    ):
        with pytest.raises(ValueError, match=msg):
            random_mdp(**kw)
    with pytest.raises(ValueError, match="`policy`"):
        check_policy(np.ones((4, 2)), m)
    with pytest.raises(ValueError, match="`P`"):
        MDP(np.ones((2, 2, 2)), np.zeros((2, 2)), 0.9, np.zeros((2, 2, 1)))
    with pytest.raises(ValueError, match="`n`"):
        sample_mdp_trajectory(m, 0)
    S, A, R = sample_mdp_trajectory(m, 5, seed=1)
    f, fn = context_features(m, S, A)
    for kw, msg in (
        (dict(alpha=-1.0), "`alpha`"),
        (dict(beta=-0.5), "`beta`"),
        (dict(n_iters=1.5), "`n_iters`"),
    ):
        with pytest.raises(ValueError, match=msg):
            kernel_q_iteration(
                f,
                R,
                fn,
                torch.eye(m.d, dtype=F64),
                **{**dict(alpha=1.0, gamma=0.9, beta=1.0, n_iters=2), **kw},
            )


# ---------------------------------------------------------------- the reductions


@pytest.mark.unit
@settings(max_examples=20)
@given(seed=st.integers(1000, 10**6))
def test_beta_zero_is_expected_sarsa_of_uniform(seed):
    m, S, A, R, W, rng = _context(seed, n=12)
    f, fn = context_features(m, S, A)
    alpha, L = rng.uniform(0.1, 1), 5
    got = kernel_q_iteration(
        f, R, fn, W, alpha=alpha, gamma=m.gamma, beta=0.0, n_iters=L, phi_queries=m.phi[0]
    )
    # an independent loop: expected SARSA with the uniform policy, targets by their features
    X = torch.cat([f, fn.flatten(0, 1), m.phi[0]])
    K = torch.softmax(f @ W @ X.T, 0)
    v = torch.zeros(len(X), dtype=F64)
    n, nA = len(R), fn.shape[0] * fn.shape[1]
    for _ in range(L):
        v = v + alpha * ((R + m.gamma * v[n : n + nA].reshape(n, -1).mean(-1) - v[:n]) @ K)
    torch.testing.assert_close(got, torch.cat([v[:n], v[n + nA :]]), atol=1e-12, rtol=1e-12)


@pytest.mark.unit
@settings(max_examples=20)
@given(seed=st.integers(1000, 10**6), beta=st.sampled_from([0.0, 0.3, 7.0, math.inf]))
def test_sarsa_is_weighted_softmax_td_on_pairs(seed, beta):
    m, S, A, R, W, rng = _context(seed)
    f, fn = context_features(m, S, A)
    n = len(R)
    got = kernel_q_iteration(
        f,
        R,
        fn,
        W,
        alpha=0.5,
        gamma=m.gamma,
        beta=beta,
        n_iters=6,
        phi_queries=m.phi[0],
        next_actions=A[1:],
    )
    ref = weighted_softmax_td(m.phi[S, A], R, W, alpha=0.5, gamma=m.gamma, n_iters=6, phi_queries=m.phi[0])
    torch.testing.assert_close(got, torch.cat([ref[:n], ref[n + 1 :]]), atol=1e-12, rtol=1e-12)


@pytest.mark.unit
@settings(max_examples=15)
@given(seed=st.integers(1000, 10**6))
def test_beta_to_infinity_within_bound(seed):
    m, S, A, R, W, rng = _context(seed, A=3)
    f, fn = context_features(m, S, A)
    alpha, L = float(rng.uniform(0.1, 1)), 6
    kw = dict(alpha=alpha, gamma=m.gamma, n_iters=L, phi_queries=m.phi.flatten(0, 1))
    q_max = kernel_q_iteration(f, R, fn, W, beta=math.inf, **kw)
    lam = 1 + alpha * (1 + m.gamma)
    for beta in (2.0, 50.0, 2000.0):
        gap = (kernel_q_iteration(f, R, fn, W, beta=beta, **kw) - q_max).abs().max().item()
        assert gap <= alpha * m.gamma * math.log(3) / beta * sum(lam**t for t in range(L)) + 1e-12


@pytest.mark.unit
def test_one_hot_sharp_kernel_is_batch_tabular_q():
    rng = np.random.default_rng(777)
    for seed in range(3):
        m = random_mdp(6, 2, seed=1000 + seed)
        while True:
            S, A, R = sample_mdp_trajectory(m, 120, seed=rng)
            if len(set((S[:-1] * 2 + A[:-1]).tolist())) == 12:
                break
        f, fn = context_features(m, S, A)
        for beta in (0.0, 3.0, math.inf):
            tab = batch_tabular_q(S, A, R, 6, 2, alpha=0.7, gamma=m.gamma, beta=beta, n_iters=15)
            ker = kernel_q_iteration(
                f,
                R,
                fn,
                40.0 * torch.eye(12, dtype=F64),
                alpha=0.7,
                gamma=m.gamma,
                beta=beta,
                n_iters=15,
                phi_queries=m.phi.flatten(0, 1),
            )
            assert (ker[120:] - tab.flatten()).abs().max() < 1e-10
            assert (ker[:120] - tab[S[:-1], A[:-1]]).abs().max() < 1e-10


@pytest.mark.unit
@settings(max_examples=40)
@given(
    q=st.lists(st.floats(-5, 5), min_size=1, max_size=6), b1=st.floats(0, 30), b2=st.floats(0, 30)
)
def test_boltzmann_backup_between_mean_and_max_and_monotone(q, b1, b2):
    q = torch.tensor(q, dtype=F64)
    lo, hi = sorted((b1, b2))
    B_lo, B_hi = boltzmann_backup(q, lo).item(), boltzmann_backup(q, hi).item()
    assert (
        q.mean().item() - 1e-12 <= B_lo <= B_hi + 1e-12 <= q.max().item() + 2e-12
    )  # d/dbeta = Var >= 0
    if hi > 0:
        assert q.max().item() - B_hi <= math.log(len(q)) / hi + 1e-12


# ---------------------------------------------------------------- the Transformer


@pytest.mark.unit
@settings(max_examples=15)
@given(seed=st.integers(1000, 10**6), beta=st.sampled_from([0.0, 1.3, 9.0, math.inf]))
def test_theorem_9a1_every_pair_is_one_iteration(seed, beta):
    m, S, A, R, W, rng = _context(seed)
    f, fn = context_features(m, S, A)
    qs = m.phi[torch.from_numpy(rng.integers(0, m.n_states, size=2))]
    alpha = float(rng.uniform(0.1, 1)) * (
        1 + 1e-9 * rng.standard_normal()
    )  # nudged: nothing at an edge
    model = ControlICTD.from_theta_star(m.d, W, n_layers=10, alpha=alpha, gamma=m.gamma, beta=beta)
    Zs = model(build_control_prompt(f, R, fn, qs), return_all=True)[:, m.d + 1]
    ref = kernel_q_iteration(
        f,
        R,
        fn,
        W,
        alpha=alpha,
        gamma=m.gamma,
        beta=beta,
        n_iters=10,
        phi_queries=torch.cat([fn.flatten(0, 1), qs.flatten(0, 1)]),
        return_all=True,
    )
    assert ((Zs - ref).abs().max() / ref.abs().max().clamp(min=1)).item() < 1e-12


@pytest.mark.unit
def test_constructed_model_value_weights_and_shape():
    A_b, V_b, A, Vc, Vt = control_theta_star(3, torch.eye(3, dtype=F64), 0.4, 0.8, 2.0)
    assert (Vc[4, 3], Vt[4, 5], Vc[4, 4]) == (0.4, 0.8 * 0.4, -0.4) and A_b[4, 6] == 2.0
    assert (V_b[:5] == 0).all() and (V_b[6:] == 0).all()


# ---------------------------------------------------------------- linear attention


@pytest.mark.unit
@settings(max_examples=30)
@given(seed=st.integers(0, 10**6), h=st.floats(0.05, 2.0))
def test_linear_attention_is_cubic_so_cannot_take_the_max(seed, h):
    g = torch.Generator().manual_seed(seed)
    D, N = 7, 10
    P, Q, Z = (
        torch.randn(D, D, generator=g, dtype=F64),
        torch.randn(D, D, generator=g, dtype=F64),
        torch.randn(D, N, generator=g, dtype=F64),
    )
    r, c = (
        torch.randint(0, D, (1,), generator=g).item(),
        torch.randint(0, N, (1,), generator=g).item(),
    )

    def out(t):
        Zt = Z.clone()
        Zt[r, c] = t
        return linear_attention(P, Q, Zt, n=6)

    diff = out(-2 * h) - 4 * out(-h) + 6 * out(0.0) - 4 * out(h) + out(2 * h)
    assert diff.abs().max() <= 1e-11 * max(1.0, out(2 * h).abs().max().item())
    qmax = lambda t: max(t, 0.0)
    assert (
        abs(qmax(-2 * h) - 4 * qmax(-h) + 6 * qmax(0.0) - 4 * qmax(h) + qmax(2 * h) + 2 * h) < 1e-12
    )


# ---------------------------------------------------------------- acting (9b) and convergence (9c)

from ictd.control_acting import greedy_returns, pair_token_q_iteration, sample_mdp_trajectories
from ictd.control_convergence import contraction_rate, population_q_map


@pytest.mark.unit
@settings(max_examples=15)
@given(
    seed=st.integers(1000, 10**6), beta=st.sampled_from([0.0, 2.0, math.inf]), sarsa=st.booleans()
)
def test_pair_tokens_equal_the_full_iteration(seed, beta, sarsa):
    m, S, A, R, W, rng = _context(seed)
    f, fn = context_features(m, S, A)
    kw = dict(alpha=0.8, gamma=m.gamma, beta=beta, n_iters=7)
    fast = pair_token_q_iteration(m.phi, S, A, R, W, sarsa=sarsa, **kw)
    full = kernel_q_iteration(
        f, R, fn, W, phi_queries=m.phi.flatten(0, 1), next_actions=A[1:] if sarsa else None, **kw
    )
    torch.testing.assert_close(fast.flatten(), full[len(R) :], atol=1e-12, rtol=1e-12)


@pytest.mark.unit
def test_greedy_returns_match_policy_return():
    for seed in range(300, 310):
        m = random_mdp(seed=seed, rewards="state")
        q = torch.randn(10, 3, generator=torch.Generator().manual_seed(seed), dtype=F64)
        assert (
            abs(greedy_returns(m.P, m.r, m.gamma, q).item() - policy_return(m, greedy_policy(q)))
            < 1e-12
        )


@pytest.mark.unit
@settings(max_examples=30)
@given(seed=st.integers(0, 10**6), which=st.integers(0, 2))
def test_proposition_9c1_contraction(seed, which):
    g = torch.Generator().manual_seed(seed)
    S, A = 2 + seed % 4, 2 + seed % 2
    m = random_mdp(S, A, gamma=0.8, seed=seed)
    diag = 0.92 + 0.08 * torch.rand(S * A, generator=g, dtype=F64)
    off = torch.rand(S * A, S * A, generator=g, dtype=F64) * (1 - torch.eye(S * A, dtype=F64))
    M = torch.diag(diag) + off / off.sum(-1, keepdim=True) * (1 - diag)[:, None]
    mm = M.diagonal().min().item()
    R0 = m.r.abs().max().item() / (2 * mm - 1 - 0.8)
    beta = (0.0, 0.5 * (2 * mm - 1 - 0.8) / (0.8 * R0), math.inf)[which]
    rho, R0_ = contraction_rate(M, m.r, 0.8, beta, 0.7)
    assert rho < 1 and abs(R0_ - R0) < 1e-12
    Q1, Q2 = ((2 * torch.rand(4, S, A, generator=g, dtype=F64) - 1) * R0 for _ in range(2))
    kw = dict(alpha=0.7, gamma=0.8, beta=beta)
    F1, F2 = population_q_map(Q1, M, m.r, m.P, **kw), population_q_map(Q2, M, m.r, m.P, **kw)
    assert ((F1 - F2).abs().amax((-2, -1)) <= rho * (Q1 - Q2).abs().amax((-2, -1)) + 1e-12).all()
    assert F1.abs().max() <= R0 * (1 + 1e-12)


@pytest.mark.unit
def test_example_9c1_oscillates_and_the_cures_converge():
    P = torch.zeros(2, 2, 2, dtype=F64)
    P[0, :, 1] = 1.0
    P[1, 0, 0] = 1.0
    P[1, 1, 1] = 1.0
    r = torch.tensor([[0.5, -0.5], [0.0, -1.0]], dtype=F64) * (1 + 1e-9)  # nudged
    I = torch.eye(4, dtype=F64)

    def last_steps(betas, alphas, n=6000):
        "The last step's size for each (beta, alpha), batched (beta = inf: the max)."
        b, a = (
            torch.tensor(betas, dtype=F64)[:, None],
            torch.tensor(alphas, dtype=F64)[:, None, None],
        )
        Q = torch.zeros(len(betas), 2, 2, dtype=F64)
        for _ in range(n):
            B = torch.where(
                torch.isinf(b),
                Q.amax(-1),
                (torch.softmax(torch.where(torch.isinf(b), 0.0, b)[..., None] * Q, -1) * Q).sum(-1),
            )
            Q, prev = Q + a * (r + 0.99 * (P @ B[:, None, :, None])[..., 0] - Q), Q
        return (Q - prev).abs().amax((-2, -1))

    torch.testing.assert_close(
        population_q_map(torch.ones(2, 2, dtype=F64), I, r, P, alpha=0.5, gamma=0.99, beta=3.5),
        torch.ones(2, 2, dtype=F64)
        + 0.5 * (r + 0.99 * (P @ torch.ones(2, 1, dtype=F64))[..., 0] - 1),
    )
    osc = last_steps([2.5, 3.5], [1.0, 1.0])
    assert (osc > 0.5).all()  # a cycle, not a slow approach
    cured = last_steps([math.inf, 3.5, 0.5, 10.0], [1.0, 0.5, 1.0, 1.0])
    assert (cured < 1e-9).all(), cured


def _unseen_mdps(root, n_mdps, n, kind):
    ss_m, ss_t = np.random.SeedSequence(root).spawn(2)
    mdps = [random_mdp(seed=np.random.default_rng(s), rewards=kind) for s in ss_m.spawn(n_mdps)]
    P, r = torch.stack([m.P for m in mdps]), torch.stack([m.r for m in mdps])
    return mdps, list(sample_mdp_trajectories(P, r, n, seed=int(ss_t.generate_state(1)[0])))


def _transformer_q(phi, S, A, R):
    "The constructed Transformer's in-context Q at the headline setting: one-hot pairs, W = 20 I, alpha 1, beta inf, L = 100."
    return pair_token_q_iteration(phi, S, A, R, 20.0 * torch.eye(30, dtype=F64), alpha=1.0, gamma=0.9, beta=math.inf, n_iters=100)


@pytest.mark.claims
@pytest.mark.parametrize("kind", ["action", "state"])
def test_acting_reaches_0_9_on_unseen_mdps(kind):
    mdps, (S, A, R) = _unseen_mdps(424242 + (kind == "state"), 100, 3200, kind)
    P, r, phi = (torch.stack([getattr(m, k) for m in mdps]) for k in ("P", "r", "phi"))
    Q = _transformer_q(phi, S, A, R)
    J = greedy_returns(P, r, 0.9, Q)
    J_star = greedy_returns(P, r, 0.9, torch.stack([q_star(m) for m in mdps]))
    J_unif = torch.tensor([policy_return(m, uniform_policy(m)) for m in mdps], dtype=F64)
    norm = ((J - J_unif) / (J_star - J_unif)).numpy()
    assert norm.mean() - 1.96 * norm.std(ddof=1) / 10 > 0.9, norm.mean()
    Qs = pair_token_q_iteration(
        phi,
        S,
        A,
        R,
        20.0 * torch.eye(30, dtype=F64),
        alpha=1.0,
        gamma=0.9,
        beta=0.0,
        n_iters=100,
        sarsa=True,
    )
    diff = norm - ((greedy_returns(P, r, 0.9, Qs) - J_unif) / (J_star - J_unif)).numpy()
    assert diff.mean() - 1.96 * diff.std(ddof=1) / 10 > 0  # above SARSA-then-greedy


@pytest.mark.claims
def test_floor_falls_like_a_sample_mean_on_unseen_mdps():
    mdps, (S, A, R) = _unseen_mdps(515151, 60, 3000, "action")
    phi, qs = torch.stack([m.phi for m in mdps]), torch.stack([q_star(m) for m in mdps])
    mu = torch.stack([stationary_distribution(m)[:, None] * uniform_policy(m) for m in mdps])
    floors = []
    for n in (100, 300, 1000, 3000):
        Q = pair_token_q_iteration(
            phi,
            S[:, : n + 1],
            A[:, : n + 1],
            R[:, :n],
            20.0 * torch.eye(30, dtype=F64),
            alpha=1.0,
            gamma=0.9,
            beta=math.inf,
            n_iters=300,
        )
        floors.append(((Q - qs).square() * mu).sum((-2, -1)).sqrt().mean().item())
    slope = np.polyfit(np.log([100, 300, 1000, 3000]), np.log(floors), 1)[0]
    assert -0.7 < slope < -0.3, slope


@pytest.mark.unit
def test_batched_sampler_is_stationary_and_consistent():
    mdps = [random_mdp(5, 2, seed=s) for s in range(700, 703)]
    P, r = torch.stack([m.P for m in mdps]), torch.stack([m.r for m in mdps])
    S, A, R = sample_mdp_trajectories(P, r, 10_000, seed=7)
    for i, m in enumerate(mdps):
        assert torch.equal(R[i], m.r[S[i, :-1], A[i, :-1]])
        assert (m.P[S[i, :-1], A[i, :-1], S[i, 1:]] > 0).all()
        batches = torch.nn.functional.one_hot(S[i, :10_000], 5).double().reshape(20, 500, 5).mean(1)
        z = (batches.mean(0) - stationary_distribution(m)).abs() / (batches.std(0) / math.sqrt(20))
        assert (z < 5).all(), z


@pytest.mark.claims
@pytest.mark.parametrize("kind", ["action", "state"])
def test_softmax_q_learning_beats_tuned_linear_sarsa_on_unseen_mdps(kind):
    mdps, (S, A, R) = _unseen_mdps(616161 + (kind == "state"), 100, 3200, kind)
    P, r, phi = (torch.stack([getattr(m, k) for m in mdps]) for k in ("P", "r", "phi"))
    J_star = greedy_returns(P, r, 0.9, torch.stack([q_star(m) for m in mdps]))
    J_unif = torch.tensor([policy_return(m, uniform_policy(m)) for m in mdps], dtype=F64)
    norm = lambda q: ((greedy_returns(P, r, 0.9, q) - J_unif) / (J_star - J_unif)).numpy()
    Q = _transformer_q(phi, S, A, R)
    x, n = S * 3 + A, R.shape[-1]
    E = torch.nn.functional.one_hot(x[:, :-1], 30).double()
    C = E.mT @ torch.nn.functional.one_hot(x[:, 1:], 30).double()
    r_sum, N = (R[:, None, :] @ E)[:, 0], E.sum(1)
    best = None
    for alpha in (
        1.0,
        2.0,
        4.0,
        8.0,
        16.0,
        32.0,
    ):  # batch linear TD on one-hot pairs, tuned on these MDPs
        w = torch.zeros_like(r_sum)
        for _ in range(100):
            w = w + alpha / n * (r_sum + 0.9 * (C @ w[..., None])[..., 0] - N * w)
        score = norm(w.unflatten(-1, (10, 3)))
        if best is None or score.mean() > best.mean():
            best = score
    diff = norm(Q) - best
    assert diff.mean() - 1.96 * diff.std(ddof=1) / 10 > 0, (diff.mean(), diff.std())


# ---------------------------------------------------------------- the O(N)-memory path (issue 33)

import subprocess, sys
import ictd.core as core
from ictd.control_model import ControlPrompt, control_masks, masked_attention, streamed_pair_update
from ictd.experiments.control_pretraining import ControlPretrainConfig, example_prompts, sample_contexts, mdp_pool


def _training_prompts(seed, B=6):
    "A batch of chapter 9d's training prompts (4 states, 2 actions, n = 20, two query blocks), from a seed the book does not use."
    cfg = ControlPretrainConfig()
    pool = mdp_pool(cfg, 4, seed)
    g = torch.Generator().manual_seed(seed)
    st_, ac, rw = sample_contexts(pool, torch.randint(0, 4, (B,), generator=g), torch.rand(B, cfg.n + 2, 2, generator=g, dtype=F64))
    return cfg, example_prompts(cfg, st_, ac, rw)


def _rel(a, b): return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.unit
@pytest.mark.parametrize("hard", [False, True])
def test_streamed_control_path_equals_the_dense_one(hard):
    "At 9d's training shapes (a batch of prompts, 3 pairs, free parameters): values and every parameter's gradient agree to 1e-12 relative."
    cfg, x = _training_prompts(9001)
    model = ControlICTD(cfg.d, n_layers=cfg.n_layers, init_gain=0.5, seed=9001, hard=hard)
    outs, grads = {}, {}
    for method in ("dense", "streamed"):
        model.zero_grad()
        out = model(x, return_all=True, method=method)
        model.predict(x, method=method).square().sum().backward()
        outs[method] = out.detach()
        grads[method] = torch.cat([torch.zeros(p.numel(), dtype=F64) if p.grad is None else p.grad.flatten() for p in model.pairs])
    assert _rel(outs["streamed"], outs["dense"]) < 1e-12
    assert grads["dense"].abs().max() > 0 and _rel(grads["streamed"], grads["dense"]) < 1e-12


@pytest.mark.unit
def test_streamed_control_path_keeps_theorem_9a1_with_ties():
    "theta* at beta = inf starts from all-zero values (every block a tie): the streamed path is kernel soft Q-iteration as the dense one is."
    m, St, At, Rt, W, _ = _context(77, S=4, A=3, features="onehot", n=15)
    f, fn = context_features(m, St, At)
    x = build_control_prompt(f, Rt, fn, m.phi[[0, 2]])
    ref = kernel_q_iteration(f, Rt, fn, W, alpha=0.6, gamma=m.gamma, beta=math.inf, n_iters=5, phi_queries=m.phi[[0, 2]].flatten(0, 1))
    for beta in (math.inf, 3.):
        model = ControlICTD.from_theta_star(m.d, W, n_layers=5, alpha=0.6, gamma=m.gamma, beta=beta)
        dense, streamed = model(x, method="dense"), model(x, method="streamed")
        assert _rel(streamed, dense) < 1e-12, beta
    assert (model.predict(x, method="streamed").flatten() - kernel_q_iteration(
        f, Rt, fn, W, alpha=0.6, gamma=m.gamma, beta=3., n_iters=5, phi_queries=m.phi[[0, 2]].flatten(0, 1))[15:]).abs().max() < 1e-11
    hard = ControlICTD.from_theta_star(m.d, W, n_layers=5, alpha=0.6, gamma=m.gamma, beta=math.inf)
    assert (hard.predict(x, method="streamed").flatten() - ref[15:]).abs().max() < 1e-11


@pytest.mark.unit
def test_auto_takes_the_streamed_control_path_above_dense_bytes(monkeypatch):
    "'auto' is the dense path for 9d's prompts and the streamed one once the dense estimate passes DENSE_BYTES; the pair functions agree."
    cfg, x = _training_prompts(9002, B=2)
    model = ControlICTD(cfg.d, n_layers=2, init_gain=0.5, seed=3)
    dense, streamed = model(x, method="dense"), model(x, method="streamed")
    assert not torch.equal(dense, streamed)                      # the two paths round differently, so the choice shows
    assert torch.equal(model(x), dense)
    monkeypatch.setattr(core, "DENSE_BYTES", 1000)
    assert torch.equal(model(x), streamed)
    pair = tuple(model.pairs[:5])
    assert torch.equal(streamed_pair_update(x.Z, pair, x.n, x.n_actions, x.q), model(x, return_all=True)[..., 1, :, :])
    monkeypatch.setattr(core, "CHUNK_BYTES", 8 * cfg.n * 7)      # seven columns per fused-attention call
    assert _rel(model(x, method="streamed"), dense) < 1e-12


@pytest.mark.unit
def test_the_dense_control_path_is_refused_at_n_1e5():
    "n = 1e5: the dense path, the masks and masked_attention refuse with the sizes and the way out; the prompt and its checks cost O(N)."
    n = 10**5
    x = ControlPrompt(torch.zeros(12, n + (n + 1) * 2, dtype=F64), n, 2, 1)
    model = ControlICTD(8, n_layers=1, seed=0)
    with pytest.raises(ValueError, match=r"the 300002 x 300002 masks and attention weights .*n = 100000, A = 2, q = 1.* would need about 3.35e\+03 GiB.*method='streamed'"):
        model.predict(x, method="dense")
    with pytest.raises(ValueError, match=r"the two 300002 x 300002 masks .* would need about 1.34e\+03 GiB.*streamed_pair_update"):
        control_masks(n, 2, 1)
    with pytest.raises(ValueError, match=r"the 300002 x 300002 logits .*use `streamed_pair_update`"):
        masked_attention(x.Z, torch.zeros(12, 12, dtype=F64), torch.zeros(1, 1, dtype=F64))
    with pytest.raises(ValueError, match="`method` must be one of"): model.predict(x, method="sparse")


MEMORY = r'''
import sys, torch
from ictd.control_model import ControlICTD, build_control_prompt, _dense_bytes
def peak_mb(): return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) / 1024
n, g = int(sys.argv[1]), torch.Generator().manual_seed(0)
r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) / 2
x = build_control_prompt(r(n, 4), r(n), r(n, 2, 4), r(1, 2, 4))
model = ControlICTD(4, 1, init_gain=0.5, seed=0).requires_grad_(False)
before = peak_mb(); v = model.predict(x)
print(peak_mb() - before, _dense_bytes(x.Z) / 2**20, bool(torch.isfinite(v).all()))
'''

@pytest.mark.unit
def test_the_control_forward_runs_in_linear_memory():
    "n = 2000 (N = 6002): the default path's forward raises the process's peak memory by under 64 MiB where the dense path needs over 1 GiB."
    out = subprocess.run([sys.executable, "-c", MEMORY, "2000"], capture_output=True, text=True, env=dict(__import__("os").environ, OMP_NUM_THREADS="1"), timeout=120)
    grew, dense, finite = out.stdout.split()
    assert finite == "True" and float(dense) > 1024 and float(grew) < 64, out.stdout + out.stderr
