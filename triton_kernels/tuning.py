"""Tile configurations per device kind and regime. Measured values and their history: each kernel's NOTES.md.

A config never depends on the batch size when batch invariance is asked for (the tile shapes fix the
order of the floating-point sums, so they must be a function of one request only).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import triton


@dataclass(frozen=True)
class TileConfig:
    block_h: int  # query rows (heads, or s_q x heads for dense MQA packing) per program
    block_n: int  # keys per loop iteration
    num_warps: int
    num_stages: int
    # Lazy rescale with a block-uniform branch that skips the multiply when no row needs it (True), or with
    # a per-row select and an unconditional multiply by alpha (False). Both keep p <= 2^threshold.
    skip_scale: bool = True

    @property
    def programs_per_core(self) -> int:
        """Programs of this tile one GPU multiprocessor holds at once: the kernels use ~255 registers a
        thread, so 8 warps take the whole register file and 4 warps half of it."""
        return 1 if self.num_warps >= 8 else 2


def forced(tile: Optional["TileConfig"] = None, num_splits: Optional[int] = None, tma: Optional[bool] = None,
           portable: Optional[bool] = None, warp_specialized: Optional[bool] = None):
    """Pin the tile config, split count, use of TMA tiles, of Ascend-portable loads and/or of the
    warp-specialized Hopper kernels of every call inside the block (sweeps and tests); a context manager.

    Scoped like ``anymla.use_backend`` (a context variable, so threads and tasks do not see each other's) and
    part of the dispatcher's decision key: plans made inside the block are never reused outside it."""
    from anymla.selection import scoped_settings
    return scoped_settings(triton_tile=tile, triton_num_splits=num_splits, triton_tma=tma,
                           triton_portable=portable, triton_warp_specialized=warp_specialized)


def _forced(name: str):
    from anymla.selection import settings
    return settings().get("triton_" + name)


def forced_tile() -> Optional["TileConfig"]:
    return _forced("tile")


def forced_splits() -> Optional[int]:
    return _forced("num_splits")


def forced_tma() -> Optional[bool]:
    return _forced("tma")


def forced_portable() -> Optional[bool]:
    return _forced("portable")


def forced_warp_specialized() -> Optional[bool]:
    return _forced("warp_specialized")


def _rows_block(rows: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(rows)))


# GPUs whose blocks get 99 KB of shared memory (sm_86, sm_89, sm_120): the H200's few-head tile, which
# compile_report (--arch 86/89 --shipped) finds within it for every kernel; not measured on such a GPU.
_SMALL_SMEM_TILE = TileConfig(16, 32, 4, 6)


# Blackwell datacenter GPUs (sm_100): Triton lowers the 64-key tiles with more staging there (345 KB); 32 keys
# and 3 stages fit the 227 KB with gathers prefetched (compile_report --arch 100 --shipped); not measured.
_SM100_TILE = TileConfig(64, 32, 8, 3, False)


def _portable(kind: str, rows: int, quantized: bool = False) -> Optional[TileConfig]:
    """The configs that do not depend on the op: a forced one, the interpreter's, AMD's and Ascend's."""
    tile = forced_tile()
    if tile is not None:
        return tile
    if kind == "interpret":
        # The interpreter costs per operation, not per element: few, large tiles.
        return TileConfig(_rows_block(rows, 64), 64, 4, 1)
    if kind == "rocm":
        # 64 KB of LDS a block (MI300X, MI250): the largest head blocks that compile there without spills
        # (compile_report --arch gfx942); never run on an AMD GPU.
        return TileConfig(64, 16, 4, 1) if _rows_block(rows, 64) == 64 else TileConfig(16, 32, 4, 2)
    if kind == "npu":
        # Unified buffer budget (192 KB on A2/A3): a [16, 512] fp32 accumulator plus a 32-row latent tile; the
        # triton-ascend compile check (ascend_compile_check.py) found that dequantizing 32 rows overflows it for
        # every quantized format, and that 8 rows fit every format and extra-cache pairing.
        return TileConfig(16, 8 if quantized else 32, 1, 1)
    return None


def sparse_config(kind: str, heads_per_group: int, quantized: bool, fmt: str = "") -> TileConfig:
    """Tiles of the sparse kernel for ``heads_per_group`` query heads sharing one index list (``fmt``: the
    main cache's format name, for the formats whose few-head tile differs)."""
    tile = _portable(kind, heads_per_group, quantized)
    if tile is not None:
        return tile
    if kind == "cuda_small_smem":
        return dataclasses.replace(_SMALL_SMEM_TILE, skip_scale=False)
    # BLOCK_H 64 needs 8 warps: its [64, 512] fp32 accumulator alone is 256 registers a thread with 4.
    # H200 sweep (NOTES.md, 2026-11-29): per-row lazy rescale beats the block-wide branch; quantized caches
    # do best without prefetch (the dequantized tile already fills shared memory), bf16 with 3 stages.
    # With few heads (tensor parallelism) decoding is bound by the latency of the gathered rows: 32-row blocks
    # and 6 stages keep several blocks in flight (the pipeliner prefetches gathers only from 5 stages on),
    # 1.2-1.9x faster than 64 rows and 2 stages on the H200 (sweep run 13).
    bh = _rows_block(heads_per_group, 64)
    if bh < 64 and fmt == "MODEL1_FP8":
        # H200 tp sweep, 2026-12-01 (sparse_mla/NOTES.md): MODEL1 at 16 heads (+512 extra) 292 µs with 64-key blocks
        # on 8 warps (one stage: two do not fit), 437 µs with the 32-key, 6-stage tile of the other formats.
        return TileConfig(bh, 64, 8, 1, False)
    if bh < 64:
        return TileConfig(bh, 32, 4, 6, False) if quantized else TileConfig(bh, 64, 4, 2, False)
    if kind == "cuda_sm100" and not quantized:
        return _SM100_TILE  # Hopper's 3 stages of 64 keys need 345 KB on sm_100
    return TileConfig(64, 64, 8, 1 if quantized else 3, False)


def dense_config(kind: str, rows_per_kv_head: int) -> TileConfig:
    """Tiles of the dense decode kernel for ``rows_per_kv_head = s_q * h_q / h_kv`` packed query rows."""
    tile = _portable(kind, rows_per_kv_head)
    if tile is not None:
        return tile
    if kind == "cuda_small_smem":
        return _SMALL_SMEM_TILE
    # H200 sweeps (NOTES.md, 2026-11-29): 64 keys a block with 2 TMA stages for the compute-bound regime;
    # with few rows (memory-bound) 32 keys and 6 stages (0.97x copy; 4 stages gave 0.72x).
    bh = _rows_block(rows_per_kv_head, 64)
    if bh < 64:
        return TileConfig(bh, 32, 4, 6, True)
    return _SM100_TILE if kind == "cuda_sm100" else TileConfig(64, 64, 8, 2, False)


# The warp-specialized Hopper kernels (hopper/): 64 query rows, three 4-warp partitions, lazy rescale per
# row; 64-key blocks in 2 stages fill the 227 KB of shared memory with the queries (H200, 2026-11-29, dense:
# 32-key blocks in 4 stages were 40 % slower, dense_decode/NOTES.md).
_WARP_SPECIALIZED = TileConfig(64, 64, 12, 2, False)


# Whether the Hopper kernels take calls with fewer than 33 query rows a kv head (tensor-parallel head counts),
# masking the rest of their 64-row tile, and the measurement behind each answer.
HOPPER_FEW_ROWS = {
    "sparse_prefill": (True, "H200, 2026-12-01: h_q 16 d_qk 576 2911 µs on the Hopper kernel with heads padded to 64 "
                             "vs 3332 portable; h_q 32 d_qk 512 2502 vs 4084"),
    "sparse_decode": (True, "H200, 2026-12-01, b128 s_q 1 topk 2048: V3.2 h_q 16 127 µs on the Hopper kernel vs 217 "
                            "portable, h_q 8 125 vs 212; V4.1 + 512 FP4 extra h_q 16 264 vs 283"),
    "dense_decode": (False, "H200, 2026-11-29: the portable kernel decodes b128 h_q 16 at 0.94x copy"),
}


def warp_specialized_config() -> Optional[TileConfig]:
    """The tile of the Hopper kernels, or None when a tile meant for the portable kernels is forced (the
    Hopper kernels' tiles are told apart by their 12 warps)."""
    tile = forced_tile() or _WARP_SPECIALIZED
    return tile if tile.num_warps == 12 else None
