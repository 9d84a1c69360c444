"""The drafter's shape and rope for each target family, from the real models' config.json fields.

- Llama-class targets (SmolLM2): the drafter copies the target's attention and rope.
- DeepSeek-V3 and Kimi-K2.5 (MLA, MoE, YaRN; K2.5 wraps its language model in `text_config`): a
  Llama shape of the drafter's own (128-dim heads, 8 KV heads) with the target's YaRN rope.
- The export is what SGLang's `LlamaForCausalLMEagle3` builds from it: its parameters' shapes
  (the export check's replay), and its rope — the cos/sin table computed by SGLang's own
  `get_rope` from the exported config.json, in SGLang's own environment.
- Fewer than two capture points are refused at build and at export.
"""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest
import torch

from aerie.contracts import DrafterShape
from aerie_trainer import export
from aerie_trainer.model import DrafterConfig, DrafterError, Eagle3Drafter, load_target_config
from tests.runs import DATA
from tests.services import REPO, clean_env
from tests.sglang_server import sglang_python

DEEPSEEK_V3 = json.loads((DATA / "deepseek_v3_config.json").read_text())
KIMI_K25 = json.loads((DATA / "kimi_k25_config.json").read_text())


def meta_state(config: DrafterConfig) -> dict[str, list[int]]:
    """The drafter's exported tensors' shapes, built on the meta device (no memory, any size)."""
    with torch.device("meta"):
        drafter = Eagle3Drafter(config)
    return {name: list(t.shape) for name, t in drafter.exported_state_dict().items()}


def sglang_shapes(config: DrafterConfig, layer_ids: list[int]) -> dict[str, list[int]]:
    """What SGLang's loader would load each exported tensor into, with that parameter's shape."""
    cfg = export.drafter_config_json(config, {}, layer_ids)
    params = export.sglang_expected_params(cfg)
    out = {}
    for name in meta_state(config):
        target, shard = export.sglang_param_name(name, params)
        out[name] = (
            None if target is None or target in ("hot_token_id",) or target.startswith("t2d") else params[target][shard]
        )
    return out


@pytest.mark.parametrize(
    "target, vocab, theta, factor",
    [(DEEPSEEK_V3, 129280, 10000.0, 40.0), (KIMI_K25, 163840, 50000.0, 64.0)],
    ids=["deepseek-v3", "kimi-k2.5"],
)
def test_mla_targets_get_a_llama_shape_of_their_own(target, vocab, theta, factor):
    config = DrafterConfig.from_target(target, num_aux=3, draft_vocab_size=32000)
    assert (config.hidden_size, config.target_hidden_size, config.vocab_size) == (7168, 7168, vocab)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (56, 8, 128)
    assert config.intermediate_size == 12288
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == factor
    assert (
        config.rope_parameters["rope_theta"] == theta
        and config.rope_parameters["original_max_position_embeddings"] == 4096
    )
    shapes = meta_state(config)
    assert shapes["fc.weight"] == [7168, 3 * 7168] and shapes["lm_head.weight"] == [32000, 7168]
    assert shapes["midlayer.self_attn.q_proj.weight"] == [56 * 128, 2 * 7168]
    assert shapes["midlayer.self_attn.k_proj.weight"] == [8 * 128, 2 * 7168]
    # every exported tensor fits the SGLang parameter it loads into (tensor-parallel-1 shapes)
    for name, want in sglang_shapes(config, [1, 29, 57]).items():
        if want is not None:
            assert shapes[name] == want, name


def test_a_llama_class_target_is_copied(smollm2_path):
    config = DrafterConfig.from_target(load_target_config(smollm2_path), num_aux=3, draft_vocab_size=4096)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.intermediate_size) == (
        9,
        3,
        64,
        1536,
    )
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}


def test_the_shape_is_a_setting():
    shape = DrafterShape(
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    config = DrafterConfig.from_target(DEEPSEEK_V3, num_aux=3, draft_vocab_size=32000, shape=shape)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.intermediate_size) == (
        32,
        4,
        64,
        8192,
    )
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
    with pytest.raises(DrafterError, match="not a multiple of num_key_value_heads 3"):
        DrafterConfig.from_target(DEEPSEEK_V3, 3, 32000, DrafterShape(num_attention_heads=32, num_key_value_heads=3))
    with pytest.raises(DrafterError, match="rope_type 'dynamic' is not supported"):
        DrafterConfig.from_target(
            DEEPSEEK_V3, 3, 32000, DrafterShape(rope_parameters={"rope_type": "dynamic", "factor": 2.0})
        )


def test_one_capture_point_is_refused_at_build_and_at_export(smollm2_path, tmp_path):
    with pytest.raises(DrafterError, match="needs at least 2"):
        DrafterConfig.from_target(DEEPSEEK_V3, num_aux=1, draft_vocab_size=32000)
    # a folder exported by someone else with one layer id: the export check refuses it
    from aerie_trainer.model import build_drafter

    drafter = build_drafter(smollm2_path, num_aux=2, draft_vocab_size=64)
    drafter.set_vocab(torch.arange(64))
    folder = export.export(drafter, tmp_path / "d", [1, 14], load_target_config(smollm2_path))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [14]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(export.ExportError, match="one capture point; SGLang skips `fc`"):
        export.check_sglang_loadable(folder)


_SGLANG_ROPE = """
import json, sys, torch
from transformers import AutoConfig
from sglang.srt.layers.rotary_embedding import get_rope
cfg = AutoConfig.from_pretrained(sys.argv[1])
# as sglang/srt/models/llama.py's LlamaDecoderLayer (which llama_eagle3 builds) reads it
rope_parameters = getattr(cfg, "rope_parameters", None)
if rope_parameters is not None:
    theta, scaling = rope_parameters.get("rope_theta", 10000), rope_parameters
else:
    theta, scaling = getattr(cfg, "rope_theta", 10000), getattr(cfg, "rope_scaling", None)
rope = get_rope(cfg.head_dim, cfg.head_dim, getattr(cfg, "max_position_embeddings", 8192), theta, True, scaling, torch.float32)
positions = json.loads(sys.argv[2])
print(json.dumps({"kind": type(rope).__name__, "cos_sin": rope.cos_sin_cache[positions].tolist()}))
"""


@pytest.mark.sglang
@pytest.mark.parametrize("target", [DEEPSEEK_V3, KIMI_K25], ids=["deepseek-v3", "kimi-k2.5"])
def test_the_exported_rope_is_the_one_sglang_computes(target, tmp_path):
    """The drafter's cos/sin at positions up to 200k equal SGLang's own table for the exported
    config.json: the serving engine rotates exactly as the trainer did."""
    config = DrafterConfig.from_target(target, num_aux=3, draft_vocab_size=32000)
    (tmp_path / "config.json").write_text(json.dumps(export.drafter_config_json(config, target, [1, 29, 57])))
    positions = [0, 1, 7, 100, 4095, 4096, 20_000, 150_000, 200_000][
        : 9 if config.max_position_embeddings > 200_000 else 8
    ]
    out = subprocess.run(
        [str(sglang_python()), "-c", textwrap.dedent(_SGLANG_ROPE), str(tmp_path), json.dumps(positions)],
        env=clean_env(SGLANG_USE_CPU_ENGINE="1", PYTHONPATH=str(REPO / "services/inference/aerie_sglang/cpu/shim")),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    assert theirs["kind"] == "YaRNScalingRotaryEmbedding"
    from aerie_trainer.model import rope_tables

    inv_freq, mscale = rope_tables(config)
    freqs = torch.tensor(positions, dtype=torch.float32)[:, None] * inv_freq
    ours = torch.cat([freqs.cos() * mscale, freqs.sin() * mscale], dim=-1)
    torch.testing.assert_close(ours, torch.tensor(theirs["cos_sin"]), rtol=0, atol=2e-6)


@pytest.mark.parametrize("target", [DEEPSEEK_V3, KIMI_K25], ids=["deepseek-v3", "kimi-k2.5"])
def test_an_mla_drafter_copies_the_targets_attention_and_fits_sglangs_mla_drafter(target):
    """arch "mla": the target's heads, LoRA ranks, head dims and YaRN; every exported tensor fits the
    parameter SGLang's Eagle3DeepseekV2ForCausalLM loads it into (q_a_proj and kv_a_proj_with_mqa
    as the two shards of its fused a-projection, 2H wide)."""
    config = DrafterConfig.from_target(target, num_aux=3, draft_vocab_size=32000, shape=DrafterShape(arch="mla"))
    text = target.get("text_config", target)
    assert config.arch == "mla" and config.num_attention_heads == text["num_attention_heads"]  # 128, 64
    assert (config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim) == (
        1536,
        512,
        128,
        64,
    )
    assert config.v_head_dim == 128 and config.head_dim == 192 and config.intermediate_size == 12288
    assert config.rope_parameters["rope_type"] == "yarn"
    cfg = export.drafter_config_json(config, target, [1, 29, 57])
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["rope_scaling"]["type"] == "yarn"
    params = export.sglang_mla_expected_params(cfg)
    shapes, loaded = meta_state(config), {}
    for name, shape in shapes.items():
        param, shard = export.sglang_mla_param_name(name, params)
        assert param is not None, name
        if param in params:
            assert shape == params[param][shard], name
            loaded.setdefault(param, set()).add(shard)
    assert loaded["model.midlayer.self_attn.fused_qkv_a_proj_with_mqa.weight"] == {"q", "kv"}
    assert set(loaded) == set(params) - {"model.embed_tokens.weight"}
    with pytest.raises(DrafterError, match="MLA fields need arch 'mla'"):
        DrafterConfig.from_target(target, 3, 32000, DrafterShape(kv_lora_rank=256))
    with pytest.raises(DrafterError, match="MLA drafter layer computes only default and yarn"):
        DrafterConfig.from_target(
            target, 3, 32000, DrafterShape(arch="mla", rope_parameters={"rope_type": "llama3", "factor": 8.0})
        )


_SGLANG_MLA_ROPE = """
import json, sys, torch
from transformers import AutoConfig
from sglang.srt.configs.model_config import compute_mla_mscale_scaling
from sglang.srt.layers.rotary_embedding.factory import get_rope_cpu
cfg = AutoConfig.from_pretrained(sys.argv[1])
# as sglang/srt/models/kimi_k25_eagle3.py's Eagle3MLADecoderLayer reads the config ...
if hasattr(cfg, "rope_parameters") and cfg.rope_parameters is not None:
    rope_params = cfg.rope_parameters
    rope_theta = rope_params.get("rope_theta", 10000)
    rope_scaling = rope_params if rope_params.get("rope_type") != "default" else None
else:
    rope_theta, rope_scaling = cfg.rope_theta, cfg.rope_scaling
# ... and deepseek_v2.py's DeepseekV2AttentionMLA builds its rope and softmax scale (on the CPU)
rope_scaling = dict(rope_scaling)
rope_scaling["rope_type"] = "deepseek_yarn"
rope = get_rope_cpu(cfg.qk_rope_head_dim, cfg.qk_rope_head_dim, cfg.max_position_embeddings, rope_theta,
                    not getattr(cfg, "rope_interleave", True), rope_scaling, torch.float32, device="cpu")
scaling = compute_mla_mscale_scaling(rope_scaling, (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5)
positions = torch.tensor(json.loads(sys.argv[2]))
g = torch.Generator().manual_seed(0)
q = torch.randn(len(positions), cfg.num_attention_heads, cfg.qk_rope_head_dim, generator=g)
k = torch.randn(len(positions), 1, cfg.qk_rope_head_dim, generator=g)
q_rot, k_rot = rope.forward_native(positions, q.clone(), k.clone())
print(json.dumps({"kind": type(rope).__name__, "scaling": scaling, "q": q.tolist(), "k": k.tolist(),
                  "q_rot": q_rot.tolist(), "k_rot": k_rot.tolist()}))
"""


@pytest.mark.sglang
def test_the_mla_drafters_rope_and_softmax_scale_are_the_ones_sglang_computes(deepseek_tiny, tmp_path):
    """The MLA drafter's rotation (interleaved pairs, DeepSeek's YaRN and its mscale) and softmax scale
    (mscale_all_dim squared) equal SGLang's own for the exported config.json: SGLang's rope module
    for an MLA drafter on the CPU, built from the config as kimi_k25_eagle3.py / deepseek_v2.py read
    it, rotates the same vectors the same way at positions up to 4000 (past YaRN's 512)."""
    from aerie_trainer.model import apply_rope_interleaved, mla_softmax_scale, rope_cos_sin, rope_tables

    config = DrafterConfig.from_target(
        load_target_config(deepseek_tiny), num_aux=3, draft_vocab_size=512, shape=DrafterShape(arch="mla")
    )
    (tmp_path / "config.json").write_text(json.dumps(export.drafter_config_json(config, {}, [3, 4, 6])))
    positions = [0, 1, 7, 100, 511, 512, 1000, 4000]
    out = subprocess.run(
        [str(sglang_python()), "-c", textwrap.dedent(_SGLANG_MLA_ROPE), str(tmp_path), json.dumps(positions)],
        env=clean_env(SGLANG_USE_CPU_ENGINE="1", PYTHONPATH=str(REPO / "services/inference/aerie_sglang/cpu/shim")),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    assert theirs["kind"] == "DeepseekScalingRotaryEmbedding"
    inv_freq, mscale = rope_tables(config)
    assert mscale != 1.0 or config.rope_parameters.get("mscale") == config.rope_parameters.get("mscale_all_dim")
    cos, sin = rope_cos_sin(torch.tensor(positions), inv_freq, mscale, torch.float32)
    for x, rotated in (("q", "q_rot"), ("k", "k_rot")):
        ours = apply_rope_interleaved(torch.tensor(theirs[x])[None], cos[None], sin[None])[0]
        torch.testing.assert_close(ours, torch.tensor(theirs[rotated]), rtol=0, atol=1e-5)
    assert mla_softmax_scale(config) == pytest.approx(theirs["scaling"], rel=1e-12)
    assert theirs["scaling"] != pytest.approx(24**-0.5)  # the tiny target's YaRN scales the softmax too
    source = (sglang_python().parents[1] / "lib").glob("python3*/site-packages/sglang/srt/models")
    folder = next(source)
    eagle, mla = (folder / "kimi_k25_eagle3.py").read_text(), (folder / "deepseek_v2.py").read_text()
    for fact in (  # the lines the script above replays
        'rope_scaling = (\n                rope_params if rope_params.get("rope_type") != "default" else None',
        "attn.fused_qkv_a_proj_with_mqa = ReplicatedLinear(\n            2 * config.hidden_size,",
        "hidden_states, residual = self.post_attention_layernorm(attn_out, residual)",
    ):
        assert fact in eagle, fact
    for fact in (
        'rope_scaling["rope_type"] = "deepseek_yarn"',
        'is_neox_style = not getattr(config, "rope_interleave", True)',
        "self.scaling = compute_mla_mscale_scaling(rope_scaling, self.scaling)",
        "self.scaling = self.qk_head_dim**-0.5",
    ):
        assert fact in mla, fact
