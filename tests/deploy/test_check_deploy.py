"""The checker's entry point: the developer's command passes on the real files, and every check
passes on the scratch copy the other tests break one edit at a time."""

from __future__ import annotations

import subprocess
import sys

from scripts.deploy_checks.compose import Project, check_compose
from scripts.deploy_checks.dockerfiles import check_dockerfiles
from scripts.deploy_checks.docs import check_docs
from scripts.deploy_checks.k8s import check_k8s
from scripts.deploy_checks.shell import check_shell
from tests.services import REPO


def test_the_deploy_checker_passes_on_the_real_files():
    """`.venv/bin/python scripts/check_deploy.py`: every check, one line per problem, exit 0 when none."""
    out = subprocess.run(
        [sys.executable, "scripts/check_deploy.py"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stderr.splitlines() == [
        "compose: ok",
        "dockerfiles: ok",
        "locks: ok",
        "k8s: ok",
        "parity: ok",
        "docs: ok",
        "shell: ok",
    ]


def test_every_check_passes_on_the_unbroken_copy(deploy_copy):
    root = deploy_copy.root
    project = Project(root / "docker-compose.yml", root / ".env.example")
    assert check_compose(project) == []
    assert check_dockerfiles(root) == []
    assert check_k8s(root) == []
    assert check_docs(root / "docs" / "deploy.md", project) == []
    assert check_shell(root) == []


def test_the_deploy_checker_refuses_an_unknown_check():
    out = subprocess.run([sys.executable, "scripts/check_deploy.py", "helm"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 2
    assert "unknown check(s) ['helm']; known: compose, dockerfiles, locks, k8s, parity, docs, shell" in out.stderr
