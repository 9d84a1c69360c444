"""The target's weights are hashed once per host, never cached in the model folder (containers mount
it read-only): concurrent processes wait for the one that hashes (issue 20, item 4)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.deploy.servers import linked_copy
from tests.services import REPO, clean_env

DESCRIBE = (
    "import logging, sys; logging.basicConfig(level=logging.INFO)\n"
    "from aerie.target import describe; print(describe(sys.argv[1]).weights_sha256)"
)


def test_two_processes_hash_the_target_once_and_write_nothing_into_the_model_folder(smollm2_path, tmp_path):
    model = linked_copy(smollm2_path, tmp_path / "model")
    before = sorted(p.name for p in model.iterdir())
    env = clean_env(AERIE_CACHE_DIR=str(tmp_path / "cache"))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", DESCRIBE, str(model)],
            env=env,
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert outs[0][0] == outs[1][0], "both processes must see the same hash"
    hashed = sum("sha256 of 1 weight files" in err for _, err in outs)
    assert hashed == 1, f"the weights were hashed {hashed} times: {outs}"
    assert sorted(p.name for p in model.iterdir()) == before, "nothing may be written into the model folder"
    # a later process (a worker start) only stats the files
    again = subprocess.run(
        [sys.executable, "-c", DESCRIBE, str(model)], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert again.stdout == outs[0][0] and "sha256 of" not in again.stderr
    # a changed weight file (size or mtime) is hashed again
    weights = model / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a hard link: restored below
    try:
        changed = subprocess.run(
            [sys.executable, "-c", DESCRIBE, str(model)], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
        )
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert "sha256 of 1 weight files" in changed.stderr and changed.stdout == outs[0][0]


def hashes(model, caches: list) -> int:
    """How many of processes started together, each with its cache folder, hashed the weights."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", DESCRIBE, str(model)],
            env=clean_env(AERIE_CACHE_DIR=str(cache)),
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for cache in caches
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return sum("sha256 of 1 weight files" in err for _, err in outs)


def test_compose_workers_hash_the_target_once_per_host(compose_services, smollm2_path, tmp_path):
    """Two containers of one host each have their own filesystem: a cache in it is hashed by each
    (and again after every recreate). The workers' cache folder must be one volume of the host."""
    model = linked_copy(smollm2_path, tmp_path / "model")
    assert hashes(model, [tmp_path / "extractor-layer", tmp_path / "trainer-layer"]) == 2
    volume, sources = tmp_path / "volume", set()
    for service in ("extractor", "trainer"):
        svc = compose_services[service]
        cache = (svc.get("environment") or {}).get("AERIE_CACHE_DIR", "/home/aerie/.cache/aerie")  # the images' ENV
        mounts = [v for v in svc.get("volumes") or [] if v["type"] == "volume" and v["target"] == cache]
        assert mounts, f"{service}: the cache folder {cache} is in the container's own layer"
        sources.add(mounts[0]["source"])
    assert len(sources) == 1, f"extractor and trainer mount different cache volumes: {sources}"
    assert hashes(model, [volume, volume]) == 1
