"""The TTT loss: soft cross-entropy of the drafter's logits to the target distribution over the
draft vocab, per row weighted, and the drafter's top-1 — without (rows, Vd) float32 tensors.

The target distribution arrives as `ttt.TargetDist`: logits (bf16 from the target's head, or
float32 log-probs for a top-k signal) and their log-sum-exp, so p = exp(t - lse_t) is formed
where it is used. For a row with weight w:

    loss = w · (lse(z) · Σp - Σ p·z)          (= -w Σ p · log_softmax(z), also when Σp != 1)
    d loss / dz = w · (softmax(z) · Σp - p)

On a GPU both are one Triton kernel each (aerie_trainer.kernels), streaming each row once; here,
in torch, rows are taken in chunks (`CHUNK_ELEMENTS` elements at a time) — the CPU path and the
reference the kernels are checked against. A row of weight 0 contributes exactly 0 (no NaN from
a row whose target has no mass).
"""

from __future__ import annotations

import torch

from aerie_trainer.precision import acc_dtype as _acc
from aerie_trainer.precision import triton_available

CHUNK_ELEMENTS = 1 << 22  # rows x vocab handled at once by the torch path


def soft_cross_entropy(logits, target_logits, target_lse, weight):
    """logits (B, L, Vd) drafter; target_logits (B, L, Vd) (any row strides), target_lse (B, L);
    weight (B, L) float. -> (Σ rows weight · cross-entropy (scalar), argmax of logits (B, L))."""
    return SoftCrossEntropy.apply(logits, target_logits, target_lse, weight)


class SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target_logits, target_lse, weight):
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        if target_logits.stride(-1) != 1:
            target_logits = target_logits.contiguous()
        if logits.is_cuda and triton_available():
            from aerie_trainer import kernels

            rows, lse, sum_p, argmax = kernels.soft_ce_forward(logits, target_logits, target_lse, weight)
        else:
            rows, lse, sum_p, argmax = soft_ce_forward_torch(logits, target_logits, target_lse, weight)
        ctx.save_for_backward(logits, target_logits, target_lse, weight, lse, sum_p)
        ctx.mark_non_differentiable(argmax)
        return rows.sum(), argmax

    @staticmethod
    def backward(ctx, grad_loss, _grad_argmax):
        logits, target_logits, target_lse, weight, lse, sum_p = ctx.saved_tensors
        if logits.is_cuda and triton_available():
            from aerie_trainer import kernels

            grad = kernels.soft_ce_backward(logits, target_logits, target_lse, weight, lse, sum_p, grad_loss)
        else:
            grad = soft_ce_backward_torch(logits, target_logits, target_lse, weight, lse, sum_p, grad_loss)
        return grad, None, None, None


def _chunks(B: int, L: int, V: int):
    step = max(1, CHUNK_ELEMENTS // max(V, 1))
    for b in range(B):
        for start in range(0, L, step):
            yield b, slice(start, min(L, start + step))


def soft_ce_forward_torch(z, t, t_lse, w):
    """-> (weighted loss per row, lse of z, Σp, argmax of z), each (B, L)."""
    B, L, V = z.shape
    acc = _acc(z.dtype)
    rows = torch.empty(B, L, dtype=acc, device=z.device)
    lse, sum_p = torch.empty_like(rows), torch.empty_like(rows)
    argmax = torch.empty(B, L, dtype=torch.int64, device=z.device)
    for b, s in _chunks(B, L, V):
        zc = z[b, s].to(acc)
        p = torch.exp(t[b, s].to(acc) - t_lse[b, s].to(acc)[:, None])
        lse[b, s] = torch.logsumexp(zc, -1)
        sum_p[b, s] = p.sum(-1)
        pz = torch.where(p > 0, p * zc, 0.0).sum(-1)
        wc = w[b, s].to(acc)
        rows[b, s] = torch.where(wc != 0, wc * (lse[b, s] * sum_p[b, s] - pz), 0.0)
        argmax[b, s] = zc.argmax(-1)
    return rows, lse, sum_p, argmax


def soft_ce_backward_torch(z, t, t_lse, w, lse, sum_p, grad_loss):
    B, L, V = z.shape
    acc = _acc(z.dtype)
    grad = torch.empty_like(z)
    for b, s in _chunks(B, L, V):
        p = torch.exp(t[b, s].to(acc) - t_lse[b, s].to(acc)[:, None])
        q = torch.exp(z[b, s].to(acc) - lse[b, s][:, None])
        wc = (w[b, s].to(acc) * grad_loss.to(acc))[:, None]
        grad[b, s] = torch.where(wc != 0, (q * sum_p[b, s][:, None] - p) * wc, 0.0).to(z.dtype)
    return grad
