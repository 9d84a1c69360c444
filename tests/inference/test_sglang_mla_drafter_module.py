"""aerie's MLA drafter against SGLang's own module, call by call, on the same weights and inputs.

An MLA drafter built and exported by aerie (`--drafter-arch mla`, random weights scaled up so
every path matters) is served by SGLang 0.5.23 on the CPU beside the tiny DeepSeek-V3, with
`sglang_draft_dump/sitecustomize.py` recording each call of SGLang's
`Eagle3DeepseekV2ForCausalLM.forward` (the inputs SGLang hands it and the logits and hidden
states it returns). The same exported folder, loaded by aerie (`load_exported`), is run on those
inputs: the draft extend over the prompt (SGLang: MLA prefill over expanded heads; aerie: one
causal pass) and the chain of draft decode steps after it (SGLang: absorbed attention over the
latent cache; aerie: the prefix keys plus the chain's own), and every call's logits and output
hidden states must agree to float32 rounding.
"""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from safetensors import safe_open

from tests.services import REPO
from tests.sglang_server import serve_server

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

POINTS = [3, 4, 6]
STEPS = 3
PROMPT = list(range(300, 340))
EAGLE_ENV = {"TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}


def test_sglangs_mla_drafter_module_computes_what_aerie_computes(deepseek_tiny, tmp_path):
    from aerie.contracts import DrafterShape
    from aerie_trainer.export import export, load_exported
    from aerie_trainer.model import build_drafter, load_target_config

    torch.manual_seed(5)
    drafter = build_drafter(deepseek_tiny, num_aux=len(POINTS), draft_vocab_size=512, shape=DrafterShape(arch="mla"))
    with torch.no_grad():
        for p in drafter.parameters():
            if p.requires_grad and p.ndim == 2:
                p.normal_(std=0.15)
            elif p.requires_grad:
                p.uniform_(0.5, 1.5)  # norms: not ones, so a norm read from the wrong tensor shows
    drafter.set_vocab(torch.arange(7, 7 + 3 * 512, 3))
    folder = export(drafter, tmp_path / "mla-drafter", POINTS, load_target_config(deepseek_tiny))
    dump = tmp_path / "dump"
    dump.mkdir()
    env = EAGLE_ENV | {
        "AERIE_DRAFT_DUMP": str(dump),
        "PYTHONPATH": f"{REPO / 'tests' / 'inference' / 'sglang_draft_dump'}:{REPO / 'services' / 'inference'}",
    }
    with serve_server(
        deepseek_tiny, folder, num_steps=STEPS, num_draft_tokens=STEPS + 1, log_dir=tmp_path, env=env
    ) as server:
        r = httpx.post(
            server.url + "/generate",
            timeout=600,
            json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}},
        )
        assert r.status_code == 200, f"{r.text[:500]}\n{server.log_tail()}"
    calls = []
    for path in sorted(dump.glob("call-*.safetensors")):
        with safe_open(path, framework="pt") as f:
            calls.append((f.metadata()["mode"], {k: f.get_tensor(k) for k in f.keys()}))
    modes = [m for m, _ in calls]
    print(f"\n[sglang mla drafter calls] {json.dumps(modes)}")
    assert calls, "SGLang's MLA drafter was never called (or the dump hook did not load)"

    ours = load_exported(folder, deepseek_tiny)  # float32, as the server computes (--dtype float32)
    shapes = [(m, len(t["input_ids"]), t["positions"].tolist()[:1], tuple(t["logits"].shape)) for m, t in calls[:8]]
    print(f"[sglang mla drafter] first calls (mode, rows, first position, logits): {shapes}")
    # the request's draft extend over the prompt (after any warm-up request's): slot j reads token j+1
    at = max(i for i, (m, t) in enumerate(calls) if m == "EXTEND" and len(t["input_ids"]) == len(PROMPT))
    mode, t = calls[at]
    assert t["input_ids"][:-1].tolist() == PROMPT[1:] and t["positions"].tolist() == list(range(len(PROMPT)))
    with torch.no_grad():
        logits, hidden, kv = ours(t["input_ids"][None], ours.project(t["hidden_in"][None]), t["positions"])
    diffs = [check(logits[0], hidden[0], t)]
    compared = [mode]
    # the draft decode steps that follow: one token each, attending to the prompt's keys and the
    # chain's (SGLang: absorbed attention over its latent cache)
    chain, everything = [], torch.ones(1, len(PROMPT), dtype=torch.bool)
    for mode, t in calls[at + 1 : at + STEPS]:
        assert mode == "DECODE" and len(t["input_ids"]) == 1, (mode, shapes)
        with torch.no_grad():
            logits, hidden, step_kv = ours(
                t["input_ids"][None],
                t["hidden_in"][None],
                t["positions"],
                prefix=kv,
                prefix_mask=everything,
                chain=chain,
            )
        chain.append(step_kv)
        diffs.append(check(logits[0], hidden[0], t))
        compared.append(mode)
    # the draft extend after the first verify: the verified rows, over the prompt's keys, causal
    mode, t = calls[at + STEPS]
    assert mode.startswith("DRAFT_EXTEND") and t["positions"].tolist()[0] == len(PROMPT), (mode, shapes)
    with torch.no_grad():
        logits, hidden, _ = ours(t["input_ids"][None], ours.project(t["hidden_in"][None]), t["positions"], past=kv)
    diffs.append(check(logits[0], hidden[0], t))
    compared.append(mode)
    print(
        f"[sglang mla drafter] equal to aerie's on calls {compared} (prompt of {len(PROMPT)} tokens); "
        f"max abs diff of logits / hidden per call {diffs}"
    )


def check(logits: torch.Tensor, hidden: torch.Tensor, call: dict) -> tuple[float, float | None]:
    """aerie's rows (T, Vd) / (T, H) against the rows SGLang returned (its last rows, or all);
    -> the largest absolute differences."""
    n = call["logits"].shape[0]
    torch.testing.assert_close(logits[-n:], call["logits"], rtol=1e-4, atol=1e-4)
    if "hidden_out" not in call:
        return float((logits[-n:] - call["logits"]).abs().max()), None
    m = call["hidden_out"].shape[0]
    torch.testing.assert_close(hidden[-m:], call["hidden_out"], rtol=1e-4, atol=1e-4)
    return float((logits[-n:] - call["logits"]).abs().max()), float((hidden[-m:] - call["hidden_out"]).abs().max())
