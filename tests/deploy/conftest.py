"""Fixtures of the deploy tests: the deployment files in scratch copies to break, the checks' findings
on them (one check per batch of breaks), the real-files Compose render, and the runtime tests' SGLang
server, started as the session begins so that its minute of start-up overlaps the static tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.breaks import DeployCopy
from tests.deploy.servers import RestartableServer, linked_copy


@pytest.fixture
def deploy_copy(tmp_path) -> DeployCopy:
    return DeployCopy(tmp_path)


@pytest.fixture(scope="session")
def findings(tmp_path_factory):
    """findings(check, edits) -> what `check(copy)` reports on a scratch copy with `edits` applied;
    once per (check, edits) in the session, so the breaks of a batch share one run."""
    found: dict = {}

    def run(check, edits: tuple) -> list[str]:
        if (check, edits) not in found:
            copy = DeployCopy(tmp_path_factory.mktemp("broken"))
            for file, old, new in edits:
                copy.edit(file, old, new)
            found[check, edits] = check(copy)
        return found[check, edits]

    return run


@pytest.fixture(scope="session")
def compose_services() -> dict:
    """The services of docker-compose.yml as Docker Compose renders them (every profile, .env.example
    with stand-ins for the empty secrets)."""
    from scripts.deploy_checks.compose import Project

    return Project().render()["services"]


@pytest.fixture(scope="session")
def sglang_target(smollm2_path, tmp_path_factory) -> Path:
    """SmolLM2 in a folder of its own (hard links): what is written into it can be seen."""
    return linked_copy(smollm2_path, tmp_path_factory.mktemp("target") / "model")


@pytest.fixture(scope="session", autouse=True)
def _deploy_sglang_starting(request, tmp_path_factory):
    """When the session will run a test of `deploy_sglang`, its server starts with the first deploy test."""
    if not any("deploy_sglang" in item.fixturenames for item in request.session.items):
        yield None
        return
    server = RestartableServer(request.getfixturevalue("sglang_target"), tmp_path_factory.mktemp("sglang"))
    server.start_soon()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def deploy_sglang(_deploy_sglang_starting):
    """The runtime tests' SGLang server (stopped after their module)."""
    yield _deploy_sglang_starting.ready()
    _deploy_sglang_starting.stop()
