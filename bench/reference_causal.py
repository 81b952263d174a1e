"""The decoder family's training prediction as the engine ran it before the fused pass (commit 1cd4019), frozen for
bench/bench_causal.py: every layer builds the (N, N) masked attention of `causal_attention` and the update
Z + V T S + U Z, for every seed's examples, and autograd records the graph."""
import functools, math
import torch
from ictd.causal import causal_keys, previous_token

@functools.lru_cache(maxsize=64)
def _mask(N:int, n:int, dtype, device)->tuple:
    keys = causal_keys(N, n, device)
    has = keys.any(0)
    fill = torch.full((N, N), -math.inf, dtype=dtype, device=device).masked_fill(~has, 0.)
    return keys, fill, has.to(dtype)

def _attention(T, Z, A, lam, n:int)->torch.Tensor:
    N = Z.shape[-1]
    pos = torch.arange(N, dtype=Z.dtype, device=Z.device).clamp(min=1).log()
    logits = T.mT @ A @ Z + torch.as_tensor(lam, dtype=Z.dtype, device=Z.device)[..., None, None] * pos[:, None]
    keys, fill, has = _mask(N, n, Z.dtype, Z.device)
    return torch.softmax(torch.where(keys, logits, fill), dim=-2) * has

def dense_causal_update(Z, A, V, U, lam, n:int)->torch.Tensor:
    T = torch.cat([Z, previous_token(Z)], -2)
    return Z + V @ T @ _attention(T, Z, A, lam, n) + U @ Z

def dense_causal_predict(config, params:dict, Z:torch.Tensor, n:int)->torch.Tensor:
    "(S, B, q): the family's prediction before the fused pass."
    Lp, Y = params["A"].shape[1], Z.to(params["A"].dtype)
    for l in range(config.n_layers): Y = dense_causal_update(Y, *(params[k][:, l % Lp][:, None] for k in ("A", "V", "U", "lam")), n)
    return Y[..., -1, n + 1:]
