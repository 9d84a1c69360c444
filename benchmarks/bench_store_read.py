"""How fast a training rank can read hidden-state shards from the S3 store, and how that scales
with readers: N processes (each its own S3Store, as each rank is) download distinct objects at
once through `ObjectStore.download` — the trainer's own path (data.py: stream, sha256, file) —
and the aggregate and per-process rates are reported beside the rate 8 training GPUs consume.

The store is the one the environment names (AERIE_STORE, AERIE_BUCKET, AERIE_S3_ACCESS_KEY,
AERIE_S3_SECRET_KEY); the objects go under a fresh `bench-read-*/` prefix and are deleted after.
What 8 GPUs consume: tokens per second per GPU (from BENCHMARKS.md's measured step, `--tokens-per-s`)
x bytes a token (K captured states of H, `--state-bytes` per value: 2 bf16, 1 fp8, plus the final
state) x 8.

    source /tmp/s3w/s3.env
    AERIE_STORE=$AERIE_TEST_S3_ENDPOINT AERIE_S3_ACCESS_KEY=$AERIE_TEST_S3_ACCESS_KEY \\
      AERIE_S3_SECRET_KEY=$AERIE_TEST_S3_SECRET_KEY AERIE_BUCKET=bench-read \\
      python benchmarks/bench_store_read.py --out benchmarks/results/cpu-2026-12-05-store-read.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import secrets
import tempfile
import time
from pathlib import Path

MB = 1 << 20


def _reader(keys: list[str], start, out) -> None:
    from aerie.store import open_store

    store = open_store()
    with tempfile.TemporaryDirectory() as tmp:
        start.wait()
        t0 = time.perf_counter()
        total = 0
        for i, key in enumerate(keys):
            path = Path(tmp) / f"{i}.bin"
            store.download(key, path)
            total += path.stat().st_size
            path.unlink()
        out.put((total, time.perf_counter() - t0))


def run(store, keys: list[str], readers: int) -> dict:
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(readers + 1), ctx.Queue()
    per = [keys[i::readers] for i in range(readers)]
    procs = [ctx.Process(target=_reader, args=(p, start, out)) for p in per]
    for p in procs:
        p.start()
    start.wait()
    t0 = time.perf_counter()
    results = [out.get() for _ in procs]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join()
    total = sum(b for b, _ in results)
    return {
        "readers": readers,
        "bytes": total,
        "seconds": round(wall, 3),
        "aggregate_mb_s": round(total / MB / wall, 1),
        "per_process_mb_s": [round(b / MB / s, 1) for b, s in results],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--objects", type=int, default=8, help="objects per round (divided over the readers)")
    ap.add_argument("--object-mb", type=int, default=32)
    ap.add_argument("--readers", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens-per-s", type=float, default=27_300.0, help="one GPU's training tokens/s")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--states", type=int, default=4, help="K captured states + the final state")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from aerie.store import open_store

    store = open_store(create_bucket=True)
    prefix = f"bench-read-{secrets.token_hex(4)}/"
    data = os.urandom(args.object_mb * MB)
    keys = [f"{prefix}{i}.bin" for i in range(args.objects)]
    for key in keys:
        store.put_bytes(key, data)
    rows = []
    try:
        for _ in range(args.rounds):
            for n in (int(x) for x in args.readers.split(",")):
                rows.append(run(store, keys, n))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        store.delete_prefix(prefix)
    need = {
        f"{name}_8gpus_mb_s": round(8 * args.tokens_per_s * args.states * args.hidden * b / MB, 1)
        for name, b in (("bf16", 2), ("fp8", 1))
    }
    best = {n: max(r["aggregate_mb_s"] for r in rows if r["readers"] == n) for n in {r["readers"] for r in rows}}
    result = {
        "command": "python benchmarks/bench_store_read.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "cpu_count": os.cpu_count(),
        "object_mb": args.object_mb,
        "rows": rows,
        "best_aggregate_mb_s": best,
        "consumption": {
            "tokens_per_s_per_gpu": args.tokens_per_s,
            "bytes_per_token_bf16": args.states * args.hidden * 2,
            **need,
        },
    }
    print(json.dumps({k: result[k] for k in ("best_aggregate_mb_s", "consumption")}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
