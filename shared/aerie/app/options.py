"""The training options of the user's commands (`enqueue --train-drafter`, `aerie run`) as click
options; what they mean and how they combine is `aerie.presets.train_config`'s."""

from __future__ import annotations

import click

from aerie import presets
from aerie.contracts import TrainConfig

OPTIONS = {
    "preset": click.option(
        "--preset",
        default=None,
        help="training recipe: a file of aerie/recipes (" + ", ".join(presets.names()) + ")",
    ),
    "epochs": click.option(
        "--epochs",
        type=click.FloatRange(min=0, min_open=True),
        default=None,
        help="passes over the data (default 10; ignored with --steps)",
    ),
    "steps": click.option(
        "--steps",
        type=click.IntRange(min=1),
        default=None,
        help="optimizer steps (default: from --epochs and the data size)",
    ),
    "lr": click.option(
        "--lr", type=click.FloatRange(min=0, min_open=True), default=None, help="peak learning rate (default 1e-4)"
    ),
    "batch_tokens": click.option(
        "--batch-tokens",
        type=click.IntRange(min=16),
        default=None,
        help="tokens per micro-batch and rank (default 4096)",
    ),
    "seq_len": click.option(
        "--seq-len", type=click.IntRange(min=16), default=None, help="tokens of a sequence trained on (default 2048)"
    ),
    "ttt_steps": click.option(
        "--ttt-steps",
        type=click.IntRange(min=1),
        default=None,
        help="training-time-test steps (default: --speculative-num-steps plus a margin, 7)",
    ),
    "speculative_num_steps": click.option(
        "--speculative-num-steps",
        type=click.IntRange(min=1),
        default=None,
        help="draft steps of the chain the drafter will serve (SGLang's --speculative-num-steps, default 3): "
        "--ttt-steps defaults to it plus a margin",
    ),
    "draft_vocab": click.option(
        "--draft-vocab", type=click.IntRange(min=2), default=None, help="draft vocabulary size (default 32000)"
    ),
    "drafter_shape": click.option(
        "--drafter-shape", default=None, help="the drafter layer's shape as JSON, e.g. '{\"num_key_value_heads\": 8}'"
    ),
    "drafter_arch": click.option(
        "--drafter-arch",
        type=click.Choice(["llama", "mla"]),
        default=None,
        help="the drafter layer SGLang serves: llama (grouped-query attention, default) or mla (DeepSeek's "
        "multi-head latent attention, Eagle3DeepseekV2ForCausalLM; copies an MLA target's attention shape)",
    ),
    "eval_every": click.option(
        "--eval-every",
        type=click.IntRange(min=1),
        default=None,
        help="measure acceptance every N steps and at each checkpoint (default: before and after only)",
    ),
    "publish_checkpoint": click.option(
        "--publish-checkpoint",
        type=click.Choice(["last", "best"]),
        default=None,
        help="publish the last step (default) or the measured step that accepted best (needs --eval-every)",
    ),
    "init_from": click.option(
        "--init-from",
        default=None,
        help="warm start from this drafter: a folder (aerie pull's, or SpecForge's export: config.json + "
        "*.safetensors) or a published drafter NAME[:VERSION]",
    ),
    "stream": click.option(
        "--stream",
        is_flag=True,
        default=None,
        help="start training on the run's first hidden shards and follow the extraction (same steps as "
        "waiting); the extraction and training overlap, on workers (--broker) as in this process",
    ),
    "train_config": click.option(
        "--train-config", default=None, help="any TrainConfig field as JSON, e.g. '{\"grad_accum\": 4}'"
    ),
}


def train_options(skip: tuple[str, ...] = ()):
    """Add the training options (all but `skip`, which the command already has) to a click command."""

    def decorate(command):
        for name in reversed(list(OPTIONS)):
            if name not in skip:
                command = OPTIONS[name](command)
        return command

    return decorate


def train_config(*args, **kwargs) -> TrainConfig:
    """`aerie.presets.train_config`, an invalid setting reported by click as a bad parameter."""
    try:
        return presets.train_config(*args, **kwargs)
    except presets.SettingError as e:
        raise click.BadParameter(str(e)) from None
