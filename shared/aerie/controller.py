"""The run controller: a run is a state machine over what the store holds, and one function moves it on.

    ingest -> [regenerate] -> extract -> [align gate] -> train -> evaluate -> publish -> done
    any of them -> failed: a record says what gave up; the same request again retries it

What the user asked is the run's plan, beside the run in the store:
- `runs/<run>/plan.json` (RunPlan): the ingest request (dataset, target, capture points, options,
  regenerate) and whether the controller fans the run out. Created by one conditional write
  (`ObjectStore.put_new`) before anything else of the run is written: a second run of the name
  with another request is refused, naming the run; the same request again reuses it.
- `runs/<run>/plan/train/<train-id>.json` (PlannedTraining): each training asked to follow the
  run, its alignment gate (a serving server the run must match first) and its start rule.

The state is never stored twice: `state(store, run)` reads it from the records the stages write
(run.json, the token, hidden, regenerated and failure records, gate records, a training's
progress and failure records and its published lineage) and lists the steps that are due.

`advance(store, settings, run, dispatcher)` is the one place that decides what happens next: it
reads the state and hands each due step to the dispatcher exactly once (claims keyed by the run,
the plan's id and the step, `aerie.queue.claim`: a deleted and re-created run is a new run).
- `OnWorkers` (Celery): every extractor task calls `advance` when it ends, which enqueues what is
  next (the last extract's end enqueues the gate or the training). `start` writes the plan and
  advances once, which enqueues the ingest; `aerie run --broker` then watches `state`.
- `InProcess` (`aerie run` on the embedded default): `drive` advances, runs the dispatched steps
  here through the stage functions (aerie.stages), and advances again until nothing is due.

The train step is one task (train, evaluate, publish); its phases are read from its progress record.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast

from aerie import drafters, layout, runs
from aerie.contracts import (
    AlignGate,
    AlignmentReport,
    AlignRequest,
    Contract,
    ExtractRequest,
    GateRecord,
    IngestFailure,
    IngestRequest,
    PlannedTraining,
    RegeneratedRecord,
    RegenerateRequest,
    RunPlan,
    ShardFailure,
    TrainConfig,
    TrainFailure,
    TrainProgress,
    TrainRequest,
)
from aerie.errors import ExpectedError
from aerie.settings import Settings
from aerie.store import NotFound, ObjectStore

if TYPE_CHECKING:
    from celery import Celery

    from aerie.stages import Progress

log = logging.getLogger(__name__)

StepKind = Literal["ingest", "regenerate", "extract", "align", "train"]
Phase = Literal["ingest", "regenerate", "extract", "align", "train", "evaluate", "publish", "done", "failed"]
TrainingPhase = Literal["waiting", "align", "train", "evaluate", "publish", "done", "failed"]
# a run's phase is its least advanced training's; a training still waiting for data is "extract"
_ORDER: tuple[Phase, ...] = ("extract", "align", "train", "evaluate", "publish", "done")


class RunConflict(ExpectedError, ValueError):
    """A run (or a planned training) of that name exists with another request: refused, never retried."""

    retryable = False


class NoPlan(ExpectedError, LookupError):
    """A run without a plan: the controller has nothing to advance."""


class StaleTrainId(ExpectedError, ValueError):
    """A train id the user chose, published before a run of the request was created again: its
    drafter was not trained on the run's data. Refused, never retried."""

    retryable = False


# --------------------------------------------------------------------------------------
# Steps and state
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One piece of work the controller dispatches: a stage's request, named uniquely within the plan."""

    kind: StepKind
    name: str  # "ingest", "regenerate:000003", "extract:000003", "align:<gate-id>", "train:<train-id>"
    request: Contract


@dataclass
class TrainingState:
    planned: PlannedTraining
    phase: TrainingPhase
    gate: GateRecord | None = None
    progress: TrainProgress | None = None
    failure: str | None = None
    stale: bool = False  # its chosen train id was published before this creation of the run: never retried


@dataclass
class RunState:
    run: str
    plan: RunPlan
    phase: Phase
    ingested: bool = False
    shards: int = 0  # shards to extract (a regenerated run's conversation shards too)
    extracted: int = 0
    trainings: list[TrainingState] = field(default_factory=list)
    due: list[Step] = field(default_factory=list)
    failure: str | None = None
    sent: list[Step] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.phase in ("done", "failed")


def gate_id(request: AlignRequest) -> str:
    """A planned check's name: its server and sample (the same check for every training it gates)."""
    basis = request.model_dump_json(include={"server", "samples", "seed", "max_tokens"})
    return hashlib.sha256(basis.encode()).hexdigest()[:16]


def gate_request(run: str, gate: AlignGate) -> AlignRequest:
    return AlignRequest(run=run, server=gate.server, samples=gate.samples, seed=gate.seed)


def load_plan(store: ObjectStore, run: str) -> RunPlan:
    try:
        return store.get_json(layout.run_plan(run), RunPlan)
    except NotFound:
        raise NoPlan(
            f"run {run!r} has no plan in {store.url} ({layout.run_plan(run)}): start it with `enqueue` or `aerie run`"
        ) from None


def planned_trainings(store: ObjectStore, run: str) -> list[PlannedTraining]:
    found = []
    for train_id in layout.planned_training_ids(run, store.list(layout.planned_trainings_prefix(run))):
        try:
            found.append(store.get_json(layout.planned_training(run, train_id), PlannedTraining))
        except NotFound:  # a run deleted meanwhile
            pass
    return found


@dataclass
class _Shards:
    """A run's shards by what the store holds of them (listings, and a record read only for the few
    regenerated shards whose tokens are not stored yet)."""

    tokens: set[str]
    hidden: set[str]
    failed: set[str]
    conversations: set[str]
    empty: set[str]  # regenerated shards whose every conversation was refused: nothing to extract

    @classmethod
    def read(cls, store: ObjectStore, run: str) -> _Shards:
        tokens, hidden = set(runs.shard_names(store, run, "tokens")), set(runs.shard_names(store, run, "hidden"))
        failed = set(layout.record_names(store.list(layout.failures_prefix(run)))) - hidden
        conversations = set(runs.conversation_shards(store, run))
        answered = (
            set(runs.regenerated_shards(store, run)) & (conversations - tokens - hidden) if conversations else set()
        )
        empty = set()
        for name in answered:
            try:
                if store.get_json(layout.regenerated_record(run, name), RegeneratedRecord).token_sequences == 0:
                    empty.add(name)
            except NotFound:
                pass
        return cls(tokens, hidden, failed, conversations, empty)

    @property
    def every(self) -> set[str]:
        return self.tokens | (self.conversations - self.empty)

    @property
    def complete(self) -> bool:
        return bool(self.every) and self.every <= self.hidden


def state(store: ObjectStore, run: str) -> RunState:
    """Where `run` stands and what is due next, from the store alone."""
    plan = load_plan(store, run)
    if not store.exists(layout.run_spec(run)):
        try:
            failure = store.get_json(layout.ingest_failure(run), IngestFailure)
        except NotFound:
            return RunState(run, plan, "ingest", due=[Step("ingest", "ingest", plan.ingest)])
        return RunState(
            run, plan, "failed", failure=f"run {run!r}: ingest of {failure.dataset!r} failed for good: {failure.error}"
        )
    shards = _Shards.read(store, run)
    st = RunState(run, plan, "extract", ingested=True, shards=len(shards.every), extracted=len(shards.hidden))
    unanswered = shards.conversations - shards.tokens - shards.hidden - shards.failed - shards.empty
    if plan.fan_out:
        st.due += [
            Step("regenerate", f"regenerate:{s}", RegenerateRequest(run=run, shard=s)) for s in sorted(unanswered)
        ]
        st.due += [
            Step("extract", f"extract:{s}", ExtractRequest(run=run, shard=s))
            for s in sorted(shards.tokens - shards.hidden - shards.failed)
        ]
    if shards.failed:
        first = _first_failure(store, run, sorted(shards.failed))
        st.phase, st.failure = (
            "failed",
            (
                f"run {run!r}: {len(shards.failed)} shard(s) failed for good{first}; records in "
                f"{store.url}/{layout.failures_prefix(run)}"
            ),
        )
        return st
    view = RunsView(store, run, shards)
    st.trainings = [_training(store, plan, planned, view) for planned in planned_trainings(store, run)]
    for training in st.trainings:
        st.due += _training_steps(run, training)
    failed = [t for t in st.trainings if t.phase == "failed"]
    if failed:
        st.phase, st.failure = "failed", failed[0].failure
    elif unanswered:
        st.phase = "regenerate"
    elif shards.complete:
        phases: list[Phase] = ["extract" if t.phase == "waiting" else t.phase for t in st.trainings] or ["done"]
        st.phase = min(phases, key=_ORDER.index)
    return st


def _first_failure(store: ObjectStore, run: str, names: list[str]) -> str:
    try:
        first = store.get_json(layout.shard_failure(run, names[0]), ShardFailure)
    except NotFound:
        return ""
    return f" (shard {first.shard}: {first.error})"


@dataclass
class RunsView:
    """What a start rule may ask of the runs a training reads: this run's shards as `state` read
    them, other runs from the store."""

    store: ObjectStore
    run: str
    shards: _Shards

    def complete(self, run: str) -> bool:
        return self.shards.complete if run == self.run else runs.run_complete(self.store, run)

    def started(self, run: str) -> bool:
        """Every shard of `run` tokenized (its sequences known) and one of them extracted."""
        shards = self.shards if run == self.run else _Shards.read(self.store, run)
        return bool(shards.hidden) and shards.every <= shards.tokens | shards.hidden


def start_rule(config: TrainConfig) -> Literal["extracted", "first_shards"]:
    """The start rule of a training of this TrainConfig: a streamed one starts on the first shards."""
    return "first_shards" if config.stream else "extracted"


# When a planned training may start (PlannedTraining.start), in one place. A streamed training
# starts on its runs' first shards and follows them (aerie_trainer.data: HiddenData.refresh).
START_RULES: dict[str, Callable[[TrainRequest, RunsView], bool]] = {
    "extracted": lambda request, view: all(view.complete(run) for run in request.runs),
    "first_shards": lambda request, view: all(view.started(run) for run in request.runs),
}


def _training(store: ObjectStore, plan: RunPlan, planned: PlannedTraining, view: RunsView) -> TrainingState:
    run, request = plan.run, planned.train
    lineage = drafters.published_lineage(store, request.drafter, request.version) if request.publish else None
    if lineage is not None and request.train_id is not None and lineage.created_at < plan.created_at:
        # a train id the user chose, published before this creation of the run: not the new data's drafter
        return TrainingState(
            planned,
            "failed",
            failure=_stale(request, plan, lineage.created_at),
            stale=True,
        )
    if lineage is not None:
        return TrainingState(planned, "done")
    progress = _progress(store, run, request.resolved_train_id)
    if not request.publish and progress is not None and progress.stage == "done":
        return TrainingState(planned, "done", progress=progress)
    try:
        failure = store.get_json(layout.train_failure(request.resolved_train_id), TrainFailure)
        return TrainingState(
            planned, "failed", progress=progress, failure=f"training {request.drafter} failed: {failure.error}"
        )
    except NotFound:
        pass
    if not START_RULES[planned.start](request, view):
        return TrainingState(planned, "waiting")
    gate = None
    if planned.align is not None:
        try:
            gate = store.get_json(layout.gate(run, gate_id(gate_request(run, planned.align))), GateRecord)
        except NotFound:
            return TrainingState(planned, "align")
        if not gate.passed and not planned.align.allow_misaligned:
            return TrainingState(planned, "failed", gate=gate, failure=_misaligned(store, gate))
    phase = progress.stage if progress is not None and progress.stage in ("evaluate", "publish") else "train"
    return TrainingState(planned, phase, gate=gate, progress=progress)


def _progress(store: ObjectStore, run: str, train_id: str) -> TrainProgress | None:
    try:
        return store.get_json(layout.train_progress(run, train_id), TrainProgress)
    except NotFound:
        return None


def _misaligned(store: ObjectStore, gate: GateRecord) -> str:
    from aerie.alignment import failure_message

    try:
        return failure_message(store.get_json(gate.report, AlignmentReport))
    except NotFound:
        return f"run {gate.run!r} is not aligned with {gate.gate.server} ({gate.report}): train anyway with --allow-misaligned"


def _training_steps(run: str, training: TrainingState) -> list[Step]:
    planned = training.planned
    if training.phase == "align":
        assert planned.align is not None  # a training waits in "align" only when its plan gates it
        check = gate_request(run, planned.align)
        return [Step("align", f"align:{gate_id(check)}", check)]
    if training.phase in ("train", "evaluate", "publish"):
        return [Step("train", f"train:{planned.train.resolved_train_id}", planned.train)]
    return []


# --------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------
class Dispatcher:
    """Where `advance` sends the steps it decided: `claim` those not yet sent, `send`, `sent`."""

    def claim(self, names: list[str]) -> list[str]:
        raise NotImplementedError

    def send(self, step: Step) -> None:
        raise NotImplementedError

    def sent(self, names: list[str]) -> None:
        """The claimed steps of `names` were sent."""

    def release(self, names: list[str]) -> None:
        """Forget the claims of `names`: the steps failed for good and are retried."""


def advance(store: ObjectStore, settings: Settings, run: str, dispatcher: Dispatcher) -> RunState:
    """Move `run` on: read its state and hand each due step to `dispatcher`, exactly once."""
    st = state(store, run)
    st.sent = _dispatch(st.plan, st.due, dispatcher)
    return st


def _dispatch(plan: RunPlan, steps: list[Step], dispatcher: Dispatcher) -> list[Step]:
    """Send each of `steps` not sent yet (its claim is free, or this owner's); -> those sent."""
    by_claim = {claim_name(plan, step): step for step in steps}
    sent: list[Step] = []
    try:
        for name in dispatcher.claim(list(by_claim)):
            dispatcher.send(by_claim[name])
            sent.append(by_claim[name])
    finally:
        dispatcher.sent([claim_name(plan, step) for step in sent])
    return sent


def claim_name(plan: RunPlan, step: Step) -> str:
    return f"{plan.run}:{plan.id}:{step.name}"


def advance_planned(store: ObjectStore, settings: Settings, run: str, dispatcher: Dispatcher) -> RunState | None:
    """`advance`, for a task's end: None for a run without a plan (written by hand, or by an
    earlier version), which the controller leaves alone."""
    try:
        return advance(store, settings, run, dispatcher)
    except NoPlan:
        return None


def start(
    store: ObjectStore,
    settings: Settings,
    plan: RunPlan,
    trainings: Iterable[PlannedTraining],
    dispatcher: Dispatcher,
) -> RunState:
    """The user's request: the plan created (or the same one reused), its trainings added, what had
    failed for good retried, then `advance`."""
    plan = create_plan(store, plan)
    for planned in trainings:
        add_training(store, plan.run, follow(planned, plan))
    retried = retry(store, plan.run, dispatcher)
    st = advance(store, settings, plan.run, dispatcher)
    st.sent[:0] = retried
    return st


def follow(planned: PlannedTraining, plan: RunPlan) -> PlannedTraining:
    """The training as `start` plans it after this creation of the run: its request names the plan
    (`TrainRequest.follows`), so its train id and drafter version are this creation's. A run deleted
    and created again is trained again (its old drafter is not taken for the new data's); the same
    request on the same run finds the same training. `start`'s callers follow it with `st.plan`."""
    if planned.train.train_id is not None or planned.train.follows == plan.id:
        return planned  # a train id the user chose is kept as given
    return planned.model_copy(update={"train": planned.train.model_copy(update={"follows": plan.id})})


def _stale(request: TrainRequest, plan: RunPlan, published_at: str) -> str:
    return (
        f"training {request.train_id}: drafter {request.drafter}:{request.version} was published at "
        f"{published_at}, before run {plan.run!r} was created again at {plan.created_at}: it was not trained "
        "on this run's data; give the training another --train-id (or leave it out) to train on it"
    )


def following(store: ObjectStore, request: TrainRequest) -> TrainRequest:
    """A training asked directly (`aerie train`, a train message without `follows`) as `follow`
    makes a planned one: following the current creation of its runs, so that a run deleted and
    created again is trained again (a new train id and version), not answered "already published"
    with the old data's drafter; the same request on the same creation is the same training (and
    the controller's own, for one run). Several runs follow a digest of their plans' ids. A run
    without a plan leaves the request as given (its creation cannot be told). A train id the user
    chose that was published before a run's creation: StaleTrainId naming --train-id."""
    if request.follows is not None:
        return request
    try:
        plans = [load_plan(store, run) for run in request.runs]
    except NoPlan:
        return request
    if request.train_id is not None:
        lineage = drafters.published_lineage(store, request.drafter, request.version) if request.publish else None
        newest = max(plans, key=lambda p: p.created_at)
        if lineage is not None and lineage.created_at < newest.created_at:
            raise StaleTrainId(_stale(request, newest, lineage.created_at))
        return request
    ids = [p.id for p in plans]
    follows = ids[0] if len(ids) == 1 else hashlib.sha256(" ".join(ids).encode()).hexdigest()[:32]
    return request.model_copy(update={"follows": follows})


def new_plan(ingest: IngestRequest, fan_out: bool = True) -> RunPlan:
    return RunPlan(run=ingest.run, id=secrets.token_hex(16), ingest=ingest, fan_out=fan_out)


def create_plan(store: ObjectStore, plan: RunPlan) -> RunPlan:
    """`runs/<run>/plan.json`, written only if absent (one conditional write: of two racing
    requests one creates the run); the stored plan when it asks the same ingest, else RunConflict."""
    stored, _ = store.create_json(layout.run_plan(plan.run), plan, RunPlan)
    if stored.ingest != plan.ingest:
        theirs, ours = stored.ingest, plan.ingest
        differs = ", ".join(k for k in IngestRequest.model_fields if getattr(theirs, k) != getattr(ours, k))
        raise RunConflict(
            f"run {plan.run!r} already exists in {store.url} with another request (its {differs} differ: "
            f"dataset {theirs.dataset!r}): choose another run name, or delete {layout.run_prefix(plan.run)}"
        )
    return stored


def add_training(store: ObjectStore, run: str, planned: PlannedTraining) -> PlannedTraining:
    """A training to follow `run`, written only if absent; the same training again reuses it."""
    key = layout.planned_training(run, planned.train.resolved_train_id)
    stored, _ = store.create_json(key, planned, PlannedTraining)
    if stored.model_dump(exclude={"created_at"}) != planned.model_dump(exclude={"created_at"}):
        raise RunConflict(
            f"training {planned.train.resolved_train_id} of run {run!r} is already planned otherwise ({key}): "
            "give it another --train-id, or delete that record"
        )
    return stored


def plan_for(store: ObjectStore, ingest: IngestRequest) -> RunPlan:
    """The plan of the run an ingest message names: the stored one (which must ask this ingest), or
    the one a bare message implies (ingest, then extract every shard), created now."""
    return create_plan(store, new_plan(ingest))


def retry(store: ObjectStore, run: str, dispatcher: Dispatcher) -> list[Step]:
    """Dispatch again what failed for good (a shard, the ingest, a training, a failed gate's check):
    its failure record deleted, its claim released and taken anew. A run without a plan (written
    by hand or by an earlier version) gets its failed shards sent as they are. Returns the steps."""
    try:
        st: RunState | None = state(store, run)
    except NoPlan:
        st = None
    failed = _failed_steps(store, run, st)
    records = {step.name: (key, store.get_bytes(key)) for step, key in failed if store.exists(key)}
    for key, _ in records.values():
        store.delete(key)
    steps = [step for step, _ in failed]
    sent: list[Step] = []
    try:
        if st is None:
            for step in steps:
                dispatcher.send(step)
                sent.append(step)
        else:
            dispatcher.release([claim_name(st.plan, step) for step in steps])
            sent = _dispatch(st.plan, steps, dispatcher)
    finally:
        for step in steps:
            if step not in sent and step.name in records:  # not sent: it stays failed
                store.put_bytes(*records[step.name])
    return sent


def _failed_steps(store: ObjectStore, run: str, st: RunState | None) -> list[tuple[Step, str]]:
    """(the step that failed for good, its failure record)."""
    if st is not None and st.failure is not None and not st.ingested:
        return [(Step("ingest", "ingest", st.plan.ingest), layout.ingest_failure(run))]
    if st is None and not store.exists(layout.run_spec(run)):
        return []
    found = []
    shards = _Shards.read(store, run)
    for name in sorted(shards.failed):
        kind: StepKind = "extract" if name in shards.tokens else "regenerate"
        request = (ExtractRequest if kind == "extract" else RegenerateRequest)(run=run, shard=name)
        found.append((Step(kind, f"{kind}:{name}", request), layout.shard_failure(run, name)))
    for training in st.trainings if st is not None else []:
        if training.phase != "failed" or training.stale:  # a stale one fails the same way again
            continue
        if training.gate is not None and not training.gate.passed:
            assert training.planned.align is not None  # a gate record exists only for a gated plan
            check = gate_request(run, training.planned.align)
            found.append((Step("align", f"align:{gate_id(check)}", check), layout.gate(run, gate_id(check))))
        else:
            train = training.planned.train
            step = Step("train", f"train:{train.resolved_train_id}", train)
            found.append((step, layout.train_failure(train.resolved_train_id)))
    return found


# --------------------------------------------------------------------------------------
# After a step: what its task records for the controller
# --------------------------------------------------------------------------------------
def record_alignment(store: ObjectStore, request: AlignRequest, report: AlignmentReport) -> list[PlannedTraining]:
    """An alignment check of a run is the outcome of the run's planned gates that ask it: recorded
    (`runs/<run>/plan/gates/<gate-id>.json`). Returns the trainings it gates."""
    try:
        load_plan(store, request.run)
    except NoPlan:
        return []
    gated = [
        p
        for p in planned_trainings(store, request.run)
        if p.align is not None and gate_id(gate_request(request.run, p.align)) == gate_id(request)
    ]
    if gated:
        assert gated[0].align is not None  # kept above only when it gates
        store.put_json(
            layout.gate(request.run, gate_id(request)),
            GateRecord(
                run=request.run,
                gate=gated[0].align,
                report=layout.alignment_report(request.run, report.server.server_id),
                server_id=report.server.server_id,
                passed=report.passed,
            ),
        )
    return gated


# --------------------------------------------------------------------------------------
# The two dispatchers
# --------------------------------------------------------------------------------------
class OnWorkers(Dispatcher):
    """Steps enqueued on the workers' queues (Celery), claimed once on the broker."""

    TASKS = {"ingest": "aerie.ingest", "regenerate": "aerie.regenerate", "extract": "aerie.extract"}

    def __init__(self, app: Celery, settings: Settings, owner: str) -> None:
        self.app, self.settings, self.owner = app, settings, owner
        self.results: list[tuple[Step, str, Any]] = []  # (step, task name, its AsyncResult: Celery's, untyped)

    def claim(self, names: list[str]) -> list[str]:
        from aerie.queue import claim

        return claim(self.settings, names, self.owner)

    def send(self, step: Step) -> None:
        from aerie.queue import ALIGN_TASK, EXTRACT_TASK, INGEST_TASK, REGENERATE_TASK, TRAIN_TASK, enqueue

        task = {
            "ingest": INGEST_TASK,
            "regenerate": REGENERATE_TASK,
            "extract": EXTRACT_TASK,
            "align": ALIGN_TASK,
            "train": TRAIN_TASK,
        }[step.kind]
        self.results.append((step, task, enqueue(self.app, task, step.request.model_dump(mode="json"))))
        log.info("enqueued %s (%s)", task, step.name)

    def sent(self, names: list[str]) -> None:
        from aerie.queue import mark_done

        mark_done(self.settings, *names)

    def release(self, names: list[str]) -> None:
        from aerie.queue import release

        release(self.settings, *names)


class InProcess(Dispatcher):
    """Steps collected here and run in this process by `drive`; claimed once per drive."""

    def __init__(self) -> None:
        self.pending: list[Step] = []
        self._claimed: set[str] = set()

    def claim(self, names: list[str]) -> list[str]:
        new = [n for n in names if n not in self._claimed]
        self._claimed.update(new)
        return new

    def send(self, step: Step) -> None:
        self.pending.append(step)

    def release(self, names: list[str]) -> None:
        self._claimed.difference_update(names)


def drive(
    store: ObjectStore,
    settings: Settings,
    plan: RunPlan,
    trainings: Iterable[PlannedTraining],
    run_steps: Callable[[list[Step]], None],
    on_state: Callable[[RunState], None] | None = None,
    wait: Callable[[], bool] | None = None,
) -> RunState:
    """The run in this process: `start`, then run what was dispatched (`run_steps`, the stage
    functions), advance again, until nothing is due. `run_steps` may leave work running in the
    background (a streamed training's extraction, which the training follows): with nothing due,
    `wait()` blocks until that work moved on (a shard stored, or it ended) and says whether to
    advance again; False (or no `wait`) ends the drive. The state reached is returned (done,
    failed, or waiting for something outside this process)."""
    dispatcher = InProcess()
    st = start(store, settings, plan, trainings, dispatcher)
    while True:
        if on_state is not None:
            on_state(st)
        if dispatcher.pending:
            steps, dispatcher.pending = dispatcher.pending, []
            run_steps(steps)
        elif wait is None or not wait():
            return st
        st = advance(store, settings, plan.run, dispatcher)


def run_here(store: ObjectStore, settings: Settings, step: Step, progress: Progress | None = None) -> Contract:
    """One step through its stage function (aerie.stages: the service registered for it); an
    alignment check is recorded for the gates that asked it."""
    from aerie import stages

    if step.kind == "ingest":
        return stages.ingest(store, settings, cast(IngestRequest, step.request))
    if step.kind == "regenerate":
        return stages.regenerate(store, settings, cast(RegenerateRequest, step.request), progress)
    if step.kind == "extract":
        return stages.extract(store, settings, cast(ExtractRequest, step.request))
    if step.kind == "align":
        check = cast(AlignRequest, step.request)
        report = stages.align(store, settings, check)
        record_alignment(store, check, report)
        return report
    return stages.train(store, settings, cast(TrainRequest, step.request), progress)
