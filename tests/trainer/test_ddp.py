"""`torchrun` DDP: two CPU ranks (gloo) train exactly what one process does with two micro-batches
of gradient accumulation — rank r takes batch 2i+r, one process takes 2i then 2i+1."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from aerie import layout
from aerie.contracts import TrainConfig

from tests.runs import hidden_run_folder, upload_run
from tests.services import REPO, clean_env, store_env


@pytest.mark.slow
def test_two_ranks_equal_one_process_with_accumulation(fs_store, cache_dir, smollm2_path):
    upload_run(fs_store, hidden_run_folder(cache_dir, smollm2_path, records=24, max_tokens=96, shard_sequences=4), "r1")
    env = clean_env(**store_env(fs_store), OMP_NUM_THREADS="1")

    def train(launcher: list[str], train_id: str, grad_accum: int) -> dict:
        cfg = TrainConfig(draft_vocab_size=1024, ttt_steps=2, steps=4, batch_tokens=128, max_seq_tokens=96, warmup_steps=1,
                          grad_accum=grad_accum, checkpoint_every=2, eval_prompts=0, holdout_fraction=0.2)
        args = [*launcher, "-m", "aerie.cli", "train", "--runs", "r1", "--drafter", "ddp", "--model", str(smollm2_path),
                "--config", cfg.model_dump_json(), "--train-id", train_id, "--no-publish"]
        out = subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        trainer_json = fs_store.get_bytes(layout.checkpoint_prefix(train_id, 4) + "trainer.json")
        return json.loads(trainer_json)

    one = train([sys.executable], "one", grad_accum=2)
    two = train([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"], "two", grad_accum=1)
    assert two["tokens"] == one["tokens"]
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-4)
    assert len({round(x, 6) for x in one["losses"]}) == 4  # the curve moves: a real comparison
