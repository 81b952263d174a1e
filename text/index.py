# %%
#| hide
import torch
from ictd.boyan import *
from ictd.wstd import weighted_softmax_td

# %% [markdown]
# # ictd: softmax Transformers implement in-context TD
#
# > A literate textbook and Python library: how the forward pass of a standard softmax Transformer runs a temporal-difference algorithm on the trajectory in its prompt.

# %% [markdown]
# Show a pretrained Transformer a trajectory of a Markov reward process it has never seen, ask it
# for the value of a state, and it answers well, without any update of its weights. Which
# reinforcement-learning algorithm is it running? For *linear* attention the answer has been known
# since Wang et al. (ICLR 2025): batch linear TD(0), one iteration per layer. The paper this book is
# built around, *Beyond Linear Attention: Softmax Transformers Implement In-Context Reinforcement
# Learning* (Xie, Liu, Chen, Liu, Chandra and Zhang, arXiv 2605.07333, 2026), answers it for the
# **softmax** attention that real Transformers use: with suitable parameters, each layer performs one
# iteration of **weighted softmax TD**, a TD algorithm in kernel space whose family contains linear TD
# as an exact special case and tabular TD as its sharp-kernel limit (the constructed Transformer itself
# reaches tabular TD in that limit and linear TD only to first order in small scores); the error decays geometrically in depth
# under a kernel-diagonality condition, down to a statistical floor that vanishes as the context
# grows; and, the paper argues, those parameters minimise a TD pretraining loss in the limit of long
# contexts and then deep models, which would explain why they emerge in training.
#
# This book develops each of these results from scratch, in code you can run on a laptop CPU in
# minutes, with a test beside every claim that would fail if the claim were false.

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
chain = random_boyan_chain(n_states=10, d=4, gamma=0.9, features="onehot", seed=0)
states, rewards = sample_trajectory(chain, n=400, seed=0)
n, beta, alpha, L = 200, 5.0, 0.5, 30
W = beta * torch.eye(chain.d, dtype=torch.float64)
values = weighted_softmax_td(chain.phi[states[:n + 1]], rewards[:n], W, alpha, chain.gamma, L, phi_queries=chain.phi)
print(f"MSVE after L = {L} layers: {msve(chain, values[n + 1:]):.4g}")

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
# ## Chapters
#
# 0. [The Boyan chain](boyan.html): Markov reward processes, the random Boyan chain testbed,
#    trajectories, stationary distributions and true values.
#    - 0a. [Many tasks at once](tasks.html): batches of random chains and their trajectories, sampled
#      in lock-step (the data of every experiment).
#    - 0b. [The shared core](core.html): input validation, one seed discipline (sub-streams of a
#      `SeedSequence`), and the batch helpers every module uses.
# 1. [Weighted softmax TD](weighted_softmax_td.html): TD in kernel space, with linear TD as an exact
#    special case, tabular TD as its sharp-kernel limit, and centred linear TD as its small-score expansion.
# 2. [The prompt](prompt.html): a trajectory written as a matrix of tokens.
# 3. [The dual-head softmax layer](dual_head.html): Theorem 1, a softmax Transformer's forward pass
#    is weighted softmax TD.
# 4. [One head and a temporal shift](tsm.html): Theorem 2, the dual-head layer as a single head on a
#    temporally shifted prompt; Theorem 3, a single head followed by a shift, with a memory of TD errors.
#    - 4a. [Decoder-only](causal.html): a causal softmax Transformer whose forward pass is prefix TD, why a
#      masked construction diverges, a causal variant that contracts, streaming with a KV cache, and what
#      pretraining a causal model finds.
# 5. [Convergence](convergence.html): geometric decay in depth, a statistical floor in context
#    length, the kernel-diagonality condition, what it cannot reach, and a weaker condition that does.
# 6. [Pretraining and emergence](pretrain.html): TD pretraining, the norm of the expected update, why
#    the constructed parameters minimise it in the limit, a batched engine that trains many seeds at once.
#    - 6a. [Emergence over seeds](emergence.html): what pretraining finds as distributions over seeds,
#      against baselines, with the ablations where the theory makes a prediction and the order of limits.
#    - 6b. [What the trained models compute](mechanism.html): probes, knockouts and the learned kernel of
#      each layer, an explicit in-context estimator that predicts trained models on unseen seeds, controls
#      trained on other objectives, and the dynamics of pretraining at the constructed parameters.
# 7. [Linear attention, side by side](linear.html): the prior linear-attention construction
#    (batch linear TD), checked, and compared with the softmax construction.
#    - 7a. [Continuous states](continuous.html): kernel TD on processes with continuous states and
#      closed-form values; the bandwidth trade-off; what pretraining learns there.
# 8. [The command line](cli.html): `ictd` reproduces every experiment of the book at full scale.
# 9. [Related work](related.html): kernel-based RL, averagers, kernel LSTD and GPTD, softmax in-context
#    learning as kernel regression, and where linear TD's generalisation through features beats the kernel.

# %% [markdown]
# ## Install and use
#
# ```sh
# pip install -e .          # from a clone; the package is `ictd`
# ```
#
# The `ictd` command reruns the book's experiments at full scale and writes figures and numbers
# (`ictd --help`; for example `ictd pretrain --seed 0 --out results/`). In Python, draw a task and a
# trajectory:

# %%
mrp = random_boyan_chain(n_states=10, d=4, gamma=0.9, seed=0)
states, rewards = sample_trajectory(mrp, n=30, seed=0)
mrp, states[:8].tolist(), rewards[:3].tolist()

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
# The notebooks in `nbs/` are the source; the package `ictd/` is generated from them by
# `nbdev_export`, and each chapter has a plain-text twin under `text/` (jupytext, `make sync`).
# Cells marked `#| slow` run the full-size experiments: `ICTD_SLOW=1 make test`. Speed is measured
# by `make bench` (timings with ratios against baselines measured in the same run), not by tests.
# The project uses nbdev 2 (configured by `settings.ini`); moving to nbdev 3 is
# `nbdev-migrate-config` plus its renamed commands (`nbdev-test`, ...).
