"""The alignment check's parts without a server: where reports live, which sequences are drawn, how
rows are read, the target's lm_head, the causes named from measurements, and the lineage.

The measurements against real SGLang (same engine, off by one, quantized) are in test_align.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from aerie import layout
from aerie.contracts import (
    AlignmentReport,
    CosineStats,
    PointAlignment,
    RunSpec,
    SampledSequence,
    ServerIdentity,
    SignalAlignment,
    TokenizationCheck,
)
from aerie.settings import Settings
from aerie.shard import pack
from aerie_extractor.align import (
    LmHead,
    ShardRows,
    diagnose,
    draw_sample,
    first_difference,
    neighbour_layer_ids,
    thresholds,
)

POINTS = [2, 15, 27]


def test_reports_live_beside_the_run_and_names_are_checked():
    key = layout.alignment_report("r1", "SmolLM2-abc123")
    assert key == "runs/r1/align/SmolLM2-abc123.json"
    listing = [
        key,
        "runs/r1/align/other-1.json",
        "runs/r1/align/x/../evil.json",
        "runs/r1/align/.tmp",
        "runs/r2/align/a.json",
    ]
    assert layout.alignment_server_ids("r1", listing) == ["SmolLM2-abc123", "other-1"]
    for bad in ("../x", "a/b", ""):
        with pytest.raises(ValueError, match="not a valid name"):
            layout.alignment_report("r1", bad)


def test_neighbour_ids_follow_the_capture_convention():
    # Llama/Qwen on SGLang: id l is point l+1
    assert neighbour_layer_ids(POINTS, "sglang-llama", 30) == [0, 1, 2, 13, 14, 15, 25, 26, 27]
    # DeepSeek rule: point 1 cannot lead (id 1 switches on the +1), so the set starts at point 2
    assert neighbour_layer_ids([2, 4, 5], "sglang-deepseek", 8) == [1, 2, 3, 4, 5]


def test_thresholds_follow_the_less_precise_dtype():
    settings = Settings(align_min_cosine={"bfloat16": 0.998})  # a partial override keeps the other defaults
    assert thresholds(settings, "float32", "float32") == ("float32", 0.9999, 0.999)
    assert thresholds(settings, "bfloat16", "float32") == ("bfloat16", 0.998, 0.995)
    assert thresholds(settings, "float32", "float16")[0] == "float16"
    assert thresholds(settings, "float32", "auto")[0] == "float32"
    with pytest.raises(ValueError, match="AERIE_ALIGN_MIN_COSINE names \\['bf16'\\]"):
        Settings(align_min_cosine={"bf16": 0.9})


def _shard(lengths: list[int], K: int = 3, H: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    rows = [
        {
            "input_ids": rng.integers(0, 100, n).astype(np.int32),
            "loss_mask": np.ones(n, np.uint8),
            "aux": rng.standard_normal((n, K, H)).astype(np.float32),
            "final": rng.standard_normal((n, H)).astype(np.float32),
        }
        for n in lengths
    ]
    return pack(rows, POINTS), rows


def test_the_sample_is_drawn_by_seed_and_read_by_byte_ranges(store):
    from aerie.contracts import ShardRecord

    shards = {}
    for index, lengths in enumerate([[5, 7, 3], [9, 4], [6]]):
        name = layout.shard_name(index)
        shard, rows = _shard(lengths, seed=index)
        key = layout.shard("r", "hidden", name)
        sha = store.put_bytes(key, shard.to_bytes())
        store.put_json(
            layout.shard_record("r", "hidden", name),
            ShardRecord(
                run="r",
                shard=name,
                kind="hidden",
                key=key,
                sha256=sha,
                bytes=0,
                sequences=len(lengths),
                tokens=sum(lengths),
                loss_tokens=0,
            ),
        )
        shards[name] = rows
    first = draw_sample(store, "r", 4, seed=7)
    assert [(r.shard, s) for r, s in first] == [(r.shard, s) for r, s in draw_sample(store, "r", 4, seed=7)]
    assert [(r.shard, s) for r, s in draw_sample(store, "r", 10, seed=1)] == [
        ("000000", 0),
        ("000000", 1),
        ("000000", 2),
        ("000001", 0),
        ("000001", 1),
        ("000002", 0),
    ]  # all six, in order
    for record, s in first:
        got = ShardRows(store, record.key).sequence(s, max_tokens=4, names=("input_ids", "aux", "final", "topk_ids"))
        want = shards[record.shard][s]
        assert set(got) == {"input_ids", "aux", "final"}
        for name in got:
            np.testing.assert_array_equal(got[name], want[name][:4])


def test_lm_head_from_safetensors_is_the_targets(smollm2_path):
    import torch
    from safetensors.torch import load_file

    weight = load_file(str(smollm2_path / "model.safetensors"))["model.embed_tokens.weight"].float()  # tied
    head = LmHead(smollm2_path)
    final = torch.randn(6, weight.shape[1]) * 3
    ids = torch.tensor([[0, 5, 7]] * 6)
    top, logprobs = head.logits_stats(final.numpy(), ids.numpy())
    want = torch.log_softmax(final @ weight.T, dim=-1)
    assert head.name.endswith("model.embed_tokens.weight")
    np.testing.assert_array_equal(top, want.argmax(-1).numpy())
    np.testing.assert_allclose(logprobs, want.gather(1, ids).numpy(), atol=2e-4)


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


# --------------------------------------------------------------------------------------
# Causes from measurements (the figures below are the ones measured against SGLang)
# --------------------------------------------------------------------------------------
def _run_spec(smollm2_path) -> RunSpec:
    from aerie.contracts import EngineSpec, IngestOptions
    from aerie.target import describe

    return RunSpec(
        run="r",
        dataset="d",
        target=describe(smollm2_path),
        capture_points=POINTS,
        dtype="bfloat16",
        engine=EngineSpec(name="hf", version="5.17.0", convention="hf", layer_ids=POINTS),
        ingest=IngestOptions(),
    )


def _server(ids, points, **kw) -> ServerIdentity:
    return ServerIdentity(
        url="http://s",
        server_id="s-1",
        model_path="/m",
        architecture="LlamaForCausalLM",
        sglang_version="0.5.23",
        dtype="float32",
        aux_layer_ids=ids,
        aux_points=points,
        transport="json",
        **kw,
    )


def _point(p, cos: dict[int, float], passed=False) -> PointAlignment:
    at = CosineStats(mean=cos[p], p1=cos[p] - 0.01, min=cos[p] - 0.02, rel_l2=0.1, tokens=10) if p in cos else None
    return PointAlignment(point=p, at_point=at, best_point=max(cos, key=cos.get), cosines=cos, passed=passed)


def test_states_one_layer_deeper_than_their_labels_are_named_an_off_by_one(smollm2_path):
    run = _run_spec(smollm2_path)
    server = _server([0, 1, 2, 13, 14, 15, 25, 26, 27], [1, 2, 3, 14, 15, 16, 26, 27, 28])
    points = [
        _point(2, {1: 0.83, 2: 0.9605, 3: 0.99999}),
        _point(15, {14: 0.95, 15: 0.9708, 16: 0.99992}),
        _point(27, {26: 0.94, 27: 0.9492, 28: 0.99985}),
    ]
    causes = diagnose(run, server, points, None, TokenizationCheck(checked=4), 0.999, 0.9)
    assert causes[0].startswith(
        "every point matches the server's point +1: the run's states were captured 1 layer(s) deeper"
    )
    assert (
        causes[1]
        == "point 2 matches the server's point 3 (cos 0.99999; at its own point cos 0.9605): an off-by-one in the layer ids"
    )
    assert len(causes) == 4


def test_a_server_given_the_points_as_ids_is_named_an_off_by_one(smollm2_path):
    run = _run_spec(smollm2_path)
    server = _server([2, 15, 27], [3, 16, 28])  # the hf convention's ids given to SGLang
    points = [
        _point(2, {3: 0.9605, 16: 0.2, 28: 0.1}),
        _point(15, {3: 0.2, 16: 0.9708, 28: 0.5}),
        _point(27, {3: 0.1, 16: 0.5, 28: 0.9492}),
    ]
    (cause,) = diagnose(run, server, points, None, TokenizationCheck(), 0.999, 0.9)
    assert "does not capture point(s) [2, 15, 27]" in cause
    assert "the server's layer ids [2, 15, 27] are the run's ids [1, 14, 26] off by +1" in cause
    assert "point 15 is closest to the server's point 16 (cos 0.9708)" in cause
    assert cause.endswith(
        "--return-aux-hidden-state-layer-ids 0 1 2 13 14 15 25 26 27 (the run's points and their neighbours)"
    )


def test_every_point_lower_at_its_own_layer_names_quantization(smollm2_path):
    run = _run_spec(smollm2_path)
    server = _server([0, 1, 2, 13, 14, 15, 25, 26, 27], [1, 2, 3, 14, 15, 16, 26, 27, 28], weights_sha256="f" * 64)
    points = [
        _point(2, {1: 0.82, 2: 0.9966, 3: 0.957}),
        _point(15, {14: 0.959, 15: 0.9812, 16: 0.956}),
        _point(27, {26: 0.943, 27: 0.9690, 28: 0.922}),
    ]
    signal = SignalAlignment(signal="final", top1_agreement=0.72, passed=False)
    (cause,) = diagnose(run, server, points, signal, TokenizationCheck(), 0.999, 0.9)
    assert cause.startswith("every point at a lower cosine, matching its own layer best (2: 0.9966")
    assert "top-1 agreement 72.0%" in cause and "a different quantization or dtype than the run" in cause
    assert "re-quantized or modified weights" in cause


def test_a_tokenizer_difference_is_named_with_its_position(smollm2_path):
    run = _run_spec(smollm2_path)
    server = _server([1, 14, 26], POINTS)
    points = [_point(p, {p: 1.0}, passed=True) for p in POINTS]
    tokens = TokenizationCheck(checked=1, differs_at=17, sample=0, run_token="28 'Ġthe'", server_token="262 'Ġth'")
    (cause,) = diagnose(run, server, points, None, tokens, 0.999, 0.9)
    assert cause.startswith(
        "tokenization differs at position 17 of sample 0 (run's tokenizer: 28 'Ġthe', server: 262 'Ġth')"
    )


# --------------------------------------------------------------------------------------
# The lineage records the checks (read through the store by the shared library)
# --------------------------------------------------------------------------------------
def _report(run: str, server_id: str, passed: bool) -> AlignmentReport:
    return AlignmentReport(
        run=run,
        server=_server([1, 14, 26], POINTS).model_copy(update={"server_id": server_id}),
        run_dtype="bfloat16",
        precision="bfloat16",
        min_cosine=0.999,
        min_cosine_p1=0.995,
        min_top1=0.9,
        seed=0,
        samples=[SampledSequence(shard="000000", sequence=0, tokens=10)],
        tokens=10,
        points=[_point(p, {p: 0.99995 if passed else 0.97}, passed=passed) for p in POINTS],
        passed=passed,
        causes=[] if passed else ["every point at a lower cosine"],
    )


def test_every_published_drafter_says_whether_it_was_checked(fs_store, tmp_path):
    from aerie import drafters, runs

    folder = tmp_path / "drafter"
    folder.mkdir()
    for name in layout.DRAFTER_FILES:
        (folder / name).write_bytes(b"{}")
    spec = json.loads(json.dumps({"runs": ["r1"]}))
    lineage = dict(
        name="d",
        version="v1",
        **spec,
        target=_run_spec_dict(),
        engine={"name": "hf", "version": "5", "convention": "hf", "layer_ids": POINTS},
        capture_points=POINTS,
        exported_layer_ids=[1, 14, 26],
        exported_convention="sglang-llama",
        draft_vocab_size=8,
        config={},
        metrics={},
    )
    unchecked = drafters.publish(fs_store, folder, lineage).alignment
    assert (
        unchecked.checked is False
        and unchecked.passed is None
        and "aerie align --run RUN --server URL" in unchecked.note
    )

    fs_store.put_json(layout.alignment_report("r1", "quant-1"), _report("r1", "quant-1", passed=False))
    fs_store.put_json(layout.alignment_report("r1", "same-1"), _report("r1", "same-1", passed=True))
    assert [r.server.server_id for r in runs.alignment_reports(fs_store, "r1")] == ["quant-1", "same-1"]
    checked = drafters.publish(fs_store, folder, {**lineage, "version": "v2"}).alignment
    assert checked.checked and checked.passed is False
    assert [(r.server_id, r.passed, r.point_cosines[15]) for r in checked.reports] == [
        ("quant-1", False, 0.97),
        ("same-1", True, 0.99995),
    ]
    assert checked.note == "trained despite failed check(s): r1 vs quant-1"
    assert drafters.published_lineage(fs_store, "d", "v2").alignment == checked


def _run_spec_dict() -> dict:
    return {
        "model": "m",
        "architecture": "LlamaForCausalLM",
        "num_layers": 30,
        "hidden_size": 576,
        "vocab_size": 49152,
        "weights_sha256": "0" * 64,
        "tokenizer_sha256": "0" * 64,
    }


def test_fp8_runs_are_compared_as_their_dequantized_states(store):
    """`aerie align` reads an fp8 run's rows by byte range and compares the states every reader gets."""
    from aerie.shard import Shard

    shard, _ = _shard([5, 7], seed=3)
    fp8 = shard.quantize()
    key = layout.shard("r8", "hidden", "000000")
    store.put_bytes(key, fp8.to_bytes())
    got = ShardRows(store, key).sequence(1, max_tokens=4, names=("aux", "final"))
    want = Shard.from_buffer(store.get_bytes(key)).sequence(1)
    for name in ("aux", "final"):
        assert got[name].dtype == shard.aux.dtype  # the run's dtype, not e4m3
        np.testing.assert_array_equal(got[name], want[name][:4])


def test_the_served_quantization_is_read_from_the_models_config(smollm2_path, cache_dir):
    """SGLang leaves `quantization` unset in /server_info when it detects the method from the
    model's config.json (server_args 'quantization': None for the W4A16 folder below, seen on
    0.5.23): `aerie align` names it from the config then. The W4A16 folder is a real
    compressed-tensors checkpoint (tests/quantized_w4a16.py: the library writes it)."""
    from safetensors import safe_open

    from aerie.target import load_config, quantization_of
    from aerie_extractor.align import served_quantization
    from tests.quantized_w4a16 import smollm2_w4a16

    w4a16 = smollm2_w4a16(cache_dir, smollm2_path)
    config = load_config(w4a16)
    named = "compressed-tensors pack-quantized W4A16 int group 32"
    assert quantization_of(config) == named
    assert served_quantization({"quantization": None}, config) == named
    assert served_quantization({"quantization": "awq"}, config) == "awq"  # the server's argument first
    assert served_quantization({}, load_config(smollm2_path)) is None  # plain bf16: none
    with safe_open(str(w4a16 / "model.safetensors"), "pt") as f:
        packed = f.get_slice("model.layers.0.self_attn.q_proj.weight_packed")
        assert packed.get_dtype() == "I32" and packed.get_shape() == [576, 576 // 8]
        assert "model.layers.0.self_attn.q_proj.weight" not in f.keys()
    # Kimi-K2.5's form (its text_config holds the model), and DeepSeek-V3's fp8
    kimi = {
        "text_config": {
            "quantization_config": {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "input_activations": None,
                        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32},
                    }
                },
                "ignore": ["lm_head"],
            }
        }
    }
    assert quantization_of(kimi) == named
    fp8 = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert quantization_of(fp8) == "fp8 block 128x128"
    assert quantization_of({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}}) == (
        "awq 4-bit group 128"
    )


def test_the_w4a16_checkpoint_holds_the_int4_weights_compressed_tensors_defines(smollm2_path, cache_dir):
    """The folder is the format compressed-tensors defines, not an imitation: the library's own
    unpacking of a stored weight, times its group scales, is the bf16 source within half an int4
    step of each group (transformers loads the folder too, decompressing it the same way)."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file

    from tests.quantized_w4a16 import smollm2_w4a16

    stored = load_file(str(smollm2_w4a16(cache_dir, smollm2_path) / "model.safetensors"))
    want = load_file(str(smollm2_path / "model.safetensors"))["model.layers.3.mlp.down_proj.weight"].float()
    name = "model.layers.3.mlp.down_proj"
    shape = torch.Size(stored[f"{name}.weight_shape"].tolist())
    q = unpack_from_int32(stored[f"{name}.weight_packed"], 4, shape).float()
    assert shape == want.shape and q.min() >= -8 and q.max() <= 7
    scale = stored[f"{name}.weight_scale"].float()  # [out, in / 32]
    got = (q.reshape(shape[0], -1, 32) * scale[..., None]).reshape(shape)
    err = (got - want).abs().reshape(shape[0], -1, 32)
    assert err.max() > 0 and (err <= scale[..., None] * 0.55).all()  # half a step, and bf16 scales' rounding


def test_transformers_loads_the_w4a16_target_dequantized_once(smollm2_path, cache_dir):
    """`hf_load_kwargs`: what the hf engine, the trainer's evaluation and the tests pass to
    `from_pretrained`: a compressed-tensors folder comes back as plain Linear weights holding the
    library's dequantization, `q * scale` (exact in float32), and forwards as a plain matmul; a plain
    folder gets nothing."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from aerie.target import hf_load_kwargs
    from tests.quantized_w4a16 import smollm2_w4a16

    assert hf_load_kwargs(smollm2_path) == {}
    w4a16 = smollm2_w4a16(cache_dir, smollm2_path)
    (config,) = hf_load_kwargs(w4a16).values()
    assert config.quant_method == "compressed-tensors" and config.dequantize is True
    model = AutoModelForCausalLM.from_pretrained(w4a16, dtype=torch.float32, **hf_load_kwargs(w4a16))
    layer = model.model.layers[3].mlp.down_proj
    stored = load_file(str(w4a16 / "model.safetensors"))
    name = "model.layers.3.mlp.down_proj"
    q = unpack_from_int32(stored[f"{name}.weight_packed"], 4, layer.weight.shape).float()
    scale = stored[f"{name}.weight_scale"].float()
    assert torch.equal(layer.weight, (q.reshape(q.shape[0], -1, 32) * scale[..., None]).reshape(q.shape))
    x = torch.randn(2, layer.in_features)
    assert torch.equal(layer(x), x @ layer.weight.T)  # no quantize-dequantize of the activations
