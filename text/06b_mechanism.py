# %%
#| default_exp mechanism

# %%
#| export
from __future__ import annotations
import copy, dataclasses, datetime, json, math, subprocess, sys
from pathlib import Path
import torch
from ictd.model import SoftmaxICTD
from ictd.tasks import TaskBatch
from ictd.convergence import span_rate
from ictd.pretrain import EMERGENCE, PretrainConfig, get_family, model_params, population_tokens, pretrain_many, token_layers
from ictd.emergence import certainty_equivalence_values, context_mean_values, held_out_prompts, msve_of, sign_pattern

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *

# %%
#| hide
import matplotlib.pyplot as plt
from IPython.display import Markdown

# %% [markdown]
# # What the trained models compute
# > Per-layer probes, knockouts and the learned kernels of pretrained softmax Transformers, an explicit in-context estimator that predicts them on seeds it was not fitted on, and the chapter-5 condition checked on the trained models.

# %% [markdown]
# Placeholder introduction.

# %% [markdown]
# ## Saved runs, with their provenance
#
# Training is slow for this page, so the runs it studies are trained by `run_mechanism_study`
# and saved under `nbs/data/` with the command, the git commit and the date that made them. A
# saved run holds the configuration, the seed and the final parameters; the models are rebuilt
# from them exactly.

# %%
#| export
def provenance(command:str,  # the command that produced the file
              )->dict:       # command, git commit, UTC date, Python and torch versions
    "What a saved result records about how it was made."
    try: commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError): commit = "unknown"
    return dict(command=command, commit=commit, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                python=sys.version.split()[0], torch=torch.__version__)

def save_runs(results:list,  # `PretrainResult`s
             )->list:        # one dict per run: config, seed, params (nested lists), final history metrics
    "Runs as plain JSON-ready dicts: configuration and final parameters."
    out = []
    for r in results:
        p = model_params(r.model)
        out.append(dict(config=dataclasses.asdict(r.config), params={k: v[0].tolist() for k, v in p.items()},
                        final={k: r.history[k][-1].tolist() for k in ("msve", "neu_population", "diagonality", "value_weights")}))
    return out

def load_models(runs:list,  # output of `save_runs` (e.g. read from a JSON file)
               )->list:     # (PretrainConfig, model) per run
    "Rebuild each saved run's configuration and trained model."
    out = []
    for r in runs:
        c = PretrainConfig(**r["config"])
        out.append((c, get_family(c.attention).module(c, {k: torch.tensor(v, dtype=torch.float64) for k, v in r["params"].items()})))
    return out

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

# %%
#| export
def centred_msve(v_hat:torch.Tensor,  # (B, s) value estimates of each task
                 tasks:TaskBatch,     # the tasks
                )->torch.Tensor:      # (B,) the d_pi-weighted error of the centred estimate against the centred v_pi
    "Value error after removing each task's $d_\\pi$-weighted mean from the estimate and from $v_\\pi$: the error in the value *shape*."
    if v_hat.shape != tasks.v_pi.shape: raise ValueError(f"`v_hat` must have shape {tuple(tasks.v_pi.shape)}, got {tuple(v_hat.shape)}")
    centre = lambda v: v - (tasks.d_pi * v).sum(-1, keepdim=True)
    return (tasks.d_pi * (centre(v_hat) - centre(tasks.v_pi)).square()).sum(-1)

# %%
show_doc(centred_msve)

# %%
from ictd.tasks import random_tasks
ct = random_tasks(32, seed=5)
floor = (ct.d_pi * (ct.v_pi - (ct.d_pi * ct.v_pi).sum(-1, keepdim=True)).square()).sum(-1)
test_close(centred_msve(torch.full_like(ct.v_pi, 3.), ct), floor, eps=1e-12)
test_close(centred_msve(ct.v_pi + 7., ct), torch.zeros(32, dtype=torch.float64), eps=1e-12)
test_close(centred_msve(2 * ct.v_pi, ct), floor, eps=1e-12)
test_fail(lambda: centred_msve(ct.v_pi[:, :3], ct), contains="`v_hat` must have shape")

# %% [markdown]
# ## Drivers of the slow experiments

# %%
#| export
def _write(out_dir, name:str, command:str, payload:dict)->Path:
    path = Path(out_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(provenance=provenance(command), **payload)))
    return path

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
# The gap map: where does a trained model know more than the value level?

# %%
#| export
GAP_GRID = dict(n=(30, 300), features=("random", "onehot"), gamma=(0.5, 0.9))  # the grid of the gap map (n_states 10), plus n_states 20 at the base

def gap_configs(base:PretrainConfig=EMERGENCE,  # the settings every cell shares
                grid:dict=GAP_GRID,              # field -> values
               )->list:                          # the configurations of the gap map
    "Every cell of the gap map's grid, and one cell with twice the states at the base."
    import itertools
    cells = [dict(zip(grid, v)) for v in itertools.product(*grid.values())] + [dict(n_states=2 * base.n_states)]
    fix = lambda c: dict(c, d=c.get("n_states", base.n_states)) if c.get("features") == "onehot" else c
    return [dataclasses.replace(base, **fix(c)) for c in cells]

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

def run_gap_map(out_dir="nbs/data",              # folder of the JSON file
                seeds=tuple(range(10)),          # seeds of every cell
                configs:list=None,               # default `gap_configs()`
                command:str="run_gap_map()",     # recorded in the file
               )->Path:                          # the file written, `mechanism_gap_map.json`
    "Train every cell of the gap map over `seeds` and save the measures of every run."
    cells = []
    for c in (configs or gap_configs()):
        runs = pretrain_many(c, list(seeds), progress=False)
        cells.append(dict(config=dataclasses.asdict(c), runs=[dict(seed=r.config.seed, diagonality=r.history["diagonality"][-1].tolist(),
                                                                   **gap_measures(r.config, r.model)) for r in runs]))
    return _write(out_dir, "mechanism_gap_map.json", command, dict(cells=cells))

# %%
#| hide
import nbdev; nbdev.nbdev_export()
