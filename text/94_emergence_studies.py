# %%
#| default_exp experiments.emergence

# %%
#| export
from __future__ import annotations
import dataclasses, json, math, tempfile
from pathlib import Path
import torch
from tqdm.auto import tqdm
from ictd.model import theta_star
from ictd.core import atomic_savefig, atomic_write_text, check_seeds, check_type, load_json, plain_log_ticks, provenance
from ictd.engine import EMERGENCE, PretrainConfig, PretrainResult
from ictd.pretrain import pretrain_many
from ictd.emergence import (UNIFORM_BELOW, baseline_msve, best_theta_star, last_selective_layer, mean_se, min_successes,
                            model_msve, ratio_interval, sign_pattern, stack_history, value_gap)

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *

# %%
#| hide
import dataclasses
import tempfile
import matplotlib.pyplot as plt
from ictd.engine import EMERGENCE

# %% [markdown]
# # Emergence studies
# > The machinery of chapter 6a: summaries of a set of runs over seeds, their tables and figures, the comparison with the baselines, the asserts of the claims, the ablation driver and the report the command line writes.

# %% [markdown]
# [Chapter 6a](emergence.html) asks what multi-task TD pretraining finds across seeds and answers with the
# tools built here; the statistics it rests on (the binomial bar, the baselines, the sign pattern, the
# estimators of NEU) are defined and explained there, in `ictd.emergence`. This page builds the module
# `ictd.experiments.emergence`, which only imports downwards from it, and tests every function on a few
# seconds of training: two seeds of a tiny configuration, far too small to carry a claim, large enough to
# exercise the code.

# %%
tiny = dataclasses.replace(EMERGENCE, n_steps=4, eval_every=2, n_tasks=16, eval_tasks=8, batch_size=8, n=10)
tiny_runs = pretrain_many(tiny, [0, 1], progress=False)


# %% [markdown]
# ## Seed summaries
#
# `seed_summary` condenses a set of runs into plain numbers per layer (the counts of seeds with the sign
# pattern, quartiles of the successor/current ratio, weights and diagonality with standard errors, the
# final MSVE and NEU); `layer_table` prints it with one row per layer.

# %%
#| export
def seed_summary(results:list,  # runs of one configuration, one per seed
                )->dict:        # plain numbers and lists, ready for JSON
    "Distributions over seeds of the final metrics of a set of runs, per layer."
    if len(results) < 2: raise ValueError(f"`results` must hold at least 2 runs, got {len(results)}")
    vw, diag = stack_history(results, "value_weights"), stack_history(results, "diagonality")
    final, ratio = vw[:, -1], vw[:, -1, :, 1] / vw[:, -1, :, 2]
    q = ratio.quantile(torch.tensor([0.25, 0.5, 0.75], dtype=ratio.dtype), dim=0)
    msve, neu_pop = stack_history(results, "msve")[:, -1, 0], stack_history(results, "neu_population")[:, -1, 0]
    cfg = results[0].config
    return dict(config=dataclasses.asdict(cfg), seeds=[r.config.seed for r in results], n_seeds=len(results),
                pattern_count=sign_pattern(final).sum(0).tolist(),
                ratio_median=q[1].tolist(), ratio_q1=q[0].tolist(), ratio_q3=q[2].tolist(),
                weights_mean=final.mean(0).tolist(), weights_se=mean_se(final)[1].tolist(),
                diagonality_start=mean_se(diag[:, 0])[0].tolist(), diagonality_end=diag[:, -1].mean(0).tolist(),
                diagonality_end_se=mean_se(diag[:, -1])[1].tolist(),
                diagonality_rise=diag[:, -1] .sub(diag[:, 0]).mean(0).tolist(), diagonality_rise_se=mean_se(diag[:, -1] - diag[:, 0])[1].tolist(),
                msve=msve.mean().item(), msve_se=mean_se(msve)[1].item(),
                neu_population=neu_pop.mean().item(), neu_population_se=mean_se(neu_pop)[1].item(),
                cosine_mean=stack_history(results, "cosine")[:, -1].mean(0).tolist())


# %%
show_doc(seed_summary)

# %%
tiny_summary = seed_summary(tiny_runs)
test_eq(tiny_summary["n_seeds"], 2)
test_eq(tiny_summary["seeds"], [0, 1])
test_eq(len(tiny_summary["pattern_count"]), tiny.n_layers)
test_fail(lambda: seed_summary(tiny_runs[:1]), contains="at least 2 runs")


# %% [markdown]
# A summary is plain numbers so that it can be written to JSON; for a reader, `layer_table` lays it out
# as two tables narrow enough for the page, one row per layer each:

# %%
#| export
def layer_table(summary:dict)->str:
    "Two narrow markdown tables of a `seed_summary`, one row per layer: the pattern, ratio and diagonality; then the three weights."
    m, pattern, weights = summary["n_seeds"], [], []
    for l, (k, w, se, med, q1, q3, d0, d1, dse) in enumerate(zip(summary["pattern_count"], summary["weights_mean"], summary["weights_se"],
            summary["ratio_median"], summary["ratio_q1"], summary["ratio_q3"], summary["diagonality_start"], summary["diagonality_end"], summary["diagonality_end_se"])):
        k = "— (no gradient)" if l == 0 and not summary["config"]["shared"] else f"{k} / {m}"
        pattern.append(f"| {l + 1} | {k} | {med:+.2f} [{q1:+.2f}, {q3:+.2f}] | {d0:.2f} → {d1:.2f} ± {dse:.2f} |")
        weights.append(f"| {l + 1} | " + " | ".join(f"{a:+.2f} ± {b:.2f}" for a, b in zip(w, se)) + " |")
    return "\n".join(["| layer | seeds with (+, +, −) | successor / current: median [quartiles] | diagonality: start → end |", "|---|---|---|---|"] + pattern
                     + ["", "| layer | reward weight | successor weight | current weight |", "|---|---|---|---|"] + weights)


# %%
test_eq(len(layer_table(tiny_summary).splitlines()), 2 * (2 + tiny.n_layers) + 1)

# %% [markdown]
# ## Figures over training
#
# Each figure carries one message. The value weights are drawn only for the layers that receive a
# gradient (`trained_layers`: the first layer's input has no value row yet, so its successor and current
# weights stay at zero and their ratio is noise); each weight has its own colour and line style, and bands
# are light enough to see through. Log axes are labelled with plain numbers.

# %%
#| export
WEIGHT_STYLES = (("reward", "-"), ("successor value", "--"), ("current value", ":"))  # label and line style of each value weight

def trained_layers(config:PretrainConfig)->list:
    "Indices of the layers whose value weights get a gradient: all but the first, or the one shared layer."
    return [0] if config.shared else list(range(1, config.n_layers))

def _layer_name(config, l): return "shared layer" if config.shared else f"layer {l + 1}"

def _band(ax, x, y, label, **kw):
    "Mean over seeds of `y` (seeds, T) with a band of one standard error."
    m, se = mean_se(y)
    line, = ax.plot(x, m, label=label, **kw)
    ax.fill_between(x, m - se, m + se, color=line.get_color(), alpha=0.2)

def _steps(results): return results[0].history["step"].flatten().numpy()


# %%
test_eq(trained_layers(tiny), [1, 2])
test_eq(trained_layers(dataclasses.replace(tiny, n_layers=8, shared=True)), [0])


# %%
#| export
def value_weight_panels(axs,           # (layers, 2) array of axes
                        results:list,  # runs of one configuration, one per seed
                       ):
    "For every trained layer: its three value weights (mean ± s.e.) and its successor/current ratio (median, quartiles) over training."
    c, steps, vw = results[0].config, _steps(results), stack_history(results, "value_weights")
    for (ax_w, ax_r), l in zip(axs, trained_layers(c)):
        for j, (w, ls) in enumerate(WEIGHT_STYLES): _band(ax_w, steps, vw[:, :, l, j], w, color=f"C{j}", ls=ls)
        ax_w.axhline(0, color="k", lw=0.5)
        ax_w.set(title=f"{_layer_name(c, l)}: value weights", ylabel="weight (mean ± s.e.)", xlabel="training step")
        q = (vw[:, :, l, 1] / vw[:, :, l, 2]).quantile(torch.tensor([0.25, 0.5, 0.75], dtype=vw.dtype), dim=0)
        ax_r.plot(steps, q[1], "o-", ms=3, color="C0", label="median over seeds")
        ax_r.fill_between(steps, q[0], q[2], color="C0", alpha=0.2, label="quartiles")
        ax_r.axhline(-c.gamma, color="k", ls="--", label=r"$-\gamma$")
        ax_r.set(ylim=(-4, 3), title=f"{_layer_name(c, l)}: successor / current", ylabel="ratio", xlabel="training step")
        for ax in (ax_w, ax_r): ax.legend(fontsize=9)


# %% [markdown]
# The panels draw into axes they are given, so that the report's overview below can reuse them on a
# page of its own; `plot_value_weights` makes the figure with one row per trained layer, and the cell
# after it checks that no untrained layer gets a row:

# %%
#| export
def plot_value_weights(results:list,  # runs of one configuration, one per seed
                      ):              # the matplotlib figure
    "The value weights and the successor/current ratio of every trained layer over training, over seeds."
    import matplotlib.pyplot as plt
    n = len(trained_layers(results[0].config))
    fig, axs = plt.subplots(n, 2, figsize=(10, 3.3 * n), squeeze=False, layout="constrained")
    value_weight_panels(axs, results)
    return fig


# %%
fig = plot_value_weights(tiny_runs)
test_eq(len(fig.axes), 2 * len(trained_layers(tiny)))
plt.close(fig)


# %%
#| export
def diagonality_panel(ax,            # the axes to draw on
                      results:list,  # runs of one configuration, one per seed
                     ):
    "Every layer's kernel diagonality over training, mean ± s.e. over seeds."
    c, steps, diag = results[0].config, _steps(results), stack_history(results, "diagonality")
    for l in range(1 if c.shared else diag.shape[2]): _band(ax, steps, diag[:, :, l], _layer_name(c, l), color=f"C{l % 4}", ls=("-", "--", ":", "-.")[l % 4])
    ax.axhline(1 / c.n_states, color="gray", lw=0.8, label=f"uniform (1/s = {1 / c.n_states:g})")
    ax.set(title="Kernel diagonality", ylabel="attention share on own state", xlabel="training step")
    ax.legend(fontsize=9)


# %% [markdown]
# Whether the trained model predicts well is a second message, so the errors get panels of their own:
# the held-out MSVE, and chapter 6a's NEU (the squared norm of the expected update) computed exactly at
# $n = \infty$. Both panels are checked with the diagonality panel in the cell below.

# %%
#| export
def error_panels(axs,           # two axes: MSVE, NEU
                 results:list,  # runs of one configuration, one per seed
                ):
    "The held-out MSVE and the exact NEU at n = infinity over training, mean ± s.e. over seeds."
    steps = _steps(results)
    _band(axs[0], steps, stack_history(results, "msve")[..., 0], "trained model", color="C0")
    axs[0].set(yscale="log", title="MSVE on held-out tasks", ylabel="MSVE", xlabel="training step")
    _band(axs[1], steps, stack_history(results, "neu_population")[..., 0], r"$n = \infty$ (exact)", color="C1", ls="--")
    axs[1].set(yscale="log", title="NEU", ylabel="squared norm of expected update", xlabel="training step")
    for ax in axs: ax.legend(fontsize=9); plain_log_ticks(ax)


# %%
fig, axs = plt.subplots(1, 3, figsize=(12, 3))
diagonality_panel(axs[0], tiny_runs); error_panels(axs[1:], tiny_runs)
test_eq([len(ax.get_lines()) for ax in axs], [tiny.n_layers + 1, 1, 1])
plt.close(fig)


# %% [markdown]
# `plot_seed_bands` puts all of it on one page for the report of the command line: the value-weight rows
# above, the diagonality, MSVE and NEU below, with no empty panel.

# %%
#| export
def plot_seed_bands(results:list,  # runs of one configuration, one per seed
                   ):              # the matplotlib figure
    "The report's overview: value weights and ratios of every trained layer, then diagonality, MSVE and NEU, as bands over seeds."
    import matplotlib.pyplot as plt
    c, n = results[0].config, len(trained_layers(results[0].config))
    fig = plt.figure(figsize=(13, 3.3 * (n + 1)), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=[n, 1])
    value_weight_panels(top.subplots(n, 2, squeeze=False), results)
    axs = bottom.subplots(1, 3)
    diagonality_panel(axs[0], results); error_panels(axs[1:], results)
    fig.suptitle(f"{len(results)} seeds: d = {c.d} {c.features} features, n = {c.n}, L = {c.n_layers}{' shared' if c.shared else ''}, "
                 f"gamma = {c.gamma:g}, lr = {c.lr:g}, {c.n_steps} steps")
    return fig


# %%
fig = plot_seed_bands(tiny_runs)
test_eq(len(fig.axes), 2 * len(trained_layers(tiny)) + 3)
plt.close(fig)


# %% [markdown]
# ## Parameters averaged over seeds
#
# Heat maps of every layer's $A$, $V^{\mathrm{cur}}$ and $V^{\mathrm{tgt}}$, averaged over seeds, with
# $\theta^*$ below them; chapter 6a explains what the average can and cannot show.

# %%
#| export
def mean_blocks(results:list,  # runs of one configuration
               )->torch.Tensor:# (L, 3, d+2, d+2) the seeds' mean A, V_cur, V_tgt per layer
    "The parameters of every layer averaged over seeds."
    return torch.stack([torch.stack([torch.stack([p.detach().double() for p in r.model.layer(l).params(torch.zeros(1, dtype=torch.float64))])
                                     for l in range(r.model.n_layers)]) for r in results]).mean(0)


# %%
test_eq(mean_blocks(tiny_runs).shape, (tiny.n_layers, 3, tiny.d + 2, tiny.d + 2))


# %% [markdown]
# `plot_blocks` draws each averaged block on a colour scale symmetric about zero, so that a sign is a
# colour, with the blocks of $\theta^*$ in the last row for comparison:

# %%
#| export
def plot_blocks(results:list,  # runs of one configuration
               ):              # the matplotlib figure
    "Heat maps of A, V_cur and V_tgt per layer, averaged over seeds, beside those of $\\theta^*$ (W = I, alpha = 1)."
    import matplotlib.pyplot as plt
    c, blocks = results[0].config, mean_blocks(results)
    d = blocks.shape[-1] - 2
    rows = list(blocks[:1] if c.shared else blocks) + [torch.stack(theta_star(d, torch.eye(d, dtype=torch.float64), alpha=1., gamma=c.gamma))]
    names = ["shared layer" if c.shared else f"layer {l + 1}" for l in range(len(rows) - 1)] + [r"$\theta^*$"]
    fig, axs = plt.subplots(len(rows), 3, figsize=(11, 3.2 * len(rows)), squeeze=False, layout="constrained")
    labels = [f"$\\phi_{i}$" for i in range(d)] + ["r", "v"]
    for i, (row, name) in enumerate(zip(rows, names)):
        for j, (M, block) in enumerate(zip(row, ("A", "V_cur", "V_tgt"))):
            lim = M.abs().max().clamp(min=1e-12).item()
            im = axs[i, j].imshow(M.numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim)
            axs[i, j].set(title=f"{name}: ${block.replace('_', '^{') + '}' if '_' in block else block}$", xticks=range(d + 2), yticks=range(d + 2))
            axs[i, j].set_xticklabels(labels, fontsize=9); axs[i, j].set_yticklabels(labels, fontsize=9)
            fig.colorbar(im, ax=axs[i, j], fraction=0.046)
    fig.suptitle(f"Parameters averaged over {len(results)} seeds (rows: token coordinates written; columns: read); "
                 r"$\theta^*$ with $W = I$, $\alpha = 1$")
    return fig


# %%
fig = plot_blocks(tiny_runs)
test_eq(len([ax for ax in fig.axes if ax.images]), 3 * (tiny.n_layers + 1))
plt.close(fig)


# %% [markdown]
# ## Baselines and claims
#
# `baseline_comparison` gives, per seed, the MSVE of the trained model and of every baseline of chapter 6a
# on that seed's held-out tasks, with the tuned $\theta^*$'s step size and kernel scale and the value gap to
# it; `comparison_table` prints only the predictors. `claim_counts` measures what Claims 6a.1 to 6a.4 rest
# on and `emergence_claims` asserts them (it refuses fewer than ten seeds).

# %%
#| export
def baseline_comparison(results:list,  # runs of one configuration
                       )->dict:        # name -> (seeds,) mean MSVE over each seed's held-out tasks
    "MSVE of the trained models and of every baseline, per seed, with the value gap to the tuned $\\theta^*$."
    rows = {}
    for r in results:
        ab = best_theta_star(r.config)
        base = {k.split(" (")[0]: v.mean().item() for k, v in baseline_msve(r.config, ab).items()}
        for k, v in dict(trained=model_msve(r).mean().item(), **base, **{"value gap to best theta*": value_gap(r, alpha=ab[0], beta=ab[1])}).items():
            rows.setdefault(k, []).append(v)
        rows.setdefault("best alpha", []).append(ab[0]); rows.setdefault("best beta", []).append(ab[1])
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in rows.items()}

NOT_PREDICTORS = ("value gap to best theta*", "best alpha", "best beta")  # entries of `baseline_comparison` that are not a predictor's MSVE

# %%
tiny_comparison = baseline_comparison(tiny_runs)
test_eq(set(tiny_comparison) - set(NOT_PREDICTORS), {"trained", "zero", "context mean", "best theta*", "certainty equivalence", "best constant"})
assert all(v.shape == (2,) for v in tiny_comparison.values())


# %% [markdown]
# The tuned step size, kernel scale and value gap are not errors of a predictor, so the table of the
# page leaves them out and lists only the predictors:

# %%
#| export
def comparison_table(comparison:dict)->str:
    "A markdown table of the predictors in `baseline_comparison`: mean ± s.e. and range over seeds."
    rows = [f"| {k} | {v.mean():.3f} ± {mean_se(v)[1]:.3f} | {v.min():.3f} – {v.max():.3f} |" for k, v in comparison.items() if k not in NOT_PREDICTORS]
    return "\n".join(["| predictor | MSVE, mean ± s.e. over seeds | range over seeds |", "|---|---|---|"] + rows)


# %%
test_eq(len(comparison_table(tiny_comparison).splitlines()), 2 + 6)


# %%
#| export
def claim_counts(results:list,     # runs of one configuration
                 comparison:dict,  # `baseline_comparison(results)`
                )->dict:           # the counts the claims of `emergence_claims` rest on
    "The measured counts behind the chapter's claims, without asserting them."
    m = len(results)
    vw, diag = stack_history(results, "value_weights")[:, -1], stack_history(results, "diagonality")
    rise = diag[:, -1, 1:] - diag[:, 0, 1:]
    selective = last_selective_layer(diag[:, -1])
    return dict(n_seeds=m, k_half=min_successes(m, 1 / 2),
                beats_context_mean=int((comparison["trained"] < comparison["context mean"]).sum()),
                beats_theta_star=int((comparison["trained"] < comparison["best theta*"]).sum()),
                diagonality_rise_z=(mean_se(rise)[0] / mean_se(rise)[1]).tolist(),
                last_layer_pattern=int(sign_pattern(vw[:, -1]).sum()), last_layer_uniform=int((diag[:, -1, -1] < UNIFORM_BELOW).sum()),
                last_selective_pattern=int(sign_pattern(vw[torch.arange(m), selective]).sum()),
                reward_positive=int((vw[..., 0] > 0).all(-1).sum()))


# %%
counts = claim_counts(tiny_runs, tiny_comparison)
test_eq((counts["n_seeds"], counts["k_half"]), (2, 3))
assert 0 <= counts["last_selective_pattern"] <= 2 and len(counts["diagonality_rise_z"]) == tiny.n_layers - 1


# %% [markdown]
# Measuring and asserting are kept apart: the report of the command line records the counts of any set
# of runs, while `emergence_claims` holds them to the thresholds of Claims 6a.1 to 6a.4, which only
# mean something over ten seeds or more:

# %%
#| export
def emergence_claims(results:list,      # runs of one configuration (>= 10 seeds)
                     comparison:dict,   # `baseline_comparison(results)`
                    )->dict:            # the measured counts and thresholds
    "Assert Claims 6a.1 to 6a.4 of the headline experiment; return the counts they rest on."
    if len(results) < 10: raise ValueError(f"`results` must hold at least 10 seeds, got {len(results)}")
    out = claim_counts(results, comparison)
    assert out["beats_context_mean"] >= out["k_half"], out
    d = torch.stack([r.history["diagonality"] for r in results]).double()   # (S, evaluations, L)
    pooled = (d[:, -1, 1:] - d[:, 0, 1:]).mean(-1)                           # Claim 6a.2: layers 2..L taken together
    out["pooled_rise_z"] = (pooled.mean() / (pooled.std() / len(pooled) ** 0.5)).item()
    assert out["pooled_rise_z"] > 2, out   # where the uniform layer sits varies by seed: no fixed layer is asserted
    assert out["last_selective_pattern"] >= out["k_half"], out
    assert out["reward_positive"] >= out["k_half"], out
    return out


# %%
show_doc(emergence_claims)

# %%
test_fail(lambda: emergence_claims(tiny_runs, tiny_comparison), contains="at least 10 seeds")


# %% [markdown]
# ## Ablations
#
# `ablation` reruns a configuration over the same seeds for each value of one setting (runs shared by two
# ablations are read from a cache folder rather than trained twice); `ablation_table` and `plot_ablation`
# show the pattern counts, ratios, diagonality and MSVE per value, and `ablation_claims` asserts Claims
# 6a.5 to 6a.9.

# %%
#| export
def ablation(config:PretrainConfig,  # the base configuration
             field:str,              # the setting to vary (a field of `PretrainConfig`)
             values,                 # the values it takes
             seeds,                  # the seeds of every run
             cache_dir=None,         # folder of cached runs (shared settings are trained once); None: none
             **fixed,                # other settings to change with it (e.g. shared=True)
            )->dict:                 # value -> list of `PretrainResult`
    "Rerun `config` over `seeds` for each value of one setting."
    if field not in {f.name for f in dataclasses.fields(PretrainConfig)}: raise ValueError(f"`field` must be a field of PretrainConfig, got {field!r}")
    return {v: pretrain_many(dataclasses.replace(config, **fixed, **{field: v}), list(seeds), progress=False, cache_dir=cache_dir) for v in values}


# %%
show_doc(ablation)

# %%
cache = tempfile.mkdtemp()
tiny_gamma = ablation(tiny, "gamma", (0.5, 0.9), [0, 1], cache_dir=cache)
test_eq(list(tiny_gamma), [0.5, 0.9])
test_eq([r.config.gamma for r in tiny_gamma[0.5]], [0.5, 0.5])
test_fail(lambda: ablation(tiny, "learning_rate", (1e-2,), [0]), contains="`field` must be a field of PretrainConfig")


# %% [markdown]
# Each value of an ablation is then summarised as a set of runs of its own, with `seed_summary`:

# %%
#| export
def ablation_rows(runs:dict,  # output of `ablation`
                 )->dict:     # value -> `seed_summary` of its runs
    "The seed summary of every value of an ablation."
    return {v: seed_summary(r) for v, r in runs.items()}


# %%
test_eq({v: sm["config"]["gamma"] for v, sm in ablation_rows(tiny_gamma).items()}, {0.5: 0.5, 0.9: 0.9})


# %% [markdown]
# and `ablation_table` puts those summaries side by side, one row per value: first what the claims count
# (the MSVE and the seeds with the sign pattern), then the shape of the solution (ratios and diagonality):

# %%
#| export
def ablation_table(runs:dict,    # output of `ablation`
                   field:str,    # the setting varied
                  )->str:        # markdown: two narrow tables, one row per value
    "Final MSVE and sign-pattern counts per layer; then median successor/current ratios and final diagonality per layer, per value of the ablation."
    counts = [f"| {field} | MSVE, mean ± s.e. | seeds with (+, +, −), per layer |", "|---|---|---|"]
    shape = [f"| {field} | successor / current, median per layer | diagonality at the end, per layer |", "|---|---|---|"]
    for v, sm in ablation_rows(runs).items():
        L = 1 if sm["config"]["shared"] else len(sm["pattern_count"])
        pat = ", ".join(f"{k}/{sm['n_seeds']}" for k in sm["pattern_count"][:L])
        counts.append(f"| {v} | {sm['msve']:.3f} ± {sm['msve_se']:.3f} | {pat} |")
        shape.append(f"| {v} | {', '.join(f'{x:+.2f}' for x in sm['ratio_median'][:L])} | {', '.join(f'{x:.2f}' for x in sm['diagonality_end'][:L])} |")
    return "\n".join(counts + [""] + shape)


# %%
test_eq(len(ablation_table(tiny_gamma, "gamma").splitlines()), 2 * 4 + 1)


# %%
#| export
def plot_ablation(runs:dict,  # output of `ablation`
                  field:str,  # the setting varied
                 ):           # the matplotlib figure
    "Per value of the ablation: the successor/current ratio of the trained layers (median and quartiles), the share of seeds with the pattern, and the MSVE."
    import matplotlib.pyplot as plt
    rows, values = ablation_rows(runs), list(runs)
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    x = torch.tensor(values, dtype=torch.float64) if numeric else torch.arange(len(values), dtype=torch.float64)
    layers = trained_layers(runs[values[0]][0].config)
    fig, axs = plt.subplots(1, 3, figsize=(13, 4), layout="constrained")
    for i, l in enumerate(layers):
        name, ls = _layer_name(runs[values[0]][0].config, l), ("-", "--", ":")[i % 3]
        med = torch.tensor([rows[v]["ratio_median"][l] for v in values])
        lo, hi = med - torch.tensor([rows[v]["ratio_q1"][l] for v in values]), torch.tensor([rows[v]["ratio_q3"][l] for v in values]) - med
        axs[0].errorbar(x + 0.01 * l * (x.max() - x.min() + 1), med, yerr=torch.stack([lo, hi]), fmt="o" + ls, color=f"C{i}", capsize=3, label=name)
        axs[1].plot(x, [rows[v]["pattern_count"][l] / rows[v]["n_seeds"] for v in values], "o" + ls, color=f"C{i}", label=name)
    gam = torch.tensor([rows[v]["config"]["gamma"] for v in values])
    axs[0].plot(x, -gam, "k--", lw=1, label=r"$-\gamma$")
    axs[0].set(ylim=(-4, 3), ylabel="successor / current (median, quartiles)", title="Weight ratio")
    axs[1].set(ylim=(-0.05, 1.05), ylabel="share of seeds with (+, +, −)", title="Sign pattern")
    m = torch.tensor([rows[v]["msve"] for v in values]); se = torch.tensor([rows[v]["msve_se"] for v in values])
    axs[2].errorbar(x, m, yerr=se, fmt="o-", color="C0", capsize=3)
    axs[2].set(ylabel="MSVE (mean ± s.e.)", title="Value error, held-out tasks")
    for ax in axs:
        ax.set_xlabel(field)
        if not numeric: ax.set_xticks(x.tolist(), [str(v) for v in values])
    for ax in axs[:2]: ax.legend(fontsize=9)
    c = rows[values[0]]["config"]
    fig.suptitle(f"Ablation over {field}: {rows[values[0]]['n_seeds']} seeds, {c['n_steps']} steps, lr = {c['lr']:g}")
    return fig


# %%
fig = plot_ablation(tiny_gamma, "gamma")
test_eq(len(fig.axes), 3)
plt.close(fig)


# %%
#| export
def ablation_claims(gamma_runs:dict,    # `ablation` over gamma, with 0.5 and 0.95
                    feature_runs:dict,  # `ablation` over features, with "random" and "onehot"
                    n_runs:dict,        # `ablation` over n (at least two values)
                    shared_runs:dict,   # `ablation` over n_layers with shared parameters, with 8
                   )->dict:             # the measured quantities the claims rest on
    "Assert Claims 6a.5 to 6a.9 of the ablations; return what they rest on."
    count = lambda runs: int(sign_pattern(stack_history(runs, "value_weights")[:, -1, -1]).sum())
    m = len(gamma_runs[0.5]); k_half = min_successes(m, 1 / 2)
    diag_end = lambda runs: stack_history(runs, "diagonality")[:, -1, -1]
    msve_end = lambda runs: stack_history(runs, "msve")[:, -1, 0]
    out = dict(k_half=k_half, pattern_gamma={g: count(r) for g, r in gamma_runs.items()},
               ratio_gamma={g: ratio_interval(r, -1) for g, r in gamma_runs.items()},
               pattern_shared={L: count(r) for L, r in shared_runs.items()}, ratio_shared={L: ratio_interval(r, 0) for L, r in shared_runs.items()},
               pattern_features={f: count(r) for f, r in feature_runs.items()},
               diagonality_onehot_minus_random=(diag_end(feature_runs["onehot"]).mean() - diag_end(feature_runs["random"]).mean()).item(),
               diagonality_difference_se=math.hypot(mean_se(diag_end(feature_runs["onehot"]))[1], mean_se(diag_end(feature_runs["random"]))[1]),
               msve_n={n: mean_se(msve_end(r))[0].item() for n, r in n_runs.items()},
               msve_difference_se=math.hypot(mean_se(msve_end(n_runs[min(n_runs)]))[1], mean_se(msve_end(n_runs[max(n_runs)]))[1]))
    lo, _, hi = out["ratio_gamma"][0.5]
    assert out["pattern_gamma"][0.5] >= k_half and lo <= -0.5 <= hi, out
    assert out["pattern_gamma"][0.95] <= out["pattern_gamma"][0.5] - 5, out
    lo, _, hi = out["ratio_shared"][8]
    assert out["pattern_shared"][8] >= k_half and lo <= -gamma_runs[0.9][0].config.gamma <= hi and hi < 0, out
    assert out["diagonality_onehot_minus_random"] > 2 * out["diagonality_difference_se"], out
    assert out["msve_n"][min(n_runs)] - out["msve_n"][max(n_runs)] > 2 * out["msve_difference_se"], out
    return out


# %% [markdown]
# ## Saved ablations
#
# Chapter 6a's four ablations train eight configurations over ten seeds, minutes on one CPU thread: more
# than a page of the book may take to build. `run_ablations` trains them, `save_ablations` writes every
# run's configuration and evaluation history to one JSON file (`ictd ablations` writes
# `nbs/data/emergence_ablations.json`, [appendix F](cli.html)), and `load_ablations` reads them back as
# `PretrainResult`s without a model, which is all that `ablation_table`, `plot_ablation`,
# `plot_value_weights` and `ablation_claims` read. A float64 written by `json` reads back to the same
# bits, so the page computes from the file exactly what it would compute from the runs.
# `check_saved_runs` retrains some seeds of a file and compares their histories with the saved ones: the
# test suite runs it, so a change of the code that changes the ablations' results is caught, not hidden
# behind a stale file.

# %%
#| export
ABLATION_BASE = dataclasses.replace(EMERGENCE, n_steps=500, eval_every=250, eval_tasks=128)   # chapter 6a's base setting of the ablations
ABLATIONS = dict(gamma=dict(field="gamma", values=(0.5, 0.7, 0.9, 0.95)),                       # name -> the setting varied and its values
                 features=dict(field="features", values=("random", "unit", "onehot")),
                 n=dict(field="n", values=(10, 30)),
                 shared=dict(field="n_layers", values=(8,), fixed=dict(shared=True)))

def run_ablations(seeds,                     # the seeds of every run
                  base:PretrainConfig=ABLATION_BASE,  # the base configuration
                  studies:dict=ABLATIONS,    # name -> dict(field, values, fixed={})
                  cache_dir=None,            # the engine's run cache (runs two studies share are trained once); None: a temporary one
                  progress:bool=False,       # a progress bar over the studies
                 )->dict:                    # name -> value -> list of `PretrainResult`
    "Every ablation of `studies` on `seeds`, through `ablation`."
    with tempfile.TemporaryDirectory() as tmp:
        return {k: ablation(base, st["field"], st["values"], seeds, cache_dir=cache_dir or tmp, **st.get("fixed", {}))
                for k, st in tqdm(studies.items(), desc="ablations", disable=not progress)}

def _run_record(r:PretrainResult)->dict:
    return dict(config=dataclasses.asdict(r.config), history={k: dict(dtype=str(v.dtype).removeprefix("torch."), values=v.tolist()) for k, v in r.history.items()})

def save_ablations(path,          # the JSON file to write (atomically)
                   runs:dict,     # output of `run_ablations`
                   studies:dict=ABLATIONS,
                   **prov,        # `provenance(...)` of the command that made them
                  )->dict:        # what was written
    "Write every run's configuration and history, study by study, with the provenance."
    rec = dict(provenance=prov, studies={k: dict(field=studies[k]["field"], fixed=studies[k].get("fixed", {}),
                                                 values=[[v, [_run_record(r) for r in rs]] for v, rs in by_value.items()]) for k, by_value in runs.items()})
    atomic_write_text(path, json.dumps(rec))
    return rec

def _run(rec:dict)->PretrainResult:
    history = {k: torch.tensor(h["values"], dtype=getattr(torch, h["dtype"])) for k, h in rec["history"].items()}
    return PretrainResult(PretrainConfig(**rec["config"]), None, history)

def load_ablations(path)->tuple:  # (name -> value -> list of `PretrainResult` without a model, provenance); a ValueError if there is none
    "The runs saved by `save_ablations`, with their provenance."
    rec = load_json(path)
    if rec is None or "studies" not in rec: raise ValueError(f"`path` must be a file written by `save_ablations` (`ictd ablations`), got {path}")
    return {k: {(tuple(v) if isinstance(v, list) else v): [_run(r) for r in rs] for v, rs in st["values"]} for k, st in rec["studies"].items()}, rec["provenance"]


# %%
show_doc(run_ablations)

# %%
show_doc(load_ablations)

# %%
tiny_studies = dict(gamma=dict(field="gamma", values=(0.5, 0.9)), shared=dict(field="n_layers", values=(2,), fixed=dict(shared=True)))
tiny_ablations = run_ablations([0, 1], tiny, tiny_studies)
with tempfile.TemporaryDirectory() as tmp:
    save_ablations(Path(tmp) / "ablations.json", tiny_ablations, tiny_studies, command="a test")
    back, prov = load_ablations(Path(tmp) / "ablations.json")
    test_fail(lambda: load_ablations(Path(tmp) / "none.json"), contains="`path` must be a file written by `save_ablations`")
test_eq(prov, dict(command="a test"))
test_eq(list(back["gamma"]), [0.5, 0.9])
test_eq(back["shared"][2][1].config, tiny_ablations["shared"][2][1].config)
for k, v in tiny_ablations["gamma"][0.9][1].history.items():   # the same bits and dtypes (a NaN where the run recorded one)
    torch.testing.assert_close(back["gamma"][0.9][1].history[k], v, rtol=0, atol=0, equal_nan=True)
test_eq(ablation_table(back["gamma"], "gamma"), ablation_table(tiny_ablations["gamma"], "gamma"))


# %% [markdown]
# `check_saved_runs` retrains the chosen seeds of every configuration of a file, batched per
# configuration, and returns the largest difference between a fresh history and the saved one, relative
# to the saved entry's size (at least 1; a NaN in one of them counts as infinitely far). The threshold is $10^{-6}$: `make test-perturbed` runs the check with every initial parameter
# nudged by a relative $10^{-9}$, so it separates rounding (another CPU, the
# nudge) from a changed result.

# %%
#| export
def check_saved_runs(saved:dict,        # name -> value -> runs, as `load_ablations` returns them
                     seeds,             # the seeds to retrain (a subset of the saved runs' seeds)
                    )->float:           # the largest relative difference, over every configuration, history entry and step
    "Retrain `seeds` of every saved configuration and measure how far their histories are from the saved ones."
    check_type(saved, dict, "saved")   # a `check_*` name: `check_arguments` leaves it to check its own arguments
    seeds, worst = check_seeds(seeds), 0.
    for by_value in saved.values():
        for runs in by_value.values():
            kept = [r for r in runs if r.config.seed in seeds]
            if not kept: raise ValueError(f"`seeds` must be among the saved runs' seeds {[r.config.seed for r in runs]}, got {list(seeds)}")
            fresh = pretrain_many(dataclasses.replace(kept[0].config, seed=0), [r.config.seed for r in kept], progress=False)
            for old, new in zip(kept, fresh):
                for k, v in old.history.items():
                    a, b = new.history[k].double(), v.double()
                    diff = ((a - b).abs() / b.abs().clamp(min=1)).masked_fill(a.isnan() & b.isnan(), 0.)   # a NaN in both is agreement
                    worst = max(worst, diff.nan_to_num(nan=math.inf).max().item())
    return worst


# %%
assert check_saved_runs(back, [1]) < 1e-10   # the same machine and code: seed 1 alone is its run in the batch (appendix B)
drifted = {"gamma": {0.5: [PretrainResult(r.config, None, dict(r.history, msve=r.history["msve"] * (1 + 1e-3))) for r in back["gamma"][0.5]]}}
assert check_saved_runs(drifted, [0, 1]) > 1e-5   # a result changed by 0.1% is caught
test_fail(lambda: check_saved_runs(back, [7]), contains="`seeds` must be among the saved runs' seeds [0, 1]")
test_fail(lambda: check_saved_runs(list(back.values()), [0]), contains="`saved` must be a dict")
test_fail(lambda: check_saved_runs(back, "0"), contains="`seeds` must be a non-empty list")


# %% [markdown]
# ## The report of a set of runs
#
# `emergence_report` writes what chapter 6a shows for one configuration (the overview figure, the heat
# maps, and the summary with the baseline comparison and the claim counts) to a folder; the
# `ictd pretrain` command calls it on the softmax runs it trains when there are at least two
# (`--seeds 0-29` for thirty, as [appendix F](cli.html) shows).

# %%
#| export
def emergence_report(results:list,  # runs of one configuration (>= 2 seeds)
                     out_dir,       # folder to write into (created if needed)
                    )->dict:        # the summary written to `out_dir/summary.json`
    "Write the overview figure, the heat maps and a JSON summary (per-layer statistics, baselines, claim counts) of a set of runs."
    import matplotlib.pyplot as plt
    out = Path(out_dir); out.mkdir(parents=True, exist_ok=True)
    comparison = baseline_comparison(results)
    summary = dict(seed_summary(results), baselines={k: dict(mean=v.mean().item(), se=mean_se(v)[1].item(), per_seed=v.tolist()) for k, v in comparison.items()},
                   claims=claim_counts(results, comparison))
    for name, fig in (("bands.png", plot_seed_bands(results)), ("parameters.png", plot_blocks(results))):
        atomic_savefig(fig, out / name, dpi=120); plt.close(fig)
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1))
    atomic_write_text(out / "summary.md", layer_table(summary) + "\n\n" + comparison_table(comparison) + "\n")
    return summary


# %%
show_doc(emergence_report)

# %%
with tempfile.TemporaryDirectory() as tmp:
    report = emergence_report(tiny_runs, tmp)
    test_eq(sorted(p.name for p in Path(tmp).iterdir()), ["bands.png", "parameters.png", "summary.json", "summary.md"])
    test_eq(json.loads((Path(tmp) / "summary.json").read_text())["seeds"], [0, 1])
    test_eq((Path(tmp) / "bands.png").read_bytes()[:8], b"\x89PNG\r\n\x1a\n")
test_eq(report["claims"]["n_seeds"], 2)

# %%
#| export
from ictd.boyan import check_arguments
check_arguments(globals())   # every public function refuses, naming it, an argument its annotation rules out (chapter 0)

# %%
#| hide
import nbdev; nbdev.nbdev_export()
