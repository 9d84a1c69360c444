"""The worker flags compose and `aerie stack` share (aerie.app.stack.WORKER_FLAGS), on real workers.

A solo worker busy with a long task reads the heartbeats another worker sent meanwhile only once
the task ends; with gossip on (Celery's default) it then warns "Substantial drift from ... may mean
clocks are out of sync" (seen after a 125 s training task on one host). With the shared flags it
does not, and it still logs the task's lines (log level INFO).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aerie.app import stack
from tests.services import REPO, clean_env

HOLD_APP = "tests.deploy.alive_app"
HOLD_S = 22  # above Celery's HEARTBEAT_DRIFT_MAX (16 s)
CELERY = str(Path(sys.executable).with_name("celery"))


def worker(env, name: str, queue: str, flags: list[str], log: Path) -> subprocess.Popen:
    argv = [CELERY, "-A", HOLD_APP, "worker", "-Q", queue, "--pool", "solo", "-n", f"{name}@%h", *flags]
    return subprocess.Popen(
        argv, env=env, cwd=REPO, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True
    )


@pytest.mark.timeout(240)
def test_the_shared_worker_flags_log_tasks_and_silence_the_drift_warning_after_a_long_task(tmp_path):
    pairs, servers, procs = {}, [], []
    try:
        for kind, flags in (("gossip", ["--loglevel", "INFO"]), ("shared", stack.WORKER_FLAGS)):
            base, redis = stack.start_redis(tmp_path / kind)
            servers.append(redis)
            env = clean_env(AERIE_BROKER=f"{base}/0", AERIE_RESULT_BACKEND=f"{base}/1")
            logs = (tmp_path / f"{kind}-busy.log", tmp_path / f"{kind}-idle.log")
            procs += [worker(env, "busy", "hold", flags, logs[0]), worker(env, "idle", "other", flags, logs[1])]
            pairs[kind] = (env, logs[0])
        deadline = time.monotonic() + 120
        while not all(" ready." in log.read_text() for _, log in pairs.values()):
            assert time.monotonic() < deadline, {k: log.read_text()[-1500:] for k, (_, log) in pairs.items()}
            assert all(p.poll() is None for p in procs)
            time.sleep(0.5)
        time.sleep(3)  # the idle workers' first heartbeats
        for env, _ in pairs.values():
            call = [CELERY, "-A", HOLD_APP, "call", "tests.hold", "--args", f"[{HOLD_S}]", "--queue", "hold"]
            subprocess.run(call, env=env, cwd=REPO, check=True, capture_output=True, timeout=60)
        done = re.compile(r"Task tests\.hold\[[0-9a-f-]+\] succeeded")
        deadline = time.monotonic() + HOLD_S + 90
        while not all(done.search(log.read_text()) for _, log in pairs.values()):
            assert time.monotonic() < deadline, {k: log.read_text()[-1500:] for k, (_, log) in pairs.items()}
            time.sleep(0.5)
        deadline = time.monotonic() + 20  # the buffered heartbeats are read at once after the task
        while "Substantial drift" not in pairs["gossip"][1].read_text() and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(2)
        gossip, shared = (log.read_text() for _, log in pairs.values())
        assert "Substantial drift" in gossip, f"the control (gossip on) did not warn:\n{gossip[-2000:]}"
        assert "Substantial drift" not in shared, shared[-2000:]
        assert re.search(r"Task tests\.hold\[[0-9a-f-]+\] received", shared), shared[-2000:]
    finally:
        for p in procs:
            stack.stop_group(p.pid, 30, p)
        for s in servers:
            s.stop()
