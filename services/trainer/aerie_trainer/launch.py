"""A training job over every device the worker was given: torchrun as a child of the task.

    AERIE_TRAIN_RANKS=auto   # the visible CUDA devices (compose deploy.resources / the k8s GPU
                             # resource -> CUDA_VISIBLE_DEVICES); 1 on the CPU
    AERIE_TRAIN_RANKS=2      # two ranks (gloo on the CPU: how the tests run it)

`run_ranks` (called by the `train` stage when this process is not already a rank and more than
one rank is wanted) starts

    python -m aerie_trainer.launch guard -- python -m torch.distributed.run --standalone \\
        --nproc_per_node N --max-restarts 0 -m aerie_trainer.job rank JOB_DIR

and relays what rank 0 reports (progress events, then the result) from files in JOB_DIR.

- The job dies with the task's process: the guard sets PR_SET_PDEATHSIG (SIGTERM) before it
  execs torchrun, so a SIGKILLed worker's torchrun is told at once and stops its ranks; every
  rank sets PR_SET_PDEATHSIG (SIGKILL) towards torchrun, so a torchrun that dies hard takes its
  ranks with it. No orphan keeps training beside the redelivered task.
- A rank that dies (killed, out of memory) makes torchrun stop the others and exit non-zero:
  `RankFailed`, a retryable error (aerie.queue.run_task retries it with backoff), and the retry
  resumes from the last complete checkpoint, as a redelivered task does. The survivors may raise
  first (gloo resets their collectives): an error that only says a peer went away is not the
  cause (`lost_peer`); a rank's own error is, and is retried only if it says so.
- Settings travel as the AERIE_* environment (credentials included, never written to a file);
  the request as JSON in JOB_DIR.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from aerie.contracts import ProgressEvent, TrainRequest, TrainResult
from aerie.settings import ENV_PREFIX, Settings

PR_SET_PDEATHSIG = 1
POLL_S = 0.5


class RankFailed(RuntimeError):
    """A rank of the training job died; retry: the job resumes from its last checkpoint."""

    retryable = True


def resolve_ranks(settings: Settings) -> int:
    """AERIE_TRAIN_RANKS -> how many ranks: auto = the visible CUDA devices on a GPU device, 1 on the CPU."""
    if settings.train_ranks != "auto":
        n = int(settings.train_ranks)
        if settings.device.startswith("cuda"):
            import torch

            visible = torch.cuda.device_count()
            if n > visible:
                raise ValueError(
                    f"AERIE_TRAIN_RANKS={n} but {visible} CUDA device(s) are visible here "
                    f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): lower it or use auto"
                )
        return n
    if settings.device.startswith("cuda"):
        import torch

        return max(1, torch.cuda.device_count())
    return 1


def settings_env(settings: Settings) -> dict[str, str]:
    """The settings as AERIE_* variables (what Settings.load() reads back in the ranks)."""
    env = {}
    for name, value in settings.model_dump(mode="json").items():
        if value is None:
            continue
        if hasattr(getattr(settings, name), "get_secret_value"):
            value = getattr(settings, name).get_secret_value()
        env[f"{ENV_PREFIX}{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    return env


def die_with_parent(sig: int) -> None:
    """Ask the kernel to send `sig` to this process when its parent goes (Linux); exit at once if
    the parent is already gone (it may have died before the call)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        parent = os.getppid()
        if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if parent == 1 or os.getppid() != parent:
            os._exit(1)


def run_ranks(
    settings: Settings,
    request: TrainRequest,
    ranks: int,
    progress: Callable[[ProgressEvent], None],
    entry: str = "aerie_trainer.job",
) -> TrainResult:
    """Train on `ranks` ranks (torchrun child running `python -m ENTRY rank JOB_DIR` in each,
    which calls `run_rank`), relaying rank 0's progress; raises RankFailed."""
    job = Path(tempfile.mkdtemp(prefix="aerie-train-"))
    try:
        (job / "request.json").write_text(request.model_dump_json())
        events, result = job / "events.jsonl", job / "result.json"
        env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
        env.update(settings_env(settings))
        env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
        cmd = [
            sys.executable,
            "-m",
            "aerie_trainer.launch",
            "guard",
            str(os.getpid()),
            "--",
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(ranks),
            "--max-restarts",
            "0",
            "-m",
            entry,
            "rank",
            str(job),
        ]
        log = open(job / "torchrun.log", "wb")
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        relayed = 0
        try:
            while True:
                done = proc.poll() is not None
                relayed = _relay(events, relayed, progress)
                if done:
                    break
                time.sleep(POLL_S)
        except BaseException:  # the task is being torn down (soft time limit, shutdown): take the job with it
            _stop(proc)
            raise
        finally:
            log.close()
        if proc.returncode == 0 and result.is_file():
            return TrainResult.model_validate_json(result.read_text())
        raise job_failure(job, request.drafter, ranks, proc.returncode)
    finally:
        shutil.rmtree(job, ignore_errors=True)


def job_failure(job: Path, drafter: str, ranks: int, returncode: int | None) -> Exception:
    """What a failed job raises, from the ranks' failure files in `job`: the first rank's own error
    (retryable as that error says), else `RankFailed` when every rank that raised only lost a peer
    (another rank was killed: its collectives reset) or none raised (a rank died without a word)."""
    failures = sorted((json.loads(f.read_text()) for f in job.glob("failure-*.json")), key=lambda f: f["rank"])
    own = [f for f in failures if not f["lost_peer"]]
    if own:
        f = own[0]
        error = RuntimeError(f"training {drafter} failed on rank {f['rank']}: {f['error']}")
        error.retryable = f["retryable"]  # type: ignore[attr-defined]
        return error
    log = job / "torchrun.log"
    tail = log.read_text(errors="replace")[-2000:] if log.is_file() else ""
    lost = "".join(f"; rank {f['rank']} lost a peer ({f['error'][:200]})" for f in failures)
    return RankFailed(
        f"training {drafter} on {ranks} ranks exited with {returncode} (a rank died?){lost}: "
        f"retried from its last checkpoint; torchrun's log ends:\n{tail}"
    )


def record_failure(job: Path, rank: int, error: BaseException) -> None:
    """A rank's error, for job_failure: what it was, whether it is worth a retry, whether it only
    says that a peer went away."""
    from aerie.queue import retryable

    part = job / f"failure-{rank}.json.part"  # renamed into place whole: a rank stopped mid-write leaves no half file
    part.write_text(
        json.dumps(
            {
                "rank": rank,
                "error": f"{type(error).__name__}: {error}",
                "retryable": retryable(error),
                "lost_peer": lost_peer(error),
            }
        )
    )
    part.rename(job / f"failure-{rank}.json")


def lost_peer(error: BaseException) -> bool:
    """Whether a rank's error is another rank's death seen from here: torch.distributed's own errors
    (NCCL, the rendezvous store, the network) or gloo's transport (a peer's socket reset or closed
    mid-collective, raised as a plain RuntimeError naming gloo's transport source)."""
    import torch.distributed as dist

    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and "/gloo/transport/" in str(error)


def _relay(events: Path, done: int, progress: Callable[[ProgressEvent], None]) -> int:
    """Report the complete lines of `events` after the first `done`; -> lines reported so far."""
    if not events.is_file():
        return done
    lines = events.read_text().split("\n")[:-1]  # the last piece may be half-written
    for line in lines[done:]:
        progress(ProgressEvent.model_validate_json(line))
    return len(lines)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


# --------------------------------------------------------------------------------------
# Inside the child processes
# --------------------------------------------------------------------------------------
def _guard(argv: list[str]) -> None:
    """`guard PARENT_PID -- CMD...`: die with the task's process, then become CMD (torchrun)."""
    parent, sep, cmd = int(argv[0]), argv[1], argv[2:]
    assert sep == "--" and cmd, "usage: guard PARENT_PID -- CMD..."
    die_with_parent(signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(1)
    os.execv(cmd[0], cmd)


def run_rank(job: Path, train: Callable[..., TrainResult]) -> None:
    """One rank (RANK/WORLD_SIZE from torchrun): `train(store, settings, request, progress)` in this
    process, the job's request and settings read from JOB_DIR and the environment; rank 0's progress
    and result written back for `run_ranks`."""
    die_with_parent(signal.SIGKILL)
    from aerie.store import open_store

    settings = Settings.load()
    request = TrainRequest.model_validate_json((job / "request.json").read_text())
    rank = int(os.environ.get("RANK", "0"))
    main = rank == 0
    events = open(job / "events.jsonl", "a") if main else None

    def report(event: ProgressEvent) -> None:
        if events is not None:
            events.write(event.model_dump_json(exclude_none=True) + "\n")
            events.flush()

    try:
        result = train(open_store(settings), settings, request, report)
    except Exception as e:  # every rank says what it raised; job_failure picks the cause
        record_failure(job, rank, e)
        raise
    if main:
        part = job / "result.json.part"
        part.write_text(result.model_dump_json())
        part.rename(job / "result.json")
    import torch

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["guard"]:
        _guard(argv[1:])
    else:
        raise SystemExit("usage: python -m aerie_trainer.launch guard PARENT_PID -- CMD...")


if __name__ == "__main__":
    main()
