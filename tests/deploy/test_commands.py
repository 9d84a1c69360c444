"""The commands the deployment runs resolve against the installed code: the Celery apps import and
build with the compose environment, the `celery`/`aerie` sub-commands of the guide exist in the
packages of the image that runs them, and SGLang's own argument parser accepts the inference
command lines of compose and Kubernetes."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from scripts.deploy_checks.compose import unescape
from scripts.deploy_checks.docs import compose_command, shell_commands
from tests.deploy.images import image_packages
from tests.services import REPO, clean_env, free_port, store_env, wait_until

SGLANG_PY = REPO / ".venv-sglang" / "bin" / "python"


def in_container(markdown: str) -> list[tuple[str, str, list[str]]]:
    """(line, compose service or k8s workload, argv) of each command the guide runs in a container."""
    found = []
    for line, argv in shell_commands(markdown):
        if argv[:2] == ["docker", "compose"] and (inner := compose_command(argv))[2]:
            found.append((line, inner[1][0], inner[2]))
        elif argv[0] == "kubectl" and "exec" in argv and "--" in argv:
            target = next((t for t in argv[argv.index("exec") + 1 :] if "/" in t), "")
            found.append((line, target.split("/", 1)[-1], argv[argv.index("--") + 1 :]))
    return found


def _sh_script(service: dict) -> str:
    """The script of a `sh -c SCRIPT` compose command, as the container's shell gets it."""
    cmd = service["command"]
    assert cmd[:2] == ["sh", "-c"], f"expected a `sh -c` command, got {cmd[:2]}"
    return unescape(cmd[2])


CELERY_SERVICES = ["extractor", "trainer"]


@pytest.mark.parametrize("service", CELERY_SERVICES)
def test_compose_worker_command_builds_its_celery_app_from_the_compose_environment(service, compose_services):
    """`celery -A X worker -Q q` in the compose file: X imports, its app builds from exactly the
    environment compose gives the container, and every queue it consumes is one aerie routes to."""
    svc = compose_services[service]
    cmd = svc["command"]
    app, queues = cmd[cmd.index("-A") + 1], cmd[cmd.index("-Q") + 1].split(",")
    int(cmd[cmd.index("--concurrency") + 1])
    env = clean_env(**svc["environment"])
    probe = (
        "import importlib, json, sys; from celery import Celery\n"
        f"m = importlib.import_module({app!r}); a = m.app\n"
        "assert isinstance(a, Celery), type(a)\n"
        "routes = {r['queue'] for r in a.conf.task_routes.values()}\n"
        "print(json.dumps(sorted(routes)))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, f"{service}: `celery -A {app}` would fail in the container:\n{out.stderr[-3000:]}"
    routed = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert set(queues) <= routed, f"{service} consumes {queues}, aerie routes tasks to {sorted(routed)}"


def _parse_error(command, argv: list[str]) -> str | None:
    """Why click would refuse `argv` for `command` (unknown option, missing argument), or None."""
    import click

    try:
        command.make_context(command.name, list(argv))
    except click.UsageError as e:
        return e.format_message()
    return None


def _registered_celery_commands() -> dict[str, str | None]:
    """celery sub-command -> distribution providing it (None: Celery's own)."""
    from importlib.metadata import entry_points

    from celery.bin.celery import celery as celery_cli

    plugins = {ep.name: ep.dist.name for ep in entry_points(group="celery.commands")}
    return {name: plugins.get(name) for name in celery_cli.commands}


def _registered_aerie_commands() -> dict[str, str]:
    from importlib.metadata import entry_points

    from aerie.app.cli import main

    plugins = {ep.name: ep.dist.name for ep in entry_points(group="aerie.commands")}
    builtin = {name: "aerie" for name in main.commands}
    return {**plugins, **builtin}


def test_every_command_the_guide_runs_in_a_container_exists_in_that_image():
    """`aerie SUB` / `celery -A APP SUB` in docs/deploy.md: the sub-command is registered, by a
    package the image of the container it runs in installs, and accepts the guide's options and
    arguments; `celery call` names a task aerie routes, with kwargs its contract accepts."""
    from aerie.app.cli import main as aerie_main
    from aerie.contracts import ExtractRequest, IngestRequest, TrainRequest
    from aerie.queue import EXTRACT_TASK, INGEST_TASK, ROUTES, TRAIN_TASK

    CONTRACTS = {INGEST_TASK: IngestRequest, EXTRACT_TASK: ExtractRequest, TRAIN_TASK: TrainRequest}
    from celery.bin.celery import celery as celery_cli

    images = {"extractor": "extractor", "trainer": "trainer"}
    celery_cmds, aerie_cmds = _registered_celery_commands(), _registered_aerie_commands()
    missing = []
    for line, where, argv in in_container((REPO / "docs" / "deploy.md").read_text()):
        if where not in images or not argv:
            continue
        have = image_packages(images[where])
        if argv[0] == "aerie":
            sub = argv[1]
            dist = aerie_cmds.get(sub)
            if dist is None:
                missing.append(
                    f"`aerie {sub}` is not a command (aerie.app.cli or an `aerie.commands` entry point): {line}"
                )
            elif dist not in have:
                missing.append(f"`aerie {sub}` comes from {dist}, which the {where} image does not install: {line}")
            elif why := _parse_error(aerie_main.get_command(None, sub), argv[2:]):
                missing.append(f"`aerie {sub}` refuses its arguments ({why}): {line}")
        elif argv[0] == "celery":
            sub = next(a for a in argv[3:] if not a.startswith("-"))
            if sub not in celery_cmds:
                missing.append(f"`celery {sub}` is not a command: {line}")
            elif celery_cmds[sub] is not None and celery_cmds[sub] not in have:
                missing.append(
                    f"`celery {sub}` comes from {celery_cmds[sub]}, not installed in the {where} image: {line}"
                )
            elif why := _parse_error(celery_cli.commands[sub], argv[argv.index(sub) + 1 :]):
                missing.append(f"`celery {sub}` refuses its arguments ({why}): {line}")
            if sub == "call":
                task = argv[argv.index("call") + 1]
                if task not in ROUTES:
                    missing.append(f"task {task!r} is not one aerie routes ({sorted(ROUTES)}): {line}")
                elif "--kwargs" in argv:  # the task validates its kwargs as this contract
                    try:
                        CONTRACTS[task].model_validate_json(argv[argv.index("--kwargs") + 1])
                    except ValueError as e:
                        missing.append(f"--kwargs of {task} are not a valid {CONTRACTS[task].__name__}: {e}: {line}")
    # the serve component's init container pulls the drafter with `aerie pull` in the slim extractor image
    serve = (REPO / "k8s" / "components" / "serve" / "serve.yaml").read_text()
    assert "image: registry.invalid/aerie/extractor:" in serve and "aerie pull" in serve
    if aerie_cmds.get("pull") not in image_packages("extractor"):
        missing.append(
            "`aerie pull` (k8s serve init container, extractor image) comes from no package the extractor image installs"
        )
    assert not missing, "\n".join(missing)


def _launch_args(script: str, env: dict[str, str]) -> list[str]:
    """The `python3 -m sglang.launch_server ...` arguments of a container script, as its shell expands them."""
    body = script[script.index("exec python3 -m sglang.launch_server") :].replace("\\\n", " ")

    def sub(m):
        name, default = m.group(1) or m.group(3), m.group(2)
        return env.get(name) or (default or "")

    body = re.sub(r"\$\{([A-Za-z_]+)(?::-([^}]*))?\}|\$([A-Za-z_]+)", sub, body)
    return shlex.split(body)[4:]


@pytest.mark.sglang
@pytest.mark.slow  # importing SGLang's server_args takes 25-35 s on 2 cores
def test_inference_command_lines_parse_with_sglangs_own_argument_parser(compose_services):
    """The capture, serve and generate command lines of compose and k8s, expanded as their shells would,
    are accepted by SGLang 0.5.23's ServerArgs parser (flags exist, values have the right types)."""
    if not SGLANG_PY.exists():
        if os.environ.get("AERIE_REQUIRE_SGLANG"):
            pytest.fail(f"{SGLANG_PY} missing: run scripts/sglang_env.sh")
        pytest.skip("no .venv-sglang (scripts/sglang_env.sh builds it)")
    env = {
        "ids": "1 14 26",  # compose: ids=$(echo "$CAPTURE_LAYER_IDS" | tr ',' ' ')
        "TP_SIZE": "8",
        "SERVED_MODEL_NAME": "target",
        "CAPTURE_LAYER_IDS": "1 14 26",
        "SGLANG_EXTRA_ARGS": "--mem-fraction-static 0.85",
        "DRAFTER_NAME": "chat-eagle3",
        "SPEC_NUM_STEPS": "3",
        "SPEC_EAGLE_TOPK": "1",
        "SPEC_NUM_DRAFT_TOKENS": "4",
        "SGLANG_API_KEY": "a-key",
        "GENERATE_TP_SIZE": "4",
        "GENERATE_EXTRA_ARGS": "--mem-fraction-static 0.85",
        "GENERATE_MAX_RUNNING": "128",
        "secret": "/tmp/tmp.sglang",  # the scripts' mktemp file holding the key (test_sglang_api_key.py)
    }
    s = compose_services
    base = yaml.safe_load_all((REPO / "k8s" / "base" / "inference.yaml").read_text())
    k8s_capture = next(d for d in base if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0][
        "command"
    ][2]
    k8s_generate = next(
        d
        for d in yaml.safe_load_all((REPO / "k8s" / "base" / "generate.yaml").read_text())
        if d["kind"] == "Deployment"
    )["spec"]["template"]["spec"]["containers"][0]["command"][2]
    k8s_serve = yaml.safe_load((REPO / "k8s" / "components" / "serve" / "serve.yaml").read_text())["spec"]["template"][
        "spec"
    ]["containers"][0]["command"][2]
    lines = {
        "compose capture": _launch_args(_sh_script(s["inference-capture"]), env),
        "compose serve": _launch_args(_sh_script(s["inference-serve"]), env),
        "k8s capture": _launch_args(k8s_capture, env),
        "k8s serve": _launch_args(k8s_serve, env),
        "compose generate": _launch_args(_sh_script(s["inference-generate"]), env),
        "k8s generate": _launch_args(k8s_generate, env),
    }
    assert lines["compose capture"][lines["compose capture"].index("--return-aux-hidden-state-layer-ids") + 1 :][
        :3
    ] == ["1", "14", "26"]
    for name, argv in lines.items():  # metrics for Prometheus; the key from a file, never in argv
        assert "--enable-metrics" in argv and argv[argv.index("--config") + 1] == "/tmp/tmp.sglang", name
        assert "a-key" not in argv, name
    probe = (
        "import argparse, json, sys\n"
        "from sglang.srt.server_args import ServerArgs\n"
        "bad = {}\n"
        "for name, argv in json.loads(sys.stdin.read()).items():\n"
        "    p = argparse.ArgumentParser(exit_on_error=False); ServerArgs.add_cli_args(p)\n"
        "    try:\n"
        "        ns, extra = p.parse_known_args(argv)\n"
        "        if extra: bad[name] = f'unknown arguments {extra}'\n"
        "    except (argparse.ArgumentError, SystemExit) as e: bad[name] = str(e)\n"
        "print(json.dumps(bad))\n"
    )
    out = subprocess.run(
        [str(SGLANG_PY), "-c", probe],
        input=json.dumps(lines),
        capture_output=True,
        text=True,
        timeout=300,
        env=clean_env(),
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}, f"SGLang rejects: {out.stdout}"


@pytest.mark.parametrize("service", CELERY_SERVICES)
def test_compose_worker_runs_as_a_plain_process_and_answers_its_own_healthcheck(
    service, compose_services, redis_url, tmp_path
):
    """The compose command, run as it is with the compose environment (broker pointed at the test
    Redis), starts a worker that the compose healthcheck command then finds alive."""
    svc = compose_services[service]
    env = clean_env(**svc["environment"])
    env.update(AERIE_BROKER=redis_url, AERIE_RESULT_BACKEND=redis_url, HOSTNAME=socket.gethostname())
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    log = (tmp_path / f"{service}.log").open("w")
    # a worker's alive file (--alive-file) goes to this test's folder, for the command and its check alike
    command = [part.replace("/tmp/aerie-alive", str(tmp_path / "alive")) for part in svc["command"]]
    worker = subprocess.Popen(
        command, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    health = [part.replace("/tmp/aerie-alive", str(tmp_path / "alive")) for part in svc["healthcheck"]["test"]]
    assert health[0] == "CMD-SHELL"
    log_path = tmp_path / f"{service}.log"
    try:
        deadline, answered = time.monotonic() + 120, None
        # wait with a quick ping first: the healthcheck's own 20 s timeout is spent on a worker still starting
        app = svc["command"][svc["command"].index("-A") + 1]
        quick = ["celery", "-A", app, "inspect", "ping", "-d", f"celery@{env['HOSTNAME']}", "--timeout", "1"]
        while time.monotonic() < deadline and worker.poll() is None:
            if subprocess.run(quick, env=env, capture_output=True, timeout=60, cwd=tmp_path).returncode == 0:
                break
            time.sleep(1)
        while time.monotonic() < deadline and worker.poll() is None:
            probe = subprocess.run(
                ["sh", "-c", unescape(health[1])], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path
            )
            if probe.returncode == 0:
                answered = probe.stdout
                break
            time.sleep(2)
        log.flush()
        assert answered is not None, (
            f"{service}: healthcheck never passed (worker exit {worker.poll()}):\n{log_path.read_text()[-3000:]}"
        )
        if "inspect ping" in health[1]:
            assert "pong" in answered
        else:  # a probe of the alive file: the worker's removes it as it stops
            os.killpg(worker.pid, signal.SIGTERM)
            worker.wait(timeout=60)
            after = subprocess.run(["sh", "-c", unescape(health[1])], capture_output=True, timeout=60, cwd=tmp_path)
            assert after.returncode != 0, f"{service}: healthcheck passes with no worker"
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait(timeout=30)
        log.close()


def test_a_stopped_compose_extractor_hands_its_task_back_at_once(
    compose_services, private_redis, s3_store, smollm2_path, tmp_path
):
    """`docker compose stop` (or a KEDA scale-down) sends SIGTERM: the compose worker (REMAP_SIGTERM,
    worker.soft_shutdown_timeout) gives its task the soft timeout, then puts it back on the queue and
    exits -- instead of holding it until SIGKILL and the visibility timeout (an hour) hands it on."""
    import redis

    svc = compose_services["extractor"]
    command = svc["command"]
    assert (
        command[-2:] == ["--", "worker.soft_shutdown_timeout=90"] and svc["environment"]["REMAP_SIGTERM"] == "SIGQUIT"
    )
    soft_s = 2
    env = clean_env(
        **{
            **svc["environment"],
            **store_env(s3_store),
            "AERIE_BROKER": private_redis,
            "AERIE_RESULT_BACKEND": private_redis,
            "AERIE_ENGINE_URLS": f'["http://127.0.0.1:{free_port()}"]',
            "HOSTNAME": socket.gethostname(),
        }
    )
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    log_path = tmp_path / "extractor.log"
    with open(log_path, "w") as log:
        worker = subprocess.Popen(
            [*command[:-1], f"worker.soft_shutdown_timeout={soft_s}"],
            env=env,
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        from aerie.contracts import IngestRequest
        from aerie.queue import INGEST_TASK, make_app
        from aerie.settings import Settings

        app = make_app(Settings(broker=private_redis))
        request = IngestRequest(run="held", dataset="datasets/none.jsonl", model=str(smollm2_path), engine="sglang")
        app.send_task(INGEST_TASK, kwargs=request.model_dump(mode="json"))
        # the task runs: it waits for the (absent) SGLang server
        wait_until(
            lambda: "is down" in log_path.read_text(),
            120,
            "the ingest task waiting for SGLang",
            details=lambda: log_path.read_text()[-3000:],
        )
        stopped = time.monotonic()
        worker.send_signal(signal.SIGTERM)  # what Docker and the kubelet send to the container's process
        worker.wait(timeout=60)
        took = time.monotonic() - stopped
        assert soft_s <= took < 30, f"the worker took {took:.1f} s to stop:\n{log_path.read_text()[-3000:]}"
        client = redis.Redis.from_url(private_redis)
        queued = [json.loads(m)["headers"]["task"] for m in client.lrange("ingest", 0, -1)]
        assert queued == [INGEST_TASK], f"the task is back on its queue: {queued}, unacked {client.hlen('unacked')}"
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=30)
