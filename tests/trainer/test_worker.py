"""The trainer service: a real `celery worker` on queue `train`, real Redis, real S3.

A user enqueues `aerie.train`; the worker is SIGKILLed after its first checkpoint; Redis hands
the task to a fresh worker, which resumes from the checkpoint, finishes and publishes the
drafter once. The same request through `aerie train` then finds it published.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from aerie import layout
from aerie.contracts import TrainConfig, TrainRequest
from aerie.queue import TRAIN_TASK, make_app
from aerie.settings import Settings

from aerie_trainer.trainer import default_train_id
from tests.runs import hidden_run_folder, upload_run
from tests.services import REPO, clean_env, store_env, wait_until
from tests.workers import TrainerWorker as Worker

pytestmark = pytest.mark.slow


def test_sigkilled_worker_resumes_and_publishes_once(s3_store, redis_url, cache_dir, smollm2_path, workers, tmp_path):
    folder = hidden_run_folder(cache_dir, smollm2_path, records=160, max_tokens=192, shard_sequences=16)
    upload_run(s3_store, folder, "sharegpt")
    cfg = TrainConfig(draft_vocab_size=2048, ttt_steps=2, steps=30, batch_tokens=256, max_seq_tokens=128, warmup_steps=4,
                      checkpoint_every=10, eval_prompts=1, eval_new_tokens=8, holdout_fraction=0.1)
    request = TrainRequest(runs=["sharegpt"], drafter="killed", model=str(smollm2_path), config=cfg)
    latest = layout.checkpoint_latest(default_train_id(request))
    # a short visibility timeout: Redis hands a lost worker's unacknowledged task on after 5 s
    env = clean_env(**store_env(s3_store), AERIE_BROKER=redis_url, AERIE_BROKER_VISIBILITY_TIMEOUT_S="5", OMP_NUM_THREADS="1")

    victim = Worker(env, "victim", tmp_path)
    workers.append(victim)
    victim.wait_for(r"ready\.", 120)
    client = make_app(Settings(broker=redis_url, store=s3_store.endpoint, bucket=s3_store.bucket,
                                    s3_access_key=env["AERIE_S3_ACCESS_KEY"], s3_secret_key=env["AERIE_S3_SECRET_KEY"]))
    result = client.send_task(TRAIN_TASK, kwargs=request.model_dump(mode="json"))

    def checkpointed() -> bool:  # the first checkpoint is in the store
        assert victim.proc.poll() is None, victim.log()[-3000:]
        return s3_store.exists(latest)

    wait_until(checkpointed, 600, "the victim's first checkpoint", poll=0.5, details=lambda: victim.log()[-3000:])
    victim.kill()
    killed_at = json.loads(s3_store.get_bytes(latest))["step"]
    assert 10 <= killed_at < 30
    assert not s3_store.list("drafters/killed/")

    rescuer = Worker(env, "rescuer", tmp_path)
    workers.append(rescuer)
    summary = result.get(timeout=900)
    assert summary["resumed_from"] == killed_at and summary["steps"] == 30
    # the worker logs success just after it stores the result the client has read: wait for the line
    rescuer.wait_for(re.escape(f"Task {TRAIN_TASK}[{result.id}] succeeded"), 60)
    versions = {k.split("/")[2] for k in s3_store.list("drafters/killed/") if k.count("/") == 3}
    assert versions == {summary["version"]}

    # the same request through the CLI: found published, nothing trained or published again
    out = subprocess.run([sys.executable, "-m", "aerie.cli", "train", "--runs", "sharegpt", "--drafter", "killed",
                          "--model", str(smollm2_path), "--config", cfg.model_dump_json()],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "already published" in out.stdout
    assert {k.split("/")[2] for k in s3_store.list("drafters/killed/") if k.count("/") == 3} == versions
