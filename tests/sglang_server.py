"""Real SGLang servers for tests: started from `.venv-sglang` on the CPU, stopped for sure.

    from tests.sglang_server import capture_server_fixture, serve_server

    sglang_capture = capture_server_fixture(points=[2, 15, 27])   # module-scoped fixture

    def test_x(sglang_capture):            # -> SGLangServer (url, layer_ids, model_path, log_tail())
        httpx.post(sglang_capture.url + "/generate", json=...)

    with serve_server(model_path, draft_path) as server:   # target + EAGLE3 drafter
        ...

- The server runs `python -m aerie_sglang.cpu.launch` (shim, CPU engine, `--serve-eagle` for a
  drafter) in its own process group, on a free port, logging to a file; `/health` is waited for
  with a timeout (failing with the log's tail if the server dies first); on exit SIGKILL goes to
  the whole group (`graceful=True`: SIGTERM first, SIGKILL after a grace period).
- Without `.venv-sglang` the tests skip (run scripts/sglang_env.sh), unless
  `AERIE_REQUIRE_SGLANG` is set (the test command sets it): then they fail.
- Each server takes ~25 s to start and 3-4 GB: share one per module (`scope="module"`). A start
  is mostly one core importing SGLang, so two servers a module needs start side by side
  (`together`), or one starts while another is in use (`start_soon`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
SGLANG_VENV = REPO / ".venv-sglang"
START_TIMEOUT_S = 420.0  # ~25 s alone; 2 shared cores under load (load avg 10) took 190 s
STOP_GRACE_S = 30.0


def sglang_python() -> Path:
    """The Python of `.venv-sglang`, or skip/fail the test (AERIE_REQUIRE_SGLANG) without it."""
    python = SGLANG_VENV / "bin" / "python"
    if python.is_file():
        return python
    reason = f"{SGLANG_VENV} is absent: run scripts/sglang_env.sh (SGLang in its own venv)"
    if os.environ.get("AERIE_REQUIRE_SGLANG"):
        pytest.fail(f"AERIE_REQUIRE_SGLANG is set but {reason}")
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def capture_args(model_path: str | os.PathLike, layer_ids: Sequence[int], dtype: str = "float32") -> list[str]:
    """Capture mode (SGLANG_CPU.md): aux hidden states at `layer_ids` (SGLang's numbering)."""
    return [
        "--model-path", str(model_path), "--dtype", dtype,
        "--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
        "--return-aux-hidden-state-layer-ids", *map(str, layer_ids),
        "--disable-radix-cache",
    ]  # fmt: skip


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


# The KV pool is capped by --max-total-tokens (4096 tokens: ~190 MB in float32 for SmolLM2).
# --mem-fraction-static only sets SGLang's start-up check "free memory after loading the weights
# > (1 - fraction) * free memory before": at 0.1, other processes allocating on this shared
# machine while the weights load made servers fail to start; 0.8 leaves that room.
# --sleep-on-idle: an idle scheduler otherwise polls its sockets in a busy loop, ~60% of a core
# (measured), and the module-scoped servers of a test run sit idle most of the time.
CPU_ARGS = [
    "--device", "cpu", "--disable-cuda-graph", "--skip-server-warmup",
    "--max-total-tokens", "4096", "--mem-fraction-static", "0.8", "--sleep-on-idle",
]  # fmt: skip


@dataclass
class SGLangServer:
    url: str
    port: int
    args: list[str]
    log_path: Path
    process: subprocess.Popen
    layer_ids: list[int] | None = None
    model_path: str | None = None
    extra: dict = field(default_factory=dict)
    graceful: bool = False  # stop with SIGTERM (SGLang's own shutdown), as a deployment restarts it

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGKILL to the process group (launcher, scheduler, detokenizer). A test's server holds
        nothing to save, and SGLang's own shutdown costs ~6 s a stop (measured: it drains requests
        for 4-6 s, or, when its scheduler gets the signal first, sleeps 5 s "to let GPU activity
        settle"). `graceful`: SIGTERM to the group first, SIGKILL if it lingers."""
        proc = self.process
        if self.graceful and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        try:  # children may outlive the launcher: the group goes in any case
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _wait_healthy(server: SGLangServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=10.0) as client:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                raise RuntimeError(
                    f"SGLang exited with code {server.process.returncode} before it was healthy "
                    f"(args: {' '.join(server.args)}); log tail:\n{server.log_tail()}"
                )
            try:
                if client.get(server.url + "/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"SGLang not healthy after {timeout_s:.0f} s at {server.url}; log tail:\n{server.log_tail()}")


@contextmanager
def sglang_server(
    args: Sequence[str],
    *,
    serve_eagle: bool = False,
    timeout_s: float = START_TIMEOUT_S,
    log_dir: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    graceful: bool = False,
) -> Iterator[SGLangServer]:
    """Start `aerie_sglang.cpu.launch` with SGLang `args` (+ CPU flags, host, port); yield when healthy.
    `graceful`: stopped by SIGTERM (SGLang's own shutdown) rather than SIGKILL (SGLangServer.stop)."""
    python = sglang_python()
    port = free_port()
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="aerie-sglang-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"sglang-{port}.log"
    full = [*args, *CPU_ARGS, "--host", "127.0.0.1", "--port", str(port)]
    cmd = [str(python), "-m", "aerie_sglang.cpu.launch", *(["--serve-eagle"] if serve_eagle else []), *full]
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("AERIE_", "VIRTUAL_ENV", "PYTHON"))}
    child_env.update(env or {})
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
            env=child_env,
            start_new_session=True,
        )
    server = SGLangServer(
        url=f"http://127.0.0.1:{port}", port=port, args=full, log_path=log_path, process=proc, graceful=graceful
    )
    try:
        started = time.monotonic()
        _wait_healthy(server, timeout_s)
        server.extra["start_s"] = time.monotonic() - started
        yield server
    finally:
        server.stop()


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
