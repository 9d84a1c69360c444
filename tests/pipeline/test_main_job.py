"""The README's main job at its smallest size: dataset -> published, pulled, working drafter."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from aerie import layout
from aerie.contracts import DrafterLineage, RegeneratedRecord
from aerie.settings import Settings
from aerie.shard import Shard
from aerie.store import open_store
from tests.runs import DATA
from tests.services import clean_env, store_env
from tests.workers import ExtractorWorker, worker_env


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_aerie_run_quick_publishes_a_trained_drafter_and_reruns_idempotently(tmp_path, smollm2_path):
    """The smallest size, as a newcomer's first look runs it. Its real speculative loop (4 held-out
    prompts x 16 tokens, greedy, chain of 3) ranks the drafters: measured 2026-12-02, untrained
    1.143, trained 1.333 (the run is deterministic on the CPU)."""
    env = clean_env(AERIE_CACHE_DIR=str(smollm2_path.parent))
    cmd = [str(Path(sys.executable).with_name("aerie")), "run", "--quick", "--out", str(tmp_path / "drafter")]
    first = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1400)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "aerie run: summary" in first.stdout and "--speculative-algorithm EAGLE3" in first.stdout

    folder = tmp_path / "drafter"
    config = json.loads((folder / "config.json").read_text())
    lineage = DrafterLineage.model_validate_json((folder / "aerie.json").read_text())
    # the exported layer ids are the capture points in SGLang's Llama convention (id = point - 1)
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [p - 1 for p in lineage.capture_points]
    assert lineage.exported_layer_ids == [1, 14, 26] and lineage.capture_points == [2, 15, 27]
    with safe_open(folder / "model.safetensors", "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    H, K, V = 576, 3, lineage.draft_vocab_size
    assert shapes["fc.weight"] == (H, K * H)
    assert shapes["lm_head.weight"] == (V, H)
    assert shapes["d2t"] == (V,) and shapes["t2d"] == (49152,)
    assert not any("embed_tokens" in n for n in shapes)
    assert set(lineage.files) == {"config.json", "model.safetensors"}
    assert lineage.runs and lineage.target.weights_sha256 and lineage.engine.name == "hf"
    m = lineage.metrics
    assert m["heldout_loss"] < m["heldout_loss_untrained"], m
    assert m["simulated_acceptance"] > m["simulated_acceptance_untrained"], m
    assert m["eval_prompts"] == 4 and m["acceptance_untrained"] >= 1.0, m
    assert m["acceptance"] > m["acceptance_untrained"], m  # the real loop: after > before

    # the same command again reuses everything in the store and says so
    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    out = again.stdout
    assert "already in" in out and "already extracted" in out and "already published" in out, out[-3000:]


def _aerie_run(args: list[str], env: dict[str, str], cwd, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(Path(sys.executable).with_name("aerie")), "run", "--quick", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_aerie_run_regenerate_trains_on_the_targets_own_answers(tmp_path, smollm2_path):
    """`aerie run --regenerate` at its smallest (one conversation, 4 new tokens, one step, no
    speculative loop): the regenerate stage answers in this process (the hf engine, no server), the
    token shard holds that answer, and the drafter trained on that run is published and pulled."""
    env = clean_env(AERIE_CACHE_DIR=str(smollm2_path.parent))
    out = _aerie_run(
        [
            "--regenerate",
            "--regenerate-max-tokens",
            "4",
            "--dataset",
            str(DATA / "sharegpt_cut.json"),
            "--records",
            "1",
            "--run",
            "regen",
            "--steps",
            "1",
            "--draft-vocab",
            "64",
            "--eval-prompts",
            "0",
            "--out",
            str(tmp_path / "drafter"),
        ],
        env,
        tmp_path,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "wall time: regenerate" in out.stdout and "aerie run: summary" in out.stdout, out.stdout[-3000:]

    store = open_store(Settings(store=f"file://{tmp_path / 'aerie-data'}"))
    record = store.get_json(layout.regenerated_record("regen", "000000"), RegeneratedRecord)
    assert record.servers == ["hf"] and record.conversations == record.turns == record.token_sequences == 1, record
    assert 0 < record.completion_tokens <= 4, record
    (answered,) = [
        json.loads(line) for line in store.get_bytes(layout.regenerated("regen", "000000")).decode().splitlines()
    ]
    question, answer = answered["messages"]
    assert question == {"role": "user", "content": "Give me a synonym for happy."} and answer["role"] == "assistant"
    assert answer["content"] and answer["content"] != "Joyful.", answered  # the target's words, not the dataset's
    # what the drafter trained on: the answer's tokens, and only they, under the loss
    from transformers import AutoTokenizer

    (key,) = [k for k in store.list(layout.shards_prefix("regen", "tokens")) if k.endswith(".safetensors")]
    seq = Shard.from_buffer(store.get_bytes(key)).sequence(0)
    masked = AutoTokenizer.from_pretrained(smollm2_path).decode(seq["input_ids"][seq["loss_mask"] == 1])
    assert masked == answer["content"] + "<|im_end|>", (masked, answer)
    lineage = DrafterLineage.model_validate_json((tmp_path / "drafter" / "aerie.json").read_text())
    assert lineage.runs == ["regen"] and lineage.metrics["steps"] == 1, lineage.metrics


def test_aerie_run_on_workers_stops_on_a_refused_credential(s3_store, redis_url, smollm2_path, tmp_path):
    env = clean_env(**{**store_env(s3_store), "AERIE_S3_SECRET_KEY": "wrong"}, AERIE_CACHE_DIR=str(smollm2_path.parent))
    out = _aerie_run(["--broker", redis_url], env, tmp_path)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "refused the credentials" in out.stderr and "AERIE_S3_SECRET_KEY" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_aerie_run_on_workers_prints_the_broker_without_its_password(s3_store, smollm2_path, tmp_path):
    """Issue 35, finding 6: `aerie run --broker` printed the broker URL with its password on every
    line ("enqueued ... on redis://:<password>@..."). Against a real Redis that requires the
    password (no worker: the run is enqueued, then the wait times out), nothing it prints holds it."""
    import secrets

    from aerie.app import stack

    password = "pw-" + secrets.token_hex(12)
    base, redis_service = stack.start_redis(tmp_path / "redis", password=password)
    try:
        env = clean_env(**store_env(s3_store), AERIE_CACHE_DIR=str(smollm2_path.parent))
        out = _aerie_run(["--broker", f"{base}/0", "--timeout", "5"], env, tmp_path)
    finally:
        redis_service.stop()
    printed = " ".join((out.stdout + out.stderr).split())  # rich wraps at 80 columns
    assert "enqueued aerie.ingest on redis://***@127.0.0.1:" in printed, printed[-3000:]
    assert password not in printed and out.returncode == 1, printed[-3000:]


def test_aerie_run_on_workers_stops_when_a_task_fails(s3_store, private_redis, smollm2_path, workers, tmp_path):
    """A real extractor worker refuses the ingest (capture point 99 of a 30-layer target): `aerie run`
    stops with the worker's reason instead of waiting for a run that will never complete."""
    env = worker_env(s3_store, private_redis, AERIE_CACHE_DIR=str(smollm2_path.parent))
    workers.append(ExtractorWorker(env, "extractor", tmp_path))
    workers[0].wait_for(r"ready\.", 120)
    out = _aerie_run(["--capture-points", "2,15,99", "--timeout", "240"], env, tmp_path)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "ingest" in out.stderr and "failed for good" in out.stderr and "capture point 99" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
