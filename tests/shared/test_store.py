"""The object store: the same tests against the filesystem backend and a real S3 server."""

import hashlib
import io
import os
import resource

import numpy as np
import pytest

from aerie import layout
from aerie.contracts import RejectRecord
from aerie.shard import Shard, pack
from aerie.store import NotFound, S3Store, StoreError


def test_put_get_list_range_delete(store):
    sha = store.put_bytes("runs/r1/a.bin", b"0123456789")
    assert sha == hashlib.sha256(b"0123456789").hexdigest()
    store.put_bytes("runs/r1/sub/b.bin", b"x")
    store.put_bytes("runs/r2/c.bin", b"y")
    assert store.list("runs/r1/") == ["runs/r1/a.bin", "runs/r1/sub/b.bin"]
    assert store.list("runs/") == ["runs/r1/a.bin", "runs/r1/sub/b.bin", "runs/r2/c.bin"]
    assert store.list("nothing/") == []
    assert store.get_range("runs/r1/a.bin", 3, 4) == b"3456"
    assert store.size("runs/r1/a.bin") == 10
    assert store.sha256("runs/r1/a.bin") == sha
    store.delete("runs/r1/a.bin")
    assert not store.exists("runs/r1/a.bin")
    with pytest.raises(NotFound, match="runs/r1/a.bin"):
        store.get_bytes("runs/r1/a.bin")


def test_records_round_trip(store):
    rec = RejectRecord(source="x.jsonl", line=3, reason="no assistant turn")
    store.put_json("runs/r/rejects/0.json", rec)
    assert store.get_json("runs/r/rejects/0.json", RejectRecord) == rec


def test_bad_keys_are_refused(store):
    for key in ("/abs", "a/../b", ""):
        with pytest.raises(StoreError, match="invalid object key"):
            store.put_bytes(key, b"")


def test_put_parts_writes_the_buffers_in_order(store):
    """A shard's parts (header, then each tensor, some larger than a write chunk, some empty)
    make the object, and its sha256, of their bytes joined; a failed write leaves nothing."""
    rng = np.random.default_rng(2)
    parts = [
        memoryview(b"head"),
        memoryview(rng.integers(0, 256, (9 << 20) + 3, dtype=np.uint8)),
        memoryview(b""),
        memoryview(rng.standard_normal(1000).astype(np.float32).view(np.uint8)),
    ]
    joined = b"".join(p.tobytes() for p in parts)
    assert store.put_parts("runs/r/parts.bin", parts) == hashlib.sha256(joined).hexdigest()
    assert store.get_bytes("runs/r/parts.bin") == joined
    with pytest.raises((OSError, StoreError), match="disk gone"):  # S3: wrapped by the store
        store.put_parts("runs/r/broken.bin", [memoryview(b"x" * 100), _Unreadable()])
    assert not store.exists("runs/r/broken.bin") and store.list("runs/r/") == ["runs/r/parts.bin"]


class _Unreadable:
    """A part whose bytes cannot be read (the disk under a mapped array went away)."""

    nbytes = 100

    def __getitem__(self, index):
        raise OSError("disk gone")


class _Pattern(io.RawIOBase):
    """A 200 MB stream generated on the fly: the test never holds it in memory."""

    def __init__(self, size):
        super().__init__()
        self.size, self.pos = size, 0
        self.block = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()

    def readable(self):
        return True

    def readinto(self, b):
        off = self.pos % len(self.block)
        n = min(len(b), self.size - self.pos, len(self.block) - off)  # partial reads are fine
        if n <= 0:
            return 0
        b[:n] = self.block[off : off + n]
        self.pos += n
        return n


@pytest.mark.slow
def test_200mb_object_round_trips_with_bounded_memory(store, tmp_path):
    size = 200 << 20
    expected = hashlib.sha256()
    src = _Pattern(size)
    while chunk := src.read(8 << 20):
        expected.update(chunk)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert store.put_stream("big/object.bin", _Pattern(size), size) == expected.hexdigest()
    assert store.size("big/object.bin") == size
    assert store.download("big/object.bin", tmp_path / "copy.bin") == expected.hexdigest()
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grown_mb < 120, f"peak memory grew {grown_mb:.0f} MB for a 200 MB object"
    assert os.path.getsize(tmp_path / "copy.bin") == size


def test_shard_written_listed_range_read_validated(store):
    rng = np.random.default_rng(0)
    seqs = [
        {
            "input_ids": rng.integers(0, 100, 20).astype(np.int32),
            "loss_mask": np.ones(20, np.uint8),
            "aux": rng.standard_normal((20, 3, 8)).astype(np.float32),
            "final": rng.standard_normal((20, 8)).astype(np.float32),
        }
        for _ in range(3)
    ]
    data = pack(seqs, capture_points=[2, 4, 6]).to_bytes()
    key = layout.shard("r", "hidden", layout.shard_name(0))
    store.put_bytes(key, data)
    assert store.list(layout.shards_prefix("r", "hidden")) == [key]
    header_len = int.from_bytes(store.get_range(key, 0, 8), "little")
    assert b'"aerie-shard/1"' in store.get_range(key, 8, header_len)
    back = Shard.from_buffer(store.get_bytes(key)).validate()
    np.testing.assert_array_equal(back.sequence(2)["aux"], seqs[2]["aux"])


def test_wrong_credentials_missing_bucket_unreachable(s3_server):
    bad = S3Store(s3_server.endpoint, "aerie", s3_server.access_key, "wrong-secret")
    with pytest.raises(StoreError, match="AERIE_S3_SECRET_KEY") as e:
        bad.check()
    assert s3_server.endpoint in str(e.value)
    missing = S3Store(s3_server.endpoint, "no-such-bucket-x", s3_server.access_key, s3_server.secret_key)
    with pytest.raises(StoreError, match="does not exist.*AERIE_BUCKET"):
        missing.check()
    from tests.services import free_port

    port = free_port()
    dead = S3Store(f"http://127.0.0.1:{port}", "aerie", "a", "b")
    dead.client._http.connection_pool_kw["retries"] = None
    with pytest.raises(StoreError, match=f"127.0.0.1:{port}.*unreachable.*AERIE_STORE"):
        dead.list("x/")


def test_a_range_past_the_end_reads_short_on_both_stores(store):
    """Issue 35 (a truncated shard on S3 was a bare InvalidRange store error, retried as a store
    failure): a range that starts past an object's end reads no bytes and one that runs past it
    reads what there is, on S3 as on a file, so the reader names the short object."""
    store.put_bytes("runs/r/x.bin", b"0123456789")
    assert store.get_range("runs/r/x.bin", 4, 100) == b"456789"
    assert store.get_range("runs/r/x.bin", 20, 8) == b""
