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
- Several ranks (`--tp N`, `--attn-dp-size N`, `--dp-size N`): SGLang's CPU engine binds each
  rank's threads to one NUMA node and refuses more ranks than nodes unless
  `SGLANG_CPU_OMP_THREADS_BIND` names a core set per rank; when unset, the launcher splits this
  process's cores among the ranks (`threads_bind`). And PyPI's CUDA build of torch ships
  `libnccl`, which SGLang then loads for every group of several ranks and drives with a CUDA
  device: on the CPU engine `SGLANG_NCCL_SO_PATH` points at no library (when unset), so SGLang
  falls back to its gloo groups, as on a machine without NCCL.
- Hook for those ops: the module `aerie_sglang.cpu.ops`, when it exists, is imported here and by
  the shim in every SGLang process; it registers plain-torch implementations with
  `torch.library`. Its import errors are not swallowed. `aerie_sglang.cpu.int4` is imported the
  same way: compressed-tensors W4A16/W8A16 checkpoints (Kimi-K2.5's INT4) through SGLang's own
  scheme, its missing CPU kernel supplied (dequantized once, 16-bit matmul).
  On a machine without CUDA it also makes `torch.cuda.synchronize()` a no-op: SGLang's MLA EAGLE-3
  drafter (`Eagle3DeepseekV2ForCausalLM`) calls it unconditionally when it shares the target's
  embedding.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent / "shim"
SGLANG_VERSION = "0.5.23"
NO_NCCL = "/nonexistent/aerie-cpu-engine/libnccl.so.2"  # SGLANG_NCCL_SO_PATH: no NCCL on the CPU engine


def cpu_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: this process's) plus what SGLang's CPU engine needs in every process."""
    env = dict(os.environ if env is None else env)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SHIM_DIR)]
    env["PYTHONPATH"] = os.pathsep.join([str(SHIM_DIR), *parts])
    env.setdefault("SGLANG_NCCL_SO_PATH", NO_NCCL)
    return env


def threads_bind(ranks: int, cpus: list[int] | None = None) -> str:
    """`SGLANG_CPU_OMP_THREADS_BIND` for `ranks` scheduler processes: this process's CPUs split into
    `ranks` groups of neighbours, in SGLang's notation (`0|1` for two ranks on two cores, `0-3|4-7`
    on eight); with fewer CPUs than ranks, ranks share them in turn."""
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    if len(cpus) < ranks:
        return "|".join(str(cpus[r % len(cpus)]) for r in range(ranks))
    size, extra = divmod(len(cpus), ranks)
    groups, start = [], 0
    for r in range(ranks):
        end = start + size + (r < extra)
        groups.append(_cpu_list(cpus[start:end]))
        start = end
    return "|".join(groups)


def _cpu_list(cpus: list[int]) -> str:
    """Sorted CPU ids as runs: [0, 1, 2, 5] -> '0-2,5'."""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def import_cpu_ops() -> bool:
    """Import `aerie_sglang.cpu.ops` (plain-torch sgl_kernel CPU ops) and `aerie_sglang.cpu.int4`
    (compressed-tensors' INT4 scheme on the CPU) when they exist."""
    if importlib.util.find_spec("aerie_sglang.cpu.ops") is None:
        return False
    import aerie_sglang.cpu.ops  # noqa: F401

    if importlib.util.find_spec("aerie_sglang.cpu.int4") is not None:
        import aerie_sglang.cpu.int4  # noqa: F401

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
    server_args = prepare_server_args(args)
    ranks = server_args.dp_size * server_args.tp_size * server_args.pp_size
    if ranks > 1 and not os.environ.get("SGLANG_CPU_OMP_THREADS_BIND"):
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = threads_bind(ranks)  # read by the scheduler processes
    return server_args


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
