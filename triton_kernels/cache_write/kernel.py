"""Triton kernels of the MLA prolog: quantize-on-write into a paged cache (every anymla format), the fused
latent RMSNorm + k_pe RoPE + cache write, the q assembly (absorbed nope part + RoPE of q_pe), and the DSA
indices' cache slots.

Exactness. The encoders are integer arithmetic on fp32 bits, so the interpreter, NVIDIA and Ascend write the
same bytes (NVIDIA sm_89+ converts the e4m3 codes, FP8 values and FP4 scales, in hardware instead: the same
rounding, far fewer instructions; see NOTES.md): e4m3 and the e4m3 FP4 scale round to nearest even (subnormals
too), FP8 tile scales are ``2^ceil(log2(max(amax / 448, 1e-4)))`` with the ceiling taken exactly from the bits
(``amax / 448`` with a correctly rounded division), and FP4 compares each value with midpoint-times-scale
thresholds, which gives the codes of torch's correctly rounded quotient without dividing (:func:`e2m1_code`).
The bytes are those of :func:`anymla.kvcache.quantize` for bf16/fp16 rows; for fp32 rows they differ only where
``amax / 448`` lies a few ulps above a power of two, where torch's fp32 ``log2`` rounds to the integer below (a
tile scale one power of two smaller, values saturated at 448); see NOTES.md.

Stores are single bytes: a bf16 rope value or an fp32 scale is written as its 2 or 4 little-endian
bytes, since triton-ascend rejects casts between pointers of different widths. Slots are
``block * page_size + offset``; a slot ``< 0`` or ``>= num_blocks * page_size`` is skipped.
"""

import triton
import triton.language as tl

# Cache formats (the codes of anymla.triton_kernels.common, kept local so this kernel imports nothing else)
FMT_BF16 = tl.constexpr(0)
FMT_V32_FP8 = tl.constexpr(1)
FMT_MODEL1_FP8 = tl.constexpr(2)
FMT_V41_FP8 = tl.constexpr(3)
FMT_V41_FP4 = tl.constexpr(4)

ROPE_INTERLEAVED = tl.constexpr(0)  # DeepSeek's layout: pairs (2i, 2i + 1) share frequency i
ROPE_NEOX = tl.constexpr(1)         # halves: (i, i + d / 2) share frequency i


@triton.jit
def e4m3_code(x):
    """fp32 -> e4m3fn byte, round to nearest even; |x| must be <= 448 (callers clamp), as torch's cast."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    exp = (mag >> 23).to(tl.int32)
    # normal range (>= 2^-6): drop 20 of fp32's 23 mantissa bits with round-half-even, rebias 127 -> 7
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20).to(tl.int32) - (120 << 3)
    # subnormal range: the value in units of 2^-9 (the implicit bit shifted in), rounded half-even
    m24 = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(141 - exp, 21), 31).to(tl.uint32)
    q = m24 >> shift
    rem = m24 & ((tl.full(m24.shape, 1, tl.uint32) << shift) - 1)
    half = tl.full(m24.shape, 1, tl.uint32) << (shift - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    sub = (q + up.to(tl.uint32)).to(tl.int32)
    code = tl.where(exp >= 121, normal, sub)
    return (code.to(tl.uint32) | sign).to(tl.uint8)


@triton.jit
def e4m3_encode(x, NATIVE_FP8: tl.constexpr):
    """fp32 -> e4m3fn byte, saturating at +-448: the hardware conversion (sm_89+: round to nearest even,
    subnormals included, saturation built in, two values an instruction) or the clamp and :func:`e4m3_code`'s
    ~35 integer operations (the interpreter, Ascend, older GPUs). Both give the bytes of torch's cast of the
    clamped value."""
    if NATIVE_FP8:
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        return e4m3_code(tl.minimum(tl.maximum(x, -448.0), 448.0))


@triton.jit
def e4m3_value(code):
    """e4m3fn byte -> fp32 (finite codes), exact."""
    c = code.to(tl.int32)
    e = (c >> 3) & 0xF
    m = (c & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * _exp2_int(e - 10))
    return tl.where((c & 0x80) != 0, -mag, mag)


@triton.jit
def e4m3_decode(code, NATIVE_FP8: tl.constexpr):
    """e4m3fn byte -> fp32 (finite codes), exact: the hardware conversion (sm_89+) or :func:`e4m3_value`."""
    if NATIVE_FP8:
        return code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        return e4m3_value(code)


@triton.jit
def _exp2_int(e):
    """2^e as fp32 for an int32 e in the normal range, built from the exponent bits."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def pow2_scale_exponent(amax):
    """e with 2^e = 2^ceil(log2(max(amax / 448, 1e-4))), exactly (FlashMLA's FP8 tile scale)."""
    t = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), 1e-4)
    bits = t.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def e2m1_code(v, s):
    """4-bit e2m1 code (sign in bit 3) of torch's correctly rounded ``fl(v / s)`` for fp32 ``v`` and an e4m3
    scale value ``s``, as an fp32 integer: nearest of 0, .5, 1, 1.5, 2, 3, 4, 6, ties to the even code,
    saturating at 6; NaN (in ``v`` or ``s``) compares false, so it and what rounds to 0 (-0.0 too) get code 0
    (anymla.kvcache's rule)."""
    # No division: v is compared with t = m * s for the midpoints m between the e2m1 values. t is exact in
    # fp32 (m has <= 3 significant bits, s <= 4), and a float v != t lies at least one fp32 spacing from t,
    # >= 2^(e(m) + e(s) - 23) (e: the exponent; half that just below a power of two, where m is one too),
    # which divided by s < 2^(e(s) + 1) exceeds half the spacing at m: fl(v / s) = m only where v = t.
    # Rounding is monotone, so fl(v / s) compares with m as v does with t, ties included.
    # A binary search over the midpoints: 1.75, then 0.75 or 3.5 (the codes above them, 4, 2, 6, are even: a
    # tie goes up, >=), then 0.25, 1.25, 2.5 or 5 (odd codes above: a tie stays, >). Each threshold is built
    # from the 0 / 1 outcomes by multiply-adds rather than selects (no predicates to hold), exactly: every
    # term and partial sum is s times a number of <= 4 significant bits.
    mag = tl.abs(v)
    up4 = (mag >= 1.75 * s).to(tl.float32)
    up2 = (mag >= 0.75 * s + up4 * (2.75 * s)).to(tl.float32)
    up1 = (mag > 0.25 * s + up4 * (2.25 * s) + up2 * (s + up4 * (1.5 * s))).to(tl.float32)
    neg = (v < -0.25 * s).to(tl.float32)
    return up1 + 2.0 * up2 + 4.0 * up4 + 8.0 * neg


@triton.jit
def bf16_bits(x):
    """fp32 -> bf16 bit pattern (uint16), round to nearest even, in integer arithmetic: Triton's
    interpreter truncates in ``.to(tl.bfloat16)``, a GPU rounds; this gives one answer everywhere."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, rounded).to(tl.uint16)


@triton.jit
def round_to(x, TY: tl.constexpr):
    """fp32 ``x`` rounded to nearest even in dtype TY (bf16 through :func:`bf16_bits`)."""
    if TY == tl.bfloat16:
        return bf16_bits(x).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(TY)


@triton.jit
def store_bytes_le(ptr, word, NBYTES: tl.constexpr, mask):
    """Store the NBYTES little-endian bytes of ``word`` (an integer tensor) at ``ptr, ptr + 1, ...``."""
    w = word.to(tl.uint32)
    for i in tl.static_range(NBYTES):
        tl.store(ptr + i, ((w >> (8 * i)) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def store_fp8_tiles(cache_ptr, row_at, scale_at, x, mask, tile_ok, FP32_SCALES: tl.constexpr,
                    NATIVE_FP8: tl.constexpr):
    """Quantize ``x [BT, NT, TILE]`` (fp32) with one pow2 scale per tile and store it: codes at
    ``row_at + tile * TILE + j``, scales at ``scale_at`` (4-byte fp32 each, or one e8m0 byte each).
    ``tile_ok [NT]`` masks tiles beyond the format's count (MODEL1 has 7, padded to 8)."""
    NT: tl.constexpr = x.shape[1]
    TILE: tl.constexpr = x.shape[2]
    e = pow2_scale_exponent(tl.max(tl.abs(x), axis=2))
    y = x * _exp2_int(-e)[:, :, None]  # exact: a power-of-two scale divides without rounding
    codes = e4m3_encode(y, NATIVE_FP8)
    tiles = tl.arange(0, NT)
    col = tiles[:, None] * TILE + tl.arange(0, TILE)[None, :]
    m2 = mask[:, None] & tile_ok[None, :]
    tl.store(cache_ptr + row_at[:, None, None] + col[None, :, :], codes,
             mask=tl.broadcast_to(m2[:, :, None], codes.shape))
    if FP32_SCALES:
        store_bytes_le(cache_ptr + scale_at[:, None] + 4 * tiles[None, :], (e + 127) << 23, 4, m2)
    else:
        tl.store(cache_ptr + scale_at[:, None] + tiles[None, :], (e + 127).to(tl.uint8), mask=m2)


@triton.jit
def bf16_bits_of(x):
    """bf16 bit patterns (uint16) of ``x``: its own bits when it is bf16 already, else rounded by
    :func:`bf16_bits`."""
    if x.dtype == tl.bfloat16:
        return x.to(tl.uint16, bitcast=True)
    else:
        return bf16_bits(x.to(tl.float32))


@triton.jit
def store_bf16(cache_ptr, at, x, mask):
    """Store ``x [BT, N]`` (any float dtype) as little-endian bf16 at byte offsets ``at[:, None] + 2 * j``."""
    j = tl.arange(0, x.shape[1])
    store_bytes_le(cache_ptr + at[:, None] + 2 * j[None, :], bf16_bits_of(x), 2, mask[:, None])


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def fp4_scales(amax, NATIVE_FP8: tl.constexpr, WIDE: tl.constexpr):
    """(e4m3 code, value) of the FP4 tile scales ``e4m3(clamp(amax / 6, 2^-9, 448))``; a NaN ``amax`` gets
    torch's NaN code 0x7F and a NaN value (every code of its tile 0, as torch's ``x / NaN``). A 16-bit amax
    (bf16 / fp16 rows, not WIDE) multiplies by fp32(1 / 6) instead of dividing: the same codes for every such
    amax (checked on all of them; among all fp32 values only 15 with 24 significant bits, a / 6 just below an
    e4m3 midpoint, round differently, so fp32 rows keep the correctly rounded division)."""
    nan = amax != amax
    if WIDE:
        q = tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32))
    else:
        q = amax * 0.16666667163372039795
    code = e4m3_encode(tl.maximum(q, 0.001953125), NATIVE_FP8)  # saturated at 448
    value = tl.where(nan, amax, e4m3_decode(code, NATIVE_FP8))
    return tl.where(nan, 0x7F, code.to(tl.int32)).to(tl.uint8), value


@triton.jit
def float32_of(x):
    """``x`` as fp32; bf16 by shifting its bits, which ``.to(tl.float32)`` takes two instructions for in the
    upper half of a register on sm_90 (extract, then shift)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


# The FP4 encoder of bf16 / fp16 rows works on pairs of 16-bit values in uint32 lanes. Its few PTX instructions
# (prmt, max.NaN.{bf16,f16}x2: sm_80+) are taken where NATIVE_FP8 holds (NVIDIA sm_89+, not the interpreter);
# elsewhere the same lanes are computed with shifts, masks and multiplies, so CPU CI tests the encoder itself.


@triton.jit
def _sign_bytes(a, b, NATIVE_FP8: tl.constexpr):
    """uint32 whose bytes 0..3 are 0xFF where bit 15 of ``a``, bit 15 of ``b``, bit 31 of ``a``, bit 31 of ``b``
    is set, else 0 (``_sign_bytes(d, d)``: 0xFFFF in each 16-bit lane whose top bit is set): one ``prmt`` with
    sign replication."""
    if NATIVE_FP8:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0xFBD9;", "=r,r,r", [a, b], dtype=tl.uint32,
                                         is_pure=True, pack=1)
    else:
        return ((a >> 15) & 0x10001) * 0xFF | ((b >> 15) & 0x10001) * 0xFF00


@triton.jit
def _pair_lanes(lo, hi, NATIVE_FP8: tl.constexpr):
    """uint32 holding the 16-bit floats ``lo`` (low half) and ``hi`` (high half), element by element: one ``prmt``
    a pair from the loaded registers (the shifts and masks take two)."""
    if NATIVE_FP8:
        return tl.inline_asm_elementwise("prmt.b32 $0, $2, $3, 0x5410; prmt.b32 $1, $2, $3, 0x7632;",
                                         "=r,=r,r,r", [lo, hi], dtype=tl.uint32, is_pure=True, pack=2)
    else:
        return lo.to(tl.uint16, bitcast=True).to(tl.uint32) | (hi.to(tl.uint16, bitcast=True).to(tl.uint32) << 16)


@triton.jit
def _max16x2(a, b, IS_BF16: tl.constexpr):
    """Lane-wise NaN-propagating max of two pairs of non-negative 16-bit floats (uint32 lanes)."""
    if IS_BF16:
        return tl.inline_asm_elementwise("max.NaN.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.uint32,
                                         is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise("max.NaN.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.uint32,
                                         is_pure=True, pack=1)


@triton.jit
def _max16x2_bf16(a, b):
    return _max16x2(a, b, True)


@triton.jit
def _max16x2_f16(a, b):
    return _max16x2(a, b, False)


@triton.jit
def _lanes(t, IS_BF16: tl.constexpr):
    """The 16-bit pattern of fp32 ``t`` (a bf16 / fp16 value) as uint32."""
    if IS_BF16:
        return t.to(tl.uint32, bitcast=True) >> 16
    else:
        return t.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit
def _e2m1_lanes(q, c4, lo0, hi0, lo1, hi1, lo2, hi2, NATIVE_FP8: tl.constexpr):
    """The e2m1 code bits of the two 16-bit floats of ``q`` (uint32): their magnitudes are compared with the
    thresholds of :func:`e2m1_code` as integers (non-negative floats, inf and NaN too, order as their bits),
    two at a time: with every threshold lane ``c = T + 0x8000`` and ``|q| <= 0x7FFF``, ``c - |q|`` borrows
    nothing across the lanes and sets a lane's top bit where ``|q| <= T``. Returns the lane mask of codes >= 4
    (code bit 2) and, in bits 15 and 31: not code bit 1, not code bit 0, the sign bit (code bit 3)."""
    a = q & 0x7FFF7FFF
    low = _sign_bytes(c4 - a, c4 - a, NATIVE_FP8)  # |q| < 1.75 s
    # the code: 4 (above 1.75 s) + the number of the lower or upper half's three midpoints below |q|
    high = low ^ 0xFFFFFFFF  # (~ on uint32 overflows in the interpreter)
    d0 = ((low & lo0) | (high & hi0)) - a
    d1 = ((low & lo1) | (high & hi1)) - a
    d2 = ((low & lo2) | (high & hi2)) - a
    # those three answers are monotone: bit 1 is the middle one, bit 0 their parity; the sign bit where the
    # code is not 0 (above 0.25 s, or high)
    return high, d1, d0 ^ d1 ^ d2, q & ((d0 & low) ^ 0xFFFFFFFF)


@triton.jit
def _e2m1_nibbles(qa, qb, c4, lo0, hi0, lo1, hi1, lo2, hi2, SHIFT: tl.constexpr, NATIVE_FP8: tl.constexpr):
    """The e2m1 codes of ``qa`` (elements e, e + 4 of a half tile: bytes 0, 2) and ``qb`` (e + 2, e + 6: bytes 1,
    3) as the nibbles at bit SHIFT of a word: each ``_sign_bytes`` spreads one code bit of the four into its byte,
    a masked merge puts it in place."""
    ua, d1a, pa, na = _e2m1_lanes(qa, c4, lo0, hi0, lo1, hi1, lo2, hi2, NATIVE_FP8)
    ub, d1b, pb, nb = _e2m1_lanes(qb, c4, lo0, hi0, lo1, hi1, lo2, hi2, NATIVE_FP8)
    w = (ua & (0x00040004 << SHIFT)) | (ub & (0x04000400 << SHIFT))
    w = w | ((_sign_bytes(d1a, d1b, NATIVE_FP8) ^ 0xFFFFFFFF) & (0x02020202 << SHIFT))
    w = w | ((_sign_bytes(pa, pb, NATIVE_FP8) ^ 0xFFFFFFFF) & (0x01010101 << SHIFT))
    return w | (_sign_bytes(na, nb, NATIVE_FP8) & (0x08080808 << SHIFT))


@triton.jit
def store_fp4_tiles(cache_ptr, row_at, scale_at, src, live, mask, NATIVE_FP8: tl.constexpr):
    """V4.1 FP4 of the rows at ``src [BT]`` (pointers; rows of ``live`` tokens load, of ``mask`` ones store):
    32 tiles of 16, each with the e4m3 scale ``e4m3(clamp(amax / 6, 2^-9, 448))`` (at ``scale_at + t``);
    element 2i goes to the low nibble of byte i (at ``row_at + i``), 2i + 1 to its high nibble."""
    # [2, BT, 32, k]: element 16 t + 8 h + j of row r at [h, r, t, j], the two 16-byte halves of each tile
    # first, tokens next: Triton 3.7 then gives each lane one tile (its amax in registers) and the two warps
    # their own tokens, with no layout conversion before the code stores (3.6 spreads a tile over two lanes).
    # One 16-byte load a half tile.
    col = tl.arange(0, 2)[:, None, None] * 8 + tl.arange(0, 32)[None, :, None] * 16
    at = src[None, :, None, None] + col[:, None, :, :]
    x = tl.load(at + tl.arange(0, 8)[None, None, None, :], mask=live[None, :, None, None], other=0.0)
    store_fp4_values(cache_ptr, row_at, scale_at, x, mask, NATIVE_FP8)


@triton.jit
def store_fp4_values(cache_ptr, row_at, scale_at, x, mask, NATIVE_FP8: tl.constexpr):
    """:func:`store_fp4_tiles` of the rows' values ``x [2, BT, 32, 8]`` (element 16 t + 8 h + j of row r at
    ``[h, r, t, j]``; fp32, or the rows' bf16/fp16)."""
    BT: tl.constexpr = x.shape[1]
    tiles = tl.arange(0, 32)
    if x.dtype == tl.float32:
        # NaN-propagating as torch's amax (a plain tl.max drops NaN on NVIDIA GPUs, keeps it in the interpreter)
        s_code, s = fp4_scales(tl.reduce(tl.reduce(tl.abs(x), 3, _max_nan), 0, _max_nan), NATIVE_FP8, True)
        lo, hi = tl.split(tl.reshape(e2m1_code(x, s[None, :, :, None]), (2, BT, 32, 4, 2)))
        # 2^23 + k has the bits 0x4B000000 + k (k < 2^23): the byte without a float-to-int conversion
        packed = (lo + 16.0 * hi + 8388608.0).to(tl.int32, bitcast=True).to(tl.uint8)
    else:
        IS_BF16: tl.constexpr = x.dtype == tl.bfloat16
        # a half tile's elements (i, i + 4) paired: q_i's two codes land 2 bytes apart in the half tile's word
        x_lo, x_hi = tl.split(tl.permute(tl.reshape(x, (2, BT, 32, 2, 4)), (0, 1, 2, 4, 3)))
        q = _pair_lanes(x_lo, x_hi, NATIVE_FP8)
        qe, qo = tl.split(tl.reshape(q, (2, BT, 32, 2, 2)))
        q0, q2 = tl.split(qe)
        q1, q3 = tl.split(qo)
        if NATIVE_FP8:
            m = _max16x2(_max16x2(q0 & 0x7FFF7FFF, q1 & 0x7FFF7FFF, IS_BF16),
                         _max16x2(q2 & 0x7FFF7FFF, q3 & 0x7FFF7FFF, IS_BF16), IS_BF16)
            m = tl.reduce(m, 0, _max16x2_bf16 if IS_BF16 else _max16x2_f16)
            m = _max16x2(m, (m >> 16) | (m << 16), IS_BF16) & 0xFFFF
            if IS_BF16:
                amax = (m << 16).to(tl.float32, bitcast=True)
            else:
                amax = m.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        else:
            amax = tl.reduce(tl.maximum(tl.reduce(tl.abs(float32_of(x_lo)), 3, _max_nan),
                                        tl.reduce(tl.abs(float32_of(x_hi)), 3, _max_nan),
                                        propagate_nan=tl.PropagateNan.ALL), 0, _max_nan)
        s_code, s = fp4_scales(amax, NATIVE_FP8, False)
        # thresholds: the midpoints m * s, exact in the rows' dtype (<= 7 significant bits, 2^-11 .. 2240), as
        # lanes T + 0x8000 of their bits T, one less where a tie rounds up (>= t is > t - 1 on the bits);
        # doubling is one exponent step E
        E: tl.constexpr = 0x80 if IS_BF16 else 0x400
        t1 = _lanes(s, IS_BF16)
        t075 = _lanes(0.75 * s, IS_BF16)
        t125 = _lanes(1.25 * s, IS_BF16)
        t175 = _lanes(1.75 * s, IS_BF16)
        c4 = ((t175 + 0x7FFF) * 0x10001)[None, :, :]
        lo0 = ((t1 - 2 * E + 0x8000) * 0x10001)[None, :, :]
        hi0 = ((t125 + E + 0x8000) * 0x10001)[None, :, :]
        lo1 = ((t075 + 0x7FFF) * 0x10001)[None, :, :]
        hi1 = ((t175 + E + 0x7FFF) * 0x10001)[None, :, :]
        lo2 = ((t125 + 0x8000) * 0x10001)[None, :, :]
        hi2 = ((t125 + 2 * E + 0x8000) * 0x10001)[None, :, :]
        w = (_e2m1_nibbles(q0, q2, c4, lo0, hi0, lo1, hi1, lo2, hi2, 0, NATIVE_FP8)
             | _e2m1_nibbles(q1, q3, c4, lo0, hi0, lo1, hi1, lo2, hi2, 4, NATIVE_FP8))
        w = w & tl.where(s != s, 0, 0xFFFFFFFF).to(tl.uint32)[None, :, :]  # a NaN tile: codes 0
        packed = tl.reshape(tl.join(tl.join(w & 0xFF, (w >> 16) & 0xFF), tl.join((w >> 8) & 0xFF, w >> 24)),
                            (2, BT, 32, 4)).to(tl.uint8)
    byte = tl.arange(0, 2)[:, None, None] * 4 + tiles[None, :, None] * 8 + tl.arange(0, 4)[None, None, :]
    tl.store(cache_ptr + row_at[None, :, None, None] + byte[:, None, :, :], packed,
             mask=tl.broadcast_to(mask[None, :, None, None], packed.shape))
    tl.store(cache_ptr + scale_at[:, None] + tiles[None, :], s_code, mask=mask[:, None])


@triton.jit
def table_slots(table_ptr, table_s_b, table_s_k, req, p, ok, page_size, max_blocks):
    """Cache slots ``block_table[req, p // page_size] * page_size + p % page_size`` of token positions ``p``
    (int tensors of one shape), -1 where ``ok`` is false, ``p < 0`` or ``p`` lies past the block table."""
    ok = ok & (p >= 0) & (p < max_blocks * page_size)
    q = tl.where(ok, p, 0).to(tl.int32)  # < 2^31 now: a 32-bit division
    blk = tl.load(table_ptr + req.to(tl.int64) * table_s_b + (q // page_size) * table_s_k, mask=ok, other=0)
    return tl.where(ok, blk * page_size + q % page_size, -1)


@triton.jit
def slot_addresses(slot, live, capacity, page_size, block_stride, token_stride, FMT: tl.constexpr):
    """(valid [BT], data byte offset [BT], scale byte offset [BT]) of the cache slots ``slot`` of the tokens
    where ``live`` holds; for BF16 caches the data offset is in elements and the scale offset unused."""
    slot = slot.to(tl.int64)
    valid = live & (slot >= 0) & (slot < capacity)
    # 32-bit division (a cache holds < 2^31 slots): a 64-bit one is a subroutine call on NVIDIA GPUs
    slot = tl.where(valid, slot, 0).to(tl.int32)
    blk = (slot // page_size).to(tl.int64)
    off = (slot % page_size).to(tl.int64)
    if FMT == FMT_MODEL1_FP8:
        row_at = blk * block_stride + off * 576
        scale_at = blk * block_stride + page_size * 576 + off * 8
    else:
        row_at = blk * block_stride + off * token_stride
        if FMT == FMT_V41_FP4:
            scale_at = row_at + 256
        else:
            scale_at = row_at + 512
    return valid, row_at, scale_at


@triton.jit
def cache_write_kernel(src_ptr, src_stride, slots_ptr, cache_ptr, n_tokens, capacity, page_size,
                       block_stride, token_stride, FMT: tl.constexpr, D: tl.constexpr, NATIVE_FP8: tl.constexpr,
                       BLOCK_T: tl.constexpr):
    """Write ``n_tokens`` latent rows ``src [n_tokens, D]`` (any float dtype, row stride ``src_stride``) into
    the paged cache at their slots. Strides of the cache are in its elements (bytes for quantized caches)."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = tok < n_tokens
    slot = tl.load(slots_ptr + tok, mask=live, other=-1)
    valid, row_at, scale_at = slot_addresses(slot, live, capacity, page_size, block_stride, token_stride, FMT)
    src = src_ptr + tok.to(tl.int64) * src_stride
    m2 = valid[:, None]
    if FMT == FMT_BF16:
        ty = cache_ptr.dtype.element_ty
        j = tl.arange(0, 512)
        x = tl.load(src[:, None] + j[None, :], mask=m2, other=0.0)
        if x.dtype != ty:  # a cast-copy only where the dtypes differ
            x = round_to(x.to(tl.float32), ty)
        tl.store(cache_ptr + row_at[:, None] + j[None, :], x, mask=m2)
        if D == 576:
            r = tl.arange(0, 64)
            x = tl.load(src[:, None] + 512 + r[None, :], mask=m2, other=0.0)
            if x.dtype != ty:
                x = round_to(x.to(tl.float32), ty)
            tl.store(cache_ptr + row_at[:, None] + 512 + r[None, :], x, mask=m2)
    elif FMT == FMT_V41_FP4:
        # Every live token's row loads, so the slot math stays out of the load's layout; rows of invalid slots
        # are not stored.
        store_fp4_tiles(cache_ptr, row_at, scale_at, src, live, valid, NATIVE_FP8)
    else:
        # (tiles, tile width, bf16 tail at byte) of the FP8 formats: V32 4 x 128 + rope at 528, MODEL1
        # 7 x 64 (padded to 8) + rope at 448, V41 16 x 32 (everything quantized)
        if FMT == FMT_V32_FP8:
            NT: tl.constexpr = 4
            TILE: tl.constexpr = 128
            N_TILES: tl.constexpr = 4
        elif FMT == FMT_MODEL1_FP8:
            NT: tl.constexpr = 8
            TILE: tl.constexpr = 64
            N_TILES: tl.constexpr = 7
        else:
            NT: tl.constexpr = 16
            TILE: tl.constexpr = 32
            N_TILES: tl.constexpr = 16
        tiles = tl.arange(0, NT)
        tile_ok = tiles < N_TILES
        col = tiles[:, None] * TILE + tl.arange(0, TILE)[None, :]
        x = tl.load(src[:, None, None] + col[None, :, :], mask=m2[:, :, None] & tile_ok[None, :, None],
                    other=0.0).to(tl.float32)
        store_fp8_tiles(cache_ptr, row_at, scale_at, x, valid, tile_ok, FMT == FMT_V32_FP8, NATIVE_FP8)
        r = tl.arange(0, 64)
        if FMT == FMT_V32_FP8:
            rope = tl.load(src[:, None] + 512 + r[None, :], mask=m2, other=0.0)
            store_bf16(cache_ptr, row_at + 528, rope, valid)
        elif FMT == FMT_MODEL1_FP8:
            rope = tl.load(src[:, None] + 448 + r[None, :], mask=m2, other=0.0)
            store_bf16(cache_ptr, row_at + 448, rope, valid)
            tl.store(cache_ptr + scale_at + 7, tl.zeros_like(scale_at).to(tl.uint8), mask=valid)


@triton.jit
def in_table(pos, n_positions):
    """Whether positions are rows of the cos / sin table (``n_positions`` rows). The table is read only there: a
    position outside it (invalid input, which the layers' debug checks raise on) gets zeros in its rope channels."""
    return (pos >= 0) & (pos < n_positions)


@triton.jit
def rope_pairs(a, b, cos, sin):
    """Rotate the pairs (a, b) by the angles whose cos / sin are given (all [.., 32] fp32)."""
    return a * cos - b * sin, b * cos + a * sin


@triton.jit
def rope_index(ROPE_STYLE: tl.constexpr):
    """Positions inside the 64-wide rope part of the two members of each of the 32 rotated pairs."""
    i = tl.arange(0, 32)
    if ROPE_STYLE == ROPE_INTERLEAVED:
        return 2 * i, 2 * i + 1
    else:
        return i, i + 32


@triton.jit
def inv_rms(x, eps, N: tl.constexpr):
    """``rsqrt(mean(x^2) + eps)`` of each row of ``x [R, N]`` (fp32), correctly rounded."""
    return inv_rms_of(tl.sum(x * x, axis=1), eps, N)


@triton.jit
def inv_rms_of(sum_sq, eps, N: tl.constexpr):
    """``rsqrt(sum_sq / N + eps)``, correctly rounded: :func:`inv_rms` of rows whose squares sum to ``sum_sq``."""
    var = sum_sq / N
    return tl.math.div_rn(tl.full(var.shape, 1.0, tl.float32), tl.sqrt_rn(var + eps))


@triton.jit
def rms_normed(x, w, eps, N: tl.constexpr, OUT_TY: tl.constexpr):
    """``w * (x * rsqrt(mean(x^2) + eps)).to(OUT_TY)`` rounded to OUT_TY, as the model's RMSNorm computes it
    (fp32 statistics, the normalized value cast to the activation dtype before the weight multiplies)."""
    inv = inv_rms(x, eps, N)
    h = round_to(x * inv[:, None], OUT_TY).to(tl.float32)
    return round_to(w[None, :] * h, OUT_TY).to(tl.float32)


@triton.jit
def mla_prolog_kernel(kv_ptr, kv_stride, kv_w_ptr, kv_eps,
                      q_ptr, q_stride, q_w_ptr, q_eps, q_out_ptr, q_out_stride,
                      pos_ptr, cos_ptr, sin_ptr, table_stride, n_positions,
                      slots_ptr, bt_ptr, bt_s_b, bt_s_k, tokens_per_req, max_blocks,
                      cache_ptr, n_tokens, capacity, page_size, block_stride, token_stride,
                      FMT: tl.constexpr, ROPE_STYLE: tl.constexpr, Q_RANK: tl.constexpr,
                      Q_BLOCK: tl.constexpr, SLOTS_FROM_TABLE: tl.constexpr, NATIVE_FP8: tl.constexpr,
                      BLOCK_T: tl.constexpr):
    """The MLA prolog of V3 / V3.2 for BLOCK_T tokens: RMSNorm of the 512-wide kv latent, RoPE of k_pe (the
    64 columns after it) from the cos / sin table at each token's position, the 576-wide row written into a
    BF16 or V32_FP8 cache; and, when Q_RANK > 0, the RMSNorm of the q latent (``q [T, Q_RANK]`` ->
    ``q_out``). RoPE keeps the model's layout (DeepSeek's interleaved pairs stay interleaved). The cache
    slots are ``slots [T]``, or with SLOTS_FROM_TABLE the block table's slots of the positions (token t
    belongs to request ``t // tokens_per_req``)."""
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = tok < n_tokens
    tok64 = tok.to(tl.int64)
    OUT_TY: tl.constexpr = kv_ptr.dtype.element_ty
    # The kv latent before the q latent and the slots just before the stores (the rows load for every live
    # token): other orders hold up to 144 registers on sm_90 or spill on sm_80.
    pos = tl.load(pos_ptr + tok, mask=live, other=0)
    src = kv_ptr + tok64 * kv_stride
    j = tl.arange(0, 512)
    x = tl.load(src[:, None] + j[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    lat = rms_normed(x, tl.load(kv_w_ptr + j).to(tl.float32), kv_eps, 512, OUT_TY)

    ia, ib = rope_index(ROPE_STYLE)
    pos64 = pos.to(tl.int64)
    i = tl.arange(0, 32)
    at = (live & in_table(pos, n_positions))[:, None]
    cos = tl.load(cos_ptr + pos64[:, None] * table_stride + i[None, :], mask=at, other=0.0)
    sin = tl.load(sin_ptr + pos64[:, None] * table_stride + i[None, :], mask=at, other=0.0)
    a = tl.load(src[:, None] + 512 + ia[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    b = tl.load(src[:, None] + 512 + ib[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    ra, rb = rope_pairs(a, b, cos, sin)

    if SLOTS_FROM_TABLE:
        slot = table_slots(bt_ptr, bt_s_b, bt_s_k, tok // tokens_per_req, pos, live, page_size, max_blocks)
    else:
        slot = tl.load(slots_ptr + tok, mask=live, other=-1)
    valid, row_at, scale_at = slot_addresses(slot, live, capacity, page_size, block_stride, token_stride, FMT)
    if FMT == FMT_BF16:
        ty = cache_ptr.dtype.element_ty
        tl.store(cache_ptr + row_at[:, None] + j[None, :], round_to(lat, ty), mask=valid[:, None])
        tl.store(cache_ptr + row_at[:, None] + 512 + ia[None, :], round_to(ra, ty), mask=valid[:, None])
        tl.store(cache_ptr + row_at[:, None] + 512 + ib[None, :], round_to(rb, ty), mask=valid[:, None])
    else:  # V32_FP8
        ok = tl.full((4,), 1, tl.int1)
        store_fp8_tiles(cache_ptr, row_at, scale_at, tl.reshape(lat, (BLOCK_T, 4, 128)), valid, ok, True,
                        NATIVE_FP8)
        store_bytes_le(cache_ptr + row_at[:, None] + 528 + 2 * ia[None, :], bf16_bits(ra), 2, valid[:, None])
        store_bytes_le(cache_ptr + row_at[:, None] + 528 + 2 * ib[None, :], bf16_bits(rb), 2, valid[:, None])

    if Q_RANK > 0:
        c = tl.arange(0, Q_BLOCK)
        qm = live[:, None] & (c < Q_RANK)[None, :]
        xq = tl.load(q_ptr + tok64[:, None] * q_stride + c[None, :], mask=qm, other=0.0).to(tl.float32)
        wq = tl.load(q_w_ptr + c, mask=c < Q_RANK, other=0.0).to(tl.float32)
        yq = rms_normed(xq, wq, q_eps, Q_RANK, OUT_TY)
        tl.store(q_out_ptr + tok64[:, None] * q_out_stride + c[None, :], round_to(yq, q_out_ptr.dtype.element_ty),
                 mask=qm)


@triton.jit
def _assemble_heads(qn_ptr, qn_s_h, qn_s_t, qpe_ptr, qpe_s_t, qpe_s_h, pos_ptr, cos_ptr, sin_ptr, table_stride,
                    n_positions, out_ptr, out_s_t, out_s_h, n_heads, t, head_block,
                    D_LAT: tl.constexpr, ROPE_STYLE: tl.constexpr, COPY_NOPE: tl.constexpr, BLOCK_H: tl.constexpr):
    """Token ``t``'s query for the heads of ``head_block`` (see :func:`q_assemble_kernel`)."""
    h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = (h < n_heads)[:, None]
    h64 = h.to(tl.int64)
    dst = out_ptr + t * out_s_t + h64[:, None] * out_s_h
    ty = out_ptr.dtype.element_ty
    if COPY_NOPE:
        c = tl.arange(0, D_LAT)
        nope = tl.load(qn_ptr + h64[:, None] * qn_s_h + t * qn_s_t + c[None, :], mask=hm, other=0.0)
        tl.store(dst + c[None, :], round_to(nope.to(tl.float32), ty), mask=hm)
    ia, ib = rope_index(ROPE_STYLE)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, 32)
    at = in_table(pos, n_positions)
    cos = tl.load(cos_ptr + pos * table_stride + i, mask=at, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * table_stride + i, mask=at, other=0.0)[None, :]
    src = qpe_ptr + t * qpe_s_t + h64[:, None] * qpe_s_h
    a = tl.load(src + ia[None, :], mask=hm, other=0.0).to(tl.float32)
    b = tl.load(src + ib[None, :], mask=hm, other=0.0).to(tl.float32)
    ra, rb = rope_pairs(a, b, cos, sin)
    tl.store(dst + D_LAT + ia[None, :], round_to(ra, ty), mask=hm)
    tl.store(dst + D_LAT + ib[None, :], round_to(rb, ty), mask=hm)


@triton.jit
def _query_slots(idx_ptr, idx_s_b, idx_s_s, idx_s_k, pos_ptr, pos_s_b, pos_s_s, bt_ptr, bt_s_b, bt_s_k,
                 out_ptr, row, k_block, s_q, topk, max_blocks, page_size, BLOCK_K: tl.constexpr):
    """The cache slots of query ``row``'s (request ``row // s_q``, query ``row % s_q``) indices in ``k_block``
    (see :func:`sparse_slots_kernel`)."""
    i = row // s_q
    j = row % s_q
    k = k_block * BLOCK_K + tl.arange(0, BLOCK_K)
    live = k < topk
    pos = tl.load(pos_ptr + i.to(tl.int64) * pos_s_b + j * pos_s_s)
    p = tl.load(idx_ptr + i.to(tl.int64) * idx_s_b + j.to(tl.int64) * idx_s_s + k * idx_s_k, mask=live, other=-1)
    slot = table_slots(bt_ptr, bt_s_b, bt_s_k, i, p, live & (p <= pos), page_size, max_blocks)
    tl.store(out_ptr + row.to(tl.int64) * topk + k, slot.to(tl.int32), mask=live)


@triton.jit
def q_assemble_kernel(qn_ptr, qn_s_h, qn_s_t, qpe_ptr, qpe_s_t, qpe_s_h,
                      pos_ptr, cos_ptr, sin_ptr, table_stride, n_positions,
                      out_ptr, out_s_t, out_s_h, n_heads,
                      idx_ptr, idx_s_b, idx_s_s, idx_s_k, bt_ptr, bt_s_b, bt_s_k, slots_ptr, s_q, topk, max_blocks,
                      page_size,
                      D_LAT: tl.constexpr, ROPE_STYLE: tl.constexpr, COPY_NOPE: tl.constexpr,
                      BLOCK_H: tl.constexpr, SLOTS: tl.constexpr, BLOCK_K: tl.constexpr):
    """One token's attention query for BLOCK_H heads: ``out[t, h] = [q_nope_absorbed[h, t] (D_LAT) |
    RoPE(q_pe[t, h]) (64)]``; without COPY_NOPE the nope part is in ``out`` already (the absorbing bmm wrote
    it there) and only q_pe is rotated. Strides are in elements; the last dim of every input is contiguous.

    With SLOTS the grid's second axis goes on past the head blocks: those programs write the token's DSA
    cache slots into ``slots_ptr`` (as :func:`sparse_slots_kernel`, the tokens being ``b * s_q`` queries in
    request order, ``pos_ptr`` their positions), so a sparse decode step launches one kernel less."""
    t = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    head_blocks = tl.cdiv(n_heads, BLOCK_H)
    if SLOTS:
        if block >= head_blocks:
            _query_slots(idx_ptr, idx_s_b, idx_s_s, idx_s_k, pos_ptr, s_q, 1, bt_ptr, bt_s_b, bt_s_k,
                         slots_ptr, tl.program_id(0), block - head_blocks, s_q, topk, max_blocks, page_size, BLOCK_K)
        else:
            _assemble_heads(qn_ptr, qn_s_h, qn_s_t, qpe_ptr, qpe_s_t, qpe_s_h, pos_ptr, cos_ptr, sin_ptr,
                            table_stride, n_positions, out_ptr, out_s_t, out_s_h, n_heads, t, block,
                            D_LAT, ROPE_STYLE, COPY_NOPE, BLOCK_H)
    else:
        _assemble_heads(qn_ptr, qn_s_h, qn_s_t, qpe_ptr, qpe_s_t, qpe_s_h, pos_ptr, cos_ptr, sin_ptr, table_stride,
                        n_positions, out_ptr, out_s_t, out_s_h, n_heads, t, block, D_LAT, ROPE_STYLE, COPY_NOPE,
                        BLOCK_H)


@triton.jit
def sparse_slots_kernel(idx_ptr, idx_s_b, idx_s_s, idx_s_k, pos_ptr, pos_s_b, pos_s_s, bt_ptr, bt_s_b, bt_s_k,
                        out_ptr, s_q, topk, max_blocks, page_size, BLOCK_K: tl.constexpr):
    """The cache slots of one query's DSA indices (token positions): ``out [b * s_q, topk]`` int32 holds
    ``block_table[i, p // page] * page + p % page`` for ``p = indices[i, j, k]``, or -1 where ``p < 0``,
    ``p > positions[i, j]`` (after the query) or ``p`` lies past the block table."""
    _query_slots(idx_ptr, idx_s_b, idx_s_s, idx_s_k, pos_ptr, pos_s_b, pos_s_s, bt_ptr, bt_s_b, bt_s_k, out_ptr,
                 tl.program_id(0), tl.program_id(1), s_q, topk, max_blocks, page_size, BLOCK_K)
