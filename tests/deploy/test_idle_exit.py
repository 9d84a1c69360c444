"""The KEDA Jobs' workers (components/keda): a real Celery worker started with the ScaledJob's own
command stops by itself once idle, with exit status 0 (the Job completes), and never while a task
runs, however long: scale-in is the worker's own, so no busy worker is killed."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

from celery import Celery

from scripts.deploy_checks.k8s import kustomize_build
from tests.services import clean_env

REPO = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).with_name("celery"))
HOLD_APP = "tests.deploy.alive_app"
IDLE_S = 2.0  # the test's idle time (the ScaledJob's is minutes), so that the exit shows in seconds


def job_worker_args() -> list[str]:
    """The `celery worker` arguments of the rendered ScaledJob's pods, its variables filled as the pod's
    env fills them (EXTRACTOR_QUEUES from the pod's queue label)."""
    (job,) = [r for r in kustomize_build(REPO / "k8s/overlays/single-host") if r["kind"] == "ScaledJob"]
    template = job["spec"]["jobTargetRef"]["template"]
    assert template["spec"]["restartPolicy"] == "Never"
    (container,) = template["spec"]["containers"]
    line = container["command"][2]
    line = line.replace('"$EXTRACTOR_QUEUES"', template["metadata"]["labels"]["aerie.dev/queues"])
    line = line.replace('"$AERIE_WORKER_CONCURRENCY"', "2")
    words = shlex.split(line)
    assert words[:4] == ["exec", "celery", "-A", "aerie_extractor.worker"], words
    args = words[words.index("worker") + 1 :]
    assert "--exit-when-idle" in args, "the Jobs' workers never stop: KEDA's Jobs would never complete"
    args[args.index("--exit-when-idle") + 1] = str(IDLE_S)
    return args


def test_a_job_worker_exits_when_idle_and_never_while_its_task_runs(private_redis, tmp_path):
    args = job_worker_args()
    assert args[args.index("-Q") + 1] == "extract"
    args[args.index("--") : args.index("--")] = ["-n", "job@%h", "--loglevel", "INFO"]
    log = tmp_path / "worker.log"
    worker = subprocess.Popen(
        [CELERY, "-A", HOLD_APP, "worker", *args],
        env=clean_env(AERIE_BROKER=private_redis),
        cwd=REPO,
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while "ready" not in log.read_text(errors="replace"):
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.1)
        # a task three idle periods long, sent at once (the worker was idle for less than IDLE_S)
        Celery(broker=private_redis).send_task("tests.hold", kwargs={"seconds": 3 * IDLE_S}, queue="extract")
        while "tests.hold" not in log.read_text(errors="replace"):
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.1)
        started = time.monotonic()
        time.sleep(2 * IDLE_S)  # past the idle time, the task still running
        assert worker.poll() is None, "the worker stopped while its task ran:\n" + log.read_text(errors="replace")
        assert "succeeded" not in log.read_text(errors="replace")
        rc = worker.wait(timeout=3 * IDLE_S + 30)
        text = log.read_text(errors="replace")
        assert rc == 0, f"exit status {rc}: the Job would fail\n{text[-3000:]}"
        assert "succeeded" in text, text[-3000:]
        assert time.monotonic() - started >= 3 * IDLE_S + IDLE_S - 0.5, "stopped before it had been idle IDLE_S"
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(30)
