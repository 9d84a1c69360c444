"""The `sglang` engine: hidden states from an SGLang server in capture mode, over HTTP.

The server (one container, or `python -m aerie_sglang.cpu.launch` on a CPU) runs with
`--enable-return-aux-hidden-states --speculative-algorithm EAGLE3
--return-aux-hidden-state-layer-ids <ids> --disable-radix-cache`, the ids being the run's
capture points translated by `aerie.capture` (never here). Design choices:

- One request per sequence: `input_ids`, `max_new_tokens: 1`, temperature 0,
  `return_hidden_states` -> `meta_info.hidden_states[0]` is `[T][K*H]` (layers concatenated
  in id order); `return_logprob`, `logprob_start_len: 0`, `top_logprobs_num: k` -> top-k
  log-probs. No torch: floats arrive as JSON and are parsed with orjson. JSON carries float32
  exactly (SGLang's `.tolist()` gives the float32 value as a double, its shortest repr parses
  back to the same double), so the only rounding is the conversion to the run's dtype.
- Target signal alignment. SGLang's `input_top_logprobs[i]` is the distribution that *predicts
  token i* (computed from the state after token i-1), so entry 0 is `None`. Our row t is the
  distribution over token t+1 (aerie.shard), so row t = `input_top_logprobs[t+1]` for
  t < T-1, and the last row (after the last prompt token) = `output_top_logprobs[0]`, the
  distribution the one generated token is drawn from. Greedy sampling does not reshape it:
  the tests compare every row with transformers' log-softmax.
- Two transports. `json`: stock SGLang, floats as text; it returns no final (post-norm) state,
  so a run over JSON must ask for `target_signal: topk`. `binary`: aerie's SGLang plugin
  (`aerie_sglang.plugin`, enabled with `AERIE_SGLANG_BINARY=1` on the server) writes aux and the
  final state as one safetensors object per request to a sink and answers with a descriptor;
  this engine reads, checks and deletes it (`sglang_binary.fetch_binary`, off the event loop).
  Then the run's target signal is the final state (top-k, if a run asks for it, still comes as
  JSON log-probs in the same response). A binary run with signal "final" is extracted with
  `capture_into`: each capture is read from the sink straight into its sequence's rows of the
  shard (`fetch_binary_into`: one copy, no per-capture buffers, the sink's bytes freed when the
  capture is claimed).
- Which transport: a new run records one in its spec (`run.json` `engine.transport`, copied
  into every shard record), chosen by `AERIE_ENGINE_TRANSPORT` = `auto` (binary when the
  server advertises the plugin in `/server_info` and a two-token probe capture is readable
  here, else JSON), `binary` (refuse otherwise, saying why) or `json`. Every shard of a run then goes through that transport: `check()` refuses a binary
  run on servers without the plugin, and a JSON run stays JSON (its data are the same floats).
  Sink: `AERIE_ENGINE_SINK` = `shm` (the server's tmpfs directory, this host;
  `AERIE_ENGINE_SHM_DIR` if mounted at another path) or `s3` (the server uploads to
  `AERIE_STORE`'s bucket, this engine reads and deletes there). Each server's reader is bound
  to what that server advertises, checked (`sglang_binary.choose_sink`): a descriptor naming
  any other file or key is refused, untouched.
- A server started with `--api-key` gets it as a bearer token on every request
  (`AERIE_ENGINE_API_KEY`); a 401 says which setting to fix.
- Back-pressure: a server whose sink holds its bound of unclaimed captures answers 503; the
  engine retries such a request for `sink_full_wait_s` (its other requests to that server wait
  behind it), then fails (retryable) with the server's message.
- Outages: a server that cannot be reached, drops a request or answers 502/503 (restarting,
  loading; a large model takes 10-30 minutes) is waited for -- its `/health` polled for up to
  `AERIE_ENGINE_OUTAGE_WAIT_S` -- then checked again (a restarted server may capture other
  layers) and the request resent, instead of spending the task's few retries in a minute. `check()`
  waits the same way, so extractors that start before SGLang (a host reboot) wait for it.
- `capture()` runs requests concurrently: `settings.engine_concurrency` in flight per URL, every
  URL in `settings.engine_urls` pulling from one queue (a faster server takes more), each
  in-flight request on its own kept-alive connection (its own small client: one shared pool's
  bookkeeping costs more CPU per request than reading and checking the capture,
  benchmarks/reports/history-2026-12.md).
- `check()` reads every server's own configuration (`/server_info`, `/model_info`) and a
  two-token probe, and refuses (EngineMismatch) another SGLang version, other layer ids,
  another model, or a radix cache that is on -- before any work. `capture()` checks first
  if nobody did.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import ssl
import time
from pathlib import Path
from typing import Literal, cast

import httpx
import numpy as np
import orjson

from aerie import sglang_client
from aerie.capture import CaptureError, convention_for, from_engine_ids, to_engine_ids
from aerie.contracts import EngineSpec, RunSpec, TargetSpec
from aerie.settings import Settings
from aerie.shard import np_dtype
from aerie_extractor.engines.base import Captured, Engine, EngineError, EngineMismatch
from aerie_extractor.engines.sglang_binary import (
    BinaryCaptureError,
    CaptureReader,
    advertised,
    capture_body,
    choose_sink,
    descriptor_of,
    fetch_binary,
    fetch_binary_into,
)

log = logging.getLogger(__name__)

Rows = tuple[np.ndarray, np.ndarray]  # one sequence's aux [T, K, H] and final [T, H] rows of a shard

_PROBE_IDS = [1, 2]  # any two in-vocabulary tokens: the probe only looks at shapes


class _Fatal(EngineError):
    """The server refused the request itself (4xx): retrying the same input cannot help."""

    retryable = False


def auth_headers(settings: Settings) -> dict[str, str]:
    """The bearer token of SGLang's `--api-key` (AERIE_ENGINE_API_KEY): every URL here is configured."""
    key = settings.engine_api_key
    return sglang_client.auth_headers(key.get_secret_value() if key is not None else None)


def http_client(settings: Settings, timeout: float) -> httpx.Client:
    return httpx.Client(timeout=timeout, headers=auth_headers(settings))


def _unauthorized(url: str, r: httpx.Response) -> EngineMismatch:
    return EngineMismatch(sglang_client.unauthorized(url, r.status_code))


def _get(client: httpx.Client, url: str, paths: tuple[str, ...]) -> dict:
    """GET the first of `paths` the server knows, as the engine's errors."""
    try:
        return sglang_client.get_first(client, url, paths)
    except (sglang_client.SGLangUnauthorized, sglang_client.NotSGLang) as e:
        raise EngineMismatch(str(e)) from None
    except sglang_client.SGLangError as e:
        raise EngineError(str(e)) from e.__cause__


def server_info(client: httpx.Client, url: str) -> dict:
    return _get(client, url, sglang_client.SERVER_INFO)


def model_info(client: httpx.Client, url: str) -> dict:
    return _get(client, url, sglang_client.MODEL_INFO)


def topk_rows(meta: dict, T: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """SGLang's input/output top-k log-probs -> (ids int32 [T, k], logprobs float32 [T, k]),
    row t = the distribution over token t+1 (see the module docstring)."""
    inputs = meta.get("input_top_logprobs")
    outputs = meta.get("output_top_logprobs")
    if inputs is None or outputs is None:
        raise EngineError("SGLang returned no top-k log-probs (input_top_logprobs/output_top_logprobs)")
    if len(inputs) != T or inputs[0] is not None:
        raise EngineError(
            f"SGLang returned top-k log-probs for {len(inputs)} input positions of {T} (first "
            f"{'empty' if inputs and inputs[0] is None else 'present'}): logprob_start_len must be 0"
        )
    rows = inputs[1:] + outputs[:1]  # row t predicts token t+1; the last row comes from the output step
    ids = np.empty((T, k), dtype=np.int32)
    values = np.empty((T, k), dtype=np.float32)
    for t, row in enumerate(rows):
        if row is None or len(row) != k:
            raise EngineError(f"SGLang top-k row {t}: {0 if row is None else len(row)} entries, expected {k}")
        for j, (logprob, token, *_) in enumerate(row):
            ids[t, j] = token
            values[t, j] = logprob
    return ids, values


def sink_config(settings: Settings) -> CaptureReader:
    """Where this extractor reads binary captures, from its settings."""
    store = None
    if settings.engine_sink == "s3":
        if not settings.store.startswith(("http://", "https://")):
            raise EngineMismatch(
                f"AERIE_ENGINE_SINK=s3 reads captures from the S3 store, but AERIE_STORE={settings.store!r} is not "
                "http(s)://: point AERIE_STORE at the server's S3 store, or use AERIE_ENGINE_SINK=shm"
            )
        from aerie.store import open_store

        store = open_store(settings)
    return CaptureReader(
        sink=settings.engine_sink, store=store, shm_dir=settings.engine_shm_dir, timeout_s=settings.engine_timeout_s
    )


def _no_plugin(why: str, stock: list[str], alternative: str = "") -> EngineMismatch:
    """The refusal for servers that do not advertise aerie's plugin where a binary run needs it."""
    return EngineMismatch(
        f"{why}, but SGLang server(s) {', '.join(stock)} do not advertise aerie's aerie_capture plugin in "
        "/server_info: install aerie-sglang in the server's environment (the inference image has it) and start it "
        f"with AERIE_SGLANG_BINARY=1{alternative}"
    )


def wait_for_server(url: str, wait_s: float, poll_s: float = 2.0) -> bool:  # /health needs no key
    """Poll `url`/health until it answers 200; True if it was down at first. Raises a retryable
    EngineError naming AERIE_ENGINE_OUTAGE_WAIT_S once `wait_s` seconds pass."""
    deadline, waited, why = time.monotonic() + wait_s, False, ""
    with httpx.Client(timeout=30.0) as client:
        while True:
            try:
                r = client.get(url + "/health")
                if r.status_code == 200:
                    if waited:
                        log.warning("SGLang server %s is back after the outage", url)
                    return waited
                why = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                why = f"{type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                raise EngineError(
                    f"SGLang server {url} unreachable or unhealthy for {wait_s:.0f} s ({why}): is it up? "
                    "(AERIE_ENGINE_URLS; AERIE_ENGINE_OUTAGE_WAIT_S sets how long to wait)"
                )
            if not waited:
                log.warning(
                    "SGLang server %s is down (%s): waiting up to %.0f s for its /health (AERIE_ENGINE_OUTAGE_WAIT_S)",
                    url,
                    why,
                    wait_s,
                )
            waited = True
            time.sleep(min(poll_s, max(deadline - time.monotonic(), 0.0)))


class SGLangEngine(Engine):
    sink_full_wait_s = 60.0  # how long a request refused for a full sink is retried (503)
    probe_timeout_s = 15.0  # how long check() waits for the probe's binary capture

    def __init__(self, settings: Settings, run_spec: RunSpec):
        self.settings, self.run = settings, run_spec
        self.urls = [u.rstrip("/") for u in settings.engine_urls]
        if not self.urls:
            raise EngineMismatch("no SGLang server configured: set AERIE_ENGINE_URLS")
        target = run_spec.target
        self.convention = convention_for("sglang", target.architecture)
        self.layer_ids = to_engine_ids(run_spec.capture_points, self.convention, target.num_layers)
        self.spec = run_spec.engine
        self.max_input: dict[str, int] = {}
        self.transport: str | None = None  # "binary" | "json", decided by check()
        self.readers: dict[str, CaptureReader] = {}  # per server: where its binary captures are read
        self._checked = False
        self._outages: dict[str, asyncio.Lock] = {}
        self._tls: ssl.SSLContext | None = None  # the TLS context of capture()'s clients, made once

    # ----------------------------------------------------------------------------------
    @classmethod
    def spec_for(cls, settings: Settings, target: TargetSpec, capture_points: list[int], dtype: str) -> EngineSpec:
        """What a new run records: the version the (first) server reports, the layer ids, and the
        transport every shard of the run will use (binary when that server advertises aerie's
        plugin and AERIE_ENGINE_TRANSPORT is not json)."""
        convention = convention_for("sglang", target.architecture)
        url = settings.engine_urls[0].rstrip("/")
        wait_for_server(url, settings.engine_outage_wait_s)  # an ingest may start before SGLang too
        with http_client(settings, 30.0) as client:
            info = server_info(client, url)
            transport: Literal["json", "binary"] = "json"
            if settings.engine_transport != "json":
                transport = cls._transport(settings, {url: advertised(info)})
            if transport == "binary":
                unreadable = cls._unreadable(settings, client, url, advertised(info))  # type: ignore[arg-type]
                if unreadable and settings.engine_transport == "binary":
                    raise EngineMismatch(unreadable)
                if unreadable:
                    log.warning("%s; this run uses JSON (AERIE_ENGINE_TRANSPORT=auto)", unreadable)
                    transport = "json"
        return EngineSpec(
            name="sglang",
            version=str(info["version"]),
            convention=convention,
            layer_ids=to_engine_ids(capture_points, convention, target.num_layers),
            transport=transport,
            dtype=dtype,
        )

    @classmethod
    def _unreadable(cls, settings: Settings, client: httpx.Client, url: str, advertisement: dict) -> str | None:
        """Why this extractor cannot read the server's binary captures (None: it can). Tried with
        one real two-token capture: the shm sink only works where the server's directory is
        mounted, which nothing else shows."""
        try:
            sinks = sink_config(settings)
            choose_sink(advertisement, sinks)
            r = client.post(url + "/generate", json=capture_body(_PROBE_IDS, sinks.sink))
            if r.status_code == 503:
                raise EngineError(f"SGLang server {url}: capture sink full, retry later: {r.text[:300]}")
            if r.status_code in (401, 403):
                raise _unauthorized(url, r)
            if r.status_code != 200:
                return f"SGLang server {url} refused a binary capture (HTTP {r.status_code}): {r.text[:300]}"
            sinks.timeout_s = cls.probe_timeout_s
            fetch_binary(descriptor_of(orjson.loads(r.content)), sinks)
        except (EngineMismatch, BinaryCaptureError) as e:
            return f"SGLang server {url} offers binary captures but this extractor cannot read them: {e}"
        return None

    @staticmethod
    def _transport(settings: Settings, ads: dict[str, dict | None]) -> Literal["json", "binary"]:
        """binary when wanted and every server in `ads` advertises the plugin; json otherwise."""
        if settings.engine_transport == "json":
            return "json"
        stock = [url for url, ad in ads.items() if ad is None]
        if not stock:
            return "binary"
        if settings.engine_transport == "binary":
            raise _no_plugin("AERIE_ENGINE_TRANSPORT=binary", stock, ", or use AERIE_ENGINE_TRANSPORT=auto|json")
        return "json"

    def check(self, run: RunSpec) -> None:
        if run.engine.name != "sglang":
            raise EngineMismatch(f"run {run.run!r} records engine {run.engine.name!r}, not 'sglang'")
        if run.engine.layer_ids != self.layer_ids:
            raise EngineMismatch(
                f"run {run.run!r} records SGLang layer ids {run.engine.layer_ids}, but its capture points "
                f"{run.capture_points} translate to {self.layer_ids} ({self.convention}): the run spec is inconsistent"
            )
        transport = run.engine.transport
        if transport not in ("json", "binary"):
            raise EngineMismatch(
                f"run {run.run!r} records transport {transport!r}; the sglang engine speaks 'json' or 'binary'"
            )
        if transport == "json" and run.target_signal != "topk":
            raise EngineMismatch(
                f"run {run.run!r} wants target signal {run.target_signal!r} but was ingested against a server without "
                "aerie's plugin (transport 'json'): stock SGLang over JSON returns top-k log-probs only. Enable the plugin "
                "(AERIE_SGLANG_BINARY=1 on the inference server; compose profile capture does) and ingest a new run, "
                "or ingest with target_signal 'topk'"
            )
        deadline = time.monotonic() + self.settings.engine_outage_wait_s
        while True:  # a server that goes down during the check is waited for and checked again
            for url in self.urls:
                wait_for_server(url, max(deadline - time.monotonic(), 0.0))
            try:
                return self._check_servers(run, transport)
            except EngineError as e:
                if not isinstance(e.__cause__, httpx.TransportError) or time.monotonic() >= deadline:
                    raise
                log.warning("%s: checking again once the server is up", e)

    def _check_servers(self, run: RunSpec, transport: str) -> None:
        with http_client(self.settings, min(self.settings.engine_timeout_s, 60.0)) as client:
            infos = {url: self._check_server(client, url, run) for url in self.urls}
            if transport == "binary":
                ads = {url: advertised(info) for url, info in infos.items()}
                stock = [url for url, ad in ads.items() if ad is None]
                if stock:
                    raise _no_plugin(f"run {run.run!r} was ingested for the binary path", stock)
                self.readers = {}
                for url, ad in ads.items():  # each server's own directory / prefix, checked
                    reader = sink_config(self.settings)
                    choose_sink(ad, reader)  # type: ignore[arg-type]
                    self.readers[url] = reader
            self.transport = transport
            for url in self.urls:
                self._probe(client, url, run)
        self._checked = True

    def _check_server(self, client: httpx.Client, url: str, run: RunSpec) -> dict:
        """Refuse a server that would not give the run's tensors; its `/server_info`."""
        info, model = server_info(client, url), model_info(client, url)
        target = run.target
        version = str(info.get("version"))
        if version != run.engine.version:
            raise EngineMismatch(
                f"SGLang server {url} runs version {version}, run {run.run!r} records SGLang {run.engine.version}: "
                f"serve the run with sglang=={run.engine.version} (hidden states differ between versions), or start a new run"
            )
        if not info.get("enable_return_aux_hidden_states"):
            raise EngineMismatch(
                f"SGLang server {url} is not in capture mode: start it with --enable-return-aux-hidden-states "
                f"--speculative-algorithm EAGLE3 --return-aux-hidden-state-layer-ids {' '.join(map(str, self.layer_ids))} "
                f"(SGLang releases without these flags, e.g. 0.5.17: the aerie plugin with AERIE_SGLANG_BINARY=1 "
                f"AERIE_CAPTURE_LAYER_IDS={','.join(map(str, self.layer_ids))} and --enable-return-hidden-states)"
            )
        served_ids = [int(i) for i in info.get("return_aux_hidden_state_layer_ids") or []]
        if served_ids != self.layer_ids:
            try:
                served_points = f"capture points {from_engine_ids(served_ids, self.convention, target.num_layers)}"
            except CaptureError as e:
                served_points = f"no valid capture points: {e}"
            raise EngineMismatch(
                f"SGLang server {url} captures layer ids {served_ids} ({self.convention}: {served_points}), "
                f"but run {run.run!r} needs capture points {run.capture_points} = layer ids {self.layer_ids}: "
                f"restart the server with --return-aux-hidden-state-layer-ids {' '.join(map(str, self.layer_ids))} "
                f"(AERIE_CAPTURE_LAYER_IDS={','.join(map(str, self.layer_ids))} on releases without that flag)"
            )
        if not info.get("disable_radix_cache"):
            raise EngineMismatch(
                f"SGLang server {url} runs with its radix (prefix) cache on: a prompt sharing a prefix with an "
                "earlier one would return hidden states for its uncached tokens only: restart it with --disable-radix-cache"
            )
        archs = model.get("architectures") or []
        if target.architecture not in archs:
            raise EngineMismatch(
                f"SGLang server {url} serves {model.get('model_path')} ({', '.join(archs) or 'unknown architecture'}), "
                f"run {run.run!r} targets {target.model} ({target.architecture}): serve the run's target"
            )
        self._check_identity(url, model, run)
        self.max_input[url] = int(info.get("max_req_input_len") or 0)
        return info

    def _check_identity(self, url: str, model: dict, run: RunSpec) -> None:
        """Same weights when the server's model folder is readable here; else the same name."""
        target = run.target
        served = str(model.get("model_path") or "")
        names = {served, str(model.get("served_model_name") or "")}
        if served and Path(served, "config.json").is_file() and any(Path(served).glob("*.safetensors")):
            from aerie.target import describe

            here = describe(served)
            if here.weights_sha256 != target.weights_sha256:
                raise EngineMismatch(
                    f"SGLang server {url} serves {served} (weights sha256 {here.weights_sha256[:12]}), "
                    f"run {run.run!r} targets {target.model} (weights sha256 {target.weights_sha256[:12]}): "
                    "serve the run's target"
                )
            return
        wanted = {target.model.rstrip("/"), os.path.basename(target.model.rstrip("/"))}
        if not any(n and (n.rstrip("/") in wanted or os.path.basename(n.rstrip("/")) in wanted) for n in names):
            raise EngineMismatch(
                f"SGLang server {url} serves {served!r} (name {model.get('served_model_name')!r}), run {run.run!r} "
                f"targets {target.model!r}: serve the run's target, or start the server with "
                f"--served-model-name {target.model}"
            )

    def _probe(self, client: httpx.Client, url: str, run: RunSpec) -> None:
        body = self._body(_PROBE_IDS)
        try:
            r = client.post(url + "/generate", json=body)
        except httpx.HTTPError as e:
            raise EngineError(f"SGLang server {url}: probe request failed ({type(e).__name__}: {e})") from e
        if r.status_code in (401, 403):
            raise _unauthorized(url, r)
        if r.status_code != 200:
            raise EngineMismatch(
                f"SGLang server {url} refused a capture request (HTTP {r.status_code}): {r.text[:300]}"
            )
        try:
            self._parse(url, orjson.loads(r.content), len(_PROBE_IDS), timeout_s=self.probe_timeout_s)
        except BinaryCaptureError as e:  # a sink this extractor cannot read: configuration, not chance
            raise EngineMismatch(f"SGLang server {url}: the probe's binary capture failed: {e}") from e

    # ----------------------------------------------------------------------------------
    def _body(self, ids: list[int]) -> dict:
        topk = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": int(self.run.topk or 20)}
        if self.transport == "binary":
            body = capture_body(ids, self.settings.engine_sink)
            return {**body, **topk} if self.run.target_signal == "topk" else body
        return {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_hidden_states": True,
            **topk,
        }

    def _parse(
        self, url: str, out: dict, T: int, timeout_s: float | None = None, into: Rows | None = None
    ) -> Captured | None:
        if self.transport == "binary":
            return self._parse_binary(url, out, T, timeout_s, into)
        return self._parse_json(url, out, T)

    def _parse_binary(
        self, url: str, out: dict, T: int, timeout_s: float | None, into: Rows | None = None
    ) -> Captured | None:
        """The capture a response names, claimed; with `into` (the sequence's aux [T, K, H] and
        final [T, H] rows of the shard) read straight into them when the dtypes agree (None
        returned), else copied in after the cast."""
        run, target = self.run, self.run.target
        K, H = len(run.capture_points), target.hidden_size
        descriptor = descriptor_of(out)
        reader = self.readers[url]
        sinks = reader if timeout_s is None else dataclasses.replace(reader, timeout_s=timeout_s)
        promised = {name: (spec.shape, spec.dtype) for name, spec in descriptor.tensors.items()}
        if (
            into is not None
            and descriptor.layer_ids == self.layer_ids
            and promised == {"aux": ([T, K, H], str(into[0].dtype)), "final": ([T, H], str(into[1].dtype))}
        ):
            fetch_binary_into(descriptor, sinks, {"aux": into[0], "final": into[1]})
            return None
        tensors = fetch_binary(descriptor, sinks)  # claims it: deleted even if the checks below fail
        aux, final = tensors["aux"], tensors["final"]
        if descriptor.layer_ids != self.layer_ids:
            raise EngineMismatch(
                f"SGLang server {url} captured layer ids {descriptor.layer_ids}, run {run.run!r} needs {self.layer_ids}"
            )
        if aux.shape != (T, K, H) or final.shape != (T, H):
            raise EngineMismatch(
                f"SGLang server {url} returned aux {list(aux.shape)} and final {list(final.shape)} for {T} tokens, "
                f"expected [{T}, {K}, {H}] and [{T}, {H}]: is the radix cache on, or another model served?"
            )
        dtype = np_dtype(run.dtype)
        cap = Captured(aux=aux.astype(dtype, copy=False), final=final.astype(dtype, copy=False))  # [T, K, H], [T, H]
        if run.target_signal == "topk":
            cap.topk_ids, cap.topk_logprobs = topk_rows(out.get("meta_info") or {}, T, int(run.topk or 20))
        if into is not None:
            into[0][...], into[1][...] = cap.aux, cap.final
            return None
        return cap

    def _parse_json(self, url: str, out: dict, T: int) -> Captured:
        run, target = self.run, self.run.target
        K, H = len(run.capture_points), target.hidden_size
        meta = out.get("meta_info") or {}
        states = meta.get("hidden_states")
        if not states:
            raise EngineMismatch(
                f"SGLang server {url} returned no hidden states: it must run with --enable-return-aux-hidden-states"
            )
        rows = states[0]
        if rows and not isinstance(rows[0], list):  # a one-token prompt may come back flat
            rows = [rows]
        aux = np.asarray(rows, dtype=np.float32)
        if aux.ndim != 2 or aux.shape[0] != T:
            raise EngineMismatch(
                f"SGLang server {url} returned hidden states of shape {list(aux.shape)} for {T} tokens: "
                "one row per prompt token expected (is the radix cache on? start it with --disable-radix-cache)"
            )
        if aux.shape[1] != K * H:
            width = aux.shape[1]
            cause = (
                f"{width // H} captured layers of H={H} where the run has {K} capture points "
                f"(wrong --return-aux-hidden-state-layer-ids; expected {' '.join(map(str, self.layer_ids))})"
                if width % H == 0
                else f"not a multiple of the run's hidden size {H}: the server serves another model than {target.model}"
            )
            raise EngineMismatch(
                f"SGLang server {url} returned {width} floats per token, expected K*H = {K}*{H}: {cause}"
            )
        ids, logprobs = topk_rows(meta, T, int(run.topk or 20))
        return Captured(
            aux=aux.reshape(T, K, H).astype(np_dtype(run.dtype), copy=False),  # [T, K, H]
            topk_ids=ids,
            topk_logprobs=logprobs,
        )

    async def _one(
        self,
        client: httpx.AsyncClient,
        url: str,
        seq: np.ndarray,
        gate: asyncio.Lock | None = None,
        into: Rows | None = None,
    ) -> Captured | None:
        """One sequence. `gate` (one per server): a request refused for a full sink holds it while
        it retries, and every new request passes it first, so the refused one gets in before this
        engine's other workers refill the sink (without it two workers could starve the others)."""
        ids = np.asarray(seq).tolist()
        limit = self.max_input.get(url) or 0
        if limit and len(ids) > limit:
            raise _Fatal(
                f"a sequence of {len(ids)} tokens exceeds SGLang server {url}'s limit of {limit} input tokens: lower ingest max_tokens or raise --context-length"
            )
        body = orjson.dumps(self._body(ids))

        async def post() -> httpx.Response:
            refusals = 0  # failures while /health says the server is up: not an outage, do not loop on them
            while True:
                try:
                    r = await client.post(url + "/generate", content=body, headers={"content-type": "application/json"})
                except httpx.TimeoutException as e:  # a slow answer, not an outage: the task's retry
                    raise EngineError(f"SGLang server {url}: request for {len(ids)} tokens timed out ({e})") from e
                except httpx.TransportError as e:  # refused, dropped: the server is down or restarting
                    why = f"{type(e).__name__}: {e}"
                else:
                    if r.status_code not in (502, 503) or "AERIE_CAPTURE_MAX_UNCLAIMED_BYTES" in r.text:
                        return r
                    why = f"HTTP {r.status_code}"
                if not self.settings.engine_outage_wait_s or refusals >= 5:
                    raise EngineError(f"SGLang server {url}: request for {len(ids)} tokens failed ({why})")
                if not await self._outage(url):
                    refusals += 1
                    await asyncio.sleep(refusals)

        def sink_full(r: httpx.Response) -> bool:
            if r.status_code != 503 or "AERIE_CAPTURE_MAX_UNCLAIMED_BYTES" not in r.text:
                return False
            if "more than the bound" in r.text:  # this one capture can never fit
                raise _Fatal(f"SGLang server {url} refused to capture {len(ids)} tokens: {r.text[:500]}")
            return True

        gate = gate or asyncio.Lock()
        async with gate:  # behind a refused request, if one is retrying
            pass
        r = await post()
        if sink_full(r):
            async with gate:  # others' captures are waiting to be claimed: retry first
                deadline, delay = time.monotonic() + self.sink_full_wait_s, 0.05
                while sink_full(r):
                    if time.monotonic() > deadline:
                        raise EngineError(
                            f"SGLang server {url}: capture sink still full after {self.sink_full_wait_s:.0f} s: {r.text[:500]}"
                        )
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    r = await post()
        if r.status_code in (401, 403):
            raise _unauthorized(url, r)
        if 400 <= r.status_code < 500:
            raise _Fatal(f"SGLang server {url} refused {len(ids)} tokens (HTTP {r.status_code}): {r.text[:300]}")
        if r.status_code != 200:
            raise EngineError(f"SGLang server {url} failed on {len(ids)} tokens (HTTP {r.status_code}): {r.text[:300]}")
        out = orjson.loads(r.content)
        if self.transport == "binary":  # waits for the sink: off the event loop
            return await asyncio.to_thread(self._parse, url, out, len(ids), None, into)
        return self._parse(url, out, len(ids))

    async def _outage(self, url: str) -> bool:
        """Wait for `url` to come back (one waiter per server; the others queue behind it), then
        check it again: a restarted server must still give this run's tensors. False: it was up."""
        async with self._outages.setdefault(url, asyncio.Lock()):
            if not await asyncio.to_thread(wait_for_server, url, self.settings.engine_outage_wait_s):
                return False

            def recheck() -> None:
                with http_client(self.settings, min(self.settings.engine_timeout_s, 60.0)) as client:
                    self._check_server(client, url, self.run)

            await asyncio.to_thread(recheck)
            return True

    async def _capture_all(self, sequences: list[np.ndarray], into: list[Rows] | None = None) -> list[Captured | None]:
        results: list[Captured | None] = [None] * len(sequences)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(len(sequences)):
            queue.put_nowait(i)

        gates = {url: asyncio.Lock() for url in self.urls}

        async def worker(client: httpx.AsyncClient, url: str) -> None:
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results[i] = await self._one(client, url, sequences[i], gates[url], None if into is None else into[i])

        # one client (one kept-alive connection) per in-flight request: httpcore's pool looks over
        # every connection and queued request on each request's start and end, which for one pool
        # of them all costs more CPU than reading and checking a capture (benchmarks/reports/history-2026-12.md)
        # (and one TLS context for them all: each client would load the CA bundle again)
        per_url = self.settings.engine_concurrency
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        if self._tls is None:
            self._tls = httpx.create_ssl_context()
        async with contextlib.AsyncExitStack() as stack:
            tasks = []
            for url in self.urls:
                for _ in range(per_url):
                    client = await stack.enter_async_context(
                        httpx.AsyncClient(
                            timeout=self.settings.engine_timeout_s,
                            limits=limits,
                            headers=auth_headers(self.settings),
                            verify=self._tls,
                        )
                    )
                    tasks.append(asyncio.create_task(worker(client, url)))
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        return results  # type: ignore[return-value]

    @property
    def capture_into(self):
        """Binary captures of a run with signal "final" go straight into the shard's arrays
        (`_capture_into`); None otherwise (JSON, top-k: `capture`). Checks the servers first."""
        if not self._checked:
            self.check(self.run)
        if self.transport == "binary" and self.run.target_signal == "final":
            return self._capture_into
        return None

    def _capture_into(
        self,
        sequences: list[np.ndarray],
        offsets: np.ndarray,
        aux: np.ndarray,
        final: np.ndarray,
        aux_scale: np.ndarray | None = None,
        final_scale: np.ndarray | None = None,
    ) -> bool:
        """Sequence i's states into rows offsets[i]:offsets[i+1] of aux [T, K, H] and final [T, H]
        (the run's dtype; the writers quantize fp8 runs): each capture read from the sink into its
        rows. False: nothing was checked finite here (the shard's validation does)."""
        if aux_scale is not None or final_scale is not None:
            raise ValueError("the sglang engine fills the run's dtype: its shards are quantized by the writers")
        if not sequences:
            return False
        into = [(aux[offsets[i] : offsets[i + 1]], final[offsets[i] : offsets[i + 1]]) for i in range(len(sequences))]
        started = time.monotonic()
        asyncio.run(self._capture_all(sequences, into))
        log.debug("sglang engine: %d sequences into the shard in %.2f s", len(sequences), time.monotonic() - started)
        return False

    def capture(self, sequences: list[np.ndarray]) -> list[Captured]:
        if not self._checked:
            self.check(self.run)
        if not sequences:
            return []
        started = time.monotonic()
        out = asyncio.run(self._capture_all(sequences))
        log.debug(
            "sglang engine: %d sequences, %d tokens in %.2f s",
            len(sequences),
            sum(len(s) for s in sequences),
            time.monotonic() - started,
        )
        return cast(list[Captured], out)  # without `into`, every sequence's slot holds its capture
