"""The extractor's SGLang client alone: CPU per binary capture against a stub server that answers
at once, this checkout's client beside an earlier commit's, in one run.

    .venv/bin/python benchmarks/bench_client.py                     # SmolLM2's shape, then the 8B shape
    .venv/bin/python benchmarks/bench_client.py --shapes 576x3 --requests 1024 --rounds 5 --out x.json

Why: on the H200 (BENCHMARKS.md, sessions 8 and 9) one extractor process spent 10-12 ms of CPU per
512-token SmolLM2 capture (2.4 MB) and 45-60 ms per 8B-shaped one (16.8 MB), so one process could
not keep up with one server. Here nothing else costs: a stub server process (asyncio, kept-alive
HTTP/1.1) answers each `/generate` as aerie's plugin does, with a capture descriptor, after writing
the capture file (safetensors, the plugin's header metadata, the sha256 of the tensor bytes) into
a private shm directory; its tensors are the same bytes every time, so it hashes nothing per
request. The client is the extractor's own `SGLangEngine` request path (post, wait for the file,
read, check, claim, place) with `--concurrency` requests in flight; `check()` is skipped (it
needs a real server: tests/inference/test_plugin_capture.py runs it).

Variants, each in its own process, interleaved round after round against the same stub:
- before: `--before`'s client (`git archive`), as installed before (no sniffio: httpcore then
  tries to import it on every lock it makes; hidden here by a finder that searches sys.path as
  a real miss does, then fails), then the same with sniffio;
- now: `capture()` (the per-capture arrays, as the JSON and top-k paths return them), and
  `capture_into` (what extraction of a binary "final" run uses: read into the shard's rows).

Per variant: the client process's CPU milliseconds per capture (all its threads,
`time.process_time`; the median of the rounds), its wall rate (meaningless on a busy machine),
and the CPU of the steps timed in their own thread (`time.thread_time`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_capture import _Split  # noqa: E402 (beside this script)

STUB = r"""
import asyncio, hashlib, json, os, struct, sys, uuid
import orjson
shm, port, T, K, H = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:6])
aux = os.urandom(T * K * H * 2)
final = os.urandom(T * H * 2)
sha = hashlib.sha256(aux + final).hexdigest()
layer_ids = list(range(1, 3 * K, 3))

def header(cid: str) -> bytes:
    meta = {"aerie_capture_id": cid, "format": "aerie-capture-v1", "layer_ids": ",".join(map(str, layer_ids)),
            "sglang": "stub", "rid": cid, "sha256": sha}
    h = {"__metadata__": meta, "aux": {"dtype": "BF16", "shape": [T, K, H], "data_offsets": [0, len(aux)]},
         "final": {"dtype": "BF16", "shape": [T, H], "data_offsets": [len(aux), len(aux) + len(final)]}}
    b = json.dumps(h, separators=(",", ":")).encode()
    b += b" " * (-len(b) % 8)
    return struct.pack("<Q", len(b)) + b

class Stub(asyncio.Protocol):
    def connection_made(self, transport):
        self.t, self.buf = transport, b""
    def data_received(self, data):
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].decode("latin-1").lower()
            n = int(head.split("content-length:")[1].split("\r\n")[0]) if "content-length:" in head else 0
            if len(self.buf) < end + 4 + n:
                return
            body, self.buf = self.buf[end + 4:end + 4 + n], self.buf[end + 4 + n:]
            self.answer(head.split(" ")[1], body)
    def answer(self, path, body):
        if path != "/generate":
            out = b"{}"
        else:
            req = orjson.loads(body)
            cid = uuid.uuid4().hex
            final_path = os.path.join(shm, cid + ".safetensors")
            partial = os.path.join(shm, ".partial-" + cid)
            hb = header(cid)
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.writev(fd, [hb, aux, final])
            os.close(fd)
            os.replace(partial, final_path)
            descriptor = {"v": 1, "id": cid, "sink": "shm", "format": "safetensors", "nbytes": len(hb) + len(aux) + len(final),
                          "rows": T, "layer_ids": layer_ids, "path": final_path,
                          "tensors": {"aux": {"shape": [T, K, H], "dtype": "bfloat16"}, "final": {"shape": [T, H], "dtype": "bfloat16"}}}
            out = orjson.dumps({"text": " the", "output_ids": [279], "meta_info": {
                "id": cid, "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": len(req["input_ids"]),
                "weight_version": "default", "completion_tokens": 1, "cached_tokens": 0, "e2e_latency": 0.01,
                "aerie_capture": descriptor}})
        self.t.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(out) + out)

async def main():
    server = await asyncio.get_running_loop().create_server(Stub, "127.0.0.1", port)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()
asyncio.run(main())
"""


class _Hidden:
    """A meta-path finder that makes `import NAME` fail as if NAME were not installed: it first
    searches sys.path for a name that is nowhere, as a real miss does, then raises."""

    def __init__(self, names: set[str]):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            from importlib.machinery import PathFinder

            assert PathFinder.find_spec(f"{name}_not_installed_anywhere") is None
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(args) -> None:
    """One variant in this process (its own sys.path root): --requests captures, twice, the
    second timed; one JSON line on stdout."""
    root = Path(args.root)
    sys.path[:0] = [str(root / "shared"), str(root / "services" / "extractor")]
    if args.hide:
        sys.meta_path.insert(0, _Hidden(set(args.hide.split(","))))
    import numpy as np

    from aerie.contracts import EngineSpec, RunSpec, TargetSpec
    from aerie.settings import Settings
    from aerie_extractor.engines import sglang_binary
    from aerie_extractor.engines.sglang import SGLangEngine
    from aerie_extractor.engines.sglang_binary import CaptureReader, check_capture_dir

    assert Path(sys.modules["aerie_extractor"].__file__).is_relative_to(root), "the variant's own code"
    T, K, H, shm = args.tokens, args.k, args.h, Path(args.shm)
    layer_ids = list(range(1, 3 * K, 3))
    settings = Settings(
        engine="sglang", engine_urls=[args.url], engine_concurrency=args.concurrency, engine_shm_dir=shm
    )
    target = TargetSpec(model="stub", architecture="LlamaForCausalLM", num_layers=3 * K + 1, hidden_size=H,
                        vocab_size=49152, weights_sha256="0" * 64, tokenizer_sha256="0" * 64)  # fmt: skip
    engine = SGLangEngine.__new__(SGLangEngine)  # check() needs a real server: the stub answers /generate only
    engine.settings = settings
    engine.run = RunSpec.model_construct(run="bench", target=target, capture_points=list(range(K)), dtype="bfloat16",
                                         target_signal="final", engine=EngineSpec.model_construct(layer_ids=layer_ids))  # fmt: skip
    engine.urls, engine.layer_ids, engine.max_input, engine._outages = settings.engine_urls, layer_ids, {}, {}
    engine.transport, engine._checked, engine._tls = "binary", True, None
    engine.readers = {engine.urls[0]: CaptureReader(sink="shm", shm_dir=check_capture_dir(shm), server_dir=str(shm))}
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 49152, T, dtype=np.int64) for _ in range(args.requests)]
    offsets = np.arange(len(seqs) + 1, dtype=np.int64) * T
    bf16 = np.dtype("bfloat16") if hasattr(np, "bfloat16") else __import__("ml_dtypes").bfloat16
    aux, final = np.empty((len(seqs) * T, K, H), bf16), np.empty((len(seqs) * T, H), bf16)

    def once():
        if args.mode == "into":
            engine.capture_into(seqs, offsets, aux, final)
            return aux[:T]
        return engine.capture(seqs)[0].aux

    once()  # warm-up: connections, threads, the shard's pages
    steps = _Split(clock=time.thread_time)  # CPU of each step, in the thread that runs it
    for owner, name, label in ((sglang_binary, "_wait_shm", "read the file"), (sglang_binary, "_check", "check (header, sha256)"),
                               (sglang_binary, "_read_into", "read into the shard and check"),
                               (SGLangEngine, "_parse_binary", "parse (all of it)")):  # fmt: skip
        if hasattr(owner, name):  # the before commit has no _read_into
            steps.wrap(owner, name, label)
    wall, cpu = time.perf_counter(), time.process_time()
    first = once()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert first.shape == (T, K, H) and not any(shm.iterdir())
    n = len(seqs)
    print(json.dumps({"cpu_ms_per_capture": 1000 * cpu / n, "captures_per_s": n / wall, "wall_s": wall, "process_cpu_s": cpu,
                      "cpu_ms_per_capture_by_step": {k: 1000 * v / n for k, v in steps.seconds.items()}}), flush=True)  # fmt: skip


def one_shape(args, variants: list[dict], T: int, K: int, H: int) -> dict:
    import statistics
    import subprocess

    shm = Path(tempfile.mkdtemp(prefix="aerie-bench-client-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    os.chmod(shm, 0o700)
    port = free_port()
    stub = subprocess.Popen(
        [sys.executable, "-c", STUB, str(shm), str(port), str(T), str(K), str(H)], stdout=subprocess.PIPE, text=True
    )
    samples: dict[str, list[dict]] = {v["name"]: [] for v in variants}
    try:
        assert stub.stdout.readline().strip() == "ready"
        for r in range(args.rounds):  # the variants interleaved, round after round
            for v in variants:
                cmd = [sys.executable, __file__, "--worker", "--root", v["root"], "--mode", v["mode"], "--hide", v.get("hide", ""),
                       "--url", f"http://127.0.0.1:{port}", "--shm", str(shm), "--tokens", str(T), "--k", str(K), "--h", str(H),
                       "--requests", str(args.requests), "--concurrency", str(args.concurrency)]  # fmt: skip
                out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
                if out.returncode != 0:
                    raise SystemExit(f"variant {v['name']!r} failed:\n{out.stderr[-3000:]}")
                samples[v["name"]].append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        stub.kill()
        stub.wait()
        shutil.rmtree(shm, ignore_errors=True)
    rows = {}
    for name, got in samples.items():
        cpu = statistics.median(x["cpu_ms_per_capture"] for x in got)
        steps = {
            k: statistics.median(x["cpu_ms_per_capture_by_step"].get(k, 0.0) for x in got)
            for k in got[0]["cpu_ms_per_capture_by_step"]
        }
        rows[name] = {"cpu_ms_per_capture": cpu, "captures_per_s": statistics.median(x["captures_per_s"] for x in got),
                      "cpu_ms_per_capture_by_step": steps, "samples": got}  # fmt: skip
    base = rows[variants[0]["name"]]["cpu_ms_per_capture"]
    print(
        f"\nT={T} K={K} H={H}: {(T * K * H + T * H) * 2 / 1e6:.1f} MB per capture, {args.requests} captures, "
        f"{args.concurrency} in flight, median of {args.rounds} rounds"
    )
    print(f"{'variant':58s} {'CPU ms/capture':>14s} {'÷ first':>8s} {'captures/s':>10s}  CPU ms by step")
    for name, row in rows.items():
        row["ratio_to_first"] = row["cpu_ms_per_capture"] / base
        print(
            f"{name:58s} {row['cpu_ms_per_capture']:14.2f} {row['ratio_to_first']:8.2f} {row['captures_per_s']:10.0f}  "
            f"{json.dumps({k: round(v, 2) for k, v in row['cpu_ms_per_capture_by_step'].items()})}",
            flush=True,
        )
    return {"T": T, "K": K, "H": H, "capture_mb": (T * K * H + T * H) * 2 / 1e6, "requests": args.requests,
            "concurrency": args.concurrency, "rounds": args.rounds, "variants": rows}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--shapes", default="576x3,4096x3", help="HxK per shape, comma-separated (SmolLM2's and the 8B shape)"
    )
    p.add_argument("--tokens", type=int, default=512, help="tokens per capture")
    p.add_argument("--requests", type=int, default=512, help="captures per timed call")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--before", default="a1f16a5", help="the commit whose client is the first row (git archive of it)")
    p.add_argument("--out", help="write the figures as JSON here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--root", "--mode", "--hide", "--url", "--shm"):
        p.add_argument(name, default="", help=argparse.SUPPRESS)
    p.add_argument("--k", type=int, help=argparse.SUPPRESS)
    p.add_argument("--h", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return {}
    import subprocess

    with tempfile.TemporaryDirectory(prefix="aerie-bench-client-before-") as before:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", args.before, "shared", "services/extractor"],
            capture_output=True,
            check=True,
        )
        subprocess.run(["tar", "x", "-C", before], input=archive.stdout, check=True)
        variants = [
            {
                "name": f"before ({args.before}): one pool, bytes per capture, no sniffio",
                "root": before,
                "mode": "capture",
                "hide": "sniffio",
            },
            {"name": f"before ({args.before}), with sniffio", "root": before, "mode": "capture"},
            {"name": "now: capture() (a client per request in flight)", "root": str(REPO), "mode": "capture"},
            {"name": "now: capture_into (read into the shard's rows)", "root": str(REPO), "mode": "into"},
        ]
        results = []
        for shape in [s for s in args.shapes.split(",") if s]:
            H, K = map(int, shape.split("x"))
            results.append(one_shape(args, variants, args.tokens, K, H))
    out = {"shapes": results, "python": platform.python_version(), "cpu_count": os.cpu_count(), "before": args.before,
           "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])}  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
