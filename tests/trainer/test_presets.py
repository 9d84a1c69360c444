"""Presets for the targets users train, from the real models' config.json fields (tests/data):
each loads through its contract, fits its model and no other, builds its drafter (on the meta
device: no memory at any size) and asks for no more GPUs than the memory estimate needs. The
parameter counts the evaluation's size threshold reads are the published ones."""

from __future__ import annotations

import base64
import json

import pytest
import redis
import torch

from aerie import layout, presets
from aerie.contracts import IngestRequest, PlannedTraining
from aerie_trainer.model import DrafterConfig, Eagle3Drafter
from aerie_trainer.sizing import FIT_FRACTION, GiB, choose_sharding, target_parameters, training_bytes
from tests.runs import DATA
from tests.workers import CELERY, EXTRACTOR_APP, worker_env

CONFIGS = {  # preset -> (config.json in tests/data, published parameter count in billions)
    "llama-3.1-8b": ("llama_3_1_8b_instruct_config.json", 8.03),
    "qwen3-8b": ("qwen3_8b_config.json", 8.19),
    "qwen3-30b-a3b": ("qwen3_30b_a3b_config.json", 30.5),
    "deepseek-v3": ("deepseek_v3_config.json", 671.0),
    "kimi-k2.5": ("kimi_k25_config.json", 1026.4),  # the language model (Moonshot: "1 T"), vision tower not counted
    "smollm2-135m": ("smollm2_135m_instruct_config.json", 0.135),  # `aerie model prepare smollm2-135m`'s config.json
}


def config(name: str) -> dict:
    return json.loads((DATA / CONFIGS[name][0]).read_text())


def test_every_target_family_has_a_preset():
    assert presets.names() == sorted(CONFIGS)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_preset_builds_its_drafter_from_the_real_config(name):
    preset, cfg = presets.load(name), config(name)
    presets.check_model(preset, cfg)
    train = presets.train_config(name, model_config=cfg)
    assert (train.preset, train.lr, train.ttt_steps, train.max_seq_tokens, train.epochs) == (
        name,
        preset.lr,
        preset.ttt_steps,
        preset.max_seq_tokens,
        preset.epochs,
    )
    assert train.activation_checkpointing is preset.activation_checkpointing
    drafter = DrafterConfig.from_target(cfg, len(preset.capture_points), train.draft_vocab_size, train.drafter)
    with torch.device("meta"):
        model = Eagle3Drafter(drafter)
    shapes = {k: list(v.shape) for k, v in model.exported_state_dict().items()}
    H = preset.hidden_size
    assert shapes["fc.weight"] == [H, len(preset.capture_points) * H] and shapes["lm_head.weight"] == [32000, H]
    assert shapes["t2d"] == [preset.vocab_size]
    # one GPU of the preset's holds a rank's training unsharded (DDP), by the estimate that picks DDP or FSDP
    memory = training_bytes(drafter, train)
    assert memory.total <= FIT_FRACTION * preset.gpu_memory_gib * GiB, memory
    # the published parameter count, within 1%
    assert target_parameters(cfg) / 1e9 == pytest.approx(CONFIGS[name][1], rel=0.01)


ANCHORS = {  # preset -> (lr, epochs, TTT steps, sequence tokens, GPUs, checkpointing, the source it names)
    "deepseek-v3": (5e-5, 10, 7, 2048, 8, False, "SpecForge examples/run_deepseek_v3_671b_eagle3_offline.sh"),
    "kimi-k2.5": (5e-5, 3, 4, 20000, 8, True, "TorchSpec configs/sglang_kimi_k25_2node.yaml"),
}


@pytest.mark.parametrize("name", sorted(ANCHORS))
def test_the_seeds_presets_are_the_anchors_recipes_and_name_them(name):
    """DeepSeek-V3: SpecForge's recipe; Kimi-K2.5: TorchSpec's (long reasoning traces: 20,000-token
    sequences, activation checkpointing) — not the 8B recipe."""
    preset = presets.load(name)
    lr, epochs, ttt, tokens, gpus, ckpt, source = ANCHORS[name]
    assert (preset.lr, preset.epochs, preset.ttt_steps, preset.max_seq_tokens) == (lr, epochs, ttt, tokens)
    assert (preset.train_gpus, preset.activation_checkpointing) == (gpus, ckpt)
    assert preset.source.startswith(source) and preset.batch_tokens >= preset.max_seq_tokens


def test_long_kimi_sequences_fit_one_h200_with_checkpointing():
    """The measured memory model (aerie_trainer.sizing): a 7,168-wide drafter, 164k target vocab,
    TTT 7, 16,384 and 20,000 (TorchSpec's) tokens a rank: within 60% of an H200 (141 GB) with
    activation checkpointing; 20,000 tokens without it do not fit one."""
    drafter = DrafterConfig.from_target(config("kimi-k2.5"), 3, 32000)
    h200 = FIT_FRACTION * 141e9

    def need(tokens: int, ckpt: bool) -> int:
        train = presets.train_config("kimi-k2.5", batch_tokens=tokens, seq_len=tokens, ttt_steps=7)
        return training_bytes(drafter, train.model_copy(update={"activation_checkpointing": ckpt})).total

    assert need(16384, True) < need(20000, True) < 0.6 * h200 < h200 < need(20000, False)


def test_a_preset_for_another_model_is_refused_by_name():
    with pytest.raises(
        presets.PresetError, match=r"preset qwen3-8b is for Qwen/Qwen3-8B; the model differs: .*hidden_size 7168"
    ):
        presets.check_model(presets.load("qwen3-8b"), config("kimi-k2.5"))
    with pytest.raises(presets.PresetError, match="no preset 'llama-3-8b': known presets are deepseek-v3, kimi-k2.5"):
        presets.load("llama-3-8b")


def test_fsdp_is_chosen_when_the_drafter_does_not_fit_one_device():
    """A Kimi-K2.5 drafter (H 7168, 32k draft vocab, the 164k embedding frozen): DDP on 80 GB GPUs,
    FSDP on 48 GB ones (its sharded state then fits), one rank never shards, the setting wins."""
    cfg = config("kimi-k2.5")
    train = presets.train_config("kimi-k2.5")
    memory = training_bytes(DrafterConfig.from_target(cfg, 3, 32000), train)
    assert FIT_FRACTION * 48 * GiB < memory.total < FIT_FRACTION * 80 * GiB
    assert choose_sharding(8, "auto", memory, 80 * GiB)[0] == "ddp"
    kind, why = choose_sharding(8, "auto", memory, 48 * GiB)
    assert kind == "fsdp" and "exceeds" in why and memory.sharded(8) < FIT_FRACTION * 48 * GiB
    assert choose_sharding(1, "auto", memory, 48 * GiB)[0] == "single"
    assert (
        choose_sharding(2, "fsdp", memory, None)[0] == "fsdp" and choose_sharding(2, "auto", memory, None)[0] == "ddp"
    )


def test_enqueue_with_a_preset_sends_its_recipe(private_redis, s3_store, tmp_path):
    """`enqueue --preset llama-3.1-8b --train-drafter`: the ingest message carries the preset's
    capture points, and the run's plan its training recipe, with an explicit option over the preset."""
    import subprocess

    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text((DATA / CONFIGS["llama-3.1-8b"][0]).read_text())
    dataset = tmp_path / "chat.jsonl"
    dataset.write_text(
        json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}) + "\n"
    )
    env = worker_env(s3_store, private_redis)
    base = [
        CELERY,
        "-A",
        EXTRACTOR_APP,
        "enqueue",
        "--dataset",
        str(dataset),
        "--run",
        "llama-run",
        "--model",
        str(model),
        "--train-drafter",
        "llama-eagle3",
    ]
    out = subprocess.run(
        [*base, "--preset", "llama-3.1-8b", "--epochs", "3"], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and f"{dataset} -> " in out.stdout and ": uploaded" in out.stdout, (
        out.stdout + out.stderr
    )
    client = redis.Redis.from_url(private_redis)
    message = json.loads(client.lpop("ingest"))
    request = IngestRequest.model_validate(json.loads(base64.b64decode(message["body"]))[1])
    assert request.capture_points == [2, 16, 29]
    (train_id,) = layout.planned_training_ids("llama-run", s3_store.list(layout.planned_trainings_prefix("llama-run")))
    train = s3_store.get_json(layout.planned_training("llama-run", train_id), PlannedTraining).train.config
    assert (train.preset, train.lr, train.epochs, train.steps, train.ttt_steps, train.grad_clip) == (
        "llama-3.1-8b",
        1e-4,
        3,
        None,
        7,
        0.5,
    )

    wrong = subprocess.run([*base, "--preset", "qwen3-8b"], env=env, capture_output=True, text=True, timeout=120)
    assert wrong.returncode != 0 and "preset qwen3-8b is for Qwen/Qwen3-8B" in wrong.stderr, wrong.stderr
    assert client.llen("ingest") == 0  # nothing sent
    # the same file for another run: the store has it, and says so
    again = subprocess.run(
        [*base[:7], "llama-run-2", *base[8:], "--preset", "llama-3.1-8b"], env=env, capture_output=True, text=True
    )
    assert again.returncode == 0 and "in the store already" in again.stdout, again.stdout + again.stderr
    assert "uploaded" not in again.stdout


def test_every_command_that_trains_takes_the_training_options_under_one_name():
    """`aerie train`, `enqueue --train-drafter` and `aerie run` take the same training options."""
    from aerie.app.options import OPTIONS
    from aerie.app.pipeline import run
    from aerie_extractor.cli import enqueue
    from aerie_trainer.cli import train

    every = {opt for option in OPTIONS.values() for opt in option(lambda: None).__click_params__[0].opts}
    assert "--train-config" in every and "--preset" in every
    for command in (train, enqueue, run):
        flags = {opt for param in command.params for opt in param.opts}
        assert every <= flags, (command.name, every - flags)
    assert "--config" not in {opt for param in train.params for opt in param.opts}


def test_the_ttt_length_follows_the_serving_chain_unless_named():
    """`--speculative-num-steps N` (the chain SGLang will run): TTT steps default to N + TTT_MARGIN,
    over a preset's own TTT length; an explicit `--ttt-steps` wins over both."""
    from aerie.contracts import TTT_MARGIN, TrainConfig

    assert TrainConfig().ttt_steps == 3 + TTT_MARGIN and TrainConfig().speculative_num_steps == 3
    assert TrainConfig(speculative_num_steps=5).ttt_steps == 5 + TTT_MARGIN
    assert TrainConfig(speculative_num_steps=5, ttt_steps=2).ttt_steps == 2
    assert presets.train_config(preset="smollm2-135m").ttt_steps == 7  # the recipe's
    chained = presets.train_config(preset="smollm2-135m", speculative_num_steps=2)
    assert (chained.speculative_num_steps, chained.ttt_steps) == (2, 2 + TTT_MARGIN)
    assert presets.train_config(preset="smollm2-135m", speculative_num_steps=2, ttt_steps=5).ttt_steps == 5
