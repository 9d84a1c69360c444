"""Training-time test (TTT): the drafter unrolled over its own drafts, and the loss it learns from.

Step 0 runs the drafter over the whole sequence from the target's captured states; step k feeds
back the drafter's own hidden output of step k-1 with the next ground-truth token, attending to
the base sequence causally plus its own chain (the keys of steps 1..k at the same slot) —
exactly what chain drafting sees at serving time (the tests check the equivalence). Loss: soft
cross-entropy to the target distribution over the draft vocab, step k weighted by decay^k.

- `TargetHead`: a batch's target signal (final state or top-k log-probs) -> the distribution
  over the draft vocab, the target's argmax, and which slots are trainable.
- `TTT`: the unrolled module (one forward per batch; what DDP wraps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from aerie_trainer.data import Batch
from aerie_trainer.model import Eagle3Drafter
from aerie_trainer.vocab import target_to_draft


# --------------------------------------------------------------------------------------
# The target distribution
# --------------------------------------------------------------------------------------
class TargetHead:
    """Turns a batch's target signal into (p over the draft vocab, target argmax, trainable)."""

    def __init__(self, lm_head: torch.Tensor | None, t2d: torch.Tensor, d2t: torch.Tensor, dtype: torch.dtype):
        self.weight = None if lm_head is None else lm_head.to(dtype)  # (V, H) frozen
        self.t2d = t2d
        self.draft_ids = torch.arange(len(d2t), device=d2t.device) + d2t  # (Vd,) target ids
        self.to_draft = target_to_draft(t2d)  # (V,) draft index or -1

    @torch.no_grad()
    def __call__(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> p (B, W, Vd) float32, argmax (B, W) target ids (-1 unused), mask (B, W) bool."""
        rows = batch.loss_mask  # only trained slots need a distribution
        B, W = rows.shape
        Vd = len(self.draft_ids)
        if batch.final is not None:
            if self.weight is None:
                raise ValueError("shards carry the final state but no target lm_head was loaded")
            h = batch.final[rows].to(self.weight.dtype)  # (N, H)
            argmax, p = [], []
            for chunk in h.split(2048):
                logits = chunk @ self.weight.T  # (n, V)
                argmax.append(logits.argmax(-1))
                p.append(torch.softmax(logits[:, self.draft_ids].float(), dim=-1))
            argmax = torch.cat(argmax) if argmax else h.new_zeros(0, dtype=torch.int64)
            p = torch.cat(p) if p else h.new_zeros(0, Vd, dtype=torch.float32)
        else:
            ids, lp = batch.topk_ids[rows], batch.topk_logprobs[rows]  # (N, k)
            argmax = ids.gather(1, lp.argmax(-1, keepdim=True)).squeeze(1)
            d = self.to_draft[ids]  # (N, k)
            p = torch.zeros(len(ids), Vd, device=ids.device)
            p.scatter_add_(1, d.clamp(min=0), lp.exp() * (d >= 0))
            p = p / p.sum(-1, keepdim=True).clamp(min=1e-12)
        P = torch.zeros(B, W, Vd, device=rows.device)
        P[rows] = p
        ARG = torch.full((B, W), -1, dtype=torch.int64, device=rows.device)
        ARG[rows] = argmax
        mask = torch.zeros(B, W, dtype=torch.bool, device=rows.device)
        mask[rows] = self.t2d[argmax]  # the drafter cannot propose tokens outside its vocab
        return P, ARG, mask


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
    """The drafter unrolled for `steps` draft steps; one forward per batch (what DDP wraps)."""

    def __init__(self, drafter: Eagle3Drafter, steps: int, decay: float):
        super().__init__()
        self.drafter, self.steps, self.decay = drafter, steps, decay

    def forward(self, input_ids, aux, p, argmax, trainable, loss_mask, keep_logits: list | None = None):
        """input_ids (B, W), aux (B, L, K*Ht), p (B, W, Vd), argmax/trainable/loss_mask (B, W); W = L + S.

        keep_logits: a list that receives each step's logits (B, L, Vd) (tests, inspection).
        """
        drafter, L = self.drafter, aux.shape[1]
        hidden = drafter.project(aux.to(drafter.fc.weight.dtype))  # (B, L, H)
        slots = torch.arange(L, device=hidden.device)
        causal = torch.ones(L, L, dtype=torch.bool, device=hidden.device).tril()  # (L, L)
        base, chain = None, []
        loss, step_loss, correct, valid = 0.0, [], [], []
        for k in range(self.steps):
            ids = input_ids[:, k : k + L]  # (B, L): x[t+1+k]
            if k == 0:
                logits, hidden, base = drafter(ids, hidden, slots)
            else:
                logits, hidden, kv = drafter(ids, hidden, slots + k, prefix=base, prefix_mask=causal, chain=chain)
                chain.append(kv)
            if keep_logits is not None:
                keep_logits.append(logits.detach())
            m = trainable[:, k : k + L]  # (B, L)
            logp = F.log_softmax(logits.float(), dim=-1)  # (B, L, Vd)
            ce = -(p[:, k : k + L] * logp).sum(-1)  # (B, L)
            step_loss.append((ce * m).sum() / m.sum().clamp(min=1))
            loss = loss + self.decay**k * step_loss[-1]
            with torch.no_grad():
                guess = drafter.draft_to_target(logits.argmax(-1))  # (B, L) target ids
                correct.append((guess == argmax[:, k : k + L]) & m)
                valid.append(loss_mask[:, k : k + L])
        return loss, torch.stack(step_loss).detach(), torch.stack(correct), torch.stack(valid)


def ttt_forward(model: torch.nn.Module, batch: Batch, target: TargetHead) -> TTTOutput:
    """model: a TTT module (or DDP around one)."""
    p, argmax, trainable = target(batch)
    return TTTOutput(*model(batch.input_ids, batch.aux, p, argmax, trainable, batch.loss_mask))
