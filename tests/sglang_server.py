"""Real SGLang servers for tests: started from `.venv-sglang` on the CPU, stopped for sure.

    from tests.sglang_server import capture_server_fixture, serve_server

    sglang_capture = capture_server_fixture(points=[2, 15, 27])   # module-scoped fixture

    def test_x(sglang_capture):            # -> SGLangServer (url, layer_ids, model_path, log_tail())
        httpx.post(sglang_capture.url + "/generate", json=...)

    with serve_server(model_path, draft_path) as server:   # target + EAGLE3 drafter
        ...

- The server runs `python -m aerie_sglang.cpu.launch` (shim, CPU engine, `--serve-eagle` for a
  drafter) through the one launcher (aerie.app.launcher): its own process group, a free port, a
  log file, `/health` waited for (LaunchError with the log's tail if the server dies first); on
  exit SIGKILL goes to the whole group (`graceful=True`: SIGTERM first).
- Without `.venv-sglang` the tests skip (run scripts/sglang_env.sh), unless
  `AERIE_REQUIRE_SGLANG` is set (the test command sets it): then they fail.
- Each server takes ~25 s to start and 3-4 GB: share one per module (`scope="module"`). A start
  is mostly one core importing SGLang, so two servers a module needs start side by side
  (`together`), or one starts while another is in use (`start_soon`).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from aerie.app import launcher

REPO = Path(__file__).resolve().parents[1]
SGLANG_VENV = REPO / ".venv-sglang"
START_TIMEOUT_S = 420.0  # ~25 s alone; 2 shared cores under load (load avg 10) took 190 s


PORT_SPAN = 32  # SGLang takes its internal ports from --port up (dist init, detokenizer, scheduler, ...)


def server_port() -> int:
    """A port for a test's server below the kernel's ephemeral range (32768-60999 by default), the
    PORT_SPAN ports from it up free: SGLang derives its internal ports from --port, and in the
    ephemeral range a client connection of another test process can hold one of them (a server
    failed so beside a second pytest-xdist worker: "dist_init_port ... is used by a process
    already"). Each worker draws from a block of its own."""
    import random
    import socket

    def free(port: int) -> bool:
        with socket.socket() as sock:
            try:
                sock.bind((launcher.HOST, port))
            except OSError:
                return False
            return True

    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    low = 20000 + (worker % 4) * 3000
    for _ in range(200):
        port = random.randrange(low, low + 3000 - PORT_SPAN)
        if all(free(p) for p in range(port, port + PORT_SPAN)):
            return port
    raise RuntimeError(f"no {PORT_SPAN} free ports in a row in {low}-{low + 3000}")


def sglang_python() -> Path:
    """The Python of `.venv-sglang`, or skip/fail the test (AERIE_REQUIRE_SGLANG) without it."""
    python = SGLANG_VENV / "bin" / "python"
    if python.is_file():
        return python
    reason = f"{SGLANG_VENV} is absent: run scripts/sglang_env.sh (SGLang in its own venv)"
    if os.environ.get("AERIE_REQUIRE_SGLANG"):
        pytest.fail(f"AERIE_REQUIRE_SGLANG is set but {reason}")
    pytest.skip(reason)


def capture_args(model_path: str | os.PathLike, layer_ids: Sequence[int], dtype: str = "float32") -> list[str]:
    """Capture mode as compose and `aerie stack` run it (launcher.capture_args), float32 on the CPU."""
    return launcher.capture_args(model_path, layer_ids, dtype)


def serve_args(
    model_path: str | os.PathLike,
    draft_path: str | os.PathLike,
    dtype: str = "float32",
    num_steps: int = 3,
    eagle_topk: int = 1,
    num_draft_tokens: int = 4,
) -> list[str]:
    """Serve mode: the target with an EAGLE3 drafter (needs `--serve-eagle` and the CPU ops)."""
    return [
        "--model-path", str(model_path), "--dtype", dtype,
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft_path),
        "--speculative-num-steps", str(num_steps), "--speculative-eagle-topk", str(eagle_topk),
        "--speculative-num-draft-tokens", str(num_draft_tokens),
    ]  # fmt: skip


CPU_ARGS = launcher.CPU_ARGS


@dataclass
class SGLangServer(launcher.Server):
    """A launcher.Server with what a test asks of it: the capture layers and the model."""

    layer_ids: list[int] | None = None
    model_path: str | None = None


@contextmanager
def sglang_server(
    args: Sequence[str],
    *,
    serve_eagle: bool = False,
    timeout_s: float = START_TIMEOUT_S,
    log_dir: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    graceful: bool = False,
    port: int | None = None,
    api_key: str | None = None,
) -> Iterator[SGLangServer]:
    """Start `aerie_sglang.cpu.launch` with SGLang `args` (+ CPU flags; host and a free port by the
    launcher, or `port`; `api_key` as the launcher hands it over); yield when healthy. A test's
    server holds nothing to save, and SGLang's own shutdown costs ~6 s a stop, so it is stopped by
    SIGKILL; `graceful`: SIGTERM first."""
    python = sglang_python()
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="aerie-sglang-"))
    cmd = launcher.cpu_command(python, args, serve_eagle=serve_eagle)
    # this checkout's plugin and CPU harness before the venv's editable install (which may be another
    # checkout's): SGLang imports the entry point's module by name, so the path decides which runs
    child_env = launcher.clean_env({"PYTHONPATH": str(REPO / "services" / "inference")} | (env or {}))
    with launcher.launch(
        cmd,
        timeout_s=timeout_s,
        log_path=log_dir / f"sglang-{time.time_ns()}.log",
        env=child_env,
        cwd=REPO,
        graceful=graceful,
        port=port or server_port(),
        api_key=api_key,
        server_type=SGLangServer,
    ) as server:
        yield server  # type: ignore[misc]


@contextmanager
def capture_server(
    model_path: str | os.PathLike,
    *,
    points: Sequence[int] | None = None,
    layer_ids: Sequence[int] | None = None,
    dtype: str = "float32",
    **kwargs,
) -> Iterator[SGLangServer]:
    """A capture-mode server for `points` (translated by aerie.capture) or raw SGLang `layer_ids`."""
    if (points is None) == (layer_ids is None):
        raise ValueError("give capture points or SGLang layer ids, not both")
    if layer_ids is None:
        from aerie.capture import convention_for, to_engine_ids
        from aerie.target import describe

        target = describe(model_path)
        layer_ids = to_engine_ids(points, convention_for("sglang", target.architecture), target.num_layers)
    with sglang_server(capture_args(model_path, layer_ids, dtype), **kwargs) as server:
        server.layer_ids, server.model_path = list(layer_ids), str(model_path)
        yield server


@contextmanager
def serve_server(
    model_path: str | os.PathLike, draft_path: str | os.PathLike, *, dtype: str = "float32", **kwargs
) -> Iterator[SGLangServer]:
    """A server of the target with an EAGLE3 drafter (`--serve-eagle`: intel_amx attention + CPU ops).

    kwargs: `num_steps`, `eagle_topk`, `num_draft_tokens` (serve_args), and sglang_server's."""
    spec = {k: kwargs.pop(k) for k in ("num_steps", "eagle_topk", "num_draft_tokens") if k in kwargs}
    with sglang_server(serve_args(model_path, draft_path, dtype, **spec), serve_eagle=True, **kwargs) as server:
        server.model_path = str(model_path)
        yield server


def capture_server_fixture(
    points: Sequence[int] | None = None,
    *,
    layer_ids: Sequence[int] | None = None,
    model_fixture: str = "smollm2_path",
    scope: str = "module",
    dtype: str = "float32",
):
    """A pytest fixture (default module-scoped) yielding a capture server of `model_fixture`'s
    model; `points=None` and `layer_ids=None` mean the default points [2, N//2, N-3]."""

    @pytest.fixture(scope=scope)
    def _capture_server(request, tmp_path_factory):
        model = request.getfixturevalue(model_fixture)
        pts = points
        if pts is None and layer_ids is None:
            from aerie.capture import default_capture_points
            from aerie.target import describe

            pts = default_capture_points(describe(model).num_layers)
        with capture_server(
            model, points=pts, layer_ids=layer_ids, dtype=dtype, log_dir=tmp_path_factory.mktemp("sglang")
        ) as server:
            yield server

    return _capture_server


def serve_server_fixture(draft_fixture: str, *, model_fixture: str = "smollm2_path", scope: str = "module", **kwargs):
    """A pytest fixture yielding a target+drafter server; `draft_fixture` names a fixture that
    returns the exported drafter folder."""

    @pytest.fixture(scope=scope)
    def _serve_server(request, tmp_path_factory):
        model = request.getfixturevalue(model_fixture)
        draft = request.getfixturevalue(draft_fixture)
        with serve_server(model, draft, log_dir=tmp_path_factory.mktemp("sglang"), **kwargs) as server:
            yield server

    return _serve_server


@contextmanager
def together(*servers: AbstractContextManager[SGLangServer]) -> Iterator[list[SGLangServer]]:
    """Enter several server context managers at once and yield their servers in order; all are
    stopped on exit (and the started ones if another fails to start). Measured on the 2-core
    machine with other jobs at load ~4: one start 39 s (35 CPU-s, nearly all on one core), two side
    by side 58 s."""
    with ExitStack() as stack:
        with ThreadPoolExecutor(len(servers)) as pool:
            futures = [pool.submit(stack.enter_context, cm) for cm in servers]
        yield [f.result() for f in futures]


class start_soon:  # noqa: N801 (used like the context managers it wraps)
    """A server context manager entered now in a background thread: `ready()` waits for its
    server (raising what the start raised), `stop()` stops it (after waiting for the start)."""

    def __init__(self, server: AbstractContextManager[SGLangServer]):
        self._stack = ExitStack()
        self._pool = ThreadPoolExecutor(1)
        self._future = self._pool.submit(self._stack.enter_context, server)

    def ready(self) -> SGLangServer:
        return self._future.result()

    def stop(self) -> None:
        self._pool.shutdown(wait=True)
        self._stack.close()
