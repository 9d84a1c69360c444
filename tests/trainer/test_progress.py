"""`progress --run` shows a run's training jobs beside its extraction: what their rank 0 records in
the store (`runs/<run>/training/<train-id>.json`), read without the trainer, and where their
TensorBoard files are; a job that gave up says so."""

from __future__ import annotations

from aerie.training import mark_failed, trainings
from aerie_trainer.tracking import Tracking
from tests.workers import celery_cli, worker_env


def test_progress_shows_the_training_of_a_run(s3_store, redis_url):
    tracking = Tracking(s3_store, "chat-eagle3-1234", "chat-eagle3", ["r1", "r2"], [], {}, "fsdp", 8)
    tracking.progress(step=150, steps=600, loss=2.5, eta_s=5400.0, tokens_per_second=812.4, force=True)
    tracking.checkpointed(150)
    assert [t.step for t in trainings(s3_store, "r2")] == [150]

    out = celery_cli(worker_env(s3_store, redis_url, COLUMNS="200"), "progress", "--run", "r1")
    for needle in ("training", "chat-eagle3-1234", "150/600", "2.500", "812", "90 min", "8 fsdp"):
        assert needle in out, (needle, out)
    assert "no TensorBoard files" in out  # no tracker was named here: none announced

    mark_failed(s3_store, "chat-eagle3-1234", "chat-eagle3", ["r1", "r2"], "RankFailed: rank 3 died")
    (record,) = trainings(s3_store, "r1")
    assert (record.stage, record.step, record.message) == ("failed", 150, "RankFailed: rank 3 died")
