"""The Celery tasks of the extractor: the `ingest`, `regenerate`, `extract` and `align` stages on the queues.

- Names come from `aerie.queue` (`aerie.ingest`, `aerie.regenerate`, `aerie.extract`, `aerie.align`);
  routing sends them to the `ingest` (ingest, regenerate, align) and `extract` queues.
- Each task runs its stage (this service's own function) and, when it ends, calls the run
  controller's `advance` (aerie.controller), which enqueues what the run's plan says comes next,
  each step once across redeliveries and racing workers: an ingest's end enqueues the run's
  regenerate or extract tasks, a regenerated shard's end its extraction, the last extraction's end
  the alignment check or the training, a passed check's end the training. A bare `aerie.ingest`
  message (no plan written by `enqueue`) creates the plan it implies: ingest, then extract.
- A shard is answered by one live delivery at a time (`held`): a second one waits for it, then
  finds the shard done, or takes over if the first died. Kwargs are JSON, validated by their
  contract (`aerie.queue.parse_message`: a message that does not match, e.g. a refused name,
  fails once).
- Retries and failures follow `aerie.queue.run_task` (the same in every service): store errors
  and retryable engine errors are retried with backoff; a refused engine (EngineMismatch) or a
  bad request fails at once; what gives up is recorded in `runs/<run>/failed/` (shard or ingest),
  where the controller reads it (the run's phase is `failed` until the same request, or
  `aerie retry-failed`, sends it again).
- An alignment check the run's plan asked for (`enqueue --train-drafter D --server URL`) records
  its outcome for the controller; when it fails and the training does not `--allow-misaligned`,
  the task fails naming its report, and the training is not enqueued.
- No settings are read at import: the app that runs a task carries them (`app.aerie_settings`).

Enqueue from the Celery CLI (the worker's app module is `aerie_extractor.worker`):

    celery -A aerie_extractor.worker call aerie.ingest \\
        --kwargs '{"run": "r1", "dataset": "datasets/chat.jsonl", "model": "/models/target"}'
"""

from __future__ import annotations

import logging

from celery import Task, shared_task

from aerie import controller, runs
from aerie.contracts import AlignRequest, ExtractRequest, IngestRequest, RegenerateRequest
from aerie.controller import OnWorkers, RunConflict
from aerie.queue import (
    ALIGN_TASK,
    EXTRACT_TASK,
    INGEST_TASK,
    MAX_RETRIES,
    REGENERATE_TASK,
    TRAIN_TASK,
    held,
    parse_message,
    run_task,
    task_progress,
    task_settings,
    task_store,
)
from aerie_extractor.align import AlignmentFailed, run_align
from aerie_extractor.extract import run_extract
from aerie_extractor.ingest import run_ingest
from aerie_extractor.regenerate import run_regenerate

log = logging.getLogger(__name__)


def _advance(task: Task, run: str) -> controller.RunState | None:
    """The run controller's next steps, enqueued from this task (claims owned by its id, so a
    redelivery of a task that died between claiming and sending sends them then)."""
    settings = task_settings(task.app)
    return controller.advance_planned(
        task_store(settings), settings, run, OnWorkers(task.app, settings, task.request.id or "local")
    )


@shared_task(bind=True, name=INGEST_TASK, max_retries=MAX_RETRIES)
def ingest(self: Task, **kwargs) -> dict:
    request = parse_message(IngestRequest, kwargs)
    settings = task_settings(self.app)
    store = task_store(settings)

    def work():
        controller.plan_for(store, request)  # created before anything of the run is written
        return run_ingest(store, settings, request)

    def give_up(error: BaseException, attempts: int) -> None:
        if not isinstance(error, RunConflict):  # another request's run: its records are not this one's
            runs.record_ingest_failure(store, request, error, attempts)

    result = run_task(self, work, give_up)
    state = _advance(self, request.run)
    result.fanned_out = len(state.sent) if state is not None else 0
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
        result = run_task(self, lambda: run_regenerate(store, settings, request, task_progress(self)), give_up)
    state = _advance(self, request.run)
    result.extract_enqueued = state is not None and any(s.name == f"extract:{request.shard}" for s in state.sent)
    return result.model_dump(mode="json")


@shared_task(bind=True, name=EXTRACT_TASK, max_retries=MAX_RETRIES)
def extract(self: Task, **kwargs) -> dict:
    request = parse_message(ExtractRequest, kwargs)
    settings = task_settings(self.app)

    def give_up(error: BaseException, attempts: int) -> None:
        runs.record_failure(task_store(settings), request.run, request.shard, error, attempts)

    result = run_task(self, lambda: run_extract(task_store(settings), settings, request), give_up)
    state = _advance(self, request.run)
    result.train_enqueued = state is not None and any(s.kind == "train" for s in state.sent)
    _log_sent(request.run, state)
    return result.model_dump(mode="json")


@shared_task(bind=True, name=ALIGN_TASK, max_retries=MAX_RETRIES)
def align(self: Task, **kwargs) -> dict:
    """The alignment check (report in `runs/<run>/align/`); for a check the run's plan asked, its
    outcome recorded and the run advanced (the training after it, when it passed or may train anyway)."""
    from aerie.alignment import failure_message

    request = parse_message(AlignRequest, kwargs)
    settings = task_settings(self.app)
    store = task_store(settings)
    report = run_task(self, lambda: run_align(store, settings, request))
    gated = controller.record_alignment(store, request, report)
    _log_sent(request.run, _advance(self, request.run) if gated else None, report.passed)
    # a gate record exists only for a gated plan: each of `gated` has its align
    if not report.passed and any(not p.align.allow_misaligned for p in gated):  # type: ignore[union-attr]
        raise AlignmentFailed(failure_message(report))
    return report.model_dump(mode="json")


def _log_sent(run: str, state: controller.RunState | None, aligned: bool | None = None) -> None:
    for step in state.sent if state is not None else []:
        if step.kind in ("align", "train"):
            how = {None: "complete", True: "aligned", False: "NOT aligned (allow_misaligned)"}[aligned]
            what = ALIGN_TASK if step.kind == "align" else f"{TRAIN_TASK} for drafter {step.request.drafter}"  # type: ignore[attr-defined]  # a TrainRequest
            log.info("run %s %s: enqueued %s", run, how, what)
