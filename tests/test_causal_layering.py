"""Chapter 4a's decoder tuning reads the engine's held-out tasks and chapter 0's weighted error, not chapter 6a's helpers.

`best_decoder` used to import `ictd.emergence` (chapter 6a) inside the function; it now takes the tuning tasks from
`ictd.engine.held_out_tasks` and scores them with `ictd.boyan.weighted_error`. These tests pin that the new route
gives the same numbers as the old one, and that the upward import does not come back."""
import ast, dataclasses
from pathlib import Path
import pytest
import torch
import ictd.causal
from ictd.experiments.causal_pretraining import best_decoder, decoder_values
from ictd.core import run_stream
from ictd.engine import PretrainConfig

LOWER = {"ictd.boyan", "ictd.wstd", "ictd.prompt", "ictd.model", "ictd.state_tokens", "ictd.core", "ictd.tasks", "ictd.engine"}

def _imports(node)->set:
    "Every ictd module a piece of `ictd/causal.py` imports (relative imports read as `ictd.<name>`)."
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.ImportFrom): out.add(f"ictd.{n.module}" if n.level else n.module)
        elif isinstance(n, ast.Import): out.update(a.name for a in n.names)
    return {m for m in out if m and m.startswith("ictd")}

@pytest.mark.unit
def test_module_and_tuning_import_only_lower_chapters():
    "The module's imports and those of `best_decoder`/`decoder_values` are chapters 0-4 and the engine (catches `from ictd.emergence import ...` coming back)."
    tree = ast.parse(Path(ictd.causal.__file__).read_text())
    top = set().union(*(_imports(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))))
    assert top <= LOWER, top - LOWER
    import ictd.experiments.causal_pretraining as cp   # chapter 6c, where the tuning moved with the pretraining section
    tree = ast.parse(Path(cp.__file__).read_text())
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    for name in ("best_decoder", "decoder_values"): assert _imports(funcs[name]) <= LOWER | {"ictd.causal"}, (name, _imports(funcs[name]))

@pytest.mark.unit
@pytest.mark.parametrize("seed", [5, 6])
def test_best_decoder_equals_the_emergence_route(seed):
    "The tuning errors through `held_out_prompts`/`msve_of` (the old route) equal the new ones bit for bit, so the tuned point is the same (catches a changed task stream or error weighting)."
    from ictd.emergence import held_out_prompts
    from ictd.boyan import msve
    config = PretrainConfig(eval_tasks=24, n_layers=2, seed=seed)
    grid = dict(alphas=(0.5, 1.), betas=(1., 4.), lams=(0., 9.))
    tasks, states, _ = held_out_prompts(dataclasses.replace(config, seed=run_stream(seed, "tuning")))
    old = {(a, b, l): msve(decoder_values(config, tasks, states, a, b, l), tasks).mean().item()
           for a in grid["alphas"] for b in grid["betas"] for l in grid["lams"]}
    assert len(set(old.values())) == len(old)          # no ties: the argmin is one point
    assert best_decoder(config, **grid) == min(old, key=old.get)
