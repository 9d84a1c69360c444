"""aerie's SGLang capture plugin on a real SGLang with a GPU (0.5.17 on the lent H200), checked
against HF transformers on the same weights.

The plugin's CPU tests run 0.5.23 for real and 0.5.17 only from its source; this script is the
0.5.17 proof. It starts `sglang.launch_server` with the plugin enabled the way the compose
`capture` profile does (AERIE_SGLANG_BINARY=1, capture layer ids, an shm sink directory,
--enable-return-hidden-states --disable-radix-cache; 0.5.17 takes the ids from
AERIE_CAPTURE_LAYER_IDS), asks for binary captures and reads them with the extractor's own reader
(`aerie_extractor.engines.sglang_binary`: advertisement, descriptor, wait, sha256, claim). Every
capture point (aux rows per layer id, final post-norm rows) of every token is compared with HF
transformers (the device's own) in bf16 and fp32; HF bf16 vs fp32 is the noise floor.

Per server: prompts one at a time (7 to 1500 tokens; 1500 spans three 512-token prefill chunks),
then 24 captures mixed with 8 JSON-hidden-state and 8 plain requests all in flight at once
(several prefill batches back to back under overlap scheduling and the prefill CUDA graph,
SGLang 0.5.17's defaults), refusals (max_new_tokens 2, an unconfigured sink, no
return_hidden_states), and what is left in the shm directory. `--server NAME=DIR` may be given
more than once: DIR holds the `aerie_sglang` package to load (default: this checkout's).

Device side (see the device recipe in BENCHMARKS.md):
    python3 benchmarks/plugin_on_device.py make-model --tokenizer /tmp/tokenizer --out /tmp/aerie-model
    python3 benchmarks/plugin_on_device.py run --model /tmp/aerie-model --site /tmp/site --out $OUT
The client needs torch + transformers (the device image's) and the project's pydantic/ml_dtypes
stack on PYTHONPATH; the servers get `--site` (SGLang and its pins) on theirs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

LAYER_IDS = [1, 5, 9]
CFG = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=12,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
)
SERVER_FLAGS = [
    "--enable-return-hidden-states",
    "--disable-radix-cache",
    "--attention-backend",
    "triton",
    "--sampling-backend",
    "pytorch",
    "--mem-fraction-static",
    "0.2",
    "--chunked-prefill-size",
    "512",
    "--cuda-graph-max-bs-decode",
    "8",
]
OK_COS = 0.999  # per token, against HF fp32; a row from another token or batch is far below


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def make_model(args) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    sizes = {**CFG, "intermediate_size": args.intermediate_size or CFG["intermediate_size"]}
    cfg = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **sizes)
    torch.manual_seed(1234)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    tok.save_pretrained(args.out)
    log("model", args.out, sorted(os.listdir(args.out)))


class Reference:
    """HF transformers on the same weights: every layer's output and the final (post-norm) state."""

    def __init__(self, model: str):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.models = {
            name: AutoModelForCausalLM.from_pretrained(model, dtype=dt).cuda().eval()
            for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32))
        }
        self.cache: dict[tuple, dict] = {}

    def of(self, ids: list[int]) -> dict:
        key = tuple(ids)
        if key not in self.cache:
            torch = self.torch
            out = {}
            with torch.no_grad():
                for name, m in self.models.items():
                    base = m.model(input_ids=torch.tensor([ids], device="cuda"), output_hidden_states=True)
                    final = base.last_hidden_state[0]
                    out[name] = {
                        "aux": [base.hidden_states[i + 1][0].float().cpu().numpy() for i in LAYER_IDS],
                        "final": final.float().cpu().numpy(),
                        "next": int(m.lm_head(final[-1:]).argmax()),
                    }
            self.cache[key] = out
        return self.cache[key]


def compare(got, ref) -> dict:
    import numpy as np

    got, ref = np.asarray(got, dtype=np.float32), np.asarray(ref, dtype=np.float32)
    if got.shape != ref.shape:
        return {"shape": list(got.shape), "ref_shape": list(ref.shape), "cos_min": -1.0}
    cos = (got * ref).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(ref, axis=-1) + 1e-12)
    return {
        "cos_min": round(float(cos.min()), 6),
        "cos_mean": round(float(cos.mean()), 6),
        "max_abs_diff": round(float(np.abs(got - ref).max()), 5),
        "ref_max_abs": round(float(np.abs(ref).max()), 3),
    }


def points(aux, final, ref: dict) -> dict:
    """Per capture point, against HF bf16 and fp32 (the verdict uses fp32)."""
    out = {}
    for dt in ("bf16", "fp32"):
        for j, lid in enumerate(LAYER_IDS):
            out.setdefault(f"aux_layer{lid}", {})[dt] = compare(aux[:, j], ref[dt]["aux"][j])
        out.setdefault("final", {})[dt] = compare(final, ref[dt]["final"])
    return out


def worst(entries: list[dict]) -> dict:
    """The lowest per-token cosine (vs fp32) of each capture point over many requests."""
    agg: dict[str, float] = {}
    for e in entries:
        for name, by in e.get("points", {}).items():
            agg[name] = min(agg.get(name, 1.0), by["fp32"]["cos_min"])
    return agg


def post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict | str, float]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), time.perf_counter() - t
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")[:600], time.perf_counter() - t


def plugin_site(folder: Path) -> Path:
    """A dist-info registering the plugin's entry point, for an SGLang unpacked without pip."""
    project = tomllib.loads((REPO / "services" / "inference" / "pyproject.toml").read_text())["project"]
    info = folder / f"aerie_sglang-{project['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    eps = "".join(f"{k} = {v}\n" for k, v in project["entry-points"]["sglang.srt.plugins"].items())
    (info / "entry_points.txt").write_text(f"[sglang.srt.plugins]\n{eps}")
    return folder


class Server:
    def __init__(self, name: str, plugin_dir: Path, args, port: int):
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.shm = f"/dev/shm/aerie-capture-{name}"
        shutil.rmtree(self.shm, ignore_errors=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("AERIE_") and k != "PYTHONPATH"}
        site = plugin_site(Path(f"/tmp/aerie-plugin-site-{name}"))
        env.update(
            PYTHONPATH=os.pathsep.join([str(site), str(plugin_dir), args.site]),
            AERIE_SGLANG_BINARY="1",
            AERIE_CAPTURE_LAYER_IDS=",".join(map(str, LAYER_IDS)),
            AERIE_CAPTURE_DIR=self.shm,
            SGLANG_PLUGINS="aerie_capture",
            TVM_FFI_CACHE_DIR="/tmp/tvm-ffi-cache",
        )
        self.cmd = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            args.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *SERVER_FLAGS,
        ]
        self.log_path = Path(args.out) / f"server_{name}.log"
        self.log = open(self.log_path, "w")
        self.log.write(f"PLUGIN: {plugin_dir}\nCMD: {' '.join(self.cmd)}\n")
        self.log.flush()
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd="/tmp", start_new_session=True
        )

    def wait(self, timeout: float) -> float | None:
        while time.monotonic() - self.t0 < timeout and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return round(time.monotonic() - self.t0, 1)
            except Exception:
                pass
            time.sleep(1)
        return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()

    def tail(self, n: int = 40) -> str:
        return "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-n:])


def capture_one(srv: Server, reader, ref: Reference, ids: list[int]) -> dict:
    from aerie_extractor.engines import sglang_binary as sb

    status, resp, dt = post(srv.url + "/generate", sb.capture_body(ids, "shm"))
    e = {"tokens": len(ids), "latency_s": round(dt, 4)}
    if status != 200:
        return {**e, "error": f"HTTP {status}: {resp}"}
    try:
        desc = sb.descriptor_of(resp)
        arrays = sb.fetch_binary(desc, reader)
    except Exception as ex:
        return {**e, "error": f"{type(ex).__name__}: {ex}", "meta_keys": sorted(resp.get("meta_info", {}))}
    aux, final = arrays["aux"], arrays["final"]
    r = ref.of(ids)
    e.update(
        rows=int(desc.rows),
        dtype=str(aux.dtype),
        layer_ids=desc.layer_ids,
        json_hidden_states="hidden_states" in resp["meta_info"] and bool(resp["meta_info"]["hidden_states"]),
        points=points(aux, final, r),
        token=resp.get("output_ids", [None])[0],
        hf_next=r["bf16"]["next"],
    )
    return e


def json_one(srv: Server, ref: Reference, ids: list[int], hidden: bool) -> dict:
    """A request without the capture field: stock SGLang's answer, with no aerie_capture in it."""
    import numpy as np

    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    if hidden:
        body["return_hidden_states"] = True
    status, resp, dt = post(srv.url + "/generate", body)
    e = {"tokens": len(ids), "hidden": hidden, "latency_s": round(dt, 4)}
    if status != 200:
        return {**e, "error": f"HTTP {status}: {resp}"}
    meta = resp["meta_info"]
    r = ref.of(ids)
    e.update(
        has_aerie_capture="aerie_capture" in meta, token=resp.get("output_ids", [None])[0], hf_next=r["bf16"]["next"]
    )
    if hidden:
        parts = meta.get("hidden_states") or []
        if not parts:
            return {**e, "error": "no hidden_states in a return_hidden_states response"}
        rows = np.asarray(parts[0], dtype=np.float32).reshape(-1, len(LAYER_IDS), CFG["hidden_size"])
        n = rows.shape[0]  # stock 0.5.17 returns only a chunked prompt's last prefill chunk
        e["rows"] = n
        e["points"] = {
            f"aux_layer{lid}": {dt: compare(rows[:, j], r[dt]["aux"][j][-n:]) for dt in ("bf16", "fp32")}
            for j, lid in enumerate(LAYER_IDS)
        }
    return e


def refusals(srv: Server) -> dict:
    from aerie_extractor.engines import sglang_binary as sb

    out = {}
    ids = list(range(200, 240))
    cases = {
        "max_new_tokens_2": lambda b: b["sampling_params"].update(max_new_tokens=2),
        "sink_s3_unconfigured": lambda b: b["sampling_params"]["custom_params"].update(aerie_capture="s3"),
        "no_return_hidden_states": lambda b: b.pop("return_hidden_states"),
    }
    for name, edit in cases.items():
        body = sb.capture_body(ids, "shm")
        edit(body)
        status, resp, _ = post(srv.url + "/generate", body)
        out[name] = {"status": status, "body": resp if isinstance(resp, str) else json.dumps(resp)[:400]}
    return out


def check_server(srv: Server, ref: Reference, rng: random.Random, vocab: int) -> dict:
    from aerie_extractor.engines import sglang_binary as sb

    with urllib.request.urlopen(srv.url + "/server_info", timeout=10) as r:
        info = json.loads(r.read())
    res = {
        "advertised": info.get("aerie_capture"),
        "enable_return_aux_hidden_states": info.get("enable_return_aux_hidden_states"),
        "return_aux_hidden_state_layer_ids": info.get("return_aux_hidden_state_layer_ids"),
        "sglang_version": info.get("version"),
    }
    reader = sb.reader_for(info, "shm", timeout_s=30)

    def rand_ids(n):
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    seq = {"short_7": rand_ids(7), "rand_64": rand_ids(64), "rand_512": rand_ids(512), "rand_1500": rand_ids(1500)}
    res["sequential"] = {name: capture_one(srv, reader, ref, ids) for name, ids in seq.items()}
    log(srv.name, "sequential", json.dumps(worst(list(res["sequential"].values()))))

    caps = [rand_ids(rng.randrange(40, 700)) for _ in range(24)]
    jsons = [rand_ids(rng.randrange(40, 480)) for _ in range(8)]
    plains = [rand_ids(rng.randrange(40, 480)) for _ in range(8)]
    for ids in caps + jsons + plains:  # references first: the requests then go out together
        ref.of(ids)
    jobs = [("capture", ids) for ids in caps] + [("json", ids) for ids in jsons] + [("plain", ids) for ids in plains]
    rng.shuffle(jobs)
    t = time.perf_counter()
    with ThreadPoolExecutor(len(jobs)) as pool:
        done = list(
            pool.map(
                lambda j: (
                    j[0],
                    capture_one(srv, reader, ref, j[1])
                    if j[0] == "capture"
                    else json_one(srv, ref, j[1], hidden=j[0] == "json"),
                ),
                jobs,
            )
        )
    conc = {
        "wall_s": round(time.perf_counter() - t, 3),
        "n": {k: sum(1 for j in jobs if j[0] == k) for k in ("capture", "json", "plain")},
    }
    by = {k: [e for kind, e in done if kind == k] for k in ("capture", "json", "plain")}
    conc["capture_worst_cos_fp32"] = worst(by["capture"])
    conc["capture_bad"] = [
        {k: e.get(k) for k in ("tokens", "error", "rows")} | {"worst": worst([e])}
        for e in by["capture"]
        if "error" in e or min(worst([e]).values(), default=-1) < OK_COS
    ]
    conc["json_worst_cos_fp32"] = worst(by["json"])
    conc["json_rows_vs_tokens"] = [[e.get("rows"), e["tokens"]] for e in by["json"]]
    conc["non_capture_with_aerie_capture"] = sum(
        1 for k in ("json", "plain") for e in by[k] if e.get("has_aerie_capture")
    )
    conc["errors"] = [e["error"] for k in by for e in by[k] if "error" in e]
    conc["token_matches_hf"] = {k: sum(1 for e in by[k] if e.get("token") == e.get("hf_next")) for k in by}
    conc["requests"] = {k: by[k] for k in by}
    res["concurrent"] = conc
    log(srv.name, "concurrent", json.dumps({k: conc[k] for k in ("wall_s", "capture_worst_cos_fp32", "errors")})[:600])
    res["refusals"] = refusals(srv)
    time.sleep(1)
    res["shm_left"] = sorted(os.listdir(srv.shm)) if os.path.isdir(srv.shm) else None
    seq_ok = all(
        "error" not in e and min(worst([e]).values()) >= OK_COS and e["rows"] == e["tokens"]
        for e in res["sequential"].values()
    )
    res["verdict"] = {
        "sequential_ok": seq_ok,
        "concurrent_ok": not conc["capture_bad"]
        and not conc["errors"]
        and conc["non_capture_with_aerie_capture"] == 0
        and min(conc["json_worst_cos_fp32"].values(), default=0) >= OK_COS,
        "refusals_ok": all(v["status"] in (400, 503) for v in res["refusals"].values()),
        "shm_clean": res["shm_left"] == [],
    }
    return res


def run(args) -> None:
    import torch
    import transformers

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    results = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers_ref": transformers.__version__,
        "model": CFG,
        "layer_ids": LAYER_IDS,
        "server_flags": SERVER_FLAGS,
        "ok_cos": OK_COS,
        "servers": {},
    }
    results["sglang"] = subprocess.run(
        [sys.executable, "-c", "import importlib.metadata as m; print(m.version('sglang'))"],
        env={**os.environ, "PYTHONPATH": args.site},
        capture_output=True,
        text=True,
    ).stdout.strip()

    def dump():
        (out / "results.json").write_text(json.dumps(results, indent=1))

    ref = Reference(args.reference or args.model)
    floor_ids = random.Random(7).sample(range(100, 40000), 512)
    r = ref.of(floor_ids)
    results["hf_bf16_vs_fp32"] = {
        **{f"aux_layer{lid}": compare(r["bf16"]["aux"][j], r["fp32"]["aux"][j]) for j, lid in enumerate(LAYER_IDS)},
        "final": compare(r["bf16"]["final"], r["fp32"]["final"]),
    }
    vocab = ref.models["bf16"].config.vocab_size
    servers = [s.split("=", 1) for s in args.server] or [["tree", str(REPO / "services" / "inference")]]
    for i, (name, plugin_dir) in enumerate(servers):
        left = args.budget_s - (time.monotonic() - t0)
        if left < 120:
            results["servers"][name] = {"skipped": f"budget: {left:.0f} s left"}
            continue
        srv = Server(name, Path(plugin_dir).resolve(), args, 31000 + i)
        entry = results["servers"][name] = {"plugin_dir": plugin_dir, "cmd": " ".join(srv.cmd[1:])}
        try:
            entry["ready_s"] = srv.wait(min(args.start_timeout, left - 60))
            log(name, "ready", entry["ready_s"])
            if entry["ready_s"] is None:
                entry["error"] = "server did not become healthy"
                entry["log_tail"] = srv.tail(60)
                continue
            entry.update(check_server(srv, ref, random.Random(1234), vocab))
        except Exception as ex:
            entry["error"] = f"{type(ex).__name__}: {ex}"
            entry["log_tail"] = srv.tail(60)
        finally:
            srv.stop()
            plugin_lines = [
                ln
                for ln in srv.log_path.read_text(errors="replace").splitlines()
                if "aerie" in ln.lower() or "Traceback" in ln or "Error" in ln
            ][:40]
            entry["log_plugin_lines"] = plugin_lines
            dump()
        log(name, "verdict", json.dumps(entry.get("verdict")))
    results["total_s"] = round(time.monotonic() - t0, 1)
    dump()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-model")
    m.add_argument("--tokenizer", required=True)
    m.add_argument("--out", default="/tmp/aerie-model")
    m.add_argument(
        "--intermediate-size", type=int, default=None, help="multiples of 128 for INT4 (Marlin) kernels, e.g. 768"
    )
    r = sub.add_parser("run")
    r.add_argument("--model", default="/tmp/aerie-model")
    r.add_argument(
        "--reference", help="the HF model to compare with (default --model), e.g. a quantized one's plain bf16"
    )
    r.add_argument("--site", default="/tmp/site", help="SGLang and its pins, for the servers' PYTHONPATH")
    r.add_argument("--out", default=os.environ.get("OUT", "/tmp/plugin-out"))
    r.add_argument("--server", action="append", default=[], help="NAME=DIR holding aerie_sglang (repeatable)")
    r.add_argument("--start-timeout", type=float, default=300)
    r.add_argument("--budget-s", type=float, default=540)
    a = p.parse_args()
    make_model(a) if a.cmd == "make-model" else run(a)


if __name__ == "__main__":
    main()
