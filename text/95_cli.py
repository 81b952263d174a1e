# %%
#| default_exp cli

# %%
#| export
from __future__ import annotations
import argparse, json, math, sys, time
from dataclasses import asdict, fields, replace
from pathlib import Path
from fastcore.docments import docments
import numpy as np
import torch
from ictd.boyan import check_gamma, plot_chain, random_boyan_chain
from ictd.experiments.convergence import (depth_experiment, diagonality_sweep, leaky_experiment, loglog_slope, phase_diagram, plot_depth,
                                          plot_diagonality, plot_floor, plot_leaky, plot_phase, plot_rates, rate_experiment)
from ictd.experiments.continuous import continuous_full_scale as continuous_experiments
from ictd.linear import ICLR_LINEAR
from ictd.experiments.linear import (plot_linear_pretraining, plot_side_by_side, plot_tuned_side_by_side, reproduce_iclr, side_by_side,
                                     tuned_side_by_side)
from ictd.experiments.head_to_head import run_head_to_head
from ictd.experiments.emergence import ABLATION_BASE, emergence_report, run_ablations, save_ablations
from ictd.experiments.mechanism import (CONVERGE_LRS, DEEP_DEPTHS, run_contest, run_contest_linear, run_contest_runs, run_control_study, run_converge_study, run_depth_sweep, run_jacobian_study, run_shared_study, run_gap_map, run_mechanism_study, run_theta_star_dynamics)
from ictd.core import atomic_savefig, atomic_write_text, check_device, jsonable, provenance, save_checked, tensors_only
from ictd.engine import DTYPES, FAMILIES, INITS, OBJECTIVES, PROTOCOLS, PretrainConfig, load_plugins, training_dtype
from ictd.pretrain import plot_emergence, pretrain_many, run_folder
from ictd.sweep import expand_spec, load_spec, measure_overheads, run_sweep, start_client, stop_client, write_sweep

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *

# %%
#| hide
import contextlib, io, tempfile
import matplotlib.image
from IPython.display import Image, Markdown
from fastcore.xtras import working_directory
from ictd.core import load_checked

# %% [markdown]
# # The command line
# > `ictd`: one command per experiment of the book, at full scale, writing figures and numbers to a folder.

# %% [markdown]
# The chapters run their experiments at sizes that execute in seconds, and mark the full-scale
# versions `#| slow`. Installing the package (`pip install -e .`) also installs a command, `ictd`,
# that reruns each experiment at the full scale, without a notebook:
#
# | command | what it reproduces | results |
# |---|---|---|
# | `ictd chain` | a random Boyan chain (chapter 0) | `chain.png`, `chain.json` |
# | `ictd convergence` | the experiments of chapter 5a: error against depth, the floor against $n$, kernel diagonality against $\beta$, the phase diagram, measured rate against the bound, the leaky regime | `convergence-{depth,floor,floor-bound,diagonality,rates,leaky}.png`, one `convergence-phase-{features}-gamma{discount}.png` per feature kind and discount, `convergence.pt`, `convergence.json` |
# | `ictd pretrain` | the emergence of the TD construction in pretraining (chapters 6 and 6a): every seed in one batched run, and chapter 6a's report over the seeds (`--seeds 0-29` for 30) | in `{key}/`: `config.json`, `seed-{S}.pt`, `seed-{S}.png`, `seed-{S}.json`, `summary.json`, `summary.png`; in `{key}/emergence/`: `bands.png`, `parameters.png`, `summary.json`, `summary.md` (per-layer statistics, baselines, claim counts) |
# | `ictd linear` | linear against softmax attention, MSVE against depth (chapter 7): untuned, and each method tuned on shared features; with `--reproduce-seeds 0-29`, the predecessor's pretraining experiment | `linear.png`, `linear-tuned.png`, `linear.pt`, `linear.json`, (`iclr-linear.json`, `iclr-linear.png`, `iclr-linear-entries.png`) |
# | `ictd continuous` | chapters 8-8b: kernel TD on continuous states (depth, context length, bandwidth, linear TD) and pretraining on continuous families | `depth.png`, `tradeoff.png`, `estimates.png`, `long_depth.png`, `pretrain_*.png`, `kernel_*.png`, `results.json` |
# | `ictd ablations` | chapter 6a's four ablations (discount, features, context length, shared depth) over `--seeds` | `emergence_ablations.json`: every run's configuration and evaluation history, with the command, commit, date and CPU (the chapter reads it from `nbs/data/`) |
# | `ictd mechanism STUDY` | chapter 6b's slow studies (`runs`, `gap`, `controls`, `dynamics`, `gamma`, `depth`, `deep`, `converge`, `shared`, `jacobian`, and the contest's `contest_runs` and `contest`), trained through the engine | `mechanism_{study}.json` with the command, commit and date that made it (the chapter reads these from `nbs/data/`) |
# | `ictd sweep SPEC` | a grid of pretraining configurations times seeds from a spec file (appendix G), here or on a Dask cluster (`--cluster local:N`, `--scheduler ADDRESS`); each cell cached as `ictd pretrain` caches it | in `sweep-{name}/`: `sweep.json`, `sweep.csv`, `sweep.png`; the cells' runs in `{key}/` |
# | `ictd all` | all of the above but `mechanism` and `sweep`, with their defaults | all of the above |
#
# Every command takes `--out DIR` (default `./ictd-results`) and prints the path of each file it
# writes. The `.json` files hold summary numbers, readable by anything; the `.pt` files hold every
# tensor, as tensors and plain containers only, for `torch.load(path, weights_only=True)` (which runs no
# pickled code), with the sha256 of each beside it in `<name>.pt.sha256` (`sha256sum -c` checks it). Every
# file is written whole to a temporary file and then moved onto its name, so a command killed half-way,
# or stopped by a full disk, leaves the files it had finished and no half-written one. Pretraining writes into one folder per
# configuration, named by a hash of every setting but the seed, of the package version and of the
# package's source code (`config.key()`), with the configuration in `config.json`; it never touches another
# configuration's files. Each seed's run is cached there (`seed-{S}.pt`, read back with
# `weights_only=True`), so running the same configuration again loads the seeds it has and trains
# only the others; `--force` retrains, and a run interrupted after a checkpoint resumes from it. A cached
# file that is damaged (cut short, a bit flipped, its checksum missing) is recomputed, with a line saying so,
# and an empty or damaged `config.json` is rewritten.

# %% [markdown]
# ## A first session
#
# In a terminal, after `pip install -e .` (each line below is also run, at a tiny size, in the
# [last section](#implementation-and-tests), which checks what it writes):
#
# ```sh
# ictd chain --seed 3 --out results          # a random Boyan chain: results/chain.png, results/chain.json
# ictd linear --n-tasks 4 --n 30 --depth 8 --out results   # chapter 7's comparison, tiny
# ictd pretrain --seeds 0-1 --n-steps 20 --eval-every 10 --n-tasks 32 --eval-tasks 8 --out results
#                                            # two seeds trained together, their figures and summary
# ictd linear --alpha 0                      # a bad value: stops before anything runs, naming the option
# ```
#
# The rest of this chapter measures the engine's speed, says what the full-scale runs cost, and
# then, under *Implementation and tests*, builds the parser and the commands and checks them.

# %% [markdown]
# ## Speed: the benchmark
#
# `make bench` (`bench/bench_engine.py`) measures the pretraining engine of chapter 6 against two
# unbatched loops in one run and writes `bench/results.json`; the tables below are read from that
# file. Times are CPU seconds of the benchmark's process on one thread: on a busy machine they are
# what the same work takes on an idle core, while wall-clock times grow with the load (both are in
# the file, with the load average). The book's reference protocol (chapter 6's default `PretrainConfig()`: 30 seeds of 6000 steps, an
# evaluation of every metric every 250 steps on 256 held-out tasks) is extrapolated from the
# measured seconds per step, per evaluation and for the set-up (task pools, held-out sets).

# %%
bench_file = Path("../bench/results.json")
bench = json.loads(bench_file.read_text()) if bench_file.exists() else None
def table(header, rows): return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(map(str, r)) + " |" for r in rows])
def bench_report(b):
    steps = table(["loop", "CPU ms per seed-step", "speed-up over (a), CPU", "wall ms per seed-step"],
                  [(k, f"{v['cpu'] * 1e3:.3g}", f"{v['speed-up vs (a)']:.0f}x", f"{v['wall'] * 1e3:.3g}") for k, v in b["seconds_per_seed_step"].items()])
    proto = table(["", "training (s)", "evaluations (s)", "set-up (s)", "total (s)", "evaluation / training"],
                  [(k, f"{v['train']:.0f}", f"{v['evaluate']:.0f}", f"{v['setup']:.0f}", f"{v['total']:.0f}", f"{v['evaluate / train']:.2f}")
                   for k, v in b["protocol"].items() if "total" in v])
    one = b["protocol"]["unbatched one-seed loop (b), 30 seeds"]["train"]
    shapes = table(["forward and backward, 30 seeds x 64 prompts, n = 30", "CPU ms"], [(k, f"{v:.1f}") for k, v in b["training_shapes_ms"].items()])
    f32, rows = b["float32"], b["seconds_per_seed_step"]
    two = next((v for k, v in rows.items() if k.endswith("threads")), None)
    threads = (f"With {b['threads'] * 2} threads instead of {b['threads']}, a step of 30 seeds took {two['wall'] / rows['(c) engine, 30 seeds, float64']['wall']:.1f} times "
               f"the wall-clock time." if two else "")
    fwd = table(["n", "dtype", "autograd", "seconds", "peak memory of the process (MB)", "attention kernel"],
                [(f"{r['n']:,}", r["dtype"], r["grad"], f"{r['seconds']:.2f}", f"{r['peak_mb']:.0f}", ", ".join(k.replace("aten::_scaled_dot_product_", "") for k in r["kernels"]))
                 if "error" not in r else (f"{r['n']:,}", r["dtype"], r["grad"], "failed", "", r["error"][:80]) for r in b["forward"]])
    head, pv = b["headline"], b["provenance"]
    f64 = head.get("float64", head)
    return Markdown(f"""Measured {b['date']} on {pv['cpu']} ({pv.get('torch_cpu_capability', '?')} kernels; host `{b['host']}`), commit `{pv['commit'][:10]}`, ictd {b['ictd']}, torch {b['torch']}, {b['threads']} thread, {b['cpus']} CPUs, load average {b['load_before'][0]:.1f} before and {b['load_after'][0]:.1f} after.

**Headline:** at 30 seeds the engine's {head.get('dtype', 'float64')} step takes {head['engine_ms_per_seed_step']:.3g} ms per seed-step against {head['incontexttd_ms_per_seed_step']:.3g} ms for InContextTD's training step, re-implemented (it trains in float32): {head['speed_up']:.0f}x (goal {head['goal']:.0f}x); in float64, the book's default, {f64['speed_up']:.0f}x; against the stricter (a'), {head['speed_up_without_hard_transformer']:.0f}x.

{steps}

The reference protocol, extrapolated (CPU seconds, one thread); the one-seed loop would train for {one / 60:.0f} min:

{proto}

{threads}

{shapes}

What float32 changes, on the headline configuration (`EMERGENCE`, {f32['seeds']} seeds, {f32['n_steps']} steps): the largest differences between the float64 and float32 runs at the end of training are {f32['max_abs_diff']['msve']:.1e} in MSVE, {f32['max_abs_diff']['diagonality']:.1e} in diagonality, {f32['max_abs_diff']['value_weights']:.1e} in the value weights and {f32['max_param_diff']:.1e} in any parameter (whose largest entry is {f32['max_param']:.2f}).

The forward pass of `SoftmaxICTD.from_theta_star` (d = 10, L = 2, one query), each case in a fresh process:

{fwd}
""")
bench_report(bench) if bench else Markdown("No `bench/results.json` yet: run `make bench`.")

# %% [markdown]
# Three things the benchmark shows. The engine's speed comes from two sources, the seeds sharing
# each operation and the state-token form of the forward pass: at $n = 30$ neither attention route
# on full prompts comes near the state tokens. Evaluations stay a small fraction of the training
# time. And torch's fused attention kernel (`flash_attention_for_cpu`) runs only on
# four-dimensional queries, keys and values whose last dimension is contiguous, in float32 and
# float64 alike and with autograd too (we checked with torch's profiler); on any other layout torch
# falls back silently to the `math` kernel, which builds the $N \times N$ attention matrix, so that
# memory grows like $n^2$ and $n = 10^5$ needs tens of gigabytes. The kernel column above says which
# one ran; with the flash kernel the memory of the forward pass grows like $n$.
# Threads: `ictd pretrain --threads` defaults to one, since on a machine shared with other jobs
# torch's threads contend for the cores (the thread row above); on an idle machine two threads, or
# two processes each with half of the seeds, use both cores.

# %% [markdown]
# ## Speed on a GPU
#
# `bench/gpu_check.sh` runs every CUDA test and then `bench/bench_gpu.py` on a machine with a GPU; the book
# keeps its last results in `bench/results-gpu.json`. The bench trains the specification's
# shapes in float32 (CUDA's default) at 10 to 10,000 seeds, eagerly and with the loss's forward and backward pass
# captured as CUDA graphs (`compile=True`). Beside the GPU it times, on the same machine's CPU and on one thread,
# InContextTD's training step and the engine. It also measures the share of each step spent drawing the batch, and
# the share of the GPU's float32 throughput the step uses. That share is computed from the matrix products of one
# seed-step (torch's `FlopCounterMode`) and a large float32 matrix product timed in the same run.

# %%
#| code-fold: true
#| code-summary: "Code of the GPU report"
gpu_file = Path("../bench/results-gpu.json")
gpu = json.loads(gpu_file.read_text()) if gpu_file.exists() else None
def gpu_report(g):
    "The GPU bench's table and what it shows, from `bench/results-gpu.json`."
    rows, pv = g["rows"], g["provenance"]
    a, cpu30 = rows["incontexttd_cpu"], rows["cpu"]["30"]["per_seed_step"]
    eager, captured = rows["gpu"], rows["captured"]
    body = table(["seeds", "eager µs per seed-step", "seed-steps per second", "x InContextTD", "captured µs per seed-step",
                  "drawing the batch", "share of float32 throughput", "GPU memory (GB)"],
                 [(f"{int(S):,}", f"{r['per_seed_step'] * 1e6:.1f}", f"{r['seed_steps_per_s']:,.0f}", f"{a / r['per_seed_step']:,.0f}x",
                   f"{captured[S]['per_seed_step'] * 1e6:.1f}" if S in captured else "-", f"{r['share']:.0%}",
                   f"{r['flops_share_of_matmul']:.2%}", f"{r['peak_memory_gb']:.1f}") for S, r in eager.items()])
    top = max(eager, key=lambda S: eager[S]["seed_steps_per_s"])
    best = eager[top]
    ratio = [captured[S]["per_seed_step"] / eager[S]["per_seed_step"] for S in captured]
    return Markdown(f"""Measured {pv['date'][:10]} on an {pv['gpu']} with {pv['cpu']} ({pv['torch_cpu_capability']} kernels), commit `{pv['commit']}`, torch {pv['torch']}, by `bash bench/gpu_check.sh {pv['commit']}`. On that machine's CPU, on one thread, InContextTD's step took {a * 1e3:.1f} ms and the engine {cpu30 * 1e3:.3f} ms per seed-step at 30 seeds in float32 ({a / cpu30:.0f}x).

{body}

At {int(top):,} seeds the GPU trains {best['seed_steps_per_s']:,.0f} seed-steps per second: {cpu30 / best['per_seed_step']:.0f} times the CPU engine's rate on one core and {a / best['per_seed_step']:,.0f} times InContextTD's. That is still {best['flops_share_of_matmul']:.2%} of the float32 throughput of a large matrix product on the same GPU ({g['matmul_float32_flops_per_s'] / 1e12:.0f} TFLOP/s), since a seed-step is only {g['flops_per_seed_step'] / 1e6:.1f} MFLOP of tiny matrix products. Two things bound the step. Drawing the batch takes {best['share']:.0%} of it: each seed's uniforms come from its own CPU generator, which is what keeps a GPU run equal to the CPU run, seed by seed. The rest is not arithmetic either, at that many FLOP per seed-step; we did not profile it further. Capturing the loss's forward and backward pass as CUDA graphs did not shorten it (a captured seed-step took {min(ratio):.2f} to {max(ratio):.2f} times an eager one; Adam's update, the divergence check and the sampler stay outside the graph).""")
gpu_report(gpu) if gpu else Markdown("No `bench/results-gpu.json` yet: run `bash bench/gpu_check.sh` on a machine with a GPU.")

# %% [markdown]
# ## Full scale
#
# In a terminal (these cells are not run when the book is built). On two CPU cores, `ictd chain`
# takes a few seconds, `ictd linear` about ten, `ictd convergence` (1000 tasks, contexts up to
# $n = 30\,000$, about 1 GB of memory per batch of 200 tasks) about a minute, and `ictd pretrain`
# as the benchmark above says (all seeds train together); a second `ictd pretrain` with the same
# options loads the cached runs. `ictd all` runs the four.

# %%
#| eval: false
# !ictd convergence --out results
# !ictd pretrain --seeds 0-29 --out results
# !ictd linear --n-tasks 300 --out results

# %% [markdown]
# And from Python, the same functions the commands call, e.g. experiment 1 of chapter 5 at full
# scale with a progress bar:

# %%
#| eval: false
sweep = depth_experiment(1000, ns=[30, 100, 300, 1000, 3000, 10_000, 30_000], progress=True)
plot_depth(sweep);


# %% [markdown]
# ## Implementation and tests
#
# The options' parsers, the parser itself, how results are written, the commands, and the session
# above run at a tiny size with what each command writes checked.

# %% [markdown]
# ### Checking the options
#
# The defaults are the full-scale settings, so the options mostly shrink or vary a run. Each option
# is parsed by a small function that rejects a bad value with a message naming the option, before
# anything runs.

# %%
#| export
def _checked(convert, ok, expected:str):
    "An argparse `type` that converts with `convert` and rejects values failing `ok`, saying what was `expected`."
    def parse(text):
        try: value = convert(text)
        except ValueError: value = None
        if value is None or not ok(value): raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
        return value
    parse.__name__ = expected
    return parse

positive_int = _checked(int, lambda v: v > 0, "a positive integer")
natural_int = _checked(int, lambda v: v >= 0, "a non-negative integer")
positive_float = _checked(float, lambda v: v > 0, "a positive number")
natural_float = _checked(float, lambda v: v >= 0, "a non-negative number")
step_size = _checked(float, lambda v: 0 < v <= 1, "a step size in (0, 1]")
discount = _checked(float, lambda v: 0 <= v < 1, "a discount factor in [0, 1)")
n_states_arg = _checked(int, lambda v: v >= 2, "an integer >= 2")

# %%
test_eq(positive_int("3"), 3)
test_eq(step_size("1"), 1.)
for f, bad in ((positive_int, "0"), (positive_int, "2.5"), (step_size, "1.5"), (discount, "1"), (natural_float, "x")):
    test_fail(lambda: f(bad), contains="must be")

# %% [markdown]
# ### The parser
#
# One sub-command per experiment, each with the options of its compute function. The options of
# `ictd pretrain` are generated from the fields of `PretrainConfig`, so that every setting of a
# pretraining run can be given on the command line, and no option can drift out of step with it;
# the seeds are given as lists and ranges (`--seeds 0-29`, `--seeds 0,3,5`), and a few options say
# how to run rather than what (`--device`, `--threads`, `--checkpoint-every`, `--force`).

# %%
#| export
FEATURES = ("random", "unit", "onehot")
PRETRAIN_TYPES = dict(n_states=n_states_arg, d=positive_int, n=positive_int, n_layers=positive_int, gamma=discount,
                      lr=positive_float, weight_decay=natural_float, init_gain=positive_float, n_tasks=positive_int,
                      batch_size=positive_int, n_steps=natural_int, eval_every=positive_int, eval_tasks=positive_int,
                      init_scale=natural_float, init_beta=_checked(float, math.isfinite, "a finite number"),
                      init_alpha=_checked(float, math.isfinite, "a finite number"))

def seed_list(text:str)->list:
    "Seeds from a comma-separated list of integers and ranges, e.g. '0-29' or '0,3,5' or '0-4,10'."
    seeds = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try: first, last = int(lo), int(hi if sep else lo)
        except ValueError: raise argparse.ArgumentTypeError(f"must be seeds like 0-29 or 0,3,5, got {text!r}") from None
        if first < 0 or last < first: raise argparse.ArgumentTypeError(f"must be seeds like 0-29 or 0,3,5 (non-negative, increasing ranges), got {text!r}")
        seeds += range(first, last + 1)
    if len(set(seeds)) != len(seeds): raise argparse.ArgumentTypeError(f"must be distinct seeds, got {text!r}")
    return seeds

def _option(name:str)->str: return "--" + name.replace("_", "-")

def _add_pretrain_options(p:argparse.ArgumentParser):
    "One option per field of `PretrainConfig`, with its default and documentation; `--seeds` takes lists and ranges (one run each)."
    docs = docments(PretrainConfig)
    load_plugins()   # every family and protocol of the book, whatever was imported
    choices = dict(features=FEATURES, attention=sorted(FAMILIES), dtype=tuple(DTYPES), objective=OBJECTIVES, init=INITS,
                   protocol=sorted(k for k in PROTOCOLS if "(" not in k))   # the continuous families' protocols take `ictd continuous`
    for f in fields(PretrainConfig):
        default = getattr(PretrainConfig(), f.name)
        if f.type in (bool, "bool"): p.add_argument(_option(f.name), action="store_true", help=docs[f.name])
        elif f.name in choices: p.add_argument(_option(f.name), choices=choices[f.name], default=default, help=docs[f.name])
        elif f.name == "seed": p.add_argument("--seeds", "--seed", type=seed_list, nargs="+", default=[[0, 1, 2]], dest="seeds",
                                              help="seeds, one run each, e.g. 0-29 or 0,3,5; " + docs[f.name])
        else: p.add_argument(_option(f.name), type=PRETRAIN_TYPES[f.name], default=default, help=docs[f.name])
    p.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda (default: the CPU; on CUDA the default --dtype is float32)")
    p.add_argument("--compile", action="store_true", help="compile the training step (torch.compile; on CUDA, CUDA graphs); objectives td and supervised")
    p.add_argument("--threads", type=positive_int, default=1, help="torch intra-op threads of this process")
    p.add_argument("--checkpoint-every", type=positive_int, default=500, help="steps between checkpoints of the whole run")
    p.add_argument("--force", action="store_true", help="retrain even if the folder holds results of this configuration")
    p.add_argument("--cache-dir", type=Path, default=None, help="folder of cached runs (default: %(default)s, meaning the --out folder)")


# %%
test_eq(seed_list("0-4,7"), [0, 1, 2, 3, 4, 7])
test_eq(seed_list("3"), [3])
for bad in ("4-2", "a", "-1", "0-"): test_fail(lambda: seed_list(bad), contains="must be seeds like")
test_fail(lambda: seed_list("0-3,2"), contains="must be distinct seeds")

# %% [markdown]
# The slow studies of chapter 6b, by name: what `ictd mechanism STUDY` runs, and what it writes.

# %%
#| export
MECHANISM_STUDIES = dict(
    runs=(lambda out, seeds, cmd, a: run_mechanism_study(out, seeds, tuple(range(max(seeds) + 1, max(seeds) + 1 + len(seeds))), command=cmd),
          "the models the chapter probes and fits its estimator on, and as many fresh seeds it predicts (mechanism_runs.json)"),
    gap=(lambda out, seeds, cmd, a: run_gap_map(out, seeds, command=cmd), "the gap map over n, states, features and gamma (mechanism_gap_map.json)"),
    controls=(lambda out, seeds, cmd, a: run_control_study(out, seeds, command=cmd), "Monte-Carlo, supervised and independent-successor controls (mechanism_controls.json)"),
    dynamics=(lambda out, seeds, cmd, a: run_theta_star_dynamics(out, seeds, command=cmd), "training from theta* and its perturbations (mechanism_dynamics.json)"),
    gamma=(lambda out, seeds, cmd, a: run_gap_map(out, seeds, cells=(dict(gamma=0.95), dict(gamma=0.7)), command=cmd, name="mechanism_gamma.json"),
           "the discount ablation at full length (mechanism_gamma.json)"),
    depth=(lambda out, seeds, cmd, a: run_depth_sweep(out, seeds, command=cmd), "separate layers at several depths (mechanism_depth.json)"),
    deep=(lambda out, seeds, cmd, a: run_depth_sweep(out, seeds, tuple(a.depths), command=cmd, name="mechanism_depth_deep.json", device=a.device,
                                                     cache_dir=a.cache_dir, train_only=a.train_only),
          "the deep end of the depth sweep, --depths (mechanism_depth_deep.json)"),
    converge=(lambda out, seeds, cmd, a: run_converge_study(out, seeds, tuple(a.lrs), a.steps, a.eval_every, a.window, device=a.device,
                                                            cache_dir=a.cache_dir, train_only=a.train_only, command=cmd),
              "the lr x steps sweep with the stopping rule, --lrs --steps --eval-every --window (mechanism_converge.json)"),
    shared=(lambda out, seeds, cmd, a: run_shared_study(out, seeds, command=cmd), "one shared layer, iterated in the chapter beyond its training depth (mechanism_shared.json)"),
    jacobian=(lambda out, seeds, cmd, a: run_jacobian_study(out, command=cmd), "the expected update's Jacobian at theta*, n = infinity and n = 30 (mechanism_jacobian.json)"),
    contest_runs=(lambda out, seeds, cmd, a: run_contest_runs(out, command=cmd),
                  "the contest's cells that no other study saved, each on its own seeds (CONTEST_CELLS, appendix D; --seeds is not used) (contest_runs.json)"),
    contest=(lambda out, seeds, cmd, a: run_contest(out, data_dir=out, command=cmd),
             "the contest's sums for every saved run of every cell, read from the runs files in --out (contest_stats.json)"),
    contest_linear=(lambda out, seeds, cmd, a: run_contest_linear(out, seeds, command=cmd),
                    "linear-attention models at the headline cell, trained on --seeds, and their contest sums (contest_linear.json)"))

def mechanism_command(args)->str:
    "The command line a mechanism study records: the study, its seeds, folder and the options that change its result."
    extra = dict(converge=f" --lrs {' '.join(f'{x:g}' for x in args.lrs)} --steps {args.steps} --eval-every {args.eval_every} --window {args.window}",
                 deep=f" --depths {' '.join(map(str, args.depths))}").get(args.study, "")
    return f"ictd mechanism {args.study} --seeds {seed_ranges(args.seeds)} --out {args.out}{extra}"


# %%
#| export
def make_parser()->argparse.ArgumentParser:
    "The `ictd` argument parser, with one sub-command per experiment."
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", type=Path, default=Path("ictd-results"), help="folder for figures and results (default: %(default)s)")
    common.add_argument("--no-progress", action="store_true", help="hide progress bars")
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="ictd", description="Reproduce the figures of the ictd book at full scale.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("chain", parents=[common], formatter_class=fmt, help="draw a random Boyan chain (chapter 0)")
    p.add_argument("--n-states", type=n_states_arg, default=10, help="number of states")
    p.add_argument("--features", choices=FEATURES, default="random", help="feature kind")
    p.add_argument("--gamma", type=discount, default=0.9, help="discount factor")
    p.add_argument("--seed", type=natural_int, default=0, help="seed of the chain")
    p = sub.add_parser("convergence", parents=[common], formatter_class=fmt, help="the experiments of chapter 5a")
    p.add_argument("--n-tasks", type=positive_int, default=1000, help="tasks of experiments 1 and 2 (depth, floor)")
    p.add_argument("--ns", type=positive_int, nargs="+", default=[30, 100, 300, 1000, 3000, 10_000, 30_000], help="context lengths, increasing")
    p.add_argument("--n-layers", type=positive_int, default=100, help="maximal depth L of experiment 1")
    p.add_argument("--beta", type=positive_float, default=15., help="score scale, W = beta I, of experiments 1 and 2")
    p.add_argument("--alpha", type=step_size, default=1., help="step size of experiments 1 and 2")
    p.add_argument("--seed", type=natural_int, default=0, help="seed of the tasks of experiments 1 and 2")
    p.add_argument("--chunk", type=positive_int, default=200, help="tasks per batch (memory grows with chunk x max(ns))")
    p.add_argument("--diag-tasks", type=positive_int, default=200, help="tasks per feature kind of experiment 3")
    p.add_argument("--n-betas", type=_checked(int, lambda v: v >= 2, "an integer >= 2"), default=22, help="score scales of experiment 3")
    p.add_argument("--rate-tasks", type=positive_int, default=150, help="tasks per feature kind of experiment 5")
    p.add_argument("--rate-layers", type=_checked(int, lambda v: v >= 4, "an integer >= 4"), default=120, help="depth of experiment 5 (rate fitted on the second half)")
    p.add_argument("--phase-tasks", type=positive_int, default=100, help="tasks per feature kind of the phase diagram (experiment 4)")
    p.add_argument("--leaky-tasks", type=positive_int, default=100, help="unit-norm tasks of the leaky regime (experiment 6)")
    p = sub.add_parser("pretrain", parents=[common], formatter_class=fmt, help="pretrain softmax Transformers on Boyan chains (chapter 6)")
    _add_pretrain_options(p)
    p = sub.add_parser("linear", parents=[common], formatter_class=fmt, help="linear against softmax in-context TD (chapters 7, 7a)")
    p.add_argument("--n-tasks", type=positive_int, default=100, help="random Boyan chains")
    p.add_argument("--n", type=positive_int, default=200, help="context length")
    p.add_argument("--depth", type=positive_int, default=60, help="deepest model")
    p.add_argument("--beta", type=positive_float, default=20., help="softmax score scale, W = beta I")
    p.add_argument("--alpha", type=positive_float, default=1., help="step size of both constructions in the untuned comparison")
    p.add_argument("--seed", type=natural_int, default=0, help="the comparisons' seed (their tasks and contexts come from its sub-streams)")
    p.add_argument("--features", choices=["random", "onehot"], nargs="+", default=["random", "onehot"],
                   help="features shared by every method in the tuned comparison")
    p.add_argument("--n-tune", type=positive_int, default=20, help="tuning tasks of the tuned comparison (separate seeds)")
    p.add_argument("--reproduce-seeds", type=seed_list, default=None,
                   help="also pretrain linear Transformers with the predecessor's protocol (ICLR_LINEAR) on these seeds, e.g. 0-29 (minutes per seed)")
    p.add_argument("--head-to-head", type=seed_list, default=None,
                   help="also pretrain linear and softmax Transformers head to head on these seeds, e.g. 0-9, each with its tuned lr (head_to_head.json)")
    p = sub.add_parser("continuous", parents=[common], formatter_class=fmt, help="kernel TD and pretraining on continuous states (chapters 8-8b)")
    p.add_argument("--seed", type=natural_int, default=0, help="seed of the contexts, and the first of the consecutive training seeds")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test) instead of the full scale")
    p = sub.add_parser("ablations", parents=[common], formatter_class=fmt,
                       help="chapter 6a's ablations over seeds, every run's history saved as JSON (emergence_ablations.json)")
    p.add_argument("--seeds", type=seed_list, default=list(range(10)), help="seeds, e.g. 0-9 (the chapter's)")
    p.add_argument("--steps", type=_checked(int, lambda v: v >= 2 and v % 2 == 0, "an even integer >= 2"), default=ABLATION_BASE.n_steps,
                   help="training steps of every run (evaluated at 0, half-way and the end)")
    p = sub.add_parser("mechanism", parents=[common], formatter_class=fmt,
                       help="the slow studies of chapter 6b, each saved as JSON with the command, commit and date that made it")
    p.add_argument("study", choices=list(MECHANISM_STUDIES), help="which study: " + "; ".join(f"{k}: {v[1]}" for k, v in MECHANISM_STUDIES.items()))
    p.add_argument("--seeds", type=seed_list, default=list(range(10)), help="seeds, e.g. 0-9 (the chapter's); `runs` also trains 10 more after them")
    p.add_argument("--device", default=None, help="torch device of `converge` and `deep` (default: cpu)")
    p.add_argument("--cache-dir", type=Path, default=None, help="`converge`, `deep`: folder of saved runs and checkpoints, resumed from (default: none)")
    p.add_argument("--train-only", action="store_true", help="`converge`, `deep`: only train into --cache-dir (parallel workers); a last call without it writes the file")
    p.add_argument("--lrs", type=positive_float, nargs="+", default=list(CONVERGE_LRS), help="`converge`: learning rates")
    p.add_argument("--steps", type=positive_int, default=4000, help="`converge`: steps of every run (the largest step count)")
    p.add_argument("--eval-every", type=positive_int, default=200, help="`converge`: steps between evaluations")
    p.add_argument("--window", type=positive_int, default=1000, help="`converge`: the stopping rule's window in steps (a multiple of --eval-every)")
    p.add_argument("--depths", type=positive_int, nargs="+", default=list(DEEP_DEPTHS), help="`deep`: depths (separate layers)")
    p = sub.add_parser("sweep", parents=[common], formatter_class=fmt,
                       help="a grid of pretraining configurations x seeds from a spec file, here or on a Dask cluster (appendix G)")
    p.add_argument("spec", type=Path, nargs="?", default=None, help="the spec file (.toml or .json), e.g. sweeps/contest.toml")
    p.add_argument("--cache-dir", type=Path, default=None, help="folder of cached runs, seen by every worker (default: %(default)s, meaning the --out folder)")
    p.add_argument("--scheduler", default=None, help="address of a running Dask scheduler, e.g. tcp://10.0.0.5:8786 (default: run here)")
    p.add_argument("--cluster", default=None, help="local:N starts a local Dask cluster of N single-threaded worker processes (default: run here)")
    p.add_argument("--checkpoint-every", type=positive_int, default=500, help="steps between checkpoints of each cell (a lost worker's cell resumes from the last)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads of each cell")
    p.add_argument("--overhead", action="store_true", help="instead of a sweep, measure the per-task overhead of local Dask and Ray clusters (sweep_overhead.json)")
    sub.add_parser("all", parents=[common], formatter_class=fmt, help="run every command above but `mechanism` and `sweep` with their defaults")
    return parser


# %%
show_doc(make_parser)

# %%
print(make_parser().format_help())


# %% [markdown]
# Every field of `PretrainConfig` is an option of `ictd pretrain`:

# %%
def sub_parser(name): return make_parser()._subparsers._group_actions[0].choices[name]
pre_help = sub_parser("pretrain").format_help()
for f in fields(PretrainConfig): assert _option(f.name if f.name != "seed" else "seeds") in pre_help, f.name
print(pre_help)


# %% [markdown]
# ### Writing results
#
# Each command saves figures as PNG, the numbers as JSON (tensors become nested lists) and, where
# there are large tensors, the whole result with `save_checked` (appendix A: `torch.save` with a checksum,
# numpy arrays turned into tensors so that `weights_only=True` loads it); each file atomically, and prints its path.

# %%
#| export
def _save(obj, path:Path)->Path:
    "Save a figure (PNG), a dict as JSON (`.json`) or with `save_checked` (`.pt`), each atomically; print and return the path."
    import matplotlib.pyplot as plt
    if path.suffix == ".png": atomic_savefig(obj, path, dpi=120, bbox_inches="tight"); plt.close(obj)
    elif path.suffix == ".json": atomic_write_text(path, json.dumps(jsonable(obj), indent=1))
    else: save_checked(tensors_only(obj), path)
    print(f"wrote {path}", flush=True)
    return path


# %% [markdown]
# A pretraining run over many seeds is summarised by the mean and the standard error over seeds of
# every metric at the end of training, and by a figure of the metrics against training steps with
# bands of one standard error:

# %%
#| export
def seed_ranges(seeds:list)->str:
    "Seeds written compactly as ranges, e.g. [0, 1, 2, 5] -> '0-2,5'."
    out, seeds = [], sorted(seeds)
    for s in seeds:
        if out and s == out[-1][1] + 1: out[-1][1] = s
        else: out.append([s, s])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)


# %% [markdown]
# Seeds are written back the way `--seeds` reads them, so a summary's title names its runs compactly:

# %%
test_eq(seed_ranges([5, 0, 1, 2, 9, 10]), "0-2,5,9-10")
test_eq(seed_list(seed_ranges([5, 0, 1, 2, 9, 10])), [0, 1, 2, 5, 9, 10])


# %% [markdown]
# `summarize` reduces a run over seeds to what `summary.json` holds: the last evaluation of every
# metric, as the mean over seeds and its standard error.

# %%
#| export
def summarize(results:list)->dict:
    "Mean and standard error over seeds of every metric at the last evaluation (standard error None for one seed)."
    S, final = len(results), {}
    for k in results[0].history:
        if k == "step": continue
        last = torch.stack([r.history[k][-1].double() for r in results])
        final[k] = dict(mean=last.mean(0), se=last.std(0) / math.sqrt(S) if S > 1 else None)
    return dict(config=asdict(results[0].config) | dict(seed=None), seeds=[r.config.seed for r in results],
                step=int(results[0].history["step"][-1]), final=final)


# %% [markdown]
# `plot_seeds` draws the same metrics against training steps, each as a mean with a band of one
# standard error (`summary.png`).

# %%
#| export
def _band(ax, steps, x, label, log=False):
    "Mean over seeds (axis 0) with a band of one standard error."
    m = x.mean(0)
    se = x.std(0) / math.sqrt(len(x)) if len(x) > 1 else torch.zeros_like(m)
    ax.plot(steps, m, label=label)
    ax.fill_between(steps, (m - se).clamp(min=1e-12) if log else m - se, m + se, alpha=0.25)

def plot_seeds(results:list,  # runs of one configuration with different seeds
               title:str=None, # figure title; default: the configuration's main settings and the seeds
              ):
    "Metrics against training steps, mean over seeds with one standard error: MSVE and NEU, and the softmax family's diagonality and last-layer value weights."
    import matplotlib.pyplot as plt
    h = {k: torch.stack([r.history[k] for r in results]).double() for k in results[0].history}
    steps, c = h["step"][0].flatten().numpy(), results[0].config
    panels = 2 + 2 * ("value_weights" in h)
    fig, axs = plt.subplots(1, panels, figsize=(4 * panels, 3.6))
    _band(axs[0], steps, h["msve"][..., 0], "MSVE", log=True)
    axs[0].set(yscale="log", xlabel="training step", ylabel="MSVE (held-out tasks)", title="Value error")
    for k, label in (("neu", f"n = {c.n} (estimate)"), ("neu_population", r"$n = \infty$")):
        if k in h: _band(axs[1], steps, h[k][..., 0], f"NEU, {label}")
    axs[1].set(xlabel="training step", ylabel="NEU", title="Norm of the expected update")
    if "value_weights" in h:
        vw = h["value_weights"][:, :, -1]
        for j, name in enumerate(("reward", "successor value", "current value")): _band(axs[2], steps, vw[..., j], name)
        axs[2].axhline(0, color="k", lw=0.5)
        axs[2].set(xlabel="training step", ylabel="weight", title=f"Value-update weights, layer {c.n_layers}")
        for l in range(c.n_layers): _band(axs[3], steps, h["diagonality"][..., l], f"layer {l + 1}")
        axs[3].set(xlabel="training step", ylabel="attention share on own state", title="Kernel diagonality")
    for ax in axs: ax.legend(fontsize=8)
    fig.suptitle(title or f"{c.attention} attention, n = {c.n}, L = {c.n_layers}, lr = {c.lr:g}, {c.dtype}: mean and standard error over seeds {seed_ranges([r.config.seed for r in results])}")
    fig.tight_layout()
    return fig


# %% [markdown]
# ### The commands
#
# One function per sub-command: it calls the exported compute and plot functions of its chapter
# and saves what they return.

# %%
#| export
def run_chain(args)->list:
    "`ictd chain`: draw a random Boyan chain and save its process."
    mrp = random_boyan_chain(args.n_states, gamma=args.gamma, features=args.features, seed=args.seed)
    info = dict(n_states=args.n_states, gamma=args.gamma, features=args.features, seed=args.seed,
                P=mrp.P, r=mrp.r, phi=mrp.phi, d_pi=mrp.d_pi, v_pi=mrp.v_pi)
    return [_save(plot_chain(mrp).figure, args.out / "chain.png"), _save(info, args.out / "chain.json")]


# %% [markdown]
# `ictd convergence` runs chapter 5a's experiments at the sizes its options give and writes one
# figure per experiment, the tensors (`convergence.pt`) and a summary (`convergence.json`).

# %%
#| export
def run_convergence(args)->list:
    "`ictd convergence`: the experiments of chapter 5a."
    if args.ns != sorted(set(args.ns)): raise ValueError(f"argument --ns: must be increasing, got {args.ns}")
    progress = not args.no_progress
    sweep = depth_experiment(args.n_tasks, beta=args.beta, alpha=args.alpha, ns=args.ns, n_layers=args.n_layers, seed=args.seed, chunk=args.chunk, progress=progress)
    diag = diagonality_sweep(args.diag_tasks, betas=torch.logspace(-1, 2.5, args.n_betas, dtype=torch.float64))
    rates = rate_experiment(args.rate_tasks, n_layers=args.rate_layers, fit_start=args.rate_layers // 2)
    phase, leaky = phase_diagram(args.phase_tasks), leaky_experiment(args.leaky_tasks)
    if not len(rates["rates"]): raise ValueError("argument --rate-tasks: no task met the condition; use more tasks")
    floors = sweep["floors"].mean(0)
    summary = dict(depth=dict(n_tasks=args.n_tasks, ns=args.ns, beta=args.beta, alpha=args.alpha, seed=args.seed,
                              mean_floor=floors, floor_slope=loglog_slope(torch.tensor(args.ns, dtype=torch.float64), floors)[0] if len(args.ns) > 1 else None,
                              mean_error_last_layer=sweep["errors"][:, :, -1].mean(0), rho_range=[sweep["rho"].min(), sweep["rho"].max()],
                              min_diagonal=sweep["min_diag"].min()),
                   diagonality=dict(n_tasks=args.diag_tasks, betas=diag["betas"],
                                    mean_of_mean=({f: c[0].mean(1) for f, c in diag["curves"].items()}),
                                    mean_of_min=({f: c[1].mean(1) for f, c in diag["curves"].items()})),
                   rates=dict(n_tasks=len(rates["rates"]), max_rho_minus_rate=float((rates["rhos"] - rates["rates"]).max()),
                              median_rho_minus_rate=float(np.median(rates["rhos"] - rates["rates"])),
                              all_under_bound=bool((rates["rates"] <= rates["rhos"] + 1e-9).all())))
    o = args.out
    figs = [_save(plot_depth(sweep), o / "convergence-depth.png")]
    if len(args.ns) > 1: figs += [_save(plot_floor(sweep), o / "convergence-floor.png"), _save(plot_floor(sweep, "bound"), o / "convergence-floor-bound.png")]
    figs += [_save(plot_diagonality(diag), o / "convergence-diagonality.png")]
    figs += [_save(plot_phase(phase, f, g), o / f"convergence-phase-{f}-gamma{g}.png") for f in phase["features"] for g in phase["gammas"]]
    figs += [_save(plot_rates(rates), o / "convergence-rates.png"), _save(plot_leaky(leaky), o / "convergence-leaky.png")]
    summary["phase"] = dict(n_tasks=args.phase_tasks, features=phase["features"], gammas=phase["gammas"], betas=phase["betas"], fractions=phase["fractions"])
    summary["leaky"] = dict(n_tasks=args.leaky_tasks, rho_range=[leaky["rho"].min(), leaky["rho"].max()], rate_range=[leaky["rates"].min(), leaky["rates"].max()])
    return figs + [_save(dict(depth=sweep, diagonality=diag, phase=phase, rates=rates, leaky=leaky), o / "convergence.pt"), _save(summary, o / "convergence.json")]


# %% [markdown]
# `ictd continuous` delegates to chapter 8a's driver, which writes its own files.

# %%
#| export
def run_continuous(args)->list:
    "`ictd continuous`: the experiments of chapter 8a (continuous states), full scale unless `--quick`."
    paths = continuous_experiments(args.out, seed=args.seed, progress=not args.no_progress, quick=args.quick)
    for path in paths: print(f"wrote {path}", flush=True)
    return paths


# %% [markdown]
# `ictd linear` runs chapter 7a's comparisons of linear and softmax in-context TD; the two
# pretraining studies (the predecessor's protocol, the head-to-head) run only when their seeds are given.

# %%
#| export
def run_linear(args)->list:
    "`ictd linear`: linear against softmax in-context TD (chapter 7a): untuned, tuned per method on shared features, optionally the predecessor's pretraining and the pretrained head-to-head."
    curves = side_by_side(args.n_tasks, args.n, args.depth, beta=args.beta, alpha=args.alpha, seed=args.seed)
    tuned = {f"{f} features": tuned_side_by_side(f, args.n_tasks, args.n_tune, args.n, args.depth, args.seed) for f in args.features}
    summary = dict(settings=dict(n_tasks=args.n_tasks, n=args.n, depth=args.depth, beta=args.beta, alpha=args.alpha, seed=args.seed,
                                 features=args.features, n_tune=args.n_tune),
                   median_msve={k: c.median(0).values for k, c in curves.items()},
                   tuned={f: {m: dict(params=r["params"], tune_msve=r["tune_msve"], median_msve=r["curves"].median(0).values)
                              for m, r in res.items()} for f, res in tuned.items()})
    paths = [_save(plot_side_by_side(curves, args.n), args.out / "linear.png"), _save(plot_tuned_side_by_side(tuned, args.n), args.out / "linear-tuned.png"),
             _save(dict(untuned=curves, tuned=tuned), args.out / "linear.pt")]
    if args.reproduce_seeds:
        results = reproduce_iclr(ICLR_LINEAR, args.reproduce_seeds, out=args.out / "iclr-linear.json", progress=not args.no_progress)
        print(f"wrote {args.out / 'iclr-linear.json'}", flush=True)
        paths += [args.out / "iclr-linear.json", _save(plot_linear_pretraining(results), args.out / "iclr-linear.png"),
                  _save(plot_linear_pretraining(results, entries=True), args.out / "iclr-linear-entries.png")]
    if args.head_to_head:
        paths.append(run_head_to_head(args.out / "head_to_head.json", command=f"ictd linear --head-to-head {seed_ranges(args.head_to_head)} --out {args.out}",
                                      seeds=args.head_to_head))
        print(f"wrote {paths[-1]}", flush=True)
    return paths + [_save(summary, args.out / "linear.json")]


# %% [markdown]
# `ictd pretrain` trains every seed of one configuration in one batched run, cached per
# configuration and seed, and writes each seed's figure and the summary across seeds.

# %%
#| export
def _seeds(args)->list:
    "The flat list of seeds of `--seeds` (given as one or more lists and ranges), checked to be distinct."
    seeds = [s for group in args.seeds for s in group]
    if len(set(seeds)) != len(seeds): raise ValueError(f"argument --seeds: must be distinct, got {seeds}")
    return seeds

def run_pretrain(args)->list:
    "`ictd pretrain`: every seed in one batched run (cached per configuration and seed), each seed's figure and a summary across seeds."
    torch.set_num_threads(args.threads)
    seeds, cache = _seeds(args), args.cache_dir or args.out
    config = PretrainConfig(**{f.name: getattr(args, f.name) for f in fields(PretrainConfig) if f.name != "seed"})
    config = replace(config, dtype=training_dtype(config, args.device))   # on CUDA, float32 unless --dtype asked
    folder = run_folder(args.out, config)
    cached = [s for s in seeds if (run_folder(cache, config) / f"seed-{s}.pt").exists()]
    if cached and not args.force: print(f"seeds {seed_ranges(cached)}: loading the cached runs from {run_folder(cache, config)}", flush=True)
    results = pretrain_many(config, seeds, progress=not args.no_progress, cache_dir=cache, device=args.device,
                            checkpoint_every=args.checkpoint_every, force=args.force, compile=args.compile)
    paths = []
    for r in results:
        h = r.history
        summary = dict(config=asdict(r.config), final={k: v[-1] for k, v in h.items()}, msve=h["msve"].flatten(), step=h["step"].flatten())
        if "value_weights" in h: paths.append(_save(plot_emergence(r), folder / f"seed-{r.config.seed}.png"))
        paths.append(_save(summary, folder / f"seed-{r.config.seed}.json"))
    paths += [_save(summarize(results), folder / "summary.json"), _save(plot_seeds(results), folder / "summary.png")]
    if config.attention == "softmax" and len(results) >= 2:
        emergence_report(results, folder / "emergence")
        for name in ("bands.png", "parameters.png", "summary.json", "summary.md"):
            paths.append(folder / "emergence" / name)
            print(f"wrote {paths[-1]}", flush=True)
    return paths


# %%
show_doc(run_convergence)

# %%
show_doc(run_pretrain)


# %% [markdown]
# `main` parses the arguments and dispatches; `ictd all` runs each command with its defaults into
# the same folder. Options that are wrong only together (a stopping window that is not a multiple of the
# evaluation spacing), or that torch cannot use (a device it does not have), are refused by `check_options`
# before any work; a `ValueError` raised by the library is reported the same way, like a parsing error: a
# message and exit status 2. An `OSError` (a full disk, a folder that cannot be written) ends the command with
# its message, which names the path and the cause, and exit status 1.

# %%
#| export
def check_options(args)->None:
    "Refuse, before any work, option values that are wrong together or that torch cannot use: a `ValueError` naming the option."
    if getattr(args, "device", None) is not None:
        try: check_device(args.device)
        except ValueError as e: raise ValueError(f"argument --device: {e}") from None
    if args.command == "mechanism" and args.study == "converge":
        if args.eval_every > args.steps: raise ValueError(f"argument --eval-every: must be at most --steps ({args.steps}), got {args.eval_every}")
        if args.window % args.eval_every: raise ValueError(f"argument --window: must be a multiple of --eval-every ({args.eval_every}), got {args.window}")
    if args.command == "mechanism" and args.study in ("converge", "deep") and args.train_only and args.cache_dir is None:
        raise ValueError("argument --train-only: needs --cache-dir to keep the runs in")
    if args.command == "pretrain": _seeds(args)
    if args.command == "sweep" and not args.overhead:
        if args.spec is None: raise ValueError("argument spec: a spec file is needed (or --overhead)")
        if not args.spec.exists(): raise ValueError(f"argument spec: no such file {str(args.spec)!r}")
        if args.scheduler is not None and args.cluster is not None: raise ValueError("argument --cluster: give --scheduler or --cluster, not both")
        if args.cluster is not None and not (args.cluster.startswith("local:") and args.cluster[6:].isdigit() and int(args.cluster[6:]) >= 1):
            raise ValueError(f"argument --cluster: must be local:N with N >= 1, got {args.cluster!r}")
        expand_spec(load_spec(args.spec))   # a bad spec stops here, before a cluster starts

def run_mechanism(args)->list:
    "`ictd mechanism STUDY`: one slow study of chapter 6b, written to `--out` as JSON with its provenance."
    path = MECHANISM_STUDIES[args.study][0](args.out, list(args.seeds), mechanism_command(args), args)
    print(f"wrote {path}" if path is not None else f"trained into {args.cache_dir}", flush=True)
    return [path] if path is not None else []


# %% [markdown]
# `ictd ablations` trains chapter 6a's ablations ([appendix E](emergence_studies.html#saved-ablations)) and writes every
# run's history to one file, which the chapter reads:

# %%
#| export
def run_ablations_command(args)->list:
    "`ictd ablations`: chapter 6a's ablations on `--seeds`, every run's configuration and history in `emergence_ablations.json`."
    t0 = time.time()
    base = replace(ABLATION_BASE, n_steps=args.steps, eval_every=args.steps // 2)
    runs = run_ablations(list(args.seeds), base, progress=not args.no_progress)
    path = Path(args.out) / "emergence_ablations.json"
    save_ablations(path, runs, **provenance(f"ictd ablations --seeds {seed_ranges(args.seeds)} --steps {args.steps} --out {args.out}",
                                            wall_s=round(time.time() - t0, 1), threads=torch.get_num_threads()))
    print(f"wrote {path}", flush=True)
    return [path]


# %% [markdown]
# `ictd sweep SPEC` runs appendix G's sweep: every cell of the spec, here or on the Dask cluster that `--cluster` starts
# or `--scheduler` names, and its three files in `sweep-{name}/` under `--out`; the cells' runs are cached in the
# folders of `ictd pretrain` (under `--cache-dir`, by default `--out`). `ictd sweep --overhead` instead measures the
# per-task overhead of local Dask and Ray clusters for the appendix.

# %%
#| export
def run_sweep_command(args)->list:
    "`ictd sweep SPEC`: every cell of the spec (each cached per configuration and seed), here or on a Dask cluster; `sweep.json`, `sweep.csv`, `sweep.png`."
    if args.overhead:
        path = measure_overheads(args.out, command=f"ictd sweep --overhead --out {args.out}")
        print(f"wrote {path}", flush=True)
        return [path]
    spec = load_spec(args.spec)
    cells, where = expand_spec(spec), args.scheduler or args.cluster or "this process"
    client = start_client(args.scheduler, args.cluster)
    try:
        workers = len(client.scheduler_info()["workers"]) if client is not None else 1
        print(f"{len(cells)} cells, {sum(len(c.seeds) for c in cells)} runs, on {where} ({workers} worker{'s' * (workers > 1)})", flush=True)
        records = run_sweep(cells, args.cache_dir or args.out, client, args.checkpoint_every, args.threads, progress=not args.no_progress)
    finally: stop_client(client)
    command = " ".join(["ictd sweep", str(args.spec), "--out", str(args.out)] + (["--scheduler", args.scheduler] if args.scheduler else [])
                       + (["--cluster", args.cluster] if args.cluster else []))
    paths = write_sweep(args.out / f"sweep-{spec.get('name', args.spec.stem)}", spec, cells, records, command, where=where, workers=workers)
    for path in paths: print(f"wrote {path}", flush=True)
    return paths


# %% [markdown]
# The sub-commands by name, and the entry point that dispatches to them:

# %%
#| export
COMMANDS = dict(chain=run_chain, linear=run_linear, convergence=run_convergence, pretrain=run_pretrain, continuous=run_continuous, ablations=run_ablations_command,
                mechanism=run_mechanism, sweep=run_sweep_command)

def main(argv:list=None, # arguments after `ictd` (default: `sys.argv[1:]`)
        ):
    "Entry point of the `ictd` console script."
    parser = make_parser()
    args = parser.parse_args(argv)
    names = [c for c in COMMANDS if c not in ("mechanism", "sweep")] if args.command == "all" else [args.command]
    for name in names:
        cmd_args = args if name == args.command else parser.parse_args([name, "--out", str(args.out)] + ["--no-progress"] * args.no_progress)
        try: check_options(cmd_args); COMMANDS[name](cmd_args)
        except ValueError as e: parser.error(f"{name}: {e}")
        except OSError as e: parser.exit(1, f"ictd {name}: error: {e}\n")


# %%
show_doc(main)

# %% [markdown]
# ### The first session, checked
#
# A chain, in a temporary folder (the same as `ictd chain --seed 3 --out DIR` in a terminal):

# %%
tmp = Path(tempfile.mkdtemp())
with working_directory(tmp): main(["chain", "--seed", "3", "--out", "results"])
chain = json.loads((tmp / "results" / "chain.json").read_text())
test_close(torch.tensor(chain["v_pi"], dtype=torch.float64), random_boyan_chain(seed=3).v_pi, eps=1e-12)
test_eq(matplotlib.image.imread(tmp / "results" / "chain.png").ndim, 3)

# %% [markdown]
# The chapter 7 comparison with tiny sizes: a few tasks, short contexts, shallow models. The
# numbers in `linear.json` are the median MSVE at each depth; they start at the MSVE of $v = 0$.

# %%
with working_directory(tmp): main(["linear", "--n-tasks", "4", "--n", "30", "--depth", "8", "--out", "results"])
lin = json.loads((tmp / "results" / "linear.json").read_text())
med = lin["median_msve"]["softmax attention, one-hot features"]
test_eq(len(med), 9)
assert med[-1] < med[0], med
saved = torch.load(tmp / "results" / "linear.pt", weights_only=True)   # tensors and plain containers only
test_eq(load_checked(tmp / "results" / "linear.pt")["untuned"].keys(), saved["untuned"].keys())


# %% [markdown]
# A bad value stops before anything runs, naming the option:

# %%
def exit_message(argv):
    "Exit status and error message of `main(argv)`."
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try: main(argv)
        except SystemExit as e: return e.code, err.getvalue().strip().splitlines()[-1]

for argv, msg in ((["linear", "--alpha", "0"], "argument --alpha: must be a positive number"),
                  (["convergence", "--ns", "300", "30"], "argument --ns: must be increasing"),
                  (["pretrain", "--n-steps", "-1"], "argument --n-steps: must be a non-negative integer"),
                  (["mechanism", "converge", "--window", "300"], "argument --window: must be a multiple of --eval-every (200)"),
                  (["mechanism", "converge", "--eval-every", "5000"], "argument --eval-every: must be at most --steps (4000)"),
                  (["mechanism", "deep", "--train-only"], "argument --train-only: needs --cache-dir"),
                  (["pretrain", "--device", "gpu"], "argument --device: `device` must be a torch device"),
                  (["pretrain", "--seeds", "0-2", "1"], "argument --seeds: must be distinct"),
                  (["linear", "--head-to-head", "0,0"], "argument --head-to-head: must be distinct seeds"),
                  (["chain", "--features", "hexagonal"], "argument --features: invalid choice"),
                  (["sweep"], "argument spec: a spec file is needed"),
                  (["sweep", "no-such-spec.toml"], "argument spec: no such file"),
                  (["sweep", "../sweeps/tiny.toml", "--cluster", "slurm"], "argument --cluster: must be local:N")):
    code, text = exit_message(argv)
    test_eq(code, 2)
    assert msg in text, text
text

# %% [markdown]
# And pretraining at a tiny size: two seeds trained together, each with its figure, and the
# summary across seeds in the configuration's folder:

# %%
tiny = ["pretrain", "--n-steps", "20", "--eval-every", "10", "--n-tasks", "32", "--eval-tasks", "8", "--seeds", "0-1",
        "--no-progress", "--out", "results"]
with working_directory(tmp): main(tiny)
tiny_config = PretrainConfig(n_steps=20, eval_every=10, n_tasks=32, eval_tasks=8)
folder = tmp / "results" / tiny_config.key()
test_eq(sorted(p.name for p in folder.iterdir()), ["config.json", "emergence", "seed-0.json", "seed-0.png", "seed-0.pt", "seed-0.pt.sha256", "seed-1.json",
                                                    "seed-1.png", "seed-1.pt", "seed-1.pt.sha256", "summary.json", "summary.png"])
summary = json.loads((folder / "summary.json").read_text())
test_eq((summary["seeds"], summary["step"], len(summary["final"]["diagonality"]["mean"])), ([0, 1], 20, 3))
{k: summary["final"][k] for k in ("msve", "neu_population")}

# %%
#| fig-cap: "Figure F.1: The summary figure that the `pretrain` command writes for a run: value error, NEU, the last layer's value-update weights and kernel diagonality against training step, as mean and standard error over seeds (here a 20-step run on two seeds, too short to train)."
#| fig-alt: "Four panels against training step 0 to 20, seeds 0 and 1, means with standard-error bands: MSVE on held-out tasks; NEU at n = 30 and at n = infinity; layer 3's reward, successor-value and current-value weights; and the attention share on own state for layers 1 to 3. All curves are nearly flat."
Image(filename=str(folder / "summary.png"))

# %%
#| hide
import nbdev; nbdev.nbdev_export()
