"""Sparse decoding (``flash_mla_with_kvcache`` with indices) over a V3.2 FP8 paged cache on ``mma.sync``
(``mma_v2``), in Gluon.

Program ``(token * head_blocks + head_block, split)``: 64 query heads of one decoding token, 8 warps, over one
split's blocks of BLOCK_N of the token's slots. A V3.2 row (656 bytes, ``anymla.kvcache``) is 512 e4m3 codes,
4 fp32 scales (one a 128 columns) at byte 512 and 64 bf16 rope values at byte 528. A block's codes and scales
are loaded into registers (16-byte loads) a block before they are dequantized (code x scale in fp32, rounded
once to bf16, as the reference does) into a latent tile; its rope values are copied by ``cp.async`` into one of
two rope tiles, also a block ahead; the block is attended with ``mma.attend_block`` (the prefill kernel's
layouts and softmax). With two latent tiles (LATENT_TILES 2) block j + 1 is dequantized into one right after
block j's P·V from the other, with no barrier between them: a warp done with its products converts while others
still multiply, and the barrier that waited for the dequantized tile goes. With one (a choice for measurements,
and the 99 KB GPUs' 16-key tile, where a second does not fit) a block is dequantized before it is attended. Even
blocks take the "a" tiles, odd ones the "b" tiles: separate allocations, so the compiler's barrier pass sees that
one is written while the other is read, and the loop goes two blocks an iteration.
Slots -1, outside the cache or past ``topk_length`` read nothing (zeros, masked keys).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from ..common import e4m3_to_f32, e4m3x2_to_f16x2, e4m3x4_has_nan
from ..hopper.dequant import ROPE_AT, _row_bytes
from ..hopper.partitions import _store_output, block_indices
from .mma import (BLOCK_H, attend_block, barrier, initial_state, key_mask, operand_smem, program_token, row_sums,
                  stage_queries)

SCALES_AT = gl.constexpr(512)  # byte offset of a row's 4 fp32 scales


@gluon.constexpr_function
def codes_layout(block_n):
    """A block's codes as int32 words ``[BLOCK_N, 4 scale tiles, 32 words]`` (4 codes a word, carried across the
    loop: uint8 codes would take a register each), 16 bytes a thread. A warp covers 8 rows x 16 words of a tile:
    in the dequantized bf16 stores, the 8 lanes of a 16-byte phase write 4 pieces of 2 rows, which the swizzle
    spreads over 8 bank groups. The warps go down the rows first, then across the tiles."""
    warp_rows = min(8, block_n // 8)
    return gl.BlockedLayout([1, 1, 4], [8, 1, 4], [warp_rows, 8 // warp_rows, 1], [2, 1, 0])


@gluon.constexpr_function
def rope_layout(block_n):
    """The rope copies ``[BLOCK_N, 64]`` bf16, 16 bytes a thread, rows spread as the codes' are (the slots go
    from one layout to the other without moving)."""
    warp_rows = min(8, block_n // 8)
    return gl.BlockedLayout([1, 8], [8, 4], [warp_rows, 8 // warp_rows], [1, 0])


@gluon.constexpr_function
def slots_layout(block_n):
    return gl.SliceLayout(1, gl.SliceLayout(2, codes_layout(block_n)))


@gluon.jit
def _load_codes(kv_ptr, slots, kv_sb, kv_sr, page, BLOCK_N: gl.constexpr):
    """Issue the loads of a block's codes (``codes_layout`` words) and scales ``[BLOCK_N, 4]`` fp32; rows of
    slot -1 read nothing and come out as zeros."""
    layout: gl.constexpr = codes_layout(BLOCK_N)
    scales_l: gl.constexpr = gl.SliceLayout(2, layout)
    base = gl.expand_dims(_row_bytes(slots, kv_sb, kv_sr, page), 1)
    tiles = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, scales_l)), 0)
    ok = gl.expand_dims(slots >= 0, 1) & (tiles >= 0)
    scales = gl.load((kv_ptr + base + SCALES_AT).to(gl.pointer_type(gl.float32)) + tiles, mask=ok, other=0.0)
    words = gl.expand_dims(gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout))), 0), 1)
    tile_words = gl.expand_dims((kv_ptr + base).to(gl.pointer_type(gl.int32)) + 32 * tiles, 2)
    codes = gl.load(tile_words + words, mask=gl.expand_dims(ok, 2) & (words >= 0), other=0)
    return codes, scales


@gluon.jit
def _copy_rope(r_tile, kv_ptr, slots, kv_sb, kv_sr, page):
    """``cp.async`` a block's rope values into ``r_tile`` [BLOCK_N, 64] (slot -1: zeros, nothing read), committed
    as a group of their own."""
    layout: gl.constexpr = rope_layout(r_tile.shape[0])
    slots = gl.convert_layout(slots, gl.SliceLayout(1, layout))
    at = gl.expand_dims(_row_bytes(slots, kv_sb, kv_sr, page) + ROPE_AT, 1)
    cols = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, layout)), 0)
    async_copy.async_copy_global_to_shared(r_tile, (kv_ptr + at).to(gl.pointer_type(gl.bfloat16)) + cols,
                                           mask=gl.expand_dims(slots >= 0, 1) & (cols >= 0))
    async_copy.commit_group()


@gluon.jit
def _spread(x):
    """``[rows, 4, 32]`` values of each word's byte k (``x`` a 4-tuple) as ``[rows, 512]`` columns (byte k of
    word w of tile t is column 128 t + 4 w + k); no data moves, only the registers' order."""
    v = gl.join(gl.join(x[0], x[2]), gl.join(x[1], x[3]))
    return gl.reshape(v, [v.shape[0], 512])


@gluon.jit
def _f16_half(h, SHIFT: gl.constexpr):
    """The fp16 value in bits ``[SHIFT, SHIFT + 16)`` of uint32 ``h``, as fp32."""
    return ((h >> SHIFT) & 0xFFFF).to(gl.uint16).to(gl.float16, bitcast=True).to(gl.float32)


@gluon.jit
def _store_dequantized(k_tile, codes, scales, NATIVE_FP8: gl.constexpr):
    """``code x scale`` in fp32, rounded once to 16 bits, into the latent tile [BLOCK_N, 512]. With fp8
    conversions (sm_89+) Triton's; without (sm_80/86) ``e4m3x2_to_f16x2``, two codes an operation, its 2^-8
    folded into the scale, and a word holding a NaN code scaled by NaN: its 4 values come out NaN, not only
    the code's (a NaN anywhere in a row makes its logit NaN, so out and lse come out NaN as the reference's)."""
    s = gl.broadcast(gl.expand_dims(scales, 2), codes)[0]  # a scale a word
    if NATIVE_FP8:
        # Codes in column order first: the conversion then takes each word's codes in pairs as they lie.
        b = _spread((codes & 0xFF, (codes >> 8) & 0xFF, (codes >> 16) & 0xFF, (codes >> 24) & 0xFF)).to(gl.uint8)
        v = e4m3_to_f32(b, True) * _spread((s, s, s, s))
    else:
        w = codes.to(gl.uint32, bitcast=True)
        even = e4m3x2_to_f16x2((w << 8) & 0xFF00FF00)  # codes 0 and 2 of each word
        odd = e4m3x2_to_f16x2(w & 0xFF00FF00)  # codes 1 and 3
        s = gl.where(e4m3x4_has_nan(w), float("nan"), s * 256.0)
        v = _spread((_f16_half(even, 0) * s, _f16_half(odd, 0) * s, _f16_half(even, 16) * s,
                     _f16_half(odd, 16) * s))
    k_tile.store(v.to(k_tile.dtype))


@gluon.jit
def _decode_step(j, q_smem, qr_smem, k_now, k_next, r_now, r_next, p_smem, kv_ptr, kv_sb, kv_sr, page,
                 idx_row_ptr, n_rows, end, scale_log2, codes, scales, slots_a, slots_b, state,
                 NATIVE_FP8: gl.constexpr, BLOCK_N: gl.constexpr, LATENT_TILES: gl.constexpr, K_STEP: gl.constexpr):
    """Key block ``j``: its rope values in ``r_now`` (copies in flight), its latent values in ``k_now``: already
    written with two latent tiles (``k_next`` is the other), still in ``codes`` with one (``k_next`` is
    ``k_now``). ``slots_a`` / ``slots_b``: blocks j + 1 and j + 2. With two tiles ``codes`` hold block j + 1,
    dequantized into ``k_next`` after block j's P·V. Returns the carried ``(codes, scales, slots_a, slots_b,
    state)`` for block j + 1."""
    m_run, m_use, l_part, acc = state
    valid = key_mask(idx_row_ptr, j, end, n_rows, BLOCK_N)
    async_copy.wait_group(0)  # block j's rope values (and at the first block the queries)
    # ... have landed for every warp, k_now is written, and every warp is done with block j - 1 (k_next, r_next
    # and P's buffer).
    barrier()
    _copy_rope(r_next, kv_ptr, slots_a, kv_sb, kv_sr, page)
    if LATENT_TILES == 1:
        _store_dequantized(k_now, codes, scales, NATIVE_FP8)
        # Block j + 1's codes into the registers just freed: they travel while block j is multiplied.
        codes, scales = _load_codes(kv_ptr, slots_a, kv_sb, kv_sr, page, BLOCK_N)
        barrier()  # the latent tile is written
    m_run, m_use, l_part, acc = attend_block(q_smem, qr_smem, k_now, r_now, p_smem, valid, scale_log2, m_run,
                                             m_use, l_part, acc, 576, K_STEP,
                                             ONE_BARRIER_MAX=False)
    if LATENT_TILES == 2:
        # One store of the whole block: Triton 3.6's barrier pass takes stores to slices of one tile for
        # overlapping writes and puts a barrier between them (NOTES.md, run 126).
        _store_dequantized(k_next, codes, scales, NATIVE_FP8)
        # Block j + 2's codes: they travel while block j + 1 is multiplied.
        codes, scales = _load_codes(kv_ptr, slots_b, kv_sb, kv_sr, page, BLOCK_N)
    # The slots of block j + 3, asked for a block before their loads need them.
    slots_c = block_indices(idx_row_ptr, j + 3, end, n_rows, BLOCK_N, slots_layout(BLOCK_N))
    return codes, scales, slots_b, slots_c, (m_run, m_use, l_part, acc)


@gluon.jit(do_not_specialize=["num_splits"])
def sparse_decode_mma_v2_kernel(
        q_ptr, sq_t, sq_h, kv_ptr, kv_sb, kv_sr, page, n_rows, idx_ptr, si_t, topk, len_ptr, len_div, sink_ptr,
        out_ptr, so_t, so_h, lse_ptr, sl_t, po_ptr, plse_ptr, h_q, hb_per_token, num_splits, scale_log2,
        HAS_LEN: gl.constexpr, HAS_SINK: gl.constexpr, SPLIT: gl.constexpr, NATIVE_FP8: gl.constexpr,
        BLOCK_N: gl.constexpr, LATENT_TILES: gl.constexpr, K_STEP: gl.constexpr):
    """q [tokens, h_q, 576]; the cache's bytes ``kv_ptr`` (block stride ``kv_sb``, row stride ``kv_sr``, ``page``
    rows a block, ``n_rows`` slots); indices [tokens, topk]; ``topk_length[t // len_div]``. Writes out [tokens,
    h_q, 512] and lse [tokens, h_q] (natural log), or with SPLIT the partials ``splits.Workspaces`` holds."""
    t, r0, length = program_token(hb_per_token, topk, len_ptr, len_div, HAS_LEN)
    split = gl.program_id(1)
    n_blocks = gl.cdiv(length, BLOCK_N)
    per_split = gl.cdiv(n_blocks, num_splits)
    j0 = split * per_split
    j1 = gl.minimum(j0 + per_split, n_blocks)
    end = gl.minimum(length, j1 * BLOCK_N)  # keys past the split read nothing (the last prefetch's)
    idx_row_ptr = idx_ptr + t.to(gl.int64) * si_t

    dtype: gl.constexpr = q_ptr.dtype.element_ty
    q_smem, qr_smem = stage_queries(q_ptr, t, sq_t, sq_h, r0, h_q, 576)
    # Even blocks in the "a" tiles, odd ones in the "b" tiles (separate allocations, so the compiler's barrier
    # pass sees that one is written while the other is read).
    k_a = gl.allocate_shared_memory(dtype, [BLOCK_N, 512], operand_smem(512))
    k_b = k_a
    if LATENT_TILES == 2:
        k_b = gl.allocate_shared_memory(dtype, [BLOCK_N, 512], operand_smem(512))
    r_a = gl.allocate_shared_memory(dtype, [BLOCK_N, 64], operand_smem(64))
    r_b = gl.allocate_shared_memory(dtype, [BLOCK_N, 64], operand_smem(64))
    p_smem = gl.allocate_shared_memory(dtype, [BLOCK_H, BLOCK_N], operand_smem(BLOCK_N))

    slots_l: gl.constexpr = slots_layout(BLOCK_N)
    slots = block_indices(idx_row_ptr, j0, end, n_rows, BLOCK_N, slots_l)
    codes, scales = _load_codes(kv_ptr, slots, kv_sb, kv_sr, page, BLOCK_N)
    _copy_rope(r_a, kv_ptr, slots, kv_sb, kv_sr, page)
    slots_a = block_indices(idx_row_ptr, j0 + 1, end, n_rows, BLOCK_N, slots_l)
    slots_b = block_indices(idx_row_ptr, j0 + 2, end, n_rows, BLOCK_N, slots_l)
    if LATENT_TILES == 2:
        _store_dequantized(k_a, codes, scales, NATIVE_FP8)
        codes, scales = _load_codes(kv_ptr, slots_a, kv_sb, kv_sr, page, BLOCK_N)
    state = initial_state(BLOCK_N)
    for j in range(j0, j1, 2):
        codes, scales, slots_a, slots_b, state = _decode_step(
            j, q_smem, qr_smem, k_a, k_b, r_a, r_b, p_smem, kv_ptr, kv_sb, kv_sr, page, idx_row_ptr, n_rows, end,
            scale_log2, codes, scales, slots_a, slots_b, state, NATIVE_FP8, BLOCK_N, LATENT_TILES, K_STEP)
        if j + 1 < j1:
            codes, scales, slots_a, slots_b, state = _decode_step(
                j + 1, q_smem, qr_smem, k_b, k_a, r_b, r_a, p_smem, kv_ptr, kv_sb, kv_sr, page, idx_row_ptr, n_rows,
                end, scale_log2, codes, scales, slots_a, slots_b, state, NATIVE_FP8, BLOCK_N, LATENT_TILES, K_STEP)
    async_copy.wait_group(0)
    m_run, m_use, l_part, acc = state
    l = row_sums(l_part)
    # The dense epilogue's arguments with one query a program (rows = heads): partials [tokens, splits, h_q].
    out_args = (h_q, out_ptr, so_t, 0, so_h, lse_ptr, sl_t, 0, 1, po_ptr, plse_ptr, sink_ptr,
                t, r0, 1, h_q, h_q, num_splits, split)
    _store_output(acc, l, m_use, m_run, out_args, False, SPLIT, HAS_SINK, 0)
