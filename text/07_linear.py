# %%
#| default_exp linear

# %%
#| export
from __future__ import annotations
import math
import torch
from torch import nn
from ictd.boyan import as_tensor, check_gamma, weighted_error
from ictd.core import check_bool, check_broadcast, check_device, check_floating, check_int, check_number, chunk_rows, default_dtype, memory_path, run_stream
from ictd.model import carry_context, grad_mode, token_rows, torch_generator, xavier_param
from ictd.prompt import Prompt
from ictd.boyan import moved_to_keywords
from ictd.tasks import Contexts, TaskBatch
from ictd.engine import Family, PretrainConfig, register_family
from ictd.sliding import fitted_td_step

# %%
#| hide
from ictd.boyan import random_boyan_chain, sample_trajectory
from ictd.pretrain import pretrain_many
from ictd.sliding import start_distributions
from ictd.tasks import sample_trajectories
from ictd.wstd import batch_linear_td

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *

# %%
#| hide
from IPython.display import Markdown
from ictd.core import record_claim
import unittest.mock
import ictd.core


# %% [markdown]
# # Linear attention: the construction
# > The prior construction for in-context TD with linear attention (Wang et al., ICLR 2025): the prompt, the layer and its batch-TD parameters checked against batch linear TD, the predecessor's measures, and the linear family plugged into the pretraining engine.

# %% [markdown]
# ::: {.callout-tip title="What this page shows"}
# - The linear-attention construction of Wang et al. (2025): a linear Transformer whose $L$ layers are $L$ iterations
#   of batch linear TD (Proposition 7.1, proved and checked), and the layer as one small matrix (Proposition 7.2).
# - The predecessor's measures of "did training find TD", and the linear family plugged into the pretraining engine.
# :::
#
# Before softmax attention, the theory of in-context TD was built on **linear** attention, where the
# softmax is replaced by the identity. Wang, Blaser, Daneshmand and Zhang (ICLR 2025,
# arXiv 2405.13861), *the predecessor* in this book, showed that a linear Transformer's forward pass
# can run batch linear TD(0), one iteration per layer, and that a linear Transformer pretrained with a
# TD loss on many tasks ends up close to that construction. This chapter rebuilds that construction,
# proves it, and defines what the [experiments](linear_experiments.html) need to test the
# pretraining claim: the predecessor's measures of "did training find TD" and the linear family of
# the pretraining engine. The predecessor's data (sliding windows of trajectories) and the step size
# of the batch-TD model it compares with have a page of their own, [the sliding-window
# protocol](sliding.html), after this one.
#
# *How to read this chapter.* The idea in one paragraph; the prompt and the layer; the construction,
# first worked by hand on a two-transition context, then as Proposition 7.1 with its proof (folded)
# and its check; Proposition 7.2, the layer as one small matrix; then the measures and the plug-in
# that lets the pretraining engine of [chapter 6](pretrain.html) train linear Transformers, with the
# predecessor's windows as linear prompts. Helpers, validation and exhaustive tests are
# in the last section, [Implementation and tests](#implementation-and-tests).
#
# *Sources.* The construction and the measures are the predecessor's (their definitions follow the
# predecessor's public code); the proofs, the matrix form of the layer, the fitted step size and
# every experiment built on them are ours.
#
# *Notation.* The predecessor names the layer's two matrices $P$ and $Q$, and so does the code
# (`P`, `Q`, and the measures `P_last`, `trQ11`, `trQ12`). In the book $P$ is the transition matrix,
# so the prose writes them in the book's roles: $V_l$ for the output (value) projection, which plays
# the part of a head's value matrix, and $A_l$ for the score matrix, scores $z_i^\top A_l z_j$ as in
# [chapter 3](dual_head.html#the-layer). Code `P` is $V$ and code `Q` is $A$.

# %% [markdown]
# ## The idea in one paragraph
#
# TD needs, for each transition, the TD error $R_{i+1} + \gamma \phi(S_{i+1})^\top w - \phi(S_i)^\top w$,
# and it moves the prediction at any state $x$ by the average of these errors weighted by
# $\phi(S_i)^\top \phi(x)$. Put the whole transition into one token, $[\phi(S_i); \gamma\phi(S_{i+1}); R_{i+1}]$,
# let the last row hold the running TD error, and choose the score matrix so that the score of key
# $i$ for target $j$ is $\alpha\,\phi(S_i)^\top(\gamma\phi'_j - \phi_j)$, where $\phi_j$ and $\phi'_j$ are the features
# of column $j$'s state and of its successor. Then linear attention (a weighted
# sum of the keys' last rows, with these raw scores as weights) adds to every context column exactly
# the change of its TD error, and to a query column minus the change of its value. One layer is one
# step of batch TD; $L$ layers are $L$ steps.

# %% [markdown]
# ## The linear-attention prompt
#
# Each context column carries a whole transition, the *successor's* features included, already
# discounted; the reward sits in the last row, which is also where the answer will appear:
#
# $$z_i = \begin{bmatrix}\phi(S_i)\\ \gamma\,\phi(S_{i+1})\\ R_{i+1}\end{bmatrix}\ (0 \le i < n),
# \qquad z_{n+j} = \begin{bmatrix}\phi(x)\\ 0\\ 0\end{bmatrix}\ \text{(a query state } x\text{)} .$$
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
                       )->torch.Tensor: # (..., 2d+1, n+q): columns [phi(S_i); gamma phi(S_{i+1}); R_{i+1}], then [phi(s_q); 0; 0]; carries n as `Z.n_context`
    "The linear-attention prompt of Wang et al. (2025): one column per transition, then the query columns."
    phi = as_tensor(phi_states, "phi_states")
    if phi.ndim < 2 or phi.shape[-2] < 2: raise ValueError(f"`phi_states` must have shape (..., n+1, d) with n >= 1, got {tuple(phi.shape)}")
    n, d = phi.shape[-2] - 1, phi.shape[-1]
    R = as_tensor(rewards, "rewards", phi.dtype, phi.device)
    if R.shape[-1:] != (n,): raise ValueError(f"`rewards` must have shape (..., {n}) to match `phi_states`, got {tuple(R.shape)}")
    Q = as_tensor(phi_queries, "phi_queries", phi.dtype, phi.device)
    if Q.ndim == phi.ndim - 1: Q = Q.unsqueeze(-2)
    if Q.ndim < 2 or Q.shape[-1] != d: raise ValueError(f"`phi_queries` must have shape (..., q, {d}), got {tuple(Q.shape)}")
    batch = check_broadcast(phi_states=phi.shape[:-2], rewards=R.shape[:-1], phi_queries=Q.shape[:-2])
    phi, R, Q = phi.expand(batch + phi.shape[-2:]), R.expand(batch + (n,)), Q.expand(batch + Q.shape[-2:])
    context = torch.cat([phi[..., :-1, :], check_gamma(gamma) * phi[..., 1:, :], R.unsqueeze(-1)], -1)
    queries = torch.cat([Q, torch.zeros(batch + (Q.shape[-2], d + 1), dtype=phi.dtype, device=phi.device)], -1)
    return carry_context(torch.cat([context, queries], -2).mT, n)


# %%
show_doc(build_linear_prompt)

# %%
phi_s, R_ = torch.arange(8.).reshape(4, 2), torch.tensor([10., 20., 30.])
Z = build_linear_prompt(phi_s, R_, torch.tensor([[-1., -2.]]), gamma=0.5)
test_eq(Z.shape, (5, 4))
test_eq(Z[:, 0], torch.tensor([0., 1., 1., 1.5, 10.]))
test_eq(Z[:, 3], torch.tensor([-1., -2., 0., 0., 0.]))
test_eq(build_linear_prompt(torch.randn(7, 4, 2), torch.randn(7, 3), torch.randn(7, 5, 2),
                            0.9).shape, (7, 5, 8))
Z


# %% [markdown]
# ## The linear-attention layer
#
# With $Z_l$ of shape $(2d+1) \times (n+q)$, whose first $n$ columns $z_0, \dots, z_{n-1}$ (the
# context) are the keys, the layer is
#
# $$Z_{l+1} = Z_l + \frac{1}{n} V_l \sum_{i<n} z_i \big(z_i^\top A_l Z_l\big),$$
#
# that is, column by column,
#
# $$z_j \leftarrow z_j + \frac1n \sum_{i<n} \big(z_i^\top A_l z_j\big)\, V_l z_i .$$
#
# There is no softmax: the weight of key $i$ for column $j$ is the raw bilinear form
# $z_i^\top A_l z_j$. (The predecessor writes the sum over keys with a diagonal mask matrix; we
# compute it as $(V Z_{:,<n})\,(Z_{:,<n}^\top (A Z))/n$, never forming the mask.) How many columns are
# context is an argument `n` of the forward pass; by default it is read from the prompt, which `build_linear_prompt`
# marks with it (`Z.n_context`). It is never guessed from the prompt's shape: a prompt with several queries would
# be read as a longer context. The scores are an $n \times (n+q)$ matrix; a long context does without it
# (`method='auto'` above a size), by the associativity of [Proposition 7.2](#the-layer-as-one-small-matrix)
# ([Implementation and tests](#long-contexts-in-linear-memory)).
#
# The predecessor's code also offers a "softmax" activation for this layer, applied to
# $Z^\top A Z$ along its second axis: for each key it normalises over the *target* columns $j$ (the
# context columns and the query), where a softmax Transformer normalises over the keys. We keep it as
# an option, `softmax=True`, for an ablation in the [next chapter](linear_experiments.html#a-fair-side-by-side).
# With it the answer at one query depends on the other queries in the same prompt (they share the
# normaliser), so it is used with one query per prompt.

# %% [markdown]
# A long context takes another path, which never builds the scores (folded here; explained and tested
# in [Implementation and tests](#long-contexts-in-linear-memory)):

# %%
#| export
#| code-fold: true
def _score_bytes(P, Q, Z, n)->float:
    "Memory of the dense layer: two arrays of shape (..., n, N), the scores and their softmax or the update."
    batch = torch.broadcast_shapes(P.shape[:-2], Q.shape[:-2], Z.shape[:-2])
    return 2. * math.prod(batch) * n * Z.shape[-1] * Z.element_size()

def _score_path(method, P, Q, Z, n)->str:
    "'dense' or 'streamed' for `linear_attention`: see `memory_path`."
    what = f"the {n} x {Z.shape[-1]} attention scores of the dense layer"
    way_out = "use method='streamed' (the default 'auto' does above `DENSE_BYTES`), which needs O(n) memory"
    return memory_path(method, _score_bytes(P, Q, Z, n), what, way_out)

def _streamed_attention(P, Q, Z, n, softmax):
    "`linear_attention` without the n x N scores: through the second moments, or over chunks of keys."
    C, QZ = Z[..., :n], Q @ Z
    if not softmax: return Z + (P @ (C @ C.mT)) @ QZ / n
    PC, rows = P @ C, chunk_rows(_score_bytes(P, Q, Z, 1) / 2)      # keys per chunk
    chunk = lambda i: PC[..., i:i + rows] @ torch.softmax(C[..., i:i + rows].mT @ QZ, dim=-1)
    return Z + sum(chunk(i) for i in range(0, n, rows)) / n


# %%
#| export
def _linear_prompt(Z,           # (..., 2d+1, n+q) prompt, or a `Prompt` whose `n` is its number of context columns
                   d:int,       # the model's feature dimension
                   n=None,      # number of context columns; default the `Prompt`'s (or `Z.n_context`, set by `build_linear_prompt`)
                  )->tuple:     # (Z as a finite floating tensor, n as an int)
    "Validate a linear-attention prompt and resolve its number `n` of context columns (never guessed from its shape)."
    if isinstance(Z, Prompt): Z, carried = Z.Z, Z.n
    else: carried = getattr(Z, "n_context", None)
    Z = check_floating(Z, "Z")
    if Z.ndim < 2 or Z.shape[-2] != 2 * d + 1: raise ValueError(f"`Z` must have {2 * d + 1} rows (2d+1 with d = {d}), got shape {tuple(Z.shape)}")
    if n is None and carried is None:
        raise ValueError("`n` must be given: `Z` does not carry its number of context columns (`build_linear_prompt` attaches it as "
                         "`Z.n_context`; slicing, stacking or `.to()` return a plain tensor)")
    n = check_int(carried if n is None else n, "n", 1, high=Z.shape[-1], what=f"an integer in 1..{Z.shape[-1]} (the number of context columns)")
    if carried is not None and n != carried: raise ValueError(f"`n` = {n} contradicts the prompt, which was built with `Z.n_context` = {carried}")
    return Z, n

def linear_attention(P:torch.Tensor,      # (..., 2d+1, 2d+1) output projection
                     Q:torch.Tensor,      # (..., 2d+1, 2d+1) bilinear score matrix
                     Z:torch.Tensor,      # (..., 2d+1, N) prompt; batch dimensions broadcast with P and Q
                     n:int,               # number of context columns (the keys)
                     softmax:bool=False,  # normalise each key's scores over the target columns (the predecessor's variant)
                     method="auto",       # 'dense' (the n x N scores), 'streamed' (O(n) memory), 'auto': dense up to `DENSE_BYTES`
                    )->torch.Tensor:      # (..., 2d+1, N) next prompt
    "One layer $Z + \\frac1n P Z M (Z^\\top Q Z)$, unvalidated, with scores optionally softmax-normalised over targets."
    if _score_path(method, P, Q, Z, n) == "streamed": return _streamed_attention(P, Q, Z, n, softmax)
    C = Z[..., :n]
    scores = C.mT @ (Q @ Z)
    if softmax: scores = torch.softmax(scores, dim=-1)
    return Z + (P @ C) @ scores / n


# %% [markdown]
# Pretraining needs parameters that are not all zero: at $V = A = 0$ every gradient of the output
# vanishes (each layer's change is a product in which both factors are zero; checked in
# [Implementation and tests](#why-the-initialisation-is-random)), so gradient descent never leaves
# the origin. We draw $V$ and $A$ from a Xavier-normal distribution with a small gain, from a seed,
# exactly as the softmax model of the [dual-head chapter](dual_head.html) does (and as the
# predecessor's code does, with gain $0.1$).

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
        self.d, self.softmax = D // 2, check_bool(softmax, "softmax")
        self.P, self.Q = xavier_param(D, D, init_gain, g, dtype), xavier_param(D, D, init_gain, g, dtype)

    def forward(self, Z:torch.Tensor,  # (..., 2d+1, n+q) prompt
                n:int=None,            # number of context columns; default `Z.n_context` (set by `build_linear_prompt`)
                method="auto",         # the memory path of `linear_attention`
               )->torch.Tensor:        # (..., 2d+1, n+q), carrying n
        Z, n = _linear_prompt(Z, self.d, n)
        return carry_context(linear_attention(self.P.to(Z), self.Q.to(Z), Z, n, self.softmax, method), n)


# %% [markdown]
# ## The batch-TD construction
#
# Choose $V_l$ zero except its bottom-right entry $1$, so that a layer writes only to the last row,
# and $A_l$ zero except its top-left block $-\alpha C$ and top-middle block $+\alpha C$ (a
# preconditioner $C$, by default $I$). Then for columns $i < n$ and any $j$,
#
# $$z_i^\top A z_j = \alpha\,\phi(S_i)^\top C\big(\gamma\,\phi'_j - \phi_j\big),$$
#
# where $\phi_j$ is the first block of column $j$ and $\gamma\phi'_j$ its middle block
# ($\phi'_j = \phi(S_{j+1})$ for a context column, $0$ for a query). The construction's parameters,
# as tensors that may carry leading batch dimensions (one step size per seed, say) and stay
# differentiable in $\alpha$:

# %%
#| export
def td_parameters(d:int,       # feature dimension
                  alpha,       # step size: a number or a tensor of shape (...) (any real value, above 1 included)
                  C=None,      # (d, d) preconditioner, default identity
                  dtype=torch.float64,
                 )->tuple:     # (P, Q), each (..., 2d+1, 2d+1), differentiable in `alpha`
    "The parameters $(P, Q)$ under which a linear-attention layer is one step of batch linear TD with step `alpha`."
    d = check_int(d, "d", 1)
    alpha = as_tensor(alpha, "alpha", dtype) if isinstance(alpha, torch.Tensor) else torch.tensor(check_number(alpha, "alpha"), dtype=dtype)
    C = torch.eye(d, dtype=dtype) if C is None else as_tensor(C, "C", dtype)
    if C.shape != (d, d): raise ValueError(f"`C` must have shape ({d}, {d}), got {tuple(C.shape)}")
    D = 2 * d + 1
    P, U = torch.zeros(D, D, dtype=dtype), torch.zeros(D, D, dtype=dtype)
    P[-1, -1] = 1.
    U[:d, :d], U[:d, d:2 * d] = -C, C
    return P.expand(alpha.shape + (D, D)), alpha[..., None, None] * U


# %% [markdown]
# A stack of $L$ such layers, sharing one $(V, A)$ or each with its own, reads its answer from the
# negated last row at the query columns; `from_td` loads the construction.

# %%
#| export
class LinearICTD(nn.Module):
    "A stack of linear-attention layers reading out the negated last row at the query columns."
    @moved_to_keywords("n_layers", "shared", "init_gain", "seed", "dtype", "softmax")
    def __init__(self, d:int,          # feature dimension
                 *,
                 n_layers:int,         # number of layers L
                 shared:bool=True,     # one (P, Q) pair for every layer, or one per layer
                 init_gain:float=0.1,  # gain of the Xavier-normal initialisation
                 seed=None,            # int or `torch.Generator` for the initialisation
                 dtype=None,           # dtype of the parameters; default float64, float32 on CUDA (`default_dtype`)
                 softmax:bool=False,   # the predecessor's softmax over target columns (an ablation)
                 device=None,          # device of the parameters; default the CPU (drawn there, then moved)
                ):
        super().__init__()
        g, dtype = torch_generator(seed), default_dtype(device, dtype)
        self.d, self.n_layers = d, check_int(n_layers, "n_layers", 1, "a positive integer")
        self.shared = check_bool(shared, "shared")
        self.layers = nn.ModuleList([LinearAttentionLayer(d, init_gain, g, dtype, softmax) for _ in range(1 if shared else self.n_layers)])
        if device is not None: self.to(check_device(device))

    def forward(self, Z, n:int=None, method="auto"):
        "Run all L layers on the prompt `Z` (a tensor, or a `Prompt`, then returned as one) with `n` context columns (default the `Prompt`'s, or `Z.n_context`)."
        given = Z
        Z, n = _linear_prompt(Z, self.d, n)
        for l in range(self.n_layers):
            layer = self.layers[0 if self.shared else l]
            Z = linear_attention(layer.P.to(Z), layer.Q.to(Z), Z, n, layer.softmax, method)
        return Prompt._of(Z, n) if isinstance(given, Prompt) else carry_context(Z, n)

    def predict(self, Z,               # (..., 2d+1, n+q) prompt, or a `Prompt` of it
                n:int=None,            # number of context columns; default the `Prompt`'s (or `Z.n_context`, set by `build_linear_prompt`)
                method="auto",         # the memory path of `linear_attention`: 'auto', 'dense' or 'streamed'
                *,
                grad=None,             # None: autograd as the caller has it; False: under `torch.no_grad()`; True: with a graph
               )->torch.Tensor:        # (..., q) value estimates at the query columns
        "Value estimates at the query columns: the negated last row of $Z_L$."
        Z, n = _linear_prompt(Z, self.d, n)
        with grad_mode(grad): return -self(Z, n, method)[..., -1, n:]

    def stacked_params(self)->tuple:
        "(P, Q), each (L', 2d+1, 2d+1) with L' = 1 when shared, else L."
        return torch.stack([l.P for l in self.layers]), torch.stack([l.Q for l in self.layers])

    @classmethod
    @moved_to_keywords("n_layers", "alpha", "C", "dtype")
    def from_td(cls, d:int,            # feature dimension
                *,
                n_layers:int,          # number of layers = TD iterations
                alpha:float,           # TD step size (any real value, above 1 included)
                C=None,                # (d, d) preconditioner, default identity
                dtype=torch.float64):
        "The construction whose forward pass is `n_layers` iterations of (preconditioned) batch linear TD."
        P, Q = td_parameters(d, check_number(alpha, "alpha"), C, dtype)
        model = cls(d, n_layers=n_layers, shared=True, seed=0, dtype=dtype)
        with torch.no_grad(): model.layers[0].P.copy_(P); model.layers[0].Q.copy_(Q)
        return model


# %%
show_doc(LinearICTD.from_td)

# %% [markdown]
# ### One layer by hand
#
# A context of two transitions with one feature ($d = 1$): $\phi(S_0) = 1$, $\phi(S_1) = 2$,
# $\phi(S_2) = 1$, rewards $R_1 = 1$, $R_2 = 0$, $\gamma = \tfrac12$, one query state $x$ with
# $\phi(x) = 2$, and step $\alpha = \tfrac12$. Batch TD from $w_0 = 0$: the TD errors are the rewards,
# $\delta^{(0)} = (1, 0)$, so $w_1 = \frac{\alpha}{n}(1 \cdot 1 + 0 \cdot 2) = \tfrac14$. The new TD
# errors are $\delta^{(1)}_0 = 1 + \tfrac12 \cdot 2 \cdot \tfrac14 - 1 \cdot \tfrac14 = 1$ and
# $\delta^{(1)}_1 = 0 + \tfrac12 \cdot 1 \cdot \tfrac14 - 2 \cdot \tfrac14 = -\tfrac38$, and the value
# at the query is $\phi(x) w_1 = \tfrac12$. One layer of the construction writes exactly these
# numbers into the last row: $1$, $-\tfrac38$ at the context columns and $-\tfrac12$ at the query.

# %%
Z_hand = build_linear_prompt(torch.tensor([[1.], [2.], [1.]], dtype=torch.float64),
                             torch.tensor([1., 0.], dtype=torch.float64),
                             torch.tensor([[2.]], dtype=torch.float64), gamma=0.5)
Z_hand_1 = LinearICTD.from_td(1, n_layers=1, alpha=0.5)(Z_hand, n=2).detach()
# the first 2d rows never change
test_eq(Z_hand_1[:2], Z_hand[:2])
test_close(Z_hand_1[-1], torch.tensor([1., -3 / 8, -1 / 2], dtype=torch.float64), eps=1e-15)
print("prompt (rows phi, gamma phi', R; columns: 2 transitions, 1 query):\n", Z_hand.numpy(),
      "\nafter one layer:\n", Z_hand_1.numpy())

# %% [markdown]
# ::: {.proposition}
# **Proposition 7.1 (the construction of Wang et al. 2025, in the form above).** Let $w_l$ be the iterates of preconditioned batch linear TD, $w_{l+1} = w_l + \frac{\alpha}{n} C^\top
# \sum_{i<n} \delta_i^{(l)} \phi(S_i)$ from $w_0 = 0$, with $\delta_i^{(l)} = R_{i+1} +
# \gamma \phi(S_{i+1})^\top w_l - \phi(S_i)^\top w_l$. Under the construction's $(V, A)$ the last
# row of $Z_l$ holds $\delta^{(l)}_i$ at context column $i$ and $-\phi(x)^\top w_l$ at the column of
# each query state $x$. So the readout $-Z_L[2d, \text{query}]$ is the value estimate of $L$
# iterations of batch linear TD.
# :::
#
# ::: {.callout-note collapse="true" title="Proof"}
# Our argument. By induction on $l$. At $l=0$, $w_0 = 0$, the last row is $R_{i+1} = \delta_i^{(0)}$ on
# the context and $0$ on the queries. The first $2d$ rows never change, since $V$ writes only to the
# last row. Suppose the claim holds at $l$; the last row gains $\frac1n\sum_{i<n} \delta_i^{(l)}\, z_i^\top A z_j$.
# At a query this is $-\frac{\alpha}{n}\sum_i \delta_i^{(l)} \phi(S_i)^\top C \phi(x) = -\phi(x)^\top(w_{l+1} - w_l)$.
# At a context column $j$ it is $\frac{\alpha}{n}\sum_i \delta_i^{(l)} \phi(S_i)^\top C(\gamma
# \phi(S_{j+1}) - \phi(S_j)) = \gamma\phi(S_{j+1})^\top(w_{l+1}-w_l) - \phi(S_j)^\top(w_{l+1}-w_l)
# = \delta_j^{(l+1)} - \delta_j^{(l)}$. $\square$
# :::
#
# The check: on random Boyan chains with random features, $L$ layers of the constructed
# linear Transformer equal $L$ iterations of `batch_linear_td` (from the
# [weighted softmax TD chapter](weighted_softmax_td.html)) at every query, in float64, for depths up
# to 50 and several queries at once; a scalar preconditioner $C = cI$ is the same as step $c\alpha$.
# The random initialisation is overwritten exactly.

# %%
worst = 0.
for seed in range(20):
    mrp = random_boyan_chain(n_states=10, d=4, seed=seed)
    S, R = sample_trajectory(mrp, n=40, seed=seed)
    L, alpha = [1, 5, 20, 50][seed % 4], 0.2
    Z = build_linear_prompt(mrp.phi[S], R, mrp.phi, mrp.gamma)
    tf = LinearICTD.from_td(4, n_layers=L, alpha=alpha).predict(Z, n=40)
    td = batch_linear_td(mrp.phi[S], R, alpha=alpha, gamma=mrp.gamma, n_iters=L,
                         phi_queries=mrp.phi)[..., 41:]
    worst = max(worst, ((tf - td).abs().max() / td.abs().max().clamp(min=1)).item())
    test_close(LinearICTD.from_td(4, n_layers=L, alpha=1.,
                                  C=alpha * torch.eye(4, dtype=torch.float64)).predict(Z, n=40), tf,
               eps=1e-12)
test_close(worst, 0., eps=1e-12)
P_td, Q_td = LinearICTD.from_td(4, n_layers=3, alpha=2.5).stacked_params()
test_eq(((P_td != 0).sum().item(), (Q_td != 0).sum().item()), (1, 8))
test_close(LinearICTD.from_td(4, n_layers=3, alpha=2.5).predict(Z, n=40),
           batch_linear_td(mrp.phi[S], R, alpha=2.5, gamma=mrp.gamma, n_iters=3,
                           phi_queries=mrp.phi)[..., 41:],
           eps=1e-9)
record_claim("construction",
             "L layers of the constructed linear Transformer are L iterations of batch linear TD "
             "(preconditioned by C) at every query.", "proved", "linear",
             "#the-batch-td-construction")
print("largest relative gap to batch linear TD over the 20 tasks: below 1e-12")


# %% [markdown]
# ## The layer as one small matrix
#
# One more fact makes training cheap, and it explains why the two similarity measures below agree
# for a linear model.
#
# ::: {.proposition}
# **Proposition 7.2 (the layer as one small matrix).** Let $\Sigma_l = \sum_{i<n} z_i z_i^\top$ be the $(2d+1)\times(2d+1)$ second-moment matrix of the
# context columns of $Z_l$. Then
#
# $$Z_{l+1} = G_l Z_l, \qquad G_l = I + \tfrac1n V_l \Sigma_l A_l,$$
#
# $$\Sigma_{l+1} = G_l \Sigma_l G_l^\top,$$
#
# so an $L$-layer linear Transformer touches its context only through $\Sigma_0$, and every query
# column is multiplied by a matrix that depends on the context only.
# :::
#
# ::: {.callout-note collapse="true" title="Proof"}
# Our argument. The update is $\frac1n V_l \sum_{i<n} z_i (z_i^\top A_l Z_l) = \frac1n V_l \big(\sum_{i<n} z_i z_i^\top\big) A_l Z_l
# = \frac1n V_l \Sigma_l A_l Z_l$ by associativity, which gives $Z_{l+1} = G_l Z_l$. The context
# columns of $Z_{l+1}$ are $G_l z_i$, so $\Sigma_{l+1} = \sum_i G_l z_i z_i^\top G_l^\top = G_l \Sigma_l G_l^\top$. $\square$
# :::
#
# The forward pass below carries $\Sigma$ and the query columns instead of the whole prompt, with
# parameters that may have leading batch dimensions (a seed axis: many independently trained models
# in one call). The check: it equals the layer-by-layer model, for shared and per-layer parameters,
# one model or a stack of seeds.

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
mrps = [random_boyan_chain(seed=s) for s in range(6)]
trajs = [sample_trajectory(m, n=30, seed=s) for s, m in enumerate(mrps)]
Zb = torch.stack([build_linear_prompt(m.phi[S], R, m.phi, m.gamma)
                  for m, (S, R) in zip(mrps, trajs)])
seeds_models = [LinearICTD(4, n_layers=3, shared=s % 2 == 0, init_gain=0.5, seed=s)
                for s in range(4)]
for m in seeds_models:
    P_s, Q_s = m.stacked_params()
    test_close(moment_predict(P_s, Q_s, Zb, 30, 3), m.predict(Zb, n=30), eps=1e-12)
shared_models = [m for m in seeds_models if m.shared]
P_stack = torch.stack([m.stacked_params()[0] for m in shared_models])
Q_stack = torch.stack([m.stacked_params()[1] for m in shared_models])
stacked = moment_predict(P_stack[:, None], Q_stack[:, None], Zb, 30, 3)
test_eq(stacked.shape, (2, 6, 10))
for i, m in enumerate(shared_models): test_close(stacked[i], m.predict(Zb, n=30), eps=1e-12)
record_claim("matrix-form",
             "An L-layer linear Transformer touches its context only through the (2d+1) x (2d+1) "
             "second-moment matrix: its layers are Z -> (I + V Sigma A / n) Z.", "proved", "linear",
             "#the-layer-as-one-small-matrix");


# %% [markdown]
# ## Did training find TD? The predecessor's measures
#
# The central experiment of Wang et al. (2025) pretrains this linear Transformer with a TD loss on
# many tasks and asks whether the trained parameters implement TD. Its measures, in the form we
# implement them (definitions as the predecessor's public code computes them; the code is ours):
#
# * **value functions in context**: put each state's feature into the query column of the same
#   context and read the answer: $v_{TF}(x)$ for the trained model, $v_{TD}(x)$ for the batch-TD
#   Transformer with one step size $\alpha$ fitted by the same TD loss (below);
# * **value difference** $\mathrm{VD} = \sum_x d_\pi(x)\,(v_{TF}(x) - v_{TD}(x))^2$;
# * **implicit weight similarity** (IWS): the cosine between $w_{TF}$, the $d_\pi$-weighted
#   least-squares fit of $v_{TF}$ on the features, and $w_{TD}$, the gradient of $v_{TD}$ with
#   respect to the query feature (the TD weight vector, since $v_{TD}$ is linear in the query);
# * **sensitivity similarity** (SS): $\sum_x d_\pi(x) \cos\big(\nabla_{\phi} v_{TF}(x), \nabla_{\phi} v_{TD}(x)\big)$,
#   the gradients taken with respect to the query feature;
# * the entries the construction predicts: $V[-1,-1]$ (1 times the step's share carried by $V$; code
#   `P_last`), and the traces of the top-left and top-middle $d \times d$ blocks of $A$, $A_{11}$
#   and $A_{12}$ ($-\alpha d$ and $+\alpha d$ up to that share; code `trQ11`, `trQ12`).
#
# Since $(V, A)$ and $(-V, -A)$ give the same output, runs are **sign-aligned** by the sign of
# $V[-1,-1]$ before their matrices are averaged.
#
# For a linear-attention model IWS and SS coincide: by Proposition 7.2, every layer multiplies
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


# %% [markdown]
# With one query per prompt, autograd gives each state's value in context and its gradient with respect to the query feature:

# %%
#| export
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


# %% [markdown]
# The value difference is the $d_\pi$-weighted squared error (`weighted_error`) between the two value functions:

# %%
#| export
def _cos(a, b, dim=-1): return (a * b).sum(dim) / (a.norm(dim=dim) * b.norm(dim=dim)).clamp(min=1e-300)

def value_difference(v_tf:torch.Tensor,  # (..., s) the model's values
                     v_td:torch.Tensor,  # (..., s) linear TD's values
                     d_pi:torch.Tensor,  # (..., s) the weights, the stationary distribution
                    )->torch.Tensor:     # (...) VD (NaN where a diverged model's values are)
    "VD: $\\sum_s d_\\pi(s) (v_{TF}(s) - v_{TD}(s))^2$ over the last axis."
    return weighted_error(v_tf, v_td, d_pi)


# %% [markdown]
# The implicit weight similarity fits a weight vector to the model's values by $d_\pi$-weighted least squares and compares its direction with TD's:

# %%
#| export
def implicit_weight_similarity(v_tf:torch.Tensor,   # (..., s) the model's values
                               phi:torch.Tensor,    # (..., s, d) features
                               d_pi:torch.Tensor,   # (..., s) weights of the fit
                               w_td:torch.Tensor,   # (..., d) TD weight vector
                              )->torch.Tensor:      # (...) cosine of the fitted weight with w_td
    "IWS: cosine between the $d_\\pi$-weighted least-squares weight of `v_tf` on `phi` and `w_td`."
    A = phi.mT @ (d_pi.unsqueeze(-1) * phi)
    w_tf = torch.linalg.solve(A, (phi.mT @ (d_pi * v_tf).unsqueeze(-1))).squeeze(-1)
    return _cos(w_tf, w_td)


# %% [markdown]
# The sensitivity similarity compares the two models' query gradients state by state:

# %%
#| export
def sensitivity_similarity(g_tf:torch.Tensor,  # (..., s, d) the model's query gradients
                           g_td:torch.Tensor,  # (..., s, d) linear TD's query gradients
                           d_pi:torch.Tensor,  # (..., s) the weights, the stationary distribution
                          )->torch.Tensor:     # (...) SS (NaN where a diverged model's gradients are)
    "SS: $\\sum_s d_\\pi(s) \\cos(g_{TF}(s), g_{TD}(s))$ for query gradients of shape (..., s, d)."
    return (d_pi * _cos(g_tf, g_td)).sum(-1)


# %% [markdown]
# The three numbers the construction predicts about the parameters:

# %%
#| export
def pq_summary(P:torch.Tensor,  # (..., 2d+1, 2d+1)
               Q:torch.Tensor,  # (..., 2d+1, 2d+1)
              )->dict:          # P_last, trQ11, trQ12, each (...)
    "The entries the TD construction predicts: $P[-1,-1]$, $\\mathrm{tr}\\,Q_{11}$ and $\\mathrm{tr}\\,Q_{12}$."
    d = P.shape[-1] // 2
    return dict(P_last=P[..., -1, -1], trQ11=Q[..., :d, :d].diagonal(dim1=-2, dim2=-1).sum(-1),
                trQ12=Q[..., :d, d:2 * d].diagonal(dim1=-2, dim2=-1).sum(-1))


# %% [markdown]
# And the sign alignment that makes runs comparable:

# %%
#| export
def align_signs(P:torch.Tensor, Q:torch.Tensor)->tuple:
    "(P, Q) multiplied by the sign of P[-1, -1] (same output, comparable across runs)."
    s = torch.where(P[..., -1:, -1:] < 0, -1., 1.).to(P)
    return P * s, Q * s


# %% [markdown]
# The check: the TD construction scored against itself has $\mathrm{IWS} = \mathrm{SS} = 1$ and
# $\mathrm{VD} = 0$; its sign-flipped copy too, and alignment undoes the flip; a perturbed model
# scores lower on every measure; the summary entries of the construction are
# $(1, -\alpha d, +\alpha d)$; and for a random (untrained) linear model IWS equals SS.

# %%
mrp = random_boyan_chain(seed=3)
S, R = sample_trajectory(mrp, n=30, seed=3)
Zc = build_linear_prompt(mrp.phi[S], R, mrp.phi[0], mrp.gamma)[..., :30]
P_td, Q_td = td_parameters(4, 0.7)
td_fn = lambda Z: moment_predict(P_td[None], Q_td[None], Z, 30, 3)
v_td, g_td = values_and_gradients(td_fn, Zc, mrp.phi)
test_close(g_td, g_td[:1].expand(10, 4), eps=1e-12)
def scores(P, Q):
    v, g = values_and_gradients(lambda Z: moment_predict(P[None], Q[None], Z, 30, 3), Zc, mrp.phi)
    return (implicit_weight_similarity(v, mrp.phi, mrp.d_pi, g_td[0]).item(),
            value_difference(v, v_td, mrp.d_pi).item(),
            sensitivity_similarity(g, g_td, mrp.d_pi).item())
test_close(scores(P_td, Q_td), (1., 0., 1.), eps=1e-12)
test_close(scores(-P_td, -Q_td), (1., 0., 1.), eps=1e-12)
test_eq(align_signs(-P_td, -Q_td), (P_td, Q_td))
noise = 0.3 * torch.randn(2, 9, 9, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
iws_p, vd_p, ss_p = scores(P_td + noise[0], Q_td + noise[1])
assert iws_p < 0.99 and vd_p > 1e-3 and ss_p < 0.99, (iws_p, vd_p, ss_p)
test_close(torch.stack(list(pq_summary(P_td, Q_td).values())),
           torch.tensor([1., -2.8, 2.8], dtype=torch.float64), eps=1e-12)
P_r, Q_r = LinearICTD(4, n_layers=3, init_gain=0.5, seed=4).stacked_params()
v_r, g_r = values_and_gradients(lambda Z: moment_predict(P_r.detach()[None], Q_r.detach()[None], Z,
                                                         30, 3), Zc, mrp.phi)
test_close(implicit_weight_similarity(v_r, mrp.phi, mrp.d_pi, g_td[0]),
           sensitivity_similarity(g_r, g_td, mrp.d_pi), eps=1e-10)
print(f"IWS {iws_p:.3f}, VD {vd_p:.3f}, SS {ss_p:.3f}")

# %% [markdown]
# ## Pretraining the linear Transformer
#
# The linear family plugs into the pretraining engine of [chapter 6](pretrain.html): its stacked
# parameters $(V, A)$ (code `P`, `Q`) with a leading seed axis, its prompts, its forward pass
# (Proposition 7.2's matrix form) and its measures are registered under
# `PretrainConfig(attention="linear")` when `ictd.linear` is imported, so `pretrain_many` trains
# linear Transformers on any data protocol the engine knows.
#
# `ICLR_LINEAR` holds the predecessor's settings: $d = 4$ random features, 10 states, $n = 30$,
# $L = 3$ layers sharing one $(V, A)$, $\gamma = 0.9$, Adam with learning rate $10^{-3}$ and weight
# decay $10^{-6}$, Xavier-normal initialisation with gain $0.1$, mini-batches of `batch_size` TD
# errors (one trajectory's $n_{\mathrm{mb}} + 1$ windows; the counts are printed with the
# [protocol](sliding.html#the-protocol-in-the-engine)), 5 mini-batches per task, 4000 tasks (`n_tasks`, so `n_steps` = 20000 optimiser steps), the
# [sliding-window protocol](sliding.html) (registered by `ictd.sliding`, which `ictd.linear` imports). Every `eval_every` steps we record, on 32 held-out tasks per seed
# (contexts of $n$ transitions from the task's random start distribution, as the predecessor
# evaluates), the measures defined above under the names `iws`, `vd`, `ss`, `msve` (against the
# true values; VD against batch TD at the [fitted step size](sliding.html#the-batch-td-companion-and-its-step-size)), and the entries `P_last`, `trQ11`, `trQ12` of the last layer. The engine's checks of
# the family (each stacked run equals its module; seeds train independently) are in
# [Implementation and tests](#the-engine-plug-ins).

# %%
#| export
ICLR_LINEAR = PretrainConfig(attention="linear", protocol="sliding", shared=True, n_tasks=4000, n_steps=20_000,
                             batch_size=64, eval_every=1250, eval_tasks=32, lr=1e-3, weight_decay=1e-6, init_gain=0.1)


# %% [markdown]
# The family's pieces: each seed's initialisation, stacked,

# %%
#| export
def linear_init(config:PretrainConfig, seeds:list, dtype=torch.float64)->dict:
    "Each seed's `LinearICTD` initialisation, stacked: P and Q of shape (S, L or 1, 2d+1, 2d+1)."
    if config.init != "xavier": raise ValueError(f"`init` must be 'xavier' for the linear family, got {config.init!r}")
    models = [LinearICTD(config.feature_dim, n_layers=config.n_layers, shared=config.shared, init_gain=config.init_gain, seed=run_stream(s, "init")) for s in seeds]
    return {k: torch.stack([torch.stack([getattr(lay, k).detach() for lay in m.layers]) for m in models]).to(dtype) for k in ("P", "Q")}


# %% [markdown]
# its prompts,

# %%
#| export
def linear_prompt(config:PretrainConfig, x:Contexts)->torch.Tensor:
    "The engine's prompts as linear-attention prompts (S, B..., 2d+1, n+q)."
    return build_linear_prompt(*x.features(), config.gamma)


# %% [markdown]
# its forward pass, through the matrix form,

# %%
#| export
def linear_predict(config:PretrainConfig, params:dict, Z:torch.Tensor, n:int)->torch.Tensor:
    "(S, B, q) values of every seed's linear Transformer, through the matrix form."
    P = params["P"]
    return moment_predict(P[:, None], params["Q"][:, None], Z.to(P.dtype), n, config.n_layers)


# %% [markdown]
# and a module carrying one seed's trained parameters.

# %%
#| export
def linear_module(config:PretrainConfig, params:dict)->LinearICTD:
    "A `LinearICTD` carrying one seed's parameters (L or 1, 2d+1, 2d+1)."
    model = LinearICTD(config.feature_dim, n_layers=config.n_layers, shared=config.shared, seed=0, dtype=params["P"].dtype)
    model.load_state_dict({f"layers.{l}.{k}": params[k][l] for l in range(params["P"].shape[0]) for k in ("P", "Q")})
    return model


# %% [markdown]
# The measures defined above, for many seeds at once,

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
    P_td, Q_td = (t.to(Zc.device) for t in td_parameters(d, alpha))   # on the contexts' device (CUDA runs)
    v_td, g_td = values_and_gradients(lambda Z: moment_predict(P_td[None], Q_td[None], Z, n, n_layers), Zc, tasks.phi)
    out = dict(iws=implicit_weight_similarity(v_tf, tasks.phi, tasks.d_pi, g_td[..., 0, :]), vd=value_difference(v_tf, v_td, tasks.d_pi),
               ss=sensitivity_similarity(g_tf, g_td, tasks.d_pi), msve=value_difference(v_tf, tasks.v_pi, tasks.d_pi))
    return {k: v.mean(-1) for k, v in out.items()} | pq_summary(P[:, -1], Q[:, -1])


# %% [markdown]
# and the hook that the engine calls at every evaluation:

# %%
#| export
def linear_metrics(config:PretrainConfig, params:dict, ev)->dict:
    "The engine's hook: `linear_measures` on the engine's held-out contexts, each (S, 1)."
    alpha = fitted_td_step(n=config.n, n_layers=config.n_layers, gamma=config.gamma, n_states=config.n_states, d=config.feature_dim)
    out = linear_measures(params["P"], params["Q"], ev.tasks, ev.x[..., :config.n], alpha, config.n_layers)
    return {k: v[:, None] for k, v in out.items() if k != "msve"}

register_family("linear", Family(init=linear_init, prompt=linear_prompt, predict=linear_predict, module=linear_module, metrics=linear_metrics))


# %% [markdown]
# ### The predecessor's windows as linear prompts
#
# The [sliding-window protocol](sliding.html) cuts a trajectory of $n + n_{\mathrm{mb}} + 2$ states into
# $n_{\mathrm{mb}} + 1$ overlapping windows; for the linear family each window is a prompt with one query:

# %%
#| export
def sliding_windows(phi:torch.Tensor,   # (..., s, d) features of each trajectory's task
                    r:torch.Tensor,     # (..., s) rewards of each trajectory's task
                    states:torch.Tensor,# (..., T) trajectories, T >= n + 3
                    n:int,              # context length
                    gamma:float,        # discount factor
                   )->tuple:            # (Z (..., T-n-1, 2d+1, n+1) one prompt per window, rewards (..., T-n-2) r(query of window k))
    "Cut trajectories into overlapping windows: window k has context states k..k+n and query state k+n+1."
    T, n = states.shape[-1], check_int(n, "n", 1)
    if T < n + 3: raise ValueError(f"`states` must hold at least n + 3 = {n + 3} states for two windows, got {T}")
    phi_S = torch.gather(phi, -2, states.unsqueeze(-1).expand(states.shape + phi.shape[-1:]))
    r_S = torch.gather(r, -1, states)
    W = T - n - 1
    ctx = phi_S.unfold(-2, n + 1, 1)[..., :W, :, :].transpose(-1, -2)   # (..., W, n+1, d)
    Z = build_linear_prompt(ctx, r_S.unfold(-1, n, 1)[..., :W, :], phi_S[..., n + 1:, :], gamma)
    return Z, r_S[..., n + 1:T - 1]


# %%
show_doc(sliding_windows)

# %% [markdown]
# A check against the definition, window by window, on one short trajectory: contexts, queries and
# rewards line up, and consecutive windows overlap in all but one transition.

# %%
mrp = random_boyan_chain(seed=5)
gen = torch.Generator().manual_seed(0)
mu = start_distributions(1, 10, gen)
states = sample_trajectories(mrp.P[None], mu, n=12, seed=gen)[0]
Zw, rw = sliding_windows(mrp.phi, mrp.r, states, 8, mrp.gamma)
test_eq((Zw.shape, rw.shape), ((4, 9, 9), (3,)))
for k in range(4):
    test_eq(Zw[k],
            build_linear_prompt(mrp.phi[states[k:k + 9]], mrp.r[states[k:k + 8]],
                                mrp.phi[states[k + 9]], mrp.gamma))
    if k < 3: test_eq(rw[k], mrp.r[states[k + 9]])
test_eq(Zw[1, :, :7], Zw[0, :, 1:8])

# %% [markdown]
# Everything the experiments need from this chapter is now in place: the construction
# (`LinearICTD.from_td`), its matrix form (`moment_predict`), the measures and the linear family. The
# [next page](sliding.html) defines the predecessor's protocol and the step size of its batch-TD
# model; the [experiments](linear_experiments.html) train with them.

# %% [markdown]
# ## Implementation and tests
#
# The checks a reader does not need for the argument, still executed: input validation, batching,
# the initialisation, the measures' edge cases, and the plug-ins' equivalences.
#
# ### The prompt, the layer and the model: bad input

# %%
test_fail(lambda: build_linear_prompt(phi_s, R_[:2], phi_s[0], 0.5),
          contains="`rewards` must have shape (..., 3)")
test_fail(lambda: build_linear_prompt(phi_s, R_, torch.ones(3), 0.5),
          contains="`phi_queries` must have shape")
test_fail(lambda: build_linear_prompt(phi_s, R_, phi_s[0], 1.0),
          contains="`gamma` must lie in [0, 1)")
test_fail(lambda: build_linear_prompt(phi_s.expand(2, 4, 2), R_, phi_s[:2].expand(3, 2, 2), 0.5),
          contains="batch dimensions of `phi_states` (2,), `rewards` (), `phi_queries` (3,) do not "
                   "broadcast")
test_fail(lambda: build_linear_prompt(phi_s, R_, torch.tensor(1.), 0.5),
          contains="`phi_queries` must have shape")
test_fail(lambda: td_parameters(4, "0.5"), contains="`alpha` must be a finite number")
test_fail(lambda: td_parameters(4, torch.tensor([0.5, math.nan])), contains="`alpha` contains NaN")
test_eq(td_parameters(4, torch.tensor([0.5, 0.25]))[1].shape, (2, 9, 9))
test_fail(lambda: LinearICTD(4, n_layers=2.5), contains="`n_layers` must be a positive integer")
test_fail(lambda: LinearICTD.from_td(4, n_layers=3, alpha="0.5"),
          contains="`alpha` must be a finite number")

# %%
lay = LinearAttentionLayer(4, seed=0)
test_eq(lay.P.detach(), LinearAttentionLayer(4, seed=0).P.detach())
test_ne(lay.P.detach(), LinearAttentionLayer(4, seed=1).P.detach())
big = LinearAttentionLayer(40, init_gain=0.5, seed=0)
test_close(big.Q.detach().std().item(), 0.5 * (2 / (81 + 81)) ** 0.5, eps=0.01)
test_fail(lambda: LinearAttentionLayer(0), contains="`d` must be a positive integer")

# %% [markdown]
# Batched prompts run at once, each query's answer ignores the other queries, and malformed prompts are rejected:

# %%
model = LinearICTD.from_td(4, n_layers=10, alpha=0.3)
batched = model.predict(Zb, n=30)
test_eq(batched.shape, (6, 10))
for b in range(6):
    test_close(batched[b], model.predict(Zb[b], n=30), eps=1e-13)
    test_close(batched[b, 3:4], model.predict(Zb[b, :, :34], n=30)[3:], eps=1e-13)
test_fail(lambda: model.predict(Zb[:, :5], n=30), contains="`Z` must have 9 rows")
test_fail(lambda: model.predict(Zb, n=50), contains="`n` must be an integer in 1..40")
test_fail(lambda: model.predict(Zb), contains="`n` must be given")
mrp_v = random_boyan_chain(n_states=10, d=4, seed=3)
S_v, R_v = sample_trajectory(mrp_v, n=40, seed=3)
# 10 queries: n = 40 is read from the prompt
Z1 = build_linear_prompt(mrp_v.phi[S_v], R_v, mrp_v.phi, mrp_v.gamma)
test_eq(model.predict(Z1).detach(), model.predict(Z1, n=40).detach())
test_fail(lambda: model.predict(Z1, n=49), contains="`n` = 49 contradicts the prompt")
# parameters are never cast to int
test_fail(lambda: model.predict(Z1.long(), n=40), contains="`Z` must be a real floating tensor")
test_fail(lambda: model.predict(Z1 * 1j, n=40), contains="`Z` must be a real floating tensor")
Z_nan = Z1.clone(); Z_nan[0, 3] = math.nan
test_fail(lambda: model.predict(Z_nan, n=40), contains="`Z` contains NaN or inf")
test_fail(lambda: LinearICTD.from_td(4, n_layers=3, alpha=0.1, C=torch.eye(3)),
          contains="`C` must have shape (4, 4)")
test_eq(LinearICTD.from_td(4, n_layers=3, alpha=0.1).predict(Zb.float(), n=30).dtype, torch.float32)


# %% [markdown]
# ### Long contexts in linear memory
#
# The dense layer builds the $n \times N$ scores $Z_{:,<n}^\top Q Z$: at $n = 10^5$, tens of GiB. Without softmax,
# Proposition 7.2's associativity gives the same layer as $Z + \frac1n (P \Sigma)(Q Z)$ with $\Sigma = Z_{:,<n} Z_{:,<n}^\top$, in
# $O(nd^2)$ time and $O(nd)$ memory. With the predecessor's softmax, each key's scores are normalised over the
# targets, so the path `'streamed'` takes the keys in chunks, each chunk's scores (at most `CHUNK_BYTES`) at a time.
# `method='auto'` takes that path when the dense scores would pass `DENSE_BYTES`, and the dense path is refused
# with its estimate above `WORK_LIMITS['bytes']`.

# %% [markdown]
# The two paths agree to $10^{-12}$ relative (with and without softmax, shared and per-layer parameters, a batch of
# prompts, chunks of one key and of several), `'auto'` switches at `DENSE_BYTES`, and a dense layer too large is refused:

# %%
def linear_paths_agree(model, Z, n):
    "Largest gap between the dense and the streamed forward pass, relative to the largest entry."
    dense, streamed = (model(Z, n, method=m) for m in ("dense", "streamed"))
    return ((dense - streamed).abs().max() / dense.abs().max()).item()

for s, softmax in enumerate((False, True, False, True)):
    m_p = LinearICTD(4, n_layers=3, shared=s < 2, init_gain=0.5, seed=s, softmax=softmax)
    assert linear_paths_agree(m_p, Zb, 30) < 1e-12
    for rows in (1, 7):                                  # chunks of 1 and 7 keys (n = 30)
        with unittest.mock.patch.object(ictd.core, "CHUNK_BYTES", rows * 40 * 6 * 8):
            assert linear_paths_agree(m_p, Zb, 30) < 1e-12
test_close(LinearICTD.from_td(4, n_layers=5, alpha=0.3).predict(Zb, 30, method="streamed"),
           batch_linear_td(
    torch.stack([m.phi[S]
                 for m, (S, _) in zip(mrps, trajs)]), torch.stack([R for _, R in trajs]), alpha=0.3,
    gamma=mrps[0].gamma, n_iters=5, phi_queries=torch.stack([m.phi for m in mrps]))[..., 31:],
           eps=1e-12)
# the dense layer's two 30 x 40 arrays, 6 prompts
size = 2 * 6 * 30 * 40 * 8
m_auto = LinearICTD(4, n_layers=3, seed=0)
with unittest.mock.patch.object(ictd.core, "DENSE_BYTES", size - 1):
    test_eq(m_auto.predict(Zb, 30).detach(), m_auto.predict(Zb, 30, method="streamed").detach())
with unittest.mock.patch.object(ictd.core, "DENSE_BYTES", size):
    test_eq(m_auto.predict(Zb, 30).detach(), m_auto.predict(Zb, 30, method="dense").detach())
Z_long = torch.zeros(9, 10**5 + 1, dtype=torch.float64)   # n = 10^5: far above the limit
test_fail(lambda: m_auto.predict(Z_long, 10**5, method="dense"),
          contains="attention scores of the dense layer would need about")
test_fail(lambda: m_auto.predict(Zb, 30, method="sparse"), contains="`method` must be one of")


# %% [markdown]
# ### Why the initialisation is random
#
# At zero parameters the gradient of the output vanishes identically; at the seeded Xavier draw it
# does not.

# %%
def output_gradient_norm(model):
    model.zero_grad(); model.predict(Zb, n=30).sum().backward()
    return sum(p.grad.norm() ** 2 for p in model.parameters()).sqrt().item()
zero_model = LinearICTD(4, n_layers=3, seed=0)
with torch.no_grad():
    for p in zero_model.parameters(): p.zero_()
test_eq(output_gradient_norm(zero_model), 0.)
assert output_gradient_norm(LinearICTD(4, n_layers=3, seed=0)) > 1e-3
output_gradient_norm(LinearICTD(4, n_layers=3, seed=0))

# %% [markdown]
# ### The measures and the windows: bad input

# %%
test_fail(lambda: query_each_state(Zc[:8], mrp.phi), contains="`Zc` must have 2d+1 = 9 rows")
test_fail(lambda: sliding_windows(mrp.phi, mrp.r, torch.zeros(10, dtype=torch.long), 8, 0.9),
          contains="at least n + 3 = 11 states")

# %% [markdown]
# ### The engine plug-ins
#
# The family on the engine's own (stationary) protocol, two seeds: each stacked run equals the
# module built from its parameters, and its initialisation is the seed's own.

# %%
cfg_stat = PretrainConfig(attention="linear", shared=True, n_steps=20, eval_every=10, n_tasks=64,
                          eval_tasks=8, batch_size=16)
runs = pretrain_many(cfg_stat, [3, 4], progress=False)
test_eq(linear_init(cfg_stat, [4])["P"][0, 0],
        LinearICTD(4, n_layers=3, seed=run_stream(4, "init")).layers[0].P.detach())
mrp_s = random_boyan_chain(seed=21)
S_s, R_s = sample_trajectory(mrp_s, n=25, seed=21)
Zs = build_linear_prompt(mrp_s.phi[S_s], R_s, mrp_s.phi, mrp_s.gamma)
for r in runs:
    test_eq(type(r.model), LinearICTD)
    p = {k: v.detach()[None] for k, v in zip(("P", "Q"), r.model.stacked_params())}
    test_close(linear_predict(cfg_stat, p, Zs[None, None], 25)[0, 0], r.model.predict(Zs, n=25),
               eps=1e-12)
test_eq(sorted(runs[0].history),
        sorted(["step", "loss", "msve", "neu", "iws", "vd", "ss", "P_last", "trQ11", "trQ12"]))
assert not torch.equal(runs[0].model.layers[0].P, LinearICTD(4, n_layers=3, seed=3).layers[0].P)

# %% [markdown]
# ### API entries of the page's other functions
#
# The functions the lesson uses but does not teach (the engine's plug-ins, measures, tables and plots), documented here:

# %%
show_doc(moment_predict)

# %%
show_doc(query_each_state)

# %%
show_doc(values_and_gradients)

# %%
show_doc(value_difference)

# %%
show_doc(implicit_weight_similarity)

# %%
show_doc(sensitivity_similarity)

# %%
show_doc(pq_summary)

# %%
show_doc(align_signs)

# %%
show_doc(linear_init)

# %%
show_doc(linear_prompt)

# %%
show_doc(linear_predict)

# %%
show_doc(linear_module)

# %%
show_doc(linear_measures)

# %%
show_doc(linear_metrics)

# %%
#| export
from ictd.boyan import check_arguments
check_arguments(globals())   # every public function refuses, naming it, an argument its annotation rules out (chapter 0)

# %% [markdown]
# The exported module's functions check their arguments against their annotations
# (chapter 0's `check_arguments`), naming the argument:

# %%
import ictd.linear as lin

# %%
ones = torch.ones(3)
test_fail(lambda: lin.value_difference("abc", ones, ones), contains="`v_tf` must be a tensor")
test_fail(lambda: lin.sensitivity_similarity(ones, "abc", ones), contains="`g_td` must be a tensor")

# %%
#| hide
import nbdev; nbdev.nbdev_export()
