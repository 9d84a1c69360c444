"""How the drafter is spread over the ranks of a `torch.distributed` job: DDP or FSDP2.

- `setup_dist(device)`: this process's rank from torchrun's environment (RANK, WORLD_SIZE,
  LOCAL_RANK); NCCL on GPUs, gloo on the CPU. One process without them.
- `wrap(...)`: DDP replicates the drafter and all-reduces gradients; FSDP2 (`fully_shard`) shards
  the trainable modules' parameters, gradients and AdamW state over the ranks and gathers each
  module's weights for its forward and backward. The frozen target embedding is never sharded
  (it is looked up, not multiplied: every rank keeps it), so a full drafter for evaluation and
  export can share it.
- `full_state(...)` / `load_full_state(...)`: the checkpoint's view of any of the three —
  full (unsharded) float32 tensors by parameter name on rank 0, the same for every sharding, so
  a checkpoint written under DDP resumes under FSDP and back.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

# A rank waits this long in a collective while rank 0 evaluates or writes a checkpoint alone.
COLLECTIVE_TIMEOUT = datetime.timedelta(hours=2)


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
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t)
        return float(t) / self.world_size


def setup_dist(device: str) -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist(device=torch.device(device))
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device.startswith("cuda")
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if cuda else "gloo", timeout=COLLECTIVE_TIMEOUT)
    dev = torch.device(f"cuda:{local}") if cuda else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return Dist(rank, world, dev)


# --------------------------------------------------------------------------------------
# Wrapping
# --------------------------------------------------------------------------------------
SHARDED_MODULES = ("fc", "midlayer", "norm", "lm_head")  # every trainable module of the drafter


def wrap(ttt: torch.nn.Module, sharding: str, dist: Dist) -> torch.nn.Module:
    """The module the training loop calls: `ttt` itself (one process), DDP around it, or `ttt`
    with its drafter's trainable modules sharded in place (FSDP2, one group per module)."""
    if sharding == "single":
        return ttt
    if sharding == "ddp":
        ids = [dist.device.index] if dist.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(ttt, device_ids=ids)
    if sharding == "fsdp":
        from torch.distributed.fsdp import fully_shard

        drafter = ttt.drafter
        for name in SHARDED_MODULES:
            fully_shard(getattr(drafter, name))
        return ttt
    raise ValueError(f"sharding {sharding!r}: single, ddp or fsdp")


def set_gradient_sync(model: torch.nn.Module, sharding: str, sync: bool):
    """A context for one micro-batch: skip the gradient exchange until the last one."""
    import contextlib

    if sharding == "ddp" and not sync:
        return model.no_sync()
    if sharding == "fsdp":
        for name in SHARDED_MODULES:
            getattr(model.drafter, name).set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


# --------------------------------------------------------------------------------------
# The full state, for checkpoints, evaluation and export
# --------------------------------------------------------------------------------------
def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True, **kw)


def full_state(
    drafter: torch.nn.Module, optimizer: torch.optim.Optimizer, sharding: str, optimizer_too: bool = True
) -> tuple[dict, dict]:
    """-> (weights, optimizer) as full tensors by parameter name (`fc.weight`, ...): the drafter's
    state dict without the embedding, and {"state": {name: {exp_avg, exp_avg_sq, step}},
    "param_groups": [{..., "params": [names]}]}. Under FSDP every rank must call it (it gathers);
    rank 0 gets the tensors, the others empty dicts. `optimizer_too=False`: the weights only."""
    if sharding != "fsdp":
        weights = {k: v.detach().cpu() for k, v in drafter.state_dict().items() if not k.startswith("embed_tokens.")}
        if not optimizer_too:
            return weights, {}
        names = trainable_names(drafter)
        sd = optimizer.state_dict()
        state = {
            names[i]: {k: (v if torch.is_tensor(v) else torch.tensor(v)).detach().cpu() for k, v in s.items()}
            for i, s in sd["state"].items()
        }
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
            for g in sd["param_groups"]
        ]
        return weights, {"state": state, "param_groups": groups}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    weights = get_model_state_dict(drafter, options=_options(ignore_frozen_params=True))
    optim = get_optimizer_state_dict(drafter, optimizer, options=_options()) if optimizer_too else {}
    weights = {k: v for k, v in weights.items() if not k.startswith("embed_tokens.")}
    return weights, optim


def load_full_state(
    drafter: torch.nn.Module, optimizer: torch.optim.Optimizer, sharding: str, weights: dict, optim: dict
) -> None:
    """The inverse of `full_state`, on every rank (each holds the full tensors it read)."""
    if sharding != "fsdp":
        missing, unexpected = drafter.load_state_dict(weights, strict=False)
        missing = [m for m in missing if not m.startswith("embed_tokens.")]
        if missing or unexpected:
            raise RuntimeError(f"checkpoint does not fit the drafter: missing {missing}, unexpected {unexpected}")
        index = {name: i for i, name in trainable_names(drafter).items()}
        state = {index[name]: s for name, s in optim["state"].items()}
        groups = [
            {**g, "params": [index[n] for n in g["params"]], "betas": tuple(g["betas"])} for g in optim["param_groups"]
        ]
        optimizer.load_state_dict({"state": state, "param_groups": groups})
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(drafter, weights, options=_options(strict=False))
    groups = [{**g, "betas": tuple(g["betas"])} for g in optim["param_groups"]]
    set_optimizer_state_dict(drafter, optimizer, {"state": optim["state"], "param_groups": groups}, options=_options())


def trainable_names(drafter: torch.nn.Module) -> dict[int, str]:
    """Optimizer parameter index -> parameter name (the order the optimizer was given them)."""
    return {i: n for i, (n, p) in enumerate((n, p) for n, p in drafter.named_parameters() if p.requires_grad)}
