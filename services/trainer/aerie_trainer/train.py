"""Train an EAGLE-3 drafter on hidden-state shards in the store, then evaluate, export, publish.

One process (CPU or one GPU), the store and settings from AERIE_* variables:

    python -m aerie_trainer.train --runs sharegpt --drafter smollm2-eagle3 --model /path/to/target

Several GPUs on one host (DDP; rank 0 checkpoints, evaluates and publishes):

    torchrun --nproc_per_node 8 -m aerie_trainer.train --runs sharegpt --drafter NAME --model M

Through the queue (the worker runs the same `run_train`):

    celery -A aerie_trainer.worker call aerie.train --kwargs '{"runs": ["sharegpt"], "drafter": "NAME", "model": "M"}'

A killed trainer started again with the same arguments resumes from its last checkpoint.

Training-time test (TTT): step 0 runs the drafter over the whole sequence from the target's
captured states; step k feeds back the drafter's own hidden output of step k-1 with the next
ground-truth token, attending to the base sequence causally plus its own chain (the keys of
steps 1..k at the same slot) — exactly what chain drafting sees at serving time. Loss: soft
cross-entropy to the target distribution over the draft vocab, step k weighted by decay^k.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from aerie.contracts import TrainConfig, TrainRequest
from aerie.settings import Settings
from aerie.store import ObjectStore, open_store
from aerie.target import describe

from aerie_trainer.checkpoint import Checkpointer, TrainerState
from aerie_trainer.data import Batch, HiddenData, load_runs
from aerie_trainer.model import Eagle3Drafter, build_drafter, load_target_lm_head
from aerie_trainer.vocab import build_draft_vocab, coverage, draft_vocab_size, target_to_draft

Progress = Callable[[dict], None]


# --------------------------------------------------------------------------------------
# The target distribution
# --------------------------------------------------------------------------------------
class TargetHead:
    """Turns a batch's target signal into (p over the draft vocab, target argmax, trainable)."""

    def __init__(self, lm_head: torch.Tensor | None, t2d: torch.Tensor, d2t: torch.Tensor, dtype: torch.dtype):
        self.weight = None if lm_head is None else lm_head.to(dtype)  # (V, H) frozen
        self.t2d = t2d
        self.draft_ids = torch.arange(len(d2t), device=d2t.device) + d2t  # (Vd,) target ids
        self.to_draft = target_to_draft(t2d)  # (V,) draft index or -1

    @torch.no_grad()
    def __call__(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> p (B, W, Vd) float32, argmax (B, W) target ids (-1 unused), mask (B, W) bool."""
        rows = batch.loss_mask  # only trained slots need a distribution
        B, W = rows.shape
        Vd = len(self.draft_ids)
        if batch.final is not None:
            if self.weight is None:
                raise ValueError("shards carry the final state but no target lm_head was loaded")
            h = batch.final[rows].to(self.weight.dtype)  # (N, H)
            argmax, p = [], []
            for chunk in h.split(2048):
                logits = chunk @ self.weight.T  # (n, V)
                argmax.append(logits.argmax(-1))
                p.append(torch.softmax(logits[:, self.draft_ids].float(), dim=-1))
            argmax = torch.cat(argmax) if argmax else h.new_zeros(0, dtype=torch.int64)
            p = torch.cat(p) if p else h.new_zeros(0, Vd, dtype=torch.float32)
        else:
            ids, lp = batch.topk_ids[rows], batch.topk_logprobs[rows]  # (N, k)
            argmax = ids.gather(1, lp.argmax(-1, keepdim=True)).squeeze(1)
            d = self.to_draft[ids]  # (N, k)
            p = torch.zeros(len(ids), Vd, device=ids.device)
            p.scatter_add_(1, d.clamp(min=0), lp.exp() * (d >= 0))
            p = p / p.sum(-1, keepdim=True).clamp(min=1e-12)
        P = torch.zeros(B, W, Vd, device=rows.device)
        P[rows] = p
        ARG = torch.full((B, W), -1, dtype=torch.int64, device=rows.device)
        ARG[rows] = argmax
        mask = torch.zeros(B, W, dtype=torch.bool, device=rows.device)
        mask[rows] = self.t2d[argmax]  # the drafter cannot propose tokens outside its vocab
        return P, ARG, mask


# --------------------------------------------------------------------------------------
# Training-time test
# --------------------------------------------------------------------------------------
@dataclass
class TTTOutput:
    loss: torch.Tensor  # weighted sum over steps
    step_loss: torch.Tensor  # (S,)
    correct: torch.Tensor  # (S, B, L) bool: draft top-1 == target argmax, at a trainable slot
    valid: torch.Tensor  # (S, B, L) bool: the slot has a loss-masked target at that step


class TTT(torch.nn.Module):
    """The drafter unrolled for `steps` draft steps; one forward per batch (what DDP wraps)."""

    def __init__(self, drafter: Eagle3Drafter, steps: int, decay: float):
        super().__init__()
        self.drafter, self.steps, self.decay = drafter, steps, decay

    def forward(self, input_ids, aux, p, argmax, trainable, loss_mask, keep_logits: list | None = None):
        """input_ids (B, W), aux (B, L, K*Ht), p (B, W, Vd), argmax/trainable/loss_mask (B, W); W = L + S.

        keep_logits: a list that receives each step's logits (B, L, Vd) (tests, inspection).
        """
        drafter, L = self.drafter, aux.shape[1]
        hidden = drafter.project(aux.to(drafter.fc.weight.dtype))  # (B, L, H)
        slots = torch.arange(L, device=hidden.device)
        causal = torch.ones(L, L, dtype=torch.bool, device=hidden.device).tril()  # (L, L)
        base, chain = None, []
        loss, step_loss, correct, valid = 0.0, [], [], []
        for k in range(self.steps):
            ids = input_ids[:, k : k + L]  # (B, L): x[t+1+k]
            if k == 0:
                logits, hidden, base = drafter(ids, hidden, slots)
            else:
                logits, hidden, kv = drafter(ids, hidden, slots + k, prefix=base, prefix_mask=causal, chain=chain)
                chain.append(kv)
            if keep_logits is not None:
                keep_logits.append(logits.detach())
            m = trainable[:, k : k + L]  # (B, L)
            logp = F.log_softmax(logits.float(), dim=-1)  # (B, L, Vd)
            ce = -(p[:, k : k + L] * logp).sum(-1)  # (B, L)
            step_loss.append((ce * m).sum() / m.sum().clamp(min=1))
            loss = loss + self.decay**k * step_loss[-1]
            with torch.no_grad():
                guess = drafter.draft_to_target(logits.argmax(-1))  # (B, L) target ids
                correct.append((guess == argmax[:, k : k + L]) & m)
                valid.append(loss_mask[:, k : k + L])
        return loss, torch.stack(step_loss).detach(), torch.stack(correct), torch.stack(valid)


def ttt_forward(model: torch.nn.Module, batch: Batch, target: TargetHead) -> TTTOutput:
    """model: a TTT module (or DDP around one)."""
    p, argmax, trainable = target(batch)
    return TTTOutput(*model(batch.input_ids, batch.aux, p, argmax, trainable, batch.loss_mask))


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
        self.progress = progress or (lambda info: None)
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
        self.drafter = build_drafter(request.model, len(self.runset.capture_points), draft_vocab_size(cfg.draft_vocab_size, target.vocab_size))
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
                self.progress({"stage": "train", "step": st.step, "steps": cfg.steps, "loss": st.losses[-1], "tokens": st.tokens})
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


# --------------------------------------------------------------------------------------
# The whole job: train -> evaluate -> export -> publish
# --------------------------------------------------------------------------------------
def run_train(store: ObjectStore, settings: Settings, request: TrainRequest, progress: Progress | None = None) -> dict:
    """Train (resuming if a checkpoint exists), evaluate before/after, export and publish.

    Idempotent: when the version this request publishes already exists, its lineage is
    returned without training again. Returns a JSON-able summary.
    """
    from aerie_trainer import evaluate, export

    progress = progress or (lambda info: None)
    dist = setup_dist(settings.device)
    train_id = request.train_id or default_train_id(request)
    version = train_id.rsplit("-", 1)[-1] if request.train_id is None else train_id
    if request.publish:  # every rank sees it and stops
        done = export.published_lineage(store, request.drafter, version)
        if done is not None:
            progress({"stage": "done", "message": f"drafter {request.drafter}:{version} already published"})
            return {"drafter": request.drafter, "version": version, "already_published": True, **_summary(done.metrics)}
    trainer = Trainer(store, request, dist, progress)
    st = trainer.state
    cfg = request.config
    evaluator = evaluate.Evaluator(trainer, settings) if dist.main else None
    if dist.main and "acceptance_untrained" not in st.metrics:
        progress({"stage": "evaluate", "message": "untrained drafter"})
        st.metrics.update({f"{k}_untrained": v for k, v in evaluator.run().items()})
    trainer.train()
    result = {"drafter": request.drafter, "version": version, "train_id": train_id, "resumed_from": trainer.resumed_from}
    if dist.main:
        progress({"stage": "evaluate", "message": "trained drafter"})
        st.metrics.update(evaluator.run())
        st.metrics.update(
            steps=st.step, tokens=st.tokens, final_loss=st.losses[-1], losses=st.losses,
            train_seconds=round(st.train_seconds, 3), data_wait_fraction=st.data_wait_seconds / max(st.train_seconds, 1e-9),
            tokens_per_second=st.tokens / max(st.train_seconds, 1e-9), holdout_split=trainer.data.split,
        )
        if request.publish:
            progress({"stage": "publish", "message": f"drafters/{request.drafter}/{version}"})
            lineage = export.publish(store, trainer.drafter, trainer.runset, request, version, st.metrics)
            result["key"] = f"drafters/{request.drafter}/{version}/"
            result["layer_ids"] = lineage.exported_layer_ids
        trainer.checkpointer.save(trainer.drafter, trainer.optimizer, trainer.names, st)  # final metrics kept too
    dist.barrier()
    result.update(_summary(st.metrics))
    return result


def _summary(metrics: dict) -> dict:
    keys = ("steps", "tokens", "final_loss", "acceptance_untrained", "acceptance", "simulated_acceptance_untrained",
            "simulated_acceptance", "heldout_loss", "heldout_acc", "tokens_per_second", "data_wait_fraction",
            "draft_vocab_coverage", "losses")
    return {k: metrics[k] for k in keys if k in metrics}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m aerie_trainer.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", required=True, help="run names whose hidden shards to train on")
    ap.add_argument("--drafter", required=True, help="drafter name (published under drafters/<name>/)")
    ap.add_argument("--model", required=True, help="target model folder (embeddings, lm_head, config)")
    ap.add_argument("--config", default="{}", help="TrainConfig fields as JSON, e.g. '{\"steps\": 300}'")
    ap.add_argument("--train-id", default=None)
    ap.add_argument("--no-publish", action="store_true")
    args = ap.parse_args(argv)
    request = TrainRequest(runs=args.runs, drafter=args.drafter, model=args.model, config=TrainConfig.model_validate_json(args.config),
                           train_id=args.train_id, publish=not args.no_publish)
    settings = Settings.load()

    def show(info: dict) -> None:
        if int(os.environ.get("RANK", "0")) != 0:
            return
        if info.get("stage") != "train" or info["step"] % 10 == 0 or info["step"] == info["steps"]:
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in info.items()}, flush=True)

    result = run_train(open_store(settings), settings, request, progress=show)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({k: v for k, v in result.items() if k != "losses"}, indent=1), flush=True)


if __name__ == "__main__":
    main()
