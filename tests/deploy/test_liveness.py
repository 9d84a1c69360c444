"""The trainer's liveness probe, as k8s/base/trainer.yaml runs it, against a real solo-pool worker
while a task runs: the probe must pass all along (a failing one restarts training), and fail once
the worker is gone."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml
from celery import Celery

from tests.services import clean_env

REPO = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).with_name("celery"))
HOLD_APP = "tests.deploy.alive_app"


def trainer_container() -> dict:
    deployment = yaml.safe_load((REPO / "k8s/base/trainer.yaml").read_text())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def probe(command: list[str], alive: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [part.replace("/tmp/aerie-alive", str(alive)) for part in command], capture_output=True, text=True, timeout=30
    )


def test_a_solo_trainer_worker_stays_live_while_its_task_runs_and_not_once_it_is_gone(private_redis, tmp_path):
    container = trainer_container()
    command, liveness = container["command"], container["livenessProbe"]["exec"]["command"]
    assert command[command.index("--pool") + 1] == "solo"
    alive = tmp_path / "alive"
    # the trainer's own options on the test app, touching every 0.5 s so that freshness shows in seconds
    args = command[command.index("worker") + 1 :]
    args = [a.replace("/tmp/aerie-alive", str(alive)) for a in args]
    args[args.index("--") : args.index("--")] = ["--alive-every", "0.5", "-n", "hold@%h", "--loglevel", "INFO"]
    env = clean_env(AERIE_BROKER=private_redis)
    worker = subprocess.Popen(
        [CELERY, "-A", HOLD_APP, "worker", *args],
        env=env,
        cwd=REPO,
        stdout=open(tmp_path / "worker.log", "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log = tmp_path / "worker.log"
    try:
        deadline = time.monotonic() + 60
        while not (alive.exists() and "ready" in log.read_text(errors="replace")):
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.2)
        client = Celery(broker=private_redis)
        client.send_task("tests.hold", kwargs={"seconds": 8}, queue="train")
        while "tests.hold" not in log.read_text(errors="replace"):
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.2)
        # what the probe used to ask: a solo worker running a task answers no control message
        ping = subprocess.run(
            [CELERY, "-A", HOLD_APP, "inspect", "ping"] + ["-d", "hold@" + socket.gethostname(), "--timeout", "2"],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert ping.returncode != 0, ping.stdout + ping.stderr
        first = alive.stat().st_mtime
        time.sleep(3)
        assert alive.stat().st_mtime > first, "the alive file was not touched while the task ran"
        assert time.time() - alive.stat().st_mtime < 2
        result = probe(liveness, alive)
        assert result.returncode == 0, result.stderr
        assert "succeeded" not in log.read_text(errors="replace")  # all of this while the task ran
    finally:
        worker.terminate()
        worker.wait(60)
    result = probe(liveness, alive)
    assert result.returncode != 0, "the probe passes with no worker"
