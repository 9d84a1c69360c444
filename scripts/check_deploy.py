"""aerie's deployment files checked the way Docker and a cluster would take them, without either.

    .venv/bin/python scripts/check_deploy.py              # every check; one line per problem, exit 1
    .venv/bin/python scripts/check_deploy.py compose k8s  # some of them

Each check (scripts/deploy_checks/) returns its problems, each naming the file, the place in it and
the fix. Real tools parse and validate (Docker Compose, BuildKit's parser, hadolint, ShellCheck,
kustomize, the Kubernetes OpenAPI schema); aerie's own rules are tables run on what they return.
tests/deploy/ runs every check on the real files and on broken copies.
"""

from __future__ import annotations

import sys

from deploy_checks import compose, dockerfiles, docs, k8s, locks, parity, shell

CHECKS = {
    "compose": compose.check_compose,
    "dockerfiles": dockerfiles.check_dockerfiles,
    "locks": locks.check_locks,
    "k8s": k8s.check_k8s,
    "parity": parity.check_parity,
    "docs": docs.check_docs,
    "shell": shell.check_shell,
}


def main(argv: list[str]) -> int:
    if unknown := [n for n in argv if n not in CHECKS]:
        print(f"unknown check(s) {unknown}; known: {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    failed = 0
    for name in argv or list(CHECKS):
        try:
            problems = CHECKS[name]()
        except (OSError, RuntimeError) as e:  # a tool missing or refusing to run: its own message
            problems = [f"could not run: {e}"]
        print("".join(f"[{name}] {p}\n" for p in problems), end="")
        print(f"{name}: {'ok' if not problems else f'{len(problems)} problem(s)'}", file=sys.stderr)
        failed += len(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
