"""Engines by name, imported lazily (the `sglang` engine needs no torch, `hf` needs no HTTP).

- `make_engine(settings, run_spec, model_path)`: the engine that extracts a run.
- `engine_spec(settings, name, target, capture_points, dtype)`: what a new run records.
"""

from __future__ import annotations

import importlib

from aerie.contracts import EngineSpec, RunSpec, TargetSpec
from aerie.settings import Settings
from aerie_extractor.engines.base import Captured, Engine, EngineError, EngineMismatch

ENGINES = {
    "hf": "aerie_extractor.engines.hf:HFEngine",
    "sglang": "aerie_extractor.engines.sglang:SGLangEngine",
}

__all__ = ["Captured", "Engine", "EngineError", "EngineMismatch", "engine_class", "engine_spec", "make_engine"]


def engine_class(name: str) -> type[Engine]:
    if name not in ENGINES:
        raise EngineMismatch(f"unknown engine {name!r}: known engines are {', '.join(ENGINES)} (AERIE_ENGINE)")
    module, cls = ENGINES[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        extra = " (pip install 'aerie-extractor[hf]' for torch)" if name == "hf" else ""
        raise EngineMismatch(f"engine {name!r} cannot be imported: {e}{extra}") from e


def engine_spec(settings: Settings, name: str, target: TargetSpec, capture_points: list[int], dtype: str) -> EngineSpec:
    return engine_class(name).spec_for(settings, target, capture_points, dtype)


def make_engine(settings: Settings, run_spec: RunSpec, model_path: str | None = None) -> Engine:
    """The engine named by the run (`run_spec.engine.name`), built for that run.

    `model_path`: the target folder for in-process engines (default: the run's target.model).
    """
    name = run_spec.engine.name
    cls = engine_class(name)
    if name == "hf":
        return cls(settings, run_spec, model_path or run_spec.target.model)  # type: ignore[call-arg]
    return cls(settings, run_spec)  # type: ignore[call-arg]
