"""SGLang 0.5.23's MLA EAGLE-3 drafter (`Eagle3DeepseekV2ForCausalLM`, sglang/srt/models/
kimi_k25_eagle3.py: an EAGLE-3 layer whose attention is DeepSeek-V2 multi-latent attention, as
TorchSpec trains for Kimi-K2.5) served on the CPU beside the tiny DeepSeek-V3 target
(tests/targets.py), in the checkpoint layout SGLang's loader reads: `midlayer.*` (or `layers.0.*`),
q_a_proj / kv_a_proj_with_mqa (fused by the loader), q_a_layernorm, q_b_proj, kv_a_layernorm,
kv_b_proj, o_proj, gate/up/down_proj, fc, norm, lm_head, d2t. Random weights: the speculative
output must equal the target's greedy output, and nothing is accepted.

SGLang 0.5.23's CPU path runs it through aerie's launcher and ops with one fix: the drafter's
`set_embed` calls `torch.cuda.synchronize()` unconditionally ("Found no NVIDIA driver" at the
draft worker's start), which aerie_sglang.cpu.ops makes a no-op on a machine without CUDA. The
draft's MLA runs in aerie's CPU attention ops, as the target's does. aerie's trainer builds this
drafter with `--drafter-arch mla` (test_sglang_mla_drafter_trained.py serves a trained one)."""

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

MAX_NEW_TOKENS = 16
PROMPTS = [[1, 504, 3060, 314, 253], list(range(200, 220))]
DRAFT_VOCAB = 4096
EAGLE_ENV = {"TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}


def random_mla_drafter(folder: Path, target: Path) -> Path:
    cfg = json.loads((target / "config.json").read_text())
    H, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads, q_rank, kv_rank, nope, rope, v_dim, inter = 4, 48, 32, 16, 8, 16, 128
    layer_ids = to_engine_ids(
        default_capture_points(NUM_LAYERS), convention_for("sglang", cfg["architectures"][0]), NUM_LAYERS
    )
    g = torch.Generator().manual_seed(13)

    def w(*shape):
        return 0.05 * torch.randn(*shape, generator=g)

    a = "midlayer.self_attn."
    tensors = {
        "fc.weight": w(H, len(layer_ids) * H),
        "midlayer.hidden_norm.weight": torch.ones(H),
        "midlayer.input_layernorm.weight": torch.ones(H),
        a + "q_a_proj.weight": w(q_rank, 2 * H),  # input: [embeddings | fc(aux)]
        a + "q_a_layernorm.weight": torch.ones(q_rank),
        a + "q_b_proj.weight": w(heads * (nope + rope), q_rank),
        a + "kv_a_proj_with_mqa.weight": w(kv_rank + rope, 2 * H),
        a + "kv_a_layernorm.weight": torch.ones(kv_rank),
        a + "kv_b_proj.weight": w(heads * (nope + v_dim), kv_rank),
        a + "o_proj.weight": w(H, heads * v_dim),
        "midlayer.post_attention_layernorm.weight": torch.ones(H),
        "midlayer.mlp.gate_proj.weight": w(inter, H),
        "midlayer.mlp.up_proj.weight": w(inter, H),
        "midlayer.mlp.down_proj.weight": w(H, inter),
        "norm.weight": torch.ones(H),
        "lm_head.weight": w(DRAFT_VOCAB, H),
        "d2t": torch.zeros(DRAFT_VOCAB, dtype=torch.int64),
        "t2d": torch.arange(vocab) < DRAFT_VOCAB,
    }
    config = {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "deepseek_v3",
        "hidden_size": H, "target_hidden_size": H, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": heads,
        "q_lora_rank": q_rank, "kv_lora_rank": kv_rank, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope,
        "v_head_dim": v_dim, "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": cfg["max_position_embeddings"], "rope_theta": cfg.get("rope_theta", 10000.0),
        "rope_scaling": cfg.get("rope_scaling"), "rope_interleave": True,
        "vocab_size": vocab, "draft_vocab_size": DRAFT_VOCAB, "tie_word_embeddings": False,
        "attention_bias": False, "torch_dtype": "float32",
        "bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": layer_ids, "use_aux_hidden_state": True},
    }  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


@pytest.fixture(scope="module")
def server(deepseek_tiny, tmp_path_factory):
    drafter = random_mla_drafter(tmp_path_factory.mktemp("drafter") / "random-eagle3-mla", deepseek_tiny)
    with serve_server(deepseek_tiny, drafter, env=EAGLE_ENV, log_dir=tmp_path_factory.mktemp("sglang")) as s:
        yield s


def test_an_mla_drafter_serves_greedy_text_and_a_random_one_accepts_nothing(server, deepseek_tiny):
    model = load_reference(deepseek_tiny)
    for ids in PROMPTS:
        r = httpx.post(server.url + "/generate", timeout=600, json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True}})  # fmt: skip
        assert r.status_code == 200, f"{r.text[:500]}; server log:\n{server.log_tail()}"
        out, meta = r.json()["output_ids"], r.json()["meta_info"]
        print(f"{len(ids)} tokens: {meta['completion_tokens']} / {meta['spec_verify_ct']} verifies")
        with torch.no_grad():
            greedy = model.generate(
                torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, min_new_tokens=MAX_NEW_TOKENS, do_sample=False
            )
        assert out == greedy[0, len(ids) :].tolist(), "speculative output differs from greedy"
        assert meta["spec_verify_ct"] >= MAX_NEW_TOKENS - 2
