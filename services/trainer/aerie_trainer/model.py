"""The EAGLE-3 drafter: one Llama decoder layer on top of the target's hidden states.

Design choices, in one place:
- Weight names are the ones SGLang's `LlamaForCausalLMEagle3` loads (`fc`, `midlayer.*`,
  `norm`, `lm_head`, `d2t`, `t2d`), so export is a plain `state_dict` minus the embeddings.
- q/k/v/o and gate/up/down stay separate matrices (SGLang fuses them at load time).
- `embed_tokens` is the target's, frozen and never exported: SGLang shares the target's.
- The layer's attention shape and rope copy a Llama-class target; an MLA target (DeepSeek-V3,
  Kimi-K2/K2.5) gets a Llama shape of its own (`own_shape`); YaRN is computed as SGLang does.
- `arch="mla"` swaps the attention for DeepSeek's multi-head latent attention (`MLAttention`),
  as SGLang's `Eagle3DeepseekV2ForCausalLM` serves it (weights `q_a_proj`, `q_a_layernorm`,
  `q_b_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`); everything else
  (fc, the norms, the residuals, the MLP, the head) is the same layer. Its keys and values are
  expanded per head and zero-padded to one width, so TTT and chain decoding use the same
  attention (aerie_trainer.attention) for both layers.
- The decoder layer reads `[input_layernorm(embed(token)), hidden_norm(h)]` (2H wide); the
  residual is the un-normed `h`. Its output `h'` (pre-norm) is fed back as the next step's `h`;
  `norm(h')` goes to `lm_head`.
- Attention takes the keys it may see in two parts, which is all that training-time test
  (TTT) and chain decoding need: a *prefix* attended under a mask (the base sequence, causal),
  and a *chain* of earlier draft steps at the same slot, attended one key per step (the
  "diagonal"). No padding masks: batches are right-padded, so causal attention never sees pads.
  aerie_trainer.attention computes it without expanding grouped K/V or building dense masks.
- Layers compute in their input's dtype (bf16 on a GPU, float32/float64 on the CPU) from float32
  parameters (aerie_trainer.precision); SiLU·up keeps only its inputs for backward.

Shapes: B batch, T slots, S prefix keys, H hidden, K capture points, Ht target hidden,
nh/nkv query/kv heads, hd head dim, V target vocab, Vd draft vocab.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from aerie.errors import ExpectedError
from aerie_trainer.attention import attend
from aerie_trainer.precision import compute_weight, linear


class DrafterError(ExpectedError, ValueError):
    """A target config or weight file the drafter cannot be built from (printed as one line)."""


@dataclass
class DrafterConfig:
    hidden_size: int  # H: the drafter is as wide as the target
    target_hidden_size: int  # Ht: width of each captured state
    num_aux: int  # K: capture points
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    vocab_size: int  # V: target vocab (embeddings, t2d)
    draft_vocab_size: int  # Vd
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    hidden_act: str = "silu"
    arch: str = "llama"  # "llama" (grouped-query attention) or "mla" (multi-head latent attention)
    q_lora_rank: int | None = None  # mla only, from here on
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None

    @classmethod
    def from_target(cls, target_config: dict, num_aux: int, draft_vocab_size: int, shape=None) -> DrafterConfig:
        """The drafter for a target's config.json (a dict; a wrapper's `text_config` is read too).

        Width, vocab and norms always follow the target. The attention shape and rope follow a
        Llama-class target (grouped-query attention, a rope this layer supports) and are the
        drafter's own for any other: an MLA target (DeepSeek-V3, Kimi-K2/K2.5) has no head
        layout a Llama layer could copy. `shape` (aerie.contracts.DrafterShape) overrides any field.
        """
        cfg = target_text_config(target_config)
        if num_aux < 2:
            raise DrafterError(
                f"{num_aux} capture point: an EAGLE-3 drafter needs at least 2 (SGLang skips `fc` when its input "
                "width equals the hidden size, so a 1-point drafter would serve silently wrong)"
            )
        try:
            H = int(cfg["hidden_size"])
            given = {k: v for k, v in (shape.model_dump() if shape is not None else {}).items() if v is not None}
            arch = given.pop("arch", "llama")
            if arch == "mla":
                base = mla_shape(cfg)
            else:
                base = llama_shape(cfg) if is_llama_class(cfg) else own_shape(cfg)
                mla_only = sorted(k for k in given if k in MLA_FIELDS)
                if mla_only:
                    raise DrafterError(f"drafter shape sets {', '.join(mla_only)}: MLA fields need arch 'mla'")
            chosen = {**base, **given}
            mla = {k: int(chosen[k]) for k in MLA_FIELDS} if arch == "mla" else {}
            if mla:
                chosen["head_dim"] = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
                chosen["num_key_value_heads"] = chosen["num_attention_heads"]  # MLA: one key/value per head
            rope = dict(chosen["rope_parameters"])
            rope.setdefault("rope_theta", base["rope_parameters"]["rope_theta"])
            rope["rope_type"] = rope.pop("type", rope.get("rope_type", "default"))
            config = cls(
                hidden_size=H,
                target_hidden_size=H,
                num_aux=num_aux,
                intermediate_size=int(chosen["intermediate_size"]),
                num_attention_heads=int(chosen["num_attention_heads"]),
                num_key_value_heads=int(chosen["num_key_value_heads"]),
                head_dim=int(chosen["head_dim"]),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
                vocab_size=int(cfg["vocab_size"]),
                draft_vocab_size=int(draft_vocab_size),
                rope_parameters=rope,
                hidden_act=str(cfg.get("hidden_act", "silu")),
                arch=arch,
                **mla,
            )
        except KeyError as e:
            raise DrafterError(f"target config.json lacks {e.args[0]!r}: is it a decoder-only LLM config?") from None
        if config.num_attention_heads % config.num_key_value_heads:
            raise DrafterError(
                f"drafter num_attention_heads {config.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {config.num_key_value_heads}"
            )
        rope_tables(config)  # refuses a rope type this layer cannot compute, by name
        return config

    @property
    def rope_dim(self) -> int:
        """Dims the rope rotates: the head dim (llama) or qk_rope_head_dim (mla)."""
        return int(self.qk_rope_head_dim) if self.arch == "mla" else self.head_dim


# --------------------------------------------------------------------------------------
# The drafter's shape for a target family
# --------------------------------------------------------------------------------------
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attn_factor",
    "extrapolation_factor",
    "truncate",
)


def target_text_config(target_config: dict) -> dict:
    """A target's language-model config: multimodal wrappers (Kimi-K2.5) keep it in `text_config`."""
    inner = target_config.get("text_config") or {}
    return {**inner, **{k: v for k, v in target_config.items() if k != "text_config"}} if inner else dict(target_config)


def target_rope(cfg: dict) -> dict:
    """The target's rope as one dict: rope_type, rope_theta and the type's keys."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope["rope_type"] = rope.pop("type", rope.get("rope_type", "default"))
    rope["rope_theta"] = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope["rope_type"] == "deepseek_yarn":  # DeepSeek's own name for the same YaRN frequencies
        rope["rope_type"] = "yarn"
    return rope


def is_llama_class(cfg: dict) -> bool:
    """Grouped-query attention a Llama layer can copy, and a rope it computes."""
    mla = any(cfg.get(k) is not None for k in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim"))
    return not mla and "num_attention_heads" in cfg and target_rope(cfg)["rope_type"] in ROPE_TYPES


def llama_shape(cfg: dict) -> dict:
    H, nh = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    return dict(
        num_attention_heads=nh,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or nh),
        head_dim=int(cfg.get("head_dim") or H // nh),
        intermediate_size=int(cfg["intermediate_size"]),
        rope_parameters=target_rope(cfg),
    )


def own_shape(cfg: dict) -> dict:
    """A Llama layer of the drafter's own for a target whose attention cannot be copied: 128-dim
    heads (H/4 when H < 1024), H/head_dim query heads, the largest divisor of those up to 8 as KV
    heads, an MLP of ~12/7 H (12288 at H = 7168, the width of TorchSpec's published Kimi-K2.5
    drafter; the target's dense MLP, 18432 for DeepSeek-V3, would triple the layer's size), and the
    target's rope (YaRN for DeepSeek-V3 / Kimi) at the drafter's head dim."""
    H = int(cfg["hidden_size"])
    head_dim = 128 if H >= 1024 else max(8, H // 4)
    heads = max(1, H // head_dim)
    kv = max(d for d in range(1, min(8, heads) + 1) if heads % d == 0 and (d < heads or heads == 1))
    rope = target_rope(cfg)
    if rope["rope_type"] not in ROPE_TYPES:
        rope = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
    return dict(
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        intermediate_size=256 * math.ceil(12 * H / 7 / 256),
        rope_parameters=rope,
    )


MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def is_mla(cfg: dict) -> bool:
    return all(cfg.get(k) is not None for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))


def mla_shape(cfg: dict) -> dict:
    """An MLA drafter layer (arch "mla"): an MLA target's own attention shape (heads, LoRA ranks,
    head dims; SGLang's `Eagle3DeepseekV2ForCausalLM` needs a q LoRA rank: 3 x kv_lora_rank where
    the target has none, DeepSeek-V3's 1536 / 512), the MLP of `own_shape` and the target's rope.
    Any other target: DeepSeek-V3's proportions at `own_shape`'s heads (nope = v = head dim,
    rope = head dim / 2, kv rank 4 x head dim, q rank 3 x kv rank)."""
    own = own_shape(cfg)
    if is_mla(cfg):
        kv_rank = int(cfg["kv_lora_rank"])
        attention = dict(
            num_attention_heads=int(cfg["num_attention_heads"]),
            q_lora_rank=int(cfg.get("q_lora_rank") or 3 * kv_rank),
            kv_lora_rank=kv_rank,
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
            qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
            v_head_dim=int(cfg["v_head_dim"]),
        )
    else:
        hd = own["head_dim"]
        attention = dict(
            num_attention_heads=own["num_attention_heads"],
            q_lora_rank=12 * hd,
            kv_lora_rank=4 * hd,
            qk_nope_head_dim=hd,
            qk_rope_head_dim=max(2, hd // 2 // 2 * 2),
            v_head_dim=hd,
        )
    return dict(own, **attention)


# --------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Llama's RMSNorm in the input's dtype, computed in float32 inside (PyTorch's fused kernel on a
    GPU): x * rsqrt(mean(x^2) + eps) * weight, rounded once, as SGLang's serving kernel does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, compute_weight(self.weight, x.dtype), self.eps)


class Linear(nn.Linear):
    """nn.Linear (no bias) in the activations' dtype (aerie_trainer.precision.linear)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


def rope_tables(config: DrafterConfig) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (hd/2,), cos/sin scale) for the rope types a Llama drafter layer
    supports, computed as SGLang's `get_rope` computes them for `LlamaForCausalLMEagle3` (float32)."""
    rope = config.rope_parameters
    kind = rope.get("rope_type", "default")
    dim, theta = config.rope_dim, float(rope["rope_theta"])
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = 1.0 / pos_freqs
    if kind == "default":
        return inv_freq, 1.0
    if config.arch == "mla" and kind != "yarn":
        raise DrafterError(
            f"rope_type {kind!r}: SGLang's MLA drafter layer computes only default and yarn (DeepSeek's YaRN); "
            "set the drafter's own rope (TrainConfig.drafter.rope_parameters)"
        )
    if kind == "linear":
        return inv_freq / float(rope["factor"]), 1.0
    if kind == "llama3":  # Llama 3.1: stretch low frequencies, keep high ones
        factor, lo, hi = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_len = float(rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        return torch.where(is_mid, mid, scaled), 1.0
    if kind == "yarn":  # YaRN: interpolate low frequencies, keep high ones, ramp between; scale cos/sin
        factor = float(rope["factor"])
        old_len = float(rope.get("original_max_position_embeddings", config.max_position_embeddings))
        beta_fast, beta_slow = float(rope.get("beta_fast", 32)), float(rope.get("beta_slow", 1))

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(theta))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if rope.get("truncate", True) or config.arch == "mla":  # DeepSeek's YaRN always truncates
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001), 0, 1)
        keep = (1 - ramp) * float(rope.get("extrapolation_factor", 1))
        inv_freq = inv_freq / factor * (1 - keep) + inv_freq * keep

        def get_mscale(m: float) -> float:
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

        if config.arch == "mla":  # DeepSeek's YaRN (SGLang's DeepseekScalingRotaryEmbedding): defaults 1 and 0
            mscale = get_mscale(float(rope.get("mscale", 1))) / get_mscale(float(rope.get("mscale_all_dim", 0)))
        elif rope.get("mscale") is not None and rope.get("mscale_all_dim") is not None:
            mscale = get_mscale(float(rope["mscale"])) / get_mscale(float(rope["mscale_all_dim"]))
        else:
            mscale = get_mscale(1.0)
        return inv_freq, mscale * float(rope.get("attn_factor", 1))
    raise DrafterError(
        f"rope_type {kind!r} is not supported by the drafter layer (supported: {', '.join(ROPE_TYPES)}): "
        "set the drafter's own rope (TrainConfig.drafter.rope_parameters)"
    )


def mla_softmax_scale(config: DrafterConfig) -> float:
    """SGLang's `DeepseekV2AttentionMLA.scaling`: qk_head_dim^-0.5, times YaRN's
    mscale(factor, mscale_all_dim)^2 when the rope is scaled."""
    scale = (int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)) ** -0.5
    rope = config.rope_parameters
    if rope.get("rope_type", "default") != "default":
        factor, all_dim = float(rope["factor"]), float(rope.get("mscale_all_dim") or 0)
        mscale = 1.0 if factor <= 1 else 0.1 * all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, n, d) -> rotated x, GPT-J style (pairs of adjacent dims: SGLang's `is_neox_style=False`,
    DeepSeek's rope); cos/sin (..., T, d) from rope_cos_sin (the first half is used)."""
    half = x.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(-2), sin[..., :half].unsqueeze(-2)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, mscale: float, dtype: torch.dtype):
    """positions (T,) or (B, T) -> cos, sin (T, hd) or (B, T, hd) in `dtype` (computed in float32)."""
    freqs = positions.to(inv_freq.dtype)[..., None] * inv_freq  # (..., T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * mscale).to(dtype), (emb.sin() * mscale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, n, hd) -> rotated x (neox style, as HF Llama); cos/sin from rope_cos_sin."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        H, hd = config.hidden_size, config.head_dim
        self.nh, self.nkv, self.hd = config.num_attention_heads, config.num_key_value_heads, hd
        self.q_proj = Linear(2 * H, self.nh * hd)
        self.k_proj = Linear(2 * H, self.nkv * hd)
        self.v_proj = Linear(2 * H, self.nkv * hd)
        self.o_proj = Linear(self.nh * hd, H)
        inv_freq, self.rope_mscale = rope_tables(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, positions, past=None, prefix=None, prefix_mask=None, chain=()):
        """x (B, T, 2H) -> out (B, T, H), kv.

        Base step (prefix None): keys are `past` (B, nkv, P, hd) followed by this step's own,
        causal; returns all of them (the cache).
        Draft step: `prefix` (k, v) (B, nkv, S, hd) seen under `prefix_mask` (T, S) bool — None:
        causal over the prefix (T == S, training-time test) — then `chain` (earlier draft steps'
        kv at the same slots) and its own kv, one key per slot each; returns its own kv
        (B, nkv, T, hd). Grouped K/V are never expanded (aerie_trainer.attention).
        """
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd)
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_mscale, x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, n, T, hd), slot-major in memory
        out, kv = _attend_cached(q, k, v, x, T, past, prefix, prefix_mask, chain)
        out = out.transpose(1, 2).reshape(B, T, self.nh * self.hd)
        return self.o_proj(out), kv


def _attend_cached(q, k, v, x, T, past, prefix, prefix_mask, chain, scale=None):
    """The attention both layers share (see Attention.forward): q (B, nh, T, d), k/v (B, nkv, T, d)."""
    if prefix is None:
        mask = None
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
            P = k.shape[2] - T
            mask = torch.ones(T, P + T, dtype=torch.bool, device=x.device).tril(P) if P else None  # key j <= P + i
        return attend(q, k, v, mask=mask, scale=scale), (k, v)
    steps = [*chain, (k, v)]
    ck = torch.stack([c.transpose(1, 2) for c, _ in steps])  # (n, B, T, nkv, d)
    cv = torch.stack([c.transpose(1, 2) for _, c in steps])
    return attend(q, prefix[0], prefix[1], ck, cv, mask=prefix_mask, scale=scale), (k, v)


class MLAttention(nn.Module):
    """DeepSeek's multi-head latent attention as SGLang 0.5.23's `DeepseekV2AttentionMLA` computes it
    in `Eagle3DeepseekV2ForCausalLM` (tp 1), on the layer's 2H-wide input:

        q = q_b_proj(q_a_layernorm(q_a_proj(x)))            -> per head [q_nope (nope) | q_pe (rope)]
        c, k_pe = kv_a_proj_with_mqa(x)                      -> latent (kv_rank) | one shared k_pe (rope)
        k_nope, v = kv_b_proj(kv_a_layernorm(c))             -> per head (nope) | (v)
        q_pe, k_pe rotated GPT-J style (interleaved pairs) with DeepSeek's YaRN (cos/sin x mscale)
        softmax((q_nope.k_nope + q_pe.k_pe) * scaling) v     scaling: mla_softmax_scale
        o_proj(heads' outputs)

    SGLang serves it "absorbed" (kv_b_proj folded into q and the output, attending over the
    latent); that is the same product reordered. Here keys and values are expanded per head,
    [k_nope | k_pe] and v, both zero-padded to D = max(nope + rope, v) so that one attention
    (aerie_trainer.attention) takes them: zero dims add nothing to a score, and the output's
    padding is dropped. The kv this returns (the cache, TTT's prefix and chain) is (B, nh, T, D)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        H, nh = config.hidden_size, config.num_attention_heads
        self.nh, self.nope, self.rope = nh, int(config.qk_nope_head_dim), int(config.qk_rope_head_dim)
        self.kv_rank, self.v_dim = int(config.kv_lora_rank), int(config.v_head_dim)
        q_rank = int(config.q_lora_rank)
        self.width = max(self.nope + self.rope, self.v_dim)
        self.q_a_proj = Linear(2 * H, q_rank)
        self.q_a_layernorm = RMSNorm(q_rank, config.rms_norm_eps)
        self.q_b_proj = Linear(q_rank, nh * (self.nope + self.rope))
        self.kv_a_proj_with_mqa = Linear(2 * H, self.kv_rank + self.rope)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, config.rms_norm_eps)
        self.kv_b_proj = Linear(self.kv_rank, nh * (self.nope + self.v_dim))
        self.o_proj = Linear(nh * self.v_dim, H)
        inv_freq, self.rope_mscale = rope_tables(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scale = mla_softmax_scale(config)

    def forward(self, x, positions, past=None, prefix=None, prefix_mask=None, chain=()):
        """x (B, T, 2H) -> out (B, T, H), kv; past / prefix / chain as Attention.forward's."""
        B, T, _ = x.shape
        nh, nope, rope, D = self.nh, self.nope, self.rope, self.width
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(B, T, nh, nope + rope)
        latent = self.kv_a_proj_with_mqa(x)
        c, k_pe = latent.split([self.kv_rank, rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c)).view(B, T, nh, nope + self.v_dim)
        k_nope, v = kv.split([nope, self.v_dim], dim=-1)
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_mscale, x.dtype)
        q_pe = apply_rope_interleaved(q[..., nope:], cos, sin)
        k_pe = apply_rope_interleaved(k_pe.unsqueeze(2), cos, sin).expand(B, T, nh, rope)
        q = F.pad(torch.cat([q[..., :nope], q_pe], dim=-1), (0, D - nope - rope))
        k = F.pad(torch.cat([k_nope, k_pe], dim=-1), (0, D - nope - rope))
        v = F.pad(v, (0, D - self.v_dim))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh, T, D)
        out, kv_out = _attend_cached(q, k, v, x, T, past, prefix, prefix_mask, chain, scale=self.scale)
        out = out[..., : self.v_dim].transpose(1, 2).reshape(B, T, nh * self.v_dim)
        return self.o_proj(out), kv_out


class SiluMul(torch.autograd.Function):
    """silu(gate) * up, keeping only gate and up for backward (silu(gate) is recomputed)."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)


class MLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        if config.hidden_act != "silu":
            raise DrafterError(f"hidden_act {config.hidden_act!r}: SGLang's Llama drafter layer supports only silu")
        H, I = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(H, I)
        self.up_proj = Linear(H, I)
        self.down_proj = Linear(I, H)

    def forward(self, x):
        return self.down_proj(SiluMul.apply(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    """`midlayer`: a Llama layer whose attention (grouped-query or MLA) reads [norm(embed), norm(h)]."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.self_attn = MLAttention(config) if config.arch == "mla" else Attention(config)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = MLP(config)

    def forward(self, embeds, hidden, positions, **attn):
        residual = hidden  # (B, T, H)
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # (B, T, 2H)
        attn_out, kv = self.self_attn(x, positions, **attn)
        hidden = residual + attn_out
        hidden = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return hidden, kv


# --------------------------------------------------------------------------------------
# The drafter
# --------------------------------------------------------------------------------------
class Eagle3Drafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        H, V, Vd = config.hidden_size, config.vocab_size, config.draft_vocab_size
        self.embed_tokens = nn.Embedding(V, H)  # the target's, frozen, not exported
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = Linear(config.num_aux * config.target_hidden_size, H)
        self.midlayer = DecoderLayer(config)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = Linear(H, Vd)
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.int64))  # draft id + d2t = target id
        self.register_buffer("t2d", torch.zeros(V, dtype=torch.bool))  # target id is in the draft vocab
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)

    def set_vocab(self, draft_ids: torch.Tensor) -> None:
        """draft_ids (Vd,) sorted target ids -> d2t, t2d."""
        draft_ids = draft_ids.to(torch.int64).cpu()
        self.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        self.t2d.zero_()
        self.t2d[draft_ids] = True

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """aux (B, T, K*Ht) captured states -> h (B, T, H)."""
        return self.fc(aux)

    def forward(self, input_ids, hidden, positions, past=None, prefix=None, prefix_mask=None, chain=()):
        """One draft step (see Attention.forward for past / prefix / chain).

        input_ids (B, T) tokens, hidden (B, T, H), positions (T,) or (B, T) for RoPE.
        Returns logits (B, T, Vd), hidden out (B, T, H) pre-norm, kv of this step.
        """
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)  # (B, T, H)
        hidden, kv = self.midlayer(
            embeds, hidden, positions, past=past, prefix=prefix, prefix_mask=prefix_mask, chain=chain
        )
        logits = self.lm_head(self.norm(hidden))  # (B, T, Vd)
        return logits, hidden, kv

    def exported_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor SGLang loads, under SGLang's names (no embeddings)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens.")}


# --------------------------------------------------------------------------------------
# The target's weights (safetensors only)
# --------------------------------------------------------------------------------------
def load_target_config(model_dir: str | os.PathLike) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise DrafterError(f"{model_dir}: no config.json: pass the target model folder (HF layout, safetensors)")
    return json.loads(path.read_text())


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> safetensors file, across a sharded checkpoint."""
    from safetensors import safe_open

    from aerie.target import TargetError, weight_files

    try:
        files = weight_files(model_dir)
    except TargetError as e:
        raise DrafterError(str(e)) from None
    index = {}
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():
                index[name] = f
    return index


def load_target_tensor(model_dir: str | os.PathLike, suffix: str) -> torch.Tensor | None:
    """The target tensor whose name ends with `suffix` (e.g. 'embed_tokens.weight'), or None."""
    from safetensors import safe_open

    index = _weight_files(Path(model_dir))
    names = sorted((n for n in index if n == suffix or n.endswith("." + suffix)), key=len)
    if not names:
        return None
    with safe_open(index[names[0]], framework="pt") as sf:
        return sf.get_tensor(names[0])


def load_target_embeddings(model_dir: str | os.PathLike) -> torch.Tensor:
    """(V, H) input embeddings of the target."""
    embed = load_target_tensor(model_dir, "embed_tokens.weight")
    if embed is None:
        raise DrafterError(f"{model_dir}: no '*embed_tokens.weight' tensor in the safetensors files")
    return embed


_HEAD = "lm_head.weight"


def load_target_lm_head(model_dir: str | os.PathLike) -> torch.Tensor:
    """(V, H) output head of the target in floating point; the embeddings only where config.json
    says `tie_word_embeddings` (absent: untied). The head turns the final states into the training
    target, so a head that is missing, stored quantized (packed integer or fp8 weights, e.g.
    `lm_head.weight_packed` + `lm_head.weight_scale` of compressed-tensors, AWQ/GPTQ's
    `lm_head.qweight`) or not (V, H)-shaped raises DrafterError naming the tensor: falling back to
    the embeddings of an untied target would train on another distribution."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    cfg = load_target_config(model_dir)
    if cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings", False)):
        return load_target_embeddings(model_dir)
    index = _weight_files(model_dir)
    names = sorted((n for n in index if n == _HEAD or n.endswith("." + _HEAD)), key=len)
    if not names:
        stored = sorted(n for n in index if n.startswith(("lm_head.", "language_model.lm_head.")) or ".lm_head." in n)
        if stored:
            raise DrafterError(
                f"{model_dir}: the target's output head is stored quantized ({', '.join(stored[:4])}), not as "
                f"'{_HEAD}': the trainer needs it unquantized (its logits are the training target); quantize the "
                "target with the head left out (compressed-tensors/llm-compressor: ignore=['lm_head'], as Kimi-K2.5 "
                "ships), or train on target_signal 'topk'"
            )
        raise DrafterError(
            f"{model_dir}: no '{_HEAD}' tensor in the safetensors files and config.json does not set "
            "tie_word_embeddings: the output head is missing (a renamed head is not guessed); pass the target's full "
            "checkpoint, or set tie_word_embeddings if the target really ties its head to the embeddings"
        )
    with safe_open(index[names[0]], framework="pt") as sf:
        head = sf.get_tensor(names[0])
    if not head.is_floating_point() or head.element_size() < 2:
        raise DrafterError(
            f"{model_dir}: the target's output head '{names[0]}' is stored as {str(head.dtype).removeprefix('torch.')} "
            "(quantized): the trainer needs it in bf16/fp16/fp32 (its logits are the training target); quantize the "
            "target with the head left out (ignore=['lm_head']), or train on target_signal 'topk'"
        )
    embed_shape = (int(cfg.get("vocab_size", head.shape[0])), int(cfg.get("hidden_size", head.shape[-1])))
    if head.dim() != 2 or ("vocab_size" in cfg and "hidden_size" in cfg and tuple(head.shape) != embed_shape):
        raise DrafterError(
            f"{model_dir}: the target's output head '{names[0]}' is {list(head.shape)}, not (vocab_size, hidden_size) "
            f"{list(embed_shape)} from config.json"
        )
    return head


def build_drafter(model_dir: str | os.PathLike, num_aux: int, draft_vocab_size: int, shape=None) -> Eagle3Drafter:
    """A freshly initialised drafter with the target's frozen embeddings (`shape`: a DrafterShape)."""
    config = DrafterConfig.from_target(load_target_config(model_dir), num_aux, draft_vocab_size, shape)
    drafter = Eagle3Drafter(config)
    embed = load_target_embeddings(model_dir)
    if tuple(embed.shape) != (config.vocab_size, config.hidden_size):
        raise DrafterError(
            f"{model_dir}: embeddings {list(embed.shape)} disagree with config.json ({config.vocab_size}, {config.hidden_size})"
        )
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(embed.float())
    return drafter
