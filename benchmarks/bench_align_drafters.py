"""How much a quantized serving target costs the drafter trained on the unquantized one, and how much its twin gets back.

    .venv/bin/python benchmarks/bench_align_drafters.py [--configs 4:0,3:0] [--conversations 60] [--json out.json]

The drafters are the tests' (cached like them): the shared one (tests/trained.py, trained on
SmolLM2-135M's own states) and, per configuration `bits:group` (group 0: one per output row),
its twin trained on the quantized target's states (tests/quantized.py `trained_on_quantized`,
which trains it when its cache is cold: ~5 min on 2 cores). The measure is teacher-forced, on
held-out ShareGPT conversations (after the first 800; user turn and answer cut to 600 characters,
at most 192 tokens): the share of positions where a drafter's first draft is the target's next
token, given the target's states (transformers, float32) at the run's points. Printed per
configuration: the shared drafter on the unquantized target, the shared drafter and the twin on
the quantized one, and the per-conversation difference (twin minus shared: mean, standard
deviation, conversations the twin wins).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", default=os.environ.get("AERIE_TEST_CACHE", os.path.expanduser("~/.cache/aerie")))
    parser.add_argument("--configs", default="4:0,3:0", help="bits:group,... (group 0: one per output row)")
    parser.add_argument("--conversations", type=int, default=60)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from aerie.target import smollm2
    from aerie_trainer import evaluate
    from aerie_trainer.export import load_exported
    from tests.quantized import smollm2_quantized, trained_on_quantized
    from tests.runs import held_out_chats
    from tests.trained import trained_drafter

    cache = Path(args.cache)
    source = smollm2(cache)
    shared = trained_drafter(cache, source).folder
    points = json.loads((shared / "aerie.json").read_text())["capture_points"]
    tok = AutoTokenizer.from_pretrained(str(source))
    held_out = held_out_chats(tok, args.conversations, 800, chars=600, max_tokens=192, min_tokens=32)

    def first_draft_hits(target: Path, drafter_folder: Path) -> list[float]:
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        return evaluate.first_draft_right(model, load_exported(drafter_folder, target), held_out, points)

    def pooled(shares: list[float]) -> float:
        lengths = [len(ids) - 1 for ids in held_out]
        return round(sum(s * n for s, n in zip(shares, lengths)) / sum(lengths), 4)

    out = {
        "points": points,
        "conversations": len(held_out),
        "positions": sum(len(ids) - 1 for ids in held_out),
        "shared_on_source": pooled(first_draft_hits(source, shared)),
        "configs": {},
    }
    for spec in args.configs.split(","):
        bits, group = (int(x) for x in spec.split(":"))
        target = smollm2_quantized(cache, source, group, bits)
        twin = trained_on_quantized(cache, source, group, bits).folder
        mine, theirs = first_draft_hits(target, shared), first_draft_hits(target, twin)
        diff = [b - a for a, b in zip(mine, theirs)]
        out["configs"][f"int{bits}-{'channel' if group == 0 else f'g{group}'}"] = {
            "shared": pooled(mine),
            "twin": pooled(theirs),
            "twin_minus_shared_mean": round(statistics.mean(diff), 4),
            "twin_minus_shared_sd": round(statistics.stdev(diff), 4),
            "twin_wins": sum(d > 0 for d in diff),
            "twin_loses": sum(d < 0 for d in diff),
        }
        print(json.dumps(out["configs"]), flush=True)
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
