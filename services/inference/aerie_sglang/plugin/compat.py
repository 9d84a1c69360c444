"""Every SGLang internal the capture plugin depends on, per supported SGLang release, in one place.

The plugin hooks SGLang's private code, which moves between releases. This module names, for each
supported release, every hook point (module path, class, method, the parameters the hook relies
on) and every internal the hooks read (fields of SGLang's request, logits output, config; the
functions they call), and the few behaviours that differ. Nothing else in the plugin spells a
SGLang module path or branches on a version: `hooks.py` asks this module.

How the two supported releases differ (their wheels' source, compared):

| need | 0.5.23 (the images') | 0.5.17 (the H200's: torch 2.11) |
|---|---|---|
| capture-only server | `--enable-return-aux-hidden-states --return-aux-hidden-state-layer-ids` | no such flags: the plugin switches SGLang's EAGLE-3 aux capture on (`resolve_spec_aux_hidden_state_config`) from `AERIE_CAPTURE_LAYER_IDS` and advertises the two fields in `/server_info` |
| final (post-norm) state | `LogitsProcessorOutput.last_hidden_states`, which is the logits processor's input itself: under a prefill CUDA graph a view of the graph's output (below); the plugin replaces it by a copy in `PrefillCudaGraphRunner._trim_logits_output` | not kept: the plugin keeps a copy of the logits processor's input (`LogitsProcessor.forward`; `PrefillCudaGraphRunner._trim_logits_output` rebuilds the output) |
| one descriptor per request | `SchedulerOutputStreamer.is_request_level_customized_info_key` | values are sliced per output token: one token (`max_new_tokens: 1`), one descriptor, no hook |
| only the capture's response carries it | `TokenizerManager.update_request_meta_info` | taken out of the batch in `TokenizerManager._handle_batch_output`, put into the request's own response in `RequestLogger.log_finished_request` |
| `/server_info` | `sglang.srt.utils.common.build_server_info` | `TokenizerManager.resolved_config_dict` |
| abort with a status | `Req.set_finish_with_abort(msg, status_code, err_type)` | `set_finish_with_abort(msg)`, then the status on `req.to_finish` |

The final rows are the plugin's own copy on both releases. On 0.5.23 (by its source):
`LogitsProcessor._get_last_hidden_states_to_store` returns the `hidden_states` it was
given, uncopied; every prefill CUDA-graph backend (breakable, full, tc_piecewise) replays a
captured body whose output lives in the graph's memory pool and `_trim_logits_output` hands back
`last_hidden_states[:raw_num_tokens]`, a view of it; `GenerationBatchResult.copy_to_cpu` copies
`hidden_states` (aux) to the host but not `last_hidden_states`. With overlap scheduling the next
batch's replay is launched before this batch's rows are read, so the view would hold that batch's
rows. The plugin clones it in `_trim_logits_output`, on the forward's stream, right after the
replay; SGLang's own later slicing (`post_forward_mlp_sync_batch`) then applies to the copy. An
eager prefill hands the logits processor a fresh tensor that the output keeps alive.

`release(version)` picks the table for the installed SGLang; any other version refuses in one
line. `tests/inference/test_plugin_compat.py` checks every name below against each release's
source (0.5.17 from its PyPI wheel, statically) and `tests/inference/test_plugin_*.py` run 0.5.23.
This module imports neither torch nor SGLang at import time (the tests read it from any venv).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from aerie_sglang.plugin.errors import PluginRefused

FIELD = "aerie_capture"  # the custom_params key, the meta_info key and the /server_info key
LAYER_IDS_VAR = "AERIE_CAPTURE_LAYER_IDS"  # releases without the capture flags: SGLang layer ids


@dataclass(frozen=True)
class Hook:
    """`HookRegistry.register(target, hooks.<hook>, HookType[kind])`."""

    target: str  # dotted path: module[.Class].function
    kind: str  # BEFORE / AFTER / AROUND
    hook: str  # the hook function's name in aerie_sglang.plugin.hooks
    params: tuple[str, ...]  # parameters of the target that the hook relies on (names, in order)
    is_async: bool = False  # the target is `async def` (an AROUND hook then is one too)


@dataclass(frozen=True)
class Uses:
    """An internal the hooks read or call without hooking it."""

    target: str  # dotted path: module.Class.attribute, module.Class.method or module.function
    kind: str  # "attr": assigned in the class (body or `self.x = ...`); "call": a function/method;
    # "fresh_pinned": a function that copies into new pinned host memory at each call (`torch.empty(...,
    # pin_memory=True)` then `.copy_`): hooks._own keeps views of the rows it returns, uncopied
    params: tuple[str, ...] = ()  # for "call": parameters passed by name


@dataclass(frozen=True)
class Release:
    version: str
    hooks: tuple[Hook, ...]
    uses: tuple[Uses, ...]
    capture_flags: bool  # the server has --enable-return-aux-hidden-states / --return-aux-hidden-state-layer-ids
    keeps_final_state: bool  # SGLang fills LogitsProcessorOutput.last_hidden_states itself
    abort_with_status: bool  # Req.set_finish_with_abort takes status_code and err_type


_SCHED = "sglang.srt.managers.scheduler.Scheduler"
_BRP = "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
_STREAMER = "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer"
_TM = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
_REQ = "sglang.srt.managers.schedule_batch.Req"
_LPO = "sglang.srt.layers.logits_processor.LogitsProcessorOutput"

_ADMIT = Hook(
    f"{_SCHED}._add_request_to_queue", "BEFORE", "before_add_request_to_queue", ("self", "req", "is_retracted")
)
_ROWS = Hook(
    f"{_BRP}._append_prefill_hidden_states",
    "AROUND",
    "around_append_prefill_hidden_states",
    ("self", "req", "logits_output", "hidden_state_offset", "capture_hidden_mode", "extend_input_len", "store"),
)

_TRIM = Hook(
    "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner._trim_logits_output",
    "AROUND",
    "around_trim_logits_output",
    ("self", "output"),
)

_COMMON_USES = (
    Uses("sglang.srt.plugins.hook_registry.HookRegistry.register", "call", ("target", "hook", "hook_type")),
    Uses("sglang.srt.plugins.hook_registry.HookType.BEFORE", "attr"),
    Uses("sglang.srt.plugins.hook_registry.HookType.AFTER", "attr"),
    Uses("sglang.srt.plugins.hook_registry.HookType.AROUND", "attr"),
    Uses("sglang.srt.runtime_context.get_parallel", "call"),
    Uses(f"{_REQ}.rid", "attr"),
    Uses(f"{_REQ}.sampling_params", "attr"),
    Uses(f"{_REQ}.origin_input_ids", "attr"),
    Uses(f"{_REQ}.return_hidden_states", "attr"),
    Uses(f"{_REQ}.to_finish", "attr"),
    Uses(f"{_REQ}.is_retracted", "attr"),
    Uses(f"{_REQ}.customized_info", "attr"),
    Uses(f"{_REQ}.finished", "call"),
    Uses("sglang.srt.sampling.sampling_params.SamplingParams.custom_params", "attr"),
    Uses("sglang.srt.sampling.sampling_params.SamplingParams.max_new_tokens", "attr"),
    Uses("sglang.srt.configs.model_config.ModelConfig.hidden_size", "attr"),
    Uses("sglang.srt.configs.model_config.ModelConfig.dtype", "attr"),
    Uses(f"{_LPO}.hidden_states", "attr"),
    Uses("sglang.srt.model_executor.forward_batch_info.CaptureHiddenMode.is_full", "call"),
)

RELEASES: dict[str, Release] = {
    "0.5.23": Release(
        version="0.5.23",
        hooks=(
            _ADMIT,
            _ROWS,
            _TRIM,
            Hook(
                f"{_STREAMER}.is_request_level_customized_info_key",
                "AROUND",
                "around_is_request_level_customized_info_key",
                ("self", "key"),
            ),
            Hook(
                f"{_TM}.update_request_meta_info",
                "AROUND",
                "around_update_request_meta_info",
                ("self", "meta_info", "state", "customized_info", "index", "finish_reason"),
            ),
            Hook(
                "sglang.srt.utils.common.build_server_info",
                "AFTER",
                "after_build_server_info",
                ("server_args", "scheduler_info"),
            ),
        ),
        uses=(
            *_COMMON_USES,
            Uses("sglang.srt.runtime_context.get_exec", "call"),
            # get_parallel() reads these by name (writes_captures, unsupported_parallelism)
            Uses("sglang.srt.arg_groups.fields.parallel.Parallel.attn_tp_rank", "attr"),
            Uses("sglang.srt.arg_groups.fields.parallel.Parallel.attn_cp_rank", "attr"),
            Uses("sglang.srt.arg_groups.fields.parallel.Parallel.attn_cp_size", "attr"),
            Uses("sglang.srt.arg_groups.fields.parallel.Parallel.pp_size", "attr"),
            Uses("sglang.srt.arg_groups.fields.exec_.ExecFeatures.return_aux_hidden_state_layer_ids", "attr"),
            Uses(f"{_LPO}.last_hidden_states", "attr"),
            Uses("sglang.srt.managers.utils.GenerationBatchResult.copy_to_cpu", "call", ("return_hidden_states",)),
            Uses("sglang.srt.utils.common.async_d2h", "fresh_pinned"),  # copy_to_cpu's `_async_d2h`
            Uses(f"{_REQ}.set_finish_with_abort", "call", ("error_msg", "status_code", "err_type")),
        ),
        capture_flags=True,
        keeps_final_state=True,
        abort_with_status=True,
    ),
    "0.5.17": Release(
        version="0.5.17",
        hooks=(
            _ADMIT,
            _ROWS,
            Hook(
                "sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state.resolve_spec_aux_hidden_state_config",
                "AFTER",
                "after_resolve_spec_aux_hidden_state_config",
                ("server_args", "model_config", "spec_algorithm", "is_draft_worker"),
            ),
            Hook(
                "sglang.srt.layers.logits_processor.LogitsProcessor.forward",
                "AROUND",
                "around_logits_processor_forward",
                ("self", "input_ids", "hidden_states", "lm_head", "logits_metadata", "aux_hidden_states"),
            ),
            _TRIM,
            Hook(
                f"{_TM}._handle_batch_output",
                "AROUND",
                "around_handle_batch_output",
                ("self", "recv_obj"),
                is_async=True,
            ),
            Hook(
                "sglang.srt.utils.request_logger.RequestLogger.log_finished_request",
                "BEFORE",
                "before_log_finished_request",
                ("self", "obj", "out"),
            ),
            Hook(f"{_TM}.resolved_config_dict", "AFTER", "after_resolved_config_dict", ("self", "base")),
        ),
        uses=(
            *_COMMON_USES,
            Uses(
                "sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state.SpecAuxHiddenStateConfig.eagle_use_aux_hidden_state",
                "attr",
            ),
            Uses(
                "sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state.SpecAuxHiddenStateConfig.eagle_aux_hidden_state_layer_ids",
                "attr",
            ),
            Uses("sglang.srt.runtime_context.ParallelContext.attn_tp_rank", "attr"),
            Uses("sglang.srt.runtime_context.ParallelContext.attn_cp_rank", "attr"),
            Uses("sglang.srt.runtime_context.ParallelContext.attn_cp_size", "attr"),
            Uses("sglang.srt.runtime_context.ParallelContext.pp_size", "attr"),
            Uses("sglang.srt.speculative.spec_info.SpeculativeAlgorithm.is_none", "call"),
            Uses("sglang.srt.configs.model_config.ModelConfig.hf_text_config", "attr"),
            Uses("sglang.srt.layers.logits_processor.LogitsMetadata.capture_hidden_mode", "attr"),
            Uses("sglang.srt.model_executor.forward_batch_info.ForwardBatch.capture_hidden_mode", "attr"),
            Uses("sglang.srt.managers.io_struct.wrap_as_pickle", "call", ("obj",)),
            Uses("sglang.srt.managers.io_struct.unwrap_from_pickle", "call", ("obj",)),
            Uses("sglang.srt.managers.io_struct.BatchStrOutput.customized_info", "attr"),
            Uses("sglang.srt.managers.io_struct.BatchTokenIDOutput.customized_info", "attr"),
            Uses("sglang.srt.managers.io_struct.BatchStrOutput.rids", "attr"),
            Uses("sglang.srt.managers.schedule_batch.FINISH_ABORT.status_code", "attr"),
            Uses("sglang.srt.managers.schedule_batch.FINISH_ABORT.err_type", "attr"),
            Uses(f"{_REQ}.set_finish_with_abort", "call", ("error_msg",)),
            Uses("sglang.srt.managers.utils.GenerationBatchResult.copy_to_cpu", "call", ("return_hidden_states",)),
            Uses("sglang.srt.managers.utils._async_d2h", "fresh_pinned"),
        ),
        capture_flags=False,
        keeps_final_state=False,
        abort_with_status=False,
    ),
}

SUPPORTED = tuple(RELEASES)


def release(version: str) -> Release:
    """The hook table for `version`, or PluginRefused (one line) for a release not listed."""
    try:
        return RELEASES[version]
    except KeyError:
        raise PluginRefused(
            f"aerie_capture plugin refused to load: sglang=={version} is not supported (supported: "
            f"{', '.join('sglang==' + v for v in SUPPORTED)}); install one of them, or uninstall aerie-sglang "
            "to run stock SGLang (clients fall back to JSON)"
        ) from None


def configured_layer_ids(rel: Release, env: dict[str, str] | None = None) -> list[int] | None:
    """`AERIE_CAPTURE_LAYER_IDS` (SGLang's layer ids, comma or space separated) on a release
    without the capture flags; on a release with them the variable is refused (the server's
    own flag is the one source of the ids)."""
    raw = (os.environ if env is None else env).get(LAYER_IDS_VAR, "").strip()
    if rel.capture_flags:
        if raw:
            raise PluginRefused(
                f"aerie_capture plugin refused to load: {LAYER_IDS_VAR} is for SGLang releases without capture "
                f"flags; sglang=={rel.version} takes --enable-return-aux-hidden-states "
                f"--return-aux-hidden-state-layer-ids {raw.replace(',', ' ')} instead (unset {LAYER_IDS_VAR})"
            )
        return None
    if not raw:
        return None
    try:
        ids = [int(part) for part in raw.replace(",", " ").split()]
    except ValueError:
        ids = []
    if not ids or any(i < 0 for i in ids):
        raise PluginRefused(
            f"aerie_capture plugin refused to load: {LAYER_IDS_VAR}={raw!r} is not a list of layer ids "
            "(non-negative integers, e.g. 1,14,26)"
        )
    return ids


# --- the behaviours that differ, for hooks.py (run inside SGLang's processes) ------------------
_layer_ids_override: list[int] | None = None  # set by `install` on releases without the flags


def install(rel: Release, layer_ids: list[int] | None) -> None:
    global _layer_ids_override
    _layer_ids_override = layer_ids if not rel.capture_flags else None


def layer_ids(rel: Release) -> list[int] | None:
    """The SGLang layer ids this server captures (None: not a capture server)."""
    if not rel.capture_flags:
        return _layer_ids_override
    from sglang.srt.runtime_context import get_exec

    ids = get_exec().features.return_aux_hidden_state_layer_ids
    return None if ids is None else [int(i) for i in ids]


def capture_server_hint(rel: Release) -> str:
    if rel.capture_flags:
        return "start SGLang with --enable-return-aux-hidden-states --return-aux-hidden-state-layer-ids ..."
    return f"set {LAYER_IDS_VAR}=<SGLang layer ids> in the server's environment (sglang=={rel.version} has no capture flags)"


def abort(rel: Release, req, message: str, status_code: int, err_type: str | None = None) -> None:
    """Finish `req` with an error response of `status_code`."""
    if rel.abort_with_status:
        if err_type is None:
            req.set_finish_with_abort(message, status_code=status_code)
        else:
            req.set_finish_with_abort(message, status_code=status_code, err_type=err_type)
        return
    req.set_finish_with_abort(message)  # FINISH_ABORT(message, 400, "BadRequestError")
    req.to_finish.status_code = int(status_code)
    if err_type is not None:
        req.to_finish.err_type = err_type


def writes_captures() -> bool:
    """Whether this scheduler process writes the captures of the requests it runs: the rank that
    sends its attention group's outputs to the detokenizer, by SGLang's own rule in both releases
    (`Scheduler.init_ipc_channels`: attention-TP rank 0, attention-CP rank 0). TP-only serving has
    one such rank (TP rank 0); with DP attention (`--attn-dp-size N`, or `--dp-size N
    --enable-dp-attention`) every attention-DP group has one, and each group schedules its own
    requests. The other ranks of a group run the same requests and drop their rows."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    return parallel.attn_tp_rank == 0 and parallel.attn_cp_rank == 0


def unsupported_parallelism() -> str | None:
    """Why this server's parallel layout cannot capture (None: it can). Attention context
    parallelism splits a prompt's tokens over ranks, and pipeline parallelism leaves the final
    state on another rank than the first stage: neither is implemented, so captures are refused
    rather than written with rows missing."""
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    if parallel.attn_cp_size > 1:
        return f"attention context parallelism (--attn-cp-size {parallel.attn_cp_size})"
    if parallel.pp_size > 1:
        return f"pipeline parallelism (--pp-size {parallel.pp_size})"
    return None


def final_state(rel: Release, logits_output):
    """The post-final-norm rows of the batch: the plugin's own copy on every release (SGLang's
    `last_hidden_states`, replaced by a copy under a prefill CUDA graph, or the plugin's copy of the
    logits processor's input where SGLang keeps none); never a buffer SGLang reuses."""
    if rel.keeps_final_state:
        return logits_output.last_hidden_states
    return getattr(logits_output, "_aerie_final", None)
