"""The `aerie.train` Celery task: JSON kwargs (a TrainRequest) -> `run_train` -> a JSON summary.

Registered with `shared_task`, so it binds to whichever app includes this module: the worker's
(`aerie_trainer.worker`) or the lead's in-process, eager app (the same code either way).
A killed worker's task is redelivered (acks_late + reject_on_worker_lost, see aerie.queue) and
resumes from its last checkpoint; a task whose drafter version is already published returns it.
"""

from __future__ import annotations

from celery import shared_task

from aerie.contracts import TrainRequest
from aerie.queue import TRAIN_TASK
from aerie.settings import Settings
from aerie.store import open_store


@shared_task(name=TRAIN_TASK, bind=True)
def train(self, **kwargs) -> dict:
    request = TrainRequest.model_validate(kwargs)
    settings = getattr(self.app, "aerie_settings", None) or Settings.load()
    store = open_store(settings)

    def progress(info: dict) -> None:
        hook = getattr(self.app, "aerie_progress", None)  # set by `aerie run` (in-process, eager)
        if hook is not None:
            hook(info)
        if not self.request.called_directly and not self.app.conf.task_always_eager:
            self.update_state(state="PROGRESS", meta=info)

    from aerie_trainer.train import run_train

    return run_train(store, settings, request, progress=progress)
