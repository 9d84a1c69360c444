"""k8s/: every overlay rendered by kustomize, validated against Kubernetes' schema, aerie's rules on it.

- kustomize is pykustomize (kustomize's own Go library, api v0.21.3; scripts/setup.sh installs it).
- Built-in resources validate against the Kubernetes OpenAPI schema (kubernetes-validate, strict);
  KEDA's resources have no schema in any package here: checked by their references only.
- Every reference (REFERENCES) names an object of the render, or a Secret (and key) that a
  `kubectl create secret generic` in docs/deploy.md creates; no Secret is embedded.
- aerie's rules are tables: RESOURCE_RULES on each resource, POD_RULES on each container, and the
  rules compose shares (common.CONTAINER_RULES).
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import yaml

from .common import CAPTURE_FLAGS, CONTAINER_RULES, REPO, Container, apply, dig, regeneration_hosts
from .docs import documented_secrets

K8S_VERSION = "1.32.0"  # the oldest Kubernetes the manifests promise to work on
CRD_KINDS = {("keda.sh/v1alpha1", "ScaledObject"), ("keda.sh/v1alpha1", "TriggerAuthentication")}
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
PROTECTED = {
    "inference",
    "generate",
    "redis",
    "minio",
}  # components only some pods may reach (a NetworkPolicy must select them)
GENERATING_PATHS = {"/health", "/health_generate"}  # SGLang generates a token there: readiness, not liveness
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
    "scaleTargetRef": ("Deployment", "name", None),
    "serviceName": ("Service", "name", None),  # a plain string
}


def kustomize_build(directory: Path) -> list[dict]:
    import pykustomize

    return [d for d in yaml.safe_load_all(asyncio.run(pykustomize.build(str(directory))).yaml) if d]


def overlays(repo: Path = REPO) -> list[Path]:
    return sorted(p.parent for p in (repo / "k8s" / "overlays").glob("*/kustomization.yaml"))


def schema_problems(r: dict) -> list[str]:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(r, K8S_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        return [f"no Kubernetes {K8S_VERSION} schema for {r.get('apiVersion')} {r.get('kind')}"]
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.path)) or '(top)'}: {e.message} (Kubernetes {K8S_VERSION} OpenAPI schema)"]
    return []


def references(node, path: str = "spec"):
    """(path, kind, name, key) of every reference in a resource tree (REFERENCES)."""
    for k, v in node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ():
        at = f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}"
        if k in REFERENCES:
            kind, name, key = REFERENCES[k]
            for i, ref in enumerate(v if isinstance(v, list) else [v]):
                ref = ref if isinstance(ref, dict) else {"name": ref}
                yield f"{at}[{i}]" if isinstance(v, list) else at, ref.get("kind", kind), ref.get(name), ref.get(key)
        yield from references(v, at)


def _unresolved(kind: str, name: str, key: str | None, objects: dict, secrets: dict) -> str | None:
    """Why a reference names nothing: a Secret is the guide's to create, anything else is in the render."""
    where = "the guide's `kubectl create secret generic`" if kind == "Secret" else "this render"
    if (name not in secrets) if kind == "Secret" else ((kind, name) not in objects):
        return f"{kind} {name!r} is not in {where}"
    keys = secrets[name] if kind == "Secret" else dig(objects[kind, name], "data") or {}
    return f"{kind} {name} has no key {key!r} in {where}" if key and key not in keys else None


def _pod(r: dict) -> dict:
    return dig(r, "spec", "template", "spec") or {} if r.get("kind") in WORKLOADS else {}


def _labels(r: dict) -> dict:
    return dig(r, "spec", "template", "metadata", "labels") or {}


def _matches(selector: dict | None, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _autoscalers(r: dict, every: list[dict]) -> list[dict]:
    return [
        o
        for o in every
        if r["kind"] == "Deployment" and dig(o, "spec", "scaleTargetRef", "name") == r["metadata"]["name"]
    ]


def _rwo_users(claim: dict, every: list[dict]) -> list[dict]:
    """The workloads mounting a ReadWriteOnce claim (none for any other resource)."""
    if claim["kind"] != "PersistentVolumeClaim" or "ReadWriteOnce" not in claim["spec"].get("accessModes", []):
        return []
    return [
        w
        for w in every
        if any(
            dig(v, "persistentVolumeClaim", "claimName") == claim["metadata"]["name"]
            for v in _pod(w).get("volumes") or []
        )
    ]


def _gpu_pod(w: dict) -> bool:
    return any(
        "nvidia.com/gpu" in (dig(c, "resources", k) or {})
        for c in _pod(w).get("containers") or []
        for k in ("limits", "requests")
    )


def _rwo_users_off_gpu(claim: dict, every: list[dict]) -> list[tuple[str, dict, list[str]]]:
    """The pods of a ReadWriteOnce claim share the node of the first one scheduled: one that may land
    where the GPU pods cannot (no GPU nodeSelector) pins them off the GPU node, and one that does not
    tolerate the GPU node's taint never reaches it. Each user selects and tolerates what the GPU users do."""
    users = _rwo_users(claim, every)
    gpu = [w for w in users if _gpu_pod(w)]
    if not gpu:
        return []
    selector = {k: v for w in gpu for k, v in (_pod(w).get("nodeSelector") or {}).items()}
    taints = sorted({t.get("key") for w in gpu for t in _pod(w).get("tolerations") or [] if t.get("key")})
    problems = []
    for w in users:
        chosen, tolerated = _pod(w).get("nodeSelector") or {}, {t.get("key") for t in _pod(w).get("tolerations") or []}
        if any(chosen.get(k) != v for k, v in selector.items()) or not set(taints) <= tolerated:
            problems.append((w["metadata"]["name"], selector, taints))
    return problems


def _rwo_users_apart(claim: dict, every: list[dict]) -> list[str]:
    """The workloads mounting one ReadWriteOnce claim must share a node: a required podAffinity on
    kubernetes.io/hostname that selects all of them, else a pod placed elsewhere never starts."""
    users = _rwo_users(claim, every)
    together = [
        any(
            t.get("topologyKey") == "kubernetes.io/hostname"
            and all(_matches(dig(t, "labelSelector", "matchLabels"), _labels(o)) for o in users)
            for t in dig(_pod(w), "affinity", "podAffinity", "requiredDuringSchedulingIgnoredDuringExecution") or []
        )
        for w in users
    ]
    return [", ".join(w["metadata"]["name"] for w in users)] if len(users) > 1 and not all(together) else []


def _unadmitted_services(r: dict, every: list[dict]) -> list[tuple[str, str]]:
    """(container, Service) for each Service a container names (in its env, its command, or a store or
    broker address of its envFrom ConfigMaps) whose pods NetworkPolicies guard, none of which admits
    this pod: its connections would be dropped."""
    services = {o["metadata"]["name"]: o for o in every if o["kind"] == "Service"}
    policies = [o for o in every if o["kind"] == "NetworkPolicy"]
    found = []
    for c in _pod(r).get("containers") or []:
        maps = {o["metadata"]["name"]: o.get("data") or {} for o in every if o["kind"] == "ConfigMap"}
        values = [e.get("value") for e in c.get("env") or []]
        values += [
            maps.get(ref.get("name"), {}).get(ref.get("key"))
            for e in c.get("env") or []
            if (ref := dig(e, "valueFrom", "configMapKeyRef"))
        ]
        # a shared ConfigMap (envFrom) names every server; a pod opens only the store and the broker of it
        values += [
            v
            for f in c.get("envFrom") or []
            for k, v in maps.get(dig(f, "configMapRef", "name"), {}).items()
            if k in ("AERIE_STORE", "AERIE_BROKER", "AERIE_RESULT_BACKEND")
        ]
        values += [str(a) for a in (c.get("command") or []) + (c.get("args") or [])]
        text = " ".join(str(v or "") for v in values)
        for name in sorted(set(re.findall(r"(?://|@)([a-z0-9-]+)(?:[:./]|$)", text)) & services.keys()):
            targets = [
                w
                for w in every
                if w["kind"] in WORKLOADS and _matches(services[name]["spec"].get("selector"), _labels(w))
            ]
            guards = [
                p
                for p in policies
                if any(_matches(dig(p, "spec", "podSelector", "matchLabels"), _labels(w)) for w in targets)
            ]
            admitted = any(
                _matches(dig(f, "podSelector", "matchLabels"), _labels(r))
                for p in guards
                for rule in dig(p, "spec", "ingress") or []
                for f in rule.get("from") or []
            )
            if guards and not admitted and r not in targets:
                found.append((c["name"], name))
    return found


def _regeneration_servers(r: dict, objects: dict, every: list[dict]) -> list[tuple[str, str, str]]:
    """(container, url, why) for each AERIE_REGENERATE_URLS entry of a workload's containers naming no
    Service of the render, or one selecting an SGLang in capture mode."""
    found = []
    for c in _pod(r).get("containers") or []:
        for url, host in regeneration_hosts(container(c, _pod(r), objects)):
            name = host.split(".")[0]
            if (service := objects.get(("Service", name))) is None:
                found.append((c.get("name"), url, f"no Service {name!r} in this render"))
                continue
            found += [
                (
                    c.get("name"),
                    url,
                    f"Service {name} selects {w['kind']}/{w['metadata']['name']}, SGLang in capture "
                    f"mode ({', '.join(flags)})",
                )
                for w in every
                if w.get("kind") in WORKLOADS and _matches(dig(service, "spec", "selector"), _labels(w))
                for wc in _pod(w).get("containers") or []
                if (
                    flags := [
                        f for f in CAPTURE_FLAGS if f in " ".join((wc.get("command") or []) + (wc.get("args") or []))
                    ]
                )
            ]
    return found


RESOURCE_RULES = [  # (message, test(resource, objects by (kind, name), documented secrets, every resource))
    (": {0}", lambda r, *_: [] if (r.get("apiVersion"), r.get("kind")) in CRD_KINDS else schema_problems(r)),
    (
        ": a Secret is embedded in the manifests: create it out of band (docs/deploy.md)",
        lambda r, *_: r["kind"] == "Secret",
    ),
    (
        ": {0}: {1}",
        lambda r, objects, secrets, _: [
            (path, why)
            for path, *ref in references(r.get("spec") or {})
            if (why := _unresolved(*ref, objects, secrets))
        ],
    ),
    (
        ": selector {0} matches no pod template in this render",
        lambda r, _, __, every: (
            [r["spec"].get("selector")]
            if r["kind"] == "Service"
            and not any(_matches(r["spec"].get("selector"), _labels(w)) for w in every if w["kind"] in WORKLOADS)
            else []
        ),
    ),
    (
        ": spec.selector {0} does not match its pod template labels {1}",
        lambda r, *_: (
            [(s, _labels(r))]
            if r["kind"] in ("Deployment", "StatefulSet")
            and not _matches(s := dig(r, "spec", "selector", "matchLabels"), _labels(r))
            else []
        ),
    ),
    (
        ": requests GPUs but has no nodeSelector: it could land on a node without them",
        lambda r, *_: (
            not _pod(r).get("nodeSelector")
            and any(
                "nvidia.com/gpu" in (dig(c, "resources", k) or {})
                for c in _pod(r).get("containers") or []
                for k in ("limits", "requests")
            )
        ),
    ),
    (
        ": triggers[].metadata.address {0!r} is not <service>.{1}.svc... of a Service here (KEDA resolves it in its own "
        "namespace)",
        lambda r, objects, *_: [
            (a, ns)
            for ns in [dig(r, "metadata", "namespace")]
            for t in dig(r, "spec", "triggers") or []
            if (a := dig(t, "metadata", "address"))
            and not any(a.startswith(f"{n}.{ns}.svc.") for kind, n in objects if kind == "Service")
        ],
    ),
    (
        ": has more than one autoscaler (KEDA and HPA would fight): use one",
        lambda r, _, __, every: len(_autoscalers(r, every)) > 1,
    ),
    (
        ": sets spec.replicas while an autoscaler owns them: `kubectl apply` would reset them mid-run; remove it",
        lambda r, _, __, every: "replicas" in r.get("spec", {}) and bool(_autoscalers(r, every)),
    ),
    (
        ": pods of component {0!r} are reachable from any pod: add a NetworkPolicy selecting them",
        lambda r, _, __, every: [
            c
            for c in [_labels(r).get("app.kubernetes.io/component")]
            if c in PROTECTED
            and not any(
                o["kind"] == "NetworkPolicy" and _matches(dig(o, "spec", "podSelector", "matchLabels"), _labels(r))
                for o in every
            )
        ],
    ),
    (
        ": ReadWriteOnce, mounted by {0} without a podAffinity holding them on one node",
        lambda r, _, __, every: _rwo_users_apart(r, every),
    ),
    (
        ": container {0} connects to Service {1}, whose NetworkPolicy does not admit this pod: add it to the policy",
        lambda r, _, __, every: _unadmitted_services(r, every),
    ),
    (
        ": ReadWriteOnce, shared with GPU pods: {0} must select their node {1} and tolerate taints {2}, else the "
        "first pod scheduled can pin the GPU pods where they cannot run",
        lambda r, _, __, every: _rwo_users_off_gpu(r, every),
    ),
    (
        ": container {0}: AERIE_REGENERATE_URLS names {1}: {2}: point it at a plain SGLang server (radix cache on, no "
        "capture: generate.yaml)",
        lambda r, objects, _, every: _regeneration_servers(r, objects, every),
    ),
]
POD_RULES = [  # (message, test(container, its group, pod spec, workload))
    (
        ": volumeMount {0!r} names no volume of the pod",
        lambda c, _, pod, r: [
            m.get("name")
            for m in c.get("volumeMounts") or []
            if m.get("name")
            not in {v.get("name") for v in pod.get("volumes") or []}
            | {t["metadata"]["name"] for t in r["spec"].get("volumeClaimTemplates") or []}
        ],
    ),
    (
        ": no {0}",
        lambda c, group, _, r: (
            [p for p in ("livenessProbe", "readinessProbe") if not c.get(p)]
            if group == "containers" and r["kind"] != "Job"
            else []
        ),
    ),
    (
        ": livenessProbe GETs {0}, which generates a token: use it for readiness, a cheap path (/ready) for liveness",
        lambda c, *_: [p for p in [dig(c, "livenessProbe", "httpGet", "path")] if p in GENERATING_PATHS],
    ),
]


def container(c: dict, pod: dict, objects: dict) -> Container:
    """A container, for the rules both platforms share (the keys of its envFrom ConfigMaps included)."""
    env = {
        k: v
        for ef in c.get("envFrom") or []
        for k, v in (dig(objects.get(("ConfigMap", dig(ef, "configMapRef", "name"))), "data") or {}).items()
    }
    grace = pod.get("terminationGracePeriodSeconds", 30)
    return Container(
        c.get("image"),
        " ".join((c.get("command") or []) + (c.get("args") or [])),
        env | {e.get("name", ""): e.get("value") for e in c.get("env") or []},
        {p: " ".join(dig(c, p, "exec", "command") or []) for p in ("livenessProbe", "readinessProbe")},
        grace if isinstance(grace, int) else 0,
    )


def check_rendered(resources: list[dict], label: str, doc_path: Path = REPO / "docs" / "deploy.md") -> list[str]:
    """Schema validation and aerie's rules on one rendered overlay."""
    objects = {(r.get("kind"), dig(r, "metadata", "name")): r for r in resources}
    secrets, problems = documented_secrets(doc_path), []
    for r in resources:
        at = f"{label}: {r.get('kind')}/{dig(r, 'metadata', 'name')}"
        problems += apply(RESOURCE_RULES, at, r, objects, secrets, resources)
        for group in ("initContainers", "containers"):
            for c in _pod(r).get(group) or []:
                problems += apply(POD_RULES, f"{at}: {group[:-1]} {c.get('name')}", c, group, _pod(r), r)
                problems += apply(
                    CONTAINER_RULES, f"{at}: {group[:-1]} {c.get('name')}", container(c, _pod(r), objects)
                )
    return problems


def check_k8s(repo: Path = REPO, doc_path: Path | None = None) -> list[str]:
    problems = [] if overlays(repo) else [f"{repo / 'k8s' / 'overlays'}: no overlay with a kustomization.yaml"]
    for overlay in overlays(repo):
        try:
            resources = kustomize_build(overlay)
        except Exception as e:  # kustomize's own message names the file and field
            problems.append(f"{overlay.relative_to(repo)}: kustomize build failed: {e}")
            continue
        problems += check_rendered(resources, str(overlay.relative_to(repo)), doc_path or repo / "docs" / "deploy.md")
    return problems
