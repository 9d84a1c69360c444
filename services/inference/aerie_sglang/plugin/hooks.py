"""The five places the plugin hooks SGLang 0.5.23 (through `HookRegistry`), and why each.

| target                                                         | type   | process   | does                                   |
|----------------------------------------------------------------|--------|-----------|----------------------------------------|
| `Scheduler._add_request_to_queue`                              | BEFORE | scheduler | admits a capture request: checks, back-pressure, reservation |
| `SchedulerBatchResultProcessor._append_prefill_hidden_states`  | AROUND | scheduler | takes aux + final rows as tensors instead of `.tolist()` |
| `SchedulerOutputStreamer.is_request_level_customized_info_key` | AROUND | scheduler | sends the descriptor once per request  |
| `TokenizerManager.update_request_meta_info`                    | AROUND | http      | puts the descriptor in `meta_info`, and nothing in other requests' |
| `sglang.srt.utils.common.build_server_info`                    | AFTER  | http      | advertises the plugin in `/server_info` |

A request opts in with `sampling_params.custom_params.aerie_capture = "shm" | "s3"` (SGLang
carries `custom_params` to the scheduler untouched and only custom logit processors read it)
plus `return_hidden_states: true` and `max_new_tokens: 1`. Every hook calls the original
unchanged for any other request, so their responses are stock SGLang's.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from http import HTTPStatus

import torch

from aerie_sglang.plugin.sink import (
    FORMAT_VERSION, SUFFIX, Capture, CaptureConfigError, CaptureSinkSettings, Sinks, SinkFull, planned_size,
)

logger = logging.getLogger("aerie_sglang.capture")

FIELD = "aerie_capture"  # the custom_params key, the meta_info key and the /server_info key
_ATTR = "_aerie_capture"  # per-request state on SGLang's Req

# Set by `install` in every SGLang process that loads the plugin.
_config: CaptureSinkSettings | None = None
_sinks: Sinks | None = None
_sglang_version = ""
_plugin_version = ""


@dataclass
class _RequestCapture:
    sink: str
    reservation: int | None
    writer: bool  # False on tensor-parallel ranks other than 0: they drop their rows
    aux_parts: list[torch.Tensor] = field(default_factory=list)
    final_parts: list[torch.Tensor] = field(default_factory=list)


def configure(config: CaptureSinkSettings, sglang_version: str, plugin_version: str) -> None:
    global _config, _sinks, _sglang_version, _plugin_version
    _config, _sinks = config, Sinks(config)
    _sglang_version, _plugin_version = sglang_version, plugin_version


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
    from sglang.srt.runtime_context import get_exec

    ids = get_exec().features.return_aux_hidden_state_layer_ids
    return None if ids is None else [int(i) for i in ids]


def _refusal(scheduler, req, sink: str) -> tuple[str, int] | None:
    assert _config is not None
    if sink not in _config.sinks:
        return (f"aerie_capture sink {sink!r} is not configured on this server: use one of "
                f"{_config.sinks} (the s3 sink needs AERIE_STORE=http(s)://... and its credentials)",
                HTTPStatus.BAD_REQUEST)
    if req.return_hidden_states is not True:
        return ("aerie_capture needs return_hidden_states: true in the same request (it replaces the "
                "float lists of that field by a binary capture)", HTTPStatus.BAD_REQUEST)
    if req.sampling_params.max_new_tokens != 1:
        return (f"aerie_capture captures the prompt only: set sampling_params.max_new_tokens to 1 "
                f"(got {req.sampling_params.max_new_tokens})", HTTPStatus.BAD_REQUEST)
    if _layer_ids() is None:
        return ("aerie_capture needs a capture server: start SGLang with --enable-return-aux-hidden-states "
                "--return-aux-hidden-state-layer-ids ...", HTTPStatus.BAD_REQUEST)
    if not getattr(scheduler.server_args, "disable_radix_cache", False):
        return ("aerie_capture needs --disable-radix-cache: with the prefix cache on, SGLang computes "
                "hidden states only for a prompt's uncached tokens", HTTPStatus.BAD_REQUEST)
    return None


def _planned_bytes(scheduler, num_tokens: int) -> int:
    hidden = int(scheduler.model_config.hidden_size)
    dtype = scheduler.model_config.dtype
    ids = _layer_ids() or []
    aux = torch.empty((num_tokens, len(ids), hidden), dtype=dtype, device="meta")
    final = torch.empty((num_tokens, hidden), dtype=dtype, device="meta")
    return planned_size({"aux": aux, "final": final}, _metadata_template(ids))


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
    refusal = _refusal(scheduler, req, sink)
    if refusal is not None:
        req.set_finish_with_abort(refusal[0], status_code=refusal[1])
        return None
    from sglang.srt.runtime_context import get_parallel

    writer = get_parallel().tp_rank == 0
    reservation = None
    if writer:
        assert _sinks is not None
        try:
            _sinks.start()
        except CaptureConfigError as e:  # the directory changed since the plugin loaded: no capture into it
            req.set_finish_with_abort(f"aerie capture refused: {e}", status_code=HTTPStatus.INTERNAL_SERVER_ERROR)
            return None
        try:
            reservation = _sinks.admit(req, _planned_bytes(scheduler, len(req.origin_input_ids)))
        except SinkFull as e:
            req.set_finish_with_abort(str(e), status_code=HTTPStatus.SERVICE_UNAVAILABLE, err_type="AerieCaptureSinkFull")
            return None
    setattr(req, _ATTR, _RequestCapture(sink=sink, reservation=reservation, writer=writer))
    return None


# --- scheduler: rows -> sink ------------------------------------------------------------------
def around_append_prefill_hidden_states(original, processor, *, req, logits_output, hidden_state_offset,
                                        capture_hidden_mode, extend_input_len, store=True):
    state: _RequestCapture | None = getattr(req, _ATTR, None)
    if state is None:
        return original(processor, req=req, logits_output=logits_output, hidden_state_offset=hidden_state_offset,
                        capture_hidden_mode=capture_hidden_mode, extend_input_len=extend_input_len, store=store)
    if not capture_hidden_mode.is_full():  # admission guarantees full capture; keep offsets right anyway
        return hidden_state_offset + 1
    start, end = hidden_state_offset, hidden_state_offset + extend_input_len
    if state.writer and not req.finished() and not req.is_retracted:
        if logits_output.last_hidden_states is None:
            _answer(req, {"error": "this SGLang build did not keep the final hidden state "
                                   "(LogitsProcessorOutput.last_hidden_states): capture unsupported"})
            return end
        # A clone per chunk: graph runners may reuse their output buffers in the next forward.
        state.aux_parts.append(logits_output.hidden_states[start:end].clone())
        state.final_parts.append(logits_output.last_hidden_states[start:end].clone())
        if store:  # the chunk that completes the prompt
            _finish(req, state)
    return end


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
    ready = None
    if aux.is_cuda or final.is_cuda:
        aux, final = (_to_pinned(t) if t.is_cuda else t for t in (aux, final))
        ready = torch.cuda.Event()
        ready.record()
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
        "tensors": {name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                    for name, t in tensors.items()},
    }
    if state.sink == "shm":
        descriptor["path"] = str(_config.shm_dir / f"{capture_id}{SUFFIX}")
    else:
        assert _config.s3 is not None
        descriptor.update(endpoint=_config.s3.endpoint, bucket=_config.s3.bucket,
                          key=f"{_config.s3.prefix}{capture_id}{SUFFIX}")
    _sinks.submit(Capture(capture_id, state.sink, tensors, metadata, nbytes, ready), state.reservation)
    state.reservation = None
    _answer(req, descriptor)


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
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
