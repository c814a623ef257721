"""MLA decoding over a paged bf16/fp16 latent cache, with split-KV.

Program ``(request, kv head, row block)`` x ``split``. The query rows of one kv head are packed MQA-style:
row ``r`` is query ``r // group`` and head ``kv_head * group + r % group``, so one latent tile loaded from
the cache feeds every query and every head that shares it. Keys are request positions ``[0, cache_seqlen)``
mapped through the block table (any page size); the causal mask is aligned to the end:
query i sees positions ``<= seqlen - s_q + i``. Key blocks that no mask touches run a mask-free loop whose
tiles come by tensor-memory copy (TMA) when the block size divides the page; the tail runs masked.
"""

import triton
import triton.language as tl

from ..common import FMT_BF16, NEG, attend_block, load_latent, load_latent_rope, store_partial, store_result


@triton.jit
def _clean_tile(kv_ptr, k_desc, r_desc, bt_row_ptr, j, page, num_blocks, kv_sb, kv_sr, kv_sg, g,
                BLOCK_N: tl.constexpr, D_QK: tl.constexpr, USE_TMA: tl.constexpr):
    """Latent rows of key block ``j``, known to be inside the sequence (no masks needed).

    With ``USE_TMA`` (BLOCK_N divides the page) the block is BLOCK_N consecutive rows of one page and comes in
    as one tensor-memory copy, out-of-range block ids reading zeros; otherwise rows are gathered, with
    corrupt block ids redirected to block 0 so nothing outside the cache is read.
    """
    pos0 = j * BLOCK_N
    if USE_TMA:
        blk = tl.load(bt_row_ptr + pos0 // page)
        off = pos0 % page
        k = tl.reshape(k_desc.load([blk, off, g, 0]), (BLOCK_N, 512))
        if D_QK == 576:
            kr = tl.reshape(r_desc.load([blk, off, g, 512]), (BLOCK_N, 64))
        else:
            kr = k
    else:
        pos = pos0 + tl.arange(0, BLOCK_N)
        blk = tl.load(bt_row_ptr + pos // page)
        blk = tl.where((blk >= 0) & (blk < num_blocks), blk, 0)
        row = blk.to(tl.int64) * kv_sb + (pos % page) * kv_sr + g * kv_sg
        k = tl.load(kv_ptr + row[:, None] + tl.arange(0, 512)[None, :])
        if D_QK == 576:
            kr = tl.load(kv_ptr + row[:, None] + 512 + tl.arange(0, 64)[None, :])
        else:
            kr = k
    return k, kr


# Arguments a serving engine changes from call to call (batch-dependent split counts, block-table widths) are not
# specialized on: a new batch size then reuses the compiled kernel of its regime.
@triton.jit(do_not_specialize=["sbt_b", "capacity", "num_splits"])
def dense_decode_kernel(
        q_ptr, sq_b, sq_i, sq_h,
        kv_ptr, k_desc, r_desc, kv_sb, kv_sr, kv_sg, page, num_blocks,
        bt_ptr, sbt_b, capacity, lens_ptr,
        sink_ptr, out_ptr, so_b, so_i, so_h, lse_ptr, sl_b, sl_i, sl_h, po_ptr, plse_ptr,
        s_q, num_heads, group, h_kv, rb_per_head, num_splits, scale_log2,
        D_QK: tl.constexpr, CAUSAL: tl.constexpr, HAS_SINK: tl.constexpr, SPLIT: tl.constexpr, INTERPRET: tl.constexpr,
        USE_TMA: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SKIP_SCALE: tl.constexpr,
        NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    per_request = h_kv * rb_per_head
    b = (pid // per_request).to(tl.int64)
    g = (pid % per_request) // rb_per_head
    r = (pid % rb_per_head) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_mask = r < s_q * group
    qi = r // group
    head = g * group + r % group

    q_row = q_ptr + b * sq_b + qi[:, None] * sq_i + head[:, None] * sq_h
    q = tl.load(q_row + tl.arange(0, 512)[None, :], mask=row_mask[:, None], other=0.0)
    if D_QK == 576:
        qr = tl.load(q_row + 512 + tl.arange(0, 64)[None, :], mask=row_mask[:, None], other=0.0)
    else:
        qr = q

    length = tl.minimum(tl.load(lens_ptr + b), capacity)  # a block-table row is never read past its end
    n_blocks = tl.cdiv(length, BLOCK_N)
    per_split = tl.cdiv(n_blocks, num_splits)
    j0 = split * per_split
    j1 = tl.minimum(j0 + per_split, n_blocks)
    last_key = length - s_q + qi  # causal: the last position each row may see

    m_run = tl.full((BLOCK_H,), NEG, tl.float32)
    m_use = tl.full((BLOCK_H,), NEG, tl.float32)
    l = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, 512), tl.float32)
    # Blocks below n_clean hold only keys inside the sequence that every row may see: no masks at all.
    if CAUSAL:
        n_clean = tl.maximum(length - s_q + 1, 0) // BLOCK_N
    else:
        n_clean = length // BLOCK_N
    bt_row_ptr = bt_ptr + b * sbt_b
    for j in tl.range(j0, tl.minimum(j1, n_clean), num_stages=NUM_STAGES):
        k, kr = _clean_tile(kv_ptr, k_desc, r_desc, bt_row_ptr, j, page, num_blocks, kv_sb, kv_sr, kv_sg, g,
                            BLOCK_N, D_QK, USE_TMA)
        m_run, m_use, l, acc = attend_block(q, qr, k, kr, row_mask[:, None], scale_log2, m_run, m_use, l, acc,
                                            D_QK == 576, SKIP_SCALE, INTERPRET, False)
    # The tail: the last partial block and, with a causal mask, blocks some rows may not see.
    for j in tl.range(tl.maximum(j0, n_clean), j1):
        pos = j * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = pos < length
        blk = tl.load(bt_row_ptr + pos // page, mask=valid, other=0)
        valid &= (blk >= 0) & (blk < num_blocks)  # a corrupt block table is skipped, never read
        row = tl.where(valid, blk, 0).to(tl.int64) * kv_sb + (pos % page) * kv_sr + g * kv_sg
        k = load_latent(kv_ptr, row, row, valid, FMT_BF16, q.dtype, False)
        if D_QK == 576:
            kr = load_latent_rope(kv_ptr, row, valid, FMT_BF16)
        else:
            kr = k
        mask = valid[None, :]
        if CAUSAL:
            mask = mask & (pos[None, :] <= last_key[:, None])
        m_run, m_use, l, acc = attend_block(q, qr, k, kr, mask, scale_log2, m_run, m_use, l, acc, D_QK == 576,
                                            SKIP_SCALE, INTERPRET)

    if SPLIT:
        prow = ((b * s_q + qi) * num_splits + split) * num_heads + head
        store_partial(po_ptr, prow * 512, plse_ptr, prow, row_mask, m_use, l, acc)
    else:
        store_result(out_ptr, b * so_b + qi * so_i + head * so_h, lse_ptr, b * sl_b + qi * sl_i + head * sl_h,
                     lse_ptr, 0, row_mask, sink_ptr, head, m_run, m_use, l, acc, HAS_SINK, False)
