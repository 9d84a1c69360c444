"""aerie's plain-torch sgl_kernel CPU ops, each against a plain reference.

The op module needs only torch, so these run in the project's .venv (it is loaded from its file:
`aerie_sglang` is installed into SGLang's own venv, not this one). Attention is checked against
`torch.nn.functional.scaled_dot_product_attention`, the tree/verify/slot ops against loops over
Python lists written independently of the implementation.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

OPS_FILE = Path(__file__).parents[2] / "services/inference/aerie_sglang/cpu/ops.py"

ALL_OPS = [
    "copy_all_layer_kv_cache_cpu",
    "decode_attention_cpu",
    "extend_attention_cpu",
    "build_draft_decode_metadata_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "assign_req_to_token_pool_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "fill_bonus_tokens_cpu",
    "fill_accept_out_cache_loc_cpu",
]


@pytest.fixture(scope="module")
def ops():
    if "aerie_sglang.cpu.ops" in sys.modules:
        return sys.modules["aerie_sglang.cpu.ops"]
    spec = importlib.util.spec_from_file_location("aerie_cpu_ops_under_test", OPS_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # registers the ops
    return module


K = torch.ops.sgl_kernel  # resolved lazily, after the fixture registered the ops


def test_every_op_sglang_calls_is_registered_for_cpu_once(ops):
    for name in ALL_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"sgl_kernel::{name}", "CPU"), name
    assert ops.register() == []  # idempotent: nothing registered twice


# --------------------------------------------------------------------------- attention


def make_pool(num_reqs=6, pool_len=64, num_slots=512, seed=0):
    """A KV slot pool and a req_to_token table whose rows point at scattered, distinct slots."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=g)[: num_reqs * pool_len].to(torch.int32)
    return slots.view(num_reqs, pool_len).contiguous()


def sdpa(q, k, v, scale, mask=None):
    """q (Lq,H,D), k/v (Lk,Hkv,D) -> (Lq,H,D), the reference."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_decode_attention_writes_the_new_token_and_matches_sdpa(ops, heads, kv_heads):
    torch.manual_seed(1)
    dim, num_slots = 16, 512
    req_to_token = make_pool(num_slots=num_slots)
    k_cache = torch.randn(num_slots, kv_heads, dim)
    v_cache = torch.randn(num_slots, kv_heads, dim)
    req_pool_indices = torch.tensor([4, 1, 3])
    seq_lens = torch.tensor([5, 17, 1])
    loc = torch.stack([req_to_token[r, s - 1] for r, s in zip(req_pool_indices, seq_lens)]).long()
    q = torch.randn(3, heads, dim)
    key, value = torch.randn(3, kv_heads, dim), torch.randn(3, kv_heads, dim)
    out = torch.empty(3, heads, dim)
    scale = dim**-0.5
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k[loc], expected_v[loc] = key, value

    K.decode_attention_cpu(
        q,
        k_cache,
        v_cache,
        1.0,
        1.0,
        out,
        key,
        value,
        loc,
        torch.zeros(3, heads, 8, dim + 1),
        req_to_token,
        req_pool_indices,
        seq_lens,
        scale,
        0.0,
        False,
        0,
        None,
        None,
    )

    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    for i in range(3):
        rows = req_to_token[req_pool_indices[i], : seq_lens[i]].long()
        ref = sdpa(q[i : i + 1], expected_k[rows], expected_v[rows], scale)
        torch.testing.assert_close(out[i : i + 1], ref, rtol=1e-5, atol=1e-5)


def test_decode_attention_logit_cap_and_refusals(ops):
    torch.manual_seed(2)
    q, cache = torch.randn(1, 2, 8) * 4, torch.randn(32, 2, 8) * 4
    req_to_token = torch.arange(32, dtype=torch.int32).view(1, 32)
    out = torch.empty(1, 2, 8)
    args = (
        q,
        cache,
        cache,
        1.0,
        1.0,
        out,
        None,
        None,
        torch.zeros(1, dtype=torch.long),
        torch.zeros(1, 2, 8, 9),
        req_to_token,
        torch.tensor([0]),
        torch.tensor([10]),
        0.5,
        3.0,
    )
    K.decode_attention_cpu(*args, False, 0, None, None)
    scores = torch.einsum("hd,khd->hk", q[0], cache[:10]) * 0.5
    probs = torch.softmax(3.0 * torch.tanh(scores / 3.0), -1)
    torch.testing.assert_close(out[0], torch.einsum("hk,khd->hd", probs, cache[:10]))
    with pytest.raises(NotImplementedError, match="sliding_window_size=5"):
        K.decode_attention_cpu(*args, False, 5, None, None)
    with pytest.raises(NotImplementedError, match="sinks"):
        K.decode_attention_cpu(*args, False, 0, None, torch.zeros(2))


def extend_case(seed, heads=4, kv_heads=2, dim=16):
    torch.manual_seed(seed)
    num_slots = 512
    req_to_token = make_pool(num_slots=num_slots, seed=seed)
    k_buffer, v_buffer = torch.randn(num_slots, kv_heads, dim), torch.randn(num_slots, kv_heads, dim)
    req_pool_indices = torch.tensor([2, 0, 5])
    seq_lens = torch.tensor([9, 4, 12])
    extend_seq_lens = torch.tensor([4, 4, 3], dtype=torch.int32)
    extend_start_loc = torch.tensor([0, 4, 8], dtype=torch.int32)
    q = torch.randn(11, heads + 2 * kv_heads, dim)[:, :heads]  # strided, as SGLang splits q out of qkv
    # the new tokens' k/v, already in the cache as SGLang's forward_extend writes them first
    k_new, v_new = torch.randn(11, kv_heads, dim), torch.randn(11, kv_heads, dim)
    for i in range(3):
        s, e, st = int(seq_lens[i]), int(extend_seq_lens[i]), int(extend_start_loc[i])
        rows = req_to_token[req_pool_indices[i], s - e : s].long()
        k_buffer[rows], v_buffer[rows] = k_new[st : st + e], v_new[st : st + e]
    return dict(
        q=q,
        k_new=k_new,
        v_new=v_new,
        k_buffer=k_buffer,
        v_buffer=v_buffer,
        req_to_token=req_to_token,
        req_pool_indices=req_pool_indices,
        seq_lens=seq_lens,
        extend_seq_lens=extend_seq_lens,
        extend_start_loc=extend_start_loc,
    )


def run_extend(c, tree_mask=None, with_new_kv=True, is_causal=True):
    out = torch.empty_like(c["q"])
    K.extend_attention_cpu(
        c["q"],
        c["k_new"] if with_new_kv else None,
        c["v_new"] if with_new_kv else None,
        out,
        c["k_buffer"],
        c["v_buffer"],
        1.0,
        1.0,
        c["req_to_token"],
        c["req_pool_indices"],
        c["seq_lens"],
        c["extend_seq_lens"],
        c["extend_start_loc"],
        4,
        0.25,
        0.0,
        False,
        0,
        None,
        None,
        tree_mask,
        is_causal,
    )
    return out


@pytest.mark.parametrize("with_new_kv", [True, False])
def test_extend_attention_is_causal_sdpa_over_prefix_and_new_tokens(ops, with_new_kv):
    c = extend_case(3)
    out = run_extend(c, with_new_kv=with_new_kv)
    for i in range(3):
        s, e, st = int(c["seq_lens"][i]), int(c["extend_seq_lens"][i]), int(c["extend_start_loc"][i])
        rows = c["req_to_token"][c["req_pool_indices"][i], :s].long()
        # query j (absolute position s-e+j) may see keys 0..s-e+j
        mask = torch.arange(s)[None, :] <= torch.arange(s - e, s)[:, None]
        ref = sdpa(c["q"][st : st + e], c["k_buffer"][rows], c["v_buffer"][rows], 0.25, mask)
        torch.testing.assert_close(out[st : st + e], ref, rtol=1e-5, atol=1e-5)


def test_extend_attention_follows_a_tree_mask(ops):
    c = extend_case(4)
    masks, flat = [], []
    g = torch.Generator().manual_seed(0)
    for i in range(3):
        s, e = int(c["seq_lens"][i]), int(c["extend_seq_lens"][i])
        m = torch.ones(e, s, dtype=torch.bool)
        m[:, s - e :] = torch.rand(e, e, generator=g) < 0.5
        m[:, s - e :] |= torch.eye(e, dtype=torch.bool)  # every token sees itself
        masks.append(m)
        flat.append(m.reshape(-1))
    out = run_extend(c, tree_mask=torch.cat(flat))
    for i in range(3):
        s, e, st = int(c["seq_lens"][i]), int(c["extend_seq_lens"][i]), int(c["extend_start_loc"][i])
        rows = c["req_to_token"][c["req_pool_indices"][i], :s].long()
        ref = sdpa(c["q"][st : st + e], c["k_buffer"][rows], c["v_buffer"][rows], 0.25, masks[i])
        torch.testing.assert_close(out[st : st + e], ref, rtol=1e-5, atol=1e-5)
    # the tree verify of topk > 1 may send only the new tokens' part (QLEN_ONLY): same attention
    qlen_only = torch.cat(
        [m[:, int(c["seq_lens"][i]) - int(c["extend_seq_lens"][i]) :].reshape(-1) for i, m in enumerate(masks)]
    )
    torch.testing.assert_close(run_extend(c, tree_mask=qlen_only), out, rtol=0, atol=0)
    # and a non-causal (encoder) extend sees everything
    out = run_extend(c, is_causal=False)
    rows = c["req_to_token"][c["req_pool_indices"][0], :9].long()
    torch.testing.assert_close(out[:4], sdpa(c["q"][:4], c["k_buffer"][rows], c["v_buffer"][rows], 0.25))


# --------------------------------------------------------------------------- MLA (DeepSeek/Kimi)
# SGLang keeps one latent row per token for multi-head latent attention: [kv_lora_rank normed
# latent | qk_rope_head_dim rotated key], one "KV head"; its value buffer is a view of the first
# kv_lora_rank columns of that same row. Prefill without a prefix runs as ordinary attention with
# the heads expanded (q/k head dim 24 here, v head dim 16); everything else (chunked prefill with
# a prefix, target verify, decode) runs absorbed: queries of width rank+rope against the one
# latent head, values = the latent itself. Shapes below are the tiny DeepSeek-V3's (tests/targets.py).
HEADS, QK_DIM, V_DIM, RANK, ROPE = 4, 24, 16, 32, 8


def latent_pool(num_slots=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    k_buffer = torch.randn(num_slots, 1, RANK + ROPE, generator=g)
    return k_buffer, k_buffer[..., :RANK]  # v: a view of k's first kv_lora_rank columns, as in SGLang


def test_mla_prefill_attends_expanded_heads_and_leaves_the_latent_cache_alone(ops):
    torch.manual_seed(5)
    req_to_token = make_pool(seed=5)
    k_buffer, v_buffer = latent_pool(seed=5)
    before = k_buffer.clone()
    req_pool_indices = torch.tensor([3, 1])
    seq_lens = torch.tensor([7, 12])  # no prefix: every token is new
    extend_start_loc = torch.tensor([0, 7], dtype=torch.int32)
    q, k, v = torch.randn(19, HEADS, QK_DIM), torch.randn(19, HEADS, QK_DIM), torch.randn(19, HEADS, V_DIM)
    out = torch.empty(19, HEADS, V_DIM)
    K.extend_attention_cpu(
        q,
        k,
        v,
        out,
        k_buffer,
        v_buffer,
        1.0,
        1.0,
        req_to_token,
        req_pool_indices,
        seq_lens,
        seq_lens.to(torch.int32),
        extend_start_loc,
        12,
        QK_DIM**-0.5,
        0.0,
        False,
        0,
        None,
        None,
        None,
        True,
    )
    for start, n in ((0, 7), (7, 12)):
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        ref = sdpa(q[start : start + n], k[start : start + n], v[start : start + n], QK_DIM**-0.5, causal)
        torch.testing.assert_close(out[start : start + n], ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(k_buffer, before)

    # the same layout over a cached prefix would mix expanded heads with latent rows: refused
    with pytest.raises(NotImplementedError, match="latent cache"):
        K.extend_attention_cpu(
            q[:3], k[:3], v[:3], out[:3], k_buffer, v_buffer, 1.0, 1.0, req_to_token, req_pool_indices[:1],
            torch.tensor([5]), torch.tensor([3], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), 3,
            QK_DIM**-0.5, 0.0, False, 0, None, None, None, True,
        )  # fmt: skip


def test_mla_absorbed_extend_attends_one_latent_head_over_prefix_and_new_tokens(ops):
    torch.manual_seed(6)
    req_to_token = make_pool(seed=6)
    k_buffer, v_buffer = latent_pool(seed=6)
    req_pool_indices = torch.tensor([0, 4])
    seq_lens, extend_seq_lens = torch.tensor([40, 9]), torch.tensor([8, 4], dtype=torch.int32)  # prefixes 32, 5
    extend_start_loc = torch.tensor([0, 8], dtype=torch.int32)
    q = torch.randn(12, HEADS, RANK + ROPE)
    k_new = torch.randn(12, 1, RANK + ROPE)
    for i, (s, e, st) in enumerate(((40, 8, 0), (9, 4, 8))):  # SGLang writes the new rows first
        k_buffer[req_to_token[req_pool_indices[i], s - e : s].long()] = k_new[st : st + e]
    out = torch.empty(12, HEADS, RANK)
    scale = QK_DIM**-0.5  # absorbed MLA keeps the expanded head's softmax scale
    K.extend_attention_cpu(
        q,
        k_new,
        k_new[..., :RANK],
        out,
        k_buffer,
        v_buffer,
        1.0,
        1.0,
        req_to_token,
        req_pool_indices,
        seq_lens,
        extend_seq_lens,
        extend_start_loc,
        8,
        scale,
        0.0,
        False,
        0,
        None,
        None,
        None,
        True,
    )
    for i, (s, e, st) in enumerate(((40, 8, 0), (9, 4, 8))):
        rows = k_buffer[req_to_token[req_pool_indices[i], :s].long()]  # (s, 1, rank+rope)
        mask = torch.arange(s)[None, :] <= torch.arange(s - e, s)[:, None]
        ref = sdpa(q[st : st + e], rows, rows[..., :RANK], scale, mask)
        torch.testing.assert_close(out[st : st + e], ref, rtol=1e-5, atol=1e-5)


def test_mla_decode_writes_the_latent_row_and_attends_it(ops):
    torch.manual_seed(7)
    req_to_token = make_pool(seed=7)
    k_cache, v_cache = latent_pool(seed=7)
    req_pool_indices, seq_lens = torch.tensor([2, 5]), torch.tensor([11, 1])
    loc = torch.stack([req_to_token[r, s - 1] for r, s in zip(req_pool_indices, seq_lens)]).long()
    q, key = torch.randn(2, HEADS, RANK + ROPE), torch.randn(2, 1, RANK + ROPE)
    out = torch.empty(2, HEADS, RANK)
    K.decode_attention_cpu(
        q, k_cache, v_cache, 1.0, 1.0, out, key, key[..., :RANK], loc, torch.zeros(2, HEADS, 8, RANK + 1),
        req_to_token, req_pool_indices, seq_lens, 0.2, 0.0, False, 0, None, None,
    )  # fmt: skip
    assert torch.equal(k_cache[loc], key) and torch.equal(v_cache[loc], key[..., :RANK])
    for i in range(2):
        rows = k_cache[req_to_token[req_pool_indices[i], : seq_lens[i]].long()]
        torch.testing.assert_close(
            out[i : i + 1], sdpa(q[i : i + 1], rows, rows[..., :RANK], 0.2), rtol=1e-5, atol=1e-5
        )


# --------------------------------------------------------------------------- KV slot ops


def test_copy_all_layer_kv_cache_moves_slots_in_every_buffer(ops):
    buffers = [torch.randn(40, 2, 8), torch.randn(40, 3, 4).to(torch.bfloat16), torch.randn(40, 16)]
    before = [b.clone() for b in buffers]
    data_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in buffers])
    tgt = torch.tensor([3, 7, 9, 10])
    src = torch.tensor([7, 3, 30, 39])  # 3<->7 swap overlaps: sources are read before writing
    K.copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt, src)
    for b, old in zip(buffers, before):
        expected = old.clone()
        for t, s in zip(tgt.tolist(), src.tolist()):
            expected[t] = old[s]
        assert torch.equal(b, expected)


def test_req_to_token_slot_bookkeeping_ops(ops):
    pool_len = 16
    req_to_token = torch.zeros(5, pool_len, dtype=torch.int32)
    req_pool_indices = torch.tensor([3, 0, 4])
    start, end = torch.tensor([2, 0, 5], dtype=torch.int32), torch.tensor([6, 3, 6], dtype=torch.int32)
    out_cache_loc = torch.arange(100, 108, dtype=torch.int64)

    K.assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start, end, out_cache_loc, pool_len)
    expected, offset = [[0] * pool_len for _ in range(5)], 0
    for r, s, e in zip(req_pool_indices.tolist(), start.tolist(), end.tolist()):
        for j in range(s, e):
            expected[r][j] = 100 + offset
            offset += 1
    assert req_to_token.tolist() == expected

    gathered = torch.full((8,), -7, dtype=torch.int64)
    K.assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start, end, gathered, pool_len)
    assert gathered.tolist() == list(range(100, 108))

    table = torch.arange(5 * pool_len, dtype=torch.int32).view(5, pool_len)
    seq_lens = torch.tensor([3, 1, 5])
    topk, num_steps = 2, 3
    draft_locs = torch.empty(3 * topk * num_steps, dtype=torch.int64)
    K.assign_draft_cache_locs_contiguous_cpu(req_pool_indices, table, seq_lens, draft_locs, pool_len, topk, num_steps)
    expected_locs = []
    for r, s in zip(req_pool_indices.tolist(), seq_lens.tolist()):
        expected_locs += [r * pool_len + s + j for j in range(topk * num_steps)]
    assert draft_locs.tolist() == expected_locs

    draft = K.build_draft_decode_metadata_cpu(table, req_pool_indices, seq_lens, topk, num_steps, pool_len)
    assert draft.shape == (3 * topk, pool_len) and draft.dtype == torch.int32
    for b, (r, s) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        for c in range(topk):
            row = draft[b * topk + c].tolist()
            prefix = [r * pool_len + j for j in range(s)]
            drafts = [r * pool_len + s + c * num_steps + j for j in range(num_steps)]
            assert row[: s + num_steps] == prefix + drafts


def test_fill_bonus_tokens_and_accepted_cache_slots(ops):
    accept_tokens = torch.tensor([[11, 12, 13, 14], [21, 22, 23, 24]], dtype=torch.int32)
    accept_lens = torch.tensor([3, 1], dtype=torch.int32)
    bonus = torch.zeros(2, dtype=torch.int32)
    K.fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus, 4)
    assert bonus.tolist() == [13, 21]

    accept_index = torch.tensor([[0, 2, -1], [4, -1, -1]], dtype=torch.int32)
    out_cache_loc = torch.arange(50, 56)
    slots = torch.zeros(3, dtype=torch.int64)
    K.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, slots)
    assert slots.tolist() == [50, 52, 54]


# --------------------------------------------------------------------------- draft tree


def random_tree_inputs(rng: random.Random, topk: int, depth: int, num_draft: int):
    """An EAGLE draft expansion as SGLang builds it: flat token j of step 0 (j < topk) hangs off
    the root; step d >= 1 expands topk parents (parent_list entries = their flat token ids) into
    topk*topk tokens; selected_index picks num_draft-1 tokens closed under ancestry, sorted."""
    parent_list = [-1]
    parent_of = {j: None for j in range(topk)}  # flat token -> flat parent token (None = root)
    layer = list(range(topk))
    next_id = topk
    for _ in range(1, depth):
        expanded = sorted(rng.sample(layer, topk))
        slot_base = len(parent_list)
        parent_list += expanded
        layer = []
        for slot, parent in enumerate(expanded):
            for _ in range(topk):
                parent_of[next_id] = parent
                assert next_id // topk == slot_base + slot  # SGLang's flat indexing
                layer.append(next_id)
                next_id += 1
    chosen: set[int] = set()
    while len(chosen) < num_draft - 1:
        token = rng.choice(list(parent_of))
        path = []
        while token is not None and token not in chosen:
            path.append(token)
            token = parent_of[token]
        if len(chosen) + len(path) <= num_draft - 1:
            chosen.update(path)
    return parent_list, sorted(chosen), parent_of


def reference_tree(selected, parent_of, seq_len, num_draft):
    """Node i>0 is selected[i-1]; children ordered by node number; depth-based positions."""
    node_of = {tok: i + 1 for i, tok in enumerate(selected)}
    parent = [None] + [node_of.get(parent_of[t], 0) if parent_of[t] is not None else 0 for t in selected]
    children = {p: [c for c in range(1, num_draft) if parent[c] == p] for p in range(num_draft)}
    next_token = [children[p][0] if children[p] else -1 for p in range(num_draft)]
    next_sibling = [-1] * num_draft
    for kids in children.values():
        for a, b in zip(kids, kids[1:]):
            next_sibling[a] = b
    ancestors = []
    for node in range(num_draft):
        chain = {0, node}
        walk = node
        while walk != 0:
            walk = parent[walk]
            chain.add(walk)
        ancestors.append(chain)
    positions = [seq_len + len(a) - 1 for a in ancestors]
    return next_token, next_sibling, ancestors, positions, children


@pytest.mark.parametrize("mode", [0, 1])
def test_build_tree_matches_a_reference_tree(ops, mode):
    rng = random.Random(5)
    topk, depth, n = 3, 4, 8
    batch = [random_tree_inputs(rng, topk, depth, n) for _ in range(3)]
    seq_lens = [7, 3, 12]
    parent_list = torch.tensor([b[0] for b in batch])
    selected_index = torch.tensor([b[1] for b in batch])
    mask_len = sum(s * n for s in seq_lens) + 3 * n * n if mode == 0 else 3 * n * n
    tree_mask = torch.ones(mask_len, dtype=torch.bool)
    positions = torch.zeros(3 * n, dtype=torch.int64)
    retrive_index = torch.zeros(3, n, dtype=torch.int64)
    next_token = torch.full((3, n), -1, dtype=torch.int64)
    next_sibling = torch.full((3, n), -1, dtype=torch.int64)
    K.build_tree_kernel_efficient_cpu(
        parent_list,
        selected_index,
        torch.tensor(seq_lens),
        tree_mask,
        positions,
        retrive_index,
        next_token,
        next_sibling,
        topk,
        depth,
        n,
        mode,
    )
    offset = 0
    for b, (_, selected, parent_of) in enumerate(batch):
        ref_next, ref_sibling, ancestors, ref_pos, _ = reference_tree(selected, parent_of, seq_lens[b], n)
        assert next_token[b].tolist() == ref_next
        assert next_sibling[b].tolist() == ref_sibling
        assert retrive_index[b].tolist() == [b * n + i for i in range(n)]
        assert positions[b * n : (b + 1) * n].tolist() == ref_pos
        row_len = n if mode == 1 else seq_lens[b] + n
        rows = tree_mask[offset : offset + n * row_len].view(n, row_len)
        for node in range(n):
            assert rows[node, row_len - n :].nonzero().flatten().tolist() == sorted(ancestors[node])
            assert rows[node, : row_len - n].all()  # the prefix stays visible
        offset += n * row_len


def test_verify_tree_greedy_walks_the_tree(ops):
    # one request, tree: 0 -> {1, 2}, 1 -> {3}, 2 -> {4}; drafts 1:"a"=5 2:"b"=6 3:7 4:8
    n, steps = 5, 4
    candidates = torch.tensor([[9, 5, 6, 7, 8], [9, 5, 6, 7, 8]])
    retrive_index = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]])
    next_token = torch.tensor([[1, 3, 4, -1, -1]] * 2)
    next_sibling = torch.tensor([[-1, 2, -1, -1, -1]] * 2)
    # request 0: target says 6 after root (second child), then 8, then 42 -> accepts 2, bonus 42
    # request 1: target says 3 after root -> accepts nothing, bonus 3
    target = torch.tensor([[6, 0, 8, 0, 42], [3, 0, 0, 0, 0]])
    predicts = torch.full((2 * n,), -1, dtype=torch.int32)
    accept_index = torch.full((2, steps), -1, dtype=torch.int32)
    accept_num = torch.zeros(2, dtype=torch.int32)
    K.verify_tree_greedy_cpu(
        predicts, accept_index, accept_num, candidates, retrive_index, next_token, next_sibling, target
    )
    assert accept_num.tolist() == [2, 0]
    assert accept_index.tolist() == [[0, 2, 4, -1], [5, -1, -1, -1]]
    assert predicts.tolist() == [6, -1, 8, -1, 42, 3, -1, -1, -1, -1]


def test_verify_tree_greedy_against_a_path_search_on_random_trees(ops):
    rng = random.Random(9)
    topk, depth, n, bs = 2, 4, 7, 4
    batch = [random_tree_inputs(rng, topk, depth, n) for _ in range(bs)]
    parent_list = torch.tensor([b[0] for b in batch])
    selected_index = torch.tensor([b[1] for b in batch])
    positions = torch.zeros(bs * n, dtype=torch.int64)
    retrive_index = torch.zeros(bs, n, dtype=torch.int64)
    next_token = torch.full((bs, n), -1, dtype=torch.int64)
    next_sibling = torch.full((bs, n), -1, dtype=torch.int64)
    K.build_tree_kernel_efficient_cpu(
        parent_list,
        selected_index,
        torch.full((bs,), 5),
        torch.ones(bs * n * n, dtype=torch.bool),
        positions,
        retrive_index,
        next_token,
        next_sibling,
        topk,
        depth,
        n,
        1,
    )
    vocab = 3  # small, so that matches happen
    candidates = torch.tensor([[rng.randrange(vocab) for _ in range(n)] for _ in range(bs)])
    target = torch.tensor([[rng.randrange(vocab) for _ in range(n)] for _ in range(bs)])
    predicts = torch.full((bs * n,), -1, dtype=torch.int32)
    accept_index = torch.full((bs, depth), -1, dtype=torch.int32)
    accept_num = torch.zeros(bs, dtype=torch.int32)
    K.verify_tree_greedy_cpu(
        predicts, accept_index, accept_num, candidates, retrive_index, next_token, next_sibling, target
    )
    for b, (_, selected, parent_of) in enumerate(batch):
        children = reference_tree(selected, parent_of, 5, n)[4]
        path, node = [0], 0
        while len(path) < depth:
            match = [c for c in children[node] if int(candidates[b, c]) == int(target[b, node])]
            if not match:
                break
            node = match[0]
            path.append(node)
        assert accept_num[b] == len(path) - 1
        assert accept_index[b].tolist() == [b * n + p for p in path] + [-1] * (depth - len(path))
        assert int(predicts[b * n + path[-1]]) == int(target[b, path[-1]])
