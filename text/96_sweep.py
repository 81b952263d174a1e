# %%
#| default_exp sweep

# %%
#| export
from __future__ import annotations
import csv, io, itertools, json, math, os, re, socket, time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
import torch
from tqdm.auto import tqdm
from ictd.core import OKABE_ITO, plain_log_ticks, atomic_savefig, atomic_write_text, check_fields, check_seeds, check_type, jsonable, provenance
from ictd.engine import PretrainConfig
from ictd.pretrain import pretrain_many, run_folder

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *

# %%
#| hide
import tempfile
import matplotlib.pyplot as plt
from IPython.display import Markdown

# %% [markdown]
# # Sweeps
# > `ictd sweep SPEC`: a grid of configurations times seeds from a small spec file, each cell trained (or read from the cache) by the engine, locally or spread over a Dask cluster, with one table and one figure across the grid.

# %% [markdown]
# `ictd sweep SPEC` trains a grid of configurations, each on its seeds, from a spec file a few lines long, and writes
# one table and one figure across the grid. Each **cell** (a configuration with all its seeds, batched in one engine
# run) is trained exactly as `ictd pretrain` trains it and cached in the same folders: a finished cell is read back,
# an interrupted one resumes from its checkpoint. The cells run one after another here, or side by side on the
# workers of a [Dask](https://distributed.dask.org) cluster (`--cluster local:N`, `--scheduler ADDRESS`), to the same bits.

# %% [markdown]
# ## A spec file
#
# A spec is TOML (read with the standard library's `tomllib`, Python 3.11 and later) or JSON, with the same
# structure either way: the seeds of every cell, a `[base]` table of changes to `PretrainConfig`'s defaults (chapter
# 6's [configuration](engine.html#what-a-run-is)), one or more `[[grid]]` tables whose every combination of values is a
# cell (a grid may give its own `seeds`), and what the figure plots. The tiny sweep this page runs:

# %%
print(Path("../sweeps/tiny.toml").read_text())

# %%
#| export
SPEC_KEYS = ("name", "seeds", "base", "grid", "plot")           # the top-level keys of a spec
SETTINGS = tuple(f.name for f in fields(PretrainConfig) if f.name != "seed")   # what a spec's base and grids may set

def load_spec(path)->dict:
    "A sweep spec read from a TOML (`.toml`) or JSON (`.json`) file."
    path = Path(path)
    if path.suffix == ".json": return json.loads(path.read_text())
    if path.suffix != ".toml": raise ValueError(f"`path` must name a .toml or .json spec file, got {str(path)!r}")
    try: import tomllib
    except ImportError:
        try: import tomli as tomllib
        except ImportError: raise ValueError(f"`path`: reading TOML needs Python 3.11 or `pip install tomli`; or write {path.name} as JSON") from None
    return tomllib.loads(path.read_text())


# %% [markdown]
# Seeds are given as in `ictd pretrain --seeds`: a list of integers, or a string of ranges such as `"0-9,20"`.

# %%
#| export
def parse_seeds(seeds, name:str="seeds")->list:
    "A list of distinct seeds from a list of integers or a string of ranges ('0-9', '0,3,5', '0-4,10'); a `ValueError` naming `name` otherwise."
    if isinstance(seeds, str):
        out = []
        for part in seeds.split(","):
            lo, sep, hi = part.strip().partition("-")
            try: first, last = int(lo), int(hi if sep else lo)
            except ValueError: raise ValueError(f"`{name}` must be seeds like '0-29' or '0,3,5', got {seeds!r}") from None
            if first < 0 or last < first: raise ValueError(f"`{name}` must be increasing ranges of non-negative seeds, got {seeds!r}")
            out += range(first, last + 1)
        seeds = out
    try: return check_seeds(seeds)
    except (TypeError, ValueError) as e: raise ValueError(f"`{name}`: {e}") from None

def seed_text(seeds)->str:
    "Seeds written compactly as ranges, e.g. [0, 1, 2, 5] -> '0-2,5' (what `parse_seeds` reads)."
    out = []
    for s in sorted(check_seeds(seeds)):
        if out and s == out[-1][1] + 1: out[-1][1] = s
        else: out.append([s, s])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)


# %% [markdown]
# A cell is a configuration and its seeds. `expand_spec` validates the spec (a `ValueError` naming the key at
# fault, or `PretrainConfig`'s own naming the field) and expands every grid. Cells that two grids share (the same
# configuration) are one cell, with the union of their seeds, so that a grid "one factor at a time around the
# headline" can list the headline's value without training it twice.

# %%
#| export
@dataclass(frozen=True)
class SweepCell:
    "One cell of a sweep: a configuration (its seed unused) and the seeds trained with it."
    config:PretrainConfig  # every setting but the seed
    seeds:tuple            # the cell's seeds, increasing

    def __post_init__(self): check_fields(self); object.__setattr__(self, "seeds", tuple(check_seeds(self.seeds)))

def _grids(spec:dict)->list:
    "The spec's grids as a list of tables (a single table, or none, allowed)."
    grids = spec.get("grid", [{}])
    grids = [grids] if isinstance(grids, dict) else grids
    if not isinstance(grids, list) or not grids or not all(isinstance(g, dict) for g in grids):
        raise ValueError(f"`grid` must be a table or a non-empty list of tables, got {grids!r}")
    return grids

def _check_spec(spec:dict):
    "Refuse unknown keys, settings that are not fields of PretrainConfig, and axes that are not non-empty lists."
    check_type(spec, dict, "spec")
    if unknown := set(spec) - set(SPEC_KEYS): raise ValueError(f"`spec` has unknown keys {sorted(unknown)} (allowed: {list(SPEC_KEYS)})")
    if "name" in spec and not (isinstance(spec["name"], str) and re.fullmatch(r"[\w.-]+", spec["name"])):
        raise ValueError(f"`name` must be letters, digits, '_', '-' or '.' (it names the results' folder), got {spec['name']!r}")
    base = spec.get("base", {})
    if not isinstance(base, dict) or (bad := set(base) - set(SETTINGS)): raise ValueError(f"`base` may set only fields of PretrainConfig but the seed, got {base!r}")
    for g in _grids(spec):
        if bad := set(g) - set(SETTINGS) - {"seeds"}: raise ValueError(f"`grid` axes must be fields of PretrainConfig (not the seed), got {sorted(bad)}")
        for k, v in g.items():
            if k != "seeds" and (not isinstance(v, list) or not v): raise ValueError(f"`grid` axis `{k}` must be a non-empty list of values, got {v!r}")

def sweep_axes(spec:dict)->list:
    "The settings that some grid of the spec varies, in order of appearance."
    return list(dict.fromkeys(k for g in _grids(spec) for k in g if k != "seeds"))

def grid_cells(spec:dict, grid:dict)->list:
    "The (configuration, seeds) of every combination of one grid's axes, in order (the last axis varying fastest)."
    base, axes = spec.get("base", {}), [k for k in grid if k != "seeds"]
    seeds = parse_seeds(grid.get("seeds", spec.get("seeds", [0])), "seeds")
    return [(PretrainConfig(**(base | dict(zip(axes, values)))), seeds) for values in itertools.product(*(grid[k] for k in axes))]

def expand_spec(spec:dict)->list:
    "The cells of a spec: every combination of every grid's axes over `base`, cells that grids share merged (union of seeds), in order of first appearance."
    _check_spec(spec)
    merged = {}
    for g in _grids(spec):
        for config, seeds in grid_cells(spec, g): merged.setdefault(config, set()).update(seeds)
    return [SweepCell(c, tuple(sorted(s))) for c, s in merged.items()]


# %% [markdown]
# A cell is named by the values it takes on the sweep's axes. The tiny spec, read and expanded (`load_spec` reads the
# file, `expand_spec` turns it into cells):

# %%
#| export
def cell_label(cell:SweepCell, axes:list)->str:
    "The cell's values on `axes`, e.g. 'n_layers = 2, lr = 0.01' ('base' when there are none)."
    return ", ".join(f"{k} = {getattr(cell.config, k)}" for k in axes) or "base"


# %%
tiny = load_spec("../sweeps/tiny.toml")
cells = expand_spec(tiny)
[(cell_label(c, sweep_axes(tiny)), c.seeds) for c in cells]


# %% [markdown]
# ## Running it here
#
# `run_sweep` runs the cells and returns one record per cell: its final metrics for every seed, whether it was
# trained, resumed or read from the cache, and its wall time. Each cell goes through `run_cell`, which is also what a
# cluster's worker runs: chapter 6's `pretrain_many` on the cell's seeds with the cache and checkpoints,
# on a fixed number of torch threads (one by default: the same kernels, so the same bits, wherever it runs), and a
# record of a few numbers sent back: each seed's final value of every metric, how the cell was obtained, its wall
# time and the process that ran it.

# %%
#| export
def run_cell(config:PretrainConfig,    # every setting but the seed
             seeds,                    # the cell's seeds
             cache_dir,                # folder of cached runs, `<cache_dir>/<config.key()>/` (shared by every worker)
             checkpoint_every:int=None,# steps between checkpoints (None: none)
             threads:int=1,            # torch threads while the cell trains
             callback=None,            # called as `callback(step)` after each optimiser step (tests use it)
            )->dict:                   # key, seeds, status ('cached', 'resumed' or 'trained'), final (metric -> per-seed values), wall_s, pid, host
    "Train one cell (or read it from the cache, or resume it), and return its final metrics for every seed."
    seeds, folder = list(seeds), run_folder(cache_dir, config)
    cached = all((folder / f"seed-{s}.pt").exists() for s in seeds)
    resumed = not cached and any(folder.glob("checkpoint-*.pt"))
    threads_before, t0 = torch.get_num_threads(), time.time()
    torch.set_num_threads(threads)
    try: results = pretrain_many(config, seeds, progress=False, cache_dir=cache_dir, checkpoint_every=checkpoint_every, callback=callback)
    finally: torch.set_num_threads(threads_before)
    final = {k: [r.history[k][-1].tolist() for r in results] for k in results[0].history if k != "step"}
    return dict(key=config.key(), seeds=seeds, status="cached" if cached else "resumed" if resumed else "trained", final=final,
                step=int(results[0].history["step"][-1]), wall_s=time.time() - t0, pid=os.getpid(), host=socket.gethostname())


# %% [markdown]
# Locally the cells run one after another; with a Dask `client`, each cell is one task (`Client.submit`), and the
# records come back as the tasks finish (`as_completed`), in any order, and are put back in the cells' order. A
# worker that dies while it runs a cell (a killed process, a preempted job) is removed by the scheduler, and its
# task goes to another worker (the scheduler gives up on a task after `distributed.scheduler.allowed-failures`
# such deaths, three by default); the cache folder must be one that every worker sees.

# %%
#| export
def run_sweep(cells:list,                # the cells (`expand_spec`)
              cache_dir,                 # folder of cached runs, seen by every worker
              client=None,               # a `distributed.Client`; None: run here, one cell after another
              checkpoint_every:int=None, # steps between checkpoints of each cell (None: none)
              threads:int=1,             # torch threads of each cell
              callback=None,             # passed to every cell's `run_cell`
              progress:bool=True,        # show a progress bar over cells
             )->list:                    # one `run_cell` record per cell, in the cells' order
    "Run every cell of a sweep, here or as one Dask task per cell, each through the engine's cache and checkpoints."
    for c in cells: check_type(c, SweepCell, "cells")
    args = lambda c: (c.config, list(c.seeds), str(cache_dir), checkpoint_every, threads, callback)
    bar = tqdm(total=len(cells), disable=not progress, desc="sweep cells")
    if client is None:
        out = []
        for c in cells: out.append(run_cell(*args(c))); bar.update()
        bar.close()
        return out
    from distributed import as_completed
    futures = {client.submit(run_cell, *args(c), key=f"ictd-cell-{i}-{c.config.key()}-{seed_text(c.seeds)}", pure=False): i for i, c in enumerate(cells)}
    out = [None] * len(cells)
    for f in as_completed(futures): out[futures[f]] = f.result(); bar.update()
    bar.close()
    return out


# %% [markdown]
# The tiny sweep, in this process, into a temporary cache:

# %%
cache = Path(tempfile.mkdtemp())
records = run_sweep(cells, cache, progress=False)
[(cell_label(c, sweep_axes(tiny)), r["status"]) for c, r in zip(cells, records)]

# %% [markdown]
# A second run of the same spec trains nothing: every cell is read from the cache.

# %%
again = run_sweep(cells, cache, progress=False)
test_eq([r["final"] for r in again], [r["final"] for r in records])     # the same numbers, read back
[r["status"] for r in again]


# %% [markdown]
# The summary table has one row per cell: the grid's axes, the seeds, how the cell was obtained, and the mean and
# standard error over seeds of every scalar metric at the end of training (`ictd sweep` writes it as `sweep.csv`,
# and every seed's numbers in `sweep.json`):

# %%
#| export
def sweep_table(cells:list,    # the cells
                records:list,  # their `run_cell` records, in the same order
                axes:list,     # the sweep's axes (`sweep_axes`)
               )->list:        # one dict per cell
    "One row per cell: its values on the axes, key, seeds, status, wall time, and mean and standard error over seeds of each scalar metric."
    rows = []
    for c, r in zip(cells, records):
        row = {k: getattr(c.config, k) for k in axes} | dict(key=r["key"], seeds=seed_text(r["seeds"]), status=r["status"], wall_s=round(r["wall_s"], 2))
        for k, per_seed in r["final"].items():
            x = torch.tensor(per_seed, dtype=torch.float64).reshape(len(per_seed), -1)
            if x.shape[1] != 1: continue
            row[f"{k}_mean"] = x.mean().item()
            row[f"{k}_se"] = (x.std() / math.sqrt(len(x))).item() if len(x) > 1 else None
        rows.append(row)
    return rows


# %% [markdown]
# The table is shown on a page as Markdown, and written as CSV (floats as Python's `repr`, which reads back to the
# same bits):

# %%
#| export
def markdown_table(rows:list, columns:list)->str:
    "A Markdown table of `columns` of `rows` (numbers to 4 significant digits)."
    show = lambda v: "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)
    return "\n".join(["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + ["| " + " | ".join(show(r.get(k)) for k in columns) + " |" for r in rows])

def csv_text(rows:list)->str:
    "The rows as CSV, with the union of their keys as the header (floats written with `repr`, exact)."
    columns = list(dict.fromkeys(k for r in rows for k in r))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(columns)
    for r in rows: w.writerow(["" if r.get(k) is None else repr(r[k]) if isinstance(r[k], float) else r[k] for k in columns])
    return buf.getvalue()


# %%
rows = sweep_table(cells, records, sweep_axes(tiny))
Markdown(markdown_table(rows, sweep_axes(tiny) + ["seeds", "status", "msve_mean", "msve_se"]))


# %% [markdown]
# And the figure across the grid: one panel per grid that has axes, the spec's `[plot]` metric against its `x` axis
# (or the grid's first axis), one line per combination of the grid's other axes, with error bars of one standard
# error over seeds; a cell that two grids share appears in both panels.

# %%
#| export
def _as_axis(values:list)->tuple:
    "Positions on the horizontal axis and their labels: the values themselves if they are all numbers, else 0, 1, ..."
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    return (list(values) if numbers else list(range(len(values)))), [str(v) for v in values], numbers

NAMES = dict(n_layers="depth L", n="context length n", gamma="discount factor", lr="learning rate", objective="objective", features="features",
             msve="held-out MSVE", neu="NEU at the training n", neu_population="NEU at n = infinity", loss="training loss")   # axis titles

def plot_sweep(spec:dict,    # the spec (its grids and `[plot]` table: `x`, `metric`)
               cells:list,   # its cells
               records:list, # their records
              ):             # the matplotlib figure
    "The spec's metric at the end of training against an axis of each grid, one line per combination of the grid's other axes, mean and standard error over seeds."
    import matplotlib.pyplot as plt
    opts = spec.get("plot", {})
    metric, want_x = opts.get("metric", "msve"), opts.get("x")
    by_config = {c.config: r for c, r in zip(cells, records)}
    grids = [g for g in _grids(spec) if any(k != "seeds" for k in g)]
    cols = min(2, len(grids)); rows = math.ceil(len(grids) / cols)        # two panels a row, readable at page width
    fig, axs = plt.subplots(rows, cols, figsize=(4.8 * cols, 3.6 * rows), squeeze=False)
    for ax in axs.flat[len(grids):]: ax.remove()
    for ax, g in zip(axs.flat, grids):
        axes = [k for k in g if k != "seeds"]
        x = want_x if want_x in axes else axes[0]
        others = [k for k in axes if k != x]
        pos, labels, numeric = _as_axis(g[x])
        combos = list(itertools.product(*(g[k] for k in others)))
        width = 0.04 * ((max(pos) - min(pos)) or 1)              # lines side by side at each value, so that their error bars stay apart
        for j, combo in enumerate(combos):
            fixed = dict(zip(others, combo))
            ys = []
            for v in g[x]:
                per_seed = torch.tensor(by_config[PretrainConfig(**(spec.get("base", {}) | fixed | {x: v}))]["final"][metric], dtype=torch.float64).flatten()
                ys.append((per_seed.mean().item(), per_seed.std().item() / math.sqrt(len(per_seed)) if len(per_seed) > 1 else 0.))
            m, se = zip(*ys)
            ax.errorbar([p + width * (j - (len(combos) - 1) / 2) for p in pos], m, yerr=se, marker="o", capsize=3, color=OKABE_ITO[j % len(OKABE_ITO)],
                        label=", ".join(f"{k} = {v}" for k, v in fixed.items()) or None)
        ax.set(xlabel=f"{NAMES.get(x, x)} ({x})", ylabel=f"{NAMES.get(metric, metric)} at the end of training", yscale="log" if metric in ("msve", "neu_population", "loss") else "linear")
        ax.set_xticks(pos, labels)
        plain_log_ticks(ax, "y")
        if others: ax.legend(fontsize=8)
    fig.suptitle(f"Sweep {spec.get('name', '')}: mean and standard error over seeds".replace("  ", " "))
    fig.tight_layout()
    return fig


# %%
#| fig-cap: "Figure G.1: The tiny sweep's figure: held-out MSVE at the end of training against depth, one line per learning rate, mean and standard error over two seeds (40 steps, too short to train)."
#| fig-alt: "One panel: MSVE on a log scale against depth L = 1 and 2, two lines for learning rates 0.01 and 0.001, with error bars over two seeds."
fig = plot_sweep(tiny, cells, records)


# %% [markdown]
# `write_sweep` writes the three files of a sweep, each atomically: `sweep.json` (the provenance, the spec, the
# table, and every cell's configuration and per-seed final metrics), `sweep.csv` (the table) and `sweep.png`.

# %%
#| export
def write_sweep(out_dir,          # folder of the three files
                spec:dict,        # the spec
                cells:list,       # its cells
                records:list,     # their records
                command:str,      # recorded in the provenance
                **extra,          # also recorded in the provenance (the cluster, its workers)
               )->list:           # the paths written
    "Write `sweep.json`, `sweep.csv` and `sweep.png` for a finished sweep, each atomically, with `provenance()`."
    import matplotlib.pyplot as plt
    out, axes = Path(out_dir), sweep_axes(spec)
    rows = sweep_table(cells, records, axes)
    data = dict(provenance=provenance(command, **extra), spec=spec, axes=axes, table=rows,
                cells=[dict(config=asdict(c.config) | dict(seed=None), **r) for c, r in zip(cells, records)])
    paths = [atomic_write_text(out / "sweep.json", json.dumps(jsonable(data), indent=1)), atomic_write_text(out / "sweep.csv", csv_text(rows))]
    fig = plot_sweep(spec, cells, records)
    paths.append(atomic_savefig(fig, out / "sweep.png", dpi=120, bbox_inches="tight"))
    plt.close(fig)
    return paths


# %% [markdown]
# The tiny sweep above, written and read back: the CSV holds one row per cell and the JSON every seed's numbers.

# %%
_out = Path(tempfile.mkdtemp())
_paths = write_sweep(_out, tiny, cells, records, command="appendix G")
test_eq(sorted(p.name for p in _out.iterdir()), ["sweep.csv", "sweep.json", "sweep.png"])
_saved = json.loads((_out / "sweep.json").read_text())
test_eq([c["final"] for c in _saved["cells"]], [r["final"] for r in records])
test_eq(len(list(csv.DictReader(io.StringIO((_out / "sweep.csv").read_text())))), len(cells))
test_eq(_saved["provenance"]["command"], "appendix G")


# %% [markdown]
# ## On a cluster
#
# The cells are independent, so a cluster runs them side by side: each cell is one task, trained on one worker with
# every seed batched, its files written into the shared cache folder. On one machine, `--cluster local:N` starts a
# local Dask cluster of N single-threaded worker processes; `--scheduler ADDRESS` uses a running one:
#
# ```sh
# ictd sweep sweeps/contest.toml --cluster local:16 --out results     # 16 worker processes on this machine
# ictd sweep sweeps/contest.toml --scheduler tcp://10.0.0.5:8786 --out /shared/results
# ```
#
# What the test checks (`tests/test_sweep.py`, on a scheduler and two worker processes on loopback): the sweep's
# per-seed metrics and trained parameters equal those of the local run bit for bit, and a worker killed by its process
# id while it trains a cell loses nothing: Dask gives the lost worker's task to a live worker, which resumes the cell
# from its last checkpoint, and the final table equals the local one, with every cell present.

# %% [markdown]
# `start_client` makes the client of `ictd sweep`'s options: a local cluster of `n` single-threaded worker
# processes on loopback (`local:N`), or a connection to a running scheduler.

# %%
#| export
def start_client(scheduler:str=None,   # address of a running Dask scheduler, e.g. 'tcp://10.0.0.5:8786'
                 cluster:str=None,     # 'local:N': start a local cluster of N worker processes, one thread each
                ):                     # a `distributed.Client`, or None for neither (run here)
    "The Dask client of `--scheduler` or `--cluster local:N` (None when neither is given)."
    if scheduler is not None and cluster is not None: raise ValueError("give `scheduler` or `cluster`, not both")
    if scheduler is None and cluster is None: return None
    if cluster is not None and not (cluster.startswith("local:") and cluster[6:].isdigit() and int(cluster[6:]) >= 1):
        raise ValueError(f"`cluster` must be 'local:N' with N >= 1 worker processes, got {cluster!r}")
    which = "scheduler" if scheduler is not None else "cluster"
    try: from distributed import Client, LocalCluster
    except ImportError: raise ValueError(f"`{which}` needs Dask distributed: pip install 'distributed>=2024.1'") from None
    if scheduler is not None:
        from distributed.comm import parse_address, parse_host_port
        try:
            scheme, where = parse_address(scheduler)
            if scheme in ("tcp", "tls"): parse_host_port(where)   # host:port
        except (ValueError, TypeError) as e: raise ValueError(f"`scheduler` must be the address of a Dask scheduler, e.g. 'tcp://10.0.0.5:8786': {e}") from None
        return Client(scheduler)
    return Client(LocalCluster(n_workers=int(cluster[6:]), threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None))

def stop_client(client):
    "Close a client of `start_client`, and the local cluster it started (a running scheduler's cluster is left running)."
    if client is None: return
    try: from distributed import Client
    except ImportError: raise TypeError(f"`client` must be a client of `start_client` or None, got {type(client).__name__}") from None
    cluster = check_type(client, Client, "client").cluster
    client.close()
    if cluster is not None: cluster.close()


# %% [markdown]
# **On a SLURM cluster** ([dask-jobqueue](https://jobqueue.dask.org), `pip install dask-jobqueue`), from a login node,
# a short Python script asks SLURM for worker jobs, each of which connects back to the scheduler in the script; the
# cache folder must be on a file system every node sees:

# %%
#| eval: false
from dask_jobqueue import SLURMCluster
from distributed import Client

# %%
#| eval: false
cluster = SLURMCluster(cores=4, processes=4, memory="16GB", walltime="04:00:00",   # 4 single-threaded workers per job
                       job_extra_directives=["--partition=cpu"], job_script_prologue=["export OMP_NUM_THREADS=1"])
cluster.scale(jobs=5)                                                               # 20 workers, one cell each at a time
spec = load_spec("sweeps/contest.toml")
cells = expand_spec(spec)
records = run_sweep(cells, "/scratch/me/ictd-cache", client=Client(cluster), checkpoint_every=200)
write_sweep("/scratch/me/results", spec, cells, records, command="SLURMCluster, 5 jobs x 4 workers")


# %% [markdown]
# Inside one allocation (`sbatch` with `--ntasks`), the same works without dask-jobqueue: `srun` starts
# `dask scheduler --scheduler-file sched.json` on one task and `dask worker --scheduler-file sched.json --nthreads 1`
# on the others, and `ictd sweep SPEC --scheduler $(python -c "import json; print(json.load(open('sched.json'))['address'])")`
# runs the sweep. A job that SLURM preempts or that reaches its wall time is a lost worker: its cell goes to another
# worker and resumes from its checkpoint (`--checkpoint-every`, 500 steps by default).

# %% [markdown]
# ### Why Dask and not Ray
#
# Both run Python functions on a pool of worker processes and move a lost worker's tasks elsewhere. Their per-task
# overhead was measured here on a local cluster of two single-threaded worker processes (`ictd sweep --overhead`).
# `task_overhead` starts a local cluster of one engine (two single-threaded worker processes), and measures the
# start-up, the round trip of one empty task submitted after the previous one returned (median), and the time per
# task of many empty tasks submitted at once. `ictd sweep --overhead` runs it for both engines (Ray only where
# `import ray` works) and writes `sweep_overhead.json`.

# %%
#| export
def _noop(i): return i

def task_overhead(engine:str,         # "dask" or "ray"
                  n_tasks:int=500,    # empty tasks submitted at once
                  n_round_trips:int=50, # empty tasks submitted one after another
                  workers:int=2,      # worker processes of the local cluster
                 )->dict:             # seconds: start, round_trip (median), per_task; the engine's version
    "Seconds to start a local cluster of `workers` processes, the median round trip of one empty task, and the time per task of `n_tasks` at once."
    t0 = time.perf_counter()
    if engine == "dask":
        import distributed
        client = distributed.Client(distributed.LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None))
        submit, gather, version = (lambda i: client.submit(_noop, i, pure=False)), client.gather, distributed.__version__
        client.wait_for_workers(workers)
    elif engine == "ray":
        import ray
        ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
        remote = ray.remote(num_cpus=1)(_noop)
        submit, gather, version = remote.remote, ray.get, ray.__version__
    else: raise ValueError(f"`engine` must be 'dask' or 'ray', got {engine!r}")
    gather([submit(i) for i in range(2 * workers)])                 # every worker up and warm
    start = time.perf_counter() - t0
    trips = []
    for i in range(n_round_trips):
        t = time.perf_counter(); gather(submit(i)); trips.append(time.perf_counter() - t)
    t = time.perf_counter()
    assert gather([submit(i) for i in range(n_tasks)]) == list(range(n_tasks))
    per_task = (time.perf_counter() - t) / n_tasks
    if engine == "dask": client.cluster.close(); client.close()
    else: ray.shutdown()
    return dict(version=version, start_s=start, round_trip_s=sorted(trips)[len(trips) // 2], per_task_s=per_task, n_tasks=n_tasks, workers=workers)


# %% [markdown]
# The installed size of each engine is that of the files its own distributions installed (`distributed` and `dask`;
# `ray`), read from the package metadata; the dependencies they pull in are not counted.

# %%
#| export
def installed_mb(*dists:str)->float:
    "The size in MB of the files the named installed distributions list in their metadata (RECORD)."
    from importlib import metadata
    total = 0
    for name in dists:
        d = metadata.distribution(name)
        total += sum((d.locate_file(f).stat().st_size for f in (d.files or []) if d.locate_file(f).exists()))
    return total / 1e6


# %%
#| export
ENGINES = dict(dask=("distributed", "dask"), ray=("ray",))   # each engine's own distributions

def measure_overheads(out_dir,            # folder of `sweep_overhead.json`
                      command:str,        # recorded in the provenance
                      n_tasks:int=500,    # empty tasks submitted at once
                     )->Path:             # the file written
    "Measure `task_overhead` and the installed size of every engine that imports here (the others with the error), and write `sweep_overhead.json`."
    engines = {}
    for name, dists in ENGINES.items():
        try: engines[name] = task_overhead(name, n_tasks) | dict(installed_mb=installed_mb(*dists))
        except ImportError as e: engines[name] = dict(error=f"not installed here ({e})")
    data = dict(provenance=provenance(command), n_tasks=n_tasks, load=list(os.getloadavg()), engines=engines)
    return atomic_write_text(Path(out_dir) / "sweep_overhead.json", json.dumps(jsonable(data), indent=1))


# %%
#| export
def overhead_report(data:dict)->str:
    "The page's Markdown for `sweep_overhead.json`: each engine's start-up, round trip and time per task, and its provenance."
    rows = [dict(engine=f"{k} {v['version']}", start=f"{v['start_s']:.1f} s", trip=f"{v['round_trip_s'] * 1e3:.2f} ms", per=f"{v['per_task_s'] * 1e3:.2f} ms",
                 size=f"{v['installed_mb']:.0f} MB" if v.get("installed_mb") else "") for k, v in data["engines"].items() if "error" not in v]
    missing = [f"{k}: {v['error']}" for k, v in data["engines"].items() if "error" in v]
    head = ["engine", "start-up, 2 workers", "one task's round trip (median)", "time per task, many at once", "installed size"]
    tab = markdown_table([dict(zip(head, r.values())) for r in rows], head)
    p = data["provenance"]
    return (tab + ("\n\nNot measured: " + "; ".join(missing) if missing else "") +
            f"\n\nMeasured by `{p['command']}` on {p['date'][:10]}, {p['cpu']}, commit `{str(p['commit'])[:10]}`, with {data['n_tasks']} empty tasks at once and the load average {data['load'][0]:.1f}.")


# %%
overhead_file = Path("data/sweep_overhead.json")
overhead = json.loads(overhead_file.read_text()) if overhead_file.exists() else None
Markdown(overhead_report(overhead) if overhead else "No `data/sweep_overhead.json` yet: run `ictd sweep --overhead --out nbs/data`.")

# %% [markdown]
# Ray is the faster of the two per task. That does not matter here: a sweep sends one task per cell, and the contest's
# cells trained for minutes each (the wall times that appendix D's `run_contest_runs` recorded):

# %%
walls = [v["wall_s"] for f in ("contest_runs.json", "contest_runs2.json") for v in json.loads(Path("data", f).read_text())["cells"].values()]
if overhead and "error" not in overhead["engines"].get("ray", {"error": ""}):
    d, r = overhead["engines"]["dask"], overhead["engines"]["ray"]
    text = (f"Ray's time per task is {d['per_task_s'] / r['per_task_s']:.0f} times smaller than Dask's, and its round trip {d['round_trip_s'] / r['round_trip_s']:.0f} "
            f"times; but Dask's round trip, {d['round_trip_s'] * 1e3:.0f} ms, is {d['round_trip_s'] / min(walls):.2%} of the shortest of the "
            f"{len(walls)} cells that `run_contest_runs` trained ({min(walls):.0f} s; the longest took {max(walls):.0f} s). Dask started {r['start_s'] / d['start_s']:.0f} times faster, "
            f"and installs {r['installed_mb'] / d['installed_mb']:.0f} times fewer megabytes.")
else: text = f"The contest's {len(walls)} trained cells took {min(walls):.0f} to {max(walls):.0f} s each."
Markdown(text)

# %% [markdown]
# What decides is the cluster. `distributed` is pure Python on top of packages the book already uses, and
# `dask-jobqueue` turns SLURM (and PBS, SGE, LSF) jobs into workers from an ordinary Python session on a login node:
# `SLURMCluster.scale` submits and cancels the worker jobs, each of which connects back to the scheduler over TCP, and
# the scheduler is a plain process, so there is no head node to place. Ray's documented set-up on SLURM is a batch
# script that starts `ray start --head` on the allocation's first node and `ray start --address` on the others, inside
# one allocation whose size is fixed when it is submitted; Ray itself has no counterpart of `scale` for SLURM jobs.
# And a sweep needs none of what Ray adds (actors, a distributed object store): one task per cell, the results a
# few numbers each.

# %% [markdown]
# ## What is cached, and what resumes
#
# - **A cell is a configuration.** Its runs live in `<cache>/<config.key()>/`, the folder of `ictd pretrain`
#   (chapter 6): `config.json`, then `seed-S.pt` for each finished seed. `config.key()` hashes every setting but the
#   seed, the package version and its source, so a changed setting or a changed code trains afresh and never reads an
#   old result. `ictd pretrain` and `ictd sweep` share the folders: a seed either trained is the other's cache.
# - **A finished seed is read, not retrained.** A cell whose seeds are all cached reports `cached`; a cell with some
#   seeds cached trains only the others.
# - **An interrupted cell resumes.** With `checkpoint_every`, the engine saves the whole state of the cell's run
#   (parameters, Adam's moments, each seed's generators, the history) every so many steps; a cell started again, on
#   any worker, continues from there and ends exactly where an uninterrupted run ends
#   ([chapter 6](pretrain.html#the-cache-resuming-and-divergence)), and reports `resumed`.
# - **The summary is always rewritten** from the cells' records, atomically (`sweep.json`, `sweep.csv`, `sweep.png`,
#   each written whole and then moved onto its name), with `provenance()`: the command, commit, date and machine.

# %% [markdown]
# ## The mechanism contest as a sweep
#
# `sweeps/contest.toml` specifies the contest of chapter 6b (issue 30): the base is `EMERGENCE`, the first grid is
# depth times objective, a grid without axes gives the headline cell forty seeds, and three one-factor grids move
# $n$, $\gamma$ and the features around it:

# %%
print(Path("../sweeps/contest.toml").read_text())

# %% [markdown]
# It expands to the contest's twenty cells, with the seeds each was trained on. Appendix D's `contest_cells` gathers
# the same cells from the studies that trained them (the headline's seeds 0 to 19 from `mechanism_runs.json`, 20 to
# 39 from `contest_runs.json`, the depth sweep, the controls, the one-factor cells); the cells and seeds the contest
# measured are in `data/contest_stats*.json`, and the spec's cells are exactly those (their training settings equal,
# seed for seed):

# %%
contest = load_spec("../sweeps/contest.toml")
contest_cells_ = expand_spec(contest)
saved = {}
for name in ("contest_stats.json", "contest_stats_sweep.json", "contest_stats_sweep2.json"):
    saved.update(json.loads(Path("data", name).read_text())["cells"])
def training_settings(config): return {k: v for k, v in config.items() if k not in ("seed", "eval_tasks")}   # the contest measured on fewer held-out tasks
spec_cells = {json.dumps(training_settings(asdict(c.config)), sort_keys=True): list(c.seeds) for c in contest_cells_}
saved_cells = {json.dumps(training_settings(v["config"]), sort_keys=True): v["seeds"] for v in saved.values()}
test_eq(spec_cells, saved_cells)
Markdown(markdown_table([dict(cell=cell_label(c, sweep_axes(contest)), seeds=seed_text(c.seeds)) for c in contest_cells_], ["cell", "seeds"])
         + f"\n\n{len(contest_cells_)} cells, {sum(len(c.seeds) for c in contest_cells_)} runs of {contest['base']['n_steps']} steps.")

# %% [markdown]
# After the training, the contest measures every cell's models (`run_contest`, appendix D), an analysis the sweep
# does not do: the sweep's table gives each cell's MSVE, NEU and the other metrics of the engine.

# %% [markdown]
# ## Implementation and tests
#
# The checks of the spec's parsing and validation, of the client's options, of the CSV's exactness, and of the figure
# on the contest's grid. `tests/test_sweep.py` runs a sweep on a real local cluster (the equality with this process's
# run, the killed worker) and the command line.

# %%
test_eq(parse_seeds("0-2,7"), [0, 1, 2, 7])
test_eq(parse_seeds([3, 1]), [3, 1])
test_eq(parse_seeds(seed_text([9, 0, 1, 2, 5])), [0, 1, 2, 5, 9])
test_fail(lambda: seed_text("0-2"), contains="`seeds` must be a non-empty list")
for bad in ("2-1", "a", [1, 1], [-1], []): test_fail(lambda: parse_seeds(bad), contains="`seeds`")

# %%
_spec = dict(seeds="0-1", base=dict(n=5), grid=[dict(n_layers=[1, 2], lr=[0.1, 0.2]), dict(n_layers=[2], lr=[0.1], seeds=[5])])
_cells = expand_spec(_spec)
test_eq([(c.config.n_layers, c.config.lr, c.seeds) for c in _cells], [(1, 0.1, (0, 1)), (1, 0.2, (0, 1)), (2, 0.1, (0, 1, 5)), (2, 0.2, (0, 1))])
test_eq({c.config.n for c in _cells}, {5})
test_eq(sweep_axes(_spec), ["n_layers", "lr"])
test_eq(expand_spec(dict(seeds=[3]))[0], SweepCell(PretrainConfig(), (3,)))      # no grid: the base cell
test_fail(lambda: SweepCell(PretrainConfig(), "0-2"), contains="`seeds` must be a sequence")
for bad, msg in ((dict(grids=[]), "unknown keys ['grids']"), (dict(base=dict(seed=3)), "`base` may set only"), (dict(grid=dict(depth=[2])), "`grid` axes must be"),
                 (dict(grid=dict(n=3)), "`grid` axis `n` must be a non-empty list"), (dict(grid=[]), "`grid` must be"), (dict(seeds="x"), "`seeds`"),
                 (dict(grid=dict(lr=[0.])), "`lr`"), (dict(name="../x"), "`name` must be")):
    test_fail(lambda: expand_spec(bad), contains=msg)

# %%
test_eq(cell_label(_cells[2], ["n_layers", "lr"]), "n_layers = 2, lr = 0.1")
test_eq(cell_label(_cells[2], []), "base")

# %%
test_eq(start_client(), None)
stop_client(None)
for bad in (dict(cluster="local:0"), dict(cluster="slurm:3"), dict(scheduler="tcp://x:1", cluster="local:2")):
    test_fail(lambda: start_client(**bad), contains="`cluster`" if "scheduler" not in bad else "not both")
test_fail(lambda: start_client("10.0.0.5"), contains="`scheduler` must be the address of a Dask scheduler")
test_fail(lambda: stop_client("client"), contains="`client` must be a")

# %%
_rows = [dict(a=1, x=0.1 + 0.2, s=None), dict(a=2, x=1 / 3, s=0.5)]
_back = list(csv.DictReader(io.StringIO(csv_text(_rows))))
test_eq([float(r["x"]) for r in _back], [0.1 + 0.2, 1 / 3])     # exact
test_eq(_back[0]["s"], "")
assert markdown_table(_rows, ["a", "x"]).splitlines()[2] == "| 1 | 0.3 |"

# %%
test_fail(lambda: task_overhead("spark"), contains="`engine` must be")

# %%
assert installed_mb("tqdm") > 0.01

# %% [markdown]
# The figure of the contest's spec has one panel per grid with axes (depth times objective, $n$, $\gamma$, the
# features), drawn here from made-up records (every seed's MSVE set to its cell's index plus one):

# %%
_fake = [dict(final=dict(msve=[[i + 1.]] * len(c.seeds))) for i, c in enumerate(contest_cells_)]
_fig = plot_sweep(contest, contest_cells_, _fake)
test_eq([ax.get_xlabel() for ax in _fig.axes], ["depth L (n_layers)", "context length n (n)", "discount factor (gamma)", "features (features)"])
test_eq(len(_fig.axes[0].get_legend().get_texts()), 4)                        # one line per objective
plt.close(_fig)

# %%
#| export
from ictd.boyan import check_arguments
check_arguments(globals())   # every public function refuses, naming it, an argument its annotation rules out (chapter 0)

# %%
#| hide
import nbdev; nbdev.nbdev_export()
