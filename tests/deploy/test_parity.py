"""compose and Kubernetes run their SGLang servers and workers alike (scripts/deploy_checks/parity.py):
none differs on the real files; a setting compose gives that an overlay lacks or sets otherwise, and
a launch flag on one side only, are reported."""

from __future__ import annotations

from scripts.deploy_checks.parity import check_parity


def test_compose_and_k8s_set_every_engine_and_plugin_setting_alike():
    assert check_parity() == []


def test_a_setting_or_flag_on_one_platform_only_is_reported(deploy_copy):
    deploy_copy.edit("k8s/base/kustomization.yaml", "      - NCCL_IB_DISABLE=0\n", "")
    deploy_copy.edit(
        "k8s/base/kustomization.yaml", "      - AERIE_ENGINE_CONCURRENCY=8", "      - AERIE_ENGINE_CONCURRENCY=4"
    )
    deploy_copy.edit("docker-compose.yml", '          --max-running-requests "$${GENERATE_MAX_RUNNING}" \\\n', "")
    deploy_copy.edit(
        "k8s/base/trainer.yaml",
        "            - name: AERIE_TRAIN_SHARDING",
        "            - name: AERIE_TRAIN_SHARDING_X",
    )
    deploy_copy.edit("docker-compose.yml", '    user: "999:999"\n', "")
    problems = check_parity(deploy_copy.root)
    for expected in [
        "single-host: Deployment/inference (compose: inference-capture): NCCL_IB_DISABLE is set in compose ('0'), not here",
        "single-host: Deployment/extractor (compose: extractor): AERIE_ENGINE_CONCURRENCY='4' here, '8' in compose",
        "multi-node: Deployment/generate (compose: inference-generate): passes --max-running-requests, compose's command does not",
        "single-host: Deployment/trainer (compose: trainer): AERIE_TRAIN_SHARDING is set in compose ('auto'), not here",
        "single-host: StatefulSet/redis runs as 999:999, compose's redis as the image default (root)",
    ]:
        assert any(expected in p for p in problems), f"{expected!r} not in {problems}"
