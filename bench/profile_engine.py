"""Profile of the engine's training steps alone: 30 seeds, the specification's shapes, steps 2..`--steps` (default 200) of one run,
no evaluation (the profiler starts after the first step and stops after the last, so set-up and evaluation are left out).

Prints torch.profiler's top operators by self CPU time (default) or cProfile's top functions by internal time (`--cprofile`),
then the CPU milliseconds per seed-step with and without the profiler.
--attention picks the model family: "softmax" (default), "causal" (the decoder of chapter 4a), or the frozen earlier
paths "causal-before" and "softmax-before" of bench/bench_causal.py.
Usage: python bench/profile_engine.py [--steps 200] [--seeds 30] [--dtype float64] [--attention softmax] [--cprofile] [--top 25]
"""
import argparse, cProfile, dataclasses, pstats, time
import sys
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ictd.engine import PretrainConfig
from ictd.pretrain import pretrain_many

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=200); ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--dtype", default="float64"); ap.add_argument("--cprofile", action="store_true"); ap.add_argument("--top", type=int, default=25); ap.add_argument("--sort", default="tottime")
    ap.add_argument("--attention", default="softmax")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    if a.attention.endswith("-before"):
        from bench_causal import register_rows
        register_rows()
    cfg = dataclasses.replace(PretrainConfig(), attention=a.attention, dtype=a.dtype, n_steps=a.steps, eval_every=10**9)
    seeds = list(range(a.seeds))
    if a.cprofile: prof = cProfile.Profile()
    else:
        from torch.profiler import profile, ProfilerActivity
        prof = profile(activities=[ProfilerActivity.CPU])
    marks, on = {}, [False]
    def mark(step, profiled=True):
        if step in (1, a.steps): marks[step] = time.process_time()
        if profiled and step == 1: prof.enable() if a.cprofile else prof.start()
        if profiled and step == a.steps: prof.disable() if a.cprofile else prof.stop()
    pretrain_many(dataclasses.replace(cfg, n_steps=3), seeds, progress=False)    # warm-up
    pretrain_many(cfg, seeds, progress=False, callback=mark)
    if a.cprofile: pstats.Stats(prof).sort_stats(a.sort).print_stats(a.top)
    else: print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=a.top))
    print(f"{1e3 * (marks[a.steps] - marks[1]) / ((a.steps - 1) * a.seeds):.4f} ms CPU per seed-step (under the profiler)")
    pretrain_many(cfg, seeds, progress=False, callback=lambda s: mark(s, False))
    print(f"{1e3 * (marks[a.steps] - marks[1]) / ((a.steps - 1) * a.seeds):.4f} ms CPU per seed-step (no profiler)")

if __name__ == "__main__":
    main()
