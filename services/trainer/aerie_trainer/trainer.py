"""The trainer loop: components (data, drafter, optimizer, checkpoints, tracking) composed by a thin loop.

One process (CPU or one GPU), or one rank of a `torch.distributed` job: DDP or FSDP2
(aerie_trainer.parallel; rank 0 checkpoints, tracks and evaluates). A trainer built again with the
same request resumes from its last checkpoint (a warm start, `init_from`, loads its source only when
there is none: aerie_trainer.warm_start): the learning rate is a pure function of the step,
the data position is (epoch, batch), and the optimizer state, RNG and loss curve come back from
the store (aerie_trainer.checkpoint) — the same files whatever the sharding.

A streamed job (`TrainConfig.stream`) starts while its runs are extracted: HiddenData plans it from
the token shards and takes epoch 0 in arrival order (the windows go into each checkpoint); its
step count and every later epoch are a complete job's.

Steps: `TrainConfig.steps`, else `epochs` passes over the batches (divided by `grad_accum` times
the ranks, which share every epoch's batches: HiddenData.rank_plan); warmup: `warmup_steps`, else 1.5% of the steps.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from aerie.contracts import ProgressEvent, TrainRequest
from aerie.errors import ExpectedError
from aerie.store import ObjectStore
from aerie.target import describe
from aerie_trainer.checkpoint import Checkpointer, TrainerState
from aerie_trainer.data import Batch, HiddenData, load_runs
from aerie_trainer.model import Eagle3Drafter, build_drafter, load_target_lm_head
from aerie_trainer.parallel import Dist, full_state, load_full_state, set_gradient_sync, setup_dist, wrap
from aerie_trainer.precision import compute_dtype
from aerie_trainer.tracking import Tracking
from aerie_trainer.ttt import TTT, TargetHead, ttt_forward
from aerie_trainer.vocab import choose_draft_vocab, draft_vocab_size
from aerie_trainer.warm_start import load_into

Progress = Callable[[ProgressEvent], None]
WARMUP_FRACTION = 0.015  # SpecForge's reference warmup ratio

__all__ = [
    "Dist",
    "Progress",
    "Trainer",
    "clip_and_step",
    "lr_at",
    "make_optimizer",
    "pack_stats",
    "read_stats",
    "setup_dist",
]


def lr_at(step: int, lr: float, steps: int, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak (pure function of the step)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


class TrainingDiverged(ExpectedError, RuntimeError):
    """The loss turned non-finite: the job stops before the step is checkpointed or anything is
    published (the weights it would publish are NaN)."""


class Trainer:
    def __init__(
        self,
        store: ObjectStore,
        request: TrainRequest,
        dist: Dist,
        progress: Progress | None = None,
        sharding: str = "single",
        trackers: list[str] = ("tensorboard",),
    ):
        self.store, self.request, self.cfg, self.dist, self.sharding = store, request, request.config, dist, sharding
        self.progress = progress or (lambda event: None)
        self.train_id = request.resolved_train_id
        cfg = self.cfg
        self.runset = load_runs(store, request.runs, stream=cfg.stream)
        self.data = HiddenData(
            store,
            self.runset,
            batch_tokens=cfg.batch_tokens,
            max_seq_tokens=cfg.max_seq_tokens,
            ttt_steps=cfg.ttt_steps,
            seed=cfg.seed,
            holdout_fraction=cfg.holdout_fraction,
            prefetch=cfg.prefetch,
            rank=dist.rank,
            world_size=dist.world_size,
            stream=cfg.stream,
        )
        per_step = cfg.grad_accum * dist.world_size  # batches the group takes a step
        self.steps = cfg.steps or max(1, math.ceil(cfg.epochs * len(self.data.epoch_plan(0)) / per_step))
        self.warmup = cfg.warmup_steps if cfg.warmup_steps is not None else round(WARMUP_FRACTION * self.steps)
        torch.manual_seed(cfg.seed)
        target = self.runset.spec.target
        if describe(request.model).weights_sha256 != target.weights_sha256:
            raise ValueError(
                f"target folder {request.model} holds other weights than the model runs {request.runs} were "
                f"captured from ({target.model}, sha256 {target.weights_sha256[:12]}…): pass that model"
            )
        drafter = build_drafter(
            request.model,
            len(self.runset.capture_points),
            draft_vocab_size(cfg.draft_vocab_size, target.vocab_size),
            cfg.drafter,
        )
        self.checkpointer = Checkpointer(store, self.train_id)
        saved = self.checkpointer.load()  # digests and values checked: CheckpointRefused, never resumed
        if saved:
            self.checkpointer.check_fits(saved[0], saved[1], drafter)
        self.state = saved[2] if saved else TrainerState()
        self.resumed_from = self.state.step if self.state.step else None
        if cfg.stream:  # epoch 0 as the checkpoint took it (the shards' arrival order then)
            self.data.restore_windows(self.state.stream_windows)
        # the target's head (gigabytes at a large vocabulary), read once: the vocabulary choice of a
        # fresh run and the loss's target both use it
        head = load_target_lm_head(request.model) if self.runset.spec.target_signal == "final" else None
        if saved:  # the full weights (and the vocabulary in d2t/t2d) before any sharding; never init_from again
            drafter.load_state_dict(saved[0], strict=False)
        elif cfg.init_from:  # a warm start: the source's weights and vocabulary
            origin = load_into(
                drafter, store, cfg.init_from, self.runset.capture_points, target.architecture, target.num_layers
            )
            self.state.metrics["init_from"] = origin.model_dump(mode="json")
        else:  # a fresh run builds its vocabulary; a resumed one loaded it
            draft_ids, covered, of = choose_draft_vocab(
                self.data,
                drafter.config.draft_vocab_size,
                target.vocab_size,
                cfg.draft_vocab_from,
                None
                if head is None
                else head.to(dist.device, torch.bfloat16 if dist.device.type == "cuda" else torch.float32),
                dist.device,
                cfg.vocab_sample_tokens,
            )
            drafter.set_vocab(draft_ids)
            self.state.metrics.update(draft_vocab_coverage=covered, draft_vocab_coverage_of=of)
        drafter.to(dist.device)
        dtype = compute_dtype(dist.device)
        if dtype is not None:  # the frozen target embedding in the compute dtype (never trained, never exported)
            drafter.embed_tokens.to(dtype)
        self.drafter = drafter
        # what rank 0 evaluates and exports: the drafter itself, or under FSDP a full copy that
        # shares the frozen embedding and takes the gathered weights (sync_full_drafter)
        self.full_drafter = drafter if sharding != "fsdp" or not dist.main else self._full_copy(drafter)
        self.target = TargetHead(
            None if head is None else head.to(dist.device), drafter.t2d, drafter.d2t, dtype or torch.float32
        )
        # float32 parameters are the master weights; the step computes in `dtype`, each weight cast
        # once per forward (per call under FSDP, whose modules gather their weights at each call)
        self.ttt = TTT(
            drafter,
            cfg.ttt_steps,
            cfg.step_decay,
            compute_dtype=dtype,
            cast_once=sharding != "fsdp",
            checkpoint=cfg.activation_checkpointing,
        )
        self.model = wrap(self.ttt, sharding, dist)
        self.optimizer = make_optimizer([p for p in drafter.parameters() if p.requires_grad], cfg, dist.device)
        if saved:
            load_full_state(drafter, self.optimizer, sharding, saved[0], saved[1])
        self.tracking = (
            Tracking(
                store,
                self.train_id,
                request.drafter,
                request.runs,
                list(trackers),
                {**cfg.model_dump(mode="json"), "steps": self.steps},
                sharding,
                dist.world_size,
            )
            if dist.main
            else None
        )

    @staticmethod
    def _full_copy(drafter: Eagle3Drafter) -> Eagle3Drafter:
        with torch.device("meta"):
            copy = Eagle3Drafter(drafter.config)
        copy.to_empty(device=drafter.fc.weight.device)
        copy.embed_tokens = drafter.embed_tokens  # shared, frozen, never sharded
        copy.load_state_dict(
            {k: v for k, v in drafter.state_dict().items() if not k.startswith("embed_tokens.")}, strict=False
        )
        copy.midlayer.self_attn.inv_freq = (
            drafter.midlayer.self_attn.inv_freq.clone()
        )  # a computed buffer, not in the state dict
        return copy

    def sync_full_drafter(self) -> Eagle3Drafter | None:
        """Every rank calls it (FSDP gathers); rank 0 gets the full, current drafter."""
        if self.sharding == "fsdp":
            weights, _ = full_state(self.drafter, self.optimizer, self.sharding, optimizer_too=False)
            if self.dist.main:
                self.full_drafter.load_state_dict(weights, strict=False)
        return self.full_drafter if self.dist.main else None

    def micro_step(self, batch: Batch, sync: bool) -> torch.Tensor:
        """One micro-batch's forward and backward -> its statistics, still on the device (pack_stats)."""
        with set_gradient_sync(self.model, self.sharding, sync):
            out = ttt_forward(self.model, batch, self.target)
            (out.loss / self.cfg.grad_accum).backward()
        return pack_stats(out)

    def train(self, measure: Callable[[TrainerState], None] | None = None) -> TrainerState:
        """Steps until `self.steps`, checkpointing every `checkpoint_every`. `measure(state)`: called
        on every rank every `eval_every` steps and at each checkpoint, before the checkpoint is
        written (what it records in `state.metrics` is resumed with it)."""
        cfg, st = self.cfg, self.state
        batches = self.data.batches(st.epoch, st.batch)
        wait0 = self.data.wait_s
        t0 = time.perf_counter()
        try:
            while st.step < self.steps:
                lr = lr_at(st.step, cfg.lr, self.steps, self.warmup)
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                tokens, stats = 0, 0
                for micro in range(cfg.grad_accum):
                    (st.epoch, st.batch), batch = next(batches)
                    tokens += batch.tokens
                    stats = stats + self.micro_step(batch.to(self.dist.device), sync=micro == cfg.grad_accum - 1)
                clip_and_step(self.optimizer, cfg.grad_clip, fold=self.sharding != "fsdp")
                # the step's one host sync, after the optimizer is queued (the GPU keeps working)
                loss, step_loss, correct, valid = read_stats(stats, cfg.ttt_steps, cfg.grad_accum)
                st.step += 1
                st.losses.append(self.dist.mean(loss))
                if not math.isfinite(st.losses[-1]):  # the same mean on every rank: all stop here
                    raise TrainingDiverged(
                        f"training {self.request.resolved_train_id}: loss turned {st.losses[-1]} at step {st.step} "
                        f"(last checkpoint kept, nothing published): check the data and the learning rate (lr={cfg.lr})"
                    )
                st.tokens += round(self.dist.mean(tokens) * self.dist.world_size)
                now = time.perf_counter()
                st.train_seconds += now - t0
                st.data_wait_seconds += self.data.wait_s - wait0
                t0, wait0 = now, self.data.wait_s
                rate = st.step / max(st.train_seconds, 1e-9)
                eta = round((self.steps - st.step) / rate, 1) if rate else None
                self._track(st, lr, step_loss, correct, valid, eta)
                self.progress(
                    ProgressEvent(
                        stage="train", step=st.step, steps=self.steps, loss=st.losses[-1], tokens=st.tokens, eta_s=eta
                    )
                )
                checkpoint = st.step % cfg.checkpoint_every == 0 or st.step == self.steps
                if measure is not None and cfg.eval_every and (checkpoint or st.step % cfg.eval_every == 0):
                    measure(st)
                    t0 = time.perf_counter()  # the measurement is not training time
                if checkpoint:
                    self.save()
        finally:
            batches.close()
        return st

    def _track(self, st: TrainerState, lr: float, step_loss, correct, valid, eta: float | None) -> None:
        if self.tracking is None:
            return
        tps = st.tokens / max(st.train_seconds, 1e-9)
        scalars = {
            "loss/total": st.losses[-1],
            "lr": lr,
            "tokens_per_second": tps,
            "data_wait_fraction": st.data_wait_seconds / max(st.train_seconds, 1e-9),
        }
        for k in range(len(step_loss)):
            scalars[f"loss/step_{k}"] = float(step_loss[k])
            scalars[f"accuracy/step_{k}"] = float(correct[k]) / max(int(valid[k]), 1)
        self.tracking.log(scalars, st.step)
        self.tracking.progress(
            step=st.step,
            steps=self.steps,
            loss=st.losses[-1],
            tokens=st.tokens,
            eta_s=eta,
            tokens_per_second=round(tps, 1),
        )

    def save(self) -> None:
        """Every rank calls it (FSDP gathers the full state); rank 0 writes."""
        weights, optim = full_state(self.drafter, self.optimizer, self.sharding)
        if self.cfg.stream:
            self.state.stream_windows = self.data.window_ids()
        if self.dist.main:
            self.checkpointer.save(weights, optim, self.state)
            if self.tracking is not None:
                self.tracking.checkpointed(self.state.step)
        self.dist.barrier()


def make_optimizer(params: list[torch.nn.Parameter], cfg, device: torch.device) -> torch.optim.AdamW:
    """AdamW(0.9, 0.95) over the float32 master weights: one fused kernel for all of them on a GPU."""
    fused = True if torch.device(device).type == "cuda" else None
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay, fused=fused)


def clip_and_step(optimizer: torch.optim.Optimizer, max_norm: float, fold: bool = True) -> None:
    """clip_grad_norm_(max_norm), AdamW's step, zero_grad. With the fused AdamW (a GPU) and `fold`,
    the clip is the optimizer's own gradient divisor (`grad_scale`, as GradScaler passes it):
    g / max(1, (|g| + 1e-6) / max_norm) inside the AdamW kernel, one pass over the gradients
    fewer than scaling them first."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if fold and optimizer.defaults.get("fused") and params:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        optimizer.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0)
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale
    else:
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def pack_stats(out) -> torch.Tensor:
    """A TTTOutput -> [loss, per-step losses (S), correct (S), valid (S)] float64 on its device;
    micro-batches' packs add up."""
    counts = torch.stack([out.correct.sum((1, 2)), out.valid.sum((1, 2))]).flatten().double()
    return torch.cat([out.loss.detach().double().reshape(1), out.step_loss.double(), counts])


def read_stats(
    stats: torch.Tensor, steps: int, grad_accum: int
) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Summed packs -> (mean loss, mean per-step losses (S,) float32, correct (S,), valid (S,) int64):
    one transfer from the device, the training step's one host sync."""
    stats = stats.cpu()
    S = steps
    return (
        float(stats[0]) / grad_accum,
        (stats[1 : 1 + S] / grad_accum).float(),
        stats[1 + S : 1 + 2 * S].long(),
        stats[1 + 2 * S :].long(),
    )
