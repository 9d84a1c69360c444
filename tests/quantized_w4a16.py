"""A real INT4 checkpoint in Kimi-K2.5's format: SmolLM2-135M quantized to compressed-tensors W4A16
(`pack-quantized`: 4-bit symmetric integer weights in groups of 32, eight to an int32, bf16 scales),
written by the compressed-tensors library itself (`benchmarks/make_w4a16.py`) (pinned in requirements-dev.txt; SGLang's own pin
reads the same version) and not by hand.

    folder = smollm2_w4a16(cache_dir, smollm2_path)

Every decoder Linear is quantized; `lm_head` is left out (`ignore: ["lm_head"]`, as Kimi-K2.5 ships;
SmolLM2 ties it to the embeddings anyway). The scales are each group's min/max range
(compressed-tensors' `calculate_qparams`, its round-to-nearest observer without calibration data).
config.json carries the library's `quantization_config`, which SGLang and transformers read.

Unlike `tests/quantized.py` (weights quantized and dequantized back, served as a plain model), this
folder needs an INT4 kernel: SGLang 0.5.23's is Marlin-only (GPU; `benchmarks/gpu_capture_device.sh
w4a16`); on the CPU aerie's test harness supplies it (`aerie_sglang/cpu/int4.py`, proven in
tests/inference/test_sglang_int4.py). transformers loads it dequantized (`aerie.target.hf_load_kwargs`).
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

BUILDER = Path(__file__).resolve().parents[1] / "benchmarks" / "make_w4a16.py"


def smollm2_w4a16(cache_dir: str | os.PathLike, smollm2_path: str | os.PathLike, group: int = GROUP) -> Path:
    """The W4A16 SmolLM2 folder (config with quantization_config, tokenizer, model.safetensors), built once."""
    from aerie.target import describe

    source = Path(smollm2_path)
    h = hashlib.sha256(Path(__file__).read_bytes() + BUILDER.read_bytes())
    h.update(describe(source).weights_sha256.encode())
    out = Path(cache_dir).expanduser() / "test-targets" / f"smollm2-w4a16-g{group}-{h.hexdigest()[:16]}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "model.safetensors").is_file():
            tmp = out.with_name(out.name + ".part")
            shutil.rmtree(tmp, ignore_errors=True)
            subprocess.run(
                [sys.executable, str(BUILDER), "--source", str(source), "--out", str(tmp), "--group", str(group)],
                check=True,
                timeout=600,
            )
            shutil.rmtree(out, ignore_errors=True)
            os.replace(tmp, out)
    return out
