"""Claims of chapter 7c's pretraining section, on seeds the chapter does not show (100..109), and its helpers."""
import dataclasses, math
import pytest
import torch
from hypothesis import given, settings, strategies as st
from ictd.continuous import TASK_SETS, GaussianAR1Family, RotationFamily, family_config, mc_z_scores, task_process
from ictd.experiments.continuous import (ar1_claims, binomial_lower, family_experiment, kernel_fit, kernel_msve, family_msve,
                                         learned_scores, plot_family_training, rotation_claims, value_weights)
from ictd.model import SoftmaxICTD, theta_star
from ictd.state_tokens import token_predict, trajectory_tokens
from ictd.engine import eval_set
from ictd.state_tokens import model_params
from ictd.pretrain import pretrain_many
from ictd.prompt import build_prompt

ROT, AR = RotationFamily(), GaussianAR1Family()
AT_LEAST = 8   # of 10 seeds: a statement true for each seed with probability 0.95 fails this with probability 0.012

@pytest.fixture(scope="module")
def rotation_experiment():
    return family_experiment(ROT, range(100, 110), [1., 2., 4., 8.], [0.125, 0.25, 0.5, 1., 2., 4., 8.], n=30, n_layers=3, n_steps=500, lr=1e-2)

@pytest.fixture(scope="module")
def ar1_experiment():
    return family_experiment(AR, range(100, 110), [1., 2., 4., 8.], [0.25, 0.5, 1., 2., 4., 8.], n=30, n_layers=3, n_steps=300, lr=1e-2)

def test_rotation_claims_on_other_seeds(rotation_experiment):
    for name, ok in rotation_claims(rotation_experiment, ROT).items(): assert ok.sum() >= AT_LEAST, (name, ok)

def test_ar1_claims_on_other_seeds(ar1_experiment):
    for name, ok in ar1_claims(ar1_experiment, AR).items(): assert ok.sum() >= AT_LEAST, (name, ok)

@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 25), L=st.integers(1, 4), q=st.integers(1, 5), ar1=st.booleans())
def test_trajectory_tokens_are_the_full_prompt(seed, n, L, q, ar1):
    fam = AR if ar1 else ROT
    t, S, _, _ = fam.sample(2, n, torch.Generator().manual_seed(seed))
    R, x = fam.reward(t, S[:, :-1]), fam.base.grid(q)[0]
    model = SoftmaxICTD(fam.d, n_layers=L, init_gain=0.7, seed=seed)
    Q = fam.features(x).expand(2, q, fam.d)
    want = model.predict(build_prompt(fam.features(S), R, Q), n=n)
    got = token_predict(model_params(model), L, trajectory_tokens(fam.features(S)[None], R[None], Q[None]))[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)

@given(beta=st.floats(0.05, 50), shift=st.lists(st.floats(-5, 5), min_size=3, max_size=3))
def test_kernel_fit_recovers_the_scale_and_ignores_query_only_terms(beta, shift):
    A = theta_star(3, AR.base.score_matrix(beta), alpha=1., gamma=0.9)[0]
    A[2, :3] += torch.tensor(shift, dtype=torch.float64)      # the key's constant feature: the same for every key of a query
    A[2, 3:] += 1.                                             # ... against the query's reward and value rows
    fit = kernel_fit(AR, A)
    torch.testing.assert_close(torch.stack([fit["beta"], fit["cosine"], fit["share"]]), torch.tensor([beta, 1., 1.], dtype=torch.float64))
    rot = kernel_fit(ROT, theta_star(2, ROT.base.score_matrix(beta), alpha=1., gamma=0.9)[0])
    torch.testing.assert_close(rot["beta"], torch.tensor(beta, dtype=torch.float64))

def test_learned_scores_of_the_constructed_kernels():
    u, x = torch.linspace(-2, 2, 9, dtype=torch.float64), torch.tensor([-1., 0., 0.7], dtype=torch.float64)
    for fam, ref in [(ROT, 3. * (torch.cos(u) - 1)), (AR, -3. * u ** 2 / 2)]:
        g = learned_scores(fam, theta_star(fam.d, fam.base.score_matrix(3.), alpha=1., gamma=0.9)[0], x, u)
        torch.testing.assert_close(g, ref.expand(3, -1), rtol=0, atol=1e-12)

def test_value_weights_read_theta_star():
    A, Vc, Vt = theta_star(3, AR.base.score_matrix(1.), alpha=0.7, gamma=0.8)
    torch.testing.assert_close(value_weights(dict(V_cur=Vc, V_tgt=Vt)), torch.tensor([0.7, 0.56, -0.7], dtype=torch.float64))

@pytest.mark.parametrize("k,N", [(10, 10), (9, 10), (8, 10), (27, 30), (1, 5)])
def test_binomial_lower_is_the_clopper_pearson_bound(k, N):
    p = binomial_lower(k, N)
    tail = lambda p: sum(math.comb(N, j) * p ** j * (1 - p) ** (N - j) for j in range(k, N + 1))
    assert abs(tail(p) - 0.05) < 1e-9 and 0 < p < k / N
    assert binomial_lower(0, N) == 0.

@pytest.mark.parametrize("fam,seed", [(ROT, 11), (ROT, 12), (AR, 11), (AR, 12)])
def test_family_values_against_monte_carlo(fam, seed):
    task = fam.draw(1, torch.Generator().manual_seed(seed))
    x = torch.linspace(-1.5, 1.5, 5, dtype=torch.float64) + (math.pi if fam is ROT else 0.)
    assert mc_z_scores(task_process(fam, task), x, fam.v_pi(task, x)[0], n_paths=2000, seed=seed).max() < 4.5
    wrong = fam.v_pi(task, x)[0] * 1.05 + 0.2                  # a value 5% off plus a shift must be rejected
    assert mc_z_scores(task_process(fam, task), x, wrong, n_paths=2000, seed=seed).max() > 4.5

def test_bad_input():
    with pytest.raises(ValueError, match="`sigma` must satisfy 0.01 <= low"): RotationFamily(sigma=(0., 0.5))
    with pytest.raises(ValueError, match="`mu` must be a pair"): RotationFamily(mu=1.)
    with pytest.raises(ValueError, match="`a` must lie inside"): GaussianAR1Family(a=(0.5, 1.))
    with pytest.raises(ValueError, match="`seeds` must be a non-empty list"): pretrain_many(family_config(ROT, n_steps=1), [1, 1])
    with pytest.raises(ValueError, match="`n_steps` must be an integer >= 0"): family_config(ROT, n_steps=-1)
    with pytest.raises(ValueError, match="`config` must have d = 2"): pretrain_many(dataclasses.replace(family_config(ROT, n_steps=1), d=3), [0])

@pytest.mark.unit
def test_unknown_panel_is_refused_before_a_figure_is_drawn():
    "A panel name outside the three raises, and leaves no empty figure behind (the chapter's page would show it)."
    import matplotlib; matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.close("all")
    with pytest.raises(ValueError, match="`panels` must be one of"):
        plot_family_training(dict(steps=torch.arange(3.), msve=torch.ones(3, 2)), ROT, {}, "", panels=("loss",))
    assert plt.get_fignums() == []

@pytest.mark.unit
def test_task_sets_are_separate_substreams():
    "The held-out, tuning and test task sets of a family are different tasks, each reproducible from its name."
    v = {w: AR.contexts(8, 15, which=w)["v"] for w in TASK_SETS}
    assert all(not torch.equal(v[a], v[b]) for a in TASK_SETS for b in TASK_SETS if a < b)
    assert torch.equal(AR.contexts(8, 15, which="tune")["v"], v["tune"])
    assert not torch.equal(AR.contexts(8, 15, seed=1)["v"], v["held_out"])

@pytest.mark.unit
def test_engine_held_out_set_is_the_family_held_out_tasks():
    "The engine evaluates every training seed on the family's held-out task set (root seed 0), the set `curve_lines` reads."
    cfg = family_config(ROT, n=12, eval_tasks=5)
    ev = eval_set(cfg, [3, 4])
    want = ROT.contexts(5, 12, 0, "held_out")["v"]
    assert torch.equal(ev.v_pi[0], want) and torch.equal(ev.v_pi[1], want)

@pytest.mark.unit
def test_family_msve_of_theta_star_is_kernel_td():
    ctx = AR.contexts(5, 20, which="test")
    theta = {k: v[None, None] for k, v in zip(("A", "V_cur", "V_tgt"), theta_star(3, AR.base.score_matrix(2.), alpha=0.6, gamma=0.9))}
    torch.testing.assert_close(family_msve(theta, 3, AR, ctx)[0], kernel_msve(AR, ctx, alpha=0.6, beta=2., n_layers=3), rtol=1e-9, atol=1e-12)
