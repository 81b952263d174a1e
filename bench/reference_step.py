"""The softmax family's training step as the engine ran it before the speed work of issue 35's 100x goal (commit 17b750b), frozen
for bench/ab_step.py: the fused state-token pass `_FusedTokens` and the stationary sampler's walk `_walk_examples`, as they were."""
import torch
from torch.autograd.function import once_differentiable
from ictd.core import TaskBatch
from ictd.engine import Contexts, TDExamples, TDSample
from ictd.state_tokens import StateTokens, token_predict
from ictd.tasks import task_features

FAST_PRODUCT = 400

def _rows(W, T):
    S, B, R, D = T.shape
    return (T.reshape(S, B * R, D) @ W).reshape(S, B, R, W.shape[-1])

class _FusedTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, A, V_cur, V_tgt, Z, log_w, succ, n_layers, q):
        S, B, D, C = Z.shape
        s, saved = log_w.shape[-1], []
        succ = succ.reshape(S * B, s, C)
        W = torch.cat([torch.cat([V_cur.mT, A], -1), torch.cat([V_tgt.mT, torch.zeros_like(A)], -1)], -2)   # (S, Lp, 2D, 2D)
        bias = log_w.reshape(S * B, s, 1)
        for l in range(n_layers):
            c = min(C, max(q, -(-FAST_PRODUCT // (s * D)))) if l == n_layers - 1 else C   # columns updated
            T = Z.mT.reshape(S * B, C, D)                                            # the tokens as rows
            KY = torch.cat([T[:, :s], succ @ T], -1).reshape(S, B, s, 2 * D)         # row k: key k, its mean successor
            XG = _rows(W[:, l % W.shape[1]], KY).reshape(S * B, s, 2 * D)            # row k: value of key k, key k times A
            O = (Z[..., C - c:].contiguous() if c < C else Z).reshape(S * B, D, c)
            att = torch.softmax(torch.baddbmm(bias, XG[..., D:], O), dim=-2)         # (S B, s, c)
            saved += [T, KY, XG, O, att]
            Z = torch.baddbmm(O, XG[..., :D].mT, att).reshape(S, B, D, c)
        ctx.n_layers, ctx.q, ctx.shape = n_layers, q, (S, B, D, C, s)
        ctx.save_for_backward(W, succ, *saved)
        return Z[..., -1, -q:]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        W, succ, *saved = ctx.saved_tensors
        L, q, (S, B, D, C, s) = ctx.n_layers, ctx.q, ctx.shape
        dW = torch.zeros_like(W)
        g = grad.new_zeros(S * B, D, saved[-1].shape[-1])
        g.view(S, B, D, -1)[..., -1, -q:] = grad
        for l in reversed(range(L)):
            T, KY, XG, O, att = saved[5 * l: 5 * l + 5]
            c = att.shape[-1]
            dX = att @ g.mT.contiguous()
            dE = torch._softmax_backward_data(XG[..., :D] @ g, att, -2, att.dtype)
            dG = dE @ T[:, C - c:]
            dO = torch.baddbmm(g, XG[..., D:].mT, dE)
            dXG = torch.cat([dX, dG], -1).reshape(S, B * s, 2 * D)
            dW[:, l % W.shape[1]] += KY.reshape(S, B * s, 2 * D).mT @ dXG
            dKY = (dXG @ W[:, l % W.shape[1]].mT).reshape(S * B, s, 2 * D)
            g = dKY[..., D:].mT @ succ
            g[..., :s] += dKY[..., :D].mT
            g[..., C - c:] += dO
        return dW[..., :D, D:], dW[..., :D, :D].mT, dW[..., D:, :D].mT, None, None, None, None, None

def fused_token_predict(params:dict, n_layers:int, x:StateTokens)->torch.Tensor:
    Z = x.Z
    batch = Z.shape[:-2]
    if Z.ndim < 3 or x.log_w.shape[:-1] != batch or x.succ.shape[:-2] != batch: return token_predict(params, n_layers, x)
    dt, S, (D, C) = params["A"].dtype, batch[0], Z.shape[-2:]
    flat = lambda t, *tail: t.to(dt).reshape(S, -1, *tail).contiguous()
    v = _FusedTokens.apply(params["A"], params["V_cur"], params["V_tgt"], flat(Z, D, C), flat(x.log_w, x.log_w.shape[-1]),
                           flat(x.succ, *x.succ.shape[-2:]), n_layers, x.q)
    return v.reshape(*batch, x.q)

def _walk_examples(pool:TaskBatch, u:torch.Tensor)->TDSample:
    (S, T, s), n = pool.P.shape[:3], u.shape[-1] - 4
    u = u.permute(2, 0, 1).contiguous()
    task = (u[0] * T).long().clamp(max=T - 1)
    rows = (torch.arange(S, device=u.device)[:, None] * T + task).flatten()
    cum = pool.P.reshape(S * T, s, s).index_select(0, rows).cumsum(-1)
    start = pool.d_pi.reshape(S * T, s).index_select(0, rows).cumsum(-1)
    cum[..., -1] = start[..., -1] = torch.inf
    cum, base, us = cum.reshape(-1, s), torch.arange(len(rows), device=u.device) * s, u[1:].reshape(n + 3, -1, 1)
    states = torch.empty(n + 1, len(rows), dtype=torch.long, device=u.device)
    states[0] = torch.searchsorted(start, us[0])[:, 0]
    for t in range(n): states[t + 1] = torch.searchsorted(cum.index_select(0, base + states[t]), us[t + 1])[:, 0]
    query = torch.searchsorted(start, us[n + 1])[:, 0]
    successor = torch.searchsorted(cum.index_select(0, base + query), us[n + 2])[:, 0]
    return TDSample(task, states.T.reshape(S, -1, n + 1), query.reshape(S, -1), successor.reshape(S, -1))

def stationary_sampler(config, pool:TaskBatch, gens:list, step:int, state:dict)->TDExamples:
    u = torch.stack([torch.rand(config.batch_size, config.n + 4, generator=g, dtype=torch.float64) for g in gens])
    b = _walk_examples(pool, u.to(pool.P.device))
    return TDExamples(Contexts(pool, b.task, b.states, torch.stack([b.query, b.successor], -1)), task_features(pool, b.task, b.query)[1])
