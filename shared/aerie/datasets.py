"""Datasets: where an ingest may read one, and the upload of a local file into the store.

- A worker reads datasets from the store. A local path is read only inside the folders its
  settings allow (`AERIE_INGEST_LOCAL_DIRS`, empty by default): a message on the broker cannot
  make a worker open `/etc/passwd`. The path is checked as written first (nothing outside is
  touched), then once symlinks are resolved (a link inside an allowed folder cannot lead out).
- `upload` keys a local file by its sha256 (`aerie.layout.dataset_upload`), so two different
  files of the same name never overwrite each other and the same file is stored once.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from aerie import layout
from aerie.errors import ExpectedError
from aerie.store import ObjectStore


class DatasetRefused(ExpectedError, ValueError):
    """A dataset a worker may not read (a local path outside the allowed folders, or a malformed
    key); the message names AERIE_INGEST_LOCAL_DIRS."""


def is_local_form(dataset: str) -> bool:
    """Written as a local path (absolute, home-relative or dot-relative) rather than a store key."""
    return dataset.startswith(("/", "~", "./", "../")) or "\\" in dataset or ".." in dataset.split("/")


def allowed_local_path(dataset: str, allowed: list[Path]) -> Path | None:
    """The resolved file `dataset` names when it lies inside one of `allowed` (after symlinks too);
    None when it is not under any of them as written. Raises DatasetRefused when it is under one
    as written but leads out of it."""
    if not allowed:
        return None
    written = Path(os.path.abspath(os.path.expanduser(dataset)))  # lexical: no file system access
    roots = [Path(os.path.abspath(os.path.expanduser(d))) for d in allowed]
    if not any(written.is_relative_to(root) for root in roots):
        return None
    real = written.resolve()
    if not any(real.is_relative_to(root.resolve()) for root in roots):
        raise DatasetRefused(
            f"dataset {dataset!r} leads to {real}, outside the folders this worker may read "
            f"(AERIE_INGEST_LOCAL_DIRS={[str(r) for r in roots]})"
        )
    return real


def refusal(dataset: str, allowed: list[Path], what: str = "dataset") -> DatasetRefused:
    """A local path outside the allowed folders; `what` names the field the path came in."""
    return DatasetRefused(
        f"{what} {dataset!r} is a local path outside the folders this worker may read "
        f"(AERIE_INGEST_LOCAL_DIRS={[str(d) for d in allowed]}): upload it to the store (`enqueue` and `aerie run` do) "
        "and name its key, or add its folder to AERIE_INGEST_LOCAL_DIRS"
    )


def file_sha256(path: str | os.PathLike[str]) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            sha.update(chunk)
    return sha.hexdigest()


def upload(store: ObjectStore, path: str | os.PathLike[str], sha: str | None = None) -> str:
    """Upload a local dataset under its content's key (once: an existing key holds the same bytes);
    `sha`: its sha256 when already computed."""
    path = Path(path)
    sha = sha or file_sha256(path)
    key = layout.dataset_upload(sha, path.name)
    if not store.exists(key):
        written = store.put_file(key, path)
        if written != sha:
            store.delete(key)
            raise DatasetRefused(
                f"{path} changed while it was uploaded (sha256 {sha[:12]}… then {written[:12]}…): upload it again"
            )
    return key
