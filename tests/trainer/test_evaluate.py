"""Speculative decoding with the target in transformers: same output as plain greedy decoding,
and SGLang's acceptance-length arithmetic (completion tokens / verify forwards)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from aerie_trainer.evaluate import (
    acceptance_length,
    first_draft_right,
    greedy_generate,
    load_target,
    speculative_generate,
)
from aerie_trainer.model import build_drafter

pytestmark = pytest.mark.slow  # loads the target and decodes: ~1-2 min on 2 cores

POINTS = [2, 15, 27]


class Proposing(torch.nn.Module):
    """A drafter that runs `inner` and then proposes what `forward` of a subclass says."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.fc, self.d2t = inner, inner.fc, inner.d2t

    def project(self, aux):
        return self.inner.project(aux)

    def draft_to_target(self, ids):
        return self.inner.draft_to_target(ids)


@pytest.fixture(scope="module")
def target(smollm2_path):
    return load_target(smollm2_path, "cpu", torch.float32)


@pytest.fixture(scope="module")
def prompts(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    texts = ["What is the capital of France?", "Write a haiku about the sea."]
    return [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)[
            "input_ids"
        ]
        for t in texts
    ]


def test_untrained_drafter_gives_greedy_output_one_token_per_verify(target, smollm2_path, prompts):
    torch.manual_seed(0)
    drafter = build_drafter(smollm2_path, num_aux=3, draft_vocab_size=2048).eval()
    drafter.set_vocab(torch.arange(2048))
    for prompt in prompts:
        want = greedy_generate(target, prompt, 16, eos_ids=[2])
        got, verifies = speculative_generate(target, drafter, prompt, POINTS, 16, 3, eos_ids=[2])
        assert got == want
        # a random drafter is (almost) never right: ~ one token per verify, the first from prefill
        assert verifies >= len(got) - 2
    report = acceptance_length(target, drafter, prompts, POINTS, 16, 3, eos_ids=[2])
    assert report["acceptance"] == pytest.approx(report["completion_tokens"] / report["verify_count"])
    assert report["acceptance"] < 1.2


def test_a_drafter_that_copies_the_target_is_accepted_and_still_greedy(target, smollm2_path, prompts):
    """A drafter whose chain is the target's own greedy continuation (the drafts are right by
    construction) is accepted whole each verify, and the output is still plain greedy."""
    torch.manual_seed(0)
    drafter = build_drafter(smollm2_path, num_aux=3, draft_vocab_size=49152).eval()
    drafter.set_vocab(torch.arange(49152))
    prompt = prompts[0]
    want = greedy_generate(target, prompt, 24)

    class Oracle(Proposing):
        """Proposes the next tokens of `want` (by counting the tokens it has been shown)."""

        def forward(self, input_ids, hidden, positions, **kw):
            logits, hidden, kv = self.inner(input_ids, hidden, positions, **kw)
            # slot t predicts token t+2; completion index = t + 2 - len(prompt)
            nxt = int(positions.reshape(-1)[-1]) + 2 - len(prompt)
            logits = torch.full_like(logits, -1e9)
            if 0 <= nxt < len(want):
                logits[..., -1, want[nxt]] = 0.0
            return logits, hidden, kv

    got, verifies = speculative_generate(target, Oracle(drafter), prompt, POINTS, 24, 3)
    assert got == want
    assert verifies == (24 - 1 + 3) // 4  # 1 from prefill, then 3 accepted drafts + 1 bonus per verify


def test_first_draft_right_is_the_share_of_slots_whose_draft_is_the_targets_next_token(target, smollm2_path, prompts):
    """Teacher-forced: slot j (token j+1, state j) drafts the token after position j+1. A drafter
    that proposes the target's greedy token on even slots and a wrong one on odd slots is right on
    exactly the even ones."""
    seq = list(prompts[0]) + greedy_generate(target, prompts[0], 8)
    with torch.no_grad():
        greedy = target(torch.tensor([seq])).logits[0].argmax(-1).tolist()
    drafter = build_drafter(smollm2_path, num_aux=3, draft_vocab_size=49152).eval()
    drafter.set_vocab(torch.arange(49152))

    class EvenSlots(Proposing):
        def forward(self, input_ids, hidden, positions, **kw):
            logits, hidden, kv = self.inner(input_ids, hidden, positions, **kw)
            logits = torch.full_like(logits, -1e9)
            for i, p in enumerate(positions.reshape(-1).tolist()):
                logits[0, i, greedy[p + 1] if p % 2 == 0 else (greedy[p + 1] + 1) % 49152] = 0.0
            return logits, hidden, kv

    slots = len(seq) - 1
    assert first_draft_right(target, EvenSlots(drafter), [seq], POINTS) == [((slots + 1) // 2) / slots]
    assert first_draft_right(target, EvenSlots(drafter), [seq], POINTS, zero_states=True) == [
        ((slots + 1) // 2) / slots
    ]


def test_eval_prompts_keep_raw_line_separators_inside_their_strings(smollm2_path):
    from aerie_trainer.evaluate import prompts_from_file

    text = (
        json.dumps({"prompt": "one\u2028two\x85three"}, ensure_ascii=False)
        + "\n"
        + json.dumps({"prompt": "four"})
        + "\n"
    )
    got = prompts_from_file(text, smollm2_path)
    tok = AutoTokenizer.from_pretrained(str(smollm2_path))
    assert len(got) == 2 and "one\u2028two\x85three" in tok.decode(got[0])
