"""Claims of chapter 9d (pretraining for control), on seeds the book does not show, and unit checks of its objective."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ictd.control import kernel_q_iteration, context_features, random_mdp, sample_mdp_trajectory
from ictd.control_acting import pair_token_q_iteration
from ictd.control_model import (
    ControlICTD,
    build_control_prompt,
    control_masks,
    control_pair_update,
    control_theta_star,
)
from ictd.experiments.control_pretraining import (
    ControlPretrainConfig,
    control_forward,
    control_td_targets,
    fast_pair_update,
    held_out,
    probe_metrics,
    td_loss,
    train_control,
    training_pools,
    sample_contexts,
)

torch.set_num_threads(1)
F64 = torch.float64
DATA = Path(__file__).resolve().parents[1] / "nbs" / "data" / "control_pretrain.json"


# ---------------------------------------------------------------- the objective


@pytest.mark.unit
def test_q_learning_target_is_the_max_backup_by_hand():
    "r + gamma max_a' q(s', a') on a tiny case, computed by hand, in float64; the mean for expected SARSA."
    q = torch.tensor([[0.5, -0.25], [-1.0, -3.0], [2.0, 2.0]], dtype=F64)
    r = torch.tensor([1.0, 0.0, -0.5], dtype=F64)
    want_max = torch.tensor([1.0 + 0.8 * 0.5, 0.8 * -1.0, -0.5 + 0.8 * 2.0], dtype=F64)
    want_mean = torch.tensor([1.0 + 0.8 * 0.125, 0.8 * -2.0, -0.5 + 0.8 * 2.0], dtype=F64)
    assert torch.allclose(control_td_targets(r, q, 0.8, "q"), want_max, rtol=0, atol=1e-15)
    assert torch.allclose(control_td_targets(r, q, 0.8, "shuffled"), want_max, rtol=0, atol=1e-15)
    assert torch.allclose(control_td_targets(r, q, 0.8, "expected"), want_mean, rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="`objective` must be one of"):
        control_td_targets(r, q, 0.8, "sarsa")


@pytest.mark.unit
def test_td_loss_is_the_semi_gradient_of_the_max_target():
    "The loss's gradient is that of 0.5 (target - v)^2 with the target held fixed, target r + gamma max of the successor block."
    cfg = ControlPretrainConfig(n=5, n_layers=2, init_gain=0.5)
    pool = training_pools(ControlPretrainConfig(n_pool=4), [31])
    g = torch.Generator().manual_seed(31)
    st, ac, rw = sample_contexts(pool, torch.randint(0, 4, (1, 6), generator=g), torch.rand(1, 6, 7, 2, generator=g, dtype=F64))
    p = (0.5 * torch.randn(1, 10, 12, 12, generator=g, dtype=F64)).requires_grad_()
    td_loss(cfg, p, st, ac, rw).sum().backward()
    # the same by hand: the model's values, then the fixed target
    phi = torch.eye(8, dtype=F64).reshape(4, 2, 8)
    q = p.detach().clone().requires_grad_()
    x = build_control_prompt(phi[st[..., :5], ac[..., :5]], rw[..., :5], phi[st[..., 1:6]], phi[st[..., 5:7]])
    out = control_forward(q, x.Z, 5, 2, 2)
    v = out[0, torch.arange(6), 0, ac[0, :, 5]]
    target = (rw[0, :, 5] + 0.9 * out[0, :, 1].amax(-1)).detach()
    (0.5 * (target - v).square().mean()).backward()
    assert torch.allclose(p.grad, q.grad, rtol=0, atol=1e-13)


# ---------------------------------------------------------------- the forward pass


@pytest.mark.unit
@pytest.mark.parametrize("seed", [41, 42, 43])
def test_fast_forward_equals_the_masked_transformer(seed):
    "fast_pair_update equals 9a's control_pair_update on random parameters; with theta* the stack is kernel soft Q-iteration."
    rng = np.random.default_rng(seed)
    S, A = int(rng.integers(2, 5)), int(rng.integers(1, 4))
    m = random_mdp(S, A, seed=rng)
    n = int(rng.integers(2, 12))
    St, At, Rt = sample_mdp_trajectory(m, n, seed=rng)
    f_sa, f_next = context_features(m, St, At)
    x = build_control_prompt(f_sa, Rt, f_next, m.phi)
    D = m.d + 4
    g = torch.Generator().manual_seed(seed)
    pair = tuple(0.5 * torch.randn(D, D, generator=g, dtype=F64) for _ in range(5))
    slow = control_pair_update(x.Z, pair, control_masks(n, A, S))
    assert torch.allclose(fast_pair_update(x.Z, pair, n, A, S), slow, rtol=0, atol=1e-12 * slow.abs().max().item())
    W = torch.from_numpy(rng.normal(size=(m.d, m.d)))
    star = torch.stack(control_theta_star(m.d, W, 0.7, m.gamma, 2.0) * 4)
    ref = kernel_q_iteration(f_sa, Rt, f_next, W, alpha=0.7, gamma=m.gamma, beta=2.0, n_iters=4, phi_queries=m.phi.flatten(0, 1))
    got = control_forward(star, x.Z, n, A, S)
    assert torch.allclose(got.flatten(), ref[n:], rtol=0, atol=1e-11)
    free = ControlICTD(m.d, n_layers=3, init_gain=0.5, seed=seed)
    stacked = torch.stack([p.detach() for p in free.pairs])
    assert torch.allclose(control_forward(stacked, x.Z, n, A, S), free.predict(x), rtol=0, atol=1e-12)


@pytest.mark.unit
def test_batched_training_equals_separate_runs():
    "Two seeds trained together end at the parameters each reaches alone, to 1e-10 (float64), for every objective."
    for obj in ("q", "shuffled"):
        cfg = ControlPretrainConfig(objective=obj, n_steps=12, eval_every=12, eval_mdps=2, n_pool=10, n=5, batch_size=8)
        both = train_control(cfg, [301, 302])
        for i, s in enumerate((301, 302)):
            alone = train_control(cfg, [s])
            assert (alone["params"][0] - both["params"][i]).abs().max() < 1e-10
            for k, v in alone["history"].items():
                assert torch.allclose(v[0], both["history"][k][i], rtol=0, atol=1e-10, equal_nan=True), k


@pytest.mark.unit
def test_held_out_metrics_of_the_construction():
    "On theta* with beta = 3 the value-reading score is 3 and the argmax mass is softmax(3 Q) at its largest, above 1/A."
    cfg = ControlPretrainConfig(eval_mdps=6)
    ho = held_out(cfg, [500, 501])
    star = torch.stack(control_theta_star(8, 20 * torch.eye(8, dtype=F64), 1.0, 0.9, 3.0) * 3)[None].expand(2, -1, -1, -1)
    m = probe_metrics(cfg, star, ho)
    assert torch.allclose(m["beta_eff"], torch.full((2, 3), 3.0, dtype=F64), rtol=0, atol=1e-12)
    assert (m["mass_value"][:, 1:] > 0.5).all() and torch.isnan(m["mass_value"][:, 0]).all()
    # its values are the construction's, computed by 9b's pair tokens (beta = 3, three iterations); the
    # greedy returns are not compared: with state rewards many actions tie, and rounding breaks the ties
    Q = pair_token_q_iteration(torch.eye(8, dtype=F64).reshape(4, 2, 8), ho["states"], ho["actions"], ho["rewards"],
                               20 * torch.eye(8, dtype=F64), alpha=1.0, gamma=0.9, beta=3.0, n_iters=3)
    assert torch.allclose(control_forward(star, ho["Z"], 20, 2, 4), Q, rtol=0, atol=1e-12)


# ---------------------------------------------------------------- the claims, on fresh seeds


FRESH = list(range(7000, 7010))
# A shortened budget (the book's study: n = 20, 600 steps, 64 held-out MDPs): n = 12, 150 steps, 16 held-out MDPs per
# seed, so that both objectives train on 10 fresh seeds in about half a minute. At this budget the models already
# split by objective in what they compute; the attention mass on the argmax is still too noisy to test here (it is
# asserted on the saved file by the notebook).
SHORT = dict(n_steps=150, eval_every=150, n_pool=100, eval_mdps=16, n=12)


@pytest.fixture(scope="module")
def fresh_runs():
    "Q-learning and expected SARSA on 10 fresh seeds at the shortened budget."
    cfg = ControlPretrainConfig(**SHORT)
    ho, pool = held_out(cfg, FRESH), training_pools(cfg, FRESH)
    return {obj: train_control(ControlPretrainConfig(objective=obj, **SHORT), FRESH, ho=ho, pool=pool)["history"] for obj in ("q", "expected")}


def _se(x):
    return x.std(ddof=1) / math.sqrt(len(x))


@pytest.mark.claims
def test_the_file_was_written_by_the_command():
    data = json.loads(DATA.read_text())
    assert data["provenance"]["command"].startswith("python -m ictd.experiments.control_pretraining")
    assert len(data["seeds"]) >= 10 and set(data["runs"]) == {"q", "expected", "shuffled"}


@pytest.mark.claims
def test_objectives_split_what_the_models_compute_on_fresh_seeds(fresh_runs):
    "Q-learning models are nearer q* than expected-SARSA models (paired); expected-SARSA models are nearer q_unif than q*."
    q, e = fresh_runs["q"], fresh_runs["expected"]
    gap = (e["err_qstar"][:, -1] - q["err_qstar"][:, -1]).numpy()
    assert gap.mean() > 3 * _se(gap), gap
    side = (e["err_qstar"][:, -1] - e["err_qunif"][:, -1]).numpy()
    assert side.mean() > 3 * _se(side), side
