"""The work of a DeepSeek V4 layer step around its GEMMs and attention, on either implementation: the prolog
(RMSNorm of the q latent; RMSNorm, RoPE and the cache write of the kv row) and the heads' norm and RoPE (the
query's, with each query's window slots; the output's rotation back). Fused Triton kernels
(:mod:`anymla.triton_kernels.cache_write.v4_kernel`) where the Triton tier runs, the model code's torch ops
otherwise; both round where the model code does.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kvcache import KVCacheFormat
from .cache_write import _write_reference
from .rope import RopeTable, apply_rope
from .slots import sparse_slots_reference

HEAD_DIM = 512  # V4's shared key/value head: the cache row
ROPE = 64  # its trailing rope channels


def rms_norm_v4(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """V4's RMSNorm: fp32 statistics; a weight (kept in fp32) multiplies the fp32 value before the one cast
    back, the unweighted form (q per head) multiplies ``x`` by the rounded factor."""
    if weight is None:
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    h = x.float()
    return (weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def rope_tail(x: torch.Tensor, positions: torch.Tensor, table: RopeTable) -> torch.Tensor:
    """Rotate the trailing 64 channels of ``x [..., 512]`` at ``positions`` in place (interleaved pairs, fp32
    math; ``x`` is the layer's own intermediate) and return it."""
    x[..., -ROPE:] = apply_rope(x[..., -ROPE:], positions, table).to(x.dtype)
    return x


def run_v4_prolog(name: str, fmt: KVCacheFormat, kv: torch.Tensor, kv_weight: torch.Tensor, eps: float,
                  q_lat: torch.Tensor, q_weight: torch.Tensor, positions: torch.Tensor, rope: RopeTable,
                  cache: torch.Tensor, block_table: torch.Tensor, bound=None) -> torch.Tensor:
    """``kv [T, 512]`` normed (``kv_weight``), its rope channels rotated at ``positions [T]`` and written into
    ``cache`` at the block table's slots of the positions (token t of request ``t // (T / b)``); returns
    ``q_lat [T, q_rank]`` normed (``q_weight``). ``name``: "triton" or "torch"; ``bound``: the plan's launcher
    (``cache_write.launch.v4_step_launchers``)."""
    if name == "torch":
        row = rope_tail(rms_norm_v4(kv, kv_weight, eps), positions, rope)
        per_request = positions.view(block_table.shape[0], -1, 1)
        slots = sparse_slots_reference(per_request, per_request[..., 0], block_table, cache.shape[1])
        _write_reference(cache, fmt, row, slots.view(-1))
        return rms_norm_v4(q_lat, q_weight, eps)
    from anymla.triton_kernels.cache_write import launch
    q_out = torch.empty_like(q_lat)
    launch.v4_prolog(kv, kv_weight, float(eps), q_lat, q_weight, q_out, positions.contiguous(), rope.cos, rope.sin,
                     block_table, cache, fmt, bound)
    return q_out


def run_v4_heads(name: str, x: torch.Tensor, positions: torch.Tensor, rope: RopeTable, eps: Optional[float],
                 bound=None, window_of: Optional[tuple] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The heads ``x [T, h, 512]`` RMS-normed without a weight (where ``eps`` is given), then their rope
    channels rotated at ``positions [T]`` by ``rope``'s angles: ``(heads, slots)``, the heads in place on the
    Triton tier. ``window_of``: ``(block_table [b, max_blocks], back [window], page_size)``, the ``T = b * s``
    queries in request order, ``back`` the offsets ``0 .. window - 1`` in ``positions``' dtype (the caller's, made
    once): ``slots [b, s, window]`` are each query's window slots (its position and the ``window - 1`` before it;
    -1 where negative or past the table), computed by the same launch on the Triton tier."""
    if name == "torch":
        heads = rope_tail(x if eps is None else rms_norm_v4(x, None, eps), positions[:, None], rope)
        if window_of is None:
            return heads, None
        block_table, back, page_size = window_of
        per_request = positions.view(block_table.shape[0], -1)
        return heads, sparse_slots_reference(per_request[..., None] - back, per_request, block_table, page_size)
    from anymla.triton_kernels.cache_write import launch
    slots = None
    if window_of is not None:
        block_table, back, page_size = window_of
        b, window = block_table.shape[0], back.shape[0]
        out = torch.empty(b, x.shape[0] // b, window, dtype=torch.int32, device=x.device)
        slots = launch.WindowSlots(block_table, x.shape[0] // b, window, page_size, out)
    launch.v4_heads(x, positions.contiguous(), rope.cos, rope.sin, eps, bound, slots)
    return x, None if slots is None else slots.out
