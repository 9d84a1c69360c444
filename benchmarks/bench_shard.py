"""Shard write+read throughput against a plain safetensors save/load of the same tensors, and
bytes stored per token against the raw tensor bytes. One run, side by side.

    .venv/bin/python benchmarks/bench_shard.py [--tokens 65536] [--hidden 576] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from aerie.shard import Shard, pack, raw_bytes_per_token


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--points", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    seqs = []
    left = a.tokens
    while left > 0:
        T = min(left, int(rng.integers(a.seq_len // 2, a.seq_len * 3 // 2)))
        seqs.append(
            {
                "input_ids": rng.integers(0, 49152, T).astype(np.int32),
                "loss_mask": np.ones(T, np.uint8),
                "aux": rng.standard_normal((T, a.points, a.hidden), dtype=np.float32).astype(ml_dtypes.bfloat16),
                "final": rng.standard_normal((T, a.hidden), dtype=np.float32).astype(ml_dtypes.bfloat16),
            }
        )
        left -= T
    shard = pack(seqs, capture_points=list(range(2, 2 + a.points)))
    as_torch = {
        k: torch.from_numpy(v.view(np.uint16)).view(torch.bfloat16)
        if v.dtype == ml_dtypes.bfloat16
        else torch.from_numpy(np.ascontiguousarray(v))
        for k, v in shard.tensors().items()
    }
    mb = sum(v.nbytes for v in shard.tensors().values()) / 1e6
    ours, theirs, checks = [], [], []
    with tempfile.TemporaryDirectory() as d:
        for _ in range(a.repeat):  # interleaved, so machine noise hits both alike
            t = time.perf_counter()
            shard.save(Path(d) / "ours.safetensors")
            back = Shard.open(Path(d) / "ours.safetensors")
            float(back.aux[-1, -1, -1])  # touch the data
            ours.append(time.perf_counter() - t)
            t = time.perf_counter()
            back.validate()
            checks.append(time.perf_counter() - t)
            t = time.perf_counter()
            save_file(as_torch, Path(d) / "theirs.safetensors", metadata=shard.metadata())
            loaded = load_file(Path(d) / "theirs.safetensors")
            float(loaded["aux"][-1, -1, -1])
            theirs.append(time.perf_counter() - t)
        stored = (Path(d) / "ours.safetensors").stat().st_size
    o, s = statistics.median(ours), statistics.median(theirs)
    raw = raw_bytes_per_token(shard)
    print(
        f"tensors: {mb:.1f} MB, {shard.num_tokens} tokens, {shard.num_sequences} sequences, K={a.points}, H={a.hidden}"
    )
    print(f"aerie shard write+read (mmap):             {mb / o:8.1f} MB/s  (median of {a.repeat})")
    print(f"aerie full validation (shapes, NaN/Inf):   {mb / statistics.median(checks):8.1f} MB/s")
    print(f"plain safetensors save+load:               {mb / s:8.1f} MB/s")
    print(f"ratio aerie / safetensors:                 {s / o:8.3f}")
    print(
        f"bytes per token stored {stored / shard.num_tokens:.1f} vs raw {raw:.1f}: overhead {100 * (stored / shard.num_tokens / raw - 1):.3f}%"
    )


if __name__ == "__main__":
    main()
