"""The images' hashed locks (scripts/deploy_checks/locks.py) and the Dockerfiles that install them:
the real files pass; a lock that lost a hash, a pyproject that moved past its lock, or a Dockerfile
that installs from the index without hashes are reported."""

from __future__ import annotations

import shutil

import pytest

from scripts.deploy_checks.dockerfiles import check_dockerfile
from scripts.deploy_checks.locks import check_locks, parse_lock
from tests.services import REPO


def test_the_images_locks_pin_every_dependency_with_hashes():
    assert check_locks() == []
    for service in ("extractor", "trainer", "inference"):
        pins = parse_lock((REPO / "services" / service / "requirements.lock").read_text())
        assert pins and all(v and h for v, h in pins.values()), service
    extractor = parse_lock((REPO / "services/extractor/requirements.lock").read_text())
    # the ranges the issue found unlocked, each pinned now
    assert {n: bool(extractor[n][0]) for n in ("numpy", "click", "tokenizers", "jinja2")} == dict.fromkeys(
        ("numpy", "click", "tokenizers", "jinja2"), True
    )


@pytest.fixture
def lock_copy(tmp_path):
    for path in [REPO / "shared/pyproject.toml", *REPO.glob("services/*/pyproject.toml")]:
        (tmp_path / path.relative_to(REPO)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, tmp_path / path.relative_to(REPO))
    for path in [*REPO.glob("services/*/requirements*"), *REPO.glob("services/*/Dockerfile")]:
        shutil.copy(path, tmp_path / path.relative_to(REPO))
    return tmp_path


def _edit(path, old, new):
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}: update this test"
    path.write_text(text.replace(old, new, 1))


def test_a_lock_out_of_step_with_its_packages_is_reported(lock_copy):
    lock = lock_copy / "services/extractor/requirements.lock"
    lines = lock.read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("click=="))
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith(" "))
    lock.write_text("".join(lines[:start] + [lines[start].replace(" \\", "")] + lines[end:]))  # click's hashes gone
    _edit(lock_copy / "shared/pyproject.toml", '"numpy>=1.26,<3"', '"numpy>=3"')
    _edit(
        lock_copy / "services/trainer/pyproject.toml",
        '"tensorboardX==2.6.5",',
        '"tensorboardX==2.6.5", "brand-new==1.0",',
    )
    problems = check_locks(lock_copy)
    assert any("services/extractor/requirements.lock: numpy>=3 is not met by the pin numpy==" in p for p in problems), (
        problems
    )
    assert any("services/trainer/requirements.lock: brand-new==1.0 is not pinned" in p for p in problems), problems
    assert any("extractor/requirements.lock: click==" in p and "no --hash" in p for p in problems), problems


def test_a_dockerfile_installing_without_hashes_is_reported(lock_copy):
    dockerfile = lock_copy / "services/trainer/Dockerfile"
    _edit(dockerfile, "--require-hashes --no-deps -r /opt/aerie/requirements.lock", "-r /opt/aerie/requirements.lock")
    (lock_copy / ".dockerignore").write_text((REPO / ".dockerignore").read_text())
    (lock_copy / "shared").mkdir(exist_ok=True)
    problems = check_dockerfile(dockerfile, lock_copy)
    assert any("may install files no hash pins" in p for p in problems), problems
    assert not any("may install" in p for p in check_dockerfile(REPO / "services/trainer/Dockerfile"))
