"""The capture convention: one coordinate, translated to each engine's ids in one place."""

import pytest

from aerie.capture import (
    CaptureError,
    convention_for,
    default_capture_points,
    from_engine_ids,
    hf_hidden_state_indices,
    to_engine_ids,
    validate_capture_points,
)

# (architecture, N, points, expected SGLang ids, expected vLLM/speculators ids)
CASES = [
    ("KimiK25ForConditionalGeneration", 61, [2, 30, 58], [1, 29, 57], [2, 30, 58]),
    ("DeepseekV3ForCausalLM", 61, [2, 30, 58], [1, 29, 57], [2, 30, 58]),
    ("DeepseekV3ForCausalLM", 61, [3, 30, 58], [3, 30, 58], [3, 30, 58]),
    ("DeepseekV3ForCausalLM", 61, [0, 30, 58], [0, 30, 58], [0, 30, 58]),
    ("LlamaForCausalLM", 32, [2, 16, 29], [1, 15, 28], [2, 16, 29]),
    ("LlamaForCausalLM", 30, [2, 15, 27], [1, 14, 26], [2, 15, 27]),
    ("Qwen3ForCausalLM", 36, [2, 18, 33], [1, 17, 32], [2, 18, 33]),
    ("LlamaForCausalLM", 30, [1, 29], [0, 28], [1, 29]),
]


@pytest.mark.parametrize("arch,n,points,sglang_ids,vllm_ids", CASES)
def test_translation_table(arch, n, points, sglang_ids, vllm_ids):
    conv = convention_for("sglang", arch)
    assert to_engine_ids(points, conv, n) == sglang_ids
    assert from_engine_ids(sglang_ids, conv, n) == points
    for engine in ("vllm", "speculators", "hf"):
        assert to_engine_ids(points, convention_for(engine, arch), n) == vllm_ids
        assert from_engine_ids(vllm_ids, convention_for(engine, arch), n) == points


def test_defaults():
    assert default_capture_points(61) == [2, 30, 58]
    assert default_capture_points(30) == [2, 15, 27]
    assert default_capture_points(32) == [2, 16, 29]
    with pytest.raises(CaptureError, match="too shallow"):
        default_capture_points(4)


def test_deepseek_first_id_rule():
    # ids [1, ...] are shifted, any other first id is taken as points
    assert from_engine_ids([1, 29, 57], "sglang-deepseek", 61) == [2, 30, 58]
    assert from_engine_ids([2, 29, 57], "sglang-deepseek", 61) == [2, 29, 57]
    with pytest.raises(CaptureError, match="point 1"):
        to_engine_ids([1, 30], "sglang-deepseek", 61)


@pytest.mark.parametrize(
    "points,n,match",
    [
        ([2, 15, 30], 30, "final-norm output"),
        ([2, 15, 31], 30, "does not exist"),
        ([-1, 15], 30, "does not exist"),
        ([], 30, "no capture points"),
        ([5, 5], 30, "repeat"),
        ([15, 2], 30, "increasing"),
    ],
)
def test_refusals_say_why(points, n, match):
    with pytest.raises(CaptureError, match=match):
        validate_capture_points(points, n)


def test_sglang_llama_cannot_capture_embeddings():
    with pytest.raises(CaptureError, match="embeddings"):
        to_engine_ids([0, 15], "sglang-llama", 30)


def test_engine_ids_out_of_range_are_refused():
    # SGLang Llama id 29 would be point 30 = the final norm of a 30-layer model
    with pytest.raises(CaptureError, match="final-norm"):
        from_engine_ids([1, 14, 29], "sglang-llama", 30)


def test_point_k_is_the_residual_stream_entering_layer_k(smollm2_path):
    """Hook decoder layer k's input on a real model and compare with HF hidden_states[k]."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    n = model.config.num_hidden_layers
    points = [0, 1, 2, 15, n - 3, n - 1]
    entering: dict[int, torch.Tensor] = {}

    def grab(k):
        def hook(module, args, kwargs):
            entering[k] = (args[0] if args else kwargs["hidden_states"]).detach().clone()

        return hook

    handles = [model.model.layers[k].register_forward_pre_hook(grab(k), with_kwargs=True) for k in points]
    ids = torch.tensor([[1, 504, 3458, 314, 260, 1345, 30, 9011, 1673, 2]])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    for h in handles:
        h.remove()
    hidden = out.hidden_states
    assert len(hidden) == n + 1
    for k, idx in zip(points, hf_hidden_state_indices(points, n)):
        torch.testing.assert_close(hidden[idx], entering[k], rtol=0, atol=0)
    # HF's last entry is post-final-norm: not any layer's input, and refused as a point
    final_norm_in = hidden[n - 1]
    assert not torch.allclose(hidden[n], final_norm_in)
    with pytest.raises(CaptureError):
        hf_hidden_state_indices([n], n)
