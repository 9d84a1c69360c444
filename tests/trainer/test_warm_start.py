"""Warm start (`init_from`, aerie_trainer.warm_start): training begins from an existing drafter —
the shared trained drafter (tests/trained.py) written the way SpecForge exports one — and a
source that does not fit the run is refused in one line before anything trains."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import load_file, save_file

from aerie import drafters, layout
from aerie.contracts import TrainConfig, TrainRequest
from aerie.settings import Settings
from aerie.stages import train as run_train
from aerie_trainer.export import export
from aerie_trainer.model import build_drafter, load_target_config
from aerie_trainer.trainer import Trainer, setup_dist
from aerie_trainer.warm_start import WarmStartError, load_into
from tests.runs import hidden_run_folder, upload_run

POINTS, LAYER_IDS = [2, 15, 27], [1, 14, 26]  # the test run's capture points, SGLang's ids for them
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


@pytest.fixture(scope="module")
def sharegpt_run(cache_dir, smollm2_path) -> Path:
    """The trainer tests' run (trainer/test_train.py): hidden states at [2, 15, 27] + final."""
    return hidden_run_folder(cache_dir, smollm2_path, records=160, max_tokens=192, shard_sequences=16)


def specforge_export(pulled: Path, dest: Path) -> Path:
    """A drafter folder as SpecForge's SGLang exporter writes it (specforge/export/to_sglang.py:
    transformers' save_pretrained of its LlamaForCausalLMEagle3): the config keys of its
    configs/*-eagle3.json (no eagle_config: SGLang's default layers, [2, N//2, N-3]), its tensor
    names (its exporter's weight map is the identity onto `fc`, `midlayer.*`, `norm`, `lm_head`,
    `d2t`, `t2d`), bf16, split in two shards with their index."""
    ours = json.loads((pulled / "config.json").read_text())
    keep = (
        "architectures",
        "bos_token_id",
        "eos_token_id",
        "head_dim",
        "hidden_act",
        "hidden_size",
        "intermediate_size",
        "max_position_embeddings",
        "model_type",
        "num_attention_heads",
        "num_hidden_layers",
        "num_key_value_heads",
        "pad_token_id",
        "rms_norm_eps",
        "rope_theta",
        "tie_word_embeddings",
        "vocab_size",
        "draft_vocab_size",
    )
    config = {k: ours[k] for k in keep} | {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "rope_scaling": None,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
    }
    dest.mkdir(parents=True)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(pulled / "model.safetensors")
    names = sorted(weights)
    parts = {SHARDS[0]: names[: len(names) // 2], SHARDS[1]: names[len(names) // 2 :]}
    for file, part in parts.items():
        save_file({n: weights[n] for n in part}, str(dest / file), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": {n: f for f, part in parts.items() for n in part}}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return dest


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_warm_start_from_a_specforge_export(trained_smol, fs_store, sharegpt_run, smollm2_path, tmp_path):
    """Step 0 holds the SpecForge folder's weights and vocabulary exactly; the job begins at the
    source's acceptance (not an untrained drafter's), trains on, and its lineage names the
    source and its files' sha256; a resumed job loads its checkpoint, not the source again."""
    source = specforge_export(trained_smol.folder, tmp_path / "specforge")
    exported = {n: t for f in SHARDS for n, t in load_file(source / f).items()}
    upload_run(fs_store, sharegpt_run, "sharegpt")
    cfg = TrainConfig(
        draft_vocab_size=4096,  # the source's
        ttt_steps=2,
        steps=2,
        batch_tokens=64,
        max_seq_tokens=64,
        lr=3e-3,
        checkpoint_every=1,
        eval_prompts=0,
        holdout_fraction=0.1,
        init_from=str(source),
    )
    request = TrainRequest(runs=["sharegpt"], drafter="warm", model=str(smollm2_path), config=cfg, train_id="warm")

    trainer = Trainer(fs_store, request, setup_dist("cpu"), trackers=[])
    start = trainer.drafter.exported_state_dict()
    assert sorted(start) == sorted(exported)
    for name, tensor in exported.items():  # bf16 values, held exactly in the float32 master weights
        assert start[name].equal(tensor.to(start[name].dtype)), name
    trainer.tracking.close()

    result = run_train(fs_store, Settings(store=f"file://{fs_store.root}"), request)
    assert result.steps == 2 and all(math.isfinite(loss) for loss in result.losses)
    cold = trained_smol.result["simulated_acceptance_untrained"]  # the source's own start, untrained
    print(json.dumps({"warm_start": result.simulated_acceptance_untrained, "cold_start": cold}))
    assert result.simulated_acceptance_untrained > cold + 0.15
    published = st_load(fs_store.get_bytes(layout.drafter_prefix("warm", result.version) + "model.safetensors"))
    assert published["d2t"].equal(exported["d2t"]) and published["t2d"].equal(exported["t2d"])
    assert not published["fc.weight"].equal(exported["fc.weight"])  # trained on
    origin = drafters.published_lineage(fs_store, "warm", result.version).init_from
    assert (origin.source, origin.format, origin.drafter) == (str(source), "eagle3", None)
    read = ["config.json", *SHARDS]
    assert origin.files == {f: hashlib.sha256((source / f).read_bytes()).hexdigest() for f in read}

    shutil.rmtree(source)  # a resumed job loads its checkpoint: the source is not read again
    again = Trainer(fs_store, request, setup_dist("cpu"), trackers=[])
    assert again.resumed_from == 2
    assert again.drafter.fc.weight.to(torch.bfloat16).equal(published["fc.weight"])
    again.tracking.close()


@pytest.fixture(scope="module")
def aerie_drafter(smollm2_path, tmp_path_factory) -> Path:
    """A random drafter for the target (256 draft tokens), exported as aerie publishes one."""
    drafter = build_drafter(smollm2_path, len(POINTS), 256)
    drafter.set_vocab(torch.arange(0, 512, 2))
    return export(drafter, tmp_path_factory.mktemp("aerie-drafter"), LAYER_IDS, load_target_config(smollm2_path))


def fresh(smollm2_path, draft_vocab: int = 256):
    return build_drafter(smollm2_path, len(POINTS), draft_vocab)


def start(drafter, store, ref) -> object:
    return load_into(drafter, store, str(ref), POINTS, "LlamaForCausalLM", 30)


def refusal(drafter, store, ref) -> str:
    with pytest.raises(WarmStartError) as e:
        start(drafter, store, ref)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_published_drafter_by_name_and_its_sglang_names(aerie_drafter, fs_store, smollm2_path, tmp_path):
    """NAME:VERSION pulls the published drafter (each file's sha256 checked) and names it in the
    origin; a folder whose tensors carry SGLang's `layers.0.` names loads the same weights."""
    from aerie.target import describe

    target = describe(smollm2_path)
    engine = {"name": "hf", "version": "0", "convention": "hf", "layer_ids": POINTS}
    drafters.publish(
        fs_store,
        aerie_drafter,
        dict(
            name="src",
            version="v1",
            runs=["r"],
            target=target,
            engine=engine,
            capture_points=POINTS,
            exported_layer_ids=LAYER_IDS,
            exported_convention="sglang-llama",
            draft_vocab_size=256,
            config=TrainConfig(),
            metrics={},
        ),
    )
    by_name = fresh(smollm2_path)
    origin = start(by_name, fs_store, "src")
    assert (origin.source, origin.drafter, origin.format) == ("src", "src:v1", "aerie")
    assert origin.files == {
        f: hashlib.sha256((aerie_drafter / f).read_bytes()).hexdigest() for f in layout.DRAFTER_FILES
    }
    source = load_file(aerie_drafter / "model.safetensors")
    for name, tensor in by_name.exported_state_dict().items():
        assert tensor.equal(source[name].to(tensor.dtype)), name

    sglang = tmp_path / "sglang-names"
    sglang.mkdir()
    shutil.copy(aerie_drafter / "config.json", sglang)
    save_file({n.replace("midlayer.", "layers.0."): t for n, t in source.items()}, str(sglang / "model.safetensors"))
    renamed = fresh(smollm2_path)
    assert start(renamed, fs_store, sglang).format == "eagle3"
    assert all(t.equal(by_name.exported_state_dict()[n]) for n, t in renamed.exported_state_dict().items())


def test_a_source_that_does_not_fit_is_refused_in_one_line(aerie_drafter, fs_store, smollm2_path, tmp_path):
    # a shape that differs: the tensor and both shapes, and what sets it
    message = refusal(fresh(smollm2_path, draft_vocab=128), fs_store, aerie_drafter)
    assert "tensor lm_head.weight has shape [256, 576], this run's drafter [128, 576] (set by --draft-vocab)" in message

    weights = load_file(aerie_drafter / "model.safetensors")
    missing = tmp_path / "missing"
    missing.mkdir()
    shutil.copy(aerie_drafter / "config.json", missing)
    save_file({n: t for n, t in weights.items() if n != "norm.weight"}, str(missing / "model.safetensors"))
    assert "no tensor norm.weight (this run's drafter has it, shape [576])" in refusal(
        fresh(smollm2_path), fs_store, missing
    )

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(aerie_drafter / "config.json", pickled)
    (pickled / "pytorch_model.bin").write_bytes(b"never opened")
    assert "pytorch_model.bin are pickled and never loaded" in refusal(fresh(smollm2_path), fs_store, pickled)

    other_layers = tmp_path / "other-layers"
    shutil.copytree(aerie_drafter, other_layers)
    config = json.loads((other_layers / "config.json").read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 14, 26]
    (other_layers / "config.json").write_text(json.dumps(config))
    message = refusal(fresh(smollm2_path), fs_store, other_layers)
    assert "trained at capture points [3, 15, 27] (layer ids [2, 14, 26]), the run's are [2, 15, 27]" in message

    assert "no such folder, nor a published drafter" in refusal(fresh(smollm2_path), fs_store, "nothing-here")


def test_an_mla_drafter_starts_from_an_mla_folder_and_a_llama_one_is_refused(deepseek_tiny, tmp_path):
    """--drafter-arch mla: the source's MLA tensors load into the run's MLA drafter, every one; a
    Llama-layer run refuses the MLA folder by its architecture, naming the flag."""
    from aerie.contracts import DrafterShape
    from aerie.store import FsStore

    mla = DrafterShape(arch="mla")
    source = build_drafter(deepseek_tiny, num_aux=3, draft_vocab_size=64, shape=mla)
    source.set_vocab(torch.arange(5, 5 + 64))
    folder = export(source, tmp_path / "mla", [3, 4, 6], load_target_config(deepseek_tiny))
    store = FsStore(tmp_path / "store")
    run = build_drafter(deepseek_tiny, num_aux=3, draft_vocab_size=64, shape=mla)
    origin = load_into(run, store, str(folder), [3, 4, 6], "DeepseekV3ForCausalLM", 8)
    assert origin.format == "eagle3" and set(origin.files) == {"config.json", "model.safetensors"}
    for name, t in source.exported_state_dict().items():
        want = t.to(torch.bfloat16).float() if t.is_floating_point() else t
        assert torch.equal(run.exported_state_dict()[name], want), name
    llama = build_drafter(deepseek_tiny, num_aux=3, draft_vocab_size=64)
    with pytest.raises(
        WarmStartError, match=r"the source is a mla drafter, this run's is llama \(--drafter-arch mla\)"
    ):
        load_into(llama, store, str(folder), [3, 4, 6], "DeepseekV3ForCausalLM", 8)
