"""Resumable trainer state in the store: safetensors for tensors, JSON for the rest. No pickle.

The files hold full (unsharded) tensors whatever the job's sharding (aerie_trainer.parallel
gathers them on rank 0 under FSDP), so one format serves one process, DDP and FSDP.

`checkpoints/<train-id>/step-<n>/`:
- `model.safetensors`      drafter weights and buffers (embeddings excluded: they are the target's)
- `optimizer.safetensors`  AdamW state flattened: `state.<param name>.<exp_avg|exp_avg_sq|step>`
- `rng.safetensors`        torch CPU (and CUDA) generator states
- `trainer.json`           step, data position, loss curve, metrics so far, AdamW param groups,
                           and a streamed job's epoch-0 windows (the shards it took, in order)

`checkpoints/<train-id>/latest.json` is written last and names the complete step with each file's
sha256; a trainer killed while writing leaves the previous `latest` in place. The learning rate is
a pure function of the step (`trainer.lr_at`), so the scheduler's whole state is the step.

A checkpoint is resumed only as it was written: every file's digest matches `latest.json`, the
files parse, every weight and optimizer tensor is finite, and the names fit the drafter
(`check_fits`). Anything else is `CheckpointRefused`, one line naming the file: a corrupted or
NaN checkpoint is never trained on, so never published. A non-finite state is never written.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from aerie import layout
from aerie.errors import ExpectedError
from aerie.store import NotFound, ObjectStore

KEEP = 2  # complete checkpoints kept per train id
FILES = ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "trainer.json")


class CheckpointRefused(ExpectedError, ValueError):
    """A checkpoint that is not what the trainer wrote (a changed or missing file, unreadable or
    non-finite tensors, names that do not fit the drafter): never resumed from."""


def _nonfinite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The first floating tensor holding a NaN or an infinity, by name, or None."""
    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


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

    def _refused(self, what: str) -> CheckpointRefused:
        return CheckpointRefused(
            f"checkpoint {what}: not resumed; delete the store prefix "
            f"{layout.checkpoints_prefix(self.train_id)} to train {self.train_id} from the start"
        )

    def _latest(self) -> dict | None:
        """latest.json as written: {"step": int, "sha256": {file: hex digest}}, or None (no checkpoint)."""
        key = layout.checkpoint_latest(self.train_id)
        try:
            raw = self.store.get_bytes(key)
        except NotFound:
            return None
        try:
            latest = json.loads(raw)
            step, digests = int(latest["step"]), latest["sha256"]
            if not isinstance(digests, dict) or set(digests) != set(FILES):
                raise ValueError
        except (ValueError, TypeError, KeyError):
            raise self._refused(f"{key} is not a checkpoint record with the sha256 of {', '.join(FILES)}") from None
        return {"step": step, "sha256": digests}

    def latest_step(self) -> int | None:
        latest = self._latest()
        return None if latest is None else latest["step"]

    def save(self, weights: dict[str, torch.Tensor], optim: dict, state: TrainerState) -> str:
        """weights: the drafter's tensors by name, embeddings excluded; optim: parallel.full_state's.
        A non-finite weight or optimizer state is refused, not written (CheckpointRefused)."""
        prefix = layout.checkpoint_prefix(self.train_id, state.step)
        weights = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
        opt_tensors, groups = flatten_optimizer(optim)
        for name, tensors in (("model.safetensors", weights), ("optimizer.safetensors", opt_tensors)):
            bad = _nonfinite(tensors)
            if bad is not None:
                raise CheckpointRefused(
                    f"training {self.train_id}: {name} tensor {bad} holds non-finite values at step {state.step} "
                    f"(not checkpointed, nothing published): check the data and the learning rate"
                )
        rng = {"torch_cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng.update({f"torch_cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
        record = {"train_id": self.train_id, **state.__dict__, "param_groups": groups}
        files = {
            "model.safetensors": st_save(weights),
            "optimizer.safetensors": st_save(opt_tensors),
            "rng.safetensors": st_save(rng),
            "trainer.json": json.dumps(record, indent=1).encode(),
        }
        for name, data in files.items():
            self.store.put_bytes(prefix + name, data)
        digests = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
        self.store.put_bytes(
            layout.checkpoint_latest(self.train_id),
            json.dumps({"step": state.step, "prefix": prefix, "sha256": digests}).encode(),
        )
        self._prune(state.step)
        return prefix

    def _read(self, prefix: str, name: str, digests: dict) -> bytes:
        """A checkpoint file's bytes, its sha256 checked against latest.json's."""
        key = prefix + name
        try:
            data = self.store.get_bytes(key)
        except NotFound:
            raise self._refused(f"{key} is missing") from None
        digest = hashlib.sha256(data).hexdigest()
        if digest != digests[name]:
            raise self._refused(
                f"{key} has sha256 {digest[:12]}…, not the {digests[name][:12]}… its latest.json records "
                f"(changed or corrupted)"
            )
        return data

    def _tensors(self, prefix: str, name: str, digests: dict) -> dict[str, torch.Tensor]:
        data = self._read(prefix, name, digests)
        try:
            tensors = st_load(data)
        except Exception as e:  # safetensors' own error type is not public API
            raise self._refused(f"{prefix + name} is not a readable safetensors file ({type(e).__name__})") from None
        bad = _nonfinite(tensors)
        if bad is not None:
            raise self._refused(f"{prefix + name} tensor {bad} holds non-finite values")
        return tensors

    def load(self) -> tuple[dict[str, torch.Tensor], dict, TrainerState] | None:
        """-> (weights, optimizer state, trainer state) of the latest complete checkpoint, or None;
        the RNG state is restored."""
        latest = self._latest()
        if latest is None:
            return None
        prefix, digests = layout.checkpoint_prefix(self.train_id, latest["step"]), latest["sha256"]
        weights = self._tensors(prefix, "model.safetensors", digests)
        opt_tensors = self._tensors(prefix, "optimizer.safetensors", digests)
        rng = self._tensors(prefix, "rng.safetensors", digests)
        try:
            record = json.loads(self._read(prefix, "trainer.json", digests))
            groups = record.pop("param_groups")
            record.pop("train_id", None)
            state = TrainerState(**record)
            optim = unflatten_optimizer(opt_tensors, groups)
            if "torch_cpu" not in rng:
                raise KeyError("torch_cpu")
        except (ValueError, TypeError, KeyError) as e:
            raise self._refused(f"{prefix}: its files do not fit together ({type(e).__name__}: {e})") from None
        torch.set_rng_state(rng["torch_cpu"])
        if torch.cuda.is_available():
            cuda = [rng[k] for k in sorted(rng) if k.startswith("torch_cuda_")]
            if len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda)
        return weights, optim, state

    def check_fits(self, weights: dict, optim: dict, drafter: torch.nn.Module) -> None:
        """The loaded tensors' names are the drafter's (embeddings excluded) and the optimizer's
        state names its trainable parameters: CheckpointRefused naming the first that is not."""
        prefix = layout.checkpoint_prefix(self.train_id, self.latest_step() or 0)
        expected = {k for k in drafter.state_dict() if not k.startswith("embed_tokens.")}
        missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
        if missing or unexpected:
            raise self._refused(
                f"{prefix}model.safetensors does not fit the drafter: "
                f"missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
        trainable = {n for n, p in drafter.named_parameters() if p.requires_grad}
        named = set(optim["state"]) | {n for g in optim["param_groups"] for n in g.get("params", [])}
        if named - trainable:
            raise self._refused(
                f"{prefix}optimizer.safetensors names parameters the drafter lacks: {sorted(named - trainable)[:3]}"
            )

    def _prune(self, keep_from_step: int) -> None:
        steps = layout.checkpoint_steps(self.train_id, self.store.list(layout.checkpoints_prefix(self.train_id)))
        for old in [s for s in steps if s < keep_from_step][: -(KEEP - 1) or None]:
            self.store.delete_prefix(layout.checkpoint_prefix(self.train_id, old))

    def delete(self) -> None:
        self.store.delete_prefix(layout.checkpoints_prefix(self.train_id))
