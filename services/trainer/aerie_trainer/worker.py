"""The trainer's Celery worker (queue `train`, one task at a time per GPU set):

    celery -A aerie_trainer.worker worker -Q train -c 1

The app is built on first access of `app` (module `__getattr__`), not at import: importing this
module reads no settings and opens no connection.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def _app():
    from aerie.queue import make_app
    from aerie.settings import Settings

    return make_app(Settings.load(), include=["aerie_trainer.tasks"])


def __getattr__(name: str):
    if name in ("app", "celery"):
        return _app()
    raise AttributeError(name)
