"""A measured memory model of one drafter training step, and its estimate at Kimi-K2.5's width.

Each measurement is one fresh process (`--one H,T,VD,S`) that builds aerie's drafter (the
trainer's own TTT module and AdamW), runs one warm-up step (which allocates the gradients and the
optimizer state), resets the kernel's resident high-water mark (/proc/self/clear_refs 5) and runs
a second step (forward, backward, clip, AdamW): `step_peak_bytes` is that step's peak resident
memory above the process's resident memory before it — the step's activations and transients.
glibc is told to map every allocation over 64 KiB on its own (MALLOC_MMAP_THRESHOLD_), so a
freed tensor leaves the resident set at once and the high-water mark is the allocations' peak.

The grid (the default run) varies width H, tokens T, draft vocab VD and TTT steps S, with and
without activation checkpointing, and fits per mode by least squares of the relative error

    step_peak = S*T*(a*H + b*VD) + T*(c*H + d*VD) + e*T^2

(e: the CPU math attention's (T x T) scores, which the GPU's flash attention never forms; it is
left out of the full-width estimate). The estimate at full width adds what the fit does not vary:
16 bytes a trainable parameter (float32 weight, gradient, AdamW's two moments), the frozen target
embedding (float32) and lm_head (bf16), the batch's inputs (captured states, the target
distribution over the draft vocab) and the target head's chunked full-vocab logits
(TargetHead.CHUNK_ROWS rows x V). The CPU measures float32 activations; a GPU computes in bf16,
so the activation terms are an upper bound there. The drafter here has 2 heads of H/2 and 1 KV
head (keys/values H/2 wide; Kimi's drafter: 56/8 heads, H/7): the kept keys are overcounted.

    python benchmarks/bench_train_memory.py --out benchmarks/results/cpu-2026-12-05-train-memory.json

On a GPU (the full width, the trainer's bf16 step, one process each; `bash
benchmarks/gpu_drafter_device.sh deps memory` runs this on the lent device):

    for c in "" --checkpoint; do PYTHONPATH=shared:services/trainer python3 benchmarks/bench_train_memory.py \
      --device cuda --one 7168,16384,32000,4 --vocab 163840 $c; done
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MMAP = "65536"
GiB = 1 << 30


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def measure(H: int, T: int, VD: int, S: int, checkpoint: bool, device: str = "cpu", vocab: int | None = None) -> dict:
    """One measurement. device "cuda": the trainer's GPU scheme (bf16 compute from float32
    weights, the Kimi drafter's 56/8 heads of 128 at H 7168), peak from the CUDA allocator."""
    import torch

    from aerie_trainer.model import DrafterConfig, Eagle3Drafter
    from aerie_trainer.precision import compute_dtype
    from aerie_trainer.trainer import clip_and_step, make_optimizer
    from aerie_trainer.ttt import TTT

    cuda = device.startswith("cuda")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    V, K = vocab or 2 * VD, 3
    heads, kv_heads, head_dim = (56, 8, 128) if cuda and H == 7168 else (2, 1, H // 2)
    cfg = DrafterConfig(
        hidden_size=H,
        target_hidden_size=H,
        num_aux=K,
        intermediate_size=12 * H // 7,  # Kimi's drafter: MLP 12288 at H 7168
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        max_position_embeddings=4 * T,
        vocab_size=V,
        draft_vocab_size=VD,
    )
    drafter = Eagle3Drafter(cfg)
    drafter.set_vocab(torch.arange(VD) * (V // VD))
    drafter.to(device)
    dtype = compute_dtype(torch.device(device))
    if dtype is not None:
        drafter.embed_tokens.to(dtype)
    ttt = TTT(drafter, S, 0.8, compute_dtype=dtype, checkpoint=checkpoint)
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    opt = make_optimizer(trainable, argparse.Namespace(lr=1e-4, weight_decay=0.0), torch.device(device))
    W, act = T + S, dtype or torch.float32
    ids = torch.randint(0, V, (1, W), device=device)
    aux = torch.randn(1, T, K * H, device=device, dtype=act)
    t_logits = torch.randn(1, W, VD, device=device, dtype=act)
    t_lse = torch.logsumexp(t_logits.float(), -1)
    argmax = torch.randint(0, V, (1, W), device=device)
    mask = torch.ones(1, W, dtype=torch.bool, device=device)

    def step():
        loss = ttt(ids, aux, t_logits, t_lse, argmax, mask, mask)[0]
        loss.backward()
        clip_and_step(opt, 0.5)
        return float(loss)

    step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        Path("/proc/self/clear_refs").write_text("5")
        before = _status("VmRSS")
    start = time.perf_counter()
    loss = step()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else _status("VmHWM")
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "vocab": V,
        "total_peak_bytes": peak if cuda else None,
        "H": H,
        "T": T,
        "VD": VD,
        "S": S,
        "checkpoint": checkpoint,
        "trainable_params": sum(p.numel() for p in trainable),
        "step_peak_bytes": peak - before,
        "step_seconds": round(seconds, 3),
        "loss_finite": loss == loss and abs(loss) != float("inf"),
    }


def one(spec: str, checkpoint: bool, vocab: int | None = None) -> dict:
    """Measure in a fresh process with the allocator setting (re-executing this script if needed)."""
    cmd = [sys.executable, __file__, "--one", spec, "--child"] + (["--checkpoint"] if checkpoint else [])
    cmd += ["--vocab", str(vocab)] if vocab else []
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO, timeout=600)
    if run.returncode:
        raise SystemExit(f"measurement {spec} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def fit(rows: list[dict]) -> dict:
    import numpy as np

    names = ["S*T*H", "S*T*VD", "T*H", "T*VD", "T^2"]
    X = np.array(
        [
            [r["S"] * r["T"] * r["H"], r["S"] * r["T"] * r["VD"], r["T"] * r["H"], r["T"] * r["VD"], r["T"] ** 2]
            for r in rows
        ],
        float,
    )
    y = np.array([r["step_peak_bytes"] for r in rows], float)
    coef, *_ = np.linalg.lstsq(X / y[:, None], np.ones(len(y)), rcond=None)  # least relative error
    pred = X @ coef
    return {
        "coefficients_bytes": dict(zip(names, [round(float(c), 3) for c in coef])),
        "max_relative_residual": round(float(np.max(np.abs(pred - y) / y)), 3),
    }


def estimate(coef: dict, H: int, T: int, VD: int, V: int, S: int, K: int = 3, I: int = 12288) -> dict:
    """Bytes of one rank at full width (GPU: flash attention, no T^2 term)."""
    c = coef
    activations = S * T * (c["S*T*H"] * H + c["S*T*VD"] * VD) + T * (c["T*H"] * H + c["T*VD"] * VD)
    q, kv = 56 * 128, 8 * 128
    trainable = K * H * H + 2 * H * (q + 2 * kv) + q * H + 3 * H * I + 4 * H + H * VD
    state = 16 * trainable
    frozen = V * H * (4 + 2)  # embedding float32, lm_head bf16
    inputs = T * K * H * 2 + T * H * 2 + (T + S) * VD * 2 + T * 4 * 8  # aux, final, target dist, ids/masks
    head_chunk = 2048 * V * 2 + 2048 * VD * 2
    total = activations + state + frozen + inputs + head_chunk
    return {
        "H": H,
        "T": T,
        "VD": VD,
        "V": V,
        "S": S,
        "activations_gib": round(activations / GiB, 1),
        "weights_grads_adamw_gib": round(state / GiB, 1),
        "frozen_embedding_and_head_gib": round(frozen / GiB, 1),
        "inputs_gib": round(inputs / GiB, 1),
        "head_chunk_gib": round(head_chunk / GiB, 1),
        "total_gib": round(total / GiB, 1),
        "fits_h200_141gb": total <= 141e9 * 0.85,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--one", help="H,T,VD,S: one measurement in a fresh process")
    ap.add_argument("--checkpoint", action="store_true")
    ap.add_argument("--device", default="cpu", help="cuda: measure the GPU step (peak from the CUDA allocator)")
    ap.add_argument("--vocab", type=int, help="target vocab (default 2 x VD)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--refit", type=Path, help="fit and estimate again from a result file's runs (no measuring)")
    args = ap.parse_args()
    if args.one:
        H, T, VD, S = (int(x) for x in args.one.split(","))
        if args.child or args.device != "cpu":
            row = measure(H, T, VD, S, args.checkpoint, args.device, args.vocab)
            print(json.dumps(row))
            if args.out and not args.child:
                args.out.write_text(json.dumps({"runs": [row]}, indent=1))
            return
        row = one(args.one, args.checkpoint, args.vocab)
        print(json.dumps(row))
        if args.out:
            args.out.write_text(json.dumps({"runs": [row]}, indent=1))
        return
    rows = json.loads(args.refit.read_text())["runs"] if args.refit else []
    for H in () if args.refit else (64, 256):
        for VD in (1024, 4096):
            for T in (512, 2048):
                for S in (2, 4):
                    for ckpt in (False, True):
                        rows.append(one(f"{H},{T},{VD},{S}", ckpt))
                        print(json.dumps(rows[-1]), flush=True)
    result = {"command": "python benchmarks/bench_train_memory.py", "runs": rows, "fit": {}, "estimate": []}
    for ckpt in (False, True):
        model = fit([r for r in rows if r["checkpoint"] is ckpt])
        result["fit"]["checkpoint" if ckpt else "plain"] = model
        for T, S in ((2048, 7), (16384, 4), (16384, 7), (20000, 4)):
            result["estimate"].append(
                {"checkpoint": ckpt, **estimate(model["coefficients_bytes"], 7168, T, 32000, 163840, S)}
            )
    print(json.dumps({k: result[k] for k in ("fit", "estimate")}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
