# %%
#| default_exp experiments.stationary

# %%
#| export
from __future__ import annotations
import json, math, time
from pathlib import Path
import torch
from ictd.core import TaskBatch, atomic_write_text, check_int, check_number, check_type, provenance
from ictd.model import SoftmaxICTD, theta_star
from ictd.state_tokens import (StateTokens, model_params, population_tokens, token_layers,
                               token_predict)
from ictd.tasks import random_tasks
from ictd.emergence import UNIFORM_BELOW, held_out_prompts
from ictd.mechanism import learned_kernel
from ictd.experiments.mechanism import load_models

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *

# %%
#| hide
import matplotlib.pyplot as plt
from IPython.display import Markdown
from ictd.core import OKABE_ITO, provenance_note
from ictd.state_tokens import population_neu, population_predict, token_layer
from ictd.mechanism import update_jacobian
from ictd.experiments.mechanism import rate_interval
import copy

# %% [markdown]
# # Stationary points of pretraining
# > Where the mean semi-gradient TD update vanishes in the population state-token model: what a uniform layer writes, why every layer starts as one, and what a Levenberg-Marquardt search finds.

# %% [markdown]
# ::: {.callout-note}
# **What this page shows** [ours]. In the population model ($n = \infty$), a layer with uniform attention writes
# one vector, $(V^{\mathrm{cur}} + V^{\mathrm{tgt}})\bar z$, to every column, so a uniform level layer followed by
# $\theta^*$ layers is exactly TD warm-started at a level (proved). At $\theta = 0$ the mean update moves only the value
# rows, the same in every layer: every layer starts as a uniform level layer, and the first-order dynamics cannot say
# which one stays uniform (proved); the mean flow from zero does not say it either (measured against 50 trained seeds).
# No member of a grid of the level + TD family is stationary, and the zeros of the mean update found to $10^{-10}$
# (two layers) are saddles at which the model predicts nothing: zeros of the batch of tasks they were found on, which
# come closer to zeros for other tasks as the batch grows (measured on one-hot tasks).
# :::
#
# *How to read this page.* Chapter [6](pretrain.html) defined the objective, the norm of the expected update (NEU),
# and showed that $\theta^*$ is not one of its zeros at the depths that are trained; chapter [6b](mechanism.html)
# found that the trained models compute a level plus a few iterates of weighted softmax TD, with one layer of
# uniform attention. This page asks whether that shape is forced by the dynamics, in the spirit of Zhang, Frei and
# Bartlett (JMLR 2024), who characterised the limit of gradient flow for one linear-attention layer. Three
# propositions are proved here, each with a float64 check beside it; everything else is measured and says on what.
# The computations over seconds come from `nbs/data/stationary_points.json`, written by `run_stationary_study`
# ([Implementation and tests](#implementation-and-tests)).

# %% [markdown]
# ## The mean update in the population model
#
# Chapter [3a](state_tokens.html#the-limit-of-an-infinitely-long-context) reduced an infinitely long stationary context
# to $s$ state tokens $z_y$ (features, reward, value slot), weighted by $d_\pi(y)$, whose successors are mixed by $P$.
# A layer with parameters $(A, V^{\mathrm{cur}}, V^{\mathrm{tgt}})$ adds to every column $z$
#
# $$\Delta z = X\, a(z), \qquad X = V^{\mathrm{cur}} Z + V^{\mathrm{tgt}} Z P^\top,$$
# $$a_y(z) = \operatorname{softmax}_y\big(z_y^\top A z + \log d_\pi(y)\big),$$
#
# with $Z = (z_1, \dots, z_s)$ the keys. With $v(x) = \mathrm{TF}(x;\theta)$ the value slot of query $x$ after $L$
# layers and $\delta(x) = r(x) + \gamma (Pv)(x) - v(x)$ the expected TD error at $x$, the mean semi-gradient update
# over a batch of tasks is
#
# $$U(\theta) = \mathbb E_{\text{task}} \sum_x d_\pi(x)\, \delta(x)\, \nabla_\theta v(x),$$
# $$\mathrm{NEU}(\theta) = \|U(\theta)\|^2 .$$
#
# Pretraining follows $\dot\theta = U(\theta)$ on average; its rest points are the zeros of $U$. `mean_updates`
# computes $U$ for many parameter sets at once, each held as one tensor (layer, head, row, column) with heads
# $(A, V^{\mathrm{cur}}, V^{\mathrm{tgt}})$, by putting the sets on the seed axis of chapter 3a's forward pass.

# %%
#| export
HEADS = ("A", "V_cur", "V_tgt")

def layer_stack(model:SoftmaxICTD)->torch.Tensor:
    "A model's parameters as one float64 tensor (L, 3, D, D): layer, then (A, V_cur, V_tgt)."
    check_type(model, SoftmaxICTD, "model")
    if model.shared: raise ValueError("`model` must have separate layers (shared=False)")
    return torch.stack([model_params(model)[k][0].detach().double() for k in HEADS], 1)

def _params(p:torch.Tensor)->dict:
    "(S, L, 3, D, D) stacked parameter sets -> the dict of (S, L, D, D) tensors of the forward pass."
    return {k: p[:, :, i] for i, k in enumerate(HEADS)}

def _population(tasks:TaskBatch, S:int)->tuple:
    one = TaskBatch(*(getattr(tasks, k)[None] for k in ("P", "r", "phi", "d_pi", "v_pi")),
                    tasks.gamma)
    x = population_tokens(one)
    return one, StateTokens(*(t.expand(S, *t.shape[1:]) for t in (x.Z, x.log_w, x.succ)), x.q)

def mean_updates(p:torch.Tensor,     # (S, L, 3, D, D) parameter sets, or (L, 3, D, D) for one
                 tasks:TaskBatch,    # the fixed batch of tasks to average over
                )->torch.Tensor:     # the same shape: the mean update of each set, at n = infinity
    "The mean semi-gradient TD update $\\mathbb E[\\delta\\, \\nabla_\\theta \\mathrm{TF}]$ at $n = \\infty$, for many sets."
    check_type(tasks, TaskBatch, "tasks")
    one_set = p.ndim == 4
    P = (p[None] if one_set else p).detach().double()
    D = tasks.phi.shape[-1] + 2
    if P.ndim != 5 or P.shape[2] != 3 or P.shape[-2:] != (D, D):
        raise ValueError(f"`p` must be (S, L, 3, D, D) with D = d + 2 = {D}, got {tuple(p.shape)}")
    one, x = _population(tasks, P.shape[0])
    P = P.requires_grad_()
    v = token_predict(_params(P), P.shape[1], x)                                    # (S, B, s)
    with torch.no_grad(): delta = one.r + tasks.gamma * (one.P @ v[..., None])[..., 0] - v
    U = torch.autograd.grad((one.d_pi * delta * v).sum() / len(tasks), P)[0]
    return U[0] if one_set else U

def update_norm(p, tasks)->float:
    "The norm of the mean update at one parameter set (L, 3, D, D); its square is `population_neu`."
    return mean_updates(p, tasks).norm().item()


# %% [markdown]
# Its squared norm is chapter 3a's `population_neu`, to rounding, at $\theta^*$ and at a random point, with
# one-hot features (the setting of this page: $s = 10$ states, $d = s$, $\gamma = 0.9$):

# %%
chk_tasks = random_tasks(16, seed=1, features="onehot")
W3 = 3 * torch.eye(10, dtype=torch.float64)
for chk_model in (SoftmaxICTD.from_theta_star(10, W3, n_layers=3, alpha=1., gamma=0.9),
                  SoftmaxICTD(10, n_layers=2, init_gain=1., seed=0)):
    neu_here = update_norm(layer_stack(chk_model), chk_tasks) ** 2
    test_close(neu_here, population_neu(chk_model, chk_tasks), eps=1e-12)

# %% [markdown]
# The study's fixed batch of tasks, drawn with its own seed:

# %%
#| export
STUDY_TASKS = dict(n_tasks=64, seed=20_261_203)   # the fixed batch of tasks of every computation here

def study_tasks(features:str="onehot",                # "onehot", or "random" (d = 4)
                n_tasks:int=STUDY_TASKS["n_tasks"],   # number of tasks
                seed:int=STUDY_TASKS["seed"],         # seed of `random_tasks`
               )->TaskBatch:
    "The study's fixed batch of tasks: one-hot features, or the headline configuration's d = 4 random features."
    if features == "onehot": return random_tasks(n_tasks, seed=seed, features="onehot")
    if features == "random": return random_tasks(n_tasks, seed=seed, features="random", d=4)
    raise ValueError(f"`features` must be 'onehot' or 'random', got {features!r}")


# %% [markdown]
# ## What a uniform layer writes
#
# ::: {.proposition}
# **Proposition 6d.1 (ours).** In the population model, if a column $z$ gives every key the same score
# ($z_y^\top A z$ independent of $y$; for instance $A = 0$), the layer adds to it
# $$\Delta z = (V^{\mathrm{cur}} + V^{\mathrm{tgt}})\, \bar z, \qquad \bar z = \sum_y d_\pi(y)\, z_y,$$
# the same vector for every such column, whatever the tokens. Only the sum of the two heads matters.
# :::
#
# ::: {.callout-note collapse="true" title="Proof"}
# A constant score cancels in the softmax, so $a(z) = d_\pi$. Then
# $X d_\pi = V^{\mathrm{cur}} Z d_\pi + V^{\mathrm{tgt}} Z (P^\top d_\pi) = (V^{\mathrm{cur}} + V^{\mathrm{tgt}}) \bar z$,
# because $d_\pi$ is stationary, $P^\top d_\pi = d_\pi$: the mean successor of a $d_\pi$-distributed key is again
# $d_\pi$-distributed. $\square$
# :::
#
# At the first layer the tokens are $z_y = (\phi(y), r(y), 0)$, so $\bar z = (\bar\phi, \bar r, 0)$ with
# $\bar r = \sum_y d_\pi(y) r(y)$ the mean reward, and the value slot of every column receives
# $u^\top \bar\phi + u_r \bar r$, with $u$ the value row of $V^{\mathrm{cur}} + V^{\mathrm{tgt}}$: a state-blind level.
# The check: random tasks (random features), a random first layer so that the tokens are not the raw ones, then a
# layer with $A = 0$ and random heads; every column's change against $(V^{\mathrm{cur}} + V^{\mathrm{tgt}})\bar z$:

# %%
def uniform_write_gap(seed:int)->float:
    "Largest |change of a column - (V_cur + V_tgt) z-bar| over every column, after a random layer."
    g = torch.Generator().manual_seed(seed)
    tasks = random_tasks(8, seed=seed, features="random", d=4)
    one, x = _population(tasks, 1)
    first = torch.randn(3, 6, 6, generator=g, dtype=torch.float64)
    heads = torch.randn(2, 6, 6, generator=g, dtype=torch.float64)
    Z1 = token_layer(x.Z, *(h[None] for h in first), x)[0]
    no_scores = torch.zeros(1, 6, 6, dtype=torch.float64)
    Z2 = token_layer(Z1, no_scores, heads[0][None], heads[1][None], x)[0]
    z_bar = (Z1[..., :10] * one.d_pi[:, :, None, :]).sum(-1)                     # (1, B, D)
    return (Z2 - Z1 - ((heads[0] + heads[1]) @ z_bar[..., None])).abs().max().item()
gaps = [uniform_write_gap(k) for k in range(5)]
assert max(gaps) < 1e-12, gaps
Markdown(f"Largest gap over five draws: below $10^{{-12}}$ (asserted).")


# %% [markdown]
# A uniform layer therefore shifts the value slot of keys and queries alike. Followed by layers of $\theta^*$
# (Definition 3.1), whose scores read features only, it starts chapter 5's population recursion from that level:
#
# ::: {.proposition}
# **Proposition 6d.2 (ours).** Let layer 1 have $A = 0$ and a single nonzero entry, $V^{\mathrm{cur}}$ reading the
# reward slot into the value slot with weight $\lambda / (1-\gamma)$, and layers $2, \dots, L$ be
# $\theta^*(W = \beta I, \alpha)$. At $n = \infty$ the model predicts $v_{L-1}$ of
# $$v_0 = \lambda \frac{\bar r}{1-\gamma}\,\mathbf 1, \qquad v_{l+1} = v_l + \alpha M_\pi \big(r + \gamma P v_l - v_l\big),$$
# $$M_\pi(x, y) = \operatorname{softmax}_y\big(\beta\,\phi(x)^\top\phi(y) + \log d_\pi(y)\big):$$
# weighted softmax TD warm-started at the level, the winner of chapter 6b's contest.
# :::
#
# ::: {.callout-note collapse="true" title="Proof"}
# By Proposition 6d.1 layer 1 adds $\lambda \bar r/(1-\gamma)$ to the value slot of every column and nothing else.
# A layer of $\theta^*$ scores with $\phi(y)^\top W \phi(x)$ only, so its attention is $M_\pi$ for keys and queries
# alike, and it adds $\alpha \sum_y M_\pi(x, y)\,(r(y) + \gamma (P v)(y) - v(y))$ to the value slot of the column of
# state $x$ (key or query), where $v$ is the common value slot of the state's columns. By induction every column of
# state $x$ carries $v_l(x)$ after layer $l + 1$. $\square$
# :::

# %%
#| export
def level_td_stack(d:int,          # feature dimension
                   n_layers:int,   # depth L >= 2
                   level:float,    # lambda: layer 1 writes lambda R-bar / (1 - gamma) to every value slot
                   beta:float,     # TD layers: W = beta I
                   alpha:float,    # TD layers: step size
                   gamma:float,    # discount factor
                  )->torch.Tensor: # (L, 3, d + 2, d + 2)
    "A uniform level layer (A = 0, V_cur reading the reward row) and L - 1 layers of theta*(beta I, alpha)."
    n_layers = check_int(n_layers, "n_layers", 2)
    D = d + 2
    first = torch.zeros(3, D, D, dtype=torch.float64)
    first[1, D - 1, d] = check_number(level, "level") / (1 - gamma)
    W = check_number(beta, "beta") * torch.eye(d, dtype=torch.float64)
    td = torch.stack(theta_star(d, W, alpha=alpha, gamma=gamma))
    return torch.stack([first] + [td] * (n_layers - 1))

def warm_td_values(tasks:TaskBatch, n_layers:int, level:float, beta:float, alpha:float)->torch.Tensor:
    "(B, s) $v_{L-1}$ of $v_{l+1} = v_l + \\alpha M_\\pi(r + \\gamma P v_l - v_l)$ from $\\lambda \\bar r / (1 - \\gamma)$."
    M = torch.softmax(beta * tasks.phi @ tasks.phi.mT + tasks.d_pi.log()[:, None, :], dim=-1)
    r_bar = (tasks.d_pi * tasks.r).sum(-1, keepdim=True)
    v = (level * r_bar / (1 - tasks.gamma)).expand_as(tasks.r)
    for _ in range(n_layers - 1):
        delta = tasks.r + tasks.gamma * (tasks.P @ v[..., None])[..., 0] - v
        v = v + alpha * (M @ delta[..., None])[..., 0]
    return v

LEVEL_TD_GRID = dict(level=(0., 0.5, 0.85, 1.), beta=(1., 3., 5., 10.), alpha=(0.5, 1.))   # searched

def level_td_grid(tasks:TaskBatch, n_layers:int, grid:dict=LEVEL_TD_GRID)->list:
    "NEU of every member of the level + TD family on the grid: (level, beta, alpha, NEU) rows, in one call."
    d = tasks.phi.shape[-1]
    pts = [(l, b, a) for l in grid["level"] for b in grid["beta"] for a in grid["alpha"]]
    sets = torch.stack([level_td_stack(d, n_layers, l, b, a, tasks.gamma) for l, b, a in pts])
    U = mean_updates(sets, tasks)
    return [(l, b, a, u.square().sum().item()) for (l, b, a), u in zip(pts, U)]


# %% [markdown]
# The check, with one-hot features at $L = 3$, against the recursion written out (`warm_td_values`):

# %%
def as_model(p:torch.Tensor)->SoftmaxICTD:
    "A `SoftmaxICTD` carrying the parameter set p (L, 3, D, D)."
    m = SoftmaxICTD(p.shape[-1] - 2, n_layers=p.shape[0], seed=0)
    with torch.no_grad():
        for l, lay in enumerate(m.layers):
            for i, k in enumerate(HEADS): getattr(lay, k).copy_(p[l, i])
    return m
def warm_gap(lam:float, b:float, a:float)->float:
    "Largest |model - warm-started recursion| over tasks and states (level lam, beta b, alpha a)."
    v = population_predict(as_model(level_td_stack(10, 3, lam, b, a, 0.9)), chk_tasks)
    return (v - warm_td_values(chk_tasks, 3, lam, b, a)).abs().max().item()
warm_gap = max(warm_gap(*c) for c in ((0.85, 3., 1.), (1., 10., 0.5)))
assert warm_gap < 1e-12, warm_gap

# %% [markdown]
# ## Every layer starts as a level layer
#
# ::: {.proposition}
# **Proposition 6d.3 (ours).** At $\theta = 0$ the mean update is zero on every $A$ and on every row of every
# $V^{\mathrm{cur}}, V^{\mathrm{tgt}}$ except the value row, and on the value rows it is the same in every layer and
# both heads:
# $$U_{V^{\mathrm{cur}}_l,\ \mathrm{value\ row}}(0) = U_{V^{\mathrm{tgt}}_l,\ \mathrm{value\ row}}(0)
# = \mathbb E_{\text{task}}\big[\bar r\, \bar z\big],$$
# $$\bar z = (\bar\phi, \bar r, 0), \quad l = 1, \dots, L.$$
# :::
#
# ::: {.callout-note collapse="true" title="Proof"}
# At $\theta = 0$ every $X$ is zero, so every layer is the identity and $v \equiv 0$, $\delta(x) = r(x)$. Perturb
# layer $l$ alone: the other layers stay the identity (their $X$ is zero whatever their input), so $v(x)$ changes only
# through layer $l$'s write to query $x$. Perturbing $A_l$ changes $a(z)$ but multiplies it by $X = 0$: no change. A
# perturbation $\varepsilon E$ of $V^{\mathrm{cur}}_l$ (or $V^{\mathrm{tgt}}_l$) adds $\varepsilon E \bar z$ to the column,
# by Proposition 6d.1 (at $A = 0$ the attention is $d_\pi$), and only its value row reaches $v(x)$: so
# $\nabla v(x)$ is $\bar z$ on the value row of both heads of every layer, and zero elsewhere. Then
# $U = \mathbb E \sum_x d_\pi(x) r(x)\, \bar z = \mathbb E[\bar r \bar z]$ there. $\square$
# :::
#
# To first order from a small initialisation, then, the flow $\dot\theta = U(\theta)$ grows the same value row in
# every layer, with no attention: **every layer starts as a uniform level layer** (Proposition 6d.1 says what it
# writes). So the first-order analysis predicts no position for the layer that stays uniform. The check of
# Proposition 6d.3, with one-hot and with random features:

# %%
for feats in ("onehot", "random"):
    t0 = study_tasks(feats)
    D = t0.phi.shape[-1] + 2
    U0 = mean_updates(torch.zeros(3, 3, D, D, dtype=torch.float64), t0)
    r_bar = (t0.d_pi * t0.r).sum(-1)
    phi_bar = (t0.d_pi[..., None] * t0.phi).sum(-2)
    z_bar = torch.cat([phi_bar, r_bar[:, None], torch.zeros_like(r_bar)[:, None]], -1)
    expect = torch.zeros_like(U0)
    expect[:, 1:, -1] = (r_bar[:, None] * z_bar).mean(0)
    test_close(U0, expect, eps=1e-14)

# %% [markdown]
# Beyond first order we have a sketch, not a proof. Along the first step, $\theta_t = t\, U(0)$, a layer's attention
# moves its write to the query by an amount proportional to its own value row, which is $t$ times the same row in
# every layer, and its tokens differ from the raw ones by $O(t)$; so the update on each $A_l$ should be the same in
# every layer up to a relative difference of order $t$, and depth should separate the layers only after that. Measured
# on the study's one-hot tasks at $L = 3$: the largest difference between two layers' $A$-updates, relative to their
# size, falls in proportion to $t$.

# %%
t0 = study_tasks("onehot")
U0 = mean_updates(torch.zeros(3, 3, 12, 12, dtype=torch.float64), t0)
def layer_spread(t:float)->float:
    "max over layers of |U_A(layer) - U_A(layer 1)| / |U_A(layer 1)| at theta = t U(0)."
    UA = mean_updates(t * U0, t0)[:, 0]
    return max((UA[l] - UA[0]).norm().item() for l in (1, 2)) / UA[0].norm().item()
spreads = {t: layer_spread(t) for t in (1e-2, 1e-3, 1e-4)}
ratios = [spreads[1e-2] / spreads[1e-3], spreads[1e-3] / spreads[1e-4]]
assert all(7 < x < 13 for x in ratios), spreads
Markdown(", ".join(f"$t = 10^{{{round(math.log10(t))}}}$: {v:.1e}" for t, v in spreads.items()) +
         f" (each tenfold step in $t$ divides it by between 7 and 13, asserted).")


# %% [markdown]
# `mean_flow` follows the flow itself from $\theta = 0$ by Euler steps, with no optimiser and no sampling: the
# small-initialisation limit of pretraining, on the fixed batch of 64 tasks. It records each layer's population
# diagonality (the mean share of a state's attention on itself; $1/s = 0.1$ for uniform attention).

# %%
#| export
def layer_diagonality(p:torch.Tensor, tasks:TaskBatch)->list:
    "Each layer's population diagonality: the mean share of a query state's attention on its own state."
    _, x = _population(tasks, 1)
    s = tasks.r.shape[-1]
    with torch.no_grad(): atts = token_layers(_params(p[None].double()), p.shape[0], x)[1]
    return [a[0][..., :, s:].diagonal(dim1=-2, dim2=-1).mean().item() for a in atts]

def mean_flow(tasks:TaskBatch,        # the batch of tasks
              n_layers:int,           # depth L
              eta:float=1.,           # Euler step of the flow d theta / dt = U(theta)
              n_steps:int=4000,       # steps
              record_every:int=200,   # steps between records
              start:torch.Tensor=None,# (L, 3, D, D); default zero
             )->dict:                 # t, norms and per-layer diagonality at each record; the last point
    "Euler steps of the mean flow $\\dot\\theta = U(\\theta)$ at $n = \\infty$ (no optimiser, no sampling)."
    D = tasks.phi.shape[-1] + 2
    p = torch.zeros(n_layers, 3, D, D, dtype=torch.float64) if start is None else start.double().clone()
    out = dict(t=[], update_norm=[], param_norm=[], diagonality=[])
    for k in range(check_int(n_steps, "n_steps", 1) + 1):
        U = mean_updates(p, tasks)
        if k % record_every == 0:
            now = (k * eta, U.norm().item(), p.norm().item(), layer_diagonality(p, tasks))
            for key, val in zip(out, now): out[key].append(val)
        p = p + eta * U
    return out | dict(last=p)


# %% [markdown]
# ## Where the layers end up
#
# The saved flows (three layers, one-hot and random features, and two layers with one-hot features), and the
# position of the uniform layer in trained models: chapter 6b's headline configuration (random features $d = 4$,
# $L = 3$, forty seeds: `mechanism_runs.json` and the contest's `contest_runs.json`) and its one-hot cell
# (ten seeds, `contest_runs2.json`), with `layer_anatomy`'s rule (diagonality below `UNIFORM_BELOW`).

# %%
#| export
def uniform_positions(runs:list)->list:
    "The 1-based positions of each saved run's uniform layers (`layer_anatomy`'s rule); runs of one configuration."
    models = load_models(runs)
    tasks = held_out_prompts(models[0][0])[0]
    diag = [learned_kernel(m, tasks).diagonal(dim1=-2, dim2=-1).mean((-2, -1)) for _, m in models]
    return [tuple(int(i) + 1 for i in (d < UNIFORM_BELOW).nonzero().flatten()) for d in diag]


# %%
#| export
def load_stationary(data_dir="data")->dict:
    "The saved study of `run_stationary_study`."
    return json.loads((Path(data_dir) / "stationary_points.json").read_text())


# %%
EXACT_NOTE = ("Its numbers are float64 computations without sampling; another CPU rounds "
              "differently in the last bits, which moves a found zero within the tolerance, "
              "not the verdicts.")

# %%
#| echo: false
study = load_stationary("data")
mech = json.loads(Path("data/mechanism_runs.json").read_text())["runs"]
contest = json.loads(Path("data/contest_runs.json").read_text())
headline = mech["fit"] + mech["fresh"] + contest["cells"]["headline"]["runs"]
onehot_runs = json.loads(Path("data/contest_runs2.json").read_text())["cells"]["one-hot"]["runs"]
positions = {"random features, L = 3": uniform_positions(headline),
             "one-hot, L = 3": uniform_positions(onehot_runs)}
SINGLED_OUT = 0.1   # a layer is singled out by a flow when its diagonality is this far below every other layer's

def singled_out(diag:list):
    "The 1-based layer whose diagonality is at least `SINGLED_OUT` below every other layer's, or None."
    order = sorted(range(len(diag)), key=lambda l: diag[l])
    return order[0] + 1 if diag[order[1]] - diag[order[0]] >= SINGLED_OUT else None

flow_pred = {name: singled_out(f["diagonality"][-1]) for name, f in study["flows"].items()}
Markdown(provenance_note(study["provenance"], "The flows and searches", note=EXACT_NOTE) + " " +
         f"The flows ran {study['flow_steps']} Euler steps of size {study['eta']:g} on {study['tasks']['n_tasks']} tasks.")

# %%
#| code-fold: true
#| fig-cap: "Figure 6d.1: the mean flow from zero makes no layer the uniform one, and trained models put it at layer 1 or 3."
#| fig-alt: "Top: population diagonality of each of three layers against flow time, solid lines for one-hot and dashed for random features, all rising from 0.1; bottom: bars of the share of trained seeds whose single uniform layer is layer 1, 2 or 3, with 95% intervals, for random and one-hot features."
LAYER_STYLE = dict(zip(range(3), zip(OKABE_ITO[:3], ("layer 1", "layer 2", "layer 3"))))
fig, (ax_f, ax_p) = plt.subplots(2, 1, figsize=(6.2, 7.2))
for name, ls in (("onehot, L = 3", "-"), ("random, L = 3", "--")):
    f = study["flows"][name]
    for l, (c, lab) in LAYER_STYLE.items():
        ax_f.plot(f["t"], [d[l] for d in f["diagonality"]], ls, color=c,
                  label=f"{lab}, {name.split(',')[0].replace('onehot', 'one-hot')}")
ax_f.axhline(0.1, color="grey", lw=0.8, ls=":")
ax_f.set(xlabel="flow time t (Euler steps x step size)", ylabel="population diagonality",
         title="(a) mean flow from zero (L = 3)")
ax_f.legend(fontsize=7, ncol=2)
width = 0.38
for j, (fam, pos) in enumerate(positions.items()):
    m = len(pos)
    shares = [rate_interval(sum(p == (l,) for p in pos), m) for l in (1, 2, 3)]
    xs = [l + (j - 0.5) * width for l in (1, 2, 3)]
    ax_p.bar(xs, [s[0] for s in shares], width, color=OKABE_ITO[4 + j], label=f"{fam} ({m} seeds)",
             yerr=[[s[0] - s[1] for s in shares], [s[2] - s[0] for s in shares]], capsize=3)
ax_p.axhline(1 / 3, color="grey", lw=0.8, ls=":", label="one in three")
ax_p.set(xticks=(1, 2, 3), xlabel="position of the single uniform layer",
         ylabel="share of seeds (95% interval)", title="(b) trained models", ylim=(0, 1))
ax_p.legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# **Figure 6d.1.** (a) Each layer's diagonality along the mean flow from $\theta = 0$ (solid: one-hot features,
# dashed: random features), on the study's 64 tasks. (b) Where the single uniform layer of a trained model sits,
# as a share of seeds with its exact 95% interval; seeds with two uniform layers are in neither bar.

# %% [markdown]
# The prediction a flow makes is the layer it singles out, one whose diagonality at the end of the flow is at least
# `SINGLED_OUT` below every other layer's, or none. The flows' last diagonalities, and the trained seeds (rates with
# their exact 95% intervals, against one in three, the share every position would get if it were a fair draw):

# %%
#| echo: false
fam_flow = {"random features, L = 3": "random, L = 3", "one-hot, L = 3": "onehot, L = 3"}
def family_column(fam, pos):
    "One family's entries of the table, top to bottom."
    last, m = study["flows"][fam_flow[fam]]["diagonality"][-1], len(pos)
    counts = {l: sum(p == (l,) for p in pos) for l in (1, 2, 3)}
    pred = flow_pred[fam_flow[fam]]
    rates = ["{:.2f} ({:.2f} to {:.2f})".format(*rate_interval(counts[l], m)) for l in (1, 2, 3)]
    return [", ".join(f"{d:.2f}" for d in last), f"layer {pred}" if pred else "none", str(m), *rates,
            str(m - sum(counts.values()))]

ROWS = ("flow's last diagonality, layers 1, 2, 3", "singled out by the flow", "trained seeds",
        "uniform at layer 1", "uniform at layer 2", "uniform at layer 3", "two uniform layers")
cols = [family_column(fam, pos) for fam, pos in positions.items()]
Markdown("| | " + " | ".join(positions) + " |\n|---|---|---|\n"
         + "\n".join(f"| {name} | " + " | ".join(c[i] for c in cols) + " |" for i, name in enumerate(ROWS)))

# %%
pos_onehot, pos_random = positions["one-hot, L = 3"], positions["random features, L = 3"]
rate_at = lambda pos, l: rate_interval(sum(p == (l,) for p in pos), len(pos))
r_first, r_third, r_mid = (rate_at(pos_random, l) for l in (1, 3, 2))
oh_first = rate_at(pos_onehot, 1)
assert flow_pred["random, L = 3"] == 1 and flow_pred["onehot, L = 3"] is None, flow_pred
assert r_first[1] < 1 / 3 < r_first[2] and r_third[1] < 1 / 3 < r_third[2], (r_first, r_third)
assert r_mid[2] < 1 / 3 and oh_first[1] > 1 / 3, (r_mid, oh_first)

# %%
#| echo: false
oh_last = study["flows"]["onehot, L = 3"]["diagonality"][-1]
Markdown(f"With random features the flow singles out layer 1, but the trained models put their uniform layer there "
         f"at a rate of {r_first[0]:.2f} ({r_first[1]:.2f} to {r_first[2]:.2f}) and at layer 3 equally often "
         f"({r_third[0]:.2f}); what they agree on is that the middle layer is rarely the uniform one "
         f"({r_mid[0]:.2f}, {r_mid[1]:.2f} to {r_mid[2]:.2f}). With one-hot features the trained models choose "
         f"layer 1 ({oh_first[0]:.2f}, {oh_first[1]:.2f} to {oh_first[2]:.2f}), while the flow leaves the three "
         f"layers within {max(oh_last) - min(oh_last):.2f} of each other. So neither the first-order analysis "
         f"(which is symmetric) nor the flow from zero predicts the position, measured on these two families of "
         f"saved runs (Adam, $n = 30$, 2000 steps) against the flow on 64 tasks at $n = \\infty$, followed to "
         f"$t = {study['flows']['onehot, L = 3']['t'][-1]:g}$, where its update norm is still "
         f"{study['flows']['onehot, L = 3']['update_norm'][-1]:.0e}. What the flow leaves out (the initialisation's "
         f"own asymmetry, Adam's per-coordinate steps, sampling at $n = 30$) must decide it; which of them does is "
         f"not separated here.")

# %% [markdown]
# ## Is a level layer followed by TD layers stationary?
#
# Proposition 6d.2 makes the winner of chapter 6b a family of parameters with three constants, the level $\lambda$,
# the kernel scale $\beta$ and the step $\alpha$. `level_td_grid` computes NEU at every point of a grid of them, in
# one batched call; $\lambda = 0$ is $\theta^*$ with one layer fewer. On the study's 64 one-hot tasks:

# %%
tasks = study_tasks("onehot")
family = {L: level_td_grid(tasks, L) for L in (2, 3)}
best = {L: min(rows, key=lambda r: r[3]) for L, rows in family.items()}
no_level = {L: min((r for r in rows if r[0] == 0), key=lambda r: r[3])
            for L, rows in family.items()}
flow_neu = {L: study["flows"][f"onehot, L = {L}"]["update_norm"][-1] ** 2 for L in (2, 3)}
for L in (2, 3): assert best[L][3] > 10 * flow_neu[L], (best[L], flow_neu[L])
assert best[3][3] < no_level[3][3], (best[3], no_level[3])     # at L = 3 a level helps
consts = lambda r: f"({r[0]:g}, {r[1]:g}, {r[2]:g})"
Markdown("| L | best (λ, β, α) | its NEU | best with λ = 0 | its NEU | NEU at the flow's end |\n"
         "|---|---|---|---|---|---|\n" + "\n".join(
             f"| {L} | {consts(best[L])} | {best[L][3]:.2e} | {consts(no_level[L])} | "
             f"{no_level[L][3]:.2e} | {flow_neu[L]:.1e} |" for L in (2, 3)))

# %% [markdown]
# No member of the family is a zero of $U$: its best NEU is more than ten times what the flow from zero reaches
# (asserted), so the flow does not stop at level + TD even where, at $L = 3$, a level improves on $\theta^*$.
# What the update pushes on at the best member, by head (the share of $\|U\|^2$ on each layer's $A$, $V^{\mathrm{cur}}$
# and $V^{\mathrm{tgt}}$):

# %%
U_best = mean_updates(level_td_stack(10, 3, *best[3][:3], 0.9), tasks)
share = U_best.square().sum((-1, -2)) / U_best.square().sum()
Markdown("| layer | A | V_cur | V_tgt |\n|---|---|---|---|\n" +
         "\n".join(f"| {l + 1} | " + " | ".join(f"{x:.2f}" for x in share[l].tolist()) + " |"
                   for l in range(3)))


# %% [markdown]
# ## Zeros of the mean update, found numerically {.deep-dive}
#
# A zero of $U$ is a root of $n$ equations in $n$ unknowns ($n = 864$ at $L = 2$, $1296$ at $L = 3$). `polish`
# runs Levenberg-Marquardt on $U(\theta) = 0$ in float64 with the Jacobian $\partial U / \partial\theta$ by central
# differences (`update_jacobian_fd`, checked against chapter 6b's exact `update_jacobian` in
# [Implementation and tests](#implementation-and-tests)), from several starts: $\theta^*$ and the best level + TD
# member of the table above, the end of the mean flow from zero, two small random initialisations (Xavier, gain 0.1)
# and, at $L = 3$, two models trained in chapter 6b's one-hot cell. A search stops when $\|U\| < 10^{-10}$ or after
# four Jacobians. At a zero the Jacobian's spectrum says what the flow does nearby: an eigenvalue with positive real
# part is a direction the flow leaves along (a saddle); zero eigenvalues are directions of a connected set of zeros.

# %%
#| echo: false
def search_progress(r:dict)->str:
    "A search's row of the first table: where it started and ended."
    return (f"| {r['name']} | {r['n_layers']} | {r['history'][0]:.1e} | {r['history'][-1]:.1e} "
            f"| {len(r['history']) - 1} |")

def search_end(r:dict)->str:
    "A search's row of the second table: how far it moved, and the point it reached."
    spec = r.get("spectrum")
    verdict = (f"{spec['verdict']}: {spec['n_positive']} +, {spec['n_negative']} −, {spec['n_zero']} zero"
               if spec else "—")
    diag = ", ".join(f"{d:.2f}" for d in r["diagonality"])
    return f"| {r['name']} | {r['n_layers']} | {r['moved']:.2f} | {diag} | {verdict} |"

Markdown("| start | L | ‖U‖ at start | ‖U‖ at end | steps |\n|---|---|---|---|---|\n"
         + "\n".join(search_progress(r) for r in study["searches"]))

# %%
#| echo: false
Markdown("| start | L | moved | diagonality per layer | spectrum at the zero |\n|---|---|---|---|---|\n"
         + "\n".join(search_end(r) for r in study["searches"]))

# %%
#| code-fold: true
#| fig-cap: "Figure 6d.2: the norm of the mean update along each Levenberg-Marquardt search, at two and three layers."
#| fig-alt: "Two log-scale panels, L = 2 (top) and L = 3 (bottom), of the update norm against accepted search steps for starts at theta*, level + TD, the mean flow, small random inits and trained models; at L = 2 several curves fall below the dotted 1e-10 line, at L = 3 none does."
KINDS = ("theta*", "level + TD", "mean flow from zero", "small random init", "trained")
fig, axes = plt.subplots(2, 1, figsize=(6.2, 7), sharey=True)
for ax, L in zip(axes, (2, 3)):
    seen = []
    for r in (r for r in study["searches"] if r["n_layers"] == L):
        kind = next(k for k in KINDS if r["name"].startswith(k))
        ls = "--" if kind in seen else "-"
        seen.append(kind)
        ax.semilogy(r["history"], ls, marker=".", color=OKABE_ITO[KINDS.index(kind)],
                    label=r["name"])
    ax.axhline(1e-10, color="grey", lw=0.8, ls=":")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set(xlabel="accepted Levenberg-Marquardt step", ylabel="norm of the mean update ‖U‖",
           title=f"L = {L}")
    ax.legend(fontsize=7)
fig.tight_layout()
plt.show()

# %% [markdown]
# **Figure 6d.2.** The norm of the mean update along each search (dotted: the $10^{-10}$ target).

# %%
#| echo: false
conv = {L: [r for r in study["searches"] if r["n_layers"] == L and r["converged"]] for L in (2, 3)}
tried = {L: sum(r["n_layers"] == L for r in study["searches"]) for L in (2, 3)}
closest3 = min((r for r in study["searches"] if r["n_layers"] == 3), key=lambda r: r["history"][-1])
assert all(r["spectrum"]["verdict"] == "saddle" for L in (2, 3) for r in conv[L])
same = lambda r: all(r["spectrum"][k] == conv[2][0]["spectrum"][k] for k in ("n_positive", "n_negative", "n_zero"))
assert all(same(r) for r in conv[2])   # the counts quoted below hold at every zero found
Markdown(f"At $L = 2$, {len(conv[2])} of {tried[2]} searches reach $\\|U\\| < 10^{{-10}}$, among them the ones "
         f"from {', '.join(sorted({r['name'].split(' (')[0] for r in conv[2]}))}; every zero found is a saddle with "
         f"{conv[2][0]['spectrum']['n_positive']} eigenvalues of positive real part, "
         f"{conv[2][0]['spectrum']['n_negative']} negative and {conv[2][0]['spectrum']['n_zero']} of "
         f"{conv[2][0]['spectrum']['n_params']} (numerically) zero, which suggests the zeros form a connected set "
         f"rather than isolated points. At $L = 3$, {len(conv[3])} of {tried[3]} searches converge within four "
         f"Jacobians; the closest, from a {closest3['name']}, stops at {closest3['history'][-1]:.0e}. The search "
         f"from the end of the flow stays near $10^{{-3}}$ at both depths.")

# %% [markdown]
# The check of every zero in the table: $\|U\|$ recomputed from the saved parameters, and what the model predicts
# there (the largest $|v(x)|$ over tasks and states, against the largest $|v_\pi(x)|$):

# %%
zeros = [r for r in study["searches"] if r["converged"]]
assert zeros, "no search converged"
checks = []
for r in zeros:
    p = torch.tensor(r["params"], dtype=torch.float64)
    norm = update_norm(p, tasks)
    assert norm < 1e-10, (r["name"], norm)
    largest = population_predict(as_model(p), tasks).abs().max().item()
    assert largest < 1e-8, (r["name"], largest)
    checks.append((r["name"], r["n_layers"]))

# %%
#| echo: false
Markdown("At every zero, ‖U‖ recomputed from the saved parameters is below $10^{-10}$ and the largest predicted "
         "value below $10^{-8}$ (both asserted): " + "; ".join(f"{n} ($L = {L}$)" for n, L in checks) +
         f". The largest true value on these tasks is {tasks.v_pi.abs().max().item():.1f}.")

# %% [markdown]
# These are zeros of the update averaged over the study's 64 tasks, not over the prior of tasks. The same parameters
# on 256 fresh one-hot tasks (another seed), against the start of the $\theta^*$ search on the same tasks:

# %%
fresh = random_tasks(256, seed=777, features="onehot")
fresh_at = {r["name"]: update_norm(torch.tensor(r["params"], dtype=torch.float64), fresh)
            for r in zeros}
b2 = best[2]
theta_b2 = torch.stack(theta_star(10, b2[1] * torch.eye(10, dtype=torch.float64), alpha=b2[2],
                                  gamma=0.9))
start_fresh = update_norm(theta_b2.expand(2, 3, 12, 12), fresh)
assert min(fresh_at.values()) > 1e-3, fresh_at

# %%
#| echo: false
Markdown(f"‖U‖ on the fresh tasks: {min(fresh_at.values()):.3f} to {max(fresh_at.values()):.3f} at the zeros, "
         f"{start_fresh:.2f} at $\\theta^*$. A zero of the batch is fitted to its 64 tasks (864 equations whose "
         f"coefficients the batch sets) and is not a zero for others: on fresh tasks the update there is "
         f"{min(fresh_at.values()) / start_fresh:.2f} to {max(fresh_at.values()) / start_fresh:.2f} times its size "
         f"at $\\theta^*$, smaller than there but far from zero.")

# %% [markdown]
# Does a larger batch give zeros closer to those of the prior-averaged update? The same search from the same start
# (the small random initialisation with seed 2, $L = 2$) on the study's seed with 64 and with 256 tasks
# (`run_batch_check`, saved in `stationary_batch.json`), and the update at each zero on the same 256 fresh tasks:

# %%
#| echo: false
batch = json.loads(Path("data/stationary_batch.json").read_text())
bs = batch["searches"]
assert all(r["converged"] for r in bs) and bs[-1]["fresh_norm"] < bs[0]["fresh_norm"] / 2, bs
Markdown(provenance_note(batch["provenance"], "These searches", note=EXACT_NOTE) + "\n\n"
         "| tasks in the batch | ‖U‖ at the end | ‖U‖ on the fresh tasks |\n|---|---|---|\n" +
         "\n".join(f"| {r['n_tasks']} | {r['history'][-1]:.0e} | {r['fresh_norm']:.1e} |" for r in bs) +
         f"\n\nWith {bs[-1]['n_tasks'] // bs[0]['n_tasks']} times the tasks the update at the zero, on fresh tasks, "
         f"is {bs[0]['fresh_norm'] / bs[-1]['fresh_norm']:.1f} times smaller (more than twice, asserted). Measured at "
         f"two batch sizes from one start, this suggests that the zeros of a batch approach zeros of the "
         f"prior-averaged update as it grows, rather than staying a fixed distance away; two sizes give no rate, "
         f"and no search on the prior itself was run.")


# %% [markdown]
# ## What is proved and what is measured
#
# - **Proved** (Propositions 6d.1-6d.3, for any tasks and any number of states and features, at $n = \infty$):
#   a uniform layer writes one vector to every column; a uniform level layer followed by $\theta^*$ layers is TD
#   warm-started at the level; at $\theta = 0$ the mean update grows the same value rows in every layer and nothing
#   else, so the first-order dynamics from a small initialisation favours no layer.
# - **Measured, on the study's fixed batch of 64 one-hot tasks** (and 64 random-feature tasks for one flow): no
#   member of the level + TD grid is a zero of the mean update; the zeros Levenberg-Marquardt reached (at $L = 2$) are
#   saddles of the flow at which the model predicts nothing, whether the search started at $\theta^*$, at level + TD or
#   near zero; they are zeros for that batch only, and on fresh tasks the update there is far from zero, though
#   less so for a zero of a four times larger batch. Whether the
#   update averaged over the prior of tasks has zeros, stable ones included, is not settled: the searches from the
#   flow's end and from trained models did not reach one within four Jacobians, and at $L = 3$ none did.
# - **Measured, on saved trained runs**: where the uniform layer sits (Figure 6d.1 (b)); neither the first-order
#   analysis nor the mean flow from zero predicts it.

# %% [markdown]
# ## Implementation and tests
#
# The Jacobian by central differences, the search, the stability summary, the positions of uniform layers in saved
# runs, and the driver that writes `stationary_points.json`.

# %%
#| export
def update_jacobian_fd(p:torch.Tensor,    # (L, 3, D, D) one parameter set
                       tasks:TaskBatch,   # the batch of tasks
                       h:float=1e-5,      # central-difference step
                       chunk:int=256,     # parameter sets per batched call
                      )->torch.Tensor:    # (n, n) dU/dtheta over the flattened parameters
    "The Jacobian of the mean update by central differences, every perturbed set in batched calls of `mean_updates`."
    n = p.numel()
    E = torch.eye(n, dtype=torch.float64).reshape(n, *p.shape)
    cols = [(mean_updates(p + h * E[i:i + chunk], tasks) - mean_updates(p - h * E[i:i + chunk], tasks)).reshape(-1, n) / (2 * h)
            for i in range(0, n, chunk)]
    return torch.cat(cols).T


# %% [markdown]
# Against chapter 6b's exact `update_jacobian` (forward-mode derivatives of the values) on a small case, four states
# with one-hot features and two layers, after reordering its flattening (head, then layer) to this page's (layer,
# then head); the update itself agrees exactly:

# %%
small = random_tasks(4, seed=3, n_states=4, features="onehot")
small_model = SoftmaxICTD(4, n_layers=2, init_gain=0.5, seed=1)
g_exact, J_exact = update_jacobian(small_model, small)
order = torch.arange(2 * 3 * 36).reshape(2, 3, 6, 6).permute(1, 0, 2, 3).flatten()
J_fd = update_jacobian_fd(layer_stack(small_model), small)
test_close(mean_updates(layer_stack(small_model), small).flatten()[order], g_exact, eps=1e-14)
test_close(J_fd[order][:, order], J_exact, eps=1e-8)


# %%
#| export
def polish(p:torch.Tensor,         # (L, 3, D, D) the start
           tasks:TaskBatch,        # the batch of tasks
           tol:float=1e-10,        # stop when the norm of the mean update is below this
           max_jacobians:int=5,    # Jacobians to compute at most
           steps_per_jacobian:int=20, # Levenberg-Marquardt steps that reuse one Jacobian
          )->tuple:                # (the last point, the update norm after every accepted step)
    "Levenberg-Marquardt on $U(\\theta) = 0$: each step tries a range of damping values on one Jacobian and keeps the best."
    tol, max_jacobians = check_number(tol, "tol", 0, True), check_int(max_jacobians, "max_jacobians", 1)
    p = p.detach().double().clone()
    g = mean_updates(p, tasks).flatten()
    hist = [g.norm().item()]
    damping = 10.0 ** torch.arange(-14., 2.5, 0.5, dtype=torch.float64)
    for _ in range(max_jacobians):
        if hist[-1] < tol: break
        J = update_jacobian_fd(p, tasks)
        lam, Q = torch.linalg.eigh(J.T @ J)
        for _ in range(steps_per_jacobian):
            b = Q.T @ (J.T @ g)
            cands = torch.stack([p - (Q @ (b / (lam + mu))).reshape(p.shape) for mu in damping * lam.max()])
            norms = mean_updates(cands, tasks).flatten(1).norm(dim=-1)
            k = int(norms.argmin())
            if norms[k] >= hist[-1]: break
            ratio = norms[k].item() / hist[-1]
            p = cands[k]; g = mean_updates(p, tasks).flatten(); hist.append(g.norm().item())
            if hist[-1] < tol or ratio > 0.5: break
    return p, hist


# %% [markdown]
# `polish` on a problem with a known root: from a small random point near zero at $L = 2$ with four states it
# reaches the tolerance, and the update there is below it when recomputed.

# %%
p_small, hist_small = polish(layer_stack(SoftmaxICTD(4, n_layers=2, init_gain=0.1, seed=2)), small,
                             max_jacobians=8)
test_eq(hist_small[-1] < 1e-10, True)
test_eq(update_norm(p_small, small) < 1e-10, True)


# %%
#| export
def spectrum_summary(J:torch.Tensor,       # (n, n) Jacobian of the mean update at a stationary point
                     zero_tol:float=1e-7,  # eigenvalues below this times the largest modulus count as zero modes
                    )->dict:
    "Stability of a rest point of $\\dot\\theta = U(\\theta)$: zero modes, eigenvalues with positive real part, and the verdict."
    ev = torch.linalg.eigvals(J)
    scale = ev.abs().max().item()
    zero = ev.abs() < zero_tol * scale
    re = ev.real[~zero]
    n_pos = int((re > 0).sum())
    return dict(n_params=len(ev), n_zero=int(zero.sum()), n_positive=n_pos, n_negative=int((re < 0).sum()),
                max_real=re.max().item(), min_real=re.min().item(), largest_modulus=scale, verdict="saddle" if n_pos else "stable")


# %%
toy = spectrum_summary(torch.diag(torch.tensor([-1., -2., 0.5, 0.], dtype=torch.float64)))
test_eq((toy["verdict"], toy["n_positive"], toy["n_negative"], toy["n_zero"]), ("saddle", 1, 2, 1))
test_eq(spectrum_summary(-torch.eye(3, dtype=torch.float64))["verdict"], "stable")

# %% [markdown]
# `uniform_positions` applies chapter 6b's rule to saved runs; making a trained model's second layer attend
# uniformly ($A = 0$) makes it a uniform layer:

# %%
run0 = copy.deepcopy(onehot_runs[0])
run0["params"]["A"][1] = [[0.] * 12 for _ in range(12)]
test_eq(2 in uniform_positions([run0])[0], True)


# %%
#| export
def _starts(tasks:TaskBatch, L:int, flow_end:torch.Tensor, trained:list)->dict:
    d, best = tasks.phi.shape[-1], min(level_td_grid(tasks, L), key=lambda r: r[3])
    out = {"theta*": torch.stack(theta_star(d, best[1] * torch.eye(d, dtype=torch.float64), alpha=best[2], gamma=tasks.gamma)).expand(L, 3, d + 2, d + 2).clone()}
    out["level + TD"] = level_td_stack(d, L, *best[:3], tasks.gamma)
    out["mean flow from zero"] = flow_end
    for seed in (L, L + 10): out[f"small random init (seed {seed})"] = layer_stack(SoftmaxICTD(d, n_layers=L, init_gain=0.1, seed=seed))
    for i, p in enumerate(trained): out[f"trained (one-hot cell, seed {i})"] = p
    return out

def run_stationary_study(out_dir="nbs/data",        # folder of the JSON file
                         flow_steps:int=6000,       # Euler steps of each mean flow
                         eta:float=0.5,             # Euler step
                         max_jacobians:int=4,       # Jacobians per Levenberg-Marquardt search
                         n_trained:int=2,           # trained one-hot models (L = 3) used as starts
                         command:str="run_stationary_study()", # recorded in the file
                        )->Path:                    # the file written, `stationary_points.json`
    "The mean flows from zero, the level + TD family's NEU, and Levenberg-Marquardt searches for zeros of the mean update from several starts."
    t0 = time.time()
    flows, searches = {}, []
    for feats, L in (("onehot", 2), ("onehot", 3), ("random", 3)):
        fl = mean_flow(study_tasks(feats), L, eta, flow_steps, record_every=max(1, flow_steps // 40))
        flows[f"{feats}, L = {L}"] = {k: v for k, v in fl.items() if k != "last"} | dict(last=fl["last"].tolist())
    runs = json.loads((Path(out_dir) / "contest_runs2.json").read_text())["cells"]["one-hot"]["runs"][:n_trained]
    trained = [layer_stack(m) for _, m in load_models(runs)]
    tasks = study_tasks("onehot")
    for L in (2, 3):
        flow_end = torch.tensor(flows[f"onehot, L = {L}"]["last"], dtype=torch.float64)
        for name, start in _starts(tasks, L, flow_end, trained if L == 3 else []).items():
            t1 = time.time()
            p, hist = polish(start, tasks, max_jacobians=max_jacobians)
            rec = dict(name=name, n_layers=L, history=hist, converged=hist[-1] < 1e-10, start_norm=start.norm().item(), final_norm=p.norm().item(),
                       moved=(p - start).norm().item(), diagonality=layer_diagonality(p, tasks), params=p.tolist())
            if rec["converged"]: rec["spectrum"] = spectrum_summary(update_jacobian_fd(p, tasks))
            searches.append(rec | dict(seconds=time.time() - t1))
    payload = dict(tasks=STUDY_TASKS, eta=eta, flow_steps=flow_steps, max_jacobians=max_jacobians, flows=flows, searches=searches,
                   family={f"L = {L}": level_td_grid(tasks, L) for L in (2, 3)}, seconds=time.time() - t0)
    return atomic_write_text(Path(out_dir) / "stationary_points.json", json.dumps(dict(provenance=provenance(command), **payload)))


# %% [markdown]
# `run_batch_check` repeats one search (from the small random initialisation with seed 2, at $L = 2$) on batches of
# different sizes drawn with the study's seed, and measures the update at each zero on 256 fresh tasks: if the
# zeros of a batch approach zeros of the prior-averaged update as the batch grows, that norm falls with the size.

# %%
#| export
def run_batch_check(out_dir="nbs/data",       # folder of the JSON file
                    sizes=(64, 256),          # batch sizes (tasks drawn with the study's seed)
                    start_seed:int=2,         # seed of the small random initialisation (L = 2)
                    fresh_seed:int=777,       # seed of the 256 fresh tasks
                    max_jacobians:int=6,      # Jacobians per search
                    command:str="run_batch_check()", # recorded in the file
                   )->Path:                   # the file written, `stationary_batch.json`
    "One Levenberg-Marquardt search per batch size from the same start, and the update at each zero on fresh tasks."
    fresh, out = random_tasks(256, seed=fresh_seed, features="onehot"), []
    start = layer_stack(SoftmaxICTD(10, n_layers=2, init_gain=0.1, seed=start_seed))
    for B in sizes:
        t1 = time.time()
        p, hist = polish(start, study_tasks("onehot", n_tasks=B), max_jacobians=max_jacobians)
        out.append(dict(n_tasks=B, history=hist, converged=hist[-1] < 1e-10, fresh_norm=update_norm(p, fresh),
                        params=p.tolist(), seconds=time.time() - t1))
    payload = dict(start_seed=start_seed, fresh_seed=fresh_seed, searches=out)
    text = json.dumps(dict(provenance=provenance(command), **payload))
    return atomic_write_text(Path(out_dir) / "stationary_batch.json", text)


# %% [markdown]
# Bad input:

# %%
zeros_p = lambda D: torch.zeros(2, 3, D, D, dtype=torch.float64)
test_fail(lambda: mean_updates(zeros_p(5), tasks), contains="`p` must be (S, L, 3, D, D)")
test_fail(lambda: mean_updates(zeros_p(12), None), contains="`tasks` must be a TaskBatch")
test_fail(lambda: study_tasks("unit"), contains="`features` must be 'onehot' or 'random'")
test_fail(lambda: layer_stack(SoftmaxICTD(4, n_layers=2, shared=True, seed=0)),
          contains="`model` must have separate layers")
test_fail(lambda: level_td_stack(10, 1, 1., 3., 1., 0.9), contains="`n_layers`")

# %% [markdown]
# The API:

# %%
show_doc(mean_updates)

# %%
show_doc(layer_stack)

# %%
show_doc(level_td_stack)

# %%
show_doc(warm_td_values)

# %%
show_doc(level_td_grid)

# %%
show_doc(mean_flow)

# %%
show_doc(update_jacobian_fd)

# %%
show_doc(polish)

# %%
show_doc(spectrum_summary)

# %%
show_doc(uniform_positions)

# %%
show_doc(run_stationary_study)

# %%
#| export
from ictd.boyan import check_arguments
check_arguments(globals())   # every public function refuses, naming it, an argument its annotation rules out (chapter 0)

# %%
#| hide
import nbdev; nbdev.nbdev_export()
