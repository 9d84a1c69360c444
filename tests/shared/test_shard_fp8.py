"""fp8 storage of the states: e4m3 with float32 scales, plain safetensors, dequantized for readers.

- The round trip keeps each value within e4m3's precision of its row's scale (relative error
  <= 2^-4 for a normal value, 2^-10 * scale below e4m3's normal range), zeros stay exact zeros,
  rows far above and below 1 keep that precision, and nothing comes back NaN/Inf.
- The file is safetensors F8_E4M3 + F32: the reference library reads it as torch.float8_e4m3fn.
- Validation names what is wrong: scales missing, misshapen, negative or NaN; an fp8 NaN; a dtype
  this aerie does not read.
- Under massive activations (a few channels of a DeepSeek-like residual stream far above the rest)
  a scale per 128 values keeps the ordinary channels at least as close as one scale per row, and
  much closer once the large channels push them into e4m3's subnormals: the default
  (`default_scale_block`) is per block where 128 divides the hidden size.
"""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest

from aerie.shard import (
    E4M3_MAX,
    Shard,
    ShardError,
    UnknownDtype,
    default_scale_block,
    dequantize_e4m3,
    dequantize_tensors,
    pack,
    quantize_e4m3,
)
from tests.shared.test_shard import make_sequences

rng = np.random.default_rng(3)


def rows_with_extremes(H=64) -> np.ndarray:
    """Rows as hidden states come, plus the awkward ones: zeros, huge, tiny, one outlier channel."""
    x = rng.standard_normal((8, H)).astype(np.float32)
    x[1] = 0.0  # an all-zero row (padding-like)
    x[2] *= 3e4  # large
    x[3] *= 1e-30  # tiny
    x[4, 7] = 2e3  # a massive-activation channel above ordinary values
    x[5, ::3] = 0.0  # exact zeros inside a row
    x[6] = E4M3_MAX * 4  # a constant row: every value on the scale exactly
    return x


def bound(x: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    """Per value: half an e4m3 ulp — 2^-4 relative for normals, 2^-10 * scale in the subnormal range."""
    s = np.repeat(scale, block, axis=-1)
    return np.maximum(np.abs(x) * 2.0**-4, s * 2.0**-10) * (1 + 1e-6)


@pytest.mark.parametrize("block", [None, 16])
def test_round_trip_within_e4m3_precision(block):
    x = rows_with_extremes()
    q, scale = quantize_e4m3(x, block)
    assert q.dtype == np.dtype(ml_dtypes.float8_e4m3fn) and scale.dtype == np.float32
    assert scale.shape == (8, 64 // (block or 64))
    back = dequantize_e4m3(q, scale)
    assert np.isfinite(back).all()
    err = np.abs(back - x)
    assert (err <= bound(x, scale, block or 64)).all(), float((err / bound(x, scale, block or 64)).max())
    assert (back[x == 0] == 0).all() and (back[1] == 0).all()  # zeros exact
    np.testing.assert_array_equal(back[6], x[6])  # values on the scale are exact
    # relative error per row (the figure that matters for a state): well within 2^-4
    rel = np.linalg.norm(back - x, axis=1) / np.maximum(np.linalg.norm(x, axis=1), 1e-38)
    assert (rel[[0, 2, 3, 4, 5]] < 2.0**-4).all() and rel[1] == 0
    # the largest value of each block lands on e4m3's largest: the scale is max|x| / 448
    np.testing.assert_allclose(np.abs(q.astype(np.float32)).reshape(8, -1, block or 64).max(-1)[scale > 0], E4M3_MAX)


def test_bf16_states_round_trip_into_bf16():
    """A shard of bf16 states stores fp8 and reads back bf16, ~2% off per row, half the bytes."""
    shard = pack(make_sequences(n=6, K=3, H=64), capture_points=[2, 15, 27])
    fp8 = shard.quantize()
    back = Shard.from_buffer(fp8.to_bytes()).validate()
    assert back.quantized and back.states_dtype == "BF16" and back.scale_block == 64
    assert back.metadata()["dtype"] == "F8_E4M3" and back.metadata()["scale_block"] == "64"
    for s0, s1 in zip(shard.sequences(), back.sequences()):
        for name in ("aux", "final"):
            assert s1[name].dtype == np.dtype(ml_dtypes.bfloat16)
            a, b = s0[name].astype(np.float32), s1[name].astype(np.float32)
            rel = np.linalg.norm(b - a, axis=-1) / np.linalg.norm(a, axis=-1)
            assert rel.max() < 2.0**-4 and rel.mean() < 0.035, (name, rel.max(), rel.mean())
        raw = back.sequence(0, dequantize=False)
        assert raw["aux"].dtype == np.dtype(ml_dtypes.float8_e4m3fn) and "aux_scale" in raw and "final_scale" in raw
    # bytes: (1 + 4/H) per value instead of 2
    assert len(fp8.to_bytes()) < 0.56 * len(shard.to_bytes())


def test_plain_safetensors_reads_fp8(tmp_path):
    import torch
    from safetensors.torch import load_file

    fp8 = pack(make_sequences(), capture_points=[1, 2, 3]).quantize(block=8)
    fp8.save(tmp_path / "s.safetensors")
    theirs = load_file(tmp_path / "s.safetensors")
    assert theirs["aux"].dtype == torch.float8_e4m3fn and theirs["aux_scale"].dtype == torch.float32
    assert list(theirs["aux_scale"].shape) == [fp8.num_tokens, 3, 2]
    np.testing.assert_array_equal(theirs["aux"].view(torch.uint8).numpy(), fp8.aux.view(np.uint8))
    ours = fp8.sequence(1)["final"].astype(np.float32)
    a, b = int(fp8.offsets[1]), int(fp8.offsets[2])
    torch_deq = (theirs["final"][a:b].float().view(b - a, 2, 8) * theirs["final_scale"][a:b, :, None]).view(b - a, 16)
    np.testing.assert_array_equal(ours, torch_deq.to(torch.bfloat16).float().numpy())


def test_topk_shards_quantize_their_aux_only():
    shard = pack(make_sequences(signal="topk"), capture_points=[1, 2, 3])
    back = Shard.from_buffer(shard.quantize().to_bytes()).validate()
    assert back.final is None and back.final_scale is None and back.topk_logprobs.dtype == np.float32
    np.testing.assert_array_equal(back.topk_ids, shard.topk_ids)


def test_nan_and_inf_are_refused_before_storage():
    shard = pack(make_sequences(dtype=np.float32), capture_points=[1, 2, 3])
    shard.final[5, 3] = np.inf
    with pytest.raises(ShardError, match="row 5 holds NaN/Inf"):
        shard.quantize()
    with pytest.raises(ShardError, match="scale block 5 does not divide the hidden size 16"):
        quantize_e4m3(np.zeros((2, 16), np.float32), 5)


def broken(mutate):
    s = pack(make_sequences(), capture_points=[1, 2, 3]).quantize()
    mutate(s)
    return s


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda s: setattr(s, "aux_scale", None), r"fp8 aux needs aux_scale float32 \[T="),
        (lambda s: setattr(s, "aux_scale", s.aux_scale[:, :2]), "fp8 aux needs aux_scale"),
        (lambda s: setattr(s, "aux_scale", np.ones((s.num_tokens, 3, 3), np.float32)), "G dividing H=16"),
        (lambda s: setattr(s, "aux_scale", s.aux_scale.astype(np.float64)), "fp8 aux needs aux_scale float32"),
        (lambda s: setattr(s, "final_scale", None), "fp8 final needs final_scale"),
        (lambda s: setattr(s, "states_dtype", "F64"), "states_dtype 'F64' is not one of"),
        (lambda s: setattr(s, "final", s.final.astype(np.float32)), "aux is fp8 but final is float32"),
        (lambda s: s.aux_scale.__setitem__((4, 1, 0), -1.0), "aux_scale holds a NaN/Inf or negative scale at token 4"),
        (
            lambda s: s.final_scale.__setitem__((2, 0), np.nan),
            "final_scale holds a NaN/Inf or negative scale at token 2",
        ),
        (lambda s: s.aux.view(np.uint8).__setitem__((9, 0, 0), 0x7F), "aux holds NaN/Inf at token 9"),
    ],
)
def test_validation_names_the_problem(mutate, match):
    with pytest.raises(ShardError, match=match):
        broken(mutate).validate()


def test_scales_on_a_bf16_shard_are_refused():
    s = pack(make_sequences(), capture_points=[1, 2, 3])
    s.aux_scale = np.ones((s.num_tokens, 3, 1), np.float32)
    with pytest.raises(ShardError, match="only fp8 states have them"):
        s.validate()


def _with_header(data: bytes, edit) -> bytes:
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (n - len(raw))
    assert len(raw) == n
    return data[:8] + raw + data[8 + n :]


def test_unknown_dtypes_are_refused_in_one_line():
    data = pack(make_sequences(), capture_points=[1, 2, 3]).quantize().to_bytes()
    # a dtype this aerie does not know (say a future e5m2 writer's)
    e5m2 = _with_header(data, lambda h: h["aux"].update(dtype="F8_E5M2"))
    with pytest.raises(
        UnknownDtype, match=r"^tensor 'aux' is stored as F8_E5M2, which this aerie does not read .*re-extract the run$"
    ):
        Shard.from_buffer(e5m2)
    odd = _with_header(data, lambda h: h["__metadata__"].update(states_dtype="F64"))
    with pytest.raises(UnknownDtype, match="states_dtype 'F64' is not one of"):
        Shard.from_buffer(odd)
    lying = _with_header(data, lambda h: h["__metadata__"].update(scale_block="8"))
    with pytest.raises(ShardError, match="header says scale_block '8' but aux_scale makes it 16"):
        Shard.from_buffer(lying)
    from aerie.errors import ExpectedError

    assert issubclass(UnknownDtype, ExpectedError) and "\n" not in str(UnknownDtype("x"))


def test_partial_readers_dequantize_what_they_fetch():
    fp8 = pack(make_sequences(), capture_points=[1, 2, 3]).quantize()
    meta = fp8.metadata()
    got = dequantize_tensors({"final": fp8.final, "final_scale": fp8.final_scale, "offsets": fp8.offsets}, meta)
    assert sorted(got) == ["final", "offsets"] and got["final"].dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got["final"], dequantize_e4m3(fp8.final, fp8.final_scale, "BF16"))
    with pytest.raises(ShardError, match="its scales 'final_scale' were not read"):
        dequantize_tensors({"final": fp8.final}, meta)


def test_quantizing_needs_no_torch():
    """The extractor's SGLang path has no torch: fp8 shards are made and read with numpy alone."""
    import subprocess
    import sys

    from tests.services import clean_env

    code = (
        "import sys; sys.modules['torch'] = None\n"  # any import of torch now fails
        "import numpy as np, ml_dtypes\n"
        "from aerie.shard import Shard, pack\n"
        "s = pack([{'input_ids': np.arange(5, dtype=np.int32), 'loss_mask': np.ones(5, np.uint8),\n"
        "           'aux': np.ones((5, 2, 8), ml_dtypes.bfloat16), 'final': np.ones((5, 8), ml_dtypes.bfloat16)}], [1, 2])\n"
        "back = Shard.from_buffer(s.quantize().to_bytes()).validate()\n"
        "print(back.sequence(0)['aux'].astype(np.float32).sum(), 'torch' in sys.modules and sys.modules['torch'] is not None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["80.0", "False"]


def deepseek_like_states(T: int, H: int, factor: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Residual-stream-like rows: ordinary channels of spread magnitudes (log-normal per channel),
    and 4 massive-activation channels at `factor` times the ordinary RMS, in every token, of both
    signs (as DeepSeek/Kimi streams carry a few). Returns (states, mask of the ordinary channels)."""
    g = np.random.default_rng(seed)
    x = g.standard_normal((T, H)).astype(np.float32) * np.exp(0.5 * g.standard_normal(H)).astype(np.float32)
    rms = float(np.sqrt((x**2).mean()))
    massive = g.choice(H, 4, replace=False)
    x[:, massive] = factor * rms * (1 + 0.1 * g.standard_normal((T, 4))) * np.array([1, -1, 1, -1], np.float32)
    ordinary = np.ones(H, bool)
    ordinary[massive] = False
    return x, ordinary


def ordinary_error(x: np.ndarray, ordinary: np.ndarray, block: int | None) -> np.ndarray:
    """Per row: relative L2 error of the ordinary channels after the fp8 round trip."""
    q, scale = quantize_e4m3(x, block)
    err = dequantize_e4m3(q, scale, np.float32) - x
    return np.linalg.norm(err[:, ordinary], axis=1) / np.linalg.norm(x[:, ordinary], axis=1)


@pytest.mark.parametrize("factor", [100.0, 1000.0, 3e4, 1e5])
def test_block_scales_keep_the_ordinary_channels_under_massive_activations(factor):
    x, ordinary = deepseek_like_states(T=32, H=7168, factor=factor)
    per_row, per_block = ordinary_error(x, ordinary, None), ordinary_error(x, ordinary, 128)
    assert (per_block <= per_row * 1.01).all()  # never worse, row by row
    assert per_block.max() < 0.05  # e4m3's 2^-4 half-ulp bound keeps an RMS error well under it
    if factor >= 3e4:  # the large channels push ordinary values into e4m3's subnormals under one scale
        assert per_row.mean() > 1.5 * per_block.mean()


def test_the_default_scale_block_is_128_where_it_divides_the_hidden_size():
    assert default_scale_block(7168) == 128 and default_scale_block(4096) == 128 and default_scale_block(256) == 128
    assert default_scale_block(576) is None and default_scale_block(64) is None  # SmolLM2, the tiny DeepSeek
