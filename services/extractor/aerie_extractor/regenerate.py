"""Regeneration: replace a dataset's assistant turns with the target's own answers.

Drafters learn best from the target's own outputs, so ingest can ask the target to answer each
user turn again (option `regenerate`), turn by turn, each answer conditioned on the earlier
regenerated ones.

- `sglang` engine: the server's OpenAI-compatible chat API (`/v1/chat/completions`) at
  `settings.engine_urls`, round-robin. A 4xx refuses the record (reason in rejects); a 5xx or an
  unreachable server is an EngineError: the ingest task retries.
- `hf` engine: `generate` of the target in this process (the embedded default).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from aerie.contracts import IngestOptions
from aerie.settings import Settings
from aerie_extractor.engines.base import EngineError, EngineMismatch

Messages = list[dict[str, str]]


class RegenerateRefused(ValueError):
    """The engine refused this conversation (the record is rejected, the run goes on)."""


def regenerate(messages: Messages, answer: Callable[[Messages], str]) -> Messages:
    """Every assistant turn replaced by `answer(conversation so far)`."""
    out: Messages = []
    for j, m in enumerate(messages):
        if m["role"] == "assistant":
            if not any(turn["role"] == "user" for turn in out):
                raise RegenerateRefused(f"turn {j + 1} is an assistant turn with no user turn before it: nothing to answer")
            text = answer(out).strip()
            if not text:
                raise RegenerateRefused(f"regenerated answer for turn {j + 1} is empty")
            out.append({"role": "assistant", "content": text})
        else:
            out.append(dict(m))
    return out


class OpenAIChat:
    def __init__(self, urls: list[str], options: IngestOptions, timeout_s: float, headers: dict[str, str] | None = None):
        import httpx

        if not urls:
            raise EngineError("regeneration needs an engine URL: set AERIE_ENGINE_URLS")
        self.urls = itertools.cycle([u.rstrip("/") for u in urls])
        self.options = options
        self.client = httpx.Client(timeout=timeout_s, headers=headers)  # headers: SGLang's --api-key

    def __call__(self, messages: Messages) -> str:
        import httpx

        url = next(self.urls)
        body = {
            "model": "default",
            "messages": messages,
            "temperature": self.options.regenerate_temperature,
            "max_tokens": self.options.regenerate_max_tokens,
        }
        try:
            r = self.client.post(f"{url}/v1/chat/completions", json=body)
        except httpx.HTTPError as e:
            raise EngineError(f"regeneration: {url} unreachable ({type(e).__name__}: {e}): is the engine up? (AERIE_ENGINE_URLS)") from e
        if r.status_code in (401, 403):  # the whole run's configuration, not this record
            raise EngineMismatch(f"regeneration: {url} refused the request (HTTP {r.status_code}): it runs with --api-key; "
                                 "set AERIE_ENGINE_API_KEY to that key")
        if 400 <= r.status_code < 500:
            raise RegenerateRefused(f"regeneration refused by {url}: HTTP {r.status_code}: {r.text[:200]}")
        if r.status_code != 200:
            raise EngineError(f"regeneration: {url} answered HTTP {r.status_code}: {r.text[:200]}")
        try:
            return r.json()["choices"][0]["message"]["content"] or ""
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise EngineError(f"regeneration: {url} answered without choices[0].message.content: {r.text[:200]}") from e

    def close(self) -> None:
        self.client.close()


class HFChat:
    def __init__(self, model_path: str, options: IngestOptions, device: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch, self.options, self.device = torch, options, device
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32 if device == "cpu" else torch.bfloat16)
        self.model.to(device).eval()

    def __call__(self, messages: Messages) -> str:
        torch = self.torch
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = self.tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"].to(self.device)
        sample = self.options.regenerate_temperature > 0
        with torch.inference_mode():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=self.options.regenerate_max_tokens,
                do_sample=sample, temperature=self.options.regenerate_temperature if sample else None,
                top_p=None, top_k=None, pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
            )
        return self.tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()

    def close(self) -> None:
        self.model = None


def make_answerer(settings: Settings, engine: str, model_path: str, options: IngestOptions):
    if engine == "sglang":
        from aerie_extractor.engines.sglang import auth_headers

        return OpenAIChat(list(settings.engine_urls), options, settings.engine_timeout_s, auth_headers(settings))
    if engine == "hf":
        return HFChat(model_path, options, settings.device)
    raise EngineError(f"regeneration through engine {engine!r} is not supported (hf, sglang)")
