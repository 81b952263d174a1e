# %%
#| default_exp mechanism

# %%
#| export
from __future__ import annotations
import copy, dataclasses
import torch
from ictd.model import SoftmaxICTD
from ictd.tasks import TaskBatch
from ictd.convergence import span_rate
from ictd.boyan import weighted_error
from ictd.state_tokens import model_params, population_predict, population_tokens, token_layers, token_predict
from ictd.engine import PretrainConfig, get_family
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel
from ictd.prompt import build_prompt
from ictd.tasks import sample_trajectories
from ictd.emergence import ALPHAS, BETAS, certainty_equivalence_values, context_mean_values, held_out_prompts, msve_of, theta_star_model
import math
import numpy as np
from ictd.wstd import weighted_softmax_td

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *

# %%
#| hide
import matplotlib.pyplot as plt
from IPython.display import Markdown
from ictd.tasks import random_tasks
from ictd.state_tokens import population_neu
from ictd.emergence import best_theta_star, neu_jackknife
from ictd.model import theta_star
from ictd.convergence import td_recursion
from ictd.core import record_claim
from matplotlib.ticker import NullFormatter
from ictd.core import plain_log_ticks
import json, math
from pathlib import Path
from ictd.engine import EMERGENCE
from ictd.emergence import UNIFORM_BELOW
from ictd.experiments.mechanism import (anatomy_counts, anatomy_table, binomial_greater, claims_table, fisher_greater, gap_table, holm, load_models,
                                       normal_greater, study_summary, summary_table)
from ictd.experiments.mechanism import (CONTEST_DEPTHS, CONTEST_FACTORS, CONTEST_GRIDS, CONTEST_NAMES, CONTEST_OBJECTIVES, CONTROLS, contest_summary,
                                       contest_winner, fit_candidate, load_contest, rate_interval)
from ictd.core import OKABE_ITO, provenance_note
from ictd.mechanism import candidate_values_at, fit_learned_algorithm, layer_values, learned_kernel
from ictd.mechanism import (centred_msve, row_writes, knockout, knockout_rows, write_constancy, swap_weights,
                            kernel_condition, layer_anatomy, lookahead_features, affine_fit, affine_predict,
                            weighted_r2, candidate_values, probe_layers, fit_estimators, estimator_values,
                            prediction_errors, gap_measures, update_jacobian, sampled_jacobians, jacobian_spectrum,
                            shared_recursion, iterate_shared)

# %% [markdown]
# # What the trained models compute
# > A pre-registered contest of algorithms, scored on the errors of pretrained softmax Transformers across a sweep of depths, objectives and settings: the trained models run a level plus a few iterates of weighted softmax TD.

# %%
#| echo: false
contest = load_contest("data")
head_cell = contest["cells"]["td, L = 3"]
head = contest_summary(head_cell, fit_seeds=range(10))
winner, runner, margin, margin_se, n_lower = contest_winner(head)
tdf = head["td"]["fits"][0]
ms = lambda x: f"{x.mean():.3f} ± {x.std() / math.sqrt(len(x)):.3f}"
hr = {k: v["scores"]["ratio"] for k, v in head.items()}
n_head = len(head["td"]["seeds"])
summaries = {k: contest_summary(v) for k, v in contest["cells"].items()}
winners = {k: contest_winner(v) for k, v in summaries.items()}
k_fit = {k: fit_candidate(v["stats"], "td")["theta"] for k, v in contest["cells"].items()}
grid_cells = [(o, L) for o in CONTEST_OBJECTIVES for L in CONTEST_DEPTHS if f"{o}, L = {L}" in summaries]
best_other = lambda sm: min((k for k in sm if k != "td"), key=lambda k: sm[k]["scores"]["ratio"].mean().item())
decided = lambda w: w[2] > 2 * w[3]                     # a cell's winner is clear when its paired margin exceeds two standard errors
cell_of = lambda o, L: f"{o}, L = {L}"
grid_keys = [cell_of(o, L) for o in CONTEST_OBJECTIVES for L in CONTEST_DEPTHS if cell_of(o, L) in summaries]
by_winner = lambda o, name: [L for L in CONTEST_DEPTHS if cell_of(o, L) in winners and winners[cell_of(o, L)][0] == name and decided(winners[cell_of(o, L)])]
ctrl_td_L = sorted({L for o in CONTROLS for L in by_winner(o, "td")})
k3 = {o: k_fit[cell_of(o, 3)]["k"] for o in CONTROLS if cell_of(o, 3) in k_fit}
more_k = [L for L in CONTEST_DEPTHS if cell_of("td", L) in k_fit and all(k_fit[cell_of("td", L)]["k"] > k_fit[cell_of(o, L)]["k"] for o in CONTROLS if cell_of(o, L) in k_fit)]
sweep_txt = (f"Across the sweep of depths and objectives, TD-trained models are won by level + TD iterates at $L = {', '.join(map(str, by_winner('td', 'td')))}$"
             + (f" and by the lookahead at $L = {', '.join(map(str, by_winner('td', 'lookahead')))}$" if by_winner('td', 'lookahead') else "")
             + f"; the same form also wins the " + " and the ".join(f"{o} models at $L = {', '.join(map(str, by_winner(o, 'td')))}$" for o in CONTROLS if by_winner(o, "td"))
             + ", so the form is not a signature of TD training. What differs between the objectives is how many iterates the fit uses: under TD "
             f"$k = {', '.join(str(k_fit[cell_of('td', L)]['k']) for L in CONTEST_DEPTHS if cell_of('td', L) in k_fit)}$ at $L = {', '.join(str(L) for L in CONTEST_DEPTHS if cell_of('td', L) in k_fit)}$, "
             f"more than under every control at $L = {', '.join(str(L) for L in more_k)}$ (at $L = 3$: {', '.join(f'{k} for {o}' for o, k in k3.items())})."
             + (f" With one-hot features, where the model sees which state is which, the winner is {CONTEST_NAMES[winners['one-hot'][0]]}." if "one-hot" in winners and winners["one-hot"][0] != "td" and decided(winners["one-hot"]) else ""))
Markdown(f"**The question.** What does a softmax Transformer pretrained with TD on random Boyan chains compute in its forward pass? "
         f"**The contest.** Five algorithms, each given the same three fitted constants (a level coefficient, a scale, and one point of a grid of kernel or "
         f"step parameters), were written down before the sweep ran, fitted to the outputs of ten trained models and scored on the *errors* of {n_head} others. "
         f"**The answer.** The winner is {CONTEST_NAMES[winner]}:\n\n"
         f"$$\\hat v(x) = \\lambda\\,\\frac{{\\bar R}}{{1-\\gamma}} + \\sigma\\, v_k(x), \\qquad v_{{t+1}}(x) = v_t(x) + \\sum_{{j=1}}^{{n}} K_j(x)\\,\\big(R_j + \\gamma v_t(S_j) - v_t(S_{{j-1}})\\big), \\qquad "
         f"K_j(x) = \\mathrm{{softmax}}_j\\big(\\beta\\, \\phi(x)^\\top \\phi(S_{{j-1}})\\big), \\quad v_0 = 0,$$\n\n"
         f"with $\\bar R$ the context's mean reward and, fitted on seeds 0 to 9 of the headline configuration, $\\lambda = {tdf['level']:.3f}$, $\\sigma = {tdf['scale']:.3f}$, "
         f"$k = {tdf['theta']['k']}$ iterates and $\\beta = {tdf['theta']['beta']:g}$: weighted softmax TD with step 1 (Definition 1.1), started from zero, run for $k$ steps, "
         f"plus a state-blind level. On the {n_head} other seeds the residual ratio (the share of the models' error that a candidate does not predict) is "
         f"{ms(hr[winner])}, against {ms(hr[runner])} for the runner-up, {CONTEST_NAMES[runner]}; the winner is lower in {n_lower} of {n_head} seeds. " + sweep_txt
         + f" **The evidence.** The same frozen constants predict how the models change when the prompt's successors are shuffled "
         f"and when the context is longer than in training, better than every other candidate; and the winner's level "
         f"constant can be read off the weights (the sections *Interventions at test time* and *Reading the algorithm off the weights*).")

# %% [markdown]
# ::: {.callout-note}
# **How to read this chapter.** The contest comes first: its rules, the headline cell, the sweep's phase diagram and
# the controls. The evidence follows: the stated algorithm as a library object, `fit_learned_algorithm`; four
# interventions at test time, each candidate's prediction stated before the measurement; and the constants read off
# the weights. Then *how* the models implement it: the anatomy of the trained models (what each layer writes, which
# layer is uniform), chapter 5's condition and five further experiments; a table of every claim with its statistics
# and a summary close the page. The theorem behind the winner is on the next page, chapter 6d. Every number comes
# from runs saved under `nbs/data/` with their provenance (the chapter never trains); the
# drivers that made them, and the tables and statistics, are the library of [appendix D](mechanism_studies.html). The
# definitions of this page's probes and of the contest's candidates are in its last two sections, with their tests.
# Everything here is the project's own analysis [ours]; the paper's claim under test is that pretraining drives the
# parameters towards the constructed $\theta^*$ (Definition 3.1).
# :::

# %% [markdown]
# ## The contest
#
# The method is the one that settled the same question for Transformers trained on regression in context
# [Akyürek et al. 2023; Garg et al. 2022]: compare the model with candidate algorithms, each with its few constants
# fitted on some trained models, on prompts and models it was not fitted to, and on the aspect of the output where the
# candidates disagree. Two rules make the comparison fair. Every candidate has the **same fitted constants**: a level
# coefficient $\lambda$ on the context-mean value $\bar R/(1-\gamma)$, a scale $\sigma$, and one point $\theta$ of a
# grid of its own kernel or step parameters, so that
#
# $$\hat v_\theta(x) = \lambda\, \frac{\bar R}{1-\gamma} + \sigma\, u_\theta(x).$$
#
# And the candidates are scored on the model's **errors**, not its output: every good estimator shares most of
# $v_\pi$'s shape with the model, so what tells algorithms apart is where the model is wrong. With
# $c(v) = v - \sum_y d_\pi(y) v(y)$ the centred values of a task (its shape), the primary score of a candidate on a
# trained model is the *residual ratio*
#
# $$\rho = \frac{\sum_{\text{tasks}} \sum_x d_\pi(x) \big(c(v_{\text{model}})(x) - c(\hat v)(x)\big)^2}{\sum_{\text{tasks}} \sum_x d_\pi(x) \big(c(v_{\text{model}})(x) - c(v_\pi)(x)\big)^2},$$
#
# the share of the model's error (in shape) that the candidate does not predict: 0 for a perfect account of the
# model, 1 for $v_\pi$ itself. The secondary scores are the *residual correlation* between the model's error
# $c(v_{\text{model}}) - c(v_\pi)$ and the candidate's $c(\hat v) - c(v_\pi)$, the centred $1 - R^2$ of the candidate
# against the model's output, and the candidate's own MSVE against $v_\pi$.
#
# The fit: $\sigma$ by least squares on the centred values, $\lambda$ by least squares on the task means (the two parts
# of the $d_\pi$-weighted squared error are orthogonal), and $\theta$ by the smallest centred residual on the fitting
# seeds; then everything is frozen. The candidates, with their grids ($u_\theta$ is the candidate's base function):

# %%
#| echo: false
base = {"td": "$v_k$: $k$ iterates of weighted softmax TD, $\\alpha = 1$, $W = \\beta I$, from $v_0 = 0$",
        "lookahead": "$\\tilde r_\\beta(x) + c\\, \\tilde r^+_\\beta(x)$: kernel-smoothed reward and next reward (the two-step lookahead)",
        "ce": "value of the context's empirical MRP with $\\varepsilon$ pseudo-counts, discount $\\gamma' = f\\gamma$",
        "bayes": "posterior mean of $v_\\pi$ under the random Boyan chain prior given the context and the state labels (Monte Carlo, 128 draws; likelihood tempered by $\\eta$), discount $\\gamma' = f\\gamma$",
        "v_pi": "the true value at discount $\\gamma' = f\\gamma$ (an oracle)"}
sym = dict(k="k", beta="\\beta", c="c", gamma_factor="f", eps="\\varepsilon", temper="\\eta")
Markdown("| candidate | $u_\\theta(x)$ | grid of $\\theta$ | grid points |\n|---|---|---|---|\n" +
         "\n".join(f"| {CONTEST_NAMES[k]} | {base[k]} | " + "; ".join(f"${sym[a]} \\in \\{{{', '.join(f'{x:g}' for x in v)}\\}}$" for a, v in g.items()) +
                   f" | {math.prod(len(v) for v in g.values())} |" for k, g in CONTEST_GRIDS.items()))

# %% [markdown]
# The Bayes candidate is the best estimator the context allows, and more: it is told which state is which in the
# chain's order, which the model, seeing only random features, is not. Scaled $v_\pi$ is an oracle. Both have fewer
# grid points than the others, which can only count against them. The definitions and their tests are in
# *Implementation: the contest* at the end of the page.
#
# **The protocol**, fixed in the page's code (commit `a020c5a`) before any cell of the sweep was scored: in the headline
# cell (`EMERGENCE`: $s = 10$, $d = 4$ random features, $n = 30$, $L = 3$, $\gamma = 0.9$, TD, 2000 steps), constants are
# fitted on seeds 0 to 9 and scored on seeds 10 to 39; seeds 20 to 39 were trained for the contest, after its rules
# were written. In every other cell of the sweep (ten seeds each) a seed is scored with the constants fitted on the
# other nine (leave one out). The sums every fit and score need are saved per run by `run_contest` (appendix D):

# %%
#| echo: false
Markdown(" ".join(provenance_note(p, f"The sums in `{f}`") for f, p in contest["provenance"].items()))

# %% [markdown]
# ### The headline cell
#
# Fitted on seeds 0 to 9, scored on the thirty others: means ± standard errors over seeds, and the number of seeds
# where the winner's residual ratio is lower than the candidate's.

# %%
#| code-fold: true
fmt_theta = lambda t: ", ".join(f"${sym[a]} = {v:g}$" for a, v in t.items())
Markdown("| candidate | fitted $\\theta$ | $\\lambda$ | $\\sigma$ | residual ratio | residual correlation | centred $1 - R^2$ | MSVE | winner lower |\n|---|---|---|---|---|---|---|---|---|\n" +
         "\n".join(f"| {'**' + CONTEST_NAMES[k] + '**' if k == winner else CONTEST_NAMES[k]} | {fmt_theta(v['fits'][0]['theta'])} | {v['fits'][0]['level']:.3f} | {v['fits'][0]['scale']:.3f} | "
                   + " | ".join(ms(v["scores"][s]) for s in ("ratio", "correlation", "centred_1mr2", "msve")) +
                   f" | {'—' if k == winner else str(int((hr[winner] < hr[k]).sum())) + ' / ' + str(n_head)} |" for k, v in sorted(head.items(), key=lambda kv: kv[1]['scores']['ratio'].mean()))
         + f"\n| trained models | | | | | | | {ms(torch.tensor([st['run']['msve'] for st, s in zip(head_cell['stats'], head_cell['seeds']) if s >= 10]))} | |")

# %%
new_seeds = torch.tensor([s >= 20 for s in head["td"]["seeds"]])
lower_new = int((hr[winner][new_seeds] < hr[runner][new_seeds]).sum())
assert winner == "td" and margin > 3 * margin_se and n_lower >= 27, (winner, margin, margin_se, n_lower)
assert all((hr["td"][new_seeds] - hr[k][new_seeds]).mean() < 0 for k in hr if k != "td"), hr
rate, lo, hi = rate_interval(n_lower, n_head)
Markdown(f"The winner is lower than the runner-up in {n_lower} of {n_head} seeds (rate {rate:.2f}, 95% interval {lo:.2f} to {hi:.2f}), "
         f"by {margin:.3f} ± {margin_se:.3f} in residual ratio; on the twenty seeds trained after the rules were written alone, in {lower_new} of "
         f"{int(new_seeds.sum())}. Its residuals correlate {head['td']['scores']['correlation'].mean():.2f} with the models' errors, against "
         f"{head[runner]['scores']['correlation'].mean():.2f} for the runner-up. It is not the best *value estimator*: its MSVE "
         f"({head['td']['scores']['msve'].mean():.3f}) is above the Bayes candidate's ({head['bayes']['scores']['msve'].mean():.3f}), as the models' own is; "
         f"it is the best account of what the models compute, errors included.")

# %%
at_edge = {k: [a for a, x in v["fits"][0]["theta"].items() if len(CONTEST_GRIDS[k][a]) > 1 and x in (min(CONTEST_GRIDS[k][a]), max(CONTEST_GRIDS[k][a]))]
           for k, v in head.items()}
Markdown("Fitted constants at an end of their grid, where a wider grid could fit better: " +
         ("; ".join(f"{CONTEST_NAMES[k]}: " + ", ".join(f"${sym[a]} = {head[k]['fits'][0]['theta'][a]:g}$ (grid {min(CONTEST_GRIDS[k][a]):g} to {max(CONTEST_GRIDS[k][a]):g})" for a in v)
                    for k, v in at_edge.items() if v) or "none") +
         ". A candidate held at an edge may score below what a wider grid would give it; such a fit is reported as it is, not widened after the "
         "scores were seen (the grids were fixed before the contest ran).")

# %% [markdown]
# ### The sweep
#
# Around the headline cell: depth $L \in \{2, 3, 4, 6\}$ crossed with four training objectives (TD; Monte-Carlo
# returns; the true value $v_\pi$ at the query, "supervised"; and TD with the successor drawn independently of the
# query, which keeps the rewards and removes the temporal structure), and one factor at a time: a shorter and a longer
# context ($n = 10$, $100$), a shorter horizon ($\gamma = 0.5$) and one-hot features. Ten seeds per cell (forty in the
# headline cell), each scored with the constants fitted on the cell's other seeds. Figure 6b.1 is the phase diagram:
# which candidate wins each cell, and how many TD iterates the winner's fit uses at each depth.

# %%
#| code-fold: true
#| label: fig-contest-phase
#| fig-cap: "Figure 6b.1. The contest's phase diagram. Left: the winning candidate in each cell of depth against training objective (colour; hatched where the paired margin over the runner-up is under two standard errors), with the residual ratio of level + TD iterates and, below it, that of the best other candidate (mean over ten seeds, forty in the headline cell, each scored with constants fitted on the other seeds). Right: the number of TD iterates k that the level + TD iterates fit uses (on all seeds of the cell), against the model's depth, per objective; the dashed line is k = L."
#| fig-alt: "Left, a four by four grid of coloured squares, rows the objectives td, mc, supervised and td-independent, columns the depths 2, 3, 4 and 6, each square labelled with two residual ratios. Right, the fitted number of TD iterates against depth, one line per objective, with the diagonal k = L dashed."
names = list(CONTEST_GRIDS)
colours = dict(zip(names, OKABE_ITO))
fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.4), gridspec_kw=dict(width_ratios=[1.25, 1]))
for i, o in enumerate(CONTEST_OBJECTIVES):
    for j, L in enumerate(CONTEST_DEPTHS):
        key = f"{o}, L = {L}"
        if key not in summaries: ax.text(j, i, "not trained\n(CPU budget)", ha="center", va="center", fontsize=8.5, color="0.4"); continue
        sm, w = summaries[key], winners[key][0]
        ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=colours[w] if decided(winners[key]) else "white", alpha=0.55,
                                   hatch=None if decided(winners[key]) else "//", edgecolor="0.5"))
        ax.text(j, i, f"TD {sm['td']['scores']['ratio'].mean():.2f}\n{best_other(sm)} {sm[best_other(sm)]['scores']['ratio'].mean():.2f}", ha="center", va="center", fontsize=8.5)
ax.set(xlim=(-0.5, len(CONTEST_DEPTHS) - 0.5), ylim=(len(CONTEST_OBJECTIVES) - 0.5, -0.5), xticks=range(len(CONTEST_DEPTHS)), xticklabels=[f"L = {L}" for L in CONTEST_DEPTHS],
       yticks=range(len(CONTEST_OBJECTIVES)), yticklabels=CONTEST_OBJECTIVES, xlabel="depth", ylabel="training objective", title="winner by residual ratio")
ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=colours[k], alpha=0.55) for k in names] + [plt.Rectangle((0, 0), 1, 1, facecolor="white", hatch="//", edgecolor="0.5")],
          labels=[CONTEST_NAMES[k] for k in names] + ["no clear winner (margin under 2 s.e.)"], fontsize=8,
          loc="upper left", bbox_to_anchor=(0, -0.16), ncol=2, frameon=False)
for o, marker in zip(CONTEST_OBJECTIVES, "osD^"):
    Ls = [L for L in CONTEST_DEPTHS if f"{o}, L = {L}" in k_fit]
    bx.plot(Ls, [k_fit[f"{o}, L = {L}"]["k"] for L in Ls], marker=marker, label=o)
bx.plot(CONTEST_DEPTHS, CONTEST_DEPTHS, "k--", lw=0.8, label="k = L")
bx.set(xlabel="depth L of the trained model", ylabel="fitted TD iterates k", xticks=CONTEST_DEPTHS, title="k of the level + TD iterates fit")
bx.legend(fontsize=8); fig.tight_layout()

# %% [markdown]
# One factor at a time around the headline cell (TD, $L = 3$): the winner, the residual ratio of level + TD iterates
# and of the best other candidate, the winner's margin over the runner-up (paired, mean ± s.e. over seeds) and the
# fitted $k$ and $\beta$.

# %%
#| code-fold: true
factor_rows = ["td, L = 3"] + [k for k in CONTEST_FACTORS if k in summaries]
Markdown("| cell | seeds | winner | its residual ratio | runner-up | level + TD iterates | margin over the runner-up | winner lower | TD fit: $k$, $\\beta$ |\n|---|---|---|---|---|---|---|---|---|\n" +
         "\n".join(f"| {'headline (' + k + ')' if k == 'td, L = 3' else k} | {len(summaries[k]['td']['seeds'])} | {CONTEST_NAMES[winners[k][0]]} | {ms(summaries[k][winners[k][0]]['scores']['ratio'])} | "
                   f"{CONTEST_NAMES[winners[k][1]]}: {ms(summaries[k][winners[k][1]]['scores']['ratio'])} | {ms(summaries[k]['td']['scores']['ratio'])} | {winners[k][2]:.3f} ± {winners[k][3]:.3f} | "
                   f"{winners[k][4]} / {len(summaries[k]['td']['seeds'])} | {k_fit[k]['k']}, {k_fit[k]['beta']:g} |" for k in factor_rows))

# %%
td_wins = [k for k, w in winners.items() if w[0] == "td"]
clear = [k for k, w in winners.items() if w[0] == "td" and decided(w)]
others = {k: w for k, w in winners.items() if w[0] != "td" and decided(w)}
ties = [k for k, w in winners.items() if not decided(w)]
Markdown(f"Level + TD iterates wins {len(clear)} of the {len(winners)} cells by more than two standard errors of the paired margin"
         + (f"; the lookahead or another candidate wins {', '.join(f'{k} ({CONTEST_NAMES[w[0]]}, margin {w[2]:.3f} ± {w[3]:.3f})' for k, w in others.items())}" if others else "")
         + (f"; no candidate is clearly ahead in {', '.join(ties)}" if ties else "") + "."
         + (" With independent successors the TD fit picks $k = 1$, and one TD iterate from zero is the smoothed reward, the lookahead with $c = 0$: the two "
            "candidates are then the same function, and tie exactly." if any('independent' in k for k in ties) else "")
         + (f" At $L = 6$ the TD fit uses the largest $k$ of its grid, {max(CONTEST_GRIDS['td']['k'])}: more iterates are not excluded." if k_fit.get(cell_of('td', 6), {}).get('k') == max(CONTEST_GRIDS['td']['k']) else "")
         + f" Under TD the fitted number of iterates is " + ", ".join(f"$k = {k_fit[f'td, L = {L}']['k']}$ at $L = {L}$" for L in CONTEST_DEPTHS if f"td, L = {L}" in k_fit)
         + (": more TD steps than the model has layers, so a layer does more than one step of the fitted kernel (what a step size above 1 would do)."
            if all(k_fit[f"td, L = {L}"]["k"] > L for L in CONTEST_DEPTHS if f"td, L = {L}" in k_fit) else "."))


# %% [markdown]
# ### Is it TD? The controls
#
# An account that fits models trained without TD as well as models trained with it is not a TD mechanism. The
# residual ratio of level + TD iterates on each objective's models, per depth, with the difference from TD's own
# models in units of its standard error (positive: the TD account fits the TD-trained models better):

# %%
#| code-fold: true
def _z(a, b): return ((b.mean() - a.mean()) / math.hypot(a.std() / math.sqrt(len(a)), b.std() / math.sqrt(len(b)))).item()
ctrl_rows = []
for L in (L for L in CONTEST_DEPTHS if f"td, L = {L}" in summaries):
    td_r = summaries[f"td, L = {L}"]["td"]["scores"]["ratio"]
    ctrl_rows.append((L, td_r, {o: summaries[f"{o}, L = {L}"]["td"]["scores"]["ratio"] for o in CONTROLS if f"{o}, L = {L}" in summaries}))
Markdown("| depth | TD models | " + " | ".join(f"{o} models (z)" for o in CONTROLS) + " |\n" + "|---" * (2 + len(CONTROLS)) + "|\n" +
         "\n".join(f"| L = {L} | {ms(t)}, $k = {k_fit[cell_of('td', L)]['k']}$ | " + " | ".join(f"{ms(c[o])} ({_z(t, c[o]):+.1f}), $k = {k_fit[cell_of(o, L)]['k']}$" if o in c else "—" for o in CONTROLS)
                   + " |" for L, t, c in ctrl_rows))

# %%
zs = {(L, o): _z(t, c[o]) for L, t, c in ctrl_rows for o in c}
n_pos = sum(z > 2 for z in zs.values())
look_ctrl = {o: summaries[f"{o}, L = 3"]["lookahead"]["scores"]["ratio"].mean().item() for o in CONTEST_OBJECTIVES if f"{o}, L = 3" in summaries}
n_neg = sum(z < -2 for z in zs.values())
Markdown(f"In {n_pos} of the {len(zs)} comparisons the TD account fits the TD-trained models better than the control's by more than two standard errors, "
         f"in {n_neg} worse, and in the other {len(zs) - n_pos - n_neg} the difference is within two standard errors. "
         + ("So the form *level + kernel TD iterates* is not a TD signature: with its $k$ refitted it describes models trained by Monte-Carlo or supervised targets about "
            "as well. " if n_pos < len(zs) / 2 else "") +
         f"What does change with the objective is the fitted number of iterates (the $k$ in each cell) and, at shallow depth, the winner itself: the lookahead's residual "
         f"ratio at $L = 3$ is " + ", ".join(f"{r:.2f} on {o} models" for o, r in look_ctrl.items()) + ". "
         "With independent successors (td-independent) the fit picks one iterate at every depth measured, the kernel-smoothed reward.")

# %% [markdown]
# ### Linear attention on the same contest
#
# Is the winner a property of softmax attention? Chapter 7's linear-attention Transformer is the architecture for which
# Wang et al. (2025) constructed TD: one layer is one iteration of batch linear TD, whose update at a state $x$ weighs
# the context's TD errors by the linear kernel $\phi(x)^\top C\, \phi(S_{j-1})$, with no softmax and no normalisation.
# The same contest is run on such models, trained at the headline cell's settings (states, features, context, depth,
# discount, TD objective and budget) at the learning rate that chapter 7b tuned for linear attention on this very cell.
# Each model reads the transition prompt rebuilt from the state tokens (`LinearOnStateTokens`,
# [appendix D](mechanism_studies.html)), so the candidates, grids, fits and residual ratio are those above. What each
# outcome would look like, stated before the measurement:
#
# - **Wang et al.'s construction.** The contest has no unnormalised linear kernel. Its nearest candidate is level + TD
#   iterates at the smallest $\beta$ of its grid: to first order in $\beta$, $\mathrm{softmax}_j(\beta a_j)$ is the
#   uniform average plus $\beta/n$ times the centred linear kernel $a_j - \bar a$, $a_j = \phi(x)^\top\phi(S_{j-1})$.
#   That candidate wins, with several iterates.
# - **The softmax models' algorithm.** Level + TD iterates wins with constants near the headline fit, and the models
#   carry the level: their task means follow $\bar R/(1-\gamma)$ as the softmax models' do.
# - **Another algorithm.** The lookahead, certainty equivalence, the Bayes posterior mean or scaled $v_\pi$ wins.
# - **Little learned.** A nearly flat output leaves every fitted scale near zero and every ratio near 1: no candidate
#   separates.

# %%
#| echo: false
lin_data = load_contest("data", names=("contest_linear.json",))
lin_cell = lin_data["cells"]["linear, L = 3"]
lin_fit_seeds = lin_cell["seeds"][:10]
lin = contest_summary(lin_cell, fit_seeds=lin_fit_seeds)
lin_win = contest_winner(lin)
n_lin = len(lin["td"]["seeds"])
Markdown(provenance_note(lin_data["provenance"]["contest_linear.json"], "The runs and sums in `contest_linear.json`")
         + f" Learning rate {lin_cell['config']['lr']:g} (chapter 7b's tuned value; the softmax models' "
         f"{EMERGENCE.lr:g}); {len(lin_cell['seeds'])} seeds, {len(lin_cell['diverged'])} diverged; constants fitted on "
         f"seeds {lin_fit_seeds[0]} to {lin_fit_seeds[-1]}, scored on the {n_lin} others.")


# %% [markdown]
# The contest on the linear models, with the same candidates' residual ratio on the softmax models of the headline cell
# for comparison (mean ± s.e. over the scored seeds):

# %%
#| code-fold: true
def theta_text(fit):
    "A fitted grid point as maths."
    return ", ".join(f"${sym[a]} = {x:g}$" for a, x in fit["theta"].items())

lin_rows = [f"| {CONTEST_NAMES[k]} | {theta_text(v['fits'][0])}, $\\lambda = {v['fits'][0]['level']:.2f}$ | "
        f"{ms(v['scores']['ratio'])} | {ms(v['scores']['correlation'])} | {ms(v['scores']['centred_1mr2'])} | "
        f"{ms(head[k]['scores']['ratio'])} |" for k, v in lin.items()]
Markdown("| candidate | fitted on linear models | residual ratio | residual correlation | centred $1 - R^2$ "
         "| residual ratio, softmax models (headline) |\n|---|---|---|---|---|---|\n" + "\n".join(lin_rows))


# %% [markdown]
# How much the linear models learn: their own value error, raw and centred (shape only), and how their task means follow
# the context-mean value (the slope of the task mean on $\bar R/(1-\gamma)$ over the held-out tasks), against the
# softmax models of the headline cell and two estimates that learn nothing about shape: the context mean and zero.

# %%
#| code-fold: true
def own_errors(cell):
    "Per seed, from the saved sums: the models' MSVE, centred MSVE and level slope, and two baselines' errors."
    r = [st["run"] for st in cell["stats"]]
    per = lambda f: torch.tensor([f(x) for x in r], dtype=torch.float64)
    return dict(msve=per(lambda x: x["msve"]), cmsve=per(lambda x: (x["Syy"] - 2 * x["Syp"] + x["Spp"]) / x["B"]),
                slope=per(lambda x: x["Lmy"] / x["Lmm"]), flat_c=per(lambda x: x["Spp"] / x["B"]),
                mean=per(lambda x: (x["Lmm"] - 2 * x["Lmp"] + x["Lpp"] + x["Spp"]) / x["B"]),
                zero=per(lambda x: (x["Lpp"] + x["Spp"]) / x["B"]))

lin_err, soft_err = own_errors(lin_cell), own_errors(head_cell)
Markdown("| estimate | seeds | MSVE | centred MSVE | slope of the task mean on $\\bar R/(1-\\gamma)$ |\n"
         "|---|---|---|---|---|\n"
         f"| linear-attention models | {len(lin_err['msve'])} | {ms(lin_err['msve'])} | {ms(lin_err['cmsve'])} | "
         f"{ms(lin_err['slope'])} |\n"
         f"| softmax models (headline cell) | {len(soft_err['msve'])} | {ms(soft_err['msve'])} | "
         f"{ms(soft_err['cmsve'])} | {ms(soft_err['slope'])} |\n"
         f"| context mean $\\bar R/(1-\\gamma)$ | {len(lin_err['msve'])} | {ms(lin_err['mean'])} | "
         f"{ms(lin_err['flat_c'])} | 1 |\n"
         f"| zero | {len(lin_err['msve'])} | {ms(lin_err['zero'])} | {ms(lin_err['flat_c'])} | 0 |")

# %%
#| echo: false
lw, lr_, l_margin, l_se, l_lower = lin_win
l_rate, l_lo, l_hi = rate_interval(l_lower, n_lin)
l_theta = lin["td"]["fits"][0]["theta"]
flattest = l_theta["beta"] == min(CONTEST_GRIDS["td"]["beta"])
no_level = bool((lin_err["msve"] > lin_err["mean"]).all()) and lin_err["slope"].max() < soft_err["slope"].min()
assert lw == "td" and l_margin > 2 * l_se and no_level, (lin_win, lin_err["slope"].max(), soft_err["slope"].min())
Markdown(
    f"On the linear models {CONTEST_NAMES[lw]} wins: residual ratio {ms(lin[lw]['scores']['ratio'])} against "
    f"{ms(lin[lr_]['scores']['ratio'])} for the runner-up, {CONTEST_NAMES[lr_]}, lower in {l_lower} of {n_lin} seeds "
    f"(rate {l_rate:.2f}, 95% interval {l_lo:.2f} to {l_hi:.2f}; paired margin {l_margin:.3f} ± {l_se:.3f}). Its fit "
    f"uses $k = {l_theta['k']}$ iterates at $\\beta = {l_theta['beta']:g}$"
    + (", the flattest kernel of the grid, the contest's nearest point to Wang et al.'s linear kernel (and at the "
       "grid's edge, so a flatter kernel might fit better still)" if flattest else "")
    + f", against $k = {tdf['theta']['k']}$, $\\beta = {tdf['theta']['beta']:g}$ on the softmax models. "
    f"But the linear models do not carry the level: their task means move by {ms(lin_err['slope'])} per unit of "
    f"$\\bar R/(1-\\gamma)$, against {ms(soft_err['slope'])} for the softmax models, so the fitted level coefficient is "
    f"$\\lambda = {lin['td']['fits'][0]['level']:.2f}$, cancelling most of the iterates' own level; their MSVE, "
    f"{lin_err['msve'].mean():.2f}, is above the context mean's ({lin_err['mean'].mean():.2f}) in every seed and "
    f"near zero's ({lin_err['zero'].mean():.2f}). In shape they learn a little: centred MSVE "
    f"{ms(lin_err['cmsve'])} against {ms(lin_err['flat_c'])} for a flat estimate and {ms(soft_err['cmsve'])} for the "
    f"softmax models.\n\n**The answer**, measured on this cell at this budget: the *level* of level + TD iterates is "
    f"specific to softmax attention here, since the linear models do not learn it; the *shape* they do compute, small as "
    f"it is, follows the same kernel TD iterates, at the flattest kernel on the grid: the outcome stated above for "
    f"Wang et al.'s construction. That they run the construction itself is not shown: the contest has no linear-kernel "
    f"candidate, and the models were trained with the softmax models' budget of {EMERGENCE.n_steps} steps, shorter "
    f"than chapter 7a's linear runs.")

# %%
#| echo: false
record_claim("linear-contest", f"On linear-attention models at the headline cell, {CONTEST_NAMES[lw]} at its flattest "
             f"kernel has the lowest residual ratio ({l_lower}/{n_lin} seeds), but the models carry no level (task-mean "
             f"slope {lin_err['slope'].mean():.2f} against {soft_err['slope'].mean():.2f} for softmax).",
             "measured", "mechanism", "#linear-attention-on-the-same-contest")

# %% [markdown]
# ## The evidence
#
# The contest says *what* function the models compute. Three kinds of evidence follow: the fitted algorithm as a
# library object that predicts a model it was not fitted to; interventions at test time, where the candidates'
# predictions are stated before the models are run; and the constants read off the weights. The theorem behind the
# winner, the stationary points of pretraining in the population model, is the subject of the next page,
# [Stationary points of pretraining](stationary_points.html) (chapter 6d). The models are the saved runs of the
# headline configuration: seeds 0 to 9 (the emergence chapter's) to fit, seeds 10 to 39 to test; `load_models`
# rebuilds them exactly from `nbs/data/mechanism_runs.json` and `nbs/data/contest_runs.json`.

# %%
saved = json.loads(Path("data/mechanism_runs.json").read_text())
fit_runs, fresh_runs = load_models(saved["runs"]["fit"]), load_models(saved["runs"]["fresh"])
test_eq(fit_runs[0][0], dataclasses.replace(EMERGENCE, seed=fit_runs[0][0].seed))
for r, (c, m) in zip(saved["runs"]["fit"], fit_runs):   # the saved parameters reproduce the value weights the training loop recorded
    test_close(m.value_weights(), torch.tensor(r["final"]["value_weights"], dtype=torch.float64), eps=1e-12)
Markdown(provenance_note(saved["provenance"], "The saved runs"))

# %% [markdown]
# ### The stated algorithm, as a library object
#
# `fit_learned_algorithm(results)` (defined with the contest at the end of the page) fits the winner to trained runs of
# one configuration exactly as the contest does and returns a `LearnedAlgorithm` whose `.values(config, tasks, states)`
# predicts a trained model's output at every state of each task from its context. Fitted on the book's seeds 0 to 9,
# it reproduces the contest's constants, and it predicts a model it was not fitted to (seed 39) from the context alone:

# %%
algo = fit_learned_algorithm(fit_runs)
test_eq((algo.k, algo.beta), (tdf["theta"]["k"], tdf["theta"]["beta"]))
test_close(torch.tensor([algo.level, algo.scale]), torch.tensor([tdf["level"], tdf["scale"]]), eps=1e-6)
new_runs = load_models(json.loads(Path("data/contest_runs.json").read_text())["cells"]["headline"]["runs"])
scored_runs = fresh_runs + new_runs                       # seeds 10 to 39, the contest's scored seeds
c39, m39 = new_runs[-1]
t39, s39, Z39 = held_out_prompts(dataclasses.replace(c39, eval_tasks=128))
with torch.no_grad(): y39 = m39.predict(Z39, n=c39.n)
p39 = algo.values(c39, t39, s39)
cen = lambda v, t: v - (t.d_pi * v).sum(-1, keepdim=True)
ratio39 = ((t39.d_pi * (cen(y39, t39) - cen(p39, t39)) ** 2).sum() / (t39.d_pi * (cen(y39, t39) - cen(t39.v_pi, t39)) ** 2).sum()).item()
test_close(ratio39, hr["td"][head["td"]["seeds"].index(39)].item(), eps=1e-9)

# %%
#| echo: false
Markdown(f"Fitted: $k = {algo.k}$, $\\beta = {algo.beta:g}$, $\\lambda = {algo.level:.3f}$, $\\sigma = {algo.scale:.3f}$. "
         f"On seed {c39.seed}, from the contexts alone, its residual ratio is {ratio39:.3f}, the contest's number for that seed.")

# %% [markdown]
# ### Interventions at test time: shift every reward
#
# Adding a constant $c$ to every reward of a prompt separates the candidates by their *level*, which the residual
# ratio ignores. Each candidate's prediction follows from its form, and is stated before the measurement. For the
# winner: the softmax weights of a target sum to one, so with constant rewards $c$ the TD iterates are constant,
# $u_{t+1} = c + \gamma u_t$, and TD is linear in the rewards; the shape is therefore unchanged and the level moves by
#
# $$\Delta = \frac{c\,\big(\lambda + \sigma (1 - \gamma^k)\big)}{1 - \gamma}.$$

# %%
#| echo: false
shift = 0.5
pred_td = shift * (tdf["level"] + tdf["scale"] * (1 - EMERGENCE.gamma ** tdf["theta"]["k"])) / (1 - EMERGENCE.gamma)
Markdown(f"**Prediction** (constants fitted on seeds 0 to 9, shift $c = {shift:g}$): level + TD iterates moves every value by "
         f"$\\Delta = {pred_td:.3f}$ and leaves the shape unchanged; scaled $v_\\pi$ moves it by $c(\\lambda + \\sigma/(1 - f\\gamma))/(1-\\gamma)$ = "
         f"{shift * (head['v_pi']['fits'][0]['level'] + head['v_pi']['fits'][0]['scale'] * (1 - EMERGENCE.gamma) / (1 - min(head['v_pi']['fits'][0]['theta']['gamma_factor'] * EMERGENCE.gamma, 0.995))) / (1 - EMERGENCE.gamma):.3f}. "
         f"The other candidates' shifts are computed from their fitted forms on the same prompts. The measurement is on the thirty models of seeds 10 to 39, "
         f"128 held-out tasks each, with rewards $R + c$ in the prompt (the Bayes candidate is left out: its prior does not allow a shifted reward).")


# %%
#| code-fold: true
def _shifted(tasks, c): return TaskBatch(tasks.P, tasks.r + c, tasks.phi, tasks.d_pi, tasks.v_pi, tasks.gamma)
def _prompt(tasks, states):
    rows = torch.arange(len(tasks))[:, None]
    return build_prompt(tasks.phi[rows, states], tasks.r[rows, states[:, :-1]], tasks.phi)
shift_rows = {k: [] for k in ("model", "td", "lookahead", "ce", "v_pi")}
shape_change = []
for c, m in scored_runs:
    cfg = dataclasses.replace(c, eval_tasks=128)
    tasks, states, Z = held_out_prompts(cfg)
    t2 = _shifted(tasks, shift)
    with torch.no_grad(): y0, y1 = m.predict(Z, n=c.n), m.predict(_prompt(t2, states), n=c.n)
    w = tasks.d_pi
    shift_rows["model"].append(((y1 - y0) * w).sum(-1).mean().item())
    cen = lambda v: v - (w * v).sum(-1, keepdim=True)
    shape_change.append(((w * (cen(y1) - cen(y0)) ** 2).sum() / (w * cen(y0) ** 2).sum()).item())
    for k in ("td", "lookahead", "ce", "v_pi"):
        f = head[k]["fits"][0]
        u0, u1 = (candidate_values_at(k, cfg, t, states, f["index"]) for t in (tasks, t2))
        lv = f["level"] * (context_mean_values(t2, states) - context_mean_values(tasks, states))
        shift_rows[k].append(((lv + f["scale"] * (u1 - u0)) * w).sum(-1).mean().item())
shift_t = {k: torch.tensor(v, dtype=torch.float64) for k, v in shift_rows.items()}
Markdown("| | level shift, mean ± s.e. over seeds | error against the model's shift |\n|---|---|---|\n" +
         "\n".join(f"| {'trained models' if k == 'model' else CONTEST_NAMES[k]} | {ms(v)} | {'—' if k == 'model' else ms((v - shift_t['model']).abs())} |" for k, v in shift_t.items()))

# %%
#| echo: false
closest = min((k for k in shift_t if k != "model"), key=lambda k: (shift_t[k] - shift_t["model"]).abs().mean().item())
se_ = lambda x: (x.std() / math.sqrt(len(x))).item()
Markdown(f"**Measurement.** The models' values move by {ms(shift_t['model'])} against the winner's predicted {pred_td:.3f} "
         f"(computed: {ms(shift_t['td'])}): every candidate under-predicts it, and their errors differ by less than "
         f"{max((shift_t[k] - shift_t['model']).abs().mean().item() for k in shift_t if k != 'model') - (shift_t[closest] - shift_t['model']).abs().mean().item():.2f}"
         f", against standard errors of {max(se_(shift_t[k] - shift_t['model']) for k in shift_t if k != 'model'):.2f}"
         f", so this intervention does not separate the candidates (the closest is "
         f"{CONTEST_NAMES[closest]}). The models' shift corresponds to a level sensitivity "
         f"$\\Lambda = {shift_t['model'].mean() * (1 - EMERGENCE.gamma) / shift:.3f}$ against the winner's "
         f"{pred_td * (1 - EMERGENCE.gamma) / shift:.3f} (fitted pooled on seeds 0 to 9; the weights give a per-seed reading below). The shape moves too, by a share "
         f"{torch.tensor(shape_change).mean():.3f} of its own centred variance, so the models are not exactly linear in the rewards outside their training range "
         f"($R + c$ reaches {1 + shift:g}).")


# %% [markdown]
# ### Three more interventions: shuffled successors, longer contexts, a patched uniform layer
#
# The contest scored the candidates on prompts like those the models were trained on. Three interventions move the
# prompt, or the inside of a model, to where the candidates disagree. Each candidate's prediction is computed from its
# form with its constants frozen (fitted on seeds 0 to 9, as in the contest) and is stated before the models are run;
# the measurement is on the thirty scored seeds (10 to 39), 128 held-out tasks each. Unlike the contest's rules, these
# predictions were not fixed at an earlier commit: they were written and measured in one session [ours]. The score of
# a prediction is the *change ratio*: with $\Delta c_{\text{model}}$ the change of the model's centred values under the
# intervention and $\Delta c_{\text{cand}}$ the candidate's predicted change,
#
# $$\rho_\Delta = \frac{\sum_{\text{tasks}} \sum_x d_\pi(x) \big(\Delta c_{\text{model}}(x) - \Delta c_{\text{cand}}(x)\big)^2}
# {\sum_{\text{tasks}} \sum_x d_\pi(x)\, \Delta c_{\text{model}}(x)^2},$$
#
# 0 when the candidate predicts the change exactly, 1 when it predicts no change. A candidate's prediction is its
# fitted form evaluated on the changed prompt, `candidate_prediction`:

# %%
#| export
def candidate_prediction(name:str,             # a candidate of `CONTEST_GRIDS`
                         fitted:dict,          # its `fit_candidate`: grid point, level and scale
                         config:PretrainConfig,# the prompts' settings (gamma, n; Bayes draws' seed)
                         tasks:TaskBatch,      # the tasks
                         states:torch.Tensor,  # (B, n+1) one context per task
                        )->torch.Tensor:       # (B, s) the fitted candidate's values
    "A fitted candidate's values from a context: level * R-bar / (1 - gamma) + scale * u_theta."
    u = candidate_values_at(name, config, tasks, states, fitted["index"])
    return fitted["level"] * context_mean_values(tasks, states) + fitted["scale"] * u


# %% [markdown]
# **(a) Shuffled successors.** In the state-token prompt a context token's successor is the next column: the
# layers read it through $Z\Pi$, while attention itself ignores the order of the columns. `shuffle_context` puts each
# context's states in a random order. Every token, with its reward, stays in the prompt; only the successors change,
# each now another state of the context, unrelated to the chain.

# %%
#| export
def context_prompt(tasks:TaskBatch,      # the tasks
                   states:torch.Tensor,  # (B, n+1) one context per task, in the order written
                  )->torch.Tensor:       # (B, d+2, n+1+s) the prompt, every state a query
    "The prompt of each task's context, in the given order, querying every state."
    rows = torch.arange(len(tasks))[:, None]
    return build_prompt(tasks.phi[rows, states], tasks.r[rows, states[:, :-1]], tasks.phi)

def shuffle_context(states:torch.Tensor,  # (B, n+1) contexts S_0..S_n
                    seed:int,             # seed of the permutations
                   )->torch.Tensor:       # (B, n+1) each context's states in a random order
    "Each context's states in a random order: the same tokens, each successor another state."
    gen = torch.Generator().manual_seed(int(seed))
    order = torch.argsort(torch.rand(states.shape, generator=gen, dtype=torch.float64), -1)
    return states.gather(-1, order)


# %% [markdown]
# Checks on eight held-out tasks and a random three-layer model (the toy of this page's checks): a shuffled context
# holds the same states, in another order.

# %%
toy = SoftmaxICTD(4, 3, init_gain=1., seed=3)
toy_tasks, toy_states, toy_Z = held_out_prompts(dataclasses.replace(EMERGENCE, eval_tasks=8))
_sh = shuffle_context(toy_states, 0)
test_eq(_sh.sort(-1).values, toy_states.sort(-1).values)
test_eq(bool((_sh == toy_states).all()), False)

# %% [markdown]
# What each candidate predicts, from its form. Level + TD iterates bootstraps on the successor's value in every
# iterate, so its shape changes. The lookahead's second term, the smoothed *next* reward, becomes a smoothed random
# reward of the context, nearly flat, and it keeps its first term. Certainty equivalence counts the shuffled
# transitions, and its empirical chain jumps to the context's states at random: its value keeps the reward's shape.
# The Bayes candidate's prior allows only moves to the next two states of the chain, so most shuffled transitions
# carry no evidence and its prediction barely moves; scaled $v_\pi$ does not read the context's transitions at all.
# The predicted change of the centred values, as a share of the model's centred variance on the original prompts
# (mean ± s.e. over the thirty seeds; computed from the candidates alone):

# %%
#| echo: false
iv_saved = json.loads(Path("data/contest_interventions.json").read_text())
iv = iv_saved["seeds"]
test_eq([r["seed"] for r in iv], head["td"]["seeds"])
col = lambda part, key, name=None: torch.tensor([r[part][key] if name is None else r[part][key][name] for r in iv])
lcol = lambda n, key, name=None: torch.tensor([r["lengthen"][str(n)][key] if name is None else r["lengthen"][str(n)][key][name] for r in iv])
names_iv = list(iv[0]["shuffle"]["ratio"])
Markdown("| candidate | predicted change of the shape under shuffling |\n|---|---|\n"
         + "\n".join(f"| {CONTEST_NAMES[k]} | {ms(col('shuffle', 'predicted', k))} |" for k in names_iv))

# %% [markdown]
# The measurement: how much the models' shape changes, how much of that change each candidate predicts, and the
# residual ratio of each frozen candidate on the shuffled prompts.

# %%
#| echo: false
sh_cr = {k: col("shuffle", "change_ratio", k) for k in names_iv}
sh_best = min(sh_cr, key=lambda k: sh_cr[k].mean().item())
sh_next = min((k for k in sh_cr if k != sh_best), key=lambda k: sh_cr[k].mean().item())
sh_lower = int((sh_cr[sh_best] < sh_cr[sh_next]).sum())
Markdown("| candidate | change ratio $\\rho_\\Delta$ | residual ratio on shuffled prompts |\n|---|---|---|\n"
         + "\n".join(f"| {CONTEST_NAMES[k]} | {ms(sh_cr[k])} | {ms(col('shuffle', 'ratio', k))} |" for k in names_iv)
         + f"\n\nThe models' shape changes by {ms(col('shuffle', 'model'))} of its centred variance. "
         f"{CONTEST_NAMES[sh_best].capitalize()} predicts the change best (change ratio {sh_cr[sh_best].mean():.2f}, lower than "
         f"{CONTEST_NAMES[sh_next]}'s {sh_cr[sh_next].mean():.2f} in {sh_lower} of {len(iv)} seeds), and its "
         f"predicted change, {ms(col('shuffle', 'predicted', sh_best))}, is close to the models' own.")

# %%
assert sh_best == "td" and sh_lower >= 25, (sh_best, sh_lower)

# %% [markdown]
# **(b) Longer contexts than in training.** The models were trained at $n = 30$. Each task gets one trajectory of
# 120 transitions, and the models and the candidates read its first 30, 60 and 120. Softmax attention averages over
# the context, so every candidate's form is defined at any $n$ and tends to its $n = \infty$ limit. The predictions:
# certainty equivalence and the Bayes posterior mean converge to $v_\pi$ as the context grows, so under them the
# models' error should fall towards scaled $v_\pi$'s; $k$ TD iterates with a fixed kernel converge to $k$ population
# iterates, which keep an error of their own. The candidates' value errors (MSVE against $v_\pi$) at each length,
# computed from the candidates alone:

# %%
#| echo: false
lengths = sorted(int(n) for n in iv[0]["lengthen"])
Markdown("| candidate | " + " | ".join(f"MSVE at n = {n}" for n in lengths)
         + " | predicted change of the shape, 30 to " + str(lengths[-1]) + " |\n" + "|---" * (len(lengths) + 2) + "|\n"
         + "\n".join(f"| {CONTEST_NAMES[k]} | " + " | ".join(ms(lcol(n, 'msve_candidates', k)) for n in lengths)
                     + f" | {ms(lcol(lengths[-1], 'predicted', k))} |" for k in names_iv))

# %% [markdown]
# The measurement: the models' value error at each length, and how well each frozen candidate accounts for the
# models' errors (residual ratio) and for their change from $n = 30$ (change ratio).

# %%
#| echo: false
ln_msve = {n: lcol(n, "msve") for n in lengths}
ln_cr = {k: lcol(lengths[-1], "change_ratio", k) for k in names_iv}
ln_best = min(ln_cr, key=lambda k: ln_cr[k].mean().item())
ln_gap = (ln_msve[lengths[-1]] - lcol(lengths[-1], "msve_candidates", "td"))
Markdown("| | " + " | ".join(f"n = {n}" for n in lengths) + f" | change ratio, 30 to {lengths[-1]} |\n"
         + "|---" * (len(lengths) + 2) + "|\n"
         + "| trained models, MSVE | " + " | ".join(ms(ln_msve[n]) for n in lengths) + " | |\n"
         + "\n".join(f"| {CONTEST_NAMES[k]}, residual ratio | " + " | ".join(ms(lcol(n, 'ratio', k)) for n in lengths)
                     + f" | {ms(ln_cr[k])} |" for k in names_iv)
         + f"\n\nThe models generalise beyond their training length: their MSVE falls from {ln_msve[30].mean():.2f} at "
         f"$n = 30$ to {ln_msve[lengths[-1]].mean():.2f} at $n = {lengths[-1]}$. It falls as level + TD iterates "
         f"predicts, not as certainty equivalence or the Bayes mean do: at $n = {lengths[-1]}$ the models' MSVE minus "
         f"the winner's is {ms(ln_gap)}, while it stays above certainty equivalence's "
         f"({lcol(lengths[-1], 'msve_candidates', 'ce').mean():.2f}) and the Bayes mean's "
         f"({lcol(lengths[-1], 'msve_candidates', 'bayes').mean():.2f}). The winner's residual ratio goes from "
         f"{lcol(30, 'ratio', 'td').mean():.2f} to {lcol(lengths[-1], 'ratio', 'td').mean():.2f}, while "
         + ", ".join(f"{CONTEST_NAMES[k]}'s goes from {lcol(30, 'ratio', k).mean():.2f} to "
                     f"{lcol(lengths[-1], 'ratio', k).mean():.2f}" for k in names_iv if k != "td")
         + f"; {CONTEST_NAMES[ln_best]} predicts the change best (change ratio {ln_cr[ln_best].mean():.2f}, against "
         f"{min(ln_cr[k].mean().item() for k in names_iv if k != ln_best):.2f} for the next).")

# %%
ln_lower = {k: int((ln_cr["td"] < ln_cr[k]).sum()) for k in names_iv if k != "td"}
assert ln_best == "td" and min(ln_lower.values()) >= 25, ln_lower
above = {k: ln_msve[lengths[-1]] - lcol(lengths[-1], "msve_candidates", k) for k in ("ce", "bayes")}
assert (ln_msve[lengths[-1]] < ln_msve[30]).all(), ln_msve
assert all(v.mean() > 3 * v.std() / math.sqrt(len(v)) for v in above.values()), above


# %% [markdown]
# **(c) Patching the uniform layer from another task.** The anatomy (*The anatomy of a trained model*) finds, in nearly every seed, one layer
# whose attention is uniform; its writes are then one context-wide average. `patched_predict` runs a model on the
# prompt of task $A$ while one layer's writes into some token rows are replaced by what that layer writes on the
# prompt of task $B$ (the other layers run on $A$'s prompt throughout).

# %%
#| export
def patched_predict(model:SoftmaxICTD,      # the model
                    Z:torch.Tensor,         # (B, d+2, N) prompts of the tasks read
                    Z_donor:torch.Tensor,   # (B, d+2, N) prompts whose writes are patched in
                    n:int,                  # context length
                    layer:int,              # the patched layer (0-based)
                    rows:list,              # token rows whose writes come from the donor
                   )->torch.Tensor:         # (B, q) the value row at the queries
    "The model's output on `Z`, layer `layer`'s writes into `rows` taken from its run on `Z_donor`."
    Za, Zb = Z, Z_donor
    with torch.no_grad():
        for l in range(model.n_layers):
            p = model.layer(l).params(Za)
            na, nb = model.update(Za, *p, n), model.update(Zb, *p, n)
            if l == layer:
                na = na.clone()
                na[..., rows, :] = Za[..., rows, :] + (nb - Zb)[..., rows, :]
            Za, Zb = na, nb
    return Za[..., model.d + 1, n + 1:]


# %% [markdown]
# Patched from the same prompt, nothing changes; the last layer's value write patched from the donor adds the donor's
# write to the value row the model had before that layer:

# %%
test_close(patched_predict(toy, toy_Z, toy_Z, 30, 1, list(range(6))), toy.predict(toy_Z, n=30),
           eps=1e-12)
_don = toy_Z[torch.roll(torch.arange(8), 1)]
_va, _vb = layer_values(toy, toy_Z, 30), layer_values(toy, _don, 30)
test_close(patched_predict(toy, toy_Z, _don, 30, 2, [5]), _va[2] + _vb[3] - _vb[2], eps=1e-12)

# %% [markdown]
# All five candidates share the level term $\lambda \bar R/(1-\gamma)$, so this intervention tests the level, not
# the candidates' shapes. Let $\Lambda = \lambda + \sigma(1 - \gamma^k)$ be the winner's whole sensitivity to the
# context mean (the level moves by $\Lambda\, c/(1-\gamma)$ under a reward shift $c$). Three accounts of where the
# level is computed, each with its prediction for the *share* $s$ of $\Lambda$ by which the output's level moves per
# unit change of $\bar R/(1-\gamma)$ from $A$ to $B$:
#
# * **the uniform layer computes the whole level** and the selective layers the shape: patching all its writes gives
#   $s = 1$ and leaves the shape unchanged;
# * **it computes only the level term** $\lambda\bar R/(1-\gamma)$, and the TD iterates their own level from $A$'s
#   rewards: $s = \lambda/\Lambda$;
# * **its value write carries the level** (the reading of an earlier version of this page): the value-row patch
#   moves the level and the feature- and reward-row patch does not.
#
# And one prediction that follows from the architecture alone: where the uniform layer is the last layer, no layer
# reads its feature and reward rows, so patching them changes nothing, exactly.

# %%
#| echo: false
Lam = tdf["level"] + tdf["scale"] * (1 - EMERGENCE.gamma ** tdf["theta"]["k"])
Markdown(f"With the fitted constants $\\lambda = {tdf['level']:.3f}$ and $\\Lambda = {Lam:.3f}$, the second account "
         f"predicts $s = {tdf['level'] / Lam:.2f}$.")

# %%
#| echo: false
pos = torch.tensor([r["uniform_layer"] for r in iv])
share = {k: col("patch", k, "slope") / Lam for k in ("tokens", "value", "all")}
pshape = {k: col("patch", k, "shape") for k in ("tokens", "value", "all")}
rows_txt = dict(tokens="feature and reward rows", value="value row", all="all rows")
at = lambda x, l: ms(x[pos == l]) if (pos == l).sum() > 1 else (f"{x[pos == l].item():.2f}" if (pos == l).sum() else "—")
Markdown("| uniform layer | seeds | patched rows | share $s$ of the level moved | change of the shape |\n|---|---|---|---|---|\n"
         + "\n".join(f"| layer {l + 1} | {int((pos == l).sum())} | {rows_txt[k]} | {at(share[k], l)} | {at(pshape[k], l)} |"
                     for l in range(3) for k in share if (pos == l).any()))

# %%
last = pos == 2
assert last.sum() >= 5 and share["tokens"][last].abs().max() < 1e-9, share["tokens"][last]
first = pos == 0
s_all = share["all"][first]
assert s_all.mean() - 2 * s_all.std() / math.sqrt(len(s_all)) > tdf["level"] / Lam, s_all
assert s_all.mean() + 2 * s_all.std() / math.sqrt(len(s_all)) < 1, s_all

# %%
#| echo: false
s_tok = share["tokens"][first]
Markdown(f"Where the uniform layer is layer 3 ({int(last.sum())} seeds), patching its feature and reward rows changes "
         f"nothing, as the architecture requires. Where it is layer 1 ({int(first.sum())} seeds), patching all its writes "
         f"moves the level by a share {ms(s_all)} of $\\Lambda$: more than the level term alone "
         f"($\\lambda/\\Lambda = {tdf['level'] / Lam:.2f}$), less than the whole level, and the shape moves too "
         f"({ms(pshape['all'][first])} of its variance). Its feature and reward rows carry {ms(s_tok)} of the level and its "
         f"value row {ms(share['value'][first])}: the level does travel partly through the re-embedded rows, which later "
         f"layers read, so the value-write reading is incomplete. The uniform layer computes most of the level, "
         f"not all of it, and not the level alone.")

# %%
#| code-fold: true
#| label: fig-contest-interventions
#| fig-cap: "Figure 6b.2. Test-time interventions on the thirty scored seeds. Left: the change ratio of each frozen candidate (0: it predicts the models' change of shape exactly; 1: it predicts no change) under shuffled successors and at n = 120. Middle: the value error of the trained models and of each frozen candidate against the context length; training used n = 30 (dotted). Right: the share of the winner's level moved by patching the uniform layer's writes from another task, by which layer is uniform and which rows are patched. Bars and bands: mean ± one standard error over seeds."
#| fig-alt: "Three panels. Left, grouped bars of the change ratio per candidate for two interventions, level + TD iterates lowest in both. Middle, MSVE against context length 30, 60, 120 on a log axis for the trained models and the five candidates; the models' curve follows level + TD iterates. Right, bars of the level share moved by the patch, grouped by the uniform layer's position, for three choices of patched rows."
fig, axs = plt.subplots(1, 3, figsize=(14, 4.3))
se = lambda x: (x.std() / math.sqrt(len(x))).item()
for i, (lab, cr) in enumerate((("shuffled successors", sh_cr), (f"n = {lengths[-1]}", ln_cr))):
    xs = torch.arange(len(names_iv)) + (i - 0.5) * 0.38
    axs[0].bar(xs, [cr[k].mean() for k in names_iv], 0.38, yerr=[se(cr[k]) for k in names_iv], label=lab,
               color=("#0072B2", "#E69F00")[i])
axs[0].set_xticks(range(len(names_iv)), [CONTEST_NAMES[k].replace("level + ", "") for k in names_iv],
                  rotation=20, ha="right")
axs[0].set(ylabel="change ratio (lower: predicted better)", title="Predicting the change")
axs[0].legend(fontsize=8)
axs[1].errorbar(lengths, [ln_msve[n].mean() for n in lengths], [se(ln_msve[n]) for n in lengths], color="k", lw=2.5,
                marker="o", label="trained models")
for k, c_ in zip(names_iv, OKABE_ITO):
    axs[1].plot(lengths, [lcol(n, "msve_candidates", k).mean() for n in lengths], "--", marker=".", color=c_,
                label=CONTEST_NAMES[k])
axs[1].axvline(30, color="0.5", ls=":", lw=0.8)
axs[1].set(xscale="log", xlabel="context length n", ylabel="MSVE (held-out tasks)", title="Beyond the training length")
axs[1].set_xticks(lengths); plain_log_ticks(axs[1], "x"); axs[1].xaxis.set_minor_formatter(NullFormatter())
axs[1].legend(fontsize=7)
groups = [l for l in range(3) if (pos == l).sum() > 1]
for j, k in enumerate(share):
    xs = torch.arange(len(groups)) + (j - 1) * 0.27
    axs[2].bar(xs, [share[k][pos == l].mean() for l in groups], 0.27, yerr=[se(share[k][pos == l]) for l in groups],
               label=rows_txt[k], color=OKABE_ITO[j + 2])
axs[2].axhline(1, color="k", lw=0.8, ls="--"); axs[2].axhline(tdf["level"] / Lam, color="0.4", lw=0.8, ls=":")
axs[2].text(len(groups) - 0.55, 1.02, "whole level", ha="right", va="bottom", fontsize=8)
axs[2].text(len(groups) - 0.55, tdf["level"] / Lam + 0.02, "level term alone", ha="right", va="bottom", fontsize=8)
axs[2].set_xticks(range(len(groups)), [f"layer {l + 1} uniform\n({int((pos == l).sum())} seeds)" for l in groups])
axs[2].set(ylabel="share of the winner's level moved", title="Patching the uniform layer")
axs[2].set_ylim(0, 1.35)
axs[2].legend(fontsize=7.5, ncol=3, loc="upper center", title="patched rows", title_fontsize=8); fig.tight_layout()

# %%
#| echo: false
iv_claims = dict(
    shuffle=f"Under shuffled successors, {CONTEST_NAMES[sh_best]} predicts the models' change of shape best "
            f"(change ratio {sh_cr[sh_best].mean():.2f} against {sh_cr[sh_next].mean():.2f}; 30 seeds).",
    lengthen=f"At n = {lengths[-1]}, four times the training length, the models' MSVE falls to "
             f"{ln_msve[lengths[-1]].mean():.2f} as {CONTEST_NAMES[ln_best]} predicts (30 seeds).",
    patch=f"Patching the uniform layer (layer 1) from another task moves a share {s_all.mean():.2f} of the level "
          f"(between the level term alone and the whole level).")
for key, claim in iv_claims.items():
    record_claim(f"intervention-{key}", claim, "measured", "mechanism", "#fig-contest-interventions")


# %% [markdown]
# ### Reading the algorithm off the weights
#
# The contest and the interventions describe the models from outside. Here the same constants are read from the
# parameters, in the spirit of reading a gradient step off trained linear attention [von Oswald et al. 2023]. A layer
# adds $(V^{\mathrm{cur}} Z + V^{\mathrm{tgt}} Z\Pi) S$ to the tokens; with its attention $S$ frozen at the pattern
# it has on a prompt, the layer is linear in the tokens, and so is the whole model. `frozen_response` propagates a
# change $\delta Z$ of the prompt through that linearisation (optionally keeping, at one layer, only the writes into
# some rows), and returns the change of the value row at the queries.

# %%
#| export
def frozen_response(model:SoftmaxICTD,    # the model
                    Z:torch.Tensor,       # (B, d+2, N) prompts (attention frozen at its values here)
                    n:int,                # context length
                    dZ:torch.Tensor,      # (B, d+2, N) a change of the prompts
                    layer:int=None,       # a layer whose writes of the change keep only `rows`
                    rows:list=None,       # those rows (that layer's other writes are dropped)
                   )->torch.Tensor:       # (B, q) the change of the value row at the queries
    "The output's linear response to `dZ`, every layer's attention frozen at its pattern on `Z`."
    Za, dz = Z, dZ
    with torch.no_grad():
        for l in range(model.n_layers):
            A, V_cur, V_tgt = model.layer(l).params(Za)
            S = torch.softmax((Za.mT @ A @ Za)[..., :n, :], dim=-2)       # (B, n, N): keys 0..n-1
            write = (V_cur @ dz[..., :n] + V_tgt @ dz[..., 1:n + 1]) @ S
            if l == layer:
                kept = write[..., rows, :]
                write = torch.zeros_like(write).index_copy(-2, torch.tensor(rows), kept)
            Za, dz = Za + (V_cur @ Za[..., :n] + V_tgt @ Za[..., 1:n + 1]) @ S, dz + write
    return dz[..., model.d + 1, n + 1:]


# %% [markdown]
# The level constant of the winner is its sensitivity to the context's mean reward: a shift $c$ of every reward moves
# its level by $\Lambda c/(1-\gamma)$ with $\Lambda = \lambda + \sigma(1-\gamma^k)$. Read off the weights, it is the
# $d_\pi$-weighted mean response to a unit shift of the context's reward row, times $1 - \gamma$: `weight_level`.
# For $\theta^*$ ($\alpha = 1$), whose attention reads only the features, the linearisation is exact and $L$ layers
# give $\Lambda = 1 - \gamma^L$, the level of $L$ TD iterates:

# %%
#| export
def weight_level(model:SoftmaxICTD,   # the model
                 tasks:TaskBatch,     # the tasks
                 states:torch.Tensor, # (B, n+1) one context per task
                 layer:int=None,      # as in `frozen_response`: keep only `rows` of its writes
                 rows:list=None,
                )->float:             # Lambda read off the weights (attention frozen)
    "The level sensitivity Lambda to the context's mean reward, from the weights, attention frozen."
    Z, n = context_prompt(tasks, states), states.shape[-1] - 1
    dZ = torch.zeros_like(Z)
    dZ[..., model.d, :n] = 1.
    dv = frozen_response(model, Z, n, dZ, layer, rows)
    return ((tasks.d_pi * dv).sum(-1).mean() * (1 - tasks.gamma)).item()


# %%
_star3 = SoftmaxICTD.from_theta_star(4, 3, 2. * torch.eye(4, dtype=torch.float64), 1., 0.9)
test_close(weight_level(_star3, toy_tasks, toy_states), 1 - 0.9 ** 3, eps=1e-9)
test_close(weight_level(_star3, toy_tasks, toy_states, 0, [5]), 1 - 0.9 ** 3, eps=1e-9)
test_close(weight_level(_star3, toy_tasks, toy_states, 0, [0, 1, 2, 3, 4]), 1 - 0.9 ** 2, eps=1e-9)


# %% [markdown]
# (The last two checks: $\theta^*$ writes only the value row, so dropping a layer's other writes changes nothing, and
# dropping its value write leaves two iterates.) The kernel and the step are read from each layer's matrices:
# `layer_readings` gives the kernel scale $\beta_l = \operatorname{tr} A_{\phi\phi}/d$ of the feature block of $A$ with
# its distance from $\beta_l I$ (0: an isotropic kernel $\beta_l\, \phi^\top\phi$, the form of the winner), and the
# step $\alpha_l = -a_v$ and discount $a_{v'}/(-a_v)$ that the value-row weights $(a_r, a_{v'}, a_v)$ would have if the
# layer were a TD step $\alpha_l(1, \gamma, -1)$.

# %%
#| export
def layer_readings(model:SoftmaxICTD,  # the model
                  )->dict:             # per layer: beta, anisotropy, step, discount, reward
    "Per layer: scale and anisotropy of A's feature block; TD step and discount of the value row."
    d, w = model.d, model.value_weights()
    A = torch.stack([model.layer(l).A.detach()[:d, :d] for l in range(model.n_layers)])
    beta = A.diagonal(dim1=-2, dim2=-1).mean(-1)
    iso = beta[:, None, None] * torch.eye(d, dtype=A.dtype)
    aniso = (A - iso).norm(dim=(-2, -1)) / A.norm(dim=(-2, -1))
    return dict(beta=beta.tolist(), anisotropy=aniso.tolist(), step=(-w[:, 2]).tolist(),
                discount=(w[:, 1] / -w[:, 2]).tolist(), reward=w[:, 0].tolist())


# %%
_rd = layer_readings(_star3)
_got = [_rd["beta"], _rd["anisotropy"], _rd["step"], _rd["discount"]]
test_close(torch.tensor(_got, dtype=torch.float64),
           torch.tensor([[2.] * 3, [0.] * 3, [1.] * 3, [0.9] * 3], dtype=torch.float64), eps=1e-12)

# %% [markdown]
# On all forty models of the headline cell, each seed's own constants (the winner fitted to that seed's outputs alone)
# against the readings of its weights, on 32 held-out tasks per seed. $\Lambda$ is read in three parts, which add up
# exactly because the linearisation is linear: through the uniform layer's value-row write, through its writes into
# the feature and reward rows (read by later layers), and through the selective layers alone.

# %%
#| code-fold: true
# the uniform layer's position over all forty headline seeds (learned kernels of the contest's models)
head_models = fit_runs + scored_runs
head_diag = torch.stack([learned_kernel(m, held_out_prompts(dataclasses.replace(c, eval_tasks=32))[0]).diagonal(dim1=-2, dim2=-1).mean((-2, -1)) for c, m in head_models])
seed_fit = [fit_candidate([st], "td") for st in head_cell["stats"]]
test_eq([c.seed for c, _ in head_models], head_cell["seeds"])
wr = []
for (c, m), f, diag_ in zip(head_models, seed_fit, head_diag):
    t_, s_, _ = held_out_prompts(dataclasses.replace(c, eval_tasks=32))
    u, D = int(diag_.argmin()), m.d
    parts = dict(value=weight_level(m, t_, s_, u, [D + 1]), tokens=weight_level(m, t_, s_, u, list(range(D + 1))))
    rd = layer_readings(m)
    sel = [l for l in range(m.n_layers) if l != u]
    wr.append(dict(seed=c.seed, u=u, fit=f["level"] + f["scale"] * (1 - c.gamma ** f["theta"]["k"]), level=f["level"],
                   k=f["theta"]["k"], beta_fit=f["theta"]["beta"], weights=weight_level(m, t_, s_), **parts,
                   beta_sel=[rd["beta"][l] for l in sel], aniso_sel=[rd["anisotropy"][l] for l in sel],
                   aniso_u=rd["anisotropy"][u], beta_u=rd["beta"][u],
                   step=[rd["step"][l] for l in sel], discount=[rd["discount"][l] for l in sel]))
W = {k: torch.tensor([r[k] for r in wr], dtype=torch.float64) for k in wr[0] if k != "seed"}
W["selective"] = W["weights"] - W["value"] - W["tokens"]
lam_corr = torch.corrcoef(torch.stack([W["fit"], W["weights"]]))[0, 1].item()
Markdown("| constant | from the fit (per seed) | from the weights | |\n|---|---|---|---|\n"
         f"| level sensitivity $\\Lambda$ | {ms(W['fit'])} | {ms(W['weights'])} | correlation over seeds "
         f"{lam_corr:.2f}; largest difference {(W['fit'] - W['weights']).abs().max():.3f} |\n"
         f"| … through the uniform layer's value write | | {ms(W['value'])} | |\n"
         f"| … through its feature and reward writes | | {ms(W['tokens'])} | |\n"
         f"| … through the selective layers alone | | {ms(W['selective'])} | |\n"
         f"| kernel: anisotropy of $A_{{\\phi\\phi}}$, selective layers | isotropic ($\\beta I$) | "
         f"{ms(W['aniso_sel'].flatten())} | uniform layer: {ms(W['aniso_u'])} |\n"
         f"| kernel scale $\\beta$ | {ms(W['beta_fit'])} (grid 0.5 to 8) | {ms(W['beta_sel'].flatten())} | "
         f"uniform layer: {ms(W['beta_u'])} |\n"
         f"| TD steps | $k$ = {ms(W['k'].double())} | summed steps $\\alpha$ = {ms(W['step'].sum(-1))} | |\n"
         f"| discount | $\\gamma$ = {EMERGENCE.gamma:g} (fixed) | median {W['discount'].flatten().median():.2f}, "
         f"quartiles {W['discount'].flatten().quantile(0.25):.2f} to {W['discount'].flatten().quantile(0.75):.2f} | |")

# %%
#| code-fold: true
#| label: fig-contest-weights
#| fig-cap: "Figure 6b.3. The algorithm read off the weights, forty models of the headline cell. Left: the level sensitivity read off the weights (attention frozen) against the one fitted to each seed's outputs, by which layer is uniform; the dashed line is equality. Middle: the anisotropy of each layer's feature block of A (0: an isotropic kernel), selective layers against the uniform one. Right: the discount a_v'/(-a_v) of each selective layer's value-row weights (a TD step has 0.9, dotted), clipped to [-3, 3]."
#| fig-alt: "Three panels. Left, a scatter of the level read from the weights against the fitted level, points on the diagonal, coloured by the uniform layer's position. Middle, strip plots of the anisotropy: selective layers near 0.1, uniform layers spread up to 1. Right, a strip plot of the value-row discounts of the selective layers, scattered widely around and beyond 0.9."
fig, axs = plt.subplots(1, 3, figsize=(13.5, 4.1))
for l in range(3):
    k_ = W["u"] == l
    axs[0].scatter(W["fit"][k_], W["weights"][k_], color=OKABE_ITO[l], s=28, label=f"layer {l + 1} uniform")
lo_, hi_ = W["fit"].min().item() - 0.03, W["fit"].max().item() + 0.03
axs[0].plot([lo_, hi_], [lo_, hi_], "k--", lw=0.8)
axs[0].set(xlabel="fitted $\\Lambda = \\lambda + \\sigma(1 - \\gamma^k)$ (per seed)",
           ylabel="$\\Lambda$ read off the weights", title="Level sensitivity")
axs[0].legend(fontsize=8)
jit = torch.linspace(-0.15, 0.15, len(wr))
axs[1].scatter(jit.repeat_interleave(2), W["aniso_sel"].flatten(), s=14, color=OKABE_ITO[0], label="selective")
axs[1].scatter(1 + jit, W["aniso_u"], s=14, color=OKABE_ITO[1], label="uniform")
axs[1].set(xticks=[0, 1], xticklabels=["selective layers", "uniform layer"], ylabel="$\\|A_{\\phi\\phi} - \\beta I\\| / \\|A_{\\phi\\phi}\\|$",
           title="Kernel: distance from $\\beta I$", ylim=(0, 1.05))
axs[2].scatter(jit.repeat_interleave(2), W["discount"].flatten().clamp(-3, 3), s=14, color=OKABE_ITO[2])
axs[2].axhline(EMERGENCE.gamma, color="k", ls=":", lw=0.8)
axs[2].set(xticks=[0], xticklabels=["selective layers"], xlim=(-0.6, 0.6), ylabel="$a_{v'} / (-a_v)$ (clipped)",
           title="Value-row discount")
fig.tight_layout()

# %%
se_u, se_s = W["aniso_u"].std() / math.sqrt(len(wr)), W["aniso_sel"].std() / math.sqrt(2 * len(wr))
iso_z = (W["aniso_u"].mean() - W["aniso_sel"].mean()) / math.hypot(se_u, se_s)
assert lam_corr > 0.8 and (W["fit"] - W["weights"]).abs().mean() < 0.05, (lam_corr, W["fit"])
assert W["aniso_sel"].median() < 0.25 and iso_z > 3, (W["aniso_sel"], W["aniso_u"])

# %%
#| echo: false
near_td = ((W["discount"] - EMERGENCE.gamma).abs() < 0.1).double().mean().item()
Markdown(f"**What the weights say.** The level constant can be read off the parameters: with attention frozen, the "
         f"level sensitivity is {ms(W['weights'])} against {ms(W['fit'])} fitted to the same seeds' outputs "
         f"(correlation {lam_corr:.2f} over {len(wr)} seeds). It comes in three parts: the uniform layer's value write "
         f"({W['value'].mean():.2f}), its writes into the feature and reward rows, which later layers read "
         f"({W['tokens'].mean():.2f}), and the selective layers' own reward paths ({W['selective'].mean():.2f}), "
         f"against the winner's $\\lambda$ = {W['level'].mean():.2f} and $\\sigma(1-\\gamma^k)$ = "
         f"{(W['fit'] - W['level']).mean():.2f}. The uniform layer's two paths together give "
         f"{(W['value'] + W['tokens']).mean():.2f}, more than the whole, and the selective layers take "
         f"{-W['selective'].mean():.2f} away: the level is not the winner's level term computed in one place. The uniform "
         f"layer computes most of it, partly through rewards and features it re-embeds for later layers (as the patch "
         f"found), and the selective layers correct it. The kernel has the winner's form: the feature block of $A$ in the selective layers is close "
         f"to $\\beta I$ (median anisotropy {W['aniso_sel'].median():.2f}, against {W['aniso_u'].median():.2f} in the "
         f"uniform layer), with $\\beta$ = {ms(W['beta_sel'].flatten())}, larger than the fitted "
         f"{ms(W['beta_fit'])} (the selective layers read re-embedded features, not the raw ones the fit uses). The step "
         f"and the discount cannot be read off the value row: the selective layers' value-row weights are not "
         f"$\\alpha(1, \\gamma, -1)$ (discount within 0.1 of {EMERGENCE.gamma:g} in {near_td:.0%} of the layers; the "
         f"summed steps {ms(W['step'].sum(-1))} against $k$ = {ms(W['k'].double())} fitted iterates). The models compute "
         f"$k$ kernel-TD iterates as a function, with writes spread over all rows, not one TD step per layer in the "
         f"value row. Measured on the headline cell only.")

# %%
#| echo: false
record_claim("weights-level", f"The level sensitivity read off the weights (attention frozen) matches the one fitted to "
             f"each seed's outputs: correlation {lam_corr:.2f} over {len(wr)} seeds; the selective layers' kernels are "
             f"near-isotropic and their value-row weights are not TD steps.", "measured", "mechanism", "#fig-contest-weights")

# %% [markdown]
# ## How the models implement it
#
# The rest of the page looks inside the models: what each layer writes, which layer is uniform, whether chapter 5's
# convergence condition holds, and how the models behave under longer training, more layers, training from
# $\theta^*$ and iteration of a shared layer. Seeds 0 to 9 are looked inside; seeds 10 to 19 test predictions.

# %% [markdown]
# ## The centred value error
#
# The value error of the [emergence chapter](emergence.html) mixes two things: the *level* of a
# task's values (their $d_\pi$-weighted mean) and their *shape* across states. A state-blind
# predictor can get the level right and the shape wrong. The centred error removes each task's
# mean from the estimate and from the truth before comparing them:
#
# $$\mathrm{cMSVE}(\hat v) = \sum_x d_\pi(x)\Big(\big(\hat v(x) - \textstyle\sum_y d_\pi(y) \hat v(y)\big) - \big(v_\pi(x) - \sum_y d_\pi(y) v_\pi(y)\big)\Big)^2 .$$
#
# Every constant prediction has the same centred error, $\mathrm{Var}_{d_\pi}(v_\pi)$: the
# constant floor. A predictor has learned something about the shape only where its centred error
# is below that floor.

# %% [markdown]
# `centred_msve` computes it (defined, with its checks, in *Implementation: the probes* at the end of the page).

# %% [markdown]
# ## The anatomy of a trained model
#
# Before comparing the models with any algorithm, we look at what each of their three layers does:
# which rows of the tokens it writes, how selective its attention is, and what is lost when it is
# knocked out. The probes are functions of a model, defined here with a check each.

# %% [markdown]
# The probes are functions of a model, each defined with a check in *Implementation: the probes* at the end of the page:
#
# * `layer_values`: the value row of the query columns after every layer (the model's running estimate);
# * `row_writes`: how much each layer writes into each token row at the queries (writes outside the value row,
#   which $\theta^*$ never makes, show up);
# * `knockout`: a layer removed ($V^{\mathrm{cur}} = V^{\mathrm{tgt}} = 0$), or made to attend uniformly ($A = 0$);
#   `knockout_rows`: only its writes into some rows removed;
# * `write_constancy`: the share of the variance of a layer's value-row write that lies between tasks (1: the same
#   number at every state of a task, as a uniform layer writes);
# * `swap_weights`: weight $\Delta a$ moved from the current-value to the successor-value head, which leaves a
#   uniform layer's output nearly unchanged (under uniform attention only $a_{v'} + a_v$ matters);
# * `learned_kernel`: each layer's population attention $M$ at $n = \infty$ (row: query state, column: key state),
#   on the tokens that layer reads; `kernel_condition`: chapter 5's condition $\min_x M(x, x) > (1 + \gamma)/2$
#   (Proposition 5.1) with the span constants of Proposition 5.2.

# %% [markdown]
# ### Ten trained models, layer by layer
#
# `layer_anatomy` collects, for one trained model on its held-out prompts, every per-layer probe:
# the population diagonality (the mean of $M(x, x)$ of the learned kernel
# above; uniform attention gives $1/s$), the rows written, the
# constancy of the value-row write, and the value error after each knockout and after the swap
# $\Delta a = 1/2$, as ratios to the intact model's.

# %% [markdown]
# A worked example first: every probe of one trained model (seed 0), read layer by layer.

# %%
anatomy = [layer_anatomy(c, m) for c, m in fit_runs]
ex = anatomy[0]
ex_L = range(len(ex["diagonality"]))
u0 = min(ex_L, key=lambda l: ex["diagonality"][l])
others = [l for l in ex_L if l != u0]
near_uniform, ex_selective = [l for l in ex_L if ex["diagonality"][l] < UNIFORM_BELOW], [l for l in ex_L if ex["diagonality"][l] >= UNIFORM_BELOW]
layer_list = lambda ls, key, fmt: " and ".join(f"{ex[key][l]:{fmt}} (layer {l + 1})" for l in ls)
n_single = sum(sum(x < UNIFORM_BELOW for x in r["diagonality"]) == 1 for r in anatomy)
values_of = lambda ls, key: " and ".join(f"{ex[key][l]:.2f}" for l in ls)
layers_named = lambda ls: ("layer " if len(ls) == 1 else "layers ") + " and ".join(str(l + 1) for l in ls)
kernel_txt = (f"The learned kernel of layer {u0 + 1} has a mean diagonal of {ex['diagonality'][u0]:.2f}, near the level $1/s = 0.1$ of uniform attention; "
              f"{layers_named(others)} reach {values_of(others, 'diagonality')}. " if near_uniform == [u0] else
              f"The learned kernels of {layers_named(near_uniform)} have mean diagonals {values_of(near_uniform, 'diagonality')}, "
              f"{'both' if len(near_uniform) == 2 else 'all'} below {UNIFORM_BELOW} and near the level $1/s = 0.1$ of uniform attention: this seed has "
              f"{len(near_uniform)} near-uniform layers, where {n_single} of the {len(anatomy)} seeds have exactly one (the counts below); {layers_named(ex_selective)} "
              f"{'reaches' if len(ex_selective) == 1 else 'reach'} {values_of(ex_selective, 'diagonality')}. We follow layer {u0 + 1}, the least selective. ")
Markdown(f"Seed {ex['seed']} has a held-out MSVE of {ex['msve']:.3f}. " + kernel_txt +
         f"Layer {u0 + 1}'s write to the value row is nearly the same number at every "
         f"state of a task (constancy {ex['constancy'][u0]:.3f}, against {layer_list(others, 'constancy', '.3f')}): it adds a "
         f"baseline that does not depend on the state. Knocking it out entirely multiplies the error by {ex['identity'][u0]:.2f}, making its attention uniform "
         f"changes the error by a factor {ex['uniform'][u0]:.3f} (it already is uniform), and moving weight $1/2$ between its successor- and current-value heads "
         f"by a factor {ex['swap'][u0]:.3f}. The last layer writes only the value row (mean change {ex['feature_writes'][-1]:.2f} in the features, "
         f"{ex['reward_writes'][-1]:.2f} in the reward, {ex['value_writes'][-1]:.2f} in the value); layer 2 writes {ex['feature_writes'][1]:.2f} into the features, "
         f"which $\\theta^*$ never does.")

# %% [markdown]
# The same probes on all ten seeds, in three tables (per seed, one value per layer; the uniform layer in bold).
# First the attention: the population diagonality of each layer's learned kernel (uniform attention gives
# $1/s = 0.1$) and the constancy of its value-row write.

# %%
Markdown(anatomy_table(anatomy, "attention"))

# %% [markdown]
# The figure shows the same two columns for all thirty layers at once: the message of the anatomy in one picture.

# %%
#| fig-cap: "Figure 6b.4: in nearly every trained model one layer, a different one across seeds, attends almost uniformly and writes nearly the same number at every state of a task; the other layers attend selectively and most of them write state-dependent corrections."
#| fig-alt: "Scatter plot of the 30 layers of ten trained models: the population diagonality of the layer's learned kernel on the horizontal axis against the constancy of its value-row write on the vertical axis, with circles, triangles and squares for layers 1, 2 and 3. About one point per model, from different positions across models, sits at diagonality about 0.1 and constancy near 1, left of a dashed line at the uniform threshold (one model has two such points); the other layers spread to the right, most of them at lower constancy and a few near 1."
fig, ax = plt.subplots(figsize=(6.4, 4.2))
diag_all, cons_all = torch.tensor([r["diagonality"] for r in anatomy]), torch.tensor([r["constancy"] for r in anatomy])
for l, (marker, colour) in enumerate(zip("o^s", ("#0072B2", "#E69F00", "#009E73"))):
    ax.scatter(diag_all[:, l], cons_all[:, l], marker=marker, color=colour, s=50, alpha=0.85, label=f"layer {l + 1}")
ax.axvline(UNIFORM_BELOW, color="k", ls="--", lw=0.8)
ax.text(UNIFORM_BELOW + 0.01, 0.25, f"uniform below {UNIFORM_BELOW}", fontsize=9, rotation=90, va="bottom")
ax.set(xlabel="population diagonality of the layer's kernel (mean of $M(x, x)$)", ylabel="constancy of the value-row write", xlim=(0, 0.75), ylim=(0, 1.05))
ax.legend(loc="lower right"); fig.tight_layout()

# %% [markdown]
# Then what knocking a layer out does to the value error (ratios to the intact model's MSVE): removing
# the layer ($V^{\mathrm{cur}} = V^{\mathrm{tgt}} = 0$), making its attention uniform ($A = 0$), and moving
# weight $\Delta a = 1/2$ from its current-value to its successor-value head:

# %%
Markdown(anatomy_table(anatomy, "knockouts"))

# %% [markdown]
# And how much each layer writes into the feature, reward and value rows at the query columns (mean absolute change):

# %%
Markdown(anatomy_table(anatomy, "writes"))

# %% [markdown]
# The check: the counts behind the anatomy (computed by `anatomy_counts`), asserted over the ten seeds.

# %%
anat = anatomy_counts(anatomy)
assert anat["one_uniform_layer"] >= 8 and len(set(p for p in anat["uniform_position"] if p)) >= 2, anat   # a rate near 1, with its interval below over 40 seeds
assert anat["uniform_constancy_min"] > 0.95 and anat["swap_uniform_max"] < anat["swap_selective_median"], anat   # a head swap moves a uniform layer less than most selective ones
assert anat["identity_min"] > 1.1 and anat["uniform_knockout_max"] < anat["identity_min"] - 1, anat          # making the uniform layer uniform costs less than removing any layer
fw = torch.tensor([r["feature_writes"] for r in anatomy])
assert (fw[:, :2].amax(-1) > 0.1).all() and (fw[:, -1] < 0.01).all(), fw

# %% [markdown]
# In words, generated from the counts:

# %%
diag_t, cons_t = torch.tensor([r["diagonality"] for r in anatomy]), torch.tensor([r["constancy"] for r in anatomy])
ident_t, unif_t = torch.tensor([r["identity"] for r in anatomy]), torch.tensor([r["uniform"] for r in anatomy])
is_selective = diag_t >= UNIFORM_BELOW
sel_cons = cons_t[is_selective]
n_high = int((sel_cons >= anat["uniform_constancy_min"]).sum())
cons_txt = (f"against at most {anat['selective_constancy_max']:.3f} for the selective layers" if n_high == 0 else
            f"against a median {sel_cons.median():.3f} for the {len(sel_cons)} selective layers, {n_high} of which reach that level too, so a constant write "
            f"alone does not mark a uniform layer")
swap_sel = (torch.tensor([r["swap"] for r in anatomy]) - 1).abs()[:, 1:][is_selective[:, 1:]]
cident_t, cunif_t = torch.tensor([r["centred_identity"] for r in anatomy]), torch.tensor([r["centred_uniform"] for r in anatomy])
cost_share = (cunif_t[is_selective] - 1) / (cident_t[is_selective] - 1)  # the cost of making a selective layer uniform, as a share of removing it, in centred MSVE
n_cheaper = int((cost_share < 1).sum())
uni_idx = diag_t.argmin(-1)
rows_ = torch.arange(len(anatomy))
vw_rm, tok_rm = (torch.tensor([r[k] for r in anatomy])[rows_, uni_idx] for k in ("value_write_removed", "token_writes_removed"))
all_rm = ident_t[rows_, uni_idx]
one_u = (head_diag < UNIFORM_BELOW).sum(-1) == 1
u_rate = rate_interval(int(one_u.sum()), len(head_models))
u_pos = {l + 1: int((one_u & (head_diag.argmin(-1) == l)).sum()) for l in range(3)}
Markdown(f"In {anat['one_uniform_layer']} of {anat['n_seeds']} seeds exactly one of the three layers keeps its attention near the uniform level "
         f"$1/s = 0.1$ (bold in the tables, left of the dashed line in Figure 6b.4; population diagonality below {UNIFORM_BELOW}); over all {len(head_models)} seeds of the "
         f"headline cell the rate is {u_rate[0]:.2f} (95% interval {u_rate[1]:.2f} to {u_rate[2]:.2f}), and which layer it is varies from seed to seed "
         f"(layer 1, 2, 3 in {u_pos[1]}, {u_pos[2]}, {u_pos[3]} seeds), so no claim about a fixed layer position can hold. That layer's value-row write is nearly the same number at every state of a task "
         f"(constancy at least {anat['uniform_constancy_min']:.3f}, {cons_txt}): it adds "
         f"a context-wide baseline, a weighted sum of the context's mean reward and mean values. Making it uniform changes the error by at most "
         f"{anat['uniform_knockout_max']:.1%} (it already is uniform), and moving weight $\Delta a = 1/2$ between its successor and current heads changes the error by at most "
         f"{anat['swap_uniform_max']:.1%}, against a median {anat['swap_selective_median']:.1%} (and up to {swap_sel.max():.0%}) for the selective layers after the first: in a uniform layer "
         f"the successor and current weights are not separately determined, only their sum is. Removing any layer outright multiplies the error by at least "
         f"{anat['identity_min']:.2f}; removing the uniform layer costs the most in {anat['uniform_removal_worst']} of {anat['n_seeds']} seeds: the baseline it "
         f"computes carries most of the value level. Making a selective layer uniform costs less than removing it in {n_cheaper} of {len(cost_share)} selective "
         f"layers, with a median cost {cost_share.median():.0%} of the removal's, measured in *centred* MSVE (the shape, which is what selectivity can buy; raw MSVE is "
         f"dominated by the level)" + (": what a selective layer adds to the shape depends on its selectivity. " if cost_share.median() > 0.5 else ". ") +
         f"The uniform layer is not described by its value write alone: removing only that write multiplies the error by a median {vw_rm.median():.2f}, removing only its "
         f"writes into the feature and reward rows by {tok_rm.median():.2f}, and removing the layer by {all_rm.median():.2f}"
         + (f"; where the uniform layer is layer 2 (seeds {', '.join(str(anatomy[i]['seed']) for i in mid)}), the same three removals give "
            f"{', '.join(f'{vw_rm[i]:.2f} / {tok_rm[i]:.2f} / {all_rm[i]:.2f}' for i in mid)}" if (mid := [i for i in range(len(anatomy)) if int(uni_idx[i]) == 1 and diag_t[i].lt(UNIFORM_BELOW).sum() == 1]) else "")
         + f" (its feature and reward writes matter only where a later layer reads them). The layers write far beyond the value row: "
         f"the first two write into the feature and reward rows of the tokens, which $\\theta^*$ never does, and the level the uniform layer contributes travels "
         f"partly through those re-embedded rows.")

# %% [markdown]
# ### Chapter 5's condition on the trained models
#
# The learned population kernels of every layer, checked against the condition
# $\min_x M(x, x) > (1 + \gamma)/2$ on each seed's held-out tasks, with the two span constants:

# %%
conditions = [kernel_condition(m, held_out_prompts(c)[0]) for c, m in fit_runs]
cond = {k: torch.tensor([r[k] for r in conditions], dtype=torch.float64) for k in ("min_diagonal", "share_meeting", "mean_diagonal", "span_td", "span_own")}
Markdown("| layer | mean $M(x, x)$ | min$_x M(x, x)$, mean over seeds [max] | threshold | share of tasks meeting it |\n|---|---|---|---|---|\n" +
         "\n".join(f"| {l + 1} | {cond['mean_diagonal'][:, l].mean():.2f} | {cond['min_diagonal'][:, l].mean():.3f} [{cond['min_diagonal'][:, l].max():.3f}] | {conditions[0]['threshold']:.2f} | "
                   f"{cond['share_meeting'][:, l].mean():.0%} |" for l in range(3)) +
         "\n\nThe span coefficients, mean over seeds:\n\n| layer | $\\mathrm{sc}(I - M(I - \\gamma P))$ | $\\mathrm{sc}(I + M(a_v I + a_{v'} P))$ |\n|---|---|---|\n" +
         "\n".join(f"| {l + 1} | {cond['span_td'][:, l].mean():.2f} | {cond['span_own'][:, l].mean():.2f} |" for l in range(3)))

# %%
assert cond["share_meeting"].max() == 0 and cond["min_diagonal"].max() < conditions[0]["threshold"] / 2, cond
assert (cond["span_td"] > 1).all() and (cond["span_own"] >= 1 - 1e-9).all(), cond

# %% [markdown]
# No layer of any of the ten trained models meets the kernel-diagonality condition on any held-out task, and no learned
# kernel satisfies the span condition of Proposition 5.2 in one step. Before reading this as a fact about training, the
# control: does $\theta^*$ itself, with the kernel $W = \beta I$ at the scales a model could reach, meet the condition on
# the same tasks, with the same four random features?

# %%
star_cond = {b: kernel_condition(SoftmaxICTD.from_theta_star(4, 1, b * torch.eye(4, dtype=torch.float64), 1., 0.9), held_out_prompts(fit_runs[0][0])[0])
             for b in (1., 4., 15.)}
star_share = {b: max(r["share_meeting"]) for b, r in star_cond.items()}
Markdown(f"$\\theta^*(W = \\beta I)$ meets it on {', '.join(f'{v:.0%} of the tasks at β = {b:g}' for b, v in star_share.items())}. "
         + ("So the result is forced by the features: with four random features per state, no kernel of this form is diagonal enough for "
            "chapter 5's condition, and the trained models' failure to meet it says nothing about training. " if max(star_share.values()) == 0 else "") +
         "The convergence theory of chapter 5 does not cover these models, whatever they learned; what they compute was decided by the contest.")

# %% [markdown]
# ## Probing the value row
#
# ### Candidate estimators
#
# To say what the value row holds *after each layer* we compare it with estimators computed from the same context
# (this is a probe of the layers, not the contest: the decisive comparison is the contest above):
#
# * the **context mean** $\bar R$ (mean reward of the context);
# * **certainty equivalence**, the value of the context's empirical MRP (it knows the states);
# * the **reward at the query** $r(x)$ (from the task: an oracle of the one-step term);
# * **TD iterates**: $\theta^*(\alpha, \beta I)$ with as many layers as the model has applied, $(\alpha, \beta)$ fitted;
# * a **two-step lookahead**: with the softmax weights $K_k(x) \propto \exp(\beta\, \phi(x)^\top \phi(S_{k-1}))$
#   of the context's transitions $k = 1, \dots, n$ for a target state $x$ (Definition 1.1 with $W = \beta I$),
#   the smoothed reward $\tilde r_\beta(x) = \sum_k K_k(x) R_k$ and the smoothed *next* reward
#   $\tilde r^+_\beta(x) = \sum_k K_k(x) R_{k+1}$ (with $R_{n+1} = 0$).
#
# Each is compared with the value row through the best affine map (scale and offset fitted by
# $d_\pi$-weighted least squares), and scored by its $R^2$.

# %% [markdown]
# The estimators and their fits are defined, with checks, in *Implementation: the probes*: `lookahead_features` (the context mean
# and the two kernel-smoothed rewards), `affine_fit` and `affine_predict` ($d_\pi$-weighted least squares with an
# intercept), `weighted_r2`, `candidate_values` (the candidates that need no fitting), `probe_layers` (every
# candidate against the value row after every layer; the TD iterates after layer $l$ are $\theta^*$ with $l$
# layers, $(\alpha, \beta)$ chosen on the emergence chapter's grid), and `fit_estimators`, `estimator_values` and
# `prediction_errors` (constants fitted pooled over some models, then used to predict others).

# %% [markdown]
# ### What the value row holds, layer by layer
#
# The probes on the ten models (64 held-out tasks each, every state a query): mean $R^2$ over seeds
# of each candidate's best affine map onto the value row after each layer.

# %%
probes = [probe_layers(dataclasses.replace(c, eval_tasks=64), m) for c, m in fit_runs]
probe_mean = {k: torch.tensor([p[k] for p in probes]).mean(0) for k in probes[0]}
Markdown("| candidate | after layer 1 | after layer 2 | after layer 3 (output) |\n|---|---|---|---|\n" +
         "\n".join(f"| {k} | " + " | ".join(f"{x:.3f}" for x in v) + " |" for k, v in probe_mean.items()))

# %% [markdown]
# The output is explained to within a few percent of its variance by several candidates at once,
# because most of its variance is the *level* of each task's values, which the context mean alone
# already carries. That is why the comparison that decides between candidates is the centred one,
# on models they were not fitted to.

# %% [markdown]
# ### The earlier comparison, and why the contest replaces it
#
# An earlier version of this page compared these estimators by fitting each, pooled over seeds 0 to 9, to the models'
# outputs, and concluded that the models run the two-step lookahead. That comparison was not capacity-matched: the
# lookahead had a free intercept and three free weights, while $\theta^*$ had one regressor that had to carry both the
# level and the shape, with $(\alpha, \beta)$ chosen by raw $R^2$, which buys the level and spoils the shape. And it
# scored the output's shape, which every good estimator shares with $v_\pi$, rather than the models' errors. The
# contest at the top of the page gives every candidate the same constants and scores errors; there the lookahead
# loses to level + TD iterates, and fits the control objectives' models as well as TD's. `fit_estimators`,
# `estimator_values` and `prediction_errors` remain in the library, because the convergence sweep below
# (Experiment 1) saved its estimator check with them.

# %% [markdown]
# ## Controls: what is specific to TD?
#
# The same architecture, data and optimiser, trained with other targets at the query (the
# [pretraining chapter](pretrain.html) defines them): Monte-Carlo returns, the true value
# $v_\pi(x)$ at the query state $x$ (supervised), and TD with the successor drawn from $d_\pi$ independently of the
# query, which keeps the rewards and removes the temporal structure. Saved by `run_control_study`;
# the TD runs are the ten fitted above. Each objective's models get the same measures: `gap_measures` gives a model's MSVE and centred
# MSVE and those of the baselines on its held-out tasks, and `study_summary` turns them into per-seed
# measures (its value-row sign pattern, its uniform layers).

# %%
ctrl_saved = json.loads(Path("data/mechanism_controls.json").read_text())
controls = {"td": study_summary(fit_runs)} | {k: study_summary(load_models(v["runs"])) for k, v in ctrl_saved["studies"].items()}
Markdown(f"Made by `{ctrl_saved['provenance']['command']}` at commit `{ctrl_saved['provenance']['commit'][:10]}` on {ctrl_saved['provenance']['date'][:10]}.\n\n" + summary_table(controls, "objective"))

# %% [markdown]
# A caution on one column: the "last *selective* layer" measure was introduced after the last layer had been seen to be
# the uniform one in some seeds. It re-targets the sign-pattern count post hoc and is labelled so here; the
# pre-specified measure is the plain last layer, reported beside it.
#
# "Specific to TD" is a comparison of counts between two sets of ten seeds. We test it with a
# one-sided Fisher exact test (the count under TD is larger than under the control), one test per
# control and measure, and correct the three controls of a measure for multiplicity with Holm's
# step-down procedure.

# %%
ctrl_tests = {meas: holm({k: fisher_greater(int(controls["td"][meas].sum()), 10, int(sm[meas].sum()), 10) for k, sm in controls.items() if k != "td"})
              for meas in ("pattern, last selective layer", "pattern, last layer", "one uniform layer")}
ms = lambda x: f"{x.mean():.3f} ± {x.std() / math.sqrt(len(x)):.3f}"
diff_z = lambda a, b: ((a.mean() - b.mean()) / math.hypot(a.std() / math.sqrt(len(a)), b.std() / math.sqrt(len(b)))).item()
ctrl_z = {k: dict(shape=diff_z(controls["td"]["shape explained"], sm["shape explained"]), msve=diff_z(controls["td"]["MSVE"], sm["MSVE"]))
          for k, sm in controls.items() if k != "td"}
assert all(z["shape"] > 2 for z in ctrl_z.values()), ctrl_z
assert ctrl_z["mc"]["msve"] > 2 and ctrl_z["supervised"]["msve"] > 2, ctrl_z
assert ctrl_tests["pattern, last selective layer"]["mc"] < 0.05 and ctrl_tests["pattern, last selective layer"]["supervised"] < 0.05, ctrl_tests
assert min(ctrl_tests["pattern, last layer"].values()) > 0.05, ctrl_tests
ctrl_tests, ctrl_z

# %%
t, cz = ctrl_tests, ctrl_z
ctrl_names = {"mc": "Monte-Carlo training", "supervised": "supervised training", "td-independent": "TD with independent successors"}
sel_p = t["pattern, last selective layer"]
sel_sig, sel_not = [k for k, p in sel_p.items() if p < 0.05], [k for k, p in sel_p.items() if p >= 0.05]
sel_phrase = lambda ks: " and ".join(f"{ctrl_names[k]} ({int(controls[k]['pattern, last selective layer'].sum())} of 10; adjusted p = {sel_p[k]:.3f})" for k in ks)
Markdown(f"What is specific to TD, against these nulls (Holm-adjusted one-sided p-values above; differences of means in units of their standard error): "
         f"TD-trained models explain more of the value *shape* than every control (by {min(z['shape'] for z in cz.values()):.1f} standard errors or more), "
         f"and the control that keeps the rewards but breaks the temporal link, TD with independent successors, explains the least. Yet on plain MSVE the "
         f"Monte-Carlo and supervised models are *better* than the TD models ({controls['mc']['MSVE'].mean():.3f} and {controls['supervised']['MSVE'].mean():.3f} "
         f"against {controls['td']['MSVE'].mean():.3f}): at this depth bootstrapping buys shape and costs level. The sign pattern $(+, +, -)$ in the last selective "
         f"layer ({int(controls['td']['pattern, last selective layer'].sum())} of 10 seeds under TD) is significantly more frequent under TD than under "
         f"{sel_phrase(sel_sig)}{'' if not sel_not else ', but not than under ' + sel_phrase(sel_not)} (Holm over the three controls of this measure; "
         f"Claims and multiplicity corrects over all of this experiment's secondary claims); the pattern in the last layer as such is not more frequent under TD than under any control "
         f"(smallest adjusted p = {min(t['pattern, last layer'].values()):.2f}). The single uniform layer is most consistent under TD "
         f"({int(controls['td']['one uniform layer'].sum())} of 10 seeds; adjusted p against the controls "
         f"{', '.join(f'{k} {v:.3f}' for k, v in t['one uniform layer'].items())}).")

# %% [markdown]
# ## Further experiments
#
# Five more questions, each answered from saved runs: does the structure above survive training to
# convergence? What does depth change? Is $\theta^*$ an attractor of pretraining? What does a learned
# *shared* layer do when it is iterated? And where, across settings, does a trained model know more
# than the value level?

# %% [markdown]
# ### Experiment 1: trained to convergence
#
# **Question.** The runs above stop at the 2000 steps of `EMERGENCE`. Is their structure where training
# *ends*, or a stage it passes through?
#
# **Setup.** A stopping rule, applied to a sweep over the learning rate ($3 \cdot 10^{-3}$, $10^{-2}$,
# $3 \cdot 10^{-2}$) and the number of steps in the `EMERGENCE` configuration, ten seeds (0 to 9) per rate.
#
# **The stopping rule** [ours]. Every `eval_every` steps the training loop records each seed's
# held-out MSVE, the mean diagonality of every layer and the last layer's value weights. For a
# window of $T_{\mathrm{win}}$ steps, a metric $Y$ *has moved* at a training step when
# $|\overline{\Delta}| + 2\,\mathrm{s.e.}(\overline{\Delta}) \ge \mathrm{tol}_Y$, where
# $\Delta_i$ is seed $i$'s change of $Y$ over the $T_{\mathrm{win}}$ steps before it and the bar and the standard error are
# over seeds (for a vector metric, the largest component). Training *has converged at* a step when,
# from that step on, no metric has moved at any evaluation; the tolerances $\mathrm{tol}_Y$ are
# `CONVERGE_TOLERANCES`, and `settled_step` applies the rule (both in *Implementation and tests*, with a check on
# synthetic trajectories). The sweep trains each learning rate once to the largest number of steps:
# Adam's step size is constant, so the model after some number of steps of a longer run is the model of a
# run of that many steps, and every smaller step count is read off the same run (its parameters are
# recorded at every evaluation).

# %% [markdown]
# **Result.** The sweep, saved by `run_converge_study`. It was trained on a 16-core machine by the script
# `DEVICE_RUN.sh` (parallel workers into a cache, then one assembling call); the file records the
# command, the commit of the code and the machine:

# %%
conv_saved = json.loads(Path("data/mechanism_converge.json").read_text())
conv = conv_saved["lrs"]
conv_summary = {lr: {int(s): {k: torch.tensor(v, dtype=torch.float64) for k, v in sm.items()} for s, sm in c["summaries"].items()} for lr, c in conv.items()}
def _conv_row(lr, c):
    "One row of the sweep's table: the settled step and the measures there (or at the last step)."
    s = c["settled"] if c["settled"] is not None else c["steps"][-1]
    sm, m = conv_summary[lr][s], len(conv_saved["seeds"])
    cen = {k: torch.tensor(v, dtype=torch.float64) for k, v in c["estimator"]["centred"].items()}
    return (f"| {lr} | {c['settled'] if c['settled'] is not None else 'not by ' + str(c['steps'][-1])} | {ms(sm['MSVE'])} | {ms(sm['shape explained'])} | "
            f"{int(sm['one uniform layer'].sum())} / {m} | {int(sm['pattern, last selective layer'].sum())} / {m} | {int(sm['pattern, last layer'].sum())} / {m} |",
            f"| {lr} | {cen['lookahead'].mean():.3f} | {cen['theta*'].mean():.3f} | {cen['certainty equivalence'].mean():.3f} |")
Markdown(f"Made by `{conv_saved['provenance']['command']}` at commit `{conv_saved['provenance']['commit'][:10]}` on {conv_saved['provenance']['date'][:10]}; "
         f"window {conv_saved['window']} steps, tolerances {conv_saved['tolerances']}.\n\n"
         "| learning rate | settled at step | MSVE | shape explained | one uniform layer | (+, +, −) last selective layer | (+, +, −) last layer |\n"
         "|---|---|---|---|---|---|---|\n" + "\n".join(_conv_row(lr, c)[0] for lr, c in conv.items()) +
         "\n\nThe learned estimator on the same runs (centred $1 - R^2$ on the held-out seeds):\n\n"
         "| learning rate | lookahead | $\\theta^*$ | cert. equiv. |\n|---|---|---|---|\n" + "\n".join(_conv_row(lr, c)[1] for lr, c in conv.items()))

# %% [markdown]
# The measures are taken at the settled step (at the last step where training did not settle);
# the estimator columns fit the candidates on the first five seeds' final models and score them
# on the other five. How the stopping statistic evolves, relative to each tolerance:

# %%
#| fig-cap: "Figure 6b.5: after thousands of steps the diagonality has stopped moving at some learning rates, but the value weights have not at any rate; below 1 a metric has stopped moving."
#| fig-alt: "Three panels (held-out MSVE, layer diagonality, last-layer value weights), each with one line per learning rate (solid, dashed, dotted) showing the seed-mean change over the window plus two standard errors, divided by the tolerance, on a log scale, with a horizontal line at 1."
fig, axs = plt.subplots(1, 3, figsize=(13, 3.6), sharey=True)
for i, (lr, c) in enumerate(conv.items()):
    for ax, (k, tol) in zip(axs, conv_saved["tolerances"].items()):
        ax.plot(c["steps"], torch.tensor(c["moved"][k], dtype=torch.float64) / tol, color=f"C{i}", ls=("-", "--", ":")[i % 3], label=f"lr {lr}")
for ax, k in zip(axs, conv_saved["tolerances"]):
    ax.axhline(1, color="k", ls="--", lw=0.8)
    ax.set(yscale="log", xlabel="training step", title=dict(msve="held-out MSVE", diagonality="diagonality of every layer", value_weights="last layer's value weights")[k])
axs[0].set(ylabel="(|mean change| + 2 s.e.) / tolerance"); plain_log_ticks(axs[0], "y")
axs[-1].legend(); fig.tight_layout()

# %%
conv_at = {lr: c["settled"] if c["settled"] is not None else c["steps"][-1] for lr, c in conv.items()}
conv_final = {lr: conv_summary[lr][s] for lr, s in conv_at.items()}
look_wins = {lr: sum(a < b for a, b in zip(c["estimator"]["centred"]["lookahead"], c["estimator"]["centred"]["theta*"])) for lr, c in conv.items()}
n_test = {lr: len(c["estimator"]["centred"]["lookahead"]) for lr, c in conv.items()}
conv_counts = {lr: dict(step=conv_at[lr], settled=conv[lr]["settled"] is not None, one_uniform=int(sm["one uniform layer"].sum()),
                        pattern_selective=int(sm["pattern, last selective layer"].sum()), lookahead_beats_theta_star=look_wins[lr]) for lr, sm in conv_final.items()}
conv_counts

# %% [markdown]
# **Check.** The run at the emergence chapter's learning rate passes through that chapter's models: its
# parameters after 2000 steps are the saved runs' final parameters (Adam's step size is constant,
# and the evaluations draw from their own generators):

# %%
for k in ("A", "V_cur", "V_tgt"):
    test_close(torch.tensor([p[k] for p in conv["0.01"]["params"]["2000"]], dtype=torch.float64).flatten(1),
               torch.tensor([r["params"][k] for r in saved["runs"]["fit"]], dtype=torch.float64).flatten(1), eps=1e-8)

# %% [markdown]
# **What it shows:**

# %%
settled_txt = "; ".join(f"lr {lr}: {'settled at step ' + str(k['step']) if k['settled'] else 'not settled by step ' + str(k['step'])}" for lr, k in conv_counts.items())
last_ratio = {lr: {k: c["moved"][k][-1] / tol for k, tol in conv_saved["tolerances"].items()} for lr, c in conv.items()}
def _msve_stat(c, lo, hi): return torch.tensor([m for s, m in zip(c["steps"], c["moved"]["msve"]) if m is not None and lo <= s <= hi], dtype=torch.float64).median()
msve_rises = [lr for lr, c in conv.items() if _msve_stat(c, 3 * c["steps"][-1] / 4, c["steps"][-1]) > 2 * _msve_stat(c, c["steps"][-1] / 4, c["steps"][-1] / 2)]
look_ce = {lr: sum(a < b for a, b in zip(c["estimator"]["centred"]["lookahead"], c["estimator"]["centred"]["certainty equivalence"])) for lr, c in conv.items()}
Markdown(f"With a window of {conv_saved['window']} steps: {settled_txt}. At the last step the stopping statistic is "
         f"{'; '.join(f'lr {lr}: ' + ', '.join(f'{x:.1f}' for x in r.values()) for lr, r in last_ratio.items())} times its tolerance (MSVE, diagonality, value "
         f"weights). The diagonality statistic is below its tolerance at the last step for learning rates {', '.join(lr for lr, r in last_ratio.items() if r['diagonality'] < 1) or 'none'}; "
         f"the value weights' statistic stays above it at every rate, still falling slowly (Figure 6b.5). The MSVE statistic stays above its tolerance at every "
         f"rate; at {', '.join(lr for lr in conv if lr not in msve_rises) or 'no rate'} it fluctuates with no trend after the first few thousand steps, which we read "
         f"as the step-to-step noise of constant-step-size training"
         + (f"; at {', '.join(msve_rises)} its median over the last quarter of training is more than twice its median over the second quarter: "
            f"training there moves again late, and its final MSVE is {'the highest of the sweep' if max(conv_final, key=lambda lr: conv_final[lr]['MSVE'].mean()) in msve_rises else 'not the highest of the sweep'} "
            if msve_rises else " ") +
         f"(a reading of the figure, not a test). Where the measures are taken (the settled step, else the last), one layer is uniform in "
         f"{', '.join(str(k['one_uniform']) for k in conv_counts.values())} of 10 seeds, $(+, +, -)$ holds in the last selective layer in "
         f"{', '.join(str(k['pattern_selective']) for k in conv_counts.values())} of 10 (learning rates {', '.join(conv)} in order), and the lookahead predicts the "
         f"held-out seeds' value shape better than the best-fitting $\\theta^*$ in {', '.join(f'{look_wins[lr]} of {n_test[lr]}' for lr in conv)}, but better than "
         f"certainty equivalence only in {', '.join(f'{look_ce[lr]} of {n_test[lr]}' for lr in conv)}: at the 2000 steps of the emergence chapter it beat both.")

# %% [markdown]
# ### Experiment 2: more layers
#
# **Question.** Does the anatomy change with depth: do more layers run more TD-like iterations?
#
# **Setup.** `EMERGENCE` with $L \in \{2, 3, 4, 6, 8\}$ separate layers (`run_depth_sweep`), ten seeds
# (0 to 9) each, 2000 steps, measured as the controls were.
#
# **Result:**

# %%
depth_saved = json.loads(Path("data/mechanism_depth.json").read_text())
depth = {k: study_summary(load_models(v["runs"])) for k, v in depth_saved["studies"].items()}
Markdown(f"Made by `{depth_saved['provenance']['command']}` at commit `{depth_saved['provenance']['commit'][:10]}` on {depth_saved['provenance']['date'][:10]}.\n\n" +
         summary_table(depth, "depth") + "\n\nMean number of uniform layers per seed: " +
         ", ".join(f"{k}: {sm['uniform layers'].mean():.1f}" for k, sm in depth.items()) + ".")

# %% [markdown]
# **What it shows, and the check** (the assert below):

# %%
d2, d8 = depth["L = 2"], depth["L = 8"]
depth_shape_z = diff_z(d8["shape explained"], d2["shape explained"])
assert depth_shape_z > 2 and all(depth[f"L = {L}"]["pattern, last selective layer"].sum() >= 9 for L in (3, 4, 6, 8)), depth
assert d2["one uniform layer"].sum() >= 9 and d8["uniform layers"].mean() > 2, depth
msve_depth = torch.stack([sm["MSVE"].mean() for sm in depth.values()])
Markdown(f"With more separate layers the models explain more of the value shape ({d2['shape explained'].mean():.2f} at $L = 2$, {d8['shape explained'].mean():.2f} "
         f"at $L = 8$; {depth_shape_z:.1f} standard errors apart) while the mean MSVE stays between {msve_depth.min():.2f} and {msve_depth.max():.2f}; the last "
         f"selective layer shows $(+, +, -)$ in at least 9 of 10 seeds at every depth from 3 on (in {int(d2['pattern, last selective layer'].sum())} at $L = 2$); "
         f"and uniform layers do not go away with depth, they multiply: exactly one in {int(d2['one uniform layer'].sum())} and "
         f"{int(depth['L = 3']['one uniform layer'].sum())} of 10 seeds at $L = 2$ and $3$, {d8['uniform layers'].mean():.1f} on average at $L = 8$. "
         f"Deeper models spend several layers on state-blind averaging.")

# %% [markdown]
# **Deeper still.** Depths 12 and 16 with separate layers are trained by `ictd mechanism deep` (`run_depth_sweep`
# with `DEEP_DEPTHS`), too slow for this machine: they were trained on a 16-core machine by
# `DEVICE_RUN.sh`, and the file records the command, the commit and the machine. A mean over seeds
# hides what happened; the per-seed values follow the table.

# %%
deep_path = Path("data/mechanism_depth_deep.json")
if deep_path.exists():
    deep_saved = json.loads(deep_path.read_text())
    deep = {k: study_summary(load_models(v["runs"])) for k, v in deep_saved["studies"].items()}
    out = Markdown(f"Made by `{deep_saved['provenance']['command']}` at commit `{deep_saved['provenance']['commit'][:10]}` on {deep_saved['provenance']['date'][:10]}.\n\n" +
                   summary_table(deep, "depth") + "\n\nMean number of uniform layers per seed: " + ", ".join(f"{k}: {sm['uniform layers'].mean():.1f}" for k, sm in deep.items()) + ".")
else: out = Markdown("Depths 12 and 16: data pending (`nbs/data/mechanism_depth_deep.json` is not there yet).")
out

# %%
BLOWN_UP = 100.   # an MSVE above this is a model that blew up (the zero estimate scores about 5)
deep_msve = {k: sm["MSVE"] for k, sm in deep.items()}
deep_diverged = {k: s["diverged"] for k, s in deep_saved["studies"].items() if "diverged" in s}   # seeds that diverged, per depth
n_deep = {k: len(m) + len(deep_diverged.get(k, [])) for k, m in deep_msve.items()}
blown = {k: int((m > BLOWN_UP).sum()) + len(deep_diverged.get(k, [])) for k, m in deep_msve.items()}
assert blown["L = 12"] >= 1 and blown["L = 16"] > blown["L = 12"], blown
trained_ok = {k: sm["shape explained"][deep_msve[k] <= BLOWN_UP] for k, sm in deep.items()}
Markdown("Per seed, MSVE at the end of training: " + "; ".join(f"{k}: " + ", ".join(f"{x:.3g}" for x in m.tolist()) for k, m in deep_msve.items()) + ". " +
         "".join(f"At {k}, seed {e['seed']} diverged at step {e['step']} (the engine's divergence guard stopped it: a loss or parameter of size {e['size']:.3g}); "
                 for k, es in deep_diverged.items() for e in es) +
         f"in all, training at the emergence chapter's learning rate blew up (MSVE above {BLOWN_UP:g}, or diverged) in "
         + " and ".join(f"{blown[k]} of {n_deep[k]} seeds at {k}" for k in deep_msve) + ". The seeds that trained explain "
         + " and ".join(f"{x.median():.2f} ({k}, median of {len(x)})" for k, x in trained_ok.items()) +
         f" of the value shape, against {depth['L = 8']['shape explained'].median():.2f} at $L = 8$ (median of 10).")

# %% [markdown]
# ### Experiment 3: the dynamics at $\theta^*$
#
# **Question.** Is $\theta^*$ an attractor of pretraining, or only a point where NEU is small in a limit?
#
# **Setup.** Two
# measurements at the training configuration ($d = 4$ raw features, three separate layers). First,
# at $n = \infty$, the expected semi-gradient update $G(\theta) = \mathbb E[\delta\, \nabla_\theta v]$
# and its Jacobian $J_G = \partial G / \partial \theta$: pretraining follows $\dot\theta = G(\theta)$ on
# average, so a point is a stable rest point only if $G = 0$ there and every eigenvalue of $J_G$ has a
# negative real part. `update_jacobian` computes both exactly, from
# $J_G = J_v^\top D_\pi (\gamma P - I) J_v + \sum_x d_\pi(x)\, \delta_x \nabla^2 v_x$ (averaged over tasks), with $J_v$ the
# Jacobian of the values, $D_\pi = \mathrm{diag}(d_\pi)$ and $\delta_x$ the expected TD error at $x$; it is checked against
# finite differences in *Implementation and tests*.

# %% [markdown]
# `update_jacobian` computes $(G, J_G)$ exactly, at $n = \infty$ or at given contexts; `sampled_jacobians`
# draws batches of stationary contexts at $n = 30$ so that the spread between batches gives an error bar; and
# `jacobian_spectrum` reads stability off the draws, with delete-one jackknife errors (all in *Implementation: the probes*).

# %% [markdown]
# At the training configuration, on held-out tasks, at $\theta^*(W = I, \alpha = 1)$ (the
# construction of Definition 3.1) and at the best-fit $\theta^*$ of the emergence chapter's grid:

# %%
star_points = {"theta* (beta 1, alpha 1)": (1., 1.)} | {"best-fit theta* (beta {1:g}, alpha {0:g})".format(*best_theta_star(EMERGENCE)): best_theta_star(EMERGENCE)[::-1]}
jac_tasks = held_out_prompts(dataclasses.replace(EMERGENCE, eval_tasks=8, seed=1000))[0]
at_star = {}
for name, (beta, alpha) in star_points.items():
    g, J = update_jacobian(SoftmaxICTD.from_theta_star(4, 3, beta * torch.eye(4, dtype=torch.float64), alpha, 0.9), jac_tasks)
    ev = torch.linalg.eigvals(J)
    neu30, neu30_se = neu_jackknife(SoftmaxICTD.from_theta_star(4, 3, beta * torch.eye(4, dtype=torch.float64), alpha, 0.9), held_out_prompts(EMERGENCE)[0], 30, n_batches=32, batch_size=64, seed=5)
    at_star[name] = dict(neu=g.square().sum().item(), max_real=ev.real.max().item(), n_unstable=int((ev.real > 1e-8).sum()), n_params=len(g), neu_n30=neu30, neu_n30_se=neu30_se)
assert all(r["neu"] > 1e-4 and r["n_unstable"] > 0 and r["neu_n30"] > 2 * r["neu_n30_se"] for r in at_star.values()), at_star
Markdown("| point | NEU at $n = \\infty$ | largest real part | eigenvalues with positive real part | NEU at $n = 30$ |\n|---|---|---|---|---|\n"
         + "\n".join(f"| {k} | {r['neu']:.3g} | {r['max_real']:.3f} | {r['n_unstable']} of {r['n_params']} | "
                     f"{r['neu_n30']:.3g} ± {r['neu_n30_se']:.2g} |" for k, r in at_star.items()))

# %% [markdown]
# The same at the training context length $n = 30$, where the expectation over contexts has no
# closed form: `sampled_jacobians` draws $N_{\mathrm b}$ batches of stationary contexts (held-out tasks),
# computes each batch's exact $(G, J_G)$ over the query and its successor, and `jacobian_spectrum`
# reports the spectrum of the mean Jacobian with delete-one jackknife standard errors over the
# batches (saved by `run_jacobian_study`: a few minutes of CPU):

# %%
jac_saved = json.loads(Path("data/mechanism_jacobian.json").read_text())
pm = lambda r, k, fmt: format(r[k], fmt) + (f" ± {r[k + '_se']:{fmt}}" if k + "_se" in r else "")
Markdown(f"Made by `{jac_saved['provenance']['command']}` at commit `{jac_saved['provenance']['commit'][:10]}` on {jac_saved['provenance']['date'][:10]}; "
         f"$n = 30$: {jac_saved['n_batches']} batches of {jac_saved['batch_size']} contexts.\n\n"
         "| point | context | NEU | largest real part of an eigenvalue of $J_G$ | eigenvalues with positive real part (of "
         f"{next(iter(next(iter(jac_saved['points'].values())).values()))['n_params']}) | smallest real part |\n|---|---|---|---|---|---|\n" +
         "\n".join(f"| {name} | {where} | {pm(r, 'neu', '.3g')} | {pm(r, 'max_real', '.3f')} | {pm(r, 'n_unstable', '.0f')} | {pm(r, 'min_real', '.3f')} |"
                   for name, pts in jac_saved["points"].items() for where, r in pts.items()))

# %%
jac30 = {name: pts["n = 30"] for name, pts in jac_saved["points"].items()}
assert all(r["max_real"] > 2 * r["max_real_se"] for r in jac30.values()), jac30
assert jac30["theta* (beta 1, alpha 1)"]["neu"] > 2 * jac30["theta* (beta 1, alpha 1)"]["neu_se"], jac30
jac_z = {name: dict(neu_z=r["neu"] / r["neu_se"], max_real_z=r["max_real"] / r["max_real_se"]) for name, r in jac30.items()}

# %% [markdown]
# **What it shows.** At both points the expected update is not zero, at $n = \infty$ (`neu`) and at the training
# context $n = 30$ (`neu_n30`, the unbiased estimate of the emergence chapter with its jackknife
# standard error, more than two standard errors above zero), and the Jacobian has
# eigenvalues with positive real part, at $n = \infty$ and at $n = 30$ alike (the largest real
# part more than two jackknife standard errors above zero at $n = 30$, asserted above; the
# Jacobian's own sample is too small to separate the best-fit point's NEU from zero, which the
# larger `neu_jackknife` sample above does): neither
# point is a rest point of the mean dynamics at this configuration. Stability is a property of rest points, so
# $\theta^*$ is neither a stable nor an unstable point here: the mean update is not zero there, and the flow
# $\dot\theta = G(\theta)$ moves away from it whatever the Jacobian's spectrum. The eigenvalues with positive real part
# say only that near $\theta^*$ the update grows in some directions. (Pretraining uses Adam, whose per-coordinate
# scaling changes the eigenvalues but not whether $G = 0$; the training runs below are the direct test.)
# Second, training itself from these points, exactly and perturbed ($\mathcal N(0, 0.05^2)$ on
# every parameter), ten seeds each (`run_theta_star_dynamics`):

# %%
dyn_saved = json.loads(Path("data/mechanism_dynamics.json").read_text())
dyn = {k: study_summary(load_models(v["runs"])) for k, v in dyn_saved["studies"].items()}
Markdown(f"Made by `{dyn_saved['provenance']['command']}` at commit `{dyn_saved['provenance']['commit'][:10]}` on {dyn_saved['provenance']['date'][:10]}.\n\n" +
         summary_table({"random init. (TD, seeds 0-9)": controls["td"]} | dyn, "start"))

# %%
#| fig-cap: "Figure 6b.6: training started at either theta* moves away from it: the value error, the expected-update norm and the last current-value weight all leave their starting values."
#| fig-alt: "Three panels against training step: held-out MSVE (log scale), NEU at n = infinity (log scale) and the last layer's current-value weight, one line per start (two theta* points, exact and perturbed) with bands of one standard error over ten seeds; the legend sits below the panels."
fig, axs = plt.subplots(1, 3, figsize=(13, 4.6))
for i, (name, st) in enumerate(dyn_saved["studies"].items()):
    h = [r["history"] for r in st["runs"]]
    step = torch.tensor(h[0]["step"], dtype=torch.float64).flatten()
    for ax, key, f in ((axs[0], "msve", lambda x: x[..., 0]), (axs[1], "neu_population", lambda x: x[..., 0]), (axs[2], "value_weights", lambda x: x[..., -1, 2])):
        y = f(torch.tensor([r[key] for r in h], dtype=torch.float64))
        m, se = y.mean(0), y.std(0) / math.sqrt(len(y))
        ax.plot(step, m, ("-" if "N(0" not in name else "--"), color=f"C{i % 2}", label=name); ax.fill_between(step, m - se, m + se, color=f"C{i % 2}", alpha=0.2)
axs[0].set(yscale="log", xlabel="training step", ylabel="MSVE (held-out tasks)", title="Value error")
axs[1].set(yscale="log", xlabel="training step", ylabel=r"NEU at $n = \infty$", title="Norm of the expected update")
axs[2].set(xlabel="training step", ylabel="weight", title="Last layer's current-value weight")
for ax in axs[:2]: plain_log_ticks(ax, "y")
fig.tight_layout(rect=(0, 0.12, 1, 1)); fig.legend(*axs[0].get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=9, frameon=False)


# %% [markdown]
# Each curve is the mean over ten seeds with a band of one standard error; dashed: the perturbed
# starts. Where does training go? The relative distance of the final parameters from the starting
# $\theta^*$, $\|\theta_{\mathrm{end}} - \theta^*\| / \|\theta^*\|$, and the value error at the start and the end,
# per seed:

# %%
def _distance(run):
    c = PretrainConfig(**run["config"])
    star = torch.stack([torch.stack(theta_star(4, c.init_beta * torch.eye(4, dtype=torch.float64), c.init_alpha, c.gamma))] * c.n_layers)   # (L, 3, D, D)
    final = torch.stack([torch.tensor(run["params"][k], dtype=torch.float64) for k in ("A", "V_cur", "V_tgt")], 1)
    return ((final - star).norm() / star.norm()).item()
dyn_moves = {k: dict(distance=torch.tensor([_distance(r) for r in st["runs"]], dtype=torch.float64),
                     msve_start=torch.tensor([r["history"]["msve"][0][0] for r in st["runs"]], dtype=torch.float64),
                     msve_end=torch.tensor([r["history"]["msve"][-1][0] for r in st["runs"]], dtype=torch.float64)) for k, st in dyn_saved["studies"].items()}
Markdown("| start | relative distance moved | MSVE at the start | MSVE at the end |\n|---|---|---|---|\n"
         + "\n".join(f"| {k} | {ms(v['distance'])} | {ms(v['msve_start'])} | {ms(v['msve_end'])} |" for k, v in dyn_moves.items()))

# %% [markdown]
# **Check:**

# %%
spec_start, fit_start = list(dyn_moves)[0], list(dyn_moves)[1]
assert (dyn_moves[spec_start]["distance"] > 0.5).all() and (dyn_moves[spec_start]["msve_end"] < dyn_moves[spec_start]["msve_start"]).all(), dyn_moves[spec_start]
spec_lower = int((dyn_moves[spec_start]["msve_end"] < dyn_moves[spec_start]["msve_start"]).sum())
assert dyn["theta* (beta 1, alpha 1)"]["one uniform layer"].sum() >= 9 and dyn[fit_start]["one uniform layer"].sum() <= 1
assert (dyn_moves[fit_start]["distance"] > 0.5).all(), dyn_moves[fit_start]   # training leaves the best-fit construction too
fit_rises = int((dyn_moves[fit_start]["msve_end"] > dyn_moves[fit_start]["msve_start"]).sum())
assert all(sm["pattern, last layer"].sum() == 10 for sm in dyn.values()), dyn
start_vs_random = diff_z(controls["td"]["MSVE"], dyn["theta* (beta 1, alpha 1)"]["MSVE"])

# %%
Markdown(f"Training does not stay at either $\\theta^*$. From the constructed $\\theta^*$ of Definition 3.1 ($W = I$, $\\alpha = 1$), exact or perturbed, "
         f"training leaves it: the parameters end {dyn_moves[spec_start]['distance'].mean():.2f} of $\\|\\theta^*\\|$ away (mean over seeds), the value error goes from "
         f"{dyn_moves[spec_start]['msve_start'].mean():.2f} to {dyn_moves[spec_start]['msve_end'].mean():.3f} (lower at the end in {spec_lower} of 10 seeds), and the models end in the same kind of solution as from a random "
         f"initialisation, with one uniform layer in {int(dyn['theta* (beta 1, alpha 1)']['one uniform layer'].sum())} of 10 seeds and an error "
         f"{dyn['theta* (beta 1, alpha 1)']['MSVE'].mean():.3f} against {controls['td']['MSVE'].mean():.3f} from random initialisation (a difference of "
         f"{start_vs_random:.1f} standard errors, not a claim). From the best-fit $\\theta^*$ training also moves away (a relative distance of "
         f"{dyn_moves[fit_start]['distance'].mean():.2f}), and the value error *rises* in {fit_rises} of 10 seeds, from {dyn_moves[fit_start]['msve_start'].mean():.3f} to "
         f"{dyn_moves[fit_start]['msve_end'].mean():.3f}" + (": the TD update is not a descent direction of the value error, and its best-fitting construction is not where it rests. "
         if fit_rises >= 9 else ": the best-fitting construction is not where training rests, and training from it does not reliably lower the value error. ") +
         f"Every start ends with the sign pattern in the last layer in every seed: the sign pattern survives training, the construction does not.")

# %% [markdown]
# ### Experiment 4: iterating a learned shared layer
#
# **Question.** Is a learned layer a convergent iteration, as $\theta^*$'s layer is where chapter 5's condition holds?
#
# **Setup.** A model with one *shared* layer, trained at the same settings (`run_shared_study`, ten seeds),
# is one learned update; chapter 5 studies what iterating such an update does. Here the learned
# layer is iterated beyond the training depth $L = 3$ and its held-out MSVE is measured against
# depth, at the training context $n = 30$ and at $n = \infty$. Chapter 5's prediction for the
# learned kernel [ours] assumes what its theory assumes: the layer writes only the value row and
# its population kernel $M$ (`learned_kernel` at depth 1) stays fixed. Then the values follow the
# linear recursion $v_{t+1} = v_t + M\,(a_0 + (a_v I + a_{v'} P)\,v_t)$ from $v_0 = 0$, with
# $a_{v'}$, $a_v$ the learned successor- and current-value weights and $a_0(y)$ the rest of the value-row write at key
# $y$ (features and rewards of $y$ and of its successor); its limit, where $M$ is invertible, is
# $v_\infty = -(a_v I + a_{v'} P)^{-1} a_0$, a TD fixed point with discount
# $a_{v'} / (-a_v)$ when $a_v < 0$.

# %% [markdown]
# `shared_recursion` computes this recursion from the learned layer, and `iterate_shared` runs the trained
# layer $K$ times and measures its held-out MSVE at $n = 30$ and at $n = \infty$ beside the recursion's
# prediction (both in *Implementation: the probes*, with a check against chapter 5's `td_recursion`).

# %% [markdown]
# **Result.** The ten trained shared-layer models, iterated up to $T = 48$ times. The errors grow by many orders of
# magnitude, so the table gives the median over seeds with the quartiles:

# %%
shared_saved = json.loads(Path("data/mechanism_shared.json").read_text())
shared_runs = load_models(shared_saved["studies"]["shared"]["runs"])
it_depths = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)
iters = [iterate_shared(dataclasses.replace(c, eval_tasks=64), m, it_depths) for c, m in shared_runs]
it = {k: torch.tensor([r[k] for r in iters], dtype=torch.float64) for k in ("msve_n", "msve_inf", "msve_predicted")}
q3 = lambda x: x.quantile(torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64), dim=0)
mq = lambda x, i: (lambda q: f"{q[1, i]:.3g} [{q[0, i]:.3g}, {q[2, i]:.3g}]")(q3(x))
Markdown(f"Made by `{shared_saved['provenance']['command']}` at commit `{shared_saved['provenance']['commit'][:10]}` on {shared_saved['provenance']['date'][:10]}.\n\n"
         "| iterations $T$ | MSVE at n = 30 | MSVE at n = ∞ | chapter 5's recursion (n = ∞) |\n|---|---|---|---|\n" +
         "\n".join(f"| {K}{' (training depth)' if K == 3 else ''} | {mq(it['msve_n'], i)} | {mq(it['msve_inf'], i)} | {mq(it['msve_predicted'], i)} |" for i, K in enumerate(it_depths)))

# %%
#| fig-cap: "Figure 6b.7: a learned shared layer is tuned to its training depth: iterated further, its value error grows without bound, and chapter 5's recursion with the learned kernel diverges too, more slowly."
#| fig-alt: "Held-out MSVE (log scale) against the number of iterations of the learned shared layer (log scale), median over ten seeds with interquartile bands, for the model at n = 30, the model at n = infinity, and chapter 5's linear recursion with the learned kernel; a dotted vertical line marks the training depth 3."
fig, ax = plt.subplots(figsize=(6.4, 4))
for i, (k, label) in enumerate((("msve_n", "model, $n = 30$"), ("msve_inf", r"model, $n = \infty$"), ("msve_predicted", r"chapter 5's recursion, learned $M$"))):
    q = q3(it[k])
    ax.plot(it_depths, q[1], ("o-", "^-.", "s--")[i], color=f"C{i}", label=label); ax.fill_between(it_depths, q[0], q[2], color=f"C{i}", alpha=0.2)
ax.axvline(3, color="k", ls=":", lw=0.8)
ax.set(xscale="log", yscale="log", xlabel="iterations T of the learned layer", ylabel="MSVE (held-out tasks), median over seeds"); ax.set_xticks([1, 2, 3, 4, 6, 8, 12, 16, 24, 48]); plain_log_ticks(ax, "x"); ax.xaxis.set_minor_formatter(NullFormatter())
ax.legend(); fig.tight_layout()

# %% [markdown]
# **What it shows, and the check:**

# %%
shared_w = torch.stack([m.value_weights()[0] for _, m in shared_runs])             # (seeds, 3): reward, successor, current
eff_gamma = shared_w[:, 1] / -shared_w[:, 2]
best_K = [it_depths[int(i)] for i in it["msve_n"].argmin(-1)]
i3, i12 = it_depths.index(3), it_depths.index(12)
assert sum(K == 3 for K in best_K) >= 9 and (it["msve_n"][:, i12] > 10 * it["msve_n"][:, i3]).all(), (best_K, it["msve_n"])
assert ((shared_w[:, 2] < 0) & (eff_gamma > 1)).sum() >= 9, shared_w
Markdown(f"The learned shared layer is not a convergent iteration run for three steps: it is tuned to its training depth. The error at $n = 30$ is smallest at "
         f"$T = 3$ in {sum(K == 3 for K in best_K)} of 10 seeds (median {q3(it['msve_n'])[1, i3]:.3f}) and at $T = 12$ it is at least ten times larger in every "
         f"seed (median {q3(it['msve_n'])[1, i12]:.3g}). The learned weights have "
         f"$a_v < 0$ with an effective discount $a_{{v'}} / (-a_v)$ above 1 in {int(((shared_w[:, 2] < 0) & (eff_gamma > 1)).sum())} of 10 seeds (median "
         f"{eff_gamma.median():.2f}), and TD iterates with a discount above 1 have no stable fixed point, which is consistent with the divergence. But chapter 5's "
         f"recursion with the learned kernel does not explain the iterated layer: at $T = 3$ its median error is {q3(it['msve_predicted'])[1, i3]:.3f}, "
         f"{q3(it['msve_predicted'])[1, i3] / q3(it['msve_inf'])[1, i3]:.1f} times the model's {q3(it['msve_inf'])[1, i3]:.3f} at $n = \\infty$, and from $T = 3$ to 4 "
         f"its error {'falls' if q3(it['msve_predicted'])[1, i3 + 1] < q3(it['msve_predicted'])[1, i3] else 'rises'} while the model's "
         f"{'rises' if q3(it['msve_inf'])[1, i3 + 1] > q3(it['msve_inf'])[1, i3] else 'falls'}. The layer's writes outside the value row, which the recursion leaves "
         f"out, carry much of what the iterations compute.")

# %% [markdown]
# ### Experiment 5: where the value shape matters, the gap map
#
# **Question.** The [emergence chapter](emergence.html)'s oracle constant beats the trained models on MSVE,
# because MSVE is mostly the value *level*. The centred error asks about the shape: where does a trained model know more
# than the value level?
#
# **Setup.** The gap map
# (saved by `run_gap_map`, ten seeds per cell, 2000 steps each) changes one or two settings of
# `EMERGENCE` at a time: the context length $n$ (30 and 300), the discount (0.5 and 0.9), one-hot
# features (on the same chains as the random features of the same seed: chapter 0), and twice the states. The "shape explained" is $1 - \mathrm{cMSVE}/\mathrm{Var}_{d_\pi}(v_\pi)$,
# zero for every constant.
#
# **Result:**

# %%
gap_saved = json.loads(Path("data/mechanism_gap_map.json").read_text())
gaps = gap_table(gap_saved["cells"])
Markdown(f"Made by `{gap_saved['provenance']['command']}` at commit `{gap_saved['provenance']['commit'][:10]}` on {gap_saved['provenance']['date'][:10]}.\n\n"
         "| cell (change to EMERGENCE) | MSVE trained | MSVE best constant | MSVE cert. equiv. |\n|---|---|---|---|\n" +
         "\n".join(f"| {k} | {ms(g['MSVE trained'])} | {ms(g['MSVE best constant'])} | {ms(g['MSVE certainty equivalence'])} |" for k, g in gaps.items()) +
         "\n\nAnd the value shape and the layers' structure, per cell:\n\n"
         "| cell | shape explained, trained | shape explained, cert. equiv. | (+, +, −) in last selective layer | one uniform layer |\n|---|---|---|---|---|\n" +
         "\n".join(f"| {k} | {ms(g['shape explained, trained'])} | "
                   f"{ms(g['shape explained, certainty equivalence'])} | {int(g['pattern, last selective layer'].sum())} / {len(g['MSVE trained'])} | "
                   f"{int(g['one uniform layer'].sum())} / {len(g['MSVE trained'])} |" for k, g in gaps.items()))


# %% [markdown]
# **Check:**

# %%
def _gamma(cell): return cell["config"]["gamma"]
se_of = lambda x: (x.std() / math.sqrt(len(x))).item()
gap_claims = {k: dict(gamma=_gamma(c), shape_z=g["shape explained, trained"].mean().item() / se_of(g["shape explained, trained"]),
                      beats_constant_z=(g["MSVE best constant"] - g["MSVE trained"]).mean().item() / se_of(g["MSVE best constant"] - g["MSVE trained"]),
                      shape_minus_ce=(g["shape explained, trained"] - g["shape explained, certainty equivalence"]).mean().item(),
                      pattern=int(g["pattern, last selective layer"].sum()), one_uniform=int(g["one uniform layer"].sum()))
              for (k, g), c in zip(gaps.items(), gap_saved["cells"])}
assert all(c["shape_z"] > 2 and c["pattern"] >= 9 for c in gap_claims.values()), gap_claims
assert all(c["one_uniform"] >= 9 for k, c in gap_claims.items() if c["gamma"] == 0.9 and "n_states" not in k), gap_claims
assert all(c["one_uniform"] <= 1 for c in gap_claims.values() if c["gamma"] == 0.5), gap_claims

# %% [markdown]
# **What it shows:**

# %%
beat = [k for k, c in gap_claims.items() if c["beats_constant_z"] > 2]
lose = [k for k, c in gap_claims.items() if c["beats_constant_z"] < -2]
over_ce = [k for k, c in gap_claims.items() if c["shape_minus_ce"] > 0]
Markdown(f"Read across the map: in every cell the trained models explain at least {min(g['shape explained, trained'].mean() for g in gaps.values()):.2f} "
         f"of the value shape on average (far from the zero of every constant), and the "
         f"last selective layer shows $(+, +, -)$ in at least 9 of 10 seeds; the emergence chapter's sign-pattern claim, in this form, holds across the map. "
         f"The single uniform layer depends on the discount: with $s = 10$ states it appears in (nearly) every seed at $\\gamma = 0.9$ and in (nearly) none at "
         f"$\\gamma = 0.5$ (with twice the states, at $\\gamma = 0.9$, in "
         f"{', '.join(str(c['one_uniform']) for k, c in gap_claims.items() if 'n_states' in k)} of 10 seeds; other discounts below). The trained models beat the oracle best constant on plain MSVE by more than two standard "
         f"errors in the cells {'; '.join(beat) if beat else '(none)'}, and lose to it in {'; '.join(lose) if lose else '(none)'}: with a long horizon and a short "
         f"context the level dominates the error and the oracle constant knows the level; elsewhere the shape, where TD structure lives, carries enough of the error "
         f"for the trained model to win. Certainty equivalence explains more of the shape than the trained models in every cell but "
         f"{'; '.join(over_ce) if over_ce else 'none'}.")

# %% [markdown]
# **Longer horizons, trained to full length.** The emergence chapter's discount ablation trains for 500 steps, which confounds a long horizon
# with under-training. Here $\gamma = 0.7$ and $0.95$ are trained for the full 2000 steps of
# `EMERGENCE` (saved by `run_gap_map` with these two cells), ten seeds each.

# %%
gamma_saved = json.loads(Path("data/mechanism_gamma.json").read_text())
gamma_full = gap_table(gamma_saved["cells"])
Markdown(f"Made by `{gamma_saved['provenance']['command']}` at commit `{gamma_saved['provenance']['commit'][:10]}` on {gamma_saved['provenance']['date'][:10]}.\n\n"
         "| cell | MSVE trained | MSVE best constant | shape explained, trained | (+, +, −) in last selective layer | one uniform layer |\n|---|---|---|---|---|---|\n" +
         "\n".join(f"| {k} | {ms(g['MSVE trained'])} | {ms(g['MSVE best constant'])} | {ms(g['shape explained, trained'])} | "
                   f"{int(g['pattern, last selective layer'].sum())} / 10 | {int(g['one uniform layer'].sum())} / 10 |" for k, g in gamma_full.items()))

# %%
g95, g70 = gamma_full["gamma = 0.95"], gamma_full["gamma = 0.7"]
assert g70["pattern, last selective layer"].sum() >= 9 and g95["pattern, last selective layer"].sum() < 9, gamma_full
assert all(g["one uniform layer"].sum() <= 3 for g in gamma_full.values()), gamma_full

# %%
Markdown(f"At $\\gamma = 0.7$ the last selective layer shows $(+, +, -)$ in {int(g70['pattern, last selective layer'].sum())} of 10 seeds after 2000 steps; at "
         f"$\\gamma = 0.95$ in only {int(g95['pattern, last selective layer'].sum())}, below the bar of 9, with a value error ({g95['MSVE trained'].mean():.2f}) "
         f"far above the oracle constant's ({g95['MSVE best constant'].mean():.2f}). Four times the emergence chapter's training length does not make the pattern "
         f"appear at the long horizon; whether still longer training would is not measured here. The single uniform layer of $\\gamma = 0.9$ is rare at both "
         f"({int(g70['one uniform layer'].sum())} and {int(g95['one uniform layer'].sum())} of 10 seeds).")

# %% [markdown]
# ## Claims and multiplicity
#
# Each experiment on this page has one primary claim; its other claims are secondary and are
# corrected together, per experiment, with Holm's procedure. The p-values are one-sided: a count
# of seeds against the null rate 1/2 (`binomial_greater`; a sign pattern or a winner chosen by a
# coin), a difference of seed means in units of its standard error against the normal
# (`normal_greater`), and counts between two objectives by Fisher's exact test. A claim that
# needs several comparisons to hold at once (e.g. "more than every control") takes the largest
# of their p-values (an intersection-union test). The primary claims are rerun on seeds the book
# does not show in `tests/test_mechanism.py`, `tests/test_mechanism_dynamics.py` and `tests/test_contest.py`.

# %%
z_max_p = lambda zs: max(normal_greater(z) for z in zs)
paired_z = lambda x: (x.mean() / (x.std() / math.sqrt(len(x)))).item()   # a paired difference in units of its s.e.
families = {
    "anatomy (seeds 0-9)": dict(primary=("one layer keeps uniform attention", binomial_greater(anat["one_uniform_layer"], anat["n_seeds"])),
                                secondary={}),
    "contest (fitted 0-9, scored 10-39)": dict(primary=("level + TD iterates has a lower residual ratio than the runner-up", normal_greater(margin / margin_se)),
                                               secondary={f"… lower than {CONTEST_NAMES[k]} in more seeds than chance": binomial_greater(int((hr['td'] < hr[k]).sum()), n_head)
                                                          for k in hr if k != "td"}),
    "controls": dict(primary=("TD explains more value shape than every control", z_max_p([z["shape"] for z in ctrl_z.values()])),
                     secondary={**{f"MSVE: TD's is higher than {k}'s": normal_greater(z["msve"]) for k, z in ctrl_z.items()},
                                **{f"{meas}: TD more often than {k}": fisher_greater(int(controls["td"][meas].sum()), 10, int(controls[k][meas].sum()), 10)
                                   for meas in ("pattern, last selective layer", "pattern, last layer", "one uniform layer") for k in ctrl_z}}),
    "dynamics": dict(primary=("theta*(beta 1, alpha 1) is not a rest point at n = 30 (NEU > 0)", normal_greater(jac_z["theta* (beta 1, alpha 1)"]["neu_z"])),
                     secondary={"the mean update's Jacobian at theta*(1, 1) has an expanding direction at n = 30": normal_greater(jac_z["theta* (beta 1, alpha 1)"]["max_real_z"]),
                                "… and at the best-fit theta*": normal_greater(jac_z[fit_start]["max_real_z"]),
                                "training from best-fit theta* raises the MSVE": binomial_greater(int((dyn_moves[fit_start]["msve_end"] > dyn_moves[fit_start]["msve_start"]).sum()), 10)}),
    "depth": dict(primary=("more layers explain more value shape (L = 8 against L = 2)", normal_greater(depth_shape_z)),
                  secondary={f"(+, +, −) in the last selective layer at L = {L}": binomial_greater(int(depth[f'L = {L}']['pattern, last selective layer'].sum()), 10) for L in (3, 4, 6, 8)}),
    "iterated shared layer": dict(primary=("the error is smallest at the training depth K = 3", binomial_greater(sum(K == 3 for K in best_K), 10)),
                                  secondary={"effective discount b / (-c) above 1": binomial_greater(int(((shared_w[:, 2] < 0) & (eff_gamma > 1)).sum()), 10)}),
    "convergence (lr 0.01)": dict(primary=("one uniform layer where the measures are taken", binomial_greater(conv_counts["0.01"]["one_uniform"], 10)),
                                  secondary={"(+, +, −) in the last selective layer": binomial_greater(conv_counts["0.01"]["pattern_selective"], 10),
                                             "the lookahead beats theta* on the held-out seeds": binomial_greater(look_wins["0.01"], n_test["0.01"])}),
    "interventions (seeds 10-39)": dict(
        primary=("level + TD iterates predicts the change under shuffled successors better than the runner-up",
                 normal_greater(paired_z(sh_cr[sh_next] - sh_cr["td"]))),
        secondary={**{f"… and at n = {lengths[-1]} better than {CONTEST_NAMES[k]}": normal_greater(paired_z(ln_cr[k] - ln_cr["td"]))
                      for k in ln_cr if k != "td"},
                   f"the models' MSVE falls from n = 30 to n = {lengths[-1]}":
                       binomial_greater(int((ln_msve[lengths[-1]] < ln_msve[30]).sum()), len(iv)),
                   "patching a uniform layer 1 moves more of the level than the level term alone":
                       normal_greater(paired_z(s_all - tdf["level"] / Lam))}),
    "weights (40 seeds)": dict(
        primary=("the level sensitivity read off the weights correlates with the fitted one (Fisher z)",
                 normal_greater(math.atanh(lam_corr) * math.sqrt(len(wr) - 3))),
        secondary={"the selective layers' kernels are less anisotropic than the uniform layer's": normal_greater(iso_z)}),
}
Markdown(claims_table(families))

# %%
for exp, f in families.items():
    record_claim(exp.split(" (")[0].replace(" ", "-"), f"{f['primary'][0][0].upper()}{f['primary'][0][1:]} ({exp}; one-sided p {'< 1e-6' if f['primary'][1] < 1e-6 else '= ' + format(f['primary'][1], '.2g')}).",
                 "measured" if f["primary"][1] < 0.05 else "partial", "mechanism", "#claims-and-multiplicity")
ctrl_adj = holm(families["controls"]["secondary"])
within = [f"{meas}: TD more often than {k}" for meas, ps in ctrl_tests.items() for k, p in ps.items() if p < 0.05]
lost, kept = [k for k in within if ctrl_adj[k] >= 0.05], [k for k in within if ctrl_adj[k] < 0.05]
sel_kept = [k for k in ctrl_z if ctrl_adj[f"pattern, last selective layer: TD more often than {k}"] < 0.05]
Markdown(f"Every primary claim holds at the 0.05 level: {all(f['primary'][1] < 0.05 for f in families.values())}. Corrected together, the controls "
         f"experiment's secondary claims keep {sum(p < 0.05 for p in ctrl_adj.values())} of {len(ctrl_adj)}: "
         f"{'; '.join(k for k, p in ctrl_adj.items() if p < 0.05) or 'none'}. Of the count differences between TD and the controls that are significant within "
         f"their own measure in the controls section, {'; '.join(lost) or 'none'} {'is' if len(lost) == 1 else 'are'} not significant once all the experiment's "
         f"secondary claims are corrected together, and {'; '.join(kept) or 'none'} {'stays' if len(kept) == 1 else 'stay'} significant.")

# %% [markdown]
# ## What the trained models compute
#
# The answers to the questions this page set out with, generated from the outputs above:

# %%
uniform_other = ", ".join(f"{k}: {int(g['one uniform layer'].sum())}/10" for k, g in gamma_full.items())
Markdown(f"1. **The algorithm.** The contest's winner, in the headline cell, is {CONTEST_NAMES[winner]}, $\\hat v = \\lambda \\bar R/(1-\\gamma) + \\sigma v_k$ "
         f"with $(\\lambda, \\sigma, k, \\beta) = ({tdf['level']:.3f}, {tdf['scale']:.3f}, {tdf['theta']['k']}, {tdf['theta']['beta']:g})$ fitted on seeds 0-9: on seeds 10-39 "
         f"its residual ratio is {ms(hr['td'])} against {ms(hr[runner])} for the runner-up, lower in {n_lower} of {n_head} seeds; it wins {len(clear)} of the "
         f"{len(winners)} cells of the sweep by more than two standard errors, and fits TD-trained models better than control-trained ones in {n_pos} of {len(zs)} comparisons.\n"
         f"1. **Interventions.** With its constants frozen it predicts the models' change under shuffled successors (change ratio "
         f"{sh_cr['td'].mean():.2f}, next best {sh_cr[sh_next].mean():.2f}) and at $n = {lengths[-1]}$ (change ratio {ln_cr['td'].mean():.2f}), where the "
         f"models' MSVE falls to {ln_msve[lengths[-1]].mean():.2f}; patching the uniform layer from another task, where it is layer 1, moves a share {s_all.mean():.2f} of the level.\n"
         f"1. **The weights.** The level sensitivity read off the weights with attention frozen matches the fitted one (correlation {lam_corr:.2f}); the "
         f"selective layers' kernels are close to $\\beta I$; the value-row weights are not TD steps.\n"
         f"2. **The layers.** In {anat['one_uniform_layer']} of 10 seeds one layer keeps uniform attention and writes a state-blind baseline; this happens at "
         f"$\\gamma = 0.9$, and rarely at the other discounts measured ({uniform_other}; "
         f"in at most {max(c['one_uniform'] for c in gap_claims.values() if c['gamma'] == 0.5)} of 10 seeds at $\\gamma = 0.5$). The sign pattern lives in the last *selective* layer.\n"
         f"3. **Chapter 5's condition.** No layer of any trained model meets it (largest minimum diagonal {cond['min_diagonal'].max():.3f} against "
         f"{conditions[0]['threshold']:.2f}), but neither does $\\theta^*$ itself with these features at $\\beta \\le 15$: the result is forced by the features.\n"
         f"4. **Where TD structure matters.** The trained models learn part of the value shape in every cell of the gap map, and beat the oracle constant on MSVE "
         f"only where shape carries enough of the error ({'; '.join(beat)}).\n"
         f"5. **What is specific to TD.** More value shape than Monte-Carlo, supervised or temporally shuffled training; not a lower MSVE than Monte-Carlo or supervised training; a sign pattern in the "
         f"last selective layer that, once the experiment's secondary claims are corrected together, is significantly more frequent than under "
         f"{' and '.join(ctrl_names[k] for k in sel_kept) or 'none of the controls'}"
         f"{'' if len(sel_kept) in (0, len(ctrl_z)) else ', and not than under ' + ' and '.join(ctrl_names[k] for k in ctrl_z if k not in sel_kept)}.\n"
         f"6. **Dynamics.** $\\theta^*$ is not a rest point of the mean TD dynamics at this configuration (NEU {at_star['theta* (beta 1, alpha 1)']['neu']:.3g}, "
         f"{at_star['theta* (beta 1, alpha 1)']['n_unstable']} of {at_star['theta* (beta 1, alpha 1)']['n_params']} Jacobian eigenvalues with positive real part), "
         f"and training started there leaves it; it is not a rest point at the training context $n = 30$ either, so it is neither stable nor unstable. Near it the "
         f"mean update grows in some directions (largest real part of a Jacobian eigenvalue at $n = 30$: "
         f"{jac30['theta* (beta 1, alpha 1)']['max_real']:.3f} ± {jac30['theta* (beta 1, alpha 1)']['max_real_se']:.3f} at $\\theta^*(W = I, \\alpha = 1)$, "
         f"{jac30[fit_start]['max_real']:.3f} ± {jac30[fit_start]['max_real_se']:.3f} at the best fit).\n"
         f"7. **A learned shared layer** is tuned to its training depth: iterated further, its error grows without bound (smallest at $T = 3$ in "
         f"{sum(K == 3 for K in best_K)} of 10 seeds), consistent with its learned effective discount above 1; chapter 5's value-row recursion does not reproduce it "
         f"quantitatively.\n"
         f"8. **Convergence** ({len(conv)} learning rates, {max(c['steps'][-1] for c in conv.values())} steps): {settled_txt}; where the measures are taken, one uniform "
         f"layer in {conv_counts['0.01']['one_uniform']} of 10 seeds at the emergence chapter's learning rate.\n"
         f"9. **Deeper models** (12 and 16 separate layers) at the emergence chapter's learning rate blow up in "
         + " and ".join(f"{blown[k]} of {n_deep[k]} seeds at {k}" for k in deep_msve) + f".\n\nThe gap map covers {len(gaps)} cells.")


# %% [markdown]
# ## Implementation: the probes
#
# The probes, estimators, Jacobians and the shared-layer recursion that the lesson uses, each with its
# checks (on the toy model and prompts of the interventions' checks, and on $\theta^*$).

# %%
#| export
def centred_msve(v_hat:torch.Tensor,  # (B, s) value estimates of each task
                 tasks:TaskBatch,     # the tasks
                )->torch.Tensor:      # (B,) the d_pi-weighted error of the centred estimate against the centred v_pi
    "Value error after removing each task's $d_\\pi$-weighted mean from the estimate and from $v_\\pi$: the error in the value *shape*."
    if v_hat.shape != tasks.v_pi.shape: raise ValueError(f"`v_hat` must have shape {tuple(tasks.v_pi.shape)}, got {tuple(v_hat.shape)}")
    centre = lambda v: v - (tasks.d_pi * v).sum(-1, keepdim=True)
    return weighted_error(centre(v_hat), centre(tasks.v_pi), tasks.d_pi)


# %%
show_doc(centred_msve)

# %%
ct = random_tasks(32, seed=5)
floor = (ct.d_pi * (ct.v_pi - (ct.d_pi * ct.v_pi).sum(-1, keepdim=True)).square()).sum(-1)
test_close(centred_msve(torch.full_like(ct.v_pi, 3.), ct), floor, eps=1e-12)
test_close(centred_msve(ct.v_pi + 7., ct), torch.zeros(32, dtype=torch.float64), eps=1e-12)
test_close(centred_msve(2 * ct.v_pi, ct), floor, eps=1e-12)


# %% [markdown]
# ### Probes: the value row after every layer
#
# A layer of the model adds $(V^{\mathrm{cur}} Z + V^{\mathrm{tgt}} Z \Pi) S$ to every token: it can write any row,
# not only the value row that $\theta^*$ writes. The first probe, `layer_values`, reads the value row of the query
# columns after each layer: the model's running estimate, layer by layer.

# %%
#| export
def layer_values(model:SoftmaxICTD,  # the model
                 Z:torch.Tensor,     # (B, d+2, n+1+q) prompts
                 n:int,              # context length
                )->torch.Tensor:     # (L+1, B, q) value row of the query columns after 0..L layers
    "The value row of every query column after each layer."
    with torch.no_grad(): Zs = model(Z, n=n, return_all=True)
    return Zs[..., model.d + 1, n + 1:].movedim(-2, 0)


# %% [markdown]
# On the toy model and prompts of the interventions' checks (a random three-layer model, `EMERGENCE` prompts), the
# value row after the last layer is the model's prediction:

# %%
with torch.no_grad(): test_close(layer_values(toy, toy_Z, 30)[-1], toy.predict(toy_Z, n=30), eps=1e-12)


# %% [markdown]
# The value row is not the only row a layer can change. `row_writes` measures how much each layer writes into each
# row (the mean absolute change at the query columns), so that writes outside the value row, which $\theta^*$ never
# makes, show up.

# %%
#| export
def row_writes(model:SoftmaxICTD,  # the model
               Z:torch.Tensor,     # (B, d+2, n+1+q) prompts
               n:int,              # context length
              )->torch.Tensor:     # (L, d+2) mean |change| of each row at the query columns, per layer
    "How much each layer writes into each token row (features, reward, value) at the query columns."
    with torch.no_grad(): Zs = model(Z, n=n, return_all=True)
    return (Zs[:, 1:] - Zs[:, :-1])[..., n + 1:].abs().mean((0, -1))


# %% [markdown]
# $\theta^*$ writes only the value row (the last of the six rows), so its first five rows show no writes:

# %%
star1 = SoftmaxICTD.from_theta_star(4, 2, torch.eye(4, dtype=torch.float64), 1., 0.9)
test_eq((row_writes(star1, toy_Z, 30)[:, :5] == 0).all(), True)


# %% [markdown]
# `knockout` removes one layer, either entirely (`"identity"`: $V^{\mathrm{cur}} = V^{\mathrm{tgt}} = 0$) or only its
# selectivity (`"uniform"`: $A = 0$, so the layer attends uniformly to the context and still writes). What the
# error loses under each says what the layer contributes, and whether its attention pattern matters.

# %%
#| export
def knockout(model:SoftmaxICTD,  # the model (not changed)
             layer:int,          # the layer to knock out (0-based)
             mode:str,           # "identity" (the layer writes nothing) or "uniform" (A = 0: uniform attention)
            )->SoftmaxICTD:      # a copy with that layer knocked out
    "A copy of `model` with one layer removed or made to attend uniformly."
    if mode not in ("identity", "uniform"): raise ValueError(f"`mode` must be 'identity' or 'uniform', got {mode!r}")
    if model.shared: raise ValueError("`model` must have separate layers: a shared layer cannot be knocked out alone")
    if not 0 <= layer < model.n_layers: raise ValueError(f"`layer` must lie in [0, {model.n_layers}), got {layer}")
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in ((m.layer(layer).V_cur, m.layer(layer).V_tgt) if mode == "identity" else (m.layer(layer).A,)): p.zero_()
    return m


# %%
show_doc(knockout)


# %% [markdown]
# `knockout_rows` removes only some of a layer's writes: the rows of $V^{\mathrm{cur}}$ and $V^{\mathrm{tgt}}$ that write
# the given token rows (the value row $d + 1$, or the feature and reward rows $0, \dots, d$). A layer's attention
# and its other writes are left as they are.

# %%
#| export
def knockout_rows(model:SoftmaxICTD,  # the model (not changed)
                  layer:int,          # the layer (0-based)
                  rows:list,          # token rows whose writes are removed (0..d-1 features, d reward, d+1 value)
                 )->SoftmaxICTD:      # a copy in which that layer writes nothing into `rows`
    "A copy of `model` whose layer `layer` no longer writes into the token rows `rows`."
    if model.shared: raise ValueError("`model` must have separate layers: a shared layer cannot be knocked out alone")
    if not 0 <= layer < model.n_layers: raise ValueError(f"`layer` must lie in [0, {model.n_layers}), got {layer}")
    if not rows or any(not 0 <= r < model.d + 2 for r in rows): raise ValueError(f"`rows` must be a non-empty list of rows in [0, {model.d + 2}), got {rows}")
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in (m.layer(layer).V_cur, m.layer(layer).V_tgt): p[list(rows)] = 0
    return m


# %%
test_close(layer_values(knockout_rows(toy, 1, list(range(6))), toy_Z, 30), layer_values(knockout(toy, 1, "identity"), toy_Z, 30), eps=1e-12)
test_eq(row_writes(knockout_rows(toy, 2, [5]), toy_Z, 30)[2, 5], torch.tensor(0., dtype=torch.float64))
test_fail(lambda: knockout_rows(toy, 0, [6]), contains="`rows` must be")

# %% [markdown]
# Removing layer 2 makes the value row after layer 3 equal the intact model's after layer 2, and a removed last layer
# writes nothing:

# %%
test_close(layer_values(knockout(toy, 1, "identity"), toy_Z, 30)[2], layer_values(toy, toy_Z, 30)[1], eps=1e-12)
test_eq(row_writes(knockout(toy, 2, "identity"), toy_Z, 30)[2], torch.zeros(6, dtype=torch.float64))


# %% [markdown]
# Two more probes. A layer with uniform attention adds to every query the same context average,
# so its write to the value row should be constant within a task: `write_constancy` gives, per
# layer, the share of the variance of its value-row write that lies *between* tasks (1: the same
# number at every state of a task).

# %%
#| export
def write_constancy(model:SoftmaxICTD,  # the model
                    Z:torch.Tensor,     # (B, d+2, n+1+q) prompts (one task each)
                    n:int,              # context length
                   )->torch.Tensor:     # (L,) between-task share of the variance of each layer's value-row write
    "Per layer, the share of the variance of its value-row write at the queries that is constant within each task."
    vals = layer_values(model, Z, n)
    dv = vals[1:] - vals[:-1]                                               # (L, B, q)
    within = (dv - dv.mean(-1, keepdim=True)).square().mean((-2, -1))
    total = (dv - dv.mean((-2, -1), keepdim=True)).square().mean((-2, -1))
    return 1 - within / total.clamp(min=1e-300)


# %% [markdown]
# With every layer made uniform, every write is the same number at every state of a task (the API entry is in
# *Implementation and tests*):

# %%
flat_toy = knockout(knockout(toy, 1, "uniform"), 2, "uniform")
test_close(write_constancy(knockout(flat_toy, 0, "uniform"), toy_Z, 30), torch.ones(3, dtype=torch.float64), eps=1e-9)


# %% [markdown]
# And under uniform attention the mean of the successors' values
# over the context equals the mean of the current values up to one column, so such a layer cannot
# tell its successor-value weight $a_{v'}$ from its current-value weight $a_v$ (the value-row
# entries of $V^{\mathrm{tgt}}$ and $V^{\mathrm{cur}}$): only $a_{v'} + a_v$ matters.
# `swap_weights` moves weight $\Delta a$ from the current to the successor head,
# $(a_{v'}, a_v) \to (a_{v'} + \Delta a, a_v - \Delta a)$, which should leave a uniform layer's output nearly unchanged
# and can change a selective layer's output.

# %%
#| export
def swap_weights(model:SoftmaxICTD,  # the model (not changed)
                 layer:int,          # the layer whose value weights to change (0-based)
                 t:float,            # weight Delta a moved from the current-value to the successor-value head
                )->SoftmaxICTD:      # a copy with (a_v', a_v) -> (a_v' + t, a_v - t) in that layer
    "A copy of `model` whose layer `layer` has successor-value weight a_v' + t and current-value weight a_v - t."
    m, d = copy.deepcopy(model), model.d
    with torch.no_grad():
        m.layer(layer).V_tgt[d + 1, d + 1] += t
        m.layer(layer).V_cur[d + 1, d + 1] -= t
    return m


# %% [markdown]
# The value weights of the layer (reward, successor, current) move by $(0, \Delta a, -\Delta a)$:

# %%
test_close(swap_weights(toy, 1, 0.3).value_weights()[1] - toy.value_weights()[1], torch.tensor([0., 0.3, -0.3], dtype=torch.float64), eps=1e-12)


# %% [markdown]
# ### The learned kernel at $n = \infty$
#
# Chapter 5's theory is about the population attention $M$ of a layer: row $x$ is the query state
# $x$, column $y$ the key state $y$, in the limit of an infinitely long stationary context.
# `learned_kernel` computes it for every layer of a trained model, on the tokens that layer actually
# reads (so later layers see what earlier layers wrote, features included).

# %%
#| export
def learned_kernel(model:SoftmaxICTD,  # any parameters
                   tasks:TaskBatch,    # tasks (B of them)
                  )->torch.Tensor:     # (L, B, s, s) float64; [l, b, x, y]: layer l's attention of query state x on key state y
    "The population ($n = \\infty$) attention of every layer: row x is the query state, column y the key state."
    d = tasks.phi.shape[-1]
    if d != model.d: raise ValueError(f"`tasks` have d = {d} features but the model expects d = {model.d}")
    one = TaskBatch(*(getattr(tasks, k)[None] for k in ("P", "r", "phi", "d_pi", "v_pi")), tasks.gamma)
    s = tasks.r.shape[-1]
    with torch.no_grad(): atts = token_layers({k: v.double() for k, v in model_params(model).items()}, model.n_layers, population_tokens(one))[1]
    return torch.stack([a[0][..., :, s:].mT for a in atts])


# %%
show_doc(learned_kernel)

# %% [markdown]
# Checks: rows are distributions; for $\theta^*$ with $W = \beta I$ every layer has the same kernel,
# the softmax of $\beta \phi(x)^\top \phi(y)$ weighted by $d_\pi(y)$ (chapter 5's
# `population_attention`); and a layer with $A = 0$ has the kernel $d_\pi$ in every row.

# %%
kt = random_tasks(6, seed=11)
K_star = learned_kernel(SoftmaxICTD.from_theta_star(4, 3, 2. * torch.eye(4, dtype=torch.float64), 1., 0.9), kt)
test_eq(K_star.shape, (3, 6, 10, 10))
test_close(K_star.sum(-1), torch.ones(3, 6, 10, dtype=torch.float64), eps=1e-12)
ref = torch.softmax(2. * kt.phi @ kt.phi.mT + kt.d_pi.log()[:, None, :], -1)
test_close(K_star, ref.expand(3, -1, -1, -1), eps=1e-12)
test_close(learned_kernel(knockout(toy, 0, "uniform"), kt)[0], kt.d_pi[:, None, :].expand(-1, 10, -1), eps=1e-12)


# %% [markdown]
# Chapter 5's condition for contraction (Proposition 5.1) is $\min_x M(x, x) > (1 + \gamma)/2$. `kernel_condition`
# reports, per layer, the minimum diagonal (averaged over tasks, with the share of tasks where the
# condition holds), and two span coefficients (Proposition 5.2): $\operatorname{sc}(B)$ of the TD error matrix
# $B = I - M(I - \gamma P)$ the learned kernel would give inside $\theta^*$ ($\alpha = 1$), and
# $\operatorname{sc}(B_l)$ of layer $l$'s own linear map on the value row,
# $B_l = I + M(a_v I + a_{v'} P)$ with its learned current- and successor-value weights; a span
# constant below 1 means the map contracts differences between states.

# %%
#| export
def _span(B): return 0.5 * (B.unsqueeze(-2) - B.unsqueeze(-3)).abs().sum(-1).amax((-1, -2))

def kernel_condition(model:SoftmaxICTD,  # a trained model
                     tasks:TaskBatch,    # tasks to check on
                    )->dict:             # per layer (lists of L): min diagonal, share meeting the condition, span constants
    "Chapter 5's kernel-diagonality condition and span constants of every layer's learned population kernel."
    M, gamma = learned_kernel(model, tasks), tasks.gamma
    low = M.diagonal(dim1=-2, dim2=-1).amin(-1)                                   # (L, B)
    w = model.value_weights()
    I = torch.eye(M.shape[-1], dtype=M.dtype)
    own = torch.stack([_span(I + M[l] @ (w[l, 2] * I + w[l, 1] * tasks.P)) for l in range(len(M))])
    return dict(min_diagonal=low.mean(-1).tolist(), threshold=(1 + gamma) / 2, share_meeting=(low > (1 + gamma) / 2).double().mean(-1).tolist(),
                mean_diagonal=M.diagonal(dim1=-2, dim2=-1).mean((-2, -1)).tolist(),
                span_td=span_rate(M, tasks.P, gamma=gamma, alpha=1.).mean(-1).tolist(), span_own=own.mean(-1).tolist())


# %%
kc = kernel_condition(SoftmaxICTD.from_theta_star(10, 2, 50. * torch.eye(10, dtype=torch.float64), 1., 0.9), random_tasks(4, seed=1, features="onehot"))
test_eq(kc["share_meeting"], [1., 1.])
test_close(torch.tensor(kc["span_td"]), torch.full((2,), 0.9, dtype=torch.float64), eps=1e-6)


# %%
#| export
def layer_anatomy(config:PretrainConfig,  # the run's settings
                  model:SoftmaxICTD,      # its trained model
                  t:float=0.5,            # weight moved by `swap_weights`
                 )->dict:                 # per layer (lists of L) probes, and the intact MSVE
    "Every per-layer probe of one trained model on its held-out prompts (knockouts as ratios of MSVE, and of centred MSVE under `centred_`)."
    tasks, states, Z = held_out_prompts(config)
    err = lambda m: msve_of(m.predict(Z, n=config.n).detach(), tasks).mean().item()
    cerr = lambda m: centred_msve(m.predict(Z, n=config.n).detach(), tasks).mean().item()
    base, cbase, L = err(model), cerr(model), model.n_layers
    diag = learned_kernel(model, tasks).diagonal(dim1=-2, dim2=-1).mean((-2, -1))
    writes = row_writes(model, Z, config.n)
    return dict(seed=config.seed, msve=base, diagonality=diag.tolist(), constancy=write_constancy(model, Z, config.n).tolist(),
                feature_writes=writes[:, :model.d].mean(-1).tolist(), reward_writes=writes[:, model.d].tolist(), value_writes=writes[:, model.d + 1].tolist(),
                identity=[err(knockout(model, l, "identity")) / base for l in range(L)], uniform=[err(knockout(model, l, "uniform")) / base for l in range(L)],
                swap=[err(swap_weights(model, l, t)) / base for l in range(L)], value_weights=model.value_weights().tolist(),
                centred_identity=[cerr(knockout(model, l, "identity")) / cbase for l in range(L)], centred_uniform=[cerr(knockout(model, l, "uniform")) / cbase for l in range(L)],
                value_write_removed=[err(knockout_rows(model, l, [model.d + 1])) / base for l in range(L)],
                token_writes_removed=[err(knockout_rows(model, l, list(range(model.d + 1)))) / base for l in range(L)])


# %% [markdown]
# `lookahead_features` computes the three regressors of the lookahead at every state of each task: the context mean
# and the two kernel-smoothed rewards.

# %%
#| export
def lookahead_features(tasks:TaskBatch,      # the tasks
                       states:torch.Tensor,  # (B, n+1) one context per task
                       beta:float,           # kernel scale, scores beta phi(x)^T phi(S_j)
                      )->torch.Tensor:       # (B, s, 3): context mean R-bar, r_hat_beta(x), r_hat^+_beta(x)
    "The context mean and the kernel-smoothed reward and next reward at every state."
    B, s = tasks.r.shape
    rows = torch.arange(B)[:, None]
    R, phi_k = tasks.r[rows, states[:, :-1]], tasks.phi[rows, states[:, :-1]]
    K = torch.softmax(beta * tasks.phi @ phi_k.mT, -1)                       # (B, s, n)
    R_next = torch.cat([R[:, 1:], torch.zeros_like(R[:, :1])], -1)
    return torch.stack([R.mean(-1, keepdim=True).expand(B, s), (K @ R[..., None])[..., 0], (K @ R_next[..., None])[..., 0]], -1)


# %% [markdown]
# At $\beta = 0$ the kernel is uniform over the context, so the smoothed reward is the context mean at every state,
# and the smoothed next reward is the mean of $R_2, \dots, R_n$ and a zero:

# %%
lf0 = lookahead_features(toy_tasks, toy_states, 0.)
test_close(lf0[..., 1], lf0[..., 0], eps=1e-12)
test_close(lf0[..., 2], lf0[..., 0] - toy_tasks.r[torch.arange(8)[:, None], toy_states[:, :1]] / 30, eps=1e-12)


# %% [markdown]
# Each candidate is mapped onto the value row by `affine_fit`, weighted least squares with an intercept (the weights
# are $d_\pi$, so the states the chain visits most count most).

# %%
#| export
def affine_fit(y:torch.Tensor,   # (N,) targets
               X:torch.Tensor,   # (N, k) regressors (an intercept is added)
               w:torch.Tensor,   # (N,) non-negative weights
              )->torch.Tensor:   # (k + 1,) intercept, then one coefficient per regressor
    "Weighted least squares with an intercept."
    A = torch.cat([torch.ones_like(y)[:, None], X], -1) * w.sqrt()[:, None]
    return torch.linalg.lstsq(A, (y * w.sqrt())[:, None]).solution[:, 0]


# %% [markdown]
# `affine_predict` applies the fitted map to regressors of any leading shape (a task batch's $(B, s, k)$ included).

# %%
#| export
def affine_predict(coef:torch.Tensor,  # (k + 1,) intercept, then one coefficient per regressor
                   X:torch.Tensor,     # (..., k) regressors
                  )->torch.Tensor:     # (...) the affine map's values
    "intercept + X @ coefficients."
    return coef[0] + X @ coef[1:]


# %% [markdown]
# A fit to exact affine data recovers the constants, whatever the weights:

# %%
af_gen = torch.Generator().manual_seed(0)
af_X, af_w = torch.randn(50, 2, generator=af_gen, dtype=torch.float64), torch.rand(50, generator=af_gen, dtype=torch.float64)
af_coef = torch.tensor([0.5, -2., 3.], dtype=torch.float64)
test_close(affine_fit(affine_predict(af_coef, af_X), af_X, af_w), af_coef, eps=1e-12)


# %% [markdown]
# The score is the weighted $R^2$ of `weighted_r2`: the share of the $d_\pi$-weighted variance of the value row
# that the mapped candidate explains.

# %%
#| export
def weighted_r2(y:torch.Tensor,      # (N,) targets
                y_hat:torch.Tensor,  # (N,) predictions
                w:torch.Tensor,      # (N,) non-negative weights
               )->float:             # the weighted coefficient of determination
    "$1 - \\sum w (y - \\hat y)^2 / \\sum w (y - \\bar y_w)^2$."
    return (1 - (w * (y - y_hat).square()).sum() / (w * (y - (w * y).sum() / w.sum()).square()).sum()).item()


# %% [markdown]
# A perfect prediction scores 1, the weighted mean scores 0:

# %%
af_y = affine_predict(af_coef, af_X)
test_close(weighted_r2(af_y, af_y, af_w), 1., eps=1e-12)
test_close(weighted_r2(af_y, torch.full_like(af_y, float((af_w * af_y).sum() / af_w.sum())), af_w), 0., eps=1e-12)


# %% [markdown]
# `candidate_values` computes the candidates that need no fitting on a run's held-out tasks and contexts.

# %%
#| export
def candidate_values(config:PretrainConfig,  # the run's settings
                     beta:float=3.,          # kernel scale of the lookahead features
                    )->dict:                 # name -> (B, s) values on the run's held-out prompts
    "The candidate estimators that need no fitting, on a run's held-out tasks and contexts."
    tasks, states, _ = held_out_prompts(config)
    f = lookahead_features(tasks, states, beta)
    return {"context mean": f[..., 0], "certainty equivalence": certainty_equivalence_values(tasks, states), "reward at the query": tasks.r,
            "smoothed reward": f[..., 1], "smoothed next reward": f[..., 2]}


# %% [markdown]
# On the eight held-out tasks of the toy's prompts, the context mean $\bar R$ is the emergence chapter's state-blind
# estimate `context_mean_values` times $1 - \gamma$ (an affine map absorbs the scale), and the reward at the query is
# the task's own reward:

# %%
toy_cands = candidate_values(dataclasses.replace(EMERGENCE, eval_tasks=8))
test_close(toy_cands["context mean"] / (1 - EMERGENCE.gamma), context_mean_values(toy_tasks, toy_states), eps=1e-12)
test_eq(toy_cands["reward at the query"], toy_tasks.r)


# %% [markdown]
# `probe_layers` scores every candidate against the value row after every layer of one model, on
# its run's held-out prompts (every state a query). For the TD iterates the candidate after layer
# $l$ is $\theta^*$ with $l$ layers, $(\alpha, \beta)$ chosen on the grid of the emergence
# chapter to fit that value row best (by the private <code>_td_iterates</code>). It is used on the ten trained models
# under *What the value row holds, layer by layer* below.

# %%
#| export
def _td_iterates(config, Z, k, target, w):
    "The k-layer theta*(alpha, beta I) output of best affine fit to `target`, over the emergence grid."
    best = None
    for a in ALPHAS:
        for b in BETAS:
            with torch.no_grad(): v = theta_star_model(dataclasses.replace(config, n_layers=k), alpha=a, beta=b).predict(Z, n=config.n)
            r2 = weighted_r2(target, affine_predict(affine_fit(target, v.flatten()[:, None], w), v.flatten()[:, None]), w)
            if best is None or r2 > best[0]: best = (r2, a, b)
    return best


# %%
#| export
def probe_layers(config:PretrainConfig,  # the run's settings
                 model:SoftmaxICTD,      # its trained model
                 beta:float=3.,          # kernel scale of the lookahead features
                )->dict:                 # candidate -> (L,) R^2 of its best affine map onto the value row after each layer
    "How well each candidate estimator, mapped affinely, explains the value row after each layer."
    tasks, states, Z = held_out_prompts(config)
    vals, w = layer_values(model, Z, config.n), tasks.d_pi.flatten()
    cands = candidate_values(config, beta)
    f = torch.stack([cands["context mean"], cands["smoothed reward"], cands["smoothed next reward"]], -1).flatten(0, 1)
    out = {k: [] for k in list(cands) + ["lookahead (3 regressors)", "TD iterates (alpha, beta fitted)"]}
    for l in range(1, model.n_layers + 1):
        y = vals[l].flatten()
        for k, v in cands.items(): out[k].append(weighted_r2(y, affine_predict(affine_fit(y, v.flatten()[:, None], w), v.flatten()[:, None]), w))
        out["lookahead (3 regressors)"].append(weighted_r2(y, affine_predict(affine_fit(y, f, w), f), w))
        out["TD iterates (alpha, beta fitted)"].append(_td_iterates(config, Z, l, y, w)[0])
    return out


# %% [markdown]
# ### Fitted, then used to predict
#
# `fit_estimators` fits, pooled over a set of trained models, the constants of each candidate:
# the affine maps of the context mean and of certainty equivalence, $\theta^*(\alpha, \beta I)$ at
# the models' depth with $(\alpha, \beta)$ on the grid and an affine map, and the two-step
# lookahead, whose constants are the kernel scale $\beta$ (on the grid `LOOKAHEAD_BETAS`) and the intercept and three
# weights. The targets are the models' outputs on their held-out prompts, gathered by the private <code>_pooled</code>.

# %%
#| export
LOOKAHEAD_BETAS = (1., 2., 4., 6., 8., 12.)  # kernel scales tried for the lookahead

def _pooled(runs, target):
    "Held-out data of every run with the targets: the model's outputs, or v_pi."
    out = []
    for c, m in runs:
        tasks, states, Z = held_out_prompts(c)
        with torch.no_grad(): out.append((c, tasks, states, Z, m.predict(Z, n=c.n) if target == "model" else tasks.v_pi))
    return out


# %%
#| export
def fit_estimators(runs:list,             # (config, model) pairs of one configuration
                   target:str="model",    # fit to the models' outputs ("model") or to the true values ("v_pi")
                  )->dict:                # candidate -> its fitted constants
    "Fit every candidate's constants to the outputs of `runs` (or to v_pi on their held-out tasks), pooled."
    if target not in ("model", "v_pi"): raise ValueError(f"`target` must be 'model' or 'v_pi', got {target!r}")
    data = _pooled(runs, target)
    y = torch.cat([v.flatten() for *_, v in data]); w = torch.cat([t.d_pi.flatten() for _, t, *_ in data])
    def fit(make):
        X = torch.cat([make(c, t, s, Z).reshape(t.r.numel(), -1) for c, t, s, Z, _ in data])
        coef = affine_fit(y, X, w)
        return coef, weighted_r2(y, affine_predict(coef, X), w)
    out = {"context mean": dict(coef=fit(lambda c, t, s, Z: context_mean_values(t, s))[0].tolist()),
           "certainty equivalence": dict(coef=fit(lambda c, t, s, Z: certainty_equivalence_values(t, s))[0].tolist())}
    star = {}
    for a in ALPHAS:
        for b in BETAS:
            with torch.no_grad(): star[(a, b)] = fit(lambda c, t, s, Z: theta_star_model(c, alpha=a, beta=b).predict(Z, n=c.n))
    a, b = max(star, key=lambda k: star[k][1])
    out["theta*"] = dict(alpha=a, beta=b, coef=star[(a, b)][0].tolist())
    look = {beta: fit(lambda c, t, s, Z: lookahead_features(t, s, beta)) for beta in LOOKAHEAD_BETAS}
    beta = max(look, key=lambda k: look[k][1])
    out["lookahead"] = dict(beta=beta, coef=look[beta][0].tolist())
    return out


# %%
show_doc(fit_estimators)


# %% [markdown]
# `estimator_values` turns fitted constants back into values on any run's held-out prompts: what a fitted
# candidate *predicts* for a model it has not seen.

# %%
#| export
def estimator_values(name:str,             # a candidate of `fit_estimators`
                     fitted:dict,          # its constants
                     config:PretrainConfig,# the run whose held-out prompts to use
                    )->torch.Tensor:       # (B, s) the candidate's values
    "A fitted candidate's values on a run's held-out tasks and contexts."
    tasks, states, Z = held_out_prompts(config)
    coef = torch.tensor(fitted["coef"], dtype=torch.float64)
    if name == "lookahead": return affine_predict(coef, lookahead_features(tasks, states, fitted["beta"]))
    if name == "theta*":
        with torch.no_grad(): v = theta_star_model(config, alpha=fitted["alpha"], beta=fitted["beta"]).predict(Z, n=config.n)
    elif name == "context mean": v = context_mean_values(tasks, states)
    elif name == "certainty equivalence": v = certainty_equivalence_values(tasks, states)
    else: raise ValueError(f"`name` must be one of 'context mean', 'certainty equivalence', 'theta*', 'lookahead', got {name!r}")
    return affine_predict(coef, v[..., None])


# %% [markdown]
# The constants $(0, 1)$ give the state-blind estimate itself, and an unknown name is refused:

# %%
toy_config = dataclasses.replace(EMERGENCE, eval_tasks=8)
test_close(estimator_values("context mean", dict(coef=[0., 1.]), toy_config), context_mean_values(toy_tasks, toy_states), eps=1e-12)
test_fail(lambda: estimator_values("median", dict(coef=[0., 1.]), toy_config), contains="`name` must be one of")


# %% [markdown]
# `prediction_errors` scores the fitted candidates on *other* models: $1 - R^2$ against each model's output, raw and
# after removing each task's mean (the shape), and each candidate's own MSVE against $v_\pi$. A fit that recovers a
# known estimator, with zero prediction error, is checked in *Implementation and tests*.

# %%
#| export
def prediction_errors(fitted:dict,  # output of `fit_estimators`
                      runs:list,    # (config, model) pairs, other seeds
                     )->dict:       # candidate -> (runs,) relative error, and the same after centring each task
    "How well each fitted candidate predicts the outputs of other trained models: 1 - R^2, raw and centred per task."
    out = {}
    for c, m in runs:
        tasks, _, Z = held_out_prompts(c)
        with torch.no_grad(): v = m.predict(Z, n=c.n)
        w = tasks.d_pi
        centre = lambda x: x - (w * x).sum(-1, keepdim=True)
        for k, f in fitted.items():
            p = estimator_values(k, f, c)
            out.setdefault(k, []).append(1 - weighted_r2(v.flatten(), p.flatten(), w.flatten()))
            out.setdefault(f"{k}, centred", []).append(1 - weighted_r2(centre(v).flatten(), centre(p).flatten(), w.flatten()))
            out.setdefault(f"{k}, MSVE", []).append(msve_of(p, tasks).mean().item())
        out.setdefault("trained, MSVE", []).append(msve_of(v, tasks).mean().item())
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in out.items()}


# %%
#| export
def gap_measures(config:PretrainConfig,  # the run's settings
                 model,                  # its trained model
                )->dict:                 # mean over held-out tasks of each measure
    "MSVE and centred MSVE of the model and of the baselines on a run's held-out tasks, with its final value weights."
    tasks, states, Z = held_out_prompts(config)
    with torch.no_grad(): v = model.predict(Z, n=config.n)
    preds = {"trained": v, "context mean": context_mean_values(tasks, states), "certainty equivalence": certainty_equivalence_values(tasks, states),
             "best constant": (tasks.d_pi * tasks.v_pi).sum(-1, keepdim=True).expand_as(tasks.v_pi)}
    out = {f"msve {k}": msve_of(p, tasks).mean().item() for k, p in preds.items()}
    out.update({f"cmsve {k}": centred_msve(p, tasks).mean().item() for k, p in preds.items()})
    out["value_weights"] = model.value_weights().tolist()
    return out


# %% [markdown]
# Both are derivatives of the model's values with respect to its flattened parameters, so the private <code>_values_fn</code>
# first writes the values as a function of one flat vector: at $n = \infty$ through the population tokens, or with
# given contexts through the model's own forward pass.

# %%
#| export
def _values_fn(model:SoftmaxICTD, tasks:TaskBatch, states:torch.Tensor=None):
    "flat parameters (in `model_params` order) -> (B, s) values of every state: at n = infinity, or with the contexts `states` (B, n+1)."
    p0 = model_params(model)
    keys, shapes = list(p0), [v.shape for v in p0.values()]
    split = lambda flat: {k: q.reshape(sh) for k, q, sh in zip(keys, torch.split(flat, [sh.numel() for sh in shapes]), shapes)}
    if states is None:
        one = TaskBatch(*(getattr(tasks, k)[None] for k in ("P", "r", "phi", "d_pi", "v_pi")), tasks.gamma)
        return lambda flat: token_predict(split(flat), model.n_layers, population_tokens(one))[0]
    n, rows = states.shape[-1] - 1, torch.arange(len(tasks))[:, None]
    Z = build_prompt(tasks.phi[rows, states], tasks.r[rows, states[:, :-1]], tasks.phi)
    named = lambda flat: {f"layers.{l}.{k}": v[0, l] for k, v in split(flat).items() for l in range(v.shape[1])}
    return lambda flat: functional_call(model, named(flat), (Z,), dict(n=n))[..., model.d + 1, n + 1:]


# %%
#| export
def update_jacobian(model:SoftmaxICTD,  # the parameters at which to linearise
                    tasks:TaskBatch,    # tasks to average over
                    states:torch.Tensor=None, # (B, n+1) one context per task; None: n = infinity
                   )->tuple:            # (g (p,), J (p, p)) over the flattened (A, V_cur, V_tgt) of every layer
    "The expected semi-gradient TD update and its Jacobian: exactly at $n = \\infty$, or at given contexts (exact over the query and its successor)."
    flat = torch.cat([v.flatten() for v in model_params(model).values()]).double()
    values = _values_fn(model, tasks, states)
    w, s = tasks.d_pi / len(tasks), tasks.r.shape[-1]
    with sdpa_kernel(SDPBackend.MATH):                                                 # the unfused attention has second derivatives
        v = values(flat).detach()
        delta = tasks.r + tasks.gamma * (tasks.P @ v[..., None])[..., 0] - v
        g = torch.func.grad(lambda f: (w * delta * values(f)).sum())
        Jv = torch.func.jacfwd(values)(flat).reshape(-1, len(flat))                    # (B s, p)
        A = torch.block_diag(*(w[..., None] * (tasks.gamma * tasks.P - torch.eye(s, dtype=tasks.P.dtype))))
        return g(flat).detach(), (Jv.T @ A @ Jv + torch.func.jacfwd(g)(flat)).detach()


# %% [markdown]
# At $n = 30$ the expectation over contexts has no closed form. `sampled_jacobians` draws independent batches of
# stationary contexts and computes each batch's exact $(G, J_G)$ over the query and its successor, so that the spread
# between batches gives an error bar.

# %%
#| export
def sampled_jacobians(model:SoftmaxICTD,  # the parameters at which to linearise
                      tasks:TaskBatch,    # tasks to draw from
                      n:int,              # context length
                      n_batches:int=8,    # independent batches K (>= 3)
                      batch_size:int=32,  # tasks (one stationary context each) per batch
                      seed:int=0,         # seed of the batches
                     )->tuple:            # (g (K, p), J (K, p, p)), one per batch
    "Monte-Carlo draws of the expected update and its Jacobian at context length `n`: each batch's mean over its contexts."
    if int(n_batches) != n_batches or n_batches < 3: raise ValueError(f"`n_batches` must be an integer >= 3, got {n_batches}")
    gen = torch.Generator().manual_seed(int(seed))
    out = []
    for _ in range(int(n_batches)):
        idx = torch.randint(len(tasks), (int(batch_size),), generator=gen)
        sub = TaskBatch(tasks.P[idx], tasks.r[idx], tasks.phi[idx], tasks.d_pi[idx], tasks.v_pi[idx], tasks.gamma)
        out.append(update_jacobian(model, sub, sample_trajectories(sub.P, n, sub.d_pi, seed=gen)))
    return torch.stack([g for g, _ in out]), torch.stack([J for _, J in out])


# %% [markdown]
# Fewer than three batches leave no error bar, and are refused:

# %%
test_fail(lambda: sampled_jacobians(toy, toy_tasks, 30, n_batches=2), contains="`n_batches` must be an integer >= 3")


# %% [markdown]
# `jacobian_spectrum` reads stability off the draws: the spectrum of the mean Jacobian, with delete-one jackknife
# standard errors over the batches when there are several.

# %%
#| export
def jacobian_spectrum(gs:torch.Tensor,  # (K, p) draws of g (or (1, p): exact)
                      Js:torch.Tensor,  # (K, p, p) draws of J (or (1, p, p): exact)
                     )->dict:           # NEU, largest real part of an eigenvalue of the mean J, unstable count; jackknife s.e. when K > 1
    "Stability of the mean dynamics at a point from draws of (g, J): the spectrum of the mean Jacobian, with delete-one jackknife errors."
    K = len(gs)
    def stats(g, J, unbiased):
        ev = torch.linalg.eigvals(J.mean(0))
        neu = (g.sum(0).square().sum() - g.square().sum()) / (len(g) * (len(g) - 1)) if unbiased else g.mean(0).square().sum()
        return torch.stack([neu, ev.real.max(), (ev.real > 1e-8).sum().double(), ev.real.min()])
    full = stats(gs, Js, K > 2)
    out = dict(neu=full[0].item(), max_real=full[1].item(), n_unstable=int(full[2]), min_real=full[3].item(), n_params=gs.shape[-1], draws=K)
    if K > 2:
        jk = torch.stack([stats(torch.cat([gs[:i], gs[i + 1:]]), torch.cat([Js[:i], Js[i + 1:]]), K > 3) for i in range(K)])
        se = ((K - 1) / K * (jk - jk.mean(0)).square().sum(0)).sqrt()
        out.update(neu_se=se[0].item(), max_real_se=se[1].item(), n_unstable_se=se[2].item(), min_real_se=se[3].item())
    return out


# %% [markdown]
# On one exact draw with $J = \mathrm{diag}(-1, -2, 0.5)$ and $g = (1, 0, 0)$ the largest real part is $0.5$, with one
# unstable direction and a NEU of 1:

# %%
js = jacobian_spectrum(torch.tensor([[1., 0., 0.]], dtype=torch.float64), torch.diag(torch.tensor([-1., -2., 0.5], dtype=torch.float64))[None])
test_eq((js["n_unstable"], js["n_params"], js["draws"]), (1, 3, 1))
test_close(torch.tensor([js["neu"], js["max_real"], js["min_real"]]), torch.tensor([1., 0.5, -2.]), eps=1e-12)


# %%
#| export
def shared_recursion(model:SoftmaxICTD,  # a model with one shared layer
                     tasks:TaskBatch,    # tasks
                     depth:int,          # iterations K
                    )->torch.Tensor:     # (K+1, B, s) the predicted values after 0..K iterations
    "Chapter 5's recursion with the learned layer's depth-1 population kernel and its value-row weights: v <- v + M (a + (cI + bP) v)."
    if not model.shared: raise ValueError("`model` must have one shared layer")
    lay, d = model.layer(0), model.d
    M = learned_kernel(model, tasks)[0]                                                          # (B, s, s), depth 1
    cur, tgt = lay.V_cur.detach().double()[d + 1], lay.V_tgt.detach().double()[d + 1]
    own = tasks.phi @ cur[:d] + cur[d] * tasks.r                                                # (B, s)
    nxt = tasks.phi @ tgt[:d] + tgt[d] * tasks.r
    a = own + (tasks.P @ nxt[..., None])[..., 0]
    v, out = torch.zeros_like(a), [torch.zeros_like(a)]
    for _ in range(int(depth)):
        v = v + (M @ (a + cur[d + 1] * v + tgt[d + 1] * (tasks.P @ v[..., None])[..., 0])[..., None])[..., 0]
        out.append(v)
    return torch.stack(out)


# %% [markdown]
# A check: for $\theta^*$ with one shared layer the layer writes only the value row, with
# $(a_r, a_{v'}, a_v) = \alpha(1, \gamma, -1)$ (reward, successor and current weights), so the recursion is chapter 5's `td_recursion` with the
# population kernel, and the iterated model at $n = \infty$ follows it exactly.

# %%
_shared_star = SoftmaxICTD.from_theta_star(4, 1, 2. * torch.eye(4, dtype=torch.float64), 0.7, 0.9, shared=True)
_st = random_tasks(3, seed=11)
_rec = shared_recursion(_shared_star, _st, 6)
test_close(_rec, td_recursion(learned_kernel(_shared_star, _st)[0], _st.P, _st.r, gamma=0.9, alpha=0.7, n_iters=6).movedim(-2, 0), eps=1e-12)
_m6 = get_family("softmax").module(dataclasses.replace(EMERGENCE, n_layers=6, shared=True), {k: v[0] for k, v in model_params(_shared_star).items()})
test_close(population_predict(_m6, _st), _rec[6], eps=1e-12)


# %% [markdown]
# `iterate_shared` runs a trained shared layer $K$ times for each depth asked, and measures the held-out MSVE at the
# training context and at $n = \infty$ beside the recursion's prediction: the measurement of the result below.

# %%
#| export
def iterate_shared(config:PretrainConfig,  # the run's settings (shared=True)
                   model:SoftmaxICTD,      # its trained model
                   depths,                 # the depths K to measure
                  )->dict:                 # per depth: held-out MSVE at n = config.n, at n = infinity, and of the recursion's prediction
    "The learned shared layer iterated K times: measured MSVE at the training context and at n = infinity, and chapter 5's prediction."
    tasks, _, Z = held_out_prompts(config)
    params = {k: v[0].double() for k, v in model_params(model).items()}
    pred = shared_recursion(model, tasks, max(depths))
    out = dict(depth=list(depths), msve_n=[], msve_inf=[], msve_predicted=[msve_of(pred[K], tasks).mean().item() for K in depths])
    for K in depths:
        m = get_family(config.attention).module(dataclasses.replace(config, n_layers=K), params)
        with torch.no_grad():
            out["msve_n"].append(msve_of(m.predict(Z, n=config.n), tasks).mean().item())
            out["msve_inf"].append(msve_of(population_predict(m, tasks), tasks).mean().item())
    return out


# %% [markdown]
# ## Implementation and tests
#
# The probes, the estimator, the Jacobian and the shared-layer recursion above are exported to `ictd.mechanism`.
# The functions that save and load runs, build this page's tables, compute its statistics and apply the stopping rule,
# and the drivers that trained every saved file, are in `ictd.experiments.mechanism`, documented and tested in
# [appendix D](mechanism_studies.html). What follows are the API entries of the probes and their unit tests: input
# checks, a fit that recovers a known estimator, and the Jacobian against finite differences.

# %%
test_fail(lambda: centred_msve(ct.v_pi[:, :3], ct), contains="`v_hat` must have shape")
test_fail(lambda: knockout(toy, 3, "uniform"), contains="`layer` must lie in [0, 3)")

# %%
show_doc(write_constancy)

# %%
show_doc(kernel_condition)


# %% [markdown]
# A check: fitted to a model that *is* the lookahead's own form, the fit recovers it. Here the
# "model" is replaced by the lookahead values themselves, and the relative prediction error on
# other tasks is zero.

# %%
class _Lookahead(torch.nn.Module):
    "A stand-in model whose outputs are lookahead values with given constants."
    def __init__(self, config, coef, beta): super().__init__(); self.config, self.coef, self.beta = config, coef, beta
    def predict(self, Z, n=None):
        tasks, states, _ = held_out_prompts(self.config)
        return affine_predict(self.coef, lookahead_features(tasks, states, self.beta))
small = dataclasses.replace(EMERGENCE, eval_tasks=16)
fake = [(dataclasses.replace(small, seed=k), _Lookahead(dataclasses.replace(small, seed=k), torch.tensor([0.1, 5., 1., 0.5], dtype=torch.float64), 4.)) for k in range(3)]
fitted_fake = fit_estimators(fake[:2])
test_eq(fitted_fake["lookahead"]["beta"], 4.)
test_close(torch.tensor(fitted_fake["lookahead"]["coef"], dtype=torch.float64), torch.tensor([0.1, 5., 1., 0.5], dtype=torch.float64), eps=1e-9)
test_close(prediction_errors(fitted_fake, fake[2:])["lookahead, centred"], torch.zeros(1, dtype=torch.float64), eps=1e-12)

# %%
show_doc(update_jacobian)

# %% [markdown]
# A check against central differences of $G$ itself, and $\|G\|^2$ against `population_neu`:

# %%
jt = random_tasks(2, seed=2, d=2)
jm = SoftmaxICTD(2, 2, init_gain=0.5, seed=6)
g0, J0 = update_jacobian(jm, jt)
test_close(g0.square().sum(), torch.tensor(population_neu(jm, jt), dtype=torch.float64), eps=1e-12)
def _with_flat(model, flat):
    "A copy of `model` carrying the flattened parameters `flat`, in `update_jacobian`'s order."
    m, p0 = copy.deepcopy(model), model_params(model)
    parts = dict(zip(p0, torch.split(flat, [v.numel() for v in p0.values()])))
    with torch.no_grad():
        for l, lay in enumerate(m.layers):
            for k, q in parts.items(): getattr(lay, k).copy_(q.reshape(p0[k].shape)[0, l])
    return m
flat0 = torch.cat([v.flatten() for v in model_params(jm).values()])
for j in (20, 77):
    e = torch.zeros_like(flat0); e[j] = 1e-6
    fd = (update_jacobian(_with_flat(jm, flat0 + e), jt)[0] - update_jacobian(_with_flat(jm, flat0 - e), jt)[0]) / 2e-6
    test_close(J0[:, j], fd, eps=1e-6)


# %% [markdown]
# ## Implementation: the contest
#
# The contest's candidates, their grids, the sums from which fits and scores follow, and the fitted winner
# `fit_learned_algorithm`. Each candidate is $\hat v(x) = \lambda\, \bar R/(1-\gamma) + \sigma\, u_\theta(x)$: a
# level coefficient $\lambda$ on the context-mean value, a scale $\sigma$ and one point $\theta$ of its grid.

# %%
#| export
def _context(tasks, states):
    "Rewards R_1..R_n and the features of S_0..S_n of each task's context."
    rows = torch.arange(len(tasks))[:, None]
    return tasks.r[rows, states[:, :-1]], tasks.phi[rows, states]

def _td_candidate(tasks, states, k_max, beta):
    "(k_max, B, s): iterates 1..k_max of weighted softmax TD (alpha = 1, W = beta I) at every state."
    R, phi = _context(tasks, states)
    W = beta * torch.eye(phi.shape[-1], dtype=phi.dtype)
    v = weighted_softmax_td(phi, R, W, 1., tasks.gamma, k_max, phi_queries=tasks.phi, return_all=True)
    return v[:, 1:, -tasks.r.shape[-1]:].movedim(1, 0)

def _lookahead_candidate(tasks, states, beta, c):
    "The smoothed reward plus c times the smoothed next reward."
    f = lookahead_features(tasks, states, beta)
    return f[..., 1] + c * f[..., 2]

def _smoothed_ce(tasks, states, gamma, eps):
    "Certainty equivalence of the context with eps pseudo-counts spread over the states (rows of states never left: uniform), discount `gamma`."
    R, _ = _context(tasks, states)
    B, s = tasks.r.shape
    S0, S1 = states[:, :-1], states[:, 1:]
    C = torch.zeros(B, s, s, dtype=torch.float64)
    C.index_put_((torch.arange(B)[:, None].expand_as(S0), S0, S1), torch.ones_like(S0, dtype=torch.float64), accumulate=True)
    N = C.sum(-1)
    P_hat = (C + eps / s) / (N + eps)[..., None]
    P_hat = torch.where((N == 0)[..., None], torch.full_like(P_hat, 1 / s), P_hat)
    rsum = torch.zeros(B, s, dtype=torch.float64).scatter_add_(1, S0, R)
    r_hat = torch.where(N > 0, rsum / N.clamp(min=1), R.mean(-1, keepdim=True).expand(B, s))
    return torch.linalg.solve(torch.eye(s, dtype=torch.float64) - gamma * P_hat, r_hat[..., None])[..., 0]

def bayes_values(tasks:TaskBatch,      # Boyan-chain tasks
                 states:torch.Tensor,  # (B, n+1) one context per task
                 gammas=(0.9,),        # discounts at which to evaluate the posterior mean value
                 temper:float=1.,      # power of the likelihood (1: the posterior itself)
                 n_samples:int=128,    # Monte-Carlo draws of the transition matrix per task
                 seed:int=0,           # seed of the draws
                )->torch.Tensor:       # (len(gammas), B, s) posterior mean of (I - gamma P)^{-1} r given the context
    "The posterior mean of the value under the random Boyan chain prior, given one context and the state labels (Monte Carlo)."
    if n_samples < 1: raise ValueError(f"`n_samples` must be a positive integer, got {n_samples}")
    if temper <= 0: raise ValueError(f"`temper` must be positive, got {temper}")
    B, s = tasks.r.shape
    S0, S1 = states[:, :-1], states[:, 1:]
    C = torch.zeros(B, s, s, dtype=torch.float64)
    C.index_put_((torch.arange(B)[:, None].expand_as(S0), S0, S1), torch.ones_like(S0, dtype=torch.float64), accumulate=True)
    rng = np.random.default_rng(np.random.SeedSequence(seed))
    idx = torch.arange(s - 2)
    a, b = (temper * C[:, idx, idx + 1]).numpy(), (temper * C[:, idx, idx + 2]).numpy()     # (B, s-2) counts of i -> i+1 and i -> i+2
    p = rng.beta(a + 1, b + 1, size=(n_samples, B, s - 2))
    while (bad := (p < 0.01) | (p > 0.99)).any(): p[bad] = rng.beta((a + 1 + 0 * p)[bad], (b + 1 + 0 * p)[bad])   # the prior's truncation to [0.01, 0.99]
    p = torch.from_numpy(p)
    P = torch.zeros(n_samples, B, s, s, dtype=torch.float64)
    P[..., idx, idx + 1], P[..., idx, idx + 2], P[..., s - 2, s - 1] = p, 1 - p, 1.
    u = torch.from_numpy(rng.uniform(0.01, 0.99, size=(32 * n_samples, B, s)))
    last = u / u.sum(-1, keepdim=True)                                                      # the last row: 32 prior draws per sample, resampled by its likelihood
    pick = torch.multinomial(torch.softmax(temper * (C[:, s - 1] * last.log()).sum(-1), 0).T, n_samples, replacement=True,
                             generator=torch.Generator().manual_seed(int(rng.integers(2**62))))
    P[..., s - 1, :] = last[pick.T, torch.arange(B)]
    I = torch.eye(s, dtype=torch.float64)
    d = torch.linalg.solve((I - P + 1.).mT, torch.ones(n_samples, B, s, 1, dtype=torch.float64))[..., 0].clamp(min=1e-300)   # d^T (I - P + 1 1^T) = 1^T
    w = torch.softmax(temper * d.gather(-1, states[None, :, :1].expand(n_samples, B, 1))[..., 0].log(), 0)   # (M, B) importance weights of S_0
    seen = torch.zeros(B, s, dtype=torch.bool).scatter_(1, S0, True)
    r_hat = torch.where(seen, tasks.r, torch.zeros_like(tasks.r))                           # the prior mean 0 for rewards never seen
    return torch.stack([(w[..., None] * torch.linalg.solve(I - g * P, r_hat.expand(n_samples, B, s)[..., None])[..., 0]).sum(0) for g in gammas])


# %%
#| export
GAMMA_FACTORS = (0.2, 0.35, 0.5, 0.6, 0.7, 0.8, 0.9, 1.)   # effective discounts gamma' = factor * gamma (at most 0.995) tried by the candidates that take one
CONTEST_GRIDS = dict(                               # candidate -> its grid of kernel/step parameters (the fitted constants besides level and scale)
    td=dict(k=(1, 2, 3, 4, 5, 6, 8, 10), beta=(0.5, 1., 2., 4., 8.)),
    lookahead=dict(beta=(1., 2., 4., 8., 12.), c=(0., 0.25, 0.5, 0.75, 1., 1.25, 1.5, 2.)),
    ce=dict(gamma_factor=GAMMA_FACTORS, eps=(0.01, 0.1, 0.3, 1., 3.)),
    bayes=dict(gamma_factor=GAMMA_FACTORS, temper=(1., 2., 4.)),
    v_pi=dict(gamma_factor=GAMMA_FACTORS))
CONTEST_NAMES = dict(td="level + k TD iterates", lookahead="level + lookahead", ce="level + certainty equivalence",
                     bayes="level + Bayes posterior mean", v_pi="level + scaled v_pi")   # how the page names them

def _discount(config, f): return min(f * config.gamma, 0.995)

def grid_thetas(name:str)->list:
    "The points of a candidate's grid, in the order `candidate_grid` computes them."
    if name not in CONTEST_GRIDS: raise ValueError(f"`name` must be one of {', '.join(map(repr, CONTEST_GRIDS))}, got {name!r}")
    g = CONTEST_GRIDS[name]
    outer, inner = dict(td=("beta", "k"), lookahead=("beta", "c"), ce=("gamma_factor", "eps"), bayes=("temper", "gamma_factor"), v_pi=(None, "gamma_factor"))[name]
    return [({outer: a} if outer else {}) | {inner: b} for a in (g[outer] if outer else (None,)) for b in g[inner]]

def candidate_grid(name:str,            # a candidate of `CONTEST_GRIDS`
                   config:PretrainConfig,  # the run's settings (gamma; the seed of the Bayes draws)
                   tasks:TaskBatch,     # the tasks
                   states:torch.Tensor, # (B, n+1) one context per task
                  )->tuple:             # (list of parameter dicts, (G, B, s) the candidate's base values u_theta at every grid point)
    "A candidate's base function $u_\\theta(x)$ at every point $\\theta$ of its grid (before the level and scale are fitted)."
    if name not in CONTEST_GRIDS: raise ValueError(f"`name` must be one of {', '.join(map(repr, CONTEST_GRIDS))}, got {name!r}")
    g, thetas = CONTEST_GRIDS[name], grid_thetas(name)
    if name == "td":
        v = torch.cat([_td_candidate(tasks, states, max(g["k"]), b)[[k - 1 for k in g["k"]]] for b in g["beta"]])
    elif name == "lookahead":
        v = torch.stack([_lookahead_candidate(tasks, states, t["beta"], t["c"]) for t in thetas])
    elif name == "ce":
        v = torch.stack([_smoothed_ce(tasks, states, _discount(config, t["gamma_factor"]), t["eps"]) for t in thetas])
    elif name == "bayes":
        v = torch.cat([bayes_values(tasks, states, [_discount(config, f) for f in g["gamma_factor"]], temper=t, seed=config.seed) for t in g["temper"]])
    else:
        I = torch.eye(tasks.r.shape[-1], dtype=torch.float64)
        v = torch.stack([torch.linalg.solve(I - _discount(config, f) * tasks.P, tasks.r[..., None])[..., 0] for f in g["gamma_factor"]])
    return thetas, v


# %%
#| export
def candidate_values_at(name:str,            # a candidate of `CONTEST_GRIDS`
                        config:PretrainConfig,  # the run's settings (gamma; the seed of the Bayes draws)
                        tasks:TaskBatch,     # the tasks
                        states:torch.Tensor, # (B, n+1) one context per task
                        index:int,           # the grid point, an index into `grid_thetas(name)`
                       )->torch.Tensor:      # (B, s) the base values u_theta at that one grid point
    "A candidate's base function at one point of its grid (what `candidate_grid` computes there, without the rest of the grid)."
    t = grid_thetas(name)[index]
    if name == "td": return _td_candidate(tasks, states, t["k"], t["beta"])[-1]
    if name == "lookahead": return _lookahead_candidate(tasks, states, t["beta"], t["c"])
    if name == "ce": return _smoothed_ce(tasks, states, _discount(config, t["gamma_factor"]), t["eps"])
    if name == "bayes": return bayes_values(tasks, states, [_discount(config, t["gamma_factor"])], temper=t["temper"], seed=config.seed)[0]
    return torch.linalg.solve(torch.eye(tasks.r.shape[-1], dtype=torch.float64) - _discount(config, t["gamma_factor"]) * tasks.P, tasks.r[..., None])[..., 0]


# %%
_tk, _sk, _ = held_out_prompts(dataclasses.replace(EMERGENCE, eval_tasks=4))
for _name in ("td", "lookahead", "ce", "v_pi"):
    _th, _vals = candidate_grid(_name, EMERGENCE, _tk, _sk)
    for _j in (0, len(_th) - 1): test_close(candidate_values_at(_name, EMERGENCE, _tk, _sk, _j), _vals[_j], eps=1e-12)

# %%
#| export
RUN_SUMS = ("Syy", "Syp", "Spp", "Lmm", "Lmy", "Lmp", "Lpp", "B", "msve")   # per-run sums (S: of d-weighted centred values; L: of task means; y the model, p v_pi, m the level regressor R-bar/(1-gamma))
GRID_SUMS = ("Suu", "Syu", "Sup", "Lmu", "Luu", "Lup")            # per-run, per-grid-point sums (u: the candidate's base values)

def _wmean(x, d): return (d * x).sum(-1)

def contest_stats(config:PretrainConfig,  # the run's settings
                  model,                  # its trained model (anything with `predict(Z, n=)`)
                  names=tuple(CONTEST_GRIDS), # candidates to measure
                 )->dict:                 # run sums, and candidate -> its sums at every grid point
    "The sufficient sums from which every candidate's fit and every score follow, on one run's held-out prompts."
    tasks, states, Z = held_out_prompts(config)
    with torch.no_grad(): y = model.predict(Z, n=config.n)
    d, vp = tasks.d_pi, tasks.v_pi
    cen = lambda v: v - _wmean(v, d)[..., None]
    m = context_mean_values(tasks, states)[:, 0]
    cy, cp, my, mp = cen(y), cen(vp), _wmean(y, d), _wmean(vp, d)
    out = dict(run=dict(Syy=(d * cy * cy).sum().item(), Syp=(d * cy * cp).sum().item(), Spp=(d * cp * cp).sum().item(), Lmm=(m * m).sum().item(),
                        Lmy=(m * my).sum().item(), Lmp=(m * mp).sum().item(), Lpp=(mp * mp).sum().item(), B=len(tasks), msve=msve_of(y, tasks).mean().item()),
               candidates={})
    for name in names:
        _, u = candidate_grid(name, config, tasks, states)
        cu, mu = cen(u), _wmean(u, d)
        out["candidates"][name] = dict(Suu=(d * cu * cu).sum((-2, -1)).tolist(), Syu=(d * cy * cu).sum((-2, -1)).tolist(),
                                       Sup=(d * cu * cp).sum((-2, -1)).tolist(), Lmu=(m * mu).sum(-1).tolist(), Luu=(mu * mu).sum(-1).tolist(),
                                       Lup=(mu * mp).sum(-1).tolist())
    return out


def _sum(stats, idx, name, key):
    "A sum over the runs `idx`: of a run sum (name None) or of a candidate's grid sums."
    if name is None: return sum(stats[i]["run"][key] for i in idx)
    return torch.tensor([stats[i]["candidates"][name][key] for i in idx], dtype=torch.float64).sum(0)

def fit_candidate(stats:list,   # `contest_stats` of the runs to fit on
                  name:str,     # the candidate
                 )->dict:       # theta (its grid point), level and scale
    "Fit a candidate to the models' outputs: its scale on the centred values, its level coefficient on the task means, its grid point by the centred residual."
    idx = range(len(stats))
    Suu, Syu = _sum(stats, idx, name, "Suu"), _sum(stats, idx, name, "Syu")
    scale = Syu / Suu.clamp(min=1e-300)
    resid = _sum(stats, idx, None, "Syy") - Syu * scale
    j = int(resid.argmin())
    level = (_sum(stats, idx, None, "Lmy") - scale[j] * _sum(stats, idx, name, "Lmu")[j]) / _sum(stats, idx, None, "Lmm")
    return dict(theta=grid_thetas(name)[j], index=j, level=float(level), scale=float(scale[j]))

def score_candidate(st:dict,      # `contest_stats` of one run (not among those fitted on)
                    name:str,     # the candidate
                    fitted:dict,  # its `fit_candidate`
                   )->dict:       # the run's scores
    "Residual ratio, residual correlation, centred 1 - R^2 and MSVE of a fitted candidate on one run."
    r, c, j, s, l = st["run"], st["candidates"][name], fitted["index"], fitted["scale"], fitted["level"]
    Suu, Syu, Sup, Lmu, Luu, Lup = (c[k][j] for k in GRID_SUMS)
    resid = r["Syy"] - 2 * s * Syu + s * s * Suu                       # sum d (c_model - c_cand)^2
    err_m = r["Syy"] - 2 * r["Syp"] + r["Spp"]                           # sum d (c_model - c_pi)^2
    err_c = s * s * Suu - 2 * s * Sup + r["Spp"]                         # sum d (c_cand - c_pi)^2
    cross = s * Syu - r["Syp"] - s * Sup + r["Spp"]                      # sum d (c_model - c_pi)(c_cand - c_pi)
    level_err = l * l * r["Lmm"] + s * s * Luu + r["Lpp"] + 2 * l * s * Lmu - 2 * l * r["Lmp"] - 2 * s * Lup
    return dict(ratio=resid / err_m, correlation=cross / math.sqrt(err_m * err_c), centred_1mr2=resid / r["Syy"], msve=(err_c + level_err) / r["B"])

CONTEST_SCORES = ("ratio", "correlation", "centred_1mr2", "msve")   # the primary score first

def contest_table(stats:list,        # `contest_stats` of the runs of one cell
                  fit_on:list=None,  # indices of the runs to fit on (None: leave one out, each run scored with the others' fit)
                  score_on:list=None,# indices of the runs to score (default: all not fitted on)
                 )->dict:            # candidate -> dict(fits, scores: name -> (runs,) tensor)
    "Fit every candidate on some runs of a cell and score it on the others (or leave one out)."
    out = {}
    for name in stats[0]["candidates"]:
        if fit_on is None:
            fits = [fit_candidate([s for j, s in enumerate(stats) if j != i], name) for i in range(len(stats))]
            sc = [score_candidate(stats[i], name, f) for i, f in enumerate(fits)]
        else:
            score_on = [i for i in range(len(stats)) if i not in fit_on] if score_on is None else score_on
            fits = [fit_candidate([stats[i] for i in fit_on], name)]
            sc = [score_candidate(stats[i], name, fits[0]) for i in score_on]
        out[name] = dict(fits=fits, scores={k: torch.tensor([x[k] for x in sc], dtype=torch.float64) for k in CONTEST_SCORES})
    return out


# %%
#| export
@dataclasses.dataclass
class LearnedAlgorithm:
    "The algorithm a set of trained models is found to run: a level plus k iterates of weighted softmax TD, $\\hat v = \\lambda \\bar R/(1-\\gamma) + \\sigma\\, v_k$."
    k:int          # number of TD iterates (from v_0 = 0)
    beta:float     # kernel scale: scores beta phi(x)^T phi(S_j)
    level:float    # level coefficient lambda on the context-mean value R-bar / (1 - gamma)
    scale:float    # scale sigma of the iterates
    alpha:float=1. # TD step size (fixed at 1: the scale absorbs a common factor)

    def values(self, config:PretrainConfig,  # settings of the prompts (checked against the tasks)
               tasks:TaskBatch,              # the tasks
               states:torch.Tensor,          # (B, n+1) one context per task
              )->torch.Tensor:               # (B, s) the predicted output of a trained model at every state
        "The predicted output of a model trained like the fitted ones, at every state of each task, from its context."
        if not isinstance(tasks, TaskBatch): raise TypeError(f"`tasks` must be a TaskBatch, got {type(tasks).__name__}")
        if not isinstance(states, torch.Tensor) or states.ndim != 2 or states.shape[0] != len(tasks):
            raise ValueError(f"`states` must be a (B, n+1) tensor with B = {len(tasks)}, got {getattr(states, 'shape', type(states).__name__)}")
        if tasks.phi.shape[-1] != config.feature_dim: raise ValueError(f"`config` has {config.feature_dim} features but `tasks` have {tasks.phi.shape[-1]}")
        R, phi = _context(tasks, states)
        v = weighted_softmax_td(phi, R, self.beta * torch.eye(phi.shape[-1], dtype=phi.dtype), self.alpha, tasks.gamma, self.k, phi_queries=tasks.phi)
        return self.level * context_mean_values(tasks, states) + self.scale * v[:, -tasks.r.shape[-1]:]

def fit_learned_algorithm(results:list,      # `PretrainResult`s (or (config, model) pairs) of one configuration
                          eval_tasks:int=128,# held-out tasks per run to fit on
                         )->LearnedAlgorithm:
    "Fit the contest's winner, level + k TD iterates, to the outputs of trained models, as chapter 6b fits it."
    pairs = [(r.config, r.model) if hasattr(r, "config") else tuple(r) for r in results]
    if not pairs: raise ValueError("`results` must hold at least one trained run")
    base = {k: v for k, v in dataclasses.asdict(pairs[0][0]).items() if k != "seed"}
    if any({k: v for k, v in dataclasses.asdict(c).items() if k != "seed"} != base for c, _ in pairs):
        raise ValueError("`results` must come from one configuration (they may differ only in the seed)")
    f = fit_candidate([contest_stats(dataclasses.replace(c, eval_tasks=eval_tasks), m, ("td",)) for c, m in pairs], "td")
    return LearnedAlgorithm(k=f["theta"]["k"], beta=f["theta"]["beta"], level=f["level"], scale=f["scale"])


# %%
#| hide
import nbdev; nbdev.nbdev_export()
