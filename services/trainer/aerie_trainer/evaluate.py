"""How good a drafter is: held-out top-1 accuracy per draft step, and real speculative decoding.

- `heldout_metrics`: the TTT unroll on held-out batches; per-step top-1 accuracy against the
  target's argmax and the *simulated* acceptance length of a chain of `ttt_steps` drafts under
  greedy verification (1 + the number of leading steps that are all correct).
- `speculative_generate`: greedy speculative decoding with the target's forward done in
  transformers (`HFTarget`) or by an SGLang server in capture mode (`SGLangTarget`). The
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
from dataclasses import dataclass
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
    from aerie.target import hf_load_kwargs

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=dtype, use_safetensors=True, **hf_load_kwargs(model_dir)
    ).to(device)
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


class HFTarget:
    """The target's forward in transformers, with a KV cache (what `speculative_generate` verifies with)."""

    def __init__(self, model, capture_points: list[int]):
        from transformers import DynamicCache

        self.model, self.device = model, next(model.parameters()).device
        self.indices = hf_hidden_state_indices(capture_points, model.config.num_hidden_layers)
        self.cache = DynamicCache()

    def _forward(self, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
        out = self.model(
            input_ids=torch.tensor([ids], device=self.device),
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=True,
        )
        return _aux(out, self.indices), out.logits[0].argmax(-1).tolist()

    def prefill(self, prompt_ids: list[int]) -> tuple[torch.Tensor, list[int]]:
        """-> aux (1, n, K*H) at every prompt position, greedy[i] = the target's token after position i."""
        return self._forward(list(prompt_ids))

    def verify(self, tokens: list[int], draft: list[int]) -> tuple[torch.Tensor, list[int]]:
        """tokens: every committed token (the last not yet seen); -> the rows of [tokens[-1], *draft]."""
        return self._forward([tokens[-1], *draft])

    def keep(self, accepted: int, drafted: int) -> None:
        """Drop the rejected drafts' keys (negative crop: tokens to remove)."""
        if accepted < drafted:
            self.cache.crop(accepted - drafted)


@torch.no_grad()
def first_draft_right(
    model, drafter: Eagle3Drafter, sequences: list[list[int]], capture_points: list[int], zero_states: bool = False
) -> list[float]:
    """Teacher-forced, per sequence: the share of positions where the drafter's first draft is the
    target's greedy next token, given the target's states at `capture_points` (zeros of their
    shape with `zero_states`: what the drafter gets from the tokens alone). Slot j = (token j+1,
    state j) drafts the token after position j+1."""
    device, dtype = drafter.fc.weight.device, drafter.fc.weight.dtype
    shares = []
    for ids in sequences:
        aux, greedy = HFTarget(model, capture_points).prefill(ids)
        if zero_states:
            aux = torch.zeros_like(aux)
        t = len(ids) - 1
        logits, _, _ = drafter(
            torch.tensor([ids[1:]], device=device),
            drafter.project(aux[:, :t].to(device, dtype)),
            torch.arange(t, device=device),
        )
        drafts = drafter.draft_to_target(logits[0].argmax(-1)).tolist()
        shares.append(sum(d == g for d, g in zip(drafts, greedy[1:])) / t)
    return shares


@torch.no_grad()
def speculative_generate(
    target,
    drafter: Eagle3Drafter,
    prompt_ids: list[int],
    capture_points: list[int],
    max_new_tokens: int,
    draft_tokens: int,
    eos_ids: list[int] = (),
) -> tuple[list[int], int]:
    """-> (completion token ids, verify count). Greedy, chain drafts (topk 1).

    target: a transformers model, an HFTarget (fresh per prompt: it holds the KV cache) or an SGLangTarget."""
    if not hasattr(target, "verify"):
        target = HFTarget(target, capture_points)
    device = drafter.fc.weight.device
    dtype = drafter.fc.weight.dtype
    new_aux, greedy = target.prefill(prompt_ids)
    tokens = list(prompt_ids) + [greedy[-1]]
    completion = [tokens[-1]]
    drafter_kv = None  # drafter keys of committed slots
    seen = 0  # slots (target rows) the drafter has read
    verify_count = 0
    while len(completion) < max_new_tokens and completion[-1] not in eos_ids:
        # 1. the drafter reads the new committed slots: slot t = (token t+1, target state t)
        n = seen + new_aux.shape[1]
        ids = torch.tensor([tokens[seen + 1 : n + 1]], device=device)
        logits, hidden, drafter_kv = drafter(
            ids, drafter.project(new_aux.to(device, dtype)), torch.arange(seen, n, device=device), past=drafter_kv
        )
        seen = n
        draft = [int(drafter.draft_to_target(logits[0, -1].argmax()))]
        hidden = hidden[:, -1:]  # (1, 1, H)
        # 2. chain: each draft step attends to every committed slot and to the chain so far
        chain = []
        everything = torch.ones(1, drafter_kv[0].shape[2], dtype=torch.bool, device=device)
        for j in range(1, draft_tokens):
            ids = torch.tensor([[draft[-1]]], device=device)
            logits, hidden, kv = drafter(
                ids,
                hidden,
                torch.tensor([n - 1 + j], device=device),
                prefix=drafter_kv,
                prefix_mask=everything,
                chain=chain,
            )
            chain.append(kv)
            draft.append(int(drafter.draft_to_target(logits[0, -1].argmax())))
        # 3. verify: the last committed token and the drafts in one target forward
        aux, greedy = target.verify(tokens, draft)  # greedy[i]: the target's token after verify row i
        verify_count += 1
        accepted = 0
        while accepted < len(draft) and draft[accepted] == greedy[accepted]:
            accepted += 1
        new_tokens = draft[:accepted] + [greedy[accepted]]
        target.keep(accepted, len(draft))
        new_aux = aux[:, : accepted + 1]
        for tok in new_tokens:
            tokens.append(tok)
            completion.append(tok)
            if tok in eos_ids or len(completion) >= max_new_tokens:
                break
    return completion[:max_new_tokens], verify_count


class EvalError(RuntimeError):
    """An evaluation server that cannot give the run's target forward; the message says the fix."""


class SGLangTarget:
    """The target's forward done by an SGLang server in capture mode — the one the extractors use
    (`--enable-return-aux-hidden-states --return-aux-hidden-state-layer-ids <the run's ids>
    --disable-radix-cache`): no target weights in the trainer.

    Each call sends the whole sequence (`input_ids`, `max_new_tokens: 1`, greedy) and reads the
    aux states at every position (`meta_info.hidden_states[0]`, [T][K*H]) and the target's greedy
    token after every position: `input_top_logprobs[i]` (top-1) predicts token i, so the token after
    position j is entry j+1's, and after the last one the output step's. Stateless (the radix cache
    is off, every request is computed whole), so one instance serves every prompt. Cost: T*K*H
    floats as JSON per verify — fine for a few held-out prompts; the number of prompts and tokens
    are TrainConfig.eval_prompts / eval_new_tokens."""

    def __init__(
        self,
        url: str,
        layer_ids: list[int],
        num_aux: int,
        hidden_size: int,
        architecture: str | None = None,
        timeout_s: float = 600.0,
        api_key: str | None = None,
    ):
        self.api_key = api_key  # the server's --api-key (AERIE_ENGINE_API_KEY)
        self.url, self.layer_ids, self.K, self.H, self.timeout_s = (
            url.rstrip("/"),
            list(layer_ids),
            num_aux,
            hidden_size,
            timeout_s,
        )
        info = self._call("/server_info", None, fallback="/get_server_info")
        if not info.get("enable_return_aux_hidden_states"):
            raise EvalError(
                f"AERIE_EVAL_SERVER {self.url} is not in capture mode: start it with --enable-return-aux-hidden-states "
                f"--speculative-algorithm EAGLE3 --return-aux-hidden-state-layer-ids {' '.join(map(str, self.layer_ids))}"
            )
        served = [int(i) for i in info.get("return_aux_hidden_state_layer_ids") or []]
        if served != self.layer_ids:
            raise EvalError(
                f"AERIE_EVAL_SERVER {self.url} captures layer ids {served}, the run's capture points are layer ids "
                f"{self.layer_ids}: restart it with --return-aux-hidden-state-layer-ids {' '.join(map(str, self.layer_ids))}"
            )
        if not info.get("disable_radix_cache"):
            raise EvalError(
                f"AERIE_EVAL_SERVER {self.url} runs with its radix cache on (it would return states for uncached "
                "tokens only): restart it with --disable-radix-cache"
            )
        if architecture is not None:
            model = self._call("/model_info", None, fallback="/get_model_info")
            if architecture not in (model.get("architectures") or []):
                raise EvalError(
                    f"AERIE_EVAL_SERVER {self.url} serves {model.get('model_path')} ({model.get('architectures')}), "
                    f"the run's target is a {architecture}: serve the run's target"
                )

    def _call(self, path: str, payload: dict | None, fallback: str | None = None) -> dict:
        from aerie import sglang_client

        try:
            return sglang_client.call(
                self.url, path, payload, api_key=self.api_key, timeout_s=self.timeout_s, setting="AERIE_EVAL_SERVER"
            )
        except sglang_client.SGLangUnauthorized:
            raise
        except sglang_client.SGLangError as e:
            if fallback and e.status == 404:
                return self._call(fallback, payload)
            raise EvalError(f"AERIE_EVAL_SERVER {self.url}{path}: {e}") from None

    def forward(self, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
        """-> aux (1, T, K*H) float32, greedy (T,)."""
        out = self._call(
            "/generate",
            {
                "input_ids": [int(i) for i in ids],
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "return_hidden_states": True,
                "return_logprob": True,
                "logprob_start_len": 0,
                "top_logprobs_num": 1,
            },
        )
        meta = out.get("meta_info") or {}
        rows = (meta.get("hidden_states") or [None])[0]
        if rows and not isinstance(rows[0], list):  # a one-token input comes back flat
            rows = [rows]
        aux = torch.tensor(rows or [], dtype=torch.float32)
        T = len(ids)
        if aux.shape != (T, self.K * self.H):
            raise EvalError(
                f"AERIE_EVAL_SERVER {self.url} returned hidden states {list(aux.shape)} for {T} tokens, expected "
                f"[{T}, {self.K * self.H}]: is it the run's target, at its layer ids, with the radix cache off?"
            )
        inputs, outputs = meta.get("input_top_logprobs") or [], meta.get("output_top_logprobs") or []
        if len(inputs) != T or not outputs:
            raise EvalError(
                f"AERIE_EVAL_SERVER {self.url} returned {len(inputs)} input log-prob rows for {T} tokens: "
                "an SGLang that honours logprob_start_len 0 is needed"
            )
        greedy = [int(row[0][1]) for row in inputs[1:]] + [int(outputs[0][0][1])]
        return aux[None], greedy

    def prefill(self, prompt_ids: list[int]) -> tuple[torch.Tensor, list[int]]:
        return self.forward(list(prompt_ids))

    def verify(self, tokens: list[int], draft: list[int]) -> tuple[torch.Tensor, list[int]]:
        aux, greedy = self.forward([*tokens, *draft])
        rows = 1 + len(draft)
        return aux[:, -rows:], greedy[-rows:]

    def keep(self, accepted: int, drafted: int) -> None:
        pass


def acceptance_length(
    target,
    drafter: Eagle3Drafter,
    prompts: list[list[int]],
    capture_points: list[int],
    max_new_tokens: int,
    draft_tokens: int,
    eos_ids: list[int] = (),
) -> dict:
    """SGLang's definition over a prompt set: sum(completion tokens) / sum(verify counts).

    target: a transformers model (a fresh KV cache per prompt), or an SGLangTarget (stateless)."""
    per_prompt, completion, verifies = [], 0, 0
    for prompt in prompts:
        ids, n_verify = speculative_generate(
            target, drafter, prompt, capture_points, max_new_tokens, draft_tokens, eos_ids
        )
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
    for n, line in enumerate(path_or_text.split("\n"), 1):  # not splitlines: U+2028 may sit inside a JSON string
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
@dataclass(frozen=True)
class EvalConfig:
    """What an Evaluator measures against, besides the drafter, the target head and the data.

    model_dir: the target's folder (config.json, tokenizer; the weights only in `transformers` mode).
    capture_points: the run's; layer_ids: the same points as the SGLang server numbers them, and
    architecture: the target's (both for `sglang` mode's capture request).
    prompts_jsonl: eval prompts (JSONL text, see prompts_from_file); default: held-out conversations.
    server / max_target_params: AERIE_EVAL_SERVER / AERIE_EVAL_MAX_TARGET_PARAMS, which choose the mode."""

    model_dir: str | os.PathLike
    capture_points: list[int]
    config: TrainConfig
    device: torch.device
    prompts_jsonl: str | None = None
    server: str | None = None
    max_target_params: float = float("inf")
    layer_ids: list[int] | None = None
    architecture: str | None = None
    api_key: str | None = None  # sent to `server` only (the configured AERIE_EVAL_SERVER)


class Evaluator:
    """Held-out metrics and the speculative-decoding loop for one drafter, before and after
    training. It gets what it uses: the drafter, the target head, the data and an EvalConfig.

    How acceptance is measured (`mode`, recorded in the metrics as `evaluated_with`):
    - `sglang`: `server` (AERIE_EVAL_SERVER) does the target's forward (SGLangTarget); the
      trainer never loads the target.
    - `transformers`: the target in this process, only when its parameter count (config.json,
      aerie_trainer.sizing) is at most `max_target_params` (AERIE_EVAL_MAX_TARGET_PARAMS).
    - `simulated`: neither — the held-out TTT figure (`simulated_acceptance`) only, said in the
      metrics' `evaluation_note`."""

    HOLDOUT_BATCHES = 16

    def __init__(self, drafter: Eagle3Drafter, target: TargetHead, data: HiddenData, setup: EvalConfig):
        from aerie_trainer.sizing import target_parameters_of

        self.drafter, self.target, self.data, self.setup = drafter, target, data, setup
        self.model_dir, self.capture_points, self.cfg = str(setup.model_dir), list(setup.capture_points), setup.config
        self.device, self.prompts_jsonl = setup.device, setup.prompts_jsonl
        config, model_dir, server, max_target_params = (
            setup.config,
            setup.model_dir,
            setup.server,
            setup.max_target_params,
        )
        self.ttt = TTT(drafter, config.ttt_steps, config.step_decay)
        self._target_model = None
        self._prompts: list[list[int]] | None = None
        self.target_params = target_parameters_of(model_dir)
        self.server, self.layer_ids, self.architecture = server, setup.layer_ids, setup.architecture
        self.api_key = setup.api_key
        if server:
            self.mode = "sglang"
            self.note = f"target forward by the SGLang server {server}"
        elif self.target_params <= max_target_params:
            self.mode = "transformers"
            self.note = f"target ({self.target_params / 1e9:.2f} B parameters) in transformers in the trainer"
        else:
            self.mode = "simulated"
            self.note = (
                f"simulated only: the target ({self.target_params / 1e9:.1f} B parameters) is over "
                f"AERIE_EVAL_MAX_TARGET_PARAMS ({max_target_params / 1e9:.1f} B) and no AERIE_EVAL_SERVER is set; "
                "measure the drafter with `aerie bench` on its serving server"
            )

    def prompts(self) -> list[list[int]]:
        """The eval prompts: the file's, else the held-out conversations'. While a streamed job's
        runs are still being extracted, those of the shards there so far, read again next time
        (kept once the runs are complete: the prompts a job on the complete runs reads)."""
        if self._prompts is not None:
            return self._prompts
        n = self.cfg.eval_prompts
        if self.prompts_jsonl is not None:
            self._prompts = prompts_from_file(self.prompts_jsonl, self.model_dir)[:n]
            return self._prompts
        complete = not self.data.stream or self.data.arrived
        prompts = prompts_from_sequences(self.data.holdout_sequences(4 * n + 8))[:n]
        if complete:
            self._prompts = prompts
        return prompts

    def target_forward(self):
        if self._target_model is None:
            if self.mode == "sglang":
                self._target_model = SGLangTarget(
                    self.server,
                    self.layer_ids,
                    len(self.capture_points),
                    self.drafter.config.target_hidden_size,
                    self.architecture,
                    api_key=self.api_key,
                )
            else:
                self._target_model = load_target(self.model_dir, self.device)
        return self._target_model

    def run(self) -> dict:
        drafter = self.drafter
        was_training = drafter.training
        drafter.eval()
        try:
            metrics = heldout_metrics(self.ttt, self.data.holdout_batches(self.HOLDOUT_BATCHES), self.target)
            metrics.update(evaluated_with=self.mode, evaluation_note=self.note)
            prompts = self.prompts() if self.cfg.eval_prompts and self.mode != "simulated" else []
            if prompts:
                spec = acceptance_length(
                    self.target_forward(),
                    drafter,
                    prompts,
                    self.capture_points,
                    self.cfg.eval_new_tokens,
                    self.cfg.eval_draft_tokens,
                    eos_token_ids(self.model_dir),
                )
                metrics.update(spec, eval_prompts=len(prompts))
            return metrics
        finally:
            drafter.train(was_training)
