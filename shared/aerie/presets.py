"""Training recipes per target family, and the training options of the user's commands.

Presets are data files, `aerie/recipes/<name>.json`, each an `aerie.contracts.Preset`
(capture points, drafter shape, draft vocab, sequence length, lr, epochs, GPUs needed):

    llama-3.1-8b  qwen3-8b  qwen3-30b-a3b  deepseek-v3  kimi-k2.5  smollm2-135m

- `load(name)`: the preset, checked by the contract; an unknown name lists the known ones.
- `load_size(name)`: an `aerie run` size (`aerie/recipes/sizes/<name>.json`, an
  `aerie.contracts.RunSize`: records, tokens, shard size and the TrainConfig fields it sets):
  `quick` and `default`. A preset's fields go over the size's.
- `check_model(preset, config)`: a preset applied to another model (architecture, hidden size,
  layers, vocab) is refused by name, before anything is enqueued.
- `train_config(...)`: the training settings every command
  that starts a training takes (`enqueue --train-drafter`, `aerie run`): `--preset`, `--epochs`,
  `--steps`, `--lr`, `--batch-tokens`, `--seq-len`, `--ttt-steps`, `--draft-vocab`,
  `--drafter-shape`, `--drafter-arch` (llama or mla: sets the shape's `arch`), `--eval-every`,
  `--publish-checkpoint`, `--init-from` (warm start), and
  `--train-config` (any TrainConfig field as JSON). Precedence: an explicit option, then
  `--train-config`, then the preset, then the command's own defaults. The click options themselves are the app's (`aerie.app.options`).
"""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from aerie.contracts import DrafterShape, Preset, RunSize, TrainConfig

RECIPES = "recipes"
SIZES = "sizes"  # aerie/recipes/sizes/<name>.json: `aerie run`'s sizes


class PresetError(ValueError):
    """An unknown preset, or one that does not fit the model; the message names both."""


class SettingError(ValueError):
    """A training setting that is not valid (the command line reports it as a bad parameter)."""


def names() -> list[str]:
    return sorted(
        p.name[: -len(".json")] for p in files("aerie").joinpath(RECIPES).iterdir() if p.name.endswith(".json")
    )


def load(name: str) -> Preset:
    if name not in names():
        raise PresetError(f"no preset {name!r}: known presets are {', '.join(names())}")
    raw = files("aerie").joinpath(RECIPES, f"{name}.json").read_text()
    try:
        preset = Preset.model_validate_json(raw)
    except ValidationError as e:
        raise PresetError(
            f"preset file {RECIPES}/{name}.json: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}"
        ) from None
    if preset.name != name:
        raise PresetError(f"preset file {RECIPES}/{name}.json names itself {preset.name!r}")
    if preset.capture_points and preset.capture_points[-1] >= preset.num_layers:
        raise PresetError(f"preset {name}: capture point {preset.capture_points[-1]} >= its {preset.num_layers} layers")
    return preset


def size_names() -> list[str]:
    folder = files("aerie").joinpath(RECIPES, SIZES)
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def load_size(name: str) -> RunSize:
    """An `aerie run` size, checked by the contract; an unknown name lists the known ones."""
    if name not in size_names():
        raise PresetError(f"no size {name!r}: known sizes are {', '.join(size_names())}")
    where = f"{RECIPES}/{SIZES}/{name}.json"
    try:
        size = RunSize.model_validate_json(files("aerie").joinpath(RECIPES, SIZES, f"{name}.json").read_text())
    except ValidationError as e:
        raise PresetError(f"size file {where}: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}") from None
    if size.name != name:
        raise PresetError(f"size file {where} names itself {size.name!r}")
    return size


def check_model(preset: Preset, config: dict[str, Any], where: str = "the model") -> None:
    """Refuse a model the preset is not for (its config.json; a wrapper's `text_config` is read too)."""
    text = {**(config.get("text_config") or {}), **{k: v for k, v in config.items() if k != "text_config"}}
    archs = set(config.get("architectures") or []) | set((config.get("text_config") or {}).get("architectures") or [])
    found = {
        "architecture": sorted(archs),
        "hidden_size": text.get("hidden_size"),
        "num_layers": text.get("num_hidden_layers"),
        "vocab_size": text.get("vocab_size"),
    }
    wanted = {
        "architecture": preset.architectures,
        "hidden_size": preset.hidden_size,
        "num_layers": preset.num_layers,
        "vocab_size": preset.vocab_size,
    }
    wrong = ["architecture"] if not archs & set(preset.architectures) else []
    wrong += [k for k in ("hidden_size", "num_layers", "vocab_size") if found[k] != wanted[k]]
    if wrong:
        diff = ", ".join(f"{k} {found[k]} (preset: {wanted[k]})" for k in wrong)
        raise PresetError(
            f"preset {preset.name} is for {preset.model}; {where} differs: {diff}: pick its preset "
            f"({', '.join(names())}) or pass the settings yourself"
        )


def preset_config(preset: Preset) -> dict[str, Any]:
    """The TrainConfig fields a preset sets."""
    return {
        "draft_vocab_size": preset.draft_vocab_size,
        "max_seq_tokens": preset.max_seq_tokens,
        "lr": preset.lr,
        "epochs": preset.epochs,
        "ttt_steps": preset.ttt_steps,
        "batch_tokens": preset.batch_tokens,
        "activation_checkpointing": preset.activation_checkpointing,
        "drafter": preset.drafter,
        "preset": preset.name,
    }


# --------------------------------------------------------------------------------------
# The commands' settings (their click options: aerie.app.options)
# --------------------------------------------------------------------------------------
FIELDS = {
    "epochs": "epochs",
    "steps": "steps",
    "lr": "lr",
    "batch_tokens": "batch_tokens",
    "seq_len": "max_seq_tokens",
    "ttt_steps": "ttt_steps",
    "speculative_num_steps": "speculative_num_steps",
    "draft_vocab": "draft_vocab_size",
    "eval_every": "eval_every",
    "publish_checkpoint": "publish_checkpoint",
    "init_from": "init_from",
    "stream": "stream",
}


def train_config(
    preset: str | None = None,
    base: dict[str, Any] | None = None,
    model_config: dict[str, Any] | None = None,
    **options: Any,
) -> TrainConfig:
    """The TrainConfig of a command's options: explicit options > --train-config > preset > `base`.
    `model_config`: the target's config.json when readable here (the preset is checked against it)."""
    fields = dict(base or {})
    if preset:
        chosen = load(preset)
        if model_config is not None:
            check_model(chosen, model_config)
        fields.update(preset_config(chosen))
    if options.get("train_config"):
        try:
            fields.update(json.loads(options["train_config"]))
        except (json.JSONDecodeError, TypeError) as e:
            raise SettingError(f"--train-config {options['train_config']!r}: not a JSON object ({e})") from None
    if options.get("speculative_num_steps") is not None and options.get("ttt_steps") is None:
        fields.pop("ttt_steps", None)  # the chain named here: the TTT length follows it (TrainConfig)
    for option, field in FIELDS.items():
        if options.get(option) is not None:
            fields[field] = options[option]
    if fields.get("init_from"):
        fields["init_from"] = init_source(fields["init_from"])
    if options.get("drafter_shape"):
        try:
            fields["drafter"] = DrafterShape.model_validate_json(options["drafter_shape"])
        except ValidationError as e:
            raise SettingError(f"--drafter-shape: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}") from None
    if options.get("drafter_arch"):
        shape = fields.get("drafter") or {}
        shape = shape.model_dump(exclude_none=True) if isinstance(shape, DrafterShape) else dict(shape)
        fields["drafter"] = {**shape, "arch": options["drafter_arch"]}
    try:
        return TrainConfig(**fields)
    except ValidationError as e:
        first = e.errors()[0]
        raise SettingError(
            f"training setting {'.'.join(map(str, first['loc']))}={first.get('input')!r}: {first['msg']}"
        ) from None


def init_source(ref: str) -> str:
    """`--init-from`: a folder here becomes its absolute path (the trainer may run elsewhere in this
    filesystem); anything else is a published drafter NAME[:VERSION], resolved by the trainer."""
    folder = Path(ref).expanduser()
    return str(folder.resolve()) if folder.is_dir() else ref


def capture_points(preset: str | None) -> list[int] | None:
    return list(load(preset).capture_points or []) or None if preset else None
