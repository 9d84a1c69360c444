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
- The plugin hooks SGLang internals: `compat.py` lists every hook point per supported release
  (0.5.23, 0.5.17) and the plugin refuses to load on any other; `/server_info` then has no
  `aerie_capture` key and clients use JSON.
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


def __getattr__(name: str):
    """`PluginRefused` lives in plugin/errors.py (every part of the plugin raises it, so it cannot
    live here without an import cycle); it is imported on first use, so this file still runs
    alone, as the deploy checks read `ENV_VARS` from it."""
    if name == "PluginRefused":
        from aerie_sglang.plugin.errors import PluginRefused

        return PluginRefused
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


ENABLE_VAR = "AERIE_SGLANG_BINARY"
# Every variable the plugin reads (sink.py's table); the deploy checks accept these AERIE_* names.
ENV_VARS = (
    ENABLE_VAR,
    "AERIE_CAPTURE_LAYER_IDS",
    "AERIE_CAPTURE_DIR",
    "AERIE_CAPTURE_MAX_UNCLAIMED_BYTES",
    "AERIE_CAPTURE_TTL_S",
    "AERIE_CAPTURE_WRITERS",
    "AERIE_CAPTURE_WRITER",
    "AERIE_CAPTURE_RING_BYTES",
    "AERIE_CAPTURE_S3_PREFIX",
    "AERIE_STORE",
    "AERIE_BUCKET",
    "AERIE_S3_ACCESS_KEY",
    "AERIE_S3_SECRET_KEY",
    "AERIE_S3_REGION",
)


def enabled(env: dict[str, str] | None = None) -> bool:
    """`AERIE_SGLANG_BINARY`: 1/true/yes on, unset/empty/0/false/no off, anything else an error."""
    raw = (os.environ if env is None else env).get(ENABLE_VAR, "").strip().lower()
    if raw in ("1", "true", "yes"):
        return True
    if raw in ("", "0", "false", "no"):
        return False
    from aerie_sglang.plugin.errors import PluginRefused

    raise PluginRefused(
        f"aerie_capture plugin refused to load: {ENABLE_VAR}={raw!r} is not one of 1, 0 (true/false, yes/no)"
    )


def check_sglang(version: str | None = None):
    """The hook table (`compat.Release`) of the installed SGLang, or PluginRefused for another release."""
    from aerie_sglang.plugin.compat import release

    return release(version or importlib.metadata.version("sglang"))


def _check_target(target: str, params: tuple[str, ...]) -> None:
    from aerie_sglang.plugin.errors import PluginRefused

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
            "aerie_capture plugin installed but off: set %s=1 in the server's environment for binary captures",
            ENABLE_VAR,
        )
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from aerie_sglang.plugin import hooks
    from aerie_sglang.plugin.compat import configured_layer_ids
    from aerie_sglang.plugin.sink import CaptureSinkSettings

    rel = check_sglang()
    layer_ids = configured_layer_ids(rel)
    for hook in rel.hooks:
        _check_target(hook.target, hook.params)
    config = CaptureSinkSettings.from_env()
    config.prepare()  # the shm directory: private to this user, or the plugin refuses to load
    hooks.configure(config, rel, importlib.metadata.version("aerie-sglang"), layer_ids)
    for hook in rel.hooks:
        HookRegistry.register(hook.target, getattr(hooks, hook.hook), HookType[hook.kind])
