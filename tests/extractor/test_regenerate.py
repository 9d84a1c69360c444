"""The regenerate stage: a dataset's turns answered again by the target through real SGLang.

Stories (one SmolLM2 server on the CPU for the module, tiny sizes):
- a shard is answered with several requests in flight (seen in the server's own batch log, not
  taken from the setting), every turn of a multi-turn conversation equal to what the server answers
  greedily on the same regenerated history, one request at a time; stored once (a second run reuses
  the answers, asks nothing);
- a worker is SIGKILLed in the middle of a shard: the task is redelivered, that shard alone is
  answered again, and every shard's answers, tokens and hidden states exist exactly once, each
  extraction enqueued once;
- a server that answers garbage, errors or cannot be reached gives one line naming it and the setting;
- a thinking template that rewrites earlier turns is tokenized turn by turn, not refused.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
import redis

from aerie import layout, stages
from aerie.contracts import IngestOptions, IngestRequest, RegeneratedRecord, RegenerateRequest
from aerie.settings import Settings
from aerie.shard import Shard
from aerie_extractor.engines.base import EngineError
from aerie_extractor.ingest import ChatTokenizer, normalize
from aerie_extractor.regenerate import Answer, assistant_turn
from tests.conftest import POINTS
from tests.services import free_port, wait_until
from tests.workers import ExtractorWorker as Worker
from tests.workers import celery_cli, wait_complete, worker_env

MAX_NEW = 6
SYSTEM = {"from": "system", "value": "You are terse."}
CONVERSATIONS = [
    [
        SYSTEM,
        {"from": "human", "value": "2+2?"},
        {"from": "gpt", "value": "4"},
        {"from": "human", "value": "Times 3?"},
        {"from": "gpt", "value": "12"},
    ],
    [
        {"from": "human", "value": "Name a color."},
        {"from": "gpt", "value": "Red."},
        {"from": "human", "value": "Another?"},
        {"from": "gpt", "value": "Blue."},
        {"from": "human", "value": "And one more?"},
        {"from": "gpt", "value": "Green."},
    ],
    [{"from": "human", "value": "Give me a synonym for happy."}, {"from": "gpt", "value": "Glad."}],
    [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi."}],
    [{"from": "gpt", "value": "Hello! How can I help?"}, {"from": "human", "value": "Hi"}],  # nothing to answer
]


def write_dataset(folder, conversations=CONVERSATIONS):
    path = folder / "chats.jsonl"
    path.write_text("".join(json.dumps({"conversations": c}) + "\n" for c in conversations))
    return path


@pytest.fixture(scope="module")
def chat_server(smollm2_path, tmp_path_factory):
    from tests.sglang_server import sglang_server

    with sglang_server(
        ["--model-path", str(smollm2_path), "--dtype", "float32"], log_dir=tmp_path_factory.mktemp("sglang")
    ) as server:
        yield server


def server_log_since(server, offset: int) -> str:
    return server.log_path.read_text(errors="replace")[offset:]


def most_at_once(log: str) -> int:
    """Most requests the server held at once, by its own scheduler log: a prefill batch's new
    sequences plus those already running."""
    return max([int(a) + int(b) for a, b in re.findall(r"#new-seq: (\d+),.*?#running-req: (\d+)", log)] or [0])


def greedy(url: str, messages: list[dict]) -> str:
    body = {"model": "default", "messages": messages, "temperature": 0.0, "max_tokens": MAX_NEW}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"].strip()


@pytest.mark.slow
@pytest.mark.sglang
def test_a_shard_answered_with_requests_in_flight_equals_the_servers_own_greedy_turns(
    fs_store, smollm2_path, chat_server, tmp_path
):
    dataset = write_dataset(tmp_path)
    # the same server under two names: conversations are spread over both (all turns of one on one)
    urls = [chat_server.url, chat_server.url.replace("127.0.0.1", "localhost")]
    settings = Settings(engine="hf", regenerate_urls=urls, regenerate_concurrency=4, ingest_local_dirs=[tmp_path])
    options = IngestOptions(
        max_tokens=256, shard_tokens=4096, regenerate=True, regenerate_max_tokens=MAX_NEW, regenerate_max_turns=2
    )
    ingested = stages.ingest(
        fs_store,
        settings,
        IngestRequest(
            run="regen", dataset=str(dataset), model=str(smollm2_path), capture_points=POINTS, options=options
        ),
    )
    assert (
        ingested.regenerate_shards == ["000000"] and ingested.shards == [] and ingested.rejects == 1
    )  # the assistant-first one
    offset = len(chat_server.log_path.read_text(errors="replace"))
    events = []
    result = stages.regenerate(fs_store, settings, RegenerateRequest(run="regen", shard="000000"), events.append)
    served = server_log_since(chat_server, offset)
    assert result.conversations == 4 and result.turns == 2 + 2 + 1 + 1, result  # the turn limit cut the colors at 2
    assert result.completion_tokens > 0 and result.tokens_per_second > 0
    assert result.max_in_flight > 1, result  # from the requests' own start and end times
    assert most_at_once(served) > 1, served[-3000:]  # and by the server's own account
    record = fs_store.get_json(layout.regenerated_record("regen", "000000"), RegeneratedRecord)
    assert record.servers == urls and record.token_sequences == 4 and record.max_in_flight == result.max_in_flight
    if result.seconds > 2.5:  # a progress event every 2 s: tokens/s and requests in flight
        assert events and events[0].stage == "regenerate" and events[0].in_flight is not None

    # every turn is the server's own greedy answer on the regenerated history, asked one at a time
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    answered = [
        json.loads(line) for line in fs_store.get_bytes(layout.regenerated("regen", "000000")).decode().splitlines()
    ]
    (shard,) = [
        Shard.from_buffer(fs_store.get_bytes(k))
        for k in fs_store.list(layout.shards_prefix("regen", "tokens"))
        if k.endswith(".safetensors")
    ]
    for i, conversation in enumerate(CONVERSATIONS[:4]):
        history, expected = [], []
        for m in normalize({"conversations": conversation}):
            if m["role"] == "assistant":
                if len(expected) == 2:
                    break
                m = {"role": "assistant", "content": greedy(chat_server.url, history)}
                expected.append(m["content"])
            history.append(m)
        while history[-1]["role"] != "assistant":  # what follows the last answered turn is dropped
            history.pop()
        assert answered[i]["messages"] == history, (i, answered[i])
        seq = shard.sequence(i)
        assert tok.decode(seq["input_ids"][seq["loss_mask"] == 1]) == "".join(a + "<|im_end|>" for a in expected)

    # stored once: the tokens exist, so the shard is skipped; without them the answers are reused, not asked again
    assert stages.regenerate(fs_store, settings, RegenerateRequest(run="regen", shard="000000")).skipped
    fs_store.delete(layout.shard_record("regen", "tokens", "000000"))
    offset = len(chat_server.log_path.read_text(errors="replace"))
    again = stages.regenerate(fs_store, settings, RegenerateRequest(run="regen", shard="000000"))
    assert again.reused_answers and again.sequences == 4
    assert "/v1/chat/completions" not in server_log_since(chat_server, offset)


@pytest.mark.sglang
def test_a_generation_server_is_refused_for_capture_naming_the_flags_of_both_sglang_generations(
    chat_server, smollm2_path
):
    """The regenerate stage's plain server is not a capture server: the extract engine says how
    to start one, with 0.5.23's flags and, for releases without them (0.5.17), the plugin's variables."""
    from aerie.capture import convention_for, to_engine_ids
    from aerie.contracts import EngineSpec, RunSpec
    from aerie.target import describe
    from aerie_extractor.engines.base import EngineMismatch
    from aerie_extractor.engines.sglang import SGLangEngine

    target = describe(smollm2_path)
    convention = convention_for("sglang", target.architecture)
    ids = to_engine_ids(POINTS, convention, target.num_layers)
    version = httpx.get(f"{chat_server.url}/server_info", timeout=30).json()["version"]
    run = RunSpec(
        run="capture-on-plain",
        dataset="inline",
        target=target,
        capture_points=list(POINTS),
        ingest=IngestOptions(),
        target_signal="topk",
        topk=4,
        engine=EngineSpec(name="sglang", version=version, convention=convention, layer_ids=ids, transport="json"),
    )
    engine = SGLangEngine(Settings(engine="sglang", engine_urls=[chat_server.url], engine_timeout_s=60), run)
    with pytest.raises(EngineMismatch) as e:
        engine.capture([np.asarray([1, 2, 3], dtype=np.int32)])
    message = str(e.value)
    assert "\n" not in message and chat_server.url in message and "not in capture mode" in message, message
    assert f"--return-aux-hidden-state-layer-ids {' '.join(map(str, ids))}" in message, message
    assert f"AERIE_CAPTURE_LAYER_IDS={','.join(map(str, ids))}" in message and "AERIE_SGLANG_BINARY=1" in message, (
        message
    )


@pytest.mark.slow
@pytest.mark.sglang
def test_sigkill_mid_shard_redoes_that_shard_once(
    s3_store, private_redis, smollm2_path, chat_server, workers, tmp_path
):
    dataset = write_dataset(tmp_path, [CONVERSATIONS[0][:3], *(c[:2] for c in CONVERSATIONS[1:4])])
    # one request at a time: a shard of two conversations is half done when its first answer is back
    env = worker_env(
        s3_store,
        private_redis,
        AERIE_BROKER_VISIBILITY_TIMEOUT_S="6",
        AERIE_REGENERATE_URLS=json.dumps([chat_server.url]),
        AERIE_REGENERATE_CONCURRENCY="1",
    )
    victim = Worker(env, "victim", tmp_path)
    workers.append(victim)
    victim.wait_for(r"ready\.", 120)
    offset = len(chat_server.log_path.read_text(errors="replace"))
    out = celery_cli(
        env,
        "enqueue",
        "--dataset",
        str(dataset),
        "--run",
        "kill-regen",
        "--model",
        str(smollm2_path),
        "--capture-points",
        ",".join(map(str, POINTS)),
        "--dtype",
        "float32",
        "--max-tokens",
        "96",
        "--regenerate",
        "--regenerate-max-tokens",
        str(MAX_NEW),
        "--regenerate-shard-records",
        "2",
        "--train-drafter",
        "d1",
    )
    assert "enqueued aerie.ingest" in out
    killed = victim.wait_for(r"Task aerie\.regenerate\[([0-9a-f-]+)\] received", 200).group(1)
    # one answer of its shard is back, the shard's others are not: kill it there
    wait_until(
        lambda: "POST /v1/chat/completions" in server_log_since(chat_server, offset), 200, "a first answer", poll=0.1
    )
    os.killpg(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(10)
    assert f"aerie.regenerate[{killed}] succeeded" not in victim.log()
    assert len(layout.record_names(s3_store.list(layout.regenerated_prefix("kill-regen")))) < 2

    for name in ("rescuer1", "rescuer2"):
        workers.append(Worker(env, name, tmp_path))
    status = wait_complete(s3_store, "kill-regen", workers, 300, private_redis)
    assert status.hidden_done == status.shards_total == status.regenerate_total == status.regenerated == 2
    assert status.sequences == 4 and status.failed == 0
    assert any(f"aerie.regenerate[{killed}] received" in w.log() for w in workers[1:]), (
        "the killed task was not redelivered"
    )

    client = redis.Redis.from_url(private_redis)
    wait_until(
        lambda: not (client.llen("extract") or client.llen("ingest") or client.hlen("unacked")),
        120,
        "queues to drain",
        poll=1,
    )
    # the run is complete once every conversation shard is extracted: exactly one aerie.train waits
    train = [json.loads(m) for m in client.lrange("train", 0, -1)]
    client.close()
    assert [t["headers"]["task"] for t in train] == ["aerie.train"], train
    shards = ["000000", "000001"]
    assert s3_store.list(layout.regenerated_prefix("kill-regen")) == [
        f"runs/kill-regen/regenerated/{s}.{ext}" for s in shards for ext in ("json", "jsonl")
    ]
    for kind in ("tokens", "hidden"):
        assert s3_store.list(layout.shards_prefix("kill-regen", kind)) == [
            f"runs/kill-regen/{kind}/{s}.{ext}" for s in shards for ext in ("json", "safetensors")
        ]
    # each shard's extraction was enqueued once, the redelivered shard's too
    logs = "".join(w.log() for w in workers)
    assert len(set(re.findall(r"Task aerie\.extract\[([0-9a-f-]+)\] received", logs))) == 2, logs[-4000:]
    # a redelivery redoes its one shard, never the run: the two shards, plus the killed shard's one
    # redelivery (a live worker keeps its task past the 6 s visibility timeout: aerie.queue.KeepVisible);
    # 4 answers, plus the 1-2 the victim had when it died
    deliveries = len(re.findall(r"Task aerie\.regenerate\[[0-9a-f-]+\] received", logs))
    answers = server_log_since(chat_server, offset).count("POST /v1/chat/completions")
    assert deliveries == 3 and 5 <= answers <= 6, (answers, deliveries)


class Forwarder:
    """A TCP port that refuses connections until `open()`, then forwards each to the real server
    (a server restarting: the regenerate stage waits for its /health, AERIE_ENGINE_OUTAGE_WAIT_S)."""

    def __init__(self, target_port: int):
        self.port, self.target_port = free_port(), target_port

    def open(self) -> None:
        import socket

        self.listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            client, _ = self.listener.accept()
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src, dst) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(2)
                except OSError:
                    pass


@pytest.mark.slow
@pytest.mark.sglang
def test_a_shard_longer_than_the_visibility_timeout_is_delivered_and_answered_once(
    s3_store, private_redis, smollm2_path, chat_server, workers, tmp_path
):
    """Visibility timeout 1 s; the shard's server restarts as the shard starts (its port refuses
    for a few seconds), so the shard waits for its /health several times that long; a second worker
    idles beside the first. The live worker keeps its tasks (aerie.queue.KeepVisible): every task is
    delivered once and every turn asked once. Before, Redis handed each running task to the idle
    worker after ~1 s and both did it (ingest, regenerate and extract, each twice)."""
    server = Forwarder(int(chat_server.url.rsplit(":", 1)[1]))
    env = worker_env(
        s3_store,
        private_redis,
        AERIE_BROKER_VISIBILITY_TIMEOUT_S="1",
        AERIE_REGENERATE_URLS=json.dumps([f"http://127.0.0.1:{server.port}"]),
        AERIE_ENGINE_OUTAGE_WAIT_S="120",
    )
    for name in ("first", "second"):
        workers.append(Worker(env, name, tmp_path))
    for w in workers:
        w.wait_for(r"ready\.", 120)
    offset = len(chat_server.log_path.read_text(errors="replace"))
    celery_cli(
        env,
        "enqueue",
        "--dataset",
        str(write_dataset(tmp_path, CONVERSATIONS[3:4])),
        "--run",
        "long-regen",
        "--model",
        str(smollm2_path),
        "--capture-points",
        ",".join(map(str, POINTS)),
        "--dtype",
        "float32",
        "--max-tokens",
        "64",
        "--regenerate",
        "--regenerate-max-tokens",
        str(MAX_NEW),
    )
    wait_until(
        lambda: "is down: waiting up to" in "".join(w.log() for w in workers), 120, "the shard to wait for its server"
    )
    time.sleep(2)
    server.open()
    status = wait_complete(s3_store, "long-regen", workers, 300, private_redis)
    assert status.regenerated == status.hidden_done == 1 and status.failed == 0, status
    record = s3_store.get_json(layout.regenerated_record("long-regen", "000000"), RegeneratedRecord)
    assert record.seconds >= 3, record  # the shard outlived the visibility timeout, three times over
    logs = "".join(w.log() for w in workers)
    for task in ("ingest", "regenerate", "extract"):
        assert len(re.findall(rf"Task aerie\.{task}\[[0-9a-f-]+\] received", logs)) == 1, (task, logs[-4000:])
    assert server_log_since(chat_server, offset).count("POST /v1/chat/completions") == record.turns == 1


# --------------------------------------------------------------------------------------
# A server that misbehaves: one line naming it and the setting
# --------------------------------------------------------------------------------------
class _Bad(BaseHTTPRequestHandler):
    replies = {
        "/garbage": (200, b'{"object": "not a chat completion"}'),
        "/broken": (500, b"Internal Server Error"),
        "/refuses": (400, b'{"error": "context too long"}'),
        "/locked": (401, b'{"error": "no key"}'),
        "/drops": (
            200,
            b'{"choices": [{"message": {"content": "an answer"}}], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}',
        ),
    }

    drops = 0  # /drops: every other request is read and its connection closed without an answer
    lock = threading.Lock()

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.path.startswith("/drops/"):
            with _Bad.lock:
                _Bad.drops += 1
                drop = _Bad.drops % 2 == 1
            if drop:  # a kept-alive connection the server closes as the request arrives
                self.close_connection = True
                return
        status, body = self.replies[self.path.split("/v1/")[0]]
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def bad_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Bad)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _ingested(store, smollm2_path, tmp_path, run):
    settings = Settings(engine="hf", ingest_local_dirs=[tmp_path])
    stages.ingest(
        store,
        settings,
        IngestRequest(
            run=run,
            dataset=str(write_dataset(tmp_path, CONVERSATIONS[2:4])),
            model=str(smollm2_path),
            capture_points=POINTS,
            options=IngestOptions(max_tokens=64, regenerate=True, regenerate_max_tokens=4),
        ),
    )


@pytest.mark.parametrize(
    "where, says",
    [
        ("/garbage", r"answered without choices\[0\]\.message: .*not a chat completion.*AERIE_REGENERATE_URLS"),
        ("/broken", r"answered HTTP 500: Internal Server Error"),
        (
            "unreachable",
            r"unreachable \(ConnectError: .*\): is the server up\? \(AERIE_REGENERATE_URLS.*OUTAGE_WAIT_S 2 s\)",
        ),
    ],
    ids=["garbage", "http-500", "unreachable"],
)
def test_a_bad_or_missing_server_is_one_line_naming_it(fs_store, smollm2_path, tmp_path, bad_server, where, says):
    url = f"http://127.0.0.1:{free_port()}" if where == "unreachable" else bad_server + where
    _ingested(fs_store, smollm2_path, tmp_path, "bad")
    settings = Settings(
        engine="hf", regenerate_urls=[url], engine_outage_wait_s=2
    )  # waits 2 s for a server that is down
    started = time.monotonic()
    with pytest.raises(EngineError) as e:
        stages.regenerate(fs_store, settings, RegenerateRequest(run="bad", shard="000000"))
    if where == "unreachable":
        assert time.monotonic() - started >= 2  # it waited for the server to come back first
    assert "\n" not in str(e.value) and url in str(e.value) and re.search(says, str(e.value)), str(e.value)
    assert e.value.retryable  # the task retries this shard
    assert fs_store.list(layout.regenerated_prefix("bad")) == []  # nothing stored: the retry asks again


def test_a_server_wanting_an_api_key_fails_the_shard_at_once(fs_store, smollm2_path, tmp_path, bad_server):
    _ingested(fs_store, smollm2_path, tmp_path, "locked")
    with pytest.raises(EngineError) as e:
        stages.regenerate(
            fs_store,
            Settings(engine="hf", regenerate_urls=[bad_server + "/locked"]),
            RegenerateRequest(run="locked", shard="000000"),
        )
    assert not e.value.retryable and "HTTP 401" in str(e.value) and "AERIE_ENGINE_API_KEY" in str(e.value)


def test_a_connection_the_server_closes_unanswered_is_asked_again_not_a_failed_shard(
    fs_store, smollm2_path, tmp_path, bad_server
):
    """Seen on an H200 with ~600 requests in flight: a dropped kept-alive connection ("ReadError")
    failed the whole shard. A request the server closed unanswered is sent again."""
    _ingested(fs_store, smollm2_path, tmp_path, "drops")
    _Bad.drops = 0
    result = stages.regenerate(
        fs_store,
        Settings(engine="hf", regenerate_urls=[bad_server + "/drops"]),
        RegenerateRequest(run="drops", shard="000000"),
    )
    assert result.conversations == 2 and result.rejects == 0 and result.completion_tokens == 4
    assert _Bad.drops == 4  # each conversation: dropped once, then answered


def test_raw_line_separators_inside_a_conversation_are_text_not_line_ends(fs_store, smollm2_path, tmp_path, bad_server):
    """Seen on an H200 with ShareGPT: a turn holding a raw U+2028 cut the stored conversation shard
    in two (str.splitlines) and failed the task. JSON writes it raw (ensure_ascii=False)."""
    text = "first\u2028second\x85third\u2029end"
    path = tmp_path / "seps.jsonl"
    path.write_text(
        json.dumps(
            {"conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": "ok"}]}, ensure_ascii=False
        )
        + "\n",
        encoding="utf-8",
    )
    stages.ingest(
        fs_store,
        Settings(engine="hf", ingest_local_dirs=[tmp_path]),
        IngestRequest(
            run="seps",
            dataset=str(path),
            model=str(smollm2_path),
            capture_points=POINTS,
            options=IngestOptions(max_tokens=64, regenerate=True, regenerate_max_tokens=4),
        ),
    )
    _Bad.drops = 1  # the next request is answered
    result = stages.regenerate(
        fs_store,
        Settings(engine="hf", regenerate_urls=[bad_server + "/drops"]),
        RegenerateRequest(run="seps", shard="000000"),
    )
    assert result.conversations == 1 and result.rejects == 0
    (answers,) = [k for k in fs_store.list(layout.regenerated_prefix("seps")) if k.endswith(".jsonl")]
    (row,) = [json.loads(x) for x in fs_store.get_bytes(answers).decode().split("\n") if x]
    assert row["messages"][0]["content"] == text


def test_a_refused_conversation_is_a_reject_and_the_shard_goes_on(fs_store, smollm2_path, tmp_path, bad_server):
    _ingested(fs_store, smollm2_path, tmp_path, "refused")
    result = stages.regenerate(
        fs_store,
        Settings(engine="hf", regenerate_urls=[bad_server + "/refuses"]),
        RegenerateRequest(run="refused", shard="000000"),
    )
    assert result.rejects == 2 and result.sequences == 0
    again = stages.regenerate(
        fs_store,
        Settings(engine="hf", regenerate_urls=[bad_server + "/garbage"]),
        RegenerateRequest(run="refused", shard="000000"),
    )
    assert again.reused_answers and again.rejects == 2  # stored once: not asked again (that server would fail)
    (key,) = fs_store.list(layout.rejects_prefix("refused"))
    assert "HTTP 400" in fs_store.get_bytes(key).decode()
    # nothing to extract, and the run says so: complete, with no token shard to wait for
    from aerie.runs import run_status

    status = run_status(fs_store, "refused")
    assert status.complete and status.regenerated == status.regenerate_total == 1 and status.tokens_done == 0


def test_turns_stop_at_the_turn_limit_and_once_the_conversation_fills_max_tokens():
    """The turn logic alone, on a stand-in answerer that reports the token counts a server would."""
    import asyncio

    from aerie_extractor.regenerate import RegenerateRefused, regenerate_conversation

    turns = [m for c in CONVERSATIONS[1:2] for m in normalize({"conversations": c})]  # 3 user turns, 3 answers
    asked = []

    async def answer(history, max_new):
        asked.append(len(history))
        return Answer(content=f"answer {len(asked)}", prompt_tokens=10 * len(history), completion_tokens=5)

    out, n = asyncio.run(regenerate_conversation(turns, answer, IngestOptions(max_tokens=1000, regenerate=True)))
    assert n == 3 and [m["content"] for m in out if m["role"] == "assistant"] == ["answer 1", "answer 2", "answer 3"]
    asked.clear()
    out, n = asyncio.run(
        regenerate_conversation(turns, answer, IngestOptions(max_tokens=1000, regenerate=True, regenerate_max_turns=2))
    )
    assert n == 2 and out[-1] == {"role": "assistant", "content": "answer 2"} and len(out) == 4  # the rest dropped
    asked.clear()  # the second answer's prompt (30) + completion (5) reaches max_tokens 35: no third turn
    out, n = asyncio.run(regenerate_conversation(turns, answer, IngestOptions(max_tokens=35, regenerate=True)))
    assert n == 2 and asked == [1, 3]

    async def empty(history, max_new):
        return Answer(content="  ")

    with pytest.raises(RegenerateRefused, match="regenerated answer for turn 2 is empty"):
        asyncio.run(regenerate_conversation(turns, empty, IngestOptions(regenerate=True)))


def test_no_answer_asks_for_more_new_tokens_than_fit_before_max_tokens():
    """What lies beyond max_tokens is truncated away at tokenization: it is never generated. The
    first prompt's length comes from ingest, later ones from the previous answer's usage."""
    import asyncio

    from aerie_extractor.regenerate import regenerate_conversation

    turns = [m for c in CONVERSATIONS[1:2] for m in normalize({"conversations": c})]  # 3 user turns, 3 answers
    asked = []

    async def answer(history, max_new):
        asked.append(max_new)
        return Answer(content="an answer", prompt_tokens=40 * len(history), completion_tokens=min(max_new, 30))

    options = IngestOptions(max_tokens=200, regenerate=True, regenerate_max_tokens=64)
    out, n = asyncio.run(regenerate_conversation(turns, answer, options, prompt_tokens=150))
    # 200 - 150 = 50 for the first; then 200 - (40 + 30) = 130, capped at 64; then 200 - (120 + 30) = 50
    assert asked == [50, 64, 50] and n == 3
    asked.clear()
    asyncio.run(regenerate_conversation(turns, answer, options))  # no count from ingest: the cap alone
    assert asked[0] == 64


def test_ingest_records_each_conversations_first_prompt_tokens(fs_store, smollm2_path, tmp_path):
    from transformers import AutoTokenizer

    settings = Settings(engine="hf", ingest_local_dirs=[tmp_path])
    stages.ingest(
        fs_store,
        settings,
        IngestRequest(
            run="counted",
            dataset=str(write_dataset(tmp_path, CONVERSATIONS[2:4])),
            model=str(smollm2_path),
            capture_points=POINTS,
            options=IngestOptions(max_tokens=256, regenerate=True),
        ),
    )
    rows = [
        json.loads(x) for x in fs_store.get_bytes(layout.conversations("counted", "000000")).decode().split("\n") if x
    ]
    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    for row in rows:
        first = row["messages"][: next(j for j, m in enumerate(row["messages"]) if m["role"] == "assistant")]
        rendered = tok.apply_chat_template(first, add_generation_prompt=True, tokenize=False)
        assert row["prompt_tokens"] == len(tok(rendered, add_special_tokens=False)["input_ids"]) > 0


# --------------------------------------------------------------------------------------
# Reasoning: the think segment kept or dropped; a template that strips earlier think blocks
# --------------------------------------------------------------------------------------
def test_the_think_segment_is_kept_inline_or_dropped():
    parsed = Answer(content="It is 4.", reasoning="2+2 is 4.")
    assert assistant_turn(parsed, "keep") == "<think>\n2+2 is 4.\n</think>\n\nIt is 4."
    assert assistant_turn(parsed, "drop") == "It is 4."
    inline = Answer(content="<think>\nadd them\n</think>\n\nIt is 4.")
    assert assistant_turn(inline, "keep") == inline.content and assistant_turn(inline, "drop") == "It is 4."
    assert assistant_turn(Answer(content="<think>cut off by max_tokens"), "drop") == ""  # refused as empty


# Qwen3's rule on SmolLM2's tokens: earlier assistant turns lose their think block.
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last=0) %}{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{%- set c = m.content %}"
    "{%- if loop.index0 < ns.last and '</think>' in c %}{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + c + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_a_template_that_rewrites_earlier_turns_is_tokenized_turn_by_turn(smollm2_path):
    chat = ChatTokenizer(smollm2_path)
    chat.tokenizer.chat_template = THINKING_TEMPLATE
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
        {"role": "user", "content": "Times 3?"},
        {"role": "assistant", "content": "<think>\nmultiply\n</think>\n\n12"},
    ]
    sequences = chat.sequences(messages, "all")
    assert len(sequences) == 2  # one per turn, each on the prompt it was answered with
    first, second = (chat.tokenizer.decode(ids) for ids, _ in sequences)
    assert first.endswith("<|im_start|>assistant\n<think>\nadd\n</think>\n\n4<|im_end|>\n")
    assert "<think>\nadd" not in second and second.endswith("<think>\nmultiply\n</think>\n\n12<|im_end|>\n")
    masked = [chat.tokenizer.decode(ids[mask == 1]) for ids, mask in sequences]
    assert masked == ["<think>\nadd\n</think>\n\n4<|im_end|>", "<think>\nmultiply\n</think>\n\n12<|im_end|>"]
    assert len(chat.sequences(messages, "last")) == 1
    # a prefix-stable template keeps one sequence for the whole conversation
    plain = ChatTokenizer(smollm2_path)
    (whole,) = plain.sequences(messages, "all")
    assert np.array_equal(whole[0], plain.encode(messages, "all")[0])


def test_a_conversation_whose_first_prompt_fills_max_tokens_is_not_asked(fs_store, smollm2_path, tmp_path):
    """Its answer would be truncated away: ingest refuses it before any request is sent."""
    settings = Settings(engine="hf", ingest_local_dirs=[tmp_path])
    ingested = stages.ingest(
        fs_store,
        settings,
        IngestRequest(
            run="long",
            dataset=str(write_dataset(tmp_path, CONVERSATIONS[2:4])),
            model=str(smollm2_path),
            capture_points=POINTS,
            options=IngestOptions(max_tokens=16, regenerate=True),
        ),
    )
    assert ingested.rejects == 2 and ingested.regenerate_shards == []
    reasons = fs_store.get_bytes(fs_store.list(layout.rejects_prefix("long"))[0]).decode()
    assert reasons.count("over-long: no assistant token within the first 16 tokens (the first prompt alone is") == 2
