"""One small drafter trained in the pipeline, shared by the tests that need a trained one.

Training it takes ~3-5 minutes on 2 CPU cores, so the trainer's own test (test_trainer_train)
and the SGLang serving test (test_serve_drafter) use the same one: ShareGPT hidden states (160
conversations, `hidden_run_folder`) -> `run_train` (300 steps, with its speculative-decoding
evaluation before and after) -> published to a filesystem store -> pulled.

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
TRAIN_CONFIG = dict(draft_vocab_size=4096, ttt_steps=3, steps=300, batch_tokens=512, max_seq_tokens=192, lr=2e-3,
                    warmup_steps=20, holdout_fraction=0.1, checkpoint_every=100, eval_prompts=8, eval_new_tokens=48,
                    eval_draft_tokens=3)


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
    from tests.test_trainer_data import hidden_run_folder

    run_folder = hidden_run_folder(cache_dir, smollm2_path, records=160, max_tokens=192, shard_sequences=16)
    key = hashlib.sha256(json.dumps([run_folder.name, TRAIN_CONFIG, source_digest()]).encode()).hexdigest()[:16]
    folder = Path(cache_dir) / "test-drafters" / key
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process training the same drafter: wait for it
        if not (folder / "train.json").is_file():
            _train_into(folder, run_folder, smollm2_path)
    return Trained(folder / "store", folder / "pulled", json.loads((folder / "train.json").read_text()))


def _train_into(folder: Path, run_folder: Path, smollm2_path: Path) -> None:
    from aerie.contracts import TrainConfig, TrainRequest
    from aerie.settings import Settings
    from aerie.store import FsStore

    from aerie_trainer.export import pull
    from aerie_trainer.train import run_train
    from tests.test_trainer_data import upload_run

    shutil.rmtree(folder, ignore_errors=True)
    store = FsStore(folder / "store")
    upload_run(store, run_folder, RUN)
    request = TrainRequest(runs=[RUN], drafter=DRAFTER, model=str(smollm2_path), config=TrainConfig(**TRAIN_CONFIG))
    started = time.monotonic()
    # Settings(...), not .load(): the test command sets AERIE_TEST_* variables
    result = run_train(store, Settings(store=f"file://{store.root}"), request)
    result["train_wall_s"] = time.monotonic() - started
    pull(store, DRAFTER, folder / "pulled")
    (folder / "train.json").write_text(json.dumps(result))  # last: marks the folder complete
