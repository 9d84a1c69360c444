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


def publish(store, tmp_path, name="smol", version="v1"):
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
