"""The extractor's Celery surface without worker processes: lazy app, CLI surface, eager mode.

- Importing the extractor's modules reads no settings and connects to nothing.
- The sub-commands registered through `celery.commands` keep a fixed set of flags.
- With the embedded `memory://` broker the same task code runs in-process: the run controller's
  first step enqueued, each task's end advances the run, and training is enqueued exactly once.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from aerie import controller, layout
from aerie.contracts import IngestOptions, IngestRequest, PlannedTraining, TrainRequest
from aerie.queue import INGEST_TASK, make_app
from aerie.settings import Settings
from tests.runs import DATA
from tests.services import clean_env

CELERY = str(Path(sys.executable).with_name("celery"))


def test_importing_the_extractor_reads_no_settings():
    code = (
        "import aerie_extractor.worker as w, aerie_extractor.tasks, aerie_extractor.cli, aerie_extractor.ingest, "
        "aerie_extractor.extract, aerie_extractor.engines\n"
        "try:\n    w.app\nexcept SystemExit as e:\n    print('refused:', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=clean_env(AERIE_TYPO="1"), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    # the import succeeded with a bad variable set; only building the app read (and refused) it
    assert "refused: Error: unknown setting(s) AERIE_TYPO" in out.stdout


def test_cli_surface():
    out = subprocess.run(
        [CELERY, "-A", "aerie_extractor.worker", "--help"], env=clean_env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "enqueue" in out.stdout and "progress" in out.stdout
    out = subprocess.run(
        [CELERY, "-A", "aerie_extractor.worker", "enqueue", "--help"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    flags = sorted(
        {f for pair in re.findall(r"^  (--[a-z-]+)(?: / (--[a-z-]+))?", out.stdout, re.M) for f in pair if f}
    )
    training = [
        "--batch-tokens",
        "--draft-vocab",
        "--drafter-arch",
        "--drafter-shape",
        "--epochs",
        "--eval-every",
        "--init-from",
        "--lr",
        "--preset",
        "--publish-checkpoint",
        "--seq-len",
        "--speculative-num-steps",
        "--steps",
        "--stream",
        "--train-config",
        "--ttt-steps",
    ]  # aerie.presets.train_options
    assert flags == sorted(
        [
            "--capture-points",
            "--dataset",
            "--debug",
            "--dtype",
            "--storage-dtype",
            "--scale-block",
            "--engine",
            "--fan-out",
            "--help",
            "--loss-on",
            "--max-record-bytes",
            "--max-records",
            "--max-tokens",
            "--model",
            "--no-fan-out",
            "--no-upload",
            "--overlong",
            "--run",
            "--shard-tokens",
            "--target-signal",
            "--topk",
            "--train-drafter",
            "--upload",
            "--wait",
            "--server",
            "--allow-misaligned",
            *training,
            "--regenerate",
            "--regenerate-max-tokens",
            "--regenerate-max-turns",
            "--regenerate-reasoning",  # the regenerate stage
            "--regenerate-temperature",
            "--regenerate-shard-records",
        ]
    ), flags
    bad = subprocess.run(
        [
            CELERY,
            "-A",
            "aerie_extractor.worker",
            "enqueue",
            "--dataset",
            "x",
            "--run",
            "r",
            "--model",
            "m",
            "--capture-points",
            "2,a",
        ],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "comma-separated layer numbers" in bad.stderr
    bad = subprocess.run(
        [
            CELERY,
            "-A",
            "aerie_extractor.worker",
            "enqueue",
            "--dataset",
            "x",
            "--run",
            "r",
            "--model",
            "m",
            "--regenerate-max-turns",
            "2",
        ],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        bad.returncode != 0 and "--regenerate-max-turns is a setting of --regenerate: add --regenerate" in bad.stderr
    ), bad.stderr


def test_eager_app_runs_the_same_tasks_and_trains_once(tmp_path, smollm2_path):
    settings = Settings(store=f"file://{tmp_path / 'store'}", broker="memory://", engine="hf", ingest_local_dirs=[DATA])
    app = make_app(settings, include=["aerie_extractor.tasks"])
    app.loader.import_default_modules()
    request = IngestRequest(
        run="eager",
        dataset=str(DATA / "malformed.jsonl"),
        model=str(smollm2_path),
        capture_points=[2, 15, 27],
        options=IngestOptions(max_tokens=96, shard_tokens=64),
    )
    training = PlannedTraining(train=TrainRequest(runs=["eager"], drafter="d-eager", model=str(smollm2_path)))
    from aerie.runs import run_status
    from aerie.store import FsStore

    store = FsStore(tmp_path / "store")
    dispatcher = controller.OnWorkers(app, settings, "test")
    controller.start(store, settings, controller.new_plan(request), [training], dispatcher)
    ((step, task, sent),) = dispatcher.results  # the first step; the tasks enqueue the rest
    result = sent.get()
    assert (step.kind, task) == ("ingest", INGEST_TASK)
    assert result["fanned_out"] == len(result["shards"]) == 3
    status = run_status(store, "eager")
    assert status.complete and status.hidden_done == 3 and status.rejects == 8
    # a redelivered extract of a finished run neither redoes the shard nor trains again
    again = app.tasks["aerie.extract"].apply_async(kwargs={"run": "eager", "shard": "000000"}).get()
    assert again["skipped"] and not again["train_enqueued"]
    assert store.exists(layout.shard_record("eager", "hidden", "000002"))
    # the progress command shows the run as a table
    shown = subprocess.run(
        [CELERY, "-A", "aerie_extractor.worker", "progress", "--run", "eager"],
        env=clean_env(AERIE_STORE=f"file://{tmp_path / 'store'}"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    assert "run eager" in shown.stdout and "yes" in shown.stdout, shown.stdout
    # a refused extraction fails at once (no retry) and is counted by the run's status
    from aerie_extractor.extract import ExtractError

    with pytest.raises(ExtractError, match="no token shard '000099'"):
        app.tasks["aerie.extract"].apply_async(kwargs={"run": "eager", "shard": "000099"}).get()
    assert run_status(store, "eager").failed == 1
    assert "ExtractError" in store.get_bytes(layout.shard_failure("eager", "000099")).decode()
    # aerie.train is not registered here: it went to the (in-memory) train queue, once
    with app.connection_for_read() as conn:
        queue = conn.SimpleQueue("train")
        assert queue.qsize() == 1
        message = queue.get(timeout=5)
        assert message.headers["task"] == "aerie.train" and message.payload[1]["drafter"] == "d-eager"
        queue.close()
