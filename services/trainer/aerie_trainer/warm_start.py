"""Warm start (`TrainConfig.init_from`): training begins from an existing EAGLE-3 drafter's weights.

    aerie train --runs sharegpt --drafter smol-v2 --model M --init-from smol-eagle3      # published in the store
    aerie train ... --init-from ./smol-eagle3          # a folder `aerie pull` wrote
    aerie train ... --init-from ./specforge-export     # SpecForge's SGLang export: config.json + *.safetensors

- The source is an existing folder, read in place, else a published drafter NAME[:VERSION], pulled
  into a temporary folder with every file checked against its lineage's sha256 (aerie.drafters.pull).
- An MLA drafter (`--drafter-arch mla`) starts from an `Eagle3DeepseekV2ForCausalLM` folder, a
  Llama-layer one from a `LlamaForCausalLMEagle3` folder; the other is refused by name.
- Tensor names: SpecForge's `LlamaForCausalLMEagle3` (specforge/modeling/draft/llama3_eagle.py)
  has the modules `fc`, `midlayer` (`input_layernorm`, `hidden_norm`, `self_attn.{q,k,v,o}_proj`,
  `post_attention_layernorm`, `mlp.{gate,up,down}_proj`), `norm`, `lm_head` and the buffers `d2t`,
  `t2d`, and its SGLang exporter's weight map is the identity: aerie's drafter uses the same names.
  A folder is read the way SGLang's loader reads it: `layers.0.` is `midlayer.` (its legacy map), an
  `embed_tokens.weight` is skipped (the drafter uses the target's embeddings, frozen).
- Checked against the run's drafter before anything trains, each refusal one line: pickled weights
  (`*.bin`, `*.pt`, ...: never loaded), a missing or unexpected tensor, a shape that differs (both
  shapes named), layer ids other than the run's capture points (both named; a config without
  `eagle_aux_hidden_state_layer_ids` is read as SGLang's default, points [2, N//2, N-3]), a d2t/t2d
  that disagree.
- The draft vocabulary comes with the weights (d2t, t2d); a source without them is accepted only
  when its head covers the whole target vocabulary (then d2t is zero and t2d all true).
- The origin (`aerie.contracts.InitOrigin`: the reference, the drafter it named, each file's
  sha256) is what `load_into` returns; the trainer keeps it in its metrics and the lineage records it.
A resumed job loads its own checkpoint, never the source again (aerie_trainer.trainer).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open

from aerie import drafters
from aerie.capture import CaptureError, convention_for, default_capture_points, from_engine_ids
from aerie.contracts import InitOrigin
from aerie.errors import ExpectedError
from aerie.store import NotFound, ObjectStore
from aerie_trainer.model import Eagle3Drafter

ARCHITECTURE = "LlamaForCausalLMEagle3"
ARCHITECTURES = {"llama": ARCHITECTURE, "mla": "Eagle3DeepseekV2ForCausalLM"}  # DrafterConfig.arch -> SGLang's
PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
RENAMED = {"layers.0.": "midlayer."}  # SGLang's legacy name map, read backwards
SKIPPED = ("embed_tokens.weight",)
VOCAB = ("d2t", "t2d")  # the target's, not the drafter's
FIX = {  # what sets each tensor's shape, for the refusal's fix
    "fc.weight": "the run's capture points x the target's hidden size",
    "lm_head.weight": "--draft-vocab",
    "d2t": "--draft-vocab",
    "t2d": "the target's vocabulary",
}


class WarmStartError(ExpectedError, ValueError):
    """A source drafter the run's drafter cannot start from; the message names the tensor or setting."""


def load_into(
    drafter: Eagle3Drafter,
    store: ObjectStore,
    ref: str,
    capture_points: list[int],
    architecture: str,
    num_layers: int,
) -> InitOrigin:
    """Copy the source's weights and draft vocabulary into `drafter` (all of it, or nothing)."""
    folder = Path(ref).expanduser()
    if folder.is_dir():
        return _load_folder(drafter, folder, ref, None, capture_points, architecture, num_layers)
    try:
        name, version = drafters.resolve(store, ref)
    except (NotFound, drafters.DrafterError) as e:
        raise WarmStartError(f"init_from {ref!r}: no such folder, nor a published drafter: {e}") from None
    with tempfile.TemporaryDirectory(prefix="aerie-init-from-") as tmp:
        drafters.pull(store, f"{name}:{version}", tmp)
        return _load_folder(drafter, Path(tmp), ref, f"{name}:{version}", capture_points, architecture, num_layers)


def _load_folder(
    drafter: Eagle3Drafter,
    folder: Path,
    ref: str,
    published: str | None,
    capture_points: list[int],
    architecture: str,
    num_layers: int,
) -> InitOrigin:
    where = f"init_from {ref!r}"
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix == ".safetensors")
    if not files:
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLED)
        raise WarmStartError(
            f"{where}: no *.safetensors weights"
            + (
                f" ({', '.join(pickled)} are pickled and never loaded: export the drafter as safetensors)"
                if pickled
                else ""
            )
        )
    if not (folder / "config.json").is_file():
        raise WarmStartError(f"{where}: no config.json (a drafter folder is config.json + *.safetensors)")
    config = json.loads((folder / "config.json").read_text())
    arch = drafter.config.arch
    if ARCHITECTURES[arch] not in (config.get("architectures") or []):
        other = [a for a, name in ARCHITECTURES.items() if name in (config.get("architectures") or [])]
        raise WarmStartError(
            f"{where}: config architectures {config.get('architectures')} is not [{ARCHITECTURES[arch]!r}]"
            + (
                f": the source is a {other[0]} drafter, this run's is {arch} (--drafter-arch {other[0]})"
                if other
                else ""
            )
        )
    check_layers(config, capture_points, architecture, num_layers, where)
    weights = _read(files, where)
    _load_weights(drafter, weights, where)
    read = [folder / "config.json", *files]
    return InitOrigin(
        source=ref,
        drafter=published,
        format="aerie" if (folder / "aerie.json").is_file() else "eagle3",
        files={p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in read},
    )


def check_layers(config: dict, capture_points: list[int], architecture: str, num_layers: int, where: str) -> None:
    """The source's layer ids, read with SGLang's rule for the target, must be the run's capture points."""
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    try:
        points = (
            from_engine_ids(ids, convention_for("sglang", architecture), num_layers)
            if ids
            else default_capture_points(num_layers)
        )
    except CaptureError as e:
        raise WarmStartError(f"{where}: {e}") from None
    if points != list(capture_points):
        said = f"layer ids {ids}" if ids else "no layer ids (SGLang's default)"
        raise WarmStartError(
            f"{where}: trained at capture points {points} ({said}), the run's are {list(capture_points)}: "
            "start from a drafter trained at the run's layers"
        )


def _read(files: list[Path], where: str) -> dict[str, torch.Tensor]:
    """Every tensor of the files under aerie's names (RENAMED applied, SKIPPED left out)."""
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                ours = name
                for theirs, mine in RENAMED.items():
                    ours = mine + ours[len(theirs) :] if ours.startswith(theirs) else ours
                if ours in SKIPPED:
                    continue
                if ours in weights:
                    raise WarmStartError(f"{where}: tensor {ours} appears twice (in {path.name} too)")
                weights[ours] = f.get_tensor(name)
    return weights


def _load_weights(drafter: Eagle3Drafter, weights: dict[str, torch.Tensor], where: str) -> None:
    own = drafter.exported_state_dict()
    own = {n: t for n, t in own.items() if n not in VOCAB} | {n: own[n] for n in VOCAB}  # weights first
    if "d2t" not in weights and "t2d" not in weights and "lm_head.weight" in weights:
        if weights["lm_head.weight"].shape[0] == drafter.config.vocab_size:  # a full-vocabulary head
            weights = {**weights, "d2t": torch.zeros_like(own["d2t"]), "t2d": torch.ones_like(own["t2d"])}
    missing = [n for n in own if n not in weights]
    if missing:
        raise WarmStartError(
            f"{where}: no tensor {missing[0]} (this run's drafter has it, shape {list(own[missing[0]].shape)})"
            + (f", nor {len(missing) - 1} other(s)" if len(missing) > 1 else "")
        )
    extra = [n for n in weights if n not in own]
    if extra:
        raise WarmStartError(
            f"{where}: tensor {extra[0]} {list(weights[extra[0]].shape)} has no place in this run's drafter"
        )
    for name, mine in own.items():
        theirs = weights[name]
        if theirs.shape != mine.shape:
            fix = f" (set by {FIX.get(name, '--drafter-shape')})"
            raise WarmStartError(
                f"{where}: tensor {name} has shape {list(theirs.shape)}, this run's drafter {list(mine.shape)}{fix}"
            )
        if theirs.is_floating_point() != mine.is_floating_point():
            raise WarmStartError(f"{where}: tensor {name} is {theirs.dtype}, this run's drafter {mine.dtype}")
    d2t, t2d = weights["d2t"].to(torch.int64), weights["t2d"].to(torch.bool)
    hot = d2t + torch.arange(len(d2t))
    if int(hot.min()) < 0 or int(hot.max()) >= len(t2d) or len(hot.unique()) != len(hot):
        raise WarmStartError(f"{where}: d2t maps draft ids outside the target vocabulary or twice onto one id")
    if not torch.equal(torch.nonzero(t2d).flatten(), hot.sort().values):
        raise WarmStartError(f"{where}: t2d disagrees with d2t (they are one draft vocabulary)")
    with torch.no_grad():
        drafter.load_state_dict({n: weights[n].to(own[n].dtype) for n in own}, strict=False)
