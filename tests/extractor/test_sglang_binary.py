"""Reading a binary capture straight into a shard's rows (`fetch_binary_into`): the same tensors
as `fetch_binary`, and every refusal of a capture that is not what its descriptor promises,
the file claimed either way. Capture files are written here as aerie's plugin writes them
(safetensors, capture id and sha256 of the tensor bytes in the header); the plugin itself, on a
real SGLang server, is tests/inference/test_plugin_capture.py."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from aerie.contracts import CaptureDescriptor
from aerie.shard import safetensors_parts
from aerie_extractor.engines.sglang_binary import (
    BinaryCaptureError,
    CaptureReader,
    CaptureRefused,
    check_capture_dir,
    fetch_binary,
    fetch_binary_into,
)

T, K, H = 7, 3, 16
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture
def sink(tmp_path) -> CaptureReader:
    tmp_path.chmod(0o700)
    return CaptureReader(sink="shm", shm_dir=check_capture_dir(tmp_path), server_dir=str(tmp_path), timeout_s=0.2)


def tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"aux": rng.standard_normal((T, K, H)).astype(BF16), "final": rng.standard_normal((T, H)).astype(BF16)}


def write_capture(
    sink: CaptureReader, arrays: dict[str, np.ndarray], *, sha: str | None = None, cid: str | None = None, edit=None
) -> CaptureDescriptor:
    """A capture file as the plugin writes it, and the descriptor its response would carry;
    `edit(bytes) -> bytes` changes the file after the fact."""
    cid = cid or uuid.uuid4().hex
    data = b"".join(bytes(p) for p in safetensors_parts(arrays, {"aerie_capture_id": cid, "sha256": "0" * 64})[1:])
    meta = {
        "aerie_capture_id": cid,
        "format": "aerie-capture-v1",
        "layer_ids": "1,5,9",
        "sglang": "test",
        "rid": cid,
        "sha256": sha or hashlib.sha256(data).hexdigest(),
    }
    raw = b"".join(bytes(p) for p in safetensors_parts(arrays, meta))
    path = Path(sink.shm_dir) / f"{cid}.safetensors"
    path.write_bytes(edit(raw) if edit else raw)
    return CaptureDescriptor(v=1, id=cid, sink="shm", format="safetensors", nbytes=len(raw), rows=T, layer_ids=[1, 5, 9],
                             tensors={n: {"shape": list(a.shape), "dtype": str(a.dtype)} for n, a in arrays.items()},
                             path=str(path))  # fmt: skip


def rows(n: int = 3) -> tuple[np.ndarray, np.ndarray, list[dict[str, np.ndarray]]]:
    """A shard's arrays of n sequences of T tokens, and each sequence's rows (views)."""
    aux, final = np.zeros((n * T, K, H), BF16), np.zeros((n * T, H), BF16)
    return aux, final, [{"aux": aux[i * T : (i + 1) * T], "final": final[i * T : (i + 1) * T]} for i in range(n)]


def test_captures_land_in_their_rows_equal_to_fetch_binary_and_are_claimed(sink):
    aux, final, places = rows(3)
    wanted = [tensors(i) for i in range(3)]
    for i in (2, 0, 1):  # any order: each into its own rows
        fetch_binary_into(write_capture(sink, wanted[i]), sink, places[i])
    assert not any(Path(sink.shm_dir).iterdir()), "every capture claimed"
    for i, want in enumerate(wanted):
        got = fetch_binary(write_capture(sink, want), sink)
        for name in ("aux", "final"):
            np.testing.assert_array_equal(places[i][name].view(np.uint16), want[name].view(np.uint16))
            np.testing.assert_array_equal(got[name].view(np.uint16), want[name].view(np.uint16))


def changed(descriptor: CaptureDescriptor, **update) -> CaptureDescriptor:
    return CaptureDescriptor.model_validate({**descriptor.model_dump(), **update})


def renamed(descriptor: CaptureDescriptor, cid: str) -> CaptureDescriptor:
    """Another capture's file under `cid`'s name, and a descriptor naming it."""
    path = Path(descriptor.path).with_name(f"{cid}.safetensors")
    os.rename(descriptor.path, path)
    return changed(descriptor, id=cid, path=str(path))


def _flip_last_byte(raw: bytes) -> bytes:
    return raw[:-1] + bytes([raw[-1] ^ 1])


@pytest.mark.parametrize("case, says", [
    ("corrupted", "sha256 .* corrupted"),
    ("another id", "holds capture id"),
    ("truncated", "past the file end|truncated"),
    ("longer", "do not fill"),
    ("other shape", "the response promised"),
    ("float32 rows", "cannot be read into a float32 array"),
])  # fmt: skip
def test_a_capture_that_is_not_what_was_promised_is_refused_and_still_claimed(sink, case, says):
    want = tensors()
    descriptor = {
        "corrupted": lambda: write_capture(sink, want, edit=_flip_last_byte),
        "another id": lambda: renamed(write_capture(sink, want), uuid.uuid4().hex),  # a server mixing captures up
        "truncated": lambda: write_capture(sink, want, edit=lambda raw: raw[:-10]),
        "longer": lambda: write_capture(sink, want, edit=lambda raw: raw + b"\0" * 8),
        "other shape": lambda: write_capture(sink, {"aux": want["aux"][:, :2], "final": want["final"]}),
        "float32 rows": lambda: write_capture(sink, want),
    }[case]()
    if case == "other shape":  # the descriptor promises the rows' shape, the file holds another
        descriptor = changed(
            descriptor,
            tensors={"aux": {"shape": [T, K, H], "dtype": "bfloat16"}, "final": {"shape": [T, H], "dtype": "bfloat16"}},
        )
    _, _, places = rows(1)
    if case == "float32 rows":
        places = [{"aux": np.zeros((T, K, H), np.float32), "final": np.zeros((T, H), np.float32)}]
    with pytest.raises(BinaryCaptureError, match=says):
        fetch_binary_into(descriptor, sink, places[0])
    assert not Path(sink.shm_dir, f"{descriptor.id}.safetensors").exists(), "claimed though refused"


def test_a_symlink_or_a_path_outside_the_sink_is_refused_untouched(sink, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside") / "secret"
    outside.write_bytes(b"x" * 64)
    descriptor = write_capture(sink, tensors())
    Path(descriptor.path).unlink()
    Path(descriptor.path).symlink_to(outside)
    _, _, places = rows(1)
    with pytest.raises(CaptureRefused, match="symlink"):
        fetch_binary_into(descriptor, sink, places[0])
    elsewhere = changed(descriptor, path=str(outside))
    with pytest.raises(CaptureRefused, match="refused, nothing read or deleted"):
        fetch_binary_into(elsewhere, sink, places[0])
    assert outside.read_bytes() == b"x" * 64


def test_a_capture_that_never_comes_names_where_it_was_expected(sink):
    descriptor = write_capture(sink, tensors())
    os.unlink(descriptor.path)
    _, _, places = rows(1)
    with pytest.raises(BinaryCaptureError, match="did not appear"):
        fetch_binary_into(descriptor, sink, places[0])
