"""Quantized serving targets for the tests: SmolLM2-135M's weights round-tripped through 4- or
3-bit quantization, saved as plain model folders.

    folder = smollm2_quantized(cache_dir, smollm2_path)                  # 4 bits, groups of 32 (test_align.py)
    folder = smollm2_quantized(cache_dir, smollm2_path, PER_CHANNEL, 3)  # 3 bits, one group per output row

The seed's failure in miniature: a drafter is trained on states of the unquantized model and
served on a quantized one (the seed's Kimi-K2 deployment is INT4 with 32-weight groups). Every
linear weight of the decoder layers (q, k, v, o, gate, up, down) is quantized round-to-nearest,
asymmetric, `bits` per weight (BITS = 4) with one scale and zero point per `group` consecutive
input weights (GROUP = 32; PER_CHANNEL: a whole row, the coarser layout), then dequantized back and
stored in the source's dtype (bf16). Measured (benchmarks/reports/history-2026-12.md "Alignment"): 4 bits in groups of 32
keep the residual stream at cosine 0.9965 / 0.980 / 0.969 (points 2 / 15 / 27), 4 bits per channel
at 0.991 / 0.963 / 0.935. Embeddings (tied with the lm_head) and norms stay as they are, as INT4
checkpoints keep them. The folder has no `quantization_config`: SGLang serves the dequantized
weights as a plain model, so it computes what an integer kernel computes up to the kernel's own
rounding.

Only safetensors and torch tensors: no transformers model load. Built once per source of this
module and per source weights under `<cache>/test-targets/`, like the SmolLM2 conversion.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path

BITS = 4
GROUP = 32
PER_CHANNEL = 0  # `group` value: one scale and zero point per output row
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
COPIED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def quantize_dequantize(weight, bits: int = BITS, group: int = GROUP):
    """[out, in] -> the same shape after round-to-nearest asymmetric quantization of every
    `group` consecutive input weights (PER_CHANNEL: the whole row) to `bits` bits (in float32)."""
    import torch

    out_features, in_features = weight.shape
    group = group or in_features
    if in_features % group:
        raise ValueError(f"input size {in_features} is not a multiple of the group size {group}")
    w = weight.to(torch.float32).reshape(out_features, in_features // group, group)  # (out, groups, group)
    lo, hi = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    levels = 2**bits - 1
    scale = ((hi - lo) / levels).clamp_min(1e-12)
    zero = torch.round(-lo / scale)
    q = torch.clamp(torch.round(w / scale) + zero, 0, levels)
    return ((q - zero) * scale).reshape(out_features, in_features).to(weight.dtype)


def is_quantized(name: str) -> bool:
    return ".layers." in name and name.endswith(".weight") and name.rsplit(".", 2)[-2] in QUANTIZED


def smollm2_quantized(
    cache_dir: str | os.PathLike, smollm2_path: str | os.PathLike, group: int = GROUP, bits: int = BITS
) -> Path:
    """The quantized SmolLM2 folder (config, tokenizer, model.safetensors), built once."""
    source = Path(smollm2_path)
    h = hashlib.sha256(Path(__file__).read_bytes())
    from aerie.target import describe

    h.update(describe(source).weights_sha256.encode())
    layout = f"g{group}" if group else "channel"
    out = Path(cache_dir).expanduser() / "test-targets" / f"smollm2-int{bits}-{layout}-{h.hexdigest()[:16]}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process building it: wait for it
        if not (out / "model.safetensors").is_file():
            _build(out, source, group, bits)
    return out


def _build(out: Path, source: Path, group: int, bits: int) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(source / "model.safetensors"))
    done = [name for name in tensors if is_quantized(name)]
    if len(done) != 7 * json.loads((source / "config.json").read_text())["num_hidden_layers"]:
        raise AssertionError(f"{source}: found {len(done)} decoder linear weights to quantize")
    for name in done:
        tensors[name] = quantize_dequantize(tensors[name], bits, group).contiguous()
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for name in COPIED:
        if (source / name).is_file():
            shutil.copy2(source / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def trained_on_quantized(
    cache_dir: str | os.PathLike, smollm2_path: str | os.PathLike, group: int = PER_CHANNEL, bits: int = BITS
):
    """The shared trained drafter's twin (tests/trained.py: same conversations, same training), its
    states and target signal taken from the quantized SmolLM2: the drafter that matches a quantized
    serving target. No speculative-decoding evaluation in training (the test serves it instead).
    Cached like the shared one, keyed by the run, the config and the trainer's and library's source."""
    from aerie import presets, stages
    from aerie.contracts import TrainRequest
    from aerie.settings import Settings
    from aerie.store import FsStore
    from tests.runs import hidden_run_folder, upload_run
    from tests.trained import SIZE, Trained, source_digest, train_config

    target = smollm2_quantized(cache_dir, smollm2_path, group, bits)
    size = presets.load_size(SIZE)
    run_folder = hidden_run_folder(
        cache_dir, target, records=size.records, max_tokens=size.max_tokens, shard_sequences=16
    )
    config = train_config().model_copy(update={"eval_prompts": 0})
    key = hashlib.sha256(json.dumps([run_folder.name, config.model_dump(), source_digest()]).encode()).hexdigest()[:16]
    folder = Path(cache_dir) / "test-drafters" / f"{target.name.rsplit('-', 1)[0]}-{key}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "train.json").is_file():
            import time

            shutil.rmtree(folder, ignore_errors=True)
            store = FsStore(folder / "store")
            upload_run(store, run_folder, f"sharegpt-int{bits}")
            started = time.monotonic()
            request = TrainRequest(
                runs=[f"sharegpt-int{bits}"], drafter=f"smol-int{bits}-eagle3", model=str(target), config=config
            )
            result = stages.train(store, Settings(store=f"file://{store.root}"), request).model_dump(mode="json")
            result["train_wall_s"] = time.monotonic() - started
            stages.pull(store, request.drafter, folder / "pulled")
            (folder / "train.json").write_text(json.dumps(result))  # last: marks the folder complete
    return Trained(folder / "store", folder / "pulled", json.loads((folder / "train.json").read_text()))
