"""The trainer's data: hidden-state shards from the store -> batches, split, ordered, resumable."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from aerie import layout
from aerie.shard import Shard
from tests.runs import hidden_run_folder, upload_run


# --------------------------------------------------------------------------------------
# Tests of the data pipeline
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_run(cache_dir, smollm2_path) -> Path:
    return hidden_run_folder(cache_dir, smollm2_path, records=24, max_tokens=96, shard_sequences=4)


def make_data(store, runs, **kw):
    from aerie_trainer.data import HiddenData, load_runs

    args = dict(batch_tokens=256, max_seq_tokens=96, ttt_steps=3, seed=0, holdout_fraction=0.2, prefetch=2) | kw
    return HiddenData(store, load_runs(store, runs), **args)


def test_batches_follow_the_slot_layout(store, small_run):
    """Slot t of step k holds token t+1+k, the signal of row t+1+k and loss_mask[t+2+k]."""
    upload_run(store, small_run, "r1")
    data = make_data(store, ["r1"])
    assert data.split == "shard" and data.holdout_items and data.train_items
    it = data.batches()
    (pos, batch) = next(it)
    it.close()
    plan = data.epoch_plan(0)
    assert pos == (0, 1)
    shard_idx, seq_idx = plan[0][0]
    seq = Shard.open(store.local_path(data.shards[shard_idx].key)).sequence(seq_idx) if store.local_path("x") else None
    if seq is None:
        seq = Shard.from_buffer(store.get_bytes(data.shards[shard_idx].key)).sequence(seq_idx)
    T = min(len(seq["input_ids"]), 96)
    assert batch.input_ids[0, : T - 1].tolist() == seq["input_ids"][1:T].tolist()
    assert batch.loss_mask[0, : T - 2].tolist() == seq["loss_mask"][2:T].astype(bool).tolist()
    assert not batch.loss_mask[0, T - 2 :].any()
    aux = batch.aux[0, : T - 1].float().numpy()
    np.testing.assert_array_equal(aux, seq["aux"][: T - 1].astype(np.float32).reshape(T - 1, -1))
    np.testing.assert_array_equal(batch.final[0, : T - 1].float().numpy(), seq["final"][1:T].astype(np.float32))


def test_epoch_plans_are_reproducible_and_cover_the_training_split(fs_store, small_run):
    upload_run(fs_store, small_run, "r1")
    data = make_data(fs_store, ["r1"])
    a, b = data.epoch_plan(3), data.epoch_plan(3)
    assert a == b and a != data.epoch_plan(4)
    assert sorted(it for batch in a for it in batch) == sorted(data.train_items)
    assert not set(data.train_items) & set(data.holdout_items)
    # resuming at a data position gives exactly the batches that followed it
    full = data.batches(0, 0)
    straight = [next(full) for _ in range(len(a) + 2)]
    full.close()
    resumed = data.batches(*straight[1][0])
    again = [next(resumed) for _ in range(len(a))]
    resumed.close()
    for (p1, b1), (p2, b2) in zip(straight[2:], again):
        assert p1 == p2 and b1.input_ids.tolist() == b2.input_ids.tolist()


def test_ranks_share_every_epochs_batches_exactly(fs_store, small_run):
    """W ranks take, round by round, the batches one process takes in order (rank r the r-th of
    each W), across epochs whose batch count W does not divide: none is dropped or repeated, and
    every rank reports the same data position, the one one process reports after as many batches."""
    from aerie_trainer.data import HiddenData, load_runs

    upload_run(fs_store, small_run, "r1")
    runs = load_runs(fs_store, ["r1"])

    def data(rank: int, world_size: int) -> HiddenData:
        args = dict(batch_tokens=384, max_seq_tokens=96, ttt_steps=3, seed=0, holdout_fraction=0.2)
        return HiddenData(fs_store, runs, rank=rank, world_size=world_size, **args)

    one = data(0, 1)
    sizes = [len(one.epoch_plan(e)) for e in range(4)]
    assert any(n % 2 for n in sizes) and any(n % 3 for n in sizes)  # epochs that 2 and 3 ranks do not divide
    total = sum(sizes[:3])
    stream = list(itertools.islice(one.rank_plan(), total))
    assert [b for _, b in stream] == [b for e in range(3) for b in one.epoch_plan(e)]
    for world_size in (1, 2, 3):
        rounds = total // world_size
        ranks = [list(itertools.islice(data(r, world_size).rank_plan(), rounds)) for r in range(world_size)]
        for k in range(rounds):
            group = stream[k * world_size : (k + 1) * world_size]
            assert [ranks[r][k][1] for r in range(world_size)] == [b for _, b in group]
            assert {ranks[r][k][0] for r in range(world_size)} == {group[-1][0]}
        # resuming every rank at a round's position continues where it left off
        pos = ranks[0][rounds // 2][0]
        for r in range(world_size):
            again = list(itertools.islice(data(r, world_size).rank_plan(*pos), rounds - rounds // 2 - 1))
            assert again == ranks[r][rounds // 2 + 1 :]


def test_mixed_runs_are_refused(fs_store, small_run):
    from aerie_trainer.data import DataError, load_runs

    upload_run(fs_store, small_run, "r1")
    spec = upload_run(fs_store, small_run, "r2")
    fs_store.put_json(layout.run_spec("r2"), spec.model_copy(update={"capture_points": [3, 15, 27]}))
    with pytest.raises(DataError, match="capture points"):
        load_runs(fs_store, ["r1", "r2"])
    with pytest.raises(DataError, match="no runs/missing/run.json"):
        load_runs(fs_store, ["missing"])
    upload_run(fs_store, small_run, "r3")
    assert len(load_runs(fs_store, ["r1", "r3"]).shards) == 2 * len(
        list((small_run / "runs" / "RUN" / "hidden").glob("*.safetensors"))
    )


def test_fp8_runs_batch_as_the_dequantized_states(store, small_run):
    """A run stored as fp8 trains on exactly the states `aerie.shard` dequantizes (the batch's
    torch dequantization, on the device it moves to, gives the same bits as numpy's), its top-k
    vocabulary counts read the dequantized final states, and it does not mix with a bf16 run."""
    import torch

    from aerie.shard import dequantize_e4m3
    from aerie_trainer.data import DataError, load_runs, read_tensors
    from tests.runs import quantize_run

    upload_run(store, small_run, "r1")
    quantize_run(store, "r1", "r8", block=64)  # H = 576: 9 scales a row
    data = make_data(store, ["r8"])
    it = data.batches()
    _, stored = next(it)
    it.close()
    assert (
        stored.aux.dtype == torch.float8_e4m3fn
        and stored.aux_scale.shape[-1] == 9
        and stored.states_dtype == torch.bfloat16
    )
    batch = stored.to("cpu")
    assert batch.aux_scale is None and batch.aux.dtype == torch.bfloat16 and batch.final.dtype == torch.bfloat16
    shard_idx, seq_idx = data.epoch_plan(0)[0][0]
    fp8 = Shard.from_buffer(store.get_bytes(data.shards[shard_idx].key))
    seq = fp8.sequence(seq_idx)  # numpy dequantized
    T = min(len(seq["input_ids"]), 96)
    np.testing.assert_array_equal(
        batch.aux[0, : T - 1].float().numpy(), seq["aux"][: T - 1].astype(np.float32).reshape(T - 1, -1)
    )
    np.testing.assert_array_equal(batch.final[0, : T - 1].float().numpy(), seq["final"][1:T].astype(np.float32))
    assert not batch.aux[0, T - 1 :].any()  # padding stays zero
    # the bf16 states they came from, within e4m3's precision
    bf16 = Shard.from_buffer(store.get_bytes(layout.shard("r1", "hidden", data.shards[shard_idx].name))).sequence(
        seq_idx
    )
    a, b = bf16["aux"].astype(np.float32), seq["aux"].astype(np.float32)
    assert (np.linalg.norm(a - b, axis=-1) / np.linalg.norm(a, axis=-1)).max() < 2.0**-4
    # byte-range readers (the vocabulary's count of target tokens) get dequantized states too
    t = read_tensors(store, data.shards[shard_idx].key, ["final", "offsets"])
    assert sorted(t) == ["final", "offsets"]
    np.testing.assert_array_equal(t["final"], dequantize_e4m3(fp8.final, fp8.final_scale, "BF16"))
    with pytest.raises(DataError, match=r"differ in storage dtype \(None vs float8_e4m3fn\)"):
        load_runs(store, ["r1", "r8"])
    # a run of the older layout (one scale per row, as shards without a block were written) trains
    # beside one scaled per block: each shard is dequantized with its own scales
    quantize_run(store, "r1", "r9")
    both = make_data(store, ["r8", "r9"])
    assert sorted({Shard.from_buffer(store.get_bytes(s.key)).scale_block for s in both.shards}) == [64, 576]
    seen = set()
    it = both.batches()
    for _, stored in itertools.islice(it, 2 * len(both.shards)):
        seen.add(stored.aux_scale.shape[-1])
        assert stored.to("cpu").aux.dtype == torch.bfloat16
    it.close()
    assert seen <= {1, 9} and seen


def test_a_shard_is_checked_once_however_often_it_is_reopened(store, small_run, monkeypatch):
    """Shards are closed and reopened as the shuffle window moves, each epoch and each held-out
    evaluation; their values are checked the first time only (HiddenData.verified)."""
    import aerie_trainer.data as data_mod

    checked = []
    real = data_mod.check_shard
    monkeypatch.setattr(data_mod, "check_shard", lambda key, *a: (checked.append(key), real(key, *a)))
    upload_run(store, small_run, "r1")
    data = make_data(store, ["r1"], holdout_fraction=0.0)
    for _ in range(2):  # two caches, as two epochs' producers or an evaluation open them
        cache = data_mod.ShardCache(store, data.expect, data.verified)
        try:
            for s in data.shards:
                cache.get(s.key)
        finally:
            cache.close()
    assert sorted(checked) == sorted(s.key for s in data.shards)


def test_corrupt_shards_are_refused_by_name_before_training(fs_store, small_run):
    """Issue 35 finding 2: one NaN, a value of 3e38, two swapped shards or a header dtype changed
    all trained silently. Now every shard is checked as it is opened: its record's sha256, the
    dtype and shape the run spec says, finite values within STATE_BOUND; a truncated shard is one
    line too (finding 10). Each case rewrites the record's sha256, so the value checks are reached."""
    import hashlib

    import ml_dtypes

    from aerie.contracts import ShardRecord
    from aerie_trainer.data import DataError

    def first_batch():  # opens every shard as training does
        from aerie_trainer.data import ShardCache

        data = make_data(fs_store, ["r1"], holdout_fraction=0.0)
        cache = ShardCache(fs_store, data.expect)
        try:
            for s in data.shards:
                cache.get(s.key)
        finally:
            cache.close()

    def rewrite(key, data: bytes):
        fs_store.put_bytes(key, data)
        rec_key = layout.shard_record("r1", "hidden", key.rsplit("/", 1)[-1].removesuffix(".safetensors"))
        rec = fs_store.get_json(rec_key, ShardRecord)
        fs_store.put_json(rec_key, rec.model_copy(update={"sha256": hashlib.sha256(data).hexdigest()}))

    upload_run(fs_store, small_run, "r1")
    keys = [s.key for s in make_data(fs_store, ["r1"], holdout_fraction=0.0).shards]
    originals = {k: fs_store.get_bytes(k) for k in keys}
    first_batch()  # intact: trains

    a, b = keys[0], keys[1]
    fs_store.put_bytes(a, originals[b])
    fs_store.put_bytes(b, originals[a])
    with pytest.raises(DataError, match="sha256.*differs from its record"):
        first_batch()
    for k in keys:
        fs_store.put_bytes(k, originals[k])

    shard = Shard.from_buffer(originals[a])
    for value, why in ((np.nan, "nan"), (3e38, r"3\.00\d*e\+38|inf")):
        aux = np.array(shard.aux)
        aux[5, 0, 7] = value
        rewrite(a, Shard(**{**shard.__dict__, "aux": aux.astype(shard.aux.dtype)}).to_bytes())
        with pytest.raises(DataError, match=f"{a}: aux at token 5 is ({why})"):
            first_batch()
    rewrite(a, Shard(**{**shard.__dict__, "aux": np.asarray(shard.aux).astype(np.float32)}).to_bytes())
    with pytest.raises(DataError, match="'aux' is float32.*the run spec says BF16"):
        first_batch()
    assert shard.aux.dtype == ml_dtypes.bfloat16
    rewrite(a, originals[a][: len(originals[a]) // 2])
    with pytest.raises(DataError, match=f"hidden shard {a}: not a readable shard"):
        first_batch()


def test_a_nan_in_an_fp8_shard_is_refused_by_name(fs_store, small_run):
    """fp8 states are checked in their bytes (e4m3fn's only bad value is NaN, 0x7F/0xFF): one NaN
    byte in one shard is refused with the shard, the tensor and the token named; the same shard
    intact trains."""
    import hashlib

    from aerie.contracts import ShardRecord
    from aerie_trainer.data import DataError, ShardCache
    from tests.runs import quantize_run

    upload_run(fs_store, small_run, "r1")
    quantize_run(fs_store, "r1", "r8")

    def open_all():
        data = make_data(fs_store, ["r8"], holdout_fraction=0.0)
        cache = ShardCache(fs_store, data.expect)
        try:
            for s in data.shards:
                cache.get(s.key)
        finally:
            cache.close()
        return data

    key = open_all().shards[0].key  # intact: every shard passes
    shard = Shard.from_buffer(fs_store.get_bytes(key))
    for tensor in ("aux", "final"):
        q = np.array(getattr(shard, tensor))
        q.view(np.uint8).reshape(q.shape[0], -1)[3, 5] = 0xFF  # -NaN in e4m3fn
        raw = Shard(**{**shard.__dict__, tensor: q}).to_bytes()
        fs_store.put_bytes(key, raw)
        rec_key = layout.shard_record("r8", "hidden", key.rsplit("/", 1)[-1].removesuffix(".safetensors"))
        rec = fs_store.get_json(rec_key, ShardRecord)
        fs_store.put_json(rec_key, rec.model_copy(update={"sha256": hashlib.sha256(raw).hexdigest()}))
        with pytest.raises(DataError, match=f"{key}: {tensor} at token 3 is nan"):
            open_all()
        fs_store.put_bytes(key, shard.to_bytes())
        fs_store.put_json(rec_key, rec)
