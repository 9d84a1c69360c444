"""The drafter, its vocabulary and its training-time test, on a tiny config (fast, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from aerie_trainer.data import Batch
from aerie_trainer.model import DrafterConfig, Eagle3Drafter
from aerie_trainer.trainer import lr_at
from aerie_trainer.ttt import TTT, TargetHead
from aerie_trainer.vocab import build_draft_vocab, d2t_t2d, target_to_draft

V, VD, H, K = 64, 24, 32, 3


# an MLA layer as DeepSeek-V3's in miniature: q/k head dim 12 != v head dim 8, YaRN whose softmax
# scale carries mscale_all_dim
MLA = dict(arch="mla", q_lora_rank=20, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
MLA_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def tiny_drafter(seed: int = 0, arch: str = "llama") -> Eagle3Drafter:
    torch.manual_seed(seed)
    mla = arch == "mla"
    cfg = DrafterConfig(
        hidden_size=H,
        target_hidden_size=H,
        num_aux=K,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=4 if mla else 2,
        head_dim=12 if mla else 8,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
        vocab_size=V,
        draft_vocab_size=VD,
        rope_parameters=dict(MLA_ROPE) if mla else {"rope_type": "default", "rope_theta": 10000.0},
        **(MLA if mla else {}),
    )
    drafter = Eagle3Drafter(cfg).double()
    with torch.no_grad():
        drafter.embed_tokens.weight.normal_()
        for p in drafter.parameters():  # larger weights than the init, so every path matters
            if p.ndim == 2 and p.requires_grad:
                p.normal_(std=0.3)
    drafter.set_vocab(torch.arange(0, 2 * VD, 2))
    return drafter


@pytest.mark.parametrize("arch", ["llama", "mla"])
def test_ttt_steps_see_what_chain_drafting_sees(arch):
    """Step k at slot t of the TTT unroll == drafting from slot t: the base sequence read up to
    t, then k chain steps fed the next tokens (prefix causal + the chain's own keys)."""
    drafter = tiny_drafter(arch=arch)
    B, L, S = 2, 9, 4
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, V, (B, L + S), generator=g)
    aux = torch.randn(B, L, K * H, generator=g, dtype=torch.float64)
    zeros = torch.zeros(B, L + S, dtype=torch.bool)
    logits: list[torch.Tensor] = []
    target_logits, target_lse = (
        torch.zeros(B, L + S, VD, dtype=torch.float64),
        torch.zeros(B, L + S, dtype=torch.float64),
    )
    TTT(drafter, S, 0.8)(input_ids, aux, target_logits, target_lse, zeros.long(), zeros, zeros, keep_logits=logits)
    for b in range(B):
        for t in (0, 3, L - 1):
            ids = input_ids[b : b + 1, : t + 1]  # slots 0..t read tokens 1..t+1
            out, hidden, base = drafter(ids, drafter.project(aux[b : b + 1, : t + 1]), torch.arange(t + 1))
            torch.testing.assert_close(out[0, -1], logits[0][b, t])
            hidden, chain = hidden[:, -1:], []
            everything = torch.ones(1, t + 1, dtype=torch.bool)
            for k in range(1, S):
                tok = input_ids[b : b + 1, t + k : t + k + 1]
                out, hidden, kv = drafter(
                    tok, hidden, torch.tensor([t + k]), prefix=base, prefix_mask=everything, chain=chain
                )
                chain.append(kv)
                torch.testing.assert_close(out[0, -1], logits[k][b, t])


@pytest.mark.parametrize("arch", ["llama", "mla"])
def test_kv_cache_extension_equals_one_pass(arch):
    drafter = tiny_drafter(arch=arch)
    ids, aux = torch.randint(0, V, (1, 12)), torch.randn(1, 12, K * H, dtype=torch.float64)
    full, _, _ = drafter(ids, drafter.project(aux), torch.arange(12))
    a, _, kv = drafter(ids[:, :5], drafter.project(aux[:, :5]), torch.arange(5))
    b, _, kv = drafter(ids[:, 5:9], drafter.project(aux[:, 5:9]), torch.arange(5, 9), past=kv)
    c, _, kv = drafter(ids[:, 9:], drafter.project(aux[:, 9:]), torch.arange(9, 12), past=kv)
    torch.testing.assert_close(torch.cat([a, b, c], 1), full)
    assert kv[0].shape[2] == 12


def test_draft_vocab_is_the_most_frequent_loss_tokens():
    counts = np.zeros(V, dtype=np.int64)
    counts[[5, 9, 40, 3, 7]] = [100, 50, 70, 1, 1]
    ids = build_draft_vocab(counts, 4)
    assert ids.tolist() == [3, 5, 9, 40]  # the top three, then the tie 3 vs 7 goes to the lower id
    d2t, t2d = d2t_t2d(ids, V)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert (d2t + torch.arange(4)).tolist() == ids.tolist()
    assert t2d.nonzero().flatten().tolist() == ids.tolist()
    assert target_to_draft(t2d)[[3, 5, 9, 40, 7]].tolist() == [0, 1, 2, 3, -1]
    with pytest.raises(ValueError, match="no loss-masked token"):
        build_draft_vocab(np.zeros(V, dtype=np.int64), 4)


def test_target_distribution_masks_tokens_outside_the_draft_vocab():
    drafter = tiny_drafter()
    lm_head = torch.randn(V, H, dtype=torch.float64)
    head = TargetHead(lm_head, drafter.t2d, drafter.d2t, torch.float64)
    final = torch.randn(1, 6, H, dtype=torch.float64)
    final[0, 1] = lm_head[2] * 50  # argmax target id 2: in the draft vocab (even ids < 48)
    final[0, 2] = lm_head[3] * 50  # argmax target id 3: outside it
    loss_mask = torch.tensor([[True, True, True, True, False, False]])
    batch = Batch(torch.zeros(1, 6, dtype=torch.long), torch.zeros(1, 3, K * H), loss_mask, final=final)
    dist, argmax, trainable = head(batch)
    p = dist.probs()
    assert argmax[0, 1] == 2 and argmax[0, 2] == 3 and argmax[0, 4] == -1
    assert trainable[0, 1] and not trainable[0, 2] and not trainable[0, 4]
    torch.testing.assert_close(p[0, :4].sum(-1), torch.ones(4, dtype=p.dtype))
    assert float(p[0, 1, 1]) > 0.99  # draft index 1 == target id 2
    # the top-k signal: probabilities of the draft tokens among the top-k, renormalised
    topk_ids = torch.tensor([[[2, 3, 4]] * 6])
    topk_lp = torch.log(torch.tensor([[[0.5, 0.3, 0.2]] * 6]))
    batch = Batch(batch.input_ids, batch.aux, loss_mask, topk_ids=topk_ids, topk_logprobs=topk_lp)
    dist, argmax, trainable = TargetHead(None, drafter.t2d, drafter.d2t, torch.float32)(batch)
    p = dist.probs()
    torch.testing.assert_close(p[0, 0, [1, 2]], torch.tensor([0.5 / 0.7, 0.2 / 0.7]))
    assert argmax[0, 0] == 2 and trainable[0, :4].all()


def test_learning_rate_warms_up_then_decays():
    lrs = [lr_at(s, lr=1e-3, steps=110, warmup=10) for s in range(110)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:])) and lrs[-1] == pytest.approx(1e-4, rel=0.01)


def test_mla_attention_is_deepseek_v3s_attention():
    """The MLA drafter layer's attention == transformers' DeepseekV3Attention (an independent
    implementation of the same math, interleaved rope, YaRN with its mscale in both the rope and
    the softmax scale) on the same weights and the layer's 2H-wide input. transformers' module maps
    its input width to itself, so its o_proj is ours stacked on zeros."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    drafter = tiny_drafter(arch="mla")
    ours = drafter.midlayer.self_attn
    cfg = DeepseekV3Config(
        hidden_size=2 * H,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=MLA["q_lora_rank"],
        kv_lora_rank=MLA["kv_lora_rank"],
        qk_nope_head_dim=MLA["qk_nope_head_dim"],
        qk_rope_head_dim=MLA["qk_rope_head_dim"],
        v_head_dim=MLA["v_head_dim"],
        rope_interleave=True,
        rope_parameters=dict(MLA_ROPE),
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        attention_bias=False,
    )
    cfg._attn_implementation = "eager"
    ref = DeepseekV3Attention(cfg, 0).double()
    with torch.no_grad():
        for name in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj"):
            getattr(ref, name).weight.copy_(getattr(ours, name).weight)
        ref.o_proj.weight.copy_(torch.cat([ours.o_proj.weight, torch.zeros_like(ours.o_proj.weight)]))
    B, T = 2, 70  # past original_max_position_embeddings (64): YaRN's interpolated frequencies matter
    x = torch.randn(B, T, 2 * H, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(T)
    cos, sin = DeepseekV3RotaryEmbedding(cfg).double()(x, positions[None].expand(B, T))
    mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    expected = ref(x, (cos, sin), mask)[0][..., :H]
    out, _ = ours(x, positions)
    # both compute their rope tables in float32 (SGLang's cos/sin cache too): 1e-6 apart, not 1e-12
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    assert ref.scaling != cfg.qk_nope_head_dim**-0.5 and ours.scale == pytest.approx(ref.scaling)
