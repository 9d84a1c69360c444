"""Real Celery workers of each service for the tests, and the ways tests talk to them.

- `ExtractorWorker` / `TrainerWorker`: one `celery -A <app> worker` process each (tests.services).
- `worker_env(store, redis_url)`: the AERIE_* variables a worker needs for this store and broker.
- `celery_cli(env, ...)`: the Celery command line on the extractor's app, as a user runs it.
- `wait_complete(store, run, workers, timeout)`: `aerie.runs.wait_for_run` with the workers' logs
  and the broker's state in the failure message.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from aerie.contracts import RunStatus
from aerie.runs import RunError, run_status, wait_for_run
from tests.services import CeleryWorker, clean_env, store_env

CELERY = str(Path(sys.executable).with_name("celery"))
EXTRACTOR_APP = "aerie_extractor.worker"


class ExtractorWorker(CeleryWorker):
    app, queues = EXTRACTOR_APP, "ingest,extract"


class TrainerWorker(CeleryWorker):
    app, queues = "aerie_trainer.worker", "train"


def worker_env(store, redis_url: str, **extra: str) -> dict[str, str]:
    return clean_env(
        **store_env(store),
        AERIE_BROKER=redis_url,
        AERIE_ENGINE="hf",
        OMP_NUM_THREADS="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        **extra,
    )


def celery_cli(env: dict[str, str], *args: str, timeout: float = 120) -> str:
    out = subprocess.run([CELERY, "-A", EXTRACTOR_APP, *args], env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"celery {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}"
    return out.stdout


def broker_state(redis_url: str) -> str:
    client = redis.Redis.from_url(redis_url)
    try:
        queues = {q: client.llen(q) for q in ("ingest", "extract", "train")}
        unacked = [json.loads(v)[0]["headers"]["id"] for v in client.hvals("unacked")]
        return f"queues {queues}, unacked {unacked}, keys {sorted(k.decode() for k in client.keys('*') if b'celery-task-meta' not in k)}"
    finally:
        client.close()


def wait_complete(store, run: str, workers: list[CeleryWorker], timeout: float, redis_url: str = "") -> RunStatus:
    try:
        return wait_for_run(store, run, timeout_s=timeout, poll_s=1.0)
    except RunError as e:
        state = broker_state(redis_url) if redis_url else ""
        pytest.fail(f"{e}\n{run_status(store, run)}\n{state}\n" + "\n".join(w.log()[-3000:] for w in workers))
