"""Dense MLA decoding (``flash_mla_with_kvcache`` without indices) over a paged bf16/fp16 cache of one kv head on
``mma.sync`` (``mma_v2``), in Gluon.

Program ``(request * row_blocks + row_block, split)``: 64 of the request's ``s_q x h_q`` query rows (query-major,
row ``i * h_q + h``, as the Hopper dense kernel packs them), 8 warps, over one split's blocks of BLOCK_N of the
request's keys. Each block's rows are copied by 16-byte ``cp.async`` from the pages the block table names into
one of NUM_STAGES stages, the next block's copies in flight while this one is attended (``mma.attend_blocks``,
as the prefill kernel gathers its rows). A causal call masks each row's keys past its query's position: query
``i`` sees keys ``j <= s_k - s_q + i``; a program attends keys up to its last row's. Epilogue: the Hopper dense
kernel's (``hopper.partitions._store_output``), direct or as split partials.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..hopper.partitions import _store_output
from .mma import BLOCK_H, ROWS, allocate_stages, attend_blocks, mma_layout, stage_rows


@gluon.jit
def _paged_rows(src, j, BLOCK_N: gl.constexpr, LAYOUT: gl.constexpr):
    """Block ``j``'s keys as element offsets into the cache (page ``key // page`` of the request's block table,
    row ``key % page``), and which to read (keys past the program's last one: none)."""
    bt_row_ptr, PAGE, kv_sb, kv_sr, n_keys, _ = src
    keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=LAYOUT)
    ok = keys < n_keys
    blk = gl.load(bt_row_ptr + keys // PAGE, mask=ok, other=0)
    return blk.to(gl.int64) * kv_sb + (keys % PAGE).to(gl.int64) * kv_sr, ok


@gluon.jit
def _seen_mask(src, j, BLOCK_N: gl.constexpr):
    """``[64, BLOCK_N]`` in S's layout: key ``j * BLOCK_N + c`` below row r's count of seen keys (computed
    here each block: carried across the loop, the rows' counts cost sm_80's tile a spill)."""
    r0, h_q, s_q, seqlen, CAUSAL = src[5]
    seen = _seen(r0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, mma_layout(BLOCK_N))), h_q, s_q, seqlen, CAUSAL)
    keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout(BLOCK_N)))
    return gl.expand_dims(keys, 0) < gl.expand_dims(seen, 1)


@gluon.jit
def _seen(rows, h_q, s_q, seqlen, CAUSAL: gl.constexpr):
    """Keys packed row ``rows`` (query ``rows // h_q``) sees: all ``seqlen``, or causally up to its position."""
    if CAUSAL:
        return gl.minimum(gl.maximum(seqlen - s_q + 1 + rows // h_q, 0), seqlen)
    return rows * 0 + seqlen


@gluon.jit(do_not_specialize=["num_splits"])
def dense_decode_mma_v2_kernel(
        q_ptr, sq_b, sq_i, sq_h, kv_ptr, kv_sb, kv_sr, bt_ptr, s_bt, lens_ptr, sink_ptr,
        out_ptr, so_b, so_i, so_h, lse_ptr, sl_b, sl_i, sl_h, po_ptr, plse_ptr,
        s_q, h_q, rb_per_request, num_splits, scale_log2,
        PAGE: gl.constexpr, D_QK: gl.constexpr, CAUSAL: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr,
        BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, K_STEP: gl.constexpr):
    """q [b, s_q, h_q, d_qk]; the cache's elements ``kv_ptr`` (page stride ``kv_sb``, row stride ``kv_sr``, PAGE
    rows a page: a constant, so a key's page and row are shifts where it is a power of two);
    block table [b, max_blocks] (row stride ``s_bt``), cache_seqlens [b]. Writes out [b, s_q, h_q, 512] and lse
    (natural log) at the given strides, or with SPLIT the partials ``splits.Workspaces`` holds."""
    pid = gl.program_id(0)
    b = pid // rb_per_request
    r0 = (pid % rb_per_request) * BLOCK_H
    split = gl.program_id(1)
    q_rows = s_q * h_q
    seqlen = gl.load(lens_ptr + b)
    n_keys = _seen(gl.minimum(r0 + BLOCK_H, q_rows) - 1, h_q, s_q, seqlen, CAUSAL)  # the last row's
    n_blocks = gl.cdiv(n_keys, BLOCK_N)
    per_split = gl.cdiv(n_blocks, num_splits)
    j0 = split * per_split
    j1 = gl.minimum(j0 + per_split, n_blocks)

    dtype: gl.constexpr = q_ptr.dtype.element_ty
    rows = r0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ROWS))
    q_at = b.to(gl.int64) * sq_b + (rows // h_q) * sq_i + (rows % h_q) * sq_h
    q_smem, qr_smem = stage_rows(q_ptr, q_at, rows < q_rows, D_QK)
    k_smem, kr_smem, p_smem = allocate_stages(dtype, NUM_STAGES, BLOCK_N, D_QK)

    src = (bt_ptr + b.to(gl.int64) * s_bt, PAGE, kv_sb, kv_sr, n_keys, (r0, h_q, s_q, seqlen, CAUSAL))
    m_run, m_use, l, acc = attend_blocks(q_smem, qr_smem, k_smem, kr_smem, p_smem, j0, j1, kv_ptr, src,
                                         scale_log2, _paged_rows, _seen_mask, D_QK, K_STEP)
    out_args = (q_rows, out_ptr, so_b, so_i, so_h, lse_ptr, sl_b, sl_i, sl_h, po_ptr, plse_ptr, sink_ptr,
                b, r0, s_q, h_q, h_q, num_splits, split)
    _store_output(acc, l, m_use, m_run, out_args, False, SPLIT, HAS_SINK, 0)
