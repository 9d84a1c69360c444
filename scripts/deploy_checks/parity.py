"""compose and Kubernetes run the same containers alike: every setting compose gives an SGLang server
or a worker (its environment, and the flags of SGLang's launch command) the k8s Deployment of the
same role gives too, with the same value, in every overlay.

Values that come from a secret are compared by presence (compose's render holds stand-ins for them);
compose's `${SECRET}` inside a URL matches k8s's `$(SECRET)`. The differences the platforms need are
listed in PLATFORM, each with its reason; anything else that differs is reported.
"""

from __future__ import annotations

import re
from pathlib import Path

from .common import REPO, dig

# compose service -> the k8s Deployments of that role
ROLES = {
    "inference-capture": ("inference",),
    "inference-generate": ("generate",),
    "extractor": ("extractor", "extractor-ingest"),
    "trainer": ("trainer",),
}
PLATFORM = {  # (compose service, variable): why k8s differs
    ("inference-capture", "AERIE_CAPTURE_DIR"): "compose's sink is a shared tmpfs folder; k8s's is the bucket",
    ("extractor", "AERIE_ENGINE_SINK"): "shm beside SGLang in compose; s3 across pods in k8s",
}
_LAUNCH = re.compile(r"sglang\.launch_server(.*)", re.DOTALL)


def _flags(command: str) -> set[str]:
    """The `--flags` of SGLang's launch in a command (all of it for a worker's command)."""
    launch = _LAUNCH.search(command)
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]+)", launch.group(1) if launch else command))


def _k8s_env(c: dict, objects: dict) -> tuple[dict[str, str | None], set[str]]:
    """A container's environment (envFrom ConfigMaps, then env) and the names whose value is a secret's."""
    env: dict[str, str | None] = {}
    for ef in c.get("envFrom") or []:
        env |= dig(objects.get(("ConfigMap", dig(ef, "configMapRef", "name"))), "data") or {}
    secret = set()
    for e in c.get("env") or []:
        env[e["name"]] = e.get("value")
        if dig(e, "valueFrom", "secretKeyRef"):
            secret.add(e["name"])
    return env, secret


def differences(services: dict, resources: list[dict], label: str) -> list[str]:
    objects = {(r.get("kind"), dig(r, "metadata", "name")): r for r in resources}
    problems = []
    for service, deployments in ROLES.items():
        s = services.get(service)
        if s is None:
            continue
        compose_env = {
            k: re.sub(r"/placeholder/(\w+)", lambda m: f"$({m.group(1).upper()})", str(v))
            for k, v in (s.get("environment") or {}).items()
        }
        secret_stand_ins = {
            k
            for k, v in (s.get("environment") or {}).items()
            if str(v).startswith("/placeholder/") or str(v) == "aerie-app"
        }
        compose_flags = _flags(" ".join(s.get("command") or []))
        for name in deployments:
            d = objects.get(("Deployment", name))
            if d is None:
                problems.append(f"{label}: no Deployment {name} for compose's {service}")
                continue
            (c, *_) = dig(d, "spec", "template", "spec", "containers") or [{}]
            env, secret = _k8s_env(c, objects)
            at = f"{label}: Deployment/{name} (compose: {service})"
            for key, value in sorted(compose_env.items()):
                if (service, key) in PLATFORM:
                    continue
                if key not in env:
                    problems.append(f"{at}: {key} is set in compose ({value!r}), not here: set it alike")
                elif key in secret or key in secret_stand_ins:
                    if not (key in secret and key in secret_stand_ins):
                        problems.append(f"{at}: {key} is a secret on one platform only")
                elif env[key] != value:
                    problems.append(f"{at}: {key}={env[key]!r} here, {value!r} in compose: set them alike")
            k8s_flags = _flags(" ".join((c.get("command") or []) + (c.get("args") or [])))
            for flag in sorted(compose_flags - k8s_flags):
                problems.append(f"{at}: compose passes {flag}, this command does not")
            for flag in sorted(k8s_flags - compose_flags):
                problems.append(f"{at}: passes {flag}, compose's command does not")
    return problems


# compose service -> (k8s kind, name) whose pod runs the same image: same user and group
IDENTITIES = {"redis": ("StatefulSet", "redis"), "minio": ("StatefulSet", "minio"), "minio-init": ("Job", "minio-init")}
IDENTITY_PLATFORM = {
    "minio": "compose's minio-data volume is created root-owned (no fsGroup as in k8s): MinIO runs as the image's root",
}


def identity_differences(services: dict, resources: list[dict], label: str) -> list[str]:
    objects = {(r.get("kind"), dig(r, "metadata", "name")): r for r in resources}
    problems = []
    for service, ref in IDENTITIES.items():
        if service in IDENTITY_PLATFORM or service not in services or ref not in objects:
            continue
        context = dig(objects[ref], "spec", "template", "spec", "securityContext") or {}
        if "runAsUser" not in context:
            continue
        want = f"{context['runAsUser']}:{context.get('runAsGroup', context['runAsUser'])}"
        if services[service].get("user") != want:
            problems.append(
                f"{label}: {ref[0]}/{ref[1]} runs as {want}, compose's {service} as "
                f'{services[service].get("user") or "the image default (root)"}: set `user: "{want}"`'
            )
    return problems


def check_parity(repo: Path = REPO) -> list[str]:
    from .compose import Project
    from .k8s import kustomize_build, overlays

    services = Project(repo / "docker-compose.yml", repo / ".env.example").render()["services"]
    return [
        p
        for overlay in overlays(repo)
        for rendered in [kustomize_build(overlay)]
        for p in differences(services, rendered, str(overlay.relative_to(repo)))
        + identity_differences(services, rendered, str(overlay.relative_to(repo)))
    ]
