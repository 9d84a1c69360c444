"""How big things are, from config.json alone (no weights): the target, and a drafter's training.

- `target_parameters(config)`: the target's parameter count — dense (Llama, Qwen3), MoE (Qwen3-MoE,
  DeepSeek-V3 / Kimi-K2.x with shared experts and dense first layers) and MLA attention. It decides
  whether the evaluation may load the target into the trainer (`AERIE_EVAL_MAX_TARGET_PARAMS`).
  Checked against the published totals in tests/trainer/test_presets.py.
- `training_bytes(drafter, train)`: one rank's memory for training a drafter unsharded — trainable
  weights, gradients and AdamW state in float32 (16 bytes a parameter), the frozen target embedding
  (float32) and lm_head (bfloat16 on a GPU), and the activations of one micro-batch through the TTT
  unroll — with or without activation checkpointing, from a measured memory model. An estimate,
  meant to pick DDP or FSDP and to check a preset fits its GPU, not to size a cluster to the byte.
- `choose_sharding(...)`: `single` for one rank; else DDP when that fits one device, FSDP2
  (parameters, gradients and optimizer state sharded over the ranks) when not; a setting overrides.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GiB = 1 << 30
FIT_FRACTION = 0.85  # of a device's memory: the CUDA context, the allocator's slack and fragmentation take the rest


def _text(config: dict) -> dict:
    inner = config.get("text_config") or {}
    return {**inner, **{k: v for k, v in config.items() if k != "text_config"}} if inner else dict(config)


def target_parameters(config: dict) -> int:
    """Parameters of a decoder-only target from its config.json (a wrapper's `text_config` is read;
    a vision tower and multi-token-prediction layers are not counted)."""
    cfg = _text(config)
    H, L, V = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["vocab_size"])
    nh = int(cfg["num_attention_heads"])
    nkv = int(cfg.get("num_key_value_heads") or nh)
    hd = int(cfg.get("head_dim") or H // nh)
    if cfg.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3, Kimi-K2.x)
        qk = int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"])
        q_rank, kv_rank, v_dim = cfg.get("q_lora_rank"), int(cfg["kv_lora_rank"]), int(cfg["v_head_dim"])
        q = H * nh * qk if not q_rank else H * int(q_rank) + int(q_rank) + int(q_rank) * nh * qk
        kv = (
            H * (kv_rank + int(cfg["qk_rope_head_dim"]))
            + kv_rank
            + kv_rank * nh * (int(cfg["qk_nope_head_dim"]) + v_dim)
        )
        attention = q + kv + nh * v_dim * H
    else:
        attention = H * nh * hd + 2 * H * nkv * hd + nh * hd * H
    dense_mlp = 3 * H * int(cfg.get("intermediate_size") or 0)
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_experts") or 0)
    moe_layers = 0
    if experts:
        first_dense = int(cfg.get("first_k_dense_replace") or 0)  # DeepSeek: the first layers stay dense
        step = int(cfg.get("decoder_sparse_step") or cfg.get("moe_layer_freq") or 1)
        dense_only = set(cfg.get("mlp_only_layers") or [])  # Qwen3-MoE
        moe_layers = sum(1 for i in range(first_dense, L) if i not in dense_only and (i + 1 - first_dense) % step == 0)
        moe_i = int(cfg["moe_intermediate_size"])
        shared = int(cfg.get("n_shared_experts") or 0)
        moe_mlp = (experts + shared) * 3 * H * moe_i + H * experts  # experts, shared experts, router
    else:
        moe_mlp = 0
    norms = 2 * H
    layers = L * (attention + norms) + (L - moe_layers) * dense_mlp + moe_layers * moe_mlp
    tied = bool(cfg.get("tie_word_embeddings", False))
    return layers + V * H * (1 if tied else 2) + H


def target_parameters_of(model_dir: str | os.PathLike) -> int:
    import json
    from pathlib import Path

    return target_parameters(json.loads((Path(model_dir) / "config.json").read_text()))


# --------------------------------------------------------------------------------------
# A drafter's training
# --------------------------------------------------------------------------------------
def drafter_parameters(drafter) -> tuple[int, int]:
    """(trainable, frozen embedding) parameters of a DrafterConfig."""
    H, I, Vd, V = drafter.hidden_size, drafter.intermediate_size, drafter.draft_vocab_size, drafter.vocab_size
    if getattr(drafter, "arch", "llama") == "mla":
        nh, qk, v = drafter.num_attention_heads, drafter.head_dim, drafter.v_head_dim
        q_rank, kv_rank, rope = drafter.q_lora_rank, drafter.kv_lora_rank, drafter.qk_rope_head_dim
        attention = (
            2 * H * (q_rank + kv_rank + rope)  # the a-projections read 2H
            + q_rank * nh * qk
            + kv_rank * nh * (drafter.qk_nope_head_dim + v)
            + nh * v * H
            + q_rank
            + kv_rank
        )
    else:
        q, kv = drafter.num_attention_heads * drafter.head_dim, drafter.num_key_value_heads * drafter.head_dim
        attention = 2 * H * (q + 2 * kv) + q * H
    trainable = drafter.num_aux * drafter.target_hidden_size * H + attention + 3 * H * I + 4 * H + H * Vd
    return trainable, V * H


@dataclass(frozen=True)
class Memory:
    weights_and_optimizer: int  # trainable: weights + grads + AdamW, float32
    frozen: int  # target embedding + target lm_head
    activations: int

    @property
    def total(self) -> int:
        return self.weights_and_optimizer + self.frozen + self.activations

    def sharded(self, ranks: int) -> int:
        """One rank's bytes under FSDP: trainable state split over the ranks, the rest whole."""
        return self.weights_and_optimizer // ranks + self.frozen + self.activations


# Activation bytes per token of one training step, fitted to measured peaks (benchmarks/
# bench_train_memory.py; float32 on the CPU, so an upper bound for a GPU's bf16 step): per TTT step
# (x H, x draft vocab) and once per batch (x H, x draft vocab), without and with activation
# checkpointing. The fit's negative once-per-batch H term (plain) is taken as 0.
ACTIVATION_BYTES = {False: (89.4, 4.12, 0.0, 7.3), True: (16.2, 0.064, 86.5, 12.3)}


def training_bytes(drafter, train, on_gpu: bool = True) -> Memory:
    trainable, embedding = drafter_parameters(drafter)
    head_bytes = 2 if on_gpu else 4
    T, H, Vd, S = train.batch_tokens, drafter.hidden_size, drafter.draft_vocab_size, train.ttt_steps
    step_h, step_vd, once_h, once_vd = ACTIVATION_BYTES[bool(getattr(train, "activation_checkpointing", False))]
    # the layer's saved activations and the logits of every TTT step (with checkpointing: what the
    # next steps read, plus one step recomputed), the batch's captured states and the target
    # distribution over the draft vocab (bf16), and the target head's chunk of full-vocab logits
    per_token = S * (step_h * H + step_vd * Vd) + once_h * H + once_vd * Vd
    inputs = T * (drafter.num_aux * drafter.target_hidden_size * 4 + 2 * Vd)
    head_chunk = 2048 * drafter.vocab_size * head_bytes  # TargetHead.CHUNK_ROWS rows at a time
    activations = int(T * per_token) + inputs + head_chunk
    return Memory(16 * trainable, 4 * embedding + head_bytes * embedding, activations)


def device_memory(device: str, override_gib: float | None) -> int | None:
    """Bytes of one device: the setting, else the GPU's; None on the CPU (no device limit)."""
    if override_gib is not None:
        return int(override_gib * GiB)
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory
    return None


def choose_sharding(ranks: int, requested: str, memory: Memory, device_bytes: int | None) -> tuple[str, str]:
    """-> (single | ddp | fsdp, why). `requested`: the setting (auto, ddp, fsdp)."""
    need = f"{memory.total / GiB:.1f} GiB a rank unsharded"
    if ranks == 1:
        if requested == "fsdp":
            return "single", f"one rank: nothing to shard ({need})"
        return "single", f"one rank ({need})"
    if requested != "auto":
        return requested, f"AERIE_TRAIN_SHARDING={requested} ({need}, {memory.sharded(ranks) / GiB:.1f} GiB sharded)"
    if device_bytes is None or memory.total <= FIT_FRACTION * device_bytes:
        room = (
            "no device limit (CPU)"
            if device_bytes is None
            else f"fits {FIT_FRACTION:.0%} of {device_bytes / GiB:.0f} GiB"
        )
        return "ddp", f"{need}: {room}"
    return "fsdp", (
        f"{need} exceeds {FIT_FRACTION:.0%} of {device_bytes / GiB:.0f} GiB; FSDP over {ranks} ranks: "
        f"{memory.sharded(ranks) / GiB:.1f} GiB a rank"
    )
