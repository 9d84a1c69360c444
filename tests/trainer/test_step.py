"""The fast training step's numeric paths equal their plain references (CPU, float64): the
attention over prefix + chain without expanded K/V, the chunked soft cross-entropy, one weight
cast per forward; and the side-by-side benchmark's CPU smoke mode runs. The GPU kernels are
checked against these same torch paths by `benchmarks/bench_step.py --check` on the device."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from aerie_trainer import loss as loss_module
from aerie_trainer.attention import attend
from aerie_trainer.ttt import TTT
from tests.services import REPO
from tests.trainer.test_drafter import VD, H, K, V, tiny_drafter


def reference_attention(q, k, v, mask, chain=()):
    """The drafter's attention as it was written first: K/V repeated per query head, a dense
    (T, S) mask, the chain's keys one score column each, one softmax."""
    rep = q.shape[1] // k.shape[1]
    pk, pv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scale = q.shape[-1] ** -0.5
    scores = ((q @ pk.transpose(-1, -2)) * scale).masked_fill(~mask, float("-inf"))
    steps = [(ck.repeat_interleave(rep, 1), cv.repeat_interleave(rep, 1)) for ck, cv in chain]
    diag = [(q * ck).sum(-1, keepdim=True) * scale for ck, _ in steps]
    probs = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1)
    S = scores.shape[-1]
    out = probs[..., :S] @ pv
    for j, (_, cv) in enumerate(steps):
        out = out + probs[..., S + j : S + j + 1] * cv
    return out


def grads(fn, tensors, upstream):
    tensors = [t.detach().requires_grad_() for t in tensors]
    out = fn(*tensors)
    out.backward(upstream)
    return out.detach(), [t.grad for t in tensors]


@pytest.mark.parametrize("nh, nkv", [(4, 2), (6, 1), (3, 3)])
@pytest.mark.parametrize("chain_len", [0, 1, 3])
def test_attention_over_prefix_and_chain_equals_the_reference(nh, nkv, chain_len):
    """Causal prefix (training) and an explicit mask (serving), grouped heads, chains of 0-3 keys:
    outputs and the gradients of q, the prefix and every chain key equal the expanded reference."""
    g = torch.Generator().manual_seed(nh * 10 + chain_len)
    B, T, hd = 2, 7, 8

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q, k, v, upstream = rnd(B, nh, T, hd), rnd(B, nkv, T, hd), rnd(B, nkv, T, hd), rnd(B, nh, T, hd)
    chain = [(rnd(B, nkv, T, hd), rnd(B, nkv, T, hd)) for _ in range(chain_len)]
    flat = [t for kv in chain for t in kv]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    some = torch.rand(T, T, generator=g) < 0.6
    some[:, 0] = True  # every query sees at least one key
    for mask, given in ((causal, None), (some, some)):

        def new(q, k, v, *chain_tensors):
            if not chain_tensors:
                return attend(q, k, v, mask=given)
            ck = torch.stack([c.transpose(1, 2) for c in chain_tensors[0::2]])
            cv = torch.stack([c.transpose(1, 2) for c in chain_tensors[1::2]])
            return attend(q, k, v, ck, cv, mask=given)

        def ref(q, k, v, *chain_tensors):
            return reference_attention(q, k, v, mask, list(zip(chain_tensors[0::2], chain_tensors[1::2])))

        out, got = grads(new, [q, k, v, *flat], upstream)
        expected, want = grads(ref, [q, k, v, *flat], upstream)
        torch.testing.assert_close(out, expected)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)


def reference_loss(logits, target_logits, target_lse, weight):
    p = torch.exp(target_logits - target_lse[..., None])
    ce = -(p * F.log_softmax(logits, dim=-1)).sum(-1)
    return (ce * weight).sum()


def test_chunked_soft_cross_entropy_equals_the_reference(monkeypatch):
    """Loss, gradient and argmax of the chunked loss (chunks smaller than a batch row, a target
    read through a strided slice as TTT reads it) equal -Σ p log_softmax(z); a row of weight 0 with
    a target of no mass (all -inf, as a top-k slot outside the draft vocab) adds nothing, no NaN."""
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 3 * 11)  # 3 rows of 11 per chunk
    g = torch.Generator().manual_seed(0)
    B, L, S, Vd = 2, 5, 3, 11
    logits = torch.randn(B, L, Vd, generator=g, dtype=torch.float64) * 3
    stored = torch.randn(B, L + S, Vd, generator=g, dtype=torch.float64) * 2  # the batch's (B, W, Vd)
    stored[1, 4, :3] = float("-inf")  # a top-k style target: no mass on some tokens
    lse_all = torch.logsumexp(stored, -1)
    k = 2
    target, lse = stored[:, k : k + L], lse_all[:, k : k + L]  # step k's view, as TTT slices it
    weight = torch.rand(B, L, generator=g, dtype=torch.float64)
    weight[0, 1] = 0.0
    upstream = torch.tensor(0.37, dtype=torch.float64)

    z = logits.clone().requires_grad_()
    got, argmax = loss_module.soft_cross_entropy(z, target, lse, weight)
    (got * upstream).backward()
    zr = logits.clone().requires_grad_()
    expected = reference_loss(zr, target, lse, weight)
    (expected * upstream).backward()
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(z.grad, zr.grad)
    assert torch.equal(argmax, logits.argmax(-1))

    empty = target.clone()
    empty[0, 1] = float("-inf")  # no mass at all, weight 0: lse_t = -inf would make p NaN
    empty_lse = torch.where(torch.isfinite(torch.logsumexp(empty, -1)), torch.logsumexp(empty, -1), 0.0)
    z = logits.clone().requires_grad_()
    got, _ = loss_module.soft_cross_entropy(z, empty, empty_lse, weight)
    got.backward()
    assert torch.isfinite(got) and torch.isfinite(z.grad).all() and not z.grad[0, 1].any()


def test_one_weight_cast_per_forward_equals_a_cast_per_call():
    """The GPU's precision scheme on the CPU: float64 master weights, float32 compute. Casting each
    weight once per TTT forward (its gradient summed over the draft steps, then cast back) gives
    the loss and master gradients of casting at every call."""
    B, L, S = 2, 9, 4
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, V, (B, L + S), generator=g)
    aux = torch.randn(B, L, K * H, generator=g, dtype=torch.float64)
    target_logits = torch.randn(B, L + S, VD, generator=g, dtype=torch.float64)
    target_lse = torch.logsumexp(target_logits, -1)
    mask = torch.ones(B, L + S, dtype=torch.bool)
    results = []
    for once in (True, False):
        drafter = tiny_drafter()
        ttt = TTT(drafter, S, 0.8, compute_dtype=torch.float32, cast_once=once)
        loss, step_loss, correct, valid = ttt(
            input_ids,
            aux,
            target_logits.float(),
            target_lse.float(),
            torch.zeros(B, L + S, dtype=torch.long),
            mask,
            mask,
        )
        loss.backward()
        assert loss.dtype == torch.float32 and drafter.fc.weight.grad.dtype == torch.float64
        results.append((loss.detach(), {n: p.grad for n, p in drafter.named_parameters() if p.requires_grad}))
    (loss_once, grads_once), (loss_each, grads_each) = results
    torch.testing.assert_close(loss_once, loss_each)
    for name, grad in grads_each.items():
        torch.testing.assert_close(grads_once[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_bench_step_smoke_runs_aeries_step_on_the_cpu(tmp_path):
    """benchmarks/bench_step.py --device cpu --tiny: aerie's step runs in the benchmark, timed, finite."""
    out = tmp_path / "tiny.json"
    run = subprocess.run(
        [sys.executable, "benchmarks/bench_step.py", "--device", "cpu", "--tiny", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert [r["trainer"] for r in results] == ["aerie"]
    assert results[0]["tokens_per_s"] > 0 and results[0]["losses_finite"] and results[0]["timed_steps"] == 3


@pytest.mark.parametrize("signal", ["final", "topk"])
def test_target_distribution_of_every_slot_equals_that_of_the_trained_slots(signal):
    """A GPU computes the target distribution at every slot (no host sync), the CPU only at the
    loss-masked ones: both give the same distribution, argmax and trainable slots where it counts."""
    from aerie_trainer.data import Batch
    from aerie_trainer.ttt import TargetHead

    drafter = tiny_drafter()
    g = torch.Generator().manual_seed(5)
    B, W = 2, 9
    loss_mask = torch.rand(B, W, generator=g) < 0.6
    if signal == "final":
        lm_head = torch.randn(V, H, generator=g, dtype=torch.float64)
        head = TargetHead(lm_head, drafter.t2d, drafter.d2t, torch.float64)
        batch = Batch(
            torch.zeros(B, W, dtype=torch.long),
            torch.zeros(B, W - 3, K * H),
            loss_mask,
            final=torch.randn(B, W, H, generator=g, dtype=torch.float64) * 3,
        )
    else:
        head = TargetHead(None, drafter.t2d, drafter.d2t, torch.float32)
        ids = torch.randint(0, V, (B, W, 4), generator=g)
        ids[0, 0] = torch.tensor([1, 3, 5, 7])  # odd ids: none in the draft vocab (a slot with no mass)
        batch = Batch(
            torch.zeros(B, W, dtype=torch.long),
            torch.zeros(B, W - 3, K * H),
            loss_mask,
            topk_ids=ids,
            topk_logprobs=torch.randn(B, W, 4, generator=g).log_softmax(-1),
        )
    out = {}
    for select in (True, False):
        head.select_rows = select
        out[select] = head(batch)
    (d1, a1, t1), (d2, a2, t2) = out[True], out[False]
    assert torch.equal(a1, a2) and torch.equal(t1, t2) and t1.any()
    torch.testing.assert_close(d1.probs()[t1], d2.probs()[t2])
    assert torch.isfinite(d2.lse).all()
