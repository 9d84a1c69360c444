"""Resumable trainer state in the store: safetensors for tensors, JSON for the rest. No pickle.

`checkpoints/<train-id>/step-<n>/`:
- `model.safetensors`      drafter weights and buffers (embeddings excluded: they are the target's)
- `optimizer.safetensors`  AdamW state flattened: `state.<param name>.<exp_avg|exp_avg_sq|step>`
- `rng.safetensors`        torch CPU (and CUDA) generator states
- `trainer.json`           step, data position, loss curve, metrics so far, AdamW param groups

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
    epoch: int = 0  # data position: next batch is epoch_plan(epoch)[batch]
    batch: int = 0
    tokens: int = 0
    losses: list[float] = field(default_factory=list)  # one per optimizer step
    metrics: dict = field(default_factory=dict)
    train_seconds: float = 0.0
    data_wait_seconds: float = 0.0


def optimizer_tensors(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """AdamW state -> flat tensors by parameter name, and JSON-able param groups."""
    sd = optimizer.state_dict()
    tensors = {}
    for idx, st in sd["state"].items():
        for key, value in st.items():
            value = value if torch.is_tensor(value) else torch.tensor(value)
            tensors[f"state.{names[idx]}.{key}"] = value.detach().cpu().contiguous()
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]
    return tensors, groups


def load_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], tensors: dict[str, torch.Tensor], groups: list[dict]) -> None:
    index = {name: i for i, name in names.items()}
    state: dict[int, dict] = {}
    for flat, value in tensors.items():
        _, rest = flat.split(".", 1)
        pname, key = rest.rsplit(".", 1)
        state.setdefault(index[pname], {})[key] = value
    param_groups = [{**g, "params": [index[n] for n in g["params"]], "betas": tuple(g["betas"])} for g in groups]
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})


class Checkpointer:
    def __init__(self, store: ObjectStore, train_id: str):
        self.store, self.train_id = store, train_id

    def latest_step(self) -> int | None:
        try:
            return int(json.loads(self.store.get_bytes(layout.checkpoint_latest(self.train_id)))["step"])
        except NotFound:
            return None

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, names: dict[int, str], state: TrainerState) -> str:
        prefix = layout.checkpoint_prefix(self.train_id, state.step)
        weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if not k.startswith("embed_tokens.")}
        self.store.put_bytes(prefix + "model.safetensors", st_save(weights))
        opt_tensors, groups = optimizer_tensors(optimizer, names)
        self.store.put_bytes(prefix + "optimizer.safetensors", st_save(opt_tensors))
        rng = {"torch_cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng.update({f"torch_cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
        self.store.put_bytes(prefix + "rng.safetensors", st_save(rng))
        record = {"train_id": self.train_id, **state.__dict__, "param_groups": groups}
        self.store.put_bytes(prefix + "trainer.json", json.dumps(record, indent=1).encode())
        self.store.put_bytes(layout.checkpoint_latest(self.train_id), json.dumps({"step": state.step, "prefix": prefix}).encode())
        self._prune(state.step)
        return prefix

    def load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> TrainerState | None:
        step = self.latest_step()
        if step is None:
            return None
        prefix = layout.checkpoint_prefix(self.train_id, step)
        weights = st_load(self.store.get_bytes(prefix + "model.safetensors"))
        missing, unexpected = model.load_state_dict(weights, strict=False)
        missing = [m for m in missing if not m.startswith("embed_tokens.")]
        if missing or unexpected:
            raise RuntimeError(f"checkpoint {prefix} does not fit the drafter: missing {missing}, unexpected {unexpected}")
        record = json.loads(self.store.get_bytes(prefix + "trainer.json"))
        load_optimizer(optimizer, names, st_load(self.store.get_bytes(prefix + "optimizer.safetensors")), record.pop("param_groups"))
        rng = st_load(self.store.get_bytes(prefix + "rng.safetensors"))
        torch.set_rng_state(rng["torch_cpu"])
        if torch.cuda.is_available():
            cuda = [rng[k] for k in sorted(rng) if k.startswith("torch_cuda_")]
            if len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda)
        record.pop("train_id", None)
        return TrainerState(**record)

    def _prune(self, keep_from_step: int) -> None:
        steps = layout.checkpoint_steps(self.train_id, self.store.list(layout.checkpoints_prefix(self.train_id)))
        for old in [s for s in steps if s < keep_from_step][: -(KEEP - 1) or None]:
            self.store.delete_prefix(layout.checkpoint_prefix(self.train_id, old))

    def delete(self) -> None:
        self.store.delete_prefix(layout.checkpoints_prefix(self.train_id))
