"""A compressed-tensors W4A16 checkpoint of an HF model folder, written by the compressed-tensors
library (the format Kimi-K2.5 ships: `pack-quantized`, 4-bit symmetric integer weights in groups of
`--group`, eight to an int32, bf16 scales; every decoder Linear, `lm_head` left out). Scales are each
group's min/max (the library's `calculate_qparams`, no calibration data).

    python benchmarks/make_w4a16.py --source DIR --out DIR [--group 32] [--dequantized DIR]

`--dequantized DIR` also writes the reference a serving engine's W4A16 kernel should match: the
same model in plain bf16 whose quantized Linears hold exactly the int4 values times their scales
(the library's `fake_quantize`), no `quantization_config`, loadable by any transformers.

Used by tests/quantized_w4a16.py (SmolLM2) and by `benchmarks/gpu_capture_device.sh w4a16` (a
random Llama whose sizes are multiples of 128, as SGLang's Marlin INT4 kernel needs).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from compressed_tensors.compressors import ModelCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.lifecycle.forward import fake_quantize
from compressed_tensors.quantization.utils import calculate_qparams
from transformers import AutoModelForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def build(source: Path, out: Path, group: int, dequantized: Path | None = None) -> None:
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
    if dequantized is not None:
        plain = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
        linears = dict(model.named_modules())
        with torch.no_grad():
            for name, module in plain.named_modules():
                q = linears.get(name)
                if isinstance(module, torch.nn.Linear) and getattr(q, "quantization_scheme", None) is not None:
                    # in the weights' own bf16, as the compressor quantizes (float32 rounds ~1% otherwise)
                    w, scale = q.weight.detach(), q.weight_scale.detach()
                    module.weight.copy_(fake_quantize(w, scale, q.weight_zero_point, args).to(torch.bfloat16))
        plain.save_pretrained(dequantized)
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, dequantized / name)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--dequantized", type=Path, help="also write the plain bf16 reference of the int4 weights")
    a = p.parse_args()
    build(a.source, a.out, a.group, a.dequantized)


if __name__ == "__main__":
    main()
