"""The trainer service: a real `celery worker` on queue `train` given two CPU "devices"
(AERIE_TRAIN_RANKS=2: the task launches a two-rank gloo job), real Redis, real S3.

A user enqueues `aerie.train`. The worker is SIGKILLed after the job's first checkpoint: its
torchrun and ranks die with it (nothing keeps training beside the rescuer). Redis hands the task to
a fresh worker, which resumes from the checkpoint; then one of its ranks is SIGKILLed: the job
fails with a retryable error, the task is retried and resumes from the last checkpoint again,
finishes and publishes the drafter once. Its TensorBoard files and progress record are in the
store and read back with TensorBoard's own reader. The same request through `aerie train` then
finds it published.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from aerie import layout
from aerie.contracts import TrainConfig, TrainProgress, TrainRequest
from aerie.queue import TRAIN_TASK, make_app
from aerie.settings import Settings
from tests.runs import hidden_run_folder, upload_run
from tests.services import REPO, clean_env, store_env, wait_until
from tests.workers import TrainerWorker as Worker

pytestmark = pytest.mark.slow


def processes() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state, command line) of every process."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()
                out[int(entry.name)] = (
                    int(fields[1]),
                    fields[0],
                    (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(),
                )
            except (OSError, ValueError):
                pass
    return out


def job_ranks(worker_pid: int) -> dict[int, int]:
    """pid -> RANK of the training ranks under a worker (its torchrun child and that one's ranks)."""
    procs, tree, frontier = processes(), set(), {worker_pid}
    while frontier:
        frontier = {pid for pid, (ppid, _, _) in procs.items() if ppid in frontier} - tree
        tree |= frontier
    ranks = {}
    for pid in tree:
        if "aerie_trainer.job rank" in procs[pid][2]:
            try:
                env = dict(
                    v.split("=", 1)
                    for v in (Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0"))
                    if "=" in v
                )
                ranks[pid] = int(env["RANK"])
            except (OSError, KeyError):
                pass
    return ranks


def alive(pids) -> list[int]:
    procs = processes()
    return [pid for pid in pids if pid in procs and procs[pid][1] != "Z"]


def test_two_rank_job_survives_a_killed_worker_and_a_killed_rank_and_publishes_once(
    s3_store, private_redis, cache_dir, smollm2_path, workers, tmp_path
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = hidden_run_folder(cache_dir, smollm2_path, records=160, max_tokens=192, shard_sequences=16)
    upload_run(s3_store, folder, "sharegpt")
    cfg = TrainConfig(
        draft_vocab_size=2048,
        ttt_steps=2,
        steps=24,
        batch_tokens=256,
        max_seq_tokens=128,
        warmup_steps=4,
        checkpoint_every=4,
        eval_prompts=1,
        eval_new_tokens=8,
        holdout_fraction=0.1,
    )
    request = TrainRequest(runs=["sharegpt"], drafter="killed", model=str(smollm2_path), config=cfg)
    train_id = request.resolved_train_id
    latest = layout.checkpoint_latest(train_id)
    # a short visibility timeout: Redis hands a lost worker's unacknowledged task on after 5 s
    env = clean_env(
        **store_env(s3_store),
        AERIE_BROKER=private_redis,
        AERIE_BROKER_VISIBILITY_TIMEOUT_S="5",
        AERIE_TRAIN_RANKS="2",
        OMP_NUM_THREADS="1",
    )

    def checkpoint() -> int:
        return json.loads(s3_store.get_bytes(latest))["step"] if s3_store.exists(latest) else 0

    victim = Worker(env, "victim", tmp_path)
    workers.append(victim)
    victim.wait_for(r"ready\.", 120)
    client = make_app(
        Settings(
            broker=private_redis,
            store=s3_store.endpoint,
            bucket=s3_store.bucket,
            s3_access_key=env["AERIE_S3_ACCESS_KEY"],
            s3_secret_key=env["AERIE_S3_SECRET_KEY"],
        )
    )
    result = client.send_task(TRAIN_TASK, kwargs=request.model_dump(mode="json"))

    # 1. the worker dies after the first checkpoint; its two ranks die with it
    wait_until(
        lambda: checkpoint() > 0 and len(job_ranks(victim.proc.pid)) == 2,
        600,
        "the victim's first checkpoint",
        poll=0.5,
        details=lambda: victim.log()[-3000:],
    )
    ranks = job_ranks(victim.proc.pid)
    victim.kill()
    wait_until(lambda: not alive(ranks), 60, f"the victim's ranks {ranks} to die with it")
    killed_at = checkpoint()
    assert 4 <= killed_at < 24 and not s3_store.list("drafters/killed/")

    # 2. a fresh worker resumes the redelivered task; one of its ranks is killed after a new checkpoint
    rescuer = Worker(env, "rescuer", tmp_path)
    workers.append(rescuer)
    wait_until(
        lambda: checkpoint() > killed_at and 1 in job_ranks(rescuer.proc.pid).values(),
        600,
        "the rescuer's first checkpoint",
        poll=0.5,
        details=lambda: rescuer.log()[-3000:],
    )
    rank_1 = next(pid for pid, rank in job_ranks(rescuer.proc.pid).items() if rank == 1)
    os.kill(rank_1, signal.SIGKILL)
    rank_killed_at = checkpoint()

    # 3. the job fails (retryable), the task is retried, resumes, finishes and publishes once
    summary = result.get(timeout=900)
    rescuer.wait_for(re.escape(f"Task {TRAIN_TASK}[{result.id}] succeeded"), 60)
    log = rescuer.log()
    assert "RankFailed" in log and "retry" in log.lower(), log[-3000:]
    assert summary["resumed_from"] >= rank_killed_at > killed_at and summary["steps"] == 24
    assert (summary["sharding"], summary["ranks"]) == ("ddp", 2)
    versions = {k.split("/")[2] for k in s3_store.list("drafters/killed/") if k.count("/") == 3}
    assert versions == {summary["version"]}

    # 4. TensorBoard files in the store, read back by TensorBoard; the progress record says done
    tb = tmp_path / "tb"
    for key in s3_store.list(layout.train_logs_prefix(train_id)):
        s3_store.download(key, tb / key.rsplit("/", 1)[-1])
    events = EventAccumulator(str(tb))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "loss/total",
        "loss/step_0",
        "loss/step_1",
        "accuracy/step_0",
        "lr",
        "tokens_per_second",
        "data_wait_fraction",
        "eval/acceptance",
        "eval/simulated_acceptance",
    } <= tags, tags
    steps = sorted({e.step for e in events.Scalars("loss/total")})
    assert steps == list(range(1, 25)), steps  # every step once, across the three attempts' files
    assert [e.step for e in events.Scalars("eval/acceptance")] == [0, 24]
    record = s3_store.get_json(layout.train_progress("sharegpt", train_id), TrainProgress)
    assert (record.stage, record.step, record.steps, record.version, record.ranks) == (
        "done",
        24,
        24,
        summary["version"],
        2,
    )

    # the same request through the CLI: found published, nothing trained or published again
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "aerie.app.cli",
            "train",
            "--runs",
            "sharegpt",
            "--drafter",
            "killed",
            "--model",
            str(smollm2_path),
            "--train-config",
            cfg.model_dump_json(),
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "already published" in out.stdout
    assert {k.split("/")[2] for k in s3_store.list("drafters/killed/") if k.count("/") == 3} == versions
