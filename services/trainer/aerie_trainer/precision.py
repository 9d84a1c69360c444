"""Which dtype the training step computes in, and how weights get there (one place for both).

- Parameters stay float32: they are the master weights the optimizer updates, DDP/FSDP reduce
  and checkpoints hold, so resuming is exact whatever the sharding.
- On a GPU the step computes in bfloat16 (`compute_dtype`): activations are bf16 from the start
  (the captured states are), and each layer takes its weight in the activations' dtype
  (`compute_weight`). Inside `weights_cast_once()` — one TTT forward, without FSDP — a weight is
  cast once and the copy serves all draft steps; its gradient flows back through that one cast
  into the float32 parameter's gradient. Under FSDP each call casts (FSDP gathers per call).
- Arithmetic that must not round to bf16 (softmax, log-sum-exp, norms, loss) runs in
  `acc_dtype`: float32 for half types, the input's own dtype otherwise (float64 in the tests).
- The Triton kernels (aerie_trainer.kernels) are used on a GPU when triton is importable.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

_CASTS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("aerie_weight_casts", default=None)


def compute_dtype(device: torch.device) -> torch.dtype | None:
    """bf16 on a GPU; None (the parameters' own dtype) elsewhere."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else None


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def compute_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` in `dtype`: itself when it already is, else a cast (cached inside weights_cast_once)."""
    if weight.dtype == dtype:
        return weight
    casts = _CASTS.get()
    if casts is None:
        return weight.to(dtype)
    key = (id(weight), dtype)
    cast = casts.get(key)
    if cast is None:
        cast = casts[key] = weight.to(dtype)
    return cast


@contextlib.contextmanager
def weights_cast_once(enabled: bool = True):
    """Within: each weight is cast to a compute dtype at most once (one TTT forward)."""
    if not enabled:
        yield
        return
    token = _CASTS.set({})
    try:
        yield
    finally:
        _CASTS.reset(token)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
