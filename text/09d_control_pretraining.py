# %%
#| default_exp experiments.control_pretraining

# %%
#| export
from __future__ import annotations
import argparse, dataclasses, json, math, sys, time
from dataclasses import dataclass
from pathlib import Path
import numpy as np
import torch
from tqdm.auto import tqdm
from ictd.boyan import _stationary
from ictd.core import (atomic_write_text, check_choice, check_int, check_number, check_seeds,
                       check_type, jsonable, nudge, provenance, run_stream)
from ictd.control import MDP, random_mdp, q_star, q_pi, uniform_policy
from ictd.control_model import ControlICTD, build_control_prompt
from ictd.control_acting import greedy_returns, pair_token_q_iteration

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *

# %%
#| hide
import matplotlib.pyplot as plt
from IPython.display import Markdown
import re
from ictd.core import OKABE_ITO, provenance_note, record_claim
from ictd.control_model import control_masks, control_pair_update, control_theta_star

# %%
#| hide
torch.set_num_threads(1)

# %% [markdown]
# # Pretraining for control
# > The three-head Transformer of chapter 9a trained from random initialisation with a Q-learning TD objective on random MDPs: does the max head emerge, and does the trained model act well on unseen MDPs? Against an expected-SARSA objective, a shuffled-reward control and the construction, over 10 seeds.

# %% [markdown]
# ::: {.callout-tip title="What this page shows"}
# - A Q-learning TD objective for [9a](control_transformer.html)'s Transformer, trained from a random start
#   on random MDPs (10 seeds), against expected SARSA and a shuffled-reward control at the same budget.
# - Whether the backup heads learn to read the value row and attend to the successor's best action.
# - How well the trained models act on unseen MDPs, beside the construction and Q-iteration.
# :::
#
# Chapters 9 to 9c *construct* a softmax Transformer that runs kernel soft Q-iteration; as chapter 6 did
# for evaluation, this page asks whether TD pretraining finds it. The objective, protocol, measures and
# results are the book's own experiment: the paper is about policy evaluation and trains nothing for
# control. The saved study (10 seeds, three objectives) is read from `nbs/data/control_pretrain.json`;
# the training loop, its fast forward pass, a small live run and every check are in
# [Implementation and tests](#implementation-and-tests).

# %% [markdown]
# ## The objective
#
# A training example is a context of $n$ transitions of a random MDP under the uniform behaviour,
# followed by one more transition $(S_n, A_n, R_{n+1}, S_{n+1})$. The prompt of
# [9a](control_transformer.html#the-prompt) holds the context and two query blocks, one for $S_n$ and
# one for $S_{n+1}$, each with all $A$ actions. The model's values there are
# $\mathrm{TF}(S_n, a)$ and $\mathrm{TF}(S_{n+1}, a')$, and the semi-gradient loss is
#
# $$\ell(\theta) = \tfrac12 \Big(R_{n+1} + \gamma\, \mathrm{sg}\big[B\big(\mathrm{TF}_\theta(S_{n+1}, \cdot)\big)\big]
# - \mathrm{TF}_\theta(S_n, A_n)\Big)^2,$$
#
# with $\mathrm{sg}$ a stopped gradient, as chapter 6's TD objective, and $B$ the backup of the
# objective: $B = \max$ for **Q-learning** (`"q"`), the mean $\frac1A\sum_{a'}$ for **expected
# SARSA** of the uniform behaviour (`"expected"`), and, as a control, the max with the query rewards
# $R_{n+1}$ shuffled within each batch (`"shuffled"`), which keeps the data and breaks the link between
# a context and its target. Trained to zero loss in expectation, the Q-learning model's output would
# satisfy the Bellman optimality equation of each MDP; the expected-SARSA model's, the uniform policy's.

# %%
#| export
CONTROL_OBJECTIVES = ("q", "expected", "shuffled")   # max, mean, max with shuffled rewards

def control_td_targets(rewards,         # (...) the rewards R_{n+1} of the query pairs
                       q_next,          # (..., A) the model's values at the successor's actions
                       gamma:float,     # discount factor
                       objective:str,   # one of `CONTROL_OBJECTIVES`
                      )->torch.Tensor:  # (...) r + gamma B(q_next), detached
    ("The TD target of `objective`: $r + \\gamma \\max_{a'} q$ ('q', 'shuffled') or "
     "$r + \\gamma\\, \\mathrm{mean}_{a'} q$ ('expected').")
    objective = check_choice(objective, CONTROL_OBJECTIVES, "objective")
    q_next = q_next.detach()
    return rewards + gamma * (q_next.mean(-1) if objective == "expected" else q_next.amax(-1))


# %% [markdown]
# On a hand-computed case the two backups are the max and the mean of the successor's values, and no
# gradient flows through the target:

# %%
q_succ = torch.tensor([[1.0, -2.0, 0.5], [0.0, 3.0, 3.0]], dtype=torch.float64, requires_grad=True)
r_q = torch.tensor([0.25, -1.0], dtype=torch.float64)
f64 = lambda *x: torch.tensor(x, dtype=torch.float64)
test_close(control_td_targets(r_q, q_succ, 0.9, "q"), f64(0.25 + 0.9 * 1.0, -1.0 + 0.9 * 3.0),
           eps=1e-15)
test_close(control_td_targets(r_q, q_succ, 0.9, "expected"),
           f64(0.25 + 0.9 * (-0.5 / 3), -1.0 + 0.9 * 2.0), eps=1e-15)
assert not control_td_targets(r_q, q_succ, 0.9, "q").requires_grad

# %% [markdown]
# ## The protocol
#
# `ControlPretrainConfig` holds a run's settings. The defaults are small on purpose: MDPs of
# `random_mdp` with $S = 4$ states, $A = 2$ actions and action rewards $r(s, a) \sim U(-1, 1)$ (9b's first
# kind), one-hot pair features ($d = SA = 8$, tokens of $d + 4 = 12$ rows), $\gamma = 0.9$, contexts of
# $n = 20$ transitions, $L = 3$ layer pairs, free parameters from 9a's Xavier initialisation (gain 0.1),
# Adam with learning rate $10^{-2}$, batches of 32, 600 steps. Each seed has its own pool of 1000
# training MDPs and 64 held-out MDPs with one context each; its streams (pool, initialisation, data,
# shuffling, held-out MDPs and contexts) are appendix A's named streams of the seed, so the three
# objectives of one seed see the same MDPs, contexts and starting point. A second study with state
# rewards ($r(s, a) = r(s)$, where only the successors separate the actions) is reported
# [at the end](#with-state-rewards).
#
# The model is 9a's: $L$ pairs of a backup layer and a TD layer, each pair five $(d+4) \times (d+4)$
# matrices. Its forward pass here computes only the logits that 9a's masks leave ($N A$ and $n N$
# scores instead of $2N^2$), for every seed at once, and equals 9a's `control_pair_update` to rounding
# error. `train_control` is a small batched loop in the manner of chapter 6's engine: each seed has
# its own parameters, generators and pool, the loss is summed over seeds and Adam is entry-wise, so
# the seeds do not interact (the engine itself holds Markov *reward* processes and chapter 6's four
# evaluation targets, and has no number of actions).

# %% [markdown]
# ## What is measured
#
# On each seed's held-out MDPs (one context of $n$ transitions each, every state a query block), at
# every evaluation:
#
# - the **value-reading score** of each backup head, $\beta_{\mathrm{eff}} = e_{d+1}^\top A_b z_j$
#   averaged over the context columns $j$: the coefficient with which a key's value row enters the
#   head's logit. The construction has exactly $\beta$ there; a head blind to the values has 0.
# - the **attention mass on the argmax**: each context column's backup weight on the action of its
#   successor block that has the largest entry in the value row entering the layer (the construction's
#   reading), and, separately, on the action that is best under the MDP's true $q_*$. Uniform
#   attention puts $1/A$ on either. Layer 1 is left out of the first measure: its value row is still 0.
# - the **normalised return** of the greedy policy of the model's query values,
#   $(J - J_{\mathrm{unif}}) / (J_* - J_{\mathrm{unif}})$, as in 9b, and the model's error against $q_*$
#   and against the uniform policy's $q_{\mathrm{unif}}$.
#
# On the construction (9a's parameters at $\beta = 5$) every backup head scores exactly 5 and puts
# more than half its mass on the best action ([checked below](#the-measures)).

# %% [markdown]
# ## The study
#
# The study's driver trains 10 seeds with each of the three objectives (the same seeds, so
# the same MDPs, contexts and initialisations), evaluates them every 100 steps, and adds on the same
# held-out contexts: the **constructed Transformer** of 9a ($W = 20 I$, $\alpha = 1$, $\beta = \infty$,
# the same depth $L$; computed exactly by 9b's `pair_token_q_iteration`), the same construction with
# $\beta = 0$ (expected SARSA of the uniform policy), with $\beta = 1$ and $\beta = 4$, the
# myopic policy ($L = 1$), and batch tabular Q-iteration run to convergence on the context
# (certainty equivalence: the optimal policy of the context's empirical MDP). The command
# `python -m ictd.experiments.control_pretraining --out nbs/data` writes `nbs/data/control_pretrain.json`
# with its provenance; this page reads it.

# %%
#| code-fold: true
#| code-summary: "Code: read the study"
study = json.loads(Path("data/control_pretrain.json").read_text())
prov, cfg_study = study["provenance"], study["config"]
runs = {k: {m: np.array(v) for m, v in r.items()} for k, r in study["runs"].items()}
base = {k: np.array(v) for k, v in study["baselines"].items()}
steps, n_seeds = np.array(study["steps"]), len(study["seeds"])
mse = lambda x: (x.mean(0), x.std(0, ddof=1) / math.sqrt(x.shape[0]))
fmt = lambda x: f"{x.mean():.3f} ± {x.std(ddof=1) / math.sqrt(len(x)):.3f}"
NAMES = dict(q="Q-learning (max)", expected="expected SARSA (mean)",
             shuffled="max, shuffled rewards")
Markdown(provenance_note(prov, "The study's numbers")
         + f" It took {prov['wall_s']:.0f} s on one thread: "
         f"{n_seeds} seeds, {cfg_study['n_steps']} steps per objective, "
         f"$S = {cfg_study['n_states']}$, $A = {cfg_study['n_actions']}$, "
         f"$n = {cfg_study['n']}$, $L = {cfg_study['n_layers']}$, "
         f"learning rate {cfg_study['lr']:g}.")


# %% [markdown]
# ### (a) Does the max head emerge?

# %%
#| fig-cap: "Figure 9d.1: The value-reading score of the last layer's backup head during training, 10 seeds per objective (mean ± one standard error)."
#| fig-alt: "The value-reading score against the training step: it rises from near 0 for Q-learning and stays near 0 for expected SARSA and the shuffled control."
def training_curves(ax, key, layer=-1):
    "Mean ± one standard error over seeds of the measure `key` of `layer`, one line per objective."
    for i, (k, lab) in enumerate(NAMES.items()):
        mu, se = mse(runs[k][key][:, :, layer])
        ax.plot(steps, mu, "o-", ms=3, color=OKABE_ITO[i], label=lab)
        ax.fill_between(steps, mu - se, mu + se, color=OKABE_ITO[i], alpha=0.25)

fig, ax = plt.subplots(figsize=(6, 3.4))
training_curves(ax, "beta_eff")
ax.axhline(0, color="k", lw=0.6)
ax.set(xlabel="training step", ylabel=r"value-reading score $\beta_{\mathrm{eff}}$",
       title=f"last backup head (layer {cfg_study['n_layers']})")
ax.legend(fontsize=8);

# %%
#| fig-cap: "Figure 9d.2: The last backup head's attention mass on the action that is best under the value row it reads, 10 seeds per objective (mean ± one standard error), against the 1/A of uniform attention."
#| fig-alt: "The attention mass on the argmax action against the training step: it rises above the dashed 1/A line for Q-learning only."
fig, ax = plt.subplots(figsize=(6, 3.4))
training_curves(ax, "mass_value")
ax.axhline(1 / cfg_study["n_actions"], color="k", ls="--", lw=0.8, label="uniform attention, 1/A")
ax.set(xlabel="training step", ylabel="attention mass on the argmax",
       title="mass on the value row's best action")
ax.legend(fontsize=8);

# %%
#| code-fold: true
#| code-summary: "Code for the table"
L_ = cfg_study["n_layers"]
measures = ([(f"value-reading score, layer {l + 1}", "beta_eff", l) for l in range(L_)]
            + [(f"mass on value argmax, layer {l + 1}", "mass_value", l) for l in range(1, L_)]
            + [(f"mass on $q_*$ argmax, layer {l + 1}", "mass_qstar", l) for l in range(L_)])
Markdown(f"After {cfg_study['n_steps']} steps (mean ± standard error over {n_seeds} seeds; "
         f"uniform attention: {1 / cfg_study['n_actions']:g}):\n\n"
         "| measure | " + " | ".join(NAMES.values()) + " |\n|---|---|---|---|\n"
         + "\n".join(f"| {m} | " + " | ".join(fmt(runs[k][key][:, -1, l]) for k in NAMES) + " |"
                     for m, key, l in measures))

# %% [markdown]
# ### (b) Do the trained models act well on unseen MDPs?

# %%
#| fig-cap: "Figure 9d.3: Normalised return of the greedy policy on each seed's 64 held-out MDPs during training (mean ± one standard error over 10 seeds), against the constructed Transformer at the same depth and certainty equivalence on the same contexts."
#| fig-alt: "Normalised return against the training step for the three objectives, with horizontal lines for the construction at beta = infinity and beta = 0 and for tabular Q-iteration to convergence."
fig, ax = plt.subplots(figsize=(6, 3.8))
for i, (k, lab) in enumerate(NAMES.items()):
    mu, se = mse(runs[k]["norm_return"])
    ax.plot(steps, mu, "o-", ms=3, color=OKABE_ITO[i], label=f"trained: {lab}")
    ax.fill_between(steps, mu - se, mu + se, color=OKABE_ITO[i], alpha=0.25)
lines = (("construction_inf", rf"construction, $\beta = \infty$ (L = {L_})"),
         ("construction_0", rf"construction, $\beta = 0$ (L = {L_})"),
         ("certainty_equivalence", "Q-iteration to convergence"))
for j, (k, lab) in enumerate(lines):
    ax.axhline(base[k].mean(), color=OKABE_ITO[4 + j], ls="--", lw=1, label=lab)
ax.axhline(0, color="k", lw=0.6)
ax.set(xlabel="training step", ylabel="normalised return\n(0: uniform behaviour, 1: optimal)",
       title="Acting on held-out MDPs")
ax.legend(fontsize=7.5, loc="lower right");

# %%
#| code-fold: true
#| code-summary: "Code for the table"
final = {k: runs[k]["norm_return"][:, -1] for k in NAMES}
BASE_NAMES = dict(construction_inf="construction, $\\beta = \\infty$",
                  construction_4="construction, $\\beta = 4$",
                  construction_1="construction, $\\beta = 1$",
                  construction_0="construction, $\\beta = 0$ (expected SARSA)",
                  myopic="myopic ($L = 1$)", certainty_equivalence="Q-iteration to convergence")
diff = lambda a, b: f"{(a - b).mean():+.3f} ± {(a - b).std(ddof=1) / math.sqrt(len(a)):.3f}"
ref = base["construction_inf"]
Markdown("Normalised return after training, mean ± standard error over seeds (each seed: its 64 "
         "held-out MDPs):\n\n| policy | normalised return | minus construction $\\beta = \\infty$ "
         "(paired) |\n|---|---|---|\n"
         + "\n".join(f"| trained, {NAMES[k]} | {fmt(final[k])} | {diff(final[k], ref)} |"
                     for k in NAMES) + "\n"
         + "\n".join(f"| {v} | {fmt(base[k])} | {diff(base[k], ref)} |"
                     for k, v in BASE_NAMES.items()))

# %% [markdown]
# ### What the trained models compute
#
# Errors against the truth: the root-mean-square error of each model's query values against the MDP's
# $q_*$ and against the uniform policy's $q_{\mathrm{unif}}$, beside those of the construction at
# four inverse temperatures (the construction has no constant to fit: $W = 20I$, $\alpha = 1$ are
# 9b's). A model that learned Q-learning should be nearer $q_*$ than $q_{\mathrm{unif}}$, and one that
# learned expected SARSA the reverse.

# %%
#| code-fold: true
#| code-summary: "Code for the table"
err_rows = [(f"trained, {NAMES[k]}", runs[k]["err_qstar"][:, -1], runs[k]["err_qunif"][:, -1])
            for k in NAMES]
err_rows += [(BASE_NAMES[k], base[f"err_qstar_{k}"], base[f"err_qunif_{k}"])
             for k in ("construction_inf", "construction_4", "construction_1", "construction_0")]
Markdown("| values | RMS error to $q_*$ | RMS error to $q_{\\mathrm{unif}}$ "
         "| difference (paired) |\n|---|---|---|---|\n"
         + "\n".join(f"| {name} | {fmt(a)} | {fmt(b)} | {diff(a, b)} |" for name, a, b in err_rows))

# %% [markdown]
# ## Answers
#
# The claims are asserted on the saved file (the tests recompute them on seeds the book does not show):

# %%
#| code-fold: true
#| code-summary: "Code for the answers"
n_a = cfg_study["n_actions"]
mq, me, ms = (runs[k]["mass_value"][:, -1, -1] for k in ("q", "expected", "shuffled"))
bq, be = runs["q"]["beta_eff"][:, -1, -1], runs["expected"]["beta_eff"][:, -1, -1]
se_ = lambda x: x.std(ddof=1) / math.sqrt(len(x))
emerged = (mq - 1 / n_a).mean() > 3 * se_(mq) and (mq - me).mean() > 3 * se_(mq - me)
answer_a = ("**(a) The max head emerges.** Under the Q-learning objective the last backup "
            f"head's value-reading score grows to {fmt(bq)} (expected SARSA: {fmt(be)}), and its "
            f"attention mass on the value row's best action reaches {fmt(mq)}, above the uniform "
            f"{1 / n_a:g} and above the expected-SARSA models' {fmt(me)} and the shuffled "
            f"control's {fmt(ms)} (each by more than three standard errors).") if emerged else (
            "**(a) The max head does not emerge** by the page's criterion (mass on the argmax "
            "above $1/A$ and above the expected-SARSA model's by three standard errors): "
            f"Q-learning {fmt(mq)}, expected SARSA {fmt(me)}, shuffled {fmt(ms)}.")
answer_b = (f"**(b) Acting.** The Q-learning-trained models reach a normalised return of "
            f"{fmt(final['q'])}, against {fmt(base['construction_inf'])} for the construction at "
            f"the same depth, {fmt(base['certainty_equivalence'])} for Q-iteration to convergence, "
            f"{fmt(final['expected'])} for the expected-SARSA-trained models and "
            f"{fmt(final['shuffled'])} for the shuffled control (paired difference Q-learning "
            f"minus expected SARSA: {diff(final['q'], final['expected'])}).")
Markdown(answer_a + "\n\n" + answer_b)

# %%
assert (final["q"] - final["shuffled"]).mean() > 3 * se_(final["q"] - final["shuffled"])
eq, ee = runs["q"]["err_qstar"][:, -1], runs["expected"]["err_qstar"][:, -1]
assert (ee - eq).mean() > 3 * se_(ee - eq)                            # Q-learning models nearer q*
side = runs["expected"]["err_qstar"][:, -1] - runs["expected"]["err_qunif"][:, -1]
assert side.mean() > 3 * se_(side)                                    # expected SARSA nearer q_unif
record_claim("objectives-split",
             "Trained from a random start on random MDPs (10 seeds, same budget), Q-learning "
             "models' values are nearer $q_*$ than expected-SARSA models' (paired, three standard "
             "errors), and expected-SARSA models' values are nearer the uniform policy's "
             "$q_{\\mathrm{unif}}$ than $q_*$.",
             "measured", "control_pretraining", "#what-the-trained-models-compute")
record_claim("max-head-emerges" if emerged else "max-head-absent",
             "Trained from a random start with the Q-learning TD objective on random MDPs "
             "(10 seeds), the last backup head's attention mass on the successor's best action "
             + ("rises above 1/A and above that of expected-SARSA-trained models" if emerged else
                "does not rise above 1/A and that of expected-SARSA-trained models")
             + " (three standard errors).",
             "measured", "control_pretraining", "#a-does-the-max-head-emerge");

# %% [markdown]
# ## With state rewards
#
# The same study with `rewards="state"`, where the actions of a state differ only in where they lead, so
# the successor's action values are close together and a context of 20 transitions says little about them.
# Its file was made first, at a commit where state rewards were the default (so its recorded command has no
# `--rewards`; today's is `--rewards state --name control_pretrain_state.json`), written to a scratch folder
# and copied here; its configuration records `rewards = "state"`.

# %%
#| code-fold: true
#| code-summary: "Code: read the second study"
state = json.loads(Path("data/control_pretrain_state.json").read_text())
assert state["config"]["rewards"] == "state"
runs_s = {k: {m: np.array(v) for m, v in r.items()} for k, r in state["runs"].items()}
base_s = {k: np.array(v) for k, v in state["baselines"].items()}
mq_s, me_s = (runs_s[k]["mass_value"][:, -1, -1] for k in ("q", "expected"))
last_s = lambda k, key: runs_s[k][key][:, -1, -1] if key == "beta_eff" else runs_s[k][key][:, -1]
Markdown(f"After {state['config']['n_steps']} steps, {len(state['seeds'])} seeds: the last backup "
         f"head's mass on the value argmax is {fmt(mq_s)} under Q-learning and {fmt(me_s)} under "
         f"expected SARSA ($\\beta_{{\\mathrm{{eff}}}}$ {fmt(last_s('q', 'beta_eff'))} "
         f"and {fmt(last_s('expected', 'beta_eff'))}); normalised returns "
         f"{fmt(last_s('q', 'norm_return'))} and {fmt(last_s('expected', 'norm_return'))}, against "
         f"{fmt(base_s['construction_inf'])} for the construction at "
         f"$L = {state['config']['n_layers']}$ and {fmt(base_s['certainty_equivalence'])} for "
         "Q-iteration to convergence on the same contexts. "
         + provenance_note(state["provenance"], "These numbers"))

# %% [markdown]
# ## Implementation and tests
#
# The configuration, the batched sampling of MDPs and contexts, the fast forward pass, the training
# loop, the measures and the study's driver, each with its checks, and a small live run. The API
# entries are the objective above and the functions a reader calls (`ControlPretrainConfig`,
# `train_control`); the module's other functions, the fast pair update and the study's driver among
# them, are listed [at the end](#the-modules-other-functions).

# %% [markdown]
# ### The objective and the configuration

# %%
test_fail(lambda: control_td_targets(r_q, q_succ, 0.9, "sarsa"),
          contains="`objective` must be one of")


# %%
#| export
@dataclass(frozen=True)
class ControlPretrainConfig:
    "Every setting of a control pretraining run (the defaults are the book's study)."
    n_states:int = 4          # states S of each random MDP
    n_actions:int = 2         # actions A
    rewards:str = "action"    # "action" (r(s, a) i.i.d.) or "state" (r(s, a) = r(s))
    gamma:float = 0.9         # discount factor
    n:int = 20                # context length (transitions)
    n_layers:int = 3          # layer pairs L (2L attention layers)
    objective:str = "q"       # one of `CONTROL_OBJECTIVES`
    lr:float = 1e-2           # Adam learning rate
    n_steps:int = 600         # optimiser steps
    batch_size:int = 32       # examples per step and seed
    init_gain:float = 0.1     # Xavier gain of 9a's initialisation
    n_pool:int = 1000         # training MDPs per seed
    eval_mdps:int = 64        # held-out MDPs per seed, one context each
    eval_every:int = 100      # steps between evaluations
    dtype:str = "float64"     # "float64" or "float32" for training (evaluation in float64)

    def __post_init__(self):
        "Validate every field (a `ValueError` naming it)."
        lows = dict(n_states=2, n_actions=1, n=1, n_layers=1, n_steps=0, batch_size=2, n_pool=1,
                    eval_mdps=2, eval_every=1)
        for name, low in lows.items():
            object.__setattr__(self, name, check_int(getattr(self, name), name, low))
        check_choice(self.rewards, ("state", "action"), "rewards")
        check_choice(self.objective, CONTROL_OBJECTIVES, "objective")
        check_choice(self.dtype, ("float64", "float32"), "dtype")
        check_number(self.gamma, "gamma", 0), check_number(self.lr, "lr", 0, strict=True)
        check_number(self.init_gain, "init_gain", 0, strict=True)
        if self.gamma >= 1: raise ValueError(f"`gamma` must lie in [0, 1), got {self.gamma}")

    @property
    def d(self)->int: return self.n_states * self.n_actions


# %%
test_eq(ControlPretrainConfig().d, 8)
for bad in (dict(objective="sarsa"), dict(n=0), dict(gamma=1.), dict(rewards="sparse"),
            dict(dtype="float16"), dict(lr=0.)):
    test_fail(lambda: ControlPretrainConfig(**bad), contains=f"`{next(iter(bad))}`")


# %% [markdown]
# ### MDPs and contexts, many at once
#
# The MDPs of a seed's stream, stacked, with the start distribution of each (the uniform behaviour's
# stationary distribution, as in chapter 9), and the trajectories of many MDPs at once from given
# uniforms (so that each seed's draws come from its own generator and the seeds can still be simulated
# in one vectorised pass):

# %%
#| export
def _config(config)->ControlPretrainConfig:
    "`config`, or a `TypeError` naming it unless it is a `ControlPretrainConfig`."
    return check_type(config, ControlPretrainConfig, "config")

def _check_pair(pair)->tuple:
    "The five matrices of a pair, or a `ValueError` naming `pair`."
    if (not isinstance(pair, (tuple, list)) or len(pair) != 5
            or not all(isinstance(p, torch.Tensor) for p in pair)):
        raise ValueError("`pair` must be five tensors (A_b, V_b, A, V_cur, V_tgt), "
                         f"got {type(pair).__name__}")
    return tuple(pair)

def mdp_pool(config:ControlPretrainConfig, size:int, seed:int)->dict:
    ("`size` MDPs of `random_mdp` from one seed: P (T, S, A, S), r (T, S, A) and the uniform "
     "behaviour's stationary start d0 (T, S).")
    config, size, seed = _config(config), check_int(size, "size", 1), check_int(seed, "seed")
    kids = np.random.SeedSequence(seed).spawn(size)
    ms = [random_mdp(config.n_states, config.n_actions, config.gamma,
                     seed=np.random.default_rng(k), rewards=config.rewards) for k in kids]
    P, r = torch.stack([m.P for m in ms]), torch.stack([m.r for m in ms])
    d0 = torch.stack([torch.from_numpy(_stationary(p.numpy())) for p in P.mean(2)])
    return dict(P=P, r=r, d0=d0)


# %%
#| export
def _draw(cdf, u): return (u[..., None] >= cdf).sum(-1).clamp(max=cdf.shape[-1] - 1)

def sample_contexts(pool:dict,         # `mdp_pool` output, every tensor with leading axes (..., T)
                    task:torch.Tensor, # (..., B) the MDP of each example
                    u:torch.Tensor,    # (..., B, m, 2) uniforms: m - 1 transitions each
                   )->tuple:           # states, actions (..., B, m); rewards (..., B, m - 1)
    ("Uniform-behaviour trajectories of the MDPs `task`, started from their stationary "
     "distributions, from the uniforms `u`.")
    pool, task = check_type(pool, dict, "pool"), check_type(task, torch.Tensor, "task")
    u = check_type(u, torch.Tensor, "u")
    lead = task.shape[:-1]
    index = lambda: (*[torch.arange(k).view(-1, *[1] * (len(lead) - i))
                       for i, k in enumerate(lead)], task)
    pick = lambda x: x[index()] if lead else x[task]
    P, r, d0 = pick(pool["P"]), pick(pool["r"]), pick(pool["d0"])
    S, A = P.shape[-3], P.shape[-2]
    cumP = P.flatten(-3, -2).cumsum(-1)                                    # (..., B, S A, S)
    s, states, actions = _draw(d0.cumsum(-1), u[..., 0, 1]), [], []
    for t in range(u.shape[-2]):
        a = (u[..., t, 0] * A).long().clamp(max=A - 1)
        states.append(s); actions.append(a)
        if t + 1 < u.shape[-2]:
            row = cumP.gather(-2, (s * A + a)[..., None, None].expand(*s.shape, 1, S))[..., 0, :]
            s = _draw(row, u[..., t + 1, 1])
    st, ac = torch.stack(states, -1), torch.stack(actions, -1)
    return st, ac, r.flatten(-2).gather(-1, st[..., :-1] * A + ac[..., :-1])


# %%
cfg_small = ControlPretrainConfig(n_pool=3)
pool_small = mdp_pool(cfg_small, 3, 0)
u_small = torch.rand(3, 30, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
st_s, ac_s, rw_s = sample_contexts(pool_small, torch.tensor([0, 2, 2]), u_small)
for i, k in enumerate((0, 2, 2)):
    assert all(pool_small["P"][k, st_s[i, t], ac_s[i, t], st_s[i, t + 1]] > 0 for t in range(29))
    test_eq(rw_s[i], pool_small["r"][k, st_s[i, :-1], ac_s[i, :-1]])
first_rng = np.random.default_rng(np.random.SeedSequence(0).spawn(3)[0])
test_eq(pool_small["r"][0], random_mdp(4, 2, seed=first_rng, rewards="action").r)


# %% [markdown]
# ### The forward pass, for every seed at once
#
# The pairs' five matrices $(A_b, V_b, A, V^{\mathrm{cur}}, V^{\mathrm{tgt}})$ are stacked with a
# leading seed axis. The backup head of a column attends to the $A$ columns of its assigned block only
# and the TD head to the $n$ context columns only (9a's masks), so the fast pair update computes just
# those logits instead of the full $N \times N$ masked ones.

# %%
#| export
def _blocks(X, n:int, A:int, q:int):
    "The block columns of X (..., D, N) as (..., D, n + q, A)."
    return X[..., n:].unflatten(-1, (n + q, A))

def backup_attention(Z, A_b, n:int, A:int, q:int)->tuple:
    ("Backup-head weights: context column j over block j (..., n, A); each block column over its "
     "own block (..., n + q, A columns, A keys).")
    Z, A_b = check_type(Z, torch.Tensor, "Z"), check_type(A_b, torch.Tensor, "A_b")
    K, Y = _blocks(Z, n, A, q), A_b @ Z                # keys; A_b z_j of every column j
    ctx = torch.softmax((K[..., :n, :] * Y[..., :n, None]).sum(-3), -1)
    return ctx, torch.softmax(torch.einsum("...dbk,...dba->...bak", K, _blocks(Y, n, A, q)), -1)

def fast_pair_update(Z,            # (..., D, N) tokens
                     pair:tuple,   # (A_b, V_b, A, V_cur, V_tgt), each (..., D, D)
                     n:int, A:int, q:int,
                    )->torch.Tensor:  # (..., D, N)
    "One pair of layers of 9a (backup layer, then TD layer), computing only the unmasked scores."
    Z, pair = check_type(Z, torch.Tensor, "Z"), _check_pair(pair)
    A_b, V_b, A_td, V_cur, V_tgt = pair
    ctx, blk = backup_attention(Z, A_b, n, A, q)
    V = _blocks(V_b @ Z, n, A, q)
    Z = Z + torch.cat([(V[..., :n, :] * ctx[..., None, :, :]).sum(-1),
                       torch.einsum("...dbk,...bak->...dba", V, blk).flatten(-2)], -1)
    keys = Z[..., :n]
    return Z + (V_cur + V_tgt) @ keys @ torch.softmax(keys.mT @ A_td @ Z, -2)


# %%
#| export
def control_forward(params,     # (..., 5 L, D, D) the pairs' matrices (leading seed axis)
                    Z,          # (..., B..., D, N) prompts
                    n:int, A:int, q:int,
                    return_all:bool=False,  # also return the tokens entering every pair
                   ):           # (..., q, A) values at the query blocks (and Z_0..Z_{L-1})
    "Values of the stacked models at their prompts' query blocks (row d + 1 of the last tokens)."
    params, Z = check_type(params, torch.Tensor, "params"), check_type(Z, torch.Tensor, "Z")
    extra = Z.dim() - params.dim() + 1         # example axes between the seed axis and the matrices
    L, Zs = params.shape[-3] // 5, []
    shape = params.shape[:-3] + (1,) * extra + params.shape[-2:]
    for l in range(L):
        Zs.append(Z)
        pair = tuple(params[..., 5 * l + i, :, :].reshape(shape) for i in range(5))
        Z = fast_pair_update(Z, pair, n, A, q)
    out = Z[..., Z.shape[-2] - 3, n + n * A:].unflatten(-1, (q, A))
    return (out, Zs) if return_all else out


# %% [markdown]
# ### Training, every seed in one pass
#
# The loop reuses the engine's conventions (appendix A's named seed streams, the `ICTD_PERTURB` nudge,
# one loss per seed). Each step draws, for every seed from its own generator, a batch of MDPs of its
# pool and their trajectories of $n + 1$ transitions; the loss is summed over seeds. The held-out
# measures are taken every `eval_every` steps and at the end.

# %%
#| export
def init_params(config:ControlPretrainConfig, seeds:list)->torch.Tensor:
    ("(S, 5 L, D, D) float64: seed s's slice is `ControlICTD(d, L, init_gain, "
     "seed=run_stream(s, 'init'))`, nudged if `ICTD_PERTURB` asks.")
    config, seeds = _config(config), check_seeds(seeds)
    model = lambda s: ControlICTD(config.d, n_layers=config.n_layers, init_gain=config.init_gain,
                                  seed=run_stream(s, "init"))
    ps = torch.stack([torch.stack([p.detach() for p in model(s).pairs]) for s in seeds])
    return nudge(dict(pairs=ps), seeds)["pairs"]

def training_pools(config:ControlPretrainConfig, seeds:list)->dict:
    ("Every seed's pool of `n_pool` training MDPs (its stream `train_pool`), stacked: "
     "P (S, T, S, A, S), r, d0.")
    config, seeds = _config(config), check_seeds(seeds)
    pools = [mdp_pool(config, config.n_pool, run_stream(s, "train_pool")) for s in seeds]
    return {k: torch.stack([p[k] for p in pools]) for k in pools[0]}

def _features(config):
    return torch.eye(config.d, dtype=torch.float64).reshape(config.n_states, config.n_actions,
                                                            config.d)

def example_prompts(config:ControlPretrainConfig, states, actions, rewards):
    ("The training prompt of each trajectory of n + 1 transitions: the context, then query blocks "
     "S_n and S_{n+1}.")
    config = _config(config)
    phi, n = _features(config), config.n
    return build_control_prompt(phi[states[..., :n], actions[..., :n]], rewards[..., :n],
                                phi[states[..., 1:n + 1]], phi[states[..., n:n + 2]])

def td_loss(config:ControlPretrainConfig, params, states, actions, rewards,
            perm=None)->torch.Tensor:
    ("(S,) the loss of every seed on its batch of trajectories (S, B, n + 2); `perm` (S, B) "
     "shuffles the query rewards.")
    config, params = _config(config), check_type(params, torch.Tensor, "params")
    x = example_prompts(config, states, actions, rewards)
    out = control_forward(params, x.Z.to(params.dtype), config.n, config.n_actions, 2)  # S,B,2,A
    v = out[..., 0, :].gather(-1, actions[..., config.n, None])[..., 0]
    r = rewards[..., config.n] if perm is None else rewards[..., config.n].gather(-1, perm)
    target = control_td_targets(r.to(v.dtype), out[..., 1, :], config.gamma, config.objective)
    return 0.5 * (target - v).square().mean(-1)


# %%
#| export
def train_control(config:ControlPretrainConfig,  # every setting
                  seeds:list,                    # the seeds, trained together
                  progress:bool=False,           # show a progress bar
                  ho:dict=None,    # the held-out set (`held_out(config, seeds)`); built if None
                  pool:dict=None,  # the stacked training pools; built if None
                 )->dict:  # params (S, 5L, D, D), history (S, evaluations, ...), steps, seeds
    "Train one control Transformer per seed with `config.objective`, all seeds in one batched pass."
    seeds, dtype = [check_int(s, "seeds", 0) for s in seeds], getattr(torch, config.dtype)
    ho = held_out(config, seeds) if ho is None else ho
    pool = training_pools(config, seeds) if pool is None else pool
    params = init_params(config, seeds).to(dtype).requires_grad_()
    opt = torch.optim.Adam([params], lr=config.lr)
    gens = [torch.Generator().manual_seed(run_stream(s, "data")) for s in seeds]
    shuffle = [torch.Generator().manual_seed(run_stream(s, "objective")) for s in seeds]
    history, steps, B = {}, [], config.batch_size
    bar = tqdm(range(config.n_steps + 1), disable=not progress,
               desc=f"{config.objective}, {len(seeds)} seeds")
    for step in bar:
        if step % config.eval_every == 0 or step == config.n_steps:
            for k, v in probe_metrics(config, params, ho).items():
                history.setdefault(k, []).append(v)
            steps.append(step)
        if step == config.n_steps: break
        task = torch.stack([torch.randint(0, config.n_pool, (B,), generator=g) for g in gens])
        u = torch.stack([torch.rand(B, config.n + 2, 2, generator=g, dtype=torch.float64)
                         for g in gens])
        perm = (torch.stack([torch.randperm(B, generator=g) for g in shuffle])
                if config.objective == "shuffled" else None)
        loss = td_loss(config, params, *sample_contexts(pool, task, u), perm)
        if not torch.isfinite(loss).all():
            bad = [s for s, l in zip(seeds, loss) if not torch.isfinite(l)]
            raise RuntimeError(f"training diverged at step {step}: seeds {bad}")
        opt.zero_grad(); loss.sum().backward(); opt.step()
    return dict(params=params.detach(), history={k: torch.stack(v, 1) for k, v in history.items()},
                steps=steps, seeds=seeds)


# %% [markdown]
# ### The measures

# %%
#| export
def held_out(config:ControlPretrainConfig, seeds:list)->dict:
    ("Every seed's held-out MDPs (stream `eval_pool`) with one context each (stream "
     "`eval_contexts`), their prompts and exact solutions.")
    config, seeds = _config(config), check_seeds(seeds)
    E, n, S, A = config.eval_mdps, config.n, config.n_states, config.n_actions
    pools = [mdp_pool(config, E, run_stream(s, "eval_pool")) for s in seeds]
    pool = {k: torch.stack([p[k] for p in pools]) for k in ("P", "r", "d0")}
    gen = lambda s: torch.Generator().manual_seed(run_stream(s, "eval_contexts"))
    u = torch.stack([torch.rand(E, n + 1, 2, generator=gen(s), dtype=torch.float64) for s in seeds])
    st, ac, rw = sample_contexts(pool, torch.arange(E).expand(len(seeds), E), u)
    phi = _features(config)
    mdps = [[MDP(pool["P"][i, k], pool["r"][i, k], config.gamma, phi) for k in range(E)]
            for i in range(len(seeds))]
    qs = torch.stack([torch.stack([q_star(m) for m in row]) for row in mdps])
    qu = torch.stack([torch.stack([q_pi(m, uniform_policy(m)) for m in row]) for row in mdps])
    x = build_control_prompt(phi[st[..., :-1], ac[..., :-1]], rw, phi[st[..., 1:]],
                             phi.expand(len(seeds), E, S, A, config.d))
    return dict(pool, states=st, actions=ac, rewards=rw, Z=x.Z, q_star=qs, q_unif=qu,
                J_star=greedy_returns(pool["P"], pool["r"], config.gamma, qs),
                J_unif=(qu * uniform_policy(mdps[0][0])).sum(-1).mean(-1))

def normalised_returns(config:ControlPretrainConfig, ho:dict, Q)->torch.Tensor:
    "(S, E) normalised return of the greedy policy of the values Q (S, E, S, A) per held-out MDP."
    config, ho, Q = _config(config), check_type(ho, dict, "ho"), check_type(Q, torch.Tensor, "Q")
    J = greedy_returns(ho["P"], ho["r"], config.gamma, Q)
    return (J - ho["J_unif"]) / (ho["J_star"] - ho["J_unif"])


# %%
#| export
def probe_metrics(config:ControlPretrainConfig, params, ho:dict)->dict:
    ("Every seed's measures on its held-out set: per-layer scores and argmax masses (S, L), "
     "normalised return and errors (S,).")
    config, params = _config(config), check_type(params, torch.Tensor, "params")
    ho = check_type(ho, dict, "ho")
    n, A, S, d = config.n, config.n_actions, config.n_states, config.d
    with torch.no_grad():
        p = params.detach().double()
        Q, Zs = control_forward(p, ho["Z"], n, A, S, return_all=True)
        succ = ho["states"][..., 1:]                    # (S, E, n) each context column's successor
        best_true = ho["q_star"].gather(-2, succ[..., None].expand(*succ.shape, A)).argmax(-1)
        score, beta_eff, mass_v, mass_q = [], [], [], []
        mass = lambda w, idx: w.gather(-1, idx)[..., 0].mean((-2, -1))
        for l, Z in enumerate(Zs):
            A_b = p[:, 5 * l][:, None]
            w = backup_attention(Z, A_b, n, A, S)[0]                            # (S, E, n, A)
            vals = Z[..., d + 1, n:n + n * A].unflatten(-1, (n, A))
            score.append(p[:, 5 * l, d + 1, d + 3])
            beta_eff.append((A_b @ Z)[..., d + 1, :n].mean((-2, -1)))
            mass_q.append(mass(w, best_true[..., None]))
            mass_v.append(mass(w, vals.argmax(-1, keepdim=True)) if l > 0
                          else torch.full_like(score[-1], math.nan))
        rms = lambda target: (Q - target).square().mean((-2, -1)).sqrt().mean(-1)
        return dict(score=torch.stack(score, -1), beta_eff=torch.stack(beta_eff, -1),
                    mass_value=torch.stack(mass_v, -1), mass_qstar=torch.stack(mass_q, -1),
                    norm_return=normalised_returns(config, ho, Q).mean(-1),
                    err_qstar=rms(ho["q_star"]), err_qunif=rms(ho["q_unif"]))


# %% [markdown]
# The check on the construction: with 9a's parameters at $\beta = 5$ every backup head has
# $\beta_{\mathrm{eff}} = 5$ and, from layer 2 on, puts $\mathrm{softmax}(5\, Q_l)$ on the best
# action, above $1/A$:

# %%
#| code-fold: true
#| code-summary: "Code: the probes on the construction"
cfg_chk = ControlPretrainConfig(eval_mdps=4)
ho_chk = held_out(cfg_chk, [7])
star5 = control_theta_star(8, 20 * torch.eye(8, dtype=torch.float64), 1., 0.9, 5.)
star5 = torch.stack(star5 * 3)[None]
m_chk = probe_metrics(cfg_chk, star5, ho_chk)
test_close(m_chk["beta_eff"], torch.full((1, 3), 5., dtype=torch.float64), eps=1e-12)
assert (m_chk["mass_value"][:, 1:] > 0.5).all()
row = lambda l: " | ".join(f"{m_chk[k][0, l]:.3f}"
                          for k in ("beta_eff", "mass_value", "mass_qstar"))
Markdown("| layer | $\\beta_{\\mathrm{eff}}$ | mass on value argmax | mass on $q_*$ argmax |\n"
         "|---|---|---|---|\n" + "\n".join(f"| {l + 1} | {row(l)} |" for l in range(3)))

# %% [markdown]
# The fast pair update equals 9a's `control_pair_update` on the full masked prompt, pair after pair, on
# random parameters (not the construction's: every entry of every matrix non-zero) in float64:

# %%
gp = torch.Generator().manual_seed(3)
ho3 = held_out(ControlPretrainConfig(eval_mdps=3, n=7), [5])
Z3 = ho3["Z"][0]
for trial in range(3):
    pair3 = tuple(0.5 * torch.randn(12, 12, generator=gp, dtype=torch.float64) for _ in range(5))
    slow = control_pair_update(Z3, pair3, control_masks(7, 2, 4))
    test_close(fast_pair_update(Z3, pair3, 7, 2, 4), slow, eps=1e-12)
    Z3 = slow

# %% [markdown]
# Batched training equals separate runs: two seeds trained together and each alone for 20 steps, in
# float64, end at the same parameters to $10^{-10}$ (the seeds share nothing but the summed loss, and
# Adam is entry-wise):

# %%
cfg_b = ControlPretrainConfig(n_steps=20, eval_every=20, eval_mdps=2, n_pool=20, n=6)
both = train_control(cfg_b, [11, 12])["params"]
for i, s in enumerate((11, 12)):
    test_close(train_control(cfg_b, [s])["params"][0], both[i], eps=1e-10)


# %% [markdown]
# ### The study's driver
#
# The baselines on the held-out contexts, and the study's driver with its command line:

# %%
#| export
def baselines(config:ControlPretrainConfig, ho:dict, kappa:float=20.)->dict:
    ("Per seed (S,): normalised return of the construction at several beta, the myopic policy and "
     "certainty equivalence; errors to q* and q_unif.")
    config, ho = _config(config), check_type(ho, dict, "ho")
    kappa = check_number(kappa, "kappa", 0, strict=True)
    phi, W = _features(config), kappa * torch.eye(config.d, dtype=torch.float64)
    context = (phi, ho["states"], ho["actions"], ho["rewards"], W)
    run = lambda beta, iters: pair_token_q_iteration(*context, alpha=1., gamma=config.gamma,
                                                     beta=beta, n_iters=iters)
    L = config.n_layers
    Qs = dict(construction_inf=run(math.inf, L), construction_4=run(4., L),
              construction_1=run(1., L), construction_0=run(0., L), myopic=run(math.inf, 1),
              certainty_equivalence=run(math.inf, 300))
    out = {k: normalised_returns(config, ho, Q).mean(-1) for k, Q in Qs.items()}
    for k, Q in Qs.items():
        for t in ("q_star", "q_unif"):
            err = (Q - ho[t]).square().mean((-2, -1)).sqrt().mean(-1)
            out[f"err_{t.replace('_', '')}_{k}"] = err
    return out


# %%
#| export
def run_control_pretraining(out="nbs/data",             # folder of control_pretrain.json
                            seeds=tuple(range(10)),     # the seeds
                            config:ControlPretrainConfig=ControlPretrainConfig(),  # the settings
                            progress:bool=True,
                            command:str="run_control_pretraining",
                            name:str="control_pretrain.json",  # the file's name in `out`
                           )->Path:
    ("Train every seed with the three objectives, measure them and the baselines on the held-out "
     "MDPs, write `<out>/control_pretrain.json`.")
    t0, seeds = time.time(), list(seeds)
    ho, pool, runs, steps = held_out(config, seeds), training_pools(config, seeds), {}, None
    for obj in CONTROL_OBJECTIVES:
        res = train_control(dataclasses.replace(config, objective=obj), seeds, progress, ho, pool)
        runs[obj], steps = res["history"], res["steps"]
    data = dict(config=dataclasses.asdict(config), seeds=seeds, steps=steps, runs=runs,
                baselines=baselines(config, ho))
    data["provenance"] = provenance(command, threads=torch.get_num_threads(),
                                    wall_s=round(time.time() - t0, 1))
    path = Path(out) / name
    atomic_write_text(path, json.dumps(jsonable(data), indent=1))
    return path


# %%
#| export
def main(argv:list=None):
    ("Command line: `python -m ictd.experiments.control_pretraining --out nbs/data "
     "[--seeds 0 1 ...] [--steps N] [--rewards state --name F]`.")
    ap = argparse.ArgumentParser(prog="python -m ictd.experiments.control_pretraining",
                                 description=run_control_pretraining.__doc__)
    ap.add_argument("--out", default="nbs/data")
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(10)))
    ap.add_argument("--steps", type=int, default=ControlPretrainConfig.n_steps)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--rewards", default=ControlPretrainConfig.rewards, choices=("action", "state"))
    ap.add_argument("--name", default="control_pretrain.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cmd = "python -m ictd.experiments.control_pretraining " + " ".join(
        sys.argv[1:] if argv is None else argv)
    config = ControlPretrainConfig(n_steps=args.steps, rewards=args.rewards)
    print(run_control_pretraining(args.out, args.seeds, config, not args.no_progress, cmd.strip(),
                                  args.name))


# %%
#| export
#| eval: false
if __name__ == "__main__": main()

# %% [markdown]
# The baselines at their limits: certainty equivalence on a long context is near optimal, and the myopic
# policy is the construction at $L = 1$:

# %%
ho_long = held_out(ControlPretrainConfig(eval_mdps=8, n=400), [21])
b_long = baselines(ControlPretrainConfig(eval_mdps=8, n=400), ho_long)
assert b_long["certainty_equivalence"].item() > 0.9, b_long["certainty_equivalence"]
b_one = baselines(ControlPretrainConfig(eval_mdps=8, n=400, n_layers=1), ho_long)
test_close(b_long["myopic"], b_one["construction_inf"], eps=1e-12)

# %% [markdown]
# ### A live run
#
# Four seeds, 150 steps, the Q-learning objective: the error to $q_*$ falls from its value at the
# random start on every seed; the last backup head's score is still near 0 this early (in the study it
# grows later in training, Figure 9d.1).

# %%
live = train_control(ControlPretrainConfig(n_steps=150, eval_every=50, eval_mdps=16),
                     [100, 101, 102, 103])
live_err, live_score = live["history"]["err_qstar"], live["history"]["beta_eff"][:, :, -1]
assert (live_err[:, -1] < live_err[:, 0]).all()
Markdown(f"RMS error to $q_*$ at steps {live['steps']}: "
         + "; ".join(f"seed {s}: " + ", ".join(f"{v:.2f}" for v in row)
                     for s, row in zip(live["seeds"], live_err.tolist()))
         + ". Last backup head's $\\beta_{\\mathrm{eff}}$ at the end: "
         + ", ".join(f"{v:.2f}" for v in live_score[:, -1].tolist()) + ".")

# %% [markdown]
# ### The module's other functions
#
# The page's API entries are the functions a reader calls; the module's other public functions, with
# their docstrings:

# %%
#| code-fold: true
#| code-summary: "Code for the list"
internals = (mdp_pool, sample_contexts, backup_attention, fast_pair_update, control_forward,
             init_params, training_pools, example_prompts, td_loss, held_out, normalised_returns,
             probe_metrics, baselines, run_control_pretraining, main)
code = lambda doc: re.sub(r"`([^`]*)`", r"<code>\1</code>", doc).replace("|", "&#124;")
Markdown(f"<details><summary>{len(internals)} functions</summary>\n\n"
         "| function | what it computes |\n|---|---|\n" + "\n".join(
    f"| <code>{f.__name__}</code> | {code(f.__doc__)} |" for f in internals) + "\n\n</details>")

# %%
#| hide
# Listed above: this keeps nbdev from adding a full API entry for each of them.
show_doc(mdp_pool)
show_doc(fast_pair_update)
show_doc(sample_contexts)
show_doc(backup_attention)
show_doc(control_forward)
show_doc(init_params)
show_doc(training_pools)
show_doc(example_prompts)
show_doc(td_loss)
show_doc(held_out)
show_doc(normalised_returns)
show_doc(probe_metrics)
show_doc(baselines)
show_doc(run_control_pretraining)
show_doc(main)

# %%
#| export
from ictd.boyan import check_arguments
check_arguments(globals())   # public functions refuse arguments their annotations rule out (ch. 0)

# %%
#| hide
import nbdev; nbdev.nbdev_export()
