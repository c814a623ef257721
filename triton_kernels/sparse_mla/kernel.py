"""DeepSeek Sparse Attention in Triton: one kernel for prefill (bf16 kv) and decoding (paged, quantized).

Program ``(token * heads_blocks + head_block, split)`` owns BLOCK_H query heads of one token (and of one
kv group). Every gathered latent row is loaded (and dequantized) once per program as one [BLOCK_N, 512] tile that
feeds BLOCK_H heads, as K (with the rope tail) and unchanged as V. The keys of a token are its ``topk`` main
indices followed by its extra-cache indices; with ``num_splits > 1`` each split takes a contiguous range of
key blocks and writes a partial that ``common.combine_kernel`` merges.
"""

import triton
import triton.language as tl

from ..common import NEG, attend_block, load_latent, load_latent_rope, row_offsets, store_partial, store_result


@triton.jit
def _block_indices(idx_row_ptr, j, n_keys, BLOCK_N: tl.constexpr):
    """The index list's entries of key block ``j``; entries past the list read as -1 (invalid)."""
    offs = j * BLOCK_N + tl.arange(0, BLOCK_N)
    return tl.load(idx_row_ptr + offs, mask=offs < n_keys, other=-1)


@triton.jit
def _attend_source(q, qr, idx_row_ptr, n_keys, blk_begin, blk_end, kv_ptr, stride_block, stride_row,
                   group_off, page, n_rows, scale_log2, m_run, m_use, l, acc,
                   FMT: tl.constexpr, D_QK: tl.constexpr, BLOCK_N: tl.constexpr, SKIP_SCALE: tl.constexpr,
                   NATIVE_FP8: tl.constexpr, PORTABLE: tl.constexpr, INTERPRET: tl.constexpr,
                   NUM_STAGES: tl.constexpr):
    """Attend to key blocks ``[blk_begin, blk_end)`` of one index list into one paged cache."""
    # A block's indices are asked for one block ahead by hand. Unpipelined (1 stage), a block would otherwise wait
    # for its indices and then for its rows: two memory round trips. Pipelined below 5 stages, the compiler's own
    # index loads are committed after the gathers and needed within the iteration, so each iteration waits for
    # every copy in flight (compile_report's "prefetch" 0); with the indices by hand, a quantized cache's 3-stage
    # loop keeps 2-3 groups of gathered codes in flight across a block (run 136: -13 to -15 % for V3.2). A bf16
    # tile would need a fourth stage of rows for that (295 KB at d 576), and from 5 stages on the pipeliner keeps
    # gathers ahead itself: both keep the compiler's index loads.
    HAND_INDICES: tl.constexpr = NUM_STAGES == 1 or (FMT != 0 and NUM_STAGES < 5)
    if HAND_INDICES:
        idx_next = _block_indices(idx_row_ptr, blk_begin, n_keys, BLOCK_N)
    for j in tl.range(blk_begin, blk_end, num_stages=NUM_STAGES):
        if HAND_INDICES:
            idx = idx_next
            idx_next = _block_indices(idx_row_ptr, j + 1, n_keys, BLOCK_N)
        else:
            idx = _block_indices(idx_row_ptr, j, n_keys, BLOCK_N)
        # FlashMLA's decode only skips -1; any index outside the cache is skipped too (never read).
        valid = (idx >= 0) & (idx < n_rows)
        row, srow = row_offsets(tl.where(valid, idx, 0), page, stride_block, stride_row, FMT)
        row += group_off
        k = load_latent(kv_ptr, row, srow, valid, FMT, q.dtype, NATIVE_FP8, PORTABLE)
        if D_QK == 576:
            kr = load_latent_rope(kv_ptr, row, valid, FMT, PORTABLE)
        else:
            kr = k
        m_run, m_use, l, acc = attend_block(q, qr, k, kr, valid[None, :], scale_log2, m_run, m_use, l, acc,
                                            D_QK == 576, SKIP_SCALE, INTERPRET)
    return m_run, m_use, l, acc


# What changes from call to call without changing the code is not specialized on, so a new batch size (split
# count) or, in prefill, a new number of kv rows (kv is then one page of s_kv rows) reuses the compiled kernel.
@triton.jit(do_not_specialize=["num_splits", "kv_page", "kv_rows", "x_page", "x_rows"])
def sparse_mla_kernel(
        q_ptr, sq_t, sq_h,
        idx_ptr, si_t, si_g, topk, len_ptr, LEN_DIV,
        kv_ptr, kv_sb, kv_sr, kv_sg, kv_page, kv_rows,
        x_idx_ptr, sxi_t, x_topk, x_len_ptr, x_kv_ptr, x_sb, x_sr, x_page, x_rows,
        sink_ptr, out_ptr, so_t, so_h, lse_ptr, max_ptr, po_ptr, plse_ptr,
        num_heads, heads_per_group, hb_per_group, num_splits, scale_log2,
        D_QK: tl.constexpr, FMT: tl.constexpr, X_FMT: tl.constexpr, HAS_X: tl.constexpr,
        HAS_LEN: tl.constexpr, HAS_X_LEN: tl.constexpr, HAS_SINK: tl.constexpr, WRITE_MAX: tl.constexpr,
        SPLIT: tl.constexpr, NATIVE_FP8: tl.constexpr, PORTABLE: tl.constexpr, INTERPRET: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SKIP_SCALE: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    hb_total = (num_heads // heads_per_group) * hb_per_group
    t = (pid // hb_total).to(tl.int64)
    g = (pid % hb_total) // hb_per_group
    local = (pid % hb_per_group) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_mask = local < heads_per_group
    head = g * heads_per_group + local

    q_row = q_ptr + t * sq_t + head[:, None] * sq_h
    q = tl.load(q_row + tl.arange(0, 512)[None, :], mask=row_mask[:, None], other=0.0)
    if D_QK == 576:
        qr = tl.load(q_row + 512 + tl.arange(0, 64)[None, :], mask=row_mask[:, None], other=0.0)
    else:
        qr = q

    n_main = topk
    if HAS_LEN:
        n_main = tl.minimum(topk, tl.load(len_ptr + t // LEN_DIV))
    nb_main = tl.cdiv(n_main, BLOCK_N)
    total = nb_main
    n_x = 0
    if HAS_X:
        n_x = x_topk
        if HAS_X_LEN:
            n_x = tl.minimum(x_topk, tl.load(x_len_ptr + t // LEN_DIV))
        total += tl.cdiv(n_x, BLOCK_N)
    per_split = tl.cdiv(total, num_splits)
    b0 = split * per_split
    b1 = tl.minimum(b0 + per_split, total)

    m_run = tl.full((BLOCK_H,), NEG, tl.float32)
    m_use = tl.full((BLOCK_H,), NEG, tl.float32)
    l = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, 512), tl.float32)
    m_run, m_use, l, acc = _attend_source(
        q, qr, idx_ptr + t * si_t + g * si_g, n_main, b0, tl.minimum(b1, nb_main), kv_ptr, kv_sb, kv_sr,
        g * kv_sg, kv_page, kv_rows, scale_log2, m_run, m_use, l, acc,
        FMT, D_QK, BLOCK_N, SKIP_SCALE, NATIVE_FP8, PORTABLE, INTERPRET, NUM_STAGES)
    if HAS_X:
        m_run, m_use, l, acc = _attend_source(
            q, qr, x_idx_ptr + t * sxi_t, n_x, tl.maximum(b0, nb_main) - nb_main, b1 - nb_main, x_kv_ptr,
            x_sb, x_sr, 0, x_page, x_rows, scale_log2, m_run, m_use, l, acc,
            X_FMT, D_QK, BLOCK_N, SKIP_SCALE, NATIVE_FP8, PORTABLE, INTERPRET, NUM_STAGES)

    if SPLIT:
        prow = (t * num_splits + split) * num_heads + head
        store_partial(po_ptr, prow * 512, plse_ptr, prow, row_mask, m_use, l, acc)
    else:
        store_result(out_ptr, t * so_t + head * so_h, lse_ptr, t * num_heads + head, max_ptr, t * num_heads + head,
                     row_mask, sink_ptr, head, m_run, m_use, l, acc, HAS_SINK, WRITE_MAX)

