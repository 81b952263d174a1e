# %%
#| default_exp __init__

# %%
#| export
import importlib

# %%
#| hide
from fastcore.test import *
from nbdev.showdoc import *

# %% [markdown]
# # The public API
# > The names a reader reaches for, importable from the top of the package: `from ictd import random_boyan_chain, theta_star, weighted_softmax_td`.

# %% [markdown]
# Every chapter builds its functions in a module of its own (`ictd.boyan`, `ictd.wstd`, `ictd.model`, ...), and the
# chapters import them from there. A reader who wants the book's main objects should not need to know which chapter
# defined them: this page lists the dozen names of the book's main line and makes each one importable from `ictd`
# itself. A name is loaded from its module the first time it is asked for, so `import ictd` stays cheap and the
# modules keep importing each other in the order the chapters build them. A function named like its module
# (`pretrain` in `ictd.pretrain`) cannot be one of them: once the module is imported, `ictd.pretrain` is the module.

# %% [markdown]
# ## The names
#
# | name | what it is | chapter |
# |---|---|---|
# | `MRP`, `random_boyan_chain` | a Markov reward process with features; a random Boyan chain | [0](boyan.html) |
# | `sample_trajectory`, `msve` | one trajectory of an MRP; the stationary-weighted value error | [0](boyan.html) |
# | `random_tasks`, `sample_trajectories` | many random chains and one trajectory of each, batched | [0a](tasks.html) |
# | `weighted_softmax_td` | the algorithm: batch TD with softmax-kernel weights | [1](weighted_softmax_td.html) |
# | `build_prompt`, `Prompt` | the prompt of a context and its queries; the prompt with its $n$, kept through casts and stacking | [2](prompt.html) |
# | `SoftmaxICTD`, `theta_star` | the dual-head Transformer; the parameters under which it runs the algorithm | [3](dual_head.html) |
# | `PretrainConfig`, `EMERGENCE` | the settings of a pretraining run; chapter 6a's configuration | [6](pretrain.html), [B](engine.html) |
# | `pretrain_many` | multi-task TD pretraining of many seeds in one batched run | [6](pretrain.html) |
# | `LinearICTD` | the linear-attention Transformer of the predecessor | [7](linear.html) |
# | `kernel_q_iteration`, `ControlICTD` | in-context control: the algorithm and its Transformer | [9](control.html), [9a](control_transformer.html) |

# %%
#| export
PUBLIC = dict(MRP="boyan", random_boyan_chain="boyan", sample_trajectory="boyan", msve="boyan",
              random_tasks="tasks", sample_trajectories="tasks", weighted_softmax_td="wstd", build_prompt="prompt", Prompt="prompt",
              SoftmaxICTD="model", theta_star="model", PretrainConfig="engine", EMERGENCE="engine",
              pretrain_many="pretrain", diagonality="emergence", LinearICTD="linear",
              kernel_q_iteration="control", ControlICTD="control_model")   # name -> the module (under `ictd`) that defines it
__all__ = ["__version__", *PUBLIC]

def __getattr__(name:str):
    "A public name, loaded from its module on first use (PEP 562); an AttributeError for any other name."
    if name not in PUBLIC: raise AttributeError(f"module 'ictd' has no attribute {name!r} (the public names are {sorted(PUBLIC)})")
    value = getattr(importlib.import_module(f"ictd.{PUBLIC[name]}"), name)
    globals()[name] = value
    return value

def __dir__(): return sorted(set(globals()) | set(PUBLIC))


# %% [markdown]
# A check, as a reader would write it: θ* for a random chain, run as the Transformer, against the algorithm, with
# only top-level imports.

# %%
import ictd
from ictd import Prompt, random_boyan_chain, sample_trajectory, SoftmaxICTD, theta_star, weighted_softmax_td

# %%
import torch

# %%
chain = random_boyan_chain(seed=1)
S, R = sample_trajectory(chain, n=30, seed=2)
W = torch.eye(chain.phi.shape[1], dtype=torch.float64)
model = SoftmaxICTD.from_theta_star(chain.phi.shape[1], W, n_layers=4, alpha=0.5, gamma=chain.gamma)
v_model = model.predict(Prompt.build(chain.phi[S], R, chain.phi), grad=False)
v_algo = weighted_softmax_td(chain.phi[S], R, W, alpha=0.5, gamma=chain.gamma, n_iters=4, phi_queries=chain.phi)[31:]
print(f"largest difference between the Transformer and the algorithm: {(v_model.detach() - v_algo).abs().max().item():.1e}")
assert (v_model.detach() - v_algo).abs().max() < 1e-12

# %% [markdown]
# ## Conventions
#
# The library's conventions (the order of arguments, the keyword-only names, one name per concept, the layout of
# outputs, `predict` and autograd, which metrics are public, devices and dtypes, deprecations) are written down in
# `CONTRIBUTING.md` at the root of the repository;
# `tests/test_api_conventions.py` inspects the signatures of the public functions and holds them to it, with an
# allow-list, each entry with its reason, of the functions that do not follow it yet.

# %% [markdown]
# ## Implementation and tests
#
# Each public name is the object its module defines, every name of `__all__` resolves, and another name fails with
# the list of the public ones:

# %%
for name, module in PUBLIC.items(): assert getattr(ictd, name) is getattr(importlib.import_module(f"ictd.{module}"), name), name
test_eq(sorted(ictd.__all__), sorted(["__version__", *PUBLIC]))
test_fail(lambda: ictd.no_such_name, contains="the public names are")
assert set(PUBLIC) <= set(dir(ictd))

# %%
#| hide
import nbdev; nbdev.nbdev_export()
