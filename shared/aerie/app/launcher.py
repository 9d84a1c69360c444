"""Start an SGLang server from a command line, wait for it, stop it for sure: the one launcher of
`aerie stack`, `aerie bench --sweep`, the tests' CPU servers and the benchmarks.

    with launch([python, "-m", "sglang.launch_server", "--model-path", M], timeout_s=600,
                log_path=Path("server.log"), api_key=KEY) as server:
        server.url   # http://127.0.0.1:<free port>

- The command gets `--host 127.0.0.1 --port <free port>` appended and runs in its own process
  group (SGLang's scheduler and detokenizer are children of the launcher process), its output to
  `log_path`. `/health` (it needs no key) is polled until it answers 200.
- `api_key`: SGLang's `--api-key`, handed over as compose and Kubernetes hand it: in a YAML file
  only this user reads (0600, in a folder of its own), named by `--config` (SGLang reads a config by
  its `.yaml` suffix), so the key is in no command line (`ps` shows every user's); the file is
  removed once the server is healthy (SGLang read it as it started) or stopped. SGLang logs its
  arguments at start, the key among them: the log is created readable by this user only.
- A server that exits first, or is not healthy within `timeout_s`, raises `LaunchError` with the
  log's tail; it is stopped before the error leaves. `begin` starts without waiting (the caller
  starts other things meanwhile, then `Server.wait_healthy`).
- Stop: SIGKILL to the whole group; `graceful` sends SIGTERM first (SGLang's own shutdown, as a
  deployment stops it) and SIGKILL after `STOP_GRACE_S` if anything lingers.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from aerie import sglang_client

STOP_GRACE_S = 30.0
HOST = "127.0.0.1"

# SGLang on the CPU (aerie_sglang.cpu.launch, in SGLang's own venv): the KV pool capped by
# --max-total-tokens (4096 tokens: ~190 MB in float32 for SmolLM2). --mem-fraction-static only
# sets SGLang's start-up check "free memory after loading the weights > (1 - fraction) * free
# memory before": at 0.1, other processes allocating on a shared machine while the weights load
# made servers fail to start; 0.8 leaves that room. --sleep-on-idle: an idle scheduler otherwise
# polls its sockets in a busy loop (~60% of a core).
CPU_ARGS = [
    "--device", "cpu", "--disable-cuda-graph", "--skip-server-warmup",
    "--max-total-tokens", "4096", "--mem-fraction-static", "0.8", "--sleep-on-idle",
]  # fmt: skip


def cpu_command(python: str | os.PathLike, args: Sequence[str], *, serve_eagle: bool = False) -> list[str]:
    """The command of an SGLang CPU server (`aerie_sglang.cpu.launch`: the sgl_kernel shim and the
    CPU engine; `serve_eagle` adds the CPU ops an EAGLE-3 drafter needs) with SGLang `args`."""
    eagle = ["--serve-eagle"] if serve_eagle else []
    return [str(python), "-m", "aerie_sglang.cpu.launch", *eagle, *args, *CPU_ARGS]


def capture_args(model: str | os.PathLike, layer_ids: Sequence[int], dtype: str = "auto") -> list[str]:
    """Capture mode, as compose's inference-capture runs it (SGLang's own flags): aux hidden states
    at `layer_ids` (SGLang's numbering), radix cache off (a prompt sharing a prefix with an earlier
    one would lose that prefix's states). On the CPU, dtype float32."""
    return [
        "--model-path", str(model), "--dtype", dtype,
        "--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
        "--return-aux-hidden-state-layer-ids", *map(str, layer_ids),
        "--disable-radix-cache",
    ]  # fmt: skip


def write_api_key(key: str) -> Path:
    """`key` as SGLang's --config YAML (`api-key: "..."`: a JSON string is a YAML one) in a new
    folder only this user enters, the file only this user reads; the caller removes the folder."""
    folder = Path(tempfile.mkdtemp(prefix="aerie-sglang-key-"))  # 0700
    path = folder / "api-key.yaml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"api-key: {json.dumps(key)}\n")
    return path


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without aerie's settings and this venv's Python variables (the
    server runs in another venv and must not read them), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AERIE_", "VIRTUAL_ENV", "PYTHON"))}
    return env | (extra or {})


class LaunchError(RuntimeError):
    """The server could not start, exited before it was healthy, or was not healthy in time."""


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


@dataclass
class Server:
    cmd: list[str]  # the full command line, host and port included
    url: str
    port: int
    log_path: Path
    process: subprocess.Popen
    graceful: bool = False
    start_s: float = 0.0  # seconds from the start to the first healthy answer
    extra: dict = field(default_factory=dict)  # whatever a caller keeps beside the server
    key_file: Path | None = None  # the --config file holding the API key, until the server read it
    started_at: float = field(default_factory=time.monotonic)

    def forget_key(self) -> None:
        """Remove the API key's file and its folder (SGLang read it as it started)."""
        if self.key_file is not None:
            shutil.rmtree(self.key_file.parent, ignore_errors=True)
            self.key_file = None

    def wait_healthy(self, timeout_s: float) -> Server:
        """Return once /health answers 200 (the key's file then removed); LaunchError with the
        log's tail if the server exits first or is not healthy `timeout_s` after its start (the
        server is stopped before the error leaves)."""
        try:
            while True:
                if self.process.poll() is not None:
                    raise LaunchError(
                        f"server {' '.join(self.cmd)} exited with {self.process.returncode} before it was healthy; "
                        f"its log ends:\n{self.log_tail(30)}"
                    )
                if sglang_client.healthy(self.url):
                    break
                if time.monotonic() - self.started_at > timeout_s:
                    raise LaunchError(
                        f"server {' '.join(self.cmd)} not healthy after {timeout_s:.0f} s; its log ends:\n"
                        f"{self.log_tail(30)}"
                    )
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.monotonic() - self.started_at
        self.forget_key()
        return self

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGKILL to the process group (`graceful`: SIGTERM first, SIGKILL if it lingers). Children
        may outlive the launcher process: the group goes in any case."""
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
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.forget_key()


def begin(
    cmd: Sequence[str],
    *,
    log_path: str | os.PathLike,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    graceful: bool = False,
    port: int | None = None,
    api_key: str | None = None,
    server_type: type[Server] = Server,
) -> Server:
    """Start `cmd` + host and `port` (default: a free one; a given one restarts a server where its
    clients expect it), `api_key` in a private --config file; return at once (`wait_healthy`)."""
    port = port or free_port()
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    key_file = write_api_key(api_key) if api_key else None
    full = [*cmd, *(["--config", str(key_file)] if key_file else []), "--host", HOST, "--port", str(port)]
    log_path.unlink(missing_ok=True)  # created anew, private: SGLang logs its arguments, the key among them
    with os.fdopen(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as log:
        try:
            proc = subprocess.Popen(
                full,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=cwd,
                env=env,
                start_new_session=True,
            )
        except OSError as e:
            if key_file is not None:
                shutil.rmtree(key_file.parent, ignore_errors=True)
            raise LaunchError(f"{full[0]!r} could not start: {e}") from None
    return server_type(
        cmd=full,
        url=f"http://{HOST}:{port}",
        port=port,
        log_path=log_path,
        process=proc,
        graceful=graceful,
        key_file=key_file,
    )


def start(cmd: Sequence[str], *, timeout_s: float, **kwargs) -> Server:
    """`begin(cmd, **kwargs)`, returned once /health answers (the caller stops it)."""
    return begin(cmd, **kwargs).wait_healthy(timeout_s)


@contextmanager
def launch(cmd: Sequence[str], **kwargs) -> Iterator[Server]:
    """`start(cmd, **kwargs)`, stopped when the block ends (an error or a signal included)."""
    server = start(cmd, **kwargs)
    try:
        yield server
    finally:
        server.stop()
