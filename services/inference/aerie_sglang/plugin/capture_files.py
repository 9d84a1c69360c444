"""A capture's file in the shm sink: its names, its safetensors header, and the private write.

Torch-free (stdlib only): the sink's writer threads in the SGLang server and its writer process
(`writer_process.py`, which must start without importing torch) both write through here, so a
capture is the same bytes whichever wrote it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import time
from pathlib import Path

FORMAT_VERSION = 1
SUFFIX = ".safetensors"
ERROR_SUFFIX = ".error"  # next to a capture that could not be written: the reason, for the client
PARTIAL_PREFIX = "."
CAPTURE_ID = re.compile(r"[0-9a-f]{32}")
# the only names the sink counts, sweeps or writes: a capture, its partial file, its error note
OWN_NAME = re.compile(r"(?:[0-9a-f]{32}(?:\.safetensors|\.error)|\.[0-9a-f]{32}\.partial)")
# safetensors' dtype names of the dtypes a capture holds, by the itemsize of each
ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2}
# ... by torch's name of each (`str(tensor.dtype)`: no torch import here)
DTYPE_NAMES = {"torch.float32": "F32", "torch.bfloat16": "BF16", "torch.float16": "F16"}


def header(entries: list[tuple[str, str, list[int]]], metadata: dict[str, str]) -> bytes:
    """The safetensors header (8-byte length + JSON, space-padded to 8 bytes) of tensors
    `(name, safetensors dtype, shape)` laid out in this order."""
    table: dict = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in entries:
        n = ITEMSIZE[dtype]
        for d in shape:
            n *= d
        table[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def names(directory: Path, capture_id: str) -> tuple[Path, Path, Path]:
    """(final, partial, error note) of a capture id; ValueError unless it is 32 lowercase hex
    digits, so no name reaches outside `directory`."""
    if not CAPTURE_ID.fullmatch(capture_id):
        raise ValueError(f"not a capture id: {capture_id!r}")
    return (
        directory / f"{capture_id}{SUFFIX}",
        directory / f"{PARTIAL_PREFIX}{capture_id}.partial",
        directory / f"{capture_id}{ERROR_SUFFIX}",
    )


def write_capture(directory: Path, capture_id: str, buffers: list) -> None:
    """The capture's file, appearing whole (a private partial file renamed). On OSError (a full
    tmpfs, typically) nothing is left but an error note for the waiting client, and it re-raises."""
    final, partial, error = names(directory, capture_id)
    try:
        write_private(partial, buffers)
        os.replace(partial, final)
    except OSError as e:
        partial.unlink(missing_ok=True)
        write_error_note(directory, capture_id, f"the SGLang server could not write {final}: {e}")
        raise


def write_error_note(directory: Path, capture_id: str, reason: str) -> None:
    """`<id>.error`, which a client waiting for the capture reads instead (best effort)."""
    try:
        write_private(names(directory, capture_id)[2], [reason.encode()])
    except OSError:
        pass


def write_private(path: Path, buffers: list) -> None:
    """A new file of `buffers`, mode 0600, never through a symlink and never over an existing
    file, written by os.writev: one system call (and one GIL release) for a whole capture."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        write_all(fd, buffers)
    finally:
        os.close(fd)


def write_all(fd: int, buffers: list) -> None:
    """Every byte of `buffers`, in order (os.writev may write less than asked)."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]
    while views:
        done = os.writev(fd, views)
        if done <= 0:
            raise OSError(f"writev wrote nothing of {sum(map(len, views))} bytes")
        while views and done >= len(views[0]):
            done -= len(views[0])
            views.pop(0)
        if views and done:
            views[0] = views[0][done:]


def own_bytes(directory: Path) -> int:
    """Bytes of the plugin's captures and partial files in `directory` (error notes do not count)."""
    total = 0
    try:
        with os.scandir(directory) as it:
            for entry in it:
                if OWN_NAME.fullmatch(entry.name) and not entry.name.endswith(ERROR_SUFFIX):
                    try:
                        total += entry.stat(follow_symlinks=False).st_size
                    except FileNotFoundError:  # claimed meanwhile
                        pass
    except FileNotFoundError:
        pass
    return total


def sweep(directory: Path, ttl_s: float, log: logging.Logger) -> None:
    """Delete captures nobody claimed within ttl_s (their client died): the plugin's own names
    only, never through a symlink."""
    cutoff = time.time() - ttl_s
    try:
        with os.scandir(directory) as it:
            for entry in it:
                if not OWN_NAME.fullmatch(entry.name):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff:
                        os.unlink(entry.path)
                        log.warning("aerie capture: deleted unclaimed %s (older than %ss)", entry.path, ttl_s)
                except FileNotFoundError:
                    pass
    except FileNotFoundError:
        pass
