"""Cross-module properties of `ictd.prompt` and `ictd.model` that the chapters cannot show: CUDA, gradients, shared parameters."""
import numpy as np
import pytest
import torch
from ictd.boyan import random_boyan_chain, sample_trajectory
from ictd.prompt import build_prompt
from ictd.wstd import weighted_softmax_td
from ictd.model import SoftmaxICTD, SingleHeadTSMLayer, DualHeadSoftmaxLayer

def context(seed, n=30, q=3):
    "Features of a sampled trajectory, its rewards and q query features, from a random Boyan chain."
    mrp = random_boyan_chain(seed=seed)
    states, rewards = sample_trajectory(mrp, n, seed=seed)
    return mrp, mrp.phi[states], rewards, mrp.phi[:q]

@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine: the CPU tests cover the same code path")
def test_cuda_matches_cpu():
    mrp, phi, rewards, phi_q = context(0)
    W = torch.eye(mrp.d, dtype=torch.float64)
    model = SoftmaxICTD.from_theta_star(mrp.d, 20, W, 0.5, mrp.gamma)
    Z = build_prompt(phi, rewards, phi_q)
    Zc = build_prompt(phi.cuda(), rewards.cuda(), phi_q.cuda())
    assert Zc.device.type == 'cuda'
    with torch.no_grad():
        vc, v = model.predict(Zc, n=30), model.predict(Z, n=30)
        assert vc.device.type == 'cuda' and vc.dtype == torch.float64
        assert (vc.cpu() - v).abs().max() < 1e-12
        td = weighted_softmax_td(phi.cuda(), rewards.cuda(), W.cuda(), 0.5, mrp.gamma, 20, phi_queries=phi_q.cuda())
        assert (vc - td[..., 31:]).abs().max() < 1e-12
        single = SingleHeadTSMLayer.from_dual_head(model.layer(0), channels=[mrp.d + 1])
        assert (single(Zc, n=30) - model.layer(0)(Zc, n=30)).abs().max() < 1e-12
        model.cuda()
        assert (model.predict(Zc.float(), n=30).cpu().double() - v).abs().max() < 1e-4 * v.abs().max()

def test_shared_theta_star_equals_per_layer():
    mrp, phi, rewards, phi_q = context(1)
    W = torch.from_numpy(np.random.default_rng(1).normal(size=(mrp.d, mrp.d)))
    Z = build_prompt(phi, rewards, phi_q)
    per_layer = SoftmaxICTD.from_theta_star(mrp.d, 12, W, 0.3, mrp.gamma)
    shared = SoftmaxICTD.from_theta_star(mrp.d, 12, W, 0.3, mrp.gamma, shared=True)
    assert len(list(shared.parameters())) == 3 and len(list(per_layer.parameters())) == 36
    with torch.no_grad(): assert torch.equal(shared.predict(Z, n=30), per_layer.predict(Z, n=30))

@pytest.mark.parametrize('shared', [False, True])
def test_gradients_reach_every_parameter(shared):
    "A prediction is differentiable in every parameter, so the model can be pretrained (chapter 7)."
    mrp, phi, rewards, phi_q = context(2)
    model = SoftmaxICTD(mrp.d, 3, shared=shared, init_gain=1., seed=0)
    model.predict(build_prompt(phi, rewards, phi_q), n=30).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name

def test_model_does_not_touch_global_rng():
    "Seeded and constructed models draw from their own generator, so building them leaves torch's global RNG alone."
    state = torch.get_rng_state()
    SoftmaxICTD(4, 3, seed=0); SoftmaxICTD.from_theta_star(4, 3, torch.eye(4), 0.1, 0.9)
    DualHeadSoftmaxLayer.from_params(torch.eye(6), torch.eye(6), torch.eye(6))
    assert torch.equal(state, torch.get_rng_state())

def test_one_query_per_prompt_batch():
    "The pretraining layout: a batch of contexts, each with its own single query given as (B, d), predicts (B, 1)."
    mrp = random_boyan_chain(seed=3)
    trajs = [sample_trajectory(mrp, 20, seed=k) for k in range(6)]
    phi, rewards = torch.stack([mrp.phi[st] for st, _ in trajs]), torch.stack([r for _, r in trajs])
    queries = torch.arange(6) % mrp.n_states
    model = SoftmaxICTD.from_theta_star(mrp.d, 5, torch.eye(mrp.d, dtype=torch.float64), 0.5, mrp.gamma)
    with torch.no_grad(): v = model.predict(build_prompt(phi, rewards, mrp.phi[queries]))
    assert v.shape == (6, 1)
    td = weighted_softmax_td(phi, rewards, torch.eye(mrp.d, dtype=torch.float64), 0.5, mrp.gamma, 5, phi_queries=mrp.phi[queries])
    assert (v[:, 0] - td[:, -1]).abs().max() < 1e-12
