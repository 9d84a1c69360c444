"""The seed's failure in miniature, measured in real SGLang: a drafter trained on the unquantized
target's states, served on the quantized target, against one trained on the quantized target's.

The story (issue 19): a drafter is trained on states of one configuration and served on another.
Here both drafters serve the same 3-bit quantized SmolLM2 (tests/quantized.py, one scale per
output row; dequantized, float32 in SGLang), on the same 12 prompts (six of the serving tests',
the first six MT-bench questions), greedy, 64 new tokens (past an end of text: the 3-bit model ends
one MT-bench answer at its first token), 3 draft steps, and SGLang reports the
acceptance (completion tokens / verify steps):
- mismatched: the shared trained drafter (tests/trained.py), trained on the *unquantized* states;
  `aerie align` of such a run against a quantized server fails (test_align.py);
- matched: its twin, the same conversations and training, states and target signal taken from
  the *quantized* weights (`trained_on_quantized`, cached like the shared one).

Why 3 bits: at 4 bits per output row these small drafters (first draft right at ~0.19 of
held-out positions) lose too little to measure. Teacher-forced over 10,414 held-out positions
(benchmarks/reports/history-2026-12.md, "What the mismatch costs"), the twin's first
draft is right at 0.182 against the shared drafter's 0.178 at 4 bits (+0.002 per conversation, sd
0.025); at 3 bits 0.232 against 0.116 (+0.117, sd 0.053, the twin ahead on all 60 conversations).
The earlier 4-bit version of this test measured served gaps of +0.075, +0.059 and +0.015 on three
machines: noise around a small effect.

Cost: training the twin (once per trainer source: 157-196 s on 2 idle cores) and two servers side by
side (a start is mostly one core importing SGLang), each with its prompts in flight at once (one
batch per verify step instead of one per prompt; measured on the random drafter: outputs and
verify counts identical to one prompt at a time, 43.4 s -> 13.5 s for six).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.inference.test_serve_drafter import EAGLE_ENV, NUM_DRAFT_TOKENS, PROMPTS, VERIFY_STEPS, acceptance, generate
from tests.sglang_server import serve_server

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

MORE_PROMPTS = [
    "Explain how a bicycle works.",
    "What are the benefits of regular exercise?",
    "Summarize the plot of Romeo and Juliet.",
]
BITS = 3
GAP = 0.05  # least acceptance gap, matched minus mismatched, over 12 prompts x 64 tokens


def chat_ids(model, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    out = [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
        for t in texts
    ]
    return [list(ids["input_ids"] if hasattr(ids, "keys") else ids) for ids in out]


@pytest.mark.timeout(3600)  # builds the shared drafter and its twin when their cache is cold
def test_on_a_quantized_target_the_drafter_trained_on_its_states_accepts_more(
    cache_dir, smollm2_path, trained_smol, tmp_path
):
    from aerie.app.bench import load_prompts
    from tests.quantized import PER_CHANNEL, smollm2_quantized, trained_on_quantized

    started = time.monotonic()
    target = smollm2_quantized(cache_dir, smollm2_path, PER_CHANNEL, BITS)
    matched = trained_on_quantized(cache_dir, smollm2_path, PER_CHANNEL, BITS)
    built_s = time.monotonic() - started
    prompts = chat_ids(smollm2_path, PROMPTS + MORE_PROMPTS + [p.turns[0] for p in load_prompts(limit=6)])

    def serve(name: str, drafter) -> dict:
        with serve_server(
            target,
            drafter.folder,
            num_steps=VERIFY_STEPS,
            num_draft_tokens=NUM_DRAFT_TOKENS,
            log_dir=tmp_path / name,
            env=EAGLE_ENV,
        ) as server:
            with ThreadPoolExecutor(len(prompts)) as pool:  # all prompts in flight: decoded as one batch
                outputs = list(pool.map(lambda ids: generate(server.url, [ids], ignore_eos=True)[0], prompts))
        return {
            "acceptance": acceptance(outputs),
            "outputs": [o["output_ids"] for o in outputs],
            "per_prompt": [round(o["meta_info"]["spec_accept_length"], 4) for o in outputs],
        }

    with ThreadPoolExecutor(2) as pool:  # both servers at once
        futures = {
            name: pool.submit(serve, name, drafter)
            for name, drafter in (("matched", matched), ("mismatched", trained_smol))
        }
        measured = {name: future.result() for name, future in futures.items()}
    gap = measured["matched"]["acceptance"] - measured["mismatched"]["acceptance"]
    print(
        f"\n[quantized target, per-channel INT{BITS}] "
        + json.dumps(
            {
                **{name: {k: v for k, v in m.items() if k != "outputs"} for name, m in measured.items()},
                "gap": round(gap, 4),
                "twin_train_wall_s": matched.result.get("train_wall_s"),
                "build_s": round(built_s, 1),
                "test_s": round(time.monotonic() - started, 1),
            }
        )
    )
    # both verify against the same target: the text is its greedy text either way
    assert measured["matched"]["outputs"] == measured["mismatched"]["outputs"]
    assert gap > GAP, measured
