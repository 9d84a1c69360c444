"""The `hf` engine and `run_extract`, in process: stored tensors equal a plain transformers forward.

The reference is computed here independently: the full causal LM, one sequence at a time, no
padding, `output_hidden_states[k]` for capture point k and `[N]` for the final state.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aerie import layout
from aerie.contracts import ExtractRequest, IngestOptions, IngestRequest, RunSpec, ShardRecord
from aerie.settings import Settings
from aerie.shard import Shard, np_dtype, pack
from aerie_extractor.engines import EngineMismatch, make_engine
from aerie_extractor.engines.hf import length_batches
from aerie.runs import run_status
from aerie_extractor.extract import ExtractError, extract_shards, run_extract
from aerie_extractor.ingest import run_ingest
from tests.conftest import POINTS
from tests.runs import DATA

def ingest(store, smollm2_path, run: str, dtype: str = "float32", signal: str = "final") -> RunSpec:
    run_ingest(store, Settings(engine="hf", ingest_local_dirs=[DATA]), IngestRequest(
        run=run, dataset=str(DATA / "malformed.jsonl"), model=str(smollm2_path), capture_points=POINTS,
        dtype=dtype, target_signal=signal, topk=5, options=IngestOptions(max_tokens=96, shard_tokens=80),
    ))
    return store.get_json(layout.run_spec(run), RunSpec)


def test_stored_hidden_states_equal_the_reference_forward(fs_store, smollm2_path, reference):
    spec = ingest(fs_store, smollm2_path, "ref")
    # a small token budget forces several padded batches inside one shard
    settings = Settings(engine="hf", tokens_per_batch=96)
    shards = [k.split("/")[-1][:-5] for k in fs_store.list(layout.shards_prefix("ref", "tokens")) if k.endswith(".json")]
    assert len(shards) >= 2
    for name in shards:
        summary = run_extract(fs_store, settings, ExtractRequest(run="ref", shard=name))
        assert not summary.skipped
    checked = 0
    for name in shards:
        record = fs_store.get_json(layout.shard_record("ref", "hidden", name), ShardRecord)
        assert record.sha256 == fs_store.sha256(record.key) and record.engine == spec.engine
        hidden = Shard.open(fs_store.local_path(record.key)).validate()
        tokens = Shard.from_buffer(fs_store.get_bytes(layout.shard("ref", "tokens", name)))
        assert np.array_equal(hidden.input_ids, tokens.input_ids) and np.array_equal(hidden.loss_mask, tokens.loss_mask)
        assert hidden.capture_points == POINTS and hidden.aux.dtype == np.float32
        for seq in hidden.sequences():
            aux, final, _ = reference(seq["input_ids"])
            torch.testing.assert_close(torch.from_numpy(np.array(seq["aux"])), aux, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(torch.from_numpy(np.array(seq["final"])), final, rtol=1e-4, atol=1e-4)
            checked += 1
    assert checked == 3
    status = run_status(fs_store, "ref")
    assert status.complete and status.hidden_done == status.shards_total == len(shards) and status.sequences == 3
    # idempotent: a second delivery finds the valid shard and skips it
    assert run_extract(fs_store, settings, ExtractRequest(run="ref", shard=shards[0])).skipped


def test_half_written_shard_is_redone(fs_store, smollm2_path):
    ingest(fs_store, smollm2_path, "half", dtype="bfloat16")
    settings = Settings(engine="hf")
    run_extract(fs_store, settings, ExtractRequest(run="half", shard="000000"))
    key = layout.shard("half", "hidden", "000000")
    good = fs_store.get_bytes(key)
    fs_store.put_bytes(key, good[: len(good) // 2])  # a torn object under a record
    summary = run_extract(fs_store, settings, ExtractRequest(run="half", shard="000000"))
    assert not summary.skipped and fs_store.get_bytes(key) == good  # deterministic, complete again
    fs_store.delete(layout.shard_record("half", "hidden", "000000"))  # object without a record
    assert not run_extract(fs_store, settings, ExtractRequest(run="half", shard="000000")).skipped
    assert Shard.from_buffer(fs_store.get_bytes(key)).validate().aux.dtype.name == "bfloat16"


def test_pipelined_extraction_stores_what_packing_the_captures_stores(fs_store, smollm2_path):
    """`extract_shards` (the engine writes straight into the shard; background threads validate,
    hash and store) stores byte for byte what packing `capture()`'s per-sequence results stores,
    skips valid shards, and raises the first error only after the shards before it are stored."""
    spec = ingest(fs_store, smollm2_path, "pipe", dtype="bfloat16")
    settings = Settings(engine="hf", tokens_per_batch=96)
    names = [k.split("/")[-1][:-5] for k in fs_store.list(layout.shards_prefix("pipe", "tokens")) if k.endswith(".json")]
    requests = [ExtractRequest(run="pipe", shard=n) for n in names]
    with pytest.raises(ExtractError, match="no token shard '000099'"):
        extract_shards(fs_store, settings, [requests[0], ExtractRequest(run="pipe", shard="000099"), *requests[1:]], writers=2)
    assert fs_store.exists(layout.shard_record("pipe", "hidden", names[0]))  # stored before the error surfaced
    summaries = extract_shards(fs_store, settings, requests, writers=2)
    assert summaries[0].skipped and not any(s.skipped for s in summaries[1:])
    engine = make_engine(settings, spec)
    engine.check(spec)
    for name in names:
        tokens = Shard.from_buffer(fs_store.get_bytes(layout.shard("pipe", "tokens", name)))
        captured = engine.capture([s["input_ids"] for s in tokens.sequences()])
        rows = [{"input_ids": s["input_ids"], "loss_mask": s["loss_mask"], "aux": c.aux, "final": c.final}
                for s, c in zip(tokens.sequences(), captured)]
        expected = pack(rows, POINTS, extra_metadata={"run": "pipe", "shard": name, "engine": "hf"}).to_bytes()
        record = fs_store.get_json(layout.shard_record("pipe", "hidden", name), ShardRecord)
        assert fs_store.get_bytes(record.key) == expected and record.bytes == len(expected)
        assert record.sha256 == fs_store.sha256(record.key)
    assert all(s.skipped for s in extract_shards(fs_store, settings, requests))


def test_topk_signal_is_the_target_log_softmax(fs_store, smollm2_path, reference):
    spec = ingest(fs_store, smollm2_path, "topk", signal="topk")
    engine = make_engine(Settings(engine="hf"), spec)
    engine.check(spec)
    ids = Shard.from_buffer(fs_store.get_bytes(layout.shard("topk", "tokens", "000000"))).sequence(0)["input_ids"]
    (cap,) = engine.capture([ids])
    _, _, logits = reference(ids)
    top = torch.topk(torch.log_softmax(logits, -1), 5, dim=-1)
    assert np.array_equal(cap.topk_ids, top.indices.int().numpy())
    torch.testing.assert_close(torch.from_numpy(cap.topk_logprobs), top.values, rtol=1e-4, atol=1e-4)


def test_engine_refuses_another_target_or_other_layers(fs_store, smollm2_path):
    spec = ingest(fs_store, smollm2_path, "mismatch")
    engine = make_engine(Settings(engine="hf"), spec)
    other_weights = spec.model_copy(update={"target": spec.target.model_copy(update={"weights_sha256": "0" * 64})})
    with pytest.raises(EngineMismatch, match="weights_sha256"):
        engine.check(other_weights)
    other_ids = spec.model_copy(update={"engine": spec.engine.model_copy(update={"layer_ids": [1, 14, 26]})})
    with pytest.raises(EngineMismatch, match=r"\[1, 14, 26\].*\[2, 15, 27\]"):
        engine.check(other_ids)


def test_length_batches_respect_the_token_budget():
    lengths = [5, 90, 40, 41, 7, 200]
    batches = length_batches(lengths, 100)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 100


def test_capture_into_places_on_its_helper_thread_what_the_launching_thread_placed(fs_store, smollm2_path):
    """capture_into's rows placed by its helper thread (the default) equal bit for bit those placed
    by the launching thread one batch behind (place_thread False, the path before) and capture()'s,
    over enough batches to reuse each host buffer; every row is written (the arrays start as NaN)."""
    spec = ingest(fs_store, smollm2_path, "helper", dtype="bfloat16")
    engine = make_engine(Settings(engine="hf", tokens_per_batch=48), spec)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(100, 40000, n).astype(np.int32) for n in (5, 40, 17, 33, 9, 26, 12, 40)]
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
    assert len(length_batches([len(s) for s in seqs], 48)) >= 5
    T, K, H = int(offsets[-1]), len(POINTS), spec.target.hidden_size
    placed = {}
    for helper in (True, False):
        engine.place_thread = helper
        aux, final = np.full((T, K, H), np.nan, dtype=np_dtype("bfloat16")), np.full((T, H), np.nan, dtype=np_dtype("bfloat16"))
        assert engine.capture_into(seqs, offsets, aux, final)
        placed[helper] = (aux.view(np.uint16), final.view(np.uint16))
    assert all(np.array_equal(a, b) for a, b in zip(placed[True], placed[False]))
    aux, final = placed[True]
    for i, cap in enumerate(engine.capture(seqs)):
        a, b = offsets[i], offsets[i + 1]
        assert np.array_equal(aux[a:b], cap.aux.view(np.uint16)) and np.array_equal(final[a:b], cap.final.view(np.uint16))
