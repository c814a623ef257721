"""Warp-specialized dense MLA decoding for Hopper (sm_90), written in Gluon (Triton's explicit-layout dialect).

Why a second kernel: the portable kernel (``kernel.py``) stops at ~0.4x of the matmul rate on compute-bound
shapes, because plain Triton runs q·kᵀ, the softmax and p·v one after the other in the same warps, splits
q·kᵀ between two warpgroups as narrow 64x32 matrix ops and cannot overlap loads, softmax and matrix work
(``NOTES.md``). Here the roles are split over warps that synchronize through mbarriers, the way FlashMLA and
FlashAttention-3 work on Hopper:

- softmax (default partition, 4 warps): S = q·kᵀ of a key block (64x64 matrix ops, q and K from shared
  memory), the mask, the skip-scale online softmax; publishes P (16-bit) and each row's rescale factor.
- two output warpgroups (4 warps each): own O's columns [0, 256) and [256, 512) and do
  ``acc = acc * alpha + P·V`` with the latent tile's first 512 columns as V; they write the result.
- loader (1 warp): tensor-memory copies (TMA) of key blocks into a ring of NUM_STAGES buffers.

While the output warpgroups multiply P·V of block j, the softmax warpgroup already computes S of block j + 1,
so the matrix units never wait for the exponentials. One program owns 64 packed query rows of one request
(``h_kv = 1``: row r is query ``r // h_q``, head ``r % h_q``) and one split's key blocks; pages must be a
multiple of 64 keys and the cache rows flat (``launch.py`` checks and otherwise uses the portable kernel).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

BLOCK_H = gl.constexpr(64)  # query rows a program: one warpgroup's matrix-op height
NEG = gl.constexpr(-1.0e30)
LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)
RESCALE_THRESHOLD_LOG2 = gl.constexpr(6.0 * 1.4426950408889634)  # skip-scale threshold 6, log2 domain
# Registers a thread: three warpgroups share the 64 K registers of an SM. ptxas compiles every partition
# within the kernel-wide limit (setmaxnreg cannot lift it), and an output warpgroup's [64, 256] fp32
# accumulator alone takes 128, so the launch passes maxnreg = REGS and the workers keep it.
REGS = gl.constexpr(168)


@gluon.jit
def _load_queries(q_ptr, q_row, row_ok, q_smem, qr_smem, D_QK: gl.constexpr):
    """Copy the program's query rows into shared memory, 64 columns at a time (few registers)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, layout)
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
    ptr = q_ptr + gl.expand_dims(gl.convert_layout(q_row, rows_l), 1) + gl.expand_dims(cols, 0)
    mask = gl.expand_dims(gl.convert_layout(row_ok, rows_l), 1)
    for c in gl.static_range(512 // 64):
        q_smem.slice(c * 64, 64, dim=1).store(gl.load(ptr + c * 64, mask=mask, other=0.0))
    if D_QK == 576:
        qr_smem.store(gl.load(ptr + 512, mask=mask, other=0.0))
    fence_async_shared()


@gluon.jit
def _exp2(x):
    # ex2.approx.ftz: one MUFU instruction; the non-ftz form Triton emits adds range fix-ups around it.
    return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _tail_mask(j, length, last_key, pos_l: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    pos = gl.expand_dims(j * BLOCK_N + gl.arange(0, BLOCK_N, layout=pos_l), 0)
    mask = pos < length
    if CAUSAL:
        mask = mask & (pos <= last_key)
    return mask


@gluon.jit
def _softmax_partition(q_smem, qr_smem, bufs, bars, sched, r0, s_q, group, scale_log2,
                       D_QK: gl.constexpr, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr):
    k_smem, kr_smem, p_smem, alpha_smem, l_smem, m_smem = bufs
    kv_ready, kv_empty, alpha_ready, p_ready, p_empty, done = bars
    k_desc, r_desc, bt_row_ptr, page, num_blocks, j0, j1, length = sched
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    pos_l: gl.constexpr = gl.SliceLayout(0, s_layout)
    qi = (r0 + gl.arange(0, BLOCK_H, layout=row_l)) // group
    last_key = gl.expand_dims(length - s_q + qi, 1)  # causal: the last position each row may see
    # Blocks below n_clean hold keys of the sequence that every row may see: no mask.
    n_clean = (gl.maximum(length - s_q + 1, 0) if CAUSAL else length) // BLOCK_N
    m_run = gl.full([BLOCK_H], NEG, gl.float32, row_l)
    m_use = gl.full([BLOCK_H], NEG, gl.float32, row_l)
    l = gl.zeros([BLOCK_H], gl.float32, row_l)
    for t in gl.static_range(NUM_STAGES):
        if j0 + t < j1:
            _load_block(k_desc, r_desc, k_smem, kr_smem, kv_ready, t, j0 + t, bt_row_ptr, page, num_blocks, D_QK)
    for j in range(j0, j1):
        i = j - j0
        stage = i % NUM_STAGES
        mbarrier.wait(kv_ready.index(stage), (i // NUM_STAGES) & 1)
        s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
        s = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s, use_acc=False, is_async=True)
        if D_QK == 576:
            s = warpgroup_mma(qr_smem, kr_smem.index(stage).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        # Raw logits: the scale is folded into the exponent (one FFMA an element); max(s) * scale = max(s * scale).
        if j >= n_clean:
            s = gl.where(_tail_mask(j, length, last_key, pos_l, BLOCK_N, CAUSAL), s, NEG)
        m_new = gl.maximum(m_run, gl.max(s, 1) * scale_log2)
        # Skip-scale, lagging max per row (a select): p = 2^(s - m_use) stays <= 2^threshold.
        m_next = gl.where(m_new - m_use > RESCALE_THRESHOLD_LOG2, m_new, m_use)
        alpha = _exp2(m_use - m_next)
        m_run = m_new
        m_use = m_next
        # The rescale factors go out first, so the output warpgroups rescale while P is computed.
        alpha_smem.index(i % 2).store(alpha)
        mbarrier.arrive(alpha_ready, count=1)
        p = _exp2(s * scale_log2 - gl.expand_dims(m_use, 1))
        if j >= n_clean:
            p = gl.where(_tail_mask(j, length, last_key, pos_l, BLOCK_N, CAUSAL), p, 0.0)
        l = l * alpha + gl.sum(p, 1)
        # P's buffer is free once both output warpgroups have multiplied the previous block.
        mbarrier.wait(p_empty, (i & 1) ^ 1)
        p_smem.store(p.to(p_smem.dtype))
        fence_async_shared()
        mbarrier.arrive(p_ready, count=1)
    l_smem.store(l)
    m_smem.store(m_use)
    mbarrier.arrive(done, count=1)


@gluon.jit
def _load_block(k_desc, r_desc, k_smem, kr_smem, kv_ready, stage, j, bt_row_ptr, page, num_blocks,
                D_QK: gl.constexpr):
    """Start the tensor-memory copy of key block ``j`` (one page's run of BLOCK_N rows) into ``stage``."""
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    nbytes: gl.constexpr = BLOCK_N * D_QK * k_smem.dtype.primitive_bitwidth // 8
    pos0 = j * BLOCK_N
    blk = gl.load(bt_row_ptr + pos0 // page)
    # A corrupt block id points past the descriptor's rows: the copy then reads zeros, never other memory.
    blk = gl.where((blk >= 0) & (blk < num_blocks), blk, num_blocks)
    row = blk * page + pos0 % page
    bar = kv_ready.index(stage)
    mbarrier.expect(bar, nbytes)
    tma.async_copy_global_to_shared(k_desc, [row, 0], bar, k_smem.index(stage))
    if D_QK == 576:
        tma.async_copy_global_to_shared(r_desc, [row, 512], bar, kr_smem.index(stage))


@gluon.jit
def _zero_keys_beyond(v_smem, first_pos, length):
    """Zero the rows of a V tile past the sequence: the cache may hold NaN there, and 0 * NaN is NaN."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    BLOCK_N: gl.constexpr = v_smem.shape[0]
    pos = first_pos + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    keep = gl.expand_dims(pos < length, 1)
    for c in gl.static_range(v_smem.shape[1] // 64):
        chunk = v_smem.slice(c * 64, 64, dim=1)
        chunk.store(gl.where(keep, chunk.load(layout), 0.0))
    fence_async_shared()


@gluon.jit
def _output_partition(bufs, bars, sched, out_args, D_QK: gl.constexpr, NUM_STAGES: gl.constexpr,
                      SPLIT: gl.constexpr, HAS_SINK: gl.constexpr, COL0: gl.constexpr):
    k_smem, kr_smem, p_smem, alpha_smem, l_smem, m_smem = bufs
    kv_ready, kv_empty, alpha_ready, p_ready, p_empty, done = bars
    k_desc, r_desc, bt_row_ptr, page, num_blocks, j0, j1, length = sched
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    row_l: gl.constexpr = gl.SliceLayout(1, o_layout)
    acc = gl.zeros([BLOCK_H, 256], gl.float32, o_layout)
    for j in range(j0, j1):
        i = j - j0
        stage = i % NUM_STAGES
        mbarrier.wait(alpha_ready, i & 1)
        # Only now may the softmax warpgroup publish P of this block (the previous one has been multiplied and
        # this block's rescale factors read): releasing P any earlier could let it run two blocks ahead.
        if i > 0:
            mbarrier.arrive(p_empty, count=1)
        acc = acc * gl.expand_dims(alpha_smem.index(i % 2).load(row_l), 1)
        mbarrier.wait(p_ready, i & 1)
        v = k_smem.index(stage).slice(COL0, 256, dim=1)
        if (j + 1) * BLOCK_N > length:
            _zero_keys_beyond(v, j * BLOCK_N, length)
        acc = warpgroup_mma(p_smem, v, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(kv_empty.index(stage), count=1)
        if COL0 == 0:
            # Refill the stage as soon as both output warpgroups are done with it: loads are the critical
            # path (two stages of 72 KB fit beside the queries), so they start here rather than wherever the
            # softmax warpgroup happens to be.
            if j + NUM_STAGES < j1:
                mbarrier.wait(kv_empty.index(stage), (i // NUM_STAGES) & 1)
                _load_block(k_desc, r_desc, k_smem, kr_smem, kv_ready, stage, j + NUM_STAGES, bt_row_ptr, page,
                            num_blocks, D_QK)
    mbarrier.wait(done, 0)
    _store_output(acc, l_smem.load(row_l), m_smem.load(row_l), out_args, SPLIT, HAS_SINK, COL0)


@gluon.jit
def _store_output(acc, l, m_use, out_args, SPLIT: gl.constexpr, HAS_SINK: gl.constexpr, COL0: gl.constexpr):
    """This warpgroup's 256 columns of out (or of the split's partial), and lse from the first warpgroup.

    Same conventions as ``common.store_result`` / ``store_partial``: empty rows give out 0 and lse +inf
    (a split: partial 0 and log2-domain lse -inf); the sink factor is ``1 / (1 + e^(sink - lse))``."""
    (q_rows, out_ptr, so_b, so_i, so_h, lse_ptr, sl_b, sl_i, sl_h, po_ptr, plse_ptr, sink_ptr,
     b, r0, s_q, group, num_heads, num_splits, split) = out_args
    layout: gl.constexpr = acc.type.layout
    rows = r0 + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
    cols = COL0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout))
    row_ok = rows < q_rows
    qi = rows // group
    head = rows % group
    empty = l == 0.0
    l_safe = gl.where(empty, 1.0, l)
    lse2 = m_use + gl.log2(l_safe)
    scale = gl.where(empty, 0.0, 1.0 / l_safe)
    b64 = b.to(gl.int64)
    if SPLIT:
        prow = ((b64 * s_q + qi) * num_splits + split) * num_heads + head
        gl.store(po_ptr + gl.expand_dims(prow * 512, 1) + gl.expand_dims(cols, 0), acc * gl.expand_dims(scale, 1), mask=gl.expand_dims(row_ok, 1))
        if COL0 == 0:
            gl.store(plse_ptr + prow, gl.where(empty, float("-inf"), lse2), mask=row_ok)
    else:
        if HAS_SINK:
            sink = gl.load(sink_ptr + head, mask=row_ok, other=float("-inf"))
            scale = scale / (1.0 + gl.exp2(sink * LOG2E - lse2))
        orow = b64 * so_b + qi * so_i + head * so_h
        gl.store(out_ptr + gl.expand_dims(orow, 1) + gl.expand_dims(cols, 0), (acc * gl.expand_dims(scale, 1)).to(out_ptr.dtype.element_ty), mask=gl.expand_dims(row_ok, 1))
        if COL0 == 0:
            gl.store(lse_ptr + b64 * sl_b + qi * sl_i + head * sl_h, gl.where(empty, float("inf"), lse2 * LN2),
                     mask=row_ok)


@gluon.jit
def _output_lo(bufs, bars, sched, out_args, D_QK: gl.constexpr, NUM_STAGES: gl.constexpr, SPLIT: gl.constexpr,
               HAS_SINK: gl.constexpr):
    _output_partition(bufs, bars, sched, out_args, D_QK, NUM_STAGES, SPLIT, HAS_SINK, 0)


@gluon.jit
def _output_hi(bufs, bars, sched, out_args, D_QK: gl.constexpr, NUM_STAGES: gl.constexpr, SPLIT: gl.constexpr,
               HAS_SINK: gl.constexpr):
    _output_partition(bufs, bars, sched, out_args, D_QK, NUM_STAGES, SPLIT, HAS_SINK, 256)


@gluon.jit
def dense_decode_hopper_kernel(
        q_ptr, sq_b, sq_i, sq_h, k_desc, r_desc, page, num_blocks,
        bt_ptr, sbt_b, lens_ptr, sink_ptr,
        out_ptr, so_b, so_i, so_h, lse_ptr, sl_b, sl_i, sl_h, po_ptr, plse_ptr,
        s_q, num_heads, rb_per_head, num_splits, scale_log2,
        D_QK: gl.constexpr, CAUSAL: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr,
        NUM_STAGES: gl.constexpr):
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    dtype: gl.constexpr = k_desc.dtype
    pid = gl.program_id(0)
    split = gl.program_id(1)
    b = pid // rb_per_head
    r0 = (pid % rb_per_head) * BLOCK_H
    group = num_heads  # h_kv = 1
    q_rows = s_q * group

    length = gl.load(lens_ptr + b)
    n_blocks = gl.cdiv(length, BLOCK_N)
    per_split = gl.cdiv(n_blocks, num_splits)
    j0 = split * per_split
    j1 = gl.minimum(j0 + per_split, n_blocks)

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, 512], gl.NVMMASharedLayout.get_default_for([BLOCK_H, 512], dtype))
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, 512], k_desc.layout)
    if D_QK == 576:
        qr_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, 64], gl.NVMMASharedLayout.get_default_for([BLOCK_H, 64], dtype))
        kr_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, 64], r_desc.layout)
    else:
        qr_smem = q_smem
        kr_smem = k_smem
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype))
    vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    alpha_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], vec_layout)  # double-buffered
    l_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_layout)
    m_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    alpha_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(kv_ready.index(s), count=1)
        mbarrier.init(kv_empty.index(s), count=2)  # released by both output warpgroups
    mbarrier.init(alpha_ready, count=1)
    mbarrier.init(p_ready, count=1)
    mbarrier.init(p_empty, count=2)
    mbarrier.init(done, count=1)

    q_layout_rows: gl.constexpr = gl.SliceLayout(1, gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
    rows = r0 + gl.arange(0, BLOCK_H, layout=q_layout_rows)
    q_row = b.to(gl.int64) * sq_b + (rows // group) * sq_i + (rows % group) * sq_h
    _load_queries(q_ptr, q_row, rows < q_rows, q_smem, qr_smem, D_QK)

    out_args = (q_rows, out_ptr, so_b, so_i, so_h, lse_ptr, sl_b, sl_i, sl_h, po_ptr, plse_ptr, sink_ptr,
                b, r0, s_q, group, num_heads, num_splits, split)
    bufs = (k_smem, kr_smem, p_smem, alpha_smem, l_smem, m_smem)
    bars = (kv_ready, kv_empty, alpha_ready, p_ready, p_empty, done)
    sched = (k_desc, r_desc, bt_ptr + b.to(gl.int64) * sbt_b, page, num_blocks, j0, j1, length)
    # (constexpr arguments are spelled out in each tuple: a tuple kept in a variable turns them into tensors)
    gl.warp_specialize([
        (_softmax_partition, (q_smem, qr_smem, bufs, bars, sched, r0, s_q, group, scale_log2, D_QK, CAUSAL,
                              NUM_STAGES)),
        (_output_lo, (bufs, bars, sched, out_args, D_QK, NUM_STAGES, SPLIT, HAS_SINK)),
        (_output_hi, (bufs, bars, sched, out_args, D_QK, NUM_STAGES, SPLIT, HAS_SINK)),
    ], [4, 4], [REGS, REGS])
