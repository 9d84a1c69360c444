"""Training jobs as the store shows them, for every command that watches one (no trainer import).

- `trainings(store, run)`: the progress records of the jobs training on a run
  (`runs/<run>/training/<train-id>.json`, written by the job's rank 0), newest first.
- `mark_failed(store, train_id, runs, error)`: a job that gave up says so in its records.
- `logs_hint(store_url, prefix)`: where a job's TensorBoard files are and how to look at them.
- `progress_table(records)`: the records as a rich table (`progress --run`, `aerie run`), and
  `published_lines(drafters)`: the published versions and how to pull them.
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
    """One or two lines: the TensorBoard folder in the store, and the command that shows it."""
    if not prefix:
        return "no TensorBoard files (AERIE_TRAIN_TRACKERS leaves tensorboard out)"
    if store_url.startswith("file://"):
        folder = store_url.removeprefix("file://").rstrip("/") + "/" + prefix
        return f"TensorBoard: tensorboard --logdir {folder}"
    return (
        f"TensorBoard files: {store_url}/{prefix}\n"
        f"  mc cp --recursive aerie/<bucket>/{prefix} ./tb && tensorboard --logdir ./tb"
    )


def progress_table(records: list[TrainProgress]):
    """One row a job, readable in 80 columns: the train id folds, every other cell stays whole
    (the drafter is named where the train id does not start with it; `updated` is UTC)."""
    from rich import box
    from rich.table import Table

    table = Table(title="training", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True)
    table.add_column("train id", overflow="fold", min_width=12)
    for col in ("stage", "step", "loss", "tok/s", "ETA", "ranks", "ckpt", "updated"):
        table.add_column(col, justify="left" if col in ("stage", "ranks") else "right", no_wrap=True)
    for r in records:
        step = f"{r.step}/{r.steps}" if r.steps else str(r.step)
        eta = (
            "-"
            if r.eta_s is None or r.stage != "train"
            else f"{r.eta_s / 60:.0f} min"
            if r.eta_s >= 60
            else f"{r.eta_s:.0f} s"
        )
        table.add_row(
            r.train_id if r.train_id.startswith(r.drafter) else f"{r.train_id} ({r.drafter})",
            r.stage,
            step,
            "-" if r.loss is None else f"{r.loss:.3f}",
            "-" if r.tokens_per_second is None else f"{r.tokens_per_second:.0f}",
            eta,
            f"{r.ranks} {r.sharding}" if r.sharding != "single" else str(r.ranks),
            "-" if r.checkpoint_step is None else str(r.checkpoint_step),
            r.updated_at[11:19],
        )
    return table


def published_lines(published: list[tuple[str, str]]) -> list[str]:
    """For each published (drafter, version): the command that fetches it."""
    return [f"published {name}:{version}: aerie pull {name}:{version} DEST" for name, version in published]
