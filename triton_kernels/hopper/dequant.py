"""Sparse decoding over a V3.2 FP8 cache on Hopper: a softmax warpgroup that also fills the key stages.

A V3.2 token is 656 bytes: 512 e4m3 codes, 4 fp32 scales (one per 128 columns), 64 bf16 rope values. The
matrix units take bf16, so each gathered row is dequantized into shared memory on its way in. Doing that in
the output warpgroups (run 22, ``../sparse_mla/NOTES.md``) left them too few registers beside their [64, 256]
accumulators to keep loads in flight. The softmax warpgroup has room (its S tile is 32 registers a thread):
while the matrix units compute S of block j it issues the loads of block j + 1's codes and scales into
registers and copies the rope tails straight into shared memory (``cp.async``); once it has published P of
block j, which implies that both output warpgroups are done with block j - 1, it writes block j + 1 in bf16
into that stage. Two stages; the output partitions run as for the other kernels (``FILL_BY_SOFTMAX``).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from .partitions import (BLOCK_H, NEG, ROWS_LAYOUT, exp2_approx, publish_alpha, publish_p, publish_totals,
                         warpgroup_mma_layout)

# Registers a thread of each output warpgroup (their [64, 256] accumulators fit without spills); the softmax
# warpgroup gets the rest of the register file (184), for the block it holds in flight.
OUTPUT_REGS = gl.constexpr(160)
# A block's codes as [rows, 4 scale tiles, 128]: 8 a thread (8-byte loads); the 8 lanes of a store phase
# write one row's 64 bf16 values, a whole 128-byte swizzle row, so the stores into the stage are conflict-free.
CODES_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 1, 8], [4, 1, 8], [4, 1, 1], [2, 1, 0]))
SCALES_LAYOUT = gl.constexpr(gl.SliceLayout(2, CODES_LAYOUT))  # [rows, 4]
SLOTS_LAYOUT = gl.constexpr(gl.SliceLayout(1, SCALES_LAYOUT))  # [rows]
SCALES_AT = gl.constexpr(512)  # byte offsets in a token's row
ROPE_AT = gl.constexpr(528)
# L2 prefetches of a block's rows: [rows, 8] line addresses a thread (a 656-byte row spans at most 7 lines of
# 128 bytes: offsets 0, 128, ..., 640 and its last byte).
LINES_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 1], [4, 8], [4, 1], [1, 0]))
PREFETCH_ASM = gl.constexpr("{ .reg .pred p; setp.ge.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }")


@gluon.jit
def _block_slots(idx_row_ptr, j, end, n_rows, BLOCK_N: gl.constexpr):
    """Cache slots of key block ``j`` of the token's index list: -1 where nothing may be read (positions from
    ``end`` on, negative indices, indices outside the cache)."""
    pos = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=SLOTS_LAYOUT)
    idx = gl.load(idx_row_ptr + pos, mask=pos < end, other=-1)
    return gl.where((idx >= 0) & (idx < n_rows), idx, -1)


@gluon.jit
def _row_bytes(slots, stride_block, stride_row, page):
    """Byte offsets of the slots' rows (``slot // page`` is the block, for any block stride)."""
    s = gl.maximum(slots, 0)
    return (s // page).to(gl.int64) * stride_block + (s % page).to(gl.int64) * stride_row


@gluon.jit
def _load_codes(kv_ptr, slots, stride_block, stride_row, page):
    """Issue the loads of a block's codes ``[rows, 4, 128]`` (uint8) and scales ``[rows, 4]``; rows of slot -1
    read nothing and come out as zeros."""
    base = gl.expand_dims(_row_bytes(slots, stride_block, stride_row, page), 1)
    tiles = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, SCALES_LAYOUT)), 0)
    ok = gl.expand_dims(slots >= 0, 1) & (tiles >= 0)
    scales = gl.load((kv_ptr + base + SCALES_AT + 4 * tiles).to(gl.pointer_type(gl.float32)), mask=ok, other=0.0)
    cols = gl.expand_dims(gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, gl.SliceLayout(1, CODES_LAYOUT))),
                                         0), 1)
    codes = gl.load(kv_ptr + gl.expand_dims(base + 128 * tiles, 2) + cols, mask=gl.expand_dims(ok, 2) & (cols >= 0),
                    other=0)
    return codes, scales


@gluon.jit
def _copy_rope(kr_stage, kv_ptr, slots, stride_block, stride_row, page):
    """Start the copies of a block's bf16 rope tails into ``kr_stage`` (16 bytes a piece); rows of slot -1 are
    zero-filled and read nothing."""
    slots = gl.convert_layout(slots, gl.SliceLayout(1, ROWS_LAYOUT))
    base = gl.expand_dims(_row_bytes(slots, stride_block, stride_row, page) + ROPE_AT, 1)
    cols = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, ROWS_LAYOUT)), 0)
    src = (kv_ptr + base).to(gl.pointer_type(kr_stage.dtype)) + cols
    async_copy.async_copy_global_to_shared(kr_stage, src, mask=gl.expand_dims(slots >= 0, 1) & (cols >= 0))
    async_copy.commit_group()


@gluon.jit
def _prefetch_rows(kv_ptr, slots, stride_block, stride_row, page):
    """Ask L2 for the rows of a later block (no registers held until they arrive): the loads that dequantize
    the block then wait for L2, not for memory. Slot -1 asks for nothing."""
    slots = gl.expand_dims(gl.convert_layout(slots, gl.SliceLayout(1, LINES_LAYOUT)), 1)
    lines = gl.expand_dims(gl.minimum(128 * gl.arange(0, 8, layout=gl.SliceLayout(0, LINES_LAYOUT)), 655), 0)
    addr = kv_ptr + _row_bytes(slots, stride_block, stride_row, page) + lines
    gl.inline_asm_elementwise(PREFETCH_ASM, "=r,l,r", [addr, slots + 0 * lines], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _store_dequantized(k_stage, codes, scales):
    """``codes * scale`` (e4m3 in fp32, rounded once to 16 bits) into the stage's [rows, 512] latent tile, then
    wait for the rope copies and make both visible to the matrix units."""
    values = codes.to(gl.float8e4nv, bitcast=True).to(gl.float32) * gl.expand_dims(scales, 2)
    k_stage.store(gl.reshape(values.to(k_stage.dtype), [k_stage.shape[0], 512]))
    async_copy.wait_group(0)
    fence_async_shared()


@gluon.jit
def dequant_softmax_partition(q_smem, qr_smem, bufs, bars, src, scale_log2):
    """``src``: ``(kv_ptr, stride_block, stride_row, page, n_rows, idx_row_ptr, end, j0, j1)``: the cache's
    bytes and paging, the token's index list and the split's key blocks ``[j0, j1)`` (positions from ``end``
    on are not read)."""
    k_smem, kr_smem, p_smem, alpha_smem, l_smem, m_smem, mrun_smem = bufs
    kv_ptr, stride_block, stride_row, page, n_rows, idx_row_ptr, end, j0, j1 = src
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    s_layout: gl.constexpr = warpgroup_mma_layout(BLOCK_N)
    row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    pos_l: gl.constexpr = gl.SliceLayout(0, s_layout)
    m_run = gl.full([BLOCK_H], NEG, gl.float32, row_l)
    m_use = gl.full([BLOCK_H], NEG, gl.float32, row_l)
    l = gl.zeros([BLOCK_H], gl.float32, row_l)
    slots = _block_slots(idx_row_ptr, j0, end, n_rows, BLOCK_N)
    next_slots = _block_slots(idx_row_ptr, j0 + 1, end, n_rows, BLOCK_N)
    later_slots = _block_slots(idx_row_ptr, j0 + 2, end, n_rows, BLOCK_N)
    if j0 < j1:
        codes, scales = _load_codes(kv_ptr, slots, stride_block, stride_row, page)
        _copy_rope(kr_smem.index(0), kv_ptr, slots, stride_block, stride_row, page)
        _prefetch_rows(kv_ptr, next_slots, stride_block, stride_row, page)
        _store_dequantized(k_smem.index(0), codes, scales)
    for j in range(j0, j1):
        i = j - j0
        stage = i % 2
        s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
        s = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma(qr_smem, kr_smem.index(stage).permute((1, 0)), s, is_async=True)
        valid = gl.expand_dims(gl.convert_layout(slots, pos_l) >= 0, 0)
        # Block j + 1's rows travel while the matrix units compute S (past the split: nothing is read; they
        # were asked into L2 a block ago), block j + 2's are asked into L2. The rope stage is free already:
        # only S of block j - 1 read it.
        codes, scales = _load_codes(kv_ptr, next_slots, stride_block, stride_row, page)
        _copy_rope(kr_smem.index(1 - stage), kv_ptr, next_slots, stride_block, stride_row, page)
        _prefetch_rows(kv_ptr, later_slots, stride_block, stride_row, page)
        slots = next_slots
        next_slots = later_slots
        later_slots = _block_slots(idx_row_ptr, j + 3, end, n_rows, BLOCK_N)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        # Raw logits: the scale is folded into the exponent; invalid keys get NEG, then p = 0.
        s = gl.where(valid, s, NEG)
        m_run, m_use, alpha = publish_alpha(s, i, m_run, m_use, scale_log2, bufs, bars)
        p = gl.where(valid, exp2_approx(s * scale_log2 - gl.expand_dims(m_use, 1)), 0.0)
        l = l * alpha + gl.sum(p, 1)
        publish_p(p, i, bufs, bars)
        # P of block j went out, so both output warpgroups are done with block j - 1: its stage takes j + 1.
        _store_dequantized(k_smem.index(1 - stage), codes, scales)
    publish_totals(l, m_use, m_run, bufs, bars)
