"""The shm sink's writer process (`AERIE_CAPTURE_WRITER=process`): captures hashed and written
outside the SGLang server's GIL, handed over once per batch instead of once per capture.

Why: SGLang's scheduler thread holds the GIL nearly all the time. Each time an in-process writer
thread takes it back (after the queue, the event, sha256, open, writev, close, rename: ~10 times
per capture), the scheduler waits: at a small model's prefill rate, thousands of hand-overs a
second, which writer threads pay for in the server's own speed (BENCHMARKS.md, the sink's writers).

How, in the server (`ProcessWriter`, one thread besides the reader of each writer process):
- The batcher thread takes a capture from the queue, waits on its batch's device-copy event,
  then takes the captures that follow it with the same event (the rest of the batch: SGLang
  hands them over within a millisecond of each other).
- It copies the rows into a ring of shared memory (an anonymous memfd, mapped by both
  processes): one `memmove` per host buffer the batch's captures are views of (the batch's final
  rows, SGLang's aux rows), not one per capture. memmove runs without the GIL.
- It sends one JSON line per group (ids, metadata, and each tensor's offset, dtype and shape in
  the ring) to the writer process's stdin.
- A reader thread takes the process's one line per group back, frees the group's ring space and
  settles the sink's accounting (the bytes it counted as queued are now files, or error notes).
So a batch costs the server's GIL a few hand-overs, not ~10 per capture.

In the writer process (`main`, stdlib only: it starts without torch), `threads` threads hash each
capture and write it exactly as the in-process writers do (`capture_files.write_capture`: a
private partial file renamed, byte for byte the same file). If the process dies, the captures
it held get error notes (their clients fail at once, naming it) and the next group starts a new
one. A capture larger than the ring goes to the in-process writer threads instead.
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import json
import logging
import mmap
import os
import queue
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from aerie_sglang.plugin.capture_files import (
    DTYPE_NAMES,
    ITEMSIZE,
    header,
    own_bytes,
    sweep,
    write_capture,
    write_error_note,
)

logger = logging.getLogger("aerie_sglang.capture")

ALIGN = 64  # each host buffer's span starts at a multiple of this in the ring
GATHER_S = 0.002  # a batch's captures come this close together: a longer gap ends the group


class WriterProcessError(RuntimeError):
    """The writer process or its ring could not be set up (the message names the setting)."""


# --- the ring (server side) -------------------------------------------------------------------
@dataclass
class _Region:
    start: int
    size: int
    done: bool = False


class Ring:
    """Shared memory the writer process maps too: an anonymous memfd (a private temporary file
    in `fallback_dir` where memfd_create is missing), sparse until written. Space is taken in
    order, wrapping at the end, and comes back when the oldest region in use is freed (regions
    freed out of order wait for those before them)."""

    def __init__(self, size: int, fallback_dir: Path):
        try:
            self.fd = os.memfd_create("aerie-capture-ring", getattr(os, "MFD_CLOEXEC", 1))
        except (AttributeError, OSError):
            import tempfile

            self.fd = os.dup(tempfile.TemporaryFile(dir=fallback_dir).fileno())
        os.ftruncate(self.fd, size)
        self.size = size
        self.map = mmap.mmap(self.fd, size)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self._regions: collections.deque[_Region] = collections.deque()

    def take(self, n: int) -> _Region | None:
        """A region of n bytes, or None while the ring lacks that much contiguous space."""
        if n > self.size:
            return None
        start: int | None
        if not self._regions:
            start = 0
        else:
            oldest, newest = self._regions[0].start, self._regions[-1]
            end = newest.start + newest.size
            if newest.start >= oldest:  # in use: [oldest, end); free: [end, size) and [0, oldest)
                start = end if end + n <= self.size else (0 if n <= oldest else None)
            else:  # wrapped: in use [oldest, size) and [0, end); free: [end, oldest)
                start = end if end + n <= oldest else None
        if start is None:
            return None
        region = _Region(start, n)
        self._regions.append(region)
        return region

    def give_back(self, region: _Region) -> None:
        region.done = True
        while self._regions and self._regions[0].done:
            self._regions.popleft()

    @property
    def in_use(self) -> int:
        return sum(r.size for r in self._regions if not r.done)


# --- the server side --------------------------------------------------------------------------
@dataclass
class _Channel:
    """One writer process, the groups it holds (seq -> (region, captures)), and whether it ended."""

    proc: subprocess.Popen
    inflight: dict[int, tuple[_Region, list]] = field(default_factory=dict)
    dead: bool = False
    wrote: int = 0  # bytes of the files its replies said it wrote, all told


@dataclass
class ProcessStats:
    groups: int = 0
    captures: int = 0
    copied_bytes: int = 0
    ring_wait_s: float = 0.0  # the batcher waiting for ring space (the writer process behind)
    restarts: int = 0

    def line(self) -> str:
        return (
            f"aerie capture writer process: {self.groups} groups, "
            f"{self.captures / max(self.groups, 1):.2f} captures per group, "
            f"{self.copied_bytes / max(self.captures, 1) / 1e6:.3f} MB copied per capture, "
            f"{self.ring_wait_s:.3f} s waiting for ring space, {self.restarts} restarts"
        )


class ProcessWriter:
    """The server's side of the writer process: `submit` takes captures from the scheduler thread
    (a queue put), the batcher and reader threads do the rest (the module docstring)."""

    def __init__(
        self,
        directory: Path,
        ring_bytes: int,
        threads: int,
        on_done,
        fallback,
        on_listed,
        list_s: float = 1.0,
        ttl_s: float = 900.0,
    ):
        """`on_done(captures, written_ids, reply)` settles the sink's accounting for a group;
        `fallback(capture)` writes a capture in-process (one larger than the ring);
        `on_listed(bytes listed, bytes written since, seconds)` takes the writer process's listing
        of the directory (it lists it every `list_s` and deletes captures older than `ttl_s`)."""
        self.directory, self.ring_bytes, self.threads = directory, ring_bytes, threads
        self.list_s, self.ttl_s = list_s, ttl_s
        self._on_done, self._fallback, self._on_listed = on_done, fallback, on_listed
        self._queue: queue.Queue = queue.Queue()
        self._cond = threading.Condition()
        self._seq = 0
        self.ring: Ring | None = None
        self._channel: _Channel | None = None
        self.stats = ProcessStats()
        self.wait_s = 0.0  # the batcher: waiting for device copies, copying into the ring
        self.cpu_s = 0.0  # ... of it on its CPU

    def start(self) -> None:
        """The ring and the first writer process, then the batcher thread; WriterProcessError
        when either cannot be made."""
        try:
            self.ring = Ring(self.ring_bytes, self.directory)
        except OSError as e:
            raise WriterProcessError(
                f"AERIE_CAPTURE_WRITER=process: the shared-memory ring of "
                f"AERIE_CAPTURE_RING_BYTES={self.ring_bytes} could not be made ({e})"
            ) from None
        with self._cond:
            self._channel = self._spawn()
        threading.Thread(target=self._run, name="aerie-capture-batcher", daemon=True).start()

    def submit(self, capture) -> None:
        self._queue.put(capture)

    def _spawn(self) -> _Channel:
        assert self.ring is not None
        root = str(Path(__file__).resolve().parents[2])  # the folder holding aerie_sglang
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        try:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "aerie_sglang.plugin.writer_process",
                    "--fd",
                    str(self.ring.fd),
                    "--size",
                    str(self.ring.size),
                    "--dir",
                    str(self.directory),
                    "--threads",
                    str(self.threads),
                    "--list-s",
                    str(self.list_s),
                    "--ttl-s",
                    str(self.ttl_s),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                pass_fds=(self.ring.fd,),
                env=env,
            )
        except OSError as e:
            raise WriterProcessError(
                f"AERIE_CAPTURE_WRITER=process: the writer process could not start ({e})"
            ) from None
        channel = _Channel(proc)
        threading.Thread(
            target=self._read, args=(channel,), name="aerie-capture-writer-process-reader", daemon=True
        ).start()
        return channel

    # --- batcher thread -----------------------------------------------------------------------
    def _run(self) -> None:
        following = None  # the first capture of the next batch, met while gathering this one
        while True:
            first = following if following is not None else self._queue.get()
            following = None
            started, cpu = time.perf_counter(), time.thread_time()
            group = [first]
            try:
                if first.ready is not None:
                    first.ready.synchronize()  # the batch's host copy
                # The rest of the batch: SGLang's scheduler hands its captures over one by one,
                # a fraction of a millisecond apart; a get that finds one waiting does not release the GIL.
                while True:
                    try:
                        capture = (
                            self._queue.get(timeout=GATHER_S) if first.ready is not None else self._queue.get_nowait()
                        )
                    except queue.Empty:
                        break
                    if capture.ready is not first.ready:  # another batch's (or a prompt split over batches)
                        following = capture
                        break
                    group.append(capture)
                self._send(group)
            except Exception:  # never lose the thread: what it held gets error notes
                logger.exception(
                    "aerie capture: the writer process's batcher failed; %d captures get error notes", len(group)
                )
                self._fail(group, "the SGLang server's capture batcher failed (its log has the traceback)")
            finally:
                self.wait_s += time.perf_counter() - started
                self.cpu_s += time.thread_time() - cpu

    def _send(self, group: list) -> None:
        """Copy the group's rows into the ring, one memmove per host buffer they are views of, and
        hand the group to the writer process. A group larger than the ring is halved; a capture
        larger than it goes to the in-process writers."""
        assert self.ring is not None
        spans, layout, odd = _layout(group)
        for capture in odd:  # not one contiguous span of host memory each
            self._fallback(capture)
        group = [c for c in group if id(c) in layout]
        if not group:
            return
        total = sum(-(-n // ALIGN) * ALIGN for _, n in spans.values())
        if total > self.ring.size:
            if len(group) == 1:
                self._fallback(group[0])
                return
            half = len(group) // 2
            self._send(group[:half])
            self._send(group[half:])
            return
        waited = time.perf_counter()
        with self._cond:
            while (region := self.ring.take(total)) is None:
                self._cond.wait(1.0)
        self.stats.ring_wait_s += time.perf_counter() - waited
        try:
            offsets, at = {}, region.start
            for key, (pointer, n) in spans.items():
                ctypes.memmove(self.ring.address + at, pointer, n)
                offsets[key] = at
                at += -(-n // ALIGN) * ALIGN
            captures = [
                {
                    "id": c.capture_id,
                    "metadata": c.metadata,
                    "tensors": [
                        [name, dtype, shape, offsets[key] + within, n]
                        for name, dtype, shape, key, within, n in layout[id(c)]
                    ],
                }
                for c in group
            ]
            with self._cond:
                if self._channel is None or self._channel.dead:
                    self.stats.restarts += self._channel is not None
                    self._channel = self._spawn()
                self._seq += 1
                seq = self._seq
                line = json.dumps({"seq": seq, "captures": captures}, separators=(",", ":")).encode() + b"\n"
                channel = self._channel
                channel.inflight[seq] = (region, group)  # from here on its reader settles the group
                self.stats.groups += 1
                self.stats.captures += len(group)
                self.stats.copied_bytes += total
        except Exception as e:  # nothing of the group went out: its ring space back, error notes
            with self._cond:
                self.ring.give_back(region)
                self._cond.notify_all()
            logger.exception("aerie capture: %d captures could not go to the writer process", len(group))
            self._fail(group, f"the SGLang server could not hand it to its capture writer process ({e})")
            return
        for capture in group:
            capture.tensors = {}  # the host buffers may go: the ring holds the rows
        assert channel.proc.stdin is not None  # started with stdin=PIPE
        try:
            channel.proc.stdin.write(line)
            channel.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):  # the process ended: its reader fails what it held
            pass

    # --- reader thread, one per writer process ------------------------------------------------
    def _read(self, channel: _Channel) -> None:
        assert channel.proc.stdout is not None  # started with stdout=PIPE
        for raw in channel.proc.stdout:
            try:
                reply = json.loads(raw)
                if "listed" in reply:  # its listing of the directory
                    with self._cond:
                        since = max(0, channel.wrote - int(reply["wrote_before"]))
                    self._on_listed(int(reply["listed"]), since, float(reply.get("seconds", 0.0)))
                    continue
                seq = int(reply["seq"])
            except (ValueError, KeyError, TypeError):
                logger.error("aerie capture: the writer process said %r, not a reply", raw[:200])
                continue
            with self._cond:
                channel.wrote += int(reply.get("bytes", 0))
                held = channel.inflight.pop(seq, None)
                if held is not None:
                    assert self.ring is not None
                    self.ring.give_back(held[0])
                    self._cond.notify_all()
            if held is None:
                logger.error("aerie capture: the writer process replied for group %d, which it does not hold", seq)
                continue
            try:
                self._on_done(held[1], set(reply.get("written", ())), reply)
            except Exception:  # the reader must go on: the ring space is back already
                logger.exception("aerie capture: settling a group of the writer process failed")
        code = channel.proc.wait()
        with self._cond:
            channel.dead = True
            left = list(channel.inflight.values())
            channel.inflight.clear()
            for region, _ in left:
                assert self.ring is not None
                self.ring.give_back(region)
            self._cond.notify_all()
        if left:
            logger.error(
                "aerie capture: the writer process ended (exit code %s) holding %d captures: they get "
                "error notes; the next batch starts a new one",
                code,
                sum(len(g) for _, g in left),
            )
        for _, group in left:
            self._fail(group, f"the SGLang server's capture writer process ended (exit code {code}) before writing it")

    def _fail(self, group: list, reason: str) -> None:
        for capture in group:
            if capture.sink == "shm":
                write_error_note(self.directory, capture.capture_id, reason)
        self._on_done(group, set(), {})


def _layout(group: list) -> tuple[dict, dict, list]:
    """Where each capture's tensors lie: the spans of host memory to copy (one per buffer the
    tensors are views of: key -> (address, bytes)), and per capture its tensors as
    (name, safetensors dtype, shape, span key, offset within the span, bytes). A capture with a
    tensor that is not contiguous host memory of a capture dtype is listed apart (for the
    in-process writers)."""
    extents: dict[int, list[int]] = {}  # storage address -> [lowest address, highest end]
    layout: dict[int, list] = {}
    odd = []
    for capture in group:
        tensors = capture.tensors.values()
        if not all(t.is_contiguous() and not t.is_cuda and str(t.dtype) in DTYPE_NAMES for t in tensors):
            odd.append(capture)
            continue
        rows = []
        for name, t in capture.tensors.items():
            key = t.untyped_storage().data_ptr()  # the buffer (a batch's rows) the tensor is a view of
            pointer, n = t.data_ptr(), t.numel() * t.element_size()
            extent = extents.setdefault(key, [pointer, pointer + n])
            extent[0], extent[1] = min(extent[0], pointer), max(extent[1], pointer + n)
            rows.append((name, DTYPE_NAMES[str(t.dtype)], list(t.shape), key, pointer, n))
        layout[id(capture)] = rows
    spans = {key: (lo, hi - lo) for key, (lo, hi) in extents.items()}
    for rows in layout.values():
        for i, (name, dtype, shape, key, pointer, n) in enumerate(rows):
            rows[i] = (name, dtype, shape, key, pointer - spans[key][0], n)
    return spans, layout, odd


# --- the writer process -----------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="aerie capture writer process (started by the SGLang plugin)")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--dir", type=Path, required=True)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--list-s", type=float, default=1.0, help="how often the directory is listed (and its total sent)")
    p.add_argument("--ttl-s", type=float, default=900.0, help="captures older than this are deleted")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s aerie capture writer process: %(message)s")
    ring = memoryview(mmap.mmap(args.fd, args.size, prot=mmap.PROT_READ))
    out = sys.stdout.buffer
    out_lock = threading.Lock()
    wrote = [0]  # bytes of the files written, all told (under out_lock)

    def say(message: dict) -> None:
        with out_lock:
            out.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")
            out.flush()

    pool = ThreadPoolExecutor(max(1, args.threads), thread_name_prefix="aerie-capture-writer")

    def write_one(capture: dict) -> tuple[bool, float, float, float, int]:
        started, cpu = time.perf_counter(), time.thread_time()
        capture_id = str(capture.get("id"))
        try:
            entries, parts = [], []
            for name, dtype, shape, offset, n in capture["tensors"]:
                count = ITEMSIZE[dtype]
                for d in shape:
                    count *= int(d)
                if count != n or offset < 0 or offset + n > args.size:
                    raise ValueError(
                        f"tensor {name} at {offset}+{n} of a {args.size}-byte ring, {count} bytes by its shape"
                    )
                entries.append((str(name), dtype, [int(d) for d in shape]))
                parts.append(ring[offset : offset + n])
            sha = hashlib.sha256()
            for part in parts:
                sha.update(part)
            hashed = time.perf_counter()
            head = header(entries, dict(capture["metadata"], sha256=sha.hexdigest()))
            write_capture(args.dir, capture_id, [head, *parts])
            nbytes = len(head) + sum(map(len, parts))
            with out_lock:
                wrote[0] += nbytes
            return True, hashed - started, time.perf_counter() - hashed, time.thread_time() - cpu, nbytes
        except OSError as e:  # write_capture left an error note
            logging.error("capture %s: %s", capture_id, e)
        except Exception as e:  # a malformed request: the server's bug, but its client must not wait forever
            logging.exception("capture %s: refused", capture_id)
            try:
                write_error_note(args.dir, capture_id, f"the SGLang server's capture writer process refused it: {e}")
            except ValueError:  # not even a capture id
                pass
        return False, time.perf_counter() - started, 0.0, time.thread_time() - cpu, 0

    def write_group(request: dict) -> None:
        futures = [(c.get("id"), pool.submit(write_one, c)) for c in request.get("captures", ())]
        written, hash_s, write_s, cpu_s, nbytes = [], 0.0, 0.0, 0.0, 0
        for capture_id, future in futures:
            ok, h, w, c, n = future.result()
            hash_s, write_s, cpu_s, nbytes = hash_s + h, write_s + w, cpu_s + c, nbytes + n
            if ok:
                written.append(capture_id)
        say(
            {
                "seq": request["seq"],
                "written": written,
                "bytes": nbytes,
                "hash_s": hash_s,
                "write_s": write_s,
                "cpu_s": cpu_s,
            }
        )

    def housekeeping() -> None:
        """The directory listed every --list-s (a listing stats every file: here, not in the
        server, where each stat would let the scheduler thread's GIL go) and swept of captures
        older than --ttl-s."""
        last_sweep = time.monotonic()
        while True:
            time.sleep(args.list_s)
            started = time.perf_counter()
            with out_lock:
                before = wrote[0]
            listed = own_bytes(args.dir)
            say({"listed": listed, "wrote_before": before, "seconds": time.perf_counter() - started})
            if time.monotonic() - last_sweep > min(5.0, args.ttl_s / 4):
                last_sweep = time.monotonic()
                sweep(args.dir, args.ttl_s, logging.getLogger("aerie_sglang.capture"))

    threading.Thread(target=housekeeping, name="aerie-capture-housekeeping", daemon=True).start()

    # A group's captures run on the pool; a thread per group waits for them and replies, so groups
    # overlap (the server frees ring regions in any order).
    groups = ThreadPoolExecutor(4, thread_name_prefix="aerie-capture-group")
    for raw in sys.stdin.buffer:
        try:
            request = json.loads(raw)
            int(request["seq"])
        except (ValueError, KeyError, TypeError):
            logging.error("not a request: %r", raw[:200])
            continue
        groups.submit(write_group, request)
    groups.shutdown(wait=True)
    pool.shutdown(wait=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
