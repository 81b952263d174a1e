# %%
#| default_exp engine

# %%
#| export
from __future__ import annotations
import dataclasses, functools, hashlib, importlib, json, math
from dataclasses import dataclass, asdict, field
from pathlib import Path
from typing import Callable
import numpy as np
import torch
from torch import nn
import ictd
from ictd.boyan import check_gamma
from ictd.core import DEFAULT_DTYPE, DefaultDtype, TaskBatch, check_bool, check_choice, check_device, check_fields, check_int, check_number, check_seeds, check_type, check_work, nudge_scale, run_stream, stacked_uniforms, training_dtype
from ictd.model import SoftmaxICTD, theta_star
from ictd.state_tokens import StateTokens, fused_token_predict, population_tokens, state_tokens, token_layers, token_predict, trajectory_tokens
from ictd.tasks import Contexts, TDExamples, TDSample, draw_cdf, gather_rows, sample_trajectories, stationary_examples, task_features, task_pool

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *
from ictd.state_tokens import population_neu

# %% [markdown]
# # The training engine's parts
# > What chapter 6's training loop is handed: the configuration of a run, the registries of model families and data protocols, the softmax family, the stationary protocol and the four training objectives.

# %% [markdown]
# [Chapter 6](pretrain.html) shows the loop that trains every seed of a configuration in one
# batched pass. The loop knows a model and its data only through two small interfaces, a model
# **family** and a data **protocol**, and a run only through its configuration. This page is the
# library behind them: the configuration and its validation, the result of a run, the two
# interfaces and their registries, the softmax family (chapter 6's model on state tokens), the
# stationary protocol (chapter 6's examples, for every seed at once) and the four training
# objectives. Read chapter 6 first; come here to add a family or a protocol, or to check what a
# setting means. Every section gives the code, its API entry and the checks that test it.

# %% [markdown]
# ## What a run is
#
# `PretrainConfig` holds every setting of a run, validated when it is built (a `ValueError` naming
# the field). Its defaults are the experiment of the paper as this project reads its description; `EMERGENCE`, chapter 6's training run,
# changes the learning rate to $10^{-2}$ and the number of steps to 2000. `key()` names the folder
# of a configuration's cached runs: a hash of every setting but the seed, of the package version
# and of its source (`source_hash`), so that a changed training code never loads an old result.

# %%
#| export
DTYPES = dict(float64=torch.float64, float32=torch.float32)

FEATURES = ("random", "unit", "onehot")
OBJECTIVES = ("td", "mc", "supervised", "td-independent")   # the training targets (see "Four objectives" below)
INITS = ("xavier", "theta_star")

@functools.lru_cache(maxsize=None)
def _hash_files(files:tuple)->str:
    h = hashlib.sha1()
    for f in files: h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]

def source_hash()->str:
    "A short hash of the package's source (every `ictd/*.py` file, names and contents), read once per process: a changed code never loads an old result."
    return _hash_files(tuple(sorted(Path(ictd.__file__).parent.glob("*.py"))))


# %%
test_eq(len(source_hash()), 12)
assert source_hash() != _hash_files(tuple(sorted(Path(ictd.__file__).parent.glob("*.py")))[1:])   # one file fewer, another hash


# %% [markdown]
# The configuration itself: every field with its default and a comment saying what it sets. `__post_init__` checks
# each field in turn, and `key()` hashes the settings together with `source_hash()`.

# %%
#| export
@dataclass(frozen=True)
class PretrainConfig:
    "Every setting of a pretraining run (defaults: the paper's experiment as this project reads it)."
    n_states:int = 10           # states per Boyan chain
    d:int = 4                   # feature dimension
    features:str = "random"     # "random", "unit" or "onehot" (then d = n_states)
    n:int = 30                  # context length
    n_layers:int = 3            # depth L
    shared:bool = False         # one parameter set for all layers
    gamma:float = 0.9           # discount factor
    lr:float = 1e-3             # Adam learning rate
    weight_decay:float = 1e-6   # Adam weight decay
    init_gain:float = 0.1       # gain of the Xavier-normal initialisation
    n_tasks:int = 4096          # size of the training task pool
    batch_size:int = 64         # examples per step
    n_steps:int = 6000          # optimiser steps
    eval_every:int = 250        # steps between evaluations
    eval_tasks:int = 256        # held-out tasks for the metrics
    seed:int = 0                # seeds the model, the task pools and the data stream
    attention:str = "softmax"   # model family: a registered name ("softmax"; "linear" from chapter 7)
    protocol:str = "stationary" # data protocol: a registered name ("stationary"; "sliding" from appendix C)
    dtype:str = DEFAULT_DTYPE   # "float64" or "float32" for the parameters and the training passes (metrics in float64); default float64, float32 on CUDA
    objective:str = "td"        # training target at the query: one of `OBJECTIVES` ("td", "mc", "supervised", "td-independent")
    init:str = "xavier"         # "xavier" (gain `init_gain`) or "theta_star" (every layer theta*(W = init_beta I, init_alpha))
    init_scale:float = 0.       # std of a Gaussian perturbation added to every initial parameter (0: none)
    init_beta:float = 1.        # theta_star initialisation: the score matrix W = init_beta I
    init_alpha:float = 1.       # theta_star initialisation: the TD step size alpha
    record_params:bool = False  # also record every parameter at each evaluation (history "param.<name>")

    def __post_init__(self):
        "Validate every field (a `ValueError` naming it) and store integer-valued numbers as `int`."
        ints = {name: 1 for name in ("n_states", "d", "n", "n_layers", "n_tasks", "batch_size", "eval_every", "eval_tasks")} | dict(n_steps=0, seed=0)
        for name, low in ints.items(): object.__setattr__(self, name, check_int(getattr(self, name), name, low))
        if self.n_states < 2: raise ValueError(f"`n_states` must be an integer >= 2, got {self.n_states}")
        for name, allowed in dict(features=FEATURES, dtype=tuple(DTYPES), objective=OBJECTIVES, init=INITS).items(): check_choice(getattr(self, name), allowed, name)
        for name in ("shared", "record_params"):
            if not isinstance(getattr(self, name), bool): raise ValueError(f"`{name}` must be a bool, got {getattr(self, name)!r}")
        for name in ("attention", "protocol"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name): raise ValueError(f"`{name}` must be a registered name (a non-empty str), got {getattr(self, name)!r}")
        check_gamma(self.gamma)
        if self.objective == "mc": mc_horizon(self.gamma)   # refuses rollouts too long to plan, before any training
        for name, low, strict in (("lr", 0, True), ("init_gain", 0, True), ("weight_decay", 0, False), ("init_scale", 0, False),
                                  ("init_beta", -math.inf, False), ("init_alpha", -math.inf, False)):
            object.__setattr__(self, name, check_number(getattr(self, name), name, low, strict))

    @property
    def feature_dim(self)->int:
        "The number of features d of the tasks (n_states for one-hot features)."
        return self.n_states if self.features == "onehot" else self.d

    def key(self)->str:
        "A short hash of every setting but the seed (and of the `ICTD_PERTURB` nudge, when set), of the package version and of its source: the name of a configuration's folder."
        settings = {k: v for k, v in asdict(self).items() if k != "seed"} | ({"nudge": nudge_scale()} if nudge_scale() else {})   # ICTD_PERTURB runs apart
        return hashlib.sha1(json.dumps(dict(settings=settings, version=ictd.__version__, source=source_hash()), sort_keys=True).encode()).hexdigest()[:12]

EMERGENCE = PretrainConfig(lr=1e-2, n_steps=2000, eval_every=200)   # chapter 6's training run: the default model and data, a tuned learning rate

# %% [markdown]
# The default `dtype` is float64 on the CPU and float32 on CUDA, where float64 is slow on most GPUs; asking for
# "float64" keeps float64 there. The default equals "float64", so a configuration's key and saved files are unchanged:

# %%
test_eq(training_dtype(PretrainConfig()), "float64")
test_eq(training_dtype(PretrainConfig(), "cuda"), "float32")
test_eq(training_dtype(PretrainConfig(dtype="float64"), "cuda"), "float64")
test_eq(training_dtype(dataclasses.replace(PretrainConfig(), lr=0.1), "cuda"), "float32")   # the default survives replace
test_eq(PretrainConfig().key(), PretrainConfig(dtype="float64").key())
test_eq(type(dataclasses.asdict(PretrainConfig())["dtype"]), str)                       # saved as a plain str

# %%
test_eq(PretrainConfig().key(), PretrainConfig(seed=5).key())
assert PretrainConfig().key() != PretrainConfig(lr=1e-2).key() != PretrainConfig(dtype="float32").key()
test_fail(lambda: PretrainConfig(dtype="float16"), contains="`dtype` must be one of")
for bad in (dict(features="cubic"), dict(n=-3), dict(n_states=1), dict(gamma=1.), dict(lr=0.), dict(lr=math.nan), dict(batch_size=2.5),
            dict(objective="q-learning"), dict(init="zeros"), dict(init_scale=-1.), dict(init_alpha=math.inf), dict(shared=1), dict(seed=-1)):
    test_fail(lambda: PretrainConfig(**bad), contains=f"`{next(iter(bad))}`")
test_eq(type(PretrainConfig(n=30.0).n), int)

# %%
#| export
HISTORY_SCHEMA = dict(   # history name -> (shape of one seed's record, E evaluations and L layers; what it is, in what unit)
    step=(("E", 1), "optimiser steps taken when the evaluation ran (int64; 0, eval_every, ..., n_steps)"),
    loss=(("E", 1), "mean training loss over the steps since the previous evaluation: the objective's squared error, "
                    "in squared value units (NaN at step 0)"),
    msve=(("E", 1), "mean over the held-out tasks of the d_pi-weighted squared value error at the queries (squared value units)"),
    neu=(("E", 1), "sampled norm of the expected TD update, unbiased (squared parameter-gradient units; discrete tasks)"),
    neu_population=(("E", 1), "softmax family: the norm of the expected update over the population of contexts (discrete tasks)"),
    diagonality=(("E", "L"), "per layer: attention weight a query puts on the keys that leave its own state, "
                             "averaged over queries and tasks (a fraction in [0, 1]; discrete tasks)"),
    value_weights=(("E", "L", "k"), "per layer: the value-update weights (reward, successor value, current value), "
                                    "k = 3 for softmax; causal adds the per-token current value, k = 4 (weights, no unit)"),
    cosine=(("E", "L", 3), "softmax family, per layer: cosine of (A, V_cur, V_tgt) with theta*(W = I, alpha = 1) (in [-1, 1])"),
    recency=(("E", "L"), "causal family, per layer: the positional bias lambda of the logit lambda log p"),
    iws=(("E", 1), "linear family: implicit weight similarity with linear TD (chapter 7; in [-1, 1])"),
    vd=(("E", 1), "linear family: d_pi-weighted squared value difference from linear TD (squared value units)"),
    ss=(("E", 1), "linear family: sensitivity similarity with linear TD (chapter 7)"),
    P_last=(("E", 1), "linear family: the last layer's readout entry P[-1, -1] (chapter 7)"),
    trQ11=(("E", 1), "linear family: trace of the Q block on (phi, phi) (chapter 7)"),
    trQ12=(("E", 1), "linear family: trace of the Q block on (phi, gamma phi') (chapter 7)"),
    **{"param.<name>": (("E", "..."), "with `record_params`: parameter <name> of the family (its own shape, per layer), float64")},
)

def history_schema(name:str)->tuple:
    "The documented (shape, meaning) of history entry `name` (`param.A` reads the `param.<name>` row), or a `ValueError` naming `name` when `HISTORY_SCHEMA` does not document it."
    key = "param.<name>" if isinstance(name, str) and name.startswith("param.") else name
    return HISTORY_SCHEMA[check_choice(key, tuple(HISTORY_SCHEMA), "name")]

@dataclass(eq=False)
class PretrainResult:
    """The trained model and the metrics recorded during training.

    `history` maps a name to a float64 tensor (int64 for `step`) with one row per evaluation: E = n_steps // eval_every + 1
    rows, at steps 0, eval_every, ..., n_steps; `stack_results` puts a seed axis in front. Every name, its shape and its unit
    are in `HISTORY_SCHEMA` (L is the depth `n_layers`): step (E, 1), loss (E, 1), msve (E, 1), neu (E, 1); the softmax
    family adds neu_population (E, 1), diagonality (E, L), value_weights (E, L, 3) and cosine (E, L, 3); the causal family
    value_weights (E, L, 4), recency (E, L) and diagonality (E, L); the linear family iws, vd, ss, P_last, trQ11 and trQ12,
    each (E, 1); `record_params=True` adds param.<name> (E, ...) for every parameter.
    `predict` evaluates the trained model under `torch.no_grad()` unless asked for a graph (`grad=True`)."""
    config:PretrainConfig
    model:nn.Module|None                        # built by the model family (a `SoftmaxICTD` for "softmax"); None for a run read back without its model
    history:dict = field(default_factory=dict)  # name -> (E, ...) tensor, one row per evaluation: see `HISTORY_SCHEMA`
    held_out:TaskBatch = None                   # the held-out tasks the metrics were measured on (None for continuous states)
    params:dict = None                          # the family's parameters as the engine holds them, without the seed axis

    def __post_init__(self): check_fields(self)

    def predict(self, Z,            # the model's prompt: a `Prompt`, or a tensor with `n`
                n=None,             # number of context transitions (from the `Prompt` when omitted)
                *,
                grad:bool=False,    # True: record an autograd graph through the model's parameters
               )->torch.Tensor:     # (..., q) the trained model's values at the queries
        "The trained model's values, under `torch.no_grad()` unless `grad=True`."
        with torch.set_grad_enabled(check_bool(grad, "grad")): return self.model.predict(Z, n)


# %% [markdown]
# ### What a run records
#
# `PretrainResult.history` holds one row per evaluation. The table below is `HISTORY_SCHEMA`, the one place that
# names each entry, its shape for one seed (E evaluations, L layers) and its unit; a test runs tiny pretraining runs
# of every family and checks that each entry they record is in it, with that shape.

# %%
from IPython.display import Markdown

# %%
Markdown("| entry | shape (one seed) | what it is |\n|---|---|---|\n" + "\n".join(
    f"| `{k}` | ({', '.join(map(str, shape))}) | {what} |" for k, (shape, what) in HISTORY_SCHEMA.items()))


# %% [markdown]
# The experiments compare seeds, so they want the runs of a configuration as tensors with a leading seed axis:

# %%
#| export
def stack_results(results:list)->dict:
    "Runs of one configuration stacked over seeds: params name -> (S, ...), history name -> (S, evaluations, ...)."
    return dict(params={k: torch.stack([r.params[k] for r in results]) for k in results[0].params},
                history={k: torch.stack([r.history[k] for r in results]) for k in results[0].history})


# %%
runs = [PretrainResult(PretrainConfig(seed=s), None, dict(msve=torch.full((3, 1), float(s))), params=dict(A=torch.full((2, 2), float(s)))) for s in range(4)]
stacked = stack_results(runs)
test_eq((stacked["history"]["msve"].shape, stacked["params"]["A"].shape), ((4, 3, 1), (4, 2, 2)))
test_eq(stacked["params"]["A"][2], runs[2].params["A"])
test_fail(lambda: PretrainResult(PretrainConfig(), "model"), contains="`model` must be a Module or None")
test_fail(lambda: PretrainResult("config", None), contains="`config` must be a PretrainConfig")
test_eq(history_schema("param.A"), HISTORY_SCHEMA["param.<name>"])
test_fail(lambda: history_schema("accuracy"), contains="`name` must be one of")


# %% [markdown]
# ## Families and protocols

# %% [markdown]
# The engine knows a model family and a data protocol only through a
# small interface, so that another module can add its own without editing this one: chapter 7
# registers linear attention and its predecessor's sliding-window protocol, chapter 8 the
# continuous task families, and a decoder-only model can register itself from its own module. A
# plug-in registers its names when it is imported (`import ictd.linear` makes
# `attention="linear"` and `protocol="sliding"` available). A lookup of a name not yet registered first imports the
# book's own plug-ins (`PLUGINS`), so `PretrainConfig(attention="causal")` trains whatever the caller imported.
#
# A **family** initialises the stacked parameters of a list of seeds (each seed's slice its own
# single-seed initialisation), encodes `Contexts` as its input, predicts the values at the queries
# (differentiably, for every seed at once), turns one seed's parameters into a module, and may add
# metrics of its own at each evaluation. A **protocol** supplies every seed's training data, a
# batch of `TDExamples` per step (seed $i$ draws from generator $i$; a `state` dictionary of
# tensors and numbers carries anything it needs across steps and is saved in checkpoints), and
# the held-out `EvalSet`. Where the current and successor inputs share their context, as in the
# stationary protocol, a batch holds both queries in one prompt and the context is encoded once.

# %%
#| export
@dataclass(frozen=True)
class Family:
    "A model family for the engine: stacked parameters with a leading seed axis, inputs, predictions, modules and metrics."
    init:Callable           # (config, seeds, dtype) -> dict name -> (S, ...) tensor; seed i's slice is that seed's own initialisation
    prompt:Callable         # (config, Contexts) -> the model's input for every seed (float64)
    predict:Callable        # (config, params, input, n) -> (S, B..., q) values at the queries, differentiable in params
    module:Callable         # (config, params of one seed, no seed axis) -> nn.Module with .predict(Z, n)
    metrics:Callable = None # (config, params (S, ...) in float64, EvalSet) -> dict name -> (S, ...) tensor

    def __post_init__(self): check_fields(self)


# %% [markdown]
# A protocol is the data side: what a step trains on and what the metrics are measured on.

# %%
#| export
@dataclass(frozen=True)
class Protocol:
    "A data protocol for the engine: every seed's training data, its batches of TD examples, and its held-out evaluation set."
    sample:Callable          # (config, data, gens, step, state) -> TDExamples of every seed; seed i draws from gens[i]
    eval_set:Callable        # (config, seeds, device) -> EvalSet of every seed, its input built by the configuration's family
    data:Callable = None     # (config, seeds, device) -> what `sample` draws from (e.g. stacked task pools); None: nothing
    loss_scale:float = 0.5   # the loss is loss_scale * mean squared TD error over a seed's batch

    def __post_init__(self): check_fields(self)


# %% [markdown]
# The registries are two dictionaries from names to families and protocols. A plug-in module adds to them when it
# is imported, and `PretrainConfig(attention=..., protocol=...)` names what it wants from them. Registering anything
# but a `Family` (or a `Protocol`) fails at once, not at the first training step.

# %%
#| export
FAMILIES, PROTOCOLS = {}, {}

def register_family(name:str, family:Family):
    "Make `family` available as `PretrainConfig(attention=name)` (call it when the family's module is imported)."
    if not isinstance(family, Family): raise ValueError(f"`family` must be a Family, got {type(family).__name__}")
    FAMILIES[name] = family


# %%
test_fail(lambda: register_family("mine", print), contains="`family` must be a Family, got builtin_function_or_method")
test_fail(lambda: Family("init", print, print, print), contains="`init` must be a callable")


# %%
#| export
def register_protocol(name:str, protocol:Protocol):
    "Make `protocol` available as `PretrainConfig(protocol=name)` (call it when the protocol's module is imported)."
    if not isinstance(protocol, Protocol): raise ValueError(f"`protocol` must be a Protocol, got {type(protocol).__name__}")
    PROTOCOLS[name] = protocol


# %%
test_fail(lambda: register_protocol("mine", Family(*[print] * 4)), contains="`protocol` must be a Protocol, got Family")
test_fail(lambda: Protocol(print, "eval_set"), contains="`eval_set` must be a callable")
test_fail(lambda: Protocol(print, print, loss_scale="0.5"), contains="`loss_scale` must be a number")

# %% [markdown]
# A lookup of a name not yet registered imports the book's plug-ins first; a name that none of them registers is
# refused with the names that exist and how a plug-in's names become available:

# %%
#| export
PLUGINS = ("ictd.linear", "ictd.sliding", "ictd.causal", "ictd.continuous")   # the book's modules that register families and protocols

def load_plugins():
    "Import every module of `PLUGINS`, so that each family and protocol of the book is registered whatever the caller imported."
    for m in PLUGINS: importlib.import_module(m)

def _lookup(registry:dict, name:str, what:str):
    if name not in registry: load_plugins()
    if name not in registry: raise ValueError(f"`{what}` must be one of {sorted(registry)} (a plug-in registers its names when imported, e.g. `import ictd.linear`), got {name!r}")
    return registry[name]

def get_family(name:str)->Family:
    "The registered model family `name`."
    return _lookup(FAMILIES, name, "attention")


# %%
#| export
def get_protocol(name:str)->Protocol:
    "The registered data protocol `name`."
    return _lookup(PROTOCOLS, name, "protocol")


# %%
test_fail(lambda: get_family("cubic"), contains="`attention` must be one of")
test_fail(lambda: get_protocol("no such protocol"), contains="a plug-in registers its names when imported, e.g. `import ictd.linear`")

# %%
import ictd.engine as _engine   # the module's registries (this page's cells have their own copies)

# %%
test_eq((_engine.get_family("causal").predict is not None, _engine.get_protocol("sliding").loss_scale), (True, 1.))   # plug-ins load on demand


# %% [markdown]
# Evaluation runs for every seed at once, always in float64. `EvalSet` holds each seed's
# held-out prompts with every evaluation point as a query, their true values and the weights of the
# MSVE:

# %%
#| export
@dataclass(eq=False)
class EvalSet:
    "Every seed's held-out prompts with every evaluation point as a query, their true values, and the weights of the MSVE."
    x:object                  # the family's input: one context per held-out task, queries at the m evaluation points
    v_pi:torch.Tensor         # (S, E, m) true values at the queries
    weights:torch.Tensor      # (S, E, m) weights of the MSVE over the queries (d_pi, or a quadrature rule)
    tasks:TaskBatch = None    # discrete tasks: the held-out tasks (S, E, ...), whose states 0..s-1 are the queries; None otherwise
    states:torch.Tensor = None  # discrete tasks: (S, E, n + 1) the contexts

    def __post_init__(self): check_fields(self)


# %% [markdown]
# ## The stationary protocol
#
# Chapter 6's examples, drawn for every seed at once: seed $i$'s batch is the one `td_batch`
# draws from seed $i$'s pool with generator $i$ (checked in [chapter 6](pretrain.html#examples-as-state-indices)).
# Seed $s$'s training pool is `task_pool(config, n_tasks, run_stream(s, "train_pool"))`; its held-out
# tasks come from its stream `eval_pool` and their contexts from its stream `eval_contexts`
# (appendix A's named streams), so no run's held-out tasks are any run's training tasks.

# %%
#| export
def stationary_pools(config:PretrainConfig, seeds:list, device=None)->TaskBatch:
    "The training pools of the stationary protocol, stacked over seeds: seed s's pool is `task_pool(config, n_tasks, run_stream(s, 'train_pool'))`."
    return TaskBatch.stack([task_pool(config, config.n_tasks, run_stream(s, "train_pool")) for s in seeds], device)


# %%
cfg = PretrainConfig(n_tasks=3)
pools = stationary_pools(cfg, [0, 1])
test_eq(pools.P.shape, (2, 3, 10, 10))
test_eq(pools.v_pi[1], task_pool(cfg, 3, run_stream(1, "train_pool")).v_pi)

# %% [markdown]
# A step's examples: for each seed, `batch_size` prompts, each a random task of its pool, a context from its
# stationary distribution and a query with its successor, both as queries of the one prompt (so the context is
# encoded once for the two values a TD error needs).

# %%
#| export
_BYTE_SUM = np.uint64(0x0101010101010101)   # times a word of eight 0/1 bytes: their sum in the top byte

def _walk_examples(pool:TaskBatch, u:torch.Tensor, host:bool=None)->TDSample:
    "`stationary_examples(pool, u)`, draw for draw, with fewer operations per transition: each example's rows of P gathered and summed once, a last entry of +inf in place of the clamp; the walk in numpy on the CPU (`host`, default: there), else in torch."
    (S, T, s), n = pool.P.shape[:3], u.shape[-1] - 4
    u = u.permute(2, 0, 1).contiguous()                                             # (n + 4, S, B)
    task = (u[0] * T).long().clamp(max=T - 1)
    rows = (torch.arange(S, device=u.device)[:, None] * T + task).flatten()          # each example's task among all seeds' pools
    cum = pool.P.reshape(S * T, s, s).index_select(0, rows).cumsum(-1)
    start = pool.d_pi.reshape(S * T, s).index_select(0, rows).cumsum(-1)
    cum[..., -1] = start[..., -1] = torch.inf                                        # a uniform never passes the last entry: no clamp
    N, out = len(rows), lambda x: x.reshape(S, -1, *x.shape[1:])
    if host if host is not None else u.device.type == "cpu":   # a draw: the count of a row's entries below its uniform
        table = cum.new_full((N, s + 1, -(-s // 8) * 8), torch.inf)                   # rows padded to words of 8 flags
        table[:, :s, :s], table[:, s, :s] = cum, start                               # row s of an example: d_pi's
        table, us, first = table.reshape(N * (s + 1), -1).numpy(), u[1:].reshape(n + 3, N, 1).numpy(), np.arange(N) * (s + 1)
        def draw(at, u):
            words = (table.take(at, axis=0) < u).view(np.uint64) * _BYTE_SUM >> np.uint64(56)   # (N, words) flag counts
            return sum(words[:, k] for k in range(words.shape[1])).astype(np.int64)
        states = np.empty((n + 1, N), dtype=np.int64)
        states[0] = draw(first + s, us[0])
        for t in range(n): states[t + 1] = draw(first + states[t], us[t + 1])
        query = draw(first + s, us[n + 1])
        successor = draw(first + query, us[n + 2])
        states, query, successor = (torch.from_numpy(x) for x in (states.T, query, successor))
        return TDSample(task, out(states), out(query), out(successor))
    cum, base, us = cum.reshape(-1, s), torch.arange(N, device=u.device) * s, u[1:].reshape(n + 3, -1, 1)
    states = torch.empty(n + 1, N, dtype=torch.long, device=u.device)
    states[0] = torch.searchsorted(start, us[0])[:, 0]
    for t in range(n): states[t + 1] = torch.searchsorted(cum.index_select(0, base + states[t]), us[t + 1])[:, 0]
    query = torch.searchsorted(start, us[n + 1])[:, 0]
    successor = torch.searchsorted(cum.index_select(0, base + query), us[n + 2])[:, 0]
    return TDSample(task, out(states.T), out(query), out(successor))

def stationary_sampler(config:PretrainConfig, pool:TaskBatch, gens:list, step:int, state:dict)->TDExamples:
    "The stationary protocol: seed i's examples are those of `td_batch(pool[i], batch_size, n, gens[i])`, drawn for all seeds at once."
    u = stacked_uniforms(gens, (config.batch_size, config.n + 4), pool.P.device)   # row i from gens[i]
    b = _walk_examples(pool, u)
    return TDExamples(Contexts(pool, b.task, b.states, torch.stack([b.query, b.successor], -1)), task_features(pool, b.task, b.query)[1])


# %%
b = stationary_sampler(cfg, pools, [torch.Generator().manual_seed(s) for s in (0, 1)], 0, {})
test_eq((b.x.states.shape, b.x.queries.shape, b.reward.shape), ((2, 64, 31), (2, 64, 2), (2, 64)))
test_eq(b.reward, pools.r[torch.arange(2)[:, None], b.x.task, b.x.queries[..., 0]])
for seed in range(3):   # the sampler's walk draws exactly what chapter 6's `stationary_examples` draws from the same uniforms
    u = torch.rand(2, 64, 34, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ref = stationary_examples(pools, u)
    for host in (True, False):   # the walk in numpy and in torch
        fast = _walk_examples(pools, u, host)
        for k in ("task", "states", "query", "successor"): assert torch.equal(getattr(ref, k), getattr(fast, k)), (host, k)


# %%
#| export
def held_out_tasks(config:PretrainConfig)->tuple:
    "The held-out tasks of a run (its stream `eval_pool`, apart from its training pool) and one context per task (its stream `eval_contexts`)."
    tasks = task_pool(config, config.eval_tasks, run_stream(config.seed, "eval_pool"))
    return tasks, sample_trajectories(tasks.P, tasks.d_pi, n=config.n, seed=run_stream(config.seed, "eval_contexts"))


# %%
held, contexts = held_out_tasks(PretrainConfig(eval_tasks=8, seed=1))
test_eq((held.P.shape, contexts.shape), ((8, 10, 10), (8, 31)))
train = stationary_pools(PretrainConfig(n_tasks=256), [1])
assert not any(torch.equal(h, p) for h in held.P for p in train.P[0])   # none of them is among the run's first 256 training tasks


# %% [markdown]
# A baseline that has settings of its own (chapter 6a's $\theta^*$, chapter 4a's decoder construction) is
# tuned on tasks apart from the ones it is scored on: the held-out tasks of the run's stream `tuning`,
# which are those of the configuration whose seed is that stream's.

# %%
#| export
def tuning_config(config:PretrainConfig)->PretrainConfig:
    "`config` with its seed replaced by the run's stream `tuning`: its `held_out_tasks` are the run's tuning tasks."
    return dataclasses.replace(config, seed=run_stream(config.seed, "tuning"))


# %%
tune_tasks = held_out_tasks(tuning_config(PretrainConfig(eval_tasks=8, seed=1)))[0]
assert not any(torch.equal(t, h) for t in tune_tasks.P for h in held.P)   # apart from the run's held-out tasks
test_eq(tuning_config(PretrainConfig(seed=1)).seed, run_stream(1, "tuning"))


# %% [markdown]
# The held-out tasks become an `EvalSet` with every state as a query of the task's one context, weighted by its
# $d_\pi$. The input is built by the configuration's family, so this is checked once the softmax family is
# registered ([below](#the-softmax-family)).

# %%
#| export
def task_eval_set(config:PretrainConfig, tasks:TaskBatch, states:torch.Tensor)->EvalSet:
    "The evaluation set of discrete held-out tasks (S, E, ...) with one context each (S, E, n + 1): every state a query, MSVE weights d_pi."
    S, E, s = tasks.r.shape
    task, queries = torch.arange(E, device=states.device).expand(S, E), torch.arange(s, device=states.device).expand(S, E, s)
    return EvalSet(get_family(config.attention).prompt(config, Contexts(tasks, task, states, queries)), tasks.v_pi, tasks.d_pi, tasks, states)


# %% [markdown]
# The stationary protocol's evaluation set stacks the held-out tasks of every seed. With it the protocol is
# complete, and it registers itself under the name chapter 6 uses:

# %%
#| export
def stationary_eval_set(config:PretrainConfig, seeds:list, device=None)->EvalSet:
    "The stationary protocol's evaluation set: every seed's `held_out_tasks`, stacked."
    held = [held_out_tasks(dataclasses.replace(config, seed=s)) for s in seeds]
    return task_eval_set(config, TaskBatch.stack([t for t, _ in held], device), torch.stack([s for _, s in held]).to(device))

register_protocol("stationary", Protocol(sample=stationary_sampler, eval_set=stationary_eval_set, data=stationary_pools))


# %% [markdown]
# The engine asks for the evaluation set of a configuration without knowing its protocol:

# %% [markdown]
# ### A forced divergence
#
# Chapter 6's divergence guard needs runs that diverge on every machine, not at the edge of stability, where the
# last bits of the arithmetic decide. `corrupted_rewards` wraps a registered protocol: from a given step on, the
# query rewards of the chosen seeds are multiplied by a huge factor, so those seeds' TD loss is of the order of the
# factor squared at that very step, whatever their parameters, while the other seeds' batches are unchanged.

# %%
#| export
def corrupted_rewards(seeds,                 # the seeds whose rewards are corrupted
                      step:int,              # the first step at which they are
                      factor:float=1e6,      # what their query rewards are multiplied by
                      base:str="stationary", # the registered protocol that supplies the data
                     )->Protocol:            # `base` with those seeds' rewards scaled from `step` on
    "A protocol that forces a divergence: `base`, with the query rewards of `seeds` times `factor` from `step` on."
    seeds, inner = check_seeds(seeds), get_protocol(base)
    def data(config, run_seeds, device): return (inner.data(config, run_seeds, device) if inner.data else None), list(run_seeds)
    def sample(config, data, gens, at, state):
        pools, run_seeds = data
        b = inner.sample(config, pools, gens, at, state)
        if at < step: return b
        scale = torch.tensor([factor if s in seeds else 1. for s in run_seeds], dtype=b.reward.dtype, device=b.reward.device)
        return dataclasses.replace(b, reward=b.reward * scale.view(-1, *[1] * (b.reward.dim() - 1)))
    return Protocol(sample=sample, eval_set=inner.eval_set, data=data, loss_scale=inner.loss_scale)


# %%
_forced = corrupted_rewards([7], 2, factor=10.)
_base, _cfg = get_protocol("stationary"), PretrainConfig(n_tasks=8, eval_tasks=2, n=5, batch_size=4)
_gens = lambda step: [torch.Generator().manual_seed(s + step) for s in (3, 7)]
for _step in range(4):
    _want = _base.sample(_cfg, _base.data(_cfg, [3, 7], None), _gens(_step), _step, {}).reward
    _got = _forced.sample(_cfg, _forced.data(_cfg, [3, 7], None), _gens(_step), _step, {}).reward
    test_eq(_got, torch.stack([_want[0], _want[1] * (10. if _step >= 2 else 1.)]))


# %%
#| export
def eval_set(config:PretrainConfig, seeds:list, device=None)->EvalSet:
    "The evaluation set of `config.protocol` for `seeds`."
    return get_protocol(config.protocol).eval_set(config, seeds, device)


# %% [markdown]
# `td_values` is the TD target of chapter 6: the prediction at the query with its graph, and
# $r(x_q) + \gamma$ times the prediction at the successor, detached (chapter 6's loop calls it through
# `objective_values`, [below](#four-objectives)).

# %%
#| export
def td_values(config:PretrainConfig, params:dict, b:TDExamples)->tuple:
    "v(x_q) (S, B) with its graph, and the TD target r(x_q) + gamma v(x_q') (S, B), detached, for every seed's examples."
    family = get_family(config.attention)
    v = family.predict(config, params, family.prompt(config, b.x), config.n)
    v, v_next = (v[..., 0], v[..., 1]) if b.successor == "query" else (v[:, :-1, 0], v[:, 1:, 0])
    return v, b.reward.to(v.dtype) + config.gamma * v_next.detach()


# %% [markdown]
# `sampled_neu` is chapter 6's NEU estimate for every seed at once, on stationary batches of the held-out
# tasks (4 of 64, the same generator seed at every evaluation, so that successive estimates differ by the
# parameters only):

# %%
#| export
def sampled_neu(config:PretrainConfig, params:dict, ev:EvalSet, n_batches:int=4, batch_size:int=64, seed:int=0)->torch.Tensor:
    "(S,) `neu` of every seed at once: `n_batches` stationary batches of its held-out tasks, drawn from a generator seeded `seed`."
    S, K = ev.states.shape[0], int(n_batches)
    gens, cfg = [torch.Generator().manual_seed(seed) for _ in range(S)], dataclasses.replace(config, batch_size=batch_size)
    leaf = {k: v.detach().requires_grad_() for k, v in params.items()}
    def update(b):
        v, target = td_values(config, leaf, b)
        grads = torch.autograd.grad(((target - v.detach()) * v).mean(-1).sum(), list(leaf.values()), allow_unused=True)
        return torch.cat([(g if g is not None else torch.zeros_like(p)).flatten(1) for g, p in zip(grads, leaf.values())], -1)
    g = torch.stack([update(stationary_sampler(cfg, ev.tasks, gens, 0, {})) for _ in range(K)], 1)     # (S, K, n_params)
    return (g.sum(1).square().sum(-1) - g.square().sum((1, 2))) / (K * (K - 1))


# %% [markdown]
# ## Four objectives
#
# The engine trains the same model on the same examples with one of four
# targets at the query $x_q$ (`PretrainConfig.objective`), so that what TD's temporal structure adds
# can be measured against controls: `"td"`, the semi-gradient TD target $r(x_q) + \gamma\,
# \mathrm{TF}(Z'; \theta)$ of chapter 6; `"mc"`, a Monte-Carlo return
# $\sum_{t<H} \gamma^t r(S_t)$ of a rollout of the task's chain from $S_0 = x_q$, truncated at the
# horizon $H$ where $\gamma^H \le 10^{-6}$ (its bias is at most $\gamma^H \max|r| / (1 - \gamma)$,
# below $10^{-5}$ for $\gamma = 0.9$ and rewards in $[-1, 1]$); `"supervised"`, the true value
# $v_\pi(x_q)$, known from $P$ and $r$; and `"td-independent"`, TD whose successor is drawn from
# $d_\pi$ independently of $x_q$, which keeps the rewards and removes the temporal structure. The
# draws an objective adds (rollouts, independent successors) come from a sub-stream of the run's
# seed of their own, so the contexts and queries are the same for all four; the evaluation and the
# recorded measures do not depend on the objective.

# %%
#| export
def mc_horizon(gamma:float, tol:float=1e-6)->int:
    "The length H of the Monte-Carlo objective's rollouts: the smallest H >= 1 with gamma^H <= tol."
    gamma = check_gamma(gamma)
    H = 1 if gamma == 0 else max(1, math.ceil(math.log(tol) / math.log(gamma)))
    return int(check_work(H, "steps", f"the Monte-Carlo objective's rollouts at gamma = {gamma}",
                          "use a smaller gamma, or objective='td'"))


# %%
test_eq(mc_horizon(0.9), 132); test_eq(mc_horizon(0.), 1)
test_fail(lambda: PretrainConfig(objective="mc", gamma=0.9999999), contains="the Monte-Carlo objective's rollouts at gamma = 0.9999999 would need")
assert 0.9 ** 131 > 1e-6 >= 0.9 ** 132   # 132 is the smallest such H


# %% [markdown]
# A Monte-Carlo return rolls each example's chain forward from its query, one uniform per step, and sums the
# discounted rewards. On one task, 20,000 returns from state 4 average to $v_\pi(4)$ within sampling error:

# %%
#| export
def rollout_returns(tasks:TaskBatch, task:torch.Tensor, start:torch.Tensor, u:torch.Tensor)->torch.Tensor:
    "(S, B) sampled returns sum_{t<H} gamma^t r(S_t) of chains started at `start` (S, B), with H - 1 = u.shape[-1] uniforms (S, B, H - 1)."
    s = tasks.P.shape[-1]
    cum = gather_rows(tasks.P, task, torch.arange(s, device=u.device).expand(*task.shape, s)).cumsum(-1)   # (S, B, s, s) each example's task
    states, u = [start], u.movedim(-1, 0).contiguous()
    for u_t in u: states.append(draw_cdf(cum.gather(-2, states[-1][..., None, None].expand(*task.shape, 1, s))[..., 0, :], u_t))
    r = task_features(tasks, task, torch.stack(states, -1))[1]
    return (r * tasks.gamma ** torch.arange(len(states), dtype=torch.float64, device=u.device)).sum(-1)


# %%
cfg = PretrainConfig(n_tasks=1, eval_tasks=4, objective="mc")
one = TaskBatch.stack([task_pool(cfg, 1, 3)])
gen = torch.Generator().manual_seed(0)
G = rollout_returns(one, torch.zeros(1, 20_000, dtype=torch.long), torch.full((1, 20_000), 4), torch.rand(1, 20_000, mc_horizon(0.9) - 1, generator=gen, dtype=torch.float64))
print(f"MC mean {G.mean():.4f} +- {G.std() / 20_000 ** 0.5:.4f} (one standard error), v_pi(4) = {one.v_pi[0, 0, 4]:.4f}")
assert abs(G.mean() - one.v_pi[0, 0, 4]) < 4 * G.std() / 20_000 ** 0.5


# %% [markdown]
# The `"td-independent"` control needs a successor drawn from $d_\pi$ regardless of the query: an inverse-CDF
# draw from each example's task, whose frequencies match $d_\pi$ (the same generator, continued):

# %%
#| export
def stationary_draws(tasks:TaskBatch, task:torch.Tensor, u:torch.Tensor)->torch.Tensor:
    "(S, B) states drawn from d_pi of the tasks `task` (S, B) of every seed, one per uniform of `u` (S, B)."
    return draw_cdf(gather_rows(tasks.d_pi[..., None, :], task, torch.zeros_like(task)).cumsum(-1), u)


# %%
draws = stationary_draws(one, torch.zeros(1, 20_000, dtype=torch.long), torch.rand(1, 20_000, generator=gen, dtype=torch.float64))
test_close(torch.bincount(draws[0], minlength=10) / 20_000, one.d_pi[0, 0], eps=0.015)


# %% [markdown]
# `objective_values` dispatches on `config.objective`: the prediction at the query with its graph, and the
# detached target of that objective. Chapter 6's loop calls it at every step; `tests/test_objectives.py` checks
# each target against its definition.

# %%
#| export
def objective_values(config:PretrainConfig, params:dict, b:TDExamples, gens:list)->tuple:
    "v(x_q) (S, B) with its graph and the target of `config.objective` (S, B), detached; `gens` (one per seed) draw what the objective adds to the data."
    if config.objective == "td": return td_values(config, params, b)
    x = b.x
    if x.tasks is None or b.successor != "query": raise ValueError(f"`objective` {config.objective!r} needs a protocol of discrete tasks with the successor as a query (as 'stationary'), got protocol {config.protocol!r}")
    S, B = x.task.shape
    uniforms = lambda *shape: torch.stack([torch.rand(B, *shape, generator=g, dtype=torch.float64) for g in gens]).to(x.task.device)
    query = x.queries[..., 0]
    if config.objective == "td-independent":
        return td_values(config, params, dataclasses.replace(b, x=dataclasses.replace(x, queries=torch.stack([query, stationary_draws(x.tasks, x.task, uniforms())], -1))))
    family = get_family(config.attention)
    v = family.predict(config, params, family.prompt(config, dataclasses.replace(x, queries=x.queries[..., :1])), config.n)[..., 0]
    if config.objective == "supervised": return v, gather_rows(x.tasks.v_pi, x.task, query).to(v.dtype)
    return v, rollout_returns(x.tasks, x.task, query, uniforms(mc_horizon(config.gamma) - 1)).to(v.dtype)


# %%
#| export
COMPILABLE = ("td", "supervised")   # the objectives whose targets draw nothing: a compiled step is the same function

def step_loss(config:PretrainConfig,  # the run's settings
              protocol,               # its data protocol (`get_protocol(config.protocol)`)
              target_gens:list,       # one generator per seed, for what the objective draws
              compile:bool=False,     # compile with `torch.compile`: on CUDA in 'reduce-overhead' mode (CUDA graphs)
              device=None,            # where the run trains
             ):                       # loss(params, batch) -> (S,) one loss per seed
    "The training loss of a step as a function of the parameters and the batch, compiled when asked."
    def loss(params, batch):
        v, target = objective_values(config, params, batch, target_gens)   # (S, B); target fixed
        return protocol.loss_scale * (target - v).square().mean(-1)        # (S,): a loss per seed
    if not check_type(compile, bool, "compile"): return loss
    if config.objective not in COMPILABLE:
        raise ValueError(f"`compile` needs an objective whose targets draw nothing, one of {COMPILABLE}; got {config.objective!r}")
    cuda = check_device(device).type == "cuda"
    compiled = torch.compile(loss, mode="reduce-overhead" if cuda else "default", dynamic=False)
    return (lambda params, batch: compiled(params, batch).clone()) if cuda else compiled   # a replay overwrites the last one's output


# %% [markdown]
# ## The softmax family
#
# Chapter 6's model on state tokens: each seed's initialisation is the one `SoftmaxICTD` draws with
# that seed (or $\theta^*$ for `init="theta_star"`), the input is state tokens (exact for discrete
# tasks, one token per context state for continuous ones), and the family adds the value-update
# weights, the cosines to $\theta^*$, the population NEU and the kernel diagonality of every layer to
# each evaluation. Chapter 6 checks its metrics against those of one model on full prompts
# ([Evaluation](pretrain.html#evaluation)).

# %%
#| export
def softmax_init(config:PretrainConfig, seeds:list, dtype)->dict:
    "Each seed's `SoftmaxICTD` initialisation (Xavier, or theta* for `init='theta_star'`), stacked: A, V_cur, V_tgt of shape (S, L or 1, d + 2, d + 2)."
    d = config.feature_dim
    if config.init == "theta_star":
        W = config.init_beta * torch.eye(d, dtype=torch.float64)
        models = [SoftmaxICTD.from_theta_star(d, W, n_layers=config.n_layers, alpha=config.init_alpha, gamma=config.gamma, shared=config.shared)] * len(seeds)
    else: models = [SoftmaxICTD(d, n_layers=config.n_layers, shared=config.shared, init_gain=config.init_gain, seed=run_stream(s, "init")) for s in seeds]
    return {k: torch.stack([torch.stack([getattr(lay, k).detach() for lay in m.layers]) for m in models]).to(dtype) for k in ("A", "V_cur", "V_tgt")}


# %%
cfg = PretrainConfig(n_layers=2)
params = softmax_init(cfg, [0, 3], torch.float64)
test_eq(params["A"].shape, (2, 2, 6, 6))
test_eq(params["V_tgt"][1, 1], SoftmaxICTD(4, n_layers=2, seed=run_stream(3, "init")).layers[1].V_tgt.detach())   # seed 3's slice: seed 3's own model


# %% [markdown]
# The engine holds parameters as plain tensors; a finished run hands back one seed's as a module:

# %%
#| export
def softmax_module(config:PretrainConfig, params:dict)->SoftmaxICTD:
    "A `SoftmaxICTD` carrying one seed's parameters (L or 1, D, D)."
    model = SoftmaxICTD(config.feature_dim, n_layers=config.n_layers, shared=config.shared, seed=0, dtype=params["A"].dtype)
    model.load_state_dict({f"layers.{l}.{k}": params[k][l] for l in range(params["A"].shape[0]) for k in ("A", "V_cur", "V_tgt")})
    return model


# %%
model = softmax_module(cfg, {k: v[1] for k, v in params.items()})
test_eq(model.layers[1].V_tgt.detach(), params["V_tgt"][1, 1])


# %% [markdown]
# The family's input is state tokens (chapter 6's [exact encoding of a discrete prompt](pretrain.html)); the
# evaluation set below is built with it.

# %%
#| export
def softmax_prompt(config:PretrainConfig, x:Contexts)->StateTokens:
    "State tokens of every seed's prompts: one per state of a discrete task (exact), or one per context state of continuous ones."
    return state_tokens(x.tasks, x.task, x.states, x.queries) if x.tasks is not None else trajectory_tokens(*x.features())


# %% [markdown]
# The population NEU, at $n = \infty$, of every seed at once: it equals `population_neu` of each seed's own model
# (checked on three tasks per seed).

# %%
#| export
def population_neu_many(config:PretrainConfig, params:dict, tasks:TaskBatch)->torch.Tensor:
    "(S,) NEU at n = infinity of every seed's parameters on its tasks (leading seed axis)."
    leaf = {k: v.detach().requires_grad_() for k, v in params.items()}
    v = token_predict(leaf, config.n_layers, population_tokens(tasks))
    with torch.no_grad(): delta = tasks.r + tasks.gamma * (tasks.P @ v.unsqueeze(-1)).squeeze(-1) - v
    grads = torch.autograd.grad((tasks.d_pi * delta * v).sum(-1).mean(-1).sum(), list(leaf.values()))
    return sum(g.flatten(1).square().sum(-1) for g in grads)


# %%
pair = TaskBatch.stack([task_pool(cfg, 3, s) for s in (0, 3)])
neu = population_neu_many(cfg, params, pair)
test_close(neu[1], population_neu(model, task_pool(cfg, 3, 3)), eps=1e-12)


# %% [markdown]
# The family's metrics at each evaluation, for every seed (compared with those of one model on full prompts in
# chapter 6's [Evaluation](pretrain.html#evaluation)):

# %%
#| export
def softmax_metrics(config:PretrainConfig, params:dict, ev)->dict:
    "Value weights (S, L, 3) and block cosines (S, L, 3) of every seed; on discrete tasks also population NEU (S, 1) and diagonality (S, L)."
    L, d, Lp = config.n_layers, config.feature_dim, params["A"].shape[1]
    with torch.no_grad():
        star = theta_star(d, torch.eye(d, dtype=torch.float64, device=params["A"].device), alpha=1., gamma=config.gamma)
        blocks = [params[k][:, [l % Lp for l in range(L)]] for k in ("A", "V_cur", "V_tgt")]       # (S, L, D, D)
        cos = torch.stack([(b * t).sum((-2, -1)) / (b.flatten(-2).norm(dim=-1) * t.norm()).clamp(min=1e-300) for b, t in zip(blocks, star)], -1)
        V_cur, V_tgt = blocks[1], blocks[2]
        weights = torch.stack([V_cur[..., d + 1, d], V_tgt[..., d + 1, d + 1], V_cur[..., d + 1, d + 1]], -1)
    if ev.tasks is None: return dict(value_weights=weights, cosine=cos)
    with torch.no_grad():
        s = ev.x.log_w.shape[-1]
        atts = token_layers(params, L, ev.x)[1]          # the queries are the states 0..s-1, in order
        diag = torch.stack([att[..., -s:].diagonal(dim1=-2, dim2=-1).mean((-2, -1)) for att in atts], -1)
    return dict(neu_population=population_neu_many(config, params, ev.tasks)[:, None], diagonality=diag, value_weights=weights, cosine=cos)


# %% [markdown]
# During training the family's forward pass is `fused_token_predict` of [the state tokens' page](state_tokens.html#the-fused-pass-for-training):
# `token_predict` computed in one autograd node with a hand-written backward pass, equal to it to rounding and
# faster at the training shapes (the [benchmark](cli.html#speed-the-benchmark) measures the training step).

# %% [markdown]
# With its parts defined, the family registers itself as `attention="softmax"`:

# %%
#| export
register_family("softmax", Family(init=softmax_init, prompt=softmax_prompt,
                                  predict=lambda config, params, x, n: fused_token_predict(params, config.n_layers, x),
                                  module=softmax_module, metrics=softmax_metrics))

# %%
ev = eval_set(PretrainConfig(eval_tasks=3), [0, 1])
test_eq((ev.v_pi.shape, ev.x.log_w.shape[-1]), ((2, 3, 10), 10))
test_eq(ev.tasks.v_pi[1], held_out_tasks(PretrainConfig(eval_tasks=3, seed=1))[0].v_pi)

# %%
#| export
from ictd.boyan import check_arguments
check_arguments(globals())   # every public function refuses, naming it, an argument its annotation rules out (chapter 0)

# %%
#| hide
import nbdev; nbdev.nbdev_export()
