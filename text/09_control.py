# %%
#| default_exp control

# %%
#| export
from __future__ import annotations
import math
from dataclasses import dataclass
import numpy as np
import torch
from ictd.boyan import as_tensor, check_gamma, transitions_from_uniforms, _stationary
from ictd.core import check_int, check_number, check_choice, check_floating, check_type

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *

# %%
#| hide
import matplotlib.pyplot as plt
from IPython.display import Markdown
import re
from ictd.boyan import boyan_transitions
from ictd.core import record_claim, OKABE_ITO, plain_log_ticks
from ictd.wstd import weighted_softmax_td


# %% [markdown]
# # MDPs and kernel soft Q-iteration
# > Beyond evaluation: Markov decision processes, a random family that generalises the Boyan chain, their exact optimal values, and kernel soft Q-iteration, the control algorithm that a softmax Transformer can run in context, with its exact reductions to expected SARSA, SARSA, kernel Q-learning and batch tabular Q-learning.

# %% [markdown]
# ::: {.callout-tip title="What this page shows"}
# - MDPs, the random family `random_mdp` that turns the Boyan chain into a decision problem, and $q_*$.
# - **Kernel soft Q-iteration** [ours]: the book's TD iteration with the successor's value replaced
#   by a Boltzmann average of its action values.
# - Four exact reductions, each tested: expected SARSA ($\beta = 0$), SARSA, kernel Q-learning
#   ($\beta \to \infty$) and batch tabular Q-learning (one-hot features, a sharp kernel).
# :::
#
# Everything before this part of the book is *policy evaluation*: the paper, its linear-attention
# predecessor (Wang et al., ICLR 2025) and chapters 0 to 8 estimate the value of the policy that
# generated the context. This part asks for *control*: from a context of transitions of an unknown
# MDP, compute (approximately) its optimal action values, and act on them. The nearest work,
# Liang and Lai (arXiv 2605.05755, 2026), constructs batch SARSA and actor-critic with *linear*
# attention. Q-learning needs the maximum over the successor's actions, and a maximum is exactly
# what a softmax can approach and a linear map cannot ([next page](control_transformer.html)).
# The family of MDPs, the algorithm and every result on these pages are the book's own
# construction, not the paper's, whose results are about policy evaluation (the summaries of it
# available to the project mention extending its theory to control settings as future work).
#
# *How to read this page.* The MDP and its exact solution; the random family, with one drawn and
# solved; trajectories; then kernel soft Q-iteration, the four reductions, and two figures. The MDP's
# plumbing (policies, exact values, returns), input checks and bulk tests are in
# [Implementation and tests](#implementation-and-tests).

# %% [markdown]
# ## Markov decision processes
#
# An MDP has states $0..S-1$, actions $0..A-1$, transitions $P(s' \mid s, a)$ (an array of shape
# $(S, A, S)$), expected rewards $r(s, a)$ (the reward $R_{t+1} = r(S_t, A_t)$ is paid on taking
# $A_t$ in $S_t$) and a discount $\gamma \in [0, 1)$. The learner sees features
# $\phi(s, a) \in \mathbb R^d$ of state-action **pairs** (shape $(S, A, d)$). A policy $\pi(a \mid s)$
# is an $(S, A)$ array whose rows are distributions. Its action values solve the Bellman equation
#
# $$q_\pi(s, a) = r(s, a) + \gamma \sum_{s'} P(s' \mid s, a) \sum_{a'} \pi(a' \mid s')\, q_\pi(s', a'),$$
#
# and the optimal action values solve $q_*(s, a) = r(s, a) + \gamma \sum_{s'} P(s' \mid s, a)
# \max_{a'} q_*(s', a')$. A policy fixes an MRP of chapter 0: $P_\pi(s, s') = \sum_a \pi(a \mid s)
# P(s' \mid s, a)$ and $r_\pi(s) = \sum_a \pi(a \mid s) r(s, a)$.

# %%
#| export
@dataclass(eq=False)
class MDP:
    "A validated Markov decision process with state-action features."
    P:torch.Tensor    # (S, A, S): P[s, a] is the distribution of the next state
    r:torch.Tensor    # (S, A) expected reward of taking action a in state s
    gamma:float       # discount factor in [0, 1)
    phi:torch.Tensor  # (S, A, d) features of every state-action pair

    def __post_init__(self):
        self.P = as_tensor(self.P, "P", torch.float64)
        self.r = as_tensor(self.r, "r", torch.float64)
        self.phi, self.gamma = as_tensor(self.phi, "phi", torch.float64), check_gamma(self.gamma)
        S, A = (self.P.shape[0], self.P.shape[1]) if self.P.ndim == 3 else (-1, -1)
        if self.P.ndim != 3 or self.P.shape[2] != S or S < 1 or A < 1:
            raise ValueError(f"`P` must have shape (S, A, S), got {tuple(self.P.shape)}")
        if (self.P < 0).any(): raise ValueError("`P` has negative entries")
        if not torch.allclose(self.P.sum(-1), torch.ones(S, A, dtype=torch.float64), atol=1e-10):
            raise ValueError("`P` is not stochastic: every P[s, a] must sum to 1")
        if self.r.shape != (S, A):
            raise ValueError(f"`r` must have shape ({S}, {A}) to match `P`, "
                             f"got {tuple(self.r.shape)}")
        if self.phi.ndim != 3 or self.phi.shape[:2] != (S, A):
            raise ValueError(f"`phi` must have shape ({S}, {A}, d) to match `P`, "
                             f"got {tuple(self.phi.shape)}")

    @property
    def n_states(self)->int: return self.P.shape[0]
    @property
    def n_actions(self)->int: return self.P.shape[1]
    @property
    def d(self)->int: return self.phi.shape[2]
    def __repr__(self):
        return (f"MDP(n_states={self.n_states}, n_actions={self.n_actions}, d={self.d}, "
                f"gamma={self.gamma})")


# %% [markdown]
# Policies are checked once; the uniform policy is the default behaviour of this
# part, and a greedy policy picks the first maximiser of each row of action values. Values that agree
# to a relative $10^{-9}$ count as tied: an iterate that should tie two actions exactly (as state
# rewards often do) ties them only up to rounding, and which of them rounding favours differs between
# CPUs, so the choice among them must not depend on it.

# %%
#| export
def check_policy(policy,        # (S, A) array of action probabilities
                 mdp:MDP,       # the MDP it acts in
                )->torch.Tensor:  # float64 (S, A)
    "`policy` as a tensor, or a `ValueError` naming `policy` unless its rows are distributions."
    pi, mdp = as_tensor(policy, "policy", torch.float64), check_type(mdp, MDP, "mdp")
    if pi.shape != (mdp.n_states, mdp.n_actions):
        raise ValueError(f"`policy` must have shape ({mdp.n_states}, {mdp.n_actions}), "
                         f"got {tuple(pi.shape)}")
    if (pi < 0).any() or not torch.allclose(pi.sum(-1), torch.ones_like(pi[:, 0]), atol=1e-10):
        raise ValueError("`policy` must have non-negative rows that sum to 1")
    return pi

def uniform_policy(mdp:MDP)->torch.Tensor:
    "The uniform policy, (S, A) with entries 1/A."
    mdp = check_type(mdp, MDP, "mdp")
    return torch.full((mdp.n_states, mdp.n_actions), 1 / mdp.n_actions, dtype=torch.float64)

TIE_RTOL = 1e-9   # action values this close (relative) are equal up to rounding

def greedy_actions(q,                     # (..., S, A) action values
                   rtol:float=TIE_RTOL,   # tolerance, relative to 1 + the row's largest |value|
                  )->torch.Tensor:        # (..., S) the first action tying the row's maximum
    ("The greedy action of each row of `q`: the first maximiser, counting values within rounding "
     "of the maximum as ties.")
    q = as_tensor(q, "q")
    tied = q >= q.amax(-1, keepdim=True) - rtol * (1 + q.abs().amax(-1, keepdim=True))
    return tied.to(torch.int8).argmax(-1)

def greedy_policy(q)->torch.Tensor:
    ("The deterministic policy (..., S, A) that takes the greedy action (`greedy_actions`) of each "
     "row of `q`.")
    q = as_tensor(q, "q")
    return torch.nn.functional.one_hot(greedy_actions(q), q.shape[-1]).to(q.dtype)


# %%
#| export
def policy_mrp(mdp:MDP, policy)->tuple:
    "The Markov reward process of `policy` in `mdp`: P_pi (S, S) and r_pi (S,)."
    pi = check_policy(policy, mdp)
    return torch.einsum("sa,sat->st", pi, mdp.P), (pi * mdp.r).sum(-1)

def stationary_distribution(mdp:MDP, policy=None)->torch.Tensor:
    "The stationary distribution (S,) of the states under `policy` (default uniform)."
    P_pi, _ = policy_mrp(mdp, uniform_policy(mdp) if policy is None else policy)
    return torch.from_numpy(_stationary(P_pi.numpy()))


# %% [markdown]
# Both value functions are exact. $q_\pi$ is one linear solve in the $SA$ pairs;
# $q_*$ is value iteration, stopped once the standard bound
# $\lVert Q_t - q_* \rVert_\infty \le \frac{\gamma}{1-\gamma} \lVert Q_t - Q_{t-1} \rVert_\infty$
# is below $10^{-12}$.

# %%
#| export
def q_pi(mdp:MDP, policy)->torch.Tensor:
    "The action values (S, A) of `policy`: the solution of $q = r + \\gamma P \\pi q$."
    pi = check_policy(policy, mdp)
    S, A = mdp.n_states, mdp.n_actions
    M = torch.einsum("sat,tb->satb", mdp.P, pi).reshape(S * A, S * A)
    q = torch.linalg.solve(torch.eye(S * A, dtype=torch.float64) - mdp.gamma * M, mdp.r.reshape(-1))
    return q.reshape(S, A)

def q_star(mdp:MDP,            # the MDP
           tol:float=1e-12,    # bound on the sup-norm distance to the optimal values
          )->torch.Tensor:     # (S, A) optimal action values
    "Optimal action values by value iteration, to within `tol` in the sup norm."
    mdp = check_type(mdp, MDP, "mdp")
    tol, g, q = check_number(tol, "tol", 0, strict=True), mdp.gamma, torch.zeros_like(mdp.r)
    for _ in range(100_000):
        new = mdp.r + g * mdp.P @ q.amax(-1)
        if g / (1 - g) * (new - q).abs().max() <= tol: return new
        q = new
    raise RuntimeError("value iteration did not converge")  # pragma: no cover


# %% [markdown]
# The **return** of a policy is its expected discounted return from a start distribution $\mu$
# (uniform over states unless given), $J(\pi) = \sum_s \mu(s) \sum_a \pi(a \mid s) q_\pi(s, a)$.
# Returns of a learner are reported normalised between the behaviour policy and the optimum,
# $(J(\pi) - J(b)) / (J(\pi_*) - J(b))$, as DPT (Lee et al., NeurIPS 2023) normalises between a
# random and the optimal policy: 0 is no better than the data's own policy, 1 is optimal.

# %%
#| export
def policy_return(mdp:MDP, policy, start=None)->float:
    "Expected discounted return of `policy` from the start distribution `start` (default uniform)."
    pi = check_policy(policy, mdp)
    mu = torch.full((mdp.n_states,), 1 / mdp.n_states, dtype=torch.float64) if start is None \
        else as_tensor(start, "start", torch.float64)
    if mu.shape != (mdp.n_states,) or (mu < 0).any() or abs(mu.sum().item() - 1) > 1e-10:
        raise ValueError(f"`start` must be a distribution over the {mdp.n_states} states")
    return (mu * (pi * q_pi(mdp, pi)).sum(-1)).sum().item()

def normalised_return(mdp:MDP, policy, behavior=None, start=None)->float:
    "$(J(\\pi) - J(b)) / (J(\\pi_*) - J(b))$ with $b$ the behaviour (default uniform)."
    b = uniform_policy(mdp) if behavior is None else behavior
    best, base = policy_return(mdp, greedy_policy(q_star(mdp)), start), policy_return(mdp, b, start)
    return (policy_return(mdp, policy, start) - base) / (best - base)


# %% [markdown]
# ## A random family that generalises the Boyan chain
#
# `random_mdp` draws an MDP in which **every action is its own random Boyan chain**
# ([chapter 0](boyan.html#the-random-boyan-chain)), with rewards that depend on the action:
#
# * for each action $a$ and state $i \le S - 3$: $p \sim U(0.01, 0.99)$, $P(i+1 \mid i, a) = p$,
#   $P(i+2 \mid i, a) = 1 - p$; $P(S-1 \mid S-2, a) = 1$; the last state's row is
#   $U(0.01, 0.99)$ weights over all states, normalised (each action drawn independently);
# * rewards $r(s, a) \sim U(-1, 1)$ i.i.d. (the default, `rewards="action"`), or `rewards="state"`:
#   $r(s, a) = r(s) \sim U(-1, 1)$, the Boyan chain's own rewards, so that actions differ only in where
#   they lead and acting well needs planning (with action rewards a myopic policy does well; page 9b);
# * features: one-hot pairs ($d = SA$, the tabular case, the default), `random` ($U(-1, 1)$ entries,
#   $d = 8$ unless given) or `unit` (those rows rescaled to norm 1).
#
# Under every policy the chain moves right and the last state can reach every state, so every policy's
# chain is irreducible and aperiodic: $q_\pi$, its stationary distribution and the uniform behaviour's
# stationary start are all well defined. The draws are read in a fixed order (transitions, rewards,
# features), so the MDPs of one seed under the three feature kinds share $P$ and $r$, and the two
# reward kinds share $P$ and $\Phi$; with one action
# the transitions are chapter 0's `boyan_transitions` of the same generator (both tested below).

# %%
#| export
MDP_FEATURES, MDP_REWARDS = ("onehot", "random", "unit"), ("action", "state")

def random_mdp(n_states:int=10,       # number of states S >= 2
               n_actions:int=3,       # number of actions A >= 1
               gamma:float=0.9,       # discount factor in [0, 1)
               features:str="onehot", # "onehot" (d = S A), "random" (U(-1, 1)) or "unit" (norm 1)
               seed=0,                # int or `numpy.random.Generator`
               d=None,                # feature dimension of random and unit features (default 8)
               rewards:str="action",  # "action": r(s, a) ~ U(-1, 1); "state": r(s, a) = r(s)
              )->MDP:
    "A random MDP whose every action is a random Boyan chain, with rewards r(s, a) ~ U(-1, 1)."
    S, A = check_int(n_states, "n_states", low=2), check_int(n_actions, "n_actions", low=1)
    features, gamma = check_choice(features, MDP_FEATURES, "features"), check_gamma(gamma)
    rewards = check_choice(rewards, MDP_REWARDS, "rewards")
    if features == "onehot" and d is not None and d != S * A:
        raise ValueError(f"`d` must be None or n_states * n_actions = {S * A} for one-hot "
                         f"features, got {d!r}")
    d = S * A if features == "onehot" else 8 if d is None else check_int(d, "d", low=1)
    rng = np.random.default_rng(seed)
    P = transitions_from_uniforms(rng.random((A, 2 * S - 2)), S).transpose(1, 0, 2)
    r = rng.uniform(-1, 1, size=(S, A))
    if rewards == "state": r = np.repeat(r[:, :1], A, 1)
    if features == "onehot": phi = np.eye(S * A).reshape(S, A, S * A)
    else:
        phi = rng.uniform(-1, 1, size=(S, A, d))
        if features == "unit": phi = phi / np.linalg.norm(phi, axis=-1, keepdims=True)
    return MDP(P, r, gamma, phi)


# %%
show_doc(random_mdp)

# %% [markdown]
# One MDP, seed 0, solved exactly. The greedy policy of $q_*$ is optimal: its own action values
# $q_\pi$ equal $q_*$, and no single-state deviation improves its return.

# %%
mdp = random_mdp(seed=0)
qs = q_star(mdp)
pi_star = greedy_policy(qs)
test_close(q_pi(mdp, pi_star), qs, eps=1e-10)
test_close(mdp.r + mdp.gamma * mdp.P @ qs.amax(-1), qs, eps=1e-11)     # Bellman optimality
J = {name: policy_return(mdp, pi) for name, pi in
     dict(optimal=pi_star, uniform=uniform_policy(mdp), worst=greedy_policy(q_star(
         MDP(mdp.P, -mdp.r, mdp.gamma, mdp.phi)))).items()}
assert J["worst"] < J["uniform"] < J["optimal"]
Markdown(f"`{mdp!r}`: returns (uniform start) {J['optimal']:.4f} for the optimal policy, "
         f"{J['uniform']:.4f} for the uniform one and {J['worst']:.4f} for the worst "
         "deterministic one.")


# %% [markdown]
# ## Trajectories
#
# A context is one trajectory $S_0, A_0, R_1, S_1, A_1, \dots, R_n, S_n, A_n$ of a behaviour
# policy $b$ (uniform by default), started from $b$'s stationary distribution. Transition $k$ is
# $(S_{k-1}, A_{k-1}, R_k, S_k)$ with $R_k = r(S_{k-1}, A_{k-1})$. The last action $A_n$ is the
# behaviour's choice at $S_n$; it is taken but not rewarded, and only SARSA reads it.

# %%
#| export
def sample_mdp_trajectory(mdp:MDP,        # the MDP
                          n:int,          # number of transitions
                          behavior=None,  # (S, A) behaviour policy; default uniform
                          seed=0,         # int or `numpy.random.Generator`
                         )->tuple:        # states (n+1,), actions (n+1,), rewards (n,)
    "`n` transitions of `behavior` from its stationary distribution: (states, actions, rewards)."
    n = check_int(n, "n", low=1)
    b = uniform_policy(mdp) if behavior is None else check_policy(behavior, mdp)
    rng, S = np.random.default_rng(seed), mdp.n_states
    s = rng.choice(S, p=stationary_distribution(mdp, b).numpy())
    cum_b, cum_P, u = b.cumsum(-1).numpy(), mdp.P.cumsum(-1).numpy(), rng.random((n + 1, 2))
    states, actions = np.empty(n + 1, dtype=np.int64), np.empty(n + 1, dtype=np.int64)
    for t in range(n + 1):
        states[t] = s
        actions[t] = min(np.searchsorted(cum_b[s], u[t, 0], side="right"), mdp.n_actions - 1)
        s = min(np.searchsorted(cum_P[s, actions[t]], u[t, 1], side="right"), S - 1)
    states, actions = torch.from_numpy(states), torch.from_numpy(actions)
    return states, actions, mdp.r[states[:-1], actions[:-1]]


# %%
states, actions, rewards = sample_mdp_trajectory(mdp, 12, seed=0)
test_eq(rewards, mdp.r[states[:-1], actions[:-1]])
for k in range(12): assert mdp.P[states[k], actions[k], states[k + 1]] > 0
Markdown("The pairs $(S_k, A_k)$ of a context of 12 transitions: "
         + ", ".join(f"({s_}, {a_})" for s_, a_ in zip(states.tolist(), actions.tolist())) + ".")


# %% [markdown]
# ## Kernel soft Q-iteration
#
# The algorithm needs, for each transition $k$, the features $\phi(S_{k-1}, A_{k-1})$ of the pair it
# left (the **keys**) and the features $\phi(S_k, a')$ of the successor state with *every* action
# $a'$. Both are read off the MDP's features; the learner never sees $P$ or $r$.

# %%
#| export
def _indices(x, size:int, name:str)->torch.Tensor:
    "Integer indices in 0..size-1 (tensor, array or list), or a `ValueError` naming `name`."
    t = as_tensor(x, name) if not isinstance(x, torch.Tensor) else x
    if t.is_floating_point() and (t != t.round()).any() or t.dtype == torch.bool or t.is_complex() \
            or t.ndim < 1 or ((t < 0) | (t >= size)).any():
        raise ValueError(f"`{name}` must be integer indices in 0..{size - 1}, got {str(x)[:60]}")
    return t.long()

def context_features(mdp:MDP, states, actions)->tuple:
    "Features of a context: phi_sa (n, d) of the pairs left, phi_next (n, A, d) of the successors."
    mdp = check_type(mdp, MDP, "mdp")
    S, Aa = _indices(states, mdp.n_states, "states"), _indices(actions, mdp.n_actions, "actions")
    if S.shape[-1:] != Aa.shape[-1:] or S.shape[-1] < 2:
        raise ValueError(f"`states` and `actions` must have the same length n + 1 >= 2, "
                         f"got {tuple(S.shape)} and {tuple(Aa.shape)}")
    return mdp.phi[S[..., :-1], Aa[..., :-1]], mdp.phi[S[..., 1:]]


# %% [markdown]
# ::: {.definition}
# **Definition 9.1 (kernel soft Q-iteration; ours).** Given a score matrix $W$, a step $\alpha > 0$
# and an inverse temperature $\beta \in [0, \infty]$, start from $Q_0 = 0$ and, for every target pair
# $x$,
#
# $$\begin{aligned}Q_{l+1}(x) = Q_l(x) + \alpha \sum_{k=1}^n K_k(x)\Big[&R_k + \gamma \sum_{a'} \pi_l(a' \mid S_k)\,
# Q_l(S_k, a')\\ &- Q_l(S_{k-1}, A_{k-1})\Big],\end{aligned}$$
#
# $$K_k(x) = \frac{\exp\big(\phi(S_{k-1}, A_{k-1})^\top W \phi(x)\big)}
# {\sum_{k'} \exp\big(\phi(S_{k'-1}, A_{k'-1})^\top W \phi(x)\big)},$$
#
# $$\pi_l(\cdot \mid s) = \mathrm{softmax}\big(\beta\, Q_l(s, \cdot)\big),$$
#
# with $\pi_l$ uniform on the maximisers when $\beta = \infty$.
# :::
#
# It is [chapter 1](weighted_softmax_td.html)'s weighted softmax TD on pairs, with the successor's value
# replaced by the **Boltzmann backup** $B_\beta(q) = \sum_{a'} \mathrm{softmax}(\beta q)_{a'}\, q_{a'}$
# of its action values. As for chapter 1, a value depends on its pair only through $\phi(x)$, so the
# iterate lives on finitely many targets: the $n$ pairs of the context, the $nA$ successor pairs
# whose values the backup reads, and any query pairs.

# %%
#| export
def _is_inf(beta)->bool:
    "Whether `beta` is the number +inf (a float, numpy or 0-d tensor), never raising."
    try: return bool(float(beta) == math.inf) if not isinstance(beta, (str, bytes)) else False
    except (TypeError, ValueError): return False

def boltzmann_backup(q:torch.Tensor,  # (..., A) action values
                     beta:float,      # inverse temperature in [0, inf]; inf is the max
                    )->torch.Tensor:  # (...,) sum_a softmax(beta q)_a q_a
    "The Boltzmann backup $\\sum_a \\mathrm{softmax}(\\beta q)_a q_a$, the max when `beta` is inf."
    q = check_floating(q, "q")
    beta = math.inf if _is_inf(beta) else check_number(beta, "beta", 0)
    if q.ndim < 1 or q.shape[-1] < 1:
        raise ValueError(f"`q` must have shape (..., A), got {tuple(q.shape)}")
    if beta == math.inf: return q.amax(-1)
    return (torch.softmax(beta * q, -1) * q).sum(-1)


# %% [markdown]
# It lies between the mean ($\beta = 0$) and the max, and falls short of the max by at most
# $\log(A)/\beta$: with $p = \mathrm{softmax}(\beta q)$,
# $\max q \le \frac1\beta \log \sum_a e^{\beta q_a} = B_\beta(q) + H(p)/\beta$ and $H(p) \le \log A$.

# %%
qa = torch.tensor([[0.3, -1.0, 0.2], [2.0, 2.0, -5.0]], dtype=torch.float64)
test_close(boltzmann_backup(qa, 0.), qa.mean(-1), eps=1e-15)
test_eq(boltzmann_backup(qa, math.inf), qa.amax(-1))
for b in (0.5, 3., 40.):
    gap = qa.amax(-1) - boltzmann_backup(qa, b)
    assert (gap >= 0).all() and (gap <= math.log(3) / b).all(), (b, gap)


# %% [markdown]
# `kernel_q_iteration` runs Definition 9.1. The weights $K$ are computed once (the scores read
# features only); each iteration is one backup and one weighted sum. `next_actions` replaces the
# Boltzmann average by the behaviour's own next action $A_k$: that is SARSA.

# %%
#| export
def _check_beta(beta)->float:
    if _is_inf(beta): return math.inf
    return check_number(beta, "beta", 0)

def kernel_q_iteration(phi_sa,            # (..., n, d) features of the pairs (S_{k-1}, A_{k-1})
                       rewards,           # (..., n) rewards, rewards[..., k-1] = R_k
                       phi_next,          # (..., n, A, d) each successor S_k with every action
                       W,                 # (d, d) or (..., d, d) score matrix
                       *,
                       alpha:float,       # step size > 0
                       gamma:float,       # discount factor in [0, 1)
                       beta:float,        # inverse temperature of the backup in [0, inf]
                       n_iters:int,       # number of iterations
                       phi_queries=None,  # (..., q, d) features of query pairs, or None
                       next_actions=None, # (..., n) behaviour's A_1..A_n: SARSA, not the backup
                       return_all=False,  # return every iterate Q_0..Q_T
                      )->torch.Tensor:    # (..., n + q) values at the context's pairs, queries
    "Kernel soft Q-iteration (Definition 9.1) from $Q_0 = 0$: values at the pairs and queries."
    keys = as_tensor(phi_sa, "phi_sa", torch.float64)
    if keys.ndim < 2:
        raise ValueError(f"`phi_sa` must have shape (..., n, d), got {tuple(keys.shape)}")
    n, d = keys.shape[-2:]
    R = as_tensor(rewards, "rewards", torch.float64)
    if R.shape[-1:] != (n,):
        raise ValueError(f"`rewards` must have shape (..., {n}), got {tuple(R.shape)}")
    N = as_tensor(phi_next, "phi_next", torch.float64)
    if N.ndim < 3 or N.shape[-3] != n or N.shape[-1] != d:
        raise ValueError(f"`phi_next` must have shape (..., {n}, A, {d}), got {tuple(N.shape)}")
    A_ = N.shape[-2]
    Q = keys.new_zeros(keys.shape[:-2] + (0, d)) if phi_queries is None \
        else as_tensor(phi_queries, "phi_queries", torch.float64)
    if Q.ndim < 2 or Q.shape[-1] != d:
        raise ValueError(f"`phi_queries` must have shape (..., q, {d}), got {tuple(Q.shape)}")
    W = as_tensor(W, "W", torch.float64)
    if W.shape[-2:] != (d, d):
        raise ValueError(f"`W` must have shape ({d}, {d}) or (..., {d}, {d}), got {tuple(W.shape)}")
    alpha, gamma = check_number(alpha, "alpha", 0, strict=True), check_gamma(gamma)
    beta, n_iters = _check_beta(beta), check_int(n_iters, "n_iters")
    batch = torch.broadcast_shapes(keys.shape[:-2], R.shape[:-1], N.shape[:-3], Q.shape[:-2],
                                   W.shape[:-2])
    X = torch.cat([keys.expand(batch + (n, d)), N.expand(batch + N.shape[-3:]).flatten(-3, -2),
                   Q.expand(batch + Q.shape[-2:])], -2)                  # (..., m, d) targets
    K = torch.softmax(keys @ W @ X.mT, dim=-2)                                # (..., n, m)
    if next_actions is not None:
        nxt = torch.as_tensor(next_actions).long()
        if nxt.shape[-1:] != (n,) or (nxt < 0).any() or (nxt >= A_).any():
            raise ValueError(f"`next_actions` must hold n = {n} actions in 0..{A_ - 1}")
        nxt = nxt.expand(batch + (n,))[..., None]
    v, vs = X.new_zeros(X.shape[:-1]), []
    for t in range(n_iters + 1):
        vs.append(torch.cat([v[..., :n], v[..., n + n * A_:]], -1))
        if t == n_iters: break
        q_next = v[..., n:n + n * A_].unflatten(-1, (n, A_))
        b = boltzmann_backup(q_next, beta) if next_actions is None \
            else q_next.gather(-1, nxt)[..., 0]
        v = v + alpha * ((R + gamma * b - v[..., :n])[..., None, :] @ K)[..., 0, :]
    return torch.stack(vs, -2) if return_all else vs[-1]


# %% [markdown]
# ## The four reductions
#
# **1. $\beta = 0$: expected SARSA of the uniform policy.** With $\beta = 0$ the policy $\pi_l$ is
# uniform at every iteration, so the backup is the mean $\frac1A \sum_{a'} Q_l(S_k, a')$: kernel
# expected SARSA that *evaluates* the uniform policy. `expected_sarsa_loop` below is an independent,
# transition-by-transition implementation with a fixed policy; the two agree to rounding error, and in
# the tabular limit the iteration converges to the uniform policy's values on the context's
# empirical MDP (tested in [Implementation and tests](#the-tabular-limit)).

# %%
#| code-fold: true
#| code-summary: "Code: kernel expected SARSA, one transition at a time"
def expected_sarsa_loop(phi_sa, rewards, phi_next, W, policy_next, alpha, gamma, n_iters,
                        phi_queries):
    "Kernel expected SARSA for a fixed policy (policy_next (n, A)), one loop per transition."
    n, A = phi_next.shape[:2]
    X = list(phi_sa) + [phi_next[k, a] for k in range(n) for a in range(A)] + list(phi_queries)
    weights = [torch.softmax(torch.stack([phi_sa[k] @ W @ x for k in range(n)]), 0) for x in X]
    v = [0.] * len(X)
    for _ in range(n_iters):
        delta = [rewards[k] + gamma * sum(policy_next[k, a] * v[n + k * A + a] for a in range(A))
                 - v[k]
                 for k in range(n)]
        v = [v[j] + alpha * sum(weights[j][k] * delta[k] for k in range(n)) for j in range(len(X))]
    return torch.stack([torch.as_tensor(x) for x in v[:n] + v[n + n * A:]])


# %%
small = random_mdp(5, 2, features="random", d=3, seed=1)
S1, A1, R1 = sample_mdp_trajectory(small, 15, seed=1)
f_sa, f_next = context_features(small, S1, A1)
W1 = torch.randn(3, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
f_q = small.phi[2]
common = dict(alpha=0.4, gamma=small.gamma, n_iters=6, phi_queries=f_q)
uniform_next = torch.full((15, 2), 0.5, dtype=torch.float64)
test_close(kernel_q_iteration(f_sa, R1, f_next, W1, beta=0., **common),
           expected_sarsa_loop(f_sa, R1, f_next, W1, uniform_next, 0.4, small.gamma, 6, f_q),
           eps=1e-12)

# %% [markdown]
# **2. The behaviour's next action: SARSA.** With `next_actions` $= (A_1, \dots, A_n)$ the update is
# TD on the chain of pairs $(S_0, A_0), (S_1, A_1), \dots, (S_n, A_n)$, with features $\phi(S_k, A_k)$:
# exactly chapter 1's `weighted_softmax_td` run on the pair features. It evaluates the behaviour.

# %%
pairs = small.phi[S1, A1]                                                       # (n + 1, d)
sarsa = kernel_q_iteration(f_sa, R1, f_next, W1, beta=0., next_actions=A1[1:], **common)
# S_0..S_n, queries
wstd = weighted_softmax_td(pairs, R1, W1, alpha=0.4, gamma=small.gamma, n_iters=6, phi_queries=f_q)
test_close(sarsa, torch.cat([wstd[:15], wstd[16:]]), eps=1e-12)

# %% [markdown]
# **3. $\beta \to \infty$: kernel Q-learning.** With $\beta = \infty$ the backup is
# $\max_{a'} Q_l(S_k, a')$. The finite-$\beta$ iterates tend to it at rate $1/\beta$: one iteration is
# a map $F_\beta$ with $\lVert F_\beta(Q) - F_\infty(Q) \rVert_\infty \le \alpha\gamma \log(A)/\beta$
# (the weights sum to one, and the backup gap is at most $\log(A)/\beta$), and $F_\infty$ is
# Lipschitz in the sup norm with constant $\Lambda = 1 + \alpha(1 + \gamma)$, so
# $\lVert Q^\beta_l - Q^\infty_l \rVert_\infty \le \alpha\gamma \frac{\log A}{\beta}
# \sum_{t < l} \Lambda^t$. The check compares the measured gap with this bound.

# %%
Ls, lam = 6, 1 + 0.4 * (1 + small.gamma)
q_max = kernel_q_iteration(f_sa, R1, f_next, W1, beta=math.inf, **common)
for b in (1., 10., 100., 1000.):
    gap = (kernel_q_iteration(f_sa, R1, f_next, W1, beta=b, **common) - q_max).abs().max().item()
    bound = 0.4 * small.gamma * math.log(2) / b * sum(lam ** t for t in range(Ls))
    assert gap <= bound, (b, gap, bound)
    print(f"beta = {b:>6g}: gap {gap:.2e}, bound {bound:.2e}")


# %% [markdown]
# **4. One-hot features and a sharp kernel: batch tabular Q-learning.** `batch_tabular_q` is the
# per-pair averaged batch update on the context: each visited pair moves by $\alpha$ times the mean
# TD error of the transitions that leave it; an unvisited pair stays at 0.

# %%
#| export
def batch_tabular_q(states, actions, rewards,  # (..., n+1), (..., n+1) and (..., n): one context
                    n_states:int, n_actions:int,
                    *,
                    alpha:float, gamma:float, beta:float, n_iters:int,
                    return_all=False,          # return every iterate Q_0..Q_T
                   )->torch.Tensor:            # (..., S, A); (..., T+1, S, A) with `return_all`
    "Per-pair averaged batch tabular soft Q-iteration (alpha times each pair's mean TD error)."
    S, A, x, R = _tabular(states, actions, rewards, n_states, n_actions)
    alpha, gamma = check_number(alpha, "alpha", 0, strict=True), check_gamma(gamma)
    beta, n_iters = _check_beta(beta), check_int(n_iters, "n_iters")
    E = torch.nn.functional.one_hot(x[..., :-1], S * A).to(R.dtype)        # (..., n, SA)
    E = E / E.sum(-2, keepdim=True).clamp(min=1)
    nxt = x[..., 1:] // A * A                                 # first pair of each successor state
    q, qs = R.new_zeros(R.shape[:-1] + (S * A,)), []
    for t in range(n_iters + 1):
        qs.append(q.unflatten(-1, (S, A)))
        if t == n_iters: break
        succ = q.gather(-1, (nxt[..., None] + torch.arange(A)).flatten(-2)).unflatten(-1, (-1, A))
        delta = R + gamma * boltzmann_backup(succ, beta) - q.gather(-1, x[..., :-1])
        q = q + alpha * (delta[..., None, :] @ E)[..., 0, :]
    return torch.stack(qs, -3) if return_all else qs[-1]

def _tabular(states, actions, rewards, n_states, n_actions):
    "Validated (S, A, pair indices (..., n+1), rewards) of a tabular context."
    S, A = check_int(n_states, "n_states", low=1), check_int(n_actions, "n_actions", low=1)
    s, a = torch.as_tensor(states), torch.as_tensor(actions)
    for t, name, hi in ((s, "states", S), (a, "actions", A)):
        bad = (t < 0).any() or (t >= hi).any()
        if t.is_floating_point() or t.ndim < 1 or t.shape[-1] < 2 or bad:
            raise ValueError(f"`{name}` must hold integers in 0..{hi - 1}, "
                             "shape (..., n+1) with n >= 1")
    R = as_tensor(rewards, "rewards", torch.float64)
    if s.shape != a.shape or R.shape[-1:] != (s.shape[-1] - 1,):
        raise ValueError(f"`states`, `actions` (..., n+1) and `rewards` (..., n) disagree: "
                         f"{tuple(s.shape)}, {tuple(a.shape)}, {tuple(R.shape)}")
    return S, A, s.long() * A + a.long(), R


# %% [markdown]
# ::: {.proposition}
# **Proposition 9.1 (ours).** Take one-hot pair features and $W = \kappa I$. Suppose every target
# pair is visited: every action of every successor state $S_1, \dots, S_n$, and every query pair,
# occurs among $(S_0, A_0), \dots, (S_{n-1}, A_{n-1})$. Then for every $\beta \in [0, \infty]$ and
# every fixed $l$, as $\kappa \to \infty$ the iterate of kernel soft Q-iteration at each target tends
# to that of `batch_tabular_q`, with a gap $O(e^{-\kappa})$.
# :::
#
# ::: {.callout-note collapse="true" title="Proof"}
# As in chapter 1's Proposition 1.5: the weights of a visited pair $x$ are
# $K_k(x) = e^{\kappa \mathbf 1[x_{k-1} = x]} / (N(x) e^\kappa + n - N(x))$, within
# $\eta_\kappa = 2(n / N_{\min} - 1) e^{-\kappa}$ in $\ell_1$ of $\mathbf 1[x_{k-1} = x] / N(x)$, and
# with those limit weights the update of $x$ is the tabular one (targets of one pair carry one value).
# The Boltzmann backup is not 1-Lipschitz in the sup norm, but it is on bounded sets:
# $\partial B_\beta / \partial q_a = p_a (1 + \beta (q_a - B_\beta(q)))$, so its Lipschitz constant on
# $\{\lVert q \rVert_\infty \le M\}$ is at most $c = 1 + 2\beta M$ ($c = 1$ for the max). For
# weights that sum to one, the map of one iteration is then Lipschitz with constant
# $\Lambda = 1 + \alpha(1 + \gamma c)$ on that set, and the iterates of both iterations stay in a
# bounded set for $l$ fixed steps (each step grows the sup norm by at most a factor $\Lambda$ plus
# $\alpha \max_k |R_k|$). The gap obeys $e_{t+1} \le \Lambda e_t + \alpha\, \eta_\kappa \max_k |\delta_k|$
# from $e_0 = 0$, so $e_l = O(\eta_\kappa) = O(e^{-\kappa})$ for fixed $l$ and $\beta$.
# :::
#
# The check: contexts of the default MDP in which every pair is visited, for $\beta \in \{0, 5, \infty\}$.
# The gap falls like $e^{-\kappa}$ (Figure 9.3 in [Implementation and tests](#the-tabular-limit)):

# %%
#| code-fold: true
#| code-summary: "Code: contexts that visit every pair, and the gaps"
def visiting_context(mdp, n, rng):
    "A trajectory in which every state-action pair is left at least once (Proposition 9.1)."
    while True:
        S_, A_, R_ = sample_mdp_trajectory(mdp, n, seed=rng)
        if len(set((S_[:-1] * mdp.n_actions + A_[:-1]).tolist())) == mdp.n_states * mdp.n_actions:
            return S_, A_, R_

def tabular_gaps(mdp, S_, A_, R_, kappas, beta, alpha=0.8, n_iters=20):
    "Largest gap over iterations and targets: kernel (W = kappa I) against batch_tabular_q."
    f_sa, f_next = context_features(mdp, S_, A_)
    q_tab = batch_tabular_q(S_, A_, R_, mdp.n_states, mdp.n_actions, alpha=alpha, gamma=mdp.gamma,
                            beta=beta, n_iters=n_iters, return_all=True)
    I = torch.eye(mdp.d, dtype=torch.float64)
    Ws = torch.as_tensor(kappas, dtype=torch.float64)[:, None, None] * I
    kern = kernel_q_iteration(f_sa, R_, f_next, Ws, alpha=alpha, gamma=mdp.gamma, beta=beta,
                              n_iters=n_iters, phi_queries=mdp.phi.flatten(0, 1), return_all=True)
    tab = torch.cat([q_tab[:, S_[:-1], A_[:-1]], q_tab.flatten(-2)], -1)
    return (kern - tab).abs().amax((-2, -1)).numpy()


# %%
rng_tab, kappa_grid = np.random.default_rng(9), np.arange(0, 41, 2.)
tab_contexts = [visiting_context(random_mdp(seed=s), 150, rng_tab) for s in range(4)]
tab_gaps = {b: np.array([tabular_gaps(random_mdp(seed=s), *c, kappa_grid, b)
                         for s, c in enumerate(tab_contexts)])
            for b in (0., 5., math.inf)}
for b, g_ in tab_gaps.items(): assert (g_[:, kappa_grid == 36] < 1e-11).all(), (b, g_[:, -3])
beta_tex = lambda b: r"\infty" if b == math.inf else f"{b:g}"
Markdown(f"At $\\kappa = 36$ the largest gap over {len(tab_contexts)} contexts, 20 iterations and "
         f"every target is below $10^{{-11}}$ (asserted) for $\\beta$ = "
         + ", ".join(f"${beta_tex(b)}$" for b in tab_gaps) + ".")

# %% [markdown]
# ## What the iteration reaches
#
# Figures 9.1 and 9.2 run the iteration with four values of $\beta$ on one context of $n = 2000$
# transitions of the default MDP (one-hot features, $\kappa = 30$, $\alpha = 1$) and measure the distance to the MDP's own $q_*$ and to the
# uniform policy's $q_\pi$ at every pair. With $\beta = 0$ the iteration evaluates the uniform policy
# and approaches $q_{\mathrm{unif}}$, not $q_*$; as $\beta$ grows it moves towards $q_*$, and
# $\beta = \infty$ gets there up to the statistical error of the context (the distance from the
# context's empirical MDP to the true one).

# %%
n_fig, betas_fig = 2000, (0., 1., 4., math.inf)
S_f, A_f, R_f = sample_mdp_trajectory(mdp, n_fig, seed=3)
fs, fn = context_features(mdp, S_f, A_f)
W_sharp = 30. * torch.eye(mdp.d, dtype=torch.float64)
traj = {b: kernel_q_iteration(fs, R_f, fn, W_sharp, alpha=1., gamma=mdp.gamma, beta=b, n_iters=80,
                              phi_queries=mdp.phi.flatten(0, 1), return_all=True)[:, n_fig:]
        for b in betas_fig}
q_unif = q_pi(mdp, uniform_policy(mdp)).flatten()
err_star = {b: (v - qs.flatten()).abs().amax(-1).numpy() for b, v in traj.items()}
err_unif = {b: (v - q_unif).abs().amax(-1).numpy() for b, v in traj.items()}
final = {b: (e[-1], err_unif[b][-1]) for b, e in err_star.items()}
assert final[math.inf][0] < final[0.][0] and final[0.][1] < final[math.inf][1]
assert final[math.inf][0] < 0.2 * np.abs(qs.numpy()).max()

# %%
#| fig-cap: "Figure 9.1: Kernel soft Q-iteration on one context of the default MDP (n = 2000, one-hot features, kappa = 30, alpha = 1): the distance to the optimal values falls furthest for large beta."
#| fig-alt: "Log-scale plot of the largest distance to q_star against the iteration l from 0 to 80, one line per beta; the curve for beta = infinity falls lowest, beta = 0 levels off highest."
ylim = (min(min(e.min() for e in d.values()) for d in (err_star, err_unif)) / 2,
        max(max(e.max() for e in d.values()) for d in (err_star, err_unif)) * 2)
beta_label = lambda b: r"$\beta = \infty$ (Q-learning)" if b == math.inf else rf"$\beta = {b:g}$"

def distance_plot(errors, title):
    "One line per beta of the largest distance at every iteration, on the shared log scale."
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for i, b in enumerate(betas_fig):
        ax.semilogy(errors[b], color=OKABE_ITO[i], label=beta_label(b))
    ax.set(xlabel="iteration $l$", ylabel=r"$\max_x |Q_l(x) - q(x)|$ (return units)", title=title,
           ylim=ylim)
    ax.legend(fontsize=9)
    plain_log_ticks(ax, "y")

distance_plot(err_star, r"distance to $q_*$")

# %%
#| fig-cap: "Figure 9.2: The same iterates' distance to the uniform policy's values: beta = 0 evaluates the uniform policy."
#| fig-alt: "Log-scale plot of the largest distance to the uniform policy's values against the iteration l from 0 to 80, one line per beta; beta = 0 falls lowest."
distance_plot(err_unif, r"distance to $q_{\mathrm{unif}}$ (uniform policy)")

# %%
Markdown(f"After 80 iterations the distance to $q_*$ is {final[math.inf][0]:.3f} for "
         f"$\\beta = \\infty$ and "
         f"{final[0.][0]:.3f} for $\\beta = 0$, whose distance to $q_{{\\mathrm{{unif}}}}$ is "
         f"{final[0.][1]:.3f} "
         f"(the largest $|q_*|$ is {np.abs(qs.numpy()).max():.2f}).")

# %%
record_claim("reductions", "Kernel soft Q-iteration reduces exactly to expected SARSA of the "
             "uniform policy ($\\beta = 0$), to weighted softmax TD on pairs (SARSA), to kernel "
             "Q-learning ($\\beta \\to \\infty$, "
             "gap at most $\\alpha\\gamma\\log(A)/\\beta$ per step) and, with one-hot features and "
             "$W = \\kappa I$, to "
             "batch tabular soft Q-iteration ($\\kappa \\to \\infty$, gap $O(e^{-\\kappa})$; "
             "Proposition 9.1).",
             "proved", "control", "#the-four-reductions");

# %% [markdown]
# [The next page](control_transformer.html) builds the softmax Transformer whose forward pass is this
# iteration, and proves that no linear-attention layer can compute its $\beta = \infty$ step.

# %% [markdown]
# ## Implementation and tests

# %% [markdown]
# ### The MDP and its policies

# %% [markdown]
# A two-state MDP solved by hand. Action 0 stays, action 1 switches; state 0 pays 1 for staying,
# everything else pays 0. Optimal: stay in 0 ($q_*(0, 0) = 1/(1-\gamma)$) and switch from 1
# ($q_*(1, 1) = \gamma/(1-\gamma)$).

# %%
two = MDP(P=[[[1., 0.], [0., 1.]], [[0., 1.], [1., 0.]]], r=[[1., 0.], [0., 0.]], gamma=0.5,
          phi=np.eye(4).reshape(2, 2, 4))
test_close(q_star(two), torch.tensor([[2., 0.5], [0.5, 1.]], dtype=torch.float64), eps=1e-12)
test_eq(greedy_policy(q_star(two)), torch.tensor([[1., 0.], [0., 1.]], dtype=torch.float64))
test_close(policy_return(two, greedy_policy(q_star(two)), start=[1., 0.]), 2., eps=1e-12)
test_close(normalised_return(two, greedy_policy(q_star(two))), 1., eps=1e-12)
test_close(normalised_return(two, uniform_policy(two)), 0., eps=1e-12)
ties = torch.tensor([[1., 1. + 1e-12, 0.], [0., 1., 1. + 1e-6], [3e9, 3e9 * (1 + 1e-10), 0.]],
                    dtype=torch.float64)
test_eq(greedy_actions(ties), torch.tensor([0, 2, 0]))           # rounding-level leads tie
test_eq(greedy_actions(ties.flip(-1)), torch.tensor([1, 0, 1]))  # the first tied action

# %% [markdown]
# Bad input fails with the argument's name:

# %%
#| code-fold: true
#| code-summary: "Tests: bad input"
ok = dict(P=two.P, r=two.r, gamma=0.5, phi=two.phi)
for msg, kw in {"`P` must have shape (S, A, S)": dict(P=np.ones((2, 2)) / 2),
                "`P` is not stochastic": dict(P=np.ones((2, 2, 2))),
                "`P` has negative entries": dict(P=np.array([[[2., -1.]] * 2] * 2)),
                "`r` must have shape (2, 2)": dict(r=np.zeros(2)),
                "`phi` must have shape (2, 2, d)": dict(phi=np.zeros((2, 4))),
                "`gamma` must lie in [0, 1)": dict(gamma=1.),
                "`r` contains NaN": dict(r=[[np.nan, 0.], [0., 0.]])}.items():
    test_fail(lambda: MDP(**{**ok, **kw}), contains=msg)
for msg, kw in {"`n_states` must be an integer >= 2": dict(n_states=1),
                "`n_actions` must be an integer >= 1": dict(n_actions=0),
                "`features` must be one of": dict(features="gaussian"),
                "`rewards` must be one of": dict(rewards="sparse"),
                "`d` must be None or n_states * n_actions": dict(d=4),
                "`d` must be an integer >= 1": dict(features="random", d=0),
                "`gamma` must lie in [0, 1)": dict(gamma=1.)}.items():
    test_fail(lambda: random_mdp(**kw), contains=msg)
test_fail(lambda: check_policy(np.ones((10, 3)), mdp),
          contains="`policy` must have non-negative rows")
test_fail(lambda: check_policy(np.ones((3, 3)) / 3, mdp),
          contains="`policy` must have shape (10, 3)")
test_fail(lambda: policy_return(mdp, uniform_policy(mdp), start=np.ones(10)),
          contains="`start` must be")
test_fail(lambda: sample_mdp_trajectory(mdp, 0), contains="`n` must be an integer >= 1")
test_fail(lambda: q_star(mdp, tol=0), contains="`tol` must be a finite number > 0")

# %% [markdown]
# The family: seeds reproduce, the feature kinds of one seed share the MDP, one action is chapter 0's
# Boyan chain, and every policy's chain has a unique stationary distribution.

# %%
#| code-fold: true
#| code-summary: "Tests: the family"
for seed in range(20):
    kinds = [random_mdp(7, 3, features=f, seed=seed) for f in MDP_FEATURES]
    for m in kinds[1:]: test_eq((m.P, m.r), (kinds[0].P, kinds[0].r))
    test_close(kinds[2].phi.norm(dim=-1), torch.ones(7, 3, dtype=torch.float64), eps=1e-12)
    test_eq(random_mdp(7, 1, seed=seed).P[:, 0].numpy(),
            boyan_transitions(7, np.random.default_rng(seed)))
    g_seed = torch.Generator().manual_seed(seed)
    pi_rand = torch.softmax(torch.randn(7, 3, generator=g_seed, dtype=torch.float64), -1)
    dist = stationary_distribution(kinds[0], pi_rand)
    test_close(dist @ policy_mrp(kinds[0], pi_rand)[0], dist, eps=1e-12)
test_eq(random_mdp(seed=3).phi, torch.eye(30, dtype=torch.float64).reshape(10, 3, 30))
test_eq(random_mdp(features="random", seed=3).d, 8)
state_r = random_mdp(seed=3, rewards="state")
test_eq(state_r.P, random_mdp(seed=3).P)
test_eq(state_r.r, random_mdp(seed=3).r[:, :1].expand(10, 3))

# %% [markdown]
# $q_\pi$ against the MRP of chapter 0 ($v_\pi = \sum_a \pi q_\pi$ solves $v = r_\pi + \gamma P_\pi v$),
# and $q_*$ dominates every policy's values:

# %%
#| code-fold: true
#| code-summary: "Tests: q_pi and q_*"
for seed in range(10):
    m = random_mdp(6, 4, seed=seed)
    g_seed = torch.Generator().manual_seed(seed)
    pi_rand = torch.softmax(3 * torch.randn(6, 4, generator=g_seed, dtype=torch.float64), -1)
    P_pi, r_pi = policy_mrp(m, pi_rand)
    v = torch.linalg.solve(torch.eye(6, dtype=torch.float64) - m.gamma * P_pi, r_pi)
    test_close((pi_rand * q_pi(m, pi_rand)).sum(-1), v, eps=1e-12)
    assert (q_star(m) >= q_pi(m, pi_rand) - 1e-10).all()

# %% [markdown]
# Trajectories: reproducible, consistent with the MDP, and stationary (the visit frequencies of a long
# trajectory are within five standard errors of the behaviour's stationary distribution, with the
# standard error from batch means over 100 batches):

# %%
#| code-fold: true
#| code-summary: "Tests: trajectories"
test_eq(sample_mdp_trajectory(mdp, 50, seed=4)[0], sample_mdp_trajectory(mdp, 50, seed=4)[0])
long_s, long_a, _ = sample_mdp_trajectory(mdp, 100_000, seed=5)
batches = torch.nn.functional.one_hot(long_s[:100_000], 10).double().reshape(100, 1000, 10).mean(1)
se = batches.std(0) / 10
z = (batches.mean(0) - stationary_distribution(mdp)).abs() / se
assert (z < 5).all(), z
test_close(torch.bincount(long_a, minlength=3).double() / len(long_a),
           torch.full((3,), 1 / 3, dtype=torch.float64), eps=0.01)
greedy_s, greedy_a, _ = sample_mdp_trajectory(mdp, 200, behavior=pi_star, seed=6)
test_eq(greedy_a, pi_star.argmax(-1)[greedy_s])

# %% [markdown]
# ### Kernel soft Q-iteration

# %%
show_doc(batch_tabular_q)

# %% [markdown]
# With one action, every reduction is chapter 1's weighted softmax TD, for any $\beta$; and a batch of
# contexts and score matrices gives the same values as one at a time:

# %%
#| code-fold: true
#| code-summary: "Tests: one action, and batches"
one = random_mdp(6, 1, features="random", d=3, seed=2)
S2, A2, R2 = sample_mdp_trajectory(one, 20, seed=2)
g2, n2 = context_features(one, S2, A2)
for b in (0., 2., math.inf):
    ours = kernel_q_iteration(g2, R2, n2, W1, alpha=0.5, gamma=0.9, beta=b, n_iters=7,
                              phi_queries=one.phi[:, 0])
    ref = weighted_softmax_td(one.phi[S2, 0], R2, W1, alpha=0.5, gamma=0.9, n_iters=7,
                              phi_queries=one.phi[:, 0])
    test_close(ours, torch.cat([ref[:20], ref[21:]]), eps=1e-12)
Ws3 = torch.randn(3, 3, 3, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
batched = kernel_q_iteration(f_sa, R1, f_next, Ws3, beta=2., **common)
for i in range(3):
    one_W = kernel_q_iteration(f_sa, R1, f_next, Ws3[i], beta=2., **common)
    test_close(batched[i], one_W, eps=1e-13)
test_eq(kernel_q_iteration(f_sa, R1, f_next, W1, beta=2., return_all=True, **common).shape,
        (7, 15 + 2))

# %% [markdown]
# ### The tabular limit
#
# Figure 9.3 shows the gaps of Proposition 9.1; the fitted slope of $\log$(gap) against $\kappa$ is
# $-1$ on every context and every $\beta$ (asserted within 0.1, on $\kappa$ from 4 to 24):

# %%
mid = (kappa_grid >= 4) & (kappa_grid <= 24)
slopes = {b: [np.polyfit(kappa_grid[mid], np.log(g_i[mid]), 1)[0] for g_i in g_]
          for b, g_ in tab_gaps.items()}
for b, sl in slopes.items(): assert all(-1.1 < s_ < -0.9 for s_ in sl), (b, sl)
Markdown("| $\\beta$ | fitted slopes, one per context |\n|---|---|\n"
         + "\n".join(f"| ${beta_tex(b)}$ | " + ", ".join(f"{s_:.3f}" for s_ in sl) + " |"
                     for b, sl in slopes.items()))

# %%
#| fig-cap: "Figure 9.3: The distance between kernel soft Q-iteration with W = kappa I and batch tabular soft Q-iteration falls like exp(-kappa), for every beta."
#| fig-alt: "Log-scale plot of the largest distance against kappa from 0 to 30, one line per context and beta; all fall parallel to a dashed line 10 exp(-kappa)."
fig, ax = plt.subplots(figsize=(6, 3.8))
shown = kappa_grid <= 30
for i, (b, g_) in enumerate(tab_gaps.items()):
    for j, g_i in enumerate(g_):
        lab = (r"$\beta = \infty$" if b == math.inf else rf"$\beta = {b:g}$") if j == 0 else None
        ax.semilogy(kappa_grid[shown], g_i[shown], "o-", ms=2.5, lw=1, color=OKABE_ITO[i],
                    alpha=0.7,
                    label=lab)
ax.semilogy(kappa_grid, 10 * np.exp(-kappa_grid), "k--", label=r"$10\,e^{-\kappa}$")
ax.set(xlabel=r"kernel scale $\kappa$ ($W = \kappa I$)",
       ylabel="max |kernel - tabular|\n(return units)",
       ylim=(1e-14, 10),
       title=f"Distance to batch tabular soft Q-iteration\n{len(tab_contexts)} contexts, "
             "20 iterations")
ax.legend(fontsize=9);


# %% [markdown]
# The limit of batch tabular Q-learning ($\beta = \infty$) is the optimal values of the context's
# empirical MDP: value iteration on the empirical transitions and mean rewards of the visited pairs
# (unvisited pairs held at 0), an independent computation:

# %%
#| code-fold: true
#| code-summary: "Code: the empirical MDP's optimal values, and the check"
def empirical_q_star(S_, A_, R_, n_states, n_actions, gamma):
    "Optimal values of the context's empirical MDP by value iteration (unvisited pairs held at 0)."
    x = S_ * n_actions + A_
    counts = torch.bincount(x[:-1], minlength=n_states * n_actions).double()
    P_hat = torch.zeros(n_states * n_actions, n_states, dtype=torch.float64).index_put_(
        (x[:-1], S_[1:]), torch.ones(len(R_), dtype=torch.float64), accumulate=True)
    P_hat = P_hat / counts.clamp(min=1)[:, None]
    r_hat = torch.zeros(n_states * n_actions, dtype=torch.float64).index_add_(0, x[:-1], R_)
    r_hat = r_hat / counts.clamp(min=1)
    q = torch.zeros(n_states, n_actions, dtype=torch.float64)
    for _ in range(2000):
        q = ((r_hat + gamma * P_hat @ q.amax(-1)) * (counts > 0)).reshape(n_states, n_actions)
    return q

S3, A3, R3 = tab_contexts[0]
test_close(batch_tabular_q(S3, A3, R3, 10, 3, alpha=1., gamma=0.9, beta=math.inf, n_iters=400),
           empirical_q_star(S3, A3, R3, 10, 3, 0.9), eps=1e-12)

# %% [markdown]
# Bad input to the iteration:

# %%
#| code-fold: true
#| code-summary: "Tests: bad input to the iteration"
for msg, kw in {"`alpha` must be a finite number > 0": dict(alpha=0.),
                "`beta` must be a finite number >= 0": dict(beta=-1.),
                "`n_iters` must be an integer >= 0": dict(n_iters=-1),
                "`gamma` must lie in [0, 1)": dict(gamma=1.)}.items():
    test_fail(lambda: kernel_q_iteration(f_sa, R1, f_next, W1, **{**common, "beta": 1., **kw}),
              contains=msg)
test_fail(lambda: kernel_q_iteration(f_sa, R1[:-1], f_next, W1, beta=1., **common),
          contains="`rewards` must have shape")
test_fail(lambda: kernel_q_iteration(f_sa, R1, f_next[:-1], W1, beta=1., **common),
          contains="`phi_next` must have shape")
test_fail(lambda: kernel_q_iteration(f_sa, R1, f_next, W1[:2], beta=1., **common),
          contains="`W` must have shape")
test_fail(lambda: kernel_q_iteration(f_sa, R1, f_next, W1, beta=1., next_actions=A1[1:] + 5,
                                     **common),
          contains="`next_actions` must hold")
tab_kw = dict(alpha=1., gamma=0.9, beta=1., n_iters=1)
test_fail(lambda: batch_tabular_q(S3, A3 + 3, R3, 10, 3, **tab_kw), contains="`actions` must hold")
test_fail(lambda: batch_tabular_q(S3, A3, R3[:-1], 10, 3, **tab_kw), contains="disagree")

# %% [markdown]
# ### The module's other functions
#
# The page's API entries are the functions a reader calls (`random_mdp`, `kernel_q_iteration`,
# `batch_tabular_q`); the MDP class and the module's other public functions, with their docstrings:

# %%
#| code-fold: true
#| code-summary: "Code for the list"
plumbing = (MDP, check_policy, uniform_policy, greedy_actions, greedy_policy, policy_mrp,
            stationary_distribution, q_pi, q_star, policy_return, normalised_return,
            sample_mdp_trajectory, context_features, boltzmann_backup)
code = lambda doc: re.sub(r"`([^`]*)`", r"<code>\1</code>", doc).replace("|", "&#124;")
Markdown(f"<details><summary>{len(plumbing)} functions</summary>\n\n"
         "| function | what it computes |\n|---|---|\n" + "\n".join(
    f"| <code>{f.__name__}</code> | {code(f.__doc__)} |" for f in plumbing) + "\n\n</details>")

# %%
#| hide
# Listed above: this keeps nbdev from adding a full API entry for each of them.
show_doc(MDP)
show_doc(check_policy)
show_doc(uniform_policy)
show_doc(greedy_actions)
show_doc(greedy_policy)
show_doc(policy_mrp)
show_doc(stationary_distribution)
show_doc(q_pi)
show_doc(q_star)
show_doc(policy_return)
show_doc(normalised_return)
show_doc(sample_mdp_trajectory)
show_doc(context_features)
show_doc(boltzmann_backup)

# %%
#| export
from ictd.boyan import check_arguments
check_arguments(globals())   # public functions refuse arguments their annotations rule out (ch. 0)

# %%
#| hide
import nbdev; nbdev.nbdev_export()
