"""Issue 32, item 4: the written conventions of CONTRIBUTING.md hold for the public functions of `ictd` (its top level and
the modules of chapters 0-4a and appendices A-C): the step size, kernel scale, discount, depth and context length are
keyword-only. Functions that cannot follow the rule this round are listed below, each with its reason; an entry that
starts to follow the rule must leave the list (the test fails on stale entries), so the list only shrinks."""
import importlib, inspect, re
import pytest
import torch
import ictd

pytestmark = pytest.mark.unit

KEYWORD_ONLY = {"alpha", "beta", "gamma", "n_layers", "n_iters", "depth", "n"}   # CONTRIBUTING.md, "Arguments"
MODULES = ("boyan", "tasks", "wstd", "prompt", "model", "state_tokens", "causal", "core", "engine", "sliding")

# Why a function may still take one of those names positionally (one reason per group):
DATACLASS = ("a dataclass or config whose fields are its arguments in field order (MRP(P, r, gamma, phi), TaskBatch(..., gamma), PretrainConfig(...), Prompt(Z, n)); positional construction is used across the book and by saved runs' configs")
CHECKER = ('a checker or converter whose data *is* the named value (check_gamma(gamma), mc_horizon(gamma), check_prompt(Z, d, n), as_prompt(Z, n), carry_context/as_output(Z, n, ...))')
KERNEL = ("an unvalidated inner kernel of a layer or of the engine's family protocol, called as update(Z, *params, n) or predict(config, params, Z, n) by code that passes n positionally in a tight loop; its signature is the protocol's (`ictd.engine.Family`), changed only with the protocol")

ALLOWED = {   # "module.name": (the names it still takes positionally, the reason)
    'ictd.boyan.MRP': (['gamma'], DATACLASS),
    'ictd.tasks.TaskBatch': (['gamma'], DATACLASS),
    'ictd.engine.PretrainConfig': (['n', 'n_layers', 'gamma'], DATACLASS),
    'ictd.prompt.Prompt': (['n'], DATACLASS),
    'ictd.boyan.check_gamma': (['gamma'], CHECKER),
    'ictd.engine.mc_horizon': (['gamma'], CHECKER),
    'ictd.model.check_prompt': (['n'], CHECKER),
    'ictd.prompt.as_prompt': (['n'], CHECKER),
    'ictd.model.carry_context': (['n'], CHECKER),
    'ictd.model.as_output': (['n'], CHECKER),
    'ictd.causal.causal_attention': (['n'], KERNEL),
    'ictd.causal.causal_keys': (['n'], KERNEL),
    'ictd.causal.causal_layers': (['n'], KERNEL),
    'ictd.causal.causal_predict': (['n'], KERNEL),
    'ictd.causal.causal_update': (['n'], KERNEL),
    'ictd.causal.fused_causal_predict': (['n'], KERNEL),
    'ictd.causal.visible_transitions': (['n'], KERNEL),
    'ictd.model.context_attention': (['n'], KERNEL),
    'ictd.model.dual_head_update': (['n'], KERNEL),
    'ictd.model.shift_after_update': (['n'], KERNEL),
    'ictd.model.successor_shift': (['n'], KERNEL),
    'ictd.model.temporal_shift': (['n'], KERNEL),
    'ictd.state_tokens.fused_token_predict': (['n_layers'], KERNEL),
    'ictd.state_tokens.token_layers': (['n_layers'], KERNEL),
    'ictd.state_tokens.token_predict': (['n_layers'], KERNEL),
    'ictd.causal.causal_work': (['n', 'n_layers'], KERNEL),
    'ictd.causal.check_causal_work': (['n', 'n_layers'], KERNEL),
}


def public_callables()->dict:
    "Every public function and class of `ictd`'s top level and of MODULES, by 'module.name'."
    found = {f"ictd.{module}.{name}": getattr(ictd, name) for name, module in ictd.PUBLIC.items()}
    for m in MODULES:
        mod = importlib.import_module(f"ictd.{m}")
        for name in mod.__all__:
            obj = getattr(mod, name)
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == mod.__name__: found[f"{mod.__name__}.{name}"] = obj
    return found


def positional_convention_names(obj)->list:
    "The names of KEYWORD_ONLY that `obj` (a function, or a class's constructor) accepts positionally."
    try: sig = inspect.signature(obj.__init__ if inspect.isclass(obj) else obj)
    except (TypeError, ValueError): return []
    return [p.name for p in sig.parameters.values() if p.name in KEYWORD_ONLY and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def test_convention_names_are_keyword_only_or_allowed_with_a_reason():
    "Each public function takes alpha, beta, gamma, depth and n by keyword only, unless ALLOWED lists exactly those names."
    found = public_callables()
    assert len(found) > 100, len(found)                                   # the scan sees the modules
    offenders = {k: v for k, v in ((k, positional_convention_names(o)) for k, o in found.items()) if v}
    unlisted = {k: v for k, v in offenders.items() if k not in ALLOWED}
    assert not unlisted, f"take these by keyword only (CONTRIBUTING.md), or list them in ALLOWED with a reason: {unlisted}"
    changed = {k: (ALLOWED[k][0], offenders.get(k, [])) for k in ALLOWED if sorted(ALLOWED[k][0]) != sorted(offenders.get(k, []))}
    assert not changed, f"ALLOWED is stale (listed, now): {changed}"
    assert all(isinstance(reason, str) and len(reason) > 40 for _, reason in ALLOWED.values())


def test_predict_takes_grad_by_keyword_and_model_first_data_rules():
    "`predict` of every prompt model and of a PretrainResult takes `grad` by keyword only; the data come first (Z, then n)."
    from ictd.causal import CausalSoftmaxICTD
    from ictd.engine import PretrainResult
    from ictd.model import ShiftAfterAttentionICTD, SoftmaxICTD
    for cls in (SoftmaxICTD, ShiftAfterAttentionICTD, CausalSoftmaxICTD, PretrainResult):
        params = inspect.signature(cls.predict).parameters
        assert list(params)[:3] == ["self", "Z", "n"], cls
        assert params["grad"].kind is inspect.Parameter.KEYWORD_ONLY, cls
    assert inspect.signature(PretrainResult.predict).parameters["grad"].default is False   # a trained model: no graph unless asked


def test_moved_names_keep_their_old_positional_call_for_one_release():
    "The functions whose alpha, gamma, n_iters or n moved behind `*` this round still take the old positional call, with a"
    " DeprecationWarning that names the new form, and give the same values as the keyword call."
    from ictd.causal import theta_causal
    from ictd.model import theta_td_memory
    from ictd.wstd import batch_tabular_td, two_head_linear_td
    W = torch.eye(3, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    phi, R = torch.randn(9, 3, generator=g, dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64)
    S = torch.randint(0, 4, (9,), generator=g)
    cases = [(theta_causal, (3, W, 0.5, 0.9, "self"), (3, W), dict(alpha=0.5, gamma=0.9, current="self"), "alpha=..., gamma=..., current=..."),
             (theta_td_memory, (3, W, 0.5, 0.9), (3, W), dict(alpha=0.5, gamma=0.9), "alpha=..., gamma=..."),
             (two_head_linear_td, (phi, R, 0.1, 0.9, 20), (phi, R), dict(alpha=0.1, gamma=0.9, n_iters=20), "n_iters=..."),
             (batch_tabular_td, (S, R, 4, 0.5, 0.9, 30), (S, R, 4), dict(alpha=0.5, gamma=0.9, n_iters=30), "n_iters=...")]
    from ictd.boyan import random_boyan_chain, sample_trajectory
    from ictd.model import SoftmaxICTD, theta_star
    from ictd.sliding import sliding_td_loss
    from ictd.tasks import sample_trajectories
    from ictd.wstd import weighted_softmax_td
    mrp = random_boyan_chain(4, 3, seed=0)
    cases += [(theta_star, (3, W, 0.5, 0.9), (3, W), dict(alpha=0.5, gamma=0.9), "alpha=..., gamma=..."),
              (weighted_softmax_td, (phi, R, W, 0.5, 0.9, 4), (phi, R, W), dict(alpha=0.5, gamma=0.9, n_iters=4), "n_iters=..."),
              (random_boyan_chain, (4, 3, 0.8, "onehot", "random", 5), (4, 3), dict(gamma=0.8, features="onehot", seed=5), "gamma=..., features=..."),
              (sample_trajectory, (mrp, 7, 2), (mrp,), dict(n=7, seed=2), "n=..., seed=..."),
              (sample_trajectories, (mrp.P[None], 7, mrp.d_pi[None], 2), (mrp.P[None], mrp.d_pi[None]), dict(n=7, seed=2), "n=..."),
              (sliding_td_loss, (R[None], R[None, 1:], 0.9), (R[None], R[None, 1:]), dict(gamma=0.9), "gamma=..."),
              (SoftmaxICTD.from_theta_star, (3, 2, W, 0.5, 0.9), (3, W), dict(n_layers=2, alpha=0.5, gamma=0.9), "n_layers=..., alpha=..., gamma=...")]
    for fn, old, new, kw, named in cases:
        with pytest.warns(DeprecationWarning, match=f"{fn.__name__}: pass .*{re.escape(named)}.* by keyword"): before = fn(*old)
        after = fn(*new, **kw)
        if isinstance(before, torch.nn.Module): before, after = tuple(before.parameters()), tuple(after.parameters())
        if hasattr(before, "P"): before, after = (before.P, before.r, before.phi), (after.P, after.r, after.phi)
        for a, b in zip(before if isinstance(before, tuple) else (before,), after if isinstance(after, tuple) else (after,)): assert torch.equal(a, b)
    assert SoftmaxICTD(3, n_layers=2, seed=1).n_layers == 2
    with pytest.warns(DeprecationWarning, match="SoftmaxICTD|__init__: pass n_layers=..."): old_model = SoftmaxICTD(*(3, 2), seed=1)   # the old form, on purpose
    assert all(torch.equal(a, b) for a, b in zip(old_model.parameters(), SoftmaxICTD(3, n_layers=2, seed=1).parameters()))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                         # the keyword form warns nothing
        theta_causal(3, W, alpha=0.5, gamma=0.9)
