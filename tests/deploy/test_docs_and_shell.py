"""docs/deploy.md names only what exists; every script a container runs passes ShellCheck."""

from __future__ import annotations

import pytest

from scripts.deploy_checks.compose import Project
from scripts.deploy_checks.docs import check_docs
from scripts.deploy_checks.shell import check_shell

DOC_BREAKS = [
    ("a Deployment that does not exist", "kubectl -n aerie logs -f deploy/trainer",
     "kubectl -n aerie logs -f deploy/trainers", "Deployment 'trainers' does not exist"),
    ("a profile that does not exist", "docker compose --profile capture up -d --scale extractor=4",
     "docker compose --profile captur up -d --scale extractor=4", "profile 'captur'"),
    ("a service that does not exist", "docker compose --profile train up -d trainer",
     "docker compose --profile train up -d trainers", "service 'trainers'"),
    ("a service that does not exist, run in", "docker compose exec extractor celery",
     "docker compose exec extractors celery", "service 'extractors'"),
    ("a Celery app no service runs", "extractor celery -A aerie_extractor.worker progress --run chat-v1\n",
     "extractor celery -A aerie.worker progress --run chat-v1\n", "Celery app 'aerie.worker'"),
    ("an overlay that does not exist", "kubectl apply -k k8s/overlays/single-host\nkubectl -n aerie get",
     "kubectl apply -k k8s/overlays/one-host\nkubectl -n aerie get", "'k8s/overlays/one-host' does not exist"),
]


@pytest.mark.parametrize("what,old,new,expected", DOC_BREAKS, ids=[b[0] for b in DOC_BREAKS])
def test_docs_check_reports_a_command_that_names_nothing(deploy_copy, what, old, new, expected):
    deploy_copy.edit("docs/deploy.md", old, new)
    project = Project(deploy_copy.root / "docker-compose.yml", deploy_copy.root / ".env.example")
    problems = check_docs(deploy_copy.root / "docs" / "deploy.md", project)
    assert any(expected in p for p in problems), f"{what}: expected {expected!r} in {problems}"


def test_docs_check_reports_a_guide_without_compose_commands_and_a_missing_one(deploy_copy):
    guide = deploy_copy.root / "docs" / "deploy.md"
    guide.write_text(guide.read_text().replace("```bash", "```text"))
    assert any("no `docker compose` command" in p for p in check_docs(guide))
    guide.unlink()
    assert any("missing (the deployment guide)" in p for p in check_docs(guide))


SHELL_BREAKS = [
    ("k8s/base/redis.yaml", '--requirepass "$REDIS_PASSWORD"', "--requirepass $REDIS_PASSWORD", "k8s/base/redis.yaml"),
    ("docker-compose.yml", '--requirepass "$${REDIS_PASSWORD}"', "--requirepass $${REDIS_PASSWORD}",
     "docker-compose.yml: services.redis.command"),
    ("scripts/minio_init.sh", '"$MINIO_URL"', "$MINIO_URL", "scripts/minio_init.sh"),
]


@pytest.mark.parametrize("file,old,new,where", SHELL_BREAKS, ids=[b[0] for b in SHELL_BREAKS])
def test_shell_check_reports_an_unquoted_secret(deploy_copy, file, old, new, where):
    deploy_copy.edit(file, old, new)
    problems = check_shell(deploy_copy.root)
    assert any(where in p and "SC2086" in p for p in problems), problems
