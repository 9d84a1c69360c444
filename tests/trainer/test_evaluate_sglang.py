"""Evaluation that never loads a large target into the trainer: the speculative loop with the
target's forward done by a real SGLang server in capture mode (the extractors' kind, radix cache
off) gives the in-process loop's acceptance on the same prompts; a job whose target is over the
size threshold never calls `from_pretrained` (it raises in this process) and evaluates through the
server; without a server it trains, publishes and says the figure is simulated."""

from __future__ import annotations

import pytest
import torch

from aerie.contracts import DrafterLineage, TrainConfig, TrainRequest
from aerie.settings import Settings
from aerie.stages import train as run_train
from aerie_trainer import evaluate
from aerie_trainer.export import load_exported
from tests.conftest import POINTS
from tests.runs import hidden_run_folder, upload_run
from tests.sglang_server import capture_server_fixture

pytestmark = [pytest.mark.slow, pytest.mark.sglang]

sglang_capture = capture_server_fixture(points=POINTS)  # SmolLM2, float32: aux at [2, 15, 27]
NEW_TOKENS, CHAIN = 24, 3


@pytest.fixture(scope="module")
def prompts(smollm2_path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    texts = ["What is the capital of France?", "Write a haiku about the sea.", "Explain recursion to a child."]
    return [
        list(
            tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)[
                "input_ids"
            ]
        )
        for t in texts
    ]


@pytest.mark.timeout(2400)  # builds the shared trained drafter when no test has (tests/trained.py)
def test_the_server_gives_the_in_process_acceptance(sglang_capture, trained_smol, smollm2_path, prompts):
    drafter = load_exported(trained_smol.folder, smollm2_path).eval()
    eos = evaluate.eos_token_ids(smollm2_path)
    in_process = evaluate.acceptance_length(
        evaluate.load_target(smollm2_path, "cpu", torch.float32), drafter, prompts, POINTS, NEW_TOKENS, CHAIN, eos
    )
    server = evaluate.SGLangTarget(sglang_capture.url, sglang_capture.layer_ids, len(POINTS), 576, "LlamaForCausalLM")
    served = evaluate.acceptance_length(server, drafter, prompts, POINTS, NEW_TOKENS, CHAIN, eos)
    print({"in_process": in_process, "sglang": served})
    assert in_process["acceptance"] > 1.1  # a trained drafter: the comparison is not 1.0 against 1.0
    assert served["completion_tokens"] == in_process["completion_tokens"]
    assert served["verify_count"] == in_process["verify_count"]
    assert served["acceptance_per_prompt"] == in_process["acceptance_per_prompt"]


def test_a_server_at_other_layers_is_refused_with_the_fix(sglang_capture):
    with pytest.raises(
        evaluate.EvalError, match=r"captures layer ids \[1, 14, 26\].*--return-aux-hidden-state-layer-ids 1 14 25"
    ):
        evaluate.SGLangTarget(sglang_capture.url, [1, 14, 25], 3, 576)


@pytest.fixture
def never_from_pretrained(monkeypatch):
    """Loading any transformers model in this process fails the test."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError(f"from_pretrained called on {args[:2]}: the target must not be loaded into the trainer")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(refuse))


def test_a_target_over_the_threshold_is_evaluated_through_the_server(
    fs_store, cache_dir, smollm2_path, sglang_capture, never_from_pretrained
):
    upload_run(fs_store, hidden_run_folder(cache_dir, smollm2_path, records=24, max_tokens=96, shard_sequences=4), "r1")
    cfg = TrainConfig(
        draft_vocab_size=1024,
        ttt_steps=2,
        steps=4,
        batch_tokens=256,
        max_seq_tokens=96,
        warmup_steps=1,
        checkpoint_every=4,
        eval_prompts=2,
        eval_new_tokens=8,
        holdout_fraction=0.2,
    )
    over = dict(
        store=f"file://{fs_store.root}", eval_max_target_params=1e6, train_trackers=[]
    )  # SmolLM2 (135 M) is "large"

    result = run_train(
        fs_store,
        Settings(**over, eval_server=sglang_capture.url),
        TrainRequest(runs=["r1"], drafter="served", model=str(smollm2_path), config=cfg),
    )
    assert result.evaluated_with == "sglang"
    assert result.acceptance is not None and result.acceptance_untrained is not None and result.acceptance >= 1.0
    lineage = fs_store.get_json(f"drafters/served/{result.version}/aerie.json", DrafterLineage)
    assert lineage.metrics["evaluated_with"] == "sglang" and lineage.metrics["eval_prompts"] == 2
    assert sglang_capture.url in lineage.metrics["evaluation_note"]

    # no server: still trained and published, with the simulated figure only, said plainly
    result = run_train(
        fs_store, Settings(**over), TrainRequest(runs=["r1"], drafter="simulated", model=str(smollm2_path), config=cfg)
    )
    assert (
        result.evaluated_with == "simulated" and result.acceptance is None and result.simulated_acceptance is not None
    )
    lineage = fs_store.get_json(f"drafters/simulated/{result.version}/aerie.json", DrafterLineage)
    assert (
        lineage.metrics["evaluation_note"].startswith("simulated only")
        and "AERIE_EVAL_SERVER" in lineage.metrics["evaluation_note"]
    )
