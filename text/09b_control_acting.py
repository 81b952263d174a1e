# %%
#| default_exp control_acting

# %%
#| export
from __future__ import annotations
import math
import torch
from ictd.boyan import as_tensor, check_gamma
from ictd.core import check_int, check_number
from ictd.boyan import _stationary
from ictd.control import boltzmann_backup, _check_beta, _tabular, greedy_actions

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *

# %%
#| hide
import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown
from ictd.core import record_claim, OKABE_ITO, plain_log_ticks
from ictd.control import (random_mdp, sample_mdp_trajectory, context_features, kernel_q_iteration,
                          q_star, greedy_policy, uniform_policy, policy_return, MDP_REWARDS)
from ictd.control_model import ControlICTD, build_control_prompt
from ictd.wstd import batch_linear_td


# %% [markdown]
# # Acting on the in-context Q-values
# > The constructed Transformer acts greedily on its in-context Q-values on 100 unseen MDPs of each reward kind: normalised return against context length and depth, with intervals, against a SARSA evaluator and a myopic policy.

# %% [markdown]
# ::: {.callout-tip title="What this page shows"}
# - [9a](control_transformer.html)'s forward pass on a tabular context, exactly, on one token per pair.
# - Greedy acting on its query values on 100 unseen MDPs per reward kind: normalised return with 95%
#   intervals across context length and depth, against SARSA-then-greedy and the myopic policy.
# - Against tuned linear-attention SARSA at equal depth and context, and online acting.
# :::
#
# *How to read this page.* The fast exact forward pass and its check against the Transformer; the
# experiment and its figures; the claim; linear-attention SARSA; the online variant. Everything is
# the book's own experiment. Helpers and bulk tests are in
# [Implementation and tests](#implementation-and-tests).

# %% [markdown]
# ## One token per pair
#
# On a context of a tabular MDP, a column's value depends on its pair only (Theorem 9a.1 and
# Definition 9.1: values are functions of the features), so the forward pass collapses as
# [chapter 3a](state_tokens.html)'s does, to one token per pair. With $N(x)$ the visits of pair $x$
# among the keys, $\hat r(x)$ their mean reward and $\hat P(s' \mid x)$ their empirical successors,
# the update at a pair $y$ is
#
# $$Q_{l+1}(y) = Q_l(y) + \alpha \sum_x w(x \mid y)\Big[\hat r(x) + \gamma \sum_{s'} \hat P(s' \mid x)\,
# B_\beta\big(Q_l(s', \cdot)\big) - Q_l(x)\Big],$$
#
# $$w(x \mid y) = \mathrm{softmax}_x\big(\phi(x)^\top W \phi(y) + \log N(x)\big),$$
#
# exactly kernel soft Q-iteration regrouped by pair (the weights of the visits of $x$ add up to
# $w(x \mid y)$, and their TD errors average to the bracket). Its cost is independent of $n$ once the
# visits are counted.

# %%
#| export
def pair_token_q_iteration(phi,               # (..., S, A, d) features of every pair of the MDP
                           states, actions,   # (..., n+1) each: the context's states and actions
                           rewards,           # (..., n) rewards, rewards[..., k-1] = R_k
                           W,                 # (d, d) or (..., d, d) score matrix
                           *,
                           alpha:float, gamma:float, beta:float, n_iters:int,
                           sarsa:bool=False,  # back up the behaviour's next action instead (SARSA)
                           return_all=False,  # return every iterate Q_0..Q_T
                          )->torch.Tensor:    # (..., S, A) values at every pair ((..., T+1, S, A))
    "Kernel soft Q-iteration on a tabular context, on one token per state-action pair (exact)."
    phi = as_tensor(phi, "phi", torch.float64)
    if phi.ndim < 3:
        raise ValueError(f"`phi` must have shape (..., S, A, d), got {tuple(phi.shape)}")
    S, A, d = phi.shape[-3:]
    _, _, x, R = _tabular(states, actions, rewards, S, A)
    alpha, gamma = check_number(alpha, "alpha", 0, strict=True), check_gamma(gamma)
    beta, n_iters = _check_beta(beta), check_int(n_iters, "n_iters")
    W = as_tensor(W, "W", torch.float64)
    if W.shape[-2:] != (d, d):
        raise ValueError(f"`W` must have shape ({d}, {d}) or (..., {d}, {d}), got {tuple(W.shape)}")
    batch = torch.broadcast_shapes(phi.shape[:-3], x.shape[:-1], R.shape[:-1], W.shape[:-2])
    x, R = x.expand(batch + x.shape[-1:]), R.expand(batch + R.shape[-1:])
    one_hot = lambda i, k: torch.nn.functional.one_hot(i, k).to(torch.float64)
    E = one_hot(x[..., :-1], S * A)                                   # (..., n, SA) keys
    N = E.sum(-2)                                                     # visits of each pair
    nxt = one_hot(x[..., 1:], S * A) if sarsa else one_hot(x[..., 1:] // A, S)
    r_hat = (R[..., None, :] @ E)[..., 0, :] / N.clamp(min=1)          # (..., SA)
    P_hat = E.mT @ nxt / N.clamp(min=1)[..., None]                    # (..., SA, S or SA)
    F = phi.flatten(-3, -2)                                           # (..., SA, d)
    w = torch.softmax(F @ W @ F.mT + N.log()[..., :, None], dim=-2)   # (..., SA keys, SA targets)
    q, qs = R.new_zeros(batch + (S * A,)), []
    for t in range(n_iters + 1):
        qs.append(q.unflatten(-1, (S, A)))
        if t == n_iters: break
        b = q if sarsa else boltzmann_backup(q.unflatten(-1, (S, A)), beta)
        delta = torch.where(N > 0, r_hat + gamma * (P_hat @ b[..., None])[..., 0] - q, 0.)
        q = q + alpha * (delta[..., None, :] @ w)[..., 0, :]
    return torch.stack(qs, -3) if return_all else qs[-1]


# %% [markdown]
# The check: it equals `kernel_q_iteration` at every pair (queries: all $SA$ pairs), for every feature
# kind, every $\beta$ and for SARSA, on small contexts where the full iteration is cheap; and the
# Transformer of 9a, run on the full prompt, gives the same values at its query blocks.

# %%
checks = []
for seed in range(6):
    kind = ("onehot", "random", "unit")[seed % 3]
    m = random_mdp(5, 3, features=kind, seed=100 + seed, d=None if kind == "onehot" else 4)
    S_, A_, R_ = sample_mdp_trajectory(m, 40, seed=seed)
    f, fn = context_features(m, S_, A_)
    W_ = torch.randn(m.d, m.d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    for b in (0., 2., math.inf):
        kw = dict(alpha=0.7, gamma=m.gamma, beta=b, n_iters=10)
        fast = pair_token_q_iteration(m.phi, S_, A_, R_, W_, **kw)
        full = kernel_q_iteration(f, R_, fn, W_, phi_queries=m.phi.flatten(0, 1), **kw)
        full = full[40:].reshape(5, 3)
        model = ControlICTD.from_theta_star(m.d, W_, n_layers=10, alpha=0.7, gamma=m.gamma, beta=b)
        tf = model.predict(build_control_prompt(f, R_, fn, m.phi))
        checks.append(max((fast - full).abs().max().item(), (tf - fast).abs().max().item()))
    kw = dict(alpha=0.7, gamma=m.gamma, beta=0., n_iters=10)
    sarsa = pair_token_q_iteration(m.phi, S_, A_, R_, W_, sarsa=True, **kw)
    full = kernel_q_iteration(f, R_, fn, W_, next_actions=A_[1:], phi_queries=m.phi.flatten(0, 1),
                              **kw)
    full = full[40:].reshape(5, 3)
    checks.append((sarsa - full).abs().max().item())
assert max(checks) < 1e-12, max(checks)
Markdown(f"Largest gap over {len(checks)} comparisons (pair tokens, full iteration, Transformer): "
         f"below $10^{{-12}}$ (asserted).")


# %% [markdown]
# ## The experiment
#
# For each reward kind of `random_mdp` (`"action"`: $r(s, a)$ i.i.d.; `"state"`: $r(s, a) = r(s)$, so that
# only where an action leads matters), 100 MDPs with ten states and three actions, $\gamma = 0.9$,
# one-hot features, none of them shown to the model before. Each MDP gives one uniform-behaviour
# trajectory of 3200 transitions; the context of length $n$ is its first $n$ transitions (nested, so
# that the curves against $n$ are paired). The Transformer is the construction with $W = \kappa I$,
# $\kappa = 20$ (a nearly tabular kernel), $\alpha = 1$ and $\beta \in \{1, 4, \infty\}$; it reads its
# action values at the query blocks of all ten states and acts greedily. Baselines, on the same contexts:
# greedy on in-context SARSA (the behaviour's own values, evaluated by the same kernel, then one greedy
# step: what an evaluation-only learner such as a SARSA construction gives), and the myopic policy
# (greedy on $Q_1$, the kernel-averaged rewards). Intervals are $\pm 1.96$ standard errors over the 100
# MDPs. The seeds of the MDPs and of the trajectories are children of one `SeedSequence` per reward kind.

# %% [markdown]
# The experiment draws 100 long trajectories at once with `sample_mdp_trajectories`, chapter 9's
# sampler batched over MDPs (one step of every chain per loop iteration, from one torch generator).

# %%
#| export
def sample_mdp_trajectories(P,              # (B, S, A, S) transitions of B MDPs
                            r,              # (B, S, A) rewards
                            n:int,          # number of transitions
                            behavior=None,  # (B, S, A) policies; default uniform
                            start=None,     # (B,) start states; default: stationary draws
                            seed=0,         # int or `torch.Generator`
                           )->tuple:        # states (B, n+1), actions (B, n+1), rewards (B, n)
    "Trajectories of B MDPs at once: (states, actions, rewards), like chapter 9's sampler."
    P, r = as_tensor(P, "P", torch.float64), as_tensor(r, "r", torch.float64)
    if P.ndim != 4 or P.shape[1] != P.shape[3]:
        raise ValueError(f"`P` must have shape (B, S, A, S), got {tuple(P.shape)}")
    B, S, A = P.shape[:3]
    if r.shape != (B, S, A):
        raise ValueError(f"`r` must have shape ({B}, {S}, {A}), got {tuple(r.shape)}")
    n = check_int(n, "n", low=1)
    b = torch.full((B, S, A), 1 / A, dtype=torch.float64) if behavior is None \
        else as_tensor(behavior, "behavior", torch.float64)
    g = seed if isinstance(seed, torch.Generator) \
        else torch.Generator().manual_seed(check_int(seed, "seed"))
    if start is None:
        P_b = torch.einsum("bsa,bsat->bst", b, P)
        d = torch.stack([torch.from_numpy(_stationary(Pi.numpy())) for Pi in P_b])
        start = torch.multinomial(d, 1, generator=g)[:, 0]
    s, rows = torch.as_tensor(start).long(), torch.arange(B)
    cum_b, cum_P = b.cumsum(-1), P.cumsum(-1)
    u = torch.rand(n + 1, 2, B, generator=g, dtype=torch.float64)
    states, actions = [s], []
    for t in range(n + 1):
        a = (u[t, 0][:, None] >= cum_b[rows, s]).sum(-1).clamp(max=A - 1)
        actions.append(a)
        if t == n: break
        s = (u[t, 1][:, None] >= cum_P[rows, s, a]).sum(-1).clamp(max=S - 1)
        states.append(s)
    states, actions = torch.stack(states, -1), torch.stack(actions, -1)
    return states, actions, r[rows[:, None], states[:, :-1], actions[:, :-1]]


# %%
mdps_t = [random_mdp(4, 2, seed=s) for s in range(3)]
St_b, At_b, Rt_b = sample_mdp_trajectories(torch.stack([m.P for m in mdps_t]),
                                           torch.stack([m.r for m in mdps_t]), 50, seed=1)
test_eq((St_b.shape, At_b.shape, Rt_b.shape), ((3, 51), (3, 51), (3, 50)))
for i, m in enumerate(mdps_t):
    test_eq(Rt_b[i], m.r[St_b[i, :-1], At_b[i, :-1]])
    assert all(m.P[St_b[i, k], At_b[i, k], St_b[i, k + 1]] > 0 for k in range(50))


# %%
#| export
def greedy_returns(P,            # (..., S, A, S) transitions
                   r,            # (..., S, A) rewards
                   gamma:float,  # discount
                   q,            # (..., S, A) action values (extra leading axes broadcast)
                   start=None,   # (S,) start distribution; default uniform
                  )->torch.Tensor:  # (...) expected discounted return of each `q`'s greedy policy
    ("Returns of the greedy policies of `q` (chapter 9's greedy actions: ties up to rounding go to "
     "the first), by one batched solve.")
    P, r = as_tensor(P, "P", torch.float64), as_tensor(r, "r", torch.float64)
    q, S = as_tensor(q, "q", torch.float64), P.shape[-1]
    a = greedy_actions(q)                                             # (..., S)
    batch = torch.broadcast_shapes(P.shape[:-3], a.shape[:-1])
    P, r, a = P.expand(batch + P.shape[-3:]), r.expand(batch + r.shape[-2:]), a.expand(batch + (S,))
    P_pi = P.gather(-2, a[..., None, None].expand(batch + (S, 1, S)))[..., 0, :]
    r_pi = r.gather(-1, a[..., None])[..., 0]
    I = torch.eye(S, dtype=torch.float64)
    v = torch.linalg.solve(I - check_gamma(gamma) * P_pi, r_pi[..., None])[..., 0]
    mu = torch.full((S,), 1 / S, dtype=torch.float64) if start is None \
        else as_tensor(start, "start", torch.float64)
    return (v * mu).sum(-1)


# %%
n_grid, L_grid = (25, 50, 100, 200, 400, 800, 1600, 3200), (1, 2, 5, 10, 20, 50, 100)
betas, n_mdps, kappa = (1., 4., math.inf), 100, 20.
def linear_sarsa(S_, A_, R_, alpha, n_iters, n_pairs=30, gamma=0.9):
    "Batch linear SARSA on one-hot pair features, w += (alpha/n) sum_k delta_k phi(x_{k-1})."
    x, n = S_ * 3 + A_, R_.shape[-1]
    E = torch.nn.functional.one_hot(x[:, :-1], n_pairs).double()
    C = E.mT @ torch.nn.functional.one_hot(x[:, 1:], n_pairs).double()      # next-pair counts
    r_sum, N, w, ws = (R_[:, None, :] @ E)[:, 0], E.sum(1), R_.new_zeros(len(R_), n_pairs), []
    for _ in range(n_iters + 1):
        ws.append(w)
        w = w + alpha / n * (r_sum + gamma * (C @ w[..., None])[..., 0] - N * w)
    return torch.stack(ws, 1)

alpha_grid = (1., 2., 4., 8., 16., 32.)
def run_kind(kind, root):
    "Normalised returns of the construction, SARSA-greedy and linear-SARSA-greedy (per alpha)."
    ss_mdp, ss_ctx = np.random.SeedSequence(root).spawn(2)
    mdps = [random_mdp(seed=np.random.default_rng(s), rewards=kind) for s in ss_mdp.spawn(n_mdps)]
    P, r, phi = (torch.stack([getattr(m, k) for m in mdps]) for k in ("P", "r", "phi"))
    trajs = sample_mdp_trajectories(P, r, n_grid[-1], seed=int(ss_ctx.generate_state(1)[0]))
    J_star = greedy_returns(P, r, 0.9, torch.stack([q_star(m) for m in mdps]))
    J_unif = torch.tensor([policy_return(m, uniform_policy(m)) for m in mdps], dtype=torch.float64)
    norm = lambda J: ((J - J_unif[:, None]) / (J_star - J_unif)[:, None]).numpy()
    W = kappa * torch.eye(30, dtype=torch.float64)
    out = np.empty((n_mdps, len(betas), len(n_grid), len(L_grid)))
    sarsa = np.empty((n_mdps, len(n_grid)))
    lin = np.empty((n_mdps, len(alpha_grid), len(n_grid), len(L_grid)))
    kw = dict(alpha=1., gamma=0.9, n_iters=L_grid[-1])
    for i, n in enumerate(n_grid):
        S_, A_, R_ = (trajs[k][:, :n + (k < 2)] for k in range(3))
        for j, b in enumerate(betas):
            Q = pair_token_q_iteration(phi, S_, A_, R_, W, beta=b, return_all=True, **kw)
            J = greedy_returns(P[:, None], r[:, None], 0.9, Q[:, list(L_grid)])          # (MDPs, L)
            out[:, j, i] = norm(J)
        Qs = pair_token_q_iteration(phi, S_, A_, R_, W, beta=0., sarsa=True, **kw)
        sarsa[:, i] = norm(greedy_returns(P, r, 0.9, Qs)[:, None])[:, 0]
        for j, a in enumerate(alpha_grid):
            w = linear_sarsa(S_, A_, R_, a, L_grid[-1])[:, list(L_grid)].unflatten(-1, (10, 3))
            lin[:, j, i] = norm(greedy_returns(P[:, None], r[:, None], 0.9, w))
    return out, sarsa, lin

results = {kind: run_kind(kind, root) for kind, root in zip(MDP_REWARDS, (9001, 9002))}
beta_tex = lambda b: r"\infty" if b == math.inf else f"{b:g}"
mean_ci = lambda x, axis=0: (x.mean(axis), 1.96 * x.std(axis, ddof=1) / math.sqrt(x.shape[axis]))


# %%
#| fig-cap: "Figure 9b.1: Normalised return of the constructed Transformer's greedy policy against context length, at depth L = 100, on 100 unseen MDPs with action rewards (95% intervals)."
#| fig-alt: "Normalised return against context length n from 25 to 3200 on a log axis, action rewards. Three curves for beta = 1, 4 and infinity rise towards 1; the SARSA-greedy baseline lies at or below them; the myopic policy is high."
def acting_plot(kind):
    "Normalised return against context length for one reward kind: the model and the baselines."
    fig, ax = plt.subplots(figsize=(6, 3.8))
    out, sarsa, _ = results[kind]
    curves = [(rf"$\beta = {beta_tex(b)}$, $L = 100$", out[:, j, :, -1])
              for j, b in enumerate(betas)]
    curves += [("SARSA, then greedy", sarsa), ("myopic ($L = 1$)", out[:, -1, :, 0])]
    for k, (lab, x) in enumerate(curves):
        mu, ci = mean_ci(x)
        ax.plot(n_grid, mu, marker="o", ms=3, color=OKABE_ITO[k], label=lab,
                ls="--" if k >= 3 else "-")
        ax.fill_between(n_grid, mu - ci, mu + ci, color=OKABE_ITO[k], alpha=0.2)
    ax.axhline(1, color="k", lw=0.6); ax.axhline(0, color="k", lw=0.6)
    ax.set(xscale="log", xlabel="context length $n$ (transitions)", ylim=(-0.35, 1.1),
           ylabel="normalised return\n(0: uniform behaviour, 1: optimal)",
           title=f'rewards = "{kind}": 100 unseen MDPs (10 states, 3 actions)')
    plain_log_ticks(ax, "x")
    ax.legend(fontsize=8, loc="lower right")

acting_plot("action")

# %%
#| fig-cap: "Figure 9b.2: The same with state rewards, where only the successors separate the actions."
#| fig-alt: "Normalised return against context length n from 25 to 3200 on a log axis, state rewards. Three curves for beta = 1, 4 and infinity rise towards 1; the SARSA-greedy baseline lies at or below them; the myopic policy stays near 0."
acting_plot("state")

# %%
#| fig-cap: "Figure 9b.3: Normalised return against depth (number of layer pairs) for several context lengths, beta = infinity, state rewards (95% intervals)."
#| fig-alt: "Normalised return against depth L from 1 to 100 on a log axis, one curve per context length; every curve starts near 0 at L = 1, rises over the first two to five pairs and levels off, higher for longer contexts."
fig, ax = plt.subplots(figsize=(6, 3.8))
out_state = results["state"][0]
for k, n in enumerate(n_grid[1::2]):
    mu, ci = mean_ci(out_state[:, -1, n_grid.index(n)])
    ax.plot(L_grid, mu, "o-", ms=3, color=OKABE_ITO[k], label=f"n = {n}")
    ax.fill_between(L_grid, mu - ci, mu + ci, color=OKABE_ITO[k], alpha=0.2)
ax.set(xscale="log", xlabel="depth $L$ (layer pairs = iterations)", ylabel="normalised return",
       title=r'State rewards, $\beta = \infty$: return against depth')
plain_log_ticks(ax, "x"); ax.axhline(1, color="k", lw=0.6); ax.legend(fontsize=9);


# %%
def summary(kind):
    out, sarsa, _ = results[kind]
    best, ci = mean_ci(out[:, -1, -1, -1])
    return best, ci, mean_ci(sarsa[:, -1]), mean_ci(out[:, -1, -1, 0])
lines = []
for kind in MDP_REWARDS:
    (best, ci, (s_mu, s_ci), (m_mu, m_ci)) = summary(kind)
    assert best - ci > 0.9, (kind, best, ci)     # the bar, lower end of the interval
    paired = results[kind][0][:, -1, -1, -1] - results[kind][1][:, -1]     # Q-learning - SARSA
    d_mu, d_ci = mean_ci(paired)
    assert d_mu - d_ci > 0, (kind, d_mu, d_ci)
    lines.append(f'rewards = "{kind}": {best:.3f} ± {ci:.2g}, against {s_mu:.3f} ± {s_ci:.2g} for '
                 f'SARSA then greedy (paired difference {d_mu:.3f} ± {d_ci:.2g}) and '
                 f'{m_mu:.3f} ± {m_ci:.2g} for the myopic policy')
record_claim("acting-0.9", "With one-hot features, $W = 20 I$, $\\alpha = 1$, $\\beta = \\infty$, "
             "$L = 100$ and $n = 3200$, "
             "the constructed Transformer's greedy policy reaches a normalised return above 0.9 "
             "(lower end of the "
             "95% interval) on 100 unseen MDPs of each reward kind, and beats greedy-on-SARSA "
             "(paired interval).",
             "measured", "control_acting", "#the-experiment")
Markdown("At $n = 3200$, $L = 100$, $\\beta = \\infty$ (mean ± 95% interval over 100 MDPs): "
         + "; ".join(lines) + ".")


# %% [markdown]
# Reading the figures. With action rewards the immediate reward already separates the actions, so the
# myopic policy is a strong baseline; with state rewards it is not, and everything the model gains
# comes from the backup through the successors. Greedy on SARSA values is one policy-improvement step
# over the behaviour. Where each baseline stands against the deep model, context length by context
# length (paired 95% intervals of the difference, $\beta = \infty$, $L = 100$), and how deep the model
# has to be:

# %%
#| code-fold: true
#| code-summary: "Code: the baselines, length by length, and the depth"
def compare(kind, other):
    "Context lengths at which the model is above / below `other` (paired 95% intervals), for one "
    "reward kind."
    out = results[kind][0][:, -1, :, -1]
    mu, ci = mean_ci(out - other)
    above = [n for n, m, c in zip(n_grid, mu, ci) if m - c > 0]
    below = [n for n, m, c in zip(n_grid, mu, ci) if m + c < 0]
    fmt = lambda ns: ", ".join(map(str, ns)) if ns else "none"
    return f"above at n = {fmt(above)}; below at n = {fmt(below)}"
depth_lines = []
for kind in MDP_REWARDS:
    by_L = results[kind][0][:, -1, -1].mean(0)
    first = next(L for L, v in zip(L_grid, by_L) if v >= by_L[-1] - 0.01)
    depth_lines.append(f'rewards = "{kind}": within 0.01 of its $L = 100$ mean from $L = {first}$ '
                       'on (at $n = 3200$)')
Markdown("\n".join(f"- rewards = \"{kind}\", against SARSA then greedy: "
                   f"{compare(kind, results[kind][1])}; against the myopic policy: "
                   f"{compare(kind, results[kind][0][:, -1, :, 0])}." for kind in MDP_REWARDS)
         + "\n- Depth: " + "; ".join(depth_lines) + ". With $\\alpha = 1$ and a sharp kernel the "
         "iteration is value "
         "iteration on the context's empirical MDP, and the greedy policy settles long before the "
         "values do.")


# %%
#| code-fold: true
#| code-summary: "Code for the tables"
def grid_table(kind):
    "Normalised return at L = 100 (mean ± 95% interval): rows n, columns beta."
    out = results[kind][0]
    cells = [mean_ci(out[:, j, :, -1]) for j in range(len(betas))]
    head = " | ".join(f"$\\beta = {beta_tex(b)}$" for b in betas)
    rows = "\n".join(f"| {n} | " + " | ".join(f"{mu[i]:.3f} ± {ci[i]:.3f}" for mu, ci in cells)
                     + " |" for i, n in enumerate(n_grid))
    return (f'Rewards = "{kind}", $L = 100$:\n\n| $n$ | {head} |\n|---|'
            + "---|" * len(betas) + "\n" + rows)
Markdown("\n\n".join(grid_table(kind) for kind in MDP_REWARDS))

# %% [markdown]
# ## Against linear-attention SARSA at equal depth and context
#
# Liang and Lai construct batch SARSA with linear attention; the book's linear-attention layer
# ([chapter 7](linear.html)) runs batch linear TD, one step per layer, and on the chain of pairs that is
# batch semi-gradient SARSA, $w \leftarrow w + \frac{\alpha}{n} \sum_k \delta_k \phi(S_{k-1}, A_{k-1})$
# with $\delta_k = R_k + \gamma w^\top \phi(S_k, A_k) - w^\top \phi(S_{k-1}, A_{k-1})$. This is our stand-in
# for their construction (theirs is one layer; the comparison gives SARSA the same depth $L$ as the
# softmax model, one step per layer). `linear_sarsa` computes it on one-hot pair features, and is
# checked against chapter 1's `batch_linear_td` below. Its step size is tuned per context length and
# depth over the grid shown, on the same 100 MDPs it is scored on (which favours it); the softmax
# construction is not tuned. Then both act greedily.

# %%
#| code-fold: true
#| code-summary: "Code: the check of linear SARSA, and the table"
m5 = random_mdp(seed=5)
S_l, A_l, R_l = sample_mdp_trajectories(m5.P[None], m5.r[None], 40, seed=5)
I30 = torch.eye(30, dtype=torch.float64)
ref_lin = batch_linear_td(I30[S_l[0] * 3 + A_l[0]], R_l[0], alpha=4., gamma=0.9, n_iters=12,
                          phi_queries=I30)[41:]
test_close(linear_sarsa(S_l, A_l, R_l, 4., 12)[0, -1], ref_lin, eps=1e-12)
rows, at_edge = [], 0
for kind in MDP_REWARDS:
    out, _, lin = results[kind]
    for l, L in enumerate(L_grid):
        if L not in (2, 10, 100): continue
        for i, n in enumerate(n_grid):
            if n not in (100, 400, 3200): continue
            best = lin[:, :, i, l].mean(0).argmax()
            at_edge += int(best == len(alpha_grid) - 1)
            q_mu, q_ci = mean_ci(out[:, -1, i, l])
            d_mu, d_ci = mean_ci(out[:, -1, i, l] - lin[:, best, i, l])
            rows.append(f"| {kind} | {n} | {L} | {q_mu:.3f} ± {q_ci:.2g} | "
                        f"{lin[:, best, i, l].mean():.3f} (alpha = {alpha_grid[best]:g}) | "
                        f"{d_mu:+.3f} ± {d_ci:.2g} |")
Markdown("| rewards | $n$ | $L$ | softmax Q-learning ($\\beta = \\infty$) | tuned linear SARSA, "
         "then greedy | paired difference |\n|---|---|---|---|---|---|\n" + "\n".join(rows)
         + f"\n\nThe tuned step size sits at the grid's largest value, {alpha_grid[-1]:g}, in "
         f"{at_edge} of the {len(rows)} cells; there a larger step might do better for SARSA.")


# %%
def ahead_of_linear(kind):
    "Paired difference at the longest context and depth, against the best step size."
    out, _, lin = results[kind]
    best = lin[:, :, -1, -1].mean(0).argmax()
    return mean_ci(out[:, -1, -1, -1] - lin[:, best, -1, -1])
ahead = {kind: ahead_of_linear(kind) for kind in MDP_REWARDS}
assert all(m - c > 0 for m, c in ahead.values()), ahead
record_claim("beats-linear-sarsa", "At $n = 3200$ and $L = 100$ the softmax Q-learning "
             "construction's greedy policy beats greedy-on-linear-SARSA (batch linear TD on pair "
             "features, step size tuned on the same MDPs) on 100 unseen MDPs of each reward kind "
             "(paired 95% intervals).", "measured",
             "control_acting", "#against-linear-attention-sarsa-at-equal-depth-and-context")
Markdown("At $n = 3200$, $L = 100$ the paired difference (softmax Q-learning minus tuned linear "
         "SARSA) is "
         + "; ".join(f'{m:.3f} ± {c:.2g} with rewards = "{k}"' for k, (m, c) in ahead.items())
         + " (both asserted above 0).")


# %% [markdown]
# ## Online: the agent appends its own transitions
#
# So far the context came from the uniform behaviour. Online, the agent acts on its own in-context
# Q-values and its transitions join the context. The protocol (ours): 100 MDPs with state rewards;
# an initial uniform-behaviour context of 200 transitions; then 10 blocks of 200 steps in which the
# agent continues the trajectory $\varepsilon$-greedily ($\varepsilon = 0.1$) on the Q-values of the
# current context (the construction above, $\beta = \infty$, $L = 100$), which are recomputed after
# each block. After each block the greedy policy of the current context is scored exactly. The
# comparison continues the same trajectory with the uniform behaviour instead, so that both contexts
# have the same length at every point.

# %%
#| code-fold: true
#| code-summary: "Code: the online protocol"
def online(root, n0=200, blocks=10, H=200, eps=0.1, agent=True):
    "Normalised return of the greedy policy after each block (MDPs, blocks + 1)."
    ss_mdp, ss_ctx = np.random.SeedSequence(root).spawn(2)
    mdps = [random_mdp(seed=np.random.default_rng(s), rewards="state")
            for s in ss_mdp.spawn(n_mdps)]
    P, r, phi = (torch.stack([getattr(m, k) for m in mdps]) for k in ("P", "r", "phi"))
    g = torch.Generator().manual_seed(int(ss_ctx.generate_state(1)[0]))
    S_, A_, R_ = sample_mdp_trajectories(P, r, n0, seed=g)
    J_star = greedy_returns(P, r, 0.9, torch.stack([q_star(m) for m in mdps]))
    J_unif = torch.tensor([policy_return(m, uniform_policy(m)) for m in mdps], dtype=torch.float64)
    W, scores = kappa * torch.eye(30, dtype=torch.float64), []
    for k in range(blocks + 1):
        Q = pair_token_q_iteration(phi, S_, A_, R_, W, alpha=1., gamma=0.9, beta=math.inf,
                                   n_iters=100)
        scores.append(((greedy_returns(P, r, 0.9, Q) - J_unif) / (J_star - J_unif)).numpy())
        if k == blocks: break
        pi = (1 - eps) * greedy_policy(Q) + eps / 3 if agent else None   # None: uniform
        St, At, Rt = sample_mdp_trajectories(P, r, H, behavior=pi, start=S_[:, -1], seed=g)
        S_, A_ = torch.cat([S_, St[:, 1:]], 1), torch.cat([A_[:, :-1], At], 1)
        R_ = torch.cat([R_, Rt], 1)
    return np.stack(scores, 1)

on, off = online(9101), online(9101, agent=False)

# %%
#| fig-cap: "Figure 9b.4: Online acting, state rewards: normalised return of the greedy policy as the agent appends its own epsilon-greedy transitions to its context, against a context grown by the uniform behaviour (100 MDPs, 95% intervals)."
#| fig-alt: "Normalised return against the context length from 200 to 2200 transitions; two curves start at the same point; the online agent's curve and the uniform-behaviour curve both rise."
fig, ax = plt.subplots(figsize=(6, 3.8))
lengths = 200 + 200 * np.arange(on.shape[1])
for k, (lab, x) in enumerate((("agent's own transitions (epsilon-greedy, 0.1)", on),
                              ("uniform behaviour's transitions", off))):
    mu, ci = mean_ci(x)
    ax.plot(lengths, mu, "o-", ms=3, color=OKABE_ITO[k], label=lab)
    ax.fill_between(lengths, mu - ci, mu + ci, color=OKABE_ITO[k], alpha=0.2)
ax.axhline(1, color="k", lw=0.6)
ax.set(xlabel="context length $n$ (200 uniform, then blocks of 200)", ylabel="normalised return",
       title="Online: the context grows with the agent's own transitions", ylim=(None, 1.05))
ax.legend(fontsize=9);

# %%
d_mu, d_ci = mean_ci(on[:, -1] - off[:, -1])
verdict = ("above" if d_mu - d_ci > 0 else "below" if d_mu + d_ci < 0
           else "not distinguishable from")
Markdown(f"After {on.shape[1] - 1} blocks the online agent's greedy policy scores "
         f"{on[:, -1].mean():.3f} "
         f"± {mean_ci(on[:, -1])[1]:.3f} and the uniform-data one {off[:, -1].mean():.3f} ± "
         f"{mean_ci(off[:, -1])[1]:.3f}; the paired difference is {d_mu:.3f} ± {d_ci:.3f}, so the "
         f"agent's "
         f"own data leaves it {verdict} the uniform behaviour's at equal context length.")

# %% [markdown]
# ## Implementation and tests

# %%
show_doc(pair_token_q_iteration)

# %%
show_doc(greedy_returns)

# %% [markdown]
# `greedy_returns` agrees with chapter 9's return of the greedy policy; `pair_token_q_iteration`
# batches over contexts; bad input is refused.

# %%
m7 = random_mdp(seed=7)
q7 = torch.randn(10, 3, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
test_close(greedy_returns(m7.P, m7.r, 0.9, q7).item(), policy_return(m7, greedy_policy(q7)),
           eps=1e-12)
S7, A7, R7 = sample_mdp_trajectory(m7, 60, seed=7)
kw7 = dict(alpha=1., gamma=0.9, beta=2., n_iters=5)
W7 = 3 * torch.eye(30, dtype=torch.float64)
flipped = (torch.stack([x, x.flip(0)]) for x in (S7, A7, R7))
both = pair_token_q_iteration(m7.phi, *flipped, W7, **kw7)
test_close(both[0], pair_token_q_iteration(m7.phi, S7, A7, R7, W7, **kw7), eps=1e-13)
test_fail(lambda: pair_token_q_iteration(m7.phi, S7, A7, R7, torch.eye(3), **kw7),
          contains="`W` must have shape (30, 30)")
test_fail(lambda: pair_token_q_iteration(m7.phi[0], S7, A7, R7, torch.eye(3), **kw7),
          contains="`phi` must have shape")
test_fail(lambda: pair_token_q_iteration(m7.phi, S7, A7 + 3, R7, torch.eye(30), **kw7),
          contains="`actions` must hold")

# %%
#| export
from ictd.boyan import check_arguments
check_arguments(globals())   # public functions refuse arguments their annotations rule out (ch. 0)

# %%
#| hide
import nbdev; nbdev.nbdev_export()
