"""The deployment's runtime against a real SGLang server on the CPU (one server, restarted once):

- the guide's `aerie bench` command runs in an environment holding exactly the extractor image's
  requirement list (tests/deploy/image_env.py), against the server;
- two extractor workers extract a run while the server is stopped and started again mid-run:
  the run completes with no failed shard and no retry spent (they wait for /health), and the
  target's weights were hashed once for both, nothing written into the model folder.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from aerie.runs import run_status
from scripts.deploy_checks.docs import compose_command, shell_commands
from tests.deploy.image_env import image_env
from tests.deploy.servers import POINTS
from tests.services import REPO, wait_until
from tests.workers import ExtractorWorker, celery_cli, wait_complete, worker_env

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def test_the_guides_bench_command_runs_in_the_extractor_image(deploy_sglang, tmp_path):
    """docs/deploy.md §10 runs `aerie bench` in the extractor container: its MT-bench prompts must be
    in that image (they were only in requirements-data.txt)."""
    guide = (REPO / "docs" / "deploy.md").read_text()
    line, argv = next(
        (line, argv)
        for line, argv in shell_commands(guide)
        if argv[:2] == ["docker", "compose"] and compose_command(argv)[2][:2] == ["aerie", "bench"]
    )
    assert compose_command(argv)[1][0] == "extractor", line
    command = compose_command(argv)[2]
    command[command.index("--url") + 1] = deploy_sglang.url
    command += ["--limit", "1", "--max-tokens", "1", "--json", str(tmp_path / "bench.json")]  # a CPU server: one token
    env = image_env("extractor", tmp_path / "image")
    out = subprocess.run(
        [str(Path(sys.executable).with_name("aerie")), *command[1:]],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, f"`{shlex.join(command)}` in the extractor image: {out.stderr[-2000:]}"
    assert json.loads((tmp_path / "bench.json").read_text())["prompts"] == 1


def test_extraction_waits_out_an_sglang_restart_and_hashes_the_target_once(
    deploy_sglang, sglang_target, s3_store, private_redis, tmp_path, workers
):
    sglang, target = deploy_sglang, sglang_target
    env = {
        **worker_env(
            s3_store,
            private_redis,
            AERIE_ENGINE_URLS=json.dumps([sglang.url]),
            AERIE_ENGINE_CONCURRENCY="2",
            AERIE_ENGINE_OUTAGE_WAIT_S="600",
            AERIE_CACHE_DIR=str(tmp_path / "cache"),
        ),
        "AERIE_ENGINE": "sglang",
    }
    before = sorted(p.name for p in target.iterdir())
    workers += [ExtractorWorker(env, f"x{i}", tmp_path) for i in range(2)]
    dataset = tmp_path / "chat.jsonl"
    dataset.write_text(
        "".join(
            json.dumps(
                {
                    "conversations": [
                        {"from": "human", "value": f"Count from {i} to {i + 6}, in words."},
                        {"from": "gpt", "value": " ".join(str(n) for n in range(i, i + 7))},
                    ]
                }
            )
            + "\n"
            for i in range(12)
        )
    )
    celery_cli(
        env,
        "enqueue",
        "--dataset",
        str(dataset),
        "--run",
        "outage",
        "--model",
        str(target),
        "--capture-points",
        ",".join(map(str, POINTS)),
        "--target-signal",
        "topk",
        "--topk",
        "4",
        "--shard-tokens",
        "64",
        "--dtype",
        "float32",
    )
    logs = lambda: "\n".join(w.log()[-2000:] for w in workers)
    wait_until(
        lambda: s3_store.exists("runs/outage/run.json") and run_status(s3_store, "outage").hidden_done >= 2,
        300,
        "the first shards extracted",
        poll=0.5,
        details=logs,
    )
    sglang.stop()  # mid-run: requests in flight are dropped, new ones refused
    assert not run_status(s3_store, "outage").complete, "the run must still be going when SGLang stops"
    sglang.start()  # a new server on the same port (~25 s: longer than the first retries' backoff)

    status = wait_complete(s3_store, "outage", workers, 600)
    assert status.failed == 0 and status.hidden_done == status.shards_total > 2
    text = "\n".join(w.log() for w in workers)
    assert re.search(r"SGLang server \S+ is down .*waiting up to 600 s", text), "the outage was waited out"
    assert "is back after the outage" in text
    assert not re.search(r"aerie\.extract failed .*: retry", text), "no retry spent on the outage"
    hashed = text.count("sha256 of 1 weight files")
    assert hashed == 1, f"the target's weights were hashed {hashed} times across the two workers"
    assert sorted(p.name for p in target.iterdir()) == before, "nothing may be written into the model folder"


def test_a_run_sglang_cannot_serve_is_refused_at_ingest(deploy_sglang, sglang_target, tmp_path):
    """Without aerie's plugin (or a sink the extractor reads: Kubernetes before AERIE_ENGINE_SINK=s3)
    SGLang answers in JSON, which has no final state: the default target_signal 'final' is refused
    when the run is ingested, naming the fix, not on every shard afterwards."""
    from aerie import stages
    from aerie.contracts import IngestRequest
    from aerie.settings import Settings
    from aerie.store import FsStore
    from aerie_extractor.ingest import IngestError

    store = FsStore(tmp_path / "store")
    settings = Settings(store=f"file://{store.root}", engine="sglang", engine_urls=[deploy_sglang.url])
    request = IngestRequest(
        run="k8s", dataset="datasets/chat.jsonl", model=str(sglang_target), engine="sglang", capture_points=POINTS
    )
    with pytest.raises(IngestError, match="wants target_signal 'final'.*AERIE_ENGINE_SINK=s3.*target_signal 'topk'"):
        stages.ingest(store, settings, request)
    assert not store.exists("runs/k8s/run.json")
