# %%
#| default_exp boyan

# %%
#| export
from __future__ import annotations
from dataclasses import InitVar, dataclass, field
import numpy as np
import torch

# %%
#| hide
#| export
import functools, inspect, warnings

def moved_to_keywords(*names:str):
    "Decorator: the keyword-only `names` (in their old positional order) may still be passed by position for one release, with a `DeprecationWarning` naming the new form."
    def wrap(fn):
        params = inspect.signature(fn).parameters.values()
        n_pos = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if len(args) > n_pos:
                extra = args[n_pos:]
                if len(extra) > len(names): raise TypeError(f"{fn.__name__}() takes {n_pos} positional arguments and the keywords {names}, got {len(args)} positional")
                moved = dict(zip(names, extra))
                if set(moved) & set(kwargs): raise TypeError(f"{fn.__name__}() got {sorted(set(moved) & set(kwargs))} both by position and by keyword")
                _warn_moved(fn, moved)
                args, kwargs = args[:n_pos], {**kwargs, **moved}
            return call.__wrapped__(*args, **kwargs)
        call.moves_positionals = True   # `ictd.boyan.checked` checks the arguments it passes on
        return call
    return wrap

def _warn_moved(fn, moved:dict, order:list=None):
    new = f"pass {', '.join(f'{k}=...' for k in moved)} by keyword" if moved else f"the positional order is now ({', '.join(order)})"
    warnings.warn(f"{fn.__name__}: {new}; the old form is deprecated and goes in the next release",
                  DeprecationWarning, stacklevel=3)

def reordered_positionals(old:tuple,  # every parameter's name in the old positional order (with `self`/`cls` first if any)
                         is_old,      # is_old(args) -> True when a call's positional `args` are in the old order
                        ):
    "Decorator: a call whose positional arguments `is_old` says are in the `old` order is mapped onto the names, for one release, with a `DeprecationWarning` naming the new form."
    if not isinstance(old, tuple) or not all(isinstance(k, str) for k in old): raise TypeError(f"`old` must be a tuple of parameter names, got {old!r}")
    if not callable(is_old): raise TypeError(f"`is_old` must be callable, got {type(is_old).__name__}")
    def wrap(fn):
        params = inspect.signature(fn).parameters.values()
        n_pos = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if not is_old(args): return call.__wrapped__(*args, **kwargs)
            if len(args) > len(old): raise TypeError(f"{fn.__name__}() takes at most {len(old)} positional arguments in its old form, got {len(args)}")
            named = dict(zip(old, args))
            if set(named) & set(kwargs): raise TypeError(f"{fn.__name__}() got {sorted(set(named) & set(kwargs))} both by position and by keyword")
            keep = [p.name for p in params][:n_pos]
            _warn_moved(fn, {k: v for k, v in named.items() if k not in keep}, [k for k in keep if k not in ("self", "cls")])
            args = [named.pop(k) for k in keep if k in named]
            return call.__wrapped__(*args, **named, **kwargs)
        call.moves_positionals = True
        return call
    return wrap


# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *
from fractions import Fraction

# %%
#| hide
import matplotlib.pyplot as plt

# %%
from IPython.display import Markdown

# %%
from ictd.core import record_claim

# %%
#| hide
from ictd.boyan import (
    FEATURES,
    REWARDS,
    _positive_strides,
    _stationary,
    as_tensor,
    boyan_transitions,
    chain_from_uniforms,
    check_gamma,
    transitions_from_uniforms,
    weighted_error,
)


# %% [markdown]
# # The Boyan chain
# > Markov reward processes, the random Boyan chain that serves as the book's testbed, trajectories, stationary distributions and true values.

# %% [markdown]
# ::: {.callout-tip title="What this page shows"}
# - A Markov reward process (MRP), its true values $v_\pi$ and its stationary distribution $d_\pi$: the ground truth
#   every later chapter scores against.
# - The book's testbed, the random Boyan chain, drawn and solved by hand on three states in exact fractions.
# - Trajectories, the ergodic theorem at work, and one seed giving one chain under every feature kind.
# - The score of every estimate: the mean squared value error (MSVE).
# - The library's code is folded where a function is introduced; helpers, input checks and tests are in
#   [Implementation and tests](#implementation-and-tests). Symbols: [Notation](notation.html).
# :::

# %% [markdown]
# Everything in this book is *policy evaluation*: a fixed policy has turned a Markov decision
# process into a **Markov reward process** (MRP), and we want its value function from data. An MRP
# on states $0, \dots, s-1$ is a row-stochastic transition matrix $P$, a reward vector $r$ (the
# reward $R_{t+1} = r(S_t)$ is paid on leaving $S_t$) and a discount $\gamma \in [0, 1)$. Its
# **value function** is the expected discounted return,
#
# $$v_\pi(x) = \mathbb{E}\Big[\sum_{t \ge 0} \gamma^t R_{t+1} \,\Big|\, S_0 = x\Big],
# \qquad v_\pi = r + \gamma P v_\pi = (I - \gamma P)^{-1} r ,$$
#
# the second identity being the **Bellman equation**. A long trajectory of an irreducible,
# aperiodic chain spends a fraction $d_\pi(x)$ of its time in state $x$, where the **stationary
# distribution** solves $d_\pi^\top P = d_\pi^\top$, $\sum_x d_\pi(x) = 1$. Value errors are
# measured where the data comes from: the **mean squared value error**
# $\mathrm{MSVE}(\hat v) = \sum_x d_\pi(x) (\hat v(x) - v_\pi(x))^2$.
#
# The learning algorithms of the later chapters never see $P$ or $r$: they see features
# $\phi(x) \in \mathbb{R}^d$ of the states (the rows of an $s \times d$ matrix $\Phi$) and a
# trajectory. The MRP object below bundles the ground truth that we score them against.

# %% [markdown]
# ## Markov reward processes
#
# `MRP` validates its inputs once and then computes the two quantities every later chapter scores
# against: the stationary distribution $d_\pi$ and the true values $v_\pi$. Every function of the
# library accepts numpy arrays or torch tensors and rejects bad input with a `ValueError` that names
# the argument ([Implementation and tests](#checking-inputs)).

# %%
#| code-fold: true
#| code-summary: "MRP"
#| export
@dataclass(eq=False)
class MRP:
    "A validated Markov reward process with features; `d_pi` and `v_pi` are computed on creation."

    P: torch.Tensor  # (s, s) row-stochastic transition matrix
    r: torch.Tensor  # (s,) expected reward on leaving each state
    gamma: float  # discount factor in [0, 1)
    phi: torch.Tensor  # (s, d) state features, one row per state
    d_pi: torch.Tensor = field(init=False)  # (s,) stationary distribution
    v_pi: torch.Tensor = field(init=False)  # (s,) true values (I - gamma P)^{-1} r
    device: InitVar = (
        None  # keyword: the device of every tensor; default that of `P` (the CPU for numpy input)
    )
    dtype: InitVar = (
        # keyword: the floating dtype of every tensor; default float64 (the checks and solves run in
        # float64 first)
        None
    )

    def __post_init__(self, device, dtype):
        self.P, self.r = as_tensor(self.P, "P", torch.float64), as_tensor(
            self.r, "r", torch.float64
        )
        self.phi, self.gamma = as_tensor(self.phi, "phi", torch.float64), check_gamma(self.gamma)
        s = self.P.shape[0] if self.P.ndim == 2 else -1
        if self.P.ndim != 2 or self.P.shape != (s, s) or s < 1:
            raise ValueError(f"`P` must be a square (s, s) matrix, got shape {tuple(self.P.shape)}")
        if (self.P < 0).any():
            raise ValueError("`P` has negative entries")
        if not torch.allclose(self.P.sum(1), torch.ones(s, dtype=torch.float64), atol=1e-10):
            raise ValueError("`P` is not row-stochastic: every row must sum to 1")
        if self.r.shape != (s,):
            raise ValueError(f"`r` must have shape ({s},) to match `P`, got {tuple(self.r.shape)}")
        if self.phi.ndim != 2 or self.phi.shape[0] != s:
            raise ValueError(
                f"`phi` must have shape ({s}, d) to match `P`, got {tuple(self.phi.shape)}"
            )
        self.d_pi = torch.from_numpy(_stationary(self.P.cpu().numpy())).to(self.P.device)
        I = torch.eye(s, dtype=torch.float64, device=self.P.device)
        self.v_pi = torch.linalg.solve(I - self.gamma * self.P, self.r)
        if device is not None or dtype is not None:
            self._move(device, dtype)

    def _move(self, device, dtype):
        for k in ("P", "r", "phi", "d_pi", "v_pi"):
            setattr(self, k, getattr(self, k).to(device=device, dtype=dtype))

    def to(self, device=None, dtype=None) -> MRP:
        (
            "A copy of the process with every tensor on `device` and in the floating `dtype` (None:"
            " unchanged)."
        )
        out = MRP.__new__(MRP)
        out.__dict__.update(self.__dict__)
        out._move(device, dtype)
        return out

    @property
    def n_states(self) -> int:
        return self.P.shape[0]

    @property
    def d(self) -> int:
        return self.phi.shape[1]

    def __repr__(self):
        return f"MRP(n_states={self.n_states}, d={self.d}, gamma={self.gamma})"


# %%
show_doc(MRP)


# %% [markdown]
# ## The random Boyan chain
#
# Boyan's chain (Boyan, 2002) is the standard small testbed for TD methods: a line of states in
# which each state jumps one or two steps to the right, so that value propagates backwards along the
# chain over many steps, which is what makes TD's bootstrapping visible. The work on in-context TD
# with *linear* attention (Wang et al., ICLR 2025) made it a *random* task family, and this book
# follows the conventions of their public code:
#
# * for $i = 0, \dots, s-3$: $p_i \sim U(0.01, 0.99)$, $P[i, i+1] = p_i$, $P[i, i+2] = 1 - p_i$;
# * $P[s-2, s-1] = 1$;
# * the last row is drawn i.i.d. $U(0.01, 0.99)$ over all states and normalised, so the last state
#   can reach every state: the chain is irreducible and aperiodic;
# * rewards $r(x) \sim U(-1, 1)$ i.i.d., or *representable*: $w \sim N(0, I_d)$, $v = \Phi w$,
#   $r = (I - \gamma P) v$, so that the true value lies in the span of the features;
# * features $\Phi_{xj} \sim U(-1, 1)$ redrawn per task, or one-hot ($\Phi = I$, the tabular case),
#   or "unit": random rows rescaled to norm 1.
#
# Every draw is a new *task*. An in-context learner is shown a trajectory of a task it has never
# seen and must estimate that task's values. Helpers turn the uniforms of a random generator into a
# chain; they, and the order in which they read the uniforms, are in
# [Implementation and tests](#drawing-a-chain-from-uniforms).

# %%
#| code-fold: true
#| code-summary: "random_boyan_chain"
#| export
@moved_to_keywords("gamma", "features", "rewards", "seed")
def random_boyan_chain(
    n_states: int = 10,  # number of states s >= 2
    d: int = 4,  # feature dimension (one-hot chains read the s x d block too: same P, r)
    *,
    gamma: float = 0.9,  # discount factor in [0, 1)
    features: str = "random",  # "random" (U(-1, 1)), "onehot" or "unit" (random rows of norm 1)
    rewards: str = "random",  # "random" (U(-1, 1)) or "representable" (v_pi in the span of phi)
    seed=None,  # int or `numpy.random.Generator`
) -> MRP:
    (
        "Draw a random Boyan chain task (the conventions of Wang et al. 2025's public code, listed "
        "above)."
    )
    from ictd.core import (
        check_choice,
        check_int,
    )  # the shared checks (imported when called, as in `check_gamma`)

    s, d = check_int(n_states, "n_states", 2), check_int(d, "d", 1, "a positive integer")
    check_choice(features, FEATURES, "features"), check_choice(rewards, REWARDS, "rewards")
    if not isinstance(seed, (np.random.Generator, np.random.SeedSequence)) and seed is not None:
        seed = check_int(seed, "seed")
    gamma, rng = check_gamma(gamma), np.random.default_rng(seed)
    P, phi = chain_from_uniforms(rng.random(2 * s - 2 + s * d), s, d, features)
    if rewards == "random":
        r = rng.uniform(-1, 1, size=s)
    else:
        r = (np.eye(s) - gamma * P) @ (phi @ rng.standard_normal(phi.shape[1]))
    return MRP(P, r, gamma, phi)


# %%
show_doc(random_boyan_chain)

# %% [markdown]
# Here is one chain, drawn with seed 0: 10 states, $d = 4$ random features, $\gamma = 0.9$.

# %%
mrp = random_boyan_chain(seed=0)
mrp


# %% [markdown]
# Arrows above the line are the single steps $i \to i+1$, arrows below the
# double steps $i \to i+2$, each labelled with its probability; the last state's row, which sends
# it anywhere, is the bottom row of the transition matrix below.

# %%
#| code-fold: true
#| code-summary: "plot_chain"
#| export
def plot_chain(mrp: MRP, ax=None):  # the chain to draw  # matplotlib axes; default: a new figure
    (
        "Draw a Boyan chain: states on a line, +1 jumps above and +2 jumps below, labelled with "
        "probabilities."
    )
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 2.6))
    P, s = mrp.P.cpu().numpy(), mrp.n_states
    for i in range(s):
        ax.add_patch(plt.Circle((i, 0), 0.28, fc="white", ec="k", zorder=3))
        ax.text(i, 0, str(i), ha="center", va="center", zorder=4)
    for i in range(s - 1):
        for j, rad, dy in ((i + 1, -0.8, 0.62), (i + 2, 0.45, -0.66)):
            if j >= s or P[i, j] == 0:
                continue
            ax.add_patch(
                FancyArrowPatch(
                    (i + 0.2, 0.2 * np.sign(dy)),
                    (j - 0.2, 0.2 * np.sign(dy)),
                    connectionstyle=f"arc3,rad={rad}",
                    arrowstyle="-|>",
                    mutation_scale=12,
                    color="C0" if j == i + 1 else "C1",
                )
            )
            ax.text(
                (i + j) / 2,
                dy,
                f"{P[i, j]:.2f}",
                ha="center",
                va="center",
                fontsize=9,
                color="C0" if j == i + 1 else "C1",
            )
    ax.plot([], [], color="C0", label="step +1")
    ax.plot([], [], color="C1", label="step +2")
    ax.set(
        xlim=(-0.6, s - 0.4),
        ylim=(-1.0, 0.95),
        aspect="equal",
        title="Transitions of one random Boyan chain",
    )
    ax.axis("off")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, 0.04), fontsize=9, ncol=2, frameon=False)
    return ax


# %%
#| fig-cap: "Figure 0.1: From each state a Boyan chain steps one or two states forward, each step with its own probability."
#| fig-alt: "Ten numbered circles, states 0 to 9, in a row. Blue arrows above join each state to the next, orange arrows below join it to the state two ahead, each labelled with its probability; a state's two probabilities sum to 1, and state 8 steps to 9 with probability 1.00. State 9 has no arrows drawn."
ax = plot_chain(mrp, plt.subplots(figsize=(6.5, 2.2))[1])
test_fig_exists(ax)

# %%
#| fig-cap: "Figure 0.2: The transition matrix of the same chain is zero except on the one or two places right of the diagonal, apart from the last state's row, which spreads over the chain."
#| fig-alt: "Heat map of the 10 by 10 transition matrix P, state x on the rows and next state y on the columns, colour from 0 (white) to 1 (dark blue). Rows 0 to 8 have weight only one and two columns right of the diagonal; row 9 has small weights across most columns."
fig, ax = plt.subplots(figsize=(5, 4))
im = ax.imshow(mrp.P.numpy(), cmap="Blues", vmin=0, vmax=1)
ax.set(
    title="Transition matrix $P$ of the same chain",
    xlabel="next state $y$",
    ylabel="state $x$",
    xticks=range(10),
    yticks=range(10),
)
fig.colorbar(im, ax=ax, label="$P(x, y)$");

# %% [markdown]
# The check: every row of $P$ sums to one; row $i \le s - 3$ has exactly the two entries $i + 1$ and
# $i + 2$, with $P[i, i+1] \in [0.01, 0.99]$; row $s - 2$ steps to $s - 1$ surely; and the last row
# reaches every state.

# %%
#| code-fold: true
#| code-summary: "Code of the check"
P = mrp.P
test_close(P.sum(1), torch.ones(10), eps=1e-12)
for i in range(8):
    test_eq(set(torch.nonzero(P[i]).flatten().tolist()), {i + 1, i + 2})
    test_close(P[i, i + 1] + P[i, i + 2], 1., eps=1e-12)
    assert 0.01 <= P[i, i + 1] <= 0.99
test_eq(P[8].tolist(), [0.] * 9 + [1.])
assert (P[9] > 0).all()
test_eq((mrp.phi.shape, mrp.gamma), ((10, 4), 0.9))


# %% [markdown]
# ## The stationary distribution and the true values, by hand
#
# Both quantities solve linear equations, and on a small Boyan chain the equations can be solved by
# hand. Take $s = 3$ states. State 0 steps to state 1 with probability $p = P(0, 1)$ and to state 2
# otherwise; state $1 = s - 2$ steps to state 2 surely; the last state, 2, returns anywhere, with
# probabilities $P(2, 0), P(2, 1), P(2, 2)$.
#
# *Stationary distribution.* The balance equations $d_\pi(y) = \sum_x d_\pi(x) P(x, y)$ read
# $d_\pi(0) = P(2, 0)\, d_\pi(2)$ (only state 2 enters state 0) and
# $d_\pi(1) = p\, d_\pi(0) + P(2, 1)\, d_\pi(2)$, so every probability is a multiple of $d_\pi(2)$, and
# normalising gives
#
# $$d_\pi = \frac{\big(P(2, 0),\ p\,P(2, 0) + P(2, 1),\ 1\big)}{1 + P(2, 0) + p\,P(2, 0) + P(2, 1)} .$$
#
# *True values.* The Bellman equation $v_\pi = r + \gamma P v_\pi$ is triangular apart from the last
# row: $v_\pi(1) = r(1) + \gamma v_\pi(2)$ and
# $v_\pi(0) = r(0) + \gamma p\, v_\pi(1) + \gamma (1 - p)\, v_\pi(2)$ express the first two values through
# $v_\pi(2)$, and substituting them into the last row,
# $v_\pi(2) = r(2) + \gamma \big(P(2, 0) v_\pi(0) + P(2, 1) v_\pi(1) + P(2, 2) v_\pi(2)\big)$, leaves one
# linear equation for $v_\pi(2)$. The cell below does this substitution in exact fractions for one
# choice of numbers (printed) and compares the result with `MRP`, which solves the same equations
# numerically in float64.

# %%
#| code-fold: true
#| code-summary: "Code of the check"
def by_hand(p, row2, r, gamma):
    "d_pi and v_pi of the three-state Boyan chain, by the substitutions above, in exact fractions."
    a, b, c = row2
    d = [a, p * a + b, Fraction(1)]
    d = [x / sum(d) for x in d]
    v0_const, v0_coef = r[0] + gamma * p * r[1], gamma * (
        gamma * p + 1 - p
    )  # v(0) = v0_const + v0_coef v(2)
    v2 = (r[2] + gamma * a * v0_const + gamma * b * r[1]) / (
        1 - gamma * a * v0_coef - gamma**2 * b - gamma * c
    )
    return d, [v0_const + v0_coef * v2, r[1] + gamma * v2, v2]


p, row2, r3, gamma3 = (
    Fraction(1, 2),
    (Fraction(1, 2), Fraction(1, 4), Fraction(1, 4)),
    (Fraction(1), Fraction(0), Fraction(-1)),
    Fraction(1, 2),
)
d3, v3 = by_hand(p, row2, r3, gamma3)
small = MRP(
    P=[[0, float(p), float(1 - p)], [0, 0, 1], [float(x) for x in row2]],
    r=[float(x) for x in r3],
    gamma=float(gamma3),
    phi=np.eye(3),
)
test_close(small.d_pi, torch.tensor([float(x) for x in d3], dtype=torch.float64), eps=1e-15)
test_close(small.v_pi, torch.tensor([float(x) for x in v3], dtype=torch.float64), eps=1e-14)
frac = lambda xs: ", ".join(
    f"{x.numerator}/{x.denominator}" if x.denominator > 1 else f"{x.numerator}" for x in xs
)
Markdown(
    f"With $p = {frac([p])}$, last row $({frac(row2)})$, rewards $r = ({frac(r3)})$ and $\\gamma ="
    f" {frac([gamma3])}$: $d_\\pi = ({frac(d3)})$ and $v_\\pi = ({frac(v3)})$. `MRP` finds the same"
    " numbers in float64, to $10^{-14}$."
)

# %% [markdown]
# The same two equations hold on every chain. The check runs on 50 random chains of 3 to 14 states,
# every feature and reward kind: the Bellman equation holds for `v_pi` to $10^{-12}$, and `d_pi` is a
# stationary probability distribution with every state visited.

# %%
#| code-fold: true
for seed in range(50):
    m = random_boyan_chain(
        n_states=3 + seed % 12, features=FEATURES[seed % 3], rewards=REWARDS[seed % 2], seed=seed
    )
    test_close(m.r + m.gamma * m.P @ m.v_pi, m.v_pi, eps=1e-12)
    test_close(m.d_pi @ m.P, m.d_pi, eps=1e-12)
    test_close(m.d_pi.sum(), 1.0, eps=1e-12)
    assert (m.d_pi > 0).all()

# %%
#| fig-cap: "Figure 0.3: The true value is a discounted look-ahead smoothing of the rewards: a state with a positive reward can still have a negative value when the states after it pay badly."
#| fig-alt: "Paired bars for states 0 to 9: rewards r(x) in blue, of both signs, and true values v_pi(x) in orange, all negative, largest in magnitude at states 0 and 1 and smallest at states 7 and 9, with gamma = 0.9."
fig, ax = plt.subplots(figsize=(6.5, 3.2))
x = np.arange(mrp.n_states)
ax.bar(x - 0.2, mrp.r.numpy(), width=0.4, label="reward $r(x)$")
ax.bar(x + 0.2, mrp.v_pi.numpy(), width=0.4, label=r"true value $v_\pi(x)$")
ax.axhline(0, color="k", lw=0.6)
ax.set(
    xlabel="state $x$",
    ylabel="reward / value (return units)",
    xticks=x,
    title=rf"Rewards and true values of the chain above ($\gamma = {mrp.gamma}$)",
)
ax.legend();


# %% [markdown]
# The value is a discounted, look-ahead smoothing of the rewards: what a state is worth depends on
# the rewards of the states it leads to, so its value can have the opposite sign to its own reward.

# %% [markdown]
# ## Trajectories
#
# In-context learners see one trajectory $S_0, R_1, S_1, \dots, R_n, S_n$: $n$ transitions, the
# $k$-th being $(S_{k-1}, R_k, S_k)$ with $R_k = r(S_{k-1})$. Unless said otherwise $S_0 \sim d_\pi$,
# so the whole trajectory is stationary. Sampling uses inverse-CDF draws from one batch of uniforms.

# %%
#| code-fold: true
#| code-summary: "sample_trajectory"
#| export
@moved_to_keywords("n", "seed", "start")
def sample_trajectory(
    mrp: MRP,  # the process to sample
    *,
    n: int,  # number of transitions
    seed=None,  # int or `numpy.random.Generator`
    start="stationary",  # "stationary" (S_0 ~ d_pi), "uniform", or a state index
) -> tuple:  # (states (n+1,) long tensor S_0..S_n, rewards (n,) float64 tensor, rewards[k-1] = R_k)
    "Sample a trajectory of `n` transitions from `mrp`."
    if int(n) != n or n < 0:
        raise ValueError(f"`n` must be a non-negative integer, got {n}")
    rng, s = np.random.default_rng(seed), mrp.n_states
    if isinstance(start, str) and start not in ("stationary", "uniform"):
        raise ValueError(f"`start` must be 'stationary', 'uniform' or a state index, got {start!r}")
    if start == "stationary":
        s0 = rng.choice(s, p=mrp.d_pi.cpu().numpy())
    elif start == "uniform":
        s0 = rng.integers(s)
    elif int(start) != start or not 0 <= start < s:
        raise ValueError(f"`start` must be a state in 0..{s - 1}, got {start}")
    else:
        s0 = int(start)
    cum, u = np.cumsum(mrp.P.cpu().numpy(), axis=1), rng.random(int(n))
    states = np.empty(int(n) + 1, dtype=np.int64)
    states[0] = s0
    for t in range(int(n)):
        states[t + 1] = min(np.searchsorted(cum[states[t]], u[t], side="right"), s - 1)
    states = torch.from_numpy(states)
    return states, mrp.r.cpu()[states[:-1]]


# %%
show_doc(sample_trajectory)

# %%
states, rewards = sample_trajectory(mrp, n=20, seed=0)
for a, b in zip(states[:-1].tolist(), states[1:].tolist()): assert mrp.P[a, b] > 0, (a, b)
print("S_0, ..., S_20: " + " → ".join(str(x) for x in states.tolist()))

# %% [markdown]
# The **ergodic theorem** says that the fraction of time a long trajectory spends in each state
# converges to $d_\pi$. With $10^5$ steps every visit frequency is within $0.01$ of the stationary
# probability (the standard error is of order $\sqrt{d_\pi(x)/n} \approx 10^{-3}$, inflated by the
# chain's correlation time):

# %%
#| code-fold: true
long_states, _ = sample_trajectory(mrp, n=100_000, seed=1)
freq = torch.bincount(long_states, minlength=mrp.n_states).double() / len(long_states)
test_close(freq, mrp.d_pi, eps=0.01)
print(f"largest |frequency - d_pi(x)| over the states: {(freq - mrp.d_pi).abs().max().item():.2e}")

# %%
#| fig-cap: 'Figure 0.4: Over $10^5$ steps the visit frequencies match the stationary distribution $d_\pi$ state by state.'
#| fig-alt: "Paired bars for states 0 to 9: the stationary probability d_pi(x) in blue and the visit frequency over 10^5 steps in orange, of equal height at every state, smallest at state 0 and largest at state 9."
fig, ax = plt.subplots(figsize=(6.5, 3.2))
ax.bar(x - 0.2, mrp.d_pi.numpy(), width=0.4, label=r"stationary $d_\pi(x)$")
ax.bar(x + 0.2, freq.numpy(), width=0.4, label="visit frequency, $10^5$ steps")
ax.set(
    xlabel="state $x$",
    ylabel="probability",
    xticks=x,
    title="Stationary distribution against visit frequencies",
)
ax.legend();

# %% [markdown]
# ## One seed, one chain under every feature kind
#
# A chain reads the uniforms of its generator in one fixed order, whatever its feature kind:
# the jump probabilities, the last row, an $s \times d$ **feature block**, and then its rewards
# (the details are in [Implementation and tests](#drawing-a-chain-from-uniforms)). Because every kind
# reads the feature block, the chains of one seed, number of states and $d$
# are **one Markov reward process** under every feature kind: the same $P$, $r$, $d_\pi$ and
# $v_\pi$, bit for bit, with only $\Phi$ differing (unit features are the random features
# rescaled, one-hot features are $I$). A side-by-side of feature kinds on the seeds of one range
# therefore compares the features on the same tasks. Two limits of the statement: $r$ follows the
# block of $s d$ uniforms, so changing $d$ keeps $P$ but redraws $r$ (a one-hot chain shares its
# rewards with the random-feature chains of the `d` it is given, default or not); and
# *representable* rewards are built from $\Phi$ ($v_\pi = \Phi w$), so across kinds they share
# $P$ only. The check runs over many seeds and sizes:

# %%
#| code-fold: true
#| code-summary: "Code of the check"
shared, sizes = [], [(2 + seed % 19, 1 + seed % 9) for seed in range(200)]
for seed, (s, d) in enumerate(sizes):
    chains = {f: random_boyan_chain(s, d, features=f, seed=seed) for f in FEATURES}
    ref = chains["random"]
    for m in chains.values():
        for k in ("P", "r", "d_pi", "v_pi"):
            test_eq(getattr(m, k), getattr(ref, k))
    test_eq(chains["onehot"].phi, torch.eye(s, dtype=torch.float64))
    test_eq(
        chains["unit"].phi.numpy(),
        ref.phi.numpy() / np.linalg.norm(ref.phi.numpy(), axis=1, keepdims=True),
    )
    other_d = random_boyan_chain(s, d + 1, seed=seed)
    test_eq(other_d.P, ref.P)
    shared.append(not torch.equal(other_d.r, ref.r))
rep = [random_boyan_chain(8, 3, features=f, rewards="representable", seed=1) for f in FEATURES]
for m in rep[1:]:
    test_eq(m.P, rep[0].P)
assert all(shared)
record_claim(
    "kinds-share-mrp",
    "The random, unit and one-hot chains of one seed (same number of states and `d`) have the same"
    " $P$, $r$, $d_\\pi$ and $v_\\pi$ bit for bit; only $\\Phi$ differs.",
    "proved",
    "boyan",
    "#one-seed-one-chain-under-every-feature-kind",
)
(s_lo, d_lo), (s_hi, d_hi) = np.min(sizes, 0), np.max(sizes, 0)
Markdown(
    f"On all {len(shared)} seeds (with $s$ from {s_lo} to {s_hi} and $d$ from {d_lo} to {d_hi}) the"
    f" {len(FEATURES)} feature kinds share $P$, $r$, $d_\\pi$ and $v_\\pi$ exactly, and changing"
    f" $d$ to $d + 1$ kept $P$ and redrew $r$ on all {sum(shared)} of them."
)


# %% [markdown]
# ## Value error
#
# Estimates are scored by the MSVE, the $d_\pi$-weighted squared error. The zero estimate scores
# $\sum_x d_\pi(x) v_\pi(x)^2$, the benchmark every learner must beat. (`msve` applies `weighted_error`, the book's one formula for
# a weighted squared error, also used with quadrature weights for continuous states.)

# %%
#| code-fold: true
#| code-summary: "msve"
#| export
def _task_first(args:tuple)->bool:
    "Is `msve(task, v_hat)` called in its old order (the task first)?"
    return len(args) == 2 and hasattr(args[0], "v_pi") and not hasattr(args[1], "v_pi")


@reordered_positionals(("task", "v_hat"), _task_first)
def msve(
    v_hat,  # (..., s) value estimates, one per state
    task,  # whose true values score them: an `MRP`, or B tasks (a `TaskBatch`, with `v_hat` of shape (B, s))
) -> torch.Tensor:  # (...) float64 tensor: the d_pi-weighted mean squared value error (0-dim for one estimate)
    "Mean squared value error $\\sum_x d_\\pi(x) (\\hat v(x) - v_\\pi(x))^2$."
    if not (hasattr(task, "v_pi") and hasattr(task, "d_pi")):
        raise TypeError(f"`task` must be an MRP or a TaskBatch, got {type(task).__name__}")
    v_hat = as_tensor(v_hat, "v_hat", torch.float64)
    s = task.v_pi.shape[-1]
    if v_hat.shape[-1:] != (s,):
        raise ValueError(f"`v_hat` must have last dimension {s}, got shape {tuple(v_hat.shape)}")
    return weighted_error(v_hat, task.v_pi.to(v_hat.device), task.d_pi.to(v_hat.device))


# %%
zero = msve(np.zeros(10), mrp)
test_close(zero, (mrp.d_pi * mrp.v_pi ** 2).sum().item(), eps=1e-15)
print(f"MSVE: zero estimate {zero:.3f}, true values {msve(mrp.v_pi, mrp):.1f}, "
      f"true values + 0.5 {msve(mrp.v_pi + 0.5, mrp):.2f}")

# %% [markdown]
# With the ground truth in place, [the next chapter](weighted_softmax_td.html) introduces the
# algorithm a softmax Transformer runs on such trajectories: weighted softmax TD.

# %% [markdown]
# ## Implementation and tests
#
# The lesson ends above. This section holds what a user of the library needs and what keeps the
# chapter honest: input validation, the order in which a chain reads its random numbers, and the
# exhaustive checks. Every cell runs when the book is built.

# %% [markdown]
# ### Keeping old calls working
#
# Two decorators, defined in this chapter's first cell because its own functions use them, keep a call in an old
# form working for one release, with a `DeprecationWarning` that names the new form (appendix A tests them):

# %%
show_doc(moved_to_keywords)

# %%
show_doc(reordered_positionals)


# %% [markdown]
# ### Checking inputs
#
# Every public function of `ictd` accepts numpy arrays or torch tensors and returns torch tensors.
# Bad input (a wrong shape, a NaN, a discount of 1) must fail loudly with a message that names the
# argument, never produce a silently wrong number. These two helpers do that for the whole library.

# %%
#| code-fold: true
#| code-summary: "as_tensor"
#| export
def _positive_strides(a: np.ndarray) -> np.ndarray:
    (
        "`a`, copied when it is a view with a negative stride (a reversed array), which torch"
        " cannot share."
    )
    return a.copy() if any(st < 0 for st in a.strides) else a


def as_tensor(
    x,  # array-like (numpy array, torch tensor, list or number)
    name: str,  # argument name, used in error messages
    dtype=None,  # dtype to convert to; default: keep floating tensors, else float64
    device=None,  # device to move to; default: keep
) -> torch.Tensor:  # finite floating tensor
    (
        "Convert `x` to a finite floating torch tensor, raising `ValueError` (`TypeError` for"
        " complex numbers) that names `name`."
    )
    if x is None:
        raise TypeError(f"`{name}` must be numeric array-like, got None")
    if x.is_complex() if isinstance(x, torch.Tensor) else np.iscomplexobj(x):
        raise TypeError(f"`{name}` must be real, got complex numbers")
    try:
        t = (
            x
            if isinstance(x, torch.Tensor)
            else torch.as_tensor(_positive_strides(np.asarray(x, dtype=np.float64)))
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"`{name}` must be numeric array-like, got {type(x).__name__}") from e
    if dtype is None and not t.is_floating_point():
        dtype = torch.float64
    t = t.to(dtype=dtype or t.dtype, device=device or t.device)
    if not torch.isfinite(t).all():
        raise ValueError(f"`{name}` contains NaN or inf")
    return t


# %%
#| code-fold: true
#| code-summary: "check_gamma"
#| export
def check_gamma(gamma) -> float:
    "Return `gamma` as a float, raising `ValueError` unless it is a real number in [0, 1)."
    from ictd.core import (
        check_number,
    )  # the shared check (appendix A's module imports this one, so it is imported when called)

    try:
        g = check_number(gamma, "gamma", 0.0)
    except ValueError:
        g = -1.0
    shape = tuple(getattr(gamma, "shape", ()))
    if shape:
        raise ValueError(
            f"`gamma` must be a number in [0, 1), got an array of shape {shape} (an MRP is MRP(P,"
            " r, gamma, phi), in this order)"
        )
    if not 0 <= g < 1:
        raise ValueError(f"`gamma` must lie in [0, 1), got {gamma!r}")
    return g


# %%
show_doc(as_tensor)

# %%
show_doc(check_gamma)

# %%
#| code-fold: true
test_eq(as_tensor([1, 2], "x").dtype, torch.float64)
test_eq(as_tensor(torch.ones(2, dtype=torch.float32), "x").dtype, torch.float32)
test_fail(lambda: as_tensor([1.0, float("nan")], "rewards"), contains="`rewards` contains NaN")
test_fail(lambda: as_tensor("abc", "phi"), contains="`phi` must be numeric")
test_eq(check_gamma(0.9), 0.9)
for g in (1, -0.1, 1.5, "0.9", None, float("nan"), 0.5j, [0.5]):
    test_fail(lambda: check_gamma(g), contains="`gamma` must lie in [0, 1)")
test_fail(lambda: as_tensor(torch.ones(2) * 1j, "r"), contains="`r` must be real")
test_fail(lambda: as_tensor(np.ones(2) * 1j, "r"), contains="`r` must be real")
test_fail(lambda: as_tensor(None, "r"), contains="`r` must be numeric array-like, got None")
for kw, msg in (
    (dict(seed=-1), "`seed` must be"),
    (dict(seed="x"), "`seed` must be"),
    (dict(n_states=float("inf")), "`n_states` must be"),
    (dict(d=None), "`d` must be a positive integer"),
    (dict(features=None), "`features` must be one of"),
):
    test_fail(lambda: random_boyan_chain(**kw), contains=msg)


# %% [markdown]
# The stationary distribution of `MRP`: the stationary distribution is the solution of the (overdetermined, consistent) linear system
# $\big[\,P^\top - I;\ \mathbf 1^\top\big] d = [0; 1]$, which is unique exactly when the augmented
# matrix has full column rank; a chain with two closed classes fails that test and is rejected.

# %%
#| code-fold: true
#| code-summary: "_stationary"
#| export
def _stationary(P: np.ndarray) -> np.ndarray:
    s = len(P)
    A = np.vstack([P.T - np.eye(s), np.ones((1, s))])
    if np.linalg.matrix_rank(A, tol=1e-10) < s:
        raise ValueError("`P` has no unique stationary distribution (the chain is reducible)")
    d = np.linalg.lstsq(A, np.r_[np.zeros(s), 1.0], rcond=None)[0]
    return np.clip(d, 0, None) / np.clip(d, 0, None).sum()


# %% [markdown]
# ### Markov reward processes: a two-state example and bad input

# %% [markdown]
# A two-state example we can solve by hand: from either state the chain moves to the other, state 0
# pays 1 and state 1 pays 0. Then $d_\pi = (1/2, 1/2)$ and $v(0) = 1 + \gamma v(1)$,
# $v(1) = \gamma v(0)$, so $v(0) = 1/(1-\gamma^2)$.

# %%
#| code-fold: true
flip = MRP(P=[[0., 1.], [1., 0.]], r=[1., 0.], gamma=0.5, phi=[[1.], [0.]])
test_close(flip.d_pi, torch.tensor([0.5, 0.5], dtype=torch.float64), eps=1e-14)
test_close(flip.v_pi, torch.tensor([1/(1-0.25), 0.5/(1-0.25)], dtype=torch.float64), eps=1e-14)
flip

# %% [markdown]
# Each malformed input fails with the argument's name:

# %%
#| code-fold: true
ok = dict(P=np.eye(2)[[1, 0]], r=np.zeros(2), gamma=0.9, phi=np.eye(2))
bad_inputs = {"`P` is not row-stochastic": dict(P=[[0.5, 0.4], [1, 0]]),
              "`P` has negative entries":  dict(P=[[1.5, -0.5], [1, 0]]),
              "`P` must be a square":      dict(P=np.ones((2, 3)) / 3),
              "`r` must have shape (2,)":  dict(r=np.zeros(3)),
              "`phi` must have shape (2, d)": dict(phi=np.ones((3, 2))),
              "`gamma` must lie in [0, 1)": dict(gamma=1.0),
              "`r` contains NaN or inf":   dict(r=[0., np.nan]),
              "`P` contains NaN or inf":   dict(P=[[np.inf, 0], [1, 0]]),
              "no unique stationary distribution": dict(P=np.eye(2))}
for msg, kw in bad_inputs.items(): test_fail(lambda: MRP(**{**ok, **kw}), contains=msg)

# %% [markdown]
# ### Drawing a chain from uniforms
#
# A chain reads the uniforms of its generator in one fixed order, whatever its feature kind:
# the $s - 2$ jump probabilities, the $s$ weights of the last row, an $s \times d$ **feature
# block**, and then its $s$ rewards. Random features are the block mapped to $U(-1, 1)$, unit
# features are those rows rescaled to norm 1, and one-hot features ($\Phi = I$) read the block and
# discard it. Reading the block for every kind is what keeps the rewards in the same place, so the
# chains of one seed differ only in $\Phi$ (checked below). Random and unit features have always
# been drawn in this order, so the book's saved results keep their tasks; one-hot chains once
# skipped the block, and now share their rewards with the other kinds.

# %%
#| code-fold: true
#| code-summary: "transitions_from_uniforms"
#| export
FEATURES, REWARDS = ("random", "onehot", "unit"), ("random", "representable")


def transitions_from_uniforms(
    u: np.ndarray,  # (..., 2s - 2) uniforms: s - 2 jump probabilities, s last-row weights
    n_states: int,  # number of states s >= 2
) -> np.ndarray:  # (..., s, s) row-stochastic matrices
    "Boyan-chain transition matrices from uniforms: jumps of +1 or +2, and a random last row."
    s = n_states
    if u.shape[-1] != 2 * s - 2:
        raise ValueError(
            f"`u` must have last dimension 2 * n_states - 2 = {2 * s - 2}, got shape {u.shape}"
        )
    p, last = 0.01 + (0.99 - 0.01) * u[..., : s - 2], 0.01 + (0.99 - 0.01) * u[..., s - 2 :]
    P, i = np.zeros((*u.shape[:-1], s, s)), np.arange(s - 2)
    P[..., i, i + 1], P[..., i, i + 2] = p, 1 - p
    P[..., s - 2, s - 1] = 1.0
    P[..., s - 1, :] = last / last.sum(-1, keepdims=True)
    return P


# %%
#| code-fold: true
#| code-summary: "boyan_transitions"
#| export
def boyan_transitions(n_states:int,                 # number of states s >= 2
                      rng:np.random.Generator,     # source of randomness
                     )->np.ndarray:                 # (s, s) row-stochastic matrix
    "Random Boyan-chain transition matrix: jumps of +1 or +2, and a random last row."
    return transitions_from_uniforms(rng.random(2 * n_states - 2), n_states)


# %%
#| code-fold: true
#| code-summary: "chain_from_uniforms"
#| export
def chain_from_uniforms(
    u: np.ndarray,  # (..., 2s - 2 + s d) uniforms: jumps, last row, feature block
    n_states: int,  # number of states s >= 2
    d: int,  # columns of the feature block (one-hot features read it too, and have s columns)
    features: str,  # one of `FEATURES`
) -> tuple:  # P (..., s, s) and phi (..., s, d), or (..., s, s) for one-hot features
    (
        "Transition matrices and features of Boyan chains from their uniforms, in the order every "
        "feature kind reads them."
    )
    if features not in FEATURES:
        raise ValueError(f"`features` must be one of {FEATURES}, got {features!r}")
    s, k = n_states, 2 * n_states - 2
    if u.shape[-1] != k + s * d:
        raise ValueError(
            f"`u` must have last dimension 2 * n_states - 2 + n_states * d = {k + s * d}, got shape"
            f" {u.shape}"
        )
    block = -1 + (1 - -1) * u[..., k:].reshape(*u.shape[:-1], s, d)
    if features == "onehot":
        phi = np.broadcast_to(np.eye(s), (*u.shape[:-1], s, s)).copy()
    else:
        phi = block / np.linalg.norm(block, axis=-1, keepdims=True) if features == "unit" else block
    return transitions_from_uniforms(u[..., :k], s), phi


# %%
show_doc(chain_from_uniforms)

# %% [markdown]
# `transitions_from_uniforms` builds the transition matrices. The uniforms come in one flat vector so that a batch of
# chains is one array and one call. Every row it builds is a probability distribution, and the first rows only move right:

# %%
show_doc(transitions_from_uniforms)

# %%
#| code-fold: true
P5 = transitions_from_uniforms(np.random.default_rng(0).random((2, 8)), 5)
test_close(P5.sum(-1), np.ones((2, 5)), eps=1e-15)
test_eq(np.triu(P5[:, :4], 1), P5[:, :4]); test_eq(P5[:, 3], np.eye(5)[[4, 4]])

# %% [markdown]
# Where only the dynamics are wanted (the worst-case searches of chapter 5b build chains block by
# block), one chain's matrix comes straight from a generator with `boyan_transitions`; that it reads the generator as
# `transitions_from_uniforms` does is tested in the next cell.

# %%
show_doc(boyan_transitions)

# %%
#| code-fold: true
u = np.random.default_rng(0).random((3, 2 * 5 - 2 + 5 * 2))
for f in FEATURES:
    P3, phi3 = chain_from_uniforms(u, 5, 2, f)
    for b in range(3):
        test_eq(chain_from_uniforms(u[b], 5, 2, f), (P3[b], phi3[b]))
test_eq(chain_from_uniforms(u[0], 5, 2, "random")[0], transitions_from_uniforms(u[0, :8], 5))
test_eq(
    boyan_transitions(5, np.random.default_rng(4)),
    transitions_from_uniforms(np.random.default_rng(4).random(8), 5),
)
test_fail(
    lambda: chain_from_uniforms(u[0, :-1], 5, 2, "random"), contains="`u` must have last dimension"
)
test_fail(lambda: chain_from_uniforms(u[0], 5, 2, "cubic"), contains="`features` must be one of")

# %% [markdown]
# Seeds reproduce draws exactly, a `numpy.random.Generator` can be passed instead, the feature and
# reward variants do what they say, and bad arguments are rejected:

# %%
#| code-fold: true
a, b = random_boyan_chain(seed=7), random_boyan_chain(seed=7)
for k in ("P", "r", "phi", "v_pi"):
    test_eq(getattr(a, k), getattr(b, k))
test_ne(random_boyan_chain(seed=8).P, a.P)
test_eq(random_boyan_chain(seed=np.random.default_rng(7)).P, a.P)
test_eq(
    random_boyan_chain(n_states=6, features="onehot", seed=1).phi, torch.eye(6, dtype=torch.float64)
)
test_close(random_boyan_chain(features="unit", seed=1).phi.norm(dim=1), torch.ones(10), eps=1e-12)
rep = random_boyan_chain(rewards="representable", seed=1)
w = torch.linalg.lstsq(rep.phi, rep.v_pi.unsqueeze(1)).solution
test_close(rep.phi @ w.squeeze(1), rep.v_pi, eps=1e-10)

for msg, kw in {"`n_states` must be an integer >= 2": dict(n_states=1),
                "`d` must be a positive integer": dict(d=0),
                "`features` must be one of": dict(features="gaussian"),
                "`rewards` must be one of": dict(rewards="sparse"),
                "`gamma` must lie in [0, 1)": dict(gamma=1.)}.items():
    test_fail(lambda: random_boyan_chain(**kw), contains=msg)


# %% [markdown]
# ### The weighted error
#
# `weighted_error` is the one formula behind `msve`. The weighted error is kept apart from the chain so that continuous-state chapters, whose
# weights are a quadrature rule rather than $d_\pi$, score estimates with the same formula:

# %%
#| code-fold: true
#| code-summary: "weighted_error"
#| export
def weighted_error(
    v_hat: torch.Tensor,  # (..., m) estimates
    v: torch.Tensor,  # (..., m) true values
    weights: torch.Tensor,  # (..., m) weights (d_pi, or a quadrature rule for continuous states)
) -> torch.Tensor:  # (...) sum_x w(x) (v_hat(x) - v(x))^2
    (
        "The weighted squared error $\\sum_x w(x) (\\hat v(x) - v(x))^2$ over the last axis: the"
        " one definition of the book's MSVE."
    )
    v, weights = as_tensor(v, "v"), as_tensor(weights, "weights")
    v_hat = _estimates(v_hat, v)
    for name, x in (("v_hat", v_hat), ("weights", weights)):
        if x.shape[-1:] != v.shape[-1:]:
            raise ValueError(f"`{name}` must have {v.shape[-1]} entries along its last axis, as `v`, "
                             f"got shape {tuple(x.shape)}")
    return ((v_hat - v).square() * weights).sum(-1)


def _estimates(v_hat, v):
    "`v_hat` as a real floating tensor; NaN and inf pass (a diverged run's error is NaN)."
    if v_hat.is_complex() if isinstance(v_hat, torch.Tensor) else np.iscomplexobj(v_hat):
        raise TypeError("`v_hat` must be real, got complex numbers")
    if not isinstance(v_hat, torch.Tensor): v_hat = torch.as_tensor(np.asarray(v_hat, dtype=np.float64))
    return v_hat if v_hat.is_floating_point() else v_hat.to(v.dtype)


# %%
#| code-fold: true
test_close(
    weighted_error(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0]), torch.tensor([0.25, 0.75])),
    3.25,
)
test_eq(msve(mrp.v_pi, mrp), 0.)
test_close(msve(np.zeros(10), mrp), (mrp.d_pi * mrp.v_pi ** 2).sum().item(), eps=1e-15)
test_close(msve(mrp.v_pi + 0.5, mrp), 0.25, eps=1e-14)
test_eq(msve(torch.zeros(3, 10), mrp).shape, (3,))
test_eq(weighted_error(torch.tensor([float('nan'), 0.]), torch.zeros(2), torch.ones(2)).isnan(),
        True)
test_fail(lambda: weighted_error(torch.ones(3), torch.zeros(2), torch.ones(2)),
          contains="`v_hat` must have 2 entries")
test_fail(lambda: weighted_error(torch.ones(2), torch.zeros(2), torch.ones(1)),
          contains="`weights` must have 2 entries")
test_fail(lambda: weighted_error(torch.ones(2, dtype=torch.complex128), torch.zeros(2),
                                 torch.ones(2)),
          contains="`v_hat` must be real")
test_fail(lambda: weighted_error(torch.ones(2), torch.tensor([0., float('inf')]), torch.ones(2)),
          contains="`v` contains NaN")

# %% [markdown]
# ### Trajectories and the value error: shapes, seeds and bad input

# %%
#| code-fold: true
states, rewards = sample_trajectory(mrp, n=20, seed=0)
test_eq(
    (states.shape, rewards.shape, states.dtype, rewards.dtype),
    ((21,), (20,), torch.int64, torch.float64),
)
test_eq(rewards, mrp.r[states[:-1]])
test_eq(sample_trajectory(mrp, n=20, seed=0)[0], states)
test_eq(sample_trajectory(mrp, n=5, start=3, seed=1)[0][0], 3)

for msg, kw in {"`n` must be a non-negative integer": dict(n=-1),
                "`start` must be 'stationary'": dict(n=3, start="left"),
                "`start` must be a state in 0..9": dict(n=3, start=10)}.items():
    test_fail(lambda: sample_trajectory(mrp, **kw), contains=msg)

test_fail(lambda: msve(np.zeros(9), mrp), contains="`v_hat` must have last dimension 10")

# %% [markdown]
# ### Arguments checked against their annotations
#
# Every module of the package ends with `check_arguments(globals())`: each public function it defines then refuses,
# with an `ArgumentError` (both a `TypeError` and a `ValueError`) naming the argument, a value that its annotation
# rules out (a string where a number, a tensor, a sequence, a configuration or a model is expected), before any work
# is done. Annotations that say nothing checkable (`Path`, `Callable`, `str`) are left to the function's own checks,
# and so are the values an annotation allows but the function does not (a negative count, say).

# %%
#| code-fold: true
#| code-summary: "check_arguments"
#| export
import functools, inspect, types, typing
from collections.abc import Iterable


def is_real_number(x) -> bool:
    (
        "A real number that is not a bool: a Python or numpy int or float, or a real tensor or"
        " array with no dimensions."
    )
    if isinstance(x, torch.Tensor):
        return x.ndim == 0 and not x.is_complex() and x.dtype != torch.bool
    if isinstance(x, np.ndarray):
        return x.ndim == 0 and x.dtype.kind in "iuf"
    return not isinstance(x, (bool, np.bool_)) and isinstance(
        x, (int, float, np.integer, np.floating)
    )


_ARRAY_LIKE = (torch.Tensor, np.ndarray, list, tuple, int, float, np.number)


def _kind(t) -> tuple:
    "(test, what was expected) for a plain annotation `t`, or None when it says nothing checkable."
    if t is int:
        return is_real_number, "an integer"  # 2.5 passes: its value is the function's to refuse
    if t is float:
        return is_real_number, "a number"
    if t is bool:
        return (lambda x: isinstance(x, (bool, np.bool_))), "True or False"
    if t is dict:
        return (lambda x: isinstance(x, dict)), "a dict"
    if t in (list, tuple):
        return (
            lambda x: isinstance(x, Iterable) and not isinstance(x, (str, bytes, dict))
        ), "a sequence"
    if t is torch.Tensor:
        return (
            lambda x: isinstance(x, _ARRAY_LIKE) and not isinstance(x, bool)
        ), "a tensor or array-like"
    if isinstance(t, type) and (
        t.__module__.startswith(("ictd", "__main__")) or issubclass(t, torch.nn.Module)
    ):
        return (lambda x: isinstance(x, t)), f"a {t.__name__}"
    return None


def _annotation_check(t) -> tuple:
    "(test, what was expected) for annotation `t`, unions and Optional included, or None."
    union = typing.get_origin(t) in (typing.Union, types.UnionType)
    args = typing.get_args(t) if union else (t,)
    kinds = [_kind(a) for a in args if a is not type(None)]
    if not kinds or None in kinds:
        return None
    none_ok = type(None) in args
    what = " or ".join(w for _, w in kinds) + (" or None" if none_ok else "")
    return (lambda x: (none_ok and x is None) or any(test(x) for test, _ in kinds)), what


class ArgumentError(TypeError, ValueError):
    (
        "An argument of the wrong kind: both a `TypeError` and a `ValueError`, as the book's own "
        "checks raise either."
    )


def checked(f):
    (
        "`f`, refusing with an `ArgumentError` that names the argument any value its annotations"
        " rule out (defaults pass)."
    )
    if getattr(f, "moves_positionals", False):  # a deprecation shim: check the arguments it passes on
        f.__wrapped__ = checked(f.__wrapped__)
        return f
    try:
        hints = typing.get_type_hints(f)
    except Exception:
        return f  # an annotation that cannot be resolved: leave `f` to its own checks
    sig = inspect.signature(
        f, follow_wrapped=False
    )  # a decorated function keeps its decorator's calling convention
    checks = {
        p.name: (c, p.default)
        for p in sig.parameters.values()
        if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and p.name in hints
        and (c := _annotation_check(hints[p.name])) is not None
    }
    if not checks:
        return f

    @functools.wraps(f)
    def with_checks(*args, **kwargs):
        for name, x in sig.bind(*args, **kwargs).arguments.items():
            if name in checks and x is not checks[name][1] and not checks[name][0][0](x):
                raise ArgumentError(
                    f"`{name}` must be {checks[name][0][1]}, got {type(x).__name__} {x!r}"[:300]
                )
        return f(*args, **kwargs)

    return with_checks


def check_arguments(namespace: dict) -> None:
    (
        "Wrap every public function a module defines (its `__all__`) with `checked`, the validators"
        " (`check_*`) aside."
    )
    for name in namespace.get("__all__", ()):
        f = namespace.get(name)
        if (
            inspect.isfunction(f)
            and f.__module__ == namespace.get("__name__")
            and not name.startswith("check_")
        ):
            namespace[name] = checked(f)


# %%
#| code-fold: true
def _toy(n: int, x: float, config: MRP | None = None, v: torch.Tensor = None, name="free"):
    return n


toy = checked(_toy)
test_eq(toy(3, 0.5), 3)
test_eq(toy(3, 1, None, [1.0, 2.0]), 3)
test_eq(toy(2.5, 1.0), 2.5)  # a number of the wrong value is left to the function
for kw, msg in [
    (dict(n="abc", x=1.0), "`n` must be an integer, got str"),
    (dict(n=True, x=1.0), "`n` must be an integer"),
    (dict(n=1, x="a"), "`x` must be a number"),
    (dict(n=1, x=1.0, config="a"), "`config` must be a MRP or None"),
    (dict(n=1, x=1.0, v="abc"), "`v` must be a tensor"),
]:
    test_fail(lambda: toy(**kw), contains=msg)
test_eq(inspect.signature(toy), inspect.signature(_toy))
assert issubclass(ArgumentError, TypeError) and issubclass(ArgumentError, ValueError)


def _runs(results: list, seeds: list = None):
    return len(results)


test_eq(checked(_runs)(range(3), seeds=(1, 2)), 3)
test_fail(lambda: checked(_runs)("abc"), contains="`results` must be a sequence")
ns = dict(__name__="__main__", __all__=["_toy"], _toy=_toy)
check_arguments(ns)
test_fail(lambda: ns["_toy"]("abc", 1.0), contains="`n` must be an integer")

# %%
#| export
check_arguments(
    globals()
)  # every public function above refuses, naming it, an argument its annotation rules out

# %%
#| hide
import nbdev; nbdev.nbdev_export()
