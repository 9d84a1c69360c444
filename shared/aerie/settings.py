"""Every endpoint, bucket, credential and default, read from the environment.

- Prefix `AERIE_`; an unknown `AERIE_*` variable is an error (a typo must not be silently ignored).
- Required credentials have no default: a missing one fails at start with its name.
- Nothing is read at import time: call `Settings.load()` where the value is needed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "AERIE_"
# Names under AERIE_ that are not settings of this model: the test harness's own variables and
# the SGLang plugin's (read in SGLang's processes, documented in aerie_sglang.plugin.sink).
RESERVED_PREFIXES = ("AERIE_TEST_", "AERIE_REQUIRE_", "AERIE_CAPTURE_", "AERIE_SGLANG_")


def redact(url: str) -> str:
    """`url` with any password (and a user name that may be a token) replaced by `***`: every URL the
    project prints (broker, result backend, store endpoint) goes through here, so a credential given
    inside a URL never reaches a log line, an error message or a terminal."""
    import urllib.parse

    try:
        u = urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    if u.password is None and u.username is None:
        return url
    host = u.hostname or ""
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    try:
        port = f":{u.port}" if u.port is not None else ""
    except ValueError:
        port = ""
    return urllib.parse.urlunsplit(u._replace(netloc=f"***@{host}{port}"))


class SettingsError(ValueError):
    """A setting that is unknown, missing or malformed; the message names the variable."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)

    # --- object store -------------------------------------------------------------------
    store: str = Field(
        default="file://./aerie-data",
        description="file:///path for the embedded filesystem store, or http(s)://host:port for S3/MinIO",
    )
    bucket: str = "aerie"
    s3_access_key: SecretStr | None = None
    s3_secret_key: SecretStr | None = None
    s3_region: str | None = None

    # --- queue --------------------------------------------------------------------------
    broker: str = Field(default="memory://", description="redis://[:password@]host:port/db, or memory:// (eager)")
    result_backend: str | None = None
    worker_concurrency: int = Field(default=1, ge=1)
    broker_visibility_timeout_s: int = Field(
        default=3600,
        ge=1,
        description="seconds before Redis hands a lost worker's unacknowledged task to another "
        "(a live worker keeps its own however long they run: aerie.queue.KeepVisible)",
    )

    broker_max_message_bytes: int = Field(
        default=1 << 20,
        ge=1024,
        description="largest task message body a worker takes (aerie's are a few KiB); a larger one is refused "
        "before it is decoded",
    )

    # --- datasets -----------------------------------------------------------------------
    ingest_local_dirs: list[Path] = Field(
        default_factory=list,
        description="local folders an ingest may read a dataset from (JSON list); empty: datasets come from the store only",
    )

    # --- engines ------------------------------------------------------------------------
    engine: Literal["hf", "sglang"] = "hf"
    engine_urls: list[str] = Field(default_factory=lambda: ["http://127.0.0.1:30000"])
    engine_concurrency: int = Field(default=4, ge=1)
    engine_timeout_s: float = Field(default=600.0, gt=0)
    engine_api_key: SecretStr | None = Field(
        default=None, description="sglang: the server's --api-key, sent as a bearer token (compose: SGLANG_API_KEY)"
    )
    engine_outage_wait_s: float = Field(
        default=1800.0,
        ge=0,
        description="sglang: how long a request waits for an unreachable server's /health before failing (a restarted large model loads for 10-30 min); 0: fail at once",
    )
    engine_transport: Literal["auto", "binary", "json"] = Field(
        default="auto",
        description="sglang, what a new run records: auto = binary where the server advertises aerie's plugin and its captures are readable here",
    )
    engine_sink: Literal["shm", "s3"] = Field(
        default="shm",
        description="sglang binary path: read captures from the server's tmpfs dir (same host) or the store",
    )
    engine_shm_dir: Path | None = Field(
        default=None, description="the plugin's shm directory as mounted here (default: the path the server advertises)"
    )
    regenerate_urls: list[str] = Field(
        default_factory=list,
        description="OpenAI-compatible servers (SGLang) the regenerate stage asks, spread across; empty: AERIE_ENGINE_URLS "
        "for a run on the sglang engine, the target in-process (transformers) for an hf run",
    )
    regenerate_concurrency: int = Field(
        default=64, ge=1, description="regenerate: requests in flight per task (all servers together)"
    )
    device: str = "cpu"
    tokens_per_batch: int = Field(default=4096, ge=1)

    # --- trainer --------------------------------------------------------------------------
    train_ranks: str = Field(
        default="auto",
        pattern=r"^(auto|[1-9][0-9]*)$",
        description="ranks of a training job: auto = the visible CUDA devices (CUDA_VISIBLE_DEVICES), 1 on the CPU; N = N ranks (gloo on the CPU)",
    )
    train_sharding: Literal["auto", "ddp", "fsdp"] = Field(
        default="auto",
        description="auto: DDP when the drafter and its optimizer state fit one device (aerie_trainer.sizing), else FSDP2",
    )
    train_device_memory_gib: float | None = Field(
        default=None,
        gt=0,
        description="memory of one device for that choice (default: the GPU's; on the CPU: DDP)",
    )
    train_trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(
        default=["tensorboard"],  # pydantic copies a mutable default per instance
        description="where training metrics go; TensorBoard files are written to the store",
    )
    eval_server: str | None = Field(
        default=None,
        pattern=r"^https?://[^\s/]+(/[^\s]*)?$",
        description="an SGLang server in capture mode at the run's capture points: the evaluation's target forward (no weights in the trainer)",
    )
    eval_max_target_params: float = Field(
        default=9e9,
        gt=0,
        description="largest target (parameters, from config.json) the evaluation loads into the trainer; larger ones go through AERIE_EVAL_SERVER or are simulated",
    )

    # --- alignment check (aerie align) ---------------------------------------------------
    # Thresholds by the less precise dtype of the run and the server: under what the same weights
    # give, above what a neighbouring layer or 4-bit quantized weights give (BENCHMARKS.md,
    # "Alignment"). float16 takes bfloat16's bounds (fp16 rounds less than bf16).
    align_min_cosine: dict[str, float] = Field(
        default_factory=lambda: {"float32": 0.9999, "bfloat16": 0.999, "float16": 0.999},
        description="least mean per-token cosine of a capture point (and the final state), by dtype",
    )
    align_min_cosine_p1: dict[str, float] = Field(
        default_factory=lambda: {"float32": 0.999, "bfloat16": 0.995, "float16": 0.995},
        description="least 1st-percentile per-token cosine, by dtype",
    )
    align_min_top1: float = Field(
        default=0.9,
        ge=0,
        le=1,
        description="least top-1 agreement of the target distribution (same weights: 0.98; int4: 0.72)",
    )

    # --- paths --------------------------------------------------------------------------
    cache_dir: Path = Path(os.path.expanduser("~/.cache/aerie"))

    @model_validator(mode="after")
    def _s3_needs_credentials(self) -> Settings:
        if self.store.startswith(("http://", "https://")):
            missing = [
                f"{ENV_PREFIX}{name.upper()}"
                for name in ("s3_access_key", "s3_secret_key")
                if getattr(self, name) is None
            ]
            if missing:
                raise ValueError(
                    f"store {self.store} is an S3 endpoint but {', '.join(missing)} "
                    "is not set: export the credentials of that server"
                )
        return self

    @model_validator(mode="after")
    def _align_dtypes(self) -> Settings:
        for name in ("align_min_cosine", "align_min_cosine_p1"):
            unknown = sorted(set(getattr(self, name)) - {"float32", "bfloat16", "float16"})
            if unknown:
                raise ValueError(f"{ENV_PREFIX}{name.upper()} names {unknown}: its keys are float32, bfloat16, float16")
        return self

    @property
    def embedded(self) -> bool:
        """The in-process default (`memory://` broker): tasks run eagerly, claims are local."""
        return self.broker.startswith("memory://")

    @classmethod
    def load(cls, **overrides: Any) -> Settings:
        """Read the environment, refusing unknown AERIE_* variables by name."""
        known = {f"{ENV_PREFIX}{name}".upper() for name in cls.model_fields}
        unknown = sorted(
            k for k in os.environ if k.startswith(ENV_PREFIX) and k not in known and not k.startswith(RESERVED_PREFIXES)
        )
        if unknown:
            raise SettingsError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        try:
            return cls(**{k: v for k, v in overrides.items() if v is not None})
        except ValidationError as e:
            first = e.errors()[0]
            where = (
                f"{ENV_PREFIX}{first['loc'][0]}".upper() + f"={first.get('input')!r}" if first["loc"] else "settings"
            )
            raise SettingsError(f"{where}: {first['msg'].removeprefix('Value error, ')}") from None
