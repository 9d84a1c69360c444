"""A Python environment that holds what a service's image installs, and nothing else, built from the
image's own requirement list (its Dockerfile's `pip install` lines) without building the image.

`image_distributions(service)` reads the Dockerfile: local packages (shared, services/<name>, with
their extras) and pinned names; each local or plain requirement brings its dependencies (resolved
from the installed metadata, markers evaluated), a `--no-deps` one only itself. `image_env(service,
folder)` returns the environment of a subprocess of this venv's Python in which a `sitecustomize`
hides every other installed distribution: its modules cannot be imported and `importlib.metadata`
does not list it (so neither its entry points nor its data are found), as in the image.
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

from scripts.deploy_checks.dockerfiles import dockerfile_instructions
from tests.services import REPO, clean_env

SITECUSTOMIZE = '''
import importlib.metadata as md, json, os, re, sys

_norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
_allowed = set(json.loads(os.environ["AERIE_TEST_IMAGE_DISTRIBUTIONS"]))
_hidden = {mod for mod, dists in md.packages_distributions().items() if not {_norm(d) for d in dists} & _allowed}


class _ImageFinder:
    """Wraps each finder: a module or distribution the image lacks is simply not found (None)."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _hidden or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(name, path, target)

    def find_distributions(self, context=md.DistributionFinder.Context()):
        found = getattr(self.finder, "find_distributions", lambda context: ())(context)
        return (d for d in found if _norm(d.metadata["Name"] or "") in _allowed)

    def invalidate_caches(self):
        getattr(self.finder, "invalidate_caches", lambda: None)()


sys.meta_path[:] = [_ImageFinder(f) for f in sys.meta_path]
'''


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _lock_pins(service: str, image_path: str) -> list[str]:
    """`name==version` of each pin of a lock the Dockerfile installs, by its path in the image
    (/opt/aerie/requirements.lock: the service's own; /opt/aerie/services/...: as in the repo)."""
    from scripts.deploy_checks.locks import parse_lock

    rel = image_path.removeprefix("/opt/aerie/")
    path = REPO / "services" / service / rel if "/" not in rel else REPO / rel
    return [f"{name}=={version}" for name, (version, _) in parse_lock(path.read_text()).items()]


def _requirements_of(service: str) -> list[tuple[Requirement, bool]]:
    """(requirement, with its dependencies) for each package a Dockerfile's RUN lines pip-install."""
    found = []
    for c in dockerfile_instructions((REPO / "services" / service / "Dockerfile").read_text()):
        if c.cmd != "RUN":
            continue
        commands: list[list[str]] = [[]]
        for token in shlex.split(" ".join(c.value)):
            commands.append([]) if token in ("&&", ";", "||") else commands[-1].append(token)
        for words in commands:
            if "pip" not in words or "install" not in words:
                continue
            deps = "--no-deps" not in words
            args = iter(words[words.index("install") + 1 :])
            for word in args:
                if word in ("-r", "--requirement"):  # a hashed lock: its pins, each as the lock gives it
                    found += [(Requirement(line), deps) for line in _lock_pins(service, next(args))]
                    continue
                if word in ("--index-url", "-i", "--extra-index-url", "-c", "--constraint"):
                    next(args)
                    continue
                if word.startswith("-"):
                    continue
                local = re.fullmatch(r"/opt/aerie/((?:shared|services/[a-z]+))(\[[\w,]+\])?", word)
                if local:
                    project = tomllib.loads((REPO / local.group(1) / "pyproject.toml").read_text())["project"]
                    word = project["name"] + (local.group(2) or "")
                found.append((Requirement(word), deps))
    return found


def image_distributions(service: str) -> set[str]:
    """Normalized names of every distribution the service's image holds (beyond the base image's Python)."""
    allowed: set[str] = set()
    todo = _requirements_of(service)
    while todo:
        req, deps = todo.pop()
        if _norm(req.name) in allowed:
            continue
        allowed.add(_norm(req.name))
        if not deps:
            continue
        for line in metadata.requires(req.name) or []:
            dep = Requirement(line)
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in (req.extras or {""})):
                todo.append((dep, True))
    return allowed


def image_env(service: str, folder: Path, **extra: str) -> dict[str, str]:
    """Environment for `sys.executable` restricted to the image's distributions (sitecustomize in `folder`)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return clean_env(
        PYTHONPATH=str(folder), AERIE_TEST_IMAGE_DISTRIBUTIONS=json.dumps(sorted(image_distributions(service))), **extra
    )


SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"


def inference_env(folder: Path, **extra: str) -> dict[str, str]:
    """Environment for SGLANG_PYTHON (SGLang's own set, as the inference image's base has it) plus
    exactly what the inference Dockerfile adds: its lock's pins and aerie's local packages, each
    `--no-deps`, taken from this venv (appended to the path: SGLang's versions win). Every other
    distribution of this venv stays hidden."""
    import subprocess

    folder.mkdir(parents=True, exist_ok=True)
    (venv_site,) = {p for p in __import__("site").getsitepackages() if p.endswith("site-packages")}
    sglang_dists = subprocess.run(
        [
            str(SGLANG_PYTHON),
            "-c",
            "import importlib.metadata as m; print('\\n'.join(d.metadata['Name'] for d in m.distributions()))",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout.split()
    allowed = {_norm(d) for d in sglang_dists} | image_distributions("inference")
    (folder / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({venv_site!r})\n" + SITECUSTOMIZE)
    return clean_env(PYTHONPATH=str(folder), AERIE_TEST_IMAGE_DISTRIBUTIONS=json.dumps(sorted(allowed)), **extra)
