"""Where a training's numbers go while it runs (rank 0 only).

- TensorBoard, by default: event files written locally by `tensorboardX` and copied to the store
  under `checkpoints/<train-id>/tensorboard/` at every checkpoint and at the end, so they outlive
  the pod. A resumed job writes a new events file from the checkpoint's step on; TensorBoard reads
  every file of the folder as one run. Scalars: `loss/total`, `loss/step_<k>` (one per TTT step),
  `accuracy/step_<k>`, `lr`, `tokens_per_second`, `data_wait_fraction`, and the evaluations'
  `eval/acceptance`, `eval/simulated_acceptance`, `eval/heldout_acc_<k>` (untrained at step 0).
- wandb / MLflow, when `AERIE_TRAIN_TRACKERS` names them: the same scalars, through the installed
  package (refused by name when it is not installed; neither is a dependency of aerie).
- The progress record `runs/<run>/training/<train-id>.json` (aerie.contracts.TrainProgress): how
  far the job is, for `progress --run` and `aerie run`; written at most every PROGRESS_EVERY_S
  seconds, at each checkpoint and at each stage change.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from aerie import layout
from aerie.contracts import TrainProgress
from aerie.store import ObjectStore, StoreError

PROGRESS_EVERY_S = 10.0


class TrackerError(RuntimeError):
    """A tracker the settings name that cannot be used here."""


class TensorBoard:
    def __init__(self, store: ObjectStore, train_id: str):
        from tensorboardX import SummaryWriter

        self.store, self.train_id = store, train_id
        self.dir = Path(tempfile.mkdtemp(prefix="aerie-tensorboard-"))
        self.writer = SummaryWriter(str(self.dir), flush_secs=30)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)

    def upload(self) -> None:
        self.writer.flush()
        for path in sorted(self.dir.glob("events.out.tfevents.*")):
            self.store.put_file(layout.train_log(self.train_id, path.name), path)

    def close(self) -> None:
        self.upload()
        self.writer.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class Wandb:
    def __init__(self, train_id: str, config: dict):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project="aerie", name=train_id, id=train_id, resume="allow", config=config)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def upload(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


class Mlflow:
    def __init__(self, train_id: str, config: dict):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment("aerie")
        found = mlflow.search_runs(filter_string=f"tags.aerie_train_id = '{train_id}'", output_format="list")
        self.run = (
            mlflow.start_run(run_id=found[0].info.run_id)
            if found
            else mlflow.start_run(run_name=train_id, tags={"aerie_train_id": train_id})
        )
        if not found:
            mlflow.log_params({k: str(v)[:500] for k, v in config.items()})

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics({k.replace("/", "."): v for k, v in scalars.items()}, step=step)

    def upload(self) -> None:
        pass

    def close(self) -> None:
        self.mlflow.end_run()


PACKAGES = {"tensorboard": "tensorboardX", "wandb": "wandb", "mlflow": "mlflow"}


class Tracking:
    """The trackers the settings name, and the job's progress record."""

    def __init__(
        self,
        store: ObjectStore,
        train_id: str,
        drafter: str,
        runs: list[str],
        trackers: list[str],
        config: dict,
        sharding: str,
        ranks: int,
    ):
        import importlib.util

        self.store, self.train_id = store, train_id
        missing = [PACKAGES[t] for t in trackers if importlib.util.find_spec(PACKAGES[t]) is None]
        if missing:
            raise TrackerError(
                f"AERIE_TRAIN_TRACKERS names {trackers} but {', '.join(missing)} is not installed here: "
                f"pip install {' '.join(missing)}, or leave it out of AERIE_TRAIN_TRACKERS"
            )
        self.trackers = [
            TensorBoard(store, train_id)
            if t == "tensorboard"
            else Wandb(train_id, config)
            if t == "wandb"
            else Mlflow(train_id, config)
            for t in trackers
        ]
        self.logs = layout.train_logs_prefix(train_id) if "tensorboard" in trackers else None
        self.record = TrainProgress(
            train_id=train_id, drafter=drafter, runs=runs, stage="train", sharding=sharding, ranks=ranks, logs=self.logs
        )
        self._written = 0.0

    def log(self, scalars: dict[str, float], step: int) -> None:
        for tracker in self.trackers:
            tracker.log(scalars, step)

    def checkpointed(self, step: int) -> None:
        """A checkpoint is complete: the event files so far go to the store with it."""
        for tracker in self.trackers:
            tracker.upload()
        self.progress(checkpoint_step=step, force=True)

    def progress(self, force: bool = False, **fields) -> None:
        """Update the progress record; written when forced, on a stage change, or every few seconds."""
        changed = fields.get("stage", self.record.stage) != self.record.stage
        self.record = self.record.model_copy(
            update={**fields, "updated_at": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())}
        )
        now = time.monotonic()
        if force or changed or now - self._written >= PROGRESS_EVERY_S:
            self._written = now
            for run in self.record.runs:
                try:
                    self.store.put_json(layout.train_progress(run, self.train_id), self.record)
                except StoreError:  # progress is informative: a store hiccup must not stop training
                    pass

    def close(self) -> None:
        """Never raises: called while an error may be on its way up (the store's own failure included)."""
        import logging

        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception:
                logging.getLogger(__name__).exception(
                    "closing the %s tracker of %s failed", type(tracker).__name__, self.train_id
                )
        self.trackers = []
