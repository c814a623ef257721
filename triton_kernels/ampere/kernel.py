"""Sparse prefill (``flash_mla_sparse_fwd``, bf16/fp16) on ``mma.sync`` (``mma_v2``), in Gluon.

Program ``token * head_blocks + head_block``: 64 query heads of one token, 8 warps, over the token's gathered
kv rows in blocks of BLOCK_N keys. The queries are copied into shared memory once; each key block's rows
(index -1 or past ``s_kv``: zero-filled, never read) are gathered by 16-byte ``cp.async`` into one of
NUM_STAGES stages, the next block's gather in flight while this block is multiplied.

Why hand-chosen layouts (``NOTES.md``): Triton gives both products ``warpsPerCTA = [1, 8]``, so every warp
reads all of q each block. Here both products share one mma layout, warps ``[2, 4]``: a warp owns 32 heads,
BLOCK_N / 4 keys of S and 128 columns of O, so q is read 4 times a block, not 8, and the row statistics of S
and O lie in the same registers (the rescale needs no layout change). S is two accumulators (d split in halves,
summed at the end): twice the independent ``HMMA`` chains a warp.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from ..hopper.partitions import NEG, RESCALE_THRESHOLD_LOG2, _store_output, block_indices, exp2_approx

BLOCK_H = gl.constexpr(64)  # the layouts below are written for 8 warps (launch: num_warps=8)
# 16-byte pieces (8 columns a thread) for the copies: a warp covers one row of 256 columns (latent tiles) or
# 4 rows of 64 (rope tiles, and the queries 64 columns at a time).
WIDE_ROWS = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0]))
ROWS = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0]))
# Triton 3.7 renamed the CTA barrier.
_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier


@gluon.constexpr_function
def mma_layout(block_n):
    """S [64, BLOCK_N] and O [64, 512]: 2 x 4 warps. BLOCK_N 16 leaves too few keys for 4 warp columns of 8-key
    mma tiles: S then takes 4 x 2 warps (its row statistics are converted to O's rows)."""
    cols = min(4, block_n // 8)
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[8 // cols, cols], instr_shape=[16, 8])


@gluon.constexpr_function
def o_layout():
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[2, 4], instr_shape=[16, 8])


@gluon.constexpr_function
def operand_smem(cols):
    """Swizzled rows of ``cols`` 16-bit values: the 16-byte pieces that one ``ldmatrix`` reads from 8 rows lie
    in 8 different bank groups (XOR of the piece index with the row's phase)."""
    row_bytes = 2 * cols
    return gl.SwizzledSharedLayout(8, max(1, 128 // row_bytes), min(8, row_bytes // 16), [1, 0])


@gluon.jit
def _copy_rows(dst, src_ptr, row_at, ok, col0, LAYOUT: gl.constexpr):
    """``cp.async`` columns ``[col0, col0 + width)`` of the rows at element offsets ``row_at`` into ``dst``
    [rows, width]; rows with ``ok`` false are zero-filled and not read."""
    cols = col0 + gl.arange(0, dst.shape[1], layout=gl.SliceLayout(0, LAYOUT))
    mask = gl.expand_dims(ok, 1) & gl.expand_dims(cols >= 0, 0)
    async_copy.async_copy_global_to_shared(dst, src_ptr + gl.expand_dims(row_at, 1) + gl.expand_dims(cols, 0),
                                           mask=mask)


@gluon.jit
def _gather_block(k_smem, kr_smem, stage, j, kv_ptr, skv_r, s_kv, idx_row_ptr, length, D_QK: gl.constexpr):
    """Start the copies of key block ``j``'s rows into ``stage`` (their own commit group is the caller's)."""
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    idx = block_indices(idx_row_ptr, j, length, s_kv, BLOCK_N, gl.SliceLayout(1, WIDE_ROWS))
    _copy_rows(k_smem.index(stage), kv_ptr, gl.maximum(idx, 0).to(gl.int64) * skv_r, idx >= 0, 0, WIDE_ROWS)
    if D_QK == 576:
        idx = block_indices(idx_row_ptr, j, length, s_kv, BLOCK_N, gl.SliceLayout(1, ROWS))
        _copy_rows(kr_smem.index(stage), kv_ptr, gl.maximum(idx, 0).to(gl.int64) * skv_r, idx >= 0, 512, ROWS)


@gluon.jit
def _qk_half(q_smem, k_tile, c0, n_steps: gl.constexpr, s, K_STEP: gl.constexpr):
    """``s += q[:, c0 : c0 + n_steps * K_STEP] · k_tile[:, same]ᵀ``, operands read from shared memory a k-step
    at a time (``ldmatrix``)."""
    a_l: gl.constexpr = gl.DotOperandLayout(0, s.type.layout, 2)
    b_l: gl.constexpr = gl.DotOperandLayout(1, s.type.layout, 2)
    for c in gl.static_range(n_steps):
        a = q_smem.slice(c0 + c * K_STEP, K_STEP, dim=1).load(a_l)
        b = k_tile.slice(c0 + c * K_STEP, K_STEP, dim=1).permute((1, 0)).load(b_l)
        s = mma_v2(a, b, s)
    return s


# s_kv only bounds the indices: a new number of kv rows reuses the compiled kernel.
@gluon.jit(do_not_specialize=["s_kv"])
def sparse_prefill_mma_v2_kernel(
        q_ptr, sq_t, sq_h, kv_ptr, skv_r, s_kv, idx_ptr, si_t, topk, len_ptr, sink_ptr,
        out_ptr, so_t, so_h, lse_ptr, max_ptr, h_q, hb_per_token, scale_log2,
        D_QK: gl.constexpr, HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, BLOCK_N: gl.constexpr,
        NUM_STAGES: gl.constexpr, K_STEP: gl.constexpr):
    """Writes out [s_q, h_q, 512], lse and max_logits [s_q, h_q] (natural log) as ``common.store_result``."""
    gl.static_assert((K_STEP == 16) or (K_STEP == 32), "K_STEP: 16 or 32 (a rope half is 32 columns)")
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    pid = gl.program_id(0)
    t = pid // hb_per_token
    r0 = (pid % hb_per_token) * BLOCK_H
    length = topk
    if HAS_LEN:
        length = gl.maximum(gl.minimum(topk, gl.load(len_ptr + t)), 0)
    n_blocks = gl.cdiv(length, BLOCK_N)
    idx_row_ptr = idx_ptr + t.to(gl.int64) * si_t

    lat_l: gl.constexpr = operand_smem(512)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, 512], lat_l)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, 512], lat_l)
    if D_QK == 576:
        rope_l: gl.constexpr = operand_smem(64)
        qr_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, 64], rope_l)
        kr_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, 64], rope_l)
    else:
        qr_smem = q_smem
        kr_smem = k_smem
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], operand_smem(BLOCK_N))

    heads = r0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ROWS))
    q_at = t.to(gl.int64) * sq_t + heads * sq_h
    for c in gl.static_range(D_QK // 64):
        if c < 8:
            _copy_rows(q_smem.slice(c * 64, 64, dim=1), q_ptr, q_at, heads < h_q, c * 64, ROWS)
        else:
            _copy_rows(qr_smem, q_ptr, q_at, heads < h_q, 512, ROWS)
    async_copy.commit_group()  # a group of its own: the last wait covers it even when no block is visited
    for b in gl.static_range(NUM_STAGES - 1):
        if b < n_blocks:
            _gather_block(k_smem, kr_smem, b, b, kv_ptr, skv_r, s_kv, idx_row_ptr, length, D_QK)
        async_copy.commit_group()

    s_l: gl.constexpr = mma_layout(BLOCK_N)
    acc_l: gl.constexpr = o_layout()
    row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
    m_run = gl.full([BLOCK_H], NEG, gl.float32, row_l)
    m_use = gl.full([BLOCK_H], NEG, gl.float32, row_l)
    l = gl.zeros([BLOCK_H], gl.float32, row_l)
    acc = gl.zeros([BLOCK_H, 512], gl.float32, acc_l)
    pa_l: gl.constexpr = gl.DotOperandLayout(0, acc_l, 2)
    v_l: gl.constexpr = gl.DotOperandLayout(1, acc_l, 2)
    # Each half of S: half the latent columns and half the rope tail.
    half_steps: gl.constexpr = 256 // K_STEP
    rope_steps: gl.constexpr = 32 // K_STEP if D_QK == 576 else 0
    for j in range(n_blocks):
        stage = j % NUM_STAGES
        if NUM_STAGES == 1:
            _barrier()  # every warp is done with the previous block's rows
            _gather_block(k_smem, kr_smem, 0, j, kv_ptr, skv_r, s_kv, idx_row_ptr, length, D_QK)
            async_copy.commit_group()
        # Whose columns of S are valid: asked for now, used after the product.
        valid = gl.expand_dims(block_indices(idx_row_ptr, j, length, s_kv, BLOCK_N, gl.SliceLayout(0, s_l)) >= 0, 0)
        async_copy.wait_group(max(NUM_STAGES - 2, 0))
        # Block j's rows (every thread's copies) have landed, and every warp is done with block j - 1: its
        # stage may be refilled and P's buffer rewritten.
        _barrier()
        if NUM_STAGES > 1:
            if j + NUM_STAGES - 1 < n_blocks:
                _gather_block(k_smem, kr_smem, (j + NUM_STAGES - 1) % NUM_STAGES, j + NUM_STAGES - 1, kv_ptr,
                              skv_r, s_kv, idx_row_ptr, length, D_QK)
            async_copy.commit_group()
        k_tile = k_smem.index(stage)
        s_lo = _qk_half(q_smem, k_tile, 0, half_steps, gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_l), K_STEP)
        s_hi = _qk_half(q_smem, k_tile, 256, half_steps, gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_l), K_STEP)
        if D_QK == 576:
            r_tile = kr_smem.index(stage)
            s_lo = _qk_half(qr_smem, r_tile, 0, rope_steps, s_lo, K_STEP)
            s_hi = _qk_half(qr_smem, r_tile, 32, rope_steps, s_hi, K_STEP)
        # Raw logits; the scale is folded into the exponent, as in the Hopper kernels.
        s = gl.where(valid, s_lo + s_hi, NEG)
        m_new = gl.maximum(m_run, gl.convert_layout(gl.max(s, 1), row_l) * scale_log2)
        # Skip-scale with a lagging max per row (a select): p = 2^(s - m_use) stays <= 2^threshold.
        m_next = gl.where(m_new - m_use > RESCALE_THRESHOLD_LOG2, m_new, m_use)
        alpha = exp2_approx(m_use - m_next)
        m_s = gl.expand_dims(gl.convert_layout(m_next, gl.SliceLayout(1, s_l)), 1)
        p = gl.where(valid, exp2_approx(s * scale_log2 - m_s), 0.0)
        l = l * alpha + gl.convert_layout(gl.sum(p, 1), row_l)
        m_run = m_new
        m_use = m_next
        acc = acc * gl.expand_dims(alpha, 1)
        # P crosses warps (a warp's S columns are a quarter of its P·V rows' keys): through shared memory.
        p_smem.store(p.to(dtype))
        _barrier()
        for c in gl.static_range(BLOCK_N // 16):
            a = p_smem.slice(c * 16, 16, dim=1).load(pa_l)
            v = k_tile.slice(c * 16, 16, dim=0).load(v_l)
            acc = mma_v2(a, v, acc)
    async_copy.wait_group(0)
    out_args = (h_q, out_ptr, so_t, so_h, lse_ptr, max_ptr, sink_ptr, t, r0)
    _store_output(acc, l, m_use, m_run, out_args, True, False, HAS_SINK, 0)
