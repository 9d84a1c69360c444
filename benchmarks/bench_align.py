"""The alignment check's thresholds, measured: stored states against SGLang servers of several configurations.

    .venv/bin/python benchmarks/bench_align.py [--samples 8] [--max-tokens 192] [--json out.json]

What `aerie align`'s default thresholds (aerie.settings: AERIE_ALIGN_MIN_COSINE, ..._P1,
AERIE_ALIGN_MIN_TOP1) rest on. The run is the default-size ShareGPT run of SmolLM2-135M (the `hf`
engine, bf16 states; tests/runs.py, cached), the one the tests' shared drafter is trained on. Each
configuration is one real SGLang 0.5.23 capture server on the CPU (radix cache off, the run's
points and their neighbours, aerie's binary plugin so the final states are compared too), checked
with the `align` stage itself:

- `float32`, `bfloat16`: the same weights, served in each dtype (same target, same engine);
- `float32-states`: the float32 server against a small run of float32 states (`hf` in float32);
- `off-by-one`: the float32 server against states taken one layer deeper than their labels
  (points [3, 16, 28] stored as [2, 15, 27]);
- `int4-g32`, `int4-channel`: the weights round-tripped through 4-bit quantization in groups of
  32 / one group per output row (tests/quantized.py), served in float32, against the unquantized run.

Printed per configuration and point: mean / p1 / min cosine at the point, the best-matching server
point, the neighbours' mean cosine; the final-state cosine and the top-1 agreement.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
POINTS = [2, 15, 27]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--only", action="append", default=None, help="configurations to run (default: all)")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory(prefix="aerie-bench-align-") as work:  # the runs' copies, the capture sink
        figures = measure(Path(work), args)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


def measure(work: Path, args) -> dict[str, dict]:
    from aerie import layout, stages
    from aerie.app.pipeline import SIZES
    from aerie.contracts import AlignRequest
    from aerie.settings import Settings
    from aerie.store import FsStore
    from aerie.target import smollm2
    from aerie_extractor.align import neighbour_layer_ids
    from tests.quantized import PER_CHANNEL, smollm2_quantized
    from tests.runs import hidden_run_folder, upload_run
    from tests.sglang_server import capture_server

    cache = Path(os.environ.get("AERIE_TEST_CACHE", os.path.expanduser("~/.cache/aerie")))
    model = smollm2(cache)
    size = SIZES["default"]
    store = FsStore(work / "store")
    upload_run(
        store,
        hidden_run_folder(cache, model, records=size.records, max_tokens=size.max_tokens, shard_sequences=16),
        "sharegpt",
    )
    upload_run(store, hidden_run_folder(cache, model, records=8, max_tokens=96, dtype="float32"), "f32")
    spec = upload_run(
        store, hidden_run_folder(cache, model, records=8, max_tokens=96, points=[p + 1 for p in POINTS]), "deeper"
    )
    store.put_json(
        layout.run_spec("deeper"),
        spec.model_copy(
            update={  # labelled one layer too shallow
                "capture_points": POINTS,
                "engine": spec.engine.model_copy(update={"layer_ids": POINTS}),
            }
        ),
    )
    settings = Settings(store=f"file://{store.root}")
    ids = neighbour_layer_ids(POINTS, "sglang-llama", 30)
    env = {"AERIE_SGLANG_BINARY": "1", "AERIE_CAPTURE_DIR": str(work / "shm")}
    configurations = [
        ("float32", model, "float32", ["sharegpt", "deeper", "f32"]),
        ("bfloat16", model, "bfloat16", ["sharegpt"]),
        ("int4-g32", smollm2_quantized(cache, model), "float32", ["sharegpt"]),
        ("int4-channel", smollm2_quantized(cache, model, PER_CHANNEL), "float32", ["sharegpt"]),
    ]
    figures: dict[str, dict] = {}
    for name, folder, dtype, runs in [c for c in configurations if not args.only or c[0] in args.only]:
        with capture_server(folder, layer_ids=ids, dtype=dtype, env=env, log_dir=work / "logs") as server:
            for run_name in runs:
                started = time.monotonic()
                report = stages.align(
                    store,
                    settings,
                    AlignRequest(run=run_name, server=server.url, samples=args.samples, max_tokens=args.max_tokens),
                )
                label = {"deeper": "off-by-one", "f32": "float32-states"}.get(run_name, name)
                figures[label] = {
                    "passed": report.passed,
                    "tokens": report.tokens,
                    "seconds": round(time.monotonic() - started, 1),
                    "points": {
                        p.point: {
                            "mean": p.at_point.mean,
                            "p1": p.at_point.p1,
                            "min": p.at_point.min,
                            "best": p.best_point,
                            "best_cos": p.cosines[p.best_point],
                            "neighbours": {q: c for q, c in p.cosines.items() if abs(q - p.point) == 1},
                        }
                        for p in report.points
                    },
                    "final": report.signal.final.mean if report.signal and report.signal.final else None,
                    "final_p1": report.signal.final.p1 if report.signal and report.signal.final else None,
                    "top1": report.signal.top1_agreement if report.signal else None,
                    "causes": report.causes,
                }
                show(label, report.passed, figures[label])
    return figures


def show(label: str, passed: bool, f: dict) -> None:
    print(f"\n== {label} ({'pass' if passed else 'FAIL'}; {f['tokens']} tokens)")
    for point, p in f["points"].items():
        near = " ".join(f"{q}:{c:.4f}" for q, c in p["neighbours"].items())
        print(
            f"  point {point}: mean {p['mean']:.6f} p1 {p['p1']:.6f} min {p['min']:.6f} best {p['best']} "
            f"({p['best_cos']:.6f}) neighbours {near}"
        )
    print(f"  final: mean {f['final']}, p1 {f['final_p1']}; top-1 {f['top1']:.4f}")
    for cause in f["causes"]:
        print(f"  - {cause}")


if __name__ == "__main__":
    main()
