"""ShellCheck on every script a container runs: compose commands and healthchecks as Compose renders
them, Kubernetes commands and probes, scripts/minio_init.sh."""

from __future__ import annotations

from pathlib import Path

import yaml

from .common import REPO, embedded_scripts, shellcheck
from .compose import Project, unescape


def check_shell(repo: Path = REPO) -> list[str]:
    problems: list[str] = []
    project = Project(repo / "docker-compose.yml", repo / ".env.example")
    if project.compose_path.exists() and project.env_example.exists():
        for where, script in embedded_scripts(project.render()["services"], "services"):
            problems += shellcheck(unescape(script), f"{project.compose_path.name}: {where}")
    for manifest in sorted((repo / "k8s").rglob("*.yaml")):
        for n, doc in enumerate(yaml.safe_load_all(manifest.read_text())):
            for where, script in embedded_scripts(doc):
                problems += shellcheck(script, f"{manifest.relative_to(repo)}[{n}]: {where}")
    for script in sorted((repo / "scripts").glob("minio_init.sh")):
        problems += shellcheck(script.read_text(), str(script.relative_to(repo)))
    return problems
