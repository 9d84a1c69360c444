"""`progress --run` shows a run's training jobs beside its extraction: what their rank 0 records in
the store (`runs/<run>/training/<train-id>.json`), read without the trainer, in 80 columns, and
where their TensorBoard files are; a job that gave up says so. `--watch` follows a planned run
until the controller calls it done (its drafter published), and an unknown run is refused.

The stages are not run by the watch test: their records are written by hand, as in
tests/shared/test_controller.py (the flows with real workers: tests/extractor, tests/pipeline)."""

from __future__ import annotations

import subprocess
import time

from aerie import controller, layout
from aerie.contracts import DrafterLineage, PlannedTraining, RunSpec, TrainConfig, TrainRequest
from aerie.settings import Settings
from aerie.training import mark_failed, trainings
from aerie_extractor.cli import WATCH_POLL_S
from aerie_trainer.tracking import Tracking
from tests.extractor.test_cli import celery, one_line
from tests.services import clean_env
from tests.shared.test_controller import ingest, write_run_spec, write_shard
from tests.workers import CELERY, EXTRACTOR_APP, celery_cli, worker_env


def test_progress_shows_the_training_of_a_run(s3_store, redis_url):
    tracking = Tracking(s3_store, "chat-eagle3-1234", "chat-eagle3", ["r1", "r2"], [], {}, "fsdp", 8)
    tracking.progress(step=150, steps=600, loss=2.5, eta_s=5400.0, tokens_per_second=812.4, force=True)
    tracking.checkpointed(150)
    assert [t.step for t in trainings(s3_store, "r2")] == [150]

    out = celery_cli(worker_env(s3_store, redis_url, COLUMNS="80"), "progress", "--run", "r1")
    assert max(map(len, out.splitlines())) <= 80, out
    for needle in (
        "run r1",
        "rejects",
        "complete",
        "training",
        "chat-eagle3-",
        "1234",
        "150/600",
        "2.500",
        "812",
        "90 min",
        "8 fsdp",
        " 150 ",
    ):
        assert needle in out, (needle, out)  # whole cells: only the train id may fold
    assert "no TensorBoard files" in out  # no tracker was named here: none announced

    mark_failed(s3_store, "chat-eagle3-1234", "chat-eagle3", ["r1", "r2"], "RankFailed: rank 3 died")
    (record,) = trainings(s3_store, "r1")
    assert (record.stage, record.step, record.message) == ("failed", 150, "RankFailed: rank 3 died")


def test_progress_watch_follows_a_run_to_its_published_drafter_and_refuses_an_unknown_run(fs_store):
    env = clean_env(AERIE_STORE=fs_store.url, COLUMNS="80")
    one_line(celery(env, "progress", "--run", "nosuchrun"), "no run 'nosuchrun'", "AERIE_STORE")
    train = TrainRequest(runs=["r"], drafter="d", model="/models/target", config=TrainConfig(steps=2))
    st = controller.start(
        fs_store, Settings(store=fs_store.url), controller.new_plan(ingest()), [PlannedTraining(train=train)],
        controller.InProcess(),
    )  # fmt: skip
    train = controller.follow(PlannedTraining(train=train), st.plan).train  # as the controller planned it
    watch = subprocess.Popen(
        [CELERY, "-A", EXTRACTOR_APP, "progress", "--run", "r", "--watch", "--timeout", "120"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        write_run_spec(fs_store)
        write_shard(fs_store, "tokens", "000000")
        write_shard(fs_store, "hidden", "000000")  # extraction ends: the training's turn
        tracking = Tracking(fs_store, train.resolved_train_id, "d", ["r"], [], {}, "single", 1)
        tracking.progress(step=1, steps=2, loss=3.25, eta_s=5.0, tokens_per_second=100.0, force=True)
        time.sleep(4 * WATCH_POLL_S)
        assert watch.poll() is None, watch.communicate()  # still following: the drafter is not out yet
        tracking.progress(step=2, stage="publish")
        spec = fs_store.get_json(layout.run_spec("r"), RunSpec)
        lineage = DrafterLineage(
            name="d", version=train.version, runs=["r"], target=spec.target, engine=spec.engine,
            capture_points=spec.capture_points, exported_layer_ids=[2, 15, 27], exported_convention="sglang",
            draft_vocab_size=32000, config=train.config, metrics={}, files={},
        )  # fmt: skip
        fs_store.put_json(layout.drafter_lineage("d", train.version), lineage)
        out, err = watch.communicate(timeout=60)
    finally:
        watch.kill()
    assert watch.returncode == 0, out + err
    assert "run r: done" in out and "training d" in out, out
    assert f"published d:{train.version}: aerie pull d:{train.version} DEST" in out, out
