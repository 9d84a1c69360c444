"""Runs for the tests: the data files, and hidden-state runs made the way the pipeline makes them.

`hidden_run_folder` makes a real run with the pipeline's own stages (ShareGPT conversations,
`hf` engine, SmolLM2-135M). Runs are cached on disk by their inputs (the target forward is the
slow part) and copied into each test's store with `upload_run`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from aerie import layout
from aerie.app.harness import sharegpt_conversations  # noqa: F401 (tests import it from here)
from aerie.capture import default_capture_points
from aerie.contracts import IngestOptions, RunSpec, ShardRecord
from aerie.runs import shard_names

DATA = Path(__file__).parent / "data"

# line -> the reason's start, for tests/data/malformed.jsonl with max_tokens 96, overlong reject
MALFORMED_REJECTS = {
    2: "bad JSON: ",
    3: "no assistant turn",
    4: "unknown role 'bot' in turn 2",
    5: "empty content in turn 2",
    6: "wrong type: turn 1 'content' is int",
    7: "wrong type: the record is a list",
    9: "over-long: ",
    11: "wrong type: 'conversations' is a string",
}

CACHE_VERSION = "3"


def held_out_chats(tokenizer, n: int, skip: int, chars: int, max_tokens: int, min_tokens: int) -> list[list[int]]:
    """Token ids of ShareGPT conversations after the first `skip` (their first user turn and answer,
    each cut to `chars` characters, in the tokenizer's chat template; at most `max_tokens`), those
    longer than `min_tokens`: held-out text for the benchmarks' teacher-forced measures."""
    out = []
    for conv in sharegpt_conversations(n, skip):
        messages = [
            {"role": "user" if t["from"] == "human" else "assistant", "content": t["value"][:chars]} for t in conv[:2]
        ]
        ids = tokenizer.apply_chat_template(messages, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)[:max_tokens]
        if len(ids) > min_tokens:
            out.append(ids)
    return out


def hidden_run_folder(
    cache_dir: Path,
    model_dir: Path,
    *,
    records: int,
    skip: int = 0,
    max_tokens: int = 256,
    shard_sequences: int = 16,
    signal: str = "final",
    topk: int = 20,
    points: list[int] | None = None,
    dtype: str = "bfloat16",
) -> Path:
    """A filesystem store holding run `RUN`: ShareGPT conversations (user turns cut to 200
    characters, so short sequences are mostly assistant text) ingested and extracted by the
    pipeline's own stages (aerie.stages: ingest, extract) with the `hf` engine. Built once per inputs.
    `points`: capture points other than the default [2, N//2, N-3]; `dtype`: of the states (and the forward)."""
    from aerie import stages
    from aerie.contracts import ExtractRequest, IngestRequest
    from aerie.settings import Settings
    from aerie.store import FsStore
    from aerie.target import describe

    target = describe(model_dir, name="SmolLM2-135M-Instruct")
    inputs = [CACHE_VERSION, target.weights_sha256, records, skip, max_tokens, shard_sequences, signal, topk]
    inputs += ([points] if points else []) + ([dtype] if dtype != "bfloat16" else [])  # the older keys stay
    key = hashlib.sha256(json.dumps(inputs).encode()).hexdigest()[:16]
    folder = Path(cache_dir) / "test-hidden-runs" / key
    if _complete(folder):
        return folder
    tmp = folder.with_name(f"{folder.name}.part-{os.getpid()}")  # concurrent builders do not collide
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    dataset = tmp / "sharegpt.jsonl"
    with open(dataset, "w") as f:
        for conv in sharegpt_conversations(records, skip):
            turns = [{**t, "value": t["value"][:200]} if t.get("from") == "human" else t for t in conv]
            f.write(json.dumps({"conversations": turns}) + "\n")
    store = FsStore(tmp)
    settings = Settings(
        store=f"file://{tmp}", engine="hf", device="cpu", tokens_per_batch=2048, ingest_local_dirs=[tmp]
    )
    points = points or default_capture_points(target.num_layers)
    ingested = stages.ingest(
        store,
        settings,
        IngestRequest(
            run="RUN",
            dataset=str(dataset),
            model=str(model_dir),
            capture_points=points,
            engine="hf",
            dtype=dtype,
            target_signal=signal,
            topk=topk,
            options=IngestOptions(max_tokens=max_tokens, shard_tokens=shard_sequences * max_tokens),
        ),
    )
    for shard in ingested.shards:
        stages.extract(store, settings, ExtractRequest(run="RUN", shard=shard))
    (tmp / "sharegpt.jsonl").unlink()
    if _complete(folder):  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    return folder


def _complete(folder: Path) -> bool:
    """run.json written and every token shard extracted."""
    if not (folder / layout.run_spec("RUN")).is_file():
        return False
    from aerie.runs import run_complete
    from aerie.store import FsStore

    return run_complete(FsStore(folder), "RUN")


def upload_run(store, folder: Path, run: str) -> RunSpec:
    """Copy run `RUN` of a cached store folder into `store` under the name `run`."""
    from aerie.store import FsStore

    cached = FsStore(folder)
    spec = cached.get_json(layout.run_spec("RUN"), RunSpec).model_copy(update={"run": run})
    for kind in ("tokens", "hidden"):  # both, as an extracted run holds them (the controller reads both)
        for name in shard_names(cached, "RUN", kind):
            store.put_file(layout.shard(run, kind, name), cached.local_path(layout.shard("RUN", kind, name)))
            rec = cached.get_json(layout.shard_record("RUN", kind, name), ShardRecord)
            store.put_json(
                layout.shard_record(run, kind, name),
                rec.model_copy(update={"run": run, "key": layout.shard(run, kind, name)}),
            )
    store.put_json(layout.run_spec(run), spec)
    return spec


def quantize_run(store, run: str, into: str, block: int | None = None) -> RunSpec:
    """Copy run `run` of `store` as run `into` with its states stored as fp8 (aerie.shard's
    quantization, as the extractor writes them with `storage_dtype: float8_e4m3fn`)."""
    import hashlib

    from aerie.shard import Shard

    spec = store.get_json(layout.run_spec(run), RunSpec)
    for name in shard_names(store, run, "hidden"):
        rec = store.get_json(layout.shard_record(run, "hidden", name), ShardRecord)
        data = Shard.from_buffer(store.get_bytes(rec.key)).quantize("float8_e4m3fn", block).to_bytes()
        key = layout.shard(into, "hidden", name)
        store.put_bytes(key, data)
        store.put_json(
            layout.shard_record(into, "hidden", name),
            rec.model_copy(
                update={"run": into, "key": key, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
            ),
        )
    fp8 = spec.model_copy(update={"run": into, "storage_dtype": "float8_e4m3fn", "scale_block": block})
    store.put_json(layout.run_spec(into), fp8)
    return fp8
