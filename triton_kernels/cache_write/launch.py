"""Launchers of the cache writer and the MLA prolog kernels (called by :mod:`anymla.layers`, which validates
the arguments first)."""

from __future__ import annotations

import torch
import triton

from anymla.kvcache import KVCacheFormat

from .. import runtime
from .kernel import (ROPE_INTERLEAVED, ROPE_NEOX, cache_write_kernel, mla_prolog_kernel,
                     q_assemble_kernel)

_FMT_CODE = {KVCacheFormat.BF16: 0, KVCacheFormat.V32_FP8: 1, KVCacheFormat.MODEL1_FP8: 2,
             KVCacheFormat.V41_FP8: 3, KVCacheFormat.V41_FP4: 4}
_ROPE_CODE = {"interleaved": ROPE_INTERLEAVED.value, "neox": ROPE_NEOX.value}


# (tokens per program, warps) on GPUs: 4 tokens keep every instantiation near 100 registers on sm_90 (8 tokens
# take 124-216, 16 up to 254: fewer resident blocks for a memory-bound kernel), see NOTES.md.
GPU_TILE = (4, 4)


def _tile() -> tuple[int, int]:
    # The interpreter pays per program: fewer, larger programs there.
    return (16, 4) if runtime.interpreting() else GPU_TILE


def _cache_geometry(cache: torch.Tensor, fmt: KVCacheFormat):
    """(pointer tensor, capacity in slots, page size, block stride, token stride); strides in the pointer's
    elements (bytes for quantized caches, where any byte dtype is viewed as uint8)."""
    nb, page = cache.shape[:2]
    ptr = cache if fmt is KVCacheFormat.BF16 else cache.view(torch.uint8)
    return ptr, nb * page, page, cache.stride(0), cache.stride(1)


def write_rows(cache: torch.Tensor, fmt: KVCacheFormat, latent: torch.Tensor, slots: torch.Tensor,
               tile: tuple[int, int] | None = None) -> None:
    """``latent [T, d_qk]`` (last dim contiguous) quantized into ``cache`` at ``slots [T]``; ``tile``
    (tokens per program, warps) overrides the default (the benchmark's sweep)."""
    n = latent.shape[0]
    if n == 0:
        return
    ptr, capacity, page, sb, st = _cache_geometry(cache, fmt)
    bt, warps = tile or _tile()
    cache_write_kernel[(triton.cdiv(n, bt),)](
        latent, latent.stride(0), slots, ptr, n, capacity, page, sb, st,
        FMT=_FMT_CODE[fmt], D=latent.shape[1], BLOCK_T=bt, num_warps=warps)


def mla_prolog(kv_a: torch.Tensor, kv_weight: torch.Tensor, kv_eps: float, q_lat, q_weight, q_eps: float, q_out,
               positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
               cache: torch.Tensor, fmt: KVCacheFormat, rope_style: str) -> None:
    """Fused RMSNorm (kv latent, and q latent when ``q_lat`` is given) + RoPE of k_pe + cache write."""
    n = kv_a.shape[0]
    if n == 0:
        return
    ptr, capacity, page, sb, st = _cache_geometry(cache, fmt)
    q_rank = 0 if q_lat is None else q_lat.shape[1]
    q_args = (kv_a, 0, kv_weight, 0.0, kv_a, 0) if q_lat is None else (q_lat, q_lat.stride(0), q_weight, q_eps,
                                                                        q_out, q_out.stride(0))
    bt, warps = _tile()
    mla_prolog_kernel[(triton.cdiv(n, bt),)](
        kv_a, kv_a.stride(0), kv_weight, kv_eps, *q_args, positions, cos, sin, cos.stride(0),
        slots, ptr, n, capacity, page, sb, st,
        FMT=_FMT_CODE[fmt], ROPE_STYLE=_ROPE_CODE[rope_style], Q_RANK=q_rank,
        Q_BLOCK=triton.next_power_of_2(max(q_rank, 1)), BLOCK_T=bt, num_warps=warps)


def assemble_q(q_nope_abs: torch.Tensor, q_pe: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, out: torch.Tensor, rope_style: str) -> None:
    """``out [T, h, 512 + 64] = [q_nope_abs [h, T, 512] | RoPE(q_pe [T, h, 64])]``."""
    h, n, d_lat = q_nope_abs.shape
    if n == 0:
        return
    block_h = min(16, triton.next_power_of_2(h))
    q_assemble_kernel[(n, triton.cdiv(h, block_h))](
        q_nope_abs, q_nope_abs.stride(0), q_nope_abs.stride(1), q_pe, q_pe.stride(0), q_pe.stride(1),
        positions, cos, sin, cos.stride(0), out, out.stride(0), out.stride(1), h,
        D_LAT=d_lat, ROPE_STYLE=_ROPE_CODE[rope_style], BLOCK_H=block_h, num_warps=4)
