"""Why the hf engine captures slower on a pool thread, and on batch shapes it has not seen.

Session 9 (BENCHMARKS.md) measured the same shards captured at 0.944x bare on the thread that had
warmed the engine and 0.659x on a fresh pool thread (a Celery threads-pool task's thread). The
suspect: torch's cuDNN attention keeps its built execution graphs in a `thread_local` cache keyed
by the exact shape (aten/src/ATen/native/cudnn/MHA.cpp, `mhagraphcache`), so every new thread, and
every batch shape not seen before in that thread, builds a cuDNN graph on the CPU first. Real
extraction sees new shapes all the time (the batch's longest sequence and its count vary).

For each SDPA choice (torch's default, which picks cuDNN on an H200 for masked attention; and
cuDNN attention switched off, `torch.backends.cuda.enable_cudnn_sdp(False)`), side by side in one
process on the same engine:
- bare forward and capture_into on shapes warmed on this thread;
- capture_into on the same shapes asked for by a fresh pool thread (since session 9 every capture
  runs on the engine's own launching thread), and run on that fresh thread itself (as before);
- bare forward and capture_into on sequences of new random lengths (shapes this process has not
  seen; a new set per sample).

    python3 benchmarks/bench_attention_thread.py --device cuda --cache /tmp/aerie-cache --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--cache", help="where smollm2() converts the default target (default: the settings' cache_dir)")
    p.add_argument("--tokens", type=int, default=500_000, help="tokens per set of sequences")
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--tokens-per-batch", type=int, default=65536)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--sdpa", default="default,no-cudnn", help="SDPA choices, comma-separated: default | no-cudnn")
    p.add_argument("--out")
    args = p.parse_args(argv)

    import bench_capture_path  # beside this script: its timing
    import torch

    from aerie.contracts import IngestOptions, IngestRequest
    from aerie.settings import Settings
    from aerie.shard import np_dtype
    from aerie.target import smollm2
    from aerie_extractor.engines import make_engine
    from aerie_extractor.ingest import build_run_spec

    tmp = tempfile.TemporaryDirectory(prefix="bench-attention-thread-")
    settings = Settings(
        store=f"file://{tmp.name}", device=args.device, tokens_per_batch=args.tokens_per_batch, engine="hf"
    )
    if args.cache:
        settings = settings.model_copy(update={"cache_dir": Path(args.cache)})
    model = str(smollm2(settings.cache_dir))
    request = IngestRequest(run="bench", dataset="random", model=model, dtype="bfloat16", storage_dtype="float8_e4m3fn",
                            options=IngestOptions(max_tokens=args.max_len))  # fmt: skip
    spec = build_run_spec(settings, request)
    engine = make_engine(settings, spec)
    engine.check(spec)
    K, H = len(spec.capture_points), spec.target.hidden_size
    block = spec.scale_block or H
    fp8 = np_dtype(spec.storage_dtype)
    high = min(40000, spec.target.vocab_size)

    def sequences(seed: int) -> tuple[list[np.ndarray], np.ndarray, list[np.ndarray]]:
        """`--tokens` tokens of random ids in sequences of random lengths, their offsets, and the
        (touched) arrays capture_into fills."""
        rng = np.random.default_rng(seed)
        seqs, total = [], 0
        while total < args.tokens:
            n = int(rng.integers(args.min_len, args.max_len + 1))
            seqs.append(rng.integers(100, high, n).astype(np.int32))
            total += n
        offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
        T = int(offsets[-1])
        arrays = [
            np.zeros((T, K, H), fp8),
            np.zeros((T, H), fp8),
            np.zeros((T, K, H // block), np.float32),
            np.zeros((T, H // block), np.float32),
        ]
        return seqs, offsets, arrays

    def bare(s) -> None:
        from aerie_extractor.engines.hf import length_batches

        seqs = s[0]
        with torch.inference_mode():
            for idx in length_batches([len(x) for x in seqs], settings.tokens_per_batch):
                engine.forward([seqs[i] for i in idx], hidden_states=False)

    def capture(s) -> None:
        assert engine.capture_into(s[0], s[1], *s[2])

    def on_fresh_thread(fn):
        def run(s) -> None:
            with ThreadPoolExecutor(1) as pool:
                pool.submit(fn, s).result()

        return run

    def on_that_thread(fn):  # before session 9: the capture runs on the thread that asks, not the engine's own
        def run(s) -> None:
            launcher = engine._launch_thread
            engine._launch_thread = threading.current_thread()
            try:
                fn(s)
            finally:
                engine._launch_thread = launcher

        return run

    def timed(fn, s) -> float:  # seconds, the device synchronized before and after
        return bench_capture_path.timed(args.device, lambda: fn(s))["seconds"]

    warm_set = sequences(0)
    tokens = int(warm_set[1][-1])
    config = {"model": model, "device": args.device, "tokens_per_set": tokens, "tokens_per_batch": settings.tokens_per_batch,
              "capture_points": spec.capture_points, "hidden": H, "cpu_count": os.cpu_count(), "python": platform.python_version(),
              "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None}  # fmt: skip
    print(json.dumps(config), flush=True)
    results: dict[str, dict] = {}
    seed = 1000
    for choice in [x for x in args.sdpa.split(",") if x]:
        cudnn_before = torch.backends.cuda.cudnn_sdp_enabled()
        torch.backends.cuda.enable_cudnn_sdp(choice != "no-cudnn")
        try:
            t = timed(capture, warm_set) + timed(
                bare, warm_set
            )  # every shape of the warm set once (the engine's thread, this one)
            print(f"{choice}: warm-up {t:.3f} s", flush=True)
            samples: dict[str, list[float]] = {}
            for _ in range(args.repeat):
                seed += 2
                passes = {
                    "bare, warm shapes": (bare, warm_set),
                    "capture, warm shapes": (capture, warm_set),
                    "capture, warm shapes, asked by a fresh pool thread": (on_fresh_thread(capture), warm_set),
                    "capture, warm shapes, run on a fresh pool thread": (
                        on_fresh_thread(on_that_thread(capture)),
                        warm_set,
                    ),
                    "bare, new shapes": (bare, sequences(seed)),
                    "capture, new shapes": (capture, sequences(seed + 1)),
                }
                for name, (fn, s) in passes.items():
                    n = int(s[1][-1])
                    samples.setdefault(name, []).append(n / timed(fn, s))
                    print(f"{choice}: {name:42s} {samples[name][-1]:12.1f} tok/s", flush=True)
            best = {name: max(v) for name, v in samples.items()}
            results[choice] = {"tok_per_s": best, "samples": samples,
                               "ratio_to_bare_warm": {name: v / best["bare, warm shapes"] for name, v in best.items()}}  # fmt: skip
        finally:
            torch.backends.cuda.enable_cudnn_sdp(cudnn_before)
        out = {"config": config, "results": results, "command": " ".join(sys.argv)}
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\n{'sdpa':10s} {'pass':42s} {'tok/s':>12s} {'/bare warm':>10s}")
    for choice, r in results.items():
        for name, v in r["tok_per_s"].items():
            print(f"{choice:10s} {name:42s} {v:12.1f} {r['ratio_to_bare_warm'][name]:10.3f}")
    engine.close()
    tmp.cleanup()
    return out


if __name__ == "__main__":
    main()
