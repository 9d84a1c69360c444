"""`aerie align`: are a run's stored states what the serving engine computes? If not, why not.

    aerie align --run sharegpt --server http://sglang-capture:30000 [--samples 8] [--seed 0]
    celery -A aerie_extractor.worker call aerie.align --kwargs '{"run": "sharegpt", "server": "http://..."}'

A drafter trained on states from one engine or quantization and served by another accepts little.
This check measures the difference before training, for the user's own run and serving deployment:

- The server is SGLang in capture mode, started like the serving deployment (same model folder,
  quantization, TP size, dtype, SGLang version) plus `--enable-return-aux-hidden-states
  --return-aux-hidden-state-layer-ids IDS --disable-radix-cache`. Its `/server_info` and
  `/model_info` give its identity; the server id hashes that configuration (not the URL), so the
  report `runs/<run>/align/<server-id>.json` is replaced when the same deployment is checked again.
- A deterministic sample: `samples` stored sequences drawn by `seed` over all hidden shards, each
  cut to its first `max_tokens` tokens (causal: a prefix's states are the prefix's). Only those
  rows are read from the store (byte ranges), never whole shards.
- Each sequence's token ids go through the server once, as the extractor's `sglang` engine sends
  them: binary through aerie's plugin when the server advertises it and its sink is readable here,
  stock JSON otherwise; with top-k log-probs of the target distribution.
- Every stored point is compared with every point the server captures: per-token cosine (mean,
  1st percentile, min) and relative L2 at the same point, the mean cosine at the others. Started
  with the run's points and their neighbours (`neighbour_layer_ids`; the report says which ids),
  the server shows which of its layers each stored point is.
- The target signal: a `final` run's stored final states through the target's own lm_head (read
  from the model folder with safetensors; no transformers model) against the server's top-1 token,
  plus the final states' cosine on the binary path; a `topk` run's ids and log-probs against the
  server's.
- Tokenization: each sample's text (the stored ids decoded by the run's tokenizer) is tokenized by
  the server (`/v1/tokenize`) and by the run's tokenizer; the first position where they differ.
- Pass/fail by the thresholds of the less precise dtype of run and server (settings
  `AERIE_ALIGN_MIN_COSINE`, `..._P1`, `AERIE_ALIGN_MIN_TOP1`, measured defaults); `diagnose` turns
  the measurements into causes, most likely first. The table is `aerie.alignment`'s (shared with
  `aerie run --server`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import click
import httpx
import numpy as np
import orjson

from aerie import layout, sglang_client
from aerie.app.views import print_report
from aerie.capture import CaptureError, convention_for, from_engine_ids, to_engine_ids
from aerie.contracts import (
    AlignmentReport,
    AlignRequest,
    CosineStats,
    PointAlignment,
    RunSpec,
    SampledSequence,
    ServerIdentity,
    ShardRecord,
    SignalAlignment,
    TokenizationCheck,
)
from aerie.runs import RunError, load_run, shard_names
from aerie.settings import Settings
from aerie.shard import dequantize_tensors, read_safetensors, scale_name
from aerie.store import ObjectStore
from aerie_extractor.engines.base import EngineError, EngineMismatch
from aerie_extractor.engines.sglang import model_info, server_info, topk_rows
from aerie_extractor.engines.sglang_binary import (
    BinaryCaptureError,
    CaptureReader,
    advertised,
    capture_body,
    choose_sink,
    descriptor_of,
    fetch_binary,
)

log = logging.getLogger(__name__)

FINAL_TOPK = 5  # top-k log-probs asked for a `final` run (top-1 agreement and the log-prob error)
PRECISION = ("float32", "float16", "bfloat16")  # most to least precise
_ORDINAL = {1: "one", 2: "two", 3: "three"}


class AlignmentFailed(RunError):
    """A check that failed where training was to follow; the message names the report and causes."""


# --------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------
def neighbour_layer_ids(points: list[int], convention: str, num_layers: int) -> list[int]:
    """SGLang layer ids of the points and their neighbours (p-1, p, p+1): a server started with
    them lets align say which of its layers each stored point is."""
    wanted = sorted({q for p in points for q in (p - 1, p, p + 1) if 0 <= q < num_layers})
    while wanted:
        try:
            return to_engine_ids(wanted, convention, num_layers)  # type: ignore[arg-type]
        except CaptureError:  # the lowest point has no id in this convention (embeddings, DeepSeek's point 1)
            wanted = wanted[1:]
    raise CaptureError(f"no SGLang layer ids for the points {points}")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.")[:48] or "server"


def served_quantization(info: dict, config: dict) -> str | None:
    """The quantization a server runs: its `--quantization` when set, else what the model's
    config.json declares (SGLang detects that itself and leaves the argument unset)."""
    from aerie.target import quantization_of

    return info.get("quantization") or quantization_of(config)


def identify(client: httpx.Client, url: str, run: RunSpec, transport: str) -> tuple[ServerIdentity, dict]:
    """The server's configuration (refusing one that cannot capture) and its `/server_info`."""
    info, model = server_info(client, url), model_info(client, url)
    target = run.target
    archs = model.get("architectures") or []
    architecture = str(archs[0]) if archs else target.architecture
    convention = convention_for("sglang", architecture)
    suggested = " ".join(map(str, neighbour_layer_ids(run.capture_points, convention, target.num_layers)))
    if not info.get("enable_return_aux_hidden_states"):
        raise EngineMismatch(
            f"SGLang server {url} is not in capture mode: start it as the serving deployment (same model, "
            f"quantization, TP, dtype) plus --enable-return-aux-hidden-states --speculative-algorithm EAGLE3 "
            f"--return-aux-hidden-state-layer-ids {suggested} --disable-radix-cache"
        )
    if not info.get("disable_radix_cache"):
        raise EngineMismatch(
            f"SGLang server {url} runs with its radix cache on: it would return states of uncached tokens "
            "only: restart it with --disable-radix-cache"
        )
    ids = [int(i) for i in info.get("return_aux_hidden_state_layer_ids") or []]
    try:
        points = from_engine_ids(ids, convention, target.num_layers)
    except CaptureError as e:
        raise EngineMismatch(
            f"SGLang server {url} captures layer ids {ids} that name no capture points of a "
            f"{target.num_layers}-layer {architecture}: {e}"
        ) from None
    model_path = str(model.get("model_path") or info.get("model_path") or "")
    weights = tokenizer = None
    folder = Path(model_path)
    dtype = str(info.get("dtype") or "auto")
    quantization = info.get("quantization")
    if model_path and (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        from aerie.target import describe, load_config

        described = describe(folder)
        weights, tokenizer = described.weights_sha256, described.tokenizer_sha256
        cfg = load_config(folder)
        if dtype == "auto":
            dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "auto")
        quantization = served_quantization(info, cfg)
    configuration = [
        model_path,
        weights or info.get("model_checksum"),
        str(info.get("version")),
        quantization,
        int(info.get("tp_size") or 1),
        dtype,
        info.get("kv_cache_dtype"),
        info.get("revision"),
    ]
    digest = hashlib.sha256(json.dumps(configuration, default=str).encode()).hexdigest()[:12]
    identity = ServerIdentity(
        url=url,
        server_id=f"{_slug(Path(model_path).name or 'sglang')}-{digest}",
        model_path=model_path,
        architecture=architecture,
        weights_sha256=weights,
        tokenizer_sha256=tokenizer,
        sglang_version=str(info.get("version")),
        quantization=quantization,
        tp_size=int(info.get("tp_size") or 1),
        dtype=dtype,
        kv_cache_dtype=info.get("kv_cache_dtype"),
        aux_layer_ids=ids,
        aux_points=points,
        transport=transport,  # type: ignore[arg-type]
    )
    return identity, info


@dataclass
class Served:
    aux: np.ndarray  # [T, Ks, H] float32, the server's points in id order
    final: np.ndarray | None  # [T, H] float32 (binary transport)
    topk_ids: np.ndarray  # [T, k] int32
    topk_logprobs: np.ndarray  # [T, k] float32


class Client:
    """One sequence at a time through the server, binary when possible."""

    def __init__(self, settings: Settings, url: str, hidden_size: int, k: int):
        self.settings, self.url, self.H, self.k = settings, url, hidden_size, k
        # the key only if `url` is a configured server: the request's URL comes from a message
        self.http = sglang_client.http_client(settings, url, settings.engine_timeout_s)
        self.sinks: CaptureReader | None = None
        self.note = ""

    def choose(self, info: dict) -> str:
        """binary when the server advertises aerie's plugin and AERIE_ENGINE_TRANSPORT allows it."""
        ad = advertised(info)
        if ad is None or self.settings.engine_transport == "json":
            return "json"
        from aerie_extractor.engines.sglang import sink_config

        try:
            self.sinks = sink_config(self.settings)
            choose_sink(ad, self.sinks)
        except EngineMismatch as e:
            if self.settings.engine_transport == "binary":
                raise
            self.note = f"binary capture not readable here ({e}); JSON used"
            return "json"
        return "binary"

    def capture(self, ids: list[int], transport: str) -> Served:
        topk = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": self.k}
        if transport == "binary":
            body = {**capture_body(ids, self.sinks.sink), **topk}  # type: ignore[union-attr]
        else:
            body = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "return_hidden_states": True,
                **topk,
            }
        try:
            r = self.http.post(
                self.url + "/generate", content=orjson.dumps(body), headers={"content-type": "application/json"}
            )
        except httpx.HTTPError as e:
            raise EngineError(
                f"SGLang server {self.url}: request for {len(ids)} tokens failed ({type(e).__name__}: {e})"
            ) from e
        if r.status_code != 200:
            raise (EngineMismatch if 400 <= r.status_code < 500 else EngineError)(
                f"SGLang server {self.url} refused {len(ids)} tokens (HTTP {r.status_code}): {r.text[:300]}"
            )
        out = orjson.loads(r.content)
        meta = out.get("meta_info") or {}
        T = len(ids)
        topk_ids, topk_logprobs = topk_rows(meta, T, self.k)
        if transport == "binary":
            tensors = fetch_binary(descriptor_of(out), self.sinks)  # type: ignore[arg-type]
            return Served(
                tensors["aux"].astype(np.float32), tensors["final"].astype(np.float32), topk_ids, topk_logprobs
            )
        rows = (meta.get("hidden_states") or [None])[0]
        if not rows:
            raise EngineMismatch(
                f"SGLang server {self.url} returned no hidden states: start it with --enable-return-aux-hidden-states"
            )
        if not isinstance(rows[0], list):  # a one-token prompt may come back flat
            rows = [rows]
        aux = np.asarray(rows, dtype=np.float32)
        if aux.ndim != 2 or aux.shape[0] != T or aux.shape[1] % self.H:
            raise EngineMismatch(
                f"SGLang server {self.url} returned hidden states {list(aux.shape)} for {T} tokens of "
                f"hidden size {self.H}: another model, or the radix cache on?"
            )
        return Served(aux.reshape(T, -1, self.H), None, topk_ids, topk_logprobs)

    def tokenize(self, text: str) -> list[int] | None:
        """The server's tokens for `text` (no special tokens added), None if it has no tokenize endpoint."""
        r = self.http.post(self.url + "/v1/tokenize", json={"prompt": text, "add_special_tokens": False})
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return [int(t) for t in r.json()["tokens"]]

    def close(self) -> None:
        self.http.close()


# --------------------------------------------------------------------------------------
# The sample, read from the store by byte ranges
# --------------------------------------------------------------------------------------
def draw_sample(store: ObjectStore, run: str, samples: int, seed: int) -> list[tuple[ShardRecord, int]]:
    """`samples` (shard record, sequence index) pairs drawn by `seed` over the run's hidden shards, in order."""
    records = [
        store.get_json(layout.shard_record(run, "hidden", name), ShardRecord)
        for name in shard_names(store, run, "hidden")
    ]
    total = sum(r.sequences for r in records)
    if total == 0:
        raise RunError(f"run {run!r} has no extracted sequences (runs/{run}/hidden/): extract it before aligning")
    picks = np.sort(np.random.default_rng(seed).choice(total, size=min(samples, total), replace=False))
    starts = np.cumsum([0] + [r.sequences for r in records])
    out = []
    for g in picks:
        i = int(np.searchsorted(starts, g, side="right")) - 1
        out.append((records[i], int(g - starts[i])))
    return out


class ShardRows:
    """Rows of one stored shard's tensors, fetched by byte range (fp8 states dequantized)."""

    def __init__(self, store: ObjectStore, key: str):
        self.store, self.key = store, key
        (n,) = struct.unpack("<Q", store.get_range(key, 0, 8))
        self.header = json.loads(store.get_range(key, 8, n))
        self.metadata = self.header.pop("__metadata__", None) or {}
        self.base = 8 + n
        self.offsets = self.rows("offsets", 0, self.header["offsets"]["shape"][0])

    def rows(self, name: str, a: int, b: int) -> np.ndarray:
        if scale_name(name) in self.header:  # fp8 states: as the run's dtype, like every reader gets them
            both = {name: self._stored_rows(name, a, b), scale_name(name): self._stored_rows(scale_name(name), a, b)}
            return dequantize_tensors(both, self.metadata)[name]
        return self._stored_rows(name, a, b)

    def _stored_rows(self, name: str, a: int, b: int) -> np.ndarray:
        spec = self.header[name]
        shape = spec["shape"]
        row_bytes = (spec["data_offsets"][1] - spec["data_offsets"][0]) // max(shape[0], 1)
        start = self.base + spec["data_offsets"][0] + a * row_bytes
        raw = self.store.get_range(self.key, start, (b - a) * row_bytes)
        head = json.dumps(
            {name: {"dtype": spec["dtype"], "shape": [b - a, *shape[1:]], "data_offsets": [0, len(raw)]}}
        ).encode()
        tensors, _ = read_safetensors(struct.pack("<Q", len(head)) + head + raw)
        return tensors[name]

    def sequence(self, s: int, max_tokens: int, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        a = int(self.offsets[s])
        b = min(int(self.offsets[s + 1]), a + max_tokens)
        return {name: self.rows(name, a, b) for name in names if name in self.header}


# --------------------------------------------------------------------------------------
# The target's lm_head, from its safetensors (no transformers model)
# --------------------------------------------------------------------------------------
class LmHead:
    """The target's output projection [V, H], memory-mapped; logits computed in row blocks."""

    BLOCK = 8192

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        from aerie.target import load_config

        cfg = load_config(folder)
        names = ["lm_head.weight"]
        if cfg.get("tie_word_embeddings"):
            names = ["model.embed_tokens.weight", "lm_head.weight"]
        index = folder / "model.safetensors.index.json"
        weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else {}
        for name in [*names, "model.embed_tokens.weight", "model.language_model.embed_tokens.weight"]:
            files = [folder / weight_map[name]] if name in weight_map else sorted(folder.glob("*.safetensors"))
            for path in files:
                if path.resolve().parent != folder.resolve():  # an index naming a file outside the folder
                    continue
                tensors, _ = read_safetensors(np.memmap(path, mode="r", dtype=np.uint8).data)
                if name in tensors:
                    self.weight, self.name = tensors[name], f"{path.name}:{name}"
                    return
        raise FileNotFoundError(f"{folder}: no lm_head.weight (or tied embed_tokens.weight) in its safetensors")

    def logits_stats(self, final: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """final [T, H] -> (argmax [T], log-probs at `ids` [T, k]) in float32."""
        T = final.shape[0]
        x = final.astype(np.float32)
        best, best_id = np.full(T, -np.inf, np.float32), np.zeros(T, np.int64)
        lse = np.full(T, -np.inf, np.float64)
        for a in range(0, self.weight.shape[0], self.BLOCK):
            logits = x @ self.weight[a : a + self.BLOCK].astype(np.float32).T  # (T, block)
            arg = logits.argmax(-1)
            top = logits[np.arange(T), arg]
            better = top > best
            best[better], best_id[better] = top[better], arg[better] + a
            lse = np.logaddexp(lse, np.log(np.exp(logits - top[:, None]).sum(-1)) + top)
        picked = np.einsum("th,tkh->tk", x, self.weight[ids].astype(np.float32))
        return best_id, (picked - lse[:, None]).astype(np.float32)


# --------------------------------------------------------------------------------------
# The comparison
# --------------------------------------------------------------------------------------
def cosines(stored: np.ndarray, served: np.ndarray) -> np.ndarray:
    """Per-row cosine of two [T, H] arrays."""
    num = (stored * served).sum(-1, dtype=np.float64)
    den = np.linalg.norm(stored, axis=-1).astype(np.float64) * np.linalg.norm(served, axis=-1) + 1e-30
    return num / den


def cosine_stats(pairs: list[tuple[np.ndarray, np.ndarray]]) -> CosineStats:
    c = np.concatenate([cosines(s, r) for s, r in pairs])
    diff = sum(float(((s - r) ** 2).sum(dtype=np.float64)) for s, r in pairs)
    norm = sum(float((r.astype(np.float64) ** 2).sum()) for _, r in pairs)
    return CosineStats(
        mean=float(c.mean()),
        p1=float(np.percentile(c, 1)),
        min=float(c.min()),
        rel_l2=float(np.sqrt(diff / max(norm, 1e-30))),
        tokens=int(c.size),
    )


def thresholds(settings: Settings, run_dtype: str, server_dtype: str) -> tuple[str, float, float]:
    """(precision, least mean cosine, least p1 cosine): the less precise dtype of the two decides."""
    defaults = Settings.model_fields
    mean = {**defaults["align_min_cosine"].default_factory(), **settings.align_min_cosine}  # type: ignore[misc, call-arg]
    p1 = {**defaults["align_min_cosine_p1"].default_factory(), **settings.align_min_cosine_p1}  # type: ignore[misc, call-arg]
    known = [d for d in (run_dtype, server_dtype) if d in PRECISION] or ["bfloat16"]
    precision = max(known, key=PRECISION.index)
    return precision, mean[precision], p1[precision]


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_tokenization(client: Client, run: RunSpec, sequences: list[np.ndarray]) -> TokenizationCheck:
    """The samples' text, tokenized by the server and by the run's tokenizer: the first difference."""
    path = Path(run.target.model) / "tokenizer.json"
    if not path.is_file():
        return TokenizationCheck(note=f"not checked: the run's tokenizer ({path}) is not readable here")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    for s, ids in enumerate(sequences):
        text = tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)
        ours = tokenizer.encode(text, add_special_tokens=False).ids
        theirs = client.tokenize(text)
        if theirs is None:
            return TokenizationCheck(note="not checked: the server has no /v1/tokenize")
        at = first_difference(ours, theirs)
        if at is not None:
            return TokenizationCheck(
                checked=s + 1,
                differs_at=at,
                sample=s,
                run_token=_token(tokenizer, ours, at),
                server_token=_token(tokenizer, theirs, at),
            )
    return TokenizationCheck(checked=len(sequences))


def _token(tokenizer, tokens: list[int], at: int) -> str:
    return f"{tokens[at]} {tokenizer.id_to_token(tokens[at])!r}" if at < len(tokens) else "(end)"


def diagnose(
    run: RunSpec,
    server: ServerIdentity,
    points: list[PointAlignment],
    signal: SignalAlignment | None,
    tokenization: TokenizationCheck,
    min_cosine: float,
    min_top1: float,
) -> list[str]:
    """The causes the measurements point at, most likely first (empty when everything passed)."""
    causes: list[str] = []
    convention = convention_for("sglang", server.architecture or run.target.architecture)
    if tokenization.differs_at is not None:
        causes.append(
            f"tokenization differs at position {tokenization.differs_at} of sample {tokenization.sample} "
            f"(run's tokenizer: {tokenization.run_token}, server: {tokenization.server_token}): the server's "
            "tokenizer is not the run's"
        )
    failed = [p for p in points if not p.passed]
    shifted = [
        p
        for p in failed
        if p.best_point is not None and p.best_point != p.point and p.cosines[p.best_point] >= min_cosine
    ]
    if shifted:
        deltas = {p.best_point - p.point for p in shifted}  # type: ignore[operator]
        for p in shifted:
            d = p.best_point - p.point  # type: ignore[operator]
            own = "not captured by the server" if p.at_point is None else f"cos {p.at_point.mean:.4f}"
            causes.append(
                f"point {p.point} matches the server's point {p.best_point} (cos {p.cosines[p.best_point]:.5f}; "  # type: ignore[index]
                f"at its own point {own}): an off-by-{_ORDINAL.get(abs(d), abs(d))} in the layer ids"
            )
        if len(deltas) == 1 and len(shifted) == len(points):
            d = deltas.pop()
            causes.insert(
                len(causes) - len(shifted),
                (
                    f"every point matches the server's point {'+' if d > 0 else ''}{d}: the run's states were captured "
                    f"{abs(d)} layer(s) {'deeper' if d > 0 else 'shallower'} than its capture points say, or this SGLang "
                    f"{server.sglang_version} numbers {server.architecture} layers other than aerie's {convention} convention"
                ),
            )
    missing = [p for p in failed if p.at_point is None and p not in shifted]
    if missing:
        ids = neighbour_layer_ids(run.capture_points, convention, run.target.num_layers)
        close = "; ".join(
            f"point {p.point} is closest to the server's point {p.best_point} (cos {p.cosines[p.best_point]:.4f})"
            for p in missing
            if p.best_point is not None
        )
        wanted = to_engine_ids(run.capture_points, convention, run.target.num_layers)
        same_count = len(server.aux_points) == len(run.capture_points)
        shift = {b - a for a, b in zip(run.capture_points, server.aux_points)} if same_count else set()
        why = (
            f": the server's layer ids {server.aux_layer_ids} are the run's ids {wanted} off by {shift.pop():+d}"
            if len(shift) == 1 and 0 not in shift
            else ""
        )
        causes.append(
            f"the server does not capture point(s) {[p.point for p in missing]} (its ids {server.aux_layer_ids} "
            f"are points {server.aux_points}){why}{'; ' + close if close else ''}: start it with "
            f"--return-aux-hidden-state-layer-ids {' '.join(map(str, ids))} (the run's points and their neighbours)"
        )
    lower = [p for p in failed if p.at_point is not None and p not in shifted]
    if lower:
        figures = ", ".join(f"{p.point}: {p.at_point.mean:.4f} (p1 {p.at_point.p1:.4f})" for p in lower)  # type: ignore[union-attr]
        which = "every point" if len(lower) == len(points) else f"point(s) {[p.point for p in lower]}"
        weights = ""
        if server.weights_sha256 and server.weights_sha256 != run.target.weights_sha256:
            weights = (
                f"; the server's weights (sha256 {server.weights_sha256[:12]}) are not the run's target's "
                f"({run.target.weights_sha256[:12]}): re-quantized or modified weights"
            )
        top1 = f"; top-1 agreement {signal.top1_agreement:.1%}" if signal is not None else ""
        causes.append(
            f"{which} at a lower cosine, matching its own layer best ({figures}; threshold {min_cosine}){top1}: the server "
            f"computes the same layers with other numbers: a different quantization or dtype than the run (server: "
            f"quantization {server.quantization or 'none'}, dtype {server.dtype}; run: {run.dtype} states from "
            f"{run.engine.name} {run.engine.version} in {run.engine.dtype}){weights}"
        )
    if signal is not None and not signal.passed and not failed:
        causes.append(
            f"the capture points agree but the target distribution does not (top-1 agreement "
            f"{signal.top1_agreement:.1%}, threshold {min_top1:.0%}): the server's final norm or lm_head differ "
            "from the run's target"
        )
    if causes and run.engine.name == "sglang" and run.engine.version != server.sglang_version:
        causes.append(
            f"the run was extracted with SGLang {run.engine.version}, the server runs {server.sglang_version}"
        )
    return causes


def run_align(store: ObjectStore, settings: Settings, request: AlignRequest) -> AlignmentReport:
    """The stage `align`: measure, diagnose, store `runs/<run>/align/<server-id>.json`, return it."""
    started = time.monotonic()
    run = load_run(store, request.run)
    url = request.server.rstrip("/")
    k = int(run.topk or 20) if run.target_signal == "topk" else FINAL_TOPK
    client = Client(settings, url, run.target.hidden_size, k)
    try:
        try:
            client.http.get(url + "/health")
        except httpx.HTTPError as e:
            raise EngineError(f"SGLang server {url} unreachable ({type(e).__name__}: {e}): is it up? (--server)") from e
        transport = client.choose(server_info(client.http, url))
        server, _ = identify(client.http, url, run, transport)
        picks = draw_sample(store, request.run, request.samples, request.seed)
        names = ("input_ids", "aux", "final", "topk_ids", "topk_logprobs")
        opened: dict[str, ShardRows] = {}
        stored: list[dict] = []
        served: list[Served] = []
        samples: list[SampledSequence] = []
        for record, s in picks:
            rows = opened.setdefault(record.key, ShardRows(store, record.key)).sequence(s, request.max_tokens, names)
            ids = [int(t) for t in rows["input_ids"]]
            try:
                out = client.capture(ids, transport)
            except BinaryCaptureError as e:  # a sink this process cannot read: JSON for all
                if settings.engine_transport == "binary" or served:
                    raise
                client.note, transport = f"binary capture not readable here ({e}); JSON used", "json"
                server = server.model_copy(update={"transport": "json"})
                out = client.capture(ids, transport)
            stored.append(rows)
            served.append(out)
            samples.append(SampledSequence(shard=record.shard, sequence=s, tokens=len(ids)))
        tokenization = check_tokenization(client, run, [r["input_ids"] for r in stored])
    finally:
        client.close()

    precision, min_cos, min_p1 = thresholds(settings, run.dtype, server.dtype)
    points = []
    for i, p in enumerate(run.capture_points):
        means = {
            q: float(
                np.concatenate(
                    [cosines(r["aux"][:, i].astype(np.float32), o.aux[:, j]) for r, o in zip(stored, served)]
                ).mean()
            )
            for j, q in enumerate(server.aux_points)
        }
        at = None
        if p in server.aux_points:
            j = server.aux_points.index(p)
            at = cosine_stats([(r["aux"][:, i].astype(np.float32), o.aux[:, j]) for r, o in zip(stored, served)])
        best = max(means, key=means.__getitem__) if means else None
        points.append(
            PointAlignment(
                point=p,
                at_point=at,
                best_point=best,
                cosines=means,
                passed=at is not None and at.mean >= min_cos and at.p1 >= min_p1,
            )
        )
    signal = compare_signal(run, stored, served, settings, min_cos, min_p1)
    report_passed = (
        all(p.passed for p in points) and (signal is None or signal.passed) and tokenization.differs_at is None
    )
    causes = (
        [] if report_passed else diagnose(run, server, points, signal, tokenization, min_cos, settings.align_min_top1)
    )
    if client.note:
        tokenization = tokenization.model_copy(
            update={"note": "; ".join(filter(None, [tokenization.note, client.note]))}
        )
    report = AlignmentReport(
        run=run.run,
        server=server,
        run_dtype=run.dtype,
        precision=precision,
        min_cosine=min_cos,
        min_cosine_p1=min_p1,
        min_top1=settings.align_min_top1,
        seed=request.seed,
        samples=samples,
        tokens=sum(s.tokens for s in samples),
        points=points,
        signal=signal,
        tokenization=tokenization,
        passed=report_passed,
        causes=causes,
        seconds=round(time.monotonic() - started, 3),
    )
    store.put_json(layout.alignment_report(run.run, server.server_id), report)
    return report


def compare_signal(
    run: RunSpec, stored: list[dict], served: list[Served], settings: Settings, min_cos: float, min_p1: float
) -> SignalAlignment | None:
    """The target signal: final states (binary), top-1 agreement and log-prob error (both transports)."""
    if run.target_signal == "topk":
        agree = np.concatenate([r["topk_ids"][:, 0] == o.topk_ids[:, 0] for r, o in zip(stored, served)])
        k = stored[0]["topk_ids"].shape[1]
        overlap = np.concatenate(
            [[len(set(a) & set(b)) / k for a, b in zip(r["topk_ids"], o.topk_ids)] for r, o in zip(stored, served)]
        )
        errors = []
        for r, o in zip(stored, served):
            for ids, lp, sids, slp in zip(r["topk_ids"], r["topk_logprobs"], o.topk_ids, o.topk_logprobs):
                ours = dict(zip(ids.tolist(), lp.tolist()))
                errors += [abs(ours[t] - v) for t, v in zip(sids.tolist(), slp.tolist()) if t in ours]
        top1 = float(agree.mean())
        return SignalAlignment(
            signal="topk",
            top1_agreement=top1,
            topk_overlap=float(overlap.mean()),
            logprob_mae=float(np.mean(errors)) if errors else None,
            passed=top1 >= settings.align_min_top1,
        )
    final = None
    if all(o.final is not None for o in served):
        final = cosine_stats([(r["final"].astype(np.float32), o.final) for r, o in zip(stored, served)])  # type: ignore[misc]
    try:
        head = LmHead(run.target.model)
    except (FileNotFoundError, OSError, ValueError) as e:
        log.warning("align: top-1 agreement not measured: %s", e)
        return (
            None
            if final is None
            else SignalAlignment(
                signal="final",
                final=final,
                top1_agreement=float("nan"),
                passed=final.mean >= min_cos and final.p1 >= min_p1,
            )
        )
    agreed: list[np.ndarray] = []
    errs: list[np.ndarray] = []
    for r, o in zip(stored, served):
        top, logprobs = head.logits_stats(r["final"], o.topk_ids)
        agreed.append(top == o.topk_ids[:, 0])
        errs.append(np.abs(logprobs - o.topk_logprobs).ravel())
    top1 = float(np.concatenate(agreed).mean())
    passed = top1 >= settings.align_min_top1 and (final is None or (final.mean >= min_cos and final.p1 >= min_p1))
    return SignalAlignment(
        signal="final",
        final=final,
        top1_agreement=top1,
        logprob_mae=float(np.concatenate(errs).mean()),
        passed=passed,
    )


# --------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------
@click.command("align")
@click.option("--run", "run_name", required=True, help="the run whose stored states are checked")
@click.option("--server", required=True, help="SGLang in capture mode, configured as the serving deployment (URL)")
@click.option("--samples", type=int, default=8, show_default=True, help="stored sequences compared")
@click.option("--seed", type=int, default=0, show_default=True, help="which sequences (same seed, same sample)")
@click.option("--max-tokens", type=int, default=256, show_default=True, help="tokens per sequence compared")
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
def align_command(run_name: str, server: str, samples: int, seed: int, max_tokens: int, as_json: bool) -> None:
    """Measure that a run's training states are what the serving SGLang computes (exit 1 when not)."""
    from pydantic import ValidationError

    from aerie.store import open_store

    try:
        request = AlignRequest(run=run_name, server=server, samples=samples, seed=seed, max_tokens=max_tokens)
    except ValidationError as e:
        first = e.errors()[0]
        flag = f"--{str(first['loc'][0]).replace('_', '-')}"
        why = "give the serving SGLang's http(s)://host:port" if flag == "--server" else first["msg"]
        raise click.UsageError(f"{flag} {first.get('input')!r}: {why}") from None
    settings = Settings.load()
    try:
        report = run_align(open_store(settings), settings, request)
    except EngineError as e:
        raise click.ClickException(" ".join(str(e).split())) from None
    if as_json:
        click.echo(report.model_dump_json(indent=1))
    else:
        print_report(report)
    if not report.passed:
        raise SystemExit(1)


__all__ = ["AlignmentFailed", "LmHead", "align_command", "diagnose", "draw_sample", "neighbour_layer_ids", "run_align"]
