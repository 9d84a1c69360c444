"""Regenerate: one conversation shard answered again by the target, at serving speed, then tokenized.

Drafters learn best from the target's own outputs. A run ingested with `regenerate` is cut into
conversation shards (`runs/<run>/conversations/<shard>.jsonl`, written by ingest); this stage
answers one shard and turns it into the token shard of the same name, which extraction reads:

- Many requests in flight: every conversation of the shard is a coroutine; at most
  `AERIE_REGENERATE_CONCURRENCY` requests are open at once, over SGLang's OpenAI-compatible chat
  API (`/v1/chat/completions`) at `AERIE_REGENERATE_URLS` (empty: `AERIE_ENGINE_URLS` for a run on
  the sglang engine). Conversation i goes to server i mod n, all its turns to the same server, so
  each turn's prompt hits that server's prefix cache. A run on the `hf` engine without URLs
  answers with the target's `generate` in this process, one request at a time (the embedded
  default; slow, for small runs).
- Multi-turn: each assistant turn is answered on the regenerated history, up to
  `regenerate_max_turns` turns and until the conversation reaches `max_tokens` (later turns would
  be truncated away); what follows the last regenerated turn is dropped.
- Reasoning models: the think segment (`reasoning_content` when the server runs a reasoning
  parser, else `<think>...</think>` in the content) is kept inline as `<think>...</think>` before
  the answer, which is what thinking templates (Qwen3, Kimi) parse, or dropped
  (`regenerate_reasoning`). Templates that strip earlier turns' think blocks are tokenized turn by
  turn (aerie_extractor.ingest.ChatTokenizer.sequences), not refused.
- Stored once: the answers are written whole to `runs/<run>/regenerated/<shard>.jsonl`, then their
  record; a redelivered task (a worker killed mid-shard, a retry after a server error) that finds
  the record reuses the answers and asks nothing again; one without it redoes this shard only.
  Then the token shard and its record, as ingest writes them; the Celery task enqueues the shard's
  extraction once (aerie.queue.claim_once).
- Errors: a 4xx (other than 401/403) refuses that conversation (rejects, the shard goes on); a
  5xx, a malformed answer or an unreachable server is an EngineError naming the URL and the
  setting: the task retries this shard; 401/403 is EngineMismatch (the configuration: no retry).
  A refused connection first waits for the server's `/health`, up to AERIE_ENGINE_OUTAGE_WAIT_S
  (a restarting server), then asks once more.
- Progress: a ProgressEvent every few seconds (conversations done, completion tokens/s, requests
  in flight now); the result and the record keep the shard's tokens/s and the in-flight figures
  measured from the requests' own start and end times.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aerie import layout
from aerie.contracts import (
    IngestOptions,
    ProgressEvent,
    RegeneratedRecord,
    RegenerateRequest,
    RegenerateResult,
    RejectRecord,
)
from aerie.runs import load_run
from aerie.settings import Settings
from aerie.store import NotFound, ObjectStore
from aerie.target import hf_load_kwargs
from aerie_extractor.engines.base import EngineError, EngineMismatch

log = logging.getLogger(__name__)

Messages = list[dict[str, str]]
PROGRESS_EVERY_S = 2.0
# A pooled connection idle this long is not reused: below uvicorn's (SGLang's) 5 s keep-alive, so
# the client never sends on a connection the server is closing (with hundreds of requests in flight
# and a task's tokenizing holding the GIL for seconds, such a send fails the shard with ReadError).
KEEPALIVE_S = 2.0
RESET_RETRIES = 2  # a request on a connection the server closed (no answer read) is sent again
_THINK = re.compile(r"<think>.*?(</think>|$)\s*", re.S)


class RegenerateRefused(ValueError):
    """The engine refused this conversation (the record is rejected, the run goes on)."""


class RegenerateError(EngineError):
    """This shard cannot be regenerated as stored (not a regenerated run, a missing shard)."""

    retryable = False


@dataclass(frozen=True)
class Answer:
    content: str
    reasoning: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


# --------------------------------------------------------------------------------------
# A conversation, turn by turn
# --------------------------------------------------------------------------------------
def assistant_turn(answer: Answer, reasoning: str) -> str:
    """The stored assistant text: the think segment kept inline (`<think>` ... `</think>`, what
    thinking templates parse) or dropped."""
    if reasoning == "drop":
        return _THINK.sub("", answer.content).strip()
    if answer.reasoning and answer.reasoning.strip():
        return f"<think>\n{answer.reasoning.strip()}\n</think>\n\n{answer.content.strip()}"
    return answer.content.strip()


async def regenerate_conversation(
    messages: Messages,
    chat: Callable[[Messages, int], Awaitable[Answer]],
    options: IngestOptions,
    prompt_tokens: int = 0,
) -> tuple[Messages, int]:
    """(the conversation with its assistant turns answered again, turns answered). Each answer
    is asked on the regenerated history; stops at the turn limit or once the conversation
    reaches `options.max_tokens`. No answer asks for more new tokens than fit before
    `max_tokens` (`prompt_tokens`: the first prompt's, as ingest counted them; then the previous
    turn's prompt and answer): what would be truncated away is never generated."""
    out: Messages = []
    turns = 0
    used = prompt_tokens  # tokens the next prompt holds at least
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            out.append(dict(m))
            continue
        if options.regenerate_max_turns is not None and turns >= options.regenerate_max_turns:
            break
        if not any(turn["role"] == "user" for turn in out):
            raise RegenerateRefused(f"turn {j + 1} is an assistant turn with no user turn before it: nothing to answer")
        answer = await chat(out, max(1, min(options.regenerate_max_tokens, options.max_tokens - used)))
        used = answer.prompt_tokens + answer.completion_tokens
        text = assistant_turn(answer, options.regenerate_reasoning)
        if not text:
            raise RegenerateRefused(f"regenerated answer for turn {j + 1} is empty")
        out.append({"role": "assistant", "content": text})
        turns += 1
        if used >= options.max_tokens:
            break  # later turns would lie beyond max_tokens
    while out and out[-1]["role"] != "assistant":
        out.pop()
    return out, turns


# --------------------------------------------------------------------------------------
# Engines: an OpenAI-compatible server (SGLang), or the target in this process
# --------------------------------------------------------------------------------------
class OpenAIChat:
    """Async client of `/v1/chat/completions`; one connection pool for all requests in flight."""

    health_poll_s = 5.0

    def __init__(
        self,
        urls: list[str],
        options: IngestOptions,
        timeout_s: float,
        concurrency: int,
        headers: dict[str, str] | None = None,
        outage_wait_s: float = 0.0,
    ):
        import httpx

        if not urls:
            raise EngineError("regeneration needs a server: set AERIE_REGENERATE_URLS (or AERIE_ENGINE_URLS)")
        self.urls = [u.rstrip("/") for u in urls]
        self.options, self.outage_wait_s = options, outage_wait_s
        self._outages: dict[str, asyncio.Lock] = {}
        self._gave_up: set[str] = set()
        limits = httpx.Limits(
            max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=KEEPALIVE_S
        )
        self.client = httpx.AsyncClient(
            timeout=timeout_s, headers=headers, limits=limits
        )  # headers: SGLang's --api-key

    async def __call__(self, url: str, messages: Messages, max_new: int | None = None) -> Answer:
        import httpx

        body = {
            "model": "default",
            "messages": messages,
            "temperature": self.options.regenerate_temperature,
            "max_tokens": max_new or self.options.regenerate_max_tokens,
        }
        try:
            try:
                r = await self._post(url, body)
            except httpx.ConnectError:
                if self.outage_wait_s <= 0:
                    raise
                await self._wait_healthy(url)  # a restarting server: wait for it, then ask once more
                r = await self._post(url, body)
        except httpx.HTTPError as e:
            raise EngineError(
                f"regeneration: {url} unreachable ({type(e).__name__}: {' '.join(str(e).split())}): is the "
                "server up? (AERIE_REGENERATE_URLS / AERIE_ENGINE_URLS; AERIE_ENGINE_OUTAGE_WAIT_S "
                f"{self.outage_wait_s:g} s)"
            ) from None
        if r.status_code in (401, 403):  # the whole run's configuration, not this record
            raise EngineMismatch(
                f"regeneration: {url} refused the request (HTTP {r.status_code}): it runs with --api-key; "
                "set AERIE_ENGINE_API_KEY to that key"
            )
        if 400 <= r.status_code < 500:
            raise RegenerateRefused(f"regeneration refused by {url}: HTTP {r.status_code}: {_short(r.text)}")
        if r.status_code != 200:
            raise EngineError(f"regeneration: {url} answered HTTP {r.status_code}: {_short(r.text)}")
        try:
            reply = r.json()
            message = reply["choices"][0]["message"]
            usage = reply.get("usage") or {}
            return Answer(
                message.get("content") or "",
                message.get("reasoning_content"),
                int(usage.get("prompt_tokens") or 0),
                int(usage.get("completion_tokens") or 0),
            )
        except (KeyError, IndexError, TypeError, ValueError, AttributeError):
            raise EngineError(
                f"regeneration: {url} answered without choices[0].message: {_short(r.text)} "
                "(is it an OpenAI-compatible server? AERIE_REGENERATE_URLS)"
            ) from None

    async def _post(self, url: str, body: dict):
        """POST, sent again (on a new connection) when the server closed the connection before
        answering: a kept-alive connection it dropped, not a server that is down (ConnectError)."""
        import httpx

        for attempt in range(RESET_RETRIES + 1):
            try:
                return await self.client.post(f"{url}/v1/chat/completions", json=body)
            except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as e:
                if attempt == RESET_RETRIES:
                    raise
                log.info("regeneration: %s closed the connection (%s): asking again", url, type(e).__name__)

    async def _wait_healthy(self, url: str) -> None:
        """Until `url/health` answers 200, at most `outage_wait_s`; one poller per server, the
        other requests to it wait on the same lock (a large model reloads for 10-30 min)."""
        import httpx

        lock = self._outages.setdefault(url, asyncio.Lock())
        async with lock:
            if url in self._gave_up:  # another request waited the whole time already
                return
            deadline = time.monotonic() + self.outage_wait_s
            warned = False
            while True:
                try:
                    if (await self.client.get(f"{url}/health")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() >= deadline:
                    self._gave_up.add(url)
                    return  # the request after it fails and says so
                if not warned:
                    log.warning(
                        "regeneration: %s is down: waiting up to %.0f s for its /health (AERIE_ENGINE_OUTAGE_WAIT_S)",
                        url,
                        self.outage_wait_s,
                    )
                    warned = True
                await asyncio.sleep(min(self.health_poll_s, max(deadline - time.monotonic(), 0.0)))

    async def close(self) -> None:
        await self.client.aclose()


def _short(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class HFChat:
    """The target's greedy/sampled `generate` in this process (no server): one request at a time."""

    urls = ["hf"]

    def __init__(self, model_path: str, options: IngestOptions, device: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch, self.options, self.device = torch, options, device
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path,
            dtype=torch.float32 if device == "cpu" else torch.bfloat16,
            use_safetensors=True,
            **hf_load_kwargs(model_path),
        )
        self.model.to(device).eval()
        self.lock = threading.Lock()

    def answer(self, messages: Messages, max_new: int | None = None) -> Answer:
        torch = self.torch
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = self.tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"].to(self.device)
        sample = self.options.regenerate_temperature > 0
        with self.lock, torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new or self.options.regenerate_max_tokens,
                do_sample=sample,
                temperature=self.options.regenerate_temperature if sample else None,
                top_p=None,
                top_k=None,
                pad_token_id=self.tokenizer.pad_token_id or self.tokenizer.eos_token_id,
            )
        new = out[0, ids.shape[1] :]
        return Answer(self.tokenizer.decode(new, skip_special_tokens=True), None, int(ids.shape[1]), int(new.shape[0]))

    async def __call__(self, url: str, messages: Messages, max_new: int | None = None) -> Answer:
        return await asyncio.to_thread(self.answer, messages, max_new)

    async def close(self) -> None:
        pass


_hf_chats: dict[tuple, HFChat] = {}


def make_chat(
    settings: Settings, engine: str, model_path: str, options: IngestOptions
) -> tuple[OpenAIChat | HFChat, list[str], int]:
    """(the chat engine, its URLs, requests in flight) for a run on `engine`."""
    urls = list(settings.regenerate_urls) or (list(settings.engine_urls) if engine == "sglang" else [])
    if urls:
        from aerie_extractor.engines.sglang import auth_headers

        concurrency = settings.regenerate_concurrency
        chat = OpenAIChat(
            urls, options, settings.engine_timeout_s, concurrency, auth_headers(settings), settings.engine_outage_wait_s
        )
        return chat, urls, concurrency
    if engine == "hf":
        key = (model_path, settings.device, options.regenerate_temperature, options.regenerate_max_tokens)
        if key not in _hf_chats:
            _hf_chats.clear()
            _hf_chats[key] = HFChat(model_path, options, settings.device)
        return _hf_chats[key], HFChat.urls, 1
    raise EngineError(f"regeneration through engine {engine!r} needs AERIE_REGENERATE_URLS")


# --------------------------------------------------------------------------------------
# A shard: every conversation in flight at once, up to the concurrency
# --------------------------------------------------------------------------------------
@dataclass
class Meter:
    """Requests in flight and tokens, measured as the requests start and end."""

    started: float = field(default_factory=time.monotonic)
    in_flight: int = 0
    max_in_flight: int = 0
    busy_s: float = 0.0  # summed request durations: / wall time = mean requests in flight
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    done: int = 0

    def wrap(self, chat, url: str) -> Callable[[Messages, int], Awaitable[Answer]]:
        async def ask(messages: Messages, max_new: int) -> Answer:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            t0 = time.monotonic()
            try:
                answer = await chat(url, messages, max_new)
            finally:
                self.in_flight -= 1
                self.busy_s += time.monotonic() - t0
            self.requests += 1
            self.prompt_tokens += answer.prompt_tokens
            self.completion_tokens += answer.completion_tokens
            return answer

        return ask

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started

    def tokens_per_second(self) -> float:
        return self.completion_tokens / max(self.seconds, 1e-9)


async def answer_all(
    records: list[dict],
    chat,
    urls: list[str],
    concurrency: int,
    options: IngestOptions,
    progress: Callable[[ProgressEvent], None] | None = None,
    meter: Meter | None = None,
) -> tuple[list[dict], Meter]:
    """Every record answered (`messages` regenerated, `turns`) or refused (`reject`), in order.
    The first engine error cancels the rest and is raised (the task retries the shard)."""
    meter = meter or Meter()
    gate = asyncio.Semaphore(concurrency)
    out: list[dict] = [{} for _ in records]

    async def one(i: int, record: dict) -> None:
        async with gate:
            base = {"line": record["line"], "source": record["source"]}
            try:
                messages, turns = await regenerate_conversation(
                    record["messages"], meter.wrap(chat, urls[i % len(urls)]), options, record.get("prompt_tokens") or 0
                )
                out[i] = {**base, "messages": messages, "turns": turns}
            except RegenerateRefused as e:
                out[i] = {**base, "reject": str(e)}
            meter.done += 1

    async def report() -> None:  # started only with a `progress`
        assert progress is not None
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            progress(
                ProgressEvent(
                    stage="regenerate",
                    step=meter.done,
                    steps=len(records),
                    tokens=meter.completion_tokens,
                    tokens_per_second=round(meter.tokens_per_second(), 1),
                    in_flight=meter.in_flight,
                    message=f"{meter.done}/{len(records)} conversations, {meter.tokens_per_second():.0f} tok/s, "
                    f"{meter.in_flight} in flight",
                )
            )

    tasks = [asyncio.create_task(one(i, r)) for i, r in enumerate(records)]
    reporter = asyncio.create_task(report()) if progress is not None else None
    try:
        if tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                if (error := t.exception()) is not None:
                    raise error
    finally:
        for t in [*tasks, *([reporter] if reporter else [])]:
            t.cancel()
        await asyncio.gather(*tasks, *([reporter] if reporter else []), return_exceptions=True)
    return out, meter


async def _answer_shard(records, chat, urls, concurrency, options, progress):
    try:
        return await answer_all(records, chat, urls, concurrency, options, progress)
    finally:
        await chat.close()


# --------------------------------------------------------------------------------------
# The stage
# --------------------------------------------------------------------------------------
def _jsonl(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in rows)


def _rows(data: bytes) -> list[dict]:
    return [
        json.loads(line) for line in data.decode().split("\n") if line.strip()
    ]  # not splitlines: U+2028 is inside strings


def stored_answers(store: ObjectStore, run: str, shard: str) -> tuple[RegeneratedRecord, list[dict]] | None:
    """The shard's stored answers when their record matches the object (sha256), else None."""
    try:
        record = store.get_json(layout.regenerated_record(run, shard), RegeneratedRecord)
        data = store.get_bytes(layout.regenerated(run, shard))  # the layout's key, never one a record names
    except NotFound:
        return None
    if hashlib.sha256(data).hexdigest() != record.sha256:
        log.warning("%s: regenerated shard %s does not match its record: asking again", run, shard)
        return None
    return record, _rows(data)


def run_regenerate(
    store: ObjectStore,
    settings: Settings,
    request: RegenerateRequest,
    progress: Callable[[ProgressEvent], None] | None = None,
) -> RegenerateResult:
    """Answer `runs/<run>/conversations/<shard>.jsonl` (once), tokenize it into the token shard."""
    from aerie_extractor.ingest import ChatTokenizer, Rejected, fit, write_token_shard

    run, shard = request.run, request.shard
    spec = load_run(store, run)
    options = spec.ingest
    if not options.regenerate:
        raise RegenerateError(f"run {run!r} was not ingested with regenerate: its token shards are the dataset's own")
    result = RegenerateResult(run=run, shard=shard)
    if store.exists(layout.shard_record(run, "tokens", shard)):
        result.skipped = True
        return result

    found = stored_answers(store, run, shard)
    if found is not None:
        record, answered = found
        result.reused_answers = True
    else:
        try:
            records = _rows(store.get_bytes(layout.conversations(run, shard)))
        except NotFound:
            raise RegenerateError(
                f"run {run!r} has no conversation shard {shard} ({layout.conversations(run, shard)})"
            ) from None
        chat, urls, concurrency = make_chat(settings, spec.engine.name, spec.target.model, options)
        started = time.monotonic()
        answered, meter = asyncio.run(_answer_shard(records, chat, urls, concurrency, options, progress))
        data = _jsonl(answered)
        key = layout.regenerated(run, shard)
        sha = store.put_bytes(key, data)
        seconds = time.monotonic() - started
        record = RegeneratedRecord(
            run=run,
            shard=shard,
            key=key,
            sha256=sha,
            conversations=sum("messages" in a for a in answered),
            turns=sum(a.get("turns", 0) for a in answered),
            rejects=sum("reject" in a for a in answered),
            prompt_tokens=meter.prompt_tokens,
            completion_tokens=meter.completion_tokens,
            seconds=round(seconds, 3),
            tokens_per_second=round(meter.completion_tokens / max(seconds, 1e-9), 2),
            max_in_flight=meter.max_in_flight,
            mean_in_flight=round(meter.busy_s / max(seconds, 1e-9), 3),
            servers=urls,
        )
        store.put_json(layout.regenerated_record(run, shard), record)
        log.info(
            "regenerate %s/%s: %d conversations, %d turns, %d completion tokens in %.1f s (%.0f tok/s, max %d in flight)",
            run,
            shard,
            record.conversations,
            record.turns,
            record.completion_tokens,
            seconds,
            record.tokens_per_second,
            record.max_in_flight,
        )

    # tokenize, as ingest does (each turn on its own where the template rewrites earlier turns)
    chat_tokenizer = ChatTokenizer(spec.target.model)
    sequences, rejects = [], []
    for row in answered:
        try:
            if "reject" in row:
                raise Rejected(row["reject"])
            for ids, mask in chat_tokenizer.sequences(row["messages"], options.loss_on):
                ids, mask = fit(ids, mask, options)
                sequences.append({"input_ids": ids, "loss_mask": mask})
        except Rejected as e:
            rejects.append(RejectRecord(source=row["source"], line=row["line"], reason=str(e)))
    earlier = store.list(layout.regenerate_rejects_prefix(run, shard))  # a retry's count may differ
    if rejects:
        key = layout.regenerate_rejects(run, shard, len(rejects))
        store.put_bytes(key, b"".join(r.model_dump_json().encode() + b"\n" for r in rejects))
        earlier = [k for k in earlier if k != key]
    for key in earlier:
        store.delete(key)
    if sequences:
        tokens = write_token_shard(store, run, shard, sequences)
        result.sequences, result.tokens = tokens.sequences, tokens.tokens
    store.put_json(layout.regenerated_record(run, shard), record.model_copy(update={"token_sequences": len(sequences)}))
    store.delete(layout.shard_failure(run, shard))  # an earlier attempt's, if any
    result.conversations, result.turns, result.rejects = record.conversations, record.turns, len(rejects)
    result.completion_tokens, result.seconds, result.tokens_per_second = (
        record.completion_tokens,
        record.seconds,
        record.tokens_per_second,
    )
    result.max_in_flight, result.mean_in_flight = record.max_in_flight, record.mean_in_flight
    return result


__all__ = [
    "Answer",
    "HFChat",
    "Meter",
    "OpenAIChat",
    "RegenerateError",
    "RegenerateRefused",
    "answer_all",
    "assistant_turn",
    "make_chat",
    "regenerate_conversation",
    "run_regenerate",
]
