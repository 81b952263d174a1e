"""`ictd sweep` on a real Dask cluster (appendix G): a scheduler and two single-threaded worker processes on loopback
run a tiny grid; every cell's per-seed metrics and trained parameters equal those of the same sweep run in this
process, bit for bit; and a worker killed by its process id while it trains a cell loses nothing (the cell is resumed
from its checkpoint on a live worker, and every cell is present). The contest's spec expands to the contest's cells."""
import functools, json, os, signal, sys, threading, time
from pathlib import Path
import pytest
import torch
from conftest import ROOT
from ictd.core import load_checked
from ictd.sweep import expand_spec, load_spec, run_sweep, sweep_table

import distributed
import cloudpickle
cloudpickle.register_pickle_by_value(sys.modules[__name__])   # the workers cannot import this file: send its functions by value

# 2 x 2 cells x 2 seeds, seeds and rates the book does not show; checkpoints every 5 steps, the kill at step 12.
SPEC = dict(name="test", seeds=[3, 8], base=dict(n=8, n_tasks=16, eval_tasks=4, batch_size=8, n_steps=20, eval_every=10),
            grid=[dict(n_layers=[1, 2], lr=[0.02, 0.005])])
CHECKPOINT_EVERY, KILL_AT = 5, 12


def pause_once(marker, step):
    "At step KILL_AT of the first cell to get there, write this process's id into `marker` and wait to be killed."
    if step != KILL_AT: return
    try: fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError: return                        # the rerun, or another cell: go on
    os.write(fd, str(os.getpid()).encode()); os.close(fd)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline: time.sleep(0.05)   # killed here; the deadline only stops a broken test from hanging


def kill_when_paused(marker, killed):
    "Wait until a worker has written `marker` (it is inside a cell, at step KILL_AT), then kill that process."
    deadline = time.monotonic() + 300
    while not (marker.exists() and marker.read_text()):
        if time.monotonic() > deadline: return
        time.sleep(0.05)
    pid = int(marker.read_text())
    os.kill(pid, signal.SIGKILL)
    killed.append(pid)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    "The sweep run here, and on a local cluster with one worker killed mid-cell."
    tmp = tmp_path_factory.mktemp("sweep")
    cells = expand_spec(SPEC)
    marker, killed, remote, errors = tmp / "paused", [], [], []
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None) as cluster, \
         distributed.Client(cluster) as client:
        killer = threading.Thread(target=kill_when_paused, args=(marker, killed), daemon=True)
        def sweep_on_cluster():
            try: remote.extend(run_sweep(cells, tmp / "cluster", client=client, checkpoint_every=CHECKPOINT_EVERY,
                                         callback=functools.partial(pause_once, str(marker)), progress=False))
            except BaseException as e: errors.append(e)
        on_cluster = threading.Thread(target=sweep_on_cluster)
        killer.start(); on_cluster.start()
        local = run_sweep(cells, tmp / "local", progress=False)      # meanwhile, the same sweep here
        on_cluster.join(timeout=300); killer.join(timeout=10)
    if errors: raise errors[0]
    return dict(cells=cells, local=local, remote=remote, killed=killed, tmp=tmp, test_pid=os.getpid())


@pytest.mark.claims
def test_cluster_equals_local_bitwise(runs):
    "Every cell's per-seed final metrics and trained parameters are the same bits on the cluster as here."
    cells, local, remote = runs["cells"], runs["local"], runs["remote"]
    assert [r["key"] for r in remote] == [c.config.key() for c in cells]
    assert [r["final"] for r in remote] == [r["final"] for r in local]
    for c, r in zip(cells, remote):
        for s in c.seeds:
            a, b = (load_checked(runs["tmp"] / where / r["key"] / f"seed-{s}.pt")["params"] for where in ("local", "cluster"))
            for k in a: assert torch.equal(a[k], b[k]), (r["key"], s, k)
    assert runs["test_pid"] not in {r["pid"] for r in remote}                # on the workers
    drop = lambda rows: [{k: v for k, v in row.items() if k not in ("status", "wall_s")} for row in rows]
    axes = ["n_layers", "lr"]
    assert drop(sweep_table(cells, remote, axes)) == drop(sweep_table(cells, local, axes))


@pytest.mark.claims
def test_killed_worker_loses_nothing(runs):
    "The worker killed inside a cell is dead; its cell was resumed from a checkpoint by a live worker; every cell is present."
    assert len(runs["killed"]) == 1, "no worker reached the pause"
    pid = runs["killed"][0]
    with pytest.raises(ProcessLookupError): os.kill(pid, 0)
    assert all(r is not None for r in runs["remote"]) and len(runs["remote"]) == len(runs["cells"]) == 4
    assert pid not in {r["pid"] for r in runs["remote"]}
    statuses = [r["status"] for r in runs["remote"]]
    assert statuses.count("resumed") == 1 and statuses.count("trained") == 3, statuses
    assert {r["status"] for r in runs["local"]} == {"trained"}


@pytest.mark.unit
def test_contest_spec_is_the_contest():
    "sweeps/contest.toml expands to the contest's cells: those of CONTEST_CELLS and contest_cells, with their seeds."
    from ictd.engine import EMERGENCE
    from ictd.experiments.mechanism import CONTEST_CELLS, CONTEST_DEPTHS, CONTEST_FACTORS, CONTEST_OBJECTIVES
    import dataclasses
    cells = {c.config: c.seeds for c in expand_spec(load_spec(ROOT / "sweeps" / "contest.toml"))}
    want = {dataclasses.replace(EMERGENCE, n_layers=L, objective=o, seed=0): tuple(range(40 if (o, L) == ("td", 3) else 10))
            for L in CONTEST_DEPTHS for o in CONTEST_OBJECTIVES}
    want |= {dataclasses.replace(EMERGENCE, **CONTEST_CELLS[k][0], seed=0): CONTEST_CELLS[k][1] for k in CONTEST_FACTORS}
    assert cells == want
    assert len(cells) == 20 and sum(map(len, cells.values())) == 230


@pytest.mark.unit
def test_cli_sweep_from_json(tmp_path, capsys):
    "`ictd sweep SPEC.json` runs here, writes its three files under sweep-NAME/, and a second run reads every cell from the cache."
    from ictd.cli import main
    spec = dict(SPEC, name="cli", seeds="5", grid=dict(n_layers=[1, 2]), base=SPEC["base"] | dict(n_steps=4, eval_every=2))
    (tmp_path / "cli.json").write_text(json.dumps(spec))
    argv = ["sweep", str(tmp_path / "cli.json"), "--out", str(tmp_path / "out"), "--no-progress"]
    main(argv)
    first = (tmp_path / "out" / "sweep-cli" / "sweep.json").read_text()
    main(argv)
    saved = json.loads((tmp_path / "out" / "sweep-cli" / "sweep.json").read_text())
    assert sorted(p.name for p in (tmp_path / "out" / "sweep-cli").iterdir()) == ["sweep.csv", "sweep.json", "sweep.png"]
    assert [c["status"] for c in saved["cells"]] == ["cached", "cached"]
    assert [c["final"] for c in saved["cells"]] == [c["final"] for c in json.loads(first)["cells"]]
    assert saved["provenance"]["command"].startswith("ictd sweep ") and saved["provenance"]["where"] == "this process"
