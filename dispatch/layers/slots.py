"""Cache slots of DeepSeek Sparse Attention indices: the token positions an indexer picks (per request) turned
into the paged cache's ``block * page_size + offset`` slots the sparse decoding kernels read, with every
index the query may not attend dropped (-1): negative ones, those after the query's own position (causality)
and those past the request's block table.

:func:`sparse_slots` is one Triton launch where the Triton tier runs (the dozen small torch ops of
:func:`sparse_slots_reference` otherwise).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import kernels

__all__ = ["sparse_slots", "sparse_slots_reference"]

_INTS = (torch.int32, torch.int64)


def check_block_table(block_table, b_or_tokens: int, device: torch.device) -> None:
    """``block_table [b, max_blocks]`` int32 on ``device`` whose ``b`` divides ``b_or_tokens``."""
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2 or block_table.dtype != torch.int32:
        got = f"{tuple(getattr(block_table, 'shape', ()))} {getattr(block_table, 'dtype', type(block_table))}"
        raise ValueError(f"block_table: expected [b, max_blocks] int32, got {got}")
    if block_table.shape[0] == 0 or b_or_tokens % block_table.shape[0]:
        raise ValueError(f"block_table: expected a row per request ({b_or_tokens} tokens or queries in request "
                         f"order), got {block_table.shape[0]} rows")
    if block_table.device != device:
        raise ValueError(f"block_table: expected a tensor on {device}, got {block_table.device}")


def check_slot_inputs(indices, positions, block_table, page_size) -> None:
    """The arguments of :func:`sparse_slots`, as it checks them."""
    if not isinstance(indices, torch.Tensor) or indices.dim() != 3 or indices.dtype not in _INTS:
        raise ValueError(f"indices: expected [b, s, topk] int32/int64 token positions, got "
                         f"{tuple(getattr(indices, 'shape', ()))} {getattr(indices, 'dtype', type(indices))}")
    b, s, _ = indices.shape
    if not isinstance(positions, torch.Tensor) or positions.shape != (b, s) or positions.dtype not in _INTS:
        raise ValueError(f"positions: expected [b, s] = [{b}, {s}] int32/int64 (each query's own position), got "
                         f"{tuple(getattr(positions, 'shape', ()))} {getattr(positions, 'dtype', type(positions))}")
    check_block_table(block_table, b, indices.device)
    if block_table.shape[0] != b:
        raise ValueError(f"block_table: expected [b, max_blocks] with b = {b}, got {tuple(block_table.shape)}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size: expected a positive int, got {page_size!r}")
    if positions.device != indices.device:
        raise ValueError(f"positions: expected a tensor on {indices.device} (the indices' device), got "
                         f"{positions.device}")


def sparse_slots(indices: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor, page_size: int, *,
                 backend: Optional[str] = None) -> torch.Tensor:
    """Cache slots of DSA indices (FlashMLA's ``indices_in_kvcache``).

    Args:
        indices: ``[b, s, topk]`` int32/int64 token positions inside each request (any strides).
        positions: ``[b, s]`` int, each query's own position; an index after it is dropped.
        block_table: ``[b, max_blocks]`` int32; page_size: the cache's tokens per block.
        backend: ``"triton"`` or ``"torch"`` to force one.
    Returns:
        ``[b, s, topk]`` int32 ``block_table[i, p // page_size] * page_size + p % page_size`` of each index
        ``p``, -1 where ``p < 0``, ``p > positions[i, j]`` or ``p >= max_blocks * page_size``.
    """
    check_slot_inputs(indices, positions, block_table, page_size)
    return run_sparse_slots(kernels.choose(indices.device, backend)[0], indices, positions, block_table, page_size)


def run_sparse_slots(name: str, indices, positions, block_table, page_size: int) -> torch.Tensor:
    """:func:`sparse_slots` on arguments already checked, with the implementation ``name``."""
    if name == "torch":
        return sparse_slots_reference(indices, positions, block_table, page_size)
    from anymla.triton_kernels.cache_write import launch
    out = torch.empty(indices.shape, dtype=torch.int32, device=indices.device)
    launch.sparse_slots(indices, positions, block_table, page_size, out)
    return out


def sparse_slots_reference(indices: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
                           page_size: int) -> torch.Tensor:
    """:func:`sparse_slots` in PyTorch ops."""
    b = indices.shape[0]
    p = indices.long()
    keep = (p >= 0) & (p <= positions[..., None]) & (p < block_table.shape[1] * page_size)
    p = torch.where(keep, p, 0)
    blk = torch.gather(block_table.long(), 1, (p // page_size).reshape(b, -1)).view(p.shape)
    return torch.where(keep, blk * page_size + p % page_size, -1).to(torch.int32)
