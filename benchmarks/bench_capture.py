"""Capture throughput through SGLang: binary plugin vs JSON vs bare prefill, one server, one run.

    .venv/bin/python benchmarks/bench_capture.py                        # starts a CPU server (SmolLM2, fp32)
    .venv/bin/python benchmarks/bench_capture.py --url http://host:30000 --prompts 256 --tokens 512 --concurrency 32

Passes over the same prompts against the same capture server (plugin installed and enabled,
`AERIE_SGLANG_BINARY=1`, `--disable-radix-cache`), each with `--concurrency` requests in flight,
`max_new_tokens: 1` (`--passes` picks a subset):

- bare:   no hidden states returned (what prefill alone costs through HTTP)
- json:   `return_hidden_states: true`; the client parses the floats into numpy (orjson), aux only
- binary: the aerie_capture plugin, shm sink; the client waits for, checks (sha256) and deletes
          each capture; aux **and** the final state, i.e. (K+1)/K times the JSON path's data
- binary-posted: the same requests, their captures not read while the pass is timed (claimed
          after it): the server's own ceiling, its sink hashing and writing, no client reading
- bare-batched, binary-posted-batched: bare and binary-posted with `--post-batch` prompts per
          HTTP request (SGLang's batch form of /generate), `--concurrency` prompts still in
          flight: whether SGLang's HTTP process (or this client) limits the per-prompt passes
- extract-json:   the extractor's `sglang` engine on a JSON run (`SGLangEngine.capture`): aux
                  floats + the top-20 log-probs a JSON run needs as its target signal
- extract-binary: the same engine on a binary run: aux + final state through the plugin, read
                  into a shard's arrays of the server's dtype (`capture_into`), as extraction does

Prints tokens/s per pass and the ratios binary/json and binary/bare, for raw requests and for
the engine (goal: binary >= 0.95 bare). A warm-up pass (not timed) runs first. The passes are
interleaved batch by batch (`--batch` prompts, the order rotating), `--rounds` times, so that a
neighbour's load on a shared machine hits all alike; tokens/s = all tokens / all seconds of a pass.
To tell a path's cost from noise the JSON also has: every (round, batch, pass) sample; each
ratio per batch (the same prompts back to back: median, min, max); the rate by position in the
rotation (warm-up/order effects); the server's own seconds per request (`e2e_latency`); and, for
a server started here, how SGLang batched each pass (its "Prefill batch" log lines).

On a GPU host, one call per model (issue 15 item 3): `--sglang-python` starts stock
`sglang.launch_server` (0.5.23 with its capture flags, or 0.5.17 with `AERIE_CAPTURE_LAYER_IDS`:
the plugin's compat table); an SGLang unpacked without pip (the device recipe's `/tmp/site`,
given by `--server-env PYTHONPATH=...`) gets the plugin registered from this checkout.
`--make-llama 4096,32` serves a random-weights Llama of the 8B shape (written once to
`--model-dir`, ~15 GB bf16), `--workers 1,2,4` adds extraction by 1, 2 and 4 extractor processes
against the one server (each also reports its CPU seconds and where its requests spent their
time: the post, the wait for the file, the check, the parse; summed over requests in flight):

    python3 benchmarks/bench_capture.py --sglang-python python3 --server-env PYTHONPATH=/tmp/site \
        --model SMOLLM2_DIR --prompts 256 --tokens 512 --concurrency 32 --batch 32 --rounds 2 \
        --workers 1,2,4 --log-dir $OUT/smollm2 --out $OUT/capture-smollm2.json \
        --server-arg=--attention-backend --server-arg=triton --server-arg=--sampling-backend --server-arg=pytorch
    # the 8B shape: add --make-llama 4096,32 --device cuda --model-dir /tmp/llama8b (SMOLLM2_DIR gives the tokenizer)

Each pass also records each server process's CPU seconds (and the client's) from /proc:
`cpu_per_s` is CPU-seconds per second of the pass, per process (the HTTP process, the scheduler,
the detokenizer, the plugin's writer process); a process near 1 is the likely limit.

Checked on the CPU at tiny sizes through the same path (the CPU launcher:
`--sglang-python .venv-sglang/bin/python --launcher aerie_sglang.cpu.launch --serve-dtype float32
--server-arg=--device --server-arg=cpu ...`), and run on the H200 by `gpu_capture_device.sh sglang`
(BENCHMARKS.md, sessions 8-15). In session 15's runs and before, `cpu_per_s` also counted the
gap after each pass (its settle, the log's reading): SGLang's scheduler loop polls while idle,
so its figure was inflated where samples are short. It now counts the pass alone.

Measured 2026-12-02:
- 2-core CPU shared with other jobs (load average 6-15), SmolLM2 fp32, 8 prompts, c=4, 2 rounds:
  128 tokens: bare 21.0, json 17.3, binary 22.1 tok/s (binary/json 1.28, binary/bare 1.05);
  256 tokens: bare 50.3, json 44.7, binary 40.9 tok/s (0.92, 0.81). Prefill itself takes
  seconds there and the machine's load swings +-30 % between rounds: inconclusive either way.
- Same CPU, 16 prompts x 256 tokens, c=4, interleaved in batches of 4, 2 rounds (BENCHMARKS.md):
  bare 154, json 164, binary 243, extract-json 153, extract-binary 274 tok/s; extraction
  binary/json 1.79, binary/bare 1.78: noise, as the next run shows (BENCHMARKS.md withdraws it).
- 2026-12-03, same CPU at load 8-9, 16 x 256 tokens, c=4, batches of 4, 4 rounds, bare / binary /
  extract-binary: 42.3 / 43.9 / 45.7 tok/s; per batch binary/bare median 0.96 (0.48-2.32),
  extract-binary/bare 0.97 (0.52-2.01); SGLang batched all three alike; server seconds per
  request 24.1 (bare) vs 23.1 (binary).
- `--sink-only` on an H200 host (16 cores), bf16, 512-token requests, 32 per step, 8 claiming
  threads: H=576 (K=3): 144k / 346k / 376k tok/s with 1 / 4 / 8 writer threads; H=4096:
  21k / 75k / 118k tok/s. Bare prefill there (FIGURES.md): 167-190k and 38-42k tok/s, so
  with 4 writers the sink has ~2x headroom over the GPU; one writer would cap it at ~0.5-0.8x
  (sha256 runs at 0.75 GB/s per thread on that CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np


def _server_s(response: dict) -> float:
    """The server's own end-to-end seconds for a request (`meta_info.e2e_latency`), 0 if absent."""
    return float((response.get("meta_info") or {}).get("e2e_latency") or 0.0)


def bare(client, ids: list[int]) -> tuple[int, float]:
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    r.raise_for_status()
    return len(ids), _server_s(r.json())


def as_json(client, ids: list[int]) -> int:
    import orjson

    r = client.post("/generate", json={"input_ids": ids, "return_hidden_states": True,
                                       "sampling_params": {"max_new_tokens": 1, "temperature": 0}})  # fmt: skip
    r.raise_for_status()
    body = orjson.loads(r.content)
    aux = np.asarray(body["meta_info"]["hidden_states"][0], dtype=np.float32)
    assert aux.shape[0] == len(ids)
    return len(ids), _server_s(body)


class Binary:
    """The plugin's capture by a plain client: the shm reader bound to the server's advertisement
    once (the first H200 run asked `/server_info` for every request, a scheduler round trip that
    slowed this pass), then per request: post, wait for, check (sha256) and delete the capture."""

    reader = None

    def _post(self, client, ids: list[int]) -> tuple[object, float]:
        """Post one capture request -> (its capture's descriptor, the server's seconds for it)."""
        return self._post_all(client, [ids], batched=False)[0]

    def _post_all(self, client, prompts: list[list[int]], batched: bool = True) -> list[tuple[object, float]]:
        """Post `prompts` in one request (SGLang's batch form of /generate unless `batched` is
        False and there is one) -> (descriptor, the server's seconds) for each."""
        import orjson

        from aerie_extractor.engines.sglang_binary import capture_body, descriptor_of, reader_for

        if self.reader is None:
            self.reader = reader_for(client.get("/server_info").json(), "shm")
        body = capture_body(prompts[0], "shm")
        if batched:
            body["input_ids"] = [list(ids) for ids in prompts]
        r = client.post("/generate", json=body)
        r.raise_for_status()
        out = orjson.loads(r.content) if batched else [orjson.loads(r.content)]
        assert len(out) == len(prompts), (len(out), len(prompts))
        return [(descriptor_of(one), _server_s(one)) for one in out]

    def _claim(self, descriptor, n: int) -> None:
        """Wait for, check (sha256) and delete one capture of n tokens."""
        from aerie_extractor.engines.sglang_binary import fetch_binary

        assert fetch_binary(descriptor, self.reader)["aux"].shape[0] == n

    def __call__(self, client, ids: list[int]) -> tuple[int, float]:
        descriptor, server_s = self._post(client, ids)
        self._claim(descriptor, len(ids))
        return len(ids), server_s


class Posted(Binary):
    """The plugin's capture posted, its files not read while the pass is timed: the server's own
    ceiling with its sink hashing and writing every capture and no client reading them.
    `settle()` (after the pass, outside its timing) claims the captures, so that the next pass
    finds the sink as empty as before."""

    def __init__(self):
        self.posted = []

    def __call__(self, client, ids: list[int]) -> tuple[int, float]:
        descriptor, server_s = self._post(client, ids)
        self.posted.append((descriptor, len(ids)))
        return len(ids), server_s

    def settle(self) -> None:
        for descriptor, n in self.posted:
            self._claim(descriptor, n)
        self.posted.clear()


class BareBatched:
    """bare, `post_batch` prompts per HTTP request (SGLang's batch form of `/generate`: a list of
    `input_ids`, one response per prompt): the same prompts in flight over fewer requests, so that
    SGLang's HTTP process and this client handle fewer requests a second."""

    def __init__(self, post_batch: int):
        self.post_batch = post_batch

    def __call__(self, client, batch: list[list[int]]) -> tuple[int, float]:
        r = client.post(
            "/generate", json={"input_ids": batch, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        )
        r.raise_for_status()
        out = r.json()
        assert len(out) == len(batch), (len(out), len(batch))
        return sum(map(len, batch)), sum(map(_server_s, out))


class PostedBatched(Posted):
    """binary-posted, `post_batch` prompts per HTTP request (as BareBatched): one descriptor per prompt."""

    def __init__(self, post_batch: int):
        super().__init__()
        self.post_batch = post_batch

    def __call__(self, client, batch: list[list[int]]) -> tuple[int, float]:
        posted = self._post_all(client, batch)
        self.posted += [(descriptor, len(ids)) for (descriptor, _), ids in zip(posted, batch)]
        return sum(map(len, batch)), sum(server_s for _, server_s in posted)


class EnginePass:
    """The extractor's engine on a run of `transport` (checked once, here): one call captures
    all prompts, `concurrency` requests in flight (`AERIE_ENGINE_CONCURRENCY`), as extraction
    does: a binary run ("final") into a shard's arrays of the run's dtype (`capture_into`), a JSON
    run ("topk") through `capture()`. The run's dtype is the server's (`dtype`): its captures
    then go into the rows uncast, as a run ingested for that server's dtype has them."""

    def __init__(
        self, url: str, model: Path, points: list[int], transport: str, concurrency: int, dtype: str = "float32"
    ):
        from aerie.contracts import IngestOptions, RunSpec
        from aerie.settings import Settings
        from aerie.shard import np_dtype
        from aerie.target import describe
        from aerie_extractor.engines.sglang import SGLangEngine

        settings = Settings(
            engine="sglang", engine_urls=[url], engine_concurrency=concurrency, engine_transport=transport
        )
        target = describe(model)
        signal = "final" if transport == "binary" else "topk"  # what a run over each transport stores
        run = RunSpec(run=f"bench-{transport}", dataset="bench", target=target, capture_points=points, dtype=dtype,
                      engine=SGLangEngine.spec_for(settings, target, points, dtype), target_signal=signal,
                      topk=20 if signal == "topk" else None, ingest=IngestOptions())  # fmt: skip
        assert run.engine.transport == transport, run.engine
        self.engine = SGLangEngine(settings, run)
        self.engine.check(run)
        self.K, self.H, self.dtype = len(points), target.hidden_size, np_dtype(dtype)
        self.into = self.engine.capture_into
        assert (self.into is not None) == (transport == "binary")
        self.arrays: tuple[np.ndarray, np.ndarray] | None = (
            None  # kept from call to call, as extraction's spare arrays are
        )

    def __call__(self, prompts: list[list[int]]) -> int:
        sequences = [np.asarray(ids, dtype=np.int32) for ids in prompts]
        if self.into is None:
            captured = self.engine.capture(sequences)
            assert all(c.aux.shape[0] == len(ids) for c, ids in zip(captured, prompts))
            return sum(map(len, prompts))
        offsets = np.concatenate([[0], np.cumsum([len(s) for s in sequences])])
        T = int(offsets[-1])
        if self.arrays is None or len(self.arrays[0]) < T:
            self.arrays = (np.empty((T, self.K, self.H), self.dtype), np.empty((T, self.H), self.dtype))
        self.into(sequences, offsets, self.arrays[0][:T], self.arrays[1][:T])
        return T


def run_pass(fn, url: str, prompts: list[list[int]], concurrency: int) -> tuple[int, float, float]:
    """-> (tokens, seconds, the server's summed per-request seconds; 0 for the engine) of one pass over `prompts`."""
    import httpx

    if isinstance(fn, EnginePass):
        start = time.perf_counter()
        return fn(prompts), time.perf_counter() - start, 0.0
    group = getattr(fn, "post_batch", 1)  # prompts per request: `concurrency` prompts in flight either way
    items = [prompts[i : i + group] for i in range(0, len(prompts), group)] if group > 1 else prompts
    with httpx.Client(base_url=url, timeout=600) as client, ThreadPoolExecutor(max(1, concurrency // group)) as pool:
        start = time.perf_counter()
        done = list(pool.map(lambda item: fn(client, item), items))
        return sum(n for n, _ in done), time.perf_counter() - start, sum(t for _, t in done)


class ProcessCPU:
    """CPU seconds of the server's processes (its HTTP process, scheduler, detokenizer, the
    plugin's writer process: the launched process and its descendants, from /proc) and of this
    client, between `take()`s: which process is busy during a pass. A process at ~1 CPU-second
    per second through a pass is the likely limit (SGLang's HTTP process is one asyncio loop).
    Each server process's main thread is also counted alone ("(main thread)"): the scheduler's
    loop runs there, and its process's figure also holds the plugin's threads."""

    def __init__(self, root: int | None):
        self.root, self.tick = root, os.sysconf("SC_CLK_TCK")
        self.last = self._now()

    def _cpu(self, stat: Path) -> tuple[int, float]:
        """(parent pid, CPU seconds) from a /proc stat file (a process's or one thread's)."""
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return int(fields[1]), (int(fields[11]) + int(fields[12])) / self.tick

    def _now(self) -> dict[str, float]:
        if self.root is None:
            return {"client": time.process_time()}
        stats: dict[int, tuple[int, float]] = {}  # pid -> (parent, cpu seconds)
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stats[int(entry.name)] = self._cpu(Path(entry.path, "stat"))
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
        tree, frontier = {self.root}, [self.root]
        while frontier:
            parent = frontier.pop()
            for pid, (ppid, _) in stats.items():
                if ppid == parent and pid not in tree:
                    tree.add(pid)
                    frontier.append(pid)
        out = {"client": time.process_time()}
        for pid in sorted(tree & stats.keys()):
            try:
                words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            name = " ".join(w.decode(errors="replace") for w in words[:3] if w)[:60] or str(pid)
            name = name if name not in out else f"{name} [{pid}]"
            out[name] = stats[pid][1]
            try:  # its main thread alone: SGLang's scheduler loop runs there, the plugin's writer threads beside it
                out[f"{name} (main thread)"] = self._cpu(Path(f"/proc/{pid}/task/{pid}/stat"))[1]
            except (OSError, IndexError, ValueError):
                pass
        return out

    def take(self) -> dict[str, float]:
        now = self._now()
        spent = {k: round(v - self.last.get(k, 0.0), 3) for k, v in now.items()}
        self.last = now
        return spent


_PREFILL = re.compile(r"Prefill batch.*?#new-seq: (\d+), #new-token: (\d+)")


class ServerLog:
    """The prefill batches SGLang logged (`#new-seq`, `#new-token`) since the last `take()`:
    how the scheduler batched a pass's requests (None when the server is not ours)."""

    def __init__(self, path: Path | None):
        self.path, self.offset = path, (path.stat().st_size if path else 0)

    def take(self) -> list[tuple[int, int]] | None:
        if self.path is None:
            return None
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            text = f.read().decode(errors="replace")
            self.offset = f.tell()
        return [(int(a), int(b)) for a, b in _PREFILL.findall(text)]

    def capture_stats(self) -> dict | None:
        """The plugin's last cost line in the whole log (`SinkStats.line`, logged every
        STATS_LOG_S while captures run): cumulative over every capture this server made."""
        if self.path is None:
            return None
        lines = [ln for ln in self.path.read_text(errors="replace").splitlines() if "aerie capture stats:" in ln]
        if not lines:
            return None
        line = lines[-1][lines[-1].index("aerie capture stats:") :]
        found = _STATS.search(line)
        stats = {"line": line, **({k: float(v) for k, v in found.groupdict().items()} if found else {})}
        process = [
            ln for ln in self.path.read_text(errors="replace").splitlines() if "aerie capture writer process:" in ln
        ]
        if process:  # AERIE_CAPTURE_WRITER=process: how many captures went over per group (ProcessStats.line)
            stats["writer_process"] = process[-1][process[-1].index("aerie capture writer process:") :]
        return stats


def sink_only(args) -> dict:
    """The plugin's data path without SGLang: per request, slice + clone the rows of a batch
    (on `--device`), hand them to the plugin's writer thread (pinned copy, sha256, safetensors
    to tmpfs), and a client pool reads, checks the sha256 and deletes each file. Shows whether
    the sink keeps up with a GPU's prefill rate (FIGURES.md: 167-190k tok/s at H=576)."""
    import hashlib
    import os
    import tempfile
    import threading

    import torch

    from aerie_sglang.plugin import hooks  # services/inference installed, or on PYTHONPATH
    from aerie_sglang.plugin.sink import Capture, CaptureSinkSettings, Sinks, planned_size

    dtype = getattr(torch, args.dtype)
    T, K, H, B = args.tokens, args.layers, args.hidden, args.concurrency
    shm = Path(tempfile.mkdtemp(prefix="aerie-sink-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    sinks = Sinks(CaptureSinkSettings(shm_dir=shm, max_unclaimed_bytes=1 << 40, ttl_s=900, writers=args.writers))
    sinks.start()
    aux_batch = torch.randn(B * T, K * H, device=args.device).to(dtype)
    final_batch = torch.randn(B * T, H, device=args.device).to(dtype)
    done = threading.Semaphore(0)

    def claim(capture_id: str) -> None:
        path = shm / f"{capture_id}.safetensors"
        while True:
            try:
                buf = path.read_bytes()
                break
            except FileNotFoundError:
                time.sleep(0.0005)
        n = int.from_bytes(buf[:8], "little")
        meta = json.loads(buf[8 : 8 + n])["__metadata__"]
        assert hashlib.sha256(memoryview(buf)[8 + n :]).hexdigest() == meta["sha256"]
        os.unlink(path)
        done.release()

    pool = ThreadPoolExecutor(args.client_threads)
    start = time.perf_counter()
    for step in range(args.prompts // B):
        for i in range(B):  # what around_append_prefill_hidden_states + _finish do per request
            aux = aux_batch[i * T : (i + 1) * T].clone().reshape(T, K, H)
            final = final_batch[i * T : (i + 1) * T].clone()
            ready = None
            if aux.is_cuda:
                aux, final = hooks._to_pinned(aux), hooks._to_pinned(final)
                ready = torch.cuda.Event()
                ready.record()
            cid = f"{step:06d}{i:04d}"
            tensors = {"aux": aux, "final": final}
            meta = {"aerie_capture_id": cid, "sha256": "0" * 64}
            sinks.submit(Capture(cid, "shm", tensors, meta, planned_size(tensors, meta), ready), None)
            pool.submit(claim, cid)
    for _ in range((args.prompts // B) * B):
        done.acquire()
    elapsed = time.perf_counter() - start
    pool.shutdown()
    shm.rmdir()
    tokens = (args.prompts // B) * B * T
    result = {"mode": "sink-only", "device": args.device, "writers": args.writers, "client_threads": args.client_threads, "dtype": args.dtype, "tokens": T, "layers": K, "hidden": H,
              "requests": (args.prompts // B) * B, "tokens_per_s": tokens / elapsed,
              "gb_per_s": tokens * (K + 1) * H * aux_batch.element_size() / elapsed / 1e9}  # fmt: skip
    print(json.dumps(result, indent=1))
    return result


# --- a server of our own: the CPU launcher, or stock SGLang of any supported release on a GPU ---------
def sglang_version(python: str, env: dict[str, str]) -> str:
    out = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
                         capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"{python} cannot report its sglang version: {out.stderr.strip()[-500:]}")
    return out.stdout.strip()


@contextlib.contextmanager
def gpu_server(args, model: Path, layer_ids: list[int], shm: str, log_dir: Path):
    """Stock `sglang.launch_server` from `--sglang-python` with the plugin enabled: capture flags on
    0.5.23, `AERIE_CAPTURE_LAYER_IDS` on 0.5.17 (aerie_sglang.plugin.compat)."""
    from aerie.app import launcher

    # The client's PYTHONPATH (its own transformers, pydantic, ...) stays out of the server's: SGLang
    # gets its pins from --server-env PYTHONPATH=... only (the device recipe's /tmp/site).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AERIE_", "VIRTUAL_ENV")) and k != "PYTHONPATH"}
    env.update(AERIE_SGLANG_BINARY="1", AERIE_CAPTURE_DIR=shm, SGLANG_PLUGINS="aerie_capture")
    for item in args.server_env:
        key, _, value = item.partition("=")
        env[key] = value
    version = sglang_version(args.sglang_python, env)
    flags = ["--model-path", str(model), "--dtype", args.serve_dtype or "bfloat16", "--disable-radix-cache",
             "--enable-return-hidden-states", *args.server_arg]  # fmt: skip
    if version == "0.5.23":
        flags += ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
                  "--return-aux-hidden-state-layer-ids", *map(str, layer_ids)]  # fmt: skip
    else:  # releases without capture flags: the plugin switches capture on (compat.py)
        env["AERIE_CAPTURE_LAYER_IDS"] = ",".join(map(str, layer_ids))
    seen = subprocess.run([args.sglang_python, "-c", "import importlib.metadata as m; m.version('aerie-sglang')"],
                          env=env, capture_output=True, timeout=120).returncode == 0  # fmt: skip
    if not seen:  # an SGLang unpacked without pip: register the plugin from this checkout
        from plugin_on_device import plugin_site  # beside this script, stdlib only

        site = plugin_site(log_dir / "plugin-site")
        plugin = Path(args.plugin_dir).resolve() if args.plugin_dir else REPO / "services" / "inference"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), str(plugin), env.get("PYTHONPATH")) if p)
    cmd = [args.sglang_python, "-m", args.launcher, *flags]
    with launcher.launch(
        cmd, timeout_s=args.start_timeout, log_path=log_dir / f"sglang-{time.time_ns()}.log", env=env, cwd=REPO
    ) as server:
        server.extra.update(start_s=server.start_s, sglang=version)
        yield server


def make_llama(out: Path, hidden: int, layers: int, tokenizer_from: Path, device: str, dtype: str) -> Path:
    """A Llama of `hidden` x `layers` with random weights (seeded; speed only), the tokenizer of
    `tokenizer_from` (its vocabulary size); 4096 x 32 is Llama-3-8B's shape (intermediate 14336,
    32 heads, 8 KV heads) with SmolLM2's 49,152-token vocabulary. Reused when already there."""
    import shutil

    import torch
    from safetensors.torch import save_file

    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        have = json.loads((out / "config.json").read_text())
        if (have.get("hidden_size"), have.get("num_hidden_layers")) != (hidden, layers):
            raise SystemExit(
                f"{out} holds a {have.get('hidden_size')} x {have.get('num_hidden_layers')} model, not "
                f"{hidden} x {layers}: give another --model-dir"
            )
        return out
    out.mkdir(parents=True, exist_ok=True)
    src = json.loads((tokenizer_from / "config.json").read_text())
    heads = max(1, hidden // 128)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
           "intermediate_size": 14336 if hidden == 4096 else int(hidden * 3.5) // 64 * 64 or 64,
           "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 4), "head_dim": hidden // heads,
           "vocab_size": src["vocab_size"], "bos_token_id": src.get("bos_token_id"), "eos_token_id": src.get("eos_token_id"),
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
           "hidden_act": "silu", "torch_dtype": dtype}  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, out / name)
    gen = torch.Generator(device=device).manual_seed(0)
    dt = getattr(torch, dtype)
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    inter, vocab = cfg["intermediate_size"], cfg["vocab_size"]

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dt).cpu()

    save_file({"model.embed_tokens.weight": rand(vocab, hidden), "model.norm.weight": torch.ones(hidden, dtype=dt),
               "lm_head.weight": rand(vocab, hidden)}, str(out / "model-head.safetensors"), metadata={"format": "pt"})  # fmt: skip
    for i in range(layers):
        p = f"model.layers.{i}."
        save_file({p + "self_attn.q_proj.weight": rand(hidden, hidden), p + "self_attn.k_proj.weight": rand(kv, hidden),
                   p + "self_attn.v_proj.weight": rand(kv, hidden), p + "self_attn.o_proj.weight": rand(hidden, hidden),
                   p + "mlp.gate_proj.weight": rand(inter, hidden), p + "mlp.up_proj.weight": rand(inter, hidden),
                   p + "mlp.down_proj.weight": rand(hidden, inter), p + "input_layernorm.weight": torch.ones(hidden, dtype=dt),
                   p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=dt)},
                  str(out / f"model-layer{i:03d}.safetensors"), metadata={"format": "pt"})  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg, indent=1))  # last: a folder with config.json is complete
    return out


class _Split:
    """Where an extractor process's captures spend their time: seconds of `clock` summed over
    requests (they overlap: 32 in flight) in each wrapped step of the binary path, and how many
    calls. `time.thread_time` for the CPU of synchronous steps."""

    def __init__(self, clock=time.perf_counter):
        import threading

        self.seconds, self.calls, self.lock, self.clock = {}, {}, threading.Lock(), clock

    def wrap(self, owner, name: str, label: str) -> None:
        import functools
        import inspect

        fn = getattr(owner, name)

        def add(t0: float) -> None:
            with self.lock:
                self.seconds[label] = self.seconds.get(label, 0.0) + self.clock() - t0
                self.calls[label] = self.calls.get(label, 0) + 1

        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def timed_async(*args, **kwargs):
                t0 = self.clock()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    add(t0)

            setattr(owner, name, timed_async)
            return

        @functools.wraps(fn)
        def timed_sync(*args, **kwargs):
            t0 = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                add(t0)

        setattr(owner, name, timed_sync)


def _worker(
    url: str,
    model: str,
    points: list[int],
    concurrency: int,
    prompts: list[list[int]],
    barrier,
    results,
    dtype: str = "float32",
) -> None:
    import httpx

    from aerie_extractor.engines import sglang, sglang_binary

    engine = EnginePass(url, Path(model), points, "binary", concurrency, dtype)  # checks the server, probes once
    split = _Split()  # after the check: only the timed captures count
    split.wrap(sglang.SGLangEngine, "_one", "request (post to parsed)")
    split.wrap(httpx.AsyncClient, "post", "post (to the response)")
    split.wrap(sglang.SGLangEngine, "_parse_binary", "parse (wait, read, check, place)")
    split.wrap(sglang_binary, "_wait_open", "wait for the file")
    split.wrap(sglang_binary, "_read_into", "read into the rows and check (sha256)")
    barrier.wait()
    start, cpu = time.perf_counter(), time.process_time()
    tokens = engine(prompts)
    end = time.perf_counter()
    results.put((tokens, start, end, {"process_cpu_s": time.process_time() - cpu, "wall_s": end - start,
                                      "seconds": split.seconds, "calls": split.calls}))  # fmt: skip


def worker_scaling(
    url: str,
    model: Path,
    points: list[int],
    prompts: list[list[int]],
    workers: list[int],
    concurrency: int,
    dtype: str = "float32",
) -> dict:
    """N extractor processes (each one engine, `concurrency` requests in flight: a worker as deployed)
    capture disjoint shares of the prompts at once against one server; tok/s = all tokens / the
    span from the first start to the last end."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = {}
    for n in workers:
        barrier, results = ctx.Barrier(n), ctx.Queue()
        procs = [
            ctx.Process(
                target=_worker, args=(url, str(model), points, concurrency, prompts[i::n], barrier, results, dtype)
            )
            for i in range(n)
        ]
        for proc in procs:
            proc.start()
        got = [results.get(timeout=3600) for _ in procs]
        for proc in procs:
            proc.join()
            if proc.exitcode != 0:
                raise SystemExit(f"an extractor worker exited with {proc.exitcode}")
        span = max(e for _, _, e, _ in got) - min(s for _, s, _, _ in got)
        out[str(n)] = {"tokens": sum(t for t, _, _, _ in got), "seconds": span, "tokens_per_s": sum(t for t, _, _, _ in got) / span,
                       "per_process": [x for _, _, _, x in got]}  # fmt: skip
        print(f"workers={n}: {out[str(n)]['tokens_per_s']:.1f} tok/s", flush=True)
    return out


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running capture server with the plugin (default: start one)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="prompts per interleaved batch (each pass runs each batch)")
    p.add_argument(
        "--passes",
        default=",".join(DEFAULT_PASSES),
        help=f"which passes, of {','.join(PASSES)} (default: {','.join(DEFAULT_PASSES)})",
    )
    p.add_argument(
        "--post-batch",
        type=int,
        default=8,
        help="bare-batched, binary-posted-batched: prompts per HTTP "
        "request (--concurrency prompts stay in flight: --concurrency/N requests)",
    )
    p.add_argument(
        "--json-share",
        type=float,
        default=1.0,
        help="the JSON passes (json, extract-json) run this share of "
        "each batch's prompts (at least one): on a GPU they run at ~1%% of bare, and a whole batch would take minutes",
    )
    p.add_argument("--model", help="the served model's folder (default: SmolLM2-135M-Instruct in ~/.cache/aerie)")
    p.add_argument(
        "--make-llama",
        metavar="HIDDEN,LAYERS",
        help="serve a random-weights Llama of this shape, built into --model-dir (4096,32: the 8B shape; speed only)",
    )
    p.add_argument("--model-dir", default="/tmp/aerie-bench-llama", help="--make-llama: where (reused when there)")
    p.add_argument("--points", help="capture points (default: aerie's default [2, N//2, N-3])")
    p.add_argument(
        "--workers", default="", help="also: extraction with N extractor processes against the server, e.g. 1,2,4"
    )
    p.add_argument(
        "--sglang-python",
        help="start stock `sglang.launch_server` from this Python (a GPU host; "
        "0.5.23 or 0.5.17) instead of the CPU launcher",
    )
    p.add_argument(
        "--serve-dtype", default=None, help="the server's --dtype (default float32 on the CPU launcher, bfloat16 else)"
    )
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="one more argument for launch_server (repeatable; --server-arg=--attention-backend --server-arg=triton)",
    )
    p.add_argument(
        "--server-env", action="append", default=[], help="KEY=VALUE for the server's environment (repeatable)"
    )
    p.add_argument(
        "--plugin-dir",
        help="an SGLang unpacked without pip: the folder holding the aerie_sglang package the "
        "server loads (default: this checkout's services/inference; another commit's, for a side-by-side)",
    )
    p.add_argument(
        "--launcher",
        default="sglang.launch_server",
        help="--sglang-python: the module it runs (aerie_sglang.cpu.launch checks this path on a CPU)",
    )
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", help="--sglang-python: keep the server's log here (default: a temporary folder)")
    p.add_argument("--out", help="write the figures as JSON here")
    p.add_argument("--sink-only", action="store_true", help="the plugin's sink path alone, no SGLang (see sink_only)")
    p.add_argument(
        "--device",
        default="cpu",
        help="--sink-only: where the captured rows live; --make-llama: where weights are drawn",
    )
    p.add_argument(
        "--dtype", default="bfloat16", help="--sink-only: bfloat16 | float16 | float32; --make-llama: the weights'"
    )
    p.add_argument("--layers", type=int, default=3, help="--sink-only: K captured layers")
    p.add_argument("--hidden", type=int, default=576, help="--sink-only: H")
    p.add_argument("--client-threads", type=int, default=4, help="--sink-only: claiming threads")
    p.add_argument("--writers", type=int, default=4, help="--sink-only: the plugin's writer threads")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the server we started, too
    if args.sink_only:
        result = sink_only(args)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))
        return result

    import tempfile

    import httpx

    from aerie.capture import convention_for, default_capture_points, to_engine_ids
    from aerie.target import describe, smollm2
    from aerie_extractor.engines.sglang_binary import advertised

    names = [n for n in args.passes.split(",") if n]
    unknown = [n for n in names if n not in PASSES]
    if unknown or not names:
        raise SystemExit(f"--passes: unknown {unknown}, choose from {','.join(PASSES)}")
    rng = np.random.default_rng(0)
    smol = smollm2(Path("~/.cache/aerie").expanduser()) if not args.model else None
    if args.make_llama:
        hidden, layers = (int(x) for x in args.make_llama.split(","))
        model = make_llama(
            Path(args.model_dir), hidden, layers, Path(args.model) if args.model else smol, args.device, args.dtype
        )
    else:
        model = Path(args.model) if args.model else smol
    target = describe(model)
    points = [int(x) for x in args.points.split(",")] if args.points else default_capture_points(target.num_layers)
    layer_ids = to_engine_ids(points, convention_for("sglang", target.architecture), target.num_layers)
    prompts = [rng.integers(100, min(40000, target.vocab_size), args.tokens).tolist() for _ in range(args.prompts)]
    server_info: dict = {}
    with contextlib.ExitStack() as stack:
        url, log, cpu = args.url, ServerLog(None), ProcessCPU(None)
        if url is None:
            shm = stack.enter_context(
                tempfile.TemporaryDirectory(
                    prefix="aerie-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None
                )
            )
            if args.sglang_python:
                log_dir = (
                    Path(args.log_dir)
                    if args.log_dir
                    else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="aerie-bench-log-")))
                )
                log_dir.mkdir(parents=True, exist_ok=True)
                server = stack.enter_context(gpu_server(args, model, layer_ids, shm, log_dir))
            else:  # SGLang on this CPU, from .venv-sglang (scripts/sglang_env.sh), as the tests start it
                from aerie.app import launcher

                python = REPO / ".venv-sglang" / "bin" / "python"
                if not python.is_file():
                    raise SystemExit(f"{python} is absent: run scripts/sglang_env.sh, or give --sglang-python")
                flags = ["--model-path", str(model), "--dtype", args.serve_dtype or "float32",
                         "--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
                         "--return-aux-hidden-state-layer-ids", *map(str, layer_ids), "--disable-radix-cache"]  # fmt: skip
                env = launcher.clean_env({"AERIE_SGLANG_BINARY": "1", "AERIE_CAPTURE_DIR": shm})
                log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="aerie-bench-log-")))
                server = stack.enter_context(
                    launcher.launch(
                        launcher.cpu_command(python, flags),
                        timeout_s=args.start_timeout,
                        log_path=log_dir / "sglang.log",
                        env=env,
                        cwd=REPO,
                    )
                )
            url, log, cpu = server.url, ServerLog(server.log_path), ProcessCPU(server.process.pid)
            server_info["start_s"] = server.extra.get("start_s")
        info = httpx.get(url + "/server_info", timeout=30).json()
        served_dtype = args.serve_dtype or ("bfloat16" if args.sglang_python or args.url else "float32")
        server_info.update(sglang=info.get("version"), model=str(model), hidden=target.hidden_size, layers=target.num_layers,
                           points=points, layer_ids=layer_ids)  # fmt: skip
        if advertised(info) is None:
            raise SystemExit(
                f"{url} does not advertise the aerie_capture plugin: install aerie-sglang in its environment and set AERIE_SGLANG_BINARY=1"
            )
        makers = {"bare": lambda: bare, "json": lambda: as_json, "binary": Binary, "binary-posted": Posted,
                  "bare-batched": lambda: BareBatched(args.post_batch), "binary-posted-batched": lambda: PostedBatched(args.post_batch),
                  "extract-json": lambda: EnginePass(url, model, points, "json", args.concurrency, served_dtype),
                  "extract-binary": lambda: EnginePass(url, model, points, "binary", args.concurrency, served_dtype)}  # fmt: skip
        passes = {name: makers[name]() for name in names}

        def share(name: str, n: int) -> int:  # prompts of n a pass runs (the JSON passes: --json-share)
            return n if "json" not in name else max(1, int(n * args.json_share))

        for name, fn in passes.items():  # warm-up
            run_pass(fn, url, prompts[: share(name, args.concurrency)], args.concurrency)
            if hasattr(fn, "settle"):
                fn.settle()
        log.take()
        cpu.take()
        cpu_s: dict[str, dict[str, float]] = {name: {} for name in names}  # pass -> process -> CPU seconds
        # Interleaved batch by batch (`--batch` prompts, pass order rotating): a neighbour's load
        # on a shared machine falls on every pass alike, not on whichever pass ran during it.
        tokens = {name: 0 for name in names}
        seconds = {name: 0.0 for name in names}
        server_s = {name: 0.0 for name in names}
        rates: dict[str, list[float]] = {name: [] for name in names}
        samples: list[dict] = []  # one per (round, batch, pass), in the order they ran
        batching: dict[str, list[tuple[int, int]]] = {name: [] for name in names}
        for r in range(args.rounds):
            got = {name: [0, 0.0] for name in names}
            for b, start in enumerate(range(0, len(prompts), args.batch)):
                for pos, name in enumerate(names[b % len(names) :] + names[: b % len(names)]):
                    cpu.take()  # the gap since the last pass (its settle, the log's reading) is no pass's
                    n, t, srv = run_pass(
                        passes[name], url, prompts[start : start + share(name, args.batch)], args.concurrency
                    )
                    spent = (
                        cpu.take()
                    )  # the pass alone: SGLang's scheduler loop polls while idle, so a gap would count too
                    if hasattr(passes[name], "settle"):  # outside the pass's timing
                        passes[name].settle()
                    got[name][0] += n
                    got[name][1] += t
                    server_s[name] += srv
                    batches = log.take()
                    if batches is not None:
                        batching[name] += batches
                    for proc, used in spent.items():
                        cpu_s[name][proc] = cpu_s[name].get(proc, 0.0) + used
                    samples.append({"round": r, "batch": b, "position": pos, "pass": name, "tokens": n, "seconds": t,
                                    "server_s": srv, "prefill_batches": batches, "cpu_s": spent})  # fmt: skip
            for name, (n, t) in got.items():
                tokens[name] += n
                seconds[name] += t
                rates[name].append(n / t)
            if args.out:  # what is measured so far, for a call stopped by its time limit
                Path(args.out).write_text(json.dumps({"partial": True, "rounds_done": r + 1, "server": server_info, "samples": samples,
                                                      "tokens_per_s": {k: tokens[k] / seconds[k] for k in names}}, indent=1))  # fmt: skip
            print(f"round {r}: " + ", ".join(f"{k} {got[k][0] / got[k][1]:.1f} tok/s" for k in names), flush=True)
        if args.workers:
            before = run_pass(bare, url, prompts, args.concurrency) if "bare" in names else None
            cpu.take()
            scaling = worker_scaling(
                url, model, points, prompts, [int(x) for x in args.workers.split(",")], args.concurrency, served_dtype
            )
            scaling["server_cpu_s"] = {k: v for k, v in cpu.take().items() if k != "client"}  # every worker count's run
            if before is not None:  # bare right before and right after: the server's speed around the extraction
                scaling["bare_before"] = {
                    "tokens": before[0],
                    "seconds": before[1],
                    "tokens_per_s": before[0] / before[1],
                }
                n, t, _ = run_pass(bare, url, prompts, args.concurrency)
                scaling["bare_after"] = {"tokens": n, "seconds": t, "tokens_per_s": n / t}
                print(f"bare after the workers: {n / t:.1f} tok/s", flush=True)
        if log.path is not None:
            time.sleep(STATS_WAIT_S)  # the plugin's cost line of the last captures
            server_info["capture_stats"] = log.capture_stats()
    tps = {name: tokens[name] / seconds[name] for name in names}
    result = {
        "prompts": args.prompts, "tokens": args.tokens, "concurrency": args.concurrency, "rounds": args.rounds,
        "batch": args.batch, "json_share": args.json_share, "server": server_info, "tokens_per_s": tps, "per_round": rates,
        "command": " ".join(sys.argv),
    }  # fmt: skip
    for a, b in (("binary", "json"), ("binary", "bare"), ("binary-posted", "bare"), ("extract-binary", "extract-json"), ("extract-binary", "bare"),
                 ("json", "bare"), ("binary-posted-batched", "bare-batched"), ("bare-batched", "bare")):  # fmt: skip
        if a in tps and b in tps:
            key = f"{a}_over_{b}".replace("-", "_")
            result[key] = tps[a] / tps[b]
            # the same prompts, run back to back: one ratio per (round, batch)
            per = {(s["round"], s["batch"]): {} for s in samples}
            for s in samples:
                per[(s["round"], s["batch"])][s["pass"]] = s["tokens"] / s["seconds"]
            result[key + "_per_batch"] = _spread([v[a] / v[b] for v in per.values()])
    by_pos: dict[int, list[float]] = {}
    for s in samples:
        by_pos.setdefault(s["position"], []).append(s["tokens"] / s["seconds"] / tps[s["pass"]])
    result["rate_by_position"] = {str(k): statistics.mean(v) for k, v in sorted(by_pos.items())}  # 1 = the pass's mean
    # each process's CPU-seconds per second of the pass (from right before to right after it: its settle not counted)
    result["cpu_per_s"] = {
        name: {proc: round(v / seconds[name], 3) for proc, v in procs.items()} for name, procs in cpu_s.items()
    }
    result["server_seconds_per_request"] = {
        name: server_s[name] / (tokens[name] / args.tokens) for name in names if server_s[name]
    }
    result["prefill_batches"] = {name: {"count": len(v), "seqs_per_batch": statistics.mean(a for a, _ in v) if v else None,
                                        "tokens_per_batch": statistics.mean(t for _, t in v) if v else None}
                                 for name, v in batching.items() if v}  # fmt: skip
    if args.workers:
        result["workers"] = scaling
    result["samples"] = samples
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


STATS_WAIT_S = 3.0  # longer than the plugin's STATS_LOG_S
_F = r"\d+(?:\.\d+)?"
_STATS = re.compile(  # SinkStats.line: tests/inference/test_plugin_capture.py holds its format
    rf"(?P<captures>\d+) captures, (?P<gb_written>{_F}) GB written; scheduler thread (?P<scheduler_ms_per_capture>{_F}) "
    rf"ms/capture, (?P<scheduler_cpu_ms>{_F}) on its CPU \(admission (?P<admission_ms>{_F}), rows (?P<rows_ms>{_F}): "
    rf"kept (?P<rows_kept_ms>{_F}), to host (?P<rows_to_host_ms>{_F})\); writers (?P<writers_ms_per_capture>{_F}) "
    rf"ms/capture, (?P<writers_cpu_ms>{_F}) on their CPU \(device copy (?P<device_copy_ms>{_F}), sha256 "
    rf"(?P<sha256_ms>{_F}), write (?P<write_ms>{_F})\); (?P<shm_listings>\d+) listings of the shm directory, "
    rf"(?P<ms_per_listing>{_F}) ms each"
)
PASSES = (
    "bare",
    "json",
    "binary",
    "binary-posted",
    "extract-json",
    "extract-binary",
    "bare-batched",
    "binary-posted-batched",
)
DEFAULT_PASSES = PASSES[:6]  # the batched passes when asked for
REPO = Path(__file__).resolve().parents[1]

if __name__ == "__main__":
    main()
