"""Client side of aerie's SGLang binary-capture plugin (`aerie_sglang.plugin`, inference image).

The plugin replaces SGLang's JSON float lists by one safetensors object per request, written by
the server to a sink, and answers with a small descriptor in `meta_info.aerie_capture`. This
module is everything the extractor needs to use it, without torch:

- `advertised(server_info)`: the plugin's entry in `/server_info` (None: stock SGLang, use JSON).
- `request_fields(sink)`: what to merge into a `/generate` body to ask for a binary capture.
- `descriptor_of(response)`: the descriptor in a `/generate` response, checked.
- `fetch_binary(descriptor, sink_config)`: wait for the object, read it, check it (capture id,
  sha256 of the tensor bytes, shapes, dtypes), delete it ("claim" it), return
  `{"aux": [T, K, H], "final": [T, H]}` numpy arrays (bf16 as `ml_dtypes.bfloat16`).

Sinks: `shm` (a tmpfs directory shared with the server; the extractor must run on the same
host, or mount the same directory, `CaptureReader.shm_dir` mapping it) and `s3` (the server uploads
to the store; `CaptureReader.store` reads and deletes). The server refuses new captures while
`max_unclaimed_bytes` wait unclaimed (HTTP 503), so a client must claim what it asked for.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aerie.contracts import CaptureDescriptor
from aerie.shard import ShardError, read_safetensors
from aerie.store import NotFound, ObjectStore
from aerie_extractor.engines.base import EngineError, EngineMismatch

FIELD = "aerie_capture"  # custom_params key, meta_info key, /server_info key
FORMAT = "safetensors/aerie-capture-v1"
SINKS = ("shm", "s3")


class BinaryCaptureError(EngineError):
    """A binary capture that did not arrive or does not hold what its descriptor says."""


@dataclass
class CaptureReader:
    """Where this client finds what the server wrote."""

    sink: str = "shm"  # "shm" | "s3"
    store: ObjectStore | None = None  # s3: a store on the plugin's bucket
    shm_dir: Path | None = None  # shm: the server's directory as mounted here (default: same path)
    timeout_s: float = 60.0  # how long an object may take to appear after the response

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
    """Check that the server offers `config.sink` (and, for s3, writes where `config.store` reads)."""
    sinks = advertisement.get("sinks") or {}
    if config.sink not in sinks:
        raise EngineMismatch(
            f"the SGLang server's aerie_capture plugin offers sinks {sorted(sinks)}, not {config.sink!r}: "
            "configure the server (AERIE_CAPTURE_DIR / AERIE_STORE on the inference container) or pick another sink"
        )
    if config.sink == "s3":
        bucket = getattr(config.store, "bucket", None)
        if bucket != sinks["s3"].get("bucket"):
            raise EngineMismatch(
                f"the SGLang server uploads captures to bucket {sinks['s3'].get('bucket')!r}, this extractor's "
                f"store reads bucket {bucket!r}: use the same AERIE_BUCKET on both"
            )
    return config.sink


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
        raise EngineMismatch(f"the SGLang server's capture descriptor is malformed: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}") from None


def _wait_shm(path: Path, timeout_s: float) -> bytes:
    deadline, delay = time.monotonic() + timeout_s, 0.0005
    while True:
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            error = path.with_suffix(".error")
            if error.exists():
                reason = error.read_text(errors="replace")
                error.unlink(missing_ok=True)
                raise BinaryCaptureError(f"capture {path.name}: {reason}") from None
            if time.monotonic() > deadline:
                raise BinaryCaptureError(
                    f"capture {path.name} did not appear in {path.parent} within {timeout_s:.0f} s: the shm sink "
                    "needs this extractor on the SGLang server's host with the same directory mounted "
                    "(CaptureReader.shm_dir), or the server's writer failed (see its log)"
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


def _check(descriptor: CaptureDescriptor, buf: bytes) -> dict[str, np.ndarray]:
    where = descriptor.path or descriptor.key
    try:
        tensors, metadata = read_safetensors(buf)
    except ShardError as e:
        raise BinaryCaptureError(f"capture {where}: {e}") from None
    if metadata.get("aerie_capture_id") != descriptor.id:
        raise BinaryCaptureError(
            f"capture {where} holds capture id {metadata.get('aerie_capture_id')!r}, the response names {descriptor.id!r}"
        )
    (n,) = np.frombuffer(buf[:8], dtype="<u8")
    digest = hashlib.sha256(memoryview(buf)[8 + int(n):]).hexdigest()
    if digest != metadata.get("sha256"):
        raise BinaryCaptureError(f"capture {where}: sha256 {digest[:12]} of its tensors != {str(metadata.get('sha256'))[:12]} in its header: corrupted")
    for name, spec in descriptor.tensors.items():
        arr = tensors.get(name)
        if arr is None or list(arr.shape) != spec.shape or str(arr.dtype) != spec.dtype:
            got = None if arr is None else (list(arr.shape), str(arr.dtype))
            raise BinaryCaptureError(f"capture {where}: tensor {name!r} is {got}, the response promised {spec.model_dump()}")
    return {name: tensors[name] for name in descriptor.tensors}


def fetch_binary(descriptor: CaptureDescriptor, sink_config: CaptureReader) -> dict[str, np.ndarray]:
    """Wait for, read, check and delete one capture; return its tensors (`aux` [T, K, H] in SGLang
    layer-id order, `final` [T, H]). The object is deleted even when it fails the checks."""
    sink = descriptor.sink
    if sink == "shm":
        path = Path(descriptor.path or "")
        if sink_config.shm_dir is not None:
            path = Path(sink_config.shm_dir) / path.name
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
        if getattr(store, "bucket", descriptor.bucket) != descriptor.bucket:
            raise BinaryCaptureError(
                f"capture {descriptor.key} is in bucket {descriptor.bucket!r}, CaptureReader.store reads "
                f"{store.bucket!r}: use the plugin's bucket"
            )
        buf = _wait_s3(store, descriptor.key, sink_config.timeout_s)
        try:
            return _check(descriptor, buf)
        finally:
            store.delete(descriptor.key)
    raise BinaryCaptureError(f"unknown capture sink {sink!r} in descriptor {descriptor.id}")
