"""Fixtures of the deploy tests: the deployment files in a scratch repo, to break one at a time."""

from __future__ import annotations

import shutil
from pathlib import Path

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
        (root / "shared").mkdir()
        shutil.copytree(REPO / "k8s", root / "k8s")

    def edit(self, rel: str, old: str, new: str) -> None:
        """Replace the first `old` in one file (the test is stale if `old` is gone)."""
        path = self.root / rel
        text = path.read_text()
        assert old in text, f"{old!r} not in {rel}: update this test"
        path.write_text(text.replace(old, new, 1))


@pytest.fixture
def deploy_copy(tmp_path) -> DeployCopy:
    return DeployCopy(tmp_path)


@pytest.fixture(scope="session")
def compose_services() -> dict:
    """The services of docker-compose.yml as Docker Compose renders them (every profile, .env.example
    with stand-ins for the empty secrets)."""
    from scripts.deploy_checks.compose import Project

    return Project().render()["services"]
