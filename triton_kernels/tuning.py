"""Tile configurations per device kind and regime. Measured values and their history: each kernel's NOTES.md.

A config never depends on the batch size when batch invariance is asked for (the tile shapes fix the
order of the floating-point sums, so they must be a function of one request only).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton


@dataclass(frozen=True)
class TileConfig:
    block_h: int  # query rows (heads, or s_q x heads for dense MQA packing) per program
    block_n: int  # keys per loop iteration
    num_warps: int
    num_stages: int
    skip_scale: bool = True  # block-uniform lazy rescale (else rescale every block)


def _rows_block(rows: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(rows)))


def sparse_config(kind: str, heads_per_group: int, d_qk: int, quantized: bool) -> TileConfig:
    """Tiles of the sparse kernel for ``heads_per_group`` query heads sharing one index list."""
    if kind == "interpret":
        # The interpreter costs per operation, not per element: few, large tiles.
        return TileConfig(_rows_block(heads_per_group, 64), 64, 4, 1)
    if kind == "npu":
        # Unified buffer budget (192 KB on A2/A3): [16, 512] fp32 accumulators plus a 32-row latent tile.
        return TileConfig(16, 32, 1, 1)
    bh = _rows_block(heads_per_group, 64)
    return TileConfig(bh, 64, 8 if bh == 64 else 4, 2)


def dense_config(kind: str, rows_per_kv_head: int, d_qk: int) -> TileConfig:
    """Tiles of the dense decode kernel for ``rows_per_kv_head = s_q * h_q / h_kv`` packed query rows."""
    if kind == "interpret":
        return TileConfig(_rows_block(rows_per_kv_head, 64), 64, 4, 1)
    if kind == "npu":
        return TileConfig(16, 32, 1, 1)
    bh = _rows_block(rows_per_kv_head, 64)
    return TileConfig(bh, 64, 8 if bh == 64 else 4, 2)
