# %%
#| default_exp causal

# %%
#| export
from __future__ import annotations
import math
import torch
from torch import nn
from ictd.boyan import as_tensor, check_gamma
from ictd.wstd import context_tensors
from ictd.prompt import build_prompt
from ictd.model import check_prompt, _generator, _token_rows, _xavier, _carry
from ictd.pretrain import Family, PretrainConfig, register_family, task_features

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *

# %%
#| hide
import time
import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown
from ictd.boyan import random_boyan_chain, sample_trajectory, msve
from ictd.tasks import random_tasks, sample_trajectories
from ictd.wstd import weighted_softmax_td
from ictd.model import SoftmaxICTD
torch.set_num_threads(1)

# %% [markdown]
# # A causal softmax Transformer
# > Decoder-only: a causal softmax Transformer that runs TD in context token by token, why masking the constructed parameters diverges, a construction that contracts for every kernel, streaming with a KV cache, and what pretraining finds under the mask.

# %% [markdown]
# The Transformers people train for in-context learning are decoder-only: each token attends to
# itself and to earlier tokens, never to later ones. One of the paper's summaries describes its
# architecture that way ("standard Transformer decoder-only structure"). The construction of
# [chapter 3](dual_head.html) is not causal: every context column attends to every other context
# column, and its target head reads the *next* token. [Chapter 3](dual_head.html) also measured that
# adding a causal mask to $\theta^*$ leaves the first layer unchanged but makes the value error grow
# again with depth.
#
# This chapter asks what a decoder can do. **Everything in it is the project's own**: the
# iteration a causal layer runs, its construction, the divergence theorem, the construction that
# converges, and the experiments. The paper's text is not available to us, and nothing here
# quotes it.
#
# The plan:
#
# 1. the iteration a causal layer can run, *prefix weighted softmax TD*, as a plain reference function;
# 2. a causal layer whose forward pass is exactly one step of it (Theorem 4a.1), checked to $10^{-12}$;
# 3. why it diverges under $\theta^*$ (Proposition 4a.2: an eigenvalue $1 + \alpha\gamma$, for every kernel),
#    a variant that contracts for every kernel (Proposition 4a.3), the bias left by causality, and a
#    positional bias that removes most of it;
# 4. streaming: the query's estimate as transitions arrive, with a KV cache;
# 5. pretraining a causal model on 10 seeds through the engine of [chapter 6](pretrain.html).

# %% [markdown]
# ## Prefix weighted softmax TD
#
# Notation as in [chapter 1](weighted_softmax_td.html): a trajectory $S_0, R_1, S_1, \dots, R_n, S_n$,
# transition $k = (S_{k-1}, R_k, S_k)$ for $k = 1..n$, a score $g(x, y) = \phi(x)^\top W \phi(y)$, and
# one value slot per *target*: the $n + 1$ trajectory states, then the queries. In weighted softmax
# TD every target sees every transition. In a decoder, the token of $S_j$ has seen only
# $S_0, \dots, S_j$, so it knows transitions $1..j$ and no others. The queries come last and see all $n$.
#
# ::: {.definition}
# **Definition (prefix weighted softmax TD; ours).** Let $\mathcal V(j)$ be the transitions target
# $j$ sees: $\{1, \dots, j\}$ for trajectory state $S_j$ (forward order), $\{1, \dots, n\}$ for a
# query. The weight of transition $k \in \mathcal V(j)$ for target $j$ (state $x_j$) is the softmax over the
# transitions it sees, optionally with a positional bias $\lambda \log p_k$ ($p_k$ the position of
# the transition's token, $p_k = k$ in forward order):
#
# $$K_{kj} = \frac{\exp\big(g(S_{k-1}, x_j) + \lambda \log p_k\big)}{\sum_{k' \in \mathcal V(j)} \exp\big(g(S_{k'-1}, x_j) + \lambda \log p_{k'}\big)},
# \qquad K_{kj} = 0 \text{ for } k \notin \mathcal V(j).$$
#
# From $v_0 = 0$ (one entry per target), with $\delta^{(t)}_k = R_k + \gamma v_t[k] - v_t[k-1]$:
#
# $$v_{t+1}[j] = v_t[j] + \alpha \sum_{k} K_{kj}\, \delta^{(t)}_k \qquad \text{(current = key)}.$$
# :::
#
# Two things differ from weighted softmax TD, and both matter below. The weights of target $j$
# are normalised over its own prefix, so two columns of the same state no longer share one
# kernel; and the value of a state is not one number but one per column, $v[j]$ being the estimate
# of $v(S_j)$ made from transitions $1..j$. With every transition visible to every target
# (`order="none"`) and $\lambda = 0$ the definition is weighted softmax TD, which the first test checks.
#
# Two variants come in later, and the reference computes them too: `order="reversed"` writes the
# trajectory into the prompt backwards ($S_n$ first), so that the token of $S_j$ sees the
# transitions *after* it, $\mathcal V(j) = \{j + 1, \dots, n\}$; and `current="self"` reads the
# current-state value of each TD error at the target itself instead of at the transition:
# $v_{t+1}[j] = v_t[j] + \alpha \sum_k K_{kj} (R_k + \gamma v_t[k] - v_t[j])$.
# %%
#| export
ORDERS = ("forward", "reversed", "none")   # how the trajectory sits in a decoder's prompt ("none": no causal mask)
CURRENTS = ("key", "self")                 # where a TD error reads its current-state value

def _choice(x, options:tuple, name:str):
    if x not in options: raise ValueError(f"`{name}` must be one of {options}, got {x!r}")
    return x

def visible_transitions(n:int,                # number of transitions
                        q:int=0,              # number of queries
                        order:str="forward",  # "forward", "reversed" or "none"
                       )->torch.Tensor:       # (n + 1 + q, n) bool: [j, k - 1] says whether target j sees transition k
    "Which transitions each target (S_0..S_n, then the queries) sees in a decoder whose prompt holds the trajectory in `order`."
    _choice(order, ORDERS, "order")
    if int(n) != n or n < 1 or int(q) != q or q < 0: raise ValueError(f"`n` must be a positive and `q` a non-negative integer, got n = {n}, q = {q}")
    j, k = torch.arange(n + 1 + q)[:, None], torch.arange(1, n + 1)[None]
    if order == "none": return torch.ones(n + 1 + q, n, dtype=torch.bool)
    return ((k <= j) if order == "forward" else (k >= j + 1)) | (j > n)

# %% [markdown]
# In forward order, $S_0$ sees nothing (its row is empty), $S_j$ sees $1..j$, and the queries see
# all. In reversed order it is the other way round, and $S_n$ sees nothing.

# %%
show_doc(visible_transitions)

# %%
test_eq(visible_transitions(3, 1).int().tolist(), [[0, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1]])
test_eq(visible_transitions(3, 1, "reversed").int().tolist(), [[1, 1, 1], [0, 1, 1], [0, 0, 1], [0, 0, 0], [1, 1, 1]])
test_eq(visible_transitions(3, 0, "none").all(), True)
test_fail(lambda: visible_transitions(3, order="backward"), contains="`order` must be one of")

# %%
#| export
def _positions(n:int, order:str, dtype, device=None)->torch.Tensor:
    "(n,) the prompt position p_k of transition k's token: k in forward order, n - k + 1 in reversed order."
    k = torch.arange(1, n + 1, dtype=dtype, device=device)
    return n + 1 - k if order == "reversed" else k

def prefix_weights(phi_states,         # (..., n + 1, d) features of S_0..S_n
                   W,                  # (d, d) or (..., d, d) score matrix, g(x, y) = phi(x)^T W phi(y)
                   phi_queries=None,   # (..., q, d), (..., d) or None
                   order:str="forward",# "forward", "reversed" or "none"
                   recency:float=0.,   # lambda: the positional bias lambda log p_k of transition k's logit
                  )->torch.Tensor:     # (..., n, m) K[..., k - 1, j]; a column sums to 1, or is 0 for a target that sees nothing
    "The softmax weights $K_{kj}$ of each target over the transitions it sees."
    keys, X, _ = context_tensors(phi_states, None, phi_queries)
    n, m, d = keys.shape[-2], X.shape[-2], keys.shape[-1]
    W = as_tensor(W, "W", keys.dtype, keys.device)
    if W.ndim < 2 or W.shape[-2:] != (d, d): raise ValueError(f"`W` must have shape ({d}, {d}) or (..., {d}, {d}), got {tuple(W.shape)}")
    seen = visible_transitions(n, m - n - 1, order).T.to(keys.device)
    G = keys @ W @ X.mT + float(recency) * _positions(n, order, keys.dtype, keys.device).log()[:, None]
    return torch.softmax(G.masked_fill(~seen, -math.inf), dim=-2).nan_to_num(0.)

# %%
show_doc(prefix_weights)

# %% [markdown]
# Each target's weights sum to one over what it sees and vanish elsewhere; without the mask they are
# those of [chapter 1](weighted_softmax_td.html); and a positional bias $\lambda \log p$ multiplies
# the kernel by $p^\lambda$.

# %%
mrp = random_boyan_chain(seed=0)
st, rw = sample_trajectory(mrp, 12, seed=0)
phi, W2 = mrp.phi[st], 2 * torch.eye(4, dtype=torch.float64)
K = prefix_weights(phi, W2, mrp.phi)
test_close(K.sum(0), torch.cat([torch.zeros(1), torch.ones(12 + 10)]).double(), eps=1e-14)
test_eq((K != 0), visible_transitions(12, 10).T)
from ictd.wstd import context_weights
test_close(prefix_weights(phi, W2, mrp.phi, order="none"), context_weights(phi, W2, mrp.phi), eps=1e-14)
kernel = torch.exp(phi[:-1] @ W2 @ mrp.phi[3]) * torch.arange(1., 13, dtype=torch.float64) ** 1.5
test_close(prefix_weights(phi, W2, mrp.phi, recency=1.5)[:, 13 + 3], kernel / kernel.sum(), eps=1e-14)

# %%
#| export
def prefix_softmax_td(phi_states,          # (..., n + 1, d) features of S_0..S_n
                      rewards,             # (..., n) rewards, rewards[..., k - 1] = R_k
                      W,                   # (d, d) or (..., d, d) score matrix
                      alpha:float,         # step size
                      gamma:float,         # discount factor in [0, 1)
                      n_iters:int,         # number of iterations (layers)
                      phi_queries=None,    # (..., q, d) query features, (..., d) for one query, or None
                      current:str="key",   # "key": delta_k reads v[k - 1] (TD); "self": it reads the target's own v[j]
                      order:str="forward", # "forward", "reversed" or "none" (no mask: weighted softmax TD)
                      recency:float=0.,    # lambda of the positional bias lambda log p_k
                      return_all:bool=False, # return every iterate v_0..v_T
                     )->torch.Tensor:      # (..., m) values at S_0..S_n then the queries; (..., n_iters + 1, m) with `return_all`
    "Prefix weighted softmax TD: every target updates with the softmax-weighted TD errors of the transitions it sees."
    keys, X, R = context_tensors(phi_states, rewards, phi_queries)
    alpha, gamma, n_iters = float(alpha), check_gamma(gamma), int(n_iters)
    if not math.isfinite(alpha): raise ValueError(f"`alpha` must be finite, got {alpha}")
    if n_iters < 0: raise ValueError(f"`n_iters` must be a non-negative integer, got {n_iters}")
    _choice(current, CURRENTS, "current")
    K = alpha * prefix_weights(phi_states, W, phi_queries, order, recency)
    K = K.expand(torch.broadcast_shapes(R.shape[:-1], K.shape[:-2]) + K.shape[-2:])
    n, anchor = R.shape[-1], K.sum(-2)                  # anchor[j] = alpha, or 0 where target j sees nothing
    v = X.new_zeros(K.shape[:-2] + K.shape[-1:])
    vs = [v]
    for _ in range(n_iters):
        if current == "key": v = v + ((R + gamma * v[..., 1:n + 1] - v[..., :n]).unsqueeze(-2) @ K).squeeze(-2)
        else: v = v + ((R + gamma * v[..., 1:n + 1]).unsqueeze(-2) @ K).squeeze(-2) - anchor * v
        vs.append(v)
    return torch.stack(vs, -2) if return_all else v

# %%
show_doc(prefix_softmax_td)

# %% [markdown]
# Checks: with no mask it *is* weighted softmax TD, batched or not; in forward order $v[0]$ never
# moves (the first token has seen no transition); and target $j$'s values do not change when
# the transitions after $j$ are changed (the reference is causal).

# %%
tasks_r = random_tasks(8, seed=3)
S_r = sample_trajectories(tasks_r.P, 20, tasks_r.d_pi, seed=3)
rows_r = torch.arange(8)[:, None]
phi_r, R_r = tasks_r.phi[rows_r, S_r], tasks_r.r[rows_r, S_r[:, :-1]]
test_close(prefix_softmax_td(phi_r, R_r, W2, 0.7, 0.9, 15, tasks_r.phi, order="none"),
           weighted_softmax_td(phi_r, R_r, W2, 0.7, 0.9, 15, tasks_r.phi), eps=1e-12)
v_r = prefix_softmax_td(phi_r, R_r, W2, 0.7, 0.9, 15, tasks_r.phi, return_all=True)
test_eq(v_r[..., 0].abs().max().item(), 0.)
R_late = R_r.clone(); R_late[:, 12:] += 5.
phi_late = phi_r.clone(); phi_late[:, 13:] *= -1
for cur in CURRENTS:
    a = prefix_softmax_td(phi_r, R_r, W2, 0.7, 0.9, 15, current=cur)
    b = prefix_softmax_td(phi_late, R_late, W2, 0.7, 0.9, 15, current=cur)
    test_eq(a[:, :13], b[:, :13])
    assert (a[:, 13:] - b[:, 13:]).abs().max() > 0.1
test_fail(lambda: prefix_softmax_td(phi_r, R_r, W2, 0.7, 0.9, 3, current="target"), contains="`current` must be one of")
# %% [markdown]
# ## The causal prompt
#
# A decoder's tokens must not change once written: when transition $n + 1$ arrives, the model
# appends a token and keeps the cached keys and values of the others. The prompt of
# [chapter 2](prompt.html) stores $R_{k}$ in the column of $S_{k-1}$, the token *before* the one
# that completes transition $k$. That is harmless for a non-causal model, but a decoder reading it
# would have to write $R_{n+1}$ into the old token of $S_n$. So the causal prompt has the same
# rows and the same arguments, and moves each reward one column right, into the token that
# completes its transition: column $k$ holds $(\phi(S_k), R_k, 0)$, column 0 holds $(\phi(S_0), 0, 0)$,
# and the queries stay last. This is the only difference. With `order="reversed"` the trajectory
# is written backwards, $S_n$ first: position $p$ holds $S_{n-p}$ with the reward $R_{n-p+1}$ of the
# transition that leaves it.

# %%
#| export
def build_causal_prompt(phi_states,          # (..., n + 1, d) features of S_0..S_n (n >= 1)
                        rewards,             # (..., n) rewards, rewards[..., k - 1] = R_k
                        phi_queries=None,    # (..., q, d), (..., d) or None
                        order:str="forward", # "forward": S_0..S_n; "reversed": S_n..S_0; the queries last in both
                       )->torch.Tensor:      # (..., d + 2, n + 1 + q), carrying n as `Z.n_context`
    "The prompt of a decoder: each reward in the token that completes its transition, the queries last."
    _choice(order, ("forward", "reversed"), "order")
    Z = build_prompt(phi_states, rewards, phi_queries)
    n, d = Z.n_context, Z.shape[-2] - 2
    out = Z.clone()
    if order == "forward":
        out[..., d, 0] = 0.
        out[..., d, 1:n + 1] = Z[..., d, :n]
    else: out[..., :, :n + 1] = Z[..., :, :n + 1].flip(-1)
    out.n_context = n
    return out

# %%
show_doc(build_causal_prompt)

# %%
Zc = build_causal_prompt(phi[:4], rw[:3], mrp.phi[7])
test_eq(Zc.shape, (6, 5)); test_eq(Zc.n_context, 3)
test_eq(Zc[4].tolist(), [0.] + rw[:3].tolist() + [0.])
test_eq(Zc[:4, :4], phi[:4].T); test_eq(Zc[:4, 4], mrp.phi[7]); test_eq(Zc[5].abs().sum().item(), 0.)
Zr = build_causal_prompt(phi[:4], rw[:3], mrp.phi[7], order="reversed")
test_eq(Zr[:4, :4], phi[:4].flip(0).T); test_eq(Zr[4].tolist(), [0.] + rw[:3].flip(0).tolist() + [0.])
test_fail(lambda: build_causal_prompt(phi[:4], rw[:2]), contains="`rewards` must have shape")

# %% [markdown]
# ## The causal layer
#
# A decoder layer at column $j$ can read columns $i \le j$. Transition $k$ is complete at column
# $k$ (forward order): its current state is in the *previous* token $k - 1$, its reward and
# successor in token $k$. So the key and value of transition $k$ need two adjacent tokens, which is
# what a causal temporal shift provides, the causal version of [chapter 4](tsm.html)'s: it appends
# to each column the previous column,
#
# $$\overleftarrow{\mathrm{TSM}}(Z) = \begin{pmatrix} Z \\ Z \Pi^\top \end{pmatrix}, \qquad (Z\Pi^\top)[:, i] = Z[:, i - 1] \ (i \ge 1), \quad 0 \ (i = 0).$$
#
# (In trained language models this is the job of "previous-token heads".) One softmax head then
# reads keys and values from $T = \overleftarrow{\mathrm{TSM}}(Z)$ and queries from $Z$:
#
# $$Z_{l+1} = Z_l + V\, T_l\, S_l + U Z_l, \qquad S_l[i, j] = \operatorname{softmax}_{i \in \mathcal K(j)}\big(T_l[:, i]^\top A\, Z_l[:, j] + \lambda \log i\big),$$
#
# with $A$ of shape $(2(d+2), d+2)$, $V$ of shape $(d+2, 2(d+2))$, a per-token map $U$ (the linear
# part of the residual block, zero in the TD construction) and the positional bias $\lambda$. The
# keys of column $j$ are $\mathcal K(j) = \{1, \dots, \min(j, n)\}$: causal ($i \le j$), never column 0
# (it completes no transition), never a query column (a query is not a transition; as in
# [chapter 3](dual_head.html) the model reads $n$ from the prompt). A column with no key (column 0) adds nothing.

# %%
#| export
def previous_token(Z:torch.Tensor)->torch.Tensor:  # (..., D, N) -> (..., D, N): column i holds column i - 1 of Z, column 0 is zero
    "The causal shift $Z\\Pi^\\top$: each column receives the previous one."
    out = torch.zeros_like(Z)
    out[..., 1:] = Z[..., :-1]
    return out

def causal_keys(N:int,          # number of columns
                n:int,          # number of context transitions
                device=None,
               )->torch.Tensor: # (N, N) bool: [i, j] says whether column j attends to column i
    "The key set of each column of a decoder: $1 \\le i \\le \\min(j, n)$."
    i, j = torch.arange(N, device=device)[:, None], torch.arange(N, device=device)[None]
    return (i >= 1) & (i <= n) & (i <= j)

# %%
test_eq(previous_token(torch.arange(6.).reshape(2, 3)).tolist(), [[0., 0., 1.], [0., 3., 4.]])
test_eq(causal_keys(5, 3).int().tolist(), [[0, 0, 0, 0, 0], [0, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 0, 0, 1, 1], [0, 0, 0, 0, 0]])

# %%
#| export
def causal_attention(Z, A, lam, n:int)->torch.Tensor:
    "(..., N, N) S[i, j]: softmax over the keys of column j of $T_i^\\top A Z_j + \\lambda \\log i$ (zero columns where there is no key)."
    N = Z.shape[-1]
    pos = torch.arange(N, dtype=Z.dtype, device=Z.device).clamp(min=1).log()
    logits = torch.cat([Z, previous_token(Z)], -2).mT @ A @ Z + torch.as_tensor(lam, dtype=Z.dtype, device=Z.device)[..., None, None] * pos[:, None]
    return torch.softmax(logits.masked_fill(~causal_keys(N, n, Z.device), -math.inf), dim=-2).nan_to_num(0.)

def causal_update(Z:torch.Tensor,    # (..., D, N) prompt
                  A:torch.Tensor,    # (..., 2D, D) score matrix on (shifted tokens, tokens)
                  V:torch.Tensor,    # (..., D, 2D) value matrix on the shifted tokens
                  U:torch.Tensor,    # (..., D, D) per-token map
                  lam,               # (...) positional bias
                  n:int,             # number of context transitions
                 )->torch.Tensor:    # (..., D, N) next prompt
    "One causal layer, $Z + V\\,\\overleftarrow{\\mathrm{TSM}}(Z)\\, S + U Z$, unvalidated."
    return Z + V @ torch.cat([Z, previous_token(Z)], -2) @ causal_attention(Z, A, lam, n) + U @ Z

# %% [markdown]
# The parameters that make one layer one step of prefix softmax TD, in forward order with
# $D = d + 2$ and rows of $T$ numbered $0..D-1$ (the token) and $D..2D-1$ (the previous token):
#
# - $A[D : D + d, 0 : d] = W$: the score of key $k$ for column $j$ is $\phi(S_{k-1})^\top W \phi(x_j)$;
# - value row $d + 1$: $V[d+1, d] = \alpha$ (reward $R_k$, in the token), $V[d+1, d+1] = \gamma\alpha$ (successor
#   value $v[k]$, in the token), $V[d+1, D + d + 1] = -\alpha$ (current value $v[k-1]$, in the previous token);
# - $U = 0$ and $\lambda$ as chosen.
#
# For `current="self"` the $-\alpha$ moves from $V$ to $U[d+1, d+1]$; for `order="reversed"` the roles
# of the token and the previous one swap for the features and the values (the token holds the
# transition's current state and reward, the previous token its successor).

# %%
#| export
def theta_causal(d:int,              # feature dimension
                 W,                  # (d, d) score matrix
                 alpha:float,        # step size
                 gamma:float,        # discount factor in [0, 1)
                 current:str="key",  # "key" or "self" (see `prefix_softmax_td`)
                 order:str="forward",# "forward" or "reversed": the layout of `build_causal_prompt`
                )->tuple:            # (A (2D, D), V (D, 2D), U (D, D)), D = d + 2, in the dtype of `W`
    "Parameters under which each causal layer is one step of prefix weighted softmax TD."
    D, W, gamma = _token_rows(d), as_tensor(W, "W"), check_gamma(gamma)
    _choice(current, CURRENTS, "current"); _choice(order, ("forward", "reversed"), "order")
    if W.shape != (D - 2, D - 2): raise ValueError(f"`W` must have shape ({D - 2}, {D - 2}), got {tuple(W.shape)}")
    alpha, d = float(alpha), D - 2
    if not math.isfinite(alpha): raise ValueError(f"`alpha` must be finite, got {alpha}")
    A, V, U = W.new_zeros(2 * D, D), W.new_zeros(D, 2 * D), W.new_zeros(D, D)
    key, succ, cur = (D, 0, D) if order == "forward" else (0, D, 0)     # where each quantity sits: the token (0) or the previous one (D)
    A[key:key + d, :d] = W
    V[d + 1, d], V[d + 1, succ + d + 1] = alpha, gamma * alpha
    if current == "key": V[d + 1, cur + d + 1] = -alpha
    else: U[d + 1, d + 1] = -alpha
    return A, V, U

# %%
show_doc(theta_causal)

# %%
#| export
class CausalSoftmaxLayer(nn.Module):
    "One decoder layer: a softmax head over the causal temporal shift of its input, a per-token map, a positional bias."
    def __init__(self, d:int,            # feature dimension; tokens have d + 2 rows
                 init_gain:float=0.1,    # gain of the Xavier-normal initialisation
                 seed=None,              # int or `torch.Generator`
                 dtype=torch.float64,    # dtype of the parameters
                ):
        super().__init__()
        D, g = _token_rows(d), _generator(seed)
        self.d = D - 2
        self.A, self.V, self.U = _xavier(2 * D, D, init_gain, g, dtype), _xavier(D, 2 * D, init_gain, g, dtype), _xavier(D, D, init_gain, g, dtype)
        self.lam = nn.Parameter(torch.zeros((), dtype=dtype))

    @classmethod
    def from_params(cls, A, V, U, lam=0.):
        "A layer with the given matrices (copied) and positional bias."
        A = as_tensor(A, "A")
        if A.ndim != 2 or A.shape[1] < 3 or A.shape[0] != 2 * A.shape[1]: raise ValueError(f"`A` must have shape (2(d + 2), d + 2) with d >= 1, got {tuple(A.shape)}")
        D = A.shape[1]
        layer = cls(D - 2, seed=0, dtype=A.dtype)
        for name, t, shape in (("A", A, (2 * D, D)), ("V", V, (D, 2 * D)), ("U", U, (D, D)), ("lam", lam, ())):
            t = as_tensor(t, name, A.dtype)
            if t.shape != shape: raise ValueError(f"`{name}` must have shape {shape}, got {tuple(t.shape)}")
            setattr(layer, name, nn.Parameter(t.detach().clone()))
        return layer

    def params(self, like:torch.Tensor)->tuple:
        "(A, V, U, lam) cast to the dtype and device of `like`."
        return tuple(p.to(like) for p in (self.A, self.V, self.U, self.lam))

    def attention(self, Z, n=None)->torch.Tensor:
        "The (..., N, N) attention of this layer on prompt `Z`."
        Z, n = check_prompt(Z, self.d, n)
        A, _, _, lam = self.params(Z)
        return causal_attention(Z, A, lam, n)

    def forward(self, Z, n=None)->torch.Tensor:
        "One causal layer on prompt `Z` (n read from `Z.n_context` by default)."
        Z, n = check_prompt(Z, self.d, n)
        return _carry(causal_update(Z, *self.params(Z), n), n)

    def value_weights(self)->torch.Tensor:
        "(reward, successor value, current value in the previous token, current value of the column itself), forward layout, detached."
        d, D = self.d, self.d + 2
        return torch.stack([self.V[d + 1, d], self.V[d + 1, d + 1], self.V[d + 1, D + d + 1], self.U[d + 1, d + 1]]).detach()

# %%
#| export
class CausalSoftmaxICTD(nn.Module):
    "A decoder-only stack of causal softmax layers reading values from the last row of its prompt."
    def __init__(self, d:int, n_layers:int, shared:bool=False, init_gain:float=0.1, seed=None, dtype=torch.float64):
        super().__init__()
        if int(n_layers) != n_layers or n_layers < 1: raise ValueError(f"`n_layers` must be a positive integer, got {n_layers}")
        g = _generator(seed)
        self.d, self.n_layers, self.shared = int(d), int(n_layers), bool(shared)
        self.layers = nn.ModuleList(CausalSoftmaxLayer(d, init_gain, g, dtype) for _ in range(1 if shared else n_layers))

    def layer(self, l:int)->CausalSoftmaxLayer:
        "The module applied at depth `l`."
        return self.layers[0 if self.shared else l]

    @classmethod
    def from_params(cls, n_layers:int, A, V, U, lam=0., shared:bool=False):
        "The model whose every layer carries (A, V, U, lam) (copied)."
        first = CausalSoftmaxLayer.from_params(A, V, U, lam)
        model = cls(first.d, n_layers, shared, seed=0, dtype=first.A.dtype)
        model.layers = nn.ModuleList([first] + [CausalSoftmaxLayer.from_params(A, V, U, lam) for _ in model.layers[1:]])
        return model

    @classmethod
    def from_theta_star(cls, d:int, n_layers:int, W, alpha:float, gamma:float,
                        current:str="key",    # "key": theta* under a causal mask (TD); "self": the contracting variant
                        order:str="forward",  # the layout of the prompts it will read
                        recency:float=0.,     # positional bias lambda
                        shared:bool=False):
        "The model whose every layer is one step of prefix softmax TD (`theta_causal`)."
        return cls.from_params(n_layers, *theta_causal(d, W, alpha, gamma, current, order), recency, shared=shared)

    def forward(self, Z, n=None, return_all:bool=False)->torch.Tensor:
        "Z_L (..., d + 2, N), or Z_0..Z_L stacked (..., L + 1, d + 2, N)."
        Z, n = check_prompt(Z, self.d, n)
        Zs = [Z]
        for l in range(self.n_layers): Zs.append(causal_update(Zs[-1], *self.layer(l).params(Z), n))
        return _carry(torch.stack(Zs, -3) if return_all else Zs[-1], n)

    def predict(self, Z, n=None)->torch.Tensor:
        "(..., q) the values at the query columns (row d + 1 of Z_L)."
        Z, n = check_prompt(Z, self.d, n)
        return self.forward(Z, n)[..., self.d + 1, n + 1:]

    def value_weights(self)->torch.Tensor:
        "(L, 4) (reward, successor, current in the previous token, current of the column) per layer."
        return torch.stack([self.layer(l).value_weights() for l in range(self.n_layers)])

# %%
show_doc(CausalSoftmaxICTD.from_theta_star)

# %% [markdown]
# ::: {.theorem}
# **Theorem 4a.1 (ours).** On `build_causal_prompt(phi_states, rewards, phi_queries, order)`, the
# model `CausalSoftmaxICTD.from_theta_star(d, L, W, alpha, gamma, current, order, recency)` holds in
# row $d + 1$ after layer $l$ the iterate $v_l$ of `prefix_softmax_td` with the same arguments, at
# every column (column $j$ holds $v_l[j]$ in forward order, $v_l[n - j]$ in reversed order; the
# queries last), for every $l$.
# :::
#
# *Proof* (forward order; reversed is the same with the roles of the two tokens swapped). By
# induction on $l$; $Z_0$'s row $d + 1$ is $0 = v_0$. The only non-zero rows of $V$ and $U$ are row
# $d + 1$, so rows $0..d$ never change and $Z_l[:d, j] = \phi(x_j)$ at every layer. Hence the
# logit of key $i$ for column $j$ is $T_l[:, i]^\top A Z_l[:, j] + \lambda \log i = \phi(S_{i-1})^\top W \phi(x_j) + \lambda\log i$ (the previous
# token of column $i \ge 1$ holds $S_{i-1}$), and the keys of column $j$ are exactly the transitions
# it sees: $1..\min(j, n)$, that is $\mathcal V(j)$, with $p_k = k$. So $S_l[k, j] = K_{kj}$. The value
# of key $k$ is row $d + 1$ of $V T_l[:, k] = \alpha R_k + \gamma\alpha\, v_l[k] - \alpha\, v_l[k-1] = \alpha\delta_k^{(l)}$
# (reward and value of token $k$, value of token $k - 1$), so row $d + 1$ of column $j$ becomes
# $v_l[j] + \alpha\sum_k K_{kj}\delta^{(l)}_k = v_{l+1}[j]$. For `current="self"` the value of key $k$ is
# $\alpha(R_k + \gamma v_l[k])$ and $U Z_l$ adds $-\alpha v_l[j]$ at every column that has a key; a column
# without keys (column 0) has a zero attention column and its own $U$ term: there, $v_l[0] = 0$
# is kept by induction. $\square$
#
# The check: 40 random instances (random $W$, features, rewards, queries, $\alpha$, $\gamma$, $\lambda$,
# every order and both currents), 6 layers each, against the reference in float64.

# %%
def random_instance(seed):
    "A random context, queries and parameters, all drawn from one seed."
    g = torch.Generator().manual_seed(seed)
    n, d, q = (int(x) for x in torch.randint(1, 9, (3,), generator=g))
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    return dict(phi_states=r(n + 1, d), rewards=r(n), phi_queries=r(q, d), W=r(d, d), alpha=float(torch.rand(1, generator=g)) + 0.2,
                gamma=float(torch.rand(1, generator=g)) * 0.99, recency=float(r(1)))

def model_values(inst, current, order, L):
    "Row d + 1 of Z_1..Z_L of the causal construction, reordered as the reference orders its targets."
    d, n = inst["W"].shape[0], inst["rewards"].shape[0]
    Z = build_causal_prompt(inst["phi_states"], inst["rewards"], inst["phi_queries"], order)
    model = CausalSoftmaxICTD.from_theta_star(d, L, inst["W"], inst["alpha"], inst["gamma"], current, order, inst["recency"])
    v = model(Z, return_all=True)[1:, d + 1]
    return torch.cat([v[:, :n + 1] if order == "forward" else v[:, :n + 1].flip(-1), v[:, n + 1:]], -1)

worst = 0.
for seed in range(40):
    inst = random_instance(seed)
    for order in ("forward", "reversed"):
        for current in CURRENTS:
            ref = prefix_softmax_td(inst["phi_states"], inst["rewards"], inst["W"], inst["alpha"], inst["gamma"], 6, inst["phi_queries"],
                                    current, order, inst["recency"], return_all=True)[1:]
            worst = max(worst, ((model_values(inst, current, order, 6) - ref).abs() / ref.abs().clamp(min=1)).max().item())
assert worst < 1e-12
print(f"largest difference to the reference (relative where |v| > 1) over 40 instances x 4 variants x 6 layers: {worst:.1e}")

# %% [markdown]
# Causality is a property of the module, whatever its parameters: an output column never depends
# on a later column. The check uses random parameters (not the construction): it changes every
# column after $j$ (features, rewards and the value slot, and the query) and requires columns
# $0..j$ of every layer's output to be *exactly* equal.

# %%
model_rand = CausalSoftmaxICTD(4, 3, seed=1, init_gain=1.).requires_grad_(False)
model_rand.layer(1).lam.fill_(0.7)
g = torch.Generator().manual_seed(2)
Z_a = torch.randn(5, 6, 16, generator=g, dtype=torch.float64)
for j in range(16):
    Z_b = Z_a.clone(); Z_b[..., j + 1:] = torch.randn(5, 6, 15 - j, generator=g, dtype=torch.float64)
    out_a, out_b = model_rand(Z_a, n=13, return_all=True), model_rand(Z_b, n=13, return_all=True)
    test_eq(out_a[..., :j + 1], out_b[..., :j + 1])
    if j < 15: assert (out_a[..., j + 1:] - out_b[..., j + 1:]).abs().max() > 1e-3
print("columns 0..j of every layer unchanged when columns j+1.. change, for every j")

# %%
#| hide
import nbdev; nbdev.nbdev_export()
