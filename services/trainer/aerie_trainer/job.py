"""The `train` stage: hidden shards -> a trained, evaluated, exported and published drafter.

    aerie train --runs sharegpt --drafter smollm2-eagle3 --model /path/to/target   # one process
    torchrun --nproc_per_node 8 -m aerie.cli train --runs sharegpt --drafter NAME --model M   # DDP
    celery -A aerie_trainer.worker call aerie.train --kwargs '{"runs": ["sharegpt"], "drafter": "NAME", "model": "M"}'

All three run `run_train` (registered as the stage `train` in `aerie.stages`). Rank 0
checkpoints, evaluates and publishes. A job started again with the same request resumes from its
last checkpoint; a request whose drafter version is already published returns its lineage.
"""

from __future__ import annotations

from pathlib import Path

from aerie import drafters, layout
from aerie.contracts import ProgressEvent, TrainFailure, TrainRequest, TrainResult
from aerie.settings import Settings
from aerie.store import ObjectStore

from aerie_trainer import export
from aerie_trainer.evaluate import Evaluator
from aerie_trainer.trainer import Progress, Trainer, default_train_id, setup_dist


def version_of(request: TrainRequest) -> str:
    """The version a request publishes: the hash part of its train id (or the id it names)."""
    train_id = request.train_id or default_train_id(request)
    return train_id.rsplit("-", 1)[-1] if request.train_id is None else train_id


def eval_prompts(store: ObjectStore, request: TrainRequest) -> str | None:
    """The eval prompts file's text (a local file, else a store key), when the request names one."""
    if not request.eval_prompts_file:
        return None
    local = Path(request.eval_prompts_file)
    return local.read_text() if local.is_file() else store.get_bytes(request.eval_prompts_file).decode()


def run_train(store: ObjectStore, settings: Settings, request: TrainRequest, progress: Progress | None = None) -> TrainResult:
    """Train (resuming if a checkpoint exists), evaluate before/after, export and publish."""
    progress = progress or (lambda event: None)
    dist = setup_dist(settings.device)
    train_id = request.train_id or default_train_id(request)
    version = version_of(request)
    if request.publish:  # every rank sees it and stops
        done = drafters.published_lineage(store, request.drafter, version)
        if done is not None:
            progress(ProgressEvent(stage="done", message=f"drafter {request.drafter}:{version} already published"))
            return TrainResult.of(request.drafter, version, done.metrics, already_published=True, train_id=train_id,
                                  key=layout.drafter_prefix(request.drafter, version), layer_ids=done.exported_layer_ids)
    trainer = Trainer(store, request, dist, progress)
    st = trainer.state
    evaluator = None
    if dist.main:
        evaluator = Evaluator(trainer.drafter, trainer.target, trainer.data, request.model, trainer.runset.capture_points,
                              request.config, dist.device, eval_prompts(store, request))
    if evaluator is not None and "acceptance_untrained" not in st.metrics:
        progress(ProgressEvent(stage="evaluate", message="untrained drafter"))
        st.metrics.update({f"{k}_untrained": v for k, v in evaluator.run().items()})
    trainer.train()
    result = TrainResult(drafter=request.drafter, version=version, train_id=train_id, resumed_from=trainer.resumed_from)
    if evaluator is not None:
        progress(ProgressEvent(stage="evaluate", message="trained drafter"))
        st.metrics.update(evaluator.run())
        st.metrics.update(
            steps=st.step, tokens=st.tokens, final_loss=st.losses[-1], losses=st.losses,
            train_seconds=round(st.train_seconds, 3), data_wait_fraction=st.data_wait_seconds / max(st.train_seconds, 1e-9),
            tokens_per_second=st.tokens / max(st.train_seconds, 1e-9), holdout_split=trainer.data.split,
        )
        if request.publish:
            progress(ProgressEvent(stage="publish", message=layout.drafter_prefix(request.drafter, version)))
            lineage = export.publish(store, trainer.drafter, trainer.runset, request, version, st.metrics)
            result.key = layout.drafter_prefix(request.drafter, version)
            result.layer_ids = lineage.exported_layer_ids
        trainer.checkpointer.save(trainer.drafter, trainer.optimizer, trainer.names, st)  # final metrics kept too
        store.delete(layout.train_failure(train_id))
    dist.barrier()
    return TrainResult.of(request.drafter, version, st.metrics, **result.model_dump(exclude={"drafter", "version"}, exclude_none=True))


def record_failure(store: ObjectStore, request: TrainRequest, error: BaseException, attempts: int) -> None:
    """`checkpoints/<train-id>/failed.json`: the job gave up (read by `aerie run` and `progress`)."""
    train_id = request.train_id or default_train_id(request)
    store.put_json(layout.train_failure(train_id), TrainFailure(
        train_id=train_id, drafter=request.drafter, error=f"{type(error).__name__}: {error}", attempts=attempts))
