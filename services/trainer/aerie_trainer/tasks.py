"""The trainer's Celery task: the `train` stage on queue `train`.

Registered with `shared_task`, so it binds to whichever app includes this module (the worker's,
`aerie_trainer.worker`). Retries and failures follow `aerie.queue.run_task`, as in every service:
store errors are retried with backoff; a job that gives up is recorded in
`checkpoints/<train-id>/failed.json`. A killed worker's task is redelivered (acks_late +
reject_on_worker_lost, see aerie.queue) and resumes from its last checkpoint; a task whose drafter
version is already published returns it; the same training delivered twice trains once (the train
id's lease, aerie_trainer.job.run_train). Progress goes to the task state (`PROGRESS`) and to the
run's progress record, which the run controller (aerie.controller) reads: the train step is a run's
last, so this task dispatches nothing after it. The worker's log has one line as a job starts and
one as it ends (train id, runs, steps): `logs -f trainer` shows which training runs.
"""

from __future__ import annotations

import logging

from celery import Task, shared_task

from aerie import controller
from aerie.contracts import TrainRequest, TrainResult
from aerie.queue import MAX_RETRIES, TRAIN_TASK, parse_message, run_task, task_progress, task_settings, task_store
from aerie_trainer.job import record_failure, run_train

log = logging.getLogger(__name__)


@shared_task(bind=True, name=TRAIN_TASK, max_retries=MAX_RETRIES)
def train(self: Task, **kwargs) -> dict:
    request = parse_message(TrainRequest, kwargs)
    settings = task_settings(self.app)
    plan = f"{request.config.steps} steps" if request.config.steps else f"{request.config.epochs:g} epochs"
    runs = ",".join(request.runs)
    train = [request]  # the training as run: following its runs' current creation (controller.following)

    def give_up(error: BaseException, attempts: int) -> None:
        record_failure(task_store(settings), train[0], error, attempts)

    def work() -> TrainResult:
        store = task_store(settings)
        train[0] = controller.following(store, request)
        log.info("training %s: drafter %s on run %s, %s", train[0].resolved_train_id, request.drafter, runs, plan)
        return run_train(store, settings, train[0], task_progress(self))

    try:
        result = run_task(self, work, give_up)
    except Exception as e:
        log.warning(
            "training %s (run %s) stopped: %s", train[0].resolved_train_id, runs, " ".join(str(e).split())[:300]
        )
        raise
    loss = "-" if result.final_loss is None else f"{result.final_loss:.4f}"
    log.info(
        "training %s (run %s) done: %s steps, final loss %s, drafter %s:%s%s",
        train[0].resolved_train_id, runs, result.steps, loss, result.drafter, result.version,
        " published" if result.key else "",
    )  # fmt: skip
    return result.model_dump(mode="json")
