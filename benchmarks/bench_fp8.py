"""fp8 (e4m3) against bf16 storage of the hidden states: bytes, state error, acceptance, side by side.

    python benchmarks/bench_fp8.py --out benchmarks/results/cpu-2026-12-03-fp8.json   # `aerie run` default sizes
    python benchmarks/bench_fp8.py --quick                                           # `aerie run --quick` sizes
    python benchmarks/bench_fp8.py --store /tmp/fp8-store --arms fp8 &   # the trainings in two processes over one
    python benchmarks/bench_fp8.py --store /tmp/fp8-store --arms bf16    # kept store, then the whole document from it
    python benchmarks/bench_fp8.py --store /tmp/fp8-store --out ...      # (runs and published drafters are reused)
    python benchmarks/bench_fp8.py --massive --out benchmarks/results/cpu-2026-12-05-fp8-massive.json

1. ShareGPT conversations are ingested and extracted once through the pipeline's own stages
   (`hf` engine, SmolLM2-135M-Instruct, states computed and stored in bf16): run `bf16`. Run `fp8`
   holds the same shards as the extractor writes them with `storage_dtype: float8_e4m3fn` (its
   writer's own `Shard.quantize`, one float32 scale per row; the forward is not repeated:
   tests/extractor/test_fp8_storage.py extracts both through real workers). Stored bytes per
   token are read off the store; the figure at H = 7168 (Kimi-K2.5 / DeepSeek-V3, 3 points + the
   final state) is computed from the format.
2. State error of each scale layout on the bf16 run's real states: per row, and per block of
   64 / 32 values (more scales, more bytes): relative L2 error and cosine per token against the
   bf16 states, and bytes per token, so the layouts compare at their cost.
3. The same drafter (same config, seed and data order) is trained on each run with `aerie run`'s
   sizes; reported: acceptance length of the project's real speculative-decoding loop (target in
   the loop, held-out prompts), simulated acceptance and step accuracies on held-out shards, loss.
   Also: how often the target's top-1 token from the fp8 final state is bf16's (the training target).
4. Host cost: numpy quantize / dequantize throughput (values/s, one core), the torch dequantize the
   trainer runs on the batch's device.

5. `--massive` (alone, seconds, no model): the scale layouts under massive activations, on
   synthetic states shaped like a DeepSeek-V3 / Kimi-K2.5 residual stream (H = 7168; ordinary
   channels of log-normally spread magnitudes; 4 channels at 1 to 10^5 times the ordinary RMS in
   every token, both signs): per row, the relative L2 error of the ordinary channels and of the
   whole row, and the share of ordinary values stored as e4m3 subnormals, for one scale per row
   against one per 128 values; the bytes of each. `aerie.shard.default_scale_block` follows it.

Prints one JSON document (and writes it with --out, after each phase: a stopped run keeps what it
measured). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from aerie import layout, presets, runs, stages
from aerie.app.pipeline import sharegpt_path
from aerie.contracts import ExtractRequest, IngestOptions, IngestRequest, ShardRecord, TrainRequest
from aerie.settings import Settings
from aerie.shard import Shard, dequantize_e4m3, quantize_e4m3
from aerie.store import FsStore
from aerie.target import describe, smollm2


def extract_run(store, settings, run: str, model: Path, dataset: str, size, records: int) -> None:
    ingested = stages.ingest(
        store,
        settings,
        IngestRequest(
            run=run,
            dataset=dataset,
            model=str(model),
            engine="hf",
            dtype="bfloat16",
            options=IngestOptions(
                max_tokens=size.max_tokens, shard_tokens=size.shard_tokens, max_records=records, overlong="truncate"
            ),
        ),
    )
    for shard in ingested.shards:
        stages.extract(store, settings, ExtractRequest(run=run, shard=shard))


def quantized_copy(store, run: str, into: str) -> None:
    """Run `into`: run `run`'s shards as the extractor stores them with storage_dtype float8_e4m3fn."""
    spec = runs.load_run(store, run)
    for name in runs.shard_names(store, run, "hidden"):
        rec = store.get_json(layout.shard_record(run, "hidden", name), ShardRecord)
        shard = Shard.from_buffer(store.get_bytes(rec.key)).quantize("float8_e4m3fn").validate()
        data = shard.to_bytes()
        key = layout.shard(into, "hidden", name)
        sha = store.put_bytes(key, data)
        store.put_json(
            layout.shard_record(into, "hidden", name),
            rec.model_copy(update={"run": into, "key": key, "sha256": sha, "bytes": len(data)}),
        )
        tokens = store.get_json(layout.shard_record(run, "tokens", name), ShardRecord)
        store.put_bytes(layout.shard(into, "tokens", name), store.get_bytes(tokens.key))
        store.put_json(
            layout.shard_record(into, "tokens", name),
            tokens.model_copy(update={"run": into, "key": layout.shard(into, "tokens", name)}),
        )
    store.put_json(layout.run_spec(into), spec.model_copy(update={"run": into, "storage_dtype": "float8_e4m3fn"}))


def run_bytes(store, run: str) -> dict:
    status = runs.run_status(store, run)
    stored = runs.hidden_bytes(store, run)
    return {
        "tokens": status.tokens,
        "sequences": status.sequences,
        "shards": status.shards_total,
        "stored_bytes": stored,
        "bytes_per_token": stored / status.tokens,
    }


def state_error(store, run: str, blocks: list[int | None]) -> dict:
    """Each layout's error on the run's stored (bf16) states, per token and point."""
    shards = [
        Shard.open(store.local_path(layout.shard(run, "hidden", n))) for n in runs.shard_names(store, run, "hidden")
    ]
    x = np.concatenate([np.concatenate([s.aux.reshape(-1, s.aux.shape[-1]), s.final]) for s in shards]).astype(
        np.float32
    )
    tokens, H = sum(s.num_tokens for s in shards), x.shape[1]
    rows_per_token = x.shape[0] / tokens
    out = {}
    for block in blocks:
        q, scale = quantize_e4m3(x, block)
        back = dequantize_e4m3(q, scale, "BF16").astype(np.float32)  # what readers get
        norm = np.linalg.norm(x, axis=1)
        keep = norm > 0
        rel = np.linalg.norm(back - x, axis=1)[keep] / norm[keep]
        cos = (back * x).sum(1)[keep] / (np.linalg.norm(back, axis=1)[keep] * norm[keep])
        G = scale.shape[-1]
        out["row" if block is None else f"block{block}"] = {
            "scales_per_row": G,
            "state_bytes_per_token": rows_per_token * (H + 4 * G),
            "bytes_per_value": (H + 4 * G) / H,
            "rel_l2_mean": float(rel.mean()),
            "rel_l2_p99": float(np.quantile(rel, 0.99)),
            "rel_l2_max": float(rel.max()),
            "cosine_mean": float(cos.mean()),
            "cosine_p1": float(np.quantile(cos, 0.01)),
            "cosine_min": float(cos.min()),
            "rows": int(keep.sum()),
        }
    return {
        "hidden_size": H,
        "rows_per_token": rows_per_token,
        "bf16_state_bytes_per_token": rows_per_token * H * 2,
        "layouts": out,
    }


def target_agreement(store, model: Path, tokens: int = 4096) -> dict:
    """How much fp8 moves the target signal: the target's top-1 token from the fp8 run's final
    states against the bf16 run's (lm_head of the target, float32), over the first `tokens` rows."""
    import torch
    from safetensors.torch import load_file

    weights = load_file(str(next(model.glob("*.safetensors"))))
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).float()  # tied in SmolLM2
    finals = {}
    for run in ("bf16", "fp8"):
        parts, n = [], 0
        for name in runs.shard_names(store, run, "hidden"):
            shard = Shard.open(store.local_path(layout.shard(run, "hidden", name)))
            parts += [shard.sequence(i)["final"] for i in range(shard.num_sequences)]
            n += shard.num_tokens
            if n >= tokens:
                break
        finals[run] = torch.from_numpy(np.concatenate(parts)[:tokens].astype(np.float32))
    with torch.no_grad():
        a, b = (finals[r] @ head.T for r in ("bf16", "fp8"))
        pa, pb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        kl = (pa.exp() * (pa - pb)).sum(-1)
    return {
        "tokens": int(a.shape[0]),
        "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
        "kl_mean": float(kl.mean()),
        "kl_p99": float(torch.quantile(kl, 0.99)),
    }


def at_hidden_size(H: int, points: int = 3, block: int | None = None) -> dict:
    """Bytes per token of a hidden shard at hidden size H: `points` capture points + the final state,
    plus the token tensors (int32 id, uint8 mask)."""
    rows, tokens_part = points + 1, 4 + 1
    G = 1 if block is None else H // block
    return {
        "H": H,
        "bf16": rows * H * 2 + tokens_part,
        "fp8": rows * (H + 4 * G) + tokens_part,
        "ratio": (rows * (H + 4 * G) + tokens_part) / (rows * H * 2 + tokens_part),
    }


def massive_activations(H: int = 7168, tokens: int = 512, factors=(1, 100, 300, 1000, 3000, 1e4, 3e4, 1e5)) -> dict:
    """Per-row vs per-128 scales on DeepSeek-like states with massive-activation channels."""
    g = np.random.default_rng(0)
    base = g.standard_normal((tokens, H)).astype(np.float32) * np.exp(0.5 * g.standard_normal(H)).astype(np.float32)
    rms = float(np.sqrt((base**2).mean()))
    massive = g.choice(H, 4, replace=False)
    ordinary = np.ones(H, bool)
    ordinary[massive] = False
    tiny = np.float32(2.0**-6)  # e4m3's smallest normal
    out = []
    for factor in factors:
        x = base.copy()
        if factor > 1:
            x[:, massive] = factor * rms * (1 + 0.1 * g.standard_normal((tokens, 4))) * np.array([1, -1, 1, -1])
        entry: dict = {"factor": factor}
        for name, block in (("row", None), ("block128", 128)):
            q, scale = quantize_e4m3(x, block)
            back = dequantize_e4m3(q, scale, np.float32)
            err = back - x
            rel_ordinary = np.linalg.norm(err[:, ordinary], axis=1) / np.linalg.norm(x[:, ordinary], axis=1)
            rel_row = np.linalg.norm(err, axis=1) / np.linalg.norm(x, axis=1)
            qf = np.abs(q.astype(np.float32))[:, ordinary]
            G = scale.shape[-1]
            entry[name] = {
                "scales_per_row": G,
                "bytes_per_value": (H + 4 * G) / H,
                "ordinary_rel_l2_mean": float(rel_ordinary.mean()),
                "ordinary_rel_l2_max": float(rel_ordinary.max()),
                "row_rel_l2_mean": float(rel_row.mean()),
                "ordinary_subnormal_share": float(((qf < tiny) & (qf > 0)).mean() + (qf == 0).mean()),
            }
        entry["ordinary_error_ratio_row_over_block"] = (
            entry["row"]["ordinary_rel_l2_mean"] / entry["block128"]["ordinary_rel_l2_mean"]
        )
        out.append(entry)
    return {"H": H, "tokens": tokens, "massive_channels": 4, "ordinary_rms": rms, "by_factor": out}


def throughput() -> dict:
    import torch

    from aerie_trainer.data import dequantize

    x = np.random.default_rng(0).standard_normal((16384, 576), dtype=np.float32)
    t = time.perf_counter()
    q, s = quantize_e4m3(x)
    quant = x.size / (time.perf_counter() - t)
    t = time.perf_counter()
    dequantize_e4m3(q, s, "BF16")
    deq = x.size / (time.perf_counter() - t)
    tq = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
    ts = torch.from_numpy(s)
    t = time.perf_counter()
    dequantize(tq, ts, torch.bfloat16)
    tdeq = x.size / (time.perf_counter() - t)
    return {
        "numpy_quantize_values_per_s": quant,
        "numpy_dequantize_values_per_s": deq,
        "torch_cpu_dequantize_values_per_s": tdeq,
        "threads": torch.get_num_threads(),
    }


def train(store, settings, run: str, model: Path, size, seed: int, max_tokens: int, **overrides) -> dict:
    config = size.train_config(max_tokens=max_tokens).model_copy(update={"seed": seed, **overrides})
    result = stages.train(
        store, settings, TrainRequest(runs=[run], drafter=f"d-{run}", model=str(model), config=config)
    )
    keep = (
        "steps",
        "final_loss",
        "acceptance_untrained",
        "acceptance",
        "simulated_acceptance_untrained",
        "simulated_acceptance",
        "heldout_loss",
        "heldout_acc",
        "draft_vocab_coverage",
        "evaluated_with",
    )
    return {k: getattr(result, k) for k in keep}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="`aerie run --quick` sizes")
    ap.add_argument("--records", type=int, default=None, help="conversations (default: the size's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument(
        "--store",
        default=None,
        help="a folder kept as the filesystem store: complete runs and published "
        "drafters in it are reused (default: a temporary one)",
    )
    ap.add_argument("--arms", default="bf16,fp8", help="which runs to train a drafter on")
    ap.add_argument(
        "--train-size",
        choices=["quick", "default"],
        default=None,
        help="the training settings of this `aerie run` size on the data (default: the data's size)",
    )
    ap.add_argument(
        "--eval-new-tokens", type=int, default=None, help="tokens per prompt of the real loop (default: the size's)"
    )
    ap.add_argument(
        "--vocab-from",
        choices=["target", "data"],
        default=None,
        help="draft vocabulary from the target's greedy tokens or the data's (default: TrainConfig's, target)",
    )
    ap.add_argument("--massive", action="store_true", help="only the massive-activation comparison (seconds)")
    a = ap.parse_args()
    if a.massive:
        t0 = time.perf_counter()
        doc = {
            "command": " ".join(["python", *sys.argv]),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, no GPU (shared with other work)",
            "massive_activations": massive_activations(),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        if a.out:
            Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(json.dumps(doc))
        return
    arms = a.arms.split(",")
    size = presets.load_size("quick" if a.quick else "default")
    records = a.records or size.records
    model = smollm2(Path(os.environ.get("AERIE_CACHE_DIR", "~/.cache/aerie")).expanduser())
    import transformers

    transformers.utils.logging.set_verbosity_error()
    t_start = time.perf_counter()
    result: dict = {
        "command": " ".join(["python", *sys.argv]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, no GPU (shared with other work)",
        "size": "quick" if a.quick else "default",
        "records": records,
        "seconds": {},
    }

    def phase(name: str, t0: float) -> None:
        result["seconds"][name] = round(time.perf_counter() - t0, 1)
        print(f"bench_fp8: {name} done in {result['seconds'][name]} s", file=sys.stderr, flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps(result, indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="bench-fp8-") as tmp:
        d = a.store or tmp
        Path(d).mkdir(parents=True, exist_ok=True)
        dataset = str(sharegpt_path())
        settings = Settings(store=f"file://{d}", engine="hf", device="cpu", ingest_local_dirs=[Path(dataset).parent])
        store = FsStore(Path(d))
        result["target"] = describe(model).model_dump(include={"model", "hidden_size", "num_layers"})
        t0 = time.perf_counter()
        if not runs.run_complete(store, "bf16"):
            extract_run(store, settings, "bf16", model, dataset, size, records)
        phase("extract", t0)
        t0 = time.perf_counter()
        if not runs.run_complete(store, "fp8"):
            quantized_copy(store, "bf16", "fp8")
        result["runs"] = {name: run_bytes(store, name) for name in ("bf16", "fp8")}
        result["bytes_ratio"] = result["runs"]["fp8"]["bytes_per_token"] / result["runs"]["bf16"]["bytes_per_token"]
        result["at_hidden_size"] = [at_hidden_size(576), at_hidden_size(7168), at_hidden_size(7168, block=128)]
        result["state_error"] = state_error(store, "bf16", [None, 64, 32])
        result["throughput"] = throughput()
        result["target_signal"] = target_agreement(store, model)
        phase("quantize + state error", t0)
        result["training"] = {}
        for name in arms:
            t0 = time.perf_counter()
            overrides = {
                k: v
                for k, v in (
                    ("eval_new_tokens", a.eval_new_tokens),
                    ("draft_vocab_from", a.vocab_from),
                    ("eval_prompts", 8 if a.train_size else None),
                )
                if v is not None
            }
            result["training"][name] = train(
                store,
                settings,
                name,
                model,
                presets.load_size(a.train_size or result["size"]),
                a.seed,
                size.max_tokens,
                **overrides,
            )
            result["train_config"] = {"size": a.train_size or result["size"], **overrides}
            phase(f"train {name}", t0)
        tr = result["training"]
        if {"bf16", "fp8"} <= set(tr):
            result["acceptance_difference"] = {
                k: tr["fp8"][k] - tr["bf16"][k]
                for k in ("acceptance", "simulated_acceptance")
                if tr["fp8"][k] is not None and tr["bf16"][k] is not None
            }
    phase("total", t_start)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
