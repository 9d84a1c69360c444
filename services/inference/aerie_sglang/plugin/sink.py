"""Sinks for captured hidden states: a tmpfs directory or an S3 bucket, written off the scheduler.

- The scheduler thread only copies the rows of a request and hands them over (`Sinks.submit`);
  background writer threads (`AERIE_CAPTURE_WRITERS`) hash them, serialize them (safetensors) and
  write or upload them. The scheduler loop never waits for a disk or the network. One thread
  hashes ~0.75 GB/s on an H200 host: 4 writers keep up with 2x its SmolLM2 / 8B prefill rate
  (`benchmarks/bench_capture.py --sink-only`).
- A capture appears atomically: `shm` writes `.<id>.partial` and renames it to `<id>.safetensors`;
  an S3 PUT is atomic. A client that holds a descriptor waits for the object, reads it, checks it
  (capture id and sha256 in the safetensors header) and deletes it: that is "claiming" it.
- Back-pressure: unclaimed bytes = files in the shm directory + captures queued in memory +
  bytes reserved by admitted requests. A request that would push them past
  `max_unclaimed_bytes` is refused at admission (`Sinks.admit`), never half-written.
- Orphans (a client that died before claiming) stay within that bound, and files older than
  `ttl_s` are deleted by the first writer thread.

Configuration, read from the environment of the SGLang server when the plugin loads:

| variable                            | meaning                                          | default                  |
|-------------------------------------|--------------------------------------------------|--------------------------|
| `AERIE_SGLANG_BINARY`               | `1` enables the plugin (installed is not enabled) | off                     |
| `AERIE_CAPTURE_DIR`                 | directory of the `shm` sink (use a tmpfs)        | `/dev/shm/aerie-capture` |
| `AERIE_CAPTURE_MAX_UNCLAIMED_BYTES` | the back-pressure bound                          | 2 GiB                    |
| `AERIE_CAPTURE_TTL_S`               | unclaimed captures older than this are deleted   | 900                      |
| `AERIE_CAPTURE_WRITERS`             | writer threads per scheduler                     | 4                        |
| `AERIE_STORE`                       | `http(s)://host:port` enables the `s3` sink      | (none: no `s3` sink)     |
| `AERIE_BUCKET`                      | bucket of the `s3` sink                          | `aerie`                  |
| `AERIE_S3_ACCESS_KEY`, `AERIE_S3_SECRET_KEY`, `AERIE_S3_REGION` | credentials    | (required with s3)       |
| `AERIE_CAPTURE_S3_PREFIX`           | key prefix of S3 captures                        | `capture/`               |
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aerie_sglang.plugin.s3 import S3Client

logger = logging.getLogger("aerie_sglang.capture")

FORMAT_VERSION = 1
SUFFIX = ".safetensors"
ERROR_SUFFIX = ".error"  # next to a capture that could not be written: the reason, for the client
PARTIAL_PREFIX = "."
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


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
    writers: int = 4  # writer threads (hashing and file writes release the GIL)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "CaptureSinkSettings":
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
        return cls(
            shm_dir=Path(env.get("AERIE_CAPTURE_DIR") or "/dev/shm/aerie-capture"),
            max_unclaimed_bytes=number("AERIE_CAPTURE_MAX_UNCLAIMED_BYTES", 2 << 30),
            ttl_s=number("AERIE_CAPTURE_TTL_S", 900.0, float),
            s3=s3,
            writers=number("AERIE_CAPTURE_WRITERS", 4),
        )

    @property
    def sinks(self) -> list[str]:
        return ["shm", "s3"] if self.s3 else ["shm"]

    def advertised(self) -> dict:
        """What clients read from /server_info: which sinks exist and where they write."""
        sinks: dict = {"shm": {"dir": str(self.shm_dir)}}
        if self.s3:
            sinks["s3"] = {"endpoint": self.s3.endpoint, "bucket": self.s3.bucket, "prefix": self.s3.prefix}
        return {"sinks": sinks, "max_unclaimed_bytes": self.max_unclaimed_bytes, "ttl_s": self.ttl_s}


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """Raw little-endian bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def safetensors_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The safetensors header (8-byte length + JSON, space-padded to 8 bytes) for these tensors
    laid out in the given order."""
    entries: dict = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        entries[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


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
    ready: object | None = None  # a torch.cuda.Event to wait on before reading device copies


@dataclass
class Sinks:
    """The sinks of one scheduler process and the writer threads that feed them."""

    config: CaptureSinkSettings
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _queue: "queue.Queue[Capture]" = field(default_factory=queue.Queue)
    _queued_bytes: int = 0
    _reserved: dict[int, int] = field(default_factory=dict)
    _threads: list[threading.Thread] = field(default_factory=list)
    _next_reservation: int = 0

    def start(self) -> None:
        if self._threads:
            return
        self.config.shm_dir.mkdir(parents=True, exist_ok=True)
        for i in range(self.config.writers):
            thread = threading.Thread(target=self._run, args=(i == 0,), name=f"aerie-capture-writer-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    # --- accounting (scheduler thread) ----------------------------------------------------
    def shm_bytes(self) -> int:
        total = 0
        try:
            with os.scandir(self.config.shm_dir) as it:
                for entry in it:
                    if entry.name.endswith(SUFFIX) or entry.name.endswith(".partial"):
                        try:
                            total += entry.stat().st_size
                        except FileNotFoundError:  # claimed meanwhile
                            pass
        except FileNotFoundError:
            pass
        return total

    def unclaimed_bytes(self) -> int:
        with self._lock:
            pending = self._queued_bytes + sum(self._reserved.values())
        return pending + self.shm_bytes()

    def admit(self, owner: object, nbytes: int) -> int:
        """Reserve `nbytes` for a request; the reservation ends when its capture is submitted or
        `owner` is garbage-collected (aborted, disconnected). Raises SinkFull over the bound."""
        if nbytes > self.config.max_unclaimed_bytes:
            raise SinkFull(
                f"aerie capture refused: this request's capture needs {nbytes} bytes, more than the bound "
                f"AERIE_CAPTURE_MAX_UNCLAIMED_BYTES={self.config.max_unclaimed_bytes} of the server: send a "
                "shorter sequence or raise the bound"
            )
        unclaimed = self.unclaimed_bytes()
        if unclaimed + nbytes > self.config.max_unclaimed_bytes:
            raise SinkFull(
                f"aerie capture refused: {unclaimed} unclaimed bytes are waiting in the capture sinks "
                f"(shm dir {self.config.shm_dir}) and this request needs {nbytes} more, over the bound "
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
        with self._lock:
            self._reserved.pop(token, None)

    def submit(self, capture: Capture, reservation: int | None) -> None:
        with self._lock:
            if reservation is not None:
                self._reserved.pop(reservation, None)
            self._queued_bytes += capture.nbytes
        self._queue.put(capture)

    # --- writer thread --------------------------------------------------------------------
    def _run(self, sweeper: bool) -> None:
        s3 = None
        if self.config.s3:
            t = self.config.s3
            s3 = S3Client(t.endpoint, t.access_key, t.secret_key, t.region)
        last_sweep = 0.0
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
            if sweeper and now - last_sweep > min(5.0, self.config.ttl_s / 4):
                last_sweep = now
                self._sweep()

    def _write(self, capture: Capture, s3: S3Client | None) -> None:
        if capture.ready is not None:
            capture.ready.synchronize()
        parts = [_tensor_bytes(t) for t in capture.tensors.values()]
        data_sha = hashlib.sha256()
        for p in parts:
            data_sha.update(p)
        metadata = dict(capture.metadata, sha256=data_sha.hexdigest())
        header = safetensors_header(capture.tensors, metadata)
        if capture.sink == "shm":
            final = self.config.shm_dir / f"{capture.capture_id}{SUFFIX}"
            partial = self.config.shm_dir / f"{PARTIAL_PREFIX}{capture.capture_id}.partial"
            try:
                with open(partial, "wb") as f:
                    f.write(header)
                    for p in parts:
                        f.write(p)
                os.replace(partial, final)
            except OSError as e:  # typically a full tmpfs: tell the waiting client, keep nothing
                partial.unlink(missing_ok=True)
                error = self.config.shm_dir / f"{capture.capture_id}{ERROR_SUFFIX}"
                try:
                    error.write_text(f"the SGLang server could not write {final}: {e}")
                except OSError:
                    pass
                raise
        elif capture.sink == "s3":
            assert s3 is not None and self.config.s3 is not None
            body_sha = hashlib.sha256(header)
            for p in parts:
                body_sha.update(p)
            key = self.config.s3.prefix + capture.capture_id + SUFFIX
            s3.put(self.config.s3.bucket, key, [header, *parts], body_sha.hexdigest())
        else:
            raise ValueError(f"unknown sink {capture.sink!r}")

    def _sweep(self) -> None:
        """Delete captures nobody claimed within ttl_s (their client died)."""
        cutoff = time.time() - self.config.ttl_s
        try:
            with os.scandir(self.config.shm_dir) as it:
                for entry in it:
                    if not entry.name.endswith((SUFFIX, ".partial", ERROR_SUFFIX)):
                        continue
                    try:
                        if entry.stat().st_mtime < cutoff:
                            os.unlink(entry.path)
                            logger.warning("aerie capture: deleted unclaimed %s (older than %ss)", entry.path, self.config.ttl_s)
                    except FileNotFoundError:
                        pass
        except FileNotFoundError:
            pass
