"""docs/deploy.md's `aerie bench --sweep` command, run as the inference container would run it: the
part after the service name, in SGLang's own package set plus exactly what the inference image adds
(tests/deploy/image_env.py: inference_env), with the container's TP_SIZE. No server can start here
(no /models/target): the sweep must get as far as launching the guide's server command, with the
container's TP size in it, and say in one line that it exited."""

from __future__ import annotations

import os
import re
import shlex
import subprocess

from tests.deploy.image_env import SGLANG_PYTHON, inference_env
from tests.services import REPO

GUIDE = (REPO / "docs" / "deploy.md").read_text()


def guide_command() -> list[str]:
    (line,) = [ln for ln in GUIDE.splitlines() if ln.startswith("docker compose") and "aerie bench --sweep" in ln]
    return shlex.split(line)  # as the host's shell splits it (quotes removed, nothing expanded by it)


def test_the_guides_sweep_leaves_tp_size_to_the_container():
    words = guide_command()
    service = words.index("inference-serve")
    host, container = words[:service], words[service + 1 :]
    assert not any("$" in w for w in host), host
    assert container[:2] == ["sh", "-c"] and "$TP_SIZE" in container[2], "TP_SIZE must be the container's"
    assert not any(re.match(r"AERIE_S3_\w+=", w) for w in host), "a key's value on the host's command line"


def test_the_guides_sweep_runs_in_the_inference_images_package_set(tmp_path):
    container = guide_command()[guide_command().index("inference-serve") + 1 :]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "aerie").write_text(
        f'#!/bin/sh\nexec {SGLANG_PYTHON} -c "import sys; from aerie.app.cli import main; sys.argv[0] = \'aerie\'; main()" "$@"\n'
    )
    (bin_dir / "aerie").chmod(0o755)
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec {SGLANG_PYTHON} "$@"\n')  # the image's python3
    (bin_dir / "python3").chmod(0o755)
    env = inference_env(tmp_path / "image", TP_SIZE="1", PATH=f"{bin_dir}:{os.environ['PATH']}", HOME=str(tmp_path))
    out = subprocess.run(container, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    aerie_part = text.split("its log ends:")[0]  # after it: the server's own log
    assert "Traceback" not in aerie_part and "ModuleNotFoundError" not in aerie_part, text[-3000:]
    assert "No module named 'sglang'" not in text, text[-3000:]
    assert out.returncode == 1, text[-3000:]
    assert "python3 -m sglang.launch_server --model-path /models/target --tp 1 " in text, text[-3000:]
    assert "before it was healthy" in text, text[-3000:]
    # --record's store client imports there too
    record = subprocess.run(
        [str(SGLANG_PYTHON), "-c", "import minio, aerie.store, aerie.drafters, aerie.layout; print('ok')"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert record.stdout.strip() == "ok", record.stderr[-2000:]
