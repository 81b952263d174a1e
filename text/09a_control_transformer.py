# %%
#| default_exp control_model

# %%
#| export
from __future__ import annotations
import math
from dataclasses import dataclass
import torch
from torch import nn
from ictd.boyan import as_tensor, check_gamma
from ictd.core import (check_bool, check_floating, check_int, check_number, check_type, check_work,
                       chunk_rows, memory_path)
from ictd.model import token_rows, torch_generator, xavier_param, _old_theta_star_call
from ictd.boyan import moved_to_keywords, reordered_positionals
from ictd.control import _check_beta

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *

# %%
#| hide
import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown
import json, re
from pathlib import Path
from ictd.core import record_claim, OKABE_ITO, plain_log_ticks, provenance_note
from ictd.control import (random_mdp, sample_mdp_trajectory, context_features, kernel_q_iteration,
                          boltzmann_backup)
from ictd.linear import linear_attention


# %% [markdown]
# # The Transformer that runs in-context Q-learning
# > A softmax Transformer whose every pair of layers is one iteration of kernel soft Q-iteration: the prompt, a backup head whose scores read the value row, the theorem and its check, what routing the backup costs, and why no linear-attention layer can take the max.

# %% [markdown]
# ::: {.callout-tip title="What this page shows"}
# - A prompt with one column per transition and a block of $A$ columns per successor or query state.
# - A **backup head** [ours] whose scores read the value row, returning the Boltzmann backup.
# - Theorem 9a.1: with the constructed parameters every *pair* of layers is one iteration of kernel
#   soft Q-iteration (checked to $10^{-12}$); Proposition 9a.2: no linear-attention layer takes the max.
# :::
#
# [Chapter 3](dual_head.html) built a layer whose attention is the TD kernel and whose two value heads
# form the TD error $R + \gamma v(S') - v(S)$, the successor's value reaching its predecessor through
# a shift of the token axis. For Q-learning the successor's value is $\max_{a'} Q(S', a')$, a
# *nonlinear* function of $A$ numbers held in $A$ different columns. A softmax head can compute it: if
# its score for a key is $\beta$ times the key's value, the head's weights over the $A$ columns of a
# state are $\mathrm{softmax}(\beta Q)$, and its output is the Boltzmann backup. The construction,
# the theorem and the proofs on this page are the book's own; neither the paper nor its anchors
# contain them.
#
# *How to read this page.* The prompt; the two layers and their parameters; Theorem 9a.1 and its
# check; how the backup head finds a successor's columns, and the price of doing it by scores instead
# of a mask; the linear-attention impossibility. Helpers, most of the API and bulk tests are in
# [Implementation and tests](#implementation-and-tests).

# %% [markdown]
# ## The prompt
#
# Take a context of $n$ transitions $(S_{k-1}, A_{k-1}, R_k, S_k)$ and $q$ query states. Tokens have
# $d + 4$ rows: the features $\phi$ (rows $0..d-1$), the reward (row $d$), the **value** memory
# (row $d+1$, $Q_0 = 0$), the **backup** memory (row $d+2$, zero at first) and a constant 1
# (row $d+3$, which lets a bilinear score read the value row). The $N = n + (n + q)A$ columns are:
#
# | columns | what they stand for | features | reward | value, backup, one |
# |---|---|---|---|---|
# | $j = 0..n-1$ (context) | pair $(S_j, A_j)$ of transition $j + 1$ | $\phi(S_j, A_j)$ | $R_{j+1}$ | 0, 0, 1 |
# | block $b = 0..n-1$, column $n + bA + a$ | successor $S_{b+1}$ with action $a$ | $\phi(S_{b+1}, a)$ | 0 | 0, 0, 1 |
# | block $b = n..n+q-1$, column $n + bA + a$ | query state $s_{b-n}$ with action $a$ | $\phi(s_{b-n}, a)$ | 0 | 0, 0, 1 |
#
# Each column is **assigned a block**: context column $j$ is assigned block $j$ (its successor's), and
# a column of a block is assigned its own block. The backup head of each column attends only to its
# assigned block; the TD head of every column attends only to the $n$ context columns, as in
# chapter 3. Both restrictions are additive $0 / -\infty$ masks on the logits.

# %%
#| export
@dataclass(eq=False)
class ControlPrompt:
    "The tokens of a control prompt and its layout: n context columns, then n + q blocks of A."
    Z:torch.Tensor  # (..., d + 4, n + (n + q) A) tokens as columns
    n:int           # number of context transitions
    n_actions:int   # A, the columns of one block
    q:int           # number of query blocks (the last q blocks)

    def __post_init__(self):
        self.Z = check_floating(self.Z, "Z")
        self.n, self.n_actions = check_int(self.n, "n", 1), check_int(self.n_actions, "n_actions", 1)
        self.q = check_int(self.q, "q")
        N = self.n + (self.n + self.q) * self.n_actions
        if self.Z.ndim < 2 or self.Z.shape[-2] < 5 or self.Z.shape[-1] != N:
            raise ValueError(f"`Z` must have shape (..., d + 4, {N}) with d >= 1 (N = n + (n + q) A "
                             f"for n = {self.n}, A = {self.n_actions}, q = {self.q}), "
                             f"got {tuple(self.Z.shape)}")

    def to(self, *args, **kwargs)->ControlPrompt:
        "The prompt with `Z.to(*args, **kwargs)` (a device, a floating dtype, or both) and the same layout."
        return ControlPrompt(self.Z.to(*args, **kwargs), self.n, self.n_actions, self.q)
    def double(self)->ControlPrompt: return self.to(torch.float64)
    def float(self)->ControlPrompt: return self.to(torch.float32)

    @classmethod
    def stack(cls, prompts, dim:int=0)->ControlPrompt:
        "Prompts of one layout stacked along a new batch axis `dim`."
        prompts = list(prompts)
        if not prompts or not all(isinstance(p, ControlPrompt) for p in prompts): raise TypeError("`prompts` must be a non-empty list of ControlPrompt")
        if len({(p.n, p.n_actions, p.q) for p in prompts}) > 1: raise ValueError("`prompts` must share one layout (n, n_actions, q)")
        if isinstance(dim, bool) or not isinstance(dim, int) or not 0 <= dim <= prompts[0].Z.ndim - 2:
            raise ValueError(f"`dim` must be a batch axis in 0..{prompts[0].Z.ndim - 2}, got {dim!r}")
        return ControlPrompt(torch.stack([p.Z for p in prompts], dim), prompts[0].n, prompts[0].n_actions, prompts[0].q)

def build_control_prompt(phi_sa,            # (..., n, d) features of the pairs (S_{k-1}, A_{k-1})
                         rewards,           # (..., n) rewards, rewards[..., k-1] = R_k
                         phi_next,          # (..., n, A, d) each successor with every action
                         phi_queries=None,  # (..., q, A, d) query states with every action
                        )->ControlPrompt:
    "The control prompt: features, reward, value and backup memories and a constant row (table)."
    keys = as_tensor(phi_sa, "phi_sa", torch.float64)
    R = as_tensor(rewards, "rewards", torch.float64)
    nxt = as_tensor(phi_next, "phi_next", torch.float64)
    if keys.ndim < 2 or nxt.ndim < 3 or nxt.shape[-3] != keys.shape[-2] \
            or nxt.shape[-1] != keys.shape[-1]:
        raise ValueError(f"`phi_next` must have shape (..., n, A, d) to match `phi_sa` "
                         f"{tuple(keys.shape)}, "
                         f"got {tuple(nxt.shape)}")
    n, d, A = keys.shape[-2], keys.shape[-1], nxt.shape[-2]
    if R.shape[-1:] != (n,):
        raise ValueError(f"`rewards` must have shape (..., {n}), got {tuple(R.shape)}")
    Qf = nxt[..., :0, :, :] if phi_queries is None \
        else as_tensor(phi_queries, "phi_queries", torch.float64)
    if Qf.ndim < 3 or Qf.shape[-2:] != (A, d):
        raise ValueError(f"`phi_queries` must have shape (..., q, {A}, {d}), got {tuple(Qf.shape)}")
    batch = torch.broadcast_shapes(keys.shape[:-2], R.shape[:-1], nxt.shape[:-3], Qf.shape[:-3])
    q = Qf.shape[-3]
    feats = torch.cat([keys.expand(batch + (n, d)),
                       nxt.expand(batch + nxt.shape[-3:]).flatten(-3, -2),
                       Qf.expand(batch + Qf.shape[-3:]).flatten(-3, -2)], -2)
    Z = feats.new_zeros(batch + (d + 4, feats.shape[-2]))
    Z[..., :d, :] = feats.mT
    Z[..., d, :n] = R.expand(batch + (n,))
    Z[..., d + 3, :] = 1.
    return ControlPrompt(Z, n, A, q)


# %% [markdown]
# A small prompt: $n = 3$ transitions of a two-action MDP with one-hot features ($d = SA = 6$) and one
# query state. Its $3 + (3 + 1) \cdot 2 = 11$ columns, and the block each column is assigned:

# %%
tiny = random_mdp(3, 2, seed=0)
S_t, A_t, R_t = sample_mdp_trajectory(tiny, 3, seed=0)
ft_sa, ft_next = context_features(tiny, S_t, A_t)
x_tiny = build_control_prompt(ft_sa, R_t, ft_next, tiny.phi[[0]])
test_eq(x_tiny.Z.shape, (6 + 4, 3 + 4 * 2))
test_eq(x_tiny.Z[6, :3], R_t); test_eq(x_tiny.Z[9], torch.ones(11, dtype=torch.float64))
test_eq(x_tiny.Z[:6, 3:9].T, ft_next.flatten(0, 1))


# %% [markdown]
# ## The two layers
#
# **The backup layer** has one head. Its logits are $z_i^\top A_b z_j$ plus the block mask, and with
# $A_b = \beta\, e_{d+1} e_{d+3}^\top$ the logit of key $i$ is $\beta\, Q(i) \cdot 1$: the key's value.
# Its value matrix $V_b = e_{d+2}(e_{d+1} - e_{d+2})^\top$ reads (value $-$ backup) of the key and
# writes the backup row:
#
# $$Z \leftarrow Z + V_b Z S_b, \qquad S_b[i, j] = \mathrm{softmax}_i\big(z_i^\top A_b z_j + \omega^b_{ij}\big),$$
#
# $$\omega^b_{ij} = \begin{cases} 0 & i \text{ in the block assigned to } j\\ -\infty & \text{otherwise.}\end{cases}$$
#
# For $\beta = \infty$ the head is the limit of its softmax: uniform over the keys of largest logit.
#
# **The TD layer** is chapter 3's dual-head layer with one change: the target head reads the backup
# row of the key *itself*, where the backup layer has put the successor's backup, instead of the
# successor's value through the shift $\Pi$. With $A = \begin{pmatrix} W & 0 \\ 0 & 0\end{pmatrix}$,
# $V^{\mathrm{cur}} = \alpha\, e_{d+1}(e_d - e_{d+1})^\top$ and $V^{\mathrm{tgt}} = \gamma\alpha\, e_{d+1} e_{d+2}^\top$:
#
# $$Z \leftarrow Z + (V^{\mathrm{cur}} + V^{\mathrm{tgt}}) Z S, \qquad
# S[i, j] = \mathrm{softmax}_i\big(z_i^\top A z_j + \omega_{i}\big),$$
#
# $$\omega_i = 0 \text{ for } i < n, \qquad \omega_i = -\infty \text{ otherwise.}$$
#
# The value-update weights on (reward, successor backup, current value) are $(+\alpha, +\gamma\alpha, -\alpha)$,
# the $(+, +, -)$ pattern of chapter 3. Why two layers and not three heads in one: the heads of one
# layer read the same input, and the TD step needs the backup of the *current* values, which is
# itself the output of an attention over them. In one layer the TD heads would read the backup
# of the previous iterate (a lagged iteration, which is a different algorithm).

# %%
#| export
def _layout(n, n_actions, q)->tuple:
    "(n, A, q, N) as ints, or a `ValueError` naming the one that is not a count."
    n, A, q = check_int(n, "n", 1), check_int(n_actions, "n_actions", 1), check_int(q, "q")
    return n, A, q, n + (n + q) * A

def control_masks(n:int,          # number of context transitions
                  n_actions:int,  # A
                  q:int,          # number of query blocks
                 )->tuple:        # (TD mask, backup mask): (N, N) of 0 / -inf, [key i, column j]
    "The masks of the TD head (keys: the context) and the backup head (keys: the assigned block)."
    n, n_actions, q, N = _layout(n, n_actions, q)
    check_work(2 * N * N * 8, "bytes", f"the two {N} x {N} masks (n = {n}, A = {n_actions}, q = {q})",
               "use `streamed_pair_update` (or `ControlICTD` with method='streamed'), which needs none")
    col = torch.arange(N)
    assigned = torch.where(col < n, col, (col - n) // n_actions)     # the block a column attends to
    key_block = torch.where(col < n, -1, (col - n) // n_actions)     # the block a column belongs to
    inf = torch.tensor(-math.inf, dtype=torch.float64)
    td = torch.where((col < n)[:, None].expand(N, N), torch.tensor(0., dtype=torch.float64), inf)
    zero = torch.tensor(0., dtype=torch.float64)
    backup = torch.where(key_block[:, None] == assigned[None, :], zero, inf)
    return td, backup

def _weights(logits:torch.Tensor, dim:int, hard:bool)->torch.Tensor:
    "Softmax of `logits` over `dim`, or its limit when `hard`: uniform over the largest."
    if not hard: return torch.softmax(logits, dim=dim)
    top = (logits == logits.amax(dim, keepdim=True)).to(logits.dtype)
    return top / top.sum(dim, keepdim=True)

def masked_attention(Z:torch.Tensor,     # (..., D, N) tokens
                     A:torch.Tensor,     # (D, D) score matrix
                     mask:torch.Tensor,  # (N, N) additive mask, [key i, column j]
                     hard:bool=False,    # the beta -> infinity limit: uniform over the top logits
                    )->torch.Tensor:     # (..., N, N) a distribution over keys i for each column j
    "Softmax attention of every column over its unmasked keys (or its limit, when `hard`)."
    Z, N = check_floating(Z, "Z"), Z.shape[-1]
    check_work(2 * math.prod(Z.shape[:-2]) * N * N * Z.element_size(), "bytes",
               f"the {N} x {N} logits and weights of {math.prod(Z.shape[:-2])} prompt(s)",
               "use `streamed_pair_update`, which never builds them")
    return _weights(Z.mT @ A @ Z + mask, -2, check_bool(hard, "hard"))


# %% [markdown]
# One iteration is the two layers in turn. The parameters of a pair are five $(d+4) \times (d+4)$
# matrices $(A_b, V_b, A, V^{\mathrm{cur}}, V^{\mathrm{tgt}})$; `control_theta_star` builds them.

# %%
#| export
def control_pair_update(Z:torch.Tensor,  # (..., d + 4, N) tokens
                        params:tuple,    # (A_b, V_b, A, V_cur, V_tgt), each (d + 4, d + 4)
                        masks:tuple,     # (TD mask, backup mask), as control_masks gives them
                        hard:bool=False, # backup head at beta = infinity
                       )->torch.Tensor:  # (..., d + 4, N) after the backup layer and the TD layer
    "One iteration: backup layer $Z + V_b Z S_b$, then TD layer $Z + (V^{cur} + V^{tgt}) Z S$."
    A_b, V_b, A, V_cur, V_tgt = _pair(params)
    Z = Z + V_b @ Z @ masked_attention(Z, A_b, masks[1], hard)
    return Z + (V_cur + V_tgt) @ Z @ masked_attention(Z, A, masks[0])

def _pair(params)->tuple:
    "The five matrices of a pair, or a `ValueError` naming `params`."
    if isinstance(params, torch.Tensor) and params.ndim >= 3: params = tuple(params.unbind(-3))
    if not isinstance(params, (tuple, list)) or len(params) != 5 \
            or not all(isinstance(p, torch.Tensor) for p in params):
        raise ValueError(f"`params` must be five (d + 4, d + 4) tensors (A_b, V_b, A, V_cur, V_tgt), "
                         f"got {type(params).__name__}"[:200])
    return tuple(params)

def control_theta_star(d:int,        # feature dimension
                       W,            # (d, d) score matrix of the TD kernel
                       alpha:float,  # step size > 0
                       gamma:float,  # discount factor in [0, 1)
                       beta:float,   # inverse temperature of the backup in [0, inf]
                      )->tuple:      # (A_b, V_b, A, V_cur, V_tgt), each (d + 4, d + 4) float64
    "The constructed parameters under which each pair of layers is one soft Q-iteration step."
    d, W = token_rows(d) - 2, as_tensor(W, "W", torch.float64)
    if W.shape != (d, d): raise ValueError(f"`W` must have shape ({d}, {d}), got {tuple(W.shape)}")
    alpha, gamma = check_number(alpha, "alpha", 0, strict=True), check_gamma(gamma)
    beta = _check_beta(beta)
    A_b, V_b, A, V_cur, V_tgt = (torch.zeros(d + 4, d + 4, dtype=torch.float64) for _ in range(5))
    A_b[d + 1, d + 3] = 1. if beta == math.inf else beta
    V_b[d + 2, d + 1], V_b[d + 2, d + 2] = 1., -1.
    A[:d, :d] = W
    V_cur[d + 1, d], V_cur[d + 1, d + 1], V_tgt[d + 1, d + 2] = alpha, -alpha, gamma * alpha
    return A_b, V_b, A, V_cur, V_tgt


# %% [markdown]
# The masks are $N \times N$ with $N = n + (n + q)A$, and so are the weights: at $n = 10^5$
# transitions and two actions, terabytes. Neither is needed. A column's backup keys are the $A$ columns of one
# block, so the backup head is $A \times A$ softmaxes within blocks; the TD head's keys are the $n$ context
# columns for every column, which fused attention (`torch.nn.functional.scaled_dot_product_attention`)
# computes without forming its weights. The streamed pair update is that pair in $O(N)$ memory;
# `ControlICTD` takes it by itself (`method='auto'`) once the dense path would pass `ictd.core.DENSE_BYTES`,
# and refuses the dense path above `ictd.core.WORK_LIMITS`. Its equality with the dense pair and its
# memory are in [Implementation and tests](#implementation-and-tests).

# %%
#| export
def _td_attend(Z, A, V, n:int)->torch.Tensor:
    "$V Z S$ of the TD head: every column over the n context keys, by fused attention (no weights)."
    keys = Z[..., :n]
    Q, K, X = Z.mT, (A.mT @ keys).mT, (V @ keys).mT          # logit z_i^T A z_j = z_j . (A^T z_i)
    shape = torch.broadcast_shapes(Q.shape[:-2], K.shape[:-2], X.shape[:-2])
    Q, K, X = (t.expand(*shape, *t.shape[-2:]).reshape(-1, 1, *t.shape[-2:]).contiguous()
               for t in (Q, K, X))        # the fused kernel wants contiguous rows
    rows = chunk_rows(Q.shape[0] * n * Q.element_size())     # columns per call: bounded memory
    attend = nn.functional.scaled_dot_product_attention
    out = torch.cat([attend(Q[..., i:i + rows, :], K, X, scale=1.)
                     for i in range(0, Q.shape[-2], rows)], -2)
    return out.reshape(*shape, *out.shape[-2:]).mT

def _backup_attend(Z, A_b, V_b, n:int, n_actions:int, q:int, hard:bool)->torch.Tensor:
    "$V_b Z S_b$ of the backup head: every column over the A keys of its assigned block."
    blocks = lambda X: X[..., n:].unflatten(-1, (n + q, n_actions))       # (..., D, n + q, A)
    K, X, cols = blocks(A_b.mT @ Z), blocks(V_b @ Z), blocks(Z)
    ctx = torch.einsum("...dbk,...db->...bk", K[..., :n, :], Z[..., :n])   # context column b: block b
    own = torch.einsum("...dbk,...dba->...bka", K, cols)                   # block column: own block
    ctx, own = _weights(ctx, -1, hard), _weights(own, -2, hard)
    return torch.cat([torch.einsum("...dbk,...bk->...db", X[..., :n, :], ctx),
                      torch.einsum("...dbk,...bka->...dba", X, own).flatten(-2)], -1)

def streamed_pair_update(Z:torch.Tensor,  # (..., d + 4, N) tokens
                         params:tuple,    # (A_b, V_b, A, V_cur, V_tgt), each (d + 4, d + 4)
                         n:int,           # number of context transitions
                         n_actions:int,   # A
                         q:int,           # number of query blocks
                         hard:bool=False, # backup head at beta = infinity
                        )->torch.Tensor:  # (..., d + 4, N), `control_pair_update`'s, in O(N) memory
    "`control_pair_update` without masks or (N, N) weights: backup within blocks, TD by fused attention."
    n, n_actions, q, N = _layout(n, n_actions, q)
    Z = check_floating(Z, "Z")
    if Z.ndim < 2 or Z.shape[-1] != N:
        raise ValueError(f"`Z` must have N = n + (n + q) A = {N} columns, got shape {tuple(Z.shape)}")
    A_b, V_b, A, V_cur, V_tgt = _pair(params)
    Z = Z + _backup_attend(Z, A_b, V_b, n, n_actions, q, check_bool(hard, "hard"))
    return Z + _td_attend(Z, A, V_cur + V_tgt, n)


# %% [markdown]
# `ControlICTD` stacks $L$ pairs. Its parameters are free (Xavier-normal from a seed, as for the
# book's other models, ready for training); `from_theta_star` sets every pair to the construction.
# It reads the values of the query blocks, an $(q, A)$ array of action values per prompt.

# %%
#| export
class ControlICTD(nn.Module):
    "A stack of L (backup layer, TD layer) pairs on control prompts; values are read from row d+1."
    @moved_to_keywords("n_layers", "init_gain", "seed", "hard")
    def __init__(self, d:int,            # feature dimension; tokens have d + 4 rows
                 *,
                 n_layers:int,           # number of layer pairs L (2L attention layers)
                 init_gain:float=0.1,    # gain of the Xavier-normal initialisation
                 seed=None,              # int or `torch.Generator`
                 hard:bool=False,        # backup heads at beta = infinity (top logits, uniformly)
                ):
        super().__init__()
        D, g = token_rows(d) + 2, torch_generator(seed)
        self.d, self.n_layers = D - 4, check_int(n_layers, "n_layers", low=1)
        self.hard = check_bool(hard, "hard")
        self.pairs = nn.ParameterList(xavier_param(D, D, init_gain, g, torch.float64)
                                      for _ in range(5 * self.n_layers))

    @classmethod
    @reordered_positionals(("cls", "d", "n_layers", "W"), _old_theta_star_call)
    def from_theta_star(cls, d:int,      # feature dimension
                        W,               # (d, d) score matrix
                        *,
                        n_layers:int,    # number of layer pairs L, one iteration each
                        alpha:float,     # step size > 0
                        gamma:float,     # discount factor in [0, 1)
                        beta:float,      # inverse temperature of the backup in [0, inf]
                       ):
        "Every pair of layers carrying `control_theta_star(d, W, alpha, gamma, beta)`."
        params = control_theta_star(d, W, alpha, gamma, beta)
        model = cls(d, n_layers=n_layers, seed=0, hard=_check_beta(beta) == math.inf)
        with torch.no_grad():
            for l in range(model.n_layers):
                for i, p in enumerate(params): model.pairs[5 * l + i].copy_(p)
        return model.requires_grad_(False)

    def forward(self, x:ControlPrompt,      # the prompt
                return_all:bool=False,      # also return the tokens after every pair
                method:str="auto",          # 'dense' (masks, N x N weights), 'streamed' (O(N)), 'auto'
               )->torch.Tensor:             # Z_L (..., d + 4, N), or Z_0..Z_L stacked on axis -3
        "Run the prompt through the L pairs of layers (the dense path up to `DENSE_BYTES`, else streamed)."
        x = check_type(x, ControlPrompt, "x")
        if x.Z.shape[-2] != self.d + 4:
            raise ValueError(f"the prompt has {x.Z.shape[-2]} rows, the model expects {self.d + 4}")
        n, A, q, N = x.n, x.n_actions, x.q, x.Z.shape[-1]
        what = (f"the {N} x {N} masks and attention weights of the dense path (n = {n}, A = {A}, "
                f"q = {q}, {math.prod(x.Z.shape[:-2])} prompt(s))")
        way_out = "use method='streamed' (the default 'auto' does above `DENSE_BYTES`): O(N) memory"
        dense = memory_path(method, _dense_bytes(x.Z), what, way_out) == "dense"
        masks, Zs = control_masks(n, A, q) if dense else None, [x.Z]
        for l in range(self.n_layers):
            pair = tuple(self.pairs[5 * l:5 * l + 5])
            Zs.append(control_pair_update(Zs[-1], pair, masks, self.hard) if dense
                      else streamed_pair_update(Zs[-1], pair, n, A, q, self.hard))
        return torch.stack(Zs, -3) if check_bool(return_all, "return_all") else Zs[-1]

    def predict(self, x:ControlPrompt,   # the prompt
                method:str="auto",       # the path of `forward`
               )->torch.Tensor:          # (..., q, A) action values at the query blocks
        "(..., q, A) action values at the query blocks: row d + 1 of Z_L."
        x = check_type(x, ControlPrompt, "x")
        Z = self(x, method=method)
        return Z[..., self.d + 1, x.n + x.n * x.n_actions:].unflatten(-1, (x.q, x.n_actions))

def _dense_bytes(Z:torch.Tensor)->float:
    "Memory of the dense path: the two (N, N) masks, and per prompt its logits, masked logits, weights."
    return (2 + 3 * math.prod(Z.shape[:-2])) * Z.shape[-1] ** 2 * 8


# %% [markdown]
# ## Every pair of layers is one iteration
#
# Write $x_j$ for the pair a column stands for (table above) and $Q_0 = 0, Q_1, \dots$ for the iterates
# of kernel soft Q-iteration ([Definition 9.1](control.html#kernel-soft-q-iteration)) with score
# $\phi^\top W \phi$, step $\alpha$ and inverse temperature $\beta$. For a block $b$ write $s_b$ for its
# state ($S_{b+1}$, or a query state).
#
# ::: {.theorem}
# **Theorem 9a.1 (ours).** *Let every pair carry `control_theta_star`$(d, W, \alpha, \gamma, \beta)$ and
# let $Z_l$ be the tokens after $l$ pairs. Then for every $l \ge 0$: rows $0..d$ and $d+3$ of $Z_l$ equal
# those of $Z_0$; $Z_l[d+1, j] = Q_l(x_j)$ at every column $j$; and for $l \ge 1$ the backup row of
# every column assigned to block $b$ is $B_\beta\big(Q_{l-1}(s_b, \cdot)\big)$, the Boltzmann backup of
# the previous iterate at that block's state. For every $W$, $\alpha$, $\gamma$, $\beta \in [0, \infty]$,
# context and number of queries.*
# :::
#
# ::: {.callout-note collapse="true" title="Proof"}
# By induction on $l$; for $l = 0$ the value and backup rows are zero, and $Q_0 = 0$. Assume the claim
# for $l$, and write $c_b$ for the common backup entry of the columns assigned to block $b$ (zero
# when $l = 0$; $B_\beta(Q_{l-1}(s_b, \cdot))$ otherwise).
#
# 1. *Backup layer.* $A_b$ has one non-zero entry, so $z_i^\top A_b z_j = \beta\, Z[d+1, i]\, Z[d+3, j]
#    = \beta\, Q_l(x_i)$. With the mask, column $j$ assigned to block $b$ puts weight
#    $\mathrm{softmax}_{a}(\beta\, Q_l(s_b, a)) = \pi_l(a \mid s_b)$ on the key of action $a$ in block $b$ and
#    none elsewhere (for $\beta = \infty$: uniform on the maximisers, the same limit). The value of
#    that key is $V_b z_i = (Q_l(s_b, a) - c_b)\, e_{d+2}$, because every column of block $b$ is
#    assigned to $b$ and carries $c_b$. The weights sum to one, so the backup row of column $j$
#    becomes $c_b + \sum_a \pi_l(a \mid s_b) Q_l(s_b, a) - c_b = B_\beta(Q_l(s_b, \cdot))$. $V_b$
#    writes row $d+2$ only.
# 2. *TD layer.* $A$ reads the feature rows only, which no layer changes, so
#    $S[k-1, j] = K_k(x_j)$ of Definition 9.1 at every layer. At key $k-1$ (context column $k - 1$,
#    assigned to block $k - 1$, whose state is $S_k$) the value is
#    $(V^{\mathrm{cur}} + V^{\mathrm{tgt}}) z = \alpha\big(R_k - Q_l(S_{k-1}, A_{k-1}) + \gamma\, B_\beta(Q_l(S_k, \cdot))\big) e_{d+1}$,
#    which is $\alpha$ times the bracket of Definition 9.1. So row $d+1$ of column $j$ becomes
#    $Q_l(x_j) + \alpha \sum_k K_k(x_j)[\cdots] = Q_{l+1}(x_j)$, and no other row changes.
#
# After both layers the value row holds $Q_{l+1}$ and the backup rows $B_\beta(Q_l(s_b, \cdot))$: the
# claim for $l + 1$.
# :::
#
# The check compares every pair's value row with `kernel_q_iteration`, and every pair's backup row
# with the backup of the previous iterate, on random MDPs of all three feature kinds, random $W$,
# $\alpha$, context lengths, numbers of actions and queries, and $\beta$ from 0 to $\infty$, in float64.
# As in chapter 3 nothing is tuned to converge, so the gap is relative to the size of the values.

# %%
#| code-fold: true
#| code-summary: "Code: the gap on one random task"
def theorem_gap(seed:int, beta:float, n_iters:int=12)->float:
    "Largest relative gap, Transformer against kernel soft Q-iteration, over pairs, columns, rows."
    rng = np.random.default_rng(seed)
    S, A = int(rng.integers(2, 7)), int(rng.integers(1, 4))
    feats = ("onehot", "random", "unit")[seed % 3]
    m = random_mdp(S, A, features=feats, seed=rng,
                   d=None if feats == "onehot" else int(rng.integers(1, 6)))
    n, q = int(rng.integers(1, 25)), int(rng.integers(0, 3))
    St, At, Rt = sample_mdp_trajectory(m, n, seed=rng)
    f_sa, f_next = context_features(m, St, At)
    f_q = m.phi[torch.from_numpy(rng.integers(0, S, size=q))]
    W = torch.from_numpy(rng.normal(scale=2 / np.sqrt(m.d), size=(m.d, m.d)))
    alpha = rng.uniform(0.1, 1)
    model = ControlICTD.from_theta_star(m.d, W, n_layers=n_iters, alpha=alpha, gamma=m.gamma,
                                        beta=beta)
    Zs = model(build_control_prompt(f_sa, Rt, f_next, f_q), return_all=True)
    every_block = torch.cat([f_next.flatten(0, 1), f_q.flatten(0, 1)])
    ref = kernel_q_iteration(f_sa, Rt, f_next, W, alpha=alpha, gamma=m.gamma, beta=beta,
                             n_iters=n_iters, phi_queries=every_block, return_all=True)
    values = torch.cat([ref[:, :n], ref[:, n:]], -1)           # context pairs, then block columns
    blocks = values[:, n:].unflatten(-1, (n + q, A))
    backups = boltzmann_backup(blocks[:-1], beta)              # (L, n + q): B(Q_{l-1}) per block
    want_backup = torch.cat([backups[:, :n], backups.repeat_interleave(A, -1)], -1)
    scale = values.abs().max().clamp(min=1)
    gap_v = (Zs[:, m.d + 1] - values).abs().max()
    gap_b = (Zs[1:, m.d + 2] - want_backup).abs().max()
    fixed = torch.equal(Zs[:, :m.d + 1], Zs[:1, :m.d + 1].expand_as(Zs[:, :m.d + 1]))
    fixed = fixed and bool((Zs[:, m.d + 3] == 1).all())
    assert fixed, seed
    return (max(gap_v, gap_b) / scale).item()


# %%
betas_check = (0., 0.5, 3., 20., math.inf)
thm_gaps = np.array([[theorem_gap(seed, b) for b in betas_check] for seed in range(15)])
assert (thm_gaps < 1e-12).all(), thm_gaps.max()
record_claim("theorem-9a.1", "Under the constructed parameters every pair of layers (a backup "
             "layer, then the TD layer) "
             "of the control Transformer is one iteration of kernel soft Q-iteration, at every "
             "column, for every "
             "$\\beta \\in [0, \\infty]$ (Theorem 9a.1).", "proved", "control_transformer",
             "#every-pair-of-layers-is-one-iteration")
Markdown(f"On {thm_gaps.shape[0]} random tasks (all three feature kinds) and {thm_gaps.shape[1]} "
         f"values of $\\beta$ "
         f"(from 0 to $\\infty$), 12 pairs each, the largest relative gap of the value and backup "
         f"rows is below "
         f"$10^{{-12}}$ (asserted), and the feature, reward and constant rows are unchanged bit "
         f"for bit.")

# %% [markdown]
# Figures 9a.1 and 9a.2 show the two attentions of the small prompt above after one pair, with $\beta = 4$:
# the TD head's kernel over the three context columns, and the backup head's weights, each column's
# mass on the two actions of its assigned block.

# %%
tiny_model = ControlICTD.from_theta_star(6, 3. * torch.eye(6, dtype=torch.float64), n_layers=2,
                                         alpha=1., gamma=0.9, beta=4.)
Z1 = tiny_model(x_tiny, return_all=True)[1]
params_t = control_theta_star(6, 3. * torch.eye(6, dtype=torch.float64), 1., 0.9, 4.)
masks_t = control_masks(3, 2, 1)
att_td = masked_attention(Z1, params_t[2], masks_t[0])
att_b = masked_attention(Z1, params_t[0], masks_t[1])
test_close(att_b.sum(0), torch.ones(11, dtype=torch.float64), eps=1e-14)
assert (att_td[3:] == 0).all()
labels = ["ctx 0", "ctx 1", "ctx 2"] + [f"{'S' + str(b + 1) if b < 3 else 'query'},a{a}"
                                         for b in range(4) for a in range(2)]

def attention_map(att, title):
    "A heat map of one head's weights, keys as rows and the attending columns as columns."
    fig, ax = plt.subplots(figsize=(5.2, 4.4))
    im = ax.imshow(att.numpy(), cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(11), labels, rotation=70, fontsize=8)
    ax.set_yticks(range(11), labels, fontsize=8)
    ax.set(xlabel="column j (the attending token)", ylabel="key i", title=title)
    fig.colorbar(im, ax=ax, label="attention weight", fraction=0.046)


# %%
#| fig-cap: "Figure 9a.1: The TD head of one pair on the 11-column prompt attends to the context columns with the kernel."
#| fig-alt: "Heat map of attention weights, keys as rows and the 11 columns as columns: only the first three key rows (the context) are non-zero."
attention_map(att_td, "TD head: kernel K over the context")

# %%
#| fig-cap: "Figure 9a.2: The backup head of the same pair attends to the two action columns of each column's assigned block."
#| fig-alt: "Heat map of attention weights, keys as rows and the 11 columns as columns: each column's weight sits on two key rows of one successor or query block, split between the block's two actions."
attention_map(att_b, "backup head: softmax(beta Q) over a block")


# %% [markdown]
# ## Finding the successor's columns: a mask or a score
#
# The construction routes each column to its block by a **mask**. It is exact for every feature kind,
# because it never reads the features, and it costs what the book's TD head already pays: the prompt
# has to say which columns are which (here the block of each column, there which columns are keys),
# plus the $nA$ successor columns themselves, so a prompt of $n$ transitions has $n(1 + A) + qA$ columns.
#
# The alternative is a **score term that matches states**: give every token a code $\psi$ of a state
# (the successor's, for a context column; its own, for a block column) in $d_\psi$ extra rows, let
# every block column be a key (a mask by column *type* only), and add $c\, \psi_i^\top \psi_j$ to the
# backup logit. As $c \to \infty$ a column's weight concentrates on the blocks whose state has the
# largest code similarity; when that is its own state, every such block holds the same action values,
# so the backup is exact in the limit. The price is the gap between a code's similarity with itself and
# with other states' codes, the **margin** $\mu = \min_s \big(\lVert\psi(s)\rVert^2 - \max_{s' \ne s}
# \psi(s)^\top \psi(s')\big)$: a wrong column's weight relative to a right one is at most
# $e^{-c\mu + \beta w}$ ($w$ the spread of the values), and there are up to $nA$ wrong columns, so
# the scale needed grows like $(\log(nA) + \beta w)/\mu$, and a negative margin (a code more similar to another state
# than to itself, which raw $U(-1, 1)$ codes allow) cannot be fixed by any scale. One-hot codes
# ($d_\psi = S$ rows) have $\mu = 1$; random unit codes in $d_\psi < S$ dimensions have a small margin.
# The folded code below computes this head; the experiment measures the error of the backup against $c$ on the
# default MDP (ten states, three actions), $\beta = 4$, contexts of $n = 200$.

# %%
#| code-fold: true
#| code-summary: "Code: the score-routed backup and the experiment"
def code_backup(q_blocks, code_cols, code_blocks, c, beta):
    "The backup head with the score c psi_i^T psi_j + beta Q_i over every block column (no mask)."
    logits = c * code_cols @ code_blocks.mT                                # (columns, blocks)
    A_ = q_blocks.shape[-1]
    logits = (logits[..., :, :, None] + beta * q_blocks[..., None, :, :]).flatten(-2)
    return (torch.softmax(logits, -1) * q_blocks.flatten(-2)[..., None, :]).sum(-1)

def routing_error(codes, c_grid, n=200, n_contexts=10, beta=4.):
    "Largest error of the score-routed backup at the context columns, for each scale c."
    m, errs = random_mdp(seed=0), []
    for k in range(n_contexts):
        St, At, Rt = sample_mdp_trajectory(m, n, seed=k)
        g_k = torch.Generator().manual_seed(k)
        q_sa = torch.randn(10, 3, generator=g_k, dtype=torch.float64)              # any values
        exact = boltzmann_backup(q_sa[St[1:]], beta)
        codes_s = codes[St[1:]]
        errs.append([(code_backup(q_sa[St[1:]], codes_s, codes_s, c, beta) - exact).abs().max()
                     .item()
                     for c in c_grid])
    return np.max(errs, 0)

def margin(codes):
    "min_s ( |psi(s)|^2 - max_{s' != s} psi(s)^T psi(s') )."
    G = codes @ codes.T
    off_diag = G - torch.diag(torch.full((len(G),), math.inf, dtype=G.dtype))
    return (G.diag() - off_diag.amax(1)).min().item()

gcode, c_grid = torch.Generator().manual_seed(0), np.array([1, 2, 5, 10, 20, 50, 100, 200, 500.])
def unit(k):
    "Ten random unit codes in k dimensions."
    x = torch.randn(10, k, generator=gcode, dtype=torch.float64)
    return x / x.norm(dim=1, keepdim=True)
codes = {"one-hot ($d_\\psi = 10$)": torch.eye(10, dtype=torch.float64),
         "random unit, $d_\\psi = 8$": unit(8),
         "random unit, $d_\\psi = 4$": unit(4),
         "raw $U(-1,1)$, $d_\\psi = 4$": 2 * torch.rand(10, 4, generator=gcode, dtype=torch.float64)
         - 1}
routing = {name: (margin(cd), routing_error(cd, c_grid)) for name, cd in codes.items()}
onehot_err = routing["one-hot ($d_\\psi = 10$)"][1]
raw_margin, raw_err = routing["raw $U(-1,1)$, $d_\\psi = 4$"]
assert onehot_err[c_grid == 50][0] < 1e-12 and raw_margin < 0 and raw_err[-1] > 0.1
for name, (mu, err) in routing.items():
    if mu > 0:                                                                  # falls with c
        assert err[-1] < err[0] and (np.diff(np.log(err[err > 1e-13])) < 1e-9).all(), name

# %%
#| fig-cap: "Figure 9a.3: The backup routed by a state-matching score instead of a mask: exact as the scale grows when every code is most similar to itself, at a rate set by the margin; a code with a negative margin never is."
#| fig-alt: "Log-log plot of the largest backup error against the code scale c from 1 to 500, one line per code. One-hot codes fall fastest, to round-off (not drawn) by c = 50; random unit codes in 8 dimensions fall later; random unit codes in 4 dimensions and raw uniform codes stay near 1."
fig, ax = plt.subplots(figsize=(6, 4))
for i, (name, (mu, err)) in enumerate(routing.items()):
    drawn = err >= 1e-13                                             # below: round-off, not drawn
    ax.loglog(c_grid[drawn], err[drawn], "o-", color=OKABE_ITO[i], ms=3,
              label=f"{name}, margin {mu:.2f}")
ax.set(xlabel="code scale $c$", ylabel="max |routed backup - exact|\n(return units)",
       ylim=(1e-13, 10),
       title="Backup routed by scores\n10 contexts of n = 200, beta = 4")
plain_log_ticks(ax, "x"); ax.legend(fontsize=8);

# %%
Markdown("Margins and errors at the largest scale $c = 500$: " + "; ".join(
    f"{name}: margin {mu:.3f}, error "
    + (f"{err[-1]:.1e}" if err[-1] >= 1e-12 else "below $10^{-12}$")
    for name, (mu, err) in routing.items()) +
    ". The one-hot codes are exact to $10^{-12}$ from $c = 50$ (asserted); the raw code's "
    "negative margin leaves an "
    "error above 0.1 at every scale (asserted).")


# %% [markdown]
# So the mask is the construction's choice: it is exact at any context length and for any features.
# Routing by scores needs $d_\psi$ extra rows holding a state code and a scale of order
# $\log(nA)/\mu$; with codes taken from random features the margin is whatever the draw gives, and can
# be negative.

# %% [markdown]
# ## Linear attention cannot take the max
#
# The book's linear-attention layer ([chapter 7](linear.html), Wang et al., ICLR 2025) is
# $Z \mapsto Z + \frac1n V Z_{:, <n} (Z_{:, <n}^\top A Z)$: every output entry is a polynomial of degree
# at most 3 in the entries of its input, whatever $V$ and $A$ are. (Liang and Lai build SARSA with such
# a layer: SARSA's backup $Q(S', A')$ is linear in the values, so a polynomial can hold it.)
#
# ::: {.proposition}
# **Proposition 9a.2 (ours).** *Fix any prompt layout in which the values $Q(s', 1)$ and $Q(s', 2)$ of
# a successor's two actions are entries $t$ and $u$ of the input, and fix every other entry. For every
# parameter setting, every output entry $f$ of a linear-attention layer of the book's form, and every
# $h > 0$, the fourth difference along $t$ vanishes:
# $f(-2h) - 4f(-h) + 6f(0) - 4f(h) + f(2h) = 0$ at $u = 0$. The Q-learning update
# $Q(x) + \alpha K(x)\big[R + \gamma \max(t, u) - Q(x)\big]$, with kernel weight $K(x) > 0$ on that
# transition, has fourth difference $-2h\alpha\gamma K(x) \ne 0$. So no such layer computes one step of
# Q-learning on any set of prompts containing these five, and no stack of $L$ layers does either:
# its output is a polynomial of degree at most $3^L$, whose $(3^L + 1)$-th difference vanishes, while
# that of $\max(t, 0)$ does not.*
# :::
#
# ::: {.callout-note collapse="true" title="Proof"}
# The layer's output is $z + \frac1n \sum_{i<n} (z_i^\top A z) V z_i$, a sum of products of at most
# three input entries, so along the line $t \mapsto$ (input with entry $t$) each output entry is a
# polynomial of degree at most 3 in $t$, and the fourth finite difference of a cubic is zero. The
# Q-learning update is affine in $\max(t, 0)$ along the line, whose values at $-2h, \dots, 2h$ are
# $0, 0, 0, h, 2h$, with fourth difference $-4h + 2h = -2h$; multiplied by $\alpha\gamma K(x)$. Two
# functions equal at the five points have equal differences, a contradiction. Composing $L$ layers
# multiplies degrees, giving degree $\le 3^L$; the $m$-th difference of $\max(t, 0)$ at
# $-\lfloor m/2 \rfloor h, \dots$ is a non-zero multiple of $h$ for every $m \ge 2$ (checked below for
# $m = 10$, the case $L = 2$).
# :::
#
# The check draws random linear-attention layers (any $V$, $A$, any prompt, of the book's form via
# `linear_attention` from chapter 7) and measures the fourth difference of every output entry along
# the line: it is round-off, while the Q-learning target needs $-2h\alpha\gamma K$. A softmax backup
# head, by contrast, has a non-zero fourth difference that tends to that of the max as $\beta$ grows.

# %%
#| code-fold: true
#| code-summary: "Code: fourth differences of 200 random linear-attention layers"
def fourth_difference(f, h):
    "f(-2h) - 4 f(-h) + 6 f(0) - 4 f(h) + f(2h)."
    return f(-2 * h) - 4 * f(-h) + 6 * f(0.) - 4 * f(h) + f(2 * h)

glin, h, D_lin, N_lin = torch.Generator().manual_seed(0), 0.5, 9, 12
worst = 0.
for trial in range(200):
    shapes = ((D_lin, D_lin), (D_lin, D_lin), (D_lin, N_lin))
    P_l, Q_l, Z_l = (torch.randn(*shape, generator=glin, dtype=torch.float64) for shape in shapes)
    r1, r2 = torch.randint(0, D_lin, (2,), generator=glin).tolist()
    c1, c2 = torch.randperm(N_lin, generator=glin)[:2].tolist()
    def out(t):
        Zt = Z_l.clone(); Zt[r1, c1], Zt[r2, c2] = t, 0.
        return linear_attention(P_l, Q_l, Zt, n=8)
    diff, size = fourth_difference(out, h), out(2 * h).abs().max()
    worst = max(worst, (diff.abs().max() / size).item())

# %%
assert worst < 1e-12, worst                           # every random linear layer: a cubic in t
alpha_c, gamma_c, K_c = 0.5, 0.9, 0.3
q_learning = lambda t: 0.2 + alpha_c * K_c * (1.0 + gamma_c * max(t, 0.) - 0.2)
target_diff = fourth_difference(q_learning, h)
test_close(target_diff, -2 * h * alpha_c * gamma_c * K_c, eps=1e-14)
two = lambda t: torch.tensor([t, 0.], dtype=torch.float64)
soft = {b: fourth_difference(lambda t: boltzmann_backup(two(t), b).item(), h)
        for b in (1., 4., 16., 64.)}
assert abs(soft[64.] + 2 * h) < 1e-6 and all(abs(v) > 1e-3 for v in soft.values())
tenth = sum((-1) ** (10 - i) * math.comb(10, i) * max((i - 5) * h, 0.) for i in range(11))
assert abs(tenth) > 1e-3
record_claim("linear-no-max", "No linear-attention layer of the book's form, with any parameters, "
             "computes one step of "
             "Q-learning: its output is cubic in the input, and five prompts differing in one "
             "successor value "
             "separate it from the max backup (Proposition 9a.2; any depth L by the (3^L + 1)-th "
             "difference).",
             "proved", "control_transformer", "#linear-attention-cannot-take-the-max")
Markdown(f"Over 200 random layers the largest fourth difference, relative to the output's size, "
         f"is below $10^{{-12}}$ "
         f"(asserted); the Q-learning target's is {target_diff:.4f} $= -2h\\alpha\\gamma K$ with "
         f"$h = {h}$, "
         f"$\\alpha = {alpha_c}$, $\\gamma = {gamma_c}$, $K = {K_c}$. The softmax backup's fourth "
         f"difference, against "
         f"the max's $-2h = {-2 * h}$: "
         + ", ".join(f"{v:.4f} at $\\beta = {b:g}$" for b, v in soft.items())
         + f". The tenth difference of $\\max(t, 0)$ (the case $L = 2$) is {tenth:g}.")

# %% [markdown]
# ## Implementation and tests

# %%
show_doc(build_control_prompt)

# %%
show_doc(control_pair_update)

# %%
show_doc(control_theta_star)

# %%
show_doc(ControlICTD)

# %% [markdown]
# The masks of the small prompt: the TD head's keys are the three context columns; the backup head of
# context column $j$ sees block $j$ (columns $3 + 2j$, $4 + 2j$), and a block column sees its own block.

# %%
td_m, b_m = control_masks(3, 2, 1)
test_eq((td_m == 0).nonzero()[:, 0].unique(), torch.arange(3))
for j in range(11):
    keys_j = (b_m[:, j] == 0).nonzero()[:, 0].tolist()
    blk = j if j < 3 else (j - 3) // 2
    test_eq(keys_j, [3 + 2 * blk, 4 + 2 * blk])

# %% [markdown]
# `predict` returns the query block's values, which are `kernel_q_iteration`'s at the query pairs; the
# query blocks do not interact (one query or three give the same values at the first); batches of
# contexts run at once; the value weights are the $(+, +, -)$ pattern; and bad prompts are refused.

# %%
#| code-fold: true
#| code-summary: "Tests: predictions, batches, weights and bad prompts"
m5 = random_mdp(5, 3, features="random", d=4, seed=7)
S5, A5, R5 = sample_mdp_trajectory(m5, 30, seed=7)
g5, n5 = context_features(m5, S5, A5)
W5 = torch.randn(4, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
model5 = ControlICTD.from_theta_star(4, W5, n_layers=8, alpha=0.6, gamma=0.9, beta=2.)
pred = model5.predict(build_control_prompt(g5, R5, n5, m5.phi[[1, 3, 4]]))
ref5 = kernel_q_iteration(g5, R5, n5, W5, alpha=0.6, gamma=0.9, beta=2., n_iters=8,
                          phi_queries=m5.phi[[1, 3, 4]].flatten(0, 1))
test_close(pred.flatten(), ref5[30:], eps=1e-12)
test_close(model5.predict(build_control_prompt(g5, R5, n5, m5.phi[[1]]))[0], pred[0], eps=1e-13)
two_contexts = (torch.stack([g5, g5.flip(0)]), torch.stack([R5, R5.flip(0)]),
                torch.stack([n5, n5.flip(0)]))
batch_pred = model5.predict(build_control_prompt(*two_contexts, m5.phi[[1, 3, 4]]))
test_close(batch_pred[0], pred, eps=1e-13)
_, _, A5p, Vc5, Vt5 = control_theta_star(4, W5, 0.6, 0.9, 2.)
test_eq(torch.stack([Vc5[5, 4], Vt5[5, 6], Vc5[5, 5]]),
        torch.tensor([0.6, 0.9 * 0.6, -0.6], dtype=torch.float64))
test_fail(lambda: control_theta_star(4, W5, 0.6, 0.9, -1.),
          contains="`beta` must be a finite number >= 0")
test_fail(lambda: control_theta_star(4, W5[:3], 0.6, 0.9, 1.), contains="`W` must have shape")
test_fail(lambda: control_theta_star(4, W5, 0., 0.9, 1.),
          contains="`alpha` must be a finite number > 0")
test_fail(lambda: build_control_prompt(g5, R5, n5[:-1]), contains="`phi_next` must have shape")
test_fail(lambda: build_control_prompt(g5, R5[:-1], n5), contains="`rewards` must have shape")
test_fail(lambda: build_control_prompt(g5, R5, n5, m5.phi[:, :2]),
          contains="`phi_queries` must have shape")
test_fail(lambda: ControlICTD(4, n_layers=0), contains="`n_layers` must be an integer >= 1")
test_fail(lambda: model5(build_control_prompt(g5[:, :3], R5, n5[..., :3])),
          contains="the model expects 8")

# %% [markdown]
# The random initialisation is reproducible from a seed and gives gradients to every parameter (the
# model is ready for the training of a later page):

# %%
free = ControlICTD(4, n_layers=2, init_gain=0.5, seed=1)
test_eq([p.detach() for p in free.pairs],
        [p.detach() for p in ControlICTD(4, n_layers=2, init_gain=0.5, seed=1).pairs])
free.predict(build_control_prompt(g5, R5, n5, m5.phi[[1]])).sum().backward()
assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in free.pairs)


# %% [markdown]
# ### The streamed path
#
# The streamed pair update is `control_pair_update` without its masks and $N \times N$ weights. On the prompts
# above, with the free model of random parameters (three batched contexts, both backup limits), the tokens after
# every pair and the gradient of every parameter agree with the dense path's to $10^{-12}$ relative (float64):

# %%
#| code-fold: true
#| code-summary: "Tests: streamed against dense"
def path_gap(model, x)->tuple:
    "Largest relative gap, streamed against dense: tokens after every pair, then gradients."
    out, grad = {}, {}
    for method in ("dense", "streamed"):
        model.zero_grad()
        out[method] = model(x, return_all=True, method=method).detach()
        model.predict(x, method=method).square().sum().backward()
        grad[method] = torch.cat([torch.zeros(p.numel(), dtype=torch.float64) if p.grad is None
                                  else p.grad.flatten() for p in model.pairs])
    rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()
    return rel(out["streamed"], out["dense"]), rel(grad["streamed"], grad["dense"])

x3 = build_control_prompt(*two_contexts, m5.phi[[1, 3, 4]])
gaps = {hard: path_gap(ControlICTD(4, n_layers=3, init_gain=0.5, seed=2, hard=hard), x3)
        for hard in (False, True)}
assert all(g < 1e-12 for pair in gaps.values() for g in pair), gaps
Markdown("Tokens and gradients, streamed against dense: below $10^{-12}$ relative for the softmax "
         "backup and for its $\\beta = \\infty$ limit (asserted).")

# %% [markdown]
# Its memory and time, measured by `bench/bench_control.py` (each row a fresh process, one thread; $d = 4$,
# $A = 2$, one query block, one pair, no gradients). "Peak" is the process's resident peak during the call
# minus before it; the dense path's need is computed by the model's estimate, and above
# `ictd.core.WORK_LIMITS` the dense path refuses (its message below).

# %%
#| code-fold: true
#| code-summary: "Code: the table of the measurements"
bench = json.loads(Path("data/control_forward_memory.json").read_text())
def plain(x:float)->str:
    "A positive number in plain digits: three significant below 10, whole numbers above."
    return f"{x:,.0f}" if x >= 10 else f"{x:.2g}"

def bench_row(r)->str:
    "One table row: n, N, path, the dense estimate, then time and added peak memory, or refusal."
    run = (f"{plain(r['seconds'])} s | {r['peak_mb'] - r['before_mb']:,.0f} MB" if "seconds" in r
           else "refused | -")
    return f"| {r['n']:,} | {r['N']:,} | {r['method']} | {plain(r['dense_gib'])} | {run} |"
rows = sorted(bench["rows"], key=lambda r: (r["n"], r["method"]))
big = next(r for r in rows if r["n"] == 10**5 and r["method"] == "streamed")
assert big["finite"] and big["peak_mb"] - big["before_mb"] < 1024
refusal = next(r["refused"] for r in rows if r["n"] == 10**5 and r["method"] == "dense")
Markdown("| n | N | path | dense path needs (GiB) | wall time | added peak |\n"
         "|---|---|---|---|---|---|\n"
         + "\n".join(bench_row(r) for r in rows)
         + f"\n\nAt $n = 10^5$ the streamed forward added "
         f"{big['peak_mb'] - big['before_mb']:.0f} MB "
         f"to the process's peak (asserted under 1 GiB) where the dense path would need "
         f"{big['dense_gib']:,.0f} GiB; its time, {big['seconds'] / 60:.0f} minutes on one thread, "
         f"is the $O(nN)$ work of attention, which no path avoids for free parameters. The dense "
         f"path's refusal: *{refusal}*. "
         + provenance_note(bench["provenance"], "These measurements",
                           "Wall times and peaks vary with the machine and its load (this one was "
                           "shared); the dense estimate is computed, not measured."))

# %% [markdown]
# ### The module's other functions
#
# The page's API entries are the functions a reader calls (`build_control_prompt`,
# `control_pair_update`, `control_theta_star`, `ControlICTD`); the module's other public names and
# `ControlICTD`'s constructor and prediction, with their docstrings:

# %%
#| code-fold: true
#| code-summary: "Code for the list"
others = (ControlPrompt, control_masks, masked_attention, streamed_pair_update,
          ControlICTD.from_theta_star, ControlICTD.predict)
code = lambda doc: re.sub(r"`([^`]*)`", r"<code>\1</code>", doc).replace("|", "&#124;")
Markdown(f"<details><summary>{len(others)} names</summary>\n\n"
         "| name | what it is |\n|---|---|\n" + "\n".join(
    f"| <code>{f.__qualname__}</code> | {code(f.__doc__)} |" for f in others) + "\n\n</details>")

# %%
#| hide
# Listed above: this keeps nbdev from adding a full API entry for each of them.
show_doc(ControlPrompt)
show_doc(control_masks)
show_doc(masked_attention)
show_doc(streamed_pair_update)

# %%
#| export
from ictd.boyan import check_arguments
check_arguments(globals())   # public functions refuse arguments their annotations rule out (ch. 0)

# %%
#| hide
import nbdev; nbdev.nbdev_export()
