"""The `train` stage: hidden shards -> a trained, evaluated, exported and published drafter.

    aerie train --runs sharegpt --drafter smollm2-eagle3 --model /path/to/target   # AERIE_TRAIN_RANKS ranks
    torchrun --nproc_per_node 8 -m aerie.cli train --runs sharegpt --drafter NAME --model M   # ranks by hand
    celery -A aerie_trainer.worker call aerie.train --kwargs '{"runs": ["sharegpt"], "drafter": "NAME", "model": "M"}'

All three run `run_train` (registered as the stage `train` in `aerie.stages`). Called outside a
distributed job with more than one rank wanted (AERIE_TRAIN_RANKS: every GPU the worker was
given), it starts the job as torchrun's ranks (aerie_trainer.launch) and relays their progress.
In a rank: DDP or FSDP2 by the memory estimate (aerie_trainer.sizing; AERIE_TRAIN_SHARDING
overrides); rank 0 checkpoints, tracks, evaluates and publishes. A job started again with the same
request resumes from its last checkpoint; a request whose drafter version is already published
returns its lineage.
"""

from __future__ import annotations

import os
from pathlib import Path

from aerie import drafters, layout
from aerie.capture import convention_for, to_engine_ids
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


def already_published(store: ObjectStore, request: TrainRequest) -> TrainResult | None:
    if not request.publish:
        return None
    train_id, version = request.train_id or default_train_id(request), version_of(request)
    done = drafters.published_lineage(store, request.drafter, version)
    if done is None:
        return None
    return TrainResult.of(
        request.drafter,
        version,
        done.metrics,
        already_published=True,
        train_id=train_id,
        key=layout.drafter_prefix(request.drafter, version),
        layer_ids=done.exported_layer_ids,
    )


def run_train(
    store: ObjectStore, settings: Settings, request: TrainRequest, progress: Progress | None = None
) -> TrainResult:
    """Train (resuming if a checkpoint exists), evaluate before/after, export and publish."""
    progress = progress or (lambda event: None)
    done = already_published(store, request)  # every rank sees it and stops
    if done is not None:
        progress(ProgressEvent(stage="done", message=f"drafter {request.drafter}:{done.version} already published"))
        return done
    if "WORLD_SIZE" not in os.environ:
        from aerie_trainer.launch import resolve_ranks, run_ranks

        ranks = resolve_ranks(settings)
        if ranks > 1:
            return run_ranks(settings, request, ranks, progress)
    return train_here(store, settings, request, progress)


def train_here(store: ObjectStore, settings: Settings, request: TrainRequest, progress: Progress) -> TrainResult:
    """This process's part: the whole job, or one rank of it."""
    dist = setup_dist(settings.device)
    train_id = request.train_id or default_train_id(request)
    version = version_of(request)
    sharding, why = sharding_for(store, settings, request, dist.world_size)
    trainer = Trainer(store, request, dist, progress, sharding=sharding, trackers=settings.train_trackers)
    st = trainer.state
    tracking = trainer.tracking
    evaluator = None
    if dist.main:
        spec = trainer.runset.spec
        layer_ids = to_engine_ids(
            trainer.runset.capture_points, convention_for("sglang", spec.target.architecture), spec.target.num_layers
        )
        evaluator = Evaluator(
            trainer.full_drafter,
            trainer.target,
            trainer.data,
            request.model,
            trainer.runset.capture_points,
            request.config,
            dist.device,
            eval_prompts(store, request),
            server=settings.eval_server,
            max_target_params=settings.eval_max_target_params,
            layer_ids=layer_ids,
            architecture=spec.target.architecture,
        )
        st.metrics.update(sharding=sharding, ranks=dist.world_size, sharding_reason=why)
        tracking.progress(
            stage="train",
            steps=trainer.steps,
            step=st.step,
            message=f"{sharding} on {dist.world_size} rank(s): {why}",
            force=True,
        )
    try:
        if evaluator is not None and "evaluated_with_untrained" not in st.metrics:  # once, not again on resume
            progress(ProgressEvent(stage="evaluate", message=f"untrained drafter ({evaluator.note})"))
            tracking.progress(stage="evaluate", message="untrained drafter")
            untrained = evaluator.run()
            st.metrics.update({f"{k}_untrained": v for k, v in untrained.items() if k != "evaluation_note"})
            _log_eval(tracking, untrained, 0)
            tracking.progress(stage="train", message="")
        trainer.train()
        result = TrainResult(
            drafter=request.drafter, version=version, train_id=train_id, resumed_from=trainer.resumed_from
        )
        full = trainer.sync_full_drafter()  # every rank: FSDP gathers the weights to rank 0
        if evaluator is not None:
            progress(ProgressEvent(stage="evaluate", message=f"trained drafter ({evaluator.note})"))
            tracking.progress(stage="evaluate", message="trained drafter")
            trained = evaluator.run()
            st.metrics.update(trained)
            _log_eval(tracking, trained, st.step)
            st.metrics.update(
                steps=st.step,
                tokens=st.tokens,
                final_loss=st.losses[-1],
                losses=st.losses,
                train_seconds=round(st.train_seconds, 3),
                data_wait_fraction=st.data_wait_seconds / max(st.train_seconds, 1e-9),
                tokens_per_second=st.tokens / max(st.train_seconds, 1e-9),
                holdout_split=trainer.data.split,
                logs=tracking.logs,
            )
            if request.publish:
                progress(ProgressEvent(stage="publish", message=layout.drafter_prefix(request.drafter, version)))
                tracking.progress(stage="publish")
                lineage = export.publish(store, full, trainer.runset, request, version, st.metrics)
                result.key = layout.drafter_prefix(request.drafter, version)
                result.layer_ids = lineage.exported_layer_ids
        trainer.save()  # every rank (FSDP gathers); the final metrics are kept too
        if dist.main:
            store.delete(layout.train_failure(train_id))
            tracking.progress(
                stage="done",
                version=version if request.publish else None,
                force=True,
                message=f"published {layout.drafter_prefix(request.drafter, version)}"
                if request.publish
                else "trained",
            )
        dist.barrier()
    finally:
        if tracking is not None:
            tracking.close()  # the event files so far go to the store, whatever happened
    return TrainResult.of(
        request.drafter, version, st.metrics, **result.model_dump(exclude={"drafter", "version"}, exclude_none=True)
    )


def _log_eval(tracking, metrics: dict, step: int) -> None:
    scalars = {
        f"eval/{k}": float(metrics[k])
        for k in ("acceptance", "simulated_acceptance", "heldout_loss")
        if metrics.get(k) is not None
    }
    for k, acc in enumerate(metrics.get("heldout_acc") or []):
        scalars[f"eval/heldout_acc_{k}"] = float(acc)
    if scalars:
        tracking.log(scalars, step)


def sharding_for(store: ObjectStore, settings: Settings, request: TrainRequest, world_size: int) -> tuple[str, str]:
    """(single | ddp | fsdp, why): aerie_trainer.sizing's estimate of this drafter's training
    against one device's memory, or AERIE_TRAIN_SHARDING."""
    from aerie.runs import load_run
    from aerie_trainer.model import DrafterConfig, load_target_config
    from aerie_trainer.sizing import choose_sharding, device_memory, training_bytes
    from aerie_trainer.vocab import draft_vocab_size

    spec = load_run(store, request.runs[0])
    cfg = request.config
    drafter = DrafterConfig.from_target(
        load_target_config(request.model),
        len(spec.capture_points),
        draft_vocab_size(cfg.draft_vocab_size, spec.target.vocab_size),
        cfg.drafter,
    )
    memory = training_bytes(drafter, cfg, on_gpu=settings.device.startswith("cuda"))
    return choose_sharding(
        world_size, settings.train_sharding, memory, device_memory(settings.device, settings.train_device_memory_gib)
    )


def record_failure(store: ObjectStore, request: TrainRequest, error: BaseException, attempts: int) -> None:
    """`checkpoints/<train-id>/failed.json`: the job gave up (read by `aerie run` and `progress`)."""
    from aerie.training import mark_failed

    train_id = request.train_id or default_train_id(request)
    text = f"{type(error).__name__}: {error}"
    store.put_json(
        layout.train_failure(train_id),
        TrainFailure(train_id=train_id, drafter=request.drafter, error=text, attempts=attempts),
    )
    mark_failed(store, train_id, request.drafter, list(request.runs), text)
