"""Which dtype the training step computes in, and how weights get there (one place for both).

- Parameters stay float32: they are the master weights the optimizer updates, DDP/FSDP reduce
  and checkpoints hold, so resuming is exact whatever the sharding.
- On a GPU the step computes in bfloat16 (`compute_dtype`): activations are bf16 from the start
  (the captured states are), and each layer takes its weight in the activations' dtype
  (`compute_weight`, `linear`). Inside `weights_cast_once()` — one TTT forward, without FSDP — a
  weight is cast once and the copy serves all draft steps. A linear layer's weight gradient is
  then summed over the draft steps in float32 by the matmuls themselves (cuBLAS accumulating into
  the output, `addmm(..., out_dtype=float32)`) and handed to the parameter once, by the last of
  its uses to run backward: no bf16 gradient sums, no casts of gradients. Under FSDP each call
  casts (FSDP gathers the weights at each call).
- Arithmetic that must not round to bf16 (softmax, log-sum-exp, norms, loss) runs in
  `acc_dtype`: float32 for half types, the input's own dtype otherwise (float64 in the tests).
- The Triton kernels (aerie_trainer.kernels) are used on a GPU when triton is importable.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

_CASTS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("aerie_weight_casts", default=None)
_REPLAY: contextvars.ContextVar[bool] = contextvars.ContextVar("aerie_checkpoint_replay", default=False)


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


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) in x's dtype (see the module doc for the cast and the weight gradient)."""
    casts = _CASTS.get()
    if casts is None or weight.dtype == x.dtype or not (weight.requires_grad and torch.is_grad_enabled()):
        return torch.nn.functional.linear(x, compute_weight(weight, x.dtype))
    key = ("linear", id(weight), x.dtype)
    use = casts.get(key)
    if use is None:
        use = casts[key] = _WeightUse(weight.detach().to(x.dtype), weight.dtype)
    if not _REPLAY.get():  # a checkpoint's recomputation is not another use
        use.uses += 1
    return _CastOnceLinear.apply(x, weight, use)


class _WeightUse:
    """One weight within one forward: its cast, how many calls used it, their summed gradient."""

    __slots__ = ("cast", "dtype", "uses", "done", "grad")

    def __init__(self, cast: torch.Tensor, dtype: torch.dtype):
        self.cast, self.dtype, self.uses, self.done, self.grad = cast, dtype, 0, 0, None


class _CastOnceLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, use):
        ctx.save_for_backward(x)
        ctx.use = use
        return torch.nn.functional.linear(x, use.cast)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        use = ctx.use
        grad_x = grad @ use.cast if ctx.needs_input_grad[0] else None
        g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        use.grad = _accumulate_weight_grad(use.grad, g2, x2, use.dtype)
        use.done += 1
        if use.done < use.uses:  # an earlier-run use of the same weight hands over the sum
            return grad_x, None, None
        grad_w, use.grad = use.grad, None
        return grad_x, grad_w, None


_MM_OUT_DTYPE: dict[str, bool] = {}  # device type -> matmuls with a float32 output for half inputs work


def _accumulate_weight_grad(acc, g, x, dtype):
    """acc (out, in) in the weight's `dtype`, or None; + g^T x (g (N, out), x (N, in))."""
    if (
        g.is_cuda
        and g.dtype in (torch.float16, torch.bfloat16)
        and dtype == torch.float32
        and _MM_OUT_DTYPE.get("cuda", True)
    ):
        try:
            if acc is None:
                return torch.ops.aten.mm.dtype(g.t(), x, torch.float32)
            return torch.ops.aten.addmm.dtype_out(acc, g.t(), x, torch.float32, out=acc)
        except (RuntimeError, AttributeError):  # an older PyTorch: sum in the generic way below
            _MM_OUT_DTYPE["cuda"] = False
    w = (g.t() @ x).to(dtype)
    return w if acc is None else acc.add_(w)


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


def checkpointed(fn):
    """`fn` under activation checkpointing (torch.utils.checkpoint, non-reentrant): its saved
    activations are dropped after the forward and recomputed in backward. The recomputation, which
    runs after `weights_cast_once` has exited (and on the autograd thread), sees this forward's
    weight casts again and does not count as another use of them, so it saves exactly the tensors
    the forward saved and the weight gradients are handed over once, as without checkpointing."""
    from torch.utils.checkpoint import checkpoint

    casts, calls = _CASTS.get(), [0]

    def run(*args):
        calls[0] += 1
        if calls[0] == 1 or casts is None:
            return fn(*args)
        token, replay = _CASTS.set(casts), _REPLAY.set(True)
        try:
            return fn(*args)
        finally:
            _REPLAY.reset(replay)
            _CASTS.reset(token)

    def call(*args):
        return checkpoint(run, *args, use_reentrant=False)

    return call


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
