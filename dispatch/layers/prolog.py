"""The MLA prolog: RMSNorm of the latents, RoPE of k_pe and q_pe from a precomputed table, the cache write,
and the assembly of the attention query ``[absorbed q_nope | roped q_pe]``.

:func:`mla_prolog` is one Triton kernel (norms + RoPE + quantize-on-write) where the Triton tier runs;
:func:`mla_prolog_reference` is the same math in PyTorch ops (the model's RMSNorm code, RoPE in fp32, the
reference writer). Unfused, these are about a dozen small launches per layer and step.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..debug import debug_enabled
from ..kvcache import KVCacheFormat, detect_format
from . import kernels
from .cache_write import _write_reference, check_slot_count
from .rope import RopeTable, apply_rope, check_positions
from .slots import check_block_table, sparse_slots_reference

__all__ = ["mla_prolog", "mla_prolog_reference", "assemble_q", "assemble_q_reference", "rms_norm"]

_PROLOG_FORMATS = (KVCacheFormat.BF16, KVCacheFormat.V32_FP8)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepSeek's RMSNorm as the model code computes it: fp32 statistics, the normalized value cast back to
    ``x``'s dtype, then multiplied by the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def check_prolog_cache(cache: torch.Tensor, name: str = "cache") -> KVCacheFormat:
    """The format of a cache the V3 / V3.2 prolog writes (bf16/fp16 576 or V32_FP8)."""
    fmt = detect_format(cache, name)
    if fmt not in _PROLOG_FORMATS or cache.shape[-1] not in (576, 656) or cache.dim() != 4 or cache.shape[2] != 1:
        raise ValueError(f"{name}: the V3 / V3.2 prolog writes d_qk 576 rows into a bf16/fp16 or V32_FP8 cache "
                         f"[num_blocks, page_size, 1, 576 | 656], got {fmt.name} of shape {tuple(cache.shape)}")
    if cache.stride(-1) != 1:
        raise ValueError(f"{name}: the last dim must be contiguous, got strides {cache.stride()}")
    check_slot_count(cache, name)
    return fmt


def _check(kv_a, positions, slots, cache, rope: RopeTable, q_lat, q_norm_weight, block_table=None) -> KVCacheFormat:
    fmt = check_prolog_cache(cache)
    if kv_a.dim() != 2 or kv_a.shape[1] != 576 or kv_a.stride(-1) != 1:
        raise ValueError(f"kv_a: expected [num_tokens, 576] (latent 512 | k_pe 64, last dim contiguous), got "
                         f"{tuple(kv_a.shape)} with strides {kv_a.stride()}")
    n = kv_a.shape[0]
    if (slots is None) == (block_table is None):
        raise ValueError("slots / block_table: expected exactly one of them (the slots, or the block table to take "
                         f"them from), got {'neither' if slots is None else 'both'}")
    for name, t in (("positions", positions), ("slots", slots)):
        if t is not None and (t.shape != (n,) or t.dtype not in (torch.int32, torch.int64)):
            raise ValueError(f"{name}: expected [num_tokens] = [{n}] int32/int64, got {tuple(t.shape)} {t.dtype}")
    if block_table is not None:
        check_block_table(block_table, n, cache.device)
    if rope.cos.shape[-1] != 32:
        raise ValueError(f"rope: expected a table for rope_dim 64 (32 angles), got {tuple(rope.cos.shape)}")
    if q_lat is not None and (q_lat.dim() != 2 or q_lat.shape[0] != n or q_lat.stride(-1) != 1
                              or q_norm_weight is None or q_norm_weight.shape != (q_lat.shape[1],)):
        raise ValueError(f"q_lat / q_norm_weight: expected [num_tokens, q_lora_rank] (last dim contiguous) and "
                         f"[q_lora_rank], got {tuple(q_lat.shape)} and "
                         f"{None if q_norm_weight is None else tuple(q_norm_weight.shape)}")
    return fmt


def mla_prolog(kv_a: torch.Tensor, kv_norm_weight: torch.Tensor, kv_eps: float, positions: torch.Tensor,
               rope: RopeTable, cache: torch.Tensor, slots: Optional[torch.Tensor], *,
               q_lat: Optional[torch.Tensor] = None, q_norm_weight: Optional[torch.Tensor] = None,
               q_eps: float = 1e-6, block_table: Optional[torch.Tensor] = None,
               backend: Optional[str] = None) -> Optional[torch.Tensor]:
    """RMSNorm of the kv latent, RoPE of k_pe, and the ``[latent | k_pe]`` row written into ``cache``.

    Args:
        kv_a: ``[T, 576]`` the kv_a projection's output (512 latent, then 64 k_pe), bf16/fp16.
        kv_norm_weight: ``[512]``; kv_eps its epsilon.
        positions: ``[T]`` int token positions (rows of ``rope``).
        rope: the cos / sin table and layout; cache: a bf16/fp16 ``[nb, page, 1, 576]`` or V32_FP8 cache.
        slots: ``[T]`` int cache slots (``< 0`` skipped), or None with ``block_table``.
        q_lat, q_norm_weight, q_eps: the q latent ``[T, q_lora_rank]`` to normalize in the same launch.
        block_table: ``[b, max_blocks]`` int32 instead of ``slots``: token ``t`` is at ``positions[t]`` of
            request ``t // (T / b)`` and goes to that position's slot (none for a position past the table),
            computed in the kernel.
    Returns:
        the normalized q latent (``q_lat``'s shape and dtype), or None without ``q_lat``.
    """
    fmt = _check(kv_a, positions, slots, cache, rope, q_lat, q_norm_weight, block_table)
    if debug_enabled():
        check_positions(positions, rope)
    name, _ = kernels.choose(cache.device, backend)
    return run_prolog(name, fmt, kv_a, kv_norm_weight, kv_eps, positions, rope, cache, slots, block_table, q_lat,
                      q_norm_weight, q_eps)


def mla_prolog_reference(kv_a: torch.Tensor, kv_norm_weight: torch.Tensor, kv_eps: float, positions: torch.Tensor,
                         rope: RopeTable, cache: torch.Tensor, slots: Optional[torch.Tensor], *,
                         q_lat: Optional[torch.Tensor] = None, q_norm_weight: Optional[torch.Tensor] = None,
                         q_eps: float = 1e-6, block_table: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """:func:`mla_prolog` in PyTorch ops."""
    fmt = _check(kv_a, positions, slots, cache, rope, q_lat, q_norm_weight, block_table)
    return run_prolog("torch", fmt, kv_a, kv_norm_weight, kv_eps, positions, rope, cache, slots, block_table, q_lat,
                      q_norm_weight, q_eps)


def run_prolog(name: str, fmt: KVCacheFormat, kv_a, kv_norm_weight, kv_eps, positions, rope, cache, slots, block_table,
               q_lat, q_norm_weight, q_eps, bound=None):
    """:func:`mla_prolog` on arguments already checked, with the implementation ``name`` ("triton" / "torch");
    ``bound``: the caller's launcher for this call signature (``cache_write.launch.step_launchers``)."""
    if name == "torch":
        if slots is None:
            b = block_table.shape[0]
            per_request = positions.view(b, -1, 1)
            slots = sparse_slots_reference(per_request, per_request[..., 0], block_table, cache.shape[1]).view(-1)
        latent = rms_norm(kv_a[:, :512], kv_norm_weight, kv_eps)
        row = torch.cat([latent.float(), apply_rope(kv_a[:, 512:], positions, rope)], -1)
        _write_reference(cache, fmt, row, slots)
        return None if q_lat is None else rms_norm(q_lat, q_norm_weight, q_eps)
    from anymla.triton_kernels.cache_write import launch
    q_out = None if q_lat is None else torch.empty_like(q_lat)
    launch.mla_prolog(kv_a, kv_norm_weight, float(kv_eps), q_lat, q_norm_weight, float(q_eps), q_out,
                      positions.contiguous(), rope.cos, rope.sin, None if slots is None else slots.contiguous(),
                      block_table, cache, fmt, rope.style, bound)
    return q_out


def _check_q(q_nope_abs, q_pe, positions, out):
    if q_nope_abs is None:
        if out is None or out.dim() != 3 or out.shape[-1] != 576:
            raise ValueError("out: without q_nope_abs, expected the query [T, h, 576] whose first 512 columns hold "
                             f"the absorbed q, got {None if out is None else tuple(out.shape)}")
        n, h, _ = out.shape
    else:
        h, n, d = q_nope_abs.shape
        if d != 512 or q_nope_abs.stride(-1) != 1:
            raise ValueError(f"q_nope_abs: expected [h, T, 512] with a contiguous last dim, got "
                             f"{tuple(q_nope_abs.shape)}")
    if q_pe.shape != (n, h, 64) or q_pe.stride(-1) != 1:
        raise ValueError(f"q_pe: expected [T, h, 64] = [{n}, {h}, 64] with a contiguous last dim, got "
                         f"{tuple(q_pe.shape)} strides {q_pe.stride()}")
    if positions.shape != (n,):
        raise ValueError(f"positions: expected [T] = [{n}], got {tuple(positions.shape)}")
    if out is not None and (out.shape != (n, h, 576) or out.stride(-1) != 1):
        raise ValueError(f"out: expected [T, h, 576] = [{n}, {h}, 576] with a contiguous last dim, "
                         f"got {tuple(out.shape)}")


def assemble_q(q_nope_abs: Optional[torch.Tensor], q_pe: torch.Tensor, positions: torch.Tensor, rope: RopeTable, *,
               out: Optional[torch.Tensor] = None, backend: Optional[str] = None) -> torch.Tensor:
    """The attention query ``[T, h, 576] = [q_nope_abs [h, T, 512] transposed | RoPE(q_pe [T, h, 64])]`` in
    ``q_nope_abs``'s dtype (one launch: the absorbed bmm's output is transposed while q_pe is rotated).

    ``q_nope_abs`` None: ``out``'s first 512 columns hold the absorbed q already (the bmm wrote them there,
    ``torch.bmm(q_nope, w_uk, out=out[..., :512].transpose(0, 1))``) and only q_pe is rotated into the rest."""
    _check_q(q_nope_abs, q_pe, positions, out)
    if debug_enabled():
        check_positions(positions, rope)
    if out is None:
        h, n, _ = q_nope_abs.shape
        out = torch.empty(n, h, 576, dtype=q_nope_abs.dtype, device=q_nope_abs.device)
    run_assemble_q(kernels.choose(out.device, backend)[0], q_nope_abs, q_pe, positions, rope, out)
    return out


def run_assemble_q(name: str, q_nope_abs, q_pe, positions, rope, out, bound=None, slots_of=None):
    """:func:`assemble_q` on arguments already checked, with the implementation ``name``, into ``out``
    (``bound``: as :func:`run_prolog`'s). ``slots_of``: ``(indices [b, s, topk], block_table, page_size)``
    (checked as :func:`~anymla.layers.sparse_slots` checks them, the ``T = b * s`` tokens being the queries in
    request order): their cache slots come back, computed by the same launch on the Triton tier."""
    if name == "torch":
        pe = apply_rope(q_pe, positions[:, None], rope).to(out.dtype)
        if q_nope_abs is None:
            out[..., 512:] = pe
        else:
            out.copy_(torch.cat([q_nope_abs.transpose(0, 1), pe], -1))
        if slots_of is None:
            return None
        indices, block_table, page_size = slots_of
        return sparse_slots_reference(indices, positions.view(indices.shape[:2]), block_table, page_size)
    from anymla.triton_kernels.cache_write import launch
    slots = None
    if slots_of is not None:
        indices, block_table, page_size = slots_of
        slots = launch.QuerySlots(indices, block_table, page_size,
                                  torch.empty(indices.shape, dtype=torch.int32, device=indices.device))
    launch.assemble_q(q_nope_abs, q_pe, positions.contiguous(), rope.cos, rope.sin, out, rope.style, bound, slots)
    return None if slots is None else slots.out


def assemble_q_reference(q_nope_abs: torch.Tensor, q_pe: torch.Tensor, positions: torch.Tensor,
                         rope: RopeTable) -> torch.Tensor:
    """:func:`assemble_q` in PyTorch ops."""
    _check_q(q_nope_abs, q_pe, positions, None)
    pe = apply_rope(q_pe, positions[:, None], rope).to(q_nope_abs.dtype)
    return torch.cat([q_nope_abs.transpose(0, 1), pe], -1)
