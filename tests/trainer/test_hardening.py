"""Issue 35's trainer findings, each against real files and a real S3 server: what a message names
is opened only inside the allowed folders, corrupt inputs are refused by name, a rerun completes a
half-published drafter."""

from __future__ import annotations

import pytest

from aerie.contracts import TrainRequest
from aerie.datasets import DatasetRefused
from aerie_trainer.job import eval_prompts


def _request(**kw) -> TrainRequest:
    return TrainRequest(runs=["r1"], drafter="d", model="/nonexistent", **kw)


def test_eval_prompts_file_outside_the_allowed_folders_is_refused_unopened(s3_store, tmp_path):
    """Finding 7: a message's eval_prompts_file naming a private file was read (and its absence was
    an oracle); now a local path outside AERIE_INGEST_LOCAL_DIRS is refused, present or not."""
    private = tmp_path / "private" / "secret.txt"
    private.parent.mkdir()
    private.write_text("do not read me")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    for name in (str(private), str(tmp_path / "private" / "absent.txt"), f"{allowed}/../private/secret.txt"):
        with pytest.raises(DatasetRefused) as refused:
            eval_prompts(s3_store, _request(eval_prompts_file=name), [allowed])
        assert "AERIE_INGEST_LOCAL_DIRS" in str(refused.value) and "do not read me" not in str(refused.value)
    (allowed / "prompts.txt").write_text("hello\n")
    assert eval_prompts(s3_store, _request(eval_prompts_file=str(allowed / "prompts.txt")), [allowed]) == "hello\n"
    (allowed / "out").symlink_to(private)
    with pytest.raises(DatasetRefused, match="outside"):
        eval_prompts(s3_store, _request(eval_prompts_file=str(allowed / "out")), [allowed])
    s3_store.put_bytes("prompts/p.txt", b"from the store\n")
    assert eval_prompts(s3_store, _request(eval_prompts_file="prompts/p.txt"), []) == "from the store\n"


def test_target_weights_are_read_from_safetensors_only(smollm2_path, tmp_path):
    """Finding 8: a folder with a dummy *.safetensors and a real pytorch_model.bin was loaded from
    the pickle, the content pin covering only the dummy. Now the weight files are exactly what
    `use_safetensors=True` loads, a folder without them is refused by name, and the loaders never
    fall back to `.bin`."""
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from aerie.target import TargetError, describe, weight_files
    from aerie_trainer.evaluate import load_target
    from aerie_trainer.model import DrafterError, load_target_embeddings

    folder = tmp_path / "target"
    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64)
    folder.mkdir()
    cfg.save_pretrained(folder)
    torch.save(LlamaForCausalLM(cfg).state_dict(), folder / "pytorch_model.bin")  # pickled weights
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_path / f, folder / f)
    save_file({"dummy": torch.zeros(1)}, str(folder / "dummy.safetensors"))
    assert (folder / "pytorch_model.bin").is_file()
    with pytest.raises(TargetError, match=str(folder)):
        describe(folder)
    with pytest.raises(DrafterError, match="never pickled"):
        load_target_embeddings(folder)
    with pytest.raises(OSError):  # transformers finds no safetensors weights: the .bin is not loaded
        load_target(folder)
    save_file({"model.embed_tokens.weight": torch.ones(64, 16)}, str(folder / "model.safetensors"))
    assert weight_files(folder) == [folder / "model.safetensors"]
    pin = describe(folder).weights_sha256
    save_file({"dummy": torch.ones(1)}, str(folder / "dummy.safetensors"))  # never loaded: not pinned
    assert describe(folder).weights_sha256 == pin
    assert load_target_embeddings(folder).shape == (64, 16)
