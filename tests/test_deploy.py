"""Deployment files, checked without Docker or a cluster (docs/deploy.md).

The checks live in scripts/check_deploy.py, which a developer runs the same way
(`.venv/bin/python scripts/check_deploy.py`). Here they run on the real files, and on broken
copies of them, to show that each check catches what it claims to. The commands the compose file
and the guide run are resolved against the installed code: the Celery apps import and build with
the compose environment, the `celery`/`aerie` sub-commands exist in the packages of the image that
runs them, and SGLang's own argument parser accepts the inference command lines.
"""

from __future__ import annotations

import filecmp
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
SGLANG_PY = REPO / ".venv-sglang" / "bin" / "python"


def _load_checker():
    spec = importlib.util.spec_from_file_location("check_deploy", REPO / "scripts" / "check_deploy.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_deploy"] = module
    spec.loader.exec_module(module)
    return module


cd = _load_checker()


def _compose(env_overrides: dict[str, str] | None = None) -> dict:
    documented = cd.read_env_file(REPO / ".env.example")
    refs = [
        r for _, s in cd._walk(yaml.safe_load((REPO / "docker-compose.yml").read_text())) for r in cd.var_refs(s, "")
    ]
    env = cd.filled_env(documented, {r.name for r in refs if r.op == ":?"})
    env.update(env_overrides or {})
    return cd.load_compose(REPO / "docker-compose.yml", env)


def _sh_script(service: dict) -> str:
    cmd = service["command"]
    assert cmd[:2] == ["sh", "-c"], f"expected a `sh -c` command, got {cmd[:2]}"
    return cmd[2]


# --------------------------------------------------------------------------------------------
# the real files pass every check
# --------------------------------------------------------------------------------------------


def test_compose_validates_against_the_compose_spec_and_every_reference_resolves():
    schema = cd.compose_schema()
    assert schema["title"] == "Compose Specification"
    assert cd.check_compose() == []


def test_dockerfiles_are_pinned_non_root_with_healthchecks():
    assert cd.check_dockerfiles() == []


def test_k8s_overlays_render_with_kustomize_and_validate_against_kubernetes_schemas():
    assert cd.check_k8s() == []
    for overlay in cd.overlays():
        kinds = {(r["kind"], r["metadata"]["name"]) for r in cd.kustomize_build(overlay)}
        for expected in [
            ("Deployment", "inference"),
            ("Deployment", "extractor"),
            ("Deployment", "trainer"),
            ("StatefulSet", "redis"),
            ("StatefulSet", "minio"),
            ("Job", "minio-init"),
            ("ScaledObject", "extractor"),
            ("PersistentVolumeClaim", "aerie-models"),
        ]:
            assert expected in kinds, f"{overlay.name}: {expected} missing from the render"


def test_deployment_guide_names_only_what_exists():
    assert cd.check_docs() == []


def test_every_shell_script_the_deployment_runs_passes_shellcheck():
    assert cd.check_shell() == []


def _component_overlay(tmp_path: Path, components: list[str], literals: list[str]) -> Path:
    """An overlay outside the repo (as a user writes one) over the base plus some components."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    rel = os.path.relpath(REPO / "k8s", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "namespace": "aerie",
                "resources": [f"{rel}/base"],
                "components": [f"{rel}/components/{c}" for c in components],
                "configMapGenerator": [{"name": "inference-config", "behavior": "merge", "literals": literals}],
            }
        )
    )
    return tmp_path


def test_k8s_serve_and_hpa_components_render_and_validate(tmp_path):
    serve = cd.kustomize_build(
        _component_overlay(tmp_path / "serve", ["keda", "serve"], ["DRAFTER=chat-eagle3", "CAPTURE_LAYER_IDS=1 14 26"])
    )
    assert cd.check_rendered(serve, "serve") == []
    config = next(r for r in serve if r["kind"] == "ConfigMap" and r["metadata"]["name"].startswith("inference-config"))
    assert config["data"]["DRAFTER"] == "chat-eagle3", "the overlay's DRAFTER must survive the serve component"
    pod = next(r for r in serve if r["kind"] == "Deployment" and r["metadata"]["name"] == "inference")["spec"][
        "template"
    ]["spec"]
    assert "aerie pull" in pod["initContainers"][0]["command"][2]
    assert "--speculative-draft-model-path /drafters/current" in pod["containers"][0]["command"][2]
    assert not any(e["name"] == "AERIE_SGLANG_BINARY" for e in pod["containers"][0].get("env") or [])

    hpa = cd.kustomize_build(_component_overlay(tmp_path / "hpa", ["hpa"], ["CAPTURE_LAYER_IDS=1 14 26"]))
    assert cd.check_rendered(hpa, "hpa") == []
    assert [r["kind"] for r in hpa if r["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")] == [
        "HorizontalPodAutoscaler"
    ]


def test_k8s_minio_init_script_is_the_compose_one():
    assert filecmp.cmp(REPO / "scripts" / "minio_init.sh", REPO / "k8s" / "base" / "minio_init.sh", shallow=False), (
        "k8s/base/minio_init.sh must be a copy of scripts/minio_init.sh: cp scripts/minio_init.sh k8s/base/"
    )


def test_compose_has_what_the_gpu_host_needs():
    doc = _compose()
    s = doc["services"]
    assert cd.compose_profiles(doc) >= {"capture", "serve", "train", "monitoring"}
    capture, serve = _sh_script(s["inference-capture"]), _sh_script(s["inference-serve"])
    for flag in (
        "--enable-return-aux-hidden-states",
        "--return-aux-hidden-state-layer-ids",
        "--disable-radix-cache",
        '--tp "${TP_SIZE}"',
    ):
        assert flag in capture
    for flag in (
        "--speculative-algorithm EAGLE3",
        "--speculative-draft-model-path",
        "--speculative-num-steps",
        '--tp "${TP_SIZE}"',
    ):
        assert flag in serve
    assert "--disable-radix-cache" not in serve
    for name in ("inference-capture", "inference-serve", "trainer"):
        devices = s[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"], name
    # extractor scales with --scale: no fixed name, no host port, no GPU
    assert not {"container_name", "ports", "deploy"} & set(s["extractor"])
    redis = _sh_script(s["redis"])
    assert "--requirepass" in redis and "--appendonly yes" in redis
    assert any(v.endswith(":/data") for v in s["redis"]["volumes"]) and any(
        v.endswith(":/data") for v in s["minio"]["volumes"]
    )
    for worker in ("extractor", "trainer"):
        assert s[worker]["depends_on"]["minio-init"]["condition"] == "service_completed_successfully"
        assert s[worker]["depends_on"]["redis"]["condition"] == "service_healthy"
    raw = (REPO / "docker-compose.yml").read_text()
    for secret in ("REDIS_PASSWORD", "MINIO_ROOT_PASSWORD", "AERIE_S3_SECRET_KEY", "FLOWER_PASSWORD"):
        assert f"${{{secret}:?Variable not set}}" in raw


def test_compose_refuses_to_start_without_secrets():
    """With .env copied from .env.example and nothing filled in, interpolation stops on a secret."""
    with pytest.raises(
        cd.InterpolationError, match=r"required variable (REDIS_PASSWORD|AERIE_S3_|MINIO_ROOT_|MODEL_DIR|FLOWER_)"
    ):
        cd.load_compose(REPO / "docker-compose.yml", cd.read_env_file(REPO / ".env.example"))


def test_inference_image_is_the_sglang_version_the_code_targets():
    launch = (REPO / "services" / "inference" / "aerie_sglang" / "cpu" / "launch.py").read_text()
    version = re.search(r'SGLANG_VERSION = "([^"]+)"', launch).group(1)
    assert f"sglang=={version}" in (REPO / "scripts" / "sglang_env.sh").read_text()
    assert (
        cd.dockerfile_args((REPO / "services" / "inference" / "Dockerfile").read_text())["SGLANG_IMAGE_TAG"]
        == f"v{version}"
    )
    assert cd.read_env_file(REPO / ".env.example")["SGLANG_IMAGE_TAG"] == f"v{version}"


def test_trainer_image_carries_the_pinned_torch_and_extractor_image_none():
    pins = tomllib.loads((REPO / "services" / "trainer" / "pyproject.toml").read_text())["project"]["dependencies"]
    torch = next(p.split("==")[1] for p in pins if p.startswith("torch=="))
    tag = cd.dockerfile_args((REPO / "services" / "trainer" / "Dockerfile").read_text())["PYTORCH_IMAGE_TAG"]
    assert tag.startswith(f"{torch}-cuda") and tag.endswith("-runtime")
    extractor = (REPO / "services" / "extractor" / "Dockerfile").read_text()
    assert "[hf]" not in extractor.split("RUN pip install", 1)[1].split("\n")[0]
    assert image_packages("extractor") == {"aerie", "aerie-extractor"}


# --------------------------------------------------------------------------------------------
# the checks fail on broken references
# --------------------------------------------------------------------------------------------


@pytest.fixture
def deploy_copy(tmp_path) -> Path:
    """The deployment files in a scratch repo (package folders only as far as COPY needs them)."""
    for rel in ("docker-compose.yml", ".env.example", ".dockerignore", "scripts/minio_init.sh", "docs/deploy.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, tmp_path / rel)
    for dockerfile in REPO.glob("services/*/Dockerfile"):
        dest = tmp_path / dockerfile.relative_to(REPO)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(dockerfile, dest)
        shutil.copy(dockerfile.parent / "pyproject.toml", dest.parent / "pyproject.toml")
    (tmp_path / "shared").mkdir()
    shutil.copytree(REPO / "k8s", tmp_path / "k8s")
    return tmp_path


def _edit(path: Path, old: str, new: str, count: int = 1) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path.name}: update this test"
    path.write_text(text.replace(old, new, count))


COMPOSE_BREAKS = [
    (
        "a depends_on target that is no service",
        "docker-compose.yml",
        "      redis:\n        condition: service_healthy\n      minio-init:",
        "      redis-cache:\n        condition: service_healthy\n      minio-init:",
        "'redis-cache' is not a service",
    ),
    (
        "an env reference missing from .env.example",
        "docker-compose.yml",
        "${AERIE_BUCKET:-aerie}",
        "${AERIE_BUCKT:-aerie}",
        "${AERIE_BUCKT} is not in .env.example",
    ),
    (
        "an undeclared named volume",
        "docker-compose.yml",
        "- redis-data:/data",
        "- redis-dat:/data",
        "named volume 'redis-dat' is not declared",
    ),
    (
        "an undeclared network",
        "docker-compose.yml",
        '    networks: [aerie]\n    healthcheck:\n      test: ["CMD", "mc"',
        '    networks: [aerie, backend]\n    healthcheck:\n      test: ["CMD", "mc"',
        "'backend' is not declared under top-level networks",
    ),
    (
        "a key the Compose Specification does not know",
        "docker-compose.yml",
        "    restart: unless-stopped\n    # Password",
        "    restat: unless-stopped\n    # Password",
        "Compose Specification schema",
    ),
    (
        "an AERIE_* variable aerie does not know",
        "docker-compose.yml",
        "AERIE_ENGINE: sglang",
        "AERIE_ENGIN: sglang",
        "AERIE_ENGIN is not an aerie setting",
    ),
    (
        "a container shell variable its environment does not set",
        "docker-compose.yml",
        "      TP_SIZE: ${TP_SIZE:-8}\n      SERVED_MODEL_NAME: ${SERVED_MODEL_NAME:-target}\n      CAPTURE_LAYER_IDS",
        "      SERVED_MODEL_NAME: ${SERVED_MODEL_NAME:-target}\n      CAPTURE_LAYER_IDS",
        "reads $TP_SIZE",
    ),
    (
        "a default that disagrees with .env.example",
        ".env.example",
        "TP_SIZE=8",
        "TP_SIZE=4",
        "default of ${TP_SIZE} is '8' but .env.example says '4'",
    ),
    (
        "a secret that is not required",
        "docker-compose.yml",
        "REDIS_PASSWORD: ${REDIS_PASSWORD:?Variable not set}",
        "REDIS_PASSWORD: ${REDIS_PASSWORD:-changeme}",
        "secret ${REDIS_PASSWORD} must be required",
    ),
    (
        "a service waiting on a profiled service it cannot require",
        "docker-compose.yml",
        "        required: false   # absent",
        "        # absent",
        "add `required: false`",
    ),
    (
        "service_healthy on a service without a healthcheck",
        "docker-compose.yml",
        "    depends_on:\n      minio-init:\n        condition: service_completed_successfully\n\nnetworks:",
        "    depends_on:\n      minio-init:\n        condition: service_healthy\n\nnetworks:",
        "minio-init has no healthcheck",
    ),
    ("an unpinned image", "docker-compose.yml", "image: redis:7.4.2-alpine", "image: redis:latest", "uses `latest`"),
    (
        "a build arg the Dockerfile does not declare",
        "docker-compose.yml",
        "SGLANG_IMAGE_TAG: ${SGLANG_IMAGE_TAG:-v0.5.23}",
        "SGLANG_TAG: ${SGLANG_IMAGE_TAG:-v0.5.23}",
        "SGLANG_TAG is not an ARG",
    ),
    (
        "a healthcheck pinging another Celery app",
        "docker-compose.yml",
        "celery -A aerie_trainer.worker inspect ping",
        "celery -A aerie_extractor.worker inspect ping",
        "pings Celery app ['aerie_extractor.worker']",
    ),
    (
        "an unescaped $ compose would refuse",
        "docker-compose.yml",
        "celery@$$(hostname)",
        "celery@$(hostname)",
        "invalid interpolation",
    ),
    (
        "a .env.example variable nothing uses",
        ".env.example",
        "FLOWER_PORT=5555",
        "FLOWER_PORT=5555\nOLD_KNOB=1",
        "OLD_KNOB is not used",
    ),
]


@pytest.mark.parametrize("what,file,old,new,expected", COMPOSE_BREAKS, ids=[b[0] for b in COMPOSE_BREAKS])
def test_compose_check_reports_a_broken_reference(deploy_copy, what, file, old, new, expected):
    compose, env = deploy_copy / "docker-compose.yml", deploy_copy / ".env.example"
    assert cd.check_compose(compose, env) == []
    _edit(deploy_copy / file, old, new)
    problems = cd.check_compose(compose, env)
    assert any(expected in p for p in problems), f"{what}: expected {expected!r} in {problems}"


DOCKERFILE_BREAKS = [
    ("FROM latest", "FROM python:3.11.13-slim-bookworm", "FROM python:latest", "uses `latest`"),
    ("FROM without a tag", "FROM python:3.11.13-slim-bookworm", "FROM python", "has no tag"),
    ("no USER", "USER 10001:10001\n", "", "no USER"),
    ("a hadolint finding", "USER 10001:10001\n", "RUN cd /opt && ls\nUSER 10001:10001\n", "DL3003"),
    ("root USER", "USER 10001:10001\n", "USER root\n", "is root"),
    ("no HEALTHCHECK", "HEALTHCHECK ", "# HEALTHCHECK ", "no HEALTHCHECK"),
    ("COPY of a missing path", "COPY shared /opt/aerie/shared", "COPY common /opt/aerie/shared", "no such path"),
    ("a baked-in secret", "PIP_NO_CACHE_DIR=1", "PIP_NO_CACHE_DIR=1 AERIE_S3_SECRET_KEY=hunter2", "bakes a secret"),
]


@pytest.mark.parametrize("what,old,new,expected", DOCKERFILE_BREAKS, ids=[b[0] for b in DOCKERFILE_BREAKS])
def test_dockerfile_check_reports_a_broken_image(deploy_copy, what, old, new, expected):
    assert cd.check_dockerfiles(deploy_copy) == []
    _edit(deploy_copy / "services" / "extractor" / "Dockerfile", old, new)
    problems = cd.check_dockerfiles(deploy_copy)
    assert any(expected in p for p in problems), f"{what}: expected {expected!r} in {problems}"


def test_shell_check_reports_an_unquoted_secret(deploy_copy):
    assert cd.check_shell(deploy_copy) == []
    _edit(
        deploy_copy / "k8s" / "base" / "redis.yaml", '--requirepass "$REDIS_PASSWORD"', "--requirepass $REDIS_PASSWORD"
    )
    problems = cd.check_shell(deploy_copy)
    assert any("k8s/base/redis.yaml" in p and "SC2086" in p for p in problems), problems


def test_dockerfile_check_reports_a_dockerignored_copy_and_an_unpinned_arg(deploy_copy):
    (deploy_copy / ".dockerignore").write_text((deploy_copy / ".dockerignore").read_text().replace("!services/\n", ""))
    assert any("excluded by .dockerignore" in p for p in cd.check_dockerfiles(deploy_copy))
    _edit(
        deploy_copy / "services" / "inference" / "Dockerfile",
        "ARG SGLANG_IMAGE_TAG=v0.5.23",
        "ARG SGLANG_IMAGE_TAG=latest",
    )
    assert any(
        "FROM lmsysorg/sglang:${SGLANG_IMAGE_TAG}" in p and "latest" in p for p in cd.check_dockerfiles(deploy_copy)
    )


K8S_BREAKS = [
    (
        "a PVC that is not there",
        "base/extractor.yaml",
        "claimName: aerie-models",
        "claimName: aerie-model",
        "PersistentVolumeClaim 'aerie-model' is not in this render",
    ),
    (
        "a Service selecting no pod",
        "base/redis.yaml",
        "  selector:\n    app.kubernetes.io/component: redis",
        "  selector:\n    app.kubernetes.io/component: rediss",
        "matches no pod template",
    ),
    (
        "a field Kubernetes does not know",
        "base/trainer.yaml",
        "      terminationGracePeriodSeconds: 300",
        "      terminationGracePeriod: 300",
        "OpenAPI schema",
    ),
    ("a wrongly typed field", "base/extractor.yaml", "  replicas: 1", "  replicas: one", "OpenAPI schema"),
    (
        "a Secret key the guide never creates",
        "base/minio.yaml",
        "key: MINIO_ROOT_PASSWORD",
        "key: MINIO_PASSWORD",
        "key 'MINIO_PASSWORD' is not in the docs",
    ),
    (
        "a container without a readiness probe",
        "base/extractor.yaml",
        "          readinessProbe:",
        "          x-readinessProbe:",
        "OpenAPI schema",
    ),
    (
        "a ConfigMap key that is not there",
        "base/minio-init.yaml",
        "key: AERIE_BUCKET",
        "key: BUCKET",
        "has no key 'BUCKET'",
    ),
    (
        "a ScaledObject on a missing Deployment",
        "components/keda/scaledobject.yaml",
        "    kind: Deployment\n    name: extractor",
        "    kind: Deployment\n    name: extractors",
        "scaleTargetRef Deployment/extractors",
    ),
    (
        "a probe pinging another Celery app",
        "base/trainer.yaml",
        "celery -A aerie_trainer.worker inspect ping",
        "celery -A aerie_extractor.worker inspect ping",
        "not the one the container runs",
    ),
    (
        "a KEDA address in another namespace",
        "overlays/multi-node/kustomization.yaml",
        "namespace: aerie\n",
        "namespace: llm\n",
        "is not <service>.llm.svc",
    ),
    (
        "a missing resource file",
        "base/kustomization.yaml",
        "  - trainer.yaml",
        "  - trainers.yaml",
        "kustomize build failed",
    ),
    (
        "an unknown AERIE_* setting",
        "base/kustomization.yaml",
        "AERIE_ENGINE=sglang",
        "AERIE_ENGIN=sglang",
        "AERIE_ENGIN is not an aerie setting",
    ),
    (
        "a GPU pod without a nodeSelector",
        "base/trainer.yaml",
        '      nodeSelector:\n        nvidia.com/gpu.present: "true"\n',
        "",
        "requests GPUs but has no nodeSelector",
    ),
    (
        "an embedded Secret",
        "base/kustomization.yaml",
        "configMapGenerator:",
        "secretGenerator:\n  - name: aerie-credentials\n    literals: [REDIS_PASSWORD=x]\nconfigMapGenerator:",
        "a Secret is embedded",
    ),
]


@pytest.mark.parametrize("what,file,old,new,expected", K8S_BREAKS, ids=[b[0] for b in K8S_BREAKS])
def test_k8s_check_reports_a_broken_manifest(deploy_copy, what, file, old, new, expected):
    _edit(deploy_copy / "k8s" / file, old, new)
    problems = cd.check_k8s(deploy_copy)
    assert any(expected in p for p in problems), f"{what}: expected {expected!r} in {problems}"


def test_k8s_check_reports_a_missing_probe(deploy_copy):
    """Schema-valid but probe-less: the check itself, not the schema, must catch it."""
    text = (deploy_copy / "k8s" / "base" / "extractor.yaml").read_text()
    start = text.index("          readinessProbe:")
    end = text.index("          livenessProbe:")
    (deploy_copy / "k8s" / "base" / "extractor.yaml").write_text(text[:start] + text[end:])
    assert any("container worker: no readinessProbe" in p for p in cd.check_k8s(deploy_copy))


DOC_BREAKS = [
    (
        "a Deployment that does not exist",
        "kubectl -n aerie scale deploy/trainer --replicas 1",
        "kubectl -n aerie scale deploy/trainers --replicas 1",
        "no Deployment 'trainers'",
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
        "a Celery app no service runs",
        "extractor celery -A aerie_extractor.worker progress --run chat-v1\n",
        "extractor celery -A aerie.worker progress --run chat-v1\n",
        "Celery app 'aerie.worker'",
    ),
    (
        "an overlay that does not exist",
        "kubectl apply -k k8s/overlays/single-host\nkubectl -n aerie get",
        "kubectl apply -k k8s/overlays/one-host\nkubectl -n aerie get",
        "k8s/overlays/one-host does not exist",
    ),
]


@pytest.mark.parametrize("what,old,new,expected", DOC_BREAKS, ids=[b[0] for b in DOC_BREAKS])
def test_docs_check_reports_a_command_that_names_nothing(deploy_copy, what, old, new, expected):
    doc = deploy_copy / "docs" / "deploy.md"
    args = (doc, deploy_copy / "docker-compose.yml", deploy_copy / ".env.example")
    assert cd.check_docs(*args) == []
    _edit(doc, old, new)
    problems = cd.check_docs(*args)
    assert any(expected in p for p in problems), f"{what}: expected {expected!r} in {problems}"


# --------------------------------------------------------------------------------------------
# the commands resolve against the code
# --------------------------------------------------------------------------------------------


def image_packages(service: str) -> set[str]:
    """Distributions a service's Dockerfile pip-installs (names from each folder's pyproject)."""
    text = (REPO / "services" / service / "Dockerfile").read_text()
    dists = set()
    for c in cd.dockerfile_instructions(text):
        rest = " ".join(c.value)
        if c.cmd == "RUN" and "pip install" in rest:
            for folder in re.findall(r"/opt/aerie/((?:shared|services/[a-z]+))", rest):
                dists.add(tomllib.loads((REPO / folder / "pyproject.toml").read_text())["project"]["name"])
    return dists


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AERIE_")}
    env.update(extra)
    return env


CELERY_SERVICES = ["extractor", "trainer"]


@pytest.mark.parametrize("service", CELERY_SERVICES)
def test_compose_worker_command_builds_its_celery_app_from_the_compose_environment(service):
    """`celery -A X worker -Q q` in the compose file: X imports, its app builds from exactly the
    environment compose gives the container, and every queue it consumes is one aerie routes to."""
    svc = _compose()["services"][service]
    cmd = svc["command"]
    app, queues = cmd[cmd.index("-A") + 1], cmd[cmd.index("-Q") + 1].split(",")
    int(cmd[cmd.index("--concurrency") + 1])
    env = _clean_env(**cd._env_of(svc))
    probe = (
        "import importlib, json, sys; from celery import Celery\n"
        f"m = importlib.import_module({app!r}); a = m.app\n"
        "assert isinstance(a, Celery), type(a)\n"
        "routes = {r['queue'] for r in a.conf.task_routes.values()}\n"
        "print(json.dumps(sorted(routes)))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, f"{service}: `celery -A {app}` would fail in the container:\n{out.stderr[-3000:]}"
    routed = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert set(queues) <= routed, f"{service} consumes {queues}, aerie routes tasks to {sorted(routed)}"


def _parse_error(command, argv: list[str]) -> str | None:
    """Why click would refuse `argv` for `command` (unknown option, missing argument), or None."""
    import click

    try:
        command.make_context(command.name, list(argv))
    except click.UsageError as e:
        return e.format_message()
    return None


def _registered_celery_commands() -> dict[str, str | None]:
    """celery sub-command -> distribution providing it (None: Celery's own)."""
    from importlib.metadata import entry_points

    from celery.bin.celery import celery as celery_cli

    plugins = {ep.name: ep.dist.name for ep in entry_points(group="celery.commands")}
    return {name: plugins.get(name) for name in celery_cli.commands}


def _registered_aerie_commands() -> dict[str, str]:
    from importlib.metadata import entry_points

    from aerie.cli import main

    plugins = {ep.name: ep.dist.name for ep in entry_points(group="aerie.commands")}
    builtin = {name: "aerie" for name in main.commands}
    return {**plugins, **builtin}


def test_every_command_the_guide_runs_in_a_container_exists_in_that_image():
    """`aerie SUB` / `celery -A APP SUB` in docs/deploy.md: the sub-command is registered, by a
    package the image of the container it runs in installs, and accepts the guide's options and
    arguments; `celery call` names a task aerie routes, with kwargs its contract accepts."""
    from aerie.cli import main as aerie_main
    from aerie.contracts import ExtractRequest, IngestRequest, TrainRequest
    from aerie.queue import EXTRACT_TASK, INGEST_TASK, ROUTES, TRAIN_TASK

    CONTRACTS = {INGEST_TASK: IngestRequest, EXTRACT_TASK: ExtractRequest, TRAIN_TASK: TrainRequest}
    from celery.bin.celery import celery as celery_cli

    images = {"extractor": "extractor", "trainer": "trainer"}
    dc = cd.doc_commands((REPO / "docs" / "deploy.md").read_text())
    celery_cmds, aerie_cmds = _registered_celery_commands(), _registered_aerie_commands()
    missing = []
    for line, where, argv in dc.in_container:
        if where not in images or not argv:
            continue
        have = image_packages(images[where])
        if argv[0] == "aerie":
            sub = argv[1]
            dist = aerie_cmds.get(sub)
            if dist is None:
                missing.append(f"`aerie {sub}` is not a command (aerie.cli or an `aerie.commands` entry point): {line}")
            elif dist not in have:
                missing.append(f"`aerie {sub}` comes from {dist}, which the {where} image does not install: {line}")
            elif why := _parse_error(aerie_main.get_command(None, sub), argv[2:]):
                missing.append(f"`aerie {sub}` refuses its arguments ({why}): {line}")
        elif argv[0] == "celery":
            sub = next(a for a in argv[3:] if not a.startswith("-"))
            if sub not in celery_cmds:
                missing.append(f"`celery {sub}` is not a command: {line}")
            elif celery_cmds[sub] is not None and celery_cmds[sub] not in have:
                missing.append(
                    f"`celery {sub}` comes from {celery_cmds[sub]}, not installed in the {where} image: {line}"
                )
            elif why := _parse_error(celery_cli.commands[sub], argv[argv.index(sub) + 1 :]):
                missing.append(f"`celery {sub}` refuses its arguments ({why}): {line}")
            if sub == "call":
                task = argv[argv.index("call") + 1]
                if task not in ROUTES:
                    missing.append(f"task {task!r} is not one aerie routes ({sorted(ROUTES)}): {line}")
                elif "--kwargs" in argv:  # the task validates its kwargs as this contract
                    try:
                        CONTRACTS[task].model_validate_json(argv[argv.index("--kwargs") + 1])
                    except ValueError as e:
                        missing.append(f"--kwargs of {task} are not a valid {CONTRACTS[task].__name__}: {e}: {line}")
    # the serve component's init container pulls the drafter with `aerie pull` in the trainer image
    serve = (REPO / "k8s" / "components" / "serve" / "serve.yaml").read_text()
    assert "image: aerie/trainer:" in serve and "aerie pull" in serve
    if aerie_cmds.get("pull") not in image_packages("trainer"):
        missing.append(
            "`aerie pull` (k8s serve init container, trainer image) is not provided by a package the trainer image installs"
        )
    assert not missing, "\n".join(missing)


def _launch_args(script: str, env: dict[str, str]) -> list[str]:
    """The `python3 -m sglang.launch_server ...` arguments of a container script, as its shell expands them."""
    body = script[script.index("exec python3 -m sglang.launch_server") :].replace("\\\n", " ")

    def sub(m):
        name, default = m.group(1) or m.group(3), m.group(2)
        return env.get(name) or (default or "")

    body = re.sub(r"\$\{([A-Za-z_]+)(?::-([^}]*))?\}|\$([A-Za-z_]+)", sub, body)
    return shlex.split(body)[4:]


@pytest.mark.slow  # importing SGLang's server_args takes 25-35 s on 2 cores
def test_inference_command_lines_parse_with_sglangs_own_argument_parser():
    """The capture and serve command lines of compose and k8s, expanded as their shells would,
    are accepted by SGLang 0.5.23's ServerArgs parser (flags exist, values have the right types)."""
    if not SGLANG_PY.exists():
        if os.environ.get("AERIE_REQUIRE_SGLANG"):
            pytest.fail(f"{SGLANG_PY} missing: run scripts/sglang_env.sh")
        pytest.skip("no .venv-sglang (scripts/sglang_env.sh builds it)")
    env = {
        "ids": "1 14 26",  # compose: ids=$(echo "$CAPTURE_LAYER_IDS" | tr ',' ' ')
        "TP_SIZE": "8",
        "SERVED_MODEL_NAME": "target",
        "CAPTURE_LAYER_IDS": "1 14 26",
        "SGLANG_EXTRA_ARGS": "--mem-fraction-static 0.85",
        "DRAFTER_NAME": "chat-eagle3",
        "SPEC_NUM_STEPS": "3",
        "SPEC_EAGLE_TOPK": "1",
        "SPEC_NUM_DRAFT_TOKENS": "4",
    }
    s = _compose()["services"]
    base = yaml.safe_load_all((REPO / "k8s" / "base" / "inference.yaml").read_text())
    k8s_capture = next(d for d in base if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0][
        "command"
    ][2]
    k8s_serve = yaml.safe_load((REPO / "k8s" / "components" / "serve" / "serve.yaml").read_text())["spec"]["template"][
        "spec"
    ]["containers"][0]["command"][2]
    lines = {
        "compose capture": _launch_args(_sh_script(s["inference-capture"]), env),
        "compose serve": _launch_args(_sh_script(s["inference-serve"]), env),
        "k8s capture": _launch_args(k8s_capture, env),
        "k8s serve": _launch_args(k8s_serve, env),
    }
    assert lines["compose capture"][lines["compose capture"].index("--return-aux-hidden-state-layer-ids") + 1 :][
        :3
    ] == ["1", "14", "26"]
    probe = (
        "import argparse, json, sys\n"
        "from sglang.srt.server_args import ServerArgs\n"
        "bad = {}\n"
        "for name, argv in json.loads(sys.stdin.read()).items():\n"
        "    p = argparse.ArgumentParser(exit_on_error=False); ServerArgs.add_cli_args(p)\n"
        "    try:\n"
        "        ns, extra = p.parse_known_args(argv)\n"
        "        if extra: bad[name] = f'unknown arguments {extra}'\n"
        "    except (argparse.ArgumentError, SystemExit) as e: bad[name] = str(e)\n"
        "print(json.dumps(bad))\n"
    )
    out = subprocess.run(
        [str(SGLANG_PY), "-c", probe],
        input=json.dumps(lines),
        capture_output=True,
        text=True,
        timeout=300,
        env=_clean_env(),
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}, f"SGLang rejects: {out.stdout}"


@pytest.mark.parametrize("service", CELERY_SERVICES)
def test_compose_worker_runs_as_a_plain_process_and_answers_its_own_healthcheck(service, redis_url, tmp_path):
    """The compose command, run as it is with the compose environment (broker pointed at the test
    Redis), starts a worker that the compose healthcheck command then finds alive."""
    import signal
    import socket
    import time

    svc = _compose()["services"][service]
    env = _clean_env(**cd._env_of(svc))
    env.update(AERIE_BROKER=redis_url, AERIE_RESULT_BACKEND=redis_url, HOSTNAME=socket.gethostname())
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    log = (tmp_path / f"{service}.log").open("w")
    worker = subprocess.Popen(
        svc["command"], env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    health = svc["healthcheck"]["test"]
    assert health[0] == "CMD-SHELL"
    log_path = tmp_path / f"{service}.log"
    try:
        deadline, answered = time.monotonic() + 120, None
        # wait with a quick ping first: the healthcheck's own 20 s timeout is spent on a worker still starting
        app = svc["command"][svc["command"].index("-A") + 1]
        quick = ["celery", "-A", app, "inspect", "ping", "-d", f"celery@{env['HOSTNAME']}", "--timeout", "1"]
        while time.monotonic() < deadline and worker.poll() is None:
            if subprocess.run(quick, env=env, capture_output=True, timeout=60, cwd=tmp_path).returncode == 0:
                break
            time.sleep(1)
        while time.monotonic() < deadline and worker.poll() is None:
            probe = subprocess.run(
                ["sh", "-c", health[1]], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path
            )
            if probe.returncode == 0:
                answered = probe.stdout
                break
            time.sleep(2)
        log.flush()
        assert answered is not None, (
            f"{service}: healthcheck never passed (worker exit {worker.poll()}):\n{log_path.read_text()[-3000:]}"
        )
        assert "pong" in answered
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait(timeout=30)
        log.close()
