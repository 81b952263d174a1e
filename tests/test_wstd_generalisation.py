"""The related-work page's comparison outside the memorisation regime, on task seeds the book does not use.

Claims (paired over the same tasks, a difference counts when it exceeds two standard errors):
- representable rewards, s = 50, n = 30: batch linear TD beats weighted softmax TD (W = beta I) on unseen states;
- i.i.d. rewards, s = 10, n = 100: weighted softmax TD beats batch linear TD on the states the context visits.
Each method's step size (and beta) is tuned on separate tasks."""
import math
import numpy as np
import pytest
import torch
from ictd.boyan import random_boyan_chain, sample_trajectory
from ictd.wstd import weighted_softmax_td, batch_linear_td

BETAS, ALPHAS, T = [0.5, 1., 2., 4., 8.], [0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.], 100

def tasks(s, n, rewards, n_tasks, seed):
    out = []
    for child in np.random.SeedSequence(seed).spawn(n_tasks):
        rng = np.random.default_rng(child)
        mrp = random_boyan_chain(n_states=s, rewards=rewards, seed=rng)
        S, R = sample_trajectory(mrp, n=n, seed=rng)
        seen = torch.zeros(s, dtype=torch.bool); seen[S] = True
        out.append((mrp.phi[S], R, mrp.phi, mrp.v_pi, seen))
    return [torch.stack(x) for x in zip(*out)]

def soft(phi, R, Q, beta, alpha):
    return weighted_softmax_td(phi, R, beta * torch.eye(phi.shape[-1], dtype=torch.float64), alpha=alpha, gamma=0.9, n_iters=T, phi_queries=Q)[..., -Q.shape[-2]:]

def lin(phi, R, Q, alpha):
    return batch_linear_td(phi, R, alpha=alpha, gamma=0.9, n_iters=T, phi_queries=Q)[..., -Q.shape[-2]:]

def mse(pred, v):
    return torch.nan_to_num(((pred - v) ** 2).mean(), nan=math.inf).item()

def compare(s, n, rewards, group, seed):
    "Mean and s.e. over tasks of error(softmax) - error(linear) on seen (group 0) or unseen (group 1) states, each method tuned."
    phi, R, Q, v, _ = tasks(s, n, rewards, 30, [seed, 0])
    beta, a_s = min(((b, a) for b in BETAS for a in ALPHAS), key=lambda ba: mse(soft(phi, R, Q, *ba), v))
    a_l = min(ALPHAS, key=lambda a: mse(lin(phi, R, Q, a), v))
    phi, R, Q, v, seen = tasks(s, n, rewards, 80, [seed, 1])
    mask = seen if group == 0 else ~seen
    per_task = lambda pred: (((pred - v) ** 2) * mask).sum(-1) / mask.sum(-1)
    diff = per_task(soft(phi, R, Q, beta, a_s)) - per_task(lin(phi, R, Q, a_l))
    diff = diff[~torch.isnan(diff)]
    return diff.mean().item(), (diff.std() / math.sqrt(len(diff))).item()

@pytest.mark.claims
def test_linear_generalises_to_unseen_states_when_values_are_representable():
    m, se = compare(50, 30, "representable", 1, seed=777)
    assert m - 2 * se > 0, (m, se)

@pytest.mark.claims
def test_kernel_looks_up_seen_states_when_values_are_not_representable():
    m, se = compare(10, 100, "random", 0, seed=778)
    assert m + 2 * se < 0, (m, se)
