"""Triton building blocks shared by the MLA kernels: latent-row loaders for every cache format, the
skip-scale online-softmax step, and the epilogues (final outputs, or split partials for the combine).

Conventions. A latent row is ``[0, 512)`` (loaded as one [BLOCK_N, 512] tile: K and, unchanged, V) plus,
for d_qk = 576, a 64-wide rope tail. Logits live in the log2 domain (``sm_scale * log2(e)`` is folded into one multiplier);
masked logits hold the finite sentinel ``NEG`` and masked probabilities are forced to 0, so a block whose
keys are all invalid can never produce NaN. Rows that are invalid load as zeros (``other=0``), so NaN in
memory the call must not read cannot reach a product.
"""

import triton
import triton.language as tl

# KV formats (the kernels' constexpr codes for anymla.kvcache.KVCacheFormat)
FMT_BF16 = tl.constexpr(0)
FMT_V32_FP8 = tl.constexpr(1)
FMT_MODEL1_FP8 = tl.constexpr(2)
FMT_V41_FP8 = tl.constexpr(3)
FMT_V41_FP4 = tl.constexpr(4)

NEG = tl.constexpr(-1.0e30)
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# Skip-scale: rescale the accumulator only when the running max outgrows the max used for the
# exponentials by more than 6 (natural, scaled logits), i.e. 6 * log2(e) in the log2 domain.
RESCALE_THRESHOLD_LOG2 = tl.constexpr(6.0 * 1.4426950408889634)


@triton.jit
def e4m3_to_f32(b, NATIVE_FP8: tl.constexpr):
    """uint8 e4m3fn codes -> fp32. Bit arithmetic where fp8 types are missing (interpreter, Ascend A2/A3)."""
    # (Triton compiles code after a constexpr-if `return`, so every helper here uses if/else chains.)
    if NATIVE_FP8:
        f = b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        x = b.to(tl.uint16)
        # Same sign/exponent/mantissa bits placed as an fp16: exact up to a 2^8 bias correction, subnormals too.
        h = ((x & 0x80) << 8) | ((x & 0x7F) << 7)
        f = h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        f = tl.where((x & 0x7F) == 0x7F, float("nan"), f)
    return f


@triton.jit
def e4m3x2_to_f16x2(t):
    """Two e4m3fn codes, in bits [8, 16) and [24, 32) of uint32 ``t`` (the other bits 0), as two fp16 values
    2^-8 times theirs in one uint32 (low half: the code from bits [8, 16)): ``e4m3_to_f32``'s bit arithmetic two
    codes an operation, for GPUs without an fp8 conversion (sm_80/86). Exact, subnormals too, except the NaN
    codes (0x7F, 0xFF), which give +-1.875: callers tell them by ``e4m3x4_has_nan``."""
    return (t & 0x80008000) | ((t >> 1) & 0x3F803F80)


@triton.jit
def e4m3x4_has_nan(w):
    """Whether one of the 4 e4m3fn codes in uint32 ``w`` is NaN (0x7F, 0xFF): a byte's low 7 bits plus 1 carry
    into its top bit only from 0x7F."""
    return (((w & 0x7F7F7F7F) + 0x01010101) & 0x80808080) != 0


@triton.jit
def e2m1_to_f32(code):
    """4-bit e2m1 codes (in a uint8) -> fp32, placed as fp16 bits with a 2^14 bias correction."""
    c = code.to(tl.uint16)
    h = ((c & 8) << 12) | ((c & 7) << 9)
    return h.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def e8m0_to_f32(b):
    return (b.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def load_bf16_bytes(byte_ptr, mask):
    """bf16 values stored little-endian at byte addresses, assembled from single bytes: triton-ascend
    rejects casts between pointers of different widths."""
    lo = tl.load(byte_ptr, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(byte_ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.bfloat16, bitcast=True)


@triton.jit
def load_f32_bytes(byte_ptr, mask):
    """fp32 values stored little-endian at byte addresses, assembled from single bytes (see above)."""
    word = tl.load(byte_ptr, mask=mask, other=0).to(tl.uint32)
    for i in tl.static_range(1, 4):
        word |= tl.load(byte_ptr + i, mask=mask, other=0).to(tl.uint32) << (8 * i)
    return word.to(tl.float32, bitcast=True)


@triton.jit
def _scaled(q, scales, TILE: tl.constexpr):
    """``q [BN, 512] * scales [BN, 512 // TILE]`` broadcast over tiles of TILE columns (scales stay small:
    a per-element scale gather would be staged through shared memory as a [BN, 512] tile)."""
    bn: tl.constexpr = q.shape[0]
    per_row: tl.constexpr = 512 // TILE
    return tl.reshape(tl.reshape(q, (bn, per_row, TILE)) * scales[:, :, None], (bn, 512))


@triton.jit
def load_latent(kv_ptr, row, srow, valid, FMT: tl.constexpr, DTYPE: tl.constexpr, NATIVE_FP8: tl.constexpr,
                PORTABLE: tl.constexpr = False):
    """The 512 leading columns (the V part) of the latent rows whose data starts at ``row`` and whose
    scales start at ``srow`` (element offsets for BF16, byte offsets otherwise; see ``row_offsets``).

    ``PORTABLE`` (Ascend) reads multi-byte fields byte by byte and unpacks FP4 nibbles with a select:
    triton-ascend 3.2 rejects pointer casts and its memory planner fails on the join-and-reshape unpack."""
    col = tl.arange(0, 512)
    m = valid[:, None]
    if FMT == FMT_BF16:
        k = tl.load(kv_ptr + row[:, None] + col[None, :], mask=m, other=0.0)
    elif FMT == FMT_V32_FP8:
        q = e4m3_to_f32(tl.load(kv_ptr + row[:, None] + col[None, :], mask=m, other=0), NATIVE_FP8)
        if PORTABLE:
            s = load_f32_bytes(kv_ptr + srow[:, None] + 4 * tl.arange(0, 4)[None, :], m)
        else:
            s_ptr = (kv_ptr + srow).to(tl.pointer_type(tl.float32))
            s = tl.load(s_ptr[:, None] + tl.arange(0, 4)[None, :], mask=m, other=0.0)
        k = _scaled(q, s, 128).to(DTYPE)
    elif FMT == FMT_V41_FP8:
        q = e4m3_to_f32(tl.load(kv_ptr + row[:, None] + col[None, :], mask=m, other=0), NATIVE_FP8)
        s = e8m0_to_f32(tl.load(kv_ptr + srow[:, None] + tl.arange(0, 16)[None, :], mask=m, other=0))
        k = _scaled(q, s, 32).to(DTYPE)
    elif FMT == FMT_V41_FP4:
        # element 2i sits in the low nibble of byte i, element 2i + 1 in the high nibble. The select also
        # serves blocks of fewer than 32 rows on GPUs: there the join-and-reshape unpack gave wrong outputs on
        # the H200 (Triton 3.6, 16 keys a block: half the elements; the interpreter agreed; cause not found).
        if PORTABLE or row.shape[0] < 32:
            byte = tl.load(kv_ptr + row[:, None] + (col // 2)[None, :], mask=m, other=0)
            v = e2m1_to_f32(tl.where((col % 2 == 0)[None, :], byte & 0xF, byte >> 4))
        else:
            byte = tl.load(kv_ptr + row[:, None] + tl.arange(0, 256)[None, :], mask=m, other=0)
            v = tl.reshape(tl.join(e2m1_to_f32(byte & 0xF), e2m1_to_f32(byte >> 4)), (byte.shape[0], 512))
        s = e4m3_to_f32(tl.load(kv_ptr + srow[:, None] + tl.arange(0, 32)[None, :], mask=m, other=0), NATIVE_FP8)
        k = _scaled(v, s, 16).to(DTYPE)
    else:
        # MODEL1: [0, 448) e4m3 with e8m0 scales per 64 (7 per row), then [448, 512) bf16 rope at byte 448.
        is_fp8 = col < 448
        q = e4m3_to_f32(tl.load(kv_ptr + row[:, None] + col[None, :], mask=m & is_fp8[None, :], other=0), NATIVE_FP8)
        # The 8th scale byte is padding: whatever it holds only scales columns the select below discards.
        s = e8m0_to_f32(tl.load(kv_ptr + srow[:, None] + tl.arange(0, 8)[None, :], mask=m, other=0))
        rope_mask = m & (~is_fp8)[None, :]
        if PORTABLE:
            r = load_bf16_bytes(kv_ptr + row[:, None] + 448 + 2 * (col % 64)[None, :], rope_mask)
        else:
            rope_ptr = (kv_ptr + row + 448).to(tl.pointer_type(tl.bfloat16))
            r = tl.load(rope_ptr[:, None] + (col - 448)[None, :], mask=rope_mask, other=0.0)
        k = tl.where(is_fp8[None, :], _scaled(q, s, 64), r.to(tl.float32)).to(DTYPE)
    return k


@triton.jit
def load_latent_rope(kv_ptr, row, valid, FMT: tl.constexpr, PORTABLE: tl.constexpr = False):
    """The 64 rope columns ``[512, 576)`` of d_qk = 576 rows (BF16 or V32_FP8, both store them as bf16)."""
    c = tl.arange(0, 64)
    if FMT == FMT_BF16:
        r = tl.load(kv_ptr + row[:, None] + 512 + c[None, :], mask=valid[:, None], other=0.0)
    elif PORTABLE:
        r = load_bf16_bytes(kv_ptr + row[:, None] + 528 + 2 * c[None, :], valid[:, None])
    else:
        rope_ptr = (kv_ptr + row + 528).to(tl.pointer_type(tl.bfloat16))
        r = tl.load(rope_ptr[:, None] + c[None, :], mask=valid[:, None], other=0.0)
    return r


@triton.jit
def row_offsets(slot, page, stride_block, stride_row, FMT: tl.constexpr):
    """Offsets (elements for BF16, bytes otherwise; int64) of the data and the scales of paged slots
    ``block * page + offset``, for any block stride. MODEL1 keeps a block's scales after all its data."""
    blk = (slot // page).to(tl.int64)
    off = (slot % page).to(tl.int64)
    base = blk * stride_block
    if FMT == FMT_MODEL1_FP8:
        row = base + off * 576
        srow = base + page * 576 + off * 8
    elif FMT == FMT_V41_FP4:
        row = base + off * stride_row
        srow = row + 256
    else:
        row = base + off * stride_row
        srow = row + 512
    return row, srow


@triton.jit
def dot_acc(a, b, acc, INTERPRET: tl.constexpr):
    # The interpreter multiplies raw bf16 bit patterns in tl.dot; fp32 operands are exact there.
    if INTERPRET:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def attend_block(q, qr, k, kr, mask, scale_log2, m_run, m_use, l, acc,
                 HAS_ROPE: tl.constexpr, SKIP_SCALE: tl.constexpr, INTERPRET: tl.constexpr, MASKED: tl.constexpr = True):
    """One key block of the skip-scale online softmax (FlashMLA's Ascend design, in the log2 domain).

    ``k [BN, 512]`` serves as K (with the rope tail ``kr``) and as V. ``m_run`` is the true running max,
    ``m_use`` the lagging max the exponentials use; the accumulator is rescaled only when ``m_run - m_use``
    exceeds the threshold in some row (block-uniform branch), so ``p = 2^(s - m_use) <= 2^threshold``.
    ``mask [BH, BN]`` marks attendable (row, key) pairs; with ``MASKED=False`` every pair is attendable
    (the caller guarantees it) and the mask is ignored.
    """
    s = dot_acc(q, tl.trans(k), tl.zeros((q.shape[0], k.shape[0]), tl.float32), INTERPRET)
    if HAS_ROPE:
        s = dot_acc(qr, tl.trans(kr), s, INTERPRET)
    if MASKED:
        s = tl.where(mask, s * scale_log2, NEG)
    else:
        s = s * scale_log2
    m_new = tl.maximum(m_run, tl.max(s, 1))
    if SKIP_SCALE:
        if tl.max(m_new - m_use, 0) > RESCALE_THRESHOLD_LOG2:
            alpha = tl.exp2(m_use - m_new)
            acc = acc * alpha[:, None]
            l = l * alpha
            m_use = m_new
    else:
        # Same lagging max per row, chosen with a select instead of a block-wide branch (the multiply by
        # alpha = 1 for rows that keep their max costs less than the branch's cross-warp reduction on GPUs).
        m_next = tl.where(m_new - m_use > RESCALE_THRESHOLD_LOG2, m_new, m_use)
        alpha = tl.exp2(m_use - m_next)
        acc = acc * alpha[:, None]
        l = l * alpha
        m_use = m_next
    p = tl.exp2(s - m_use[:, None])
    if MASKED:
        p = tl.where(mask, p, 0.0)
    l += tl.sum(p, 1)
    if INTERPRET:
        acc = dot_acc(p, k, acc, INTERPRET)
    else:
        acc = tl.dot(p.to(k.dtype), k, acc)
    return m_new, m_use, l, acc


@triton.jit
def store_result(out_ptr, out_row, lse_ptr, lse_row, max_ptr, max_row, row_mask, sink_ptr, head,
                 m_run, m_use, l, acc, HAS_SINK: tl.constexpr, WRITE_MAX: tl.constexpr):
    """Normalize and store ``out``, natural-log ``lse`` and ``max_logits`` for rows ``row_mask``; empty rows
    get out 0, lse +inf, max -inf. The sink factor is ``1 / (1 + e^(sink - lse))``."""
    empty = l == 0.0
    l_safe = tl.where(empty, 1.0, l)
    lse2 = m_use + tl.log2(l_safe)
    scale = 1.0 / l_safe
    if HAS_SINK:
        sink = tl.load(sink_ptr + head, mask=row_mask, other=float("-inf"))
        scale = scale / (1.0 + tl.exp2(sink * LOG2E - lse2))
    scale = tl.where(empty, 0.0, scale)
    c = tl.arange(0, 512)
    tl.store(out_ptr + out_row[:, None] + c[None, :], (acc * scale[:, None]).to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None])
    tl.store(lse_ptr + lse_row, tl.where(empty, float("inf"), lse2 * LN2), mask=row_mask)
    if WRITE_MAX:
        tl.store(max_ptr + max_row, tl.where(empty, float("-inf"), m_run * LN2), mask=row_mask)


@triton.jit
def store_partial(po_ptr, po_row, plse_ptr, plse_row, row_mask, m_use, l, acc):
    """A split's normalized partial output (fp32) and its log2-domain lse (-inf when the split is empty)."""
    empty = l == 0.0
    l_safe = tl.where(empty, 1.0, l)
    inv = tl.where(empty, 0.0, 1.0 / l_safe)
    c = tl.arange(0, 512)
    tl.store(po_ptr + po_row[:, None] + c[None, :], acc * inv[:, None], mask=row_mask[:, None])
    tl.store(plse_ptr + plse_row, tl.where(empty, float("-inf"), m_use + tl.log2(l_safe)), mask=row_mask)


@triton.jit(do_not_specialize=["num_splits", "tokens_per_batch"])
def combine_kernel(po_ptr, plse_ptr, out_ptr, lse_ptr, sink_ptr, num_splits, num_heads, tokens_per_batch,
                   so_b, so_i, so_h, sl_b, sl_i, sl_h,
                   HAS_SINK: tl.constexpr, BLOCK_D: tl.constexpr, MAX_SPLITS: tl.constexpr):
    """Merge split partials ``po [T, S, H, 512]`` / ``plse [T, S, H]`` (log2) into out and natural lse.

    Grid ``(T * H, 512 // BLOCK_D)``: every split of one (token, head, column block) is loaded at once, so
    the merge costs one round trip to memory however many splits there are. Empty splits (lse -inf) get
    weight 0 and are never read; a token whose splits are all empty gets out 0 and lse +inf. Output token
    ``t`` is ``(b, i) = divmod(t, tokens_per_batch)`` and addresses ``out`` / ``lse`` through their strides.
    """
    t = tl.program_id(0) // num_heads
    h = tl.program_id(0) % num_heads
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    s = tl.arange(0, MAX_SPLITS)
    t64 = t.to(tl.int64)
    row = (t64 * num_splits + s) * num_heads + h
    lse_s = tl.load(plse_ptr + row, mask=s < num_splits, other=float("-inf"))
    m = tl.max(lse_s, 0)
    has = m > float("-inf")
    m_safe = tl.where(has, m, 0.0)
    w = tl.exp2(lse_s - m_safe)  # 0 for empty splits
    total = tl.sum(w, 0)
    lse2 = m_safe + tl.log2(tl.where(has, total, 1.0))
    inv = tl.where(has, 1.0 / tl.where(has, total, 1.0), 0.0)
    if HAS_SINK:
        inv = inv / (1.0 + tl.exp2(tl.load(sink_ptr + h) * LOG2E - lse2))
    o = tl.load(po_ptr + row[:, None] * 512 + d[None, :], mask=(w > 0.0)[:, None], other=0.0)
    acc = tl.sum(o * w[:, None], 0)
    b = t // tokens_per_batch
    qi = t % tokens_per_batch
    tl.store(out_ptr + b.to(tl.int64) * so_b + qi * so_i + h * so_h + d, (acc * inv).to(out_ptr.dtype.element_ty))
    if tl.program_id(1) == 0:
        tl.store(lse_ptr + b.to(tl.int64) * sl_b + qi * sl_i + h * sl_h, tl.where(has, lse2 * LN2, float("inf")))
