"""k8s/: every overlay rendered by kustomize, validated against Kubernetes' schema, references resolved.

- kustomize is pykustomize (kustomize's own Go library, api v0.21.3; scripts/setup.sh installs it).
- Built-in resources validate against the Kubernetes OpenAPI schema (kubernetes-validate, strict).
  KEDA's ScaledObject and TriggerAuthentication have no schema in any package here: they are
  checked by their references only.
- Every reference (PVC, ConfigMap and its keys, KEDA/HPA targets, TriggerAuthentication) names an
  object of the render; Secrets are never embedded, and each one referenced (and its key) is
  created by a `kubectl create secret generic` in docs/deploy.md.
- Services and workload selectors match pod labels; long-running containers have probes that ping
  the Celery app they run; GPU pods have a nodeSelector; images are pinned; AERIE_* names known.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import yaml

from .common import REPO, celery_apps, image_pinned, unknown_aerie_name

K8S_VERSION = "1.32.0"  # the oldest Kubernetes the manifests promise to work on
CRD_KINDS = {("keda.sh/v1alpha1", "ScaledObject"), ("keda.sh/v1alpha1", "TriggerAuthentication")}
# field -> (kind it names, its name field, its key field): wherever it appears in a resource
REFERENCES = {
    "persistentVolumeClaim": ("PersistentVolumeClaim", "claimName", None),
    "configMap": ("ConfigMap", "name", None),
    "configMapRef": ("ConfigMap", "name", None),
    "configMapKeyRef": ("ConfigMap", "name", "key"),
    "secret": ("Secret", "secretName", None),
    "secretRef": ("Secret", "name", None),
    "secretKeyRef": ("Secret", "name", "key"),
    "secretTargetRef": ("Secret", "name", "key"),
    "authenticationRef": ("TriggerAuthentication", "name", None),
    "scaleTargetRef": ("Deployment", "name", None),  # or its `kind`
}


def kustomize_build(directory: Path) -> list[dict]:
    import pykustomize

    return [d for d in yaml.safe_load_all(asyncio.run(pykustomize.build(str(directory))).yaml) if d]


def overlays(repo: Path = REPO) -> list[Path]:
    return sorted(p.parent for p in (repo / "k8s" / "overlays").glob("*/kustomization.yaml"))


def documented_secret_keys(doc_path: Path) -> dict[str, set[str]]:
    """Secret name -> keys, from `kubectl create secret generic NAME --from-literal=KEY=...` in the guide."""
    out: dict[str, set[str]] = {}
    text = doc_path.read_text().replace("\\\n", " ") if doc_path.exists() else ""
    for m in re.finditer(r"kubectl\b[^\n]*?create secret generic\s+(\S+)([^\n]*)", text):
        out.setdefault(m.group(1), set()).update(re.findall(r"--from-literal=([A-Za-z0-9_.-]+)=", m.group(2)))
    return out


def references(node, path: str = ""):
    """(path, kind, name, key) of every reference in a resource tree (REFERENCES)."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        at = f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}" if path else k
        if k in REFERENCES:
            kind, name, key = REFERENCES[k]
            for i, ref in enumerate(v if isinstance(v, list) else [v]):
                yield f"{at}[{i}]" if isinstance(v, list) else at, ref.get("kind", kind), ref.get(name), ref.get(key)
        yield from references(v, at)


def pod_spec(res: dict) -> dict | None:
    spec = res.get("spec") or {}
    if res.get("kind") == "CronJob":
        spec = (spec.get("jobTemplate") or {}).get("spec") or {}
    if res.get("kind") in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "CronJob"):
        return (spec.get("template") or {}).get("spec")
    return spec if res.get("kind") == "Pod" else None


def check_rendered(resources: list[dict], label: str, doc_path: Path = REPO / "docs" / "deploy.md") -> list[str]:
    """Schema validation and reference checks of one rendered overlay."""
    import kubernetes_validate

    objects = {(r.get("kind"), (r.get("metadata") or {}).get("name")): r for r in resources}
    secrets, problems = documented_secret_keys(doc_path), []
    pods = [_template_labels(r) for r in resources if r.get("kind") in ("Deployment", "StatefulSet")]
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
        for path, ref_kind, name, key in references(spec, "spec"):
            if ref_kind == "Secret" and name not in secrets:
                problems.append(f"{at}: {path}: Secret {name!r} is not created by a `kubectl create secret generic` "
                                "in docs/deploy.md")
            elif ref_kind == "Secret" and key and key not in secrets[name]:
                problems.append(f"{at}: {path}: Secret {name} key {key!r} is not in the docs' `kubectl create secret "
                                f"generic {name}`")
            elif ref_kind != "Secret" and (ref_kind, name) not in objects:
                problems.append(f"{at}: {path}: {ref_kind} {name!r} is not in this render")
            elif ref_kind != "Secret" and key and key not in (objects[ref_kind, name].get("data") or {}):
                problems.append(f"{at}: {path}: {ref_kind} {name} has no key {key!r}")
        if kind == "Service" and not any(_matches(spec.get("selector"), labels) for labels in pods):
            problems.append(f"{at}: selector {spec.get('selector')} matches no pod template in this render")
        if kind == "StatefulSet" and spec.get("serviceName") and ("Service", spec["serviceName"]) not in objects:
            problems.append(f"{at}: serviceName {spec.get('serviceName')!r} is not a Service in this render")
        if kind in ("Deployment", "StatefulSet"):
            sel, labels = (spec.get("selector") or {}).get("matchLabels"), _template_labels(r)
            if not _matches(sel, labels):
                problems.append(f"{at}: spec.selector {sel} does not match its pod template labels {labels}")
        if pod_spec(r) is not None:
            problems += _check_pod(at, r, objects)
        for i, t in enumerate(spec.get("triggers") or [] if kind == "ScaledObject" else []):
            # KEDA's operator resolves the address from its own namespace: it must name ours in full
            address = (t.get("metadata") or {}).get("address", "")
            host = address.rsplit(":", 1)[0].split(".")
            if address and (("Service", host[0]) not in objects or host[1:3] != [meta.get("namespace"), "svc"]):
                problems.append(f"{at}: triggers[{i}].metadata.address {address!r} is not <service>."
                                f"{meta.get('namespace')}.svc... of a Service here (KEDA resolves it in its namespace)")
    targets = [r["spec"]["scaleTargetRef"].get("name") for r in resources if "scaleTargetRef" in (r.get("spec") or {})]
    for t in sorted({t for t in targets if targets.count(t) > 1}):
        problems.append(f"{label}: {t} has more than one autoscaler (KEDA and HPA would fight): use one")
    return problems


def _template_labels(workload: dict) -> dict:
    return (((workload.get("spec") or {}).get("template") or {}).get("metadata") or {}).get("labels") or {}


def _matches(selector: dict | None, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _check_pod(at: str, workload: dict, objects: dict) -> list[str]:
    """Containers (images, volume mounts, AERIE_* names, probes) and GPU placement of one pod template."""
    pod, problems, gpu = pod_spec(workload), [], False
    volumes = {v.get("name") for v in pod.get("volumes") or []}
    volumes |= {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates") or []}
    # one-shot Jobs and init containers run to completion: Kubernetes has no readiness for them
    long_running = workload.get("kind") not in ("Job", "CronJob")
    for group in ("initContainers", "containers"):
        for c in pod.get(group) or []:
            cat = f"{at}: {group[:-1]} {c.get('name')}"
            if why := image_pinned(c["image"]) if c.get("image") else "no image":
                problems.append(f"{cat}: {why}")
            problems += [f"{cat}: volumeMount {vm.get('name')!r} names no volume of the pod"
                         for vm in c.get("volumeMounts") or [] if vm.get("name") not in volumes]
            names = [e.get("name", "") for e in c.get("env") or []] + [
                key for ef in c.get("envFrom") or [] if "configMapRef" in ef
                for key in (objects.get(("ConfigMap", ef["configMapRef"].get("name"))) or {}).get("data") or {}
            ]
            problems += [f"{cat}: env {n} is not an aerie setting: aerie refuses unknown AERIE_* variables"
                         for n in names if unknown_aerie_name(n)]
            resources = c.get("resources") or {}
            gpu |= any("nvidia.com/gpu" in (resources.get(k) or {}) for k in ("limits", "requests"))
            for probe in ("livenessProbe", "readinessProbe") if group == "containers" and long_running else ():
                if not c.get(probe):
                    problems.append(f"{cat}: no {probe}")
                apps = celery_apps(((c.get(probe) or {}).get("exec") or {}).get("command"))
                if apps and apps != celery_apps((c.get("command") or []) + (c.get("args") or [])):
                    problems.append(f"{cat}: {probe} pings Celery app {sorted(apps)}, not the one the container runs")
    if gpu and not pod.get("nodeSelector"):
        problems.append(f"{at}: requests GPUs but has no nodeSelector: it could land on a node without them")
    return problems


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
