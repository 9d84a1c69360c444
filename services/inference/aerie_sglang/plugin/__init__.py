"""aerie's SGLang plugin: captured hidden states as safetensors bytes, not JSON floats.

Stock SGLang returns `return_hidden_states` as `.tolist()` floats (~15 KB per token at H = 576,
~340 KB at Kimi-K2.5's size). With this plugin a request that asks for it gets, in
`meta_info.aerie_capture`, a small descriptor of a safetensors object written to a sink:

    {"v": 1, "id": "<uuid hex>", "sink": "shm", "path": "/dev/shm/aerie-capture/<id>.safetensors",
     "format": "safetensors", "nbytes": N, "rows": T, "layer_ids": [1, 14, 26],
     "tensors": {"aux": {"dtype": "float32", "shape": [T, K, H]},
                 "final": {"dtype": "float32", "shape": [T, H]}}}
    # s3 sink: "endpoint", "bucket", "key" instead of "path"

- `aux[t, j]` is the hidden state SGLang captures for `layer_ids[j]` after prompt token t (the
  tensors of stock `meta_info.hidden_states`, reshaped); `final[t]` is the post-final-norm state
  the lm_head sees. Layer ids are SGLang's own: `aerie.capture` maps them to capture points.
- The object appears atomically (possibly a moment after the response: it is written by a
  background thread). Its header metadata holds `aerie_capture_id` and `sha256` (of the tensor
  bytes); the client checks both, then deletes the object.
- Opt in per request: `sampling_params.custom_params.aerie_capture = "shm" | "s3"`, with
  `return_hidden_states: true` and `max_new_tokens: 1`. Other requests are stock SGLang's.
- The plugin hooks SGLang internals, so it pins the version it was checked against and refuses
  to load on any other; `/server_info` then has no `aerie_capture` key and clients use JSON.
- Installed is not enabled: it hooks SGLang only where `AERIE_SGLANG_BINARY=1` (the compose
  `capture` profile, the k8s capture Deployment). Elsewhere (serve mode) SGLang runs unhooked.

Registered in `pyproject.toml` under the `sglang.srt.plugins` entry-point group; SGLang loads it
in every process (main/http, scheduler, detokenizer). `SGLANG_PLUGINS` may restrict plugins.
Sink configuration: see `aerie_sglang.plugin.sink`.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import os
import pkgutil

SGLANG_VERSION = "0.5.23"

# target -> (hook type, hook function name in .hooks, parameters the hook relies on)
HOOKS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue": (
        "BEFORE", "before_add_request_to_queue", ("self", "req", "is_retracted")),
    "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor._append_prefill_hidden_states": (
        "AROUND", "around_append_prefill_hidden_states",
        ("self", "req", "logits_output", "hidden_state_offset", "capture_hidden_mode", "extend_input_len", "store")),
    "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer.is_request_level_customized_info_key": (
        "AROUND", "around_is_request_level_customized_info_key", ("self", "key")),
    "sglang.srt.managers.tokenizer_manager.TokenizerManager.update_request_meta_info": (
        "AROUND", "around_update_request_meta_info",
        ("self", "meta_info", "state", "customized_info", "index", "finish_reason")),
    "sglang.srt.utils.common.build_server_info": (
        "AFTER", "after_build_server_info", ("server_args", "scheduler_info")),
}


ENABLE_VAR = "AERIE_SGLANG_BINARY"
# Every variable the plugin reads (sink.py's table); the deploy checks accept these AERIE_* names.
ENV_VARS = (ENABLE_VAR, "AERIE_CAPTURE_DIR", "AERIE_CAPTURE_MAX_UNCLAIMED_BYTES", "AERIE_CAPTURE_TTL_S", "AERIE_CAPTURE_WRITERS",
            "AERIE_CAPTURE_S3_PREFIX", "AERIE_STORE", "AERIE_BUCKET", "AERIE_S3_ACCESS_KEY", "AERIE_S3_SECRET_KEY", "AERIE_S3_REGION")


class PluginRefused(RuntimeError):
    """The plugin does not apply to this SGLang; nothing was hooked."""


def enabled(env: dict[str, str] | None = None) -> bool:
    """`AERIE_SGLANG_BINARY`: 1/true/yes on, unset/empty/0/false/no off, anything else an error."""
    raw = (os.environ if env is None else env).get(ENABLE_VAR, "").strip().lower()
    if raw in ("1", "true", "yes"):
        return True
    if raw in ("", "0", "false", "no"):
        return False
    raise PluginRefused(f"aerie_capture plugin refused to load: {ENABLE_VAR}={raw!r} is not one of 1, 0 (true/false, yes/no)")


def check_sglang(version: str | None = None) -> str:
    """The installed SGLang version, or PluginRefused when it is not the pinned one."""
    version = version or importlib.metadata.version("sglang")
    if version != SGLANG_VERSION:
        raise PluginRefused(
            f"aerie_capture plugin refused to load: it hooks sglang=={SGLANG_VERSION} internals and this "
            f"is sglang=={version}. Install sglang=={SGLANG_VERSION} (scripts/sglang_env.sh, the "
            "inference image), or uninstall aerie-sglang to run stock SGLang; clients fall back to JSON."
        )
    return version


def _check_target(target: str, params: tuple[str, ...]) -> None:
    owner, _, name = target.rpartition(".")
    try:
        fn = getattr(pkgutil.resolve_name(owner), name)
    except (ImportError, AttributeError) as e:
        raise PluginRefused(f"aerie_capture plugin refused to load: hook target {target} is missing ({e})") from None
    have = list(inspect.signature(inspect.unwrap(fn)).parameters)
    missing = [p for p in params if p not in have]
    if missing:
        raise PluginRefused(
            f"aerie_capture plugin refused to load: {target} has parameters {have}, the hook needs {missing}"
        )


def register() -> None:
    """The `sglang.srt.plugins` entry point: check everything first, then hook, all or nothing."""
    if not enabled():
        logging.getLogger("aerie_sglang.capture").info(
            "aerie_capture plugin installed but off: set %s=1 in the server's environment for binary captures", ENABLE_VAR
        )
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from aerie_sglang.plugin import hooks
    from aerie_sglang.plugin.sink import CaptureSinkSettings

    version = check_sglang()
    for target, (_, _, params) in HOOKS.items():
        _check_target(target, params)
    config = CaptureSinkSettings.from_env()
    config.prepare()  # the shm directory: private to this user, or the plugin refuses to load
    hooks.configure(config, version, importlib.metadata.version("aerie-sglang"))
    for target, (kind, fn_name, _) in HOOKS.items():
        HookRegistry.register(target, getattr(hooks, fn_name), HookType[kind])
