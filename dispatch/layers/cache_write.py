"""The public cache writer: latent rows quantized on write into a paged cache of any anymla format.

Serving engines write each step's new latent rows (``[kv_latent | k_pe]`` after RMSNorm and RoPE) into the
paged cache at the slots their block tables give; :func:`write_cache` does that for every format
(bf16/fp16, V3.2 FP8 656 B, MODEL1/V4 FP8 584 B, V4.1 FP8 528 B, V4.1 FP4 288 B), with the bytes of
:func:`anymla.kvcache.quantize`.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import kvcache
from ..kvcache import KVCacheFormat, detect_format
from . import kernels

__all__ = ["write_cache", "write_cache_reference", "explain_write_cache"]

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def check_slot_count(cache: torch.Tensor, name: str = "cache") -> None:
    """Slots are int32 (FlashMLA's indices; the kernels divide them in 32 bits)."""
    if cache.shape[0] * cache.shape[1] >= 2 ** 31:
        raise ValueError(f"{name}: at most 2^31 - 1 slots (num_blocks * page_size) are addressable, got shape "
                         f"{tuple(cache.shape)}")


def _validate(cache: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor) -> KVCacheFormat:
    if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
        raise ValueError(f"cache: expected a 4-dim paged cache [num_blocks, page_size, 1, d], got "
                         f"{getattr(cache, 'shape', type(cache).__name__)}")
    fmt = detect_format(cache, "cache")
    if cache.shape[2] != 1:
        raise ValueError(f"cache: the MLA latent cache has one kv head (dim 2), got shape {tuple(cache.shape)}")
    if cache.stride(-1) != 1:
        raise ValueError(f"cache: the last dim must be contiguous, got strides {cache.stride()}")
    check_slot_count(cache)
    d = cache.shape[-1] if fmt is KVCacheFormat.BF16 else fmt.spec.d_qk
    if fmt is KVCacheFormat.BF16 and d not in (512, 576):
        raise ValueError(f"cache: a bf16/fp16 cache holds d_qk 576 or 512 per token, got {d}")
    if not isinstance(latent, torch.Tensor) or latent.dim() != 2 or latent.shape[1] != d:
        raise ValueError(f"latent: expected [num_tokens, {d}] for a {fmt.name} cache, got "
                         f"{tuple(getattr(latent, 'shape', ()))}")
    if latent.dtype not in _FLOATS:
        raise TypeError(f"latent: expected bfloat16, float16 or float32, got {latent.dtype}")
    if not isinstance(slots, torch.Tensor) or slots.dim() != 1 or slots.shape[0] != latent.shape[0]:
        raise ValueError(f"slots: expected [num_tokens] = [{latent.shape[0]}] int slots, got "
                         f"{tuple(getattr(slots, 'shape', ()))}")
    if slots.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slots: expected int32 or int64, got {slots.dtype}")
    for name, t in (("latent", latent), ("slots", slots)):
        if t.device != cache.device:
            raise ValueError(f"{name}: expected a tensor on {cache.device} (the cache's device), got {t.device}")
    return fmt


def write_cache(cache: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor, *,
                backend: Optional[str] = None) -> None:
    """Write latent rows into a paged MLA cache, quantizing on write (in place).

    Args:
        cache: ``[num_blocks, page_size, 1, d_qk]`` bf16/fp16 (d_qk 576 or 512), or a quantized cache
            ``[num_blocks, page_size, 1, bytes]`` of uint8/int8/float8_e4m3fn bytes told by its last dim
            (656 V3.2 FP8, 584 MODEL1/V4 FP8 (the per-block container view of :func:`anymla.kvcache.quantize`),
            528 V4.1 FP8, 288 V4.1 FP4). Any block stride (non-packed blocks).
        latent: ``[num_tokens, d_qk]`` bf16/fp16/fp32 rows ``[nope | rope]`` (576 for V3/V3.2 formats, 512
            for the V4 family), last dim contiguous.
        slots: ``[num_tokens]`` int32/int64 ``block * page_size + offset`` (:func:`anymla.kvcache.cache_slots`);
            slots ``< 0`` or ``>= num_blocks * page_size`` are skipped. Slots must be distinct.
        backend: ``"triton"`` or ``"torch"`` to force one (see :func:`explain_write_cache`).

    The bytes written are those of :func:`anymla.kvcache.quantize` on the same rows (pow2 scales; bf16/fp16
    rows exactly, fp32 rows but for tiles whose ``amax / 448`` lies a few ulps above a power of two).
    """
    fmt = _validate(cache, latent, slots)
    name, _ = kernels.choose(cache.device, backend)
    if latent.stride(-1) != 1:
        latent = latent.contiguous()
    if name == "torch":
        _write_reference(cache, fmt, latent, slots)
        return
    from anymla.triton_kernels.cache_write import launch
    launch.write_rows(cache, fmt, latent, slots.contiguous())


def explain_write_cache(device: torch.device, backend: Optional[str] = None) -> str:
    """Which implementation :func:`write_cache` runs on ``device``, and why."""
    name, reason = kernels.choose(torch.device(device), backend)
    return f"write_cache on {device}: {name} ({reason})"


def write_cache_reference(cache: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor) -> None:
    """:func:`write_cache` in PyTorch ops (the oracle of the Triton writer): each row goes through
    :func:`anymla.kvcache.quantize` and its bytes are scattered to the slot's fields."""
    _write_reference(cache, _validate(cache, latent, slots), latent, slots)


def _write_reference(cache: torch.Tensor, fmt: KVCacheFormat, latent: torch.Tensor, slots: torch.Tensor) -> None:
    nb, page = cache.shape[:2]
    slots = slots.long()
    keep = (slots >= 0) & (slots < nb * page)
    slots, rows = slots[keep], latent[keep]
    if fmt is KVCacheFormat.BF16:
        cache[slots // page, slots % page, 0] = rows.to(cache.dtype)
        return
    q = kvcache.quantize(rows.reshape(-1, 1, 1, rows.shape[1]), fmt)[:, 0, 0]
    flat = torch.as_strided(cache.view(torch.uint8), (cache.untyped_storage().nbytes(),), (1,), 0)
    data_at, scale_at, _ = kvcache._field_addresses(cache, fmt, slots)  # the layouts' one definition
    span = torch.arange(q.shape[1], device=cache.device)
    if fmt is KVCacheFormat.MODEL1_FP8:  # 576 data bytes, then the 8 scale bytes in the block's tail
        flat[data_at[:, None] + span[:576]] = q[:, :576]
        flat[scale_at[:, None] + span[:8]] = q[:, 576:]
    else:
        flat[data_at[:, None] + span] = q
