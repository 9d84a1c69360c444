"""The deploy runtime tests' SGLang server and target model (tests/deploy/conftest.py: deploy_sglang)."""

from __future__ import annotations

import os
import threading
from contextlib import ExitStack
from pathlib import Path

from tests.sglang_server import START_TIMEOUT_S, capture_server

POINTS = [2, 15, 27]


def linked_copy(model: Path, dest: Path) -> Path:
    """The model's files hard-linked into a fresh folder (no copy of the weights)."""
    dest.mkdir()
    for f in model.iterdir():
        if f.is_file() and not f.name.startswith("."):
            os.link(f, dest / f.name)
    return dest


class RestartableServer:
    """A capture server of `model` that a test may stop and start again on the same port. The first
    start may run in a background thread (`start_soon`); `ready()` waits for it."""

    def __init__(self, model: Path, log_dir: Path):
        self.model, self.log_dir, self.port, self.url = model, log_dir, None, None
        self._stack, self._starting, self._error = None, None, None

    def start(self) -> None:
        self._stack = ExitStack()
        # on its first port when started again; stopped as a deployment restarts it: SIGTERM, SGLang's own shutdown
        server = self._stack.enter_context(
            capture_server(self.model, points=POINTS, log_dir=self.log_dir, graceful=True, port=self.port)
        )
        self.port, self.url = server.port, server.url

    def start_soon(self) -> None:
        def start():
            try:
                self.start()
            except BaseException as e:  # a skip or failure too: raised again by ready()
                self._error = e

        self._starting = threading.Thread(target=start, name="deploy-sglang-start", daemon=True)
        self._starting.start()

    def ready(self) -> RestartableServer:
        if self._starting is not None:
            self._starting.join(START_TIMEOUT_S + 60)
            assert not self._starting.is_alive(), f"SGLang did not start within {START_TIMEOUT_S + 60:.0f} s"
            self._starting = None
            if self._error is not None:
                raise self._error
        return self

    def stop(self) -> None:
        if self._starting is not None:
            self._starting.join(START_TIMEOUT_S + 60)
        if self._stack is not None:
            self._stack.close()
            self._stack = None
