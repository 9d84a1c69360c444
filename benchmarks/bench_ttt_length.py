"""Two training-time-test lengths side by side at equal training wall time (CPU).

    .venv/bin/python -m benchmarks.bench_ttt_length --model ~/.cache/aerie/SmolLM2-135M-Instruct-bf16 \\
        --budget-s 150 --json benchmarks/results/cpu-ttt-length.json

The serving chain is `--chain` draft steps (SGLang's --speculative-num-steps, default 3); the arms
train TTT lengths chain + each of `--margins` (default 1 and 4: 4 and 7 steps) on one ShareGPT run
extracted here first (SmolLM2-135M, `hf` engine, the pipeline's own stages: `build_run`). Each
arm is first timed over `--calibrate` steps, then trained anew for as many steps as fit
`--budget-s` seconds at that step time, and measured the way the job measures a drafter: the
project's speculative-decoding loop (chain of `eval_draft_tokens` = the serving chain, greedy, on
held-out prompts) and the held-out simulated acceptance. Prints one JSON object (also --json):
per arm its TTT length, step time, steps, train seconds, final loss and acceptance figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

from aerie import stages
from aerie.app.harness import sharegpt_conversations
from aerie.contracts import ExtractRequest, IngestOptions, IngestRequest, TrainConfig, TrainRequest
from aerie.settings import Settings
from aerie.store import FsStore


def build_run(store: FsStore, settings: Settings, root: Path, model: str, records: int) -> None:
    """Run `r`: ShareGPT conversations (user turns cut to 200 characters) ingested and extracted by
    the pipeline's own stages with the `hf` engine, 96 tokens a sequence, 4 sequences a shard."""
    dataset = root / "chats.jsonl"
    with open(dataset, "w") as f:
        for conv in sharegpt_conversations(records):
            turns = [{**t, "value": t["value"][:200]} if t.get("from") == "human" else t for t in conv]
            f.write(json.dumps({"conversations": turns}) + "\n")
    options = IngestOptions(max_tokens=96, shard_tokens=4 * 96, overlong="truncate")
    request = IngestRequest(run="r", dataset=str(dataset), model=model, engine="hf", options=options)
    for shard in stages.ingest(store, settings, request).shards:
        stages.extract(store, settings, ExtractRequest(run="r", shard=shard))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="target model folder (SmolLM2-135M-Instruct)")
    ap.add_argument("--chain", type=int, default=3, help="serving chain's draft steps")
    ap.add_argument("--margins", default="1,4", help="TTT margins over the chain, one arm each")
    ap.add_argument("--budget-s", type=float, default=150.0, help="training seconds per arm")
    ap.add_argument("--calibrate", type=int, default=4, help="steps timed to size each arm")
    ap.add_argument("--records", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="aerie-bench-ttt-"))
    store = FsStore(root)
    settings = Settings(store=f"file://{root}", engine="hf", device="cpu", ingest_local_dirs=[root])
    build_run(store, settings, root, args.model, args.records)
    base = dict(
        speculative_num_steps=args.chain,
        draft_vocab_size=2048,
        batch_tokens=256,
        max_seq_tokens=96,
        lr=3e-3,
        grad_clip=1.0,
        warmup_steps=2,
        checkpoint_every=100_000,
        holdout_fraction=0.2,
        eval_prompts=4,
        eval_new_tokens=32,
        eval_draft_tokens=args.chain,
    )

    def train(tag: str, ttt: int, steps: int) -> dict:
        config = TrainConfig(**base, ttt_steps=ttt, steps=steps)
        request = TrainRequest(
            runs=["r"], drafter="bench", model=args.model, config=config, train_id=tag, publish=False
        )
        r = stages.train(store, settings, request)
        return {**r.model_dump(), "train_seconds": r.tokens / r.tokens_per_second}

    arms = []
    for margin in [int(m) for m in args.margins.split(",")]:
        ttt = args.chain + margin
        cal = train(f"cal-{ttt}", ttt, args.calibrate)
        step_s = cal["train_seconds"] / cal["steps"]
        steps = max(1, round(args.budget_s / step_s))
        m = train(f"arm-{ttt}", ttt, steps)
        arm = {
            "margin": margin,
            "ttt_steps": ttt,
            "calibrated_step_s": round(step_s, 3),
            "steps": m["steps"],
            "train_seconds": round(m["train_seconds"], 1),
            "step_s": round(m["train_seconds"] / m["steps"], 3),
            "final_loss": round(m["final_loss"], 4),
            **{k: m.get(k) for k in ("acceptance", "simulated_acceptance", "acceptance_untrained", "evaluation_note")},
        }
        arms.append(arm)
        print(arm, file=sys.stderr, flush=True)
    result = {
        "settings": {**vars(args), "config": base},
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
        },
        "arms": arms,
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
