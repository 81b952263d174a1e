"""Memory and time of the control Transformer's forward pass (chapter 9a, `ControlICTD`), dense path against the
streamed one (issue 33), each row in a fresh process with one torch thread: d = 4 features, A = 2 actions, one query
block, L = 1 pair of layers, Xavier-normal parameters (gain 0.5, seed 0), no gradients.

For each n it records the wall time of `predict`, the process's peak resident memory (VmHWM) before and after the call,
and the memory the dense path would need (`ictd.control_model._dense_bytes`: two (N, N) masks and, per prompt, logits,
masked logits and weights), N = n + (n + q) A. The dense path runs only where that estimate is under
`ictd.core.WORK_LIMITS['bytes']` (above it the model refuses it, and the refusal's message is recorded instead).
Writes nbs/data/control_forward_memory.json with `ictd.core.provenance`; chapter 9a shows it. No timed test reads it.
Usage: python bench/bench_control.py [--dense 1000,2000,10000,100000] [--streamed 1000,2000,10000,100000] [--out nbs/data/control_forward_memory.json]
"""
import argparse, json, os, subprocess, sys
from pathlib import Path

ROW = r'''
import json, sys, time, torch
from ictd.control_model import ControlICTD, _dense_bytes, build_control_prompt
def peak_mb(): return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) / 1024
n, method = int(sys.argv[1]), sys.argv[2]
g = torch.Generator().manual_seed(0)
r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) / 2
x = build_control_prompt(r(n, 4), r(n), r(n, 2, 4), r(1, 2, 4))
model = ControlICTD(4, 1, init_gain=0.5, seed=0).requires_grad_(False)
row = dict(n=n, N=x.Z.shape[-1], method=method, dense_gib=_dense_bytes(x.Z) / 2**30, before_mb=peak_mb())
try:
    t = time.perf_counter(); v = model.predict(x, method=method); row["seconds"] = time.perf_counter() - t
    row.update(peak_mb=peak_mb(), finite=bool(torch.isfinite(v).all()))
except ValueError as e: row["refused"] = str(e)
print(json.dumps(row))
'''

def measure(n:int, method:str)->dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", ROW, str(n), method], capture_output=True, text=True, env=env, check=True)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    print(row, flush=True)
    return row

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dense", default="1000,2000,10000,100000")
    p.add_argument("--streamed", default="1000,2000,10000,100000")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "nbs" / "data" / "control_forward_memory.json"))
    a = p.parse_args(argv)
    from ictd.core import atomic_write_text, provenance
    rows = [measure(int(n), "dense") for n in a.dense.split(",")] + [measure(int(n), "streamed") for n in a.streamed.split(",")]
    command = "python bench/bench_control.py " + " ".join(argv if argv is not None else sys.argv[1:])
    atomic_write_text(a.out, json.dumps(dict(rows=rows, provenance=provenance(command.strip(), threads=1)), indent=1) + "\n")

if __name__ == "__main__": main()
