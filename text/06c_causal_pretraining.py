# %%
#| default_exp experiments.causal_pretraining

# %%
#| export
from __future__ import annotations
import dataclasses
import torch
from ictd.boyan import weighted_error
from ictd.engine import PretrainConfig, held_out_tasks, tuning_config
from ictd.causal import CausalSoftmaxICTD, build_causal_prompt

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *

# %%
#| hide
import dataclasses, json, time
import matplotlib.pyplot as plt
import numpy as np
from pathlib import Path
from IPython.display import Markdown
from ictd.core import DRAW_NOTE, OKABE_ITO, plain_log_ticks, provenance, record_claim
from ictd.engine import EMERGENCE
from ictd.emergence import mean_se, min_successes

# %%
#| hide
from ictd.core import folded_api   # the folded API entries of appendix A

# %%
#| hide
torch.set_num_threads(1)

# %% [markdown]
# # Decoders under pretraining
# > What multi-task TD pretraining finds when the model is the causal softmax Transformer of chapter 4a: its value error against the non-causal model's, its value weights, its kernel and its positional bias, over 20 seeds.

# %% [markdown]
# ::: {.callout-note}
# ## What this page shows
# The decoder of [chapter 4a](causal.html) plugs into the training engine of [chapter 6](pretrain.html) as a model family. Trained like chapter 6a's models on the same 20 seeds, it learns the TD sign pattern and a positive positional bias in its upper layers, at a held-out error a little above the non-causal model's; certainty equivalence beats both at three layers. Everything on this page is the project's own experiment.
# :::

# %% [markdown]
# ## Pretraining a decoder
#
# **Question.** What does multi-task TD pretraining find when the model is a decoder: does the
# mask change the value error, the TD sign pattern of the value weights, the kernel's diagonality,
# and does the model learn a positional bias of the sign chapter 4a's fix uses?
#
# **Setup.** The decoder plugs into the training engine of [chapter 6](pretrain.html)
# (`pretrain_many` trains every seed in one batched pass) as a model family: its parameters are
# stacked with a seed axis, its prompts are causal prompts, and its metrics are the value weights,
# positional bias and diagonality of every layer (the plug-in is in
# [chapter 4a's Implementation and tests](causal.html#the-decoder-as-a-model-family-of-the-engine)). The run trains the decoder and the
# non-causal model of chapter 6 with the same configuration, the one chapter 6a's emergence study uses
# (`EMERGENCE` in `ictd.pretrain`: $d = 4$ random features, $n = 30$, $L = 3$, Adam with learning rate
# $10^{-2}$, 2000 steps), on the same 20 seeds, and measures both on each seed's held-out tasks beside the
# baselines of [chapter 6a](emergence.html) and the decoder construction of chapter 4a
# (`current="self"`, tuned over $\alpha$, $\beta$ and $\lambda$ at the same depth on tuning tasks). On one shared
# CPU thread this takes longer than the book's budget, so the run's numbers were saved to
# `nbs/data/causal_pretrain.json`, with the command, the commit and the date, and the chapter reads
# them back (the command is in [Implementation and tests](#the-saved-pretraining-run)).

# %%
pre = (json.loads(next(p
                       for p in (Path("data/causal_pretrain.json"),
                                 Path("nbs/data/causal_pretrain.json")) if p.exists()).read_text()))
prov, seeds_pre = pre["provenance"], pre["per_seed"]
n_pre = len(seeds_pre)
test_eq(n_pre, 20)
Markdown(f"Read `nbs/data/causal_pretrain.json`: {len(seeds_pre)} seeds "
         f"({pre['seeds'][0]}..{pre['seeds'][-1]}), {pre['config']['n_steps']} steps, "
         f"learning rate {pre['config']['lr']:g}, made by commit `{prov['commit'][:10]}` on "
         f"{prov['date']} in {prov['wall_s'] / 60:.0f} minutes "
         f"on one thread (a shared machine), with {prov['command']}"
         + (f"; {prov['note']}." if "note" in prov else ".")
         + (f" It was made on {prov['cpu']} with torch {prov['torch']}. "
            if not prov["cpu"].startswith("not recorded")
            else f" Its CPU was not recorded (torch {prov['torch']}). ") + DRAW_NOTE)


# %% [markdown]
# **Result: value error.** The trained decoder, the trained non-causal model, the decoder construction
# tuned at the same depth, and the baselines of [chapter 6a](emergence.html), each on every seed's
# held-out tasks (mean over the 256 tasks of a seed; mean ± standard error over the seeds).
# The best constant is an oracle: the single number per task that minimises its MSVE, computed from
# the true values, shown for scale; the other baselines see only the context.

# %%
#| code-fold: true
def per_seed(key, sub=None):
    "One number per seed from the summary."
    return torch.tensor([s[key][sub] if sub
                         else (s[key][-1] if isinstance(s[key], list) else s[key])
                         for s in seeds_pre], dtype=torch.float64)

msve_rows = {"trained decoder (causal mask)": per_seed("msve_causal"),
             "trained non-causal model": per_seed("msve_softmax"),
             "decoder construction (self-anchored, tuned)": per_seed("msve_decoder_construction"),
             **{k: per_seed("baselines", k) for k in seeds_pre[0]["baselines"]}}
shown = {"best constant": "best constant (oracle)",
         "best theta*": "best theta* (tuned, non-causal)"}
Markdown(f"| predictor | MSVE, mean ± s.e. over {n_pre} seeds | range |\n|---|---|---|\n" +
         "\n".join(f"| {shown.get(k, k)} | {v.mean():.3f} ± {mean_se(v)[1]:.3f} | {v.min():.3f} – "
                   f"{v.max():.3f} |" for k, v in msve_rows.items()))

# %%
#| echo: false
gap = msve_rows["trained decoder (causal mask)"] - msve_rows["trained non-causal model"]
wins = int((gap < 0).sum())
ratio = (msve_rows["trained decoder (causal mask)"].mean() / msve_rows["trained non-causal model"].mean())
Markdown(f"The decoder's MSVE minus the non-causal model's, per seed: mean {gap.mean():+.3f} ± "
         f"{mean_se(gap)[1]:.3f} "
         f"({gap.mean() / mean_se(gap)[1]:.1f} standard errors; the decoder's mean error is "
         f"{ratio:.2f} times the non-causal model's); "
         f"the decoder is better in {wins} of {n_pre} seeds. Against the context-mean predictor "
         f"the decoder is better in "
         f"{int((msve_rows['trained decoder (causal mask)'] < msve_rows['context mean']).sum())} "
         f"of {n_pre} seeds. On the first ten seeds alone the gap is "
         f"{gap[:10].mean():+.3f} ± {mean_se(gap[:10])[1]:.3f} "
         f"({gap[:10].mean() / mean_se(gap[:10])[1]:.1f} standard errors).")

# %% [markdown]
# **Result: value weights.** For the decoder, the value row of each layer has four entries that the TD
# construction uses: the reward (in the token), the successor value (in the token), the current
# value in the previous token (where $\theta^*$ under the mask puts $-\alpha$) and the column's own value
# through $U$ (where the self-anchored construction puts $-\alpha$). The non-causal model has the
# three of [chapter 6](pretrain.html).

# %%
#| code-fold: true
wc = torch.tensor([s["weights_causal"] for s in seeds_pre], dtype=torch.float64)     # (seeds, L, 4)
ws = torch.tensor([s["weights_softmax"] for s in seeds_pre], dtype=torch.float64)    # (seeds, L, 3)
fmt = lambda w: ", ".join(f"{m:+.2f} ± {e:.2f}" for m, e in zip(w.mean(0), mean_se(w)[1]))
rows_c, rows_s = [], []
for l in range(wc.shape[1]):
    current_negative = (wc[:, l, 2] < 0) | (wc[:, l, 3] < 0)   # in either slot
    tdc = int(((wc[:, l, 0] > 0) & (wc[:, l, 1] > 0) & current_negative).sum())
    tds = int(((ws[:, l, 0] > 0) & (ws[:, l, 1] > 0) & (ws[:, l, 2] < 0)).sum())
    rows_c.append(f"| {l + 1} | ({fmt(wc[:, l])}) | {tdc} / {n_pre} |")
    rows_s.append(f"| {l + 1} | ({fmt(ws[:, l])}) | {tds} / {n_pre} |")
Markdown("*Decoder*: weights on (reward, successor, current value in the previous token, own value "
         "via $U$)\n\n"
         "| layer | weights, mean ± s.e. | seeds with (+, +, − in either) |\n|---|---|---|\n"
         + "\n".join(rows_c) +
         "\n\n*Non-causal model*: weights on (reward, successor, current value)\n\n"
         "| layer | weights, mean ± s.e. | seeds with (+, +, −) |\n|---|---|---|\n"
         + "\n".join(rows_s))

# %% [markdown]
# **Result: diagonality and positional bias.** The share of each query's attention on keys whose current state is the query's
# state, per layer, at the start and at the end of training.
# The last column is the decoder's learned positional bias $\lambda$ at the end of training.

# %%
#| code-fold: true
# (seeds, evaluations, L)
dc = torch.tensor([s["diagonality_causal"] for s in seeds_pre], dtype=torch.float64)
ds = torch.tensor([s["diagonality_softmax"] for s in seeds_pre], dtype=torch.float64)
rec = torch.tensor([s["recency"] for s in seeds_pre], dtype=torch.float64)
Markdown("| layer | decoder: start → end | non-causal: start → end | decoder's λ "
         "|\n|---|---|---|---|\n" +
         "\n".join(f"| {l + 1} | {dc[:, 0, l].mean():.3f} → {dc[:, -1, l].mean():.3f} ± "
                   f"{mean_se(dc[:, -1, l])[1]:.3f} | "
                   f"{ds[:, 0, l].mean():.3f} → {ds[:, -1, l].mean():.3f} ± "
                   f"{mean_se(ds[:, -1, l])[1]:.3f} | {rec[:, l].mean():+.3f} ± "
                   f"{mean_se(rec[:, l])[1]:.3f} |"
                   for l in range(dc.shape[-1])))

# %%
#| fig-cap: "Figure 6c.1: Under pretraining the decoder's held-out value error falls like the non-causal model's and ends a little above it."
#| fig-alt: "Log-scale held-out value error against training step, 0 to 2000, for the decoder (solid blue) and the non-causal model (dashed orange): means over the seeds with shaded 10 to 90 percent bands; both fall steeply early and flatten, the decoder's curve a little above."
#| code-fold: true
fig, ax = plt.subplots(figsize=(5.8, 3.4))
steps_pre = np.array(seeds_pre[0]["step"])
for name, key, color, ls in (("decoder", "msve_causal", "C0", "-"),
                             ("non-causal", "msve_softmax", "C1", "--")):
    m = torch.tensor([s[key] for s in seeds_pre], dtype=torch.float64)
    ax.plot(steps_pre, m.mean(0), ls, color=color, label=f"{name} (mean of {n_pre} seeds)")
    ax.fill_between(steps_pre, m.quantile(0.1, 0), m.quantile(0.9, 0), color=color, alpha=0.2)
ax.set(yscale="log", xlabel="training step", ylabel="MSVE on held-out tasks",
       title="Value error during pretraining")
plain_log_ticks(ax, "y")
ax.legend(fontsize=9)
fig.tight_layout()

# %%
#| fig-cap: "Figure 6c.2: Under pretraining the last layer's attention becomes more diagonal in both models: a larger share lands on keys that leave the query's own state."
#| fig-alt: "Kernel diagonality of the last layer against training step, 0 to 2000, for the decoder (solid blue) and the non-causal model (dashed orange), means over the seeds; both start near 0.1 and end higher, the decoder's rising most of the way within the first 400 steps, the non-causal model's more slowly, with a shallow dip between 200 and 600 steps."
#| code-fold: true
fig, ax = plt.subplots(figsize=(5.8, 3.4))
for name, d_, color, ls in (("decoder", dc, "C0", "-"), ("non-causal", ds, "C1", "--")):
    ax.plot(steps_pre, d_[..., -1].mean(0), ls, color=color, label=f"{name}, last layer")
ax.set(xlabel="training step", ylabel="attention share on own state",
       title=f"Kernel diagonality (mean of {n_pre} seeds)")
ax.legend(fontsize=9)
fig.tight_layout()

# %% [markdown]
# Figure 6c.1 shows the value error on held-out tasks during pretraining (mean over the seeds, band from
# the 10% to the 90% quantile); Figure 6c.2 the last layer's kernel diagonality.
#
# **What it shows, and the check.** Computed from the tables above:

# %%
#| echo: false
L_last = wc.shape[1] - 1
own_more_negative = int((wc[:, L_last, 3] < wc[:, L_last, 2]).sum())
td_dec = (int(((wc[:, L_last, 0] > 0) & (wc[:, L_last, 1] > 0) & ((wc[:, L_last, 2] < 0) | (wc[:, L_last, 3] < 0))).sum()))
td_soft = int(((ws[:, L_last, 0] > 0) & (ws[:, L_last, 1] > 0) & (ws[:, L_last, 2] < 0)).sum())
rise_dec, rise_soft = dc[:, -1, L_last] - dc[:, 0, L_last], ds[:, -1, L_last] - ds[:, 0, L_last]
Markdown(f"- Sign pattern: in the last layer, {td_dec} of {n_pre} decoders and {td_soft} of "
         f"{n_pre} non-causal models show (+, +, −) "
         f"(for the decoder: reward and successor positive, and a negative weight on the current "
         f"value in either slot).\n"
         f"- Where the decoder puts its current-value weight: the column's own value (through $U$, "
         f"the self-anchored slot of Proposition 4a.3) is the more "
         f"negative of the two slots in {own_more_negative} of {n_pre} seeds; the previous token's "
         f"value (the slot of $\\theta^*$ under the mask) in the other "
         f"{n_pre - own_more_negative}.\n"
         f"- Diagonality of the last layer rises by {rise_dec.mean():+.3f} ± "
         f"{mean_se(rise_dec)[1]:.3f} in the decoder and by {rise_soft.mean():+.3f} ± "
         f"{mean_se(rise_soft)[1]:.3f} "
         f"in the non-causal model.\n"
         f"- The learned positional bias $\\lambda$ is positive (favouring late, well-informed "
         f"transitions, as chapter 4a's fix does) in "
         f"{', '.join(f'{int((rec[:, l] > 0).sum())} of {n_pre} seeds in layer {l + 1}' for l in range(rec.shape[1]))}.\n"
         f"- Value error: the decoder ends at "
         f"{msve_rows['trained decoder (causal mask)'].mean():.3f} ± "
         f"{mean_se(msve_rows['trained decoder (causal mask)'])[1]:.3f}, "
         f"the non-causal model at {msve_rows['trained non-causal model'].mean():.3f} ± "
         f"{mean_se(msve_rows['trained non-causal model'])[1]:.3f}; "
         f"the decoder is better in {wins} of {n_pre} seeds. Mean MSVE over the context-mean "
         f"predictor's: decoder "
         f"{msve_rows['trained decoder (causal mask)'].mean() / msve_rows['context mean'].mean():.2f}, non-causal {msve_rows['trained non-causal model'].mean() / msve_rows['context mean'].mean():.2f}, "
         f"certainty equivalence "
         f"{msve_rows['certainty equivalence'].mean() / msve_rows['context mean'].mean():.2f}, and "
         f"the decoder construction, limited to three layers "
         f"of step at most 1, "
         f"{msve_rows['decoder construction (self-anchored, tuned)'].mean() / msve_rows['context mean'].mean():.2f}.")

# %% [markdown]
# The mask costs the construction much accuracy and the trained model a little: at this budget the
# decoder ends above the non-causal model, by a paired gap of more than two standard errors over the
# seeds (checked below), though not on every seed. The gap is of the size of the spread between seeds,
# so ten seeds resolve it poorly (compare the first ten alone, above); the run has twenty, and the tests
# repeat the comparison on ten seeds the book does not show. What emerges is the same in kind: the TD sign pattern in the last layer of most
# decoders (and of many non-causal models: [chapter 6b](mechanism.html) shows that the layer carrying
# it is not always the last), a kernel that grows more diagonal, and a positional bias of the sign the
# mean-field argument recommends, learned without being asked for. Two baselines put this in its place. Certainty
# equivalence, which solves the context's empirical chain and uses no attention, beats both trained
# models (counted below), so three layers trained for 2000 steps are not yet the best in-context
# estimator on these tasks; and the oracle best constant, which knows the true values, is better
# still, as it is in [chapter 6a](emergence.html). The decoder construction, limited to three layers of
# step at most 1, is far behind both trained models: at this depth the trained weights, not the
# construction, are what a decoder can use.

# %%
ce, dec_m, soft_m = (msve_rows["certainty equivalence"], msve_rows["trained decoder (causal mask)"],
                     msve_rows["trained non-causal model"])
# seeds a one-sided sign test needs to reject a coin flip at the 5% level
k_pre = min_successes(n_pre, 1 / 2)
# the decoder pays for the mask: a paired gap above two standard errors
assert gap.mean() > 2 * mean_se(gap)[1] and wins < n_pre / 2, (gap, wins)
assert (int((ce < dec_m).sum()) >= k_pre and int((ce < soft_m).sum()) >= k_pre
        and int((dec_m < msve_rows["context mean"]).sum()) >= k_pre)
construction = msve_rows["decoder construction (self-anchored, tuned)"]
assert (construction > dec_m).all() and (rec[:, 1:] > 0).all(), (construction, rec)
assert msve_rows["best constant"].mean() < ce.mean()
assert td_dec >= k_pre and td_soft >= 1 and rise_dec.mean() > 0 and rise_soft.mean() > 0
print(f"certainty equivalence beats the decoder on {int((ce < dec_m).sum())} of {n_pre} seeds and "
      f"the non-causal model on {int((ce < soft_m).sum())} of {n_pre}; a sign test needs {k_pre}")

# %%
#| echo: false
_ = record_claim("pretrained-decoder",
                 "Pretrained under a causal mask (chapter 6a's configuration, 20 seeds), the "
                 "decoder's held-out error is a little above the non-causal model's (a paired gap "
                 "of more than two standard errors), it learns a positive positional bias in its "
                 "upper layers, and both are beaten by certainty equivalence.",
             "measured", "causal_pretraining", "#pretraining-a-decoder")


# %% [markdown]
# ## Implementation and tests
#
# The drivers of the saved run, the cell that wrote it, and the API entries.

# %% [markdown]
# ### The saved pretraining run
#
# The drivers that made `nbs/data/causal_pretrain.json`: they tune
# the decoder construction on tuning tasks disjoint from a run's held-out tasks, and train both models
# on every seed through `pretrain_many`.

# %%
#| code-fold: true
#| export
def decoder_values(config:PretrainConfig, tasks, states, alpha:float, beta:float,
                   lam:float)->torch.Tensor:
    ("(B, s) values of the decoder construction at every state of each task, from its context "
     "`states` (B, n + 1).")
    rows, d = torch.arange(len(tasks))[:, None], tasks.phi.shape[-1]
    Z = build_causal_prompt(tasks.phi[rows, states], tasks.r[rows, states[:, :-1]], tasks.phi)
    model = CausalSoftmaxICTD.from_theta_star(d, beta * torch.eye(d, dtype=torch.float64), n_layers=config.n_layers, alpha=alpha, gamma=config.gamma, current="self", recency=lam)
    with torch.no_grad(): return model.predict(Z)


# %%
from ictd.causal import prefix_softmax_td
from ictd.tasks import random_tasks, sample_trajectories

# %%
#| code-fold: true
tasks_r = random_tasks(8, seed=3)                       # chapter 4a's check tasks
S_r = sample_trajectories(tasks_r.P, tasks_r.d_pi, n=20, seed=3)
rows_r = torch.arange(8)[:, None]
phi_r, R_r = tasks_r.phi[rows_r, S_r], tasks_r.r[rows_r, S_r[:, :-1]]
W2 = 2. * torch.eye(4, dtype=torch.float64)
v_dec = decoder_values(PretrainConfig(n=20), tasks_r, S_r, 0.5, 2., 4.)
v_ref = prefix_softmax_td(phi_r, R_r, W2, alpha=0.5, gamma=0.9, n_iters=3, phi_queries=tasks_r.phi,
                          current="self", recency=4.)
test_close(v_dec, v_ref[:, 21:], eps=1e-12)


# %% [markdown]
# `best_decoder` scores each point of a grid by its mean MSVE on the held-out tasks of the run's `tuning` stream
# (disjoint from the tasks the run is measured on):

# %%
#| code-fold: true
#| export
def best_decoder(config:PretrainConfig,                 # the run's settings (depth, gamma)
                 alphas=(0.5, 1.), betas=(0.5, 1., 2., 4.), lams=(0., 4., 9.),  # the grid
                )->tuple:                               # (alpha, beta, lambda) of least MSVE
    "Tune the self-anchored decoder construction on tasks disjoint from a run's held-out tasks."
    tasks, states = held_out_tasks(tuning_config(config))
    msve = lambda g: weighted_error(decoder_values(config, tasks, states, *g), tasks.v_pi,
                                    tasks.d_pi)
    err = {g: msve(g).mean().item()
           for g in ((a, b, l) for a in alphas for b in betas for l in lams)}
    return min(err, key=err.get)


# %% [markdown]
# `causal_pretrain_summary` trains both models on every seed and records, per seed, what the saved file holds:

# %%
#| code-fold: true
#| export
def causal_pretrain_summary(config:PretrainConfig,  # the decoder's settings (`attention="causal"`)
                            seeds,                  # the seeds
                            progress:bool=False,
                            cache_dir=None,         # the engine's run cache (`pretrain_many`)
                           )->dict:                 # plain numbers, ready for JSON
    ("Pretrain the decoder and the non-causal model on `seeds`; per seed: metrics, value "
     "weights, diagonality and baselines.")
    # chapter 6's engine loop and 6a's baselines: imported here, by the driver only
    from ictd.pretrain import pretrain_many
    from ictd.emergence import baseline_msve
    causal = pretrain_many(config, seeds, progress, cache_dir)
    softmax = pretrain_many(dataclasses.replace(config, attention="softmax"), seeds, progress,
                            cache_dir)
    out = dict(config=dataclasses.asdict(config), seeds=list(seeds), per_seed=[])
    for c, s in zip(causal, softmax):
        tasks, states = held_out_tasks(c.config)
        base = {k.split(" (")[0]: v.mean().item() for k, v in baseline_msve(c.config).items()}
        g = best_decoder(c.config)
        v_g = decoder_values(c.config, tasks, states, *g)
        h, hs = c.history, s.history
        out["per_seed"].append(dict(seed=c.config.seed, msve_causal=h["msve"][:, 0].tolist(),
                                    msve_softmax=hs["msve"][:, 0].tolist(),
                                    step=h["step"][:, 0].tolist(),
                                    weights_causal=h["value_weights"][-1].tolist(),
                                    weights_softmax=hs["value_weights"][-1].tolist(),
                                    diagonality_causal=h["diagonality"].tolist(),
                                    diagonality_softmax=hs["diagonality"].tolist(),
                                    recency=h["recency"][-1].tolist(), baselines=base,
                                    best_decoder=list(g),
                                    msve_decoder_construction=weighted_error(
                                        v_g, tasks.v_pi, tasks.d_pi).mean().item()))
    return out


# %%
#| echo: false
folded_api(
    show_doc(decoder_values),
    show_doc(best_decoder),
    show_doc(causal_pretrain_summary),
)

# %% [markdown]
# The cell that wrote the file (not run when the book is built; run from the repository root):

# %%
#| code-fold: true
#| eval: false
t0 = time.time()
# EMERGENCE: the training configuration of chapter 6a (ictd.pretrain), here with a causal mask
summary = causal_pretrain_summary(dataclasses.replace(EMERGENCE, attention="causal"),
                                  list(range(20)))
summary["provenance"] = provenance("the eval: false cell of nbs/06c_causal_pretraining.ipynb, run "
                                   "from the repository root with OMP_NUM_THREADS=1",
                                   wall_s=round(time.time() - t0, 1), threads=1)
json.dump(summary, open("nbs/data/causal_pretrain.json", "w"), indent=1)

# %%
#| hide
show_doc(decoder_values)
show_doc(best_decoder)
show_doc(causal_pretrain_summary)

# %%
#| export
from ictd.boyan import check_arguments
# every public function refuses, naming it, an argument its annotation rules out (chapter 0)
check_arguments(globals())

# %%
#| hide
import nbdev; nbdev.nbdev_export()
