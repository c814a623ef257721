"""Sparse prefill (``flash_mla_sparse_fwd``, bf16/fp16) on ``mma.sync`` (``mma_v2``), in Gluon.

Program ``token * head_blocks + head_block``: 64 query heads of one token, 8 warps, over the token's gathered
kv rows in blocks of BLOCK_N keys. The queries are copied into shared memory once; each key block's rows
(index -1 or past ``s_kv``: zero-filled, never read) are gathered by 16-byte ``cp.async`` into one of
NUM_STAGES stages, the next block's gather in flight while this block is multiplied. The block's attention
and the layouts are ``mma.py``'s (shared with the decoding kernel, ``decode.py``).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from ..hopper.partitions import _store_output, block_indices
from .mma import allocate_stages, attend_blocks, key_mask, program_token, stage_queries


@gluon.jit
def _index_rows(src, j, BLOCK_N: gl.constexpr, LAYOUT: gl.constexpr):
    """Block ``j``'s kv rows as element offsets, and which to read (index -1, past ``s_kv`` or the length: none)."""
    idx_row_ptr, length, s_kv, skv_r = src
    idx = block_indices(idx_row_ptr, j, length, s_kv, BLOCK_N, LAYOUT)
    return gl.maximum(idx, 0).to(gl.int64) * skv_r, idx >= 0


@gluon.jit
def _index_mask(src, j, BLOCK_N: gl.constexpr):
    idx_row_ptr, length, s_kv, _ = src
    return key_mask(idx_row_ptr, j, length, s_kv, BLOCK_N)


# s_kv only bounds the indices: a new number of kv rows reuses the compiled kernel.
@gluon.jit(do_not_specialize=["s_kv"])
def sparse_prefill_mma_v2_kernel(
        q_ptr, sq_t, sq_h, kv_ptr, skv_r, s_kv, idx_ptr, si_t, topk, len_ptr, sink_ptr,
        out_ptr, so_t, so_h, lse_ptr, max_ptr, h_q, hb_per_token, scale_log2,
        D_QK: gl.constexpr, HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, BLOCK_N: gl.constexpr,
        NUM_STAGES: gl.constexpr, K_STEP: gl.constexpr):
    """Writes out [s_q, h_q, 512], lse and max_logits [s_q, h_q] (natural log) as ``common.store_result``."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    t, r0, length = program_token(hb_per_token, topk, len_ptr, 1, HAS_LEN)
    n_blocks = gl.cdiv(length, BLOCK_N)
    idx_row_ptr = idx_ptr + t.to(gl.int64) * si_t

    # (q first: the kernel's shared memory in the order the launch's shared_bytes counts it)
    q_smem, qr_smem = stage_queries(q_ptr, t, sq_t, sq_h, r0, h_q, D_QK)  # its group: the last wait covers it
    k_smem, kr_smem, p_smem = allocate_stages(dtype, NUM_STAGES, BLOCK_N, D_QK)
    src = (idx_row_ptr, length, s_kv, skv_r)
    m_run, m_use, l, acc = attend_blocks(q_smem, qr_smem, k_smem, kr_smem, p_smem, 0, n_blocks, kv_ptr, src,
                                         scale_log2, _index_rows, _index_mask, D_QK, K_STEP)
    out_args = (h_q, out_ptr, so_t, so_h, lse_ptr, max_ptr, sink_ptr, t, r0)
    _store_output(acc, l, m_use, m_run, out_args, True, False, HAS_SINK, 0)
