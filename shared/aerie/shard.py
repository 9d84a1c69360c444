"""The shard format: packed sequences in one safetensors file, no padding.

Tensors (T tokens over S sequences, K capture points, H hidden size):

| name            | dtype         | shape      | kind          |
|-----------------|---------------|------------|---------------|
| `input_ids`     | int32         | [T]        | tokens+hidden |
| `loss_mask`     | uint8 (0/1)   | [T]        | tokens+hidden |
| `offsets`       | int64         | [S+1]      | tokens+hidden |
| `aux`           | bf16/f16/f32  | [T, K, H]  | hidden        |
| `final`         | bf16/f16/f32  | [T, H]     | hidden, signal "final" |
| `topk_ids`      | int32         | [T, k]     | hidden, signal "topk"  |
| `topk_logprobs` | float32       | [T, k]     | hidden, signal "topk"  |
| `aux_scale`     | float32       | [T, K, G]  | hidden, fp8 storage    |
| `final_scale`   | float32       | [T, G]     | hidden, fp8 storage, signal "final" |

Sequence `s` is rows `offsets[s]:offsets[s+1]`. Row `t` of `aux`/`final` is the target's state
after reading token `t`; the signal at row `t` is the target's distribution over token `t+1`.
The safetensors header's `__metadata__` names the format, kind, capture points, dims and dtype.

fp8 storage (the run's `storage_dtype: float8_e4m3fn`): `aux` and `final` are stored as e4m3
(F8_E4M3, 1 byte) with a float32 scale per block of `scale_block` values of a row (the header says
`scale_block`; a run that names none gets `default_scale_block(H)`: 128 where 128 divides H,
else the whole row, one scale per token and capture point, G = 1; shards of either layout read alike)
and `states_dtype`, the dtype the engine produced. A state is `q * scale`, `scale = max|row| / 448`
(e4m3's largest value): about half the bytes of bf16, a relative error per value of at most
2^-4. Readers never see the stored bytes unless they ask: `Shard.sequence` dequantizes into
`states_dtype`, as does `dequantize_tensors` for readers that fetch tensors by byte range.

Why our own (tiny) container code: `safetensors.numpy` has no bfloat16, and the extractor's
SGLang path runs without torch. Files are plain safetensors: `safetensors.torch.load_file`
reads them, and tests check both directions.
"""

from __future__ import annotations

import io
import json
import mmap
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO

import ml_dtypes
import numpy as np

from aerie.errors import ExpectedError

if TYPE_CHECKING:
    from numpy.typing import DTypeLike
    from typing_extensions import Buffer

FORMAT = "aerie-shard/1"

_DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
FLOAT_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
STORAGE_DTYPES = {"float8_e4m3fn": "F8_E4M3"}  # quantized storage of the states (scales beside them)
STATE_DTYPES = ("BF16", "F16", "F32", "F8_E4M3")  # what `aux`/`final` may be stored as
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
# byte -> value: a lookup in this table is faster than numpy's cast
_E4M3_VALUES = np.arange(256, dtype=np.uint8).view(_DTYPES["F8_E4M3"]).astype(np.float32)
_QUANT_ROWS = 4096  # rows quantized at a time (bounds the float32 temporaries)


class ShardError(ValueError):
    """A shard that does not hold what its header promises."""


class UnknownDtype(ExpectedError, ShardError):
    """A shard stored in a dtype this aerie does not read (written by a newer one?)."""


def _nonfinite(arr: np.ndarray) -> np.ndarray:
    """NaN/Inf mask, read off the exponent bits for 16-bit floats (no float32 copy); e4m3 has
    no Inf, and its NaN is every exponent and mantissa bit set."""
    if arr.dtype == _DTYPES["BF16"]:
        return (arr.view(np.uint16) & 0x7F80) == 0x7F80
    if arr.dtype == _DTYPES["F16"]:
        return (arr.view(np.uint16) & 0x7C00) == 0x7C00
    if arr.dtype == _DTYPES["F8_E4M3"]:
        return (arr.view(np.uint8) & 0x7F) == 0x7F
    return ~np.isfinite(arr)


def np_dtype(name: str) -> np.dtype:
    """'bfloat16' | 'float16' | 'float32' | 'float8_e4m3fn' (a storage dtype) -> numpy dtype."""
    return _DTYPES[FLOAT_DTYPES.get(name) or STORAGE_DTYPES[name]]


# --------------------------------------------------------------------------------------
# fp8 (e4m3) storage of the states: numpy only (the extractor's SGLang path has no torch)
# --------------------------------------------------------------------------------------
SCALE_BLOCK = 128  # values per fp8 scale by default: DeepSeek-V3's own fp8 block width


def default_scale_block(hidden_size: int) -> int | None:
    """The scale block of an fp8 run that names none: 128 values per scale when 128 divides the
    hidden size, else one scale per row (None). Chosen by `benchmarks/bench_fp8.py --massive`
    (BENCHMARKS.md, "fp8 under massive activations"): with a few channels far above the rest, as
    DeepSeek/Kimi residual streams have, one scale per row lets the large channels set the scale of
    every other value, and far enough above them the ordinary values fall into e4m3's subnormals;
    a scale per 128 values confines them to their block, for 4 bytes per 128 values (+3 % bytes)."""
    return SCALE_BLOCK if hidden_size % SCALE_BLOCK == 0 else None


def quantize_e4m3(x: np.ndarray, block: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """x [..., H] -> (q [..., H] float8_e4m3fn, scale [..., H // block] float32), x ~ q * scale.

    Each block of `block` values of a row (None: the whole row) gets scale = max|x| / 448, so its
    largest value lands on e4m3's largest; a zero block gets scale 0 (and stays exactly zero).
    Values round to nearest (relative error <= 2^-4; below 2^-6 * scale e4m3 is subnormal, an
    absolute error <= 2^-10 * scale). A NaN/Inf raises ShardError naming its row."""
    H = x.shape[-1]
    block = block or H
    if H % block:
        raise ShardError(f"scale block {block} does not divide the hidden size {H}")
    G = H // block
    rows = x.reshape(-1, H)
    q = np.empty(rows.shape, dtype=_DTYPES["F8_E4M3"])
    scale = np.empty((rows.shape[0], G), dtype=np.float32)
    for a in range(0, rows.shape[0], _QUANT_ROWS):
        v = rows[a : a + _QUANT_ROWS].astype(np.float32).reshape(-1, G, block)  # (r, G, block)
        amax = np.abs(v).max(axis=-1)  # (r, G); NaN/Inf propagate here
        if not np.isfinite(amax).all():
            bad = a + int(np.argwhere(~np.isfinite(amax))[0][0])
            raise ShardError(f"row {bad} holds NaN/Inf: it cannot be stored as fp8")
        s = amax / np.float32(E4M3_MAX)
        v /= np.where(s > 0, s, np.float32(1))[..., None]
        np.clip(v, -E4M3_MAX, E4M3_MAX, out=v)  # a quotient a hair above 448 must not round to NaN
        q[a : a + len(v)] = v.reshape(len(v), H).astype(_DTYPES["F8_E4M3"])
        scale[a : a + len(v)] = s
    return q.reshape(x.shape), scale.reshape(*x.shape[:-1], G)


def dequantize_e4m3(q: np.ndarray, scale: np.ndarray, dtype: DTypeLike = np.float32) -> np.ndarray:
    """(q [..., H] float8_e4m3fn, scale [..., G]) -> q * scale [..., H] in `dtype` (float32 math,
    one rounding into `dtype`: the same bits as the trainer's torch path)."""
    dtype = _DTYPES[dtype] if isinstance(dtype, str) else np.dtype(dtype)
    H, G = q.shape[-1], scale.shape[-1]
    v = _E4M3_VALUES[q.view(np.uint8)].reshape(*q.shape[:-1], G, H // G)
    v *= scale[..., None]
    return v.reshape(q.shape).astype(dtype, copy=False)


def scale_name(name: str) -> str:
    """The tensor holding the scales of a quantized tensor (`aux` -> `aux_scale`)."""
    return f"{name}_scale"


def states_dtype(metadata: dict[str, str]) -> str:
    """The dtype readers get a shard's states in (safetensors name): the engine's for fp8 shards."""
    name = metadata.get("states_dtype") or metadata.get("dtype", "F32")
    if name not in FLOAT_DTYPES.values():
        raise UnknownDtype(
            f"shard states_dtype {name!r} is not one of {sorted(FLOAT_DTYPES.values())}: "
            "written by a newer aerie? read it with that version or re-extract the run"
        )
    return name


def dequantize_tensors(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> dict[str, np.ndarray]:
    """Tensors (some or all of a shard's, as fetched by byte range) as readers want them: each fp8
    one with its `<name>_scale` beside it turned back into the shard's states dtype, the scales
    dropped. Anything else passes through unchanged."""
    out = {}
    for name, arr in tensors.items():
        if name.endswith("_scale") and name.removesuffix("_scale") in tensors:
            continue
        if arr.dtype == _DTYPES["F8_E4M3"]:
            if scale_name(name) not in tensors:
                raise ShardError(f"tensor {name!r} is stored as fp8 but its scales {scale_name(name)!r} were not read")
            arr = dequantize_e4m3(arr, tensors[scale_name(name)], states_dtype(metadata))
        out[name] = arr
    return out


# --------------------------------------------------------------------------------------
# The safetensors container (spec: 8-byte little-endian header size, JSON header, data)
# --------------------------------------------------------------------------------------
def _header(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> tuple[bytes, list[Any]]:
    header: dict[str, object] = {"__metadata__": metadata}
    order, offset = [], 0
    for name in sorted(tensors):
        arr = tensors[name]
        if arr.dtype not in _NAMES:
            raise ShardError(f"tensor {name!r}: dtype {arr.dtype} cannot be stored")
        n = arr.nbytes
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + n]}
        order.append(name)
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)  # data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw, order


def safetensors_parts(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> list[memoryview]:
    """The file as a list of buffers, in order: header, then each tensor's bytes (no copy of
    contiguous arrays). Joined, they are the bytes `write_safetensors` writes."""
    head, order = _header(tensors, metadata)
    parts = [memoryview(head)]
    for name in order:
        arr = np.ascontiguousarray(tensors[name])
        parts.append(arr.reshape(-1).view(np.uint8).data)
    return parts


def write_safetensors(out: BinaryIO, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> int:
    """Stream tensors into `out` without building the whole file in memory; return bytes."""
    total = 0
    for part in safetensors_parts(tensors, metadata):
        out.write(part)
        total += part.nbytes
    return total


def read_safetensors(buf: Buffer) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Zero-copy views over a bytes-like or mmap: name -> ndarray, metadata."""
    mv = memoryview(buf)
    layout, metadata, base = safetensors_layout(mv, len(mv))
    tensors = {}
    for name, (dt, shape, start, end) in layout.items():
        tensors[name] = np.frombuffer(mv[base + start : base + end], dtype=dt).reshape(shape)
    return tensors, metadata


def safetensors_layout(
    head: Buffer, size: int
) -> tuple[dict[str, tuple[np.dtype, list[int], int, int]], dict[str, str], int]:
    """Where a safetensors file of `size` bytes keeps its tensors, from its first bytes `head`
    (at least the 8-byte length and the header): name -> (dtype, shape, start, end) with offsets
    into the data, which begins at the returned base; and the metadata. Checked: the header's
    length, its JSON, each dtype, and each tensor's bytes within the file and of its shape's size."""
    mv = memoryview(head)
    if len(mv) < 8:
        raise ShardError(f"{len(mv)} bytes is too short for a safetensors header")
    (n,) = struct.unpack("<Q", mv[:8])
    if n > size - 8:
        raise ShardError(f"header length {n} exceeds the file ({size} bytes): truncated object?")
    if n > len(mv) - 8:
        raise ShardError(f"header length {n} exceeds the {len(mv) - 8} header bytes given")
    try:
        header = json.loads(bytes(mv[8 : 8 + n]))
    except json.JSONDecodeError as e:
        raise ShardError(f"unreadable safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise ShardError("unreadable safetensors header: not a JSON object")
    metadata = header.pop("__metadata__", {}) or {}
    base = 8 + n
    layout = {}
    for name, spec in header.items():
        dt = _DTYPES.get(spec["dtype"])
        if dt is None:
            raise UnknownDtype(
                f"tensor {name!r} is stored as {spec['dtype']}, which this aerie does not read (it reads "
                f"{', '.join(_DTYPES)}): written by a newer aerie? read it with that version or re-extract the run"
            )
        start, end = spec["data_offsets"]
        if base + end > size:
            raise ShardError(f"tensor {name!r} ends at byte {base + end}, past the file end {size}: truncated")
        shape = [int(d) for d in spec["shape"]]
        if not 0 <= start <= end or end - start != int(np.prod(shape, dtype=np.int64)) * dt.itemsize:
            raise ShardError(f"tensor {name!r}: bytes {start}..{end} do not hold a {dt} array of shape {shape}")
        layout[name] = (dt, shape, start, end)
    return layout, metadata, base


# --------------------------------------------------------------------------------------
# Shards
# --------------------------------------------------------------------------------------
@dataclass
class Shard:
    """One shard in memory (arrays may be zero-copy views over a mapped file)."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    offsets: np.ndarray
    capture_points: list[int] = field(default_factory=list)
    aux: np.ndarray | None = None
    final: np.ndarray | None = None
    topk_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None
    aux_scale: np.ndarray | None = None  # fp8 storage: [T, K, G] float32
    final_scale: np.ndarray | None = None  # fp8 storage: [T, G] float32
    states_dtype: str | None = None  # fp8 storage: what the states dequantize into (BF16/F16/F32)
    extra_metadata: dict[str, str] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "tokens" if self.aux is None else "hidden"

    @property
    def num_sequences(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def quantized(self) -> bool:
        return self.aux is not None and self.aux.dtype == _DTYPES["F8_E4M3"]

    @property
    def scale_block(self) -> int | None:
        """Values of a row per scale (fp8 shards)."""
        if self.aux is None or not self.quantized or self.aux_scale is None:
            return None
        return self.aux.shape[2] // self.aux_scale.shape[2]

    @property
    def target_signal(self) -> str | None:
        if self.final is not None:
            return "final"
        if self.topk_ids is not None:
            return "topk"
        return None

    def sequence(self, s: int, dequantize: bool = True) -> dict[str, np.ndarray]:
        """Sequence s's rows. An fp8 shard's states come back in `states_dtype`, or with
        dequantize=False as stored, with their `aux_scale`/`final_scale` rows beside them."""
        a, b = int(self.offsets[s]), int(self.offsets[s + 1])
        out = {"input_ids": self.input_ids[a:b], "loss_mask": self.loss_mask[a:b]}
        for name in ("aux", "final", "topk_ids", "topk_logprobs", "aux_scale", "final_scale"):
            arr = getattr(self, name)
            if arr is not None:
                out[name] = arr[a:b]
        return (
            dequantize_tensors(out, {"states_dtype": str(self.states_dtype)}) if dequantize and self.quantized else out
        )

    def sequences(self) -> Iterator[dict[str, np.ndarray]]:
        for s in range(self.num_sequences):
            yield self.sequence(s)

    def tensors(self) -> dict[str, np.ndarray]:
        names = (
            "input_ids",
            "loss_mask",
            "offsets",
            "aux",
            "final",
            "topk_ids",
            "topk_logprobs",
            "aux_scale",
            "final_scale",
        )
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def metadata(self) -> dict[str, str]:
        meta = {
            "format": FORMAT,
            "kind": self.kind,
            "sequences": str(self.num_sequences),
            "tokens": str(self.num_tokens),
            **self.extra_metadata,
        }
        if self.aux is not None:
            meta.update(
                capture_points=json.dumps(list(self.capture_points)),
                hidden_size=str(self.aux.shape[2]),
                dtype=_NAMES[self.aux.dtype],
                target_signal=str(self.target_signal),
            )
        if self.quantized:
            meta.update(states_dtype=str(self.states_dtype), scale_block=str(self.scale_block))
        return meta

    def quantize(self, storage_dtype: str = "float8_e4m3fn", block: int | None = None) -> Shard:
        """This shard with its states stored as fp8 (`quantize_e4m3`: a scale per `block` values
        of a row, None: per row); the token tensors and the top-k signal are shared, not copied."""
        if storage_dtype not in STORAGE_DTYPES:
            raise ShardError(f"storage dtype {storage_dtype!r} is not one of {sorted(STORAGE_DTYPES)}")
        if self.aux is None or self.quantized:
            raise ShardError("only a hidden shard in bf16/f16/f32 can be quantized")
        aux, aux_scale = quantize_e4m3(self.aux, block)
        final = final_scale = None
        if self.final is not None:
            final, final_scale = quantize_e4m3(self.final, block)
        return Shard(
            input_ids=self.input_ids,
            loss_mask=self.loss_mask,
            offsets=self.offsets,
            capture_points=list(self.capture_points),
            aux=aux,
            final=final,
            topk_ids=self.topk_ids,
            topk_logprobs=self.topk_logprobs,
            aux_scale=aux_scale,
            final_scale=final_scale,
            states_dtype=_NAMES[self.aux.dtype],
            extra_metadata=dict(self.extra_metadata),
        )

    # ----------------------------------------------------------------------------------
    def validate(self, check_finite: bool = True) -> Shard:
        """Raise ShardError naming the first broken promise."""
        T = self.num_tokens
        if self.input_ids.ndim != 1 or self.input_ids.dtype != np.int32:
            raise ShardError(f"input_ids must be int32 [T], got {self.input_ids.dtype} {list(self.input_ids.shape)}")
        if self.loss_mask.shape != (T,) or self.loss_mask.dtype != np.uint8:
            raise ShardError(f"loss_mask must be uint8 [{T}], got {self.loss_mask.dtype} {list(self.loss_mask.shape)}")
        if self.loss_mask.size and int(self.loss_mask.max()) > 1:
            raise ShardError("loss_mask holds values other than 0 and 1")
        off = self.offsets
        if off.ndim != 1 or off.dtype != np.int64 or len(off) < 1:
            raise ShardError(f"offsets must be int64 [S+1], got {off.dtype} {list(off.shape)}")
        if int(off[0]) != 0 or int(off[-1]) != T:
            raise ShardError(f"offsets must run from 0 to {T} (tokens), got {int(off[0])}..{int(off[-1])}")
        steps = np.diff(off)
        if (steps <= 0).any():
            bad = int(np.argmax(steps <= 0))
            raise ShardError(
                f"offsets not strictly increasing at sequence {bad}: {int(off[bad])} -> {int(off[bad + 1])}"
            )
        if self.aux is None:
            return self
        K = len(self.capture_points)
        if self.aux.ndim != 3 or self.aux.shape[0] != T or self.aux.shape[1] != K:
            raise ShardError(f"aux must be [T={T}, K={K}, H], got {list(self.aux.shape)}")
        if self.aux.dtype not in [_DTYPES[n] for n in STATE_DTYPES]:
            raise ShardError(f"aux dtype {self.aux.dtype} is not one of {', '.join(STATE_DTYPES)}")
        H = self.aux.shape[2]
        self._validate_scales(T, K, H)
        if self.final is not None:
            if self.final.shape != (T, H):
                raise ShardError(f"final must be [T={T}, H={H}], got {list(self.final.shape)}")
        elif self.topk_ids is not None and self.topk_logprobs is not None:
            if self.topk_ids.ndim != 2 or self.topk_ids.shape[0] != T or self.topk_ids.dtype != np.int32:
                raise ShardError(
                    f"topk_ids must be int32 [T={T}, k], got {self.topk_ids.dtype} {list(self.topk_ids.shape)}"
                )
            if self.topk_logprobs.shape != self.topk_ids.shape or self.topk_logprobs.dtype != np.float32:
                raise ShardError(
                    f"topk_logprobs must be float32 {list(self.topk_ids.shape)}, got {self.topk_logprobs.dtype} {list(self.topk_logprobs.shape)}"
                )
        else:
            raise ShardError("hidden shard has no target signal: needs `final` or `topk_ids`+`topk_logprobs`")
        if check_finite:
            for name in ("aux", "final", "aux_scale", "final_scale"):
                arr = getattr(self, name)
                if arr is None:
                    continue
                wrong = _nonfinite(arr)
                if name.endswith("_scale"):
                    wrong |= arr < 0
                if wrong.any():
                    row = int(np.argwhere(wrong)[0][0])
                    seq = int(np.searchsorted(off, row, side="right") - 1)
                    what = "a NaN/Inf or negative scale" if name.endswith("_scale") else "NaN/Inf"
                    raise ShardError(f"{name} holds {what} at token {row} (sequence {seq})")
        return self

    def _validate_scales(self, T: int, K: int, H: int) -> None:
        """fp8 states come with float32 scales [T, K, G] / [T, G] (G divides H) and a states dtype;
        other states come with neither."""
        assert self.aux is not None  # called for hidden shards only
        if not self.quantized:
            if self.aux_scale is not None or self.final_scale is not None or self.states_dtype is not None:
                raise ShardError(
                    f"scales or states_dtype on a shard stored as {_NAMES[self.aux.dtype]}: only fp8 states have them"
                )
            if self.final is not None and self.final.dtype == _DTYPES["F8_E4M3"]:
                raise ShardError("final is fp8 but aux is not: both states are stored alike")
            return
        if self.states_dtype not in FLOAT_DTYPES.values():
            raise ShardError(
                f"fp8 shard: states_dtype {self.states_dtype!r} is not one of {sorted(FLOAT_DTYPES.values())}"
            )
        scale = self.aux_scale
        if (
            scale is None
            or scale.dtype != np.float32
            or scale.ndim != 3
            or scale.shape[:2] != (T, K)
            or H % max(scale.shape[2], 1)
        ):
            got = "none" if scale is None else f"{scale.dtype} {list(scale.shape)}"
            raise ShardError(f"fp8 aux needs aux_scale float32 [T={T}, K={K}, G] with G dividing H={H}, got {got}")
        G = scale.shape[2]
        if self.final is not None:
            if self.final.dtype != _DTYPES["F8_E4M3"]:
                raise ShardError(f"aux is fp8 but final is {self.final.dtype}: both states are stored alike")
            fs = self.final_scale
            if fs is None or fs.dtype != np.float32 or fs.shape != (T, G):
                got = "none" if fs is None else f"{fs.dtype} {list(fs.shape)}"
                raise ShardError(f"fp8 final needs final_scale float32 [T={T}, G={G}], got {got}")
        elif self.final_scale is not None:
            raise ShardError("final_scale without final")

    # ----------------------------------------------------------------------------------
    def write(self, out: BinaryIO) -> int:
        self.validate(check_finite=False)
        return write_safetensors(out, self.tensors(), self.metadata())

    def parts(self) -> list[memoryview]:
        """The shard's file as buffers in order (header, tensors), without joining them."""
        self.validate(check_finite=False)
        return safetensors_parts(self.tensors(), self.metadata())

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        self.write(buf)
        return buf.getvalue()

    def save(self, path: str | os.PathLike[str]) -> int:
        tmp = f"{path}.part"
        with open(tmp, "wb") as f:
            n = self.write(f)
        os.replace(tmp, path)
        return n

    @classmethod
    def from_buffer(cls, buf: Buffer) -> Shard:
        tensors, meta = read_safetensors(buf)
        if meta.get("format") != FORMAT:
            raise ShardError(f"not an aerie shard: header format {meta.get('format')!r}, expected {FORMAT!r}")
        missing = [n for n in ("input_ids", "loss_mask", "offsets") if n not in tensors]
        if missing:
            raise ShardError(f"shard lacks tensor(s) {missing}")
        extra = {
            k: v
            for k, v in meta.items()
            if k
            not in (
                "format",
                "kind",
                "sequences",
                "tokens",
                "capture_points",
                "hidden_size",
                "dtype",
                "target_signal",
                "states_dtype",
                "scale_block",
            )
        }
        quantized = tensors.get("aux") is not None and tensors["aux"].dtype == _DTYPES["F8_E4M3"]
        shard = cls(
            input_ids=tensors["input_ids"],
            loss_mask=tensors["loss_mask"],
            offsets=tensors["offsets"],
            capture_points=json.loads(meta.get("capture_points", "[]")),
            aux=tensors.get("aux"),
            final=tensors.get("final"),
            topk_ids=tensors.get("topk_ids"),
            topk_logprobs=tensors.get("topk_logprobs"),
            aux_scale=tensors.get("aux_scale"),
            final_scale=tensors.get("final_scale"),
            states_dtype=states_dtype(meta) if quantized else None,
            extra_metadata=extra,
        )
        if meta.get("kind") != shard.kind:
            raise ShardError(f"header says kind {meta.get('kind')!r} but tensors make a {shard.kind!r} shard")
        if shard.aux is not None and meta.get("dtype") != _NAMES[shard.aux.dtype]:
            raise ShardError(f"header says dtype {meta.get('dtype')!r} but aux is stored as {_NAMES[shard.aux.dtype]}")
        if quantized and shard.aux_scale is not None and meta.get("scale_block") != str(shard.scale_block):
            raise ShardError(
                f"header says scale_block {meta.get('scale_block')!r} but aux_scale makes it {shard.scale_block}"
            )
        return shard

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Shard:
        """Memory-map a shard file: arrays are views over the page cache, no copy."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                raise ShardError(f"{path}: empty file")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return cls.from_buffer(mm)


def pack(
    sequences: Sequence[dict[str, np.ndarray]],
    capture_points: Sequence[int] = (),
    extra_metadata: dict[str, str] | None = None,
) -> Shard:
    """Concatenate per-sequence arrays (same keys as Shard.sequence) into one shard."""
    if not sequences:
        raise ShardError("cannot pack an empty list of sequences")
    lengths = [len(s["input_ids"]) for s in sequences]
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])

    def cat(name: str, dtype: DTypeLike | None = None) -> Any:  # an ndarray, None when the sequences lack it
        if name not in sequences[0]:
            return None
        arr = np.concatenate([np.asarray(s[name]) for s in sequences], axis=0)
        return arr.astype(dtype, copy=False) if dtype is not None else arr

    return Shard(
        input_ids=cat("input_ids", np.int32),
        loss_mask=cat("loss_mask", np.uint8),
        offsets=offsets,
        capture_points=list(capture_points),
        aux=cat("aux"),
        final=cat("final"),
        topk_ids=cat("topk_ids", np.int32),
        topk_logprobs=cat("topk_logprobs", np.float32),
        extra_metadata=dict(extra_metadata or {}),
    )


def raw_bytes_per_token(shard: Shard) -> float:
    """Bytes of the tensors themselves per token (what a shard's size is compared with)."""
    return sum(a.nbytes for a in shard.tensors().values()) / max(shard.num_tokens, 1)
