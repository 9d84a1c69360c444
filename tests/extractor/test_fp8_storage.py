"""fp8 storage through the real pipeline: a user enqueues the same conversations twice, once with
`--storage-dtype float8_e4m3fn`; a real `celery worker` (Redis broker, S3 store) extracts both.

- The fp8 run's shards are valid (sha256, shapes, scales) and hold about half the bytes per token
  of the bf16 run's (at H = 576: (4 x (576 + 4) + 5) / (4 x 1152 + 5) = 0.504).
- Dequantized, its states are the bf16 run's within e4m3's precision (relative error per row < 2^-4).
- The trainer reads it from S3: the same drafter trains on both runs with loss curves a few
  percent apart, and its held-out metrics are computed from the fp8 shards.
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest

from aerie import layout
from aerie.contracts import RunSpec, ShardRecord, TrainConfig, TrainRequest
from aerie.runs import hidden_bytes, run_status
from aerie.settings import Settings
from aerie.shard import Shard
from aerie.stages import train as run_train
from tests.runs import sharegpt_conversations
from tests.services import store_env
from tests.workers import ExtractorWorker, celery_cli, wait_complete, worker_env

pytestmark = pytest.mark.slow


def test_fp8_run_halves_the_bytes_and_trains(s3_store, private_redis, smollm2_path, workers, tmp_path):
    dataset = tmp_path / "chats.jsonl"
    with open(dataset, "w") as f:
        for conv in sharegpt_conversations(16):
            f.write(json.dumps({"conversations": [{**t, "value": t["value"][:200]} for t in conv]}) + "\n")
    env = worker_env(s3_store, private_redis, AERIE_TOKENS_PER_BATCH="512")
    workers.append(ExtractorWorker(env, "fp8", tmp_path))
    workers[0].wait_for(r"ready\.", 120)
    common = [
        "--dataset",
        str(dataset),
        "--model",
        str(smollm2_path),
        "--dtype",
        "bfloat16",
        "--max-tokens",
        "128",
        "--shard-tokens",
        "1024",
    ]
    celery_cli(env, "enqueue", "--run", "bf16", *common)
    celery_cli(env, "enqueue", "--run", "fp8", "--storage-dtype", "float8_e4m3fn", *common)
    for run in ("bf16", "fp8"):
        wait_complete(s3_store, run, workers, 400, private_redis)

    assert s3_store.get_json(layout.run_spec("fp8"), RunSpec).storage_dtype == "float8_e4m3fn"
    tokens = run_status(s3_store, "fp8").tokens
    assert tokens == run_status(s3_store, "bf16").tokens > 1000
    ratio = hidden_bytes(s3_store, "fp8") / hidden_bytes(s3_store, "bf16")
    assert 0.49 < ratio < 0.52, ratio  # headers included
    for name in layout.record_names(s3_store.list(layout.shards_prefix("fp8", "hidden"))):
        record = s3_store.get_json(layout.shard_record("fp8", "hidden", name), ShardRecord)
        data = s3_store.get_bytes(record.key)
        assert hashlib.sha256(data).hexdigest() == record.sha256
        fp8 = Shard.from_buffer(data).validate()
        assert fp8.quantized and fp8.states_dtype == "BF16" and fp8.metadata()["scale_block"] == "576"
        bf16 = Shard.from_buffer(s3_store.get_bytes(layout.shard("bf16", "hidden", name))).validate()
        for a, b in zip(bf16.sequences(), fp8.sequences()):
            for tensor in ("aux", "final"):
                x, y = a[tensor].astype(np.float32), b[tensor].astype(np.float32)
                rel = np.linalg.norm(y - x, axis=-1) / np.linalg.norm(x, axis=-1)
                assert rel.max() < 2.0**-4 and 0.005 < rel.mean() < 0.04, (tensor, rel.max(), rel.mean())

    # the trainer reads the fp8 run from S3 (downloaded shards, byte-range reads for the vocabulary)
    settings = Settings(**{k.removeprefix("AERIE_").lower(): v for k, v in store_env(s3_store).items()})
    cfg = TrainConfig(
        draft_vocab_size=512,
        ttt_steps=2,
        steps=6,
        batch_tokens=256,
        max_seq_tokens=128,
        lr=2e-3,
        warmup_steps=1,
        eval_prompts=0,
        holdout_fraction=0.25,
        checkpoint_every=100,
    )
    results = {
        run: run_train(
            s3_store,
            settings,
            TrainRequest(runs=[run], drafter=f"d-{run}", model=str(smollm2_path), config=cfg, publish=False),
        )
        for run in ("bf16", "fp8")
    }
    fp8, bf16 = results["fp8"], results["bf16"]
    assert fp8.steps == 6 and all(math.isfinite(x) for x in fp8.losses)
    assert fp8.simulated_acceptance is not None and fp8.heldout_acc  # held-out shards read as fp8
    assert fp8.losses == pytest.approx(bf16.losses, rel=0.05), (fp8.losses, bf16.losses)
