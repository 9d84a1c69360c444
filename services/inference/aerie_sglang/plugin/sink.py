"""Sinks for captured hidden states: a tmpfs directory or an S3 bucket, written off the scheduler.

- The scheduler thread only copies the rows of a request and hands them over (`Sinks.submit`);
  background writer threads (`AERIE_CAPTURE_WRITERS`) hash them, serialize them (safetensors) and
  write or upload them. The scheduler loop never waits for a disk or the network. The default is
  8 writers: hashing is what a writer spends its time on, and too few writers (or too small a
  bound) hold extraction below the server's bare prefill (BENCHMARKS.md, "the sink's writers and
  bound"). With `AERIE_CAPTURE_WRITER=process` a writer process does this for the shm sink
  instead, a batch at a time (writer_process.py); the writer threads then write only s3 captures.
- A capture appears atomically: `shm` writes `.<id>.partial` and renames it to `<id>.safetensors`;
  an S3 PUT is atomic. A client that holds a descriptor waits for the object, reads it, checks it
  (capture id and sha256 in the safetensors header) and deletes it: that is "claiming" it.
- Back-pressure: unclaimed bytes = captures in the shm directory + captures uploaded to the s3
  sink and not yet seen claimed + captures queued in memory + bytes reserved by admitted
  requests. A request that would push them past `max_unclaimed_bytes` is refused at admission
  (`Sinks.admit`), never half-written. The shm directory's share is its last listing plus what
  the writers put there since: the first writer thread (or the writer process) lists it every second, and an admission
  lists it only when that figure would refuse, so a refusal is decided on a fresh listing. A
  listing stats every file, so listing at every admission would cost the scheduler thread time
  per request that grows with the files waiting (`benchmarks/bench_sink_admit.py`). Files another
  process writes into the same directory (several schedulers, data parallel) count from the next
  listing on. The first writer thread
  also lists the s3 prefix every second while uploads wait (one request), forgetting what
  clients deleted: the scheduler never waits for the network.
- The first writer thread logs what captures cost every `STATS_LOG_S` while they run: the
  scheduler thread's time in the plugin per capture (admission, rows), the writers' (waiting for
  the device copy, sha256, write) and the listings'.
- Orphans (a client that died before claiming) stay within that bound, and captures older than
  `ttl_s` are deleted by the first writer thread (in the shm directory: the writer process, when
  it runs), in the shm directory and under the s3 prefix.
- Only the plugin's own names are ever counted or deleted: `<32 hex>.safetensors`, its
  `.<32 hex>.partial` and `<32 hex>.error`. The shm directory is private: created 0700 (an
  existing one must be a real directory of the server's user, and is narrowed to 0700), files
  0600, written without following symlinks; anything else refuses to load the plugin, naming
  AERIE_CAPTURE_DIR.

Configuration, read from the environment of the SGLang server when the plugin loads:

| variable                            | meaning                                          | default                  |
|-------------------------------------|--------------------------------------------------|--------------------------|
| `AERIE_SGLANG_BINARY`               | `1` enables the plugin (installed is not enabled) | off                     |
| `AERIE_CAPTURE_DIR`                 | directory of the `shm` sink (use a tmpfs)        | `/dev/shm/aerie-capture` |
| `AERIE_CAPTURE_MAX_UNCLAIMED_BYTES` | the back-pressure bound                          | 2 GiB                    |
| `AERIE_CAPTURE_TTL_S`               | unclaimed captures older than this are deleted   | 900                      |
| `AERIE_CAPTURE_WRITERS`             | writer threads per scheduler (or in its writer process) | 8                 |
| `AERIE_CAPTURE_WRITER`              | `threads`, or `process`: shm captures hashed and written by a writer process, handed over per batch through a shared-memory ring (writer_process.py) | `threads` |
| `AERIE_CAPTURE_RING_BYTES`          | that ring's size (memory taken as it is used)    | 1 GiB                    |
| `AERIE_STORE`                       | `http(s)://host:port` enables the `s3` sink      | (none: no `s3` sink)     |
| `AERIE_BUCKET`                      | bucket of the `s3` sink                          | `aerie`                  |
| `AERIE_S3_ACCESS_KEY`, `AERIE_S3_SECRET_KEY`, `AERIE_S3_REGION` | credentials    | (required with s3)       |
| `AERIE_CAPTURE_S3_PREFIX`           | key prefix of S3 captures                        | `capture/`               |
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import stat
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aerie_sglang.plugin.capture_files import (  # noqa: F401 (FORMAT_VERSION, SUFFIX: the hooks' names)
    DTYPE_NAMES,
    FORMAT_VERSION,
    OWN_NAME,
    SUFFIX,
    header,
    own_bytes,
    write_capture,
)
from aerie_sglang.plugin.capture_files import (
    sweep as sweep_dir,
)
from aerie_sglang.plugin.s3 import S3Client
from aerie_sglang.plugin.writer_process import ProcessWriter, WriterProcessError

logger = logging.getLogger("aerie_sglang.capture")

S3_REFRESH_S = 1.0  # how often uploads waiting to be claimed are re-listed
SHM_LIST_S = 1.0  # how often the shm directory is listed while the sink runs
STATS_LOG_S = 2.0  # how often the cost of captures is logged while they run


class CaptureConfigError(ValueError):
    """The server's capture configuration cannot work (named variable, and the fix)."""


class SinkFull(RuntimeError):
    """Admitting a capture would exceed the bound on unclaimed bytes."""


@dataclass(frozen=True)
class S3Target:
    endpoint: str
    bucket: str
    access_key: str
    secret_key: str
    region: str
    prefix: str


@dataclass(frozen=True)
class CaptureSinkSettings:
    shm_dir: Path
    max_unclaimed_bytes: int
    ttl_s: float
    s3: S3Target | None = None
    writers: int = 8  # writer threads (hashing and file writes release the GIL), or the writer process's
    writer: str = "threads"  # "process": shm captures hashed and written in a writer process (writer_process.py)
    ring_bytes: int = 1 << 30  # the process writer's shared-memory ring

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> CaptureSinkSettings:
        env = dict(os.environ if env is None else env)

        def number(name: str, default: float, kind=int):
            raw = env.get(name)
            if raw is None or raw == "":
                return kind(default)
            try:
                value = kind(raw)
            except ValueError:
                raise CaptureConfigError(f"{name}={raw!r} is not a number") from None
            if value <= 0:
                raise CaptureConfigError(f"{name}={raw!r} must be greater than 0")
            return value

        s3 = None
        store = env.get("AERIE_STORE", "")
        if store.startswith(("http://", "https://")):
            missing = [n for n in ("AERIE_S3_ACCESS_KEY", "AERIE_S3_SECRET_KEY") if not env.get(n)]
            if missing:
                raise CaptureConfigError(
                    f"AERIE_STORE={store} enables the s3 capture sink but {', '.join(missing)} "
                    "is not set: export the credentials of that server"
                )
            prefix = env.get("AERIE_CAPTURE_S3_PREFIX", "capture/")
            if prefix and not prefix.endswith("/"):
                prefix += "/"
            s3 = S3Target(
                endpoint=store,
                bucket=env.get("AERIE_BUCKET", "aerie"),
                access_key=env["AERIE_S3_ACCESS_KEY"],
                secret_key=env["AERIE_S3_SECRET_KEY"],
                region=env.get("AERIE_S3_REGION") or "us-east-1",
                prefix=prefix,
            )
        writer = (env.get("AERIE_CAPTURE_WRITER") or "threads").strip().lower()
        if writer not in ("threads", "process"):
            raise CaptureConfigError(
                f"AERIE_CAPTURE_WRITER={env['AERIE_CAPTURE_WRITER']!r} is not one of threads, process"
            )
        return cls(
            shm_dir=Path(env.get("AERIE_CAPTURE_DIR") or "/dev/shm/aerie-capture"),
            max_unclaimed_bytes=number("AERIE_CAPTURE_MAX_UNCLAIMED_BYTES", 2 << 30),
            ttl_s=number("AERIE_CAPTURE_TTL_S", 900.0, float),
            s3=s3,
            writers=number("AERIE_CAPTURE_WRITERS", 8),
            writer=writer,
            ring_bytes=number("AERIE_CAPTURE_RING_BYTES", 1 << 30),
        )

    @property
    def sinks(self) -> list[str]:
        return ["shm", "s3"] if self.s3 else ["shm"]

    def prepare(self) -> None:
        """Create the shm directory (0700) or accept an existing one only when it is a real
        directory of this user; CaptureConfigError (naming AERIE_CAPTURE_DIR) otherwise."""
        prepare_dir(self.shm_dir)

    def advertised(self) -> dict:
        """What clients read from /server_info: which sinks exist and where they write."""
        sinks: dict = {"shm": {"dir": str(self.shm_dir)}}
        if self.s3:
            sinks["s3"] = {"endpoint": self.s3.endpoint, "bucket": self.s3.bucket, "prefix": self.s3.prefix}
        return {"sinks": sinks, "max_unclaimed_bytes": self.max_unclaimed_bytes, "ttl_s": self.ttl_s}


def prepare_dir(path: Path) -> None:
    """The shm directory, private to the server's user: made 0700 when missing; an existing one
    must not be a symlink, must be a directory owned by this user, and is narrowed to 0700 (files
    in a directory others can enter are readable hidden states; one they own can be swapped)."""
    where = f"AERIE_CAPTURE_DIR={path}"
    if not path.is_absolute():
        raise CaptureConfigError(f"{where} is not an absolute path")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise CaptureConfigError(
            f"{where} is a symlink: refused (point AERIE_CAPTURE_DIR at a real directory of the server's user)"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise CaptureConfigError(f"{where} is not a directory")
    if st.st_uid != os.geteuid():
        raise CaptureConfigError(
            f"{where} belongs to uid {st.st_uid}, not the server's user ({os.geteuid()}): refused "
            "(another user made it; remove it or choose another AERIE_CAPTURE_DIR)"
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
        logger.warning("aerie capture: %s was mode %o, narrowed to 700", path, stat.S_IMODE(st.st_mode))


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw little-endian bytes of a contiguous CPU tensor, without a copy (two torch calls: each
    releases and retakes the GIL, which SGLang's scheduler thread shares with the writers)."""
    if t.dim() == 0:
        t = t.reshape(1)
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def safetensors_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The safetensors header (8-byte length + JSON, space-padded to 8 bytes) for these tensors
    laid out in the given order."""
    return header([(name, DTYPE_NAMES[str(t.dtype)], list(t.shape)) for name, t in tensors.items()], metadata)


def planned_size(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    return len(safetensors_header(tensors, metadata)) + sum(t.numel() * t.element_size() for t in tensors.values())


@dataclass
class Capture:
    """One request's rows, handed from the scheduler thread to a writer thread."""

    capture_id: str
    sink: str
    tensors: dict[str, torch.Tensor]  # contiguous CPU tensors (or pinned, with `ready` event)
    metadata: dict[str, str]
    nbytes: int
    ready: torch.cuda.Event | None = None  # to wait on before reading device copies


@dataclass
class SinkStats:
    """What captures cost one scheduler process, cumulative (seconds, bytes, counts)."""

    captures: int = 0
    bytes: int = 0
    admission_s: float = 0.0  # scheduler thread: admitting capture requests (hooks.py)
    admission_cpu_s: float = 0.0  # ... of it on the CPU (time.thread_time): the rest waited (the GIL, a lock)
    rows_s: float = 0.0  # scheduler thread: taking their rows and handing them over (hooks.py), of which
    rows_take_s: float = 0.0  # the rows kept (views of host rows, clones of device rows)
    rows_host_s: float = 0.0  # device rows sent to pinned host memory (copy and event launched)
    rows_cpu_s: float = 0.0  # the rows' time on the CPU
    wait_s: float = 0.0  # writers: waiting for the device-to-host copy
    hash_s: float = 0.0  # writers: sha256
    write_s: float = 0.0  # writers: serializing and writing or uploading
    writers_cpu_s: float = 0.0  # writers: all of that on the CPU
    listings: int = 0
    listing_s: float = 0.0  # listing the shm directory, whichever thread

    def line(self) -> str:
        n = max(self.captures, 1)

        def ms(s: float) -> str:
            return f"{s / n * 1e3:.3f}"

        return (
            f"aerie capture stats: {self.captures} captures, {self.bytes / 1e9:.3f} GB written; scheduler thread "
            f"{ms(self.admission_s + self.rows_s)} ms/capture, {ms(self.admission_cpu_s + self.rows_cpu_s)} on its CPU "
            f"(admission {ms(self.admission_s)}, rows {ms(self.rows_s)}: "
            f"kept {ms(self.rows_take_s)}, to host {ms(self.rows_host_s)}); "
            f"writers {ms(self.wait_s + self.hash_s + self.write_s)} ms/capture, {ms(self.writers_cpu_s)} on their CPU "
            f"(device copy {ms(self.wait_s)}, sha256 {ms(self.hash_s)}, write {ms(self.write_s)}); "
            f"{self.listings} listings of the shm directory, "
            f"{self.listing_s / max(self.listings, 1) * 1e3:.3f} ms each"
        )


@dataclass
class Sinks:
    """The sinks of one scheduler process and the writer threads that feed them."""

    config: CaptureSinkSettings
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _queue: queue.Queue[Capture] = field(default_factory=queue.Queue)
    _queued_bytes: int = 0
    _reserved: dict[int, int] = field(default_factory=dict)
    # reservations whose request was garbage-collected, forgotten at the next use of `_lock`
    _released: queue.SimpleQueue[int] = field(default_factory=queue.SimpleQueue)
    _threads: list[threading.Thread] = field(default_factory=list)
    _next_reservation: int = 0
    _s3_waiting: dict[str, tuple[int, float]] = field(default_factory=dict)  # key -> (bytes, uploaded at, monotonic)
    _listing: threading.Lock = field(default_factory=threading.Lock)  # one listing of the shm directory at a time
    _shm_listed: int = 0  # bytes of the plugin's files in the shm directory at the last listing
    _shm_since: int = 0  # bytes the writers put there since that listing began
    _listed_at: float = float("-inf")  # monotonic
    _process: ProcessWriter | None = None  # AERIE_CAPTURE_WRITER=process: shm captures go there
    _process_wait: tuple[float, float] = (0.0, 0.0)  # the batcher's wait and CPU seconds counted so far
    _threads_wrote: int = 0  # bytes the writer threads put in the shm directory, all told
    _threads_wrote_listed: int = 0  # ... when the writer process's last listing arrived
    stats: SinkStats = field(default_factory=SinkStats)

    def start(self) -> None:
        if self._threads:
            return
        self.config.prepare()
        self.list_shm()  # what an earlier server left there counts from the first admission
        threads = self.config.writers
        if self.config.writer == "process":
            process = ProcessWriter(
                self.config.shm_dir,
                self.config.ring_bytes,
                self.config.writers,
                self._process_done,
                self._queue.put,
                self._process_listed,
                list_s=SHM_LIST_S,
                ttl_s=self.config.ttl_s,
            )
            try:
                process.start()
            except WriterProcessError as e:
                raise CaptureConfigError(str(e)) from None
            self._process = process
            # in-process threads now write only s3 captures and what the ring cannot hold; the
            # first also lists, sweeps and logs
            threads = self.config.writers if self.config.s3 else 1
        for i in range(threads):
            thread = threading.Thread(target=self._run, args=(i == 0,), name=f"aerie-capture-writer-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    # --- accounting (scheduler thread) ----------------------------------------------------
    def shm_bytes(self) -> int:
        return own_bytes(self.config.shm_dir)

    def list_shm(self) -> None:
        """List the shm directory: its figure becomes what is there now, plus what the writers put
        there since this listing began (counted twice if the listing saw it too: never less)."""
        with self._listing:
            started = time.perf_counter()
            with self._lock:
                written_before = self._shm_since
            listed = self.shm_bytes()
            with self._lock:
                self._shm_listed = listed
                self._shm_since -= written_before
                self._listed_at = time.monotonic()
                self.stats.listings += 1
                self.stats.listing_s += time.perf_counter() - started

    def unclaimed_bytes(self, fresh: bool = True) -> int:
        """The bytes that count against the bound; `fresh=False` takes the shm directory's share
        from its last listing and the writes since, instead of listing it now."""
        if fresh:
            self.list_shm()
        with self._lock:
            self._forget_released()
            return (
                self._queued_bytes
                + sum(self._reserved.values())
                + sum(n for n, _ in self._s3_waiting.values())
                + self._shm_listed
                + self._shm_since
            )

    def admit(self, owner: object, nbytes: int) -> int:
        """Reserve `nbytes` for a request; the reservation ends when its capture is submitted or
        `owner` is garbage-collected (aborted, disconnected). Raises SinkFull over the bound."""
        if nbytes > self.config.max_unclaimed_bytes:
            raise SinkFull(
                f"aerie capture refused: this request's capture needs {nbytes} bytes, more than the bound "
                f"AERIE_CAPTURE_MAX_UNCLAIMED_BYTES={self.config.max_unclaimed_bytes} of the server: send a "
                "shorter sequence or raise the bound"
            )
        unclaimed = self.unclaimed_bytes(fresh=False)
        if unclaimed + nbytes > self.config.max_unclaimed_bytes:  # refused only on a fresh listing
            unclaimed = self.unclaimed_bytes()
        if unclaimed + nbytes > self.config.max_unclaimed_bytes:
            raise SinkFull(
                f"aerie capture refused: {unclaimed} unclaimed bytes are waiting in the capture sinks "
                f"(shm dir {self.config.shm_dir}{', s3 prefix ' + self.config.s3.prefix if self.config.s3 else ''}) "
                f"and this request needs {nbytes} more, over the bound "
                f"AERIE_CAPTURE_MAX_UNCLAIMED_BYTES={self.config.max_unclaimed_bytes}: clients must read "
                "and delete their captures (or raise the bound); retry later"
            )
        with self._lock:
            token = self._next_reservation
            self._next_reservation += 1
            self._reserved[token] = nbytes
        weakref.finalize(owner, self._release, token)
        return token

    def _release(self, token: int) -> None:
        """A request's finalizer. It runs inside a garbage collection, in whichever thread the
        collection happened to start, which may hold `_lock` at that moment (SGLang's Req is in a
        reference cycle, so only the cyclic collector frees it, and Python 3.12 runs it at any
        bytecode): taking `_lock` here deadlocks that thread, and SGLang's scheduler with it.
        SimpleQueue.put is reentrant, made for such callbacks; the token is dropped under the lock
        by its next user."""
        self._released.put(token)

    def _forget_released(self) -> None:
        """Drop the reservations of collected requests (the caller holds `_lock`)."""
        while True:
            try:
                token = self._released.get_nowait()
            except queue.Empty:
                return
            self._reserved.pop(token, None)

    def submit(self, capture: Capture, reservation: int | None) -> None:
        with self._lock:
            if reservation is not None:
                self._reserved.pop(reservation, None)
            self._queued_bytes += capture.nbytes
        if self._process is not None and capture.sink == "shm":
            self._process.submit(capture)
        else:
            self._queue.put(capture)

    def _process_listed(self, listed: int, process_since: int, seconds: float) -> None:
        """The writer process listed the shm directory (it lists and sweeps it every SHM_LIST_S in
        this mode: a listing stats every file, and each stat in the server would let the
        scheduler thread's GIL go): `listed` bytes, and `process_since` bytes it wrote since that
        listing began. What the writer threads wrote since the previous listing counts on top
        (counted twice if the listing saw it too: never less)."""
        with self._lock:
            self._shm_listed = listed
            self._shm_since = process_since + self._threads_wrote - self._threads_wrote_listed
            self._threads_wrote_listed = self._threads_wrote
            self._listed_at = time.monotonic()
            self.stats.listings += 1
            self.stats.listing_s += seconds

    def _process_done(self, captures: list[Capture], written: set[str], reply: dict) -> None:
        """The writer process is done with these captures: those in `written` are files in the
        shm directory now, the others error notes (the writer process, or its end, wrote them)."""
        done = [c for c in captures if c.capture_id in written]
        nbytes = sum(c.nbytes for c in done)
        with self._lock:
            self._queued_bytes -= sum(c.nbytes for c in captures)
            self._shm_since += nbytes
            self.stats.captures += len(done)
            self.stats.bytes += nbytes
            self.stats.hash_s += float(reply.get("hash_s", 0.0))
            self.stats.write_s += float(reply.get("write_s", 0.0))
            self.stats.writers_cpu_s += float(reply.get("cpu_s", 0.0))

    # --- writer thread --------------------------------------------------------------------
    def _run(self, sweeper: bool) -> None:
        s3 = None
        if self.config.s3:
            t = self.config.s3
            s3 = S3Client(t.endpoint, t.access_key, t.secret_key, t.region)
        last_sweep = last_listing = last_log = 0.0
        logged = 0
        while True:
            try:
                capture = self._queue.get(timeout=1.0)
            except queue.Empty:
                capture = None
            if capture is not None:
                try:
                    self._write(capture, s3)
                except Exception:
                    logger.exception("aerie capture %s: writing to sink %s failed", capture.capture_id, capture.sink)
                finally:
                    with self._lock:
                        self._queued_bytes -= capture.nbytes
            now = time.monotonic()
            if not sweeper:
                continue
            if now - self._listed_at > SHM_LIST_S and self._process is None:  # the writer process lists it
                self.list_shm()
            if self.stats.captures != logged and now - last_log > STATS_LOG_S:
                last_log, logged = now, self.stats.captures
                process = self._process
                if process is not None:  # the batcher's time and CPU are the writers' "device copy"
                    with self._lock:
                        self.stats.wait_s += process.wait_s - self._process_wait[0]
                        self.stats.writers_cpu_s += process.cpu_s - self._process_wait[1]
                        self._process_wait = (process.wait_s, process.cpu_s)
                logger.info(self.stats.line())
                if process is not None:
                    logger.info(process.stats.line())
            sweep = now - last_sweep > min(5.0, self.config.ttl_s / 4)
            if s3 is not None and (sweep or (self._s3_waiting and now - last_listing > S3_REFRESH_S)):
                last_listing = now
                self._sweep_s3(s3, expire=sweep)
            if sweep and self._process is None:  # the writer process sweeps it
                last_sweep = now
                self._sweep()

    def _write(self, capture: Capture, s3: S3Client | None) -> None:
        started, cpu = time.perf_counter(), time.thread_time()
        if capture.ready is not None:
            capture.ready.synchronize()
        copied = time.perf_counter()
        parts = [_tensor_bytes(t) for t in capture.tensors.values()]
        data_sha = hashlib.sha256()
        for p in parts:
            data_sha.update(p)
        hashed = time.perf_counter()
        metadata = dict(capture.metadata, sha256=data_sha.hexdigest())
        head = safetensors_header(capture.tensors, metadata)
        if capture.sink == "shm":
            write_capture(self.config.shm_dir, capture.capture_id, [head, *parts])
            with self._lock:
                self._shm_since += capture.nbytes
                self._threads_wrote += capture.nbytes
        elif capture.sink == "s3":
            assert s3 is not None and self.config.s3 is not None
            body_sha = hashlib.sha256(head)
            for p in parts:
                body_sha.update(p)
            key = self.config.s3.prefix + capture.capture_id + SUFFIX
            s3.put(self.config.s3.bucket, key, [head, *parts], body_sha.hexdigest())
            with self._lock:  # unclaimed until a listing no longer shows it
                self._s3_waiting[key] = (capture.nbytes, time.monotonic())
        else:
            raise ValueError(f"unknown sink {capture.sink!r}")
        with self._lock:
            self.stats.captures += 1
            self.stats.bytes += capture.nbytes
            self.stats.wait_s += copied - started
            self.stats.hash_s += hashed - copied
            self.stats.write_s += time.perf_counter() - hashed
            self.stats.writers_cpu_s += time.thread_time() - cpu

    def _sweep_s3(self, s3: S3Client, expire: bool) -> None:
        """List the capture prefix: forget uploads clients have claimed (deleted) and, with
        `expire`, delete captures older than ttl_s. Only `<prefix><32 hex>.safetensors` is touched."""
        assert self.config.s3 is not None
        bucket, prefix = self.config.s3.bucket, self.config.s3.prefix
        listed_at = time.monotonic()
        try:
            objects = s3.list(bucket, prefix)
        except Exception as e:  # the store is down: keep counting what waits, try again later
            logger.warning(
                "aerie capture: listing s3://%s/%s failed (%s); unclaimed uploads still count", bucket, prefix, e
            )
            return
        present = {o.key for o in objects}
        with self._lock:
            for key, (_, uploaded) in list(self._s3_waiting.items()):
                if key not in present and uploaded < listed_at:
                    del self._s3_waiting[key]
        if not expire:
            return
        cutoff = time.time() - self.config.ttl_s
        for o in objects:
            name = o.key[len(prefix) :]
            if "/" in name or not OWN_NAME.fullmatch(name) or not name.endswith(SUFFIX) or o.modified >= cutoff:
                continue
            try:
                s3.delete(bucket, o.key)
                logger.warning(
                    "aerie capture: deleted unclaimed s3://%s/%s (older than %ss)", bucket, o.key, self.config.ttl_s
                )
            except Exception as e:
                logger.warning("aerie capture: could not delete expired s3://%s/%s (%s)", bucket, o.key, e)
            with self._lock:
                self._s3_waiting.pop(o.key, None)

    def _sweep(self) -> None:
        """Delete captures nobody claimed within ttl_s (capture_files.sweep)."""
        sweep_dir(self.config.shm_dir, self.config.ttl_s, logger)
