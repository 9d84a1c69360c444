"""The extractor's Celery app module: `celery -A aerie_extractor.worker worker -Q ingest,extract`.

Importing this module reads nothing: the app is built (settings read, tasks included) the
first time `app` is looked up, which `celery -A` does right away. A setting to fix then ends the
command with one line naming it (Celery would print the app module's traceback); `get_app()`
raises SettingsError as usual.
"""

from __future__ import annotations

from functools import cache

from celery import Celery


@cache
def get_app() -> Celery:
    from aerie.queue import make_app
    from aerie.settings import Settings

    return make_app(Settings.load(), include=["aerie_extractor.tasks"])


def __getattr__(name: str):
    if name in ("app", "celery"):
        from aerie.settings import SettingsError

        try:
            return get_app()
        except SettingsError as e:
            raise SystemExit(f"Error: {e}") from None
    raise AttributeError(name)
