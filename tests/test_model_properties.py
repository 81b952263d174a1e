"""Cross-module properties of `ictd.prompt` and `ictd.model` that the chapters cannot show: CUDA, gradients, shared parameters."""
import os
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
import torch
from ictd.boyan import random_boyan_chain, sample_trajectory
from ictd.prompt import build_prompt
from ictd.wstd import weighted_softmax_td
from ictd.model import SoftmaxICTD, SingleHeadTSMLayer, DualHeadSoftmaxLayer, ShiftAfterAttentionICTD

def context(seed, n=30, q=3):
    "Features of a sampled trajectory, its rewards and q query features, from a random Boyan chain."
    mrp = random_boyan_chain(seed=seed)
    states, rewards = sample_trajectory(mrp, n=n, seed=seed)
    return mrp, mrp.phi[states], rewards, mrp.phi[:q]

@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine: the CPU tests cover the same code path")
def test_cuda_matches_cpu():
    mrp, phi, rewards, phi_q = context(0)
    W = torch.eye(mrp.d, dtype=torch.float64)
    model = SoftmaxICTD.from_theta_star(mrp.d, W, n_layers=20, alpha=0.5, gamma=mrp.gamma)
    Z = build_prompt(phi, rewards, phi_q)
    Zc = build_prompt(phi.cuda(), rewards.cuda(), phi_q.cuda())
    assert Zc.device.type == 'cuda'
    with torch.no_grad():
        vc, v = model.predict(Zc, n=30), model.predict(Z, n=30)
        assert vc.device.type == 'cuda' and vc.dtype == torch.float64
        assert (vc.cpu() - v).abs().max() < 1e-12
        td = weighted_softmax_td(phi.cuda(), rewards.cuda(), W.cuda(), alpha=0.5, gamma=mrp.gamma, n_iters=20, phi_queries=phi_q.cuda())
        assert (vc - td[..., 31:]).abs().max() < 1e-12
        single = SingleHeadTSMLayer.from_dual_head(model.layer(0), channels=[mrp.d + 1])
        assert (single(Zc, n=30) - model.layer(0)(Zc, n=30)).abs().max() < 1e-12
        after = ShiftAfterAttentionICTD.from_theta_td_memory(mrp.d, W, n_layers=20, alpha=0.5, gamma=mrp.gamma)
        assert (after.predict(Zc, n=30).cpu() - v).abs().max() < 1e-12
        model.cuda()
        assert (model.predict(Zc.float(), n=30).cpu().double() - v).abs().max() < 1e-4 * v.abs().max()

def test_shared_theta_star_equals_per_layer():
    mrp, phi, rewards, phi_q = context(1)
    W = torch.from_numpy(np.random.default_rng(1).normal(size=(mrp.d, mrp.d)))
    Z = build_prompt(phi, rewards, phi_q)
    per_layer = SoftmaxICTD.from_theta_star(mrp.d, W, n_layers=12, alpha=0.3, gamma=mrp.gamma)
    shared = SoftmaxICTD.from_theta_star(mrp.d, W, n_layers=12, alpha=0.3, gamma=mrp.gamma, shared=True)
    assert len(list(shared.parameters())) == 3 and len(list(per_layer.parameters())) == 36
    with torch.no_grad(): assert torch.equal(shared.predict(Z, n=30), per_layer.predict(Z, n=30))

@pytest.mark.parametrize('shared', [False, True])
def test_gradients_reach_every_parameter(shared):
    "A prediction is differentiable in every parameter, so the model can be pretrained (chapter 7)."
    mrp, phi, rewards, phi_q = context(2)
    model = SoftmaxICTD(mrp.d, n_layers=3, shared=shared, init_gain=1., seed=0)
    model.predict(build_prompt(phi, rewards, phi_q), n=30).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name

def test_model_does_not_touch_global_rng():
    "Seeded and constructed models draw from their own generator, so building them leaves torch's global RNG alone."
    state = torch.get_rng_state()
    SoftmaxICTD(4, n_layers=3, seed=0); SoftmaxICTD.from_theta_star(4, torch.eye(4), n_layers=3, alpha=0.1, gamma=0.9)
    DualHeadSoftmaxLayer.from_params(torch.eye(6), torch.eye(6), torch.eye(6))
    assert torch.equal(state, torch.get_rng_state())

def test_one_query_per_prompt_batch():
    "The pretraining layout: a batch of contexts, each with its own single query given as (B, d), predicts (B, 1)."
    mrp = random_boyan_chain(seed=3)
    trajs = [sample_trajectory(mrp, n=20, seed=k) for k in range(6)]
    phi, rewards = torch.stack([mrp.phi[st] for st, _ in trajs]), torch.stack([r for _, r in trajs])
    queries = torch.arange(6) % mrp.n_states
    model = SoftmaxICTD.from_theta_star(mrp.d, torch.eye(mrp.d, dtype=torch.float64), n_layers=5, alpha=0.5, gamma=mrp.gamma)
    with torch.no_grad(): v = model.predict(build_prompt(phi, rewards, mrp.phi[queries]))
    assert v.shape == (6, 1)
    td = weighted_softmax_td(phi, rewards, torch.eye(mrp.d, dtype=torch.float64), alpha=0.5, gamma=mrp.gamma, n_iters=5, phi_queries=mrp.phi[queries])
    assert (v[:, 0] - td[:, -1]).abs().max() < 1e-12

@pytest.mark.parametrize('q', [0, 1, 2, 4])
def test_prompt_carries_n(q):
    "A built prompt gives its n to every model; a plain tensor without `n` and a contradicting `n` are refused."
    mrp, phi, rewards, phi_q = context(4, n=12, q=q)
    Z = build_prompt(phi, rewards, phi_q)
    for model in (SoftmaxICTD.from_theta_star(mrp.d, torch.eye(mrp.d, dtype=torch.float64), n_layers=4, alpha=0.5, gamma=mrp.gamma),
                  ShiftAfterAttentionICTD.from_theta_td_memory(mrp.d, torch.eye(mrp.d, dtype=torch.float64), n_layers=4, alpha=0.5, gamma=mrp.gamma)):
        with torch.no_grad():
            assert torch.equal(model.predict(Z), model.predict(Z.clone(), n=12))
            assert model.predict(Z).shape == (q,)
            assert model(Z).n_context == 12
            with pytest.raises(ValueError, match="`n` must be given"): model.predict(Z.clone())
            with pytest.raises(ValueError, match="contradicts the prompt"): model.predict(Z, n=11)

@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 30), q=st.integers(0, 4), n_layers=st.integers(1, 30))
@settings(max_examples=int(os.environ.get("ICTD_EXAMPLES", 30)), deadline=None)
def test_both_forms_run_the_same_iteration(seed, n, q, n_layers):
    "Theorem 3 against Theorem 1: the shift-after-attention model (theta_delta) and the dual-head model (theta*) give the same values at every column."
    rng = np.random.default_rng(seed)
    mrp = random_boyan_chain(n_states=int(rng.integers(2, 10)), d=int(rng.integers(1, 6)), seed=rng)
    states, rewards = sample_trajectory(mrp, n=n, seed=rng)
    W = torch.from_numpy(rng.normal(scale=1 / np.sqrt(mrp.d), size=(mrp.d, mrp.d)))
    alpha = rng.uniform(0.05, 1)
    Z = build_prompt(mrp.phi[states], rewards, torch.from_numpy(rng.uniform(-1, 1, (q, mrp.d))))
    with torch.no_grad():
        before = SoftmaxICTD.from_theta_star(mrp.d, W, n_layers=n_layers, alpha=alpha, gamma=mrp.gamma)(Z)[mrp.d + 1]
        after = ShiftAfterAttentionICTD.from_theta_td_memory(mrp.d, W, n_layers=n_layers, alpha=alpha, gamma=mrp.gamma)(Z)[mrp.d + 1]
    assert (before - after).abs().max() <= 1e-12 * max(1., before.abs().max().item())
