"""What admitting one capture request costs the SGLang scheduler thread, by how many captures wait
unclaimed in the shm directory: the plugin's admission now (`Sinks.admit`: the directory's last
listing plus the writers' bytes since, listed again only before a refusal) beside admission as it
was until 2026-12-04 (the directory listed at every admission, `unclaimed_bytes()` fresh). One
run, the two interleaved round after round, on files of a tmpfs like the real sink's.

    .venv-sglang/bin/python benchmarks/bench_sink_admit.py [--files 0,32,256,1024] [--admissions 500]

Run it with the interpreter the plugin is installed in (`.venv-sglang`, made by scripts/sglang_env.sh).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from aerie_sglang.plugin.sink import CaptureSinkSettings, Sinks

CAPTURE_BYTES = 2_360_000  # a 512-token SmolLM2 capture (aux 3 x 576 + final, bf16), for the bound's arithmetic


class _Req:
    """A request object: its reservation ends when it is collected, as SGLang's Req."""


def _admit_now(sinks: Sinks, n: int) -> float:
    reqs = [_Req() for _ in range(n)]
    started = time.perf_counter()
    for req in reqs:
        sinks.admit(req, CAPTURE_BYTES)
    took = time.perf_counter() - started
    del reqs
    gc.collect()
    return took / n


def _admit_listing(sinks: Sinks, n: int) -> float:
    """Admission before 2026-12-04: a listing of the directory, then the same reservation."""
    reqs = [_Req() for _ in range(n)]
    started = time.perf_counter()
    for req in reqs:
        sinks.unclaimed_bytes()  # listed every time
        sinks.admit(req, CAPTURE_BYTES)
    took = time.perf_counter() - started
    del reqs
    gc.collect()
    return took / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", default="0,32,256,1024", help="captures waiting in the directory, one case each")
    p.add_argument("--admissions", type=int, default=500, help="admissions timed per round and case")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default="/dev/shm", help="where the sink's directory is made (a tmpfs)")
    p.add_argument("--out", help="raw JSON")
    a = p.parse_args()
    rows = []
    for files in [int(x) for x in a.files.split(",")]:
        with tempfile.TemporaryDirectory(dir=a.dir) as root:
            cap = Path(root) / "cap"
            sinks = Sinks(CaptureSinkSettings(shm_dir=cap, max_unclaimed_bytes=1 << 50, ttl_s=900))
            sinks.config.prepare()
            for _ in range(files):  # small files: a listing's cost is per file, not per byte
                (cap / f"{uuid.uuid4().hex}.safetensors").write_bytes(b"\0" * 4096)
            sinks.list_shm()
            now, listing = [], []
            for _ in range(a.rounds):
                listing.append(_admit_listing(sinks, a.admissions))
                now.append(_admit_now(sinks, a.admissions))
            row = {
                "files_waiting": files,
                "us_per_admission_listing_each": [x * 1e6 for x in listing],
                "us_per_admission_now": [x * 1e6 for x in now],
                "median_listing_each_us": statistics.median(listing) * 1e6,
                "median_now_us": statistics.median(now) * 1e6,
            }
            row["now_over_listing_each"] = row["median_now_us"] / row["median_listing_each_us"]
            rows.append(row)
            print(
                f"{files:5d} files waiting: listing at each admission {row['median_listing_each_us']:8.1f} us, "
                f"now {row['median_now_us']:6.1f} us per admission ({row['now_over_listing_each']:.3f}x)",
                flush=True,
            )
    if a.out:
        Path(a.out).write_text(
            json.dumps(
                {
                    "command": " ".join([Path(sys.executable).name, *sys.argv]),
                    "machine": platform.platform(),
                    "admissions": a.admissions,
                    "rounds": a.rounds,
                    "rows": rows,
                },
                indent=1,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
