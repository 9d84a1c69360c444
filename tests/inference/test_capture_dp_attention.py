"""Capture under DP attention, the way DeepSeek-V3 and Kimi-K2.5 are served, through real SGLang.

SGLang's usual DeepSeek/Kimi deployment runs attention data-parallel: the TP group is split into
attention-DP groups, each with its own scheduler and its own requests, while the MoE layers stay
tensor-parallel across all ranks. The capture plugin writes on the rank that sends its group's
outputs (SGLang's own rule: attention-TP rank 0, attention-CP rank 0), so every attention-DP rank
writes the captures of the requests it owns, and a TP group writes each capture once.

- Real SGLang 0.5.23 on the CPU serves the tiny DeepSeek-V3 (tests/targets.py) with
  `--tp 2 --attn-dp-size 2` (two attention-DP ranks of one attention head group each, the MoE
  split over both): a batch of prompts sent at once lands on both ranks, and every request is
  captured exactly once (one file each, none left over after the client claims them), its aux
  rows at every capture point and its final state equal to transformers' (float32).
- The writer rule over SGLang's own rank layout (`derive_attention_ranks`): TP-only serving keeps
  one writer; pure DP attention has one per rank; a mixed layout (TP 4, 2 attention-DP groups)
  one per group. Attention CP and PP are refused at admission, naming the flag.

The mixed layout was also run through a real server by hand (tp 4, attn-dp 2, 6 prompts: both
groups captured, every row equal to transformers, no file left over); at ~4.5 min to start four
ranks on two loaded cores it is not part of the suite.
"""

from __future__ import annotations

import secrets
import subprocess
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from aerie.capture import convention_for, default_capture_points, to_engine_ids
from tests.services import clean_env, wait_settled
from tests.sglang_server import REPO, capture_args, sglang_python, sglang_server
from tests.targets import NUM_LAYERS, load_reference

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

POINTS = default_capture_points(NUM_LAYERS)  # [2, 4, 5]
CHUNK = 32  # --chunked-prefill-size: the 40- and 60-token prompts take two chunks
PROMPTS = [
    [1, 504, 3060, 314, 253],
    list(range(200, 220)),
    [1, *range(3000, 3059)],
    list(range(400, 410)),
    list(range(700, 740)),
    [5, 6, 7],
]
TOLERANCE = 1e-4  # max abs difference, float32


@pytest.fixture(scope="module")
def shm_dir(tmp_path_factory) -> Path:
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path_factory.mktemp("shm")
    path = root / f"aerie-test-dp-{secrets.token_hex(4)}"
    yield path
    for f in path.glob("*"):
        f.unlink()
    if path.exists():
        path.rmdir()


@pytest.fixture(scope="module")
def dp_server(deepseek_tiny, shm_dir, tmp_path_factory):
    ids = to_engine_ids(POINTS, convention_for("sglang", "DeepseekV3ForCausalLM"), NUM_LAYERS)
    args = [
        *capture_args(deepseek_tiny, ids),
        "--tp", "2", "--attn-dp-size", "2", "--chunked-prefill-size", str(CHUNK),
    ]  # fmt: skip
    env = {"AERIE_SGLANG_BINARY": "1", "AERIE_CAPTURE_DIR": str(shm_dir)}
    with sglang_server(args, env=env, log_dir=tmp_path_factory.mktemp("dp-attention")) as server:
        yield server


def test_every_attention_dp_rank_writes_the_captures_of_its_own_requests(dp_server, deepseek_tiny, shm_dir):
    from aerie_extractor.engines.sglang_binary import capture_body, descriptor_of, fetch_binary, reader_for

    shm = reader_for(httpx.get(dp_server.url + "/server_info", timeout=60).json(), "shm")

    def capture(ids: list[int]) -> dict:
        r = httpx.post(dp_server.url + "/generate", json=capture_body(ids, "shm"), timeout=600)
        assert r.status_code == 200, f"{r.status_code} {r.text[:500]}; server log:\n{dp_server.log_tail()}"
        return r.json()

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # one batch, spread over the ranks by SGLang
        responses = list(pool.map(capture, PROMPTS))
    ranks = [r["meta_info"].get("dp_rank") for r in responses]
    assert set(ranks) == {0, 1}, f"SGLang scheduled the batch on ranks {ranks}: both should take part"
    descriptors = [descriptor_of(r) for r in responses]  # every request answered with its capture
    files = wait_settled(lambda: sorted(p.name for p in shm_dir.glob("*.safetensors")), 60, "captures written")
    assert files == sorted(f"{d.id}.safetensors" for d in descriptors), "each request's capture written once"

    model = load_reference(deepseek_tiny)
    for ids, rank, descriptor in zip(PROMPTS, ranks, descriptors):
        captured = fetch_binary(descriptor, shm)
        with torch.no_grad():
            hf = [h[0].numpy() for h in model(torch.tensor([ids]), output_hidden_states=True).hidden_states]
        assert captured["aux"].shape == (len(ids), len(POINTS), hf[0].shape[-1])
        diffs = [float(np.abs(captured["aux"][:, j] - hf[point]).max()) for j, point in enumerate(POINTS)]
        final = float(np.abs(captured["final"] - hf[NUM_LAYERS]).max())
        print(
            f"dp rank {rank}, {len(ids)} tokens: max abs diff per point {dict(zip(POINTS, diffs))}, final {final:.1e}"
        )
        assert max(diffs) <= TOLERANCE and final <= TOLERANCE, f"{len(ids)}-token prompt on dp rank {rank}"
    assert not list(shm_dir.glob("*.safetensors")), "a capture nobody asked for was left behind"


def test_one_writer_per_attention_group_over_sglangs_rank_layout():
    """`compat.writes_captures()` on every rank of four layouts, the ranks placed by SGLang's own
    `derive_attention_ranks`; attention CP and PP are refused (`unsupported_parallelism`)."""
    code = """
        from sglang.srt.runtime_context import derive_attention_ranks, get_parallel
        from aerie_sglang.plugin import compat
        for tp_size, attn_dp_size in [(2, 1), (2, 2), (4, 2), (8, 8)]:
            attn_tp_size = tp_size // attn_dp_size
            writers = []
            for tp_rank in range(tp_size):
                attn_tp_rank, attn_dp_rank = derive_attention_ranks(tp_rank=tp_rank, attn_tp_size=attn_tp_size, attn_cp_size=1)
                with get_parallel().override(tp_rank=tp_rank, attn_tp_rank=attn_tp_rank, attn_dp_rank=attn_dp_rank,
                                             attn_cp_rank=0, attn_cp_size=1, pp_size=1):
                    if compat.writes_captures():
                        writers.append((tp_rank, attn_dp_rank))
                    assert compat.unsupported_parallelism() is None
            print("LAYOUT", tp_size, attn_dp_size, writers)
        with get_parallel().override(attn_cp_size=2, pp_size=1):
            print("CP", compat.unsupported_parallelism())
        with get_parallel().override(attn_cp_size=1, pp_size=2):
            print("PP", compat.unsupported_parallelism())
    """
    env = {k: v for k, v in clean_env().items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    proc = subprocess.run(
        [str(sglang_python()), "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=300, cwd=REPO, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "LAYOUT 2 1 [(0, 0)]" in out, out  # TP-only: one writer
    assert "LAYOUT 2 2 [(0, 0), (1, 1)]" in out, out  # pure DP attention: every rank
    assert "LAYOUT 4 2 [(0, 0), (2, 1)]" in out, out  # one per attention-DP group
    assert "LAYOUT 8 8 " + str([(r, r) for r in range(8)]) in out, out  # Kimi-K2.5's usual --tp 8 --dp 8
    assert "CP attention context parallelism (--attn-cp-size 2)" in out, out
    assert "PP pipeline parallelism (--pp-size 2)" in out, out
