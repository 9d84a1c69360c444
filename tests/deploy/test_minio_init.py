"""scripts/minio_init.sh against a faithful fake of `mc` and MinIO's admin API (tests/deploy/fake_mc.py:
neither is packaged on PyPI or Debian). The script runs with nothing but `mc` on its PATH, as in
an image without grep or cat, on every `up`, and leaves the application key limited to its bucket."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.services import REPO

SCRIPT = REPO / "scripts" / "minio_init.sh"
ENV = {
    "MINIO_URL": "http://minio:9000",
    "MINIO_ROOT_USER": "aerie-admin",
    "MINIO_ROOT_PASSWORD": "root-secret",
    "BUCKET": "aerie",
    "APP_ACCESS_KEY": "aerie-app",
    "APP_SECRET_KEY": "app-secret",
}
# What aerie's store and the plugin's s3 sink call, and nothing more (issue 16: no s3:*).
BUCKET_ACTIONS = {"s3:GetBucketLocation", "s3:ListBucket", "s3:ListBucketMultipartUploads"}
OBJECT_ACTIONS = {
    "s3:GetObject",
    "s3:PutObject",
    "s3:DeleteObject",
    "s3:AbortMultipartUpload",
    "s3:ListMultipartUploadParts",
}


class FakeMinio:
    def __init__(self, root: Path):
        self.root, self.state = root, root / "server.json"
        self.state.write_text(
            json.dumps(
                {
                    "url": ENV["MINIO_URL"],
                    "root": [ENV["MINIO_ROOT_USER"], ENV["MINIO_ROOT_PASSWORD"]],
                    "buckets": [],
                    "policies": {},
                    "users": {},
                }
            )
        )
        self.bin = root / "bin"
        self.bin.mkdir()
        (self.bin / "mc").write_text(
            f"#!{sys.executable}\nimport sys; sys.path.insert(0, {str(REPO)!r})\n"
            "from tests.deploy.fake_mc import main; main(sys.argv[1:])\n"
        )
        (self.bin / "mc").chmod(0o755)

    def init(self, script: Path = SCRIPT, **env: str) -> subprocess.CompletedProcess:
        """The script as the container runs it: /bin/sh, PATH holding `mc` and nothing else."""
        full = {
            **ENV,
            "PATH": str(self.bin),
            "HOME": str(self.root),
            "TMPDIR": str(self.root),
            "FAKE_MC_STATE": str(self.state),
            "MC_CONFIG_DIR": str(self.root / "mc"),
            **env,
        }
        return subprocess.run(["/bin/sh", str(script)], env=full, capture_output=True, text=True, timeout=60)

    def server(self) -> dict:
        return json.loads(self.state.read_text())

    def calls(self) -> list[list[str]]:
        return [json.loads(line) for line in Path(f"{self.state}.log").read_text().splitlines()]


@pytest.fixture
def minio(tmp_path) -> FakeMinio:
    return FakeMinio(tmp_path)


def test_minio_init_limits_the_app_key_to_its_bucket_on_the_first_up(minio):
    """The documented key is `aerie-app`: the old `grep -q aerie-app` matched mc's `AccessKey:` line,
    so the policy was never attached and every request of the workers got AccessDenied."""
    out = minio.init()
    assert out.returncode == 0, out.stderr
    assert "bucket aerie ready; key aerie-app may list, read, write and delete objects in it only" in out.stdout
    server = minio.server()
    assert server["buckets"] == ["aerie"]
    assert server["users"]["aerie-app"] == {"policies": ["aerie-app"], "secret": "app-secret"}
    statements = server["policies"]["aerie-app"]["Statement"]
    granted = {(a, r) for s in statements if s["Effect"] == "Allow" for a in s["Action"] for r in s["Resource"]}
    assert granted == {(a, "arn:aws:s3:::aerie") for a in BUCKET_ACTIONS} | {
        (a, "arn:aws:s3:::aerie/*") for a in OBJECT_ACTIONS
    }, "least privilege: objects of one bucket, no bucket admin"


def test_minio_init_succeeds_again_on_every_later_up(minio):
    """`docker compose up` and `docker compose run mc` wait for minio-init to complete successfully:
    the second and later runs must too, with the state unchanged."""
    assert minio.init().returncode == 0
    first = minio.server()
    for _ in range(2):
        again = minio.init()
        assert again.returncode == 0, again.stderr
    assert minio.server() == first
    attaches = [c for c in minio.calls() if c[2:5] == ["admin", "policy", "attach"]]
    assert len(attaches) == 3, "attach runs every time: an attached policy is success for mc >= 2024-10-08"


def test_minio_init_rotates_the_app_secret_and_replaces_an_older_policy(minio):
    minio.init()
    server = minio.server()
    server["policies"]["aerie-app"] = {
        "Version": "2012-10-17",
        "Statement": [
            {"Effect": "Allow", "Action": ["s3:*"], "Resource": ["arn:aws:s3:::aerie", "arn:aws:s3:::aerie/*"]}
        ],
    }
    minio.state.write_text(json.dumps(server))
    assert minio.init(APP_SECRET_KEY="rotated").returncode == 0
    server = minio.server()
    assert server["users"]["aerie-app"]["secret"] == "rotated"
    assert not any("s3:*" in s["Action"] for s in server["policies"]["aerie-app"]["Statement"])


def test_minio_init_fails_when_the_policy_does_not_stick(minio):
    out = minio.init(FAKE_MC_DROP_ATTACH="1")
    assert out.returncode == 1
    assert "key aerie-app has policies [] after attaching aerie-app: check the server's IAM" in out.stderr


def test_minio_init_stops_on_wrong_root_credentials_and_on_a_root_app_key(minio):
    out = minio.init(MINIO_ROOT_PASSWORD="wrong")
    assert out.returncode == 1
    assert "mc: <ERROR> Unable to initialize new alias from the provided credentials." in out.stderr
    assert minio.server()["buckets"] == []
    out = minio.init(APP_ACCESS_KEY="aerie-admin")
    assert out.returncode == 64 and "AERIE_S3_ACCESS_KEY equals MINIO_ROOT_USER" in out.stderr
    out = minio.init(BUCKET="")
    assert out.returncode != 0 and "BUCKET" in out.stderr


def test_minio_init_keeps_other_policies_of_the_key(minio):
    """A key an operator also gave another policy reads back as "policyName": "readwrite,aerie-app"."""
    minio.init()
    server = minio.server()
    server["policies"]["readwrite"] = {"Version": "2012-10-17", "Statement": []}
    server["users"]["aerie-app"]["policies"] = ["readwrite", "aerie-app"]
    minio.state.write_text(json.dumps(server))
    out = minio.init()
    assert out.returncode == 0, out.stderr
    assert minio.server()["users"]["aerie-app"]["policies"] == ["readwrite", "aerie-app"]


def test_the_fake_prints_what_mc_prints(minio):
    """The outputs the script reads, as mc RELEASE.2025-04-16T18-13-26Z formats them."""
    minio.init()
    env = {**os.environ, "FAKE_MC_STATE": str(minio.state)}
    mc = [str(minio.bin / "mc"), "--config-dir", str(minio.root / "mc")]
    text = subprocess.run([*mc, "admin", "user", "info", "root", "aerie-app"], env=env, capture_output=True, text=True)
    assert text.stdout == "AccessKey: aerie-app\nStatus: enabled\nPolicyName: aerie-app\nMemberOf: []\n"
    js = subprocess.run(
        [*mc, "admin", "user", "info", "root", "aerie-app", "--json"], env=env, capture_output=True, text=True
    )
    assert js.stdout == (
        '{\n "status": "success",\n "accessKey": "aerie-app",\n "policyName": "aerie-app",\n'
        ' "userStatus": "enabled"\n}\n'
    )
    missing = subprocess.run([*mc, "admin", "user", "info", "root", "nobody"], env=env, capture_output=True, text=True)
    assert missing.returncode == 1 and missing.stderr.startswith("mc: <ERROR> Unable to get user info.")


def test_k8s_minio_init_script_is_the_compose_one():
    assert filecmp.cmp(SCRIPT, REPO / "k8s" / "base" / "minio_init.sh", shallow=False), (
        "k8s/base/minio_init.sh must be a copy of scripts/minio_init.sh: cp scripts/minio_init.sh k8s/base/"
    )


def allowed(policy: dict, action: str, resource: str, prefix: str | None = None) -> bool:
    """IAM's evaluation of an Allow-only policy for one request: an action and resource of a statement
    match (`*` wildcards), and its StringLike condition on s3:prefix (ListBucket's) holds."""
    from fnmatch import fnmatchcase

    for s in policy["Statement"]:
        if s["Effect"] != "Allow" or action not in s["Action"]:
            continue
        if not any(fnmatchcase(resource, r) for r in s["Resource"]):
            continue
        like = s.get("Condition", {}).get("StringLike", {}).get("s3:prefix")
        if like is not None and (prefix is None or not any(fnmatchcase(prefix, p) for p in like)):
            continue
        return True
    return False


CAPTURE = {"CAPTURE_ACCESS_KEY": "aerie-capture", "CAPTURE_SECRET_KEY": "capture-secret"}


def test_minio_init_gives_sglang_a_key_for_its_capture_prefix_only(minio):
    out = minio.init(**CAPTURE)
    assert out.returncode == 0, out.stderr
    assert "key aerie-capture may list, write and delete objects under aerie/capture/ only" in out.stdout
    server = minio.server()
    assert server["users"]["aerie-capture"] == {"policies": ["aerie-capture"], "secret": "capture-secret"}
    assert server["users"]["aerie-app"]["policies"] == ["aerie-app"]
    policy = server["policies"]["aerie-capture"]
    obj = "arn:aws:s3:::aerie/"
    # what the plugin's s3 sink does
    assert allowed(policy, "s3:PutObject", obj + "capture/0123.safetensors")
    assert allowed(policy, "s3:DeleteObject", obj + "capture/0123.safetensors")
    assert allowed(policy, "s3:ListBucket", "arn:aws:s3:::aerie", prefix="capture/")
    # and nothing of aerie's own data, nor another bucket
    for action in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject"):
        for key in ("datasets/chat.jsonl", "runs/r/run.json", "drafters/d/latest", "captured/x", "capture"):
            assert not allowed(policy, action, obj + key), (action, key)
        assert not allowed(policy, action, "arn:aws:s3:::other/capture/x")
    assert not allowed(policy, "s3:ListBucket", "arn:aws:s3:::aerie", prefix="runs/")
    assert not allowed(policy, "s3:ListBucket", "arn:aws:s3:::aerie")
    # the application's key keeps the whole bucket (the extractors fetch and delete captures)
    assert allowed(server["policies"]["aerie-app"], "s3:GetObject", obj + "capture/0123.safetensors")
    again = minio.init(**CAPTURE)  # idempotent, as every later apply
    assert again.returncode == 0, again.stderr


def test_minio_init_refuses_a_capture_key_that_is_not_its_own_or_a_prefix_of_aerie(minio):
    for env, why in [
        ({**CAPTURE, "CAPTURE_ACCESS_KEY": "aerie-app"}, "CAPTURE_ACCESS_KEY must be a key of its own"),
        ({**CAPTURE, "CAPTURE_PREFIX": "runs/"}, "CAPTURE_PREFIX runs/ is not one plain 'name/' segment"),
        ({**CAPTURE, "CAPTURE_PREFIX": "a/b/"}, "CAPTURE_PREFIX a/b/ is not one plain"),
        ({**CAPTURE, "CAPTURE_PREFIX": "../"}, "CAPTURE_PREFIX ../ is not one plain"),
        ({"CAPTURE_ACCESS_KEY": "aerie-capture"}, "CAPTURE_SECRET_KEY is empty"),
    ]:
        out = minio.init(**env)
        assert out.returncode != 0 and why in out.stderr, (env, out.stderr)
    assert "aerie-capture" not in minio.server()["policies"]


def test_k8s_sglang_holds_the_key_minio_init_scopes_to_captures():
    from scripts.deploy_checks.k8s import kustomize_build

    for overlay in ("single-host", "multi-node"):
        rendered = kustomize_build(REPO / "k8s/overlays" / overlay)

        def secret_keys(kind, name):
            r = next(r for r in rendered if r["kind"] == kind and r["metadata"]["name"] == name)
            (c,) = r["spec"]["template"]["spec"]["containers"]
            return {
                e["name"]: e["valueFrom"]["secretKeyRef"]["key"]
                for e in c.get("env") or []
                if "secretKeyRef" in (e.get("valueFrom") or {})
            }

        sglang, init = secret_keys("Deployment", "inference"), secret_keys("Job", "minio-init")
        assert (sglang["AERIE_S3_ACCESS_KEY"], sglang["AERIE_S3_SECRET_KEY"]) == (
            init["CAPTURE_ACCESS_KEY"],
            init["CAPTURE_SECRET_KEY"],
        ), overlay
        assert sglang["AERIE_S3_ACCESS_KEY"] != init["APP_ACCESS_KEY"], "SGLang holds the application's key"
