"""Static checks of aerie's deployment files: what Docker and a cluster would refuse, found without them.

Each check returns a list of problems, each naming the file, the place in it and what to change;
an empty list means it passed. Real tools do the parsing: Docker Compose (compose), BuildKit's
parser and hadolint (dockerfiles), ShellCheck (shell), kustomize and the Kubernetes OpenAPI schema
(k8s); the modules add only aerie's own rules. Entry point: scripts/check_deploy.py.
"""

from __future__ import annotations

from .compose import check_compose
from .dockerfiles import check_dockerfiles
from .docs import check_docs
from .k8s import check_k8s
from .shell import check_shell

CHECKS = {
    "compose": check_compose,
    "dockerfiles": check_dockerfiles,
    "k8s": check_k8s,
    "docs": check_docs,
    "shell": check_shell,
}
