"""`sgl_kernel` import shim for SGLang's CPU engine on machines without the CPU kernel build.

With `SGLANG_USE_CPU_ENGINE=1`, SGLang imports `sgl_kernel`'s `*_cpu` names at module level.
PyPI's `sglang-kernel` is a CUDA-only build: its `__init__` loads the CUDA ops library and
fails with `libcuda.so.1: cannot open shared object file`. This package, put FIRST on
`PYTHONPATH` (the folder `aerie_sglang/cpu/shim`), stands in for it:

1. extends its `__path__` with the installed `sgl_kernel` folder, so every submodule
   (`sgl_kernel.kvcacheio`, `sgl_kernel.load_utils`, ...) is the installed one;
2. replaces `load_utils._load_architecture_specific_ops` and `_preload_cuda_library` with
   no-ops (nothing CUDA is loaded; `torch.ops.sgl_kernel.*` stays empty);
3. executes the installed `sgl_kernel/__init__.py` in this module's namespace, so every name
   SGLang imports from `sgl_kernel` exists;
4. imports `aerie_sglang.cpu.ops` when that module exists: it registers plain-torch versions of
   the `torch.ops.sgl_kernel.*_cpu` ops the EAGLE3 serving path calls. Doing it here puts them
   in every SGLang process (main, scheduler, detokenizer), since each one imports `sgl_kernel`;
   and `aerie_sglang.cpu.int4` likewise (a CPU path for compressed-tensors' INT4 scheme).

Tied to `sglang==0.5.23` / `sglang-kernel==0.4.10` (pinned in scripts/sglang_env.sh): the
shim refuses other `sglang-kernel` versions, whose `__init__` it has not been checked against.
"""

import importlib.metadata
import importlib.util
import os
import sys

SGL_KERNEL_VERSION = "0.4.10"

_here = os.path.dirname(os.path.abspath(__file__))


def _installed_dir() -> str:
    for entry in sys.path:
        candidate = os.path.join(os.path.abspath(entry or os.getcwd()), "sgl_kernel")
        if candidate != _here and os.path.isfile(os.path.join(candidate, "__init__.py")):
            return candidate
    raise ImportError(
        "aerie's sgl_kernel shim found no installed sgl_kernel package on sys.path: "
        f"pip install sglang-kernel=={SGL_KERNEL_VERSION} into this environment (scripts/sglang_env.sh)"
    )


def _install() -> None:
    version = importlib.metadata.version("sglang-kernel")
    if version != SGL_KERNEL_VERSION:
        raise ImportError(
            f"aerie's sgl_kernel shim is checked against sglang-kernel=={SGL_KERNEL_VERSION}, "
            f"found {version}: pin sglang-kernel=={SGL_KERNEL_VERSION} (scripts/sglang_env.sh)"
        )
    installed = _installed_dir()
    __path__.append(installed)  # noqa: F821 - the package's own __path__
    from sgl_kernel import load_utils  # the installed submodule, found through __path__

    load_utils._load_architecture_specific_ops = lambda: None
    load_utils._preload_cuda_library = lambda: None
    init_py = os.path.join(installed, "__init__.py")
    with open(init_py, encoding="utf-8") as f:
        code = compile(f.read(), init_py, "exec")
    exec(code, globals())  # noqa: S102 - the installed package's own __init__, as Python would run it


_install()
del _install

if importlib.util.find_spec("aerie_sglang") and importlib.util.find_spec("aerie_sglang.cpu.ops"):
    # Not guarded by try/except: an ops module that fails to import must stop the server,
    # not leave it running without the ops it promised.
    import aerie_sglang.cpu.ops  # noqa: F401,E402
if importlib.util.find_spec("aerie_sglang") and importlib.util.find_spec("aerie_sglang.cpu.int4"):
    import aerie_sglang.cpu.int4  # noqa: F401,E402  # compressed-tensors WNA16 on the CPU (patched on import)
