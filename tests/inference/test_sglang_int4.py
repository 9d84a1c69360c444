"""A real INT4 target end to end through real SGLang 0.5.23 on the CPU: Kimi-K2.5's format.

The target is SmolLM2-135M written as compressed-tensors W4A16 `pack-quantized` by the
compressed-tensors library (tests/quantized_w4a16.py: 4-bit symmetric, groups of 32, every decoder
Linear, `lm_head` left out). SGLang loads it with its own config parsing, loader and scheme selection
(`CompressedTensorsWNA16`); only the missing CPU kernel is aerie's (`aerie_sglang/cpu/int4.py`:
compressed-tensors' own unpacking and dequantization once after loading, then a matmul in the
server's dtype). transformers (the reference) loads the same checkpoint dequantized
(`aerie.target.hf_load_kwargs`).

- the CPU path's weights are compressed-tensors' own decompression, bit for bit, and an independent
  reading of the format (eight 4-bit values to an int32, value i at bits 4i, stored +8);
- float32 activations (accepted by the CPU path for this): the INT4 server's greedy text equals
  transformers' on the dequantized weights, and capture through it (aerie's binary plugin) equals
  transformers at every captured point and the final state;
- `aerie align` against it names the real quantization (read from config.json: SGLang leaves it
  unset) and tells the INT4 target's run (passes) from the bf16 target's (fails, quantization named);
- a drafter trained by the pipeline on the INT4 target's states exports, and SGLang serves it on the
  INT4 target with the text of greedy decoding and its acceptance equal to the project's loop;
- bfloat16, W4A16 proper (a 16-bit matmul of the dequantized weight, as SGLang serves the checkpoint
  on a GPU): the states at every point are transformers' bf16 ones up to bf16's rounding, far
  closer than the unquantized target's; greedy text is measured, not asserted (bf16 logits tie).

Servers: the float32 capture server (module-scoped, started in the background while the first
test runs), the drafter's, and the bfloat16 one; at most two at a time.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from tests.runs import hidden_run_folder, upload_run
from tests.sglang_server import REPO, capture_args, serve_server, sglang_python, sglang_server, start_soon

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

POINTS = [2, 15, 27]  # SmolLM2-135M, N = 30: the default points
N = 30
QUANTIZATION = "compressed-tensors pack-quantized W4A16 int group 32"
PROMPTS = [
    "What is the capital of France? Explain briefly.",
    "Write a short poem about the sea.",
    "Name three prime numbers.",
    "How do I boil an egg?",
]
MAX_NEW_TOKENS, STEPS = 32, 3  # the drafter's served text (32 tokens of plain greedy as well)
GREEDY_TOKENS, BF16_GREEDY_TOKENS = 16, 8  # the capture servers' own greedy text (bf16 decoding is slow here)
EAGLE_ENV = {"TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": "1"}
RUN_RECORDS, RUN_TOKENS = 96, 128
SAMPLES, ALIGN_TOKENS = 4, 96
AGREEMENT_TOLERANCE = 0.05  # |SGLang's acceptance - the project's loop's|, over the prompt set
CAPTURE_TOLERANCE = 1e-3  # max abs diff, float32 (states reach ~3e3 in SmolLM2's middle layers; measured 0.0)
DTYPE = "float32"


@pytest.fixture(scope="module")
def w4a16(cache_dir, smollm2_path) -> Path:
    from tests.quantized_w4a16 import smollm2_w4a16

    return smollm2_w4a16(cache_dir, smollm2_path)


@pytest.fixture(scope="module")
def server_ids() -> list[int]:
    from aerie_extractor.align import neighbour_layer_ids

    return neighbour_layer_ids(POINTS, "sglang-llama", N)  # the points and their neighbours: 9 layers


@pytest.fixture(scope="module")
def capture_starting(w4a16, server_ids, tmp_path_factory):
    """The INT4 target in capture mode, float32, aerie's binary plugin on; started in the
    background by the first test (which needs no server)."""
    shm = tmp_path_factory.mktemp("capture-shm")
    env = {"AERIE_SGLANG_BINARY": "1", "AERIE_CAPTURE_DIR": str(shm)}
    starting = start_soon(
        sglang_server(capture_args(w4a16, server_ids, dtype=DTYPE), env=env, log_dir=tmp_path_factory.mktemp("int4"))
    )
    try:
        yield starting
    finally:
        starting.stop()


@pytest.fixture(scope="module")
def int4_server(capture_starting):
    return capture_starting.ready()


@pytest.fixture(scope="module")
def prompt_ids(smollm2_path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    out = []
    for text in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


@pytest.fixture(scope="module")
def reference(w4a16):
    """transformers on the dequantized INT4 weights, float32."""
    from tests.targets import load_reference

    return load_reference(w4a16)


@pytest.fixture(scope="module")
def int4_run(cache_dir, w4a16) -> Path:
    """ShareGPT states of the INT4 target, extracted by the pipeline's hf engine (cached)."""
    return hidden_run_folder(cache_dir, w4a16, records=RUN_RECORDS, max_tokens=RUN_TOKENS, shard_sequences=16)


def generate(server, body: dict) -> dict:
    r = httpx.post(server.url + "/generate", json=body, timeout=600)
    assert r.status_code == 200, f"{r.status_code} {r.text[:500]}; server log:\n{server.log_tail()}"
    return r.json()


def greedy(model, ids: list[int], tokens: int = MAX_NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return out[0, len(ids) :].tolist()


def equal_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two outputs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def capture_diffs(server, points: list[int], model, prompt_ids, other=None) -> dict[str, dict]:
    """Per point (and "final"), over the prompts: the max abs difference and the relative L2
    (||a - b|| / ||b||) between the server's binary capture and `model`'s hidden states ("max",
    "rel"), and between `other`'s states and `model`'s when given ("other_max", "other_rel")."""
    from aerie_extractor.engines.sglang_binary import capture_body, descriptor_of, fetch_binary, reader_for

    shm = reader_for(httpx.get(server.url + "/server_info", timeout=60).json(), "shm")
    keys = [*points, "final"]
    sums = {k: dict.fromkeys(("max", "num", "other_max", "other_num", "den"), 0.0) for k in keys}
    for ids in prompt_ids:
        captured = fetch_binary(descriptor_of(generate(server, capture_body(ids, "shm"))), shm)
        assert captured["aux"].shape[:2] == (len(ids), len(points))
        with torch.no_grad():
            hf = [h[0].float() for h in model(torch.tensor([ids]), output_hidden_states=True).hidden_states]
            far = (
                None
                if other is None
                else [h[0].float() for h in other(torch.tensor([ids]), output_hidden_states=True).hidden_states]
            )
        got = {p: torch.from_numpy(np.asarray(captured["aux"][:, j], dtype=np.float32)) for j, p in enumerate(points)}
        got["final"] = torch.from_numpy(np.asarray(captured["final"], dtype=np.float32))
        for key in keys:
            ref, s = hf[N if key == "final" else key], sums[key]
            s["max"] = max(s["max"], (got[key] - ref).abs().max().item())
            s["num"] += ((got[key] - ref) ** 2).sum().item()
            s["den"] += (ref**2).sum().item()
            if far is not None:
                apart = far[N if key == "final" else key] - ref
                s["other_max"] = max(s["other_max"], apart.abs().max().item())
                s["other_num"] += (apart**2).sum().item()
    return {
        k: {
            "max": s["max"],
            "rel": (s["num"] / s["den"]) ** 0.5,
            "other_max": s["other_max"],
            "other_rel": (s["other_num"] / s["den"]) ** 0.5,
        }
        for k, s in sums.items()
    }


def brief(diffs: dict[str, dict], *fields: str) -> dict:
    return {k: tuple(float(f"{d[f]:.2g}") for f in fields) for k, d in diffs.items()}


# --------------------------------------------------------------------------------------------
def test_the_cpu_path_dequantizes_as_compressed_tensors_does(w4a16, capture_starting):
    """In SGLang's own environment: aerie's CPU path against compressed-tensors' decompression (the
    checkpoint's symmetric layers, and asymmetric/channel layers the library packs here), and
    against the format read independently. First in the module: the capture server starts meanwhile."""
    code = f"""
        import torch
        from safetensors.torch import load_file
        from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
        from aerie_sglang.cpu.int4 import dequantized_weight

        def library(state, args):
            scheme = QuantizationScheme(targets=["Linear"], weights=args)
            return PackedQuantizationCompressor.decompress(state, scheme)["weight"]

        tensors = load_file({str(w4a16 / "model.safetensors")!r})
        checked = 0
        names = sorted(n for n in tensors if n.endswith(".weight_packed"))
        for name in [n for n in names if n.startswith(("model.layers.0.", "model.layers.29."))]:
            prefix = name.removesuffix("weight_packed")
            packed, scale = tensors[name], tensors[prefix + "weight_scale"]
            args = QuantizationArgs(num_bits=4, symmetric=True, strategy="group", group_size=32)
            state = {{"weight_packed": packed, "weight_scale": scale, "weight_shape": tensors[prefix + "weight_shape"]}}
            ours = dequantized_weight(packed, scale, num_bits=4, strategy="group", group_size=32, symmetric=True)
            assert torch.equal(ours, library(state, args)), name
            # the format read independently: value i of a word at bits 4i..4i+3, stored as q + 8
            nibbles = (packed.unsqueeze(-1) >> torch.arange(0, 32, 4)) & 0xF
            q = nibbles.reshape(packed.shape[0], -1).to(torch.bfloat16) - 8
            plain = (q.reshape(q.shape[0], -1, 32) * scale.unsqueeze(-1)).reshape(q.shape)
            assert torch.equal(ours, plain), name
            checked += 1

        # asymmetric (zero points packed along the output dim) and per-channel: packed by the library
        torch.manual_seed(0)
        w = torch.randn(64, 128, dtype=torch.bfloat16)
        for strategy, group in (("group", 32), ("channel", None)):
            for symmetric in (False, True):
                args = QuantizationArgs(num_bits=4, symmetric=symmetric, strategy=strategy, group_size=group)
                groups = 128 // group if group else 1
                x = w.float().reshape(64, groups, -1)
                from compressed_tensors.quantization.utils import calculate_qparams
                scale, zp = calculate_qparams(x.amin(-1), x.amax(-1), args)
                state = PackedQuantizationCompressor.compress(
                    {{"weight": w, "weight_scale": scale.to(torch.bfloat16), "weight_zero_point": zp}},
                    QuantizationScheme(targets=["Linear"], weights=args),
                )
                ours = dequantized_weight(
                    state["weight_packed"], state["weight_scale"], state.get("weight_zero_point"),
                    num_bits=4, strategy=strategy, group_size=group or -1, symmetric=symmetric,
                )
                assert torch.equal(ours, library(state, args)), (strategy, symmetric)
                assert (ours.float() - w.float()).abs().max() <= scale.float().max(), (strategy, symmetric)
                checked += 1
        print(checked)
    """
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/tmp"),
        "PYTHONPATH": str(REPO / "services" / "inference"),
    }
    result = subprocess.run(
        [str(sglang_python()), "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=600, cwd=REPO, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert int(result.stdout.split()[-1]) == 2 * 7 + 4  # the first and last layers' 7 Linears, 4 packed here


def test_the_int4_target_serves_transformers_greedy_text(int4_server, reference, prompt_ids, w4a16):
    info = httpx.get(int4_server.url + "/server_info", timeout=60).json()
    # SGLang detected the method from config.json and left its argument unset
    assert info.get("quantization") is None and info.get("dtype") == DTYPE, info
    assert "quant=compressed-tensors" in int4_server.log_path.read_text()  # SGLang's loader took the INT4 path
    body = {"sampling_params": {"max_new_tokens": GREEDY_TOKENS, "temperature": 0, "ignore_eos": True}}
    outputs = [generate(int4_server, {**body, "input_ids": ids})["output_ids"] for ids in prompt_ids]
    matched = [equal_prefix(out, greedy(reference, ids, GREEDY_TOKENS)) for out, ids in zip(outputs, prompt_ids)]
    print(f"\n[int4 greedy, {DTYPE}] tokens equal to transformers' before any difference, per prompt: {matched}")
    assert matched == [GREEDY_TOKENS] * len(prompt_ids)


def test_capture_through_the_int4_target_equals_transformers_at_every_point(
    int4_server, server_ids, reference, prompt_ids, smollm2_path
):
    from aerie.capture import from_engine_ids
    from tests.targets import load_reference

    points = from_engine_ids(server_ids, "sglang-llama", N)
    assert points == [1, 2, 3, 14, 15, 16, 26, 27, 28]
    diffs = capture_diffs(int4_server, points, reference, prompt_ids, load_reference(smollm2_path))
    print(
        f"\n[int4 capture, {DTYPE}] to transformers on the dequantized weights, per point (max abs, rel L2): "
        f"{brief(diffs, 'max', 'rel')}\n"
        f"[int4 capture] the unquantized target's states from the same: {brief(diffs, 'other_max', 'other_rel')}"
    )
    for p, d in diffs.items():
        assert d["max"] <= CAPTURE_TOLERANCE, (p, d)
        assert d["max"] < 1e-3 * d["other_max"], (p, d)  # the INT4 numbers, not the unquantized model's


def test_align_names_the_quantization_and_tells_the_int4_run_from_the_bf16_one(
    int4_server, int4_run, cache_dir, smollm2_path, tmp_path
):
    from aerie import stages
    from aerie.contracts import AlignRequest
    from aerie.settings import Settings
    from aerie.store import FsStore

    store = FsStore(tmp_path / "store")
    upload_run(store, int4_run, "int4")
    upload_run(store, hidden_run_folder(cache_dir, smollm2_path, records=8, max_tokens=ALIGN_TOKENS), "bf16")
    settings = Settings(store=f"file://{store.root}")
    request = AlignRequest(run="int4", server=int4_server.url, samples=SAMPLES, max_tokens=ALIGN_TOKENS)
    matched = stages.align(store, settings, request)
    mismatched = stages.align(store, settings, request.model_copy(update={"run": "bf16"}))
    for name, report in (("int4 run", matched), ("bf16 run", mismatched)):
        print(
            f"\n[int4 align] {name}: passed {report.passed}, quantization {report.server.quantization!r}, "
            f"mean cosine per point { {p.point: round(p.at_point.mean, 5) for p in report.points} }, "
            f"top1 {report.signal.top1_agreement:.4f}",
            *report.causes,
            sep="\n",
        )
    assert matched.server.quantization == mismatched.server.quantization == QUANTIZATION
    assert matched.server.transport == "binary" and matched.server.dtype == DTYPE
    assert matched.passed and matched.causes == [], matched.causes
    assert all(p.passed and p.best_point == p.point for p in matched.points)
    assert not mismatched.passed
    for p in mismatched.points:
        assert p.best_point == p.point and p.at_point.mean < min(q.at_point.mean for q in matched.points), p
    assert any("a different quantization or dtype than the run" in c for c in mismatched.causes), mismatched.causes
    assert any(QUANTIZATION in c for c in mismatched.causes), mismatched.causes


@pytest.fixture(scope="module")
def trained(w4a16, int4_run, cache_dir):
    """The pipeline's own stages on the INT4 target's states: train -> publish -> pull. Cached under
    `<cache>/test-drafters/` like tests/trained.py's, keyed by the run, the config and the trainer's
    and library's source (training takes ~4 minutes on 2 loaded cores)."""
    import fcntl
    import hashlib
    import shutil

    from aerie import stages
    from aerie.contracts import TrainConfig, TrainRequest
    from aerie.settings import Settings
    from aerie.store import FsStore
    from tests.trained import source_digest

    config = TrainConfig(
        draft_vocab_size=1024,
        ttt_steps=3,
        steps=160,
        batch_tokens=512,
        max_seq_tokens=RUN_TOKENS,
        lr=3e-3,
        warmup_steps=8,
        grad_clip=1.0,
        checkpoint_every=80,
        eval_prompts=0,
        holdout_fraction=0.1,
    )
    key = hashlib.sha256(json.dumps([int4_run.name, config.model_dump(), source_digest()]).encode()).hexdigest()[:16]
    root = Path(cache_dir) / "test-drafters" / f"smollm2-w4a16-{key}"
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "train.json").is_file():
            shutil.rmtree(root, ignore_errors=True)
            store = FsStore(root / "store")
            upload_run(store, int4_run, "int4")
            result = stages.train(
                store,
                Settings(store=f"file://{store.root}"),
                TrainRequest(runs=["int4"], drafter="int4-eagle3", model=str(w4a16), config=config),
            )
            stages.pull(store, "int4-eagle3", root / "pulled")
            (root / "train.json").write_text(result.model_dump_json())  # last: marks the folder complete
    return root / "pulled", json.loads((root / "train.json").read_text())


def test_a_drafter_trained_on_the_int4_states_serves_on_it_as_the_project_loop_predicts(
    trained, w4a16, reference, prompt_ids, tmp_path
):
    from aerie_trainer import evaluate
    from aerie_trainer.export import check_layer_ids, check_sglang_loadable, load_exported

    folder, result = trained
    lineage = json.loads((folder / "aerie.json").read_text())
    assert lineage["capture_points"] == POINTS
    check_sglang_loadable(folder)
    assert check_layer_ids(folder, POINTS, "LlamaForCausalLM", N) == POINTS
    with serve_server(
        w4a16, folder, dtype=DTYPE, num_steps=STEPS, num_draft_tokens=STEPS + 1, log_dir=tmp_path, env=EAGLE_ENV
    ) as server:
        assert "quant=compressed-tensors" in server.log_path.read_text()
        outputs = [
            generate(
                server,
                {
                    "input_ids": ids,
                    "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True},
                },
            )
            for ids in prompt_ids
        ]
    sglang = sum(o["meta_info"]["completion_tokens"] for o in outputs) / sum(
        o["meta_info"]["spec_verify_ct"] for o in outputs
    )
    project = evaluate.acceptance_length(
        reference, load_exported(folder, w4a16), prompt_ids, POINTS, MAX_NEW_TOKENS, STEPS
    )
    equal_text = [o["output_ids"] == greedy(reference, ids) for o, ids in zip(outputs, prompt_ids)]
    print(
        f"\n[int4 drafter] sglang {sglang:.4f} project {project['acceptance']:.4f} per prompt "
        f"{[round(o['meta_info']['spec_accept_length'], 3) for o in outputs]} vs {project['acceptance_per_prompt']}; "
        f"text equal to greedy per prompt {equal_text}; train "
        f"{json.dumps({k: result.get(k) for k in ('steps', 'final_loss', 'simulated_acceptance')})}"
    )
    assert all(equal_text)
    assert project["completion_tokens"] == sum(o["meta_info"]["completion_tokens"] for o in outputs)
    assert abs(sglang - project["acceptance"]) <= AGREEMENT_TOLERANCE, (sglang, project)
    assert sglang > MAX_NEW_TOKENS / (MAX_NEW_TOKENS - 1) + 0.1, sglang  # more than nothing accepted


def test_in_bfloat16_w4a16_proper_the_states_are_transformers_up_to_rounding(
    w4a16, smollm2_path, server_ids, prompt_ids, tmp_path
):
    """SGLang's own dtypes for compressed-tensors: a 16-bit matmul of the dequantized weight, the
    numbers Marlin computes on a GPU up to accumulation order. Last in the module (its own server)."""
    from aerie.capture import from_engine_ids
    from tests.targets import load_reference

    points = from_engine_ids(server_ids, "sglang-llama", N)
    reference, plain = load_reference(w4a16, torch.bfloat16), load_reference(smollm2_path, torch.bfloat16)
    env = {"AERIE_SGLANG_BINARY": "1", "AERIE_CAPTURE_DIR": str(tmp_path / "shm")}
    with sglang_server(capture_args(w4a16, server_ids, dtype="bfloat16"), env=env, log_dir=tmp_path) as server:
        diffs = capture_diffs(server, points, reference, prompt_ids, plain)
        body = {"sampling_params": {"max_new_tokens": BF16_GREEDY_TOKENS, "temperature": 0, "ignore_eos": True}}
        outputs = [generate(server, {**body, "input_ids": ids})["output_ids"] for ids in prompt_ids]
    matched = [equal_prefix(out, greedy(reference, ids, BF16_GREEDY_TOKENS)) for out, ids in zip(outputs, prompt_ids)]
    print(
        f"\n[int4 bf16] to transformers bf16 per point (max abs, rel L2): {brief(diffs, 'max', 'rel')}\n"
        f"[int4 bf16] the unquantized target's bf16 states from the same: {brief(diffs, 'other_max', 'other_rel')}\n"
        f"[int4 bf16] greedy tokens equal to transformers' before any difference (of {BF16_GREEDY_TOKENS}): {matched}"
    )
    for p, d in diffs.items():
        assert d["rel"] < 0.25 * d["other_rel"], (p, d)  # bf16 rounding, well under what 4 bits move
    assert all(m >= 1 for m in matched), matched  # the first token at least; after it, ties in bf16 logits
