"""aerie's CPU support for real SGLang (`aerie_sglang.cpu`), each case in a fresh `.venv-sglang`
process: the `sgl_kernel` shim and the launcher's `--serve-eagle` platform override."""

from __future__ import annotations

import os
import subprocess
import textwrap

import pytest

from tests.sglang_server import REPO, sglang_python

pytestmark = [pytest.mark.sglang]

SHIM = REPO / "services/inference/aerie_sglang/cpu/shim"


def run_sglang_python(code: str, *, pythonpath: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/tmp"),
        "PYTHONPATH": pythonpath,
    }
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    return subprocess.run(
        [str(sglang_python()), "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env,
    )  # fmt: skip


def test_installed_sgl_kernel_needs_cuda_and_the_shim_stands_in():
    bare = run_sglang_python("import sgl_kernel")
    assert bare.returncode != 0 and "libcuda" in bare.stderr, (
        "PyPI's sglang-kernel imports on CPU now: is the shim still needed?"
    )

    shimmed = run_sglang_python(
        """
        import sys, sgl_kernel, sgl_kernel.kvcacheio, torch
        from sgl_kernel import copy_all_layer_kv_cache_cpu, __version__
        print(sgl_kernel.__file__)
        print(sgl_kernel.kvcacheio.__file__)
        print(__version__)
        # the hook: importing sgl_kernel (as every SGLang process does) registered aerie's CPU ops
        ops = sys.modules["aerie_sglang.cpu.ops"]
        print(all(hasattr(torch.ops.sgl_kernel, name) for name in ops.SCHEMAS))
        """,
        pythonpath=str(SHIM),
    )
    assert shimmed.returncode == 0, shimmed.stderr[-3000:]
    shim_file, submodule_file, version, ops_registered = shimmed.stdout.split()
    assert shim_file.startswith(str(SHIM))  # the shim answers `import sgl_kernel` ...
    assert "site-packages/sgl_kernel/kvcacheio.py" in submodule_file  # ... submodules are the installed ones
    assert version == "0.4.10"
    assert ops_registered == "True"


@pytest.mark.slow
def test_launcher_serve_eagle_keeps_intel_amx_attention(smollm2_path):
    # SGLang resolves the attention backend from the platform: without AMX kernels it falls back
    # to torch_native, which its EAGLE draft worker refuses; --serve-eagle keeps intel_amx.
    result = run_sglang_python(
        f"""
        from aerie_sglang.cpu.launch import prepare
        from sglang.srt.arg_groups.overrides import resolving_view
        for extra in ([], ["--serve-eagle"]):
            args = prepare([*extra, "--model-path", {str(smollm2_path)!r}, "--dtype", "float32"])
            args.resolve_once()
            print(resolving_view(args).attention_backend, resolving_view(args).device)
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["torch_native", "cpu", "intel_amx", "cpu"]
