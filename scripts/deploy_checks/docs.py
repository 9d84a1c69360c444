"""docs/deploy.md: every `docker compose`, `kubectl` and `celery -A` line names what exists.

Profiles, services and Celery apps come from the model Docker Compose renders; overlays are paths
under k8s/; `kubectl ... deploy/NAME` names a workload of k8s/base. Lines are split with shlex;
the only grammar written here is which `docker compose` options take a value.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from .common import REPO, celery_apps
from .compose import ComposeError, Project

_COMPOSE_VALUE_OPTS = {"-f", "--file", "-p", "--project-name", "--profile", "--env-file", "--scale", "-v", "--volume",
                       "-u", "--user", "-e", "--env", "--entrypoint", "-w", "--workdir", "--name", "-t", "--timeout",
                       "--index", "--tail", "-l", "--label"}
_KUBECTL_KINDS = {"deploy": "Deployment", "deployment": "Deployment", "sts": "StatefulSet",
                  "statefulset": "StatefulSet", "svc": "Service", "service": "Service", "job": "Job"}


def shell_commands(markdown: str) -> list[tuple[str, list[str]]]:
    """(line, argv) of each simple command in ```bash/sh/shell/console fences (split at && || ; |)."""
    lines, inside, buf = [], False, ""
    for s in (line.strip() for line in markdown.splitlines()):
        if s.startswith("```"):
            inside, buf = not inside and s[3:].strip() in ("bash", "sh", "shell", "console"), ""
        elif inside and s and not s.startswith("#"):
            buf += s.removeprefix("$ ").removesuffix("\\") + " "
            if not s.endswith("\\"):
                lines.append(buf.strip())
                buf = ""
    out = []
    for line in lines:
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:  # a quote spanning lines (a heredoc, a JSON block): not a command line
            continue
        argv: list[list[str]] = [[]]
        for t in tokens:
            argv.append([]) if t in ("&&", "||", ";", "|") else argv[-1].append(t)
        out += [(line, a) for a in argv if a]
    return out


def compose_command(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    """`docker compose ...` -> (profiles, services, the command `run`/`exec` runs in the container)."""
    profiles, positional, i = [], [], 2
    while i < len(argv) and not (len(positional) == 2 and positional[0] in ("run", "exec")):
        if argv[i] == "--profile":
            profiles.append(argv[i + 1])
        if argv[i] in _COMPOSE_VALUE_OPTS:
            i += 1
        elif not argv[i].startswith("-"):
            positional.append(argv[i])
        i += 1
    return profiles, positional[1:], argv[i:] if positional[:1] in (["run"], ["exec"]) else []


def check_docs(doc_path: Path = REPO / "docs" / "deploy.md", project: Project | None = None) -> list[str]:
    if not doc_path.exists():
        return [f"{doc_path}: missing (the deployment guide)"]
    repo = doc_path.parent.parent
    project = project or Project(repo / "docker-compose.yml", repo / ".env.example")
    try:
        services = project.render()["services"]
    except ComposeError as e:
        return [f"{project.compose_path.name}: docker compose config: {e}"]
    profiles = {p for svc in services.values() for p in svc.get("profiles") or []}
    apps = {app for svc in services.values() for app in celery_apps(svc.get("command"))}
    objects = {(d.get("kind"), (d.get("metadata") or {}).get("name"))
               for f in sorted((repo / "k8s" / "base").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d}
    commands = shell_commands(doc_path.read_text())
    problems = [] if any(a[:2] == ["docker", "compose"] for _, a in commands) else [
        f"{doc_path.name}: no `docker compose` command in a ```bash block"]
    for line, argv in commands:
        at, (profs, svcs, _) = f"{doc_path.name}: `{line}`", compose_command(argv)
        if argv[:2] == ["docker", "compose"]:
            problems += [f"{at}: profile {p!r} is not in {project.compose_path.name} (profiles: {', '.join(sorted(profiles))})"
                         for p in profs if p not in profiles]
            problems += [f"{at}: service {s!r} is not in {project.compose_path.name}" for s in svcs if s not in services]
        if argv[0] == "kubectl":
            problems += [f"{at}: {path} does not exist" for flag, path in zip(argv, argv[1:], strict=False)
                         if flag in ("-k", "-f", "--kustomize", "--filename") and path.startswith(("k8s/", "./k8s/"))
                         and not (repo / path).exists()]
            problems += [f"{at}: there is no {_KUBECTL_KINDS[k]} {o!r} in k8s/base" for k, slash, o in
                         (t.partition("/") for t in argv) if slash and k in _KUBECTL_KINDS
                         and (_KUBECTL_KINDS[k], o) not in objects]
        problems += [f"{at}: Celery app {app!r} is no compose service's app ({', '.join(sorted(apps))})"
                     for app in sorted(celery_apps(argv) - apps)]
    return problems
