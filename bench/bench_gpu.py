"""The engine on a GPU at scale (issue 35): seed-steps per second at 10, 100, 1000 and 10,000 seeds, eager and captured,
against the CPU engine and InContextTD's training step measured on the same machine's CPU in the same run.

What is timed, at the specification's shapes (d = 4, n = 30, L = 3, batch 64, Adam), in float32 (CUDA's default):
  - `pretrain_many(..., device="cuda")`, wall seconds between the callbacks after a warm-up step and after the last step,
    eager and with `compile=True` (torch.compile in 'reduce-overhead' mode: the loss's forward and backward replayed as
    CUDA graphs; Adam's update and the per-step divergence check stay eager);
  - the share of a step spent drawing the batch (`stationary_sampler`: one CPU generator per seed draws the uniforms,
    in threads at 256 seeds and more (`ictd.core.stacked_uniforms`), and the walk runs on the GPU), timed alone;
  - the floating-point work of one seed-step (torch's FlopCounterMode on the GPU path, forward and backward), and from it
    the fraction of the GPU's float32 throughput used: against a float32 matrix product measured in the same run (TF32 off,
    as in the engine) and against the datasheet's 67 TFLOP/s for an H200's float32 (non-tensor) units.
Task pools: seed s >= 100 reuses the pool (and held-out tasks) of seed s mod 100. Building 10,000 pools of 256 tasks takes
about 5 CPU-minutes, which is set-up, not the step; a step's work depends on the shapes, not on the pools' values.
The CPU rows run the engine in float32 on one torch thread, and InContextTD's step (bench/incontexttd.py, row (a) of
bench_engine.py), on this machine's CPU.
Writes a JSON file (default bench/results-gpu.json) with the host, CPU, GPU, torch build and commit.
Usage: python bench/bench_gpu.py [--seeds 10 100 1000 10000] [--compiled-seeds 10 100 1000 10000] [--cpu-seeds 10 30] [--budget 360] [--out F] [--commit SHA]
"""
import argparse, dataclasses, json, os, sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ictd.core import provenance
from ictd.engine import PretrainConfig, get_family, get_protocol, register_protocol, step_loss, stationary_sampler, stationary_pools, stationary_eval_set, Protocol, DTYPES
from ictd.pretrain import pretrain_many
from incontexttd import incontexttd_train

BASE = 100                           # distinct pools; seed s uses seed s mod BASE's
H200_FP32_PEAK = 67e12               # NVIDIA H200 datasheet: FP32 (CUDA cores), dense
SPEC = dataclasses.replace(PretrainConfig(), dtype="float32", n_tasks=256, eval_tasks=16, eval_every=10**9, protocol="bench-tiled")

def tiled(obj, S):
    "`obj` (a tensor, or a dataclass, tuple or dict of them) with its leading (seed) axis repeated up to `S`."
    if isinstance(obj, torch.Tensor): return obj.repeat(-(-S // obj.shape[0]), *[1] * (obj.dim() - 1))[:S]
    if dataclasses.is_dataclass(obj): return dataclasses.replace(obj, **{f.name: tiled(getattr(obj, f.name), S) for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, (tuple, list)): return type(obj)(tiled(v, S) for v in obj)
    if isinstance(obj, dict): return {k: tiled(v, S) for k, v in obj.items()}
    return obj

def tiled_pools(config, seeds, device=None):
    return tiled(stationary_pools(config, seeds[:BASE], device), len(seeds))

def tiled_eval_set(config, seeds, device=None):
    return tiled(stationary_eval_set(config, seeds[:BASE], device), len(seeds))

register_protocol("bench-tiled", Protocol(sample=stationary_sampler, eval_set=tiled_eval_set, data=tiled_pools))

def sync(device):
    if torch.device(device).type == "cuda": torch.cuda.synchronize()

def seconds_per_seed_step(S, device, steps, warm, compile=False):
    "Wall seconds per seed-step of `pretrain_many` at `S` seeds, between the callbacks after step `warm` and the last step."
    marks = {}
    def mark(step):
        if step in (warm, steps): sync(device); marks[step] = time.perf_counter()
    t = time.perf_counter()
    pretrain_many(dataclasses.replace(SPEC, n_steps=steps), list(range(S)), device=device, callback=mark, compile=compile)
    return dict(per_seed_step=(marks[steps] - marks[warm]) / ((steps - warm) * S), total_s=time.perf_counter() - t, steps=steps)

def sampling_share(S, device, per_seed_step, reps=5):
    "Wall seconds per seed-step spent in the stationary sampler alone, and its share of the measured step."
    data = tiled_pools(SPEC, list(range(S)), device)
    gens = [torch.Generator().manual_seed(s) for s in range(S)]
    stationary_sampler(SPEC, data, gens, 0, {}); sync(device)
    t = time.perf_counter()
    for i in range(reps): stationary_sampler(SPEC, data, gens, i, {})
    sync(device)
    sample = (time.perf_counter() - t) / (reps * S)
    return dict(sample_per_seed_step=sample, share=sample / per_seed_step)

def flops_per_seed_step(device, S=10):
    "Floating-point operations of one seed-step's loss, forward and backward (FlopCounterMode: matrix products)."
    from torch.utils.flop_counter import FlopCounterMode
    seeds, protocol = list(range(S)), get_protocol(SPEC.protocol)
    params = {k: v.to(device).requires_grad_() for k, v in get_family(SPEC.attention).init(SPEC, seeds, DTYPES[SPEC.dtype]).items()}
    batch = protocol.sample(SPEC, protocol.data(SPEC, seeds, device), [torch.Generator().manual_seed(s) for s in seeds], 0, {})
    loss_of = step_loss(SPEC, protocol, [torch.Generator().manual_seed(s) for s in seeds], False, device)
    import ictd.state_tokens as st
    numpy_on_cpu, st._NUMPY_ON_CPU = st._NUMPY_ON_CPU, False    # torch's products everywhere: the counter sees only those
    try:
        with FlopCounterMode(display=False) as counter:
            loss_of(params, batch).sum().backward()
    finally: st._NUMPY_ON_CPU = numpy_on_cpu
    return counter.get_total_flops() / S

def matmul_flops_per_s(device, size=8192, reps=10):
    "Measured float32 matrix-product throughput (TF32 off), FLOP/s."
    torch.backends.cuda.matmul.allow_tf32 = False
    a, b = (torch.randn(size, size, device=device) for _ in range(2))
    for _ in range(3): a @ b
    sync(device); t = time.perf_counter()
    for _ in range(reps): a @ b
    sync(device)
    return 2 * size ** 3 * reps / (time.perf_counter() - t)

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[10, 100, 1000, 10000])
    ap.add_argument("--compiled-seeds", type=int, nargs="*", default=[10, 100, 1000, 10000])
    ap.add_argument("--cpu-seeds", type=int, nargs="*", default=[10, 30])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--budget", type=float, default=360, help="seconds; a row that would start after this is skipped (and says so)")
    ap.add_argument("--commit", default=None, help="the commit measured (where the tree has no .git)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results-gpu.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    start, rows = time.perf_counter(), dict(gpu={}, captured={}, cpu={}, skipped=[])
    prov = provenance("python bench/bench_gpu.py " + " ".join(argv or sys.argv[1:]), threads=1)
    if a.commit: prov["commit"] = a.commit
    if torch.device(a.device).type == "cuda": prov["gpu"] = torch.cuda.get_device_name()
    out = dict(provenance=prov, shapes=dict(d=SPEC.d, n=SPEC.n, n_layers=SPEC.n_layers, batch_size=SPEC.batch_size, dtype=SPEC.dtype), rows=rows)
    def save():
        tmp = a.out.with_suffix(".tmp"); tmp.write_text(json.dumps(out, indent=1) + "\n"); os.replace(tmp, a.out)
    def left(): return a.budget - (time.perf_counter() - start)
    rows["incontexttd_cpu"] = seconds_per_seed_step_incontexttd()
    for S in a.cpu_seeds:
        rows["cpu"][S] = seconds_per_seed_step(S, "cpu", 21, 1); print("cpu", S, rows["cpu"][S], flush=True); save()
    out["flops_per_seed_step"] = flops_per_seed_step(a.device)
    out["matmul_float32_flops_per_s"] = matmul_flops_per_s(a.device) if torch.device(a.device).type == "cuda" else None
    for compiled, seeds in ((False, a.seeds), (True, a.compiled_seeds)):
        for S in seeds:
            steps, warm = (60, 10) if S <= 100 else (30, 6) if S <= 1000 else (14, 4)
            if left() < 0: rows["skipped"].append(dict(seeds=S, compiled=compiled)); continue
            if compiled: torch._dynamo.reset()   # a fresh compile per seed count (each is its own shape), not a recompile past dynamo's limit
            r = seconds_per_seed_step(S, a.device, steps, warm, compile=compiled)
            r["seed_steps_per_s"] = 1 / r["per_seed_step"]
            r["flops_share_of_matmul"] = out["flops_per_seed_step"] * r["seed_steps_per_s"] / out["matmul_float32_flops_per_s"] if out["matmul_float32_flops_per_s"] else None
            r["flops_share_of_datasheet"] = out["flops_per_seed_step"] * r["seed_steps_per_s"] / H200_FP32_PEAK
            if not compiled: r.update(sampling_share(S, a.device, r["per_seed_step"]))
            if torch.device(a.device).type == "cuda": r["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9; torch.cuda.reset_peak_memory_stats()
            rows["captured" if compiled else "gpu"][S] = r
            print("captured" if compiled else "eager", S, r, flush=True); save()
    out["wall_s"] = time.perf_counter() - start
    save()
    print(f"wrote {a.out}")

def seconds_per_seed_step_incontexttd(steps=11):
    "InContextTD's training step (row (a) of bench_engine.py) on this CPU, one thread: wall seconds per step (one seed)."
    marks = {}
    incontexttd_train(steps, callback=lambda k: marks.__setitem__(k, time.perf_counter()) if k in (1, steps) else None)
    return (marks[steps] - marks[1]) / (steps - 1)

if __name__ == "__main__":
    main()
