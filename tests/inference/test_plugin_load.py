"""Loading the binary-capture plugin through SGLang's own plugin loader, each case in a fresh
SGLang process (`.venv-sglang`, where `aerie-sglang` is pip-installed: its entry point is real).

- installed is not enabled: without `AERIE_SGLANG_BINARY=1` it hooks nothing;
- on sglang 0.5.23 every hook of its table (`compat.RELEASES`) applies; on a release without a
  table the plugin refuses, with a message that says what to do, and hooks nothing (the server
  then runs stock and advertises nothing); 0.5.17's table: tests/inference/test_plugin_compat.py;
- a broken sink configuration refuses to load, naming the variable;
- the back-pressure bound and the reservations of admitted requests;
- the shm sink is private to the server's user and sweeps only its own names; the s3 sink counts
  its uploads in the bound and expires them (these import the sink alone: torch, no SGLang).
"""

from __future__ import annotations

import subprocess
import textwrap

import pytest

from tests.services import clean_env
from tests.sglang_server import REPO, sglang_python

pytestmark = [pytest.mark.sglang, pytest.mark.slow]  # each case imports SGLang afresh (~10-50 s)

_PRELUDE = """
import importlib.metadata, logging, os, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s %(message)s")
"""


def _run(code: str, env: dict[str, str] | None = None) -> str:

    child_env = {k: v for k, v in clean_env().items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    child_env.update({"SGLANG_PLUGINS": "aerie_capture", "AERIE_SGLANG_BINARY": "1", **(env or {})})
    proc = subprocess.run(
        [str(sglang_python()), "-c", _PRELUDE + textwrap.dedent(code)],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=child_env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_the_plugin_hooks_every_target_on_its_sglang_version_once_enabled():
    out = _run("""
        from sglang.srt.plugins import load_plugins
        from sglang.srt.plugins.hook_registry import HookRegistry
        from aerie_sglang.plugin import register
        from aerie_sglang.plugin.compat import RELEASES
        HOOKS = [h.target for h in RELEASES["0.5.23"].hooks]
        os.environ.pop("AERIE_SGLANG_BINARY")
        register()                                    # installed, not enabled: hooks nothing
        print("OFF", [t for t in HOOKS if t in HookRegistry._hooks])
        os.environ["AERIE_SGLANG_BINARY"] = "1"
        load_plugins()
        missing = [t for t in HOOKS if t not in HookRegistry._patched]
        print("MISSING", missing)
        from sglang.srt.utils.common import build_server_info
        print("WRAPPED", hasattr(build_server_info, "__wrapped__"))
    """)
    assert "OFF []" in out and "installed but off: set AERIE_SGLANG_BINARY=1" in out
    assert "MISSING []" in out and "WRAPPED True" in out


def test_the_plugin_refuses_another_sglang_version_and_hooks_nothing():
    out = _run("""
        real = importlib.metadata.version
        importlib.metadata.version = lambda name: "0.5.22" if name == "sglang" else real(name)
        from sglang.srt.plugins import load_plugins
        from sglang.srt.plugins.hook_registry import HookRegistry
        from aerie_sglang.plugin.compat import RELEASES
        HOOKS = {h.target for r in RELEASES.values() for h in r.hooks}
        load_plugins()
        print("HOOKED", [t for t in HOOKS if t in HookRegistry._hooks])
    """)
    assert "HOOKED []" in out
    assert (
        "aerie_capture plugin refused to load: sglang==0.5.22 is not supported (supported: sglang==0.5.23, sglang==0.5.17)"
        in out
    )


def test_an_s3_sink_without_credentials_refuses_to_load_naming_the_variables():
    out = _run(
        """
        from sglang.srt.plugins import load_plugins
        from sglang.srt.plugins.hook_registry import HookRegistry
        from aerie_sglang.plugin.compat import RELEASES
        HOOKS = {h.target for r in RELEASES.values() for h in r.hooks}
        load_plugins()
        print("HOOKED", [t for t in HOOKS if t in HookRegistry._hooks])
        """,
        env={"AERIE_STORE": "http://127.0.0.1:9", "AERIE_S3_ACCESS_KEY": "k"},
    )
    assert "HOOKED []" in out and "AERIE_S3_SECRET_KEY is not set" in out


def test_the_bound_counts_files_queued_captures_and_reservations(tmp_path):
    """The bound holds reservations, the captures this sink wrote (counted at once, no listing)
    and files seen by a listing; admission lists the directory only before refusing, so a
    claimed capture frees its bytes for the next request. On 2026-12-04's code before this
    change every admission listed the directory: 0.8 ms of the scheduler thread per request with
    256 captures waiting, on a 2-core VM (benchmarks/bench_sink_admit.py)."""
    out = _sink_run(
        f"""
        import gc
        from aerie_sglang.plugin.sink import SinkFull
        cap = Path({str(tmp_path)!r}) / "cap"
        sinks = Sinks(CaptureSinkSettings(shm_dir=cap, max_unclaimed_bytes=4000, ttl_s=900))
        sinks.config.prepare()        # not started: no writer thread lists the directory behind the test
        class Req: pass
        a, b = Req(), Req()
        sinks.admit(a, 2400)
        try:
            sinks.admit(b, 2400); print("ADMITTED-OVER")
        except SinkFull as e:
            print("REFUSED", "AERIE_CAPTURE_MAX_UNCLAIMED_BYTES=4000" in str(e))
        del a; gc.collect()                      # an aborted request releases its reservation
        sinks.admit(b, 2400); print("ADMITTED-AFTER-RELEASE")
        del b; gc.collect()
        tensors = {{"aux": torch.ones(30, 2, 8), "final": torch.ones(30, 8)}}   # ~3.1 KB as written
        meta = {{"aerie_capture_id": "1" * 32, "sha256": "0" * 64}}
        sinks._write(Capture("1" * 32, "shm", tensors, meta, planned_size(tensors, meta)), None)   # what a writer does
        listings = sinks.stats.listings
        try:
            sinks.admit(Req(), 1000); print("ADMITTED-OVER-OWN")
        except SinkFull:
            print("REFUSED-OWN")
        sinks.admit(Req(), 100)                  # under the bound: admitted on the figure it holds
        print("LISTED-TO-ADMIT", sinks.stats.listings - listings - 1)   # only the refusal listed
        (cap / ("1" * 32 + ".safetensors")).unlink()   # a client claims it
        sinks.admit(Req(), 1000); print("ADMITTED-AFTER-CLAIM")       # the would-be refusal lists it gone
        (cap / ("a" * 32 + ".safetensors")).write_bytes(b"0" * 3500)   # another scheduler's capture
        sinks.list_shm()                         # the first writer thread lists every second
        try:
            sinks.admit(Req(), 1000); print("ADMITTED-OVER-FILE")
        except SinkFull:
            print("REFUSED-FILE")
        try:
            sinks.admit(Req(), 5000)
        except SinkFull as e:
            print("TOO-BIG", "more than the bound" in str(e))
    """,
        tmp_path,
    )
    assert "ADMITTED-OVER" not in out, out
    assert "REFUSED True" in out and "ADMITTED-AFTER-RELEASE" in out, out
    assert "REFUSED-OWN" in out and "LISTED-TO-ADMIT 0" in out and "ADMITTED-AFTER-CLAIM" in out, out
    assert "REFUSED-FILE" in out and "TOO-BIG True" in out, out


def _sink_run(code: str, tmp_path, env: dict[str, str] | None = None) -> str:
    """`code` in `.venv-sglang` with only the sink imported (torch, no SGLang: a few seconds)."""
    child_env = {k: v for k, v in clean_env().items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    proc = subprocess.run(
        [str(sglang_python()), "-c", _PRELUDE + _SINK_PRELUDE + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**child_env, **(env or {})},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


_SINK_PRELUDE = """
import time
from pathlib import Path
import torch
from aerie_sglang.plugin.sink import Capture, CaptureConfigError, CaptureSinkSettings, S3Target, Sinks, planned_size

def capture(sinks, sink, cid, rows=4):
    tensors = {"aux": torch.ones(rows, 2, 8), "final": torch.ones(rows, 8)}
    meta = {"aerie_capture_id": cid, "sha256": "0" * 64}
    sinks.submit(Capture(cid, sink, tensors, meta, planned_size(tensors, meta)), None)

def wait(condition, what, timeout=30):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out: {what}")
        time.sleep(0.05)
"""


def test_the_shm_sink_is_private_to_the_servers_user(tmp_path):
    """Directory 0700, files 0600; a symlink or a directory of another user is refused naming
    AERIE_CAPTURE_DIR; the sweeper deletes only the plugin's own names. On 2026-12-02's code:
    0755 / 0644, both accepted, and every old `*.safetensors` of the directory deleted."""
    out = _sink_run(
        """
        import os
        root = Path.cwd()
        sinks = Sinks(CaptureSinkSettings(shm_dir=root / "cap", max_unclaimed_bytes=1 << 20, ttl_s=60, writers=1))
        sinks.start()
        capture(sinks, "shm", "a" * 32)
        wait(lambda: (root / "cap" / ("a" * 32 + ".safetensors")).exists(), "the capture")
        print("MODES", oct((root / "cap").stat().st_mode & 0o777), oct((root / "cap" / ("a" * 32 + ".safetensors")).stat().st_mode & 0o777))
        (root / "elsewhere").mkdir()
        (root / "link").symlink_to(root / "elsewhere")
        other = root / "other"
        other.mkdir()
        if os.geteuid() == 0:
            os.chown(other, 4242, 4242)
        else:
            other = Path("/var/tmp")  # a directory this user does not own
        for name, path in (("SYMLINK", root / "link"), ("OTHER-OWNER", other)):
            try:
                Sinks(CaptureSinkSettings(shm_dir=path, max_unclaimed_bytes=1 << 20, ttl_s=60, writers=1)).start()
                print(name, "ACCEPTED")
            except CaptureConfigError as e:
                print(name, "REFUSED", "AERIE_CAPTURE_DIR" in str(e))
        loose = root / "loose"
        loose.mkdir(mode=0o755)
        loose.chmod(0o755)
        CaptureSinkSettings(shm_dir=loose, max_unclaimed_bytes=1, ttl_s=60).prepare()
        print("NARROWED", oct(loose.stat().st_mode & 0o777))
        cap = root / "cap"
        names = ["b" * 32 + ".safetensors", "." + "c" * 32 + ".partial", "d" * 32 + ".error",
                 "notes.safetensors", "model.safetensors", "e" * 31 + ".safetensors", "keep.txt"]
        for name in names:
            (cap / name).write_bytes(b"x")
            os.utime(cap / name, (time.time() - 3600, time.time() - 3600))
        (cap / ("f" * 32 + ".safetensors")).symlink_to(root / "elsewhere")
        sinks._sweep()
        print("LEFT", sorted(p.name for p in cap.iterdir()))
    """,
        tmp_path,
    )
    assert "MODES 0o700 0o600" in out, out
    assert "SYMLINK REFUSED True" in out and "OTHER-OWNER REFUSED True" in out, out
    assert "NARROWED 0o700" in out, out
    left = out.split("LEFT ", 1)[1]
    for kept in (
        "notes.safetensors",
        "model.safetensors",
        "e" * 31 + ".safetensors",
        "keep.txt",
        "f" * 32 + ".safetensors",
    ):
        assert kept in left, (kept, left)
    for swept in ("b" * 32 + ".safetensors", "c" * 32 + ".partial", "d" * 32 + ".error"):
        assert swept not in left, (swept, left)


def test_a_request_collected_while_its_thread_holds_the_sinks_lock_does_not_deadlock(tmp_path):
    """An admitted request's reservation ends when the request is garbage-collected. SGLang's Req
    is in a reference cycle (its sampling params hold it), so the cyclic collector frees it, in
    whatever thread it runs and at whatever bytecode (Python 3.12), possibly inside the sink's
    lock. On the H200 (2026-12-04, session 13) SGLang's scheduler hung at a capture until its
    watchdog killed the server; this is that collection, made to happen under the lock. With the
    finalizer taking the lock, as it did, the thread deadlocks on itself."""
    out = _sink_run(
        """
        import gc, os, threading
        sinks = Sinks(CaptureSinkSettings(shm_dir=Path.cwd() / "cap", max_unclaimed_bytes=1 << 20, ttl_s=60, writers=1))
        sinks.config.prepare()
        class Req: pass
        req = Req()
        req.me = req                            # a cycle, as SGLang's Req is
        sinks.admit(req, 1000)
        print("RESERVED", sinks.unclaimed_bytes(fresh=False))
        del req
        done = threading.Event()
        def collect_under_the_lock():
            with sinks._lock:
                gc.collect()                    # frees the request: its finalizer runs here
            done.set()
        threading.Thread(target=collect_under_the_lock, daemon=True).start()
        if not done.wait(10):
            print("DEADLOCK", flush=True)
            os._exit(0)
        print("RELEASED", sinks.unclaimed_bytes(fresh=False))
    """,
        tmp_path,
    )
    assert "RESERVED 1000" in out and "DEADLOCK" not in out, out
    assert "RELEASED 0" in out, out


def test_a_capture_written_in_pieces_is_whole_and_its_sha256_holds(tmp_path):
    """The writer puts a whole file out with os.writev (one system call, one GIL release, where
    it used a file object and a write per part), which may write less than asked: with writev
    taking at most 7 bytes a call the file is still every byte, safetensors reads it back, its
    bf16 and float32 rows are the submitted ones, and the header's sha256 is of the data."""
    out = _sink_run(
        """
        import hashlib, json, os
        from safetensors.torch import load_file
        from aerie_sglang.plugin import sink as sink_module
        calls = []
        real = os.writev
        def short_writev(fd, buffers):
            calls.append(1)
            head = bytes(memoryview(buffers[0])[:7])
            return real(fd, [head])
        sink_module.os.writev = short_writev
        root = Path.cwd()
        sinks = Sinks(CaptureSinkSettings(shm_dir=root / "cap", max_unclaimed_bytes=1 << 20, ttl_s=60, writers=1))
        sinks.config.prepare()
        g = torch.Generator().manual_seed(3)
        tensors = {"aux": torch.randn(5, 2, 8, generator=g).to(torch.bfloat16), "final": torch.randn(5, 8, generator=g)}
        meta = {"aerie_capture_id": "a" * 32, "sha256": "0" * 64}
        sinks._write(Capture("a" * 32, "shm", tensors, meta, planned_size(tensors, meta)), None)
        path = root / "cap" / ("a" * 32 + ".safetensors")
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        back = load_file(str(path))
        print("SIZE", len(raw) == planned_size(tensors, meta), "CALLS", len(calls) > len(raw) // 8)
        print("EQUAL", all(torch.equal(back[k], tensors[k]) for k in tensors))
        print("SHA", header["__metadata__"]["sha256"] == hashlib.sha256(raw[8 + n:]).hexdigest())
        print("LEFT", sorted(p.name for p in (root / "cap").iterdir()))
        (root / "cap" / ("." + "b" * 32 + ".partial")).write_bytes(b"")  # the partial file cannot be created
        try:
            sinks._write(Capture("b" * 32, "shm", tensors, meta, planned_size(tensors, meta)), None)
        except OSError:
            pass
        print("ERROR-NOTE", (root / "cap" / ("b" * 32 + ".error")).read_text().startswith("the SGLang server could not write"))
    """,
        tmp_path,
    )
    assert "SIZE True CALLS True" in out, out
    assert "ERROR-NOTE True" in out, out
    assert "EQUAL True" in out and "SHA True" in out, out
    assert "LEFT ['" + "a" * 32 + ".safetensors']" in out, out


def test_the_s3_sink_is_bounded_and_expires_unclaimed_captures(s3_store, tmp_path):
    """Uploads count in the unclaimed bytes until a client deletes them (the next listing sees
    it) and refuse admission past the bound; captures older than the TTL are deleted from the
    prefix, nothing else. On 2026-12-02's code an upload counted for nothing and nothing under
    the prefix ever expired."""
    creds = s3_store.client._provider.retrieve()
    s3_store.put_bytes("capture/notes.txt", b"not a capture")
    s3_store.put_bytes("capture/deeper/" + "9" * 32 + ".safetensors", b"not the plugin's key")
    s3_store.put_bytes("runs/r1/" + "9" * 32 + ".safetensors", b"not under the prefix")
    out = _sink_run(
        f"""
        from aerie_sglang.plugin.s3 import S3Client
        from aerie_sglang.plugin.sink import SinkFull
        target = S3Target({s3_store.endpoint!r}, {s3_store.bucket!r}, {creds.access_key!r}, {creds.secret_key!r}, "us-east-1", "capture/")
        sinks = Sinks(CaptureSinkSettings(shm_dir=Path.cwd() / "cap", max_unclaimed_bytes=4000, ttl_s=6, s3=target, writers=2))
        sinks.start()
        capture(sinks, "s3", "1" * 32, rows=16)  # ~1.4 KB each
        capture(sinks, "s3", "2" * 32, rows=16)
        wait(lambda: not sinks._queued_bytes, "the uploads")
        waiting = sinks.unclaimed_bytes()
        print("UNCLAIMED", waiting)
        try:
            sinks.admit(object(), 2000)
            print("ADMITTED-OVER")
        except SinkFull as e:
            print("REFUSED", "s3 prefix capture/" in str(e))
        S3Client(target.endpoint, target.access_key, target.secret_key).delete(target.bucket, "capture/" + "1" * 32 + ".safetensors")
        wait(lambda: sinks.unclaimed_bytes() < waiting, "the claimed capture forgotten", timeout=15)
        print("AFTER-CLAIM", sinks.unclaimed_bytes())
        wait(lambda: sinks.unclaimed_bytes() == 0, "the unclaimed capture expired", timeout=40)
        print("EXPIRED")
    """,
        tmp_path,
    )
    assert "ADMITTED-OVER" not in out and "REFUSED True" in out, out
    waiting = int(out.split("UNCLAIMED ")[1].split()[0])
    after = int(out.split("AFTER-CLAIM ")[1].split()[0])
    assert 2500 < waiting <= 4000 and 0 < after < waiting, out
    assert "EXPIRED" in out, out
    assert sorted(s3_store.list("")) == sorted(
        ["capture/notes.txt", "capture/deeper/" + "9" * 32 + ".safetensors", "runs/r1/" + "9" * 32 + ".safetensors"]
    )


def test_the_final_rows_kept_on_0_5_17_are_a_copy_of_the_forwards_output(tmp_path):
    """0.5.17 drops the final (post-norm) rows, so the plugin keeps the logits processor's input.
    Under 0.5.17's default prefill CUDA graph that input is the graph's static output, which the
    next batch's replay overwrites before this batch's rows are read (overlap scheduling). On the
    H200 (2026-12-03, benchmarks/plugin_on_device.py) keeping the tensor itself gave wrong final
    rows (cos < 0.2 against HF) for 23 of 24 concurrent captures and for a 3-chunk prompt; with the
    copy all were at the bf16 floor."""
    out = _sink_run(
        """
        from aerie_sglang.plugin import compat, hooks
        rel = compat.RELEASES["0.5.17"]
        hooks.configure(CaptureSinkSettings(shm_dir=Path.cwd() / "cap", max_unclaimed_bytes=1 << 20, ttl_s=60), rel, "test", [1, 5])
        class Full:
            def is_full(self): return True
        class Metadata:
            capture_hidden_mode = Full()
        class Output: pass
        static = torch.ones(6, 8)  # the graph's output buffer, the logits processor's input
        out = hooks.around_logits_processor_forward(lambda *a, **k: Output(), None, None, static, None, Metadata(), [torch.zeros(6, 8)])
        static.fill_(7.0)  # the next batch's replay
        print("KEPT", compat.final_state(rel, out).eq(1).all().item())
    """,
        tmp_path,
    )
    assert "KEPT True" in out


def test_the_final_rows_kept_on_0_5_23_under_a_prefill_cuda_graph_are_the_plugins_own(tmp_path):
    """0.5.23 keeps the final rows as `last_hidden_states`, the logits processor's input itself;
    under a prefill CUDA graph SGLang's own `_trim_logits_output` returns a view of the graph's
    output buffer, and with overlap scheduling the next batch's replay overwrites that buffer
    before this batch's rows are taken. Here the buffer is overwritten between the two, as there:
    the captures must hold the first batch's rows. SGLang's real `_trim_logits_output` and
    `LogitsProcessorOutput`; the runner is a stand-in holding the replay's sizes (no GPU here;
    benchmarks/final_rows_on_device.py runs the same hooks around a real CUDA graph)."""
    out = _sink_run(
        """
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import PrefillCudaGraphRunner
        from aerie_sglang.plugin import compat, hooks
        rel = compat.RELEASES["0.5.23"]
        hooks.configure(CaptureSinkSettings(shm_dir=Path.cwd() / "cap", max_unclaimed_bytes=1 << 20, ttl_s=60), rel, "test")
        hooks._layer_ids = lambda: [1, 5]  # the server's --return-aux-hidden-state-layer-ids
        submitted = []
        hooks._sinks.submit = lambda capture, reservation: submitted.append(capture)
        class Spec:
            def is_speculative(self): return False
        class Runner:  # what `PrefillCudaGraphRunner.execute` set for this replay: 5 real tokens of 8
            raw_num_tokens, raw_bs, _is_full_backend = 5, 2, True
            model_runner = type("ModelRunner", (), {"spec_algorithm": Spec()})()
        class Req:
            customized_info = None
            is_retracted = False
            def __init__(self, rid): self.rid = rid
        static = torch.arange(8.0).reshape(8, 1).repeat(1, 4)  # the graph's output buffer: 8 padded rows
        replayed = LogitsProcessorOutput(next_token_logits=torch.zeros(2, 10), hidden_states=torch.zeros(8, 8), last_hidden_states=static)
        trimmed = hooks.around_trim_logits_output(PrefillCudaGraphRunner._trim_logits_output, Runner(), replayed)
        static.fill_(-1.0)  # the next batch's replay, before this batch's result is processed
        print("ALIASES", compat.final_state(rel, trimmed).untyped_storage().data_ptr() == static.untyped_storage().data_ptr())
        for rid, (start, end) in zip("ab", [(0, 3), (3, 5)]):
            hooks._take_rows(Req(rid), hooks._RequestCapture("shm", None, True), trimmed, start, end, True)
        print("FINAL", [c.tensors["final"][:, 0].tolist() for c in submitted], [tuple(c.tensors["final"].shape) for c in submitted])
    """,
        tmp_path,
        # this checkout's plugin first (SGLang's venv may hold another checkout's), then the sgl_kernel shim
        env={
            "SGLANG_USE_CPU_ENGINE": "1",
            "PYTHONPATH": f"{REPO / 'services/inference'}:{REPO / 'services/inference/aerie_sglang/cpu/shim'}",
        },
    )
    assert "ALIASES False" in out, out
    assert "FINAL [[0.0, 1.0, 2.0], [3.0, 4.0]] [(3, 4), (2, 4)]" in out, out


def test_a_batchs_final_device_rows_go_to_the_host_once_and_each_capture_keeps_a_view(tmp_path):
    """Final rows on the device (0.5.17 keeps them there) go to pinned host memory once per batch,
    not once per capture: every capture of the batch holds a view of that copy at its own offsets
    and waits on the copy's one event. A prompt's first chunk of several keeps a clone (its rows are
    joined on the device). This machine has no GPU: a device tensor, the pinned copy and the CUDA
    event are stand-ins here; benchmarks/plugin_on_device.py checks the values on a GPU."""
    out = _sink_run(
        """
        from aerie_sglang.plugin import compat, hooks
        rel = compat.RELEASES["0.5.17"]
        hooks.configure(CaptureSinkSettings(shm_dir=Path.cwd() / "cap", max_unclaimed_bytes=1 << 20, ttl_s=60), rel, "test", [1, 5])
        copies, submitted = [], []
        class Event:
            def record(self): self.recorded = True
        class OnDevice:  # a device tensor's stand-in
            is_cuda = True
            def __init__(self, rows): self.rows = rows
            def __getitem__(self, index): return OnDevice(self.rows[index])
            def clone(self): return OnDevice(self.rows.clone())
        torch.cuda.Event = Event
        hooks._to_pinned = lambda t: copies.append(t) or t.rows.clone()
        hooks._sinks.submit = lambda capture, reservation: submitted.append(capture)
        class Req:
            customized_info = None
            def __init__(self, rid): self.rid = rid
        class Output: pass
        def batch(values):
            out = Output()
            out.hidden_states = torch.arange(float(len(values) * 16)).reshape(len(values), 16)  # aux [T, 2 * 8], on the host
            setattr(out, "_aerie_final", OnDevice(torch.tensor(values).reshape(-1, 1).repeat(1, 8)))
            return out
        first = batch([0.0, 0, 0, 1, 1, 2, 2, 2])
        for rid, (start, end) in zip("abc", [(0, 3), (3, 5), (5, 8)]):
            hooks._take_rows(Req(rid), hooks._RequestCapture("shm", None, True), first, start, end, True)
        split = hooks._RequestCapture("shm", None, True)
        hooks._take_rows(Req("d"), split, batch([3.0, 3]), 0, 2, False)   # the first of two chunks
        print("COPIES", len(copies), "CAPTURES", len(submitted))
        print("ONE-EVENT", len({id(c.ready) for c in submitted}) == 1 and submitted[0].ready.recorded)
        print("ROWS", [sorted(set(c.tensors["final"].flatten().tolist())) for c in submitted],
              [tuple(c.tensors["final"].shape) for c in submitted], [tuple(c.tensors["aux"].shape) for c in submitted])
        print("SPLIT-KEEPS-A-CLONE", type(split.final_parts[0]).__name__, split.ready is None)
        second = batch([4.0, 4])
        hooks._take_rows(Req("e"), hooks._RequestCapture("shm", None, True), second, 0, 2, True)
        print("SECOND-BATCH", len(copies), submitted[-1].ready is not submitted[0].ready)
    """,
        tmp_path,
    )
    assert "COPIES 1 CAPTURES 3" in out and "ONE-EVENT True" in out, out
    assert "ROWS [[0.0], [1.0], [2.0]] [(3, 8), (2, 8), (3, 8)] [(3, 2, 8), (2, 2, 8), (3, 2, 8)]" in out, out
    assert "SPLIT-KEEPS-A-CLONE OnDevice True" in out and "SECOND-BATCH 2 True" in out, out
