"""A quantized serving target for the tests: SmolLM2-135M's weights round-tripped through 4-bit
per-group quantization, saved as a plain model folder.

    folder = smollm2_int4(cache_dir, smollm2_path)   # the alignment tests' quantized target

The seed's failure in miniature: a drafter is trained on states of the unquantized model and
served on an INT4 one (the seed's Kimi-K2 deployment is INT4 with 32-weight groups). Every linear
weight of the decoder layers (q, k, v, o, gate, up, down) is quantized round-to-nearest,
asymmetric, 4 bits per weight with one scale and zero point per GROUP consecutive input weights,
then dequantized back and stored in the source's dtype (bf16). Embeddings (tied with the lm_head)
and norms stay as they are, as INT4 checkpoints keep them. The folder has no
`quantization_config`: SGLang serves the dequantized weights as a plain model, so it computes
what an INT4 kernel computes up to the kernel's own rounding.

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
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "special_tokens_map.json", "chat_template.jinja")


def quantize_dequantize(weight, bits: int = BITS, group: int = GROUP):
    """[out, in] -> the same shape after round-to-nearest asymmetric quantization of every
    `group` consecutive input weights to `bits` bits (computed in float32)."""
    import torch

    out_features, in_features = weight.shape
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


def smollm2_int4(cache_dir: str | os.PathLike, smollm2_path: str | os.PathLike, group: int = GROUP) -> Path:
    """The quantized SmolLM2 folder (config, tokenizer, model.safetensors), built once."""
    source = Path(smollm2_path)
    h = hashlib.sha256(Path(__file__).read_bytes())
    from aerie.target import describe

    h.update(describe(source).weights_sha256.encode())
    out = Path(cache_dir).expanduser() / "test-targets" / f"smollm2-int{BITS}-g{group}-{h.hexdigest()[:16]}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process building it: wait for it
        if not (out / "model.safetensors").is_file():
            _build(out, source, group)
    return out


def _build(out: Path, source: Path, group: int) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(source / "model.safetensors"))
    done = [name for name in tensors if is_quantized(name)]
    if len(done) != 7 * json.loads((source / "config.json").read_text())["num_hidden_layers"]:
        raise AssertionError(f"{source}: found {len(done)} decoder linear weights to quantize")
    for name in done:
        tensors[name] = quantize_dequantize(tensors[name], BITS, group).contiguous()
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for name in COPIED:
        if (source / name).is_file():
            shutil.copy2(source / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
