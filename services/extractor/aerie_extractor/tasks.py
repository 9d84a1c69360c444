"""The Celery tasks of the extractor: thin wrappers over `run_ingest` and `run_extract`.

- Names come from `aerie.queue` (`aerie.ingest`, `aerie.extract`); routing sends them to the
  `ingest` and `extract` queues. Kwargs are JSON, validated by IngestRequest / ExtractRequest.
- Retries: store errors and retryable engine errors, at most MAX_RETRIES times, backoff
  2, 4, 8... s (capped). A refused engine (EngineMismatch) or a bad request fails at once.
- No settings are read at import: the app that runs a task carries them (`app.aerie_settings`).

Enqueue from the Celery CLI (the worker's app module is `aerie_extractor.worker`):

    celery -A aerie_extractor.worker call aerie.ingest \\
        --kwargs '{"run": "r1", "dataset": "datasets/chat.jsonl", "model": "/models/target"}'
"""

from __future__ import annotations

import logging

from celery import Task, current_app, shared_task

from aerie.contracts import ExtractRequest, IngestRequest
from aerie.queue import EXTRACT_TASK, INGEST_TASK, TRAIN_TASK
from aerie.settings import Settings
from aerie.store import ObjectStore, StoreError, open_store
from aerie_extractor.engines import EngineError
from aerie_extractor.extract import claim_once, load_run, mark_done, record_failure, run_complete, run_extract
from aerie_extractor.ingest import run_ingest

log = logging.getLogger(__name__)

MAX_RETRIES = 5
BACKOFF_S, BACKOFF_CAP_S = 2.0, 60.0

_stores: dict[str, ObjectStore] = {}


def task_settings(app=None) -> Settings:
    """The settings of the app running the task (built by aerie.queue.make_app)."""
    app = app or current_app
    settings = getattr(app, "aerie_settings", None)
    return settings if settings is not None else Settings.load()


def task_store(settings: Settings) -> ObjectStore:
    key = f"{settings.store}|{settings.bucket}"
    if key not in _stores:
        _stores[key] = open_store(settings)
    return _stores[key]


def backoff(retries: int) -> float:
    return min(BACKOFF_S * 2**retries, BACKOFF_CAP_S)


def enqueue(app, name: str, kwargs: dict):
    """Send a task by name; run it through the registered task when there is one (eager apps)."""
    if name in app.tasks:
        return app.tasks[name].apply_async(kwargs=kwargs)
    return app.send_task(name, kwargs=kwargs)


def _retryable(e: BaseException) -> bool:
    return isinstance(e, StoreError) or (isinstance(e, EngineError) and e.retryable)


@shared_task(bind=True, name=INGEST_TASK, max_retries=MAX_RETRIES)
def ingest(self: Task, **kwargs) -> dict:
    request = IngestRequest.model_validate(kwargs)
    settings = task_settings(self.app)
    try:  # an unreachable store is retried like any store error
        summary = run_ingest(task_store(settings), settings, request)
    except Exception as e:
        if _retryable(e) and self.request.retries < self.max_retries:
            raise self.retry(exc=e, countdown=backoff(self.request.retries))
        raise
    if request.fan_out:
        for shard in summary.shards:
            enqueue(self.app, EXTRACT_TASK, ExtractRequest(run=request.run, shard=shard).model_dump(mode="json"))
    result = summary.as_dict()
    result["fanned_out"] = len(summary.shards) if request.fan_out else 0
    return result


@shared_task(bind=True, name=EXTRACT_TASK, max_retries=MAX_RETRIES)
def extract(self: Task, **kwargs) -> dict:
    request = ExtractRequest.model_validate(kwargs)
    settings = task_settings(self.app)
    store = None
    try:
        store = task_store(settings)
        summary = run_extract(store, settings, request)
    except Exception as e:
        if _retryable(e) and self.request.retries < self.max_retries:
            log.warning("extract %s/%s failed (%s), retry %d in %.0f s", request.run, request.shard, e, self.request.retries + 1, backoff(self.request.retries))
            raise self.retry(exc=e, countdown=backoff(self.request.retries))
        if store is not None:
            try:
                record_failure(store, request, e, self.request.retries + 1)
            except StoreError:
                log.exception("could not record the failure of %s/%s", request.run, request.shard)
        raise
    result = summary.as_dict()
    result["train_enqueued"] = maybe_enqueue_train(self.app, settings, store, request.run, self.request.id or "local")
    return result


def maybe_enqueue_train(app, settings: Settings, store: ObjectStore, run: str, owner: str) -> bool:
    """When the run is complete and asks for training, enqueue `aerie.train` exactly once.

    Every extract checks after writing its record, so the last to finish sees the run
    complete (two may both see it: the claim lets one through). The claim's owner is the task
    id, so a redelivered task that died after claiming but before sending sends it then.
    """
    if not run_complete(store, run):
        return False
    spec = load_run(store, run)
    if spec.train_after is None:
        return False
    name = f"train:{run}"  # not keyed by anything a concurrent re-ingest could rewrite
    if not claim_once(settings, name, owner):
        return False
    enqueue(app, TRAIN_TASK, spec.train_after.model_dump(mode="json"))
    mark_done(settings, name)
    log.info("run %s complete: enqueued %s for drafter %s", run, TRAIN_TASK, spec.train_after.drafter)
    return True
