"""Issue 32, "Done when": the five tasks a researcher who `pip install`ed ictd tries first, written only with
`from ictd import ...` and documented names; objects that do not change with what else was imported; and a CLI that
offers every registered model family."""
import subprocess, sys, textwrap
import pytest
import torch
from ictd import (MRP, PretrainConfig, SoftmaxICTD, build_prompt, diagonality, msve, pretrain_many, random_boyan_chain,
                  random_tasks, sample_trajectories, sample_trajectory, theta_star, weighted_softmax_td)

pytestmark = pytest.mark.unit


def test_theta_star_runs_weighted_softmax_td_on_a_random_chain():
    "Task 1: the model under theta* predicts what weighted softmax TD computes, at every query, in float64."
    chain = random_boyan_chain(n_states=7, d=3, gamma=0.8, seed=5)
    states, rewards = sample_trajectory(chain, n=25, seed=5)
    W, alpha, L = 2.0 * torch.eye(3, dtype=torch.float64), 0.7, 4
    model = SoftmaxICTD.from_theta_star(3, W, n_layers=L, alpha=alpha, gamma=chain.gamma)
    assert all(torch.equal(a, b) for a, b in zip((model.layer(0).A, model.layer(0).V_cur, model.layer(0).V_tgt), theta_star(3, W, alpha=alpha, gamma=chain.gamma)))
    Z = build_prompt(chain.phi[states], rewards, chain.phi)
    expected = weighted_softmax_td(chain.phi[states], rewards, W, alpha=alpha, gamma=chain.gamma, n_iters=L, phi_queries=chain.phi,
                                   queries_only=True)
    torch.testing.assert_close(model.predict(Z), expected, rtol=1e-12, atol=1e-12)


def test_pretrain_evaluate_and_probe_a_small_model(tmp_path):
    "Tasks 2 and 3: pretrain two seeds, evaluate on a fresh chain, and read the attention and value weights."
    config = PretrainConfig(n_tasks=64, batch_size=16, n_steps=20, eval_every=10, eval_tasks=16)
    runs = pretrain_many(config, seeds=[0, 1], progress=False, cache_dir=tmp_path)
    assert len(runs) == 2 and all(torch.isfinite(torch.as_tensor(r.history["msve"])).all() for r in runs)
    chain = random_boyan_chain(seed=9)
    states, rewards = sample_trajectory(chain, n=config.n, seed=9)
    values = runs[0].predict(build_prompt(chain.phi[states], rewards, chain.phi), config.n)
    assert values.shape == (chain.n_states,) and not values.requires_grad and torch.isfinite(values).all()
    assert msve(values, chain) >= 0
    model = runs[0].model
    assert model.value_weights().shape == (config.n_layers, 3)
    A = model.layer(0).A   # the score matrix of the first layer (chapter 3's names: A, V_cur, V_tgt)
    assert A.shape == (config.d + 2, config.d + 2) and not torch.equal(A, runs[1].model.layer(0).A)
    tasks = random_tasks(8, seed=3, d=config.d)
    contexts = sample_trajectories(tasks.P, tasks.d_pi, n=config.n, seed=3)
    for share in (diagonality(model, tasks), diagonality(model, tasks, contexts)):   # n = infinity, then n = 30
        assert share.shape == (config.n_layers,) and ((share > 0) & (share < 1)).all()
    assert msve(torch.zeros(8, tasks.P.shape[-1], dtype=torch.float64), tasks).shape == (8,)


def test_a_users_own_mrp():
    "Task 4: a chain of the user's own (a two-state cycle) runs through sampling, the algorithm and the metric."
    P = torch.tensor([[0., 1.], [1., 0.]], dtype=torch.float64)
    r, phi = torch.tensor([1., 0.], dtype=torch.float64), torch.eye(2, dtype=torch.float64)
    mrp = MRP(P, r, gamma=0.5, phi=phi)
    torch.testing.assert_close(mrp.v_pi, torch.tensor([4 / 3, 2 / 3], dtype=torch.float64))   # v = r + 0.5 P v
    states, rewards = sample_trajectory(mrp, n=40, seed=0)
    values = weighted_softmax_td(phi[states], rewards, 30 * torch.eye(2, dtype=torch.float64), alpha=1.0, gamma=0.5, n_iters=60,
                                 phi_queries=phi)[41:]
    assert msve(values, mrp) < 1e-10, 'a deterministic cycle: tabular TD recovers v_pi from its context'


def test_device_and_dtype_options():
    "Task 5: the model, the chain and the prompt take `device=` and `dtype=`, and the CPU is the default."
    model = SoftmaxICTD(4, n_layers=2, seed=0, dtype=torch.float32, device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    chain = random_boyan_chain(seed=1).to(dtype=torch.float32)
    states, rewards = sample_trajectory(chain, n=10, seed=1)
    Z = build_prompt(chain.phi[states], rewards, chain.phi, dtype=torch.float32, device="cpu")
    assert Z.dtype == torch.float32 and Z.device.type == "cpu" and model.predict(Z).dtype == torch.float32
    assert next(SoftmaxICTD(4, n_layers=2, seed=0).parameters()).device.type == "cpu"


# Runs in a fresh interpreter: each module's public classes are listed right after the module itself has run, then
# compared once every module has been imported. A class that another module patches gains a name in between.
NO_PATCHES = textwrap.dedent("""
    import importlib, importlib.abc, importlib.util, inspect, json, pkgutil, sys
    seen = {}
    class Snap(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if not name.startswith('ictd.'): return None
            sys.meta_path.remove(self)
            try: spec = importlib.util.find_spec(name)
            finally: sys.meta_path.insert(0, self)
            run = spec.loader.exec_module
            def exec_module(module):
                run(module)
                for k, v in vars(module).items():
                    if inspect.isclass(v) and v.__module__ == name: seen[f'{name}.{k}'] = (v, set(dir(v)))
            spec.loader.exec_module = exec_module
            return spec
    sys.meta_path.insert(0, Snap())
    import ictd
    names = [m.name for m in pkgutil.walk_packages(ictd.__path__, 'ictd.') if m.name != 'ictd._modidx']
    for m in names: importlib.import_module(m)
    classes = {f'{m}.{k}' for m in names for k, v in vars(sys.modules[m]).items() if inspect.isclass(v) and v.__module__ == m}
    print(json.dumps({k: sorted(set(dir(v)) - d) for k, (v, d) in seen.items() if set(dir(v)) - d}))
    print(json.dumps(sorted(classes - set(seen))))
""")


def test_no_class_gains_an_attribute_when_another_module_is_imported():
    out = subprocess.run([sys.executable, "-c", NO_PATCHES], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    gained, unseen = out.stdout.strip().splitlines()[-2:]
    assert unseen == '[]', f'classes the snapshot missed: {unseen}'
    assert gained == '{}', f'classes that change with what is imported: {gained}'


def test_the_cli_offers_every_registered_family(capsys):
    "`ictd pretrain --attention` lists every family registered once `ictd` is imported (softmax, linear, causal)."
    import ictd.cli, ictd.engine
    with pytest.raises(SystemExit): ictd.cli.main(["pretrain", "--help"])
    text = capsys.readouterr().out
    offered = text[text.index("--attention {") + len("--attention {"):].split("}")[0].split(",")
    assert {"softmax", "linear", "causal"} <= set(ictd.engine.FAMILIES)
    assert sorted(offered) == sorted(ictd.engine.FAMILIES), (offered, sorted(ictd.engine.FAMILIES))
