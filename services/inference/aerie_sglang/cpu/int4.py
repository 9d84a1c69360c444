"""A CPU path for SGLang 0.5.23's compressed-tensors WNA16 scheme (`CompressedTensorsWNA16`: INT4/INT8
weights, 16-bit activations, `pack-quantized`; Kimi-K2.5's format), for aerie's CPU test harness.

SGLang selects the scheme itself (its config parsing of `quantization_config`, its
`CompressedTensorsConfig._get_scheme_from_parts`, its loader filling the scheme's own parameters
`weight_packed` / `weight_scale` / `weight_zero_point` / `weight_shape`); only the kernel is
missing: the scheme is Marlin-only (`gptq_marlin_repack` and `apply_gptq_marlin_linear`, CUDA), and
its capability check calls `torch.cuda.get_device_capability()` ("Found no NVIDIA driver"). On a
machine without CUDA this module gives the scheme:

- `process_weights_after_loading`: the layer's shard unpacked with compressed-tensors' own
  `unpack_from_int32` (32 consecutive values in `num_bits` int32 words, value i at bit i*num_bits,
  stored with +2**(bits-1) offset; zero points packed along the output dimension) and dequantized
  with compressed-tensors' own `dequantize` (`(q - zero_point) * scale` per group of `group_size`
  input columns, in the scale's dtype, which SGLang loads as the server's dtype). Done once: the
  packed parameters are dropped and the layer keeps one dense `weight` in the server's dtype.
  A 4-bit value times a bf16 scale rounded to bf16 is what compressed-tensors' decompression
  gives in bf16, and what transformers serves from the same checkpoint.
- `apply_weights`: `F.linear(x, weight, bias)`, in the server's dtype: with bfloat16/float16 (the
  dtypes SGLang accepts for compressed-tensors) a 16-bit matmul of the dequantized weight, W4A16
  semantics, the numbers of an integer kernel up to its accumulation order (not its speed).
- float32 activations are accepted too (`get_supported_act_dtypes`), on the CPU only: the weight
  is then the exact product `(q - zero_point) * scale`, as transformers dequantizes it in
  float32, so a test can compare SGLang with transformers beyond bfloat16's rounding (bf16 logits
  tie often enough to change greedy text within 32 tokens).
- `get_min_capability`: 0 on the CPU, and the config's `_check_scheme_supported` accepts 0 without
  asking CUDA; every other scheme's check is SGLang's own (it still fails on the CPU).

Not supported (refused naming the setting, never computed wrong): activation ordering
(`actorder: group`, a `weight_g_idx` permutation), as SGLang's own later CPU path refuses it.

compressed-tensors is SGLang 0.5.23's own pin (`compressed-tensors==0.18.0` in its metadata; the
scheme imports it), so the unpacking is the very code that wrote the checkpoint's format.

Applied in every SGLang process of the CPU harness: the `sgl_kernel` shim and the launcher import
this module, which patches the two SGLang modules when they are imported (`install`; at once if
they already are). With CUDA present nothing is patched (Marlin serves the checkpoint).
Checked against compressed-tensors' own decompression in `tests/inference/test_sglang_int4.py`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

SCHEME_MODULE = "sglang.srt.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16"
CONFIG_MODULE = "sglang.srt.layers.quantization.compressed_tensors.compressed_tensors"
CPU_CAPABILITY = 0  # what the scheme asks of the device once it has this CPU path: nothing
PACKED = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")


def dequantized_weight(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None = None,
    *,
    num_bits: int,
    strategy: str,
    group_size: int,
    symmetric: bool,
) -> torch.Tensor:
    """The dense [out, in] weight of one layer shard in `scale`'s dtype: `packed` [out, in * bits / 32]
    int32, `scale` [out, groups], `zero_point` [out * bits / 32, groups] int32 (asymmetric only),
    unpacked and dequantized by compressed-tensors' own functions."""
    from compressed_tensors.compressors.pack_quantized.helpers import (  # type: ignore[import-untyped]
        unpack_from_int32,
    )
    from compressed_tensors.quantization import QuantizationArgs  # type: ignore[import-untyped]
    from compressed_tensors.quantization.lifecycle.forward import dequantize  # type: ignore[import-untyped]

    rows, words = packed.shape
    cols = words * 32 // num_bits
    q = unpack_from_int32(packed, num_bits, torch.Size([rows, cols]))
    zp = None
    if not symmetric:
        if zero_point is None:
            raise ValueError("an asymmetric WNA16 layer has no weight_zero_point")
        zp = unpack_from_int32(zero_point, num_bits, torch.Size([rows, scale.shape[1]]), packed_dim=0)
    args = QuantizationArgs(
        num_bits=num_bits,
        symmetric=symmetric,
        strategy=strategy,
        group_size=group_size if strategy == "group" else None,
    )
    weight: torch.Tensor = dequantize(x_q=q, scale=scale, zero_point=zp, args=args)
    return weight


def _process_weights_after_loading(self: Any, layer: torch.nn.Module) -> None:
    if self.has_g_idx:
        raise NotImplementedError(
            "aerie's CPU path for compressed-tensors WNA16 does not support activation ordering "
            "(actorder: group in the checkpoint's quantization_config)"
        )
    weight = dequantized_weight(
        layer.weight_packed.data,
        layer.weight_scale.data,
        getattr(layer, "weight_zero_point", None),
        num_bits=32 // self.pack_factor,
        strategy=str(self.strategy),
        group_size=self.group_size,
        symmetric=bool(self.symmetric),
    )
    for name in PACKED:
        if hasattr(layer, name):
            delattr(layer, name)
    layer.register_parameter(
        "weight", torch.nn.Parameter(weight.to(self.kernel_config.act_type).contiguous(), requires_grad=False)
    )


def _apply_weights(
    self: Any, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return torch.nn.functional.linear(x, layer.weight, bias)


def _get_min_capability(cls: Any) -> int:
    return CPU_CAPABILITY


def patch_scheme(module: types.ModuleType) -> None:
    cls = module.CompressedTensorsWNA16
    cls.process_weights_after_loading = _process_weights_after_loading
    cls.apply_weights = _apply_weights
    cls.get_min_capability = classmethod(_get_min_capability)
    cls.aerie_cpu_path = True


def patch_config(module: types.ModuleType) -> None:
    cls = module.CompressedTensorsConfig
    original = cls._check_scheme_supported
    if getattr(original, "aerie_cpu_path", False):
        return

    def _check_scheme_supported(self: Any, min_capability: int, error: bool = True) -> bool:
        if min_capability <= CPU_CAPABILITY:
            return True  # a scheme with aerie's CPU path: no device capability to check
        return original(self, min_capability, error)

    _check_scheme_supported.aerie_cpu_path = True  # type: ignore[attr-defined]
    cls._check_scheme_supported = _check_scheme_supported

    dtypes = cls.get_supported_act_dtypes

    def get_supported_act_dtypes(self: Any) -> list[torch.dtype]:
        return [*dtypes(self), torch.float32]  # float32 activations: the tests' exact comparisons

    cls.get_supported_act_dtypes = get_supported_act_dtypes


PATCHES: dict[str, Callable[[types.ModuleType], None]] = {SCHEME_MODULE: patch_scheme, CONFIG_MODULE: patch_config}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module in PATCHES, the spec the other finders give, its loader
    patching the module right after executing it (before any other module imports a name from it)."""

    def find_spec(
        self, fullname: str, path: Any, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: types.ModuleType, exec_module: Any = exec_module, patch: Any = patch) -> None:
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]  # this module's loader only
        return spec


def install() -> bool:
    """Patch SGLang's WNA16 scheme and its config's capability check for the CPU: now for the
    modules already imported, on import for the others. Nothing where CUDA is available; True
    when installed."""
    if torch.cuda.is_available():
        return False
    for name, patch in PATCHES.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
    return True


install()
