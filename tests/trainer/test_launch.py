"""A failed training job names its cause, whichever rank fails first: two real gloo ranks (plain
processes, no torchrun, so that the survivor always raises before anything stops it) and the
failure files they leave, read by `job_failure` as `run_ranks` reads them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aerie.queue import retryable
from aerie_trainer.launch import RankFailed, job_failure
from tests.services import REPO, clean_env, free_port

RANK = textwrap.dedent("""
    import datetime, os, signal, sys
    from pathlib import Path
    import torch, torch.distributed as dist
    from aerie_trainer.launch import record_failure

    job, how, rank = Path(sys.argv[1]), sys.argv[2], int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    t = torch.ones(4096)
    dist.all_reduce(t)  # both ranks are connected
    try:
        if rank == 1 and how == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == 1:
            raise ValueError("rank 1's own mistake")
        dist.all_reduce(t)  # rank 1 never joins: its socket closes under this collective
    except Exception as e:
        record_failure(job, rank, e)
        sys.stdout.flush()
        os._exit(1)
""")


def two_ranks(job: Path, how: str) -> list[int]:
    env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(job), how],
            env={**env, "RANK": str(r)},
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    for p in procs:
        p.wait(timeout=180)
    return [p.returncode for p in procs]


def test_a_killed_rank_is_a_retryable_rank_failure_though_its_peer_raised_first(tmp_path):
    assert two_ranks(tmp_path, "killed") == [1, -9]
    assert [f.name for f in tmp_path.glob("failure-*.json")] == ["failure-0.json"]  # the survivor's gloo error only
    error = job_failure(tmp_path, "d", 2, 1)
    assert isinstance(error, RankFailed) and retryable(error)
    assert "rank 0 lost a peer" in str(error) and "gloo" in str(error), error


def test_a_ranks_own_error_is_the_cause_not_its_peers_lost_connection(tmp_path):
    assert two_ranks(tmp_path, "raises") == [1, 1]
    assert sorted(f.name for f in tmp_path.glob("failure-*.json")) == ["failure-0.json", "failure-1.json"]
    error = job_failure(tmp_path, "d", 2, 1)
    assert not isinstance(error, RankFailed) and not retryable(error)
    assert str(error) == "training d failed on rank 1: ValueError: rank 1's own mistake"


@pytest.mark.parametrize("said", [True, False])
def test_rank_zeros_own_error_keeps_its_retry_and_no_failure_file_is_a_rank_that_died(tmp_path, said):
    assert isinstance(job_failure(tmp_path, "d", 2, -9), RankFailed)
    (tmp_path / "failure-0.json").write_text(
        f'{{"rank": 0, "error": "StoreError: gone", "retryable": {str(said).lower()}, "lost_peer": false}}'
    )
    error = job_failure(tmp_path, "d", 2, 1)
    assert str(error) == "training d failed on rank 0: StoreError: gone" and retryable(error) is said
