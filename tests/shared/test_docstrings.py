"""Docstrings state the contract and the reason; measurements and history live in BENCHMARKS.md
(CONTRIBUTING.md). Checked over the product code: no dated figure, no benchmark session, no
measured ratio, no "as it was until"."""

from __future__ import annotations

import ast
import re

from tests.services import REPO

HISTORY = re.compile(r"\b20\d\d-\d\d-\d\d\b|\bsession \d+|\bas it was until\b|\b\d+\.\d+ ?[x×](?!\w)", re.I)


def docstrings(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False)
            if text:
                yield getattr(node, "name", "<module>"), text


def test_product_docstrings_carry_no_measurements_or_history():
    files = [
        p
        for root in ("shared", "services")
        for p in sorted((REPO / root).rglob("*.py"))
        if not {"shim", "build"} & set(p.parts)
    ]
    assert len(files) > 50
    found = [
        f"{path.relative_to(REPO)}:{name}: {match.group(0)!r}"
        for path in files
        for name, text in docstrings(path)
        for match in HISTORY.finditer(text)
    ]
    assert not found, "move these figures to BENCHMARKS.md:\n" + "\n".join(found)


def test_the_check_sees_a_dated_figure(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('"""Fast: 0.97x bare on the H200 (as it was until 2026-12-04, session 11)."""\n')
    (text,) = [t for _, t in docstrings(planted)]
    assert [m.group(0) for m in HISTORY.finditer(text)] == ["0.97x", "as it was until", "2026-12-04", "session 11"]
