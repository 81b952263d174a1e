# %%
#| default_exp prompt

# %%
#| export
from __future__ import annotations
from dataclasses import dataclass
import torch
from ictd.boyan import as_tensor
from ictd.core import check_broadcast, check_floating, check_int, moved_to_keywords

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *

# %%
#| hide
import matplotlib.pyplot as plt
import numpy as np
from ictd.boyan import random_boyan_chain, sample_trajectory
from ictd.core import record_claim
import math
import inspect, re
from IPython.display import Markdown

# %%
#| hide
from ictd.core import api_table, short_doc   # the helper tables of appendix A

# %% [markdown]
# # The prompt
# > How a trajectory and the states to evaluate become one matrix of tokens: features, reward and a value-memory slot per column.

# %% [markdown]
# ::: {.callout-note}
# **What this chapter shows.** The prompt $Z_0$ (Definition 2.1): one column per transition, one for the last state
# and one per query, with rows for the features, the reward and an empty value memory. Row-token attention, as code
# usually writes it, is the book's column form transposed (checked against torch's attention in float64).
# `build_prompt` writes a trajectory into this layout, and a figure shows one prompt. `Prompt` keeps a prompt's
# number of transitions with the matrix.
# :::

# %% [markdown]
# **Intuition.** A Transformer reads a matrix: one column per token, one row per embedding coordinate. To make it
# evaluate a policy in context we must write the context trajectory
# $S_0, R_1, S_1, \dots, R_n, S_n$ and the states we want values for into such a matrix. The paper
# says what goes in (the features of the states, the rewards, and memory slots in which the layers
# write their value estimates); the exact layout below is **the project's own choice**, made so that
# the constructions of the [next](dual_head.html) [two](tsm.html) chapters are exact.
#
# ::: {.definition}
# **Definition 2.1 (the prompt; our layout).** For a context of $n$ transitions with features
# $\phi(\cdot) \in \mathbb{R}^d$ and $q$ query states $x_{n+1}, \dots, x_{n+q}$, the prompt $Z_0$ has $d + 2$
# rows and $n + 1 + q$ columns:
#
# | column $j$ | rows $0..d-1$ (features) | row $d$ (reward) | row $d+1$ (value memory) |
# |---|---|---|---|
# | $0 \le j < n$: transition $j+1$ | $\phi(S_j)$ | $R_{j+1}$ | $v_0(S_j) = 0$ |
# | $j = n$: the last state | $\phi(S_n)$ | $0$ | $0$ |
# | $n < j \le n + q$: query $j - n$ | $\phi(x_j)$ | $0$ | $0$ |
# :::
#
# Column $j < n$ is the token of transition $j+1 = (S_j, R_{j+1}, S_{j+1})$, but it holds only the
# first state and the reward: the successor state $S_{j+1}$ is the *next* column. This is why the
# last state $S_n$, which starts no transition, still needs a column of its own: it is the successor
# of the $n$-th transition. The $q$ query columns hold the states whose values we want; one query
# column is the usual case, and several let one forward pass evaluate many states (every state of
# a chain, say). The last row starts at zero everywhere: it is the memory in which the layers
# accumulate their value estimates, and the readout of the model is that row at the query columns.
#
# The layout fixes which columns are *keys*: only the $n$ context columns carry a transition, so
# only they are attended to. The last-state and query columns are read from (they are queries of the
# attention) but never attended to, which the models implement with a $-\infty$ mask. A consequence,
# checked in [the next chapter](dual_head.html): appending or removing query columns changes nothing
# in the other columns.

# %% [markdown]
# ## From row-token attention to the book's columns
#
# Most code and papers write attention with **tokens as rows**: $H = Z^\top$ is $m \times D$ (one row per
# token), and a head computes $\operatorname{softmax}\big(\mathsf Q \mathsf K^\top/\sqrt{d_k}\big)\,\mathsf V$ with $\mathsf Q = H W_Q^\top$,
# $\mathsf K = H W_K^\top$, $\mathsf V = H W_V^\top$, the softmax taken along each row (sans-serif letters: the
# row-token matrices, which appear only in this box; $K$, $V$ and $Q$ keep their meanings elsewhere). This book, like the in-context-learning
# papers it follows, writes **tokens as columns**. The two are the same computation, transposed:
#
# ::: {.callout-tip title="The bridge: row-token attention in the book's column convention"}
# | | row-token attention | this book (tokens are columns $z_0, \dots, z_{m-1}$ of $Z$) |
# |---|---|---|
# | token $j$ | row $j$ of $H$ | column $z_j$ of $Z$ |
# | score of key $i$ for query $j$ | $(W_Q z_j)^\top (W_K z_i)/\sqrt{d_k} = z_j^\top W_Q^\top W_K z_i/\sqrt{d_k}$ | $z_i^\top A z_j$ with $A = W_K^\top W_Q/\sqrt{d_k}$ |
# | normalisation | softmax along row $j$: the matrix $S^\top$, row-stochastic | softmax over keys $i$ in column $j$: $S$, column-stochastic |
# | output | $S^\top \mathsf V$, row $j = \sum_i S[i, j]\, (W_V z_i)^\top$ | $W_V Z S$, column $j = \sum_i S[i, j]\, W_V z_i$ |
# | mask of non-key tokens | $-\infty$ added to the scores of those keys | $\omega_i = -\infty$ for $i \ge n$ |
#
# On features the score is $\phi(S_{i})^\top W \phi(x_j)$, key first, so the book's feature score matrix is
# $W = W_K^\top W_Q$ (up to the $1/\sqrt{d_k}$, which the book folds into $W$), not its transpose; for a
# non-symmetric $W$ the order matters ([chapter 1](weighted_softmax_td.html#implementation-and-tests) checks it).
# :::
#
# The check builds a random prompt-sized example in float64, runs torch's own row-token attention
# (`scaled_dot_product_attention`, with the last-state and query tokens masked as keys) and compares it
# with the column form $W_V Z S$, $S[i, j] = \operatorname{softmax}_i(z_i^\top A z_j + \omega_i)$:

# %%
g_bridge = torch.Generator().manual_seed(0)
D_tok, m_tok, n_keys, d_k = 6, 9, 6, 3           # embedding size, tokens, keys, head size
randn = lambda *shape: torch.randn(*shape, generator=g_bridge, dtype=torch.float64)
Z_b = randn(D_tok, m_tok)                         # tokens are the columns
W_Q, W_K, W_V = randn(d_k, D_tok), randn(d_k, D_tok), randn(D_tok, D_tok)
H = Z_b.T                                         # row-token view: one row per token
key_mask = torch.zeros(m_tok, m_tok, dtype=torch.float64)
key_mask[:, n_keys:] = -math.inf                  # tokens n.. are never keys
rows = torch.nn.functional.scaled_dot_product_attention(H @ W_Q.T, H @ W_K.T, H @ W_V.T,
                                                        attn_mask=key_mask)
A_b = W_K.T @ W_Q / math.sqrt(d_k)                # the book's score matrix
mask_col = torch.where(torch.arange(m_tok) < n_keys, 0., -math.inf).double()
S_b = torch.softmax(Z_b.T @ A_b @ Z_b + mask_col[:, None], dim=0)   # S[i, j]: key i, column j
bridge_gap = (rows.T - W_V @ Z_b @ S_b).abs().max().item()
assert bridge_gap < 1e-12, bridge_gap
print(f"largest |row-token attention - column form| over the {D_tok} x {m_tok} entries: "
      "below 1e-12")
_ = record_claim(
    "bridge",
    "Row-token attention $\\operatorname{softmax}(\\mathsf Q \\mathsf K^\\top/"
    "\\sqrt{d_k})\\mathsf V$ equals the book's column form $W_V Z S$ with $S$ "
    "column-stochastic and $A = W_K^\\top W_Q/\\sqrt{d_k}$.",
    "proved",
    "prompt",
    "#from-row-token-attention-to-the-books-columns",
)


# %% [markdown]
# ## Building the prompt
#
# `build_prompt` takes features rather than state indices, so that any feature map works: the
# reader computes `mrp.phi[states]`. Inputs may carry leading batch dimensions (many contexts at
# once), which broadcast against each other: one set of query features can serve a whole batch of
# contexts. The query features are read by their number of dimensions: one dimension fewer than
# `phi_states` means one query per prompt, shape (..., d); otherwise they are (..., q, d). So to
# share q queries across a batch of shape (B,), pass them as (1, q, d), not (q, d).

# %%
#| export
def _check_features(x:torch.Tensor, name:str, min_rows:int=0)->None:
    if x.ndim < 2 or x.shape[-2] < min_rows or x.shape[-1] < 1:
        raise ValueError(f"`{name}` must have shape (..., {'n + 1' if min_rows else 'q'}, d) with d >= 1"
                         f"{' and n >= 1' if min_rows else ''}, got {tuple(x.shape)}")


# %%
#| export
def build_prompt(phi_states,        # (..., n + 1, d) features of S_0..S_n (n >= 1 transitions)
                 rewards,           # (..., n) rewards, rewards[k-1] = R_k
                 phi_queries=None,  # (..., q, d) query features, or (..., d) for one query per prompt; None: no query column
                 *,
                 device=None,       # device of the prompt; default: that of `phi_states`
                 dtype=None,        # floating dtype of the prompt; default: the inputs' promoted dtype (float64 for numpy and lists)
                )->torch.Tensor:    # (..., d + 2, n + 1 + q) prompt Z_0: features, reward and value-memory rows; carries n as `Z.n_context` (see `Prompt`)
    "Write a trajectory and query states into the prompt matrix $Z_0$: features, reward and value-memory rows."
    phi_states = as_tensor(phi_states, "phi_states", dtype, device)
    rewards = as_tensor(rewards, "rewards", dtype, device=phi_states.device)
    _check_features(phi_states, "phi_states", min_rows=2)
    n, d = phi_states.shape[-2] - 1, phi_states.shape[-1]
    if rewards.ndim < 1 or rewards.shape[-1] != n:
        raise ValueError(f"`rewards` must have shape (..., n) with n = {n} (one fewer than the states of `phi_states`), got {tuple(rewards.shape)}")
    if phi_queries is None: phi_queries = phi_states.new_zeros(phi_states.shape[:-2] + (0, d))
    phi_queries = as_tensor(phi_queries, "phi_queries", dtype, device=phi_states.device)
    if phi_queries.ndim == phi_states.ndim - 1: phi_queries = phi_queries.unsqueeze(-2)
    _check_features(phi_queries, "phi_queries")
    if phi_queries.shape[-1] != d: raise ValueError(f"`phi_queries` must have last dimension d = {d} like `phi_states`, got {tuple(phi_queries.shape)}")
    dtype = torch.promote_types(torch.promote_types(phi_states.dtype, rewards.dtype), phi_queries.dtype)
    batch = check_broadcast(phi_states=phi_states.shape[:-2], rewards=rewards.shape[:-1], phi_queries=phi_queries.shape[:-2])
    q = phi_queries.shape[-2]
    Z = phi_states.new_zeros(batch + (d + 2, n + 1 + q), dtype=dtype)
    Z[..., :d, :n + 1] = phi_states.transpose(-1, -2)
    Z[..., :d, n + 1:] = phi_queries.transpose(-1, -2)
    Z[..., d, :n] = rewards
    Z.n_context = n
    return Z


# %%
show_doc(build_prompt)

# %% [markdown]
# A hand-sized example: $d = 2$, three transitions, two queries. Reading the matrix column by column
# gives the trajectory back; the reward row is zero from column $n$ on, and the value row is zero.

# %%
phi = torch.tensor([[1., 0.], [0., 1.], [1., 1.], [2., 0.]], dtype=torch.float64)  # S_0..S_3
R = torch.tensor([0.5, -1., 2.], dtype=torch.float64)                               # R_1..R_3
Z = build_prompt(phi, R, torch.tensor([[3., 3.], [0., -1.]], dtype=torch.float64))
test_eq(Z, torch.tensor([[1., 0., 1., 2., 3., 0.],
                         [0., 1., 1., 0., 3., -1.],
                         [.5, -1., 2., 0., 0., 0.],
                         [0., 0., 0., 0., 0., 0.]], dtype=torch.float64))
Z


# %% [markdown]
# ## What the prompt looks like
#
# The heat map below is the prompt of a short trajectory ($n = 12$ transitions, $d = 4$ random
# features) with three query states. The three row blocks are the features, the reward and the
# value memory; the three column blocks are the context (keys and queries of the attention), the
# last state and the query states (queries only).

# %%
#| export
@moved_to_keywords("n", "ax", "title")
def plot_prompt(Z:torch.Tensor,   # (d + 2, n + 1 + q) prompt
                *,
                n:int,            # number of context transitions
                ax=None,          # matplotlib axes; default: a new figure
                title="The prompt $Z_0$",  # axes title
               ):
    "Heat map of a prompt with its row blocks (features, reward, value memory) and column blocks labelled."
    import matplotlib.pyplot as plt
    Z = as_tensor(Z, "Z").detach().cpu()
    if Z.ndim != 2: raise ValueError(f"`Z` must be one prompt of shape (d + 2, n + 1 + q), got {tuple(Z.shape)}")
    D, N = Z.shape
    n = check_int(n, "n", 1, high=N - 1, what=f"an integer in 1..{N - 1} (the context transitions of `Z`)")
    if ax is None: _, ax = plt.subplots(figsize=(min(8, max(6, 0.32 * N + 2)), 0.45 * D + 2))
    lim = float(Z.abs().max()) or 1.
    im = ax.imshow(Z.numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
    ax.figure.colorbar(im, ax=ax, label="entry value", fraction=0.03)
    ax.set_yticks(range(D), [rf"$\phi_{i}$" for i in range(D - 2)] + ["reward", "value memory"])
    step = 1 if N <= 24 else 5
    ax.set_xticks(range(0, N, step), [str(j) for j in range(0, N, step)], fontsize=9)
    for x in (n - 0.5, n + 0.5): ax.axvline(x, color="k", lw=1.5)
    for y in (D - 2.5, D - 1.5): ax.axhline(y, color="k", lw=1, ls="--")
    top = ax.secondary_xaxis("top")
    top.set_xticks([(n - 1) / 2, n, (n + N) / 2], ["context\n(transitions $1..n$)", "last\nstate", "queries"], fontsize=9)
    top.tick_params(length=0)
    ax.set_xlabel("token (column) $j$")
    ax.set_title(title)
    return ax


# %%
#| fig-cap: "Figure 2.1: The prompt stacks features, reward and value memory as rows, and the context, the last state and the queries as columns; the value row starts empty."
#| fig-alt: "Heat map of a 6-row, 16-column matrix: four feature rows with entries of both signs, a reward row filled for the first 12 columns and zero after, and an all-zero value-memory row; vertical lines separate the 12 context columns, the last-state column and three query columns."
small = random_boyan_chain(seed=3)
st, rw = sample_trajectory(small, n=12, seed=3)
Zs = build_prompt(small.phi[st], rw, small.phi[[0, 4, 9]])
_, ax = plt.subplots(figsize=(5.0, 3.5))
ax = plot_prompt(Zs, n=12, ax=ax, title="A 12-transition Boyan-chain context, query states 0, 4, 9")
test_fig_exists(ax)

# %% [markdown]
# The reward row ends at column $n - 1$: the last state and the queries have no reward, and the
# value-memory row is blank. [The next chapter](dual_head.html) builds the layer that fills that row.

# %% [markdown]
# ## Implementation and tests
#
# The lesson ends above; this section documents the rules a user of `build_prompt` meets and tests
# them: how a prompt carries its number of transitions, query shapes, dtypes, batches and bad input.

# %% [markdown]
# ### The layout on a sampled trajectory
#
# On a sampled Boyan-chain trajectory, with every state of the chain as a query, the blocks land
# where the table of Definition 2.1 says; and the bridge's attention matrix is column-stochastic, zero on
# the rows of the masked tokens:

# %%
mrp = random_boyan_chain(seed=0)
states, rewards = sample_trajectory(mrp, n=30, seed=0)
Z = build_prompt(mrp.phi[states], rewards, mrp.phi)
n, d, s = 30, mrp.d, mrp.n_states
test_eq(Z.shape, (d + 2, n + 1 + s))
test_eq(Z[:d, :n + 1], mrp.phi[states].T)
test_eq(Z[:d, n + 1:], mrp.phi.T)
test_eq(Z[d, :n], rewards)
test_eq(Z[d, n:], torch.zeros(s + 1, dtype=torch.float64))
test_eq(Z[d + 1], torch.zeros(n + 1 + s, dtype=torch.float64))
test_eq(Z.n_context, n)
assert not hasattr(Z[..., :-1], "n_context") and not hasattr(Z.float(), "n_context")
test_close(S_b.sum(0), torch.ones(m_tok, dtype=torch.float64), eps=1e-15)
test_eq(S_b[n_keys:], torch.zeros(m_tok - n_keys, m_tok, dtype=torch.float64))

# %% [markdown]
# ### The prompt carries its $n$
#
# The matrix alone does not say where the context ends: the last-state column and a query column
# look alike (features, reward 0, value 0), and a context column may have reward 0 too. So a
# prompt with $q$ query columns and $m = n + 1 + q$ columns cannot tell a model its $n$. A model that
# *guessed* $n = m - 2$ (one query) would silently treat the first $q - 1$ queries of a
# several-query prompt as context transitions: it would attend to them as keys and read the wrong
# values back ([the next chapter](dual_head.html) measures how wrong). The book's rule is that
# $n$ is never guessed:
#
# * `build_prompt` attaches $n$ to the tensor it returns, as the attribute `Z.n_context`;
# * every model reads $n$ from the argument `n` if given, else from `Z.n_context`, and raises a
#   `ValueError` if neither is there, or if both are and disagree.
#
# The attribute lives on that tensor object only: slicing, stacking, `.to()` to another dtype or
# device, or a round trip through numpy return a plain tensor without it, and then `n` must be
# passed. The attribute is kept for one release for the chapters that read it; new code passes a
# `Prompt` (below), which carries $n$ through all of these.

# %%
# the hand-sized example's S_0..S_3
phi = torch.tensor([[1., 0.], [0., 1.], [1., 1.], [2., 0.]], dtype=torch.float64)
R = torch.tensor([0.5, -1., 2.], dtype=torch.float64)
Z = build_prompt(phi, R, torch.tensor([[3., 3.], [0., -1.]], dtype=torch.float64))


# %% [markdown]
# ### A `Prompt`: the matrix and its $n$ together
#
# The attribute `Z.n_context` is lost by `.clone()`, `.float()`, `.to()`, `torch.stack` and numpy.
# A `Prompt` keeps the two together as one value: a frozen dataclass holding the matrix `Z` and the
# integer `n`, whose methods return new prompts with the same `n`. We chose a plain dataclass over a
# tensor subclass on purpose: a subclass would have to decide, for each of torch's hundreds of
# operations, whether the result is still a prompt (a slice of columns is not; a cast is), and any it
# got wrong would carry a wrong $n$ silently. A dataclass supports only the operations that keep a
# prompt a prompt (device and dtype moves, batch indexing, stacking and concatenation along batch
# axes) and refuses the rest by not having them. `torch.stack` and `torch.cat` of prompts work too
# (through `__torch_function__`) and refuse prompts of different $n$. The softmax models of chapters 3 to 4a
# accept a `Prompt` in `predict` and `forward` in place of `(Z, n)`, and `forward` returns one; plain tensors
# with an explicit `n` keep working.

# %%
#| export
def _batch_dim(dim, batch_ndim:int)->int:
    "A stacking axis among the batch axes 0..`batch_ndim` (negative counts from the end of them), or a `ValueError` naming `dim`."
    dim = check_int(dim, "dim", -batch_ndim - 1, high=batch_ndim,
                    what=f"a batch axis in {-batch_ndim - 1}..{batch_ndim} (the last two axes of a prompt are its rows and columns)")
    return dim % (batch_ndim + 1)

@dataclass(frozen=True, eq=False)
class Prompt:
    "A prompt matrix and its number of context transitions, kept together through casts, moves and stacking."
    Z:torch.Tensor   # (..., D, n + 1 + q) the prompt matrix (D = d + 2 rows for the book's models)
    n:int            # number of context transitions: the columns 0..n-1 are keys, column n is the last state

    def __post_init__(self):
        Z = check_floating(self.Z, "Z")
        if Z.ndim < 2: raise ValueError(f"`Z` must have shape (..., D, n + 1 + q), got {tuple(Z.shape)}")
        N = Z.shape[-1]
        n = check_int(self.n, "n", 1, high=N - 1, what=f"an integer in 1..{N - 1} (the columns of `Z` minus the last-state column)")
        object.__setattr__(self, "Z", Z); object.__setattr__(self, "n", n)

    @classmethod
    def build(cls, phi_states, rewards, phi_queries=None, *, device=None, dtype=None)->Prompt:
        "`build_prompt(phi_states, rewards, phi_queries, device=device, dtype=dtype)` as a `Prompt`."
        Z = build_prompt(phi_states, rewards, phi_queries, device=device, dtype=dtype)
        return cls(Z, Z.n_context)

    @property
    def q(self)->int: return self.Z.shape[-1] - self.n - 1   # number of query columns
    @property
    def shape(self)->torch.Size: return self.Z.shape
    @property
    def batch_shape(self)->torch.Size: return self.Z.shape[:-2]
    @property
    def dtype(self)->torch.dtype: return self.Z.dtype
    @property
    def device(self)->torch.device: return self.Z.device

    @classmethod
    def _of(cls, Z:torch.Tensor, n:int)->Prompt:
        "A prompt from a model's own output and an `n` already checked: no second pass over the entries (an output may hold inf)."
        p = object.__new__(cls)
        object.__setattr__(p, "Z", Z); object.__setattr__(p, "n", n)
        return p

    def _with(self, Z:torch.Tensor)->Prompt:
        if not Z.is_floating_point(): raise TypeError(f"a Prompt holds a floating tensor, got dtype {Z.dtype}")
        return Prompt._of(Z, self.n)
    def to(self, *args, **kwargs)->Prompt:
        "The prompt with `Z.to(*args, **kwargs)` (a device, a floating dtype, or both) and the same `n`."
        return self._with(self.Z.to(*args, **kwargs))
    def double(self)->Prompt: return self._with(self.Z.double())
    def float(self)->Prompt: return self._with(self.Z.float())
    def cpu(self)->Prompt: return self._with(self.Z.cpu())
    def clone(self)->Prompt: return self._with(self.Z.clone())
    def detach(self)->Prompt: return self._with(self.Z.detach())
    def __len__(self)->int:
        if self.Z.ndim < 3: raise TypeError("len() of a single prompt (no batch axis)")
        return self.Z.shape[0]

    def __getitem__(self, idx)->Prompt:
        "The prompts at `idx` along the batch axes (an index that reaches the rows or columns is refused)."
        if self.Z.ndim < 3: raise IndexError("a single prompt has no batch axis to index (index `Z` itself for its entries)")
        idx = idx if isinstance(idx, tuple) else (idx,)
        if any(i is Ellipsis or i is None for i in idx) or len(idx) > self.Z.ndim - 2:
            raise IndexError(f"a Prompt is indexed along its {self.Z.ndim - 2} batch axes only, got {idx!r}")
        return self._with(self.Z[idx])

    @classmethod
    def stack(cls, prompts, dim:int=0)->Prompt:
        "Prompts of one shape and one `n` stacked along a new batch axis `dim`."
        return cls._join(torch.stack, prompts, dim, new=True)

    @classmethod
    def cat(cls, prompts, dim:int=0)->Prompt:
        "Prompts of one `n` concatenated along the existing batch axis `dim`."
        return cls._join(torch.cat, prompts, dim, new=False)

    @classmethod
    def _join(cls, fn, prompts, dim, new:bool)->Prompt:
        prompts = list(prompts)
        if not prompts or not all(isinstance(p, Prompt) for p in prompts): raise TypeError("`prompts` must be a non-empty list of Prompt")
        if len({p.n for p in prompts}) > 1: raise ValueError(f"`prompts` must share one n, got n = {sorted({p.n for p in prompts})}")
        batch = prompts[0].Z.ndim - 2
        if not new and batch == 0: raise ValueError("`prompts` without a batch axis cannot be concatenated: stack them")
        d = _batch_dim(dim, batch if new else batch - 1)
        return Prompt._of(fn([p.Z for p in prompts], d), prompts[0].n)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        "`torch.stack` and `torch.cat` of prompts give a prompt; other torch functions do not take one."
        joins = {torch.stack: cls.stack, torch.cat: cls.cat}
        if func not in joins: return NotImplemented
        return joins[func](*args, **(kwargs or {}))

    def __repr__(self): return f"Prompt(shape={tuple(self.Z.shape)}, n={self.n}, q={self.q}, dtype={self.dtype}, device={self.device})"

def as_prompt(Z,        # a `Prompt`, or a (..., D, N) tensor
              n=None,   # number of context transitions: required for a plain tensor; must agree with a `Prompt`'s
             )->Prompt:
    "`Z` as a `Prompt`: a `Prompt` passes (an `n` that contradicts it is refused), a tensor needs `n` (or the legacy `Z.n_context`)."
    if isinstance(Z, Prompt):
        if n is not None and check_int(n, "n", 1) != Z.n: raise ValueError(f"`n` = {n} contradicts the prompt, which has n = {Z.n}")
        return Z
    carried = getattr(Z, "n_context", None)
    if n is None and carried is None:
        raise ValueError("`n` must be given: `Z` does not carry its number of context transitions "
                         "(pass a `Prompt`, made by `Prompt.build` or `Prompt(Z, n)`)")
    if carried is not None and n is not None and check_int(n, "n", 1) != carried:
        raise ValueError(f"`n` = {n} contradicts the prompt, which was built with `Z.n_context` = {carried}")
    return Prompt(Z, carried if n is None else n)


# %%
show_doc(Prompt)

# %% [markdown]
# The constructors and the figure's function, in short (their checks follow):

# %%
api_table(Prompt.build, as_prompt, plot_prompt)

# %%
#| hide
show_doc(Prompt.build); show_doc(as_prompt); show_doc(plot_prompt)

# %% [markdown]
# A prompt built by `Prompt.build` keeps its $n$ through a move to float32, a copy, and stacking;
# a model reads $n$ from it, so the call needs no `n`:

# %%
P1 = Prompt.build(phi, R, torch.tensor([[3., 3.], [0., -1.]], dtype=torch.float64))
test_eq((P1.n, P1.q, P1.shape), (3, 2, (4, 6)))
test_eq(P1.Z, Z)
batch = torch.stack([P1.float(), P1.clone().float()])
test_eq((batch.n, batch.shape, batch.dtype), (3, (2, 4, 6), torch.float32))
test_eq((batch[1].n, batch.double().dtype, batch.to("cpu").n), (3, torch.float64, 3))
test_eq(Prompt.cat([batch, batch]).shape, (4, 4, 6))
test_fail(lambda: Prompt.stack([P1, Prompt(Z, 2)]), contains="`prompts` must share one n")
test_fail(lambda: Prompt(Z, 6), contains="`n` must be an integer in 1..5")
test_fail(lambda: batch[..., 0], contains="batch axes only")
test_eq(as_prompt(Z).n, 3)
test_fail(lambda: as_prompt(Z.clone()), contains="`n` must be given")
test_fail(lambda: as_prompt(P1, n=2), contains="contradicts the prompt")
test_eq(build_prompt(phi, R, device="cpu", dtype=torch.float32).dtype, torch.float32)
print(P1)

# %% [markdown]
# A single query may be given as a vector, no query at all as `None`, and numpy input becomes a
# float64 tensor while float32 stays float32:

# %%
test_eq(build_prompt(phi, R, torch.tensor([3., 3.], dtype=torch.float64)), Z[:, :5])
test_eq(build_prompt(phi, R), Z[:, :4])
test_eq(build_prompt(phi.numpy(), R.numpy(), [3., 3.]).dtype, torch.float64)
test_eq(build_prompt(phi.float(), R.float(), torch.ones(2)).dtype, torch.float32)

# %% [markdown]
# Batches: leading dimensions broadcast, so a batch of contexts can share one set of queries, and
# each prompt of a batch is the prompt of its own context.

# %%
trajs = [sample_trajectory(mrp, n=n, seed=k) for k in range(5)]
phis = torch.stack([mrp.phi[st] for st, _ in trajs]).reshape(5, 1, n + 1, d).expand(5, 3, n + 1, d)
rews = torch.stack([r for _, r in trajs]).reshape(5, 1, n).expand(5, 3, n)
Zb = build_prompt(phis, rews, mrp.phi[:2])
test_eq((Zb.shape, Zb.n_context), ((5, 3, d + 2, n + 3), n))
for k, (st, r) in enumerate(trajs): test_eq(Zb[k, 2], build_prompt(mrp.phi[st], r, mrp.phi[:2]))
one_each = build_prompt(phis[:, 0], rews[:, 0], mrp.phi[:5])   # (5, d): query k for context k
test_eq(one_each.shape, (5, d + 2, n + 2))
for k in range(5): test_eq(one_each[k, :d, -1], mrp.phi[k])

# %% [markdown]
# Malformed input fails with the argument's name and what was expected:

# %%
bad = {"`phi_states` must have shape (..., n + 1, d)": (phi[:1], R[:0], None),
       "`rewards` must have shape (..., n) with n = 3": (phi, R[:2], None),
       "`phi_queries` must have last dimension d = 2": (phi, R, torch.ones(3, dtype=torch.float64)),
       "`rewards` contains NaN or inf": (phi, torch.tensor([0., float("nan"), 1.]), None),
       "do not broadcast": (phi.expand(2, 4, 2), R.expand(3, 3), None),
       "`phi_states` must be numeric": ("abc", R, None)}
for msg, args in bad.items(): test_fail(lambda: build_prompt(*args), contains=msg)

# %% [markdown]
# `plot_prompt` draws one prompt, not a batch, with a number of context transitions it can hold:

# %%
test_fail(lambda: plot_prompt(Zb, n=n), contains="`Z` must be one prompt")
for bad_n in (0, Zb.shape[-1], 2.5, "3", None):
    test_fail(lambda: plot_prompt(Zb[0, 0], n=bad_n), contains="`n` must be an integer in 1..")

# %%
#| export
from ictd.boyan import check_arguments
check_arguments(globals())   # every public function refuses, naming it, an argument its annotation rules out (chapter 0)

# %%
#| hide
import nbdev; nbdev.nbdev_export()
