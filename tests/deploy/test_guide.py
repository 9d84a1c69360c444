"""docs/deploy.md's edits of the deployment files, run as written and read back by the real tools:
the registry and GPU-switch `sed` lines through kustomize, the GPU-split override through Compose."""

from __future__ import annotations

import re
import shutil
import subprocess

from scripts.deploy_checks.compose import Project
from scripts.deploy_checks.k8s import kustomize_build
from tests.services import REPO

GUIDE = (REPO / "docs" / "deploy.md").read_text()


def test_the_guides_registry_and_gpu_switch_edits_render_as_documented(tmp_path):
    edits = [line for line in GUIDE.splitlines() if line.startswith("sed -i") and "k8s/overlays/single-host" in line]
    assert len(edits) == 3, edits  # the registry, the GPUs to the trainer, the GPUs to the generation server
    setup = next(line for line in GUIDE.splitlines() if line.startswith("REGISTRY="))

    def render(folder, *lines):
        shutil.copytree(REPO / "k8s", folder / "k8s")
        for edit in lines:
            subprocess.run(["bash", "-euc", f"{setup}\n{edit}"], cwd=folder, check=True, timeout=60)
        return kustomize_build(folder / "k8s" / "overlays" / "single-host")

    regenerating = render(tmp_path / "generate", edits[0], edits[2])
    assert {r["metadata"]["name"]: r["spec"].get("replicas") for r in regenerating if r["kind"] == "Deployment"} == {
        "inference": 0,
        "generate": 1,
        "trainer": 0,
        "extractor": None,
    }, "the GPUs go to the generation server"
    rendered = render(tmp_path / "train", edits[0], edits[1])
    images = {
        c["image"]
        for r in rendered
        if r["kind"] in ("Deployment", "Job")
        for group in ("initContainers", "containers")
        for c in r["spec"]["template"]["spec"].get(group) or []
    }
    assert {i for i in images if "/aerie/" in i} == {
        f"registry.example.com/aerie/{s}:0.1.0" for s in ("inference", "extractor", "trainer")
    }
    replicas = {r["metadata"]["name"]: r["spec"].get("replicas") for r in rendered if r["kind"] == "Deployment"}
    assert replicas == {"inference": 0, "generate": 0, "trainer": 1, "extractor": None}, (
        "the GPUs go to the trainer; KEDA keeps its own"
    )


def test_the_guides_gpu_split_gives_each_service_its_own_device_list(tmp_path):
    block = re.search(r"```yaml\n(services:\n.*?)```", GUIDE, re.DOTALL).group(1)
    override = tmp_path / "compose.override.yml"
    override.write_text(block)
    services = Project().render(files=(override,))["services"]
    devices = {
        n: services[n]["deploy"]["resources"]["reservations"]["devices"] for n in ("inference-capture", "trainer")
    }
    assert devices == {
        "inference-capture": [{"capabilities": ["gpu"], "driver": "nvidia", "device_ids": ["0", "1", "2", "3"]}],
        "trainer": [{"capabilities": ["gpu"], "driver": "nvidia", "device_ids": ["4", "5", "6", "7"]}],
    }
