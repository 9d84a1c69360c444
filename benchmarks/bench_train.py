"""Trainer throughput: tokens/s and the fraction of step time spent waiting for data.

    # on runs already in the store (AERIE_STORE etc.), e.g. after the main job:
    python benchmarks/bench_train.py --runs sharegpt --model ~/.cache/aerie/SmolLM2-135M-Instruct-bf16

    # on shards of random hidden states with the target's shapes (throughput does not depend on
    # the values), written to a temporary filesystem store or to AERIE_STORE with --in-store:
    python benchmarks/bench_train.py --synthetic 8 --model M [--device cuda] [--steps 50]

    # a target folder of random weights with a named shape (config, embeddings, lm_head only),
    # e.g. Llama-3.1-8B's, for a drafter of realistic size on a GPU:
    python benchmarks/bench_train.py --synthetic 4 --synthetic-target llama3-8b --device cuda

    # the same trainer wrapped as the job's ranks wrap it (DDP, or FSDP2's fully_shard), in a
    # process group of one (NCCL on a GPU, gloo on the CPU) or under torchrun:
    python benchmarks/bench_train.py --synthetic 4 --synthetic-target llama3-8b --device cuda --sharding fsdp

    # small sizes on the CPU (SmolLM2's shapes, one synthetic shard): does it run
    python -m benchmarks.bench_train --quick --out result.json

Prints one JSON line (its last line: the device scripts read it): tokens/s over the timed steps
(after --warmup steps), mean step time, data wait fraction (goal < 5%), and the settings it ran
with. `--out FILE` also writes the harness's result (aerie.app.harness) there.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np

from aerie import layout
from aerie.app import harness
from aerie.capture import convention_for, default_capture_points
from aerie.contracts import EngineSpec, IngestOptions, RunSpec, ShardRecord, TrainConfig, TrainRequest
from aerie.settings import Settings
from aerie.shard import pack
from aerie.store import FsStore, open_store
from aerie.target import describe


def synthetic_run(store, model: str, run: str, shards: int, seq_tokens: int, shard_tokens: int, seed: int = 0) -> None:
    """Shards of random bf16 states shaped like the target's (K=3 points, H), real-looking ids."""
    import ml_dtypes

    target = describe(model)
    points = default_capture_points(target.num_layers)
    rng = np.random.default_rng(seed)
    engine = EngineSpec(
        name="hf", version="synthetic", convention=convention_for("hf", target.architecture), layer_ids=points
    )
    for s in range(shards):
        seqs = []
        for _ in range(max(1, shard_tokens // seq_tokens)):
            T = seq_tokens
            seqs.append(
                {
                    "input_ids": rng.integers(0, target.vocab_size, T, dtype=np.int32),
                    "loss_mask": (np.arange(T) > T // 8).astype(np.uint8),
                    "aux": rng.standard_normal((T, len(points), target.hidden_size), dtype=np.float32).astype(
                        ml_dtypes.bfloat16
                    ),
                    "final": rng.standard_normal((T, target.hidden_size), dtype=np.float32).astype(ml_dtypes.bfloat16),
                }
            )
        shard = pack(seqs, points)
        name = layout.shard_name(s)
        data = shard.to_bytes()
        sha = store.put_bytes(layout.shard(run, "hidden", name), data)
        store.put_json(
            layout.shard_record(run, "hidden", name),
            ShardRecord(
                run=run,
                shard=name,
                kind="hidden",
                key=layout.shard(run, "hidden", name),
                sha256=sha,
                bytes=len(data),
                sequences=shard.num_sequences,
                tokens=shard.num_tokens,
                loss_tokens=int(shard.loss_mask.sum()),
                engine=engine,
            ),
        )
    store.put_json(
        layout.run_spec(run),
        RunSpec(
            run=run, dataset="synthetic", target=target, engine=engine, capture_points=points, ingest=IngestOptions()
        ),
    )


SHAPES = {  # hidden, intermediate, heads, kv heads, vocab, layers
    "llama3-8b": (4096, 14336, 32, 8, 128256, 32),
    "smollm2-135m": (576, 1536, 9, 3, 49152, 30),
}


def synthetic_target(shape: str, folder: str) -> str:
    """A target folder holding only what the trainer reads: config, embeddings, lm_head."""
    import os

    import torch
    from safetensors.torch import save_file

    H, I, nh, nkv, V, N = SHAPES[shape]
    os.makedirs(folder, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": I,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "num_hidden_layers": N,
        "vocab_size": V,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "max_position_embeddings": 8192,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        f.write("{}")  # hashed by describe(), never used
    g = torch.Generator().manual_seed(0)
    save_file(
        {
            "model.embed_tokens.weight": (torch.randn(V, H, generator=g) * 0.02).bfloat16(),
            "lm_head.weight": (torch.randn(V, H, generator=g) * 0.02).bfloat16(),
        },
        os.path.join(folder, "model.safetensors"),
    )
    return folder


def dist_for(sharding: str, device: str):
    """The job's Dist; for DDP/FSDP outside torchrun, a process group of one on this device (so
    the wrapped path, its NCCL or gloo collectives included, runs on a single GPU)."""
    import os

    import torch

    from aerie_trainer.parallel import Dist, setup_dist

    if sharding == "single" or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return setup_dist(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    cuda = device.startswith("cuda")
    torch.distributed.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    dev = torch.device(device if not cuda or ":" in device else "cuda:0")
    if cuda:
        torch.cuda.set_device(dev)
    return Dist(0, 1, dev)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="*", default=[])
    ap.add_argument("--model", help="target model folder")
    ap.add_argument(
        "--synthetic-target", choices=sorted(SHAPES), help="random target weights of this shape instead of --model"
    )
    ap.add_argument("--synthetic", type=int, default=0, help="write this many random shards and train on them")
    ap.add_argument("--in-store", action="store_true", help="write synthetic shards to AERIE_STORE, not a temp folder")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--seq-tokens", type=int, default=512)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument(
        "--sharding",
        choices=("single", "ddp", "fsdp"),
        default="single",
        help="wrap the drafter as the job's ranks do (a process group of one unless under torchrun)",
    )
    harness.add_arguments(ap)
    args = ap.parse_args()
    if args.quick:
        args.synthetic, args.steps, args.warmup = max(args.synthetic, 1), 3, 1
        args.batch_tokens, args.seq_tokens, args.draft_vocab, args.ttt_steps = 512, 128, 1024, 2

    from aerie_trainer.trainer import Trainer

    if args.synthetic_target:
        args.model = synthetic_target(args.synthetic_target, tempfile.mkdtemp(prefix="aerie-target-"))
    settings = Settings.load(device=args.device)
    if not args.model and args.quick:
        from aerie.target import smollm2

        args.model = str(smollm2(settings.cache_dir))
    if not args.model:
        ap.error("--model or --synthetic-target is required")
    store = (
        open_store(settings)
        if (args.in_store or not args.synthetic)
        else FsStore(tempfile.mkdtemp(prefix="aerie-bench-"))
    )
    runs = list(args.runs)
    if args.synthetic:
        synthetic_run(store, args.model, "bench-synthetic", args.synthetic, args.seq_tokens, 8 * args.batch_tokens)
        runs = ["bench-synthetic"]
    cfg = TrainConfig(
        draft_vocab_size=args.draft_vocab,
        ttt_steps=args.ttt_steps,
        steps=args.warmup + args.steps,
        batch_tokens=args.batch_tokens,
        max_seq_tokens=args.seq_tokens,
        checkpoint_every=10**9,
        eval_prompts=0,
        holdout_fraction=0.0,
        warmup_steps=2,
    )
    request = TrainRequest(
        runs=runs, drafter="bench", model=args.model, config=cfg, train_id=f"bench-{time.time_ns()}", publish=False
    )
    trainer = Trainer(store, request, dist_for(args.sharding, settings.device), sharding=args.sharding, trackers=[])
    trainer.save = lambda: None  # a benchmark does not checkpoint

    marks = {}

    def progress(event) -> None:
        if event.stage == "train" and event.step == args.warmup:
            if trainer.dist.device.type == "cuda":
                import torch

                torch.cuda.synchronize()
            marks["t"], marks["tokens"], marks["wait"] = time.perf_counter(), event.tokens, trainer.data.wait_s

    trainer.progress = progress
    state = trainer.train()
    if trainer.dist.device.type == "cuda":
        import torch

        torch.cuda.synchronize()
    elapsed = time.perf_counter() - marks["t"]
    tokens = state.tokens - marks["tokens"]
    wait = trainer.data.wait_s - marks["wait"]
    line = {
        "tokens_per_s": round(tokens / elapsed, 1),
        "step_s": round(elapsed / args.steps, 4),
        "data_wait_fraction": round(wait / elapsed, 4),
        "device": str(trainer.dist.device),
        "store": store.url.split("://")[0],
        "sharding": args.sharding,
        "batch_tokens": args.batch_tokens,
        "ttt_steps": args.ttt_steps,
        "draft_vocab": cfg.draft_vocab_size,
        "timed_steps": args.steps,
        "runs": runs,
        "final_loss": round(state.losses[-1], 4),
    }
    harness.report(
        [
            harness.Figure("trainer throughput", line["tokens_per_s"], "tok/s"),
            harness.Figure("share of step time waiting for data", line["data_wait_fraction"], "", "< 0.05"),
        ],
        args.out,
        details=line,
        echo=False,
    )
    print(json.dumps(line))


if __name__ == "__main__":
    main()
