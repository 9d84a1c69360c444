"""The extractor's Celery sub-commands as a user meets them when something is wrong: one line
naming the cause and the setting to fix, a non-zero exit, the traceback only with --debug; and
`enqueue` writes nothing until everything it needs has been checked.

Real parts: the `celery` command line in a subprocess, a real Redis (or a port where none
listens), a real S3 server with wrong keys or none at all.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from aerie import layout
from tests.services import clean_env, free_port, store_env

CELERY = str(Path(sys.executable).with_name("celery"))
APP = "aerie_extractor.worker"


def celery(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CELERY, "-A", APP, *args], env=env, capture_output=True, text=True, timeout=180)


def one_line(out: subprocess.CompletedProcess, *names: str) -> str:
    """The failure's message: exit non-zero, stderr one line naming each of `names`, no traceback."""
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode != 0, out.stdout + out.stderr
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


def enqueue_args(dataset, run: str = "r1", model: str = "/models/target") -> list[str]:
    return ["enqueue", "--dataset", str(dataset), "--run", run, "--model", model]


@pytest.fixture
def chat(tmp_path) -> Path:
    path = tmp_path / "chat.jsonl"
    path.write_text(
        json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}) + "\n"
    )
    return path


def down() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"


def test_cli_failures_are_one_line_broker_down(fs_store, chat):
    """2026-12-02: 150 lines of traceback ending in 'Retry limit exceeded ... result store' after
    20 s, not naming AERIE_BROKER; and the dataset was uploaded first (an orphan)."""
    out = celery(clean_env(**store_env(fs_store), AERIE_BROKER=down()), *enqueue_args(chat))
    one_line(out, "unreachable", "AERIE_BROKER")
    assert fs_store.list("") == [], "nothing uploaded while the broker is down"


def test_cli_failures_are_one_line_wrong_s3_keys(s3_store, redis_url, chat):
    env = clean_env(**{**store_env(s3_store), "AERIE_S3_SECRET_KEY": "wrong"}, AERIE_BROKER=redis_url)
    one_line(celery(env, *enqueue_args(chat)), "refused the credentials", "AERIE_S3_SECRET_KEY")


def test_cli_failures_are_one_line_s3_unreachable(redis_url):
    env = clean_env(
        AERIE_STORE=f"http://127.0.0.1:{free_port()}",
        AERIE_S3_ACCESS_KEY="k",
        AERIE_S3_SECRET_KEY="s",
        AERIE_BROKER=redis_url,
    )
    one_line(celery(env, "progress", "--run", "r1"), "unreachable", "AERIE_STORE")


def test_cli_failures_are_one_line_bad_dataset_and_refused_name(fs_store, redis_url, chat):
    env = clean_env(**store_env(fs_store), AERIE_BROKER=redis_url)
    one_line(celery(env, *enqueue_args("chta.jsonl")), "chta.jsonl", "neither a file here nor an object")
    one_line(celery(env, *enqueue_args("./chta.jsonl")), "no such file")
    one_line(celery(env, *enqueue_args(chat, run="my run")), "run", "pattern")
    assert fs_store.list("") == [], "nothing uploaded for a request that was refused"
    assert redis.Redis.from_url(redis_url).llen("ingest") == 0, "nothing sent"


def test_cli_failures_are_one_line_unknown_setting():
    one_line(celery(clean_env(AERIE_BROKR="redis://x"), "progress", "--run", "r1"), "unknown setting", "AERIE_BROKR")


def test_cli_failures_show_the_traceback_with_debug(fs_store, chat):
    out = celery(clean_env(**store_env(fs_store), AERIE_BROKER=down()), *enqueue_args(chat), "--debug")
    assert out.returncode != 0 and "Traceback" in out.stderr and "AERIE_BROKER" in out.stderr, out.stderr


def test_enqueue_keys_uploads_by_content(fs_store, redis_url, tmp_path):
    """Two different files both named chat.jsonl: two objects, each message names its own (on
    2026-12-02's code both went to datasets/chat.jsonl, the second overwriting the first)."""
    env = clean_env(**store_env(fs_store), AERIE_BROKER=redis_url)
    files = []
    for i, answer in enumerate(["Hello.", "Goodbye."]):
        path = tmp_path / f"team{i}" / "chat.jsonl"
        path.parent.mkdir()
        path.write_text(
            json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": answer}]})
            + "\n"
        )
        files.append(path)
        out = celery(env, *enqueue_args(path, run=f"r{i}"))
        assert out.returncode == 0, out.stdout + out.stderr
    keys = [layout.dataset_upload(hashlib.sha256(p.read_bytes()).hexdigest(), "chat.jsonl") for p in files]
    assert keys[0] != keys[1] and sorted(fs_store.list("datasets/")) == sorted(keys)
    for path, key in zip(files, keys):
        assert fs_store.get_bytes(key) == path.read_bytes()
    client = redis.Redis.from_url(redis_url)
    import base64

    sent = [json.loads(base64.b64decode(json.loads(m)["body"]))[1]["dataset"] for m in client.lrange("ingest", 0, -1)]
    assert sorted(sent) == sorted(keys)
    # the same file again: the same object, nothing new
    assert celery(env, *enqueue_args(files[0], run="r2")).returncode == 0
    assert sorted(fs_store.list("datasets/")) == sorted(keys)
