"""Real servers for tests: an S3 server (SeaweedFS `weed mini`) and Redis.

Both are started by the product's own code (`aerie stack`'s, aerie.app.stack) as plain processes
on loopback, every port and credential explicit, and stopped by whoever started them.
`python -m tests.services s3 --dir D --env-file F` starts one for the test command
(scripts/test.sh) and writes the variables that point at it.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from aerie.app import stack
from aerie.app.launcher import free_port  # noqa: F401 (the tests import it from here)
from aerie.app.stack import S3Server  # noqa: F401 (the tests import it from here)

REPO = Path(__file__).resolve().parents[1]


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex((host, port)) == 0


def start_s3(data_dir: str | os.PathLike, timeout_s: float = 60.0) -> S3Server:
    """The product's S3 server (`aerie stack`'s: weed mini on loopback, fresh credentials)."""
    return stack.start_s3(data_dir, timeout_s)


# --------------------------------------------------------------------------------------
# Environment and waiting: one helper each
# --------------------------------------------------------------------------------------
def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any AERIE_* variable (the test command's AERIE_TEST_*
    included), plus `extra`: a subprocess sees only the settings a test gives it."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("AERIE_")}, **extra}


def store_env(store) -> dict[str, str]:
    """AERIE_* variables that make a subprocess (worker, CLI) use this store."""
    from aerie.store import FsStore

    if isinstance(store, FsStore):
        return {"AERIE_STORE": f"file://{store.root}"}
    creds = store.client._provider.retrieve()
    return {
        "AERIE_STORE": store.endpoint,
        "AERIE_BUCKET": store.bucket,
        "AERIE_S3_ACCESS_KEY": creds.access_key,
        "AERIE_S3_SECRET_KEY": creds.secret_key,
    }


def wait_until(condition, timeout: float, what: str, poll: float = 0.1, details=lambda: ""):
    """Poll `condition()` until it returns something truthy (returned); fail the test naming `what`
    (and `details()`) when `timeout` seconds pass first."""
    import pytest

    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:.0f} s. {details()}")
        time.sleep(poll)


def wait_settled(measure, timeout: float, what: str, quiet: float = 1.0):
    """Poll `measure()` until it returns the same value for `quiet` seconds (work in flight has
    finished); return that value; fail the test naming `what` after `timeout` seconds."""
    import pytest

    deadline = time.monotonic() + timeout
    value, since = measure(), time.monotonic()
    while time.monotonic() - since < quiet:
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: still changing after {timeout:.0f} s (last {value!r})")
        time.sleep(0.1)
        now = measure()
        if now != value:
            value, since = now, time.monotonic()
    return value


def start_redis(data_dir: Path, timeout_s: float = 30.0) -> tuple[str, subprocess.Popen]:
    """A private redis-server on a free loopback port (`aerie stack`'s): (url of db 0, process)."""
    base, service = stack.start_redis(data_dir, timeout_s)
    return f"{base}/0", service.proc


# --------------------------------------------------------------------------------------
class CeleryWorker:
    """One real `celery -A <app> worker -Q <queues>` process (solo pool: the task runs in the
    process a test may SIGKILL), in its own process group, logging to `<log_dir>/<name>.log`."""

    app: str = ""
    queues: str = ""

    def __init__(self, env: dict[str, str], name: str, log_dir: Path):
        self.name, self.log_path = name, Path(log_dir) / f"{name}.log"
        celery = str(Path(sys.executable).with_name("celery"))
        self.proc = subprocess.Popen(
            [
                celery,
                "-A",
                self.app,
                "worker",
                "-Q",
                self.queues,
                "--pool",
                "solo",
                "-n",
                f"{name}@%h",
                "--loglevel",
                "INFO",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            env=env,
            cwd=REPO,
            stdout=open(self.log_path, "wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float):
        """The first match of `pattern` in the log; fails the test if the worker exits first."""
        import re

        import pytest

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if m := re.search(pattern, self.log()):
                return m
            if self.proc.poll() is not None:
                pytest.fail(f"worker {self.name} exited ({self.proc.returncode}):\n{self.log()[-3000:]}")
            time.sleep(0.1)
        pytest.fail(f"worker {self.name}: no {pattern!r} within {timeout} s:\n{self.log()[-3000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["s3"])
    p.add_argument("--dir", required=True)
    p.add_argument("--env-file", required=True)
    a = p.parse_args()
    server = start_s3(a.dir)
    Path(a.env_file).write_text(
        f"export AERIE_TEST_S3_ENDPOINT={server.endpoint}\n"
        f"export AERIE_TEST_S3_ACCESS_KEY={server.access_key}\n"
        f"export AERIE_TEST_S3_SECRET_KEY={server.secret_key}\n"
        f"export AERIE_TEST_S3_PGID={server.proc.pid}\n"
    )
    print(f"S3 server (weed mini) at {server.endpoint}, pgid {server.proc.pid}")


if __name__ == "__main__":
    main()
