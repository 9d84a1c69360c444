"""Capture throughput through SGLang: binary plugin vs JSON vs bare prefill, one server, one run.

    .venv/bin/python benchmarks/bench_capture.py                        # starts a CPU server (SmolLM2, fp32)
    .venv/bin/python benchmarks/bench_capture.py --url http://host:30000 --prompts 256 --tokens 512 --concurrency 32

Passes over the same prompts against the same capture server (plugin installed and enabled,
`AERIE_SGLANG_BINARY=1`, `--disable-radix-cache`), each with `--concurrency` requests in flight,
`max_new_tokens: 1`:

- bare:   no hidden states returned (what prefill alone costs through HTTP)
- json:   `return_hidden_states: true`; the client parses the floats into numpy (orjson), aux only
- binary: the aerie_capture plugin, shm sink; the client waits for, checks (sha256) and deletes
          each capture; aux **and** the final state, i.e. (K+1)/K times the JSON path's data
- extract-json:   the extractor's `sglang` engine on a JSON run (`SGLangEngine.capture`): aux
                  floats + the top-20 log-probs a JSON run needs as its target signal
- extract-binary: the same engine on a binary run: aux + final state through the plugin

Prints tokens/s per pass and the ratios binary/json and binary/bare, for raw requests and for
the engine (goal: binary >= 0.95 bare). A warm-up pass (not timed) runs first. The passes are
interleaved batch by batch (`--batch` prompts, the order rotating), `--rounds` times, so that a
neighbour's load on a shared machine hits all alike; tokens/s = all tokens / all seconds of a pass.

Measured 2026-12-02:
- 2-core CPU shared with other jobs (load average 6-15), SmolLM2 fp32, 8 prompts, c=4, 2 rounds:
  128 tokens: bare 21.0, json 17.3, binary 22.1 tok/s (binary/json 1.28, binary/bare 1.05);
  256 tokens: bare 50.3, json 44.7, binary 40.9 tok/s (0.92, 0.81). Prefill itself takes
  seconds there and the machine's load swings +-30 % between rounds: inconclusive either way.
- Same CPU, 16 prompts x 256 tokens, c=4, interleaved in batches of 4, 2 rounds (BENCHMARKS.md):
  bare 154, json 164, binary 243, extract-json 153, extract-binary 274 tok/s; extraction
  binary/json 1.79, binary/bare 1.78 (bare below binary in every round: unexplained, noise-sized).
- `--sink-only` on an H200 host (16 cores), bf16, 512-token requests, 32 per step, 8 claiming
  threads: H=576 (K=3): 144k / 346k / 376k tok/s with 1 / 4 / 8 writer threads; H=4096:
  21k / 75k / 118k tok/s. Bare prefill there (FIGURES.md): 167-190k and 38-42k tok/s, so
  with 4 writers the sink has ~2x headroom over the GPU; one writer would cap it at ~0.5-0.8x
  (sha256 runs at 0.75 GB/s per thread on that CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def bare(client, ids: list[int]) -> int:
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    r.raise_for_status()
    return len(ids)


def as_json(client, ids: list[int]) -> int:
    import orjson

    r = client.post("/generate", json={"input_ids": ids, "return_hidden_states": True,
                                       "sampling_params": {"max_new_tokens": 1, "temperature": 0}})  # fmt: skip
    r.raise_for_status()
    aux = np.asarray(orjson.loads(r.content)["meta_info"]["hidden_states"][0], dtype=np.float32)
    assert aux.shape[0] == len(ids)
    return len(ids)


def binary(client, ids: list[int]) -> int:
    import orjson

    from aerie_extractor.engines.sglang_binary import capture_body, descriptor_of, fetch_binary, reader_for

    r = client.post("/generate", json=capture_body(ids, "shm"))
    r.raise_for_status()
    tensors = fetch_binary(descriptor_of(orjson.loads(r.content)), reader_for(client.get("/server_info").json(), "shm"))
    assert tensors["aux"].shape[0] == len(ids)
    return len(ids)


class EnginePass:
    """The extractor's engine on a run of `transport` (checked once, here): one call captures
    all prompts, `concurrency` requests in flight (`AERIE_ENGINE_CONCURRENCY`)."""

    def __init__(self, url: str, model: Path, points: list[int], transport: str, concurrency: int):
        from aerie.contracts import IngestOptions, RunSpec
        from aerie.settings import Settings
        from aerie.target import describe
        from aerie_extractor.engines.sglang import SGLangEngine

        settings = Settings(engine="sglang", engine_urls=[url], engine_concurrency=concurrency, engine_transport=transport)
        target = describe(model)
        signal = "final" if transport == "binary" else "topk"  # what a run over each transport stores
        run = RunSpec(run=f"bench-{transport}", dataset="bench", target=target, capture_points=points, dtype="float32",
                      engine=SGLangEngine.spec_for(settings, target, points, "float32"), target_signal=signal,
                      topk=20 if signal == "topk" else None, ingest=IngestOptions())  # fmt: skip
        assert run.engine.transport == transport, run.engine
        self.engine = SGLangEngine(settings, run)
        self.engine.check(run)

    def __call__(self, prompts: list[list[int]]) -> int:
        captured = self.engine.capture([np.asarray(ids, dtype=np.int32) for ids in prompts])
        assert all(c.aux.shape[0] == len(ids) for c, ids in zip(captured, prompts))
        return sum(map(len, prompts))


def run_pass(fn, url: str, prompts: list[list[int]], concurrency: int) -> tuple[int, float]:
    """-> (tokens, seconds) of one pass over `prompts`."""
    import httpx

    if isinstance(fn, EnginePass):
        start = time.perf_counter()
        return fn(prompts), time.perf_counter() - start
    with httpx.Client(base_url=url, timeout=600) as client, ThreadPoolExecutor(concurrency) as pool:
        start = time.perf_counter()
        tokens = sum(pool.map(lambda ids: fn(client, ids), prompts))
        return tokens, time.perf_counter() - start


def sink_only(args) -> dict:
    """The plugin's data path without SGLang: per request, slice + clone the rows of a batch
    (on `--device`), hand them to the plugin's writer thread (pinned copy, sha256, safetensors
    to tmpfs), and a client pool reads, checks the sha256 and deletes each file. Shows whether
    the sink keeps up with a GPU's prefill rate (FIGURES.md: 167-190k tok/s at H=576)."""
    import hashlib
    import os
    import tempfile
    import threading

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "services" / "inference"))
    from aerie_sglang.plugin import hooks
    from aerie_sglang.plugin.sink import Capture, CaptureSinkSettings, Sinks, planned_size

    dtype = getattr(torch, args.dtype)
    T, K, H, B = args.tokens, args.layers, args.hidden, args.concurrency
    shm = Path(tempfile.mkdtemp(prefix="aerie-sink-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    sinks = Sinks(CaptureSinkSettings(shm_dir=shm, max_unclaimed_bytes=1 << 40, ttl_s=900, writers=args.writers))
    sinks.start()
    aux_batch = torch.randn(B * T, K * H, device=args.device).to(dtype)
    final_batch = torch.randn(B * T, H, device=args.device).to(dtype)
    done = threading.Semaphore(0)

    def claim(capture_id: str) -> None:
        path = shm / f"{capture_id}.safetensors"
        while True:
            try:
                buf = path.read_bytes()
                break
            except FileNotFoundError:
                time.sleep(0.0005)
        n = int.from_bytes(buf[:8], "little")
        meta = json.loads(buf[8 : 8 + n])["__metadata__"]
        assert hashlib.sha256(memoryview(buf)[8 + n :]).hexdigest() == meta["sha256"]
        os.unlink(path)
        done.release()

    pool = ThreadPoolExecutor(args.client_threads)
    start = time.perf_counter()
    for step in range(args.prompts // B):
        for i in range(B):  # what around_append_prefill_hidden_states + _finish do per request
            aux = aux_batch[i * T : (i + 1) * T].clone().reshape(T, K, H)
            final = final_batch[i * T : (i + 1) * T].clone()
            ready = None
            if aux.is_cuda:
                aux, final = hooks._to_pinned(aux), hooks._to_pinned(final)
                ready = torch.cuda.Event()
                ready.record()
            cid = f"{step:06d}{i:04d}"
            tensors = {"aux": aux, "final": final}
            meta = {"aerie_capture_id": cid, "sha256": "0" * 64}
            sinks.submit(Capture(cid, "shm", tensors, meta, planned_size(tensors, meta), ready), None)
            pool.submit(claim, cid)
    for _ in range((args.prompts // B) * B):
        done.acquire()
    elapsed = time.perf_counter() - start
    pool.shutdown()
    shm.rmdir()
    tokens = (args.prompts // B) * B * T
    result = {"mode": "sink-only", "device": args.device, "writers": args.writers, "client_threads": args.client_threads, "dtype": args.dtype, "tokens": T, "layers": K, "hidden": H,
              "requests": (args.prompts // B) * B, "tokens_per_s": tokens / elapsed,
              "gb_per_s": tokens * (K + 1) * H * aux_batch.element_size() / elapsed / 1e9}  # fmt: skip
    print(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running capture server with the plugin (default: start one on the CPU)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="prompts per interleaved batch (each pass runs each batch)")
    p.add_argument("--model", help="the served model's folder (default: SmolLM2-135M-Instruct in ~/.cache/aerie)")
    p.add_argument("--points", default="2,15,27", help="capture points the server captures")
    p.add_argument("--out", help="write the figures as JSON here")
    p.add_argument("--sink-only", action="store_true", help="the plugin's sink path alone, no SGLang (see sink_only)")
    p.add_argument("--device", default="cpu", help="--sink-only: where the captured rows live (cuda on a GPU host)")
    p.add_argument("--dtype", default="bfloat16", help="--sink-only: bfloat16 | float16 | float32")
    p.add_argument("--layers", type=int, default=3, help="--sink-only: K captured layers")
    p.add_argument("--hidden", type=int, default=576, help="--sink-only: H")
    p.add_argument("--client-threads", type=int, default=4, help="--sink-only: claiming threads")
    p.add_argument("--writers", type=int, default=4, help="--sink-only: the plugin's writer threads")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server we started, too
    if args.sink_only:
        result = sink_only(args)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        return result

    import httpx

    from aerie_extractor.engines.sglang_binary import advertised

    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, args.tokens).tolist() for _ in range(args.prompts)]
    points = [int(p) for p in args.points.split(",")]
    with contextlib.ExitStack() as stack:
        url = args.url
        if args.model:
            model = Path(args.model)
        else:
            from aerie.target import smollm2

            model = smollm2(Path("~/.cache/aerie").expanduser())
        if url is None:
            import tempfile

            from tests.sglang_server import capture_server

            shm = stack.enter_context(tempfile.TemporaryDirectory(prefix="aerie-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
            env = {"AERIE_SGLANG_BINARY": "1", "AERIE_CAPTURE_DIR": shm}
            server = stack.enter_context(capture_server(model, points=points, env=env))
            url = server.url
        info = advertised(httpx.get(url + "/server_info", timeout=30).json())
        if info is None:
            raise SystemExit(f"{url} does not advertise the aerie_capture plugin: install aerie-sglang in its environment and set AERIE_SGLANG_BINARY=1")
        passes = {"bare": bare, "json": as_json, "binary": binary,
                  "extract-json": EnginePass(url, model, points, "json", args.concurrency),
                  "extract-binary": EnginePass(url, model, points, "binary", args.concurrency)}  # fmt: skip
        for fn in passes.values():  # warm-up
            run_pass(fn, url, prompts[: args.concurrency], args.concurrency)
        # Interleaved batch by batch (`--batch` prompts, pass order rotating): a neighbour's load
        # on a shared machine falls on every pass alike, not on whichever pass ran during it.
        names = list(passes)
        tokens = {name: 0 for name in names}
        seconds = {name: 0.0 for name in names}
        rates: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(args.rounds):
            got = {name: [0, 0.0] for name in names}
            for b, start in enumerate(range(0, len(prompts), args.batch)):
                for name in names[b % len(names) :] + names[: b % len(names)]:
                    n, t = run_pass(passes[name], url, prompts[start : start + args.batch], args.concurrency)
                    got[name][0] += n
                    got[name][1] += t
            for name, (n, t) in got.items():
                tokens[name] += n
                seconds[name] += t
                rates[name].append(n / t)
        tps = {name: tokens[name] / seconds[name] for name in names}
    result = {
        "prompts": args.prompts, "tokens": args.tokens, "concurrency": args.concurrency, "rounds": args.rounds,
        "batch": args.batch, "tokens_per_s": tps, "per_round": rates,
        "binary_over_json": tps["binary"] / tps["json"], "binary_over_bare": tps["binary"] / tps["bare"],
        "extract_binary_over_json": tps["extract-binary"] / tps["extract-json"],
        "extract_binary_over_bare": tps["extract-binary"] / tps["bare"],
    }  # fmt: skip
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
