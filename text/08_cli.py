# %%
#| default_exp cli

# %%
#| export
from __future__ import annotations
import argparse, json, sys
from dataclasses import asdict, fields
from pathlib import Path
from fastcore.docments import docments
import numpy as np
import torch
from ictd.boyan import check_gamma, plot_chain, random_boyan_chain
from ictd.convergence import (depth_experiment, diagonality_sweep, loglog_slope, plot_depth, plot_diagonality,
                              plot_floor, plot_rates, rate_experiment)
from ictd.linear import plot_side_by_side, side_by_side
from ictd.pretrain import PretrainConfig, plot_emergence, pretrain

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *

# %%
#| hide
import contextlib, io, tempfile
import matplotlib.image
from fastcore.xtras import working_directory


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
# | `ictd convergence` | the four experiments of chapter 5: error against depth, the floor against $n$, kernel diagonality against $\beta$, measured rate against the bound | `convergence-{depth,floor,diagonality,rates}.png`, `convergence.pt`, `convergence.json` |
# | `ictd pretrain` | the emergence of the TD construction in pretraining (chapter 6), one run per seed | `pretrain-seed{S}.png`, `pretrain-seed{S}.json`, `pretrain-{key}.pt` |
# | `ictd linear` | linear against softmax attention, MSVE against depth (chapter 7) | `linear.png`, `linear.pt`, `linear.json` |
# | `ictd all` | all of the above with their defaults | all of the above |
#
# Every command takes `--out DIR` (default `./ictd-results`) and prints the path of each file it
# writes. The `.json` files hold summary numbers, readable by anything; the `.pt` files hold every
# tensor, for `torch.load(path, weights_only=False)`. Pretraining is cached: a run is saved under
# a hash of its whole configuration (`config.key()`, a method of `PretrainConfig`), and running the
# same configuration again loads it instead of training.

# %% [markdown]
# ## Checking the options
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
# ## The parser
#
# One sub-command per experiment, each with the options of its compute function. The options of
# `ictd pretrain` are generated from the fields of `PretrainConfig`, so that every setting of a
# pretraining run can be given on the command line, and no option can drift out of step with it.

# %%
#| export
FEATURES = ("random", "unit", "onehot")
PRETRAIN_TYPES = dict(n_states=n_states_arg, d=positive_int, n=positive_int, n_layers=positive_int, gamma=discount,
                      lr=positive_float, weight_decay=natural_float, init_gain=positive_float, n_tasks=positive_int,
                      batch_size=positive_int, n_steps=natural_int, eval_every=positive_int, eval_tasks=positive_int)

def _option(name:str)->str: return "--" + name.replace("_", "-")

def _add_pretrain_options(p:argparse.ArgumentParser):
    "One option per field of `PretrainConfig`, with its default and documentation; `--seed` takes one or more seeds (one run each)."
    docs = docments(PretrainConfig)
    for f in fields(PretrainConfig):
        default = getattr(PretrainConfig(), f.name)
        if f.name == "shared": p.add_argument(_option(f.name), action="store_true", help=docs[f.name])
        elif f.name == "features": p.add_argument(_option(f.name), choices=FEATURES, default=default, help=docs[f.name])
        elif f.name == "seed": p.add_argument("--seed", type=natural_int, nargs="+", default=[0, 1, 2], help="one run per seed; " + docs[f.name])
        else: p.add_argument(_option(f.name), type=PRETRAIN_TYPES[f.name], default=default, help=docs[f.name])
    p.add_argument("--cache-dir", type=Path, default=None, help="folder of cached runs (default: %(default)s, meaning the --out folder)")


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
    p = sub.add_parser("convergence", parents=[common], formatter_class=fmt, help="the four experiments of chapter 5")
    p.add_argument("--n-tasks", type=positive_int, default=1000, help="tasks of experiments 1 and 2 (depth, floor)")
    p.add_argument("--ns", type=positive_int, nargs="+", default=[30, 100, 300, 1000, 3000, 10_000, 30_000], help="context lengths, increasing")
    p.add_argument("--n-layers", type=positive_int, default=100, help="maximal depth L of experiment 1")
    p.add_argument("--beta", type=positive_float, default=15., help="score scale, W = beta I, of experiments 1 and 2")
    p.add_argument("--alpha", type=step_size, default=1., help="step size of experiments 1 and 2")
    p.add_argument("--seed", type=natural_int, default=0, help="seed of the tasks of experiments 1 and 2")
    p.add_argument("--chunk", type=positive_int, default=200, help="tasks per batch (memory grows with chunk x max(ns))")
    p.add_argument("--diag-tasks", type=positive_int, default=200, help="tasks per feature kind of experiment 3")
    p.add_argument("--n-betas", type=_checked(int, lambda v: v >= 2, "an integer >= 2"), default=22, help="score scales of experiment 3")
    p.add_argument("--rate-tasks", type=positive_int, default=150, help="tasks per feature kind of experiment 4")
    p.add_argument("--rate-layers", type=_checked(int, lambda v: v >= 4, "an integer >= 4"), default=120, help="depth of experiment 4 (rate fitted on the second half)")
    p = sub.add_parser("pretrain", parents=[common], formatter_class=fmt, help="pretrain softmax Transformers on Boyan chains (chapter 6)")
    _add_pretrain_options(p)
    p = sub.add_parser("linear", parents=[common], formatter_class=fmt, help="linear against softmax in-context TD (chapter 7)")
    p.add_argument("--n-tasks", type=positive_int, default=100, help="random Boyan chains")
    p.add_argument("--n", type=positive_int, default=200, help="context length")
    p.add_argument("--depth", type=positive_int, default=60, help="deepest model")
    p.add_argument("--beta", type=positive_float, default=20., help="softmax score scale, W = beta I")
    p.add_argument("--alpha", type=step_size, default=1., help="step size of both constructions")
    p.add_argument("--seed", type=natural_int, default=0, help="first task seed")
    sub.add_parser("all", parents=[common], formatter_class=fmt, help="run every command above with its defaults")
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
for f in fields(PretrainConfig): assert _option(f.name) in pre_help, f.name
print(pre_help)


# %% [markdown]
# ## Writing results
#
# Each command saves figures as PNG, the numbers as JSON (tensors become nested lists) and, where
# there are large tensors, the whole result with `torch.save`; and prints each path.

# %%
#| export
def _jsonable(x):
    "`x` with tensors and numpy arrays turned into (nested) lists, for `json.dump`."
    if isinstance(x, (torch.Tensor, np.ndarray)): return x.tolist()
    if isinstance(x, (np.generic,)): return x.item()
    if isinstance(x, dict): return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)): return [_jsonable(v) for v in x]
    return x

def _save(obj, path:Path)->Path:
    "Save a figure (PNG), a dict as JSON (`.json`) or with `torch.save` (`.pt`); print and return the path."
    import matplotlib.pyplot as plt
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".png": obj.savefig(path, dpi=120, bbox_inches="tight"); plt.close(obj)
    elif path.suffix == ".json": path.write_text(json.dumps(_jsonable(obj), indent=1))
    else: torch.save(obj, path)
    print(f"wrote {path}", flush=True)
    return path


# %% [markdown]
# ## The commands
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

def run_convergence(args)->list:
    "`ictd convergence`: the four experiments of chapter 5."
    if args.ns != sorted(set(args.ns)): raise ValueError(f"argument --ns: must be increasing, got {args.ns}")
    progress = not args.no_progress
    sweep = depth_experiment(args.n_tasks, args.beta, args.alpha, args.ns, args.n_layers, seed=args.seed, chunk=args.chunk, progress=progress)
    diag = diagonality_sweep(args.diag_tasks, betas=torch.logspace(-1, 2.5, args.n_betas, dtype=torch.float64))
    rates = rate_experiment(args.rate_tasks, n_layers=args.rate_layers, fit_start=args.rate_layers // 2)
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
    if len(args.ns) > 1: figs.append(_save(plot_floor(sweep), o / "convergence-floor.png"))
    figs += [_save(plot_diagonality(diag), o / "convergence-diagonality.png"), _save(plot_rates(rates), o / "convergence-rates.png")]
    return figs + [_save(dict(depth=sweep, diagonality=diag, rates=rates), o / "convergence.pt"), _save(summary, o / "convergence.json")]

def run_linear(args)->list:
    "`ictd linear`: MSVE against depth of linear and softmax in-context TD (chapter 7)."
    curves = side_by_side(args.n_tasks, args.n, args.depth, args.beta, args.alpha, args.seed)
    summary = dict(settings=dict(n_tasks=args.n_tasks, n=args.n, depth=args.depth, beta=args.beta, alpha=args.alpha, seed=args.seed),
                   median_msve={k: c.median(0).values for k, c in curves.items()})
    return [_save(plot_side_by_side(curves, args.n), args.out / "linear.png"), _save(curves, args.out / "linear.pt"),
            _save(summary, args.out / "linear.json")]

def run_pretrain(args)->list:
    "`ictd pretrain`: one pretraining run per seed, cached by configuration, with its emergence figure."
    cache, paths = args.cache_dir or args.out, []
    for seed in args.seed:
        config = PretrainConfig(**{f.name: seed if f.name == "seed" else getattr(args, f.name) for f in fields(PretrainConfig)})
        checkpoint = Path(cache) / f"pretrain-{config.key()}.pt"
        if checkpoint.exists(): print(f"seed {seed}: loading the cached run {checkpoint}", flush=True)
        result = pretrain(config, progress=not args.no_progress, cache_dir=cache)
        h = result.history
        summary = dict(config=asdict(config), checkpoint=str(checkpoint), final={k: v[-1] for k, v in h.items()},
                       msve=h["msve"].flatten(), step=h["step"].flatten())
        paths += [_save(plot_emergence(result), args.out / f"pretrain-seed{seed}.png"), _save(summary, args.out / f"pretrain-seed{seed}.json")]
        print(f"checkpoint {checkpoint}", flush=True)
    return paths + [checkpoint]


# %%
show_doc(run_convergence)

# %%
show_doc(run_pretrain)

# %% [markdown]
# `main` parses the arguments and dispatches; `ictd all` runs each command with its defaults into
# the same folder. A `ValueError` raised by the library (an inconsistent combination of options that
# the parser cannot see alone) is reported like a parsing error: a message and exit status 2.

# %%
#| export
COMMANDS = dict(chain=run_chain, linear=run_linear, convergence=run_convergence, pretrain=run_pretrain)

def main(argv:list=None, # arguments after `ictd` (default: `sys.argv[1:]`)
        ):
    "Entry point of the `ictd` console script."
    parser = make_parser()
    args = parser.parse_args(argv)
    names = list(COMMANDS) if args.command == "all" else [args.command]
    for name in names:
        cmd_args = args if name == args.command else parser.parse_args([name, "--out", str(args.out)] + ["--no-progress"] * args.no_progress)
        try: COMMANDS[name](cmd_args)
        except ValueError as e: parser.error(f"{name}: {e}")


# %%
show_doc(main)

# %% [markdown]
# ## Trying it out
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


# %% [markdown]
# A bad value stops before anything runs, naming the option:

# %%
def exit_message(argv):
    "Exit status and error message of `main(argv)`."
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try: main(argv)
        except SystemExit as e: return e.code, err.getvalue().strip().splitlines()[-1]

for argv, msg in ((["linear", "--alpha", "2"], "argument --alpha: must be a step size in (0, 1]"),
                  (["convergence", "--ns", "300", "30"], "argument --ns: must be increasing"),
                  (["pretrain", "--n-steps", "-1"], "argument --n-steps: must be a non-negative integer"),
                  (["chain", "--features", "hexagonal"], "argument --features: invalid choice")):
    code, text = exit_message(argv)
    test_eq(code, 2)
    assert msg in text, text
text

# %% [markdown]
# ## Full scale
#
# In a terminal (these cells are not run when the book is built). On two CPU cores, `ictd chain`
# takes a few seconds, `ictd linear` about ten, `ictd convergence` (1000 tasks, contexts up to
# $n = 30\,000$, about 1 GB of memory per batch of 200 tasks) about a minute, and `ictd pretrain`
# (three seeds of 6000 steps) the longest, a few minutes per seed; a second `ictd pretrain` with
# the same options loads the cached runs. `ictd all` runs the four.

# %%
#| eval: false
# !ictd convergence --out results
# !ictd pretrain --seed 0 1 2 --out results
# !ictd linear --n-tasks 300 --out results

# %% [markdown]
# And from Python, the same functions the commands call, e.g. experiment 1 of chapter 5 at full
# scale with a progress bar:

# %%
#| eval: false
sweep = depth_experiment(1000, ns=[30, 100, 300, 1000, 3000, 10_000, 30_000], progress=True)
plot_depth(sweep);

# %%
#| hide
import nbdev; nbdev.nbdev_export()
