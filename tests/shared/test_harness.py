"""aerie.app.harness: the benchmarks' one result schema, and a benchmark run from the repository
alone (`python -m benchmarks.<name>`, no sys.path edits, no tests.* imports)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from aerie.app import harness
from tests.services import REPO


def test_a_result_says_what_was_measured_where_by_which_command(tmp_path):
    out = tmp_path / "r" / "result.json"
    res = harness.report([harness.Figure("x / y", 0.5, "x", ">= 1")], out, details={"n": 3})
    assert json.loads(out.read_text()) == res
    assert set(res) == {"schema", "figures", "device", "commit", "command", "date", "details"}
    assert res["schema"] == "aerie-benchmark/1" and res["details"] == {"n": 3}
    assert res["figures"] == [{"figure": "x / y", "value": 0.5, "unit": "x", "goal": ">= 1"}]
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", res["commit"]), res["commit"]
    assert res["command"] == harness.command() and re.match(r"\d{4}-\d\d-\d\dT", res["date"]) and res["device"]
    a, b = harness.interleaved(3, lambda: None, lambda: None)
    assert len(a) == len(b) == 3 and all(s >= 0 for s in a + b)


def test_a_benchmark_runs_from_the_repository_alone(tmp_path):
    out = tmp_path / "shard.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_shard", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["command"].endswith(f"-m benchmarks.bench_shard --quick --out {out}")
    assert [f["figure"] for f in res["figures"]][1] == "shard bytes per token / raw tensor bytes"
    assert 1.0 <= res["figures"][1]["value"] <= 1.01


def test_no_benchmark_edits_sys_path_or_imports_the_tests_or_private_names():
    found = []
    for path in sorted((REPO / "benchmarks").glob("*.py")):
        text = path.read_text()
        for pattern in (r"sys\.path\.(insert|append)|sys\.path\[", r"^\s*(from|import) tests\b",
                        r"from aerie\w*(\.\w+)* import [^\n]*\b_[a-zA-Z]"):  # fmt: skip
            found += [f"{path.name}: {m.group(0).strip()}" for m in re.finditer(pattern, text, re.M)]
    assert found == []


def test_benchmarks_md_opens_with_the_figures_and_every_raw_file_is_cited():
    """BENCHMARKS.md is a map: its table of current figures within the first 40 lines, every raw
    file it links present, and every raw file in benchmarks/results cited by it, a report or a
    device script (what nothing cites leaves the tree)."""
    text = (REPO / "BENCHMARKS.md").read_text()
    head = text.splitlines()[:40]
    assert "| figure | value | goal | command | raw file | date |" in head
    linked = set(re.findall(r"\]\((benchmarks/results/[^)]+)\)", text))
    assert linked and [p for p in sorted(linked) if not (REPO / p).is_file()] == []
    citing = text + "".join(
        p.read_text() for pattern in ("benchmarks/reports/*.md", "benchmarks/*.sh") for p in REPO.glob(pattern)
    )
    uncited = [p.name for p in sorted((REPO / "benchmarks" / "results").iterdir()) if p.name not in citing]
    assert uncited == []
