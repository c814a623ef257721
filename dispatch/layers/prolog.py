"""The MLA prolog: RMSNorm of the latents, RoPE of k_pe and q_pe from a precomputed table, the cache write,
and the assembly of the attention query ``[absorbed q_nope | roped q_pe]``.

:func:`mla_prolog` is one Triton kernel (norms + RoPE + quantize-on-write) where the Triton tier runs;
:func:`mla_prolog_reference` is the same math in PyTorch ops (the model's RMSNorm code, RoPE in fp32, the
reference writer). Unfused, these are about a dozen small launches per layer and step.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kvcache import KVCacheFormat, detect_format
from . import kernels
from .cache_write import _write_reference
from .rope import RopeTable, apply_rope

__all__ = ["mla_prolog", "mla_prolog_reference", "assemble_q", "assemble_q_reference", "rms_norm"]

_PROLOG_FORMATS = (KVCacheFormat.BF16, KVCacheFormat.V32_FP8)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepSeek's RMSNorm as the model code computes it: fp32 statistics, the normalized value cast back to
    ``x``'s dtype, then multiplied by the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _check(kv_a, positions, slots, cache, rope: RopeTable, q_lat, q_norm_weight) -> KVCacheFormat:
    fmt = detect_format(cache, "cache")
    if fmt not in _PROLOG_FORMATS or cache.shape[-1] not in (576, 656):
        raise ValueError(f"cache: the V3 / V3.2 prolog writes d_qk 576 rows into a bf16/fp16 or V32_FP8 cache, "
                         f"got {fmt.name} with last dim {cache.shape[-1]}")
    if kv_a.dim() != 2 or kv_a.shape[1] != 576 or kv_a.stride(-1) != 1:
        raise ValueError(f"kv_a: expected [num_tokens, 576] (latent 512 | k_pe 64, last dim contiguous), got "
                         f"{tuple(kv_a.shape)} with strides {kv_a.stride()}")
    n = kv_a.shape[0]
    for name, t in (("positions", positions), ("slots", slots)):
        if t.shape != (n,) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: expected [num_tokens] = [{n}] int32/int64, got {tuple(t.shape)} {t.dtype}")
    if rope.cos.shape[-1] != 32:
        raise ValueError(f"rope: expected a table for rope_dim 64 (32 angles), got {tuple(rope.cos.shape)}")
    if q_lat is not None and (q_lat.dim() != 2 or q_lat.shape[0] != n or q_lat.stride(-1) != 1
                              or q_norm_weight is None or q_norm_weight.shape != (q_lat.shape[1],)):
        raise ValueError(f"q_lat / q_norm_weight: expected [num_tokens, q_lora_rank] (last dim contiguous) and "
                         f"[q_lora_rank], got {tuple(q_lat.shape)} and "
                         f"{None if q_norm_weight is None else tuple(q_norm_weight.shape)}")
    return fmt


def mla_prolog(kv_a: torch.Tensor, kv_norm_weight: torch.Tensor, kv_eps: float, positions: torch.Tensor,
               rope: RopeTable, cache: torch.Tensor, slots: torch.Tensor, *, q_lat: Optional[torch.Tensor] = None,
               q_norm_weight: Optional[torch.Tensor] = None, q_eps: float = 1e-6,
               backend: Optional[str] = None) -> Optional[torch.Tensor]:
    """RMSNorm of the kv latent, RoPE of k_pe, and the ``[latent | k_pe]`` row written into ``cache``.

    Args:
        kv_a: ``[T, 576]`` the kv_a projection's output (512 latent, then 64 k_pe), bf16/fp16.
        kv_norm_weight: ``[512]``; kv_eps its epsilon.
        positions: ``[T]`` int token positions (rows of ``rope``); slots ``[T]`` cache slots (``< 0`` skipped).
        rope: the cos / sin table and layout; cache: a bf16/fp16 ``[nb, page, 1, 576]`` or V32_FP8 cache.
        q_lat, q_norm_weight, q_eps: the q latent ``[T, q_lora_rank]`` to normalize in the same launch.
    Returns:
        the normalized q latent (``q_lat``'s shape and dtype), or None without ``q_lat``.
    """
    fmt = _check(kv_a, positions, slots, cache, rope, q_lat, q_norm_weight)
    name, _ = kernels.choose(cache.device, backend)
    if name == "torch":
        return _prolog_reference(kv_a, kv_norm_weight, kv_eps, positions, rope, cache, fmt, slots, q_lat,
                                 q_norm_weight, q_eps)
    from anymla.triton_kernels.cache_write import launch
    q_out = None if q_lat is None else torch.empty_like(q_lat)
    launch.mla_prolog(kv_a, kv_norm_weight, float(kv_eps), q_lat, q_norm_weight, float(q_eps), q_out,
                      positions.contiguous(), rope.cos, rope.sin, slots.contiguous(), cache, fmt, rope.style)
    return q_out


def mla_prolog_reference(kv_a: torch.Tensor, kv_norm_weight: torch.Tensor, kv_eps: float, positions: torch.Tensor,
                         rope: RopeTable, cache: torch.Tensor, slots: torch.Tensor, *,
                         q_lat: Optional[torch.Tensor] = None, q_norm_weight: Optional[torch.Tensor] = None,
                         q_eps: float = 1e-6) -> Optional[torch.Tensor]:
    """:func:`mla_prolog` in PyTorch ops."""
    fmt = _check(kv_a, positions, slots, cache, rope, q_lat, q_norm_weight)
    return _prolog_reference(kv_a, kv_norm_weight, kv_eps, positions, rope, cache, fmt, slots, q_lat,
                             q_norm_weight, q_eps)


def _prolog_reference(kv_a, kv_norm_weight, kv_eps, positions, rope, cache, fmt, slots, q_lat, q_norm_weight, q_eps):
    latent = rms_norm(kv_a[:, :512], kv_norm_weight, kv_eps)
    row = torch.cat([latent.float(), apply_rope(kv_a[:, 512:], positions, rope)], -1)
    _write_reference(cache, fmt, row, slots)
    return None if q_lat is None else rms_norm(q_lat, q_norm_weight, q_eps)


def _check_q(q_nope_abs, q_pe, positions, out):
    h, n, d = q_nope_abs.shape
    if d != 512 or q_nope_abs.stride(-1) != 1:
        raise ValueError(f"q_nope_abs: expected [h, T, 512] with a contiguous last dim, got {tuple(q_nope_abs.shape)}")
    if q_pe.shape != (n, h, 64) or q_pe.stride(-1) != 1:
        raise ValueError(f"q_pe: expected [T, h, 64] = [{n}, {h}, 64] with a contiguous last dim, got "
                         f"{tuple(q_pe.shape)} strides {q_pe.stride()}")
    if positions.shape != (n,):
        raise ValueError(f"positions: expected [T] = [{n}], got {tuple(positions.shape)}")
    if out is not None and (out.shape != (n, h, 576) or out.stride(-1) != 1):
        raise ValueError(f"out: expected [T, h, 576] = [{n}, {h}, 576] with a contiguous last dim, "
                         f"got {tuple(out.shape)}")


def assemble_q(q_nope_abs: torch.Tensor, q_pe: torch.Tensor, positions: torch.Tensor, rope: RopeTable, *,
               out: Optional[torch.Tensor] = None, backend: Optional[str] = None) -> torch.Tensor:
    """The attention query ``[T, h, 576] = [q_nope_abs [h, T, 512] transposed | RoPE(q_pe [T, h, 64])]`` in
    ``q_nope_abs``'s dtype (one launch: the absorbed bmm's output is transposed while q_pe is rotated)."""
    _check_q(q_nope_abs, q_pe, positions, out)
    h, n, _ = q_nope_abs.shape
    out = torch.empty(n, h, 576, dtype=q_nope_abs.dtype, device=q_nope_abs.device) if out is None else out
    name, _ = kernels.choose(q_nope_abs.device, backend)
    if name == "torch":
        out.copy_(assemble_q_reference(q_nope_abs, q_pe, positions, rope))
        return out
    from anymla.triton_kernels.cache_write import launch
    launch.assemble_q(q_nope_abs, q_pe, positions.contiguous(), rope.cos, rope.sin, out, rope.style)
    return out


def assemble_q_reference(q_nope_abs: torch.Tensor, q_pe: torch.Tensor, positions: torch.Tensor,
                         rope: RopeTable) -> torch.Tensor:
    """:func:`assemble_q` in PyTorch ops."""
    _check_q(q_nope_abs, q_pe, positions, None)
    pe = apply_rope(q_pe, positions[:, None], rope).to(q_nope_abs.dtype)
    return torch.cat([q_nope_abs.transpose(0, 1), pe], -1)
