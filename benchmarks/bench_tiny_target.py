"""Does the tests' tiny DeepSeek-V3 give a drafter something to learn, and does the drafter read its states?

    .venv/bin/python benchmarks/bench_tiny_target.py [--cache DIR] [--json out.json]

The target is tests/targets.py's (built into `--cache`, default the tests' cache), trained on as
tests/inference/test_sglang_deepseek_trained.py trains on it: 96 ShareGPT conversations of 128
tokens, its states at points [3, 4, 6] (`hf` engine, bf16), 160 steps of the `train` stage.
Printed:

- the target's next-token entropy over one chat prompt (nats; a flat distribution over the
  49,152-token vocabulary is ln 49152 = 10.80), and the cosine between consecutive layers' states;
- the train stage's final loss and held-out simulated acceptance;
- teacher-forced: the share of held-out positions (24 ShareGPT conversations after the first 500,
  up to 128 tokens each) where the drafter's first draft is the target's next token, fed the
  target's states at the points it was trained on ([3, 4, 6]), at the neighbouring layers the Llama
  id rule makes SGLang capture ([2, 3, 5]), one layer deeper ([4, 5, 7]), or zeros;
- the project's speculative loop (greedy, 3 draft steps, 32 new tokens) on the test's 4 prompts,
  fed [3, 4, 6] and [2, 3, 5].

`AERIE_BENCH_SEED` builds the target from another seed (tests/targets.py's SEED) into the cache.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
POINTS, NEIGHBOURS, DEEPER = [3, 4, 6], [2, 3, 5], [4, 5, 7]
PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Name three prime numbers.",
    "How do I boil an egg?",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", default=os.environ.get("AERIE_TEST_CACHE", os.path.expanduser("~/.cache/aerie")))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))

    import torch
    from transformers import AutoTokenizer

    import tests.targets as targets
    from aerie import stages
    from aerie.contracts import TrainConfig, TrainRequest
    from aerie.settings import Settings
    from aerie.store import FsStore
    from aerie.target import smollm2
    from aerie_trainer import evaluate
    from aerie_trainer.export import load_exported
    from tests.runs import held_out_chats, hidden_run_folder, upload_run

    seed = int(os.environ.get("AERIE_BENCH_SEED") or targets.SEED)
    cache = Path(args.cache)
    smol = smollm2(cache)
    folder = targets.deepseek_v3_tiny(cache, smol, seed)
    model = targets.load_reference(folder)
    tok = AutoTokenizer.from_pretrained(str(folder))

    def chat(messages, **kw) -> list[int]:
        ids = tok.apply_chat_template(messages, tokenize=True, **kw)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    prompt_ids = [chat([{"role": "user", "content": p}], add_generation_prompt=True) for p in PROMPTS]
    out: dict = {"target": folder.name, "seed": seed}
    with torch.no_grad():
        o = model(torch.tensor([prompt_ids[0]]), output_hidden_states=True)
        logp = o.logits[0].log_softmax(-1)
        out["entropy_nats"] = round(float(-(logp.exp() * logp).sum(-1).mean()), 3)
        out["flat_entropy_nats"] = round(math.log(o.logits.shape[-1]), 3)
        hs = o.hidden_states
        out["cosine_layer_to_next"] = [
            round(float(torch.cosine_similarity(hs[i][0], hs[i + 1][0], dim=-1).mean()), 3)
            for i in range(1, len(hs) - 1)
        ]

    with tempfile.TemporaryDirectory() as tmp:
        run = hidden_run_folder(cache, folder, records=96, max_tokens=128, shard_sequences=16, points=POINTS)
        store = FsStore(Path(tmp) / "store")
        upload_run(store, run, "ds")
        config = TrainConfig(
            draft_vocab_size=512,
            ttt_steps=3,
            steps=160,
            batch_tokens=512,
            max_seq_tokens=128,
            lr=3e-3,
            warmup_steps=8,
            checkpoint_every=80,
            eval_prompts=0,
            holdout_fraction=0.1,
        )
        result = stages.train(
            store,
            Settings(store=f"file://{store.root}"),
            TrainRequest(runs=["ds"], drafter="ds-eagle3", model=str(folder), config=config),
        )
        out["final_loss"], out["simulated_acceptance"] = (
            round(result.final_loss, 4),
            round(result.simulated_acceptance, 4),
        )
        drafter = load_exported(stages.pull(store, "ds-eagle3", Path(tmp) / "pulled"), folder)

        held_out = held_out_chats(tok, 24, 500, chars=400, max_tokens=128, min_tokens=16)
        n = out["held_out_positions"] = sum(len(ids) - 1 for ids in held_out)
        teacher_forced = {}
        for name, points in (
            ("trained_points", POINTS),
            ("neighbours", NEIGHBOURS),
            ("deeper", DEEPER),
            ("zeros", POINTS),
        ):
            shares = evaluate.first_draft_right(model, drafter, held_out, points, zero_states=name == "zeros")
            teacher_forced[name] = round(sum(a * (len(ids) - 1) for a, ids in zip(shares, held_out)) / n, 4)
        out["teacher_forced_top1"] = teacher_forced
        for name, points in (("trained_points", POINTS), ("neighbours", NEIGHBOURS)):
            r = evaluate.acceptance_length(model, drafter, prompt_ids, points, 32, 3)
            out[f"acceptance_{name}"] = {
                "acceptance": round(r["acceptance"], 4),
                "per_prompt": r["acceptance_per_prompt"],
            }
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
