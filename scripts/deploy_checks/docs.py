"""docs/deploy.md: every `docker compose`, `kubectl` and `celery -A` line names what exists.

A Markdown parser (markdown-it, CommonMark) finds the guide's shell blocks, shlex splits their lines
into commands. What a command may name: a profile, service or Celery app of the model Docker Compose
renders, a workload of k8s/base, a path under k8s/. The only grammar written here is which
`docker compose` options take a value.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml
from markdown_it import MarkdownIt

from .common import REPO, celery_apps, dig
from .compose import ComposeError, Project

_COMPOSE_VALUE_OPTS = {
    "-f",
    "--file",
    "-p",
    "--project-name",
    "--profile",
    "--env-file",
    "--scale",
    "-v",
    "--volume",
    "-u",
    "--user",
    "-e",
    "--env",
    "--entrypoint",
    "-w",
    "--workdir",
    "--name",
    "-t",
    "--timeout",
    "--index",
    "--tail",
    "-l",
    "--label",
}
_KUBECTL_KINDS = {
    "deploy": "Deployment",
    "deployment": "Deployment",
    "sts": "StatefulSet",
    "statefulset": "StatefulSet",
    "svc": "Service",
    "service": "Service",
    "job": "Job",
}


def shell_commands(markdown: str) -> list[tuple[str, list[str]]]:
    """(line, argv) of each simple command in ```bash/sh/shell/console blocks (split at && || ; |)."""
    found = []
    for block in MarkdownIt().parse(markdown):
        for line in (
            block.content.replace("\\\n", " ").splitlines()
            if block.type == "fence" and block.info.strip() in ("bash", "sh", "shell", "console")
            else []
        ):
            lexer = shlex.shlex(line.strip().removeprefix("$ "), posix=True, punctuation_chars=";&|")
            lexer.whitespace_split = True
            try:
                tokens = list(lexer)
            except ValueError:  # a quote spanning lines (a heredoc, a JSON block): not a command line
                continue
            argv: list[list[str]] = [[]]
            for t in tokens:
                argv.append([]) if t in ("&&", "||", ";", "|") else argv[-1].append(t)
            found += [(" ".join(line.split()), a) for a in argv if a]
    return found


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


def documented_secrets(doc_path: Path) -> dict[str, set[str]]:
    """Secret name -> keys, from the guide's `kubectl create secret generic NAME --from-literal=KEY=...`."""
    found: dict[str, set[str]] = {}
    for _, argv in shell_commands(doc_path.read_text()) if doc_path.exists() else []:
        if argv[0] == "kubectl" and "create" in argv and "generic" in argv:
            found.setdefault(argv[argv.index("generic") + 1], set()).update(
                a.split("=")[1] for a in argv if a.startswith("--from-literal=")
            )
    return found


def named(argv: list[str]) -> list[tuple[str, str]]:
    """(kind, name) of everything one command names."""
    profiles, services, _ = compose_command(argv) if argv[:2] == ["docker", "compose"] else ([], [], [])
    kubectl = argv if argv[0] == "kubectl" else []
    return (
        [("profile", p) for p in profiles]
        + [("service", s) for s in services]
        + [
            ("path", path)
            for flag, path in zip(kubectl, kubectl[1:])
            if flag in ("-k", "-f", "--kustomize", "--filename") and path.startswith(("k8s/", "./k8s/"))
        ]
        + [
            (_KUBECTL_KINDS[k], o)
            for k, slash, o in (t.partition("/") for t in kubectl)
            if slash and k in _KUBECTL_KINDS
        ]
        + [("Celery app", app) for app in sorted(celery_apps(argv))]
    )


def check_docs(doc_path: Path = REPO / "docs" / "deploy.md", project: Project | None = None) -> list[str]:
    if not doc_path.exists():
        return [f"{doc_path}: missing (the deployment guide)"]
    repo = doc_path.parent.parent
    project = project or Project(repo / "docker-compose.yml", repo / ".env.example")
    try:
        services = project.render()["services"]
    except ComposeError as e:
        return [f"{project.compose_path.name}: docker compose config: {e}"]
    known = (
        {("service", s) for s in services}
        | {("profile", p) for s in services.values() for p in s.get("profiles") or []}
        | {("profile", "*")}  # Compose's every profile at once
        | {("Celery app", app) for s in services.values() for app in celery_apps(s.get("command"))}
        | {
            (d.get("kind"), dig(d, "metadata", "name"))
            for f in (repo / "k8s" / "base").glob("*.yaml")
            for d in yaml.safe_load_all(f.read_text())
            if d
        }
    )
    commands = shell_commands(doc_path.read_text())
    problems = (
        []
        if any(a[:2] == ["docker", "compose"] for _, a in commands)
        else [f"{doc_path.name}: no `docker compose` command in a ```bash block"]
    )
    for line, argv in commands:
        problems += [
            f"{doc_path.name}: `{line}`: {kind} {name!r} does not exist"
            + (kind != "path") * (f" (there are: {', '.join(sorted(n for k, n in known if k == kind))})")
            for kind, name in named(argv)
            if not ((repo / name).exists() if kind == "path" else (kind, name) in known)
        ]
    return problems
