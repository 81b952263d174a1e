"""Issue 33: nothing lost, nothing silent. Faults injected into the run folders (a writer killed half-way through a
file, files cut short or with a bit flipped, a folder that cannot be written, a full disk), each ending with a folder
that works on the next call and a result equal to an uninterrupted run; and a property test over public entry points:
bad arguments give only a ValueError or TypeError that names the argument.

The tests run as root, which ignores permission bits, so an unwritable folder is made as a path under a file (the
operating system refuses it whoever asks), and a permission error or a full disk is injected by monkeypatching
`os.replace` or the file's `write` (PermissionError, OSError(ENOSPC)); no disk is mounted or filled."""
import dataclasses, errno, json, math, os, subprocess, sys, textwrap
from pathlib import Path
import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
import ictd.core as core
from ictd.boyan import MRP, check_gamma, random_boyan_chain
from ictd.cli import _save, main
from ictd.core import checksum_path, load_checked, record_claim, save_checked
from ictd.engine import PretrainConfig
from ictd.model import SoftmaxICTD, theta_star
from ictd.prompt import build_prompt, plot_prompt
from ictd.pretrain import pretrain_many
from ictd.wstd import batch_linear_td, batch_tabular_td, context_weights, tabular_rate, two_head_linear_td, weighted_softmax_td
from ictd.linear import LinearICTD, build_linear_prompt, sliding_windows, td_parameters
from ictd.model import check_prompt
from ictd.causal import CausalSoftmaxICTD, prefix_softmax_td, stream_values
from ictd.continuous import GaussianAR1Family, family_config
from ictd.boyan import sample_trajectory

pytestmark = pytest.mark.unit
TINY = PretrainConfig(n_tasks=32, eval_tasks=4, n_steps=12, eval_every=4, batch_size=16)
SEEDS = [0, 1]

@pytest.fixture(scope='module')
def straight():
    "The uninterrupted runs every faulted run must equal."
    return pretrain_many(TINY, SEEDS, progress=False)

def assert_equal_runs(got, want):
    "The same parameters and every recorded metric, bit for bit (NaN where the other has NaN)."
    for a, b in zip(got, want):
        assert a.config == b.config
        for p, q in zip(a.model.parameters(), b.model.parameters()): assert torch.equal(p, q)
        assert set(a.history) == set(b.history)
        for k in b.history: assert torch.equal(a.history[k].nan_to_num(), b.history[k].nan_to_num()), k

def folder_of(cache): return Path(cache) / TINY.key()

class Stop(Exception): pass

def stop_at(step):
    "A callback that interrupts training after optimiser step `step`."
    def cb(s):
        if s == step: raise Stop
    return cb

def checkpoint_file(cache)->Path:
    [f] = folder_of(cache).glob('checkpoint-*.pt')
    return f

# ---- a writer killed in the middle of a file -------------------------------------------------------------------------

KILLER = textwrap.dedent('''
    import os, signal, sys, tempfile
    prefix, nth, cache = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    real_mkstemp, real_fdopen, names, hits = tempfile.mkstemp, os.fdopen, [], []
    def mkstemp(*a, **k):
        fd, name = real_mkstemp(*a, **k); names.append(os.path.basename(name)); return fd, name
    class HalfThenKill:
        "A file whose first write puts half the bytes on disk and then kills the process (SIGKILL: no cleanup runs)."
        def __init__(self, f): self.f = f
        def __enter__(self): return self
        def __exit__(self, *a): self.f.close()
        def write(self, data):
            self.f.write(data[:len(data) // 2]); self.f.flush(); os.fsync(self.f.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
    def fdopen(fd, mode="r", *a, **k):
        f = real_fdopen(fd, mode, *a, **k)
        if "w" in mode and names and names[-1].startswith("." + prefix) and ".sha256." not in names[-1]:   # the file, not its checksum
            hits.append(1)
            if len(hits) == nth: return HalfThenKill(f)
        return f
    tempfile.mkstemp, os.fdopen = mkstemp, fdopen
    from ictd.engine import PretrainConfig
    from ictd.pretrain import pretrain_many
    pretrain_many(PretrainConfig(n_tasks=32, eval_tasks=4, n_steps=12, eval_every=4, batch_size=16), [0, 1], progress=False,
                  cache_dir=cache, checkpoint_every=4)
    ''')

@pytest.mark.parametrize('prefix, nth', [('checkpoint-', 2), ('seed-1.pt', 1)], ids=['second-checkpoint', 'second-seed-file'])
def test_a_writer_killed_mid_file_loses_nothing(tmp_path, straight, prefix, nth):
    "SIGKILL after half of a checkpoint or seed file is on disk: the previous files stand, and the next call ends where an uninterrupted run ends."
    proc = subprocess.run([sys.executable, '-c', KILLER, prefix, str(nth), str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert proc.returncode == -9, proc.stderr
    folder = folder_of(tmp_path)
    assert list(folder.glob(f'.{prefix}*.tmp')), 'the half-written temporary file is left by the kill'
    for f in folder.glob('*.pt'): assert load_checked(f) is not None, f   # every file under a final name is whole
    assert_equal_runs(pretrain_many(TINY, SEEDS, progress=False, cache_dir=tmp_path, checkpoint_every=4), straight)
    assert sorted(p.name for p in folder.glob('seed-*.pt')) == ['seed-0.pt', 'seed-1.pt']
    for f in folder.glob('*.pt'): assert load_checked(f) is not None, f'{f} is damaged after the next call'
    if prefix == 'checkpoint-': assert not list(folder.glob('checkpoint-*')), 'the finished run removes its checkpoint'

class HalfThenFail:
    "A file whose write puts half the bytes on disk, then fails as a full disk does."
    def __init__(self, f): self.f = f
    def __enter__(self): return self
    def __exit__(self, *a): self.f.close()
    def write(self, data):
        self.f.write(data[:len(data) // 2]); raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

def test_a_full_disk_mid_checkpoint_names_the_path_and_keeps_the_old_one(tmp_path, straight, monkeypatch):
    "ENOSPC half-way through the second checkpoint: an OSError naming the file and 'No space left on device', the first checkpoint intact, no temporary file."
    real_fdopen, real_mkstemp, names = os.fdopen, core.tempfile.mkstemp, []
    with pytest.raises(Stop): pretrain_many(TINY, SEEDS, progress=False, cache_dir=tmp_path, checkpoint_every=4, callback=stop_at(6))
    before = checkpoint_file(tmp_path).read_bytes()
    def mkstemp(*a, **k):
        fd, name = real_mkstemp(*a, **k); names.append(Path(name).name); return fd, name
    def fdopen(fd, mode='r', *a, **k):
        f = real_fdopen(fd, mode, *a, **k)
        return HalfThenFail(f) if 'w' in mode and names[-1].startswith('.checkpoint-') and '.sha256.' not in names[-1] else f
    monkeypatch.setattr(core.tempfile, 'mkstemp', mkstemp); monkeypatch.setattr(core.os, 'fdopen', fdopen)
    with pytest.raises(OSError, match=r'cannot write .*checkpoint-\w+\.pt: No space left on device'):
        pretrain_many(TINY, SEEDS, progress=False, cache_dir=tmp_path, checkpoint_every=4)
    monkeypatch.undo()
    assert checkpoint_file(tmp_path).read_bytes() == before and not list(folder_of(tmp_path).glob('.*'))
    assert_equal_runs(pretrain_many(TINY, SEEDS, progress=False, cache_dir=tmp_path, checkpoint_every=4), straight)

# ---- damaged files ----------------------------------------------------------------------------------------------------

def cut_short(f:Path): f.write_bytes(f.read_bytes()[:len(f.read_bytes()) // 3])
def flip_a_bit(f:Path):
    data = bytearray(f.read_bytes()); data[len(data) // 2] ^= 0x10; f.write_bytes(bytes(data))
def empty(f:Path): f.write_bytes(b'')
def drop_checksum(f:Path): checksum_path(f).unlink()
def garble_checksum(f:Path): checksum_path(f).write_text('not a checksum')
DAMAGES = dict(cut_short=(cut_short, 'do not match its checksum'), flip_a_bit=(flip_a_bit, 'do not match its checksum'),
               empty=(empty, 'do not match its checksum'), drop_checksum=(drop_checksum, 'no readable checksum'),
               garble_checksum=(garble_checksum, 'do not match its checksum'))

@pytest.mark.parametrize('damage', list(DAMAGES))
def test_a_damaged_checkpoint_is_recomputed(tmp_path, straight, capsys, damage):
    "A checkpoint cut short, with a bit flipped, empty or without its checksum is never resumed from: 'recomputing <path>: <reason>', then a run equal to an uninterrupted one."
    with pytest.raises(Stop): pretrain_many(TINY, SEEDS, progress=False, cache_dir=tmp_path, checkpoint_every=4, callback=stop_at(6))
    f = checkpoint_file(tmp_path)
    hurt, reason = DAMAGES[damage]
    hurt(f); capsys.readouterr()
    steps = []
    assert_equal_runs(pretrain_many(TINY, SEEDS, progress=False, cache_dir=tmp_path, checkpoint_every=4, callback=steps.append), straight)
    assert f'recomputing {f}: ' in capsys.readouterr().out and steps[0] == 1          # trained from the start
    assert not f.exists() and not checksum_path(f).exists()

@pytest.mark.parametrize('damage', list(DAMAGES))
def test_a_damaged_seed_file_is_recomputed(tmp_path, straight, capsys, damage):
    "A cached seed-S.pt cut short, with a bit flipped, empty or unchecked is retrained (that seed only), never served back."
    pretrain_many(TINY, SEEDS, progress=False, cache_dir=tmp_path)
    f = folder_of(tmp_path) / 'seed-1.pt'
    hurt, reason = DAMAGES[damage]
    hurt(f); capsys.readouterr()
    steps = []
    again = pretrain_many(TINY, SEEDS, progress=False, cache_dir=tmp_path, callback=steps.append)
    out = capsys.readouterr().out
    assert f'recomputing {f}: ' in out and reason in out and len(steps) == TINY.n_steps     # one training pass, for seed 1
    assert_equal_runs(again, straight)
    assert load_checked(f) is not None

@pytest.mark.parametrize('text', ['', '{"n_steps": 1', '[]', '\x00\xff'], ids=['empty', 'cut-short', 'not-an-object', 'binary'])
def test_a_damaged_config_json_is_rewritten(tmp_path, straight, capsys, text):
    "An empty or damaged config.json is rewritten (library and CLI), not reported as another configuration or an argument error."
    folder = folder_of(tmp_path); folder.mkdir(parents=True)
    (folder / 'config.json').write_bytes(text.encode('latin-1'))
    assert_equal_runs(pretrain_many(TINY, SEEDS, progress=False, cache_dir=tmp_path), straight)
    assert 'recomputing' in capsys.readouterr().out and json.loads((folder / 'config.json').read_text())['n_steps'] == TINY.n_steps

def test_the_cli_rewrites_an_empty_config_json(tmp_path, capsys):
    "`ictd pretrain` on a folder whose config.json is empty: it is rewritten and the command succeeds (no argument error)."
    cli = tmp_path / 'cli' / dataclasses.replace(TINY, attention='linear').key()
    cli.mkdir(parents=True); (cli / 'config.json').write_text('')
    main(['pretrain', '--device', 'cpu', '--n-tasks', '32', '--eval-tasks', '4', '--n-steps', '12', '--eval-every', '4', '--batch-size', '16',
          '--attention', 'linear', '--seeds', '0', '--no-progress', '--out', str(tmp_path / 'cli')])
    assert json.loads((cli / 'config.json').read_text())['attention'] == 'linear' and 'recomputing' in capsys.readouterr().out

# ---- folders that cannot be written -----------------------------------------------------------------------------------

def test_an_unwritable_folder_stops_before_training(tmp_path, straight):
    "A cache folder under a file (unwritable even for root): an OSError naming the path, raised before the first step."
    (tmp_path / 'a-file').write_text('x')
    steps = []
    with pytest.raises(OSError, match=r'cannot write .*a-file'):
        pretrain_many(TINY, SEEDS, progress=False, cache_dir=tmp_path / 'a-file' / 'cache', callback=steps.append)
    assert steps == []
    assert_equal_runs(pretrain_many(TINY, SEEDS, progress=False, cache_dir=tmp_path / 'cache'), straight)

def test_a_permission_error_names_the_path_and_stops_before_training(tmp_path, straight, monkeypatch):
    "os.replace raising PermissionError (a read-only folder) after the folder exists: the error names the path and the cause before step 1; later calls work."
    pretrain_many(TINY, [0], progress=False, cache_dir=tmp_path)
    steps = []
    def refuse(src, dst): raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dst))
    monkeypatch.setattr(core.os, 'replace', refuse)
    with pytest.raises(PermissionError, match=r'cannot write .*: Permission denied'):
        pretrain_many(TINY, SEEDS, progress=False, cache_dir=tmp_path, callback=steps.append)
    monkeypatch.undo()
    assert steps == [] and not list(folder_of(tmp_path).glob('.*'))
    assert_equal_runs(pretrain_many(TINY, SEEDS, progress=False, cache_dir=tmp_path), straight)

def test_no_room_for_a_checkpoint_stops_before_training(tmp_path, monkeypatch):
    "A disk with less free space than one checkpoint: an OSError naming the folder and the sizes, before the first step."
    free = core.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(core.shutil, 'disk_usage', lambda p: free._replace(free=100))
    steps = []
    with pytest.raises(OSError, match=r'MiB free, a checkpoint needs about'):
        pretrain_many(TINY, SEEDS, progress=False, cache_dir=tmp_path, checkpoint_every=4, callback=steps.append)
    assert steps == []

def test_the_cli_reports_an_unwritable_out_folder_with_its_path(tmp_path, capsys):
    "`ictd pretrain --out <under a file>`: exit status 1 and a one-line message with the path and the cause, not a traceback."
    (tmp_path / 'a-file').write_text('x')
    with pytest.raises(SystemExit) as e:
        main(['pretrain', '--n-steps', '2', '--eval-every', '1', '--n-tasks', '8', '--eval-tasks', '2', '--seeds', '0', '--no-progress',
              '--out', str(tmp_path / 'a-file' / 'out')])
    assert e.value.code == 1 and 'cannot write' in capsys.readouterr().err

# ---- safe formats and names -------------------------------------------------------------------------------------------

def test_cli_torch_files_load_with_weights_only(tmp_path):
    "What the CLI saves as .pt (numpy arrays and strings among tensors, as in convergence.pt) loads with weights_only=True and carries a checksum."
    res = dict(depth=dict(errors=torch.ones(2, 3), floors=np.ones(2)), phase=dict(features=np.array(['onehot', 'unit']), gammas=(0.5, 0.9)),
               rates=dict(rhos=np.float64(0.5)))
    path = _save(res, tmp_path / 'convergence.pt')
    back = torch.load(path, weights_only=True)
    assert torch.equal(back['depth']['floors'], torch.ones(2, dtype=torch.float64)) and back['phase']['features'] == ['onehot', 'unit']
    assert load_checked(path)['rates']['rhos'] == 0.5

@pytest.mark.parametrize('key, chapter', [('../x', 'c'), ('x', '../c'), ('x', 'a/b'), ('x', '..'), ('x', 'a\\b')])
def test_claim_names_cannot_leave_their_folder(tmp_path, key, chapter):
    with pytest.raises(ValueError, match='must be a non-empty name'): record_claim(key, 'y', 'proved', chapter, folder=tmp_path / 'claims')
    assert not list(tmp_path.rglob('*.json'))

def test_cli_options_are_checked_before_any_training(tmp_path, monkeypatch, capsys):
    "`mechanism converge --window` not a multiple of --eval-every, --device gpu, repeated --seeds: exit 2 naming the option, and nothing trained."
    import ictd.experiments.mechanism as mech, ictd.cli as cli
    trained = []
    monkeypatch.setattr(cli, 'pretrain_many', lambda *a, **k: trained.append(1))
    monkeypatch.setattr(mech, 'pretrain_many', lambda *a, **k: trained.append(1))
    for argv, message in ((['mechanism', 'converge', '--window', '300'], 'argument --window: must be a multiple of --eval-every'),
                          (['mechanism', 'converge', '--steps', '100'], 'argument --eval-every: must be at most --steps'),
                          (['mechanism', 'converge', '--train-only'], 'argument --train-only: needs --cache-dir'),
                          (['pretrain', '--device', 'gpu'], 'argument --device'),
                          (['pretrain', '--seeds', '0-3', '2'], 'argument --seeds: must be distinct')):
        with pytest.raises(SystemExit) as e: main(argv + ['--out', str(tmp_path)])
        assert e.value.code == 2 and message in capsys.readouterr().err, argv
    assert trained == []

# ---- silent wrong answers ---------------------------------------------------------------------------------------------

LIN_MRP = random_boyan_chain(n_states=10, d=4, seed=11)
LIN_S, LIN_R = sample_trajectory(LIN_MRP, n=20, seed=11)
LIN_Z = build_linear_prompt(LIN_MRP.phi[LIN_S], LIN_R, LIN_MRP.phi, LIN_MRP.gamma)     # n = 20 transitions, 10 queries

def test_linear_predict_reads_n_from_the_prompt():
    "10 queries: LinearICTD.predict returns 10 values equal to batch TD (1e-12), with n read from the prompt; a prompt that does not carry n, or contradicts it, is refused naming `n`."
    model = LinearICTD.from_td(4, n_layers=3, alpha=0.5)
    v = model.predict(LIN_Z)
    td = batch_linear_td(LIN_MRP.phi[LIN_S], LIN_R, alpha=0.5, gamma=LIN_MRP.gamma, n_iters=3, phi_queries=LIN_MRP.phi)[..., 21:]
    assert v.shape == (10,) and (v - td).abs().max() < 1e-12
    assert torch.equal(model(LIN_Z)[..., -1, 20:], model(LIN_Z, n=20)[..., -1, 20:])
    with pytest.raises(ValueError, match='`n` must be given'): model.predict(LIN_Z.clone())      # a plain tensor: no guess from its shape
    with pytest.raises(ValueError, match='`n` = 29 contradicts'): model.predict(LIN_Z, n=29)

def test_linear_refuses_integer_prompts_instead_of_casting_its_parameters():
    "An integer prompt used to cast alpha = 0.5 to 0 (all-zero values): it is refused with a TypeError naming `Z`; the float prompt of the same numbers works."
    Z = torch.randint(-3, 4, (9, 12), generator=torch.Generator().manual_seed(0))
    model = LinearICTD.from_td(4, n_layers=2, alpha=0.5)
    with pytest.raises(TypeError, match='`Z` must be a real floating tensor'): model.predict(Z, n=10)
    with pytest.raises(TypeError, match='`Z` must be a real floating tensor'): model.layers[0](Z, n=10)
    assert model.predict(Z.double(), n=10).abs().max() > 0

def test_a_reversed_layout_model_is_refused_by_the_kv_cache():
    "stream_values on a model built for reversed prompts used to return wrong estimates: a ValueError naming `model`; the forward-built model streams as before."
    W, phi = torch.eye(4, dtype=torch.float64), LIN_MRP.phi[LIN_S][None]
    with pytest.raises(ValueError, match='`model` must read the forward layout'):
        stream_values(CausalSoftmaxICTD.from_theta_star(4, W, n_layers=2, alpha=1., gamma=0.9, order='reversed'), phi, LIN_R[None], LIN_MRP.phi[None])
    fwd = CausalSoftmaxICTD.from_theta_star(4, W, n_layers=2, alpha=1., gamma=0.9)
    assert fwd.order == 'forward' and stream_values(fwd, phi, LIN_R[None], LIN_MRP.phi[None]).shape == (1, 20, 10)

def test_family_config_refuses_a_gamma_that_is_not_the_family_s():
    "family_config(family, gamma=0.5) used to return the family's gamma silently: a ValueError naming `gamma` (and `d`); repeating the family's own value is accepted."
    fam = GaussianAR1Family()
    with pytest.raises(ValueError, match="`gamma` is the family's"): family_config(fam, gamma=0.5)
    with pytest.raises(ValueError, match="`d` is the family's"): family_config(fam, d=7)
    assert family_config(fam, gamma=fam.gamma).gamma == fam.gamma

def test_the_mechanism_writer_is_atomic(tmp_path, monkeypatch):
    "A failure while `_write` replaces a study file leaves the old file whole and no temporary file; the error names the path."
    from ictd.experiments.mechanism import _write
    _write(tmp_path, 'study.json', 'first', dict(answer=1))
    before = (tmp_path / 'study.json').read_bytes()
    def refuse(src, dst): raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(core.os, 'replace', refuse)
    with pytest.raises(OSError, match=r'cannot write .*study\.json: No space left on device'): _write(tmp_path, 'study.json', 'second', dict(answer=2))
    monkeypatch.undo()
    assert (tmp_path / 'study.json').read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ['study.json']

def test_provenance_records_the_source_hash():
    "provenance() records the hash of the installed package's source, the one the run cache keys on, beside its commit."
    from ictd.engine import source_hash
    prov = core.provenance('x')
    assert prov['source'] == source_hash() and len(prov['source']) == 12 and 'commit' in prov

# ---- long contexts: O(n)-memory paths and work estimates ---------------------------------------------------------------

BIG_N = 10**5
BIG_PHI = torch.zeros(BIG_N + 1, 2, dtype=torch.float64)      # n = 10^5: a dense n x n matrix is tens of GiB

def relative_gap(a, b): return ((a - b).abs().max() / b.abs().max()).item()

def test_weighted_softmax_td_has_a_streamed_path_equal_to_the_dense_one():
    "The O(n)-memory path (fused attention) gives the dense result to 1e-12 relative: batched contexts and W, queries, rho, centred, return_all."
    g = torch.Generator().manual_seed(33)
    phi, R, W, Q = (torch.randn(*s, dtype=torch.float64, generator=g) for s in ((4, 26, 3), (4, 25), (4, 3, 3), (4, 5, 3)))
    rho = torch.rand(31, dtype=torch.float64, generator=g) * 2
    for kw in (dict(phi_queries=Q, rho=rho), dict(centred=True, return_all=True), dict(phi_queries=Q, rho=lambda k, x: 1 + x[..., 0].tanh())):
        dense, streamed = (weighted_softmax_td(phi, R, W, alpha=0.4, gamma=0.9, n_iters=10, method=m, **kw) for m in ('dense', 'streamed'))
        assert relative_gap(streamed, dense) < 1e-12, kw

def test_the_streamed_path_groups_repeated_features(monkeypatch):
    "Features that repeat (Boyan chains) take the grouped path, never attention, and give the dense result to 1e-12 relative."
    import ictd.wstd
    def never(*args): raise AssertionError('the grouped path must not attend')
    monkeypatch.setattr(ictd.wstd, '_attend', never)
    chains = [random_boyan_chain(n_states=5, d=3, features='unit', seed=s) for s in (1, 2)]
    runs = [sample_trajectory(c, n=30, seed=7) for c in chains]
    phi, R = torch.stack([c.phi[S] for c, (S, _) in zip(chains, runs)]), torch.stack([R for _, R in runs])
    Q, W = torch.stack([c.phi for c in chains]), torch.randn(2, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for kw in (dict(phi_queries=Q), dict(centred=True, return_all=True)):
        dense, streamed = (weighted_softmax_td(phi, R, W, alpha=0.4, gamma=0.9, n_iters=10, method=m, **kw) for m in ('dense', 'streamed'))
        assert relative_gap(streamed, dense) < 1e-12, kw

def test_the_streamed_path_keeps_gradients_with_repeated_features():
    "Gradients through the streamed path (query features that require grad, repeated features) equal the dense path's to 1e-12."
    chain = random_boyan_chain(n_states=5, d=3, features='unit', seed=4)
    S, R = sample_trajectory(chain, n=30, seed=4)
    grads = []
    for method in ('dense', 'streamed'):
        Q = chain.phi.clone().requires_grad_(True)
        weighted_softmax_td(chain.phi[S], R, 2 * torch.eye(3, dtype=torch.float64), alpha=0.5, gamma=0.9, n_iters=5, phi_queries=Q, method=method)[-5:].sum().backward()
        grads.append(Q.grad)
    assert grads[0].abs().max() > 1e-3 and relative_gap(grads[1], grads[0]) < 1e-12

def test_weighted_softmax_td_chooses_the_streamed_path_above_dense_bytes(monkeypatch):
    "method='auto' (the default) is the dense path up to `DENSE_BYTES` and the streamed path above it."
    phi, R, W = CTX, CTX[:-1, 0], W2
    dense, streamed = (weighted_softmax_td(phi, R, W, alpha=0.5, gamma=0.9, n_iters=4, phi_queries=PHI, method=m) for m in ('dense', 'streamed'))
    assert not torch.equal(dense, streamed)                      # the two paths round differently, so the choice shows
    monkeypatch.setattr(core, 'DENSE_BYTES', 3 * 5 * 9 * 8 - 1)   # just under the dense path's three 5 x 9 arrays
    assert torch.equal(weighted_softmax_td(phi, R, W, alpha=0.5, gamma=0.9, n_iters=4, phi_queries=PHI), streamed)
    monkeypatch.setattr(core, 'DENSE_BYTES', 3 * 5 * 9 * 8)
    assert torch.equal(weighted_softmax_td(phi, R, W, alpha=0.5, gamma=0.9, n_iters=4, phi_queries=PHI), dense)

def test_dense_work_at_n_1e5_is_refused_with_its_estimate_and_the_way_out():
    "At n = 1e5 the calls that must build an n x n matrix refuse before allocating it: the estimate in GiB and what to do instead."
    I2 = torch.eye(2, dtype=torch.float64)
    with pytest.raises(ValueError, match=r'would need about 224 GiB, above the limit of 4 GiB .*method=.streamed'):
        weighted_softmax_td(BIG_PHI, BIG_PHI[1:, 0], I2, alpha=0.5, gamma=0.9, n_iters=1, method='dense')
    with pytest.raises(ValueError, match='instead of a `score` function'):
        weighted_softmax_td(BIG_PHI, BIG_PHI[1:, 0], None, alpha=0.5, gamma=0.9, n_iters=1, score=lambda k, x: k @ x.mT)
    with pytest.raises(ValueError, match=r'would need about 149 GiB.*method=.streamed'): context_weights(BIG_PHI, I2)
    with pytest.raises(ValueError, match='`batch_linear_td` computes the same values'): two_head_linear_td(BIG_PHI, BIG_PHI[1:, 0], alpha=0.5, gamma=0.9, n_iters=1)
    Z = torch.zeros(5, BIG_N + 1, dtype=torch.float64)
    with pytest.raises(ValueError, match=r'attention scores of the dense layer would need about 149 GiB'):
        LinearICTD.from_td(2, n_layers=1, alpha=0.5).predict(Z, BIG_N, method='dense')

def test_linear_ictd_has_a_streamed_path_equal_to_the_dense_one(monkeypatch):
    "LinearICTD's O(n) path (second moments; chunks of keys with softmax) equals the dense layers to 1e-12 relative, and 'auto' takes it above `DENSE_BYTES`."
    for softmax in (False, True):
        model = LinearICTD(4, n_layers=3, shared=False, init_gain=0.5, seed=1, softmax=softmax)
        dense = model(LIN_Z, method='dense')
        assert relative_gap(model(LIN_Z, method='streamed'), dense) < 1e-12
        monkeypatch.setattr(core, 'CHUNK_BYTES', 3 * 30 * 8)        # chunks of 3 keys (30 columns)
        assert relative_gap(model(LIN_Z, method='streamed'), dense) < 1e-12
        monkeypatch.setattr(core, 'DENSE_BYTES', 2 * 20 * 30 * 8 - 1)   # just under the dense layer's two 20 x 30 arrays
        assert torch.equal(model(LIN_Z), model(LIN_Z, method='streamed'))
        monkeypatch.undo()
        assert torch.equal(model(LIN_Z), dense)

def test_linear_ictd_runs_n_1e5_in_linear_memory():
    "A forward pass at n = 1e5 (the default path) returns batch TD's values; the dense path would need 149 GiB for its scores."
    g = torch.Generator().manual_seed(5)
    phi, R = torch.randn(BIG_N + 1, 2, dtype=torch.float64, generator=g) / 4, torch.randn(BIG_N, dtype=torch.float64, generator=g)
    Z = build_linear_prompt(phi, R, phi[:3], 0.9)
    v = LinearICTD.from_td(2, n_layers=3, alpha=0.5).predict(Z)
    assert relative_gap(v, batch_linear_td(phi, R, alpha=0.5, gamma=0.9, n_iters=3, phi_queries=phi[:3])[-3:]) < 1e-10

def test_check_prompt_refuses_integer_prompts_and_non_integer_n():
    "An integer prompt used to be cast silently, and n = True read as 1: TypeError naming `Z`, ValueError naming `n`."
    model = SoftmaxICTD.from_theta_star(2, W2, n_layers=2, alpha=0.5, gamma=0.9)
    with pytest.raises(TypeError, match='`Z` must be a real floating tensor'): model(torch.ones(4, 8, dtype=torch.long), n=5)
    with pytest.raises(TypeError, match='`Z` must be a real floating tensor'): check_prompt(torch.ones(4, 8, dtype=torch.bool), 2, 5)
    for n in (True, math.nan, '5', [5]):
        with pytest.raises(ValueError, match='`n` must be an integer in 1..7'): check_prompt(torch.ones(4, 8), 2, n)

# ---- the property test ------------------------------------------------------------------------------------------------

P3 = torch.tensor([[0.5, 0.5, 0.], [0., 0.5, 0.5], [0.5, 0., 0.5]], dtype=torch.float64)
PHI, R = torch.eye(3, 2, dtype=torch.float64) + 0.1, torch.tensor([1., 0., -1.], dtype=torch.float64)
CTX = torch.randn(6, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
W2 = torch.eye(2, dtype=torch.float64)
NOT_A_NUMBER = [None, '0.5', [0.5, 0.5], {}, object(), complex(0.5, 1.), math.nan, math.inf, -math.inf, torch.tensor([0.5, 0.5])]
NOT_A_COUNT = NOT_A_NUMBER + [-1, 2.5, True]
NOT_A_GAMMA = NOT_A_NUMBER + [1., -0.1, 2.]
def not_a_matrix(shape, *wrong):
    "Values that are not a finite real tensor of `shape`: the `wrong` shapes, NaN and inf entries, complex entries, a string, a dict, None."
    good = torch.ones(shape, dtype=torch.float64) / shape[-1]
    return [None, 'abc', {}, good.clone().fill_(math.nan), good.clone().fill_(math.inf), good.to(torch.complex128) * 1j,
            good.numpy() * 1j] + [torch.ones(w, dtype=torch.float64) for w in wrong]

# entry point -> (the valid arguments, argument -> values it must refuse)
COVERED = {
    'MRP': (MRP, dict(P=P3, r=R, gamma=0.9, phi=PHI),
            dict(P=not_a_matrix((3, 3), (3, 4), (3,), ()) + [P3 * 2, -P3], r=not_a_matrix((3,), (4,), (3, 1)), gamma=NOT_A_GAMMA,
                 phi=not_a_matrix((3, 2), (4, 2), (3,), (3, 2, 1)))),
    'check_gamma': (check_gamma, dict(gamma=0.9), dict(gamma=NOT_A_GAMMA)),
    'random_boyan_chain': (random_boyan_chain, dict(n_states=4, d=2, gamma=0.9, features='random', rewards='random', seed=0),
                           dict(n_states=NOT_A_COUNT + [1], d=NOT_A_COUNT + [0], gamma=NOT_A_GAMMA, features=['cubic', None, 3],
                                rewards=['cubic', None], seed=[-1, 'x', 2.5, [1.5]])),
    'PretrainConfig': (PretrainConfig, {},
                       dict(n_states=NOT_A_COUNT + [1], d=NOT_A_COUNT + [0], n=NOT_A_COUNT + [0], n_layers=NOT_A_COUNT + [0],
                            gamma=NOT_A_GAMMA, lr=NOT_A_NUMBER + [0., -1.], weight_decay=NOT_A_NUMBER + [-1.], init_gain=NOT_A_NUMBER + [0.],
                            n_tasks=NOT_A_COUNT + [0], batch_size=NOT_A_COUNT + [0], n_steps=NOT_A_COUNT, eval_every=NOT_A_COUNT + [0],
                            eval_tasks=NOT_A_COUNT + [0], seed=NOT_A_COUNT, features=['cubic', None, 3], dtype=['float16', None],
                            objective=['q', None], init=['zeros', None], init_scale=NOT_A_NUMBER + [-1.], init_beta=NOT_A_NUMBER,
                            init_alpha=NOT_A_NUMBER, shared=[1, 'yes', None], record_params=[0, 'no'], attention=['', None, 3], protocol=['', None, 3])),
    'build_prompt': (build_prompt, dict(phi_states=CTX, rewards=CTX[:-1, 0], phi_queries=PHI),
                     dict(phi_states=not_a_matrix((6, 2), (1, 2), (6,)), rewards=not_a_matrix((5,), (4,), ()),
                          phi_queries=not_a_matrix((3, 2), (3, 3))[1:])),
    'weighted_softmax_td': (weighted_softmax_td, dict(phi_states=CTX, rewards=CTX[:-1, 0], W=W2, alpha=0.5, gamma=0.9, n_iters=3, phi_queries=PHI),
                            dict(phi_states=not_a_matrix((6, 2), (1, 2), (6,)), rewards=not_a_matrix((5,), (4,), ()), W=not_a_matrix((2, 2), (3, 3), (2,)),
                                 alpha=NOT_A_NUMBER, gamma=NOT_A_GAMMA, n_iters=NOT_A_COUNT, phi_queries=not_a_matrix((3, 2), (3, 3))[1:],
                                 rho=not_a_matrix((9,), (8,), (9, 2))[1:], method=['sparse', None, 3, 'Dense'])),
    'theta_star': (theta_star, dict(d=2, W=W2, alpha=0.5, gamma=0.9),
                   dict(d=NOT_A_COUNT + [0], W=not_a_matrix((2, 2), (3, 3), (2,)), alpha=NOT_A_NUMBER, gamma=NOT_A_GAMMA)),
    'SoftmaxICTD.from_theta_star': (SoftmaxICTD.from_theta_star, dict(d=2, n_layers=2, W=W2, alpha=0.5, gamma=0.9),
                                    dict(d=NOT_A_COUNT + [0], n_layers=NOT_A_COUNT + [0], W=not_a_matrix((2, 2), (3, 3), (2,)), alpha=NOT_A_NUMBER,
                                         gamma=NOT_A_GAMMA, shared=[1, 'yes', None])),
    'SoftmaxICTD': (SoftmaxICTD, dict(d=2, n_layers=2, init_gain=0.1, seed=0),
                    dict(d=NOT_A_COUNT + [0], n_layers=NOT_A_COUNT + [0], init_gain=NOT_A_NUMBER + [-1.], seed=['x', -1, 2.5],
                         shared=[1, 'yes', None], dtype=['float64', torch.int64])),
    'pretrain_many': (pretrain_many, dict(config=dataclasses.replace(TINY, n_steps=0), seeds=[0], progress=False),
                      dict(config=[None, {}, 'EMERGENCE', 3], seeds=[None, [], [1, 1], [-1], [0.5], 'a', math.nan, [math.nan], [None]],
                           cache_dir=[3, 2.5, object()], device=['gpu', 3.5, 'cuda:x'], checkpoint_every=NOT_A_COUNT[1:] + [0],
                           callback=[3, 'f'])),
}
LIN_BAD_Z = not_a_matrix((9, 30), (8, 30), (9,), (10, 30)) + [torch.ones(9, 30, dtype=torch.int64), torch.ones(9, 30, dtype=torch.bool),
                                                            np.ones((9, 30), dtype=np.int32)]
COVERED.update({
    'LinearICTD.predict': (LinearICTD.from_td(4, n_layers=3, alpha=0.5).predict, dict(Z=LIN_Z, n=20),
                           dict(Z=LIN_BAD_Z, n=NOT_A_COUNT[1:] + [0, 31, 25])),
    'LinearICTD.forward': (LinearICTD.from_td(4, n_layers=3, alpha=0.5), dict(Z=LIN_Z, n=20), dict(Z=LIN_BAD_Z, n=NOT_A_COUNT[1:] + [0, 31])),
    'prefix_softmax_td': (prefix_softmax_td, dict(phi_states=CTX, rewards=CTX[:-1, 0], W=W2, alpha=0.5, gamma=0.9, n_iters=3, phi_queries=PHI),
                          dict(recency=NOT_A_NUMBER)),
    'stream_values': (stream_values, dict(model=CausalSoftmaxICTD(2, n_layers=2, seed=0), phi_states=CTX, rewards=CTX[:-1, 0], phi_queries=PHI),
                      dict(model=[CausalSoftmaxICTD.from_theta_star(2, W2, n_layers=2, alpha=1., gamma=0.9, order='reversed'), SoftmaxICTD(2, n_layers=2, seed=0), None, 'model'])),
    'tabular_rate': (tabular_rate, dict(states=[0, 0, 0, 1, 0], n_states=2, beta=8., alpha=1., gamma=0.5),
                     dict(alpha=NOT_A_NUMBER + [0., -5., 5., 1.5, -1e-9], beta=NOT_A_NUMBER, gamma=NOT_A_GAMMA)),
    'family_config': (family_config, dict(family=GaussianAR1Family(), n_steps=4), dict(gamma=[0.5, 0.], d=[7, 1])),
})
NOT_A_STEP = [None, '0.5', {}, object(), complex(0.5, 1.), math.nan, math.inf, -math.inf]   # td_parameters takes tensors of step sizes
PROMPT = build_prompt(CTX, CTX[:-1, 0], PHI)                                                    # d = 2, n = 5, three queries: (4, 9)
COVERED.update({
    'context_weights': (context_weights, dict(phi_states=CTX, W=W2, phi_queries=PHI),
                        dict(phi_states=not_a_matrix((6, 2), (1, 2), (6,)), W=not_a_matrix((2, 2), (3, 3), (2,)),
                             phi_queries=not_a_matrix((3, 2), (3, 3))[1:], score=[3, 'x'])),
    'two_head_linear_td': (two_head_linear_td, dict(phi_states=CTX, rewards=CTX[:-1, 0], alpha=0.5, gamma=0.9, n_iters=3, phi_queries=PHI),
                           dict(phi_states=not_a_matrix((6, 2), (1, 2), (6,)), rewards=not_a_matrix((5,), (4,), ()), alpha=NOT_A_NUMBER,
                                gamma=NOT_A_GAMMA, n_iters=NOT_A_COUNT, phi_queries=not_a_matrix((3, 2), (3, 3))[1:])),
    'batch_linear_td': (batch_linear_td, dict(phi_states=CTX, rewards=CTX[:-1, 0], alpha=0.5, gamma=0.9, n_iters=3, phi_queries=PHI),
                        dict(alpha=NOT_A_NUMBER, gamma=NOT_A_GAMMA, n_iters=NOT_A_COUNT, C=not_a_matrix((2, 2), (3, 3), (2,))[1:])),
    'build_linear_prompt': (build_linear_prompt, dict(phi_states=CTX, rewards=CTX[:-1, 0], phi_queries=PHI, gamma=0.9),
                            dict(phi_states=not_a_matrix((6, 2), (1, 2), (6,)), rewards=not_a_matrix((5,), (4,), ()),
                                 phi_queries=not_a_matrix((3, 2), (3, 3), ()),
                                 gamma=NOT_A_GAMMA)),
    'td_parameters': (td_parameters, dict(d=2, alpha=0.5), dict(d=NOT_A_COUNT + [0], alpha=NOT_A_STEP, C=not_a_matrix((2, 2), (3, 3), (2,))[1:])),
    'LinearICTD': (LinearICTD, dict(d=2, n_layers=2, seed=0), dict(d=NOT_A_COUNT + [0], n_layers=NOT_A_COUNT + [0],
                                                                 init_gain=NOT_A_NUMBER + [-1.], seed=['x', -1, 2.5], dtype=['float64', torch.int64])),
    'LinearICTD.from_td': (LinearICTD.from_td, dict(d=2, n_layers=2, alpha=0.5),
                           dict(d=NOT_A_COUNT + [0], n_layers=NOT_A_COUNT + [0], alpha=NOT_A_NUMBER, C=not_a_matrix((2, 2), (3, 3), (2,))[1:])),
    'SoftmaxICTD.forward': (SoftmaxICTD(2, n_layers=2, seed=0), dict(Z=PROMPT, n=5),
                            dict(Z=not_a_matrix((4, 9), (5, 9), (4,)) + [torch.ones(4, 9, dtype=torch.int64), torch.ones(4, 9, dtype=torch.bool),
                                                                        np.ones((4, 9), dtype=np.int32)],
                                 n=NOT_A_COUNT[1:] + [0, 9, 3])),
    'sliding_windows': (sliding_windows, dict(phi=LIN_MRP.phi, r=LIN_MRP.r, states=LIN_S, n=5, gamma=0.9),
                        dict(n=NOT_A_COUNT + [0], gamma=NOT_A_GAMMA)),
})
COVERED['LinearICTD.predict'][2]['method'] = ['sparse', None, 3]
NOT_A_FLAG = ['False', 'no', 0, 1, None, 0.5]                                                   # truthy or falsy, but not a bool
for name, flags in {'weighted_softmax_td': ('return_all', 'centred'), 'batch_linear_td': ('return_all', 'centred'),
                    'two_head_linear_td': ('return_all',), 'LinearICTD': ('shared', 'softmax')}.items():
    COVERED[name][2].update({flag: NOT_A_FLAG for flag in flags})
COVERED.update({
    'batch_tabular_td': (batch_tabular_td, dict(states=[0, 1, 1, 0], rewards=[1., 0., 2.], n_states=2, alpha=0.5, gamma=0.9, n_iters=3),
                         dict(states=[[0.5, 1., 0., 1.], [0, 2, 1, 0], [0], None, 'abc'], rewards=not_a_matrix((3,), (2,), ()),
                              n_states=NOT_A_COUNT + [0], alpha=NOT_A_NUMBER, gamma=NOT_A_GAMMA, n_iters=NOT_A_COUNT, return_all=NOT_A_FLAG)),
    'tabular_rate.states': (tabular_rate, dict(states=[0, 0, 0, 1, 0], n_states=2, beta=8., alpha=1., gamma=0.5),
                            dict(states=[[[0, 0, 1], [0, 1, 0]], [0, 3], [0.5, 1.], None], n_states=NOT_A_COUNT + [0])),
    'plot_prompt': (lambda Z, n: plt.close(plot_prompt(Z, n=n).figure), dict(Z=PROMPT, n=5),
                    dict(Z=not_a_matrix((4, 9), (2, 4, 9), (4,))[:-1] + [torch.ones(4, 9, dtype=torch.complex64)], n=NOT_A_COUNT[1:] + [0, 9])),
})
CASES = [(name, arg, i) for name, (_, _, bad) in COVERED.items() for arg, values in bad.items() for i in range(len(values))]

def refuses(name, arg, i):
    "Call entry point `name` with argument `arg` replaced by its i-th bad value: the error a caller sees, or None if it was accepted."
    f, good, bad = COVERED[name]
    try: f(**dict(good, **{arg: bad[arg][i]}))
    except (ValueError, TypeError) as e: return e
    except Exception as e: return AssertionError(f'{name}({arg}={bad[arg][i]!r}) raised {type(e).__name__}: {e}')
    return AssertionError(f'{name}({arg}={bad[arg][i]!r}) was accepted')

def test_the_property_test_covers_these_entry_points():
    assert sorted(COVERED) == sorted(['MRP', 'check_gamma', 'random_boyan_chain', 'PretrainConfig', 'build_prompt', 'weighted_softmax_td',
                                      'theta_star', 'SoftmaxICTD.from_theta_star', 'SoftmaxICTD', 'pretrain_many', 'LinearICTD.predict',
                                      'LinearICTD.forward', 'prefix_softmax_td', 'stream_values', 'tabular_rate', 'family_config',
                                      'context_weights', 'two_head_linear_td', 'batch_linear_td', 'build_linear_prompt', 'td_parameters',
                                      'LinearICTD', 'LinearICTD.from_td', 'SoftmaxICTD.forward', 'sliding_windows',
                                      'batch_tabular_td', 'tabular_rate.states', 'plot_prompt'])
    assert len(CASES) > 300, len(CASES)

@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(st.sampled_from(CASES))
def test_bad_arguments_are_refused_naming_the_argument(case):
    "A random entry point, argument and bad value (wrong type, shape, dtype, NaN or inf, out of range): a ValueError or TypeError whose message names the argument."
    e = refuses(*case)
    assert isinstance(e, (ValueError, TypeError)), str(e)
    name = {'phi_queries': 'phi_queries'}.get(case[1], case[1])
    assert f'`{name}`' in str(e), (case, str(e))

def test_every_case_at_once():
    "The same, over every case (a list of what fails, for the report)."
    failures = [(c, str(e)[:200]) for c in CASES for e in [refuses(*c)] if not isinstance(e, (ValueError, TypeError)) or f'`{c[1]}`' not in str(e)]
    assert not failures, '\n'.join(map(str, failures))
