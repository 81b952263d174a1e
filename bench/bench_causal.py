"""Benchmark of the decoder family (`attention="causal"`, chapter 4a) at chapter 6a's EMERGENCE sizes (d = 4, n = 30,
L = 3, batch 64), with the rows of one run measured interleaved in one process (no timed tests):

  (a) before: the prediction the engine ran until the fused pass, frozen in bench/reference_causal.py (dense (N, N)
      masked attention per layer, autograd);
  (b) readable: `causal_predict` today (the module's layer, fused attention in O(N) memory, autograd);
  (c) fused: the engine's `fused_causal_predict` (one autograd node, hand-written backward).

Each row is the CPU time per seed-step (`time.process_time`) of `pretrain_many` steps 2..K at 10 seeds (the claims
test's size), repeated `--reps` times in rotation (a, b, c, a, b, c, ...); the median and the range are reported,
with the load average before and after. Then the forward pass of `CausalSoftmaxICTD` at n = 1e3, 1e4, 1e5 (d = 4,
L = 3, 10 queries), each in a fresh process: wall time, the process's peak memory and the attention kernels used;
beside it the memory the dense (N, N) attention of (a) would need at that n.
With --softmax it also times the softmax family (30 seeds, the specification's default configuration) the same way, interleaved:
its fused state-token pass before the keys were read without a product (bench/reference_tokens.py) against today's.
Writes bench/results-causal.json with the host, CPU model, torch build and commit (`ictd.core.provenance`).
With --reps 0 it measures only the forward rows and adds them to the file.
Usage: python bench/bench_causal.py [--steps 30] [--reps 5] [--seeds 10] [--ns 1000,10000,100000] [--softmax] [--out bench/results-causal.json]
"""
import argparse, dataclasses, json, os, statistics, subprocess, sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ictd.core import provenance
from ictd.causal import causal_init, causal_metrics, causal_module, causal_predict, causal_prompt
from ictd.engine import EMERGENCE, Family, PretrainConfig, get_family, register_family
from ictd.pretrain import pretrain_many
from reference_causal import dense_causal_predict
from reference_tokens import pick_token_predict

ROWS = {"before: dense masked attention, autograd": "causal-before", "readable: causal_predict, autograd": "causal-readable",
        "fused: the engine's fused_causal_predict": "causal"}

SOFTMAX_ROWS = {"softmax before: keys through `pick`": "softmax-before", "softmax today: fused_token_predict": "softmax"}

def register_rows():
    for name, predict in (("causal-before", dense_causal_predict), ("causal-readable", causal_predict)):
        register_family(name, Family(init=causal_init, prompt=causal_prompt, predict=predict, module=causal_module, metrics=causal_metrics))
    soft = get_family("softmax")
    register_family("softmax-before", dataclasses.replace(soft, predict=lambda config, params, x, n: pick_token_predict(params, config.n_layers, x)))

def seed_step_ms(attention:str, seeds:list, steps:int, base=EMERGENCE)->float:
    "CPU milliseconds per seed-step of steps 2..`steps` of one run (no evaluation inside)."
    cfg = dataclasses.replace(base, attention=attention, n_steps=steps, eval_every=10 ** 9)
    marks = {}
    def mark(step):
        if step in (1, steps): marks[step] = time.process_time()
    pretrain_many(cfg, seeds, progress=False, callback=mark)
    return 1e3 * (marks[steps] - marks[1]) / ((steps - 1) * len(seeds))

MEMORY_SCRIPT = r'''
import json, sys, time, torch
from torch.profiler import profile
from ictd.causal import CausalSoftmaxICTD, build_causal_prompt
def peak_mb(): return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) / 1024
n = int(sys.argv[1])
g = torch.Generator().manual_seed(0)
Z = build_causal_prompt(torch.randn(n + 1, 4, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64),
                        torch.randn(10, 4, generator=g, dtype=torch.float64))
model = CausalSoftmaxICTD(4, 3, seed=0, init_gain=0.5).requires_grad_(False)
with profile() as prof: model.predict(Z[..., -41:], n=30)
kernels = sorted({e.key for e in prof.key_averages() if "attention" in e.key and e.key.startswith("aten::_")})
base = peak_mb()
t = time.perf_counter()
v = model.predict(Z)
print(json.dumps(dict(n=n, seconds=time.perf_counter() - t, kernels=kernels, peak_mb=peak_mb(), before_mb=base,
                      finite=bool(torch.isfinite(v).all()))))
'''

def forward_memory(ns:list)->list:
    env, out = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads())), []
    for n in ns:
        proc = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(n)], capture_output=True, text=True, env=env, timeout=3600)
        row = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else dict(n=n, error=(proc.stderr.strip().splitlines() or ["killed"])[-1][:300])
        row["dense_attention_gb"] = 3 * (n + 11) ** 2 * 8 / 1e9            # logits, masked logits and softmax of (a), per layer
        out.append(row); print(row, flush=True)
    return out

def softmax_rows(a)->dict:
    "The softmax family's rows: 30 seeds of the default configuration, interleaved, as the decoder's."
    seeds, load_before, times = list(range(30)), os.getloadavg(), {name: [] for name in SOFTMAX_ROWS}
    for attention in SOFTMAX_ROWS.values(): seed_step_ms(attention, seeds, 3, PretrainConfig())
    for rep in range(a.reps):
        for name, attention in SOFTMAX_ROWS.items(): times[name].append(seed_step_ms(attention, seeds, a.steps, PretrainConfig()))
        print(rep, {k: round(v[-1], 4) for k, v in times.items()}, flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    (b, t) = med.values()
    print(f"softmax family: {t:.4f} ms per seed-step against {b:.4f} before: {b / t:.3f}x")
    return dict(seeds=30, load_before=load_before, load_after=os.getloadavg(), speedup=b / t,
                ms_per_seed_step={k: dict(median=med[k], min=min(v), max=max(v), runs=v) for k, v in times.items()})

def save(out:dict, path:str):
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=1)); os.replace(tmp, path)

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=30); ap.add_argument("--reps", type=int, default=5); ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--ns", default="1000,10000,100000"); ap.add_argument("--out", default="bench/results-causal.json")
    ap.add_argument("--softmax", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    register_rows()
    command = f"python bench/bench_causal.py --steps {a.steps} --reps {a.reps} --seeds {a.seeds} --ns {a.ns}" + (" --softmax" if a.softmax else "")
    if a.reps == 0:                                            # the forward rows only, added to the file's step rows
        out = json.loads(Path(a.out).read_text()) if Path(a.out).exists() else {}
        out["forward_provenance"] = provenance(command, threads=1)
    else:
        seeds, load_before = list(range(a.seeds)), os.getloadavg()
        for attention in ROWS.values(): seed_step_ms(attention, seeds, 3)                      # warm-up
        times = {name: [] for name in ROWS}
        for rep in range(a.reps):
            for name, attention in ROWS.items(): times[name].append(seed_step_ms(attention, seeds, a.steps))
            print(rep, {k: round(v[-1], 3) for k, v in times.items()}, flush=True)
        load_after = os.getloadavg()
        med = {k: statistics.median(v) for k, v in times.items()}
        before, fused = med["before: dense masked attention, autograd"], med["fused: the engine's fused_causal_predict"]
        out = dict(provenance=provenance(command, threads=1), load_before=load_before, load_after=load_after, seeds=a.seeds, steps=a.steps,
                   reps=a.reps, ms_per_seed_step={k: dict(median=med[k], min=min(v), max=max(v), runs=v) for k, v in times.items()},
                   speedup_fused_over_before=before / fused)
        print(f"fused {fused:.3f} ms per seed-step against {before:.3f} before: {before / fused:.2f}x (load {load_before[0]:.1f} -> {load_after[0]:.1f})")
        if a.softmax: out["softmax"] = softmax_rows(a)
        save(out, a.out)
    out["forward"] = [r for r in out.get("forward", []) if r["n"] not in [int(x) for x in a.ns.split(",") if x]]
    for row in forward_memory([int(x) for x in a.ns.split(",") if x]):
        out["forward"].append(row); save(out, a.out)                                           # each row as soon as it is measured

if __name__ == "__main__":
    main()
