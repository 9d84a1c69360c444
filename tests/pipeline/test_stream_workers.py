"""Streaming training end to end: real Celery workers (extractor and trainer), real Redis, real S3.

A user enqueues a run with `--train-drafter d --stream`. The extractor worker lands the first
shards and is SIGKILLed; the training starts on them and checkpoints while the run still misses
shards; then the trainer worker is SIGKILLed too. Fresh workers take the redelivered tasks: the
run completes, the training resumes from its checkpoint (the epoch-0 windows it recorded) and
publishes once. The result equals a streamed job trained here on the complete run: the same
steps (the ones a non-streamed job plans), the same epoch-0 windows and equal weights.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal

import pytest
import torch
from safetensors.torch import load as st_load

from aerie import controller, drafters, layout
from aerie.runs import shard_names
from aerie.settings import Settings
from tests.conftest import POINTS
from tests.runs import sharegpt_conversations
from tests.services import store_env, wait_until
from tests.workers import ExtractorWorker, TrainerWorker, celery_cli, worker_env

pytestmark = pytest.mark.slow

CONFIG = {
    "draft_vocab_size": 512,
    "draft_vocab_from": "data",  # counted on the token shards: the same vocabulary whenever the job starts
    "ttt_steps": 2,
    "batch_tokens": 192,
    "max_seq_tokens": 96,
    "epochs": 2,
    "warmup_steps": 2,
    "checkpoint_every": 2,
    "holdout_fraction": 0.05,  # split by sequence: every shard holds training sequences
    "eval_prompts": 1,
    "eval_new_tokens": 4,
}


def test_a_streamed_job_starts_before_extraction_ends_survives_sigkills_and_equals_the_complete_one(
    s3_store, private_redis, smollm2_path, workers, tmp_path
):
    from aerie.stages import train as run_train
    from aerie_trainer.data import HiddenData, load_runs

    dataset = tmp_path / "chats.jsonl"
    with open(dataset, "w") as f:
        for conv in sharegpt_conversations(24):
            turns = [{**t, "value": t["value"][:200]} if t.get("from") == "human" else t for t in conv]
            f.write(json.dumps({"conversations": turns}) + "\n")
    # short visibility timeout: a killed worker's task goes to another after 6 s
    env = worker_env(s3_store, private_redis, AERIE_BROKER_VISIBILITY_TIMEOUT_S="6")
    extractor, trainer = ExtractorWorker(env, "ext1", tmp_path), TrainerWorker(env, "tr1", tmp_path)
    workers += [extractor, trainer]
    extractor.wait_for(r"ready\.", 120)
    trainer.wait_for(r"ready\.", 120)
    celery_cli(
        env,
        "enqueue",
        "--dataset",
        str(dataset),
        "--run",
        "streamed",
        "--model",
        str(smollm2_path),
        "--capture-points",
        ",".join(map(str, POINTS)),
        "--dtype",
        "float32",
        "--max-tokens",
        "96",
        "--shard-tokens",
        "384",
        "--train-drafter",
        "d",
        "--stream",
        "--train-config",
        json.dumps(CONFIG),
    )
    hidden = lambda: shard_names(s3_store, "streamed", "hidden")  # noqa: E731
    # 1. the extractor dies once the first window's shards (SHUFFLE_WINDOW = 4) have landed
    wait_until(lambda: len(hidden()) >= 4, 400, "4 hidden shards", poll=0.1, details=lambda: extractor.log()[-3000:])
    os.killpg(extractor.proc.pid, signal.SIGKILL)
    extractor.proc.wait(10)
    names = shard_names(s3_store, "streamed", "tokens")
    landed = hidden()
    assert len(names) == 6 and len(landed) < 6
    (planned,) = controller.planned_trainings(s3_store, "streamed")
    request = planned.train
    assert planned.start == "first_shards" and request.config.stream
    train_id = request.resolved_train_id
    latest = layout.checkpoint_latest(train_id)

    def checkpoint() -> int:
        return json.loads(s3_store.get_bytes(latest))["step"] if s3_store.exists(latest) else 0

    # 2. training started on the shards there are, and checkpoints while the run still misses some
    wait_until(lambda: checkpoint() >= 2, 400, "the first checkpoint", poll=0.2, details=lambda: trainer.log()[-3000:])
    assert hidden() == landed, "no extractor was alive: the run still misses shards"
    os.killpg(trainer.proc.pid, signal.SIGKILL)
    trainer.proc.wait(10)
    killed_at = checkpoint()

    # 3. fresh workers: the redelivered extract completes the run, the training resumes and publishes
    workers += [ExtractorWorker(env, "ext2", tmp_path), TrainerWorker(env, "tr2", tmp_path)]
    wait_until(
        lambda: drafters.published_lineage(s3_store, "d", request.version) is not None,
        600,
        "the streamed drafter published",
        poll=1,
        details=lambda: "\n".join(w.log()[-2000:] for w in workers[2:]),
    )
    assert hidden() == names
    done = workers[3].wait_for(r"Task aerie\.train\[[0-9a-f-]+\] succeeded in [^\n]*", 120).group(0)
    assert re.search(rf"resumed_from.{{0,4}}{killed_at}\b", done), done
    lineage = drafters.published_lineage(s3_store, "d", request.version)
    streamed = json.loads(s3_store.get_bytes(json.loads(s3_store.get_bytes(latest))["prefix"] + "trainer.json"))

    # the step count a non-streamed job on the complete run plans
    cfg = request.config
    sequential = HiddenData(
        s3_store,
        load_runs(s3_store, ["streamed"]),
        batch_tokens=cfg.batch_tokens,
        max_seq_tokens=cfg.max_seq_tokens,
        ttt_steps=cfg.ttt_steps,
        seed=cfg.seed,
        holdout_fraction=cfg.holdout_fraction,
    )
    steps = math.ceil(cfg.epochs * len(sequential.epoch_plan(0)))
    assert lineage.metrics["steps"] == streamed["step"] == steps
    # epoch 0 in arrival order: the first window the 4 shards there were, the rest once all had landed
    assert streamed["stream_windows"] == [[f"streamed/{n}" for n in names[:4]], [f"streamed/{n}" for n in names[4:]]]

    # 4. the same streamed job on the complete run, here (one thread, as the workers): equal weights
    reference = request.model_copy(update={"train_id": "reference", "publish": False})
    settings = Settings(
        store=s3_store.endpoint,
        bucket=s3_store.bucket,
        s3_access_key=store_env(s3_store)["AERIE_S3_ACCESS_KEY"],
        s3_secret_key=store_env(s3_store)["AERIE_S3_SECRET_KEY"],
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_train(s3_store, settings, reference)
    finally:
        torch.set_num_threads(threads)
    ref_latest = json.loads(s3_store.get_bytes(layout.checkpoint_latest("reference")))["prefix"]
    ref_state = json.loads(s3_store.get_bytes(ref_latest + "trainer.json"))
    assert ref_state["step"] == steps and ref_state["stream_windows"] == streamed["stream_windows"]
    ours = st_load(s3_store.get_bytes(json.loads(s3_store.get_bytes(latest))["prefix"] + "model.safetensors"))
    theirs = st_load(s3_store.get_bytes(ref_latest + "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0, msg=name)
