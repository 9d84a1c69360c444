"""SGLang's JIT caches in the inference image (its ENV) lie on the cache volume that compose and every
k8s SGLang Deployment mount, so Triton's and inductor's kernels survive a recreate."""

from __future__ import annotations

from pathlib import PurePosixPath

from scripts.deploy_checks.dockerfiles import dockerfile_instructions
from scripts.deploy_checks.k8s import kustomize_build
from tests.services import REPO

CACHE_VARIABLES = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


def image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for c in dockerfile_instructions((REPO / "services/inference/Dockerfile").read_text()):
        if c.cmd == "ENV":
            env |= dict(zip(c.value[0::2], c.value[1::2]))
    return env


def _under(path: str, mounts: list[str]) -> bool:
    return any(PurePosixPath(path).is_relative_to(m) for m in mounts)


def test_triton_and_inductor_caches_lie_on_the_kept_cache_volume(compose_services):
    env = image_env()
    caches = [env.get(name) for name in CACHE_VARIABLES]
    assert all(caches), f"the image sets no {CACHE_VARIABLES}: Triton/inductor compile into folders no volume keeps"
    for name in ("inference-capture", "inference-serve", "inference-generate"):
        service = compose_services[name]
        kept = [
            v["target"] for v in service["volumes"] if v.get("type") == "volume" and v.get("source") == "sglang-cache"
        ]
        assert all(_under(c, kept) for c in caches), (name, caches, kept)
        assert not set(CACHE_VARIABLES) & set(service.get("environment") or {}), f"{name} overrides the image's caches"
    for overlay in ("single-host", "multi-node"):
        for r in kustomize_build(REPO / "k8s/overlays" / overlay):
            if r["kind"] != "Deployment" or r["metadata"]["name"] not in ("inference", "generate"):
                continue
            pod = r["spec"]["template"]["spec"]
            (sglang,) = pod["containers"]
            volumes = {v["name"]: v for v in pod["volumes"]}
            kept = [
                m["mountPath"]
                for m in sglang["volumeMounts"]
                if m["name"] == "sglang-cache"  # a claim, or (multi-node) a per-pod emptyDir on disk
                and ("persistentVolumeClaim" in volumes[m["name"]] or "emptyDir" in volumes[m["name"]])
            ]
            assert all(_under(c, kept) for c in caches), (overlay, r["metadata"]["name"], caches, kept)
