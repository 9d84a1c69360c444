"""Extract: one token shard -> engine -> a validated hidden shard + its record in the store.

- Idempotent: a hidden shard whose record's sha256 matches the stored object is skipped; a
  shard without a record (a worker died between the two writes) or with a wrong hash is redone.
  Keys are deterministic, so a redelivered task can neither lose nor duplicate a shard.
- The engine is built once per process and run (`check()` before its first capture).
- `run_status(store, run)` reads progress from the store alone, at any time.
- `claim_once(...)`: the run's last shard enqueues training exactly once (Redis SET NX).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass

from aerie import layout
from aerie.contracts import ExtractRequest, RunSpec, RunStatus, ShardFailure, ShardRecord
from aerie.settings import Settings
from aerie.shard import Shard, ShardError, pack
from aerie.store import NotFound, ObjectStore
from aerie_extractor.engines import Engine, EngineMismatch, make_engine

log = logging.getLogger(__name__)


class ExtractError(RuntimeError):
    """A shard that cannot be extracted as stored (corrupt token shard, missing run)."""


@dataclass
class ExtractSummary:
    run: str
    shard: str
    skipped: bool
    sequences: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    capture_seconds: float = 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


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
def load_run(store: ObjectStore, run: str) -> RunSpec:
    try:
        return store.get_json(layout.run_spec(run), RunSpec)
    except NotFound:
        raise ExtractError(f"run {run!r} has no run.json in {store.url}: ingest it first (aerie.ingest)") from None


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
) -> ExtractSummary:
    """Extract one shard of a run; skip it when a valid hidden shard already exists."""
    started = time.monotonic()
    run, name = request.run, request.shard
    if hidden_is_valid(store, run, name) is not None:
        return ExtractSummary(run=run, shard=name, skipped=True)
    spec = load_run(store, run)
    tokens = load_tokens(store, run, name)
    if engine is None:
        engine = get_engine(settings, spec)
    sequences = [s["input_ids"] for s in tokens.sequences()]
    t0 = time.monotonic()
    captured = engine.capture(sequences)
    capture_seconds = time.monotonic() - t0
    if len(captured) != len(sequences):
        raise EngineMismatch(f"engine returned {len(captured)} results for {len(sequences)} sequences of shard {name}")
    K, H = len(spec.capture_points), spec.target.hidden_size
    rows = []
    for i, (seq, cap) in enumerate(zip(tokens.sequences(), captured)):
        T = len(seq["input_ids"])
        if cap.aux.shape != (T, K, H):
            raise EngineMismatch(
                f"shard {name} sequence {i}: engine returned aux {list(cap.aux.shape)}, expected [{T}, {K}, {H}] "
                f"(tokens x capture points {spec.capture_points} x hidden size): wrong layer ids or wrong model?"
            )
        row = {"input_ids": seq["input_ids"], "loss_mask": seq["loss_mask"], "aux": cap.aux}
        if spec.target_signal == "final":
            row["final"] = cap.final
        else:
            row["topk_ids"], row["topk_logprobs"] = cap.topk_ids, cap.topk_logprobs
        rows.append(row)
    hidden = pack(rows, spec.capture_points, extra_metadata={"run": run, "shard": name, "engine": spec.engine.name})
    try:
        hidden.validate(check_finite=True)
    except ShardError as e:
        raise EngineMismatch(f"shard {name}: the engine's output is not a valid hidden shard: {e}") from e
    data = hidden.to_bytes()
    key = layout.shard(run, "hidden", name)
    sha = store.put_bytes(key, data)
    seconds = time.monotonic() - started
    record = ShardRecord(
        run=run, shard=name, kind="hidden", key=key, sha256=sha, bytes=len(data),
        sequences=hidden.num_sequences, tokens=hidden.num_tokens, loss_tokens=int(hidden.loss_mask.sum()),
        engine=spec.engine, seconds=round(seconds, 3),
    )
    store.put_json(layout.shard_record(run, "hidden", name), record)
    store.delete(layout.shard_failure(run, name))
    return ExtractSummary(
        run=run, shard=name, skipped=False, sequences=record.sequences, tokens=record.tokens,
        bytes=record.bytes, seconds=seconds, capture_seconds=capture_seconds,
    )


def record_failure(store: ObjectStore, request: ExtractRequest, error: BaseException, attempts: int) -> None:
    store.put_json(
        layout.shard_failure(request.run, request.shard),
        ShardFailure(run=request.run, shard=request.shard, error=f"{type(error).__name__}: {error}", attempts=attempts),
    )


# --------------------------------------------------------------------------------------
def _names(keys: list[str]) -> set[str]:
    return {k.rsplit("/", 1)[1][: -len(".json")] for k in keys if k.endswith(".json")}


def run_status(store: ObjectStore, run: str) -> RunStatus:
    """Shards total/tokenized/extracted/failed, tokens and rejects of a run, from the store."""
    ingested = store.exists(layout.run_spec(run))
    token_keys = [k for k in store.list(layout.shards_prefix(run, "tokens")) if k.endswith(".json")]
    hidden = _names(store.list(layout.shards_prefix(run, "hidden")))
    failed = _names(store.list(layout.failures_prefix(run))) - hidden
    sequences = tokens = 0
    for key in token_keys:
        record = store.get_json(key, ShardRecord)
        sequences += record.sequences
        tokens += record.tokens
    rejects = sum(store.get_bytes(k).count(b"\n") for k in store.list(layout.rejects_prefix(run)))
    return RunStatus(
        run=run,
        shards_total=len(token_keys),
        tokens_done=len(token_keys),
        hidden_done=len(hidden),
        failed=len(failed),
        sequences=sequences,
        tokens=tokens,
        rejects=rejects,
        complete=ingested and len(hidden) == len(token_keys),
    )


def run_complete(store: ObjectStore, run: str) -> bool:
    """Every token shard of an ingested run has a hidden record (cheap: listings only)."""
    if not store.exists(layout.run_spec(run)):
        return False
    tokens = _names(store.list(layout.shards_prefix(run, "tokens")))
    return bool(tokens) and tokens <= _names(store.list(layout.shards_prefix(run, "hidden")))


# --------------------------------------------------------------------------------------
# Exactly-once follow-up work (the run's training) across racing workers
# --------------------------------------------------------------------------------------
_local_claims: dict[str, str] = {}
_local_lock = threading.Lock()


def claim_once(settings: Settings, name: str, owner: str) -> bool:
    """True for exactly one owner of `name` (and again for that same owner, e.g. a redelivered
    task whose first attempt died between claiming and sending). Redis SET NX on the broker;
    in-process for the embedded (memory://) broker."""
    key = f"aerie:once:{name}"
    if settings.broker.startswith("memory://"):
        with _local_lock:
            return _local_claims.setdefault(key, owner) == owner
    if not settings.broker.startswith(("redis://", "rediss://")):
        raise ExtractError(f"train_after needs a Redis broker for its exactly-once claim, AERIE_BROKER={settings.broker!r}")
    import redis

    client = redis.Redis.from_url(settings.broker)
    try:
        if client.set(key, owner, nx=True, ex=30 * 24 * 3600):
            return True
        return (client.get(key) or b"").decode() == owner and not client.exists(key + ":done")
    finally:
        client.close()


def mark_done(settings: Settings, name: str) -> None:
    if settings.broker.startswith(("redis://", "rediss://")):
        import redis

        client = redis.Redis.from_url(settings.broker)
        try:
            client.set(f"aerie:once:{name}:done", 1, ex=30 * 24 * 3600)
        finally:
            client.close()


__all__ = [
    "ExtractError", "ExtractSummary", "claim_once", "drop_engine", "get_engine", "hidden_is_valid",
    "load_run", "mark_done", "record_failure", "run_complete", "run_extract", "run_status",
]
