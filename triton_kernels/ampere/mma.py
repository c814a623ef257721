"""What the ``mma_v2`` kernels of this folder share: their layouts, the query staging and one key block's
attention (S = q·kᵀ, the online softmax, P through shared memory, O += P·V) on 64 heads and 8 warps.

Why hand-chosen layouts (``NOTES.md``): Triton gives both products ``warpsPerCTA = [1, 8]``, so every warp
reads all of q each block. Here both products share one mma layout, warps ``[2, 4]``: a warp owns 32 heads,
BLOCK_N / 4 keys of S and 128 columns of O, so q is read 4 times a block, not 8, and the row statistics of S
and O lie in the same registers (the rescale needs no layout change). S is two accumulators (d split in halves,
summed at the end): twice the independent ``HMMA`` chains a warp. The row sums of P stay partial, each thread
summing the keys it holds (rescaled like O), and cross the warps once, at the end: a warp holds a quarter of its
rows' keys, so a sum each block would cross the 4 warp columns through shared memory every block.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from ..hopper.partitions import NEG, RESCALE_THRESHOLD_LOG2, barrier, block_indices, exp2_approx

BLOCK_H = gl.constexpr(64)  # the layouts below are written for 8 warps (launch: num_warps=8)
# 16-byte pieces (8 columns a thread) for the copies: a warp covers one row of 256 columns (latent tiles) or
# 4 rows of 64 (rope tiles, and the queries 64 columns at a time).
WIDE_ROWS = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [8, 1], [1, 0]))
ROWS = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0]))


@gluon.constexpr_function
def s_warp_cols(block_n):
    return min(4, block_n // 8)


@gluon.constexpr_function
def mma_layout(block_n):
    """S [64, BLOCK_N] and O [64, 512]: 2 x 4 warps. BLOCK_N 16 leaves too few keys for 4 warp columns of 8-key
    mma tiles: S then takes 4 x 2 warps (its row statistics are converted to O's rows)."""
    cols = s_warp_cols(block_n)
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
def copy_rows(dst, src_ptr, row_at, ok, col0, LAYOUT: gl.constexpr):
    """``cp.async`` columns ``[col0, col0 + width)`` of the rows at element offsets ``row_at`` into ``dst``
    [rows, width]; rows with ``ok`` false are zero-filled and not read."""
    cols = col0 + gl.arange(0, dst.shape[1], layout=gl.SliceLayout(0, LAYOUT))
    mask = gl.expand_dims(ok, 1) & gl.expand_dims(cols >= 0, 0)
    async_copy.async_copy_global_to_shared(dst, src_ptr + gl.expand_dims(row_at, 1) + gl.expand_dims(cols, 0),
                                           mask=mask)


@gluon.jit
def program_token(hb_per_token, topk, len_ptr, len_div, HAS_LEN: gl.constexpr):
    """``(t, r0, length)`` of program ``t * hb_per_token + head_block``: its token, first head and how many of
    the token's ``topk`` indices count (``topk_length[t // len_div]``, clamped to ``[0, topk]``)."""
    pid = gl.program_id(0)
    t = pid // hb_per_token
    length = topk
    if HAS_LEN:
        length = gl.maximum(gl.minimum(topk, gl.load(len_ptr + t // len_div)), 0)
    return t, (pid % hb_per_token) * BLOCK_H, length


@gluon.jit
def stage_queries(q_ptr, t, sq_t, sq_h, r0, h_q, D_QK: gl.constexpr):
    """``(q_smem [64, 512], qr_smem [64, 64])`` (d_qk 512: ``qr_smem`` is ``q_smem``): token ``t``'s heads
    ``[r0, r0 + 64)`` copied by ``cp.async`` in a commit group of their own (absent heads zero-filled)."""
    heads = r0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ROWS))
    return stage_rows(q_ptr, t.to(gl.int64) * sq_t + heads * sq_h, heads < h_q, D_QK)


@gluon.jit
def stage_rows(q_ptr, q_at, ok, D_QK: gl.constexpr):
    """``(q_smem [64, 512], qr_smem [64, 64])`` (d_qk 512: ``qr_smem`` is ``q_smem``): the 64 query rows at
    element offsets ``q_at`` (``SliceLayout(1, ROWS)``) copied by ``cp.async`` in a commit group of their own
    (rows with ``ok`` false zero-filled)."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, 512], operand_smem(512))
    if D_QK == 576:
        qr_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, 64], operand_smem(64))
    else:
        qr_smem = q_smem
    for c in gl.static_range(D_QK // 64):
        if c < 8:
            copy_rows(q_smem.slice(c * 64, 64, dim=1), q_ptr, q_at, ok, c * 64, ROWS)
        else:
            copy_rows(qr_smem, q_ptr, q_at, ok, 512, ROWS)
    async_copy.commit_group()
    return q_smem, qr_smem


# [64, 4] per-warp-column partials loaded so that a thread holds the four of each of its rows (register bits:
# the column, then rows 8 and 32), its rows those of O's layout (lanes: rows 1, 2, 4 past the quad; warps: row 16
# past the 4 warp columns): their maximum is then in O's rows with no exchange.
FOUR_A_ROW = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [8, 0], [32, 0]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[0, 0], [0, 0], [16, 0]], block_bases=[], shape=[64, 4]))


@gluon.jit
def _row_max(s, ONE_BARRIER: gl.constexpr):
    """The maximum over the keys of S [64, BLOCK_N] (S's layout), in O's rows. With ``ONE_BARRIER`` and 4 warp
    columns (BLOCK_N >= 32) by one barrier: each warp's maximum over its keys (S's column ``32 a + 8 w + c`` lies
    in warp column ``w``: shuffles within the quad only) into shared memory, then every thread takes the four of
    its rows (``gl.max`` over the warp columns takes three barriers). The caller's barrier before the next block
    keeps the next block's writes behind these reads."""
    BLOCK_N: gl.constexpr = s.shape[1]
    row_l: gl.constexpr = gl.SliceLayout(1, o_layout())
    if ONE_BARRIER and s_warp_cols(BLOCK_N) == 4:
        per_warp = gl.max(gl.max(gl.reshape(s, [BLOCK_H, BLOCK_N // 32, 4, 8]), 3), 1)
        partials = gl.allocate_shared_memory(gl.float32, [BLOCK_H, 4], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        partials.store(per_warp)
        barrier()
        return gl.convert_layout(gl.max(partials.load(FOUR_A_ROW), 1), row_l)
    else:
        return gl.convert_layout(gl.max(s, 1), row_l)


@gluon.jit
def _own_keys_sum(p):
    """``[64, 4 x warp columns]``: P [64, BLOCK_N] (S's layout) summed over the keys of a row that one thread
    holds: S's column ``a * width + 2 * c + e`` lies in the thread of ``c`` (``e``: the pair of columns an mma
    tile gives a thread, ``a``: the tiles' repetition). No exchange between threads."""
    BLOCK_N: gl.constexpr = p.shape[1]
    width: gl.constexpr = 8 * s_warp_cols(BLOCK_N)
    pairs = gl.sum(gl.reshape(p, [BLOCK_H, BLOCK_N // width, width // 2, 2]), 3)
    return gl.sum(pairs, 1)


@gluon.jit
def initial_state(BLOCK_N: gl.constexpr):
    """``(m_run, m_use, l_part, acc)`` before the first key block: the maxima in O's rows, ``l_part`` the
    threads' partial row sums (``row_sums`` adds them up), ``acc`` in O's layout."""
    row_l: gl.constexpr = gl.SliceLayout(1, o_layout())
    m_run = gl.full([BLOCK_H], NEG, gl.float32, row_l)
    m_use = gl.full([BLOCK_H], NEG, gl.float32, row_l)
    l_part = _own_keys_sum(gl.zeros([BLOCK_H, BLOCK_N], gl.float32, mma_layout(BLOCK_N)))
    acc = gl.zeros([BLOCK_H, 512], gl.float32, o_layout())
    return m_run, m_use, l_part, acc


@gluon.jit
def row_sums(l_part):
    """``[64]`` in O's rows: the row sums of P from the threads' partials (one exchange across the warps)."""
    return gl.convert_layout(gl.sum(l_part, 1), gl.SliceLayout(1, o_layout()))


@gluon.jit
def key_mask(idx_row_ptr, j, length, n_rows, BLOCK_N: gl.constexpr):
    """``[1, BLOCK_N]`` in S's column layout: which keys of block ``j`` to attend (``block_indices`` >= 0).
    Asked for before the block's product, so its load travels meanwhile."""
    s_cols: gl.constexpr = gl.SliceLayout(0, mma_layout(BLOCK_N))
    return gl.expand_dims(block_indices(idx_row_ptr, j, length, n_rows, BLOCK_N, s_cols) >= 0, 0)


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


@gluon.jit
def attend_block(q_smem, qr_smem, k_tile, r_tile, p_smem, valid, scale_log2, m_run, m_use, l_part, acc,
                 D_QK: gl.constexpr, K_STEP: gl.constexpr, ONE_BARRIER_MAX: gl.constexpr):
    """One key block: ``k_tile`` [BLOCK_N, 512] (K, and unchanged V) and ``r_tile`` [BLOCK_N, 64] (the rope
    tail, d_qk 576), in shared memory and visible to every warp; ``valid`` [1, BLOCK_N] (S's column layout)
    marks the keys to attend; ``ONE_BARRIER_MAX``: S's row maximum by ``_row_max``'s one barrier (faster where
    the kernel has registers to spare: prefill, not V3.2 decoding, NOTES.md run 133). Returns the new ``(m_run,
    m_use, l_part, acc)``. P goes through ``p_smem``: the caller keeps it (and the tiles) unwritten until every
    warp is past this block."""
    gl.static_assert((K_STEP == 16) or (K_STEP == 32), "K_STEP: 16 or 32 (a rope half is 32 columns)")
    BLOCK_N: gl.constexpr = k_tile.shape[0]
    dtype: gl.constexpr = k_tile.dtype
    s_l: gl.constexpr = mma_layout(BLOCK_N)
    acc_l: gl.constexpr = o_layout()
    row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
    # Each half of S: half the latent columns and half the rope tail.
    half_steps: gl.constexpr = 256 // K_STEP
    s_lo = _qk_half(q_smem, k_tile, 0, half_steps, gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_l), K_STEP)
    s_hi = _qk_half(q_smem, k_tile, 256, half_steps, gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_l), K_STEP)
    if D_QK == 576:
        s_lo = _qk_half(qr_smem, r_tile, 0, 32 // K_STEP, s_lo, K_STEP)
        s_hi = _qk_half(qr_smem, r_tile, 32, 32 // K_STEP, s_hi, K_STEP)
    # Raw logits; the scale is folded into the exponent, as in the Hopper kernels.
    s = gl.where(valid, s_lo + s_hi, NEG)
    m_new = gl.maximum(m_run, _row_max(s, ONE_BARRIER_MAX) * scale_log2)
    # Skip-scale with a lagging max per row (a select): p = 2^(s - m_use) stays <= 2^threshold.
    m_next = gl.where(m_new - m_use > RESCALE_THRESHOLD_LOG2, m_new, m_use)
    alpha = exp2_approx(m_use - m_next)
    m_s = gl.expand_dims(gl.convert_layout(m_next, gl.SliceLayout(1, s_l)), 1)
    p = gl.where(valid, exp2_approx(s * scale_log2 - m_s), 0.0)
    part_rows: gl.constexpr = gl.SliceLayout(1, l_part.type.layout)
    l_part = l_part * gl.expand_dims(gl.convert_layout(alpha, part_rows), 1) + _own_keys_sum(p)
    acc = acc * gl.expand_dims(alpha, 1)
    # P crosses warps (a warp's S columns are a quarter of its P·V rows' keys): through shared memory.
    p_smem.store(p.to(dtype))
    barrier()
    pa_l: gl.constexpr = gl.DotOperandLayout(0, acc_l, 2)
    v_l: gl.constexpr = gl.DotOperandLayout(1, acc_l, 2)
    for c in gl.static_range(BLOCK_N // 16):
        a = p_smem.slice(c * 16, 16, dim=1).load(pa_l)
        v = k_tile.slice(c * 16, 16, dim=0).load(v_l)
        acc = mma_v2(a, v, acc)
    return m_new, m_next, l_part, acc


@gluon.jit
def allocate_stages(dtype: gl.constexpr, NUM_STAGES: gl.constexpr, BLOCK_N: gl.constexpr, D_QK: gl.constexpr):
    """``(k_smem [NUM_STAGES, BLOCK_N, 512], kr_smem [NUM_STAGES, BLOCK_N, 64], p_smem [64, BLOCK_N])``: the key
    stages (latent, and the rope tails at d_qk 576; at 512 ``kr_smem`` is ``k_smem``) and P's buffer, allocated
    after the queries (the order the launches' ``shared_bytes`` counts)."""
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, 512], operand_smem(512))
    if D_QK == 576:
        kr_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, 64], operand_smem(64))
    else:
        kr_smem = k_smem
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], operand_smem(BLOCK_N))
    return k_smem, kr_smem, p_smem


@gluon.jit
def _copy_block(k_smem, kr_smem, stage, j, kv_ptr, src, ROWS_OF: gl.constexpr, D_QK: gl.constexpr):
    """Start the copies of key block ``j``'s rows into ``stage`` (their commit group is the caller's):
    ``ROWS_OF(src, j, BLOCK_N, layout)`` gives the rows' element offsets and which to read."""
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    at, ok = ROWS_OF(src, j, BLOCK_N, gl.SliceLayout(1, WIDE_ROWS))
    copy_rows(k_smem.index(stage), kv_ptr, at, ok, 0, WIDE_ROWS)
    if D_QK == 576:
        at, ok = ROWS_OF(src, j, BLOCK_N, gl.SliceLayout(1, ROWS))
        copy_rows(kr_smem.index(stage), kv_ptr, at, ok, 512, ROWS)


@gluon.jit
def attend_blocks(q_smem, qr_smem, k_smem, kr_smem, p_smem, j0, j1, kv_ptr, src, scale_log2,
                  ROWS_OF: gl.constexpr, MASK_OF: gl.constexpr, D_QK: gl.constexpr, K_STEP: gl.constexpr):
    """Key blocks ``[j0, j1)`` of a program, their rows copied from 16-bit ``kv_ptr`` into the NUM_STAGES
    stages of ``k_smem`` [NUM_STAGES, BLOCK_N, 512] (and ``kr_smem``, the rope tails at d_qk 576): block j + 1's
    copies travel while block j is attended. ``ROWS_OF(src, j, BLOCK_N, layout)``: block j's row offsets and
    which rows to read (the others are zero-filled); ``MASK_OF(src, j, BLOCK_N)``: the keys to attend, ``[1,
    BLOCK_N]`` or ``[64, BLOCK_N]`` in S's layout. Returns ``(m_run, m_use, l, acc)`` (``l`` the row sums of P)
    with every copy landed."""
    NUM_STAGES: gl.constexpr = k_smem.shape[0]
    for b in gl.static_range(NUM_STAGES - 1):
        if j0 + b < j1:
            _copy_block(k_smem, kr_smem, b, j0 + b, kv_ptr, src, ROWS_OF, D_QK)
        async_copy.commit_group()
    m_run, m_use, l_part, acc = initial_state(k_smem.shape[1])
    for j in range(j0, j1):
        i = j - j0
        if NUM_STAGES == 1:
            barrier()  # every warp is done with the previous block's rows
            _copy_block(k_smem, kr_smem, 0, j, kv_ptr, src, ROWS_OF, D_QK)
            async_copy.commit_group()
        valid = MASK_OF(src, j, k_smem.shape[1])
        async_copy.wait_group(max(NUM_STAGES - 2, 0))
        # Block j's rows (every thread's copies) have landed, and every warp is done with block j - 1: its
        # stage may be refilled and P's buffer rewritten.
        barrier()
        if NUM_STAGES > 1:
            if j + NUM_STAGES - 1 < j1:
                _copy_block(k_smem, kr_smem, (i + NUM_STAGES - 1) % NUM_STAGES, j + NUM_STAGES - 1, kv_ptr, src,
                            ROWS_OF, D_QK)
            async_copy.commit_group()
        stage = i % NUM_STAGES
        m_run, m_use, l_part, acc = attend_block(q_smem, qr_smem, k_smem.index(stage), kr_smem.index(stage),
                                                 p_smem, valid, scale_log2, m_run, m_use, l_part, acc, D_QK, K_STEP,
                                                 ONE_BARRIER_MAX=True)
    async_copy.wait_group(0)
    return m_run, m_use, row_sums(l_part), acc
