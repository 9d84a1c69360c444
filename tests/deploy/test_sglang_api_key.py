"""SGLang's API key reaches the server through a file only its user reads (SGLang's `--config` YAML),
never through its argv, which every user of the host sees (`ps`, /proc/PID/cmdline). Run for real:
compose's generate script, as its shell runs it, starting a real SGLang (CPU) on a small model; the
key is enforced (401 without it) and appears in no process's command line."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx

from aerie.app.launcher import free_port
from tests.sglang_server import CPU_ARGS, START_TIMEOUT_S, sglang_python

KEY = "k3y-with-'quote-and-$dollar"


def _cmdlines(pgid: int) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.getpgid(int(proc.name)) != pgid:
                continue
            found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except (OSError, ProcessLookupError):
            continue
    return found


def test_the_api_key_is_enforced_and_in_no_command_line(compose_services, sglang_target, tmp_path):
    (shell, flag, script) = compose_services["inference-generate"]["command"]
    assert (shell, flag) == ("sh", "-c")
    script = script.replace("$$", "$")  # Compose's render keeps its escape
    assert "--api-key" not in script[script.index("exec ") :], "the key on SGLang's command line"
    port = free_port()
    python = sglang_python()
    script = script.replace("python3 -m sglang.launch_server", f"{shlex.quote(str(python))} -m aerie_sglang.cpu.launch")
    script = script.replace("/models/target", shlex.quote(str(sglang_target)))
    script = script.replace("--host 0.0.0.0 --port 30000", f"--host 127.0.0.1 --port {port}")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AERIE_", "VIRTUAL_ENV", "PYTHON"))}
    env |= {
        "SGLANG_API_KEY": KEY,
        "TP_SIZE": "1",
        "SERVED_MODEL_NAME": "target",
        "GENERATE_MAX_RUNNING": "8",
        "SGLANG_EXTRA_ARGS": " ".join([*CPU_ARGS, "--dtype", "float32"]),
        "TMPDIR": str(tmp),
    }
    log = tmp_path / "sglang.log"
    proc = subprocess.Popen(
        ["sh", "-c", script],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        with httpx.Client(timeout=10) as client:
            while True:
                assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
                assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
                try:
                    if client.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(1)
            assert client.get(url + "/v1/models").status_code == 401, "the key is not enforced"
            assert client.get(url + "/v1/models", headers={"Authorization": "Bearer other"}).status_code == 401
        lines = _cmdlines(proc.pid)
        assert len(lines) >= 2, lines  # the server and its scheduler/detokenizer processes
        assert not [line for line in lines if KEY in line or "k3y" in line], "the key is in a command line"
        (secret,) = [f for f in tmp.iterdir() if f.suffix == ".yaml"]  # SGLang writes its own files there too
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    finally:
        try:
            os.killpg(proc.pid, 15)
            proc.wait(60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, 9)


STUB = """
import json, os, stat, sys
import yaml
argv = sys.argv[1:]
path = argv[argv.index("--config") + 1]
print(json.dumps({"argv": argv, "config": yaml.safe_load(open(path)), "mode": stat.S_IMODE(os.stat(path).st_mode)}))
"""


def _scripts(compose_services) -> dict[str, str]:
    """Every SGLang container script: compose's three modes and k8s's (base, serve component)."""
    import yaml

    from tests.services import REPO

    found = {
        n: compose_services[n]["command"][2].replace("$$", "$")
        for n in ("inference-capture", "inference-serve", "inference-generate")
    }
    for rel in ("k8s/base/inference.yaml", "k8s/base/generate.yaml", "k8s/components/serve/serve.yaml"):
        for doc in yaml.safe_load_all((REPO / rel).read_text()):
            if doc and doc.get("kind") == "Deployment":
                found[rel] = doc["spec"]["template"]["spec"]["containers"][0]["command"][2]
    return found


def test_every_sglang_script_hands_the_key_over_in_a_private_file(compose_services, tmp_path):
    """Each script as its shell runs it, SGLang replaced by a program that reports its argv and reads
    the --config file as SGLang's ConfigArgumentMerger does (YAML; `api-key` names --api-key)."""
    import json

    stub = tmp_path / "stub.py"
    stub.write_text(STUB)
    drafter = tmp_path / "drafters" / "d"
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text("{}")
    for name, script in _scripts(compose_services).items():
        script = script.replace("python3 -m sglang.launch_server", f"{sys.executable} {stub}")
        script = script.replace("/drafters/", f"{tmp_path}/drafters/")
        tmp = tmp_path / name.replace("/", "_")
        tmp.mkdir()
        env = {
            "PATH": os.environ["PATH"],
            "TMPDIR": str(tmp),
            "SGLANG_API_KEY": KEY,
            "CAPTURE_LAYER_IDS": "1,14,26",
            "DRAFTER_NAME": "d",
            "DRAFTER": "d",
        }
        out = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, (name, out.stderr[-2000:])
        report = json.loads(out.stdout.strip().splitlines()[-1])
        assert not [a for a in report["argv"] if "k3y" in a], (name, report["argv"])
        assert report["config"] == {"api-key": KEY}, (name, report["config"])
        assert report["mode"] == 0o600, name
