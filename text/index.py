# %%
#| hide
import json, re
from pathlib import Path
import matplotlib.pyplot as plt
import torch
from IPython.display import Markdown
from ictd.boyan import *
from ictd.experiments.convergence import depth_experiment
from ictd.claims import chapter_labels, claims_table
from ictd.core import load_claims
from ictd.wstd import weighted_softmax_td

# %% [markdown]
# # ictd: softmax Transformers implement in-context TD
#
# > A literate textbook and Python library: how the forward pass of a standard softmax Transformer runs a temporal-difference algorithm on the trajectory in its prompt.

# %% [markdown]
# Show a pretrained Transformer a trajectory of a Markov reward process it has never seen, ask it
# for the value of a state, and it answers well, without any update of its weights. Which
# reinforcement-learning algorithm is it running? For *linear* attention the answer has been known
# since [Wang et al. (ICLR 2025)](https://arxiv.org/abs/2405.13861): batch linear TD(0), one iteration
# per layer. The paper this book is built around,
# [*Beyond Linear Attention: Softmax Transformers Implement In-Context Reinforcement Learning*](https://arxiv.org/abs/2605.07333)
# (Xie, Liu, Chen, Liu, Chandra and Zhang, 2026), answers it for the **softmax** attention that real
# Transformers use: with suitable parameters each layer performs one iteration of **weighted softmax TD**,
# a TD algorithm in kernel space; the error decays geometrically in depth under a kernel-diagonality
# condition, down to a statistical floor that shrinks as the context grows; and those parameters minimise
# a TD pretraining loss in the limit of long contexts and then deep models.
#
# **What pretraining produced.** The book proves the first claim, proves and measures the second, and measures the
# third, and there its answer differs from the construction. Transformers pretrained with the TD loss on random Boyan
# chains predict values well, but their parameters are not $\theta^*$, and $\theta^*$ is not a rest point of
# pretraining at the training context length ([chapters 6 to 6d](pretrain.html)). What the trained models compute,
# decided by a contest of algorithms scored on the models' *errors*, is a state-blind level (the context's mean reward,
# scaled) plus a few iterates of weighted softmax TD with a learned kernel: the paper's algorithm at the level of the
# function, reached with other parameters ([chapter 6b](mechanism.html)).
#
# This book develops each of these results from scratch, in code you can run on a laptop CPU in
# minutes, with a test beside every claim that would fail if the claim were false.

# %% [markdown]
# ## The result in one figure
#
# Take random Boyan chains with one-hot features ([chapter 0](boyan.html)), write one trajectory of
# each into a prompt ([chapter 2](prompt.html)), and run the constructed softmax Transformer
# ([chapter 3](dual_head.html)) with more and more layers. Its error against the true values falls
# geometrically with depth, as the population recursion does (black: an infinite context, under the
# contraction bound of [chapter 5](convergence.html), dashed), until it reaches a **statistical floor**
# (dotted): the error of the best answer the context itself supports. A longer context lowers the floor.

# %%
#| echo: false
#| fig-cap: "Figure 1: the constructed softmax Transformer's error falls geometrically with depth, like the population recursion under its contraction bound, down to a statistical floor that a longer context lowers."
#| fig-alt: "Log-scale plot of the sup-norm value error against the number of layers. One coloured curve per context length falls and then flattens at its dotted floor, lower for longer contexts; a black population curve keeps falling, below a dashed straight bound."
hero = depth_experiment(n_tasks=100, ns=(30, 100, 300, 1000), n_layers=60)
depths = torch.arange(hero["errors"].shape[-1])
fig, ax = plt.subplots(figsize=(6.6, 4.2))
for i, n in enumerate(hero["ns"]):
    ax.plot(depths, hero["errors"][:, i].mean(0), color=plt.cm.tab10(i), label=f"context length $n = {n}$")
    ax.axhline(hero["floors"][:, i].mean(), color=plt.cm.tab10(i), ls=":", lw=1.2)
ax.plot(depths, hero["population"].mean(0), color="k", label=r"population ($n = \infty$)")
ax.plot(depths, hero["bound"].mean(0), color="k", ls="--", lw=1, label=r"bound $\kappa^L \|v_\pi\|_\infty$")
ax.set(yscale="log", xlabel="depth $L$ (layers)", ylabel=r"error $\|v_L - v_\pi\|_\infty$ (return units)",
       title=f"Mean over {len(hero['errors'])} random one-hot Boyan chains ($\\beta = {hero['beta']:g}$, $\\alpha = {hero['alpha']:g}$)")
ax.legend(fontsize=9, loc="lower left")
plt.show()

# %% [markdown]
# ## The book in one equation
#
# On the left, one iteration of weighted softmax TD ([chapter 1](weighted_softmax_td.html)): the value of
# every state $x$ moves by a step $\alpha$ along the TD errors
# $\delta_k^{(l)} = R_k + \gamma v_l(S_k) - v_l(S_{k-1})$ of the context's transitions, each weighted by its
# softmax weight $K_k(x) = e^{g(S_{k-1}, x)} / \sum_{k'} e^{g(S_{k'-1}, x)}$, which is large when the
# transition starts in a state similar to $x$ (score $g(y, x) = \phi(y)^\top W \phi(x)$). On the right, one
# layer of a softmax Transformer with two heads: a current-value head, and a target-value head that reads its
# input through the shift $\Pi$ that brings each successor's token to its predecessor's column
# ([chapter 3](dual_head.html)); $S_l$ is the layer's attention matrix.
#
# ::: {.one-equation}
# $$\underbrace{v_{l+1}(x) = v_l(x) + \alpha \sum_{k=1}^{n} K_k(x)\, \delta_k^{(l)}}_{\text{weighted softmax TD}}$$
#
# $$\Longleftrightarrow$$
#
# $$\underbrace{Z_{l+1} = Z_l + V^{\mathrm{cur}} Z_l S_l + V^{\mathrm{tgt}} (Z_l \Pi) S_l}_{\text{a dual-head softmax layer}}$$
# :::
#
# With the constructed parameters $\theta^*$ (scores $z_i^\top A z_j = \phi(S_i)^\top W \phi(x_j)$, and value
# heads that write $\alpha R - \alpha v$ and $\gamma \alpha v'$ into the value row), the value row of $Z_l$ holds
# $v_l$ at every token and every layer: the forward pass *is* the algorithm. The rest of the book asks when
# the iteration converges ([chapter 5](convergence.html)) and whether pretraining finds $\theta^*$
# ([chapter 6](pretrain.html)).

# %% [markdown]
# ## What the book establishes
#
# Each chapter records the claims it checks, with their status, as it executes: **proved** (a proof on the
# page and a check to machine precision), **measured** (a statistic over tasks or seeds, with its
# uncertainty), **partial** (holds only in a regime the chapter names) or **refuted** (the check fails, and
# the chapter says what holds instead). The headline claims, read from those records (`nbs/data/claims/`), not typed:

# %%
#| echo: false
HEADLINE = (("dual_head", "theorem-3.1"), ("tsm", "theorem-4.1"), ("convergence", "contraction-bound"),
            ("convergence_experiments", "floor-slope"), ("emergence", "order-of-limits"), ("emergence", "headline"),
            ("mechanism", "contest"), ("linear_head_to_head", "head-to-head"),
            ("control_transformer", "theorem-9a.1"))   # (chapter, key) of the claims the front page shows

labels, claims = chapter_labels(), load_claims("data/claims")
by_key = {(c["chapter"], c["key"]): c for c in claims}
Markdown(claims_table([by_key[k] for k in HEADLINE], labels)
         + f"\n\nThese are {len(HEADLINE)} of the {len(claims)} claims the chapters record. All of them, chapter by chapter "
           "and with counts by status, are in [the claims ledger](claims.html).")

# %% [markdown]
# ## Reading paths
#
# The chapters build on one another in the order of the sidebar, but not every reader needs all of them.
# Each path below assumes the one before it; the first assumes only TD(0) and what attention computes.

# %%
#| echo: false
PATHS = {"**The core** (the thesis and its proof): the testbed, the algorithm, the prompt, the layer, convergence and the experiments that test it. Prerequisites: TD(0) and attention.": ("0", "1", "2", "3", "5", "5a"),
         "**Training** (does pretraining find the construction?). Prerequisite: the core.": ("6", "6a", "6b", "6c", "6d"),
         "**Extensions** (worst cases of convergence, one head with a shift, decoder-only models, linear attention, continuous states). Prerequisite: the core; chapters 7a and 8b also use chapter 6.": ("5b", "4", "4a", "7", "7a", "7b", "8", "8a", "8b"),
         "**In-context control** (softmax attention takes the max: a Transformer that runs Q-learning in context, when it converges, and how well it acts). Prerequisite: the core.": ("9", "9a", "9b", "9c", "9d"),
         "**Reproducing the experiments** at full scale from the command line. Prerequisite: none.": ("F",),
         "**Checking the book**: every claim it records, chapter by chapter, with its status and its check. Prerequisite: none.": ("I",)}

def reading_paths(paths, labels):
    "Each reading path as a Markdown list item linking its chapters (found by number) in order."
    by_number = {label.split(" ", 1)[0]: (page, label) for page, label in labels.items()}
    first = [f"[{label}]({page}.html)" for page, label in labels.items() if not re.match(r"([0-9]+|[A-Z])[a-z]? ", label)]  # the notation page
    return (f"- **Before you start**: " + ", ".join(first) + "\n" if first else "") + "\n".join(f"- {text}\n  " + " &rarr; ".join(f"[{by_number[n][1]}]({by_number[n][0]}.html)" for n in nums if n in by_number)
                     for text, nums in paths.items())

Markdown(reading_paths(PATHS, labels))

# %% [markdown]
# ## Weighted softmax TD in your browser
#
# On the book's website (`_docs/index.html` after `make docs`; README.md leaves the figure out) you can move
# the controls of the figure below to see how the algorithm of [chapter 1](weighted_softmax_td.html) behaves. The
# figure runs weighted softmax TD in the page, on a random Boyan chain with ten states
# ([chapter 0](boyan.html)) and one trajectory of it, with scores $\phi(x)^\top W \phi(y)$ for $W = \beta I$
# and step size $\alpha$. Each layer of the constructed Transformer is one iteration
# ([chapter 3](dual_head.html)), so the depth $L$ is the number of iterations. The figure draws three things:
#
# - **Values by state**: the estimates $v_L(x)$ at the ten states, read out as queries, against the true values $v_\pi(x)$.
# - **Error against depth**: the mean squared value error $\sum_x d_\pi(x) (v_l(x) - v_\pi(x))^2$ of every layer $l \le L$.
# - **Attention**: the heat map $\hat M(x, y)$, the softmax weight that a query in state $x$ puts on the transitions
#   leaving state $y$ (the aggregated attention of [chapter 5](convergence.html)). Its diagonal is what the
#   kernel-diagonality condition of that chapter asks to exceed $(1 + \gamma)/2$.
#
# The feature kinds are those of `random_boyan_chain`: one-hot, random rows of unit norm, and random entries in
# $U(-1, 1)$ ($d = 4$). With one-hot features a large $\beta$ gives batch tabular TD, whose error
# [chapter 5](convergence.html) shows falling geometrically in depth down to a floor set by the context length
# $n$. With $\beta = 0$ every query weighs all transitions equally. The chains and trajectories are exported from Python (`tools/explorable_data.py`), so
# the page computes on the library's own numbers. The page's JavaScript port of `weighted_softmax_td` is
# `window.ictd.weightedSoftmaxTD(phiStates, rewards, W, alpha, gamma, nIters, phiQueries)`: plain nested arrays
# in, and out the values at the $n + 1$ trajectory states followed by the queries, as the library returns them
# (with $\rho = 1$ and scores $\phi(x)^\top W \phi(y)$). The browser test checks it against the library to
# $10^{-9}$ on random contexts.

# %% [markdown]
# <!-- site only: the interactive figure (js/explorable.js); README.md leaves this cell out -->
# <div id="wstd-explorable" class="wstd-explorable">The interactive figure needs JavaScript.</div>
# <script src="js/d3.min.js"></script>
# <script src="js/plot.umd.min.js"></script>
# <script src="js/wstd.js"></script>
# <script src="js/wstd-data.js"></script>
# <script src="js/explorable.js"></script>

# %% [markdown]
# The figure starts at seed 0, one-hot features, $\beta = 5$, $\alpha = 0.5$, $L = 30$ and $n = 200$. The
# same computation in Python, with the library, gives the error that the figure prints below its plots:

# %%
import torch
from ictd import msve, random_boyan_chain, sample_trajectory, weighted_softmax_td

# %%
chain = random_boyan_chain(n_states=10, d=4, gamma=0.9, features="onehot", seed=0)
states, rewards = sample_trajectory(chain, n=400, seed=0)
n, beta, alpha, L = 200, 5.0, 0.5, 30
W = beta * torch.eye(chain.d, dtype=torch.float64)
values = weighted_softmax_td(chain.phi[states[:n + 1]], rewards[:n], W, alpha=alpha, gamma=chain.gamma, n_iters=L,
                             phi_queries=chain.phi, queries_only=True)
print(f"MSVE after L = {L} layers: {msve(values, chain):.4g}")

# %% [markdown]
# ## A note on sources
#
# **The paper's full text was not available to the authors of this book**: only its abstract and
# summaries of it. The book states the paper's claims as claims of the paper. Every exact
# construction here (the precise form of weighted softmax TD, the prompt layout, the parameters
# $\theta^*$ of the dual-head layer, the temporal-shift reparametrisation, the contraction
# constant) is **the book's own**, chosen to satisfy every claim of the paper, proved in the
# chapter that introduces it, and checked numerically. Nothing here is a quotation of the paper,
# and where our construction may differ from the paper's, the chapter says so.

# %% [markdown]
# ## Install and use
#
# ```sh
# pip install -e .          # from a clone; the package is `ictd`
# ```
#
# The `ictd` command reruns the book's experiments at full scale and writes figures and numbers
# (`ictd --help`, and [appendix F](cli.html)). For example `ictd pretrain --seeds 0-9 --out results/` trains chapter 6's
# model on ten seeds in one batched run and writes, in `results/<key>/` (`<key>` a hash of the configuration and the
# source): `config.json`, per seed `seed-S.pt` (the trained parameters and history, `torch.load(..., weights_only=True)`),
# `seed-S.json` and `seed-S.png`, and over the seeds `summary.json` and `summary.png` (value error, NEU, the last
# layer's value weights and kernel diagonality against training step), with chapter 6a's report in `emergence/`. One
# seed alone is one draw: its last layer's weights may sit far from the $-\gamma$ line of chapter 6's figures, which is
# why the book states every training result over seeds. In Python, the book's main names import from the top of the
# package ([appendix H](api.html) lists them); draw a task and a trajectory:

# %%
from ictd import random_boyan_chain, sample_trajectory

# %%
mrp = random_boyan_chain(n_states=10, d=4, gamma=0.9, seed=0)
states, rewards = sample_trajectory(mrp, n=30, seed=0)
mrp, states[:8].tolist(), rewards[:3].tolist()

# %% [markdown]
# and, in a snippet that runs on its own, build the constructed Transformer $\theta^*$ of chapter 3, read its values
# off a prompt of that context, and score them:

# %%
import torch
from ictd import Prompt, SoftmaxICTD, msve, random_boyan_chain, sample_trajectory

# %%
mrp = random_boyan_chain(n_states=10, d=4, gamma=0.9, seed=0)
states, rewards = sample_trajectory(mrp, n=30, seed=0)
model = SoftmaxICTD.from_theta_star(4, 2 * torch.eye(4, dtype=torch.float64), n_layers=3, alpha=0.5, gamma=mrp.gamma)
v_model = model.predict(Prompt.build(mrp.phi[states], rewards, mrp.phi), grad=False)   # one value per state
print(f"MSVE of theta* (L = 3) on this context: {msve(v_model, mrp):.3f}")

# %% [markdown]
# ## Build the book and run the tests
#
# Two commands do all of the set-up on a fresh machine with Python 3.10+ (they create `.venv`,
# install PyTorch 2.13.0 and then the package with its development tools):
#
# ```sh
# make docs   # execute every chapter, then build the site into _docs/
# make test   # the whole test suite: library and notebooks in sync, every chapter's tests, tests/
# ```
#
# `make site` rebuilds the site from the outputs already saved in the notebooks, without executing them (seconds).
# The two commands' wall times on a fresh clone, as `make fresh-clone` last measured them:

# %%
#| echo: false
fresh_file = next((p for p in (Path("data/fresh_clone.json"), Path("nbs/data/fresh_clone.json")) if p.exists()), None)
fresh = json.loads(fresh_file.read_text()) if fresh_file else None
Markdown(f"`make docs` took {fresh['make docs']['seconds'] / 60:.0f} min and `make test` {fresh['make test']['seconds'] / 60:.0f} min "
         f"({'both passed' if fresh['make test']['passed'] else 'make test: ' + fresh['make test']['result']}; commit `{fresh['provenance']['commit'][:10]}`, {fresh['provenance']['date'][:10]}, {fresh['provenance']['cpu']}, "
         f"{fresh['cores']} cores)." if fresh else "Not measured yet on this checkout: `make fresh-clone` measures it.")

# %% [markdown]
# The notebooks in `nbs/` are the source; the package `ictd/` is generated from them by
# `nbdev_export`, and each chapter has a plain-text twin under `text/` (jupytext, `make sync`).
# Cells marked `#| slow` run the full-size experiments: `ICTD_SLOW=1 make test`. Speed is measured
# by `make bench` (timings with ratios against baselines measured in the same run), not by tests.
#
# *Claims that survive another CPU.* The last bits of a float64 result differ between CPU types, so the book asserts
# only what survives rounding. `ICTD_PERTURB=1e-9 make test` (or `make test-perturbed`, the claims tier and every
# chapter's checks) multiplies every initial parameter of every training run by $1 + 10^{-9}\,\xi$, $\xi \sim N(0, 1)$
# from a fixed stream ([appendix A](core.html#the-rounding-nudge-claims-that-survive-another-cpu)); a claim that flips
# under it is not a claim. `make test-other-kernels` rebuilds the fast chapters with another set of torch's CPU kernels
# than the machine's default (AVX2 on an AVX-512 CPU, unvectorised ones on an AVX2 CPU), so a printed digit that depends
# on the kernels' rounding fails; figures are compared as pixels, where such rounding can flip the anti-aliasing of a few
# of them. The chapters that train in the page say so where their digits are draws: on another CPU type `make docs` may
# rewrite those digits (and a few pixels), within the statistics' standard errors. `make fresh-clone` runs, on a fresh clone, what CI
# runs and then `make docs`, which must leave the committed files unchanged. CI runs `make test`, `make test-perturbed` and `make test-other-kernels`.
# The project uses nbdev 2 (configured by `settings.ini`); moving to nbdev 3 is
# `nbdev-migrate-config` plus its renamed commands (`nbdev-test`, ...).
