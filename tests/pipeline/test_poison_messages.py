"""The poison-message probe: every malformed message shape, sent straight to the broker, at a live
worker of each queue (ingest, extract, train). Each is refused once, with one log line, and dropped;
the workers never stop, nothing is restored to a queue, and a good run then goes through all three
queues (ingest, extract, train, publish) on the same worker processes.

Two layers are probed, as a broker writer can reach them:
- task messages a kombu producer sends (a Celery client, `celery call`) whose body is not Celery's
  `[args, kwargs, embed]`, is not JSON, has another content type, is too large, or whose headers
  lack a task id;
- raw entries pushed onto a queue's Redis list that are not kombu messages at all.
"""

from __future__ import annotations

import base64
import json
import re
import uuid

import pytest
import redis
from kombu import Connection

from aerie import controller, layout
from aerie.contracts import IngestOptions, IngestRequest, PlannedTraining, TrainConfig, TrainRequest
from aerie.controller import OnWorkers
from aerie.queue import EXTRACT_TASK, INGEST_TASK, TRAIN_TASK, make_app
from aerie.settings import Settings
from tests.conftest import POINTS
from tests.runs import DATA
from tests.services import wait_until
from tests.workers import ExtractorWorker, TrainerWorker, wait_complete, worker_env

pytestmark = pytest.mark.slow

LIMIT = 64 << 10  # AERIE_BROKER_MAX_MESSAGE_BYTES for these workers

# name -> (body bytes, content type, extra headers); each sent with headers naming the queue's task and an id
BODIES = {
    "a JSON string": (b'"hello"', "application/json", {}),
    "a number": (b"5", "application/json", {}),
    "null": (b"null", "application/json", {}),
    "a mapping": (b'{"run": "r"}', "application/json", {}),
    "a list of two": (b"[[], {}]", "application/json", {}),
    "a list of four": (b"[[], {}, {}, 1]", "application/json", {}),
    "args not a list": (b"[1, {}, {}]", "application/json", {}),
    "kwargs not a mapping": (b"[[], 2, {}]", "application/json", {}),
    "embed not a mapping": (b"[[], {}, 3]", "application/json", {}),
    "embed overwriting the request": (b'[[], {}, {"hostname": 5}]', "application/json", {}),
    "embed callbacks not signatures": (b'[[], {}, {"callbacks": 5}]', "application/json", {}),
    "invalid JSON": (b"{not json", "application/json", {}),
    "invalid UTF-8": (b'[[], {"run": "\xff\xfe"}, {}]', "application/json", {}),
    "pickle": (b"\x80\x04K\x05.", "application/x-python-serialize", {}),
    "YAML": (b"- []\n- {}\n- {}\n", "application/x-yaml", {}),
    "a huge argument": (json.dumps([[], {"run": "r" * (LIMIT + 1)}, {}]).encode(), "application/json", {}),
    "timelimit not a pair": (b"[[], {}, {}]", "application/json", {"timelimit": 5}),
}
HEADERLESS = {  # headers without the task's id or name (Celery's consumer raised KeyError on the first)
    "no id": {"task": "{task}"},
    "no task": {"id": "{id}"},
    "an unknown task without an id": {"task": "aerie.nope"},
}
ITEMS = {  # raw entries of a queue's Redis list
    "not JSON": b"garbage",
    "a JSON number": b"5",
    "a JSON list": b"[1, 2]",
    "an envelope without properties": b'{"body": "W10="}',
    "a body that is not base64": json.dumps(
        {
            "body": "!!!",
            "headers": {},
            "properties": {
                "delivery_tag": "t1",
                "body_encoding": "base64",
                "delivery_info": {"exchange": "x", "routing_key": "x"},
            },
        }
    ).encode(),
    "an item over twice the bound": b"x" * (2 * LIMIT + 1),
}


def send_poison(broker: str, queue: str, task: str) -> list[str]:
    """Every malformed shape onto `queue`; the ids of the task messages among them."""
    ids = []
    with Connection(broker) as conn:
        producer = conn.Producer()
        for body, content_type, extra in BODIES.values():
            ids.append(str(uuid.uuid4()))
            producer.publish(
                body,
                exchange=queue,
                routing_key=queue,
                headers={"task": task, "id": ids[-1], **extra},
                content_type=content_type,
                content_encoding="utf-8",
                serializer=None,
            )
        for headers in HEADERLESS.values():
            producer.publish(
                b"[[], {}, {}]",
                exchange=queue,
                routing_key=queue,
                headers={k: v.format(task=task, id=str(uuid.uuid4())) for k, v in headers.items()},
                content_type="application/json",
                content_encoding="utf-8",
                serializer=None,
            )
    client = redis.Redis.from_url(broker)
    try:
        for item in ITEMS.values():
            client.lpush(queue, item)
    finally:
        client.close()
    return ids


def test_every_malformed_message_is_refused_once_and_every_queue_goes_on(
    s3_store, private_redis, smollm2_path, workers, tmp_path
):
    env = worker_env(s3_store, private_redis, AERIE_BROKER_MAX_MESSAGE_BYTES=str(LIMIT))
    extractor, trainer = ExtractorWorker(env, "extractor", tmp_path), TrainerWorker(env, "trainer", tmp_path)
    workers += [extractor, trainer]
    for w in workers:
        w.wait_for(r"ready\.", 120)
    pids = {w.name: w.proc.pid for w in workers}

    ids = {}
    for queue, task in (("ingest", INGEST_TASK), ("extract", EXTRACT_TASK), ("train", TRAIN_TASK)):
        ids[queue] = send_poison(private_redis, queue, task)
    per_queue = len(BODIES) + len(HEADERLESS) + len(ITEMS)

    def refused(worker) -> int:
        assert worker.proc.poll() is None, f"worker {worker.name} stopped:\n{worker.log()[-4000:]}"
        return len(re.findall(r"refused (?:a message on|an item of) queue", worker.log()))

    wait_until(
        lambda: refused(extractor) == 2 * per_queue and refused(trainer) == per_queue,
        120,
        "every malformed message refused",
        poll=0.5,
        details=lambda: (
            f"extractor {refused(extractor)}, trainer {refused(trainer)}:\n"
            + "\n".join(w.log()[-4000:] for w in workers)
        ),
    )
    client = redis.Redis.from_url(private_redis)
    try:
        for w in workers:
            log = w.log()
            assert w.proc.poll() is None and "Unrecoverable error" not in log, log[-4000:]
            for queue in w.queues.split(","):
                for task_id in ids[queue]:
                    assert log.count(f"id '{task_id}'") == 1, f"{task_id} on {queue}:\n{log[-4000:]}"
        # dropped, not restored: nothing queued, nothing unacknowledged
        assert not any(client.llen(q) for q in ("ingest", "extract", "train")) and not client.hlen("unacked")
    finally:
        client.close()
    app = make_app(Settings(broker=private_redis))
    failed = app.AsyncResult(ids["extract"][0])
    assert failed.state == "FAILURE" and "message refused: its body is of type str" in str(failed.result)
    huge = [line for line in extractor.log().splitlines() if "over AERIE_BROKER_MAX_MESSAGE_BYTES" in line]
    assert len(huge) == 2, huge  # ingest and extract, refused by size before the body was decoded

    # a good run through all three queues, on the same worker processes
    s3_store.put_bytes("datasets/poison.jsonl", (DATA / "malformed.jsonl").read_bytes())
    train = TrainRequest(
        runs=["after-poison"],
        drafter="after-poison",
        model=str(smollm2_path),
        config=TrainConfig(
            draft_vocab_size=256, ttt_steps=1, steps=2, batch_tokens=64, max_seq_tokens=64, eval_prompts=0
        ),
    )
    ingest = IngestRequest(
        run="after-poison",
        dataset="datasets/poison.jsonl",
        model=str(smollm2_path),
        capture_points=POINTS,
        options=IngestOptions(max_tokens=96, shard_tokens=128),
    )
    settings = Settings(broker=private_redis)
    controller.start(
        s3_store,
        settings,
        controller.new_plan(ingest),
        [PlannedTraining(train=train)],
        OnWorkers(app, settings, "test"),
    )
    status = wait_complete(s3_store, "after-poison", workers, 300, private_redis)
    assert status.sequences == 3 and status.failed == 0
    trainer.wait_for(r"Task aerie\.train\[[0-9a-f-]+\] succeeded", 300)
    assert s3_store.exists(layout.drafter_latest("after-poison"))
    assert {w.name: w.proc.pid for w in workers} == pids and all(w.proc.poll() is None for w in workers)


def test_a_refused_message_names_why():
    """The consumer's check, one shape at a time (the probe above sends them to live workers)."""
    from kombu.transport.virtual import Message

    from aerie.queue import item_refusal, refusal

    class Channel:  # what kombu's Message needs of its channel to decode a body
        def decode_body(self, body, encoding):
            return base64.b64decode(body) if encoding == "base64" else body

    def message(body: bytes, content_type="application/json", headers=None):
        payload = {
            "body": base64.b64encode(body).decode(),
            "content-type": content_type,
            "content-encoding": "utf-8",
            "headers": {"task": TRAIN_TASK, "id": "1"} if headers is None else headers,
            "properties": {"delivery_tag": "t", "body_encoding": "base64", "delivery_info": {}},
        }
        return Message(payload, channel=Channel())

    assert refusal(message(b'[[], {"run": "r"}, {}]'), LIMIT) is None
    assert refusal(message(b'"x"'), LIMIT) == "its body is of type str, not [args, kwargs, embed]"
    assert refusal(message(b"[[], {}]"), LIMIT) == "its body is a list of 2, not [args, kwargs, embed]"
    assert "over AERIE_BROKER_MAX_MESSAGE_BYTES=65536" in refusal(message(b"x" * (LIMIT + 1)), LIMIT)
    assert "content type is 'application/x-yaml'" in refusal(message(b"[]", "application/x-yaml"), LIMIT)
    assert "no 'id'" in refusal(message(b"[[], {}, {}]", headers={"task": TRAIN_TASK}), LIMIT)
    assert item_refusal(b"garbage", LIMIT).startswith("it is not JSON")
    assert item_refusal(b"x" * (2 * LIMIT + 1), 2 * LIMIT) == (
        f"it is over {2 * LIMIT} bytes (twice AERIE_BROKER_MAX_MESSAGE_BYTES)"
    )
