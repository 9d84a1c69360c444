"""`aerie align` against real SGLang on the CPU: the seed's failure, measured before training.

The story: a user has a run (ShareGPT conversations, SmolLM2-135M states extracted by the `hf`
engine in bf16, the run the shared trained drafter learns from) and a serving SGLang. Before
spending GPU-days they ask whether the run's states are what that server computes:
- the same target in the same engine passes, with figures (`aerie align`, the user's command);
- a run whose states were captured one layer deeper than its capture points say (an engine that
  numbers the output of layer k as "k") fails, and the report says "point 2 matches the server's
  point 3: an off-by-one in the layer ids"; the training that was to follow is not enqueued
  (the plan's align gate), unless the user insists;
- the same weights quantized to 4 bits per 32-weight group, served by SGLang, against states of
  the unquantized weights: fails with the cosine drop measured at every point, each point still
  matching its own layer best, and the quantization named.

Servers (module-scoped, float32, radix cache off, capturing the run's points and their
neighbours, `neighbour_layer_ids`): SmolLM2 over stock SGLang JSON, and the quantized SmolLM2
through aerie's binary plugin (so the final states are compared too).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from aerie import controller, layout
from aerie.contracts import (
    AlignGate,
    AlignmentReport,
    AlignRequest,
    IngestRequest,
    PlannedTraining,
    TrainRequest,
)
from aerie.settings import Settings
from aerie.store import FsStore
from aerie_extractor.align import neighbour_layer_ids
from tests.runs import hidden_run_folder, upload_run
from tests.services import clean_env, store_env
from tests.sglang_server import capture_server, together

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

POINTS = [2, 15, 27]  # SmolLM2-135M, N = 30
SAMPLES, MAX_TOKENS = 4, 96  # 384 tokens compared per check
AERIE = str(Path(sys.executable).with_name("aerie"))
# Measured here (benchmarks/reports/history-2026-12.md "Alignment"): same weights >= 0.99985 mean per point (bf16 states,
# float32 server), neighbouring layers 0.82-0.975, the quantized weights 0.9966 (point 2) to 0.969.
SAME = 0.9998  # least mean cosine of the same target in the same engine
NEIGHBOUR = 0.98  # a neighbouring layer stays under this


@pytest.fixture(scope="module")
def run_folder(cache_dir, smollm2_path) -> Path:
    """The default-size ShareGPT run (the shared trained drafter's, tests/trained.py): cached."""
    from aerie import presets

    size = presets.load_size("default")
    return hidden_run_folder(
        cache_dir, smollm2_path, records=size.records, max_tokens=size.max_tokens, shard_sequences=16
    )


@pytest.fixture(scope="module")
def server_ids() -> list[int]:
    return neighbour_layer_ids(POINTS, "sglang-llama", 30)


@pytest.fixture(scope="module")
def int4_folder(cache_dir, smollm2_path) -> Path:
    from tests.quantized import smollm2_quantized

    return smollm2_quantized(cache_dir, smollm2_path)


@pytest.fixture(scope="module")
def servers(smollm2_path, int4_folder, server_ids, tmp_path_factory):
    """Both servers, started side by side (a start is mostly one core importing SGLang)."""
    shm = tmp_path_factory.mktemp("capture-shm")
    env = {"AERIE_SGLANG_BINARY": "1", "AERIE_CAPTURE_DIR": str(shm)}
    with together(
        capture_server(smollm2_path, layer_ids=server_ids, log_dir=tmp_path_factory.mktemp("sglang-smol")),
        capture_server(int4_folder, layer_ids=server_ids, env=env, log_dir=tmp_path_factory.mktemp("sglang-int4")),
    ) as both:
        yield both


@pytest.fixture(scope="module")
def smol_server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def int4_server(servers):
    return servers[1]


def figures(report: AlignmentReport) -> dict:
    out = {
        p.point: {
            "mean": round(p.at_point.mean, 6),
            "p1": round(p.at_point.p1, 6),
            "min": round(p.at_point.min, 6),
            "rel_l2": round(p.at_point.rel_l2, 5),
            "best": p.best_point,
            "neighbours": {q: round(c, 4) for q, c in p.cosines.items() if q != p.point},
        }
        if p.at_point
        else {"best": p.best_point, "cosines": p.cosines}
        for p in report.points
    }
    if report.signal:
        out["signal"] = {
            "top1": round(report.signal.top1_agreement, 4),
            "logprob_mae": report.signal.logprob_mae,
            "final": None if report.signal.final is None else round(report.signal.final.mean, 6),
        }
    return out


def test_the_same_target_in_the_same_engine_passes(smol_server, server_ids, run_folder, s3_store, smollm2_path):
    spec = upload_run(s3_store, run_folder, "sharegpt")
    env = clean_env(**store_env(s3_store))
    out = subprocess.run(
        [
            AERIE,
            "align",
            "--run",
            "sharegpt",
            "--server",
            smol_server.url,
            "--samples",
            str(SAMPLES),
            "--max-tokens",
            str(MAX_TOKENS),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(out.stdout)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "aligned: report runs/sharegpt/align/" in out.stdout and "tokenization: 4 samples agree" in out.stdout

    (server_id,) = layout.alignment_server_ids("sharegpt", s3_store.list(layout.alignments_prefix("sharegpt")))
    report = s3_store.get_json(layout.alignment_report("sharegpt", server_id), AlignmentReport)
    print("[same engine]", json.dumps(figures(report)))
    assert (
        report.passed
        and report.causes == []
        and report.tokens == sum(s.tokens for s in report.samples) <= SAMPLES * MAX_TOKENS
    )
    for p in report.points:
        assert p.passed and p.best_point == p.point and p.at_point.mean >= SAME, p
        assert all(c < NEIGHBOUR for q, c in p.cosines.items() if q != p.point), p  # neighbours are far below
    assert report.signal.signal == "final" and report.signal.final is None  # stock JSON returns no final state
    assert report.signal.top1_agreement >= 0.95
    s = report.server  # the identity of what was checked
    assert (s.model_path, s.sglang_version, s.quantization, s.tp_size, s.dtype, s.transport) == (
        str(smollm2_path),
        "0.5.23",
        None,
        1,
        "float32",
        "json",
    )
    assert s.aux_layer_ids == server_ids and s.aux_points == [1, 2, 3, 14, 15, 16, 26, 27, 28]
    assert s.weights_sha256 == spec.target.weights_sha256 and s.tokenizer_sha256 == spec.target.tokenizer_sha256
    assert report.precision == "bfloat16"  # bf16 states: bf16's thresholds


@pytest.fixture(scope="module")
def deeper_run_folder(cache_dir, smollm2_path) -> Path:
    """States at points [3, 16, 28], to be labelled [2, 15, 27]: what an engine that calls the
    output of layer k "layer k" hands over."""
    return hidden_run_folder(cache_dir, smollm2_path, records=8, max_tokens=MAX_TOKENS, points=[p + 1 for p in POINTS])


def upload_mislabelled(store, folder: Path, run: str) -> None:
    spec = upload_run(store, folder, run)
    engine = spec.engine.model_copy(update={"layer_ids": POINTS})
    store.put_json(layout.run_spec(run), spec.model_copy(update={"capture_points": POINTS, "engine": engine}))


def test_capture_ids_off_by_one_fail_name_the_off_by_one_and_stop_training(
    smol_server, deeper_run_folder, tmp_path, smollm2_path
):
    from aerie.queue import ALIGN_TASK, make_app
    from aerie_extractor.align import AlignmentFailed

    store = FsStore(tmp_path / "store")
    upload_mislabelled(store, deeper_run_folder, "foreign")
    settings = Settings(store=f"file://{store.root}", broker="memory://")
    app = make_app(settings, include=["aerie_extractor.tasks"])
    app.loader.import_default_modules()
    # the run's plan: a training gated by the check against the serving server (what
    # `enqueue --train-drafter --server URL` writes)
    gate = AlignGate(server=smol_server.url, samples=SAMPLES)
    ingest = IngestRequest(
        run="foreign", dataset="datasets/foreign.jsonl", model=str(smollm2_path), capture_points=POINTS
    )
    plan = controller.create_plan(store, controller.new_plan(ingest))
    train = TrainRequest(runs=["foreign"], drafter="d", model=str(smollm2_path))
    controller.add_training(store, "foreign", PlannedTraining(train=train, align=gate))
    request = controller.gate_request("foreign", gate)

    # the check before training fails: the task raises, naming the report and the cause; no training
    with pytest.raises(
        AlignmentFailed, match=r"run 'foreign' is not aligned .*every point matches the server's point \+1"
    ):
        app.tasks[ALIGN_TASK].apply_async(kwargs=request.model_dump(mode="json")).get()
    with app.connection_for_read() as conn:
        queue = conn.SimpleQueue("train")
        assert queue.qsize() == 0
        queue.close()

    (server_id,) = layout.alignment_server_ids("foreign", store.list(layout.alignments_prefix("foreign")))
    report = store.get_json(layout.alignment_report("foreign", server_id), AlignmentReport)
    print("[off by one]", json.dumps(figures(report)), *report.causes, sep="\n")
    assert not report.passed
    assert report.causes[0].startswith("every point matches the server's point +1")
    for p, cause in zip(report.points, report.causes[1:]):
        assert p.best_point == p.point + 1 and p.cosines[p.point + 1] >= SAME, p  # the layer below its label
        assert p.at_point.mean < NEIGHBOUR, p  # its own label is a neighbouring layer
        assert cause.startswith(f"point {p.point} matches the server's point {p.point + 1} (cos ")
        assert cause.endswith("an off-by-one in the layer ids")

    # the user insists (a training planned with --allow-misaligned): it is enqueued on the same
    # failed check, and the report stays failed
    insisting = TrainRequest(runs=["foreign"], drafter="d2", model=str(smollm2_path))
    controller.add_training(
        store, "foreign", PlannedTraining(train=insisting, align=gate.model_copy(update={"allow_misaligned": True}))
    )
    st = controller.advance(store, settings, plan.run, controller.OnWorkers(app, settings, "test"))
    assert [s.name for s in st.sent] == [f"train:{insisting.resolved_train_id}"]
    assert "is not aligned" in next(t.failure for t in st.trainings if t.planned.train.drafter == "d")
    with app.connection_for_read() as conn:
        queue = conn.SimpleQueue("train")
        message = queue.get(timeout=5)
        assert message.headers["task"] == "aerie.train" and message.payload[1]["drafter"] == "d2"
        queue.close()
    assert not store.get_json(layout.alignment_report("foreign", server_id), AlignmentReport).passed


def test_a_quantized_serving_target_fails_with_the_drop_measured_and_the_quantization_named(
    smol_server, int4_server, run_folder, tmp_path
):
    from aerie import stages

    store = FsStore(tmp_path / "store")
    spec = upload_run(store, run_folder, "sharegpt")
    settings = Settings(store=f"file://{store.root}")
    request = AlignRequest(run="sharegpt", server=int4_server.url, samples=SAMPLES, max_tokens=MAX_TOKENS)
    quantized = stages.align(store, settings, request)
    same = stages.align(store, settings, request.model_copy(update={"server": smol_server.url}))
    drop = {p.point: round(s.at_point.mean - p.at_point.mean, 5) for p, s in zip(quantized.points, same.points)}
    print(
        "[quantized]",
        json.dumps(figures(quantized)),
        "[drop vs same engine]",
        json.dumps(drop),
        *quantized.causes,
        sep="\n",
    )

    assert same.passed and not quantized.passed
    assert quantized.server.transport == "binary" and quantized.server.weights_sha256 != spec.target.weights_sha256
    assert {r.server.server_id for r in (quantized, same)} == set(
        layout.alignment_server_ids("sharegpt", store.list(layout.alignments_prefix("sharegpt")))
    )  # one report each
    for p in quantized.points:
        assert not p.passed and p.best_point == p.point, p  # the right layer, other numbers
        assert 0.9 < p.at_point.mean < 0.999, p
        assert drop[p.point] > 0.002, drop
    assert drop[27] > drop[2]  # quantization error grows with depth
    final = quantized.signal
    assert final.final is not None and final.final.mean < 0.99 and final.top1_agreement < 0.9 and not final.passed
    (cause,) = quantized.causes
    assert cause.startswith("every point at a lower cosine, matching its own layer best (2: 0.99")
    assert "a different quantization or dtype than the run" in cause and "re-quantized or modified weights" in cause


# --------------------------------------------------------------------------------------
# In the flow: the check runs before training when a serving server is given
# --------------------------------------------------------------------------------------
def test_aerie_run_with_a_misaligned_serving_server_stops_before_training(int4_server, smollm2_path, tmp_path):
    env = clean_env(AERIE_CACHE_DIR=str(smollm2_path.parent))
    out = subprocess.run(
        [AERIE, "run", "--quick", "--records", "8", "--server", int4_server.url, "--out", str(tmp_path / "drafter")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(out.stdout[-3000:])
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "NOT aligned: report runs/" in out.stdout  # the table, then the one-line reason
    (reason,) = out.stderr.strip().splitlines()
    assert "is not aligned with " + int4_server.url in reason and "a different quantization or dtype" in reason, reason
    assert "--allow-misaligned" in reason
    assert "train (steps)" not in out.stdout and not (tmp_path / "drafter").exists()
    assert not list((tmp_path / "aerie-data").rglob("drafters/*"))  # nothing trained, nothing published


def test_enqueue_with_a_server_trains_only_after_the_check_passed(
    smol_server, s3_store, private_redis, smollm2_path, workers, tmp_path
):
    import redis

    from tests.runs import DATA
    from tests.services import wait_until
    from tests.workers import ExtractorWorker, celery_cli, worker_env

    env = worker_env(s3_store, private_redis, AERIE_CACHE_DIR=str(smollm2_path.parent))
    workers.append(ExtractorWorker(env, "extractor", tmp_path))
    workers[0].wait_for(r"ready\.", 120)
    celery_cli(
        env,
        "enqueue",
        "--dataset",
        str(DATA / "malformed.jsonl"),
        "--run",
        "checked",
        "--model",
        str(smollm2_path),
        "--capture-points",
        "2,15,27",
        "--max-tokens",
        "96",
        "--shard-tokens",
        "64",
        "--train-drafter",
        "d-checked",
        "--server",
        smol_server.url,
    )
    client = redis.Redis.from_url(private_redis)
    try:  # no trainer worker here: the training waits in its queue, sent by the check
        wait_until(
            lambda: client.llen("train"),
            600,
            "aerie.train enqueued after the check",
            poll=1,
            details=lambda: workers[0].log()[-3000:],
        )
        message = json.loads(client.lindex("train", 0))
    finally:
        client.close()
    assert message["headers"]["task"] == "aerie.train"
    workers[0].wait_for(r"run checked aligned: enqueued aerie.train for drafter d-checked", 30)
    (server_id,) = layout.alignment_server_ids("checked", s3_store.list(layout.alignments_prefix("checked")))
    report = s3_store.get_json(layout.alignment_report("checked", server_id), AlignmentReport)
    assert report.passed and report.server.url == smol_server.url
    assert "succeeded" in workers[0].wait_for(r"Task aerie\.align\[[0-9a-f-]+\] (succeeded)", 30).group(0)
