"""The places the plugin hooks SGLang (through `HookRegistry`), and why each.

Which targets a release needs, and every SGLang name the hooks read, is `compat.py`'s table; the
hooks below branch on nothing else. On 0.5.23 (the images'):

| target                                                         | type   | process   | does                                   |
|----------------------------------------------------------------|--------|-----------|----------------------------------------|
| `Scheduler._add_request_to_queue`                              | BEFORE | scheduler | admits a capture request: checks, back-pressure, reservation |
| `SchedulerBatchResultProcessor._append_prefill_hidden_states`  | AROUND | scheduler | takes aux + final rows as tensors instead of `.tolist()` |
| `PrefillCudaGraphRunner._trim_logits_output`                   | AROUND | scheduler | replaces `last_hidden_states`, a view of the graph's output buffer, by a copy |
| `SchedulerOutputStreamer.is_request_level_customized_info_key` | AROUND | scheduler | sends the descriptor once per request  |
| `TokenizerManager.update_request_meta_info`                    | AROUND | http      | puts the descriptor in `meta_info`, and nothing in other requests' |
| `sglang.srt.utils.common.build_server_info`                    | AFTER  | http      | advertises the plugin in `/server_info` |

On 0.5.17 (the H200's) the first three, and instead of the last three:

| target                                                         | type   | process   | does                                   |
|----------------------------------------------------------------|--------|-----------|----------------------------------------|
| `spec_aux_hidden_state.resolve_spec_aux_hidden_state_config`   | AFTER  | scheduler | switches EAGLE-3 aux capture on for `AERIE_CAPTURE_LAYER_IDS` (no capture flags in 0.5.17) |
| `LogitsProcessor.forward`                                      | AROUND | scheduler | keeps a copy of the final (post-norm) rows, which 0.5.17 drops |
| `TokenizerManager._handle_batch_output`                        | AROUND | http      | takes the descriptors out of the batch's `customized_info` (other requests see none) |
| `RequestLogger.log_finished_request`                           | BEFORE | http      | puts the descriptor into its own request's `meta_info` |
| `TokenizerManager.resolved_config_dict`                        | AFTER  | http      | advertises the plugin and the capture layer ids in `/server_info` |

A request opts in with `sampling_params.custom_params.aerie_capture = "shm" | "s3"` (SGLang
carries `custom_params` to the scheduler untouched and only custom logit processors read it)
plus `return_hidden_states: true` and `max_new_tokens: 1`. Every hook calls the original
unchanged for any other request, so their responses are stock SGLang's.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus

import torch

import aerie_sglang.plugin.compat as compat
from aerie_sglang.plugin.compat import FIELD, LAYER_IDS_VAR
from aerie_sglang.plugin.sink import (
    FORMAT_VERSION,
    SUFFIX,
    Capture,
    CaptureConfigError,
    CaptureSinkSettings,
    SinkFull,
    Sinks,
    planned_size,
)

logger = logging.getLogger("aerie_sglang.capture")

_ATTR = "_aerie_capture"  # per-request state on SGLang's Req

# Set by `install` in every SGLang process that loads the plugin.
_config: CaptureSinkSettings | None = None
_sinks: Sinks | None = None
_rel: compat.Release | None = None
_sglang_version = ""
_plugin_version = ""


@dataclass
class _RequestCapture:
    sink: str
    reservation: int | None
    writer: bool  # compat.writes_captures(): False on the ranks of an attention group that drop their rows
    aux_parts: list[torch.Tensor] = field(default_factory=list)
    final_parts: list[torch.Tensor] = field(default_factory=list)
    ready: object | None = None  # the event of the batch's host copy that final_parts are views of


def configure(
    config: CaptureSinkSettings, rel: compat.Release, plugin_version: str, layer_ids: list[int] | None = None
) -> None:
    global _config, _sinks, _rel, _sglang_version, _plugin_version
    _config, _sinks, _rel = config, Sinks(config), rel
    _planned.clear()
    _sglang_version, _plugin_version = rel.version, plugin_version
    compat.install(rel, layer_ids)


def advertised() -> dict:
    assert _config is not None
    return {
        "plugin": "aerie_capture",
        "version": _plugin_version,
        "sglang": _sglang_version,
        "format": f"safetensors/aerie-capture-v{FORMAT_VERSION}",
        "request": {
            "sampling_params.custom_params": {FIELD: "<sink>"},
            "return_hidden_states": True,
            "max_new_tokens": 1,
        },
        **_config.advertised(),
    }


def requested_sink(req) -> str | None:
    params = getattr(req.sampling_params, "custom_params", None)
    if not isinstance(params, dict):
        return None
    sink = params.get(FIELD)
    return None if sink is None else str(sink)


# --- scheduler: admission ---------------------------------------------------------------------
def _layer_ids() -> list[int] | None:
    assert _rel is not None
    return compat.layer_ids(_rel)


def _refusal(scheduler, req, sink: str) -> tuple[str, int] | None:
    assert _config is not None
    if sink not in _config.sinks:
        return (
            f"aerie_capture sink {sink!r} is not configured on this server: use one of "
            f"{_config.sinks} (the s3 sink needs AERIE_STORE=http(s)://... and its credentials)",
            HTTPStatus.BAD_REQUEST,
        )
    if req.return_hidden_states is not True:
        return (
            "aerie_capture needs return_hidden_states: true in the same request (it replaces the "
            "float lists of that field by a binary capture)",
            HTTPStatus.BAD_REQUEST,
        )
    if req.sampling_params.max_new_tokens != 1:
        return (
            f"aerie_capture captures the prompt only: set sampling_params.max_new_tokens to 1 "
            f"(got {req.sampling_params.max_new_tokens})",
            HTTPStatus.BAD_REQUEST,
        )
    if _layer_ids() is None:
        assert _rel is not None
        return (f"aerie_capture needs a capture server: {compat.capture_server_hint(_rel)}", HTTPStatus.BAD_REQUEST)
    unsupported = compat.unsupported_parallelism()
    if unsupported is not None:
        return (
            f"aerie_capture does not support {unsupported}: serve the capture server with tensor "
            "parallelism and/or DP attention only",
            HTTPStatus.BAD_REQUEST,
        )
    if not getattr(scheduler.server_args, "disable_radix_cache", False):
        return (
            "aerie_capture needs --disable-radix-cache: with the prefix cache on, SGLang computes "
            "hidden states only for a prompt's uncached tokens",
            HTTPStatus.BAD_REQUEST,
        )
    return None


_planned: dict[int, int] = {}  # prompt tokens -> planned capture bytes (one model per process)


def _planned_bytes(scheduler, num_tokens: int) -> int:
    """What admission reserves for a capture before its rows exist (the header planned with an
    empty rid), remembered per prompt length: the scheduler thread builds it once per length."""
    nbytes = _planned.get(num_tokens)
    if nbytes is None:
        hidden = int(scheduler.model_config.hidden_size)
        dtype = scheduler.model_config.dtype
        ids = _layer_ids() or []
        aux = torch.empty((num_tokens, len(ids), hidden), dtype=dtype, device="meta")
        final = torch.empty((num_tokens, hidden), dtype=dtype, device="meta")
        nbytes = planned_size({"aux": aux, "final": final}, _metadata_template(ids))
        if len(_planned) >= 8192:
            _planned.clear()
        _planned[num_tokens] = nbytes
    return nbytes


def _metadata_template(layer_ids: list[int], capture_id: str = "0" * 32, rid: str = "") -> dict[str, str]:
    return {
        "aerie_capture_id": capture_id,
        "format": f"aerie-capture-v{FORMAT_VERSION}",
        "layer_ids": ",".join(map(str, layer_ids)),
        "sglang": _sglang_version,
        "rid": rid,
        "sha256": "0" * 64,  # replaced by the writer (same length)
    }


def before_add_request_to_queue(scheduler, req, *args, **kwargs):
    """BEFORE `Scheduler._add_request_to_queue(req, is_retracted=False)`."""
    sink = requested_sink(req)
    if sink is None or req.to_finish is not None:
        return None
    is_retracted = kwargs.get("is_retracted", args[0] if args else False)
    state = getattr(req, _ATTR, None)
    if state is not None:
        if is_retracted:  # prefill runs again from the start
            state.aux_parts.clear()
            state.final_parts.clear()
        return None
    started, cpu = time.perf_counter(), time.thread_time()
    try:
        _admit(scheduler, req, sink)
    finally:
        assert _sinks is not None
        _sinks.stats.admission_s += time.perf_counter() - started  # the scheduler thread's alone
        _sinks.stats.admission_cpu_s += time.thread_time() - cpu
    return None


def _admit(scheduler, req, sink: str) -> None:
    assert _rel is not None
    refusal = _refusal(scheduler, req, sink)
    if refusal is not None:
        compat.abort(_rel, req, refusal[0], refusal[1])
        return
    writer = compat.writes_captures()
    reservation = None
    if writer:
        assert _sinks is not None
        try:
            _sinks.start()
        except CaptureConfigError as e:  # the directory changed since the plugin loaded: no capture into it
            compat.abort(_rel, req, f"aerie capture refused: {e}", HTTPStatus.INTERNAL_SERVER_ERROR)
            return
        try:
            reservation = _sinks.admit(req, _planned_bytes(scheduler, len(req.origin_input_ids)))
        except SinkFull as e:
            compat.abort(_rel, req, str(e), HTTPStatus.SERVICE_UNAVAILABLE, "AerieCaptureSinkFull")
            return
    setattr(req, _ATTR, _RequestCapture(sink=sink, reservation=reservation, writer=writer))


# --- scheduler: rows -> sink ------------------------------------------------------------------
def around_append_prefill_hidden_states(
    original, processor, *, req, logits_output, hidden_state_offset, capture_hidden_mode, extend_input_len, store=True
):
    state: _RequestCapture | None = getattr(req, _ATTR, None)
    if state is None:
        return original(
            processor,
            req=req,
            logits_output=logits_output,
            hidden_state_offset=hidden_state_offset,
            capture_hidden_mode=capture_hidden_mode,
            extend_input_len=extend_input_len,
            store=store,
        )
    if not capture_hidden_mode.is_full():  # admission guarantees full capture; keep offsets right anyway
        return hidden_state_offset + 1
    start, end = hidden_state_offset, hidden_state_offset + extend_input_len
    if state.writer and not req.finished() and not req.is_retracted:
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            _take_rows(req, state, logits_output, start, end, store)
        finally:
            assert _sinks is not None
            _sinks.stats.rows_s += time.perf_counter() - started
            _sinks.stats.rows_cpu_s += time.thread_time() - cpu
    return end


def _take_rows(req, state: _RequestCapture, logits_output, start: int, end: int, store: bool) -> None:
    assert _rel is not None
    final = compat.final_state(_rel, logits_output)
    if final is None:
        _answer(
            req,
            {
                "error": f"this SGLang build (sglang=={_sglang_version}) did not keep the final hidden "
                "state of this forward: capture unsupported"
            },
        )
        return
    final_rows = None
    if store and not state.final_parts and final.is_cuda:  # the whole prompt in this batch
        host, state.ready = _batch_on_host(logits_output, final)
        final_rows = host[start:end]
    started = time.perf_counter()
    state.aux_parts.append(_own(logits_output.hidden_states[start:end], _host_rows(logits_output)))
    state.final_parts.append(final_rows if final_rows is not None else _own(final[start:end]))
    assert _sinks is not None
    _sinks.stats.rows_take_s += time.perf_counter() - started
    if store:  # the chunk that completes the prompt
        _finish(req, state)


_HOST = "_aerie_final_host"  # on a batch's logits output: (its final rows, their host copy, the copy's event)


def _batch_on_host(logits_output, final: torch.Tensor) -> tuple[torch.Tensor, object]:
    """A batch's final device rows in new pinned host memory, and the event that marks the copy
    done: one copy per batch, launched by its first capture request that lies wholly in it, on the
    stream where `_own` clones device rows (so it reads them no later than a clone would). Each of
    the batch's captures keeps a view; the writers wait on the event. Done per request instead
    (a clone, a pinned allocation, a copy, an event), keeping and sending the rows to the host
    would take the scheduler thread's time for every capture (BENCHMARKS.md). A prompt split over several batches keeps its clones (`_finish` joins them on the device)."""
    cached = getattr(logits_output, _HOST, None)
    if cached is None or cached[0] is not final:
        started = time.perf_counter()
        ready = torch.cuda.Event()
        host = _to_pinned(final)
        ready.record()
        cached = (final, host, ready)
        setattr(logits_output, _HOST, cached)
        assert _sinks is not None
        _sinks.stats.rows_host_s += time.perf_counter() - started
    return cached[1], cached[2]


_AUX_PINNED = "_aerie_aux_pinned"  # on a batch's logits output: whether its aux rows are SGLang's pinned host copy


def _host_rows(logits_output) -> bool:
    """Whether the batch's aux rows are pinned host memory, asked once per batch (each torch call
    lets the writer threads take the GIL from the scheduler thread)."""
    pinned = getattr(logits_output, _AUX_PINNED, None)
    if pinned is None:
        aux = logits_output.hidden_states
        pinned = bool(not aux.is_cuda and aux.is_pinned())
        setattr(logits_output, _AUX_PINNED, pinned)
    return pinned


def _own(rows: torch.Tensor, pinned: bool | None = None) -> torch.Tensor:
    """Rows the capture may hold until a writer has written them. Pinned host rows are SGLang's
    copy of this batch's states (overlap scheduling: new pinned memory per batch, the release's
    `fresh_pinned` function in compat, checked in its source): a view of them is kept, with no copy
    in the scheduler thread. Anything else is cloned: a device tensor may be a CUDA graph's output
    buffer, which the next forward overwrites, and a CPU forward's rows are the model's own. (Final
    device rows of a prompt that lies wholly in one batch skip this: `_batch_on_host`.)"""
    if pinned is None:
        pinned = not rows.is_cuda and rows.is_pinned()
    return rows if pinned else rows.clone()


def _finish(req, state: _RequestCapture) -> None:
    assert _sinks is not None and _config is not None
    final = torch.cat(state.final_parts) if len(state.final_parts) > 1 else state.final_parts[0]
    aux = torch.cat(state.aux_parts) if len(state.aux_parts) > 1 else state.aux_parts[0]
    state.aux_parts, state.final_parts = [], []
    rows, hidden = final.shape
    aux = aux.reshape(rows, -1, hidden)  # [T, K*H] -> [T, K, H]
    # With overlap scheduling SGLang has already copied `hidden_states` (aux) to the host, but
    # not `last_hidden_states`: each device tensor goes to pinned memory without waiting here;
    # the writer thread waits on the event.
    ready, state.ready = state.ready, None  # final rows that are views of their batch's host copy
    if aux.is_cuda or final.is_cuda:
        started = time.perf_counter()
        aux, final = (_to_pinned(t) if t.is_cuda else t for t in (aux, final))
        ready = torch.cuda.Event()  # recorded after the batch copy, on the same stream: covers it too
        ready.record()
        _sinks.stats.rows_host_s += time.perf_counter() - started
    capture_id = uuid.uuid4().hex
    layer_ids = _layer_ids() or []
    tensors = {"aux": aux, "final": final}
    metadata = _metadata_template(layer_ids, capture_id, str(req.rid))
    nbytes = planned_size(tensors, metadata)
    descriptor = {
        "v": FORMAT_VERSION,
        "id": capture_id,
        "sink": state.sink,
        "format": "safetensors",
        "nbytes": nbytes,
        "rows": rows,
        "layer_ids": layer_ids,
        "tensors": {
            name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)} for name, t in tensors.items()
        },
    }
    if state.sink == "shm":
        descriptor["path"] = str(_config.shm_dir / f"{capture_id}{SUFFIX}")
    else:
        assert _config.s3 is not None
        descriptor.update(
            endpoint=_config.s3.endpoint, bucket=_config.s3.bucket, key=f"{_config.s3.prefix}{capture_id}{SUFFIX}"
        )
    _sinks.submit(Capture(capture_id, state.sink, tensors, metadata, nbytes, ready), state.reservation)
    state.reservation = None
    _answer(req, descriptor)


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    """A device tensor's copy in new pinned host memory, launched on the current stream. The tensor
    was made on the forward's stream: `record_stream` keeps the caching allocator from handing its
    memory to a later forward before this copy has read it (what SGLang's `async_d2h` does)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    t.record_stream(torch.cuda.current_stream())
    return host


def _answer(req, descriptor: dict) -> None:
    if req.customized_info is None:
        req.customized_info = {}
    req.customized_info[FIELD] = [descriptor]


def around_is_request_level_customized_info_key(original, streamer, key):
    return key == FIELD or original(streamer, key)


# --- http process -----------------------------------------------------------------------------
def around_update_request_meta_info(original, manager, meta_info, state, customized_info, index, finish_reason):
    """Stock SGLang gives every request of an output batch an entry for every customized_info key;
    requests that did not ask for a capture must not see ours."""
    if FIELD in customized_info:
        mine = customized_info[FIELD][index]
        customized_info = {k: v for k, v in customized_info.items() if k != FIELD}
        if customized_info:
            original(manager, meta_info, state, customized_info, index, finish_reason)
        if mine:
            meta_info[FIELD] = mine[0]
        return None
    return original(manager, meta_info, state, customized_info, index, finish_reason)


def after_build_server_info(result, *args, **kwargs):
    result[FIELD] = advertised()
    return result


# --- releases without capture flags or a kept final state (0.5.17) -----------------------------
def after_resolve_spec_aux_hidden_state_config(
    config, *args, model_config=None, spec_algorithm=None, is_draft_worker=False, **kwargs
):
    """SGLang's own EAGLE-3 aux capture, on the target and without a draft, for the configured ids
    (what 0.5.23's --enable-return-aux-hidden-states does in `_resolve_capture_only_aux_hidden_state`)."""
    ids = _layer_ids()
    if ids is None or is_draft_worker or spec_algorithm is None or not spec_algorithm.is_none():
        return config
    layers = int(getattr(model_config.hf_text_config, "num_hidden_layers", 0) or 0)
    beyond = [i for i in ids if i >= layers]
    if beyond:
        raise ValueError(f"{LAYER_IDS_VAR}: layer ids {beyond} are out of range for a target with {layers} layers")
    config.eagle_use_aux_hidden_state = True
    config.eagle_aux_hidden_state_layer_ids = list(ids)
    return config


_FINAL = "_aerie_final"  # compat.final_state reads it


def around_logits_processor_forward(original, processor, *args, **kwargs):
    """Keeps the logits processor's input (the post-final-norm rows of every prompt token) on its
    output when aux states are captured for the whole prompt."""
    out = original(processor, *args, **kwargs)
    if out is None or _layer_ids() is None:
        return out
    # (input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states): compat checks the order.
    hidden = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
    metadata = kwargs.get("logits_metadata", args[3] if len(args) > 3 else None)
    aux = kwargs.get("aux_hidden_states", args[4] if len(args) > 4 else None)
    mode = getattr(metadata, "capture_hidden_mode", None)
    if hidden is not None and aux is not None and mode is not None and mode.is_full():
        # A copy, made here on the forward's stream: under a prefill CUDA graph (0.5.17's default)
        # `hidden` is the graph's static output, which the next batch's replay overwrites, and with
        # overlap scheduling that replay is launched before this batch's rows are read.
        setattr(out, _FINAL, hidden.clone())
    return out


def around_trim_logits_output(original, runner, output, *args, **kwargs):
    """The prefill CUDA-graph runner rebuilds the output trimmed to the real tokens, right after the
    replay and on the forward's stream. Where SGLang keeps the final rows (0.5.23) they are a view
    of the graph's output buffer, which the next replay overwrites (with overlap scheduling, before
    this batch's rows are read): they are replaced here by a copy. Where the plugin keeps them
    (0.5.17) its copy is carried over, trimmed alike."""
    trimmed = original(runner, output, *args, **kwargs)
    if trimmed is None:
        return trimmed
    kept = getattr(trimmed, "last_hidden_states", None)
    if kept is not None:
        trimmed.last_hidden_states = kept.clone()
    final = getattr(output, _FINAL, None)
    if final is not None:
        rows = trimmed.hidden_states.shape[0] if trimmed.hidden_states is not None else final.shape[0]
        setattr(trimmed, _FINAL, final[:rows])
    return trimmed


# rid -> (time, descriptor): taken out of a batch's output, waiting for its request's response.
_pending: dict[str, tuple[float, dict]] = {}


async def around_handle_batch_output(original, manager, recv_obj):
    """0.5.17 gives every request of an output batch every customized_info key (a list per token):
    the descriptors leave the batch here, and each goes to its own request in
    `before_log_finished_request`, so other requests' responses are stock."""
    wrapped = getattr(recv_obj, "customized_info", None)
    if wrapped is not None:
        from sglang.srt.managers.io_struct import unwrap_from_pickle, wrap_as_pickle

        info = unwrap_from_pickle(wrapped)
        if isinstance(info, dict) and FIELD in info:
            now = time.monotonic()
            for rid, values in zip(recv_obj.rids, info.pop(FIELD)):
                mine = next((v for v in values or () if v is not None), None)
                if mine is not None:
                    _pending[rid] = (now, mine)
            ttl = _config.ttl_s if _config is not None else 900
            for rid in [r for r, (t, _) in _pending.items() if now - t > ttl]:  # responses never sent
                del _pending[rid]
            recv_obj.customized_info = wrap_as_pickle(info) if info else None
    return await original(manager, recv_obj)


def before_log_finished_request(request_logger, obj, out, *args, **kwargs):
    """Called with every finished request's response just before it is returned."""
    if not _pending:
        return None
    rid = getattr(obj, "rid", None)
    if isinstance(rid, str) and rid in _pending and isinstance(out, dict) and isinstance(out.get("meta_info"), dict):
        out["meta_info"][FIELD] = _pending.pop(rid)[1]
    return None


def after_resolved_config_dict(result, *args, **kwargs):
    """`/server_info` on 0.5.17: the plugin, and the capture mode it switched on (the fields 0.5.23's
    flags add, which the extractor checks)."""
    result[FIELD] = advertised()
    ids = _layer_ids()
    if ids is not None:
        result["enable_return_aux_hidden_states"] = True
        result["return_aux_hidden_state_layer_ids"] = ids
    return result
