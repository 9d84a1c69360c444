"""Capture throughput through SGLang: binary plugin vs JSON vs bare prefill, one server, one run.

    .venv/bin/python benchmarks/bench_capture.py                        # starts a CPU server (SmolLM2, fp32)
    .venv/bin/python benchmarks/bench_capture.py --url http://host:30000 --prompts 256 --tokens 512 --concurrency 32

Three passes over the same prompts against the same capture server (plugin installed,
`--disable-radix-cache`), each with `--concurrency` requests in flight, `max_new_tokens: 1`:

- bare:   no hidden states returned (what prefill alone costs through HTTP)
- json:   `return_hidden_states: true`; the client parses the floats into numpy (orjson), aux only
- binary: the aerie_capture plugin, shm sink; the client waits for, checks (sha256) and deletes
          each capture; aux **and** the final state, i.e. (K+1)/K times the JSON path's data

Prints tokens/s per pass and the ratios binary/json and binary/bare (goal: binary >= 0.95 bare).
A warm-up pass (not timed) runs first. The passes are interleaved round by round
(`--rounds`) so that a neighbour's load on a shared machine hits all three alike.
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

import httpx
import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from aerie_extractor.engines.sglang_binary import SinkConfig, advertised, capture_body, descriptor_of, fetch_binary  # noqa: E402


def bare(client: httpx.Client, ids: list[int]) -> int:
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    r.raise_for_status()
    return len(ids)


def as_json(client: httpx.Client, ids: list[int]) -> int:
    r = client.post("/generate", json={"input_ids": ids, "return_hidden_states": True,
                                       "sampling_params": {"max_new_tokens": 1, "temperature": 0}})  # fmt: skip
    r.raise_for_status()
    aux = np.asarray(orjson.loads(r.content)["meta_info"]["hidden_states"][0], dtype=np.float32)
    assert aux.shape[0] == len(ids)
    return len(ids)


def binary(client: httpx.Client, ids: list[int]) -> int:
    r = client.post("/generate", json=capture_body(ids, "shm"))
    r.raise_for_status()
    tensors = fetch_binary(descriptor_of(orjson.loads(r.content)), SinkConfig("shm"))
    assert tensors["aux"].shape[0] == len(ids)
    return len(ids)


def run_pass(fn, url: str, prompts: list[list[int]], concurrency: int) -> float:
    with httpx.Client(base_url=url, timeout=600) as client, ThreadPoolExecutor(concurrency) as pool:
        start = time.perf_counter()
        tokens = sum(pool.map(lambda ids: fn(client, ids), prompts))
        return tokens / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running capture server with the plugin (default: start one on the CPU)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server we started, too

    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, args.tokens).tolist() for _ in range(args.prompts)]
    with contextlib.ExitStack() as stack:
        url = args.url
        if url is None:
            from aerie.target import smollm2
            from tests.sglang_server import capture_server

            server = stack.enter_context(capture_server(smollm2(Path("~/.cache/aerie").expanduser()), points=[2, 15, 27]))
            url = server.url
        info = advertised(httpx.get(url + "/server_info", timeout=30).json())
        if info is None:
            raise SystemExit(f"{url} does not advertise the aerie_capture plugin: install aerie-sglang in its environment")
        passes = {"bare": bare, "json": as_json, "binary": binary}
        for fn in passes.values():  # warm-up
            run_pass(fn, url, prompts[: args.concurrency], args.concurrency)
        rates: dict[str, list[float]] = {name: [] for name in passes}
        for _ in range(args.rounds):
            for name, fn in passes.items():
                rates[name].append(run_pass(fn, url, prompts, args.concurrency))
        tps = {name: float(np.median(r)) for name, r in rates.items()}
    result = {
        "prompts": args.prompts, "tokens": args.tokens, "concurrency": args.concurrency, "rounds": args.rounds,
        "tokens_per_s": tps, "per_round": rates,
        "binary_over_json": tps["binary"] / tps["json"], "binary_over_bare": tps["binary"] / tps["bare"],
    }  # fmt: skip
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
