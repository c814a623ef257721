"""Sparse prefill (``flash_mla_sparse_fwd``, bf16/fp16) on ``mma.sync`` (``mma_v2``), in Gluon.

Program ``token * head_blocks + head_block``: 64 query heads of one token, 8 warps, over the token's gathered
kv rows in blocks of BLOCK_N keys. The queries are copied into shared memory once; each key block's rows
(index -1 or past ``s_kv``: zero-filled, never read) are gathered by 16-byte ``cp.async`` into one of
NUM_STAGES stages, the next block's gather in flight while this block is multiplied. The block's attention
and the layouts are ``mma.py``'s (shared with the decoding kernel, ``decode.py``).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from ..hopper.partitions import _store_output, block_indices
from .mma import (BLOCK_H, ROWS, WIDE_ROWS, attend_block, barrier, copy_rows, initial_state, key_mask,
                  operand_smem, program_token, stage_queries)


@gluon.jit
def _gather_block(k_smem, kr_smem, stage, j, kv_ptr, skv_r, s_kv, idx_row_ptr, length, D_QK: gl.constexpr):
    """Start the copies of key block ``j``'s rows into ``stage`` (their own commit group is the caller's)."""
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    idx = block_indices(idx_row_ptr, j, length, s_kv, BLOCK_N, gl.SliceLayout(1, WIDE_ROWS))
    copy_rows(k_smem.index(stage), kv_ptr, gl.maximum(idx, 0).to(gl.int64) * skv_r, idx >= 0, 0, WIDE_ROWS)
    if D_QK == 576:
        idx = block_indices(idx_row_ptr, j, length, s_kv, BLOCK_N, gl.SliceLayout(1, ROWS))
        copy_rows(kr_smem.index(stage), kv_ptr, gl.maximum(idx, 0).to(gl.int64) * skv_r, idx >= 0, 512, ROWS)


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
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, 512], operand_smem(512))
    if D_QK == 576:
        kr_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, 64], operand_smem(64))
    else:
        kr_smem = k_smem
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], operand_smem(BLOCK_N))
    for b in gl.static_range(NUM_STAGES - 1):
        if b < n_blocks:
            _gather_block(k_smem, kr_smem, b, b, kv_ptr, skv_r, s_kv, idx_row_ptr, length, D_QK)
        async_copy.commit_group()

    m_run, m_use, l, acc = initial_state()
    for j in range(n_blocks):
        stage = j % NUM_STAGES
        if NUM_STAGES == 1:
            barrier()  # every warp is done with the previous block's rows
            _gather_block(k_smem, kr_smem, 0, j, kv_ptr, skv_r, s_kv, idx_row_ptr, length, D_QK)
            async_copy.commit_group()
        valid = key_mask(idx_row_ptr, j, length, s_kv, BLOCK_N)
        async_copy.wait_group(max(NUM_STAGES - 2, 0))
        # Block j's rows (every thread's copies) have landed, and every warp is done with block j - 1: its
        # stage may be refilled and P's buffer rewritten.
        barrier()
        if NUM_STAGES > 1:
            if j + NUM_STAGES - 1 < n_blocks:
                _gather_block(k_smem, kr_smem, (j + NUM_STAGES - 1) % NUM_STAGES, j + NUM_STAGES - 1, kv_ptr,
                              skv_r, s_kv, idx_row_ptr, length, D_QK)
            async_copy.commit_group()
        m_run, m_use, l, acc = attend_block(q_smem, qr_smem, k_smem.index(stage), kr_smem.index(stage), p_smem,
                                            valid, scale_log2, m_run, m_use, l, acc, D_QK, K_STEP)
    async_copy.wait_group(0)
    out_args = (h_q, out_ptr, so_t, so_h, lse_ptr, max_ptr, sink_ptr, t, r0)
    _store_output(acc, l, m_use, m_run, out_args, True, False, HAS_SINK, 0)
