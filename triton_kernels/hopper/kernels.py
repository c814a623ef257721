"""The Hopper (sm_90) kernels, in Gluon: dense decoding over a paged bf16/fp16 cache, sparse prefill and
sparse decoding over V3.2, V4.1 and MODEL1 quantized caches (``dequant.py``; ``few_heads.py`` for at most 32
heads a token).

Each entry point maps its program to 64 query rows and a key range, stages the queries in shared memory and
forks into the partitions of ``partitions.py``. Why these kernels exist next to the portable ones, what was
measured: ``../dense_decode/NOTES.md`` and ``../sparse_mla/NOTES.md``.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..common import FMT_BF16
from .dequant import DEQUANT_REGS, OUTPUT_REGS, dequant_partition, softmax_output_partition
from .few_heads import allocate_few_heads, attend_partition, fill_even, fill_odd, fill_warps, wide_loads, worker_regs
from .partitions import (BLOCK_H, FILL_BY_WORKER, FILL_GATHER, FILL_PAGES, REGS, VECTOR_LAYOUT, allocate,
                         load_queries, output_hi, output_lo, softmax_partition)


# Arguments a serving engine changes from call to call (batch-dependent split counts, block-table widths) are not
# specialized on: a new batch size then reuses the compiled kernel of its regime.
@gluon.jit(do_not_specialize=["sbt_b", "capacity", "num_splits"])
def dense_decode_hopper_kernel(
        q_ptr, sq_b, sq_i, sq_h, k_desc, r_desc, page, num_blocks,
        bt_ptr, sbt_b, capacity, lens_ptr, sink_ptr,
        out_ptr, so_b, so_i, so_h, lse_ptr, sl_b, sl_i, sl_h, po_ptr, plse_ptr,
        s_q, num_heads, rb_per_head, num_splits, scale_log2,
        D_QK: gl.constexpr, CAUSAL: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr,
        NUM_STAGES: gl.constexpr):
    """Program ``(request * row_blocks + row_block, split)``: 64 packed rows (row r: query ``r // h_q``, head
    ``r % h_q``; one kv head) over one split's key blocks of whole pages, fetched by TMA."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    pid = gl.program_id(0)
    split = gl.program_id(1)
    b = pid // rb_per_head
    r0 = (pid % rb_per_head) * BLOCK_H
    group = num_heads  # h_kv = 1
    q_rows = s_q * group

    length = gl.minimum(gl.load(lens_ptr + b), capacity)  # a block-table row never read past its end
    n_blocks = gl.cdiv(length, BLOCK_N)
    per_split = gl.cdiv(n_blocks, num_splits)
    j0 = split * per_split
    j1 = gl.minimum(j0 + per_split, n_blocks)

    k_layout: gl.constexpr = k_desc.layout
    if D_QK == 576:
        r_layout: gl.constexpr = r_desc.layout
        q_smem, qr_smem, bufs, bars = allocate(k_desc.dtype, BLOCK_N, D_QK, NUM_STAGES, k_layout, r_layout, False, 2)
    else:  # no rope tiles
        q_smem, qr_smem, bufs, bars = allocate(k_desc.dtype, BLOCK_N, D_QK, NUM_STAGES, k_layout, k_layout, False, 2)
    rows = r0 + gl.arange(0, BLOCK_H, layout=VECTOR_LAYOUT)
    load_queries(q_ptr, b.to(gl.int64) * sq_b + (rows // group) * sq_i + (rows % group) * sq_h, rows < q_rows,
                 q_smem, qr_smem, D_QK)

    out_args = (q_rows, out_ptr, so_b, so_i, so_h, lse_ptr, sl_b, sl_i, sl_h, po_ptr, plse_ptr, sink_ptr,
                b, r0, s_q, group, num_heads, num_splits, split)
    sched = (k_desc, r_desc, q_ptr, 0, 0, q_smem, bt_ptr + b.to(gl.int64) * sbt_b, page, num_blocks, j0, j1, length)
    # (constexpr arguments are spelled out in each tuple: a tuple kept in a variable turns them into tensors)
    gl.warp_specialize([
        (softmax_partition, (q_smem, qr_smem, bufs, bars, sched, r0, s_q, group, scale_log2, D_QK, CAUSAL,
                             NUM_STAGES, False)),
        (output_lo, (bufs, bars, sched, out_args, D_QK, NUM_STAGES, FILL_PAGES, SPLIT, HAS_SINK)),
        (output_hi, (bufs, bars, sched, out_args, D_QK, NUM_STAGES, FILL_PAGES, SPLIT, HAS_SINK)),
    ], [4, 4], [REGS, REGS])


# s_kv only bounds the indices: a new number of kv rows reuses the compiled kernel.
@gluon.jit(do_not_specialize=["s_kv"])
def sparse_prefill_hopper_kernel(
        q_ptr, sq_t, sq_h, kv_ptr, skv_r, s_kv, idx_ptr, si_t, topk, len_ptr, len_div, sink_ptr,
        out_ptr, so_t, so_h, lse_ptr, max_ptr, h_q, hb_per_token, scale_log2,
        D_QK: gl.constexpr, HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, BLOCK_N: gl.constexpr,
        NUM_STAGES: gl.constexpr, K_LAYOUT: gl.constexpr, R_LAYOUT: gl.constexpr, HEADS: gl.constexpr):
    """Program ``token * head_blocks + head_block``: HEADS heads of one token (one kv head) over the token's
    ``topk`` gathered rows; blocks past ``topk_length[token // len_div]`` are never visited (``len_div`` 1 for
    prefill, ``s_q`` for bf16 sparse decoding's tokens, whose lengths are per request). 64 heads: NUM_STAGES key
    stages that the output warpgroups refill; 8, 16 or 32: the few-head form of ``few_heads.py`` (two stages, each
    refilled by a gathering warpgroup of its own)."""
    pid = gl.program_id(0)
    t = pid // hb_per_token
    r0 = (pid % hb_per_token) * HEADS
    length = topk
    if HAS_LEN:
        length = gl.maximum(gl.minimum(topk, gl.load(len_ptr + t // len_div)), 0)
    heads = r0 + gl.arange(0, HEADS, layout=VECTOR_LAYOUT)
    q_at = t.to(gl.int64) * sq_t + heads * sq_h
    idx_row_ptr = idx_ptr + t.to(gl.int64) * si_t
    out_args = (h_q, out_ptr, so_t, so_h, lse_ptr, max_ptr, sink_ptr, t, r0)
    if HEADS == 64:
        q_smem, qr_smem, bufs, bars = allocate(q_ptr.dtype.element_ty, BLOCK_N, D_QK, NUM_STAGES, K_LAYOUT,
                                               R_LAYOUT, True, 2)
        idx_smem = gl.allocate_shared_memory(gl.int32, [NUM_STAGES, BLOCK_N],
                                             gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        load_queries(q_ptr, q_at, heads < h_q, q_smem, qr_smem, D_QK)
        sched = (0, 0, kv_ptr, skv_r, s_kv, idx_smem, idx_row_ptr, 0, 0, 0, gl.cdiv(length, BLOCK_N), length)
        gl.warp_specialize([
            (softmax_partition, (q_smem, qr_smem, bufs, bars, sched, r0, 1, h_q, scale_log2, D_QK, False,
                                 NUM_STAGES, True)),
            (output_lo, (bufs, bars, sched, out_args, D_QK, NUM_STAGES, FILL_GATHER, False, HAS_SINK)),
            (output_hi, (bufs, bars, sched, out_args, D_QK, NUM_STAGES, FILL_GATHER, False, HAS_SINK)),
        ], [4, 4], [REGS, REGS])
    else:
        q_smem, qr_smem, k_smem, kr_smem, p_smem, ready, empty = allocate_few_heads(
            q_ptr.dtype.element_ty, HEADS, BLOCK_N, D_QK, K_LAYOUT, R_LAYOUT)
        load_queries(q_ptr, q_at, heads < h_q, q_smem, qr_smem, D_QK)
        rows = (kv_ptr, 0, skv_r, 1, s_kv, idx_row_ptr, length, 0, gl.cdiv(length, BLOCK_N))
        gl.warp_specialize([
            (attend_partition, (q_smem, qr_smem, k_smem, kr_smem, p_smem, ready, empty, rows, rows, scale_log2,
                                out_args, D_QK, False, False, HAS_SINK, True)),
            (fill_even, (k_smem, kr_smem, ready, empty, rows, rows, 0, 0, False, False)),
            (fill_odd, (k_smem, kr_smem, ready, empty, rows, rows, 0, 0, False, False)),
        ], [4, 4], [worker_regs(HEADS, FMT_BF16), worker_regs(HEADS, FMT_BF16)])


@gluon.jit
def _decode_sources(kv_ptr, kv_sb, kv_sr, page, n_rows, idx_ptr, si_t, topk, len_ptr,
                    x_kv_ptr, x_sb, x_sr, x_page, x_rows, x_idx_ptr, sxi_t, x_topk, x_len_ptr, len_div, t, split,
                    num_splits, BLOCK_N: gl.constexpr, HAS_X: gl.constexpr, HAS_LEN: gl.constexpr,
                    HAS_X_LEN: gl.constexpr):
    """A decoding program's sources ``(main, extra)``, each ``(kv_ptr, stride_block, stride_row, page, n_rows,
    idx_row_ptr, end, j0, j1)``: the token's key blocks of split ``split``, main cache's first, then the extra
    cache's; positions past ``topk_length[t // len_div]`` (and the extra one) are never visited. Also the
    split's first block and its end, in the program's numbering."""
    n_main = topk
    if HAS_LEN:
        n_main = gl.maximum(gl.minimum(topk, gl.load(len_ptr + t // len_div)), 0)
    nb_main = gl.cdiv(n_main, BLOCK_N)
    n_x = 0
    if HAS_X_LEN:
        n_x = gl.maximum(gl.minimum(x_topk, gl.load(x_len_ptr + t // len_div)), 0)
    elif HAS_X:
        n_x = x_topk
    total = nb_main + gl.cdiv(n_x, BLOCK_N)
    per_split = gl.cdiv(total, num_splits)
    b0 = split * per_split
    b1 = gl.minimum(b0 + per_split, total)
    t64 = t.to(gl.int64)
    m1 = gl.minimum(b1, nb_main)
    main = (kv_ptr, kv_sb, kv_sr, page, n_rows, idx_ptr + t64 * si_t, gl.minimum(n_main, m1 * BLOCK_N), b0, m1)
    x0 = gl.maximum(b0, nb_main) - nb_main
    x1 = b1 - nb_main
    extra = (x_kv_ptr, x_sb, x_sr, x_page, x_rows, x_idx_ptr + t64 * sxi_t, gl.minimum(n_x, x1 * BLOCK_N), x0, x1)
    return main, extra, b0, b1


@gluon.jit(do_not_specialize=["num_splits"])
def sparse_decode_hopper_kernel(
        q_ptr, sq_t, sq_h, kv_ptr, kv_sb, kv_sr, page, n_rows, idx_ptr, si_t, topk, len_ptr,
        x_kv_ptr, x_sb, x_sr, x_page, x_rows, x_idx_ptr, sxi_t, x_topk, x_len_ptr, len_div, sink_ptr,
        out_ptr, so_t, so_h, lse_ptr, sl_t, po_ptr, plse_ptr, h_q, hb_per_token, num_splits, scale_log2,
        D_QK: gl.constexpr, FMT: gl.constexpr, X_FMT: gl.constexpr, HAS_X: gl.constexpr, HAS_LEN: gl.constexpr,
        HAS_X_LEN: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr, BLOCK_N: gl.constexpr,
        K_LAYOUT: gl.constexpr, R_LAYOUT: gl.constexpr, HEADS: gl.constexpr):
    """Program ``(token * head_blocks + head_block, split)``: HEADS heads of one decoding token over one split's
    key blocks (``_decode_sources``): the token's ``topk`` slots in the quantized cache ``kv_ptr`` (bytes),
    then its ``x_topk`` slots in the extra cache. Writes out and lse, or the split's partial. 64 heads: the
    dequantizing softmax warpgroup of ``dequant.py``; 8, 16 or 32: the few-head form of ``few_heads.py``."""
    pid = gl.program_id(0)
    split = gl.program_id(1)
    t = pid // hb_per_token
    r0 = (pid % hb_per_token) * HEADS
    main, extra, b0, b1 = _decode_sources(kv_ptr, kv_sb, kv_sr, page, n_rows, idx_ptr, si_t, topk, len_ptr,
                                          x_kv_ptr, x_sb, x_sr, x_page, x_rows, x_idx_ptr, sxi_t, x_topk, x_len_ptr,
                                          len_div, t, split, num_splits, BLOCK_N, HAS_X, HAS_LEN, HAS_X_LEN)
    heads = r0 + gl.arange(0, HEADS, layout=VECTOR_LAYOUT)
    q_at = t.to(gl.int64) * sq_t + heads * sq_h
    # The dense epilogue's arguments with one query a program (rows = heads): out [tokens, h_q, 512], lse
    # [tokens, h_q], partials [tokens, splits, h_q, ...]. (Spelled out: a jit function cannot return the
    # pointers that are None.)
    out_args = (h_q, out_ptr, so_t, 0, so_h, lse_ptr, sl_t, 0, 1, po_ptr, plse_ptr, sink_ptr,
                t, r0, 1, h_q, h_q, num_splits, split)
    if HEADS == 64:
        q_smem, qr_smem, bufs, bars = allocate(q_ptr.dtype.element_ty, BLOCK_N, D_QK, 2, K_LAYOUT, R_LAYOUT, False, 1)
        load_queries(q_ptr, q_at, heads < h_q, q_smem, qr_smem, D_QK)
        sched = (0, 0, 0, 0, 0, 0, 0, 0, 0, b0, b1, 0)  # the output partitions read the block range only
        gl.warp_specialize([
            (softmax_output_partition, (q_smem, qr_smem, bufs, bars, main, extra, scale_log2, out_args, D_QK,
                                        HAS_X, SPLIT, HAS_SINK)),
            (output_hi, (bufs, bars, sched, out_args, D_QK, 2, FILL_BY_WORKER, SPLIT, HAS_SINK)),
            (dequant_partition, (bufs, bars, main, extra, FMT, X_FMT, HAS_X)),
        ], [4, 4], [OUTPUT_REGS, DEQUANT_REGS])
    else:
        q_smem, qr_smem, k_smem, kr_smem, p_smem, ready, empty = allocate_few_heads(
            q_ptr.dtype.element_ty, HEADS, BLOCK_N, D_QK, K_LAYOUT, R_LAYOUT)
        load_queries(q_ptr, q_at, heads < h_q, q_smem, qr_smem, D_QK)
        gl.warp_specialize([
            (attend_partition, (q_smem, qr_smem, k_smem, kr_smem, p_smem, ready, empty, main, extra, scale_log2,
                                out_args, D_QK, HAS_X, SPLIT, HAS_SINK, False)),
            (fill_even, (k_smem, kr_smem, ready, empty, main, extra, FMT, X_FMT, HAS_X, wide_loads(HEADS))),
            (fill_odd, (k_smem, kr_smem, ready, empty, main, extra, FMT, X_FMT, HAS_X, wide_loads(HEADS))),
        ], [fill_warps(HEADS, FMT), fill_warps(HEADS, FMT)], [worker_regs(HEADS, FMT), worker_regs(HEADS, FMT)])
