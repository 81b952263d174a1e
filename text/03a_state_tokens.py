# %%
#| default_exp state_tokens

# %%
#| export
from __future__ import annotations
from dataclasses import dataclass
import numpy as np
import torch
from torch.autograd.function import once_differentiable
from ictd.core import TaskBatch, check_int, check_type
from ictd.prompt import build_prompt
from ictd.tasks import task_features
from ictd.model import SoftmaxICTD

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *

# %%
#| hide
from IPython.display import Markdown
from ictd.core import record_claim
from ictd.tasks import random_tasks, sample_trajectories, stationary_examples
import inspect, re
from IPython.display import Markdown

# %%
#| hide
from ictd.core import api_table, short_doc   # the helper tables of appendix A


# %%
#| hide
def matrix_table(M, rows, cols, digits:int=2)->Markdown:
    "A small matrix as a Markdown table with labelled rows and columns."
    head = "| | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols) + "\n"
    return Markdown(head + "\n".join(f"| {r} | " + " | ".join(f"{v:.{digits}f}" for v in M[i].tolist()) + " |"
                                      for i, r in enumerate(rows)))


# %% [markdown]
# # The forward pass over every state and seed at once
# > State tokens: the dual-head softmax Transformer's forward pass on one key column per state instead of one per visit, for many seeds' parameters stacked on a leading axis; exact at every context length, and its limit at an infinitely long stationary context.

# %% [markdown]
# ::: {.callout-note}
# **What this chapter shows.** On a tabular task a context column's token depends only on its state, so the $n$ keys of
# chapter 3's prompt collapse to one **state token** per state, with a log-count bias and mean successors: the forward
# pass is exact and its cost no longer grows with $n$. Many seeds' models run in one batched pass, and the limit
# $n \to \infty$ is the same pass with $d_\pi$ and $P$ in place of the counts [ours].
# :::

# %% [markdown]
# [Chapter 3](dual_head.html) built the dual-head layer on a prompt of $n + 1 + q$ columns: $n$ keys
# (one per transition of the context), the last state $S_n$ and $q$ queries. Pretraining
# ([chapter 6](pretrain.html)) runs that forward pass millions of times, for many seeds at once, on
# contexts of tabular tasks, and the theory of chapter 6 needs it at an *infinitely* long context.
# This chapter gives the one forward pass that serves all three [ours]: on a tabular task a context
# column's token depends only on its state, so the $n$ keys collapse to $s$ **state tokens**, one per
# state, whatever $n$ is; and the parameters of $S$ independent models (one per seed) are stacked on
# a leading axis, so that every seed's prompts go through one batched product.
#
# The idea comes first, then a worked example on one four-state chain for two seeds at once, then the limit
# $n \to \infty$. The helpers and the exhaustive check against chapter 3's model are in
# [Implementation and tests](#implementation-and-tests).

# %% [markdown]
# ## The idea: one column per state, one leading axis per seed
#
# A context column's token is a function of its state. At layer 0 the column of a visit of state $y$
# is $(\phi(y), r(y), 0)$. A layer updates each column from its own token and from quantities shared
# by all columns (the keys and their values), so by induction it stays a function of the state: every
# visit of $y$ carries the same token at every layer, whatever the parameters. Two consequences:
#
# - a softmax over the $n$ keys is a softmax over the $s$ states with the logit bias $\log N(y)$,
#   where $N(y)$ is the number of visits of $y$ among the keys (a state never visited gets
#   $\log 0 = -\infty$, weight zero);
# - the successor shift $Z\Pi$, which gives each key the token of the column after it, becomes for
#   state $y$ the *mean* token of the columns that follow visits of $y$: a state token, or the last
#   column $S_n$ (not a key: its reward slot is empty).
#
# The last column and the queries are the columns that are not keys. So a prompt of $n + 1 + q$
# columns becomes one of $s + 1 + q$ columns, of which the first $s$ are keys. `StateTokens` holds such
# a prompt: the tokens, the log weight of each key, and each key's mean successor as weights over the
# columns.

# %%
#| export
@dataclass(eq=False)
class StateTokens:
    "A prompt reduced to one token per state: exact for dual-head softmax layers, whose context columns depend on their state only."
    Z:torch.Tensor       # (..., D, s + m) the s state tokens (the keys), then m columns that are not keys
    log_w:torch.Tensor   # (..., s) log weight of each state among the keys (log count, or log d_pi; -inf where absent)
    succ:torch.Tensor    # (..., s, s + m) row y: the mean successor of state y's keys, as weights over the s + m columns
    q:int                # the last q columns are the queries

    def __post_init__(self):
        "Refuse fields that are not floating tensors of matching shapes, or a `q` out of range, naming the field."
        for name in ("Z", "log_w", "succ"):
            x = check_type(getattr(self, name), torch.Tensor, name)
            if not x.is_floating_point(): raise TypeError(f"`{name}` must be a real floating tensor, got dtype {x.dtype}")
        if self.Z.ndim < 2 or self.log_w.ndim < 1 or self.succ.shape[-2:] != (self.log_w.shape[-1], self.Z.shape[-1]):
            raise ValueError(f"`succ` must have shape (..., s, s + m) = (..., {self.log_w.shape[-1] if self.log_w.ndim else '?'}, "
                             f"{self.Z.shape[-1] if self.Z.ndim else '?'}) to match `log_w` and `Z`, got {tuple(self.succ.shape)}")
        self.q = check_int(self.q, "q", 0, high=self.Z.shape[-1] - self.log_w.shape[-1])


# %% [markdown]
# `state_tokens` builds them from contexts given as state indices, the form in which chapter 6 draws
# its examples (a task index, the context's states, the query states). Its inputs carry a leading
# seed axis, since each seed trains on a pool of tasks of its own. The counts $N(y)$ and the successor
# weights are two `scatter_add`s over the context, so the cost of building the tokens is linear in $n$,
# and everything after it is independent of $n$.

# %%
#| export
def state_tokens(tasks:TaskBatch,      # tasks with a leading seed axis: P (S, T, s, s), r (S, T, s), phi (S, T, s, d)
                 task:torch.Tensor,    # (S, B) index of each prompt's task
                 states:torch.Tensor,  # (S, B, n + 1) the contexts' states S_0..S_n
                 queries:torch.Tensor, # (S, B, q) query states
                )->StateTokens:        # columns: the s state tokens, the last state S_n, the q queries
    "The prompts of contexts `states` with `queries`, as state tokens with the counts and successors of the contexts."
    s, n, q = tasks.P.shape[-1], states.shape[-1] - 1, queries.shape[-1]
    every = torch.arange(s, device=states.device).expand(*task.shape, s)
    phi, r = task_features(tasks, task, torch.cat([every, states[..., -1:], queries], -1))
    Z = torch.cat([phi.mT, r[..., None, :], torch.zeros_like(r)[..., None, :]], -2)
    Z[..., -2, s:] = 0                                                       # no reward slot outside the context
    keys, ones = states[..., :n], torch.ones_like(states[..., :n], dtype=torch.float64)
    counts = torch.zeros(*task.shape, s, dtype=torch.float64, device=states.device).scatter_add_(-1, keys, ones)
    after = torch.cat([states[..., 1:n], torch.full_like(states[..., :1], s)], -1)   # the column after each key: a state, or S_n (column s)
    succ = torch.zeros(*task.shape, s * (s + 1 + q), dtype=torch.float64, device=states.device).scatter_add_(-1, keys * (s + 1 + q) + after, ones)
    return StateTokens(Z, counts.log(), succ.reshape(*task.shape, s, s + 1 + q) / counts.clamp(min=1)[..., None], q)


# %%
show_doc(state_tokens)

# %% [markdown]
# A context small enough to count by hand: three states, the context $S_0..S_4 = 0, 1, 0, 2, 0$ and one
# query, state 1. State 0 is a key twice (at steps 0 and 2), followed once by state 1 and once by
# state 2; state 1 once, followed by 0; state 2 once, followed by the last state $S_4$, which is
# column $s = 3$. The query is column 4.

# %%
three = random_tasks(1, seed=0, n_states=3, d=2)
hand = state_tokens(
    TaskBatch.stack([three]),
    torch.zeros(1, 1, dtype=torch.long),
    torch.tensor([[[0, 1, 0, 2, 0]]]),
    torch.tensor([[[1]]]),
)
test_eq(hand.log_w.exp()[0, 0], torch.tensor([2., 1., 1.], dtype=torch.float64))
test_eq(
    hand.succ[0, 0],
    torch.tensor([[0, 0.5, 0.5, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 1, 0]], dtype=torch.float64),
)
test_eq(
    hand.Z[0, 0, :2], torch.cat([three.phi[0].mT, three.phi[0, [0, 1]].mT], -1)
)  # features: the three states, S_4 = 0, the query 1
test_eq(
    hand.Z[0, 0, 2], torch.cat([three.r[0], torch.zeros(2, dtype=torch.float64)])
)  # rewards on the keys only
matrix_table(hand.succ[0, 0], [f"key: state {y}" for y in range(3)],
             ["state 0", "state 1", "state 2", "$S_4$ (last)", "query"])


# %% [markdown]
# **Seeds on a leading axis.** Parameters come as a dictionary of stacked tensors `A`, `V_cur`, `V_tgt`
# of shape (S, L or 1, D, D): one slice per independent model (one per seed), and a layer axis of
# length 1 when the model shares one layer across depth. Every seed has many prompts, and each prompt
# needs the seed's matrix applied to each of its columns. Done prompt by prompt that is $S \times B$
# small products; `seed_map` folds a seed's prompts into the columns of one wide matrix and does $S$
# products instead, which is what makes many seeds cost little more than one.

# %%
#| export
def seed_map(W:torch.Tensor,  # (S, D, E) one matrix per seed
             Y:torch.Tensor,  # (S, ..., E, K) columns of every prompt of each seed
            )->torch.Tensor:  # (S, ..., D, K): W[i] @ Y[i, ...]
    "Apply each seed's matrix to every column of its prompts, as one matrix product per seed (not one per prompt)."
    S, E, K = Y.shape[0], Y.shape[-2], Y.shape[-1]
    out = W @ Y.movedim(-2, 1).reshape(S, E, -1)
    return out.reshape(S, W.shape[-2], *Y.shape[1:-2], K).movedim(1, -2)


# %%
g = torch.Generator().manual_seed(0)
W_s, Y_s = torch.randn(3, 4, 5, generator=g, dtype=torch.float64), torch.randn(
    3, 2, 6, 5, 7, generator=g, dtype=torch.float64
)
test_close(
    seed_map(W_s, Y_s), W_s[:, None, None] @ Y_s, eps=1e-12
)  # the same as broadcasting, prompt by prompt
test_eq(seed_map(W_s, Y_s).shape, (3, 2, 6, 4, 7))


# %% [markdown]
# One dual-head layer on state tokens is chapter 3's layer with the two substitutions above: the
# attention of every updated column over the $s$ keys carries the bias $\log w$, and the values are
# $V^{\mathrm{cur}} Z_{\text{keys}} + V^{\mathrm{tgt}} Z\,\mathrm{succ}^\top$, the target head reading each
# key's mean successor. `columns` lets the last layer update only the query columns, the only ones
# whose value is read.

# %%
#| export
def token_layer(Z, A, V_cur, V_tgt,       # (S, ..., D, s + m) tokens and one layer's parameters (S, D, D)
                x:StateTokens,            # the weights and successors of the state tokens
                columns=slice(None),      # the columns to update (default all)
               )->tuple:                  # the updated `columns` and their attention over the s state keys
    "One dual-head layer on state tokens: attention over the s states with bias log w, values $V^{cur} Z + V^{tgt}$ (mean successor)."
    s = x.log_w.shape[-1]
    keys, out = Z[..., :s], Z[..., columns]
    X = seed_map(torch.cat([V_cur, V_tgt], -1), torch.cat([keys, Z @ x.succ.mT], -2))
    att = torch.softmax(seed_map(A.mT, keys).mT @ out + x.log_w[..., None], dim=-2)
    return out + X @ att, att


# %%
show_doc(token_layer)

# %% [markdown]
# Each column's attention is a distribution over the $s$ keys, and a state absent from the context
# ($\log w = -\infty$) gets none of it. On the hand-counted context with random parameters:

# %%
D3 = 2 + 2   # d + 2 token rows for d = 2
A3, Vc3, Vt3 = torch.randn(
    3, 1, D3, D3, generator=torch.Generator().manual_seed(1), dtype=torch.float64
)
_, att3 = token_layer(hand.Z, A3, Vc3, Vt3, hand)
test_close(att3.sum(-2), torch.ones(1, 1, 5, dtype=torch.float64), eps=1e-12)
absent = state_tokens(
    TaskBatch.stack([three]),
    torch.zeros(1, 1, dtype=torch.long),
    torch.tensor([[[0, 1, 0, 1, 0]]]),
    torch.tensor([[[2]]]),
)
test_eq(
    token_layer(absent.Z, A3, Vc3, Vt3, absent)[1][..., 2, :],
    torch.zeros(1, 1, 5, dtype=torch.float64),
)  # state 2 is no key


# %% [markdown]
# A stack of layers: layer $l$ uses slice $l$ of the parameters, or slice 0 at every depth when the
# model shares its layer (<code>_layer_params</code>). `token_layers` keeps every layer's tokens and attention,
# which the mechanism chapters read; inputs are cast to the parameters' dtype once (<code>_cast</code>).

# %%
#| export
def _layer_params(params:dict, l:int)->tuple:
    "Layer `l`'s (A, V_cur, V_tgt), each (S, D, D)."
    Lp = params["A"].shape[1]
    return tuple(params[k][:, l % Lp] for k in ("A", "V_cur", "V_tgt"))

def _cast(x:StateTokens, dtype)->StateTokens:
    return x if x.Z.dtype == dtype else StateTokens(x.Z.to(dtype), x.log_w.to(dtype), x.succ.to(dtype), x.q)

def token_layers(params:dict, n_layers:int, x:StateTokens)->tuple:
    "Z_0..Z_L of stacked parameters (S, L or 1, D, D) on state tokens (S, ...), and each layer's attention (S, ..., s, s + m)."
    x = _cast(x, params["A"].dtype)
    Zs, atts = [x.Z], []
    for l in range(n_layers):
        Z, att = token_layer(Zs[-1], *_layer_params(params, l), x)
        Zs.append(Z); atts.append(att)
    return Zs, atts


# %% [markdown]
# Training needs only the values at the queries. `token_predict` runs the same layers and lets the
# last one update the $q$ query columns alone; it agrees with the last layer of `token_layers`:

# %%
#| export
def token_predict(params:dict, n_layers:int, x:StateTokens)->torch.Tensor:
    "(S, ..., q) values at the queries of state tokens (S, ...); the last layer updates the query columns only."
    x = _cast(x, params["A"].dtype)
    Z = x.Z
    for l in range(n_layers - 1): Z = token_layer(Z, *_layer_params(params, l), x)[0]
    return token_layer(Z, *_layer_params(params, n_layers - 1), x, slice(-x.q, None))[0][..., -1, :]


# %%
params3 = {
    "A": A3[:, None],
    "V_cur": Vc3[:, None],
    "V_tgt": Vt3[:, None],
}  # one seed, one shared layer
Zs3, atts3 = token_layers(params3, 4, hand)
test_eq((len(Zs3), len(atts3)), (5, 4))
test_close(token_predict(params3, 4, hand), Zs3[-1][..., -1, -1:], eps=1e-12)


# %% [markdown]
# A `SoftmaxICTD` of chapter 3 enters this form through `model_params`, which stacks its layers and
# adds a seed axis of one. Its uses follow in the worked example.

# %%
#| export
def model_params(model:SoftmaxICTD)->dict:
    "A model's parameters stacked as the engine holds them, with a seed axis of one: (1, L or 1, D, D) each."
    return {k: torch.stack([getattr(lay, k) for lay in model.layers])[None] for k in ("A", "V_cur", "V_tgt")}


# %% [markdown]
# ## A worked example
#
# One random four-state Boyan chain with $d = 2$ features, a stationary context of $n = 10$
# transitions, and every state as a query ($q = 4$). Chapter 3's prompt has $n + 1 + q$ columns; the
# state tokens have $s + 1 + q$:

# %%
chain = random_tasks(1, seed=0, n_states=4, d=2)
walk = sample_trajectories(chain.P, chain.d_pi, n=10, seed=0)  # (1, n + 1): S_0..S_10
every_state = torch.arange(4)[None, None]  # (S = 1, B = 1, q = 4)
x_ex = state_tokens(
    TaskBatch.stack([chain]), torch.zeros(1, 1, dtype=torch.long), walk[None], every_state
)
Z_ex = build_prompt(chain.phi[0, walk[0]], chain.r[0, walk[0, :-1]], chain.phi[0])
Markdown(
    f"Context $S_0..S_{{10}}$ = {walk[0].tolist()}; visits per state $N(y)$ ="
    f" {x_ex.log_w.exp()[0, 0].int().tolist()}; columns: {Z_ex.shape[-1]} in the prompt,"
    f" {x_ex.Z.shape[-1]} as state tokens."
)

# %% [markdown]
# Row $y$ of the successor weights is the empirical distribution of what followed the visits of $y$
# (the fifth column is the last state $S_{10}$, not a key):

# %%
matrix_table(x_ex.succ[0, 0, :, :5], [f"key: state {y}" for y in range(4)],
             [f"state {y}" for y in range(4)] + ["$S_{10}$ (last)"])

# %% [markdown]
# Two seeds' models, one with its own three layers and one with a shared layer, go through the state
# tokens together: their parameters are stacked on the seed axis and the tokens repeated along it.
# Each seed's prediction at the four queries equals chapter 3's forward pass on the full prompt, to
# rounding error:

# %%
seed_models = [SoftmaxICTD(2, n_layers=3, init_gain=1., seed=0),
               SoftmaxICTD(2, n_layers=3, init_gain=1., seed=1)]
stacked = {k: torch.cat([model_params(m)[k] for m in seed_models]) for k in ("A", "V_cur", "V_tgt")}
both_seeds = StateTokens(
    *(t.expand(2, *t.shape[1:]) for t in (x_ex.Z, x_ex.log_w, x_ex.succ)), x_ex.q
)
with torch.no_grad():
    together = token_predict(stacked, 3, both_seeds)[:, 0]
    alone = torch.stack([m.predict(Z_ex) for m in seed_models])
test_close(together, alone, eps=1e-12)
gap_ex = (together - alone).abs().max().item()
assert gap_ex < 1e-13, gap_ex
Markdown(
    "Largest difference over both seeds and four queries: below $10^{-13}$ (asserted); the"
    f" predictions of seed 0 are {', '.join(f'{v:.4f}' for v in together[0].tolist())}."
)


# %% [markdown]
# The equality is exact in arithmetic, not an approximation: only the order of the sums differs. The
# check over random tasks, models with separate and shared layers, every layer's tokens and float64
# is in [Implementation and tests](#implementation-and-tests).
#
# Chapter 3's model also runs on contexts of *continuous* states ([chapter 8](continuous.html)),
# where no two visits share a token. There every context column is its own key with log weight 0 and
# its successor is the next column: `trajectory_tokens` writes chapter 3's prompt in this form, so one
# forward pass and one training engine serve both.

# %%
#| export
def trajectory_tokens(phi_states,    # (..., n + 1, d) features of S_0..S_n
                      rewards,       # (..., n) rewards, rewards[..., k-1] = R_k
                      phi_queries,   # (..., q, d) query features
                     )->StateTokens: # the prompt of `build_prompt` with the n context states as keys
    "A prompt of continuous states as state tokens: every context state its own key (log weight 0), its successor the next column."
    Z = build_prompt(phi_states, rewards, phi_queries)
    n = Z.shape[-1] - 1 - phi_queries.shape[-2]
    succ = torch.eye(n, Z.shape[-1], dtype=Z.dtype, device=Z.device).roll(1, -1)
    return StateTokens(Z, Z.new_zeros(n), succ, phi_queries.shape[-2])


# %%
traj = trajectory_tokens(chain.phi[0, walk[0]], chain.r[0, walk[0, :-1]], chain.phi[0])
test_eq(traj.Z, Z_ex)
with torch.no_grad():
    test_close(
        token_predict(
            model_params(seed_models[0]),
            3,
            StateTokens(traj.Z[None], traj.log_w[None], traj.succ[None], 4),
        )[0],
        seed_models[0].predict(Z_ex),
        eps=1e-12,
    )


# %% [markdown]
# ## The limit of an infinitely long context
#
# As $n \to \infty$ in a stationary context, the fraction of keys that are visits of $y$ tends to
# $d_\pi(y)$ and the fraction of those followed by $y'$ tends to $P(y, y')$. The forward pass therefore
# tends to the same computation with the weights $\log d_\pi$ and the successors $P$ (and no last
# column, which is one of infinitely many). `population_tokens` builds these tokens with every state as
# a query; `population_predict` runs a model on them. [Chapter 6](pretrain.html) uses them to compute
# its objective exactly at $n = \infty$.

# %%
#| export
def population_tokens(tasks:TaskBatch)->StateTokens:
    "The limit n -> infinity of stationary contexts as state tokens: weights d_pi, successors P, every state a query."
    phi = tasks.phi.to(torch.float64)
    s = phi.shape[-2]
    zero = phi.new_zeros(*phi.shape[:-2], 1, s)
    Z = torch.cat([torch.cat([phi.mT, tasks.r[..., None, :], zero], -2), torch.cat([phi.mT, zero, zero], -2)], -1)
    return StateTokens(Z, tasks.d_pi.log(), torch.cat([tasks.P, torch.zeros_like(tasks.P)], -1), s)


# %%
pop = population_tokens(chain)
test_eq((pop.Z.shape, pop.q), ((1, 4, 8), 4))               # s keys and s queries, no last column
test_close(pop.log_w.exp().sum(-1), torch.ones(1, dtype=torch.float64), eps=1e-12)
test_eq(pop.succ[..., :4], chain.P)


# %%
#| export
def population_predict(model:SoftmaxICTD,  # any parameters
                       tasks:TaskBatch,    # tasks (B of them)
                      )->torch.Tensor:     # (B, s) prediction at every query state for an infinitely long stationary context
    "The model's forward pass in the limit $n \\to \\infty$ of a stationary context: attention over state tokens weighted by $d_\\pi$."
    d = tasks.phi.shape[-1]
    if d != model.d: raise ValueError(f"`tasks` have d = {d} features but the model expects d = {model.d}")
    one = tasks.map(lambda x: x[None])
    return token_predict(model_params(model), model.n_layers, population_tokens(one))[0]


# %% [markdown]
# The limit, measured: a random model (three layers, $d = 4$) on two random chains, its prediction on
# stationary contexts of growing length against `population_predict`, the largest gap over the
# queries averaged over 8 contexts. The finite contexts go through state tokens too, exact by the
# worked example above, so that, once its visits are counted, a context of $n = 30000$ costs no more than one of $n = 300$. The context's visit frequencies and successor frequencies deviate
# from $d_\pi$ and $P$ by $O(n^{-1/2})$, so the gap should fall at about that rate; a wrong limit (say,
# uniform weights in place of $d_\pi$) would leave a gap that does not fall.

# %%
#| code-fold: true
#| code-summary: "Code of the check"
rand_model, two_tasks = SoftmaxICTD(4, n_layers=3, init_gain=1., seed=3), random_tasks(2, seed=5)
pool2, which, every10 = (
    TaskBatch.stack([two_tasks]),
    torch.arange(2)[None],
    torch.arange(10).expand(1, 2, 10),
)
def finite_gap(n:int, seed:int)->float:
    """Largest |prediction at n - prediction at n = infinity| over both tasks and every query,
    for one context per task."""
    S = sample_trajectories(two_tasks.P, two_tasks.d_pi, n=n, seed=seed)
    with torch.no_grad():
        finite = token_predict(
            model_params(rand_model), 3, state_tokens(pool2, which, S[None], every10)
        )[0]
        return (finite - population_predict(rand_model, two_tasks)).abs().max().item()
lengths = (300, 3000, 30000)
mean_gaps = torch.tensor(
    [[finite_gap(n, k) for k in range(8)] for n in lengths], dtype=torch.float64
).mean(-1)
slope = (
    torch.linalg.lstsq(
        torch.stack(
            [torch.ones(3, dtype=torch.float64), torch.tensor(lengths, dtype=torch.float64).log()],
            -1,
        ),
        mean_gaps.log()[:, None],
    )
    .solution[1]
    .item()
)
assert mean_gaps[-1] < mean_gaps[0] / 5 and -0.8 < slope < -0.3, (mean_gaps, slope)
print("n       mean largest gap (8 contexts)")
for n, gap in zip(lengths, mean_gaps.tolist()): print(f"{n:<7} {gap:.3f}")
print(f"slope of log gap against log n: {slope:.2f}")


# %% [markdown]
# The last of the three: NEU, the objective of chapter 6 (the squared norm of the expected
# semi-gradient TD update), in the same limit. There the expectation over queries and successors is
# a sum weighted by $d_\pi$ and $P$, so it is exact given the tasks; its definition, its finite-$n$
# estimator and the check that the two agree are in [chapter 6](pretrain.html#the-norm-of-the-expected-update).

# %%
#| export
def population_neu(model:SoftmaxICTD,  # any parameters
                   tasks:TaskBatch,    # tasks to average over
                  )->float:            # NEU(theta) at n = infinity, exact given the tasks
    "NEU in the limit of infinitely long contexts: exact over queries and successors, averaged over `tasks`."
    v = population_predict(model, tasks)
    with torch.no_grad(): delta = tasks.r + tasks.gamma * (tasks.P @ v.unsqueeze(-1)).squeeze(-1) - v
    grads = torch.autograd.grad((tasks.d_pi * delta * v).sum(-1).mean(), list(model.parameters()), allow_unused=True)
    return sum(g.square().sum() for g in grads if g is not None).item()


# %% [markdown]
# A check by hand. With both value heads zero the prediction is 0 whatever $A$ is, so the TD error is
# the reward, $\delta(x) = r(x)$, and the gradient reaches only the value row of each head: the row of
# $V^{\mathrm{cur}}$ receives $\sum_x d_\pi(x) r(x)$ times the attention-weighted key tokens at query
# $x$, and the row of $V^{\mathrm{tgt}}$ the same with each key's mean successor $Z_{\text{keys}} P^\top$.

# %%
zero_values = SoftmaxICTD(4, n_layers=1, init_gain=1., seed=0)
with torch.no_grad(): zero_values.layers[0].V_cur.zero_(); zero_values.layers[0].V_tgt.zero_()
Zp = population_tokens(two_tasks).Z  # (B, D, 2s): the s keys, then the s queries
keys, queries = Zp[..., :10], Zp[..., 10:]
att = torch.softmax(
    (zero_values.layers[0].A.detach().mT @ keys).mT @ queries + two_tasks.d_pi.log()[..., None],
    dim=-2,
)
w = (two_tasks.d_pi * two_tasks.r)[..., None]                     # d_pi(x) delta(x), with delta = r
row_cur, row_tgt = (keys @ att @ w).mean(0), (keys @ two_tasks.P.mT @ att @ w).mean(0)
test_close(
    population_neu(zero_values, two_tasks),
    (row_cur.square().sum() + row_tgt.square().sum()).item(),
    eps=1e-12,
)

# %% [markdown]
# ## Implementation and tests
#
# The exhaustive check: random parameters (separate layers or one shared layer,
# three layers), prompts with two queries from stationary contexts of 8 random chains, and the
# state-token forward against chapter 3's forward on the full prompt, in float64, for the values at the
# queries and for every layer's last columns.

# %%
#| code-fold: true
#| code-summary: "Tests"
pool = TaskBatch.stack([random_tasks(8, seed=1)])
ex = stationary_examples(
    pool, torch.rand(1, 32, 34, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
)
pairs = torch.stack([ex.query, ex.successor], -1)
(phi_s, r_s), phi_q = (
    task_features(pool, ex.task, ex.states),
    task_features(pool, ex.task, pairs)[0],
)
Z_full = build_prompt(phi_s[0], r_s[0, :, :-1], phi_q[0])
for shared in (False, True):
    model = SoftmaxICTD(4, n_layers=3, shared=shared, init_gain=1., seed=4)
    with torch.no_grad():
        test_close(
            token_predict(model_params(model), 3, state_tokens(pool, ex.task, ex.states, pairs))[0],
            model.predict(Z_full, n=30),
            eps=1e-12,
        )
        test_close(
            token_layers(model_params(model), 3, state_tokens(pool, ex.task, ex.states, pairs))[0][
                -1
            ][0, :, :, -2:],
            model(Z_full, n=30)[..., -2:],
            eps=1e-12,
        )
record_claim("state-tokens-exact",
             "On tabular contexts the forward pass on state tokens (one key per state, "
             "log-count bias, mean successors) equals the dual-head Transformer's forward pass "
             "on the full prompt, for every seed of a stacked batch.",
             "proved", "state_tokens", "#a-worked-example");

# %% [markdown]
# ### The fused pass for training
#
# The engine's softmax family trains through `fused_token_predict`: `token_predict` computed by hand in
# one autograd node, the same arithmetic laid out for speed. At the training shapes every prompt's
# products are tiny matrices (a few rows by $D$ or $s + m$ columns), thousands of them per step. The fused pass
# holds each layer's tokens as rows and applies each seed's three matrices to the rows of all its prompts in one
# product, $P = T\,[V^{cur\top}, A, V^{tgt\top}]$: its first block gives the keys' current values, its middle block the
# A-scaled keys, and its last block, times the successor weights, the values of the keys' mean successors. The
# scores are laid out key-major, where the softmax over the keys runs fastest. The last layer computes what is
# read, the last entry of the query rows: of the value blocks it keeps the last column, so its products with the
# values are matrix-vector products. The backward pass is written out and skips the gradient of the prompt, and
# on the CPU the stacks of tiny products go through numpy's `matmul`, whose loop over them costs about half of
# torch's (elsewhere, torch's). Where the inputs lack the state tokens' batched layout (continuous prompts), it
# is `token_predict` itself.

# %%
#| export
_NUMPY_ON_CPU = True   # the fused pass's stacks of tiny products through numpy on the CPU (False: torch's, as elsewhere)

def _mm(a, b, out=None):
    "The batched product a @ b (written into `out` when given); on the CPU through numpy's matmul."
    if a.device.type == "cpu" and _NUMPY_ON_CPU and a.dtype in (torch.float32, torch.float64):
        # numpy's loop over stacks of tiny matrices costs about half of torch's
        r = np.matmul(a.numpy(), b.numpy(), out=None if out is None else out.numpy())
        return torch.from_numpy(r) if out is None else out
    return torch.matmul(a, b) if out is None else out.copy_(torch.matmul(a, b))

class _FusedTokens(torch.autograd.Function):
    """`token_predict` as one autograd node: A, V_cur, V_tgt (S, L or 1, D, D); T (S, B, C, D) the tokens as rows,
    log_w (S, B, s), succ (S, B, s, C). Per layer one product per seed, P = T [V_cur^T, A, V_tgt^T], gives every
    row's value, A-scaled key and successor value; the keys' values are P's first block plus `succ` times its last.
    The last layer computes the queries' values alone: the value blocks shrink to their last column."""
    @staticmethod
    def _layer(W, l, n_layers):
        "Layer l's columns of W (S, D, 2w + D), their indices among its 3D (None: all), and w: the value entries computed."
        D, W = W.shape[-2], W[:, l % W.shape[1]]
        if l < n_layers - 1: return W, None, D
        idx = torch.tensor([D - 1, *range(D, 2 * D), 3 * D - 1], device=W.device)   # the last layer: values' last entry
        return W.index_select(-1, idx), idx, 1

    @staticmethod
    def forward(ctx, A, V_cur, V_tgt, T, log_w, succ, n_layers, q):
        S, B, C, D = T.shape
        s, N, saved = log_w.shape[-1], S * B, []
        K = s + 1 if not succ[..., s + 1:].any() else C       # the columns a key's successor can be
        succ = succ.detach().reshape(N, s, C)[..., :K]
        W = torch.cat([V_cur.mT, A, V_tgt.mT], -1).detach()   # (S, Lp, D, 3D)
        bias, T = log_w.detach().reshape(N, s).T.reshape(s, N, 1), T.detach().reshape(N, C, D)
        for l in range(n_layers):
            Wl, _, w = _FusedTokens._layer(W, l, n_layers)
            c = q if l == n_layers - 1 else C                  # rows updated: the last layer's queries
            P = _mm(T.view(S, B * C, D), Wl).view(N, C, 2 * w + D)
            X = _mm(succ, P[:, :K, w + D:]).add_(P[:, :s, :w])  # (N, s, w) row k: the value of key k
            Tc, E = T[:, C - c:], T.new_empty(s, N, c)          # scores laid out key-major: a faster softmax
            _mm(P[:, :s, w:w + D], Tc.mT, out=E.permute(1, 0, 2))
            att = torch.softmax(E.add_(bias), dim=0).permute(1, 0, 2)   # (N, s, c)
            saved += [T, P, X, att]
            T = _mm(att.mT, X).add_(Tc[..., D - w:])
        ctx.n_layers, ctx.q, ctx.shape = n_layers, q, (S, B, C, D, s, K)
        ctx.save_for_backward(W, succ, *saved)
        return T.reshape(S, B, q)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        W, succ, *saved = ctx.saved_tensors
        L, q, (S, B, C, D, s, K) = ctx.n_layers, ctx.q, ctx.shape
        N, Lp, dW = S * B, W.shape[1], torch.zeros_like(W)
        g = grad.reshape(N, q, 1)                              # d value / d the last layer's outputs
        for l in reversed(range(L)):
            T, P, X, att = saved[4 * l: 4 * l + 4]
            (Wl, idx, w), c = _FusedTokens._layer(W, l, L), att.shape[-1]
            if l >= L - 2: dP = grad.new_zeros(N, C, 2 * w + D)   # zero where no product writes
            dX = _mm(att, g, out=dP[:, :s, :w])
            if l == L - 1: datt = X.permute(1, 0, 2) * g.reshape(N, c)   # (s, N, q): an outer product
            else: datt = att.new_empty(s, N, c); _mm(X, g.mT, out=datt.permute(1, 0, 2))
            dE = torch._softmax_backward_data(datt, att.permute(1, 0, 2), 0, att.dtype).permute(1, 0, 2)
            _mm(dE, T[:, C - c:], out=dP[:, :s, w:w + D])      # d the A-scaled keys
            _mm(succ.mT, dX, out=dP[:, :K, w + D:])            # d the successor values
            dWl = _mm(T.view(S, B * C, D).mT, dP.view(S, B * C, 2 * w + D))
            if idx is None: dW[:, l % Lp] += dWl
            else: dW[:, l % Lp].index_add_(-1, idx, dWl)
            if l == 0: break                                   # the prompt needs no gradient
            dT = _mm(dP.view(S, B * C, 2 * w + D), Wl.mT).view(N, C, D)
            dT[:, C - c:, D - w:] += g
            dT[:, C - c:] += _mm(dE.mT, P[:, :s, w:w + D])
            g = dT
        return dW[..., D:2 * D], dW[..., :D].mT, dW[..., 2 * D:].mT, None, None, None, None, None


# %%
#| export
def fused_token_predict(params:dict,    # A, V_cur, V_tgt: (S, L or 1, D, D) each
                        n_layers:int,   # depth L
                        x:StateTokens,  # state tokens with a leading seed axis
                       )->torch.Tensor: # (S, B..., q) values at the queries
    "`token_predict` in one fused autograd node (a hand-written backward pass), for state tokens of discrete tasks; `token_predict` itself otherwise."
    Z = x.Z
    batch = Z.shape[:-2]
    if Z.ndim < 3 or x.log_w.shape[:-1] != batch or x.succ.shape[:-2] != batch: return token_predict(params, n_layers, x)
    dt, S, (D, C) = params["A"].dtype, batch[0], Z.shape[-2:]
    flat = lambda t, *tail: t.to(dt).reshape(S, -1, *tail).contiguous()
    v = _FusedTokens.apply(params["A"], params["V_cur"], params["V_tgt"], flat(Z.mT, C, D), flat(x.log_w, x.log_w.shape[-1]),
                           flat(x.succ, *x.succ.shape[-2:]), n_layers, x.q)
    return v.reshape(*batch, x.q)


# %% [markdown]
# The fused pass against `token_predict`, in float64: values and the gradients of a TD-style loss agree to
# rounding, for separate and shared layers, for one, three and four layers, with the two training queries
# and with every state as a query, through numpy's products and through torch's (the route of other devices); float32 runs too, and continuous prompts take `token_predict`.

# %%
#| code-fold: true
#| code-summary: "Tests"
def _grads(predict, params, L, x):
    leaf = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    v = predict(leaf, L, x)
    (v[..., 0] - 0.9 * v[..., -1].detach()).square().sum().backward()
    return v.detach(), [leaf[k].grad for k in ("A", "V_cur", "V_tgt")]

pools2 = TaskBatch.stack([random_tasks(8, seed=s) for s in (1, 2)])
ex2 = stationary_examples(
    pools2, torch.rand(2, 16, 34, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
)
every = torch.arange(10).expand(2, 16, 10)
for L, shared in ((3, False), (4, True), (1, False)):
    models = [SoftmaxICTD(4, n_layers=L, shared=shared, init_gain=1., seed=s) for s in (5, 6)]
    theta = {
        k: torch.cat([model_params(m)[k] for m in models]).detach() for k in ("A", "V_cur", "V_tgt")
    }
    for queries in (torch.stack([ex2.query, ex2.successor], -1), every):
        x2 = state_tokens(pools2, ex2.task, ex2.states, queries)
        (v0, g0), (v1, g1) = _grads(token_predict, theta, L, x2), _grads(
            fused_token_predict, theta, L, x2
        )
        test_eq(v1.shape, v0.shape)
        test_close(v1, v0, eps=1e-12)
        for a, b in zip(g1, g0): test_close(a, b, eps=1e-12 * max(1., b.abs().max().item()))
        _NUMPY_ON_CPU = False   # the torch route of other devices, on the CPU: the same to rounding
        (v2, g2), _NUMPY_ON_CPU = _grads(fused_token_predict, theta, L, x2), True
        test_close(v2, v0, eps=1e-12)
        for a, b in zip(g2, g0): test_close(a, b, eps=1e-12 * max(1., b.abs().max().item()))
v32 = fused_token_predict({k: v.float() for k, v in theta.items()}, L, x2)
test_eq(v32.dtype, torch.float32); test_close(v32.double(), token_predict(theta, L, x2), eps=1e-4)
xc = trajectory_tokens(
    torch.randn(2, 3, 6, 4, dtype=torch.float64),
    torch.randn(2, 3, 5, dtype=torch.float64),
    torch.randn(2, 3, 2, 4, dtype=torch.float64),
)
test_eq(fused_token_predict(theta, L, xc), token_predict(theta, L, xc))

# %% [markdown]
# ### The library's functions in short

# %%
api_table(StateTokens, seed_map, token_layers, token_predict, model_params, trajectory_tokens,
          population_tokens, population_predict, population_neu, fused_token_predict)

# %%
#| hide
show_doc(StateTokens); show_doc(seed_map); show_doc(token_layers); show_doc(token_predict); show_doc(model_params); show_doc(trajectory_tokens); show_doc(population_tokens); show_doc(population_predict); show_doc(population_neu); show_doc(fused_token_predict)

# %% [markdown]
# Bad input: a model and tasks with different feature dimensions; state tokens whose fields are no
# floating tensors, do not match in shape, or count more queries than non-key columns.

# %%
test_fail(lambda: population_predict(SoftmaxICTD(3, n_layers=2, seed=0), two_tasks),
          contains="`tasks` have d = 4 features but the model expects d = 3")
test_fail(lambda: StateTokens("abc", hand.log_w, hand.succ, 1), contains="`Z` must be a Tensor")
test_fail(
    lambda: StateTokens(hand.Z, hand.log_w.long(), hand.succ, 1),
    contains="`log_w` must be a real floating",
)
test_fail(
    lambda: StateTokens(hand.Z, hand.log_w, hand.succ[..., :-1], 1),
    contains="`succ` must have shape",
)
test_fail(
    lambda: StateTokens(hand.Z, hand.log_w, hand.succ, 3), contains="`q` must be an integer in 0..2"
)
test_eq(StateTokens(hand.Z, hand.log_w, hand.succ, 1).q, 1)

# %%
#| export
from ictd.boyan import check_arguments
check_arguments(globals())   # every public function refuses, naming it, an argument its annotation rules out (chapter 0)

# %%
#| hide
import nbdev; nbdev.nbdev_export()
