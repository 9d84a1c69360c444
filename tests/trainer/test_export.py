"""The exported drafter folder against SGLang's loader, and publish / pull through the store."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from aerie import drafters, layout
from aerie.capture import default_capture_points
from aerie.contracts import EngineSpec, IngestOptions, RunSpec, TrainConfig, TrainRequest
from aerie.store import NotFound
from aerie.target import describe
from aerie_trainer import export
from aerie_trainer.data import RunSet
from aerie_trainer.model import build_drafter, load_target_config
from tests.services import REPO

VD = 1024


@pytest.fixture(scope="module")
def drafter(smollm2_path):
    torch.manual_seed(0)
    d = build_drafter(smollm2_path, num_aux=3, draft_vocab_size=VD)
    d.set_vocab(torch.arange(3, 3 + 2 * VD, 2))
    return d


@pytest.fixture
def exported(drafter, smollm2_path, tmp_path) -> Path:
    return export.export(drafter, tmp_path / "drafter", [1, 14, 26], load_target_config(smollm2_path))


def sglang_source() -> Path | None:
    """llama_eagle3.py of the pinned SGLang, if an SGLang install is around (.venv-sglang or this env)."""
    spec = importlib.util.find_spec("sglang")
    roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    roots += sorted(REPO.glob(".venv-sglang/lib/python3*/site-packages/sglang"))
    for root in roots:
        path = root / "srt" / "models" / "llama_eagle3.py"
        if path.is_file():
            return path
    return None


@pytest.mark.sglang
def test_mapping_constants_are_sglangs_own():
    """The name mapping export.py replays is the one in SGLang 0.5.23's llama_eagle3.py."""
    path = sglang_source()
    if path is None:  # the test command requires SGLang: there this check can never be lost silently
        reason = "no SGLang install (.venv-sglang) to read llama_eagle3.py from: scripts/sglang_env.sh creates it"
        if os.environ.get("AERIE_REQUIRE_SGLANG"):
            pytest.fail(f"AERIE_REQUIRE_SGLANG is set but {reason}")
        pytest.skip(reason)
    tree = ast.parse(path.read_text())
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in ("stacked_params_mapping", "legacy_name_map"):
                found[node.targets[0].id] = ast.literal_eval(node.value)
    assert found["stacked_params_mapping"] == export.SGLANG_STACKED_PARAMS_MAPPING
    assert found["legacy_name_map"] == export.SGLANG_LEGACY_NAME_MAP
    source = path.read_text()
    # the facts the check relies on: d2t becomes hot_token_id, t2d is skipped, fc is K*Ht wide,
    # the first layer's qkv reads 2H, a tied config aliases lm_head to the embeddings
    for fact in (
        'if "d2t" in name:',
        'if "t2d" in name:',
        "self.hidden_size_in * self.num_aux_hidden_states",
        "hidden_size = 2 * self.hidden_size if self.is_input_layer else self.hidden_size",
        "self.lm_head = self.model.embed_tokens",
        'eagle_config.get("eagle_aux_hidden_state_layer_ids")',
    ):
        assert fact in source, fact


def test_exported_folder_is_what_sglang_loads(exported, drafter, smollm2_path):
    report = export.check_sglang_loadable(exported)
    # every tensor consumed by a parameter (or d2t/t2d), none skipped
    assert report["skipped"] == []
    assert set(report["tensors"]) == set(export.REQUIRED_TENSORS)
    assert report["tensors"]["midlayer.self_attn.q_proj.weight"] == "model.layers.0.self_attn.qkv_proj.weight"
    assert report["tensors"]["lm_head.weight"] == "lm_head.weight"
    assert report["tensors"]["fc.weight"] == "model.fc.weight"
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == VD and cfg["target_hidden_size"] == 576 and cfg["vocab_size"] == 49152
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert cfg["tie_word_embeddings"] is False and cfg["rope_theta"] == 100000.0
    tensors = load_file(str(exported / "model.safetensors"))
    assert tensors["fc.weight"].shape == (576, 3 * 576) and tensors["fc.weight"].dtype == torch.bfloat16
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (9 * 64, 2 * 576)
    assert tensors["midlayer.self_attn.k_proj.weight"].shape == (3 * 64, 2 * 576)
    assert tensors["lm_head.weight"].shape == (VD, 576)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert not any("embed" in n for n in tensors)
    # transformers (which SGLang uses to read config.json) sees the same numbers
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(str(exported))
    assert hf.num_hidden_layers == 1 and hf.draft_vocab_size == VD and hf.tie_word_embeddings is False
    theta = (getattr(hf, "rope_parameters", None) or {}).get("rope_theta", getattr(hf, "rope_theta", None))
    assert theta == 100000.0
    # and it loads back into the same drafter
    again = export.load_exported(exported, smollm2_path)
    for name, t in drafter.exported_state_dict().items():
        want = t.to(torch.bfloat16).float() if t.is_floating_point() else t
        assert torch.equal(again.state_dict()[name], want), name


def _rewrite(folder: Path, change) -> Path:
    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_check_catches_what_sglang_would_silently_skip(exported):
    with pytest.raises(export.ExportError, match="'midlayer.mlp.down.weight' matches no SGLang parameter"):
        export.check_sglang_loadable(
            _rewrite(
                exported, lambda t: t.__setitem__("midlayer.mlp.down.weight", t.pop("midlayer.mlp.down_proj.weight"))
            )
        )


def test_check_catches_a_missing_shard_and_a_wrong_shape(exported):
    def damage(t):
        del t["midlayer.self_attn.v_proj.weight"]
        t["norm.weight"] = torch.ones(575)

    with pytest.raises(export.ExportError) as e:
        export.check_sglang_loadable(_rewrite(exported, damage))
    assert "qkv_proj.weight would stay uninitialised" in str(e.value)
    assert "'norm.weight' [575] does not fit" in str(e.value)


def test_check_catches_a_tied_config(exported):
    cfg = json.loads((exported / "config.json").read_text())
    (exported / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    with pytest.raises(export.ExportError, match="tie_word_embeddings"):
        export.check_sglang_loadable(exported)


def test_export_refuses_a_drafter_missing_a_tensor(drafter, smollm2_path, tmp_path):
    broken = build_drafter(smollm2_path, num_aux=3, draft_vocab_size=VD)
    broken.set_vocab(torch.arange(VD))
    broken.norm = torch.nn.Identity()
    with pytest.raises(export.ExportError, match=r"lacks required tensor\(s\) \['norm.weight'\]"):
        export.export(broken, tmp_path / "x", [1, 14, 26], load_target_config(smollm2_path))
    assert not (tmp_path / "x" / "model.safetensors").exists()


def test_publish_then_pull(store, drafter, smollm2_path, tmp_path):
    target = describe(smollm2_path)
    points = default_capture_points(target.num_layers)
    spec = RunSpec(
        run="r1",
        dataset="d",
        target=target,
        ingest=IngestOptions(),
        capture_points=points,
        engine=EngineSpec(name="hf", version="t", convention="hf", layer_ids=points),
    )
    request = TrainRequest(
        runs=["r1"], drafter="smol", model=str(smollm2_path), config=TrainConfig(draft_vocab_size=VD)
    )
    lineage = export.publish(
        store, drafter, RunSet([spec], []), request, "v1", {"acceptance": 1.5, "losses": [2.0, 1.0]}
    )
    assert lineage.exported_layer_ids == [1, 14, 26] and lineage.exported_convention == "sglang-llama"
    assert lineage.capture_points == [2, 15, 27] and lineage.target.weights_sha256 == target.weights_sha256
    assert store.get_bytes(layout.drafter_latest("smol")) == b"v1"
    dest = drafters.pull(store, "smol", tmp_path / "pulled")
    assert sorted(p.name for p in dest.iterdir()) == ["aerie.json", "config.json", "model.safetensors"]
    export.check_sglang_loadable(dest)
    assert json.loads((dest / "aerie.json").read_text())["metrics"]["acceptance"] == 1.5
    with pytest.raises(NotFound, match="no drafter 'nope'"):
        drafters.pull(store, "nope", tmp_path / "n")
    # a corrupted object is refused by its lineage hash
    store.put_bytes(layout.drafter_file("smol", "v1", "config.json"), b"{}")
    with pytest.raises(drafters.DrafterError, match="sha256"):
        drafters.pull(store, "smol:v1", tmp_path / "bad")
