"""A tiny DeepSeek-V3 target for the tests: the seed's model class (Kimi-K2/K2.5 are DeepSeek-V3
models) in miniature, small enough for SGLang on 2 CPU cores in float32.

    folder = deepseek_v3_tiny(cache_dir, smollm2_path)   # the tests' `deepseek_tiny` fixture

What makes it the same class as the real models:
- multi-head latent attention with q and kv LoRA ranks, q/k head dim (nope + rope) != v head dim,
  interleaved rope (`rope_interleave`), YaRN `rope_scaling` (mscale_all_dim != 0, so the softmax
  scale carries YaRN's mscale too);
- mixture of experts: 8 routed experts in 4 groups (grouped top-k over sigmoid scores with the
  `e_score_correction_bias`, `noaux_tc`), 1 shared expert, `routed_scaling_factor`; the first
  layer dense (`first_k_dense_replace = 1`);
- its config.json is the real DeepSeek-V3 one (`tests/data/deepseek_v3_config.json`) with
  miniature numbers (`MINIATURE`), because SGLang reads keys transformers' config class does not
  write (`moe_layer_freq`, `topk_method`, `scoring_func`, ...). Left out: `auto_map` (it names
  remote code files this folder does not ship) and `quantization_config` (the real weights are
  fp8; these are float32). The legacy `rope_scaling`/`rope_theta` pair stays, as in the real file:
  transformers 5 turns it into `rope_parameters` when it loads the folder.

The weights are random (seeded), made by transformers' own `DeepseekV3ForCausalLM`, then written
in the checkpoint layout of the real models (one tensor per expert projection:
`mlp.experts.{e}.gate_proj.weight`; transformers 5 fuses them in memory and SGLang reads them one by
one). Some defaults are changed so that a wrong wiring shows: random norm weights (not ones),
a random `e_score_correction_bias` (not zeros) and a router with a wide score spread (no near-ties
between experts, so both engines route every token the same way). And some so that a drafter has
something to learn and learns it from the states (`_SPREAD`): peaked next-token logits, states made
by the layers.

The tokenizer is SmolLM2's (from the converted default target), so the vocab is 49152 and the
project's data and chat template apply. Built once per source of this module under
`<cache>/test-targets/`, like the SmolLM2 conversion.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path

REAL_CONFIG = Path(__file__).parent / "data" / "deepseek_v3_config.json"  # deepseek-ai/DeepSeek-V3's
LEFT_OUT_KEYS = frozenset({"auto_map", "quantization_config"})
SEED = 1234
NUM_LAYERS = 8  # default capture points [2, 4, 5]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

# What the tiny target changes in the real config: its sizes (and float32), nothing else.
MINIATURE = {
    "first_k_dense_replace": 1,
    "hidden_size": 64,
    "intermediate_size": 128,
    "kv_lora_rank": 32,
    "max_position_embeddings": 4096,
    "moe_intermediate_size": 32,
    "n_group": 4,
    "n_routed_experts": 8,
    "num_attention_heads": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": NUM_LAYERS,
    "num_key_value_heads": 4,
    "num_nextn_predict_layers": 0,
    "q_lora_rank": 48,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,  # q/k head dim 24 ...
    "v_head_dim": 16,  # ... v head dim 16, as DeepSeek's 192 and 128
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 8.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 512,
        "type": "yarn",
    },
    "topk_group": 2,
    "torch_dtype": "float32",
}


# Weights drawn at another spread than transformers' init (normal, std `initializer_range` 0.02
# everywhere), by module name: std. At 0.02 the target's next-token distribution is flat (entropy
# 10.79 nats, ln 49152 = 10.80): a drafter has nothing to learn (its loss stays at 15.2, its
# first draft is the target's next token at 0.19 of held-out positions) and its served acceptance
# is whichever way the near-ties fall on the machine (1.15 with AVX2 kernels, 2.21 with AVX-512,
# one source). `lm_head` at 0.4 makes the logits peaked (entropy 6.4 nats); the residual writers
# `o_proj` and `down_proj` (dense, shared and routed experts) at 0.16 and the embeddings at 0.002
# make the states the layers' work rather than the current token's embedding, so the drafter reads
# them (first draft right at 0.73 of positions fed the trained points, 0.58 fed the neighbouring
# layers, 0.55 fed zeros). Measured then (benchmarks/reports/history-2026-12.md).
_SPREAD = {"lm_head": 0.4, "o_proj": 0.16, "down_proj": 0.16, "embed_tokens": 0.002}


def real_config() -> dict:
    return json.loads(REAL_CONFIG.read_text())


def tiny_config(vocab_size: int, bos_token_id: int, eos_token_id: int) -> dict:
    """config.json of the tiny target: the real DeepSeek-V3 config with miniature numbers."""
    config = {k: v for k, v in real_config().items() if k not in LEFT_OUT_KEYS}
    config.update(MINIATURE)
    config.update(vocab_size=vocab_size, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    return config


def source_key(tokenizer_folder: Path) -> str:
    h = hashlib.sha256(Path(__file__).read_bytes() + REAL_CONFIG.read_bytes())
    for name in TOKENIZER_FILES:
        path = tokenizer_folder / name
        if path.is_file():
            h.update(name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def deepseek_v3_tiny(cache_dir: str | os.PathLike, smollm2_path: str | os.PathLike, seed: int = SEED) -> Path:
    """The tiny DeepSeek-V3 folder (config.json, model.safetensors, SmolLM2's tokenizer), built once
    (another `seed`: another folder)."""
    smollm2_path = Path(smollm2_path)
    name = (
        f"deepseek-v3-tiny-{source_key(smollm2_path)}"
        if seed == SEED
        else f"deepseek-v3-tiny-seed{seed}-{source_key(smollm2_path)}"
    )
    out = Path(cache_dir).expanduser() / "test-targets" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process building the same target: wait for it
        if not (out / "model.safetensors").is_file():
            _build(out, smollm2_path, seed)
    return out


def load_reference(folder: str | os.PathLike, dtype=None):
    """transformers' model of the folder (the tiny DeepSeek-V3, the W4A16 SmolLM2 dequantized),
    `dtype` (default float32), eval; refuses a partial load (a checkpoint name transformers does
    not map would leave a layer at its random init)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = dtype or torch.float32
    from aerie.target import hf_load_kwargs

    model, info = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, output_loading_info=True, **hf_load_kwargs(folder)
    )
    unloaded = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if unloaded:
        raise AssertionError(f"transformers did not load {folder} completely: {unloaded}")
    return model.eval()


def checkpoint_tensors(model) -> dict:
    """transformers 5's in-memory state dict -> the real checkpoints' layout: each fused expert
    tensor (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) split into
    `experts.{e}.{gate,up,down}_proj.weight`."""
    tensors = {}
    for name, value in model.state_dict().items():
        value = value.detach().contiguous()
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            gate, up = value.chunk(2, dim=1)
            for e in range(value.shape[0]):
                tensors[f"{prefix}{e}.gate_proj.weight"] = gate[e].contiguous()
                tensors[f"{prefix}{e}.up_proj.weight"] = up[e].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(value.shape[0]):
                tensors[f"{prefix}{e}.down_proj.weight"] = value[e].contiguous()
        else:
            tensors[name] = value
    return tensors


def _module_name(param: str) -> str:
    """`model.layers.1.mlp.shared_experts.down_proj.weight` -> `down_proj`; a fused expert tensor
    (`model.layers.1.mlp.experts.down_proj`) is a parameter of its own name."""
    parts = param.split(".")
    return parts[-2] if parts[-1] == "weight" else parts[-1]


def _build(out: Path, smollm2_path: Path, seed: int) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    smol = json.loads((smollm2_path / "config.json").read_text())  # its special ids (eos = <|im_end|>)
    config = tiny_config(len(tokenizer), smol["bos_token_id"], smol["eos_token_id"])
    hf_config = DeepseekV3Config(
        **{k: v for k, v in config.items() if k not in ("architectures", "torch_dtype", "transformers_version")}
    )
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(hf_config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # RMSNorm weights: around 1, not exactly 1
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
            elif name.endswith("mlp.gate.weight"):  # router: scores well apart
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
            elif std := _SPREAD.get(_module_name(name)):
                param.copy_(std * torch.randn(param.shape, generator=generator))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=generator))

    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(checkpoint_tensors(model), tmp / "model.safetensors", metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (smollm2_path / name).is_file():
            shutil.copy2(smollm2_path / name, tmp / name)
    # the written checkpoint is the model: transformers reads it back to the same logits
    probe = torch.tensor([[1, 504, 3060, 314, 253, 9, 77]])
    with torch.no_grad():
        if not torch.equal(load_reference(tmp)(probe).logits, model(probe).logits):
            raise AssertionError(f"{tmp}: the saved checkpoint does not reload to the model that wrote it")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
