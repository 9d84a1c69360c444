"""The Celery tasks of the extractor: the `ingest`, `regenerate`, `extract` and `align` stages on the queues.

- Names come from `aerie.queue` (`aerie.ingest`, `aerie.regenerate`, `aerie.extract`); routing
  sends them to the `ingest` (ingest, regenerate, align) and `extract` queues.
- A run with `regenerate`: ingest enqueues one `aerie.regenerate` per conversation shard, and each
  enqueues its shard's `aerie.extract` as soon as the shard's tokens are stored; each follow-up is
  sent once (`claim_once`, keyed by the run's creation time and the shard), also when a task is
  redelivered after it sent. A shard is answered by one live delivery at a time (`held`): a second
  one waits for it, then finds the shard done, or takes over if the first died. Kwargs are JSON, validated by IngestRequest / ExtractRequest
  (`aerie.queue.parse_message`: a message that does not match, e.g. a refused name, fails once).
- Retries and failures follow `aerie.queue.run_task` (the same in every service): store errors
  and retryable engine errors are retried with backoff; a refused engine (EngineMismatch) or a
  bad request fails at once; what gives up is recorded in `runs/<run>/failed/` (shard or ingest).
- No settings are read at import: the app that runs a task carries them (`app.aerie_settings`).
- A complete run that asks for training (`train_after`) and for an alignment check first
  (`align`: `enqueue --train-drafter D --server URL`) gets `aerie.align`, which enqueues the
  training when the check passes (or `allow_misaligned`), and fails naming its report otherwise.

Enqueue from the Celery CLI (the worker's app module is `aerie_extractor.worker`):

    celery -A aerie_extractor.worker call aerie.ingest \\
        --kwargs '{"run": "r1", "dataset": "datasets/chat.jsonl", "model": "/models/target"}'
"""

from __future__ import annotations

import logging

from celery import Task, shared_task

from aerie import layout, runs, stages
from aerie.contracts import AlignRequest, ExtractRequest, IngestRequest, RegenerateRequest
from aerie.queue import (
    ALIGN_TASK,
    EXTRACT_TASK,
    INGEST_TASK,
    MAX_RETRIES,
    REGENERATE_TASK,
    TRAIN_TASK,
    claim_once,
    enqueue,
    held,
    mark_done,
    parse_message,
    run_task,
    task_progress,
    task_settings,
    task_store,
)
from aerie.settings import Settings
from aerie.store import ObjectStore

log = logging.getLogger(__name__)


@shared_task(bind=True, name=INGEST_TASK, max_retries=MAX_RETRIES)
def ingest(self: Task, **kwargs) -> dict:
    request = parse_message(IngestRequest, kwargs)
    settings = task_settings(self.app)

    def give_up(error: BaseException, attempts: int) -> None:
        runs.record_ingest_failure(task_store(settings), request, error, attempts)

    result = run_task(self, lambda: stages.ingest(task_store(settings), settings, request), give_up)
    if request.fan_out:
        for shard in result.shards:
            enqueue(self.app, EXTRACT_TASK, ExtractRequest(run=request.run, shard=shard).model_dump(mode="json"))
        result.fanned_out = len(result.shards)
        if result.regenerate_shards:
            created = runs.load_run(task_store(settings), request.run).created_at
            for shard in result.regenerate_shards:
                result.fanned_out += send_once(
                    self.app,
                    settings,
                    f"regenerate:{request.run}:{created}:{shard}",
                    self.request.id or "local",
                    REGENERATE_TASK,
                    RegenerateRequest(run=request.run, shard=shard).model_dump(mode="json"),
                )
    return result.model_dump(mode="json")


@shared_task(bind=True, name=REGENERATE_TASK, max_retries=MAX_RETRIES)
def regenerate(self: Task, **kwargs) -> dict:
    """One conversation shard answered by the target (stored once) and tokenized; then its extraction."""
    request = parse_message(RegenerateRequest, kwargs)
    settings = task_settings(self.app)
    store = task_store(settings)

    def give_up(error: BaseException, attempts: int) -> None:
        runs.record_failure(store, request.run, request.shard, error, attempts)

    with held(settings, f"regenerate:{request.run}:{request.shard}"):  # one live delivery answers a shard
        result = run_task(self, lambda: stages.regenerate(store, settings, request, task_progress(self)), give_up)
    owner = self.request.id or "local"
    if request.fan_out and store.exists(layout.shard_record(request.run, "tokens", request.shard)):
        created = runs.load_run(store, request.run).created_at
        result.extract_enqueued = bool(
            send_once(
                self.app,
                settings,
                f"extract:{request.run}:{created}:{request.shard}",
                owner,
                EXTRACT_TASK,
                ExtractRequest(run=request.run, shard=request.shard).model_dump(mode="json"),
            )
        )
    elif request.fan_out:  # every conversation refused: nothing to extract, and the run may be complete now
        maybe_enqueue_train(self.app, settings, store, request.run, owner)
    return result.model_dump(mode="json")


def send_once(app, settings: Settings, name: str, owner: str, task: str, kwargs: dict) -> int:
    """Enqueue `task` once for `name` across redeliveries and racing workers (1 when sent here)."""
    if not claim_once(settings, name, owner):
        return 0
    enqueue(app, task, kwargs)
    mark_done(settings, name)
    return 1


@shared_task(bind=True, name=EXTRACT_TASK, max_retries=MAX_RETRIES)
def extract(self: Task, **kwargs) -> dict:
    request = parse_message(ExtractRequest, kwargs)
    settings = task_settings(self.app)

    def give_up(error: BaseException, attempts: int) -> None:
        runs.record_failure(task_store(settings), request.run, request.shard, error, attempts)

    result = run_task(self, lambda: stages.extract(task_store(settings), settings, request), give_up)
    result.train_enqueued = maybe_enqueue_train(
        self.app, settings, task_store(settings), request.run, self.request.id or "local"
    )
    return result.model_dump(mode="json")


@shared_task(bind=True, name=ALIGN_TASK, max_retries=MAX_RETRIES)
def align(self: Task, **kwargs) -> dict:
    """The alignment check (report in `runs/<run>/align/`); with `then_train`, the training after it."""
    from aerie.alignment import failure_message
    from aerie_extractor.align import AlignmentFailed

    request = parse_message(AlignRequest, kwargs)
    settings = task_settings(self.app)
    report = run_task(self, lambda: stages.align(task_store(settings), settings, request))
    if request.then_train is not None:
        if not report.passed and not request.allow_misaligned:
            raise AlignmentFailed(failure_message(report))
        enqueue(self.app, TRAIN_TASK, request.then_train.model_dump(mode="json"))
        log.info(
            "run %s %s: enqueued %s for drafter %s",
            request.run,
            "aligned" if report.passed else "NOT aligned (allow_misaligned)",
            TRAIN_TASK,
            request.then_train.drafter,
        )
    return report.model_dump(mode="json")


def maybe_enqueue_train(app, settings: Settings, store: ObjectStore, run: str, owner: str) -> bool:
    """When the run is complete and asks for training, enqueue `aerie.train` exactly once.

    Every extract checks after writing its record, so the last to finish sees the run
    complete (two may both see it: the claim lets one through). The claim's owner is the task
    id, so a redelivered task that died after claiming but before sending sends it then.
    """
    if not runs.run_complete(store, run):
        return False
    spec = runs.load_run(store, run)
    if spec.train_after is None:
        return False
    name = f"train:{run}"  # not keyed by anything a concurrent re-ingest could rewrite
    if not claim_once(settings, name, owner):
        return False
    if spec.align is not None:  # the check first; it enqueues the training
        gate = spec.align
        enqueue(
            app,
            ALIGN_TASK,
            AlignRequest(
                run=run,
                server=gate.server,
                samples=gate.samples,
                seed=gate.seed,
                then_train=spec.train_after,
                allow_misaligned=gate.allow_misaligned,
            ).model_dump(mode="json"),
        )
    else:
        enqueue(app, TRAIN_TASK, spec.train_after.model_dump(mode="json"))
    mark_done(settings, name)
    log.info(
        "run %s complete: enqueued %s for drafter %s",
        run,
        ALIGN_TASK if spec.align else TRAIN_TASK,
        spec.train_after.drafter,
    )
    return True
