"""Extract: one token shard -> engine -> a validated hidden shard + its record in the store.

- Idempotent: a hidden shard whose record's sha256 matches the stored object is skipped; a
  shard without a record (a worker died between the two writes) or with a wrong hash is redone.
  Keys are deterministic, so a redelivered task can neither lose nor duplicate a shard.
- The engine is built once per process and run (`check()` before its first capture).
- A run's spec, status and failures are read through `aerie.runs` (the store is the interface).
- `extract_shards(...)` pipelines several shards in one process: background writers validate,
  hash and store shard i while the engine captures shard i+1 (benchmarks/gpu_pipeline.py uses
  it; a Celery task extracts one shard with `run_extract`).
- An engine with `capture_into` (the `hf` engine, signal "final") writes straight into the
  shard's arrays, and may report them checked finite on the device (no host pass over them).
  Its `capture_into_async` returns once the shard's batches are launched: the writer waits for
  the last rows, while the engine goes on to the next shard (extract_shards, or the next task of
  a threads-pool worker) without draining the device.
- A run with `storage_dtype` (fp8) is stored as e4m3 states with float32 scales, about half of
  bf16's bytes: quantized on the device by an engine that can (`quantize_on_device`, the hf
  engine), else by the writer (aerie.shard.Shard.quantize) after the finite check.
- The shard arrays an engine fills are reused from shard to shard within a process (`_spare`),
  by `extract_shards` and by one task after another (`run_extract`): fresh memory costs a page
  fault per 4 KB.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

import numpy as np

from aerie import layout
from aerie.contracts import ExtractRequest, ExtractResult, RunSpec, ShardRecord
from aerie.runs import RunError, load_run
from aerie.settings import Settings
from aerie.shard import FLOAT_DTYPES, Shard, ShardError, np_dtype, pack
from aerie.store import NotFound, ObjectStore
from aerie_extractor.engines import Engine, EngineMismatch, make_engine

log = logging.getLogger(__name__)


class ExtractError(RunError):
    """A shard that cannot be extracted as stored (corrupt or missing token shard)."""


# --------------------------------------------------------------------------------------
# One engine per process, per run
# --------------------------------------------------------------------------------------
_engine_lock = threading.Lock()
_engine: tuple[tuple, Engine] | None = None


def get_engine(settings: Settings, spec: RunSpec) -> Engine:
    """The process's engine for this run (built and checked on first use, then reused)."""
    global _engine
    key = (spec.run, spec.created_at, spec.engine.model_dump_json(), settings.device)
    with _engine_lock:
        if _engine is not None and _engine[0] == key:
            return _engine[1]
        if _engine is not None:
            _engine[1].close()
            _engine = None
        engine = make_engine(settings, spec)
        engine.check(spec)
        _engine = (key, engine)
        return engine


def drop_engine() -> None:
    global _engine
    with _engine_lock:
        if _engine is not None:
            _engine[1].close()
        _engine = None


# --------------------------------------------------------------------------------------
def hidden_is_valid(store: ObjectStore, run: str, shard: str) -> ShardRecord | None:
    """The hidden shard's record when the stored object matches it (sha256), else None."""
    try:
        record = store.get_json(layout.shard_record(run, "hidden", shard), ShardRecord)
        if store.sha256(record.key) == record.sha256:
            return record
        log.warning("%s: hidden shard %s does not match its record: redoing it", run, shard)
    except NotFound:
        pass
    return None


def load_tokens(store: ObjectStore, run: str, shard: str) -> Shard:
    try:
        record = store.get_json(layout.shard_record(run, "tokens", shard), ShardRecord)
    except NotFound:
        raise ExtractError(f"run {run!r} has no token shard {shard!r}: was it ingested? (runs/{run}/tokens/)") from None
    data = store.get_bytes(record.key)
    if hashlib.sha256(data).hexdigest() != record.sha256:
        raise ExtractError(f"token shard {record.key} does not match its record's sha256: re-ingest run {run!r}")
    try:
        return Shard.from_buffer(data).validate()
    except ShardError as e:
        raise ExtractError(f"token shard {record.key}: {e}") from e


def run_extract(
    store: ObjectStore,
    settings: Settings,
    request: ExtractRequest,
    engine: Engine | None = None,
) -> ExtractResult:
    """Extract one shard of a run; skip it when a valid hidden shard already exists."""
    started = time.monotonic()
    taken: list[np.ndarray] = []  # the spare arrays this shard took
    try:
        captured = _capture(
            store,
            settings,
            request,
            engine,
            empty=lambda shape, dtype: _spare.take(shape, dtype, taken),
        )
        if captured is None:
            return ExtractResult(run=request.run, shard=request.shard, skipped=True)
        return _store_hidden(store, started, *captured)
    finally:
        _spare.give(taken)
        _spare.trim(4 * settings.worker_concurrency)  # one shard's arrays per task in flight


def extract_shards(
    store: ObjectStore,
    settings: Settings,
    requests: list[ExtractRequest],
    engine: Engine | None = None,
    writers: int = 2,
) -> list[ExtractResult]:
    """`run_extract` for several shards, pipelined: while the engine captures shard i+1, up to
    `writers` threads validate, hash and store the shards before it (each thread holds one packed
    shard in memory, the queue is bounded by the same number; the arrays of stored shards are
    reused for the next ones). Same objects, records and idempotence as shard-by-shard
    `run_extract`; the first error is raised once the shards already handed to the writers are
    stored."""
    summaries: list[ExtractResult | None] = [None] * len(requests)
    in_flight: list[tuple[int, Future, list[np.ndarray]]] = []
    error: BaseException | None = None

    def collect(wait_for: int) -> None:  # take finished writes until at most `wait_for` remain
        nonlocal error
        while len(in_flight) > wait_for:
            j, future, taken = in_flight.pop(0)
            try:
                summaries[j] = future.result()
            except BaseException as e:  # noqa: BLE001 - raised below, after the other writes end
                error = error or e
            _spare.give(taken)  # written (or failed): the writer holds them no more

    with ThreadPoolExecutor(max_workers=max(1, writers), thread_name_prefix="aerie-shard-writer") as pool:
        for j, request in enumerate(requests):
            collect(max(1, writers))
            if error is not None:
                break
            started = time.monotonic()
            taken: list[np.ndarray] = []  # the spare arrays this shard took
            try:
                captured = _capture(
                    store,
                    settings,
                    request,
                    engine,
                    empty=lambda shape, dtype, taken=taken: _spare.take(shape, dtype, taken),
                )
            except BaseException as e:  # noqa: BLE001
                _spare.give(taken)
                error = e
                break
            if captured is None:
                _spare.give(taken)
                summaries[j] = ExtractResult(run=request.run, shard=request.shard, skipped=True)
                continue
            in_flight.append((j, pool.submit(_store_hidden, store, started, *captured), taken))
        collect(0)
    _spare.trim(4)  # one shard's arrays (aux, final and fp8's two scales) stay for what comes next
    if error is not None:
        raise error
    return summaries  # type: ignore[return-value]


def _capture(store: ObjectStore, settings: Settings, request: ExtractRequest, engine: Engine | None, empty=np.empty):
    """The engine's part of a shard: None when a valid hidden shard exists, else
    (request, spec, packed hidden shard, capture seconds, whether the engine checked it finite),
    or (..., None, `_Captured`) while an async capture still fills the shard.
    `empty(shape, dtype)` makes the arrays an engine with `capture_into` fills."""
    run, name = request.run, request.shard
    if hidden_is_valid(store, run, name) is not None:
        return None
    spec = load_run(store, run)
    tokens = load_tokens(store, run, name)
    if engine is None:
        engine = get_engine(settings, spec)
    sequences = [s["input_ids"] for s in tokens.sequences()]
    K, H = len(spec.capture_points), spec.target.hidden_size
    meta = {"run": run, "shard": name, "engine": spec.engine.name}
    t0 = time.monotonic()
    capture_into = getattr(engine, "capture_into", None)
    if spec.target_signal == "final" and capture_into is not None:
        # the engine writes straight into the shard's arrays: no per-sequence copies to pack
        T, dtype = tokens.num_tokens, np_dtype(spec.dtype)
        hidden = Shard(
            input_ids=tokens.input_ids,
            loss_mask=tokens.loss_mask,
            offsets=tokens.offsets,
            capture_points=list(spec.capture_points),
            extra_metadata=meta,
        )
        if spec.storage_dtype is not None and getattr(engine, "quantize_on_device", False):  # fp8 from the device
            G, fp8 = H // (spec.scale_block or H), np_dtype(spec.storage_dtype)
            hidden.aux, hidden.final = empty((T, K, H), fp8), empty((T, H), fp8)
            hidden.aux_scale, hidden.final_scale = empty((T, K, G), np.float32), empty((T, G), np.float32)
            hidden.states_dtype = FLOAT_DTYPES[spec.dtype]
        else:
            hidden.aux, hidden.final = empty((T, K, H), dtype), empty((T, H), dtype)
        arrays = (sequences, tokens.offsets, hidden.aux, hidden.final, hidden.aux_scale, hidden.final_scale)
        launch = getattr(engine, "capture_into_async", None)
        if launch is not None:
            return request, spec, hidden, None, _Captured(launch(*arrays), t0)
        finite = capture_into(*arrays)
        return request, spec, hidden, time.monotonic() - t0, finite
    captured = engine.capture(sequences)
    capture_seconds = time.monotonic() - t0
    if len(captured) != len(sequences):
        raise EngineMismatch(f"engine returned {len(captured)} results for {len(sequences)} sequences of shard {name}")
    rows: list[dict[str, Any]] = []  # the signal's arrays are set for the run's signal
    for i, (seq, cap) in enumerate(zip(tokens.sequences(), captured)):
        T = len(seq["input_ids"])
        if cap.aux.shape != (T, K, H):
            raise EngineMismatch(
                f"shard {name} sequence {i}: engine returned aux {list(cap.aux.shape)}, expected [{T}, {K}, {H}] "
                f"(tokens x capture points {spec.capture_points} x hidden size): wrong layer ids or wrong model?"
            )
        row: dict[str, Any] = {"input_ids": seq["input_ids"], "loss_mask": seq["loss_mask"], "aux": cap.aux}
        if spec.target_signal == "final":
            row["final"] = cap.final
        else:
            row["topk_ids"], row["topk_logprobs"] = cap.topk_ids, cap.topk_logprobs
        rows.append(row)
    return request, spec, pack(rows, spec.capture_points, extra_metadata=meta), capture_seconds, False


def _store_hidden(
    store: ObjectStore,
    started: float,
    request: ExtractRequest,
    spec: RunSpec,
    hidden: Shard,
    capture_seconds: float | None,
    finite: bool | _Captured,
) -> ExtractResult:
    """Validate, hash and write a packed hidden shard, then its record (in this order)."""
    run, name = request.run, request.shard
    if isinstance(finite, _Captured):  # the rows are in the arrays once the engine's future is done
        finite, capture_seconds = finite.result()
    stored = time.monotonic()
    try:
        hidden.validate(check_finite=not finite)
        if (
            spec.storage_dtype is not None and not hidden.quantized
        ):  # fp8: numpy only, in this writer thread (no torch on the SGLang path)
            hidden = hidden.quantize(spec.storage_dtype, spec.scale_block).validate()
    except ShardError as e:
        raise EngineMismatch(f"shard {name}: the engine's output is not a valid hidden shard: {e}") from e
    parts = hidden.parts()
    size = sum(p.nbytes for p in parts)
    key = layout.shard(run, "hidden", name)
    sha = store.put_parts(key, parts)
    seconds = time.monotonic() - started
    record = ShardRecord(
        run=run,
        shard=name,
        kind="hidden",
        key=key,
        sha256=sha,
        bytes=size,
        sequences=hidden.num_sequences,
        tokens=hidden.num_tokens,
        loss_tokens=int(hidden.loss_mask.sum()),
        engine=spec.engine,
        seconds=round(seconds, 3),
    )
    store.put_json(layout.shard_record(run, "hidden", name), record)
    store.delete(layout.shard_failure(run, name))
    return ExtractResult(
        run=run,
        shard=name,
        skipped=False,
        sequences=record.sequences,
        tokens=record.tokens,
        bytes=record.bytes,
        seconds=seconds,
        capture_seconds=cast(float, capture_seconds),  # set: by the caller, or by the engine's future above
        store_seconds=time.monotonic() - stored,
    )


class _Captured:
    """An async capture in flight (`capture_into_async`'s Future): when it ended is kept, so that
    the capture's seconds do not count the time its writer waited in the queue."""

    def __init__(self, future: Future, started: float):
        self.future, self.started, self.ended = future, started, None
        future.add_done_callback(lambda _: setattr(self, "ended", time.monotonic()))

    def result(self) -> tuple[bool, float]:
        """(finite flag, seconds from the launch to the last rows placed), once they are."""
        finite = self.future.result()
        return finite, (self.ended or time.monotonic()) - self.started


class _Spare:
    """Flat arrays of stored shards, kept for the next shards of this process: `take` hands out the
    smallest that fits, else a new one; `trim` keeps the largest few (at most what the tasks in
    flight hold: one shard's arrays per task; extract_shards trims what its writers held)."""

    def __init__(self):
        self.arrays, self.lock = [], threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: np.dtype, taken: list[np.ndarray]) -> np.ndarray:
        n = int(np.prod(shape))
        with self.lock:
            fits = [k for k, flat in enumerate(self.arrays) if flat.dtype == dtype and flat.size >= n]
            flat = self.arrays.pop(min(fits, key=lambda k: self.arrays[k].size)) if fits else None
        taken.append(np.empty(n, dtype=dtype) if flat is None else flat)
        return taken[-1][:n].reshape(shape)

    def give(self, taken: list[np.ndarray]) -> None:
        with self.lock:
            self.arrays.extend(taken)
        taken.clear()

    def trim(self, keep: int) -> None:
        with self.lock:
            self.arrays.sort(key=lambda a: -a.nbytes)
            del self.arrays[keep:]


_spare = _Spare()


__all__ = [
    "ExtractError",
    "drop_engine",
    "extract_shards",
    "get_engine",
    "hidden_is_valid",
    "load_tokens",
    "run_extract",
]
