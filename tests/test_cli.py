"""The `ictd` command line: help for every sub-command from the installed console script, each
sub-command end to end at tiny sizes (files written, figures readable, numbers sane), and bad options
rejected with a message naming the option."""
import json, math, os, subprocess
from dataclasses import fields
import matplotlib.image
import numpy as np
import pytest
import torch
from conftest import BIN
from ictd.cli import main
from ictd.engine import PretrainConfig

ICTD = str(BIN / 'ictd')
OPTIONS = {None: ['chain', 'convergence', 'pretrain', 'linear', 'continuous', 'ablations', 'sweep', 'all'],
           'chain': ['--n-states', '--features', '--gamma', '--seed', '--out', '--no-progress'],
           'convergence': ['--n-tasks', '--ns', '--n-layers', '--beta', '--alpha', '--seed', '--chunk', '--diag-tasks',
                           '--n-betas', '--rate-tasks', '--rate-layers', '--phase-tasks', '--leaky-tasks', '--out'],
           'pretrain': ['--' + f.name.replace('_', '-') for f in fields(PretrainConfig)] + ['--seeds', '--device', '--threads', '--force',
                                                                                           '--checkpoint-every', '--cache-dir', '--out'],
           'linear': ['--n-tasks', '--n', '--depth', '--beta', '--alpha', '--seed', '--features', '--n-tune', '--reproduce-seeds', '--out'],
           'continuous': ['--seed', '--quick', '--out', '--no-progress'],
           'ablations': ['--seeds', '--steps', '--out', '--no-progress'],
           'sweep': ['--cache-dir', '--scheduler', '--cluster', '--checkpoint-every', '--threads', '--overhead', '--out', '--no-progress'],
           'all': ['--out', '--no-progress']}

def run_ictd(*args):
    env = dict(os.environ, OMP_NUM_THREADS='1')
    return subprocess.Popen([ICTD, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

def test_help_of_every_command(capsys):
    "`ictd --help` from the console script, and `ictd CMD --help` through `main` (one interpreter, not one per command),"
    " exit 0 and list the options."
    out, err = run_ictd('--help').communicate(timeout=120)
    helps = {None: out}
    for cmd in OPTIONS:
        if cmd is None: continue
        with pytest.raises(SystemExit) as exit_: main([cmd, '--help'])
        assert exit_.value.code == 0, cmd
        helps[cmd] = capsys.readouterr().out
    for cmd, text in helps.items():
        assert text.startswith('usage: ictd' + (f' {cmd}' if cmd else '')), text
        for opt in OPTIONS[cmd]: assert opt in text, f'{opt} missing from `ictd {cmd or ""} --help`'

def check_png(path):
    "A non-empty PNG that matplotlib reads, of a reasonable size, not blank."
    assert path.stat().st_size > 1000, path
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and min(img.shape[:2]) > 150 and img.std() > 0.01, (path, img.shape)

def written(capsys):
    "Paths printed as written by the last command."
    return [line.split('wrote ', 1)[1] for line in capsys.readouterr().out.splitlines() if line.startswith('wrote ')]

def test_chain(tmp_path, capsys):
    main(['chain', '--n-states', '6', '--features', 'onehot', '--seed', '2', '--out', str(tmp_path)])
    assert sorted(written(capsys)) == sorted(str(tmp_path / f) for f in ('chain.png', 'chain.json'))
    check_png(tmp_path / 'chain.png')
    info = json.loads((tmp_path / 'chain.json').read_text())
    P = np.array(info['P'])
    assert P.shape == (6, 6) and np.allclose(P.sum(1), 1) and info['seed'] == 2
    d = np.array(info['d_pi'])
    assert np.allclose(d @ P, d) and math.isclose(d.sum(), 1)

def test_convergence(tmp_path, capsys):
    main(['convergence', '--n-tasks', '6', '--ns', '20', '80', '--n-layers', '12', '--chunk', '4', '--diag-tasks', '5',
          '--n-betas', '4', '--rate-tasks', '20', '--rate-layers', '30', '--phase-tasks', '3', '--leaky-tasks', '4',
          '--no-progress', '--out', str(tmp_path)])
    figs = [tmp_path / f'convergence-{k}.png' for k in ('depth', 'floor', 'floor-bound', 'diagonality', 'rates', 'leaky')]
    figs += [tmp_path / f'convergence-phase-{f}-gamma{g}.png' for f in ('onehot', 'unit', 'random') for g in (0.5, 0.9, 0.99)]
    assert set(written(capsys)) == {str(p) for p in figs + [tmp_path / 'convergence.pt', tmp_path / 'convergence.json']}
    for f in figs: check_png(f)
    res = torch.load(tmp_path / 'convergence.pt', weights_only=True)
    assert res['depth']['errors'].shape == (6, 2, 13) and res['depth']['floors'].shape == (6, 2)   # 6 tasks in batches of 4 and 2
    s = json.loads((tmp_path / 'convergence.json').read_text())
    lo, hi = s['depth']['rho_range']
    assert 0.89 < lo <= hi < 1 and s['depth']['min_diagonal'] > 0.95      # one-hot features, beta = 15: the condition holds
    assert all(0 < f < 10 for f in s['depth']['mean_floor']) and math.isfinite(s['depth']['floor_slope'])
    for curve in s['diagonality']['mean_of_mean'].values(): assert len(curve) == 4 and all(0 <= v <= 1 for v in curve)
    assert s['rates']['n_tasks'] > 0 and s['rates']['all_under_bound'] and s['rates']['max_rho_minus_rate'] >= 0
    fr = np.array(s['phase']['fractions'])
    assert fr.shape[:2] == (3, 3) and np.allclose(fr[..., :3].sum(-1), 1)   # converge + stall + diverge: every task in one phase
    assert len(res['leaky']['rho']) == 4 and s['leaky']['n_tasks'] == 4

def test_continuous_quick(tmp_path, capsys):
    main(['continuous', '--quick', '--no-progress', '--out', str(tmp_path)])
    paths = [p for p in written(capsys)]
    assert paths and all(os.path.exists(p) and p.startswith(str(tmp_path)) for p in paths)
    for p in paths:
        if p.endswith('.png'): check_png(tmp_path / os.path.basename(p))
    assert 'pretraining' in json.loads((tmp_path / 'results.json').read_text())

def test_linear(tmp_path, capsys):
    main(['linear', '--n-tasks', '3', '--n', '20', '--depth', '6', '--alpha', '2.5', '--n-tune', '2', '--features', 'onehot',
          '--out', str(tmp_path)])
    assert sorted(written(capsys)) == sorted(str(tmp_path / f) for f in ('linear.png', 'linear-tuned.png', 'linear.pt', 'linear.json'))
    check_png(tmp_path / 'linear.png'); check_png(tmp_path / 'linear-tuned.png')
    res = torch.load(tmp_path / 'linear.pt', weights_only=True)
    assert len(res['untuned']) == 3 and all(c.shape == (3, 7) for c in res['untuned'].values())
    s = json.loads((tmp_path / 'linear.json').read_text())
    assert s['settings']['alpha'] == 2.5                                   # step sizes above 1 are allowed
    tuned = s['tuned']['onehot features']
    from ictd.experiments.linear import TUNING_GRIDS
    assert set(tuned) == set(TUNING_GRIDS)
    for method, r in tuned.items():                                        # each method's tuned values come from its own grid
        assert all(r['params'][k] in TUNING_GRIDS[method][k] for k in TUNING_GRIDS[method]), (method, r['params'])
        assert len(r['median_msve']) == 7 and math.isfinite(r['tune_msve'])

def test_pretrain_and_its_cache(tmp_path, capsys):
    "One folder per configuration with every seed's files and a summary; a second run loads the cached seeds and trains only new ones."
    args = ['pretrain', '--device', 'cpu', '--threads', '1', '--n-steps', '4', '--eval-every', '2', '--n-tasks', '16', '--eval-tasks', '8',
            '--batch-size', '8', '--n', '10', '--seeds', '0-1', '--no-progress', '--out', str(tmp_path)]
    main(args)
    folder = tmp_path / PretrainConfig(n_steps=4, eval_every=2, n_tasks=16, eval_tasks=8, batch_size=8, n=10).key()
    assert sorted(written(capsys)) == sorted(str(folder / f) for f in ('seed-0.png', 'seed-0.json', 'seed-1.png', 'seed-1.json', 'summary.json', 'summary.png',
                                                                      'emergence/bands.png', 'emergence/parameters.png', 'emergence/summary.json', 'emergence/summary.md'))
    for f in ('bands.png', 'parameters.png'): check_png(folder / 'emergence' / f)
    report = json.loads((folder / 'emergence' / 'summary.json').read_text())
    assert 'baselines' in report and 'claims' in report
    for seed in (0, 1):
        check_png(folder / f'seed-{seed}.png')
        s = json.loads((folder / f'seed-{seed}.json').read_text())
        assert s['config']['seed'] == seed and s['config']['n_steps'] == 4 and s['step'] == [0, 2, 4]
        assert all(0 < m < 100 for m in s['msve'])
        assert torch.load(folder / f'seed-{seed}.pt', weights_only=True)['config']['seed'] == seed
    check_png(folder / 'summary.png')
    summary = json.loads((folder / 'summary.json').read_text())
    runs = [json.loads((folder / f'seed-{s}.json').read_text())['final']['msve'][0] for s in (0, 1)]
    assert summary['seeds'] == [0, 1] and math.isclose(summary['final']['msve']['mean'][0], np.mean(runs))
    assert math.isclose(summary['final']['msve']['se'][0], np.std(runs, ddof=1) / math.sqrt(2))
    assert json.loads((folder / 'config.json').read_text())['n_steps'] == 4
    first = (folder / 'seed-1.json').read_text()
    main(args[:-5] + ['--seeds', '0,1,2', '--no-progress', '--out', str(tmp_path)])
    assert 'seeds 0-1: loading the cached runs' in capsys.readouterr().out
    assert (folder / 'seed-1.json').read_text() == first and (folder / 'seed-2.pt').exists()
    main(args[:-2] + ['--lr', '0.01', '--out', str(tmp_path)])
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2                  # another configuration, another folder

@pytest.mark.parametrize('argv, message', [
    (['linear', '--alpha', '0'], 'argument --alpha: must be a positive number'),
    (['linear', '--reproduce-seeds', '3-1'], 'argument --reproduce-seeds: must be seeds like'),
    (['convergence', '--alpha', '1.5'], 'argument --alpha: must be a step size in (0, 1]'),
    (['linear', '--n-tasks', '0'], 'argument --n-tasks: must be a positive integer'),
    (['convergence', '--ns', '100', '30'], 'argument --ns: must be increasing'),
    (['convergence', '--beta', 'big'], 'argument --beta: must be a positive number'),
    (['pretrain', '--gamma', '1'], 'argument --gamma: must be a discount factor in [0, 1)'),
    (['pretrain', '--features', 'hexagonal'], 'argument --features: invalid choice'),
    (['pretrain', '--seeds', '3-1'], 'argument --seeds/--seed: must be seeds like 0-29 or 0,3,5'),
    (['pretrain', '--seeds', '0-2', '1'], 'pretrain: argument --seeds: must be distinct'),
    (['pretrain', '--dtype', 'float16'], 'argument --dtype: invalid choice'),
    (['pretrain', '--threads', '0'], 'argument --threads: must be a positive integer'),
    (['chain', '--n-states', '1'], 'argument --n-states: must be an integer >= 2'),
    (['chain', '--colour', 'red'], 'unrecognized arguments: --colour'),
    ([], 'the following arguments are required: COMMAND')])
def test_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit) as e: main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err

def test_bad_option_from_the_console_script():
    proc = run_ictd('convergence', '--n-layers', '-5')
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and 'argument --n-layers: must be a positive integer' in err and not out

def test_all_runs_every_command(tmp_path, monkeypatch):
    "`ictd all` calls each command once, with its defaults, the shared --out and --no-progress."
    import ictd.cli
    calls = []
    monkeypatch.setattr(ictd.cli, 'COMMANDS', {k: (lambda a, k=k: calls.append((k, a))) for k in ictd.cli.COMMANDS})
    main(['all', '--out', str(tmp_path), '--no-progress'])
    assert sorted(k for k, _ in calls) == ['ablations', 'chain', 'continuous', 'convergence', 'linear', 'pretrain']
    assert all(a.out == tmp_path and a.no_progress for _, a in calls)
    conv = dict(calls)['convergence']
    assert conv.n_tasks == 1000 and conv.ns[-1] == 30_000                 # full scale by default
    assert dict(calls)['pretrain'].seeds == [[0, 1, 2]] and dict(calls)['pretrain'].n_steps == PretrainConfig().n_steps


@pytest.mark.unit
def test_mechanism_dispatches_each_study(monkeypatch, tmp_path):
    "`ictd mechanism STUDY` calls the study's driver with the seeds, the output folder and the command it records."
    import ictd.cli as cli
    calls = {}
    for name in ("run_mechanism_study", "run_gap_map", "run_control_study", "run_theta_star_dynamics", "run_depth_sweep"):
        monkeypatch.setattr(cli, name, lambda *a, _n=name, **k: calls.setdefault(_n, (a, k)) and tmp_path / f"{_n}.json")
    cli.main(["mechanism", "runs", "--seeds", "0-2", "--out", str(tmp_path)])
    a, k = calls["run_mechanism_study"]
    assert a[1] == [0, 1, 2] and tuple(a[2]) == (3, 4, 5) and k["command"] == f"ictd mechanism runs --seeds 0-2 --out {tmp_path}"
    cli.main(["mechanism", "gamma", "--seeds", "4", "--out", str(tmp_path)])
    a, k = calls["run_gap_map"]
    assert a[1] == [4] and k["name"] == "mechanism_gamma.json" and [c["gamma"] for c in k["cells"]] == [0.95, 0.7]
    for study, fn in (("controls", "run_control_study"), ("dynamics", "run_theta_star_dynamics"), ("depth", "run_depth_sweep")):
        cli.main(["mechanism", study, "--out", str(tmp_path)])
        assert calls[fn][0][1] == list(range(10)), study
    with pytest.raises(SystemExit) as e: cli.main(["mechanism", "nonsense"])
    assert e.value.code == 2

@pytest.mark.unit
def test_mechanism_converge_deep_jacobian_shared_pass_their_options(monkeypatch, tmp_path):
    "`ictd mechanism converge/deep/jacobian/shared` call their drivers with the sweep's options, and record them in the command."
    import ictd.cli as cli
    calls = {}
    for name in ("run_converge_study", "run_depth_sweep", "run_jacobian_study", "run_shared_study"):
        monkeypatch.setattr(cli, name, lambda *a, _n=name, **k: calls.setdefault(_n, (a, k)) and tmp_path / f"{_n}.json")
    cli.main(["mechanism", "converge", "--seeds", "0-3", "--lrs", "0.01", "0.03", "--steps", "500", "--eval-every", "50", "--window", "100",
              "--device", "cpu", "--cache-dir", str(tmp_path), "--out", str(tmp_path)])
    a, k = calls["run_converge_study"]
    assert a[1:6] == ([0, 1, 2, 3], (0.01, 0.03), 500, 50, 100) and k["device"] == "cpu" and k["cache_dir"] == tmp_path and not k["train_only"]
    assert k["command"] == f"ictd mechanism converge --seeds 0-3 --out {tmp_path} --lrs 0.01 0.03 --steps 500 --eval-every 50 --window 100"
    cli.main(["mechanism", "deep", "--depths", "12", "--train-only", "--cache-dir", str(tmp_path), "--out", str(tmp_path)])
    a, k = calls["run_depth_sweep"]
    assert a[2] == (12,) and k["name"] == "mechanism_depth_deep.json" and k["train_only"] and k["command"].endswith("--depths 12")
    for study, fn in (("jacobian", "run_jacobian_study"), ("shared", "run_shared_study")):
        cli.main(["mechanism", study, "--out", str(tmp_path)])
        assert fn in calls, study

@pytest.mark.unit
def test_linear_head_to_head_dispatches(monkeypatch, tmp_path):
    "`ictd linear --head-to-head 0-2` runs the pretrained head-to-head on those seeds and records the command; without it, it does not run."
    import ictd.cli as cli
    calls = []
    monkeypatch.setattr(cli, "run_head_to_head", lambda out, command, seeds: calls.append((out, command, seeds)) or out)
    for name in ("side_by_side", "tuned_side_by_side"): monkeypatch.setattr(cli, name, lambda *a, **k: {})
    for name in ("plot_side_by_side", "plot_tuned_side_by_side"): monkeypatch.setattr(cli, name, lambda *a, **k: None)
    monkeypatch.setattr(cli, "_save", lambda obj, path: path)
    cli.main(["linear", "--out", str(tmp_path), "--features", "random"])
    assert calls == []
    cli.main(["linear", "--head-to-head", "0-2", "--out", str(tmp_path), "--features", "random"])
    assert calls == [(tmp_path / "head_to_head.json", f"ictd linear --head-to-head 0-2 --out {tmp_path}", [0, 1, 2])]
