"""`aerie run --model <a DeepSeek-V3 folder>`: the main job on the seed's target class (MLA, MoE,
YaRN), on the embedded default, in miniature (the tiny random DeepSeek-V3 of tests/targets.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.services import clean_env


@pytest.mark.slow
def test_aerie_run_trains_a_drafter_for_a_deepseek_v3_target(tmp_path, deepseek_tiny, smollm2_path):
    env = clean_env(AERIE_CACHE_DIR=str(smollm2_path.parent))
    cmd = [
        str(Path(sys.executable).with_name("aerie")),
        "run",
        "--quick",
        "--model",
        str(deepseek_tiny),
        "--records",
        "24",
        "--steps",
        "30",
        "--eval-prompts",
        "2",
        "--out",
        str(tmp_path / "drafter"),
    ]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "DeepseekV3ForCausalLM, 8 layers" in out.stdout and "[2, 4, 5] -> SGLang ids [1, 3, 4]" in out.stdout
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    # a Llama layer of its own for an MLA target, with the target's YaRN rope
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["target_hidden_size"] == 64
    assert (
        config["rope_parameters"]["rope_type"] == "yarn"
        and config["num_key_value_heads"] < config["num_attention_heads"]
    )
    lineage = json.loads((tmp_path / "drafter" / "aerie.json").read_text())
    assert (
        lineage["metrics"]["draft_vocab_coverage"] > 0.9
        and lineage["target"]["architecture"] == "DeepseekV3ForCausalLM"
    )
