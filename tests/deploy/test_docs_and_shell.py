"""docs/deploy.md names only what exists; every script a container runs passes ShellCheck."""

from __future__ import annotations

import pytest

from scripts.deploy_checks.compose import Project
from scripts.deploy_checks.docs import check_docs
from scripts.deploy_checks.shell import check_shell
from tests.deploy.breaks import Break, with_batches

# One batch: each edit renames what one line of the guide names, and its message quotes that name.
DOC_BREAKS = [
    Break(what, "docs/deploy.md", old, new, expected, batch="guide")
    for what, old, new, expected in [
        (
            "a Deployment that does not exist",
            "kubectl -n aerie logs -f deploy/trainer",
            "kubectl -n aerie logs -f deploy/trainers",
            "Deployment 'trainers' does not exist",
        ),
        (
            "a profile that does not exist",
            "docker compose --profile capture up -d --scale extractor=4",
            "docker compose --profile captur up -d --scale extractor=4",
            "profile 'captur'",
        ),
        (
            "a service that does not exist",
            "docker compose --profile train up -d trainer",
            "docker compose --profile train up -d trainers",
            "service 'trainers'",
        ),
        (
            "a service that does not exist, run in",
            "docker compose exec extractor celery",
            "docker compose exec extractors celery",
            "service 'extractors'",
        ),
        (
            "a Celery app no service runs",
            "extractor celery -A aerie_extractor.worker progress --run chat-v1\n",
            "extractor celery -A aerie.worker progress --run chat-v1\n",
            "Celery app 'aerie.worker'",
        ),
        (
            "an overlay that does not exist",
            "kubectl apply -k k8s/overlays/single-host\nkubectl -n aerie get",
            "kubectl apply -k k8s/overlays/one-host\nkubectl -n aerie get",
            "'k8s/overlays/one-host' does not exist",
        ),
    ]
]


def docs_problems(copy) -> list[str]:
    return check_docs(
        copy.root / "docs" / "deploy.md", Project(copy.root / "docker-compose.yml", copy.root / ".env.example")
    )


@pytest.mark.parametrize("broken,edits", with_batches(DOC_BREAKS))
def test_docs_check_reports_a_command_that_names_nothing(findings, broken, edits):
    problems = findings(docs_problems, edits)
    assert any(broken.expected in p for p in problems), f"{broken.what}: expected {broken.expected!r} in {problems}"


def test_docs_check_reports_a_guide_without_compose_commands_and_a_missing_one(deploy_copy):
    guide = deploy_copy.root / "docs" / "deploy.md"
    guide.write_text(guide.read_text().replace("```bash", "```text"))
    assert any("no `docker compose` command" in p for p in check_docs(guide))
    guide.unlink()
    assert any("missing (the deployment guide)" in p for p in check_docs(guide))


# One batch: each edit unquotes a secret in its own file, and its finding names that file.
SHELL_BREAKS = [
    Break(file, file, old, new, where, batch="scripts")
    for file, old, new, where in [
        (
            "k8s/base/redis.yaml",
            '--requirepass "$REDIS_PASSWORD"',
            "--requirepass $REDIS_PASSWORD",
            "k8s/base/redis.yaml",
        ),
        (
            "docker-compose.yml",
            '--requirepass "$${REDIS_PASSWORD}"',
            "--requirepass $${REDIS_PASSWORD}",
            "docker-compose.yml: services.redis.command",
        ),
        ("scripts/minio_init.sh", '"$MINIO_URL"', "$MINIO_URL", "scripts/minio_init.sh"),
    ]
]


def shell_problems(copy) -> list[str]:
    return check_shell(copy.root)


@pytest.mark.parametrize("broken,edits", with_batches(SHELL_BREAKS))
def test_shell_check_reports_an_unquoted_secret(findings, broken, edits):
    problems = findings(shell_problems, edits)
    assert any(p.startswith(broken.expected) and "SC2086" in p for p in problems), problems
