"""Start a real SGLang server on the CPU (tests, laptops). Run it with SGLang's own Python:

    # capture mode (what the extractor talks to)
    .venv-sglang/bin/python -m aerie_sglang.cpu.launch --model-path M --port 30000 \\
        --dtype float32 --enable-return-aux-hidden-states --speculative-algorithm EAGLE3 \\
        --return-aux-hidden-state-layer-ids 1 14 26 --disable-radix-cache \\
        --disable-cuda-graph --skip-server-warmup --max-total-tokens 4096 --mem-fraction-static 0.1

    # serve mode (target + EAGLE3 drafter)
    .venv-sglang/bin/python -m aerie_sglang.cpu.launch --serve-eagle --model-path M \\
        --speculative-algorithm EAGLE3 --speculative-draft-model-path D \\
        --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 ...

Every argument except `--serve-eagle` is SGLang's own (`--device cpu` is added when absent).
What it does before handing over to SGLang's `launch_server`:

- `SGLANG_USE_CPU_ENGINE=1` and the `sgl_kernel` import shim (`aerie_sglang/cpu/shim`) first on
  `PYTHONPATH`, in this process and (through the environment) in SGLang's spawned scheduler
  and detokenizer.
- `--serve-eagle`: SGLang's draft worker refuses the `torch_native` attention backend, and on a
  CPU without AMX SGLang's argument resolution turns `intel_amx` back into `torch_native`.
  `override_platform(has_amx=True)` before the arguments are resolved keeps `intel_amx` for
  attention (linear layers stay plain torch). That path calls `torch.ops.sgl_kernel.*_cpu`
  ops missing from PyPI's CUDA-only kernel build.
- Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2/K2.5: `kv_lora_rank` in the model's
  config.json, or in its `text_config`): `torch_native` cannot run it (its SDPA call assumes
  equal q/k and v head dims and crashes at the first prefill), so the same override is applied
  without `--serve-eagle`, in capture mode too; aerie's ops run MLA's expanded-head prefill and
  its one-latent-head extend/decode.
- Hook for those ops: the module `aerie_sglang.cpu.ops`, when it exists, is imported here and by
  the shim in every SGLang process; it registers plain-torch implementations with
  `torch.library`. Its import errors are not swallowed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent / "shim"
SGLANG_VERSION = "0.5.23"


def cpu_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) plus what SGLang's CPU engine needs in every process."""
    env = dict(os.environ if env is None else env)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SHIM_DIR)]
    env["PYTHONPATH"] = os.pathsep.join([str(SHIM_DIR), *parts])
    return env


def import_cpu_ops() -> bool:
    """Import `aerie_sglang.cpu.ops` (plain-torch sgl_kernel CPU ops) when it exists."""
    if importlib.util.find_spec("aerie_sglang.cpu.ops") is None:
        return False
    import aerie_sglang.cpu.ops  # noqa: F401

    return True


def uses_mla(model_path: str | None) -> bool:
    """Whether the model folder's config.json describes multi-head latent attention."""
    if not model_path:
        return False
    config_path = Path(model_path) / "config.json"
    if not config_path.is_file():
        return False  # a hub id: SGLang resolves it; nothing to read here
    config = json.loads(config_path.read_text())
    return config.get("kv_lora_rank") is not None or (config.get("text_config") or {}).get("kv_lora_rank") is not None


def _model_path(args: list[str]) -> str | None:
    for i, arg in enumerate(args):
        if arg == "--model-path" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--model-path="):
            return arg.split("=", 1)[1]
    return None


def prepare(args: list[str]):
    """Set up this process for SGLang's CPU engine and return SGLang's ServerArgs for `args`
    (aerie's `--serve-eagle` included); nothing is started yet."""
    serve_eagle = "--serve-eagle" in args
    args = [a for a in args if a != "--serve-eagle"]
    if not any(a == "--device" or a.startswith("--device=") for a in args):
        args += ["--device", "cpu"]

    os.environ.update(cpu_environment())
    if str(SHIM_DIR) not in sys.path:
        sys.path.insert(0, str(SHIM_DIR))
    loaded = sys.modules.get("sgl_kernel")
    if loaded is not None and not str(getattr(loaded, "__file__", "")).startswith(str(SHIM_DIR)):
        raise RuntimeError(
            f"sgl_kernel was imported before the CPU shim ({loaded.__file__}): start SGLang through this launcher"
        )

    import importlib.metadata

    version = importlib.metadata.version("sglang")
    if version != SGLANG_VERSION:
        raise RuntimeError(
            f"aerie's CPU launcher is checked against sglang=={SGLANG_VERSION}, found {version}: "
            f"run scripts/sglang_env.sh (it pins sglang=={SGLANG_VERSION})"
        )

    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import override_platform
    from sglang.srt.server_args import prepare_server_args

    import_cpu_ops()
    if serve_eagle or uses_mla(_model_path(args)):
        override_platform(has_amx=True).install()
    load_plugins()
    return prepare_server_args(args)


def main(argv: list[str] | None = None) -> None:
    server_args = prepare(list(sys.argv[1:] if argv is None else argv))
    from sglang.launch_server import run_server
    from sglang.srt.utils import kill_process_tree

    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
