"""k8s/: every overlay rendered by kustomize, validated against Kubernetes' schema, aerie's rules on it.

- kustomize is pykustomize (kustomize's own Go library, api v0.21.3; scripts/setup.sh installs it).
- Built-in resources validate against the Kubernetes OpenAPI schema (kubernetes-validate, strict);
  KEDA's resources have no schema in any package here: checked by their references only.
- Every reference (REFERENCES) names an object of the render, or a Secret (and key) that a
  `kubectl create secret generic` in docs/deploy.md creates; no Secret is embedded.
- aerie's rules are tables: RESOURCE_RULES on each resource, CONTAINER_RULES on each container.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import yaml

from .common import REPO, apply, celery_apps, image_problems, soft_shutdown_missing, unknown_aerie_names

K8S_VERSION = "1.32.0"  # the oldest Kubernetes the manifests promise to work on
CRD_KINDS = {("keda.sh/v1alpha1", "ScaledObject"), ("keda.sh/v1alpha1", "TriggerAuthentication")}
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
PROTECTED = {"inference"}  # components only some pods may reach (a NetworkPolicy must select them)
GENERATING_PATHS = {"/health", "/health_generate"}  # SGLang generates a token there: readiness, not liveness
# field -> (kind it names, its name field, its key field): wherever it appears in a resource
REFERENCES = {
    "persistentVolumeClaim": ("PersistentVolumeClaim", "claimName", None), "configMap": ("ConfigMap", "name", None),
    "configMapRef": ("ConfigMap", "name", None), "configMapKeyRef": ("ConfigMap", "name", "key"),
    "secret": ("Secret", "secretName", None), "secretRef": ("Secret", "name", None),
    "secretKeyRef": ("Secret", "name", "key"), "secretTargetRef": ("Secret", "name", "key"),
    "authenticationRef": ("TriggerAuthentication", "name", None), "scaleTargetRef": ("Deployment", "name", None),
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


def _pod(r: dict) -> dict:
    return ((r.get("spec") or {}).get("template") or {}).get("spec") or {} if r.get("kind") in WORKLOADS else {}


def _labels(r: dict) -> dict:
    return (((r.get("spec") or {}).get("template") or {}).get("metadata") or {}).get("labels") or {}


def _matches(selector: dict | None, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _reference_problems(r: dict, objects: dict, secrets: dict) -> list[str]:
    found = []
    for path, kind, name, key in references(r.get("spec") or {}, "spec"):
        if kind == "Secret" and name not in secrets:
            found.append(f"{path}: Secret {name!r} is not created by a `kubectl create secret generic` in docs/deploy.md")
        elif kind == "Secret" and key and key not in secrets[name]:
            found.append(f"{path}: Secret {name} key {key!r} is not in the docs' `kubectl create secret generic {name}`")
        elif kind != "Secret" and (kind, name) not in objects:
            found.append(f"{path}: {kind} {name!r} is not in this render")
        elif kind != "Secret" and key and key not in (objects[kind, name].get("data") or {}):
            found.append(f"{path}: {kind} {name} has no key {key!r}")
    return found


def _env_names(c: dict, objects: dict) -> list[str]:
    return [e.get("name", "") for e in c.get("env") or []] + [
        k for ef in c.get("envFrom") or [] if "configMapRef" in ef
        for k in (objects.get(("ConfigMap", ef["configMapRef"].get("name"))) or {}).get("data") or {}]


# (message, test(container, its group, pod spec, workload, objects))
CONTAINER_RULES = [
    (": {0}", lambda c, *_: image_problems(c.get("image"))),
    (": volumeMount {0!r} names no volume of the pod",
     lambda c, _, pod, r, __: [m.get("name") for m in c.get("volumeMounts") or [] if m.get("name") not in
                               {v.get("name") for v in pod.get("volumes") or []} |
                               {t["metadata"]["name"] for t in r["spec"].get("volumeClaimTemplates") or []}]),
    (": env {0} is not an aerie setting: aerie refuses unknown AERIE_* variables",
     lambda c, _, __, ___, objects: unknown_aerie_names(_env_names(c, objects))),
    (": no {0}", lambda c, group, _, r, __: [p for p in ("livenessProbe", "readinessProbe") if not c.get(p)]
     if group == "containers" and r["kind"] != "Job" else []),
    (": {0} pings Celery app {1}, not the one the container runs",
     lambda c, *_: [(p, sorted(a)) for p in ("livenessProbe", "readinessProbe")
                    if (a := celery_apps(((c.get(p) or {}).get("exec") or {}).get("command")))
                    and a != celery_apps((c.get("command") or []) + (c.get("args") or []))]),
    (": livenessProbe GETs {0}, which generates a token: use it for readiness, a cheap path (/ready) for liveness",
     lambda c, *_: [p for p in [((c.get("livenessProbe") or {}).get("httpGet") or {}).get("path")] if p in GENERATING_PATHS]),
    ((": a Celery worker that keeps its task on SIGTERM: env REMAP_SIGTERM=SIGQUIT, `-- worker.soft_shutdown_timeout=N`"
      " and terminationGracePeriodSeconds above N"), lambda c, _, pod, *__: soft_shutdown_missing(
         " ".join((c.get("command") or []) + (c.get("args") or [])), {e["name"]: e.get("value") for e in c.get("env") or []},
         g if isinstance(g := pod.get("terminationGracePeriodSeconds", 30), int) else 0)),
]


def _gpu(pod: dict) -> bool:
    return any("nvidia.com/gpu" in ((c.get("resources") or {}).get(k) or {}) for c in pod.get("containers") or []
               for k in ("limits", "requests"))


def _keda_addresses(r: dict, objects: dict) -> list[str]:
    """KEDA's operator resolves a trigger's address in its own namespace: it must name ours in full."""
    found = []
    for t in (r.get("spec") or {}).get("triggers") or [] if r.get("kind") == "ScaledObject" else []:
        address = (t.get("metadata") or {}).get("address", "")
        host = address.rsplit(":", 1)[0].split(".")
        if address and (("Service", host[0]) not in objects or host[1:3] != [r["metadata"].get("namespace"), "svc"]):
            found.append((address, r["metadata"].get("namespace")))
    return found


# (message, test(resource, objects, documented secrets, every resource))
RESOURCE_RULES = [
    (": a Secret is embedded in the manifests: create it out of band (docs/deploy.md)", lambda r, *_: r["kind"] == "Secret"),
    (": {0}", lambda r, objects, secrets, _: _reference_problems(r, objects, secrets)),
    (": selector {0} matches no pod template in this render",
     lambda r, _, __, every: [r["spec"].get("selector")] if r["kind"] == "Service" and not any(
         _matches(r["spec"].get("selector"), _labels(w)) for w in every if w["kind"] in WORKLOADS) else []),
    (": serviceName {0!r} is not a Service in this render",
     lambda r, objects, *_: [n] if (n := (r.get("spec") or {}).get("serviceName")) and ("Service", n) not in objects else []),
    (": spec.selector {0} does not match its pod template labels {1}",
     lambda r, *_: [(s, _labels(r))] if r["kind"] in ("Deployment", "StatefulSet") and not _matches(
         s := (r["spec"].get("selector") or {}).get("matchLabels"), _labels(r)) else []),
    (": requests GPUs but has no nodeSelector: it could land on a node without them",
     lambda r, *_: _gpu(_pod(r)) and not _pod(r).get("nodeSelector")),
    (": triggers[].metadata.address {0!r} is not <service>.{1}.svc... of a Service here (KEDA resolves it in its namespace)",
     lambda r, objects, *_: _keda_addresses(r, objects)),
    (": sets spec.replicas while an autoscaler owns them: `kubectl apply` would reset them mid-run; remove it",
     lambda r, _, __, every: r["kind"] == "Deployment" and "replicas" in r["spec"] and any(
         (o.get("spec") or {}).get("scaleTargetRef", {}).get("name") == r["metadata"]["name"] for o in every)),
    (": pods of component {0!r} are reachable from any pod: add a NetworkPolicy selecting them",
     lambda r, _, __, every: [c for c in [_labels(r).get("app.kubernetes.io/component")] if c in PROTECTED and not any(
         o["kind"] == "NetworkPolicy" and _matches(o["spec"]["podSelector"].get("matchLabels"), _labels(r))
         for o in every)]),
]


def _shared_rwo_claims(resources: list[dict]) -> list[str]:
    """Workloads mounting one ReadWriteOnce claim must share a node (a required podAffinity on
    kubernetes.io/hostname that selects all of them), else a pod elsewhere never starts."""
    rwo = {r["metadata"]["name"] for r in resources if r["kind"] == "PersistentVolumeClaim"
           and "ReadWriteOnce" in r["spec"].get("accessModes", [])}
    users: dict[str, list[dict]] = {}
    for r in resources:
        for v in _pod(r).get("volumes") or []:
            if (v.get("persistentVolumeClaim") or {}).get("claimName") in rwo:
                users.setdefault(v["persistentVolumeClaim"]["claimName"], []).append(r)

    def together(r: dict, group: list[dict]) -> bool:
        terms = ((_pod(r).get("affinity") or {}).get("podAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution") or []
        return any(t.get("topologyKey") == "kubernetes.io/hostname" and all(
            _matches((t.get("labelSelector") or {}).get("matchLabels"), _labels(o)) for o in group) for t in terms)

    return [f"{claim} (ReadWriteOnce) is mounted by {', '.join(r['metadata']['name'] for r in group)} without a podAffinity "
            "holding them on one node" for claim, group in users.items() if len(group) > 1
            and not all(together(r, group) for r in group)]


def check_rendered(resources: list[dict], label: str, doc_path: Path = REPO / "docs" / "deploy.md") -> list[str]:
    """Schema validation and aerie's rules on one rendered overlay."""
    import kubernetes_validate

    objects = {(r.get("kind"), (r.get("metadata") or {}).get("name")): r for r in resources}
    secrets, problems = documented_secret_keys(doc_path), []
    for r in resources:
        at = f"{label}: {r.get('kind')}/{(r.get('metadata') or {}).get('name')}"
        if (r.get("apiVersion"), r.get("kind")) not in CRD_KINDS:
            try:
                kubernetes_validate.validate(r, K8S_VERSION, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                problems.append(f"{at}: no Kubernetes {K8S_VERSION} schema for {r.get('apiVersion')} {r.get('kind')}")
            except kubernetes_validate.ValidationError as e:
                problems.append(f"{at}: {'.'.join(map(str, e.path)) or '(top)'}: {e.message} "
                                f"(Kubernetes {K8S_VERSION} OpenAPI schema)")
        problems += apply(RESOURCE_RULES, at, r, objects, secrets, resources)
        pod = _pod(r)
        for group in ("initContainers", "containers"):
            for c in pod.get(group) or []:
                problems += apply(CONTAINER_RULES, f"{at}: {group[:-1]} {c.get('name')}", c, group, pod, r, objects)
    targets = [(r.get("spec") or {}).get("scaleTargetRef", {}).get("name") for r in resources]
    problems += [f"{label}: {t} has more than one autoscaler (KEDA and HPA would fight): use one"
                 for t in sorted({t for t in targets if t and targets.count(t) > 1})]
    return problems + [f"{label}: PersistentVolumeClaim {p}" for p in _shared_rwo_claims(resources)]


def check_k8s(repo: Path = REPO, doc_path: Path | None = None) -> list[str]:
    found = overlays(repo)
    problems = [] if found else [f"{repo / 'k8s' / 'overlays'}: no overlay with a kustomization.yaml"]
    for overlay in found:
        label = str(overlay.relative_to(repo))
        try:
            resources = kustomize_build(overlay)
        except Exception as e:  # kustomize's own message names the file and field
            problems.append(f"{label}: kustomize build failed: {e}")
            continue
        problems += check_rendered(resources, label, doc_path or repo / "docs" / "deploy.md")
    return problems
