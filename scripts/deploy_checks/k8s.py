"""k8s/: every overlay rendered by kustomize, validated against Kubernetes' schema, references resolved.

- kustomize: pykustomize (kustomize's own Go library, api v0.21.3), else a `kustomize` on PATH.
- Every built-in resource validates against the Kubernetes OpenAPI schema (kubernetes-validate,
  strict). KEDA's CRDs (ScaledObject, TriggerAuthentication) have no schema in kubernetes-validate
  and no package here ships one; they are checked by their references only.
- References resolve within the render: Service selectors, PVCs, ConfigMaps (and keys), KEDA/HPA
  scale targets; Secrets are referenced, never embedded, and each key is created by a `kubectl
  create secret generic` in docs/deploy.md. Long-running containers have probes (pinging the
  Celery app they run), GPU pods a nodeSelector, every image a pinned tag.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from pathlib import Path

import yaml

from .common import REPO, celery_apps, image_pinned, unknown_aerie_name

K8S_VERSION = "1.32.0"  # the oldest Kubernetes the manifests promise to work on
CRD_KINDS = {("keda.sh/v1alpha1", "ScaledObject"), ("keda.sh/v1alpha1", "TriggerAuthentication")}


def kustomize_build(directory: Path) -> list[dict]:
    try:
        import pykustomize
    except ImportError:
        pykustomize = None
    if pykustomize is not None:
        return [d for d in yaml.safe_load_all(asyncio.run(pykustomize.build(str(directory))).yaml) if d]
    if not (exe := shutil.which("kustomize")):
        raise RuntimeError("no kustomize: pip install --ignore-requires-python pykustomize==0.1.4 (scripts/setup.sh)")
    out = subprocess.run([exe, "build", str(directory)], capture_output=True, text=True, timeout=120)
    if out.returncode:
        raise RuntimeError(out.stderr.strip())
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def overlays(repo: Path = REPO) -> list[Path]:
    return sorted(p.parent for p in (repo / "k8s" / "overlays").glob("*/kustomization.yaml"))


def documented_secret_keys(doc_path: Path) -> dict[str, set[str]]:
    """Secret name -> keys, from `kubectl create secret generic NAME --from-literal=KEY=...` in the guide."""
    out: dict[str, set[str]] = {}
    text = doc_path.read_text().replace("\\\n", " ") if doc_path.exists() else ""
    for m in re.finditer(r"kubectl\b[^\n]*?create secret generic\s+(\S+)([^\n]*)", text):
        out.setdefault(m.group(1), set()).update(re.findall(r"--from-literal=([A-Za-z0-9_.-]+)=", m.group(2)))
    return out


def _pod_spec(res: dict) -> dict | None:
    spec = res.get("spec") or {}
    if res.get("kind") == "CronJob":
        spec = (spec.get("jobTemplate") or {}).get("spec") or {}
    elif res.get("kind") == "Pod":
        return spec
    return (spec.get("template") or {}).get("spec") if res.get("kind") in WORKLOADS else None


WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "CronJob"}


def _matches(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


class _Render:
    """One rendered overlay: what references can point at, and the problems found."""

    def __init__(self, resources: list[dict], secrets: dict[str, set[str]]):
        self.by_kind: dict[str, dict[str, dict]] = {}
        for r in resources:
            self.by_kind.setdefault(r.get("kind", "?"), {})[(r.get("metadata") or {}).get("name", "?")] = r
        self.secrets, self.problems = secrets, []

    def need(self, at: str, kind: str, name, key: str | None = None) -> None:
        """`kind/name` (and its data `key`) must be in this render."""
        obj = self.by_kind.get(kind, {}).get(name)
        if obj is None:
            self.problems.append(f"{at}: {kind} {name!r} is not in this render")
        elif key is not None and key not in (obj.get("data") or {}):
            self.problems.append(f"{at}: {kind} {name} has no key {key!r}")

    def secret(self, at: str, name, key: str | None = None) -> None:
        if name not in self.secrets:
            self.problems.append(f"{at}: Secret {name!r} is not created by a `kubectl create secret generic` in docs/deploy.md")
        elif key is not None and key not in self.secrets[name]:
            self.problems.append(f"{at}: Secret {name} key {key!r} is not in the docs' `kubectl create secret generic {name}`")

    def setting(self, at: str, key: str) -> None:
        if unknown_aerie_name(key):
            self.problems.append(f"{at}: {key} is not an aerie setting: aerie refuses unknown AERIE_* variables")


def check_rendered(resources: list[dict], label: str, doc_path: Path = REPO / "docs" / "deploy.md") -> list[str]:
    """Schema validation and reference checks of one rendered overlay."""
    import kubernetes_validate

    ctx = _Render(resources, documented_secret_keys(doc_path))
    problems = ctx.problems
    templates = [w["spec"]["template"] for k in ("Deployment", "StatefulSet") for w in ctx.by_kind.get(k, {}).values()]
    for r in resources:
        kind, spec, meta = r.get("kind"), r.get("spec") or {}, r.get("metadata") or {}
        at = f"{label}: {kind}/{meta.get('name')}"
        if (r.get("apiVersion"), kind) not in CRD_KINDS:
            try:
                kubernetes_validate.validate(r, K8S_VERSION, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                problems.append(f"{at}: no Kubernetes {K8S_VERSION} schema for {r.get('apiVersion')} {kind}")
            except kubernetes_validate.ValidationError as e:
                where = ".".join(str(p) for p in e.path) or "(top)"
                problems.append(f"{at}: {where}: {e.message} (Kubernetes {K8S_VERSION} OpenAPI schema)")
        if kind == "Secret":
            problems.append(f"{at}: a Secret is embedded in the manifests: create it out of band (docs/deploy.md)")
        if _pod_spec(r) is not None:
            _check_pod(ctx, at, r)
        if kind == "Service" and not any(
            _matches(spec.get("selector") or {}, (t.get("metadata") or {}).get("labels") or {}) for t in templates
        ):
            problems.append(f"{at}: selector {spec.get('selector')} matches no pod template in this render")
        if kind == "StatefulSet" and spec.get("serviceName"):
            ctx.need(f"{at}: serviceName", "Service", spec["serviceName"])
        if kind in ("Deployment", "StatefulSet"):
            sel = (spec.get("selector") or {}).get("matchLabels") or {}
            lbl = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
            if not _matches(sel, lbl):
                problems.append(f"{at}: spec.selector {sel} does not match its pod template labels {lbl}")
        if kind in ("ScaledObject", "HorizontalPodAutoscaler"):
            ref = spec.get("scaleTargetRef") or {}
            ctx.need(f"{at}: scaleTargetRef", ref.get("kind", "Deployment"), ref.get("name"))
        for i, t in enumerate(spec.get("triggers") or [] if kind == "ScaledObject" else []):
            if auth := (t.get("authenticationRef") or {}).get("name"):
                ctx.need(f"{at}: triggers[{i}].authenticationRef", "TriggerAuthentication", auth)
            # KEDA's operator resolves the address from its own namespace: it must name ours in full
            address = (t.get("metadata") or {}).get("address", "")
            host = address.rsplit(":", 1)[0].split(".")
            if address and (host[0] not in ctx.by_kind.get("Service", {}) or host[1:3] != [meta.get("namespace"), "svc"]):
                problems.append(
                    f"{at}: triggers[{i}].metadata.address {address!r} is not <service>.{meta.get('namespace')}.svc... "
                    "of a Service in this render (KEDA resolves it from its own namespace)"
                )
        for ref in spec.get("secretTargetRef") or [] if kind == "TriggerAuthentication" else []:
            ctx.secret(at, ref.get("name"), ref.get("key"))
    targets = [(r.get("spec") or {}).get("scaleTargetRef", {}).get("name") for r in resources
               if r.get("kind") in ("ScaledObject", "HorizontalPodAutoscaler")]
    for t in sorted({t for t in targets if targets.count(t) > 1}):
        problems.append(f"{label}: {t} has more than one autoscaler (KEDA and HPA would fight): use one")
    return problems


def _check_pod(ctx: _Render, at: str, workload: dict) -> None:
    """Volumes, containers (images, env, probes), GPU placement of one workload's pod template."""
    pod = _pod_spec(workload)
    volumes = {v.get("name"): v for v in pod.get("volumes") or []}
    volumes |= {(t.get("metadata") or {}).get("name"): t for t in workload["spec"].get("volumeClaimTemplates") or []}
    for v in volumes.values():
        if "persistentVolumeClaim" in v:
            ctx.need(f"{at}: volume {v.get('name')}", "PersistentVolumeClaim", v["persistentVolumeClaim"].get("claimName"))
        if "configMap" in v:
            ctx.need(f"{at}: volume {v.get('name')}", "ConfigMap", v["configMap"].get("name"))
        if "secret" in v:
            ctx.secret(at, v["secret"].get("secretName"))
    # one-shot Jobs and init containers run to completion: Kubernetes has no readiness for them
    long_running, gpu = workload.get("kind") not in ("Job", "CronJob"), False
    for group in ("initContainers", "containers"):
        for c in pod.get(group) or []:
            cat = f"{at}: {group[:-1]} {c.get('name')}"
            if why := image_pinned(c["image"]) if c.get("image") else "no image":
                ctx.problems.append(f"{cat}: {why}")
            for vm in c.get("volumeMounts") or []:
                if vm.get("name") not in volumes:
                    ctx.problems.append(f"{cat}: volumeMount {vm.get('name')!r} names no volume of the pod")
            _check_env(ctx, cat, c)
            resources = c.get("resources") or {}
            gpu |= any("nvidia.com/gpu" in (resources.get(k) or {}) for k in ("limits", "requests"))
            for probe in ("livenessProbe", "readinessProbe") if group == "containers" and long_running else ():
                if not c.get(probe):
                    ctx.problems.append(f"{cat}: no {probe}")
                apps = celery_apps(((c.get(probe) or {}).get("exec") or {}).get("command"))
                if apps and apps != celery_apps((c.get("command") or []) + (c.get("args") or [])):
                    ctx.problems.append(f"{cat}: {probe} pings Celery app {sorted(apps)}, not the one the container runs")
    if gpu and not pod.get("nodeSelector"):
        ctx.problems.append(f"{at}: requests GPUs but has no nodeSelector: it could land on a node without them")


def _check_env(ctx: _Render, at: str, container: dict) -> None:
    for e in container.get("env") or []:
        ctx.setting(f"{at}: env", e.get("name", ""))
        src = e.get("valueFrom") or {}
        if ref := src.get("secretKeyRef"):
            ctx.secret(at, ref.get("name"), ref.get("key"))
        if ref := src.get("configMapKeyRef"):
            ctx.need(f"{at}: env {e.get('name')}", "ConfigMap", ref.get("name"), ref.get("key"))
    for ef in container.get("envFrom") or []:
        if ref := ef.get("configMapRef"):
            ctx.need(f"{at}: envFrom", "ConfigMap", ref.get("name"))
            for key in (ctx.by_kind.get("ConfigMap", {}).get(ref.get("name")) or {}).get("data") or {}:
                ctx.setting(f"{at}: envFrom ConfigMap {ref.get('name')} sets", key)
        if ref := ef.get("secretRef"):
            ctx.secret(at, ref.get("name"))


def check_k8s(repo: Path = REPO, doc_path: Path | None = None) -> list[str]:
    found = overlays(repo)
    if not found:
        return [f"{repo / 'k8s' / 'overlays'}: no overlay with a kustomization.yaml"]
    problems = []
    for overlay in found:
        label = str(overlay.relative_to(repo))
        try:
            resources = kustomize_build(overlay)
        except Exception as e:  # kustomize's own message names the file and field
            problems.append(f"{label}: kustomize build failed: {e}")
            continue
        problems += check_rendered(resources, label, doc_path or repo / "docs" / "deploy.md")
    return problems
