"""Published drafters through the store alone (aerie.drafters): publish, resolve, pull — and a
bucket that lies cannot make `pull` write anywhere but DEST."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from aerie import drafters, layout
from aerie.contracts import DrafterLineage, EngineSpec, TargetSpec, TrainConfig
from aerie.store import NotFound
from tests.services import clean_env, store_env

TARGET = TargetSpec(
    model="m",
    architecture="LlamaForCausalLM",
    num_layers=30,
    hidden_size=8,
    vocab_size=16,
    weights_sha256="w" * 64,
    tokenizer_sha256="t" * 64,
)


def publish(store, tmp_path, name="smol", version="v1", **more):
    folder = tmp_path / f"export-{version}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    save_file({"fc.weight": np.ones((8, 24), dtype=np.float32)}, str(folder / "model.safetensors"))
    return drafters.publish(
        store,
        folder,
        dict(
            name=name,
            version=version,
            runs=["r1"],
            target=TARGET,
            capture_points=[2, 15, 27],
            exported_layer_ids=[1, 14, 26],
            engine=EngineSpec(name="hf", version="t", convention="hf", layer_ids=[2, 15, 27]),
            exported_convention="sglang-llama",
            draft_vocab_size=4,
            config=TrainConfig(),
            metrics={"acceptance": 1.5},
            **more,
        ),
    )


def test_publish_resolve_pull(store, tmp_path):
    lineage = publish(store, tmp_path)
    assert set(lineage.files) == set(layout.DRAFTER_FILES)
    assert drafters.resolve(store, "smol") == ("smol", "v1") == drafters.resolve(store, "smol:v1")
    dest = drafters.pull(store, "smol", tmp_path / "pulled")
    assert sorted(p.name for p in dest.iterdir()) == ["aerie.json", "config.json", "model.safetensors"]
    assert DrafterLineage.model_validate_json((dest / "aerie.json").read_text()) == lineage
    with pytest.raises(NotFound, match="no drafter 'nope'"):
        drafters.pull(store, "nope", tmp_path / "n")
    with pytest.raises(drafters.DrafterError, match="not a valid name"):
        drafters.pull(store, "../etc", tmp_path / "n")


@pytest.mark.parametrize("name", ["/tmp/aerie-pwned", "../escaped.txt", "sub/dir.json", "extra.py"])
def test_pull_refuses_names_outside_dest(fs_store, tmp_path, name):
    """A bucket writer edits aerie.json's `files` to name a path of their choosing: refused before
    anything is written (on 2026-12-02's code `pull` wrote `dest / name`: an absolute name or
    `..` escaped DEST)."""
    lineage = publish(fs_store, tmp_path)
    files = {**lineage.files, name: lineage.files["config.json"]}
    fs_store.put_bytes(
        layout.drafter_file("smol", "v1", "aerie.json"), lineage.model_copy(update={"files": files}).to_json()
    )
    dest = tmp_path / "d" / "dest"
    with pytest.raises(drafters.DrafterError, match="refused, nothing written"):
        drafters.pull(fs_store, "smol", dest)
    assert not dest.exists() or not any(dest.iterdir())
    assert not (tmp_path / "d" / "escaped.txt").exists()


def test_a_replaced_file_is_refused_and_nothing_moves_into_dest(fs_store, tmp_path):
    publish(fs_store, tmp_path)
    fs_store.put_bytes(layout.drafter_file("smol", "v1", "model.safetensors"), b"not the weights")
    dest = tmp_path / "dest"
    with pytest.raises(drafters.DrafterError, match="sha256"):
        drafters.pull(fs_store, "smol:v1", dest)
    assert not (dest / "model.safetensors").exists() and not (dest / "aerie.json").exists()


def test_a_latest_pointer_naming_a_path_is_refused(fs_store, tmp_path):
    publish(fs_store, tmp_path)
    fs_store.put_bytes(layout.drafter_latest("smol"), b"../../etc")
    with pytest.raises(drafters.DrafterError, match="not a valid name"):
        drafters.pull(fs_store, "smol", tmp_path / "dest")


def test_aerie_pull_needs_only_the_shared_package(s3_store, tmp_path):
    """`aerie pull` as the serve init-container runs it: torch, transformers and the services'
    packages cannot be imported in that process, and it still pulls."""
    publish(s3_store, tmp_path, version="v7")
    blocked = ["torch", "transformers", "aerie_trainer", "aerie_extractor", "aerie_sglang"]
    code = (
        f"import sys\nfor m in {blocked!r}: sys.modules[m] = None  # import of any of them raises\n"
        "from aerie.app.cli import main\nmain()"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, "pull", "smol", str(tmp_path / "out")],
        env=clean_env(**store_env(s3_store)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "smol:v7" in out.stdout and (tmp_path / "out" / "model.safetensors").is_file()


def test_a_name_with_a_trailing_newline_is_refused():
    with pytest.raises(drafters.DrafterError, match="not a valid name"):
        drafters.parse_ref("smol:v1\n")


def test_a_rerun_completes_a_latest_that_a_crash_left_unwritten(s3_store, tmp_path):
    """Finding 4 of issue 35: a crash between `aerie.json` and `latest` left `latest` missing (or
    naming the older version) for good, the rerun saying already_published; now the rerun's
    published_result completes it, and never moves `latest` back from a later version."""
    from aerie.contracts import TrainRequest

    v1 = publish(s3_store, tmp_path, version="v1", created_at="2026-01-01T00:00:00+00:00")
    request = TrainRequest(runs=["r1"], drafter="smol", model="m", train_id="v2")
    v2 = publish(s3_store, tmp_path, version="v2")
    s3_store.put_bytes(layout.drafter_latest("smol"), b"v1")  # as if it died before moving `latest`
    assert drafters.published_result(s3_store, request).already_published
    assert drafters.resolve(s3_store, "smol") == ("smol", "v2")
    s3_store.delete(layout.drafter_latest("smol"))  # as if the first version died before `latest`
    assert drafters.published_result(s3_store, request) is not None
    assert drafters.resolve(s3_store, "smol") == ("smol", "v2")
    older = TrainRequest(runs=["r1"], drafter="smol", model="m", train_id="v1")
    assert drafters.published_result(s3_store, older) is not None and v1.created_at < v2.created_at
    assert drafters.resolve(s3_store, "smol") == ("smol", "v2")  # a rerun of v1 leaves the later one


def test_pull_swaps_the_folder_whole_and_follows_no_planted_link(s3_store, tmp_path):
    """Finding 5 of issue 35: files moved into DEST one at a time (a corrupted v2 left v2's
    config.json beside v1's weights, the error saying nothing moved) and links planted in DEST were
    followed. Now DEST is the old drafter or the new one, and a link in it is replaced, not written
    through."""
    publish(s3_store, tmp_path, version="v1")
    dest = drafters.pull(s3_store, "smol:v1", tmp_path / "dest")
    before = {p.name: p.read_bytes() for p in dest.iterdir()}
    v2 = publish(s3_store, tmp_path, version="v2")
    config = layout.drafter_file("smol", "v2", "config.json")
    s3_store.put_bytes(config, b'{"architectures": ["Other"]}')  # v2's config no longer matches
    weights = layout.drafter_file("smol", "v2", "model.safetensors")
    good_weights = s3_store.get_bytes(weights)
    s3_store.put_bytes(weights, b"corrupted")
    with pytest.raises(drafters.DrafterError, match="left as it was"):
        drafters.pull(s3_store, "smol:v2", dest)
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".dest")) == []  # no leftovers
    s3_store.put_bytes(weights, good_weights)
    s3_store.put_bytes(config, (tmp_path / "export-v2" / "config.json").read_bytes())
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    (dest / layout.LINEAGE_FILE).unlink()
    (dest / layout.LINEAGE_FILE).symlink_to(victim)
    drafters.pull(s3_store, "smol:v2", dest)
    assert victim.read_text() == "mine" and not (dest / layout.LINEAGE_FILE).is_symlink()
    assert DrafterLineage.model_validate_json((dest / layout.LINEAGE_FILE).read_text()) == v2


def test_pull_refuses_a_file_a_link_or_a_foreign_folder_as_dest(fs_store, tmp_path):
    """Finding 10: `aerie pull` into a file path was a traceback; a pull replaces DEST whole, so a
    folder holding anything but a drafter is refused too (by name, nothing written)."""
    publish(fs_store, tmp_path)
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "home")
    for dest, why in (("a-file", "not a folder"), ("home", "notes.txt"), ("link", "symbolic link")):
        with pytest.raises(drafters.DrafterError, match=why):
            drafters.pull(fs_store, "smol", tmp_path / dest)
    assert (tmp_path / "a-file").read_text() == "x" and (tmp_path / "home" / "notes.txt").exists()
    r = subprocess.run(
        [sys.executable, "-m", "aerie.app.cli", "pull", "smol", str(tmp_path / "a-file" / "sub")],
        env=clean_env(**store_env(fs_store)),
        capture_output=True,
        text=True,
    )
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "a-file" in r.stderr, r.stderr
