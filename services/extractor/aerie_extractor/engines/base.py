"""One interface for every engine that turns token sequences into hidden states.

An engine returns, per sequence, the aux hidden states at the run's capture points and the
target signal. Engines never renumber layers themselves: they receive capture points and ask
`aerie.capture` for their own ids.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from aerie.contracts import EngineSpec, RunSpec, TargetSpec
from aerie.errors import ExpectedError
from aerie.settings import Settings


class EngineError(ExpectedError, RuntimeError):
    """The engine failed or disagrees with the run (retryable when `retryable`)."""

    retryable = True


class EngineMismatch(EngineError):
    """The engine serves another model / captures other layers / runs another version."""

    retryable = False


@dataclass
class Captured:
    """Hidden states of one sequence of T tokens."""

    aux: np.ndarray  # [T, K, H], the run's dtype (ml_dtypes.bfloat16 / float16 / float32)
    final: np.ndarray | None = None  # [T, H] post-final-norm state (signal "final")
    topk_ids: np.ndarray | None = None  # [T, k] int32 (signal "topk")
    topk_logprobs: np.ndarray | None = None  # [T, k] float32


class Engine(ABC):
    """Lifecycle: build -> `check(run)` once before any work -> `capture(...)` -> `close()`."""

    spec: EngineSpec

    @classmethod
    def spec_for(cls, settings: Settings, target: TargetSpec, capture_points: list[int], dtype: str) -> EngineSpec:
        """The EngineSpec a new run records for this engine (ingest calls it before any capture):
        name, version, id convention and the layer ids the capture points translate to."""
        raise NotImplementedError(f"{cls.__name__}.spec_for")

    @abstractmethod
    def check(self, run: RunSpec) -> None:
        """Refuse (EngineMismatch) before any work if the engine would not produce what the
        run's capture points, target and recorded engine version say."""

    @abstractmethod
    def capture(self, sequences: list[np.ndarray]) -> list[Captured]:
        """token ids (int32 [T_i]) -> one Captured per sequence, same order."""

    def close(self) -> None:  # noqa: B027 - optional
        pass
