"""What an image installs, read from its Dockerfile (a helper of the deploy tests, no fixtures)."""

from __future__ import annotations

import re
import tomllib

from scripts.deploy_checks.dockerfiles import dockerfile_instructions
from tests.services import REPO


def image_packages(service: str) -> set[str]:
    """Distributions a service's Dockerfile pip-installs (names from each folder's pyproject)."""
    dists = set()
    for c in dockerfile_instructions((REPO / "services" / service / "Dockerfile").read_text()):
        if c.cmd == "RUN" and "pip install" in (rest := " ".join(c.value)):
            for folder in re.findall(r"/opt/aerie/((?:shared|services/[a-z]+))", rest):
                dists.add(tomllib.loads((REPO / folder / "pyproject.toml").read_text())["project"]["name"])
    return dists
