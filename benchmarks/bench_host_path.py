"""Host work per extracted shard, without the model: what runs on the CPU after the forward.

    .venv/bin/python benchmarks/bench_host_path.py [--tokens 65536] [--repeat 5]

The rows stand for a GPU batch already copied to the host (random bf16, K=3, H=576 as for
SmolLM2-135M; sequences of 256..1024 tokens). Timed, alternated, best of `--repeat`, on a
filesystem store in a temporary folder:

- before (session 1's `run_extract`): slice per sequence, `pack` (concatenate), validate with
  the host NaN/Inf pass, `to_bytes`, `put_bytes` (sha256 + write);
- now (`hf.capture_into` + `extract._store_hidden`): copy each sequence's rows straight into the
  shard's preallocated arrays, validate the structure (finite already checked on the device),
  stream the shard's parts to the store (sha256 + write).

On a GPU this work runs after every shard's forwards; `extract_shards` also moves the second
half (validation, sha256, write) to background threads, which this does not time.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()

    from aerie.shard import Shard, np_dtype, pack
    from aerie.store import FsStore

    K, H, bf16 = 3, 576, np_dtype("bfloat16")
    rng = np.random.default_rng(0)
    lengths = []
    while sum(lengths) < args.tokens:
        lengths.append(int(rng.integers(256, 1025)))
    lengths[-1] -= sum(lengths) - args.tokens
    T = sum(lengths)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    batch = rng.standard_normal((T, K + 1, H), dtype=np.float32).astype(bf16)  # "the host copy of the GPU rows"
    ids = rng.integers(0, 49152, T).astype(np.int32)
    mask = np.ones(T, dtype=np.uint8)
    store = FsStore(tempfile.mkdtemp(prefix="bench-host-"))
    meta = {"run": "bench", "shard": "000000", "engine": "hf"}

    def before() -> None:
        rows = [
            {"input_ids": ids[a:b], "loss_mask": mask[a:b], "aux": batch[a:b, :K], "final": batch[a:b, K]}
            for a, b in zip(offsets[:-1], offsets[1:])
        ]
        hidden = pack(rows, [1, 15, 28], extra_metadata=meta)
        hidden.validate(check_finite=True)
        store.put_bytes("runs/bench/hidden/000000.safetensors", hidden.to_bytes())

    def now() -> None:
        hidden = Shard(
            input_ids=ids,
            loss_mask=mask,
            offsets=offsets,
            capture_points=[1, 15, 28],
            aux=np.empty((T, K, H), dtype=bf16),
            final=np.empty((T, H), dtype=bf16),
            extra_metadata=meta,
        )
        src, aux, final = batch.view(np.int16), hidden.aux.view(np.int16), hidden.final.view(np.int16)
        for a, b in zip(offsets[:-1], offsets[1:]):
            aux[a:b] = src[a:b, :K]
            final[a:b] = src[a:b, K]
        hidden.validate(check_finite=False)
        store.put_parts("runs/bench/hidden/000000.safetensors", hidden.parts())

    times: dict[str, list[float]] = {"before": [], "now": []}
    for _ in range(args.repeat):
        for name, fn in (("before", before), ("now", now)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    mb = T * (K + 1) * H * 2 / 1e6
    b, n = min(times["before"]), min(times["now"])
    print(f"{T} tokens, {len(lengths)} sequences, {mb:.0f} MB of hidden states per shard")
    print(
        f"before: {b:.3f} s ({b / T * 1e6:.2f} us/token)   now: {n:.3f} s ({n / T * 1e6:.2f} us/token)   before/now: {b / n:.2f}"
    )


if __name__ == "__main__":
    main()
