"""The store layout: every object key aerie reads or writes is built here, nowhere else.

```
datasets/<name>.jsonl
runs/<run>/run.json
runs/<run>/tokens/<shard>.safetensors (+ .json record)
runs/<run>/hidden/<shard>.safetensors (+ .json record)
runs/<run>/rejects/<part>.jsonl
drafters/<name>/<version>/{config.json,model.safetensors,aerie.json}
drafters/<name>/latest                    (text: the latest version)
checkpoints/<train-id>/step-<n>/...  and  checkpoints/<train-id>/latest.json
```
"""

from __future__ import annotations


def dataset(name: str) -> str:
    return f"datasets/{name}" if name.endswith(".jsonl") else f"datasets/{name}.jsonl"


def run_prefix(run: str) -> str:
    return f"runs/{run}/"


def run_spec(run: str) -> str:
    return f"runs/{run}/run.json"


def shard_name(index: int) -> str:
    return f"{index:06d}"


def shard(run: str, kind: str, name: str) -> str:
    assert kind in ("tokens", "hidden"), kind
    return f"runs/{run}/{kind}/{name}.safetensors"


def shard_record(run: str, kind: str, name: str) -> str:
    assert kind in ("tokens", "hidden"), kind
    return f"runs/{run}/{kind}/{name}.json"


def shards_prefix(run: str, kind: str) -> str:
    return f"runs/{run}/{kind}/"


def shard_failure(run: str, name: str) -> str:
    """A shard's extraction that failed for good (removed when a later attempt succeeds)."""
    return f"runs/{run}/failed/{name}.json"


def failures_prefix(run: str) -> str:
    return f"runs/{run}/failed/"


def rejects(run: str, part: str) -> str:
    return f"runs/{run}/rejects/{part}.jsonl"


def rejects_prefix(run: str) -> str:
    return f"runs/{run}/rejects/"


def drafter_prefix(name: str, version: str) -> str:
    return f"drafters/{name}/{version}/"


def drafter_latest(name: str) -> str:
    return f"drafters/{name}/latest"


def checkpoint_prefix(train_id: str, step: int) -> str:
    return f"checkpoints/{train_id}/step-{step:08d}/"


def checkpoint_latest(train_id: str) -> str:
    return f"checkpoints/{train_id}/latest.json"
