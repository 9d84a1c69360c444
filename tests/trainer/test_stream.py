"""Streaming training's data: a job that starts on a run's first hidden shards and follows them.

The run (6 shards of 4 sequences, two of them held out) is copied into the store with only its
first shards extracted; the rest land while the job's producer waits for them. Epoch 0 takes the
shards in arrival order, SHUFFLE_WINDOW at a time; the step count, the split and every later epoch
are the ones a job on the complete run plans; the windows a checkpoint records rebuild epoch 0 on
resume; a late shard is checked (sha256) like every other before it is trained on.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from aerie import layout
from aerie.contracts import ShardRecord
from tests.runs import hidden_run_folder, upload_run


@pytest.fixture(scope="module")
def small_run(cache_dir, smollm2_path) -> Path:
    return hidden_run_folder(cache_dir, smollm2_path, records=24, max_tokens=96, shard_sequences=4)


def make_data(store, runs, stream: bool, **kw):
    from aerie_trainer.data import HiddenData, load_runs

    args = dict(batch_tokens=256, max_seq_tokens=96, ttt_steps=3, seed=0, holdout_fraction=0.3, prefetch=2) | kw
    return HiddenData(store, load_runs(store, runs, stream=stream), stream=stream, poll_s=0.05, **args)


def withhold(store, run: str, names: list[str]) -> dict[str, tuple[bytes, bytes]]:
    """Remove the hidden shards `names` (record and file) as if not extracted yet; -> their bytes."""
    kept = {}
    for name in names:
        rec, key = layout.shard_record(run, "hidden", name), layout.shard(run, "hidden", name)
        kept[name] = (store.get_bytes(rec), store.get_bytes(key))
        store.delete(rec)
        store.delete(key)
    return kept


def land(store, run: str, name: str, kept) -> None:
    """The shard extracted: its file, then its record (the extractor's order)."""
    store.put_bytes(layout.shard(run, "hidden", name), kept[name][1])
    store.put_bytes(layout.shard_record(run, "hidden", name), kept[name][0])


def test_a_streamed_epoch_follows_the_shards_as_they_arrive_and_ends_as_a_complete_job(fs_store, small_run):
    from aerie_trainer.data import SHUFFLE_WINDOW, ShardCache

    upload_run(fs_store, small_run, "r1")
    complete = make_data(fs_store, ["r1"], stream=False)
    names = [s.name for s in complete.shards]
    train_shards = sorted({s for s, _ in complete.train_items})
    assert len(names) == 6 and len(train_shards) == 4 == SHUFFLE_WINDOW
    # the shards of the first window but one, and every held-out shard, are still being extracted
    missing = [names[i] for i in train_shards[-1:]] + [names[i] for i in range(6) if i not in train_shards]
    kept = withhold(fs_store, "r1", missing)

    data = make_data(fs_store, ["r1"], stream=True)
    # planned from the token shards: the complete job's split and step count, before the shards exist
    assert [s.name for s in data.shards] == names and not data.arrived
    assert data.train_items == complete.train_items and data.holdout_items == complete.holdout_items
    assert len(data.epoch_plan(0)) == len(complete.epoch_plan(0))
    assert data.epoch_plan(1) == complete.epoch_plan(1)

    got, started = [], threading.Event()

    def consume():
        it = data.batches()
        try:
            for _ in range(len(complete.epoch_plan(0)) + len(complete.epoch_plan(1))):
                started.set()
                got.append(next(it))
        finally:
            it.close()

    reader = threading.Thread(target=consume)
    reader.start()
    time.sleep(1.0)
    assert started.is_set() and not got, "the first window is formed before its shards arrived"
    for name in missing:  # one at a time, in name order, as one extract worker lands them
        time.sleep(0.3)
        land(fs_store, "r1", name, kept)
    reader.join(60)
    assert not reader.is_alive() and data.refresh()
    windows = data.window_ids()
    assert windows == [[f"r1/{names[i]}" for i in train_shards]]
    # epoch 0 took every training sequence once; epoch 1 is the complete job's epoch 1
    assert sorted(it for b in data._stream0 for it in b) == sorted(complete.train_items)
    assert got[len(data._stream0) - 1][0] == (1, 0)  # the position after epoch 0's last batch
    cache = ShardCache(fs_store, complete.expect)
    try:
        later = [b.input_ids.tolist() for _, b in got[len(data._stream0) :]]
        assert later == [complete.load(cache, b).input_ids.tolist() for b in complete.epoch_plan(1)[: len(later)]]
    finally:
        cache.close()

    # a job resumed from a checkpoint that recorded the windows takes the same epoch 0
    resumed = make_data(fs_store, ["r1"], stream=True)
    resumed.restore_windows(windows)
    assert resumed._stream0 == data._stream0


def test_a_late_shard_is_checked_like_the_others(fs_store, small_run):
    """A shard that lands after the job started is verified (its record's sha256) before it is
    trained on, even when no shard had landed at the start: a corrupted late shard stops the job,
    naming it."""
    from aerie_trainer.data import DataError

    upload_run(fs_store, small_run, "r1")
    names = [s.name for s in make_data(fs_store, ["r1"], stream=True, holdout_fraction=0.0).shards]
    kept = withhold(fs_store, "r1", names)  # none extracted when the job starts
    data = make_data(fs_store, ["r1"], stream=True, holdout_fraction=0.0)
    assert not data.expect
    name = names[0]
    record, good = kept[name]
    kept[name] = (record, good[:-8] + b"\x00" * 8)  # the last bytes of its states zeroed
    for n in names:
        land(fs_store, "r1", n, kept)
    it = data.batches()
    try:
        with pytest.raises(DataError, match=rf"hidden shard runs/r1/hidden/{name}\.safetensors: sha256 .* differs"):
            next(it)
    finally:
        it.close()
    assert ShardRecord.model_validate_json(record).shard == name
