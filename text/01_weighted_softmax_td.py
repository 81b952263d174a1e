# %%
#| default_exp wstd

# %%
#| export
from __future__ import annotations
import math
import numpy as np
import torch
from ictd.boyan import as_tensor, check_gamma
from ictd.core import (
    check_bool,
    check_int,
    check_number,
    check_work,
    chunk_rows,
    memory_path,
    moved_to_keywords,
)

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *

# %%
#| hide
import matplotlib.pyplot as plt
from ictd.boyan import random_boyan_chain, sample_trajectory, msve
from ictd.core import record_claim
from fractions import Fraction
import unittest.mock
import ictd.core

# %%
#| hide
plt.rcParams.update({"axes.titlesize": 10, "figure.titlesize": 11})

# %%
#| hide
from ictd.wstd import (batch_linear_td, batch_tabular_td, certainty_equivalence, context_weights,
                       tabular_rate, two_head_linear_td, weighted_softmax_td)


# %% [markdown]
# # Weighted softmax TD
# > Temporal-difference learning in kernel space: the algorithm a softmax Transformer runs in context, and its exact reductions to batch linear TD and batch tabular TD.

# %% [markdown]
# ::: {.callout-tip title="What this page shows"}
# - **Weighted softmax TD** (Definition 1.1): each value moves by a softmax-weighted average of TD errors; eight
#   lines of code, one iteration worked by hand in exact fractions.
# - Its iterates are kernel regressions over the context: *policy evaluation in kernel space* (Lemma 1.1).
# - Linear TD is an exact special case (Propositions 1.1 to 1.3); tabular TD is a limit (1.5 to 1.7).
# - The Transformer's bilinear score reaches linear TD only to first order at small scores (1.4) and, run
#   long, lands on the tabular answer (1.8).
# :::

# %% [markdown]
# The paper this book follows (Xie et al., 2026) names **weighted softmax TD** and claims that it is policy
# evaluation in a kernel space, that a softmax Transformer runs it in its forward pass, and that linear TD and
# tabular TD are special cases of it. The paper's full text is not available to this project: the exact update
# below, the scores and weights that give each special case, and every proof on this page are **the project's own
# construction**, checked numerically here. Proofs fold out under "Proof"; the library's code, its input checks
# and the exhaustive tests are in [Implementation and tests](#implementation-and-tests). Symbols are listed once
# in [Notation](notation.html).

# %% [markdown]
# ## TD learning in one page
#
# [Chapter 0](boyan.html) set up a Markov reward process with values $v_\pi = r + \gamma P v_\pi$. We only see a
# trajectory $S_0, R_1, S_1, \dots, R_n, S_n$: $n$ transitions, the $k$-th being
# $(S_{k-1}, R_k, S_k)$. Temporal-difference learning replaces the unknown expectation in the
# Bellman equation by the sampled transition. Given an estimate $v$, the **TD error** of transition
# $k$ is
#
# $$\delta_k = R_k + \gamma\, v(S_k) - v(S_{k-1}),$$
#
# whose expectation given $S_{k-1} = x$ is $(r + \gamma P v - v)(x)$, zero for every $x$ exactly
# when $v = v_\pi$. TD moves $v(S_{k-1})$ a step $\alpha$ in the direction of $\delta_k$.
#
# * **Tabular TD** keeps one number per state. The *batch* version we use sweeps the whole
#   trajectory with $v$ frozen and then moves each state by the mean TD error of the transitions
#   that leave it: with $N(x) = \#\{k : S_{k-1} = x\}$,
#   $$v_{t+1}(x) = v_t(x) + \frac{\alpha}{N(x)} \sum_{k:\,S_{k-1} = x} \delta_k^{(t)} \qquad (N(x) > 0),$$
#   and states never left keep their value. Its fixed point makes every mean TD error zero:
#   $\hat v = \hat r + \gamma \hat P \hat v$ with the empirical rewards $\hat r(x)$ and transition
#   frequencies $\hat P(x, y)$ of the trajectory, the **certainty-equivalence** value of the
#   context's empirical MRP.
# * **Linear TD** writes $v(x) = \phi(x)^\top w$ and moves $w$ along the semi-gradient
#   $\delta_k \phi(S_{k-1})$. Batch linear TD(0) averages over the trajectory:
#   $$w_{t+1} = w_t + \frac{\alpha}{n} \sum_{k=1}^{n} \delta_k^{(t)} \phi(S_{k-1}), \qquad w_0 = 0 .$$
#
# Both are *batch* algorithms: every iteration sees the same $n$ transitions. That is the form an
# in-context learner can run, since a Transformer layer sees the whole prompt at once, and in the
# constructions of the later chapters one iteration is one layer.

# %% [markdown]
# ## The kernel view
#
# **Intuition.** Tabular TD moves the value of a state by the TD errors of the transitions that leave it. Replace
# "the transitions that leave it" by "every transition, weighted by how similar the state it leaves is
# to $x$" and you can update the value of *any* state $x$, visited or not. That is the whole idea;
# linear TD already does it, with the inner product of features as the similarity.
#
# Linear TD's update of the value at any state $x$ is, multiplying by $\phi(x)^\top$,
# $$v_{t+1}(x) = v_t(x) + \frac{\alpha}{n} \sum_k \phi(S_{k-1})^\top \phi(x)\; \delta_k^{(t)} .$$
# The weights $w$ have disappeared: the value at $x$ moves by a *kernel-weighted sum of TD errors*,
# and the TD errors themselves only need $v$ at the trajectory states. Weighted softmax TD makes the
# kernel a softmax.
#
# ::: {.definition}
# **Definition 1.1 (weighted softmax TD; the name is the paper's, this exact form is ours).** Given a
# score function $g(x, y)$ (the Transformer's $\phi(x)^\top W \phi(y)$), each transition $k$ gets a
# weight for the target state $x$,
#
# $$K_k(x) = \frac{\exp g(S_{k-1}, x)}{\sum_{k'=1}^{n} \exp g(S_{k'-1}, x)},$$
#
# and, from $v_0 = 0$, for every target state $x$
#
# $$v_{t+1}(x) = v_t(x) + \alpha\, \rho(x) \sum_{k=1}^{n} K_k(x)\, \delta_k^{(t)},
# \qquad \delta_k^{(t)} = R_k + \gamma v_t(S_k) - v_t(S_{k-1}),$$
#
# with step size $\alpha$ and an optional per-target weight $\rho(x) \ge 0$.
# :::
#
# The softmax Transformer runs $\rho = 1$. The update of $v(x)$ needs $v_t$ only at
# $S_0, \dots, S_n$, so the iterate is a vector over the $n + 1$ trajectory states and any query
# states: $m = n + 1 + q$ numbers, whatever the size of the state space $s$. This is **policy evaluation in kernel space**. The keys of the softmax are the
# $n$ transition start states $S_0, \dots, S_{n-1}$; the last state $S_n$ and the queries are
# targets only.
# A target state that never starts a transition gets weights spread over other states; this matters for the
# tabular reduction below. The softmax Transformer of [chapter 3](dual_head.html) runs $\rho = 1$; a
# $\rho \ne 1$ appears below only to show that linear TD fits the algorithm.

# %% [markdown]
# ### A worked example: one iteration by hand
#
# Take three states with one-hot features, the trajectory $S_0, S_1, S_2, S_3 = 0, 1, 0, 2$ with rewards
# $R_1, R_2, R_3 = 1, 0, 2$, and the score $g(x, y) = \log 4 \cdot \mathbf 1[x = y]$, so that $\exp g$ is 4
# on a match and 1 otherwise. Read the weights as a matrix with **one row per transition $k$ (the key
# $S_{k-1}$) and one column per target**: the column of target $x$ is the distribution $K_\cdot(x)$ over
# transitions, and it sums to 1. Target 0 is the state left by transitions 1 and 3, so its column is
# $(4, 1, 4)/9$; target 1 gets $(1, 4, 1)/6$; target 2 is never left, so every transition looks
# equally (dis)similar to it and its column is uniform, $(1, 1, 1)/3$. From $v_0 = 0$ the first TD errors
# are the rewards, $\delta^{(0)} = (1, 0, 2)$, and with $\alpha = 1/2$, $\rho = 1$ the first iterate at each
# target is half its column's weighted average of $\delta^{(0)}$: $v_1(0) = \tfrac12 \cdot \tfrac{4 + 0 + 8}{9} = \tfrac23$,
# $v_1(1) = \tfrac12 \cdot \tfrac{1 + 0 + 2}{6} = \tfrac14$ and $v_1(2) = \tfrac12 \cdot \tfrac{1 + 0 + 2}{3} = \tfrac12$.
# The algorithm is a few lines of code; the cell after it computes these numbers and prints them as fractions.

# %% [markdown]
# With $\rho = 1$ and no queries, Definition 1.1 is this function: one softmax, then one matrix-vector product
# per iteration. (The library's `weighted_softmax_td` is the same iteration with input checks, batches, query
# states, $\rho$, and a path for long contexts that never builds $K$.)

# %%
def softmax_td(phi, R, W, alpha, gamma, n_iters):
    "Definition 1.1 with rho = 1: the values at S_0..S_n after `n_iters` iterations from v_0 = 0."
    K = torch.softmax(phi[:-1] @ W @ phi.T, dim=0)     # (n, n+1): column x holds K_1(x)..K_n(x)
    v = torch.zeros(len(phi), dtype=phi.dtype)
    for _ in range(n_iters):
        delta = R + gamma * v[1:] - v[:-1]             # the TD errors of the n transitions
        v = v + alpha * delta @ K                      # each target moves by its weighted TD error
    return v


# %%
phi_ex = torch.eye(3, dtype=torch.float64)[[0, 1, 0, 2]]  # one-hot features of S_0..S_3
W_ex = math.log(4) * torch.eye(3, dtype=torch.float64)  # exp g = 4 on a match, 1 otherwise
R_ex = torch.tensor([1.0, 0.0, 2.0], dtype=torch.float64)
K_ex = context_weights(phi_ex, W_ex)  # (3 transitions, 4 targets)
v1_ex = softmax_td(phi_ex, R_ex, W_ex, alpha=0.5, gamma=0.9, n_iters=1)
frac = lambda x: str(Fraction(float(x)).limit_denominator(100))
print("weights K (rows: transitions k = 1..3; columns: targets S_0..S_3 = states 0, 1, 0, 2)")
for k in range(3):
    print(f"  k = {k + 1}: " + "  ".join(f"{frac(x):>4}" for x in K_ex[k]))
print("v_1 at the targets:", "  ".join(frac(x) for x in v1_ex))
test_close(K_ex[:, 0], torch.tensor([4, 1, 4], dtype=torch.float64) / 9, eps=1e-15)
test_close(K_ex[:, 3], torch.full((3,), 1 / 3, dtype=torch.float64), eps=1e-15)
test_close(v1_ex, torch.tensor([2 / 3, 1 / 4, 2 / 3, 1 / 2], dtype=torch.float64), eps=1e-15)
test_close(weighted_softmax_td(phi_ex, R_ex, W_ex, alpha=0.5, gamma=0.9, n_iters=1), v1_ex,
           eps=1e-15)


# %% [markdown]
# The next sections use short trajectories of random Boyan chains with unit-norm features and $W = \beta I$
# (`boyan_context`, folded below). On ten of them the eight lines above and the library agree over 40
# iterations:

# %%
#| code-fold: true
#| code-summary: "boyan_context: the contexts of the checks"
def boyan_context(n, seed, n_states=10):
    (
        "Unit-norm features of a trajectory of `n` transitions of a random Boyan chain, its"
        " rewards, and the features of every state."
    )
    chain = random_boyan_chain(n_states=n_states, features="unit", seed=seed)
    S, R = sample_trajectory(chain, n=n, seed=seed)
    return chain.phi[S], R, chain.phi


phi, R, Q = boyan_context(8, seed=0)
W = 3 * torch.eye(4, dtype=torch.float64)

# %%
#| code-fold: true
gaps = [
    (softmax_td(p, R_, W, 0.5, 0.9, 40) - weighted_softmax_td(p, R_, W, alpha=0.5, gamma=0.9,
                                                              n_iters=40)).abs().max()
    for p, R_, _ in (boyan_context(30, seed) for seed in range(10))
]
assert max(gaps) < 1e-12
print("softmax_td and weighted_softmax_td: largest difference below 1e-12 on 10 contexts")

# %% [markdown]
# ## Softmax weights
#
# The weights are a softmax over the keys, one column per target; `torch.softmax` subtracts each column's
# largest score first, so scores of $10^4$ do not overflow.

# %% [markdown]
# ### Normalised kernels: Nadaraya-Watson weighting of TD errors
#
# ::: {.remark}
# **Remark 1.1 (special case: normalised kernel TD).** If $g = \log k$ for a positive similarity kernel $k$,
# then $\exp g = k$ and
# $$K_k(x) = \frac{k(S_{k-1}, x)}{\sum_{k'} k(S_{k'-1}, x)},$$
# so $\sum_k K_k(x) \delta_k$ is the **Nadaraya-Watson** kernel-regression estimate, at $x$, of
# the TD error as a function of the state it starts from. Weighted softmax TD with $\rho = 1$
# moves each value by the locally averaged TD error around it.
# :::
#
# The Transformer's bilinear score
# $\phi(x)^\top W \phi(y)$ is the special case of the exponential kernel
# $k(x, y) = \exp(\phi(x)^\top W \phi(y))$; a Gaussian kernel of bandwidth $h$ is
# $g(x, y) = -\lVert \phi(x) - \phi(y) \rVert^2 / (2h^2)$. [Implementation and tests](#softmax-weights-columns-the-formula-extreme-scores) compares the
# weights with a hand-computed Nadaraya-Watson estimator for both kernels.

# %% [markdown]
# ### From uniform to tabular
#
# With one-hot features and $W = \beta I$ the score is $g(x, y) = \beta\, \mathbf 1[x = y]$. At
# $\beta = 0$ every target weighs all transitions equally; as $\beta$ grows the weight of target $x$
# concentrates, equally, on the transitions that leave $x$. Below: a 30-transition trajectory of a
# 10-state Boyan chain and three targets: the state it leaves most often, one it leaves twice, and
# one it never reaches, posed as a query.

# %%
#| fig-cap: "Figure 1.1: As the score scale beta grows, a target puts its weight on the transitions that leave its own state; a state the context never leaves keeps uniform weights."
#| fig-alt: "Three stacked panels of softmax weight against transition index 1 to 30, one curve per beta from 0 to 16; in the first two panels the weights rise to 1/N on the transitions leaving the target state and fall to 0 elsewhere; in the third panel, for a state never left, all curves lie flat at 1/30."
#| code-fold: true
chain = random_boyan_chain(n_states=10, features="onehot", seed=0)
states, rewards = sample_trajectory(chain, n=30, seed=0)
left = torch.bincount(states[:-1], minlength=10)
targets = [int(left.argmax()), int(torch.nonzero(left == 2)[0]), int(torch.nonzero(left == 0)[0])]
betas = [0, 1, 2, 4, 8, 16]
fig, axs = plt.subplots(3, 1, figsize=(6.1, 5.2), sharex=True)
for ax, x in zip(axs, targets):
    for i, beta in enumerate(betas):
        K = context_weights(chain.phi[states], beta * np.eye(10), phi_queries=chain.phi[x])[:, -1]
        ax.plot(range(1, 31), K, "o-", ms=3, lw=1, color=plt.cm.viridis(i / (len(betas) - 1)),
                label=rf"$\beta = {beta}$")
    hits = np.nonzero((states[:-1] == x).numpy())[0] + 1
    ax.plot(hits, np.zeros_like(hits) - 0.03, "k^", ms=6, label="transitions leaving $x$")
    note = " (the same for every $\\beta$)" if left[x] == 0 else ""
    ax.set_title(f"target state $x = {x}$, left {int(left[x])} times{note}", fontsize=10)
    ax.set(ylabel="weight $K_k(x)$", ylim=(-0.07, 0.56))
axs[-1].set_xlabel("transition $k$ (leaves $S_{k-1}$)")
axs[-1].legend(fontsize=9, ncol=4, loc="upper center")
fig.suptitle(r"Softmax weights over a 30-transition context, scores $\beta\,\mathbf{1}[x = y]$")
plt.tight_layout()


# %% [markdown]
# For a state the context leaves $N(x)$ times the weights approach $1/N(x)$ on its own transitions
# and $0$ elsewhere; for the state it never leaves they stay at $1/n$ for every $\beta$. Exactly,
# for $N(x) \ge 1$,
# $$K_k(x) = \frac{e^{\beta \mathbf 1[S_{k-1} = x]}}{N(x)\, e^\beta + n - N(x)},$$
# $$\sum_k \Big| K_k(x) - \frac{\mathbf 1[S_{k-1} = x]}{N(x)} \Big| = \frac{2 (n - N(x))}{N(x)\, e^\beta + n - N(x)}
# \le \frac{2 (n - N(x))}{N(x)}\, e^{-\beta},$$
# (the $N(x)$ own transitions each fall short of $1/N(x)$ by $\frac{n - N(x)}{N(x) (N(x) e^\beta + n - N(x))}$
# and the others carry $\frac{1}{N(x) e^\beta + n - N(x)}$ each), which the next cell checks for
# every visited state and many $\beta$:

# %%
#| code-fold: true
def tabular_weights(states, n_states):
    "The beta -> infinity limit: 1[S_{k-1} = x] / N(x), shape (n, len(states))."
    E = torch.nn.functional.one_hot(states[:-1], n_states).double()
    return E[:, states] / E.sum(0)[states]

n, tab = len(states) - 1, tabular_weights(states, 10)
N = left[states].double()
for beta in (0., 0.5, 3., 10., 25.):
    K = context_weights(chain.phi[states], beta * np.eye(10))
    visited = N > 0
    l1 = (K - tab).abs().sum(0)[visited]
    test_close(l1, 2 * (n - N[visited]) / (N[visited] * math.exp(beta) + n - N[visited]), eps=1e-13)


# %% [markdown]
# ## Policy evaluation in kernel space
#
# The paper calls weighted softmax TD policy evaluation "in kernel space". Here is the statement
# that phrase can carry, with its proof.
#
# ::: {.proposition}
# **Lemma 1.1 (ours: the iterates lie in the span of the kernel functions).** For every $t$ and every
# state $x$, whether or not it occurs in the context,
# $$v_t(x) = \rho(x) \sum_{k=1}^n c^{(t)}_k\, K_k(x), \qquad c^{(t)}_k = \alpha \sum_{\tau=0}^{t-1} \delta^{(\tau)}_k .$$
# So $v_t$ is a combination of the $n$ normalised kernel functions $x \mapsto K_k(x)$ (times $\rho$),
# one per transition, and its coefficients are the TD errors of that transition accumulated over
# the iterations. The whole state space is evaluated from $n$ numbers.
# :::
#
# ::: {.callout-note collapse="true" title="Proof"}
# Summing the update from $v_0 = 0$,
# $v_t(x) = \sum_{\tau<t} \alpha \rho(x) \sum_k K_k(x) \delta^{(\tau)}_k = \rho(x) \sum_k K_k(x)\, \alpha \sum_{\tau<t} \delta^{(\tau)}_k$.
# The TD errors $\delta^{(\tau)}_k$ depend on the values at the trajectory states only, not on $x$.
# :::
#
# The check runs the iteration on the trajectory alone, takes the coefficients from its TD errors,
# and evaluates $v_t$ at query states it has never seen; the iteration run *with* those queries
# agrees:

# %%
#| code-fold: true
def kernel_coefficients(phi, R, W, alpha, gamma, n_iters):
    (
        "The coefficients c_k^(t) = alpha * sum_{s<t} delta_k^(s) after `n_iters` iterations, from "
        "the trajectory alone."
    )
    v = weighted_softmax_td(
        phi, R, W, alpha=alpha, gamma=gamma, n_iters=n_iters - 1, return_all=True
    )  # v_0..v_{T-1} at S_0..S_n
    delta = torch.as_tensor(R) + gamma * v[:, 1:] - v[:, :-1]
    return alpha * delta.sum(0)


base = weighted_softmax_td(phi, R, W, alpha=0.5, gamma=0.9, n_iters=25)
with_q = weighted_softmax_td(phi, R, W, alpha=0.5, gamma=0.9, n_iters=25, phi_queries=Q)
c_T = kernel_coefficients(phi, R, W, 0.5, 0.9, 25)
K_new = context_weights(phi, W, phi_queries=Q)[:, -len(Q) :]  # K_k(x) at the 10 query states
test_close(c_T @ K_new, with_q[-len(Q) :], eps=1e-13)
test_close(c_T @ context_weights(phi, W), base, eps=1e-13)
_ = record_claim(
    "kernel-span",
    "The iterates of weighted softmax TD are combinations of the $n$ normalised kernel functions,"
    " one per transition, with coefficients the accumulated TD errors (Lemma 1.1).",
    "proved",
    "weighted_softmax_td",
    "#policy-evaluation-in-kernel-space",
)

# %% [markdown]
# To see the kernel functions, take a continuous state. The states of a 13-state Boyan chain sit at
# $x = 0, \tfrac1{12}, \dots, 1$ on a line, with features $\phi(x) = (x, x^2, 1)$, and a
# score matrix $W$ for which the bilinear score is a Gaussian kernel of bandwidth $h$ (folded):
#
# ::: {.callout-note collapse="true" title="A bilinear score that is a Gaussian kernel"}
# $$W = \begin{pmatrix} 1/h^2 & 0 & 0 \\ 0 & 0 & -1/(2h^2) \\ 0 & 0 & 0 \end{pmatrix}, \qquad
# \phi(y)^\top W \phi(x) = \frac{xy}{h^2} - \frac{y^2}{2h^2} = -\frac{(x - y)^2}{2h^2} + \frac{x^2}{2h^2}.$$
#
# The last term depends on the target $x$ only and cancels in the softmax over keys, so this
# *bilinear* score, the kind a Transformer computes, gives exactly the Gaussian (Nadaraya-Watson)
# weights of bandwidth $h$.
# :::
#
# The figure draws $v_T$ on the whole interval as the sum of its kernel
# bumps, one per distinct state the context leaves (the transitions leaving the same state share
# one bump, with the sum of their coefficients).

# %%
#| code-fold: true
#| code-summary: "The context on a line and its Gaussian kernel"
h_bump, s_line = 0.08, 13
line = random_boyan_chain(n_states=s_line, seed=3)
pos = torch.linspace(0, 1, s_line, dtype=torch.float64)
feat = lambda x: torch.stack([x, x**2, torch.ones_like(x)], -1)
W_gauss = torch.tensor([[1, 0, 0], [0, 0, -0.5], [0, 0, 0]], dtype=torch.float64) / h_bump**2
S_line, R_line = sample_trajectory(line, n=40, seed=3)
x_grid = torch.linspace(-0.05, 1.05, 400, dtype=torch.float64)
K_grid = context_weights(feat(pos[S_line]), W_gauss, phi_queries=feat(x_grid))[:, -400:]
gauss = torch.exp(-((pos[S_line[:-1], None] - x_grid[None]) ** 2) / (2 * h_bump**2))
test_close(K_grid, gauss / gauss.sum(0), eps=1e-12)  # the bilinear score is a Gaussian kernel
T_bump = 30
c_line = kernel_coefficients(feat(pos[S_line]), R_line, W_gauss, 0.7, line.gamma, T_bump)
v_grid = weighted_softmax_td(
    feat(pos[S_line]), R_line, W_gauss, alpha=0.7, gamma=line.gamma, n_iters=T_bump,
                             phi_queries=feat(x_grid)
)[-400:]
test_close(c_line @ K_grid, v_grid, eps=1e-12)

# %%
#| fig-cap: "Figure 1.2: The estimate is a sum of kernel bumps, one per state the context leaves: it interpolates between those states and does not extrapolate beyond them."
#| fig-alt: "Value against state position on [0, 1]: shaded bumps, one per state left by the context, colored from dark to light by position; a thick black curve, their sum, follows the orange dots of the true values between the visited states and departs from them at the left end, where no state is left."
#| code-fold: true
fig, ax = plt.subplots(figsize=(6.1, 4.2))
left_states = torch.unique(S_line[:-1])
for i, y in enumerate(left_states):
    own = S_line[:-1] == y
    bump = c_line[own] @ K_grid[own]
    colour = plt.cm.viridis(
        0.85 * float(pos[y])
    )  # one colour per position, dark (left) to light (right)
    ax.fill_between(x_grid, 0, bump, color=colour, alpha=0.3, lw=0)
    ax.plot(
        x_grid,
        bump,
        color=colour,
        lw=1,
        label=(
            "one bump per state $y$ left: $\\sum_{k:\\,S_{k-1} = y} c_k K_k(x)$" if i == 0 else None
        ),
    )
ax.plot(x_grid, v_grid, "k", lw=2.2, label=f"$v_{{{T_bump}}}(x)$ = sum of the bumps")
ax.plot(
    pos,
    line.v_pi,
    "o",
    color="#D55E00",
    ms=6,
    mec="k",
    label=r"true $v_\pi$ at the chain's 13 states",
)
ax.plot(
    pos[left_states],
    np.full(len(left_states), -0.2),
    "k|",
    ms=10,
    label="states the context leaves",
)
ax.axhline(0, color="grey", lw=0.6)
ax.set(
    xlabel="state position $x$",
    ylabel="value (return units)",
    title=(
        f"Weighted softmax TD as kernel regression: $n = 40$, Gaussian kernel $h = {h_bump}$, $t ="
        f" {T_bump}$"
    ),
)
ax.legend(fontsize=8, loc="lower right");

# %%
#| code-fold: true
never_left = [int(x) for x in range(s_line) if x not in left_states]
v_at_states = weighted_softmax_td(
    feat(pos[S_line]), R_line, W_gauss, alpha=0.7, gamma=line.gamma, n_iters=T_bump,
                                  phi_queries=feat(pos)
)[-s_line:]
for x in never_left:
    print(
        f"state {x} (x = {pos[x]:.3f}, never left): v_{T_bump} = {v_at_states[x]:.2f}, v_pi ="
        f" {line.v_pi[x]:.2f}"
    )
print(
    f"largest |v_{T_bump} - v_pi| over the states the context leaves:"
    f" {(v_at_states - line.v_pi)[left_states].abs().max():.2f}"
)

# %% [markdown]
# Between the states the context leaves, $v_t$ is a smooth blend of the bumps around it. Each bump
# is a coefficient (a sum of accumulated TD errors, not a value) times a normalised weight that is
# near 1 where $y$ is the closest state the context leaves and falls off where another one takes
# over. So beyond the outermost states left, $v_t$ tends to the *coefficient* of the nearest one,
# which need not be close to any value: at the left end, where this context never leaves the first
# states (printed above), the estimate is far from $v_\pi$. Evaluation in kernel space
# interpolates between the data; it does not extrapolate beyond them.

# %% [markdown]
# ## Linear TD is a special case (exactly)
#
# ::: {.proposition}
# **Proposition 1.1 (ours; the paper states that linear TD is a special case).** Let the features
# be such that $\phi(x)^\top \phi(y) > 0$ for all pairs
# in play (positive features suffice), and take
# $$g(x, y) = \log\big(\phi(x)^\top \phi(y)\big), \qquad \rho(x) = \frac1n \sum_{k=1}^n \phi(S_{k-1})^\top \phi(x).$$
# Then for every $t$ and every target $x$, $v_t(x) = \phi(x)^\top w_t$, where $w_t$ are the iterates of
# batch linear TD(0) with the same $\alpha$, $\gamma$ and $w_0 = 0$.
# :::
#
# ::: {.callout-note collapse="true" title="Proof"}
# This is the normalised-kernel case with the linear kernel $k(x, y) = \phi(x)^\top\phi(y)$,
# and $\rho$ undoes the normalisation:
# $$\rho(x) K_k(x) = \frac1n \sum_{k'} \phi(S_{k'-1})^\top \phi(x) \cdot
# \frac{\phi(S_{k-1})^\top \phi(x)}{\sum_{k'} \phi(S_{k'-1})^\top \phi(x)} = \frac1n\, \phi(S_{k-1})^\top \phi(x).$$
# Induction on $t$: at $t = 0$ both sides are 0. If $v_t = \phi^\top w_t$ at all targets, then in
# particular at $S_0, \dots, S_n$, so the two algorithms compute the same TD errors $\delta_k^{(t)}$, and
# $$\begin{aligned} v_{t+1}(x) &= \phi(x)^\top w_t + \frac{\alpha}{n} \sum_k \phi(S_{k-1})^\top \phi(x)\, \delta_k^{(t)} \\
# &= \phi(x)^\top \Big(w_t + \frac{\alpha}{n} \sum_k \delta_k^{(t)} \phi(S_{k-1})\Big) = \phi(x)^\top w_{t+1}. \end{aligned}$$
#
# That is the claim at $t + 1$.
# :::
#
# The positivity requirement is the price of writing a linear kernel as $\exp g$; the per-target
# weight $\rho$ is what turns a *normalised* average of TD errors back into linear TD's *sum*.
# `batch_linear_td` is the classical algorithm, iterating $w$ itself and reading the values
# out at the targets at the end, so that the check compares two different computations.

# %% [markdown]
# Now Proposition 1.1, on 100 random contexts: positive features with entries $U(0.1, 1)$, random
# sizes $n \le 40$, $d \le 5$, $q \le 3$ queries, $\gamma \in [0, 0.99)$, 60 iterations, every
# iterate compared. The step is $\alpha = U(0.05, 1)/d$, small enough that the iterates stay
# bounded (their largest magnitude is printed), so an *absolute* tolerance of $10^{-12}$ in float64
# is meaningful.

# %%
#| code-fold: true
linear_score = lambda keys, X: torch.log(keys @ X.mT)
linear_rho = lambda keys, X: (keys @ X.mT).mean(-2)
worst, largest = 0.0, 0.0
for seed in range(100):
    r = np.random.default_rng(seed)
    n, d, q = int(r.integers(1, 41)), int(r.integers(1, 6)), int(r.integers(0, 4))
    phi, R, Q = r.uniform(0.1, 1, (n + 1, d)), r.uniform(-1, 1, n), r.uniform(0.1, 1, (q, d))
    a, g = r.uniform(0.05, 1) / d, r.uniform(0, 0.99)
    v_soft = weighted_softmax_td(
        phi, R, None, alpha=a, gamma=g, n_iters=60, phi_queries=Q, rho=linear_rho,
                                 score=linear_score, return_all=True
    )
    v_lin = batch_linear_td(phi, R, alpha=a, gamma=g, n_iters=60, phi_queries=Q, return_all=True)
    test_close(v_soft, v_lin, eps=1e-12)
    worst, largest = max(worst, (v_soft - v_lin).abs().max().item()), max(
        largest, v_lin.abs().max().item()
    )
assert largest < 1e3
assert worst < 1e-12
print(f"largest |v| {largest:.1f}, largest difference below 1e-12")
_ = record_claim(
    "linear-td-exact",
    "With positive inner products of features, the score $\\log \\phi^\\top\\phi$ and a per-target"
    " weight, weighted softmax TD equals batch linear TD(0) at every iteration (Proposition 1.1).",
    "proved",
    "weighted_softmax_td",
    "#linear-td-is-a-special-case-exactly",
)

# %% [markdown]
# ### When some inner products are negative
#
# Proposition 1.1 assumes $\phi(x)^\top \phi(y) > 0$ for every key $y$ and target $x$ in play. The
# condition is not a convenience of the proof: with $\rho \ge 0$ no score at all can do without it.
#
# ::: {.proposition}
# **Proposition 1.2 (ours: the condition is necessary).** Fix a context, a target $x$ and a key
# $S_{j-1}$ with $\phi(S_{j-1})^\top \phi(x) < 0$. Then for no score $g$ with finite values and no
# weight $\rho(x) \ge 0$ does weighted softmax TD agree with batch linear TD at $x$ after one
# iteration for every reward vector.
# :::
#
# ::: {.callout-note collapse="true" title="Proof"}
# From $v_0 = 0$ the first TD errors are the rewards, $\delta^{(0)} = R$. Take $R = e_j$
# (reward 1 on transition $j$, 0 elsewhere). Weighted softmax TD gives $v_1(x) = \alpha \rho(x) K_j(x) \ge 0$,
# since a softmax weight of a finite score is positive. Batch linear TD gives
# $v_1(x) = \phi(x)^\top \frac{\alpha}{n} \phi(S_{j-1}) < 0$.
# :::
#
# The book's default features, i.i.d. $U(-1, 1)$ entries, break the condition for about half of
# all pairs of states. On such a context the score $\log(\phi^\top\phi)$ is undefined and the
# reduction is refused; replacing it by $\log|\phi^\top\phi|$ runs, but computes something else,
# as Proposition 1.2 says it must:

# %%
#| code-fold: true
chain_u = random_boyan_chain(seed=4)  # features U(-1, 1), d = 4
gram = chain_u.phi @ chain_u.phi.T
S_u, R_u = sample_trajectory(chain_u, n=30, seed=4)
phi_u = chain_u.phi[S_u]
neg_share = (gram < 0).double().mean().item()
assert neg_share > 0.2
test_fail(
    lambda: weighted_softmax_td(phi_u, R_u, None, alpha=0.1, gamma=0.9, n_iters=5, rho=linear_rho,
                                score=linear_score),
    contains="NaN or +inf",
)
abs_score = lambda keys, X: torch.log((keys @ X.mT).abs())
abs_rho = lambda keys, X: (keys @ X.mT).abs().mean(-2)
v_abs = weighted_softmax_td(phi_u, R_u, None, alpha=0.1, gamma=0.9, n_iters=30, rho=abs_rho,
                            score=abs_score)
v_lin_u = batch_linear_td(phi_u, R_u, alpha=0.1, gamma=0.9, n_iters=30)
abs_gap = (v_abs - v_lin_u).abs().max().item()
assert abs_gap > 0.1 * v_lin_u.abs().max().item()
print(
    f"negative inner products: {neg_share:.0%} of the {gram.numel()} pairs of states; score"
    f" log|phi^T phi|: largest gap to linear TD {abs_gap:.2f} (largest |v|"
    f" {v_lin_u.abs().max().item():.2f})"
)
_ = record_claim(
    "positivity-necessary",
    "With a nonnegative per-target weight, no score reproduces linear TD when some inner product of"
    " features is negative (Proposition 1.2).",
    "proved",
    "weighted_softmax_td",
    "#when-some-inner-products-are-negative",
)

# %% [markdown]
# :::: {.callout-note collapse="true" title="Deep dive: Proposition 1.3, linear TD for any features, with two heads"}
# The paper's abstract says that weighted softmax TD "adopts both linear TD and tabular TD as special
# cases", without a condition; the paper's full text, which may state one, is not available to us. What this chapter can prove is the conditional form above, and
# Proposition 1.2 shows that on the book's default features the condition fails. The condition goes
# away with one more head, the same kind of uniform head that Proposition 1.4
# below uses for centring. Shift the linear kernel by a constant that makes it positive, run
# weighted softmax TD with it, and subtract what the shift added with a head that attends uniformly.
#
# ::: {.proposition}
# **Proposition 1.3 (ours: linear TD for any features, with two heads).** For a target $x$ pick
# $\zeta(x) > -\min_k \phi(S_{k-1})^\top \phi(x)$ (for instance $1 + \max_k |\phi(S_{k-1})^\top \phi(x)|$), and let
# $$g_x(y) = \log\big(\zeta(x) + \phi(y)^\top \phi(x)\big), \qquad \rho(x) = \frac1n \sum_{k=1}^n \big(\zeta(x) + \phi(S_{k-1})^\top \phi(x)\big).$$
# Then the update with two heads, the weighted softmax head with this score and $\rho$ and a
# uniform head with weight $-\zeta(x)$,
# $$v_{t+1}(x) = v_t(x) + \alpha \Big(\rho(x) \sum_k K_k(x)\, \delta^{(t)}_k - \zeta(x)\, \frac1n \sum_k \delta^{(t)}_k\Big),$$
# equals batch linear TD(0) read out at $x$, $v_t(x) = \phi(x)^\top w_t$, for every $t$ and every
# feature map.
# :::
#
# ::: {.callout-note collapse="true" title="Proof"}
# As in Proposition 1.1, $\rho(x) K_k(x) = \frac1n (\zeta(x) + \phi(S_{k-1})^\top \phi(x))$, now with a
# positive kernel, so the two heads together weight $\delta_k$ by
# $\frac1n (\zeta(x) + \phi(S_{k-1})^\top \phi(x)) - \frac{\zeta(x)}{n} = \frac1n \phi(S_{k-1})^\top \phi(x)$, linear TD's weight.
# The induction of Proposition 1.1 finishes the proof. The second head has a negative weight, which
# Proposition 1.2 shows no single head with $\rho \ge 0$ can supply.
# :::
# ::::

# %% [markdown]
# The check repeats the test of Proposition 1.1 on features of both signs, $U(-1, 1)$ entries, where
# Proposition 1.1 does not apply: 100 random contexts, every iterate compared with `batch_linear_td`
# to an absolute $10^{-12}$, with the largest value printed. The uniform head is what makes it work:
# without it (the first head alone) the gap is of the order of the values.

# %%
#| code-fold: true
shift_c = lambda k, x: 1 + (k @ x.mT).abs().amax(-2)  # c(x), as in two_head_linear_td
first_head = dict(
    score=lambda k, x: torch.log(shift_c(k, x).unsqueeze(-2) + k @ x.mT),
    rho=lambda k, x: shift_c(k, x) + (k @ x.mT).mean(-2),
)
worst2, largest2, without = 0.0, 0.0, []
for r in map(
    np.random.default_rng, np.random.SeedSequence(1000).spawn(100)
):  # 100 random cases, each its own child stream
    n, d, q = int(r.integers(1, 41)), int(r.integers(1, 6)), int(r.integers(0, 4))
    phi, R, Q = r.uniform(-1, 1, (n + 1, d)), r.uniform(-1, 1, n), r.uniform(-1, 1, (q, d))
    a, g = r.uniform(0.05, 1) / d, r.uniform(0, 0.99)
    v_two = two_head_linear_td(phi, R, alpha=a, gamma=g, n_iters=60, phi_queries=Q, return_all=True)
    v_lin = batch_linear_td(phi, R, alpha=a, gamma=g, n_iters=60, phi_queries=Q, return_all=True)
    test_close(v_two, v_lin, eps=1e-12)
    worst2, largest2 = max(worst2, (v_two - v_lin).abs().max().item()), max(
        largest2, v_lin.abs().max().item()
    )
    one_head = weighted_softmax_td(phi, R, None, alpha=a, gamma=g, n_iters=60, phi_queries=Q,
                                   **first_head)
    without.append((one_head - v_lin[-1]).abs().max().item() / max(v_lin.abs().max().item(), 1e-12))
assert largest2 < 1e3 and np.median(without) > 0.1
assert worst2 < 1e-12
print(
    f"largest |v| {largest2:.1f}, largest difference below 1e-12; "
    f"first head alone: median relative gap {np.median(without):.2f}"
)
_ = record_claim(
    "two-head-linear-td",
    "Two heads (a shifted-kernel softmax head and a uniform head) give batch linear TD for any"
    " features (Proposition 1.3).",
    "proved",
    "weighted_softmax_td",
    "#when-some-inner-products-are-negative",
)

# %% [markdown]
# ## What the Transformer's score gives: linear TD to first order {.deep-dive}
#
# Proposition 1.1 is a statement about the *algorithm*. It needs the score
# $\log(\phi(x)^\top\phi(y))$ and a per-target weight $\rho \ne 1$, and the Transformer of
# [chapter 3](dual_head.html) has neither: its score is bilinear, $\phi(x)^\top W \phi(y)$, and its
# $\rho$ is 1. So linear TD is a special case of weighted softmax TD (with positive inner products, or
# with the second head of Proposition 1.3), but not of the constructed
# Transformer. What the constructed Transformer does have is a link to linear TD at *small* scores,
# which this section proves.
#
# ::: {.callout-note collapse="true" title="Why small scores, and the centring head"}
# **Why small scores.** At $\varepsilon = 0$ every softmax weight is $1/n$; to first order,
# $K_k(x) \approx \frac1n + \frac{\varepsilon}{n}(g_k - \bar g)$, which is *linear* in the feature of the key. A weight
# linear in $\phi(S_{k-1})$ is exactly what linear TD uses, so near $\varepsilon = 0$ the Transformer should
# behave like a linear TD, once the uniform part $\frac1n$ is removed. In a Transformer the centring is one more head: a head whose score matrix is zero attends
# uniformly to the $n$ context columns, and with the value matrices $-V^{\mathrm{cur}}, -V^{\mathrm{tgt}}$ of
# $\theta^*$ it subtracts $\alpha \cdot \frac1n \sum_k \delta_k$, the mean TD error. [Chapter 3](dual_head.html)
# builds that three-head layer and checks it against `weighted_softmax_td(..., centred=True)`.
# :::
#
# Write the score as $\varepsilon\, g$ with $g(y, x) = \phi(y)^\top W \phi(x)$, and let
# $g_k = g(S_{k-1}, x)$ for a fixed target $x$, $\bar g = \frac1n \sum_k g_k$, $\bar\phi = \frac1n \sum_k \phi(S_{k-1})$
# and $\Delta_x = \max_k g_k - \min_k g_k$.
#
# ::: {.proposition}
# **Proposition 1.4 (ours: small scores).** For every target $x$ and every vector $\delta \in \mathbb R^n$,
# $$\begin{aligned} &\Big|\sum_k K_k(x)\, \delta_k - \frac1n \sum_k \delta_k -
#   \frac{\varepsilon}{n} \sum_k \big(\phi(S_{k-1}) - \bar\phi\big)^\top W \phi(x)\; \delta_k\Big| \\
#   &\qquad \le \frac{\varepsilon^2 \Delta_x^2}{8} \big(\max_k \delta_k - \min_k \delta_k\big).\end{aligned}$$
# Consequently, *centred* weighted softmax TD, $v_{t+1}(x) = v_t(x) + \alpha \sum_k \big(K_k(x) - \frac1n\big) \delta^{(t)}_k$,
# differs after one step by at most $\alpha \varepsilon^2 \Delta_x^2 (\max \delta - \min \delta)/8$ from
# **centred, preconditioned batch linear TD**
# $$w_{t+1} = w_t + \frac{\alpha}{n}\, C \sum_k \delta^{(t)}_k \big(\phi(S_{k-1}) - \bar\phi\big), \qquad C = \varepsilon W^\top,$$
# read out as $v(x) = \phi(x)^\top w$; and for every fixed number $T$ of iterations the two iterates differ
# by $O(\varepsilon^2)$ while each moves by $\Theta(\varepsilon)$. The bound is not uniform in $T$: see the
# section on long horizons below.
# :::
#
# ::: {.callout-note collapse="true" title="Proof"}
# Fix $x$ and $\delta$ and let $f(\varepsilon) = \sum_k K_k \delta_k$ with $K = \operatorname{softmax}(\varepsilon g)$,
# and write $\mathbb E_\varepsilon$, $\operatorname{Cov}_\varepsilon$ for moments under the distribution $K$ over $k$.
# Differentiating the softmax, $\frac{d}{d\varepsilon} \mathbb E_\varepsilon[h] = \operatorname{Cov}_\varepsilon(g, h)$
# for any $h$, so $f'(\varepsilon) = \operatorname{Cov}_\varepsilon(g, \delta)$ and, differentiating once more and
# collecting terms, $f''(\varepsilon) = \mathbb E_\varepsilon\big[(g - \mathbb E_\varepsilon g)^2 (\delta - \mathbb E_\varepsilon \delta)\big]$.
# Hence $|f''| \le \operatorname{Var}_\varepsilon(g) \cdot (\max \delta - \min \delta) \le \frac{\Delta_x^2}{4} (\max \delta - \min \delta)$
# (a variable with range $\Delta_x$ has variance at most $\Delta_x^2/4$). At $\varepsilon = 0$ the weights are uniform:
# $f(0) = \frac1n \sum_k \delta_k$ and $f'(0) = \frac1n \sum_k (g_k - \bar g) \delta_k$, and $g_k - \bar g = (\phi(S_{k-1}) - \bar\phi)^\top W \phi(x)$.
# Taylor's theorem with the Lagrange remainder gives the inequality. For the update: if $v_t(x) = \phi(x)^\top w_t$ at
# every target, both algorithms see the same TD errors, and
# $\frac{\alpha\varepsilon}{n} \sum_k (\phi(S_{k-1}) - \bar\phi)^\top W \phi(x)\, \delta_k = \phi(x)^\top \frac{\alpha}{n} \varepsilon W^\top \sum_k \delta_k (\phi(S_{k-1}) - \bar\phi)$,
# which is the linear step read out at $x$. Over $T$ steps, let $e_t$ be the largest gap over the targets. The TD errors
# of the two iterates differ by at most $(1 + \gamma) e_t$ and $\sum_k |K_k - \frac1n| \le 2$, so
# $e_{t+1} \le (1 + 2\alpha(1 + \gamma))\, e_t + \alpha \varepsilon^2 \max_x \Delta_x^2 (\max \delta^{(t)} - \min \delta^{(t)})/8$ with $e_0 = 0$,
# where $\delta^{(t)}$ are the linear iterate's TD errors, bounded for fixed $T$ uniformly in $\varepsilon \le 1$. So $e_T = O(\varepsilon^2)$.
# :::

# %% [markdown]
# Then the iterates. For ten contexts (unit-norm Boyan features, a random $W$, $\alpha = 0.5$,
# $\gamma = 0.9$, $T = 10$ iterations, every state as a query) the cell measures, for
# $\varepsilon$ from $10^{-3}$ to $10^{-1}$, the largest gap between centred softmax TD with score
# matrix $\varepsilon W$ and centred linear TD with $C = \varepsilon W^\top$, and fits the slope of
# $\log(\text{gap})$ against $\log \varepsilon$. Proposition 1.4 says 2; a wrong first-order term
# (dropping the centring, or using $W$ instead of $W^\top$) would leave a gap of order $\varepsilon$,
# slope 1, and without the uniform head the gap does not vanish at all (slope 0). All three are measured.

# %%
#| code-fold: true
eps_grid = np.logspace(-3, -1, 7)


def small_score_gaps(seed, variant="centred"):
    (
        "Largest gap over T = 10 iterations and all targets, for each eps, between a softmax"
        " variant and centred linear TD with C = eps W^T."
    )
    phi_s, R_s, Q_s = boyan_context(20, seed=seed)
    W_s = torch.from_numpy(np.random.default_rng(seed).standard_normal((4, 4)))
    out = []
    for eps in eps_grid:
        lin = batch_linear_td(
            phi_s, R_s, alpha=0.5, gamma=0.9, n_iters=10, phi_queries=Q_s, return_all=True,
                              C=eps * W_s.T, centred=True
        )
        if variant == "centred":
            soft = weighted_softmax_td(
                phi_s, R_s, eps * W_s, alpha=0.5, gamma=0.9, n_iters=10, phi_queries=Q_s,
                                       return_all=True, centred=True
            )
        elif variant == "W not transposed":
            soft = weighted_softmax_td(
                phi_s, R_s, eps * W_s, alpha=0.5, gamma=0.9, n_iters=10, phi_queries=Q_s,
                                       return_all=True, centred=True
            )
            lin = batch_linear_td(
                phi_s, R_s, alpha=0.5, gamma=0.9, n_iters=10, phi_queries=Q_s, return_all=True,
                                  C=eps * W_s, centred=True
            )
        else:
            soft = weighted_softmax_td(phi_s, R_s, eps * W_s, alpha=0.5, gamma=0.9, n_iters=10,
                                       phi_queries=Q_s, return_all=True)
        out.append((soft - lin).abs().max().item())
    return np.array(out)


slope = lambda gaps: np.polyfit(np.log(eps_grid), np.log(gaps), 1)[0]
slopes_by_variant = {
    v: [slope(small_score_gaps(seed, v)) for seed in range(10)]
    for v in ("centred", "W not transposed", "no uniform head")
}
assert all(1.8 < s_ < 2.2 for s_ in slopes_by_variant["centred"]), slopes_by_variant["centred"]
assert all(0.8 < s_ < 1.2 for s_ in slopes_by_variant["W not transposed"]), slopes_by_variant[
    "W not transposed"
]
assert all(abs(s_) < 0.2 for s_ in slopes_by_variant["no uniform head"]), slopes_by_variant[
    "no uniform head"
]
for v, sl in slopes_by_variant.items():
    print(f"{v}: fitted slopes from {min(sl):.2f} to {max(sl):.2f} on {len(sl)} contexts")
_ = record_claim(
    "small-scores-first-order",
    "At score scale $\\varepsilon$, centred softmax TD stays within $O(\\varepsilon^2)$ of centred"
    " linear TD preconditioned by $\\varepsilon W^\\top$ for a fixed number of iterations"
    " (Proposition 1.4; measured slope 2).",
    "proved",
    "weighted_softmax_td",
    "#what-the-transformers-score-gives-linear-td-to-first-order",
)


# %% [markdown]
# ::: {.callout-note}
# **What the constructed Transformer runs.** With $\theta^*$ ([chapter 3](dual_head.html)) the
# Transformer runs weighted softmax TD exactly, with the bilinear score $\phi(x)^\top W \phi(y)$ and
# $\rho = 1$: every TD error weighted by a softmax weight, nothing else. Of the two classical
# algorithms, it reaches batch *tabular* TD in a limit (one-hot features, $W = \beta I$,
# $\beta \to \infty$, next section). It reaches linear TD only approximately and only for a fixed
# horizon: at small scores, with one more uniform head, its first $T$ iterates are those of centred
# linear TD preconditioned by $\varepsilon W^\top$ up to $O(\varepsilon^2)$, with a constant that grows with $T$
# (Proposition 1.4). Run for many iterations it leaves linear TD and converges (when it converges) to
# the certainty-equivalence value of the context, shifted by a constant when the centring head is
# present ([Proposition 1.8](#small-scores-over-long-horizons-where-the-iteration-goes)). The exact reduction to
# batch linear TD (Propositions 1.1 and 1.3) is a property of the algorithm with another score and
# $\rho \ne 1$, which the Transformer of this book does not compute.
# :::

# %% [markdown]
# ## Tabular TD is a limit
#
# Tabular TD needs integer states, not features. `batch_tabular_td` runs the per-state averaged batch update of
# the first section and `certainty_equivalence` solves the empirical MRP directly (a state the context never
# leaves is made absorbing with reward `unvisited_reward`, default 0; both are in
# [Implementation and tests](#tabular-td-state-indices-batches-and-bad-input)).

# %% [markdown]
# ::: {.proposition}
# **Proposition 1.5 (ours; the paper states that tabular TD is a special case).** Take one-hot
# features and $W = \beta I$, so $g(x, y) = \beta\,\mathbf 1[x = y]$,
# and $\rho = 1$. Suppose every target state is left at least once in the context: $S_n$ occurs among
# $S_0, \dots, S_{n-1}$, and so does every query state. Then, for every fixed $t$, as $\beta \to \infty$
# the iterate of weighted softmax TD at each target $x$ converges to $v^{\mathrm{tab}}_t(x)$ of per-state
# averaged batch tabular TD, with $|v_t(x) - v^{\mathrm{tab}}_t(x)| = O(e^{-\beta})$.
# :::
#
# ::: {.callout-note collapse="true" title="Proof"}
# By the formula for $K$ above, each column differs from the tabular weights
# $\mathbf 1[S_{k-1} = x]/N(x)$ by at most $\eta_\beta = 2 (n/N_{\min} - 1) e^{-\beta}$ in $\ell_1$,
# where $N_{\min}$ is the smallest visit count of a target state. With tabular weights the update of
# target $x$ is $\frac{\alpha}{N(x)} \sum_{k: S_{k-1} = x} \delta_k$, exactly the tabular update of
# $x$'s value, and targets of the same state carry equal values, so on the targets the two
# iterations are the same map $F_\infty$; the softmax iteration is a map $F_\beta$ with
# $\lVert F_\beta(v) - F_\infty(v) \rVert_\infty \le \alpha\, \eta_\beta \max_k |\delta_k(v)|$.
# Since the columns of $K$ sum to 1, $F_\beta$ is Lipschitz in the max norm with constant
# $\Lambda = 1 + \alpha (1 + \gamma)$ for every $\beta$, so the gap $e_t$ between the iterates obeys
# $e_{t+1} \le \Lambda\, e_t + \alpha\, \eta_\beta \max_k |\delta_k(v^{\mathrm{tab}}_t)|$ with $e_0 = 0$:
# $e_t \le L_t\, \eta_\beta$ with $L_t$ independent of $\beta$.
# :::
#
# ::: {.callout-note collapse="true" title="Why the hypothesis"}
# Why the hypothesis. A target whose state is never left has uniform weights $1/n$ for *every*
# $\beta$ (the figure above): its value moves by the mean TD error of the whole context, whereas
# tabular TD leaves it at 0. If that target is $S_n$, its value enters the TD error of the last
# transition and the discrepancy spreads to every state upstream. A query at a state never left
# is harmless to the others (nobody reads it) but is itself not tabular. So the reduction is a
# statement about trajectories in which every target state starts a transition, and that is what
# we test; the cell after the test shows the failure when the last state is new.
# :::
#
# The check measures the gap between the two iterations over a fixed, moderate number of
# iterations, for a range of $\beta$, on contexts that satisfy the hypothesis.

# %%
#| code-fold: true
def tabular_gap(states, rewards, n_states, betas, alpha, gamma, n_iters):
    (
        "For each beta, the largest distance over iterations 0..n_iters and targets between"
        " weighted softmax TD with scores beta 1[x=y] and batch tabular TD."
    )
    I = torch.eye(n_states, dtype=torch.float64)
    Ws = (
        torch.as_tensor(betas, dtype=torch.float64)[:, None, None] * I
    )  # one W per beta: a batch of 1 context and len(betas) score matrices
    soft = weighted_softmax_td(I[states], rewards, Ws, alpha=alpha, gamma=gamma, n_iters=n_iters,
                               return_all=True)
    tab = batch_tabular_td(
        states, rewards, n_states, alpha=alpha, gamma=gamma, n_iters=n_iters, return_all=True
    )
    return (soft - tab[:, states]).abs().amax((-2, -1)).numpy()


def context_leaving_every_target(mrp, n, seed):
    "Sample trajectories until one also leaves its last state (the hypothesis of Proposition 1.5)."
    rng = np.random.default_rng(seed)
    while True:
        S, R = sample_trajectory(mrp, n=n, seed=rng)
        if (S[:-1] == S[-1]).any():
            return S, R


contexts = [
    context_leaving_every_target(random_boyan_chain(n_states=8, features="onehot", seed=s), 40, s)
    for s in range(8)
]
beta_grid = np.arange(0, 41, 2.0)
gaps = np.array([tabular_gap(S, R, 8, beta_grid, 0.8, 0.9, 30) for S, R in contexts])
for gap in gaps:
    assert gap[beta_grid == 30][0] < 1e-10 and gap[-1] < 1e-12
mid = (beta_grid >= 4) & (beta_grid <= 24)
slopes = [np.polyfit(beta_grid[mid], np.log(gap[mid]), 1)[0] for gap in gaps]
assert all(-1.1 < s < -0.9 for s in slopes), slopes
print(f"fitted d log(gap) / d beta from {min(slopes):.3f} to {max(slopes):.3f}"
      f" on {len(slopes)} contexts")
_ = record_claim(
    "tabular-limit",
    "With one-hot features and $W = \\beta I$, weighted softmax TD tends to batch tabular TD at"
    " rate $e^{-\\beta}$ when every target state is left (Proposition 1.5).",
    "proved",
    "weighted_softmax_td",
    "#tabular-td-is-a-limit",
)

# %%
#| fig-cap: "Figure 1.3: The distance between weighted softmax TD and batch tabular TD falls like exp(-beta) on every context."
#| fig-alt: "Log-scale plot of the largest distance against beta from 0 to 30 for 8 contexts; all curves fall parallel to a dashed line 10 exp(-beta), down to about 1e-12."
#| code-fold: true
fig, ax = plt.subplots(figsize=(6.1, 3.6))
shown = beta_grid <= 30  # beyond, the distance is round-off: asserted, not drawn
for i, gap in enumerate(gaps):
    ax.semilogy(
        beta_grid[shown],
        gap[shown],
        "o-",
        ms=3,
        lw=1,
        color="C0",
        alpha=0.6,
        label="8 contexts (one curve each)" if i == 0 else None,
    )
ax.semilogy(beta_grid, 10 * np.exp(-beta_grid), "k--", label=r"$10\, e^{-\beta}$")
ax.axhline(1e-10, color="grey", lw=0.8, ls=":", label="$10^{-10}$")
ax.set(
    xlabel=r"score scale $\beta$",
    ylabel="max |softmax TD - tabular TD|\n(return units)",
    ylim=(1e-14, 10),
    xlim=(-1, 41),
    title="Distance to batch tabular TD over 30 iterations, 8 random contexts",
)
ax.legend(fontsize=9);

# %% [markdown]
# The distance falls like $e^{-\beta}$ (fitted slopes of $\log$-distance against $\beta$ printed
# above, all within $[-1.1, -0.9]$) down to about $10^{-12}$ at $\beta = 30$; beyond that it is
# float64 round-off (below $10^{-12}$ at $\beta = 40$, asserted above), whose digits vary between
# machines, so it is not drawn.
# When the hypothesis fails, when the last state of the trajectory is new, the gap stays
# large however large $\beta$ is:

# %%
#| code-fold: true
mrp8 = random_boyan_chain(n_states=8, features="onehot", seed=0)
rng_new = np.random.default_rng(5)
while True:
    S_new, R_new = sample_trajectory(mrp8, n=12, seed=rng_new)
    if not (S_new[:-1] == S_new[-1]).any(): break
gap_new = tabular_gap(S_new, R_new, 8, [10, 20, 40], 0.8, 0.9, 30)
assert gap_new.min() > 1e-2, gap_new
print(f"last state new: the gap is at least {gap_new.min():.2f} at beta = 10, 20 and 40")


# %% [markdown]
# Proposition 1.5 is about the path of the iterates; where they go is a separate matter (Proposition 1.6, folded):

# %% [markdown]
# :::: {.callout-note collapse="true" title="Deep dive: Proposition 1.6, the fixed point on the subspace the iteration preserves"}
# Proposition 1.5 is about the path of the iterates; where they go is a separate matter. The
# iterate is a vector in $\mathbb R^{n+1+q}$, one entry per target column, and in that space the
# fixed point is *not* unique: the query entries never enter a TD error, so any values there are
# fixed, and two positions of the trajectory in the same state may carry different values. What the
# iteration actually explores is smaller. Call a vector **state-consistent** if it gives equal
# values to targets in the same state (it is a function of the state). The update of target $x$
# depends on $x$ only through its state, so the iteration maps state-consistent vectors to
# state-consistent vectors, and since $v_0 = 0$ is one, every iterate is.
#
# ::: {.proposition}
# **Proposition 1.6 (ours: the fixed point, on the subspace the iteration preserves).** Under the
# hypothesis of Proposition 1.5 and for *every* $\beta > 0$, not only in the limit, the
# certainty-equivalence value $\hat v$ (at each target's state) is the only state-consistent fixed
# point of weighted softmax TD. In the whole space $\mathbb R^{n+1+q}$ the fixed points form an
# affine set of dimension $n + 1 + q - s'$, where $s'$ is the number of distinct target states.
# :::
#
# ::: {.callout-note collapse="true" title="Proof"}
# A fixed point makes $\sum_k K_k(x) \delta_k = 0$ for each target state $x$; targets of
# the same state give the same equation, so there are $s'$ equations. Write $\bar\delta_x$ for the mean TD
# error of the transitions leaving $x$ and $\Sigma = \sum_k \delta_k$; the formula for $K$ turns the
# equation of $x$ into $(e^\beta - 1) N(x) \bar\delta_x + \Sigma = 0$. Summing over the $s'$ target states (every
# transition leaves one of them), $(e^\beta - 1) \Sigma + s' \Sigma = 0$, so $\Sigma = 0$ and then every $\bar\delta_x = 0$.
# On state-consistent vectors $v = f(\text{state})$, the equations $\bar\delta_x = 0$ read
# $f = \hat r + \gamma \hat P f$ on the $s'$ target states: every state a transition reaches is a
# target, and every target state is left (the hypothesis), so $\hat P$ is a stochastic matrix on
# these states and $I - \gamma \hat P$ is invertible: $f = \hat v$ is the only solution. In the
# whole space the same $s'$ equations are affine in the $n + 1 + q$ entries (the $q$ query entries
# do not even appear). Their linear part has rank exactly $s'$: at most $s'$ because there are $s'$
# equations, at least $s'$ because its restriction to the state-consistent vectors is the
# invertible $s' \times s'$ system just solved. So the fixed points form an affine set of dimension
# $n + 1 + q - s'$, always positive under the hypothesis ($S_n$ repeats a state of the context).
# :::
#
# The check below writes the fixed-point equations as a linear system in two ways: over the $s'$
# values of a state-consistent vector, where it must be nonsingular and solved by $\hat v$, and
# over all $n + 1 + q$ entries, where its null space must have dimension $n + 1 + q - s'$ (and a
# point of it, outside the subspace, must be a fixed point too). When the hypothesis fails the
# subspace system must become singular.
# ::::

# %%
#| code-fold: true
def fixed_point_systems(S, R, n_states, beta, gamma, q_states=()):
    (
        "The fixed-point equations of weighted softmax TD (one-hot, W = beta I): (M_full, b) over"
        " all m entries and (M_sub, b_sub) over the distinct target states."
    )
    S, I = torch.as_tensor(S), torch.eye(n_states, dtype=torch.float64)
    targets = torch.cat([S, torch.as_tensor(q_states, dtype=torch.long)])
    K = context_weights(I[S], beta * I, phi_queries=I[targets[len(S) :]] if len(q_states) else None)
    n, m = K.shape
    D = torch.zeros(n, m, dtype=torch.float64)
    D[range(n), range(n)], D[range(n), range(1, n + 1)] = -1.0, gamma
    M_full, b = K.T @ D, -K.T @ torch.as_tensor(R, dtype=torch.float64)  # fixed point: M_full v = b
    states = torch.unique(targets)
    E = (targets[:, None] == states[None]).double()  # (m, s') v = E f
    first = torch.tensor(
        [int(torch.nonzero(targets == x)[0]) for x in states]
    )  # one equation per distinct target state
    return M_full, b, M_full[first] @ E, b[first], states


sub_sv, null_ok = [], []
for S, R in contexts:
    q_st = [int(S[3]), int(S[7])]  # two queries, in states the context leaves
    for beta in (0.5, 3.0, 10.0):
        M_full, b, M_sub, b_sub, states = fixed_point_systems(S, R, 8, beta, 0.9, q_st)
        ce = certainty_equivalence(S, R, 8, gamma=0.9)
        sv = torch.linalg.svdvals(M_sub)
        sub_sv.append((sv.min() / sv.max()).item())
        test_close(torch.linalg.solve(M_sub, b_sub), ce[states], eps=1e-10)
        m, s_ = M_full.shape[0], len(states)
        test_eq(int(torch.linalg.matrix_rank(M_full)), s_)
        null = torch.linalg.svd(M_full).Vh[s_:]  # a basis of the null space
        test_eq(null.shape[0], m - s_)
        v_other = ce[torch.cat([torch.as_tensor(S), torch.tensor(q_st)])] + null.T @ torch.ones(
            m - s_, dtype=torch.float64
        )
        test_close(M_full @ v_other, b, eps=1e-10)  # another fixed point ...
        assert (
            v_other[torch.as_tensor(S)] - ce[torch.as_tensor(S)]
        ).abs().max() > 1e-3  # ... not state-consistent
assert min(sub_sv) > 1e-4, min(sub_sv)
M_new = fixed_point_systems(S_new, R_new, 8, 10.0, 0.9)[2]  # the context whose last state is new
sv_new = torch.linalg.svdvals(M_new)
assert sv_new.min() / sv_new.max() < 1e-12
print(
    f"smallest relative singular value of the subspace system: {min(sub_sv):.1e} over"
    f" {len(sub_sv)} cases satisfying the hypothesis; below 1e-12 (singular to working precision)"
    " when the last state is new"
)
_ = record_claim(
    "tabular-fixed-point",
    "For every $\\beta > 0$ the certainty-equivalence value is the only state-consistent fixed"
    " point of tabular-score weighted softmax TD (Proposition 1.6).",
    "proved",
    "weighted_softmax_td",
    "#tabular-td-is-a-limit",
)

# %% [markdown]
# And the iterates do reach that fixed point: with many iterations, weighted softmax TD lands on the
# certainty-equivalence value of each context's empirical MRP, at large $\beta$ and already at
# moderate $\beta$ (Proposition 1.7 below proves convergence for large enough $\beta$; at
# $\beta = 3$ it is observed, not proved):

# %%
#| code-fold: true
for S, R in contexts:
    ce = certainty_equivalence(S, R, 8, gamma=0.9)
    phi = torch.eye(8, dtype=torch.float64)[S]
    Ws = torch.tensor([3.0, 40.0], dtype=torch.float64)[:, None, None] * torch.eye(
        8, dtype=torch.float64
    )
    test_close(weighted_softmax_td(phi, R, Ws, alpha=0.8, gamma=0.9, n_iters=600),
               ce[S].expand(2, -1), eps=1e-10)
    test_close(batch_tabular_td(S, R, 8, alpha=0.8, gamma=0.9, n_iters=600)[S], ce[S], eps=1e-10)

# %% [markdown]
# Without the hypothesis the certainty-equivalence value is still a fixed point (the equation of a
# target that is never left says $T = 0$, which the others imply), but no longer the only one: the
# value $c$ at a never-left $S_n$ is free, each $c$ extends to a fixed point (the empirical Bellman
# equations of the states left, with $v(S_n) = c$), and the iteration settles on the $c$ its path
# reaches. For the context above, whose last state is new:

# %%
#| code-fold: true
I8 = torch.eye(8, dtype=torch.float64)
v_long = weighted_softmax_td(I8[S_new], R_new, 40 * I8, alpha=0.8, gamma=0.9, n_iters=1000)
c = v_long[-1]
E, F = (torch.nn.functional.one_hot(x, 8).double() for x in (S_new[:-1], S_new[1:]))
N = E.sum(0).clamp(min=1)
A, b = (
    I8 - 0.9 * (E.T @ F) / N[:, None],
    (R_new @ E) / N,
)  # empirical Bellman equations, states never left get v = 0 ...
last = int(S_new[-1])
A[last], b[last] = I8[last], c  # ... except S_n, pinned to the value the iteration reached
test_close(v_long, torch.linalg.solve(A, b)[S_new], eps=1e-12)
ce_new = certainty_equivalence(
    S_new, R_new, 8, gamma=0.9
)  # the fixed point with v(S_n) = 0 (S_n absorbing, reward 0)
off_ce = (v_long - ce_new[S_new]).abs().max().item()
assert off_ce > 0.1, off_ce  # the iteration did not settle on the certainty-equivalence value
print(
    f"c = v(S_n) reached by the iteration: {c.item():.3f}; largest distance to the"
    f" certainty-equivalence value: {off_ce:.3f}"
)

# %% [markdown]
# :::: {.callout-note collapse="true" title="Deep dive: Proposition 1.7, convergence in the tabular case"}
# Convergence itself needs a condition. On state-consistent vectors the iteration is a linear
# recursion on the $s'$ values $f(x)$: grouping the transitions by the state they leave,
# $\sum_k K_k(x) \delta_k = \sum_y \hat M(x, y)\, \bar\delta_y$ with
# $\hat M(x, y) = N(y) e^{\beta \mathbf 1[x = y]} / \sum_z N(z) e^{\beta \mathbf 1[x = z]}$, a row-stochastic
# matrix, and $\bar\delta_y = (\hat r + \gamma \hat P f - f)(y)$.
#
# ::: {.proposition}
# **Proposition 1.7 (ours: convergence in the tabular case).** Under the hypothesis of Proposition 1.5,
# let $\alpha \in (0, 1]$ and $\mu = \min_x \hat M(x, x) = \min_x \frac{N(x) e^\beta}{N(x) e^\beta + n - N(x)}$.
# If $\mu > (1 + \gamma)/2$, which holds for $\beta > \log\frac{(1 + \gamma)(n - N_{\min})}{(1 - \gamma) N_{\min}}$,
# then $\max_x |v_t(x) - \hat v(x)| \le \kappa^t \max_x |\hat v(x)|$ with
# $\kappa = 1 - \alpha(2\mu - 1 - \gamma) < 1$.
# :::
#
# ::: {.callout-note collapse="true" title="Proof"}
# Since $\hat v$ is a fixed point, the error $e_t = f_t - \hat v$ obeys
# $e_{t+1} = \big(I - \alpha \hat M (I - \gamma \hat P)\big) e_t$. Row $x$ of this matrix is
# $(1 - \alpha \hat M(x, x))$ on the diagonal, $-\alpha \hat M(x, y)$ off it, plus $\alpha\gamma (\hat M \hat P)(x, \cdot)$,
# whose entries are non-negative and sum to $\gamma$. With $\alpha \le 1$ the diagonal term is non-negative,
# so the absolute row sum is at most $1 - \alpha \hat M(x, x) + \alpha (1 - \hat M(x, x)) + \alpha\gamma \le \kappa$,
# and $\|e_{t+1}\|_\infty \le \kappa \|e_t\|_\infty$, with $e_0 = -\hat v$. The threshold on $\beta$ solves
# $\hat M(x, x) > (1 + \gamma)/2$ for the least-visited state. This is the tabular, finite-context case of the
# contraction argument of [chapter 5](convergence.html).
# :::
#
# `tabular_rate` computes $\kappa$ for one context (chapter 3 uses it again). The check takes each context
# above, sets $\beta$ one unit above its threshold, and verifies the bound at every one of 60 iterations:
# ::::

# %%
#| code-fold: true
rates = []
for S, R in contexts:
    N_x = torch.bincount(torch.as_tensor(S[:-1]), minlength=8).double()
    N_min, n_ctx = N_x[N_x > 0].min().item(), len(S) - 1
    beta = math.log((1.9 * (n_ctx - N_min)) / (0.1 * N_min)) + 1
    lam = tabular_rate(S, 8, beta=beta, alpha=0.8, gamma=0.9)
    assert lam < 1
    ce = certainty_equivalence(S, R, 8, gamma=0.9)[S]
    err = (
        (weighted_softmax_td(I8[S], R, beta * I8, alpha=0.8, gamma=0.9, n_iters=60,
                             return_all=True) - ce)
        .abs()
        .amax(-1)
    )
    assert (
        err <= lam ** torch.arange(61, dtype=torch.float64) * ce.abs().max() * (1 + 1e-12) + 1e-13
    ).all()
    rates.append((lam, (err[1:] / err[:-1]).max().item()))
print("bound kappa / largest measured one-step ratio of the error, per context: "
      + "; ".join(f"{a_:.3f} / {b_:.3f}" for a_, b_ in rates))
_ = record_claim(
    "tabular-convergence",
    "Above a threshold on $\\beta$, tabular-score weighted softmax TD converges geometrically to"
    " the certainty-equivalence value (Proposition 1.7).",
    "proved",
    "weighted_softmax_td",
    "#tabular-td-is-a-limit",
)


# %% [markdown]
# ## Small scores over long horizons: where the iteration goes {.deep-dive}
#
# Proposition 1.4 is a statement at a *fixed* number of iterations $T$: the constant in its
# $O(\varepsilon^2)$ grows like $(1 + 2\alpha(1 + \gamma))^T$. This is not an artefact of the proof. The
# next cells run centred softmax TD and centred linear TD ($C = \varepsilon W^\top$) for up to
# $T = 2 \cdot 10^5$ iterations on three contexts of the small-score check ($W = I$, unit-norm features,
# $n = 20$, $\alpha = 0.5$, $\gamma = 0.9$, $\varepsilon = 0.03$, every state a query).
#
# ::: {.callout-note collapse="true" title="How the check runs 200,000 iterations"}
# Both iterations are
# affine, $v \mapsto F v + f$; the cell builds the two maps from `context_weights` and the features, checks
# them against `weighted_softmax_td(..., centred=True)` and `batch_linear_td(..., C=C, centred=True)` over the first 200 iterations, and then
# iterates the maps themselves, which is much faster than calling the functions $2 \cdot 10^5$ times.
# :::

# %%
#| code-fold: true
def horizon_context(seed, n=20):
    (
        "States, features and rewards of the small-score contexts (as `boyan_context`), and the "
        "features of every state."
    )
    chain = random_boyan_chain(n_states=10, features="unit", seed=seed)
    S, R = sample_trajectory(chain, n=n, seed=seed)
    return S, chain.phi[S], R, chain.phi


def centred_maps(phi, R, Q, eps, alpha, gamma, centred=True):
    (
        "Affine maps (M, c) of one iteration of (centred) softmax TD with score eps I, and (Mw, cw,"
        " X) of centred linear TD with C = eps I."
    )
    K = context_weights(phi, eps * torch.eye(phi.shape[-1], dtype=torch.float64), Q).numpy()
    n, m = K.shape
    D = np.zeros((n, m))
    D[range(n), range(n)], D[range(n), range(1, n + 1)] = -1.0, gamma
    Kc, R = K - centred / n, np.asarray(R)
    keys, succ, X = phi[:-1].numpy(), phi[1:].numpy(), torch.cat([phi, Q]).numpy()
    cen = keys - keys.mean(0)
    Mw = np.eye(keys.shape[1]) + alpha * eps / n * cen.T @ (gamma * succ - keys)
    return (np.eye(m) + alpha * Kc.T @ D, alpha * Kc.T @ R), (Mw, alpha * eps / n * cen.T @ R, X)


def long_run(phi, R, Q, eps=0.03, alpha=0.5, gamma=0.9, T=200_000, n_points=80):
    (
        "Iterates of centred softmax TD and centred linear TD at log-spaced iterations up to T, and"
        " the iteration after which linear TD moves < 1e-12."
    )
    (M, c), (Mw, cw, X) = centred_maps(phi, R, Q, eps, alpha, gamma)
    ts = np.unique(
        np.r_[np.logspace(0, np.log10(T), n_points).round(), 10, 1000, 10_000, T].astype(int)
    )
    v, w, soft, lin, settled = np.zeros(len(c)), np.zeros(len(cw)), [], [], None
    for t in range(1, T + 1):
        v, w_new = M @ v + c, Mw @ w + cw
        if settled is None and np.abs(X @ (w_new - w)).max() < 1e-12:
            settled = t
        w = w_new
        if len(soft) < len(ts) and t == ts[len(soft)]:
            soft.append(v)
            lin.append(X @ w)
    return ts, np.array(soft), np.array(lin), settled


horizon_seeds = [0, 1, 2]
for seed in horizon_seeds:  # the maps are the functions' iterations
    _, phi_h, R_h, Q_h = horizon_context(seed)
    (M, c), (Mw, cw, X) = centred_maps(phi_h, R_h, Q_h, 0.03, 0.5, 0.9)
    W_h = 0.03 * torch.eye(4, dtype=torch.float64)
    soft = weighted_softmax_td(phi_h, R_h, W_h, alpha=0.5, gamma=0.9, n_iters=200, phi_queries=Q_h,
                               centred=True).numpy()
    lin = batch_linear_td(phi_h, R_h, alpha=0.5, gamma=0.9, n_iters=200, phi_queries=Q_h, C=W_h,
                          centred=True).numpy()
    v, w = np.zeros(len(c)), np.zeros(4)
    for t in range(200):
        v, w = M @ v + c, Mw @ w + cw
    test_close(v, soft, eps=1e-12)
    test_close(X @ w, lin, eps=1e-12)
horizon = {seed: long_run(*horizon_context(seed)[1:]) for seed in horizon_seeds}
for seed, (ts, soft, lin, settled) in horizon.items():
    gap = np.abs(soft - lin).max(1)
    at = {T: gap[np.searchsorted(ts, T)] for T in (10, 1000, 10_000, 200_000)}
    assert at[200_000] > 100 * at[10]
    _, (Mw, _, _) = centred_maps(*horizon_context(seed)[1:], 0.03, 0.5, 0.9)
    tau = 1 / (1 - np.abs(np.linalg.eigvals(Mw)).max())
    print(
        f"context {seed}: gap "
        + ", ".join(f"{v_:.2g} at T = {T:,}" for T, v_ in at.items())
        + f"; linear TD: time constant {tau:,.0f} iterations, "
        + (
            f"steps < 1e-12 from T = {settled:,}"
            if settled
            else "steps still >= 1e-12 at T = 200,000"
        )
    )


# %% [markdown]
# The gap to linear TD is small for tens of iterations, then grows by orders of magnitude, also on contexts where linear TD has already stopped moving. Where the iteration goes instead is Proposition 1.8 (folded): run long, it lands on the *tabular* answer of the context, shifted by a constant with the centring head.

# %% [markdown]
# :::: {.callout-note collapse="true" title="Deep dive: Proposition 1.8, the fixed points of weighted softmax TD for any score"}
# The gap to linear TD is small for tens of iterations, then grows by orders of magnitude, also on
# contexts where linear TD has already stopped moving (the time constants and stopping times are
# printed). So the softmax iteration does not settle where linear TD does. Where does it go? On the trajectory, grouping the transitions by the state they
# leave as in Proposition 1.7, the update of a target in state $x$ is $\sum_y J(x, y)\, \bar\delta_y$, where
# $\bar\delta_y$ is the mean TD error of the transitions leaving $y$, $N(y)$ their number, $K(y, x)$ their
# common weight for target $x$ (the score depends on the states only), and
# $$J(x, y) = N(y)\Big(K(y, x) - \frac{\chi}{n}\Big), \qquad \chi = 0 \text{ (two heads, } \rho = 1), \quad \chi = 1 \text{ (centred, three heads)}.$$
#
# ::: {.proposition}
# **Proposition 1.8 (ours: the fixed points of weighted softmax TD for any score).** Suppose every
# state of the trajectory $S_0, \dots, S_n$ is left at least once, and restrict to state-consistent
# vectors $f$ over the $s'$ distinct states of the trajectory (the iteration preserves them; query
# targets never enter a TD error, so they do not affect these values).
# (a) If $\chi = 0$ and $J$ is nonsingular, the only fixed point is the certainty-equivalence value
# $\hat v$ of the context. (b) If $\chi = 1$, then $J \mathbf 1 = 0$; if $J$ has rank $s' - 1$, the fixed
# points are exactly $\hat v - \xi \mathbf 1$, $\xi \in \mathbb R$, and $\ell^\top f_t = 0$ for every $t$, where
# $\ell \ne 0$ solves $\ell^\top J = 0$. So if the iterates converge and $\ell^\top \mathbf 1 \ne 0$, their limit is
# $\hat v - \xi \mathbf 1$ with $\xi = \ell^\top \hat v / \ell^\top \mathbf 1$.
# :::
#
# ::: {.callout-note collapse="true" title="Proof"}
# A fixed point solves $J \bar\delta = 0$. (a) $J$ nonsingular gives $\bar\delta = 0$, the empirical Bellman
# equations, whose only solution is $\hat v$ (Proposition 1.6). (b) The rows of $J$ sum to
# $\sum_y N(y) K(y, x) - \sum_y N(y)/n = 1 - 1 = 0$, so $J\mathbf 1 = 0$, and with rank $s' - 1$ the null
# space is spanned by $\mathbf 1$: $\bar\delta = \nu \mathbf 1$, i.e. $\hat r - \nu \mathbf 1 + \gamma \hat P f = f$, whose
# solution is $f = \hat v - \frac{\nu}{1 - \gamma}\mathbf 1$. The iteration is $f_{t+1} = f_t + \alpha J\, \bar\delta(f_t)$, so
# $\ell^\top f_{t+1} = \ell^\top f_t = \ell^\top f_0 = 0$, which fixes $\xi$.
# :::
#
# Neither limit involves the features beyond telling states apart: run long, the Transformer's
# iteration lands on the *tabular* answer of the context (shifted by a constant with the centring
# head), at small scores as at large ones, not on linear TD's fixed point. The features and the score
# shape the path and the values at states the context never leaves. This holds in exact arithmetic;
# at $\varepsilon = 0.03$ the smallest nonzero singular value of $J$ is tiny (printed below), and the
# slowest direction takes millions of iterations. The check computes the limits from $J$ and
# compares them with $M^{T} v_0 + \dots$ at $T = 10^9$ (by repeated squaring), for both variants:
# ::::

# %%
#| code-fold: true
def predicted_limit(S, R, phi, eps, gamma, centred):
    "The limit of Proposition 1.8 at the trajectory states, and the singular values of J."
    S = np.asarray(S)
    U, n = np.unique(S[:-1]), len(S) - 1
    assert set(S.tolist()) <= set(U.tolist()), "a target state is never left"
    K = context_weights(phi, eps * torch.eye(phi.shape[-1], dtype=torch.float64)).numpy()
    key = [int(np.nonzero(S[:-1] == y)[0][0]) for y in U]  # one transition leaving y
    col = [int(np.nonzero(S == x)[0][0]) for x in U]  # one target column in state x
    N = np.array([(S[:-1] == y).sum() for y in U])
    B = N[None, :] * (K[np.ix_(key, col)].T - centred / n)  # B[x, y]
    ce = certainty_equivalence(S, R, 10, gamma=gamma).numpy()[U]
    sv = np.linalg.svd(B, compute_uv=False)
    if centred:
        ell = np.linalg.svd(B)[0][:, -1]  # left null vector
        ce = ce - ell @ ce / ell.sum()
    return ce[np.searchsorted(U, S)], sv


def power_limit(M, c, T=10**9):
    "The iterate after T steps of v -> M v + c from 0, by repeated squaring."
    A = np.block([[M, c[:, None]], [np.zeros((1, len(c))), np.ones((1, 1))]])
    return np.linalg.matrix_power(A, T)[:-1, -1]


for seed in horizon_seeds:
    S_h, phi_h, R_h, Q_h = horizon_context(seed)
    for centred in (True, False):
        lim, sv = predicted_limit(S_h, R_h, phi_h, 0.03, 0.9, centred)
        (M, c), _ = centred_maps(phi_h, R_h, Q_h, 0.03, 0.5, 0.9, centred)
        far = power_limit(M, c)[: len(S_h)]
        test_close(far, lim, eps=1e-5)
        print(
            f"context {seed}, {'centred (three heads)' if centred else 'two heads, rho = 1':>21}:"
            " |v_1e9 - limit| below 1e-5; smallest nonzero singular value of J"
            f" {sv[-2 if centred else -1]:.0e}; distance to centred linear TD at T = 200,000:"
            f" {np.abs(lim - horizon[seed][2][-1][:len(S_h)]).max():.2f}"
        )
_ = record_claim(
    "long-horizon-limit",
    "Run long, weighted softmax TD with any score converges (when it converges) to the"
    " certainty-equivalence value, shifted by a constant with a centring head, not to linear TD's"
    " fixed point (Proposition 1.8).",
    "proved",
    "weighted_softmax_td",
    "#small-scores-over-long-horizons-where-the-iteration-goes",
)

# %% [markdown]
# The figure puts the two measurements side by side for the three contexts: the gap to centred linear
# TD (solid) and the distance to the limit of Proposition 1.8 (dashed), over $T$; a dotted line marks
# the iteration after which linear TD's steps are below $10^{-12}$ on that context (if it comes before
# $2 \cdot 10^5$).

# %%
#| fig-cap: "Figure 1.4: At small scores the centred iteration follows linear TD for tens of iterations, then leaves it for the limit of Proposition 1.8."
#| fig-alt: "Log-log plot over iterations 1 to 200000 for three contexts: solid curves, the gap to centred linear TD, stay small and then grow by orders of magnitude; dashed curves, the distance to the limit of Proposition 1.8, fall towards zero."
#| code-fold: true
fig, ax = plt.subplots(figsize=(6.1, 4.2))
for i, (seed, (ts, soft, lin, settled)) in enumerate(horizon.items()):
    S_h, phi_h, R_h, _ = horizon_context(seed)
    lim, _ = predicted_limit(S_h, R_h, phi_h, 0.03, 0.9, True)
    ax.loglog(
        ts,
        np.abs(soft - lin).max(1),
        color=f"C{i}",
        lw=1.6,
        label=f"context {seed}: gap to centred linear TD",
    )
    ax.loglog(
        ts,
        np.abs(soft[:, : len(S_h)] - lim).max(1),
        color=f"C{i}",
        ls="--",
        lw=1.2,
        label=f"context {seed}: distance to the limit of Proposition 1.8",
    )
for i, r in enumerate(horizon.values()):
    if r[3]:
        ax.axvline(
            r[3],
            color=f"C{i}",
            lw=0.8,
            ls=":",
            label="linear TD's steps fall below $10^{-12}$" if i == 0 else None,
        )
ax.set(
    xlabel="iteration $T$ (= layer)",
    ylabel="largest gap over the targets\n(return units)",
    title=(
        r"Centred softmax TD at $\varepsilon = 0.03$: close to linear TD for a while, then"
        r" elsewhere"
    ),
)
ax.legend(fontsize=8, loc="lower right");

# %% [markdown]
# ## Learning a Boyan chain in kernel space
#
# Putting it together: one 1000-transition trajectory of a 10-state Boyan chain with one-hot
# features, scores $40\,\mathbf 1[x = y]$ (tabular to round-off), $\alpha = 1$ and $\gamma = 0.9$.
# The iterate has 1001 entries, one per trajectory state; every entry of state $x$ carries the same
# value, plotted against the true $v_\pi(x)$. With $\alpha = 1$ the update at the tabular limit is
# value iteration on the empirical MRP, $v \leftarrow \hat r + \gamma \hat P v$, so the iterates
# approach the certainty-equivalence value at rate $\gamma$ per iteration; that value differs from
# $v_\pi$ only through sampling error.

# %%
#| code-fold: true
boyan = random_boyan_chain(n_states=10, features="onehot", seed=0)
S, R = sample_trajectory(boyan, n=1000, seed=0)
assert (S[:-1] == S[-1]).any()
W_tab = 40 * torch.eye(10, dtype=torch.float64)
V = weighted_softmax_td(boyan.phi[S], R, W_tab, alpha=1.0, gamma=boyan.gamma, n_iters=150,
                        return_all=True)
first = torch.tensor([int(torch.nonzero(S == x)[0]) for x in range(10)])
per_state = V[:, first]
for x in range(10):
    test_close(V[:, S == x], per_state[:, x : x + 1].expand(-1, int((S == x).sum())), eps=1e-12)
ce = certainty_equivalence(S, R, 10, gamma=boyan.gamma)
errs = (per_state - ce).abs().max(1).values
assert (errs[1:] <= boyan.gamma * errs[:-1] + 1e-12).all()
test_close(per_state[-1], ce, eps=1e-6)
print(
    f"MSVE: zero estimate {msve(torch.zeros(10), boyan):.3f}, after 150 iterations"
    f" {msve(per_state[-1], boyan):.4f}, certainty equivalence {msve(ce, boyan):.4f}"
)

# %%
#| fig-cap: "Figure 1.5: On one 1000-transition context of a Boyan chain, the iterates settle geometrically on values close to the true values."
#| fig-alt: "Value estimate against iteration 0 to 150 for the 10 states, one solid colored curve each, with dashed horizontal lines of the same colors at the true values; the curves move fast in the first iterations, some crossing zero, then settle near their dashed lines."
#| code-fold: true
fig, ax = plt.subplots(figsize=(4.6, 3.8))
for x in range(10):
    c = plt.cm.viridis(x / 9)
    ax.plot(per_state[:, x], color=c, lw=1.3, label=f"state {x}")
    ax.axhline(boyan.v_pi[x], color=c, ls="--", lw=0.9)
ax.set(
    xlabel="iteration $t$ (= layer)",
    ylabel="value estimate $v_t(x)$ (return units)",
    title=(
        r"Weighted softmax TD on one Boyan chain: $v_t$ (solid) against $v_\pi$ (dashed), $n ="
        r" 1000$"
    ),
)
ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1))
fig.tight_layout();

# %% [markdown]
# What the figure shows: the first iterate is each state's mean observed reward (with $\alpha = 1$
# and $v_0 = 0$ the first TD errors are the bare rewards), and the discounted values of the
# successors then propagate back one step per iteration. So a state can start on the wrong side
# of 0 and cross over as its successors' values arrive (the cell below checks the first iterate,
# counts such states and prints the largest case). From then on the curves settle, at the
# geometric rate $\gamma$ checked above, on the certainty-equivalence values, which sit close to
# the dashed true values; the remaining gap is the context's sampling error (the MSVE line above).

# %%
#| code-fold: true
r_hat = torch.stack([R[S[:-1] == x].mean() for x in range(10)])
test_close(per_state[1], r_hat, eps=1e-12)  # v_1 = the mean observed reward
wrong_side = per_state * ce.sign() < 0  # (iteration, state): opposite sign to the limit
x_w = int((per_state * ce.sign()).min(0).values.argmin())  # the state furthest on the wrong side
t_w = int((per_state[:, x_w] * ce.sign()[x_w]).argmin())
assert wrong_side.any(0).sum() >= 1
print(
    f"{int(wrong_side.any(0).sum())} of 10 states have an estimate of the opposite sign to their"
    f" limit at some iteration (furthest: state {x_w}, {per_state[t_w, x_w].item():.2f} at"
    f" iteration {t_w}, limit {ce[x_w].item():.2f}); every state has the sign of its limit from"
    f" iteration {int(torch.nonzero(wrong_side.any(1))[-1]) + 1} on"
)

# %% [markdown]
# Everything here ran on 1001 numbers, the values at the trajectory
# states; the chain's transition matrix was never formed. The next chapters build
# [the prompt](prompt.html) that holds these numbers and [the softmax Transformer layer](dual_head.html)
# whose forward pass is exactly this iteration.

# %% [markdown]
# ## Implementation and tests
#
# The lesson ends above. This section holds the library's code (folded) with its documentation, then what keeps
# the chapter honest: input validation, shapes, batching, precision, long contexts, and comparisons with direct
# transcriptions of the definitions. Every cell runs when the book is built.
#
# ### The library's functions
#
# A context is the features of $S_0, \dots, S_n$, the rewards $R_1, \dots, R_n$ and optional query features.
# Queries come as `(..., q, d)`, or as `(..., d)` for a single query per context; leading batch dimensions
# broadcast, and everything is converted to the dtype and device of `phi_states`.

# %% [markdown]
# With `queries_only=True` the algorithms return what a model's `predict` returns, the values at the queries:

# %%
ch_q = random_boyan_chain(seed=4)
st_q, rw_q = sample_trajectory(ch_q, n=12, seed=4)
kw_q = dict(alpha=0.5, gamma=ch_q.gamma, n_iters=3, phi_queries=ch_q.phi[:3])
full_q = weighted_softmax_td(ch_q.phi[st_q], rw_q, torch.eye(4, dtype=torch.float64), **kw_q)
test_eq(weighted_softmax_td(ch_q.phi[st_q], rw_q, torch.eye(4, dtype=torch.float64), **kw_q,
                            queries_only=True), full_q[13:])
test_eq(batch_linear_td(ch_q.phi[st_q], rw_q, **kw_q, queries_only=True, return_all=True),
        batch_linear_td(ch_q.phi[st_q], rw_q, **kw_q, return_all=True)[..., 13:])
test_fail(lambda: batch_linear_td(ch_q.phi[st_q], rw_q, alpha=0.5, gamma=0.9, n_iters=2,
                                  queries_only=True),
          contains="`queries_only` needs `phi_queries`")


# %%
#| code-fold: true
#| code-summary: "Argument helpers"
#| export
def _broadcast(batch: tuple, shape: tuple, name: str) -> tuple:
    try:
        return tuple(torch.broadcast_shapes(batch, shape))
    except RuntimeError:
        raise ValueError(
            f"`{name}` has batch dimensions {tuple(shape)} that do not broadcast with"
            f" {tuple(batch)}"
        ) from None


def _count(x, name: str) -> int:
    return check_int(x, name, 0, "a non-negative integer")


def _scalar(x, name: str) -> float:
    return check_number(x, name, what="a real number (finite)")


# %%
#| code-fold: true
#| code-summary: "context_tensors"
#| export
def context_tensors(
    phi_states,  # (..., n+1, d) features of S_0..S_n
    rewards=None,  # (..., n) rewards, rewards[..., k-1] = R_k, or None
    phi_queries=None,  # (..., q, d) query features, (..., d) for one query, or None
) -> tuple:  # (keys (..., n, d), targets (..., m, d), rewards (..., n) or None), m = n+1+q
    (
        "Validate a context: its keys $S_0..S_{n-1}$, its targets $S_0..S_n$ then the queries, and "
        "its rewards."
    )
    phi = as_tensor(phi_states, "phi_states")
    dt, dev = phi.dtype, phi.device
    if phi.ndim < 2 or phi.shape[-2] < 2 or phi.shape[-1] < 1:
        raise ValueError(
            "`phi_states` must have shape (..., n+1, d) with n >= 1 and d >= 1, got"
            f" {tuple(phi.shape)}"
        )
    n, d, batch, R = phi.shape[-2] - 1, phi.shape[-1], tuple(phi.shape[:-2]), None
    if rewards is not None:
        R = as_tensor(rewards, "rewards", dt, dev)
        if R.ndim < 1 or R.shape[-1] != n:
            raise ValueError(
                f"`rewards` must have shape (..., {n}) to match `phi_states` (n = {n}), got"
                f" {tuple(R.shape)}"
            )
        batch = _broadcast(batch, R.shape[:-1], "rewards")
    Q = phi.new_zeros(batch + (0, d))
    if phi_queries is not None:
        Q = as_tensor(phi_queries, "phi_queries", dt, dev)
        if Q.ndim == phi.ndim - 1:
            Q = Q.unsqueeze(-2)
        if Q.ndim != phi.ndim or Q.shape[-1] != d:
            raise ValueError(
                f"`phi_queries` must have shape (..., q, {d}) or (..., {d}) with the batch"
                f" dimensions of `phi_states` {tuple(phi.shape)}, got {tuple(Q.shape)}"
            )
        batch = _broadcast(batch, Q.shape[:-2], "phi_queries")
    phi, Q = phi.expand(batch + phi.shape[-2:]), Q.expand(batch + Q.shape[-2:])
    return phi[..., :-1, :], torch.cat([phi, Q], -2), None if R is None else R.expand(batch + (n,))


# %%
show_doc(context_tensors)


# %%
#| code-fold: true
#| code-summary: "The streamed path (long contexts)"
#| export
def _score_matrix(W, keys):
    (
        "`W` validated for the keys' features: (d, d) or (..., d, d), in their dtype and on their "
        "device."
    )
    d = keys.shape[-1]
    if W is None:
        raise ValueError("`W` must be given when `score` is None")
    W = as_tensor(W, "W", keys.dtype, keys.device)
    if W.ndim < 2 or W.shape[-2:] != (d, d):
        raise ValueError(f"`W` must have shape ({d}, {d}) or (..., {d}, {d}), got {tuple(W.shape)}")
    _broadcast(keys.shape[:-2], W.shape[:-2], "W")
    return W


def _dense_bytes(keys, X, W, score, arrays=3) -> float:
    (
        "Memory of the dense path: `arrays` arrays of shape (..., n, m) (scores, weights, weights "
        "times rho)."
    )
    batch = keys.shape[:-2]
    if score is None:
        batch = _broadcast(batch, _score_matrix(W, keys).shape[:-2], "W")
    return arrays * math.prod(batch) * keys.shape[-2] * X.shape[-2] * keys.element_size()


def _path(method, keys, X, W, score) -> str:
    "'dense' or 'streamed' for `weighted_softmax_td`: see `memory_path`."
    what = f"the {keys.shape[-2]} x {X.shape[-2]} weights of the dense path"
    way_out = (
        "pass `W` (the bilinear score) instead of a `score` function for method='streamed' (O(n)"
        " memory)"
    )
    return memory_path(
        method, _dense_bytes(keys, X, W, score), what, way_out, streamed=score is None
    )


def _attend(keys, queries, delta):
    (
        "Each row $q_j$ of `queries` attends to the keys with values `delta`: the weights are never"
        " built."
    )
    n, d = keys.shape[-2:]
    values = torch.nn.functional.pad(
        delta.unsqueeze(-1), (0, d - 1)
    )  # the CPU kernel: values as wide as keys
    shape = torch.broadcast_shapes(keys.shape[:-2], queries.shape[:-2], delta.shape[:-1])
    flat = lambda t: t.expand(*shape, *t.shape[-2:]).reshape(-1, 1, *t.shape[-2:]).contiguous()
    Q, K, V = flat(queries), flat(keys), flat(values)
    rows = chunk_rows(
        Q.shape[0] * n * Q.element_size()
    )  # queries per call: bounded even where a backend
    attend = (
        torch.nn.functional.scaled_dot_product_attention
    )  # without a fused kernel builds the scores
    out = torch.cat(
        [attend(Q[..., i : i + rows, :], K, V, scale=1.0) for i in range(0, Q.shape[-2], rows)], -2
    )
    return out[..., 0].reshape(*shape, queries.shape[-2])


def _grouped(keys, X, W, batch):
    (
        "The kernel sum through the distinct feature rows, when they are few; None when they are"
        " too many."
    )
    n = keys.shape[-2]
    if keys.requires_grad or X.requires_grad or W.requires_grad:
        return None  # indices carry no gradient
    rows = torch.cat([keys.expand(batch + keys.shape[-2:]), X.expand(batch + X.shape[-2:])], -2)
    U, idx = torch.unique(rows.reshape(-1, rows.shape[-1]), dim=0, return_inverse=True)
    nbytes = math.prod(batch) * len(U) ** 2 * keys.element_size()
    if 2 * len(U) > n or chunk_rows(nbytes / len(U)) < len(U):
        return None  # the kernel must fit one chunk
    idx = idx.reshape(batch + rows.shape[-2:-1])
    key_idx, target_idx = idx[..., :n], idx[..., n:]
    count = keys.new_zeros(batch + U.shape[:1]).scatter_add_(
        -1, key_idx, torch.ones_like(key_idx, dtype=keys.dtype)
    )
    G = (U @ W @ U.mT).expand(batch + (len(U), len(U)))  # scores between distinct rows
    K = torch.softmax(
        G + count.log().unsqueeze(-1), dim=-2
    )  # group a's total weight c_a e^g / sum c e^g
    per_key = lambda delta: keys.new_zeros(count.shape).scatter_add_(
        -1, key_idx, delta
    ) / count.clamp(min=1)
    return lambda delta: (per_key(delta).unsqueeze(-2) @ K).squeeze(-2).gather(-1, target_idx)


def _streamed(keys, X, R, W, alpha, gamma, n_iters, rho, return_all, centred):
    (
        "`weighted_softmax_td` in O(n + m) memory: grouped by distinct features, else attending"
        " from $W\\phi(x)$."
    )
    W = _score_matrix(W, keys)
    queries = X @ W.mT  # g(phi_k, x) = phi_k . (W phi(x))
    batch = torch.broadcast_shapes(keys.shape[:-2], queries.shape[:-2], R.shape[:-1])
    kernel_sum = _grouped(keys, X, W, batch) or (lambda delta: _attend(keys, queries, delta))
    step = alpha * _rho(rho, keys, X, batch + X.shape[-2:-1])
    shift = 1 / keys.shape[-2] if centred else 0.0  # the uniform head of `centred`
    update = lambda delta: step * (kernel_sum(delta) - shift * delta.sum(-1, keepdim=True))
    return _iterate(update, X.new_zeros(batch + X.shape[-2:-1]), R, gamma, n_iters, return_all)


# %%
#| code-fold: true
#| code-summary: "context_weights"
#| export
def _weights(keys, X, W, score):
    n, m = keys.shape[-2], X.shape[-2]
    if score is None:
        G = keys @ _score_matrix(W, keys) @ X.mT
    else:
        if not callable(score):
            raise ValueError(f"`score` must be a callable or None, got {type(score).__name__}")
        G = torch.as_tensor(score(keys, X), dtype=keys.dtype, device=keys.device)
        try:
            G = G.expand(keys.shape[:-2] + (n, m))
        except RuntimeError:
            raise ValueError(
                f"`score` must return shape (..., {n}, {m}), got {tuple(G.shape)}"
            ) from None
        if torch.isnan(G).any() or (G == math.inf).any():
            raise ValueError("`score` returned NaN or +inf")
    if (G.amax(-2) == -math.inf).any():
        raise ValueError("`score` is -inf on every key for some target")
    return torch.softmax(G, dim=-2)


def context_weights(
    phi_states,  # (..., n+1, d) features of S_0..S_n
    W=None,  # (d, d) or (..., d, d) score matrix, g(x, y) = phi(x)^T W phi(y)
    phi_queries=None,  # (..., q, d), (..., d) or None
    score=None,  # callable score(keys (..., n, d), targets (..., m, d)) -> (..., n, m); replaces W
) -> torch.Tensor:  # (..., n, m): K[..., k-1, j], weight of transition k for target j
    "Softmax weights $K_k(x)$ of the $n$ transitions for each of the $m = n+1+q$ targets."
    keys, X, _ = context_tensors(phi_states, None, phi_queries)
    check_work(
        _dense_bytes(keys, X, W, score, arrays=2),
        "bytes",
        f"the {keys.shape[-2]} x {X.shape[-2]} weights",
        "`weighted_softmax_td` iterates without building them (method='streamed')",
    )
    return _weights(keys, X, W, score)


# %%
show_doc(context_weights)


# %%
#| code-fold: true
#| code-summary: "The iteration"
#| export
def _rho(rho, keys, X, shape):
    (
        "`rho` as a tensor broadcast with `shape` (..., m): from None (ones), a tensor, or a"
        " callable on the key and target features."
    )
    if rho is None:
        return X.new_ones(shape)
    if callable(rho):
        rho = rho(keys, X)
    rho = as_tensor(rho, "rho", X.dtype, X.device)
    try:
        full = torch.broadcast_shapes(rho.shape, shape)
    except RuntimeError:
        full = ()
    if full[-1:] != shape[-1:]:
        raise ValueError(
            f"`rho` must broadcast to shape (..., m) = {tuple(shape)}, got {tuple(rho.shape)}"
        )
    return rho.expand(full)


def _iterate(update, v0, R, gamma, n_iters, return_all):
    (
        "Run v <- v + update(delta(v)) from v0, with delta_k = R_k + gamma v[k] - v[k-1] on the"
        " first n+1 entries."
    )
    n, v, vs = R.shape[-1], v0, [v0]
    for _ in range(n_iters):
        v = v + update(R + gamma * v[..., 1 : n + 1] - v[..., :n])
        if return_all:
            vs.append(v)
    return torch.stack(vs, -2) if return_all else v


def _kernel_iterate(K, R, gamma, n_iters, return_all):
    (
        "`_iterate` from v = 0 with the kernel update v(x) <- v(x) + sum_k K_k(x) delta_k, K of"
        " shape (..., n, m)."
    )
    v0 = K.new_zeros(K.shape[:-2] + K.shape[-1:])
    return _iterate(
        lambda delta: (delta.unsqueeze(-2) @ K).squeeze(-2), v0, R, gamma, n_iters, return_all
    )


# %%
#| code-fold: true
#| code-summary: "weighted_softmax_td"
#| export
@moved_to_keywords("alpha", "gamma", "n_iters", "phi_queries", "rho", "score", "return_all", "centred", "method")
def weighted_softmax_td(
    phi_states,  # (..., n+1, d) features of S_0..S_n
    rewards,  # (..., n) rewards, rewards[..., k-1] = R_k
    W,  # (d, d) or (..., d, d) score matrix (ignored, may be None, when `score` is given)
    *,
    alpha: float,  # step size
    gamma: float,  # discount factor in [0, 1)
    n_iters: int,  # number of iterations (layers)
    phi_queries=None,  # (..., q, d) query features, (..., d) for one query, or None
    rho=None,  # per-target weight: None (1), a tensor (..., m), or rho(keys, targets) -> (..., m)
    score=None,  # score(keys (..., n, d), targets (..., m, d)) -> (..., n, m); default phi^T W phi
    return_all=False,  # return every iterate v_0..v_T instead of the last
    centred=False,  # subtract a uniform head: weights K_k(x) - 1/n (Proposition 1.4)
    method="auto",  # 'dense' (build K), 'streamed' (O(n) memory; needs W) or 'auto'
    queries_only=False,  # return the values at the queries only, as a model's `predict` does
) -> torch.Tensor:  # (..., m) values at S_0..S_n, queries (the queries only with `queries_only`); (..., T+1, m) `return_all`
    (
        "Weighted softmax TD: $v_{t+1}(x) = v_t(x) + \\alpha \\rho(x) \\sum_k K_k(x)"
        " \\delta_k^{(t)}$ from $v_0 = 0$ ($K_k(x) - 1/n$ when `centred`)."
    )
    keys, X, R = context_tensors(
        phi_states, as_tensor(rewards, "rewards"), phi_queries
    )  # rewards are required
    alpha, gamma, n_iters = _scalar(alpha, "alpha"), check_gamma(gamma), _count(n_iters, "n_iters")
    return_all, centred = check_bool(return_all, "return_all"), check_bool(centred, "centred")
    first_query = _first_query(keys, phi_queries, queries_only)
    if _path(method, keys, X, W, score) == "streamed":
        return _streamed(keys, X, R, W, alpha, gamma, n_iters, rho, return_all, centred)[..., first_query:]
    K = _weights(keys, X, W, score)
    if centred:
        K = K - 1 / keys.shape[-2]
    K = K * (alpha * _rho(rho, keys, X, K.shape[:-2] + K.shape[-1:])).unsqueeze(-2)
    return _kernel_iterate(K, R, gamma, n_iters, return_all)[..., first_query:]


def _first_query(keys, phi_queries, queries_only) -> int:
    "The first output column to return: 0, or the first query's (n + 1, for n keys) with `queries_only`."
    if not check_bool(queries_only, "queries_only"):
        return 0
    if phi_queries is None:
        raise ValueError("`queries_only` needs `phi_queries`: without queries there is nothing to return")
    return keys.shape[-2] + 1


# %%
show_doc(weighted_softmax_td)


# %%
#| code-fold: true
#| code-summary: "batch_linear_td"
#| export
@moved_to_keywords("alpha", "gamma", "n_iters", "phi_queries", "return_all")
def batch_linear_td(
    phi_states,  # (..., n+1, d) features of S_0..S_n
    rewards,  # (..., n) rewards, rewards[..., k-1] = R_k
    *,
    alpha: float,  # step size
    gamma: float,  # discount factor in [0, 1)
    n_iters: int,  # number of iterations
    phi_queries=None,  # (..., q, d) query features, (..., d) for one query, or None
    return_all=False,  # return every iterate instead of the last
    C=None,  # (d, d) or (..., d, d) preconditioner of the step; None: the identity
    centred=False,  # step along the centred key features phi(S_{k-1}) - mean_k phi(S_{k-1})
    queries_only=False,  # return the values at the queries only, as a model's `predict` does
) -> torch.Tensor:  # (..., m) phi(x)^T w_T at S_0..S_n, queries (the queries only with `queries_only`); (..., T+1, m) `return_all`
    (
        "Batch linear TD(0), $w_{t+1} = w_t + \\frac{\\alpha}{n} C \\sum_k \\delta_k"
        " \\phi(S_{k-1})$ from $w_0 = 0$ (optionally centred features), read out in value space."
    )
    keys, X, R = context_tensors(
        phi_states, as_tensor(rewards, "rewards"), phi_queries
    )  # rewards are required
    alpha, gamma, n_iters = _scalar(alpha, "alpha"), check_gamma(gamma), _count(n_iters, "n_iters")
    return_all, centred = check_bool(return_all, "return_all"), check_bool(centred, "centred")
    d, batch = keys.shape[-1], keys.shape[:-2]
    direction = keys - keys.mean(-2, keepdim=True) if centred else keys
    if C is None:
        precondition = lambda u: u
    else:
        C = as_tensor(C, "C", keys.dtype, keys.device)
        if C.ndim < 2 or C.shape[-2:] != (d, d):
            raise ValueError(
                f"`C` must have shape ({d}, {d}) or (..., {d}, {d}), got {tuple(C.shape)}"
            )
        batch = torch.broadcast_shapes(batch, C.shape[:-2])
        precondition = lambda u: (C @ u.unsqueeze(-1)).squeeze(-1)
    step = (
        lambda delta: alpha
        / R.shape[-1]
        * precondition((delta.unsqueeze(-2) @ direction).squeeze(-2))
    )
    first_query = _first_query(keys, phi_queries, queries_only)
    return _linear_td(keys, X, R, gamma, n_iters, keys.new_zeros(batch + (d,)), step, return_all)[..., first_query:]


def _linear_td(keys, X, R, gamma, n_iters, w, step, return_all):
    (
        "Iterate $w_{t+1} = w_t + \\mathrm{step}(\\delta^{(t)})$ from `w` and read out "
        "$\\phi(x)^\\top w$ at the rows of `X`."
    )
    succ, ws = X[..., 1 : R.shape[-1] + 1, :], [w]
    for _ in range(n_iters):
        delta = (
            R + gamma * (succ @ w.unsqueeze(-1)).squeeze(-1) - (keys @ w.unsqueeze(-1)).squeeze(-1)
        )
        w = w + step(delta)
        ws.append(w)
    if not return_all:
        return (X @ ws[-1].unsqueeze(-1)).squeeze(-1)
    return torch.stack(ws, -2) @ X.mT


# %%
show_doc(batch_linear_td)


# %%
#| code-fold: true
#| code-summary: "two_head_linear_td"
#| export
@moved_to_keywords("alpha", "gamma", "n_iters", "phi_queries", "return_all")
def two_head_linear_td(
    phi_states,  # (..., n+1, d) features of S_0..S_n, any signs
    rewards,  # (..., n) rewards, rewards[..., k-1] = R_k
    *,
    alpha: float,  # step size
    gamma: float,  # discount factor in [0, 1)
    n_iters: int,  # number of iterations (layers)
    phi_queries=None,  # (..., q, d) query features, (..., d) for one query, or None
    return_all=False,  # return every iterate v_0..v_T instead of the last
) -> torch.Tensor:  # (..., m) values at S_0..S_n, queries; (..., T+1, m) `return_all`
    (
        "Batch linear TD as two heads: a softmax head with the shifted kernel $c +"
        " \\phi^\\top\\phi$ and $\\rho$ = its mean, minus a uniform head of weight $c$."
    )
    keys, X, R = context_tensors(
        phi_states, as_tensor(rewards, "rewards"), phi_queries
    )  # rewards are required
    alpha, gamma, n_iters = _scalar(alpha, "alpha"), check_gamma(gamma), _count(n_iters, "n_iters")
    return_all = check_bool(return_all, "return_all")
    check_work(
        _dense_bytes(keys, X, None, True, arrays=5),
        "bytes",
        f"the {keys.shape[-2]} x {X.shape[-2]} kernels of the two heads",
        "`batch_linear_td` computes the same values in O(n d) memory",
    )
    gram = keys @ X.mT  # (..., n, m) linear kernel
    c = 1 + gram.abs().amax(-2)  # (..., m) shift making the kernel positive
    K = _weights(keys, X, None, lambda k, x: torch.log(c.unsqueeze(-2) + gram))
    K = alpha * ((c + gram.mean(-2)).unsqueeze(-2) * K - c.unsqueeze(-2) / keys.shape[-2])
    return _kernel_iterate(K, R, gamma, n_iters, return_all)


# %%
show_doc(two_head_linear_td)


# %%
#| code-fold: true
#| code-summary: "check_states"
#| export
def check_states(
    states,  # (..., n+1) state indices S_0..S_n: integers, or integer-valued floats
    n_states: int,  # number of states s; indices must lie in 0..s-1
    device=None,  # device of the result; default that of `states`
) -> torch.Tensor:  # (..., n+1) int64 states
    (
        "Integer state indices of a trajectory, or a `ValueError` naming `states` (or `n_states`)"
        " and what was expected."
    )
    n_states = check_int(n_states, "n_states", low=1)
    s = states
    if not isinstance(s, torch.Tensor):
        try:
            s = np.asarray(states)
        except ValueError:
            s = np.asarray(None)  # ragged lists
        if s.dtype.kind not in "iufb":
            raise ValueError(
                f"`states` must be an integer array of shape (..., n+1), got {states!r:.60}"
            )
        s = torch.as_tensor(s)
    if s.is_floating_point():
        if not (torch.isfinite(s).all() and (s == s.round()).all()):
            raise ValueError("`states` must hold integer state indices")
        s = s.long()
    if s.dtype == torch.bool or s.is_complex() or s.ndim < 1 or s.shape[-1] < 2:
        raise ValueError(
            "`states` must be an integer array of shape (..., n+1) with n >= 1, got"
            f" {tuple(s.shape)} {s.dtype}"
        )
    if ((s < 0) | (s >= n_states)).any():
        raise ValueError(f"`states` must lie in 0..{n_states - 1}")
    return s.long().to(device or s.device)


def _tabular_context(states, rewards, n_states):
    n_states = _count(n_states, "n_states")
    if n_states < 1:
        raise ValueError("`n_states` must be a positive integer, got 0")
    S = check_states(states, n_states)
    R = as_tensor(rewards, "rewards", device=S.device)
    if R.ndim < 1 or R.shape[-1] != S.shape[-1] - 1:
        raise ValueError(
            f"`rewards` must have shape (..., {S.shape[-1] - 1}) to match `states`, got"
            f" {tuple(R.shape)}"
        )
    batch = _broadcast(S.shape[:-1], R.shape[:-1], "rewards")
    S, R = S.expand(batch + S.shape[-1:]), R.expand(batch + R.shape[-1:])
    E = torch.nn.functional.one_hot(S[..., :-1], n_states).to(
        R.dtype
    )  # (..., n, s): transition k leaves state S_{k-1}
    return S, R, E, E.sum(-2)


# %%
show_doc(check_states)


# %%
#| code-fold: true
#| code-summary: "batch_tabular_td"
#| export
@moved_to_keywords("alpha", "gamma", "n_iters", "return_all")
def batch_tabular_td(
    states,  # (..., n+1) integer states S_0..S_n
    rewards,  # (..., n) rewards, rewards[..., k-1] = R_k
    n_states: int,  # number of states s
    *,
    alpha: float,  # step size
    gamma: float,  # discount factor in [0, 1)
    n_iters: int,  # number of iterations
    return_all=False,  # return every iterate instead of the last
) -> torch.Tensor:  # (..., s) values per state; (..., n_iters+1, s) with `return_all`
    (
        "Per-state averaged batch tabular TD: $v(x) \\mathrel{+}= \\alpha \\cdot$ (mean TD error of"
        " the transitions leaving $x$)."
    )
    S, R, E, N = _tabular_context(states, rewards, n_states)
    alpha, gamma, n_iters = _scalar(alpha, "alpha"), check_gamma(gamma), _count(n_iters, "n_iters")
    return_all = check_bool(return_all, "return_all")
    A = (
        alpha * E / N.clamp(min=1).unsqueeze(-2)
    )  # (..., n, s): alpha / N(x) on the transitions leaving x
    v, vs = R.new_zeros(R.shape[:-1] + (n_states,)), []
    for _ in range(n_iters + 1):
        vs.append(v)
        delta = R + gamma * v.gather(-1, S[..., 1:]) - v.gather(-1, S[..., :-1])
        v = v + (delta.unsqueeze(-2) @ A).squeeze(-2)
    return torch.stack(vs, -2) if return_all else vs[-1]


# %%
#| code-fold: true
#| code-summary: "certainty_equivalence"
#| export
@moved_to_keywords("gamma")
def certainty_equivalence(
    states,  # (..., n+1) integer states S_0..S_n
    rewards,  # (..., n) rewards, rewards[..., k-1] = R_k
    n_states: int,  # number of states s
    *,
    gamma: float,  # discount factor in [0, 1)
    unvisited_reward=0.0,  # reward of a never-left state, made absorbing: float or (...,)
) -> torch.Tensor:  # (..., s) values of the empirical MRP
    (
        "Value of the context's empirical MRP $\\hat v = \\hat r + \\gamma \\hat P \\hat v$; a"
        " state never left is absorbing with reward `unvisited_reward`."
    )
    S, R, E, N = _tabular_context(states, rewards, n_states)
    gamma = check_gamma(gamma)
    fill = as_tensor(unvisited_reward, "unvisited_reward", device=R.device).to(R.dtype)
    if fill.ndim and fill.shape != R.shape[:-1]:
        raise ValueError(
            f"`unvisited_reward` must be a float or have shape {tuple(R.shape[:-1])}, got"
            f" {tuple(fill.shape)}"
        )
    unseen = N == 0
    I = torch.eye(n_states, dtype=R.dtype, device=R.device)
    inv = 1 / N.clamp(min=1)
    F = torch.nn.functional.one_hot(S[..., 1:], n_states).to(R.dtype)
    P_hat = torch.where(
        unseen.unsqueeze(-1), I, (E.mT @ F) * inv.unsqueeze(-1)
    )  # empirical transitions; self-loop if never left
    r_hat = torch.where(
        unseen, fill.unsqueeze(-1), (R.unsqueeze(-2) @ E).squeeze(-2) * inv
    )  # mean reward on leaving x
    return torch.linalg.solve(I - gamma * P_hat, r_hat.unsqueeze(-1)).squeeze(-1)


# %%
show_doc(batch_tabular_td)

# %%
show_doc(certainty_equivalence)


# %%
#| code-fold: true
#| code-summary: "tabular_rate"
#| export
def tabular_rate(
    states,  # (n+1,) integer states S_0..S_n of one context
    n_states: int,  # number of states s
    *,  # the rest by keyword: three floats easily swapped
    beta: float,  # score scale: one-hot features, scores beta 1[x = y]
    alpha: float,  # step size in (0, 1]
    gamma: float,  # discount factor in [0, 1)
) -> float:  # kappa = 1 - alpha (2 mu - 1 - gamma) < 1
    (
        "Proposition 1.7's rate $\\kappa$ of one one-hot context; a `ValueError` where its"
        " hypotheses fail."
    )
    S, gamma = check_states(states, n_states), check_gamma(gamma)
    if S.ndim != 1:
        raise ValueError(f"`states` must be one context of shape (n+1,), got {tuple(S.shape)}")
    alpha = check_number(
        alpha,
        "alpha",
        0.0,
        strict=True,
        high=1.0,
        what="a step size in (0, 1], where Proposition 1.7 holds",
    )
    N, n, beta = (
        torch.bincount(S[:-1], minlength=n_states).double(),
        len(S) - 1,
        check_number(beta, "beta"),
    )
    mu = (N * math.exp(beta) / (N * math.exp(beta) + n - N))[N > 0].min().item()
    if not (S[:-1] == S[-1]).any() or mu <= (1 + gamma) / 2:
        raise ValueError(
            "the hypotheses of Propositions 1.5 and 1.7 fail for this context (a target state never"
            " left, or mu <= (1 + gamma) / 2)"
        )
    return 1 - alpha * (2 * mu - 1 - gamma)


# %% [markdown]
# ### Checking the context

# %%
#| code-fold: true
keys, X, R = context_tensors(
    np.arange(8.0).reshape(4, 2), [1.0, 2.0, 3.0], phi_queries=[[9.0, 9.0], [7.0, 7.0]]
)
test_eq((keys.shape, X.shape, R.shape, X.dtype), ((3, 2), (6, 2), (3,), torch.float64))
test_eq(keys, X[:3])
test_eq(X[4:], torch.tensor([[9.0, 9.0], [7.0, 7.0]], dtype=torch.float64))
test_eq(
    context_tensors(torch.zeros(5, 4, 2), torch.zeros(5, 3), torch.ones(5, 2))[1].shape, (5, 5, 2)
)
test_eq(
    context_tensors(torch.zeros(5, 4, 2), torch.zeros(3), torch.ones(1, 7, 2))[1].shape, (5, 11, 2)
)
test_eq(
    context_tensors(torch.zeros(4, 2, dtype=torch.float32), np.zeros(3))[2].dtype, torch.float32
)

# Each malformed context fails with the name of the culprit:
bad_contexts = {
    "`phi_states` must have shape (..., n+1, d)": dict(phi_states=np.zeros(4)),
    "`rewards` must have shape (..., 3)": dict(rewards=np.zeros(4)),
    "`rewards` has batch dimensions (2,)": dict(
        rewards=np.zeros((2, 3)), phi_states=np.zeros((5, 4, 2))
    ),
    "`phi_queries` must have shape (..., q, 2)": dict(phi_queries=np.zeros((1, 3))),
    "`phi_queries` must have shape": dict(phi_queries=np.zeros((1, 1, 1, 2))),
    "`phi_states` contains NaN": dict(phi_states=np.full((4, 2), np.nan)),
    "`rewards` contains NaN": dict(rewards=[0.0, np.inf, 0.0]),
}
for msg, kw in bad_contexts.items():
    args = {**dict(phi_states=np.zeros((4, 2)), rewards=np.zeros(3)), **kw}
    test_fail(lambda: context_tensors(**args), contains=msg)

# %% [markdown]
# ### Softmax weights: columns, the formula, extreme scores
#
# Columns are probability distributions over the $n$ keys, and the weights agree with a direct
# transcription of the formula:

# %%
#| code-fold: true
rng = np.random.default_rng(0)
phi, W = rng.uniform(-1, 1, (7, 3)), rng.standard_normal((3, 3))
K = context_weights(phi, W, phi_queries=rng.uniform(-1, 1, (2, 3)))
test_eq(K.shape, (6, 9))
test_close(K.sum(0), torch.ones(9, dtype=torch.float64), eps=1e-15)
G = np.exp(phi[:-1] @ W @ phi.T)
test_close(K[:, :7], torch.from_numpy(G / G.sum(0)), eps=1e-15)

def nadaraya_watson(kernel, xs, ys, x):
    "Kernel regression estimate at `x` from samples `(xs[i], ys[i])`."
    k = np.array([kernel(xi, x) for xi in xs])
    return (k * ys).sum() / k.sum()


h, deltas = 0.7, rng.standard_normal(6)
kernels = {
    "gaussian": lambda a, b: np.exp(-np.sum((a - b) ** 2) / (2 * h * h)),
    "exponential": lambda a, b: np.exp(a @ W @ b),
}
scores = {"gaussian": lambda k, x: -torch.cdist(k, x) ** 2 / (2 * h * h), "exponential": None}
for name, kernel in kernels.items():
    K = context_weights(phi, W, score=scores[name])
    for j in range(7):
        test_close(
            (K[:, j] * torch.from_numpy(deltas)).sum(),
            nadaraya_watson(kernel, phi[:-1], deltas, phi[j]),
            eps=1e-12,
        )

# Huge scores are harmless in both precisions, and a score that is $-\infty$ on every key is
# refused:
onehot = np.eye(4)[[0, 1, 2, 1, 3]]
for dt in (torch.float32, torch.float64):
    K = context_weights(torch.tensor(onehot, dtype=dt), 1e4 * np.eye(4))
    assert torch.isfinite(K).all()
    test_close(K[:, 1], torch.tensor([0, 0.5, 0, 0.5], dtype=dt), eps=1e-7)
    test_eq(K[:, 4], torch.full((4,), 0.25, dtype=dt))
test_fail(
    lambda: context_weights(onehot, score=lambda k, x: torch.log(k @ x.mT)),
    contains="-inf on every key",
)
test_fail(lambda: context_weights(onehot, score=lambda k, x: k @ x.mT / 0), contains="NaN or +inf")
test_fail(
    lambda: context_weights(onehot, score=lambda k, x: torch.zeros(3, 3)),
    contains="`score` must return shape (..., 4, 5)",
)
test_fail(lambda: context_weights(onehot, W=np.eye(3)), contains="`W` must have shape (4, 4)")
test_fail(lambda: context_weights(onehot), contains="`W` must be given")

# %% [markdown]
# ### The iteration: exhaustive checks
#
# The checks below reuse the short Boyan-chain contexts of the lesson (unit-norm features, $W = 3I$).

# %%
#| code-fold: true
phi, R, Q = boyan_context(8, seed=0)
W = 3 * torch.eye(4, dtype=torch.float64)
base = weighted_softmax_td(phi, R, W, alpha=0.5, gamma=0.9, n_iters=25)
with_q = weighted_softmax_td(phi, R, W, alpha=0.5, gamma=0.9, n_iters=25, phi_queries=Q)

# Queries are targets only: nobody's TD error reads them. So appending queries never changes the
# values at the trajectory states, and a query's value does not depend on the other queries.
# `return_all` starts at $v_0 = 0$ and ends at the plain result.
test_eq(with_q.shape, (9 + 10,))
test_close(with_q[:9], base, eps=1e-14)
for i in range(10):
    test_close(
        weighted_softmax_td(phi, R, W, alpha=0.5, gamma=0.9, n_iters=25, phi_queries=Q[i])[9],
               with_q[9 + i], eps=1e-14
    )
allv = weighted_softmax_td(phi, R, W, alpha=0.5, gamma=0.9, n_iters=25, phi_queries=Q,
                           return_all=True)
test_eq(allv.shape, (26, 19))
test_eq(allv[0], torch.zeros(19, dtype=torch.float64))
test_eq(allv[-1], with_q)
test_eq(
    weighted_softmax_td(phi, R, W, alpha=0.5, gamma=0.9, n_iters=0, phi_queries=Q),
        torch.zeros(19, dtype=torch.float64)
)

# The three forms of `rho` agree (a constant, a tensor per target, a function of the features),
# and a `rho` with batch dimensions of its own broadcasts like the rest (a constant $\rho = 1/2$
# is the same as halving $\alpha$):
rho_fn = lambda keys, X: 1 + X[..., 0]
a = weighted_softmax_td(phi, R, W, alpha=0.5, gamma=0.9, n_iters=25, phi_queries=Q, rho=rho_fn)
test_close(
    weighted_softmax_td(phi, R, W, alpha=0.5, gamma=0.9, n_iters=25, phi_queries=Q,
                        rho=1 + torch.cat([phi, Q])[:, 0]), a, eps=1e-14
)
test_close(weighted_softmax_td(phi, R, W, alpha=0.5, gamma=0.9, n_iters=25, phi_queries=Q, rho=1.0),
           with_q, eps=1e-14)
two_rhos = weighted_softmax_td(
    phi, R, W, alpha=0.5, gamma=0.9, n_iters=25, phi_queries=Q,
                               rho=torch.tensor([[1.0], [0.5]], dtype=torch.float64)
)
test_eq(two_rhos.shape, (2, 19))
test_close(two_rhos[1],
           weighted_softmax_td(phi, R, W, alpha=0.25, gamma=0.9, n_iters=25, phi_queries=Q),
           eps=1e-14)

# Batches: a call on a stack of contexts equals a loop of single calls, and batch dimensions
# broadcast (one $W$ for all contexts, or one per context, or a grid of both):
B = 6
phis, Rs, Qs = map(torch.stack, zip(*[boyan_context(12, seed) for seed in range(B)]))
Ws = torch.stack([beta * torch.eye(4, dtype=torch.float64) for beta in range(1, B + 1)])
batched = weighted_softmax_td(phis, Rs, Ws, alpha=0.5, gamma=0.9, n_iters=20, phi_queries=Qs,
                              return_all=True)
test_eq(batched.shape, (B, 21, 13 + 10))
for b in range(B):
    test_close(
        batched[b],
        weighted_softmax_td(phis[b], Rs[b], Ws[b], alpha=0.5, gamma=0.9, n_iters=20,
                            phi_queries=Qs[b], return_all=True),
        eps=1e-14,
    )
shared_W = weighted_softmax_td(phis, Rs, Ws[0], alpha=0.5, gamma=0.9, n_iters=20, phi_queries=Qs)
for b in range(B):
    test_close(
        shared_W[b],
               weighted_softmax_td(phis[b], Rs[b], Ws[0], alpha=0.5, gamma=0.9, n_iters=20,
                                   phi_queries=Qs[b]), eps=1e-14
    )
grid = weighted_softmax_td(phis[None], Rs[None], Ws[:3, None], alpha=0.5, gamma=0.9, n_iters=20,
                           phi_queries=Qs[None])
test_eq(grid.shape, (3, B, 23))
test_close(grid[2, 4],
           weighted_softmax_td(phis[4], Rs[4], Ws[2], alpha=0.5, gamma=0.9, n_iters=20,
                               phi_queries=Qs[4]), eps=1e-14)

# Precision and devices: float64 in gives float64 out, float32 gives float32, on the input's
# device, and the two precisions agree to float32 precision (relative $10^{-5}$ of the values'
# scale after 50 iterations). Scores of $10^4$ (here $W = 2 \cdot 10^4 I$ on unit features) leave
# every value finite in both precisions.
v64 = weighted_softmax_td(phis, Rs, Ws, alpha=0.5, gamma=0.9, n_iters=50, phi_queries=Qs)
v32 = weighted_softmax_td(phis.float(), Rs.float(), Ws.float(), alpha=0.5, gamma=0.9, n_iters=50,
                          phi_queries=Qs.float())
test_eq((v64.dtype, v32.dtype, v32.device), (torch.float64, torch.float32, phis.device))
rel32 = ((v32.double() - v64).abs().max() / v64.abs().max()).item()
assert rel32 < 1e-5, rel32
for dt in (torch.float32, torch.float64):
    W_huge = 2e4 * torch.eye(4, dtype=dt)
    assert (phis.to(dt) @ W_huge @ phis.to(dt).mT).abs().max() >= 1e4
    assert torch.isfinite(
        weighted_softmax_td(phis.to(dt), Rs.to(dt), W_huge, alpha=0.5, gamma=0.9, n_iters=50,
                            phi_queries=Qs.to(dt))
    ).all()
print("float32 against float64 after 50 iterations: largest gap below 1e-5 of the values' scale")

# A case we can solve by hand: one transition ($n = 1$). Every target puts weight 1 on it, so all
# values stay equal, $v_t(x) = u_t$, and $u_{t+1} = u_t + \alpha (R_1 + \gamma u_t - u_t)$, whence
# $$u_t = \frac{R_1}{1 - \gamma}\Big(1 - \big(1 - \alpha (1 - \gamma)\big)^t\Big).$$
alpha, gamma, R1 = 0.3, 0.8, 2.5
v = weighted_softmax_td(
    rng.standard_normal((2, 3)),
    [R1],
    rng.standard_normal((3, 3)),
    alpha=alpha,
    gamma=gamma,
    n_iters=20,
    phi_queries=rng.standard_normal((4, 3)),
    return_all=True,
)
u = R1 / (1 - gamma) * (1 - (1 - alpha * (1 - gamma)) ** torch.arange(21, dtype=torch.float64))
test_eq(v.shape, (21, 6))
test_close(v, u[:, None].expand(21, 6), eps=1e-13)

# The iteration is affine in $v$. Write the TD errors as $\delta = R + D v$, with $D$ the $n
# \times m$ matrix whose row $k - 1$ holds $-1$ at column $k - 1$ (the state left) and $+\gamma$
# at column $k$ (the successor), and collect the weights in the $n \times m$ matrix $K$. Then
# $$v_{t+1} = \big(I + \alpha \operatorname{diag}(\rho)\, K^\top D\big)\, v_t + \alpha
# \operatorname{diag}(\rho)\, K^\top R .$$ With an arbitrary $W$ nothing promises convergence:
# this matrix can have eigenvalues outside the unit disc, and values then grow geometrically. The
# cell checks the affine form against the iterates, and finds such a $W$.
def iteration_matrix(phi, R, W, alpha, gamma, phi_queries=None, rho=None):
    "The affine map v -> M v + c of one iteration of weighted softmax TD, built entry by entry."
    K = context_weights(phi, W, phi_queries)
    n, m = K.shape
    D = torch.zeros(n, m, dtype=torch.float64)
    D[range(n), range(n)], D[range(n), range(1, n + 1)] = -1.0, gamma
    rho = (
        torch.ones(m, dtype=torch.float64)
        if rho is None
        else torch.as_tensor(rho, dtype=torch.float64)
    )
    return torch.eye(m, dtype=torch.float64) + alpha * rho[:, None] * (K.T @ D), alpha * rho * (
        K.T @ torch.as_tensor(R)
    )


r = np.random.default_rng(7)
phi_m, R_m, Q_m, W_m, rho_m = (
    r.standard_normal((9, 3)),
    r.standard_normal(8),
    r.standard_normal((2, 3)),
    r.standard_normal((3, 3)),
    r.uniform(0, 2, 11),
)
M_it, c_it = iteration_matrix(phi_m, R_m, W_m, 0.4, 0.9, Q_m, rho_m)
iterates = weighted_softmax_td(phi_m, R_m, W_m, alpha=0.4, gamma=0.9, n_iters=5, phi_queries=Q_m,
                               rho=rho_m, return_all=True)
for t in range(5):
    test_close(
        iterates[t + 1], M_it @ iterates[t] + c_it, eps=1e-13 * iterates[t + 1].abs().max().item()
    )
M_big, _ = iteration_matrix(phi_m, R_m, 3 * W_m, 1.5, 0.9)
spectral_radius = torch.linalg.eigvals(M_big).abs().max().item()
assert spectral_radius > 1
blowup = weighted_softmax_td(phi_m, R_m, 3 * W_m, alpha=1.5, gamma=0.9,
                             n_iters=200).abs().max().item()
assert blowup > 1e6
print(f"W' = 3W, alpha = 1.5: spectral radius {spectral_radius:.2f}, max |v_200| = {blowup:.1e}")

# %% [markdown]
# ::: {.callout-note collapse="true" title="The order of the score's arguments"}
# **The order of the score's arguments.** The lesson's example came first; here is the convention it used. We write $g(S_{k-1}, x)$: the key (the state the
# transition leaves) first, the target second. Some write the score target first,
# $g(x, S_{k-1})$. For a symmetric score the order is immaterial; for the bilinear score it is not:
# $\phi(x)^\top W \phi(y)$ read target-first is our score with $W^\top$. In the Transformer the
# score of key column $i$ for query column $j$ is $z_i^\top A z_j$, key first, which is why the
# book's $W$ is the feature block of $A$ as it stands; an attention written as
# $q_j^\top k_i = z_j^\top W_Q^\top W_K z_i$ has $W = W_K^\top W_Q$ in our convention.
# [Chapter 2](prompt.html#from-row-token-attention-to-the-books-columns) translates
# the usual row-token attention into this convention. The check below shows that the order matters
# for a non-symmetric $W$.
# :::
#
# Bad arguments fail with their names:

# %%
#| code-fold: true
good = dict(
    phi_states=np.zeros((9, 3)), rewards=np.zeros(8), W=np.eye(3), alpha=0.5, gamma=0.9, n_iters=5
)
bad_args = [
    ("`gamma` must lie in [0, 1)", dict(gamma=1.0)),
    ("`gamma` must lie in [0, 1)", dict(gamma=-0.5)),
    ("`n_iters` must be a non-negative integer", dict(n_iters=-1)),
    ("`n_iters` must be a non-negative integer", dict(n_iters=2.5)),
    ("`alpha` must be a real number (finite)", dict(alpha=float("nan"))),
    ("`alpha` must be a real number", dict(alpha="fast")),
    ("`alpha` must be a real number", dict(alpha="0.5")),
    ("`n_iters` must be a non-negative integer", dict(n_iters=float("inf"))),
    ("`rewards` must be numeric", dict(rewards=None)),
    ("`phi_states` must be real", dict(phi_states=np.ones((9, 3)) * 1j)),
    ("`W` must have shape (3, 3)", dict(W=np.eye(4))),
    (
        "`W` has batch dimensions (2,)",
        dict(W=np.zeros((2, 3, 3)), phi_states=np.zeros((5, 9, 3)), rewards=np.zeros((5, 8))),
    ),
    ("`rewards` must have shape (..., 8)", dict(rewards=np.zeros(9))),
    ("`phi_states` must have shape", dict(phi_states=np.zeros((1, 3)))),
    ("`phi_queries` must have shape", dict(phi_queries=np.zeros((2, 4)))),
    ("`rho` must broadcast to shape", dict(rho=np.ones(4))),
    (
        "`rho` contains NaN",
        dict(rho=lambda k, x: torch.full(x.shape[:-1], math.nan, dtype=x.dtype)),
    ),
    ("`score` must be a callable", dict(score="dot")),
]
for msg, kw in bad_args:
    test_fail(lambda: weighted_softmax_td(**{**good, **kw}), contains=msg)

# The order of the score's arguments matters as soon as $W$ is not symmetric. Reading
# $\phi(x)^\top W \phi(y)$ target first ($g(x, S_{k-1})$) is the same algorithm as our key-first
# convention with $W^\top$, and a different one from our convention with $W$:
W_ns = torch.from_numpy(np.random.default_rng(8).uniform(-1, 1, (4, 4)))  # not symmetric
target_first = (
    lambda keys, X: X @ W_ns @ keys.mT
)  # g(target, key) = phi(target)^T W phi(key), as (..., n, m)
v_tf = weighted_softmax_td(phi, R, None, alpha=0.5, gamma=0.9, n_iters=25, phi_queries=Q,
                           score=lambda k, x: target_first(k, x).mT)
test_close(v_tf,
           weighted_softmax_td(phi, R, W_ns.T, alpha=0.5, gamma=0.9, n_iters=25, phi_queries=Q),
           eps=1e-13)
order_gap = (v_tf - weighted_softmax_td(phi, R, W_ns, alpha=0.5, gamma=0.9, n_iters=25,
                                        phi_queries=Q)).abs().max().item()
assert order_gap > 1e-2, order_gap
print(
    f"largest |v| {v_tf.abs().max().item():.2f}; W against W^T: largest difference {order_gap:.3f}"
)

# In general, the vectorised iteration agrees with a direct transcription of the definition as
# three nested loops, on random contexts with queries, a random $\rho$ and random scores:
def wstd_loops(phi, R, W, alpha, gamma, T, Q, rho):
    "Weighted softmax TD written as loops over iterations, targets and transitions."
    n, X = len(R), np.concatenate([phi, Q])
    v = np.zeros(len(X))
    for t in range(T):
        delta = [R[k - 1] + gamma * v[k] - v[k - 1] for k in range(1, n + 1)]
        new = v.copy()
        for j, x in enumerate(X):
            e = [math.exp(phi[k - 1] @ W @ x) for k in range(1, n + 1)]
            new[j] += alpha * rho[j] * sum(e[k] * delta[k] for k in range(n)) / sum(e)
        v = new
    return v

for seed in range(10):
    r = np.random.default_rng(seed)
    n, d, q = r.integers(1, 12), r.integers(1, 5), r.integers(0, 3)
    phi, R = r.standard_normal((n + 1, d)), r.standard_normal(n)
    W, Q = r.standard_normal((d, d)), r.standard_normal((q, d))
    rho = r.uniform(0, 2, n + 1 + q)
    test_close(weighted_softmax_td(phi, R, W, alpha=0.4, gamma=0.9, n_iters=15, phi_queries=Q,
                                   rho=rho),
               torch.from_numpy(wstd_loops(phi, R, W, 0.4, 0.9, 15, Q, rho)), eps=1e-12)


# %% [markdown]
# ### Long contexts in linear memory
#
# ::: {.callout-note collapse="true" title="How the streamed path works, and when it is taken"}
# The dense path holds $K$, $n \times m$ numbers: at $n = 10^5$ that is tens of GiB. For the bilinear score
# $\phi(S_{k-1})^\top W \phi(x)$ the sum $\sum_k K_k(x)\,\delta_k$ is softmax attention of the query $W\phi(x)$
# over the keys $\phi(S_{k-1})$ with values $\delta_k$, so the path `'streamed'` computes it each iteration by fused
# attention (`scaled_dot_product_attention`, as the dual-head model's layers do), which never builds the weights:
# memory $O(n + m)$, time $O(n m d)$ per iteration instead of once (the targets go in chunks whose scores would
# fit in `CHUNK_BYTES`, so a backend without a fused kernel for the dtype, as CUDA for float64, stays bounded too). When the features repeat (a trajectory of a
# chain with $s$ states has at most $s$ distinct rows), it groups the keys by their distinct rows $u_a$, with counts
# $c_a$ and sums $D_a$ of their TD errors: $\sum_k K_k(x)\,\delta_k = \sum_a \frac{c_a e^{g(u_a, x)}}{\sum_b c_b e^{g(u_b, x)}}
# \frac{D_a}{c_a}$, a small dense kernel between distinct rows, and $O(n)$ time per iteration.
# `method='auto'` takes the path when the dense weights
# would pass `DENSE_BYTES`; the dense path, asked for or needed (a `score` function), is refused with its estimate
# above `WORK_LIMITS['bytes']`. So are `context_weights`, which returns $K$ itself, and `two_head_linear_td`,
# whose shifted kernel is not bilinear (`batch_linear_td` is the same algorithm in $O(nd)$ memory).
# :::

# %%
#| code-fold: true
# The paths agree to $10^{-12}$ relative on random contexts of every form the function takes
# (queries, a batch of contexts with a batch of $W$, `rho` as a tensor and as a function,
# `centred`, `return_all`, float32), by attention (random features) and by groups (Boyan chains,
# with attention switched off), `'auto'` switches at `DENSE_BYTES`, and what cannot be done in the
# memory allowed is refused:
def paths_agree(phi, R, W, **kw):
    "The largest difference between the dense and the streamed path, relative to the largest value."
    dense, streamed = (
        weighted_softmax_td(phi, R, W, alpha=0.4, gamma=0.9, n_iters=12, method=m, **kw)
                       for m in ("dense", "streamed")
    )
    return ((dense - streamed).abs().max() / dense.abs().max()).item()


r = np.random.default_rng(5)
for case in range(6):
    n, d, q = int(r.integers(1, 40)), int(r.integers(1, 5)), int(r.integers(0, 4))
    phi_p, R_p, W_p, Q_p = (
        torch.from_numpy(r.standard_normal(s))
        for s in ((3, n + 1, d), (3, n), (3, d, d), (3, q, d))
    )
    rho_p = torch.from_numpy(r.uniform(0, 2, n + 1 + q))
    assert paths_agree(phi_p, R_p, W_p, phi_queries=Q_p, rho=rho_p, centred=case % 2 == 1) < 1e-12
    assert (
        paths_agree(
            phi_p[0],
            R_p[0],
            W_p[0],
            phi_queries=Q_p[0],
            rho=lambda k, x: 1 + x[..., 0].tanh(),
            return_all=True,
        )
        < 1e-12
    )
    assert paths_agree(phi_p.float(), R_p.float(), W_p.float(), phi_queries=Q_p.float()) < 1e-5
with unittest.mock.patch.object(
    ictd.core, "CHUNK_BYTES", 3 * (3 * n * 8)
):  # 3 targets per call: 3 contexts, n keys
    assert paths_agree(phi_p, R_p, W_p, phi_queries=Q_p) < 1e-12


def never(*args):
    raise AssertionError("the grouped path must not attend")


with unittest.mock.patch.dict(
    globals(), _attend=never
):  # repeated features: the grouped path alone
    for seed in range(4):
        chains = [
            random_boyan_chain(n_states=6, features="unit", seed=seed + 10 * b) for b in range(3)
        ]
        paths = [sample_trajectory(c, n=40, seed=seed) for c in chains]
        phi_g, R_g = torch.stack([c.phi[S] for c, (S, _) in zip(chains, paths)]), torch.stack(
            [R for _, R in paths]
        )
        Q_g, W_g = torch.stack([c.phi for c in chains]), torch.from_numpy(
            r.standard_normal((3, 4, 4))
        )
        assert (
            paths_agree(phi_g, R_g, W_g, phi_queries=Q_g, rho=torch.from_numpy(r.uniform(0, 2, 47)))
            < 1e-12
        )
        assert (
            paths_agree(
                phi_g[0],
                R_g[0],
                3 * torch.eye(4, dtype=torch.float64),
                centred=True,
                return_all=True,
            )
            < 1e-12
        )
phi_a, R_a, Q_a = boyan_context(30, seed=4)
I4 = torch.eye(4, dtype=torch.float64)
size = 3 * 30 * (31 + 10) * 8  # bytes of the dense path's three 30 x 41 arrays
with unittest.mock.patch.object(ictd.core, "DENSE_BYTES", size - 1):
    test_eq(
        weighted_softmax_td(phi_a, R_a, 3 * I4, alpha=0.5, gamma=0.9, n_iters=5, phi_queries=Q_a),
        weighted_softmax_td(phi_a, R_a, 3 * I4, alpha=0.5, gamma=0.9, n_iters=5, phi_queries=Q_a,
                            method="streamed"),
    )
with unittest.mock.patch.object(ictd.core, "DENSE_BYTES", size):
    test_eq(
        weighted_softmax_td(phi_a, R_a, 3 * I4, alpha=0.5, gamma=0.9, n_iters=5, phi_queries=Q_a),
        weighted_softmax_td(phi_a, R_a, 3 * I4, alpha=0.5, gamma=0.9, n_iters=5, phi_queries=Q_a,
                            method="dense"),
    )
big = torch.zeros(
    10**5 + 1, 4, dtype=torch.float64
)  # n = 10^5: the dense weights are far above the limit
test_fail(
    lambda: weighted_softmax_td(big, big[1:, 0], I4, alpha=0.5, gamma=0.9, n_iters=1,
                                method="dense"),
    contains="weights of the dense path would need about",
)
test_fail(
    lambda: weighted_softmax_td(big, big[1:, 0], None, alpha=0.5, gamma=0.9, n_iters=1,
                                score=lambda k, x: k @ x.mT),
    contains="instead of a `score` function",
)
test_fail(lambda: context_weights(big, I4), contains="method='streamed'")
test_fail(
    lambda: two_head_linear_td(big, big[1:, 0], alpha=0.5, gamma=0.9, n_iters=1),
    contains="`batch_linear_td` computes the same values",
)
test_fail(
    lambda: weighted_softmax_td(phi_a, R_a, I4, alpha=0.5, gamma=0.9, n_iters=1, method="sparse"),
    contains="`method` must be one of",
)

# %% [markdown]
# ### Tabular TD: state indices, batches and bad input

# %%
#| code-fold: true
# `check_states` is the one rule for state indices in the package (the convergence chapter uses it
# too): integers, or floats with integer values, in range, with at least one transition.
test_eq(check_states([0.0, 2.0, 1.0], 3), torch.tensor([0, 2, 1]))
for bad, msg in {
    (0.5, 1.0): "must hold integer state indices",
    (0, 3): "must lie in 0..2",
    (1,): "n >= 1",
    (True, False): "must be an integer array",
}.items():
    test_fail(lambda: check_states(torch.tensor(bad), 3), contains=msg)
test_fail(lambda: check_states([0, 1], 0), contains="`n_states` must be an integer >= 1")
for bad in (None, "abc", [[0, 1], [1]]):
    test_fail(lambda: check_states(bad, 3), contains="`states` must be an integer array")
phi_l3, R_l3, I3 = np.eye(3)[[0, 1, 2, 1]], [1.0, 0.0, 2.0], np.eye(3)
for a in (
    -5.0,
    0.0,
    1.5,
    5.0,
    math.nan,
):  # kappa is a rate only for a step size in (0, 1] (the proof's diagonal term)
    test_fail(
        lambda: tabular_rate([0, 0, 0, 1, 0], 2, beta=8.0, alpha=a, gamma=0.5),
        contains="`alpha` must be a step size in (0, 1]",
    )
test_fail(
    lambda: tabular_rate([0, 0, 0, 1, 0], 2, beta=math.inf, alpha=1.0, gamma=0.5),
    contains="`beta` must be a finite number",
)
test_fail(
    lambda: tabular_rate([[0, 0, 1], [0, 1, 0]], 2, beta=8.0, alpha=1.0, gamma=0.5),
    contains="`states` must be one context",
)
for flag in (
    "return_all",
    "centred",
):  # a string such as "False" is truthy: refused rather than read as True
    test_fail(
        lambda: weighted_softmax_td(phi_l3, R_l3, I3, alpha=0.5, gamma=0.9, n_iters=2,
                                    **{flag: "False"}),
        contains=f"`{flag}` must be a bool",
    )
    test_fail(
        lambda: batch_linear_td(phi_l3, R_l3, alpha=0.5, gamma=0.9, n_iters=2, **{flag: "False"}),
        contains=f"`{flag}` must be a bool",
    )

# Batched calls equal loops, and bad input is refused:
Ss = torch.from_numpy(np.random.default_rng(2).integers(0, 6, (5, 16)))
Rs = torch.from_numpy(np.random.default_rng(3).uniform(-1, 1, (5, 15)))
test_eq(
    batch_tabular_td(Ss, Rs, 6, alpha=0.5, gamma=0.9, n_iters=30, return_all=True).shape, (5, 31, 6)
)
for b in range(5):
    test_close(
        batch_tabular_td(Ss, Rs, 6, alpha=0.5, gamma=0.9, n_iters=30)[b],
        batch_tabular_td(Ss[b], Rs[b], 6, alpha=0.5, gamma=0.9, n_iters=30),
        eps=1e-14,
    )
    test_close(
        certainty_equivalence(Ss, Rs, 6, gamma=0.9)[b],
        certainty_equivalence(Ss[b], Rs[b], 6, gamma=0.9),
        eps=1e-13,
    )
for msg, kw in {
    "`states` must lie in 0..5": dict(states=[0, 6, 1]),
    "`states` must hold integer state indices": dict(states=[0.0, 1.5, 1.0]),
    "`states` must be an integer array of shape (..., n+1)": dict(states=[0]),
    "`rewards` must have shape (..., 2)": dict(rewards=[1.0]),
    "`n_states` must be a non-negative integer": dict(n_states=2.5),
    "`gamma` must lie in [0, 1)": dict(gamma=1.0),
}.items():
    args = {**dict(states=[0, 1, 1], rewards=[1.0, 2.0], n_states=6, gamma=0.9), **kw}
    test_fail(lambda: certainty_equivalence(**args), contains=msg)
    test_fail(lambda: batch_tabular_td(alpha=0.5, n_iters=3, **args), contains=msg)

# A hand example for the tabular functions: the trajectory $0 \to 1 \to 0 \to 2$ with rewards $1,
# 2, 3$ leaves state 0 twice (to 1 and to 2, mean reward 2) and state 1 once (to 0, reward 2); it
# never leaves state 2. So $\hat v(2) = 0$, $\hat v(1) = 2 + \gamma \hat v(0)$ and $\hat v(0) = 2
# + \frac\gamma2 (\hat v(1) + \hat v(2))$, whence $\hat v(0) = (2 + \gamma)/(1 - \gamma^2/2)$.
# Batch tabular TD reaches it, at a rate no worse than $1 - \alpha(1 - \gamma)$ per iteration (its
# update is $v \leftarrow (1-\alpha) v + \alpha(\hat r + \gamma \hat P v)$ on the states left, a
# contraction in the max norm), and it never moves state 2:
g = 0.5
v0_hand = (2 + g) / (1 - g * g / 2)
ce = certainty_equivalence([0, 1, 0, 2], [1.0, 2.0, 3.0], 3, gamma=g)
test_close(ce, torch.tensor([v0_hand, 2 + g * v0_hand, 0.0], dtype=torch.float64), eps=1e-14)
tab = batch_tabular_td(
    [0, 1, 0, 2], [1.0, 2.0, 3.0], 3, alpha=0.7, gamma=g, n_iters=200, return_all=True
)
test_close(tab[-1], ce, eps=1e-14)
test_eq(tab[:, 2], torch.zeros(201, dtype=torch.float64))
absorbing = certainty_equivalence([0, 1, 0, 2], [1.0, 2.0, 3.0], 3, gamma=g, unvisited_reward=1.0)
test_close(absorbing[2], 1 / (1 - g), eps=1e-14)
test_close(absorbing[1], 2 + g * absorbing[0], eps=1e-14)
test_fail(
    lambda: certainty_equivalence([0, 1, 0, 2], [1.0, 2.0, 3.0], 3, gamma=g,
                                  unvisited_reward=[1.0, 2.0]),
    contains="`unvisited_reward`",
)
err = (tab[:60] - ce).abs().max(1).values
assert (err[1:] <= (1 - 0.7 * (1 - g)) * err[:-1] + 1e-15).all()

# %% [markdown]
# ### Batch linear TD: preconditioner and centring
#
# `batch_linear_td` takes a preconditioner `C` and `centred=True` (the linear side of Proposition 1.4). The identity
# preconditioner is the plain algorithm, centring changes the result, a batch of preconditioners broadcasts, and a
# preconditioner of the wrong shape is refused:

# %%
#| code-fold: true
phi_l, R_l, Q_l = boyan_context(12, seed=3)
I4 = torch.eye(4, dtype=torch.float64)
plain = batch_linear_td(phi_l, R_l, alpha=0.5, gamma=0.9, n_iters=30, phi_queries=Q_l)
test_close(batch_linear_td(phi_l, R_l, alpha=0.5, gamma=0.9, n_iters=30, phi_queries=Q_l, C=I4),
           plain, eps=1e-14)
assert (batch_linear_td(phi_l, R_l, alpha=0.5, gamma=0.9, n_iters=30, phi_queries=Q_l,
                        centred=True) - plain).abs().max() > 1e-3
Cs = torch.stack([I4, 0.5 * I4])
test_close(
    batch_linear_td(phi_l, R_l, alpha=0.5, gamma=0.9, n_iters=30, phi_queries=Q_l, C=Cs)[1],
    batch_linear_td(phi_l, R_l, alpha=0.25, gamma=0.9, n_iters=30, phi_queries=Q_l),
    eps=1e-14,
)
test_fail(
    lambda: batch_linear_td(phi_l, R_l, alpha=0.5, gamma=0.9, n_iters=3, C=torch.eye(3)),
    contains="`C` must have shape (4, 4)",
)

# %% [markdown]
# ### Linear TD: the fixed point, batches, and the role of $\rho$
#
# A sanity check of `batch_linear_td` on its own: when it converges, its limit is the TD fixed
# point $w^\star = A_{\mathrm{TD}}^{-1} b_{\mathrm{TD}}$ with $A_{\mathrm{TD}} = \frac1n \sum_k \phi(S_{k-1}) (\phi(S_{k-1}) - \gamma \phi(S_k))^\top$
# and $b_{\mathrm{TD}} = \frac1n \sum_k R_k \phi(S_{k-1})$ (the solution of $\sum_k \delta_k \phi(S_{k-1}) = 0$).

# %%
#| code-fold: true
mrp = random_boyan_chain(seed=1)
S, R = sample_trajectory(mrp, n=400, seed=1)
Phi = mrp.phi[S]
A = Phi[:-1].T @ (Phi[:-1] - mrp.gamma * Phi[1:]) / 400
b = Phi[:-1].T @ R / 400
test_close(batch_linear_td(Phi, R, alpha=0.5, gamma=mrp.gamma, n_iters=3000),
           Phi @ torch.linalg.solve(A, b), eps=1e-10)

# The same holds batched: one call on a stack of 32 contexts matches one `batch_linear_td` call,
# and both match the loop of single calls.
phis, Rs, Qs = (
    rng.uniform(0.1, 1, (32, 21, 4)),
    rng.uniform(-1, 1, (32, 20)),
    rng.uniform(0.1, 1, (32, 2, 4)),
)
v_soft = weighted_softmax_td(phis, Rs, None, alpha=0.1, gamma=0.9, n_iters=80, phi_queries=Qs,
                             rho=linear_rho, score=linear_score)
v_lin = batch_linear_td(phis, Rs, alpha=0.1, gamma=0.9, n_iters=80, phi_queries=Qs)
test_close(v_soft, v_lin, eps=1e-12)
for b in range(0, 32, 8):
    test_close(v_lin[b],
               batch_linear_td(phis[b], Rs[b], alpha=0.1, gamma=0.9, n_iters=80, phi_queries=Qs[b]),
               eps=1e-14)

# The reduction is specific to this $\rho$: with $\rho = 1$ the same score gives a different
# algorithm (normalised rather than summed TD errors), and the check fails, as it should:
test_ne(weighted_softmax_td(phis, Rs, None, alpha=0.1, gamma=0.9, n_iters=80, phi_queries=Qs,
                            score=linear_score), v_lin)
assert (
    weighted_softmax_td(phis, Rs, None, alpha=0.1, gamma=0.9, n_iters=80, phi_queries=Qs,
                        score=linear_score) - v_lin
).abs().max() > 1e-3

phis_s, Rs_s, Qs_s = (
    rng.uniform(-1, 1, (32, 21, 4)),
    rng.uniform(-1, 1, (32, 20)),
    rng.uniform(-1, 1, (32, 2, 4)),
)
test_close(
    two_head_linear_td(phis_s, Rs_s, alpha=0.1, gamma=0.9, n_iters=80, phi_queries=Qs_s),
    batch_linear_td(phis_s, Rs_s, alpha=0.1, gamma=0.9, n_iters=80, phi_queries=Qs_s),
    eps=1e-12,
)
test_fail(
    lambda: two_head_linear_td(phis_s, Rs_s, alpha=0.1, gamma=1.0, n_iters=5),
    contains="`gamma` must lie in [0, 1)",
)

# %% [markdown]
# ### Small scores: the one-step inequality
#
# First the one-step inequality, on random contexts, random score matrices, random vectors
# $\delta$ and scales $\varepsilon$ from $10^{-3}$ to $1$: the left side never exceeds the bound,
# and the bound is not loose by orders of magnitude (the largest ratio is printed).

# %%
#| code-fold: true
ratios = []
for seed in range(40):
    r = np.random.default_rng(seed)
    n, d = int(r.integers(2, 30)), int(r.integers(1, 5))
    phi_e, W_e, delta_e = (
        r.standard_normal((n + 1, d)),
        r.standard_normal((d, d)),
        torch.from_numpy(r.standard_normal(n)),
    )
    keys_e = torch.from_numpy(phi_e[:-1])
    for eps in (1e-3, 1e-2, 1e-1, 1.0):
        K_e = context_weights(phi_e, eps * W_e)
        g_e = keys_e @ torch.from_numpy(W_e) @ torch.from_numpy(phi_e).T  # (n, m) unscaled scores
        first = delta_e.mean() + eps * ((g_e - g_e.mean(0)) * delta_e[:, None]).mean(0)
        lhs = (delta_e @ K_e - first).abs()
        bound = eps**2 * (g_e.amax(0) - g_e.amin(0)) ** 2 / 8 * (delta_e.max() - delta_e.min())
        assert (lhs <= bound * (1 + 1e-9) + 1e-15).all()
        if eps <= 0.1:
            ratios.append((lhs / bound).max().item())
print(f"largest |remainder| / bound for eps <= 0.1: {max(ratios):.2f}")

# %%
#| export
from ictd.boyan import check_arguments

check_arguments(
    globals()
)  # every public function refuses, naming it, an argument its annotation rules out (chapter 0)

# %%
#| hide
import nbdev; nbdev.nbdev_export()
