"""The pipeline's stages, as plain functions: each takes the store, the settings and a typed request.

    ingest   IngestRequest  -> IngestResult    dataset -> token shards + run.json      (extractor)
                                               (regenerate on: -> conversation shards)
    regenerate RegenerateRequest -> RegenerateResult  one conversation shard -> the    (extractor)
                                               target's answers (many requests in flight) -> one token shard
    extract  ExtractRequest -> ExtractResult   one token shard -> one hidden shard     (extractor)
    align    AlignRequest   -> AlignmentReport a run's stored states against a         (extractor)
                                               serving SGLang: per point cosine, cause
    train    TrainRequest   -> TrainResult     hidden shards -> trained, evaluated,    (trainer)
                                               exported and published drafter
    pull     NAME[:VERSION] -> folder          a published drafter, checked            (this package)

The shared library composes the services through these functions: the run controller's
in-process dispatcher (`aerie.controller.run_here`, under `aerie run`), the benchmarks and the
tests. The code behind a stage is the service's domain code: a service registers it under the
entry-point group `aerie.stages` (`pip install` is registration), and a stage whose service is
not installed here says which package to install. Inside a service, its own tasks and commands
call its functions directly (`aerie_extractor.ingest.run_ingest`, `aerie_trainer.job.run_train`).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from aerie.contracts import (
    AlignmentReport,
    AlignRequest,
    ExtractRequest,
    ExtractResult,
    IngestRequest,
    IngestResult,
    ProgressEvent,
    RegenerateRequest,
    RegenerateResult,
    TrainRequest,
    TrainResult,
)
from aerie.drafters import pull
from aerie.settings import Settings
from aerie.store import ObjectStore

Progress = Callable[[ProgressEvent], None]
GROUP = "aerie.stages"
PROVIDERS = {
    "ingest": "aerie-extractor (services/extractor)",
    "regenerate": "aerie-extractor (services/extractor)",
    "extract": "aerie-extractor (services/extractor)",
    "align": "aerie-extractor (services/extractor)",
    "train": "aerie-trainer (services/trainer)",
}


class StageUnavailable(RuntimeError):
    """The service that implements a stage is not installed in this environment."""


def implementation(stage: str) -> Callable[..., Any]:
    """The function a service registered for `stage` (entry point group `aerie.stages`)."""
    found = [ep for ep in entry_points(group=GROUP) if ep.name == stage]
    if not found:
        raise StageUnavailable(
            f"stage {stage!r} needs the package {PROVIDERS.get(stage, '?')} installed here "
            f"(no entry point {stage!r} in group {GROUP!r}); or run it on the workers (--broker redis://...)"
        )
    return found[0].load()


def ingest(store: ObjectStore, settings: Settings, request: IngestRequest) -> IngestResult:
    return implementation("ingest")(store, settings, request)


def regenerate(
    store: ObjectStore, settings: Settings, request: RegenerateRequest, progress: Progress | None = None
) -> RegenerateResult:
    """Answer one conversation shard with the target (stored once), then tokenize it into its token shard."""
    return implementation("regenerate")(store, settings, request, progress)


def extract(store: ObjectStore, settings: Settings, request: ExtractRequest) -> ExtractResult:
    return implementation("extract")(store, settings, request)


def align(store: ObjectStore, settings: Settings, request: AlignRequest) -> AlignmentReport:
    """Compare a sample of the run's stored states with the serving server's; the report is stored."""
    return implementation("align")(store, settings, request)


def train(
    store: ObjectStore, settings: Settings, request: TrainRequest, progress: Progress | None = None
) -> TrainResult:
    return implementation("train")(store, settings, request, progress)


__all__ = [
    "Progress",
    "StageUnavailable",
    "align",
    "extract",
    "implementation",
    "ingest",
    "pull",
    "regenerate",
    "train",
]
