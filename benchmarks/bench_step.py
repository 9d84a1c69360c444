"""aerie's EAGLE-3 training step beside SpecForge's: same shapes, same random inputs, one GPU.

    # the H200 (device tool); SpecForge's `specforge/` from its source in a git-excluded folder
    # (never a project dependency: bash benchmarks/bench_step_carry.sh builds .benchcarry/)
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .benchcarry/wheels/*.whl
    PYTHONPATH=/tmp/site:shared:services/trainer:.benchcarry/sf \\
        python3 benchmarks/bench_step.py --device cuda --check --attention --out $OUT/step.json

    # smoke test on the CPU: aerie's side only (SpecForge's Triton loss needs a GPU)
    python benchmarks/bench_step.py --device cpu --tiny --out /tmp/tiny.json

One full training step each, 7 TTT steps, L = 2048, inputs already on the GPU (data loading is
excluded for both), warm-up steps (torch.compile and Triton JIT happen there) then timed steps:
- aerie: services/trainer/aerie_trainer — TargetHead, TTT (bf16 compute from float32 masters,
  flash + chain-merge attention, the Triton soft cross-entropy), then, as Trainer.train does it,
  clip 1.0 and the fused AdamW (trainer.make_optimizer), and the one host read of the step's stats.
- SpecForge (commit a6b6b023 measured): OnlineEagle3Model + LlamaForCausalLMEagle3 driven by its
  Eagle3TrainStrategy / TargetHead / TrainerCore / FSDPTrainingBackend (wrap=False) /
  BF16Optimizer, i.e. its offline path (stored final state -> TargetHead -> _compute_target_p ->
  TTT with its Triton LogSoftmaxLoss); attention backend flex_attention (its default).
aerie gets L+1 tokens per row (its collate turns T tokens into T-1 slots), SpecForge L tokens (its
shift keeps L positions): tokens per step = B*L for both.

--check compares the GPU paths with the torch paths the CPU tests prove (attention, chain merge,
loss, a whole TTT step in bf16 against float32); --attention times the ways to attend over the
TTT chain (this one; flex attention over the growing key cache, compile time included; the first
implementation with expanded K/V and dense masks). Prints a table; writes everything as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
import time
import traceback

import torch

SHAPES = {
    "llama8b": dict(H=4096, nh=32, nkv=8, hd=128, I=14336, V=128256, Vd=32000, K=3),  # Llama-3.1-8B drafter
    "smol135m": dict(H=576, nh=9, nkv=3, hd=64, I=1536, V=49152, Vd=32000, K=3),  # SmolLM2-135M drafter
    "smol135m_vd4096": dict(H=576, nh=9, nkv=3, hd=64, I=1536, V=49152, Vd=4096, K=3),
    "tiny": dict(H=64, nh=4, nkv=2, hd=16, I=128, V=512, Vd=128, K=3),  # CPU smoke test
    # an MLA drafter layer (--drafter-arch mla) with DeepSeek-V3/Kimi's head dims at a small width
    "smol_mla": dict(H=576, nh=8, nkv=8, hd=192, I=1536, V=49152, Vd=4096, K=3, mla=(384, 128, 128, 64, 128)),
}
TTT_STEPS = 7
MAX_POS = 2048

PLANS = {
    "full": [
        dict(trainer="aerie", shape="llama8b", B=1, profile=True),
        dict(trainer="specforge", shape="llama8b", B=1),
        dict(trainer="aerie", shape="llama8b", B=4, profile=True),
        dict(trainer="specforge", shape="llama8b", B=4),
        dict(trainer="aerie", shape="smol135m", B=4, profile=True),
        dict(trainer="specforge", shape="smol135m", B=4),
        dict(trainer="aerie", shape="smol135m_vd4096", B=4),
        dict(trainer="specforge", shape="smol135m_vd4096", B=4),
    ],
    "tiny": [dict(trainer="aerie", shape="tiny", B=2, L=32)],
}
PLANS["aerie"] = [it for it in PLANS["full"] if it["trainer"] == "aerie"]


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


class Phases:
    """CUDA-event marks around named calls during one instrumented step (inactive otherwise)."""

    def __init__(self):
        self.active, self.marks = False, []

    def wrap(self, name, fn):
        def wrapped(*a, **k):
            if not self.active:
                return fn(*a, **k)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            r = fn(*a, **k)
            e.record()
            self.marks.append((name, s, e))
            return r

        return wrapped

    def measure(self, step):
        self.marks, self.active = [], True
        try:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            step()
            e.record()
            torch.cuda.synchronize()
        finally:
            self.active = False
        out = {"step_total": round(s.elapsed_time(e), 2)}
        for name, a, b in self.marks:
            out[name] = round(out.get(name, 0.0) + a.elapsed_time(b), 2)
        return out


PHASES = Phases()


# --------------------------------------------------------------------------------------
# Shared random inputs (identical for both trainers)
# --------------------------------------------------------------------------------------
def make_inputs(shape: dict, B: int, L: int, device, seed: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    H, V, Vd, K = shape["H"], shape["V"], shape["Vd"], shape["K"]
    kw = dict(generator=g, device=device)
    ids = torch.randint(0, V, (B, L + 1), **kw)  # L+1 tokens per row
    aux = torch.randn(B, L + 1, K * H, **kw).to(torch.bfloat16)  # aux[t]: after token t
    final = torch.randn(B, L + 1, H, **kw).to(torch.bfloat16)  # final state after token t
    draft_ids = torch.randperm(V, **kw)[:Vd].sort().values
    head = torch.randn(V, H, **kw) * 0.02
    # draft-vocab rows get 4x the norm, so the target's argmax lies in the draft vocab as it does
    # for real data (coverage ~95%+); otherwise most positions would be masked out of the loss
    head[draft_ids] *= 4.0
    return dict(ids=ids, aux=aux, final=final, draft_ids=draft_ids.cpu(), head=head.to(torch.bfloat16))


def construct(fn, device):
    """Build a module directly on the device (fast init of 8B-sized layers); on any error, on the CPU."""
    try:
        with torch.device(device):
            return fn()
    except Exception as e:  # noqa: BLE001 - fall back, say why
        log("construct on device failed, building on the CPU:", type(e).__name__, e)
        return fn()


# --------------------------------------------------------------------------------------
# aerie
# --------------------------------------------------------------------------------------
def aerie_drafter(shape: dict, device):
    from aerie_trainer.model import DrafterConfig, Eagle3Drafter

    H = shape["H"]
    cfg = DrafterConfig(
        hidden_size=H,
        target_hidden_size=H,
        num_aux=shape["K"],
        intermediate_size=shape["I"],
        num_attention_heads=shape["nh"],
        num_key_value_heads=shape["nkv"],
        head_dim=shape["hd"],
        rms_norm_eps=1e-5,
        max_position_embeddings=MAX_POS,
        vocab_size=shape["V"],
        draft_vocab_size=shape["Vd"],
    )
    if "mla" in shape:  # q LoRA rank, kv LoRA rank, nope, rope, v head dims
        q_rank, kv_rank, nope, rope, v = shape["mla"]
        cfg.arch, cfg.q_lora_rank, cfg.kv_lora_rank = "mla", q_rank, kv_rank
        cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim = nope, rope, v
    torch.manual_seed(0)
    return construct(lambda: Eagle3Drafter(cfg), device)


def aerie_batch(inp: dict, L: int, steps: int, device):
    """collate()'s layout for one full-length sequence of L+1 tokens per row: W = L + steps slots."""
    from aerie_trainer.data import Batch

    ids, aux, final = inp["ids"], inp["aux"], inp["final"]
    B, H = ids.shape[0], final.shape[-1]
    W = L + steps
    input_ids = torch.zeros(B, W, dtype=torch.int64, device=device)
    input_ids[:, :L] = ids[:, 1:]
    fin = torch.zeros(B, W, H, dtype=final.dtype, device=device)
    fin[:, :L] = final[:, 1:]
    loss_mask = torch.ones(B, W, dtype=torch.bool, device=device)
    return Batch(input_ids=input_ids, aux=aux[:, :L].contiguous(), loss_mask=loss_mask, final=fin, tokens=B * L)


def build_aerie(shape: dict, B: int, L: int, inp: dict, device, phases: Phases):
    from aerie.contracts import TrainConfig
    from aerie_trainer.precision import compute_dtype
    from aerie_trainer.trainer import clip_and_step, lr_at, make_optimizer, pack_stats, read_stats
    from aerie_trainer.ttt import TTT, TargetHead, TTTOutput

    cfg = TrainConfig(draft_vocab_size=shape["Vd"], ttt_steps=TTT_STEPS)  # the defaults otherwise
    drafter = aerie_drafter(shape, device)
    drafter.set_vocab(inp["draft_ids"])
    drafter.to(device)
    dtype = compute_dtype(device)
    if dtype is not None:  # as Trainer.__init__ does
        drafter.embed_tokens.to(dtype)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, cfg, device)
    target = TargetHead(inp["head"], drafter.t2d, drafter.d2t, dtype or torch.float32)
    model = TTT(drafter, cfg.ttt_steps, cfg.step_decay, compute_dtype=dtype)
    batch = aerie_batch(inp, L, cfg.ttt_steps, device)
    state = {"step": 0}
    teacher = phases.wrap("teacher (TargetHead)", target.__call__)
    forward = phases.wrap("forward TTT+loss", model)
    backward = phases.wrap("backward", lambda loss: loss.backward())

    optimize = phases.wrap("optimizer (clip+AdamW)", lambda: clip_and_step(optimizer, cfg.grad_clip))
    read = phases.wrap("stats read (host sync)", read_stats)

    def step():
        # Trainer.train()'s body with grad_accum 1 (ttt_forward split in two for the phase marks)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(state["step"], cfg.lr, 10_000, 150)
        dist, argmax, trainable = teacher(batch)
        out = TTTOutput(*forward(batch.input_ids, batch.aux, dist.logits, dist.lse, argmax, trainable, batch.loss_mask))
        backward(out.loss / cfg.grad_accum)
        stats = pack_stats(out)
        optimize()
        loss, *_ = read(stats, cfg.ttt_steps, cfg.grad_accum)
        state["step"] += 1
        return loss

    info = dict(
        weights="float32 masters, bf16 compute (one cast per forward)" if dtype else "float32",
        optimizer=f"AdamW(0.9, 0.95) fused={device.type == 'cuda'} + clip {cfg.grad_clip}",
        trainable_params=sum(p.numel() for p in params),
        lr=cfg.lr,
    )
    return step, info, [drafter, optimizer, target, model, batch]


# --------------------------------------------------------------------------------------
# SpecForge (its own modules, imported from the carried source)
# --------------------------------------------------------------------------------------
def build_specforge(shape: dict, B: int, L: int, inp: dict, device, phases: Phases, backend: str = "flex_attention"):
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.modeling.target.target_head import TargetHead
    from specforge.optimizer import BF16Optimizer
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.backend import FSDPTrainingBackend, ParallelConfig
    from specforge.training.controller import TrainerCore
    from specforge.training.strategies.base import Eagle3TrainStrategy
    from transformers import LlamaConfig

    H, V = shape["H"], shape["V"]
    common = dict(
        hidden_size=H,
        num_attention_heads=shape["nh"],
        num_key_value_heads=shape["nkv"],
        head_dim=shape["hd"],
        intermediate_size=shape["I"],
        vocab_size=V,
        max_position_embeddings=MAX_POS,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        num_hidden_layers=1,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    dcfg = LlamaConfig(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=shape["Vd"], **common)
    torch.manual_seed(0)
    # build_eagle3_draft: from_config(torch_dtype=bf16) -> freeze_embedding -> .to(device, bf16)
    draft = construct(lambda: LlamaForCausalLMEagle3(dcfg, attention_backend=backend), device).to(dtype=torch.bfloat16)
    with torch.no_grad():  # load_vocab_mapping's result
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[inp["draft_ids"]] = True
        draft.t2d.copy_(t2d)
        draft.d2t.copy_(inp["draft_ids"] - torch.arange(len(inp["draft_ids"])))
    draft.freeze_embedding()
    draft = draft.to(device=device, dtype=torch.bfloat16)
    model = OnlineEagle3Model(draft_model=draft, length=TTT_STEPS, attention_backend=backend).to(
        device=device, dtype=torch.bfloat16
    )
    tmp = tempfile.mkdtemp(prefix="sf_target_")  # TargetHead reads a config folder; the weight is ours
    LlamaConfig(**common).save_pretrained(tmp)
    target_head = construct(lambda: TargetHead(tmp), device)
    with torch.no_grad():
        target_head.fc.weight.copy_(inp["head"].float())
    target_head.freeze_weights()
    target_head = target_head.eval().to(device=device, dtype=torch.bfloat16)

    def optimizer_factory(module):  # its assembly defaults: lr 1e-4, clip 0.5, warmup 0.015, cosine
        return BF16Optimizer(
            module,
            lr=1e-4,
            max_grad_norm=0.5,
            warmup_ratio=0.015,
            lr_scheduler="cosine",
            total_steps=10000,
            offload_master=False,
        )

    be = FSDPTrainingBackend(ParallelConfig.from_distributed(), optimizer_factory=optimizer_factory)
    wrapped = be.prepare_model(model, wrap=False, optimizer_target=model.draft_model)
    strategy = Eagle3TrainStrategy(wrapped, target_head=target_head)
    core = TrainerCore(strategy, be, accumulation_steps=1)
    target_head.forward = phases.wrap("teacher logits (TargetHead)", target_head.forward)
    strategy.forward_loss = phases.wrap("forward incl. teacher", strategy.forward_loss)
    be.backward = phases.wrap("backward", be.backward)
    be.step = phases.wrap("optimizer (BF16Optimizer)", be.step)
    ids, aux, final = inp["ids"], inp["aux"], inp["final"]
    tensors = {
        "input_ids": ids[:, :L].contiguous(),
        "attention_mask": torch.ones(B, L, dtype=torch.long, device=device),
        "loss_mask": torch.ones(B, L, dtype=torch.long, device=device),
        "hidden_state": aux[:, :L].contiguous(),
        "target": final[:, :L].contiguous(),
    }
    batch = TrainBatch(
        sample_ids=[str(i) for i in range(B)],
        strategy="eagle3",
        tensors=tensors,
        metadata={"target_repr": "hidden_state"},
    )

    def step():
        return core.train_step(batch)

    info = dict(
        attention_backend=backend,
        weights="bf16 params + fp32 master (BF16Optimizer)",
        optimizer="BF16Optimizer: AdamW on fp32 masters, clip 0.5",
        loss="Triton LogSoftmaxLoss",
        trainable_params=sum(p.numel() for p in draft.parameters() if p.requires_grad),
        lr=1e-4,
    )
    return step, info, [draft, model, target_head, be, strategy, core, batch]


def loss_of(res):
    if isinstance(res, float):
        return res
    loss = getattr(res, "loss", None)
    if loss is None and isinstance(res, dict):
        loss = res.get("loss")
    try:
        return float(loss)
    except (TypeError, ValueError):
        return None


# --------------------------------------------------------------------------------------
# Timing and profiling
# --------------------------------------------------------------------------------------
def kernel_category(name: str) -> str:
    n = name.lower()
    if "flash" in n or "fmha" in n or "flex" in n or "attention" in n or "triton_tem_fused" in n or "_chain_" in n:
        return "attention (flash/flex/chain merge)"
    if "_soft_ce_" in n or "log_softmax_forward_kernel" in n or "log_softmax_backward_kernel" in n:
        return "loss kernels (Triton)"
    if "multi_tensor" in n or "adam" in n:
        return "optimizer"
    if any(s in n for s in ("gemm", "sm90_xmma", "cutlass", "nvjet", "cublas", "xmma", "s16816", "wgmma")):
        return "GEMM"
    if "norm" in n:
        return "norms"
    if "softmax" in n or "logsumexp" in n:
        return "softmax/logsumexp (aten)"
    if n.startswith("triton_"):
        return "inductor-generated triton"
    if "reduce" in n:
        return "reductions"
    if "copy" in n or "cast" in n or "memcpy" in n or "memset" in n or "fill" in n or "cat" in n:
        return "copies/casts/fills/cat"
    if "elementwise" in n or "vectorized" in n or "unrolled" in n:
        return "elementwise (aten)"
    if "index" in n or "gather" in n or "scatter" in n:
        return "index/gather/scatter"
    return "other"


def profile_one(step, device, top=25):
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        sync(device)
    wall = time.perf_counter() - t0
    rows, cats, total = [], {}, 0.0
    for ev in prof.key_averages():
        if "CUDA" not in str(getattr(ev, "device_type", "")):
            continue
        t = getattr(ev, "self_device_time_total", 0.0)
        if t > 0:
            total += t
            c = kernel_category(ev.key)
            cats[c] = cats.get(c, 0.0) + t
            rows.append((t, ev.count, ev.key))
    rows.sort(reverse=True)
    ops = []
    for ev in prof.key_averages():
        if "CUDA" in str(getattr(ev, "device_type", "")):
            continue
        t = getattr(ev, "device_time_total", 0.0)
        if t > 0:
            ops.append((t, ev.count, ev.key))
    ops.sort(reverse=True)
    return dict(
        wall_ms=round(wall * 1e3, 2),
        gpu_kernel_ms=round(total / 1e3, 2),
        kernels=sum(r[1] for r in rows),
        categories_ms={k: round(v / 1e3, 2) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        top_kernels=[dict(ms=round(t / 1e3, 3), n=c, name=k[:140]) for t, c, k in rows[:top]],
        top_ops_inclusive=[dict(ms=round(t / 1e3, 3), n=c, name=k[:100]) for t, c, k in ops[:top]],
    )


def run_item(item: dict, device, args) -> dict:
    shape = SHAPES[item["shape"]]
    B, L = item["B"], item.get("L", 2048)
    res = dict(item, L=L, tokens_per_step=B * L)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        res["mem_before_build_GiB"] = round(torch.cuda.memory_allocated() / 2**30, 3)
    t_build = time.perf_counter()
    inp = make_inputs(shape, B, L, device)
    build = build_aerie if item["trainer"] == "aerie" else build_specforge
    step, info, keep = build(shape, B, L, inp, device, PHASES)
    res.update(info)
    inp.clear()  # only what the trainer kept stays (equal footing for peak memory)
    gc.collect()
    sync(device)
    res["build_s"] = round(time.perf_counter() - t_build, 2)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses = []
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        losses.append(loss_of(step()))
    sync(device)
    res["warmup_s"] = round(time.perf_counter() - t0, 2)  # torch.compile / Triton JIT / autotuning happen here
    events = (
        [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(args.iters)]
        if device.type == "cuda"
        else []
    )
    t1 = time.perf_counter()
    for i in range(args.iters):
        if events:
            events[i][0].record()
        losses.append(loss_of(step()))
        if events:
            events[i][1].record()
    sync(device)
    dt = time.perf_counter() - t1
    res["timed_steps"] = args.iters
    res["step_ms_mean"] = round(dt / args.iters * 1e3, 2)
    res["tokens_per_s"] = round(B * L * args.iters / dt, 1)
    res["losses_first_last"] = [losses[0], losses[-1]]
    res["losses_finite"] = all(x is not None and math.isfinite(x) for x in losses)
    if device.type == "cuda":
        per = sorted(a.elapsed_time(b) for a, b in events)
        res["step_ms_median_events"] = round(per[len(per) // 2], 2)
        res["step_ms_min_events"] = round(per[0], 2)
        res["peak_mem_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        res["peak_reserved_GiB"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
        res["peak_mem_own_GiB"] = round(res["peak_mem_GiB"] - res["mem_before_build_GiB"], 3)
        try:
            res["phases_ms"] = PHASES.measure(step)
        except Exception as e:  # noqa: BLE001 - optional
            res["phases_error"] = f"{type(e).__name__}: {e}"
        if item.get("profile") and not args.no_profile:
            try:
                res["profile"] = profile_one(step, device)
            except Exception as e:  # noqa: BLE001 - optional
                res["profile_error"] = f"{type(e).__name__}: {e}"
    del keep, step
    return res


# --------------------------------------------------------------------------------------
# --check: the GPU paths against the torch paths (which the CPU tests prove)
# --------------------------------------------------------------------------------------
def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def guard_kernels(device) -> dict:
    """Run each Triton kernel once; one that fails to build or run is replaced by its torch path
    for this run (recorded in the JSON), so the measurement still happens and says so."""
    from aerie_trainer import attention, kernels, loss, ttt

    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device).to(torch.bfloat16)

    def chain():
        q, o = rnd(1, 40, 8, 64).transpose(1, 2), rnd(1, 40, 8, 64).transpose(1, 2)
        ck, cv = rnd(2, 1, 40, 2, 64), rnd(2, 1, 40, 2, 64)
        out, lse = kernels.chain_merge_forward(q, o, torch.zeros(1, 8, 40, device=device), ck, cv, 0.125)
        kernels.chain_merge_backward(o, q, out, lse, ck, cv, q, 0.125)

    def soft_ce():
        z, t = rnd(2, 5, 300), rnd(2, 5, 300)
        lse, w = torch.zeros(2, 5, device=device), torch.ones(2, 5, device=device)
        rows, zl, sp, _ = kernels.soft_ce_forward(z, t, lse, w)
        kernels.soft_ce_backward(z, t, lse, w, zl, sp, torch.ones((), device=device))

    def teacher():
        full = rnd(3, 5000)
        ids = torch.arange(0, 5000, 7, device=device)
        kernels.teacher_rows(
            full,
            ids,
            torch.empty(3, len(ids), dtype=full.dtype, device=device),
            torch.empty(3, device=device),
            torch.empty(3, dtype=torch.int64, device=device),
        )

    fallbacks = {}
    for name, run, module in (
        ("chain merge", chain, attention),
        ("soft cross-entropy", soft_ce, loss),
        ("teacher rows", teacher, ttt),
    ):
        try:
            run()
            sync(device)
        except Exception as e:  # noqa: BLE001 - fall back to torch for this run, say so
            module.triton_available = lambda: False
            fallbacks[name] = f"{type(e).__name__}: {str(e)[:500]}"
    return fallbacks


CHECK_SIZES = dict(T=300, L=700, V=32000, ttt_L=512)  # slots for attention, loss rows, vocab, TTT slots


def check_gpu(device) -> dict:
    from aerie_trainer import attention as A
    from aerie_trainer import kernels, loss
    from aerie_trainer.ttt import TTT

    out = {}
    g = torch.Generator(device=device).manual_seed(1)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    for name, (nh, nkv, hd) in {"llama8b": (32, 8, 128), "smol": (9, 3, 64)}.items():
        B, T, n = 2, CHECK_SIZES["T"], 3
        q, dout = (rnd(B, T, nh, hd).transpose(1, 2) for _ in range(2))
        k, v = (rnd(B, T, nkv, hd).transpose(1, 2) for _ in range(2))
        ck, cv = rnd(n, B, T, nkv, hd), rnd(n, B, T, nkv, hd)
        res = {"flash_mode": A.flash_mode(q, k)}
        scale = hd**-0.5
        # the merge kernels against the torch merge, same inputs
        o_p, lse_p = A._math_forward(q, k, v, None, scale)
        ko, kl = kernels.chain_merge_forward(q, o_p, lse_p, ck, cv, scale)
        to, tl_ = A.merge_forward_torch(q, o_p, lse_p, ck, cv, scale)
        res["merge_fwd_rel"] = [rel(ko, to), rel(kl, tl_)]
        kb = kernels.chain_merge_backward(dout, q, to, tl_, ck, cv, q, scale)
        tb = A.merge_backward_torch(dout, q, to, tl_, ck, cv, q, scale)
        res["merge_bwd_rel"] = [rel(a, b) for a, b in zip(kb, tb)]
        # the whole attention (flash + kernels, bf16) against the float32 math path (explicit mask)
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        tensors = [q, k, v, ck, cv]
        fast = [t.detach().requires_grad_() for t in tensors]
        o1 = A.attend(*fast)
        o1.backward(dout)
        slow = [t.detach().float().requires_grad_() for t in tensors]
        o2 = A.attend(*slow, mask=causal)
        o2.backward(dout.float())
        res["attention_rel_out"] = rel(o1, o2)
        res["attention_rel_grads"] = [rel(a.grad, b.grad) for a, b in zip(fast, slow)]
        out[f"attention_{name}"] = res
    # the loss kernels against the torch loss, bf16 logits, a strided target view
    B, L, S, V = 2, CHECK_SIZES["L"], 7, CHECK_SIZES["V"]
    z = rnd(B, L, V) * 4
    stored = rnd(B, L + S, V) * 4
    t = stored[:, 3 : 3 + L]
    t_lse = torch.logsumexp(t.float(), -1)
    w = torch.rand(B, L, generator=g, device=device)
    w[0, :10] = 0
    kf = kernels.soft_ce_forward(z, t, t_lse, w)
    tf = loss.soft_ce_forward_torch(z, t, t_lse, w)
    go = torch.tensor(0.7, device=device)
    kg = kernels.soft_ce_backward(z, t, t_lse, w, tf[1], tf[2], go)
    tg = loss.soft_ce_backward_torch(z, t, t_lse, w, tf[1], tf[2], go)
    out["loss"] = dict(
        rows_rel=rel(kf[0], tf[0]),
        lse_rel=rel(kf[1], tf[1]),
        sum_p_rel=rel(kf[2], tf[2]),
        argmax_equal=bool((kf[3] == tf[3]).all()),
        grad_rel=rel(kg, tg),
    )
    # the teacher kernel against torch's argmax / index_select / logsumexp
    full = rnd(300, 128256) * 3
    ids = torch.randperm(128256, generator=g, device=device)[:32000].sort().values
    lo, ls, am = (
        torch.empty(300, 32000, dtype=full.dtype, device=device),
        torch.empty(300, device=device),
        torch.empty(300, dtype=torch.int64, device=device),
    )
    kernels.teacher_rows(full, ids, lo, ls, am)
    out["teacher"] = dict(
        logits_equal=bool(torch.equal(lo, full[:, ids])),
        argmax_equal=bool(torch.equal(am, full.argmax(-1))),
        lse_rel=rel(ls, torch.logsumexp(full[:, ids].float(), -1)),
    )
    # a linear layer's weight gradient summed in float32 by the matmuls, against bf16 matmuls + float32 sums
    from aerie_trainer import precision

    w = torch.randn(512, 1024, generator=g, device=device, requires_grad=True)
    xs, gs = [rnd(700, 1024) for _ in range(4)], [rnd(700, 512) for _ in range(4)]
    with precision.weights_cast_once():
        ys = [precision.linear(x, w) for x in xs]
    sum((y * gy).sum() for y, gy in zip(ys, gs)).backward()
    want = sum((gy.t() @ x).float() for x, gy in zip(xs, gs))
    out["weight_grad_sum"] = dict(rel=rel(w.grad, want), out_dtype_matmuls=precision._MM_OUT_DTYPE.get("cuda", True))
    # the clip folded into the fused AdamW against clip_grad_norm_ then the step
    from aerie.contracts import TrainConfig
    from aerie_trainer.trainer import clip_and_step, make_optimizer

    start = [torch.randn(300, 200, generator=g, device=device) for _ in range(3)]
    grad = [torch.randn(300, 200, generator=g, device=device) * 5 for _ in range(3)]
    moved = []
    for fold in (True, False):
        ps = [torch.nn.Parameter(x.clone()) for x in start]
        opt = make_optimizer(ps, TrainConfig(), device)
        for _ in range(2):
            for p, gr in zip(ps, grad):
                p.grad = gr.clone()
            clip_and_step(opt, 0.5, fold=fold)
        moved.append(torch.cat([(p.detach() - x).flatten() for p, x in zip(ps, start)]))
    out["clip_folded_into_adamw"] = dict(rel=rel(moved[0], moved[1]))
    # a whole TTT step: bf16 fast path against float32 (math attention, float32 compute), same weights;
    # the Llama layer and the MLA layer (its keys/values zero-padded to 192 dims through flash and the merge)
    from aerie_trainer.ttt import TargetHead, ttt_forward

    ttt_L = CHECK_SIZES["ttt_L"]
    for key, shape in (
        ("ttt_step_bf16_vs_fp32", dict(SHAPES["smol135m"], Vd=4096)),
        ("ttt_step_mla", SHAPES["smol_mla"]),
    ):
        inp = make_inputs(shape, 2, ttt_L, device)
        results = []
        for dtype in (torch.bfloat16, torch.float32):
            drafter = aerie_drafter(shape, device)
            drafter.set_vocab(inp["draft_ids"])
            drafter.to(device)
            target = TargetHead(inp["head"], drafter.t2d, drafter.d2t, torch.bfloat16)
            o = ttt_forward(
                TTT(drafter, TTT_STEPS, 0.8, compute_dtype=dtype), aerie_batch(inp, ttt_L, TTT_STEPS, device), target
            )
            o.loss.backward()
            results.append((o, {n: p.grad for n, p in drafter.named_parameters() if p.requires_grad}))
        (fast, gf), (ref, gr) = results
        out[key] = dict(
            loss=[float(fast.loss), float(ref.loss)],
            step_loss_rel=rel(fast.step_loss, ref.step_loss),
            grad_rel={n: round(rel(gf[n], gr[n]), 5) for n in gr},
        )
    return out


# --------------------------------------------------------------------------------------
# --attention: ways to attend over the TTT chain, timed (forward + backward of all 7 steps)
# --------------------------------------------------------------------------------------
def reference_chain_step(q, base, chain, mask):
    """The first implementation: K/V repeated per query head, a dense mask, explicit scores."""
    rep = q.shape[1] // base[0].shape[1]
    pk, pv = (t.repeat_interleave(rep, 1) for t in base)
    scale = q.shape[-1] ** -0.5
    scores = ((q @ pk.transpose(-1, -2)) * scale).masked_fill(~mask, float("-inf"))
    steps = [(ck.repeat_interleave(rep, 1), cv.repeat_interleave(rep, 1)) for ck, cv in chain]
    diag = [(q * ck).sum(-1, keepdim=True) * scale for ck, _ in steps]
    probs = torch.softmax(torch.cat([scores, *diag], dim=-1).float(), dim=-1).to(q.dtype)
    S = scores.shape[-1]
    out = probs[..., :S] @ pv
    for j, (_, cv) in enumerate(steps):
        out = out + probs[..., S + j : S + j + 1] * cv
    return out


def attention_variants(device):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from aerie_trainer.attention import attend

    flex = torch.compile(flex_attention)
    masks = {}

    def aerie(q, base, chain, L):
        if not chain:
            return attend(q, *base)
        ck = torch.stack([c.transpose(1, 2) for c, _ in chain])
        cv = torch.stack([c.transpose(1, 2) for _, c in chain])
        return attend(q, *base, ck, cv)

    def first(q, base, chain, L):
        causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
        if not chain:
            rep = q.shape[1] // base[0].shape[1]
            return torch.nn.functional.scaled_dot_product_attention(
                q, base[0].repeat_interleave(rep, 1), base[1].repeat_interleave(rep, 1), is_causal=True
            )
        return reference_chain_step(q, base, chain, causal)

    def flex_cache(q, base, chain, L):
        n = len(chain)
        if n not in masks:

            def mask_mod(b, h, q_idx, kv_idx):
                return (kv_idx <= q_idx) | ((kv_idx >= L) & (kv_idx % L == q_idx))

            masks[n] = create_block_mask(mask_mod, None, None, L, (n + 1) * L, device=device)
        k = torch.cat([base[0], *[c for c, _ in chain]], dim=2)
        v = torch.cat([base[1], *[c for _, c in chain]], dim=2)
        return flex(q, k, v, block_mask=masks[n], enable_gqa=True)

    return {
        "aerie (flash + chain merge)": aerie,
        "flex attention, growing KV cache": flex_cache,
        "first implementation (expanded K/V, dense mask)": first,
    }


def bench_attention(device, deadline: float) -> list[dict]:
    """deadline: time.perf_counter() after which no further shape is started."""
    rows = []
    for shape_name, B in (("llama8b", 1), ("smol135m", 4)):
        if time.perf_counter() > deadline:
            rows.append(dict(shape=shape_name, B=B, skipped="deadline"))
            continue
        s = SHAPES[shape_name]
        L, nh, nkv, hd = 2048, s["nh"], s["nkv"], s["hd"]
        g = torch.Generator(device=device).manual_seed(0)

        def rnd(*shape):
            return torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16)

        qs = [rnd(B, L, nh, hd).transpose(1, 2) for _ in range(TTT_STEPS)]
        kvs = [(rnd(B, L, nkv, hd).transpose(1, 2), rnd(B, L, nkv, hd).transpose(1, 2)) for _ in range(TTT_STEPS)]
        ups = [rnd(B, nh, L, hd) for _ in range(TTT_STEPS)]
        for name, fn in attention_variants(device).items():
            row = dict(shape=shape_name, B=B, variant=name)

            def chain_pass():
                leaves = [t.detach().requires_grad_() for t in qs + [x for kv in kvs for x in kv]]
                q_l, kv_l = leaves[:TTT_STEPS], leaves[TTT_STEPS:]
                kv_pairs = list(zip(kv_l[0::2], kv_l[1::2]))
                total = 0
                for k in range(TTT_STEPS):
                    o = fn(q_l[k], kv_pairs[0], kv_pairs[1 : k + 1], L)
                    total = total + (o * ups[k]).sum()
                total.backward()

            try:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                t0 = time.perf_counter()
                chain_pass()
                torch.cuda.synchronize()
                row["first_call_s"] = round(time.perf_counter() - t0, 2)  # compile included
                chain_pass()
                ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(5)]
                for a, b in ev:
                    a.record()
                    chain_pass()
                    b.record()
                torch.cuda.synchronize()
                row["fwd_bwd_ms_median"] = round(sorted(a.elapsed_time(b) for a, b in ev)[2], 2)
                row["peak_extra_GiB"] = round((torch.cuda.max_memory_allocated() - before) / 2**30, 3)
            except Exception as e:  # noqa: BLE001 - record and go on
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log("attention", json.dumps(row))
            rows.append(row)
            gc.collect()
            torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--plan", default="full", choices=sorted(PLANS))
    ap.add_argument("--tiny", action="store_true", help="the CPU smoke test: --plan tiny")
    ap.add_argument("--out", help="where the JSON goes (required unless --summarize)")
    ap.add_argument("--summarize", metavar="JSON", help="print the table of an earlier run's JSON and exit")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--check", action="store_true", help="GPU: check the kernels against the torch paths first")
    ap.add_argument("--attention", action="store_true", help="GPU: time the attention variants (after the plan)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--only", default=None, help="comma-separated plan indices")
    ap.add_argument("--repeat", type=int, default=1, help="run the plan this many times (profiles in the first)")
    ap.add_argument("--deadline", type=float, default=1e9, help="seconds from start; later items are skipped")
    args = ap.parse_args()
    if args.summarize:
        with open(args.summarize) as f:
            print(table(json.load(f)))
        return
    if not args.out:
        ap.error("--out is required")
    device = torch.device(args.device)
    if args.tiny:
        args.plan, args.warmup, args.iters = "tiny", 1, 3
    if device.type != "cuda" and args.plan != "tiny":
        ap.error(f"--device {args.device}: only --tiny runs off a GPU (SpecForge's Triton loss needs one)")
    start = time.perf_counter()
    env = dict(torch=torch.__version__, python=sys.version.split()[0], device=str(device), command=" ".join(sys.argv))
    if device.type == "cuda":
        env.update(
            gpu=torch.cuda.get_device_name(0),
            gpu_mem_GiB=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
        )
    out = dict(env=env, warmup=args.warmup, iters=args.iters, ttt_steps=TTT_STEPS, results=[], skipped=[])

    def save():
        out["elapsed_s"] = round(time.perf_counter() - start, 1)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)

    if device.type == "cuda":
        out["fallbacks"] = guard_kernels(device)
        log("kernel fallbacks", out["fallbacks"] or "none")
    if args.check:
        try:
            out["check"] = check_gpu(device)
        except Exception as e:  # noqa: BLE001 - record it, the timing still runs
            out["check"] = dict(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
        log("check", json.dumps(out["check"]))
        save()
        gc.collect()
        torch.cuda.empty_cache()
    plan = PLANS[args.plan]
    if args.only:
        plan = [plan[int(i)] for i in args.only.split(",")]
    plan = [dict(it, run=n, profile=it.get("profile", False) and n == 0) for n in range(args.repeat) for it in plan]
    for item in plan:
        if time.perf_counter() - start > args.deadline:
            out["skipped"].append(dict(item, reason="deadline"))
            continue
        log("RUN", item)
        try:
            r = run_item(item, device, args)
        except Exception as e:  # noqa: BLE001 - record it, go on with the next
            r = dict(item, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
        torch._dynamo.reset()  # compiled modules keep the previous trainer alive otherwise
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        out["results"].append(r)
        log(
            "DONE",
            json.dumps(
                {
                    k: r.get(k)
                    for k in (
                        "trainer",
                        "shape",
                        "B",
                        "tokens_per_s",
                        "step_ms_mean",
                        "peak_mem_own_GiB",
                        "warmup_s",
                        "losses_first_last",
                        "error",
                    )
                }
            ),
        )
        save()
    if args.attention and device.type == "cuda":
        if time.perf_counter() - start > args.deadline:
            out["skipped"].append(dict(attention=True, reason="deadline"))
        else:
            out["attention"] = bench_attention(device, start + args.deadline)
        save()
    print(table(out))
    log("total", round(time.perf_counter() - start, 1), "s")


def gemm_flops_per_token(shape: dict) -> float:
    """Matrix-multiply FLOPs per token of one aerie step (what the profile files under GEMM).

    Per TTT step the drafter's matmuls see each token once: q/k/v read [embedding; hidden] (2H),
    o, the MLP and the draft lm_head; forward 2 FLOPs per weight, backward 4 (input and weight
    gradients). The fc over the K capture points runs once (its input needs no gradient: 2 + 2),
    the target's head once, forward only. Attention (flash, chain merge) is not counted here.
    """
    H, nh, nkv, hd, I, V, Vd, K = (shape[k] for k in ("H", "nh", "nkv", "hd", "I", "V", "Vd", "K"))
    per_step = 2 * H * (nh + 2 * nkv) * hd + nh * hd * H + 3 * H * I + H * Vd
    return 6 * per_step * TTT_STEPS + 4 * K * H * H + 2 * H * V


def floor_rows(out: dict) -> list[str]:
    """For each profiled aerie item: GEMM time, its TFLOP/s, and the ratio to SpecForge's step
    that aerie would reach if every other kernel took no time (the matmul floor)."""
    sf = {}
    for r in out["results"]:
        if r.get("trainer") == "specforge" and r.get("step_ms_mean"):
            sf.setdefault((r["shape"], r["B"]), []).append(r["step_ms_mean"])
    lines = []
    for r in out["results"]:
        prof = r.get("profile")
        if r.get("trainer") != "aerie" or not isinstance(prof, dict):
            continue
        gemm = prof["categories_ms"].get("GEMM", 0.0)
        other = prof["gpu_kernel_ms"] - gemm
        tflops = gemm_flops_per_token(SHAPES[r["shape"]]) * r["tokens_per_step"] / (gemm / 1e3) / 1e12
        sf_ms = sorted(sf.get((r["shape"], r["B"]), [float("nan")]))
        sf_mid = sf_ms[len(sf_ms) // 2]
        lines.append(
            f"{r['shape']:<18} {r['B']:<2} GEMM {gemm:7.1f} ms at {tflops:5.0f} TFLOP/s, other kernels "
            f"{other:6.1f} ms; SpecForge step {sf_mid:6.1f} ms -> ratio at most {sf_mid / gemm:.2f} "
            f"with nothing but the matmuls; 1.5x needs the others <= {sf_mid / 1.5 - gemm:.1f} ms"
        )
    return lines


def table(out: dict) -> str:
    lines = ["shape              B  aerie tok/s  SpecForge tok/s  ratio  aerie GiB  SpecForge GiB  aerie warmup s"]
    by = {}
    for r in out["results"]:
        by.setdefault((r["shape"], r["B"], r.get("run", 0)), {})[r["trainer"]] = r
    for (shape, B, _), pair in by.items():
        a, s = pair.get("aerie", {}), pair.get("specforge", {})
        at, st = a.get("tokens_per_s"), s.get("tokens_per_s")
        ratio = f"{at / st:.2f}" if at and st else "-"
        lines.append(
            f"{shape:<18} {B:<2} {at or a.get('error', '-')!s:<12} {st or s.get('error', '-')!s:<16} "
            f"{ratio:<6} {a.get('peak_mem_own_GiB', '-')!s:<10} {s.get('peak_mem_own_GiB', '-')!s:<14} "
            f"{a.get('warmup_s', '-')}"
        )
    floor = floor_rows(out)
    if floor:
        lines += ["", "matmul floor (profiled items; the profile's kernel times):", *floor]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
