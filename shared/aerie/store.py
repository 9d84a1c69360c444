"""The object store: one interface, two backends with the same layout.

- `S3Store`: any S3 server (MinIO, SeaweedFS, AWS) through the official `minio` SDK.
- `FsStore`: a folder on disk (the embedded default); keys are relative paths.

Whole-object writes only: an object appears complete or not at all (S3 semantics; the
filesystem backend writes a temporary file and renames it). Records are written *after*
the data they describe, so a reader that finds a record finds its object.

`put_new` writes an object only if none exists under its key, atomically: of two writers racing
for one key exactly one creates it (a hard link on the filesystem; `If-None-Match: *` on S3, which
AWS S3, MinIO and SeaweedFS honour). A run's creation rests on it (aerie.controller).
"""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import io
import os
import shutil
import tempfile
import time
import urllib.parse
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar, cast

from aerie.settings import Settings, redact

if TYPE_CHECKING:
    from aerie.contracts import Contract

CHUNK = 8 << 20  # streaming granularity
PART_SIZE = 16 << 20  # multipart part size for S3 uploads

T = TypeVar("T", bound="Contract")


class StoreError(RuntimeError):
    """A store problem, phrased with the endpoint and the setting to fix."""


class NotFound(StoreError, KeyError):
    def __str__(self) -> str:  # KeyError would add quotes
        return str(self.args[0])


class _HashingReader(io.RawIOBase):
    """Wraps a file object, hashing what is read through it."""

    def __init__(self, raw: BinaryIO):
        super().__init__()
        self.raw, self.sha = raw, hashlib.sha256()
        self.count = 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.sha.update(data)
        self.count += len(data)
        return data


def _sha256_parts(parts: list[memoryview]) -> hashlib._Hash:
    sha = hashlib.sha256()
    for part in parts:
        for a in range(0, part.nbytes, CHUNK):
            sha.update(part[a : a + CHUNK])
    return sha


class PartsReader(io.RawIOBase):
    """A readable stream over a list of buffers (a shard's header and tensors), read in order."""

    def __init__(self, parts: list[memoryview]):
        super().__init__()
        self.parts, self.part, self.pos = parts, 0, 0

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        out = []
        while self.part < len(self.parts) and n != 0:
            part = self.parts[self.part]
            take = part.nbytes - self.pos if n < 0 else min(n, part.nbytes - self.pos)
            out.append(part[self.pos : self.pos + take].tobytes())
            self.pos += take
            n = n - take if n > 0 else n
            if self.pos == part.nbytes:
                self.part, self.pos = self.part + 1, 0
        return b"".join(out) if len(out) != 1 else out[0]


class ObjectStore(ABC):
    url: str

    # --- primitives -------------------------------------------------------------------
    @abstractmethod
    def put_stream(self, key: str, stream: BinaryIO, length: int = -1) -> str:
        """Write an object from a stream (multipart when large); return its sha256."""

    @abstractmethod
    def open(self, key: str) -> Iterator[bytes]:
        """Stream an object in chunks (bounded memory)."""

    @abstractmethod
    def get_range(self, key: str, offset: int, length: int) -> bytes: ...

    @abstractmethod
    def size(self, key: str) -> int: ...

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """All keys under a prefix, sorted."""

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def put_new(self, key: str, data: bytes) -> bool:
        """Create the object `key` holding `data` unless one exists: True when this call created it,
        False when the key was taken (by an earlier or a racing writer). Atomic across processes."""

    def local_path(self, key: str) -> Path | None:
        """A path the object can be memory-mapped from, when the backend has one."""
        return None

    # --- conveniences built on the primitives ------------------------------------------
    def put_parts(self, key: str, parts: builtins.list[memoryview]) -> str:
        """Write an object made of buffers, in order (a shard's header and tensors); return its sha256."""
        stream = cast(BinaryIO, PartsReader(parts))  # a raw stream: read() is all put_stream uses
        return self.put_stream(key, stream, sum(p.nbytes for p in parts))

    def put_bytes(self, key: str, data: bytes) -> str:
        return self.put_stream(key, io.BytesIO(data), len(data))

    def put_file(self, key: str, path: str | os.PathLike[str]) -> str:
        with open(path, "rb") as f:
            return self.put_stream(key, f, os.fstat(f.fileno()).st_size)

    def get_bytes(self, key: str) -> bytes:
        return b"".join(self.open(key))

    def download(self, key: str, path: str | os.PathLike[str]) -> str:
        """Copy an object to a file (atomically); return its sha256."""
        sha = hashlib.sha256()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".part")
        with open(tmp, "wb") as f:
            for chunk in self.open(key):
                sha.update(chunk)
                f.write(chunk)
        os.replace(tmp, path)
        return sha.hexdigest()

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
            return True
        except NotFound:
            return False

    def put_json(self, key: str, record: Contract) -> str:
        return self.put_bytes(key, record.to_json())

    def create_json(self, key: str, record: T, model: type[T]) -> tuple[T, bool]:
        """`record` written at `key` unless a record is there already: (the record the key holds,
        whether this call wrote it)."""
        if self.put_new(key, record.to_json()):
            return record, True
        return self.get_json(key, model), False

    def get_json(self, key: str, model: type[T]) -> T:
        return model.model_validate_json(self.get_bytes(key))

    def delete_prefix(self, prefix: str) -> int:
        keys = self.list(prefix)
        for k in keys:
            self.delete(k)
        return len(keys)

    def sha256(self, key: str) -> str:
        sha = hashlib.sha256()
        for chunk in self.open(key):
            sha.update(chunk)
        return sha.hexdigest()


class InvalidKey(StoreError):
    """A key that would leave the bucket's layout (absolute, '..'): refused, never retried."""

    retryable = False


def _check_key(key: str) -> str:
    if not key or key.startswith("/") or ".." in key.split("/") or "\\" in key:
        raise InvalidKey(f"invalid object key {key!r}: keys are relative, '/'-separated, without '..'")
    return key


# --------------------------------------------------------------------------------------
class FsStore(ObjectStore):
    """A folder with the same layout as the bucket."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def put_stream(self, key: str, stream: BinaryIO, length: int = -1) -> str:
        reader = _HashingReader(stream)
        with self._writing(key) as f:
            shutil.copyfileobj(reader, f, CHUNK)
        return reader.sha.hexdigest()

    def put_parts(self, key: str, parts: list[memoryview]) -> str:
        """No copy, and the hash beside the write: a helper thread hashes the buffers while this one
        writes them, in CHUNKs (both without the GIL), so a shard takes max(hash, write), not the sum."""
        with ThreadPoolExecutor(1, thread_name_prefix="aerie-fs-sha256") as helper:
            sha = helper.submit(_sha256_parts, parts)
            with self._writing(key) as f:
                for part in parts:
                    for a in range(0, part.nbytes, CHUNK):
                        f.write(part[a : a + CHUNK])
                digest = sha.result().hexdigest()  # a failed hash leaves no object
        return digest

    @contextlib.contextmanager
    def _writing(self, key: str) -> Iterator[BinaryIO]:
        """A file that becomes the object `key` when the block ends without an error (a temporary
        file renamed), and is removed otherwise."""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as f:
                yield f
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def open(self, key: str) -> Iterator[bytes]:
        path = self._path(key)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise NotFound(f"{key}: no such object in {self.url}") from None
        with f:
            while chunk := f.read(CHUNK):
                yield chunk

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                f.seek(offset)
                return f.read(length)
        except FileNotFoundError:
            raise NotFound(f"{key}: no such object in {self.url}") from None

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            raise NotFound(f"{key}: no such object in {self.url}") from None

    def list(self, prefix: str) -> list[str]:
        base = self.root / prefix.rsplit("/", 1)[0] if "/" in prefix else self.root
        if not base.is_dir():
            return []
        keys = []
        for dirpath, _, files in os.walk(base):
            for name in files:
                if name.startswith(".") and name.endswith(".part"):
                    continue
                key = os.path.relpath(os.path.join(dirpath, name), self.root).replace(os.sep, "/")
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def put_new(self, key: str, data: bytes) -> bool:
        """The whole object written to a temporary file, then hard-linked to its key: link() fails
        when the name exists, so exactly one writer creates it, and a reader never sees a part."""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            Path(tmp).unlink(missing_ok=True)

    def local_path(self, key: str) -> Path | None:
        return self._path(key)


# --------------------------------------------------------------------------------------
class S3Store(ObjectStore):
    """An S3 bucket through the `minio` SDK."""

    def __init__(self, endpoint: str, bucket: str, access_key: str, secret_key: str, region: str | None = None):
        from minio import Minio

        u = urllib.parse.urlparse(endpoint)
        if u.scheme not in ("http", "https") or not u.netloc:
            raise StoreError(f"AERIE_STORE={endpoint!r} is not an http(s)://host:port S3 endpoint")
        self.endpoint, self.bucket = endpoint, bucket
        self.url = f"{redact(endpoint).rstrip('/')}/{bucket}"
        self.client = Minio(
            u.netloc, access_key=access_key, secret_key=secret_key, secure=u.scheme == "https", region=region
        )

    def _explain(self, e: Exception, key: str | None = None) -> StoreError:
        from minio.error import S3Error

        where = f"S3 endpoint {redact(self.endpoint)} (AERIE_STORE), bucket {self.bucket!r} (AERIE_BUCKET)"
        if isinstance(e, S3Error):
            if e.code in ("NoSuchKey", "NoSuchObject") or (e.code == "ResourceNotFound" and key):
                return NotFound(f"{key}: no such object in {self.url}")
            if e.code == "NoSuchBucket":
                return StoreError(
                    f"bucket {self.bucket!r} does not exist at {redact(self.endpoint)}: create it (`aerie prepare-store`), or set AERIE_BUCKET"
                )
            if e.code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied"):
                return StoreError(
                    f"{where} refused the credentials ({e.code}): check AERIE_S3_ACCESS_KEY and AERIE_S3_SECRET_KEY"
                )
            return StoreError(f"{where}: {e.code}: {e.message}")
        if isinstance(e, (OSError,)) or type(e).__module__.startswith("urllib3"):
            return StoreError(
                f"{where} is unreachable ({type(e).__name__}: {e}): is the server running? check AERIE_STORE"
            )
        return StoreError(f"{where}: {type(e).__name__}: {e}")

    def _call(self, fn: Callable[..., Any], *args: Any, key: str | None = None, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except Exception as e:  # translated into one clear error
            raise self._explain(e, key) from e

    def ensure_bucket(self) -> None:
        if not self._call(self.client.bucket_exists, self.bucket):
            self._call(self.client.make_bucket, self.bucket)

    def check(self) -> None:
        """Fail early with the clear error when the bucket cannot be reached."""
        if not self._call(self.client.bucket_exists, self.bucket):
            raise StoreError(
                f"bucket {self.bucket!r} does not exist at {redact(self.endpoint)}: create it (`aerie prepare-store`), or set AERIE_BUCKET"
            )

    def put_stream(self, key: str, stream: BinaryIO, length: int = -1) -> str:
        reader = _HashingReader(stream)
        self._call(
            self.client.put_object,
            self.bucket,
            _check_key(key),
            reader,
            length,
            part_size=PART_SIZE,
            key=key,
        )
        return reader.sha.hexdigest()

    def open(self, key: str) -> Iterator[bytes]:
        resp = self._call(self.client.get_object, self.bucket, _check_key(key), key=key)
        try:
            yield from resp.stream(CHUNK)
        finally:
            resp.close()
            resp.release_conn()

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """The bytes at [offset, offset + length), fewer where the object ends first (none past its
        end: S3's InvalidRange), as a file read there gives: the reader sees the object is short."""
        try:
            resp = self._call(
                self.client.get_object, self.bucket, _check_key(key), offset=offset, length=length, key=key
            )
        except StoreError as e:
            if getattr(e.__cause__, "code", None) == "InvalidRange":
                return b""
            raise
        try:
            return resp.read()
        finally:
            resp.close()
            resp.release_conn()

    def size(self, key: str) -> int:
        return self._call(self.client.stat_object, self.bucket, _check_key(key), key=key).size

    def list(self, prefix: str) -> list[str]:
        objs = self._call(lambda: list(self.client.list_objects(self.bucket, prefix=prefix, recursive=True)))
        return sorted(o.object_name for o in objs)

    def delete(self, key: str) -> None:
        self._call(self.client.remove_object, self.bucket, _check_key(key), key=key)

    CONDITIONAL_CONFLICT_RETRIES = 5

    def put_new(self, key: str, data: bytes) -> bool:
        """PUT with `If-None-Match: *`: the server refuses it (412) when the key exists. minio's
        public put_object turns unknown headers into user metadata (`X-Amz-Meta-If-None-Match`,
        silently unconditional), so the request goes through its single-part PUT with the header
        as is. A 409 (a conditional write to the key in flight, AWS) is asked again."""
        from minio.error import S3Error

        for attempt in range(self.CONDITIONAL_CONFLICT_RETRIES):
            try:
                self.client._put_object(
                    self.bucket,
                    _check_key(key),
                    data,
                    headers={"Content-Type": "application/octet-stream", "If-None-Match": "*"},
                )
                return True
            except S3Error as e:
                if e.code == "PreconditionFailed":
                    return False
                if e.code != "ConditionalRequestConflict" or attempt == self.CONDITIONAL_CONFLICT_RETRIES - 1:
                    raise self._explain(e, key) from e
            except Exception as e:  # translated into one clear error
                raise self._explain(e, key) from e
            time.sleep(0.1 * 2**attempt)
        raise AssertionError("unreachable")


def open_store(settings: Settings | None = None, *, create_bucket: bool = False) -> ObjectStore:
    """The store the settings name: `file://PATH` or `http(s)://HOST:PORT`."""
    settings = settings or Settings.load()
    if settings.store.startswith("file://"):
        return FsStore(settings.store[len("file://") :])
    if settings.store.startswith(("http://", "https://")):
        assert settings.s3_access_key and settings.s3_secret_key  # enforced by Settings
        store = S3Store(
            settings.store,
            settings.bucket,
            settings.s3_access_key.get_secret_value(),
            settings.s3_secret_key.get_secret_value(),
            settings.s3_region,
        )
        store.ensure_bucket() if create_bucket else store.check()
        return store
    raise StoreError(f"AERIE_STORE={settings.store!r}: use file:///path or http(s)://host:port")
