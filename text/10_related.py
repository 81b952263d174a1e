# %% [markdown]
# # Related work
# > Where weighted softmax TD sits among kernel-based reinforcement learning and softmax in-context learning: what coincides, under which conditions, with a numerical check where one can be made.

# %%
#| hide
from fastcore.test import *

# %%
#| hide
import math
import numpy as np
import torch
import matplotlib.pyplot as plt
from IPython.display import Markdown
from ictd.boyan import random_boyan_chain, sample_trajectory
from ictd.wstd import weighted_softmax_td, batch_linear_td, context_weights, certainty_equivalence

# %% [markdown]
# ::: {.callout-note}
# **What this page shows.** Weighted softmax TD is an old idea met from a new side: iterated, it is
# kernel-based reinforcement learning (Ormoneit and Sen) evaluated by TD iterations instead of solved,
# and in the tabular limit the two coincide (checked below); it is an averager in Gordon's sense;
# kernel LSTD and Gaussian-process TD fit other objectives. Outside the memorisation regime, linear TD
# generalises through the features when they carry the values, and the kernel does not.
# :::
#
# This page places the algorithm of [chapter 1](weighted_softmax_td.html) next to older and
# neighbouring ideas. Every relation is stated as what coincides and under which conditions; where a
# relation can be checked with the book's functions, a cell checks it. Descriptions of the cited
# works are summaries in our words of their published abstracts, not quotations; the relations to
# weighted softmax TD and their proofs are ours.
#
# ## The line of work this book follows
#
# * **Wang, Blaser, Daneshmand and Zhang (ICLR 2025), "Transformers Can Learn Temporal Difference
#   Methods for In-Context Reinforcement Learning"** (arXiv:2405.13861). A linear-attention
#   Transformer whose forward pass is batch linear TD, with parameters that emerge from multi-task TD
#   pretraining. The book's [chapter 7](linear.html) reproduces it side by side with the softmax
#   construction.
# * **Wang, Chandra and Zhang (NeurIPS 2025), "Towards Provable Emergence of In-Context Reinforcement
#   Learning"** (arXiv:2509.18389). Still a linear Transformer for policy evaluation; it proves that
#   one of the global minimisers of the pretraining loss implements in-context TD.
#
# **Who is "Wang et al. 2025b".** The summaries of the paper in the project's files cite
# "Wang et al. [2025a,b]" as the earlier analyses that rely on linear attention. The two 2025 papers
# above are the ones of this line whose first author is Wang and that analyse linear attention for
# in-context TD; the second shares two authors (Chandra, Zhang) with the paper this book follows. The
# summaries do not say which letter is which; by publication order (May 2024 and September 2025 on
# arXiv) the ICLR paper would be 2025a and the NeurIPS paper **2025b**. That assignment is our inference,
# not something the project's sources state.
#
# The same group's **Xie, Liu, Chandra and Zhang (2026), "Convergence and Emergence of In-Context
# Reinforcement Learning with Chain of Thought"** (arXiv:2605.07123) studies the linear-Transformer
# setting with chain-of-thought generation, where each generated step is a TD update.

# %% [markdown]
# ## Kernel-based reinforcement learning (Ormoneit and Sen, 2002)
#
# Ormoneit and Sen ("Kernel-Based Reinforcement Learning", *Machine Learning* 49, 2002) assign a
# value to each sampled state and iterate a Bellman operator in which the expectation over the next
# state is replaced by a normalised kernel average over sampled transitions; the iteration converges
# to the unique solution of that approximate Bellman equation from any start, and the estimate is
# consistent as the sample grows. For policy evaluation on one context, with the softmax weights
# $K_k(x)$ of chapter 1 as the normalised kernel, their iteration reads
# $$u_{t+1}(x) = \sum_k K_k(x)\,\big(R_k + \gamma\, u_t(S_k)\big).$$
# Weighted softmax TD with $\alpha = 1$, $\rho = 1$ is
# $$v_{t+1}(x) = \sum_k K_k(x)\,\big(R_k + \gamma\, v_t(S_k)\big) + \Big(v_t(x) - \sum_k K_k(x)\, v_t(S_{k-1})\Big).$$
#
# **What coincides (ours).** The two iterations are the same map exactly when the bracket vanishes
# along the iterates: the kernel average of the values at the keys must give back the target's own
# value. That holds in the tabular limit (one-hot features, $W = \beta I$, $\beta \to \infty$), where
# $K_k(x) = \mathbf 1[S_{k-1} = x]/N(x)$ and the iterates are state-consistent, provided every target
# state is left (the hypothesis of chapter 1's Proposition 1.5): both are then value iteration on the context's
# empirical MRP. Away from that limit they differ, and so do their fixed points: KBRL's is a
# kernel-smoothed value that depends on the bandwidth, while weighted softmax TD's, by
# [Proposition 1.8](weighted_softmax_td.html#small-scores-over-long-horizons-where-the-iteration-goes),
# is the certainty-equivalence value at the trajectory states whatever the kernel (when the matrix $B$
# there is nonsingular and the iteration converges). The kernel shapes the path and the values away
# from the data, not the fixed point on the data.

# %%
chain = random_boyan_chain(n_states=13, seed=3)
S, R = sample_trajectory(chain, n=60, seed=3)
assert set(S.tolist()) <= set(S[:-1].tolist())   # every target state is left
ce = certainty_equivalence(S, R, 13, gamma=chain.gamma)[S]

def kbrl(phi, R, gamma, n_iters=None, **kw):
    """Ormoneit-Sen kernel-based policy evaluation on the context:
    n_iters iterates from 0, or the fixed point if n_iters is None."""
    K = context_weights(phi, **kw)
    n = K.shape[0]
    shift = torch.zeros(n, n + 1, dtype=torch.float64)
    shift[range(n), range(1, n + 1)] = 1.   # picks u(S_k) for transition k
    if n_iters is None:
        eye = torch.eye(n + 1, dtype=torch.float64)
        return torch.linalg.solve(eye - gamma * K.T @ shift, K.T @ R)
    u, us = torch.zeros(n + 1, dtype=torch.float64), []
    for _ in range(n_iters): u = K.T @ (R + gamma * shift @ u); us.append(u)
    return torch.stack(us)

onehot = torch.eye(13, dtype=torch.float64)[S]
W40 = 40 * torch.eye(13, dtype=torch.float64)
tab_kbrl = kbrl(onehot, R, chain.gamma, 100, W=W40)
tab_wstd = weighted_softmax_td(onehot, R, W40, alpha=1.0, gamma=chain.gamma, n_iters=100,
                               return_all=True)[1:]
test_close(tab_wstd, tab_kbrl, eps=1e-12)
print("tabular limit (beta = 40, alpha = 1): "
      "largest gap over 100 iterations below 1e-12 (checked above)")

pos = torch.linspace(0, 1, 13, dtype=torch.float64)[S][:, None]   # states on a line
for h in (0.03, 0.08):
    gauss = lambda k, x: -torch.cdist(k, x) ** 2 / (2 * h * h)
    v_far = weighted_softmax_td(pos, R, None, alpha=0.5, gamma=chain.gamma, n_iters=6000,
                                score=gauss)
    u_fix = kbrl(pos, R, chain.gamma, score=gauss)
    test_close(v_far, ce, eps=1e-10)
    assert (u_fix - ce).abs().max() > 1e-2
    print(f"Gaussian kernel h = {h}: "
          "weighted softmax TD after 6000 iterations - CE value: below 1e-10; "
          f"KBRL fixed point - CE value: {(u_fix - ce).abs().max().item():.2f}")

# %% [markdown]
# ## Averagers (Gordon, 1995)
#
# Gordon ("Stable Function Approximation in Dynamic Programming", ICML 1995) proves that fitted value
# iteration converges when the function approximator is a non-expansion in the max norm, a class that
# includes $k$-nearest-neighbour and other fixed-weight averaging schemes ("averagers"), and that the
# approximate algorithm is then exact dynamic programming on a modified MDP.
#
# **Relation (ours).** The softmax weights of a target are non-negative and sum to one, so
# $v \mapsto \big(\sum_k K_k(x)\, v(S_k)\big)_x$ is an averager, and KBRL above is value iteration composed
# with it: a $\gamma$-contraction, which is why it converges from any start. Weighted softmax TD does
# not have that form: it averages TD errors and adds them to the target's own value, and its one-step
# map can expand. Chapter 1 exhibits a $W$ whose iteration has spectral radius above one. It is an
# averager-style contraction only where chapter 1's Proposition 1.7 or chapter 5's diagonality
# condition holds, for example in the tabular limit, where the rate is $1 - \alpha(1 - \gamma)$.

# %% [markdown]
# ## Kernel LSTD and Gaussian-process TD
#
# * **Kernel LSTD** (Xu, Hu and Lu, "Kernel-Based Least Squares Policy Iteration for Reinforcement
#   Learning", *IEEE Transactions on Neural Networks*, 2007; an earlier kernel LSTD by Xu et al., 2005)
#   solves least-squares TD in the feature space of a kernel, with a sparsified dictionary of samples.
# * **GPTD** (Engel, Mannor and Meir, "Bayes Meets Bellman: The Gaussian Process Approach to Temporal
#   Difference Learning", ICML 2003; extended to stochastic transitions in ICML 2005) puts a Gaussian
#   process prior on the value function and a Gaussian noise model on the rewards, and computes the
#   posterior in closed form.
# * Taylor and Parr ("Kernelized Value Function Approximation for Reinforcement Learning", ICML 2009)
#   show that, up to regularisation, kernel LSTD equals a model-based method that regresses the reward
#   and transition models with kernels, and that GPTD's posterior mean equals the same value function.
#
# **Relation (ours).** Both families write the value as an expansion over the samples,
# $v(x) = \sum_y \beta_y\, k(y, x)$, as weighted softmax TD does (chapter 1's lemma: $v_t(x) = \rho(x) \sum_k c^{(t)}_k K_k(x)$),
# but with an unnormalised kernel, solved in one linear system with ridge regularisation instead of
# iterated. Their fixed points meet on the data: LSTD with kernel features $k(\cdot, y)$ over the
# distinct states $y$ the context leaves, without regularisation, solves $\sum_k k(y, S_{k-1})\, \delta_k = 0$
# for every $y$, that is $G\, (N \circ m) = 0$ with the Gram matrix $G$ of those states and the per-state
# mean TD errors $m$. A nonsingular $G$ forces $m = 0$: the certainty-equivalence value at the
# trajectory states, the same limit as weighted softmax TD's (Proposition 1.8(a), with its matrix $J$ replaced by
# $G \operatorname{diag}(N)$). Ridge regularisation moves kernel LSTD off it; finite depth (early stopping)
# is what keeps weighted softmax TD off it. Off the data the two interpolate differently (RKHS
# expansion against normalised weights).

# %%
U = torch.unique(S[:-1])
line = torch.linspace(0, 1, 13, dtype=torch.float64)
for h in (0.08, 0.2):
    k = lambda a, b: torch.exp(-(a[:, None] - b[None]) ** 2 / (2 * h * h))
    F, F_next = k(line[S[:-1]], line[U]), k(line[S[1:]], line[U])   # keys' and successors' features
    A_lstd, b_lstd = F.T @ (F - chain.gamma * F_next), F.T @ R
    gaps = {}
    for lam in (0., 1e-3, 1e-1):
        ridge = lam * torch.eye(len(U), dtype=torch.float64)
        beta = torch.linalg.solve(A_lstd + ridge, b_lstd)
        gaps[lam] = (k(line[S], line[U]) @ beta - ce).abs().max().item()
    cond = torch.linalg.cond(A_lstd).item()
    if cond < 1e6: assert gaps[0.] < 1e-10 and gaps[1e-1] > 1e-2
    reliable = lambda lam: cond < 1e6 or lam > 0
    size = lambda g: "below 1e-10" if g < 1e-10 else f"{g:.0e}"
    show = lambda lam, g: size(g) if reliable(lam) else "not reliable"
    gap_text = ", ".join(f"{show(lam, g)} at ridge {lam:g}" for lam, g in gaps.items())
    cond_text = f"{cond:.0e}" if cond < 1e6 else "above 1e6"
    print(f"kernel LSTD, h = {h} (condition number {cond_text}): gap to the CE value {gap_text}")

# %% [markdown]
# At the wider bandwidth the system is ill-conditioned (printed), and the unregularised solution
# carries the round-off that the condition number allows: the coincidence is exact in exact
# arithmetic only, the same caveat as for Proposition 1.8 at small scores.
#
# ## Softmax in-context learning as kernel regression and functional gradient descent
#
# * **Han, Wang, Zhao and Ji** ("Explaining Emergent In-Context Learning as Kernel Regression",
#   arXiv:2305.12766, 2023; TMLR 2025 as "Understanding Emergent In-Context Learning from a Kernel
#   Regression Perspective") argue that in-context prediction behaves asymptotically like the
#   Nadaraya-Watson estimator $\hat y = \sum_i y_i K(x, x_i) / \sum_i K(x, x_i)$ and find attention patterns
#   consistent with it.
# * **Cheng, Chen and Sra** ("Transformers Implement Functional Gradient Descent to Learn Non-Linear
#   Functions In Context", ICML 2024) show that non-linear attention can implement gradient descent in
#   function space, in the RKHS of a kernel set by the attention's non-linearity, and that the best
#   non-linearity depends on the function class.
#
# **Relation (ours).** Chapter 1's softmax weights are exactly Nadaraya-Watson weights with the kernel
# $\exp g$, so one step of weighted softmax TD moves each value by the Nadaraya-Watson estimate of the
# TD error at that state. With $\gamma = 0$ the TD error is the residual $R_k - v(S_{k-1})$ and weighted
# softmax TD is functional gradient descent on $\frac12 \sum_k (R_k - v(S_{k-1}))^2$ with the step direction
# smoothed by the normalised kernel: the regression setting of Cheng et al. with a per-target
# normalised kernel in place of an RKHS kernel. With $\gamma > 0$ the analogy stops at the update's
# form: the TD error is not the gradient of any loss in $v$ (the successor term makes the update a
# semi-gradient), which is why convergence needs a condition (chapter 5) rather than following from
# descent on a loss.
#
# ## Summary of the relations
#
# Weighted softmax TD is a *kernel-smoothed TD iteration*, not kernel-based value iteration: it
# coincides with KBRL only in the tabular limit at $\alpha = 1$, its fixed point on the data is the
# certainty-equivalence value like unregularised kernel LSTD's, and its stability is not inherited
# from the averager property. What is new in the paper's construction is that a softmax Transformer
# computes it layer by layer, with the depth playing the role of the number of iterations.

# %% [markdown]
# ## Outside the memorisation regime
#
# The book's side-by-side comparisons of the softmax and linear constructions use 10-state chains
# and contexts of $n = 100$ transitions, in which nearly every state the queries ask about occurs in
# the context. There the kernel can look values up, while linear TD must project them onto $d = 4$
# features, and the comparison says little about generalisation. This section asks the next
# question: what happens at query states the context never visits, and on chains larger than the
# context ($s = 50, 100$ states at $n = 30$)?
#
# **Protocol.** Random Boyan chains with $U(-1, 1)$ features ($d = 4$), $\gamma = 0.9$, a stationary
# context of $n$ transitions, every state of the chain as a query. Two reward models: i.i.d.
# $U(-1, 1)$ rewards (the default; $v_\pi$ is generally not in the span of the features), and
# "representable" rewards ($v_\pi = \Phi w$, $w \sim N(0, I)$). Two methods run for the same number of
# iterations, $T = 100$ (the depth of a 100-layer Transformer): weighted softmax TD with the
# Transformer's score ($W = \beta I$, $\rho = 1$) and batch linear TD, and the zero predictor as the
# floor any method must beat. Each method's step size (and $\beta$ for the kernel) is tuned per
# setting on 50 tasks by the mean squared error over all states, then evaluated on 150 fresh tasks;
# the tuned values are printed with a flag when one sits on the edge of its grid. The errors are
# squared errors against $v_\pi$, averaged over the states of a group (seen: the state occurs in
# $S_0, \dots, S_n$; unseen: it does not), then over tasks, with standard errors over tasks; the
# comparisons are paired (same tasks).

# %%
#| code-fold: true
#| code-summary: "The tasks, the two methods and the tuning"
BETAS = [2. ** k for k in range(-5, 5)]   # 1/32 .. 16
ALPHAS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1., 2.]
T_ITERS, SETTINGS_MEM = 100, [(10, 100), (10, 30), (50, 30), (100, 30)]

def task_batch(s, n, rewards, n_tasks, seed):
    """Stacked contexts of n_tasks random Boyan chains: features of S_0..S_n, rewards,
    features of all states, v_pi, and which states occur in the context."""
    out = []
    for child in np.random.SeedSequence(seed).spawn(n_tasks):
        rng = np.random.default_rng(child)
        mrp = random_boyan_chain(n_states=s, rewards=rewards, seed=rng)
        S_t, R_t = sample_trajectory(mrp, n=n, seed=rng)
        seen = torch.zeros(s, dtype=torch.bool)
        seen[S_t] = True
        out.append((mrp.phi[S_t], R_t, mrp.phi, mrp.v_pi, seen))
    return [torch.stack(x) for x in zip(*out)]

def softmax_values(phi, R, Q, alpha, betas):
    """Weighted softmax TD (W = beta I, rho = 1) after T_ITERS iterations at every state,
    one row per beta: (len(betas), tasks, s)."""
    eye = torch.eye(phi.shape[-1], dtype=torch.float64)
    W = torch.tensor(betas, dtype=torch.float64)[:, None, None, None] * eye
    return weighted_softmax_td(phi, R, W, alpha=alpha, gamma=0.9, n_iters=T_ITERS,
                               phi_queries=Q)[..., -Q.shape[-2]:]

def linear_values(phi, R, Q, alpha):
    "Batch linear TD after T_ITERS iterations at every state: (tasks, s)."
    return batch_linear_td(phi, R, alpha=alpha, gamma=0.9, n_iters=T_ITERS,
                           phi_queries=Q)[..., -Q.shape[-2]:]

def group_errors(pred, v, seen):
    "Per-task MSE over the seen and over the unseen states (NaN where a task has none)."
    e = (pred - v) ** 2
    return (e * seen).sum(-1) / seen.sum(-1), (e * ~seen).sum(-1) / (~seen).sum(-1)

def tune(phi, R, Q, v):
    "Best (beta, alpha) for weighted softmax TD and best alpha for linear TD, by the MSE."
    mse = lambda pred: torch.nan_to_num(((pred - v) ** 2).mean(-1).mean(-1), nan=math.inf)
    soft = torch.stack([mse(softmax_values(phi, R, Q, a, BETAS)) for a in ALPHAS])  # alphas x betas
    i, j = divmod(int(soft.argmin()), len(BETAS))
    lin = torch.stack([mse(linear_values(phi, R, Q, a)) for a in ALPHAS])
    return (BETAS[j], ALPHAS[i]), ALPHAS[int(lin.argmin())]

def on_edge(beta, alpha_s, alpha_l):
    "Which tuned values sit on the edge of their grid."
    tuned = (("beta", beta, BETAS), ("softmax alpha", alpha_s, ALPHAS),
             ("linear alpha", alpha_l, ALPHAS))
    return [name for name, val, grid in tuned if val in (grid[0], grid[-1])]

def mean_se(x):
    "Mean and standard error over the tasks where x is defined."
    x = x[~torch.isnan(x)]
    if len(x) < 2: return math.nan, math.nan
    return x.mean().item(), (x.std() / math.sqrt(len(x))).item()

fmt = lambda x: "–" if math.isnan(mean_se(x)[0]) else "{:.3f} ± {:.3f}".format(*mean_se(x))

# %%
mem_rows = []
for rewards in ("random", "representable"):
    for s_, n_ in SETTINGS_MEM:
        (beta_t, alpha_s), alpha_l = tune(*task_batch(s_, n_, rewards, 50, seed=[s_, n_, 0])[:4])
        phi_t, R_t, Q_t, v_t, seen_t = task_batch(s_, n_, rewards, 150, seed=[s_, n_, 1])
        preds = {"softmax": softmax_values(phi_t, R_t, Q_t, alpha_s, [beta_t])[0],
                 "linear": linear_values(phi_t, R_t, Q_t, alpha_l), "zero": torch.zeros_like(v_t)}
        mem_rows.append(dict(rewards=rewards, s=s_, n=n_,
                             beta=beta_t, alpha_s=alpha_s, alpha_l=alpha_l,
                             edge=on_edge(beta_t, alpha_s, alpha_l),
                             errs={m: group_errors(p, v_t, seen_t) for m, p in preds.items()},
                             unseen_share=(~seen_t).double().mean().item()))

row = {(r["rewards"], r["s"], r["n"]): r for r in mem_rows}
edges = [f"{r['rewards']} rewards, s = {r['s']}, n = {r['n']}: {', '.join(r['edge'])}"
         for r in mem_rows if r["edge"]]
print("Tuned values on the edge of their grid: " + ("; ".join(edges) if edges else "none") + ".")
Markdown("| rewards | $s$ | $n$ | unseen states "
         "| tuned $\\beta$, $\\alpha$ (softmax) | tuned $\\alpha$ (linear) |\n"
         "|---|---|---|---|---|---|\n"
         + "\n".join(f"| {r['rewards']} | {r['s']} | {r['n']} | {r['unseen_share']:.0%} | "
                     f"{r['beta']:g}, {r['alpha_s']:g} | {r['alpha_l']:g} |" for r in mem_rows))


# %% [markdown]
# The errors, first on the states the context visits, then on the states it never shows:

# %%
def error_table(group):
    "The table of mean ± standard error of each method on one group of states (0 seen, 1 unseen)."
    head = ("| rewards | $s$ | $n$ | weighted softmax TD | batch linear TD | zero |\n"
            "|---|---|---|---|---|---|\n")
    cells = lambda r: " | ".join(fmt(r["errs"][m][group]) for m in ("softmax", "linear", "zero"))
    lines = [f"| {r['rewards']} | {r['s']} | {r['n']} | {cells(r)} |" for r in mem_rows]
    return head + "\n".join(lines)

Markdown("**Seen states**\n\n" + error_table(0))

# %%
Markdown("**Unseen states**\n\n" + error_table(1))

# %% [markdown]
# The figure draws the same numbers: for each reward model (rows) and group of states (columns),
# the error of each method against the setting, with two-standard-error bars.

# %%
#| fig-cap: "Figure 10.1: Weighted softmax TD has the lowest error on seen states when rewards are random, batch linear TD has it when rewards are representable by the features, and on unseen states of the larger chains with random rewards no method beats the zero predictor."
#| fig-alt: "Four log-scale panels of the mean squared error against v_pi: rows for random and representable rewards, columns for seen and unseen states, each at four settings (s = 10, n = 100; s = 10, n = 30; s = 50, n = 30; s = 100, n = 30), with weighted softmax TD (blue circles), batch linear TD (orange squares) and the zero predictor (green triangles, dotted), and two-standard-error bars."
#| code-fold: true
METHODS = {"softmax": ("o-", r"weighted softmax TD ($W = \beta I$)"),
           "linear": ("s-", "batch linear TD"), "zero": ("^:", "zero predictor")}
fig, axs = plt.subplots(2, 2, figsize=(6.2, 6), sharex=True)
labels = [f"s={s_}\nn={n_}" for s_, n_ in SETTINGS_MEM]
for i, rewards in enumerate(("random", "representable")):
    for g, group in enumerate(("seen", "unseen")):
        ax = axs[i, g]
        for k, (m, (style, label)) in enumerate(METHODS.items()):
            stats = np.array([mean_se(row[rewards, *sn]["errs"][m][g]) for sn in SETTINGS_MEM])
            ax.errorbar(np.arange(4) + (k - 1) * 0.08, stats[:, 0], yerr=2 * stats[:, 1],
                        fmt=style, ms=4, capsize=2, color=f"C{k}", label=label)
        ax.set(yscale="log", title=f"{rewards} rewards,\n{group} states")
        ax.set_xticks(range(4), labels, fontsize=8)
    axs[i, 0].set_ylabel("MSE against $v_\\pi$\n(return units$^2$)")
fig.legend(*axs[0, 0].get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=8,
           frameon=False)
plt.tight_layout(rect=(0, 0.07, 1, 1))


# %% [markdown]
# Mean squared errors against $v_\pi$ (return units squared), mean ± standard error over 150 tasks per
# row; "unseen states" is the share of the chain's states that do not occur in the context. The
# next cell turns the tables into statements, each a paired comparison on the same tasks, called
# established when the mean paired difference exceeds two standard errors:

# %%
def paired(r, a, b, group):
    "Mean and standard error over tasks of error(a) - error(b) on one group (0 seen, 1 unseen)."
    return mean_se(r["errs"][a][group] - r["errs"][b][group])

def verdict(r, a, b, group):
    m, se = paired(r, a, b, group)
    return m + 2 * se < 0

lin_wins_unseen = all(verdict(row["representable", s_, 30], "linear", "softmax", 1)
                      for s_ in (50, 100))
lin_wins_seen = all(verdict(row["representable", *sn], "linear", "softmax", 0)
                    for sn in SETTINGS_MEM)
soft_wins_seen = all(verdict(row["random", *sn], "softmax", "linear", 0) for sn in SETTINGS_MEM)
none_beats_zero = not any(verdict(row["random", s_, 30], m, "zero", 1)
                          for s_ in (50, 100) for m in ("softmax", "linear"))
assert lin_wins_unseen and lin_wins_seen and soft_wins_seen and none_beats_zero
mean_err = lambda key, m, g: mean_se(row[key]["errs"][m][g])[0]
ratio = lambda key, g: mean_err(key, "softmax", g) / mean_err(key, "linear", g)
r_unseen_50 = ratio(("representable", 50, 30), 1)
r_unseen_100 = ratio(("representable", 100, 30), 1)
r_seen_mem = ratio(("representable", 10, 100), 0)
k_seen_mem, k_seen_100 = 1 / ratio(("random", 10, 100), 0), 1 / ratio(("random", 100, 30), 0)
Markdown(f"""
* **Linear TD's generalisation through features beats the kernel when $v_\\pi$ is in the span
  of the features**: on unseen states of the 50- and 100-state chains its error is
  {r_unseen_50:.1f} and {r_unseen_100:.1f} times smaller, and it also wins on the states the
  context visits, in every setting, including the memorisation regime ($s = 10$, $n = 100$:
  {r_seen_mem:.1f} times smaller). Four features fitted to 30 transitions identify $w$; a local
  average of TD errors cannot extrapolate along them.
* **The kernel wins when $v_\\pi$ is not representable, on the states the context visits**: with
  i.i.d. rewards its error on seen states is {k_seen_mem:.0f} times smaller at $s = 10$, $n = 100$
  and still {k_seen_100:.1f} times smaller at $s = 100$, $n = 30$. This is the lookup the book's
  side-by-side measures.
* **On unseen states with non-representable values nothing beats predicting zero** (no paired
  difference to the zero predictor reaches two standard errors at $s = 50, 100$): i.i.d. random
  features make feature similarity uninformative about value similarity, so the kernel has
  nothing to interpolate
  from, and linear TD's projection is the wrong model.

Measured on random Boyan chains with i.i.d. $U(-1, 1)$ features ($d = 4$), the Transformer's
score $W = \\beta I$ and $T = 100$ iterations: the "softmax is better on random features" of the
memorisation regime is a statement about looking values up, not about generalisation; outside it
the answer depends on whether the features carry the values, and when they do, linear TD
generalises and the kernel does not.
""")
