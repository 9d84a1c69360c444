"""The Celery tasks of the extractor: the `ingest` and `extract` stages on the queues.

- Names come from `aerie.queue` (`aerie.ingest`, `aerie.extract`); routing sends them to the
  `ingest` and `extract` queues. Kwargs are JSON, validated by IngestRequest / ExtractRequest.
- Retries and failures follow `aerie.queue.run_task` (the same in every service): store errors
  and retryable engine errors are retried with backoff; a refused engine (EngineMismatch) or a
  bad request fails at once; what gives up is recorded in `runs/<run>/failed/` (shard or ingest).
- No settings are read at import: the app that runs a task carries them (`app.aerie_settings`).

Enqueue from the Celery CLI (the worker's app module is `aerie_extractor.worker`):

    celery -A aerie_extractor.worker call aerie.ingest \\
        --kwargs '{"run": "r1", "dataset": "datasets/chat.jsonl", "model": "/models/target"}'
"""

from __future__ import annotations

import logging

from celery import Task, shared_task

from aerie import runs, stages
from aerie.contracts import ExtractRequest, IngestRequest
from aerie.queue import (
    EXTRACT_TASK, INGEST_TASK, MAX_RETRIES, TRAIN_TASK, claim_once, enqueue, mark_done, run_task, task_settings, task_store,
)
from aerie.settings import Settings
from aerie.store import ObjectStore

log = logging.getLogger(__name__)


@shared_task(bind=True, name=INGEST_TASK, max_retries=MAX_RETRIES)
def ingest(self: Task, **kwargs) -> dict:
    request = IngestRequest.model_validate(kwargs)
    settings = task_settings(self.app)

    def give_up(error: BaseException, attempts: int) -> None:
        runs.record_ingest_failure(task_store(settings), request, error, attempts)

    result = run_task(self, lambda: stages.ingest(task_store(settings), settings, request), give_up)
    if request.fan_out:
        for shard in result.shards:
            enqueue(self.app, EXTRACT_TASK, ExtractRequest(run=request.run, shard=shard).model_dump(mode="json"))
        result.fanned_out = len(result.shards)
    return result.model_dump(mode="json")


@shared_task(bind=True, name=EXTRACT_TASK, max_retries=MAX_RETRIES)
def extract(self: Task, **kwargs) -> dict:
    request = ExtractRequest.model_validate(kwargs)
    settings = task_settings(self.app)

    def give_up(error: BaseException, attempts: int) -> None:
        runs.record_failure(task_store(settings), request.run, request.shard, error, attempts)

    result = run_task(self, lambda: stages.extract(task_store(settings), settings, request), give_up)
    result.train_enqueued = maybe_enqueue_train(self.app, settings, task_store(settings), request.run, self.request.id or "local")
    return result.model_dump(mode="json")


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
    enqueue(app, TRAIN_TASK, spec.train_after.model_dump(mode="json"))
    mark_done(settings, name)
    log.info("run %s complete: enqueued %s for drafter %s", run, TRAIN_TASK, spec.train_after.drafter)
    return True
