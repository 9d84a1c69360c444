"""`aerie stack` as docs/deploy.md ("Without Docker") tells a newcomer to use it, and the
definitions it shares with docker-compose.yml.

The guide's own code blocks are run, as written, in a folder laid out like a fresh clone (`.venv`
and `.venv-sglang` linked to this checkout's): the stack starts, the second shell's block enqueues
with the Celery CLI, watches the run to its published drafter and pulls it; the stop command then
leaves no process of the stack alive.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml
from markdown_it import MarkdownIt

from aerie.app import stack
from tests.services import REPO, clean_env
from tests.sglang_server import sglang_python

GUIDE = REPO / "docs" / "deploy.md"
SECTION = "## Without Docker"


def guide_blocks() -> list[str]:
    """The bash blocks of the guide's "Without Docker" section, in order."""
    text = GUIDE.read_text()
    start = text.index(SECTION)
    end = text.index("\n## ", start + 1)
    return [t.content for t in MarkdownIt().parse(text[start:end]) if t.type == "fence" and t.info.strip() == "bash"]


def block_with(command: str) -> str:
    found = [b for b in guide_blocks() if command in b]
    assert len(found) == 1, f"docs/deploy.md, {SECTION}: {len(found)} bash blocks run `{command}`"
    return found[0]


def compose_services() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]


def defaults(value: str) -> str:
    """A compose value with every ${VAR:-default} replaced by its default (what .env.example keeps)."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)


@pytest.mark.parametrize("service", ["extractor", "trainer"])
def test_compose_runs_the_worker_commands_and_settings_the_stack_runs(service):
    """One definition: compose's worker command (its defaults) is the stack's, and every setting
    the stack gives a worker is one compose gives it, with the same value where it is not a
    per-machine address (the store, the broker, the SGLang URL)."""
    svc = compose_services()[service]
    command = [defaults(part) for part in svc["command"]]
    ours = stack.extractor_command() if service == "extractor" else stack.trainer_command()
    assert command == ours, f"docker-compose.yml's {service} runs {command}, aerie stack {ours}"
    for flag in ("--loglevel", "--without-gossip", "--without-mingle"):
        assert flag in command, f"{service}: no {flag} in compose's command"

    env = {k: defaults(str(v)) for k, v in svc["environment"].items() if k != "<<"}
    compose_names = set(env) | {"AERIE_STORE", "AERIE_BUCKET", "AERIE_S3_ACCESS_KEY", "AERIE_S3_SECRET_KEY"}
    compose_names |= {"AERIE_BROKER", "AERIE_RESULT_BACKEND"}
    aerie = yaml.safe_load((REPO / "docker-compose.yml").read_text())["x-aerie-env"]
    ours_env = stack.aerie_env("s", "b", "a", "k", "redis://r")
    assert set(ours_env) == set(aerie)
    timeout = "AERIE_BROKER_VISIBILITY_TIMEOUT_S"
    assert ours_env[timeout] == defaults(aerie[timeout])
    extra = stack.extractor_env("http://x:1", "key") if service == "extractor" else stack.trainer_env("cuda")
    assert set(extra) <= compose_names, f"aerie stack sets {set(extra) - compose_names}, compose does not"
    # per machine: addresses, the device, and SGLang's key (made for each stack, as .env's for compose)
    per_machine = {"AERIE_ENGINE_URLS", "AERIE_DEVICE", "AERIE_ENGINE_API_KEY"} if service == "extractor" else set()
    for name in set(extra) - per_machine:
        assert extra[name] == env[name], f"{service} {name}: compose {env[name]!r}, aerie stack {extra[name]!r}"
    capture = compose_services()["inference-capture"]["environment"]
    assert stack.capture_env("/c")["AERIE_SGLANG_BINARY"] == capture["AERIE_SGLANG_BINARY"]


def _cmdlines(pgid: int) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if os.getpgid(int(proc.name)) == pgid:
                    found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except (OSError, ProcessLookupError):
                pass
    return found


@pytest.mark.sglang
@pytest.mark.timeout(900)
def test_the_stacks_sglang_requires_its_key_which_is_in_no_command_line(smollm2_path, tmp_path):
    """The stack's SGLang is compose's inference-capture: started through the one launcher with an
    API key (a private --config YAML, as compose hands SGLang's key over), which it then requires
    (401 without it, or with another); the key is in no command line of its processes, its file is
    gone once the server runs, its log (where SGLang prints its arguments) is private, and the
    extractors are given it."""
    import secrets

    import httpx

    from aerie.capture import convention_for, default_capture_points, to_engine_ids
    from aerie.target import describe

    target = describe(smollm2_path)
    ids = to_engine_ids(
        default_capture_points(target.num_layers), convention_for("sglang", target.architecture), target.num_layers
    )
    key = secrets.token_urlsafe(32)
    capture = tmp_path / "capture"
    capture.mkdir()
    service = stack.start_sglang(str(sglang_python()), smollm2_path, ids, "cpu", tmp_path / "logs", capture, key)
    try:
        assert service.server is not None
        key_file = service.server.key_file
        assert key_file is not None and key_file.suffix == ".yaml" and oct(key_file.stat().st_mode)[-3:] == "600"
        stack.wait_sglang(service, timeout_s=600)
        assert not key_file.exists()
        url = service.server.url
        with httpx.Client(timeout=60) as client:
            assert client.get(url + "/v1/models").status_code == 401, "the key is not enforced"
            assert client.get(url + "/v1/models", headers={"Authorization": "Bearer other"}).status_code == 401
            assert client.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        lines = _cmdlines(service.proc.pid)
        assert len(lines) >= 2 and "--config" in lines[0], lines  # the server and its scheduler/detokenizer
        assert not [line for line in lines if key in line], "the key is in a command line"
        # SGLang logs its arguments, the key among them: the log is this user's alone
        assert oct(service.log.stat().st_mode)[-3:] == "600"
        for flag in ("--enable-return-aux-hidden-states", "--disable-radix-cache", "--enable-metrics"):
            assert flag in lines[0]
        assert stack.extractor_env(url, key)["AERIE_ENGINE_API_KEY"] == key
    finally:
        service.stop()
    assert _cmdlines(service.proc.pid) == []


def test_stack_refuses_an_unknown_model_in_one_line(tmp_path):
    out = subprocess.run(
        [str(REPO / ".venv" / "bin" / "aerie"), "stack", "up", "--model", "nosuchmodel", "--dir", str(tmp_path / "s")],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "--model nosuchmodel" in out.stderr and "smollm2-135m" in out.stderr, out.stderr
    down = subprocess.run(
        [str(REPO / ".venv" / "bin" / "aerie"), "stack", "down", "--dir", str(tmp_path / "s")],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert down.returncode != 0 and "no stack runs from" in down.stderr, down.stderr


def alive(pids: list[int]) -> list[int]:
    left = []
    for pid in pids:
        try:
            os.killpg(pid, 0)
            left.append(pid)
        except ProcessLookupError:
            pass
    return left


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.timeout(1500)
def test_the_guides_without_docker_section_gets_a_pulled_drafter_and_leaves_no_process(tmp_path):
    sglang_python()  # skip (or fail, AERIE_REQUIRE_SGLANG) without .venv-sglang
    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / ".venv").symlink_to(REPO / ".venv")
    (clone / ".venv-sglang").symlink_to((REPO / ".venv-sglang").resolve())
    env = clean_env(OMP_NUM_THREADS="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    env.pop("VIRTUAL_ENV", None)
    env["PATH"] = ":".join(p for p in env["PATH"].split(":") if ".venv" not in p)

    start = block_with("aerie stack up").strip()
    assert start == ".venv/bin/aerie stack up", start
    up = subprocess.Popen(
        ["bash", "-c", start],
        cwd=clone,
        env=env,
        stdout=open(tmp_path / "up.out", "wb"),
        stderr=open(tmp_path / "up.err", "wb"),
        start_new_session=True,
    )
    state_dir = clone / ".aerie-stack"
    groups: list[int] = []
    capture: Path | None = None
    try:
        deadline = time.monotonic() + stack.SGLANG_START_S + 120
        while not (state_dir / "stack.env").exists():
            assert up.poll() is None, f"aerie stack up exited {up.returncode}:\n{(tmp_path / 'up.err').read_text()}"
            assert time.monotonic() < deadline, (tmp_path / "up.err").read_text()
            time.sleep(1)
        recorded = json.loads((state_dir / "stack.json").read_text())
        groups, capture = list(recorded["groups"].values()), Path(recorded["capture"])
        assert capture.is_dir()
        assert len(groups) == 5  # sglang, redis, s3, extractor, trainer
        printed = (tmp_path / "up.out").read_text()
        assert "export AERIE_STORE=" in printed and "AERIE_TEST" not in printed
        assert printed == (state_dir / "stack.env").read_text()
        # SGLang's key: printed for the user, in no process's command line
        key = dict(line.removeprefix("export ").split("=", 1) for line in printed.splitlines())["AERIE_ENGINE_API_KEY"]
        assert len(key) > 20 and key not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout

        session = block_with("source .aerie-stack/stack.env")
        started = time.monotonic()
        out = subprocess.run(["bash", "-ec", session], cwd=clone, env=env, capture_output=True, text=True, timeout=900)
        took = time.monotonic() - started
        logs = "\n".join(
            f"== {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in sorted((state_dir / "logs").glob("*.log"))
        )
        assert out.returncode == 0, f"the guide's commands failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}\n{logs}"
        print(f"the guide's second-shell block: {took:.0f} s")
        pulled = clone / "drafters" / "chat-eagle3"
        assert {"config.json", "model.safetensors", "aerie.json"} <= {p.name for p in pulled.iterdir()}

        # the TensorBoard hint: the bucket in the URL, and a command that works as printed
        bucket_url = f"{dict(line.removeprefix('export ').split('=', 1) for line in printed.splitlines())['AERIE_STORE']}/aerie/checkpoints/"
        assert bucket_url in out.stdout and "<bucket>" not in out.stdout, out.stdout[-2000:]
        hint = re.search(r"aerie logs (\S+) \./tb", out.stdout)
        assert hint, out.stdout[-2000:]
        copied = subprocess.run(
            ["bash", "-ec", f"source .venv/bin/activate; source .aerie-stack/stack.env; {hint.group(0)}"],
            cwd=clone,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert copied.returncode == 0, copied.stderr
        assert any(p.name.startswith("events.out.tfevents.") for p in (clone / "tb").iterdir())

        # the workers' logs: a line per task, and the trainer's own lines about its training
        extractor = (state_dir / "logs" / "extractor.log").read_text()
        trainer = (state_dir / "logs" / "trainer.log").read_text()
        assert re.search(r"Task aerie\.extract\[[0-9a-f-]+\] received", extractor), extractor[-2000:]
        train_id = hint.group(1)
        assert f"training {train_id}: drafter chat-eagle3 on run chat-v1, 10 steps" in trainer, trainer[-2000:]
        done = rf"training {train_id} \(run chat-v1\) done: 10 steps, final loss [0-9.]+, drafter chat-eagle3:\S+ published"
        deadline = time.monotonic() + 120  # the task ends a moment after its drafter is published
        while not re.search(done, trainer := (state_dir / "logs" / "trainer.log").read_text()):
            assert time.monotonic() < deadline, trainer[-2000:]
            time.sleep(0.5)
        assert "Substantial drift" not in extractor + trainer

        # stop as the guide says: every group gone, the shared-memory capture folder removed
        stop = block_with("aerie stack down").strip()
        down = subprocess.run(
            ["bash", "-ec", f"source .venv/bin/activate; {stop}"],
            cwd=clone,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert down.returncode == 0, down.stderr
        assert up.wait(60) == 0, (tmp_path / "up.err").read_text()[-2000:]
        assert alive(groups) == [], f"process groups left after `aerie stack down`: {alive(groups)}"
        assert not (state_dir / "stack.json").exists() and not capture.exists()
        leftover = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
        assert str(clone) not in leftover and str(state_dir) not in leftover, leftover
    finally:
        for pgid in [up.pid, *groups]:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if capture is not None:
            shutil.rmtree(capture, ignore_errors=True)
