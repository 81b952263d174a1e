# %%
#| default_exp experiments.mechanism

# %%
#| export
from __future__ import annotations
import dataclasses, json, math
from pathlib import Path
import torch
from ictd.model import SoftmaxICTD
from ictd.state_tokens import model_params
from ictd.engine import EMERGENCE, PretrainConfig, get_family
from ictd.pretrain import DIVERGED, DivergenceError, pretrain_many
from ictd.emergence import UNIFORM_BELOW, context_mean_values, held_out_prompts, sign_pattern
from ictd.boyan import check_gamma, msve
from ictd.core import atomic_write_text, check_type, provenance
from ictd.stats import binomial_tail, normal_greater, rate_interval
from ictd.tasks import sample_trajectories
from ictd.mechanism import (CONTEST_GRIDS, CONTEST_NAMES, contest_table, fit_candidate, fit_estimators, gap_measures, jacobian_spectrum, learned_kernel, prediction_errors,
                            sampled_jacobians, update_jacobian, candidate_prediction, context_prompt, patched_predict, shuffle_context)

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *
from types import SimpleNamespace
import tempfile
from ictd.engine import corrupted_rewards, register_protocol

# %% [markdown]
# # The mechanism studies
# > The machinery of chapter 6b: saving and loading trained runs with their provenance, the tables and statistics of its experiments, the stopping rule of its convergence sweep, and the drivers that trained every file it reads; then chapter 6b's probes and contest (exported to `ictd.mechanism`) and its further measurements.

# %% [markdown]
# *How to read this chapter.* It is the implementation half of [chapter 6b](mechanism.html), kept apart so that
# the lesson there reads without the library in the way (and so that the theory module `ictd.mechanism` stays
# small). Nothing here is a new result: each section defines the functions one of 6b's experiments uses, with the
# tests that pin them down. The drivers at the end are what `ictd mechanism ...` (appendix F) and `DEVICE_RUN.sh`
# call; they train through chapter 6's `pretrain_many` and write JSON files under `nbs/data/` that record the
# command, the git commit and the date. The training configuration they start from is chapter 6's `EMERGENCE`
# ($s = 10$ states, $d = 4$ random features, $n = 30$, $L = 3$ separate layers, $\gamma = 0.9$, learning rate
# $10^{-2}$, 2000 steps).
#
# The last sections serve 6b's contest of algorithms: the training driver of its new cells (`run_contest_runs`), the
# gathering of every cell's saved models (`contest_cells`), the driver that measures them (`run_contest`), and the
# loading, fitting and scoring of the saved sums (`load_contest`, `contest_summary`, `contest_winner`, `rate_interval`).
#
# The page has three parts. Part 1 (the sections below) is the library of `ictd.experiments.mechanism`. [Part
# 2](#part-2-chapter-6bs-probes-and-contest) defines chapter 6b's probes and the contest's candidates, sums and
# `fit_learned_algorithm`, exported to `ictd.mechanism`. [Part 3](#part-3-further-measurements) holds the further
# measurements that chapter 6b links to: the anatomy of the trained models layer by layer, chapter 5's condition,
# the value row probed by the earlier estimators, the controls and five further experiments, with their own claims
# table.

# %% [markdown]
# ## Saved runs, with their provenance
#
# `provenance` ([appendix A](core.html#where-a-saved-result-came-from)) records how a file was made. A saved run holds the configuration, the seed and the final parameters (and, on request, the metrics at every evaluation); `load_models` rebuilds the models exactly.

# %%
#| export
HISTORY_KEYS = ("step", "msve", "neu_population", "diagonality", "value_weights")  # the metrics a saved run keeps

def save_runs(results:list,         # `PretrainResult`s
              history:bool=False,   # also keep the metrics at every evaluation (else only the final ones)
             )->list:               # one dict per run: config, params (nested lists), final metrics (and history)
    "Runs as plain JSON-ready dicts: configuration and final parameters."
    out = []
    for r in results:
        p = model_params(r.model)
        out.append(dict(config=dataclasses.asdict(r.config), params={k: v[0].tolist() for k, v in p.items()},
                        final={k: r.history[k][-1].tolist() for k in HISTORY_KEYS[1:]},
                        **(dict(history={k: r.history[k].tolist() for k in HISTORY_KEYS}) if history else {})))
    return out


# %% [markdown]
# `load_models` is its inverse: it rebuilds each run's configuration and, through the configuration's attention
# family, the trained model itself.

# %%
#| export
def load_models(runs:list,  # output of `save_runs` (e.g. read from a JSON file)
               )->list:     # (PretrainConfig, model) per run
    "Rebuild each saved run's configuration and trained model."
    out = []
    for r in runs:
        c = PretrainConfig(**r["config"])
        out.append((c, get_family(c.attention).module(c, {k: torch.tensor(v, dtype=torch.float64) for k, v in r["params"].items()})))
    return out


# %%
show_doc(load_models)

# %% [markdown]
# A check: the saved runs of chapter 6b load, with the configuration they were trained with, and their parameters reproduce the value weights the training loop recorded.

# %%
saved = json.loads(Path("data/mechanism_runs.json").read_text())
two = load_models(saved["runs"]["fit"][:2])
test_eq(two[1][0], dataclasses.replace(EMERGENCE, seed=saved["runs"]["fit"][1]["config"]["seed"]))
for r, (c, m) in zip(saved["runs"]["fit"], two):
    test_close(m.value_weights(), torch.tensor(r["final"]["value_weights"], dtype=torch.float64), eps=1e-12)

# %% [markdown]
# And the round trip: a run saved by `save_runs` (here a stand-in with the fields of a `PretrainResult`) loads back
# to the same configuration and parameters.

# %%
_fake = SimpleNamespace(config=two[0][0], model=two[0][1], history={k: torch.tensor([saved["runs"]["fit"][0]["final"].get(k, 0.)]) for k in HISTORY_KEYS})
(_c2, _m2), = load_models(save_runs([_fake]))
test_eq(_c2, two[0][0])
for k, v in model_params(two[0][1]).items(): test_eq(model_params(_m2)[k].detach(), v.detach())

# %% [markdown]
# ## Tables of the anatomy
#
# `anatomy_table` prints one part of the per-layer probes of chapter 6b's `layer_anatomy`, in three narrow tables rather than one wide one; `anatomy_counts` gives the counts its claims assert.

# %%
#| export
ANATOMY_PARTS = dict(attention=(("diagonality", ".2f", "population diagonality per layer"), ("constancy", ".3f", "value-write constancy")),
                     knockouts=(("identity", ".2f", "layer removed (MSVE ratio)"), ("uniform", ".3f", "made uniform"), ("swap", ".3f", "swap $\\Delta u = 1/2$")),
                     writes=())  # the columns of each part of `anatomy_table` (writes: features / reward / value per layer)

def anatomy_table(rows:list,             # `layer_anatomy` rows, one per seed
                  part:str="attention",  # which probes: "attention", "knockouts" or "writes"
                 )->str:                 # a markdown table, one row per seed, one value per layer in each cell
    "A markdown table of one part of the `layer_anatomy` rows; the uniform layer in bold."
    if part not in ANATOMY_PARTS: raise ValueError(f"`part` must be one of {', '.join(map(repr, ANATOMY_PARTS))}, got {part!r}")
    f = lambda xs, u, fmt: ", ".join(("**" + format(x, fmt) + "**") if i in u else format(x, fmt) for i, x in enumerate(xs))
    if part == "writes":
        L = len(rows[0]["diagonality"])
        out = ["| seed | " + " | ".join(f"layer {l + 1}: features / reward / value" for l in range(L)) + " |", "|---" * (L + 1) + "|"]
        return "\n".join(out + [f"| {r['seed']} | " + " | ".join(f"{a:.2f} / {b:.2f} / {c:.2f}" for a, b, c in zip(r["feature_writes"], r["reward_writes"], r["value_writes"])) + " |"
                                for r in rows])
    cols = ANATOMY_PARTS[part]
    out = ["| seed | " + " | ".join(h for *_, h in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for r in rows:
        u = {i for i, x in enumerate(r["diagonality"]) if x < UNIFORM_BELOW}
        out.append(f"| {r['seed']} | " + " | ".join(f(r[k], u, fmt) for k, fmt, _ in cols) + " |")
    return "\n".join(out)


# %%
_row = dict(seed=7, diagonality=[0.08, 0.6, 0.4], constancy=[0.99, 0.5, 0.8], identity=[5., 3., 2.], uniform=[1., 1.2, 1.1], swap=[1., 1.1, 1.2],
            feature_writes=[0.1, 0.5, 0.], reward_writes=[0.2, 0.3, 0.], value_writes=[0.3, 1., 0.4])
test_eq(anatomy_table([_row]).splitlines()[-1], "| 7 | **0.08**, 0.60, 0.40 | **0.990**, 0.500, 0.800 |")
test_eq(anatomy_table([_row], "writes").splitlines()[-1], "| 7 | 0.10 / 0.20 / 0.30 | 0.50 / 0.30 / 1.00 | 0.00 / 0.00 / 0.40 |")
test_fail(lambda: anatomy_table([_row], "layers"), contains="`part` must be one of")


# %%
#| export
def anatomy_counts(rows:list)->dict:
    "The counts behind the anatomy claims: one uniform layer, its constant write, and the swap's effect by layer kind."
    diag = torch.tensor([r["diagonality"] for r in rows]); uniform = diag < UNIFORM_BELOW
    cons, swap = torch.tensor([r["constancy"] for r in rows]), (torch.tensor([r["swap"] for r in rows]) - 1).abs()
    later = torch.zeros_like(uniform); later[:, 1:] = True               # layer 1 reads a zero value row: its swap is void
    return dict(n_seeds=len(rows), one_uniform_layer=int((uniform.sum(-1) == 1).sum()), uniform_position=[int(u.nonzero()[0]) + 1 if u.sum() == 1 else None for u in uniform],
                uniform_constancy_min=cons[uniform].min().item(), selective_constancy_max=cons[~uniform].max().item(),
                swap_uniform_max=swap[uniform & later].max().item(), swap_selective_median=swap[~uniform & later].median().item(),
                selective_diagonality_min=diag[~uniform].min().item(), identity_min=torch.tensor([r["identity"] for r in rows]).min().item(),
                uniform_knockout_max=(torch.tensor([r["uniform"] for r in rows]) - 1).abs()[uniform].max().item(),
                uniform_removal_worst=int((torch.tensor([r["identity"] for r in rows]).argmax(-1) == diag.argmin(-1)).sum()))


# %%
_c = anatomy_counts([_row, dict(_row, seed=8, diagonality=[0.6, 0.07, 0.4])])
test_eq((_c["one_uniform_layer"], _c["uniform_position"]), (2, [1, 2]))
test_close(_c["uniform_constancy_min"], 0.5, eps=1e-6)


# %% [markdown]
# ## Tables of the gap map and of the studies
#
# `gap_table` reads the per-seed measures of a gap-map file; `study_summary` measures trained models directly (MSVE, shape explained, uniform layers, sign patterns) and `summary_table` prints them.

# %%
#| export
def gap_table(cells:list,  # the `cells` of `mechanism_gap_map.json`
             )->dict:      # change -> name -> (seeds,) tensor
    "Per cell of the gap map: per-seed MSVE and shape explained of the trained model and certainty equivalence, and the TD sign pattern in the last selective layer."
    from ictd.emergence import last_selective_layer
    out = {}
    for cell in cells:
        rs = cell["runs"]
        get = lambda k: torch.tensor([r[k] for r in rs], dtype=torch.float64)
        vw, diag = torch.tensor([r["value_weights"] for r in rs], dtype=torch.float64), torch.tensor([r["diagonality"] for r in rs], dtype=torch.float64)
        key = ", ".join(f"{k} = {v}" for k, v in cell["change"].items())
        out[key] = {"MSVE trained": get("msve trained"), "MSVE context mean": get("msve context mean"), "MSVE best constant": get("msve best constant"),
                    "MSVE certainty equivalence": get("msve certainty equivalence"),
                    "shape explained, trained": 1 - get("cmsve trained") / get("cmsve best constant"),
                    "shape explained, certainty equivalence": 1 - get("cmsve certainty equivalence") / get("cmsve best constant"),
                    "pattern, last selective layer": sign_pattern(vw[torch.arange(len(rs)), last_selective_layer(diag)]).double(),
                    "one uniform layer": ((diag < UNIFORM_BELOW).sum(-1) == 1).double()}
    return out


# %% [markdown]
# The studies other than the gap map save the models themselves, so `study_summary` measures them afresh: each
# model's MSVE and shape explained on its held-out tasks, its uniform layers (from the learned kernels) and its sign
# patterns. Chapter 6b applies it to every saved study.

# %%
#| export
def study_summary(runs:list,  # (config, model) pairs of one setting
                 )->dict:     # name -> (seeds,) tensor
    "The measures of the controls, the dynamics and the depth sweep, per seed, from the models themselves."
    from ictd.emergence import last_selective_layer
    rows = []
    for c, m in runs:
        tasks, states, Z = held_out_prompts(c)
        g = gap_measures(c, m)
        diag = learned_kernel(m, tasks).diagonal(dim1=-2, dim2=-1).mean((-2, -1))
        vw = m.value_weights()
        rows.append([g["msve trained"], 1 - g["cmsve trained"] / g["cmsve best constant"], float((diag < UNIFORM_BELOW).sum() == 1),
                     float(sign_pattern(vw[last_selective_layer(diag[None])[0]])), float(sign_pattern(vw[-1])), diag.max().item(), float((diag < UNIFORM_BELOW).sum())])
    t = torch.tensor(rows, dtype=torch.float64).T
    return dict(zip(("MSVE", "shape explained", "one uniform layer", "pattern, last selective layer", "pattern, last layer", "largest layer diagonality", "uniform layers"), t))


# %%
show_doc(study_summary)


# %% [markdown]
# Chapter 6b measures every study with `study_summary`; `summary_table` prints a set of them side by side, means with
# standard errors for the measures and counts of seeds for the structures.

# %%
#| export
def summary_table(summaries:dict,  # name -> `study_summary`
                  label:str,       # the first column's heading
                 )->str:
    "A markdown table of `study_summary` results: means ± s.e. and counts over seeds."
    out = [f"| {label} | MSVE | shape explained | one uniform layer | (+, +, −) last selective layer | (+, +, −) last layer | largest layer diagonality |", "|---|---|---|---|---|---|---|"]
    for k, sm in summaries.items():
        m = len(sm["MSVE"])
        num = lambda v: f"{v:.3f}" if abs(v) < 100 else f"{v:.3g}"   # a diverged setting's huge errors: 3 digits, not rounding noise
        se = lambda x: f"{num(x.mean())} ± {num(x.std() / math.sqrt(m))}"
        out.append(f"| {k} | {se(sm['MSVE'])} | {se(sm['shape explained'])} | {int(sm['one uniform layer'].sum())} / {m} | "
                   f"{int(sm['pattern, last selective layer'].sum())} / {m} | {int(sm['pattern, last layer'].sum())} / {m} | {se(sm['largest layer diagonality'])} |")
    return "\n".join(out)


# %%
_sm = dict(zip(("MSVE", "shape explained", "one uniform layer", "pattern, last selective layer", "pattern, last layer", "largest layer diagonality"),
               torch.tensor([[1., 3.], [0.2, 0.4], [1., 1.], [0., 1.], [1., 1.], [0.5, 0.5]], dtype=torch.float64)))
test_eq(summary_table({"x": _sm}, "study").splitlines()[-1], "| x | 2.000 ± 1.000 | 0.300 ± 0.100 | 2 / 2 | 1 / 2 | 2 / 2 | 0.500 ± 0.000 |")


# %% [markdown]
# ## Statistics
#
# One-sided tests for counts of seeds and differences of means, and Holm's correction of a family of p-values: chapter 6b's *Claims and multiplicity* uses them.

# %%
#| export
def fisher_greater(k1:int, m1:int,  # successes and seeds of the first group
                   k2:int, m2:int,  # successes and seeds of the second group
                  )->float:         # one-sided p-value of "the first group's rate is larger"
    "Fisher's exact test, one-sided: P(X >= k1) for X hypergeometric with the observed margins."
    K, N = k1 + k2, m1 + m2
    return sum(math.comb(K, x) * math.comb(N - K, m1 - x) for x in range(k1, min(K, m1) + 1)) / math.comb(N, m1)


# %% [markdown]
# Ten of ten against none of ten is the most extreme table, with probability $1 / \binom{20}{10}$; a first group
# with fewer successes gives 1; and a middle case is the hypergeometric tail written out:

# %%
test_close(fisher_greater(10, 10, 0, 10), 1 / math.comb(20, 10), eps=1e-15)
test_eq(fisher_greater(0, 10, 5, 10), 1.)
test_close(fisher_greater(7, 10, 2, 10), sum(math.comb(9, x) * math.comb(11, 10 - x) for x in range(7, 10)) / math.comb(20, 10), eps=1e-15)


# %% [markdown]
# A claim tested once per control and measure is a family of tests; `holm` adjusts the family's p-values with Holm's
# step-down procedure, which controls the probability of any false claim in the family without assuming the tests
# independent.

# %%
#| export
def holm(pvalues:dict,  # name -> p-value
        )->dict:        # name -> Holm-adjusted p-value
    "Holm's step-down adjustment of a family of p-values."
    order, out, running = sorted(pvalues, key=pvalues.get), {}, 0.
    for i, k in enumerate(order):
        running = max(running, min(1., (len(order) - i) * pvalues[k]))
        out[k] = running
    return out


# %% [markdown]
# The smallest of three p-values is multiplied by 3, the next by 2 (and never falls below the one before), the last by 1:

# %%
test_eq(holm({"a": 0.01, "b": 0.04, "c": 0.03}), {"a": 0.03, "c": 0.06, "b": 0.06})


# %% [markdown]
# A count of seeds with a property (a sign pattern, a winner between two estimators) is tested against the rate a coin
# would give with `binomial_greater`.

# %%
#| export
def binomial_greater(k:int,         # successes
                     m:int,         # trials (seeds)
                     p0:float=0.5,  # null success rate
                    )->float:       # one-sided p-value P(X >= k), X ~ Binomial(m, p0)
    "Exact one-sided binomial test of a count of seeds against a null rate (`ictd.stats.binomial_tail`)."
    return binomial_tail(k, m, p0)


# %% [markdown]
# Nine of ten against a fair coin has $p = 11/1024$; zero of ten has $p = 1$; a count above the number of seeds is refused:

# %%
test_close(binomial_greater(9, 10), 11 / 1024, eps=1e-15)
test_eq(binomial_greater(0, 10), 1.)
test_fail(lambda: binomial_greater(11, 10), contains="`k` must be an integer in [0, 10]")

# %% [markdown]
# A difference of seed means, in units of its standard error, is compared with the standard normal by `normal_greater`
# ([appendix J](statistics.html), imported here with `rate_interval` so that the studies' names stay where they were).

# %%
#| export
_all_ = ["normal_greater", "rate_interval"]

# %%
test_close(normal_greater(1.959963984540054), 0.025, eps=1e-12)


# %% [markdown]
# `claims_table` puts each experiment's claims in one table: the primary claim's p-value as it is, the secondary
# claims' Holm-adjusted together.

# %%
#| export
def _p(p): return "< 1e-6" if p < 1e-6 else f"{p:.2g}"   # a p-value as printed: a normal tail below 1e-6 says no more

def claims_table(families:dict,  # experiment -> dict(primary=(claim, p), secondary={claim: p})
                 level:float=0.05, # significance level
                )->str:          # a markdown table, Holm-adjusted within each experiment's secondary claims
    "The claims of each experiment with their p-values: the primary one as is, the secondary ones Holm-adjusted together."
    out = ["| experiment | claim | role | p | Holm-adjusted p | holds at " + f"{level:g}" + " |", "|---|---|---|---|---|---|"]
    for exp, f in families.items():
        claim, p = f["primary"]
        out.append(f"| {exp} | {claim} | primary | {_p(p)} | — | {'yes' if p < level else 'no'} |")
        adj = holm(f["secondary"]) if f["secondary"] else {}
        out += [f"| | {k} | secondary | {_p(f['secondary'][k])} | {_p(adj[k])} | {'yes' if adj[k] < level else 'no'} |" for k in f["secondary"]]
    return "\n".join(out)


# %%
_ct = claims_table({"x": dict(primary=("p", 0.01), secondary={"a": 0.01, "b": 0.04, "c": 0.3})})
assert "| a | secondary | 0.01 | 0.03 | yes |" in _ct and "| b | secondary | 0.04 | 0.08 | no |" in _ct, _ct
assert "| primary | < 1e-6 |" in claims_table({"y": dict(primary=("q", 1e-9), secondary={})})

# %%
show_doc(claims_table)

# %% [markdown]
# ## The stopping rule
#
# `converge_metrics` collects the trajectories the rule of chapter 6b's Experiment 1 watches, `moved_by` computes
# the statistic of one metric over a window, and `settled_step` applies the rule: the first evaluation from
# which no metric moves again.

# %%
#| export
CONVERGE_TOLERANCES = dict(msve=0.01, diagonality=0.02, value_weights=0.02)  # a seed-mean change over the window below these is "not moving"
CONVERGE_LRS = (3e-3, 1e-2, 3e-2)                                           # learning rates of the convergence sweep

def converge_metrics(results:list,  # `PretrainResult`s of one configuration, one per seed
                    )->dict:        # name -> (S, T, k) per-seed trajectories
    "The trajectories the stopping rule watches: held-out MSVE, every layer's diagonality, the last layer's value weights."
    h = lambda k: torch.stack([r.history[k] for r in results]).double()
    S, T = len(results), h("msve").shape[1]
    return dict(msve=h("msve").reshape(S, T, 1), diagonality=h("diagonality").reshape(S, T, -1), value_weights=h("value_weights")[:, :, -1])


# %% [markdown]
# On two stand-in runs with four evaluations of three layers, the trajectories come out per seed, evaluation and
# component (the last layer's three value weights):

# %%
_vw = torch.arange(36.).reshape(4, 3, 3)
_metrics = converge_metrics([SimpleNamespace(history=dict(msve=torch.zeros(4, 1), diagonality=torch.zeros(4, 3), value_weights=_vw))] * 2)
test_eq({k: tuple(v.shape) for k, v in _metrics.items()}, dict(msve=(2, 4, 1), diagonality=(2, 4, 3), value_weights=(2, 4, 3)))
test_eq(_metrics["value_weights"][1], _vw[:, -1].double())


# %% [markdown]
# `moved_by` is the statistic of one metric: over a window of `lag` evaluations, the seed mean of each seed's change
# plus two standard errors, the largest over the metric's components.

# %%
#| export
def moved_by(traj:torch.Tensor,  # (S, T, k) per-seed trajectories at evenly spaced evaluations
             lag:int,            # the window in evaluations
            )->torch.Tensor:     # (T,) largest |seed-mean change| + 2 s.e. over the window (NaN before `lag`)
    "How far a metric has moved over the last `lag` evaluations, on the seed mean with two standard errors."
    if not 1 <= lag < traj.shape[1]: raise ValueError(f"`lag` must lie in [1, {traj.shape[1]}), got {lag}")
    if traj.shape[0] < 2: raise ValueError(f"`traj` needs at least 2 seeds for a standard error, got {traj.shape[0]}")
    delta = traj[:, lag:] - traj[:, :-lag]
    bound = (delta.mean(0).abs() + 2 * delta.std(0) / math.sqrt(traj.shape[0])).amax(-1)
    return torch.cat([torch.full((lag,), math.nan, dtype=bound.dtype), bound])


# %% [markdown]
# Seeds that all rise by 0.1 per evaluation have moved by exactly $0.1 \cdot$ `lag` (no spread, no standard error), and
# the statistic is undefined before the first full window:

# %%
_ramp = 0.1 * torch.arange(6, dtype=torch.float64)[None, :, None].expand(3, -1, 2)
test_close(moved_by(_ramp, 2)[2:], torch.full((4,), 0.2, dtype=torch.float64), eps=1e-12)
test_eq(moved_by(_ramp, 2)[:2].isnan().all(), True)
test_fail(lambda: moved_by(_ramp, 6), contains="`lag` must lie in [1, 6)")


# %% [markdown]
# `settled_step` applies the rule to every watched metric at once, with the tolerances `CONVERGE_TOLERANCES`.

# %%
#| export
def settled_step(metrics:dict,     # output of `converge_metrics`
                 steps:list,       # (T,) the evaluation steps, evenly spaced
                 window:int,       # the window w in steps (a multiple of the spacing)
                 tolerances:dict=CONVERGE_TOLERANCES, # metric -> tolerance epsilon
                )->int|None:       # the first step from which no metric moves again; None if training never settles
    "The stopping rule: the first evaluation step from which every metric stays below its tolerance at every later evaluation."
    every = steps[1] - steps[0]
    if window % every: raise ValueError(f"`window` must be a multiple of the evaluation spacing {every}, got {window}")
    still = torch.stack([moved_by(metrics[k], window // every) < tol for k, tol in tolerances.items()]).all(0)
    later = still.flip(0).cumprod(0).flip(0).bool()                       # still at t and at every evaluation after it
    return int(steps[int(later.nonzero()[0])]) if later.any() else None


# %%
show_doc(settled_step)

# %% [markdown]
# A check on synthetic trajectories: ten seeds that decay as $e^{-\sigma/500}$ ($\sigma$ the training step) to a seed's own level,
# with no noise, settle where the decay over a window of 1000 steps falls below the tolerance,
# $e^{-\sigma/500}(e^{1000/500} - 1) < 0.01$, i.e. at the first evaluation after $\sigma = 500 \ln(639) \approx 3230$;
# a trajectory that keeps drifting never settles.

# %%
_steps = list(range(0, 8001, 200))
_t = torch.tensor(_steps, dtype=torch.float64)
_levels = torch.linspace(0, 1, 10, dtype=torch.float64)[:, None, None]
_decay = _levels + torch.exp(-_t / 500)[None, :, None]
_flat = dict(msve=_decay, diagonality=_decay.expand(-1, -1, 3), value_weights=torch.zeros(10, len(_steps), 3, dtype=torch.float64))
test_eq(settled_step(_flat, _steps, 1000), 3400)
test_eq(settled_step(dict(_flat, msve=_decay + 2e-5 * _t[None, :, None]), _steps, 1000), None)
test_fail(lambda: settled_step(_flat, _steps, 300), contains="multiple of the evaluation spacing")


# %% [markdown]
# ## Drivers of the slow experiments
#
# Every saved file of chapter 6b was written by one of these functions, which train through `pretrain_many` with one torch thread and record the
# command, the git commit and the date.

# %% [markdown]
# Each driver writes its file through the private <code>_write</code>, which puts the provenance (command, commit, date) first.

# %%
#| export
def _write(out_dir, name:str, command:str, payload:dict)->Path:
    "Write `payload` as JSON to `out_dir`/`name` atomically (`atomic_write_text`: a crash leaves the old file or the new one), after the provenance of `command`."
    return atomic_write_text(Path(out_dir) / name, json.dumps(dict(provenance=provenance(command), **payload)))


# %%
with tempfile.TemporaryDirectory() as _d:
    _saved = json.loads(_write(_d, "x.json", "a command", dict(answer=42)).read_text())
test_eq((list(_saved)[0], _saved["provenance"]["command"], _saved["answer"]), ("provenance", "a command", 42))


# %% [markdown]
# `run_mechanism_study` trains the runs the chapter looks inside and fits on (seeds 0 to 9) and the runs it predicts (seeds 10 to 19).

# %%
#| export
def run_mechanism_study(out_dir="nbs/data",            # folder of the JSON file
                        seeds=tuple(range(10)),        # the seeds the chapter fits on (those of the emergence chapter)
                        fresh_seeds=tuple(range(10, 20)), # seeds the chapter predicts
                        config:PretrainConfig=EMERGENCE,   # the configuration
                        command:str="run_mechanism_study()", # recorded in the file
                       )->Path:                           # the file written, `mechanism_runs.json`
    "Train `config` on `seeds` and `fresh_seeds` and save the final parameters of every run."
    runs = {name: save_runs(pretrain_many(config, list(s), progress=False)) for name, s in (("fit", seeds), ("fresh", fresh_seeds))}
    return _write(out_dir, "mechanism_runs.json", command, dict(config=dataclasses.asdict(config), runs=runs))


# %% [markdown]
# The gap map: where does a trained model know more than the value level? `run_gap_map` trains `EMERGENCE` with each change of `GAP_CELLS` and keeps, per run, only the measures (`gap_measures`) and the diagonality of every layer.

# %%
#| export
GAP_CELLS = (dict(n=30, gamma=0.5), dict(n=30, gamma=0.9), dict(n=300, gamma=0.5), dict(n=300, gamma=0.9),
             dict(features="onehot", gamma=0.5), dict(features="onehot", gamma=0.9), dict(n_states=20))  # changes to EMERGENCE

def run_gap_map(out_dir="nbs/data",              # folder of the JSON file
                seeds=tuple(range(10)),          # seeds of every cell
                cells=GAP_CELLS,                 # changes to `base`, one per cell
                base:PretrainConfig=EMERGENCE,   # the settings every cell shares
                command:str="run_gap_map()",     # recorded in the file
                name:str="mechanism_gap_map.json", # the file's name
               )->Path:                          # the file written (rewritten after every cell)
    "Train every cell of the gap map over `seeds` and save the measures of every run."
    done = []
    for change in cells:
        c = dataclasses.replace(base, **change)
        runs = pretrain_many(c, list(seeds), progress=False)
        done.append(dict(change=change, config=dataclasses.asdict(c), runs=[dict(seed=r.config.seed, diagonality=r.history["diagonality"][-1].tolist(),
                                                                              **gap_measures(r.config, r.model)) for r in runs]))
        path = _write(out_dir, name, command, dict(cells=done))
    return path


# %% [markdown]
# The controls, the dynamics from $\theta^*$, the shared layer and the depth sweep each train `EMERGENCE` with
# one change over ten seeds and save the runs with their gap measures; the private <code>_study</code> does that for a set of changes.

# %% [markdown]
# A study trains every seed of a configuration together, and one diverging seed stops the batch. The
# seed is then dropped and recorded (step, learning rate, size reached), and the others are trained
# again without it: the engine's run of a seed does not depend on which seeds share its batch. The example
# below forces seed 0 to diverge at step 40 (`corrupted_rewards` of [appendix B](engine.html#a-forced-divergence) makes its rewards a million times
# too large from then on), so which seed is dropped, and when, follows from the setting on every machine.

# %%
#| export
def train_dropping_diverged(config:PretrainConfig,  # the configuration
                            seeds,                  # its seeds
                            **kwargs,               # passed to `pretrain_many` (device, cache_dir)
                           )->tuple:                # (results of the seeds that trained, records of those that diverged)
    "Train `seeds` together; a seed that diverges is dropped and recorded, and the others trained without it."
    seeds, diverged = list(seeds), []
    while seeds:
        try: return pretrain_many(config, seeds, progress=False, **kwargs), diverged
        except DivergenceError as e:
            diverged += [dict(seed=s, step=e.step, lr=e.lr, size=e.size, limit=DIVERGED, message=str(e)) for s in e.seeds]
            seeds = [s for s in seeds if s not in e.seeds]
    return [], diverged


# %%
register_protocol("seed 0 corrupted at step 40", corrupted_rewards([0], 40))   # a forced divergence
wild = PretrainConfig(n_tasks=32, eval_tasks=4, n_steps=100, eval_every=50, protocol="seed 0 corrupted at step 40")
kept, dropped = train_dropping_diverged(wild, [0, 1])
test_eq(([r.config.seed for r in kept], [d["seed"] for d in dropped]), ([1], [0]))
test_eq(kept[0].history["msve"], pretrain_many(wild, [1], progress=False)[0].history["msve"])   # seed 1's run is its own
dropped[0]["step"], dropped[0]["lr"]


# %%
#| export
def _study(changes:dict, seeds, history:bool, base:PretrainConfig=EMERGENCE, device=None, cache_dir=None, train_only:bool=False)->dict:
    "name -> saved runs of `base` with each change, with their gap measures (with `train_only`, only train into `cache_dir`)."
    out = {}
    for name, change in changes.items():
        runs, diverged = train_dropping_diverged(dataclasses.replace(base, **change), seeds, device=device, cache_dir=cache_dir)
        if train_only: continue
        out[name] = dict(change=change, runs=[dict(saved, gap=gap_measures(r.config, r.model)) for saved, r in zip(save_runs(runs, history), runs)])
        if diverged: out[name]["diverged"] = diverged
    return out


# %% [markdown]
# The controls change the objective to each of `CONTROLS`.

# %%
#| export
CONTROLS = ("mc", "supervised", "td-independent")   # objectives other than TD, on the same data and architecture

def run_control_study(out_dir="nbs/data", seeds=tuple(range(10)), command:str="run_control_study()")->Path:
    "Train `EMERGENCE` with each objective of `CONTROLS` over `seeds`; write `mechanism_controls.json`."
    return _write(out_dir, "mechanism_controls.json", command, dict(studies=_study({o: dict(objective=o) for o in CONTROLS}, seeds, False)))


# %% [markdown]
# The dynamics study starts training at $\theta^*$ instead of a random initialisation: `theta_star_starts` names the
# four starting points, each a change to the configuration's initialisation.

# %%
#| export
def theta_star_starts(config:PretrainConfig=EMERGENCE,  # the configuration (depth, gamma)
                      scale:float=0.05,                 # std of the perturbation
                     )->dict:                           # name -> changes to `config`
    "The starting points of the dynamics study: theta*(W = I, alpha = 1), the best-fit theta* of the emergence grid, each exact and perturbed."
    from ictd.emergence import best_theta_star
    alpha, beta = best_theta_star(config)
    starts = {"theta* (beta 1, alpha 1)": dict(init="theta_star", init_beta=1., init_alpha=1.),
              f"best-fit theta* (beta {beta:g}, alpha {alpha:g})": dict(init="theta_star", init_beta=float(beta), init_alpha=float(alpha))}
    return {**starts, **{f"{k} + N(0, {scale:g}^2)": dict(v, init_scale=scale) for k, v in starts.items()}}


# %%
_starts = theta_star_starts(scale=0.1)
test_eq(len(_starts), 4)
test_eq(_starts["theta* (beta 1, alpha 1)"], dict(init="theta_star", init_beta=1., init_alpha=1.))
test_eq(_starts["theta* (beta 1, alpha 1) + N(0, 0.1^2)"]["init_scale"], 0.1)


# %% [markdown]
# `run_theta_star_dynamics` trains from each of them, keeping the metrics at every evaluation (chapter 6b plots them).

# %%
#| export
def run_theta_star_dynamics(out_dir="nbs/data", seeds=tuple(range(10)), command:str="run_theta_star_dynamics()")->Path:
    "Train `EMERGENCE` from each of `theta_star_starts()` over `seeds`, keeping the histories; write `mechanism_dynamics.json`."
    return _write(out_dir, "mechanism_dynamics.json", command, dict(studies=_study(theta_star_starts(), seeds, True)))


# %% [markdown]
# `run_shared_study` trains the model with one shared layer that chapter 6b iterates beyond its training depth.

# %%
#| export
def run_shared_study(out_dir="nbs/data", seeds=tuple(range(10)), command:str="run_shared_study()")->Path:
    "Train `EMERGENCE` with one shared layer over `seeds`; write `mechanism_shared.json` (the learned layer is iterated in the chapter)."
    return _write(out_dir, "mechanism_shared.json", command, dict(studies=_study({"shared": dict(shared=True)}, seeds, False)))


# %% [markdown]
# `run_depth_sweep` trains every depth of `DEPTHS` with separate layers; the deep end, `DEEP_DEPTHS`, is too slow for
# this machine and is trained in parallel workers into a cache (`train_only`), then assembled by a last call.

# %%
#| export
DEPTHS = (2, 3, 4, 6, 8)                            # depths of the sweep with separate layers
DEEP_DEPTHS = (12, 16)                              # the deep end of the depth sweep, saved separately (`mechanism_depth_deep.json`)

def run_depth_sweep(out_dir="nbs/data", seeds=tuple(range(10)), depths=DEPTHS, command:str="run_depth_sweep()", name:str="mechanism_depth.json",
                    device=None, cache_dir=None, train_only:bool=False)->Path|None:
    "Train `EMERGENCE` at each depth (separate layers) over `seeds`; write `name` (nothing with `train_only`: runs go to `cache_dir`)."
    if train_only and cache_dir is None: raise ValueError("`train_only` needs a `cache_dir` to keep the runs in")
    studies = _study({f"L = {L}": dict(n_layers=L) for L in depths}, seeds, False, device=device, cache_dir=cache_dir, train_only=train_only)
    return None if train_only else _write(out_dir, name, command, dict(studies=studies))


# %% [markdown]
# A worker that only trains must have somewhere to keep its runs:

# %%
test_fail(lambda: run_depth_sweep(train_only=True), contains="`train_only` needs a `cache_dir`")


# %% [markdown]
# The convergence sweep trains one run per learning rate to the largest step count, recording the
# parameters at every evaluation; with a `cache_dir`, workers can train disjoint seeds or rates
# in parallel (`train_only`) and a last call assembles the file from their saved runs. `converge_config` is the
# configuration of one learning rate.

# %%
#| export
def converge_config(lr:float, n_steps:int, eval_every:int)->PretrainConfig:
    "`EMERGENCE` with another learning rate and length, recording the parameters at every evaluation."
    return dataclasses.replace(EMERGENCE, lr=lr, n_steps=n_steps, eval_every=eval_every, record_params=True)


# %%
_cc = converge_config(3e-3, 4000, 200)
test_eq((_cc.lr, _cc.n_steps, _cc.eval_every, _cc.record_params), (3e-3, 4000, 200, True))
test_eq(dataclasses.replace(_cc, lr=EMERGENCE.lr, n_steps=EMERGENCE.n_steps, eval_every=EMERGENCE.eval_every, record_params=EMERGENCE.record_params), EMERGENCE)


# %% [markdown]
# Every step count of the sweep is read off the same run, so `model_at` rebuilds the model at any evaluation from
# the recorded parameters (the history keys `param.A`, `param.V_cur`, `param.V_tgt`).

# %%
#| export
def model_at(result, i:int):
    "The model of a run at its i-th evaluation, rebuilt from the recorded parameters."
    c = result.config
    return get_family(c.attention).module(c, {k[6:]: v[i].double() for k, v in result.history.items() if k.startswith("param.")})


# %% [markdown]
# On a stand-in run whose history holds the parameters of two saved models, the model at evaluation 1 is the second:

# %%
_hist = {f"param.{k}": torch.stack([model_params(m)[k][0].detach() for _, m in two]) for k in ("A", "V_cur", "V_tgt")}
_at1 = model_at(SimpleNamespace(config=two[1][0], history=_hist), 1)
test_close(_at1.value_weights(), two[1][1].value_weights(), eps=1e-15)


# %% [markdown]
# At each learning rate the sweep also checks the learned estimator, with the private <code>_estimator_check</code>: fitted on
# the first half of the seeds' final models, scored on the other half.

# %%
#| export
def _estimator_check(runs:list)->dict:
    "Fit the candidates on the first half of `runs`, score them on the second: centred 1 - R^2 per seed, and the lookahead's constants."
    half = len(runs) // 2
    fitted = fit_estimators(runs[:half])
    pred = prediction_errors(fitted, runs[half:])
    return dict(lookahead=fitted["lookahead"], theta_star={k: fitted["theta*"][k] for k in ("alpha", "beta")},
                centred={k: pred[f"{k}, centred"].tolist() for k in fitted}, msve={k: pred[f"{k}, MSVE"].tolist() for k in list(fitted) + ["trained"]})


# %% [markdown]
# `run_converge_study` puts it together: train, apply the stopping rule, and summarise the models at every kept step count.

# %%
#| export
def run_converge_study(out_dir="nbs/data",          # folder of the JSON file
                       seeds=tuple(range(10)),      # seeds of every learning rate
                       lrs=CONVERGE_LRS,            # learning rates
                       n_steps:int=4000,            # steps of every run (the largest step count of the sweep)
                       eval_every:int=200,          # steps between evaluations
                       window:int=1000,             # the stopping rule's window in steps
                       kept=(500, 1000, 2000, 4000, 8000, 16000, 32000), # step counts summarised (those evaluated, the last and the settled step)
                       device=None,                 # torch device (default the CPU)
                       cache_dir=None,              # folder of saved runs and checkpoints (None: none)
                       train_only:bool=False,       # only train (into `cache_dir`) and write nothing
                       command:str="run_converge_study()", # recorded in the file
                       name:str="mechanism_converge.json", # the file's name
                      )->Path|None:                 # the file written
    "The lr x steps sweep of `EMERGENCE` with the stopping rule, and the chapter's measures at every kept step count."
    if train_only and cache_dir is None: raise ValueError("`train_only` needs a `cache_dir` to keep the runs in")
    out = {}
    for lr in lrs:
        c = converge_config(lr, n_steps, eval_every)
        runs = pretrain_many(c, list(seeds), progress=False, cache_dir=cache_dir, device=device,
                             checkpoint_every=10 * eval_every if cache_dir is not None else None)
        if train_only: continue
        steps = runs[0].history["step"].flatten().tolist()
        metrics = converge_metrics(runs)
        settled = settled_step(metrics, steps, window)
        at = sorted({s for s in kept if s in steps} | {steps[-1]} | ({settled} if settled is not None else set()))
        summaries, params = {}, {}
        for s in at:
            i = steps.index(s)
            models = [(r.config, model_at(r, i)) for r in runs]
            summaries[s] = {k: v.tolist() for k, v in study_summary(models).items()}
            params[s] = [{k: v.tolist() for k, v in model_params(m).items()} for _, m in models]
        final = [(r.config, model_at(r, len(steps) - 1)) for r in runs]
        out[f"{lr:g}"] = dict(lr=lr, config=dataclasses.asdict(c), steps=steps, settled=settled,
                              moved={k: moved_by(v, window // eval_every).tolist() for k, v in metrics.items()},
                              trajectories={k: v.tolist() for k, v in metrics.items()}, summaries=summaries, params=params,
                              estimator=_estimator_check([(dataclasses.replace(c, eval_tasks=128), m) for c, m in final]))
    if train_only: return None
    return _write(out_dir, name, command, dict(seeds=list(seeds), window=window, tolerances=CONVERGE_TOLERANCES, lrs=out))


# %%
test_fail(lambda: run_converge_study(train_only=True), contains="`train_only` needs a `cache_dir`")


# %% [markdown]
# The Jacobian at the training context length is measured at two points, which `star_points` names: $\theta^*$ of
# Definition 3.1 ($W = I$, $\alpha = 1$) and the best-fit $\theta^*$ of the emergence chapter's grid, each as (beta, alpha).

# %%
#| export
def star_points(config:PretrainConfig=EMERGENCE)->dict:
    "The two theta* of the dynamics study: name -> (beta, alpha)."
    from ictd.emergence import best_theta_star
    alpha, beta = best_theta_star(config)
    return {"theta* (beta 1, alpha 1)": (1., 1.), f"best-fit theta* (beta {beta:g}, alpha {alpha:g})": (float(beta), float(alpha))}


# %%
_sp = star_points()
test_eq(len(_sp), 2)
test_eq(_sp["theta* (beta 1, alpha 1)"], (1., 1.))
_fit = _starts[list(_sp)[1]]
test_eq((_fit["init_beta"], _fit["init_alpha"]), _sp[list(_sp)[1]])


# %% [markdown]
# `run_jacobian_study` computes, at both points, the exact $n = \infty$ values and `sampled_jacobians` at the
# training context, and saves them with the eigenvalues' real parts.

# %%
#| export
def run_jacobian_study(out_dir="nbs/data",       # folder of the JSON file
                       n_batches:int=6,          # Monte-Carlo batches K at n = 30
                       batch_size:int=16,        # contexts per batch
                       seed:int=0,               # seed of the contexts
                       command:str="run_jacobian_study()", # recorded in the file
                      )->Path:                   # the file written, `mechanism_jacobian.json`
    "The expected update's Jacobian at both theta* of `EMERGENCE`: exact at n = infinity (8 held-out tasks) and sampled at its n."
    c = EMERGENCE
    tasks_inf = held_out_prompts(dataclasses.replace(c, eval_tasks=8, seed=1000))[0]
    tasks = held_out_prompts(dataclasses.replace(c, seed=1000))[0]
    out = {}
    for name, (beta, alpha) in star_points(c).items():
        m = SoftmaxICTD.from_theta_star(c.feature_dim, beta * torch.eye(c.feature_dim, dtype=torch.float64), n_layers=c.n_layers, alpha=alpha, gamma=c.gamma)
        g, J = update_jacobian(m, tasks_inf)
        gs, Js = sampled_jacobians(m, tasks, c.n, n_batches, batch_size, seed)
        out[name] = {"n = infinity": dict(jacobian_spectrum(g[None], J[None]), real_parts=sorted(torch.linalg.eigvals(J).real.tolist())),
                     f"n = {c.n}": dict(jacobian_spectrum(gs, Js), real_parts=sorted(torch.linalg.eigvals(Js.mean(0)).real.tolist()))}
    return _write(out_dir, "mechanism_jacobian.json", command, dict(n_batches=n_batches, batch_size=batch_size, seed=seed, points=out))


# %% [markdown]
# ## The contest's runs
#
# Chapter 6b's contest of algorithms scores every candidate on models trained across a sweep. Most of its models are
# the saved runs above (the `EMERGENCE` seeds 0 to 19, the depth sweep, the controls at $L = 3$); `CONTEST_CELLS`
# names the cells that had to be trained for it: twenty more headline seeds (so that thirty are scored), the three
# control objectives at the other depths, and one factor at a time around the headline cell. `run_contest_runs`
# trains them and saves the final parameters after every cell, so that an interrupted sweep keeps what it finished.

# %%
#| export
CONTEST_CELLS = {"headline": (dict(), tuple(range(20, 40))),
                 **{f"{o}, L = {L}": (dict(objective=o, n_layers=L), tuple(range(10))) for L in (2, 4, 6) for o in CONTROLS},
                 "n = 10": (dict(n=10), tuple(range(10))), "n = 100": (dict(n=100), tuple(range(10))),
                 "gamma = 0.5": (dict(gamma=0.5), tuple(range(10))), "one-hot": (dict(features="onehot"), tuple(range(10)))}  # name -> (changes to EMERGENCE, seeds)

def run_contest_runs(out_dir="nbs/data",             # folder of the JSON file
                     cells:dict=CONTEST_CELLS,       # name -> (changes to `EMERGENCE`, seeds)
                     command:str="run_contest_runs()", # recorded in the file
                     name:str="contest_runs.json",   # the file's name
                    )->Path:                         # the file written (rewritten after every cell)
    "Train every cell of the contest that no other study saved, and save its runs (and any diverged seeds) with their wall time."
    import time
    done = {}
    for cell, (change, seeds) in cells.items():
        t0 = time.time()
        runs, diverged = train_dropping_diverged(dataclasses.replace(EMERGENCE, **change), seeds)
        done[cell] = dict(change=change, runs=save_runs(runs), diverged=diverged, wall_s=time.time() - t0)
        path = _write(out_dir, name, command, dict(cells=done))
    return path


# %%
test_eq(len(CONTEST_CELLS["headline"][1]), 20)
test_eq(set(range(20, 40)) & set(range(20)), set())   # the headline's new seeds are not the saved ones

# %% [markdown]
# `contest_cells` gathers the runs of every cell of the contest from the saved files: the headline cell's forty seeds
# (0 to 19 from `mechanism_runs.json`, 20 to 39 from `contest_runs.json`), TD at the other depths from the depth
# sweep, the controls at $L = 3$ from `mechanism_controls.json`, and everything else from `contest_runs.json` and
# `contest_runs2.json`. (The first training pass was stopped to fit the CPU budget, and the one-factor cells were
# trained first in a second pass, then the remaining controls at $L = 6$ as time allowed.)

# %%
#| export
CONTEST_DEPTHS = (2, 3, 4, 6)                        # depths of the contest's sweep
CONTEST_RUN_FILES = ("contest_runs.json", "contest_runs2.json")   # the runs `run_contest_runs` saved (the second: the cells trained after the first was stopped)
CONTEST_OBJECTIVES = ("td",) + CONTROLS              # objectives of the contest's sweep
CONTEST_FACTORS = ("n = 10", "n = 100", "gamma = 0.5", "one-hot")   # one factor at a time around the headline cell

def contest_cells(data_dir="nbs/data",  # folder of the saved runs
                 )->dict:               # cell name -> list of (config, model), seed order
    "The trained models of every cell of the contest that has been trained, rebuilt from the saved files."
    read = lambda name: json.loads((Path(data_dir) / name).read_text())
    runs, depth, ctrl = read("mechanism_runs.json"), read("mechanism_depth.json"), read("mechanism_controls.json")
    new = {k: v for f in CONTEST_RUN_FILES if (Path(data_dir) / f).exists() for k, v in read(f)["cells"].items()}
    out = {"td, L = 3": load_models(runs["runs"]["fit"] + runs["runs"]["fresh"] + new["headline"]["runs"])}
    for L in CONTEST_DEPTHS:
        for o in CONTEST_OBJECTIVES:
            if (o, L) == ("td", 3): continue
            key = f"{o}, L = {L}"
            saved = depth["studies"][f"L = {L}"] if o == "td" else ctrl["studies"][o] if L == 3 else new.get(key)
            if saved is not None: out[key] = load_models(saved["runs"])      # a cell still training is left out
    return out | {k: load_models(new[k]["runs"]) for k in CONTEST_FACTORS if k in new}


# %% [markdown]
# `run_contest` measures every cell's models with chapter 6b's `contest_stats` (the sums from which each candidate's
# fit and scores follow) and writes them, with the grids, to `contest_stats.json`.

# %%
#| export
def _rounded(x): return float(f"{x:.12g}")

def run_contest(out_dir="nbs/data",            # folder of the JSON file
                data_dir="nbs/data",           # folder of the saved runs
                eval_tasks:int=128,            # held-out tasks per run
                cells=None,                    # cell names to measure (None: all of `contest_cells`)
                command:str="run_contest()",   # recorded in the file
                name:str="contest_stats.json", # the file's name
                wait_s:float=0.,               # wait up to this long for a cell still training to appear in the saved runs
               )->Path:                        # the file written (rewritten after every cell)
    "The contest's sums for every run of every cell, with the candidates' grids and each cell's wall time."
    import time
    from ictd.mechanism import contest_stats
    all_cells, done, start = contest_cells(data_dir), {}, time.time()
    for cell in (cells or list(all_cells)):
        while cell not in all_cells and time.time() - start < wait_s: time.sleep(20); all_cells = contest_cells(data_dir)
        if cell not in all_cells: raise ValueError(f"cell {cell!r} has no saved runs in {data_dir}")
        t0 = time.time()
        stats = [contest_stats(dataclasses.replace(c, eval_tasks=eval_tasks), m) for c, m in all_cells[cell]]
        for st in stats:
            for v in st["candidates"].values(): v.update({k: [_rounded(x) for x in xs] for k, xs in v.items()})
        done[cell] = dict(config=dataclasses.asdict(dataclasses.replace(all_cells[cell][0][0], seed=0)), seeds=[c.seed for c, _ in all_cells[cell]],
                          stats=stats, wall_s=time.time() - t0)
        path = _write(out_dir, name, command, dict(eval_tasks=eval_tasks, grids=CONTEST_GRIDS, cells=done))
    return path


# %% [markdown]
# `load_contest` reads the saved sums of every cell (the headline, depth and $L = 3$ control cells were measured
# first, into `contest_stats.json`, on 128 held-out tasks per run; the cells trained for the contest, as their
# training finished, into `contest_stats_sweep.json` and `contest_stats_sweep2.json`, on 64), and
# `contest_summary` fits and scores the candidates of one cell: on given fit seeds, or leaving one seed out at a time.

# %%
#| export
CONTEST_FILES = ("contest_stats.json", "contest_stats_sweep.json", "contest_stats_sweep2.json")   # the files `run_contest` wrote, in order

def load_contest(data_dir="nbs/data",       # folder of the files
                 names=CONTEST_FILES,       # the files to read (those missing are skipped)
                )->dict:                    # cells (name -> config, seeds, stats, wall_s) and provenance (file -> its provenance)
    "Every cell of the contest from its saved files."
    out = dict(cells={}, provenance={})
    for name in names:
        path = Path(data_dir) / name
        if not path.exists(): continue
        saved = json.loads(path.read_text())
        out["provenance"][name] = saved["provenance"]
        out["cells"].update({k: dict(v, file=name) for k, v in saved["cells"].items()})
    return out


# %%
#| export
def contest_summary(cell:dict,          # a cell of `load_contest`
                    fit_seeds=None,     # seeds to fit on (the others are scored); None: leave one seed out
                   )->dict:             # candidate -> fits, scores (name -> (seeds,) tensor) and the scored seeds
    "Fit and score every candidate of one cell, with the chapter's protocol."
    seeds = cell["seeds"]
    if fit_seeds is None: tab, scored = contest_table(cell["stats"]), seeds
    else:
        fit_on = [i for i, s in enumerate(seeds) if s in set(fit_seeds)]
        if not fit_on or len(fit_on) == len(seeds): raise ValueError("`fit_seeds` must name some, but not all, of the cell's seeds")
        tab, scored = contest_table(cell["stats"], fit_on=fit_on), [s for s in seeds if s not in set(fit_seeds)]
    return {k: dict(v, seeds=scored) for k, v in tab.items()}


# %%
#| export
def contest_winner(summary:dict,        # output of `contest_summary`
                   score:str="ratio",   # the score that decides (lower is better)
                  )->tuple:             # (winner, runner-up, mean paired difference runner-up - winner, its s.e., seeds where the winner is lower)
    "The candidate with the lowest mean score, and its paired margin over the runner-up."
    order = sorted(summary, key=lambda k: summary[k]["scores"][score].mean().item())
    a, b = (summary[k]["scores"][score] for k in order[:2])
    diff = b - a
    return order[0], order[1], diff.mean().item(), (diff.std() / math.sqrt(len(diff))).item(), int((a < b).sum())


# %%
_st = lambda y, u: dict(run=dict(Syy=1., Syp=0., Spp=1., Lmm=1., Lmy=0., Lmp=0., Lpp=0., B=1, msve=1.),
                        candidates=dict(v_pi=dict(Suu=[u] * 8, Syu=[y] * 8, Sup=[0.] * 8, Lmu=[0.] * 8, Luu=[0.] * 8, Lup=[0.] * 8)))
_cell = dict(seeds=[0, 1, 2], stats=[_st(0.5, 1.), _st(0.5, 1.), _st(0.5, 1.)])
_sum = contest_summary(_cell, fit_seeds=[0])
test_eq(_sum["v_pi"]["seeds"], [1, 2])
test_close(_sum["v_pi"]["scores"]["ratio"], torch.full((2,), 0.375, dtype=torch.float64), eps=1e-12)   # scale 0.5: (1 - 2 (0.5)(0.5) + 0.25) / (1 + 1)
test_fail(lambda: contest_summary(_cell, fit_seeds=[0, 1, 2]), contains="`fit_seeds` must name some")

# %% [markdown]
# A rate over seeds is reported with its exact (Clopper-Pearson) interval, `rate_interval` ([appendix J](statistics.html)):
# a property seen in 27 of 30 seeds is a rate of 0.9 with an interval, not an event asserted at "9 in 10".

# %%
test_eq(rate_interval(10, 10)[2], 1.)
test_close(rate_interval(10, 10)[1], 0.025 ** (1 / 10), eps=1e-9)          # P(X = 10) = p^10 = 0.025 at the lower end
test_close(rate_interval(0, 10)[2], 1 - 0.025 ** (1 / 10), eps=1e-9)
_r = rate_interval(27, 30)
assert _r[1] < 0.9 < _r[2] and _r[2] < 0.99, _r
test_fail(lambda: rate_interval(3, 2), contains="`k` must be an integer in [0, 2]")

# %% [markdown]
# ## The contest's interventions
#
# Chapter 6b tests the contest's winner by three interventions at test time: shuffled successors, contexts longer than
# in training, and the uniform layer's writes patched from another task. `seed_interventions` measures all three on
# one trained model, with every candidate's prediction from its frozen constants (`fits`, candidate -> its
# `fit_candidate`). Shapes are compared through the *change ratio*: the $d_\pi$-weighted squared difference between
# the model's and the candidate's change of centred values, over the model's own; the residual ratio of each
# candidate is recorded on the changed prompts too. The patch's level change is recorded as a slope: the output's
# mean change per unit change of the context-mean value $\bar R/(1-\gamma)$ from the task to its donor (the next task
# of the batch), fitted through the origin over the tasks.

# %%
#| export
INTERVENTION_LENGTHS = (30, 60, 120)   # context lengths read from one trajectory per task (the first is the training n)
PATCH_ROWS = ("tokens", "value", "all") # the patched rows: features and reward, the value row, every row

def _centred(d, v): return v - (d * v).sum(-1, keepdim=True)
def _wsq(d, v): return (d * v * v).sum().item()

def _changes(d, v_pi, y1, p1, y0, p0):
    "The model's change of shape, each candidate's predicted change, change ratio and residual ratio on the new prompts."
    dy, base = _centred(d, y1) - _centred(d, y0), _wsq(d, _centred(d, y0))
    dp = {k: _centred(d, p1[k]) - _centred(d, p0[k]) for k in p1}
    err = _wsq(d, _centred(d, y1) - _centred(d, v_pi))
    return dict(model=_wsq(d, dy) / base, predicted={k: _wsq(d, v) / base for k, v in dp.items()},
                change_ratio={k: _wsq(d, dy - v) / _wsq(d, dy) for k, v in dp.items()},
                ratio={k: _wsq(d, _centred(d, y1) - _centred(d, p1[k])) / err for k in p1})

def _setting(config, fits, eval_tasks):
    "The held-out tasks, contexts and prompts of a run, and the frozen candidates' predictions from any context."
    c = dataclasses.replace(config, eval_tasks=eval_tasks)
    tasks, states, Z = held_out_prompts(c)
    preds = lambda n, st: {k: candidate_prediction(k, f, dataclasses.replace(c, n=n), tasks, st) for k, f in fits.items()}
    return c, tasks, states, Z, preds

def shuffle_intervention(config:PretrainConfig, # the run's settings
                         model,                 # its trained model (anything with `predict(Z, n=)`)
                         fits:dict,             # candidate -> its `fit_candidate` (frozen constants)
                         eval_tasks:int=128,    # held-out tasks
                        )->dict:                # the model's change, each candidate's predicted change, change and residual ratios
    "Every context's states in a random order (`shuffle_context`): the model against the frozen candidates."
    c, tasks, states, Z, preds = _setting(config, fits, eval_tasks)
    s2 = shuffle_context(states, 1000 + c.seed)
    with torch.no_grad(): y0, y1 = model.predict(Z, n=c.n), model.predict(context_prompt(tasks, s2), n=c.n)
    return _changes(tasks.d_pi, tasks.v_pi, y1, preds(c.n, s2), y0, preds(c.n, states))

def lengthen_intervention(config:PretrainConfig, model, fits:dict, eval_tasks:int=128,
                          lengths=INTERVENTION_LENGTHS,  # context lengths, the first the reference
                         )->dict:                        # per length: residual ratios, MSVE of the model and of each candidate, changes from the first
    "One trajectory per task, read at every length of `lengths`: the model against the frozen candidates."
    c, tasks, _, _, preds = _setting(config, fits, eval_tasks)
    long = sample_trajectories(tasks.P, tasks.d_pi, n=max(lengths), seed=2000 + c.seed)
    ys, ps = {}, {}
    for L in lengths:
        with torch.no_grad(): ys[L] = model.predict(context_prompt(tasks, long[:, :L + 1]), n=L)
        ps[L] = preds(L, long[:, :L + 1])
    d, L0 = tasks.d_pi, lengths[0]
    out = {}
    for L in lengths:
        ch = _changes(d, tasks.v_pi, ys[L], ps[L], ys[L0], ps[L0]) if L != L0 else \
             dict(ratio={k: _wsq(d, _centred(d, ys[L]) - _centred(d, v)) / _wsq(d, _centred(d, ys[L]) - _centred(d, tasks.v_pi)) for k, v in ps[L].items()})
        out[str(L)] = dict(ch, msve=msve(ys[L], tasks).mean().item(), msve_candidates={k: msve(v, tasks).mean().item() for k, v in ps[L].items()})
    return out

def patch_intervention(config:PretrainConfig, model:SoftmaxICTD, eval_tasks:int=128,
                      )->dict:   # the uniform layer, its diagonalities, and per patched rows the level slope and the change of shape
    "The least selective layer's writes patched from the next task of the batch (`patched_predict`)."
    c = dataclasses.replace(config, eval_tasks=eval_tasks)
    tasks, states, Z = held_out_prompts(c)
    d = tasks.d_pi
    diag = learned_kernel(model, tasks).diagonal(dim1=-2, dim2=-1).mean((-2, -1))
    u, donor, D = int(diag.argmin()), torch.roll(torch.arange(len(tasks)), 1), model.d
    m = context_mean_values(tasks, states)[:, 0]
    x = m[donor] - m
    with torch.no_grad(): y0 = model.predict(Z, n=c.n)
    out = dict(uniform_layer=u, diagonality=diag.tolist())
    for key, rows in zip(PATCH_ROWS, (list(range(D + 1)), [D + 1], list(range(D + 2)))):
        y = patched_predict(model, Z, Z[donor], c.n, u, rows)
        dl = (d * (y - y0)).sum(-1)
        out[key] = dict(slope=((dl * x).sum() / (x * x).sum()).item(), shape=_wsq(d, _centred(d, y) - _centred(d, y0)) / _wsq(d, _centred(d, y0)))
    return out

def seed_interventions(config:PretrainConfig,  # the run's settings
                       model:SoftmaxICTD,      # its trained model
                       fits:dict,              # candidate -> its `fit_candidate` (frozen constants)
                       eval_tasks:int=128,     # held-out tasks
                      )->dict:                 # the three interventions' measures on this seed
    "Shuffled successors, longer contexts and the uniform layer patched from another task, measured on one trained model."
    p = patch_intervention(config, model, eval_tasks)
    return dict(seed=config.seed, uniform_layer=p.pop("uniform_layer"), diagonality=p.pop("diagonality"),
                shuffle=shuffle_intervention(config, model, fits, eval_tasks),
                lengthen=lengthen_intervention(config, model, fits, eval_tasks), patch=p)


# %% [markdown]
# Checks on a stand-in: with a "model" that *is* a candidate (level + TD iterates at a grid point), that candidate
# predicts every change exactly (change ratio 0) and scores a residual ratio of 0 on the changed prompts, and scaled
# $v_\pi$ predicts no change (change ratio 1). The patch needs a layered model and is checked in chapter 6b.

# %%
from ictd.mechanism import LearnedAlgorithm, candidate_prediction, context_prompt, grid_thetas


# %%
class _AsAlgorithm(torch.nn.Module):
    "A stand-in model whose output is a LearnedAlgorithm's, computed from the states written in the prompt."
    def __init__(self, algo, config): super().__init__(); self.algo, self.config = algo, config
    def predict(self, Z, n=None):
        tasks = held_out_prompts(self.config)[0]
        states = (Z[:, None, :4, :n + 1] - tasks.phi[..., None]).abs().sum(-2).argmin(-2)   # random features are distinct
        return self.algo.values(dataclasses.replace(self.config, n=n), tasks, states)

_c = dataclasses.replace(EMERGENCE, eval_tasks=6, seed=3)
_fits = dict(td=dict(index=grid_thetas("td").index(dict(beta=2., k=3)), level=0.4, scale=0.9), v_pi=dict(index=2, level=0.4, scale=0.7))
_stand = _AsAlgorithm(LearnedAlgorithm(k=3, beta=2., level=0.4, scale=0.9), _c)
test_fail(lambda: LearnedAlgorithm(k=2.5, beta=2., level=0.4, scale=0.9), contains="`k` must be an integer >= 0")
test_fail(lambda: LearnedAlgorithm(k=3, beta="2", level=0.4, scale=0.9), contains="`beta` must be a finite number")
_t, _s, _ = held_out_prompts(_c)
test_close(_stand.predict(context_prompt(_t, _s), n=30), candidate_prediction("td", _fits["td"], _c, _t, _s), eps=1e-12)
for _ch in [shuffle_intervention(_c, _stand, _fits, 6)] + list(lengthen_intervention(_c, _stand, _fits, 6, (30, 60)).values())[1:]:
    assert _ch["change_ratio"]["td"] < 1e-20 and _ch["ratio"]["td"] < 1e-20 and _ch["model"] > 1e-3, _ch
    test_close(torch.tensor(_ch["change_ratio"]["v_pi"]), torch.tensor(1.), eps=1e-12)


# %% [markdown]
# `run_contest_interventions` measures every scored seed of the headline cell (10 to 39), with the candidates fitted
# on seeds 0 to 9 as in the chapter, and writes `contest_interventions.json` (about a minute and a half of one CPU
# thread).

# %%
#| export
def run_contest_interventions(out_dir="nbs/data",     # folder of the JSON file
                              data_dir="nbs/data",    # folder of the saved runs and contest sums
                              eval_tasks:int=128,     # held-out tasks per seed
                              command:str="run_contest_interventions()",  # recorded in the file
                             )->Path:                 # the file written
    "The three interventions on every scored seed of the headline cell, with the candidates fitted on seeds 0-9."
    import time
    t0 = time.time()
    head = contest_summary(load_contest(data_dir)["cells"]["td, L = 3"], fit_seeds=range(10))
    fits = {k: v["fits"][0] for k, v in head.items()}
    runs = [(c, m) for c, m in contest_cells(data_dir)["td, L = 3"] if c.seed in set(head["td"]["seeds"])]
    seeds = [seed_interventions(c, m, fits, eval_tasks) for c, m in runs]
    return _write(out_dir, "contest_interventions.json", command,
                  dict(eval_tasks=eval_tasks, lengths=INTERVENTION_LENGTHS, fits=fits, seeds=seeds, wall_s=time.time() - t0))


# %% [markdown]
# ## Linear attention on the same contest
#
# Issue 30 asks whether "level + TD iterates" is specific to softmax attention: the same contest on chapter 7's
# linear-attention family at the same $(s, d, n, L, \gamma)$. `run_contest_linear` trains such models (`LINEAR_CONTEST`:
# the headline configuration with `attention="linear"` and the learning rate chapter 7b tuned for linear attention on
# this cell, `head_to_head.json`; at the softmax models' learning rate they do not learn) and measures the contest's sums
# on them, writing `contest_linear.json` (`ictd mechanism contest_linear --seeds 0-29 --out nbs/data`, appendix F). A
# linear model reads the transition prompt of Wang et al. (`build_linear_prompt`); `LinearOnStateTokens` rebuilds it
# from the state-token prompt, so that every candidate and score of the contest apply unchanged. Chapter 6b reads the
# file ([linear attention on the same contest](mechanism.html#linear-attention-on-the-same-contest)).

# %%
#| export
# the headline cell with chapter 7's linear attention, at the learning rate chapter 7b tuned for it on this very cell
# (`head_to_head.json`: tune seeds 100-102, lrs 1e-3 to 0.3; 1e-2, the softmax models' lr, did not learn)
LINEAR_CONTEST = dataclasses.replace(EMERGENCE, attention="linear", lr=3e-3)

class LinearOnStateTokens(torch.nn.Module):
    "A linear-attention model read through the state-token prompt: its transition prompt is rebuilt from the tokens."
    def __init__(self, model:torch.nn.Module,  # a linear-attention model with `.predict(Z, n=n)`
                 gamma:float,                  # the discount of the transition prompt
                ):
        super().__init__()
        self.model, self.gamma = check_type(model, torch.nn.Module, "model"), check_gamma(gamma)
    def predict(self, Z:torch.Tensor,  # (B, d+2, n+1+q) state-token prompt
                n:int,                 # context length
               )->torch.Tensor:        # (B, q) the linear model's values at the queries
        "The linear model's values at the query columns of a state-token prompt."
        from ictd.linear import build_linear_prompt
        d = Z.shape[-2] - 2
        ZL = build_linear_prompt(Z[..., :d, :n + 1].mT, Z[..., d, :n], Z[..., :d, n + 1:].mT, self.gamma)
        return self.model.predict(ZL, n=n)

def run_contest_linear(out_dir="nbs/data",               # folder of the JSON file
                       seeds=tuple(range(10)),           # seeds to train
                       config:PretrainConfig=LINEAR_CONTEST, # the configuration
                       eval_tasks:int=128,               # held-out tasks per run for the contest's sums
                       command:str="run_contest_linear()",  # recorded in the file
                      )->Path:                           # the file written
    "Train linear-attention models at the headline cell's settings and save their parameters and contest sums."
    import time
    import ictd.linear                                   # registers the family
    from ictd.mechanism import contest_stats
    t0 = time.time()
    runs, diverged = train_dropping_diverged(config, seeds)
    saved = [dict(config=dataclasses.asdict(r.config), params=dict(zip(("P", "Q"), (t.detach().tolist() for t in r.model.stacked_params()))),
                  msve=r.history["msve"][-1].tolist()) for r in runs]
    stats = [contest_stats(dataclasses.replace(r.config, eval_tasks=eval_tasks), LinearOnStateTokens(r.model, r.config.gamma)) for r in runs]
    cell = dict(config=dataclasses.asdict(dataclasses.replace(config, seed=0)), seeds=[r.config.seed for r in runs], stats=stats,
                runs=saved, diverged=diverged, wall_s=time.time() - t0)
    return _write(out_dir, "contest_linear.json", command, dict(eval_tasks=eval_tasks, grids=CONTEST_GRIDS, cells={"linear, L = 3": cell}))


# %% [markdown]
# A smoke check of the driver (two training steps, four tasks), and of the prompt rebuilt from the tokens against a
# linear prompt built directly:

# %%
import ictd.linear
from ictd.linear import LinearICTD, build_linear_prompt

# %%
_lt, _ls, _lZ = held_out_prompts(dataclasses.replace(LINEAR_CONTEST, eval_tasks=3))
_lm = LinearICTD(4, n_layers=3, shared=False, seed=1)
_rows = torch.arange(3)[:, None]
_direct = _lm.predict(build_linear_prompt(_lt.phi[_rows, _ls], _lt.r[_rows, _ls[:, :-1]], _lt.phi, 0.9), n=30)
test_close(LinearOnStateTokens(_lm, 0.9).predict(_lZ, n=30), _direct, eps=1e-12)
test_fail(lambda: LinearOnStateTokens("model", 0.9), contains="`model` must be a Module")
test_fail(lambda: LinearOnStateTokens(_lm, 1.5), contains="`gamma` must lie in [0, 1)")
with tempfile.TemporaryDirectory() as _tmp:
    _lin = json.loads(run_contest_linear(_tmp, (0,), dataclasses.replace(LINEAR_CONTEST, n_steps=2, eval_every=1, eval_tasks=4), 4).read_text())
_cell = _lin["cells"]["linear, L = 3"]
test_eq((_cell["seeds"], sorted(_cell["stats"][0]["candidates"])), ([0], sorted(CONTEST_GRIDS)))
test_eq(load_models(_cell["runs"])[0][1].predict(build_linear_prompt(_lt.phi[_rows, _ls], _lt.r[_rows, _ls[:, :-1]], _lt.phi, 0.9), n=30).shape, (3, 10))

# %% [markdown]
# ## Part 2: chapter 6b's probes and contest
#
# The functions chapter 6b's argument rests on, with their checks: the probes of a trained model (the centred value
# error, the value row after every layer, knockouts, writes, the learned kernel and chapter 5's condition), the fitted
# estimators, the Jacobians of the expected update, the shared-layer recursion, and the contest's candidates, sums,
# fits, scores and `fit_learned_algorithm`. They are exported to `ictd.mechanism` (the theory module of chapter 6b),
# although they are defined here, so that the lesson reads without them.

# %%
#| hide
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
from ictd.emergence import ALPHAS, BETAS, certainty_equivalence_values, context_mean_values, held_out_prompts, theta_star_model
import math
import numpy as np
from ictd.wstd import weighted_softmax_td
from ictd.tasks import random_tasks
from ictd.state_tokens import population_neu
from ictd.emergence import best_theta_star, neu_jackknife
from ictd.model import theta_star
from ictd.convergence import td_recursion
from ictd.mechanism import *
from ictd.mechanism import _wmean, _context

# %% [markdown]
# The checks run on a random three-layer model and eight held-out prompts of the headline configuration (the toy of
# chapter 6b's intervention checks):

# %%
toy = SoftmaxICTD(4, n_layers=3, init_gain=1., seed=3)
toy_tasks, toy_states, toy_Z = held_out_prompts(dataclasses.replace(EMERGENCE, eval_tasks=8))


# %% [markdown]
# ## Chapter 6b's probes
#
# The probes, estimators, Jacobians and the shared-layer recursion that chapter 6b uses, each with its
# checks (on the toy model and prompts of the interventions' checks, and on $\theta^*$).

# %%
#| export mechanism
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
#| export mechanism
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
#| export mechanism
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
star1 = SoftmaxICTD.from_theta_star(4, torch.eye(4, dtype=torch.float64), n_layers=2, alpha=1., gamma=0.9)
test_eq((row_writes(star1, toy_Z, 30)[:, :5] == 0).all(), True)


# %% [markdown]
# `knockout` removes one layer, either entirely (`"identity"`: $V^{\mathrm{cur}} = V^{\mathrm{tgt}} = 0$) or only its
# selectivity (`"uniform"`: $A = 0$, so the layer attends uniformly to the context and still writes). What the
# error loses under each says what the layer contributes, and whether its attention pattern matters.

# %%
#| export mechanism
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
#| export mechanism
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
#| export mechanism
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
# [its API entries and unit tests](#chapter-6bs-probes-api-entries-and-unit-tests)):

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
#| export mechanism
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
#| export mechanism
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
K_star = learned_kernel(SoftmaxICTD.from_theta_star(4, 2. * torch.eye(4, dtype=torch.float64), n_layers=3, alpha=1., gamma=0.9), kt)
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
#| export mechanism
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
kc = kernel_condition(SoftmaxICTD.from_theta_star(10, 50. * torch.eye(10, dtype=torch.float64), n_layers=2, alpha=1., gamma=0.9), random_tasks(4, seed=1, features="onehot"))
test_eq(kc["share_meeting"], [1., 1.])
test_close(torch.tensor(kc["span_td"]), torch.full((2,), 0.9, dtype=torch.float64), eps=1e-6)


# %%
#| export mechanism
def layer_anatomy(config:PretrainConfig,  # the run's settings
                  model:SoftmaxICTD,      # its trained model
                  t:float=0.5,            # weight moved by `swap_weights`
                 )->dict:                 # per layer (lists of L) probes, and the intact MSVE
    "Every per-layer probe of one trained model on its held-out prompts (knockouts as ratios of MSVE, and of centred MSVE under `centred_`)."
    tasks, states, Z = held_out_prompts(config)
    err = lambda m: msve(m.predict(Z, n=config.n).detach(), tasks).mean().item()
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
#| export mechanism
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
#| export mechanism
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
#| export mechanism
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
#| export mechanism
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
#| export mechanism
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
#| export mechanism
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
#| export mechanism
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
#| export mechanism
LOOKAHEAD_BETAS = (1., 2., 4., 6., 8., 12.)  # kernel scales tried for the lookahead

def _pooled(runs, target):
    "Held-out data of every run with the targets: the model's outputs, or v_pi."
    out = []
    for c, m in runs:
        tasks, states, Z = held_out_prompts(c)
        with torch.no_grad(): out.append((c, tasks, states, Z, m.predict(Z, n=c.n) if target == "model" else tasks.v_pi))
    return out


# %%
#| export mechanism
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
#| export mechanism
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
# known estimator, with zero prediction error, is checked in [its API entries and unit tests](#chapter-6bs-probes-api-entries-and-unit-tests).

# %%
#| export mechanism
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
            out.setdefault(f"{k}, MSVE", []).append(msve(p, tasks).mean().item())
        out.setdefault("trained, MSVE", []).append(msve(v, tasks).mean().item())
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in out.items()}


# %%
#| export mechanism
def gap_measures(config:PretrainConfig,  # the run's settings
                 model,                  # its trained model
                )->dict:                 # mean over held-out tasks of each measure
    "MSVE and centred MSVE of the model and of the baselines on a run's held-out tasks, with its final value weights."
    tasks, states, Z = held_out_prompts(config)
    with torch.no_grad(): v = model.predict(Z, n=config.n)
    preds = {"trained": v, "context mean": context_mean_values(tasks, states), "certainty equivalence": certainty_equivalence_values(tasks, states),
             "best constant": (tasks.d_pi * tasks.v_pi).sum(-1, keepdim=True).expand_as(tasks.v_pi)}
    out = {f"msve {k}": msve(p, tasks).mean().item() for k, p in preds.items()}
    out.update({f"cmsve {k}": centred_msve(p, tasks).mean().item() for k, p in preds.items()})
    out["value_weights"] = model.value_weights().tolist()
    return out


# %% [markdown]
# Both are derivatives of the model's values with respect to its flattened parameters, so the private <code>_values_fn</code>
# first writes the values as a function of one flat vector: at $n = \infty$ through the population tokens, or with
# given contexts through the model's own forward pass.

# %%
#| export mechanism
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
#| export mechanism
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
#| export mechanism
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
        out.append(update_jacobian(model, sub, sample_trajectories(sub.P, sub.d_pi, n=n, seed=gen)))
    return torch.stack([g for g, _ in out]), torch.stack([J for _, J in out])


# %% [markdown]
# Fewer than three batches leave no error bar, and are refused:

# %%
test_fail(lambda: sampled_jacobians(toy, toy_tasks, 30, n_batches=2), contains="`n_batches` must be an integer >= 3")


# %% [markdown]
# `jacobian_spectrum` reads stability off the draws: the spectrum of the mean Jacobian, with delete-one jackknife
# standard errors over the batches when there are several.

# %%
#| export mechanism
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
#| export mechanism
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
_shared_star = SoftmaxICTD.from_theta_star(4, 2. * torch.eye(4, dtype=torch.float64), n_layers=1, alpha=0.7, gamma=0.9, shared=True)
_st = random_tasks(3, seed=11)
_rec = shared_recursion(_shared_star, _st, 6)
test_close(_rec, td_recursion(learned_kernel(_shared_star, _st)[0], _st.P, _st.r, gamma=0.9, alpha=0.7, n_iters=6).movedim(-2, 0), eps=1e-12)
_m6 = get_family("softmax").module(dataclasses.replace(EMERGENCE, n_layers=6, shared=True), {k: v[0] for k, v in model_params(_shared_star).items()})
test_close(population_predict(_m6, _st), _rec[6], eps=1e-12)


# %% [markdown]
# `iterate_shared` runs a trained shared layer $K$ times for each depth asked, and measures the held-out MSVE at the
# training context and at $n = \infty$ beside the recursion's prediction: the measurement of the result below.

# %%
#| export mechanism
def iterate_shared(config:PretrainConfig,  # the run's settings (shared=True)
                   model:SoftmaxICTD,      # its trained model
                   depths,                 # the depths K to measure
                  )->dict:                 # per depth: held-out MSVE at n = config.n, at n = infinity, and of the recursion's prediction
    "The learned shared layer iterated K times: measured MSVE at the training context and at n = infinity, and chapter 5's prediction."
    tasks, _, Z = held_out_prompts(config)
    params = {k: v[0].double() for k, v in model_params(model).items()}
    pred = shared_recursion(model, tasks, max(depths))
    out = dict(depth=list(depths), msve_n=[], msve_inf=[], msve_predicted=[msve(pred[K], tasks).mean().item() for K in depths])
    for K in depths:
        m = get_family(config.attention).module(dataclasses.replace(config, n_layers=K), params)
        with torch.no_grad():
            out["msve_n"].append(msve(m.predict(Z, n=config.n), tasks).mean().item())
            out["msve_inf"].append(msve(population_predict(m, tasks), tasks).mean().item())
    return out


# %% [markdown]
# ## Chapter 6b's probes: API entries and unit tests
#
# The probes, the estimator, the Jacobian and the shared-layer recursion above are exported to `ictd.mechanism`.
# The functions that save and load runs, build chapter 6b's tables, compute its statistics and apply the stopping
# rule, and the drivers that trained every saved file, are in `ictd.experiments.mechanism`, part 1 of this page. What
# follows are the API entries of the probes and their unit tests: input checks, a fit that recovers a known estimator,
# and the Jacobian against finite differences.

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
jm = SoftmaxICTD(2, n_layers=2, init_gain=0.5, seed=6)
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
# ## Chapter 6b's contest
#
# The contest's candidates, their grids, the sums from which fits and scores follow, and the fitted winner
# `fit_learned_algorithm`. Each candidate is $\hat v(x) = \lambda\, \bar R/(1-\gamma) + \sigma\, u_\theta(x)$: a
# level coefficient $\lambda$ on the context-mean value, a scale $\sigma$ and one point $\theta$ of its grid.

# %%
#| export mechanism
def _context(tasks, states):
    "Rewards R_1..R_n and the features of S_0..S_n of each task's context."
    rows = torch.arange(len(tasks))[:, None]
    return tasks.r[rows, states[:, :-1]], tasks.phi[rows, states]

def _td_candidate(tasks, states, k_max, beta):
    "(k_max, B, s): iterates 1..k_max of weighted softmax TD (alpha = 1, W = beta I) at every state."
    R, phi = _context(tasks, states)
    W = beta * torch.eye(phi.shape[-1], dtype=phi.dtype)
    v = weighted_softmax_td(phi, R, W, alpha=1., gamma=tasks.gamma, n_iters=k_max, phi_queries=tasks.phi, return_all=True)
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
#| export mechanism
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
#| export mechanism
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
#| export mechanism
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
                        Lmy=(m * my).sum().item(), Lmp=(m * mp).sum().item(), Lpp=(mp * mp).sum().item(), B=len(tasks), msve=msve(y, tasks).mean().item()),
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
#| export mechanism
from ictd.core import check_int, check_number

@dataclasses.dataclass
class LearnedAlgorithm:
    "The algorithm a set of trained models is found to run: a level plus k iterates of weighted softmax TD, $\\hat v = \\lambda \\bar R/(1-\\gamma) + \\sigma\\, v_k$."
    k:int          # number of TD iterates (from v_0 = 0)
    beta:float     # kernel scale: scores beta phi(x)^T phi(S_j)
    level:float    # level coefficient lambda on the context-mean value R-bar / (1 - gamma)
    scale:float    # scale sigma of the iterates
    alpha:float=1. # TD step size (fixed at 1: the scale absorbs a common factor)

    def __post_init__(self):
        "`k` an integer >= 0 and the other fields finite numbers, or a `ValueError` naming the field."
        self.k = check_int(self.k, "k")
        for name in ("beta", "level", "scale", "alpha"): setattr(self, name, check_number(getattr(self, name), name))

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
        v = weighted_softmax_td(phi, R, self.beta * torch.eye(phi.shape[-1], dtype=phi.dtype), alpha=self.alpha, gamma=tasks.gamma, n_iters=self.k, phi_queries=tasks.phi)
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


# %% [markdown]
# ## Part 3: further measurements
#
# How the models of chapter 6b implement the algorithm that wins its contest, and what else was measured on them: the
# centred value error, the anatomy of the trained models layer by layer, chapter 5's condition, the value row probed
# by the earlier estimators, the controls, and five further experiments (training to convergence, more layers, the
# dynamics at $\theta^*$, an iterated shared layer, the gap map). They were the body of chapter 6b before its contest;
# the lesson now states the algorithm and its evidence, and links here. Every number comes from the saved runs under
# `nbs/data/`, as there.

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
# The ten models the anatomy probes (seeds 0 to 9 of the headline cell) and all forty of the headline cell, with the position of their uniform layer:

# %%
saved = json.loads(Path("data/mechanism_runs.json").read_text())
fit_runs, fresh_runs = load_models(saved["runs"]["fit"]), load_models(saved["runs"]["fresh"])
new_runs = load_models(json.loads(Path("data/contest_runs.json").read_text())["cells"]["headline"]["runs"])
head_models = fit_runs + fresh_runs + new_runs                     # seeds 0 to 39 of the headline cell
prompts = lambda c: held_out_prompts(dataclasses.replace(c, eval_tasks=32))[0]
head_diag = torch.stack([learned_kernel(m, prompts(c)).diagonal(dim1=-2, dim2=-1).mean((-2, -1))
                         for c, m in head_models])
Markdown(provenance_note(saved["provenance"], "The saved runs"))

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
# `centred_msve` computes it (defined, with its checks, in [part 2](#part-2-chapter-6bs-probes-and-contest)).

# %% [markdown]
# ## The anatomy of a trained model
#
# Before comparing the models with any algorithm, we look at what each of their three layers does:
# which rows of the tokens it writes, how selective its attention is, and what is lost when it is
# knocked out. The probes are functions of a model, defined here with a check each.

# %% [markdown]
# The probes are functions of a model, each defined with a check in [part 2](#part-2-chapter-6bs-probes-and-contest):
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
#| fig-cap: "Figure D.1: in nearly every trained model one layer, a different one across seeds, attends almost uniformly and writes nearly the same number at every state of a task; the other layers attend selectively and most of them write state-dependent corrections."
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
         f"$1/s = 0.1$ (bold in the tables, left of the dashed line in Figure D.1; population diagonality below {UNIFORM_BELOW}); over all {len(head_models)} seeds of the "
         f"headline cell the rate is {u_rate[0]:.2f} (95% interval {u_rate[1]:.2f} to {u_rate[2]:.2f}), and which layer it is varies from seed to seed "
         f"(layer 1, 2, 3 in {u_pos[1]}, {u_pos[2]}, {u_pos[3]} seeds), so no claim about a fixed layer position can hold. That layer's value-row write is nearly the same number at every state of a task "
         f"(constancy at least {anat['uniform_constancy_min']:.3f}, {cons_txt}): it adds "
         f"a context-wide baseline, a weighted sum of the context's mean reward and mean values. Making it uniform changes the error by at most "
         f"{anat['uniform_knockout_max']:.1%} (it already is uniform), and moving weight $\\Delta a = 1/2$ between its successor and current heads changes the error by at most "
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
star_cond = {b: kernel_condition(SoftmaxICTD.from_theta_star(4, b * torch.eye(4, dtype=torch.float64), n_layers=1, alpha=1., gamma=0.9), held_out_prompts(fit_runs[0][0])[0])
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
# The estimators and their fits are defined, with checks, in [part 2](#part-2-chapter-6bs-probes-and-contest): `lookahead_features` (the context mean
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
# An earlier version of chapter 6b compared these estimators by fitting each, pooled over seeds 0 to 9, to the models'
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
# `CONVERGE_TOLERANCES`, and `settled_step` applies the rule (both in [part 1](#the-stopping-rule), with a check on
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
#| fig-cap: "Figure D.2: after thousands of steps the diagonality has stopped moving at some learning rates, but the value weights have not at any rate; below 1 a metric has stopped moving."
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
         f"the value weights' statistic stays above it at every rate, still falling slowly (Figure D.2). The MSVE statistic stays above its tolerance at every "
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
# finite differences in [its API entries and unit tests](#chapter-6bs-probes-api-entries-and-unit-tests).

# %% [markdown]
# `update_jacobian` computes $(G, J_G)$ exactly, at $n = \infty$ or at given contexts; `sampled_jacobians`
# draws batches of stationary contexts at $n = 30$ so that the spread between batches gives an error bar; and
# `jacobian_spectrum` reads stability off the draws, with delete-one jackknife errors (all in [part 2](#part-2-chapter-6bs-probes-and-contest)).

# %% [markdown]
# At the training configuration, on held-out tasks, at $\theta^*(W = I, \alpha = 1)$ (the
# construction of Definition 3.1) and at the best-fit $\theta^*$ of the emergence chapter's grid:

# %%
star_points = {"theta* (beta 1, alpha 1)": (1., 1.)} | {"best-fit theta* (beta {1:g}, alpha {0:g})".format(*best_theta_star(EMERGENCE)): best_theta_star(EMERGENCE)[::-1]}
jac_tasks = held_out_prompts(dataclasses.replace(EMERGENCE, eval_tasks=8, seed=1000))[0]
at_star = {}
for name, (beta, alpha) in star_points.items():
    g, J = update_jacobian(SoftmaxICTD.from_theta_star(4, beta * torch.eye(4, dtype=torch.float64), n_layers=3, alpha=alpha, gamma=0.9), jac_tasks)
    ev = torch.linalg.eigvals(J)
    neu30, neu30_se = neu_jackknife(SoftmaxICTD.from_theta_star(4, beta * torch.eye(4, dtype=torch.float64), n_layers=3, alpha=alpha, gamma=0.9), held_out_prompts(EMERGENCE)[0], 30, n_batches=32, batch_size=64, seed=5)
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
#| fig-cap: "Figure D.3: training started at either theta* moves away from it: the value error, the expected-update norm and the last current-value weight all leave their starting values."
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
    star = torch.stack([torch.stack(theta_star(4, c.init_beta * torch.eye(4, dtype=torch.float64), alpha=c.init_alpha, gamma=c.gamma))] * c.n_layers)   # (L, 3, D, D)
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
# prediction (both in [part 2](#part-2-chapter-6bs-probes-and-contest), with a check against chapter 5's `td_recursion`).

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
#| fig-cap: "Figure D.4: a learned shared layer is tuned to its training depth: iterated further, its value error grows without bound, and chapter 5's recursion with the learned kernel diverges too, more slowly."
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
# ### Claims of the further measurements
#
# Each experiment of this part has one primary claim; its other claims are secondary and corrected together, per
# experiment, with Holm's procedure, as in chapter 6b's
# [claims and multiplicity](mechanism.html#claims-and-multiplicity).

# %%
z_max_p = lambda zs: max(normal_greater(z) for z in zs)
paired_z = lambda x: (x.mean() / (x.std() / math.sqrt(len(x)))).item()   # a paired difference in units of its s.e.
families = {
    "anatomy (seeds 0-9)": dict(primary=("one layer keeps uniform attention", binomial_greater(anat["one_uniform_layer"], anat["n_seeds"])),
                                secondary={}),
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
}
Markdown(claims_table(families))

# %%
for exp, f in families.items():
    record_claim(exp.split(" (")[0].replace(" ", "-"), f"{f['primary'][0][0].upper()}{f['primary'][0][1:]} ({exp}; one-sided p {'< 1e-6' if f['primary'][1] < 1e-6 else '= ' + format(f['primary'][1], '.2g')}).",
                 "measured" if f["primary"][1] < 0.05 else "partial", "mechanism_studies", "#claims-of-the-further-measurements")
ctrl_adj = holm(families["controls"]["secondary"])
within = [f"{meas}: TD more often than {k}" for meas, ps in ctrl_tests.items() for k, p in ps.items() if p < 0.05]
lost, kept = [k for k in within if ctrl_adj[k] >= 0.05], [k for k in within if ctrl_adj[k] < 0.05]
sel_kept = [k for k in ctrl_z if ctrl_adj[f"pattern, last selective layer: TD more often than {k}"] < 0.05]
Markdown(f"Every primary claim of the further measurements holds at the 0.05 level: {all(f['primary'][1] < 0.05 for f in families.values())}. Corrected together, the controls "
         f"experiment's secondary claims keep {sum(p < 0.05 for p in ctrl_adj.values())} of {len(ctrl_adj)}: "
         f"{'; '.join(k for k, p in ctrl_adj.items() if p < 0.05) or 'none'}. Of the count differences between TD and the controls that are significant within "
         f"their own measure in the controls section, {'; '.join(lost) or 'none'} {'is' if len(lost) == 1 else 'are'} not significant once all the experiment's "
         f"secondary claims are corrected together, and {'; '.join(kept) or 'none'} {'stays' if len(kept) == 1 else 'stay'} significant.")

# %% [markdown]
# ### What the further measurements show
#
# Generated from the outputs above:

# %%
uniform_other = ", ".join(f"{k}: {int(g['one uniform layer'].sum())}/10" for k, g in gamma_full.items())
Markdown(f"1. **The layers.** In {anat['one_uniform_layer']} of 10 seeds one layer keeps uniform attention and writes a state-blind baseline; this happens at "
         f"$\\gamma = 0.9$, and rarely at the other discounts measured ({uniform_other}; "
         f"in at most {max(c['one_uniform'] for c in gap_claims.values() if c['gamma'] == 0.5)} of 10 seeds at $\\gamma = 0.5$). The sign pattern lives in the last *selective* layer.\n"
         f"1. **Chapter 5's condition.** No layer of any trained model meets it (largest minimum diagonal {cond['min_diagonal'].max():.3f} against "
         f"{conditions[0]['threshold']:.2f}), but neither does $\\theta^*$ itself with these features at $\\beta \\le 15$: the result is forced by the features.\n"
         f"1. **Where TD structure matters.** The trained models learn part of the value shape in every cell of the gap map, and beat the oracle constant on MSVE "
         f"only where shape carries enough of the error ({'; '.join(beat)}).\n"
         f"1. **What is specific to TD.** More value shape than Monte-Carlo, supervised or temporally shuffled training; not a lower MSVE than Monte-Carlo or supervised training; a sign pattern in the "
         f"last selective layer that, once the experiment's secondary claims are corrected together, is significantly more frequent than under "
         f"{' and '.join(ctrl_names[k] for k in sel_kept) or 'none of the controls'}"
         f"{'' if len(sel_kept) in (0, len(ctrl_z)) else ', and not than under ' + ' and '.join(ctrl_names[k] for k in ctrl_z if k not in sel_kept)}.\n"
         f"1. **Dynamics.** $\\theta^*$ is not a rest point of the mean TD dynamics at this configuration (NEU {at_star['theta* (beta 1, alpha 1)']['neu']:.3g}, "
         f"{at_star['theta* (beta 1, alpha 1)']['n_unstable']} of {at_star['theta* (beta 1, alpha 1)']['n_params']} Jacobian eigenvalues with positive real part), "
         f"and training started there leaves it; it is not a rest point at the training context $n = 30$ either, so it is neither stable nor unstable. Near it the "
         f"mean update grows in some directions (largest real part of a Jacobian eigenvalue at $n = 30$: "
         f"{jac30['theta* (beta 1, alpha 1)']['max_real']:.3f} ± {jac30['theta* (beta 1, alpha 1)']['max_real_se']:.3f} at $\\theta^*(W = I, \\alpha = 1)$, "
         f"{jac30[fit_start]['max_real']:.3f} ± {jac30[fit_start]['max_real_se']:.3f} at the best fit).\n"
         f"1. **A learned shared layer** is tuned to its training depth: iterated further, its error grows without bound (smallest at $T = 3$ in "
         f"{sum(K == 3 for K in best_K)} of 10 seeds), consistent with its learned effective discount above 1; chapter 5's value-row recursion does not reproduce it "
         f"quantitatively.\n"
         f"1. **Convergence** ({len(conv)} learning rates, {max(c['steps'][-1] for c in conv.values())} steps): {settled_txt}; where the measures are taken, one uniform "
         f"layer in {conv_counts['0.01']['one_uniform']} of 10 seeds at the emergence chapter's learning rate.\n"
         f"1. **Deeper models** (12 and 16 separate layers) at the emergence chapter's learning rate blow up in "
         + " and ".join(f"{blown[k]} of {n_deep[k]} seeds at {k}" for k in deep_msve) + f".\n\nThe gap map covers {len(gaps)} cells.")

# %%
#| export
from ictd.boyan import check_arguments
check_arguments(globals())   # every public function refuses, naming it, an argument its annotation rules out (chapter 0)

# %%
#| export mechanism
from ictd.boyan import check_arguments
check_arguments(globals())   # every public function refuses, naming it, an argument its annotation rules out (chapter 0)

# %%
#| hide
import nbdev; nbdev.nbdev_export()
