"""Behavioural tests of chapter 4's statements about the heads (issue 18), on seeds the book does not show.

- Neither head of theta* computes the TD error: the current head's value row is alpha (R - v), the
  target head's gamma alpha v(successor); only their sum, and the single TSM head's value, is alpha delta.
- theta_delta's attention, read off the layer's output, is the softmax of weighted softmax TD.
- Each of the three weights `value_weights` reports matters with its sign: flipping one breaks TD."""
import numpy as np
import pytest
import torch
from ictd.boyan import random_boyan_chain, sample_trajectory
from ictd.prompt import build_prompt
from ictd.wstd import weighted_softmax_td, context_weights
from ictd.model import (SoftmaxICTD, SingleHeadTSMLayer, DualHeadSoftmaxLayer, ShiftAfterAttentionICTD, theta_star,
                        theta_td_memory, attend_context, temporal_shift)

def context(seed, n=25, d=3):
    mrp = random_boyan_chain(n_states=8, d=d, seed=seed)
    S, R = sample_trajectory(mrp, n=n, seed=seed)
    W = torch.from_numpy(np.random.default_rng(seed).normal(size=(d, d)))
    return mrp, S, R, W

@pytest.mark.unit
@pytest.mark.parametrize("seed", [11, 12, 13])
def test_heads_split_the_td_error(seed):
    mrp, S, R, W = context(seed)
    d, n, alpha, gamma = mrp.d, len(R), 0.4, mrp.gamma
    A, V_cur, V_tgt = theta_star(d, W, alpha=alpha, gamma=gamma)
    Z0 = build_prompt(mrp.phi[S], R, mrp.phi)
    Z = SoftmaxICTD.from_theta_star(d, W, n_layers=4, alpha=alpha, gamma=gamma).requires_grad_(False)(Z0, n=n)
    v = weighted_softmax_td(mrp.phi[S], R, W, alpha=alpha, gamma=gamma, n_iters=4, phi_queries=mrp.phi)
    delta = R + gamma * v[1:n + 1] - v[:n]
    cur, tgt = (V_cur @ Z[:, :n])[d + 1], (V_tgt @ Z[:, 1:n + 1])[d + 1]
    single = SingleHeadTSMLayer.from_dual_head(DualHeadSoftmaxLayer.from_params(A, V_cur, V_tgt), channels=[d + 1])
    one = (single.V.detach() @ temporal_shift(Z, n, channels=[d + 1])[:, :n])[d + 1]
    torch.testing.assert_close(cur, alpha * (R - v[:n]), rtol=0, atol=1e-12)
    torch.testing.assert_close(tgt, gamma * alpha * v[1:n + 1], rtol=0, atol=1e-12)
    torch.testing.assert_close(cur + tgt, alpha * delta, rtol=0, atol=1e-12)
    torch.testing.assert_close(one, alpha * delta, rtol=0, atol=1e-12)
    assert (cur - alpha * delta).abs().max() > 1e-2

@pytest.mark.unit
@pytest.mark.parametrize("seed", [21, 22])
def test_theta_delta_attention_and_sign_flips(seed):
    mrp, S, R, W = context(seed)
    d, n, alpha, gamma = mrp.d, len(R), 0.5, mrp.gamma
    Z0 = build_prompt(mrp.phi[S], R, mrp.phi)
    A, V_cur, V_tgt = theta_td_memory(d, W, alpha=alpha, gamma=gamma)
    probe = Z0.clone().expand(n, -1, -1).clone()
    probe[:, d, :n] = torch.eye(n, dtype=torch.float64)
    S_read = attend_context(probe, A, probe[..., :n])[:, d]
    torch.testing.assert_close(S_read, context_weights(mrp.phi[S], W, phi_queries=mrp.phi), rtol=0, atol=1e-13)
    td = weighted_softmax_td(mrp.phi[S], R, W, alpha=alpha, gamma=gamma, n_iters=8, phi_queries=mrp.phi)[-mrp.n_states:]
    good = ShiftAfterAttentionICTD.from_params(8, A, V_cur, V_tgt).requires_grad_(False).predict(Z0, n=n)
    torch.testing.assert_close(good, td, rtol=0, atol=1e-12)
    for k, (V, i, j) in enumerate([(V_cur, d + 1, d), (V_cur, d, d), (V_tgt, d, d)]):
        V2 = V.clone(); V2[i, j] *= -1
        params = [A, V2, V_tgt] if V is V_cur else [A, V_cur, V2]
        flipped = ShiftAfterAttentionICTD.from_params(8, *params).requires_grad_(False)
        assert torch.sign(flipped.layer(0).value_weights())[k] == -torch.tensor([1., -1., 1.])[k]
        assert (flipped.predict(Z0, n=n) - td).abs().max() > 1e-2
