# %%
#| default_exp sliding

# %%
#| export
from __future__ import annotations
import functools, math
import numpy as np
import torch
from ictd.core import check_type, run_stream, substream
from ictd.boyan import moved_to_keywords
from ictd.tasks import Contexts, TaskBatch, TDExamples, random_tasks, sample_trajectories, task_features, task_pool
from ictd.engine import EvalSet, PretrainConfig, Protocol, register_protocol, task_eval_set
from ictd.pretrain import stack_pools

# %%
#| hide
import dataclasses, inspect
from ictd.boyan import random_boyan_chain
from ictd.pretrain import pretrain_many
from ictd.engine import eval_set
from ictd.linear import ICLR_LINEAR, moment_predict, sliding_windows, td_parameters

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *

# %%
#| hide
from IPython.display import Markdown


# %% [markdown]
# # The sliding-window protocol
# > The predecessor's data protocol for pretraining in-context TD (Wang et al., ICLR 2025): trajectories from random start distributions cut into overlapping windows, the semi-gradient TD loss over them, the batch-TD step size that loss selects, and the protocol plugged into the pretraining engine.

# %% [markdown]
# [Chapter 7](linear.html) built the linear-attention construction of Wang et al. (2025) (*the
# predecessor*), its measures and the linear family of the pretraining engine. This page defines the
# data that family is pretrained on in the predecessor's experiment, and the one number its measures
# need besides a trained model: the step size of the batch-TD Transformer the model is compared with.
#
# *How to read this chapter.* The question is what the predecessor trains on and at which step size
# its batch-TD model runs. First the protocol: random start distributions, windows and the loss;
# then the step size, which that same loss fits (Proposition 7.3 makes the fit exact and cheap), and
# the result, the fitted $\alpha_{TD}$ of the predecessor's setting with its standard error; then the
# protocol as a plug-in of the engine. The protocol does not depend on the attention: the softmax
# family of chapter 6 trains on it too (checked at the end). Validation and the engine's equivalences are in the last section,
# [Implementation and tests](#implementation-and-tests).
#
# *Sources.* The protocol and the loss follow the predecessor's public code; Proposition 7.3, its
# proof and the fitted step size are ours.

# %% [markdown]
# ## The protocol
#
# The data protocol of Wang et al. (2025) differs from chapter 6's independent stationary prompts.
# For each task (a random Boyan chain with its own random features) it runs **5 mini-batches**; each
# mini-batch is **one trajectory** started from a random, not stationary, distribution $d_0$ of the
# task (entries uniform on $[0.01, 0.99]$, normalised), cut into **$n_{\mathrm{mb}} + 1$ consecutive
# overlapping windows** for a mini-batch size $n_{\mathrm{mb}}$ (counted from the sampler [in the
# engine](#the-protocol-in-the-engine)): window $k$ has the context transitions $S_k \to S_{k+1}, \dots, S_{k+n-1} \to S_{k+n}$
# and the query $S_{k+n+1}$. The TD error pairs window $k$'s query with window $k+1$'s, whose context
# has slid by one transition:
#
# $$\delta_k = r(S_{k+n+1}) + \gamma\, \mathrm{TF}(Z^{(k+1)}) - \mathrm{TF}(Z^{(k)}), \qquad
# \text{loss} = \frac1{n_{\mathrm{mb}}} \sum_{k<n_{\mathrm{mb}}} \delta_k^2 \text{ with } \mathrm{TF}(Z^{(k+1)}) \text{ held fixed}.$$
#
# Here is the sampler's first piece, the start distributions; the windows as prompts of the linear
# family are the `sliding_windows` of [chapter 7](linear.html#the-predecessors-windows-as-linear-prompts).

# %%
#| export
def start_distributions(n_tasks:int,   # number of tasks
                        n_states:int,  # states per task
                        gen:torch.Generator, # source of randomness
                       )->torch.Tensor:      # (n_tasks, n_states), rows sum to 1
    "The predecessor's random start distributions: entries uniform on [0.01, 0.99], normalised."
    mu = 0.01 + 0.98 * torch.rand(n_tasks, n_states, generator=gen, dtype=torch.float64)
    return mu / mu.sum(-1, keepdim=True)


# %% [markdown]
# Each row is a distribution that puts between $0.01/0.99/s$ and $0.99/0.01/s$ on every one of the $s$
# states, so every trajectory can start anywhere:

# %%
mu = start_distributions(3, 10, torch.Generator().manual_seed(0))
test_close(mu.sum(-1), torch.ones(3, dtype=torch.float64), eps=1e-12)
assert 0.01 / 0.99 / 10 < mu.min() and mu.max() < 0.99 / 0.01 / 10
test_eq(mu, start_distributions(3, 10, torch.Generator().manual_seed(0)))


# %% [markdown]
# The loss pairs each window with the next, the successor's value held fixed:

# %%
#| export
@moved_to_keywords("gamma")
def sliding_td_loss(v:torch.Tensor,       # (..., W) values of consecutive windows
                    rewards:torch.Tensor, # (..., W-1) reward of each window's query state
                    *,
                    gamma:float,          # discount factor
                   )->torch.Tensor:       # (...) mean squared TD error, successor's value held fixed
    "The predecessor's loss: mean over windows of $(r + \\gamma\\,\\mathrm{TF}(Z^{(k+1)}) - \\mathrm{TF}(Z^{(k)}))^2$, the first term detached."
    return (rewards + gamma * v[..., 1:].detach() - v[..., :-1]).square().mean(-1)


# %% [markdown]
# A check by hand on three windows: the loss is the mean of the two squared TD errors, and its
# gradient reaches only the earlier window of each pair (the successor's value is held fixed).

# %%
v_demo = torch.tensor([1., 2., 3.], requires_grad=True)
loss = sliding_td_loss(v_demo, torch.tensor([0.5, -1.]), gamma=0.5)
loss.backward()
test_close(loss.item(), ((0.5 + 1 - 1) ** 2 + (-1 + 1.5 - 2) ** 2) / 2, eps=1e-12)
test_close(v_demo.grad, torch.tensor([-0.5, 1.5, 0.]), eps=1e-12)


# %% [markdown]
# ## The batch-TD companion and its step size
#
# VD and IWS compare the trained model with batch TD at *one* step size $\alpha$, and the predecessor
# fits that step size with the same TD loss: the batch-TD Transformer's only parameter $\alpha$
# follows the semi-gradient $\psi(\alpha) = \mathbb E[\delta\, \partial v_{TD}/\partial\alpha]$ of the
# sliding-window loss, started at $\alpha = 1$. The fitted $\alpha$ does not depend on the trained
# model, only on the task distribution, so we compute once the point where $\psi$ changes sign from
# $+$ to $-$ nearest to 1 (the stable point of its flow from $\alpha = 1$). (The predecessor trains
# $\alpha$ alongside the model with Adam; we do not train it, and have not checked where a trained
# $\alpha$ ends; the spread of the single-chunk fits below shows how far a fit on few tasks can sit from it.)
#
# This is cheap and exact because of a fact about batch TD.
#
# ::: {.proposition}
# **Proposition 7.3 (batch TD is a polynomial in its step size).** On a window's context, batch TD is $w \leftarrow w + \alpha(\hat b - \hat A_{\mathrm{TD}} w)$ with
# $\hat A_{\mathrm{TD}} = \frac1n\sum_{i<n} \phi(S_i)(\phi(S_i) - \gamma\phi(S_{i+1}))^\top$ and
# $\hat b = \frac1n \sum_{i<n} R_{i+1}\phi(S_i)$. From $w_0 = 0$,
#
# $$w_L = \sum_{j=1}^{L} \binom{L}{j} (-1)^{j-1} \alpha^j \hat A_{\mathrm{TD}}^{\,j-1} \hat b ,$$
#
# so $v_{TD}$ at the query is a polynomial of degree $L$ in $\alpha$, and $\psi$ a polynomial of
# degree $2L - 1$ whose coefficients are averages over windows.
# :::
#
# ::: {.callout-note collapse="true" title="Proof"}
# Our argument. $w_L = (I - \alpha \hat A_{\mathrm{TD}}) w_{L-1} + \alpha \hat b$, so $w_L = \sum_{k<L} (I - \alpha \hat A_{\mathrm{TD}})^k \alpha \hat b$.
# Expanding each power binomially and collecting the terms in $\alpha^j \hat A_{\mathrm{TD}}^{j-1}$ gives
# $\sum_{k=j-1}^{L-1} \binom{k}{j-1} (-1)^{j-1} = (-1)^{j-1}\binom{L}{j}$ by the hockey-stick identity.
# $\psi$ is the mean over windows of $\delta_k\, \partial v_k/\partial\alpha$, a product of a polynomial
# of degree $L$ and one of degree $L - 1$. $\square$
# :::
#
# The windows' $\hat A_{\mathrm{TD}}$ and $\hat b$ are differences of running sums along each trajectory.

# %%
#| export
@moved_to_keywords("n", "gamma", "n_layers")
def sliding_td_coefficients(phi:torch.Tensor,    # (..., s, d) features of each trajectory's task
                            r:torch.Tensor,      # (..., s) rewards
                            states:torch.Tensor, # (..., T) trajectories
                            *,
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


# %% [markdown]
# The expected semi-gradient is then a product of polynomials, averaged over windows:

# %%
#| export
@moved_to_keywords("gamma")
def td_semigradient_poly(coef:torch.Tensor,     # (..., W, L+1) value coefficients of consecutive windows
                         rewards:torch.Tensor,  # (..., W-1) reward of each window's query
                         *,
                         gamma:float,           # discount factor
                        )->np.polynomial.Polynomial: # g(alpha) = mean of delta_k * dv_k/dalpha
    "The expected semi-gradient of the sliding-window TD loss in alpha, as a polynomial (mean over all windows given)."
    delta = gamma * coef[..., 1:, :] - coef[..., :-1, :]
    delta[..., 0] += rewards
    d_v = coef[..., :-1, 1:] * torch.arange(1, coef.shape[-1], dtype=coef.dtype)
    prod = torch.stack([sum(delta[..., i] * d_v[..., k - i] for i in range(delta.shape[-1]) if 0 <= k - i < d_v.shape[-1])
                        for k in range(delta.shape[-1] + d_v.shape[-1] - 1)], -1)
    return np.polynomial.Polynomial(prod.flatten(0, -2).mean(0).numpy())


# %% [markdown]
# The fitted step size is the stable root of that polynomial reached from $\alpha = 1$:

# %%
#| export
def fit_td_step(g:np.polynomial.Polynomial,  # expected semi-gradient in alpha
               )->float:                      # the stable step size reached from alpha = 1
    "The sign change of `g` from + to - nearest to alpha = 1 in the direction `g(1)` points."
    check_type(g, np.polynomial.Polynomial, "g")
    roots = sorted(r.real for r in g.roots() if abs(r.imag) < 1e-9 and r.real > 0 and g.deriv()(r.real) < 0)
    pick = [r for r in roots if r >= 1] if g(1.) > 0 else [r for r in roots[::-1] if r <= 1]
    if not pick: raise ValueError(f"no stable step size in the direction of the semi-gradient from alpha = 1 (g(1) = {g(1.):.3g})")
    return float(pick[0])


# %% [markdown]
# On polynomials whose roots are known: $g(\alpha) = (2 - \alpha)(\alpha - 0.5)$ is positive at 1 and
# falls through 0 at 2, so the fit is 2; $-g$ is negative at 1 and its flow runs down to its stable
# root 0.5; $\alpha - 2$ is negative at 1 with no stable root below it, and the fit is refused.

# %%
g_demo = -np.polynomial.Polynomial.fromroots([0.5, 2.])   # (2 - alpha)(alpha - 0.5)
test_close(fit_td_step(g_demo), 2., eps=1e-12)
test_close(fit_td_step(-g_demo), 0.5, eps=1e-12)
test_fail(lambda: fit_td_step(np.polynomial.Polynomial([-2., 1.])), contains="no stable step size")
test_fail(lambda: fit_td_step([-2., 1.]), contains="`g` must be a Polynomial")

# %% [markdown]
# Checks: the polynomial reproduces the batch-TD Transformer's values at the windows' queries at an
# arbitrary step size, and the polynomial semi-gradient equals the one autograd computes through
# the Transformer.

# %%
mrp = random_boyan_chain(seed=11)
gen = torch.Generator().manual_seed(1)
states = sample_trajectories(mrp.P[None].expand(3, 10, 10), start_distributions(3, 10, gen), n=40, seed=gen)
phi3, r3 = mrp.phi.expand(3, 10, 4), mrp.r.expand(3, 10)
Zw, rw = sliding_windows(phi3, r3, states, 30, mrp.gamma)
coef, rw2 = sliding_td_coefficients(phi3, r3, states, n=30, gamma=mrp.gamma, n_layers=3)
test_eq(rw2, rw)
a = torch.tensor(2.7, dtype=torch.float64, requires_grad=True)
v = moment_predict(*(t[None] for t in td_parameters(4, a)), Zw, 30, 3)[..., 0]
test_close((coef * 2.7 ** torch.arange(4, dtype=torch.float64)).sum(-1), v.detach(), eps=1e-10)
auto, = torch.autograd.grad(((rw + mrp.gamma * v[..., 1:] - v[..., :-1]).detach() * v[..., :-1]).mean(), a)
test_close(td_semigradient_poly(coef, rw, gamma=mrp.gamma)(2.7), auto.item(), eps=1e-10)

# %%
#| export
FIT_CHUNK, FIT_TRAJECTORIES, FIT_STEPS = 64, 5, 65   # tasks per chunk, trajectories per task, steps per trajectory beyond n
FIT_SEED = 123_456   # the fit's seed: its tasks are drawn from stream 0 of it, chunk k's trajectories from child k of stream 1


# %% [markdown]
# The fit averages the semi-gradient over chunks of fresh tasks (cached, since it depends only on the task distribution):

# %%
#| export
@functools.lru_cache(maxsize=16)
def td_semigradient_chunks(n:int, n_layers:int, gamma:float, n_states:int=10, d:int=4,
                           n_tasks:int=1024,  # fresh tasks, in chunks of FIT_CHUNK, FIT_TRAJECTORIES trajectories each
                          )->tuple:           # one semi-gradient polynomial per chunk of FIT_CHUNK tasks
    "The sliding-window TD semi-gradient of the batch-TD Transformer in its step size, per chunk of fresh tasks (cached)."
    polys, rep = [], lambda x: x.repeat_interleave(FIT_TRAJECTORIES, 0)
    for first in range(0, n_tasks, FIT_CHUNK):
        tasks = random_tasks(min(FIT_CHUNK, n_tasks - first), seed=substream(FIT_SEED, 0), first=first, n_states=n_states, d=d, gamma=gamma)
        gen = torch.Generator().manual_seed(substream(FIT_SEED, 1, first // FIT_CHUNK))
        states = sample_trajectories(rep(tasks.P), rep(start_distributions(len(tasks), n_states, gen)), n=n + FIT_STEPS, seed=gen)
        polys.append(td_semigradient_poly(*sliding_td_coefficients(rep(tasks.phi), rep(tasks.r), states, n=n, gamma=gamma, n_layers=n_layers), gamma=gamma))
    return tuple(polys)


# %% [markdown]
# The step size fitted on all chunks together:

# %%
#| export
@moved_to_keywords("n", "n_layers", "gamma", "n_states", "d", "n_tasks")
def fitted_td_step(*, n:int, n_layers:int, gamma:float, n_states:int=10, d:int=4, n_tasks:int=1024)->float:
    "The batch-TD Transformer's step size fitted by the sliding-window TD loss on `n_tasks` fresh tasks."
    polys = td_semigradient_chunks(n, n_layers, gamma, n_states, d, n_tasks)
    return fit_td_step(sum(polys[1:], polys[0]) / len(polys))


# %%
show_doc(fitted_td_step)

# %% [markdown]
# For the predecessor's setting ($d = 4$, 10 states, $n = 30$, $L = 3$, $\gamma = 0.9$), on the
# default number of fresh tasks, with the standard error of the fit estimated from its chunks of
# tasks fitted separately (the counts below are read from the code's defaults and a sampled trajectory):

# %%
alpha_td = fitted_td_step(n=30, n_layers=3, gamma=0.9)
chunks = td_semigradient_chunks(30, 3, 0.9)
n_fit_tasks = inspect.signature(td_semigradient_chunks).parameters["n_tasks"].default
probe = sample_trajectories(mrp.P[None], start_distributions(1, 10, gen), n=30 + FIT_STEPS, seed=gen)
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
# ## The protocol in the engine
#
# The predecessor's **sliding protocol** is a protocol of the engine, registered as `"sliding"` when
# `ictd.sliding` is imported (`ictd.linear` imports it). Its tasks come in order: each
# seed's task $k$ is task $k$ of its training pool (`task_pool(config, ., run_stream(seed, "train_pool"), first=k)`), drawn
# `SLIDING_CHUNK` at a time with their random start distributions and trajectories from the seed's
# data stream; the $n_\text{steps} / n_\text{tasks}$ steps on a task each take one trajectory of
# $n + n_{\mathrm{mb}} + 2$ states and cut it into the $n_{\mathrm{mb}} + 1$ overlapping windows of
# chapter 7's `sliding_windows`, each window's successor being the *next window* (`TDExamples(successor="next")`).
# Its loss is the predecessor's mean squared TD error, without a factor $\frac12$ (`loss_scale=1`).
# The held-out contexts start from random start distributions too.

# %%
#| export
SLIDING_CHUNK = 25   # tasks of a seed drawn together (with their trajectories) by the sliding protocol


# %% [markdown]
# The protocol draws its tasks in chunks, each seed from its own pool and generator,

# %%
#| export
def _per_task(config:PretrainConfig)->int:
    if config.n_steps % config.n_tasks: raise ValueError(f"`n_steps` must be a multiple of `n_tasks` for the sliding protocol (mini-batches per task), got {config.n_steps} and {config.n_tasks}")
    return config.n_steps // config.n_tasks

def sliding_chunk(config:PretrainConfig, seeds:list, gens:list, first:int)->dict:
    "Tasks first.. of every seed (up to SLIDING_CHUNK; TaskBatch tensors (S, count, ...)) and their trajectories `states` (S, count, per task, n + B + 2)."
    count, per_task, T = min(SLIDING_CHUNK, config.n_tasks - first), _per_task(config), config.n + config.batch_size + 1
    pools, states = [], []
    for s, g in zip(seeds, gens):
        pools.append(task_pool(config, count, run_stream(s, "train_pool"), first=first))
        mu = start_distributions(count, config.n_states, g).repeat_interleave(per_task, 0)
        states.append(sample_trajectories(pools[-1].P.repeat_interleave(per_task, 0), mu, n=T, seed=g).unflatten(0, (count, per_task)))
    pool = stack_pools(pools)
    return dict(P=pool.P, r=pool.r, phi=pool.phi, d_pi=pool.d_pi, v_pi=pool.v_pi, states=torch.stack(states))


# %% [markdown]
# cuts one trajectory per step into its windows,

# %%
#| export
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


# %% [markdown]
# and holds out tasks of its own, with contexts from random start distributions:

# %%
#| export
def sliding_eval_set(config:PretrainConfig, seeds:list, device=None)->EvalSet:
    "Each seed's held-out tasks (its stream `eval_pool`), with one context per task from a random start distribution (its stream `eval_contexts`)."
    pools, states = [], []
    for s in seeds:
        pools.append(task_pool(config, config.eval_tasks, run_stream(s, "eval_pool")))
        gen = torch.Generator().manual_seed(run_stream(s, "eval_contexts"))
        states.append(sample_trajectories(pools[-1].P, start_distributions(config.eval_tasks, config.n_states, gen), n=config.n, seed=gen))
    return task_eval_set(config, stack_pools(pools, device), torch.stack(states).to(device))

register_protocol("sliding", Protocol(sample=sliding_sample, eval_set=sliding_eval_set, loss_scale=1.,
                                      data=lambda config, seeds, device: dict(seeds=seeds, device=device, per_task=_per_task(config))))

# %% [markdown]
# One step of the predecessor's configuration (`ICLR_LINEAR`, [chapter 7](linear.html#pretraining-the-linear-transformer)):

# %%
batch = sliding_sample(ICLR_LINEAR, dict(seeds=[0], device="cpu"), [torch.Generator().manual_seed(0)], 0, {})
n_win = batch.x.states.shape[-2]   # (seeds, windows, n + 1) context states
test_eq(n_win, ICLR_LINEAR.batch_size + 1)
print(f"one mini-batch of the predecessor's configuration: {n_win} windows, {n_win - 1} TD errors (batch_size = {ICLR_LINEAR.batch_size})")

# %% [markdown]
# With the protocol and the fitted step size, the [experiments](linear_experiments.html) train
# linear Transformers as the predecessor did and measure how close they come to batch TD.

# %% [markdown]
# ## Implementation and tests
#
# The engine's equivalences for the protocol, still executed.

# %% [markdown]
# The sliding protocol: a seed trained alongside another equals the same seed trained alone, the
# evaluations fall where asked, and a step count that is not a multiple of the task count is refused.

# %%
small_sliding = dataclasses.replace(ICLR_LINEAR, n_tasks=30, n_steps=60, eval_every=20, eval_tasks=4)
tiny, tiny_alone = pretrain_many(small_sliding, [1, 2], progress=False), pretrain_many(small_sliding, [2], progress=False)
test_close(tiny[1].params["P"], tiny_alone[0].params["P"], eps=1e-12)
test_close(tiny[1].history["iws"], tiny_alone[0].history["iws"], eps=1e-12)
test_eq(tiny[0].history["step"].flatten(), torch.tensor([0, 20, 40, 60]))
test_fail(lambda: pretrain_many(dataclasses.replace(small_sliding, n_steps=61), [0]), contains="`n_steps` must be a multiple of `n_tasks`")

# %% [markdown]
# The protocol serves any family: chapter 6's softmax Transformer trains on it too, evaluated on the
# same held-out tasks and contexts as the linear one.

# %%
soft_sliding = pretrain_many(dataclasses.replace(small_sliding, attention="softmax", shared=False), [2], progress=False)
test_eq(soft_sliding[0].history["step"].flatten(), torch.tensor([0, 20, 40, 60]))
assert torch.isfinite(soft_sliding[0].history["msve"]).all()
ev_lin, ev_soft = (eval_set(c, [2]) for c in (small_sliding, soft_sliding[0].config))
test_eq((ev_lin.states, ev_lin.tasks.P), (ev_soft.states, ev_soft.tasks.P))

# %%
#| export
from ictd.boyan import check_arguments
check_arguments(globals())   # every public function refuses, naming it, an argument its annotation rules out (chapter 0)

# %%
#| hide
import nbdev; nbdev.nbdev_export()
