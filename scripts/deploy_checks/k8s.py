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
CRD_KINDS = {
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("keda.sh/v1alpha1", "ScaledJob"),
    ("keda.sh/v1alpha1", "TriggerAuthentication"),
}
JOB_FIELDS = {"command", "restartPolicy"}  # what a ScaledJob's pods may change of their Deployment's
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


def _template(r: dict) -> dict:
    """A workload's pod template; a KEDA ScaledJob's is its Job's."""
    if r.get("kind") == "ScaledJob":
        return dig(r, "spec", "jobTargetRef", "template") or {}
    return dig(r, "spec", "template") or {} if r.get("kind") in WORKLOADS else {}


def _pod(r: dict) -> dict:
    return _template(r).get("spec") or {}


def _labels(r: dict) -> dict:
    return dig(_template(r), "metadata", "labels") or {}


def _job_schema(r: dict) -> list[str]:
    """KEDA's CRDs have no schema here: a ScaledJob's `jobTargetRef` is a batch/v1 JobSpec, checked as one."""
    if r.get("kind") != "ScaledJob":
        return []
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"}, "spec": dig(r, "spec", "jobTargetRef")}
    return [f"jobTargetRef.{p}" for p in schema_problems(job)]


def _job_drift(r: dict, objects: dict) -> list[str]:
    """Where a ScaledJob's pod spec differs from that of the Deployment of its name beyond JOB_FIELDS
    (the Deployment is the pod spec's one source: components/keda copies it; an overlay's later patch
    of the Deployment alone does not reach the Jobs)."""
    deployment = objects.get(("Deployment", dig(r, "metadata", "name")))
    if r.get("kind") != "ScaledJob" or deployment is None:
        return []

    def strip(template: dict) -> dict:
        spec = {k: v for k, v in (template.get("spec") or {}).items() if k not in JOB_FIELDS}
        spec["containers"] = [{k: v for k, v in c.items() if k not in JOB_FIELDS} for c in spec.get("containers") or []]
        return {"metadata": template.get("metadata"), "spec": spec}

    job, pods = strip(_template(r)), strip(_template(deployment))
    return [
        k
        for k in sorted(set(job["spec"]) | set(pods["spec"]) | {"metadata"})
        if (job["spec"] | {"metadata": job["metadata"]}).get(k)
        != (pods["spec"] | {"metadata": pods["metadata"]}).get(k)
    ]


def _queues(w: dict) -> set[str]:
    """The Celery queues a worker's pods consume (their `aerie.dev/queues` label: base/extractor.yaml)."""
    return {q for q in (_labels(w).get("aerie.dev/queues") or "").split("-") if q}


def _scaled_pods(r: dict, objects: dict) -> dict | None:
    """The workload whose pods an autoscaler starts: a ScaledJob's own, else its scaleTargetRef's."""
    if r.get("kind") == "ScaledJob":
        return r
    ref = dig(r, "spec", "scaleTargetRef")
    return objects.get(("Deployment", ref.get("name"))) if r.get("kind") in ("ScaledObject",) and ref else None


def _misdirected_triggers(r: dict, objects: dict) -> list[tuple[str, list[str]]]:
    """(queue, consumed) for each queue an autoscaler follows that its pods do not consume."""
    pods = _scaled_pods(r, objects)
    if pods is None:
        return []
    consumed = _queues(pods)
    return [
        (q, sorted(consumed))
        for t in dig(r, "spec", "triggers") or []
        if (q := dig(t, "metadata", "listName")) and q not in consumed
    ]


def _int(value, default: int = 0) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _regeneration_overload(r: dict, objects: dict, every: list[dict]) -> list[tuple[int, int]]:
    """(requests, bound) where the `ingest` workers (who regenerate) can have more regenerate requests in
    flight than the generate servers run at once: replicas (an autoscaler's most) x worker concurrency
    x AERIE_REGENERATE_CONCURRENCY against GENERATE_MAX_RUNNING x generate's replicas (at least 1)."""
    if "ingest" not in _queues(r) or r.get("kind") not in ("Deployment", "ScaledJob"):
        return []
    scalers = [o for o in every if (s := _scaled_pods(o, objects)) is not None and s is r and o is not r]
    replicas = (
        _int(dig(r, "spec", "maxReplicaCount"), 100)
        if r["kind"] == "ScaledJob"
        else max(
            [_int(dig(o, "spec", "maxReplicaCount"), 100) for o in scalers] or [_int(r["spec"].get("replicas"), 1)]
        )
    )
    (c, *_) = _pod(r).get("containers") or [{}]
    env = container(c, _pod(r), objects).env
    requests = (
        replicas * _int(env.get("AERIE_WORKER_CONCURRENCY"), 1) * _int(env.get("AERIE_REGENERATE_CONCURRENCY"), 64)
    )
    found = []
    for server in every:
        if server.get("kind") != "Deployment" or dig(server, "metadata", "name") != "generate":
            continue
        (sc, *_) = _pod(server).get("containers") or [{}]
        senv = container(sc, _pod(server), objects)
        if "--max-running-requests" not in senv.command:
            found.append((requests, 0))
            continue
        bound = _int(senv.env.get("GENERATE_MAX_RUNNING")) * max(1, _int(server["spec"].get("replicas"), 1))
        if requests > bound:
            found.append((requests, bound))
    return found


def _matches(selector: dict | None, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _autoscalers(r: dict, every: list[dict]) -> list[dict]:
    return [
        o
        for o in every
        if r["kind"] == "Deployment" and dig(o, "spec", "scaleTargetRef", "name") == r["metadata"]["name"]
    ]


def _worker_scalers(r: dict, every: list[dict]) -> list[dict]:
    """A Deployment's autoscalers, and the ScaledJob that runs its pod spec as Jobs (components/keda)."""
    return _autoscalers(r, every) + [
        o
        for o in every
        if r["kind"] == "Deployment" and o.get("kind") == "ScaledJob" and o["metadata"]["name"] == r["metadata"]["name"]
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
    (
        ": {0}",
        lambda r, *_: _job_schema(r) if (r.get("apiVersion"), r.get("kind")) in CRD_KINDS else schema_problems(r),
    ),
    (
        ": its Jobs' pod spec differs from Deployment {1}'s in {0}: patch the Deployment before components/keda "
        "copies it, or patch both alike",
        lambda r, objects, *_: [(", ".join(d), r["metadata"]["name"]) for d in [_job_drift(r, objects)] if d],
    ),
    (
        ": ttlSecondsAfterFinished is {0}, not 0: a finished Job kept that long makes `kubectl apply -k` fail after "
        "any change of its pod template (immutable); 0 removes it once done, and the next apply runs it anew",
        lambda r, *_: (
            [dig(r, "spec", "ttlSecondsAfterFinished")]
            if r.get("kind") == "Job" and dig(r, "spec", "ttlSecondsAfterFinished") != 0
            else []
        ),
    ),
    (
        ": rollout.strategy is not `gradual`: `kubectl apply` of a changed ScaledJob deletes its running Jobs, "
        "busy workers and all",
        lambda r, *_: r.get("kind") == "ScaledJob" and dig(r, "spec", "rollout", "strategy") != "gradual",
    ),
    (
        ": scales on queue {0!r}, which its pods do not consume (they consume {1}): it starts workers that "
        "cannot take the backlog",
        lambda r, objects, *_: _misdirected_triggers(r, objects),
    ),
    (
        ": the ingest workers can have {0} regenerate requests in flight, more than the generate servers run at "
        "once ({1}: GENERATE_MAX_RUNNING x generate replicas, `--max-running-requests`): lower the workers' "
        "replicas, AERIE_WORKER_CONCURRENCY or AERIE_REGENERATE_CONCURRENCY, or raise GENERATE_MAX_RUNNING",
        lambda r, objects, _, every: _regeneration_overload(r, objects, every),
    ),
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
        lambda r, _, __, every: len(_worker_scalers(r, every)) > 1,
    ),
    (
        ": runs {0} pod(s) beside ScaledJob {1}'s Jobs, which run its pod spec: set its replicas to 0 (components/keda)",
        lambda r, _, __, every: [
            (r["spec"].get("replicas", 1), o["metadata"]["name"])
            for o in _worker_scalers(r, every)
            if o.get("kind") == "ScaledJob" and r["spec"].get("replicas", 1) != 0
        ],
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


def _root_settings(c: dict, pod: dict) -> list[str]:
    """What lets a container run as root: its securityContext over its pod's must say runAsNonRoot
    (the kubelet then refuses a root image) and a non-zero numeric runAsUser (a named USER of the
    image cannot be checked by the kubelet, which then refuses to start it)."""
    sc = {**(pod.get("securityContext") or {}), **(c.get("securityContext") or {})}
    problems = [] if sc.get("runAsNonRoot") is True else ["runAsNonRoot is not true"]
    uid = sc.get("runAsUser")
    problems += [] if isinstance(uid, int) and uid > 0 else [f"runAsUser is {uid!r}, not a non-zero uid"]
    return ["; ".join(problems)] if problems else []


POD_RULES = [  # (message, test(container, its group, pod spec, workload))
    (
        ": may run as root ({0}): set securityContext runAsNonRoot: true and runAsUser (the pod's or its own)",
        lambda c, _, pod, __: _root_settings(c, pod),
    ),
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
            if group == "containers" and r["kind"] not in ("Job", "ScaledJob")
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
