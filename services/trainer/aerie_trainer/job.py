"""The `train` stage: hidden shards -> a trained, evaluated, exported and published drafter.

    aerie train --runs sharegpt --drafter smollm2-eagle3 --model /path/to/target   # AERIE_TRAIN_RANKS ranks
    torchrun --nproc_per_node 8 -m aerie.app.cli train --runs sharegpt --drafter NAME --model M   # ranks by hand
    celery -A aerie_trainer.worker call aerie.train --kwargs '{"runs": ["sharegpt"], "drafter": "NAME", "model": "M"}'

All three call `run_train` (registered as the stage `train` in `aerie.stages` for the shared
library, which composes the services: `aerie run`). Called outside a distributed job with more than one rank wanted (AERIE_TRAIN_RANKS: every GPU the worker was
given), it starts the job as torchrun's ranks (aerie_trainer.launch) and relays their progress.
In a rank: DDP or FSDP2 by the memory estimate (aerie_trainer.sizing; AERIE_TRAIN_SHARDING
overrides); rank 0 checkpoints, tracks, evaluates and publishes. A job started again with the same
request resumes from its last checkpoint; a request whose drafter version is already published
returns its lineage; two starts of one training at once train once (the train id's lease).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from safetensors.torch import save as st_save

from aerie import controller, drafters, layout, sglang_client
from aerie.capture import convention_for, to_engine_ids
from aerie.contracts import ProgressEvent, TrainFailure, TrainRequest, TrainResult
from aerie.datasets import DatasetRefused, allowed_local_path, is_local_form, refusal
from aerie.queue import held
from aerie.settings import Settings
from aerie.store import ObjectStore
from aerie_trainer import export
from aerie_trainer.evaluate import EvalConfig, Evaluator
from aerie_trainer.trainer import Progress, Trainer, setup_dist


def eval_prompts(store: ObjectStore, request: TrainRequest, local_dirs: list[Path] | None = None) -> str | None:
    """The eval prompts file's text, when the request names one: a store key, or a local file
    inside `local_dirs` (AERIE_INGEST_LOCAL_DIRS, the folders a dataset may be read from). A
    message names it, so a local path anywhere else is refused before anything is opened (no file
    outside those folders is read, nor its existence revealed): DatasetRefused naming the setting."""
    name = request.eval_prompts_file
    if not name:
        return None
    allowed = list(local_dirs or [])
    path = allowed_local_path(name, allowed)
    if path is not None:
        if not path.is_file():
            raise DatasetRefused(f"eval_prompts_file {name!r}: no such file")
        return path.read_text()
    if is_local_form(name):
        raise refusal(name, allowed, "eval_prompts_file")
    return store.get_bytes(name).decode()


def run_train(
    store: ObjectStore, settings: Settings, request: TrainRequest, progress: Progress | None = None
) -> TrainResult:
    """Train (resuming if a checkpoint exists), evaluate before/after, export and publish.

    One job per train id: the process that starts it (not a rank) holds the train id's lease
    (aerie.queue.held: on the broker, or a lock of this host in-process) while it trains, so the
    same training started twice trains once, in one checkpoint namespace, and publishes once (the
    second start waits, then finds it published); a redelivered task of a killed holder takes the
    lease over once it lapses, and resumes from the last checkpoint. A request without `follows`
    (`aerie train`) follows its runs' current creation first (controller.following): a run deleted
    and created again is trained again, and a chosen train id published before is refused."""
    progress = progress or (lambda event: None)
    request = controller.following(store, request)  # a re-created run trains again (aerie train)
    if "WORLD_SIZE" in os.environ:  # a rank of a job its launcher holds
        return _published(request, progress, store) or train_here(store, settings, request, progress)
    with held(settings, f"train:{request.resolved_train_id}"):
        done = _published(request, progress, store)
        if done is not None:
            return done
        from aerie_trainer.launch import resolve_ranks, run_ranks

        ranks = resolve_ranks(settings)
        if ranks > 1:
            return run_ranks(settings, request, ranks, progress, entry="aerie_trainer.job")  # each rank: main()
        return train_here(store, settings, request, progress)


def _published(request: TrainRequest, progress: Progress, store: ObjectStore) -> TrainResult | None:
    done = drafters.published_result(store, request)  # every rank sees it and stops
    if done is not None:
        progress(ProgressEvent(stage="done", message=f"drafter {request.drafter}:{done.version} already published"))
    return done


def train_here(store: ObjectStore, settings: Settings, request: TrainRequest, progress: Progress) -> TrainResult:
    """This process's part: the whole job, or one rank of it."""
    dist = setup_dist(settings.device)
    prompts = eval_prompts(store, request, settings.ingest_local_dirs) if dist.main else None  # refused before any work
    train_id, version = request.resolved_train_id, request.version
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
        setup = EvalConfig(
            model_dir=request.model,
            capture_points=trainer.runset.capture_points,
            config=request.config,
            device=dist.device,
            prompts_jsonl=prompts,
            server=settings.eval_server,
            api_key=sglang_client.api_key_for(settings, settings.eval_server) if settings.eval_server else None,
            max_target_params=settings.eval_max_target_params,
            layer_ids=layer_ids,
            architecture=spec.target.architecture,
        )
        evaluator = Evaluator(trainer.full_drafter, trainer.target, trainer.data, setup)
        st.metrics.update(sharding=sharding, ranks=dist.world_size, sharding_reason=why)
        tracking.progress(
            stage="train",
            steps=trainer.steps,
            step=st.step,
            message=f"{sharding} on {dist.world_size} rank(s): {why}",
            force=True,
        )
    start = f"drafter from {request.config.init_from}" if request.config.init_from else "untrained drafter"
    initial = None
    try:
        if evaluator is not None and "evaluated_with_untrained" not in st.metrics:  # once, not again on resume
            if st.step > 0:
                pass  # a streamed job resumed before its runs were complete: its starting weights are gone
            elif request.config.stream and not trainer.data.arrived:
                # measured once the runs are complete, on the held-out data the trained drafter is measured on
                initial = {k: v.detach().to("cpu", copy=True) for k, v in trainer.full_drafter.state_dict().items()}
            else:
                _evaluate_untrained(evaluator, st, start, progress, tracking)
        trainer.train(lambda state: _measure(trainer, evaluator, state))
        if request.config.stream:  # the final evaluation reads the complete runs' held-out shards
            trainer.data.wait_arrived()
        result = TrainResult(
            drafter=request.drafter, version=version, train_id=train_id, resumed_from=trainer.resumed_from
        )
        full = trainer.sync_full_drafter()  # every rank: FSDP gathers the weights to rank 0
        if evaluator is not None and initial is not None:
            trained_weights = {k: v.detach().clone() for k, v in full.state_dict().items()}
            full.load_state_dict(initial)
            _evaluate_untrained(evaluator, st, start, progress, tracking)
            full.load_state_dict(trained_weights)
            del trained_weights, initial
        last = None
        if evaluator is not None and request.config.publish_checkpoint == "best":
            last = _load_best(store, train_id, full, st.metrics)
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
        if last is not None:  # the checkpoint keeps the last step's weights, whatever was published
            full.load_state_dict(last, strict=False)
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


def _measure(trainer: Trainer, evaluator: Evaluator | None, state) -> None:
    """Every rank (FSDP gathers): rank 0 evaluates the current drafter, appends the step to
    `acceptance_curve_steps` and its acceptance to `acceptance_curve` (served acceptance when prompts are evaluated, else the simulated one)
    and, when it is the best so far, writes its weights to `checkpoints/<id>/best/`."""
    full = trainer.sync_full_drafter()
    if evaluator is not None:
        trainer.tracking.progress(stage="evaluate", message=f"step {state.step}")
        measured = evaluator.run()
        figure = measured.get("acceptance", measured.get("simulated_acceptance"))
        metrics = state.metrics
        metrics.setdefault("acceptance_curve_steps", []).append(state.step)
        metrics.setdefault("acceptance_curve", []).append(figure)
        metrics["acceptance_curve_of"] = "acceptance" if "acceptance" in measured else "simulated_acceptance"
        _log_eval(trainer.tracking, measured, state.step)
        if figure is not None and figure > metrics.get("best_acceptance", float("-inf")):
            weights = {k: v.detach().cpu().contiguous() for k, v in full.state_dict().items() if _kept(k)}
            data = st_save(weights)
            trainer.store.put_bytes(layout.checkpoint_best(trainer.train_id), data)
            # its digest rides in the metrics, so in the checkpoint that follows (checked on resume)
            metrics.update(best_step=state.step, best_acceptance=figure, best_sha256=hashlib.sha256(data).hexdigest())
        trainer.tracking.progress(stage="train", message="")
    trainer.dist.barrier()


def _kept(name: str) -> bool:
    return not name.startswith("embed_tokens.")  # the frozen target embedding is never saved


def _load_best(store: ObjectStore, train_id: str, full, metrics: dict) -> dict:
    """Load the best measured step's weights into `full` (rank 0) -> the last step's, to put back;
    `published_step`/`published_acceptance` go to the metrics (and so to the lineage). The file
    must hash to the `best_sha256` recorded when it was written and hold finite values, else
    CheckpointRefused naming it (never published)."""
    import torch
    from safetensors.torch import load as st_load

    from aerie_trainer.checkpoint import CheckpointRefused

    key = layout.checkpoint_best(train_id)
    data = store.get_bytes(key)
    digest = hashlib.sha256(data).hexdigest()
    recorded = metrics.get("best_sha256")
    if recorded is not None and digest != recorded:
        raise CheckpointRefused(
            f"checkpoint {key} has sha256 {digest[:12]}…, not the {str(recorded)[:12]}… recorded when it was "
            f"written (changed or corrupted): not published; train {train_id} again with another --train-id"
        )
    try:
        best = st_load(data)
    except Exception as e:  # safetensors' own error type is not public API
        raise CheckpointRefused(f"checkpoint {key} is not a readable safetensors file ({type(e).__name__})") from None
    bad = next((k for k, v in best.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())), None)
    if bad is not None:
        raise CheckpointRefused(f"checkpoint {key} tensor {bad} holds non-finite values: not published")
    last = {k: v.detach().cpu().clone() for k, v in full.state_dict().items() if _kept(k)}
    full.load_state_dict(best, strict=False)  # copied into the parameters, on their device
    metrics.update(published_step=metrics["best_step"], published_acceptance=metrics["best_acceptance"])
    return last


def _evaluate_untrained(evaluator: Evaluator, st, start: str, progress: Progress, tracking) -> None:
    """The starting drafter's figures (`*_untrained`), logged at step 0. A streamed job that starts
    before its runs are complete measures a copy of its starting weights (kept in memory) once they
    are, so that both figures read the held-out prompts and batches a job on the complete runs
    reads; one resumed before that has no starting weights left and no `*_untrained` figures."""
    progress(ProgressEvent(stage="evaluate", message=f"{start} ({evaluator.note})"))
    tracking.progress(stage="evaluate", message=start)
    untrained = evaluator.run()
    st.metrics.update({f"{k}_untrained": v for k, v in untrained.items() if k != "evaluation_note"})
    _log_eval(tracking, untrained, 0)
    tracking.progress(stage="train", message="")


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

    train_id = request.resolved_train_id
    text = f"{type(error).__name__}: {error}"
    store.put_json(
        layout.train_failure(train_id),
        TrainFailure(train_id=train_id, drafter=request.drafter, error=text, attempts=attempts),
    )
    mark_failed(store, train_id, request.drafter, list(request.runs), text)


def main(argv: list[str] | None = None) -> None:
    """`python -m aerie_trainer.job rank JOB_DIR`: one rank of a job `run_ranks` started."""
    import sys

    from aerie_trainer.launch import run_rank

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["rank"] or len(argv) != 2:
        raise SystemExit("usage: python -m aerie_trainer.job rank JOB_DIR")
    run_rank(Path(argv[1]), run_train)


if __name__ == "__main__":
    main()
