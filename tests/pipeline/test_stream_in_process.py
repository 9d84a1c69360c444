"""`aerie run --stream` without a broker: the extraction and the training overlap in this process.

The embedded run (`aerie run --quick --stream`, a filesystem store) extracts its shards in a thread
while the training follows the ones stored. The run's last shard is held back (the real
extraction, started only once the training has written its first checkpoint, or after 240 s):
the training must have started and checkpointed while the run still missed that shard, which a
run that extracts everything before training never does. The result equals a job trained here on
the complete run: the steps a non-streamed job plans, the same epoch-0 windows, equal weights,
and the same figures before and after training (the same held-out prompts). A shard that fails under a streamed run stops it in one line; the same command again finishes it.
"""

from __future__ import annotations

import json
import math
import os
import time

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load as st_load

from aerie import controller, drafters, layout, stages
from aerie.runs import shard_names
from aerie.settings import Settings
from aerie.store import FsStore

pytestmark = pytest.mark.slow

TRAIN_CONFIG = {
    "draft_vocab_from": "data",  # counted on the token shards: the same vocabulary whenever the job starts
    "checkpoint_every": 2,
}


def aerie_run_stream(root, run: str, out):
    from aerie.app.cli import main

    args = ["run", "--quick", "--stream", "--run", run, "--drafter", "d", "--epochs", "2", "--store", f"file://{root}"]
    return CliRunner().invoke(main, [*args, "--out", str(out), "--train-config", json.dumps(TRAIN_CONFIG)])


def holding_the_last_shard(store, run: str, seen: dict, before=None):
    """The real extract stage, the run's last shard started only once the training has written its
    first checkpoint (240 s at most); `before(name)` then, if given. What was seen goes in `seen`."""
    real_extract = stages.extract

    def extract(store_, settings, request):
        names = shard_names(store, run, "tokens")
        if request.shard == names[-1] and "hidden" not in seen:
            (planned,) = controller.planned_trainings(store, run)
            latest = layout.checkpoint_latest(planned.train.resolved_train_id)
            deadline = time.monotonic() + 240
            while not store.exists(latest) and time.monotonic() < deadline:
                time.sleep(0.2)
            seen.update(
                checkpoint=json.loads(store.get_bytes(latest)) if store.exists(latest) else None,
                hidden=shard_names(store, run, "hidden"),
                tokens=names,
                threads=torch.get_num_threads(),
            )
            if before is not None:
                before(request.shard)
        return real_extract(store_, settings, request)

    return extract


def no_aerie_settings(monkeypatch, smollm2_path) -> None:
    for name in [k for k in os.environ if k.startswith("AERIE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AERIE_CACHE_DIR", str(smollm2_path.parent))


@pytest.mark.timeout(1200)
def test_aerie_run_stream_trains_while_it_extracts_and_equals_the_complete_job(tmp_path, smollm2_path, monkeypatch):
    from aerie_trainer.data import HiddenData, load_runs

    no_aerie_settings(monkeypatch, smollm2_path)
    root = tmp_path / "store"
    store = FsStore(root)
    run, seen = "chat", {}
    monkeypatch.setattr(stages, "extract", holding_the_last_shard(store, run, seen))
    out = aerie_run_stream(root, run, tmp_path / "drafter")
    assert out.exit_code == 0, out.output[-3000:] + repr(out.exception)
    assert "aerie run: summary" in out.output

    # the training had started and checkpointed while the last shard was not extracted yet
    assert seen["checkpoint"] is not None, f"no checkpoint within 240 s of holding the last shard: {seen}"
    assert seen["checkpoint"]["step"] >= 2 and seen["hidden"] == seen["tokens"][:-1], seen
    assert shard_names(store, run, "hidden") == seen["tokens"]

    (planned,) = controller.planned_trainings(store, run)
    request = planned.train
    assert planned.start == "first_shards" and request.config.stream
    lineage = drafters.published_lineage(store, "d", request.version)
    assert lineage is not None
    latest = json.loads(store.get_bytes(layout.checkpoint_latest(request.resolved_train_id)))["prefix"]
    streamed = json.loads(store.get_bytes(latest + "trainer.json"))

    # the steps a non-streamed job on the complete run plans
    cfg = request.config
    sequential = HiddenData(
        store,
        load_runs(store, [run]),
        batch_tokens=cfg.batch_tokens,
        max_seq_tokens=cfg.max_seq_tokens,
        ttt_steps=cfg.ttt_steps,
        seed=cfg.seed,
        holdout_fraction=cfg.holdout_fraction,
    )
    steps = math.ceil(cfg.epochs * len(sequential.epoch_plan(0)))
    assert lineage.metrics["steps"] == streamed["step"] == steps

    # the same streamed job on the complete run, here, with the run's torch threads: equal weights
    reference = request.model_copy(update={"train_id": "reference", "publish": False})
    threads = torch.get_num_threads()
    torch.set_num_threads(seen["threads"])
    try:
        ref = stages.train(store, Settings(store=f"file://{root}"), reference)
    finally:
        torch.set_num_threads(threads)
    # measured as a job on the complete run measures: the same held-out prompts and batches, before
    # and after (the streamed job measures its starting weights once the run is complete)
    m = lineage.metrics
    assert m["eval_prompts"] == 4 and m["acceptance_untrained"] is not None and m["acceptance"] is not None, m
    for key in ("acceptance", "simulated_acceptance"):
        assert m[key] == getattr(ref, key) and m[f"{key}_untrained"] == getattr(ref, f"{key}_untrained"), key
    assert m["heldout_loss"] == ref.heldout_loss
    ref_latest = json.loads(store.get_bytes(layout.checkpoint_latest("reference")))["prefix"]
    ref_state = json.loads(store.get_bytes(ref_latest + "trainer.json"))
    assert ref_state["step"] == steps and ref_state["stream_windows"] == streamed["stream_windows"]
    ours = st_load(store.get_bytes(latest + "model.safetensors"))
    theirs = st_load(store.get_bytes(ref_latest + "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0, msg=name)


@pytest.mark.timeout(1200)
def test_a_shard_that_fails_under_a_streamed_run_stops_it_in_one_line_and_a_rerun_finishes(
    tmp_path, smollm2_path, monkeypatch
):
    """The last shard's token file is damaged once the training has checkpointed: its real
    extraction fails, the failure is recorded, the training that waits for the shard stops, and
    the run ends in one line naming the shard's error. The same command again, the file restored,
    retries the shard, resumes the training from its checkpoint and publishes."""
    no_aerie_settings(monkeypatch, smollm2_path)
    root = tmp_path / "store"
    store = FsStore(root)
    run, seen, kept = "chat", {}, {}

    def damage(name: str) -> None:
        key = layout.shard(run, "tokens", name)
        kept[key] = store.get_bytes(key)
        store.put_bytes(key, kept[key][:-8] + b"\x00" * 8)

    monkeypatch.setattr(stages, "extract", holding_the_last_shard(store, run, seen, before=damage))
    out = aerie_run_stream(root, run, tmp_path / "drafter")
    assert out.exit_code == 1, out.output[-3000:] + repr(out.exception)
    assert seen["checkpoint"] is not None and seen["hidden"] == seen["tokens"][:-1], seen
    last = seen["tokens"][-1]
    error = out.output.strip().splitlines()[-1]
    assert error.startswith("Error: ") and "does not match its record's sha256" in error, out.output[-3000:]
    assert f"tokens/{last}" in error and "Traceback" not in out.output
    assert store.exists(layout.shard_failure(run, last)) and not store.exists(layout.shard_record(run, "hidden", last))
    (planned,) = controller.planned_trainings(store, run)
    request = planned.train
    assert drafters.published_lineage(store, "d", request.version) is None
    checkpoint = json.loads(store.get_bytes(layout.checkpoint_latest(request.resolved_train_id)))["step"]
    assert checkpoint >= 2

    ((key, good),) = kept.items()
    store.put_bytes(key, good)
    again = aerie_run_stream(root, run, tmp_path / "drafter")
    assert again.exit_code == 0, again.output[-3000:] + repr(again.exception)
    assert shard_names(store, run, "hidden") == seen["tokens"] and not store.exists(layout.shard_failure(run, last))
    lineage = drafters.published_lineage(store, "d", request.version)
    assert lineage is not None
    state = json.loads(
        store.get_bytes(
            json.loads(store.get_bytes(layout.checkpoint_latest(request.resolved_train_id)))["prefix"] + "trainer.json"
        )
    )
    assert lineage.metrics["steps"] == state["step"] > checkpoint
