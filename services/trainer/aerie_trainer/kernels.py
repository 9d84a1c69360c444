"""Triton kernels of the training step on a GPU (imported only there: the CPU never needs triton).

- `soft_ce_forward` / `soft_ce_backward`: the soft cross-entropy of a TTT step over the draft
  vocab, one program per row streaming the row once: the student's log-sum-exp (online), the
  target's probabilities from its logits and log-sum-exp, Σ p·z, Σ p and the student's argmax in
  the forward; (softmax(z)·Σp − p)·weight in the backward. Nothing of size (rows, Vd) in float32
  is ever written. Reference: aerie_trainer.loss (the same formulas in torch).
- `teacher_rows`: the target head's full-vocab logits -> the draft vocab's logits, their
  log-sum-exp and the full-vocab argmax, one pass per row. Reference: ttt.TargetHead (torch).
- `chain_merge_forward` / `chain_merge_backward`: the chain keys of TTT merged into the prefix
  attention by log-sum-exp, one program per (batch, key/value head, CHAIN_SLOTS slots) holding
  the group's query heads. Reference: aerie_trainer.attention.merge_forward_torch / merge_backward_torch.

Offsets are int64 (rows x vocab overflows int32 at large batches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# --------------------------------------------------------------------------------------
# Soft cross-entropy over the draft vocab
# --------------------------------------------------------------------------------------
@triton.jit
def _soft_ce_fwd(
    Z, TGT, TLSE, W, ROWS, LSE, SUMP, ARG, L, V, z_sb, z_st, t_sb, t_st, tl_sb, tl_st, w_sb, w_st, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    b, t = row // L, row % L
    z_row = Z + b * z_sb + t * z_st
    t_row = TGT + b * t_sb + t * t_st
    t_lse = tl.load(TLSE + b * tl_sb + t * tl_st).to(tl.float32)
    m = tl.full([], float("-inf"), tl.float32)  # running max of z
    s = tl.full([], 0.0, tl.float32)  # running Σ exp(z - m)
    pz = tl.full([], 0.0, tl.float32)  # Σ p·z
    ps = tl.full([], 0.0, tl.float32)  # Σ p
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 0, tl.int64)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < V
        z = tl.load(z_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
        tgt = tl.load(t_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
        p = tl.exp(tgt - t_lse)
        block_max = tl.max(z, 0)
        m_new = tl.maximum(m, block_max)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
        pz += tl.sum(tl.where(inside & (p > 0), p * z, 0.0), 0)
        ps += tl.sum(p, 0)
        i = tl.argmax(z, 0).to(tl.int64)  # first index of the block's max
        take = block_max > best  # strictly greater: the earliest block keeps a tie (torch.argmax)
        best_i = tl.where(take, start + i, best_i)
        best = tl.where(take, block_max, best)
    lse = m + tl.log(s)
    w = tl.load(W + b * w_sb + t * w_st).to(tl.float32)
    loss = tl.where(w != 0, w * (lse * ps - pz), 0.0)
    tl.store(ROWS + row, loss)
    tl.store(LSE + row, lse)
    tl.store(SUMP + row, ps)
    tl.store(ARG + row, best_i)


@triton.jit
def _soft_ce_bwd(
    Z,
    TGT,
    TLSE,
    W,
    LSE,
    SUMP,
    GOUT,
    G,
    L,
    V,
    z_sb,
    z_st,
    t_sb,
    t_st,
    tl_sb,
    tl_st,
    w_sb,
    w_st,
    g_sb,
    g_st,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b, t = row // L, row % L
    z_row = Z + b * z_sb + t * z_st
    t_row = TGT + b * t_sb + t * t_st
    g_row = G + b * g_sb + t * g_st
    t_lse = tl.load(TLSE + b * tl_sb + t * tl_st).to(tl.float32)
    w = tl.load(W + b * w_sb + t * w_st).to(tl.float32) * tl.load(GOUT).to(tl.float32)
    lse = tl.load(LSE + row)
    ps = tl.load(SUMP + row)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < V
        z = tl.load(z_row + cols, mask=inside, other=0.0).to(tl.float32)
        tgt = tl.load(t_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
        g = (tl.exp(z - lse) * ps - tl.exp(tgt - t_lse)) * w
        g = tl.where(w != 0, g, 0.0)
        tl.store(g_row + cols, g.to(G.dtype.element_ty), mask=inside)


def _block(V: int) -> int:
    return min(4096, triton.next_power_of_2(V))


def soft_ce_forward(z, tgt, t_lse, w):
    """z (B, L, V) student logits, tgt (B, L, V) target logits (any row strides), t_lse/w (B, L).
    -> per-row weighted losses (B, L) fp32, student lse (B, L), Σp (B, L), argmax (B, L) int64."""
    B, L, V = z.shape
    for x in (z, tgt):
        assert x.stride(-1) == 1, "the vocab dimension must be contiguous"
    rows = torch.empty(B, L, dtype=torch.float32, device=z.device)
    lse, sum_p = torch.empty_like(rows), torch.empty_like(rows)
    arg = torch.empty(B, L, dtype=torch.int64, device=z.device)
    if B * L:
        _soft_ce_fwd[(B * L,)](
            z,
            tgt,
            t_lse,
            w,
            rows,
            lse,
            sum_p,
            arg,
            L,
            V,
            z.stride(0),
            z.stride(1),
            tgt.stride(0),
            tgt.stride(1),
            t_lse.stride(0),
            t_lse.stride(1),
            w.stride(0),
            w.stride(1),
            BLOCK=_block(V),
            num_warps=8,
        )
    return rows, lse, sum_p, arg


def soft_ce_backward(z, tgt, t_lse, w, lse, sum_p, grad_out):
    B, L, V = z.shape
    g = torch.empty(B, L, V, dtype=z.dtype, device=z.device)
    if B * L:
        _soft_ce_bwd[(B * L,)](
            z,
            tgt,
            t_lse,
            w,
            lse,
            sum_p,
            grad_out,
            g,
            L,
            V,
            z.stride(0),
            z.stride(1),
            tgt.stride(0),
            tgt.stride(1),
            t_lse.stride(0),
            t_lse.stride(1),
            w.stride(0),
            w.stride(1),
            g.stride(0),
            g.stride(1),
            BLOCK=_block(V),
            num_warps=8,
        )
    return g


# --------------------------------------------------------------------------------------
# The target distribution from the target head's full-vocab logits
# --------------------------------------------------------------------------------------
@triton.jit
def _teacher_rows(LOGITS, IDS, OUT, LSE, ARG, V, VD, l_s, o_s, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * l_s
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.full([], 0, tl.int64)
    for start in range(0, V, BLOCK):  # the argmax over the whole vocab
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        block_max = tl.max(x, 0)
        i = tl.argmax(x, 0).to(tl.int64)
        take = block_max > best
        best_i = tl.where(take, start + i, best_i)
        best = tl.where(take, block_max, best)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    for start in range(0, VD, BLOCK):  # the draft vocab's logits, gathered, and their log-sum-exp
        j = start + tl.arange(0, BLOCK)
        inside = j < VD
        ids = tl.load(IDS + j, mask=inside, other=0)
        x = tl.load(base + ids, mask=inside, other=float("-inf"))
        tl.store(OUT + row * o_s + j, x, mask=inside)
        xf = x.to(tl.float32)
        m_new = tl.maximum(m, tl.max(xf, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(xf - m_new), 0)
        m = m_new
    tl.store(LSE + row, m + tl.log(s))
    tl.store(ARG + row, best_i)


def teacher_rows(full, draft_ids, logits, lse, argmax):
    """full (n, V) target logits -> into logits (n, Vd) (the draft ids' columns, full's dtype),
    lse (n,) float32 of those, argmax (n,) int64 over all V. One pass per row."""
    n, V = full.shape
    assert full.stride(-1) == 1 and logits.stride(-1) == 1
    if n:
        _teacher_rows[(n,)](
            full,
            draft_ids,
            logits,
            lse,
            argmax,
            V,
            len(draft_ids),
            full.stride(0),
            logits.stride(0),
            BLOCK=4096,
            num_warps=8,
        )


# --------------------------------------------------------------------------------------
# The chain keys of TTT, merged into the prefix attention
# --------------------------------------------------------------------------------------
@triton.jit
def _rows(T, REP: tl.constexpr, REP_P: tl.constexpr, BT: tl.constexpr):
    """The program's rows: BT slots x the group's REP query heads (padded to REP_P), slot-major."""
    i = tl.arange(0, BT * REP_P)
    t = tl.program_id(0).to(tl.int64) * BT + i // REP_P
    r = i % REP_P
    return t, r, (t < T) & (r < REP)


@triton.jit
def _chain_fwd(
    Q,
    OP,
    LSEP,
    CK,
    CV,
    OUT,
    LSE,
    T,
    NKV,
    N,
    q_sb,
    q_st,
    q_sh,
    o_sb,
    o_st,
    o_sh,
    lp_sb,
    lp_sh,
    lp_st,
    c_sn,
    c_sb,
    c_st,
    c_sg,
    out_sb,
    out_st,
    out_sh,
    l_sb,
    l_sh,
    l_st,
    scale,
    REP: tl.constexpr,
    REP_P: tl.constexpr,
    HD: tl.constexpr,
    HD_P: tl.constexpr,
    BT: tl.constexpr,
):
    bg = tl.program_id(1).to(tl.int64)
    g, b = bg % NKV, bg // NKV
    t, r, valid = _rows(T, REP, REP_P, BT)
    d = tl.arange(0, HD_P)
    m2 = valid[:, None] & (d < HD)[None, :]
    h = g * REP + r  # the group's query heads
    q = tl.load(Q + b * q_sb + t[:, None] * q_st + h[:, None] * q_sh + d[None, :], mask=m2, other=0.0).to(tl.float32)
    acc = tl.load(OP + b * o_sb + t[:, None] * o_st + h[:, None] * o_sh + d[None, :], mask=m2, other=0.0).to(tl.float32)
    m = tl.load(LSEP + b * lp_sb + h * lp_sh + t * lp_st, mask=valid, other=0.0).to(tl.float32)
    l = tl.full([BT * REP_P], 1.0, tl.float32)  # the prefix enters as weight exp(lse_p - m) = 1, output o_p
    for j in range(N):
        base = j * c_sn + b * c_sb + t * c_st + g * c_sg  # the slot's chain key (shared by the group)
        kk = tl.load(CK + base[:, None] + d[None, :], mask=m2, other=0.0).to(tl.float32)
        vv = tl.load(CV + base[:, None] + d[None, :], mask=m2, other=0.0).to(tl.float32)
        s = tl.sum(q * kk, 1) * scale
        m_new = tl.maximum(m, s)
        alpha, beta = tl.exp(m - m_new), tl.exp(s - m_new)
        acc = acc * alpha[:, None] + beta[:, None] * vv
        l = l * alpha + beta
        m = m_new
    out = acc / l[:, None]
    tl.store(
        OUT + b * out_sb + t[:, None] * out_st + h[:, None] * out_sh + d[None, :], out.to(OUT.dtype.element_ty), mask=m2
    )
    tl.store(LSE + b * l_sb + h * l_sh + t * l_st, m + tl.log(l), mask=valid)


@triton.jit
def _chain_bwd(
    Q,
    DO,
    OUT,
    LSE,
    CK,
    CV,
    DQP,
    DQ,
    DCK,
    DCV,
    T,
    NKV,
    N,
    q_sb,
    q_st,
    q_sh,
    do_sb,
    do_st,
    do_sh,
    o_sb,
    o_st,
    o_sh,
    l_sb,
    l_sh,
    l_st,
    c_sn,
    c_sb,
    c_st,
    c_sg,
    dqp_sb,
    dqp_st,
    dqp_sh,
    dq_sb,
    dq_st,
    dq_sh,
    scale,
    REP: tl.constexpr,
    REP_P: tl.constexpr,
    HD: tl.constexpr,
    HD_P: tl.constexpr,
    BT: tl.constexpr,
):
    bg = tl.program_id(1).to(tl.int64)
    g, b = bg % NKV, bg // NKV
    t, r, valid = _rows(T, REP, REP_P, BT)
    d = tl.arange(0, HD_P)
    dm = d < HD
    m2 = valid[:, None] & dm[None, :]
    h = g * REP + r
    q = tl.load(Q + b * q_sb + t[:, None] * q_st + h[:, None] * q_sh + d[None, :], mask=m2, other=0.0).to(tl.float32)
    do = tl.load(DO + b * do_sb + t[:, None] * do_st + h[:, None] * do_sh + d[None, :], mask=m2, other=0.0).to(
        tl.float32
    )
    o = tl.load(OUT + b * o_sb + t[:, None] * o_st + h[:, None] * o_sh + d[None, :], mask=m2, other=0.0).to(tl.float32)
    lse = tl.load(LSE + b * l_sb + h * l_sh + t * l_st, mask=valid, other=0.0).to(tl.float32)
    dq = tl.load(DQP + b * dqp_sb + t[:, None] * dqp_st + h[:, None] * dqp_sh + d[None, :], mask=m2, other=0.0).to(
        tl.float32
    )
    delta = tl.sum(do * o, 1)
    ts = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)  # the program's slots, one row each
    ms = (ts < T)[:, None] & dm[None, :]
    for j in range(N):
        base = j * c_sn + b * c_sb + t * c_st + g * c_sg
        kk = tl.load(CK + base[:, None] + d[None, :], mask=m2, other=0.0).to(tl.float32)
        vv = tl.load(CV + base[:, None] + d[None, :], mask=m2, other=0.0).to(tl.float32)
        p = tl.where(valid, tl.exp(tl.sum(q * kk, 1) * scale - lse), 0.0)
        ds = p * (tl.sum(do * vv, 1) - delta)
        dq += ds[:, None] * kk * scale
        # the key's and value's gradients: summed over the group's heads (rows of one slot)
        dk = tl.sum(tl.reshape(ds[:, None] * q, (BT, REP_P, HD_P)), 1) * scale
        dv = tl.sum(tl.reshape(p[:, None] * do, (BT, REP_P, HD_P)), 1)
        slot = j * c_sn + b * c_sb + ts * c_st + g * c_sg
        tl.store(DCK + slot[:, None] + d[None, :], dk.to(DCK.dtype.element_ty), mask=ms)
        tl.store(DCV + slot[:, None] + d[None, :], dv.to(DCV.dtype.element_ty), mask=ms)
    tl.store(DQ + b * dq_sb + t[:, None] * dq_st + h[:, None] * dq_sh + d[None, :], dq.to(DQ.dtype.element_ty), mask=m2)


CHAIN_SLOTS = 8  # slots per program of the chain kernels (x the group's heads x head dim per tile)


def _heads(q, ck):
    nh, hd, nkv = q.shape[1], q.shape[3], ck.shape[3]
    rep = nh // nkv
    return nkv, rep, dict(REP=rep, REP_P=triton.next_power_of_2(rep), HD=hd, HD_P=triton.next_power_of_2(hd))


def _bthd(x):
    """Strides (batch, slot, head) of a (B, heads, T, hd) tensor whose last dim is contiguous."""
    assert x.stride(-1) == 1, "the head dimension must be contiguous"
    return x.stride(0), x.stride(2), x.stride(1)


def chain_merge_forward(q, o_p, lse_p, ck, cv, scale):
    """q, o_p (B, nh, T, hd); lse_p (B, nh, T) fp32; ck, cv (n, B, T, nkv, hd) -> out (B, nh, T, hd)
    (stored slot-major, as flash stores its output), lse (B, nh, T) fp32."""
    B, nh, T, hd = q.shape
    ck, cv = ck.contiguous(), cv.contiguous()
    nkv, rep, meta = _heads(q, ck)
    out = torch.empty(B, T, nh, hd, dtype=q.dtype, device=q.device).transpose(1, 2)
    lse = torch.empty(B, nh, T, dtype=torch.float32, device=q.device)
    if B * T:
        grid = (triton.cdiv(T, CHAIN_SLOTS), B * nkv)
        _chain_fwd[grid](
            q,
            o_p,
            lse_p,
            ck,
            cv,
            out,
            lse,
            T,
            nkv,
            ck.shape[0],
            *_bthd(q),
            *_bthd(o_p),
            *lse_p.stride(),
            *ck.stride()[:4],
            *_bthd(out),
            *lse.stride(),
            scale,
            **meta,
            BT=CHAIN_SLOTS,
            num_warps=4,
        )
    return out, lse


def chain_merge_backward(dout, q, out, lse, ck, cv, dq_prefix, scale):
    B, nh, T, hd = q.shape
    ck, cv = ck.contiguous(), cv.contiguous()
    nkv, rep, meta = _heads(q, ck)
    dq = torch.empty(B, T, nh, hd, dtype=q.dtype, device=q.device).transpose(1, 2)
    dck, dcv = torch.empty_like(ck), torch.empty_like(cv)
    if B * T:
        grid = (triton.cdiv(T, CHAIN_SLOTS), B * nkv)
        _chain_bwd[grid](
            q,
            dout,
            out,
            lse,
            ck,
            cv,
            dq_prefix,
            dq,
            dck,
            dcv,
            T,
            nkv,
            ck.shape[0],
            *_bthd(q),
            *_bthd(dout),
            *_bthd(out),
            *lse.stride(),
            *ck.stride()[:4],
            *_bthd(dq_prefix),
            *_bthd(dq),
            scale,
            **meta,
            BT=CHAIN_SLOTS,
            num_warps=8,
        )
    return dq, dck, dcv
