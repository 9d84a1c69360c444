"""Several ranks: two CPU ranks (gloo), launched by the train stage itself (AERIE_TRAIN_RANKS=2),
train what one process does with two micro-batches of gradient accumulation — rank r takes batch
2i+r, one process takes 2i then 2i+1 — under DDP and under FSDP2 (`fully_shard`), and the
checkpoints are the same full safetensors files whatever the sharding. An epoch holds 5 batches,
so the ranks share its odd batch across the epoch's end as one process does."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load as st_load

from aerie import layout
from aerie.contracts import TrainConfig
from tests.runs import hidden_run_folder, upload_run
from tests.services import REPO, clean_env, store_env

CFG = TrainConfig(
    draft_vocab_size=1024,
    ttt_steps=2,
    steps=3,
    batch_tokens=384,  # 4 sequences of 96 tokens a batch: 5 batches an epoch
    max_seq_tokens=96,
    warmup_steps=1,
    checkpoint_every=2,
    eval_prompts=0,
    holdout_fraction=0.2,
)


@pytest.mark.slow
def test_two_ranks_equal_one_process_with_accumulation_under_ddp_and_fsdp(fs_store, cache_dir, smollm2_path):
    upload_run(fs_store, hidden_run_folder(cache_dir, smollm2_path, records=24, max_tokens=96, shard_sequences=4), "r1")

    def train(train_id: str, grad_accum: int, **env: str) -> dict:
        cfg = CFG.model_copy(update={"grad_accum": grad_accum})
        args = [
            sys.executable,
            "-m",
            "aerie.app.cli",
            "train",
            "--runs",
            "r1",
            "--drafter",
            "ddp",
            "--model",
            str(smollm2_path),
            "--train-config",
            cfg.model_dump_json(),
            "--train-id",
            train_id,
            "--no-publish",
        ]
        out = subprocess.run(
            args,
            env=clean_env(**store_env(fs_store), OMP_NUM_THREADS="1", **env),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        result = json.loads(out.stdout[out.stdout.rindex('{\n "drafter"') :])  # after the progress lines
        prefix = layout.checkpoint_prefix(train_id, 3)
        return {
            "result": result,
            "trainer": json.loads(fs_store.get_bytes(prefix + "trainer.json")),
            "model": st_load(fs_store.get_bytes(prefix + "model.safetensors")),
            "optimizer": st_load(fs_store.get_bytes(prefix + "optimizer.safetensors")),
        }

    one = train("one", grad_accum=2)
    ddp = train("ddp", grad_accum=1, AERIE_TRAIN_RANKS="2")
    fsdp = train("fsdp", grad_accum=1, AERIE_TRAIN_RANKS="2", AERIE_TRAIN_SHARDING="fsdp")
    assert (one["result"]["sharding"], ddp["result"]["sharding"], fsdp["result"]["sharding"]) == (
        "single",
        "ddp",
        "fsdp",
    )
    assert ddp["result"]["ranks"] == fsdp["result"]["ranks"] == 2
    assert len({round(x, 6) for x in one["trainer"]["losses"]}) == 3  # the curve moves: a real comparison
    for two in (ddp, fsdp):
        assert two["trainer"]["tokens"] == one["trainer"]["tokens"]
        assert two["trainer"]["losses"] == pytest.approx(one["trainer"]["losses"], rel=1e-4)
        # the same files, full tensors under the same names, whatever the sharding
        assert two["model"].keys() == one["model"].keys() and two["optimizer"].keys() == one["optimizer"].keys()
        for name, tensor in one["model"].items():
            torch.testing.assert_close(two["model"][name], tensor, rtol=1e-3, atol=1e-5, msg=name)
        for name, tensor in one["optimizer"].items():
            torch.testing.assert_close(two["optimizer"][name].float(), tensor.float(), rtol=1e-3, atol=1e-6, msg=name)
    assert {g["params"][0] for g in fsdp["trainer"]["param_groups"]} == {
        g["params"][0] for g in one["trainer"]["param_groups"]
    }
