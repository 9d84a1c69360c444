"""The trainer's user command, registered in `aerie` through the `aerie.commands` entry point.

aerie train --runs sharegpt --drafter smollm2-eagle3 --model /path/to/target [--config '{"steps": 300}']
aerie train ... --eval-every 100 --publish best   # measure acceptance every 100 steps, publish the best step
aerie train ... --init-from smol-eagle3:v1        # warm start from a drafter (aerie_trainer.warm_start)
AERIE_TRAIN_RANKS=8 aerie train ...                                   # launches 8 ranks itself
torchrun --nproc_per_node 8 -m aerie.app.cli train --runs sharegpt --drafter NAME --model M   # ranks by hand
"""

from __future__ import annotations

import json
import os

import click


@click.command("train")
@click.option(
    "--runs", "runs", required=True, multiple=True, help="run whose hidden shards to train on (repeat for several)"
)
@click.option("--drafter", required=True, help="drafter name (published under drafters/<name>/)")
@click.option("--model", required=True, help="target model folder (embeddings, lm_head, config)")
@click.option("--config", "config_json", default="{}", help="TrainConfig fields as JSON, e.g. '{\"steps\": 300}'")
@click.option("--train-id", default=None, help="checkpoint namespace (default: derived from the request)")
@click.option("--no-publish", is_flag=True, help="train and evaluate only")
@click.option(
    "--eval-every", type=click.IntRange(min=1), default=None, help="measure acceptance every N steps and checkpoint"
)
@click.option(
    "--publish",
    "publish_checkpoint",
    type=click.Choice(["last", "best"]),
    default=None,
    help="publish the last step (default) or the measured step that accepted best (needs --eval-every)",
)
@click.option(
    "--init-from",
    default=None,
    help="warm start from this drafter: a folder (aerie pull's, or SpecForge's export) or a published NAME[:VERSION]",
)
def train(runs, drafter, model, config_json, train_id, no_publish, eval_every, publish_checkpoint, init_from) -> None:
    """Train, evaluate and publish a drafter in this process (or one torchrun rank)."""
    import torch

    from aerie.contracts import ProgressEvent, TrainConfig, TrainRequest
    from aerie.presets import init_source
    from aerie.settings import Settings
    from aerie.store import open_store
    from aerie_trainer.job import run_train

    request = TrainRequest(
        runs=list(runs),
        drafter=drafter,
        model=model,
        config=TrainConfig.model_validate(
            {
                **json.loads(config_json),
                **({"eval_every": eval_every} if eval_every else {}),
                **({"publish_checkpoint": publish_checkpoint} if publish_checkpoint else {}),
                **({"init_from": init_source(init_from)} if init_from else {}),
            }
        ),
        train_id=train_id,
        publish=not no_publish,
    )
    settings = Settings.load()
    main = int(os.environ.get("RANK", "0")) == 0

    def show(event: ProgressEvent) -> None:
        if main and (event.stage != "train" or (event.step or 0) % 10 == 0 or event.step == event.steps):
            click.echo(event.model_dump_json(exclude_none=True))

    result = run_train(open_store(settings), settings, request, show)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if main:
        from aerie.training import logs_hint

        click.echo(json.dumps(result.model_dump(exclude={"losses"}, exclude_none=True), indent=1))
        click.echo(logs_hint(settings.store, result.logs), err=True)
