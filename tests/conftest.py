from pathlib import Path
import fcntl, os, subprocess, sys
import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

def chapters():
    "Every notebook of the book, in chapter order (scratch notebooks starting with `_` excluded)."
    return sorted(p for p in (ROOT / 'nbs').glob('*.ipynb') if not p.name.startswith('_'))

# Chapters that execute in under half a minute: tests/test_rebuild.py re-executes these in full (every unflagged cell,
# stopping at the first failing assert), which also runs their embedded tests, so tests/test_notebooks.py skips them.
FAST = ['index.ipynb', '00_boyan.ipynb', '00a_tasks.ipynb', '90_core.ipynb', '01_weighted_softmax_td.ipynb', '02_prompt.ipynb',
        '03_dual_head.ipynb', '03a_state_tokens.ipynb', '04_tsm.ipynb', '04a_causal.ipynb', '05_convergence.ipynb', '05b_worst_cases.ipynb',
        '09_control.ipynb', '09a_control_transformer.ipynb', '09c_control_convergence.ipynb', '96_sweep.ipynb', '98_claims.ipynb']

def run(*args, cwd=ROOT, **kw):
    "Run a command from the venv, failing the test with its output on a non-zero exit."
    cmd = [str(BIN / args[0]) if (BIN / args[0]).exists() else args[0], *map(str, args[1:])]
    env = {k: v for k, v in os.environ.items() if k != 'IN_TEST'}  # nbdev commands do nothing under IN_TEST
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env, **kw)
    assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stdout}\n{res.stderr}"
    return res

# Property tests are reproducible by default (a fixed search); ICTD_HYPOTHESIS=explore searches afresh each run.
from hypothesis import settings
settings.register_profile("reproducible", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("ICTD_HYPOTHESIS", "reproducible"))

# Test tiers (markers registered in pytest.ini): a test marked in its file keeps its marks; an unmarked test gets its
# file's tier below, or `unit`. `make test-fast` runs `-m unit`; `make test` runs everything.
FILE_TIERS = dict(test_notebooks="book", test_site="book", test_packaging="book", test_sync="book", test_cli="book",
                  test_emergence="claims", test_continuous_pretrain="claims", test_convergence_properties="claims")

def pytest_collection_modifyitems(config, items):
    tiers = {"unit", "claims", "book"}
    for item in items:
        if not tiers & {m.name for m in item.iter_markers()}:
            item.add_marker(getattr(pytest.mark, FILE_TIERS.get(item.module.__name__.rsplit(".", 1)[-1], "unit")))
    # The longest notebook executions start first, so that two xdist workers are not left waiting on one of them at the
    # end (on 2 cores the suite's wall time is bounded below by its longest test plus what is scheduled before it).
    # Only function-scoped tests move: a test that shares a module fixture keeps its place beside its module.
    items.sort(key=lambda item: next((i for i, name in enumerate(LONGEST) if name in item.nodeid), len(LONGEST)))

LONGEST = ("test_pretrained_decoder_on_seeds_the_book_does_not_show", "test_notebook[07a_linear_experiments.ipynb]", "test_notebook[06a_emergence.ipynb]",
           "test_training_leaves_both_theta_stars", "test_notebook[06b_mechanism.ipynb]", "test_rebuild_leaves_notebook_unchanged[04a_causal.ipynb]",
           "test_saved_ablations_are_what_the_code_computes", "test_notebook[08b_continuous_pretraining.ipynb]",
           "test_notebook[08a_continuous_experiments.ipynb]", "test_notebook[06_pretrain.ipynb]")


# Runs several tests train alike (chapter 6's EMERGENCE on the unseen seeds 100-109, say) are trained once per session and
# read back by the others from a run cache that every xdist worker shares; a lock per configuration makes a second
# worker wait for the first and load its runs. A cached run equals a fresh one (the engine saves the trained tensors).
@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory):
    "pretrain_many(config, seeds) through the session's shared run cache."
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-runs"
    folder.mkdir(exist_ok=True)
    def train(config, seeds, **kw):
        from ictd.pretrain import pretrain_many
        with open(folder / f"{config.key()}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try: return pretrain_many(config, list(seeds), progress=False, cache_dir=folder, **kw)
            finally: fcntl.flock(lock, fcntl.LOCK_UN)
    train.folder = folder
    return train


# ICTD_CPU_PROFILE=FILE appends one JSON line per test: its CPU seconds (this process and the children it waited for),
# which unlike `--durations` do not grow when the machine is shared. For finding where the suite's time goes.
if os.environ.get("ICTD_CPU_PROFILE"):
    import json, resource, time
    def _cpu():
        return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
                   for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        start, wall = _cpu(), time.time()
        yield
        with open(os.environ["ICTD_CPU_PROFILE"], "a") as f:
            f.write(json.dumps({"test": item.nodeid, "cpu": round(_cpu() - start, 2), "wall": round(time.time() - wall, 2)}) + "\n")
