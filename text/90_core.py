# %%
#| default_exp core

# %%
#| export
from __future__ import annotations
import collections.abc, dataclasses, datetime, errno, functools, hashlib, inspect, io, json, math, os, platform, shutil, subprocess, sys, tempfile, typing, warnings
from pathlib import Path
import numpy as np
import torch
import ictd
from ictd.boyan import ArgumentError, _annotation_check, as_tensor, is_real_number, weighted_error
from ictd.tasks import TaskBatch

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *
from ictd.tasks import random_tasks
from IPython.display import Markdown
import matplotlib.pyplot as plt
from fastcore.xtras import working_directory

# %% [markdown]
# # The shared core
# > The checks, seed streams, weighted error and task-batch helpers that the engine and the experiments share, written once.

# %% [markdown]
# The later chapters validate their arguments, split one seed into independent random streams,
# score value estimates by a weighted squared error, move batches of tasks around and record the
# claims they check. Each of these is written once here, so that it means the same thing everywhere:
# two chapters that score an estimate, or derive a random stream from a seed, cannot disagree
# because they run the same few lines. Nothing in this chapter is about TD or attention, and a reader
# of the core path can skip it; the one idea worth a look is the first section, on seeds.
#
# *How to read this chapter.* Why one seed per run and streams split from it (with a worked example
# of what goes wrong otherwise), the weighted error, the task-batch helpers and the claim records that
# build the front page's results table. The argument validators, used everywhere, are defined just
# below and tested, with the other input checks, in [Implementation and tests](#implementation-and-tests).

# %% [markdown]
# The validators: bad input gets a `ValueError` that names the argument and says what was expected
# (their rules and tests are in [Implementation and tests](#validators)).

# %%
#| export
_is_number = is_real_number   # chapter 0's test of a real number that is not a bool

def check_int(x,               # the value
              name:str,        # the argument's name, for the message
              low:int=0,       # the smallest value allowed
              what:str=None,   # what was expected, for the message; default "an integer >= `low`"
              high=math.inf,   # the largest value allowed
             )->int:           # `x` as an int
    "`x` as an int, or a `ValueError` naming `name` unless `x` is an integer-valued number in `low`..`high`."
    if not _is_number(x) or not math.isfinite(x) or int(x) != x or not low <= x <= high:
        raise ValueError(f"`{name}` must be {what or (f'an integer >= {low}' if high == math.inf else f'an integer in {low}..{high}')}, got {x!r}")
    return int(x)


# %% [markdown]
# Real-valued settings (step sizes, scales, discounts) get the same treatment, with a bound below that may be strict
# and, where the maths has one, a bound above. A tensor whose maths is real (a prompt) must be a finite floating
# tensor: integers, booleans and complex numbers are refused rather than cast, since a model casts its parameters
# to its input's dtype (`check_floating`):

# %%
#| export
def check_number(x,                 # the value
                 name:str,          # the argument's name, for the message
                 low:float=-math.inf, # the bound below
                 strict:bool=False, # exclude `low` itself
                 what:str=None,     # what was expected, for the message; default "a finite number >= `low`"
                 high:float=math.inf, # the bound above (included)
                )->float:           # `x` as a float
    "`x` as a float, or a `ValueError` naming `name` unless `x` is a finite number >= `low` (> `low` when `strict`) and <= `high`."
    if not _is_number(x) or not math.isfinite(x) or x < low or (strict and x == low) or x > high:
        bound = ("" if low == -math.inf else f" {'>' if strict else '>='} {low}") if high == math.inf else f" in {'(' if strict else '['}{low}, {high}]"
        raise ValueError(f"`{name}` must be {what or 'a finite number' + bound}, got {x!r}")
    return float(x)

def check_floating(x,             # a tensor, numpy array, list or number
                   name:str,      # the argument's name, for the message
                  )->torch.Tensor: # `x` as a finite floating tensor (floating tensors keep their dtype, lists become float64)
    "`x` as a finite real floating tensor; a `TypeError` naming `name` for a tensor or array of integers, booleans or complex numbers, a `ValueError` for NaN or inf."
    dtype = x.dtype if isinstance(x, (torch.Tensor, np.ndarray)) else None
    if dtype is not None and not (x.is_floating_point() if isinstance(x, torch.Tensor) else dtype.kind == "f"):
        raise TypeError(f"`{name}` must be a real floating tensor, got dtype {dtype} (cast it to a floating dtype first)")
    return as_tensor(x, name)


# %% [markdown]
# A setting that names one of a few options (a feature kind, an objective) is checked against the list of them
# (all three are tested in [Implementation and tests](#validators)):

# %%
#| export
def check_choice(x, allowed:tuple, name:str):
    "`x`, or a `ValueError` naming `name` unless `x` is one of `allowed`."
    if x not in allowed: raise ValueError(f"`{name}` must be one of {tuple(allowed)}, got {x!r}")
    return x


# %% [markdown]
# The experiments take a list of seeds, or one seed: `check_seeds` turns either into a list and refuses repeated
# seeds, which would count one run twice in a seed statistic (tested with the others, [below](#validators)).

# %%
#| export
def check_seeds(seeds)->list:
    "A non-empty list of distinct non-negative integer seeds (one int is a list of one), or a `ValueError` naming `seeds`."
    try: seeds = [seeds] if _is_number(seeds) else list(seeds)
    except TypeError: raise TypeError(f"`seeds` must be an integer or a list of integers, got {seeds!r}") from None
    if not seeds or any(not _is_number(s) or not math.isfinite(s) or int(s) != s or s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise ValueError(f"`seeds` must be a non-empty list of distinct non-negative integers, got {seeds}")
    return [int(s) for s in seeds]


# %% [markdown]
# An argument that must be an object of some class (a configuration, a task batch) or a flag, batch dimensions that
# must broadcast, and a torch device, are checked the same way; a device that names a CUDA GPU on a machine without one is refused before any work.
# `check_arguments` wraps a module's functions, not its classes: a dataclass calls `check_fields` in its `__post_init__`, which
# checks each field against its annotation as chapter 0's `checked` checks an argument (a field left at its default passes,
# and `Callable` asks for something callable):

# %%
#| export
def check_type(x, types, name:str):
    "`x`, or a `TypeError` naming `name` unless `x` is an instance of `types` (a class or a tuple of them)."
    if not isinstance(x, types):
        want = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise TypeError(f"`{name}` must be a {want}, got {type(x).__name__} {x!r}"[:300])
    return x

def check_bool(x, name:str)->bool:
    "`x` as a bool, or a `TypeError` naming `name` unless it is True or False (a string such as 'False' is not)."
    return bool(check_type(x, (bool, np.bool_), name))

def check_broadcast(**shapes)->tuple:
    "The shape the named batch shapes broadcast to, or a `ValueError` naming them and their shapes."
    try: return tuple(torch.broadcast_shapes(*shapes.values()))
    except RuntimeError: pass
    named = ", ".join(f"`{k}` {tuple(v)}" for k, v in shapes.items())
    raise ValueError(f"the batch dimensions of {named} do not broadcast")

def check_device(device)->torch.device:
    "`device` as a `torch.device` (None: the CPU, the book's default everywhere; CUDA only when asked), or a `ValueError` naming `device` if torch cannot use it."
    if device is None: return torch.device("cpu")
    try: dev = torch.device(device)
    except (RuntimeError, TypeError) as e: raise ValueError(f"`device` must be a torch device such as 'cpu' or 'cuda', got {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available(): raise ValueError(f"`device` is {device!r} but torch sees no CUDA GPU here")
    return dev

def default_dtype(device=None,  # a torch device (None: the CPU)
                  dtype=None,   # a floating torch dtype asked for, or None: the device's default
                 )->torch.dtype:
    "`dtype` if given, else the book's default for `device`: float64 on the CPU (exact checks), float32 on CUDA (whose float64 is slow on most GPUs)."
    if dtype is not None:
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point: raise ValueError(f"`dtype` must be a floating torch dtype, got {dtype!r}")
        return dtype
    return torch.float32 if check_device(device).type == "cuda" else torch.float64

class DefaultDtype(str):
    "The `dtype` a configuration has when none was asked for: 'float64' (it equals that string, in keys and saved files), trained in float32 on CUDA."
    def __deepcopy__(self, memo): return str(self)   # `asdict` (saved files, keys) writes a plain str
DEFAULT_DTYPE = DefaultDtype("float64")

def training_dtype(config,      # a `PretrainConfig` (anything with a `dtype` field)
                   device=None, # where it trains
                  )->str:
    "The dtype `config` trains in on `device`: its `dtype`, but float32 on CUDA when it has the default (`DEFAULT_DTYPE`), float64 on request."
    if not hasattr(config, "dtype"): raise TypeError(f"`config` must be a PretrainConfig, got {type(config).__name__}")
    try: cuda = torch.device("cpu" if device is None else device).type == "cuda"
    except (RuntimeError, TypeError): raise ValueError(f"`device` must be a torch device such as 'cpu' or 'cuda', got {device!r}") from None
    return "float32" if isinstance(config.dtype, DefaultDtype) and cuda else str(config.dtype)

@functools.lru_cache(maxsize=None)
def _field_checks(cls:type)->dict:
    "Field name -> (test, what was expected) for the annotated fields of the dataclass `cls` that say something checkable."
    try: hints = typing.get_type_hints(cls)
    except Exception: return {}                 # an annotation that cannot be resolved: leave the class to its own checks
    callables = (typing.Callable, collections.abc.Callable)
    checks = {k: (callable, "a callable") if t in callables else _annotation_check(t) for k, t in hints.items()}
    return {k: c for k, c in checks.items() if c is not None}

def check_fields(obj):
    "`obj`, or an `ArgumentError` (a `TypeError` and a `ValueError`) naming the first field of the dataclass `obj` that its annotation rules out; a field at its default passes."
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type): raise TypeError(f"`obj` must be a dataclass instance, got {type(obj).__name__}")
    checks = _field_checks(type(obj))
    for f in dataclasses.fields(obj):
        x = getattr(obj, f.name)
        if f.name in checks and x is not f.default and not checks[f.name][0](x):
            raise ArgumentError(f"`{f.name}` must be {checks[f.name][1]}, got {type(x).__name__} {x!r}"[:300])
    return obj


# %% [markdown]
# The library's conventions (`CONTRIBUTING.md`) make the step
# size, the discount, the depth and the context length keyword-only. A function that moves a name behind the `*`
# keeps its old positional call working for one release: `moved_to_keywords` maps the extra positional arguments
# onto the names in their old order and warns, naming the new form.

# %%
#| export
from ictd.boyan import moved_to_keywords, reordered_positionals   # defined first thing in chapter 0, which uses them
_all_ = ["moved_to_keywords", "reordered_positionals"]


# %%
@moved_to_keywords("alpha", "gamma")
def _step(x, *, alpha, gamma=0.5): return x + alpha * gamma
test_eq(_step(1., alpha=2., gamma=0.25), 1.5)
test_warns(lambda: test_eq(_step(1., 2., 0.25), 1.5))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always"); _step(1., 2.)
test_eq([str(w.message)[:40] for w in caught], ["_step: pass alpha=... by keyword; the ol"])
test_fail(lambda: _step(1., 2., 0.25, 3.), contains="takes 1 positional arguments")
test_fail(lambda: _step(1., 2., alpha=2.), contains="both by position and by keyword")
test_eq(list(inspect.signature(_step).parameters), ["x", "alpha", "gamma"])

@reordered_positionals(("P", "n", "d0"), lambda args: len(args) > 2)
def _walk(P, d0, *, n): return (P, d0, n)
test_eq(_walk("P", "d", n=3), ("P", "d", 3))
test_warns(lambda: test_eq(_walk("P", 3, "d"), ("P", "d", 3)))
test_fail(lambda: _walk("P", 3, "d", n=4), contains="both by position and by keyword")

# %% [markdown]
# Some work grows with its arguments faster than a reader expects: an attention matrix of $n \times m$ entries
# grows with the square of the context, and a rollout of $\log(\text{tol}) / \log \gamma$ steps without bound
# as $\gamma \to 1$. An entry point whose work follows from its arguments estimates it first and refuses it
# above a limit, saying what it would have needed and the way out (`check_work`, tested [below](#work-before-it-starts)).
# Where a call has a path in $O(n)$ memory, `method='auto'` takes it once the dense matrix would pass
# `DENSE_BYTES` (`memory_path`), and holds at most about `CHUNK_BYTES` at a time (`chunk_rows`).

# %%
#| export
WORK_LIMITS = dict(bytes=4 * 2**30, steps=10**7, multiply_adds=10**12)   # the most memory (bytes), sequential steps and multiply-adds (hours on one CPU thread) a call plans before it refuses
DENSE_BYTES = 2**30                                  # above this a dense n x m matrix makes `method='auto'` take the O(n) path
CHUNK_BYTES = 2**26                                  # the most a streamed path holds at once (one chunk of scores, say)
MEMORY_PATHS = ("auto", "dense", "streamed")

def _amount(x:float, unit:str)->str:
    if unit == "bytes": return f"{x / 2**30:.3g} GiB"
    return f"{x:.2g} multiply-adds" if unit == "multiply_adds" else f"{x:,.0f} {unit}"

def check_work(amount:float,  # the estimate, in `unit`
               unit:str,      # a key of `WORK_LIMITS`: 'bytes', 'steps' or 'multiply_adds'
               what:str,      # what the work is, for the message, e.g. "the 100001 x 100001 attention weights"
               way_out:str,   # how to do without it, for the message
              )->float:       # `amount`
    "`amount`, or a `ValueError` that gives the estimate, the limit and the way out when it passes `WORK_LIMITS[unit]`."
    limit = WORK_LIMITS[check_choice(unit, tuple(WORK_LIMITS), "unit")]
    if amount > limit:
        raise ValueError(f"{what} would need about {_amount(amount, unit)}, above the limit of {_amount(limit, unit)} "
                         f"(`ictd.core.WORK_LIMITS['{unit}']`): {way_out}")
    return amount

def memory_path(method:str,         # 'auto', 'dense' or 'streamed' (the O(n)-memory path)
                nbytes:float,       # the memory the dense path needs
                what:str,           # what the dense path builds, for the message
                way_out:str,        # how to do without it, for the message
                streamed:bool=True, # whether this call has a streamed path
               )->str:              # 'dense' or 'streamed'
    "The path a call takes: 'auto' is 'dense' up to `DENSE_BYTES` and 'streamed' above; the dense path is refused above `WORK_LIMITS['bytes']`."
    check_choice(method, MEMORY_PATHS, "method")
    if method == "streamed" and not streamed: raise ValueError(f"`method` = 'streamed' is not available here: {way_out}")
    if method == "auto": method = "streamed" if streamed and nbytes > DENSE_BYTES else "dense"
    if method == "dense": check_work(nbytes, "bytes", what, way_out)
    return method

def chunk_rows(row_bytes:float)->int:
    "How many rows of `row_bytes` bytes each fit in `CHUNK_BYTES` (at least one): the chunk of a streamed path."
    return max(1, int(CHUNK_BYTES // max(row_bytes, 1)))


# %% [markdown]
# ## One seed, many streams
#
# A run takes one seed. Where it needs independent random streams (the data, the initialisation's
# perturbation, the draws an objective adds), stream $k$ is child $k$ of
# `numpy.random.SeedSequence(seed)`, the child `SeedSequence.spawn` would make: no offsets added to
# seeds by hand, so no two streams of two runs can collide by arithmetic.

# %%
#| export
def substream(seed:int,    # the run's seed
              stream:int,  # the stream's index k >= 0
              *path:int,   # further indices: child `path[0]` of that stream, and so on down
             )->int:       # a 64-bit seed for a torch or numpy generator
    "A 64-bit seed for stream `stream` of `seed`: child `stream` of `numpy.random.SeedSequence(seed)`, as `spawn` makes it (its own children with `path`)."
    key = tuple(check_int(k, "stream") for k in (stream, *path))
    return int(np.random.SeedSequence(check_int(seed, "seed"), spawn_key=key).generate_state(1, np.uint64)[0])


# %% [markdown]
# Torch code wants a `torch.Generator` rather than an integer: `stream_generator` is one seeded with that stream's
# 64-bit seed.

# %%
#| export
def stream_generator(seed:int, stream:int, *path:int)->torch.Generator:
    "A CPU torch Generator for stream `stream` of `seed` (and its children `path`)."
    return torch.Generator().manual_seed(substream(seed, stream, *path))


# %% [markdown]
# *A worked example: why not offsets.* The common alternative derives a run's second stream by adding
# a constant to its seed (`seed + 17`). Then stream 1 of one run *is* stream 0 of another, and two
# runs of a seed sweep silently share random numbers. The cell counts the coincidences among the first
# two streams of 20 runs, both ways.

# %%
runs = range(20)
adhoc = {(s, k): s + 17 * k for s in runs for k in range(2)}          # stream k of run s by an offset, `seed + 17 * k`
spawned = {(s, k): substream(s, k) for s in runs for k in range(2)}   # stream k of run s as child k of SeedSequence(s)
clash = [(a, b) for a in adhoc for b in adhoc if a < b and adhoc[a] == adhoc[b]]
assert clash and len(set(spawned.values())) == len(spawned)
(s1, k1), (s2, k2) = clash[0]
Markdown(f"With offsets, {len(clash)} pairs of the {len(adhoc)} streams coincide (stream {k1} of run {s1} is stream {k2} of run {s2}); "
         f"with `substream`, all {len(spawned)} streams are distinct.")

# %%
children = np.random.SeedSequence(7).spawn(3)
test_eq([substream(7, k) for k in range(3)], [int(c.generate_state(1, np.uint64)[0]) for c in children])
assert len({substream(s, k) for s in range(20) for k in range(5)}) == 100
test_eq(torch.rand(3, generator=stream_generator(7, 2)), torch.rand(3, generator=torch.Generator().manual_seed(substream(7, 2))))

# %% [markdown]
# A training run (chapter 6's engine) draws from nine streams of its one seed, named once here so
# that every protocol and family asks for a stream by name: the mini-batches, the initialisation,
# the perturbation added to a constructed initialisation, the draws an objective adds, the training
# and held-out task pools, the held-out contexts, the tasks a baseline is tuned on, and the nudge of the
# next section. Task $b$ of a
# pool drawn from seed $u$ is drawn from `substream(u, b)`, so two pools never share a task unless
# they share a seed.

# %%
#| export
RUN_STREAMS = ("data", "perturbation", "objective", "train_pool", "eval_pool", "eval_contexts", "tuning", "init", "nudge")


# %%
#| export
def run_stream(seed:int,  # the run's seed
               name:str,  # one of `RUN_STREAMS`
              )->int:     # a 64-bit seed
    "The seed of a training run's stream `name`: `substream(seed, RUN_STREAMS.index(name))`."
    return substream(seed, RUN_STREAMS.index(check_choice(name, RUN_STREAMS, "name")))


# %%
test_eq(run_stream(3, "objective"), substream(3, 2))
test_eq(len({run_stream(s, k) for s in range(10) for k in RUN_STREAMS}), 10 * len(RUN_STREAMS))
test_fail(lambda: run_stream(3, "pool"), contains="`name`")
test_eq(substream(7, 2, 5), int(np.random.SeedSequence(7).spawn(3)[2].spawn(6)[5].generate_state(1, np.uint64)[0]))
test_fail(lambda: substream(7, 2, -1), contains="`stream`")

# %% [markdown]
# A training step draws each seed's uniforms from the seed's own generator, so that a seed's run does not depend on
# which seeds train beside it. `stacked_uniforms` makes those draws for every seed at once. On a GPU run the CPU
# does nothing else, and at thousands of seeds the one-generator-at-a-time loop was half of a step (appendix F):
# there the rows are drawn by a pool of threads, each generator still drawing its own row.

# %%
#| export
_DRAW_THREADS = {}   # thread pools by size, made once

def stacked_uniforms(gens:list,        # one CPU `torch.Generator` per row
                     shape:tuple,      # the shape of each row's draw
                     device=None,      # where the result goes (default the CPU)
                     threads:int=None, # threads drawing rows; None: 8 for a CUDA device and at least 256 rows, else 1
                    )->torch.Tensor:   # (len(gens), *shape) float64 uniforms
    "Row i is `torch.rand(shape, generator=gens[i])`, the same numbers in any number of threads (torch's kernels release the GIL)."
    from concurrent.futures import ThreadPoolExecutor
    for g in check_type(gens, list, "gens"): check_type(g, torch.Generator, "gens")
    shape, device = tuple(check_type(shape, (tuple, list), "shape")), check_device(device)
    if threads is None: threads = 8 if device.type == "cuda" and len(gens) >= 256 else 1
    check_int(threads, "threads", low=1)
    out = torch.empty(len(gens), *shape, dtype=torch.float64, pin_memory=device.type == "cuda" and torch.cuda.is_available())
    def fill(rows):
        for i in rows: torch.rand(shape, generator=gens[i], dtype=torch.float64, out=out[i])
    if threads == 1: fill(range(len(gens)))
    else: list(_DRAW_THREADS.setdefault(threads, ThreadPoolExecutor(threads)).map(fill, [range(k, len(gens), threads) for k in range(threads)]))
    return out.to(device, non_blocking=True)


# %%
gens_a, gens_b = ([torch.Generator().manual_seed(s) for s in range(300)] for _ in range(2))
loop = torch.stack([torch.rand(4, 5, generator=g, dtype=torch.float64) for g in [torch.Generator().manual_seed(s) for s in range(300)]])
test_eq(stacked_uniforms(gens_a, (4, 5)), loop)
test_eq(stacked_uniforms(gens_b, (4, 5), threads=4), loop)                         # threads draw the same rows
test_eq(stacked_uniforms(gens_a, (4, 5), threads=3), stacked_uniforms(gens_b, (4, 5)))   # and leave each stream where a loop would
test_fail(lambda: stacked_uniforms([1], (2,)), contains="`gens`")
test_fail(lambda: stacked_uniforms(gens_a, (2,), threads=0), contains="`threads`")

# %% [markdown]
# ## The rounding nudge: claims that survive another CPU
#
# The last bits of a float64 computation differ between CPU types (AVX2 and AVX-512 kernels, fused
# multiply-adds, the order of a reduction). A claim that holds on one machine and fails on another rested
# on those bits, and is no claim. The environment variable `ICTD_PERTURB` makes such claims visible on one
# machine: set to a small number $\epsilon$ (CI uses $10^{-9}$), it multiplies every initial parameter of a
# training run, and every other starting point a chapter fits from, by $1 + \epsilon\,\xi$ with $\xi \sim N(0, 1)$
# drawn entry by entry from the run's stream `nudge`. Zeros stay zero, so a constructed initialisation keeps
# its structure. Unset (the default), nothing changes, bit for bit.

# %%
#| export
NUDGE_VAR = "ICTD_PERTURB"   # the environment variable that asks for the rounding nudge

def nudge_scale()->float:
    "The relative nudge $\\epsilon$ that `ICTD_PERTURB` asks for: 0 when it is unset or empty."
    raw = os.environ.get(NUDGE_VAR, "").strip()
    if not raw: return 0.
    try: return check_number(float(raw), NUDGE_VAR, 0.)
    except ValueError: raise ValueError(f"environment variable `{NUDGE_VAR}` must be a finite number >= 0, got {raw!r}") from None

def nudged(x:torch.Tensor,  # a starting point (any shape, real)
           seed:int,        # the run's seed: the noise comes from its stream `nudge`
           *path:int,       # further indices, one stream per tensor of a run
          )->torch.Tensor:  # `x` times 1 + epsilon N(0, 1), entry by entry; `x` itself when epsilon is 0
    "`x` nudged by the relative noise `ICTD_PERTURB` asks for, from the fixed stream `nudge` of `seed`."
    eps = nudge_scale()
    if eps == 0: return x
    g = stream_generator(seed, RUN_STREAMS.index("nudge"), *path)
    xi = torch.randn(x.shape, generator=g, dtype=torch.float64).to(x.device)
    return (x.double() * (1 + eps * xi)).to(x.dtype)


def nudge(params:dict,  # name -> stacked parameters (S, ...), seed axis first
          seeds:list,   # the seed of each slice
         )->dict:       # the same, each seed's slice `nudged` from its own stream (one per name); unchanged when unset
    "Stacked parameters of a batch of runs, each seed's nudged by the relative noise `ICTD_PERTURB` asks for."
    if nudge_scale() == 0: return params
    return {k: torch.stack([nudged(v[i], s, j) for i, s in enumerate(seeds)]) for j, (k, v) in enumerate(sorted(params.items()))}


# %%
x0 = torch.tensor([[0., 1.], [-2., 3.]], dtype=torch.float64)
_unset = os.environ.pop(NUDGE_VAR, None)
test_eq(nudge_scale(), 0.)
assert nudged(x0, 5) is x0                                   # unset: the same tensor, untouched
os.environ[NUDGE_VAR] = "1e-9"
a, b = nudged(x0, 5), nudged(x0, 5, 1)
test_eq(a, nudged(x0, 5))                                    # a fixed stream
test_eq(a[0, 0], 0.)                                         # zeros stay zero
rel = (a - x0)[x0 != 0] / x0[x0 != 0]
assert 0 < rel.abs().max() < 1e-8 and not torch.equal(a, b), rel
test_eq(nudge({"A": torch.stack([x0, x0])}, [5, 6])["A"][0], nudged(x0, 5, 0))   # a batch: each seed its own stream
os.environ[NUDGE_VAR] = "nudge"
test_fail(nudge_scale, contains="ICTD_PERTURB")
if _unset is None: del os.environ[NUDGE_VAR]
else: os.environ[NUDGE_VAR] = _unset

# %% [markdown]
# ## The weighted squared error
#
# Value estimates are scored by the mean squared value error, weighted by the stationary
# distribution $d_\pi$ (or, for continuous states, by a quadrature rule on a grid):
# $\sum_x w(x) (\hat v(x) - v(x))^2$. It is defined once, in chapter 0 (`weighted_error`, which
# `msve` uses), and every chapter imports it from there or from here.

# %%
tasks = random_tasks(4, seed=0)
test_close(weighted_error(torch.zeros(4, 10, dtype=torch.float64), tasks.v_pi, tasks.d_pi), (tasks.v_pi ** 2 * tasks.d_pi).sum(-1))
test_eq(weighted_error(tasks.v_pi, tasks.v_pi, tasks.d_pi), torch.zeros(4, dtype=torch.float64))

# %% [markdown]
# ## Task batches
#
# A `TaskBatch` ([chapter 0a](tasks.html)) is five tensors and a discount. Its `map` applies one function to each
# tensor (to move a batch to a device, or take the tasks of one seed), and `TaskBatch.stack` stacks batches of equal
# shapes along a new leading axis (the engine's seed axis); it refuses batches whose discounts differ, since a
# `TaskBatch` has one. Both are methods of the class itself, so a `TaskBatch` can do the same whatever was imported.

# %%
two = TaskBatch.stack([random_tasks(3, seed=0), random_tasks(3, seed=5)])
test_eq(two.P.shape, (2, 3, 10, 10))
test_eq(two.map(lambda x: x[1]).r, random_tasks(3, seed=5).r)
test_eq(random_tasks(3, seed=5).map(lambda x: x[1:]).v_pi, random_tasks(3, seed=5).v_pi[1:])
test_fail(lambda: TaskBatch.stack([]), contains="`batches`")


# %% [markdown]
# ## Files that survive a crash
#
# Every file the package writes (a checkpoint, a trained seed, a run folder's `config.json`, a claim
# record, a command's results) goes through the few functions below. A file written straight to
# its final path and interrupted half-way (a killed process, a full disk) stays there half-written,
# and every later run that reads it dies on it. So a file is written whole to a temporary file in
# the same folder, flushed to the disk, and only then moved onto its name with `os.replace`, which
# is atomic: a reader sees the old file or the new one, never part of one. A failure names the path
# and its cause ("No space left on device", "Permission denied").

# %%
#| export
def _write_error(path, e:OSError)->OSError:
    "`e` restated with the path it was writing and its cause, as the same kind of `OSError`."
    msg = f"cannot write {path}: {e.strerror or e}"
    return type(e)(e.errno, msg) if e.errno is not None else type(e)(msg)

def atomic_write_bytes(path,       # the file's final name
                       data:bytes, # its whole contents
                      )->Path:     # `path`
    "Write `data` to `path` so that a crash leaves the old file or the new one: a temporary file in the same folder, fsynced, then `os.replace`d."
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f: f.write(data); f.flush(); os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException: Path(tmp).unlink(missing_ok=True); raise
    except OSError as e: raise _write_error(path, e) from e
    return path

def atomic_write_text(path, text:str)->Path:
    "Write `text` (UTF-8) to `path` atomically, as `atomic_write_bytes` does."
    return atomic_write_bytes(path, text.encode())

def atomic_savefig(fig,        # a matplotlib figure
                   path,       # the file; its suffix names the format (png, pdf, svg)
                   **kwargs,   # passed to `fig.savefig` (dpi, bbox_inches)
                  )->Path:     # `path`
    "Save `fig` to `path` atomically: drawn into memory, then written as `atomic_write_bytes` does."
    from matplotlib.figure import Figure
    check_type(fig, Figure, "fig")
    buf = io.BytesIO(); fig.savefig(buf, format=Path(path).suffix.lstrip(".") or "png", **kwargs)
    return atomic_write_bytes(path, buf.getvalue())


# %% [markdown]
# A failed write leaves the old file, or none, and no temporary file behind:

# %%
with tempfile.TemporaryDirectory() as tmp:
    f = atomic_write_text(Path(tmp) / "a" / "x.txt", "first")
    atomic_write_text(f, "second")
    test_eq(f.read_text(), "second")
    test_fail(lambda: atomic_write_text(f / "under-a-file.txt", "x"), contains="cannot write")
    test_eq(sorted(p.name for p in f.parent.iterdir()), ["x.txt"])
    fig = plt.figure(); atomic_savefig(fig, Path(tmp) / "fig.png", dpi=50); plt.close(fig)
    test_fail(lambda: atomic_savefig(fig.gca(), Path(tmp) / "axes.png"), contains="`fig` must be a Figure")
    test_eq((Path(tmp) / "fig.png").read_bytes()[:4], b"\x89PNG")


# %% [markdown]
# A file that was written whole can still be damaged later (a bit flipped on disk, a copy cut short),
# and `torch.load` may read a damaged file without complaint and hand back wrong numbers. So a torch
# file is saved with the sha256 of its bytes in a small file beside it (`seed-0.pt.sha256`, in the
# format `sha256sum -c` checks), written after it: a crash between the two leaves a file whose checksum
# does not match, which is treated as absent. `load_checked` returns `None` for a missing, unreadable,
# damaged or unchecked file, saying "recomputing <path>: <reason>", and the caller computes it again.
# What is saved must load with `torch.load(..., weights_only=True)` (tensors and plain containers,
# never pickled code): `save_checked` refuses anything else, and `tensors_only` turns numpy arrays
# and scalars into tensors and numbers first.

# %%
#| export
def checksum_path(path)->Path:
    "The file beside `path` that holds its sha256: `<path>.sha256`."
    return Path(f"{path}.sha256")

def _digest(data:bytes)->str: return hashlib.sha256(data).hexdigest()

def tensors_only(x):
    "`x` with numpy arrays turned into tensors and numpy scalars into numbers (nested), so that `weights_only=True` loads it."
    if isinstance(x, np.ndarray): return torch.from_numpy(x.copy()) if x.dtype.kind in "biufc" else tensors_only(x.tolist())   # strings: a list
    if isinstance(x, np.generic): return x.item()
    if isinstance(x, dict): return {k: tensors_only(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)): return type(x)(tensors_only(v) for v in x)
    return x


# %%
#| export
def save_checked(obj,       # tensors and plain containers (dict, list, tuple, str, numbers, None)
                 path,      # the file, e.g. `folder / "seed-0.pt"`
                )->Path:    # `path`
    "`torch.save` `obj` to `path` atomically, with the sha256 of its bytes in `checksum_path(path)`; a `TypeError` if `weights_only=True` could not load it."
    buf = io.BytesIO(); torch.save(obj, buf); data = buf.getvalue()
    try: torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e: raise TypeError(f"`obj` for {path} must hold only tensors and plain containers (weights_only=True): {str(e).splitlines()[-1]}") from None
    atomic_write_bytes(path, data)
    atomic_write_text(checksum_path(path), f"{_digest(data)}  {Path(path).name}\n")
    return Path(path)

def _damage(path:Path):
    "Why the torch file at `path` cannot be trusted (a short reason), with its contents; (None, the loaded object) when it can."
    try: data, want = path.read_bytes(), checksum_path(path).read_text().split()[0]
    except (OSError, IndexError, UnicodeDecodeError) as e: return f"no readable checksum beside it ({type(e).__name__})", None
    if _digest(data) != want: return "its contents do not match its checksum (damaged or cut short)", None
    try: return None, torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e: return f"it cannot be read ({type(e).__name__})", None

def load_checked(path):
    "The object saved at `path` by `save_checked`; None if there is none, or (saying 'recomputing <path>: <reason>') if it is unreadable or fails its checksum."
    path = Path(path)
    if not path.exists(): return None
    reason, obj = _damage(path)
    if reason is None: return obj
    print(f"recomputing {path}: {reason}", flush=True)
    return None

def remove_checked(path):
    "Remove a file saved by `save_checked` and its checksum (either may be missing)."
    for p in (Path(path), checksum_path(path)): p.unlink(missing_ok=True)


# %% [markdown]
# A file saved and loaded back is the same; one bit flipped, a file cut short or a missing checksum each
# read as absent, with the reason:

# %%
with tempfile.TemporaryDirectory() as tmp, working_directory(tmp):   # relative paths, so the messages read the same on every run
    f = save_checked(dict(x=torch.arange(5.), n=3, names=["a"]), Path("run.pt"))
    test_eq(load_checked(f)["x"], torch.arange(5.))
    test_eq(checksum_path(f).read_text().split()[1], "run.pt")
    data = bytearray(f.read_bytes()); data[len(data) // 2] ^= 1
    f.write_bytes(bytes(data)); test_eq(load_checked(f), None)
    f.write_bytes(bytes(data[:100])); test_eq(load_checked(f), None)
    save_checked(dict(x=1), f); checksum_path(f).unlink(); test_eq(load_checked(f), None)
    remove_checked(f); test_eq(load_checked(f), None)
    back = load_checked(save_checked(tensors_only(dict(a=np.arange(3), b=(np.float64(0.5),), c=np.array(["x", "y"]))), f))
    test_eq((back["a"], back["b"], back["c"]), (torch.arange(3), (0.5,), ["x", "y"]))
    test_fail(lambda: save_checked(dict(a=np.arange(3)), f), contains="tensors and plain containers")


# %% [markdown]
# A run that will write into a folder checks first that it can, and that the disk has room for what it
# will write, so that a full disk or a read-only folder stops it before the training, not after:

# %%
#| export
def check_writable(folder,        # the folder a run will write into (created if missing)
                   nbytes:int=0,  # the size of the largest file it will write
                  )->Path:        # `folder`
    "`folder`, after writing and removing a probe file in it; an `OSError` naming it if that fails or the disk has under `nbytes` free."
    folder = Path(folder)
    probe = atomic_write_bytes(folder / f".probe-{os.getpid()}", b"probe")
    probe.unlink()
    free = shutil.disk_usage(folder).free
    if free < nbytes: raise OSError(errno.ENOSPC, f"cannot write {folder}: {free / 2**20:.1f} MiB free, a checkpoint needs about {nbytes / 2**20:.1f} MiB")
    return folder


# %%
with tempfile.TemporaryDirectory() as tmp:
    test_eq(check_writable(Path(tmp) / "run"), Path(tmp) / "run")
    test_eq(list((Path(tmp) / "run").iterdir()), [])
    test_fail(lambda: check_writable(Path(tmp) / "run", 2**80), contains="MiB free")


# %% [markdown]
# Names that become parts of a path (a chapter's record file) are checked: a name with a separator
# or `..` would write outside the folder it was meant for.

# %%
#| export
def check_name(x,          # the value
               name:str,   # the argument's name, for the message
              )->str:      # `x`
    "`x`, or a `ValueError` naming `name` unless it is a non-empty string usable as one file name (no separator, not `.` or `..`)."
    if not isinstance(x, str) or not x.strip() or x in (".", "..") or any(c in x for c in "/\\\0"):
        raise ValueError(f"`{name}` must be a non-empty name without '/', '\\' or '..', got {x!r}")
    return x


# %% [markdown]
# ## Claim records
#
# The front page's results table lists every claim of the book with its status, its chapter and the
# evidence for it. It is not typed: each chapter records a claim with `record_claim` in the cell that
# checks it, after the asserts, so a claim whose check fails is never recorded. A status is one of
# *proved* (a proof, and an exact check of it), *measured* (holds on the named testbed, with its statistics),
# *partial* (holds in part; the record says which) and *refuted* (the book measured it false). Records of a
# chapter go to one JSON file, rewritten in a fixed order, so executing a chapter twice leaves it unchanged.

# %%
#| export
CLAIM_STATUSES = ("proved", "measured", "partial", "refuted")

def _json_object(f:Path):
    "The JSON object (a dict) in the file `f`, or None if it cannot be read as one."
    try: obj = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError): return None
    return obj if isinstance(obj, dict) else None

def load_json(path)->dict:
    "The JSON object saved at `path`; None if there is none, or (saying 'recomputing <path>: <reason>') if it cannot be read as one."
    if not Path(path).exists(): return None
    obj = _json_object(Path(path))
    if obj is None: print(f"recomputing {path}: it cannot be read as a JSON object (empty, cut short or damaged)", flush=True)
    return obj

def record_claim(key:str,              # identifier, unique within the chapter, e.g. "floor-slope"
                 claim:str,            # the statement, one sentence of markdown
                 status:str,           # one of `CLAIM_STATUSES`
                 chapter:str,          # the chapter's page name without `.html`, e.g. "convergence"
                 evidence:str="",      # an anchor on that page that shows it, e.g. "#experiment-1-error-against-depth"
                 folder="data/claims", # where the chapter's record file goes (relative to the notebook's folder)
                )->dict:               # the record written
    "Record a claim the chapter has just checked (call it after its asserts) in `folder/<chapter>.json`."
    check_choice(status, CLAIM_STATUSES, "status"); check_name(key, "key"); check_name(chapter, "chapter")
    if not isinstance(claim, str) or not claim.strip(): raise ValueError(f"`claim` must be a non-empty string, got {claim!r}")
    if not isinstance(evidence, str) or (evidence and not evidence.startswith("#")): raise ValueError(f"`evidence` must be an anchor starting with '#', got {evidence!r}")
    f = Path(folder) / f"{chapter}.json"
    records = dict(load_json(f) or {}, **{key: dict(claim=claim, status=status, chapter=chapter, evidence=evidence)})
    atomic_write_text(f, json.dumps(dict(sorted(records.items())), indent=1) + "\n")
    return records[key]


# %%
show_doc(record_claim)


# %% [markdown]
# `load_claims` reads the records back, all chapters at once: the front page's results table is built from it.

# %%
#| export
def load_claims(folder="data/claims")->list:
    "Every recorded claim under `folder`, as dicts with a `key`, in file then key order; a `ValueError` naming a damaged file."
    files = {f: _json_object(f) for f in sorted(Path(folder).glob("*.json"))}
    bad = [str(f) for f, r in files.items() if r is None]
    if bad: raise ValueError(f"claim records {bad} cannot be read: execute their chapters again to rewrite them")
    return [dict(key=k, **r) for records in files.values() for k, r in records.items()]


# %%
with tempfile.TemporaryDirectory() as tmp:
    r = record_claim("sum", "Rows of $S$ sum to one.", "proved", "dual_head", "#the-layer", folder=tmp)
    record_claim("sum", "Rows of $S$ sum to one.", "proved", "dual_head", "#the-layer", folder=tmp)
    record_claim("a-rate", "The rate is $\\rho$.", "measured", "convergence", folder=tmp)
    test_eq([c["key"] for c in load_claims(tmp)], ["a-rate", "sum"])
    test_eq(load_claims(tmp)[1], dict(key="sum", **r))


# %% [markdown]
# ## Results as JSON
#
# Summaries are written as JSON, readable by anything: tensors and numpy arrays become nested lists.

# %%
#| export
def jsonable(x):
    "`x` with tensors and numpy arrays turned into (nested) lists and numpy scalars into numbers, for `json.dump`."
    if isinstance(x, (torch.Tensor, np.ndarray)): return x.tolist()
    if isinstance(x, np.generic): return x.item()
    if isinstance(x, dict): return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)): return [jsonable(v) for v in x]
    return x


# %%
test_eq(jsonable(dict(a=torch.ones(2), b=(np.float64(0.5), np.arange(2)), c="x")), dict(a=[1., 1.], b=[0.5, [0, 1]], c="x"))


# %% [markdown]
# ## Where a saved result came from
#
# A result too slow for the book is computed by a command and saved under `nbs/data/`; the file records the command,
# the git commit of the installed package, a hash of its source files (`source_hash`: it tells uncommitted edits
# apart, which the commit does not) and the date that made it, the Python and torch versions, and the machine:
# the CPU's model, the instruction set torch's kernels used (AVX2, AVX-512, ...) and the torch build. The last
# digits of a trained number depend on that machine; a construction, an equivalence or a closed form does not.

# %%
#| export
def cpu_model()->str:
    "The CPU's model name (`/proc/cpuinfo` on Linux, else `platform.processor()`), or 'unknown'."
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"): return line.split(":", 1)[1].strip()
    except OSError: pass
    return platform.processor() or "unknown"

def _package_commit()->str:
    "The git commit of the folder the installed `ictd` was loaded from ('unknown' outside a git checkout)."
    try: return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                               cwd=Path(ictd.__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError): return "unknown"


# %%
#| export
def provenance(command:str,  # the command that produced the file
               **extra,      # anything else to record (threads, wall-clock seconds)
              )->dict:       # command, commit, source hash, UTC date, Python, torch and the machine, then `extra`
    "What a saved result records about how it was made, and on what machine."
    from ictd.engine import source_hash   # the engine's module imports this one: imported when called
    return dict(command=command, commit=_package_commit(), source=source_hash(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                python=sys.version.split()[0], torch=torch.__version__, torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
                cpu=cpu_model(), machine=platform.machine(), nudge=nudge_scale(), **extra)


# %% [markdown]
# A page that reads a saved file says where it came from, and which of its numbers another machine would
# reproduce digit for digit (`provenance_note`).

# %%
#| export
DRAW_NOTE = ("Its numbers are draws of seeded training runs: another CPU type or torch build rounds differently in the last "
             "bits, so a rerun there gives the same statistics to within their standard errors, not the same digits.")

def provenance_note(prov:dict,          # a saved file's `provenance`
                    what:str="",        # what the file holds, e.g. "The control runs"
                    note:str=DRAW_NOTE, # which of its numbers are exact and which are draws
                   )->str:              # one Markdown paragraph
    "A sentence for the page: the command, commit, date, CPU and torch build that made a saved result, and what is exact in it."
    cap = prov.get("torch_cpu_capability")
    cpu = prov.get("cpu", "not recorded")
    machine = ("a CPU that was not recorded" if cpu.startswith("not recorded") else cpu) + (f" ({cap} kernels)" if cap and cap != "not recorded" else "")
    return (f"{what + ' were made' if what else 'Made'} by `{prov['command']}` at commit `{str(prov.get('commit', 'unknown'))[:10]}` on "
            f"{str(prov.get('date', 'an unrecorded date'))[:10]}, on {machine}, with torch {prov.get('torch', 'not recorded')}. {note}")


# %%
test_eq(list(provenance("x", threads=1)), ["command", "commit", "source", "date", "python", "torch", "torch_cpu_capability", "cpu",
                                          "machine", "nudge", "threads"])
assert provenance("x")["cpu"] and provenance("x")["torch_cpu_capability"] in ("DEFAULT", "AVX2", "AVX512", "ZVECTOR", "SVE256", "SVE128")
assert "The runs were made by `ictd x` at commit `0123456789`" in provenance_note(dict(command="ictd x", commit="0123456789ab"), "The runs")
assert "on a CPU that was not recorded," in provenance_note(dict(command="x", cpu="not recorded (made before provenance named the CPU)"))

# %% [markdown]
# ## Log axes that read as numbers
#
# Matplotlib labels a log axis $10^{-2}, 10^0, 10^2$; the book's figures write 0.01, 1, 100, and label some minor
# ticks too where an axis spans less than two decades (2 and 5 times a power of ten; 2, 3, 4 and 6 times it under one
# decade), so that a short axis shows more than one number. Every
# chapter's figures call this one function, and draw their colours from one colour-blind-safe palette (Okabe and Ito's).

# %%
#| export
OKABE_ITO = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")   # colour-blind-safe palette


# %%
#| export
def plain_log_ticks(ax,               # matplotlib axes
                    which:str="both", # the axes to label: "x", "y" or "both" (axes not on a log scale are left alone)
                   ):
    "Label the log-scale axes of `ax` with plain numbers (0.01, 2, 300), minor ticks too where an axis spans under two decades."
    from matplotlib.axes import Axes
    from matplotlib.ticker import FuncFormatter, NullFormatter
    check_type(ax, Axes, "ax"), check_choice(which, ("x", "y", "both"), "which")
    number = lambda v: f"{v:g}" if 1e-4 <= abs(v) < 1e5 else f"$10^{{{round(math.log10(abs(v)))}}}$"
    for name in ("x", "y") if which == "both" else (which,):
        axis = getattr(ax, f"{name}axis")
        if getattr(ax, f"get_{name}scale")() != "log": continue
        lo, hi = sorted(abs(v) for v in axis.get_view_interval())
        axis.set_major_formatter(FuncFormatter(lambda v, _: number(v)))
        digits = "2346" if hi < 15 * lo else "25" if hi < 100 * lo else ""     # which minor ticks get a label
        axis.set_minor_formatter(FuncFormatter(lambda v, _, digits=digits: number(v) if f"{v:.0e}"[0] in digits else "") if digits else NullFormatter())


# %%
import matplotlib.pyplot as plt

# %%
fig, ax = plt.subplots()
ax.plot([0.5, 3], [2e-3, 4e2]); ax.set(xscale="log", yscale="log"); plain_log_ticks(ax); fig.canvas.draw()
labels = lambda axis: [t.get_text() for t in axis.get_ticklabels() + axis.get_ticklabels(minor=True) if t.get_text()]
assert "0.01" in labels(ax.yaxis) and "100" in labels(ax.yaxis) and not any("10^" in t for t in labels(ax.yaxis)), labels(ax.yaxis)
assert {"1", "2", "0.6"} <= set(labels(ax.xaxis)), labels(ax.xaxis)   # under one decade: minor ticks 2, 3, 4, 6 labelled
test_fail(lambda: plain_log_ticks(ax, "z"), contains="`which` must be")
test_fail(lambda: plain_log_ticks(fig), contains="`ax` must be a Axes")
plt.close(fig)

# %% [markdown]
# ## Implementation and tests
#
# Every cell runs when the book is built.
#
# ### Validators
#
# Bad input gets a `ValueError` that names the argument and says what was expected. Integer-valued
# numbers are accepted where an integer is expected (`30.0` for `n`), booleans are not (they are
# integers to Python, and never what a caller meant).

# %%
show_doc(check_int)

# %%
test_eq(check_int(30.0, "n", 1), 30)
for bad in (0, -1, 2.5, True, "3", math.nan, math.inf, None, torch.tensor([3])): test_fail(lambda: check_int(bad, "n", 1), contains="`n` must be an integer >= 1")
test_eq(check_int(torch.tensor(3), "n", 1), 3)
test_eq(check_int(4, "n", 1, high=4), 4)
test_fail(lambda: check_int(5, "n", 1, high=4), contains="`n` must be an integer in 1..4, got 5")
test_fail(lambda: check_int(0, "d", 1, "a positive integer"), contains="`d` must be a positive integer, got 0")

# %%
show_doc(check_number)

# %%
test_eq(check_number(1, "lr", 0, strict=True), 1.)
test_fail(lambda: check_number(0., "lr", 0, strict=True), contains="`lr` must be a finite number > 0")
test_fail(lambda: check_number(math.inf, "alpha"), contains="`alpha` must be a finite number, got inf")
test_eq(check_number(1, "alpha", 0, strict=True, high=1), 1.)
test_fail(lambda: check_number(1.5, "alpha", 0, strict=True, high=1), contains="`alpha` must be a finite number in (0, 1]")
test_fail(lambda: check_number(-5, "alpha", 0, strict=True, high=1), contains="`alpha` must be a finite number in (0, 1]")
test_eq(check_floating([1, 2], "Z").dtype, torch.float64)
test_eq(check_floating(torch.ones(2, dtype=torch.float32), "Z").dtype, torch.float32)
for bad in (torch.ones(2, dtype=torch.int64), np.ones(2, dtype=int), torch.ones(2, dtype=torch.bool), torch.ones(2) * 1j):
    test_fail(lambda: check_floating(bad, "Z"), contains="`Z` must be a real")
test_fail(lambda: check_floating(torch.tensor([1., math.nan]), "Z"), contains="`Z` contains NaN or inf")
test_fail(lambda: check_choice("cubic", ("random", "onehot"), "features"), contains="`features` must be one of")
test_eq(check_seeds(range(3)), [0, 1, 2]); test_eq(check_seeds(4), [4])
for bad in ([], [1, 1], [-1], [0.5], [math.nan], math.inf): test_fail(lambda: check_seeds(bad), contains="`seeds` must be a non-empty list")
test_fail(lambda: check_seeds(None), contains="`seeds` must be an integer or a list")
test_eq(check_type(3, (int, float), "n"), 3)
test_fail(lambda: check_type("3", (int, float), "n"), contains="`n` must be a int or float")
test_eq(check_broadcast(phi_states=(3, 1), rewards=(4,)), (3, 4))
test_eq(check_bool(np.bool_(True), "centred"), True)
for bad in ("False", 0, None): test_fail(lambda: check_bool(bad, "centred"), contains="`centred` must be a bool")
test_fail(lambda: check_broadcast(phi_states=(3,), rewards=(4,)), contains="batch dimensions of `phi_states` (3,), `rewards` (4,) do not")
test_eq(check_device("cpu"), torch.device("cpu"))
test_eq(check_device(None), torch.device("cpu"))   # CUDA only when asked, even where it is present
test_fail(lambda: check_device("gpu"), contains="`device` must be a torch device")
test_fail(lambda: check_device(3.5), contains="`device` must be a torch device")
if not torch.cuda.is_available(): test_fail(lambda: check_device("cuda"), contains="no CUDA GPU")
test_eq(default_dtype(), torch.float64); test_eq(default_dtype("cpu", torch.float32), torch.float32)
test_fail(lambda: default_dtype(None, torch.int64), contains="`dtype` must be a floating torch dtype")
if torch.cuda.is_available(): test_eq(default_dtype("cuda"), torch.float32)

@dataclasses.dataclass
class _Toy:
    "A dataclass whose fields `check_fields` checks."
    n:int
    f:typing.Callable
    t:torch.Tensor = None
    def __post_init__(self): check_fields(self)
test_eq(_Toy(3, abs).t, None)
for bad, field in ((dict(n="3", f=abs), "n"), (dict(n=3, f="abs"), "f"), (dict(n=3, f=abs, t="abc"), "t")):
    test_fail(lambda: _Toy(**bad), contains=f"`{field}` must be")
test_fail(lambda: check_fields(_Toy), contains="`obj` must be a dataclass instance")

# %% [markdown]
# ### Work before it starts
#
# `check_work` passes an estimate under its limit and refuses one above it with the estimate, the limit and the way
# out; `memory_path` takes the dense path up to `DENSE_BYTES`, the streamed one above, and refuses a dense path that
# would pass the memory limit (or a streamed one where there is none).

# %%
test_eq(check_work(WORK_LIMITS["steps"], "steps", "a rollout", "use a smaller gamma"), WORK_LIMITS["steps"])
horizon = math.ceil(math.log(1e-6) / math.log(0.9999999))     # the Monte-Carlo rollout at gamma = 0.9999999
test_fail(lambda: check_work(horizon, "steps", "the rollout", "use a smaller `gamma`"),
          contains=f"the rollout would need about {horizon:,} steps, above the limit of 10,000,000 steps")
test_fail(lambda: check_work(2e12, "multiply_adds", "the decoder's pass", "use a shorter context"),
          contains="the decoder's pass would need about 2e+12 multiply-adds, above the limit of 1e+12 multiply-adds")
test_fail(lambda: check_work(8e10, "bytes", "the weights", "use method='streamed'"), contains="about 74.5 GiB, above the limit of 4 GiB")
test_fail(lambda: check_work(1, "seconds", "x", "y"), contains="`unit` must be one of")
test_eq(memory_path("auto", DENSE_BYTES, "K", "-"), "dense")
test_eq(memory_path("auto", DENSE_BYTES + 1, "K", "-"), "streamed")
test_fail(lambda: memory_path("auto", 8e10, "K", "pass W instead of a score function", streamed=False), contains="pass W instead")
test_fail(lambda: memory_path("dense", 8e10, "K", "use method='streamed'"), contains="K would need about 74.5 GiB")
test_eq(memory_path("dense", 8e8, "K", "-"), "dense")
test_fail(lambda: memory_path("streamed", 1, "K", "pass W", streamed=False), contains="`method` = 'streamed' is not available here: pass W")
test_fail(lambda: memory_path("fast", 1, "K", "-"), contains="`method` must be one of ('auto', 'dense', 'streamed')")
test_eq(chunk_rows(CHUNK_BYTES / 3), 3); test_eq(chunk_rows(2 * CHUNK_BYTES), 1)

# %% [markdown]
# ### Task batches and claim records: bad input

# %%
test_fail(lambda: TaskBatch.stack([random_tasks(1, gamma=0.5), random_tasks(1)]), contains="one discount")

# %%
with tempfile.TemporaryDirectory() as tmp:
    test_fail(lambda: record_claim("x", "y", "true", "z", folder=tmp), contains="`status`")
    test_fail(lambda: record_claim("", "y", "proved", "z", folder=tmp), contains="`key`")
    test_fail(lambda: record_claim("x", "y", "proved", "z", "anchor", folder=tmp), contains="`evidence`")
    for bad in ("../up", "a/b", "..", "a\\b"):
        test_fail(lambda: record_claim("x", "y", "proved", bad, folder=tmp), contains="`chapter` must be a non-empty name")
        test_fail(lambda: record_claim(bad, "y", "proved", "z", folder=tmp), contains="`key` must be a non-empty name")
    test_eq(list(Path(tmp).iterdir()), [])

# %% [markdown]
# A damaged record file (`load_json` reads it as absent) is rewritten with the claim being recorded (the chapter's
# other claims come back as it runs), and `load_claims` names a damaged file rather than building a table without it:

# %%
with tempfile.TemporaryDirectory() as tmp, working_directory(tmp):
    Path("claims").mkdir(); Path("claims/z.json").write_text('{"cut": {"claim')
    test_fail(lambda: load_claims("claims"), contains="z.json")
    record_claim("x", "y", "proved", "z", folder="claims")
    test_eq([c["key"] for c in load_claims("claims")], ["x"])


# %% [markdown]
# ## Helpers of the book's pages
#
# The lesson pages keep the API entries of their internals out of the reader's way: a table of names and short
# docstrings (`api_table`, with the anchors doc links use), or the entries themselves in one folded block
# (`folded_docs` from the functions, `folded_api` from `show_doc` results). They are internal (`exporti`): the
# chapters use them, a user has no need to.

# %%
#| exporti
def short_doc(o, width:int=64)->str:
    "The first sentence of `o`'s docstring, cut at a word outside maths and code to about `width` characters."
    import re
    doc = re.split(r"(?<=[.:;])\s", inspect.getdoc(o).splitlines()[0])[0].rstrip(".:;")
    if len(doc) <= width: return doc.replace("|", "\\|")
    cuts = [m.start() for m in re.finditer(" ", doc[:width])
            if doc[:m.start()].count("$") % 2 == 0 and doc[:m.start()].count("`") % 2 == 0]
    return (doc[:cuts[-1]] + " ...").replace("|", "\\|") if cuts else doc.replace("|", "\\|")

def api_table(*objs):
    "A table of helpers: each name, with the anchor its doc links use, and its docstring in short."
    from IPython.display import Markdown
    rows = [f'| <span id="{o.__qualname__.lower()}"></span>`{o.__qualname__}` | {short_doc(o)} |' for o in objs]
    return Markdown("| helper | what it does |\n|---|---|\n" + "\n".join(rows))

def folded_docs(*fs, summary:str):
    "The `show_doc` entries of `fs` in one folded block: the page shows `summary` until it is opened."
    import re
    from IPython.display import Markdown
    from nbdev.showdoc import show_doc
    docs = [re.sub(r"^\[source\]\(.*\n", "", show_doc(f)._repr_markdown_(), flags=re.M) for f in fs]
    return Markdown(f"<details>\n<summary>{summary}</summary>\n\n" + "\n\n".join(docs) + "\n\n</details>")

def folded_api(*docs):
    "The API entries `docs` (`show_doc` results) in one block that the reader unfolds."
    from IPython.display import Markdown
    entries = "\n\n".join(d._repr_markdown_() for d in docs)
    return Markdown(f"<details><summary>API entries</summary>\n\n{entries}\n\n</details>")


# %%
test_eq(short_doc(api_table), "A table of helpers")
test_eq(short_doc(short_doc, width=20), "The first sentence ...")   # cut at a word, at most 20 characters
assert '<span id="folded_docs"></span>`folded_docs`' in api_table(folded_docs).data
assert folded_docs(short_doc, summary="two").data.startswith("<details>\n<summary>two</summary>")

# %%
show_doc(short_doc)

# %%
show_doc(api_table)

# %%
show_doc(folded_docs)

# %%
show_doc(folded_api)

# %%
#| export
from ictd.boyan import check_arguments
check_arguments(globals())   # every public function refuses, naming it, an argument its annotation rules out (chapter 0)
