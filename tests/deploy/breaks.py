"""Broken copies of the deployment files: a scratch copy to edit, and the breaks the check tests
apply to it, batched so that one run of a check serves several (tests/deploy/conftest.py: findings)."""

from __future__ import annotations

import shutil
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.services import REPO

DEPLOY_FILES = ("docker-compose.yml", ".env.example", ".dockerignore", "scripts/minio_init.sh", "docs/deploy.md")


class DeployCopy:
    """A copy of the deployment files (package folders only as far as a COPY needs them)."""

    def __init__(self, root: Path):
        self.root = root
        for rel in DEPLOY_FILES:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / rel, root / rel)
        for dockerfile in REPO.glob("services/*/Dockerfile"):
            dest = root / dockerfile.relative_to(REPO)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(dockerfile, dest)
            shutil.copy(dockerfile.parent / "pyproject.toml", dest.parent / "pyproject.toml")
            for lock in dockerfile.parent.glob("requirements*"):  # the hashed locks the Dockerfile COPYs
                shutil.copy(lock, dest.parent / lock.name)
        (root / "shared").mkdir()
        shutil.copy(REPO / "shared" / "pyproject.toml", root / "shared" / "pyproject.toml")  # the locks' check reads it
        shutil.copytree(REPO / "k8s", root / "k8s")

    def edit(self, rel: str, old: str, new: str) -> None:
        """Replace the first `old` in one file (the test is stale if `old` is gone)."""
        path = self.root / rel
        text = path.read_text()
        assert old in text, f"{old!r} not in {rel}: update this test"
        path.write_text(text.replace(old, new, 1))


class Break(NamedTuple):
    """One broken input: `old` replaced by `new` in `file`, and what the check must then report.

    Breaks of one `batch` go into one copy, checked once: each edits a different service, resource or
    instruction, and each `expected` names what its own edit broke (so no other edit of the batch can
    produce it). A break without a batch (a refusal that stops the whole check, or two breaks of one
    place) gets a copy of its own."""

    what: str
    file: str
    old: str
    new: str
    expected: str
    batch: str = ""


def with_batches(breaks: list[Break]) -> list[tuple[Break, tuple]]:
    """pytest parameters: each break with the edits of its batch (its own alone, without a batch)."""
    edits = defaultdict(list)
    for b in breaks:
        edits[b.batch or b.what].append((b.file, b.old, b.new))
    return [pytest.param(b, tuple(edits[b.batch or b.what]), id=b.what) for b in breaks]
