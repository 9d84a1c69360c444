"""One small drafter trained in the pipeline, shared by the tests that need a trained one.

Training it takes ~3-5 minutes on 2 CPU cores, so the trainer's own test (trainer/test_train.py)
and the SGLang serving test (test_serve_drafter) use the same one: ShareGPT hidden states (160
conversations, `hidden_run_folder`) -> the `train` stage at `aerie run`'s default size (300 steps,
with its speculative-decoding evaluation before and after) -> published to a filesystem store -> pulled.

It is built once per inputs under the test cache (`<cache>/test-drafters/<key>`), and the key
covers the trainer's and the shared library's source, so a code change always trains anew.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from tests.services import REPO

SOURCES = [REPO / "shared" / "aerie", REPO / "services" / "trainer" / "aerie_trainer"]
DRAFTER = "smol-eagle3"
RUN = "sharegpt"
SIZE = "default"  # `aerie run`'s default size (aerie/recipes/sizes): the same data and training


def train_config():
    from aerie import presets

    return presets.load_size(SIZE).train_config()


@dataclass(frozen=True)
class Trained:
    store_root: Path  # the filesystem store it was trained from and published to
    folder: Path  # the published drafter, pulled (model.safetensors, config.json, aerie.json)
    result: dict  # run_train's summary, plus train_wall_s

    def store(self):
        from aerie.store import FsStore

        return FsStore(self.store_root)


def source_digest() -> str:
    h = hashlib.sha256()
    for root in SOURCES:
        for path in sorted(root.rglob("*.py")):
            h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def trained_drafter(cache_dir: Path, smollm2_path: Path) -> Trained:
    from aerie import presets
    from tests.runs import hidden_run_folder

    size = presets.load_size(SIZE)
    run_folder = hidden_run_folder(
        cache_dir, smollm2_path, records=size.records, max_tokens=size.max_tokens, shard_sequences=16
    )
    key = hashlib.sha256(
        json.dumps([run_folder.name, train_config().model_dump(), source_digest()]).encode()
    ).hexdigest()[:16]
    folder = Path(cache_dir) / "test-drafters" / key
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process training the same drafter: wait for it
        if not (folder / "train.json").is_file():
            _train_into(folder, run_folder, smollm2_path)
    return Trained(folder / "store", folder / "pulled", json.loads((folder / "train.json").read_text()))


def _train_into(folder: Path, run_folder: Path, smollm2_path: Path) -> None:
    from aerie import stages
    from aerie.contracts import TrainRequest
    from aerie.settings import Settings
    from aerie.store import FsStore
    from tests.runs import upload_run

    shutil.rmtree(folder, ignore_errors=True)
    store = FsStore(folder / "store")
    upload_run(store, run_folder, RUN)
    request = TrainRequest(runs=[RUN], drafter=DRAFTER, model=str(smollm2_path), config=train_config())
    started = time.monotonic()
    # Settings(...), not .load(): the test command sets AERIE_TEST_* variables
    result = stages.train(store, Settings(store=f"file://{store.root}"), request).model_dump(mode="json")
    result["train_wall_s"] = time.monotonic() - started
    stages.pull(store, DRAFTER, folder / "pulled")
    (folder / "train.json").write_text(json.dumps(result))  # last: marks the folder complete


DEEPSEEK_POINTS = [3, 4, 6]  # the tiny DeepSeek-V3's capture points in its serving tests


def deepseek_drafter(cache_dir: Path, model: Path, root: Path, arch: str = "llama"):
    """A drafter (`arch`: DrafterShape.arch) trained by the pipeline's own stages on the tiny
    DeepSeek-V3's hidden states (96 records, 128 tokens, points DEEPSEEK_POINTS, 160 steps) into a
    filesystem store under `root`, published, pulled. -> (pulled folder, TrainResult)"""
    from aerie import stages
    from aerie.contracts import DrafterShape, TrainConfig, TrainRequest
    from aerie.settings import Settings
    from aerie.store import FsStore
    from tests.runs import hidden_run_folder, upload_run

    store = FsStore(root / "store")
    run = hidden_run_folder(cache_dir, model, records=96, max_tokens=128, shard_sequences=16, points=DEEPSEEK_POINTS)
    upload_run(store, run, "ds")
    config = TrainConfig(
        draft_vocab_size=512,
        ttt_steps=3,
        steps=160,
        batch_tokens=512,
        max_seq_tokens=128,
        lr=3e-3,
        warmup_steps=8,
        checkpoint_every=80,
        eval_prompts=0,
        holdout_fraction=0.1,
        drafter=DrafterShape(arch=arch),
    )
    name = f"ds-{arch}"
    result = stages.train(
        store,
        Settings(store=f"file://{store.root}"),
        TrainRequest(runs=["ds"], drafter=name, model=str(model), config=config),
    )
    return stages.pull(store, name, root / name), result
