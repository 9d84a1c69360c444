"""The architecture, checked on the source: services meet only through the store and the shared
library, no import cycle, each stage defined once, one command surface."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.services import REPO, clean_env

sys.path.insert(0, str(REPO / "scripts"))
import import_graph  # noqa: E402  (scripts/ is not a package)


def test_no_cycle_and_no_service_imports_another():
    problems = import_graph.problems(import_graph.graph())
    assert problems == []


def test_the_checker_catches_what_it_is_for(tmp_path):
    """A cycle and a cross-service import, planted in a copy of the graph, are reported."""
    g = import_graph.graph()
    g["aerie_trainer.evaluate"].add("aerie_trainer.job")  # job -> evaluate already
    g["aerie_trainer.job"].add("aerie_extractor.extract")
    found = import_graph.problems(g)
    assert any("cycle" in p and "aerie_trainer.evaluate" in p for p in found), found
    assert any("aerie_trainer.job (trainer) imports aerie_extractor.extract" in p for p in found), found


def test_the_documents_the_checker_cites_exist():
    """scripts/import_graph.py states its rules by citing a document: that document is in the
    repository (it once cited one that was not), and ARCHITECTURE.md stays a one-page map."""
    cited = set(re.findall(r"\b([A-Z][A-Z_]+\.md)\b", (REPO / "scripts" / "import_graph.py").read_text()))
    assert "ARCHITECTURE.md" in cited
    assert [name for name in sorted(cited) if not (REPO / name).is_file()] == []
    assert len((REPO / "ARCHITECTURE.md").read_text().splitlines()) <= 150


def test_the_core_does_not_import_the_app():
    """`aerie` outside `aerie.app` imports neither the app nor click, rich or subprocess."""
    assert import_graph.core_problems() == []
    assert {"aerie.app.cli", "aerie.app.pipeline", "aerie.app.ops", "aerie.app.bench"} <= set(import_graph.graph())


def test_the_core_rule_catches_what_it_is_for(tmp_path):
    """An app import and a click import, planted in the core, are reported."""
    mods, g = import_graph.modules(), import_graph.graph()
    g["aerie.layout"].add("aerie.app.cli")
    planted = tmp_path / "presets.py"
    planted.write_text(mods["aerie.presets"].read_text() + "\n\ndef f():\n    import click.types\n")
    found = import_graph.core_problems({**mods, "aerie.presets": planted}, g)
    assert "aerie.layout (core) imports aerie.app.cli (app): the core runs without the app" in found, found
    assert "aerie.presets (core) imports click: the core runs without the app's libraries" in found, found


def test_one_train_id_property():
    """A training's id is `TrainRequest.resolved_train_id` everywhere, never recomputed by a caller."""
    for path in [*(REPO / "shared").rglob("*.py"), *(REPO / "services").rglob("*.py")]:
        if ".venv" not in path.parts:
            text = path.read_text()
            assert not re.search(r"\btrain_id or\b|default_train_id\(", text), path.relative_to(REPO)


def test_the_trainer_does_not_depend_on_the_extractor():
    deps = tomllib.loads((REPO / "services/trainer/pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in deps if d.startswith("aerie-extractor")], deps


def test_each_stage_is_defined_once_and_composed_through_the_registry_only_outside_its_service():
    """The shared library (the run controller's in-process dispatcher under `aerie run`), the
    benchmarks and the tests compose the services through `aerie.stages` (entry points); a service
    calls its own stage functions directly, never through the registry (go-to-definition reaches
    the code, and stale installed metadata cannot change what a worker runs)."""
    sources = {
        p: p.read_text()
        for root in ("shared", "services", "benchmarks", "tests")
        for p in (REPO / root).rglob("*.py")
        if ".venv" not in p.parts
    }
    for stage in ("run_ingest", "run_extract", "run_train"):
        defined = [p for p, text in sources.items() if re.search(rf"^def {stage}\(", text, re.M)]
        assert len(defined) == 1, (stage, defined)
    for path in (
        "shared/aerie/controller.py",
        "shared/aerie/app/pipeline.py",
        "benchmarks/gpu_pipeline.py",
        "tests/trained.py",
        "tests/runs.py",
    ):
        text = (REPO / path).read_text()
        assert re.search(r"stages\.(ingest|extract|train)\b", text), path
        assert not re.search(r"\brun_(ingest|extract|train)\(", text), f"{path} calls a stage's implementation directly"
    for path in (REPO / "services").rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"\bstages\.[a-z]+\(|from aerie import .*\bstages\b|import aerie\.stages", text), (
            f"{path.relative_to(REPO)} calls its own service through the registry (aerie.stages)"
        )
    for path in ("services/extractor/aerie_extractor/tasks.py", "services/trainer/aerie_trainer/tasks.py"):
        assert re.search(r"\brun_(ingest|extract|train)\(", (REPO / path).read_text()), path


def test_command_surface():
    """`aerie` commands come from one mechanism (entry points), and the set does not grow by accident."""
    out = subprocess.run(
        [str(Path(sys.executable).with_name("aerie")), "--help"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    commands = sorted(re.findall(r"^  ([a-z-]+)\s", out.stdout.split("Commands:")[1], re.M))
    assert commands == [
        "align",
        "bench",
        "capture-ids",
        "logs",
        "model",
        "prepare-store",
        "pull",
        "retry-failed",
        "run",
        "smoke",
        "stack",
        "train",
    ], commands
    for service in ("extractor", "trainer"):  # no argparse CLI of their own
        for path in (REPO / "services" / service).rglob("*.py"):
            assert "argparse" not in path.read_text(), path
