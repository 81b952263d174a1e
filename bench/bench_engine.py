"""Benchmark of the batched pretraining engine (`ictd.pretrain.pretrain_many`), with ratios measured in one run.

Measures, in seconds per seed-step (one optimiser step of one seed, batch 64, the specification's shapes d = 4, n = 30, L = 3):
  (a) InContextTD's training step, re-implemented (bench/incontexttd.py, whose docstring lists what was matched: the
      predecessor's numpy Boyan chains, its sliding prompt rebuilt from deques at every one of the 65 prompts of a
      mini-batch, its softmax Transformer in mode 'auto' on one prompt per forward pass, float32, one backward pass
      through the 65 graphs and one Adam step, and the hard-coded linear Transformer it trains alongside); the same
      loop without the hard-coded Transformer is row (a'), a stricter baseline;
  (b) the one-seed loop the book used before the engine (bench/reference.py),
  (c) the engine at 1, 10 and 30 seeds, float64 and float32;
the cost of one batched evaluation; the specification's protocol (30 seeds x 6000 steps, evaluations every
250 steps on 256 held-out tasks) extrapolated from them; the forward and backward pass at the training
shapes with fused (SDPA) attention, dense attention, state tokens (autograd) and the engine's fused state-token pass; what float32 changes in the
headline run; and the forward pass of `SoftmaxICTD.from_theta_star` (d = 10, L = 2, one query) at
n = 1e3, 1e4, 1e5: wall time and the peak memory of a fresh process, with the attention kernel torch picks.

The headline compares the engine's float32 path (30 seeds) with (a): the predecessor trains in float32, so float32 against
float32 is the like-for-like ratio; the float64 path (the book's default dtype) is reported beside it, in the headline and in the rows.
Times are CPU seconds of this process (`time.process_time`): on a busy machine they are closer to what the same
work takes on an idle core than wall times, which inflate with the load (both are recorded, with the load; a loaded
machine still inflates CPU times, through shared caches and cores, so compare rows of one run, not runs).
With --device cuda the engine's rows run on the GPU (compare their wall times: CPU time does not count the GPU's work); the
frozen old loops and the forward-pass memory runs stay on the CPU.
Writes bench/results.json with the host, CPU model, torch build and commit (`ictd.core.provenance`).
Usage: python bench/bench_engine.py [--quick] [--linear-only] [--device cpu|cuda] [--threads 1] [--out bench/results.json]
"""
import argparse, dataclasses, json, os, platform, subprocess, sys, tempfile, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ictd
import ictd.engine as engine
from ictd.core import provenance
import ictd.pretrain as pt
from ictd.engine import EMERGENCE, PretrainConfig
from ictd.state_tokens import fused_token_predict, state_tokens, token_predict
from ictd.pretrain import pretrain_many
from ictd.prompt import build_prompt
from ictd.tasks import task_features
from reference import one_seed_pretrain
from incontexttd import incontexttd_train
from reference_loops import pretrain_linear_many
from ictd.linear import ICLR_LINEAR
from ictd.sliding import fitted_td_step

SPEC = PretrainConfig()
DEVICE = "cpu"   # where the engine's runs go (--device)

def sync():
    "Wait for the GPU's queued work, so that a clock read after it counts it."
    if torch.device(DEVICE).type == "cuda": torch.cuda.synchronize()

def clock(fn):
    "(cpu seconds, wall seconds) of one call."
    c, w = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c, time.perf_counter() - w

def per_step(run, steps, seeds=1):
    "Seconds per seed-step of `run(steps, callback)`, timed between the callbacks after step 1 and after the last step."
    marks = {}
    def mark(step):
        if step in (1, steps):
            sync()
            marks[step] = (time.process_time(), time.perf_counter())
    run(steps, mark)
    (c0, w0), (c1, w1) = marks[1], marks[steps]
    return dict(cpu=(c1 - c0) / ((steps - 1) * seeds), wall=(w1 - w0) / ((steps - 1) * seeds))

def engine_run(seeds, dtype):
    cfg = dataclasses.replace(SPEC, dtype=dtype, eval_every=10**9)
    return lambda steps, callback: pretrain_many(dataclasses.replace(cfg, n_steps=steps), list(range(seeds)), progress=False, callback=callback, device=DEVICE)

def evaluation_seconds(seeds=30):
    "CPU and wall seconds of one evaluation of every metric for `seeds` seeds (the specification's 256 held-out tasks)."
    ev = engine.eval_set(SPEC, list(range(seeds)))
    params = engine.get_family("softmax").init(SPEC, list(range(seeds)), torch.float64)
    pt.evaluate_many(SPEC, params, ev)
    c, w = clock(lambda: [pt.evaluate_many(SPEC, params, ev) for _ in range(3)])
    return dict(cpu=c / 3, wall=w / 3)

def setup_seconds(seeds=30):
    "Task pools, held-out sets and initialisation of `seeds` seeds (a run of zero steps without its evaluation)."
    c, w = clock(lambda: (engine.stationary_pools(SPEC, list(range(seeds))), engine.eval_set(SPEC, list(range(seeds)))))
    return dict(cpu=c, wall=w)

def training_shapes(S=30, B=64):
    "Forward and backward at the training shapes (S seeds x B prompts, n = 30, two queries) by three routes, CPU ms."
    from ictd.model import dual_head_update
    cfg = SPEC
    pool = pt.stack_pools([engine.task_pool(cfg, 256, s) for s in range(S)])
    gens = [torch.Generator().manual_seed(s) for s in range(S)]
    b = engine.stationary_sampler(cfg, pool, gens, 0, {}).x
    pairs = b.queries
    (phi_s, r_s), phi_q = task_features(pool, b.task, b.states), task_features(pool, b.task, pairs)[0]
    Z = build_prompt(phi_s, r_s[..., :-1], phi_q)
    params = {k: v.requires_grad_() for k, v in engine.softmax_init(cfg, list(range(S)), torch.float64).items()}
    def full(update):
        def run():
            Zl = Z
            for l in range(3):
                A, Vc, Vt = (params[k][:, l, None] for k in ("A", "V_cur", "V_tgt"))
                Zl = update(Zl, A, Vc, Vt, 30)
            Zl[..., -1, -2].sum().backward()
        return run
    def dense(Z, A, Vc, Vt, n):
        X = Vc @ Z[..., :n] + Vt @ Z[..., 1:n + 1]
        return Z + X @ torch.softmax(Z[..., :n].mT @ (A @ Z), dim=-2)
    def tokens(predict):
        return lambda: predict(params, 3, state_tokens(pool, b.task, b.states, pairs))[..., 0].sum().backward()
    out = {}
    for name, fn in (("fused attention (SDPA)", full(dual_head_update)), ("dense attention", full(dense)), ("state tokens (autograd)", tokens(token_predict)),
                     ("state tokens, the engine's fused pass", tokens(fused_token_predict))):
        fn()
        out[name] = 1e3 * clock(lambda: [fn() for _ in range(5)])[0] / 5
    return out

MEMORY_SCRIPT = r'''
import json, resource, sys, time, torch
def peak_mb():
    "Peak resident memory of this process in MB: VmHWM (reset by exec, unlike ru_maxrss, which keeps the parent's)."
    try: return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) / 1024
    except (OSError, StopIteration): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
from ictd.boyan import random_boyan_chain
from ictd.model import SoftmaxICTD
from ictd.prompt import build_prompt
from ictd.tasks import sample_trajectories
n, dtype, grad = int(sys.argv[1]), getattr(torch, sys.argv[2]), sys.argv[3] == "grad"
mrp = random_boyan_chain(10, features="onehot", seed=0)
S = sample_trajectories(mrp.P[None], n, mrp.d_pi[None], seed=0)[0]
Z = build_prompt(mrp.phi[S], mrp.r[S[:-1]], mrp.phi[0]).to(dtype)
model = SoftmaxICTD.from_theta_star(10, 2, 15. * torch.eye(10, dtype=torch.float64), 1., 0.9).to(dtype)
base = peak_mb()
from torch.profiler import profile
with profile() as prof:                     # the kernel torch picks depends on dtype, autograd and layout, not on n
    with torch.set_grad_enabled(grad): model.predict(Z[..., -102:], n=100)
kernels = sorted({e.key for e in prof.key_averages() if "attention" in e.key and e.key.startswith("aten::_")})
t = time.perf_counter()
with torch.set_grad_enabled(grad):
    v = model.predict(Z, n=n)
    if grad: v.sum().backward()
seconds = time.perf_counter() - t
print(json.dumps(dict(n=n, dtype=sys.argv[2], grad=grad, seconds=seconds, kernels=kernels,
                      peak_mb=peak_mb(), before_mb=base)))
'''

def forward_memory(ns, cases):
    "Each (n, dtype, grad) in a fresh process: the forward pass's wall time, the process's peak memory (VmHWM), the attention kernels used."
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    out = []
    for n in ns:
        for dtype, grad in cases:
            proc = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(n), dtype, "grad" if grad else "nograd"],
                                  capture_output=True, text=True, env=env, timeout=1800)
            if proc.returncode: out.append(dict(n=n, dtype=dtype, grad=grad, error=(proc.stderr.strip().splitlines() or ["killed"])[-1][:300]))
            else: out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(out[-1], flush=True)
    return out

def float32_effect(seeds, n_steps):
    "The headline run in float64 and float32 on the same seeds: the largest differences in final metrics and parameters."
    cfg = dataclasses.replace(EMERGENCE, n_steps=n_steps)
    r64, r32 = (pretrain_many(dataclasses.replace(cfg, dtype=dt), seeds, progress=False, device=DEVICE) for dt in ("float64", "float32"))
    gap = lambda k: max((a.history[k][-1] - b.history[k][-1]).abs().max().item() for a, b in zip(r64, r32))
    params = max((p.double() - q.double()).abs().max().item() for a, b in zip(r64, r32) for p, q in zip(a.model.parameters(), b.model.parameters()))
    scale = max(p.abs().max().item() for a in r64 for p in a.model.parameters())
    return dict(seeds=len(seeds), n_steps=n_steps, max_abs_diff={k: gap(k) for k in ("msve", "diagonality", "value_weights", "cosine", "neu_population")},
                max_param_diff=params, max_param=scale,
                final_msve_mean={dt: sum(r.history["msve"][-1, 0].item() for r in rs) / len(rs) for dt, rs in (("float64", r64), ("float32", r32))})

def linear_reproduction(seed_counts=(3, 30), steps=50):
    "The predecessor's protocol (`ICLR_LINEAR`) through the engine against the side loop it replaced, seconds per seed-step, and the 30-seed reproduction extrapolated."
    c = ICLR_LINEAR
    fitted_td_step(n=c.n, n_layers=c.n_layers, gamma=c.gamma, n_states=c.n_states, d=c.feature_dim)          # cached: neither loop pays for the fit
    cfg = dataclasses.replace(c, n_tasks=steps // 5, n_steps=steps, eval_every=10**9)   # 5 mini-batches per task, as ICLR_LINEAR
    out = {}
    for S in seed_counts:
        seeds = list(range(S))
        old = per_step(lambda k, cb: pretrain_linear_many(cfg, seeds, callback=cb), steps, seeds=S)
        new = per_step(lambda k, cb: pretrain_many(cfg, seeds, progress=False, callback=cb, device=DEVICE), steps, seeds=S)
        out[f"{S} seeds"] = dict(old_loop=old, engine=new, engine_device=DEVICE, speed_up_cpu=old["cpu"] / new["cpu"], speed_up_wall=old["wall"] / new["wall"])
        print(S, out[f"{S} seeds"], flush=True)
    top = out[f"{seed_counts[-1]} seeds"]
    clock_kind = "cpu" if DEVICE == "cpu" else "wall"
    out[f"30 seeds x {c.n_steps} steps, training only ({clock_kind} s, extrapolated)"] = dict(old_loop=30 * c.n_steps * top["old_loop"][clock_kind], engine=30 * c.n_steps * top["engine"][clock_kind])
    out["speed_up"] = top["old_loop"][clock_kind] / top["engine"][clock_kind]
    print(f"linear reproduction ({seed_counts[-1]} seeds): the engine is {out['speed_up']:.2f}x the old loop ({clock_kind} time per seed-step)", flush=True)
    return out

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps and no n = 1e5 (a smoke test)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--out", type=Path, default=None, help="default bench/results.json (with --quick, a file in the system's temporary folder: a smoke test is not a result)")
    ap.add_argument("--linear-only", action="store_true", help="only the linear reproduction's speed-up (written to results-linear.json beside --out)")
    ap.add_argument("--device", default="cpu", help="torch device of the engine's runs: cpu (default) or cuda")
    a = ap.parse_args(argv)
    global DEVICE
    if a.out is None: a.out = Path(tempfile.gettempdir()) / "ictd-bench-quick" / "results.json" if a.quick else Path(__file__).resolve().parent / "results.json"
    a.out.parent.mkdir(parents=True, exist_ok=True)
    DEVICE = a.device
    if torch.device(DEVICE).type == "cuda" and not torch.cuda.is_available(): ap.error("--device cuda: no CUDA device is available")
    torch.set_num_threads(a.threads)
    if a.linear_only:
        res = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), device=DEVICE, quick=a.quick, load_before=os.getloadavg(),
                   linear_reproduction=linear_reproduction((3,), 20) if a.quick else linear_reproduction(), load_after=os.getloadavg())
        path = a.out.with_name("results-linear.json")
        path.write_text(json.dumps(res, indent=1))
        return print(f"wrote {path}")
    q = a.quick
    res = dict(ictd=ictd.__version__, torch=torch.__version__, threads=a.threads, machine=platform.processor() or platform.machine(),
               cpus=os.cpu_count(), device=DEVICE, quick=q, load_before=os.getloadavg(), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               host=platform.node(), provenance=provenance("make bench" if not a.quick else "python bench/bench_engine.py --quick", threads=a.threads,
                                                            torch_build=torch.__config__.show().splitlines()[:3], mkl=torch.backends.mkl.is_available()),
               baseline="(a): bench/incontexttd.py, a re-implementation of InContextTD's training step (Sequential-Intelligence-Lab/InContextTD, experiment/): "
                        + " ".join(__import__("incontexttd").__doc__.split()))
    rows = {}
    A, A_strict = "(a) InContextTD's training step, re-implemented", "(a') the same without its hard-coded linear Transformer"
    rows[A] = per_step(lambda k, cb: incontexttd_train(k, callback=cb), 3 if q else 11)
    rows[A_strict] = per_step(lambda k, cb: incontexttd_train(k, hard=False, callback=cb), 3 if q else 11)
    rows["(b) one-seed loop before the engine"] = per_step(lambda k, cb: one_seed_pretrain(dataclasses.replace(SPEC, eval_every=10**9), k, cb), 10 if q else 100)
    for dtype in ("float64", "float32"):
        for S in (1, 10, 30):
            rows[f"(c) engine, {S} seed{'s' * (S > 1)}, {dtype}"] = per_step(engine_run(S, dtype), (10 if q else 100) if S > 1 else (20 if q else 300), seeds=S)
            print(list(rows.items())[-1], flush=True)
    torch.set_num_threads(2 * a.threads)
    rows[f"(c) engine, 30 seeds, float64, {2 * a.threads} threads"] = per_step(engine_run(30, "float64"), 10 if q else 100, seeds=30)
    torch.set_num_threads(a.threads)
    ref, strict = rows[A]["cpu"], rows[A_strict]["cpu"]
    for r in rows.values(): r["speed-up vs (a)"], r["speed-up vs (a')"] = ref / r["cpu"], strict / r["cpu"]
    ratios = lambda head: dict(engine_ms_per_seed_step=1e3 * head["cpu"], incontexttd_ms_per_seed_step=1e3 * ref, speed_up=ref / head["cpu"],
                               speed_up_without_hard_transformer=strict / head["cpu"], goal=100., met=ref / head["cpu"] >= 100.)
    head = rows["(c) engine, 30 seeds, float32"]      # like for like: the predecessor trains in float32
    res["headline"] = dict(ratios(head), dtype="float32", float64=ratios(rows["(c) engine, 30 seeds, float64"]),
                           note="the engine's float32 path against InContextTD's float32 training step; float64, the book's default, beside it")
    strict_key = "speed-up vs (a')"
    print("\n".join(f"{k:62s} {1e3 * r['cpu']:9.3f} ms CPU per seed-step  {r['speed-up vs (a)']:7.1f}x (a)  {r[strict_key]:7.1f}x (a')" for k, r in rows.items()), flush=True)
    h64 = res["headline"]["float64"]
    print(f"headline: the engine (30 seeds, float32, as the predecessor) is {ref / head['cpu']:.0f}x InContextTD's training step per seed-step "
          f"({strict / head['cpu']:.0f}x without its hard-coded Transformer); float64: {h64['speed_up']:.0f}x ({h64['speed_up_without_hard_transformer']:.0f}x); goal 100x", flush=True)
    res["threads_note"] = "rows with more threads: compare wall times (their CPU time adds the threads up)"
    res["seconds_per_seed_step"] = rows
    ev, setup = evaluation_seconds(), setup_seconds()
    res["evaluation_30_seeds"], res["setup_30_seeds"] = ev, setup
    evals = SPEC.n_steps // SPEC.eval_every + 1
    res["protocol"] = {dtype: dict(train=30 * SPEC.n_steps * rows[f"(c) engine, 30 seeds, {dtype}"]["cpu"], evaluate=evals * ev["cpu"], setup=setup["cpu"])
                       for dtype in ("float64", "float32")}
    for p in res["protocol"].values():
        p["total"] = p["train"] + p["evaluate"] + p["setup"]
        p["evaluate / train"] = p["evaluate"] / p["train"]
    res["protocol"]["unbatched one-seed loop (b), 30 seeds"] = dict(train=30 * SPEC.n_steps * rows["(b) one-seed loop before the engine"]["cpu"])
    print(res["protocol"], flush=True)
    res["linear_reproduction"] = linear_reproduction((3,), 20) if q else linear_reproduction()
    res["training_shapes_ms"] = training_shapes()
    print(res["training_shapes_ms"], flush=True)
    res["float32"] = float32_effect(list(range(3 if q else 10)), 200 if q else EMERGENCE.n_steps)
    print(res["float32"], flush=True)
    cases = [("float64", False), ("float32", False), ("float64", True)]
    res["forward"] = forward_memory([1000, 10_000], cases) + ([] if q else forward_memory([100_000], cases[:2]))
    res["load_after"] = os.getloadavg()
    a.out.write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out}")

if __name__ == "__main__":
    main()
