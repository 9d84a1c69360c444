"""EAGLE-3 serving on the seed's target class: real SGLang serves the tiny DeepSeek-V3
(tests/targets.py) with an EAGLE-3 drafter on the CPU, through aerie's launcher and CPU ops.

The drafter has the shape a DeepSeek-V3/Kimi drafter has (SpecForge's, and what SGLang's
`LlamaForCausalLMEagle3` loads): a Llama decoder layer with its own attention shape (4 heads, 2 KV
heads, head dim 32: not the target's MLA layout) and plain rope, `target_hidden_size` = the
target's H, the capture ids of aerie's DeepSeek rule, a draft vocabulary (d2t/t2d). Its weights are
random, so it must change nothing and accept nothing:

- SGLang's speculative output equals transformers' greedy output on every prompt (float32): the
  target's verify passes (MLA extend over the latent cache, no tree mask with topk 1), the draft
  passes (GQA decode/extend) and the tree/verify bookkeeping all run in aerie's plain-torch ops;
- SGLang's own acceptance length (`spec_accept_length`, completion tokens / verify steps) is ~1.

Measured (2026-12-03, `bash scripts/test.sh tests/inference/test_sglang_deepseek_serve.py`):
text equal on 3/3 prompts, acceptance 32/31 = 1.032 on each. One server.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from aerie.capture import convention_for, default_capture_points, to_engine_ids
from tests.sglang_server import serve_server
from tests.targets import NUM_LAYERS, load_reference

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

MAX_NEW_TOKENS = 32
PROMPTS = [[1, 504, 3060, 314, 253], list(range(200, 220)), [1, *range(3000, 3040)]]
DRAFT_VOCAB = 4096
# As tests/inference/test_serve_drafter.py: eager top-k (inductor compiles for minutes on a loaded
# 2-core CPU) and one OpenMP thread (tiny verify matmuls; two threads stall each other under load).
EAGLE_ENV = {"TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}


def random_drafter(folder: Path, target: Path) -> Path:
    """An EAGLE-3 drafter for `target` in the export layout (aerie_trainer.export), random weights."""
    cfg = json.loads((target / "config.json").read_text())
    H, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads, kv_heads, head_dim, inter = 4, 2, 32, 128
    layer_ids = to_engine_ids(
        default_capture_points(NUM_LAYERS), convention_for("sglang", cfg["architectures"][0]), NUM_LAYERS
    )
    g = torch.Generator().manual_seed(11)

    def w(*shape):
        return 0.05 * torch.randn(*shape, generator=g)

    tensors = {
        "fc.weight": w(H, len(layer_ids) * H),
        "midlayer.hidden_norm.weight": torch.ones(H),
        "midlayer.input_layernorm.weight": torch.ones(H),
        "midlayer.self_attn.q_proj.weight": w(heads * head_dim, 2 * H),  # input: [embeddings | fc(aux)]
        "midlayer.self_attn.k_proj.weight": w(kv_heads * head_dim, 2 * H),
        "midlayer.self_attn.v_proj.weight": w(kv_heads * head_dim, 2 * H),
        "midlayer.self_attn.o_proj.weight": w(H, heads * head_dim),
        "midlayer.post_attention_layernorm.weight": torch.ones(H),
        "midlayer.mlp.gate_proj.weight": w(inter, H),
        "midlayer.mlp.up_proj.weight": w(inter, H),
        "midlayer.mlp.down_proj.weight": w(H, inter),
        "norm.weight": torch.ones(H),
        "lm_head.weight": w(DRAFT_VOCAB, H),
        "d2t": torch.zeros(DRAFT_VOCAB, dtype=torch.int64),  # draft id i -> target id i + d2t[i]
        "t2d": torch.arange(vocab) < DRAFT_VOCAB,
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": H, "target_hidden_size": H, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": cfg["max_position_embeddings"], "rope_theta": 10000.0,
        "vocab_size": vocab, "draft_vocab_size": DRAFT_VOCAB, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
        "bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": layer_ids, "use_aux_hidden_state": True},
    }  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


@pytest.fixture(scope="module")
def drafter(deepseek_tiny, tmp_path_factory) -> Path:
    from aerie_trainer.export import check_sglang_loadable

    folder = random_drafter(tmp_path_factory.mktemp("drafter") / "random-eagle3", deepseek_tiny)
    check_sglang_loadable(folder)  # every tensor lands in an SGLang parameter, none skipped
    return folder


@pytest.fixture(scope="module")
def server(deepseek_tiny, drafter, tmp_path_factory):
    with serve_server(deepseek_tiny, drafter, env=EAGLE_ENV, log_dir=tmp_path_factory.mktemp("sglang")) as s:
        yield s


def test_the_drafter_captures_with_aeries_deepseek_ids(drafter):
    ids = json.loads((drafter / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == [1, 3, 4]  # capture points [2, 4, 5]: SGLang's DeepSeek model adds 1 when the first id is 1


def test_speculative_output_equals_greedy_and_a_random_drafter_accepts_nothing(server, deepseek_tiny):
    model = load_reference(deepseek_tiny)
    for ids in PROMPTS:
        r = httpx.post(server.url + "/generate", timeout=600, json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}})  # fmt: skip
        assert r.status_code == 200, f"{r.text[:500]}; server log:\n{server.log_tail()}"
        out, meta = r.json()["output_ids"], r.json()["meta_info"]
        print(
            f"{len(ids)} tokens: {meta['completion_tokens']} / {meta['spec_verify_ct']} verifies = {meta['spec_accept_length']:.3f}"
        )
        with torch.no_grad():
            greedy = model.generate(
                torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, min_new_tokens=MAX_NEW_TOKENS, do_sample=False
            )
        assert out == greedy[0, len(ids) :].tolist(), (
            f"speculative output differs from greedy for a prompt of {len(ids)} tokens"
        )
        assert meta["completion_tokens"] == MAX_NEW_TOKENS
        # the first token comes from prefill, each verify step adds the target's own token plus
        # the accepted drafts: nothing accepted gives n / (n - 1)
        assert meta["spec_verify_ct"] >= MAX_NEW_TOKENS - 2
        assert meta["spec_accept_length"] == pytest.approx(MAX_NEW_TOKENS / meta["spec_verify_ct"])
        assert meta["spec_accept_length"] < 1.1
