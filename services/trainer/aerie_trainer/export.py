"""Export a drafter exactly as SGLang's `LlamaForCausalLMEagle3` (or, for an MLA drafter,
`Eagle3DeepseekV2ForCausalLM`) loads it, check it, publish it.

A drafter folder is `config.json` + `model.safetensors` (+ aerie's `aerie.json` lineage):
- config: a Llama config with `architectures: ["LlamaForCausalLMEagle3"]`, `num_hidden_layers: 1`,
  `draft_vocab_size`, `target_hidden_size`, the target's RoPE settings,
  `tie_word_embeddings: false` (true would make SGLang alias `lm_head` to the embeddings and
  drop our head), and `eagle_config.eagle_aux_hidden_state_layer_ids`: the run's capture points
  in the serving engine's own numbering (`aerie.capture`, the only place that translates).
- weights: `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`; no embeddings (SGLang shares the
  target's).

An MLA drafter (DrafterConfig.arch "mla") is written as SGLang 0.5.23's
`sglang/srt/models/kimi_k25_eagle3.py` reads it: a DeepSeek-V3 config (`model_type` deepseek_v3,
`q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`, the legacy
`rope_theta` + `rope_scaling` pair and `rope_interleave`) with `architectures:
["Eagle3DeepseekV2ForCausalLM"]`, and the same `fc`, `midlayer.*` (MLA projections:
`self_attn.{q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
o_proj}`), `norm`, `lm_head`, `d2t`, `t2d`.

SGLang's draft loader silently skips a weight name it does not recognise, so a misnamed tensor
would load, serve and accept nothing. `check_sglang_loadable` replays SGLang 0.5.23's
`load_weights` name mapping (constants below, copied from `sglang/srt/models/llama_eagle3.py`
and `kimi_k25_eagle3.py` and checked against those files by the tests when they are available)
over the folder and refuses anything that would be skipped, left unloaded, or mis-shaped.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from aerie import drafters
from aerie.capture import CaptureError, convention_for, from_engine_ids, to_engine_ids
from aerie.contracts import DrafterLineage, TrainRequest
from aerie.store import ObjectStore
from aerie_trainer.model import (
    MLA_FIELDS,
    ROPE_TYPES,
    DrafterConfig,
    Eagle3Drafter,
    load_target_config,
    load_target_embeddings,
    target_text_config,
)

ARCHITECTURE = "LlamaForCausalLMEagle3"
MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
ARCHITECTURES = {"llama": ARCHITECTURE, "mla": MLA_ARCHITECTURE}  # DrafterConfig.arch -> SGLang's class
SERVING_ENGINE = "sglang"

# --- from sglang 0.5.23, sglang/srt/models/llama_eagle3.py, LlamaForCausalLMEagle3.load_weights
SGLANG_STACKED_PARAMS_MAPPING = [
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
]
SGLANG_LEGACY_NAME_MAP = {
    "midlayer": "layers.0",
    "aux_norm_low": "fc_norm.0",
    "aux_norm_mid": "fc_norm.1",
    "aux_norm_high": "fc_norm.2",
}

# --- from sglang 0.5.23, sglang/srt/models/kimi_k25_eagle3.py, Eagle3DeepseekV2ForCausalLM.load_weights:
# gate/up are stacked; q_a_proj and kv_a_proj_with_mqa are cached and fused into
# fused_qkv_a_proj_with_mqa (q first); `layers.0.` is read as `midlayer.`; all but lm_head get `model.`
SGLANG_MLA_STACKED_PARAMS_MAPPING = [(".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]
SGLANG_MLA_FUSED_A = (".fused_qkv_a_proj_with_mqa", {".q_a_proj": "q", ".kv_a_proj_with_mqa": "kv"})

MLA_ATTENTION_TENSORS = tuple(
    f"midlayer.self_attn.{n}.weight"
    for n in (
        "q_a_proj",
        "q_a_layernorm",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_a_layernorm",
        "kv_b_proj",
        "o_proj",
    )
)

REQUIRED_TENSORS = (
    "fc.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
)


MLA_REQUIRED_TENSORS = (
    tuple(n for n in REQUIRED_TENSORS if not n.startswith("midlayer.self_attn.")) + MLA_ATTENTION_TENSORS
)


def required_tensors(arch: str) -> tuple[str, ...]:
    return MLA_REQUIRED_TENSORS if arch == "mla" else REQUIRED_TENSORS


class ExportError(ValueError):
    """A drafter folder SGLang would not load as trained."""


# --------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------
def drafter_config_json(
    config: DrafterConfig, target_config: dict, layer_ids: list[int], dtype: str = "bfloat16"
) -> dict:
    if config.arch == "mla":
        return mla_config_json(config, target_config, layer_ids, dtype)
    rope = dict(config.rope_parameters)
    out = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "target_hidden_size": config.target_hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": rope["rope_theta"],
        "rope_parameters": rope,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": dtype,
        "torch_dtype": dtype,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids), "use_aux_hidden_state": True},
    }
    out |= target_token_ids(target_config)
    if rope.get("rope_type", "default") == "default":
        out.pop("rope_parameters")  # plain theta: read the same by every transformers version
    return out


def target_token_ids(target_config: dict) -> dict:
    """The target's bos/eos/pad token ids, which a drafter's config.json repeats."""
    text = target_text_config(target_config)
    return {key: text[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in text}


def mla_config_json(config: DrafterConfig, target_config: dict, layer_ids: list[int], dtype: str) -> dict:
    """The config SGLang's `Eagle3DeepseekV2ForCausalLM` reads (through transformers' DeepseekV3Config:
    the legacy `rope_theta` + `rope_scaling` pair, as DeepSeek-V3's own config.json writes it)."""
    rope = dict(config.rope_parameters)
    theta = float(rope.pop("rope_theta"))
    kind = rope.pop("rope_type", "default")
    out = {
        "architectures": [MLA_ARCHITECTURE],
        "model_type": "deepseek_v3",
        "hidden_size": config.hidden_size,
        "target_hidden_size": config.target_hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_attention_heads,
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "num_hidden_layers": 1,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": theta,
        "rope_scaling": None if kind == "default" else {"type": kind, **rope},
        "rope_interleave": True,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "dtype": dtype,
        "torch_dtype": dtype,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids), "use_aux_hidden_state": True},
    }
    return out | target_token_ids(target_config)


def export(
    drafter: Eagle3Drafter,
    folder: str | os.PathLike,
    layer_ids: list[int],
    target_config: dict,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write config.json + model.safetensors; refuse a drafter missing a required tensor."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = drafter.exported_state_dict()
    missing = [n for n in required_tensors(drafter.config.arch) if n not in state]
    if missing:
        raise ExportError(
            f"drafter lacks required tensor(s) {missing}: SGLang would serve it half-loaded; not exported"
        )
    if int(drafter.t2d.sum()) != drafter.config.draft_vocab_size:
        raise ExportError("draft vocabulary not set (t2d is empty): build it before exporting")
    tensors = {n: (t.to(dtype) if t.is_floating_point() else t).detach().cpu().contiguous() for n, t in state.items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    name = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(
        json.dumps(drafter_config_json(drafter.config, target_config, layer_ids, name), indent=2)
    )
    check_sglang_loadable(folder)
    return folder


def load_exported(folder: str | os.PathLike, target_dir: str | os.PathLike) -> Eagle3Drafter:
    """An exported folder back into a drafter (float32), with the target's embeddings."""
    from safetensors.torch import load_file

    from aerie.contracts import DrafterShape

    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    target_config = load_target_config(target_dir)
    num_aux = len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    if MLA_ARCHITECTURE in (cfg.get("architectures") or []):
        rope = dict(cfg.get("rope_scaling") or {"rope_type": "default"})
        rope["rope_type"] = rope.pop("type", rope.get("rope_type", "default"))
        rope["rope_theta"] = cfg["rope_theta"]
        shape = DrafterShape(
            arch="mla",
            num_attention_heads=cfg["num_attention_heads"],
            intermediate_size=cfg["intermediate_size"],
            rope_parameters=rope,
            **{k: cfg[k] for k in MLA_FIELDS},
        )
    else:
        rope = dict(cfg.get("rope_parameters") or {"rope_type": "default"})
        rope.setdefault("rope_theta", cfg["rope_theta"])
        shape = DrafterShape(
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=cfg["head_dim"],
            intermediate_size=cfg["intermediate_size"],
            rope_parameters=rope,
        )
    drafter = Eagle3Drafter(DrafterConfig.from_target(target_config, num_aux, cfg["draft_vocab_size"], shape))
    weights = load_file(str(folder / "model.safetensors"))
    weights["embed_tokens.weight"] = load_target_embeddings(target_dir)
    drafter.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in weights.items()}, strict=True)
    return drafter.eval()


# --------------------------------------------------------------------------------------
# The check against SGLang's loader
# --------------------------------------------------------------------------------------
def sglang_expected_params(cfg: dict) -> dict[str, dict]:
    """SGLang's LlamaForCausalLMEagle3 parameters for a config: name -> {shard id -> shape}.

    Mirrors `LlamaModel.__init__` / `LlamaDecoderLayer.__init__` of llama_eagle3.py (tp=1).
    """
    H = cfg["hidden_size"]
    nh, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim", H // nh)
    inter = cfg["intermediate_size"]
    Ht = cfg.get("target_hidden_size", H)
    layer_ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    num_aux = cfg.get("num_aux_hidden_states") or (len(layer_ids) if layer_ids else 3)
    params: dict[str, dict] = {
        "model.embed_tokens.weight": {None: [cfg["vocab_size"], H]},
        "model.fc.weight": {None: [H, Ht * num_aux]},
        "model.norm.weight": {None: [H]},
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        width = 2 * H if i == 0 else H
        params[p + "self_attn.qkv_proj.weight"] = {
            "q": [nh * hd, width],
            "k": [nkv * hd, width],
            "v": [nkv * hd, width],
        }
        params[p + "self_attn.o_proj.weight"] = {None: [H, nh * hd]}
        params[p + "mlp.gate_up_proj.weight"] = {0: [inter, H], 1: [inter, H]}
        params[p + "mlp.down_proj.weight"] = {None: [H, inter]}
        for norm in ("input_layernorm", "post_attention_layernorm", "hidden_norm"):
            params[p + norm + ".weight"] = {None: [H]}
    if not cfg.get("tie_word_embeddings", False):
        params["lm_head.weight"] = {None: [cfg["draft_vocab_size"] or cfg["vocab_size"], H]}
    return params


def sglang_param_name(name: str, params: dict) -> tuple[str | None, object]:
    """A checkpoint tensor name -> (SGLang parameter it loads into or None if skipped, shard id).

    The same steps, in the same order, as LlamaForCausalLMEagle3.load_weights.
    """
    for legacy, new in SGLANG_LEGACY_NAME_MAP.items():
        if legacy in name:
            name = name.replace(legacy, new)
    if "d2t" in name:
        return "hot_token_id", None
    if "t2d" in name:
        return "t2d (read, unused)", None
    for param_name, weight_name, shard_id in SGLANG_STACKED_PARAMS_MAPPING:
        if weight_name not in name:
            continue
        name = name.replace(weight_name, param_name)
        full = f"model.{name}" if name not in params else name
        return (full if full in params else None), shard_id
    full = name if name in params else f"model.{name}"
    return (full if full in params else None), None


def sglang_mla_expected_params(cfg: dict) -> dict[str, dict]:
    """SGLang's Eagle3DeepseekV2ForCausalLM parameters for a config (tp=1): name -> {shard -> shape}.

    Mirrors `Eagle3MLAModel` / `Eagle3MLADecoderLayer.__init__` of kimi_k25_eagle3.py and
    `DeepseekV2AttentionMLA`'s projections (q LoRA: the 2H-wide fused a-projection)."""
    H, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    q_rank, kv_rank = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    inter, Ht = cfg["intermediate_size"], cfg.get("target_hidden_size") or H
    layer_ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    num_aux = len(layer_ids) if layer_ids is not None else 3
    a = "model.midlayer.self_attn."
    params: dict[str, dict] = {
        "model.embed_tokens.weight": {None: [cfg["vocab_size"], H]},
        "model.fc.weight": {None: [H, Ht * num_aux]},
        "model.norm.weight": {None: [H]},
        a + "fused_qkv_a_proj_with_mqa.weight": {"q": [q_rank, 2 * H], "kv": [kv_rank + rope, 2 * H]},
        a + "q_a_layernorm.weight": {None: [q_rank]},
        a + "q_b_proj.weight": {None: [nh * (nope + rope), q_rank]},
        a + "kv_a_layernorm.weight": {None: [kv_rank]},
        a + "kv_b_proj.weight": {None: [nh * (nope + v), kv_rank]},
        a + "o_proj.weight": {None: [H, nh * v]},
        "model.midlayer.mlp.gate_up_proj.weight": {0: [inter, H], 1: [inter, H]},
        "model.midlayer.mlp.down_proj.weight": {None: [H, inter]},
    }
    for norm in ("input_layernorm", "post_attention_layernorm", "hidden_norm"):
        params[f"model.midlayer.{norm}.weight"] = {None: [H]}
    if not cfg.get("tie_word_embeddings", False):
        params["lm_head.weight"] = {None: [cfg.get("draft_vocab_size") or cfg["vocab_size"], H]}
    return params


def sglang_mla_param_name(name: str, params: dict) -> tuple[str | None, object]:
    """A checkpoint tensor name -> (SGLang parameter or None if skipped, shard id), in the steps
    of Eagle3DeepseekV2ForCausalLM.load_weights."""
    if name == "d2t" or name.endswith(".d2t"):
        return "hot_token_id", None
    if name == "t2d" or name.endswith(".t2d"):
        return "t2d (read, unused)", None
    mapped = re.sub(r"^layers\.0\.", "midlayer.", name)
    if not mapped.startswith("lm_head."):
        mapped = f"model.{mapped}"
    for param_name, weight_name, shard_id in SGLANG_MLA_STACKED_PARAMS_MAPPING:
        if weight_name in mapped and mapped.replace(weight_name, param_name) in params:
            return mapped.replace(weight_name, param_name), shard_id
    fused, parts = SGLANG_MLA_FUSED_A
    for part in (".kv_a_proj_with_mqa", ".q_a_proj"):  # the loader tests "q_a_proj" in the name, a substring
        if part in mapped:
            target = mapped.replace(part, fused)
            return (target if target in params else None), parts[part]
    return (mapped if mapped in params else None), None


def check_sglang_loadable(folder: str | os.PathLike) -> dict:
    """Refuse (ExportError) a folder SGLang 0.5.23 would not load completely; return a report."""
    folder = Path(folder)
    problems: list[str] = []
    cfg = json.loads((folder / "config.json").read_text())
    mla = cfg.get("architectures") == [MLA_ARCHITECTURE]
    if cfg.get("architectures") != [ARCHITECTURE] and not mla:
        problems.append(
            f"config architectures {cfg.get('architectures')} is neither [{ARCHITECTURE!r}] nor [{MLA_ARCHITECTURE!r}]"
        )
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "rms_norm_eps",
        "vocab_size",
        "draft_vocab_size",
        "target_hidden_size",
        *(MLA_FIELDS if mla else ()),
    ):
        if cfg.get(key) is None:
            problems.append(f"config lacks {key!r}")
    if problems:
        raise ExportError(f"{folder}: " + "; ".join(problems))
    if cfg.get("num_hidden_layers") != 1:
        problems.append(f"num_hidden_layers {cfg.get('num_hidden_layers')} != 1 (one midlayer)")
    if cfg.get("tie_word_embeddings", False):
        problems.append("tie_word_embeddings true: SGLang would alias lm_head to the target embeddings and skip ours")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg.get('hidden_act')!r}: SGLang's LlamaMLP supports only silu")
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids or not all(isinstance(i, int) for i in ids):
        problems.append(
            "eagle_config.eagle_aux_hidden_state_layer_ids missing: SGLang would capture its default layers"
        )
    elif len(ids) < 2:
        problems.append(
            f"eagle_aux_hidden_state_layer_ids {ids}: one capture point; SGLang skips `fc` when its input "
            "width equals the hidden size, so this drafter would serve silently wrong (at least 2)"
        )
    rope = (cfg.get("rope_scaling") if mla else cfg.get("rope_parameters")) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if mla and kind not in ("default", "yarn", "deepseek_yarn"):
        problems.append(f"rope_scaling type {kind!r}: SGLang's MLA attention computes DeepSeek's YaRN only")
    elif mla and kind != "default" and "factor" not in rope:
        problems.append(f"rope_scaling type {kind!r} without its 'factor'")
    elif kind not in ROPE_TYPES:
        problems.append(f"rope_type {kind!r}: the drafter computes {', '.join(ROPE_TYPES)} only")
    elif kind != "default" and "factor" not in rope:
        problems.append(f"rope_type {kind!r} without its 'factor': SGLang would scale by 1.0")
    if not (cfg.get("rope_parameters") or {}).get("rope_theta") and cfg.get("rope_theta") is None:
        problems.append("no rope_theta / rope_parameters: SGLang would use theta 10000")
    params = sglang_mla_expected_params(cfg) if mla else sglang_expected_params(cfg)
    param_name = sglang_mla_param_name if mla else sglang_param_name
    loaded: dict[str, set] = {}
    report = {"tensors": {}, "skipped": []}
    with safe_open(folder / "model.safetensors", framework="pt") as f:
        names = list(f.keys())
        for name in names:
            t = f.get_slice(name)
            shape, dtype = list(t.get_shape()), t.get_dtype()
            target, shard = param_name(name, params)
            report["tensors"][name] = target
            if target is None:
                problems.append(f"tensor {name!r} matches no SGLang parameter: it would be silently skipped")
                report["skipped"].append(name)
            elif target == "hot_token_id":
                if dtype != "I64" or shape != [cfg["draft_vocab_size"]]:
                    problems.append(f"d2t must be int64 [{cfg['draft_vocab_size']}], is {dtype} {shape}")
            elif target.startswith("t2d"):
                if dtype != "BOOL" or shape != [cfg["vocab_size"]]:
                    problems.append(f"t2d must be bool [{cfg['vocab_size']}], is {dtype} {shape}")
            else:
                want = params[target][shard]
                if shape != want:
                    problems.append(f"tensor {name!r} {shape} does not fit SGLang's {target}[{shard}] {want}")
                if dtype not in ("BF16", "F16", "F32"):
                    problems.append(f"tensor {name!r} has dtype {dtype}, expected a float")
                loaded.setdefault(target, set()).add(shard)
        for name, shards in params.items():
            if name == "model.embed_tokens.weight":
                if any(report["tensors"].get(n) == name for n in names):
                    problems.append("the folder carries embeddings: SGLang shares the target's; do not export them")
                continue
            if loaded.get(name, set()) != set(shards):
                problems.append(
                    f"SGLang parameter {name} would stay uninitialised (loaded shards {sorted(map(str, loaded.get(name, set())))} of {sorted(map(str, shards))})"
                )
        if "d2t" not in names or "t2d" not in names:
            problems.append("d2t / t2d missing: SGLang could not map draft ids to target ids")
        else:
            d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
            hot = d2t + torch.arange(len(d2t))
            if int(hot.min()) < 0 or int(hot.max()) >= cfg["vocab_size"] or len(set(hot.tolist())) != len(hot):
                problems.append("d2t maps draft ids outside the target vocab or twice onto one id")
            elif not torch.equal(torch.nonzero(t2d).flatten(), hot.sort().values):
                problems.append("t2d disagrees with d2t")
    if problems:
        raise ExportError(f"{folder} would not load completely in SGLang: " + "; ".join(problems))
    report["config"] = {
        k: cfg[k] for k in ("draft_vocab_size", "target_hidden_size", "num_hidden_layers", "eagle_config")
    }
    return report


def check_layer_ids(
    folder: str | os.PathLike, capture_points: list[int], architecture: str, num_layers: int
) -> list[int]:
    """Refuse (ExportError) a folder whose layer ids make SGLang capture other tensors than the
    drafter was trained on: the ids are read back with the serving engine's own rule for this
    architecture (aerie.capture) and must give the capture points of the training data."""
    cfg = json.loads((Path(folder) / "config.json").read_text())
    ids = list((cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [])
    convention = convention_for(SERVING_ENGINE, architecture)
    try:
        read = from_engine_ids(ids, convention, num_layers)
    except CaptureError as e:
        raise ExportError(f"{folder}: eagle_aux_hidden_state_layer_ids {ids}: {e}") from None
    if read != list(capture_points):
        shift = {b - a for a, b in zip(capture_points, read)} if len(read) == len(capture_points) else set()
        what = f"an off-by-{abs(shift.pop())}" if len(shift) == 1 and 0 not in shift else "other layers"
        raise ExportError(
            f"{folder}: SGLang's {convention} rule reads eagle_aux_hidden_state_layer_ids {ids} of a {architecture} as "
            f"capture points {read}, but the drafter was trained on {list(capture_points)}: {what}; export with "
            f"{to_engine_ids(capture_points, convention, num_layers)} (aerie.capture.to_engine_ids)"
        )
    return read


# --------------------------------------------------------------------------------------
# Publish
# --------------------------------------------------------------------------------------
def publish(
    store: ObjectStore, drafter: Eagle3Drafter, runset, request: TrainRequest, version: str, metrics: dict
) -> DrafterLineage:
    """Export and check the drafter, then publish it (aerie.drafters: files, lineage, `latest`)."""
    spec = runset.spec
    convention = convention_for(SERVING_ENGINE, spec.target.architecture)
    layer_ids = to_engine_ids(spec.capture_points, convention, spec.target.num_layers)
    with tempfile.TemporaryDirectory(prefix="aerie-export-") as tmp:
        folder = export(drafter, tmp, layer_ids, load_target_config(request.model))
        check_layer_ids(folder, spec.capture_points, spec.target.architecture, spec.target.num_layers)
        return drafters.publish(
            store,
            folder,
            dict(
                name=request.drafter,
                version=version,
                runs=list(request.runs),
                target=spec.target,
                engine=spec.engine,
                capture_points=list(spec.capture_points),
                exported_layer_ids=layer_ids,
                exported_convention=convention,
                draft_vocab_size=drafter.config.draft_vocab_size,
                config=request.config,
                metrics={k: v for k, v in metrics.items() if isinstance(v, (int, float, str, list)) or v is None},
                init_from=metrics.get("init_from"),
            ),
        )
