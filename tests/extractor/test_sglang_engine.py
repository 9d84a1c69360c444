"""The `sglang` engine against a real SGLang 0.5.23 server on the CPU, checked against transformers.

A capture server per capture-point choice (module-scoped, parametrized: the default [2, 15, 27]
and the edges [1, 5, 9, 29]; both start together, each stops after its tests):
- every aux tensor the engine returns equals transformers' `output_hidden_states[point]` in
  float32, and the top-k signal equals transformers' log-softmax top-k row for row;
- the same through the user's path: `celery enqueue` -> a real worker -> SGLang -> S3;
- a server that captures other layers, runs another version or serves another model is refused
  before any request, with a message naming both sides.
"""

from __future__ import annotations

import json
import re

import httpx
import ml_dtypes
import numpy as np
import pytest

from aerie import layout
from aerie.app.launcher import free_port
from aerie.capture import convention_for, to_engine_ids
from aerie.contracts import EngineSpec, IngestOptions, RunSpec, ShardRecord
from aerie.settings import Settings
from aerie.shard import Shard
from aerie.target import describe
from aerie_extractor.engines.base import EngineError, EngineMismatch
from aerie_extractor.engines.sglang import SGLangEngine
from tests.runs import DATA
from tests.services import wait_settled
from tests.sglang_server import capture_server, start_soon
from tests.workers import ExtractorWorker as Worker
from tests.workers import celery_cli, wait_complete, worker_env

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

TOPK = 8
PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Write a haiku about hidden states flowing between two engines that disagree."},
        {"role": "assistant", "content": "Layer two or three?\nOff by one, the drafter guessed\nnothing it was shown."},
    ],
]


@pytest.fixture(scope="module")
def target(smollm2_path):
    return describe(smollm2_path)


@pytest.fixture(scope="module")
def sequences(smollm2_path) -> list[np.ndarray]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    seqs = [
        np.asarray(tok.apply_chat_template(m, tokenize=True, return_dict=True)["input_ids"], dtype=np.int32)
        for m in PROMPTS
    ]
    return [*seqs, np.asarray([1], dtype=np.int32)]  # a one-token prompt too


@pytest.fixture(scope="module")
def hf_forward(smollm2_path):
    """token ids -> transformers float32 (hidden_states [N+1, T, H], log-softmax [T, V])."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()

    def forward(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        with torch.inference_mode():
            res = model(
                input_ids=torch.from_numpy(np.asarray(ids, dtype=np.int64))[None],
                output_hidden_states=True,
                use_cache=False,
            )
        return torch.stack(res.hidden_states)[:, 0].numpy(), torch.log_softmax(res.logits[0].float(), dim=-1).numpy()

    return forward


def assert_matches_transformers(aux, topk_ids, topk_logprobs, hs, logp, points, label: str) -> None:
    """aux [T, K, H] equals hidden_states[points]; top-k rows equal the log-softmax top-k."""
    T = aux.shape[0]
    for k, point in enumerate(points):
        want = hs[point]  # capture point k == output_hidden_states[k]
        np.testing.assert_allclose(aux[:, k], want, rtol=1e-4, atol=1e-4, err_msg=f"{label}: point {point}")
        # an off-by-one would match a neighbour instead: it is measurably different
        assert np.abs(aux[:, k] - hs[point + 1]).max() > 1e-2, f"{label}: point {point} also equals point {point + 1}"
    # row t is the distribution over token t+1, the last row (the output step) included
    ref_ids = np.argsort(-logp, axis=-1)[:, :TOPK]
    ref_vals = np.take_along_axis(logp, ref_ids, axis=-1)
    assert topk_ids.shape == (T, TOPK) and topk_ids.dtype == np.int32 and topk_logprobs.dtype == np.float32
    np.testing.assert_allclose(topk_logprobs, ref_vals, atol=1e-4, err_msg=f"{label}: top-k log-probs")
    sure = np.diff(ref_vals, axis=-1).min(axis=-1) < -1e-3  # rows without near-ties
    np.testing.assert_array_equal(topk_ids[sure], ref_ids[sure], err_msg=f"{label}: top-k ids")


# Default points [2, N//2, N-3] and the edges SGLang's Llama convention can name (1 and N-1).
POINT_SETS = {"default": [2, 15, 27], "edges": [1, 5, 9, 29]}


@pytest.fixture(scope="module")
def starting(smollm2_path, tmp_path_factory) -> dict:
    """Both servers, started in the background together when the first is asked for (a start is
    mostly one core importing SGLang): the second is ready by the time the first's tests end."""
    started = {
        name: start_soon(capture_server(smollm2_path, points=points, log_dir=tmp_path_factory.mktemp("sglang")))
        for name, points in POINT_SETS.items()
    }
    yield started
    for s in started.values():
        s.stop()


@pytest.fixture(scope="module", params=list(POINT_SETS), ids=list(POINT_SETS))
def server(request, starting):
    srv = starting[request.param].ready()
    srv.extra["points"] = POINT_SETS[request.param]
    yield srv
    starting[request.param].stop()


def make_run(target, points, version="0.5.23", dtype="float32", **changes) -> RunSpec:
    convention = convention_for("sglang", target.architecture)
    engine = EngineSpec(
        name="sglang", version=version, convention=convention,
        layer_ids=to_engine_ids(points, convention, target.num_layers), transport="json", dtype=dtype,
    )  # fmt: skip
    return RunSpec(
        run="sgl-test", dataset="inline", target=target, engine=engine, capture_points=list(points),
        dtype=dtype, target_signal="topk", topk=TOPK, ingest=IngestOptions(), **changes,
    )  # fmt: skip


def settings_for(server, **kw) -> Settings:
    return Settings(engine="sglang", engine_urls=[server.url], engine_concurrency=2, engine_timeout_s=120, **kw)


def generate_requests(server) -> int:
    """Requests the server has answered on /generate so far (its access log)."""
    count = lambda: len(re.findall(r'"POST /generate HTTP', server.log_path.read_text(errors="replace")))  # noqa: E731
    return wait_settled(count, 30, "the server's access log")  # its line is written after the response


# --------------------------------------------------------------------------------------
def test_aux_and_topk_equal_transformers(server, target, sequences, hf_forward):
    points = server.extra["points"]
    run = make_run(target, points)
    spec = SGLangEngine.spec_for(settings_for(server), target, points, "float32")
    assert spec == run.engine  # what a new run records: the server's version, the translated ids
    engine = SGLangEngine(settings_for(server), run)
    engine.check(run)
    captured = engine.capture(sequences)

    assert len(captured) == len(sequences)
    for seq, cap in zip(sequences, captured):
        hs, logp = hf_forward(seq)
        assert cap.aux.shape == (len(seq), len(points), target.hidden_size) and cap.aux.dtype == np.float32
        for k, point in enumerate(points):
            a, b = cap.aux[:, k], hs[point]
            cos = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
            assert cos.min() > 0.99999, f"point {point}: cosine {cos.min()}"
        assert_matches_transformers(cap.aux, cap.topk_ids, cap.topk_logprobs, hs, logp, points, f"{len(seq)} tokens")


def test_bfloat16_run_stores_the_rounded_states(server, target, sequences, hf_forward):
    points = server.extra["points"]
    run = make_run(target, points, dtype="bfloat16")
    (cap,) = SGLangEngine(settings_for(server), run).capture(sequences[:1])
    assert cap.aux.dtype == np.dtype(ml_dtypes.bfloat16)
    hs, _ = hf_forward(sequences[0])
    want = np.stack([hs[p] for p in points], axis=1).astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_allclose(cap.aux.astype(np.float32), want, rtol=1e-2, atol=1e-2)


def test_enqueue_through_real_celery_workers(
    server, s3_store, private_redis, smollm2_path, workers, tmp_path, hf_forward
):
    """The user's story with this engine: `celery enqueue` -> a real worker ingests (recording the
    server's engine spec) and extracts through SGLang into S3 -> every stored tensor equals transformers."""
    points = server.extra["points"]
    run = f"celery-sgl-{len(points)}"
    env = worker_env(s3_store, private_redis)
    env.update(AERIE_ENGINE="sglang", AERIE_ENGINE_URLS=json.dumps([server.url]), AERIE_ENGINE_CONCURRENCY="2")
    workers.append(Worker(env, "sgl", tmp_path))
    workers[0].wait_for(r"ready\.", 120)
    celery_cli(env, "enqueue", "--dataset", str(DATA / "malformed.jsonl"), "--run", run, "--model", str(smollm2_path),
               "--capture-points", ",".join(map(str, points)), "--engine", "sglang", "--dtype", "float32",
               "--target-signal", "topk", "--topk", str(TOPK), "--max-tokens", "96", "--shard-tokens", "64")  # fmt: skip
    status = wait_complete(s3_store, run, workers, 600, private_redis)

    spec = s3_store.get_json(layout.run_spec(run), RunSpec)
    assert (spec.engine.name, spec.engine.version, spec.engine.transport) == ("sglang", "0.5.23", "json")
    assert spec.engine.layer_ids == server.layer_ids and spec.capture_points == points
    checked = 0
    for key in sorted(k for k in s3_store.list(layout.shards_prefix(run, "hidden")) if k.endswith(".json")):
        record = s3_store.get_json(key, ShardRecord)
        assert record.engine == spec.engine
        hidden = Shard.from_buffer(s3_store.get_bytes(record.key)).validate()
        assert hidden.capture_points == points and hidden.target_signal == "topk"
        for seq in hidden.sequences():
            hs, logp = hf_forward(seq["input_ids"])
            assert_matches_transformers(
                seq["aux"], seq["topk_ids"], seq["topk_logprobs"], hs, logp, points, record.shard
            )
            checked += 1
    assert checked == status.sequences == 3 and status.shards_total >= 2


def test_refuses_other_layer_ids_before_any_request(server, target, sequences):
    served = server.extra["points"]
    other = [3, 16, 28] if served != [3, 16, 28] else [2, 15, 27]
    run = make_run(target, other)
    engine = SGLangEngine(settings_for(server), run)
    before = generate_requests(server)
    with pytest.raises(EngineMismatch) as err:
        engine.capture(sequences)  # capture checks first
    message = str(err.value)
    assert str(server.layer_ids) in message and str(run.engine.layer_ids) in message, message
    assert str(other) in message and server.url in message, message
    assert generate_requests(server) == before, "a refused run sent work to the server"

    good = SGLangEngine(settings_for(server), make_run(target, served))
    good.capture(sequences[:1])
    assert generate_requests(server) > before  # the request count above does see requests


def test_refuses_other_version_and_other_model(server, target):
    points = server.extra["points"]
    with pytest.raises(EngineMismatch, match=r"version 0\.5\.23.*records SGLang 0\.5\.17"):
        SGLangEngine(settings_for(server), make_run(target, points, version="0.5.17")).check(
            make_run(target, points, version="0.5.17")
        )

    other_weights = target.model_copy(update={"weights_sha256": "0" * 64})
    run = make_run(other_weights, points)
    with pytest.raises(EngineMismatch, match=r"weights sha256 .*serve the run's target"):
        SGLangEngine(settings_for(server), run).check(run)

    other_arch = target.model_copy(update={"architecture": "Qwen2ForCausalLM"})
    run = make_run(other_arch, points)
    with pytest.raises(EngineMismatch, match=r"LlamaForCausalLM.*Qwen2ForCausalLM"):
        SGLangEngine(settings_for(server), run).check(run)


def test_every_configured_server_is_checked(server, target):
    points = server.extra["points"]
    dead = f"http://127.0.0.1:{free_port()}"
    run = make_run(target, points)
    settings = Settings(
        engine="sglang", engine_urls=[server.url, dead], engine_timeout_s=30, engine_outage_wait_s=0
    )  # fail at once (waiting out an outage: tests/deploy/test_sglang_runtime.py)
    engine = SGLangEngine(settings, run)
    with pytest.raises(EngineError, match=re.escape(dead) + ".*unreachable") as err:
        engine.check(run)
    assert not isinstance(err.value, EngineMismatch) and err.value.retryable  # a server down is worth a retry


def test_shape_check_names_the_cause(server, target):
    points = server.extra["points"]
    run = make_run(target.model_copy(update={"hidden_size": 500}), points)  # not the served model's H
    with pytest.raises(EngineMismatch, match=r"floats per token.*another model"):
        SGLangEngine(settings_for(server), run).check(run)


def test_server_info_endpoints_match_the_launch(server):
    info = httpx.get(server.url + "/server_info", timeout=30).json()
    assert info["return_aux_hidden_state_layer_ids"] == server.layer_ids
    assert info["disable_radix_cache"] is True and info["version"] == "0.5.23"
