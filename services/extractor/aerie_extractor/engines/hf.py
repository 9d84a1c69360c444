"""The `hf` engine: a transformers forward in this process, the reference for every other engine.

- Capture point k is `output_hidden_states[k]` (aerie.capture.hf_hidden_state_indices); the
  final state is `hidden_states[N]`, the post-final-norm state the lm_head reads.
- Sequences are grouped by length into batches of at most `settings.tokens_per_batch` padded
  tokens (right padding + attention mask, so real tokens never see the padding).
- Runs the base model (no lm_head) unless the run wants top-k log-probs.
- `capture_into` (signal "final", what `run_extract` uses) writes straight into the shard's
  arrays and overlaps the host with the device: each batch's real rows are gathered on the
  device (no padding crosses the bus), checked finite there, copied into a pinned buffer without
  blocking, and copied into place on the host by a helper thread while the launching thread goes
  on to the next batch. `capture_into_async` returns once the batches are launched (a Future of
  the finite flag): the next shard's batches queue behind this one's last copies, so a stream of
  shards does not drain the device at each shard's end.
- A run stored as fp8 gets its states quantized on the device (`quantize_e4m3`, the same bits as
  `aerie.shard.quantize_e4m3`): half the bytes cross the bus, and the writers, whose numpy
  quantization is far slower than the device's forward and slows the captures beside it, have
  nothing to quantize.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from aerie.capture import hf_hidden_state_indices, to_engine_ids
from aerie.contracts import EngineSpec, RunSpec, TargetSpec
from aerie.settings import Settings
from aerie.shard import E4M3_MAX, np_dtype
from aerie.target import describe, hf_load_kwargs
from aerie_extractor.engines.base import Captured, Engine, EngineError, EngineMismatch

log = logging.getLogger(__name__)


def _torch_dtype(torch, name: str, device: str):
    if name == "float16" and device == "cpu":
        return torch.float32  # half matmuls on CPU are slow or missing; stored as float16 anyway
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def to_numpy(t, dtype: str) -> np.ndarray:
    """A torch tensor -> numpy in the run's storage dtype (bf16 as ml_dtypes.bfloat16)."""
    import torch

    t = t.detach().to(getattr(torch, dtype)).contiguous().to("cpu")  # convert where it lives, then copy
    return _host_bits(t).view(np_dtype(dtype))


def quantize_e4m3(x, block: int):
    """x (..., H) on any device -> (q (..., H) float8_e4m3fn, scale (..., H // block) float32): the
    same bits as `aerie.shard.quantize_e4m3` (float32 math, each division a true division: torch on
    CUDA turns a division by a CPU scalar into a multiplication by its reciprocal, which rounds
    differently, so the divisors are tensors)."""
    import torch

    H = x.shape[-1]
    v = x.float().reshape(*x.shape[:-1], H // block, block)
    amax = v.abs().amax(dim=-1)  # NaN/Inf propagate (capture_into's finite flag reports them)
    scale = amax / torch.full_like(amax, E4M3_MAX)
    v = v / torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(-1)
    v.clamp_(-E4M3_MAX, E4M3_MAX)  # a quotient a hair above 448 must not round to NaN
    return v.to(torch.float8_e4m3fn).reshape(x.shape), scale


def _host_bits(t) -> np.ndarray:
    """A host tensor as numpy of plain integers where numpy has no such float (bf16 -> int16, fp8 ->
    uint8): copies between such arrays are plain memory copies, no ml_dtypes cast runs."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy()
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy()
    return t.numpy()


def _np_bits(a: np.ndarray) -> np.ndarray:
    """The numpy side of `_host_bits`: bf16 arrays viewed as int16, fp8 as uint8."""
    if a.dtype == np_dtype("bfloat16"):
        return a.view(np.int16)
    if a.dtype == np_dtype("float8_e4m3fn"):
        return a.view(np.uint8)
    return a


def _one_at_a_time(method):
    """The engine's captures one at a time (its pinned buffers and the device are shared): the
    tasks of a threads-pool worker capture in turn and store side by side. Every capture runs on
    the engine's own launching thread, whichever thread asks: torch keeps per-thread state that
    the forward pays to build, e.g. cuDNN attention's execution graphs, cached `thread_local` and
    per shape (aten/src/ATen/native/cudnn/MHA.cpp), so a capture from a fresh pool thread (a
    Celery threads-pool task's) runs well below one from the thread that ran it before
    (BENCHMARKS.md, "capture at engine speed")."""

    @functools.wraps(method)
    def serialized(self, *args, **kwargs):
        with self._lock:
            if threading.current_thread() is self._launch_thread:
                return method(self, *args, **kwargs)
            return self._launcher.submit(method, self, *args, **kwargs).result()

    return serialized


def length_batches(lengths: list[int], tokens_per_batch: int) -> list[list[int]]:
    """Indices grouped longest-first so that len(batch) * longest <= tokens_per_batch."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= tokens_per_batch:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


class HFEngine(Engine):
    # fp8 runs are quantized on the device (extract asks the engine; False: the writers quantize,
    # as every other engine's shards are)
    quantize_on_device = True

    def __init__(self, settings: Settings, run_spec: RunSpec, model_path: str | None = None):
        import torch
        from transformers import AutoModelForCausalLM

        self.settings, self.run = settings, run_spec
        if settings.device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # prefork children share the cores: do not oversubscribe them
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // settings.worker_concurrency))
        self.model_path = str(model_path or run_spec.target.model)
        self.device = settings.device
        self.compute_dtype = _torch_dtype(torch, run_spec.dtype, self.device)
        self.spec = self.spec_for(settings, run_spec.target, run_spec.capture_points, run_spec.dtype)
        self.indices = hf_hidden_state_indices(run_spec.capture_points, run_spec.target.num_layers)
        started = time.monotonic()
        try:
            model = AutoModelForCausalLM.from_pretrained(
                self.model_path, dtype=self.compute_dtype, use_safetensors=True, **hf_load_kwargs(self.model_path)
            )
        except (OSError, ValueError) as e:
            raise EngineMismatch(f"hf engine cannot load the target from {self.model_path}: {e}") from e
        self.model = model.to(self.device).eval()
        self.base = getattr(model, model.base_model_prefix)
        self._pinned: Any = None  # capture_into's host buffers (CUDA torch tensors), grown on demand
        self._lock = threading.Lock()
        # the thread every capture runs on (_one_at_a_time), for the life of the engine
        self._launcher = ThreadPoolExecutor(1, thread_name_prefix="aerie-hf-launch")
        self._launch_thread = self._launcher.submit(self._launch_thread_start, torch.get_num_threads()).result()
        # capture_into's helper: places the rows of each pinned buffer set once its copies are done,
        # in launch order, across calls (the device is not drained between shards)
        self._placer = ThreadPoolExecutor(1, thread_name_prefix="aerie-hf-place")
        self._placing: list[Future | None] = [None, None]  # per pinned buffer set: the place of the batch in it
        self._next_slot = 0
        log.info(
            "hf engine: %s on %s (%s) in %.1f s",
            self.model_path,
            self.device,
            self.compute_dtype,
            time.monotonic() - started,
        )

    @staticmethod
    def _launch_thread_start(intra_op: int) -> threading.Thread:
        """The launching thread's first job: torch's intra-op thread count as the thread that built
        the engine has it (on the CPU, a prefork worker's children share the cores; OpenMP keeps
        this setting per thread, and the torch build here reports the same count in a new thread
        either way)."""
        import torch

        torch.set_num_threads(intra_op)
        return threading.current_thread()

    @classmethod
    def spec_for(cls, settings: Settings, target: TargetSpec, capture_points: list[int], dtype: str) -> EngineSpec:
        import transformers

        return EngineSpec(
            name="hf",
            version=transformers.__version__,
            convention="hf",
            layer_ids=to_engine_ids(capture_points, "hf", target.num_layers),
            transport="inproc",
            dtype=dtype,
        )

    def check(self, run: RunSpec) -> None:
        if run.engine.name != "hf":
            raise EngineMismatch(f"run {run.run!r} records engine {run.engine.name!r}, not 'hf'")
        if run.engine.version != self.spec.version:
            raise EngineMismatch(
                f"run {run.run!r} was planned with transformers {run.engine.version}, this worker has "
                f"{self.spec.version}: install transformers=={run.engine.version} or start a new run"
            )
        if run.engine.layer_ids != self.spec.layer_ids:
            raise EngineMismatch(
                f"run {run.run!r} records hf layer ids {run.engine.layer_ids}, its capture points "
                f"{run.capture_points} translate to {self.spec.layer_ids}"
            )
        here = describe(self.model_path)
        for name in ("weights_sha256", "tokenizer_sha256", "num_layers", "hidden_size"):
            if getattr(here, name) != getattr(run.target, name):
                raise EngineMismatch(
                    f"the target at {self.model_path} is not the run's target: {name} "
                    f"{getattr(here, name)} != {getattr(run.target, name)} recorded in runs/{run.run}/run.json "
                    "(point the worker at the same model folder the run was ingested with)"
                )

    def forward(self, batch: list[np.ndarray], hidden_states: bool = True):
        """One padded forward -> the hidden_states tuple (B, L, H) each; no conversion.
        hidden_states=False: the last state alone (B, L, H), the others not kept (a bare forward)."""
        import torch

        longest = max(len(s) for s in batch)
        ids = torch.zeros((len(batch), longest), dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for b, s in enumerate(batch):
            ids[b, : len(s)] = torch.from_numpy(np.asarray(s, dtype=np.int64))
            mask[b, : len(s)] = 1
        cuda = self.device.startswith("cuda")
        if cuda:
            ids, mask = ids.pin_memory(), mask.pin_memory()
        with torch.inference_mode():
            out = self.base(
                input_ids=ids.to(self.device, non_blocking=cuda),
                attention_mask=mask.to(self.device, non_blocking=cuda),
                output_hidden_states=hidden_states,
                use_cache=False,
            )
        return out.hidden_states if hidden_states else out.last_hidden_state

    def _checked_forward(self, batch: list[np.ndarray]):
        try:
            hs = self.forward(batch)
        except RuntimeError as e:  # CUDA OOM and friends: the task may retry
            raise EngineError(
                f"hf forward failed on {len(batch)} sequences of up to {len(batch[0])} tokens: {e}"
            ) from e
        N = self.run.target.num_layers
        if len(hs) != N + 1:
            raise EngineMismatch(f"hf returned {len(hs)} hidden states, a {N}-layer target has {N + 1}")
        return hs

    def capture_into(
        self,
        sequences: list[np.ndarray],
        offsets: np.ndarray,
        aux: np.ndarray,
        final: np.ndarray,
        aux_scale: np.ndarray | None = None,
        final_scale: np.ndarray | None = None,
    ) -> bool:
        """Signal "final": sequence i's states go to rows offsets[i]:offsets[i+1] of aux [T, K, H]
        and final [T, H] (the run's dtype). With aux_scale [T, K, G] and final_scale [T, G]
        (float32), aux and final are float8_e4m3fn, quantized on the device with a scale per H // G
        values. True when every value was checked finite on the device (False: something is not
        finite; the caller's validation says where)."""
        return self.capture_into_async(sequences, offsets, aux, final, aux_scale, final_scale).result()

    @_one_at_a_time
    def capture_into_async(
        self,
        sequences: list[np.ndarray],
        offsets: np.ndarray,
        aux: np.ndarray,
        final: np.ndarray,
        aux_scale: np.ndarray | None = None,
        final_scale: np.ndarray | None = None,
    ) -> Future:
        """`capture_into` that returns once every batch is launched: a Future of its finite flag,
        done when the last rows are in the arrays (until then nothing may read or reuse them). The
        device is not drained between calls: the next shard's batches queue behind this one's last
        copies while the helper thread places them, so a stream of shards keeps the device busy.
        Raises at once, after this call's rows already handed to the helper are placed, when a
        forward fails."""
        import torch

        K, H = len(self.indices), aux.shape[2]
        block = None if aux_scale is None else H // aux_scale.shape[2]
        batches = length_batches([len(s) for s in sequences], self.settings.tokens_per_batch)
        run_dtype = getattr(torch, self.run.dtype)
        shapes = (
            [((K + 1, H), run_dtype)]
            if block is None
            else [((K + 1, H), torch.float8_e4m3fn), ((K + 1, H // block), torch.float32)]
        )
        # at least a full batch's rows at once (no new pinned buffers as shards' batches vary)
        self._host_buffers(
            max(self.settings.tokens_per_batch, *(sum(len(sequences[i]) for i in idx) for idx in batches)), shapes
        )
        # block is set iff aux_scale is, and final_scale comes with it (capture_into: both or neither)
        outs: list[tuple[Any, Any]] = [(_np_bits(aux), _np_bits(final))]
        outs += [] if block is None else [(aux_scale, final_scale)]

        def place(hosts: list[np.ndarray], idx: list[int]) -> None:  # host (n, K+1, ...): the sequences of idx in order
            p = 0
            for i in idx:
                a, b = int(offsets[i]), int(offsets[i + 1])
                for host, (aux_out, final_out) in zip(hosts, outs):
                    aux_out[a:b] = host[p : p + b - a, :K]
                    final_out[a:b] = host[p : p + b - a, K]
                p += b - a

        jobs: list[Future] = []  # this call's places on the helper thread, in order
        try:
            with torch.inference_mode():
                bad = torch.zeros((), dtype=torch.bool, device=self.device)
                for idx in batches:
                    batch = [sequences[i] for i in idx]
                    rows = self._gather(self._checked_forward(batch), batch)  # the hidden states are freed here
                    bad |= ~torch.isfinite(rows).all()
                    tensors = [rows] if block is None else list(quantize_e4m3(rows, block))
                    slot = self._next_slot
                    self._next_slot = 1 - slot
                    placing = self._placing[slot]
                    if placing is not None:
                        placing.exception()  # buffer `slot` is free again (its batch placed, or failed)
                    hosts, event = self._stage(tensors, slot)
                    job = (event, [_host_bits(h) for h in hosts], idx)
                    placing = self._placer.submit(self._place_when_ready, place, *job)
                    self._placing[slot] = placing
                    jobs.append(placing)
                flag, event = self._stage([bad.reshape(1)], None)
        except BaseException:
            wait(jobs)  # nothing writes into the caller's arrays once this raises
            raise

        def finite() -> bool:  # after this call's places (the helper runs its jobs in order)
            if event is not None:
                event.synchronize()
            for job in jobs:
                job.result()  # a place's error
            return not bool(flag[0].item())

        return self._placer.submit(finite)

    def _host_buffers(self, rows: int, shapes: Sequence[tuple[tuple[int, ...], object]]) -> None:
        """CUDA: two sets of pinned buffers, one per (row shape, dtype) of `shapes`, each of at
        least `rows` rows (the device fills one set while the host empties the other), grown on demand."""
        import torch

        if not self.device.startswith("cuda"):
            return
        have = None if self._pinned is None else [(tuple(b.shape[1:]), b.dtype) for b in self._pinned[0]]
        if have != [(tuple(s), d) for s, d in shapes] or self._pinned[0][0].shape[0] < rows:
            self._pinned = [[torch.empty((rows, *s), dtype=d, pin_memory=True) for s, d in shapes] for _ in range(2)]

    def _gather(self, hs, batch: list[np.ndarray]):
        """One forward's capture rows on the device: the real tokens only, sequence after sequence
        (no padding crosses the bus), (n, K+1, H) in the run's dtype (capture points, then final)."""
        import torch

        N, (B, L, H) = self.run.target.num_layers, hs[0].shape
        flat = torch.from_numpy(np.concatenate([b * L + np.arange(len(s)) for b, s in enumerate(batch)]))
        if self.device.startswith("cuda"):
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        return torch.stack([hs[i].reshape(B * L, H).index_select(0, flat) for i in (*self.indices, N)], dim=1).to(
            getattr(torch, self.run.dtype)
        )

    def _stage(self, tensors: list, slot: int | None):
        """CUDA: start copying the device tensors into pinned buffer set `slot` (None: new pinned
        tensors), on the compute stream, after the work queued so far -> (host views, event recorded
        after the copies); a stream of its own for the copies would be slower. CPU: (tensors, None)."""
        import torch

        if not self.device.startswith("cuda"):
            return tensors, None
        if slot is None:
            hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        else:
            hosts = [buf[: t.shape[0]] for buf, t in zip(self._pinned[slot], tensors)]
        for host, t in zip(hosts, tensors):
            host.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return hosts, event

    @staticmethod
    def _place_when_ready(place, event, host, idx: list[int]) -> None:
        if event is not None:
            event.synchronize()
        place(host, idx)

    @_one_at_a_time
    def capture(self, sequences: list[np.ndarray]) -> list[Captured]:
        import torch

        N = self.run.target.num_layers
        results: list[Captured | None] = [None] * len(sequences)
        for idx in length_batches([len(s) for s in sequences], self.settings.tokens_per_batch):
            batch = [sequences[i] for i in idx]
            hs = self._checked_forward(batch)
            aux = torch.stack([hs[i] for i in self.indices], dim=2)  # (B, L, K, H)
            final = hs[N]  # (B, L, H), post-final-norm
            # one device->host copy per batch (not per sequence); rows are sliced on the host
            aux_host = to_numpy(aux, self.run.dtype)
            final_host = to_numpy(final, self.run.dtype) if self.run.target_signal == "final" else None
            for b, i in enumerate(idx):
                T = len(sequences[i])
                cap = Captured(aux=aux_host[b, :T])
                if final_host is not None:
                    cap.final = final_host[b, :T]
                else:
                    with torch.inference_mode():
                        logp = torch.log_softmax(self.model.lm_head(final[b, :T]).float(), dim=-1)
                        top = torch.topk(logp, self.run.topk or 20, dim=-1)
                    cap.topk_ids = top.indices.to(torch.int32).cpu().numpy()
                    cap.topk_logprobs = top.values.cpu().numpy()
                results[i] = cap
        return results  # type: ignore[return-value]

    def close(self) -> None:
        self._launcher.shutdown(wait=True)
        self._placer.shutdown(wait=True)  # the last places end before the buffers go
        self.model = self.base = self._pinned = None  # type: ignore[assignment]
