"""Triton kernels of DeepSeek V4's attention prolog and its heads' RoPE (``anymla.layers.V4Attention``).

V4's rows are 512 wide with the rope in the trailing 64 channels (interleaved pairs), its RMSNorms weigh the
fp32 normalized value by an fp32 weight before the one cast back (the q heads' norm has no weight and
multiplies the activation by the factor rounded to its dtype), and its cache formats are bf16 512, MODEL1 /
V4 FP8 584 B, V4.1 FP8 528 B and V4.1 FP4 288 B. Each kernel rounds where the model code does, so its values
are the torch ops' of :mod:`anymla.layers.v4` and its cache bytes those of the writer on those values.
"""

import triton
import triton.language as tl

from .kernel import (FMT_BF16, FMT_MODEL1_FP8, FMT_V41_FP4, FMT_V41_FP8, bf16_bits, in_table, inv_rms, inv_rms_of,
                     rope_pairs, round_to, slot_addresses, store_bytes_le, store_fp4_values, store_fp8_tiles,
                     table_slots)

ROPE_PAIRS = tl.constexpr(32)   # the trailing 64 channels: 32 rotated pairs
FIRST_ROPE_PAIR = tl.constexpr(224)  # of the 256 pairs of a 512-wide row


@triton.jit
def _rotated_tail(a, b, pos, cos_ptr, sin_ptr, table_stride, n_positions, live):
    """The pairs ``(a, b) [R, 256]`` (fp32; pair p = channels 2p, 2p + 1 of R rows at positions ``pos [R]``,
    or of rows all at ``pos [1]``; ``live`` of pos's shape) with the trailing 32 rotated by their angles, the
    rest as they are."""
    p = tl.arange(0, 256)
    roped = p >= FIRST_ROPE_PAIR
    at = pos.to(tl.int64)[:, None] * table_stride + (p - FIRST_ROPE_PAIR)[None, :]
    m = (live & in_table(pos, n_positions))[:, None] & roped[None, :]
    ra, rb = rope_pairs(a, b, tl.load(cos_ptr + at, mask=m, other=0.0), tl.load(sin_ptr + at, mask=m, other=0.0))
    return tl.where(roped[None, :], ra, a), tl.where(roped[None, :], rb, b)


@triton.jit
def v4_prolog_kernel(kv_ptr, kv_stride, kv_w_ptr, eps, q_ptr, q_stride, q_w_ptr, q_out_ptr, q_out_stride,
                     pos_ptr, cos_ptr, sin_ptr, table_stride, n_positions, bt_ptr, bt_s_b, bt_s_k, tokens_per_req,
                     max_blocks,
                     cache_ptr, n_tokens, capacity, page_size, block_stride, token_stride,
                     FMT: tl.constexpr, Q_RANK: tl.constexpr, Q_BLOCK: tl.constexpr, NATIVE_FP8: tl.constexpr,
                     BLOCK_T: tl.constexpr):
    """V4's prolog for BLOCK_T tokens: the kv row ``kv [T, 512]`` RMS-normed (fp32 weight ``kv_w``), its
    trailing 64 channels rotated at the token's position, written into the cache at the block table's slot of
    that position (token t of request ``t // tokens_per_req``; none past the table); and the q latent
    ``q [T, Q_RANK]`` RMS-normed (fp32 weight ``q_w``) into ``q_out``."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = tok < n_tokens
    tok64 = tok.to(tl.int64)
    OUT_TY: tl.constexpr = kv_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + tok, mask=live, other=0)
    j = tl.arange(0, 512)
    x = tl.load(kv_ptr + tok64[:, None] * kv_stride + j[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    w = tl.load(kv_w_ptr + j).to(tl.float32)
    row = round_to(w[None, :] * (x * inv_rms(x, eps, 512)[:, None]), OUT_TY).to(tl.float32)
    a, b = tl.split(tl.reshape(row, (BLOCK_T, 256, 2)))
    a, b = _rotated_tail(a, b, pos, cos_ptr, sin_ptr, table_stride, n_positions, live)
    a = round_to(a, OUT_TY).to(tl.float32)
    b = round_to(b, OUT_TY).to(tl.float32)

    slot = table_slots(bt_ptr, bt_s_b, bt_s_k, tok // tokens_per_req, pos, live, page_size, max_blocks)
    valid, row_at, scale_at = slot_addresses(slot, live, capacity, page_size, block_stride, token_stride, FMT)
    if FMT == FMT_BF16:
        ty = cache_ptr.dtype.element_ty
        p = tl.arange(0, 256)
        at = cache_ptr + row_at[:, None] + 2 * p[None, :]
        tl.store(at, round_to(a, ty), mask=valid[:, None])
        tl.store(at + 1, round_to(b, ty), mask=valid[:, None])
    else:
        row = tl.reshape(tl.join(a, b), (BLOCK_T, 512))
        if FMT == FMT_V41_FP4:
            halves = tl.permute(tl.reshape(row.to(OUT_TY), (BLOCK_T, 32, 2, 8)), (2, 0, 1, 3))
            store_fp4_values(cache_ptr, row_at, scale_at, halves, valid, NATIVE_FP8)
        elif FMT == FMT_V41_FP8:
            store_fp8_tiles(cache_ptr, row_at, scale_at, tl.reshape(row, (BLOCK_T, 16, 32)), valid,
                            tl.full((16,), 1, tl.int1), False, NATIVE_FP8)
        else:  # MODEL1 / V4 FP8: 7 tiles of 64, the rope part as bf16 at byte 448, the 8th scale byte 0
            tl.static_assert(FMT == FMT_MODEL1_FP8)
            store_fp8_tiles(cache_ptr, row_at, scale_at, tl.reshape(row, (BLOCK_T, 8, 64)), valid,
                            tl.arange(0, 8) < 7, False, NATIVE_FP8)
            p = tl.arange(0, 256)
            tail = valid[:, None] & (p >= FIRST_ROPE_PAIR)[None, :]
            at = cache_ptr + row_at[:, None] + 448 + 4 * (p - FIRST_ROPE_PAIR)[None, :]
            store_bytes_le(at, bf16_bits(a), 2, tail)
            store_bytes_le(at + 2, bf16_bits(b), 2, tail)
            tl.store(cache_ptr + scale_at + 7, tl.zeros_like(scale_at).to(tl.uint8), mask=valid)

    c = tl.arange(0, Q_BLOCK)
    qm = live[:, None] & (c < Q_RANK)[None, :]
    xq = tl.load(q_ptr + tok64[:, None] * q_stride + c[None, :], mask=qm, other=0.0).to(tl.float32)
    wq = tl.load(q_w_ptr + c, mask=c < Q_RANK, other=0.0).to(tl.float32)
    yq = wq[None, :] * (xq * inv_rms(xq, eps, Q_RANK)[:, None])
    tl.store(q_out_ptr + tok64[:, None] * q_out_stride + c[None, :], round_to(yq, q_out_ptr.dtype.element_ty),
             mask=qm)


@triton.jit
def _heads(x_ptr, x_s_t, x_s_h, n_heads, eps, pos_ptr, cos_ptr, sin_ptr, table_stride, n_positions, t, head_block,
           NORM: tl.constexpr, BLOCK_H: tl.constexpr):
    """Token ``t``'s heads of ``head_block`` (see :func:`v4_heads_kernel`), in place."""
    h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < n_heads
    TY: tl.constexpr = x_ptr.dtype.element_ty
    row = x_ptr + t.to(tl.int64) * x_s_t + h.to(tl.int64)[:, None] * x_s_h
    if NORM:
        p = tl.arange(0, 256)
        a = tl.load(row + 2 * p[None, :], mask=hm[:, None], other=0.0).to(tl.float32)
        b = tl.load(row + 2 * p[None, :] + 1, mask=hm[:, None], other=0.0).to(tl.float32)
        f = round_to(inv_rms_of(tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1), eps, 512), TY)
        a = round_to(a * f.to(tl.float32)[:, None], TY).to(tl.float32)
        b = round_to(b * f.to(tl.float32)[:, None], TY).to(tl.float32)
        at_t = t + tl.zeros((1,), tl.int32)  # every head of the token at its one position
        a, b = _rotated_tail(a, b, tl.load(pos_ptr + at_t), cos_ptr, sin_ptr, table_stride, n_positions, at_t >= 0)
        tl.store(row + 2 * p[None, :], round_to(a, TY), mask=hm[:, None])
        tl.store(row + 2 * p[None, :] + 1, round_to(b, TY), mask=hm[:, None])
    else:
        i = tl.arange(0, ROPE_PAIRS)
        at = row + 448 + 2 * i[None, :]
        a = tl.load(at, mask=hm[:, None], other=0.0).to(tl.float32)
        b = tl.load(at + 1, mask=hm[:, None], other=0.0).to(tl.float32)
        pos = tl.load(pos_ptr + t)
        angle = pos.to(tl.int64) * table_stride + i[None, :]
        ok = in_table(pos, n_positions)
        ra, rb = rope_pairs(a, b, tl.load(cos_ptr + angle, mask=ok, other=0.0),
                            tl.load(sin_ptr + angle, mask=ok, other=0.0))
        tl.store(at, round_to(ra, TY), mask=hm[:, None])
        tl.store(at + 1, round_to(rb, TY), mask=hm[:, None])


@triton.jit
def v4_heads_kernel(x_ptr, x_s_t, x_s_h, n_heads, eps, pos_ptr, cos_ptr, sin_ptr, table_stride, n_positions,
                    bt_ptr, bt_s_b, bt_s_k, slots_ptr, s_q, window, max_blocks, page_size,
                    NORM: tl.constexpr, SLOTS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_W: tl.constexpr):
    """V4's heads ``x [T, n_heads, 512]`` of token ``t = program_id(0)``, BLOCK_H a program, in place: with NORM
    each head RMS-normed without a weight (the factor rounded to x's dtype, then multiplied), then the
    trailing 64 channels rotated at the token's position (by the table's angles; the output's rotation back
    passes the negated sines). With SLOTS the grid's second axis goes on past the head blocks: those programs
    write each query's window slots, ``slots [T, window]`` = the block table's slots of positions
    ``pos - k`` for ``k < window`` (-1 where negative or past the table; query t of request ``t // s_q``)."""
    t = tl.program_id(0)
    block = tl.program_id(1)
    head_blocks = tl.cdiv(n_heads, BLOCK_H)
    if SLOTS:
        if block >= head_blocks:
            k = (block - head_blocks) * BLOCK_W + tl.arange(0, BLOCK_W)
            live = k < window
            p = tl.load(pos_ptr + t) - k
            slot = table_slots(bt_ptr, bt_s_b, bt_s_k, t // s_q, p, live, page_size, max_blocks)
            tl.store(slots_ptr + t.to(tl.int64) * window + k, slot.to(tl.int32), mask=live)
        else:
            _heads(x_ptr, x_s_t, x_s_h, n_heads, eps, pos_ptr, cos_ptr, sin_ptr, table_stride, n_positions, t, block,
                   NORM, BLOCK_H)
    else:
        _heads(x_ptr, x_s_t, x_s_h, n_heads, eps, pos_ptr, cos_ptr, sin_ptr, table_stride, n_positions, t, block,
               NORM, BLOCK_H)
