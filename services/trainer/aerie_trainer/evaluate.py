"""How good a drafter is: held-out top-1 accuracy per draft step, and real speculative decoding.

- `heldout_metrics`: the TTT unroll on held-out batches; per-step top-1 accuracy against the
  target's argmax and the *simulated* acceptance length of a chain of `ttt_steps` drafts under
  greedy verification (1 + the number of leading steps that are all correct).
- `speculative_generate`: greedy speculative decoding with the target in transformers. The
  drafter proposes a chain of `draft_tokens` (topk 1), the target verifies it in one forward,
  the longest matching prefix is accepted plus one bonus token from the target. The drafter
  reads the target's states at the run's capture points (`output_hidden_states[k]`), exactly
  what SGLang hands an EAGLE-3 drafter. Output equals plain greedy decoding.
- Acceptance length = completion_tokens / verify_count, SGLang's `spec_accept_length`
  (the first token comes from prefill and is not a verify).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from aerie.capture import hf_hidden_state_indices
from aerie.contracts import TrainConfig

from aerie_trainer.data import HiddenData
from aerie_trainer.model import Eagle3Drafter
from aerie_trainer.ttt import TTT, TargetHead, ttt_forward


# --------------------------------------------------------------------------------------
# Held-out TTT metrics
# --------------------------------------------------------------------------------------
@torch.no_grad()
def heldout_metrics(ttt: TTT, batches, target: TargetHead) -> dict:
    """batches: iterable of data.Batch."""
    device = ttt.drafter.fc.weight.device
    loss_sum, n_batches = 0.0, 0
    correct = valid = None
    accept_sum, accept_n = 0.0, 0
    for batch in batches:
        out = ttt_forward(ttt, batch.to(device), target)
        loss_sum += float(out.loss)
        n_batches += 1
        c, v = out.correct.sum((1, 2)).double(), out.valid.sum((1, 2)).double()
        correct = c if correct is None else correct + c
        valid = v if valid is None else valid + v
        start = out.valid[0]  # (B, L) slots with a step-0 target
        run = torch.cumprod(out.correct.to(torch.int64), dim=0)  # (S, B, L): all steps so far correct
        accept_sum += float((1 + run.sum(0))[start].sum())
        accept_n += int(start.sum())
    if n_batches == 0 or accept_n == 0:
        return {}
    acc = (correct / valid.clamp(min=1)).tolist()
    return {
        "heldout_loss": loss_sum / n_batches,
        "heldout_acc": [round(a, 4) for a in acc],
        "simulated_acceptance": accept_sum / accept_n,
    }


# --------------------------------------------------------------------------------------
# Speculative decoding with the target in transformers
# --------------------------------------------------------------------------------------
def load_target(model_dir: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    from transformers import AutoModelForCausalLM

    dtype = dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device)
    model.eval()
    return model


def eos_token_ids(model_dir: str | os.PathLike) -> list[int]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            ids += eos if isinstance(eos, list) else [] if eos is None else [eos]
    return sorted(set(ids))


def _aux(out, indices: list[int]) -> torch.Tensor:
    """transformers output -> (1, T, K*H) states at the capture points."""
    return torch.cat([out.hidden_states[i] for i in indices], dim=-1)


@torch.no_grad()
def greedy_generate(target, prompt_ids: list[int], max_new_tokens: int, eos_ids: list[int] = ()) -> list[int]:
    """Plain greedy decoding with a KV cache: the reference speculative decoding must equal."""
    from transformers import DynamicCache

    device = next(target.parameters()).device
    cache = DynamicCache()
    ids = torch.tensor([prompt_ids], device=device)
    out_ids: list[int] = []
    while len(out_ids) < max_new_tokens:
        logits = target(input_ids=ids, past_key_values=cache, use_cache=True).logits
        tok = int(logits[0, -1].argmax())
        out_ids.append(tok)
        if tok in eos_ids:
            break
        ids = torch.tensor([[tok]], device=device)
    return out_ids


@torch.no_grad()
def speculative_generate(target, drafter: Eagle3Drafter, prompt_ids: list[int], capture_points: list[int],
                         max_new_tokens: int, draft_tokens: int, eos_ids: list[int] = ()) -> tuple[list[int], int]:
    """-> (completion token ids, verify count). Greedy, chain drafts (topk 1)."""
    from transformers import DynamicCache

    device = next(target.parameters()).device
    dtype = drafter.fc.weight.dtype
    indices = hf_hidden_state_indices(capture_points, target.config.num_hidden_layers)
    cache = DynamicCache()
    out = target(input_ids=torch.tensor([prompt_ids], device=device), past_key_values=cache, use_cache=True, output_hidden_states=True)
    tokens = list(prompt_ids) + [int(out.logits[0, -1].argmax())]
    completion = [tokens[-1]]
    new_aux = _aux(out, indices)  # (1, n, K*H): target rows not yet seen by the drafter
    drafter_kv = None  # drafter keys of committed slots
    seen = 0  # slots (target rows) the drafter has read
    verify_count = 0
    while len(completion) < max_new_tokens and completion[-1] not in eos_ids:
        # 1. the drafter reads the new committed slots: slot t = (token t+1, target state t)
        n = seen + new_aux.shape[1]
        ids = torch.tensor([tokens[seen + 1 : n + 1]], device=device)
        logits, hidden, drafter_kv = drafter(ids, drafter.project(new_aux.to(dtype)), torch.arange(seen, n, device=device), past=drafter_kv)
        seen = n
        draft = [int(drafter.draft_to_target(logits[0, -1].argmax()))]
        hidden = hidden[:, -1:]  # (1, 1, H)
        # 2. chain: each draft step attends to every committed slot and to the chain so far
        chain = []
        everything = torch.ones(1, drafter_kv[0].shape[2], dtype=torch.bool, device=device)
        for j in range(1, draft_tokens):
            ids = torch.tensor([[draft[-1]]], device=device)
            logits, hidden, kv = drafter(ids, hidden, torch.tensor([n - 1 + j], device=device), prefix=drafter_kv, prefix_mask=everything, chain=chain)
            chain.append(kv)
            draft.append(int(drafter.draft_to_target(logits[0, -1].argmax())))
        # 3. verify: the last committed token and the drafts in one target forward
        verify = torch.tensor([[tokens[-1], *draft]], device=device)
        out = target(input_ids=verify, past_key_values=cache, use_cache=True, output_hidden_states=True)
        verify_count += 1
        greedy = out.logits[0].argmax(-1).tolist()  # greedy[i]: the target's token after verify[i]
        accepted = 0
        while accepted < len(draft) and draft[accepted] == greedy[accepted]:
            accepted += 1
        new_tokens = draft[:accepted] + [greedy[accepted]]
        if accepted < len(draft):  # drop the rejected drafts' keys (negative: tokens to remove)
            cache.crop(accepted - len(draft))
        new_aux = _aux(out, indices)[:, : accepted + 1]
        for tok in new_tokens:
            tokens.append(tok)
            completion.append(tok)
            if tok in eos_ids or len(completion) >= max_new_tokens:
                break
    return completion[:max_new_tokens], verify_count


def acceptance_length(target, drafter: Eagle3Drafter, prompts: list[list[int]], capture_points: list[int],
                      max_new_tokens: int, draft_tokens: int, eos_ids: list[int] = ()) -> dict:
    """SGLang's definition over a prompt set: sum(completion tokens) / sum(verify counts)."""
    per_prompt, completion, verifies = [], 0, 0
    for prompt in prompts:
        ids, n_verify = speculative_generate(target, drafter, prompt, capture_points, max_new_tokens, draft_tokens, eos_ids)
        per_prompt.append(len(ids) / max(n_verify, 1))
        completion += len(ids)
        verifies += n_verify
    return {
        "acceptance": completion / max(verifies, 1),
        "acceptance_per_prompt": [round(a, 4) for a in per_prompt],
        "completion_tokens": completion,
        "verify_count": verifies,
    }


def prompts_from_sequences(sequences: list[dict[str, np.ndarray]], max_prompt_tokens: int = 384) -> list[list[int]]:
    """A held-out conversation's prompt: its tokens before the first trained (assistant) token."""
    prompts = []
    for seq in sequences:
        trained = np.flatnonzero(seq["loss_mask"])
        if trained.size and 2 <= trained[0] <= max_prompt_tokens:
            prompts.append(seq["input_ids"][: trained[0]].astype(int).tolist())
    return prompts


def prompts_from_file(path_or_text: str, model_dir: str | os.PathLike) -> list[list[int]]:
    """JSONL lines {"prompt": str} or {"messages": [...]}, rendered with the target's chat template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = []
    for n, line in enumerate(path_or_text.splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        messages = rec.get("messages") or ([{"role": "user", "content": rec["prompt"]}] if "prompt" in rec else None)
        if messages is None:
            raise ValueError(f"line {n} of the eval prompts: needs a 'prompt' string or a 'messages' list")
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return prompts


# --------------------------------------------------------------------------------------
# What the trainer runs before and after training
# --------------------------------------------------------------------------------------
class Evaluator:
    """Held-out metrics and the speculative-decoding loop for one drafter, before and after
    training. It gets what it uses: the drafter, the target head, the data, the model folder."""

    HOLDOUT_BATCHES = 16

    def __init__(self, drafter: Eagle3Drafter, target: TargetHead, data: HiddenData, model_dir: str | os.PathLike,
                 capture_points: list[int], config: TrainConfig, device: torch.device, prompts_jsonl: str | None = None):
        """prompts_jsonl: eval prompts (JSONL text, see prompts_from_file); default: held-out conversations."""
        self.drafter, self.target, self.data, self.model_dir = drafter, target, data, str(model_dir)
        self.capture_points, self.cfg, self.device, self.prompts_jsonl = list(capture_points), config, device, prompts_jsonl
        self.ttt = TTT(drafter, config.ttt_steps, config.step_decay)
        self._target_model = None
        self._prompts: list[list[int]] | None = None

    def prompts(self) -> list[list[int]]:
        if self._prompts is None:
            n = self.cfg.eval_prompts
            if self.prompts_jsonl is not None:
                self._prompts = prompts_from_file(self.prompts_jsonl, self.model_dir)[:n]
            else:
                self._prompts = prompts_from_sequences(self.data.holdout_sequences(4 * n + 8))[:n]
        return self._prompts

    def run(self) -> dict:
        drafter = self.drafter
        was_training = drafter.training
        drafter.eval()
        try:
            metrics = heldout_metrics(self.ttt, self.data.holdout_batches(self.HOLDOUT_BATCHES), self.target)
            prompts = self.prompts() if self.cfg.eval_prompts else []
            if prompts:
                if self._target_model is None:
                    self._target_model = load_target(self.model_dir, self.device)
                spec = acceptance_length(self._target_model, drafter, prompts, self.capture_points,
                                         self.cfg.eval_new_tokens, self.cfg.eval_draft_tokens, eos_token_ids(self.model_dir))
                metrics.update(spec, eval_prompts=len(prompts))
            return metrics
        finally:
            drafter.train(was_training)
