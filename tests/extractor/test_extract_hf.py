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
from aerie.runs import run_status
from aerie.settings import Settings
from aerie.shard import Shard, np_dtype, pack, quantize_e4m3
from aerie_extractor.engines import EngineError, EngineMismatch, make_engine
from aerie_extractor.engines.hf import length_batches
from aerie_extractor.engines.hf import quantize_e4m3 as quantize_on_device
from aerie_extractor.extract import ExtractError, extract_shards, run_extract
from aerie_extractor.ingest import run_ingest
from tests.conftest import POINTS
from tests.runs import DATA


def ingest(store, smollm2_path, run: str, dtype: str = "float32", signal: str = "final", **fp8) -> RunSpec:
    run_ingest(
        store,
        Settings(engine="hf", ingest_local_dirs=[DATA]),
        IngestRequest(
            run=run,
            dataset=str(DATA / "malformed.jsonl"),
            model=str(smollm2_path),
            capture_points=POINTS,
            dtype=dtype,
            target_signal=signal,
            topk=5,
            options=IngestOptions(max_tokens=96, shard_tokens=80),
            **fp8,
        ),
    )
    return store.get_json(layout.run_spec(run), RunSpec)


def test_stored_hidden_states_equal_the_reference_forward(fs_store, smollm2_path, reference):
    spec = ingest(fs_store, smollm2_path, "ref")
    # a small token budget forces several padded batches inside one shard
    settings = Settings(engine="hf", tokens_per_batch=96)
    shards = [
        k.split("/")[-1][:-5] for k in fs_store.list(layout.shards_prefix("ref", "tokens")) if k.endswith(".json")
    ]
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
    names = [
        k.split("/")[-1][:-5] for k in fs_store.list(layout.shards_prefix("pipe", "tokens")) if k.endswith(".json")
    ]
    requests = [ExtractRequest(run="pipe", shard=n) for n in names]
    with pytest.raises(ExtractError, match="no token shard '000099'"):
        extract_shards(
            fs_store, settings, [requests[0], ExtractRequest(run="pipe", shard="000099"), *requests[1:]], writers=2
        )
    assert fs_store.exists(layout.shard_record("pipe", "hidden", names[0]))  # stored before the error surfaced
    summaries = extract_shards(fs_store, settings, requests, writers=2)
    assert summaries[0].skipped and not any(s.skipped for s in summaries[1:])
    engine = make_engine(settings, spec)
    engine.check(spec)
    for name in names:
        tokens = Shard.from_buffer(fs_store.get_bytes(layout.shard("pipe", "tokens", name)))
        captured = engine.capture([s["input_ids"] for s in tokens.sequences()])
        rows = [
            {"input_ids": s["input_ids"], "loss_mask": s["loss_mask"], "aux": c.aux, "final": c.final}
            for s, c in zip(tokens.sequences(), captured)
        ]
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


def test_capture_into_places_on_its_helper_thread_what_capture_returns(fs_store, smollm2_path):
    """capture_into's rows, placed by its helper thread, equal capture()'s bit for bit over enough
    batches to reuse each host buffer; every row is written (the arrays start as NaN)."""
    spec = ingest(fs_store, smollm2_path, "helper", dtype="bfloat16")
    engine = make_engine(Settings(engine="hf", tokens_per_batch=48), spec)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(100, 40000, n).astype(np.int32) for n in (5, 40, 17, 33, 9, 26, 12, 40)]
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
    assert len(length_batches([len(s) for s in seqs], 48)) >= 5
    T, K, H = int(offsets[-1]), len(POINTS), spec.target.hidden_size
    aux, final = (
        np.full((T, K, H), np.nan, dtype=np_dtype("bfloat16")),
        np.full((T, H), np.nan, dtype=np_dtype("bfloat16")),
    )
    assert engine.capture_into(seqs, offsets, aux, final)
    aux, final = aux.view(np.uint16), final.view(np.uint16)
    for i, cap in enumerate(engine.capture(seqs)):
        a, b = offsets[i], offsets[i + 1]
        assert np.array_equal(aux[a:b], cap.aux.view(np.uint16)) and np.array_equal(
            final[a:b], cap.final.view(np.uint16)
        )


def test_async_captures_back_to_back_fill_each_shard_as_one_call_does(fs_store, smollm2_path):
    """Shards launched back to back with capture_into_async (the device not drained between them,
    the helper placing across calls) hold the bits one capture_into per shard gives; a forward that
    fails mid-shard raises at once, and by then every row of that shard handed to the helper is
    placed (nothing writes into the caller's arrays after the raise)."""
    spec = ingest(fs_store, smollm2_path, "async", dtype="bfloat16")
    engine = make_engine(Settings(engine="hf", tokens_per_batch=48), spec)
    rng = np.random.default_rng(2)
    shards = [
        [rng.integers(100, 40000, n).astype(np.int32) for n in lens]
        for lens in ((5, 40, 17, 33), (9, 26, 12, 40, 3), (21, 8))
    ]
    K, H, bf16 = len(POINTS), spec.target.hidden_size, np_dtype("bfloat16")

    def arrays(seqs):
        offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
        T = int(offsets[-1])
        return offsets, np.full((T, K, H), np.nan, dtype=bf16), np.full((T, H), np.nan, dtype=bf16)

    one = []
    for seqs in shards:
        offsets, aux, final = arrays(seqs)
        assert engine.capture_into(seqs, offsets, aux, final)
        one.append((aux.view(np.uint16), final.view(np.uint16)))
    launched = []
    for seqs in shards:
        offsets, aux, final = arrays(seqs)
        launched.append((engine.capture_into_async(seqs, offsets, aux, final), aux, final))
    for (future, aux, final), (aux1, final1) in zip(launched, one):
        assert future.result() is True
        assert np.array_equal(aux.view(np.uint16), aux1) and np.array_equal(final.view(np.uint16), final1)

    forward, calls = engine._checked_forward, []

    def failing(batch):
        calls.append(len(batch))
        if len(calls) == 3:
            raise EngineError("the device fell over")
        return forward(batch)

    engine._checked_forward = failing
    offsets, aux, final = arrays(shards[1])
    with pytest.raises(EngineError, match="fell over"):
        engine.capture_into_async(shards[1], offsets, aux, final)
    assert all(f is None or f.done() for f in engine._placing)
    placed = ~np.isnan(final.astype(np.float32)).all(axis=1)
    assert placed.any() and not placed.all()  # the two batches before the failure, and no more
    assert np.array_equal(final.view(np.uint16)[placed], one[1][1][placed])


def test_every_capture_runs_on_the_engines_own_thread_whichever_thread_asks(fs_store, smollm2_path):
    """Captures asked for by the main thread, by pool threads (a threads-pool worker's tasks) and
    two at once all run their forwards on the engine's one launching thread (torch's per-thread
    state, such as cuDNN attention's graph cache, is then built once), with the same bits; a
    forward's error reaches the thread that asked, and close() ends the launching thread."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    spec = ingest(fs_store, smollm2_path, "launcher", dtype="bfloat16")
    engine = make_engine(Settings(engine="hf", tokens_per_batch=48), spec)
    rng = np.random.default_rng(3)
    seqs = [rng.integers(100, 40000, n).astype(np.int32) for n in (7, 30, 19)]
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
    K, H, bf16 = len(POINTS), spec.target.hidden_size, np_dtype("bfloat16")
    forward, ran_on = engine._checked_forward, set()

    def recorded(batch):
        ran_on.add(threading.current_thread())
        return forward(batch)

    engine._checked_forward = recorded

    def capture() -> tuple[np.ndarray, np.ndarray]:
        T = int(offsets[-1])
        aux, final = np.full((T, K, H), np.nan, dtype=bf16), np.full((T, H), np.nan, dtype=bf16)
        assert engine.capture_into(seqs, offsets, aux, final)
        return aux.view(np.uint16), final.view(np.uint16)

    here = capture()
    with ThreadPoolExecutor(2) as pool:
        there = [f.result() for f in [pool.submit(capture) for _ in range(4)]]
    assert ran_on == {engine._launch_thread} and engine._launch_thread is not threading.current_thread()
    assert all(np.array_equal(a, here[0]) and np.array_equal(f, here[1]) for a, f in there)
    assert engine.capture(seqs)[1].aux.shape == (30, K, H) and ran_on == {engine._launch_thread}

    def failing(batch):
        raise EngineError("the device fell over")

    engine._checked_forward = failing
    with ThreadPoolExecutor(1) as pool:
        with pytest.raises(EngineError, match="fell over"):
            pool.submit(capture).result()
    engine.close()
    assert not engine._launch_thread.is_alive()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("block", [None, 64])
def test_device_quantization_gives_the_writers_bits(dtype, block):
    """The hf engine's fp8 quantization (torch, here on the CPU; bench_capture_path checks it on a
    GPU) gives the bits of the writers' numpy `quantize_e4m3`: values over nine orders of
    magnitude, rows whose small values fall into e4m3's subnormals, zero rows and blocks, and
    values a hair below a rounding tie; a NaN gives a NaN scale."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((300, 4, 576)) * 10.0 ** rng.integers(-6, 4, (300, 4, 1))
    x[5, 1] = 0.0
    x[6, 2, :64] = 0.0
    x[7, 0, 1:] *= 1e-5  # one large value: the rest land in the subnormals
    x[8, 3] = np.linspace(-448, 448, 576) * (1 + 2.0**-20)
    x = x.astype(np_dtype(dtype))
    q, scale = quantize_e4m3(x, block)
    xt = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) if dtype == "bfloat16" else torch.from_numpy(x)
    qt, st = quantize_on_device(xt, block or 576)
    assert np.array_equal(qt.view(torch.uint8).numpy(), q.view(np.uint8))
    assert np.array_equal(st.numpy().view(np.uint32), scale.view(np.uint32))
    x32 = x.astype(np.float32)
    x32[9, 0, 3] = np.nan
    _, st = quantize_on_device(torch.from_numpy(x32), block or 576)
    assert torch.isnan(st[9, 0, 0]) and not torch.isnan(st[9, 1:]).any()


def test_fp8_run_stores_the_same_bytes_quantized_on_the_device_or_by_the_writer(fs_store, smollm2_path):
    """An fp8 run (scale per 64 values) extracted with the hf engine quantizing on the device (the
    default) stores byte for byte what the writers' quantization stores, by `run_extract` (one
    task after another, the arrays reused) and by `extract_shards`."""
    ingest(fs_store, smollm2_path, "fp8", dtype="bfloat16", storage_dtype="float8_e4m3fn", scale_block=64)
    settings = Settings(engine="hf", tokens_per_batch=48)
    names = [k.split("/")[-1][:-5] for k in fs_store.list(layout.shards_prefix("fp8", "tokens")) if k.endswith(".json")]
    requests = [ExtractRequest(run="fp8", shard=n) for n in names]
    stored = {}
    for on_device in (True, False):
        for how in ("tasks", "pipelined"):
            fs_store.delete_prefix(layout.shards_prefix("fp8", "hidden"))
            engine = make_engine(settings, fs_store.get_json(layout.run_spec("fp8"), RunSpec))
            engine.quantize_on_device = on_device
            if how == "tasks":
                assert not any(run_extract(fs_store, settings, r, engine=engine).skipped for r in requests)
            else:
                extract_shards(fs_store, settings, requests, engine=engine, writers=2)
            stored[on_device, how] = [fs_store.get_bytes(layout.shard("fp8", "hidden", n)) for n in names]
    assert len(set(map(tuple, stored.values()))) == 1
    shard = Shard.from_buffer(stored[True, "tasks"][0])
    assert shard.quantized and shard.scale_block == 64 and str(shard.states_dtype) == "BF16"
