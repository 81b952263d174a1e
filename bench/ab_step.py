"""A/B of the softmax family's training step: the step as it was before the speed work toward issue 35's 100x goal (frozen
in bench/reference_step.py: the fused state-token pass and the sampler's walk of commit 17b750b) against today's, both
through `pretrain_many` (30 seeds, the specification's default configuration, one thread), interleaved in one process
(before, after, before, after, ...) so that both see the same load; CPU milliseconds per seed-step of steps 2..`--steps`,
median and range over `--reps` rounds, for float64 and float32. Also prints the largest parameter difference between the
two after the rounds' last run (the same arithmetic up to rounding). No timed test: this is a measurement.
Usage: python bench/ab_step.py [--steps 40] [--reps 5] [--seeds 30] [--dtypes float64,float32] [--out FILE.json]
"""
import argparse, dataclasses, json, os, statistics, sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference_step
from ictd.core import provenance
from ictd.engine import PretrainConfig, get_family, get_protocol, register_family, register_protocol
from ictd.pretrain import pretrain_many

def register_before():
    "The frozen step as the family 'softmax-step-before' and the protocol 'stationary-step-before'."
    register_family("softmax-step-before", dataclasses.replace(
        get_family("softmax"), predict=lambda config, params, x, n: reference_step.fused_token_predict(params, config.n_layers, x)))
    register_protocol("stationary-step-before", dataclasses.replace(get_protocol("stationary"), sample=reference_step.stationary_sampler))

ROWS = {"before (commit 17b750b)": dict(attention="softmax-step-before", protocol="stationary-step-before"), "after": {}}

def seed_step_ms(cfg, seeds):
    "CPU ms per seed-step of steps 2..n_steps of one run, and the run's results."
    marks = {}
    def mark(step):
        if step in (1, cfg.n_steps): marks[step] = time.process_time()
    res = pretrain_many(cfg, seeds, progress=False, callback=mark)
    return 1e3 * (marks[cfg.n_steps] - marks[1]) / ((cfg.n_steps - 1) * len(seeds)), res

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40); ap.add_argument("--reps", type=int, default=5); ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--dtypes", default="float64,float32"); ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    register_before()
    seeds, out = list(range(a.seeds)), dict(provenance=provenance(" ".join(["python bench/ab_step.py"] + sys.argv[1:]), threads=1),
                                            load_before=os.getloadavg(), seeds=a.seeds, steps=a.steps, reps=a.reps)
    for dtype in a.dtypes.split(","):
        base = dataclasses.replace(PretrainConfig(), dtype=dtype, n_steps=a.steps, eval_every=10 ** 9)
        cfgs = {name: dataclasses.replace(base, **kw) for name, kw in ROWS.items()}
        for cfg in cfgs.values(): seed_step_ms(dataclasses.replace(cfg, n_steps=3), seeds)        # warm-up
        times, last = {name: [] for name in cfgs}, {}
        for rep in range(a.reps):
            for name, cfg in cfgs.items(): ms, last[name] = seed_step_ms(cfg, seeds); times[name].append(ms)
            print(dtype, rep, {k: round(v[-1], 4) for k, v in times.items()}, flush=True)
        (b, t) = (statistics.median(v) for v in times.values())
        gap = max((p - q).abs().max().item() for r0, r1 in zip(*last.values()) for p, q in zip(r0.params.values(), r1.params.values()))
        print(f"{dtype}: {t:.4f} ms per seed-step against {b:.4f} before: {b / t:.3f}x; largest parameter difference {gap:.2e}", flush=True)
        out[dtype] = dict(speedup=b / t, max_param_diff=gap, ms_per_seed_step={k: dict(median=statistics.median(v), min=min(v), max=max(v), runs=v)
                                                                                for k, v in times.items()})
    out["load_after"] = os.getloadavg()
    if a.out is not None: a.out.write_text(json.dumps(out, indent=1))

if __name__ == "__main__":
    main()
