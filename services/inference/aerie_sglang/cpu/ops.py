"""Plain-torch versions of the `torch.ops.sgl_kernel.*` CPU ops SGLang 0.5.23 calls with the
`intel_amx` attention backend: when it serves an EAGLE-3 drafter, and for any model with
multi-head latent attention (the launcher keeps that backend for both).

PyPI's `sglang-kernel==0.4.10` is a CUDA-only build: its libraries declare none of these ops, so on a
CPU machine without sgl-kernel's own CPU build the `intel_amx` path fails at its first call. This
module defines each op's schema in the `sgl_kernel` namespace (only where nothing declared it yet) and
registers a CPU implementation written in plain torch, following the semantics of sgl-kernel's
`csrc/cpu/` kernels and of SGLang's Python callers.

Design choices:
- Importing this module registers the ops, as importing a C++ extension does; `register()` is
  idempotent and returns the names it registered. Nothing else happens at import.
- Readable before fast: attention is a per-sequence loop over einsum + softmax in float32, tree ops
  are the straightforward loops. Fine for a 135M model and a few prompts, not for load tests.
- Anything the pinned SGLang might pass that these versions do not implement (sliding windows,
  attention sinks, cross-attention) is refused with an error that names the argument, never
  silently ignored.
- Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2/K2.5) needs nothing else: the attention
  ops take any number of KV heads that divides the query heads, and any v head dim. SGLang runs
  MLA on this backend as (a) prefill without a cached prefix: ordinary attention with the heads
  expanded (q/k head dim != v head dim) over the new tokens only, the latent cache already
  written; (b) everything else: "absorbed" attention, one latent KV head of width
  kv_lora_rank + rope dim whose value buffer is a view of its first kv_lora_rank columns.
- Deliberately absent: `convert_weight_packed`. SGLang switches its layers (linear, MoE, MLA
  projections) to sgl-kernel's AMX kernels (`weight_packed_linear`, `fused_experts_cpu`,
  `biased_grouped_topk_cpu`, `qkv_proj_with_rope`, ...) when the CPU has AMX tiles *and* that op
  exists (`sglang.srt.utils.common.cpu_has_amx_support`). Without it those layers run SGLang's
  plain-torch code on any CPU (MoE: `moe_forward_native` with torch top-k routing), so only the
  attention and speculative-decoding bookkeeping ops below are needed. Measured with the tiny
  DeepSeek-V3 (8 routed experts, grouped biased top-k, shared expert) in capture and EAGLE-3
  serve mode: the ops called were exactly the ones in SCHEMAS minus fill_accept_out_cache_loc_cpu.
- Every op is checked in `tests/inference/test_cpu_ops.py` against a plain reference (attention against
  `torch.nn.functional.scaled_dot_product_attention`, tree/verify ops against loops over Python lists).
"""

from __future__ import annotations

import ctypes

import torch

NAMESPACE = "sgl_kernel"

# name -> schema, in the argument order of sgl_kernel 0.4.10's Python wrappers and SGLang 0.5.23's
# intel_amx backend (the callers are the contract: both pass arguments positionally).
SCHEMAS: dict[str, str] = {
    "decode_attention_cpu": (
        "decode_attention_cpu(Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, float k_scale, "
        "float v_scale, Tensor(c!) output, Tensor? key, Tensor? value, Tensor loc, "
        "Tensor(d!) attn_logits, Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, "
        "float sm_scale, float logit_cap, bool is_cross_attention, int sliding_window_size, "
        "Tensor? encoder_lens, Tensor? sinks) -> ()"
    ),
    "extend_attention_cpu": (
        "extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, "
        "Tensor(a!) o_extend, Tensor k_buffer, Tensor v_buffer, float k_scale, float v_scale, "
        "Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens, "
        "Tensor extend_start_loc, int? max_len_extend, float sm_scale, float logit_cap, "
        "bool is_cross_attention, int sliding_window_size, Tensor? encoder_lens, Tensor? sinks, "
        "Tensor? tree_mask, bool is_causal) -> ()"
    ),
    "copy_all_layer_kv_cache_cpu": (
        "copy_all_layer_kv_cache_cpu(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()"
    ),
    "build_draft_decode_metadata_cpu": (
        "build_draft_decode_metadata_cpu(Tensor req_to_token, Tensor req_pool_indices, "
        "Tensor seq_lens, int topk, int num_steps, int pool_len) -> Tensor"
    ),
    "build_tree_kernel_efficient_cpu": (
        "build_tree_kernel_efficient_cpu(Tensor parent_list, Tensor selected_index, "
        "Tensor verified_seq_len, Tensor(a!) tree_mask, Tensor(b!) positions, "
        "Tensor(c!) retrive_index, Tensor(d!) retrive_next_token, Tensor(e!) retrive_next_sibling, "
        "int topk, int depth, int draft_token_num, int tree_mask_mode) -> ()"
    ),
    "verify_tree_greedy_cpu": (
        "verify_tree_greedy_cpu(Tensor(a!) predicts, Tensor(b!) accept_index, "
        "Tensor(c!) accept_token_num, Tensor candidates, Tensor retrive_index, "
        "Tensor retrive_next_token, Tensor retrive_next_sibling, Tensor target_predict) -> ()"
    ),
    "assign_req_to_token_pool_cpu": (
        "assign_req_to_token_pool_cpu(Tensor req_pool_indices, Tensor(a!) req_to_token, "
        "Tensor start_offset, Tensor end_offset, Tensor out_cache_loc, int pool_len) -> ()"
    ),
    "assign_extend_cache_locs_cpu": (
        "assign_extend_cache_locs_cpu(Tensor req_pool_indices, Tensor req_to_token, "
        "Tensor start_offset, Tensor end_offset, Tensor(a!) out_cache_loc, int pool_len) -> ()"
    ),
    "assign_draft_cache_locs_contiguous_cpu": (
        "assign_draft_cache_locs_contiguous_cpu(Tensor req_pool_indices, Tensor req_to_token, "
        "Tensor seq_lens, Tensor(a!) out_cache_loc, int pool_len, int topk, int num_steps) -> ()"
    ),
    "fill_bonus_tokens_cpu": (
        "fill_bonus_tokens_cpu(Tensor accept_tokens, Tensor accept_lens, Tensor(a!) bonus_tokens, "
        "int accept_stride) -> ()"
    ),
    "fill_accept_out_cache_loc_cpu": (
        "fill_accept_out_cache_loc_cpu(Tensor accept_index, Tensor out_cache_loc, "
        "Tensor(a!) accept_out_cache_loc) -> ()"
    ),
}

TREE_MASK_FULL, TREE_MASK_QLEN_ONLY = 0, 1


# --------------------------------------------------------------------------- attention


def _refuse_unsupported(op: str, is_cross_attention: bool, sliding_window_size: int, sinks) -> None:
    # SGLang passes `layer.sliding_window_size + 1`, so 0 (from -1) means "no window".
    if is_cross_attention:
        raise NotImplementedError(f"{op}: is_cross_attention=True is not implemented by aerie's CPU ops")
    if sliding_window_size > 0:
        raise NotImplementedError(
            f"{op}: sliding_window_size={sliding_window_size} is not implemented by aerie's CPU ops; "
            "serve a model without sliding-window attention or use sgl-kernel's CPU build"
        )
    if sinks is not None:
        raise NotImplementedError(f"{op}: attention sinks are not implemented by aerie's CPU ops")


def attend(
    q: torch.Tensor,  # (Lq, H, D)
    k: torch.Tensor,  # (Lk, Hkv, D)
    v: torch.Tensor,  # (Lk, Hkv, Dv)
    sm_scale: float,
    logit_cap: float,
    allowed: torch.Tensor | None,  # (Lq, Lk) bool, True = may attend; None = everything
) -> torch.Tensor:  # (Lq, H, Dv) float32
    q_len, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads  # grouped-query attention: q heads h*group..h*group+group-1 share kv head h
    q = q.float().view(q_len, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * q_len, dim)
    scores = torch.bmm(q, k.float().permute(1, 2, 0)).mul_(sm_scale)  # (Hkv, group*Lq, Lk)
    if logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    if allowed is not None:
        scores = scores.view(kv_heads, group, q_len, -1).masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(kv_heads, group * q_len, -1)
    out = torch.bmm(probs, v.float().transpose(0, 1))  # (Hkv, group*Lq, Dv)
    return out.view(kv_heads, group, q_len, -1).permute(2, 0, 1, 3).reshape(q_len, heads, -1)


def _kv_rows(buffer: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    values = buffer[rows]
    if scale != 1.0 or values.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        values = values.float() * scale  # fp8 caches store value / scale
    return values


def decode_attention_cpu(
    query,
    k_cache,
    v_cache,
    k_scale,
    v_scale,
    output,
    key,
    value,
    loc,
    attn_logits,
    req_to_token,
    req_pool_indices,
    seq_lens,
    sm_scale,
    logit_cap,
    is_cross_attention,
    sliding_window_size,
    encoder_lens,
    sinks,
) -> None:
    """One new token per sequence: write its k/v at `loc` (when given), then attend over the
    sequence's first `seq_lens[i]` cache slots, found through `req_to_token`."""
    _refuse_unsupported("decode_attention_cpu", is_cross_attention, sliding_window_size, sinks)
    if key is not None and value is not None:
        k_cache[loc] = key.to(k_cache.dtype)
        v_cache[loc] = value.to(v_cache.dtype)
    for i in range(query.shape[0]):
        rows = req_to_token[req_pool_indices[i], : int(seq_lens[i])].long()
        out = attend(
            query[i : i + 1],
            _kv_rows(k_cache, rows, k_scale),
            _kv_rows(v_cache, rows, v_scale),
            sm_scale,
            logit_cap,
            None,
        )
        output[i] = out[0].to(output.dtype)
    # attn_logits is the C++ kernel's split-K scratch space; nothing here needs it.


def extend_attention_cpu(
    q_extend,
    k_extend,
    v_extend,
    o_extend,
    k_buffer,
    v_buffer,
    k_scale,
    v_scale,
    req_to_token,
    req_pool_indices,
    seq_lens,
    extend_seq_lens,
    extend_start_loc,
    max_len_extend,
    sm_scale,
    logit_cap,
    is_cross_attention,
    sliding_window_size,
    encoder_lens,
    sinks,
    tree_mask,
    is_causal,
) -> None:
    """Several new tokens per sequence (prefill, draft extend, target verify). Sequence i has
    `seq_lens[i]` tokens of which the last `extend_seq_lens[i]` are new; their queries start at row
    `extend_start_loc[i]`. The prefix is read from the cache through `req_to_token`, the new tokens'
    k/v from `k_extend`/`v_extend` (from the cache when those are None).

    `tree_mask` (target verify of a token tree) is SGLang's FULL_MASK layout: per sequence, row-major
    (extend_len, seq_len) booleans, sequences back to back; True = may attend. Without it the new
    tokens see the whole prefix and attend causally among themselves (`is_causal`)."""
    _refuse_unsupported("extend_attention_cpu", is_cross_attention, sliding_window_size, sinks)
    mask_offset = 0
    # The verify of a token tree (topk > 1) sends either SGLang's FULL_MASK layout, (extend_len,
    # seq_len) per sequence, or only the new tokens' part, (extend_len, extend_len) per sequence
    # (QLEN_ONLY: every new token sees the whole prefix). The mask's size tells which.
    qlen_only = tree_mask is not None and tree_mask.numel() == int((extend_seq_lens.long() ** 2).sum()) != int(
        (extend_seq_lens.long() * seq_lens.long()).sum()
    )
    for i in range(seq_lens.shape[0]):
        seq_len, ext_len = int(seq_lens[i]), int(extend_seq_lens[i])
        start, prefix_len = int(extend_start_loc[i]), seq_len - ext_len
        rows = req_to_token[req_pool_indices[i], :seq_len].long()
        if k_extend is None or v_extend is None:
            k, v = _kv_rows(k_buffer, rows, k_scale), _kv_rows(v_buffer, rows, v_scale)
        else:
            k_new, v_new = k_extend[start : start + ext_len], v_extend[start : start + ext_len]
            if prefix_len:
                prefix = rows[:prefix_len]
                k_old, v_old = _kv_rows(k_buffer, prefix, k_scale), _kv_rows(v_buffer, prefix, v_scale)
                if k_old.shape[1:] != k_new.shape[1:] or v_old.shape[1:] != v_new.shape[1:]:
                    raise NotImplementedError(
                        f"extend_attention_cpu: the cached prefix ({prefix_len} tokens) has k/v rows "
                        f"{tuple(k_old.shape[1:])}/{tuple(v_old.shape[1:])} but the new tokens "
                        f"{tuple(k_new.shape[1:])}/{tuple(v_new.shape[1:])} (MLA's expanded-head "
                        "extend over a latent cache): SGLang runs that path only without a prefix"
                    )
                k_new, v_new = torch.cat([k_old, k_new.to(k_old.dtype)]), torch.cat([v_old, v_new.to(v_old.dtype)])
            k, v = k_new, v_new
        if tree_mask is not None and qlen_only:
            among = tree_mask[mask_offset : mask_offset + ext_len * ext_len].view(ext_len, ext_len).bool()
            mask_offset += ext_len * ext_len
            allowed = torch.cat([torch.ones(ext_len, prefix_len, dtype=torch.bool), among], dim=1)
        elif tree_mask is not None:
            allowed = tree_mask[mask_offset : mask_offset + ext_len * seq_len].view(ext_len, seq_len)
            mask_offset += ext_len * seq_len
        elif is_causal:
            query_pos = torch.arange(prefix_len, seq_len).unsqueeze(1)
            allowed = torch.arange(seq_len).unsqueeze(0) <= query_pos
        else:
            allowed = None
        out = attend(q_extend[start : start + ext_len], k, v, sm_scale, logit_cap, allowed)
        o_extend[start : start + ext_len] = out.to(o_extend.dtype)


# --------------------------------------------------------------------------- KV cache slots


_raw_views: dict[tuple[int, int], torch.Tensor] = {}


def _raw_rows(address: int, row_bytes: int, num_rows: int) -> torch.Tensor:
    """A (num_rows, row_bytes) uint8 view of memory SGLang owns (a KV buffer), by address."""
    view = _raw_views.get((address, row_bytes))
    if view is None or view.shape[0] < num_rows:
        raw = (ctypes.c_uint8 * (num_rows * row_bytes)).from_address(address)
        view = torch.frombuffer(raw, dtype=torch.uint8).view(num_rows, row_bytes)
        _raw_views[(address, row_bytes)] = view
    return view[:num_rows]


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc) -> None:
    """For every buffer (data_ptrs[b] = its address, strides[b] = bytes per slot), copy slot
    src_loc[j] to slot tgt_loc[j]. Reads all sources before writing, so overlapping moves are safe."""
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.long(), src_loc.long()
    num_rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for address, row_bytes in zip(data_ptrs.tolist(), strides.tolist()):
        rows = _raw_rows(int(address), int(row_bytes), num_rows)
        rows[tgt] = rows[src]  # advanced indexing on the right makes a copy first


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
) -> None:
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the next end[i]-start[i] entries of
    out_cache_loc (requests back to back)."""
    offset = 0
    for i in range(req_pool_indices.shape[0]):
        start, end = int(start_offset[i]), int(end_offset[i])
        req_to_token[req_pool_indices[i], start:end] = out_cache_loc[offset : offset + end - start].to(
            req_to_token.dtype
        )
        offset += end - start


def assign_extend_cache_locs_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
) -> None:
    """The inverse gather: out_cache_loc (back to back) = req_to_token[req, start:end] per request."""
    offset = 0
    for i in range(req_pool_indices.shape[0]):
        start, end = int(start_offset[i]), int(end_offset[i])
        out_cache_loc[offset : offset + end - start] = req_to_token[req_pool_indices[i], start:end]
        offset += end - start


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_steps
) -> None:
    """Request i's topk*num_steps draft slots, reserved right after its seq_lens[i] committed ones."""
    width = topk * num_steps
    for i in range(req_pool_indices.shape[0]):
        start = int(seq_lens[i])
        out_cache_loc[i * width : (i + 1) * width] = req_to_token[req_pool_indices[i], start : start + width]


def build_draft_decode_metadata_cpu(req_to_token, req_pool_indices, seq_lens, topk, num_steps, pool_len):
    """A req_to_token table for multi-step draft decode: row b*topk+c = request b's committed prefix,
    then candidate c's num_steps draft slots (laid out at seq_len + c*num_steps)."""
    num_seqs = req_pool_indices.shape[0]
    draft = torch.zeros((num_seqs * topk, pool_len), dtype=req_to_token.dtype)
    for b in range(num_seqs):
        source = req_to_token[req_pool_indices[b]]
        seq_len = int(seq_lens[b])
        for c in range(topk):
            row = draft[b * topk + c]
            row[:seq_len] = source[:seq_len]
            first = seq_len + c * num_steps
            row[seq_len : seq_len + num_steps] = source[first : first + num_steps]
    return draft


# --------------------------------------------------------------------------- draft tree


def build_tree_kernel_efficient_cpu(
    parent_list,
    selected_index,
    verified_seq_len,
    tree_mask,
    positions,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    topk,
    depth,
    draft_token_num,
    tree_mask_mode,
) -> None:
    """Turn the drafter's top-k expansion into the verify tree: for each request, node 0 is the last
    verified token and node i>0 is the draft token selected_index[i-1]. Fills the attention mask
    (a node sees the root, its ancestors and itself), positions (seq_len + depth), and the links
    verify_tree_greedy walks (first child, next sibling; later siblings are linked first)."""
    if tree_mask_mode not in (TREE_MASK_FULL, TREE_MASK_QLEN_ONLY):
        raise NotImplementedError(
            f"build_tree_kernel_efficient_cpu: tree_mask_mode={tree_mask_mode} is not supported on "
            "the CPU (0 = FULL_MASK, 1 = QLEN_ONLY)"
        )
    n = draft_token_num
    parents = parent_list.tolist()
    selected = selected_index.tolist()
    seq_lens = verified_seq_len.tolist()

    def parent_node(b: int, node: int) -> int:
        """Tree node (0..n-1) of node's parent, or n when the parent is not among the selected."""
        parent_slot = selected[b][node - 1] // topk
        if parent_slot == 0:
            return 0
        parent_token = parents[b][parent_slot]
        for j in range(n - 1):
            if selected[b][j] == parent_token:
                return j + 1
        return n

    mask_offset = 0
    for b in range(len(seq_lens)):
        seq_len, base = int(seq_lens[b]), b * n
        positions[base] = seq_len
        retrive_index[b, 0] = base
        for node in range(n - 1, 0, -1):
            retrive_index[b, node] = base + node
            parent = parent_node(b, node)
            if parent == n:
                continue
            first_child = int(retrive_next_token[b, parent])
            retrive_next_token[b, parent] = node
            if first_child != -1:
                retrive_next_sibling[b, node] = first_child
        row_len = n if tree_mask_mode == TREE_MASK_QLEN_ONLY else seq_len + n
        prefix = 0 if tree_mask_mode == TREE_MASK_QLEN_ONLY else seq_len
        for node in range(n):
            row = mask_offset + node * row_len + prefix  # the prefix columns are left as they were
            tree_mask[row : row + n] = False
            tree_mask[row] = True  # the root
            depth_of_node, ancestor = 0, node
            while ancestor != 0 and ancestor != n:
                tree_mask[row + ancestor] = True
                depth_of_node += 1
                ancestor = parent_node(b, ancestor)
            positions[base + node] = seq_len + depth_of_node
        mask_offset += n * row_len


def verify_tree_greedy_cpu(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    target_predict,
) -> None:
    """Greedy tree verification: from the root, repeatedly step to the first child (in sibling
    order) whose draft token equals the target's argmax at the current node. predicts[node] gets the
    target token at each accepted node, accept_index the flat indices of the accepted path (the
    caller pre-fills the rest with -1), accept_token_num the number of accepted drafts (bonus
    excluded)."""
    batch, num_spec_steps = accept_index.shape
    flat_target = target_predict.reshape(-1)
    for b in range(batch):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        accepted, node = 0, 0
        for _ in range(1, num_spec_steps):
            node = int(retrive_next_token[b, node])
            while node != -1:
                if int(candidates[b, node]) == int(flat_target[last]):
                    predicts[last] = flat_target[last]
                    accepted += 1
                    last = int(retrive_index[b, node])
                    accept_index[b, accepted] = last
                    break
                node = int(retrive_next_sibling[b, node])
            if node == -1:
                break
        accept_token_num[b] = accepted
        predicts[last] = flat_target[last]


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride) -> None:
    """bonus_tokens[i] = the last accepted token of request i (accept_lens includes the bonus)."""
    flat = accept_tokens.reshape(-1)
    for i in range(accept_lens.shape[0]):
        bonus_tokens[i] = flat[accept_stride * i + int(accept_lens[i]) - 1]


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc) -> None:
    """The cache slots of the accepted tokens, in order, skipping rejected (-1) entries."""
    accepted = accept_index.reshape(-1)
    accepted = accepted[accepted > -1].long()
    accept_out_cache_loc[: accepted.numel()] = out_cache_loc[accepted]


# --------------------------------------------------------------------------- registration

IMPLEMENTATIONS = {name: globals()[name] for name in SCHEMAS}
_library: torch.library.Library | None = None


def _has_schema(name: str) -> bool:
    try:
        torch._C._get_schema(f"{NAMESPACE}::{name}", "")
    except RuntimeError:
        return False
    return True


def _has_cpu_kernel(name: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::{name}", "CPU")


def register() -> list[str]:
    """Define (where undeclared) and implement for CPU every op in SCHEMAS; idempotent. Ops that
    already have a CPU kernel (sgl-kernel's own CPU build) are left alone. Returns the names this
    call registered."""
    global _library
    if _library is None:
        _library = torch.library.Library(NAMESPACE, "FRAGMENT")
    registered = []
    for name, schema in SCHEMAS.items():
        if not _has_schema(name):
            _library.define(schema)
        if not _has_cpu_kernel(name):
            _library.impl(name, IMPLEMENTATIONS[name], "CPU")
            registered.append(name)
    return registered


register()


def _cpu_synchronize() -> None:
    """SGLang's MLA EAGLE-3 drafter (`Eagle3DeepseekV2ForCausalLM.set_embed`, 0.5.23) calls
    `torch.cuda.synchronize()` unconditionally after sharing the target's embedding; on a machine
    with no CUDA device there is nothing to wait for, where torch would raise."""


if not torch.cuda.is_available():
    torch.cuda.synchronize = lambda device=None: _cpu_synchronize()
