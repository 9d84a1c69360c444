"""`aerie` commands when something is wrong: one line naming the cause and the setting, exit 1,
no traceback (`aerie --debug` shows it); and `aerie run` makes a valid run name of any file name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from aerie.app.pipeline import run_name_for
from aerie.contracts import IngestRequest
from tests.services import clean_env, free_port, store_env

AERIE = str(Path(sys.executable).with_name("aerie"))


def aerie(env: dict[str, str], *args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([AERIE, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def one_line(out: subprocess.CompletedProcess, *names: str) -> str:
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


def test_aerie_run_names_a_run_after_any_file_name():
    for path, name in [
        ("/data/my chat data.jsonl", "my-chat-data-quick-32"),
        ("Été: 100%.json", "t-100-quick-32"),
        ("/x/...jsonl", "dataset-quick-32"),
    ]:
        assert run_name_for(path, "quick-32") == name
        IngestRequest(run=name, dataset="d", model="m")  # the contracts' name pattern accepts it


def test_cli_failures_are_one_line_aerie_run_my_chat_data_broker_down(tmp_path, smollm2_path):
    """A dataset named `my chat data.jsonl`, Redis down: the run name is derived, the broker is
    named, and nothing is uploaded before the broker is reached."""
    dataset = tmp_path / "my chat data.jsonl"
    dataset.write_text(
        json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hey."}]}) + "\n"
    )
    store = tmp_path / "store"
    out = aerie(
        clean_env(AERIE_CACHE_DIR=str(smollm2_path.parent)),
        "run",
        "--quick",
        "--dataset",
        str(dataset),
        "--model",
        str(smollm2_path),
        "--store",
        f"file://{store}",
        "--broker",
        f"redis://127.0.0.1:{free_port()}/0",
        cwd=tmp_path,
    )
    one_line(out, "unreachable", "AERIE_BROKER")
    assert not (store / "datasets").exists()


def test_cli_failures_are_one_line_aerie_run_missing_dataset(tmp_path, smollm2_path):
    out = aerie(
        clean_env(AERIE_CACHE_DIR=str(smollm2_path.parent)),
        "run",
        "--quick",
        "--dataset",
        "my chta.jsonl",
        "--model",
        str(smollm2_path),
        "--store",
        f"file://{tmp_path / 'store'}",
        cwd=tmp_path,
    )
    one_line(out, "my chta.jsonl", "no such file")


def test_cli_failures_are_one_line_aerie_pull(s3_store, tmp_path):
    wrong = clean_env(**{**store_env(s3_store), "AERIE_S3_SECRET_KEY": "wrong"})
    one_line(aerie(wrong, "pull", "smol", str(tmp_path / "d")), "refused the credentials", "AERIE_S3_SECRET_KEY")
    gone = clean_env(AERIE_STORE=f"http://127.0.0.1:{free_port()}", AERIE_S3_ACCESS_KEY="k", AERIE_S3_SECRET_KEY="s")
    one_line(aerie(gone, "pull", "smol", str(tmp_path / "d")), "unreachable", "AERIE_STORE")
    out = aerie(gone, "--debug", "pull", "smol", str(tmp_path / "d"))
    assert out.returncode != 0 and "Traceback" in out.stderr and "AERIE_STORE" in out.stderr


def test_model_prepare_prints_the_packaged_models_folder(smollm2_path):
    """`aerie model prepare smollm2-135m` prints the folder to pass to --model; an unknown name is refused."""
    env = clean_env(AERIE_CACHE_DIR=str(smollm2_path.parent))
    out = aerie(env, "model", "prepare", "smollm2-135m")
    assert out.returncode == 0 and out.stdout == f"{smollm2_path}\n", out.stderr
    one_line(aerie(env, "model", "prepare", "gpt2"), "'gpt2'", "smollm2-135m")
