"""The run controller (aerie.controller) against both real stores and a real Redis: a run's phases
read from its records, each step dispatched once, failures retried by the same request again, and
a run's creation atomic (one conditional write: of two requests for one name, one creates it).

The stages are not run here: the records they write are written by hand, so each transition is
checked on its own (the flows with real stages and workers: tests/pipeline, tests/extractor).
"""

from __future__ import annotations

import hashlib
import threading

import pytest

from aerie import controller, layout
from aerie.contracts import (
    AlignGate,
    EngineSpec,
    GateRecord,
    IngestFailure,
    IngestOptions,
    IngestRequest,
    PlannedTraining,
    RunSpec,
    ShardFailure,
    ShardRecord,
    TargetSpec,
    TrainConfig,
    TrainFailure,
    TrainProgress,
    TrainRequest,
)
from aerie.controller import InProcess, RunConflict
from aerie.settings import Settings

SERVER = "http://sglang-capture:30000"


def ingest(run: str = "r", dataset: str = "datasets/a.jsonl") -> IngestRequest:
    return IngestRequest(run=run, dataset=dataset, model="/models/target", capture_points=[2, 15, 27])


def write_run_spec(store, run: str = "r") -> None:
    target = TargetSpec(
        model="/models/target",
        architecture="LlamaForCausalLM",
        num_layers=30,
        hidden_size=576,
        vocab_size=49152,
        weights_sha256="0" * 64,
        tokenizer_sha256="1" * 64,
    )
    engine = EngineSpec(name="hf", version="1", convention="hf", layer_ids=[2, 15, 27])
    spec = RunSpec(
        run=run,
        dataset="datasets/a.jsonl",
        target=target,
        engine=engine,
        capture_points=[2, 15, 27],
        ingest=IngestOptions(),
    )
    store.put_json(layout.run_spec(run), spec)


def write_shard(store, kind: str, shard: str, run: str = "r") -> None:
    record = ShardRecord(
        run=run, shard=shard, kind=kind, key=layout.shard(run, kind, shard), sha256="0" * 64,
        bytes=1, sequences=1, tokens=8, loss_tokens=4,
    )  # fmt: skip
    store.put_json(layout.shard_record(run, kind, shard), record)


def names(steps) -> list[str]:
    return [s.name for s in steps]


def test_a_run_moves_through_its_phases_each_step_dispatched_once(store):
    """ingest -> extract -> align gate -> train -> evaluate -> done, with a failure at each
    of shard, gate and training retried by the same request again (`start`)."""
    settings = Settings()  # the in-process dispatcher: nothing of the settings is used
    train = TrainRequest(runs=["r"], drafter="d", model="/models/target", publish=False)
    planned = PlannedTraining(train=train, align=AlignGate(server=SERVER))
    plan = controller.new_plan(ingest())
    here = InProcess()

    st = controller.start(store, settings, plan, [planned], here)
    train = controller.follow(planned, st.plan).train  # as planned: bound to this creation of the run
    assert train.follows == plan.id and train.resolved_train_id != planned.train.resolved_train_id
    assert st.phase == "ingest" and names(here.pending) == ["ingest"]
    assert controller.advance(store, settings, "r", here).sent == []  # claimed: never twice

    write_run_spec(store)
    for shard in ("000000", "000001"):
        write_shard(store, "tokens", shard)
    st = controller.advance(store, settings, "r", here)
    assert st.phase == "extract" and names(st.sent) == ["extract:000000", "extract:000001"]
    assert (st.shards, st.extracted) == (2, 0) and st.trainings[0].phase == "waiting"

    write_shard(store, "hidden", "000000")
    store.put_json(layout.shard_failure("r", "000001"), ShardFailure(run="r", shard="000001", error="boom", attempts=5))
    st = controller.advance(store, settings, "r", here)
    assert st.phase == "failed" and st.sent == []
    assert "1 shard(s) failed for good (shard 000001: boom)" in st.failure

    # the same request again: the plan reused, the failed shard sent again, its record gone
    st = controller.start(store, settings, controller.new_plan(ingest()), [planned], here)
    assert names(st.sent) == ["extract:000001"] and not store.exists(layout.shard_failure("r", "000001"))
    assert store.get_json(layout.run_plan("r"), type(plan)).id == plan.id

    write_shard(store, "hidden", "000001")
    st = controller.advance(store, settings, "r", here)
    ((check,),) = [[s.request for s in st.sent]]
    assert st.phase == "align" and check.server == SERVER and check.run == "r"
    gate_key = layout.gate("r", controller.gate_id(check))
    report = layout.alignment_report("r", "smol")
    store.put_json(gate_key, GateRecord(run="r", gate=planned.align, report=report, server_id="smol", passed=False))
    st = controller.advance(store, settings, "r", here)
    assert st.phase == "failed" and st.sent == [] and f"not aligned with {SERVER}" in st.failure
    assert "--allow-misaligned" in st.failure

    st = controller.start(store, settings, controller.new_plan(ingest()), [planned], here)
    assert names(st.sent) == [f"align:{controller.gate_id(check)}"] and not store.exists(gate_key)
    store.put_json(gate_key, GateRecord(run="r", gate=planned.align, report=report, server_id="smol", passed=True))
    st = controller.advance(store, settings, "r", here)
    assert st.phase == "train" and names(st.sent) == [f"train:{train.resolved_train_id}"]

    store.put_json(
        layout.train_failure(train.resolved_train_id),
        TrainFailure(train_id=train.resolved_train_id, drafter="d", error="RankFailed: gone", attempts=6),
    )
    st = controller.advance(store, settings, "r", here)
    assert st.phase == "failed" and st.failure == "training d failed: RankFailed: gone"
    st = controller.start(store, settings, controller.new_plan(ingest()), [planned], here)
    assert names(st.sent) == [f"train:{train.resolved_train_id}"]

    progress = TrainProgress(train_id=train.resolved_train_id, drafter="d", runs=["r"], stage="evaluate")
    store.put_json(layout.train_progress("r", train.resolved_train_id), progress)
    assert controller.advance(store, settings, "r", here).phase == "evaluate"
    store.put_json(layout.train_progress("r", train.resolved_train_id), progress.model_copy(update={"stage": "done"}))
    st = controller.advance(store, settings, "r", here)
    assert st.phase == "done" and st.due == []


def test_an_ingest_that_failed_is_retried_by_the_same_request(fs_store):
    settings = Settings(store=fs_store.url)
    here = InProcess()
    controller.start(fs_store, settings, controller.new_plan(ingest()), [], here)
    failure = IngestFailure(run="r", dataset="datasets/a.jsonl", error="IngestError: no template", attempts=1)
    fs_store.put_json(layout.ingest_failure("r"), failure)
    st = controller.state(fs_store, "r")
    assert st.phase == "failed" and "ingest of 'datasets/a.jsonl' failed for good: IngestError" in st.failure
    st = controller.start(fs_store, settings, controller.new_plan(ingest()), [], here)
    assert names(st.sent) == ["ingest"] and st.phase == "ingest"


def test_a_plan_without_fan_out_dispatches_nothing_after_ingest(fs_store):
    settings = Settings(store=fs_store.url)
    here = InProcess()
    controller.start(fs_store, settings, controller.new_plan(ingest(), fan_out=False), [], here)
    write_run_spec(fs_store)
    write_shard(fs_store, "tokens", "000000")
    st = controller.advance(fs_store, settings, "r", here)
    assert st.phase == "extract" and st.sent == []
    write_shard(fs_store, "hidden", "000000")  # extracted by hand: complete, nothing planned after
    assert controller.advance(fs_store, settings, "r", here).phase == "done"


def test_the_same_request_reuses_the_run_another_is_refused_naming_it(store):
    first = controller.create_plan(store, controller.new_plan(ingest()))
    again = controller.create_plan(store, controller.new_plan(ingest()))
    assert again == first  # the stored plan, its id kept
    with pytest.raises(RunConflict) as refused:
        controller.create_plan(store, controller.new_plan(ingest(dataset="datasets/b.jsonl")))
    message = str(refused.value)
    assert "run 'r' already exists" in message and "dataset" in message and "'datasets/a.jsonl'" in message
    assert "\n" not in message and layout.run_prefix("r") in message


@pytest.mark.parametrize("backend", ["fs", "s3"])
def test_racing_requests_for_one_run_name_create_it_once(request, backend):
    """Eight threads create run 'r' at once, each with its own dataset: one plan is written, one
    request wins, seven are refused; the plan names the winner's dataset. (Before: the run's
    existence was checked before ingest and written after it, so both of two runs went on.)"""
    store = request.getfixturevalue(f"{backend}_store")
    barrier, outcomes = threading.Barrier(8), {}

    def create(i: int) -> None:
        barrier.wait()
        try:
            outcomes[i] = controller.create_plan(store, controller.new_plan(ingest(dataset=f"datasets/{i}.jsonl")))
        except RunConflict as e:
            outcomes[i] = e

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = {i: plan for i, plan in outcomes.items() if not isinstance(plan, RunConflict)}
    assert len(won) == 1, outcomes
    ((i, plan),) = won.items()
    assert plan.ingest.dataset == f"datasets/{i}.jsonl"
    assert store.get_json(layout.run_plan("r"), type(plan)) == plan


@pytest.mark.parametrize("backend", ["fs", "s3"])
def test_put_new_creates_an_object_once_among_racing_writers(request, backend):
    store = request.getfixturevalue(f"{backend}_store")
    barrier, created = threading.Barrier(8), []

    def put(i: int) -> None:
        barrier.wait()
        if store.put_new("probes/once", f"writer {i}".encode()):
            created.append(i)

    threads = [threading.Thread(target=put, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(created) == 1 and store.get_bytes("probes/once") == f"writer {created[0]}".encode()
    assert not store.put_new("probes/once", b"later")
    assert store.list("probes/") == ["probes/once"]  # no temporary file left behind


def test_each_step_is_enqueued_once_and_a_recreated_run_is_a_new_run(fs_store, redis_url):
    """Workers' dispatch (Celery on a real Redis): three task ends advance the same run, each
    extraction is enqueued once; the run deleted and created again (same name, new plan id) has
    its shards enqueued again. (Before: a run's follow-up was claimed by its name for 30 days.)"""
    import redis

    from aerie.queue import make_app

    settings = Settings(store=fs_store.url, broker=redis_url)
    app = make_app(settings)
    client = redis.Redis.from_url(redis_url)

    def create() -> None:
        controller.create_plan(fs_store, controller.new_plan(ingest()))
        write_run_spec(fs_store)
        for shard in ("000000", "000001"):
            write_shard(fs_store, "tokens", shard)

    create()
    for owner in ("task-1", "task-2", "task-3"):
        controller.advance(fs_store, settings, "r", controller.OnWorkers(app, settings, owner))
    assert client.llen("extract") == 2
    fs_store.delete_prefix(layout.run_prefix("r"))
    create()
    sent = controller.OnWorkers(app, settings, "task-1")
    controller.advance(fs_store, settings, "r", sent)
    assert [task for _, task, _ in sent.results] == ["aerie.extract", "aerie.extract"] and client.llen("extract") == 4
    client.close()


def test_the_train_id_is_one_property_and_the_version_its_hash():
    request = TrainRequest(runs=["r"], drafter="d", model="/models/target")
    assert request.resolved_train_id == f"d-{request.version}" and len(request.version) == 12
    named = request.model_copy(update={"train_id": "mine"})
    assert (named.resolved_train_id, named.version) == ("mine", "mine")
    assert request.model_copy(update={"publish": False}).resolved_train_id == request.resolved_train_id


def test_a_local_lease_is_held_by_one_at_a_time(tmp_path):
    """The in-process lease (a flock on this host): a second holder of the same name waits until
    the first leaves; another name does not."""
    from aerie.queue import held

    settings = Settings(store=f"file://{tmp_path}")
    order, inside = [], threading.Event()

    def second() -> None:
        with held(settings, "train:x"):
            order.append("second")

    with held(settings, "train:x"):
        thread = threading.Thread(target=second)
        thread.start()
        with held(settings, "train:y"):
            inside.set()
        thread.join(0.5)
        assert thread.is_alive() and inside.is_set()
        order.append("first")
    thread.join(10)
    assert order == ["first", "second"]


def test_a_deleted_and_recreated_run_trains_again(fs_store, redis_url):
    """Issue 35, finding 10: a run deleted and enqueued again (same name, same training asked)
    found its old drafter version published and was "done" without training on the new data.
    Now a planned training follows its run's creation (TrainRequest.follows = the plan's id): the
    re-created run's training is a new train id and version, and its train task goes to the real
    Redis queue. A train id the user chose that was published before the re-creation is not
    taken for the new data's drafter: the run fails naming why and the fix, and is not retried."""
    import base64
    import json
    import time

    import redis

    from aerie.contracts import DrafterLineage
    from aerie.queue import make_app

    settings = Settings(store=fs_store.url, broker=redis_url)
    app = make_app(settings)
    client = redis.Redis.from_url(redis_url)
    client.delete("train")

    def create(planned: PlannedTraining) -> PlannedTraining:
        st = controller.start(fs_store, settings, controller.new_plan(ingest()), [planned], InProcess())
        write_run_spec(fs_store)
        for kind in ("tokens", "hidden"):
            write_shard(fs_store, kind, "000000")
        return controller.follow(planned, st.plan)

    def publish(train: TrainRequest) -> None:
        spec = fs_store.get_json(layout.run_spec("r"), RunSpec)
        lineage = DrafterLineage(
            name="d", version=train.version, runs=["r"], target=spec.target, engine=spec.engine,
            capture_points=spec.capture_points, exported_layer_ids=[2, 15, 27], exported_convention="sglang",
            draft_vocab_size=32000, config=train.config, metrics={}, files={},
        )  # fmt: skip
        fs_store.put_json(layout.drafter_lineage("d", train.version), lineage)

    def train_messages() -> list[dict]:
        """The train tasks' kwargs on the real queue, oldest first (kombu pushes on the left)."""
        bodies = [base64.b64decode(json.loads(m)["body"]) for m in reversed(client.lrange("train", 0, -1))]
        return [json.loads(body)[1] for body in bodies]

    asked = PlannedTraining(train=TrainRequest(runs=["r"], drafter="d", model="/models/target"))
    first = create(asked).train
    st = controller.advance(fs_store, settings, "r", controller.OnWorkers(app, settings, "task-1"))
    assert st.phase == "train" and [m["follows"] for m in train_messages()] == [first.follows]
    publish(first)
    assert controller.advance(fs_store, settings, "r", controller.OnWorkers(app, settings, "task-2")).phase == "done"

    fs_store.delete_prefix(layout.run_prefix("r"))
    second = create(asked).train
    assert second.follows != first.follows and second.version != first.version
    st = controller.advance(fs_store, settings, "r", controller.OnWorkers(app, settings, "task-3"))
    assert st.phase == "train", st  # trained again, not found published
    assert [m["follows"] for m in train_messages()] == [first.follows, second.follows]

    # a chosen train id published before the run was created again: refused by name, never retried
    chosen = PlannedTraining(train=TrainRequest(runs=["r"], drafter="d", model="/models/target", train_id="mine"))
    fs_store.delete_prefix(layout.run_prefix("r"))
    publish(create(chosen).train)
    time.sleep(1.1)  # created_at has a resolution of a second at worst
    fs_store.delete_prefix(layout.run_prefix("r"))
    create(chosen)
    st = controller.advance(fs_store, settings, "r", controller.OnWorkers(app, settings, "task-4"))
    assert st.phase == "failed" and "training mine: drafter d:mine was published at" in st.failure
    assert "before run 'r' was created again" in st.failure and "another --train-id" in st.failure
    assert controller.retry(fs_store, "r", controller.OnWorkers(app, settings, "task-5")) == []
    assert len(train_messages()) == 2
    client.delete("train")
    client.close()


def test_a_streamed_training_is_dispatched_on_the_first_hidden_shard_once(fs_store):
    """`first_shards` (TrainConfig.stream): the training is due once the run is tokenized and one
    shard is extracted, while the others still are; it is sent once, and the run's phase stays
    `extract` until every shard is. A non-streamed training of the same run still waits."""
    settings = Settings()
    streamed = TrainRequest(runs=["r"], drafter="s", model="/m", config=TrainConfig(stream=True), publish=False)
    waiting = TrainRequest(runs=["r"], drafter="w", model="/m", publish=False)
    planned = [
        PlannedTraining(train=streamed, start=controller.start_rule(streamed.config)),
        PlannedTraining(train=waiting, start=controller.start_rule(waiting.config)),
    ]
    assert [p.start for p in planned] == ["first_shards", "extracted"]
    here = InProcess()
    st = controller.start(fs_store, settings, controller.new_plan(ingest()), planned, here)
    streamed, waiting = (controller.follow(p, st.plan).train for p in planned)  # as planned: this creation's
    write_run_spec(fs_store)
    for shard in ("000000", "000001", "000002"):
        write_shard(fs_store, "tokens", shard)
    st = controller.advance(fs_store, settings, "r", here)
    assert [t.phase for t in st.trainings] == ["waiting", "waiting"]
    write_shard(fs_store, "hidden", "000001")
    st = controller.advance(fs_store, settings, "r", here)
    assert st.phase == "extract" and names(st.sent) == [f"train:{streamed.resolved_train_id}"]
    assert [t.phase for t in st.trainings] == ["train", "waiting"]
    write_shard(fs_store, "hidden", "000000")
    assert controller.advance(fs_store, settings, "r", here).sent == []  # once
    write_shard(fs_store, "hidden", "000002")
    st = controller.advance(fs_store, settings, "r", here)
    assert st.phase == "train" and names(st.sent) == [f"train:{waiting.resolved_train_id}"]


def test_stream_names_its_own_train_id_and_leaves_the_others_as_they_were():
    plain = TrainRequest(runs=["r"], drafter="d", model="/m")
    # fields added later, at their defaults, are left out: the ids of earlier requests stay
    later = {"follows": True, "config": {"stream", "speculative_num_steps"}}
    basis = plain.model_dump_json(exclude={"train_id": True, "publish": True, **later})
    assert plain.resolved_train_id == f"d-{hashlib.sha256(basis.encode()).hexdigest()[:12]}"
    streamed = plain.model_copy(update={"config": TrainConfig(stream=True)})
    assert streamed.resolved_train_id != plain.resolved_train_id
