"""Operator commands: prepare a store, check a fresh deployment end to end, re-run what failed.

    aerie prepare-store                 the bucket (or folder) of AERIE_STORE / AERIE_BUCKET, and a
                                        write-read-list-delete round trip with this key
    aerie smoke --model /models/target  a 10-record dataset through the workers: ingest, extract, report
    aerie retry-failed --run chat-v1    re-enqueue what of a run gave up (shards, ingest, training)

They talk to the deployment the way a user does (the store, and the queues by task name), so they
run in any container that has the settings (`docker compose exec extractor aerie smoke ...`) or on
a laptop against any S3 server and Redis. Expected failures print one line naming the cause.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Literal

import click

from aerie import layout

SMOKE_RECORDS = 10


def _settings():
    from aerie.settings import Settings

    return Settings.load()


def _app(settings):
    """The Celery app of the workers' broker, checked reachable; refused for the in-process broker."""
    from aerie.queue import check_broker, make_app

    if settings.embedded:
        raise click.ClickException(
            "AERIE_BROKER is memory:// (in-process): point it at the workers' Redis (redis://:PASSWORD@HOST:6379/0)"
        )
    app = make_app(settings)
    check_broker(app)
    return app


@click.command("prepare-store")
def prepare_store() -> None:
    """Create the bucket (or folder) the settings name, and check this key may write, read, list and
    delete in it. On MinIO, scripts/minio_init.sh also gives the application a key limited to it."""
    from aerie.store import open_store

    settings = _settings()
    store = open_store(settings, create_bucket=True)
    key = layout.probe(f"prepare-{secrets.token_hex(8)}")
    payload = secrets.token_bytes(64)
    store.put_bytes(key, payload)
    try:
        if store.get_bytes(key) != payload or key not in store.list(layout.probe("")):
            raise click.ClickException(f"{store.url}: an object written by this key reads back differently")
    finally:
        store.delete(key)
    if store.exists(key):
        raise click.ClickException(f"{store.url}: the probe object {key} survived its delete: check the key's rights")
    click.echo(f"store {store.url}: ready; this key may write, read, list and delete objects in it")


def smoke_dataset() -> bytes:
    """Ten short ShareGPT conversations (no data package needed in the image)."""
    lines = []
    for i in range(SMOKE_RECORDS):
        a, b = 3 * i + 2, 7 * i + 5
        lines.append(
            {
                "conversations": [
                    {"from": "human", "value": f"What is {a} plus {b}?"},
                    {"from": "gpt", "value": f"{a} plus {b} is {a + b}."},
                ]
            }
        )
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


@click.command("smoke")
@click.option("--model", required=True, help="target model folder, as the workers see it (/models/target)")
@click.option("--capture-points", default=None, help="comma-separated capture points (default 2,N//2,N-3)")
@click.option("--target-signal", type=click.Choice(["final", "topk"]), default="final", show_default=True)
@click.option("--timeout", type=float, default=1800.0, show_default=True, help="seconds to wait for the run")
@click.option("--keep", is_flag=True, help="keep the smoke run and its dataset in the store")
def smoke(
    model: str, capture_points: str | None, target_signal: Literal["final", "topk"], timeout: float, keep: bool
) -> None:
    """After `up`: enqueue a 10-record dataset, wait for the workers to ingest and extract it, report."""
    from aerie import controller
    from aerie.contracts import IngestOptions, IngestRequest
    from aerie.runs import RunError, load_run, wait_for_run
    from aerie.store import open_store

    settings = _settings()
    store, app = open_store(settings), _app(settings)
    run = f"smoke-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    dataset = layout.dataset(run)
    points = [int(p) for p in capture_points.split(",")] if capture_points else None
    request = IngestRequest(
        run=run,
        dataset=dataset,
        model=model,
        capture_points=points,
        target_signal=target_signal,
        options=IngestOptions(max_records=SMOKE_RECORDS, shard_tokens=1024),
    )
    store.put_bytes(dataset, smoke_dataset())
    started = time.monotonic()
    controller.start(store, settings, controller.new_plan(request), [], controller.OnWorkers(app, settings, run))
    click.echo(f"smoke: enqueued run {run} ({SMOKE_RECORDS} records) on {settings.broker.rsplit('@', 1)[-1]}")
    try:
        status = wait_for_run(store, run, timeout_s=timeout)
        engine = load_run(store, run).engine
    except RunError as e:
        raise click.ClickException(f"smoke failed: {e} (kept in the store: {layout.run_prefix(run)})") from None
    click.echo(
        f"smoke: ok in {time.monotonic() - started:.0f} s: {status.sequences} sequences, {status.tokens} tokens, "
        f"{status.hidden_done}/{status.shards_total} shards extracted by {engine.name} {engine.version} "
        f"({engine.transport or 'in-process'} transport), {status.rejects} rejects"
    )
    if not keep:
        store.delete_prefix(layout.run_prefix(run))
        store.delete(dataset)


@click.command("retry-failed")
@click.option("--run", "run_name", required=True, help="the run whose failed shards to extract again")
def retry_failed(run_name: str) -> None:
    """Re-enqueue what of a run gave up: its shards' extraction (or regeneration), its ingest, its
    training or a failed alignment check (fix the cause first: `progress` and runs/RUN/failed/ in the
    store say what it was)."""
    from aerie import controller
    from aerie.store import open_store

    settings = _settings()
    store = open_store(settings)
    if not store.exists(layout.run_plan(run_name)) and not store.exists(layout.run_spec(run_name)):
        message = f"run {run_name!r} has neither a plan nor a run.json in {store.url}: enqueue it"
        if store.exists(layout.ingest_failure(run_name)):
            message = (
                f"run {run_name!r}: its ingest failed (runs/{run_name}/failed/ingest.json): enqueue the dataset again"
            )
        raise click.ClickException(message)
    app = _app(settings)
    steps = controller.retry(store, run_name, controller.OnWorkers(app, settings, f"retry-{secrets.token_hex(8)}"))
    shards = [s.name.split(":", 1)[1] for s in steps if s.kind in ("extract", "regenerate")]
    others = [s.name for s in steps if s.kind not in ("extract", "regenerate")]
    if not steps:
        click.echo(f"run {run_name}: no failed shard")
    if shards:
        click.echo(f"run {run_name}: re-enqueued {len(shards)} failed shard(s): {', '.join(shards)}")
    if others:
        click.echo(f"run {run_name}: re-enqueued {', '.join(others)}")
