"""Sparse attention on Hopper for few heads (tensor-parallel head counts: at most 32 query heads a token), with
the keys as the matrix ops' M dimension: decoding over quantized caches, and sparse prefill over bf16 rows (whose
workers gather rows by 16-byte copies instead of dequantizing).

Why a kernel of its own: with 64 query rows a program (``dequant.py``), a token of 16 heads fills a quarter of
the tile, and the one warpgroup that dequantizes rows is a single latency-bound chain an SM (H200, run 35:
1.6 TB/s, 1 program an SM). Turned around, Sᵀ = K·qᵀ is a 64-key x HEADS product and Oᵀ = Vᵀ·Pᵀ accumulates
``[512, HEADS]``: 64 registers a thread at 16 heads instead of two warpgroups' 128. That leaves room for two
workers that do nothing but dequantize (a warpgroup each; two each for V4.1 caches at <= 16 heads,
``fill_warps``), each owning one of the two key stages:

- the default warpgroup: for each block, Sᵀ (K from the stage, qᵀ from shared memory), the mask and the
  skip-scale online softmax along the keys (one cross-warp maximum a block; the row sums are kept per thread
  and reduced once at the end), Pᵀ into shared memory, Oᵀ += Vᵀ·Pᵀ (V transposed from the same stage), then
  it frees the stage;
- two dequantizing workers: worker ``w`` fills the program's blocks ``w, w + 2, ...``: it loads a block's
  codes and scales into registers and asks L2 for its next block's rows, waits for its stage, writes the block
  in bf16 (the rope values too), and marks the stage full.

Sources, splits and formats as ``dequant.py``'s (V3.2, V4.1 FP8 / FP4 extra, MODEL1); the epilogue is
``partitions._store_output``'s (its decoding or its prefill form), on Oᵀ transposed.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ..common import FMT_BF16, FMT_V41_FP8
from .dequant import _slots_at, block_counts, fill_sources, second_source
from .partitions import (NEG, RESCALE_THRESHOLD_LOG2, ROWS_LAYOUT, WIDE_ROWS_LAYOUT, _store_output, barrier,
                         block_indices, exp2_approx, warpgroup_mma_layout)


@gluon.constexpr_function
def fill_warps(heads, fmt):
    """Warps of each filling worker: 8 where they dequantize V4.1 caches for at most 16 heads (a block's codes
    converted by two warpgroups at once, 32 registers a thread: V4.1's 16 scales a row and FP4's nibbles make its
    conversion the longest, ../sparse_mla/NOTES.md run 117), else 4: V3.2 and MODEL1 workers wait on their loads
    more than they convert, bf16 workers only copy, and beside 32 heads' Oᵀ (128 registers a thread) wider
    workers spill."""
    return 8 if fmt == FMT_V41_FP8 and heads <= 16 else 4


@gluon.constexpr_function
def worker_regs(heads, fmt):
    """Registers a thread of each worker; the default warpgroup gets the rest of the register file (Triton
    re-balances with setmaxnreg). The fewest spills offline (compile_report --hopper, Triton 3.7.1)."""
    if fill_warps(heads, fmt) == 8:
        return 88 if heads <= 8 else 80
    return 152 if heads <= 16 else 144


@gluon.constexpr_function
def wide_loads(heads):
    """Whether the workers load 16 code bytes a thread (``dequant._codes_layout``): at most 16 heads. Beside 32
    heads' Oᵀ their 144 registers spill with them, and 152 made V3.2 h32 25 % slower (../sparse_mla/NOTES.md,
    run 138)."""
    return heads <= 16


@gluon.constexpr_function
def launch_regs(heads, fmt):
    """Registers a thread at launch (``maxnreg``): the register file over the program's threads (168 for three
    warpgroups, 96 for five), so the default warpgroup can grow into what the workers give back."""
    return 65536 // (32 * (4 + 2 * fill_warps(heads, fmt))) // 8 * 8


# Oᵀ leaves in rows of 512 output columns (4 contiguous a thread): coalesced stores of out and the partials.
OUT_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0]))


@gluon.jit
def _scores(k_tile, kr_tile, q_smem, qr_smem, s_layout: gl.constexpr, D_QK: gl.constexpr, TWO_CHAINS: gl.constexpr):
    """Sᵀ = K·qᵀ of one stage ``[BLOCK_N, HEADS]`` fp32. ``TWO_CHAINS`` (prefill, bound by this warpgroup's
    chain): as two accumulators taking alternate 16-column steps of d; with N = HEADS a step is a short matrix
    op, and one accumulator makes the 32-36 steps one chain, each waiting for the one before. (Decoding is
    bound by its workers, and its second accumulator spills at 32 heads.)"""
    BLOCK_N: gl.constexpr = k_tile.shape[0]
    HEADS: gl.constexpr = q_smem.shape[0]
    if not TWO_CHAINS:
        s = warpgroup_mma(k_tile, q_smem.permute((1, 0)), gl.zeros([BLOCK_N, HEADS], gl.float32, s_layout),
                          use_acc=False, is_async=True)
        if D_QK == 576:
            s = warpgroup_mma(kr_tile, qr_smem.permute((1, 0)), s, is_async=True)
        return warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    even = gl.zeros([BLOCK_N, HEADS], gl.float32, s_layout)
    odd = gl.zeros([BLOCK_N, HEADS], gl.float32, s_layout)
    even, odd = _alternate_steps(k_tile, q_smem, even, odd, True)
    if D_QK == 576:
        even, odd = _alternate_steps(kr_tile, qr_smem, even, odd, False)
    even, odd = warpgroup_mma_wait(num_outstanding=0, deps=(even, odd))
    return even + odd


@gluon.jit
def _alternate_steps(k_cols, q_cols, even, odd, FIRST: gl.constexpr):
    """``even`` / ``odd`` += the even / odd 16-column steps of ``k_cols``·``q_cols``ᵀ (``FIRST``: they start
    empty)."""
    WIDTH: gl.constexpr = k_cols.shape[1]
    for c in gl.static_range(0, WIDTH, 32):
        even = warpgroup_mma(k_cols.slice(c, 16, dim=1), q_cols.slice(c, 16, dim=1).permute((1, 0)), even,
                             use_acc=(c > 0) or not FIRST, is_async=True)
        odd = warpgroup_mma(k_cols.slice(c + 16, 16, dim=1), q_cols.slice(c + 16, 16, dim=1).permute((1, 0)), odd,
                            use_acc=(c > 0) or not FIRST, is_async=True)
    return even, odd


@gluon.jit
def _keys_max(s, partials):
    """The maximum over the keys (dim 0, 16 a warp) of Sᵀ ``[BLOCK_N, HEADS]``, in the heads' layout of Sᵀ, with
    one barrier: each warp's maximum over its 16 keys into ``partials`` [4, HEADS] (the caller alternates two
    of them, so a warp writing the next block's never overtakes one still reading this block's), then every
    thread takes the four partials of its heads. (``gl.max`` over dim 0 takes three barriers.)"""
    BLOCK_N: gl.constexpr = s.shape[0]
    HEADS: gl.constexpr = s.shape[1]
    per_warp = gl.max(gl.reshape(s, [4, BLOCK_N // 4, HEADS]), 1)
    partials.store(per_warp)
    barrier()
    # Four partials of a head in one thread, the heads placed as Sᵀ's columns: the maximum needs no exchange.
    four_a_thread: gl.constexpr = gl.BlockedLayout([4, 2], [8, 4], [4, 1], [1, 0])
    return gl.convert_layout(gl.max(partials.load(four_a_thread), 0), gl.SliceLayout(0, s.type.layout))


@gluon.jit
def _attend(q_smem, qr_smem, k_smem, kr_smem, p_smem, ready, empty, first, second, m_run, m_use, l_acc, acc,
            scale_log2, D_QK: gl.constexpr, PREFILL: gl.constexpr):
    """The default warpgroup over ``first``'s key blocks, then ``second``'s, in one loop (a block's source only
    decides which keys are valid), as the program's blocks ``0, 1, ...`` (stage ``i % 2``). Returns the softmax
    state and Oᵀ."""
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEADS: gl.constexpr = q_smem.shape[0]
    s_layout: gl.constexpr = warpgroup_mma_layout(HEADS)
    pos_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    n_first, n = block_counts(first, second)
    slots = _slots_at(first, second, n_first, 0, BLOCK_N, pos_l)
    partials = gl.allocate_shared_memory(gl.float32, [2, 4, HEADS], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    for i in range(0, n):
        stage = i % 2
        next_slots = _slots_at(first, second, n_first, i + 1, BLOCK_N, pos_l)
        mbarrier.wait(ready.index(stage), (i // 2) & 1)
        s = _scores(k_smem.index(stage), kr_smem.index(stage), q_smem, qr_smem, s_layout, D_QK, PREFILL)
        valid = gl.expand_dims(slots >= 0, 1)
        s = gl.where(valid, s, NEG)
        m_new = gl.maximum(m_run, _keys_max(s, partials.index(i % 2)) * scale_log2)
        # Skip-scale, lagging max per head (a select): p = 2^(s - m_use) stays <= 2^threshold.
        m_next = gl.where(m_new - m_use > RESCALE_THRESHOLD_LOG2, m_new, m_use)
        alpha = gl.expand_dims(exp2_approx(m_use - m_next), 0)
        p = gl.where(valid, exp2_approx(s * scale_log2 - gl.expand_dims(m_next, 0)), 0.0)
        l_acc = l_acc * alpha + p
        acc = acc * alpha
        p_smem.store(p.to(p_smem.dtype))
        fence_async_shared()
        acc = warpgroup_mma(k_smem.index(stage).permute((1, 0)), p_smem, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index(stage), count=1)
        m_run = m_new
        m_use = m_next
        slots = next_slots
    return m_run, m_use, l_acc, acc


@gluon.jit
def attend_partition(q_smem, qr_smem, k_smem, kr_smem, p_smem, ready, empty, main, extra, scale_log2, out_args,
                     D_QK: gl.constexpr, HAS_X: gl.constexpr, SPLIT: gl.constexpr, HAS_SINK: gl.constexpr,
                     PREFILL: gl.constexpr):
    """The default warpgroup: both sources under one softmax, then the epilogue (``_store_output``'s sparse
    prefill form with max_logits, or its decoding form)."""
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    HEADS: gl.constexpr = q_smem.shape[0]
    s_layout: gl.constexpr = warpgroup_mma_layout(HEADS)
    head_l: gl.constexpr = gl.SliceLayout(0, s_layout)
    m_run = gl.full([HEADS], NEG, gl.float32, head_l)
    m_use = gl.full([HEADS], NEG, gl.float32, head_l)
    l_acc = gl.zeros([BLOCK_N, HEADS], gl.float32, s_layout)
    acc = gl.zeros([512, HEADS], gl.float32, s_layout)
    second = second_source(main, extra, HAS_X)
    m_run, m_use, l_acc, acc = _attend(q_smem, qr_smem, k_smem, kr_smem, p_smem, ready, empty, main, second, m_run,
                                       m_use, l_acc, acc, scale_log2, D_QK, PREFILL)
    rows_l: gl.constexpr = gl.SliceLayout(1, OUT_LAYOUT)
    out = gl.convert_layout(gl.permute(acc, (1, 0)), OUT_LAYOUT)
    _store_output(out, gl.convert_layout(gl.sum(l_acc, 0), rows_l), gl.convert_layout(m_use, rows_l),
                  gl.convert_layout(m_run, rows_l), out_args, PREFILL, SPLIT, HAS_SINK, 0)


@gluon.jit
def _gather_rows(dst, kv_ptr, rows, ok, col0: gl.constexpr, LAYOUT: gl.constexpr):
    """Copy columns ``[col0, col0 + width)`` of the bf16 rows at element offsets ``rows`` into ``dst`` [rows,
    width] (``cp.async``, 16 bytes a piece); rows not ``ok`` are zero-filled and read nothing."""
    rows_l: gl.constexpr = gl.SliceLayout(1, LAYOUT)
    cols = gl.expand_dims(col0 + gl.arange(0, dst.shape[1], layout=gl.SliceLayout(0, LAYOUT)), 0)
    at = gl.expand_dims(gl.convert_layout(rows, rows_l), 1)
    mask = gl.expand_dims(gl.convert_layout(ok, rows_l), 1) & (cols >= 0)
    async_copy.async_copy_global_to_shared(dst, kv_ptr + at + cols, mask=mask)


@gluon.jit
def _gather_fill(k_smem, kr_smem, ready, empty, src, W: gl.constexpr):
    """Worker ``W``'s blocks of bf16 rows (sparse prefill: ``kv_ptr + index * stride_row``): each stage refilled
    by 16-byte copies the moment it is free, the rope tail too where the stages have one."""
    kv_ptr, stride_block, stride_row, page, n_rows, idx_row_ptr, end, j0, j1 = src
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    WITH_ROPE: gl.constexpr = kr_smem.shape[2] == 64
    slots_l: gl.constexpr = gl.SliceLayout(1, WIDE_ROWS_LAYOUT)
    slots = block_indices(idx_row_ptr, j0 + W, end, n_rows, BLOCK_N, slots_l)
    for j in range(j0 + W, j1, 2):
        i = j - j0
        next_slots = block_indices(idx_row_ptr, j + 2, end, n_rows, BLOCK_N, slots_l)
        rows = gl.maximum(slots, 0).to(gl.int64) * stride_row
        ok = slots >= 0
        mbarrier.wait(empty.index(W), ((i // 2) & 1) ^ 1)
        for c in gl.static_range(2):
            _gather_rows(k_smem.index(W).slice(c * 256, 256, dim=1), kv_ptr, rows, ok, c * 256, WIDE_ROWS_LAYOUT)
        if WITH_ROPE:
            _gather_rows(kr_smem.index(W), kv_ptr, rows, ok, 512, ROWS_LAYOUT)
        async_copy.commit_group()
        async_copy.wait_group(0)
        fence_async_shared()
        mbarrier.arrive(ready.index(W), count=1)
        slots = next_slots


@gluon.jit
def _fill_partition(k_smem, kr_smem, ready, empty, main, extra, W: gl.constexpr, FMT: gl.constexpr,
                    X_FMT: gl.constexpr, HAS_X: gl.constexpr, WIDE: gl.constexpr):
    if FMT == FMT_BF16:
        _gather_fill(k_smem, kr_smem, ready, empty, main, W)
    else:
        fill_sources(k_smem, kr_smem, ready, empty, main, extra, W, 2, FMT, X_FMT, HAS_X, WIDE)


@gluon.jit
def fill_even(k_smem, kr_smem, ready, empty, main, extra, FMT: gl.constexpr, X_FMT: gl.constexpr,
              HAS_X: gl.constexpr, WIDE: gl.constexpr):
    _fill_partition(k_smem, kr_smem, ready, empty, main, extra, 0, FMT, X_FMT, HAS_X, WIDE)


@gluon.jit
def fill_odd(k_smem, kr_smem, ready, empty, main, extra, FMT: gl.constexpr, X_FMT: gl.constexpr,
             HAS_X: gl.constexpr, WIDE: gl.constexpr):
    _fill_partition(k_smem, kr_smem, ready, empty, main, extra, 1, FMT, X_FMT, HAS_X, WIDE)


@gluon.jit
def allocate_few_heads(dtype: gl.constexpr, HEADS: gl.constexpr, BLOCK_N: gl.constexpr, D_QK: gl.constexpr,
                       k_layout: gl.constexpr, r_layout: gl.constexpr):
    """Shared memory and barriers of one program: queries, two key stages, Pᵀ, and each stage's full / free
    barriers (one arrival each: a worker fills a stage, the default warpgroup frees it)."""
    q_smem = gl.allocate_shared_memory(dtype, [HEADS, 512], gl.NVMMASharedLayout.get_default_for([HEADS, 512], dtype))
    qr_smem = gl.allocate_shared_memory(dtype, [HEADS, 64], gl.NVMMASharedLayout.get_default_for([HEADS, 64], dtype))
    k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, 512], k_layout)
    if D_QK == 576:
        kr_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, 64], r_layout)
    else:
        kr_smem = k_smem
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEADS],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEADS], dtype))
    ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(2):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    return q_smem, qr_smem, k_smem, kr_smem, p_smem, ready, empty

