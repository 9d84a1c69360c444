"""The operator's commands against real servers (S3, Redis, a Celery worker): `aerie prepare-store`
creates what `enqueue` needs, `aerie smoke` checks a fresh deployment, `aerie retry-failed` re-runs
the shards of a run that gave up once the cause is fixed (issue 20, items 3, 11, 12)."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from aerie import layout
from aerie.app.ops import smoke_dataset
from aerie.runs import failures, shard_names
from aerie.store import S3Store
from tests.deploy.servers import linked_copy
from tests.services import clean_env, store_env, wait_until
from tests.workers import ExtractorWorker, celery_cli, wait_complete, worker_env

AERIE = str(Path(sys.executable).with_name("aerie"))


def aerie(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([AERIE, *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_prepare_store_creates_the_bucket_enqueue_needs_and_checks_the_key(s3_server, tmp_path):
    bucket = "prep-" + secrets.token_hex(4)
    store = S3Store(s3_server.endpoint, bucket, s3_server.access_key, s3_server.secret_key)
    env = clean_env(**store_env(store))
    refused = aerie(env, "smoke", "--model", "/models/target")  # nothing prepared yet: the message names the fix
    assert refused.returncode == 1
    assert f"bucket {bucket!r} does not exist" in refused.stderr and "aerie prepare-store" in refused.stderr
    first = aerie(env, "prepare-store")
    assert first.returncode == 0, first.stderr
    assert f"store {s3_server.endpoint}/{bucket}: ready; this key may write, read, list and delete" in first.stdout
    assert store.client.bucket_exists(bucket) and store.list("") == [], "the probe object is gone again"
    assert aerie(env, "prepare-store").returncode == 0, "idempotent"
    wrong = aerie({**env, "AERIE_S3_SECRET_KEY": "wrong"}, "prepare-store")
    assert wrong.returncode == 1 and len(wrong.stderr.strip().splitlines()) == 1
    assert "refused the credentials" in wrong.stderr and "AERIE_S3_SECRET_KEY" in wrong.stderr
    local = aerie(clean_env(AERIE_STORE=f"file://{tmp_path / 'store'}"), "prepare-store")
    assert local.returncode == 0 and (tmp_path / "store").is_dir()
    store.client.remove_bucket(bucket)


@pytest.mark.slow
def test_smoke_then_a_failed_run_retried_after_the_cause_is_fixed(s3_store, redis_url, smollm2_path, tmp_path, workers):
    model = linked_copy(smollm2_path, tmp_path / "model")
    env = worker_env(s3_store, redis_url, AERIE_CACHE_DIR=str(tmp_path / "cache"))
    workers.append(ExtractorWorker(env, "ops", tmp_path))

    smoke = aerie(env, "smoke", "--model", str(model), "--timeout", "300")
    assert smoke.returncode == 0, smoke.stderr + workers[0].log()[-3000:]
    assert "smoke: ok in" in smoke.stdout and "10 sequences" in smoke.stdout and "0 rejects" in smoke.stdout
    assert not [k for k in s3_store.list("") if "smoke-" in k], "the smoke run is removed after success"

    # a run whose extraction gives up: the model folder is gone when its shards are extracted
    s3_store.put_bytes(layout.dataset("chat"), smoke_dataset())
    # ingest only: the shards are extracted by hand below
    celery_cli(
        env, "enqueue", "--dataset", "datasets/chat.jsonl", "--run", "r1", "--model", str(model),
        "--shard-tokens", "64", "--no-fan-out",
    )  # fmt: skip
    shards = wait_until(
        lambda: shard_names(s3_store, "r1", "tokens") if s3_store.exists(layout.run_spec("r1")) else None,
        120,
        "ingest of r1",
    )
    model.rename(tmp_path / "model-away")
    for shard in shards:
        celery_cli(env, "call", "aerie.extract", "--kwargs", json.dumps({"run": "r1", "shard": shard}))
    wait_until(
        lambda: len(failures(s3_store, "r1")) == len(shards),
        120,
        "the shards' failure records",
        details=lambda: workers[0].log()[-2000:],
    )

    (tmp_path / "model-away").rename(model)  # the cause, fixed
    retried = aerie(env, "retry-failed", "--run", "r1")
    assert retried.returncode == 0, retried.stderr
    assert f"run r1: re-enqueued {len(shards)} failed shard(s)" in retried.stdout
    status = wait_complete(s3_store, "r1", workers, 180)
    assert status.failed == 0 and status.hidden_done == len(shards)
    assert aerie(env, "retry-failed", "--run", "r1").stdout.strip() == "run r1: no failed shard"
