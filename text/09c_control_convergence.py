# %%
#| default_exp control_convergence

# %%
#| export
from __future__ import annotations
import math
import torch
from ictd.boyan import as_tensor, check_gamma
from ictd.core import check_number
from ictd.control import boltzmann_backup, _check_beta

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
from ictd.control import (MDP, random_mdp, sample_mdp_trajectory, q_star, stationary_distribution,
                          uniform_policy, batch_tabular_q)
from ictd.control_acting import pair_token_q_iteration

# %% [markdown]
# # When in-context Q-iteration converges
# > A contraction condition for kernel soft Q-iteration (the kernel's diagonality against gamma and beta), a two-state MDP on which the Boltzmann iteration oscillates and three cures, and the error to q* against depth and context length.

# %% [markdown]
# ::: {.callout-tip title="What this page shows"}
# - Proposition 9c.1 [ours]: the iteration contracts when the kernel's diagonal mass beats
#   $(1 + \gamma c_\beta)/2$, with $c_\beta$ the backup's Lipschitz constant.
# - Example 9c.1 [ours]: an MDP on which undamped Boltzmann iteration oscillates, and three cures.
# - The error to $q_*$ against depth and context length: a geometric depth term and an $n^{-1/2}$ floor.
# :::
#
# The Boltzmann backup is not a non-expansion: Asadi and Littman (ICML 2017) show that value
# iteration with it can have several fixed points or fail to converge, and propose mellowmax, a
# non-expansion, instead. Mellowmax is a log-mean-exp, not a weighted average of the values, so an
# attention head does not form it. This page asks what that means for the Transformer of
# [9a](control_transformer.html), whose backup head is a Boltzmann average with a fixed $\beta$.
# Everything on it is the book's own analysis.
#
# *How to read this page.* The contraction condition and its check; the oscillating example and
# its cures, with a figure; the error against depth and length, with a figure. Helpers and bulk
# checks are in [Implementation and tests](#implementation-and-tests).

# %% [markdown]
# ## A contraction condition
#
# In the tabular limit or in the limit of an infinitely long stationary context, the iteration of
# Definition 9.1 runs on the pairs with a row-stochastic attention matrix $M$ (row $y$: the weights
# $w(x \mid y)$ of [9b](control_acting.html#one-token-per-pair)) and the empirical or true $\hat r$,
# $\hat P$:
#
# $$F(Q) = Q + \alpha M\big(\hat r + \gamma \hat P B_\beta(Q) - Q\big).$$
#
# The backup's gradient is $\partial B_\beta / \partial q_a = p_a\big(1 + \beta (q_a - B_\beta(q))\big)$ with
# $p = \mathrm{softmax}(\beta q)$. Its entries sum to 1 but can be negative (for actions well below the
# backup), so its $\ell_1$ norm, the Lipschitz constant of $B_\beta$ in the sup norm, exceeds 1:
# it is $1 + \beta \sum_a p_a |q_a - B_\beta(q)| \le 1 + \beta w/2$ on values of spread at most $w$.
#
# ::: {.proposition}
# **Proposition 9c.1 (ours).** Let $m = \min_y M(y, y)$, $\alpha \in (0, 1]$, $\bar r = \max |\hat r|$
# and suppose $2m - 1 - \gamma > 0$. The box $\lVert Q \rVert_\infty \le R_0 = \bar r / (2m - 1 - \gamma)$
# is invariant under $F$, and on it $F$ is Lipschitz in the sup norm with constant
# $\rho = 1 - \alpha(2m - 1 - \gamma c_\beta)$, where $c_\beta = 1$ for $\beta \in \{0, \infty\}$ and
# $c_\beta \le 1 + \beta R_0$ otherwise. So if $2m - 1 > \gamma c_\beta$ the iteration from $Q_0 = 0$
# converges geometrically, at rate $\rho$, to the unique fixed point in the box. In the tabular case
# ($M = I$) the condition reads $\gamma c_\beta < 1$: always for $\beta \in \{0, \infty\}$, and for
# $\beta < (1 - \gamma)^2 / (\gamma \bar r)$ in general.
# :::
#
# ::: {.callout-note collapse="true" title="Proof"}
# $F(Q) = (I - \alpha M) Q + \alpha M \hat r + \alpha\gamma M \hat P B_\beta(Q)$. Row $y$ of $I - \alpha M$ has
# absolute sum $|1 - \alpha M(y, y)| + \alpha (1 - M(y, y)) = 1 - \alpha(2 M(y, y) - 1)$ for
# $\alpha \le 1$; $M$ and $\hat P$ are row-stochastic; and
# $\lVert B_\beta(Q) \rVert_\infty \le \lVert Q \rVert_\infty$ (a weighted average). So
# $\lVert F(Q) \rVert_\infty \le (1 - \alpha(2m-1))R_0 + \alpha \bar r + \alpha\gamma R_0 = R_0$ on the box: it is invariant. For two points of the box,
# $F(Q) - F(Q') = (I - \alpha M)(Q - Q') + \alpha\gamma M \hat P (B_\beta(Q) - B_\beta(Q'))$, and the
# backup is Lipschitz with constant $c_\beta$ on the box, because the values of one state there spread
# over at most $2R_0$, so $\sum_a p_a |q_a - B_\beta| \le R_0$ (a mean absolute deviation is at most half
# the range); the max and the mean are non-expansions. Add the two bounds. With $M = I$, $m = 1$,
# $R_0 = \bar r/(1 - \gamma)$ and $\gamma(1 + \beta R_0) < 1$ is the stated bound on $\beta$.
# :::
#
# The condition is sufficient, and for intermediate $\beta$ it is very conservative (the bound for the
# book's default discount is computed below). The check samples attention matrices with
# diagonal mass above the threshold, random MDPs and $\beta$ at 0.9 of the largest value the
# condition allows, and measures $\lVert F(Q) - F(Q') \rVert / \lVert Q - Q' \rVert$ for random pairs
# in the box against $\rho$.

# %%
Markdown(f"In the tabular case with $\\gamma = 0.9$ and rewards in $[-1, 1]$ the condition allows "
         f"only "
         f"$\\beta < {(1 - 0.9) ** 2 / 0.9:.4f}$.")


# %%
#| export
def population_q_map(Q,          # (..., S, A) action values
                     M,          # (..., SA, SA) row-stochastic attention (row y: target y)
                     r,          # (..., S, A) rewards
                     P,          # (..., S, A, S) transitions
                     *, alpha:float, gamma:float, beta:float,
                    )->torch.Tensor:  # (..., S, A)
    "One step $F(Q) = Q + \\alpha M (r + \\gamma P B_\\beta(Q) - Q)$ of soft Q-iteration on pairs."
    alpha, gamma = check_number(alpha, "alpha", 0, strict=True), check_gamma(gamma)
    beta = _check_beta(beta)
    Q, M, r, P = (as_tensor(t, name, torch.float64) for t, name in ((Q, "Q"), (M, "M"), (r, "r"), (P, "P")))
    if Q.ndim < 2 or r.shape[-2:] != Q.shape[-2:] or P.shape[-3:] != Q.shape[-2:] + Q.shape[-2:-1] \
            or M.shape[-2:] != (Q.shape[-2] * Q.shape[-1],) * 2:
        raise ValueError(f"`Q` (..., S, A), `r` (..., S, A), `P` (..., S, A, S) and `M` (..., SA, SA) must "
                         f"agree, got {tuple(Q.shape)}, {tuple(r.shape)}, {tuple(P.shape)}, {tuple(M.shape)}")
    td = r + gamma * (P @ boltzmann_backup(Q, beta)[..., None, :, None])[..., 0] - Q
    return Q + alpha * (M @ td.flatten(-2)[..., None])[..., 0].unflatten(-1, Q.shape[-2:])

def contraction_rate(M, r, gamma:float, beta:float, alpha:float=1.)->tuple:
    "(rho, R_0) of Proposition 9c.1, or rho >= 1 when the condition fails."
    M, r, gamma = as_tensor(M, "M", torch.float64), as_tensor(r, "r", torch.float64), check_gamma(gamma)
    alpha, beta = check_number(alpha, "alpha", 0, strict=True), _check_beta(beta)
    if M.ndim < 2 or M.shape[-1] != M.shape[-2] or r.ndim < 2:
        raise ValueError(f"`M` must be (..., SA, SA) and `r` (..., S, A), got {tuple(M.shape)}, {tuple(r.shape)}")
    m, rbar = torch.diagonal(M, dim1=-2, dim2=-1).amin(-1), r.abs().amax((-2, -1))
    R0 = rbar / (2 * m - 1 - gamma)
    c = torch.ones_like(R0) if beta in (0, math.inf) else 1 + beta * R0
    return 1 - alpha * (2 * m - 1 - gamma * c), R0


# %%
g9, ratios, margins = torch.Generator().manual_seed(0), [], []
for trial in range(200):
    S, A = 3 + trial % 4, 2 + trial % 3
    mdp = random_mdp(S, A, gamma=float(0.5 + 0.4 * torch.rand(1, generator=g9)), seed=trial)
    u = torch.rand(S * A, generator=g9, dtype=torch.float64)
    diag = 0.5 + (1 + mdp.gamma) / 4 + 0.2 * u                             # m > (1 + gamma)/2
    off = torch.rand(S * A, S * A, generator=g9, dtype=torch.float64)
    off = off * (1 - torch.eye(S * A, dtype=torch.float64))
    diag = diag.clamp(max=1)
    M = torch.diag(diag) + off / off.sum(-1, keepdim=True) * (1 - diag)[:, None]
    m = M.diagonal().min().item()
    rbar = mdp.r.abs().max().item()
    R0 = rbar / (2 * m - 1 - mdp.gamma)
    beta_max = (2 * m - 1 - mdp.gamma) / (mdp.gamma * R0)            # 2m - 1 = gamma (1 + beta R0)
    beta = (0., 0.9 * beta_max, math.inf)[trial % 3]
    alpha = float(0.3 + 0.7 * torch.rand(1, generator=g9))
    rho, _ = contraction_rate(M, mdp.r, mdp.gamma, beta, alpha)
    box = lambda: (2 * torch.rand(8, S, A, generator=g9, dtype=torch.float64) - 1) * R0
    Q1, Q2 = box(), box()
    kw = dict(alpha=alpha, gamma=mdp.gamma, beta=beta)
    num = population_q_map(Q1, M, mdp.r, mdp.P, **kw) - population_q_map(Q2, M, mdp.r, mdp.P, **kw)
    num = num.abs().amax((-2, -1))
    ratio = (num / (Q1 - Q2).abs().amax((-2, -1))).max().item()
    assert rho < 1 and ratio <= rho.item() + 1e-12, (trial, ratio, rho)
    F_box = population_q_map(Q1, M, mdp.r, mdp.P, **kw).abs().max().item()
    assert F_box <= R0 * (1 + 1e-12), (trial, F_box, R0)
    ratios.append(ratio / rho.item())
record_claim("contraction", "Kernel soft Q-iteration on pairs is a sup-norm contraction with rate "
             "$1 - \\alpha(2m - 1 - \\gamma c_\\beta)$ when the attention's least diagonal mass "
             "$m$ exceeds "
             "$(1 + \\gamma c_\\beta)/2$, with $c_\\beta = 1$ for $\\beta \\in \\{0, \\infty\\}$ "
             "and "
             "$c_\\beta \\le 1 + \\beta R_0$ otherwise (Proposition 9c.1).", "proved",
             "control_convergence",
             "#a-contraction-condition")
Markdown(f"On {len(ratios)} random cases the measured Lipschitz ratio never exceeds $\\rho$ "
         f"(asserted) and the box is invariant "
         f"(asserted); the largest ratio is {max(ratios):.2f} of $\\rho$, the median "
         f"{np.median(ratios):.2f}.")

# %% [markdown]
# ## An MDP on which the Boltzmann iteration oscillates
#
# **Example 9c.1 (ours, found by a seeded search over small MDPs and then rounded).** Two states, two
# actions, deterministic: in state 0 both actions lead to state 1 and pay $+\tfrac12$ and
# $-\tfrac12$; in state 1 action 0 leads to state 0 and pays 0, action 1 stays and pays $-1$;
# $\gamma = 0.99$. Run the tabular iteration ($M = I$, $\alpha = 1$: soft value iteration) from $Q_0 = 0$.

# %%
P_ex = torch.zeros(2, 2, 2, dtype=torch.float64)
P_ex[0, :, 1] = 1.; P_ex[1, 0, 0] = 1.; P_ex[1, 1, 1] = 1.
r_ex = torch.tensor([[0.5, -0.5], [0., -1.]], dtype=torch.float64)
gamma_ex, I4 = 0.99, torch.eye(4, dtype=torch.float64)
def soft_vi(beta, alpha=1., n_iters=5000):
    "Iterates of the tabular iteration on Example 9c.1 from Q_0 = 0."
    Qs = [torch.zeros(2, 2, dtype=torch.float64)]
    for _ in range(n_iters):
        Qs.append(population_q_map(Qs[-1], I4, r_ex, P_ex, alpha=alpha, gamma=gamma_ex, beta=beta))
    return torch.stack(Qs)
def amplitude(Qs): return (Qs[-1] - Qs[-2]).abs().max().item()
def sweep_amplitudes(betas, n_iters=10_000):
    "The last step's size after `n_iters` undamped iterations, for many beta at once (batched)."
    b = torch.as_tensor(betas, dtype=torch.float64)[:, None, None]
    Q = torch.zeros(len(betas), 2, 2, dtype=torch.float64)
    for _ in range(n_iters):
        B = (torch.softmax(b * Q, -1) * Q).sum(-1)
        new = r_ex + gamma_ex * (P_ex @ B[:, None, :, None])[..., 0]
        Q, step = new, (new - Q).abs().amax((-2, -1))
    return step.numpy()
beta_sweep = np.round(np.arange(0.25, 12.01, 0.25), 2)
amps = sweep_amplitudes(beta_sweep)
window = beta_sweep[amps > 1e-6]
cure_runs = {r"$\beta = \infty$": soft_vi(math.inf),
             r"$\beta = 4$, $\alpha = 1/2$": soft_vi(4., 0.5),
             r"$\beta = 1/2$": soft_vi(0.5)}
cures = {lab: amplitude(Qs) for lab, Qs in cure_runs.items()}
period2 = soft_vi(4.)
assert amplitude(period2) > 0.5 and (period2[-1] - period2[-3]).abs().max() < 1e-9      # a 2-cycle
assert all(a < 1e-9 for a in cures.values())
assert (amps[np.isin(beta_sweep, (2., 3., 4.))] > 0.5).all()
assert (amps[np.isin(beta_sweep, (0.5, 8., 12.))] < 1e-9).all()
Markdown(f"Undamped, the iterates settle into a cycle of period 2 for $\\beta$ from "
         f"{window.min():g} "
         f"to {window.max():g} "
         f"on a grid of step 0.25 up to 12 (amplitude up to {amps.max():.2f}; a 2-cycle asserted "
         f"at $\\beta = 4$, "
         f"oscillation at 2, 3, 4 and convergence at 0.5, 8, 12 asserted, away from the window's "
         f"edges); with each "
         f"cure the last step is below $10^{{-9}}$ (asserted).")

# %% [markdown]
# *Why.* In state 1 the two actions are $Q(1, 0) = \gamma V_0$ and $Q(1, 1) = -1 + \gamma V_1$, and state 0's
# actions differ by a constant, so its backup is $\gamma V_1$ plus a constant, a step later. Linearise at
# the fixed point: with $g_0, g_1$ the backup's sensitivities in state 1 ($g_0 + g_1 = 1$), the map on
# $(V_1, V_0)$ has matrix $\gamma \begin{pmatrix} g_1 & g_0 \\ 1 & 0 \end{pmatrix}$, whose eigenvalue
# $\gamma\big(g_1 - \sqrt{g_1^2 + 4 g_0}\big)/2 = -\gamma(1 + \varepsilon)$ when $g_1 = -\varepsilon$. The
# worse action's sensitivity $g_1 = p_1(1 - \beta \Delta p_0)$ ($\Delta$ the gap) is negative when
# $\beta\Delta p_0 > 1$; once $\gamma(1 + \varepsilon) > 1$ the fixed point is
# unstable and the iterates oscillate. The max ($\beta = \infty$) has $g_1 = 0$ and the mean $g_1 = \tfrac12$;
# a step $\alpha = 1/2$ maps the eigenvalue to $1 - \alpha + \alpha\lambda > -1$. The smallest sensitivity
# and the eigenvalue at the fixed point are computed below.

# %%
fixed = cure_runs[r"$\beta = 4$, $\alpha = 1/2$"][-1]
step_at_4 = lambda q: population_q_map(q, I4, r_ex, P_ex, alpha=1., gamma=gamma_ex, beta=4.)
J = torch.autograd.functional.jacobian(step_at_4, fixed)
eig = torch.linalg.eigvals(J.reshape(4, 4)).real
x = torch.linspace(0, 10, 10001, dtype=torch.float64)
sens = torch.sigmoid(-x) * (1 - x * torch.sigmoid(x))
assert eig.min() < -1 and sens.min() < -(1 - gamma_ex) / gamma_ex
Markdown(f"At $\\beta = 4$ the fixed point (found with $\\alpha = 1/2$) has a Jacobian eigenvalue "
         f"{eig.min():.3f} $< -1$ "
         f"(asserted); the smallest sensitivity of the worse of two actions over $\\beta\\Delta "
         f"\\ge 0$ is {sens.min():.3f}, "
         f"at $\\beta\\Delta = {x[sens.argmin()]:.2f}$, below $-(1 - \\gamma)/\\gamma = "
         f"{-(1 - gamma_ex) / gamma_ex:.4f}$.")

# %%
#| fig-cap: "Figure 9c.1: Example 9c.1: the size of each step, which stays large for beta = 4 (a 2-cycle) and falls to round-off with each cure."
#| fig-alt: "Log-scale step size against the iteration up to 5000; the beta = 4 undamped curve stays near 1, the three cures fall to 1e-13, the damped one most slowly."
fig, ax = plt.subplots(figsize=(6, 3.6))
steps = lambda Qs: (Qs[1:] - Qs[:-1]).abs().amax((-2, -1)).numpy()
runs = [(r"$\beta = 4$, $\alpha = 1$", period2)] + list(cure_runs.items())
for k, (lab, Qs) in enumerate(runs):
    st = steps(Qs)
    drawn = st >= 1e-13                                             # below: round-off, not drawn
    ax.semilogy(np.arange(1, len(Qs))[drawn], st[drawn], color=OKABE_ITO[k], label=lab, lw=1.2)
ax.set(xlabel="iteration $l$", ylabel="$\\max|Q_l - Q_{l-1}|$ (return units)",
       ylim=(1e-13, 100), title="size of each step")
ax.legend(fontsize=8);

# %%
#| fig-cap: "Figure 9c.2: Example 9c.1: the size of the last step against beta, zero outside a window of intermediate beta."
#| fig-alt: "Size of the last step against beta from 0.25 to 12, zero outside a window of intermediate beta and about 1 inside it."
fig, ax = plt.subplots(figsize=(6, 3.4))
ax.plot(beta_sweep, amps, "o-", ms=3, color=OKABE_ITO[0])
ax.set(xlabel=r"inverse temperature $\beta$",
       ylabel="size of the last step\n(after 10000 iterations)",
       title=r"oscillation against $\beta$ ($\alpha = 1$)");

# %%
record_claim("oscillation", "Undamped Boltzmann soft Q-iteration oscillates (a 2-cycle) on a "
             "deterministic two-state MDP "
             "with $\\gamma = 0.99$ for intermediate $\\beta$; $\\beta = \\infty$, a small "
             "$\\beta$ or a step $\\alpha = 1/2$ "
             "each restore convergence (Example 9c.1).", "proved", "control_convergence",
             "#an-mdp-on-which-the-boltzmann-iteration-oscillates");

# %% [markdown]
# For the Transformer this is a design rule rather than an obstacle: its backup head can run at
# $\beta = \infty$ (the limit of the head, a hard maximum, under which the tabular iteration is a
# contraction), and its step $\alpha$ is a parameter of the value heads. The mechanism needs
# $\gamma(1 + \varepsilon) > 1$, so it is a long-horizon effect: with two actions it is excluded for
# $\gamma < 1/(1 + \varepsilon_{\max})$, where $-\varepsilon_{\max}$ is the smallest sensitivity above.

# %%
Markdown(f"With two actions, $\\varepsilon_{{\\max}} = {-sens.min():.3f}$, so the two-state "
         f"mechanism needs "
         f"$\\gamma > {1 / (1 - sens.min()):.3f}$; page 9b's main claim uses $\\beta = \\infty$.")

# %% [markdown]
# ## Error to $q_*$ against depth and context length
#
# As in [chapter 5](convergence.html), the error of the deep model has two terms: the distance of the
# iterate to the fixed point of the context's iteration (the depth term, geometric in $L$ when the
# iteration contracts) and the distance of that fixed point to $q_*$ (the statistical floor of a finite
# context). The experiment: 100 MDPs of the default family ($\gamma = 0.9$, one-hot features), one
# uniform-behaviour trajectory each, nested contexts of $n = 100$ to $3000$, the construction with
# $W = 20 I$, $\alpha = 1$, $\beta = \infty$, depth up to 120 (the fixed point is the iterate at depth 300).
# The error is the root mean square over pairs weighted by the behaviour's stationary pair distribution,
# $\big(\sum_{s, a} d_b(s) b(a \mid s) (Q_L(s, a) - q_*(s, a))^2\big)^{1/2}$.

# %%
ns_c, Ls_c, n_mdps_c = (100, 300, 1000, 3000), np.arange(0, 121), 100
ss_m, ss_t = np.random.SeedSequence(9101).spawn(2)
mdps_c = [random_mdp(seed=np.random.default_rng(s)) for s in ss_m.spawn(n_mdps_c)]
trajs_c = [sample_mdp_trajectory(m, ns_c[-1], seed=np.random.default_rng(s))
           for m, s in zip(mdps_c, ss_t.spawn(n_mdps_c))]
phi_c, qs_c = torch.stack([m.phi for m in mdps_c]), torch.stack([q_star(m) for m in mdps_c])
mu_c = torch.stack([stationary_distribution(m)[:, None] * uniform_policy(m)
                    for m in mdps_c])                                       # (MDPs, S, A)
rms = lambda Q: ((Q - qs_c[:, None]).square() * mu_c[:, None]).sum((-2, -1)).sqrt()
err_L, floor, depth_gap = {}, {}, {}
for n in ns_c:
    S_, A_, R_ = (torch.stack([t[i][:n + (i < 2)] for t in trajs_c]) for i in range(3))
    Q = pair_token_q_iteration(phi_c, S_, A_, R_, 20. * torch.eye(30, dtype=torch.float64),
                               alpha=1., gamma=0.9,
                               beta=math.inf, n_iters=300, return_all=True)
    err_L[n], floor[n] = rms(Q[:, :121]).numpy(), rms(Q[:, -1:])[:, 0].numpy()
    size = Q[:, -1].abs().amax((-2, -1)).numpy()[:, None]
    depth_gap[n] = (Q[:, :121] - Q[:, -1:]).abs().amax((-2, -1)).numpy() / size
for n in ns_c:                                                          # value iteration's bound
    assert (depth_gap[n] <= 0.9 ** Ls_c * (1 + 1e-6) + 1e-8).all(), n
floor_mu = np.array([floor[n].mean() for n in ns_c])
slope = np.polyfit(np.log(ns_c), np.log(floor_mu), 1)[0]
assert -0.7 < slope < -0.3, slope

# %%
#| fig-cap: "Figure 9c.3: Error of the constructed Transformer's Q-values to q* against depth, for four context lengths (mean over 100 MDPs, 95% bands): a geometric depth term, then a floor that falls with n."
#| fig-alt: "Log-scale error against depth L from 0 to 120, four curves for n = 100, 300, 1000, 3000; all fall together at first, then level off at floors that are lower for longer contexts; a dashed line shows 0.9^L times the initial error."
fig, ax = plt.subplots(figsize=(6, 4))
for k, n in enumerate(ns_c):
    mu, ci = err_L[n].mean(0), 1.96 * err_L[n].std(0, ddof=1) / math.sqrt(n_mdps_c)
    ax.semilogy(Ls_c, mu, color=OKABE_ITO[k], label=f"n = {n}")
    ax.fill_between(Ls_c, mu - ci, mu + ci, color=OKABE_ITO[k], alpha=0.2)
ax.semilogy(Ls_c, err_L[ns_c[0]].mean(0)[0] * 0.9 ** Ls_c, "k--", lw=1,
            label=r"$\gamma^L \times$ error at $L = 0$")
ax.set(xlabel="depth $L$ (layer pairs)", ylabel="weighted RMS error to $q_*$ (return units)",
       ylim=(1e-2, 20),
       title="Error to q* against depth\n100 MDPs, beta = infinity")
plain_log_ticks(ax, "y"); ax.legend(fontsize=9);

# %%
record_claim("depth-and-floor", "The constructed Transformer's error to $q_*$ falls at least as "
             "fast as $\\gamma^L$ towards "
             "its context's fixed point (asserted on 100 MDPs) and then levels off at a floor "
             "whose mean falls with "
             "the context length at a fitted log-log slope between -0.7 and -0.3.", "measured",
             "control_convergence",
             "#error-to-q_-against-depth-and-context-length")
Markdown(f"Floors (mean over the 100 MDPs): "
         + ", ".join(f"{f:.3f} at $n = {n}$" for n, f in zip(ns_c, floor_mu))
         + f"; fitted slope of log floor against log $n$: {slope:.2f} (asserted between $-0.7$ and "
           f"$-0.3$; "
         "$-1/2$ is the rate of a sample mean). The depth term obeys value iteration's bound "
         "$\\lVert Q_L - Q_\\infty \\rVert_\\infty \\le \\gamma^L \\lVert Q_\\infty "
         "\\rVert_\\infty$ on every MDP and length (asserted).")

# %% [markdown]
# Everything so far sets the parameters by hand. [Chapter 9d](control_pretraining.html) trains this Transformer
# from a random start with a Q-learning objective and asks whether the max head emerges.

# %% [markdown]
# ## Implementation and tests

# %%
show_doc(population_q_map)

# %%
show_doc(contraction_rate)

# %% [markdown]
# `population_q_map` with $M = I$ is the tabular update of page 9's `batch_tabular_q` on a context in
# which every pair is visited (the empirical $\hat r$, $\hat P$), and bad arguments are refused:

# %%
m3 = random_mdp(4, 2, seed=31)
rng3 = np.random.default_rng(31)
while True:
    S3, A3, R3 = sample_mdp_trajectory(m3, 80, seed=rng3)
    if len(set((S3[:-1] * 2 + A3[:-1]).tolist())) == 8: break
x3 = S3 * 2 + A3
N3 = torch.bincount(x3[:-1], minlength=8).double()
r_hat = (torch.zeros(8, dtype=torch.float64).index_add_(0, x3[:-1], R3) / N3).reshape(4, 2)
P_hat = torch.zeros(8, 4, dtype=torch.float64).index_put_((x3[:-1], S3[1:]),
                                                         torch.ones(80, dtype=torch.float64),
                                                         accumulate=True)
P_hat = (P_hat / N3[:, None]).reshape(4, 2, 4)
Q3 = torch.zeros(4, 2, dtype=torch.float64)
for _ in range(6):
    Q3 = population_q_map(Q3, torch.eye(8, dtype=torch.float64), r_hat, P_hat, alpha=0.7, gamma=0.9,
                          beta=3.)
test_close(Q3, batch_tabular_q(S3, A3, R3, 4, 2, alpha=0.7, gamma=0.9, beta=3., n_iters=6),
           eps=1e-12)
test_fail(lambda: population_q_map(Q3, torch.eye(8), r_hat, P_hat, alpha=0., gamma=0.9, beta=1.),
          contains="`alpha`")
test_fail(lambda: population_q_map(Q3, torch.eye(8), r_hat, P_hat, alpha=1., gamma=0.9, beta=-1.),
          contains="`beta`")

# %%
#| export
from ictd.boyan import check_arguments
check_arguments(globals())   # every public function refuses, naming it, an argument its annotation rules out (chapter 0)

# %%
#| hide
import nbdev; nbdev.nbdev_export()
