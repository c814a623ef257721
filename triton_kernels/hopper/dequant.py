"""Sparse decoding over quantized caches on Hopper: warpgroups that dequantize rows into the key stages.

The matrix units take bf16, so each gathered row is dequantized into shared memory on its way in, by a
warpgroup that does nothing else: it loads a block's codes and scales into registers (its rows asked into L2 a
block earlier), waits for a free stage and writes the block in bf16 into it. The 64-head kernel has one such
warpgroup beside two that multiply, as FlashMLA's sm_90 kernel divides a program: the default one computes S,
the softmax and O's first 256 columns, the other O's last 256 (``FILL_BY_WORKER``); before, the softmax
warpgroup converted each block between its S products (run 24) and the conversion sat on its chain (run 122,
``../sparse_mla/NOTES.md``). The few-head kernel (``few_heads.py``) has two, taking turns.

Formats (``anymla.kvcache``): V3.2 FP8 (656 bytes: 512 e4m3, 4 fp32 scales a 128 columns, 64 bf16 rope
values), V4.1 FP8 (528 bytes: 512 e4m3, 16 e8m0 scales a 32 columns), V4.1 FP4 (288 bytes: 512 e2m1, 32 e4m3 scales a 16 columns) and MODEL1/V4 FP8 (per block: rows of
448 e4m3 and 64 bf16 rope values, the latent's columns [448, 512), then every row's 8 e8m0 scale bytes, 7 used, a
64 columns). An extra cache is a second source: its blocks follow the main cache's under one softmax.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ..common import FMT_MODEL1_FP8, FMT_V32_FP8, FMT_V41_FP4, FMT_V41_FP8
from .partitions import (BLOCK_H, NEG, _store_output, block_indices, exp2_approx, publish_alpha, publish_p,
                         publish_totals, warpgroup_mma_layout)

# Registers a thread of the second output warpgroup (its [64, 256] accumulator fits without spills) and of the
# dequantizing one (a block's codes, 64 a thread, with its scales and addresses); the softmax warpgroup, which
# also owns O's first 256 columns, gets the rest of the register file (224).
OUTPUT_REGS = gl.constexpr(160)
DEQUANT_REGS = gl.constexpr(128)
ROPE_AT = gl.constexpr(528)  # V3.2: byte offset of the bf16 rope values in a row
MODEL1_ROW = gl.constexpr(576)  # MODEL1: bytes of a row's data (448 codes, 64 bf16 rope values), scales apart
MODEL1_ROPE_TILE = gl.constexpr(7)  # MODEL1: the 64-column tile of the rope values (columns [448, 512))
PREFETCH_ASM = gl.constexpr("{ .reg .pred p; setp.ge.s32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }")


@gluon.constexpr_function
def _row_lanes(fmt, warps, wide):
    """Lanes of a warp over a block's rows in every layout of a format's loads (codes, L2 prefetches, rope), so
    the slots pass between them without a conversion through shared memory: 8 where the loads are ``wide``
    (``fill_stages``), else 4. FP4 takes 8 in 8-warp workers only: in 4-warp ones its 8-row layout spills past
    the budget (``../sparse_mla/NOTES.md``, "16-byte code loads")."""
    return 8 if wide and (fmt != FMT_V41_FP4.value or warps >= 8) else 4


@gluon.constexpr_function
def _codes_layout(fmt, warps, wide):
    """A block's codes as [rows, scale tiles, bytes a tile], ``_row_lanes`` rows a warp, the rows spread over
    the ``warps`` that dequantize. At 8 rows a warp, 4 lanes take a row's 64 codes (FP8: 16 bytes a thread,
    16-byte loads; FP4: its 8-byte scale tiles), so the 8 lanes of a 16-byte store phase write 64 bf16 values of
    rows r and r + 1 each, whose 128-byte swizzle rows take disjoint 16-byte columns. At 4 rows a warp, 8 bytes a
    thread: FP8, the 8 lanes of a phase write one row's 64 values, a whole swizzle row; FP4, 128 values of one
    row (2-way conflicted). Conflict counts: ``tests/test_hopper_layouts.py``. MODEL1: the tiles lie in
    registers, so which of them is the rope tile is known when compiling."""
    rows = _row_lanes(fmt, warps, wide)
    if fmt == FMT_V41_FP4.value:
        return gl.BlockedLayout([1, 1, 8], [rows, 32 // rows, 1], [warps, 1, 1], [2, 1, 0])
    tile_lanes = 2 if fmt == FMT_V41_FP8.value else 1  # V4.1's 32-byte tiles: two hold a row's 64 codes
    return gl.BlockedLayout([1, 1, 2 * rows], [rows, tile_lanes, 32 // rows // tile_lanes], [warps, 1, 1], [2, 1, 0])


@gluon.constexpr_function
def _lines_layout(fmt, warps, wide):
    """L2 prefetches of a block's rows: [rows, 8] line addresses (a row of at most 656 bytes spans at most 7
    lines of 128 bytes: offsets 0, 128, ..., and its last byte)."""
    rows = _row_lanes(fmt, warps, wide)
    return gl.BlockedLayout([1, 1], [rows, 32 // rows], [warps, 1], [1, 0])


@gluon.constexpr_function
def _rope_layout(warps, wide):
    """V3.2's rope tails [rows, 64] bf16, rows spread as its codes' are: 8 rows a warp, 32 bytes a thread (a
    store phase's 8 lanes write rows r and r + 1, disjoint 16-byte columns of their swizzle rows); 4 rows a warp,
    16 bytes a thread (a phase's 8 lanes write one row)."""
    rows = _row_lanes(FMT_V32_FP8.value, warps, wide)
    return gl.BlockedLayout([1, 2 * rows], [rows, 32 // rows], [warps, 1], [1, 0])


@gluon.constexpr_function
def _tiles(fmt):
    """(scale tiles a row, code bytes a tile, byte offset of the scales, bytes a row). MODEL1: 8 tiles of 64
    columns, the last one the rope's (its scale byte is padding); the scales sit after the block's rows."""
    return {FMT_V32_FP8.value: (4, 128, 512, 656), FMT_V41_FP8.value: (16, 32, 512, 528),
            FMT_V41_FP4.value: (32, 8, 256, 288), FMT_MODEL1_FP8.value: (8, 64, None, 576)}[fmt]


@gluon.constexpr_function
def _slots_layout(fmt, warps, wide):
    """A block's slots [rows], spread as the rows of its codes are."""
    return gl.SliceLayout(1, gl.SliceLayout(2, _codes_layout(fmt, warps, wide)))


@gluon.jit
def _row_bytes(slots, stride_block, stride_row, page):
    """Byte offsets of the slots' rows (``slot // page`` is the block, for any block stride)."""
    s = gl.maximum(slots, 0)
    return (s // page).to(gl.int64) * stride_block + (s % page).to(gl.int64) * stride_row


@gluon.jit
def _model1_row_bytes(slots, stride_block, page):
    """MODEL1: byte offsets of the slots' data rows (576 bytes apart from the block's start) and of their scale
    bytes (8 a row, after all of the block's rows)."""
    s = gl.maximum(slots, 0)
    block = (s // page).to(gl.int64) * stride_block
    row = (s % page).to(gl.int64)
    return block + row * MODEL1_ROW, block + page * MODEL1_ROW + row * 8


@gluon.jit
def _load_codes(kv_ptr, slots, stride_block, stride_row, page, FMT: gl.constexpr, WIDE: gl.constexpr):
    """Issue the loads of a block's codes ``[rows, tiles, bytes]`` (uint8) and its scales ``[rows, tiles]``
    (fp32 for V3.2, their bytes otherwise; MODEL1: ``_load_model1``'s scale words and rope values); rows of
    slot -1 read nothing and come out as zeros."""
    if FMT == FMT_MODEL1_FP8:
        codes, scales = _load_model1(kv_ptr, slots, stride_block, page, WIDE)
    else:
        layout: gl.constexpr = _codes_layout(FMT, gl.num_warps(), WIDE)
        n_tiles: gl.constexpr = _tiles(FMT)[0]
        tile_bytes: gl.constexpr = _tiles(FMT)[1]
        scales_at: gl.constexpr = _tiles(FMT)[2]
        scales_l: gl.constexpr = gl.SliceLayout(2, layout)
        base = gl.expand_dims(_row_bytes(slots, stride_block, stride_row, page), 1)
        tiles = gl.expand_dims(gl.arange(0, n_tiles, layout=gl.SliceLayout(0, scales_l)), 0)
        ok = gl.expand_dims(slots >= 0, 1) & (tiles >= 0)
        if FMT == FMT_V32_FP8:
            scales = gl.load((kv_ptr + base + scales_at + 4 * tiles).to(gl.pointer_type(gl.float32)), mask=ok,
                             other=0.0)
        else:
            scales = gl.load(kv_ptr + base + scales_at + tiles, mask=ok, other=0)
        cols = gl.expand_dims(gl.expand_dims(gl.arange(0, tile_bytes,
                                                       layout=gl.SliceLayout(0, gl.SliceLayout(1, layout))), 0), 1)
        codes = gl.load(kv_ptr + gl.expand_dims(base + tile_bytes * tiles, 2) + cols,
                        mask=gl.expand_dims(ok, 2) & (cols >= 0), other=0)
    return codes, scales


@gluon.jit
def _load_model1(kv_ptr, slots, stride_block, page, WIDE: gl.constexpr):
    """MODEL1: a block's codes ``[rows, 8, 64]`` (the rope tile, 7, reads nothing) and, as its scales, each
    row's 8 scale bytes as one 64-bit word ``[rows]`` with its bf16 rope values ``[rows, 1, 64]`` (in the codes'
    layout)."""
    layout: gl.constexpr = _codes_layout(FMT_MODEL1_FP8, gl.num_warps(), WIDE)
    data, scales_at = _model1_row_bytes(slots, stride_block, page)
    valid = slots >= 0
    words = gl.load((kv_ptr + scales_at).to(gl.pointer_type(gl.uint64)), mask=valid, other=0)
    base = gl.expand_dims(gl.expand_dims(data, 1), 2)
    tiles = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout))), 0), 2)
    cols = gl.expand_dims(gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout))), 0), 1)
    ok = gl.expand_dims(gl.expand_dims(valid, 1), 2)
    codes = gl.load(kv_ptr + base + 64 * tiles + cols, mask=ok & (tiles < MODEL1_ROPE_TILE), other=0)
    rope = gl.load((kv_ptr + base + 64 * MODEL1_ROPE_TILE).to(gl.pointer_type(gl.bfloat16)) + cols,
                   mask=ok & (cols >= 0), other=0.0)
    return codes, (words, rope)


@gluon.jit
def _e2m1(code):
    """4-bit e2m1 codes (in uint8) -> fp32: placed as fp16 bits, then a 2^14 bias correction."""
    c = code.to(gl.uint16)
    return (((c & 8) << 12) | ((c & 7) << 9)).to(gl.float16, bitcast=True).to(gl.float32) * 16384.0


@gluon.jit
def dequantized(codes, scales, FMT: gl.constexpr, dtype: gl.constexpr):
    """A block's ``[rows, 512]`` latent values, ``code * scale`` in fp32 rounded once to ``dtype`` (MODEL1: with
    the rope values as columns [448, 512)), from ``_load_codes``' codes and scales, in the layout they are
    stored from (``store_conflicts.py`` counts that store's bank conflicts)."""
    if FMT == FMT_V32_FP8:
        s = scales
    elif FMT == FMT_V41_FP8:
        s = (scales.to(gl.int32) << 23).to(gl.float32, bitcast=True)  # e8m0
    elif FMT == FMT_MODEL1_FP8:
        words, rope = scales
        s = _model1_scales(words)
    else:
        s = scales.to(gl.float8e4nv, bitcast=True).to(gl.float32)
    if FMT == FMT_MODEL1_FP8:
        # Tiles lie in registers, so the rope tile's select is decided when compiling: its conversions vanish.
        tiles_l: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, codes.type.layout))
        tiles = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=tiles_l), 0), 2)
        values = (codes.to(gl.float8e4nv, bitcast=True).to(gl.float32) * gl.expand_dims(s, 2)).to(dtype)
        values = gl.where(tiles == MODEL1_ROPE_TILE, rope, values)
    elif FMT == FMT_V41_FP4:
        # element 2i sits in the low nibble of byte i
        values = gl.join(_e2m1(codes & 0xF) * gl.expand_dims(s, 2), _e2m1(codes >> 4) * gl.expand_dims(s, 2))
    else:
        values = codes.to(gl.float8e4nv, bitcast=True).to(gl.float32) * gl.expand_dims(s, 2)
    return gl.reshape(values.to(dtype), [codes.shape[0], 512])


@gluon.jit
def _store_dequantized(k_stage, codes, scales, FMT: gl.constexpr):
    """``dequantized`` into the stage's [rows, 512] latent tile, made visible to the matrix units. (No copy is
    in flight: the ``wait_group`` keeps ptxas from moving the next block's loads above these stores, which
    spilled in the few-head workers, 8-92 B a thread on Triton 3.6 without it.)"""
    k_stage.store(dequantized(codes, scales, FMT, k_stage.dtype))
    async_copy.wait_group(0)
    fence_async_shared()


@gluon.jit
def _model1_scales(words):
    """MODEL1: the e8m0 scales ``[rows, 8]`` (fp32) of the rows' scale words (byte t scales tile t), in the
    layout of the codes whose rows the words' layout slices (``_slots_layout``)."""
    scales_l: gl.constexpr = words.type.layout.parent
    shifts = gl.arange(0, 8, layout=gl.SliceLayout(0, scales_l)).to(gl.uint64) * 8
    e8m0 = (gl.expand_dims(words, 1) >> gl.expand_dims(shifts, 0)) & 0xFF
    return (e8m0.to(gl.int32) << 23).to(gl.float32, bitcast=True)


@gluon.jit
def _rope_pointers(kv_ptr, slots, stride_block, stride_row, page, WIDE: gl.constexpr):
    """V3.2: the addresses ``[rows, 64]`` (bf16, ``_rope_layout``) of a block's rope tails and
    which of them to read (not those of slot -1)."""
    layout: gl.constexpr = _rope_layout(gl.num_warps(), WIDE)
    slots = gl.convert_layout(slots, gl.SliceLayout(1, layout))
    base = gl.expand_dims(_row_bytes(slots, stride_block, stride_row, page) + ROPE_AT, 1)
    cols = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, layout)), 0)
    return (kv_ptr + base).to(gl.pointer_type(gl.bfloat16)) + cols, gl.expand_dims(slots >= 0, 1) & (cols >= 0)


@gluon.jit
def _prefetch_rows(kv_ptr, slots, stride_block, stride_row, page, FMT: gl.constexpr, WIDE: gl.constexpr):
    """Ask L2 for the rows of a later block (no registers held until they arrive): the loads that dequantize
    the block then wait for L2, not for memory. Slot -1 asks for nothing. MODEL1: the eighth line a row is
    that of its scales (its 576 bytes span at most 6 lines)."""
    row_bytes: gl.constexpr = _tiles(FMT)[3]
    layout: gl.constexpr = _lines_layout(FMT, gl.num_warps(), WIDE)
    slots = gl.expand_dims(gl.convert_layout(slots, gl.SliceLayout(1, layout)), 1)
    lines = gl.expand_dims(gl.minimum(128 * gl.arange(0, 8, layout=gl.SliceLayout(0, layout)), row_bytes - 1), 0)
    if FMT == FMT_MODEL1_FP8:
        data, scales_at = _model1_row_bytes(slots, stride_block, page)
        last = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, layout)), 0) == 7
        addr = kv_ptr + gl.where(last, scales_at, data + lines)
    else:
        addr = kv_ptr + _row_bytes(slots, stride_block, stride_row, page) + lines
    gl.inline_asm_elementwise(PREFETCH_ASM, "=r,l,r", [addr, slots + 0 * lines], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _block_source(first, second, n_first, k):
    """Where a call's ``k``-th key block lies: ``(kv_ptr, stride_block, stride_row, page, n_rows, idx_row_ptr,
    end, j)``, block ``j`` of ``first``'s index list while ``k < n_first``, then of ``second``'s. Past both
    ranges ``j`` is past ``second``'s, whose positions are never read."""
    if k < n_first:
        kv_ptr, stride_block, stride_row, page, n_rows, idx_row_ptr, end, j0, j1 = first
        j = j0 + k
    else:
        kv_ptr, stride_block, stride_row, page, n_rows, idx_row_ptr, end, j0, j1 = second
        j = j0 + k - n_first
    return kv_ptr, stride_block, stride_row, page, n_rows, idx_row_ptr, end, j


@gluon.jit
def _slots_at(first, second, n_first, k, BLOCK_N: gl.constexpr, LAYOUT: gl.constexpr):
    """The slots of a call's ``k``-th key block (``block_indices``; -1 past both ranges)."""
    kv_ptr, stride_block, stride_row, page, n_rows, idx_row_ptr, end, j = _block_source(first, second, n_first, k)
    return block_indices(idx_row_ptr, j, end, n_rows, BLOCK_N, LAYOUT)


@gluon.jit
def _prefetch_block(first, second, n_first, k, slots, FMT: gl.constexpr, WIDE: gl.constexpr):
    """Ask L2 for a call's ``k``-th key block (``_prefetch_rows``)."""
    kv_ptr, stride_block, stride_row, page, n_rows, idx_row_ptr, end, j = _block_source(first, second, n_first, k)
    _prefetch_rows(kv_ptr, slots, stride_block, stride_row, page, FMT, WIDE)


@gluon.jit
def _alone(src):
    """``src`` with an empty block range: the second source of a walk over one source only."""
    kv_ptr, stride_block, stride_row, page, n_rows, idx_row_ptr, end, j0, j1 = src
    return kv_ptr, stride_block, stride_row, page, n_rows, idx_row_ptr, end, j1, j1


@gluon.jit
def second_source(main, extra, HAS_X: gl.constexpr):
    """The source a walk over a program's key blocks takes after ``main``: the extra cache, or none."""
    if HAS_X:
        second = extra
    else:
        second = _alone(main)
    return second


@gluon.jit
def block_counts(first, second):
    """``(n_first, n)``: the key blocks of ``first`` and of both sources, a walk's ``k`` running over ``[0, n)``."""
    n_first = gl.maximum(first[8] - first[7], 0)
    return n_first, n_first + gl.maximum(second[8] - second[7], 0)


@gluon.jit
def fill_stages(k_smem, kr_smem, ready, empty, first, second, i0, W: gl.constexpr, NW: gl.constexpr,
                FMT: gl.constexpr, WIDE: gl.constexpr):
    """A dequantizing warpgroup over ``first``'s key blocks, then ``second``'s (two caches of one format), in one
    loop: of the program's blocks ``i = i0 + k`` (``k`` counting both sources' blocks; stage ``i % 2``) those
    equal to ``W`` modulo ``NW`` (``NW`` warpgroups take turns). Each block's codes and scales go into registers
    and the rows of this warpgroup's next block are asked into L2; once the stage is free the block goes into it
    in bf16. ``WIDE``: the codes load 16 bytes a thread (``_codes_layout``). Returns the program block number
    after both sources."""
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    slots_l: gl.constexpr = _slots_layout(FMT, gl.num_warps(), WIDE)
    n_first, n = block_counts(first, second)
    k0 = (W + NW - i0 % NW) % NW
    slots = _slots_at(first, second, n_first, k0, BLOCK_N, slots_l)
    next_slots = _slots_at(first, second, n_first, k0 + NW, BLOCK_N, slots_l)
    for k in range(k0, n, NW):
        i = i0 + k
        if NW == 2:
            stage = W
        else:
            stage = i % 2
        kv_ptr, stride_block, stride_row, page, n_rows, idx_row_ptr, end, j = _block_source(first, second, n_first, k)
        codes, scales = _load_codes(kv_ptr, slots, stride_block, stride_row, page, FMT, WIDE)
        if FMT == FMT_V32_FP8:
            rope_at, rope_ok = _rope_pointers(kv_ptr, slots, stride_block, stride_row, page, WIDE)
            rope = gl.load(rope_at, mask=rope_ok, other=0.0)
        # This warpgroup's next block's rows into L2 (its indices came an iteration ago: nothing waits for them);
        # the indices of the one after travel meanwhile.
        _prefetch_block(first, second, n_first, k + NW, next_slots, FMT, WIDE)
        slots = next_slots
        next_slots = _slots_at(first, second, n_first, k + 2 * NW, BLOCK_N, slots_l)
        mbarrier.wait(empty.index(stage), ((i // 2) & 1) ^ 1)
        if FMT == FMT_V32_FP8:
            kr_smem.index(stage).store(rope)
        _store_dequantized(k_smem.index(stage), codes, scales, FMT)
        mbarrier.arrive(ready.index(stage), count=1)
    return i0 + n


@gluon.jit
def fill_sources(k_smem, kr_smem, ready, empty, main, extra, W: gl.constexpr, NW: gl.constexpr, FMT: gl.constexpr,
                 X_FMT: gl.constexpr, HAS_X: gl.constexpr, WIDE: gl.constexpr):
    """``fill_stages`` over a program's main and extra caches: one loop where they share a format, else two."""
    if HAS_X and X_FMT == FMT:
        fill_stages(k_smem, kr_smem, ready, empty, main, extra, 0, W, NW, FMT, WIDE)
    else:
        i = fill_stages(k_smem, kr_smem, ready, empty, main, _alone(main), 0, W, NW, FMT, WIDE)
        if HAS_X:
            fill_stages(k_smem, kr_smem, ready, empty, extra, _alone(extra), i, W, NW, X_FMT, WIDE)


@gluon.jit
def dequant_partition(bufs, bars, main, extra, FMT: gl.constexpr, X_FMT: gl.constexpr, HAS_X: gl.constexpr):
    """The 64-head kernel's dequantizing warpgroup: every key block of the program into the two stages."""
    k_smem, kr_smem, p_smem, alpha_smem, l_smem, m_smem, mrun_smem = bufs
    kv_ready, kv_empty, alpha_ready, p_ready, p_empty, done = bars
    # 16-byte code loads: within the spill budgets here, and V4.1 + FP4 15 % faster with them (run 138)
    fill_sources(k_smem, kr_smem, kv_ready, kv_empty, main, extra, 0, 1, FMT, X_FMT, HAS_X, True)


@gluon.jit
def softmax_output_partition(q_smem, qr_smem, bufs, bars, main, extra, scale_log2, out_args, D_QK: gl.constexpr,
                             HAS_X: gl.constexpr, SPLIT: gl.constexpr, HAS_SINK: gl.constexpr):
    """The 64-head kernel's default warpgroup, over both sources' key blocks in one loop (a block's source only
    decides which keys are valid): S = q·kᵀ, the online softmax, the rescale factors and P published to the
    other output warpgroup, then its own columns [0, 256) of O (``acc * alpha + P·V``); it frees a stage with the
    other output warpgroup once both products are done, and writes its columns, lse and max_logits.

    ``main``, ``extra``: ``(kv_ptr, stride_block, stride_row, page, n_rows, idx_row_ptr, end, j0, j1)``: a cache's
    bytes and paging, the token's index list into it and the split's key blocks ``[j0, j1)`` of that list
    (positions from ``end`` on are not read)."""
    k_smem, kr_smem, p_smem, alpha_smem, l_smem, m_smem, mrun_smem = bufs
    kv_ready, kv_empty, alpha_ready, p_ready, p_empty, done = bars
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    s_layout: gl.constexpr = warpgroup_mma_layout(BLOCK_N)
    o_layout: gl.constexpr = warpgroup_mma_layout(256)
    row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_row_l: gl.constexpr = gl.SliceLayout(1, o_layout)
    pos_l: gl.constexpr = gl.SliceLayout(0, s_layout)
    second = second_source(main, extra, HAS_X)
    n_first, n = block_counts(main, second)
    m_run = gl.full([BLOCK_H], NEG, gl.float32, row_l)
    m_use = gl.full([BLOCK_H], NEG, gl.float32, row_l)
    l = gl.zeros([BLOCK_H], gl.float32, row_l)
    acc = gl.zeros([BLOCK_H, 256], gl.float32, o_layout)
    for i in range(0, n):
        stage = i % 2
        mbarrier.wait(kv_ready.index(stage), (i // 2) & 1)
        # The block's indices (the dequantizing warpgroup read them: from L1 or L2) travel while S is computed;
        # fetched a block ahead they would hold 16 more registers a thread through the loop.
        slots = _slots_at(main, second, n_first, i, BLOCK_N, pos_l)
        s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, s_layout)
        s = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s, use_acc=False, is_async=True)
        if D_QK == 576:
            s = warpgroup_mma(qr_smem, kr_smem.index(stage).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        # Raw logits: the scale is folded into the exponent; invalid keys get NEG, then p = 0.
        valid = gl.expand_dims(slots >= 0, 0)
        s = gl.where(valid, s, NEG)
        m_run, m_use, alpha = publish_alpha(s, i, m_run, m_use, scale_log2, bufs, bars)
        p = gl.where(valid, exp2_approx(s * scale_log2 - gl.expand_dims(m_use, 1)), 0.0)
        l = l * alpha + gl.sum(p, 1)
        publish_p(p, i, bufs, bars)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, o_row_l), 1)
        acc = warpgroup_mma(p_smem, k_smem.index(stage).slice(0, 256, dim=1), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(kv_empty.index(stage), count=1)
    publish_totals(l, m_use, m_run, bufs, bars)
    _store_output(acc, gl.convert_layout(l, o_row_l), gl.convert_layout(m_use, o_row_l),
                  gl.convert_layout(m_run, o_row_l), out_args, False, SPLIT, HAS_SINK, 0)
