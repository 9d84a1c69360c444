"""k8s/: overlays rendered by kustomize, validated against Kubernetes' schema, references resolved."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml

from scripts.deploy_checks.k8s import (
    check_k8s,
    check_rendered,
    kustomize_build,
    overlays,
)
from tests.deploy.breaks import Break, with_batches
from tests.services import REPO


def test_k8s_overlays_render_the_whole_system(compose_services):
    for overlay in overlays():
        kinds = {(r["kind"], r["metadata"]["name"]) for r in kustomize_build(overlay)}
        for expected in [
            ("Deployment", "inference"),
            ("Deployment", "extractor"),
            ("Deployment", "trainer"),
            ("StatefulSet", "redis"),
            ("StatefulSet", "minio"),
            ("Job", "minio-init"),
            ("Deployment", "extractor-ingest"),
            ("ScaledJob", "extractor"),
            ("PersistentVolumeClaim", "aerie-models"),
        ]:
            assert expected in kinds, f"{overlay.name}: {expected} missing from the render"
        # SGLang's --api-key: the server reads it from the Secret, and so do its clients
        pods = {
            r["metadata"]["name"]: r["spec"]["template"]["spec"]
            for r in kustomize_build(overlay)
            if r["kind"] == "Deployment"
        }
        keys = {
            (name, e["name"])
            for name, pod in pods.items()
            for e in pod["containers"][0].get("env") or []
            if (e.get("valueFrom") or {}).get("secretKeyRef", {}).get("key") == "SGLANG_API_KEY"
        }
        assert keys == {
            ("inference", "SGLANG_API_KEY"),
            ("generate", "SGLANG_API_KEY"),
            ("extractor", "AERIE_ENGINE_API_KEY"),
            ("extractor-ingest", "AERIE_ENGINE_API_KEY"),
            ("trainer", "AERIE_ENGINE_API_KEY"),
        }, keys
        # extractors run in other pods than SGLang: captures travel through the bucket (the s3 sink),
        # so the server's plugin gets the store and its key
        rendered = kustomize_build(overlay)
        config = next(r["data"] for r in rendered if r["metadata"]["name"].startswith("aerie-config"))
        assert config["AERIE_ENGINE_SINK"] == "s3" and config["AERIE_ENGINE_TRANSPORT"] == "auto"
        sglang = pods["inference"]["containers"][0]
        assert {"AERIE_SGLANG_BINARY", "AERIE_STORE", "AERIE_BUCKET", "AERIE_S3_ACCESS_KEY", "AERIE_S3_SECRET_KEY"} <= {
            e["name"] for e in sglang["env"]
        }
        # every setting of aerie's SGLang plugin that compose gives the capture server, k8s gives it
        # the same (the sink's folder aside: compose's sink is shm, k8s's s3)
        plugin = {
            k: v
            for k, v in compose_services["inference-capture"]["environment"].items()
            if k.startswith("AERIE_") and k != "AERIE_CAPTURE_DIR"
        }
        given = {e["name"]: e.get("value") for e in sglang["env"]}
        assert {k: given.get(k) for k in plugin} == plugin, f"{overlay.name}: plugin settings differ from compose's"
        assert "--enable-metrics" in sglang["command"][2]
        inference = next(r for r in rendered if r["kind"] == "Deployment" and r["metadata"]["name"] == "inference")
        assert inference["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
        assert any(m["mountPath"] == "/home/aerie/.cache" for m in sglang["volumeMounts"]), "SGLang's JIT cache"


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
                "components": [f"{rel}/components/{c}" for c in ["models-rwo", *components]],
                "configMapGenerator": [{"name": "inference-config", "behavior": "merge", "literals": literals}],
            }
        )
    )
    return tmp_path


def test_k8s_serve_and_hpa_components_render_and_validate(tmp_path):
    serve = kustomize_build(
        _component_overlay(tmp_path / "serve", ["keda", "serve"], ["DRAFTER=chat-eagle3", "CAPTURE_LAYER_IDS=1 14 26"])
    )
    assert check_rendered(serve, "serve") == []
    config = next(r for r in serve if r["kind"] == "ConfigMap" and r["metadata"]["name"].startswith("inference-config"))
    assert config["data"]["DRAFTER"] == "chat-eagle3", "the overlay's DRAFTER must survive the serve component"
    pod = next(r for r in serve if r["kind"] == "Deployment" and r["metadata"]["name"] == "inference")
    pod = pod["spec"]["template"]["spec"]
    assert "aerie pull" in pod["initContainers"][0]["command"][2]
    assert "--speculative-draft-model-path /drafters/current" in pod["containers"][0]["command"][2]
    assert not any(e["name"] == "AERIE_SGLANG_BINARY" for e in pod["containers"][0].get("env") or [])
    # clients reach the served model: a policy on inference admits labelled pods of any namespace
    labels = next(r for r in serve if r["kind"] == "Deployment" and r["metadata"]["name"] == "inference")
    labels = labels["spec"]["template"]["metadata"]["labels"]
    assert any(
        r["kind"] == "NetworkPolicy"
        and all(labels.get(k) == v for k, v in r["spec"]["podSelector"]["matchLabels"].items())
        and f.get("namespaceSelector") == {}
        and f["podSelector"]["matchLabels"] == {"aerie.dev/sglang-client": "true"}
        for r in serve
        for rule in (r.get("spec") or {}).get("ingress") or []
        for f in rule.get("from") or []
    ), "serving admits no client"

    hpa = kustomize_build(_component_overlay(tmp_path / "hpa", ["hpa"], ["CAPTURE_LAYER_IDS=1 14 26"]))
    assert check_rendered(hpa, "hpa") == []
    autoscalers = [r["kind"] for r in hpa if r["kind"] in ("HorizontalPodAutoscaler", "ScaledObject", "ScaledJob")]
    assert autoscalers == ["HorizontalPodAutoscaler"]


def test_k8s_check_reports_two_autoscalers_on_one_deployment(tmp_path):
    both = kustomize_build(_component_overlay(tmp_path, ["keda", "hpa"], ["CAPTURE_LAYER_IDS=1 14 26"]))
    assert any("Deployment/extractor: has more than one autoscaler" in p for p in check_rendered(both, "both"))


K8S_REGENERATE_URLS = 'AERIE_REGENERATE_URLS=["http://generate:30000"]'
WORKER_ENV = "          env:\n            - name: REDIS_PASSWORD"
# Breaks of one batch ("a", "b", "c") edit different resources, or different fields of one whose
# expected message names the field; a resource gets at most one schema error per batch (the schema
# reports the first); the others change what every resource sees (kustomize, the namespace, an
# overlay's components, the PVC's apiVersion) and get a copy each.
K8S_BREAKS = [
    b._replace(file=f"k8s/{b.file}")
    for b in [
        Break(
            "a missing resource file",
            "base/kustomization.yaml",
            "  - trainer.yaml",
            "  - trainers.yaml",
            "kustomize build failed",
        ),
        Break(
            "a field Kubernetes does not know",
            "base/trainer.yaml",
            "      terminationGracePeriodSeconds: 300",
            "      terminationGracePeriod: 300",
            "Deployment/trainer: spec.template.spec: Additional properties are not allowed ('terminationGracePeriod'",
            batch="a",
        ),
        Break(
            "a wrongly typed field",
            "base/extractor.yaml",
            "terminationGracePeriodSeconds: 120",
            "terminationGracePeriodSeconds: soon",
            "Deployment/extractor: spec.template.spec.terminationGracePeriodSeconds: 'soon' is not of type 'integer'",
            batch="b",
        ),
        Break(
            "a container without a readiness probe",
            "base/extractor.yaml",
            "          readinessProbe:",
            "          x-readinessProbe:",
            "Deployment/extractor: spec.template.spec.containers.0: Additional properties are not allowed ('x-readinessProbe'",
            batch="c",
        ),
        Break(
            "an apiVersion with no schema",
            "base/models-pvc.yaml",
            "apiVersion: v1",
            "apiVersion: v2",
            "no Kubernetes 1.32.0 schema for v2 PersistentVolumeClaim",
        ),
        Break(
            "an embedded Secret",
            "base/kustomization.yaml",
            "configMapGenerator:",
            "secretGenerator:\n  - name: aerie-credentials\n    literals: [REDIS_PASSWORD=x]\nconfigMapGenerator:",
            "a Secret is embedded",
            batch="a",
        ),
        Break(
            "a PVC that is not there",
            "base/extractor.yaml",
            "claimName: aerie-models",
            "claimName: aerie-model",
            "PersistentVolumeClaim 'aerie-model' is not in this render",
            batch="a",
        ),
        Break(
            "a ConfigMap volume that is not there",
            "base/minio-init.yaml",
            "name: minio-init-script",
            "name: minio-script",
            "configMap: ConfigMap 'minio-script' is not in this render",
            batch="a",
        ),
        Break(
            "a Secret volume the guide never creates",
            "base/minio-init.yaml",
            "      volumes:\n",
            "      volumes:\n        - name: creds\n          secret: {secretName: minio-creds}\n",
            "Secret 'minio-creds' is not in the guide's `kubectl create secret generic`",
            batch="a",
        ),
        Break(
            "a volumeMount of no volume",
            "base/extractor.yaml",
            "            - name: models\n              mountPath",
            "            - name: model\n              mountPath",
            "volumeMount 'model' names no volume",
            batch="a",
        ),
        Break(
            "a Service selecting no pod",
            "base/redis.yaml",
            "  selector:\n    app.kubernetes.io/component: redis",
            "  selector:\n    app.kubernetes.io/component: rediss",
            "Service/redis: selector {'app.kubernetes.io/component': 'rediss'} matches no pod template",
            batch="a",
        ),
        Break(
            "a StatefulSet naming no Service",
            "base/redis.yaml",
            "serviceName: redis",
            "serviceName: rediss",
            "StatefulSet/redis: spec.serviceName: Service 'rediss' is not in this render",
            batch="a",
        ),
        Break(
            "a selector not matching its pod template",
            "base/extractor.yaml",
            "    matchLabels:\n      app.kubernetes.io/component: extractor",
            "    matchLabels:\n      app.kubernetes.io/component: extractors",
            "Deployment/extractor: spec.selector {'aerie.dev/queues': 'extract', 'app.kubernetes.io/component': 'extractors'} does not match",
            batch="a",
        ),
        Break(
            "a Secret key the guide never creates",
            "base/minio.yaml",
            "key: MINIO_ROOT_PASSWORD",
            "key: MINIO_PASSWORD",
            "Secret aerie-credentials has no key 'MINIO_PASSWORD' in the guide's",
            batch="b",
        ),
        Break(
            "a ConfigMap key that is not there",
            "base/minio-init.yaml",
            "key: AERIE_BUCKET",
            "key: BUCKET",
            "has no key 'BUCKET'",
            batch="b",
        ),
        Break(
            "an env ConfigMap that is not there",
            "base/minio-init.yaml",
            "                  name: aerie-config\n",
            "                  name: aerie-settings\n",
            "configMapKeyRef: ConfigMap 'aerie-settings' is not in this render",
            batch="c",
        ),
        Break(
            "an envFrom ConfigMap that is not there",
            "base/extractor.yaml",
            "                name: aerie-config",
            "                name: aerie-settings",
            "configMapRef: ConfigMap 'aerie-settings' is not in this render",
            batch="b",
        ),
        Break(
            "an envFrom Secret the guide never creates",
            "base/extractor.yaml",
            WORKER_ENV,
            "            - secretRef: {name: worker-secrets}\n" + WORKER_ENV,
            "secretRef: Secret 'worker-secrets' is not in the guide's",
            batch="b",
        ),
        Break(
            "an unknown AERIE_* setting",
            "base/kustomization.yaml",
            "AERIE_ENGINE=sglang",
            "AERIE_ENGIN=sglang",
            "Deployment/trainer: container worker: env AERIE_ENGIN is not an aerie setting",
            batch="a",
        ),
        Break(
            "an unpinned image",
            "base/redis.yaml",
            "image: docker.io/library/redis:7.4.2-alpine",
            "image: docker.io/library/redis:latest",
            "container redis: image 'docker.io/library/redis:latest' uses `latest`",
            batch="b",
        ),
        Break(
            "a probe pinging another Celery app",
            "base/extractor.yaml",
            "celery -A aerie_extractor.worker inspect ping",
            "celery -A aerie_trainer.worker inspect ping",
            "Deployment/extractor: container worker: readinessProbe pings Celery app ['aerie_trainer.worker']",
            batch="b",
        ),
        Break(
            "a models-claim pod that may land off the GPU node",
            "components/models-rwo/models-affinity.yaml",
            '      nodeSelector:\n        nvidia.com/gpu.present: "true"\n',
            "",
            "PersistentVolumeClaim/aerie-models: ReadWriteOnce, shared with GPU pods: extractor must select their node",
            batch="c",
        ),
        Break(
            "a store client the MinIO policy does not admit",
            "base/network-policy.yaml",
            "        - podSelector:\n            matchLabels:\n              app.kubernetes.io/component: minio-init\n",
            "",
            "Job/minio-init: container minio-init connects to Service minio, whose NetworkPolicy does not admit this pod",
            batch="c",
        ),
        Break(
            "Redis's worker policy selecting no pod (KEDA's alone then shuts the workers out)",
            "base/network-policy.yaml",
            "  name: redis\nspec:\n  podSelector:\n    matchLabels:\n      app.kubernetes.io/component: redis",
            "  name: redis\nspec:\n  podSelector:\n    matchLabels:\n      app.kubernetes.io/component: nobody",
            "Deployment/trainer: container worker connects to Service redis, whose NetworkPolicy does not admit this pod",
            batch="b",
        ),
        Break(
            "a probe pinging a solo-pool worker",
            "base/trainer.yaml",
            'command: ["sh", "-c", "test $(( $(date +%s) - $(stat -c %Y /tmp/aerie-alive) )) -lt 60"]',
            'command: ["sh", "-c", "celery -A aerie_trainer.worker inspect ping"]',
            "Deployment/trainer: container worker: readinessProbe pings a solo-pool worker",
            batch="b",
        ),
        Break(
            "a probe reading another alive file",
            "base/trainer.yaml",
            '"--alive-file", "/tmp/aerie-alive"',
            '"--alive-file", "/tmp/alive"',
            "readinessProbe reads /tmp/aerie-alive, not the --alive-file the worker touches (/tmp/alive)",
            batch="a",
        ),
        Break(
            "a GPU pod without a nodeSelector",
            "base/trainer.yaml",
            '      nodeSelector:\n        nvidia.com/gpu.present: "true"\n',
            "",
            "Deployment/trainer: requests GPUs but has no nodeSelector",
            batch="b",
        ),
        Break(
            "an overlay patching the extractors' Deployment but not their Jobs",
            "overlays/multi-node/kustomization.yaml",
            "      - op: add   # extractor.yaml's, on the Jobs' pods (copied before this overlay's patches)\n"
            "        path: /spec/jobTargetRef/template/spec/nodeSelector\n"
            '        value: {aerie.dev/cpu-worker: "true"}',
            "",
            "multi-node: ScaledJob/extractor: its Jobs' pod spec differs from Deployment extractor's in nodeSelector",
            batch="b",
        ),
        Break(
            "a one-shot Job kept after its run (its next changed apply fails)",
            "base/minio-init.yaml",
            "  ttlSecondsAfterFinished: 0\n",
            "  ttlSecondsAfterFinished: 3600\n",
            "Job/minio-init: ttlSecondsAfterFinished is 3600, not 0",
            batch="c",
        ),
        Break(
            "a ScaledJob whose update deletes its running Jobs",
            "components/keda/scaledjob.yaml",
            "    strategy: gradual",
            "    strategy: default",
            "ScaledJob/extractor: rollout.strategy is not `gradual`",
            batch="b",
        ),
        Break(
            "an extract backlog scaling workers of another queue",
            "components/keda/scaledjob.yaml",
            "        listName: extract",
            "        listName: ingest",
            "ScaledJob/extractor: scales on queue 'ingest', which its pods do not consume (they consume ['extract'])",
            batch="c",
        ),
        Break(
            "regeneration beyond what the generate server runs at once",
            "base/kustomization.yaml",
            "      - GENERATE_MAX_RUNNING=128",
            "      - GENERATE_MAX_RUNNING=100",
            "Deployment/extractor-ingest: the ingest workers can have 128 regenerate requests in flight, more than the "
            "generate servers run at once (100",
            batch="a",
        ),
        Break(
            "a generate server without a bound on running requests",
            "base/generate.yaml",
            '                --max-running-requests "$GENERATE_MAX_RUNNING" \\\n',
            "",
            "Deployment/extractor-ingest: the ingest workers can have 128 regenerate requests in flight, more than the "
            "generate servers run at once (0",
        ),
        Break(
            "a KEDA trigger naming no TriggerAuthentication",
            "components/keda/scaledjob.yaml",
            "      authenticationRef:\n        name: redis-auth",
            "      authenticationRef:\n        name: redis-login",
            "authenticationRef: TriggerAuthentication 'redis-login' is not in this render",
            batch="a",
        ),
        Break(
            "an aerie image of no named registry",
            "base/extractor.yaml",
            "image: registry.invalid/aerie/extractor:0.1.0",
            "image: aerie/extractor:0.1.0",
            "'aerie/extractor:0.1.0' names no registry",
            batch="a",
        ),
        Break(
            "a Deployment's pods beside its ScaledJob's Jobs",
            "overlays/multi-node/kustomization.yaml",
            "  - name: trainer\n    count: 1\n",
            "  - name: trainer\n    count: 1\n  - name: extractor\n    count: 2\n",
            "multi-node: Deployment/extractor: runs 2 pod(s) beside ScaledJob extractor's Jobs",
            batch="a",
        ),
        Break(  # issue 35, finding 10: the NetworkPolicy covered SGLang only (Redis: the break below)
            "MinIO reachable from any pod",
            "base/network-policy.yaml",
            "      app.kubernetes.io/component: minio\n",
            "      app.kubernetes.io/component: nothing\n",
            "pods of component 'minio' are reachable from any pod",
        ),
        Break(
            "SGLang reachable from any pod",
            "base/network-policy.yaml",
            "      app.kubernetes.io/component: inference\n",
            "      app.kubernetes.io/component: nothing\n",
            "pods of component 'inference' are reachable from any pod",
            batch="a",
        ),
        Break(
            "a liveness probe that generates",
            "base/inference.yaml",
            "httpGet: {path: /ready, port: http}",
            "httpGet: {path: /health, port: http}",
            "livenessProbe GETs /health, which generates a token",
            batch="a",
        ),
        Break(
            "a worker that keeps its task on SIGTERM",
            "base/extractor.yaml",
            "            - name: REMAP_SIGTERM\n",
            "            - name: REMAP_SIGTERN\n",
            "container worker: a Celery worker that keeps its task on SIGTERM",
            batch="c",
        ),
        Break(
            "pods of a ReadWriteOnce claim free to spread",
            "overlays/single-host/kustomization.yaml",
            "  - ../../components/models-rwo",
            "  # - ../../components/models-rwo",
            "PersistentVolumeClaim/aerie-models: ReadWriteOnce, mounted by extractor, extractor-ingest, generate, inference, trainer, extractor without a podAffinity",
        ),
        Break(
            "a KEDA address in another namespace",
            "overlays/multi-node/kustomization.yaml",
            "namespace: aerie\n",
            "namespace: llm\n",
            "is not <service>.llm.svc",
        ),
        # regeneration: never through the capture server (radix cache off, capturing), always through one
        Break(
            "regeneration sent to the capture server",
            "base/kustomization.yaml",
            K8S_REGENERATE_URLS,
            K8S_REGENERATE_URLS.replace("generate:", "inference:"),
            "Deployment/extractor: container worker: AERIE_REGENERATE_URLS "
            "names http://inference:30000: Service inference selects Deployment/inference, SGLang in capture mode",
            batch="c",
        ),
        Break(
            "a generation server started in capture mode",
            "base/generate.yaml",
            "--enable-metrics $GENERATE_EXTRA_ARGS",
            "--disable-radix-cache --enable-metrics $GENERATE_EXTRA_ARGS",
            "names http://generate:30000: Service generate selects "
            "Deployment/generate, SGLang in capture mode (--disable-radix-cache)",
        ),
        Break(
            "regeneration at a Service that is not there",
            "base/kustomization.yaml",
            K8S_REGENERATE_URLS,
            K8S_REGENERATE_URLS.replace("generate:", "generator:"),
            "names http://generator:30000: no Service 'generator' in this render",
        ),
        Break(
            "an sglang extractor with no generation server",
            "base/kustomization.yaml",
            f"      - {K8S_REGENERATE_URLS}\n",
            "",
            "Deployment/extractor: container worker: AERIE_ENGINE=sglang without AERIE_REGENERATE_URLS",
        ),
        Break(
            "the generation server reachable from any pod",
            "base/network-policy.yaml",
            "      app.kubernetes.io/component: generate\n",
            "      app.kubernetes.io/component: nothing\n",
            "pods of component 'generate' are reachable from any pod",
            batch="a",
        ),
    ]
]


def k8s_problems(copy) -> list[str]:
    return check_k8s(copy.root)


@pytest.mark.parametrize("broken,edits", with_batches(K8S_BREAKS))
def test_k8s_check_reports_a_broken_manifest(findings, broken, edits):
    problems = findings(k8s_problems, edits)
    assert any(broken.expected in p for p in problems), f"{broken.what}: expected {broken.expected!r} in {problems}"


def test_k8s_check_reports_a_missing_probe(deploy_copy):
    """Schema-valid but probe-less: the check itself, not the schema, must catch it."""
    text = (deploy_copy.root / "k8s" / "base" / "extractor.yaml").read_text()
    start, end = text.index("          readinessProbe:"), text.index("          livenessProbe:")
    (deploy_copy.root / "k8s" / "base" / "extractor.yaml").write_text(text[:start] + text[end:])
    assert any("container worker: no readinessProbe" in p for p in check_k8s(deploy_copy.root))


def test_k8s_check_reports_no_overlay(deploy_copy):
    shutil.rmtree(deploy_copy.root / "k8s" / "overlays")
    assert any("no overlay with a kustomization.yaml" in p for p in check_k8s(deploy_copy.root))


def test_minios_claim_holds_the_100m_tokens_the_guide_sizes():
    """Issue 37, finding 9: MinIO's claim (4 Ti) was below the guide's own figure for 100 M tokens
    at H = 7168. The claim each overlay renders holds the guide's bytes per token x 100 M."""
    import re

    guide = (REPO / "docs" / "deploy.md").read_text()
    per_token = int(re.search(r"= ([\d,]+) B ≈ \d+ KB per token", guide).group(1).replace(",", ""))
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
    for overlay in overlays():
        minio = next(
            r for r in kustomize_build(overlay) if r["kind"] == "StatefulSet" and r["metadata"]["name"] == "minio"
        )
        size = minio["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"]
        number, unit = re.fullmatch(r"(\d+)([KMGTP]i)", size).groups()
        assert int(number) * units[unit] >= per_token * 100_000_000, f"{overlay.name}: MinIO's claim {size}"
