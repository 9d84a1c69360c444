"""Activation checkpointing per TTT step (TrainConfig.activation_checkpointing): the same loss,
per-step losses, top-1 and master gradients as keeping every activation — with a weight cast
once per forward (the GPU's scheme, here float64 master / float32 compute, whose recomputation
runs after the cast context has exited) and without — and a lower peak of the process's memory
for the same step (measured by benchmarks/bench_train_memory.py in a fresh process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from aerie.contracts import TrainConfig, TrainRequest
from aerie.stages import train as run_train
from aerie_trainer.ttt import TTT
from tests.runs import hidden_run_folder, upload_run
from tests.services import REPO
from tests.trainer.test_drafter import VD, H, K, V, tiny_drafter
from tests.trainer.test_train import settings_for


def _step(checkpoint: bool, master: torch.dtype, compute: torch.dtype | None):
    B, L, S = 2, 9, 4
    g = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, V, (B, L + S), generator=g)
    aux = torch.randn(B, L, K * H, generator=g, dtype=torch.float64)
    target_logits = torch.randn(B, L + S, VD, generator=g, dtype=torch.float64)
    target_lse = torch.logsumexp(target_logits, -1)
    trainable = torch.rand(B, L + S, generator=g) > 0.2
    drafter = tiny_drafter().to(master)
    ttt = TTT(drafter, S, 0.8, compute_dtype=compute, cast_once=compute is not None, checkpoint=checkpoint)
    dt = compute or master
    out = ttt(
        input_ids,
        aux.to(dt),
        target_logits.to(dt),
        target_lse.to(dt),
        torch.randint(0, V, (B, L + S), generator=g),
        trainable,
        trainable,
    )
    out[0].backward()
    return out, {n: p.grad for n, p in drafter.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(
    "master,compute", [(torch.float64, None), (torch.float64, torch.float32)], ids=["plain", "cast-once"]
)
def test_checkpointed_steps_give_the_same_loss_and_gradients(master, compute):
    (loss, step_loss, correct, valid), grads = _step(False, master, compute)
    (c_loss, c_step_loss, c_correct, c_valid), c_grads = _step(True, master, compute)
    torch.testing.assert_close(c_loss, loss, rtol=0, atol=0)
    torch.testing.assert_close(c_step_loss, step_loss, rtol=0, atol=0)
    assert torch.equal(c_correct, correct) and torch.equal(c_valid, valid)
    assert grads.keys() == c_grads.keys() and all(g is not None for g in grads.values())
    for name, grad in grads.items():
        torch.testing.assert_close(c_grads[name], grad, rtol=1e-12, atol=1e-14, msg=name)


def test_checkpointing_lowers_the_peak_memory_of_a_training_step(tmp_path):
    """One step (forward, backward, optimizer) at a shape where the draft-vocab logits dominate,
    each variant in its own process: the peak resident memory above the process's state before
    the step is below 60% of it with checkpointing (0.45 measured)."""
    peaks = {}
    for ckpt in (False, True):
        out = tmp_path / f"{ckpt}.json"
        cmd = [sys.executable, "benchmarks/bench_train_memory.py", "--one", "64,512,8192,7", "--out", str(out)]
        cmd += ["--checkpoint"] if ckpt else []
        run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        (row,) = json.loads(out.read_text())["runs"]
        assert row["checkpoint"] is ckpt and row["loss_finite"]
        peaks[ckpt] = row["step_peak_bytes"]
    # 7 steps x 512 tokens x 8192 logits x 4 bytes = 112 MiB of logits alone are kept without it
    assert peaks[False] > 112 << 20, peaks
    assert peaks[True] < 0.6 * peaks[False], peaks


@pytest.fixture(scope="module")
def sharegpt_run(cache_dir, smollm2_path):
    """tests/trainer/test_train.py's run (the same cached folder)."""
    return hidden_run_folder(cache_dir, smollm2_path, records=160, max_tokens=192, shard_sequences=16)


@pytest.mark.slow
def test_a_training_job_with_checkpointing_follows_the_same_losses(fs_store, sharegpt_run, smollm2_path):
    """TrainConfig.activation_checkpointing reaches the job's step: the real trainer on SmolLM2's
    ShareGPT hidden states, 4 steps each way, gives the same loss curve."""
    upload_run(fs_store, sharegpt_run, "sharegpt")
    losses = {}
    for ckpt in (False, True):
        cfg = TrainConfig(
            draft_vocab_size=2048,
            ttt_steps=3,
            steps=4,
            batch_tokens=192,
            max_seq_tokens=96,
            eval_prompts=0,
            activation_checkpointing=ckpt,
        )
        request = TrainRequest(
            runs=["sharegpt"], drafter="a", model=str(smollm2_path), config=cfg, train_id=f"c{int(ckpt)}", publish=False
        )
        losses[ckpt] = run_train(fs_store, settings_for(fs_store), request).losses
    assert len(losses[True]) == 4
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
