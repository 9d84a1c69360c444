"""`aerie run`'s training settings: the size's recipe, a preset's (checked against the model), and
the command's options over both; a preset or --epochs without --steps trains for epochs."""

from __future__ import annotations

import json

import click
import pytest

from aerie import presets
from aerie.app.pipeline import training_config
from aerie.contracts import RunSize, TrainConfig
from tests.runs import DATA


def test_options_over_the_size(smollm2_path):
    quick = training_config(presets.load_size("quick"), smollm2_path, None, None, None, None)
    assert (quick.steps, quick.lr, quick.ttt_steps, quick.grad_clip, quick.preset) == (120, 3e-3, 2, 1.0, None)
    mine = training_config(
        presets.load_size("quick"),
        smollm2_path,
        50,
        512,
        None,
        None,
        lr=1e-3,
        ttt_steps=4,
        batch_tokens=128,
        seq_len=64,
        drafter_shape='{"intermediate_size": 256}',
        drafter_arch="mla",
        train_config='{"grad_accum": 2}',
    )
    assert (
        mine.steps,
        mine.draft_vocab_size,
        mine.lr,
        mine.ttt_steps,
        mine.batch_tokens,
        mine.max_seq_tokens,
        mine.drafter.intermediate_size,
        mine.grad_accum,
    ) == (50, 512, 1e-3, 4, 128, 64, 256, 2)
    assert mine.drafter.arch == "mla"  # --drafter-arch over --drafter-shape, its other fields kept
    assert training_config(presets.load_size("quick"), smollm2_path, None, None, None, None).drafter.arch == "llama"
    by_epochs = training_config(presets.load_size("quick"), smollm2_path, None, None, None, None, epochs=2)
    assert (by_epochs.steps, by_epochs.epochs, by_epochs.warmup_steps) == (None, 2, None)


def test_a_preset_is_checked_against_the_model(smollm2_path, tmp_path):
    with pytest.raises(
        click.UsageError, match="preset llama-3.1-8b is for meta-llama/Llama-3.1-8B-Instruct; the model differs"
    ):
        training_config(presets.load_size("default"), smollm2_path, None, None, None, None, preset="llama-3.1-8b")
    (tmp_path / "config.json").write_text((DATA / "llama_3_1_8b_instruct_config.json").read_text())
    config = training_config(
        presets.load_size("default"), tmp_path, None, None, None, None, preset="llama-3.1-8b", lr=5e-5
    )
    assert (config.preset, config.steps, config.epochs, config.lr, config.draft_vocab_size, config.ttt_steps) == (
        "llama-3.1-8b",
        None,
        10,
        5e-5,
        32000,
        7,
    )
    with pytest.raises(click.BadParameter, match="training setting lr=-1"):
        training_config(
            presets.load_size("default"), smollm2_path, None, None, None, None, train_config=json.dumps({"lr": -1})
        )


def test_the_sizes_are_recipe_files():
    """`aerie run`'s sizes load from aerie/recipes/sizes through their contract: the size sets its
    TrainConfig fields, TrainConfig's defaults the rest; a size that sets a derived field is refused."""
    assert presets.size_names() == ["default", "quick"]
    default = presets.load_size("default")
    assert (default.records, default.max_tokens, default.shard_tokens) == (160, 192, 3072)
    config = default.train_config()
    assert (config.steps, config.max_seq_tokens, config.checkpoint_every, config.grad_clip, config.seed) == (
        300,
        192,
        75,
        1.0,
        TrainConfig().seed,
    )
    assert default.train_config(steps=20).checkpoint_every == 10
    with pytest.raises(presets.PresetError, match="no size 'huge': known sizes are default, quick"):
        presets.load_size("huge")
    raw = json.loads(default.model_dump_json(exclude_unset=True))
    assert RunSize.model_validate(raw) == default
    with pytest.raises(ValueError, match="max_seq_tokens and checkpoint_every follow from the size"):
        RunSize.model_validate({**raw, "train": {**raw["train"], "checkpoint_every": 5}})
