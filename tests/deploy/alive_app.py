"""A Celery app built like every aerie worker's (`aerie.queue.make_app`), with one task that holds
the worker for a given time: the trainer's pool kind can be probed while a task runs."""

from __future__ import annotations

import time

from aerie.queue import make_app
from aerie.settings import Settings

app = make_app(Settings.load())


@app.task(name="tests.hold")
def hold(seconds: float) -> None:
    time.sleep(seconds)
