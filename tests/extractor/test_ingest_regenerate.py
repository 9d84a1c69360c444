"""Regeneration on the embedded default: ingest writes conversation shards, the regenerate stage
answers each assistant turn with the target in this process (the `hf` engine, no server).

Checked against the target itself: greedy `generate` from the same chat-templated prompt, turn
by turn, each later prompt holding the earlier regenerated answers. Through SGLang's chat API
(many requests in flight, a killed worker, a bad server): tests/extractor/test_regenerate.py.
"""

from __future__ import annotations

import pytest
import torch

from aerie import layout, stages
from aerie.contracts import IngestOptions, IngestRequest, IngestResult, RegenerateRequest
from aerie.settings import Settings
from aerie.shard import Shard
from tests.runs import DATA

MAX_NEW = 8


@pytest.fixture(scope="module")
def greedy(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()

    def answer(messages: list[dict]) -> str:
        ids = tok(
            tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
            return_tensors="pt",
        )["input_ids"]
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                pad_token_id=tok.eos_token_id,
            )
        return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()

    return tok, answer


def ingest_and_regenerate(store, settings: Settings, request: IngestRequest) -> tuple[IngestResult, int]:
    """Ingest (conversation shards), then the regenerate stage over each: (ingest's result, sequences)."""
    ingested = stages.ingest(store, settings, request)
    assert ingested.shards == [] and ingested.regenerate_shards
    results = [
        stages.regenerate(store, settings, RegenerateRequest(run=request.run, shard=s))
        for s in ingested.regenerate_shards
    ]
    return ingested, sum(r.sequences for r in results)


@pytest.mark.slow
def test_regenerated_turns_are_the_targets_own_greedy_answers(fs_store, smollm2_path, greedy):
    tok, answer = greedy
    options = IngestOptions(max_tokens=256, shard_tokens=4096, regenerate=True, regenerate_max_tokens=MAX_NEW)
    _, sequences = ingest_and_regenerate(
        fs_store,
        Settings(engine="hf", ingest_local_dirs=[DATA]),
        IngestRequest(
            run="regen",
            dataset=str(DATA / "sharegpt_cut.json"),
            model=str(smollm2_path),
            options=options,
        ),
    )
    assert sequences == 2
    (shard,) = [
        Shard.from_buffer(fs_store.get_bytes(k))
        for k in fs_store.list(layout.shards_prefix("regen", "tokens"))
        if k.endswith(".safetensors")
    ]

    # record a_0: one user turn
    first = answer([{"role": "user", "content": "Give me a synonym for happy."}])
    seq = shard.sequence(0)
    assert tok.decode(seq["input_ids"][seq["loss_mask"] == 1]) == first + "<|im_end|>"
    # record b_0: two turns, the second conditioned on the first regenerated answer
    convo = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}]
    a1 = answer(convo)
    a2 = answer([*convo, {"role": "assistant", "content": a1}, {"role": "user", "content": "Times 3?"}])
    seq = shard.sequence(1)
    masked = seq["input_ids"][seq["loss_mask"] == 1]
    assert tok.decode(masked) == a1 + "<|im_end|>" + a2 + "<|im_end|>"


def test_a_conversation_opening_with_an_assistant_turn_is_rejected_not_a_crash(fs_store, smollm2_path, tmp_path):
    """ShareGPT holds records whose first turn is the assistant's: nothing to answer. Such a record
    is rejected with its line and reason, and the run goes on (before b38b0c9: the whole ingest
    crashed on `apply_chat_template` of an empty conversation)."""
    import json

    dataset = tmp_path / "assistant-first.jsonl"
    dataset.write_text(
        json.dumps(
            {"conversations": [{"from": "gpt", "value": "Hello! How can I help?"}, {"from": "human", "value": "Hi"}]}
        )
        + "\n"
        + json.dumps({"conversations": [{"from": "human", "value": "Say hi."}, {"from": "gpt", "value": "Hi."}]})
        + "\n"
    )
    options = IngestOptions(max_tokens=128, shard_tokens=4096, regenerate=True, regenerate_max_tokens=4)
    ingested, sequences = ingest_and_regenerate(
        fs_store,
        Settings(engine="hf", ingest_local_dirs=[tmp_path]),
        IngestRequest(
            run="assistant-first",
            dataset=str(dataset),
            model=str(smollm2_path),
            options=options,
        ),
    )
    assert sequences == 1 and ingested.rejects == 1  # refused by ingest, before any answer is asked
    (key,) = fs_store.list(layout.rejects_prefix("assistant-first"))
    reject = json.loads(fs_store.get_bytes(key).decode().splitlines()[0])
    assert reject["line"] == 1 and "assistant turn with no user turn before it" in reject["reason"]
