"""The binary-capture plugin against real SGLang on the CPU (SmolLM2-135M, float32).

Story: an SGLang capture server with aerie's plugin installed advertises it; the extractor asks
for binary captures, reads them from tmpfs or S3 and gets exactly what SGLang's JSON path and
transformers give, for every capture point and the final state; requests that do not ask are
answered as by stock SGLang; a client that stops claiming fills the sink to its bound and no
further, the server refusing captures with a clear error while it keeps serving.

The extractor's `sglang` engine on the same server: a run ingested against it records the
binary transport and stores the final state; its shards equal the JSON path's and transformers';
a run over JSON stays JSON; a full sink makes the engine wait, then fail with the server's reason;
an extractor killed mid-way leaves at most the bound behind.

Two server starts, side by side: stock SGLang (the plugin excluded through SGLANG_PLUGINS)
records reference responses and what the engine makes of a stock server, and stops; the plugin
server (`AERIE_SGLANG_BINARY=1`, its shm captures written by the sink's writer process) serves
every test of the module. Both prefill in chunks of 32 tokens,
so that captures spanning several chunks are tested too.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from aerie import layout
from aerie.contracts import CaptureDescriptor, ExtractRequest, IngestOptions, RunSpec, ShardRecord
from aerie.settings import Settings
from aerie.shard import Shard, pack
from aerie_extractor.engines.base import EngineError, EngineMismatch
from aerie_extractor.engines.sglang import SGLangEngine
from aerie_extractor.engines.sglang_binary import (
    BinaryCaptureError,
    CaptureReader,
    advertised,
    capture_body,
    choose_sink,
    descriptor_of,
    fetch_binary,
    reader_for,
)
from aerie_extractor.extract import run_extract
from tests.services import clean_env, wait_settled, wait_until
from tests.sglang_server import REPO, capture_args, sglang_server, start_soon

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

POINTS = [2, 15, 27]  # SmolLM2: N = 30 -> SGLang Llama ids [1, 14, 26]
PROMPTS = [
    [1, 504, 3060, 314, 253],
    list(range(200, 220)),
    [1, *range(3000, 3059)],
]
CHUNK = 32  # --chunked-prefill-size: the last prompt and BIG are prefilled in several chunks
BIG = list(range(1000, 1064))  # 64 tokens: 64 * (3 + 1) * 576 * 4 B = 590 KB per capture
BOUND = 1_500_000  # two BIG captures fit, a third does not
TIMING_KEYS = {"e2e_latency", "response_sent_to_client_ts"}  # differ between any two runs


def _args(model) -> list[str]:
    return [*capture_args(model, _layer_ids(model)), "--chunked-prefill-size", str(CHUNK)]


def _layer_ids(model) -> list[int]:
    from aerie.capture import convention_for, to_engine_ids
    from aerie.target import describe

    target = describe(model)
    return to_engine_ids(POINTS, convention_for("sglang", target.architecture), target.num_layers)


def _plain_requests() -> list[dict]:
    """Requests without the flag, in the shapes the project sends them (and plain generation)."""
    ids = PROMPTS[1]
    return [
        {"rid": "plain", "input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
        {"rid": "hidden", "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
         "return_hidden_states": True},
        {"rid": "topk", "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
         "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 5},
        {"rid": "text", "text": "The capital of France is", "sampling_params": {"max_new_tokens": 3, "temperature": 0}},
    ]  # fmt: skip


def _comparable(body: bytes) -> str:
    """The response with its timing fields removed, key order kept."""
    out = json.loads(body)
    for key in TIMING_KEYS:
        out.get("meta_info", {}).pop(key, None)
    return json.dumps(out)


def engine_settings(server, **kw) -> Settings:
    """One request at a time: batch composition changes the low bits of SGLang's floats."""
    return Settings(engine="sglang", engine_urls=[server.url], engine_concurrency=1, engine_timeout_s=120, **kw)


def make_run(name: str, model, settings: Settings, signal: str = "final") -> RunSpec:
    """A run as ingest records it: the engine spec (and transport) comes from the server."""
    from aerie.target import describe

    target = describe(model)
    return RunSpec(
        run=name, dataset="inline", target=target, engine=SGLangEngine.spec_for(settings, target, POINTS, "float32"),
        capture_points=POINTS, dtype="float32", target_signal=signal, topk=5 if signal == "topk" else None,
        ingest=IngestOptions(),
    )  # fmt: skip


API_KEY = "aerie-test-" + secrets.token_hex(8)  # the stock server runs with SGLang's --api-key


@pytest.fixture(scope="module")
def stock(smollm2_path, plugin_starting, tmp_path_factory) -> dict:
    """Stock SGLang (aerie's plugin excluded, SGLang's own kept) started with `--api-key`: its
    answers to `_plain_requests()`, what the extractor's engine makes of such a server, and what
    the engine and `aerie bench` do with the key (AERIE_ENGINE_API_KEY) and without it. (The
    plugin server is already starting beside it: `plugin_starting`.)"""
    args = [*_args(smollm2_path), "--api-key", API_KEY]
    env = {"SGLANG_PLUGINS": "smg-servicer,smg-zmq"}
    with sglang_server(args, env=env, log_dir=tmp_path_factory.mktemp("stock")) as server:
        with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
            out: dict = {"info": client.get(server.url + "/server_info").json()}
            out["responses"] = {
                r["rid"]: _comparable(client.post(server.url + "/generate", json=r).content) for r in _plain_requests()
            }
        keyed = engine_settings(server, engine_api_key=API_KEY)
        auto = make_run("stock-auto", smollm2_path, keyed, signal="topk")
        out["auto_transport"] = auto.engine.transport
        refusals = []
        try:
            make_run(
                "stock-binary", smollm2_path, engine_settings(server, engine_transport="binary", engine_api_key=API_KEY)
            )
        except EngineMismatch as e:
            refusals.append(str(e))
        binary_run = auto.model_copy(update={"engine": auto.engine.model_copy(update={"transport": "binary"})})
        final_over_json = auto.model_copy(update={"target_signal": "final", "topk": None})
        for run in (binary_run, final_over_json):
            try:
                SGLangEngine(keyed, run).check(run)
            except EngineMismatch as e:
                refusals.append(str(e))
        out["refusals"] = refusals
        out["api_key"] = _with_and_without_the_key(server, auto, keyed, tmp_path_factory.mktemp("bench"))
        return out


def _with_and_without_the_key(server, run: RunSpec, keyed: Settings, tmp: Path) -> dict:
    """The engine and `aerie bench` against a server with --api-key: a capture and a chat with the
    key, the refusal (naming AERIE_ENGINE_API_KEY) without it."""
    from aerie.app import bench

    got: dict = {"unauthenticated_status": httpx.get(server.url + "/server_info", timeout=30).status_code}
    (captured,) = SGLangEngine(keyed, run).capture([np.asarray(PROMPTS[0], dtype=np.int32)])
    got["engine_aux_shape"] = list(captured.aux.shape)
    try:
        SGLangEngine(engine_settings(server), run).check(run)
    except EngineMismatch as e:
        got["engine_without"] = str(e)
    got.update(_evaluation_and_align(server, keyed))
    prompts = [bench.Prompt("p1", "", ["Say hello."])]
    _, completions = bench.run(server.url, prompts, max_tokens=1, api_key=API_KEY)
    got["bench_tokens"] = completions[0].completion_tokens
    prompt_file = tmp / "prompts.jsonl"
    prompt_file.write_text(json.dumps({"prompt": "Say hello."}) + "\n")
    command = [
        str(Path(sys.executable).with_name("aerie")),
        "bench",
        "--url",
        server.url,
        "--prompts",
        str(prompt_file),
        "--max-tokens",
        "1",
    ]
    for name, env in (("cli_with", clean_env(AERIE_ENGINE_API_KEY=API_KEY)), ("cli_without", clean_env())):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        got[name] = (done.returncode, done.stdout + done.stderr)
    return got


def _evaluation_and_align(server, keyed: Settings) -> dict:
    """The trainer's evaluation target and align's client through the keyed server: the key goes
    to the configured URL (AERIE_EVAL_SERVER, AERIE_ENGINE_URLS) and never to a URL a message
    names (align's request: the same server under another name gets no key, so HTTP 401)."""
    from aerie import sglang_client
    from aerie_extractor.align import Client
    from aerie_trainer.evaluate import SGLangTarget

    got: dict = {}
    layer_ids = [1, 14, 26]
    eval_settings = Settings(eval_server=server.url, engine_api_key=API_KEY)
    key = sglang_client.api_key_for(eval_settings, server.url)
    target = SGLangTarget(server.url, layer_ids, len(POINTS), 576, "LlamaForCausalLM", api_key=key)
    aux, greedy = target.forward(PROMPTS[0])
    got["eval_aux_shape"], got["eval_greedy"] = list(aux.shape), len(greedy)
    try:
        SGLangTarget(server.url, layer_ids, len(POINTS), 576)
    except sglang_client.SGLangError as e:
        got["eval_without"] = str(e)
    configured = Client(keyed, server.url, 576, 5)
    got["align_info"] = bool(
        sglang_client.server_info(configured.http, server.url).get("enable_return_aux_hidden_states")
    )
    elsewhere = server.url.replace("127.0.0.1", "localhost")  # the same server, not a configured URL
    message = Client(keyed, elsewhere, 576, 5)
    got["align_message_header"] = message.http.headers.get("authorization")
    try:
        sglang_client.server_info(message.http, elsewhere)
    except sglang_client.SGLangUnauthorized as e:
        got["align_message"] = str(e)
    configured.http.close()
    message.http.close()
    return got


@pytest.fixture(scope="module")
def stock_responses(stock) -> dict[str, str]:
    return stock["responses"]


@pytest.fixture(scope="module")
def bucket(s3_server):
    from aerie.store import S3Store

    store = S3Store(s3_server.endpoint, "cap-" + secrets.token_hex(5), s3_server.access_key, s3_server.secret_key)
    store.ensure_bucket()
    yield store
    store.delete_prefix("")
    store.client.remove_bucket(store.bucket)


@pytest.fixture(scope="module")
def plugin_starting(smollm2_path, bucket, s3_server, tmp_path_factory):
    """The plugin server, started in the background as the module's first server fixture is set
    up (its start overlaps the stock server's; `server` waits for it)."""
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path_factory.mktemp("shm")
    shm_dir = shm / f"aerie-test-{secrets.token_hex(4)}"
    env = {
        "AERIE_SGLANG_BINARY": "1",
        "AERIE_CAPTURE_DIR": str(shm_dir),
        "AERIE_CAPTURE_MAX_UNCLAIMED_BYTES": str(BOUND),
        # shm captures through the writer process (the DeepSeek plugin servers run the default,
        # writer threads); s3 captures still go through the threads
        "AERIE_CAPTURE_WRITER": "process",
        "AERIE_STORE": s3_server.endpoint,
        "AERIE_BUCKET": bucket.bucket,
        "AERIE_S3_ACCESS_KEY": s3_server.access_key,
        "AERIE_S3_SECRET_KEY": s3_server.secret_key,
    }
    args = _args(smollm2_path)
    starting = start_soon(sglang_server(args, env=env, log_dir=tmp_path_factory.mktemp("plugin")))
    try:
        yield starting, shm_dir
    finally:
        starting.stop()
    for f in shm_dir.glob("*"):
        f.unlink()
    if shm_dir.exists():
        shm_dir.rmdir()


@pytest.fixture(scope="module")
def server(stock_responses, plugin_starting):
    """The plugin server, once the stock server has answered and stopped."""
    starting, shm_dir = plugin_starting
    s = starting.ready()
    s.extra["shm_dir"] = shm_dir
    return s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def shm(client) -> CaptureReader:
    """A reader bound to the server's advertised shm directory, as the engine binds one."""
    return reader_for(client.get("/server_info").json(), "shm")


@pytest.fixture(scope="module")
def hf_reference(smollm2_path):
    """transformers' output_hidden_states (float32) for every prompt: [N+1, T, H]."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    out = {}
    with torch.no_grad():
        for ids in [*PROMPTS, BIG]:
            hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
            out[tuple(ids)] = np.stack([h[0].numpy() for h in hs])
    return out


def _capture(client, ids, sink) -> dict:
    r = client.post("/generate", json=capture_body(ids, sink))
    assert r.status_code == 200, r.text
    return descriptor_of(r.json())


def _shm_bytes(server) -> int:
    return sum(f.stat().st_size for f in server.extra["shm_dir"].glob("*") if f.is_file())


# --------------------------------------------------------------------------------------------
def test_server_advertises_the_plugin(client, server, bucket):
    info = advertised(client.get("/server_info").json())
    assert info is not None and info["sglang"] == "0.5.23"
    assert info["sinks"]["shm"]["dir"] == str(server.extra["shm_dir"])
    assert info["sinks"]["s3"]["bucket"] == bucket.bucket
    assert info["max_unclaimed_bytes"] == BOUND


def test_binary_equals_json_and_transformers(client, server, smollm2_path, hf_reference, shm):
    layer_ids = _layer_ids(smollm2_path)
    for ids in PROMPTS:
        descriptor = _capture(client, ids, "shm")
        assert descriptor.layer_ids == layer_ids and descriptor.rows == len(ids)
        binary = fetch_binary(descriptor, shm)
        assert not Path(descriptor.path).exists(), "fetch_binary claims (deletes) the capture"
        aux, final = binary["aux"], binary["final"]
        assert aux.shape == (len(ids), len(POINTS), 576) and final.shape == (len(ids), 576)
        assert aux.dtype == np.float32 and final.dtype == np.float32

        plain = client.post("/generate", json={"input_ids": ids, "return_hidden_states": True,
                                               "sampling_params": {"max_new_tokens": 1, "temperature": 0}})  # fmt: skip
        as_json = np.asarray(plain.json()["meta_info"]["hidden_states"][0], dtype=np.float32)
        if len(ids) <= CHUNK:
            np.testing.assert_array_equal(aux.reshape(len(ids), -1), as_json)  # the very same tensors
        else:  # stock SGLang drops the rows of all but the last prefill chunk; the plugin keeps them
            assert len(as_json) == len(ids) - CHUNK
            np.testing.assert_array_equal(aux[CHUNK:].reshape(len(as_json), -1), as_json)

        hf = hf_reference[tuple(ids)]
        for j, point in enumerate(POINTS):
            np.testing.assert_allclose(aux[:, j], hf[point], rtol=1e-4, atol=1e-4, err_msg=f"capture point {point}")
        np.testing.assert_allclose(final, hf[30], rtol=1e-4, atol=1e-4, err_msg="final (post-norm) state")


def test_s3_sink_gives_the_same_tensors(client, bucket, shm):
    ids = PROMPTS[2]
    via_shm = fetch_binary(_capture(client, ids, "shm"), shm)
    descriptor = _capture(client, ids, "s3")
    assert descriptor.bucket == bucket.bucket and descriptor.key.startswith("capture/")
    via_s3 = fetch_binary(descriptor, reader_for(client.get("/server_info").json(), "s3", store=bucket))
    for name in ("aux", "final"):
        np.testing.assert_array_equal(via_s3[name], via_shm[name])
    assert not bucket.exists(descriptor.key), "fetch_binary claims (deletes) the object"


def put_tokens(store, run: RunSpec, shards: dict[str, list[list[int]]]) -> None:
    """run.json and token shards (ids as given, every token in the loss) as ingest writes them."""
    store.put_json(layout.run_spec(run.run), run)
    for name, seqs in shards.items():
        rows = [
            {"input_ids": np.asarray(ids, dtype=np.int32), "loss_mask": np.ones(len(ids), dtype=np.uint8)}
            for ids in seqs
        ]
        data = pack(rows, extra_metadata={"run": run.run, "shard": name}).to_bytes()
        key = layout.shard(run.run, "tokens", name)
        sha = store.put_bytes(key, data)
        store.put_json(layout.shard_record(run.run, "tokens", name), ShardRecord(
            run=run.run, shard=name, kind="tokens", key=key, sha256=sha, bytes=len(data),
            sequences=len(seqs), tokens=sum(map(len, seqs)), loss_tokens=sum(map(len, seqs))))  # fmt: skip


def extract(store, settings: Settings, run: RunSpec, shard: str) -> tuple[Shard, ShardRecord]:
    run_extract(store, settings, ExtractRequest(run=run.run, shard=shard), engine=SGLangEngine(settings, run))
    record = store.get_json(layout.shard_record(run.run, "hidden", shard), ShardRecord)
    return Shard.from_buffer(store.get_bytes(record.key)).validate(), record


def test_a_stock_server_gets_json_runs_and_binary_ones_are_refused(stock):
    assert "aerie_capture" not in stock["info"] and stock["auto_transport"] == "json"
    new_binary, binary_on_stock, final_over_json = stock["refusals"]
    assert "AERIE_ENGINE_TRANSPORT=binary" in new_binary and "AERIE_SGLANG_BINARY=1" in new_binary
    assert "ingested for the binary path" in binary_on_stock and "do not advertise" in binary_on_stock
    assert "target signal 'final'" in final_over_json and "target_signal 'topk'" in final_over_json


def test_the_engine_extracts_through_the_binary_path(server, smollm2_path, bucket, hf_reference):
    """Shards made by run_extract through the binary path (read into the shard's rows) hold the
    final state; their aux equal the JSON path's bit for bit, and both equal transformers for every
    capture point."""
    settings = engine_settings(server)
    binary = make_run("bin", smollm2_path, settings)
    binary_topk = make_run("bin-topk", smollm2_path, settings, signal="topk")
    as_json = make_run("json", smollm2_path, engine_settings(server, engine_transport="json"), signal="topk")
    assert (binary.engine.transport, binary_topk.engine.transport, as_json.engine.transport) == (
        "binary",
        "binary",
        "json",
    )
    # a binary "final" run is read straight into the shard's rows; top-k and JSON runs go through capture()
    assert [SGLangEngine(settings, run).capture_into is not None for run in (binary, binary_topk)] == [True, False]
    short = PROMPTS[:2]  # one prefill chunk: stock JSON keeps only a prompt's last chunk
    put_tokens(bucket, binary, {"000000": short, "000001": [PROMPTS[2], BIG]})
    put_tokens(bucket, binary_topk, {"000000": short})
    put_tokens(bucket, as_json, {"000000": short})

    for shard in ("000000", "000001"):
        hidden, record = extract(bucket, settings, binary, shard)
        assert record.engine == binary.engine and record.engine.transport == "binary"
        assert hidden.target_signal == "final" and hidden.capture_points == POINTS
        for seq in hidden.sequences():
            hf = hf_reference[tuple(seq["input_ids"].tolist())]
            for j, point in enumerate(POINTS):
                np.testing.assert_allclose(seq["aux"][:, j], hf[point], rtol=1e-4, atol=1e-4, err_msg=f"point {point}")
            np.testing.assert_allclose(seq["final"], hf[30], rtol=1e-4, atol=1e-4, err_msg="final state")
    from_binary = Shard.from_buffer(bucket.get_bytes(layout.shard("bin", "hidden", "000000")))

    from_json, record = extract(bucket, engine_settings(server, engine_transport="json"), as_json, "000000")
    assert record.engine.transport == "json" and from_json.target_signal == "topk"
    np.testing.assert_array_equal(from_json.aux, from_binary.aux)  # the same float32 values
    topk, _ = extract(bucket, settings, binary_topk, "000000")  # binary aux, top-k as JSON log-probs
    np.testing.assert_array_equal(topk.aux, from_binary.aux)
    np.testing.assert_array_equal(topk.topk_ids, from_json.topk_ids)
    np.testing.assert_array_equal(topk.topk_logprobs, from_json.topk_logprobs)
    assert _shm_bytes(server) == 0 and not bucket.list("capture/"), "every capture was claimed"


def test_the_server_logs_what_captures_cost(client, server, shm):
    """The sink's first writer logs, every STATS_LOG_S while captures run, the scheduler thread's
    time in the plugin per capture and the writers': what bench_capture reads to say whether the
    plugin or SGLang limits a capture server (BENCHMARKS.md, session 12)."""
    pattern = re.compile(
        r"aerie capture stats: (\d+) captures, [\d.]+ GB written; scheduler thread ([\d.]+) ms/capture, "
        r"([\d.]+) on its CPU \(admission ([\d.]+), rows ([\d.]+): kept [\d.]+, to host [\d.]+\); "
        r"writers ([\d.]+) ms/capture, ([\d.]+) on their CPU \(device copy [\d.]+, sha256 ([\d.]+), "
        r"write [\d.]+\); (\d+) listings"
    )
    fetch_binary(_capture(client, PROMPTS[0], "shm"), shm)  # at least one capture, whatever ran before
    deadline = time.monotonic() + 10
    while not (found := pattern.findall(server.log_path.read_text(errors="replace"))) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert found, "no 'aerie capture stats' line in the server's log"
    captures, scheduler, scheduler_cpu, admission, rows, writers, writers_cpu, sha256, listings = found[-1]
    assert int(captures) >= 1
    assert float(scheduler) > 0 and float(admission) > 0 and float(rows) > 0
    assert 0 < float(scheduler_cpu) <= float(scheduler) * 1.05 + 0.002  # thread CPU time within its wall time
    assert float(writers) >= float(sha256) > 0 and 0 < float(writers_cpu) <= float(writers) * 1.05 + 0.002
    assert int(listings) >= 1
    # this server's shm captures went through the writer process (AERIE_CAPTURE_WRITER=process)
    process = re.findall(
        r"aerie capture writer process: (\d+) groups, ([\d.]+) captures per group",
        server.log_path.read_text(errors="replace"),
    )
    assert process and int(process[-1][0]) >= 1 and float(process[-1][1]) >= 1, (
        "no writer process line in the server's log"
    )


def test_auto_chooses_json_where_the_captures_cannot_be_read(server, smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setattr(SGLangEngine, "probe_timeout_s", 0.5)
    tmp_path.chmod(0o700)  # a valid capture directory, but not the server's: as if on another host
    elsewhere = {"engine_shm_dir": tmp_path}
    assert (
        make_run("elsewhere", smollm2_path, engine_settings(server, **elsewhere), signal="topk").engine.transport
        == "json"
    )
    with pytest.raises(EngineMismatch, match="cannot read them.*did not appear"):
        make_run("elsewhere", smollm2_path, engine_settings(server, engine_transport="binary", **elsewhere))
    wait_until(lambda: len(list(server.extra["shm_dir"].glob("*.safetensors"))) >= 2, 30, "the two probes' captures")
    for f in server.extra["shm_dir"].glob("*.safetensors"):  # the two probes' captures, never claimed
        f.unlink()


def test_requests_without_the_flag_are_answered_as_stock(client, stock_responses, shm):
    for request in _plain_requests():
        got = _comparable(client.post("/generate", json=request).content)
        assert got == stock_responses[request["rid"]], request["rid"]
    # While captures share their batches: the same fields, the same tokens, nothing of ours. (The
    # floats may differ from a lone run, as with stock SGLang: another batch composition splits
    # prefill chunks differently and rounds its matmuls differently.)
    with ThreadPoolExecutor(8) as pool:
        captures = [pool.submit(_capture, client, ids, "shm") for ids in PROMPTS]
        plain = {r["rid"]: pool.submit(client.post, "/generate", json=r) for r in _plain_requests()}
        for future in captures:  # claimed first: a failure below must not leave the sink full
            fetch_binary(future.result(), shm)
        for rid, future in plain.items():
            got, stock = json.loads(_comparable(future.result().content)), json.loads(stock_responses[rid])
            assert list(got) == list(stock) and list(got["meta_info"]) == list(stock["meta_info"]), rid
            assert got["output_ids"] == stock["output_ids"], rid


def test_a_full_sink_refuses_captures_and_the_server_keeps_serving(client, server, smollm2_path, shm):
    run = make_run("full", smollm2_path, engine_settings(server))
    engine = SGLangEngine(engine_settings(server), run)
    engine.check(run)  # its probe needs room in the sink
    first, second = _capture(client, BIG, "shm"), _capture(client, BIG, "shm")
    wait_until(
        lambda: Path(first.path).exists() and Path(second.path).exists(), 30, "the two captures in the sink", poll=0.05
    )

    refused = client.post("/generate", json=capture_body(BIG, "shm"))
    assert refused.status_code == 503
    assert "AERIE_CAPTURE_MAX_UNCLAIMED_BYTES" in refused.text and "unclaimed" in refused.text
    assert client.post("/generate", json=_plain_requests()[0]).status_code == 200  # still serving
    too_big = client.post("/generate", json=capture_body(list(range(100, 300)), "shm"))
    assert too_big.status_code == 503 and "more than the bound" in too_big.text

    # the engine waits for room, then fails (a retryable error) with the server's reason
    engine.sink_full_wait_s = 1.0
    with pytest.raises(EngineError, match="still full after 1 s.*AERIE_CAPTURE_MAX_UNCLAIMED_BYTES") as err:
        engine.capture([np.asarray(BIG, dtype=np.int32)])
    assert err.value.retryable
    with pytest.raises(EngineError, match="more than the bound") as err:
        engine.capture([np.arange(100, 300, dtype=np.int32)])
    assert not err.value.retryable
    # ... and gets through once others claim theirs while it waits
    engine.sink_full_wait_s = 60.0
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(engine.capture, [np.asarray(BIG, dtype=np.int32)])
        time.sleep(1.0)  # a negative check: for this second the capture must still be waiting
        assert not waiting.done()
        for descriptor in (first, second):  # claiming frees the sink
            fetch_binary(descriptor, shm)
        assert waiting.result(timeout=60)[0].final.shape == (64, 576)
    assert fetch_binary(_capture(client, BIG, "shm"), shm)["aux"].shape == (64, 3, 576)


def test_the_s3_sink_counts_in_the_bound(client, bucket):
    """Captures uploaded to the bucket and not claimed hold the server's bound like files in the
    shm directory: a third BIG one is refused until a client claims them (on 2026-12-02's code
    the s3 sink had no bound: uploads were never counted)."""
    s3 = reader_for(client.get("/server_info").json(), "s3", store=bucket)
    first, second = _capture(client, BIG, "s3"), _capture(client, BIG, "s3")
    wait_until(lambda: bucket.exists(first.key) and bucket.exists(second.key), 30, "the two uploads", poll=0.05)
    refused = client.post("/generate", json=capture_body(BIG, "s3"))
    assert refused.status_code == 503 and "s3 prefix capture/" in refused.text, refused.text
    for descriptor in (first, second):  # claiming frees the bound once the server's next listing sees it
        fetch_binary(descriptor, s3)

    def admitted():
        r = client.post("/generate", json=capture_body(BIG, "s3"))
        return r if r.status_code == 200 else None

    third = descriptor_of(wait_until(admitted, 30, "a capture admitted after the claims", poll=0.5).json())
    assert fetch_binary(third, s3)["aux"].shape == (64, 3, 576) and not bucket.list("capture/")


def test_bad_capture_requests_name_the_fix(client):
    body = capture_body(PROMPTS[0], "shm")
    body["sampling_params"]["max_new_tokens"] = 2
    r = client.post("/generate", json=body)
    assert r.status_code == 400 and "max_new_tokens to 1" in r.text
    body = capture_body(PROMPTS[0], "nfs")
    r = client.post("/generate", json=body)
    assert r.status_code == 400 and "'nfs' is not configured" in r.text
    body = capture_body(PROMPTS[0], "shm")
    body["return_hidden_states"] = False
    r = client.post("/generate", json=body)
    assert r.status_code == 400 and "return_hidden_states: true" in r.text


_GREEDY_CLIENT = """
import sys, httpx
url, ids = sys.argv[1], list(range(1000, 1064))
body = {"input_ids": ids, "return_hidden_states": True,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0, "custom_params": {"aerie_capture": "shm"}}}
with httpx.Client(timeout=120) as c:
    while True:  # asks, never claims
        r = c.post(url + "/generate", json=body)
        print(r.status_code, flush=True)
"""


_EXTRACTOR = """
import sys, numpy as np
from aerie.contracts import RunSpec
from aerie.settings import Settings
from aerie_extractor.engines.sglang import SGLangEngine
url, run = sys.argv[1], RunSpec.model_validate_json(sys.argv[2])
engine = SGLangEngine(Settings(engine="sglang", engine_urls=[url], engine_concurrency=4), run)
sequences = [np.arange(1000 + i, 1064 + i, dtype=np.int32) for i in range(4)]
while True:  # 4 requests in flight (room for 2 in the sink), each claimed as it comes back
    engine.capture(sequences)
    print("captured", flush=True)
"""


def test_a_killed_extractor_or_client_leaves_no_more_than_the_bound(client, server, smollm2_path, shm):
    assert _shm_bytes(server) == 0
    run = make_run("killed", smollm2_path, engine_settings(server))
    env = clean_env()
    extractor = subprocess.Popen([sys.executable, "-c", _EXTRACTOR, server.url, run.model_dump_json()],
                                 stdout=subprocess.PIPE, text=True, cwd=REPO, env=env)  # fmt: skip
    watchdog = threading.Timer(300, extractor.kill)  # readline below cannot wait forever
    watchdog.start()
    try:
        assert extractor.stdout.readline().strip() == "captured", "the extractor failed or hung (see stderr)"
    finally:  # mid-way through its second round
        watchdog.cancel()
        extractor.send_signal(signal.SIGKILL)
        extractor.wait(timeout=10)
    wait_settled(lambda: _shm_bytes(server), 60, "requests in flight after the kill")
    assert _shm_bytes(server) <= BOUND

    # a client that asks and never claims fills the sink to the bound, and no further
    proc = subprocess.Popen([sys.executable, "-c", _GREEDY_CLIENT, server.url], stdout=subprocess.PIPE, text=True)
    try:
        codes = []
        deadline = time.monotonic() + 120
        while "503" not in codes:  # until it has filled the sink
            assert time.monotonic() < deadline and proc.poll() is None, f"client got {codes}"
            codes.append(proc.stdout.readline().split()[0])
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    wait_settled(lambda: _shm_bytes(server), 60, "a request in flight after the kill")
    orphans = list(server.extra["shm_dir"].glob("*.safetensors"))
    assert orphans and _shm_bytes(server) <= BOUND
    assert client.post("/generate", json=capture_body(BIG, "shm")).status_code == 503

    # Orphans older than AERIE_CAPTURE_TTL_S are deleted by the server; age them instead of waiting.
    old = time.time() - 3600
    for f in orphans:
        os.utime(f, (old, old))
    wait_until(lambda: not any(f.exists() for f in orphans), 30, "the server's deletion of expired captures", poll=0.2)
    assert fetch_binary(_capture(client, BIG, "shm"), shm)["final"].shape == (64, 576)


def test_a_lost_capture_fails_with_the_place_it_was_expected(tmp_path):
    descriptor = CaptureDescriptor(
        v=1,
        id="0" * 32,
        sink="shm",
        format="safetensors",
        nbytes=0,
        rows=0,
        layer_ids=[],
        tensors={},
        path=str(tmp_path / ("0" * 32 + ".safetensors")),
    )
    with pytest.raises(BinaryCaptureError, match="did not appear"):
        fetch_binary(descriptor, CaptureReader("shm", shm_dir=tmp_path, timeout_s=0.2))


def test_a_capture_the_server_could_not_write_fails_with_its_reason(tmp_path):
    (tmp_path / ("1" * 32 + ".error")).write_text("the SGLang server could not write x: No space left on device")
    descriptor = CaptureDescriptor(
        v=1,
        id="1" * 32,
        sink="shm",
        format="safetensors",
        nbytes=0,
        rows=0,
        layer_ids=[],
        tensors={},
        path=str(tmp_path / ("1" * 32 + ".safetensors")),
    )
    with pytest.raises(BinaryCaptureError, match="No space left on device"):
        fetch_binary(descriptor, CaptureReader("shm", shm_dir=tmp_path, timeout_s=5))
    assert not list(tmp_path.iterdir()), "the reason is claimed too"


def _descriptor(sink: str, **where) -> CaptureDescriptor:
    return CaptureDescriptor(
        v=1, id="ab" * 16, sink=sink, format="safetensors", nbytes=0, rows=0, layer_ids=[], tensors={}, **where
    )


@pytest.mark.parametrize(
    "case", ["shm-unbound", "shm-outside", "shm-other-name", "shm-dotdot", "s3-run-record", "s3-other-name"]
)
def test_capture_descriptors_cannot_name_a_path_or_key_outside_the_capture_sink(fs_store, s3_store, tmp_path, case):
    """A server (or whoever answers in its place) names a file or key of its choosing in a capture
    descriptor: refused (not retryable, naming the settings) before anything is read or deleted.
    On 2026-12-02's code the named file or object was read, then deleted even though it failed
    the capture checks."""
    captures, victim = tmp_path / "captures", tmp_path / "victim.txt"
    captures.mkdir(mode=0o700)
    victim.write_text("precious")
    (captures / "notes.txt").write_text("not a capture")
    s3_store.put_bytes("runs/r1/run.json", b"{}")
    s3_store.put_bytes("capture/notes.safetensors", b"not a capture")
    reader, descriptor = {
        "shm-unbound": (CaptureReader("shm", timeout_s=0.5), _descriptor("shm", path=str(victim))),
        "shm-outside": (CaptureReader("shm", shm_dir=captures, timeout_s=0.5), _descriptor("shm", path=str(victim))),
        "shm-other-name": (
            CaptureReader("shm", shm_dir=captures, timeout_s=0.5),
            _descriptor("shm", path=str(captures / "notes.txt")),
        ),
        "shm-dotdot": (
            CaptureReader("shm", shm_dir=captures, timeout_s=0.5),
            _descriptor("shm", path=f"{captures}/../victim.txt"),
        ),
        "s3-run-record": (
            CaptureReader("s3", store=s3_store, timeout_s=0.5),
            _descriptor("s3", endpoint="http://x", bucket=s3_store.bucket, key="runs/r1/run.json"),
        ),
        "s3-other-name": (
            CaptureReader("s3", store=s3_store, timeout_s=0.5),
            _descriptor("s3", endpoint="http://x", bucket=s3_store.bucket, key="capture/notes.safetensors"),
        ),
    }[case]
    if hasattr(reader, "server_dir"):  # bound as the engine binds it to the server's advertisement
        choose_sink(
            {"sinks": {"shm": {"dir": str(captures)}, "s3": {"bucket": s3_store.bucket, "prefix": "capture/"}}}, reader
        )
    with pytest.raises(EngineMismatch, match="refused") as refused:
        fetch_binary(descriptor, reader)
    assert not refused.value.retryable
    assert "AERIE_CAPTURE" in str(refused.value) or "AERIE_ENGINE_SHM_DIR" in str(refused.value), refused.value
    assert victim.read_text() == "precious" and (captures / "notes.txt").exists()
    assert s3_store.exists("runs/r1/run.json") and s3_store.exists("capture/notes.safetensors")


def test_the_capture_directory_the_server_advertises_is_checked_before_use(tmp_path):
    """The directory read (advertised, or AERIE_ENGINE_SHM_DIR) must be absolute, a real directory
    and private to its owner: the engine refuses a symlink or a directory others may write."""
    ok = tmp_path / "ok"
    ok.mkdir(mode=0o700)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    link = tmp_path / "link"
    link.symlink_to(ok)
    choose_sink({"sinks": {"shm": {"dir": str(ok)}}}, reader := CaptureReader("shm"))
    assert reader.shm_dir == ok
    for bad in ("relative/dir", f"{ok}/../ok", str(shared), str(link), str(tmp_path / "missing")):
        with pytest.raises(EngineMismatch, match="AERIE_ENGINE_SHM_DIR"):
            choose_sink({"sinks": {"shm": {"dir": bad}}}, CaptureReader("shm"))
    with pytest.raises(EngineMismatch, match="AERIE_ENGINE_SHM_DIR"):  # the setting is checked the same way
        choose_sink({"sinks": {"shm": {"dir": str(ok)}}}, CaptureReader("shm", shm_dir=shared))
    for prefix in ("runs/", "/capture/", "capture", "a/../b/", "", 7):
        with pytest.raises(EngineMismatch, match="AERIE_CAPTURE_S3_PREFIX"):
            choose_sink({"sinks": {"s3": {"bucket": "b", "prefix": prefix}}}, CaptureReader("s3", store=_Bucket("b")))


class _Bucket:
    """Only what choose_sink reads of a store: its bucket."""

    def __init__(self, bucket: str):
        self.bucket = bucket


def test_sglang_api_key_is_sent_by_the_engine_and_bench(stock):
    """SGLang started with --api-key refuses requests without it (401); the extractor's engine
    (check, a JSON capture) and `aerie bench` (library and command) send AERIE_ENGINE_API_KEY as a
    bearer token, and without it fail in one line naming that setting. On 2026-12-02's code
    neither sent a key: the engine's very first /server_info was refused."""
    got = stock["api_key"]
    assert got["unauthenticated_status"] == 401
    assert got["engine_aux_shape"] == [len(PROMPTS[0]), len(POINTS), 576]
    assert "AERIE_ENGINE_API_KEY" in got["engine_without"] and "401" in got["engine_without"]
    assert got["bench_tokens"] == 1
    assert got["eval_aux_shape"] == [1, len(PROMPTS[0]), len(POINTS) * 576] and got["eval_greedy"] == len(PROMPTS[0])
    assert "401" in got["eval_without"] and "AERIE_ENGINE_API_KEY" in got["eval_without"]
    assert got["align_info"] is True
    assert got["align_message_header"] is None and "401" in got["align_message"], "no key to a message's URL"
    code, text = got["cli_with"]
    assert code == 0 and "aerie bench" in text, text
    code, text = got["cli_without"]
    lines = [line for line in text.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and "AERIE_ENGINE_API_KEY" in lines[0], text
    assert API_KEY not in got["engine_without"] + text, "the key is never printed"
