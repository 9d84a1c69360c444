"""The Celery app every aerie worker and client builds: JSON only, routed by task name.

- Broker and result backend: Redis (`AERIE_BROKER`), or `memory://` for the embedded default,
  where tasks run eagerly in-process: the same task code, no second implementation.
- JSON serializer only; pickle is refused on both ends.
- `acks_late` + `reject_on_worker_lost`: a killed worker's task goes back to the queue.
- Prefetch 1: a long extract or train task never hides behind another in a worker's buffer.
"""

from __future__ import annotations

from celery import Celery

from aerie.settings import Settings

INGEST, EXTRACT, TRAIN = "ingest", "extract", "train"

# task names: the only strings a producer needs to enqueue work (send_task by name)
INGEST_TASK = "aerie.ingest"
EXTRACT_TASK = "aerie.extract"
TRAIN_TASK = "aerie.train"

ROUTES = {INGEST_TASK: {"queue": INGEST}, EXTRACT_TASK: {"queue": EXTRACT}, TRAIN_TASK: {"queue": TRAIN}}


def make_app(settings: Settings | None = None, include: list[str] | None = None) -> Celery:
    settings = settings or Settings.load()
    eager = settings.broker.startswith("memory://")
    backend = settings.result_backend or (None if eager else settings.broker)
    app = Celery("aerie", broker=settings.broker, backend=backend, include=include or [])
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_routes=ROUTES,
        task_default_queue=INGEST,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=True,
        worker_prefetch_multiplier=1,
        worker_concurrency=settings.worker_concurrency,
        broker_connection_retry_on_startup=True,
        # a task is redelivered if its worker vanishes; the visibility timeout bounds how long
        # Redis waits before handing an unacknowledged task to another worker
        broker_transport_options={
            "visibility_timeout": settings.broker_visibility_timeout_s,
            # sweep for a lost worker's tasks often enough to honour a short timeout
            "unacked_restore_interval": min(10, settings.broker_visibility_timeout_s),
            "unacked_restore_throttle": 1,
        },
        result_expires=7 * 24 * 3600,
        task_always_eager=eager,
        task_eager_propagates=True,
        task_track_started=True,
    )
    app.aerie_settings = settings  # type: ignore[attr-defined]
    return app
