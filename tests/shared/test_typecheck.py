"""The type check scripts/lint.sh runs (mypy.ini): strict on the shared core, so an unannotated or
wrongly typed function there fails the lint, with the file, the line and the error code."""

from __future__ import annotations

import subprocess
import sys

from tests.services import REPO


def test_a_type_error_in_the_core_fails_the_check(tmp_path):
    assert ".venv/bin/python -m mypy" in (REPO / "scripts" / "lint.sh").read_text()
    planted = tmp_path / "aerie" / "planted.py"
    planted.parent.mkdir()
    planted.write_text("def steps(config):\n    return config.steps\n\n\ndef lr() -> float:\n    return 'high'\n")
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(REPO / "mypy.ini"), "--cache-dir", str(tmp_path / "c")]
        + [str(planted)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "planted.py:1: error: Function is missing a type annotation  [no-untyped-def]" in done.stdout
    assert 'planted.py:6: error: Incompatible return value type (got "str", expected "float")' in done.stdout


def test_the_services_are_checked_bodies_and_all(tmp_path):
    """The extractor and the SGLang plugin are in the checked set; an unannotated function's body
    is checked there too (check_untyped_defs), and a new function must be annotated."""
    files = next(line for line in (REPO / "mypy.ini").read_text().splitlines() if line.startswith("files ="))
    assert "services/extractor/aerie_extractor" in files and "services/inference/aerie_sglang" in files
    planted = tmp_path / "aerie_extractor" / "planted.py"
    planted.parent.mkdir()
    planted.write_text("def shard_name(i):\n    return 'shard-' + len(str(i))\n")
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(REPO / "mypy.ini"), "--cache-dir", str(tmp_path / "c")]
        + [str(planted)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "planted.py:1: error: Function is missing a type annotation  [no-untyped-def]" in done.stdout
    assert 'planted.py:2: error: Unsupported operand types for + ("str" and "int")  [operator]' in done.stdout
