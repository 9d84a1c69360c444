"""Training-time-test lengths side by side at equal training wall time (CPU).

    .venv/bin/python -m benchmarks.bench_ttt_length --budget-s 75 \\
        --out benchmarks/results/cpu-2026-12-06-ttt-length.json

The serving chain is `--chain` draft steps (SGLang's --speculative-num-steps, default 3); one arm
per margin of `--margins` (default 1 and 4: TTT 4 and 7, the chain plus TrainConfig's TTT_MARGIN)
trains on one ShareGPT run extracted here first (the target, default the embedded SmolLM2-135M, the
`hf` engine, the pipeline's own stages: `build_run`).

Equal wall time: a longer unroll costs more per step, so the arms are given the same training
seconds, not the same steps. Each arm's step time is measured first (`--calibrate` steps, the arms
alternating for `--rounds` rounds so that both see the machine's load alike; the median round),
then each arm is trained anew from scratch for the steps that fit `--budget-s` at its step time
(its own learning-rate schedule over those steps). The training seconds each arm really took are
reported beside the budget: on a shared machine they drift with the load, the steps do not.

Each trained drafter is measured the way a training job measures one: the project's
speculative-decoding loop (greedy, a chain of `--chain` drafts as the serving engine would run,
the target in transformers) on held-out conversations' prompts, and the held-out per-step top-1
accuracy. The held-out simulated acceptance is not compared: it counts a chain of each arm's own
TTT length. Prints the `aerie-benchmark/1` result (aerie.app.harness; --out FILE keeps it): the
arms' acceptance and step time side by side and, per arm, its TTT length, step time, steps,
training seconds, final loss, acceptance before and after, per-step accuracy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from aerie import stages
from aerie.app import harness
from aerie.app.harness import sharegpt_conversations
from aerie.contracts import ExtractRequest, IngestOptions, IngestRequest, TrainConfig, TrainRequest
from aerie.settings import Settings
from aerie.store import FsStore
from aerie.target import smollm2


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
    harness.add_arguments(ap)
    ap.add_argument("--model", default=None, help="target model folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--chain", type=int, default=3, help="serving chain's draft steps")
    ap.add_argument("--margins", default="1,4", help="TTT margins over the chain, one arm each")
    ap.add_argument("--budget-s", type=float, default=75.0, help="training seconds per arm")
    ap.add_argument("--calibrate", type=int, default=6, help="steps timed to size each arm")
    ap.add_argument("--rounds", type=int, default=2, help="calibration rounds, the arms alternating")
    ap.add_argument("--records", type=int, default=48, help="ShareGPT conversations in the run")
    ap.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts the loop decodes")
    ap.add_argument("--eval-new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0, help="TrainConfig.seed: the drafter's init and data order")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args()
    if args.quick:
        args.budget_s, args.records, args.calibrate, args.rounds = 6.0, 16, 2, 1
        args.eval_prompts, args.eval_new_tokens = 2, 16

    torch.set_num_threads(args.threads)
    model = args.model or str(smollm2(Path("~/.cache/aerie").expanduser()))
    root = Path(tempfile.mkdtemp(prefix="aerie-bench-ttt-"))
    store = FsStore(root)
    settings = Settings(store=f"file://{root}", engine="hf", device="cpu", ingest_local_dirs=[root])
    build_run(store, settings, root, model, args.records)
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
        eval_prompts=args.eval_prompts,
        eval_new_tokens=args.eval_new_tokens,
        eval_draft_tokens=args.chain,
        seed=args.seed,
    )

    def train(tag: str, ttt: int, steps: int, evaluate: bool = True) -> dict:
        config = TrainConfig(**{**base, **({} if evaluate else {"eval_prompts": 0})}, ttt_steps=ttt, steps=steps)
        request = TrainRequest(runs=["r"], drafter="bench", model=model, config=config, train_id=tag, publish=False)
        r = stages.train(store, settings, request)
        return {**r.model_dump(), "train_seconds": (r.tokens or 0) / (r.tokens_per_second or 1.0)}

    ttts = [args.chain + int(m) for m in args.margins.split(",")]
    calibration: dict[int, list[float]] = {t: [] for t in ttts}
    for n in range(args.rounds):
        for ttt in ttts:
            cal = train(f"cal-{ttt}-{n}", ttt, args.calibrate, evaluate=False)
            calibration[ttt].append(cal["train_seconds"] / cal["steps"])
            print(f"calibration round {n}, TTT {ttt}: {calibration[ttt][-1]:.3f} s/step", file=sys.stderr, flush=True)

    arms = []
    for ttt in ttts:
        step_s = statistics.median(calibration[ttt])
        steps = max(1, round(args.budget_s / step_s))
        m = train(f"arm-{ttt}", ttt, steps)
        arm = {
            "margin": ttt - args.chain,
            "ttt_steps": ttt,
            "calibrated_step_s": round(step_s, 4),
            "calibration_step_s": [round(s, 4) for s in calibration[ttt]],
            "steps": m["steps"],
            "train_seconds": round(m["train_seconds"], 1),
            "step_s": round(m["train_seconds"] / m["steps"], 4),
            "final_loss": round(m["final_loss"], 4),
            "acceptance": m.get("acceptance"),
            "acceptance_untrained": m.get("acceptance_untrained"),
            "heldout_acc": m.get("heldout_acc"),
            "heldout_acc_chain": (m.get("heldout_acc") or [])[: args.chain],
            "evaluated_with": m.get("evaluated_with"),
        }
        arms.append(arm)
        print(json.dumps(arm), file=sys.stderr, flush=True)

    short, long = arms[0], arms[-1]
    figures = [
        harness.Figure(f"served-loop acceptance length, TTT {a['ttt_steps']}, chain {args.chain}", a["acceptance"])
        for a in arms
    ]
    figures += [harness.Figure(f"step time, TTT {a['ttt_steps']}", a["step_s"], "s") for a in arms]
    if len(arms) > 1 and short["acceptance"] and long["acceptance"]:
        figures.append(
            harness.Figure(
                f"acceptance TTT {long['ttt_steps']} / TTT {short['ttt_steps']}, equal training seconds",
                round(long["acceptance"] / short["acceptance"], 3),
                "x",
            )
        )
        figures.append(
            harness.Figure(
                f"step time TTT {long['ttt_steps']} / TTT {short['ttt_steps']}",
                round(long["step_s"] / short["step_s"], 3),
                "x",
            )
        )
    details = {
        "settings": {**{k: v for k, v in vars(args).items() if k != "out"}, "model": model, "config": base},
        "torch": torch.__version__,
        "arms": arms,
    }
    harness.report(figures, args.out, details)


if __name__ == "__main__":
    main()
