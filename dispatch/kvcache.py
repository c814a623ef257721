"""KV-cache formats FlashMLA has defined, with byte-exact quantize / dequantize codecs.

Every cache is paged: ``[num_blocks, page_size, h_kv, bytes_or_elements_per_token]``. The format of a
quantized cache is told by ``k_cache.shape[-1]`` (bytes per token), exactly as FlashMLA does:

============  ====  =====  ===================================================================
format        d_qk  bytes  per-token layout (offsets in bytes)
============  ====  =====  ===================================================================
BF16          576   1152   576 x bf16 latent row: [0,512) nope (= V), [512,576) rope (also fp16;
              /512         d_qk 512 rows hold V = the whole row)
V32_FP8       576   656    [0,512) 512 x e4m3 nope | [512,528) 4 x fp32 scales (tile 128) |
                           [528,656) 64 x bf16 rope
MODEL1_FP8    512   584    per *block*: page_size rows x 576 B (448 x e4m3 nope + 64 x bf16 rope),
(= V4_FP8)                 then page_size rows x 8 B (7 x e8m0 scales, tile 64, 1 pad byte); the
                           block stride is padded to a multiple of 576 B. The [nb, B, 1, 584] view
                           is a container: token t's data is at block + 576 t, its scales at
                           block + 576 B + 8 t.
V41_FP8       512   528    [0,512) 512 x e4m3 (rope quantized too) | [512,528) 16 x e8m0 (tile 32)
V41_FP4       512   288    [0,256) 512 x e2m1, element i in byte i//2, even i in the low nibble |
                           [256,288) 32 x e4m3 scales (tile 16). Only as an extra cache.
============  ====  =====  ===================================================================

Scale recipes (FlashMLA ``tests/quant.py``): FP8 tiles use ``s = 2^ceil(log2(max(amax/448, 1e-4)))``
and ``q = e4m3(x / s)``; V32 stores ``s`` as fp32 (so it may also hold a non-power-of-two scale, see
``scale_mode="amax"``), the others store the e8m0 byte ``fp32_bits(s) >> 23``. FP4 tiles use
``scale = e4m3(clamp(amax / 6, 2^-9, 448))`` and e2m1 round-to-nearest-even with saturation to +-6.
Dequantization returns bf16, computed as ``bf16(fp32(q) * fp32(s))``; for power-of-two and e4m3 scales
this equals FlashMLA's bf16 multiply bit for bit.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

__all__ = [
    "KVCacheFormat",
    "FormatSpec",
    "detect_format",
    "quantize",
    "dequantize",
    "gather_rows",
    "cache_slots",
]

_E4M3_MAX = 448.0
_E2M1_MAX = 6.0


@dataclass(frozen=True)
class FormatSpec:
    bytes_per_token: int  # elements per token for BF16
    d_qk: int
    d_nope: int  # leading dims that are quantized (all 512 for V4.1)
    d_rope: int  # trailing dims stored as bf16 (0 when the rope part is quantized too)
    quant_tile: int
    num_scales: int
    per_block: bool  # MODEL1 keeps all data of a block first, then all scales


class KVCacheFormat(enum.Enum):
    """The KV-cache formats FlashMLA has defined (see the module docstring for byte layouts)."""

    BF16 = FormatSpec(576, 576, 576, 0, 0, 0, False)
    V32_FP8 = FormatSpec(656, 576, 512, 64, 128, 4, False)
    MODEL1_FP8 = FormatSpec(584, 512, 448, 64, 64, 7, True)
    V41_FP8 = FormatSpec(528, 512, 512, 0, 32, 16, False)
    V41_FP4 = FormatSpec(288, 512, 512, 0, 16, 32, False)

    @property
    def spec(self) -> FormatSpec:
        return self.value

    @property
    def is_quantized(self) -> bool:
        return self is not KVCacheFormat.BF16

    @property
    def data_bytes(self) -> int:
        """Bytes of one token's data row (before its scales)."""
        return {KVCacheFormat.V32_FP8: 656, KVCacheFormat.MODEL1_FP8: 576,
                KVCacheFormat.V41_FP8: 512, KVCacheFormat.V41_FP4: 256}[self]


V4_FP8 = KVCacheFormat.MODEL1_FP8  # FlashMLA renamed MODEL1 to V4 with the V4.1 release
_BY_BYTES = {f.spec.bytes_per_token: f for f in KVCacheFormat if f.is_quantized}
_BYTE_DTYPES = (torch.uint8, torch.int8, torch.float8_e4m3fn)


def detect_format(k_cache: torch.Tensor, name: str = "k_cache") -> KVCacheFormat:
    """Tell a cache's format from its dtype and ``k_cache.shape[-1]``, as FlashMLA does.

    bf16/fp16 caches are ``BF16`` (any d_qk); byte caches (uint8, int8 or float8_e4m3fn) are told by
    their bytes per token: 656 V32_FP8, 584 MODEL1_FP8, 528 V41_FP8, 288 V41_FP4. ``name`` is the argument
    named in errors.
    """
    if k_cache.dtype in (torch.bfloat16, torch.float16):
        return KVCacheFormat.BF16
    if k_cache.dtype in _BYTE_DTYPES:
        fmt = _BY_BYTES.get(k_cache.shape[-1])
        if fmt is None:
            raise ValueError(
                f"{name}: a quantized cache must have 656 (V3.2 FP8), 584 (MODEL1/V4 FP8), 528 (V4.1 FP8) or "
                f"288 (V4.1 FP4) bytes per token in its last dim, got shape {tuple(k_cache.shape)}")
        return fmt
    raise TypeError(f"{name}: expected bfloat16/float16 elements or uint8/int8/float8_e4m3fn bytes, got {k_cache.dtype}")


def _model1_block_bytes(page_size: int) -> int:
    return math.ceil(page_size * 584 / 576) * 576


def _fp8_scale_pow2(amax: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(torch.clamp(amax / _E4M3_MAX, min=1e-4))))


def _to_e4m3_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def _e4m3_bytes_to_float(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float8_e4m3fn).float()


def _e8m0_byte(s: torch.Tensor) -> torch.Tensor:
    return (s.float().contiguous().view(torch.int32) >> 23).to(torch.uint8)


def _e8m0_to_float(b: torch.Tensor) -> torch.Tensor:
    return (b.to(torch.int32) << 23).view(torch.float32)


# e2m1 magnitudes by code 0..7 and the midpoints between neighbours; a tie goes to the even code.
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    mag = x.abs()
    mid = torch.tensor(_E2M1_MIDPOINTS, dtype=x.dtype, device=x.device)
    code = (mag[..., None] > mid).sum(-1)
    odd_tie = (mag[..., None] == mid) & (torch.arange(7, device=x.device) % 2 == 1)
    code = code + odd_tie.sum(-1)
    code = torch.where(torch.isnan(x), torch.zeros_like(code), code)
    sign = (x < 0) & (code > 0)
    return (code + 8 * sign).to(torch.uint8)


def _e2m1_codes_to_float(c: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(_E2M1_VALUES, device=c.device)
    mag = lut[(c & 7).long()]
    return torch.where((c & 8) != 0, -mag, mag)


def _tiles(x: torch.Tensor, tile: int) -> torch.Tensor:
    return x.unflatten(-1, (x.shape[-1] // tile, tile))


def quantize(kv: torch.Tensor, fmt: KVCacheFormat, *, scale_mode: str = "pow2") -> torch.Tensor:
    """Quantize a paged bf16 latent cache into ``fmt``.

    Args:
        kv: ``[num_blocks, page_size, 1, d_qk]`` floating point (d_qk 576 for V32_FP8, 512 otherwise).
        fmt: a quantized :class:`KVCacheFormat`.
        scale_mode: ``"pow2"`` (FlashMLA's recipe) or ``"amax"`` (``s = amax / 448``, a non-power-of-two
            scale; only V32_FP8 stores fp32 scales that can hold it).

    Returns:
        ``[num_blocks, page_size, 1, bytes_per_token]`` uint8. For MODEL1_FP8 this is the strided
        container view of a per-block buffer (``stride(1) == 584``, block stride a multiple of 576).
    """
    if not isinstance(fmt, KVCacheFormat) or not fmt.is_quantized:
        raise ValueError(f"fmt: expected a quantized KVCacheFormat, got {fmt!r}")
    spec = fmt.spec
    if kv.dim() != 4 or kv.shape[2] != 1 or kv.shape[3] != spec.d_qk:
        raise ValueError(f"kv: expected [num_blocks, page_size, 1, {spec.d_qk}] for {fmt.name}, got {tuple(kv.shape)}")
    if scale_mode not in ("pow2", "amax"):
        raise ValueError(f"scale_mode: expected 'pow2' or 'amax', got {scale_mode!r}")
    if scale_mode == "amax" and fmt is not KVCacheFormat.V32_FP8:
        raise ValueError(f"scale_mode='amax' needs fp32 scales; {fmt.name} stores e8m0/e4m3 scales")
    nb, page, _, _ = kv.shape
    x = kv[:, :, 0].float()
    nope = _tiles(x[..., : spec.d_nope], spec.quant_tile)
    amax = nope.abs().amax(-1, keepdim=True)

    if fmt is KVCacheFormat.V41_FP4:
        scale_bytes = _to_e4m3_bytes(torch.clamp(amax / _E2M1_MAX, 2.0 ** -9, _E4M3_MAX))
        scale = _e4m3_bytes_to_float(scale_bytes)
        codes = _to_e2m1_codes(nope / scale).flatten(-2)
        packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
        row = torch.cat([packed, scale_bytes.flatten(-2)], -1)
        return row.view(nb, page, 1, 288)

    if scale_mode == "amax":
        scale = torch.where(amax > 0, amax / _E4M3_MAX, torch.ones_like(amax))
    else:
        scale = _fp8_scale_pow2(amax)
    data = _to_e4m3_bytes(nope / scale).flatten(-2)
    rope = x[..., spec.d_nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    if fmt is KVCacheFormat.V32_FP8:
        scales = scale.flatten(-2).contiguous().view(torch.uint8)
        return torch.cat([data, scales, rope], -1).view(nb, page, 1, 656)
    e8m0 = _e8m0_byte(scale).flatten(-2)
    if fmt is KVCacheFormat.V41_FP8:
        return torch.cat([data, e8m0], -1).view(nb, page, 1, 528)
    # MODEL1: a block holds every token's 576-byte data row, then every token's 8 scale bytes.
    block_bytes = _model1_block_bytes(page)
    raw = torch.zeros(nb, block_bytes, dtype=torch.uint8, device=kv.device)
    raw[:, : page * 576] = torch.cat([data, rope], -1).reshape(nb, page * 576)
    pad = torch.zeros(nb, page, 1, dtype=torch.uint8, device=kv.device)
    raw[:, page * 576: page * 584] = torch.cat([e8m0, pad], -1).reshape(nb, page * 8)
    return raw.as_strided((nb, page, 1, 584), (block_bytes, 584, 584, 1))


def _field_addresses(cache: torch.Tensor, fmt: KVCacheFormat, slots: torch.Tensor):
    """Byte addresses (into the cache's storage) of each slot's quantized data, scales and bf16 rope."""
    page = cache.shape[1]
    blk, off = slots // page, slots % page
    base = cache.storage_offset() * cache.element_size() + blk * cache.stride(0) * cache.element_size()
    if fmt is KVCacheFormat.MODEL1_FP8:
        data = base + off * 576
        return data, base + page * 576 + off * 8, data + 448
    data = base + off * cache.stride(1) * cache.element_size()
    return data, data + fmt.data_bytes if fmt is not KVCacheFormat.V32_FP8 else data + 512, data + 528


def _gather_bytes(flat: torch.Tensor, addr: torch.Tensor, n: int) -> torch.Tensor:
    return flat[addr[..., None] + torch.arange(n, device=addr.device)]


def gather_rows(cache: torch.Tensor, slots: torch.Tensor, fmt: KVCacheFormat | None = None) -> torch.Tensor:
    """Read the latent rows at ``slots`` (``block * page_size + offset``, every slot valid) as bf16.

    Works on any block stride (non-packed blocks) and on the MODEL1 per-block layout.

    Args:
        cache: ``[num_blocks, page_size, h_kv, d]`` bf16/fp16 or ``[num_blocks, page_size, 1, bytes]`` quantized.
        slots: int tensor of any shape.
    Returns:
        ``[*slots.shape, h_kv, d_qk]`` in the cache dtype for BF16 caches, else ``[*slots.shape, d_qk]`` bf16.
    """
    fmt = detect_format(cache) if fmt is None else fmt
    slots = slots.long()
    if not fmt.is_quantized:
        return cache[slots // cache.shape[1], slots % cache.shape[1]]
    spec = fmt.spec
    flat = torch.as_strided(cache.view(torch.uint8), (cache.untyped_storage().nbytes(),), (1,), 0)
    data_at, scale_at, rope_at = _field_addresses(cache, fmt, slots)
    if fmt is KVCacheFormat.V41_FP4:
        data = _gather_bytes(flat, data_at, 256)
        vals = _e2m1_codes_to_float(torch.stack([data & 0xF, data >> 4], -1).flatten(-2))
        scale = _e4m3_bytes_to_float(_gather_bytes(flat, scale_at, 32))
    else:
        vals = _e4m3_bytes_to_float(_gather_bytes(flat, data_at, spec.d_nope))
        if fmt is KVCacheFormat.V32_FP8:
            scale = _gather_bytes(flat, scale_at, 16).view(torch.float32)
        else:
            scale = _e8m0_to_float(_gather_bytes(flat, scale_at, spec.num_scales))
    out = (_tiles(vals, spec.quant_tile) * scale[..., None]).flatten(-2).to(torch.bfloat16)
    if spec.d_rope:
        out = torch.cat([out, _gather_bytes(flat, rope_at, 2 * spec.d_rope).view(torch.bfloat16)], -1)
    return out


def dequantize(cache: torch.Tensor, fmt: KVCacheFormat | None = None) -> torch.Tensor:
    """Dequantize a whole paged cache into bf16 ``[num_blocks, page_size, 1, d_qk]``.

    ``fmt`` defaults to :func:`detect_format`. A BF16 cache is returned as bf16.
    """
    fmt = detect_format(cache) if fmt is None else fmt
    if not fmt.is_quantized:
        return cache.to(torch.bfloat16)
    if cache.dim() != 4 or cache.shape[2] != 1 or cache.shape[3] != fmt.spec.bytes_per_token:
        raise ValueError(f"cache: expected [num_blocks, page_size, 1, {fmt.spec.bytes_per_token}], got {tuple(cache.shape)}")
    nb, page = cache.shape[:2]
    slots = torch.arange(nb * page, device=cache.device).view(nb, page)
    return gather_rows(cache, slots, fmt)[:, :, None]


def cache_slots(positions: torch.Tensor, block_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """Map per-request token positions to paged-cache slots ``block * page_size + offset``.

    Args:
        positions: ``[b, ...]`` int, token positions inside each request; ``-1`` stays ``-1``.
        block_table: ``[b, max_blocks]`` int32.
    Returns:
        int32 tensor shaped like ``positions`` (FlashMLA's ``abs_indices2indices_in_kvcache``).
    """
    b = positions.shape[0]
    flat = positions.reshape(b, -1).long()
    invalid = flat < 0
    blk = torch.gather(block_table.long(), 1, torch.where(invalid, 0, flat // page_size))
    slot = blk * page_size + torch.where(invalid, 0, flat % page_size)
    return torch.where(invalid, -1, slot).to(torch.int32).reshape(positions.shape)

