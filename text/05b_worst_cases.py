# %%
#| default_exp experiments.worst_cases

# %%
#| export
from __future__ import annotations
import itertools
import json
import sys
import warnings
from pathlib import Path
import numpy as np
import scipy.linalg
import scipy.optimize
import torch
from tqdm.auto import tqdm
from ictd.boyan import MRP, boyan_transitions, check_gamma, random_boyan_chain
from ictd.convergence import (circulant_threshold, kernel_attention, kernel_diagonality, rate_bound, relaxation_time, spectral_radius,
                              sup_error, td_recursion)
from ictd.core import OKABE_ITO, atomic_write_text, check_type, plain_log_ticks, provenance
from ictd.core import provenance_note, substream
from ictd.experiments.convergence import measured_rate, scale_for_diagonality
from ictd.tasks import stack_tasks, task_rng

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *

# %%
#| hide
import re
import math
import matplotlib.pyplot as plt
from IPython.display import Markdown
from ictd.convergence import circulant_limit
from ictd.core import record_claim

# %%
#| hide
from ictd.core import folded_docs   # the folded API entries of appendix A


# %% [markdown]
# # Worst cases
# > Beyond the fast-mixing random Boyan chains of chapter 5a: the rate on slowly mixing chains, and how diagonal the attention must be for the layer recursion to converge on every chain, with certified lower bounds on the threshold of Proposition 5.7.

# %% [markdown]
# ::: {.callout-tip title="What this page shows"}
# - On slowly mixing chains the per-layer rate is slower than the tabular rate, as Proposition 5.6 predicts, and by how much.
# - How diagonal the attention must be for the recursion to converge on *every* chain: a search for worst cases gives
#   certified lower bounds on the threshold $m^*$ of Proposition 5.7 for 3 to 8 states.
# :::

# %% [markdown]
# [Chapter 5a](convergence_experiments.html) measured the statements of [chapter 5](convergence.html) on random Boyan chains,
# which mix in a few steps. This page asks two questions that such chains cannot answer. First, is the per-layer rate
# always the tabular rate $\kappa_{\mathrm{tab}}$ when the attention leaks, as it was there? Proposition 5.6 says no for slowly
# mixing chains, and the first section measures by how much. Second, how diagonal must the attention be for the recursion
# $v_{l+1} = v_l + \alpha M (r + \gamma P v_l - v_l)$ to converge on *every* chain? Proposition 5.1 asks for a minimum
# diagonal above $(1 + \gamma)/2$; the true dividing line is the diagonality threshold $m^*(\gamma, \alpha, s)$ of
# Proposition 5.7, bounded there on both sides, and the second section searches for worst cases to see where between the
# bounds it lies for $3$ to $8$ states. Both are the project's own **[ours]** work; the module `ictd.experiments.worst_cases`
# builds on `ictd.convergence` and on chapter 5a's `ictd.experiments.convergence`.
#
# *How to read this page.* Each section states its question, what is run, the result (a figure, and for the threshold a table
# of certified values), what it shows, and the check that asserts it. The functions that run them and the input
# validation are in the last section, [Implementation and tests](#implementation-and-tests). Symbols are those of [Notation](notation.html) and chapter 5.

# %% [markdown]
# ## Slowly mixing chains: when the rate is not the tabular rate
#
# [Experiments 5 and 6 of chapter 5a](convergence_experiments.html#experiment-5-the-measured-rate-against-the-bound) found the rate $\kappa_{\mathrm{tab}} = 1 - \alpha(1 - \gamma)$ in the leaky regime, on random Boyan chains,
# which mix in a few steps. [Proposition 5.6](convergence.html#slowly-mixing-chains) says that on a lazy chain the rate
# tends instead to $1 - \alpha(1 - \gamma)\mu_{\min}(M_\pi)$ as the chain slows down. Two families measure the whole
# range: lazy versions $P_\eta$ of random Boyan chains, and two random 5-state Boyan blocks that jump to the other
# block's first state with probability $\eta$ (a nearly decomposable chain). For each chain, unit-norm features and
# $W = \beta I$ with $\beta$ set (by bisection, `scale_for_diagonality` of [Experiment 6](convergence_experiments.html#experiment-6-the-leaky-regime-at-finite-n)) so that
# $\min_x M_\pi(x, x) = 0.96$: the diagonal condition holds on every chain. The mixing time is measured by the
# relaxation time $1/(1 - |\mu_2(P)|)$ (`relaxation_time` of chapter 5).

# %%
#| export
def _two_blocks(P1:np.ndarray, P2:np.ndarray, eta:float)->np.ndarray:
    "Two chains joined: each state jumps to the other block's first state with probability eta."
    s1, s2 = len(P1), len(P2)
    P = np.zeros((s1 + s2, s1 + s2))
    P[:s1, :s1], P[s1:, s1:] = (1 - eta) * P1, (1 - eta) * P2
    P[:s1, s1] += eta
    P[s1:, 0] += eta
    return P


# %%
#| export
def slow_mixing_experiment(n_tasks:int=20,      # chains per family and mixing parameter
                           etas=None,           # (K,) laziness / cross-block probabilities (capped at 1/2 for the blocks); default 13 log-spaced in [1e-3, 1]
                           target:float=0.96,   # min_x M_pi(x, x) of every chain
                           alpha:float=1.,      # step size in (0, 1]
                           seed:int=7000,       # chain b: features, rewards and first chain from task b of stream 0, its two blocks from task b of streams 1 and 2
                           n_layers:int=200,    # depth of the population recursion
                           fit_start:int=100,   # first depth of the rate fit
                          )->dict:              # etas, lam, gamma, and per family ("lazy", "two blocks") tensors (B, K): relax, rates, spectral, rho, min_diag; lazy_limit (B,)
    "Rates of the population recursion on lazy Boyan chains and on two Boyan blocks joined by a rare jump (unit-norm features, $W = \\beta I$), against the relaxation time."
    etas = np.logspace(-3, 0, 13) if etas is None else np.asarray(etas, dtype=float)
    bases = [random_boyan_chain(features="unit", seed=task_rng(substream(seed, 0), b)) for b in range(int(n_tasks))]
    blocks = [[boyan_transitions(5, task_rng(substream(seed, k), b)) for k in (1, 2)] for b in range(int(n_tasks))]
    gamma = bases[0].gamma
    out = dict(etas=etas, lam=1 - alpha * (1 - gamma), gamma=gamma, alpha=alpha, fit=f"{fit_start}-{n_layers}")
    for family in ("lazy", "two blocks"):
        tb = stack_tasks(MRP((1 - e) * np.eye(10) + e * base.P.numpy() if family == "lazy" else _two_blocks(*blk, min(e, 0.5)),
                             base.r.numpy(), gamma, base.phi.numpy()) for base, blk in zip(bases, blocks) for e in etas)
        beta = scale_for_diagonality(tb.phi, tb.d_pi, torch.full((len(tb),), target, dtype=torch.float64))
        M = kernel_attention(tb.phi, beta[:, None, None] * torch.eye(tb.phi.shape[-1], dtype=torch.float64), tb.d_pi)
        err = sup_error(td_recursion(M, tb.P, tb.r, gamma=gamma, alpha=alpha, n_iters=n_layers), tb.v_pi.unsqueeze(1))
        cols = dict(relax=relaxation_time(tb.P), rates=measured_rate(err, fit_start), spectral=spectral_radius(M, tb.P, gamma=gamma, alpha=alpha),
                    rho=rate_bound(M, gamma=gamma, alpha=alpha), min_diag=kernel_diagonality(M)[1])
        out[family] = {k: v.reshape(int(n_tasks), len(etas)) for k, v in cols.items()}
        if family == "lazy":
            mu_min = torch.linalg.eigvals(M).real.amin(-1).reshape(int(n_tasks), len(etas))[:, 0]
            out["lazy_limit"] = 1 - alpha * (1 - gamma) * mu_min
    return out


# %%
#| export
def plot_slow_mixing(result:dict, # output of `slow_mixing_experiment`
                    ):            # the matplotlib figure
    "Spectral radius of $B$ (median and 10-90% band over chains) and measured rate against the relaxation time, with $\\kappa_{\\mathrm{tab}}$ and the lazy-chain limit."
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.0, 5.0))
    for i, family in enumerate(("lazy", "two blocks")):
        r = result[family]
        x, y = r["relax"].median(0).values, r["spectral"]
        ax.plot(x, y.median(0).values, ("-", "--")[i], color=OKABE_ITO[i], label=f"spectral radius of $B$, {family} (median of {len(y)} chains)")
        ax.fill_between(x, y.quantile(0.1, 0), y.quantile(0.9, 0), color=OKABE_ITO[i], alpha=0.2)
        ax.plot(x, r["rates"].median(0).values, "os"[i], color=OKABE_ITO[i], ms=4, mfc="none", label=f"measured rate, depths {result['fit']}, {family} (median)")
    m = result["lazy"]["min_diag"].mean().item()
    ax.axhline(result["lam"], color="k", lw=1, label=r"$\kappa_{\mathrm{tab}} = 1 - \alpha(1 - \gamma)$")
    ax.axhline(result["lazy_limit"].median(), color=OKABE_ITO[0], ls=":", label=r"lazy limit $1 - \alpha(1-\gamma)\mu_{\min}(M_\pi)$ (median)")
    ax.axhline(1 - result["alpha"] * (1 - result["gamma"]) * (2 * m - 1), color=OKABE_ITO[5], ls="-.", label=r"its cap $1 - \alpha(1-\gamma)(2 \min_x M_\pi(x,x) - 1)$")
    ax.set(xscale="log", xlabel="relaxation time $1/(1 - |\\mu_2(P)|)$ (steps)", ylabel="per-layer rate of $\\|v_L - v_\\pi\\|_\\infty$",
           title=f"Slow mixing slows the iteration\n(unit-norm features, $\\min_x M_\\pi(x, x) = {m:.2f}$; bound $\\kappa = {result['lazy']['rho'].mean():.2f}$)")
    plain_log_ticks(ax, "x")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2))
    fig.tight_layout()
    return fig


# %% [markdown]
# Claims, measured on these two families: on the fastest-mixing lazy chains the rate is $\kappa_{\mathrm{tab}}$; on lazy chains the
# asymptotic rate (the spectral radius of $B$) grows with the relaxation time and reaches Proposition 5.6's limit; and it
# always lies between $\kappa_{\mathrm{tab}}$ and $\kappa$ (Propositions 5.1 and 5.2: a sanity check of the theorems). The measured rate, fitted
# over depths 100 to 200, is plotted too: where two modes have nearly the same rate it has not yet settled on the slower,
# and it can lie below the spectral radius (its range is printed under the figure).

# %%
#| fig-cap: "Figure 5b.1: on lazy chains the iteration slows as the chain mixes more slowly, up to the limit of Proposition 5.6; two-block chains barely slow down."
#| fig-alt: "Spectral radius and measured rate against the relaxation time on a log axis, for lazy and two-block chains, with horizontal lines for the tabular rate, the lazy limit and its cap."
slow = slow_mixing_experiment(20)
lazy_r, block_r, lam = slow["lazy"], slow["two blocks"], slow["lam"]
for r in (lazy_r, block_r):
    assert (r["spectral"] <= r["rho"] + 1e-12).all() and (
        r["spectral"] >= lam - 1e-12
    ).all()  # Proposition 5.1, and the tabular rate is an eigenvalue
    assert (r["min_diag"] - 0.96).abs().max() < 1e-9  # sanity check: beta was set for this
assert (lazy_r["spectral"][:, -1] - lam).abs().max() < 1e-9 and (
    lazy_r["rates"][:, -1] - lam
).abs().max() < 2e-3
assert ((lazy_r["spectral"][:, 0] - slow["lazy_limit"]).abs() < 2e-3).all() and (
    slow["lazy_limit"] > lam + 3e-3
).all()
med = lazy_r["spectral"].median(0).values
assert (med[:-1] >= med[1:] - 1e-12).all() and med[
    0
] > lam + 3e-3  # grows as the relaxation time grows
record_claim(
    "slow-mixing",
    "On slowly mixing lazy chains the rate is slower than $\\kappa_{\\mathrm{tab}}$ and reaches the"
    " limit of Proposition 5.6.",
    "measured",
    "worst_cases",
    "#slowly-mixing-chains-when-the-rate-is-not-the-tabular-rate",
)
plot_slow_mixing(slow)
fast_gap = (lazy_r["rates"][:, -1] - lam).abs().max().item()
assert (
    fast_gap < 1e-6
), fast_gap  # a rounding-level gap: stated as this bound, whose digits do not depend on the machine
Markdown(
    "Fastest lazy chains ($\\eta = 1$, median relaxation time"
    f" {lazy_r['relax'][:, -1].median():.2f}): rates within $10^{{-6}}$ of"
    f" $\\kappa_{{\\mathrm{{tab}}}} = {lam:.2f}$. Slowest ($\\eta = 10^{{-3}}$): lazy chains"
    f" (relaxation time {lazy_r['relax'][:, 0].median():.0f}) have rates in"
    f" [{lazy_r['spectral'][:, 0].min():.4f}, {lazy_r['spectral'][:, 0].max():.4f}], within"
    f" {(lazy_r['spectral'][:, 0] - slow['lazy_limit']).abs().max():.1e} of the limit; two blocks"
    f" (relaxation time {block_r['relax'][:, 0].median():.0f}) in"
    f" [{block_r['spectral'][:, 0].min():.4f}, {block_r['spectral'][:, 0].max():.4f}]. The bound"
    f" $\\kappa$ is {lazy_r['rho'].mean():.3f} on every chain. Depth factor at the lazy limit:"
    f" {math.log(lam) / math.log(slow['lazy_limit'].median()):.3f} (median chain), at most"
    f" {math.log(lam) / math.log(1 - slow['alpha'] * (1 - slow['gamma']) * (2 * 0.96 - 1)):.3f} by"
    f" the cap. The median measured rate (depths {slow['fit']}) over the mixing parameters lies in"
    f" [{lazy_r['rates'].median(0).values.min():.4f}, {lazy_r['rates'].median(0).values.max():.4f}]"
    f" on lazy chains and in [{block_r['rates'].median(0).values.min():.4f},"
    f" {block_r['rates'].median(0).values.max():.4f}] on two blocks, "
    + (
        "dipping below"
        if min(r["rates"].median(0).values.min() for r in (lazy_r, block_r)) < lam - 1e-4
        else "never below"
    )
    + " $\\kappa_{\\mathrm{tab}}$."
)


# %% [markdown]
# The lazy chains slow down by a small amount, and Proposition 5.6 says why it must be small under the diagonal
# condition: by Gershgorin's theorem $\mu_{\min} \ge 2\min_x M_\pi(x, x) - 1$, so the limit is at most
# $1 - \alpha(1 - \gamma)(2\min_x M_\pi(x, x) - 1)$ (vermillion dash-dotted line); the factor by which the depth for a given accuracy
# grows, $\ln \kappa_{\mathrm{tab}} / \ln(\text{limit})$, is printed above.
# The two-block chains, although nearly decomposable, barely slow down at all: their slow mode is the block indicator,
# and (our reading, not measured here) the attention of these chains rarely leaks across blocks, so $M_\pi$ nearly
# preserves that mode: slow mixing would then slow the iteration only where the attention mixes the slow mode of $P$.

# %% [markdown]
# The leaky-regime finding, restated with its scope: *on random Boyan chains* (which relax in a few steps) the rate is
# the constant direction's $\kappa_{\mathrm{tab}}$ whatever the diagonality; on slowly mixing chains it is slower, up to
# $1 - \alpha(1 - \gamma)\mu_{\min}$ on lazy ones, while still below the diagonal bound $\kappa$ when the condition holds.

# %% [markdown]
# ## The true threshold: a search for worst cases
#
# [Proposition 5.7](convergence.html#how-diagonal-is-diagonal-enough-the-true-threshold) defines the diagonality threshold
# $m^*(\gamma, \alpha, s)$, shows it is exactly $1/2$ at two states and at most $(1 + \gamma)/2$, and bounds it from below
# by circulant pairs. What is the true $m^*$ for $s \ge 3$? We search for it numerically: `worst_case_pair` maximises
# the spectral radius of $B$ over positive pairs at a fixed minimum diagonal (multistart L-BFGS on the logits of $M$ and
# $P$, from random starts and from the best circulant pair), and `threshold_search` ratchets $m$ upward along the pairs
# it finds. The search can only certify *lower* bounds on $m^*$: each comes with an explicit positive pair whose
# spectral radius is checked to be at least one.

# %%
#| export
def _row_softmax(X:np.ndarray)->np.ndarray:
    E = np.exp(X - X.max(1, keepdims=True))
    return E / E.sum(1, keepdims=True)


# %%
#| export
def _pair_from_logits(z:np.ndarray, m:float, s:int)->tuple:
    "M = m I + (1 - m) softmax(X) and P = softmax(Y), both positive, from the logits z = (X, Y) flattened."
    return m * np.eye(s) + (1 - m) * _row_softmax(z[:s * s].reshape(s, s)), _row_softmax(z[s * s:].reshape(s, s))


# %%
#| export
def _quotient_radius(z:np.ndarray, m:float, s:int, gamma:float, alpha:float)->tuple:
    "Spectral radius of B on vectors modulo constants (Proposition 5.2, item 3), and its gradient in the logits."
    Q, P = _row_softmax(z[:s * s].reshape(s, s)), _row_softmax(z[s * s:].reshape(s, s))
    M, I = m * np.eye(s) + (1 - m) * Q, np.eye(s)
    L, R = np.hstack([-np.ones((s - 1, 1)), I[1:, 1:]]), I[:, 1:]             # coordinates modulo constants
    w, vl, vr = scipy.linalg.eig(L @ (I - alpha * M @ (I - gamma * P)) @ R, left=True, right=True)
    k = int(np.argmax(np.abs(w)))
    C = np.outer(vl[:, k].conj(), vr[:, k]) / (vl[:, k].conj() @ vr[:, k])    # d lambda / d(L B R)
    GB = L.T @ np.real(np.conj(w[k]) / abs(w[k]) * C) @ R.T
    GM, GP = -alpha * GB @ (I - gamma * P).T, alpha * gamma * M.T @ GB
    GQ = (1 - m) * GM
    return abs(w[k]), np.concatenate([(Q * (GQ - (GQ * Q).sum(1, keepdims=True))).ravel(), (P * (GP - (GP * P).sum(1, keepdims=True))).ravel()])


# %%
#| export
def _maximise_radius(z:np.ndarray, m:float, s:int, gamma:float, alpha:float)->tuple:
    "Local maximum of the quotient radius from the logits z (L-BFGS-B, logits in [-25, 25])."
    res = scipy.optimize.minimize(lambda x: tuple(-t for t in _quotient_radius(x, m, s, gamma, alpha)), z, jac=True,
                                  method="L-BFGS-B", bounds=[(-25., 25.)] * len(z), options=dict(maxiter=300))
    return res.x, -res.fun


# %%
#| export
def _circulant_logits(gamma:float, alpha:float, s:int)->np.ndarray:
    "Logits of a positive pair close to the best circulant pair, embedded in s states (Proposition 5.7, item 2)."
    c, X, Y = circulant_threshold(gamma, alpha, s), np.full((s, s), -20.), np.full((s, s), -20.)
    n, a, b = c["n"], c["a"], c["b"]
    for x in range(s):
        if x < n: X[x, (x + a) % n], Y[x, (x + b) % n] = 20., 20.
        else: X[x, x], Y[x, (x + 1) % s] = 20., 20.
    if n < s: Y[0, n] = 0.                                                      # a rare move into the added states
    return np.concatenate([X.ravel(), Y.ravel()])


# %%
#| export
def _check_search_args(m, gamma, alpha, n_states):
    "The search's arguments, checked: (s, gamma)."
    if int(n_states) != n_states or n_states < 2: raise ValueError(f"`n_states` must be an integer of at least 2, got {n_states}")
    s = int(n_states)
    if not 0 <= m < 1: raise ValueError(f"`m` must lie in [0, 1), got {m}")
    if not 0 < alpha <= 1: raise ValueError(f"`alpha` must lie in (0, 1], got {alpha}")
    return s, check_gamma(gamma)


# %%
#| export
def worst_case_pair(m:float,       # the smallest allowed diagonal of M
                    gamma:float,   # discount factor in [0, 1)
                    alpha:float,   # step size in (0, 1]
                    n_states:int,  # number of states s >= 2
                    seed:int=0,    # seed of the random starts
                    n_starts:int=20, # random starts, besides the circulant one
                   )->tuple:       # (M, P) float64 (s, s): M positive, row-stochastic, diagonal >= m; P positive (so irreducible), stochastic
    "The pair with the largest spectral radius of $B = I - \\alpha M (I - \\gamma P)$ found by a multistart search at minimum diagonal `m`."
    s, gamma = _check_search_args(m, gamma, alpha, n_states)
    rng = np.random.default_rng(seed)
    starts = [_circulant_logits(gamma, alpha, s)] + [rng.normal(scale=3., size=2 * s * s) for _ in range(int(n_starts))]
    best = max((_maximise_radius(z, m, s, gamma, alpha) for z in starts), key=lambda t: t[1])[0]
    return tuple(torch.from_numpy(A) for A in _pair_from_logits(best, m, s))


# %% [markdown]
# `worst_case_pair` keeps its promises on a few sizes, and below the circulant bound it finds a diverging pair:

# %%
#| code-fold: true
#| code-summary: "Code of the check"
for s_c in (2, 3, 5):
    M_w, P_w = worst_case_pair(0.6, 0.9, 1.0, s_c, seed=1, n_starts=3)
    assert (
        M_w.dtype == torch.float64
        and (M_w > 0).all()
        and (P_w > 0).all()
        and M_w.diagonal().min() >= 0.6 - 1e-12
    )
    test_close(M_w.sum(1), torch.ones(s_c, dtype=torch.float64), eps=1e-12)
    test_close(P_w.sum(1), torch.ones(s_c, dtype=torch.float64), eps=1e-12)
m_c5 = circulant_threshold(0.9, 1.0, 5)["m"]
assert (
    spectral_radius(*worst_case_pair(m_c5 - 1e-3, 0.9, 1.0, 6, n_starts=0), gamma=0.9, alpha=1.0)
    > 1
)
assert (
    spectral_radius(*worst_case_pair(0.5, 0.9, 1.0, 2, n_starts=5), gamma=0.9, alpha=1.0) < 1
)  # item 3: two states never fail above 1/2


# %%
#| export
def _family_max(z:np.ndarray, m:float, s:int, gamma:float, alpha:float, margin:float=1e-9)->float:
    "Largest m' >= m with spr(B) >= 1 + margin along M = m' I + (1 - m') Q for the logits z (grid, then bisection); None if none."
    f = lambda mm: spectral_radius(*map(torch.from_numpy, _pair_from_logits(z, mm, s)), gamma=gamma, alpha=alpha).item() >= 1 + margin
    ms = np.linspace(m, (1 + gamma) / 2, 101)
    ok = np.nonzero([f(mm) for mm in ms])[0]
    if not len(ok): return None
    lo, hi = ms[ok.max()], ms[min(ok.max() + 1, len(ms) - 1)]
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) else (lo, mid)
    return lo


# %%
#| export
def threshold_search(*, gamma:float,     # discount factor in [0, 1)
                     alpha:float,     # step size in (0, 1]
                     n_states:int,    # number of states s >= 2
                     seed:int=0,      # seed of the random starts
                     n_starts:int=100, # random starts
                     step:float=2e-3, # how far above the record each new search starts
                    )->dict:          # m (a certified lower bound on m*), M, P (the certificate, float64), rho (its spectral radius >= 1)
    "A certified lower bound on the diagonality threshold $m^*$: the largest minimum diagonal at which the search finds a pair with $\\operatorname{spr}(B) \\ge 1$."
    s, gamma = _check_search_args(0., gamma, alpha, n_states)
    rng = np.random.default_rng(seed)
    c = circulant_threshold(gamma, alpha, s)
    z0 = _circulant_logits(gamma, alpha, s)
    best_m, best_z = c["m"] - 1e-4, None
    for i in range(int(n_starts) + 1):
        z, m = (z0, best_m) if i == 0 else (rng.normal(scale=3., size=2 * s * s), best_m + step)
        for _ in range(100):                                        # ratchet: optimise at m, then slide m up along the pair found
            z, r = _maximise_radius(z, m, s, gamma, alpha)
            mm = _family_max(z, m, s, gamma, alpha) if r >= 1 + 1e-9 else None
            if mm is None: break
            if best_z is None or mm > best_m: best_m, best_z = mm, z.copy()
            m = mm + step
    if best_z is None: raise RuntimeError(f"no certificate found at gamma = {gamma}, alpha = {alpha}, s = {s}")
    M, P = (torch.from_numpy(A) for A in _pair_from_logits(best_z, best_m, s))
    return dict(m=best_m, M=M, P=P, rho=spectral_radius(M, P, gamma=gamma, alpha=alpha).item())


# %% [markdown]
# The certificates of the book come from one run of `save_threshold_certificates` (a few minutes, so its results are
# stored in `nbs/data/convergence_threshold.json` with the command, commit and date that made them). The chapter loads
# them and re-checks each certificate exactly: the pair is positive and stochastic, its minimum diagonal is the
# certified value, and its spectral radius is at least one. (The recorded command imports the function from the module
# it lived in when the file was made; it is now `ictd.experiments.worst_cases.save_threshold_certificates`, same code.)

# %%
#| export
THRESHOLD_FILE = Path(__file__).resolve().parents[2] / "nbs" / "data" / "convergence_threshold.json" if "__file__" in globals() else Path("data/convergence_threshold.json")


# %%
#| export
def save_threshold_certificates(path=THRESHOLD_FILE,          # where to write the JSON file
                                gammas=(0.5, 0.9, 0.99),      # discount factors
                                alphas=(0.25, 0.5, 1.),       # step sizes
                                sizes=tuple(range(2, 9)),     # numbers of states
                                n_starts:int=100,             # random starts per search
                                seed:int=0,                   # seed of the searches
                                progress:bool=True,           # tqdm over the searches
                                command:str=None,             # the command line to record (default: sys.argv)
                               )->dict:                       # the records written
    "Run `threshold_search` over a grid and save its certificates with the command, commit and date that made them."
    records = []
    for g, a, s in tqdm(list(itertools.product(gammas, alphas, sizes)), disable=not progress, desc="threshold search"):
        r = threshold_search(gamma=g, alpha=a, n_states=s, seed=seed, n_starts=n_starts)
        records.append(dict(gamma=g, alpha=a, n_states=s, m=r["m"], rho=r["rho"], circulant=circulant_threshold(g, a, s)["m"],
                            M=r["M"].tolist(), P=r["P"].tolist()))
    out = provenance(command or " ".join(sys.argv), settings=dict(n_starts=n_starts, seed=seed), records=records)
    atomic_write_text(path, json.dumps(out))
    return out


# %%
#| export
def check_certificate(record:dict, # one record: gamma, alpha, n_states, m, M, P
                     )->float:     # the spectral radius of B, >= 1
    "Re-check a certificate: M positive, row-stochastic, with minimum diagonal m; P positive and stochastic; $\\operatorname{spr}(B) \\ge 1$."
    check_type(record, dict, "record")
    missing = [k for k in ("gamma", "alpha", "n_states", "m", "M", "P") if k not in record]
    if missing: raise ValueError(f"`record` must have the keys gamma, alpha, n_states, m, M and P; missing {missing}")
    M, P = (torch.tensor(record[k], dtype=torch.float64) for k in ("M", "P"))
    s = record["n_states"]
    ok = (M.shape == P.shape == (s, s) and (M > 0).all() and (P > 0).all() and (M.diagonal().min() >= record["m"] - 1e-12)
          and ((M.sum(1) - 1).abs().max() < 1e-12) and ((P.sum(1) - 1).abs().max() < 1e-12))
    rho = spectral_radius(M, P, gamma=record["gamma"], alpha=record["alpha"]).item()
    if not ok or rho < 1: raise ValueError(f"invalid certificate at gamma = {record['gamma']}, alpha = {record['alpha']}, s = {s}: rho = {rho}")
    return rho


# %%
#| export
def load_threshold_certificates(path=THRESHOLD_FILE)->dict:
    "The stored certificates (see `save_threshold_certificates`)."
    if not Path(path).exists(): raise ValueError(f"`path` must be a certificate file, got {path}")
    return json.loads(Path(path).read_text())


# %%
#| export
def diagonality_threshold(gamma:float,  # discount factor in [0, 1)
                          alpha:float,  # step size in (0, 1]
                          n_states:int, # number of states s >= 2
                          certificates=None, # records of `load_threshold_certificates` (default: the book's file, if present)
                         )->float:      # the certified lower bound on m*(gamma, alpha, s)
    "The book's certified value of $m^*$: the best of the circulant bound and the stored search certificates (Proposition 5.7, item 2, for smaller s and alpha)."
    m = circulant_threshold(gamma, alpha, n_states)["m"]
    if certificates is None and not THRESHOLD_FILE.exists():
        warnings.warn(f"no certificate file at {THRESHOLD_FILE} (an installed package has no nbs/data/): returning the circulant bound alone, "
                      "which can be lower than the book's certified value; pass `certificates=` to use a saved file")
    if certificates is None: certificates = load_threshold_certificates()["records"] if THRESHOLD_FILE.exists() else []
    for r in certificates:
        if r["gamma"] == gamma and r["alpha"] <= alpha and r["n_states"] <= n_states and r["m"] > m:
            check_certificate(r)
            m = r["m"]
    return m


# %%
#| code-fold: true
#| code-summary: "Code of the check"
certs = load_threshold_certificates("data/convergence_threshold.json")
records = certs["records"]
display(
    Markdown(
        provenance_note(
            certs,
            "The certificates",
            "Which chains the search found depends on its random starts and on rounding, but each"
            " certificate is re-checked exactly below, so what it certifies holds on every"
            " machine.",
        )
    )
)
rhos_c = [check_certificate(r) for r in records]  # exact re-check of every certificate
test_fail(
    lambda: check_certificate(dict(records[-1], m=0.99)), contains="invalid certificate"
)  # a false minimum diagonal is caught
M0, P0 = (
    torch.tensor(records[-1][k], dtype=torch.float64) for k in ("M", "P")
)  # a certificate is softmax attention:
d0 = MRP(
    P0.numpy(), np.zeros(len(P0)), 0.9, np.eye(len(P0))
).d_pi  # one-hot features, W[y, x] = log(M[x, y] / d(y))
test_close(
    kernel_attention(torch.eye(len(P0), dtype=torch.float64), (M0.log() - d0.log()[None, :]).T, d0),
    M0,
    eps=1e-12,
)
thr = {
    (r["gamma"], r["alpha"], r["n_states"]): diagonality_threshold(
        r["gamma"], r["alpha"], r["n_states"], records
    )
    for r in records
}
gammas_t, alphas_t, sizes_t = (
    sorted({k[0] for k in thr}),
    sorted({k[1] for k in thr}),
    sorted({k[2] for k in thr}),
)
for g in gammas_t:
    for a in alphas_t:
        row = [thr[g, a, s] for s in sizes_t]
        assert row == sorted(row) and row[0] == 0.5 and row[-1] < (1 + g) / 2  # items 2, 3, 5
        assert all(thr[g, a, s] >= thr[g, a2, s] for a2 in alphas_t if a2 < a for s in sizes_t)
record_claim(
    "threshold-above-half",
    "Self-attention dominating ($\\min_x M(x, x) > 1/2$) is not enough beyond two states: explicit"
    " positive pairs with larger diagonals diverge, certified exactly.",
    "proved",
    "worst_cases",
    "#the-true-threshold-a-search-for-worst-cases",
)
gain = {k: thr[k] - circulant_threshold(*k)["m"] for k in thr}
limits = {(g, a): circulant_limit(g, a) for g in gammas_t for a in alphas_t}
first_above = {
    (g, a): min((s for s in sizes_t if thr[g, a, s] > 0.5 + 1e-9), default=None)
    for g in gammas_t
    for a in alphas_t
}
Markdown(
    f"Certificates: {len(records)} pairs, spectral radii in [{min(rhos_c):.9f}, {max(rhos_c):.9f}]"
    f" (each at least one with a margin of $10^{{-9}}$, in float64); made by `{certs['command']}`"
    f" at commit `{certs['commit'][:10]}` on"
    f" {certs['date'][:10]} ({certs['settings']['n_starts']} random starts per search). The search"
    f" beat the circulant bound at {sum(v > 1e-6 for v in gain.values())} of {len(gain)} grid"
    f" points, by at most {max(gain.values()):.4f}. At $\\gamma = 0.9$, $\\alpha = 1$: a pair in"
    f" which every state keeps at least {thr[0.9, 1., 8]:.3f} of its attention for itself can still"
    " diverge. The smallest number of states with a certified value above $1/2$: "
    + "; ".join(
        f"$\\gamma = {g}$: "
        + ", ".join(
            (
                f"$s = {first_above[g, a]}$ at $\\alpha = {a}$"
                if first_above[g, a]
                else f"none up to $s = {sizes_t[-1]}$ at $\\alpha = {a}$"
            )
            for a in alphas_t
        )
        for g in gammas_t
    )
    + ".\n\n"
    + "\n\n".join(
        f"**$\\gamma = {g}$**\n\n| $s$ | "
        + " | ".join(f"$\\alpha = {a}$" for a in alphas_t)
        + " |\n|---|"
        + "---|" * len(alphas_t)
        + "\n"
        + "\n".join(
            f"| {s} | " + " | ".join(f"{thr[g, a, s]:.4f}" for a in alphas_t) + " |"
            for s in sizes_t
        )
        + "\n| $m_\\infty$ (circulant) | "
        + " | ".join(f"{limits[g, a]:.4f}" for a in alphas_t)
        + " |"
        + "\n| $(1 + \\gamma)/2$ | "
        + " | ".join(f"{(1 + g) / 2:.3f}" for a in alphas_t)
        + " |"
        for g in gammas_t
    )
)


# %% [markdown]
# The table gives certified lower bounds on $m^*(\gamma, \alpha, s)$ (each entry: a positive pair with that minimum
# diagonal whose error matrix has spectral radius at least one; by Proposition 5.7 item 2, an entry also certifies every
# larger $s$ and $\alpha$). The certified values grow with $s$ and with $\alpha$ (asserted), they are $1/2$ at two states, and a
# few states more already make a minimum diagonal above $1/2$ not enough (the smallest such $s$ per $\gamma$ and $\alpha$ is
# listed above the table). Whether the search found the *true* $m^*$ is not known: the
# entries are lower bounds, measured by a search over random and circulant starts; the upper bound is $(1 + \gamma)/2$.
# Figures 5b.2 ($\gamma = 0.9$) and 5b.3 ($\gamma = 0.5$ and $0.99$) set them beside the two candidate conditions:

# %%
#| fig-cap: "Figure 5b.2: at gamma = 0.9 the certified diagonality threshold grows with the number of states and the step size, far above one half, and stays below (1 + gamma)/2."
#| fig-alt: "The certified threshold against the number of states for three step sizes at discount 0.9, with horizontal lines for (1 + gamma)/2, one half, the small-step closed form and, dotted, the circulant limits."
def plot_threshold(ax, g, title, legend=False):
    "Certified m* against s at discount g, one line per step size, with the reference levels."
    for i, a in enumerate(alphas_t):
        ax.plot(sizes_t, [thr[g, a, s] for s in sizes_t], "o-", color=f"C{i}",
                label=rf"certified $m^*$, $\alpha = {a}$")
        ax.axhline(limits[g, a], color=f"C{i}", ls=":", lw=1)
    ax.axhline((1 + g) / 2, color="k", ls="--", label=r"Proposition 5.1: $(1 + \gamma)/2$")
    ax.axhline(0.5, color="grey", lw=1, label=r"$1/2$ (self-attention dominates)")
    ax.axhline(1 / (1 + math.sqrt(1 - g**2)), color="C3", ls="-.", lw=1,
               label=r"$1/(1 + \sqrt{1 - \gamma^2})$, any $\alpha$, $s \to \infty$")
    ax.set(title=title, xlabel="number of states $s$", ylim=(0.45, 1.01))
    if legend: ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)


fig, ax = plt.subplots(figsize=(6.0, 3.8))
plot_threshold(ax, 0.9, r"$\gamma = 0.9$ (dotted: circulant limit $m_\infty$)", legend=True)
ax.set_ylabel(r"min$_x M(x, x)$ below which" "\n" "some pair diverges")
fig.tight_layout()

# %%
#| fig-cap: "Figure 5b.3: the same at gamma = 0.5 and 0.99: the threshold rises towards 1 as gamma does, and at gamma = 0.99 and alpha = 1 it is already close to (1 + gamma)/2."
#| fig-alt: "Two panels, discount 0.5 and 0.99, of the certified threshold against the number of states for three step sizes, with the same reference lines as Figure 5b.2."
others = [g for g in gammas_t if g != 0.9]
fig, axes = plt.subplots(1, len(others), figsize=(6.0, 3.4), sharey=True)
for ax, g in zip(axes, others): plot_threshold(ax, g, rf"$\gamma = {g}$")
axes[0].set_ylabel(r"min$_x M(x, x)$ below which" "\n" "some pair diverges")
fig.tight_layout()

# %% [markdown]
# The entries are far above $1/2$ (at $\gamma = 0.9$, $\alpha = 1$, see the sentence above the table). As $\gamma \to 1$ the thresholds approach 1
# (the dash-dotted closed form, for any $\alpha$ as $s \to \infty$, tends to 1 like $1 - \sqrt{2(1 - \gamma)}$; at $\alpha = 1$ the certified
# values at $\gamma = 0.99$ are already close to $(1 + \gamma)/2$), so no condition on the diagonal alone can stay near $1/2$; and the circulant
# limits (dotted) stay below $(1 + \gamma)/2$, so Proposition 5.1's constant may or may not be the truth for large $s$:
# that is open.
#
# **What to check instead.** The exact criterion is $\operatorname{spr}(B) < 1$, checkable for any given $M_\pi$ and $P$
# (`spectral_radius`); Proposition 5.2's span conditions $\operatorname{sc}(B^k) < 1$ are checkable sufficient conditions between the
# diagonal one and the exact one; all of them use $P$. A condition on the diagonal of $M$ alone cannot be weaker than
# $\min_x M(x, x) > m^*(\gamma, \alpha, s)$, which by the table grows with $s$ and, by the closed form, tends to 1 as $\gamma \to 1$. A
# $d_\pi$-weighted $\ell_2$ argument, TD's classical one, gives another kind of condition: if $M D_\pi^{-1}$ is symmetric
# positive definite ($D_\pi = \operatorname{diag}(d_\pi)$), then $M (I - \gamma P) = (M D_\pi^{-1})(D_\pi (I - \gamma P))$ is a
# positive definite matrix times one whose symmetric part is positive definite ($x^\top D_\pi P x \le \|x\|_{D_\pi}\|Px\|_{D_\pi}
# \le \|x\|^2_{D_\pi}$), so all its eigenvalues have positive real part and every small enough step $\alpha$ converges, for
# every $P$ and every $\gamma < 1$ (the margin, $(1 - \gamma)$ times the smallest eigenvalue, vanishes as $\gamma \to 1$). Population
# softmax attention has this form, $M_\pi D_\pi^{-1} = \mathcal Z^{-1} \mathcal H$, only when the normaliser $\mathcal Z(x) = \sum_z d_\pi(z)h(z, x)$ is the same
# for every state; we have not turned this into a condition for the general case.

# %% [markdown]
# ## Implementation and tests
#
# The functions that run the page's experiments and searches, then the check that bad input to the search gets a
# `ValueError` that names the argument.

# %%
#| hide
# documented in the folded blocks below; named here, nbdev adds no entry after each definition
show_doc(slow_mixing_experiment)
show_doc(plot_slow_mixing)
show_doc(worst_case_pair)
show_doc(threshold_search)
show_doc(save_threshold_certificates)
show_doc(check_certificate)
show_doc(load_threshold_certificates)
show_doc(diagonality_threshold)

# %%
#| echo: false
folded_docs(slow_mixing_experiment, plot_slow_mixing, worst_case_pair, threshold_search,
            save_threshold_certificates, check_certificate, load_threshold_certificates,
            diagonality_threshold,
            summary="Signatures of the 8 functions")

# %% [markdown]
# ### Bad input

# %%
#| code-fold: true
#| code-summary: "Code of the check"
bad_input = [
    ("`m` must lie in [0, 1)", lambda: worst_case_pair(1.2, 0.9, 1., 3)),
    ("`n_states` must be an integer of at least 2",
     lambda: threshold_search(gamma=0.9, alpha=1., n_states=1)),
    ("`alpha` must lie in (0, 1]", lambda: worst_case_pair(0.6, 0.9, 0., 3)),
    ("`path` must be a certificate file",
     lambda: load_threshold_certificates("data/no_such_file.json")),
    ("`record` must be a dict", lambda: check_certificate("abc")),
    ("`record` must have the keys", lambda: check_certificate({"M": [[1.]], "P": [[1.]]})),
]
for msg, f in bad_input:
    test_fail(f, contains=msg)

# %%
#| export
from ictd.boyan import check_arguments
check_arguments(globals())   # every public function refuses, naming it, an argument its annotation rules out (chapter 0)
