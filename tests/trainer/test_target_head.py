"""The target's output head, which turns the final states into the training target: read as stored,
the embeddings only where config.json ties them, and a missing or quantized head refused in one
line naming the tensor (never the embeddings of an untied target in its place).

The quantized layouts are the ones real checkpoints carry: compressed-tensors pack-quantized
(`weight_packed` int32 + `weight_scale` + `weight_shape`, Kimi-K2.5's format) and AWQ/GPTQ
(`qweight`/`qzeros`/`scales`); an int8 or fp8 `lm_head.weight` is quantized too.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from aerie_trainer.model import DrafterError, load_target_lm_head

V, H = 32, 16


def target(tmp_path, tensors: dict[str, torch.Tensor], **config):
    folder = tmp_path / "target"
    folder.mkdir()
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": V, "hidden_size": H, "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps({**cfg, **config}))
    embed = torch.randn(V, H, dtype=torch.bfloat16)
    save_file({"model.embed_tokens.weight": embed, **tensors}, str(folder / "model.safetensors"))
    return folder, embed


def test_an_untied_head_is_read_as_stored(tmp_path):
    head = torch.randn(V, H, dtype=torch.bfloat16)
    folder, _ = target(tmp_path, {"lm_head.weight": head})
    assert torch.equal(load_target_lm_head(folder), head)


def test_a_tied_target_gives_its_embeddings(tmp_path):
    folder, embed = target(tmp_path, {}, tie_word_embeddings=True)
    assert torch.equal(load_target_lm_head(folder), embed)


def test_a_missing_head_is_refused_not_replaced_by_the_embeddings(tmp_path):
    folder, _ = target(tmp_path, {"output.weight": torch.randn(V, H)})  # renamed: not guessed
    with pytest.raises(DrafterError, match=r"no 'lm_head.weight' tensor .* does not set tie_word_embeddings"):
        load_target_lm_head(folder)
    (tmp_path / "absent").mkdir()
    folder2, _ = target(tmp_path / "absent", {})  # config.json without the key: untied
    cfg = json.loads((folder2 / "config.json").read_text())
    del cfg["tie_word_embeddings"]
    (folder2 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DrafterError, match="no 'lm_head.weight'"):
        load_target_lm_head(folder2)


@pytest.mark.parametrize(
    "tensors, named",
    [
        (  # compressed-tensors pack-quantized W4A16, group 32
            {
                "lm_head.weight_packed": torch.zeros(V, H // 8, dtype=torch.int32),
                "lm_head.weight_scale": torch.ones(V, H // 32 or 1, dtype=torch.bfloat16),
                "lm_head.weight_shape": torch.tensor([V, H]),
            },
            r"stored quantized \(lm_head.weight_packed, lm_head.weight_scale, lm_head.weight_shape\)",
        ),
        (  # AWQ / GPTQ
            {"lm_head.qweight": torch.zeros(H, V // 8, dtype=torch.int32), "lm_head.scales": torch.ones(1, V)},
            r"stored quantized \(lm_head.qweight, lm_head.scales\)",
        ),
        ({"lm_head.weight": torch.zeros(V, H, dtype=torch.int8)}, r"'lm_head.weight' is stored as int8"),
        (
            {"lm_head.weight": torch.zeros(V, H, dtype=torch.float8_e4m3fn)},
            r"'lm_head.weight' is stored as float8_e4m3fn",
        ),
    ],
)
def test_a_quantized_head_is_refused_naming_the_tensor(tmp_path, tensors, named):
    from aerie.errors import ExpectedError

    folder, _ = target(tmp_path, tensors)
    with pytest.raises(DrafterError, match=named) as refused:
        load_target_lm_head(folder)
    assert isinstance(refused.value, ExpectedError) and "\n" not in str(refused.value)  # one line, no traceback


def test_a_head_of_another_shape_is_refused(tmp_path):
    folder, _ = target(tmp_path, {"lm_head.weight": torch.randn(V + 8, H)})
    with pytest.raises(DrafterError, match=r"'lm_head.weight' is \[40, 16\], not \(vocab_size, hidden_size\)"):
        load_target_lm_head(folder)
