"""Hidden-state shards from the store -> padded training batches, prefetched in the background.

- One run or several: their run specs must name the same target (weights hash), capture points,
  hidden size and target signal, or training refuses with the first difference.
- Held-out split by shard when there are enough shards, else by sequence; seeded, stable.
- Order: per epoch (seed, epoch) shuffles the shards, then the sequences inside windows of
  `SHUFFLE_WINDOW` shards (shuffling across shards without holding a whole run). The order is a
  pure function of (seed, epoch, shard offsets), so the data position of a checkpoint is just
  (epoch, batch index) and a resumed run sees exactly the batches an uninterrupted one would.
- A background thread downloads shards (memory-maps them where the store has a local path) and
  builds batches; `wait_s` counts the time the training loop spent waiting for it.
- Streaming (`stream`, TrainConfig.stream): the job starts while its runs are still being extracted.
  The data set is planned from the runs' *token* shards (an extracted shard keeps its token shard's
  sequences, so lengths, split, step count and epochs >= 1 are the ones a job on the complete runs
  plans); epoch 0 takes the shards in arrival order, `SHUFFLE_WINDOW` at a time (fewer only once
  every shard has arrived), each window's sequences shuffled by (seed, 0, window); `refresh` lists
  the hidden records again and a late shard gets the same checks (sha256, header, values) as the
  others before it is trained on. The windows formed so far (`window_ids`) go into the checkpoint,
  so a resumed job rebuilds the same epoch 0 (`restore_windows`). Held-out evaluation reads the
  shards arrived so far (all of them once the runs are complete: `wait_arrived`).
- fp8 shards (a run's `storage_dtype`) travel as stored, e4m3 bytes plus float32 scales, up to
  `Batch.to`, which dequantizes where the batch lands (the GPU: half the host-to-device bytes and
  no host pass over the states) into the shard's states dtype, the bits `aerie.shard` computes.

Slot layout of a sequence x[0..T-1] (aux/final row t = target state after token t), for draft
step k at slot t: token x[t+1+k], target signal row t+1+k (the distribution over x[t+2+k]),
trained when loss_mask[t+2+k]. Slot t's first hidden is fc(aux[t]).
"""

from __future__ import annotations

import itertools
import json
import queue
import shutil
import struct
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import torch

from aerie import layout
from aerie.contracts import RunSpec, ShardRecord
from aerie.datasets import file_sha256
from aerie.errors import ExpectedError
from aerie.runs import shard_names
from aerie.shard import _DTYPES, Shard, ShardError, dequantize_tensors, read_safetensors, scale_name
from aerie.store import NotFound, ObjectStore

SHUFFLE_WINDOW = 4  # shards whose sequences are shuffled together


class DataError(ExpectedError, ValueError):
    """Runs or shards that cannot be trained on together."""


@dataclass(frozen=True)
class ShardRef:
    run: str
    name: str
    key: str
    sequences: int
    tokens: int
    sha256: str | None = None  # the record's: the bytes read must hash to it
    pending: bool = False  # streaming: not extracted yet; `key` is its token shard (same sequences)

    @property
    def id(self) -> str:
        return f"{self.run}/{self.name}"


@dataclass
class RunSet:
    """The runs a drafter trains on, checked to agree."""

    specs: list[RunSpec]
    shards: list[ShardRef]

    @property
    def spec(self) -> RunSpec:
        return self.specs[0]

    @property
    def capture_points(self) -> list[int]:
        return list(self.spec.capture_points)


def load_runs(store: ObjectStore, runs: list[str], stream: bool = False) -> RunSet:
    """The runs' specs, checked to agree, and their hidden shards. `stream`: every token shard,
    those not extracted yet as `pending` refs to their token shard (HiddenData.refresh resolves them)."""
    specs = []
    for run in runs:
        try:
            specs.append(store.get_json(layout.run_spec(run), RunSpec))
        except NotFound:
            raise DataError(
                f"run {run!r}: no {layout.run_spec(run)} in {store.url}: ingest and extract it first"
            ) from None
    first = specs[0]
    for spec in specs[1:]:
        for what, a, b in (
            ("target weights", first.target.weights_sha256, spec.target.weights_sha256),
            ("target architecture", first.target.architecture, spec.target.architecture),
            ("capture points", first.capture_points, spec.capture_points),
            ("hidden size", first.target.hidden_size, spec.target.hidden_size),
            ("target signal", (first.target_signal, first.topk), (spec.target_signal, spec.topk)),
            # the scale block may differ: each shard is dequantized with its own scales
            ("storage dtype", first.storage_dtype, spec.storage_dtype),
        ):
            if a != b:
                raise DataError(
                    f"runs {first.run!r} and {spec.run!r} differ in {what} ({a} vs {b}): a drafter trains "
                    "on runs of one target captured at the same points; train them separately"
                )
    shards = []
    for spec in specs:
        for name in shard_names(store, spec.run, "hidden"):
            ref = hidden_ref(store, spec.run, name)
            if ref is not None:
                shards.append(ref)
        if stream:
            arrived = {s.name for s in shards if s.run == spec.run}
            for name in shard_names(store, spec.run, "tokens"):
                if name not in arrived:
                    rec = store.get_json(layout.shard_record(spec.run, "tokens", name), ShardRecord)
                    shards.append(ShardRef(spec.run, rec.shard, rec.key, rec.sequences, rec.tokens, pending=True))
            shards.sort(key=lambda s: (runs.index(s.run), s.name))
        if not any(s.run == spec.run for s in shards):
            raise DataError(f"run {spec.run!r} has no hidden shards in {store.url}: run its extraction first")
    return RunSet(specs, shards)


def hidden_ref(store: ObjectStore, run: str, name: str) -> ShardRef | None:
    """The hidden shard `name` of `run` as its record says, None while it is not (fully) stored."""
    try:
        rec = store.get_json(layout.shard_record(run, "hidden", name), ShardRecord)
    except NotFound:
        return None
    if rec.kind != "hidden" or not store.exists(rec.key):
        return None
    return ShardRef(run, rec.shard, rec.key, rec.sequences, rec.tokens, rec.sha256)


# --------------------------------------------------------------------------------------
# Reading shards
# --------------------------------------------------------------------------------------
def read_tensors(store: ObjectStore, key: str, names: list[str]) -> dict[str, np.ndarray]:
    """Only the named tensors of a shard, by byte ranges (no need to fetch aux)."""
    local = store.local_path(key)
    if local is not None:
        shard, meta = read_safetensors(np.memmap(local, mode="r", dtype=np.uint8))
        names = [*names, *(scale_name(n) for n in names if scale_name(n) in shard)]  # fp8 states: their scales too
        return dequantize_tensors({n: np.array(shard[n]) for n in names}, meta)
    (n,) = struct.unpack("<Q", store.get_range(key, 0, 8))
    header = json.loads(store.get_range(key, 8, n))
    names = [*names, *(scale_name(n) for n in names if scale_name(n) in header)]
    out = {}
    for name in names:
        spec = header[name]
        a, b = spec["data_offsets"]
        raw = store.get_range(key, 8 + n + a, b - a)
        if len(raw) != b - a:  # the object ends first
            raise ShardError(f"tensor {name!r} ends at byte {8 + n + b}, past the object's end: truncated")
        tensors, _ = read_safetensors(_one_tensor_file(name, spec, raw))
        out[name] = tensors[name].copy()
    return dequantize_tensors(out, header.get("__metadata__") or {})


def check_shard(key: str, shard: Shard, spec: RunSpec) -> None:
    """Refuse (DataError naming the shard) states of another dtype or shape than `spec` says, or
    non-finite or beyond STATE_BOUND."""
    hidden = spec.target.hidden_size
    points = len(spec.capture_points)
    tokens = shard.num_tokens
    want = "F8_E4M3" if spec.storage_dtype else _STATES_DTYPE[spec.dtype]
    for name, arr, shape in (("aux", shard.aux, (tokens, points, hidden)), ("final", shard.final, (tokens, hidden))):
        if arr is None:
            if name == "aux" or spec.target_signal == "final":
                raise DataError(f"hidden shard {key}: no {name!r} tensor: re-extract the run")
            continue
        if arr.dtype != _DTYPES[want] or tuple(arr.shape) != shape:
            raise DataError(
                f"hidden shard {key}: {name!r} is {arr.dtype} {tuple(arr.shape)}, the run spec says {want} {shape}: "
                "corrupted or from another run; re-extract the run"
            )
    arrays = [("aux", shard.aux, 1.0), ("final", shard.final, 1.0)]
    if shard.quantized:
        arrays = [
            ("aux", shard.aux, None),
            ("final", shard.final, None),
            ("aux scale", shard.aux_scale, _FP8_MAX),
            ("final scale", shard.final_scale, _FP8_MAX),
        ]
    if shard.topk_logprobs is not None:
        arrays.append(("topk_logprobs", shard.topk_logprobs, "nan"))
    for name, arr, factor in arrays:
        if arr is None:
            continue
        for start in range(0, arr.shape[0], _CHECK_ROWS):
            raw = np.asarray(arr[start : start + _CHECK_ROWS])
            if factor is None and raw.dtype == _E4M3:
                # e4m3fn has no infinity and |q| <= 448: its only bad value is NaN (S.1111.111), found
                # in the bytes; converting to float32 first made this check the trainer's bottleneck
                bad = (raw.view(np.uint8) & 0x7F) == 0x7F
                if not bad.any():
                    continue
            part = raw.astype(np.float32)
            if factor == "nan":
                bad = np.isnan(part)
            elif factor is None:
                bad = ~np.isfinite(part)
            else:
                bad = ~np.isfinite(part) | (np.abs(part) * factor > STATE_BOUND)
            if bad.any():
                row = start + int(np.argwhere(bad)[0][0])
                value = part.reshape(part.shape[0], -1)[row - start][bad.reshape(part.shape[0], -1)[row - start]][0]
                raise DataError(
                    f"hidden shard {key}: {name} at token {row} is {value} (non-finite or beyond "
                    f"{STATE_BOUND:g}, STATE_BOUND): corrupted states are never trained on; re-extract the run"
                )


def _offsets(store: ObjectStore, key: str) -> np.ndarray:
    try:
        return read_tensors(store, key, ["offsets"])["offsets"]
    except (ShardError, ValueError, KeyError, struct.error) as e:
        raise DataError(f"hidden shard {key}: not a readable shard ({e}): re-extract the run") from None


def _one_tensor_file(name: str, spec: dict, raw: bytes) -> bytes:
    head = json.dumps({name: {**spec, "data_offsets": [0, len(raw)]}}).encode()
    return struct.pack("<Q", len(head)) + head + raw


# A hidden state's magnitude above this is corruption, not a model's state: fp16's largest finite
# value, so every state trained on can also be served in fp16 (and bf16), while the "massive
# activations" of LLMs stay orders of magnitude below it.
STATE_BOUND = 65504.0
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
_FP8_MAX = 448.0  # e4m3fn's largest finite value: a state is q * scale with |q| <= this
_STATES_DTYPE = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
_CHECK_ROWS = 4096  # rows converted to float32 at a time when checking values (bounded memory)


class ShardCache:
    """Opens shards: memory-mapped in place on a filesystem store, else downloaded to a temp dir.

    With `expect` (key -> (ShardRef, RunSpec)), every shard is checked before it is first trained on:
    its bytes hash to the record's sha256, its header holds the dtype and shape the run spec says,
    and its states are finite and within STATE_BOUND. A shard that fails is a DataError naming it:
    corrupt data is never trained on. `verified` (shared by the caches of one HiddenData) holds the
    keys already checked: a shard reopened (each epoch, each held-out evaluation) is not read again
    to be checked; a downloaded one is still compared with its record, as hashing it is free there."""

    def __init__(
        self,
        store: ObjectStore,
        expect: dict[str, tuple[ShardRef, RunSpec]] | None = None,
        verified: set[str] | None = None,
    ):
        self.store = store
        self.expect = {} if expect is None else expect  # the data's own dict: a streamed job adds late shards
        self.verified = set() if verified is None else verified
        self.dir = Path(tempfile.mkdtemp(prefix="aerie-shards-"))
        self.open_shards: dict[str, Shard] = {}

    def get(self, key: str) -> Shard:
        if key not in self.open_shards:
            expected = self.expect.get(key)
            checked = expected is None or key in self.verified
            local, got = self.store.local_path(key), None
            if local is None:
                local = self.dir / key.replace("/", "__")
                got = self.store.download(key, local)  # hashed while downloading
            elif not checked:
                got = file_sha256(local)
            if expected is not None and expected[0].sha256 is not None and got not in (None, expected[0].sha256):
                raise DataError(
                    f"hidden shard {key}: sha256 {got[:12]}… differs from its record's {expected[0].sha256[:12]}…: "
                    "corrupted or replaced; re-extract the run"
                )
            try:
                shard = Shard.open(local)
            except ShardError as e:
                raise DataError(f"hidden shard {key}: not a readable shard ({e}): re-extract the run") from None
            if not checked:
                try:
                    shard.validate(check_finite=False)  # structure; values below, in bounded parts
                except ShardError as e:
                    raise DataError(f"hidden shard {key}: {e}: re-extract the run") from None
                check_shard(key, shard, expected[1])
                self.verified.add(key)
            self.open_shards[key] = shard
        return self.open_shards[key]

    def keep_only(self, keys: set[str]) -> None:
        for key in list(self.open_shards):
            if key not in keys:
                del self.open_shards[key]
                (self.dir / key.replace("/", "__")).unlink(missing_ok=True)

    def close(self) -> None:
        self.open_shards.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


# --------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------
@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, L+S) int64: slot j holds x[j+1]
    aux: torch.Tensor  # (B, L, K*Ht) shard dtype: aux[t]
    loss_mask: torch.Tensor  # (B, L+S) bool: loss_mask[j+2]
    final: torch.Tensor | None = None  # (B, L+S, H): signal row j+1
    topk_ids: torch.Tensor | None = None  # (B, L+S, k) int64
    topk_logprobs: torch.Tensor | None = None  # (B, L+S, k) float32
    tokens: int = 0  # real slots
    aux_scale: torch.Tensor | None = None  # fp8 shards: (B, L, K, G) float32 (aux is float8_e4m3fn)
    final_scale: torch.Tensor | None = None  # fp8 shards: (B, L+S, G) float32
    states_dtype: torch.dtype | None = None  # fp8 shards: what aux/final dequantize into

    def to(self, device, non_blocking: bool = False) -> Batch:
        """The batch on `device`; fp8 states dequantized there (aux, final in states_dtype)."""
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        moved = Batch(
            move(self.input_ids),
            move(self.aux),
            move(self.loss_mask),
            move(self.final),
            move(self.topk_ids),
            move(self.topk_logprobs),
            self.tokens,
        )
        if self.aux_scale is not None:
            moved.aux = dequantize(moved.aux, move(self.aux_scale), self.states_dtype)
            if self.final is not None:
                moved.final = dequantize(moved.final, move(self.final_scale), self.states_dtype)
        return moved


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(q (..., H) float8_e4m3fn or its flattened (..., K*H), scale (..., [K,] G)) -> q * scale in
    `dtype`: float32 math, one rounding (aerie.shard.dequantize_e4m3's bits)."""
    v = q.to(torch.float32).view(*scale.shape, -1) * scale[..., None]  # (..., [K,] G, H // G)
    return v.to(dtype).view(q.shape)


_TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def _torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype == np.dtype("bfloat16"):
        return torch.from_numpy(np.ascontiguousarray(a).view(np.uint16)).view(torch.bfloat16)
    if a.dtype == np.dtype("float8_e4m3fn"):
        return torch.from_numpy(np.ascontiguousarray(a).view(np.uint8)).view(torch.float8_e4m3fn)
    return torch.from_numpy(np.ascontiguousarray(a))


def _finer(scale: np.ndarray, G: int) -> np.ndarray:
    """Scales [..., g] as G scales a row (g divides G): each repeated over the G/g blocks it covers."""
    g = scale.shape[-1]
    return scale if g == G else np.repeat(scale, G // g, axis=-1)


def collate(sequences: list[dict[str, np.ndarray]], ttt_steps: int, states_dtype: str | None = None) -> Batch:
    """Sequences (Shard.sequence dicts, T >= 3) -> one right-padded batch. Sequences of an fp8
    shard as stored (`sequence(s, dequantize=False)`: with aux_scale/final_scale) make a batch of
    fp8 states that `Batch.to` dequantizes into `states_dtype` (BF16/F16/F32)."""
    B = len(sequences)
    L = max(len(s["input_ids"]) for s in sequences) - 1
    W = L + ttt_steps
    first = sequences[0]
    K, Ht = first["aux"].shape[1:]
    input_ids = np.zeros((B, W), dtype=np.int64)
    loss_mask = np.zeros((B, W), dtype=bool)
    aux = np.zeros((B, L, K * Ht), dtype=first["aux"].dtype)
    final = np.zeros((B, W, first["final"].shape[1]), dtype=first["final"].dtype) if "final" in first else None
    if "topk_ids" in first:
        k = first["topk_ids"].shape[1]
        topk_ids, topk_lp = np.zeros((B, W, k), dtype=np.int64), np.full((B, W, k), -np.inf, dtype=np.float32)
    quantized = "aux_scale" in first
    if quantized:  # scale 0 on padding: it dequantizes to zeros, as the other dtypes pad
        # runs may differ in scale block (an older run's one per row beside 128 values per scale):
        # the batch takes the finest, each coarser scale repeated over the blocks it covers
        G = max(s["aux_scale"].shape[-1] for s in sequences)
        coarse = sorted({s["aux_scale"].shape[-1] for s in sequences if G % s["aux_scale"].shape[-1]})
        if coarse:
            raise DataError(
                f"fp8 sequences with {coarse} and {G} scales a row cannot share a batch (neither block divides the "
                "other): train these runs separately, or re-extract one with the other's scale_block"
            )
        aux_scale = np.zeros((B, L, K, G), dtype=np.float32)
        final_scale = np.zeros((B, W, G), dtype=np.float32) if final is not None else None
    tokens = 0
    for b, s in enumerate(sequences):
        T = len(s["input_ids"])
        tokens += T - 1
        input_ids[b, : T - 1] = s["input_ids"][1:]
        loss_mask[b, : T - 2] = s["loss_mask"][2:].astype(bool)
        aux[b, : T - 1] = s["aux"][: T - 1].reshape(T - 1, K * Ht)
        if quantized:
            aux_scale[b, : T - 1] = _finer(s["aux_scale"][: T - 1], G)
        if final is not None:
            final[b, : T - 1] = s["final"][1:]
            if quantized:
                final_scale[b, : T - 1] = _finer(s["final_scale"][1:], G)
        else:
            topk_ids[b, : T - 1] = s["topk_ids"][1:]
            topk_lp[b, : T - 1] = s["topk_logprobs"][1:]
    batch = Batch(torch.from_numpy(input_ids), _torch(aux), torch.from_numpy(loss_mask), tokens=tokens)
    if final is not None:
        batch.final = _torch(final)
    else:
        batch.topk_ids, batch.topk_logprobs = torch.from_numpy(topk_ids), torch.from_numpy(topk_lp)
    if quantized:
        if states_dtype not in _TORCH_DTYPES:
            raise DataError(
                f"fp8 sequences need the dtype they dequantize into (BF16, F16 or F32), got {states_dtype!r}"
            )
        batch.aux_scale, batch.states_dtype = torch.from_numpy(aux_scale), _TORCH_DTYPES[states_dtype]
        if final is not None:
            batch.final_scale = torch.from_numpy(final_scale)
    return batch


# --------------------------------------------------------------------------------------
# The data set: split, epoch plans, the prefetching iterator
# --------------------------------------------------------------------------------------
Item = tuple[int, int]  # (shard index, sequence index)


class HiddenData:
    def __init__(
        self,
        store: ObjectStore,
        runset: RunSet,
        *,
        batch_tokens: int,
        max_seq_tokens: int,
        ttt_steps: int,
        seed: int,
        holdout_fraction: float,
        prefetch: int = 4,
        rank: int = 0,
        world_size: int = 1,
        stream: bool = False,
        poll_s: float = 0.5,
    ):
        self.store, self.runset = store, runset
        self.batch_tokens, self.max_seq_tokens, self.ttt_steps = batch_tokens, max_seq_tokens, ttt_steps
        self.seed, self.prefetch, self.rank, self.world_size = seed, prefetch, rank, world_size
        self.shards = runset.shards
        specs = {spec.run: spec for spec in runset.specs}
        self.specs = specs
        self.expect = {s.key: (s, specs[s.run]) for s in self.shards if not s.pending}
        self.stream, self.poll_s = stream, poll_s
        if stream and world_size > 1:
            raise DataError(
                f"a streamed training runs on one rank (this job has {world_size}): its first epoch follows the "
                "order shards arrive in, which one process observes; train with AERIE_TRAIN_RANKS=1 or without --stream"
            )
        self.windows: list[list[int]] = []  # streaming: epoch 0's shard windows, in the order formed
        self._stream0: list[list[Item]] = []  # their batches
        self.closing = threading.Event()
        self.verified: set[str] = set()  # shards checked once (ShardCache), not again on each reopening
        # sequence lengths from the offsets alone (a few bytes per shard, fetched by range)
        self.lengths = [np.diff(_offsets(store, s.key)) for s in self.shards]
        self.train_items, self.holdout_items = self._split(holdout_fraction)
        self.wait_s = 0.0
        if not self.train_items:
            raise DataError(f"runs {[s.run for s in runset.specs]}: no training sequence of >= 3 tokens")

    def _split(self, fraction: float) -> tuple[list[Item], list[Item]]:
        rng = np.random.default_rng([self.seed, 7])
        usable = [(i, s) for i, lens in enumerate(self.lengths) for s in range(len(lens)) if lens[s] >= 3]
        n_hold_shards = round(fraction * len(self.shards))
        if fraction > 0 and 1 <= n_hold_shards < len(self.shards) and len(self.shards) >= 4:
            held = set(rng.permutation(len(self.shards))[:n_hold_shards].tolist())
            self.split = "shard"
            return [it for it in usable if it[0] not in held], [it for it in usable if it[0] in held]
        self.split = "sequence"
        n_hold = max(1, round(fraction * len(usable))) if fraction > 0 and len(usable) > 1 else 0
        order = rng.permutation(len(usable))
        held = {usable[j] for j in order[:n_hold]}
        return [it for it in usable if it not in held], [usable[j] for j in sorted(order[:n_hold])]

    # --- the plan ---------------------------------------------------------------------
    def _pack(self, items: list[Item]) -> list[list[Item]]:
        batches, cur, used = [], [], 0
        for it in items:
            n = min(int(self.lengths[it[0]][it[1]]), self.max_seq_tokens)
            if cur and used + n > self.batch_tokens:
                batches.append(cur)
                cur, used = [], 0
            cur.append(it)
            used += n
        if cur:
            batches.append(cur)
        return batches

    def epoch_plan(self, epoch: int) -> list[list[Item]]:
        """The group's batches of an epoch (every rank's), in order (the same on every call)."""
        rng = np.random.default_rng([self.seed, epoch])
        by_shard: dict[int, list[Item]] = {}
        for it in self.train_items:
            by_shard.setdefault(it[0], []).append(it)
        order = [int(i) for i in rng.permutation(sorted(by_shard))]
        plan: list[list[Item]] = []
        for w in range(0, len(order), SHUFFLE_WINDOW):
            items = [it for i in order[w : w + SHUFFLE_WINDOW] for it in by_shard[i]]
            plan += self._pack([items[j] for j in rng.permutation(len(items))])
        return plan

    # --- streaming: epoch 0 in arrival order ------------------------------------------
    @property
    def arrived(self) -> bool:
        return not any(s.pending for s in self.shards)

    def refresh(self) -> bool:
        """List the runs' hidden records again; shards extracted since become trainable (checked
        like every shard when first opened). A shard that failed for good is a DataError. -> every
        shard has arrived."""
        pending = {s.run for s in self.shards if s.pending}
        for run in pending:
            hidden = set(shard_names(self.store, run, "hidden"))
            failed = set(layout.record_names(self.store.list(layout.failures_prefix(run))))
            for i, ref in enumerate(self.shards):
                if ref.run != run or not ref.pending:
                    continue
                if ref.name in hidden:
                    new = hidden_ref(self.store, run, ref.name)
                    if new is not None:
                        self.expect[new.key] = (new, self.specs[run])
                        self.shards[i] = new
                elif ref.name in failed:
                    raise DataError(
                        f"run {run!r}: shard {ref.name} failed for good ({layout.shard_failure(run, ref.name)}): "
                        "a streamed training cannot finish without it; retry the run's extraction"
                    )
        return self.arrived

    def wait_arrived(self) -> None:
        """Until every shard of the runs is extracted (a streamed job, before its final evaluation)."""
        while not self.refresh():
            if self.closing.wait(self.poll_s):
                raise DataError("stopped while waiting for the runs' shards")

    def _stream_window(self, shards: list[int]) -> None:
        taken = set(shards)
        items = [it for it in self.train_items if it[0] in taken]
        rng = np.random.default_rng([self.seed, 0, len(self.windows)])
        self.windows.append(shards)
        self._stream0 += self._pack([items[j] for j in rng.permutation(len(items))])

    def _next_window(self) -> bool:
        """Form epoch 0's next window from the shards arrived and not taken yet (name order):
        `SHUFFLE_WINDOW` of them, or the rest once all have arrived; waits for them. -> False when
        every training shard is in a window (epoch 0 is complete)."""
        wanted = sorted({it[0] for it in self.train_items} - {i for w in self.windows for i in w})
        while wanted:
            all_in = self.refresh()
            ready = [i for i in wanted if not self.shards[i].pending]
            if len(ready) >= SHUFFLE_WINDOW or all_in:
                self._stream_window(ready[:SHUFFLE_WINDOW])
                return True
            if self.closing.wait(self.poll_s):
                raise DataError("stopped while waiting for the runs' shards")
        return False

    def window_ids(self) -> list[list[str]]:
        """Epoch 0's windows so far, as shard ids (run/name): what a checkpoint keeps."""
        return [[self.shards[i].id for i in w] for w in list(self.windows)]

    def restore_windows(self, windows: list[list[str]]) -> None:
        """A resumed streamed job: epoch 0's windows as its checkpoint recorded them."""
        index = {s.id: i for i, s in enumerate(self.shards)}
        self.refresh()
        for ids in windows:
            missing = [i for i in ids if i not in index or self.shards[index[i]].pending]
            if missing:
                raise DataError(
                    f"the checkpoint's epoch 0 read shards {missing} that the runs no longer hold: "
                    "re-extract them, or train anew (another --train-id)"
                )
            self._stream_window([index[i] for i in ids])

    def _has(self, plans: dict[int, list[list[Item]]], e: int, i: int) -> bool:
        """Whether epoch `e` has a batch `i` (epoch 0 of a streamed job grows as shards arrive)."""
        if self.stream and e == 0:
            plans[0] = self._stream0
            while i >= len(self._stream0) and self._next_window():
                pass
            return i < len(self._stream0)
        if e not in plans:
            plans[e] = self.epoch_plan(e)
        return i < len(plans[e])

    def rank_plan(self, epoch: int = 0, index: int = 0) -> Iterator[tuple[tuple[int, int], list[Item]]]:
        """This rank's batches, endless, from the group's data position (epoch, index): the group
        takes the epochs' batches in order, rank r the r-th of each `world_size`, across epoch ends
        (no batch dropped, so W ranks with accumulation A take exactly the batches one process takes
        with W*A). Yields (the group's position after this round, the batch); the position is the
        same on every rank, so rank 0's checkpoint resumes all of them."""
        plans: dict[int, list[list[Item]]] = {}

        def advance(e: int, i: int, k: int) -> tuple[int, int]:
            i += k
            while not self._has(plans, e, i):
                i, e = i - len(plans[e]), e + 1
            return e, i

        e, i = advance(epoch, index, 0)
        while True:
            be, bi = advance(e, i, self.rank)
            batch = plans[be][bi]
            e, i = advance(e, i, self.world_size)
            for old in [k for k in plans if k < e]:
                del plans[old]
            yield (e, i), batch

    def load(self, cache: ShardCache, batch: list[Item]) -> Batch:
        seqs = []
        for shard_idx, seq_idx in batch:
            shard = cache.get(self.shards[shard_idx].key)
            seq = shard.sequence(seq_idx, dequantize=False)  # fp8 stays fp8 until Batch.to (load_runs: one storage)
            seqs.append({k: v[: self.max_seq_tokens] for k, v in seq.items()})
        return collate(seqs, self.ttt_steps, shard.states_dtype)

    # --- iteration ----------------------------------------------------------------------
    def batches(self, epoch: int = 0, index: int = 0) -> Prefetcher:
        """This rank's endless batches from the group's data position (epoch, index) (rank_plan);
        yields (the position after them, Batch)."""

        self.closing.clear()

        def produce() -> Iterator:
            cache = ShardCache(self.store, self.expect, self.verified)
            try:
                plan = self.rank_plan(epoch, index)
                ahead = deque(itertools.islice(plan, self.prefetch + 1))
                while True:
                    pos, items = ahead.popleft()
                    ahead.append(next(plan))
                    # the next few batches' shards stay open instead of being downloaded again
                    cache.keep_only({self.shards[s].key for b in [items, *(b for _, b in ahead)] for s, _ in b})
                    yield pos, self.load(cache, items)
            finally:
                cache.close()

        return Prefetcher(produce, self.prefetch, self)

    def holdout_batches(self, max_batches: int | None = None) -> Iterator[Batch]:
        cache = ShardCache(self.store, self.expect, self.verified)
        try:
            for n, batch in enumerate(self._pack(self._holdout_arrived())):
                if max_batches is not None and n >= max_batches:
                    break
                yield self.load(cache, batch)
        finally:
            cache.close()

    def _holdout_arrived(self) -> list[Item]:
        """The held-out sequences of the shards extracted so far (all of them unless streaming)."""
        if self.stream:
            self.refresh()
        return [it for it in self.holdout_items if not self.shards[it[0]].pending]

    def holdout_sequences(self, n: int) -> list[dict[str, np.ndarray]]:
        """Up to n held-out sequences (input_ids, loss_mask), e.g. for prompts."""
        out = []
        for shard_idx, seq_idx in self._holdout_arrived()[:n]:
            t = read_tensors(self.store, self.shards[shard_idx].key, ["input_ids", "loss_mask", "offsets"])
            a, b = int(t["offsets"][seq_idx]), int(t["offsets"][seq_idx + 1])
            out.append({"input_ids": t["input_ids"][a:b], "loss_mask": t["loss_mask"][a:b]})
        return out

    def loss_token_counts(self, vocab_size: int) -> np.ndarray:
        """(V,) counts of loss-masked tokens over the training sequences."""
        counts = np.zeros(vocab_size, dtype=np.int64)
        by_shard: dict[int, list[int]] = {}
        for s, q in self.train_items:
            by_shard.setdefault(s, []).append(q)
        for s, seqs in by_shard.items():
            t = read_tensors(self.store, self.shards[s].key, ["input_ids", "loss_mask", "offsets"])
            keep = np.zeros(len(t["input_ids"]), dtype=bool)
            for q in seqs:
                keep[t["offsets"][q] : t["offsets"][q + 1]] = True
            ids = t["input_ids"][keep & (t["loss_mask"] == 1)]
            if ids.size and int(ids.max()) >= vocab_size:
                raise DataError(f"shard {self.shards[s].key}: token id {int(ids.max())} >= target vocab {vocab_size}")
            counts += np.bincount(ids, minlength=vocab_size)
        return counts

    def target_token_counts(self, vocab_size: int, argmax, max_tokens: int) -> np.ndarray:
        """(V,) counts of the *target's* greedy token at the trained positions of the training
        sequences (up to `max_tokens` of them, shard by shard): the tokens the drafter must propose.

        argmax(rows) -> target ids: rows of the run's target signal (`final` [n, H], or
        `topk_ids`/`topk_logprobs` [n, k]) for the positions whose next token is trained."""
        counts = np.zeros(vocab_size, dtype=np.int64)
        signal = ["final"] if self.runset.spec.target_signal == "final" else ["topk_ids", "topk_logprobs"]
        by_shard: dict[int, list[int]] = {}
        for s, q in self.train_items:
            by_shard.setdefault(s, []).append(q)
        seen = 0
        for s, seqs in by_shard.items():
            if seen >= max_tokens:
                break
            if self.shards[s].pending:  # streaming: the target's tokens of the shards extracted so far
                continue
            t = read_tensors(self.store, self.shards[s].key, ["loss_mask", "offsets", *signal])
            keep = np.zeros(len(t["loss_mask"]), dtype=bool)
            for q in seqs:  # row r predicts token r+1: kept when that token is trained, in the same sequence
                a, b = t["offsets"][q], t["offsets"][q + 1]
                keep[a : b - 1] = t["loss_mask"][a + 1 : b] == 1
            rows = np.flatnonzero(keep)[: max_tokens - seen]
            if rows.size:
                ids = np.asarray(argmax({name: t[name][rows] for name in signal}), dtype=np.int64)
                counts += np.bincount(ids, minlength=vocab_size)[:vocab_size]
                seen += rows.size
        return counts


class Prefetcher:
    """Runs a batch generator in a daemon thread, `depth` batches ahead."""

    _DONE = object()

    def __init__(self, make_iter, depth: int, owner: HiddenData):
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.owner = owner
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(make_iter,), daemon=True, name="aerie-prefetch")
        self.thread.start()

    def _run(self, make_iter) -> None:
        try:
            for item in make_iter():
                while not self.stop.is_set():
                    try:
                        self.queue.put(item, timeout=0.2)
                        break
                    except queue.Full:
                        continue
                if self.stop.is_set():
                    return
        except BaseException as e:  # handed to the training loop, raised there
            self.queue.put(e)

    def __iter__(self):
        return self

    def __next__(self):
        t0 = time.perf_counter()
        item = self.queue.get()
        self.owner.wait_s += time.perf_counter() - t0
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self.stop.set()
        self.owner.closing.set()  # a streamed epoch waiting for shards stops waiting
        self.thread.join(timeout=10)
