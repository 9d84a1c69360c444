"""The capture convention: the one module that knows what "layer k" means.

A **capture point** `k` (0 <= k < N, N = number of decoder layers) is the residual stream
*entering* decoder layer `k`, before its input norm: the output of layer `k-1` (hidden +
residual), and for `k = 0` the embeddings. In transformers terms it is
`output_hidden_states[k]`; HF's index `N` is post-final-norm and is *not* a capture point
(the "final state" is carried separately as the target signal).

Engines number the same tensors differently; every translation lives here:

| convention                        | engine id -> capture point                          |
|-----------------------------------|-----------------------------------------------------|
| `sglang-llama` (Llama/Qwen family)| id `l` -> point `l + 1`                             |
| `sglang-deepseek` (DeepSeek/Kimi) | `+1` only if the first id is 1, else id = point     |
| `hf`, `vllm`, `speculators`       | id = point                                          |

Nothing else in aerie adds or subtracts one from a layer number.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

Convention = Literal["sglang-llama", "sglang-deepseek", "hf", "vllm", "speculators"]
CONVENTIONS: tuple[str, ...] = ("sglang-llama", "sglang-deepseek", "hf", "vllm", "speculators")

# Architectures (config.json `architectures[0]`) whose SGLang 0.5.23 model class applies the
# DeepSeek convention (`+1` only when the first id is 1): in its own set_eagle3_layers_to_capture,
# by inheritance, or by delegating to such a class (Kimi-K2.5's multimodal wrapper). The list is
# exactly what SGLang's source says; tests/shared/test_sglang_layer_rule.py derives it from the
# installed model files and fails when the two differ. Kimi-K2 itself is `DeepseekV3ForCausalLM`;
# the `*NextN` / `*Eagle` names are draft-model classes SGLang builds for MTP and EAGLE drafts,
# listed because they inherit the rule.
SGLANG_DEEPSEEK_ARCHS = frozenset(
    {
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "DeepseekV3ForCausalLMNextN",
        "Glm4MoeLiteForCausalLM",
        "Glm4MoeLiteForCausalLMNextN",
        "Glm5NextForConditionalGenerationNextN",
        "GlmMoeDsaForCausalLM",
        "GlmMoeDsaForCausalLMNextN",
        "KimiK25ForConditionalGeneration",
        "MistralLarge3ForCausalLM",
        "MistralLarge3ForCausalLMEagle",
    }
)


class CaptureError(ValueError):
    """A capture point or engine id that cannot name a residual-stream tensor."""


def default_capture_points(num_layers: int) -> list[int]:
    """`[2, N//2, N-3]`: low, middle and high residual streams (EAGLE-3's choice)."""
    if num_layers < 6:
        raise CaptureError(
            f"a target with {num_layers} decoder layers is too shallow for the default capture "
            "points [2, N//2, N-3]: pass capture points explicitly"
        )
    return [2, num_layers // 2, num_layers - 3]


def validate_capture_points(points: Sequence[int], num_layers: int) -> list[int]:
    """Check that every point names a capturable tensor; return them as a list."""
    points = [int(p) for p in points]
    if not points:
        raise CaptureError("no capture points given: pass at least one (default [2, N//2, N-3])")
    for p in points:
        if p == num_layers:
            raise CaptureError(
                f"capture point {p} is the final-norm output of a {num_layers}-layer target: it is "
                f"the target signal, not a capture point (valid: 0..{num_layers - 1})"
            )
        if p < 0 or p > num_layers:
            raise CaptureError(
                f"capture point {p} does not exist in a {num_layers}-layer target "
                f"(valid: 0..{num_layers - 1}; point k is the residual stream entering layer k)"
            )
    if len(set(points)) != len(points):
        raise CaptureError(f"capture points {points} repeat a point")
    if points != sorted(points):
        raise CaptureError(f"capture points {points} must be in increasing order")
    return points


def convention_for(engine: str, architecture: str) -> Convention:
    """The id convention an engine uses for a target architecture."""
    if engine == "sglang":
        return "sglang-deepseek" if architecture in SGLANG_DEEPSEEK_ARCHS else "sglang-llama"
    if engine in ("hf", "vllm", "speculators"):
        return engine  # type: ignore[return-value]
    raise CaptureError(f"unknown engine {engine!r}: known engines are sglang, hf, vllm, speculators")


def to_engine_ids(points: Sequence[int], convention: Convention, num_layers: int) -> list[int]:
    """Capture points -> the layer ids an engine must be told to capture those tensors."""
    points = validate_capture_points(points, num_layers)
    if convention == "sglang-llama":
        if points[0] == 0:
            raise CaptureError(
                "capture point 0 (the embeddings) cannot be captured by SGLang's Llama/Qwen "
                "models: their id l captures the output of layer l (point l+1)"
            )
        return [p - 1 for p in points]
    if convention == "sglang-deepseek":
        # DeepSeek models add 1 to every id when (and only when) the first id is 1.
        # Ids that are points themselves are used when that leaves the first id != 1.
        if points[0] == 2:
            return [p - 1 for p in points]
        if points[0] == 1:
            raise CaptureError(
                "capture point 1 cannot be expressed for SGLang's DeepSeek/Kimi models: id 1 "
                "switches on their +1 shift, so no id list names point 1 first"
            )
        return list(points)
    if convention in ("hf", "vllm", "speculators"):
        return list(points)
    raise CaptureError(f"unknown convention {convention!r}: known {', '.join(CONVENTIONS)}")


def from_engine_ids(ids: Sequence[int], convention: Convention, num_layers: int) -> list[int]:
    """Layer ids as an engine (or a drafter's config) states them -> capture points."""
    ids = [int(i) for i in ids]
    if not ids:
        raise CaptureError("empty layer id list")
    if convention == "sglang-llama":
        points = [i + 1 for i in ids]
    elif convention == "sglang-deepseek":
        points = [i + 1 for i in ids] if ids[0] == 1 else list(ids)
    elif convention in ("hf", "vllm", "speculators"):
        points = list(ids)
    else:
        raise CaptureError(f"unknown convention {convention!r}: known {', '.join(CONVENTIONS)}")
    try:
        return validate_capture_points(points, num_layers)
    except CaptureError as e:
        raise CaptureError(f"{convention} layer ids {ids} -> {e}") from None


def hf_hidden_state_indices(points: Sequence[int], num_layers: int) -> list[int]:
    """Indices into transformers' `output_hidden_states` tuple for these points."""
    return validate_capture_points(points, num_layers)
