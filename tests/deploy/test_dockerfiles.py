"""services/*/Dockerfile: BuildKit's parser and hadolint, plus aerie's rules (pins, user, secrets, COPY)."""

from __future__ import annotations

import re
import tomllib

import pytest

from scripts import import_graph
from scripts.deploy_checks.dockerfiles import check_dockerfiles, dockerfile_args, dockerignored
from tests.deploy.breaks import Break, with_batches
from tests.deploy.images import image_packages
from tests.services import REPO


def test_inference_image_is_the_sglang_version_the_code_targets():
    launch = (REPO / "services" / "inference" / "aerie_sglang" / "cpu" / "launch.py").read_text()
    version = re.search(r'SGLANG_VERSION = "([^"]+)"', launch).group(1)
    assert f"sglang=={version}" in (REPO / "scripts" / "sglang_env.sh").read_text()
    args = dockerfile_args((REPO / "services" / "inference" / "Dockerfile").read_text())
    assert args["SGLANG_IMAGE_TAG"] == f"v{version}"
    assert f"\nSGLANG_IMAGE_TAG=v{version}\n" in (REPO / ".env.example").read_text()


def test_trainer_image_carries_the_pinned_torch_and_extractor_image_none():
    pins = tomllib.loads((REPO / "services" / "trainer" / "pyproject.toml").read_text())["project"]["dependencies"]
    torch = next(p.split("==")[1] for p in pins if p.startswith("torch=="))
    tag = dockerfile_args((REPO / "services" / "trainer" / "Dockerfile").read_text())["PYTORCH_IMAGE_TAG"]
    assert tag.startswith(f"{torch}-cuda") and tag.endswith("-runtime")
    extractor = (REPO / "services" / "extractor" / "Dockerfile").read_text()
    assert "[hf]" not in extractor.split("RUN pip install", 1)[1].split("\n")[0]
    assert image_packages("extractor") == {"aerie", "aerie-extractor"}


# "hadolint:" marks a rule hadolint owns (the checker has no version of its own). Breaks of one batch
# ("x", "y", "z") edit different instructions; a parse failure, a removed FROM or USER get a copy each.
EXTRACTOR, INFERENCE = "services/extractor/Dockerfile", "services/inference/Dockerfile"
DOCKERFILE_BREAKS = [
    Break(
        "hadolint: FROM latest",
        EXTRACTOR,
        "FROM docker.io/library/python:3.11.13-slim-bookworm",
        "FROM python:latest",
        "DL3007",
        batch="x",
    ),
    Break(
        "hadolint: FROM without a tag",
        EXTRACTOR,
        "FROM docker.io/library/python:3.11.13-slim-bookworm",
        "FROM python",
        "DL3006",
        batch="y",
    ),
    Break("hadolint: root USER", EXTRACTOR, "USER 10001:10001\n", "USER root\n", "DL3002", batch="y"),
    Break("hadolint: a non-numeric USER", EXTRACTOR, "USER 10001:10001\n", "USER aerie\n", "DL3066", batch="z"),
    Break(
        "hadolint: a RUN finding",
        EXTRACTOR,
        "USER 10001:10001\n",
        "RUN cd /opt && ls\nUSER 10001:10001\n",
        "DL3003",
        batch="x",
    ),
    Break(
        "a Dockerfile BuildKit cannot parse",
        EXTRACTOR,
        "USER 10001:10001\n",
        "RUN <<EOF\nUSER 10001:10001\n",
        "does not parse: unterminated heredoc",
    ),
    Break("hadolint: no FROM", EXTRACTOR, "FROM docker.io/library/python:3.11.13-slim-bookworm\n", "", "DL3061"),
    Break(
        "a FROM of no named registry",
        EXTRACTOR,
        "FROM docker.io/library/python:",
        "FROM python:",
        "image 'python:3.11.13-slim-bookworm' names no registry",
        batch="z",
    ),
    Break("no USER", EXTRACTOR, "USER 10001:10001\n", "", "no USER"),
    Break("hadolint: no HEALTHCHECK", EXTRACTOR, "HEALTHCHECK ", "# HEALTHCHECK ", "DL3057", batch="x"),
    Break(
        "COPY of a missing path",
        EXTRACTOR,
        "COPY shared /opt/aerie/shared",
        "COPY common /opt/aerie/shared",
        "COPY common: no such path",
        batch="x",
    ),
    Break(
        "a secret baked into ENV",
        EXTRACTOR,
        "PIP_NO_CACHE_DIR=1",
        "PIP_NO_CACHE_DIR=1 AERIE_S3_SECRET_KEY=hunter2",
        "ENV AERIE_S3_SECRET_KEY bakes a secret",
        batch="x",
    ),
    Break(
        "an ARG with a secret default",
        EXTRACTOR,
        "USER 10001:10001\n",
        "ARG HF_TOKEN=hf_abc\nUSER 10001:10001\n",
        "ARG HF_TOKEN's default bakes a secret",
        batch="x",
    ),
    Break(
        "a FROM tag from an ARG set to latest",
        INFERENCE,
        "ARG SGLANG_IMAGE_TAG=v0.5.23",
        "ARG SGLANG_IMAGE_TAG=latest",
        "FROM docker.io/lmsysorg/sglang:${SGLANG_IMAGE_TAG} -> image 'docker.io/lmsysorg/sglang:latest' uses `latest`",
        batch="x",
    ),
    Break(
        "a FROM tag from an ARG without a default",
        INFERENCE,
        "ARG SGLANG_IMAGE_TAG=v0.5.23",
        "ARG SGLANG_IMAGE_TAG",
        "ARG SGLANG_IMAGE_TAG has no default",
        batch="y",
    ),
    Break(
        "HEALTHCHECK NONE",
        EXTRACTOR,
        "HEALTHCHECK ",
        "HEALTHCHECK NONE\n# HEALTHCHECK ",
        "HEALTHCHECK NONE: the image needs a health check",
        batch="y",
    ),
    Break(
        ".dockerignore excluding a COPY source",
        ".dockerignore",
        "!services/\n",
        "",
        "COPY services/extractor: excluded by .dockerignore",
        batch="x",
    ),
]


def dockerfile_problems(copy) -> list[str]:
    return check_dockerfiles(copy.root)


@pytest.mark.parametrize("broken,edits", with_batches(DOCKERFILE_BREAKS))
def test_dockerfile_check_reports_a_broken_image(findings, broken, edits):
    problems = findings(dockerfile_problems, edits)
    assert any(broken.expected in p for p in problems), f"{broken.what}: expected {broken.expected!r} in {problems}"


def test_dockerfile_check_reports_a_missing_dockerignore_and_a_service_without_a_dockerfile(deploy_copy):
    (deploy_copy.root / ".dockerignore").unlink()
    (deploy_copy.root / "services" / "extractor" / "Dockerfile").unlink()
    problems = check_dockerfiles(deploy_copy.root)
    assert any(".dockerignore: missing" in p for p in problems), problems
    assert any("services/extractor: a service without a Dockerfile" in p for p in problems), problems


def test_the_inference_image_leaves_the_cpu_harness_out():
    """The CPU test harness (aerie_sglang.cpu) stays out of the build context, and nothing the image
    ships imports it."""
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert dockerignored("services/inference/aerie_sglang/cpu/launch.py", patterns)
    assert dockerignored("services/inference/aerie_sglang/cpu/shim/sgl_kernel/__init__.py", patterns)
    assert not dockerignored("services/inference/aerie_sglang/plugin/__init__.py", patterns)
    assert not dockerignored("services/inference/pyproject.toml", patterns)
    shipped = {m: deps for m, deps in import_graph.graph().items() if m.startswith("aerie_sglang")}
    assert "aerie_sglang.plugin" in shipped
    assert not [
        (m, d)
        for m, deps in shipped.items()
        if not m.startswith("aerie_sglang.cpu")
        for d in deps
        if d.startswith("aerie_sglang.cpu")
    ]
