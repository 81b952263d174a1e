"""The softmax family's fused state-token pass as the engine ran it before its keys were read without a product (commit
1cd4019), frozen for bench/bench_causal.py --softmax: each layer's keys and mean successors came from one product with
`pick`, whose rows 2k and 2k + 1 are the identity's row k and state k's successor weights."""
import torch
from torch.autograd.function import once_differentiable
from ictd.state_tokens import StateTokens, token_predict
from reference_step import FAST_PRODUCT, _rows

class _FusedTokens(torch.autograd.Function):
    """`token_predict` as one autograd node: A, V_cur, V_tgt (S, L or 1, D, D); Z (S, B, D, C), log_w (S, B, s), succ (S, B, s, C) contiguous.
    Each layer's keys and their mean successors come from one product with `pick` (rows 2k, 2k + 1: key k, its successors), and its values
    and A-scaled keys from one product per seed with W = [[V_cur^T, A], [V_tgt^T, 0]]."""
    @staticmethod
    def forward(ctx, A, V_cur, V_tgt, Z, log_w, succ, n_layers, q):
        S, B, D, C = Z.shape
        s, saved = log_w.shape[-1], []
        eye = torch.eye(s, C, dtype=Z.dtype, device=Z.device).expand(S, B, s, C)
        pick = torch.stack([eye, succ], -2).reshape(S * B, 2 * s, C)
        W = torch.cat([torch.cat([V_cur.mT, A], -1), torch.cat([V_tgt.mT, torch.zeros_like(A)], -1)], -2)   # (S, Lp, 2D, 2D)
        bias = log_w.reshape(S * B, s, 1)
        for l in range(n_layers):
            c = min(C, max(q, -(-FAST_PRODUCT // (s * D)))) if l == n_layers - 1 else C   # columns updated
            T = Z.mT.contiguous().reshape(S * B, C, D)                               # the tokens as rows
            KY = (pick @ T).reshape(S, B, s, 2 * D)                                  # row k: key k, its mean successor
            XG = _rows(W[:, l % W.shape[1]], KY).reshape(S * B, s, 2 * D)            # row k: value of key k, key k times A
            O = (Z[..., C - c:].contiguous() if c < C else Z).reshape(S * B, D, c)
            att = torch.softmax(torch.baddbmm(bias, XG[..., D:], O), dim=-2)         # (S B, s, c)
            saved += [T, KY, XG, O, att]
            Z = torch.baddbmm(O, XG[..., :D].mT, att).reshape(S, B, D, c)
        ctx.n_layers, ctx.q, ctx.shape = n_layers, q, (S, B, D, C, s)
        ctx.save_for_backward(W, pick, *saved)
        return Z[..., -1, -q:]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        W, pick, *saved = ctx.saved_tensors
        L, q, (S, B, D, C, s) = ctx.n_layers, ctx.q, ctx.shape
        dW = torch.zeros_like(W)
        g = grad.new_zeros(S * B, D, saved[-1].shape[-1])
        g.view(S, B, D, -1)[..., -1, -q:] = grad                                 # d value / d the last layer's output columns
        for l in reversed(range(L)):
            T, KY, XG, O, att = saved[5 * l: 5 * l + 5]
            c = att.shape[-1]
            dX = att @ g.mT.contiguous()                                         # (S B, s, D)
            dE = torch._softmax_backward_data(XG[..., :D] @ g, att, -2, att.dtype)
            dG = dE @ T[:, C - c:]                                               # (S B, s, D)
            dO = torch.baddbmm(g, XG[..., D:].mT, dE)                            # (S B, D, c)
            dXG = torch.cat([dX, dG], -1).reshape(S, B * s, 2 * D)
            dW[:, l % W.shape[1]] += KY.reshape(S, B * s, 2 * D).mT @ dXG
            dKY = (dXG @ W[:, l % W.shape[1]].mT).reshape(S * B, 2 * s, D)       # rows 2k, 2k + 1: d key k, d its mean successor
            g = dKY.mT @ pick                                                    # (S B, D, C)
            g[..., C - c:] += dO
        return dW[..., :D, D:], dW[..., :D, :D].mT, dW[..., D:, :D].mT, None, None, None, None, None


def pick_token_predict(params:dict, n_layers:int, x:StateTokens)->torch.Tensor:
    "`fused_token_predict` with the frozen pass above."
    Z = x.Z
    batch = Z.shape[:-2]
    if Z.ndim < 3 or x.log_w.shape[:-1] != batch or x.succ.shape[:-2] != batch: return token_predict(params, n_layers, x)
    dt, S, (D, C) = params["A"].dtype, batch[0], Z.shape[-2:]
    flat = lambda t, *tail: t.to(dt).reshape(S, -1, *tail).contiguous()
    v = _FusedTokens.apply(params["A"], params["V_cur"], params["V_tgt"], flat(Z, D, C), flat(x.log_w, x.log_w.shape[-1]),
                           flat(x.succ, *x.succ.shape[-2:]), n_layers, x.q)
    return v.reshape(*batch, x.q)
