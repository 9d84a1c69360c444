"""No container runs as root: every service of every compose profile and every container of every k8s
workload (overlays and components) runs as a non-zero uid, or is the one named exception below.

Compose: a pulled image's own USER cannot be read without Docker, so a pulled service sets `user`; a
service built here runs its Dockerfile's last USER. k8s: the kubelet enforces `runAsNonRoot` with a
numeric `runAsUser`. MinIO as uid 1000 needs its data folder to be 1000's (a new Docker volume is
root's): compose's `minio-data-owner` gives it, the one root container, confined; its script is run
here for real, with only the capabilities compose leaves it, on a folder laid out as a root MinIO
left it, and uid 1000 can write there afterwards, not before.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from scripts.deploy_checks.compose import ROOT_CAPABILITIES, Project, check_compose, unescape
from scripts.deploy_checks.dockerfiles import dockerfile_instructions
from scripts.deploy_checks.k8s import check_k8s, kustomize_build, overlays
from tests.deploy.breaks import Break, with_batches
from tests.deploy.test_k8s import _component_overlay

# The services allowed to run as root, and why: each is checked to be confined.
ROOT_EXCEPTIONS = {
    "minio-data-owner": "gives MinIO's data volume to uid 1000 before MinIO starts (a new Docker volume is root's)",
}
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob", "ScaledJob")


def _uid(service: dict) -> str:
    """The uid a rendered compose service runs as: its `user`, else its Dockerfile's last USER."""
    if service.get("user"):
        return str(service["user"]).split(":")[0]
    build = service.get("build")
    assert build, "a pulled image without `user`: its own USER cannot be read here"
    text = (Path(build["context"]) / build.get("dockerfile", "Dockerfile")).read_text()
    users = [c.value[0] for c in dockerfile_instructions(text) if c.cmd == "USER"]
    assert users, f"{build}: no USER"
    return users[-1].split(":")[0]


def test_every_service_of_every_compose_profile_runs_as_a_non_root_uid():
    project = Project()
    profiles = sorted({p for s in project.render()["services"].values() for p in s.get("profiles", [])})
    assert {"capture", "serve", "regenerate", "train", "monitoring", "tools"} <= set(profiles)
    seen = {}
    for profile in [None, *profiles]:
        for name, service in project.render(profile)["services"].items():
            seen[name] = service
            uid = _uid(service)
            assert uid.isdigit(), f"{name} (profile {profile}): user {uid!r} is not a numeric uid"
            if name in ROOT_EXCEPTIONS:
                continue
            assert int(uid) > 0, f"{name} (profile {profile}) runs as root"
    assert {"minio", "flower", "redis", "mc", "minio-init", "trainer", "extractor"} <= set(seen)
    for name in ROOT_EXCEPTIONS:
        s = seen[name]
        assert s["network_mode"] == "none" and s["cap_drop"] == ["ALL"] and s.get("restart") in (None, "no")
        assert set(s["cap_add"]) <= ROOT_CAPABILITIES and s["read_only"] is True
        assert "no-new-privileges:true" in s["security_opt"]
    # the owner it gives MinIO's volume is the uid MinIO runs as, on the same source
    owner, minio = seen["minio-data-owner"], seen["minio"]
    script = unescape(owner["entrypoint"][2])
    assert re.findall(r"chown -R (\d+:\d+) /data", script) == [minio["user"]], script
    assert [v["source"] for v in owner["volumes"]] == [v["source"] for v in minio["volumes"]]
    assert minio["depends_on"]["minio-data-owner"]["condition"] == "service_completed_successfully"


def _as(uid: int, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv], capture_output=True, text=True
    )


def test_the_data_owner_script_makes_minios_folder_writable_with_only_its_capabilities():
    if os.geteuid() != 0:  # the test command (CI) runs as root: there this check is never lost silently
        reason = "changing owners needs root"
        if os.environ.get("AERIE_REQUIRE_SGLANG"):
            pytest.fail(f"the test command runs as root, this run does not: {reason}")
        pytest.skip(reason)
    owner = Project().render()["services"]["minio-data-owner"]
    caps = ",".join(f"+{c.lower()}" for c in owner["cap_add"])
    top = Path(tempfile.mkdtemp(prefix="aerie-minio-"))  # under /tmp: uid 1000 must reach it
    try:
        top.chmod(0o755)
        data = top / "data"
        (data / "bucket" / "obj").mkdir(parents=True)  # what a root MinIO left: root's, one folder private
        (data / "bucket" / "obj" / "xl.meta").write_bytes(b"x")
        (data / "bucket").chmod(0o700)
        os.chown(data / "bucket" / "obj", 4242, 4242)
        assert _as(1000, "touch", str(data / "new")).returncode != 0, "uid 1000 could write a root folder"

        script = unescape(owner["entrypoint"][2]).replace("/data", str(data))
        # as Docker starts it: uid 0 with every capability dropped but cap_add, no new privileges
        run = ["setpriv", f"--bounding-set=-all,{caps}", f"--inh-caps=-all,{caps}", "--no-new-privs"]
        out = subprocess.run([*run, "sh", "-c", script], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        for path in (data / "new", data / "bucket" / "obj" / "part.1"):
            wrote = _as(1000, "touch", str(path))
            assert wrote.returncode == 0, f"uid 1000 cannot write {path}: {wrote.stderr}"
        assert _as(1000, "cat", str(data / "bucket" / "obj" / "xl.meta")).stdout == "x"

        # once the folder is 1000's, a later `up` changes nothing (no walk of every object)
        os.chown(data / "new", 4242, 4242)
        out = subprocess.run([*run, "sh", "-c", script], capture_output=True, text=True)
        assert out.returncode == 0 and (data / "new").stat().st_uid == 4242
    finally:
        shutil.rmtree(top)


def _rendered_workloads(tmp_path: Path) -> dict[str, list[dict]]:
    renders = {overlay.name: kustomize_build(overlay) for overlay in overlays()}
    renders["components: keda, serve"] = kustomize_build(
        _component_overlay(tmp_path / "serve", ["keda", "serve"], ["DRAFTER=d", "CAPTURE_LAYER_IDS=1 14 26"])
    )
    renders["components: hpa"] = kustomize_build(
        _component_overlay(tmp_path / "hpa", ["hpa"], ["CAPTURE_LAYER_IDS=1 14 26"])
    )
    return {label: [r for r in resources if r["kind"] in WORKLOADS] for label, resources in renders.items()}


def _pod_spec(r: dict) -> dict:
    spec = r["spec"]
    if r["kind"] == "ScaledJob":
        spec = spec["jobTargetRef"]
    elif r["kind"] == "CronJob":
        spec = spec["jobTemplate"]["spec"]
    return spec["template"]["spec"]


def test_every_container_of_every_k8s_workload_runs_as_a_non_root_uid(tmp_path):
    names = set()
    for label, workloads in _rendered_workloads(tmp_path).items():
        for r in workloads:
            pod = _pod_spec(r)
            for c in [*(pod.get("initContainers") or []), *pod["containers"]]:
                at = f"{label}: {r['kind']}/{r['metadata']['name']} {c['name']}"
                sc = {**(pod.get("securityContext") or {}), **(c.get("securityContext") or {})}
                assert sc.get("runAsNonRoot") is True, f"{at}: runAsNonRoot is not set"
                assert isinstance(sc.get("runAsUser"), int) and sc["runAsUser"] > 0, f"{at}: runAsUser {sc}"
                names.add(f"{r['kind']}/{r['metadata']['name']}/{c['name']}")
    for expected in ("StatefulSet/minio/minio", "StatefulSet/redis/redis", "Job/minio-init/minio-init"):
        assert expected in names, sorted(names)
    assert any(n.startswith("ScaledJob/extractor/") for n in names)
    assert "Deployment/inference/pull-drafter" in names  # the serve component's init container


ROOT_BREAKS = [
    Break(
        "compose: MinIO without a user",
        "docker-compose.yml",
        '    user: "1000:1000"\n    restart: unless-stopped\n    stop_grace_period: 30s\n    logging: *logging\n'
        '    command: ["server"',
        '    restart: unless-stopped\n    stop_grace_period: 30s\n    logging: *logging\n    command: ["server"',
        "services.minio: no `user`: a pulled image may run as root",
        batch="compose",
    ),
    Break(
        "compose: flower as root",
        "docker-compose.yml",
        'user: "1000:1000"   # the image\'s flower user',
        'user: "0:0"   # the image\'s flower user',
        'services.flower: runs as root without restart: "no", network_mode: none, cap_drop: [ALL]',
        batch="compose",
    ),
    Break(
        "compose: a named user",
        "docker-compose.yml",
        'user: "999:999"',
        "user: redis",
        "services.redis: user 'redis' is not numeric",
        batch="compose",
    ),
    Break(
        "compose: the root exception given the network",
        "docker-compose.yml",
        "    network_mode: none\n",
        "",
        "services.minio-data-owner: runs as root without network_mode: none",
        batch="compose",
    ),
    Break(
        "k8s: MinIO's pod without runAsNonRoot",
        "k8s/base/minio.yaml",
        "        runAsNonRoot: true\n        runAsUser: 1000\n",
        "",
        "StatefulSet/minio: container minio: may run as root (runAsNonRoot is not true; runAsUser is None",
        batch="k8s",
    ),
    Break(
        "k8s: a container of a non-root pod set to root",
        "k8s/base/redis.yaml",
        "          securityContext:\n            allowPrivilegeEscalation: false\n",
        "          securityContext:\n            runAsUser: 0\n            allowPrivilegeEscalation: false\n",
        "StatefulSet/redis: container redis: may run as root (runAsUser is 0, not a non-zero uid)",
        batch="k8s",
    ),
]


def _problems(copy) -> list[str]:
    return check_compose(Project(copy.root / "docker-compose.yml", copy.root / ".env.example")) + check_k8s(copy.root)


@pytest.mark.parametrize("broken,edits", with_batches(ROOT_BREAKS))
def test_the_deploy_check_reports_a_container_that_may_run_as_root(findings, broken, edits):
    problems = findings(_problems, edits)
    assert any(broken.expected in p for p in problems), f"{broken.what}: expected {broken.expected!r} in {problems}"
