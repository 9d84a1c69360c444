"""Each image's hashed lock (services/*/requirements*.lock) against what it must hold.

- Every line of the lock pins one version (`==`) and carries at least one sha256: `pip install
  --require-hashes` (the Dockerfiles) then installs those files and no other.
- Every requirement of the `.in` beside it is met by the lock's pin.
- A full lock (compiled with dependencies, not `--no-deps`) meets every runtime dependency of the
  packages its image installs (shared/pyproject.toml and the service's), except the aerie packages
  themselves and what the base image carries (BASE_IMAGE); so a version range widened or a
  dependency added in a pyproject without a new lock is reported.

Regenerate a lock with the command in its header (uv pip compile --generate-hashes).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from .common import REPO

# what an image's base already carries (the Dockerfile checks it), by service
BASE_IMAGE = {"trainer": {"torch"}}
LOCAL = {"aerie", "aerie-extractor", "aerie-trainer", "aerie-sglang"}


def _name(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


def parse_lock(text: str) -> dict[str, tuple[str, int]]:
    """name -> (version, number of hashes); a line that is no `name==version` pin maps to ('', 0)."""
    entries: dict[str, tuple[str, int]] = {}
    for block in re.sub(r"\\\n", " ", text).splitlines():
        block = block.split(" #", 1)[0].strip()
        if not block or block.startswith("#"):
            continue
        spec, *options = block.split(" --")
        name, sep, version = spec.strip().partition("==")
        hashes = sum(1 for o in options if o.startswith("hash=sha256:"))
        entries[_name(name) if sep else _name(spec.strip())] = (version.strip() if sep else "", hashes)
    return entries


def _requirements(lines: list[str]):
    from packaging.requirements import Requirement

    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            yield Requirement(line)


def _unmet(requirement, pins: dict) -> str | None:
    name = _name(requirement.name)
    if name not in pins or not pins[name][0]:
        return f"{requirement} is not pinned"
    if not requirement.specifier.contains(pins[name][0], prereleases=True):
        return f"{requirement} is not met by the pin {name}=={pins[name][0]}"
    return None


def check_lock(lock: Path, repo: Path = REPO) -> list[str]:
    rel = lock.relative_to(repo)
    text = lock.read_text()
    pins = parse_lock(text)
    problems = [f"{rel}: {n}: not pinned with == (a lock pins one version)" for n, (v, _) in pins.items() if not v]
    problems += [
        f"{rel}: {n}=={v}: no --hash=sha256 (pip --require-hashes refuses it)"
        for n, (v, h) in pins.items()
        if v and not h
    ]
    source = lock.with_suffix(".in")
    if not source.exists():
        return problems + [f"{rel}: no {source.name} beside it (what the lock was compiled from)"]
    problems += [
        f"{rel}: {why} (from {source.name})"
        for r in _requirements(source.read_text().splitlines())
        if (why := _unmet(r, pins))
    ]
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    if "--no-deps" in header or lock.name != "requirements.lock":
        return problems
    service = lock.parent.name
    for pyproject in (repo / "shared" / "pyproject.toml", lock.parent / "pyproject.toml"):
        deps = tomllib.loads(pyproject.read_text())["project"].get("dependencies", [])
        for r in _requirements(deps):
            if _name(r.name) in LOCAL or _name(r.name) in BASE_IMAGE.get(service, set()):
                continue
            if why := _unmet(r, pins):
                problems.append(f"{rel}: {why} ({pyproject.relative_to(repo)}): add it to {source.name} and regenerate")
    return problems


def check_locks(repo: Path = REPO) -> list[str]:
    locks = sorted(repo.glob("services/*/requirements*.lock"))
    missing = [
        f"services/{d.parent.name}: no requirements.lock (the image's hashed dependencies)"
        for d in sorted(repo.glob("services/*/Dockerfile"))
        if not (d.parent / "requirements.lock").exists()
    ]
    return missing + [p for lock in locks for p in check_lock(lock, repo)]
