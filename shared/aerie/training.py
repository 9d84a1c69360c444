"""Training jobs as the store shows them, for every command that watches one (no trainer import).

- `trainings(store, run)`: the progress records of the jobs training on a run
  (`runs/<run>/training/<train-id>.json`, written by the job's rank 0), newest first.
- `mark_failed(store, train_id, runs, error)`: a job that gave up says so in its records.
- `logs_hint(store_url, prefix)`: where a job's TensorBoard files are and how to look at them.
- the records as a table: `aerie.app.views.progress_table`.
"""

from __future__ import annotations

from aerie import layout
from aerie.contracts import TrainProgress
from aerie.store import NotFound, ObjectStore


def trainings(store: ObjectStore, run: str) -> list[TrainProgress]:
    records = []
    for train_id in layout.train_progress_ids(run, store.list(layout.train_progress_prefix(run))):
        try:
            records.append(store.get_json(layout.train_progress(run, train_id), TrainProgress))
        except NotFound:
            pass
    return sorted(records, key=lambda r: r.updated_at, reverse=True)


def mark_failed(store: ObjectStore, train_id: str, drafter: str, runs: list[str], error: str) -> None:
    for run in runs:
        key = layout.train_progress(run, train_id)
        try:
            record = store.get_json(key, TrainProgress)
        except NotFound:
            record = TrainProgress(train_id=train_id, drafter=drafter, runs=runs, stage="failed")
        store.put_json(key, record.model_copy(update={"stage": "failed", "message": error[:500]}))


def logs_hint(store_url: str, prefix: str | None) -> str:
    """One or two lines: the TensorBoard folder in the store (`store_url`: the store's own URL,
    bucket included) and the command that copies it here and shows it (`aerie logs`: the
    settings' store client, nothing else to configure)."""
    if not prefix:
        return "no TensorBoard files (AERIE_TRAIN_TRACKERS leaves tensorboard out)"
    if store_url.startswith("file://"):
        folder = store_url.removeprefix("file://").rstrip("/") + "/" + prefix
        return f"TensorBoard: tensorboard --logdir {folder}"
    train_id = prefix.removeprefix("checkpoints/").split("/", 1)[0]
    return (
        f"TensorBoard files: {store_url.rstrip('/')}/{prefix}\n"
        f"  aerie logs {train_id} ./tb && tensorboard --logdir ./tb"
    )


def published_lines(published: list[tuple[str, str]]) -> list[str]:
    """For each published (drafter, version): the command that fetches it."""
    return [f"published {name}:{version}: aerie pull {name}:{version} DEST" for name, version in published]
