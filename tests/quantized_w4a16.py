"""A real INT4 checkpoint in Kimi-K2.5's format: SmolLM2-135M quantized to compressed-tensors W4A16
(`pack-quantized`: 4-bit symmetric integer weights in groups of 32, eight to an int32, bf16 scales),
written by the compressed-tensors library itself (pinned in requirements-dev.txt; SGLang's own pin
reads the same version) and not by hand.

    folder = smollm2_w4a16(cache_dir, smollm2_path)

Every decoder Linear is quantized; `lm_head` is left out (`ignore: ["lm_head"]`, as Kimi-K2.5 ships;
SmolLM2 ties it to the embeddings anyway). The scales are each group's min/max range
(compressed-tensors' `calculate_qparams`, its round-to-nearest observer without calibration data).
config.json carries the library's `quantization_config`, which SGLang and transformers read.

Unlike `tests/quantized.py` (weights quantized and dequantized back, served as a plain model), this
folder needs an INT4 kernel: SGLang 0.5.23 has none on the CPU for it (BENCHMARKS.md / README's
Kimi-K2.5 section); `benchmarks/gpu_capture_device.sh w4a16` serves it on a GPU.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

GROUP = 32
COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

_BUILD = """
import sys
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme, apply_quantization_config
from compressed_tensors.quantization.utils import calculate_qparams

source, out, group = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
scheme = QuantizationScheme(targets=["Linear"], weights=args)
apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
done = 0
for module in model.modules():
    if isinstance(module, torch.nn.Linear) and getattr(module, "quantization_scheme", None) is not None:
        w = module.weight.detach().float().reshape(module.weight.shape[0], -1, group)
        scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
        module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))
        module.weight_zero_point.data.copy_(zero.to(module.weight_zero_point.dtype))
        done += 1
expected = 7 * model.config.num_hidden_layers
if done != expected:
    raise SystemExit(f"quantized {done} Linear modules, expected {expected}")
compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
compressor.compress_model(model)
model.save_pretrained(out)
compressor.update_config(out)
"""


def smollm2_w4a16(cache_dir: str | os.PathLike, smollm2_path: str | os.PathLike, group: int = GROUP) -> Path:
    """The W4A16 SmolLM2 folder (config with quantization_config, tokenizer, model.safetensors), built once."""
    from aerie.target import describe

    source = Path(smollm2_path)
    h = hashlib.sha256(Path(__file__).read_bytes())
    h.update(describe(source).weights_sha256.encode())
    out = Path(cache_dir).expanduser() / "test-targets" / f"smollm2-w4a16-g{group}-{h.hexdigest()[:16]}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "model.safetensors").is_file():
            tmp = out.with_name(out.name + ".part")
            shutil.rmtree(tmp, ignore_errors=True)
            subprocess.run([sys.executable, "-c", _BUILD, str(source), str(tmp), str(group)], check=True, timeout=600)
            for name in COPIED:
                if (source / name).is_file():
                    shutil.copy2(source / name, tmp / name)
            shutil.rmtree(out, ignore_errors=True)
            os.replace(tmp, out)
    return out
