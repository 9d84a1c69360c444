"""Training-time test (TTT): the drafter unrolled over its own drafts, and the loss it learns from.

Step 0 runs the drafter over the whole sequence from the target's captured states; step k feeds
back the drafter's own hidden output of step k-1 with the next ground-truth token, attending to
the base sequence causally plus its own chain (the keys of steps 1..k at the same slot) —
exactly what chain drafting sees at serving time (the tests check the equivalence). Loss: soft
cross-entropy to the target distribution over the draft vocab, step k weighted by decay^k.

- `TargetHead`: a batch's target signal (final state or top-k log-probs) -> the distribution
  over the draft vocab (`TargetDist`: logits and their log-sum-exp, computed once per batch, in
  the layout the loss reads: (B, W, Vd), step k reads slots k..k+L), the target's argmax, and
  which slots are trainable. No host sync on a GPU: every slot is computed, masks applied after.
- `TTT`: the unrolled module (one forward per batch; what DDP wraps). On a GPU it computes in
  bf16 from the float32 parameters, each weight cast once per forward (aerie_trainer.precision);
  the loss is aerie_trainer.loss (never a (rows, Vd) float32 tensor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aerie_trainer.data import Batch
from aerie_trainer.loss import soft_cross_entropy
from aerie_trainer.model import Eagle3Drafter
from aerie_trainer.precision import acc_dtype, checkpointed, triton_available, weights_cast_once
from aerie_trainer.vocab import target_to_draft


# --------------------------------------------------------------------------------------
# The target distribution
# --------------------------------------------------------------------------------------
@dataclass
class TargetDist:
    """The target's distribution over the draft vocab: p = exp(logits - lse)."""

    logits: torch.Tensor  # (B, W, Vd): the head's logits (its dtype) or float32 log-probs (top-k)
    lse: torch.Tensor  # (B, W) float32 (float64 for float64 logits)

    def probs(self) -> torch.Tensor:
        """(B, W, Vd) probabilities (tests, inspection; the loss never forms them all at once)."""
        acc = acc_dtype(self.logits.dtype)
        return torch.exp(self.logits.to(acc) - self.lse.to(acc)[..., None])


class TargetHead:
    """Turns a batch's target signal into (TargetDist, target argmax, trainable)."""

    CHUNK_ROWS = 2048  # rows of full-vocab logits at a time (2048 x 128k bf16 = 0.5 GB)

    def __init__(self, lm_head: torch.Tensor | None, t2d: torch.Tensor, d2t: torch.Tensor, dtype: torch.dtype):
        self.weight = None if lm_head is None else lm_head.to(dtype)  # (V, H) frozen
        self.t2d = t2d
        self.draft_ids = torch.arange(len(d2t), device=d2t.device) + d2t  # (Vd,) target ids
        self.to_draft = target_to_draft(t2d)  # (V,) draft index or -1
        self.select_rows: bool | None = None  # compute only loss-masked slots (None: on the CPU only)

    @torch.no_grad()
    def __call__(self, batch: Batch) -> tuple[TargetDist, torch.Tensor, torch.Tensor]:
        """-> TargetDist (B, W, Vd), argmax (B, W) target ids (-1 unused), trainable (B, W) bool."""
        rows = batch.loss_mask.reshape(-1)  # only trained slots need a distribution
        B, W = batch.loss_mask.shape
        # a GPU computes every slot (choosing the trained ones would be a host sync), the CPU only
        # the trained ones (its time goes to the head's matmul); the others get weight 0 anyway
        select = not rows.is_cuda if self.select_rows is None else self.select_rows
        chosen = rows.nonzero().squeeze(1) if select else None
        if batch.final is not None:
            if self.weight is None:
                raise ValueError("shards carry the final state but no target lm_head was loaded")
            h = batch.final.reshape(B * W, -1)
            logits, lse, argmax = self._from_final(h if chosen is None else h[chosen])
        else:
            ids, lp = batch.topk_ids.reshape(B * W, -1), batch.topk_logprobs.reshape(B * W, -1)  # (N, k)
            if chosen is not None:
                ids, lp = ids[chosen], lp[chosen]
            logits, lse, argmax = self._from_topk(ids, lp)
        if chosen is not None:  # back to every slot
            logits = logits.new_zeros(B * W, logits.shape[1]).index_copy_(0, chosen, logits)
            lse = lse.new_zeros(B * W).index_copy_(0, chosen, lse)
            argmax = argmax.new_zeros(B * W).index_copy_(0, chosen, argmax)
        argmax = torch.where(rows, argmax, -1)
        trainable = rows & self.t2d[argmax.clamp(min=0)]  # the drafter cannot propose tokens outside its vocab
        return TargetDist(logits.view(B, W, -1), lse.view(B, W)), argmax.view(B, W), trainable.view(B, W)

    def _from_final(self, h: torch.Tensor):
        """h (N, H) final states -> draft-vocab logits (N, Vd), their lse, full-vocab argmax (N,)."""
        N, Vd = h.shape[0], len(self.draft_ids)
        logits = torch.empty(N, Vd, dtype=self.weight.dtype, device=h.device)
        lse = torch.empty(N, dtype=acc_dtype(self.weight.dtype), device=h.device)
        argmax = torch.empty(N, dtype=torch.int64, device=h.device)
        fused = h.is_cuda and triton_available() and lse.dtype == torch.float32
        for start in range(0, N, self.CHUNK_ROWS):
            part = slice(start, start + self.CHUNK_ROWS)
            full = h[part].to(self.weight.dtype) @ self.weight.T  # (n, V)
            if fused:  # one pass over each row (aerie_trainer.kernels)
                from aerie_trainer import kernels

                kernels.teacher_rows(full, self.draft_ids, logits[part], lse[part], argmax[part])
                continue
            argmax[part] = full.argmax(-1)
            torch.index_select(full, 1, self.draft_ids, out=logits[part])
            lse[part] = torch.logsumexp(logits[part].to(lse.dtype), -1)
        return logits, lse, argmax

    def _from_topk(self, ids: torch.Tensor, lp: torch.Tensor):
        """ids/lp (N, k) top-k target ids and log-probs -> float32 log-probs over the draft vocab
        (the top-k renormalised to its draft tokens; -inf elsewhere), their lse, the argmax."""
        argmax = ids.gather(1, lp.argmax(-1, keepdim=True)).squeeze(1)
        d = self.to_draft[ids]  # (N, k)
        p = torch.zeros(len(ids), len(self.draft_ids), dtype=torch.float32, device=ids.device)
        p.scatter_add_(1, d.clamp(min=0), lp.float().exp() * (d >= 0))
        logits = p.log()
        lse = torch.logsumexp(logits, -1)
        return logits, torch.where(torch.isfinite(lse), lse, 0.0), argmax  # a slot with no draft token: p = 0


# --------------------------------------------------------------------------------------
# Training-time test
# --------------------------------------------------------------------------------------
@dataclass
class TTTOutput:
    loss: torch.Tensor  # weighted sum over steps
    step_loss: torch.Tensor  # (S,)
    correct: torch.Tensor  # (S, B, L) bool: draft top-1 == target argmax, at a trainable slot
    valid: torch.Tensor  # (S, B, L) bool: the slot has a loss-masked target at that step


class TTT(torch.nn.Module):
    """The drafter unrolled for `steps` draft steps; one forward per batch (what DDP wraps).

    compute_dtype: the activations' dtype (None: the parameters'); cast_once: cast each weight to
    it once per forward (off under FSDP, whose modules gather their weights at each call).
    checkpoint: activation checkpointing per draft step — each step (the drafter layer, its
    logits and its loss) keeps only what the next steps read (its hidden output and keys/values)
    and is recomputed in backward: the (tokens x draft vocab) logits and the layer's
    intermediates of one step at a time instead of all steps' (BENCHMARKS.md, "Kimi-scale
    training memory"). Same loss and gradients; about one more forward of the layer per step."""

    def __init__(
        self,
        drafter: Eagle3Drafter,
        steps: int,
        decay: float,
        compute_dtype: torch.dtype | None = None,
        cast_once: bool = True,
        checkpoint: bool = False,
    ):
        super().__init__()
        self.drafter, self.steps, self.decay = drafter, steps, decay
        self.compute_dtype, self.cast_once, self.checkpoint = compute_dtype, cast_once, checkpoint

    def forward(
        self, input_ids, aux, target_logits, target_lse, argmax, trainable, loss_mask, keep_logits: list | None = None
    ):
        """input_ids (B, W), aux (B, L, K*Ht), target_logits (B, W, Vd) / target_lse (B, W) (a
        TargetDist), argmax/trainable/loss_mask (B, W); W = L + S.

        keep_logits: a list that receives each step's logits (B, L, Vd) (tests, inspection).
        """
        drafter, L = self.drafter, aux.shape[1]
        dtype = self.compute_dtype or drafter.fc.weight.dtype
        keep = keep_logits is not None
        with weights_cast_once(self.cast_once and dtype != drafter.fc.weight.dtype):
            hidden = drafter.project(aux.to(dtype))  # (B, L, H)
            slots = torch.arange(L, device=hidden.device)
            base, chain = None, []
            loss, step_loss, correct, valid = 0.0, [], [], []
            for k in range(self.steps):
                m = trainable[:, k : k + L]  # (B, L)
                run = _Step(drafter, k, keep)
                args = (
                    input_ids[:, k : k + L],
                    hidden,
                    slots,
                    target_logits[:, k : k + L],
                    target_lse[:, k : k + L],
                    m,
                )
                if k:
                    args += (*base, *(t for kv in chain for t in kv))
                step, guess, hidden, kv, logits = (checkpointed(run) if self.checkpoint else run)(*args)
                if k == 0:
                    base = kv
                else:
                    chain.append(kv)
                if keep:
                    keep_logits.append(logits)
                step_loss.append(step)
                loss = loss + self.decay**k * step
                with torch.no_grad():
                    correct.append((drafter.draft_to_target(guess) == argmax[:, k : k + L]) & m)
                    valid.append(loss_mask[:, k : k + L])
        return loss, torch.stack(step_loss).detach(), torch.stack(correct), torch.stack(valid)


class _Step:
    """One draft step as a function of tensors only (what activation checkpointing recomputes):
    (ids, hidden, slots, target logits, target lse, trainable[, base k, v, chain k, v ...]) ->
    (weighted loss, top-1, hidden out, kv, logits or None)."""

    def __init__(self, drafter: Eagle3Drafter, k: int, keep: bool):
        self.drafter, self.k, self.keep = drafter, k, keep

    def __call__(self, ids, hidden, slots, t_logits, t_lse, m, *kvs):
        if self.k == 0:
            logits, hidden, kv = self.drafter(ids, hidden, slots)
        else:
            chain = [(kvs[i], kvs[i + 1]) for i in range(2, len(kvs), 2)]
            logits, hidden, kv = self.drafter(ids, hidden, slots + self.k, prefix=(kvs[0], kvs[1]), chain=chain)
        weight = m.to(acc_dtype(logits.dtype)) / m.sum().clamp(min=1)
        step, guess = soft_cross_entropy(logits, t_logits, t_lse, weight)
        return step, guess, hidden, kv, logits.detach() if self.keep else None


def ttt_forward(model: torch.nn.Module, batch: Batch, target: TargetHead) -> TTTOutput:
    """model: a TTT module (or DDP around one)."""
    dist, argmax, trainable = target(batch)
    return TTTOutput(*model(batch.input_ids, batch.aux, dist.logits, dist.lse, argmax, trainable, batch.loss_mask))
