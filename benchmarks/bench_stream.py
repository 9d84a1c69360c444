"""Extract + train wall time: a streamed training (TrainConfig.stream) against the sequential one.

    .venv/bin/python -m benchmarks.bench_stream --out benchmarks/results/cpu-stream.json   # 48, 2 rounds
    .venv/bin/python -m benchmarks.bench_stream --quick      # 16 conversations, one epoch, one round

The same ShareGPT conversations are ingested once per mode and round (runs `seq<r>`,
`stream<r>`: the same shards) in a temporary filesystem store, then each mode is timed from the
first extraction to the trained drafter:
- sequential: every shard extracted (the pipeline's `extract` stage, `hf` engine), then trained;
- streamed: the shards extracted one after the other in one thread while the training starts,
  in another, as soon as the first shard is stored (the controller's `first_shards` rule) and
  follows them (epoch 0 in arrival order).
`--repeat` rounds run both modes, alternating which goes first, so that both see the machine's
drift; the figures are the rounds' medians.
Each mode's extraction and training get one torch thread each (OMP_NUM_THREADS=1, which the hf
engine keeps), as an extractor and a trainer worker would each have their own device: the
streamed mode overlaps them, the sequential one cannot. The target is `--model`, default the
embedded SmolLM2-135M (float32). Each mode's extraction engine (the target, loaded and checked
for its run) is built before its clock starts, as a running extractor worker already holds it:
both modes time the same work, and neither pays the target's load inside its extraction. Prints
the `aerie-benchmark/1` result (aerie.app.harness; --out FILE keeps it): the median wall times
and ratio; in its details, per round and mode, the extraction and training time, when the
training started, the steps (equal by construction) and the settings.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from aerie import stages
from aerie.app import harness
from aerie.app.harness import sharegpt_conversations
from aerie.contracts import ExtractRequest, IngestOptions, IngestRequest, TrainConfig, TrainRequest
from aerie.runs import load_run, shard_names
from aerie.settings import Settings
from aerie.store import FsStore
from aerie.target import smollm2
from aerie_extractor.extract import get_engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_arguments(ap)
    ap.add_argument("--model", default=None, help="target model folder (default: the embedded SmolLM2-135M)")
    ap.add_argument("--records", type=int, default=48, help="ShareGPT conversations")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--shard-sequences", type=int, default=4)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=2, help="rounds of both modes, alternating which goes first")
    args = ap.parse_args()
    if args.quick:
        args.records, args.epochs, args.repeat = 16, 1.0, 1
    model = args.model or str(smollm2(Path("~/.cache/aerie").expanduser()))

    os.environ["OMP_NUM_THREADS"] = "1"  # read by the hf engine: it keeps torch's one thread
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="aerie-bench-stream-"))
    store = FsStore(root)
    settings = Settings(
        store=f"file://{root}", engine="hf", device="cpu", tokens_per_batch=2048, ingest_local_dirs=[root]
    )
    dataset = root / "chats.jsonl"
    with open(dataset, "w") as f:
        for conv in sharegpt_conversations(args.records):
            turns = [{**t, "value": t["value"][:200]} if t.get("from") == "human" else t for t in conv]
            f.write(json.dumps({"conversations": turns}) + "\n")
    config = dict(
        draft_vocab_size=2048,
        draft_vocab_from="data",
        ttt_steps=3,
        batch_tokens=256,
        max_seq_tokens=args.max_tokens,
        epochs=args.epochs,
        checkpoint_every=10_000,
        holdout_fraction=0.05,
        eval_prompts=1,
        eval_new_tokens=8,
    )
    settings_out = {k: v for k, v in vars(args).items() if k != "out"} | {"model": model}
    result: dict = {
        "settings": {**settings_out, "config": config, "torch_threads_per_stage": 1},
        "torch": torch.__version__,
    }

    def one(mode: str, run: str) -> dict:
        shards = stages.ingest(
            store,
            settings,
            IngestRequest(
                run=run,
                dataset=str(dataset),
                model=model,
                engine="hf",
                dtype="float32",
                options=IngestOptions(
                    max_tokens=args.max_tokens, shard_tokens=args.shard_sequences * args.max_tokens, overlong="truncate"
                ),
            ),
        ).shards
        request = TrainRequest(
            runs=[run],
            drafter=f"bench-{run}",
            model=model,
            config=TrainConfig(**config, stream=mode == "streamed"),
            publish=False,
        )
        times: dict[str, float] = {}

        def extract_all() -> None:
            t = time.perf_counter()
            for shard in shards:
                stages.extract(store, settings, ExtractRequest(run=run, shard=shard))
            times["extract_s"] = time.perf_counter() - t

        get_engine(settings, load_run(store, run))  # the worker's engine, loaded before the clock starts
        t0 = time.perf_counter()
        if mode == "sequential":
            extract_all()
            t_train = time.perf_counter()
            trained = stages.train(store, settings, request)
        else:
            extractor = threading.Thread(target=extract_all)
            extractor.start()
            while not shard_names(store, run, "hidden"):  # the controller's first_shards rule
                time.sleep(0.05)
            t_train = time.perf_counter()
            trained = stages.train(store, settings, request)
            extractor.join()
        wall = time.perf_counter() - t0
        out = {
            "mode": mode,
            "wall_s": round(wall, 2),
            "extract_s": round(times["extract_s"], 2),
            "train_started_after_s": round(t_train - t0, 2),
            "train_s": round(time.perf_counter() - t_train, 2),
            "shards": len(shards),
            "steps": trained.steps,
            "final_loss": trained.final_loss,
        }
        print(json.dumps(out), file=sys.stderr, flush=True)
        return out

    rounds = []
    for r in range(args.repeat):  # the modes alternate which goes first: both see the machine's drift
        order = ("sequential", "streamed") if r % 2 == 0 else ("streamed", "sequential")
        got = {mode: one(mode, f"{'seq' if mode == 'sequential' else 'stream'}{r}") for mode in order}
        got["streamed_over_sequential_wall"] = round(got["streamed"]["wall_s"] / got["sequential"]["wall_s"], 3)
        rounds.append(got)
    result["rounds"] = rounds
    wall = {m: statistics.median(g[m]["wall_s"] for g in rounds) for m in ("sequential", "streamed")}
    figures = [
        harness.Figure("extract + train wall, sequential (median of rounds)", wall["sequential"], "s"),
        harness.Figure("extract + train wall, streamed (median of rounds)", wall["streamed"], "s"),
        harness.Figure(
            "extract + train wall, streamed / sequential (median of rounds)",
            statistics.median(g["streamed_over_sequential_wall"] for g in rounds),
            "x",
        ),
    ]
    harness.report(figures, args.out, result)


if __name__ == "__main__":
    main()
