"""Celery sub-commands of the extractor (entry point group `celery.commands`).

    celery -A aerie_extractor.worker enqueue --dataset chat.jsonl --run r1 --model /models/target \\
        --capture-points 2,15,27 --max-tokens 2048 --shard-tokens 65536
    celery -A aerie_extractor.worker enqueue ... --train-drafter d1 --server http://sglang-capture:30000
        # training waits for `aerie align` of the run against that serving server, and not if it fails
    celery -A aerie_extractor.worker enqueue ... --regenerate --regenerate-max-tokens 1024 --regenerate-max-turns 4
        # train on the target's own answers: one aerie.regenerate task a shard (AERIE_REGENERATE_URLS, many in flight)
    celery -A aerie_extractor.worker progress --run r1 [--watch --timeout 3600]

`progress`, not `status`: Celery registers its own `status` (workers online) after plugins, so a
plugin of that name would be silently replaced.

`enqueue` checks everything before it writes anything: the request (names, options), then the
broker (AERIE_BROKER), then uploads a local dataset under its content's key
(`datasets/sha256/<hex>/<name>`: two files of the same name never overwrite each other), then
writes the run's plan (aerie.controller: refused, naming the run, when the run exists with another
request; the same request again reuses it and retries what failed) and enqueues its first step;
the workers advance the run from there. Expected failures print one line naming the cause and the
setting; `--debug` shows the traceback.
"""

from __future__ import annotations

import secrets
import time
from pathlib import Path

import click
from celery.bin.base import CeleryCommand

from aerie import controller, datasets, layout
from aerie.app import options as app_options
from aerie.app.cli import one_line_failures
from aerie.app.options import train_options
from aerie.contracts import AlignGate, IngestOptions, IngestRequest, PlannedTraining, RunStatus, TrainRequest


def _app_settings(ctx: click.Context):
    from aerie.queue import task_settings

    app = ctx.obj.app
    return app, task_settings(app)


def _points(value: str | None) -> list[int] | None:
    if not value:
        return None
    try:
        return [int(p) for p in value.replace(" ", "").split(",") if p]
    except ValueError:
        raise click.BadParameter(f"{value!r}: give comma-separated layer numbers, e.g. 2,15,27") from None


@click.command(cls=CeleryCommand)
@click.option("--dataset", required=True, help="store key (datasets/x.jsonl) or a local file (uploaded to datasets/)")
@click.option("--run", "run_name", required=True, help="run name: runs/<run>/ in the store")
@click.option("--model", required=True, help="target model folder, as the workers see it")
@click.option("--capture-points", default=None, help="comma-separated capture points (default 2,N//2,N-3)")
@click.option("--engine", type=click.Choice(["hf", "sglang"]), default=None, help="default: AERIE_ENGINE")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16")
@click.option(
    "--storage-dtype",
    type=click.Choice(["float8_e4m3fn"]),
    default=None,
    help="store the states as fp8 (e4m3 + float32 scales, per 128 values or per row): about half of bf16's bytes (default: in --dtype)",
)
@click.option(
    "--scale-block",
    type=int,
    default=None,
    help="with --storage-dtype: values per scale (default: 128 where it divides the hidden size, else the whole row)",
)
@click.option("--target-signal", type=click.Choice(["final", "topk"]), default="final")
@click.option("--topk", type=int, default=20)
@click.option("--loss-on", type=click.Choice(["all", "last"]), default="all", help="assistant turns trained on")
@click.option("--max-tokens", type=int, default=2048)
@click.option("--overlong", type=click.Choice(["truncate", "reject"]), default="truncate")
@click.option("--shard-tokens", type=int, default=65536)
@click.option("--max-records", type=int, default=None, help="stop after this many accepted records")
@click.option(
    "--max-record-bytes",
    type=int,
    default=None,
    help="reject dataset lines / array elements larger than this (default 1 MiB: IngestOptions.max_record_bytes)",
)
@click.option(
    "--regenerate",
    is_flag=True,
    help="answer every user turn again with the target (the regenerate stage) and train on that",
)
@click.option(
    "--regenerate-max-tokens", type=int, default=None, help="with --regenerate: new tokens per answer (default 512)"
)
@click.option(
    "--regenerate-max-turns",
    type=int,
    default=None,
    help="with --regenerate: assistant turns answered per conversation (default all)",
)
@click.option(
    "--regenerate-reasoning",
    type=click.Choice(["keep", "drop"]),
    default=None,
    help="with --regenerate: a reasoning model's think segment trained on (keep, default) or dropped",
)
@click.option(
    "--regenerate-temperature",
    type=float,
    default=None,
    help="with --regenerate: sampling temperature (default 0: greedy)",
)
@click.option(
    "--regenerate-shard-records", type=int, default=None, help="with --regenerate: conversations per task (default 256)"
)
@click.option(
    "--fan-out/--no-fan-out", default=True, help="extract the run's shards once ingested (--no-fan-out: ingest only)"
)
@click.option(
    "--train-drafter",
    default=None,
    help="when the run is complete (--stream: from its first shards), train this drafter on it",
)
@click.option("--upload/--no-upload", default=True, help="upload a local --dataset file to the store first")
@click.option("--wait", type=float, default=0, help="seconds to wait for the ingest task's result")
@click.option(
    "--server",
    "align_server",
    default=None,
    help="with --train-drafter: check the run against this serving SGLang (capture mode) before training (aerie align)",
)
@click.option("--allow-misaligned", is_flag=True, help="with --server: train even when the alignment check fails")
@train_options()
@one_line_failures
@click.pass_context
def enqueue(
    ctx: click.Context,
    dataset,
    run_name,
    model,
    capture_points,
    engine,
    dtype,
    storage_dtype,
    scale_block,
    target_signal,
    topk,
    loss_on,
    max_tokens,
    overlong,
    shard_tokens,
    max_records,
    max_record_bytes,
    regenerate,
    regenerate_max_tokens,
    regenerate_max_turns,
    regenerate_reasoning,
    regenerate_temperature,
    regenerate_shard_records,
    fan_out,
    train_drafter,
    upload,
    wait,
    align_server,
    allow_misaligned,
    **training,
):
    """Plan a run (ingest, extraction, the training after it) and enqueue its first step (task aerie.ingest)."""
    from aerie import presets

    regeneration = {
        f"regenerate_{k}": v
        for k, v in (
            ("max_tokens", regenerate_max_tokens),
            ("max_turns", regenerate_max_turns),
            ("reasoning", regenerate_reasoning),
            ("temperature", regenerate_temperature),
            ("shard_records", regenerate_shard_records),
        )
        if v is not None
    }
    if regeneration and not regenerate:
        raise click.UsageError(
            f"--{next(iter(regeneration)).replace('_', '-')} is a setting of --regenerate: add --regenerate"
        )

    if align_server and not train_drafter or allow_misaligned and not align_server:
        raise click.UsageError(
            "--server checks the run before --train-drafter trains on it, and --allow-misaligned "
            "overrides that check: give --train-drafter with --server, --server with --allow-misaligned"
        )
    app, settings = _app_settings(ctx)
    try:  # the training settings (and a preset's capture points) are checked before anything is sent
        config = app_options.train_config(model_config=_model_config(model), **training)
        capture_points = capture_points or (
            ",".join(map(str, presets.capture_points(training["preset"]) or [])) or None
        )
    except presets.PresetError as e:
        raise click.UsageError(str(e)) from None
    local, sha = Path(dataset).expanduser(), None
    if upload and local.is_file():  # its key comes from its content; uploaded once all is checked
        sha = datasets.file_sha256(local)
        dataset = layout.dataset_upload(sha, local.name)
    elif upload and datasets.is_local_form(dataset):
        raise click.ClickException(f"--dataset {dataset}: no such file")
    if Path(model).expanduser().is_dir():
        model = str(Path(model).expanduser().resolve())
    try:
        request = IngestRequest(
            run=run_name,
            dataset=dataset,
            model=model,
            capture_points=_points(capture_points),
            engine=engine,
            dtype=dtype,
            storage_dtype=storage_dtype,
            scale_block=scale_block,
            target_signal=target_signal,
            topk=topk,
            options=IngestOptions(
                loss_on=loss_on,
                max_tokens=max_tokens,
                overlong=overlong,
                shard_tokens=shard_tokens,
                max_records=max_records,
                **({"max_record_bytes": max_record_bytes} if max_record_bytes else {}),
                regenerate=regenerate,
                **regeneration,
            ),
        )
        trainings = (
            [
                PlannedTraining(
                    train=TrainRequest(runs=[run_name], drafter=train_drafter, model=model, config=config),
                    align=AlignGate(server=align_server, allow_misaligned=allow_misaligned) if align_server else None,
                    start=controller.start_rule(config),
                )
            ]
            if train_drafter
            else []
        )
    except ValueError as e:  # a refused name or option: one line naming the field
        raise click.ClickException(" ".join(str(e).split())) from None
    from aerie.queue import check_broker
    from aerie.store import open_store

    check_broker(app)  # before anything is written: a broker that is down leaves no orphan upload
    store = open_store(settings)
    if sha is not None:
        stored = store.exists(dataset)  # the same content uploaded before: not sent again
        datasets.upload(store, local, sha)
        ctx.obj.echo(f"{local} -> {dataset}: " + ("in the store already (same sha256)" if stored else "uploaded"))
    elif (
        upload
        and not datasets.is_local_form(dataset)
        and not any(store.exists(k) for k in (dataset, layout.dataset(dataset)))
    ):
        raise click.ClickException(
            f"--dataset {dataset}: neither a file here nor an object in {store.url} "
            "(give a local file to upload, or the key of an uploaded dataset)"
        )
    # the run's plan, then its first step: the workers advance it from there (aerie.controller)
    dispatcher = controller.OnWorkers(app, settings, owner=f"enqueue-{secrets.token_hex(8)}")
    state = controller.start(store, settings, controller.new_plan(request, fan_out=fan_out), trainings, dispatcher)
    for _, task, sent in dispatcher.results:
        ctx.obj.echo(f"enqueued {task} {sent.id} for run {run_name}")
    if not dispatcher.results:
        ctx.obj.echo(
            f"run {run_name} is planned already ({state.phase}): nothing new to enqueue (`progress --run {run_name}`)"
        )
    ingested = [sent for step, _, sent in dispatcher.results if step.kind == "ingest"]
    if wait and ingested:
        from celery.exceptions import TimeoutError as ResultTimeout

        try:
            summary = ingested[0].get(timeout=wait)
        except ResultTimeout:
            raise click.ClickException(
                f"the ingest of run {run_name} (task {ingested[0].id}) did not finish within --wait {wait:g} s: "
                "is a worker consuming queue 'ingest'? (`progress --run` shows it)"
            ) from None
        ctx.obj.echo(
            f"ingested: {summary['sequences']} sequences, {summary['tokens']} tokens in "
            f"{len(summary['shards'])} shards, {summary['rejects']} rejects"
        )


def _model_config(model: str) -> dict | None:
    """The target's config.json when the model folder is readable here (a preset is checked against it)."""
    import json

    path = Path(model).expanduser() / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def status_table(status: RunStatus):
    from rich import box
    from rich.table import Table

    table = Table(title=f"run {status.run}", box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True)
    regen = status.regenerate_total > 0
    for col in (
        "shards",
        *(("regenerated",) if regen else ()),
        "tokenized",
        "extracted",
        "failed",
        "sequences",
        "tokens",
        "rejects",
        "complete",
    ):
        table.add_column(col, justify="right")
    table.add_row(
        str(status.shards_total),
        *((str(status.regenerated),) if regen else ()),
        str(status.tokens_done),
        str(status.hidden_done),
        str(status.failed),
        str(status.sequences),
        str(status.tokens),
        str(status.rejects),
        "yes" if status.complete else "no",
    )
    return table


WATCH_POLL_S = 1.0


def _run_state(store, run: str) -> controller.RunState | None:
    """The run controller's view of a run with a plan (enqueue, `aerie run`); None without one."""
    try:
        return controller.state(store, run)
    except controller.NoPlan:
        return None


@click.command(cls=CeleryCommand)
@click.option("--run", "run_name", required=True)
@click.option(
    "--watch",
    is_flag=True,
    help="follow the run until it is done (its drafter published) or failed; exit 1 unless done",
)
@click.option("--timeout", type=float, default=3600.0, help="seconds --watch waits")
@click.option("--json", "as_json", is_flag=True, help="print the RunStatus record as JSON")
@one_line_failures
@click.pass_context
def progress(ctx, run_name, watch, timeout, as_json):
    """Show a run's progress: shards tokenized / extracted / failed, tokens, rejects, its trainings."""
    from rich.console import Console

    from aerie.app.views import progress_table
    from aerie.runs import run_status
    from aerie.store import open_store
    from aerie.training import logs_hint, published_lines, trainings

    _, settings = _app_settings(ctx)
    store = open_store(settings)
    console = Console()
    status, state, jobs = run_status(store, run_name), _run_state(store, run_name), trainings(store, run_name)
    if state is None and not jobs and not status.tokens_done and not store.exists(layout.run_spec(run_name)):
        raise click.ClickException(
            f"no run {run_name!r} in {store.url} (AERIE_STORE): enqueue it first, or name a run that store holds"
        )

    def finished() -> bool:  # a planned run: done or failed, its trainings included; else extracted
        return state.done if state is not None else status.complete or status.failed > 0

    if watch and not finished():
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        deadline = time.monotonic() + timeout
        with Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
        ) as bar:
            extracted = bar.add_task(
                f"run {run_name}: shards extracted", total=max(status.shards_total, 1), completed=status.hidden_done
            )
            trained = None
            while not finished() and time.monotonic() < deadline:
                time.sleep(WATCH_POLL_S)
                status, state, jobs = (
                    run_status(store, run_name),
                    _run_state(store, run_name),
                    trainings(store, run_name),
                )
                bar.update(extracted, total=max(status.shards_total, 1), completed=status.hidden_done)
                if jobs:  # the newest training job: its steps
                    job = jobs[0]
                    what = f"training {job.drafter}: {job.stage}"
                    if trained is None:
                        trained = bar.add_task(what, total=job.steps)
                    bar.update(trained, description=what, total=job.steps, completed=job.step)
    if as_json:
        click.echo(status.model_dump_json())
    else:
        console.print(status_table(status))
        # published: what the jobs' records say, and what the controller found (a lineage in the
        # store; the job's record says "done" a moment later)
        published = {(r.drafter, r.version) for r in jobs if r.version}
        if state is not None:
            requests = [t.planned.train for t in state.trainings if t.phase == "done"]
            published |= {(r.drafter, r.version) for r in requests if r.publish}
        if jobs:
            console.print(progress_table(jobs))
            console.print(logs_hint(store.url, jobs[0].logs), highlight=False, soft_wrap=True)
        for line in published_lines(sorted(published)):
            console.print(line)
        if state is not None:
            console.print(f"run {run_name}: {state.phase}" + (f": {state.failure}" if state.failure else ""))
    if watch and not (state.phase == "done" if state is not None else status.complete):
        raise SystemExit(1)
