"""The shard format: packed, no padding, plain safetensors, validated with precise errors."""

import ml_dtypes
import numpy as np
import pytest

from aerie.shard import Shard, ShardError, pack, raw_bytes_per_token

rng = np.random.default_rng(0)


def make_sequences(n=5, K=3, H=16, signal="final", dtype=ml_dtypes.bfloat16):
    seqs = []
    for _ in range(n):
        T = int(rng.integers(3, 40))
        s = {
            "input_ids": rng.integers(0, 1000, T).astype(np.int32),
            "loss_mask": (rng.random(T) > 0.5).astype(np.uint8),
            "aux": rng.standard_normal((T, K, H)).astype(dtype),
        }
        if signal == "final":
            s["final"] = rng.standard_normal((T, H)).astype(dtype)
        else:
            s["topk_ids"] = rng.integers(0, 1000, (T, 4)).astype(np.int32)
            s["topk_logprobs"] = -rng.random((T, 4)).astype(np.float32)
        seqs.append(s)
    return seqs


@pytest.mark.parametrize("signal", ["final", "topk"])
def test_round_trip_and_sequences(tmp_path, signal):
    seqs = make_sequences(signal=signal)
    shard = pack(seqs, capture_points=[2, 15, 27])
    path = tmp_path / "s.safetensors"
    shard.save(path)
    back = Shard.open(path).validate()
    assert back.capture_points == [2, 15, 27]
    assert back.num_sequences == len(seqs) and back.target_signal == signal
    for s, got in zip(seqs, back.sequences()):
        for name, arr in s.items():
            np.testing.assert_array_equal(got[name], arr)
    # no padding: the file is the tensors plus a small header
    raw = sum(a.nbytes for a in shard.tensors().values())
    assert raw <= path.stat().st_size <= raw + 2048


def test_plain_safetensors_both_ways(tmp_path):
    """Our container is safetensors: the reference library reads ours and we read its."""
    import torch
    from safetensors.torch import load_file, save_file

    shard = pack(make_sequences(), capture_points=[1, 2, 3])
    path = tmp_path / "ours.safetensors"
    shard.save(path)
    theirs = load_file(path)
    assert theirs["aux"].dtype == torch.bfloat16
    np.testing.assert_array_equal(theirs["aux"].view(torch.uint16).numpy(), shard.aux.view(np.uint16))
    np.testing.assert_array_equal(theirs["offsets"].numpy(), shard.offsets)
    other = tmp_path / "theirs.safetensors"
    save_file(theirs, other, metadata=shard.metadata())
    again = Shard.open(other).validate()
    np.testing.assert_array_equal(again.final.view(np.uint16), shard.final.view(np.uint16))


def test_open_is_zero_copy(tmp_path):
    shard = pack(make_sequences(), capture_points=[1, 2, 3])
    shard.save(tmp_path / "s.safetensors")
    back = Shard.open(tmp_path / "s.safetensors")
    assert not back.aux.flags.owndata and not back.aux.flags.writeable


def broken(mutate):
    s = pack(make_sequences(), capture_points=[1, 2, 3])
    mutate(s)
    return s


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda s: setattr(s, "offsets", s.offsets[::-1].copy()), "offsets must run from 0"),
        (lambda s: s.offsets.__setitem__(2, s.offsets[1]), "not strictly increasing at sequence 1"),
        (lambda s: setattr(s, "input_ids", s.input_ids.astype(np.int64)), "input_ids must be int32"),
        (lambda s: setattr(s, "loss_mask", s.loss_mask[:-1]), "loss_mask must be uint8"),
        (lambda s: setattr(s, "aux", s.aux[:, :2]), r"aux must be \[T="),
        (lambda s: setattr(s, "final", s.final[:, :8]), "final must be"),
        (lambda s: setattr(s, "final", None), "no target signal"),
        (lambda s: s.aux.__setitem__((7, 1, 3), np.nan), "aux holds NaN/Inf at token 7"),
        (lambda s: s.final.__setitem__((0, 0), np.inf), "final holds NaN/Inf at token 0"),
    ],
)
def test_validation_names_the_problem(mutate, match):
    with pytest.raises(ShardError, match=match):
        broken(mutate).validate()


def test_truncated_and_foreign_files_are_refused():
    data = pack(make_sequences(), capture_points=[1, 2, 3]).to_bytes()
    with pytest.raises(ShardError, match="truncated"):
        Shard.from_buffer(data[: len(data) // 2])
    from safetensors.numpy import save

    with pytest.raises(ShardError, match="not an aerie shard"):
        Shard.from_buffer(save({"x": np.zeros(3, np.float32)}))


def test_tokens_shard_and_overhead():
    seqs = [{k: v for k, v in s.items() if k in ("input_ids", "loss_mask")} for s in make_sequences()]
    shard = pack(seqs)
    assert shard.kind == "tokens"
    back = Shard.from_buffer(shard.to_bytes()).validate()
    assert back.aux is None and back.num_tokens == shard.num_tokens
    big = pack(make_sequences(n=40, K=3, H=576), capture_points=[2, 15, 27])
    stored = len(big.to_bytes()) / big.num_tokens
    assert stored / raw_bytes_per_token(big) < 1.01
