"""An MLA drafter (DrafterShape.arch "mla": DeepSeek's multi-head latent attention, SGLang 0.5.23's
`Eagle3DeepseekV2ForCausalLM`) trained by the pipeline on the tiny DeepSeek-V3, exported, served
by real SGLang on the CPU beside its target — and its acceptance beside the Llama-layer drafter's.

- Both drafters are trained through the `train` stage on the same hidden states (capture points
  [3, 4, 6], tests/inference/test_sglang_deepseek_trained.py's), with the same settings and steps;
  only the drafter layer's attention differs (the MLA layer copies the target's: 4 heads, q/kv
  LoRA ranks 48/32, nope/rope/v head dims 16/8/16, YaRN; the Llama layer is `own_shape`'s 4 heads
  of 16 dims, 2 KV heads).
- The MLA drafter's folder is what SGLang's MLA drafter loads (the export check) and SGLang
  serves it: the text equals plain greedy decoding, and SGLang's acceptance (completion tokens /
  verify steps) equals the project's own speculative loop running the exported MLA drafter
  (aerie_trainer.model.MLAttention) on the same prompts — the same math in both engines.
- Printed, side by side: each drafter's held-out simulated acceptance and the project loop's
  acceptance on the prompts (the Llama layer's loop equals SGLang's in
  test_sglang_deepseek_trained.py), and SGLang's for the MLA drafter.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from tests.inference.test_sglang_deepseek_trained import (  # the same target, states, prompts and chain
    AGREEMENT_TOLERANCE,
    EAGLE_ENV,
    MAX_NEW_TOKENS,
    POINTS,
    STEPS,
    acceptance,
    chat_ids,
)
from tests.sglang_server import serve_server

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


@pytest.fixture(scope="module")
def trained(deepseek_tiny, deepseek_llama_drafter, cache_dir, tmp_path_factory) -> dict:
    """arch -> (pulled folder, train result): the MLA layer trained here through the pipeline's own
    stages, the Llama layer the one test_sglang_deepseek_trained.py serves (tests/trained.py)."""
    from tests.trained import deepseek_drafter

    mla = deepseek_drafter(cache_dir, deepseek_tiny, tmp_path_factory.mktemp("mla-trained"), "mla")
    return {"mla": mla, "llama": deepseek_llama_drafter}


@pytest.fixture(scope="module")
def prompt_ids(deepseek_tiny) -> list[list[int]]:
    return chat_ids(deepseek_tiny)


def test_a_trained_mla_drafter_serves_in_sglang_as_the_project_loop_runs_it(
    trained, deepseek_tiny, prompt_ids, tmp_path
):
    from aerie_trainer import evaluate
    from aerie_trainer.export import check_layer_ids, check_sglang_loadable, load_exported
    from tests.targets import load_reference

    folder, result = trained["mla"]
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Eagle3DeepseekV2ForCausalLM"]
    assert (config["q_lora_rank"], config["kv_lora_rank"], config["qk_rope_head_dim"]) == (48, 32, 8)
    assert json.loads((folder / "aerie.json").read_text())["exported_layer_ids"] == POINTS
    assert check_sglang_loadable(folder)["skipped"] == []
    assert check_layer_ids(folder, POINTS, "DeepseekV3ForCausalLM", 8) == POINTS
    drafter = load_exported(folder, deepseek_tiny)
    assert type(drafter.midlayer.self_attn).__name__ == "MLAttention"

    with serve_server(
        deepseek_tiny, folder, num_steps=STEPS, num_draft_tokens=STEPS + 1, log_dir=tmp_path, env=EAGLE_ENV
    ) as server:
        outputs = []
        for ids in prompt_ids:
            r = httpx.post(
                server.url + "/generate",
                timeout=600,
                json={
                    "input_ids": ids,
                    "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True},
                },
            )
            assert r.status_code == 200, f"{r.text[:500]}\n{server.log_tail()}"
            outputs.append(r.json())
        log = server.log_path.read_text(errors="replace")
    assert "skipping unexpected weight" not in log, server.log_tail()  # SGLang's loader skips silently otherwise

    target = load_reference(deepseek_tiny)
    with torch.no_grad():
        for ids, out in zip(prompt_ids, outputs):
            greedy = target.generate(
                torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, min_new_tokens=MAX_NEW_TOKENS, do_sample=False
            )
            assert out["output_ids"] == greedy[0, len(ids) :].tolist(), "speculative output differs from greedy"
    project = evaluate.acceptance_length(target, drafter, prompt_ids, POINTS, MAX_NEW_TOKENS, STEPS)
    llama_folder, llama_result = trained["llama"]
    llama = evaluate.acceptance_length(
        target, load_exported(llama_folder, deepseek_tiny), prompt_ids, POINTS, MAX_NEW_TOKENS, STEPS
    )
    sglang = acceptance(outputs)
    figures = {
        "steps": result.steps,
        "mla": {
            "sglang_acceptance": round(sglang, 4),
            "project_loop_acceptance": round(project["acceptance"], 4),
            "sglang_per_prompt": [round(o["meta_info"]["spec_accept_length"], 3) for o in outputs],
            "project_per_prompt": project["acceptance_per_prompt"],
            "simulated_acceptance": result.simulated_acceptance,
            "final_loss": result.final_loss,
        },
        "llama": {
            "project_loop_acceptance": round(llama["acceptance"], 4),
            "project_per_prompt": llama["acceptance_per_prompt"],
            "simulated_acceptance": llama_result.simulated_acceptance,
            "final_loss": llama_result.final_loss,
        },
    }
    print(f"\n[mla drafter vs llama layer, equal steps] {json.dumps(figures)}")
    assert result.steps == llama_result.steps == 160
    assert project["completion_tokens"] == sum(o["meta_info"]["completion_tokens"] for o in outputs)
    assert abs(sglang - project["acceptance"]) <= AGREEMENT_TOLERANCE, (sglang, project)
    assert result.simulated_acceptance > 2.0, f"the MLA drafter learnt little from the target's states: {result}"
    assert sglang > MAX_NEW_TOKENS / (MAX_NEW_TOKENS - 1) + 0.3, sglang  # clearly more than nothing accepted
