"""A run as the store holds it: its spec, its shards, its progress — readable by every service.

Nothing here extracts or trains; it reads what the extractor wrote (and records a shard's
failure), so the trainer, `aerie run` and the Celery sub-commands share one view of a run:

- `load_run(store, run)`: `runs/<run>/run.json`, or a clear error when the run was never ingested.
- `run_status(store, run)`: shards total / regenerated / tokenized / extracted / failed, tokens, rejects.
- `run_complete(store, run)`: every shard (a regenerated run's conversation shards too) has a
  hidden record (listings only: cheap).
- `wait_for_run(store, run, timeout_s)`: until complete; fails naming the failed shards, or the
  deadline, and says where to look.
- `alignment_reports(store, run)`, `lineage_alignment(store, runs)`: the run's alignment checks
  against serving servers (written by the extractor's `aerie align`), and what a drafter's lineage
  records of them: the trainer reads them here, never from the extractor.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from aerie import layout
from aerie.contracts import (
    AlignmentReport,
    AlignmentSummary,
    IngestFailure,
    IngestRequest,
    LineageAlignment,
    RegeneratedRecord,
    RunSpec,
    RunStatus,
    ShardFailure,
    ShardRecord,
)
from aerie.store import NotFound, ObjectStore, StoreError


class RunError(RuntimeError):
    """A run that is missing, failed, or did not finish in time; the message says what to do."""


def load_run(store: ObjectStore, run: str) -> RunSpec:
    try:
        return store.get_json(layout.run_spec(run), RunSpec)
    except NotFound:
        raise RunError(f"run {run!r} has no run.json in {store.url}: ingest it first (aerie.ingest)") from None


def shard_names(store: ObjectStore, run: str, kind: str) -> list[str]:
    """Names of the shards of `kind` ("tokens" | "hidden") that have a record, sorted."""
    return layout.record_names(store.list(layout.shards_prefix(run, kind)))


def conversation_shards(store: ObjectStore, run: str) -> list[str]:
    """A regenerated run's conversation shards (ingest writes them; each becomes one token shard)."""
    return layout.conversation_names(store.list(layout.conversations_prefix(run)))


def regenerated_shards(store: ObjectStore, run: str) -> list[str]:
    """Conversation shards whose answers are stored (their record exists)."""
    return layout.record_names(store.list(layout.regenerated_prefix(run)))


def _nothing_to_extract(store: ObjectStore, run: str, shards: set[str]) -> set[str]:
    """Of a regenerated run's shards without tokens, those whose every conversation was refused
    (the record says 0 token sequences: there is no token shard to extract). One read per shard
    still missing, so only the few in flight cost anything."""
    empty = set()
    for name in shards:
        try:
            if store.get_json(layout.regenerated_record(run, name), RegeneratedRecord).token_sequences == 0:
                empty.add(name)
        except NotFound:
            pass
    return empty


def _shards_to_extract(store: ObjectStore, run: str, tokens: set[str], hidden: set[str]) -> set[str]:
    """Every shard the run must extract: its token shards and its conversation shards (a
    regenerated run), less conversation shards that ended with nothing to extract."""
    conversations = set(conversation_shards(store, run))
    return tokens | conversations - _nothing_to_extract(store, run, conversations - tokens - hidden)


def hidden_bytes(store: ObjectStore, run: str) -> int:
    """Bytes of the run's stored hidden-state shards."""
    return sum(store.size(k) for k in layout.shard_objects(store.list(layout.shards_prefix(run, "hidden"))))


def record_failure(store: ObjectStore, run: str, shard: str, error: BaseException | str, attempts: int) -> None:
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    store.put_json(layout.shard_failure(run, shard), ShardFailure(run=run, shard=shard, error=text, attempts=attempts))


def record_ingest_failure(store: ObjectStore, request: IngestRequest, error: BaseException, attempts: int) -> None:
    store.put_json(
        layout.ingest_failure(request.run),
        IngestFailure(
            run=request.run, dataset=request.dataset, error=f"{type(error).__name__}: {error}", attempts=attempts
        ),
    )


def failures(store: ObjectStore, run: str) -> list[ShardFailure]:
    """The failure records of shards that have not been extracted since."""
    done = set(shard_names(store, run, "hidden"))
    out = []
    for name in layout.record_names(store.list(layout.failures_prefix(run))):
        if name not in done:
            try:
                out.append(store.get_json(layout.shard_failure(run, name), ShardFailure))
            except NotFound:  # a later attempt succeeded meanwhile
                pass
    return out


def run_status(store: ObjectStore, run: str) -> RunStatus:
    """Shards total/tokenized/extracted/failed, tokens and rejects of a run, from the store."""
    ingested = store.exists(layout.run_spec(run))
    tokens = shard_names(store, run, "tokens")
    to_regenerate = conversation_shards(store, run)
    hidden = set(shard_names(store, run, "hidden"))
    every = _shards_to_extract(store, run, set(tokens), hidden)
    failed = sorted(set(layout.record_names(store.list(layout.failures_prefix(run)))) - hidden)
    sequences = n_tokens = 0
    for name in tokens:
        record = store.get_json(layout.shard_record(run, "tokens", name), ShardRecord)
        sequences += record.sequences
        n_tokens += record.tokens
    rejects = 0
    for key in store.list(layout.rejects_prefix(run)):  # counted from the names: no part is read
        count = layout.rejects_count(key)
        rejects += count if count is not None else store.get_bytes(key).count(b"\n")
    return RunStatus(
        run=run,
        shards_total=len(every),
        tokens_done=len(tokens),
        hidden_done=len(hidden),
        failed=len(failed),
        sequences=sequences,
        tokens=n_tokens,
        rejects=rejects,
        complete=ingested and every <= hidden,
        failed_shards=failed,
        regenerate_total=len(to_regenerate),
        regenerated=len(set(regenerated_shards(store, run)) & set(to_regenerate)),
    )


def run_complete(store: ObjectStore, run: str) -> bool:
    """Every token shard of an ingested run has a hidden record (cheap: listings only)."""
    if not store.exists(layout.run_spec(run)):
        return False
    tokens, hidden = set(shard_names(store, run, "tokens")), set(shard_names(store, run, "hidden"))
    every = _shards_to_extract(store, run, tokens, hidden)
    return bool(every) and every <= hidden


def wait_for_run(
    store: ObjectStore,
    run: str,
    timeout_s: float,
    poll_s: float = 2.0,
    on_status: Callable[[RunStatus | None], None] | None = None,
) -> RunStatus:
    """Poll the store until the run is complete; raise RunError when a shard failed for good or
    the deadline passes. A store that refuses the credentials or cannot be reached raises its
    own StoreError at once (nothing to wait for); a run not yet ingested is waited for."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = run_status(store, run) if store.exists(layout.run_spec(run)) else None
        if on_status is not None:
            on_status(status)
        if status is None and store.exists(layout.ingest_failure(run)):
            failure = store.get_json(layout.ingest_failure(run), IngestFailure)
            raise RunError(f"run {run!r}: ingest of {failure.dataset!r} failed for good: {failure.error}")
        if status is not None:
            if status.failed:
                first = failures(store, run)[:1]
                why = f" (shard {first[0].shard}: {first[0].error})" if first else ""
                raise RunError(
                    f"run {run!r}: {status.failed} shard(s) failed for good{why}; records in "
                    f"{store.url}/{layout.failures_prefix(run)}"
                )
            if status.complete:
                return status
        if time.monotonic() > deadline:
            done = (
                "not ingested yet" if status is None else f"{status.hidden_done}/{status.shards_total} shards extracted"
            )
            raise RunError(f"run {run!r} did not complete within {timeout_s:.0f} s ({done}): are the workers running?")
        time.sleep(poll_s)


def alignment_reports(store: ObjectStore, run: str) -> list[AlignmentReport]:
    """The run's alignment reports (`runs/<run>/align/<server-id>.json`), oldest first."""
    reports = []
    for server_id in layout.alignment_server_ids(run, store.list(layout.alignments_prefix(run))):
        try:
            reports.append(store.get_json(layout.alignment_report(run, server_id), AlignmentReport))
        except NotFound:  # replaced meanwhile
            pass
    return sorted(reports, key=lambda r: r.created_at)


def summarize_alignment(report: AlignmentReport) -> AlignmentSummary:
    server = report.server
    return AlignmentSummary(
        run=report.run,
        key=layout.alignment_report(report.run, server.server_id),
        passed=report.passed,
        server_id=server.server_id,
        model_path=server.model_path,
        sglang_version=server.sglang_version,
        quantization=server.quantization,
        dtype=server.dtype,
        tp_size=server.tp_size,
        point_cosines={p.point: (None if p.at_point is None else p.at_point.mean) for p in report.points},
        top1_agreement=None if report.signal is None else report.signal.top1_agreement,
        causes=list(report.causes),
        created_at=report.created_at,
    )


def lineage_alignment(store: ObjectStore, runs: list[str]) -> LineageAlignment:
    """What a drafter trained on `runs` records of their alignment checks: every report found (one
    per run and serving configuration), or that none was made."""
    reports = [summarize_alignment(r) for run in runs for r in alignment_reports(store, run)]
    unchecked = [run for run in runs if not any(r.run == run for r in reports)]
    if not reports:
        return LineageAlignment(
            checked=False,
            note=f"no alignment check of run(s) {', '.join(runs)} against a serving "
            "server: run `aerie align --run RUN --server URL` before training",
        )
    failed = [r for r in reports if not r.passed]
    note = "; ".join(
        filter(
            None,
            [
                f"unchecked run(s): {', '.join(unchecked)}" if unchecked else "",
                f"trained despite failed check(s): {', '.join(f'{r.run} vs {r.server_id}' for r in failed)}"
                if failed
                else "",
            ],
        )
    )
    return LineageAlignment(checked=True, passed=not failed and not unchecked, reports=reports, note=note)


__all__ = [
    "RunError",
    "StoreError",
    "failures",
    "hidden_bytes",
    "load_run",
    "record_failure",
    "record_ingest_failure",
    "alignment_reports",
    "lineage_alignment",
    "run_complete",
    "run_status",
    "conversation_shards",
    "regenerated_shards",
    "shard_names",
    "wait_for_run",
]
