"""The trainer's user command, registered in `aerie` through the `aerie.commands` entry point.

aerie train --runs sharegpt --drafter smollm2-eagle3 --model /path/to/target [--steps 300] [--train-config '{...}']
aerie train ... --eval-every 100 --publish-checkpoint best   # measure acceptance every 100 steps, publish the best

The training options are the ones `enqueue --train-drafter` and `aerie run` take (aerie.presets).
AERIE_TRAIN_RANKS=8 aerie train ...                                   # launches 8 ranks itself
torchrun --nproc_per_node 8 -m aerie.app.cli train --runs sharegpt --drafter NAME --model M   # ranks by hand
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from aerie.app.options import train_config, train_options


@click.command("train")
@click.option(
    "--runs", "runs", required=True, multiple=True, help="run whose hidden shards to train on (repeat for several)"
)
@click.option("--drafter", required=True, help="drafter name (published under drafters/<name>/)")
@click.option("--model", required=True, help="target model folder (embeddings, lm_head, config)")
@click.option("--train-id", default=None, help="checkpoint namespace (default: derived from the request)")
@click.option("--no-publish", is_flag=True, help="train and evaluate only")
@train_options()
def train(runs, drafter, model, train_id, no_publish, **training) -> None:
    """Train, evaluate and publish a drafter in this process (or one torchrun rank)."""
    import torch

    from aerie.contracts import ProgressEvent, TrainRequest
    from aerie.settings import Settings
    from aerie.store import open_store
    from aerie.target import load_config
    from aerie_trainer.job import run_train

    readable = (Path(model) / "config.json").is_file()  # the preset is checked against it where it is here
    request = TrainRequest(
        runs=list(runs),
        drafter=drafter,
        model=model,
        config=train_config(model_config=load_config(model) if readable else None, **training),
        train_id=train_id,
        publish=not no_publish,
    )
    settings = Settings.load()
    main = int(os.environ.get("RANK", "0")) == 0

    def show(event: ProgressEvent) -> None:
        if main and (event.stage != "train" or (event.step or 0) % 10 == 0 or event.step == event.steps):
            click.echo(event.model_dump_json(exclude_none=True))

    store = open_store(settings)
    result = run_train(store, settings, request, show)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if main:
        from aerie.training import logs_hint

        click.echo(json.dumps(result.model_dump(exclude={"losses"}, exclude_none=True), indent=1))
        click.echo(logs_hint(store.url, result.logs), err=True)
