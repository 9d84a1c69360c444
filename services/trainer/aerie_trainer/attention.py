"""Attention over a prefix of keys plus a chain of draft steps' keys at the same slot.

This is all that training-time test (TTT) and chain decoding need (model.Attention): step k at
slot t attends to the base sequence's keys under a mask (causal in training: keys 0..t) and to
the k chain keys of slot t itself (draft steps 1..k, one key each: the "diagonal").

Design choices, in one place:
- One softmax over both parts, computed in two: the prefix part is ordinary attention that also
  returns its log-sum-exp; the chain keys are merged into it by log-sum-exp (`merge_forward`).
  Backward uses the merged output and log-sum-exp: the prefix's backward given those is exactly
  the gradient of the joint softmax for the prefix keys (the same identity ring attention uses),
  and the chain keys' gradients follow from the same two numbers.
- Grouped-query attention is never expanded: query heads are grouped per key/value head
  (`q.unflatten(1, (nkv, rep))`), never `repeat_interleave` of the keys.
- On a GPU in bf16/fp16 with a causal prefix, the prefix part is PyTorch's flash-attention kernel
  (`aten._scaled_dot_product_flash_attention` forward and backward, which take grouped heads and
  return the log-sum-exp), and the merge is two Triton kernels (aerie_trainer.kernels). Anywhere
  else (the CPU, float32/float64, an explicit mask) it is the plain-torch math below, which is
  also the reference the GPU path is checked against (`benchmarks/bench_step.py --check`).
- No (L x L) mask is built on the flash path; the math path builds the boolean mask it needs.

Shapes: B batch, nh query heads, nkv key/value heads (rep = nh / nkv), T queries, S prefix keys,
n chain keys per slot, hd head dim. q (B, nh, T, hd); k, v (B, nkv, S, hd); the chain stacked as
ck, cv (n, B, T, nkv, hd).
"""

from __future__ import annotations

import torch

from aerie_trainer.precision import acc_dtype as _acc
from aerie_trainer.precision import triton_available

_FLASH_MODE: dict[int, str | None] = {}  # device index -> "gqa", "expand" or None (no flash)


def attend(q, k, v, ck=None, cv=None, mask=None, scale=None):
    """Softmax attention of q over k/v (under `mask` (T, S) bool; None: causal, T == S) and over
    the chain keys ck/cv (one per slot and step; None: no chain). Returns (B, nh, T, hd)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return PrefixChainAttention.apply(q, k, v, ck, cv, mask, scale)


class PrefixChainAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ck, cv, mask, scale):
        mode = flash_mode(q, k) if mask is None else None
        if mode is not None:
            o_p, lse_p, extras = _flash_forward(q, k, v, scale, mode)
        else:
            o_p, lse_p = _math_forward(q, k, v, mask, scale)
            extras = None
        if ck is not None and ck.shape[0]:
            out, lse = merge_forward(q, o_p, lse_p, ck, cv, scale)
        else:
            out, lse, ck, cv = o_p, lse_p, None, None
        ctx.save_for_backward(q, k, v, ck, cv, out, lse, mask)
        ctx.mode, ctx.extras, ctx.scale = mode, extras, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, ck, cv, out, lse, mask = ctx.saved_tensors
        if dout.stride(-1) != 1:
            dout = dout.contiguous()
        if ctx.mode is not None:
            dq, dk, dv = _flash_backward(dout, q, k, v, out, lse, ctx.extras, ctx.scale, ctx.mode)
        else:
            dq, dk, dv = _math_backward(dout, q, k, v, out, lse, mask, ctx.scale)
        dck = dcv = None
        if ck is not None:
            dq, dck, dcv = merge_backward(dout, q, out, lse, ck, cv, dq, ctx.scale)
        return dq, dk, dv, dck, dcv, None, None


# --------------------------------------------------------------------------------------
# The prefix part: plain torch (any device, any dtype, any mask)
# --------------------------------------------------------------------------------------
def _scores(q, k, scale):
    """-> (B, nkv, rep, T, S) scaled scores, query heads grouped by their key/value head."""
    B, nh, T, hd = q.shape
    nkv, S = k.shape[1], k.shape[2]
    acc = _acc(q.dtype)
    qg = q.to(acc).reshape(B, nkv, (nh // nkv) * T, hd)
    return ((qg @ k.to(acc).transpose(-1, -2)) * scale).view(B, nkv, nh // nkv, T, S)


def _allowed(mask, T, S, device):
    return mask if mask is not None else torch.ones(T, S, dtype=torch.bool, device=device).tril()


def _math_forward(q, k, v, mask, scale):
    B, nh, T, hd = q.shape
    nkv, S = k.shape[1], k.shape[2]
    s = _scores(q, k, scale).masked_fill(~_allowed(mask, T, S, q.device), float("-inf"))
    lse = torch.logsumexp(s, -1)  # (B, nkv, rep, T)
    p = torch.exp(s - lse[..., None]).view(B, nkv, -1, S)
    out = (p @ v.to(p.dtype)).view(B, nh, T, hd)
    return out.to(q.dtype), lse.view(B, nh, T)


def _math_backward(dout, q, k, v, out, lse, mask, scale):
    """Gradients of the prefix keys given the *joint* output and log-sum-exp (see the module doc)."""
    B, nh, T, hd = q.shape
    nkv, S = k.shape[1], k.shape[2]
    acc = _acc(q.dtype)
    s = _scores(q, k, scale).masked_fill(~_allowed(mask, T, S, q.device), float("-inf"))
    p = torch.exp(s - lse.to(acc).view(B, nkv, -1, T)[..., None]).view(B, nkv, -1, S)  # (B, nkv, rep*T, S)
    do = dout.to(acc).reshape(B, nkv, -1, hd)
    dv = p.transpose(-1, -2) @ do  # (B, nkv, S, hd): the product sums over the group's heads
    dp = do @ v.to(acc).transpose(-1, -2)
    delta = (dout.to(acc) * out.to(acc)).sum(-1).reshape(B, nkv, -1, 1)
    ds = p * (dp - delta)
    dq = ((ds @ k.to(acc)) * scale).view(B, nh, T, hd)
    dk = (ds.transpose(-1, -2) @ q.to(acc).reshape(B, nkv, -1, hd)) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# --------------------------------------------------------------------------------------
# The prefix part on a GPU: PyTorch's flash-attention kernels
# --------------------------------------------------------------------------------------
def flash_mode(q, k) -> str | None:
    """ "gqa" (flash takes the grouped heads as they are), "expand" (it needs them repeated), or
    None (no flash here: CPU, float32, odd head dim, non-square causal, or a failed probe)."""
    if not (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 256
        and q.shape[2] == k.shape[2]
    ):
        return None
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if index not in _FLASH_MODE:
        _FLASH_MODE[index] = _probe_flash(q.device, q.dtype)
    return _FLASH_MODE[index]


def _probe_flash(device, dtype) -> str | None:
    """Run flash once on a small grouped-head problem and compare it (output, log-sum-exp and
    gradients given the joint output) with the math path; the first mode that agrees wins."""
    g = torch.Generator(device=device).manual_seed(0)
    B, nh, nkv, T, hd = 1, 4, 2, 96, 64
    q, do = (torch.randn(B, T, nh, hd, generator=g, device=device, dtype=dtype).transpose(1, 2) for _ in range(2))
    k, v = (torch.randn(B, T, nkv, hd, generator=g, device=device, dtype=dtype).transpose(1, 2) for _ in range(2))
    scale = hd**-0.5
    ref_out, ref_lse = _math_forward(q, k, v, None, scale)
    ref_grads = _math_backward(do, q, k, v, ref_out, ref_lse, None, scale)
    for mode in ("gqa", "expand"):
        try:
            out, lse, extras = _flash_forward(q, k, v, scale, mode)
            grads = _flash_backward(do, q, k, v, out, lse, extras, scale, mode)
        except RuntimeError:
            continue
        pairs = [(out, ref_out), (lse, ref_lse), *zip(grads, ref_grads)]
        if all(a.shape == b.shape and _rel(a, b) < 2e-2 for a, b in pairs):
            return mode
    return None


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _repeat(t, rep):
    return t if rep == 1 else t.repeat_interleave(rep, 1)


def _flash_forward(q, k, v, scale, mode):
    rep = q.shape[1] // k.shape[1] if mode == "expand" else 1
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, _repeat(k, rep), _repeat(v, rep), 0.0, True, False, scale=scale
    )
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _flash_backward(dout, q, k, v, out, lse, extras, scale, mode):
    cum_q, cum_k, max_q, max_k, seed, offset = extras
    nkv = k.shape[1]
    rep = q.shape[1] // nkv if mode == "expand" else 1
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout,
        q,
        _repeat(k, rep),
        _repeat(v, rep),
        out,
        lse,
        cum_q,
        cum_k,
        max_q,
        max_k,
        0.0,
        True,
        seed,
        offset,
        scale=scale,
    )
    if rep > 1:
        dk, dv = (t.unflatten(1, (nkv, rep)).sum(2) for t in (dk, dv))
    return dq, dk, dv


# --------------------------------------------------------------------------------------
# The chain keys, merged by log-sum-exp
# --------------------------------------------------------------------------------------
def merge_forward(q, o_p, lse_p, ck, cv, scale):
    """Prefix output/log-sum-exp + the chain keys -> the joint (out, lse)."""
    if q.is_cuda and triton_available():
        from aerie_trainer import kernels

        return kernels.chain_merge_forward(q, o_p, lse_p, ck, cv, scale)
    return merge_forward_torch(q, o_p, lse_p, ck, cv, scale)


def merge_backward(dout, q, out, lse, ck, cv, dq, scale):
    """-> (dq with the chain's part added, dck, dcv)."""
    if q.is_cuda and triton_available():
        from aerie_trainer import kernels

        return kernels.chain_merge_backward(dout, q, out, lse, ck, cv, dq, scale)
    return merge_backward_torch(dout, q, out, lse, ck, cv, dq, scale)


def _grouped(ck, acc):
    """(n, B, T, nkv, hd) -> (n, B, nkv, 1, T, hd): broadcasts over a group's query heads."""
    return ck.to(acc).permute(0, 1, 3, 2, 4).unsqueeze(3)


def merge_forward_torch(q, o_p, lse_p, ck, cv, scale):
    B, nh, T, hd = q.shape
    nkv = ck.shape[3]
    acc = _acc(q.dtype)
    q5 = q.to(acc).unflatten(1, (nkv, -1))  # (B, nkv, rep, T, hd)
    d = (q5 * _grouped(ck, acc)).sum(-1) * scale  # (n, B, nkv, rep, T): one score per chain key
    lp = lse_p.to(acc).view(B, nkv, -1, T)
    lse = torch.logsumexp(torch.cat([lp[None], d]), 0)  # (B, nkv, rep, T)
    out = torch.exp(lp - lse)[..., None] * o_p.to(acc).unflatten(1, (nkv, -1))
    out = out + (torch.exp(d - lse)[..., None] * _grouped(cv, acc)).sum(0)
    return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2)


def merge_backward_torch(dout, q, out, lse, ck, cv, dq, scale):
    B, nh, T, hd = q.shape
    nkv = ck.shape[3]
    acc = _acc(q.dtype)
    q5 = q.to(acc).unflatten(1, (nkv, -1))
    do5 = dout.to(acc).unflatten(1, (nkv, -1))
    k6, v6 = _grouped(ck, acc), _grouped(cv, acc)
    delta = (do5 * out.to(acc).unflatten(1, (nkv, -1))).sum(-1)  # (B, nkv, rep, T)
    p = torch.exp((q5 * k6).sum(-1) * scale - lse.to(acc).view(B, nkv, -1, T))  # (n, B, nkv, rep, T)
    ds = p * ((do5 * v6).sum(-1) - delta)
    dq5 = dq.to(acc).unflatten(1, (nkv, -1)) + (ds[..., None] * k6).sum(0) * scale
    dck = (ds[..., None] * q5).sum(3) * scale  # (n, B, nkv, T, hd): summed over the group's heads
    dcv = (p[..., None] * do5).sum(3)
    return (
        dq5.flatten(1, 2).to(q.dtype),
        dck.permute(0, 1, 3, 2, 4).to(ck.dtype),
        dcv.permute(0, 1, 3, 2, 4).to(cv.dtype),
    )
