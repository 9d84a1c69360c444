"""The shm sink's writer process (`AERIE_CAPTURE_WRITER=process`, plugin/writer_process.py).

Story: with the writer process on, a batch's captures leave the SGLang server as one group, their
rows copied into the shared ring once per host buffer they are views of, and land as the very
same files the in-process writer threads write, counted in the bound until they are files. A
writer process that dies leaves error notes for what it held (clients fail at once, naming it),
gives its ring space back, and the next batch starts a new one. The ring reuses its space in
order and never hands out space in use. A misspelt setting refuses the sink, naming it.

These run the sink alone in `.venv-sglang` (torch, no SGLang, a few seconds each); the plugin's
SGLang server tests (test_plugin_capture.py) run their server with the writer process.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.inference.test_plugin_load import _sink_run

pytestmark = [pytest.mark.sglang]

_BATCH = """
import threading
from aerie_sglang.plugin import writer_process
copies = []
real_memmove = writer_process.ctypes.memmove
writer_process.ctypes.memmove = lambda dst, src, n: copies.append(n) or real_memmove(dst, src, n)

class Copied:
    '''A batch's device-to-host copy event: done once `done` is set (after the whole batch is handed over).'''
    def __init__(self): self.done = threading.Event()
    def synchronize(self): self.done.wait()

def batch(sinks, prefix, ready, spans=((0, 5), (5, 17), (17, 40)), seed=0):
    g = torch.Generator().manual_seed(seed)
    aux = torch.randn(40, 3 * 8, generator=g).to(torch.bfloat16)   # SGLang's aux rows of the batch, on the host
    final = torch.randn(40, 8, generator=g).to(torch.bfloat16)     # the batch's final rows, copied once
    ids = []
    for i, (a, b) in enumerate(spans):
        cid = f"{prefix}{i:031x}"
        tensors = {"aux": aux[a:b].reshape(b - a, 3, 8), "final": final[a:b]}
        meta = {"aerie_capture_id": cid, "rid": str(i), "sha256": "0" * 64}
        sinks.submit(Capture(cid, "shm", tensors, meta, planned_size(tensors, meta), ready), None)
        ids.append(cid)
    return ids

def alone(sinks, cid, rows, dtype=torch.float32):
    tensors = {"aux": torch.full((rows, 3, 8), 0.5, dtype=dtype), "final": torch.full((rows, 8), 2.0, dtype=dtype)}
    meta = {"aerie_capture_id": cid, "rid": "x", "sha256": "0" * 64}
    sinks.submit(Capture(cid, "shm", tensors, meta, planned_size(tensors, meta)), None)
    return [cid]
"""


def _batch_run(code: str, tmp_path) -> str:
    return _sink_run(_BATCH + textwrap.dedent(code), tmp_path)


def test_a_batch_goes_to_the_writer_process_as_one_group_and_lands_as_the_threads_files(tmp_path):
    """Three captures of one batch (views of one aux and one final buffer) go over as one group,
    with one copy per buffer; a float32 capture of its own and one larger than the ring (written
    in-process instead) too. Every file equals, byte for byte, what the writer threads write for
    the same captures; the queued bytes return to 0 and the directory holds exactly the files."""
    out = _batch_run(
        """
        import hashlib, json
        files = {}
        for mode in ("threads", "process"):
            root = Path.cwd() / mode
            sinks = Sinks(CaptureSinkSettings(shm_dir=root, max_unclaimed_bytes=1 << 30, ttl_s=60, writers=2,
                                              writer=mode, ring_bytes=64 << 10))
            sinks.start()
            copies.clear()
            ready = Copied()
            ids = batch(sinks, "a", ready)
            ready.done.set()
            wait(lambda: sinks.stats.captures == 3, "the batch")
            ids += alone(sinks, "b" * 32, 4)
            ids += alone(sinks, "c" * 32, 1000)               # 128 KB: more than the 64 KB ring
            wait(lambda: sinks.stats.captures == 5 and not sinks._queued_bytes, "every capture")
            files[mode] = {cid: (root / f"{cid}.safetensors").read_bytes() for cid in ids}
            print(mode.upper(), "LEFT", len(list(root.iterdir())), "UNCLAIMED", sinks.unclaimed_bytes() == sum(map(len, files[mode].values())))
            if mode == "process":
                print("COPIES", copies, "STATS", sinks._process.stats.groups, sinks._process.stats.captures)
                print("ONE-PROCESS", sinks._process._channel.proc.poll() is None, sinks._process.stats.restarts)
        print("IDENTICAL", files["threads"] == files["process"])
        raw = files["process"]["a" + "0" * 31]
        n = int.from_bytes(raw[:8], "little")
        print("SHA", json.loads(raw[8:8 + n])["__metadata__"]["sha256"] == hashlib.sha256(raw[8 + n:]).hexdigest())
    """,
        tmp_path,
    )
    assert "THREADS LEFT 5 UNCLAIMED True" in out and "PROCESS LEFT 5 UNCLAIMED True" in out, out
    assert "IDENTICAL True" in out and "SHA True" in out, out
    # the batch: its aux buffer (40 x 24 bf16) and its final buffer (40 x 8 bf16), once each; then
    # the lone capture's two tensors; the large one never entered the ring
    assert "COPIES [1920, 640, 384, 128] STATS 2 4" in out, out
    assert "ONE-PROCESS True 0" in out, out


def test_a_writer_process_that_dies_leaves_error_notes_and_the_next_batch_starts_a_new_one(tmp_path):
    """The writer process is stopped while it holds a batch, then killed: both captures get an
    error note naming the writer process (their clients fail at once instead of timing out), the
    bound no longer counts them, and the next batch is written by a new process."""
    out = _batch_run(
        """
        import os, signal
        root = Path.cwd() / "cap"
        sinks = Sinks(CaptureSinkSettings(shm_dir=root, max_unclaimed_bytes=1 << 30, ttl_s=60, writers=2,
                                          writer="process", ring_bytes=1 << 20))
        sinks.start()
        first = sinks._process._channel.proc
        os.kill(first.pid, signal.SIGSTOP)
        ready = Copied()
        ids = batch(sinks, "d", ready, spans=((0, 20), (20, 40)))
        ready.done.set()
        wait(lambda: sinks._process.stats.groups == 1, "the batch handed over")
        print("HELD", sinks.unclaimed_bytes() > 0, sinks._process.ring.in_use > 0)
        os.kill(first.pid, signal.SIGKILL)
        wait(lambda: all((root / f"{cid}.error").exists() for cid in ids), "the error notes")
        wait(lambda: not sinks._queued_bytes, "the bound released")
        print("NOTES", [(root / f"{cid}.error").read_text() for cid in ids])
        print("AFTER", sinks.unclaimed_bytes(), sinks._process.ring.in_use, sorted(p.suffix for p in root.iterdir()))
        ids = batch(sinks, "e", None, spans=((0, 40),))
        wait(lambda: (root / f"{ids[0]}.safetensors").exists(), "the next capture")
        print("NEXT", sinks._process._channel.proc.pid != first.pid, sinks._process.stats.restarts, sinks.stats.captures)
    """,
        tmp_path,
    )
    assert "HELD True True" in out, out
    assert out.count("writer process ended (exit code -9) before writing it") == 2, out
    assert "AFTER 0 0 ['.error', '.error']" in out, out
    assert "NEXT True 1 1" in out, out


def test_the_ring_reuses_its_space_in_order_and_never_hands_out_space_in_use(tmp_path):
    """Regions are taken in order and wrap at the end; a region freed out of order comes back only
    with those before it; a request larger than the free contiguous space waits (None)."""
    out = _sink_run(
        """
        from aerie_sglang.plugin.writer_process import Ring
        ring = Ring(100, Path.cwd())
        a, b, c = ring.take(40), ring.take(40), ring.take(20)
        print("TAKEN", [(r.start, r.size) for r in (a, b, c)], ring.take(1))
        ring.give_back(b)                      # out of order: a still holds the start
        print("STILL-FULL", ring.take(1), ring.in_use)
        ring.give_back(a)                      # now a and b come back: [0, 80) free
        d = ring.take(50)
        print("WRAPPED", (d.start, d.size), ring.take(31), (ring.take(30).start))
        for r in list(ring._regions):
            ring.give_back(r)
        print("EMPTY", ring.in_use, (ring.take(100).start), ring.take(101))
        ring.map[0:3] = b"abc"
        import mmap, os
        print("SHARED", mmap.mmap(ring.fd, 100, prot=mmap.PROT_READ)[0:3])
    """,
        tmp_path,
    )
    assert "TAKEN [(0, 40), (40, 40), (80, 20)] None" in out, out
    assert "STILL-FULL None 60" in out, out
    assert "WRAPPED (0, 50) None 50" in out, out
    assert "EMPTY 0 0 None" in out and "SHARED b'abc'" in out, out


def test_a_misspelt_writer_setting_refuses_the_sink_naming_it(tmp_path):
    out = _sink_run(
        """
        for env in ({"AERIE_CAPTURE_WRITER": "fork"}, {"AERIE_CAPTURE_WRITER": "process", "AERIE_CAPTURE_RING_BYTES": "0"}):
            try:
                CaptureSinkSettings.from_env(env)
                print("ACCEPTED")
            except CaptureConfigError as e:
                print("REFUSED", e)
        print("DEFAULT", CaptureSinkSettings.from_env({}).writer, CaptureSinkSettings.from_env({"AERIE_CAPTURE_WRITER": "Process"}).writer)
    """,
        tmp_path,
    )
    assert "ACCEPTED" not in out, out
    assert "REFUSED AERIE_CAPTURE_WRITER='fork' is not one of threads, process" in out, out
    assert "REFUSED AERIE_CAPTURE_RING_BYTES='0' must be greater than 0" in out, out
    assert "DEFAULT threads process" in out, out


def test_the_writer_process_lists_and_sweeps_the_directory_instead_of_the_server(tmp_path):
    """With the writer process on, the server never lists the shm directory on its own (a listing
    stats every file, each stat a GIL release in the server): the writer process lists it every
    second and the bound follows what clients claim, and it deletes the plugin's old captures
    and nothing else."""
    out = _batch_run(
        """
        import os
        root = Path.cwd() / "cap"
        sinks = Sinks(CaptureSinkSettings(shm_dir=root, max_unclaimed_bytes=1 << 30, ttl_s=60, writers=1,
                                          writer="process", ring_bytes=1 << 20))
        sinks.start()                                  # one listing of its own, at start
        own = []
        real_list = Sinks.list_shm
        Sinks.list_shm = lambda self: own.append(1) or real_list(self)
        ids = batch(sinks, "a", None, spans=((0, 20), (20, 40)))
        wait(lambda: sinks.stats.captures == 2, "the captures")
        sizes = [(root / f"{cid}.safetensors").stat().st_size for cid in ids]
        listings = sinks.stats.listings
        wait(lambda: sinks.stats.listings > listings + 1, "the writer process's listings")
        print("COUNTED", sinks.unclaimed_bytes(fresh=False) == sum(sizes))
        (root / f"{ids[0]}.safetensors").unlink()      # a client claims one
        wait(lambda: sinks.unclaimed_bytes(fresh=False) == sizes[1], "the claim seen")
        print("CLAIMED-SEEN", "SERVER-LISTINGS", len(own))
        old = root / ("9" * 32 + ".safetensors")       # a capture its client never claimed
        for path in (old, root / "keep.txt"):
            path.write_bytes(b"x" * 100)
            os.utime(path, (time.time() - 3600, time.time() - 3600))
        wait(lambda: not old.exists(), "the old capture swept")
        print("SWEPT", sorted(p.name for p in root.iterdir()) == sorted(["keep.txt", f"{ids[1]}.safetensors"]))
    """,
        tmp_path,
    )
    assert "COUNTED True" in out, out
    assert "CLAIMED-SEEN SERVER-LISTINGS 0" in out, out
    assert "SWEPT True" in out, out
