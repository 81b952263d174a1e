# %%
#| default_exp linear

# %%
#| export
from __future__ import annotations
import torch
from torch import nn
from ictd.boyan import as_tensor, check_gamma, msve, random_boyan_chain, sample_trajectory
from ictd.wstd import batch_linear_td, weighted_softmax_td

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *

# %%
#| hide
import matplotlib.pyplot as plt


# %% [markdown]
# # Linear attention, side by side
# > The prior construction for in-context TD with linear attention (Wang et al., ICLR 2025), rebuilt, checked against batch linear TD, and compared with the softmax construction of this book.

# %% [markdown]
# Before softmax attention, the theory of in-context TD was built on **linear** attention, where the
# softmax is replaced by the identity. Wang, Blaser, Daneshmand and Zhang (ICLR 2025,
# arXiv 2405.13861) showed that a linear Transformer's forward pass can run batch linear TD(0), one
# iteration per layer. This chapter rebuilds that construction in the form given in the project's
# specification, proves the equivalence with a short argument of our own,
# checks it to machine precision, and then puts the two constructions side by side.

# %% [markdown]
# ## The linear-attention prompt
#
# Each context column carries a whole transition, the *successor's* features included, already
# discounted; the reward sits in the last row, which is also where the answer will appear:
#
# $$z_i = \begin{bmatrix}\phi(S_i)\\ \gamma\,\phi(S_{i+1})\\ R_{i+1}\end{bmatrix}\ (0 \le i < n),
# \qquad z_{n+j} = \begin{bmatrix}\phi(s_{q,j})\\ 0\\ 0\end{bmatrix}\ \text{(queries)} .$$
#
# So the prompt has $2d+1$ rows and $n + q$ columns. Compare the softmax prompt of the
# [prompt chapter](prompt.html): there each column holds one *state*, and the successor is reached by
# a shift of the token axis instead of being copied into the token.

# %%
#| export
def build_linear_prompt(phi_states,   # (..., n+1, d) features of S_0..S_n
                        rewards,      # (..., n) rewards, rewards[..., k-1] = R_k
                        phi_queries,  # (..., q, d) query features, or (..., d) for one query
                        gamma:float,  # discount factor in [0, 1)
                       )->torch.Tensor: # (..., 2d+1, n+q): columns [phi(S_i); gamma phi(S_{i+1}); R_{i+1}], then [phi(s_q); 0; 0]
    "The linear-attention prompt of Wang et al. (2025): one column per transition, then the query columns."
    phi = as_tensor(phi_states, "phi_states")
    if phi.ndim < 2 or phi.shape[-2] < 2: raise ValueError(f"`phi_states` must have shape (..., n+1, d) with n >= 1, got {tuple(phi.shape)}")
    n, d = phi.shape[-2] - 1, phi.shape[-1]
    R = as_tensor(rewards, "rewards", phi.dtype, phi.device)
    if R.shape[-1:] != (n,): raise ValueError(f"`rewards` must have shape (..., {n}) to match `phi_states`, got {tuple(R.shape)}")
    Q = as_tensor(phi_queries, "phi_queries", phi.dtype, phi.device)
    if Q.ndim == phi.ndim - 1: Q = Q.unsqueeze(-2)
    if Q.shape[-1] != d: raise ValueError(f"`phi_queries` must have shape (..., q, {d}), got {tuple(Q.shape)}")
    batch = torch.broadcast_shapes(phi.shape[:-2], R.shape[:-1], Q.shape[:-2])
    phi, R, Q = phi.expand(batch + phi.shape[-2:]), R.expand(batch + (n,)), Q.expand(batch + Q.shape[-2:])
    context = torch.cat([phi[..., :-1, :], check_gamma(gamma) * phi[..., 1:, :], R.unsqueeze(-1)], -1)
    queries = torch.cat([Q, torch.zeros(batch + (Q.shape[-2], d + 1), dtype=phi.dtype, device=phi.device)], -1)
    return torch.cat([context, queries], -2).mT


# %%
show_doc(build_linear_prompt)

# %%
phi_s, R_ = torch.arange(8.).reshape(4, 2), torch.tensor([10., 20., 30.])
Z = build_linear_prompt(phi_s, R_, torch.tensor([[-1., -2.]]), gamma=0.5)
test_eq(Z.shape, (5, 4))
test_eq(Z[:, 0], torch.tensor([0., 1., 1., 1.5, 10.]))
test_eq(Z[:, 3], torch.tensor([-1., -2., 0., 0., 0.]))
test_eq(build_linear_prompt(torch.randn(7, 4, 2), torch.randn(7, 3), torch.randn(7, 5, 2), 0.9).shape, (7, 5, 8))
test_fail(lambda: build_linear_prompt(phi_s, R_[:2], phi_s[0], 0.5), contains="`rewards` must have shape (..., 3)")
test_fail(lambda: build_linear_prompt(phi_s, R_, torch.ones(3), 0.5), contains="`phi_queries` must have shape")
test_fail(lambda: build_linear_prompt(phi_s, R_, phi_s[0], 1.0), contains="`gamma` must lie in [0, 1)")
Z


# %% [markdown]
# ## The linear-attention layer
#
# With $Z_l$ of shape $(2d+1) \times (n+q)$ and $M = \mathrm{diag}(1, \dots, 1, 0, \dots, 0)$
# keeping the $n$ context columns as keys, the layer is
#
# $$Z_{l+1} = Z_l + \frac{1}{n} P_l Z_l M \big(Z_l^\top Q_l Z_l\big).$$
#
# There is no softmax: the weight of key $i$ for column $j$ is the raw bilinear form
# $z_i^\top Q_l z_j$. We compute it as $(P Z_{:,<n})\,(Z_{:,<n}^\top (Q Z))/n$, never forming $M$.
# How many columns are context is an argument `n` of the forward pass, by default all but the last
# column (one query).

# %%
#| export
def _context_length(Z:torch.Tensor, n)->int:
    if n is None: n = Z.shape[-1] - 1
    if not 1 <= n <= Z.shape[-1]: raise ValueError(f"`n` must lie in 1..{Z.shape[-1]} (the number of context columns), got {n}")
    return int(n)

class LinearAttentionLayer(nn.Module):
    "One linear self-attention layer $Z + \\frac1n P Z M (Z^\\top Q Z)$ of Wang et al. (2025)."
    def __init__(self, d:int,        # feature dimension; tokens have 2d+1 rows
                 dtype=torch.float64):
        super().__init__()
        self.d = d
        self.P = nn.Parameter(torch.zeros(2 * d + 1, 2 * d + 1, dtype=dtype))
        self.Q = nn.Parameter(torch.zeros(2 * d + 1, 2 * d + 1, dtype=dtype))

    def forward(self, Z:torch.Tensor,  # (..., 2d+1, n+q) prompt
                n:int=None,            # number of context columns (default: all but the last)
               )->torch.Tensor:        # (..., 2d+1, n+q)
        if Z.shape[-2] != 2 * self.d + 1: raise ValueError(f"`Z` must have {2 * self.d + 1} rows (2d+1 with d = {self.d}), got {Z.shape[-2]}")
        n = _context_length(Z, n)
        P, Q = self.P.to(Z), self.Q.to(Z)
        C = Z[..., :n]
        return Z + (P @ C) @ (C.mT @ (Q @ Z)) / n


# %% [markdown]
# ## The batch-TD construction
#
# Choose $P_l$ zero except its bottom-right entry $1$, so that a layer writes only to the last row,
# and $Q_l$ zero except its top-left block $-\alpha C$ and top-middle block $+\alpha C$ (a
# preconditioner $C$, by default $I$). Then for columns $i < n$ and any $j$,
#
# $$z_i^\top Q z_j = \alpha\,\phi(S_i)^\top C\big(\gamma\,\phi'_j - \phi_j\big),$$
#
# where $\phi_j$ is the first block of column $j$ and $\gamma\phi'_j$ its middle block
# ($\phi'_j = \phi(S_{j+1})$ for a context column, $0$ for a query).
#
# ::: {.proposition}
# **Proposition (our argument for the construction of Wang et al. 2025 in the form above).** Let $w_l$ be the
# iterates of preconditioned batch linear TD, $w_{l+1} = w_l + \frac{\alpha}{n} C^\top
# \sum_{i<n} \delta_i^{(l)} \phi(S_i)$ from $w_0 = 0$, with $\delta_i^{(l)} = R_{i+1} +
# \gamma \phi(S_{i+1})^\top w_l - \phi(S_i)^\top w_l$. Then the last row of $Z_l$ holds
# $\delta^{(l)}_i$ at context column $i$ and $-\phi(s_q)^\top w_l$ at each query column.
# :::
#
# ::: {.proof}
# *Proof.* By induction on $l$. At $l=0$, $w_0 = 0$, the last row is $R_{i+1} = \delta_i^{(0)}$ on
# the context and $0$ on the queries. The first $2d$ rows never change. Suppose the claim holds at
# $l$; the last row gains $\frac1n\sum_{i<n} \delta_i^{(l)}\, z_i^\top Q z_j$. At a query this is
# $-\frac{\alpha}{n}\sum_i \delta_i^{(l)} \phi(S_i)^\top C \phi(s_q) = -\phi(s_q)^\top(w_{l+1} - w_l)$.
# At a context column $j$ it is $\frac{\alpha}{n}\sum_i \delta_i^{(l)} \phi(S_i)^\top C(\gamma
# \phi(S_{j+1}) - \phi(S_j)) = \gamma\phi(S_{j+1})^\top(w_{l+1}-w_l) - \phi(S_j)^\top(w_{l+1}-w_l)
# = \delta_j^{(l+1)} - \delta_j^{(l)}$.
# :::
#
# So the readout is $-Z_L[2d, \text{query}]$: the value estimate of $L$ iterations of batch linear TD.

# %%
#| export
class LinearICTD(nn.Module):
    "A stack of linear-attention layers reading out the negated last row at the query columns."
    def __init__(self, d:int,          # feature dimension
                 n_layers:int,         # number of layers L
                 shared:bool=True,     # one (P, Q) pair for every layer, or one per layer
                 dtype=torch.float64):
        super().__init__()
        if int(n_layers) != n_layers or n_layers < 0: raise ValueError(f"`n_layers` must be a non-negative integer, got {n_layers}")
        self.d, self.n_layers, self.shared = d, int(n_layers), shared
        self.layers = nn.ModuleList([LinearAttentionLayer(d, dtype) for _ in range(1 if shared else self.n_layers)])

    def forward(self, Z:torch.Tensor, n:int=None)->torch.Tensor:
        "Run all L layers on the prompt `Z` with `n` context columns (default: all but the last)."
        for l in range(self.n_layers): Z = self.layers[0 if self.shared else l](Z, n)
        return Z

    def predict(self, Z:torch.Tensor,  # (..., 2d+1, n+q) prompt
                n:int=None,            # number of context columns (default: all but the last)
               )->torch.Tensor:        # (..., q) value estimates at the query columns
        "Value estimates at the query columns: the negated last row of $Z_L$."
        n = _context_length(Z, n)
        return -self(Z, n)[..., -1, n:]

    @classmethod
    def from_td(cls, d:int,            # feature dimension
                n_layers:int,          # number of layers = TD iterations
                alpha:float,           # TD step size
                C=None,                # (d, d) preconditioner, default identity
                dtype=torch.float64):
        "The construction whose forward pass is `n_layers` iterations of (preconditioned) batch linear TD."
        C = torch.eye(d, dtype=dtype) if C is None else as_tensor(C, "C", dtype)
        if C.shape != (d, d): raise ValueError(f"`C` must have shape ({d}, {d}), got {tuple(C.shape)}")
        model = cls(d, n_layers, shared=True, dtype=dtype)
        with torch.no_grad():
            P, Q = model.layers[0].P, model.layers[0].Q
            P[-1, -1] = 1.
            Q[:d, :d], Q[:d, d:2 * d] = -alpha * C, alpha * C
        return model


# %%
show_doc(LinearICTD.from_td)

# %% [markdown]
# The claim, checked: on random Boyan chains with random features, $L$ layers of the constructed
# linear Transformer equal $L$ iterations of `batch_linear_td` (from the
# [weighted softmax TD chapter](weighted_softmax_td.html)) at every query, in float64, for depths up
# to 50 and several queries at once; a scalar preconditioner $C = cI$ is the same as step $c\alpha$.

# %%
worst = 0.
for seed in range(20):
    mrp = random_boyan_chain(n_states=10, d=4, seed=seed)
    S, R = sample_trajectory(mrp, 40, seed=seed)
    L, alpha = [1, 5, 20, 50][seed % 4], 0.2
    Z = build_linear_prompt(mrp.phi[S], R, mrp.phi, mrp.gamma)
    tf = LinearICTD.from_td(4, L, alpha).predict(Z, n=40)
    td = batch_linear_td(mrp.phi[S], R, alpha, mrp.gamma, L, phi_queries=mrp.phi)[..., 41:]
    worst = max(worst, ((tf - td).abs().max() / td.abs().max().clamp(min=1)).item())
    test_close(LinearICTD.from_td(4, L, 1., C=alpha * torch.eye(4, dtype=torch.float64)).predict(Z, n=40), tf, eps=1e-12)
test_close(worst, 0., eps=1e-12)
worst

# %% [markdown]
# Batched prompts run at once, each query's answer ignores the other queries, and malformed prompts
# are rejected:

# %%
mrps = [random_boyan_chain(seed=s) for s in range(6)]
trajs = [sample_trajectory(m, 30, seed=s) for s, m in enumerate(mrps)]
Zb = torch.stack([build_linear_prompt(m.phi[S], R, m.phi, m.gamma) for m, (S, R) in zip(mrps, trajs)])
model = LinearICTD.from_td(4, 10, 0.3)
batched = model.predict(Zb, n=30)
test_eq(batched.shape, (6, 10))
for b in range(6):
    test_close(batched[b], model.predict(Zb[b], n=30), eps=1e-13)
    test_close(batched[b, 3:4], model.predict(Zb[b, :, :34], n=30)[3:], eps=1e-13)
test_fail(lambda: model.predict(Zb[:, :5], n=30), contains="`Z` must have 9 rows")
test_fail(lambda: model.predict(Zb, n=50), contains="`n` must lie in 1..40")
test_fail(lambda: LinearICTD.from_td(4, 3, 0.1, C=torch.eye(3)), contains="`C` must have shape (4, 4)")
test_eq(LinearICTD.from_td(4, 3, 0.1).predict(Zb.float(), n=30).dtype, torch.float32)


# %% [markdown]
# ## Side by side
#
# | | linear attention (Wang et al. 2025) | softmax attention (this book) |
# |---|---|---|
# | token | a transition $[\phi(S_i); \gamma\phi(S_{i+1}); R_{i+1}]$ | a state $[\phi(S_i); R_{i+1}; v(S_i)]$ |
# | successor | copied into the token | reached by a shift of the token axis (second head, or TSM) |
# | weight of key $i$'s TD error for target $x$ | $\frac{\alpha}{n}\phi(S_i)^\top C \phi(x)$, unnormalised (written to the negated value slot) | $\alpha\,\mathrm{softmax}_i\, \phi(S_i)^\top W \phi(x)$ |
# | one layer | one step of batch linear TD on $w$ | one step of weighted softmax TD on $v$ |
# | where the estimate lives | a weight vector in $\mathbb R^d$ | values at the context's states (kernel space) |
# | limit in depth | the linear TD fixed point in the span of $\phi$ | the fixed point of the kernel-weighted Bellman equation (tabular: certainty equivalence) |
#
# Two consequences can be measured. First, **normalisation is a per-state step size**: with one-hot
# features both algorithms have the same fixed point (the certainty-equivalence value of the
# context), but linear TD moves state $x$ by $\alpha N(x)/n$ of its average TD error per layer while
# tabular softmax TD moves it by $\alpha$, so rarely visited states hold linear attention back.
# Second, **linear attention is limited by its features**: with $d = 4$ random features on 10 states
# its fixed point is a projection, with a floor no depth removes.
#
# The experiment: 100 random Boyan chains ($s = 10$, $\gamma = 0.9$), one stationary context of
# $n = 200$ transitions each, MSVE of the value estimate at every state (all 10 states as queries)
# against depth. Softmax attention uses the constructed parameters with $W = \beta I$, $\beta = 20$
# (the tabular regime, see the [convergence chapter](convergence.html)); the softmax Transformer's
# output is computed with `weighted_softmax_td`, which equals it layer by layer (Theorem 1 in the
# [dual-head chapter](dual_head.html)). Both use step $\alpha = 1$.

# %%
#| export
def msve_against_depth(tasks:list,         # MRPs, all with the same number of states
                       contexts:list,      # one (states, rewards) trajectory per task
                       values_fn,          # callable(phi_states, rewards, phi_queries, gamma) -> (n_iters+1, s) estimates per depth
                      )->torch.Tensor:     # (n_tasks, n_iters+1) MSVE of each task's estimate at each depth
    "MSVE at every depth of an in-context estimator run on each task's own context, all states as queries."
    return torch.stack([msve(m, values_fn(m.phi[S], R, m.phi, m.gamma)) for m, (S, R) in zip(tasks, contexts)])


# %%
#| export
def side_by_side(n_tasks:int=100,    # random Boyan chains (task b has seed `seed + b`)
                 n:int=200,          # context length
                 depth:int=60,       # deepest model
                 beta:float=20.,     # softmax score scale, W = beta I
                 alpha:float=1.,     # step size of both constructions
                 seed:int=0,         # first task seed (the context of task b has seed `seed + b` too)
                )->dict:             # label -> (n_tasks, depth + 1) MSVE at every depth
    "MSVE against depth of linear and softmax in-context TD, each on its own kind of features, on the same chains."
    def linear(phi_s, R, phi_q, gamma): return batch_linear_td(phi_s, R, alpha, gamma, depth, phi_queries=phi_q, return_all=True)[..., n + 1:]
    def softmax(phi_s, R, phi_q, gamma):
        W = beta * torch.eye(phi_s.shape[-1], dtype=phi_s.dtype)
        return weighted_softmax_td(phi_s, R, W, alpha, gamma, depth, phi_queries=phi_q, return_all=True)[..., n + 1:]
    def curve(features, values_fn):
        tasks = [random_boyan_chain(features=features, seed=seed + b) for b in range(n_tasks)]
        return msve_against_depth(tasks, [sample_trajectory(m, n, seed=seed + b) for b, m in enumerate(tasks)], values_fn)
    return {"linear attention, one-hot features": curve("onehot", linear),
            "softmax attention, one-hot features": curve("onehot", softmax),
            "linear attention, 4 random features": curve("random", linear)}

def plot_side_by_side(curves:dict,   # the output of `side_by_side`
                      n:int,         # the context length they were run with
                     ):              # the matplotlib figure
    "Median and quartiles of MSVE against depth for each construction."
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for (label, c), ls in zip(curves.items(), ("-", "-", "--")):
        med, lo, hi = (c.quantile(q, dim=0).numpy() for q in (0.5, 0.25, 0.75))
        ax.plot(med, ls, label=label)
        ax.fill_between(range(c.shape[1]), lo, hi, alpha=0.2)
    ax.set(yscale="log", xlabel="depth $L$ (layers = TD iterations)", ylabel="MSVE (squared return units)",
           title=f"Linear vs softmax in-context TD, {c.shape[0]} Boyan chains, $n = {n}$ (median, quartiles)")
    ax.set_ylim(bottom=1e-4)
    ax.legend(loc="lower left", fontsize=9)
    return fig


# %%
n_ctx = 200
curves = side_by_side(n=n_ctx)
plot_side_by_side(curves, n_ctx);

# %% [markdown]
# What the figure shows, and the tests below pin down: with one-hot features, softmax attention
# reaches its floor within a few dozen layers while linear attention, at the same step size, is
# still far above it after 60 layers, because its slowest state moves at rate $\alpha N(x)/n$.
# Given enough depth they meet: both fixed points are the certainty-equivalence value. With four
# random features, linear attention stalls at the error of its projected fixed point.

# %%
onehot_lin, onehot_soft, rand_lin = (c.median(0).values for c in curves.values())
assert onehot_soft[40] < onehot_lin[40] / 3, (onehot_soft[40], onehot_lin[40])
assert rand_lin[-1] > 3 * onehot_soft[-1], (rand_lin[-1], onehot_soft[-1])
mrp = random_boyan_chain(features="onehot", seed=0)
S, R = sample_trajectory(mrp, n_ctx, seed=0)
far_lin = batch_linear_td(mrp.phi[S], R, 1., mrp.gamma, 3000, phi_queries=mrp.phi)[n_ctx + 1:]
far_soft = weighted_softmax_td(mrp.phi[S], R, 20. * torch.eye(10, dtype=torch.float64), 1., mrp.gamma, 300, phi_queries=mrp.phi)[n_ctx + 1:]
test_close(far_lin, far_soft, eps=1e-6)
onehot_lin[40].item(), onehot_soft[40].item(), rand_lin[-1].item()

# %% [markdown]
# The softmax construction pays for its speed and expressiveness with a condition: its contraction
# needs the attention to concentrate on a state's own visits (kernel diagonality, the
# [convergence chapter](convergence.html)), while linear TD's stability depends on the step size and
# the features' covariance. Which of the two a pretrained Transformer ends up running is a question
# about training, taken up in [chapter 6](pretrain.html).

# %%
#| hide
import nbdev; nbdev.nbdev_export()
