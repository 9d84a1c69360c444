"""Every message on the queues and every JSON record in the store. Nobody re-declares them.

All models are strict about their keys (`extra="forbid"`): a typo in a task's kwargs or a
record written by another version is an error that names the field, not a silent default.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from aerie.layout import SHARD_NAME

if TYPE_CHECKING:
    from typing import Self  # Python 3.11; annotations only

SCHEMA_VERSION = 1


def utcnow() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


class Contract(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def to_json(self) -> bytes:
        return self.model_dump_json(indent=1).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> Self:
        return cls.model_validate_json(raw)


_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
Name = Annotated[str, Field(pattern=_NAME)]  # a name that becomes part of a store key (run, drafter, version)


# --------------------------------------------------------------------------------------
# What a run is made of
# --------------------------------------------------------------------------------------
class TargetSpec(Contract):
    """The target model, pinned by content so a drafter can name exactly what it serves."""

    model: str = Field(description="name or path the user gave")
    revision: str | None = None
    architecture: str
    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    weights_sha256: str = Field(description="sha256 over the sorted safetensors files' hashes")
    tokenizer_sha256: str = Field(description="sha256 of tokenizer.json / tokenizer files")


class EngineSpec(Contract):
    name: Literal["hf", "sglang"]
    version: str
    convention: str
    layer_ids: list[int] = Field(description="ids the engine was told to capture (its convention)")
    transport: Literal["inproc", "json", "binary"] = "inproc"
    dtype: str = "bfloat16"


class IngestOptions(Contract):
    loss_on: Literal["all", "last"] = Field("all", description="assistant turns trained on")
    max_tokens: int = Field(2048, ge=8)
    overlong: Literal["truncate", "reject"] = "truncate"
    shard_tokens: int = Field(65536, ge=64, description="tokens per shard (whole sequences)")
    max_records: int | None = Field(None, ge=1, description="stop after this many accepted records")
    max_record_bytes: int = Field(
        1 << 20,
        ge=1024,
        description="a dataset line (JSONL) or array element larger than this is rejected before it is decoded or tokenized",
    )
    regenerate: bool = Field(False, description="answer every user turn again with the target (the regenerate stage)")
    regenerate_temperature: float = Field(0.0, ge=0.0)
    regenerate_max_tokens: int = Field(512, ge=1, description="new tokens per regenerated answer")
    regenerate_max_turns: int | None = Field(
        None, ge=1, description="assistant turns regenerated per conversation; the rest of it is dropped (None: all)"
    )
    regenerate_reasoning: Literal["keep", "drop"] = Field(
        "keep",
        description="a reasoning model's think segment (reasoning_content or <think>...</think>): trained on, or dropped",
    )
    regenerate_shard_records: int = Field(
        256, ge=1, description="conversations per regenerate task (one token shard each)"
    )


# How a run's hidden states are stored (aerie.shard): in `dtype`, or as fp8 with float32 scales.
StorageDtype = Annotated[
    Literal["float8_e4m3fn"] | None,
    Field(
        description="float8_e4m3fn: states stored as e4m3 with a float32 scale per scale_block values of a row: about "
        "half of bf16's bytes, dequantized by every reader; None: stored in `dtype`"
    ),
]
ScaleBlock = Annotated[
    int | None,
    Field(
        ge=1,
        description="with storage_dtype: values of a row per scale (divides the hidden size); None at ingest: 128 where it "
        "divides the hidden size, else one scale per row (aerie.shard.default_scale_block); None in a run: one per row",
    ),
]


class RunSpec(Contract):
    """`runs/<run>/run.json`: everything needed to know what the shards of a run contain."""

    schema_version: int = SCHEMA_VERSION
    run: str = Field(pattern=_NAME)
    dataset: str
    target: TargetSpec
    engine: EngineSpec
    capture_points: list[int]
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    storage_dtype: StorageDtype = None
    scale_block: ScaleBlock = None
    target_signal: Literal["final", "topk"] = "final"
    topk: int | None = None
    ingest: IngestOptions
    created_at: str = Field(default_factory=utcnow)

    @model_validator(mode="before")
    @classmethod
    def _no_chained_work(cls, data: object) -> object:
        """Stores written by earlier versions carry `train_after` and `align` keys (what followed the
        run, now its plan's): unset ones are read without them; a set one is refused by name."""
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in ("train_after", "align")):
            data = {k: v for k, v in data.items() if not (k in ("train_after", "align") and v is None)}
        return data


class ShardRecord(Contract):
    """`runs/<run>/{tokens,hidden}/<shard>.json`, written after the object it describes."""

    schema_version: int = SCHEMA_VERSION
    run: str
    shard: str
    kind: Literal["tokens", "hidden"]
    key: str
    sha256: str
    bytes: int = Field(ge=0)
    sequences: int = Field(ge=0)
    tokens: int = Field(ge=0)
    loss_tokens: int = Field(ge=0)
    engine: EngineSpec | None = None
    seconds: float | None = None
    created_at: str = Field(default_factory=utcnow)


class RegeneratedRecord(Contract):
    """`runs/<run>/regenerated/<shard>.json`, written after the answers object it describes: the
    shard's regeneration is done (a redelivered task reuses the answers, never asks again)."""

    schema_version: int = SCHEMA_VERSION
    run: str
    shard: str
    key: str
    sha256: str
    conversations: int = Field(ge=0, description="conversations answered (refused ones are in rejects)")
    turns: int = Field(ge=0, description="assistant turns regenerated")
    rejects: int = Field(0, ge=0)
    prompt_tokens: int = Field(0, ge=0)
    completion_tokens: int = Field(0, ge=0)
    seconds: float = 0.0
    tokens_per_second: float = Field(0.0, description="completion tokens / seconds")
    max_in_flight: int = Field(
        0, description="most requests in flight at once, measured from their start and end times"
    )
    mean_in_flight: float = Field(0.0, description="requests in flight, averaged over the shard's wall time")
    servers: list[str] = Field(default_factory=list, description="engine URLs used ('hf': the target in-process)")
    token_sequences: int | None = Field(
        None,
        description="sequences its token shard holds, once tokenized; 0: every conversation refused, no token shard",
    )
    created_at: str = Field(default_factory=utcnow)


class RejectRecord(Contract):
    """One line of `runs/<run>/rejects/<part>-n<count>.jsonl`."""

    source: str
    line: int = Field(ge=1)
    reason: str


class ShardFailure(Contract):
    """`runs/<run>/failed/<shard>.json`: an extraction that gave up (retries spent or refused)."""

    run: str
    shard: str
    error: str
    attempts: int = Field(ge=1)
    created_at: str = Field(default_factory=utcnow)


class RunStatus(Contract):
    run: str
    shards_total: int
    tokens_done: int
    hidden_done: int
    failed: int
    sequences: int
    tokens: int
    rejects: int
    complete: bool
    failed_shards: list[str] = Field(default_factory=list)
    regenerate_total: int = Field(0, description="shards to regenerate (runs with regenerate on)")
    regenerated: int = Field(0, description="of those, shards whose answers are stored")


class IngestFailure(Contract):
    """`runs/<run>/failed/ingest.json`: an ingest that gave up (the run has no run.json)."""

    run: str
    dataset: str
    error: str
    attempts: int = Field(ge=1)
    created_at: str = Field(default_factory=utcnow)


class TrainFailure(Contract):
    """`checkpoints/<train-id>/failed.json`: a training job that gave up (retries spent or refused)."""

    train_id: str
    drafter: str
    error: str
    attempts: int = Field(ge=1)
    created_at: str = Field(default_factory=utcnow)


# --------------------------------------------------------------------------------------
# Queue messages (Celery kwargs, JSON)
# --------------------------------------------------------------------------------------
class IngestRequest(Contract):
    run: str = Field(pattern=_NAME)
    dataset: str = Field(description="store key (datasets/x.jsonl) or a local path")
    model: str = Field(description="target model folder (HF layout, safetensors)")
    capture_points: list[int] | None = None
    engine: Literal["hf", "sglang"] | None = None
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    storage_dtype: StorageDtype = None
    scale_block: ScaleBlock = None
    target_signal: Literal["final", "topk"] = "final"
    topk: int = Field(20, ge=1)
    options: IngestOptions = Field(default_factory=IngestOptions)

    @model_validator(mode="after")
    def _scale_block_needs_fp8(self) -> IngestRequest:
        if self.scale_block is not None and self.storage_dtype is None:
            raise ValueError(
                f"scale_block {self.scale_block} applies to fp8 storage only: set storage_dtype float8_e4m3fn"
            )
        return self


class ExtractRequest(Contract):
    run: str = Field(pattern=_NAME)
    shard: str = Field(pattern=SHARD_NAME, description="six digits, as aerie.layout.shard_name makes")


class RegenerateRequest(Contract):
    """One conversation shard of a run to answer again with the target, then tokenize."""

    run: str = Field(pattern=_NAME)
    shard: str = Field(pattern=SHARD_NAME, description="six digits, as aerie.layout.shard_name makes")


class DrafterShape(Contract):
    """The drafter layer's own shape and rope. Unset fields follow the target: a Llama-class target
    (grouped-query attention, a rope the drafter supports) is copied; any other (MLA: DeepSeek-V3,
    Kimi-K2/K2.5) gets a Llama shape of its own (aerie_trainer.model.DrafterConfig.from_target).

    `arch` picks the layer SGLang serves: "llama" (`LlamaForCausalLMEagle3`, grouped-query
    attention) or "mla" (`Eagle3DeepseekV2ForCausalLM`, DeepSeek's multi-head latent attention,
    as TorchSpec's Kimi-K2.5 drafter); an MLA layer copies an MLA target's attention shape (heads,
    LoRA ranks, head dims, rope) unless the fields below say otherwise."""

    arch: Literal["llama", "mla"] = Field("llama", description="the drafter layer: llama (GQA) or mla (DeepSeek MLA)")
    num_attention_heads: int | None = Field(None, ge=1)
    num_key_value_heads: int | None = Field(None, ge=1)
    head_dim: int | None = Field(None, ge=2, multiple_of=2)
    intermediate_size: int | None = Field(None, ge=1)
    rope_parameters: dict[str, float | int | str] | None = Field(
        None, description="rope_type (default, linear, llama3, yarn), rope_theta and the type's own keys"
    )
    q_lora_rank: int | None = Field(None, ge=1, description="mla: rank of the query's low-rank projection")
    kv_lora_rank: int | None = Field(None, ge=1, description="mla: rank of the shared key/value latent")
    qk_nope_head_dim: int | None = Field(None, ge=1, description="mla: query/key head dims without rope")
    qk_rope_head_dim: int | None = Field(None, ge=2, multiple_of=2, description="mla: query/key head dims with rope")
    v_head_dim: int | None = Field(None, ge=1, description="mla: value head dim")


# Training-time-test steps beyond the serving chain's draft steps (TrainConfig.ttt_steps unset);
# why this margin: BENCHMARKS.md, "Training-time-test length at equal wall time".
TTT_MARGIN = 4


class TrainConfig(Contract):
    """How a drafter is trained. Defaults follow SpecForge's reference EAGLE-3 recipe (lr 1e-4,
    grad clip 0.5, 7 TTT steps, 2048-token sequences, 10 epochs, warmup 1.5% of the steps); where
    aerie differs, docs/deploy.md ("Training settings") says why. `steps` unset: `epochs` passes
    over the training shards (the trainer counts the batches)."""

    draft_vocab_size: int = Field(32000, ge=2)
    speculative_num_steps: int = Field(
        3, ge=1, description="draft steps of the chain the drafter will serve (SGLang's --speculative-num-steps)"
    )
    ttt_steps: int = Field(  # type: ignore[assignment]  # never None after _ttt_from_the_chain
        None, ge=1, description="training-time-test steps; unset: speculative_num_steps + TTT_MARGIN"
    )
    step_decay: float = Field(0.8, gt=0.0, le=1.0)
    steps: int | None = Field(
        None, ge=1, description="optimizer steps; unset: epochs x the data's batches / grad_accum"
    )
    epochs: float = Field(10.0, gt=0, description="passes over the training data when steps is unset")
    batch_tokens: int = Field(4096, ge=16)
    max_seq_tokens: int = Field(2048, ge=16)
    grad_accum: int = Field(1, ge=1)
    activation_checkpointing: bool = Field(
        False,
        description="recompute each TTT step's activations in backward instead of keeping them: long "
        "sequences (16k tokens at H 7168) fit one GPU for about one more forward of the drafter layer",
    )
    lr: float = Field(1e-4, gt=0)
    warmup_steps: int | None = Field(None, ge=0, description="unset: 1.5% of the steps")
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(0.5, gt=0)
    seed: int = 0
    holdout_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    checkpoint_every: int = Field(200, ge=1)
    eval_prompts: int = Field(8, ge=0)
    eval_new_tokens: int = Field(64, ge=1)
    eval_draft_tokens: int = Field(3, ge=1, description="chain length in the spec-decoding eval")
    eval_every: int | None = Field(
        None,
        ge=1,
        description="measure acceptance every N steps and at each checkpoint (the trained-drafter evaluation); "
        "unset: before and after training only",
    )
    publish_checkpoint: Literal["last", "best"] = Field(
        "last", description="publish the last step's drafter, or the measured step with the best acceptance"
    )
    init_from: str | None = Field(
        None,
        min_length=1,
        description="warm start: a drafter folder (aerie's, or an EAGLE-3 export as SpecForge writes it) or a "
        "published drafter NAME[:VERSION] whose weights and draft vocabulary training starts from",
    )
    stream: bool = Field(
        False,
        description="start on the runs' first hidden shards and follow them as they are extracted (epoch 0 in "
        "arrival order); the same steps, split and later epochs as a job on the complete runs",
    )
    prefetch: int = Field(4, ge=1)
    draft_vocab_from: Literal["target", "data"] = Field(
        "target",
        description="the target's own greedy tokens at trained positions (then the data's), or the data's trained tokens",
    )
    vocab_sample_tokens: int = Field(
        2_000_000, ge=1, description="trained positions the target's greedy tokens are counted over"
    )
    drafter: DrafterShape = Field(default_factory=DrafterShape)
    preset: str | None = Field(
        None, description="the preset these values came from (recorded in the lineage, not read)"
    )

    @model_validator(mode="before")
    @classmethod
    def _ttt_from_the_chain(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("ttt_steps") is None:
            data = {**data, "ttt_steps": int(data.get("speculative_num_steps", 3)) + TTT_MARGIN}
        return data

    @model_validator(mode="after")
    def _best_is_measured(self) -> TrainConfig:
        if self.publish_checkpoint == "best" and self.eval_every is None:
            raise ValueError("publish_checkpoint 'best' needs eval_every: the steps whose acceptance is measured")
        return self


class TrainRequest(Contract):
    runs: list[Name] = Field(min_length=1)
    drafter: str = Field(pattern=_NAME)
    model: str = Field(description="target model folder (for embeddings, lm_head, config)")
    config: TrainConfig = Field(default_factory=TrainConfig)
    train_id: str | None = Field(
        None, pattern=_NAME, description="checkpoint namespace and drafter version; default derived from inputs"
    )
    eval_prompts_file: str | None = None
    publish: bool = True
    follows: str | None = Field(
        None,
        pattern=r"^[0-9a-f]{32}$",
        description="the id of the run creation (RunPlan.id) a training follows (of several runs, a digest of "
        "theirs), set by the controller and by a direct training (aerie.controller.following): part of the "
        "derived train id, so a deleted and re-created run is trained anew, not found published",
    )

    @field_validator("runs")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"runs {v} repeat a run")
        return v

    @property
    def resolved_train_id(self) -> str:
        """The job's checkpoint namespace: `train_id` when given, else derived from the inputs
        (same inputs, same id: a redelivered or repeated request finds its own checkpoints)."""
        if self.train_id is not None:
            return self.train_id
        # a field added later with its default leaves the ids of earlier requests as they were
        exclude: dict[str, Any] = {"train_id": True, "publish": True}
        if self.follows is None:
            exclude["follows"] = True
        defaults = [k for k, v in (("stream", False), ("speculative_num_steps", 3)) if getattr(self.config, k) == v]
        if defaults:
            exclude["config"] = set(defaults)
        basis = self.model_dump_json(exclude=exclude)
        return f"{self.drafter}-{hashlib.sha256(basis.encode()).hexdigest()[:12]}"

    @property
    def version(self) -> str:
        """The drafter version it publishes: the hash part of the derived id, or the id it names."""
        return self.resolved_train_id.rsplit("-", 1)[-1] if self.train_id is None else self.train_id


# --------------------------------------------------------------------------------------
# What the stages return (Celery task results are these, dumped as JSON)
# --------------------------------------------------------------------------------------
class StageResult(Contract):
    model_config = ConfigDict(extra="forbid", frozen=False)  # filled in as the stage goes


class IngestResult(StageResult):
    run: str
    shards: list[str] = Field(default_factory=list)
    sequences: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    rejects: int = 0
    truncated: int = 0
    skipped: bool = Field(False, description="the run was already ingested: nothing written")
    fanned_out: int = Field(0, description="extract (or regenerate) tasks enqueued")
    regenerate_shards: list[str] = Field(
        default_factory=list, description="conversation shards the regenerate stage answers"
    )


class RegenerateResult(StageResult):
    run: str
    shard: str
    skipped: bool = Field(False, description="the shard's tokens were already stored")
    reused_answers: bool = Field(False, description="the answers were stored by an earlier attempt: not asked again")
    conversations: int = 0
    turns: int = 0
    sequences: int = 0
    tokens: int = 0
    rejects: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    tokens_per_second: float = 0.0
    max_in_flight: int = 0
    mean_in_flight: float = 0.0
    extract_enqueued: bool = False


class ExtractResult(StageResult):
    run: str
    shard: str
    skipped: bool = Field(description="a valid hidden shard already existed")
    sequences: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    capture_seconds: float = Field(0.0, description="the engine's part (forwards, copies into the shard's arrays)")
    store_seconds: float = Field(0.0, description="validation, sha256 and the store write (a writer thread's part)")
    train_enqueued: bool = False


class TrainResult(StageResult):
    drafter: str
    version: str
    train_id: str | None = None
    resumed_from: int | None = None
    already_published: bool = False
    key: str | None = Field(None, description="drafters/<name>/<version>/ when published")
    layer_ids: list[int] | None = Field(None, description="the serving engine's aux layer ids written in config.json")
    steps: int | None = None
    tokens: int | None = None
    final_loss: float | None = None
    losses: list[float] | None = None
    acceptance_untrained: float | None = None
    acceptance: float | None = None
    simulated_acceptance_untrained: float | None = None
    simulated_acceptance: float | None = None
    heldout_loss: float | None = None
    heldout_acc: list[float] | None = None
    tokens_per_second: float | None = None
    data_wait_fraction: float | None = None
    draft_vocab_coverage: float | None = None
    evaluated_with: Literal["transformers", "sglang", "simulated"] | None = Field(
        None,
        description="how acceptance was measured: the target in this process, through an SGLang server, or simulated only",
    )
    sharding: Literal["single", "ddp", "fsdp"] | None = None
    ranks: int | None = None
    logs: str | None = Field(None, description="store prefix of the TensorBoard event files")

    @classmethod
    def of(cls, drafter: str, version: str, metrics: dict[str, Any], **fields: Any) -> TrainResult:
        """A result carrying the metrics (of a lineage or a trainer state) it has fields for."""
        known = set(cls.model_fields) - {"drafter", "version"} - set(fields)
        return cls(drafter=drafter, version=version, **fields, **{k: v for k, v in metrics.items() if k in known})


class ProgressEvent(Contract):
    """What a stage reports while it runs: drawn by `aerie run`, sent to Celery as task state
    `PROGRESS` (Flower and `progress` show it)."""

    stage: Literal["ingest", "regenerate", "extract", "train", "evaluate", "publish", "done"]
    message: str = ""
    step: int | None = None
    steps: int | None = None
    loss: float | None = None
    tokens: int | None = None
    eta_s: float | None = None
    tokens_per_second: float | None = None
    in_flight: int | None = Field(None, description="regenerate: requests in flight now")


class TrainProgress(Contract):
    """`runs/<run>/training/<train-id>.json`, one per run a training reads: where a training job
    stands, written by its rank 0 (each checkpoint, every few seconds, and at the end), read by
    `progress --run` and `aerie run` without importing the trainer."""

    train_id: str = Field(pattern=_NAME)
    drafter: str
    runs: list[str]
    stage: Literal["train", "evaluate", "publish", "done", "failed"]
    step: int = Field(0, ge=0)
    steps: int | None = None
    loss: float | None = None
    tokens: int = 0
    eta_s: float | None = None
    tokens_per_second: float | None = None
    sharding: Literal["single", "ddp", "fsdp"] = "single"
    ranks: int = Field(1, ge=1)
    checkpoint_step: int | None = Field(None, description="the last complete checkpoint")
    logs: str | None = Field(None, description="store prefix of the TensorBoard event files")
    version: str | None = Field(None, description="the drafter version, once published")
    message: str = ""
    updated_at: str = Field(default_factory=utcnow)


class Preset(Contract):
    """A training recipe for one target family: data file `aerie/presets/<name>.json`, checked
    here. `hidden_size`, `num_layers` and `vocab_size` are the target's, so a preset applied to
    another model is refused by name; `capture_points` unset: the default [2, N//2, N-3]."""

    name: str = Field(pattern=_NAME)
    model: str = Field(description="the Hugging Face model the preset is for")
    architectures: list[str] = Field(min_length=1, description="config.json `architectures` it accepts")
    hidden_size: int = Field(ge=1)
    num_layers: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    capture_points: list[int] | None = None
    drafter: DrafterShape = Field(default_factory=DrafterShape)
    draft_vocab_size: int = Field(ge=2)
    max_seq_tokens: int = Field(ge=16)
    lr: float = Field(gt=0)
    epochs: float = Field(gt=0)
    ttt_steps: int = Field(7, ge=1)
    batch_tokens: int = Field(ge=16)
    activation_checkpointing: bool = False
    train_gpus: int = Field(
        ge=1,
        description="GPUs the recipe trains on: its source's count, at least what aerie_trainer.sizing's estimate needs",
    )
    gpu_memory_gib: int = Field(ge=1, description="memory of one GPU that train_gpus assumes")
    serve_gpus: int = Field(
        ge=1, description="GPUs SGLang needs to serve the target (capture and serving), of serve_gpu_memory_gib"
    )
    serve_gpu_memory_gib: int = Field(ge=1)
    source: str = Field("", description="where the training settings come from (an anchor's published recipe)")
    notes: str = ""

    @field_validator("capture_points")
    @classmethod
    def _points(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (len(v) < 2 or v != sorted(set(v))):
            raise ValueError(f"capture_points {v}: at least 2, increasing")
        return v


class RunSize(Contract):
    """An `aerie run` size: how much data and how long a training, data file
    `aerie/recipes/sizes/<name>.json`, checked here. `train` holds the TrainConfig fields the size
    sets (the others keep TrainConfig's defaults); `max_tokens` is both the conversations' length
    and the training's `max_seq_tokens`; checkpoints every quarter of the steps (at least 10)."""

    name: str = Field(pattern=_NAME)
    records: int = Field(ge=1, description="conversations taken from the dataset")
    max_tokens: int = Field(ge=16, description="tokens per conversation (longer ones are truncated)")
    shard_tokens: int = Field(ge=1, description="tokens per hidden-state shard")
    train: TrainConfig
    notes: str = ""

    @field_validator("train")
    @classmethod
    def _steps_given(cls, v: TrainConfig) -> TrainConfig:
        if v.steps is None or {"max_seq_tokens", "checkpoint_every"} & v.model_fields_set:
            raise ValueError("train: give steps; max_seq_tokens and checkpoint_every follow from the size")
        return v

    def train_config(
        self,
        steps: int | None = None,
        draft_vocab: int | None = None,
        max_tokens: int | None = None,
        eval_prompts: int | None = None,
    ) -> TrainConfig:
        """The size's TrainConfig, with the command's options over it."""
        steps = steps or self.train.steps or 0
        update: dict[str, object] = {
            "steps": steps,
            "max_seq_tokens": max_tokens or self.max_tokens,
            "checkpoint_every": max(10, steps // 4),
        }
        if draft_vocab:
            update["draft_vocab_size"] = draft_vocab
        if eval_prompts is not None:
            update["eval_prompts"] = eval_prompts
        return TrainConfig(**{**self.train.model_dump(exclude_unset=True), **update})


class SpeculativeSetting(Contract):
    """SGLang's speculative flags for one server: chain when eagle_topk is 1, a tree otherwise."""

    num_steps: int = Field(ge=1, description="--speculative-num-steps")
    eagle_topk: int = Field(ge=1, description="--speculative-eagle-topk")
    num_draft_tokens: int = Field(ge=2, description="--speculative-num-draft-tokens")

    @property
    def shape(self) -> str:
        return "chain" if self.eagle_topk == 1 else "tree"

    def flags(self) -> list[str]:
        return [
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-num-steps",
            str(self.num_steps),
            "--speculative-eagle-topk",
            str(self.eagle_topk),
            "--speculative-num-draft-tokens",
            str(self.num_draft_tokens),
        ]


class SweepPoint(Contract):
    setting: SpeculativeSetting | None = Field(description="None: the plain server (no drafter)")
    acceptance_length: float | None = None
    accept_rate: float | None = None
    tokens_per_s: float | None = None
    speedup: float | None = None
    completion_tokens: int = 0
    requests: int = 0
    start_s: float = Field(0.0, description="seconds the server took to become healthy")
    error: str | None = Field(
        None, description="the setting could not be measured: why (the server's log tail when it died)"
    )


class BenchSweep(Contract):
    """`drafters/<name>/<version>/bench/<id>.json`: `aerie bench --sweep` of a published drafter
    (beside its lineage; `aerie.json` itself never changes)."""

    drafter: str
    version: str
    launch: str = Field(description="the server command the settings' flags were added to")
    prompts: int
    max_tokens: int
    points: list[SweepPoint]
    best: SpeculativeSetting | None = Field(description="the setting with the most tokens/s")
    created_at: str = Field(default_factory=utcnow)


# --------------------------------------------------------------------------------------
# The binary-capture descriptor: what aerie's SGLang plugin answers in meta_info.aerie_capture
# (the plugin, in SGLang's own environment, writes the same fields as a plain dict)
# --------------------------------------------------------------------------------------
class CapturedTensor(Contract):
    dtype: str
    shape: list[int]


class CaptureDescriptor(Contract):
    v: int
    id: str = Field(pattern=r"^[0-9a-f]{32}$")
    sink: Literal["shm", "s3"]
    format: Literal["safetensors"]
    nbytes: int = Field(ge=0)
    rows: int = Field(ge=0)
    layer_ids: list[int]
    tensors: dict[str, CapturedTensor]
    path: str | None = Field(None, description="shm: the file the server writes")
    endpoint: str | None = Field(None, description="s3: where the server uploads")
    bucket: str | None = None
    key: str | None = None


# --------------------------------------------------------------------------------------
# The alignment check (`aerie align`, task aerie.align): a run's stored states against what a
# serving SGLang computes for the same tokens. The report is `runs/<run>/align/<server-id>.json`.
# --------------------------------------------------------------------------------------
_URL = r"^https?://[^\s/]+(/[^\s]*)?$"


class AlignGate(Contract):
    """What `enqueue --train-drafter --server URL` asks: check the run against URL before training."""

    server: str = Field(pattern=_URL, description="the serving SGLang server, in capture mode")
    samples: int = Field(8, ge=1, le=4096)
    seed: int = 0
    allow_misaligned: bool = Field(False, description="train even when the check fails (the lineage says so)")


class AlignRequest(Contract):
    run: str = Field(pattern=_NAME)
    server: str = Field(
        pattern=_URL, description="SGLang in capture mode with the serve profile's model, quantization, TP and dtype"
    )
    samples: int = Field(
        8, ge=1, le=4096, description="stored sequences compared (drawn by seed: same seed, same sample)"
    )
    seed: int = 0
    max_tokens: int = Field(
        256, ge=2, description="tokens per sequence compared (its prefix: the states of a prefix are the same)"
    )


class CosineStats(Contract):
    """Per-token cosine between stored and served states over the sample, and the relative L2."""

    mean: float
    p1: float = Field(description="1st percentile over tokens")
    min: float
    rel_l2: float = Field(description="||stored - served|| / ||served|| over all sampled tokens")
    tokens: int


class PointAlignment(Contract):
    point: int = Field(description="the run's capture point")
    at_point: CosineStats | None = Field(None, description="against the server's same point; None: not captured there")
    best_point: int | None = Field(None, description="the server's point this one matches best")
    cosines: dict[int, float] = Field(default_factory=dict, description="server point -> mean cosine")
    passed: bool


class SignalAlignment(Contract):
    """The target signal: the final state (binary transport) and the target distribution."""

    signal: Literal["final", "topk"]
    final: CosineStats | None = Field(None, description="final states (the server's binary capture only)")
    top1_agreement: float = Field(description="fraction of tokens whose top-1 target token is the same")
    topk_overlap: float | None = Field(None, description="topk runs: mean shared fraction of the top-k ids")
    logprob_mae: float | None = Field(None, description="mean |log-prob difference| over the server's top-k tokens")
    passed: bool


class TokenizationCheck(Contract):
    """The sampled sequences' text, tokenized by the server and by the run's tokenizer."""

    checked: int = 0
    differs_at: int | None = Field(None, description="first token position where the two disagree")
    sample: int | None = None
    run_token: str | None = None
    server_token: str | None = None
    note: str | None = None


class ServerIdentity(Contract):
    url: str
    server_id: str = Field(pattern=_NAME, description="stable name of the configuration (not of the URL)")
    model_path: str
    architecture: str | None = None
    weights_sha256: str | None = Field(None, description="when the server's model folder is readable here")
    tokenizer_sha256: str | None = None
    sglang_version: str
    quantization: str | None = None
    tp_size: int = 1
    dtype: str
    kv_cache_dtype: str | None = None
    aux_layer_ids: list[int]
    aux_points: list[int] = Field(description="the capture points those ids are, by aerie.capture")
    transport: Literal["json", "binary"]


class SampledSequence(Contract):
    shard: str
    sequence: int = Field(ge=0)
    tokens: int = Field(ge=1)


class AlignmentReport(Contract):
    """`runs/<run>/align/<server-id>.json`: one run against one serving configuration."""

    schema_version: int = SCHEMA_VERSION
    run: str
    server: ServerIdentity
    run_dtype: str
    precision: str = Field(description="the dtype whose thresholds applied: the less precise of run and server")
    min_cosine: float
    min_cosine_p1: float
    min_top1: float
    seed: int
    samples: list[SampledSequence]
    tokens: int
    points: list[PointAlignment]
    signal: SignalAlignment | None = None
    tokenization: TokenizationCheck = Field(default_factory=TokenizationCheck)
    passed: bool
    causes: list[str] = Field(default_factory=list, description="what the measurements point at, most likely first")
    seconds: float = 0.0
    created_at: str = Field(default_factory=utcnow)


class AlignmentSummary(Contract):
    """One alignment report, as a drafter's lineage records it."""

    run: str
    key: str
    passed: bool
    server_id: str
    model_path: str
    sglang_version: str
    quantization: str | None
    dtype: str
    tp_size: int
    point_cosines: dict[int, float | None] = Field(description="capture point -> mean cosine at the same point")
    top1_agreement: float | None
    causes: list[str]
    created_at: str


class LineageAlignment(Contract):
    """Whether the runs a drafter was trained on were checked against a serving server, and how."""

    checked: bool
    passed: bool | None = Field(None, description="every report passed; None when nothing was checked")
    reports: list[AlignmentSummary] = Field(default_factory=list)
    note: str = ""


# --------------------------------------------------------------------------------------
# The drafter's lineage, `drafters/<name>/<version>/aerie.json`
# --------------------------------------------------------------------------------------
class InitOrigin(Contract):
    """Where a warm-started drafter's first weights came from (`TrainConfig.init_from`)."""

    source: str = Field(description="init_from as given: a folder, or a published drafter NAME[:VERSION]")
    drafter: str | None = Field(None, description="the published drafter NAME:VERSION it named")
    format: Literal["aerie", "eagle3"] = Field(
        description="an aerie drafter (with aerie.json), or another EAGLE-3 export"
    )
    files: dict[str, str] = Field(description="file name -> sha256 of every file read")


class DrafterLineage(Contract):
    schema_version: int = SCHEMA_VERSION
    name: str
    version: str
    runs: list[str]
    target: TargetSpec
    engine: EngineSpec
    capture_points: list[int]
    exported_layer_ids: list[int]
    exported_convention: str
    draft_vocab_size: int
    config: TrainConfig
    metrics: dict[str, float | int | str | list[float] | None]
    files: dict[str, str] = Field(description="file name -> sha256")
    alignment: LineageAlignment | None = Field(
        None, description="the alignment checks of its runs (None: published before they were recorded)"
    )
    init_from: InitOrigin | None = Field(None, description="the drafter training started from (None: from scratch)")
    created_at: str = Field(default_factory=utcnow)


# --------------------------------------------------------------------------------------
# The run's plan: what the user asked of a run, read by the run controller (aerie.controller)
# --------------------------------------------------------------------------------------
class RunPlan(Contract):
    """`runs/<run>/plan.json`: the run's data as asked, created once (a conditional write) before
    anything else of the run is written. Its `id` is new each time the plan is created, so the
    work a deleted and re-created run of the same name dispatches is never taken for the old one's."""

    schema_version: int = SCHEMA_VERSION
    run: str = Field(pattern=_NAME)
    id: str = Field(pattern=r"^[0-9a-f]{32}$", description="this creation of the run (claims are keyed by it)")
    ingest: IngestRequest
    fan_out: bool = Field(
        True, description="the controller dispatches the run's regenerate and extract steps (False: ingest only)"
    )
    created_at: str = Field(default_factory=utcnow)

    @model_validator(mode="after")
    def _one_run(self) -> RunPlan:
        if self.ingest.run != self.run:
            raise ValueError(f"plan of run {self.run!r} ingests run {self.ingest.run!r}")
        return self


class PlannedTraining(Contract):
    """`runs/<run>/plan/train/<train-id>.json`: a training asked to follow the run, and when.

    `start` is the rule the controller checks before it dispatches the training: `extracted`,
    every run of the request completely extracted; `first_shards` (a streamed training,
    TrainConfig.stream), every run tokenized and holding at least one hidden shard."""

    schema_version: int = SCHEMA_VERSION
    train: TrainRequest
    align: AlignGate | None = Field(None, description="check the run against a serving server before training")
    start: Literal["extracted", "first_shards"] = "extracted"
    created_at: str = Field(default_factory=utcnow)


class GateRecord(Contract):
    """`runs/<run>/plan/gates/<gate-id>.json`: the outcome of a planned alignment check (the
    report itself is `runs/<run>/align/<server-id>.json`)."""

    schema_version: int = SCHEMA_VERSION
    run: str
    gate: AlignGate
    report: str = Field(description="the alignment report's key")
    server_id: str
    passed: bool
    created_at: str = Field(default_factory=utcnow)
