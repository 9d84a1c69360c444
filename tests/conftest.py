"""Shared fixtures: real servers, both store backends, the small real target.

- S3: the server the test command started (AERIE_TEST_S3_* variables), else one started here.
- Redis: 127.0.0.1:6379 (the test command starts one if none answers), a private db per test
  (a share of the 15 per test process).
- Every test that touches a store gets a fresh bucket or folder.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

from tests.services import S3Server, start_redis, start_s3

POINTS = [2, 15, 27]  # SmolLM2-135M (N = 30): the default capture points [2, N//2, N-3]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """On pytest-xdist's workers (scripts/test.sh: --dist loadgroup), a test file is a unit of work
    (its module-scoped servers start once), except that every file with SGLang tests is one unit:
    each SGLang server takes 3-4 GB and a file may hold three at once, so those files run one after
    another, on one worker, while the other runs the rest (two workers both in SGLang files ran
    the 24 GB machine out of memory). The SGLang unit and the files with slow tests come first,
    so that the last to finish are short."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    sglang_files = {item.path for item in items if item.get_closest_marker("sglang")}
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.path, i)
        group = "sglang" if item.path in sglang_files else str(item.path.relative_to(config.rootpath))
        item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: (item.path not in sglang_files, item.path not in slow_files, first[item.path]))


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> S3Server:
    if os.environ.get("AERIE_TEST_S3_ENDPOINT"):
        yield S3Server(
            os.environ["AERIE_TEST_S3_ENDPOINT"],
            os.environ["AERIE_TEST_S3_ACCESS_KEY"],
            os.environ["AERIE_TEST_S3_SECRET_KEY"],
        )
        return
    server = start_s3(tmp_path_factory.mktemp("weed"))
    yield server
    server.stop()


@pytest.fixture
def s3_store(s3_server):
    from aerie.store import S3Store

    bucket = "t-" + secrets.token_hex(6)
    store = S3Store(s3_server.endpoint, bucket, s3_server.access_key, s3_server.secret_key)
    store.ensure_bucket()
    yield store
    try:
        store.delete_prefix("")
        store.client.remove_bucket(bucket)
    except Exception:
        pass


@pytest.fixture
def fs_store(tmp_path):
    from aerie.store import FsStore

    return FsStore(tmp_path / "store")


@pytest.fixture(params=["fs", "s3"])
def store(request):
    return request.getfixturevalue(f"{request.param}_store")


def _redis_dbs() -> list[int]:
    """Databases 1-15 split among the test processes (pytest-xdist's workers gw0, gw1, ...): no
    two processes ever share one; a process that used all of its share reuses its last."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    index, share = int(worker.removeprefix("gw")), 15 // count
    if share == 0:
        raise pytest.UsageError(f"{count} test processes share Redis' 15 databases: run at most 15 (-n)")
    return list(range(1 + index * share, 1 + (index + 1) * share))


_redis_db_share = _redis_dbs()
_redis_db = iter(_redis_db_share)


@pytest.fixture
def redis_url():
    """A private, flushed Redis database on the local server."""
    import redis

    host = os.environ.get("AERIE_TEST_REDIS", "redis://127.0.0.1:6379")
    db = next(_redis_db, None) or _redis_db_share[-1]
    url = f"{host}/{db}"
    client = redis.Redis.from_url(url)
    try:
        client.ping()
    except redis.exceptions.ConnectionError:
        pytest.fail(f"no Redis at {host}: the test command (scripts/test.sh) starts one")
    client.flushdb()
    yield url
    client.flushdb()
    client.close()


@pytest.fixture
def private_redis(tmp_path):
    """A redis-server of this test's own: worker processes of other test sessions can never share
    its queues (tests that kill workers and count redeliveries use it)."""
    url, proc = start_redis(tmp_path)
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    return Path(os.environ.get("AERIE_TEST_CACHE", os.path.expanduser("~/.cache/aerie")))


@pytest.fixture(scope="session")
def smollm2_path(cache_dir) -> Path:
    from aerie.target import smollm2

    return smollm2(cache_dir)


@pytest.fixture
def workers():
    """Celery worker processes a test starts (tests.services.CeleryWorker): stopped after it."""
    started: list = []
    yield started
    for w in started:
        w.stop()


@pytest.fixture(scope="session")
def trained_smol(cache_dir, smollm2_path):
    """The one small trained drafter the trainer and serving tests share (tests/trained.py)."""
    from tests.trained import trained_drafter

    return trained_drafter(cache_dir, smollm2_path)


@pytest.fixture(scope="session")
def deepseek_tiny(cache_dir, smollm2_path) -> Path:
    """The tiny random DeepSeek-V3 target (MLA, MoE, YaRN; tests/targets.py), built once and cached."""
    from tests.targets import deepseek_v3_tiny

    return deepseek_v3_tiny(cache_dir, smollm2_path)


@pytest.fixture(scope="session")
def deepseek_llama_drafter(deepseek_tiny, cache_dir, tmp_path_factory):
    """The Llama-layer drafter trained on the tiny DeepSeek-V3's states (tests/trained.py), shared
    by its serving test and the MLA drafter's side by side. -> (pulled folder, TrainResult)"""
    from tests.trained import deepseek_drafter

    return deepseek_drafter(cache_dir, deepseek_tiny, tmp_path_factory.mktemp("deepseek-llama"), "llama")


@pytest.fixture(scope="session")
def reference(smollm2_path):
    """SmolLM2 in transformers, float32: token ids -> (hidden_states[POINTS] [T,K,H],
    hidden_states[N] (the final state) [T,H], logits [T,V]) — what every engine must reproduce."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()

    def forward(ids):
        with torch.inference_mode():
            out = model(torch.tensor(np.asarray(ids, dtype=np.int64))[None], output_hidden_states=True)
        hs = out.hidden_states
        return torch.stack([hs[p][0] for p in POINTS], dim=1), hs[len(hs) - 1][0], out.logits[0]

    return forward
