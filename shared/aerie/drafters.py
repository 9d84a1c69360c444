"""Published drafters in the store: publish a folder, resolve a reference, read the lineage, pull.

No torch here: `aerie pull` (the serve init-container, a user's laptop) needs only this package.

A published drafter is `drafters/<name>/<version>/` holding the files SGLang loads
(`config.json`, `model.safetensors`) and `aerie.json` (its lineage, with each file's sha256),
written in that order, then `drafters/<name>/latest` naming the version. Its lineage's presence
means "completely published".

Pulling trusts nothing the bucket says about where to write: only the fixed file names above are
fetched, into a fresh temporary folder beside DEST, each checked against the lineage's sha256; only
then does that folder replace DEST whole (renames), so DEST is the old drafter or the new one, never
a mix, and nothing planted in DEST (a symlink) is followed. A lineage naming any other file is
refused before anything is written.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from aerie import layout
from aerie.contracts import _NAME, DrafterLineage, TrainRequest, TrainResult
from aerie.runs import lineage_alignment
from aerie.store import NotFound, ObjectStore, StoreError

_NAME_RE = re.compile(_NAME)


class DrafterError(StoreError):
    """A drafter reference or published drafter that cannot be used; the message says why."""


def parse_ref(ref: str) -> tuple[str, str | None]:
    """'NAME[:VERSION]' -> (name, version or None), both checked against the name pattern."""
    name, _, version = ref.partition(":")
    for what, value in (("name", name), ("version", version)):
        if (value or what == "name") and not _NAME_RE.fullmatch(value):
            raise DrafterError(
                f"drafter {what} {value!r} in {ref!r} is not a valid name (letters, digits, '.', '_', '-')"
            )
    return name, version or None


def resolve(store: ObjectStore, ref: str) -> tuple[str, str]:
    """'NAME[:VERSION]' -> (name, version); no version means the one `latest` names."""
    name, version = parse_ref(ref)
    if version is None:
        try:
            version = store.get_bytes(layout.drafter_latest(name)).decode().strip()
        except NotFound:
            raise NotFound(
                f"no drafter {name!r} published in {store.url} ({layout.drafter_latest(name)} missing)"
            ) from None
        parse_ref(f"{name}:{version}")  # what the bucket says is checked like what a user types
    return name, version


def published_lineage(store: ObjectStore, name: str, version: str) -> DrafterLineage | None:
    try:
        return store.get_json(layout.drafter_lineage(name, version), DrafterLineage)
    except NotFound:
        return None


def published_result(store: ObjectStore, request: TrainRequest) -> TrainResult | None:
    """What a training request that published its drafter version returned (from its lineage), or None."""
    if not request.publish:
        return None
    done = published_lineage(store, request.drafter, request.version)
    if done is None:
        return None
    point_latest(store, request.drafter, request.version, done)  # a crash between lineage and latest
    return TrainResult.of(
        request.drafter,
        request.version,
        done.metrics,
        already_published=True,
        train_id=request.resolved_train_id,
        key=layout.drafter_prefix(request.drafter, request.version),
        layer_ids=done.exported_layer_ids,
    )


def point_latest(store: ObjectStore, name: str, version: str, lineage: DrafterLineage) -> bool:
    """Complete the last step of publishing `version` (its lineage written): point `latest` at it
    unless `latest` already names it or a version published after it (or in the same second). Idempotent, so a rerun of a
    publish that died between `aerie.json` and `latest` finishes it; True when `latest` was written."""
    try:
        current = store.get_bytes(layout.drafter_latest(name)).decode().strip()
    except NotFound:
        current = None
    if current == version:
        return False
    if current is not None and _NAME_RE.fullmatch(current):
        other = published_lineage(store, name, current)
        if other is not None and other.created_at >= lineage.created_at:
            return False
    store.put_bytes(layout.drafter_latest(name), version.encode())
    return True


def publish(store: ObjectStore, folder: str | os.PathLike[str], lineage: dict[str, Any]) -> DrafterLineage:
    """Upload an exported drafter folder (its files first, `aerie.json` last), then move `latest`.

    `lineage`: the DrafterLineage fields but `files`, which are the uploaded files' sha256. Unless
    it says otherwise, `alignment` is what the store holds of its runs' alignment checks (or that
    there were none): every published drafter says whether it was checked against a serving server."""
    folder = Path(folder)
    name, version = lineage["name"], lineage["version"]
    if lineage.get("alignment") is None:
        lineage = {**lineage, "alignment": lineage_alignment(store, list(lineage["runs"]))}
    files = {f: store.put_file(layout.drafter_file(name, version, f), folder / f) for f in layout.DRAFTER_FILES}
    record = DrafterLineage(**lineage, files=files)
    store.put_json(layout.drafter_lineage(name, version), record)
    store.put_bytes(layout.drafter_latest(name), version.encode())  # last: published_result redoes it
    return record


def pull(store: ObjectStore, ref: str, dest: str | os.PathLike[str]) -> Path:
    """Fetch drafter NAME[:VERSION] into DEST, every file checked against its lineage's sha256."""
    name, version = resolve(store, ref)
    lineage = published_lineage(store, name, version)
    if lineage is None:
        raise NotFound(f"drafter {name}:{version} is not (completely) published in {store.url}")
    unexpected = sorted(set(lineage.files) - set(layout.DRAFTER_FILES))
    missing = sorted(set(layout.DRAFTER_FILES) - set(lineage.files))
    if unexpected or missing:
        raise DrafterError(
            f"{layout.drafter_lineage(name, version)} lists files {sorted(lineage.files)}; a drafter is exactly "
            f"{list(layout.DRAFTER_FILES)}: refused, nothing written"
        )
    dest = Path(os.path.abspath(dest))
    _check_replaceable(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DrafterError(
            f"cannot make {dest.parent} ({type(e).__name__}: {e.strerror}): pull into a folder"
        ) from None
    fresh = Path(tempfile.mkdtemp(prefix=f".{dest.name}.pull-", dir=dest.parent))  # new: no planted links
    try:
        os.chmod(fresh, 0o755)
        for filename in layout.DRAFTER_FILES:  # fixed names: nothing from the bucket becomes a path
            got = store.download(layout.drafter_file(name, version, filename), fresh / filename)
            if got != lineage.files[filename]:
                raise DrafterError(
                    f"{layout.drafter_file(name, version, filename)}: sha256 {got[:12]}… differs from aerie.json's "
                    f"{lineage.files[filename][:12]}…: corrupted or replaced upload; {dest} left as it was"
                )
        (fresh / layout.LINEAGE_FILE).write_bytes(lineage.to_json())
        _swap_in(fresh, dest)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)  # gone after the swap; a failed pull's leftovers
    return dest


def _check_replaceable(dest: Path) -> None:
    """DEST may be absent, or a real folder holding nothing but a pulled drafter's files (a pull
    replaces it whole); anything else is refused before anything is fetched."""
    if dest.is_symlink():
        raise DrafterError(f"{dest} is a symbolic link: refused (pull into a real folder), nothing written")
    if not dest.exists():
        return
    if not dest.is_dir():
        raise DrafterError(f"{dest} exists and is not a folder: pull into a new or a pulled drafter's folder")
    theirs = sorted(e.name for e in os.scandir(dest) if e.name not in (*layout.DRAFTER_FILES, layout.LINEAGE_FILE))
    if theirs:
        raise DrafterError(
            f"{dest} holds files that are not a drafter's ({', '.join(theirs[:5])}): a pull replaces the folder "
            "whole, so it refuses this one; pull into a new folder"
        )


def _swap_in(fresh: Path, dest: Path) -> None:
    """Replace DEST by the verified folder FRESH whole: the old folder is renamed aside, FRESH renamed
    to DEST, then the old one removed (renames within one folder; links inside DEST are never
    followed, only removed with it)."""
    if not dest.exists():
        os.rename(fresh, dest)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
    os.rename(dest, old / "d")
    try:
        os.rename(fresh, dest)
    except OSError:
        os.rename(old / "d", dest)  # put the old one back
        raise
    shutil.rmtree(old, ignore_errors=True)
