"""docker-compose.yml: Docker Compose itself loads it per profile; aerie's rules run on its output."""

from __future__ import annotations

import ast
import importlib.util
import re

import pytest

from scripts.deploy_checks.common import aerie_env_names
from scripts.deploy_checks.compose import ComposeError, Project, check_compose, unescape
from tests.deploy.breaks import Break, with_batches
from tests.services import REPO


def test_compose_has_what_the_gpu_host_needs(compose_services):
    s = compose_services
    assert {p for svc in s.values() for p in svc.get("profiles", [])} >= {"capture", "serve", "train", "monitoring"}
    capture, serve = unescape(s["inference-capture"]["command"][2]), unescape(s["inference-serve"]["command"][2])
    for flag in ("--enable-return-aux-hidden-states", "--return-aux-hidden-state-layer-ids", "--disable-radix-cache"):
        assert flag in capture
    for flag in ("--speculative-algorithm EAGLE3", "--speculative-draft-model-path", "--speculative-num-steps"):
        assert flag in serve
    assert '--tp "${TP_SIZE}"' in capture and '--tp "${TP_SIZE}"' in serve
    assert "--disable-radix-cache" not in serve
    # regeneration: a plain server of its own profile, reached by the extractors at its alias
    generate = unescape(s["inference-generate"]["command"][2])
    assert s["inference-generate"]["profiles"] == ["regenerate"] and "--enable-metrics" in generate
    assert not any(
        flag in generate for flag in ("--disable-radix-cache", "--enable-return-aux-hidden-states", "--speculative")
    )
    assert s["inference-generate"]["networks"]["aerie"]["aliases"] == ["generate"] and not s["inference-generate"].get(
        "ports"
    )
    assert s["extractor"]["environment"]["AERIE_REGENERATE_URLS"] == '["http://generate:30000"]'
    assert s["extractor"]["environment"]["AERIE_REGENERATE_CONCURRENCY"] == "64"
    for name in ("inference-capture", "inference-serve", "trainer"):
        devices = s[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"], name
    # extractor scales with --scale: no fixed name, no host port, no GPU
    assert not {"container_name", "ports", "deploy"} & set(s["extractor"])
    redis = unescape(s["redis"]["command"][2])
    assert "--requirepass" in redis and "--appendonly yes" in redis
    for name in ("redis", "minio"):
        assert any(v["type"] == "volume" and v["target"] == "/data" for v in s[name]["volumes"]), name
    for worker in ("extractor", "trainer"):
        assert s[worker]["depends_on"]["minio-init"]["condition"] == "service_completed_successfully"
        assert s[worker]["depends_on"]["redis"]["condition"] == "service_healthy"
    for name in ("inference-capture", "inference-serve"):  # JIT kernels survive restarts and mode switches
        assert {"type": "volume", "source": "sglang-cache", "target": "/home/aerie/.cache", "volume": {}} in s[name][
            "volumes"
        ]
    for worker in ("extractor", "trainer"):
        assert s[worker]["environment"]["AERIE_BROKER_VISIBILITY_TIMEOUT_S"] == "3600"  # from .env
    # SGLang's --api-key is one secret: the server requires it, the extractors send it
    assert (
        s["extractor"]["environment"]["AERIE_ENGINE_API_KEY"] == s["inference-capture"]["environment"]["SGLANG_API_KEY"]
    )
    raw = (REPO / "docker-compose.yml").read_text()
    for secret in ("REDIS_PASSWORD", "MINIO_ROOT_PASSWORD", "AERIE_S3_SECRET_KEY", "FLOWER_PASSWORD"):
        assert f"${{{secret}:?Variable not set}}" in raw


def test_minio_data_goes_to_a_data_disk_when_minio_data_dir_names_one():
    project = Project()
    default = project.render()["services"]["minio"]["volumes"]
    disk = project.render(env={**project.stand_ins, "MINIO_DATA_DIR": "/srv/aerie/minio"})["services"]["minio"][
        "volumes"
    ]
    assert [(v["type"], v["source"]) for v in default] == [("volume", "minio-data")]
    assert [(v["type"], v["source"], v["target"]) for v in disk] == [("bind", "/srv/aerie/minio", "/data")]


def test_compose_refuses_to_start_without_secrets():
    """With .env copied from .env.example and nothing filled in, Compose stops on an empty secret."""
    refusal = r"required variable (REDIS_PASSWORD|AERIE_S3_|MINIO_ROOT_|MODEL_DIR|FLOWER_|SGLANG_API_KEY)\w* is missing a value"
    with pytest.raises(ComposeError, match=refusal):
        Project().run("config", "--quiet", env_file=REPO / ".env.example")


def test_every_aerie_name_the_plugin_reads_is_in_its_env_vars():
    """The deploy checks accept the plugin's `ENV_VARS`: every AERIE_* name in its code is listed there."""
    plugin = REPO / "services" / "inference" / "aerie_sglang" / "plugin"
    names = {
        node.value
        for f in plugin.glob("*.py")
        for node in ast.walk(ast.parse(f.read_text()))
        if isinstance(node, ast.Constant) and re.fullmatch(r"AERIE_[A-Z0-9_]+", str(node.value))
    }
    assert {"AERIE_SGLANG_BINARY", "AERIE_CAPTURE_DIR", "AERIE_CAPTURE_WRITERS"} <= names
    spec = importlib.util.spec_from_file_location("_plugin", plugin / "__init__.py")  # needs no SGLang
    spec.loader.exec_module(module := importlib.util.module_from_spec(spec))
    assert names == set(module.ENV_VARS), f"aerie_sglang.plugin.ENV_VARS differs from what the plugin reads: {names}"
    assert names <= aerie_env_names()


# "Compose:" marks what Docker Compose itself refuses (its own message; each stops the check, so each
# gets a copy of its own). The batch "services" breaks one service (or anchor) per edit, "variables"
# one variable of .env.example or one port line; each expected message names its service or variable.
REGENERATE_URLS = """AERIE_REGENERATE_URLS: '["http://generate:30000"]'"""
GENERATE_FLAGS = "--enable-metrics $${SGLANG_EXTRA_ARGS}\n\n  # Celery workers"
SERVE_TP = "      TP_SIZE: ${TP_SIZE:-8}\n      SERVED_MODEL_NAME: ${SERVED_MODEL_NAME:-target}\n      DRAFTER_NAME"
COMPOSE_BREAKS = [
    Break(
        "Compose: a depends_on target that is no service",
        "docker-compose.yml",
        "      redis:\n        condition: service_healthy\n      minio-init:",
        "      redis-cache:\n        condition: service_healthy\n      minio-init:",
        'depends on undefined service "redis-cache"',
    ),
    Break(
        "Compose: an undeclared named volume",
        "docker-compose.yml",
        "- redis-data:/data",
        "- redis-dat:/data",
        "refers to undefined volume redis-dat",
    ),
    Break(
        "Compose: an undeclared network",
        "docker-compose.yml",
        '    networks: [aerie]\n    healthcheck:\n      test: ["CMD", "mc"',
        '    networks: [aerie, backend]\n    healthcheck:\n      test: ["CMD", "mc"',
        "refers to undefined network backend",
    ),
    Break(
        "Compose: an undeclared secret",
        "docker-compose.yml",
        "      - redis-data:/data\n",
        "      - redis-data:/data\n    secrets: [redis-password]\n",
        "refers to undefined secret redis-password",
    ),
    Break(
        "Compose: a key the Compose Specification does not know",
        "docker-compose.yml",
        "    restart: unless-stopped\n    stop_grace_period: 30s   # AOF",
        "    restat: unless-stopped\n    stop_grace_period: 30s   # AOF",
        "additional properties 'restat' not allowed",
    ),
    Break(
        "Compose: neither image nor build",
        "docker-compose.yml",
        "    image: docker.io/library/redis:7.4.2-alpine\n",
        "",
        "has neither an image nor a build context",
    ),
    Break(
        "Compose: a malformed ${...} it cannot interpolate",
        "docker-compose.yml",
        "celery@$$(hostname)",
        "celery@${HOSTNAME",
        "invalid interpolation format",
    ),
    Break(
        "Compose: a service waiting on a profiled service it cannot require",
        "docker-compose.yml",
        "        required: false   # absent",
        "        # absent",
        "(no profile, profile monitoring, profile regenerate, profile serve, profile tools, profile train): docker compose config: "
        'service "extractor" depends on undefined service "inference-capture"',
    ),
    Break(
        "an env reference missing from .env.example",
        "docker-compose.yml",
        "${AERIE_BUCKET:-aerie}",
        "${AERIE_BUCKT:-aerie}",
        "${AERIE_BUCKT} is not in .env.example",
        batch="variables",
    ),
    Break(
        "a .env.example variable nothing uses",
        ".env.example",
        "FLOWER_PORT=5555",
        "FLOWER_PORT=5555\nOLD_KNOB=1",
        "OLD_KNOB is not used",
        batch="variables",
    ),
    Break(
        "a default that disagrees with .env.example",
        ".env.example",
        "TP_SIZE=8",
        "TP_SIZE=4",
        "services.inference-capture.environment.TP_SIZE is '8' by default but '4' with .env.example",
    ),
    Break(
        "two different defaults for one variable",
        "docker-compose.yml",
        SERVE_TP,
        SERVE_TP.replace(":-8", ":-4"),
        "services.inference-serve.environment.TP_SIZE is '4' by default but '8' with .env.example",
        batch="services",
    ),
    Break(
        "a variable with neither a default nor :?",
        "docker-compose.yml",
        "${TP_SIZE:-8}",
        "${TP_SIZE}",
        "services.inference-capture.environment.TP_SIZE is '' by default but '8' with .env.example",
    ),
    Break(
        "a secret that is not required",
        "docker-compose.yml",
        "REDIS_PASSWORD: ${REDIS_PASSWORD:?Variable not set}",
        "REDIS_PASSWORD: ${REDIS_PASSWORD:-changeme}",
        "secret ${REDIS_PASSWORD} must be required at every use",
        batch="services",
    ),
    Break(
        "a secret with a value in .env.example",
        ".env.example",
        "REDIS_PASSWORD=\n",
        "REDIS_PASSWORD=hunter2\n",
        "REDIS_PASSWORD has a value",
        batch="variables",
    ),
    Break(
        "an AERIE_* variable in .env.example aerie does not know",
        ".env.example",
        "AERIE_BUCKET=aerie",
        "AERIE_BUCKET=aerie\nAERIE_BUCKETS=aerie",
        ".env.example: AERIE_BUCKETS is not used by docker-compose.yml",
        batch="variables",
    ),
    Break(
        "an AERIE_* variable in a container aerie does not know",
        "docker-compose.yml",
        "AERIE_ENGINE: sglang",
        "AERIE_ENGIN: sglang",
        "AERIE_ENGIN is not an aerie setting",
        batch="services",
    ),
    Break(
        "a container shell variable its environment does not set",
        "docker-compose.yml",
        "      TP_SIZE: ${TP_SIZE:-8}\n      SERVED_MODEL_NAME: ${SERVED_MODEL_NAME:-target}\n      CAPTURE_LAYER_IDS",
        "      SERVED_MODEL_NAME: ${SERVED_MODEL_NAME:-target}\n      CAPTURE_LAYER_IDS",
        "services.inference-capture.command: the container shell reads $TP_SIZE",
        batch="services",
    ),
    Break(
        "service_healthy on a service without a healthcheck",
        "docker-compose.yml",
        "    depends_on:\n      minio-init:\n        condition: service_completed_successfully\n\nnetworks:",
        "    depends_on:\n      minio-init:\n        condition: service_healthy\n\nnetworks:",
        "minio-init has no healthcheck",
        batch="services",
    ),
    Break(
        "a restarting service without a healthcheck",
        "docker-compose.yml",
        '    healthcheck:\n      test: ["CMD", "mc", "--config-dir", "/tmp/.mc", "ready", "local"]',
        '    x-healthcheck:\n      test: ["CMD", "mc"]',
        "services.minio: restarts automatically but has no healthcheck",
        batch="services",
    ),
    Break(
        "a bind-mounted file that does not exist",
        "docker-compose.yml",
        "./scripts/minio_init.sh:",
        "./scripts/minio-init.sh:",
        "scripts/minio-init.sh does not exist",
        batch="services",
    ),
    Break(
        "an unpinned image",
        "docker-compose.yml",
        "image: docker.io/library/redis:7.4.2-alpine",
        "image: docker.io/library/redis:latest",
        "image 'docker.io/library/redis:latest' uses `latest`",
        batch="services",
    ),
    Break(
        "an image of no named registry (Docker Hub, anyone's namespace)",
        "docker-compose.yml",
        "image: docker.io/library/redis:7.4.2-alpine",
        "image: redis:7.4.2-alpine",
        "'redis:7.4.2-alpine' names no registry",
        batch="variables",
    ),
    Break(
        "an image built here that `up` may pull",
        "docker-compose.yml",
        "    pull_policy: never   # built by `docker compose build`, not on every up\n    restart: unless-stopped",
        "    pull_policy: build\n    restart: unless-stopped",
        "aerie/extractor:0.1.0 is built here: set `pull_policy: never`",
        batch="services",
    ),
    Break(
        "a service without log limits",
        "docker-compose.yml",
        "    stop_grace_period: 30s   # AOF flushed on SIGTERM\n    logging: *logging\n",
        "    stop_grace_period: 30s   # AOF flushed on SIGTERM\n",
        "services.redis: no log limit",
        batch="services",
    ),
    Break(
        "a worker that keeps its task on SIGTERM (no REMAP_SIGTERM)",
        "docker-compose.yml",
        "      REMAP_SIGTERM: SIGQUIT\n      AERIE_WORKER_CONCURRENCY",
        "      AERIE_WORKER_CONCURRENCY",
        "services.extractor: a Celery worker that keeps its task on SIGTERM",
        batch="services",
    ),
    Break(
        "a worker whose grace period is shorter than its soft shutdown",
        ".env.example",
        "EXTRACTOR_STOP_GRACE=120s",
        "EXTRACTOR_STOP_GRACE=60s",
        "services.extractor: a Celery worker that keeps its task on SIGTERM",
        batch="variables",
    ),
    Break(
        "a port on every interface",
        "docker-compose.yml",
        "      - ${FLOWER_BIND:-127.0.0.1}:${FLOWER_PORT:-5555}:5555",
        "      - ${FLOWER_PORT:-5555}:5555",
        "services.flower.ports: 5555 listens on every interface",
        batch="services",
    ),
    Break(
        "one bind address for two services",
        "docker-compose.yml",
        "${FLOWER_BIND:-127.0.0.1}:",
        "${MINIO_BIND:-127.0.0.1}:",
        "${MINIO_BIND} binds several published ports",
        batch="variables",
    ),
    Break(
        "GPUs as one comma string",
        "docker-compose.yml",
        "              count: all\n",
        '              device_ids: ["0,1,2,3"]\n',
        "device_ids 0,1,2,3 is one string naming several GPUs",
        batch="services",
    ),
    Break(
        "an API key with a value in .env.example",
        ".env.example",
        "SGLANG_API_KEY=\n",
        "SGLANG_API_KEY=abc\n",
        "SGLANG_API_KEY has a value",
        batch="variables",
    ),
    Break(
        "a Dockerfile that does not exist",
        "docker-compose.yml",
        "dockerfile: services/extractor/Dockerfile",
        "dockerfile: services/extractor/Dockerfil",
        "services/extractor/Dockerfil does not exist",
        batch="services",
    ),
    Break(
        "a build arg the Dockerfile does not declare",
        "docker-compose.yml",
        "SGLANG_IMAGE_TAG: ${SGLANG_IMAGE_TAG:-v0.5.23}",
        "SGLANG_TAG: ${SGLANG_IMAGE_TAG:-v0.5.23}",
        "SGLANG_TAG is not an ARG",
        batch="services",
    ),
    Break(
        "a healthcheck pinging another Celery app",
        "docker-compose.yml",
        "celery -A aerie_extractor.worker inspect ping",
        "celery -A aerie_trainer.worker inspect ping",
        "services.extractor: healthcheck pings Celery app ['aerie_trainer.worker']",
        batch="services",
    ),
    Break(
        "a top-level volume no service uses",
        "docker-compose.yml",
        "volumes:\n  redis-data: {}",
        "volumes:\n  spare-data: {}\n  redis-data: {}",
        "top-level volumes.spare-data is used by no service",
        batch="services",
    ),
    # regeneration: never through the capture server (radix cache off, capturing), always through one
    Break(
        "regeneration sent to the capture server",
        "docker-compose.yml",
        REGENERATE_URLS,
        REGENERATE_URLS.replace("generate:", "inference:"),
        "services.extractor.environment.AERIE_REGENERATE_URLS: "
        "http://inference:30000: service inference-capture runs SGLang in capture mode (--disable-radix-cache, "
        "--enable-return-aux-hidden-states)",
        batch="variables",
    ),
    Break(
        "a generation server started in capture mode",
        "docker-compose.yml",
        GENERATE_FLAGS,
        "--disable-radix-cache " + GENERATE_FLAGS,
        "http://generate:30000: service inference-generate runs SGLang in capture mode (--disable-radix-cache)",
    ),
    Break(
        "regeneration at a host that is no service",
        "docker-compose.yml",
        REGENERATE_URLS,
        REGENERATE_URLS.replace("generate:", "generator:"),
        "services.extractor.environment.AERIE_REGENERATE_URLS: "
        "http://generator:30000: host 'generator' is no service or network alias of this file",
    ),
    Break(
        "an sglang extractor with no generation server",
        "docker-compose.yml",
        f"      {REGENERATE_URLS}\n",
        "",
        "services.extractor: AERIE_ENGINE=sglang without AERIE_REGENERATE_URLS: `enqueue --regenerate` would ask "
        "AERIE_ENGINE_URLS, the capture server",
    ),
]


def compose_problems(copy) -> list[str]:
    return check_compose(Project(copy.root / "docker-compose.yml", copy.root / ".env.example"))


@pytest.mark.parametrize("broken,edits", with_batches(COMPOSE_BREAKS))
def test_compose_check_reports_a_broken_file(findings, broken, edits):
    problems = findings(compose_problems, edits)
    assert any(broken.expected in p for p in problems), f"{broken.what}: expected {broken.expected!r} in {problems}"


def test_compose_check_reports_a_missing_env_example(deploy_copy):
    (deploy_copy.root / ".env.example").unlink()
    project = Project(deploy_copy.root / "docker-compose.yml", deploy_copy.root / ".env.example")
    assert any("missing (the user copies it to .env)" in p for p in check_compose(project))
