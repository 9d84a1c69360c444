"""Resumable trainer state in the store: safetensors for tensors, JSON for the rest. No pickle.

The files hold full (unsharded) tensors whatever the job's sharding (aerie_trainer.parallel
gathers them on rank 0 under FSDP), so one format serves one process, DDP and FSDP.

`checkpoints/<train-id>/step-<n>/`:
- `model.safetensors`      drafter weights and buffers (embeddings excluded: they are the target's)
- `optimizer.safetensors`  AdamW state flattened: `state.<param name>.<exp_avg|exp_avg_sq|step>`
- `rng.safetensors`        torch CPU (and CUDA) generator states
- `trainer.json`           step, data position, loss curve, metrics so far, AdamW param groups,
                           and a streamed job's epoch-0 windows (the shards it took, in order)

`checkpoints/<train-id>/latest.json` is written last and names the complete step; a trainer
killed while writing leaves the previous `latest` in place. The learning rate is a pure
function of the step (`trainer.lr_at`), so the scheduler's whole state is the step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from aerie import layout
from aerie.store import NotFound, ObjectStore

KEEP = 2  # complete checkpoints kept per train id


@dataclass
class TrainerState:
    step: int = 0  # optimizer steps done
    epoch: int = 0  # the ranks' data position: the group's next batch is epoch_plan(epoch)[batch]
    batch: int = 0
    tokens: int = 0
    losses: list[float] = field(default_factory=list)  # one per optimizer step
    metrics: dict = field(default_factory=dict)
    train_seconds: float = 0.0
    data_wait_seconds: float = 0.0
    stream_windows: list[list[str]] = field(default_factory=list)  # a streamed job's epoch 0 (HiddenData.windows)


def flatten_optimizer(optim: dict) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """{"state": {name: {key: tensor}}, "param_groups"} -> flat tensors `state.<name>.<key>`, groups."""
    tensors = {}
    for name, st in optim["state"].items():
        for key, value in st.items():
            value = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"state.{name}.{key}"] = value.detach().cpu().contiguous()
    return tensors, [dict(g) for g in optim["param_groups"]]


def unflatten_optimizer(tensors: dict[str, torch.Tensor], groups: list[dict]) -> dict:
    state: dict[str, dict] = {}
    for flat, value in tensors.items():
        _, rest = flat.split(".", 1)
        name, key = rest.rsplit(".", 1)
        state.setdefault(name, {})[key] = value
    return {"state": state, "param_groups": groups}


class Checkpointer:
    """Writes (rank 0) and reads (every rank) full states: the same files under any sharding."""

    def __init__(self, store: ObjectStore, train_id: str):
        self.store, self.train_id = store, train_id

    def latest_step(self) -> int | None:
        try:
            return int(json.loads(self.store.get_bytes(layout.checkpoint_latest(self.train_id)))["step"])
        except NotFound:
            return None

    def save(self, weights: dict[str, torch.Tensor], optim: dict, state: TrainerState) -> str:
        """weights: the drafter's tensors by name, embeddings excluded; optim: parallel.full_state's."""
        prefix = layout.checkpoint_prefix(self.train_id, state.step)
        self.store.put_bytes(
            prefix + "model.safetensors", st_save({k: v.detach().cpu().contiguous() for k, v in weights.items()})
        )
        opt_tensors, groups = flatten_optimizer(optim)
        self.store.put_bytes(prefix + "optimizer.safetensors", st_save(opt_tensors))
        rng = {"torch_cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng.update({f"torch_cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
        self.store.put_bytes(prefix + "rng.safetensors", st_save(rng))
        record = {"train_id": self.train_id, **state.__dict__, "param_groups": groups}
        self.store.put_bytes(prefix + "trainer.json", json.dumps(record, indent=1).encode())
        self.store.put_bytes(
            layout.checkpoint_latest(self.train_id), json.dumps({"step": state.step, "prefix": prefix}).encode()
        )
        self._prune(state.step)
        return prefix

    def load(self) -> tuple[dict[str, torch.Tensor], dict, TrainerState] | None:
        """-> (weights, optimizer state, trainer state) of the latest complete checkpoint, or None;
        the RNG state is restored."""
        step = self.latest_step()
        if step is None:
            return None
        prefix = layout.checkpoint_prefix(self.train_id, step)
        weights = st_load(self.store.get_bytes(prefix + "model.safetensors"))
        record = json.loads(self.store.get_bytes(prefix + "trainer.json"))
        optim = unflatten_optimizer(
            st_load(self.store.get_bytes(prefix + "optimizer.safetensors")), record.pop("param_groups")
        )
        rng = st_load(self.store.get_bytes(prefix + "rng.safetensors"))
        torch.set_rng_state(rng["torch_cpu"])
        if torch.cuda.is_available():
            cuda = [rng[k] for k in sorted(rng) if k.startswith("torch_cuda_")]
            if len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda)
        record.pop("train_id", None)
        return weights, optim, TrainerState(**record)

    def _prune(self, keep_from_step: int) -> None:
        steps = layout.checkpoint_steps(self.train_id, self.store.list(layout.checkpoints_prefix(self.train_id)))
        for old in [s for s in steps if s < keep_from_step][: -(KEEP - 1) or None]:
            self.store.delete_prefix(layout.checkpoint_prefix(self.train_id, old))

    def delete(self) -> None:
        self.store.delete_prefix(layout.checkpoints_prefix(self.train_id))
