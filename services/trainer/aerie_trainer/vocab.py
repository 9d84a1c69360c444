"""The draft vocabulary: the target tokens the drafter can propose.

- From what the target says (`draft_vocab_from: "target"`, the default): the tokens the target
  itself predicts greedily at the trained positions, most frequent first — exactly the tokens a
  chain of drafts must match — then the data's own trained tokens by frequency for any rows left;
  or from the data alone (`"data"`: the loss-masked tokens of the runs, as EAGLE-3's recipe does).
  Sorted by target id; when the runs hold fewer distinct tokens, the lowest unused ids fill the
  rest so the head always has exactly `draft_vocab_size` rows (SGLang sizes it from the config).
- `d2t[i] = target_id - i` (int64; SGLang's `hot_token_id = d2t + arange`), `t2d[target_id]`
  True for the draft tokens (bool over the target vocab).
- A position whose target argmax is outside the draft vocab is masked from the loss: the
  drafter cannot propose that token, so there is nothing to learn there.
"""

from __future__ import annotations

import numpy as np
import torch


class VocabError(ValueError):
    pass


def draft_vocab_size(requested: int, target_vocab: int) -> int:
    """TrainConfig.draft_vocab_size, capped at the target's vocab."""
    return min(int(requested), int(target_vocab))


def build_draft_vocab(counts: np.ndarray, size: int) -> torch.Tensor:
    """counts (V,) loss-token frequencies -> draft ids (Vd,) int64, sorted target ids."""
    V = len(counts)
    if not 1 <= size <= V:
        raise VocabError(f"draft_vocab_size {size} must be between 1 and the target vocab {V}")
    if counts.sum() == 0:
        raise VocabError("no loss-masked token in the training data: check the runs' loss masks")
    # most frequent first; ties broken by the lower id (stable sort on -count)
    order = np.argsort(-counts, kind="stable")
    chosen = order[:size]
    return torch.from_numpy(np.sort(chosen).astype(np.int64))


def d2t_t2d(draft_ids: torch.Tensor, target_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    d2t = draft_ids - torch.arange(len(draft_ids), dtype=torch.int64)
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d


def target_to_draft(t2d: torch.Tensor) -> torch.Tensor:
    """(V,) int64: draft index of each target id, -1 outside the draft vocab."""
    index = torch.full(t2d.shape, -1, dtype=torch.int64, device=t2d.device)
    index[t2d] = torch.arange(int(t2d.sum()), dtype=torch.int64, device=t2d.device)
    return index


def ranked_counts(target_counts: np.ndarray | None, data_counts: np.ndarray) -> np.ndarray:
    """One ranking: the target's greedy tokens first (by count), then the data's trained tokens."""
    if target_counts is None or target_counts.sum() == 0:
        return data_counts.astype(np.float64)
    return target_counts.astype(np.float64) + data_counts / (data_counts.sum() + 1.0)


def target_argmax(lm_head: torch.Tensor | None, device: torch.device, chunk: int = 4096):
    """rows -> the target's greedy token ids: `final` rows through the target's lm_head (V, H), on
    `device`, in chunks; `topk` rows by their largest log-prob."""

    def argmax(rows: dict) -> np.ndarray:
        if "final" in rows:
            if lm_head is None:
                raise VocabError("a final-state run needs the target's lm_head to find its greedy tokens")
            h = torch.from_numpy(np.asarray(rows["final"], dtype=np.float32))
            return torch.cat(
                [(c.to(device, lm_head.dtype) @ lm_head.T).argmax(-1).cpu() for c in h.split(chunk)]
            ).numpy()
        ids, lp = np.asarray(rows["topk_ids"]), np.asarray(rows["topk_logprobs"], dtype=np.float32)
        return np.take_along_axis(ids, lp.argmax(-1)[:, None], axis=1)[:, 0]

    return argmax


def choose_draft_vocab(
    data,
    size: int,
    vocab_size: int,
    source: str,
    lm_head: torch.Tensor | None,
    device: torch.device,
    sample_tokens: int,
) -> tuple[torch.Tensor, float, str]:
    """(draft ids, coverage, what the coverage counts). `data`: the trainer's HiddenData.

    "target": ranked by the target's greedy tokens at up to `sample_tokens` trained positions
    (then the data's tokens); coverage = the share of those greedy tokens the vocab holds.
    "data": the trained tokens of the data; coverage = their share."""
    data_counts = data.loss_token_counts(vocab_size)
    if source == "target":
        target_counts = data.target_token_counts(vocab_size, target_argmax(lm_head, device), sample_tokens)
        draft_ids = build_draft_vocab(ranked_counts(target_counts, data_counts), size)
        if target_counts.sum():
            return draft_ids, coverage(target_counts, draft_ids), "target greedy tokens"
    draft_ids = build_draft_vocab(data_counts.astype(np.float64), size)
    return draft_ids, coverage(data_counts, draft_ids), "trained data tokens"


def coverage(counts: np.ndarray, draft_ids: torch.Tensor) -> float:
    """Fraction of loss tokens whose id is in the draft vocab."""
    return float(counts[draft_ids.numpy()].sum() / max(counts.sum(), 1))
