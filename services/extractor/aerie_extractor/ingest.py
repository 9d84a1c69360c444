"""Ingest: a chat dataset -> tokenized, loss-masked token shards + the run spec.

- Input: a store key (`datasets/x.jsonl`), or a local path inside a folder the settings allow
  (AERIE_INGEST_LOCAL_DIRS, empty by default: a worker opens nothing a message names); JSONL (one record a line) or a JSON
  array (ShareGPT's own files), streamed record by record with `json.JSONDecoder.raw_decode`,
  so a 100 MB array is never held whole and an array cut off at the end stops cleanly.
- A record must be UTF-8 (never "repaired") and at most `max_record_bytes` (1 MiB by default:
  SmolLM2's tokenizer turns 1 MiB of text into 203k tokens, +109 MiB peak RSS): a longer one is
  refused with its line, its bytes skipped as they stream by, never held.
- Records: ShareGPT (`conversations`: `from`/`value`) or OpenAI (`messages`: `role`/`content`),
  with system prompts and any number of turns.
- The *target's* chat template renders the conversation. The loss mask covers assistant tokens
  only: each assistant turn's text span is found by rendering the conversation up to that turn
  (with the generation prompt) and up to its end, and checking that each rendering is a prefix
  of the whole; tokens are mapped to spans by their character offsets. A template that is not
  prefix-stable (e.g. Qwen3's or Kimi's, which drop earlier turns' think blocks) is tokenized turn
  by turn instead: one sequence per assistant turn, its own prompt as the template renders it then.
- Regeneration (`regenerate`): ingest only checks and normalizes the records and writes them as
  conversation shards (`runs/<run>/conversations/<shard>.jsonl`, `regenerate_shard_records` each);
  the regenerate stage (aerie_extractor.regenerate, one task a shard) answers them with the target
  and writes each shard's token shard, so extraction of a shard starts as soon as it is answered.
- A record nested deeper than `MAX_DEPTH` arrays/objects is refused with its line (measured
  without recursion, before it is parsed), never a `RecursionError` that stops the whole ingest.
- Every refused record becomes a `RejectRecord` (1-based line, reason) in
  `runs/<run>/rejects/<part>-n<count>.jsonl`, written every `REJECTS_PART` rejects at most (never
  all held); the run goes on.
- Output: token shards of about `shard_tokens` tokens (whole sequences), each object written
  before its record, then `run.json` last: its presence means ingest finished.
"""

from __future__ import annotations

import codecs
import itertools
import json
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from aerie import layout
from aerie.capture import default_capture_points, validate_capture_points
from aerie.contracts import IngestOptions, IngestRequest, IngestResult, RejectRecord, RunSpec, ShardRecord
from aerie.datasets import DatasetRefused, allowed_local_path, is_local_form, refusal
from aerie.errors import ExpectedError
from aerie.runs import conversation_shards, shard_names
from aerie.settings import Settings
from aerie.shard import default_scale_block, pack
from aerie.store import NotFound, ObjectStore
from aerie.target import describe

log = logging.getLogger(__name__)

ROLES = {
    # ShareGPT `from`
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "system": "system",
    # OpenAI `role`
    "developer": "system",
}


class IngestError(ExpectedError, ValueError):
    """The whole run cannot be ingested (missing dataset, template, existing run...)."""


class Rejected(ValueError):
    """One record refused; the message is the reason stored in rejects."""


class NotPrefixStable(Rejected):
    """The template renders an earlier turn differently once later turns follow (thinking templates)."""


# --------------------------------------------------------------------------------------
# Reading: store key or path -> (line, record | Rejected)
# --------------------------------------------------------------------------------------
def _byte_chunks(store: ObjectStore, dataset: str, local_dirs: list[Path]) -> tuple[str, Iterator[bytes]]:
    """The dataset's bytes: from a local file inside `local_dirs` (AERIE_INGEST_LOCAL_DIRS), else
    from the store. Nothing else is opened (aerie.datasets); returns (source name, chunks)."""
    try:
        path = allowed_local_path(dataset, local_dirs)
    except DatasetRefused as e:
        raise IngestError(str(e)) from None
    if path is not None and path.is_file():

        def read() -> Iterator[bytes]:
            with open(path, "rb") as f:
                while chunk := f.read(8 << 20):
                    yield chunk

        return str(path), read()
    if path is not None or is_local_form(dataset):
        raise IngestError(str(refusal(dataset, local_dirs)) if path is None else f"dataset {dataset!r}: no such file")
    keys = [dataset] if "/" in dataset else [dataset, layout.dataset(dataset)]
    for key in keys:
        if store.exists(key):
            return key, store.open(key)
    raise IngestError(
        f"dataset {dataset!r} is not an object in {store.url} (tried {', '.join(keys)}): upload it "
        "(`enqueue --dataset FILE` does), or name a file in a folder of AERIE_INGEST_LOCAL_DIRS"
    )


_JSON_SPACE = b" \t\r\n"
_SEPARATORS = re.compile(r"[ \t\r\n,]*")
_NOT_UTF8 = re.compile("[\udc80-\udcff]")  # bytes that were not UTF-8, as 'surrogateescape' decodes them
_OUTSIDE_STRING = re.compile(r'["{}\[\],]')  # what opens a string or changes the nesting
_STRING_BODY = re.compile(
    r'[^"\\]*+(?:\\.[^"\\]*+)*+', re.S
)  # a string's characters and escapes, up to its quote (possessive: no backtracking state)


# A chat record is 4 levels deep (record, turns, turn, content parts); 64 leaves room for any
# tool-call payload while staying far below Python's recursion limit (1000), which the json
# decoder and everything that walks a record would otherwise hit with RecursionError.
MAX_DEPTH = 64
# Rejects written to the store per part at most: a dataset of a million bad lines holds at most
# this many RejectRecords (a few MB) in memory, and no part is too big to read.
REJECTS_PART = 10_000
_STRING = re.compile(r'"[^"\\]*+(?:\\.[^"\\]*+)*+"', re.S)  # a whole JSON string (possessive)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def _too_deep(text: str) -> Rejected | None:
    """Rejected when the JSON `text` nests arrays/objects deeper than MAX_DEPTH (strings skipped),
    measured by counting, never by recursion."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:  # cannot nest deeper than it opens
        return None
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text)).encode()
    steps = np.where(np.isin(np.frombuffer(brackets, np.uint8), (ord("["), ord("{"))), 1, -1)
    depth = int(np.cumsum(steps).max()) if steps.size else 0
    if depth <= MAX_DEPTH:
        return None
    return Rejected(f"nested too deep: {depth} levels of arrays/objects, more than {MAX_DEPTH} (a chat record needs 4)")


def _over_long(what: str, cap: int) -> Rejected:
    return Rejected(
        f"over-long {what}: more than {cap} bytes (limit IngestOptions.max_record_bytes; enqueue --max-record-bytes)"
    )


def iter_records(
    chunks: Iterator[bytes], max_record_bytes: int = IngestOptions.model_fields["max_record_bytes"].default
) -> Iterator[tuple[int, object]]:
    """(1-based line, parsed record or Rejected) for JSONL or a JSON array (possibly cut off).

    A record of more than `max_record_bytes` is refused without being held: its bytes are
    skipped as they stream by. Bytes that are not UTF-8 refuse their record (never replaced)."""
    chunks = iter(chunks)
    head: bytes | None
    head, lines_before = next(chunks, b"").removeprefix(b"\xef\xbb\xbf"), 0  # a UTF-8 byte order mark is not data
    while True:
        first = len(head) - len(head.lstrip(_JSON_SPACE))
        lines_before += head.count(b"\n", 0, first)
        head = head[first:]  # leading blank lines are never a record: counted, not kept
        if head or (head := next(chunks, None)) is None:
            break
    if not head:
        return
    rest = itertools.chain([head], chunks)
    if head.startswith(b"["):
        yield from _iter_array(_Text(rest), lines_before + 1, max_record_bytes)
    else:
        yield from _iter_jsonl(rest, lines_before, max_record_bytes)


def _iter_jsonl(chunks: Iterator[bytes], line_no: int, cap: int) -> Iterator[tuple[int, object]]:
    """Lines as bytes: each is decoded (strict UTF-8) and parsed on its own; a line longer than
    `cap` is dropped as it streams by, never accumulated."""
    line, over = bytearray(), False

    def parse() -> Iterator[tuple[int, object]]:
        if over:
            yield line_no, _over_long("line", cap)
            return
        if not line.strip():
            return
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            yield (
                line_no,
                Rejected(
                    f"invalid UTF-8: byte 0x{line[e.start]:02x} at byte {e.start + 1} of the line ({e.reason}); "
                    "save the file as UTF-8"
                ),
            )
            return
        deep = _too_deep(text)
        if deep is not None:
            yield line_no, deep
            return
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            yield line_no, Rejected(f"bad JSON: {e.msg} at column {e.colno}")
        except RecursionError:  # never past _too_deep; a last guard that keeps the line number
            yield line_no, Rejected(f"nested too deep: more than {MAX_DEPTH} levels of arrays/objects")
        else:
            yield line_no, record

    for chunk in chunks:
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = memoryview(chunk)[start : len(chunk) if end < 0 else end]
            if not over and len(line) + len(piece) > cap:
                over = True
                line.clear()
            if not over:
                line += piece
            if end < 0:
                break
            line_no += 1
            yield from parse()
            line.clear()
            over = False
            start = end + 1
    if line or over:
        line_no += 1
        yield from parse()


class _Text:
    """A JSON array's text, decoded chunk by chunk; what is consumed (before `pos`) is dropped as
    more is read. Bytes that are not UTF-8 become lone surrogates ('surrogateescape'), found per
    record, so they refuse their record instead of being replaced."""

    def __init__(self, chunks: Iterator[bytes]):
        self._chunks, self._decoder = chunks, codecs.getincrementaldecoder("utf-8")("surrogateescape")
        self.buf, self.pos, self.exhausted = "", 0, False
        self.more()

    def more(self) -> bool:
        """Append the next text (dropping the consumed); False at the end of the data."""
        if self.exhausted:
            return False
        chunk = next(self._chunks, None)
        if chunk is None:
            self.exhausted = True
            text = self._decoder.decode(b"", final=True)
        else:
            text = self._decoder.decode(chunk)
        self.buf, self.pos = self.buf[self.pos :] + text, 0
        return chunk is not None or bool(text)

    def skip_value(self) -> tuple[int, bool]:
        """Consume the JSON value at `pos` without holding it: (newlines in it, whether it ended
        before the data did). Strings are jumped over by regex, so this costs little per byte."""
        depth, in_string, newlines, i = 0, False, 0, self.pos

        def done(end: int) -> tuple[int, bool]:
            nonlocal newlines
            newlines += self.buf.count("\n", self.pos, end)
            self.pos = end
            return newlines, True

        while True:
            buf = self.buf
            if in_string:
                j = _STRING_BODY.match(buf, i).end()  # type: ignore[union-attr]  # it matches the empty string
                if j < len(buf) and buf[j] == '"':
                    in_string, i = False, j + 1
                    if depth == 0:
                        return done(i)
                    continue
                keep = j  # the end of the text (or an escape at its very end, waiting for its character)
            else:
                m = _OUTSIDE_STRING.search(buf, i)
                if m:
                    c, i = m.group(), m.end()
                    if c == '"':
                        in_string = True
                    elif c in "{[":
                        depth += 1
                    elif depth == 0:  # a bare literal, ended by the array's ',' or ']'
                        return done(m.start())
                    elif c in "}]":
                        depth -= 1
                        if depth == 0:
                            return done(i)
                    continue
                keep = len(buf)
            newlines += buf.count("\n", self.pos, keep)
            self.pos = keep
            if not self.more():
                return newlines, False
            i = self.pos


_DEEP = object()  # _decode_element: the element nests deeper than the decoder can recurse
_TRUNCATED = "bad JSON: the file ends inside this record (truncated array): stopped here"


def _decode_element(decoder: json.JSONDecoder, text: _Text, cap: int) -> tuple[object, int | None]:
    """The array element at `text.pos` and where it ends, reading more text as needed; end None:
    it does not end within `cap` characters (so neither within `cap` bytes)."""
    while True:
        try:
            record, end = decoder.raw_decode(text.buf, text.pos)
        except RecursionError:  # nested deeper than the decoder recurses (so than MAX_DEPTH)
            return _DEEP, None
        except json.JSONDecodeError as e:
            if len(text.buf) - text.pos > cap:
                return None, None
            if text.more():
                continue
            if e.pos >= len(text.buf.rstrip()) or e.msg.startswith("Unterminated"):
                raise Rejected(_TRUNCATED) from None
            raise Rejected(f"bad JSON: {e.msg} (the rest of the array cannot be read)") from None
        # a number or literal at the very end of a chunk may continue in the next one
        if end == len(text.buf) and not text.exhausted and text.more():
            continue
        return record, end


def _iter_array(text: _Text, line: int, cap: int) -> Iterator[tuple[int, object]]:
    """Decode a JSON array element by element; a record cut off by the file's end stops it, an
    over-long one is skipped (its bytes streamed past) and the next one read."""
    decoder = json.JSONDecoder()
    text.pos = text.buf.index("[") + 1
    while True:
        while True:  # whitespace and the separating comma
            end = _SEPARATORS.match(text.buf, text.pos).end()  # type: ignore[union-attr]  # matches the empty string
            line += text.buf.count("\n", text.pos, end)
            text.pos = end
            if text.pos < len(text.buf) or not text.more():
                break
        if text.pos >= len(text.buf) or text.buf[text.pos] == "]":
            return
        try:
            record, end = _decode_element(decoder, text, cap)
        except Rejected as e:  # the file ends inside the record, or it cannot be parsed: no way to the next
            yield line, e
            return
        if end is None:  # over-long, or too deep to decode: skipped as it streams by
            newlines, ended = text.skip_value()
            too_deep = Rejected(
                f"nested too deep: more than {MAX_DEPTH} levels of arrays/objects (a chat record needs 4)"
            )
            yield line, (too_deep if record is _DEEP else _over_long("record", cap)) if ended else Rejected(_TRUNCATED)
            if not ended:
                return
            line += newlines
            continue
        raw = text.buf[text.pos : end]
        if end - text.pos > cap:
            yield line, _over_long("record", cap)
        elif (deep := _too_deep(raw)) is not None:
            yield line, deep
        elif _NOT_UTF8.search(raw):
            yield (
                line,
                Rejected("invalid UTF-8: the record holds bytes that are not UTF-8 text; save the file as UTF-8"),
            )
        else:
            yield line, record
        line += raw.count("\n")
        text.pos = end


# --------------------------------------------------------------------------------------
# Records -> normalized messages
# --------------------------------------------------------------------------------------
def _type(v: object) -> str:
    return {dict: "an object", list: "a list", str: "a string", type(None): "null", bool: "a boolean"}.get(
        type(v), type(v).__name__
    )


def normalize(record: object) -> list[dict[str, str]]:
    """A ShareGPT or OpenAI record -> [{role, content}], roles system/user/assistant."""
    if not isinstance(record, dict):
        raise Rejected(
            f"wrong type: the record is {_type(record)}, expected an object with 'conversations' or 'messages'"
        )
    if "conversations" in record:
        turns, role_key, text_key = record["conversations"], "from", "value"
        fmt = "conversations"
    elif "messages" in record:
        turns, role_key, text_key = record["messages"], "role", "content"
        fmt = "messages"
    else:
        raise Rejected(
            f"wrong type: the record has neither 'conversations' (ShareGPT) nor 'messages' (OpenAI); keys: {sorted(record)[:8]}"
        )
    if not isinstance(turns, list):
        raise Rejected(f"wrong type: '{fmt}' is {_type(turns)}, expected a list of turns")
    messages = []
    for i, turn in enumerate(turns, start=1):
        if not isinstance(turn, dict):
            raise Rejected(
                f"wrong type: turn {i} is {_type(turn)}, expected an object with '{role_key}' and '{text_key}'"
            )
        who = turn.get(role_key)
        if not isinstance(who, str):
            raise Rejected(f"wrong type: turn {i} '{role_key}' is {_type(who)}, expected a string")
        role = ROLES.get(who.lower())
        if role is None:
            raise Rejected(f"unknown role {who!r} in turn {i} (known: {', '.join(sorted(ROLES))})")
        content = turn.get(text_key)
        if isinstance(content, list):  # OpenAI content parts: text only
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise Rejected(f"wrong type: turn {i} '{text_key}' has non-text parts; only text is supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise Rejected(f"wrong type: turn {i} '{text_key}' is {_type(content)}, expected a string")
        if not content.strip():
            raise Rejected(f"empty content in turn {i}")
        messages.append({"role": role, "content": content})
    while messages and messages[-1]["role"] != "assistant":
        messages.pop()  # trailing prompts teach nothing
    if not any(m["role"] == "assistant" for m in messages):
        raise Rejected("no assistant turn")
    return messages


# --------------------------------------------------------------------------------------
# Messages -> input_ids + loss_mask through the target's chat template
# --------------------------------------------------------------------------------------
class ChatTokenizer:
    """The target's tokenizer and chat template; builds (input_ids, loss_mask) per record."""

    def __init__(self, model_folder: str | os.PathLike):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_folder))
        if not getattr(self.tokenizer, "chat_template", None):
            raise IngestError(
                f"the tokenizer in {model_folder} has no chat template: aerie renders conversations with "
                "the target's own template (add chat_template.jinja to the model folder)"
            )
        # a template that marks assistant text with {% generation %} says where the loss goes itself
        self.generation_tags = bool(re.search(r"\{%-?\s*generation\s*-?%\}", self.tokenizer.chat_template))

    def render(self, messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def assistant_spans(self, messages: list[dict[str, str]], text: str) -> list[tuple[int, int]]:
        """Character spans of each assistant turn (its content and end-of-turn token) in `text`."""
        spans = []
        for j, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            upto = self.render(messages[: j + 1])
            if j:
                start = len(self.render(messages[:j], generation_prompt=True))
                stable = upto[:start] == self.render(messages[:j], generation_prompt=True)
            else:
                # an opening assistant turn: templates may add a default system prompt before it,
                # which an empty conversation does not render; find the content itself
                start = upto.rfind(m["content"].strip())
                stable = start >= 0
            if not stable or not text.startswith(upto):
                raise NotPrefixStable(
                    f"chat template is not prefix-stable at turn {j + 1}: rendering the conversation up to "
                    "this turn is not a prefix of the whole (the template rewrites earlier turns)"
                )
            end = len(upto.rstrip())  # the end-of-turn token yes, the newline after it no
            if end > start:
                spans.append((start, end))
        return spans

    def answerable(self, messages: list[dict[str, str]], max_tokens: int) -> tuple[list[dict[str, str]], int]:
        """(a conversation worth answering again, its first prompt's tokens): a user turn before its
        first assistant turn, and a first prompt shorter than `max_tokens` (else no answer token would
        be kept: not asked). The regenerate stage asks for no more new tokens than fit after it."""
        first = next(j for j, m in enumerate(messages) if m["role"] == "assistant")
        if not any(m["role"] == "user" for m in messages[:first]):
            raise Rejected(f"turn {first + 1} is an assistant turn with no user turn before it: nothing to answer")
        try:
            prompt = self.tokenizer(self.render(messages[:first], generation_prompt=True), add_special_tokens=False)[
                "input_ids"
            ]
        except Exception as e:  # jinja raises for conversations the template refuses
            raise Rejected(f"chat template refused the conversation: {e}") from None
        if len(prompt) >= max_tokens:
            raise Rejected(
                f"over-long: no assistant token within the first {max_tokens} tokens (the first prompt alone "
                f"is {len(prompt)} tokens): not regenerated"
            )
        return messages, len(prompt)

    def sequences(self, messages: list[dict[str, str]], loss_on: str) -> list[tuple[np.ndarray, np.ndarray]]:
        """The conversation as one sequence, or, when the template rewrites earlier turns, one
        sequence per assistant turn (each with the prompt that turn was answered on)."""
        try:
            return [self.encode(messages, loss_on)]
        except NotPrefixStable:
            return self.encode_turns(messages, loss_on)

    def encode_turns(self, messages: list[dict[str, str]], loss_on: str) -> list[tuple[np.ndarray, np.ndarray]]:
        """One (input_ids, loss_mask) per assistant turn j: the rendering of turns 0..j, the loss
        on turn j only. Its prompt (turns before j with the generation prompt) must be a prefix of
        that rendering: what the model saw when it answered turn j."""
        turns = [j for j, m in enumerate(messages) if m["role"] == "assistant"]
        out = []
        for j in turns[-1:] if loss_on == "last" else turns:
            if not any(m["role"] == "user" for m in messages[:j]):
                raise Rejected(
                    f"turn {j + 1} is an assistant turn with no user turn before it (template rewrites earlier turns)"
                )
            try:
                prompt = self.render(messages[:j], generation_prompt=True)
                text = self.render(messages[: j + 1])
            except Exception as e:
                raise Rejected(f"chat template refused the conversation: {e}") from None
            if not text.startswith(prompt):
                raise Rejected(
                    f"chat template is not prefix-stable at turn {j + 1} even on its own: the prompt rendered "
                    "with the generation prompt is not a prefix of the turn's rendering"
                )
            out.append(self._tokenize(text, [(len(prompt), len(text.rstrip()))]))
        return out

    def encode(self, messages: list[dict[str, str]], loss_on: str) -> tuple[np.ndarray, np.ndarray]:
        if self.generation_tags:
            return self._encode_tagged(messages, loss_on)
        try:
            text = self.render(messages)
        except Exception as e:  # jinja raises for conversations the template refuses
            raise Rejected(f"chat template refused the conversation: {e}") from None
        spans = self.assistant_spans(messages, text)
        return self._tokenize(text, spans[-1:] if loss_on == "last" else spans)

    def _tokenize(self, text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, loss_mask) of `text`, the loss on the tokens inside the character spans."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int32)
        mask = np.zeros(len(ids), dtype=np.uint8)
        offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        for a, b in spans:
            # a token belongs to the turn when it starts inside the span
            mask[(offsets[:, 0] >= a) & (offsets[:, 0] < b) & (offsets[:, 1] > offsets[:, 0])] = 1
        return ids, mask

    def _encode_tagged(self, messages: list[dict[str, str]], loss_on: str) -> tuple[np.ndarray, np.ndarray]:
        try:
            out = self.tokenizer.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
        except Exception as e:
            raise Rejected(f"chat template refused the conversation: {e}") from None
        ids = np.asarray(out["input_ids"], dtype=np.int32)
        mask = np.asarray(out["assistant_masks"], dtype=np.uint8)
        if loss_on == "last" and mask.any():
            starts = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8)])) == 1)
            mask[: starts[-1]] = 0  # only the last contiguous assistant span
        return ids, mask


# --------------------------------------------------------------------------------------
# The ingest job
# --------------------------------------------------------------------------------------
def fit(ids: np.ndarray, mask: np.ndarray, opts: IngestOptions) -> tuple[np.ndarray, np.ndarray]:
    """A sequence within `max_tokens` (truncated or refused by `overlong`)."""
    if len(ids) > opts.max_tokens:
        if opts.overlong == "reject":
            raise Rejected(f"over-long: {len(ids)} tokens > max {opts.max_tokens}")
        ids, mask = ids[: opts.max_tokens], mask[: opts.max_tokens]
        if not mask.any():
            raise Rejected(f"over-long: no assistant token within the first {opts.max_tokens} tokens (truncated)")
    if not mask.any():
        raise Rejected("no assistant token after templating (empty assistant turns?)")
    return ids, mask


def write_token_shard(store: ObjectStore, run: str, name: str, sequences: list[dict[str, np.ndarray]]) -> ShardRecord:
    """A token shard, its object before its record (the record means: this shard is whole)."""
    shard = pack(sequences, extra_metadata={"run": run, "shard": name})
    data = shard.to_bytes()
    key = layout.shard(run, "tokens", name)
    sha = store.put_bytes(key, data)
    record = ShardRecord(
        run=run,
        shard=name,
        kind="tokens",
        key=key,
        sha256=sha,
        bytes=len(data),
        sequences=shard.num_sequences,
        tokens=shard.num_tokens,
        loss_tokens=int(shard.loss_mask.sum()),
    )
    store.put_json(layout.shard_record(run, "tokens", name), record)
    return record


def build_run_spec(settings: Settings, request: IngestRequest) -> RunSpec:
    """The run spec a request describes: target pinned by hashes, engine, capture points."""
    from aerie_extractor.engines import engine_spec

    target = describe(request.model)
    points = (
        validate_capture_points(request.capture_points, target.num_layers)
        if request.capture_points
        else default_capture_points(target.num_layers)
    )
    engine = engine_spec(settings, request.engine or settings.engine, target, points, request.dtype)
    if engine.transport == "json" and request.target_signal == "final":
        raise IngestError(
            f"run {request.run!r} wants target_signal 'final', but the SGLang server gives this extractor JSON only (it "
            "advertises no aerie plugin, or its captures are not readable here), and JSON carries top-k log-probs only: "
            "start SGLang with AERIE_SGLANG_BINARY=1 and a sink this extractor reads (AERIE_ENGINE_SINK=s3 when they run "
            "in other pods), or ingest with target_signal 'topk'"
        )
    if request.scale_block and target.hidden_size % request.scale_block:
        raise IngestError(
            f"run {request.run!r}: scale_block {request.scale_block} does not divide the target's hidden size "
            f"{target.hidden_size}: pick a divisor, or leave it unset (128 where it divides, else one scale per row)"
        )
    scale_block = request.scale_block
    if request.storage_dtype is not None and scale_block is None:
        scale_block = default_scale_block(target.hidden_size)
    return RunSpec(
        run=request.run,
        dataset=request.dataset,
        target=target,
        engine=engine,
        capture_points=points,
        dtype=request.dtype,
        storage_dtype=request.storage_dtype,
        scale_block=scale_block,
        target_signal=request.target_signal,
        topk=request.topk if request.target_signal == "topk" else None,
        ingest=request.options,
    )


def _same_run(a: RunSpec, b: RunSpec) -> bool:
    skip = {"created_at"}
    return a.model_dump(exclude=skip) == b.model_dump(exclude=skip)


def run_ingest(store: ObjectStore, settings: Settings, request: IngestRequest) -> IngestResult:
    """Tokenize `request.dataset` into `runs/<run>/tokens/*` and write `runs/<run>/run.json`.

    Re-running the same request (a redelivered task) finds run.json and returns the shards
    already written; the same run name with another request is refused.
    """
    spec = build_run_spec(settings, request)
    summary = IngestResult(run=request.run)
    try:
        existing = store.get_json(layout.run_spec(request.run), RunSpec)
    except NotFound:
        existing = None
    if existing is not None:
        if not _same_run(existing, spec):
            raise IngestError(
                f"run {request.run!r} already exists in {store.url} with another dataset/model/options "
                f"(dataset {existing.dataset!r}): choose another run name or delete runs/{request.run}/"
            )
        summary.skipped = True
        summary.shards = shard_names(store, request.run, "tokens")
        if existing.ingest.regenerate:  # the regenerate stage writes those tokens: its shards are the work
            summary.shards, summary.regenerate_shards = [], conversation_shards(store, request.run)
        return summary

    opts: IngestOptions = request.options
    source, chunks = _byte_chunks(store, request.dataset, settings.ingest_local_dirs)  # refused before any work
    chat = ChatTokenizer(request.model)
    pending: list[dict[str, np.ndarray]] = []
    conversations: list[dict] = []  # regenerate: the next conversation shard
    pending_tokens = 0
    rejects: list[RejectRecord] = []

    overflow = 0  # parts written because REJECTS_PART rejects piled up before a shard was

    def flush_rejects(part: str) -> None:
        if rejects:
            store.put_bytes(
                layout.rejects(request.run, part, len(rejects)),
                b"".join(r.model_dump_json().encode() + b"\n" for r in rejects),
            )
            summary.rejects += len(rejects)
            rejects.clear()

    def flush_conversations() -> None:
        name = layout.shard_name(len(summary.regenerate_shards))
        store.put_bytes(
            layout.conversations(request.run, name),
            b"".join(json.dumps(c, ensure_ascii=False).encode() + b"\n" for c in conversations),
        )
        flush_rejects(name)
        summary.regenerate_shards.append(name)
        conversations.clear()

    def flush_shard() -> None:
        nonlocal pending_tokens
        name = layout.shard_name(len(summary.shards))
        record = write_token_shard(store, request.run, name, pending)
        flush_rejects(name)
        summary.shards.append(name)
        summary.sequences += record.sequences
        summary.tokens += record.tokens
        summary.loss_tokens += record.loss_tokens
        pending.clear()
        pending_tokens = 0

    accepted = 0
    for line, record in iter_records(chunks, opts.max_record_bytes):
        try:
            if isinstance(record, Rejected):
                raise record
            messages = normalize(record)
            if opts.regenerate:  # answered by the regenerate stage, tokenized there
                answerable, prompt_tokens = chat.answerable(messages, opts.max_tokens)
                conversations.append(
                    {"line": line, "source": source, "messages": answerable, "prompt_tokens": prompt_tokens}
                )
                if len(conversations) >= opts.regenerate_shard_records:
                    flush_conversations()
                accepted += 1
                if opts.max_records and accepted >= opts.max_records:
                    break
                continue
            fitted = []
            for ids, mask in chat.sequences(messages, opts.loss_on):
                summary.truncated += len(ids) > opts.max_tokens and opts.overlong == "truncate"  # refused after, too
                fitted.append(fit(ids, mask, opts))
        except Rejected as e:
            rejects.append(RejectRecord(source=source, line=line, reason=str(e)))
            if len(rejects) >= REJECTS_PART:  # streamed to the store, never all held
                shard = layout.shard_name(max(len(summary.shards), len(summary.regenerate_shards)))
                flush_rejects(f"{shard}-p{overflow:06d}")
                overflow += 1
            continue
        for ids, mask in fitted:
            if pending and pending_tokens + len(ids) > opts.shard_tokens:
                flush_shard()
            pending.append({"input_ids": ids, "loss_mask": mask})
            pending_tokens += len(ids)
        accepted += 1
        if opts.max_records and accepted >= opts.max_records:
            break
    if pending:
        flush_shard()
    if conversations:
        flush_conversations()
    # a part no shard wrote: never overwrites one
    flush_rejects(layout.shard_name(max(len(summary.shards), len(summary.regenerate_shards))))
    if not store.exists(layout.run_spec(request.run)):  # a twin delivery may have finished first
        store.put_json(layout.run_spec(request.run), spec)
    store.delete(layout.ingest_failure(request.run))  # an earlier attempt's, if any
    log.info(
        "ingest %s: %d shards, %d sequences, %d tokens, %d rejects%s",
        request.run,
        len(summary.shards),
        summary.sequences,
        summary.tokens,
        summary.rejects,
        f", {accepted} conversations in {len(summary.regenerate_shards)} shards to regenerate"
        if opts.regenerate
        else "",
    )
    return summary
