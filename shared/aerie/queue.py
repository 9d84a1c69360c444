"""The Celery app every aerie worker and client builds, and the one way tasks run on it.

- Broker and result backend: Redis (`AERIE_BROKER`), or `memory://` for the embedded default,
  where tasks run eagerly in-process: the same task code, no second implementation.
- JSON serializer only; pickle is refused on both ends.
- `acks_late` + `reject_on_worker_lost`: a killed worker's task goes back to the queue.
- `KeepVisible` (a worker step, Redis brokers): a live worker keeps the messages of the tasks it
  holds from being handed out again, however long they run; the visibility timeout
  (`AERIE_BROKER_VISIBILITY_TIMEOUT_S`) then counts only for a worker that is gone (killed, host
  lost), whose tasks go to another worker once it has passed.
- Prefetch 1: a long extract or train task never hides behind another in a worker's buffer.
- `Consumer` (the workers' consumer class): a message that is not a Celery task of the JSON
  protocol (its body not `[args, kwargs, embed]`, not JSON, another content type, headers without
  a task name and id) or whose body is over `AERIE_BROKER_MAX_MESSAGE_BYTES` is refused once, before
  its body is decoded where the size is what is wrong: one log line, the message dropped (and its
  task id, if it has one, marked failed in the result backend). The worker goes on.
- `Alive` (a worker step, `celery worker --alive-file PATH`): the worker touches PATH every
  ALIVE_EVERY_S (`--alive-every`) while it runs, from a thread, so a probe can tell a live worker from a dead one by
  the file's age even while a solo-pool worker runs a long task and answers no control message
  (`celery inspect ping` says "No nodes replied" then; a liveness probe built on it kills training).
- `IdleExit` (a worker step, `celery worker --exit-when-idle SECONDS`): the worker stops by itself
  (a warm shutdown, exit status 0) once it has held no task for SECONDS; never while it holds one.
  A KEDA ScaledJob's worker is a Job that completes when its queue is done: scale-in is the worker's
  own decision, so no autoscaler kills a busy worker.
- `CheckItems` (a worker step, Redis brokers): an item on a queue's list that is not a kombu
  message (not JSON, not its envelope, over twice that bound) is dropped with one log line as it
  is read, before kombu decodes it.
- `run_task`: every service's tasks retry and give up the same way — transient errors (the store,
  an engine that says so) are retried with exponential backoff, at most MAX_RETRIES times; a
  permanent error, or the last retry's, is recorded once in the store and raised.
- `parse_message`: a task's kwargs against its contract; a message that does not match (a refused
  name, a typo) is a permanent failure, raised once with every problem named.
- `claim` / `mark_done` / `release`: exactly-once dispatch of a run's steps across racing workers
  (Redis SET NX on the broker; aerie.controller keys them by the run's plan).
- `held`: one live holder of a piece of work (a regenerate shard, a training) across deliveries of
  its task: a second delivery waits while the holder lives, and takes over once it is gone (a lease
  on the broker; in-process, a lock on a file of this host).
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from celery import Celery, Task, bootsteps, current_app
from celery.worker.consumer import Consumer as CeleryConsumer
from pydantic import BaseModel, ValidationError

from aerie.contracts import ProgressEvent
from aerie.settings import Settings, redact
from aerie.store import ObjectStore, StoreError, open_store

log = logging.getLogger(__name__)
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

INGEST, EXTRACT, TRAIN = "ingest", "extract", "train"

# task names: the only strings a producer needs to enqueue work (send_task by name)
INGEST_TASK = "aerie.ingest"
EXTRACT_TASK = "aerie.extract"
TRAIN_TASK = "aerie.train"
ALIGN_TASK = "aerie.align"  # the alignment check before training: light (HTTP + numpy), an extractor's work
REGENERATE_TASK = (
    "aerie.regenerate"  # one conversation shard answered by the target's server: HTTP + tokenizer, an extractor's work
)

ROUTES = {
    INGEST_TASK: {"queue": INGEST},
    EXTRACT_TASK: {"queue": EXTRACT},
    TRAIN_TASK: {"queue": TRAIN},
    ALIGN_TASK: {"queue": INGEST},
    REGENERATE_TASK: {"queue": INGEST},
}

MAX_RETRIES = 5
ALIVE_EVERY_S = 10.0  # a probe allows several periods: see k8s/base/trainer.yaml's livenessProbe
BACKOFF_S, BACKOFF_CAP_S = 2.0, 60.0


class QueueError(RuntimeError):
    """A broker setting that cannot do what is asked; the message names the setting."""


class MessageRefused(QueueError):
    """A queue message that does not match its contract: retrying the same message cannot help."""

    retryable = False


def make_app(settings: Settings | None = None, include: list[str] | None = None) -> Celery:
    settings = settings or Settings.load()
    backend = settings.result_backend or (None if settings.embedded else settings.broker)
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
        task_always_eager=settings.embedded,
        task_eager_propagates=True,
        task_track_started=True,
        worker_consumer="aerie.queue:Consumer",
    )
    add_alive_options(app)
    if settings.broker.startswith(("redis://", "rediss://")):
        app.steps["consumer"].add(KeepVisible)
        app.steps["consumer"].add(CheckItems)
    app.aerie_settings = settings
    return app


def add_alive_options(app: Celery) -> None:
    """`celery worker --alive-file PATH` on this app: the `Alive` step, off unless the option is given."""
    from celery.bin.base import CeleryOption as Option  # celery's own click option: the worker's CLI is celery's

    app.user_options["worker"].add(
        Option(
            ("--alive-file",),
            default=None,
            help=f"Touch this file every {ALIVE_EVERY_S:g} s while the worker runs (for liveness probes).",
        )
    )
    app.user_options["worker"].add(
        Option(("--alive-every",), type=float, default=ALIVE_EVERY_S, help="Seconds between touches of --alive-file.")
    )
    app.user_options["worker"].add(
        Option(
            ("--exit-when-idle",),
            type=float,
            default=None,
            help="Stop (exit status 0) once the worker has held no task for this many seconds.",
        )
    )
    app.steps["worker"].add(Alive)
    app.steps["worker"].add(IdleExit)


class Alive(bootsteps.StartStopStep):
    """Touches `--alive-file` every ALIVE_EVERY_S while the worker's blueprint runs.

    The touch comes from a thread of the worker's process, so it goes on while a solo pool runs a
    task in the main thread; it stops when the worker stops (the file is removed) or the process
    dies (the file ages). A probe checks the file's age: older than a few periods means no worker."""

    def __init__(self, parent, alive_file: str | None = None, alive_every: float = ALIVE_EVERY_S, **options) -> None:
        self.path = Path(alive_file) if alive_file else None
        self.every_s = float(alive_every)
        self.done = threading.Event()
        self.thread: threading.Thread | None = None

    def include_if(self, parent) -> bool:
        return self.path is not None

    def start(self, worker) -> None:
        assert self.path is not None  # include_if: the step runs only with --alive-file
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()
        self.thread = threading.Thread(target=self.touch, name="aerie-alive", daemon=True)
        self.thread.start()

    def touch(self) -> None:
        assert self.path is not None  # started by start() only
        while not self.done.wait(self.every_s):
            try:
                self.path.touch()
            except OSError as e:  # a full or read-only disk: the probe will say so by the file's age
                log.warning("could not touch the alive file %s (%s)", self.path, e)

    def stop(self, worker) -> None:
        self.done.set()
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    terminate = stop  # a cold shutdown (SIGQUIT, the workers' REMAP_SIGTERM) calls this instead


class IdleExit(bootsteps.StartStopStep):
    """Stops the worker once it has held no task (running or reserved) for `--exit-when-idle` seconds.

    The stop is Celery's warm shutdown, asked for from a thread through the worker's own flag
    (`state.should_stop`, which the consumer's loop checks): a task that arrives meanwhile runs to its
    end first, and a message fetched but not started goes back to the queue (acks_late)."""

    POLL_S = 0.5

    def __init__(self, parent, exit_when_idle: float | None = None, **options) -> None:
        self.idle_s = float(exit_when_idle) if exit_when_idle is not None else None
        self.done = threading.Event()

    def include_if(self, parent) -> bool:
        return self.idle_s is not None

    def start(self, worker) -> None:
        threading.Thread(target=self.watch, name="aerie-idle-exit", daemon=True).start()

    def watch(self) -> None:
        from celery.worker import state

        assert self.idle_s is not None  # started only when included (include_if)
        idle_since = time.monotonic()
        while not self.done.wait(self.POLL_S):
            if state.active_requests or state.reserved_requests:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since >= self.idle_s:
                log.info("no task for %g s (--exit-when-idle): stopping", self.idle_s)
                state.should_stop = 0  # EX_OK: a Job's pod succeeds
                return

    def stop(self, worker) -> None:
        self.done.set()

    terminate = stop


class Consumer(CeleryConsumer):
    """Celery's consumer, refusing a message it cannot run once instead of dying on it.

    Celery's own handler raises out of the worker's loop on a body that is not a 3-item list (or
    not a list at all), or on headers without an id: the worker stops ("Unrecoverable error"), the
    broker restores the unacknowledged message and every restart dies on it again. Here each
    message is checked first (`refusal`), the body's size before the body is decoded; a refused one
    is dropped with one log line. Anything Celery's handler still raises for a message (other than
    a broker connection error, which restarts the connection as before) drops that message too."""

    def create_task_handler(self, *args, **kwargs):
        handle = super().create_task_handler(*args, **kwargs)
        limit = task_settings(self.app).broker_max_message_bytes
        connection_errors = tuple(self.connection_errors)

        def on_task_received(message) -> None:
            reason = refusal(message, limit)
            if reason is None:
                try:
                    return handle(message)
                except connection_errors:
                    raise
                except Exception as e:  # a shape refusal() did not foresee: this message only
                    if message.acknowledged:
                        raise
                    reason = f"Celery could not take it ({type(e).__name__}: {_short(str(e), 200)})"
            self.refuse(message, reason)

        return on_task_received

    def refuse(self, message, reason: str) -> None:
        headers = message.headers if isinstance(message.headers, dict) else {}
        task_id, name = headers.get("id"), headers.get("task")
        queue = (message.delivery_info or {}).get("routing_key")
        log.error(
            "refused a message on queue %s (task %s, id %s, %d bytes): %s; dropped",
            queue,
            _short(name, 60),
            _short(task_id, 60),
            len(message.body or b""),
            reason,
        )
        message.reject_log_error(log, self.connection_errors)
        if isinstance(task_id, str) and task_id:
            try:
                self.app.backend.mark_as_failure(task_id, MessageRefused(f"message refused: {reason}"))
            except Exception as e:  # no result backend, or it is away: the log line stands
                log.warning("could not record the refusal of %s (%s: %s)", task_id, type(e).__name__, e)


EMBED_KEYS = frozenset({"callbacks", "errbacks", "chain", "chord"})  # what Celery's protocol 2 embeds


class CheckItems(bootsteps.StartStopStep):
    """Every item a worker pops off a queue's Redis list is checked before kombu decodes it.

    kombu decodes the item (its JSON envelope: body, headers, properties) inside the worker's loop;
    an item that is not valid JSON, not an envelope, or whose body is not base64, raises out of that
    loop and the worker stops. The check is redis-py's response callback for BRPOP on the channel
    the task consumer reads with (kombu's `channel.client`), so it sees the raw bytes first: an
    item over twice AERIE_BROKER_MAX_MESSAGE_BYTES (room for the body's base64 and its headers) is
    dropped before any decoding, and one that kombu could not take is dropped too, each with one
    log line. It was popped already: nothing to acknowledge, nothing comes back."""

    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c) -> None:
        limit = 2 * task_settings(c.app).broker_max_message_bytes
        channel = c.task_consumer.channel

        def checked(response, **_):
            if not response:
                return None
            queue, item = response
            reason = item_refusal(item, limit)
            if reason is None:
                return tuple(response)
            name = queue.decode(errors="replace").split(channel.sep)[0] if isinstance(queue, bytes) else queue
            log.error("refused an item of queue %s (%d bytes): %s; dropped", _short(name, 60), len(item), reason)
            return None  # kombu reads it as an empty poll

        channel.client.set_response_callback("BRPOP", checked)


def item_refusal(item: bytes, limit: int) -> str | None:
    """Why kombu's Redis transport could not take `item` (a queue list's raw entry) as a message."""
    if len(item) > limit:
        return f"it is over {limit} bytes (twice AERIE_BROKER_MAX_MESSAGE_BYTES)"
    try:
        envelope = json.loads(item)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        return f"it is not JSON ({type(e).__name__}: {_short(str(e), 120)})"
    if not isinstance(envelope, dict):
        return f"it is a JSON {type(envelope).__name__}, not a kombu message"
    properties = envelope.get("properties")
    if not isinstance(properties, dict) or not isinstance(properties.get("delivery_tag"), str):
        return "it has no properties with a delivery_tag"
    delivery = properties.get("delivery_info")
    if not isinstance(delivery, dict) or not {"exchange", "routing_key"} <= delivery.keys():
        return "its properties have no delivery_info with an exchange and a routing_key"
    headers, body = envelope.get("headers"), envelope.get("body")
    if headers is not None and not isinstance(headers, dict):
        return f"its headers are of type {type(headers).__name__}, not a mapping"
    if body is not None and not isinstance(body, str):
        return f"its body is of type {type(body).__name__}, not a string"
    encoding = properties.get("body_encoding")
    if encoding not in (None, "base64"):
        return f"its body_encoding {_short(encoding)} is not base64"
    if body and encoding == "base64":
        try:
            base64.b64decode(body, validate=True)
        except ValueError:  # binascii.Error
            return "its body is not base64"
    return None


def refusal(message, limit: int) -> str | None:
    """Why a worker cannot run `message` as a task of the JSON protocol (Celery protocol 2), or None.

    The size is checked before the body is decoded; the content type before it is parsed."""
    headers = message.headers
    if not isinstance(headers, dict):
        return f"its headers are a {type(headers).__name__}, not a mapping"
    for field in ("task", "id"):
        if not isinstance(headers.get(field), str) or not headers[field]:
            return f"its headers have no {field!r} (a Celery task message of protocol 2 names its task and id)"
    timelimit = headers.get("timelimit")
    if timelimit is not None and not (
        isinstance(timelimit, list | tuple)
        and len(timelimit) == 2
        and all(t is None or isinstance(t, int | float) for t in timelimit)
    ):
        return f"its timelimit header {_short(timelimit)} is not [hard, soft] seconds"
    size = len(message.body or b"")
    if size > limit:
        return f"its body is {size} bytes, over AERIE_BROKER_MAX_MESSAGE_BYTES={limit}"
    if message.content_type != "application/json":
        return f"its content type is {_short(message.content_type)}, not application/json"
    try:
        body = message.decode()
    except Exception as e:
        return f"its body is not JSON ({type(e).__name__}: {_short(str(e), 120)})"
    if not (isinstance(body, list) and len(body) == 3):
        kind = f"a list of {len(body)}" if isinstance(body, list) else f"of type {type(body).__name__}"
        return f"its body is {kind}, not [args, kwargs, embed]"
    args, kwargs, embed = body
    if not isinstance(args, list):
        return f"its args are of type {type(args).__name__}, not a list"
    if not isinstance(kwargs, dict):
        return f"its kwargs are of type {type(kwargs).__name__}, not a mapping"
    if embed is not None and not isinstance(embed, dict):
        return f"its embed is of type {type(embed).__name__}, not a mapping"
    if unknown := sorted(set(embed or {}) - EMBED_KEYS):  # they would overwrite the request's own fields
        return f"its embed has {_short(unknown)}, not only {sorted(EMBED_KEYS)}"
    for key, value in (embed or {}).items():
        if not (value is None or isinstance(value, dict) or (isinstance(value, list) and key != "chord")):
            return f"its embed's {key} is of type {type(value).__name__}, not a signature"
    return None


class KeepVisible(bootsteps.StartStopStep):
    """A live worker's tasks are never handed to another worker, however long they run.

    Redis has no acknowledgement of its own: kombu keeps each unacknowledged message in a sorted
    set scored by its delivery time, and any consumer hands out again those older than the
    visibility timeout, whether their worker is dead or only slow. A regeneration or a training
    longer than the timeout was then run twice at once (work done twice; follow-ups still once).
    This step re-scores, every quarter of the timeout, the messages of every task this worker holds
    (running, waiting for a slot, or for its retry countdown), from a thread of its own, so a task
    that blocks the worker's loop (solo pool) is kept too. The timeout then counts from the last
    renewal: a killed worker (or a lost host) stops renewing and its tasks come back once it has
    passed, as before."""

    requires = ("celery.worker.consumer.tasks:Tasks",)
    MAX_INTERVAL_S = 60.0

    def __init__(self, parent, **kwargs):
        super().__init__(parent, **kwargs)
        self._stop: threading.Event | None = None

    def start(self, c) -> None:
        channel = c.task_consumer.channel
        interval = min(self.MAX_INTERVAL_S, channel.visibility_timeout / 4)
        self._stop = stop = threading.Event()
        threading.Thread(
            target=self._renew_until, args=(channel, interval, stop), name="aerie-keep-visible", daemon=True
        ).start()

    def stop(self, c) -> None:
        if self._stop is not None:
            self._stop.set()
            self._stop = None

    shutdown = stop

    @staticmethod
    def _renew_until(channel, interval: float, stop: threading.Event) -> None:
        while not stop.wait(interval):
            try:
                renew_visibility(channel)
            except Exception as e:  # the broker away for a moment: the next round renews
                log.warning("could not renew the visibility of this worker's tasks (%s: %s)", type(e).__name__, e)


def renew_visibility(channel) -> int:
    """Re-score the unacknowledged messages of the tasks this worker holds (only those still
    unacknowledged: `ZADD XX`); how many were held."""
    from celery.worker import state

    tags = [
        tag
        for request in list(state.requests.values())
        if (tag := getattr(getattr(request, "message", None), "delivery_tag", None)) is not None
    ]
    if tags:
        now = time.time()
        with channel.conn_or_acquire() as client:
            client.zadd(channel.unacked_index_key, dict.fromkeys(tags, now), xx=True)
    return len(tags)


# --------------------------------------------------------------------------------------
# Inside a task
# --------------------------------------------------------------------------------------
_stores: dict[str, ObjectStore] = {}


def task_settings(app: Celery | None = None) -> Settings:
    """The settings of the app running the task (built by make_app), else the environment's."""
    settings = getattr(app or current_app, "aerie_settings", None)
    return settings if settings is not None else Settings.load()


def task_store(settings: Settings) -> ObjectStore:
    """One store client per (endpoint, bucket) per worker process."""
    key = f"{settings.store}|{settings.bucket}"
    if key not in _stores:
        _stores[key] = open_store(settings)
    return _stores[key]


def parse_message(model: type[M], kwargs: dict[str, Any]) -> M:
    """A task's kwargs as its contract, or MessageRefused naming each field, value and rule (a
    plain string, so the result backend and the worker log keep the reason)."""
    try:
        return model.model_validate(kwargs)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'message'}={_short(err.get('input'))}: {err['msg']}"
            for err in e.errors()[:5]
        )
        raise MessageRefused(f"{model.__name__} refused: {problems}") from None


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def backoff(retries: int) -> float:
    return min(BACKOFF_S * 2**retries, BACKOFF_CAP_S)


def retryable(error: BaseException) -> bool:
    """An error's own `retryable` when it says (an engine's, a refused key's), else: store errors."""
    said = getattr(error, "retryable", None)
    return bool(said) if said is not None else isinstance(error, StoreError)


def run_task(task: Task, work: Callable[[], T], give_up: Callable[[BaseException, int], None] | None = None) -> T:
    """Run a task's work under aerie's retry policy. `give_up(error, attempts)` records a failure
    that will not be retried (in the store, next to what failed); it is called once."""
    try:
        return work()
    except Exception as e:
        if retryable(e) and task.request.retries < task.max_retries:
            log.warning(
                "%s failed (%s): retry %d in %.0f s",
                task.name,
                e,
                task.request.retries + 1,
                backoff(task.request.retries),
            )
            raise task.retry(exc=e, countdown=backoff(task.request.retries)) from e
        if give_up is not None:
            try:
                give_up(e, task.request.retries + 1)
            except StoreError:
                log.exception("%s: could not record the failure", task.name)
        raise


def task_progress(task: Task, also: Callable[[ProgressEvent], None] | None = None) -> Callable[[ProgressEvent], None]:
    """A progress callback for a stage run by `task`: Celery state PROGRESS with the event's fields
    (Flower and `progress` show it), when the task runs on a worker."""

    def report(event: ProgressEvent) -> None:
        if also is not None:
            also(event)
        if not task.request.called_directly and not task.app.conf.task_always_eager:
            task.update_state(state="PROGRESS", meta=event.model_dump(exclude_none=True))

    return report


def check_broker(app: Celery) -> None:
    """Fail at once, naming the setting, when the broker cannot be reached (instead of Celery's
    endless connection retries)."""
    settings = task_settings(app)
    if settings.embedded:
        return
    try:
        with app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1, timeout=5)
    except Exception as e:  # kombu raises OperationalError (or the transport's own) after the retries
        where = redact(settings.broker)
        if _is_auth_failure(e):
            raise QueueError(
                f"broker {where} refused the credentials ({_auth_cause(e)}): check the password in AERIE_BROKER"
            ) from None
        raise QueueError(
            f"broker {where} is unreachable ({type(e).__name__}): is Redis running? check AERIE_BROKER"
        ) from None


def _auth_cause(e: BaseException) -> str:
    return type(_auth_error(e) or e).__name__


def _auth_error(e: BaseException | None) -> BaseException | None:
    """The Redis authentication error behind `e` (kombu wraps it in OperationalError), or None."""
    import redis

    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, redis.AuthenticationError) or "WRONGPASS" in str(e) or "NOAUTH" in str(e):
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def _is_auth_failure(e: BaseException) -> bool:
    return _auth_error(e) is not None


def enqueue(app: Celery, name: str, kwargs: dict[str, Any]):
    """Send a task by name; run it through the registered task when there is one (eager apps)."""
    if name in app.tasks:
        return app.tasks[name].apply_async(kwargs=kwargs)
    return app.send_task(name, kwargs=kwargs)


# --------------------------------------------------------------------------------------
# Exactly-once dispatch of a run's steps (aerie.controller) across racing workers
# --------------------------------------------------------------------------------------
_local_claims: dict[str, str] = {}
_local_done: set[str] = set()
_local_lock = threading.Lock()
CLAIM_TTL_S = 30 * 24 * 3600
SENDING_TTL_S = 120  # a claimant that died between claiming and sending is replaced after this


def _redis(settings: Settings, what: str):
    if not settings.broker.startswith(("redis://", "rediss://")):
        raise QueueError(f"{what} needs a Redis broker, AERIE_BROKER={settings.broker!r}")
    import redis

    return redis.Redis.from_url(settings.broker)


def claim(settings: Settings, names: list[str], owner: str) -> list[str]:
    """Those of `names` this owner may send now: each is claimed by exactly one owner (and again by
    that same owner, e.g. a redelivered task whose first attempt died between claiming and sending,
    until `mark_done`). Redis SET NX on the broker, in three round trips however many names;
    in-process for the embedded broker.

    Two deliveries of one task can still run at once (a worker's broker connection lost and its
    unacknowledged tasks requeued while they run; KeepVisible covers the visibility timeout): the
    owner's claim is then taken again only after the other's `sending` mark expires
    (SENDING_TTL_S), so the two never both send."""
    keys = [f"aerie:once:{name}" for name in names]
    if settings.embedded:
        with _local_lock:
            return [
                n for n, k in zip(names, keys) if k not in _local_done and _local_claims.setdefault(k, owner) == owner
            ]
    if not names:
        return []
    client = _redis(settings, "exactly-once dispatch")
    try:
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.set(key, owner, nx=True, ex=CLAIM_TTL_S)
        fresh = pipe.execute()
        pipe = client.pipeline(transaction=False)
        for key, new in zip(keys, fresh):
            if not new:
                pipe.get(key)
                pipe.exists(key + ":done")
        seen, mine = iter(pipe.execute()), []
        for key, new in zip(keys, fresh):
            if not new:
                holder, done = next(seen), next(seen)
                if (holder or b"").decode() != owner or done:
                    continue
            mine.append(key)
        pipe = client.pipeline(transaction=False)
        for key in mine:
            pipe.set(key + ":sending", owner, nx=True, ex=SENDING_TTL_S)
        sending = dict(zip(mine, pipe.execute()))
        return [n for n, k in zip(names, keys) if sending.get(k)]
    finally:
        client.close()


def claim_once(settings: Settings, name: str, owner: str) -> bool:
    """`claim` of one name: True for exactly one owner."""
    return bool(claim(settings, [name], owner))


def mark_done(settings: Settings, *names: str) -> None:
    """The claimed work of `names` was sent: never sent again, not even by its owner."""
    if settings.embedded:
        with _local_lock:
            _local_done.update(f"aerie:once:{name}" for name in names)
        return
    if names and settings.broker.startswith(("redis://", "rediss://")):
        client = _redis(settings, "exactly-once dispatch")
        try:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.set(f"aerie:once:{name}:done", 1, ex=CLAIM_TTL_S)
            pipe.execute()
        finally:
            client.close()


def release(settings: Settings, *names: str) -> None:
    """Forget the claims of `names` (the work failed for good and is retried): claimable again."""
    keys = [f"aerie:once:{name}{part}" for name in names for part in ("", ":sending", ":done")]
    if settings.embedded:
        with _local_lock:
            for key in keys:
                _local_claims.pop(key, None)
                _local_done.discard(key)
        return
    if keys:
        client = _redis(settings, "exactly-once dispatch")
        try:
            client.delete(*keys)
        finally:
            client.close()


# --------------------------------------------------------------------------------------
# One live holder of a piece of work across deliveries of its task
# --------------------------------------------------------------------------------------
LEASE_MIN_S, LEASE_MAX_S = 5.0, 30.0


def lease_ttl(settings: Settings) -> float:
    """A holder's lease: renewed every third of it, so it lapses that long after its holder dies;
    never longer than the visibility timeout (the dead holder's task comes back after it and should
    find the lease gone), at least LEASE_MIN_S (a loaded host may be late to renew)."""
    return max(LEASE_MIN_S, min(LEASE_MAX_S, float(settings.broker_visibility_timeout_s)))


@contextmanager
def local_lease(settings: Settings, name: str) -> Iterator[None]:
    """One holder of `name` among the processes (and threads) of this host that use the same store:
    an exclusive `flock` on a file named by the store and `name` in the temporary folder. The
    kernel drops it when its holder exits, however it exits, so a killed holder never blocks."""
    import fcntl
    import hashlib
    import tempfile
    from pathlib import Path

    where = hashlib.sha256(f"{settings.store}|{settings.bucket}|{name}".encode()).hexdigest()[:32]
    folder = Path(tempfile.gettempdir()) / "aerie-leases"
    folder.mkdir(mode=0o700, exist_ok=True)
    with open(folder / where, "a+b") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("%s is held by another process on this host: waiting until it finishes", name)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def held(settings: Settings, name: str, ttl_s: float | None = None) -> Iterator[None]:
    """Run the block as the one live holder of `name` (a redis-py Lock on the broker, renewed from a
    thread of its own every third of `ttl_s`). A second live delivery of the same task (the broker
    connection lost and the unacknowledged task requeued while it runs; see KeepVisible for the
    visibility timeout) waits here until the holder releases (then the work is found done) or dies
    (its lease lapses within `ttl_s`: the waiter takes it over), so the work is never done twice
    at once. In-process (the embedded broker): a lock on a file of this host (`local_lease`)."""
    if settings.embedded:
        with local_lease(settings, name):
            yield
        return
    import redis
    from redis.exceptions import LockError

    ttl_s = ttl_s or lease_ttl(settings)
    client = _redis(settings, "a lease")
    lock = client.lock(f"aerie:lease:{name}", timeout=ttl_s, sleep=min(1.0, ttl_s / 5), thread_local=False)
    try:
        if not lock.acquire(blocking=False):
            log.warning(
                "%s is held by another live delivery of its task: waiting until it finishes, or takes over once it "
                "is gone (its lease lapses within %.0f s)",
                name,
                ttl_s,
            )
            started = time.monotonic()
            lock.acquire(blocking=True)
            log.warning("%s: the lease is ours after %.1f s", name, time.monotonic() - started)
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(ttl_s / 3):
                try:
                    lock.reacquire()
                except LockError:  # it lapsed (a late renewal, the broker away): ours again if nobody took it
                    if not lock.acquire(blocking=False):
                        log.error(
                            "%s: the lease lapsed and another delivery holds it now (this one was late to renew)", name
                        )
                        return
                except redis.RedisError as e:  # the broker away for a moment: the next round renews
                    log.warning("%s: could not renew the lease (%s: %s)", name, type(e).__name__, e)

        renewer = threading.Thread(target=renew, name=f"aerie-lease-{name}", daemon=True)
        renewer.start()
        try:
            yield
        finally:
            stop.set()
            renewer.join(timeout=5)
            try:
                lock.release()
            except (LockError, redis.RedisError):  # lapsed or unreachable: it expires by itself
                pass
    finally:
        client.close()
