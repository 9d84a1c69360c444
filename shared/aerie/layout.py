"""The store layout: every object key aerie reads or writes is built *and parsed* here, nowhere else.

```
datasets/<name>.jsonl
datasets/sha256/<sha256>/<file name>      a local dataset uploaded by enqueue / aerie run (keyed by content)
runs/<run>/plan.json                        what the user asked of the run (RunPlan; created once, first)
runs/<run>/plan/train/<train-id>.json       a training asked to follow the run (PlannedTraining)
runs/<run>/plan/gates/<gate-id>.json        a planned alignment check's outcome (GateRecord)
runs/<run>/run.json
runs/<run>/conversations/<shard>.jsonl      a regenerated run's input conversations (ingest writes them)
runs/<run>/regenerated/<shard>.jsonl (+ .json record)   the target's answers to them (the regenerate stage)
runs/<run>/tokens/<shard>.safetensors (+ .json record)
runs/<run>/hidden/<shard>.safetensors (+ .json record)
runs/<run>/failed/<shard>.json            a shard whose extraction gave up (ingest.json: the ingest)
runs/<run>/rejects/<part>-n<count>.jsonl  refused records (RejectRecord lines; the count in the name)
runs/<run>/align/<server-id>.json          the run against one serving configuration (aerie align)
runs/<run>/training/<train-id>.json       where a training job on the run stands (TrainProgress)
drafters/<name>/<version>/{config.json,model.safetensors,aerie.json}
drafters/<name>/<version>/bench/<id>.json  `aerie bench --sweep` of that version (BenchSweep)
drafters/<name>/latest                    (text: the latest version)
checkpoints/<train-id>/step-<n>/...  and  checkpoints/<train-id>/latest.json
checkpoints/<train-id>/best/model.safetensors   the measured step that accepted best (--publish-checkpoint best)
checkpoints/<train-id>/tensorboard/<events file>   the training's TensorBoard event files
checkpoints/<train-id>/failed.json        a training job that gave up
probes/<token>                            `aerie prepare-store`'s round trip (deleted at once)
<capture prefix><32 hex>.safetensors      an SGLang capture in the s3 sink (claimed: read and deleted at once)
```

Names inside keys (runs, shards, drafters, versions, train ids) are checked by the contracts'
name pattern before they get here; `_check_key` in the store refuses `..` and absolute keys.
Names parsed or checked here match whole (`fullmatch`: a `$` would let a trailing newline in).
"""

from __future__ import annotations

import re

SHARD_KINDS = ("tokens", "hidden")
SHARD_NAME = r"^[0-9]{6}$"  # what shard_name makes; the contracts refuse any other shard in a message
LINEAGE_FILE = "aerie.json"  # a drafter's lineage, written last: its presence means "published"
DRAFTER_FILES = ("config.json", "model.safetensors")  # what SGLang loads, written before the lineage
_SHARD_NAME = re.compile(SHARD_NAME)
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SERVER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # the contracts' name pattern
_GATE_ID = re.compile(r"[0-9a-f]{16}")


def dataset(name: str) -> str:
    return f"datasets/{name}" if name.endswith(".jsonl") else f"datasets/{name}.jsonl"


def dataset_upload(sha256: str, filename: str) -> str:
    """An uploaded local file, keyed by its content: two different `chat.jsonl` never meet, the
    same file uploaded twice is one object. The file's own name is kept (cleaned) for people."""
    if not _SHA256.fullmatch(sha256):
        raise ValueError(f"{sha256!r} is not a sha256 hex digest")
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", filename.rsplit("/", 1)[-1]).strip(".-")[:100] or "dataset"
    return f"datasets/sha256/{sha256}/{name}"


def run_prefix(run: str) -> str:
    return f"runs/{run}/"


def run_spec(run: str) -> str:
    return f"runs/{run}/run.json"


# --- the run's plan (aerie.controller) ----------------------------------------------------
def run_plan(run: str) -> str:
    return f"runs/{run}/plan.json"


def planned_training(run: str, train_id: str) -> str:
    """A training asked to follow `run`, named by its train id."""
    if not _SERVER_ID.fullmatch(train_id):
        raise ValueError(f"train id {train_id!r} is not a valid name")
    return f"runs/{run}/plan/train/{train_id}.json"


def planned_trainings_prefix(run: str) -> str:
    return f"runs/{run}/plan/train/"


def planned_training_ids(run: str, keys: list[str]) -> list[str]:
    """Train ids of the planned trainings among `keys` (a listing of the run's plan/train folder), sorted."""
    return _json_names(planned_trainings_prefix(run), keys)


def gate(run: str, gate_id: str) -> str:
    """The outcome of a planned alignment check of `run` (gate ids are hex digests)."""
    if not _GATE_ID.fullmatch(gate_id):
        raise ValueError(f"gate id {gate_id!r} is not 16 hex digits")
    return f"runs/{run}/plan/gates/{gate_id}.json"


def _json_names(root: str, keys: list[str]) -> list[str]:
    """Names of the `<name>.json` objects directly under `root` among `keys`, valid names only, sorted."""
    names = set()
    for key in keys:
        rest = key[len(root) :] if key.startswith(root) else ""
        if "/" not in rest and rest.endswith(".json") and _SERVER_ID.fullmatch(rest[: -len(".json")]):
            names.add(rest[: -len(".json")])
    return sorted(names)


# --- shards -------------------------------------------------------------------------------
def shard_name(index: int) -> str:
    return f"{index:06d}"


def shard(run: str, kind: str, name: str) -> str:
    assert kind in SHARD_KINDS, kind
    return f"runs/{run}/{kind}/{name}.safetensors"


def shard_record(run: str, kind: str, name: str) -> str:
    assert kind in SHARD_KINDS, kind
    return f"runs/{run}/{kind}/{name}.json"


def shards_prefix(run: str, kind: str) -> str:
    return f"runs/{run}/{kind}/"


def _checked(name: str) -> str:
    if not isinstance(name, str) or not _SHARD_NAME.fullmatch(name):
        raise ValueError(f"shard name {name!r} is not six digits")
    return name


# --- regeneration: conversations in, the target's answers out -----------------------------
def conversations(run: str, name: str) -> str:
    """A shard of a regenerated run's input conversations (JSONL: line, source, messages)."""
    return f"runs/{run}/conversations/{_checked(name)}.jsonl"


def conversations_prefix(run: str) -> str:
    return f"runs/{run}/conversations/"


def conversation_names(keys: list[str]) -> list[str]:
    """Shard names of the `<name>.jsonl` conversation objects among `keys`, sorted."""
    return sorted(_shard_keys(keys, ".jsonl"))


def regenerated(run: str, name: str) -> str:
    """The target's answers to one conversation shard (JSONL, the regenerated conversations)."""
    return f"runs/{run}/regenerated/{_checked(name)}.jsonl"


def regenerated_record(run: str, name: str) -> str:
    """Written after `regenerated(run, name)`: its presence means the shard's answers are stored."""
    return f"runs/{run}/regenerated/{_checked(name)}.json"


def regenerated_prefix(run: str) -> str:
    return f"runs/{run}/regenerated/"


def shard_failure(run: str, name: str) -> str:
    """A shard's extraction that failed for good (removed when a later attempt succeeds)."""
    return f"runs/{run}/failed/{name}.json"


def ingest_failure(run: str) -> str:
    """An ingest that failed for good (not a shard name: shard names are six digits)."""
    return f"runs/{run}/failed/ingest.json"


def failures_prefix(run: str) -> str:
    return f"runs/{run}/failed/"


def record_names(keys: list[str]) -> list[str]:
    """Shard names of the `<name>.json` records among `keys` (a listing of one shard folder), sorted.

    Objects (`.safetensors`), temporary files and anything not named like a shard are left out."""
    return sorted(_shard_keys(keys, ".json"))


def shard_objects(keys: list[str]) -> list[str]:
    """The shard objects (`<name>.safetensors`) among `keys`."""
    return list(_shard_keys(keys, ".safetensors").values())


def _shard_keys(keys: list[str], suffix: str) -> dict[str, str]:
    """{shard name: key} for the keys whose last part is `<six digits><suffix>`, in listing order."""
    found: dict[str, str] = {}
    for key in keys:
        base = key.rsplit("/", 1)[-1]
        if base.endswith(suffix) and _SHARD_NAME.fullmatch(base[: -len(suffix)]):
            found.setdefault(base[: -len(suffix)], key)
    return found


_REJECTS_COUNT = re.compile(r"-n([0-9]+)\.jsonl")


def rejects(run: str, part: str, count: int) -> str:
    """A part of ingest's refused records, `count` lines: the name carries the count, so a run's
    status counts its rejects from a listing, never reading the parts (aerie.runs.run_status)."""
    return f"runs/{run}/rejects/{part}-n{int(count)}.jsonl"


def regenerate_rejects(run: str, name: str, count: int) -> str:
    """The conversations of one shard the regenerate stage refused (beside ingest's parts)."""
    return f"runs/{run}/rejects/{_checked(name)}-regenerate-n{int(count)}.jsonl"


def regenerate_rejects_prefix(run: str, name: str) -> str:
    """What a shard's regenerate rejects start with, whatever their count (a retry replaces them)."""
    return f"runs/{run}/rejects/{_checked(name)}-regenerate-"


def rejects_prefix(run: str) -> str:
    return f"runs/{run}/rejects/"


def rejects_count(key: str) -> int | None:
    """The line count a rejects key carries (`rejects`, `regenerate_rejects`); None for a key
    without one (written by an older aerie: its lines must be counted)."""
    m = _REJECTS_COUNT.search(key.rsplit("/", 1)[-1])
    return int(m.group(1)) if m and key.endswith(m.group(0)) else None


# --- alignment reports --------------------------------------------------------------------
def alignment_report(run: str, server_id: str) -> str:
    """The alignment check of a run against one serving configuration (its server id)."""
    if not _SERVER_ID.fullmatch(server_id):
        raise ValueError(f"server id {server_id!r} is not a valid name")
    return f"runs/{run}/align/{server_id}.json"


def alignments_prefix(run: str) -> str:
    return f"runs/{run}/align/"


def alignment_server_ids(run: str, keys: list[str]) -> list[str]:
    """Server ids of the alignment reports among `keys` (a listing of the run's align folder), sorted."""
    return _json_names(alignments_prefix(run), keys)


# --- training progress --------------------------------------------------------------------
def train_progress(run: str, train_id: str) -> str:
    """Where a training job that reads `run` records how far it is (one per run it reads)."""
    if not _SERVER_ID.fullmatch(train_id):
        raise ValueError(f"train id {train_id!r} is not a valid name")
    return f"runs/{run}/training/{train_id}.json"


def train_progress_prefix(run: str) -> str:
    return f"runs/{run}/training/"


def train_progress_ids(run: str, keys: list[str]) -> list[str]:
    """Train ids of the progress records among `keys` (a listing of the run's training folder), sorted."""
    return _json_names(train_progress_prefix(run), keys)


# --- captures (the SGLang plugin's s3 sink) ----------------------------------------------
CAPTURE_ID = re.compile(r"[0-9a-f]{32}")  # the plugin's capture ids (uuid4 hex)
CAPTURE_SUFFIX = ".safetensors"
_PREFIX = re.compile(r"(?:[A-Za-z0-9_-][A-Za-z0-9._-]*/)+")
_AERIE_ROOTS = ("datasets/", "runs/", "drafters/", "checkpoints/", "probes/")


def check_capture_prefix(prefix: object) -> str:
    """A capture prefix a server may use: relative, '/'-terminated, plain segments, and outside
    aerie's own folders (so no capture key can ever name a run's, a drafter's or a dataset's object)."""
    if (
        not isinstance(prefix, str)
        or not _PREFIX.fullmatch(prefix)
        or ".." in prefix.split("/")
        or prefix.startswith(_AERIE_ROOTS)
    ):
        raise ValueError(
            f"capture prefix {prefix!r} is not a relative 'name/' prefix outside {', '.join(_AERIE_ROOTS)}"
        )
    return prefix


def capture_key(prefix: str, capture_id: str) -> str:
    """The one key a capture of this id may have under `prefix`."""
    if not CAPTURE_ID.fullmatch(capture_id):
        raise ValueError(f"capture id {capture_id!r} is not 32 hex digits")
    return f"{check_capture_prefix(prefix)}{capture_id}{CAPTURE_SUFFIX}"


# --- drafters -----------------------------------------------------------------------------
def drafter_prefix(name: str, version: str) -> str:
    return f"drafters/{name}/{version}/"


def drafter_file(name: str, version: str, filename: str) -> str:
    """One file of a published drafter; only the files a drafter is made of."""
    if filename not in (*DRAFTER_FILES, LINEAGE_FILE):
        raise ValueError(f"{filename!r} is not a drafter file ({', '.join((*DRAFTER_FILES, LINEAGE_FILE))})")
    return f"drafters/{name}/{version}/{filename}"


def drafter_lineage(name: str, version: str) -> str:
    return drafter_file(name, version, LINEAGE_FILE)


def drafter_bench(name: str, version: str, bench_id: str) -> str:
    """A benchmark record of a published drafter, beside (never inside) its lineage."""
    if not _SERVER_ID.fullmatch(bench_id):
        raise ValueError(f"bench id {bench_id!r} is not a valid name")
    return f"drafters/{name}/{version}/bench/{bench_id}.json"


def drafter_bench_prefix(name: str, version: str) -> str:
    return f"drafters/{name}/{version}/bench/"


def drafter_latest(name: str) -> str:
    return f"drafters/{name}/latest"


# --- checkpoints --------------------------------------------------------------------------
def checkpoints_prefix(train_id: str) -> str:
    return f"checkpoints/{train_id}/"


def checkpoint_prefix(train_id: str, step: int) -> str:
    return f"checkpoints/{train_id}/step-{step:08d}/"


def checkpoint_latest(train_id: str) -> str:
    return f"checkpoints/{train_id}/latest.json"


def checkpoint_best(train_id: str) -> str:
    """The drafter weights of the measured step that accepted best (`publish_checkpoint: best`);
    outside the `step-<n>/` folders, so pruning keeps it."""
    return f"checkpoints/{train_id}/best/model.safetensors"


def checkpoint_steps(train_id: str, keys: list[str]) -> list[int]:
    """The steps that have objects under `checkpoints/<train_id>/step-<n>/` among `keys`, sorted."""
    root = checkpoints_prefix(train_id)
    steps = set()
    for key in keys:
        if key.startswith(root):
            m = _STEP_DIR.fullmatch(key[len(root) :].split("/", 1)[0])
            if m:
                steps.add(int(m.group(1)))
    return sorted(steps)


def train_logs_prefix(train_id: str) -> str:
    """The training's TensorBoard event files (`tensorboard --logdir` on a copy of this folder)."""
    return f"checkpoints/{train_id}/tensorboard/"


def train_log(train_id: str, filename: str) -> str:
    if "/" in filename or not filename.startswith("events.out.tfevents."):
        raise ValueError(f"{filename!r} is not a TensorBoard events file name")
    return f"checkpoints/{train_id}/tensorboard/{filename}"


def train_failure(train_id: str) -> str:
    """A training job that failed for good (removed when a later attempt succeeds)."""
    return f"checkpoints/{train_id}/failed.json"


def probe(token: str) -> str:
    """A short-lived object that checks the key may write, read, list and delete (aerie prepare-store)."""
    return f"probes/{token}"
