"""The warp partitions of the Hopper kernels (Gluon), shared by dense decoding and sparse prefill (and the
output partitions and softmax steps by sparse decoding, whose softmax partition is ``dequant.py``'s).

One program owns 64 query rows (BLOCK_H: one warpgroup's matrix-op height) and a range of key blocks. Three
warpgroups synchronize through mbarriers in shared memory:

- softmax (the default partition): S = q·kᵀ of a key block (64 x BLOCK_N matrix ops, q and K from shared
  memory), the mask, the skip-scale online softmax (lagging max per row); publishes each row's rescale factor,
  then P (16-bit).
- two output warpgroups: own O's columns [0, 256) and [256, 512); ``acc = acc * alpha + P·V`` with the
  latent tile's first 512 columns as V; they refill key stages (``FILL``) and write the result.

While the output warpgroups multiply P·V of block j, the softmax warpgroup computes S of block j + 1. Key
blocks live in a ring of NUM_STAGES stages: dense blocks come by tensor-memory copy (TMA, one page run of
BLOCK_N rows); sparse blocks are gathered row by row (``cp.async``) through an index list whose blocks the
softmax warpgroup stages in shared memory two blocks ahead. The queries (72 KB) and two stages of 72 KB fill
the 227 KB of shared memory, so loads are the critical path: each stage is refilled by the output
warpgroups the moment they are done with it.

``sched`` (what the partitions share, all scalars or shared memory):
``(k_desc, r_desc, kv_ptr, stride_row, n_rows, idx_smem, src_row_ptr, page, num_blocks, j0, j1, length)``:
key blocks ``[j0, j1)``; positions ``>= length`` are masked. Dense: ``src_row_ptr`` is the request's block
table row, rows come through the descriptors. Sparse: ``src_row_ptr`` is the token's index list, rows are
``kv_ptr + index * stride_row``; indices outside ``[0, n_rows)`` are skipped (their rows read as zeros).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

# Triton 3.7 renamed the CTA barrier (in a warp-specialized partition: its warps only).
barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
BLOCK_H = gl.constexpr(64)
NEG = gl.constexpr(-1.0e30)
LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)
RESCALE_THRESHOLD_LOG2 = gl.constexpr(6.0 * 1.4426950408889634)  # skip-scale threshold 6, log2 domain
# Registers a thread at launch: three warpgroups share the 64 K registers of an SM (65536 / 384 -> 168). The
# partitions are then re-balanced (setmaxnreg): the softmax (default) partition gets what the two output
# partitions leave (their worker_num_regs); an output warpgroup's [64, 256] fp32 accumulator alone takes 128.
REGS = gl.constexpr(168)
# Row-major copies of 16-byte pieces (8 columns a thread), for the query load and the gathers.
ROWS_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
WIDE_ROWS_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0]))
VECTOR_LAYOUT = gl.constexpr(gl.BlockedLayout([1], [32], [4], [0]))  # 64 indices over a warpgroup
GATHER_ROWS = gl.constexpr(16)  # rows a gather step: few 64-bit addresses live beside the accumulator
# Who fills the key stages (the output partitions' FILL): the first output warpgroup by TMA (dense pages),
# each output warpgroup its own columns by gathers (sparse prefill), or a dequantizing warpgroup of its own
# (quantized rows, ``dequant.py``), to which the output warpgroups give each stage back.
FILL_PAGES = gl.constexpr(0)
FILL_GATHER = gl.constexpr(1)
FILL_BY_WORKER = gl.constexpr(2)


@gluon.constexpr_function
def warpgroup_mma_layout(n):
    """The accumulator layout of one warpgroup's 64 x ``n`` matrix ops (wgmma, 16-bit inputs)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16])


@gluon.jit
def load_queries(q_ptr, q_row, row_ok, q_smem, qr_smem, D_QK: gl.constexpr):
    """Copy the program's query rows (element offsets ``q_row``) into shared memory, 64 columns at a time."""
    rows_l: gl.constexpr = gl.SliceLayout(1, ROWS_LAYOUT)
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, ROWS_LAYOUT))
    ptr = q_ptr + gl.expand_dims(gl.convert_layout(q_row, rows_l), 1) + gl.expand_dims(cols, 0)
    mask = gl.expand_dims(gl.convert_layout(row_ok, rows_l), 1)
    for c in gl.static_range(512 // 64):
        q_smem.slice(c * 64, 64, dim=1).store(gl.load(ptr + c * 64, mask=mask, other=0.0))
    if D_QK == 576:
        qr_smem.store(gl.load(ptr + 512, mask=mask, other=0.0))
    fence_async_shared()


@gluon.jit
def exp2_approx(x):
    # ex2.approx.ftz: one MUFU instruction; the non-ftz form Triton emits adds range fix-ups around it.
    return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _tail_mask(j, length, last_key, pos_l: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """Dense: keys of the sequence (``< length``) that the row's query may see (causal, aligned to the end)."""
    pos = gl.expand_dims(j * BLOCK_N + gl.arange(0, BLOCK_N, layout=pos_l), 0)
    mask = pos < length
    if CAUSAL:
        mask = mask & (pos <= last_key)
    return mask


@gluon.jit
def _load_block(k_desc, r_desc, k_smem, kr_smem, kv_ready, stage, j, bt_row_ptr, page, num_blocks,
                D_QK: gl.constexpr):
    """Dense: start the tensor-memory copy of key block ``j`` (one page's run of BLOCK_N rows) into ``stage``."""
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
def block_indices(src_row_ptr, j, length, n_rows, BLOCK_N: gl.constexpr, LAYOUT: gl.constexpr):
    """Sparse: the index list's block ``j`` (in ``LAYOUT``), with -1 for every key not to be read (from
    ``length`` on, negative, or outside the ``n_rows`` kv rows)."""
    pos = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=LAYOUT)
    idx = gl.load(src_row_ptr + pos, mask=pos < length, other=-1)
    return gl.where((idx >= 0) & (idx < n_rows), idx, -1)


@gluon.jit
def _stage_indices(idx_smem, slot, j, src_row_ptr, length, n_rows, BLOCK_N: gl.constexpr):
    """Sparse: the index list's block ``j`` into ``idx_smem[slot]`` (``block_indices``)."""
    idx_smem.index(slot).store(block_indices(src_row_ptr, j, length, n_rows, BLOCK_N, VECTOR_LAYOUT))


@gluon.jit
def _gather(dst, kv_ptr, stride_row, idx_slot, col0, LAYOUT: gl.constexpr):
    """Sparse: copy columns ``[col0, col0 + width)`` of the rows ``idx_slot`` names into ``dst`` [rows, width]
    (``cp.async``, 16 bytes a piece); index -1 fills its row with zeros and reads nothing."""
    rows_l: gl.constexpr = gl.SliceLayout(1, LAYOUT)
    cols = col0 + gl.arange(0, dst.shape[1], layout=gl.SliceLayout(0, LAYOUT))
    for r in gl.static_range(dst.shape[0] // GATHER_ROWS):
        idx = idx_slot.slice(r * GATHER_ROWS, GATHER_ROWS).load(rows_l)
        row = gl.expand_dims(gl.maximum(idx, 0).to(gl.int64) * stride_row, 1)
        ok = gl.expand_dims(idx >= 0, 1) & gl.expand_dims(cols >= 0, 0)
        async_copy.async_copy_global_to_shared(dst.slice(r * GATHER_ROWS, GATHER_ROWS), kv_ptr + row +
                                               gl.expand_dims(cols, 0), mask=ok)


@gluon.jit
def _gather_columns(k_smem, kr_smem, stage, idx_slot, kv_ptr, stride_row, col0, width: gl.constexpr,
                    WITH_ROPE: gl.constexpr):
    """Sparse: gather the latent columns ``[col0, col0 + width)`` (and the rope tail) of a key block."""
    for c in gl.static_range(width // 256):
        _gather(k_smem.index(stage).slice(col0 + c * 256, 256, dim=1), kv_ptr, stride_row, idx_slot,
                col0 + c * 256, WIDE_ROWS_LAYOUT)
    if WITH_ROPE:
        _gather(kr_smem.index(stage), kv_ptr, stride_row, idx_slot, 512, ROWS_LAYOUT)


@gluon.jit
def _signal_gathered(kv_ready, stage, count: gl.constexpr):
    """Arrive on the stage's barrier once this warpgroup's copies have landed (``count`` arrivals)."""
    async_copy.mbarrier_arrive(kv_ready.index(stage))
    mbarrier.arrive(kv_ready.index(stage), count=count)


@gluon.jit
def softmax_partition(q_smem, qr_smem, bufs, bars, sched, r0, s_q, group, scale_log2,
                      D_QK: gl.constexpr, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr, SPARSE: gl.constexpr):
    k_smem, kr_smem, p_smem, alpha_smem, l_smem, m_smem, mrun_smem = bufs
    kv_ready, kv_empty, alpha_ready, p_ready, p_empty, done = bars
    k_desc, r_desc, kv_ptr, stride_row, n_rows, idx_smem, src_row_ptr, page, num_blocks, j0, j1, length = sched
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    s_layout: gl.constexpr = warpgroup_mma_layout(BLOCK_N)
    row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    pos_l: gl.constexpr = gl.SliceLayout(0, s_layout)
    qi = (r0 + gl.arange(0, BLOCK_H, layout=row_l)) // group
    last_key = gl.expand_dims(length - s_q + qi, 1)  # dense, causal: the last position each row may see
    # Dense blocks below n_clean hold keys of the sequence that every row may see: no mask. Sparse blocks
    # always mask (any index may be invalid).
    if SPARSE:
        n_clean = j0
    else:
        n_clean = (gl.maximum(length - s_q + 1, 0) if CAUSAL else length) // BLOCK_N
    m_run = gl.full([BLOCK_H], NEG, gl.float32, row_l)
    m_use = gl.full([BLOCK_H], NEG, gl.float32, row_l)
    l = gl.zeros([BLOCK_H], gl.float32, row_l)
    for t in gl.static_range(NUM_STAGES):
        if j0 + t < j1:
            if SPARSE:
                _stage_indices(idx_smem, t, j0 + t, src_row_ptr, length, n_rows, BLOCK_N)
                _gather_columns(k_smem, kr_smem, t, idx_smem.index(t), kv_ptr, stride_row, 0, 512, D_QK == 576)
                _signal_gathered(kv_ready, t, 2)  # the count the two output warpgroups give later
            else:
                _load_block(k_desc, r_desc, k_smem, kr_smem, kv_ready, t, j0 + t, src_row_ptr, page, num_blocks,
                            D_QK)
    for j in range(j0, j1):
        i = j - j0
        stage = i % NUM_STAGES
        mbarrier.wait(kv_ready.index(stage), (i // NUM_STAGES) & 1)
        if SPARSE:
            fence_async_shared()  # gathered rows were written by the generic proxy; the matrix ops read async
        s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
        s = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s, use_acc=False, is_async=True)
        if D_QK == 576:
            s = warpgroup_mma(qr_smem, kr_smem.index(stage).permute((1, 0)), s, is_async=True)
        if SPARSE:
            valid = gl.expand_dims(idx_smem.index(stage).load(pos_l) >= 0, 0)
            # The indices of block j + NUM_STAGES, for the output warpgroups' refill of this stage.
            if j + NUM_STAGES < j1:
                _stage_indices(idx_smem, stage, j + NUM_STAGES, src_row_ptr, length, n_rows, BLOCK_N)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        # Raw logits: the scale is folded into the exponent (one FFMA an element); max(s) * scale = max(s * scale).
        if SPARSE:
            s = gl.where(valid, s, NEG)
        elif j >= n_clean:
            s = gl.where(_tail_mask(j, length, last_key, pos_l, BLOCK_N, CAUSAL), s, NEG)
        m_run, m_use, alpha = publish_alpha(s, i, m_run, m_use, scale_log2, bufs, bars)
        p = exp2_approx(s * scale_log2 - gl.expand_dims(m_use, 1))
        if SPARSE:
            p = gl.where(valid, p, 0.0)
        elif j >= n_clean:
            p = gl.where(_tail_mask(j, length, last_key, pos_l, BLOCK_N, CAUSAL), p, 0.0)
        l = l * alpha + gl.sum(p, 1)
        publish_p(p, i, bufs, bars)
    publish_totals(l, m_use, m_run, bufs, bars)


@gluon.jit
def publish_alpha(s, i, m_run, m_use, scale_log2, bufs, bars):
    """Block ``i``'s online-softmax step on masked raw logits ``s``: the new running maxima and each row's
    rescale factor, published to the output warpgroups at once. Returns ``(m_run, m_use, alpha)``."""
    k_smem, kr_smem, p_smem, alpha_smem, l_smem, m_smem, mrun_smem = bufs
    kv_ready, kv_empty, alpha_ready, p_ready, p_empty, done = bars
    m_new = gl.maximum(m_run, gl.max(s, 1) * scale_log2)
    # Skip-scale, lagging max per row (a select): p = 2^(s - m_use) stays <= 2^threshold.
    m_next = gl.where(m_new - m_use > RESCALE_THRESHOLD_LOG2, m_new, m_use)
    alpha = exp2_approx(m_use - m_next)
    # The rescale factors go out first, so the output warpgroups rescale while P is computed.
    alpha_smem.index(i % 2).store(alpha)
    mbarrier.arrive(alpha_ready, count=1)
    return m_new, m_next, alpha


@gluon.jit
def publish_p(p, i, bufs, bars):
    """Hand block ``i``'s probabilities to the output warpgroups."""
    k_smem, kr_smem, p_smem, alpha_smem, l_smem, m_smem, mrun_smem = bufs
    kv_ready, kv_empty, alpha_ready, p_ready, p_empty, done = bars
    # P's buffer is free once both output warpgroups have multiplied the previous block.
    mbarrier.wait(p_empty, (i & 1) ^ 1)
    p_smem.store(p.to(p_smem.dtype))
    fence_async_shared()
    mbarrier.arrive(p_ready, count=1)


@gluon.jit
def publish_totals(l, m_use, m_run, bufs, bars):
    """The row sums and maxima for the output warpgroups' epilogue, after the last block."""
    k_smem, kr_smem, p_smem, alpha_smem, l_smem, m_smem, mrun_smem = bufs
    kv_ready, kv_empty, alpha_ready, p_ready, p_empty, done = bars
    l_smem.store(l)
    m_smem.store(m_use)
    mrun_smem.store(m_run)
    mbarrier.arrive(done, count=1)


@gluon.jit
def _zero_keys_beyond(v_smem, first_pos, length):
    """Dense: zero the rows of a V tile past the sequence: the cache may hold NaN there, and 0 * NaN is NaN."""
    BLOCK_N: gl.constexpr = v_smem.shape[0]
    pos = first_pos + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ROWS_LAYOUT))
    keep = gl.expand_dims(pos < length, 1)
    for c in gl.static_range(v_smem.shape[1] // 64):
        chunk = v_smem.slice(c * 64, 64, dim=1)
        chunk.store(gl.where(keep, chunk.load(ROWS_LAYOUT), 0.0))
    fence_async_shared()


@gluon.jit
def _output_partition(bufs, bars, sched, out_args, D_QK: gl.constexpr, NUM_STAGES: gl.constexpr,
                      FILL: gl.constexpr, SPLIT: gl.constexpr, HAS_SINK: gl.constexpr, COL0: gl.constexpr):
    k_smem, kr_smem, p_smem, alpha_smem, l_smem, m_smem, mrun_smem = bufs
    kv_ready, kv_empty, alpha_ready, p_ready, p_empty, done = bars
    k_desc, r_desc, kv_ptr, stride_row, n_rows, idx_smem, src_row_ptr, page, num_blocks, j0, j1, length = sched
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    o_layout: gl.constexpr = warpgroup_mma_layout(256)
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
        if FILL == FILL_GATHER:
            fence_async_shared()  # V was gathered through the generic proxy (invalid rows already zero)
        elif FILL == FILL_PAGES:
            if (j + 1) * BLOCK_N > length:
                _zero_keys_beyond(v, j * BLOCK_N, length)
        acc = warpgroup_mma(p_smem, v, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        # Refill the stage the moment it is free: loads are the critical path.
        if FILL == FILL_BY_WORKER:
            mbarrier.arrive(kv_empty.index(stage), count=1)
        elif FILL == FILL_GATHER:
            # Each warpgroup gathers its own columns (the second one the rope tail too): its half is free as
            # soon as its own product is done; S of this block finished before P was published.
            if j + NUM_STAGES < j1:
                _gather_columns(k_smem, kr_smem, stage, idx_smem.index(stage), kv_ptr, stride_row, COL0, 256,
                                (COL0 != 0) & (D_QK == 576))
                _signal_gathered(kv_ready, stage, 1)
        elif FILL == FILL_PAGES:
            mbarrier.arrive(kv_empty.index(stage), count=1)
            if COL0 == 0:
                if j + NUM_STAGES < j1:
                    mbarrier.wait(kv_empty.index(stage), (i // NUM_STAGES) & 1)
                    _load_block(k_desc, r_desc, k_smem, kr_smem, kv_ready, stage, j + NUM_STAGES, src_row_ptr, page,
                                num_blocks, D_QK)
    mbarrier.wait(done, 0)
    _store_output(acc, l_smem.load(row_l), m_smem.load(row_l), mrun_smem.load(row_l), out_args,
                  FILL == FILL_GATHER, SPLIT, HAS_SINK, COL0)


@gluon.jit
def _store_output(acc, l, m_use, m_run, out_args, SPARSE: gl.constexpr, SPLIT: gl.constexpr,
                  HAS_SINK: gl.constexpr, COL0: gl.constexpr):
    """This warpgroup's 256 columns of out (or of a split's partial); lse (and max_logits) from the first.

    Same conventions as ``common.store_result`` / ``store_partial``: empty rows give out 0, lse +inf and
    max_logits -inf (a split: partial 0 and log2-domain lse -inf); the sink factor is
    ``1 / (1 + e^(sink - lse))``. ``out_args``: dense ``(q_rows, out_ptr, so_b, so_i, so_h, lse_ptr, sl_b,
    sl_i, sl_h, po_ptr, plse_ptr, sink_ptr, b, r0, s_q, group, num_heads, num_splits, split)``, sparse
    ``(h_q, out_ptr, so_t, so_h, lse_ptr, max_ptr, sink_ptr, t, r0)``."""
    layout: gl.constexpr = acc.type.layout
    rows_i = gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, layout))
    cols = gl.expand_dims(COL0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, layout)), 0)
    empty = l == 0.0
    l_safe = gl.where(empty, 1.0, l)
    lse2 = m_use + gl.log2(l_safe)
    scale = gl.where(empty, 0.0, 1.0 / l_safe)
    if SPARSE:
        h_q, out_ptr, so_t, so_h, lse_ptr, max_ptr, sink_ptr, t, r0 = out_args
        head = r0 + rows_i
        row_ok = head < h_q
        t64 = t.to(gl.int64)
        stat = t64 * h_q + head
        orow = t64 * so_t + head * so_h
    else:
        (q_rows, out_ptr, so_b, so_i, so_h, lse_ptr, sl_b, sl_i, sl_h, po_ptr, plse_ptr, sink_ptr,
         b, r0, s_q, group, num_heads, num_splits, split) = out_args
        rows = r0 + rows_i
        row_ok = rows < q_rows
        qi = rows // group
        head = rows % group
        b64 = b.to(gl.int64)
        stat = b64 * sl_b + qi * sl_i + head * sl_h
        orow = b64 * so_b + qi * so_i + head * so_h
    if SPLIT:
        prow = ((b64 * s_q + qi) * num_splits + split) * num_heads + head
        gl.store(po_ptr + gl.expand_dims(prow * 512, 1) + cols, acc * gl.expand_dims(scale, 1),
                 mask=gl.expand_dims(row_ok, 1))
        if COL0 == 0:
            gl.store(plse_ptr + prow, gl.where(empty, float("-inf"), lse2), mask=row_ok)
    else:
        if HAS_SINK:
            sink = gl.load(sink_ptr + head, mask=row_ok, other=float("-inf"))
            scale = scale / (1.0 + gl.exp2(sink * LOG2E - lse2))
        out = (acc * gl.expand_dims(scale, 1)).to(out_ptr.dtype.element_ty)
        gl.store(out_ptr + gl.expand_dims(orow, 1) + cols, out, mask=gl.expand_dims(row_ok, 1))
        if COL0 == 0:
            gl.store(lse_ptr + stat, gl.where(empty, float("inf"), lse2 * LN2), mask=row_ok)
            if SPARSE:
                gl.store(max_ptr + stat, gl.where(empty, float("-inf"), m_run * LN2), mask=row_ok)


@gluon.jit
def output_lo(bufs, bars, sched, out_args, D_QK: gl.constexpr, NUM_STAGES: gl.constexpr, FILL: gl.constexpr,
              SPLIT: gl.constexpr, HAS_SINK: gl.constexpr):
    _output_partition(bufs, bars, sched, out_args, D_QK, NUM_STAGES, FILL, SPLIT, HAS_SINK, 0)


@gluon.jit
def output_hi(bufs, bars, sched, out_args, D_QK: gl.constexpr, NUM_STAGES: gl.constexpr, FILL: gl.constexpr,
              SPLIT: gl.constexpr, HAS_SINK: gl.constexpr):
    _output_partition(bufs, bars, sched, out_args, D_QK, NUM_STAGES, FILL, SPLIT, HAS_SINK, 256)


@gluon.jit
def allocate(dtype: gl.constexpr, BLOCK_N: gl.constexpr, D_QK: gl.constexpr, NUM_STAGES: gl.constexpr,
             k_layout: gl.constexpr, r_layout: gl.constexpr, SPARSE: gl.constexpr, P_READERS: gl.constexpr):
    """Shared memory and barriers of one program: ``(q_smem, qr_smem, bufs, bars)``. ``P_READERS``: the
    warpgroups other than the softmax's that multiply each P (they release its buffer)."""
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, 512],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_H, 512], dtype))
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, 512], k_layout)
    if D_QK == 576:
        qr_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, 64],
                                            gl.NVMMASharedLayout.get_default_for([BLOCK_H, 64], dtype))
        kr_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, 64], r_layout)
    else:
        qr_smem = q_smem
        kr_smem = k_smem
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], dtype))
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    alpha_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], vec)  # double-buffered
    l_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec)
    m_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec)
    mrun_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], vec)
    kv_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    alpha_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        # Dense: one expect-tx arrival a copy; sparse: one arrival from each gathering warpgroup.
        mbarrier.init(kv_ready.index(s), count=2 if SPARSE else 1)
        mbarrier.init(kv_empty.index(s), count=2)  # released by both output warpgroups
    mbarrier.init(alpha_ready, count=1)
    mbarrier.init(p_ready, count=1)
    mbarrier.init(p_empty, count=P_READERS)
    mbarrier.init(done, count=1)
    bufs = (k_smem, kr_smem, p_smem, alpha_smem, l_smem, m_smem, mrun_smem)
    bars = (kv_ready, kv_empty, alpha_ready, p_ready, p_empty, done)
    return q_smem, qr_smem, bufs, bars
