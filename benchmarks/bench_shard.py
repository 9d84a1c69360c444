"""Shard write+read throughput against a plain safetensors save/load of the same tensors, and
bytes stored per token against the raw tensor bytes. One run, side by side.

    .venv/bin/python -m benchmarks.bench_shard [--tokens 65536] [--hidden 576] [--repeat 5] [--out F.json]
    .venv/bin/python -m benchmarks.bench_shard --quick        # small sizes: does it run
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

from aerie.app import harness
from aerie.shard import Shard, pack, raw_bytes_per_token


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--points", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--repeat", type=int, default=5)
    harness.add_arguments(p)
    a = p.parse_args()
    if a.quick:
        a.tokens, a.repeat = 4096, 2
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
    per_token = stored / shard.num_tokens
    harness.report(
        [
            harness.Figure("shard write+read (mmap) / plain safetensors save+load", round(s / o, 3), "x"),
            harness.Figure("shard bytes per token / raw tensor bytes", round(per_token / raw, 6), "x", "<= 1.01"),
        ],
        a.out,
        details={
            "tensors_mb": round(mb, 1),
            "tokens": shard.num_tokens,
            "sequences": shard.num_sequences,
            "points": a.points,
            "hidden": a.hidden,
            "repeat": a.repeat,
            "shard_write_read_mb_s": round(mb / o, 1),
            "shard_validation_mb_s": round(mb / statistics.median(checks), 1),
            "safetensors_save_load_mb_s": round(mb / s, 1),
            "bytes_per_token_stored": round(per_token, 1),
            "bytes_per_token_raw": round(raw, 1),
        },
    )


if __name__ == "__main__":
    main()
