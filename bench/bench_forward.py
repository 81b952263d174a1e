"""Benchmark the softmax in-context TD forward pass, with ratios against baselines measured in the same run.

For each context length n it times, on one batch of prompts from random Boyan chains:
- `SoftmaxICTD.from_theta_star(...)` as built (the successor shift applied as a tensor shift),
- the same layer with the shift applied as the dense (n+2) x (n+2) matrix product Z @ Pi (baseline),
- `weighted_softmax_td`, the algorithm the model computes (reference),
and prints the median times and the ratios baseline / model and algorithm / model.
Usage: python bench/bench_forward.py [--batch 32] [--layers 10] [--n 100 300 1000] [--device cpu|cuda]
"""
import argparse
import torch
from torch.utils.benchmark import Timer
from ictd.boyan import random_boyan_chain, sample_trajectory
from ictd.prompt import build_prompt
from ictd.model import SoftmaxICTD, context_attention
from ictd.wstd import weighted_softmax_td

def prompts(batch, n, device):
    "A batch of prompts (one query each) from random one-hot Boyan chains, and their trajectories."
    mrps = [random_boyan_chain(features="onehot", seed=b) for b in range(batch)]
    trajs = [sample_trajectory(m, n=n, seed=b) for b, m in enumerate(mrps)]
    phi_S = torch.stack([m.phi[S] for m, (S, _) in zip(mrps, trajs)]).to(device)
    R = torch.stack([R for _, R in trajs]).to(device)
    phi_q = torch.stack([m.phi[0] for m in mrps]).to(device)
    return build_prompt(phi_S, R, phi_q), phi_S, R, phi_q

def dense_shift_forward(model, Z, n):
    "Baseline: the dual-head layers with Z Pi computed as a dense matrix product."
    N = Z.shape[-1]
    Pi = torch.zeros(N, N, dtype=Z.dtype, device=Z.device)
    Pi[torch.arange(1, n + 1), torch.arange(n)] = 1.
    for l in range(model.n_layers):
        A, V_cur, V_tgt = model.layer(l).params(Z)
        S = context_attention(Z, A, n)
        Z = Z + V_cur @ Z @ S + V_tgt @ (Z @ Pi) @ S
    return Z

def median_seconds(fn, min_run_time=0.5):
    return Timer(stmt="fn()", globals=dict(fn=fn)).blocked_autorange(min_run_time=min_run_time).median

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--n", type=int, nargs="+", default=[100, 300, 1000])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    d, W = 10, 15. * torch.eye(10, dtype=torch.float64)
    model = SoftmaxICTD.from_theta_star(d, W, n_layers=a.layers, alpha=1., gamma=0.9).to(a.device).requires_grad_(False)
    print(f"device {a.device}, batch {a.batch}, {a.layers} layers, float64, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'n':>6} {'model ms':>10} {'dense-Pi ms':>12} {'wstd ms':>9} {'dense/model':>12} {'wstd/model':>11}")
    for n in a.n:
        Z, phi_S, R, phi_q = prompts(a.batch, n, a.device)
        ours = median_seconds(lambda: model(Z, n))
        dense = median_seconds(lambda: dense_shift_forward(model, Z, n))
        algo = median_seconds(lambda: weighted_softmax_td(phi_S, R, W.to(a.device), alpha=1., gamma=0.9, n_iters=a.layers, phi_queries=phi_q))
        assert torch.allclose(model(Z, n), dense_shift_forward(model, Z, n), atol=1e-12)
        print(f"{n:>6} {ours * 1e3:>10.2f} {dense * 1e3:>12.2f} {algo * 1e3:>9.2f} {dense / ours:>12.2f} {algo / ours:>11.2f}")

if __name__ == "__main__":
    main()
