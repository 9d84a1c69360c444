"""Client side of aerie's SGLang binary-capture plugin (`aerie_sglang.plugin`, inference image).

The plugin replaces SGLang's JSON float lists by one safetensors object per request, written by
the server to a sink, and answers with a small descriptor in `meta_info.aerie_capture`. This
module is everything the extractor needs to use it, without torch:

- `advertised(server_info)`: the plugin's entry in `/server_info` (None: stock SGLang, use JSON).
- `request_fields(sink)`: what to merge into a `/generate` body to ask for a binary capture.
- `descriptor_of(response)`: the descriptor in a `/generate` response, checked.
- `choose_sink(advertisement, reader)`: check the server offers the reader's sink and bind the
  reader to where that sink writes (directory, bucket, prefix), each checked.
- `fetch_binary(descriptor, reader)`: wait for the object, read it, check it (capture id,
  sha256 of the tensor bytes, shapes, dtypes), delete it ("claim" it), return
  `{"aux": [T, K, H], "final": [T, H]}` numpy arrays (bf16 as `ml_dtypes.bfloat16`).
- `fetch_binary_into(descriptor, reader, out)`: the same, read straight into the caller's arrays
  (a sequence's rows of a shard): one copy from the server's file to its place.

Sinks: `shm` (a tmpfs directory shared with the server; the extractor must run on the same
host, or mount the same directory, `AERIE_ENGINE_SHM_DIR` / `CaptureReader.shm_dir` naming where)
and `s3` (the server uploads to the store; `CaptureReader.store` reads and deletes). The server
refuses new captures while `max_unclaimed_bytes` wait unclaimed (HTTP 503), so a client must
claim what it asked for.

Nothing a server says becomes a path or key by itself. The reader only ever reads and deletes
`<its directory>/<32 hex>.safetensors` (and that id's `.error` note), or `<prefix><32 hex>.safetensors`
in its own bucket: the id is the descriptor's (checked), the directory is the advertised one (or
AERIE_ENGINE_SHM_DIR), which must be a real directory private to its owner, and the prefix must lie
outside aerie's folders. A descriptor naming anything else is refused (CaptureRefused) untouched.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np

from aerie import layout
from aerie.contracts import CaptureDescriptor
from aerie.shard import ShardError, read_safetensors, safetensors_layout
from aerie.store import NotFound, ObjectStore
from aerie_extractor.engines.base import EngineError, EngineMismatch

FIELD = "aerie_capture"  # custom_params key, meta_info key, /server_info key
FORMAT = "safetensors/aerie-capture-v1"
SINKS = ("shm", "s3")


ERROR_NOTE_BYTES = 4096  # what is read of a capture's .error note


class BinaryCaptureError(EngineError):
    """A binary capture that did not arrive or does not hold what its descriptor says."""


class CaptureRefused(EngineMismatch):
    """A capture sink or descriptor naming a place outside what this extractor reads: refused
    before anything is read or deleted (configuration or a hostile server: no retry helps)."""


@dataclass
class CaptureReader:
    """Where this client finds what the server wrote; `choose_sink` binds it to a server."""

    sink: str = "shm"  # "shm" | "s3"
    store: ObjectStore | None = None  # s3: a store on the plugin's bucket
    shm_dir: Path | None = None  # shm: the directory read here (AERIE_ENGINE_SHM_DIR, else the advertised one)
    timeout_s: float = 60.0  # how long an object may take to appear after the response
    server_dir: str | None = None  # shm: the directory as the server names it (advertised)
    prefix: str | None = None  # s3: the key prefix of captures (advertised, checked)

    def __post_init__(self) -> None:
        if self.sink not in SINKS:
            raise ValueError(f"binary-capture sink {self.sink!r} is not one of {SINKS}")
        if self.sink == "s3" and self.store is None:
            raise ValueError("binary-capture sink 's3' needs CaptureReader.store (the plugin's bucket)")


def advertised(server_info: dict) -> dict | None:
    """The plugin's advertisement in `/server_info` (or `/get_server_info`), or None when the
    server runs without it (stock SGLang, or a plugin that refused another SGLang version)."""
    info = server_info.get(FIELD)
    if not isinstance(info, dict):
        return None
    if info.get("format") != FORMAT:
        raise EngineMismatch(
            f"the SGLang server's aerie_capture plugin speaks {info.get('format')!r}, this extractor {FORMAT!r}: "
            "deploy matching inference and extractor images"
        )
    return info


def choose_sink(advertisement: dict, config: CaptureReader) -> str:
    """Check that the server offers `config.sink` and bind `config` to where it writes: for shm
    the directory (the advertised one, or AERIE_ENGINE_SHM_DIR where it is mounted here), checked
    by `check_capture_dir`; for s3 the bucket (`config.store`'s) and the capture prefix."""
    sinks = advertisement.get("sinks") or {}
    if config.sink not in sinks:
        raise EngineMismatch(
            f"the SGLang server's aerie_capture plugin offers sinks {sorted(sinks)}, not {config.sink!r}: "
            "configure the server (AERIE_CAPTURE_DIR / AERIE_STORE on the inference container) or pick another sink"
        )
    if config.sink == "shm":
        server_dir = (sinks["shm"] or {}).get("dir")
        if (
            not isinstance(server_dir, str)
            or not server_dir.startswith("/")
            or os.path.normpath(server_dir) != server_dir
        ):
            raise CaptureRefused(
                f"the SGLang server advertises capture directory {server_dir!r}, not an absolute normalized "
                "path: refused (the server's AERIE_CAPTURE_DIR; AERIE_ENGINE_SHM_DIR here)"
            )
        config.server_dir = server_dir
        config.shm_dir = check_capture_dir(Path(config.shm_dir or server_dir))
    if config.sink == "s3":
        bucket = getattr(config.store, "bucket", None)
        if bucket != sinks["s3"].get("bucket"):
            raise EngineMismatch(
                f"the SGLang server uploads captures to bucket {sinks['s3'].get('bucket')!r}, this extractor's "
                f"store reads bucket {bucket!r}: use the same AERIE_BUCKET on both"
            )
        try:
            config.prefix = layout.check_capture_prefix(sinks["s3"].get("prefix"))
        except ValueError as e:
            raise CaptureRefused(
                f"the SGLang server's s3 capture sink: {e}: refused (its AERIE_CAPTURE_S3_PREFIX)"
            ) from None
    return config.sink


def reader_for(server_info: dict, sink: str = "shm", **fields) -> CaptureReader:
    """A reader bound to what a server's `/server_info` advertises (checked as `choose_sink` does)."""
    advertisement = advertised(server_info)
    if advertisement is None:
        raise EngineMismatch(
            "the SGLang server does not advertise aerie's aerie_capture plugin: no binary captures to read"
        )
    reader = CaptureReader(sink, **fields)
    choose_sink(advertisement, reader)
    return reader


def check_capture_dir(path: Path) -> Path:
    """The shm directory this extractor reads and deletes in: absolute, a real directory (not a
    symlink), private to its owner (the plugin creates it 0700) and owned by this user (or read
    by root). Anything else could hold files others planted, or be a folder the server picked."""
    where = f"capture directory {path} (AERIE_ENGINE_SHM_DIR here, or the server's AERIE_CAPTURE_DIR)"
    if not path.is_absolute() or os.path.normpath(path) != str(path):
        raise CaptureRefused(f"{where} is not an absolute normalized path: refused")
    try:
        st = os.lstat(path)
    except OSError as e:
        raise CaptureRefused(
            f"{where} cannot be read here ({e.strerror}): mount the server's directory, or use the s3 sink"
        ) from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise CaptureRefused(f"{where} is {'a symlink' if stat.S_ISLNK(st.st_mode) else 'not a directory'}: refused")
    if st.st_mode & 0o077:
        raise CaptureRefused(
            f"{where} is open to other users (mode {stat.S_IMODE(st.st_mode):o}, the plugin makes 700): refused"
        )
    if st.st_uid != os.geteuid() and os.geteuid() != 0:
        raise CaptureRefused(
            f"{where} belongs to uid {st.st_uid}, not this user ({os.geteuid()}): refused "
            "(run the extractor as the server's user, as the images do)"
        )
    return path


def request_fields(sink: str) -> dict:
    """Merge into a `/generate` body (its sampling_params are merged key by key)."""
    return {
        "return_hidden_states": True,
        "sampling_params": {"max_new_tokens": 1, "custom_params": {FIELD: sink}},
    }


def capture_body(input_ids: list[int], sink: str) -> dict:
    """A complete `/generate` body for one binary capture of `input_ids`."""
    body = request_fields(sink)
    body["input_ids"] = list(input_ids)
    body["sampling_params"]["temperature"] = 0.0
    return body


def descriptor_of(response: dict) -> CaptureDescriptor:
    """The capture descriptor of a `/generate` response, validated (a malformed one is refused)."""
    from pydantic import ValidationError

    meta = response.get("meta_info") or {}
    descriptor = meta.get(FIELD)
    if not isinstance(descriptor, dict):
        raise BinaryCaptureError(
            "the SGLang response has no meta_info.aerie_capture: the server did not load the aerie_capture "
            "plugin (check /server_info and the server log for 'aerie_capture plugin refused')"
        )
    if "error" in descriptor:
        raise BinaryCaptureError(f"the SGLang server could not capture: {descriptor['error']}")
    try:
        return CaptureDescriptor.model_validate(descriptor)
    except ValidationError as e:
        raise EngineMismatch(
            f"the SGLang server's capture descriptor is malformed: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}"
        ) from None


def _open_regular(path: Path) -> int:
    """A descriptor of a regular file, never through a symlink (O_NOFOLLOW): FileNotFoundError if absent."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CaptureRefused(f"capture {path} is a symlink: refused, not followed (AERIE_ENGINE_SHM_DIR)") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CaptureRefused(f"capture {path} is not a regular file: refused (AERIE_ENGINE_SHM_DIR)")
    return fd


def _read_regular(path: Path, limit: int = -1) -> bytes:
    """A regular file's bytes (the first `limit`), never through a symlink: FileNotFoundError if absent."""
    with os.fdopen(_open_regular(path), "rb") as f:
        return f.read(limit)


def _pread_into(fd: int, out: memoryview, offset: int) -> None:
    """Fill `out` with the file's bytes from `offset` (short reads continued; the end of the file is an error)."""
    done = 0
    while done < len(out):
        got = os.preadv(fd, [out[done:]], offset + done)
        if got == 0:
            raise ShardError(f"the file ends {len(out) - done} bytes early")
        done += got


def _wait_shm(path: Path, timeout_s: float) -> bytes:
    """The capture file's bytes, once it appears."""
    with os.fdopen(_wait_open(path, timeout_s), "rb") as f:
        return f.read()


def _wait_open(path: Path, timeout_s: float) -> int:
    """A descriptor of the capture file once the server has written it (or its `.error` note, raised)."""
    deadline, delay = time.monotonic() + timeout_s, 0.0005
    while True:
        try:
            return _open_regular(path)
        except FileNotFoundError:
            error = path.with_suffix(".error")  # the same id's note: <id>.error
            try:
                reason = _read_regular(error, ERROR_NOTE_BYTES).decode(errors="replace")
            except FileNotFoundError:
                reason = None
            if reason is not None:
                error.unlink(missing_ok=True)
                raise BinaryCaptureError(f"capture {path.name}: {reason}") from None
            if time.monotonic() > deadline:
                raise BinaryCaptureError(
                    f"capture {path.name} did not appear in {path.parent} within {timeout_s:.0f} s: the shm sink "
                    "needs this extractor on the SGLang server's host with the same directory mounted "
                    "(AERIE_ENGINE_SHM_DIR), or the server's writer failed (see its log)"
                ) from None
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


def _wait_s3(store: ObjectStore, key: str, timeout_s: float) -> bytes:
    deadline, delay = time.monotonic() + timeout_s, 0.002
    while True:
        try:
            return store.get_bytes(key)
        except NotFound:
            if time.monotonic() > deadline:
                raise BinaryCaptureError(
                    f"capture {key} did not appear in bucket {getattr(store, 'bucket', '?')} within {timeout_s:.0f} s: "
                    "the server's upload failed or is backed up (see its log)"
                ) from None
            time.sleep(delay)
            delay = min(delay * 2, 0.1)


HEAD_BYTES = 64 * 1024  # what is read first of a capture file: its length and header (aerie's are < 1 KB)


def _read_into(descriptor: CaptureDescriptor, fd: int, out: dict[str, np.ndarray]) -> None:
    """The capture in `fd` read straight into `out` (name -> a C-contiguous array of the tensor's
    shape and dtype): the header checked as `_check` does, each tensor's bytes read into its array,
    the sha256 taken over what was read. The tensors must fill the data region back to back (the
    plugin writes them so), so that the digest covers exactly what the header's covers."""
    where = descriptor.path or descriptor.key
    size = os.fstat(fd).st_size
    head = os.pread(fd, HEAD_BYTES, 0)
    try:
        spans, metadata, base = safetensors_layout(head, size)
    except ShardError as e:
        raise BinaryCaptureError(f"capture {where}: {e}") from None
    _check_header(descriptor, where, metadata, {name: (shape, str(dt)) for name, (dt, shape, _, _) in spans.items()})
    if set(spans) != set(out):
        raise BinaryCaptureError(f"capture {where} holds tensors {sorted(spans)}, the reader wants {sorted(out)}")
    order = sorted(spans, key=lambda name: spans[name][2])
    ends = [0] + [spans[name][3] for name in order]
    if [spans[name][2] for name in order] != ends[:-1] or base + ends[-1] != size:
        raise BinaryCaptureError(f"capture {where}: its tensors do not fill its {size - base} data bytes back to back")
    digest = hashlib.sha256()
    for name in order:
        dt, shape, start, end = spans[name]
        arr = out[name]
        if list(arr.shape) != shape or arr.dtype != dt or not arr.flags.c_contiguous:
            raise BinaryCaptureError(
                f"capture {where}: tensor {name!r} ({dt} {shape}) cannot be read into a "
                f"{'' if arr.flags.c_contiguous else 'non-contiguous '}{arr.dtype} array of shape {list(arr.shape)}"
            )
        view = arr.reshape(-1).view(np.uint8).data
        try:
            _pread_into(fd, view, base + start)
        except ShardError as e:
            raise BinaryCaptureError(f"capture {where}: tensor {name!r}: {e}: truncated") from None
        digest.update(view)
    _check_digest(where, digest.hexdigest(), metadata)


def _check_header(
    descriptor: CaptureDescriptor, where: str | None, metadata: dict, found: dict[str, tuple[list[int], str]]
) -> None:
    """The capture id in the header, and each promised tensor's (shape, dtype) in `found`, are the descriptor's."""
    if metadata.get("aerie_capture_id") != descriptor.id:
        raise BinaryCaptureError(
            f"capture {where} holds capture id {metadata.get('aerie_capture_id')!r}, the response names {descriptor.id!r}"
        )
    for name, spec in descriptor.tensors.items():
        got = found.get(name)
        if got is None or list(got[0]) != spec.shape or got[1] != spec.dtype:
            raise BinaryCaptureError(
                f"capture {where}: tensor {name!r} is {got}, the response promised {spec.model_dump()}"
            )


def _check_digest(where: str | None, digest: str, metadata: dict) -> None:
    if digest != metadata.get("sha256"):
        raise BinaryCaptureError(
            f"capture {where}: sha256 {digest[:12]} of its tensors != {str(metadata.get('sha256'))[:12]} in its header: corrupted"
        )


def _check(descriptor: CaptureDescriptor, buf: bytes) -> dict[str, np.ndarray]:
    where = descriptor.path or descriptor.key
    try:
        tensors, metadata = read_safetensors(buf)
    except ShardError as e:
        raise BinaryCaptureError(f"capture {where}: {e}") from None
    _check_header(
        descriptor, where, metadata, {name: (list(arr.shape), str(arr.dtype)) for name, arr in tensors.items()}
    )
    (n,) = np.frombuffer(buf[:8], dtype="<u8")
    _check_digest(where, hashlib.sha256(memoryview(buf)[8 + int(n) :]).hexdigest(), metadata)
    return {name: tensors[name] for name in descriptor.tensors}


def capture_path(descriptor: CaptureDescriptor, reader: CaptureReader) -> Path:
    """The one file a shm descriptor may name: `<reader's directory>/<id>.safetensors`, and only
    when the descriptor's path is exactly that file in the server's advertised directory."""
    name = layout.capture_key("x/", descriptor.id).removeprefix("x/")  # <32 hex>.safetensors, the id checked
    if reader.shm_dir is None:
        raise CaptureRefused(
            f"capture {descriptor.path!r}: this reader knows no capture directory (bind it to the server's "
            "advertisement with choose_sink, or set AERIE_ENGINE_SHM_DIR): refused, nothing read or deleted"
        )
    named = PurePosixPath(descriptor.path or "")
    if named.name != name or (reader.server_dir is not None and str(named.parent) != reader.server_dir):
        raise CaptureRefused(
            f"capture {descriptor.path!r} is not {reader.server_dir or '<capture dir>'}/{name}: refused, nothing read or deleted "
            "(the server's AERIE_CAPTURE_DIR; AERIE_ENGINE_SHM_DIR here)"
        )
    return Path(reader.shm_dir) / name


def capture_object(descriptor: CaptureDescriptor, reader: CaptureReader) -> str:
    """The one key an s3 descriptor may name: `<advertised prefix><id>.safetensors` in our bucket."""
    if reader.prefix is None:
        raise CaptureRefused(
            f"capture {descriptor.key!r}: this reader knows no capture prefix (bind it to the server's "
            "advertisement with choose_sink): refused, nothing read or deleted"
        )
    key = layout.capture_key(reader.prefix, descriptor.id)
    if descriptor.key != key:
        raise CaptureRefused(
            f"capture key {descriptor.key!r} is not {key!r}: refused, nothing read or deleted "
            "(the server's AERIE_CAPTURE_S3_PREFIX)"
        )
    return key


def fetch_binary_into(descriptor: CaptureDescriptor, sink_config: CaptureReader, out: dict[str, np.ndarray]) -> None:
    """`fetch_binary`, the tensors landing in `out`'s arrays (name -> C-contiguous, the tensor's
    shape and dtype, e.g. a sequence's rows of a shard): from the shm sink they are read straight
    in, so a capture is copied once, from the server's file into its place, and its bytes leave
    the sink as soon as it is claimed; from S3 they are copied in. Checked and claimed as
    `fetch_binary` does (a failed check leaves `out` partly written)."""
    if descriptor.sink != "shm" or sink_config.sink != "shm":
        tensors = fetch_binary(descriptor, sink_config)
        for name, arr in out.items():
            if name not in tensors or arr.shape != tensors[name].shape or arr.dtype != tensors[name].dtype:
                raise BinaryCaptureError(
                    f"capture {descriptor.id}: tensor {name!r} cannot be copied into a {arr.dtype} array of shape {list(arr.shape)}"
                )
            np.copyto(arr, tensors[name])
        return
    path = capture_path(descriptor, sink_config)
    fd = _wait_open(path, sink_config.timeout_s)
    try:
        _read_into(descriptor, fd, out)
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def fetch_binary(descriptor: CaptureDescriptor, sink_config: CaptureReader) -> dict[str, np.ndarray]:
    """Wait for, read, check and delete one capture; return its tensors (`aux` [T, K, H] in SGLang
    layer-id order, `final` [T, H]). A capture the reader may touch (`capture_path`,
    `capture_object`) is deleted even when it fails the checks; any other is refused untouched."""
    sink = descriptor.sink
    if sink != sink_config.sink:
        raise CaptureRefused(
            f"capture {descriptor.id} is in sink {sink!r}, this reader reads {sink_config.sink!r}: refused"
        )
    if sink == "shm":
        path = capture_path(descriptor, sink_config)
        buf = _wait_shm(path, sink_config.timeout_s)
        try:
            return _check(descriptor, buf)
        finally:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    if sink == "s3":
        store = sink_config.store
        if store is None:
            raise BinaryCaptureError(f"capture {descriptor.key} is in S3 but CaptureReader.store is not set")
        bucket = getattr(store, "bucket", descriptor.bucket)
        if bucket != descriptor.bucket:
            raise BinaryCaptureError(
                f"capture {descriptor.key} is in bucket {descriptor.bucket!r}, CaptureReader.store reads "
                f"{bucket!r}: use the plugin's bucket"
            )
        key = capture_object(descriptor, sink_config)
        buf = _wait_s3(store, key, sink_config.timeout_s)
        try:
            return _check(descriptor, buf)
        finally:
            store.delete(key)
    raise BinaryCaptureError(f"unknown capture sink {sink!r} in descriptor {descriptor.id}")
