"""The trainer loop: components (data, drafter, optimizer, checkpoints) composed by a thin loop.

One process (CPU or one GPU) or one rank of a `torch.distributed` job (DDP; rank 0 checkpoints).
A trainer built again with the same request resumes from its last checkpoint: the learning rate
is a pure function of the step, the data position is (epoch, batch), and the optimizer state,
RNG and loss curve come back from the store (aerie_trainer.checkpoint).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from aerie.contracts import ProgressEvent, TrainConfig, TrainRequest
from aerie.store import ObjectStore
from aerie.target import describe

from aerie_trainer.checkpoint import Checkpointer, TrainerState
from aerie_trainer.data import Batch, HiddenData, load_runs
from aerie_trainer.model import build_drafter, load_target_lm_head
from aerie_trainer.ttt import TTT, TargetHead, ttt_forward
from aerie_trainer.vocab import build_draft_vocab, coverage, draft_vocab_size

Progress = Callable[[ProgressEvent], None]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to 10% of the peak (pure function of the step)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


# --------------------------------------------------------------------------------------
# Distributed setup (torchrun)
# --------------------------------------------------------------------------------------
@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    def mean(self, value: float) -> float:
        if self.world_size == 1:
            return value
        t = torch.tensor([value], device=self.device)
        torch.distributed.all_reduce(t)
        return float(t) / self.world_size


def setup_dist(device: str) -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(device=torch.device(device))
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    dev = torch.device(f"cuda:{local}") if device.startswith("cuda") else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return Dist(rank, world, dev)


# --------------------------------------------------------------------------------------
# The trainer: components composed by a thin loop
# --------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, store: ObjectStore, request: TrainRequest, dist: Dist, progress: Progress | None = None):
        self.store, self.request, self.cfg, self.dist = store, request, request.config, dist
        self.progress = progress or (lambda event: None)
        self.train_id = request.train_id or default_train_id(request)
        cfg = self.cfg
        self.runset = load_runs(store, request.runs)
        self.data = HiddenData(store, self.runset, batch_tokens=cfg.batch_tokens, max_seq_tokens=cfg.max_seq_tokens,
                               ttt_steps=cfg.ttt_steps, seed=cfg.seed, holdout_fraction=cfg.holdout_fraction,
                               prefetch=cfg.prefetch, rank=dist.rank, world_size=dist.world_size)
        torch.manual_seed(cfg.seed)
        target = self.runset.spec.target
        if describe(request.model).weights_sha256 != target.weights_sha256:
            raise ValueError(f"target folder {request.model} holds other weights than the model runs {request.runs} were "
                             f"captured from ({target.model}, sha256 {target.weights_sha256[:12]}…): pass that model")
        self.drafter = build_drafter(request.model, len(self.runset.capture_points),
                                     draft_vocab_size(cfg.draft_vocab_size, target.vocab_size), cfg.drafter)
        self.drafter.to(dist.device)
        self.names = {i: n for i, (n, p) in enumerate((n, p) for n, p in self.drafter.named_parameters() if p.requires_grad)}
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.checkpointer = Checkpointer(store, self.train_id)
        self.state = self.checkpointer.load(self.drafter, self.optimizer, self.names) or TrainerState()
        self.resumed_from = self.state.step if self.state.step else None
        if self.resumed_from is None:  # a fresh run builds its vocabulary; a resumed one loaded it
            counts = self.data.loss_token_counts(target.vocab_size)
            draft_ids = build_draft_vocab(counts, self.drafter.config.draft_vocab_size)
            self.drafter.set_vocab(draft_ids)
            self.state.metrics["draft_vocab_coverage"] = coverage(counts, draft_ids)
        self.drafter.to(dist.device)
        head = load_target_lm_head(request.model) if self.runset.spec.target_signal == "final" else None
        amp = dist.device.type == "cuda"
        self.autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if amp else contextlib.nullcontext
        self.target = TargetHead(None if head is None else head.to(dist.device), self.drafter.t2d, self.drafter.d2t,
                                 torch.bfloat16 if amp else torch.float32)
        self.model = TTT(self.drafter, cfg.ttt_steps, cfg.step_decay)
        if dist.world_size > 1:
            self.model = torch.nn.parallel.DistributedDataParallel(self.model, device_ids=[dist.device.index] if amp else None)

    def micro_step(self, batch: Batch, sync: bool) -> float:
        ctx = contextlib.nullcontext() if sync or self.dist.world_size == 1 else self.model.no_sync()
        with ctx, self.autocast():
            out = ttt_forward(self.model, batch, self.target)
            (out.loss / self.cfg.grad_accum).backward()
        return float(out.loss.detach())

    def train(self) -> TrainerState:
        cfg, st = self.cfg, self.state
        batches = self.data.batches(st.epoch, st.batch)
        wait0 = self.data.wait_s
        t0 = time.perf_counter()
        try:
            while st.step < cfg.steps:
                for group in self.optimizer.param_groups:
                    group["lr"] = lr_at(st.step, cfg)
                loss, tokens = 0.0, 0
                for micro in range(cfg.grad_accum):
                    (st.epoch, st.batch), batch = next(batches)
                    tokens += batch.tokens
                    loss += self.micro_step(batch.to(self.dist.device), sync=micro == cfg.grad_accum - 1) / cfg.grad_accum
                torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                st.step += 1
                st.losses.append(self.dist.mean(loss))
                st.tokens += round(self.dist.mean(tokens) * self.dist.world_size)
                now = time.perf_counter()
                st.train_seconds += now - t0
                st.data_wait_seconds += self.data.wait_s - wait0
                t0, wait0 = now, self.data.wait_s
                rate = st.step / max(st.train_seconds, 1e-9)
                self.progress(ProgressEvent(stage="train", step=st.step, steps=cfg.steps, loss=st.losses[-1], tokens=st.tokens,
                                            eta_s=round((cfg.steps - st.step) / rate, 1) if rate else None))
                if st.step % cfg.checkpoint_every == 0 or st.step == cfg.steps:
                    self.save()
        finally:
            batches.close()
        return st

    def save(self) -> None:
        if self.dist.main:
            self.checkpointer.save(self.drafter, self.optimizer, self.names, self.state)
        self.dist.barrier()


def default_train_id(request: TrainRequest) -> str:
    """Same inputs -> same id: a redelivered task finds its own checkpoints."""
    basis = request.model_dump_json(exclude={"train_id", "publish"})
    return f"{request.drafter}-{hashlib.sha256(basis.encode()).hexdigest()[:12]}"
