# %%
#| default_exp linear

# %%
#| export
from __future__ import annotations
import dataclasses, functools, inspect, itertools, json, math
from dataclasses import dataclass
from pathlib import Path
import torch
from torch import nn
import numpy as np
from tqdm.auto import tqdm
from ictd.boyan import as_tensor, check_gamma, msve, random_boyan_chain, sample_trajectory, weighted_error
from ictd.model import token_rows, torch_generator, xavier_param
from ictd.tasks import TaskBatch, random_tasks, sample_trajectories
from ictd.model import SoftmaxICTD
from ictd.prompt import build_prompt
from ictd.tasks import Contexts, TDExamples, task_features, task_pool
from ictd.pretrain import (EMERGENCE, EvalSet, Family, PretrainConfig, Protocol, held_out_tasks, pretrain_many, register_family, register_protocol,
                           stack_pools, stack_results, task_eval_set)
from ictd.wstd import batch_linear_td, context_tensors, weighted_softmax_td
from ictd.core import jsonable

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *

# %%
#| hide
import matplotlib.pyplot as plt
from IPython.display import Markdown


# %% [markdown]
# # Linear attention, side by side
# > The prior construction for in-context TD with linear attention (Wang et al., ICLR 2025): rebuilt and checked against batch linear TD, pretrained with the predecessor's protocol and measures, and compared with the softmax construction of this book with each method's step size tuned.

# %% [markdown]
# Before softmax attention, the theory of in-context TD was built on **linear** attention, where the
# softmax is replaced by the identity. Wang, Blaser, Daneshmand and Zhang (ICLR 2025,
# arXiv 2405.13861) showed that a linear Transformer's forward pass can run batch linear TD(0), one
# iteration per layer, and that a linear Transformer pretrained with a TD loss on many tasks ends
# up close to that construction. This chapter
#
# 1. rebuilds the construction in the form given in the project's specification, proves the
#    equivalence with a short argument of our own and checks it to machine precision;
# 2. pretrains the linear Transformer with the predecessor's data protocol and scores it with the
#    predecessor's measures, over many seeds, against their published numbers;
# 3. compares linear and softmax in-context TD on the same tasks and features, each with its own
#    step size (and score scale) tuned, with the predecessor's "softmax" variant as an ablation.
#
# The construction and the measures are the predecessor's (their definitions follow the
# predecessor's public code); the proofs, the matrix form of the layer, the fitted step size and
# every experiment here are ours.

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
#
# The predecessor's code also offers a "softmax" activation for this layer, applied to
# $Z^\top Q Z$ along its second axis: for each key it normalises over the *target* columns $j$ (the
# context columns and the query), where a softmax Transformer normalises over the keys. We keep it as
# an option, `softmax=True`, for the ablation at the end of the chapter. With it the answer at one
# query depends on the other queries in the same prompt (they share the normaliser), so it is used
# with one query per prompt.

# %%
#| export
def _context_length(Z:torch.Tensor, n)->int:
    if n is None: n = Z.shape[-1] - 1
    if not 1 <= n <= Z.shape[-1]: raise ValueError(f"`n` must lie in 1..{Z.shape[-1]} (the number of context columns), got {n}")
    return int(n)

def linear_attention(P:torch.Tensor,      # (..., 2d+1, 2d+1) output projection
                     Q:torch.Tensor,      # (..., 2d+1, 2d+1) bilinear score matrix
                     Z:torch.Tensor,      # (..., 2d+1, N) prompt; batch dimensions broadcast with P and Q
                     n:int,               # number of context columns (the keys)
                     softmax:bool=False,  # normalise each key's scores over the target columns (the predecessor's variant)
                    )->torch.Tensor:      # (..., 2d+1, N) next prompt
    "One layer $Z + \\frac1n P Z M (Z^\\top Q Z)$, unvalidated, with scores optionally softmax-normalised over targets."
    C = Z[..., :n]
    scores = C.mT @ (Q @ Z)
    if softmax: scores = torch.softmax(scores, dim=-1)
    return Z + (P @ C) @ scores / n


# %% [markdown]
# Pretraining needs parameters that are not all zero: at $P = Q = 0$ every gradient of the output
# vanishes (each layer's change is a product in which both factors are zero), so gradient descent
# never leaves the origin. We draw $P$ and $Q$ from a Xavier-normal distribution with a small gain,
# from a seed, exactly as the softmax model of the [dual-head chapter](dual_head.html) does (and as
# the predecessor's code does, with gain $0.1$).

# %%
#| export
class LinearAttentionLayer(nn.Module):
    "One linear self-attention layer $Z + \\frac1n P Z M (Z^\\top Q Z)$ of Wang et al. (2025)."
    def __init__(self, d:int,             # feature dimension; tokens have 2d+1 rows
                 init_gain:float=0.1,     # gain of the Xavier-normal initialisation of P and Q
                 seed=None,               # int or `torch.Generator` for the initialisation
                 dtype=torch.float64,     # dtype of the stored parameters
                 softmax:bool=False,      # the predecessor's softmax over target columns instead of raw scores
                ):
        super().__init__()
        D, g = 2 * (token_rows(d) - 2) + 1, torch_generator(seed)
        self.d, self.softmax = D // 2, bool(softmax)
        self.P, self.Q = xavier_param(D, D, init_gain, g, dtype), xavier_param(D, D, init_gain, g, dtype)

    def forward(self, Z:torch.Tensor,  # (..., 2d+1, n+q) prompt
                n:int=None,            # number of context columns (default: all but the last)
               )->torch.Tensor:        # (..., 2d+1, n+q)
        if Z.shape[-2] != 2 * self.d + 1: raise ValueError(f"`Z` must have {2 * self.d + 1} rows (2d+1 with d = {self.d}), got {Z.shape[-2]}")
        return linear_attention(self.P.to(Z), self.Q.to(Z), Z, _context_length(Z, n), self.softmax)


# %%
lay = LinearAttentionLayer(4, seed=0)
test_eq(lay.P.detach(), LinearAttentionLayer(4, seed=0).P.detach())
test_ne(lay.P.detach(), LinearAttentionLayer(4, seed=1).P.detach())
big = LinearAttentionLayer(40, init_gain=0.5, seed=0)
test_close(big.Q.detach().std().item(), 0.5 * (2 / (81 + 81)) ** 0.5, eps=0.01)
test_fail(lambda: LinearAttentionLayer(0), contains="`d` must be a positive integer")


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
# The construction's parameters, as tensors that may carry leading batch dimensions (one step size
# per seed, say) and stay differentiable in $\alpha$:

# %%
#| export
def td_parameters(d:int,       # feature dimension
                  alpha,       # step size: a number or a tensor of shape (...) (any real value, above 1 included)
                  C=None,      # (d, d) preconditioner, default identity
                  dtype=torch.float64,
                 )->tuple:     # (P, Q), each (..., 2d+1, 2d+1), differentiable in `alpha`
    "The parameters $(P, Q)$ under which a linear-attention layer is one step of batch linear TD with step `alpha`."
    alpha = torch.as_tensor(alpha, dtype=dtype)
    C = torch.eye(d, dtype=dtype) if C is None else as_tensor(C, "C", dtype)
    if C.shape != (d, d): raise ValueError(f"`C` must have shape ({d}, {d}), got {tuple(C.shape)}")
    D = 2 * d + 1
    P, U = torch.zeros(D, D, dtype=dtype), torch.zeros(D, D, dtype=dtype)
    P[-1, -1] = 1.
    U[:d, :d], U[:d, d:2 * d] = -C, C
    return P.expand(alpha.shape + (D, D)), alpha[..., None, None] * U


# %%
#| export
class LinearICTD(nn.Module):
    "A stack of linear-attention layers reading out the negated last row at the query columns."
    def __init__(self, d:int,          # feature dimension
                 n_layers:int,         # number of layers L
                 shared:bool=True,     # one (P, Q) pair for every layer, or one per layer
                 init_gain:float=0.1,  # gain of the Xavier-normal initialisation
                 seed=None,            # int or `torch.Generator` for the initialisation
                 dtype=torch.float64,
                 softmax:bool=False,   # the predecessor's softmax over target columns (an ablation)
                ):
        super().__init__()
        if int(n_layers) != n_layers or n_layers < 1: raise ValueError(f"`n_layers` must be a positive integer, got {n_layers}")
        g = torch_generator(seed)
        self.d, self.n_layers, self.shared = d, int(n_layers), shared
        self.layers = nn.ModuleList([LinearAttentionLayer(d, init_gain, g, dtype, softmax) for _ in range(1 if shared else self.n_layers)])

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

    def stacked_params(self)->tuple:
        "(P, Q), each (L', 2d+1, 2d+1) with L' = 1 when shared, else L."
        return torch.stack([l.P for l in self.layers]), torch.stack([l.Q for l in self.layers])

    @classmethod
    def from_td(cls, d:int,            # feature dimension
                n_layers:int,          # number of layers = TD iterations
                alpha:float,           # TD step size (any real value, above 1 included)
                C=None,                # (d, d) preconditioner, default identity
                dtype=torch.float64):
        "The construction whose forward pass is `n_layers` iterations of (preconditioned) batch linear TD."
        if not math.isfinite(float(alpha)): raise ValueError(f"`alpha` must be a finite number, got {alpha}")
        P, Q = td_parameters(d, float(alpha), C, dtype)
        model = cls(d, n_layers, shared=True, seed=0, dtype=dtype)
        with torch.no_grad(): model.layers[0].P.copy_(P); model.layers[0].Q.copy_(Q)
        return model


# %%
show_doc(LinearICTD.from_td)

# %% [markdown]
# The claim, checked: on random Boyan chains with random features, $L$ layers of the constructed
# linear Transformer equal $L$ iterations of `batch_linear_td` (from the
# [weighted softmax TD chapter](weighted_softmax_td.html)) at every query, in float64, for depths up
# to 50 and several queries at once; a scalar preconditioner $C = cI$ is the same as step $c\alpha$.
# The random initialisation is overwritten exactly.

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
P_td, Q_td = LinearICTD.from_td(4, 3, 2.5).stacked_params()
test_eq(((P_td != 0).sum().item(), (Q_td != 0).sum().item()), (1, 8))
test_close(LinearICTD.from_td(4, 3, 2.5).predict(Z, n=40), batch_linear_td(mrp.phi[S], R, 2.5, mrp.gamma, 3, phi_queries=mrp.phi)[..., 41:], eps=1e-9)
print("largest relative gap to batch linear TD over the 20 tasks: below 1e-12")

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
# And the reason for the initialisation: at zero parameters the gradient of the output vanishes
# identically, at the seeded Xavier draw it does not.

# %%
def output_gradient_norm(model):
    model.zero_grad(); model.predict(Zb, n=30).sum().backward()
    return sum(p.grad.norm() ** 2 for p in model.parameters()).sqrt().item()
zero_model = LinearICTD(4, 3, seed=0)
with torch.no_grad():
    for p in zero_model.parameters(): p.zero_()
test_eq(output_gradient_norm(zero_model), 0.)
assert output_gradient_norm(LinearICTD(4, 3, seed=0)) > 1e-3
output_gradient_norm(LinearICTD(4, 3, seed=0))


# %% [markdown]
# ## The layer as a $(2d+1) \times (2d+1)$ matrix
#
# One more fact makes training cheap. The score matrix and the product with $P$ associate:
# $(P Z M)(Z^\top Q Z) = P\,(Z M Z^\top)\,Q\,Z$, and $Z M Z^\top = \Sigma$ is the
# $(2d+1)\times(2d+1)$ second-moment matrix of the context columns. So one layer multiplies the
# whole prompt from the left by a small matrix,
#
# $$Z_{l+1} = A_l Z_l, \qquad A_l = I + \tfrac1n P_l \Sigma_l Q_l, \qquad \Sigma_{l+1} = A_l \Sigma_l A_l^\top,$$
#
# and an $L$-layer linear Transformer touches its context only through $\Sigma_0$. The forward
# pass below carries $\Sigma$ and the query columns instead of the whole prompt, with parameters that
# may have leading batch dimensions (a seed axis: many independently trained models in one call).

# %%
#| export
def moment_predict(P:torch.Tensor,  # (..., L', 2d+1, 2d+1), L' = 1 (shared) or n_layers; batch dims broadcast with Z's
                   Q:torch.Tensor,  # (..., L', 2d+1, 2d+1)
                   Z:torch.Tensor,  # (..., 2d+1, n+q) prompts
                   n:int,           # number of context columns
                   n_layers:int,    # depth L
                  )->torch.Tensor:  # (..., q) values at the query columns
    "The linear Transformer's values through $Z_{l+1} = (I + P \\Sigma_l Q / n) Z_l$: only the context's second moments and the queries are carried."
    C, z = Z[..., :n], Z[..., n:]
    Sigma, I = C @ C.mT, torch.eye(Z.shape[-2], dtype=Z.dtype, device=Z.device)
    for l in range(n_layers):
        k = 0 if P.shape[-3] == 1 else l
        A = I + P[..., k, :, :] @ Sigma @ Q[..., k, :, :] / n
        Sigma, z = A @ Sigma @ A.mT, A @ z
    return -z[..., -1, :]


# %%
seeds_models = [LinearICTD(4, 3, shared=s % 2 == 0, init_gain=0.5, seed=s) for s in range(4)]
for m in seeds_models:
    P_s, Q_s = m.stacked_params()
    test_close(moment_predict(P_s, Q_s, Zb, 30, 3), m.predict(Zb, n=30), eps=1e-12)
shared_models = [m for m in seeds_models if m.shared]
P_stack = torch.stack([m.stacked_params()[0] for m in shared_models])
Q_stack = torch.stack([m.stacked_params()[1] for m in shared_models])
stacked = moment_predict(P_stack[:, None], Q_stack[:, None], Zb, 30, 3)
test_eq(stacked.shape, (2, 6, 10))
for i, m in enumerate(shared_models): test_close(stacked[i], m.predict(Zb, n=30), eps=1e-12)


# %% [markdown]
# ## Did training find TD? The predecessor's measures
#
# The central experiment of Wang et al. (2025) pretrains this linear Transformer with a TD loss on
# many tasks and asks whether the trained parameters implement TD. Its measures, in the form we
# implement them (definitions as the predecessor's public code computes them; the code is ours):
#
# * **value functions in context**: put each state's feature into the query column of the same
#   context and read the answer: $v_{TF}(s)$ for the trained model, $v_{TD}(s)$ for the batch-TD
#   Transformer with one step size $\alpha$ fitted by the same TD loss (below);
# * **value difference** $\mathrm{VD} = \sum_s d_\pi(s)\,(v_{TF}(s) - v_{TD}(s))^2$;
# * **implicit weight similarity** (IWS): the cosine between $w_{TF}$, the $d_\pi$-weighted
#   least-squares fit of $v_{TF}$ on the features, and $w_{TD}$, the gradient of $v_{TD}$ with
#   respect to the query feature (the TD weight vector, since $v_{TD}$ is linear in the query);
# * **sensitivity similarity** (SS): $\sum_s d_\pi(s) \cos\big(\nabla_{\phi} v_{TF}(s), \nabla_{\phi} v_{TD}(s)\big)$,
#   the gradients taken with respect to the query feature;
# * the entries the construction predicts: $P[-1,-1]$ (1 times the step's share carried by $P$),
#   and the traces of the top-left and top-middle $d \times d$ blocks of $Q$ ($-\alpha d$ and
#   $+\alpha d$ up to that share).
#
# Since $(P, Q)$ and $(-P, -Q)$ give the same output, runs are **sign-aligned** by the sign of
# $P[-1,-1]$ before their matrices are averaged.
#
# For a linear-attention model IWS and SS coincide: by the matrix form above, every layer multiplies
# the query column by a matrix that depends on the context only, so $v_{TF}$ is linear in the query
# feature, its gradient is the same at every state, and the least-squares fit recovers that
# gradient exactly. They differ for a softmax model.

# %%
#| export
def query_each_state(Zc:torch.Tensor,   # (..., 2d+1, n) context columns
                     phi:torch.Tensor,  # (..., s, d) features of the states to query
                    )->torch.Tensor:    # (..., s, 2d+1, n+1): one prompt per state, its feature in the query column
    "One prompt per state: the same context, with that state's feature as the single query."
    D, d = Zc.shape[-2], phi.shape[-1]
    if D != 2 * d + 1: raise ValueError(f"`Zc` must have 2d+1 = {2 * d + 1} rows for features of dimension {d}, got {D}")
    s = phi.shape[-2]
    q = torch.cat([phi, phi.new_zeros(phi.shape[:-1] + (d + 1,))], -1).unsqueeze(-1)   # (..., s, D, 1)
    return torch.cat([Zc.unsqueeze(-3).expand(Zc.shape[:-2] + (s,) + Zc.shape[-2:]), q], -1)

def values_and_gradients(predict,            # callable Z (..., 2d+1, n+1) -> (..., 1) values at the query
                         Zc:torch.Tensor,    # (..., 2d+1, n) context columns
                         phi:torch.Tensor,   # (..., s, d) state features
                        )->tuple:            # (values (..., s), gradients wrt the query feature (..., s, d))
    "Each state's value in context and the gradient of that value with respect to the query feature."
    with torch.enable_grad():
        x = phi.detach().clone().requires_grad_(True)
        v = predict(query_each_state(Zc.detach(), x))[..., 0]
        g, = torch.autograd.grad(v.sum(), x)
    return v.detach(), g


# %%
#| export
def _cos(a, b, dim=-1): return (a * b).sum(dim) / (a.norm(dim=dim) * b.norm(dim=dim)).clamp(min=1e-300)

def value_difference(v_tf, v_td, d_pi)->torch.Tensor:
    "VD: $\\sum_s d_\\pi(s) (v_{TF}(s) - v_{TD}(s))^2$ over the last axis."
    return weighted_error(v_tf, v_td, d_pi)

def implicit_weight_similarity(v_tf:torch.Tensor,   # (..., s) the model's values
                               phi:torch.Tensor,    # (..., s, d) features
                               d_pi:torch.Tensor,   # (..., s) weights of the fit
                               w_td:torch.Tensor,   # (..., d) TD weight vector
                              )->torch.Tensor:      # (...) cosine of the fitted weight with w_td
    "IWS: cosine between the $d_\\pi$-weighted least-squares weight of `v_tf` on `phi` and `w_td`."
    A = phi.mT @ (d_pi.unsqueeze(-1) * phi)
    w_tf = torch.linalg.solve(A, (phi.mT @ (d_pi * v_tf).unsqueeze(-1))).squeeze(-1)
    return _cos(w_tf, w_td)

def sensitivity_similarity(g_tf, g_td, d_pi)->torch.Tensor:
    "SS: $\\sum_s d_\\pi(s) \\cos(g_{TF}(s), g_{TD}(s))$ for query gradients of shape (..., s, d)."
    return (d_pi * _cos(g_tf, g_td)).sum(-1)

def pq_summary(P:torch.Tensor,  # (..., 2d+1, 2d+1)
               Q:torch.Tensor,  # (..., 2d+1, 2d+1)
              )->dict:          # P_last, trQ11, trQ12, each (...)
    "The entries the TD construction predicts: $P[-1,-1]$, $\\mathrm{tr}\\,Q_{11}$ and $\\mathrm{tr}\\,Q_{12}$."
    d = P.shape[-1] // 2
    return dict(P_last=P[..., -1, -1], trQ11=Q[..., :d, :d].diagonal(dim1=-2, dim2=-1).sum(-1),
                trQ12=Q[..., :d, d:2 * d].diagonal(dim1=-2, dim2=-1).sum(-1))

def align_signs(P:torch.Tensor, Q:torch.Tensor)->tuple:
    "(P, Q) multiplied by the sign of P[-1, -1] (same output, comparable across runs)."
    s = torch.where(P[..., -1:, -1:] < 0, -1., 1.).to(P)
    return P * s, Q * s


# %% [markdown]
# The checks: the TD construction scored against itself has $\mathrm{IWS} = \mathrm{SS} = 1$ and
# $\mathrm{VD} = 0$; its sign-flipped copy too, and alignment undoes the flip; a perturbed model
# scores lower on every measure; and the summary entries of the construction are
# $(1, -\alpha d, +\alpha d)$.

# %%
mrp = random_boyan_chain(seed=3)
S, R = sample_trajectory(mrp, 30, seed=3)
Zc = build_linear_prompt(mrp.phi[S], R, mrp.phi[0], mrp.gamma)[..., :30]
P_td, Q_td = td_parameters(4, 0.7)
td_fn = lambda Z: moment_predict(P_td[None], Q_td[None], Z, 30, 3)
v_td, g_td = values_and_gradients(td_fn, Zc, mrp.phi)
test_close(g_td, g_td[:1].expand(10, 4), eps=1e-12)
def scores(P, Q):
    v, g = values_and_gradients(lambda Z: moment_predict(P[None], Q[None], Z, 30, 3), Zc, mrp.phi)
    return (implicit_weight_similarity(v, mrp.phi, mrp.d_pi, g_td[0]).item(), value_difference(v, v_td, mrp.d_pi).item(),
            sensitivity_similarity(g, g_td, mrp.d_pi).item())
test_close(scores(P_td, Q_td), (1., 0., 1.), eps=1e-12)
test_close(scores(-P_td, -Q_td), (1., 0., 1.), eps=1e-12)
test_eq(align_signs(-P_td, -Q_td), (P_td, Q_td))
noise = 0.3 * torch.randn(2, 9, 9, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
iws_p, vd_p, ss_p = scores(P_td + noise[0], Q_td + noise[1])
assert iws_p < 0.99 and vd_p > 1e-3 and ss_p < 0.99, (iws_p, vd_p, ss_p)
test_close(torch.stack(list(pq_summary(P_td, Q_td).values())), torch.tensor([1., -2.8, 2.8], dtype=torch.float64), eps=1e-12)
P_r, Q_r = LinearICTD(4, 3, init_gain=0.5, seed=4).stacked_params()
v_r, g_r = values_and_gradients(lambda Z: moment_predict(P_r.detach()[None], Q_r.detach()[None], Z, 30, 3), Zc, mrp.phi)
test_close(implicit_weight_similarity(v_r, mrp.phi, mrp.d_pi, g_td[0]), sensitivity_similarity(g_r, g_td, mrp.d_pi), eps=1e-10)
test_fail(lambda: query_each_state(Zc[:8], mrp.phi), contains="`Zc` must have 2d+1 = 9 rows")
iws_p, vd_p, ss_p


# %% [markdown]
# ## The predecessor's data: sliding windows
#
# The data protocol of Wang et al. (2025) differs from chapter 6's independent stationary prompts.
# For each task (a random Boyan chain with its own random features) it runs **5 mini-batches**; each
# mini-batch is **one trajectory** started from a random, not stationary, distribution $\mu$ of the
# task (entries uniform on $[0.01, 0.99]$, normalised), cut into **$B + 1$ consecutive overlapping
# windows** for a mini-batch size $B$ (counted from the sampler after the configuration below): window $k$ has the context transitions $S_k \to S_{k+1}, \dots, S_{k+n-1} \to S_{k+n}$
# and the query $S_{k+n+1}$. The TD error pairs window $k$'s query with window $k+1$'s, whose context
# has slid by one transition:
#
# $$\delta_k = r(S_{k+n+1}) + \gamma\, \mathrm{TF}(Z^{(k+1)}) - \mathrm{TF}(Z^{(k)}), \qquad
# \text{loss} = \frac1{B} \sum_{k<B} \delta_k^2 \text{ with } \mathrm{TF}(Z^{(k+1)}) \text{ held fixed}.$$
#
# Here is the sampler: tasks with their start distributions, one trajectory per task, and its
# windows as prompts.

# %%
#| export
def start_distributions(n_tasks:int,   # number of tasks
                        n_states:int,  # states per task
                        gen:torch.Generator, # source of randomness
                       )->torch.Tensor:      # (n_tasks, n_states), rows sum to 1
    "The predecessor's random start distributions: entries uniform on [0.01, 0.99], normalised."
    mu = 0.01 + 0.98 * torch.rand(n_tasks, n_states, generator=gen, dtype=torch.float64)
    return mu / mu.sum(-1, keepdim=True)

def sliding_windows(phi:torch.Tensor,   # (..., s, d) features of each trajectory's task
                    r:torch.Tensor,     # (..., s) rewards of each trajectory's task
                    states:torch.Tensor,# (..., T) trajectories, T >= n + 3
                    n:int,              # context length
                    gamma:float,        # discount factor
                   )->tuple:            # (Z (..., T-n-1, 2d+1, n+1) one prompt per window, rewards (..., T-n-2) r(query of window k))
    "Cut trajectories into overlapping windows: window k has context states k..k+n and query state k+n+1."
    T = states.shape[-1]
    if T < n + 3: raise ValueError(f"`states` must hold at least n + 3 = {n + 3} states for two windows, got {T}")
    phi_S = torch.gather(phi, -2, states.unsqueeze(-1).expand(states.shape + phi.shape[-1:]))
    r_S = torch.gather(r, -1, states)
    W = T - n - 1
    ctx = phi_S.unfold(-2, n + 1, 1)[..., :W, :, :].transpose(-1, -2)   # (..., W, n+1, d)
    Z = build_linear_prompt(ctx, r_S.unfold(-1, n, 1)[..., :W, :], phi_S[..., n + 1:, :], gamma)
    return Z, r_S[..., n + 1:T - 1]

def sliding_td_loss(v:torch.Tensor,       # (..., W) values of consecutive windows
                    rewards:torch.Tensor, # (..., W-1) reward of each window's query state
                    gamma:float,          # discount factor
                   )->torch.Tensor:       # (...) mean squared TD error, successor's value held fixed
    "The predecessor's loss: mean over windows of $(r + \\gamma\\,\\mathrm{TF}(Z^{(k+1)}) - \\mathrm{TF}(Z^{(k)}))^2$, the first term detached."
    return (rewards + gamma * v[..., 1:].detach() - v[..., :-1]).square().mean(-1)


# %%
show_doc(sliding_windows)

# %% [markdown]
# A check against the definition, window by window, on one short trajectory: contexts, queries and
# rewards line up, and consecutive windows overlap in all but one transition.

# %%
mrp = random_boyan_chain(seed=5)
gen = torch.Generator().manual_seed(0)
mu = start_distributions(1, 10, gen)
states = sample_trajectories(mrp.P[None], 12, mu, seed=gen)[0]
Zw, rw = sliding_windows(mrp.phi, mrp.r, states, 8, mrp.gamma)
test_eq((Zw.shape, rw.shape), ((4, 9, 9), (3,)))
for k in range(4):
    test_eq(Zw[k], build_linear_prompt(mrp.phi[states[k:k + 9]], mrp.r[states[k:k + 8]], mrp.phi[states[k + 9]], mrp.gamma))
    if k < 3: test_eq(rw[k], mrp.r[states[k + 9]])
test_eq(Zw[1, :, :7], Zw[0, :, 1:8])
test_close(mu.sum(), 1., eps=1e-12)
assert 0.01 / 0.99 / 10 < mu.min() and mu.max() < 0.99 / 0.01 / 10
test_fail(lambda: sliding_windows(mrp.phi, mrp.r, states[:10], 8, 0.9), contains="at least n + 3 = 11 states")
v_demo = torch.tensor([1., 2., 3.], requires_grad=True)
loss = sliding_td_loss(v_demo, torch.tensor([0.5, -1.]), 0.5)
loss.backward()
test_close(loss.item(), ((0.5 + 1 - 1) ** 2 + (-1 + 1.5 - 2) ** 2) / 2, eps=1e-12)
test_close(v_demo.grad, torch.tensor([-0.5, 1.5, 0.]), eps=1e-12)


# %% [markdown]
# ## The batch-TD companion and its step size
#
# VD and IWS compare the trained model with batch TD at *one* step size $\alpha$, and the predecessor
# fits that step size with the same TD loss: the batch-TD Transformer's only parameter $\alpha$
# follows the semi-gradient $g(\alpha) = \mathbb E[\delta\, \partial v_{TD}/\partial\alpha]$ of the
# sliding-window loss, started at $\alpha = 1$. The fitted $\alpha$ does not depend on the trained
# model, only on the task distribution, so we compute once the point where $g$ changes sign from
# $+$ to $-$ nearest to 1 (the stable point of its flow from $\alpha = 1$). (The predecessor trains
# $\alpha$ alongside the model with Adam; we do not train it, and have not checked where a trained
# $\alpha$ ends; the spread of the single-chunk fits below shows how far a fit on few tasks can sit from it.)
#
# This is cheap and exact because $v_{TD}$ is a polynomial of degree $L$ in $\alpha$. Batch TD on
# a window's context is $w \leftarrow w + \alpha(b - Mw)$ with $M = \frac1n\sum_i \phi(S_i)(\phi(S_i) -
# \gamma\phi(S_{i+1}))^\top$ and $b = \frac1n \sum_i R_{i+1}\phi(S_i)$, so from $w_0 = 0$
#
# $$w_L = \sum_{j=1}^{L} \binom{L}{j} (-1)^{j-1} \alpha^j M^{j-1} b ,$$
#
# and $g$ is a polynomial of degree $2L - 1$ whose coefficients are averages over windows. The
# windows' $M$ and $b$ are differences of running sums along each trajectory.

# %%
#| export
def sliding_td_coefficients(phi:torch.Tensor,    # (..., s, d) features of each trajectory's task
                            r:torch.Tensor,      # (..., s) rewards
                            states:torch.Tensor, # (..., T) trajectories
                            n:int,               # context length
                            gamma:float,         # discount factor
                            n_layers:int,        # depth L
                           )->tuple:             # (coefficients (..., T-n-1, L+1) of v_TD(alpha) at each window's query, rewards (..., T-n-2))
    "Each sliding window's batch-TD value at its query as a polynomial in the step size (the windows of `sliding_windows`)."
    phi_S = torch.gather(phi, -2, states.unsqueeze(-1).expand(states.shape + phi.shape[-1:]))
    r_S = torch.gather(r, -1, states)
    T, W = states.shape[-1], states.shape[-1] - n - 1
    A = phi_S[..., :-1, :, None] * (phi_S[..., :-1, None, :] - gamma * phi_S[..., 1:, None, :])   # (..., T-1, d, d)
    c = phi_S[..., :-1, :] * r_S[..., :-1, None]                                                 # (..., T-1, d)
    cA = torch.cat([torch.zeros_like(A[..., :1, :, :]), A.cumsum(-3)], -3)
    cc = torch.cat([torch.zeros_like(c[..., :1, :]), c.cumsum(-2)], -2)
    M, u = (cA[..., n:n + W, :, :] - cA[..., :W, :, :]) / n, (cc[..., n:n + W, :] - cc[..., :W, :]) / n
    q, coef = phi_S[..., n + 1:, :], [torch.zeros_like(r_S[..., n + 1:])]
    for j in range(1, n_layers + 1):
        coef.append(math.comb(n_layers, j) * (-1) ** (j - 1) * (q * u).sum(-1))
        u = (M @ u.unsqueeze(-1)).squeeze(-1)
    return torch.stack(coef, -1), r_S[..., n + 1:T - 1]


# %%
#| export
def td_semigradient_poly(coef:torch.Tensor,     # (..., W, L+1) value coefficients of consecutive windows
                         rewards:torch.Tensor,  # (..., W-1) reward of each window's query
                         gamma:float,           # discount factor
                        )->np.polynomial.Polynomial: # g(alpha) = mean of delta_k * dv_k/dalpha
    "The expected semi-gradient of the sliding-window TD loss in alpha, as a polynomial (mean over all windows given)."
    delta = gamma * coef[..., 1:, :] - coef[..., :-1, :]
    delta[..., 0] += rewards
    d_v = coef[..., :-1, 1:] * torch.arange(1, coef.shape[-1], dtype=coef.dtype)
    prod = torch.stack([sum(delta[..., i] * d_v[..., k - i] for i in range(delta.shape[-1]) if 0 <= k - i < d_v.shape[-1])
                        for k in range(delta.shape[-1] + d_v.shape[-1] - 1)], -1)
    return np.polynomial.Polynomial(prod.flatten(0, -2).mean(0).numpy())

def fit_td_step(g:np.polynomial.Polynomial,  # expected semi-gradient in alpha
               )->float:                      # the stable step size reached from alpha = 1
    "The sign change of `g` from + to - nearest to alpha = 1 in the direction `g(1)` points."
    roots = sorted(r.real for r in g.roots() if abs(r.imag) < 1e-9 and r.real > 0 and g.deriv()(r.real) < 0)
    pick = [r for r in roots if r >= 1] if g(1.) > 0 else [r for r in roots[::-1] if r <= 1]
    if not pick: raise ValueError(f"no stable step size in the direction of the semi-gradient from alpha = 1 (g(1) = {g(1.):.3g})")
    return float(pick[0])


# %% [markdown]
# Checks: the polynomial reproduces the batch-TD Transformer's values at the windows' queries at an
# arbitrary step size, and the polynomial semi-gradient equals the one autograd computes through
# the Transformer.

# %%
mrp = random_boyan_chain(seed=11)
gen = torch.Generator().manual_seed(1)
states = sample_trajectories(mrp.P[None].expand(3, 10, 10), 40, start_distributions(3, 10, gen), seed=gen)
phi3, r3 = mrp.phi.expand(3, 10, 4), mrp.r.expand(3, 10)
Zw, rw = sliding_windows(phi3, r3, states, 30, mrp.gamma)
coef, rw2 = sliding_td_coefficients(phi3, r3, states, 30, mrp.gamma, 3)
test_eq(rw2, rw)
a = torch.tensor(2.7, dtype=torch.float64, requires_grad=True)
v = moment_predict(*(t[None] for t in td_parameters(4, a)), Zw, 30, 3)[..., 0]
test_close((coef * 2.7 ** torch.arange(4, dtype=torch.float64)).sum(-1), v.detach(), eps=1e-10)
auto, = torch.autograd.grad(((rw + mrp.gamma * v[..., 1:] - v[..., :-1]).detach() * v[..., :-1]).mean(), a)
test_close(td_semigradient_poly(coef, rw, mrp.gamma)(2.7), auto.item(), eps=1e-10)

# %%
#| export
FIT_CHUNK, FIT_TRAJECTORIES, FIT_STEPS = 64, 5, 65   # tasks per chunk, trajectories per task, steps per trajectory beyond n

@functools.lru_cache(maxsize=16)
def td_semigradient_chunks(n:int, n_layers:int, gamma:float, n_states:int=10, d:int=4,
                           n_tasks:int=1024,  # fresh tasks, in chunks of FIT_CHUNK, FIT_TRAJECTORIES trajectories each
                          )->tuple:           # one semi-gradient polynomial per chunk of FIT_CHUNK tasks
    "The sliding-window TD semi-gradient of the batch-TD Transformer in its step size, per chunk of fresh tasks (cached)."
    polys, rep = [], lambda x: x.repeat_interleave(FIT_TRAJECTORIES, 0)
    for first in range(0, n_tasks, FIT_CHUNK):
        tasks = random_tasks(min(FIT_CHUNK, n_tasks - first), seed=123_456 + first, n_states=n_states, d=d, gamma=gamma)
        gen = torch.Generator().manual_seed(first)
        states = sample_trajectories(rep(tasks.P), n + FIT_STEPS, rep(start_distributions(len(tasks), n_states, gen)), seed=gen)
        polys.append(td_semigradient_poly(*sliding_td_coefficients(rep(tasks.phi), rep(tasks.r), states, n, gamma, n_layers), gamma))
    return tuple(polys)

def fitted_td_step(n:int, n_layers:int, gamma:float, n_states:int=10, d:int=4, n_tasks:int=1024)->float:
    "The batch-TD Transformer's step size fitted by the sliding-window TD loss on `n_tasks` fresh tasks."
    polys = td_semigradient_chunks(n, n_layers, gamma, n_states, d, n_tasks)
    return fit_td_step(sum(polys[1:], polys[0]) / len(polys))


# %% [markdown]
# For the predecessor's setting ($d = 4$, 10 states, $n = 30$, $L = 3$, $\gamma = 0.9$), on the
# default number of fresh tasks, with the standard error of the fit estimated from its chunks of
# tasks fitted separately (the counts below are read from the code's defaults and a sampled trajectory):

# %%
alpha_td = fitted_td_step(30, 3, 0.9)
chunks = td_semigradient_chunks(30, 3, 0.9)
n_fit_tasks = inspect.signature(td_semigradient_chunks).parameters["n_tasks"].default
probe = sample_trajectories(mrp.P[None], 30 + FIT_STEPS, start_distributions(1, 10, gen), seed=gen)
n_windows = sliding_windows(mrp.phi[None], mrp.r[None], probe, 30, mrp.gamma)[0].shape[-3]
n_td_errors = n_fit_tasks * FIT_TRAJECTORIES * (n_windows - 1)
test_eq(len(chunks), -(-n_fit_tasks // FIT_CHUNK))
chunk_fits = torch.tensor([fit_td_step(p) for p in chunks])
g_mean = sum(chunks[1:], chunks[0]) / len(chunks)
assert g_mean(alpha_td - 0.02) > 0 > g_mean(alpha_td + 0.02)
se_td = (chunk_fits.std() / len(chunks) ** 0.5).item()
assert abs(chunk_fits.mean().item() - alpha_td) < 3 * se_td, (chunk_fits, alpha_td)
Markdown(f"{n_fit_tasks} tasks, {FIT_TRAJECTORIES} trajectories each, {n_windows} windows and {n_windows - 1} TD errors per "
         f"trajectory: {n_td_errors} TD errors in {len(chunks)} chunks of {FIT_CHUNK} tasks. Fitted step size "
         f"$\\alpha_{{TD}}$ = {alpha_td:.3f} $\\pm$ {se_td:.3f} (s.e. over the {len(chunks)} chunk fits, whose mean is within "
         f"3 s.e. of the pooled fit); single-chunk fits range from {chunk_fits.min():.2f} to {chunk_fits.max():.2f}.")

# %% [markdown]
# ## Pretraining the linear Transformer
#
# The linear family plugs into the pretraining engine of [chapter 6](pretrain.html): its stacked
# parameters $(P, Q)$ with a leading seed axis, its prompts, its forward pass (the matrix form
# above) and its measures are registered under `PretrainConfig(attention="linear")`, so
# `pretrain_many` trains linear Transformers on any data protocol the engine knows.
#
# `ICLR_LINEAR` holds the predecessor's settings: $d = 4$ random features, 10 states, $n = 30$,
# $L = 3$ layers sharing one $(P, Q)$, $\gamma = 0.9$, Adam with learning rate $10^{-3}$ and weight
# decay $10^{-6}$, Xavier-normal initialisation with gain $0.1$, mini-batches of `batch_size` TD
# errors (one trajectory's $B + 1$ windows; the counts are printed after the protocol below), 5
# mini-batches per task, 4000 tasks (`n_tasks`, so `n_steps` = 20000 optimiser steps), the
# sliding-window protocol. Every `eval_every` steps we record, on 32 held-out tasks per seed
# (contexts of $n$ transitions from the task's random start distribution, as the predecessor
# evaluates), the measures defined above under the names `iws`, `vd`, `ss`, `msve` (against the
# true values), and the entries `P_last`, `trQ11`, `trQ12` of the last layer.

# %%
#| export
ICLR_LINEAR = PretrainConfig(attention="linear", protocol="sliding", shared=True, n_tasks=4000, n_steps=20_000,
                             batch_size=64, eval_every=1250, eval_tasks=32, lr=1e-3, weight_decay=1e-6, init_gain=0.1)

def linear_init(config:PretrainConfig, seeds:list, dtype=torch.float64)->dict:
    "Each seed's `LinearICTD` initialisation, stacked: P and Q of shape (S, L or 1, 2d+1, 2d+1)."
    if config.init != "xavier": raise ValueError(f"`init` must be 'xavier' for the linear family, got {config.init!r}")
    models = [LinearICTD(config.feature_dim, config.n_layers, config.shared, config.init_gain, seed=int(s)) for s in seeds]
    return {k: torch.stack([torch.stack([getattr(lay, k).detach() for lay in m.layers]) for m in models]).to(dtype) for k in ("P", "Q")}

def linear_prompt(config:PretrainConfig, x:Contexts)->torch.Tensor:
    "The engine's prompts as linear-attention prompts (S, B..., 2d+1, n+q)."
    return build_linear_prompt(*x.features(), config.gamma)

def linear_predict(config:PretrainConfig, params:dict, Z:torch.Tensor, n:int)->torch.Tensor:
    "(S, B, q) values of every seed's linear Transformer, through the matrix form."
    P = params["P"]
    return moment_predict(P[:, None], params["Q"][:, None], Z.to(P.dtype), n, config.n_layers)

def linear_module(config:PretrainConfig, params:dict)->LinearICTD:
    "A `LinearICTD` carrying one seed's parameters (L or 1, 2d+1, 2d+1)."
    model = LinearICTD(config.feature_dim, config.n_layers, config.shared, seed=0, dtype=params["P"].dtype)
    model.load_state_dict({f"layers.{l}.{k}": params[k][l] for l in range(params["P"].shape[0]) for k in ("P", "Q")})
    return model


# %%
#| export
def linear_measures(P:torch.Tensor,   # (S, L', 2d+1, 2d+1) stacked parameters
                    Q:torch.Tensor,   # (S, L', 2d+1, 2d+1)
                    tasks:TaskBatch,  # held-out tasks with a seed axis (S, E, ...)
                    Zc:torch.Tensor,  # (S, E, 2d+1, n) their contexts
                    alpha:float,      # step size of the batch-TD Transformer
                    n_layers:int,     # depth L
                   )->dict:           # name -> (S,) mean over the held-out tasks (and P_last, trQ11, trQ12 of the last layer)
    "The predecessor's measures of how close trained linear Transformers are to batch TD, one value per seed."
    n, d = Zc.shape[-1], Zc.shape[-2] // 2
    P, Q = P.detach(), Q.detach()
    v_tf, g_tf = values_and_gradients(lambda Z: moment_predict(P[:, None, None], Q[:, None, None], Z, n, n_layers), Zc, tasks.phi)
    P_td, Q_td = td_parameters(d, alpha)
    v_td, g_td = values_and_gradients(lambda Z: moment_predict(P_td[None], Q_td[None], Z, n, n_layers), Zc, tasks.phi)
    out = dict(iws=implicit_weight_similarity(v_tf, tasks.phi, tasks.d_pi, g_td[..., 0, :]), vd=value_difference(v_tf, v_td, tasks.d_pi),
               ss=sensitivity_similarity(g_tf, g_td, tasks.d_pi), msve=value_difference(v_tf, tasks.v_pi, tasks.d_pi))
    return {k: v.mean(-1) for k, v in out.items()} | pq_summary(P[:, -1], Q[:, -1])

def linear_metrics(config:PretrainConfig, params:dict, ev)->dict:
    "The engine's hook: `linear_measures` on the engine's held-out contexts, each (S, 1)."
    alpha = fitted_td_step(config.n, config.n_layers, config.gamma, config.n_states, config.feature_dim)
    out = linear_measures(params["P"], params["Q"], ev.tasks, ev.x[..., :config.n], alpha, config.n_layers)
    return {k: v[:, None] for k, v in out.items() if k != "msve"}

register_family("linear", Family(init=linear_init, prompt=linear_prompt, predict=linear_predict, module=linear_module, metrics=linear_metrics))

# %% [markdown]
# The family on the engine's own (stationary) protocol, two seeds: each stacked run equals the
# module built from its parameters, and its initialisation is the seed's own.

# %%
cfg_stat = PretrainConfig(attention="linear", shared=True, n_steps=20, eval_every=10, n_tasks=64, eval_tasks=8, batch_size=16)
runs = pretrain_many(cfg_stat, [3, 4], progress=False)
test_eq(linear_init(cfg_stat, [4])["P"][0, 0], LinearICTD(4, 3, seed=4).layers[0].P.detach())
mrp_s = random_boyan_chain(seed=21)
S_s, R_s = sample_trajectory(mrp_s, 25, seed=21)
Zs = build_linear_prompt(mrp_s.phi[S_s], R_s, mrp_s.phi, mrp_s.gamma)
for r in runs:
    test_eq(type(r.model), LinearICTD)
    p = {k: v.detach()[None] for k, v in zip(("P", "Q"), r.model.stacked_params())}
    test_close(linear_predict(cfg_stat, p, Zs[None, None], 25)[0, 0], r.model.predict(Zs, n=25), eps=1e-12)
test_eq(sorted(runs[0].history), sorted(["step", "loss", "msve", "neu", "iws", "vd", "ss", "P_last", "trQ11", "trQ12"]))
assert not torch.equal(runs[0].model.layers[0].P, LinearICTD(4, 3, seed=3).layers[0].P)

# %% [markdown]
# The predecessor's **sliding protocol** is a protocol of the engine. Its tasks come in order: each
# seed's task $k$ is task $k$ of its pool (`task_pool(config, ., seed * 1_000_003 + k)`), drawn
# `SLIDING_CHUNK` at a time with their random start distributions and trajectories from the seed's
# own generator; the $n_\text{steps} / n_\text{tasks}$ steps on a task each take one trajectory of
# $n + B + 2$ states and cut it into the $B + 1$ overlapping windows of `sliding_windows`, each
# window's successor being the *next window* (`TDExamples(successor="next")`). Its loss is the
# predecessor's mean squared TD error, without a factor $\frac12$ (`loss_scale=1`). The held-out
# contexts start from random start distributions too.

# %%
#| export
SLIDING_CHUNK = 25   # tasks of a seed drawn together (with their trajectories) by the sliding protocol

def _per_task(config:PretrainConfig)->int:
    if config.n_steps % config.n_tasks: raise ValueError(f"`n_steps` must be a multiple of `n_tasks` for the sliding protocol (mini-batches per task), got {config.n_steps} and {config.n_tasks}")
    return config.n_steps // config.n_tasks

def sliding_chunk(config:PretrainConfig, seeds:list, gens:list, first:int)->dict:
    "Tasks first.. of every seed (up to SLIDING_CHUNK; TaskBatch tensors (S, count, ...)) and their trajectories `states` (S, count, per task, n + B + 2)."
    count, per_task, T = min(SLIDING_CHUNK, config.n_tasks - first), _per_task(config), config.n + config.batch_size + 1
    pools, states = [], []
    for s, g in zip(seeds, gens):
        pools.append(task_pool(config, count, s * 1_000_003 + first))
        mu = start_distributions(count, config.n_states, g).repeat_interleave(per_task, 0)
        states.append(sample_trajectories(pools[-1].P.repeat_interleave(per_task, 0), T, mu, seed=g).unflatten(0, (count, per_task)))
    pool = stack_pools(pools)
    return dict(P=pool.P, r=pool.r, phi=pool.phi, d_pi=pool.d_pi, v_pi=pool.v_pi, states=torch.stack(states))

def sliding_sample(config:PretrainConfig, data:dict, gens:list, step:int, state:dict)->TDExamples:
    "Step `step` of the sliding protocol: the B + 1 consecutive windows of one trajectory of every seed, each window's successor the next."
    per_task, device = _per_task(config), data["device"]
    task = step // per_task
    if step % (SLIDING_CHUNK * per_task) == 0: state.update(sliding_chunk(config, data["seeds"], gens, task))
    tasks = TaskBatch(*(state[k].to(device) for k in ("P", "r", "phi", "d_pi", "v_pi")), config.gamma)
    windows = state["states"][:, task % SLIDING_CHUNK, step % per_task].to(device).unfold(-1, config.n + 2, 1)   # (S, B + 1, n + 2)
    index = torch.full(windows.shape[:2], task % SLIDING_CHUNK, device=device)
    x = Contexts(tasks, index, windows[..., :-1], windows[..., -1:])
    return TDExamples(x, task_features(tasks, index[:, :-1], windows[:, :-1, -1])[1], successor="next")

def sliding_eval_set(config:PretrainConfig, seeds:list, device=None)->EvalSet:
    "Each seed's held-out tasks, with one context per task from a random start distribution (generator seeded seed + 17)."
    pools, states = [], []
    for s in seeds:
        pools.append(task_pool(config, config.eval_tasks, s * 1_000_003 + config.n_tasks))
        gen = torch.Generator().manual_seed(s + 17)
        states.append(sample_trajectories(pools[-1].P, config.n, start_distributions(config.eval_tasks, config.n_states, gen), seed=gen))
    return task_eval_set(config, stack_pools(pools, device), torch.stack(states).to(device))

register_protocol("sliding", Protocol(sample=sliding_sample, eval_set=sliding_eval_set, loss_scale=1.,
                                      data=lambda config, seeds, device: dict(seeds=seeds, device=device, per_task=_per_task(config))))

# %%
small_sliding = dataclasses.replace(ICLR_LINEAR, n_tasks=30, n_steps=60, eval_every=20, eval_tasks=4)
tiny, tiny_alone = pretrain_many(small_sliding, [1, 2], progress=False), pretrain_many(small_sliding, [2], progress=False)
test_close(tiny[1].params["P"], tiny_alone[0].params["P"], eps=1e-12)
test_close(tiny[1].history["iws"], tiny_alone[0].history["iws"], eps=1e-12)
test_eq(tiny[0].history["step"].flatten(), torch.tensor([0, 20, 40, 60]))
test_fail(lambda: pretrain_many(dataclasses.replace(small_sliding, n_steps=61), [0]), contains="`n_steps` must be a multiple of `n_tasks`")
batch = sliding_sample(ICLR_LINEAR, dict(seeds=[0], device="cpu"), [torch.Generator().manual_seed(0)], 0, {})
n_win = batch.x.states.shape[-2]   # (seeds, windows, n + 1) context states
test_eq(n_win, ICLR_LINEAR.batch_size + 1)
print(f"one mini-batch of the predecessor's configuration: {n_win} windows, {n_win - 1} TD errors (batch_size = {ICLR_LINEAR.batch_size})")

# %% [markdown]
# The published numbers we compare with are the predecessor's (Wang et al. 2025, as reported in
# the issue that asked for this reproduction): the means over 30 seeds after 4000 tasks, and one
# seed after 5000 tasks. They appear as the last rows of every table below.

# %%
#| export
ICLR_REFERENCE = dict(tasks=4000, iws=0.93, vd=(0.02, 0.03), P_last=1.6, trQ11=-4.3, trQ12=3.3)   # mean over 30 seeds
ICLR_SEED0 = dict(tasks=5000, iws=0.990, vd=0.0053, P_last=2.06, trQ11=-6.31, trQ12=4.75)           # the predecessor's seed 0

def aligned_history(results:list)->dict:
    "Runs of one configuration: their history (S, evaluations), with `tasks` seen and P_last, trQ11, trQ12 multiplied by the sign of each run's final P[-1, -1]."
    c = results[0].config
    h = {k: v.squeeze(-1).double() for k, v in stack_results(results)["history"].items() if not k.startswith("param.")}
    h["tasks"] = h["step"] * c.n_tasks / c.n_steps
    sign = torch.where(h["P_last"][:, -1:] < 0, -1., 1.).to(h["P_last"])
    for k in ("P_last", "trQ11", "trQ12"): h[k] = h[k] * sign
    return h

def summarise_linear(results:list)->dict:
    "Mean and standard error over seeds of every measure at the last evaluation (sign-aligned), as plain numbers."
    h, c = aligned_history(results), results[0].config
    S = h["iws"].shape[0]
    return {k: dict(mean=v[:, -1].mean().item(), se=(v[:, -1].std().item() / S ** 0.5 if S > 1 else math.nan))
            for k, v in h.items() if k not in ("tasks", "step")} | dict(tasks=int(h["tasks"][0, -1]), seeds=S, alpha_td=fitted_td_step(c.n, c.n_layers, c.gamma, c.n_states, c.feature_dim))


# %%
#| export
def plot_linear_pretraining(results:list,          # runs of the sliding protocol (`pretrain_many`), one per seed
                            reference:dict=ICLR_REFERENCE,  # published values to mark, or None
                            title:str=None,
                           ):                      # the matplotlib figure
    "Bands (mean and 2 standard errors over seeds) of the measures against tasks seen, sign-aligned, with the published values."
    import matplotlib.pyplot as plt
    h = aligned_history(results)
    x, S = h["tasks"][0].numpy(), h["iws"].shape[0]
    fig, axs = plt.subplots(1, 3, figsize=(8, 3.2))
    def band(ax, key, label):
        m, se = h[key].mean(0).numpy(), (h[key].std(0) / S ** 0.5).numpy()
        ax.plot(x, m, label=label)
        ax.fill_between(x, m - 2 * se, m + 2 * se, alpha=0.25)
    band(axs[0], "iws", "IWS (= SS here)")
    band(axs[1], "vd", "VD")
    for key, label in (("P_last", "$P[-1,-1]$"), ("trQ11", r"tr $Q_{11}$"), ("trQ12", r"tr $Q_{12}$")): band(axs[2], key, label)
    if reference:
        axs[0].plot(reference["tasks"], reference["iws"], "k*", label="published, 30 seeds")
        axs[1].plot([reference["tasks"]] * 2, reference["vd"], "k-", lw=3, label="published range")
        for key in ("P_last", "trQ11", "trQ12"): axs[2].plot(reference["tasks"], reference[key], "k*")
    axs[0].set(ylabel="cosine", ylim=(-0.05, 1.05), title="implicit weight similarity")
    axs[1].set(yscale="log", ylabel="squared return units", title="value difference to batch TD")
    axs[2].set(ylabel="entry / trace", title="learned P and Q (sign-aligned)")
    for ax in axs:
        ax.set_xlabel("tasks seen")
        ax.legend(fontsize=7.5)
    fig.suptitle(title or f"Linear Transformer, sliding-window TD pretraining: mean and 2 s.e. over {S} seeds", fontsize=10)
    fig.tight_layout()
    return fig

def plot_pq(P:torch.Tensor,   # (S, 2d+1, 2d+1) one layer's P per seed
            Q:torch.Tensor,   # (S, 2d+1, 2d+1)
           ):                 # the matplotlib figure
    "Heat maps of the sign-aligned mean P and Q over seeds."
    import matplotlib.pyplot as plt
    S = P.shape[0]
    P, Q = (m.mean(0).numpy() for m in align_signs(P, Q))
    fig, axs = plt.subplots(1, 2, figsize=(8, 3.6))
    for ax, M, name in zip(axs, (P, Q), ("P", "Q")):
        lim = abs(M).max()
        im = ax.imshow(M, cmap="RdBu_r", vmin=-lim, vmax=lim)
        ax.set(title=f"mean {name} over {S} seeds, sign-aligned", xlabel="column", ylabel="row")
        fig.colorbar(im, ax=ax, shrink=0.85)
    fig.tight_layout()
    return fig


# %% [markdown]
# ### The book's run
#
# The full protocol (20000 optimiser steps) takes minutes per seed on a CPU, so the book runs a
# shorter version: 10 seeds, 400 tasks (2000 steps), learning rate $3 \cdot 10^{-3}$ instead of $10^{-3}$, every
# other setting as `ICLR_LINEAR`. The `#| slow` cell further down runs the full protocol for 30 seeds.

# %%
fast_linear = dataclasses.replace(ICLR_LINEAR, lr=3e-3, n_tasks=400, n_steps=2000, eval_every=250)
lin = pretrain_many(fast_linear, range(10), progress=False)
plot_linear_pretraining(lin, reference=None, title=f"Linear Transformer, sliding-window TD, lr = {fast_linear.lr:g}: mean and 2 s.e. over 10 seeds");

# %%
lin_params = stack_results(lin)["params"]
plot_pq(lin_params["P"][:, -1], lin_params["Q"][:, -1]);


# %%
#| export
def reference_table(summaries:dict,             # label -> output of `summarise_linear`
                    reference:dict=ICLR_REFERENCE,
                   )->str:                      # a Markdown table
    "Mean (standard error) over seeds of each measure per run, next to the published values."
    keys = ("iws", "vd", "P_last", "trQ11", "trQ12")
    fmt = lambda s, k: f"{s[k]['mean']:.3g} ({s[k]['se']:.2g})"
    ref = lambda k: "-".join(f"{x:g}" for x in reference[k]) if isinstance(reference[k], tuple) else f"{reference[k]:g}"
    rows = [f"| {label} | {s['seeds']} | {s['tasks']} | " + " | ".join(fmt(s, k) for k in keys) + " |" for label, s in summaries.items()]
    rows.append(f"| published (Wang et al. 2025) | 30 | {reference['tasks']} | " + " | ".join(ref(k) for k in keys) + " |")
    rows.append(f"| published, seed 0 | 1 | {ICLR_SEED0['tasks']} | " + " | ".join(f"{ICLR_SEED0[k]:g}" for k in keys) + " |")
    return ("| run | seeds | tasks | IWS | VD | $P[-1,-1]$ | tr $Q_{11}$ | tr $Q_{12}$ |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows))


# %%
Markdown(reference_table({f"book run (lr {fast_linear.lr:g})": summarise_linear(lin)}))


# %% [markdown]
# What the run shows, as statements about seeds (each seed is one independent run, so the number of
# seeds with a property is binomial; we print a one-sided 95% Clopper-Pearson lower bound on the
# probability that a run has it):
#
# * the implicit weight similarity rises from near 0 to above $0.85$, and the value difference to
#   batch TD falls below $0.05$, in most seeds;
# * after sign alignment, every seed has the construction's sign pattern: $\mathrm{tr}\,Q_{11} < 0 <
#   \mathrm{tr}\,Q_{12}$ (the mean heat maps show the two $-/+$ diagonal blocks of $Q$ and the
#   bottom-right entry of $P$);
# * the magnitudes are below the published ones, since this run has seen a tenth of the tasks; the
#   seeds that lag are slow to leave the small initialisation rather than heading elsewhere (their
#   entries have the same signs, smaller).

# %%
def lower_bound(k:int, n:int, level:float=0.95)->float:
    "One-sided Clopper-Pearson lower confidence bound on a success probability after k successes in n trials."
    tail = lambda p: sum(math.comb(n, j) * p ** j * (1 - p) ** (n - j) for j in range(k, n + 1))
    lo, hi = 0., 1.
    for _ in range(60): lo, hi = ((lo + hi) / 2, hi) if tail((lo + hi) / 2) < 1 - level else (lo, (lo + hi) / 2)
    return lo if k else 0.

h_lin = aligned_history(lin)
claims = {"IWS > 0.85": h_lin["iws"][:, -1] > 0.85, "VD < 0.05": h_lin["vd"][:, -1] < 0.05,
          "tr Q11 < 0 < tr Q12": (h_lin["trQ11"][:, -1] < 0) & (h_lin["trQ12"][:, -1] > 0), "IWS rose by > 0.5": h_lin["iws"][:, -1] > h_lin["iws"][:, 0] + 0.5}
counts = {k: int(v.sum()) for k, v in claims.items()}
assert counts["IWS > 0.85"] >= 7 and counts["VD < 0.05"] >= 7 and counts["IWS rose by > 0.5"] >= 8, counts
assert counts["tr Q11 < 0 < tr Q12"] >= 9, counts
{k: f"{c} of 10 seeds (p >= {lower_bound(c, 10):.2f})" for k, c in counts.items()}


# %% [markdown]
# ### The full protocol
#
# `reproduce_iclr` runs `ICLR_LINEAR` (by default for 30 seeds) and writes a small JSON summary:
# the sign-aligned mean and standard error of every measure at every evaluation, each seed's final
# values and the sign-aligned mean $P$ and $Q$. At full scale it takes minutes per seed on one CPU
# thread, so it is `#| slow` here; the cell after it shows every summary saved in `nbs/data/`. The
# files there were written by the same function, for 10 seeds
# (`python -c "from ictd.linear import *; reproduce_iclr(seeds=range(10), out='nbs/data/iclr_linear_10seeds.json')"`,
# 488 s) and for the published 30 seeds (the slow cell below, or `ictd linear --reproduce-seeds 0-29`;
# about 20 minutes of one CPU thread).

# %%
#| export
def reproduce_iclr(config:PretrainConfig=ICLR_LINEAR,  # the protocol
                   seeds=range(30),     # one run per seed
                   out=None,            # path of the JSON summary to write, or None
                   progress:bool=True,  # show a progress bar
                  )->list:              # one PretrainResult per seed
    "The predecessor's pretraining experiment over many seeds (`pretrain_many`), with a small JSON summary of its results."
    results = pretrain_many(config, list(seeds), progress=progress)
    if out is not None:
        params = stack_results(results)["params"]
        h, (P, Q) = aligned_history(results), align_signs(params["P"][:, -1], params["Q"][:, -1])
        S = len(list(seeds))
        summary = dict(produced_by="ictd.linear.reproduce_iclr",
                       config=dataclasses.asdict(config), seeds=list(seeds), alpha_td=summarise_linear(results)["alpha_td"],
                       tasks=h["tasks"][0], mean={k: v.mean(0) for k, v in h.items() if k not in ("tasks", "step")},
                       se={k: v.std(0) / S ** 0.5 for k, v in h.items() if k not in ("tasks", "step")},
                       final={k: v[:, -1] for k, v in h.items() if k not in ("tasks", "step")}, P_mean=P.mean(0), Q_mean=Q.mean(0))
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(jsonable(summary)))
    return results


# %%
#| slow
full_linear = reproduce_iclr(out="data/iclr_linear_30seeds.json")
plot_linear_pretraining(full_linear);

# %%
saved, files = {}, sorted(Path("data").glob("iclr_linear_*seeds.json"))
assert Path("data/iclr_linear_30seeds.json") in files, f"the 30-seed summary is missing from data/ (found {[f.name for f in files]})"
for f in files:
    js = json.loads(f.read_text())
    saved[f"full protocol, lr {js['config']['lr']:g} (`{f.name}`)"] = js
    summary = {k: dict(mean=v[-1], se=js["se"][k][-1]) for k, v in js["mean"].items()} | dict(seeds=len(js["seeds"]), tasks=int(js["tasks"][-1]))
    display(Markdown(f"Saved by `{js['produced_by']}`:\n\n" + reference_table({f.name: summary})))

# %% [markdown]
# Against the published values, the saved full-protocol runs (asserted below; the 30-seed file must
# be there): the value difference falls in the published range; the implicit weight similarity is
# within 0.05 of the published 0.93 but above it by the number of standard errors printed below,
# which for 30 seeds is more than noise. Two differences of protocol may explain a higher IWS: we
# evaluate on held-out tasks, and we compare with batch TD at the step size $\alpha_{TD}$ fitted
# once (the root above) instead of an $\alpha$ trained alongside the model. The $P$ and $Q$ entries have the construction's signs in at least nine seeds in ten (the counts,
# with a 95% lower confidence bound on the share of seeds, are printed). Their magnitudes come out
# larger than the published means: most of our seeds come near the magnitudes published for the
# predecessor's seed 0 (the last row of the table), while a seed that is slow to leave the
# initialisation stays small; a mean over seeds depends on how many such seeds there are. The
# per-seed values:

# %%
for label, js in saved.items():
    final = {k: torch.tensor(v) for k, v in js["final"].items()}
    assert abs(torch.tensor(js["mean"]["iws"][-1]) - ICLR_REFERENCE["iws"]) < 0.05 and js["mean"]["vd"][-1] < 0.03, label
    signs = (final["trQ11"] < 0) & (final["trQ12"] > 0) & (final["P_last"] > 0)
    S = len(js["seeds"])
    assert signs.sum() >= 0.9 * S, (label, int(signs.sum()))
    z_iws = (js["mean"]["iws"][-1] - ICLR_REFERENCE["iws"]) / js["se"]["iws"][-1]
    print(f"{label}: IWS {js['mean']['iws'][-1]:.3f} +- {js['se']['iws'][-1]:.3f}, {z_iws:.1f} s.e. from the published {ICLR_REFERENCE['iws']}; "
          f"the construction's signs in {int(signs.sum())} of {S} seeds (share >= {lower_bound(int(signs.sum()), S):.2f} at 95%)")
    display(Markdown(f"{label}:\n\n| seed | " + " | ".join(map(str, js["seeds"])) + " |\n" + "|---" * (len(js["seeds"]) + 1) + "|\n"
                     + "\n".join(f"| {k} | " + " | ".join(f"{x:.3g}" for x in final[k].tolist()) + " |" for k in ("iws", "vd", "P_last", "trQ11", "trQ12"))))

# %% [markdown]
# ## The same measures for a pretrained softmax Transformer
#
# Which of the predecessor's measures carry over to the softmax model of [chapter 6](pretrain.html)?
# The value difference does, against the constructed softmax model $\theta^*(W = \beta I, \alpha)$
# whose $(\alpha, \beta)$ fit the trained model best (smallest VD on a grid). So does the
# sensitivity similarity, the $d_\pi$-weighted cosine between the two models' gradients with
# respect to the query feature. The implicit weight similarity does not: $\theta^*$'s values are
# not linear in the query feature, so there is no weight vector to compare with. The $P$ and $Q$
# entries have no counterpart either (chapter 6 reports the value-update weights and the attention's
# diagonality instead).

# %%
#| export
THETA_STAR_GRID = dict(alpha=(0.5, 1., 2., 4., 8., 16.), beta=(0., 0.25, 0.5, 1., 2., 4., 8.))

def softmax_in_context(predict,          # callable Z (..., d+2, n+1+s) -> (..., s) values at the query columns
                       phi_S, R, phi,    # context features (..., n+1, d), rewards (..., n), state features (..., s, d)
                      )->tuple:          # (values (..., s), gradients wrt the query feature (..., s, d))
    "Every state's value in context in the softmax prompt of chapter 2, and its gradient with respect to the query feature."
    with torch.enable_grad():
        x = phi.detach().clone().requires_grad_(True)
        v = predict(build_prompt(phi_S, R, x))
        g, = torch.autograd.grad(v.sum(), x)
    return v.detach(), g

def softmax_measures(model,             # a `SoftmaxICTD`
                     tasks:TaskBatch,   # held-out tasks (E of them)
                     states:torch.Tensor, # (E, n+1) one context per task
                     grid:dict=THETA_STAR_GRID, # (alpha, beta) grid of theta*(beta I, alpha)
                    )->dict:            # vd, ss, the best-fit alpha and beta, and vd_zero (VD against the zero function, for scale)
    "VD against the best-fit constructed softmax model theta*, and the sensitivity similarity to it, averaged over tasks."
    rows, n, gamma, L = torch.arange(len(tasks))[:, None], states.shape[-1] - 1, tasks.gamma, model.n_layers
    phi_S, R, I = tasks.phi[rows, states], tasks.r[rows, states[:, :-1]], torch.eye(tasks.phi.shape[-1], dtype=torch.float64)
    v_tf, g_tf = softmax_in_context(lambda Z: model.predict(Z, n=n), phi_S, R, tasks.phi)
    def star(alpha, beta):
        return softmax_in_context(lambda Z: weighted_softmax_td(Z[..., :-2, :n + 1].mT, Z[..., -2, :n], beta * I, alpha, gamma, L,
                                                                phi_queries=Z[..., :-2, n + 1:].mT)[..., n + 1:], phi_S, R, tasks.phi)
    fits = {(a, b): star(a, b) for a in grid["alpha"] for b in grid["beta"]}
    (a, b), (v_st, g_st) = min(fits.items(), key=lambda kv: value_difference(v_tf, kv[1][0], tasks.d_pi).mean().item())
    return dict(vd=value_difference(v_tf, v_st, tasks.d_pi).mean().item(), ss=sensitivity_similarity(g_tf, g_st, tasks.d_pi).mean().item(),
                alpha=a, beta=b, vd_zero=value_difference(v_tf, 0 * v_tf, tasks.d_pi).mean().item())


# %% [markdown]
# The check: a constructed model scores $\mathrm{VD} = 0$ and $\mathrm{SS} = 1$ against itself,
# with its own parameters recovered from the grid.

# %%
held_tasks = task_pool(PretrainConfig(), 16, 777)
held_states = sample_trajectories(held_tasks.P, 30, held_tasks.d_pi, seed=777)
star_model = SoftmaxICTD.from_theta_star(4, 3, 4. * torch.eye(4, dtype=torch.float64), 0.5, 0.9)
m = softmax_measures(star_model, held_tasks, held_states)
test_close((m["vd"], m["ss"]), (0., 1.), eps=1e-10)
test_eq((m["alpha"], m["beta"]), (0.5, 4.))

# %% [markdown]
# Applied to softmax Transformers pretrained by the engine on chapter 6's protocol (its
# `EMERGENCE` settings shortened to 400 steps, 10 seeds; $L = 3$ layers of their own, $d = 4$ random
# features, $n = 30$), on each seed's 32 held-out tasks:

# %%
soft_cfg = dataclasses.replace(EMERGENCE, n_steps=400, eval_every=400, eval_tasks=32)
soft_runs = pretrain_many(soft_cfg, range(10), progress=False)
soft_m = [softmax_measures(r.model, *held_out_tasks(r.config)) for r in soft_runs]
soft_tab = {k: torch.tensor([m[k] for m in soft_m]) for k in soft_m[0]}
soft_tab["vd / vd_zero"] = soft_tab["vd"] / soft_tab["vd_zero"]
{k: f"{v.mean():.3g} ({v.std() / 10 ** 0.5:.2g})" for k, v in soft_tab.items()}

# %% [markdown]
# Mean (standard error) over the 10 seeds. What it says, asserted below as counts of seeds: the
# trained softmax model is close to *some* constructed model in value (VD a few percent of the
# squared size of its values, `vd_zero`), but the best fit has nearly uniform attention (small
# $\beta$) and a large step, and the sensitivity similarity is well below 1: the short run
# has learned TD-like value updates on attention that is still far from the diagonal, selective
# attention of the tabular regime, as chapter 6's diagonality measure shows for its runs.

# %%
assert (soft_tab["vd / vd_zero"] < 0.1).sum() >= 9, soft_tab["vd / vd_zero"]
assert (soft_tab["ss"] > 0.45).sum() >= 9 and (soft_tab["ss"] < 0.9).sum() >= 9, soft_tab["ss"]
assert (soft_tab["beta"] <= 0.5).sum() >= 9, soft_tab["beta"]


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
# [dual-head chapter](dual_head.html)). Both use step $\alpha = 1$: equal settings, not tuned ones
# (the next section tunes them).

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
# random features, linear attention stalls at the error of its projected fixed point. How much of
# the first gap is the shared step size is the question of the next section.

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
# ## A fair side-by-side
#
# The comparison above gives both constructions the same step $\alpha = 1$ and softmax a score
# scale $\beta = 20$ picked for it, so it partly measures the settings. Here each method gets its
# own parameters, tuned by a grid on the same tuning tasks (seeds the test tasks do not use), and
# both run on the **same features**: one-hot features (where both have the same fixed point), and
# $d = 4$ random features (where linear TD is limited to the span of the features). A third
# method is the ablation: the predecessor's "softmax" variant of the linear-attention layer,
# which normalises each key's scores over the *target* columns instead of over the keys, with the
# TD-shaped parameters $P = \alpha\, e e^\top$ and $Q = \beta [-I, I]$ blocks.
#
# For that variant the attention weights do not change across layers (only the last row changes,
# and the scores read only the first $2d$ rows), so its forward pass reduces to an iteration on the
# last row with a fixed weight matrix per query, computed below and checked against the layer.

# %%
#| export
def query_softmax_td(phi_states,        # (..., n+1, d) features of S_0..S_n
                     rewards,           # (..., n) rewards
                     phi_queries,       # (..., q, d) query features (each gets its own prompt)
                     alpha:float,       # the entry P[-1, -1]
                     beta:float,        # the scale of Q's blocks -beta I, +beta I
                     gamma:float,       # discount factor
                     n_iters:int,       # number of layers
                     return_all=False,  # every depth 0..n_iters instead of the last
                    )->torch.Tensor:    # (..., q) values, or (..., n_iters+1, q)
    "The predecessor's target-normalised softmax layer with TD-shaped parameters, one query per prompt, in closed form."
    keys, X, R = context_tensors(phi_states, rewards, phi_queries)
    n = R.shape[-1]
    scores = beta * keys @ (gamma * X[..., 1:n + 1, :] - keys).mT          # (..., n, n): key i, context target j
    s_q = -beta * keys @ X[..., n + 1:, :].mT                               # (..., n, q)
    log_norm = torch.logaddexp(torch.logsumexp(scores, -1, keepdim=True), s_q)   # (..., n, q): per key, per query's prompt
    K = torch.exp(scores.unsqueeze(-3) - log_norm.mT.unsqueeze(-1))        # (..., q, n, n)
    k_q = torch.exp(s_q - log_norm).mT                                      # (..., q, n)
    y, y_q = R.unsqueeze(-2).expand(k_q.shape), k_q.new_zeros(k_q.shape[:-1])
    out = [y_q]
    for _ in range(int(n_iters)):
        y, y_q = y + alpha / n * (y.unsqueeze(-2) @ K).squeeze(-2), y_q + alpha / n * (y * k_q).sum(-1)
        out.append(y_q)
    return -(torch.stack(out, -2) if return_all else y_q)


# %%
mrp = random_boyan_chain(seed=7)
S, R = sample_trajectory(mrp, 25, seed=7)
variant = LinearICTD(4, 6, softmax=True, seed=0)
P_v, Q_v = td_parameters(4, 3.)
with torch.no_grad(): variant.layers[0].P.copy_(2. * P_v); variant.layers[0].Q.copy_(Q_v)
one_query_each = torch.stack([build_linear_prompt(mrp.phi[S], R, mrp.phi[x], mrp.gamma) for x in range(10)])
test_close(query_softmax_td(mrp.phi[S], R, mrp.phi, 2., 3., mrp.gamma, 6), variant.predict(one_query_each, n=25)[:, 0], eps=1e-12)
test_eq(query_softmax_td(mrp.phi[S], R, mrp.phi, 2., 3., mrp.gamma, 6, return_all=True)[-1], query_softmax_td(mrp.phi[S], R, mrp.phi, 2., 3., mrp.gamma, 6))
two_queries = build_linear_prompt(mrp.phi[S], R, mrp.phi[:2], mrp.gamma)
assert (variant.predict(two_queries, n=25)[0] - variant.predict(one_query_each[0], n=25)[0]).abs() > 1e-6

# %% [markdown]
# The tuning: for each method and grid point, the median MSVE over 20 tuning tasks at the deepest
# layer; the best grid point is then run on the test tasks. The grids are wide enough that the
# tuned values sit inside them (asserted below), and step sizes above 1 are included.

# %%
#| export
TUNING_GRIDS = {
    "linear attention": dict(alpha=(0.25, 0.5, 1., 2., 4., 8., 16., 32., 64.)),
    "softmax attention": dict(alpha=(0.25, 0.5, 1., 1.5, 2.), beta=(0.5, 1., 2., 4., 8., 16., 32., 64.)),
    "query-normalised softmax (ablation)": dict(alpha=(-64., -16., -4., -1., 1., 4.), beta=(-16., -4., -1., -0.25, 0.25, 1., 4., 16.)),
}

def _method_values(method:str, phi_s, R, phi_q, gamma, depth, alpha, beta=None):
    "Values at the queries at every depth 0..depth for one method at one grid point."
    n = R.shape[-1]
    if method == "linear attention": return batch_linear_td(phi_s, R, alpha, gamma, depth, phi_queries=phi_q, return_all=True)[..., n + 1:]
    if method == "softmax attention":
        W = beta * torch.eye(phi_s.shape[-1], dtype=phi_s.dtype)
        return weighted_softmax_td(phi_s, R, W, alpha, gamma, depth, phi_queries=phi_q, return_all=True)[..., n + 1:]
    return query_softmax_td(phi_s, R, phi_q, alpha, beta, gamma, depth, return_all=True)

def _msve_curves(method, tasks, states, depth, **params)->torch.Tensor:
    "(B, depth+1) MSVE of each task's estimate at every depth (inf where it diverged)."
    rows = torch.arange(len(tasks))[:, None]
    v = _method_values(method, tasks.phi[rows, states], tasks.r[rows, states[:, :-1]], tasks.phi, tasks.gamma, depth, **params)
    err = weighted_error(v, tasks.v_pi[:, None], tasks.d_pi[:, None])
    return torch.nan_to_num(err, nan=math.inf)

def tuned_side_by_side(features:str="random",  # "random" (d = 4) or "onehot" features, shared by all methods
                       n_tasks:int=100,        # test tasks (seeds `seed`, `seed + 1`, ...)
                       n_tune:int=20,          # tuning tasks (seeds from `seed + 100_000`)
                       n:int=100,              # context length
                       depth:int=40,           # deepest model; tuning minimises the median MSVE there
                       seed:int=0,             # first test task seed
                       grids:dict=None,        # method -> dict of parameter grids; default `TUNING_GRIDS`
                      )->dict:                 # method -> dict(params, tune_msve, curves (n_tasks, depth+1))
    "MSVE against depth of each method with its own parameters tuned by a grid on separate tuning tasks, all on the same features and contexts."
    if features not in ("random", "onehot"): raise ValueError(f"`features` must be 'random' or 'onehot', got {features!r}")
    grids = TUNING_GRIDS if grids is None else grids
    def draw(first, count):
        tasks = random_tasks(count, seed=first, features=features)
        return tasks, sample_trajectories(tasks.P, n, tasks.d_pi, seed=first)
    tune, test = draw(seed + 100_000, n_tune), draw(seed, n_tasks)
    out = {}
    for method, grid in grids.items():
        points = [dict(zip(grid, vals)) for vals in itertools.product(*grid.values())]
        scores = [_msve_curves(method, *tune, depth, **p)[:, -1].median().item() for p in points]
        best = points[min(range(len(points)), key=scores.__getitem__)]
        out[method] = dict(params=best, tune_msve=min(scores), curves=_msve_curves(method, *test, depth, **best))
    return out


# %%
#| export
def plot_tuned_side_by_side(results:dict,  # features label -> output of `tuned_side_by_side`
                            n:int,         # context length used
                           ):              # the matplotlib figure
    "Median and quartiles of MSVE against depth of every tuned method, one panel per kind of features."
    import matplotlib.pyplot as plt
    fig, axs = plt.subplots(1, len(results), figsize=(8, 3.9), sharey=True, squeeze=False)
    for ax, (label, res) in zip(axs[0], results.items()):
        for (method, r), ls in zip(res.items(), ("-", "-", ":")):
            c = r["curves"].clamp(max=1e6)
            med, lo, hi = (c.quantile(q, dim=0).numpy() for q in (0.5, 0.25, 0.75))
            ax.plot(med, ls, label=method)
            ax.fill_between(range(c.shape[1]), lo, hi, alpha=0.2)
        ax.axhline(c[:, 0].median().item(), color="k", lw=0.8, ls="--", label="zero predictor (depth 0)")
        ax.set(yscale="log", xlabel="depth $L$ (layers)", title=f"{label} features, $n = {n}$")
    axs[0, 0].set_ylabel("MSVE (squared return units)")
    handles, labels = axs[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8.5, frameon=False)
    fig.suptitle(f"Tuned in-context TD (parameters in the table below), {c.shape[0]} test chains: median and quartiles", fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


# %%
fair = {"one-hot": tuned_side_by_side("onehot"), "4 random": tuned_side_by_side("random")}
plot_tuned_side_by_side(fair, n=100);

# %%
rows = [f"| {feat} | {m} | {', '.join(f'{k} = {v:g}' for k, v in r['params'].items())} | {r['tune_msve']:.3g} | {r['curves'][:, -1].median():.3g} |"
        for feat, res in fair.items() for m, r in res.items()]
Markdown("| features | method | tuned parameters | tuning MSVE at $L = 40$ (median) | test MSVE at $L = 40$ (median) |\n|---|---|---|---|---|\n" + "\n".join(rows))


# %% [markdown]
# With each method tuned, the picture is more even than at equal settings, and the asserts below
# hold it to that:
#
# * on **one-hot** features the tuned linear construction takes a step size well above 1 and closes
#   much of the gap, but softmax is still ahead at $L = 40$: lower median error and lower error on
#   most of the 100 test chains. Both converge to the same fixed point, so this is a statement
#   about speed in depth, which the normalisation (a per-state step size) buys;
# * on the **same 4 random features**, linear attention is limited to the span of the features and
#   stays an order of magnitude above tuned softmax on almost every chain;
# * the predecessor's **query-normalised** variant, tuned over signed grids, is far worse than both
#   (on one-hot features no better than predicting zero): normalising over the targets does not give
#   a TD update. Its signed grids were widened until its tuned values sit inside them (asserted
#   below, as for the other two methods); the ablation shows the direction of normalisation
#   matters, not the best such model.

# %%
def interior(value, grid): return min(grid) < value < max(grid)
for res in fair.values():
    for m in TUNING_GRIDS:
        assert all(interior(v, TUNING_GRIDS[m][k]) for k, v in res[m]["params"].items()), (m, res[m]["params"])
final = {feat: {m: r["curves"][:, -1] for m, r in res.items()} for feat, res in fair.items()}
lin1, soft1, abl1 = final["one-hot"].values()
lin4, soft4, abl4 = final["4 random"].values()
assert fair["one-hot"]["linear attention"]["params"]["alpha"] > 1
assert soft1.median() < lin1.median() / 2 and (soft1 < lin1).sum() >= 60, ((soft1 < lin1).sum(), soft1.median(), lin1.median())
assert soft4.median() < lin4.median() / 10 and (soft4 < lin4).sum() >= 90, ((soft4 < lin4).sum(), soft4.median(), lin4.median())
assert (soft1 < abl1).sum() >= 95 and (soft4 < abl4).sum() >= 95
{feat: f"softmax below linear on {int((f['softmax attention'] < f['linear attention']).sum())} of 100 chains" for feat, f in final.items()}

# %% [markdown]
# The softmax construction pays for its speed and expressiveness with a condition: its contraction
# needs the attention to concentrate on a state's own visits (kernel diagonality, the
# [convergence chapter](convergence.html)), while linear TD's stability depends on the step size and
# the features' covariance. Which of the two a pretrained softmax Transformer ends up running is a
# question about training, taken up in [chapter 6](pretrain.html); for the linear Transformer, the
# pretraining section above answers it: batch TD, up to the seeds that are slow to leave the
# initialisation.

# %%
#| hide
import nbdev; nbdev.nbdev_export()
