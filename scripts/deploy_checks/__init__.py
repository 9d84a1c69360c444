"""Checks of aerie's deployment files, one module each. A check returns its problems, each naming
the file, the place in it and the fix; none means it passed. Real tools parse and validate (Docker
Compose, BuildKit's parser, hadolint, ShellCheck, kustomize, the Kubernetes OpenAPI schema);
aerie's own rules are tables run on what those tools return."""

from __future__ import annotations

from .compose import check_compose
from .dockerfiles import check_dockerfiles
from .docs import check_docs
from .k8s import check_k8s
from .shell import check_shell

CHECKS = {"compose": check_compose, "dockerfiles": check_dockerfiles, "k8s": check_k8s, "docs": check_docs,
          "shell": check_shell}
