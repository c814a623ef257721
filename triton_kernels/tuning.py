"""Tile configurations per device kind and regime. Measured values and their history: each kernel's NOTES.md.

A config never depends on the batch size when batch invariance is asked for (the tile shapes fix the
order of the floating-point sums, so they must be a function of one request only).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
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
           portable: Optional[bool] = None, warp_specialized: Optional[bool] = None, mma_v2: Optional[bool] = None):
    """Pin the tile config, split count, use of TMA tiles, of Ascend-portable loads, of the warp-specialized
    Hopper kernels and/or of the ``mma_v2`` kernels (``ampere/``) of every call inside the block (sweeps and
    tests); a context manager.

    Scoped like ``anymla.use_backend`` (a context variable, so threads and tasks do not see each other's) and
    part of the dispatcher's decision key: plans made inside the block are never reused outside it."""
    from anymla.selection import scoped_settings
    return scoped_settings(triton_tile=tile, triton_num_splits=num_splits, triton_tma=tma,
                           triton_portable=portable, triton_warp_specialized=warp_specialized,
                           triton_mma_v2=mma_v2)


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


# ANYMLA_HOPPER_KERNELS=0 (read when anymla is imported) switches the Hopper kernels off for the whole process:
# a Hopper GPU then runs every call on the portable kernels, as the other GPUs do (the stand-in of
# `bench --portable`, for whole test suites). A scoped tuning.forced(warp_specialized=...) still wins.
_HOPPER_OFF_BY_ENV = os.environ.get("ANYMLA_HOPPER_KERNELS") == "0"


def forced_warp_specialized() -> Optional[bool]:
    scoped = _forced("warp_specialized")
    return False if scoped is None and _HOPPER_OFF_BY_ENV else scoped


# ANYMLA_MMA_V2=0 likewise switches the mma_v2 kernels off for the whole process (the portable kernel then serves
# the GPUs they would); a scoped tuning.forced(mma_v2=...) still wins.
_MMA_V2_OFF_BY_ENV = os.environ.get("ANYMLA_MMA_V2") == "0"


def forced_mma_v2() -> Optional[bool]:
    scoped = _forced("mma_v2")
    return False if scoped is None and _MMA_V2_OFF_BY_ENV else scoped


def _rows_block(rows: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(rows)))


# ---------------------------------------------------------------- the tile table
#
# TILES[kind, op, rows, cache] is the tile of the portable kernels and the measurement or compile check it
# rests on, where
#   kind   is a runtime.device_kind, or DEFAULT: the H200's measured tiles, which every kind runs in the regimes
#          it has no row for (sm_90; sm_80, where compile_report --arch 80 finds them within its 163 KB but for
#          one, never run there; sm_100 but for its own rows),
#   op     "sparse" (the sparse kernel: prefill and decoding) or "dense" (dense decoding),
#   rows   "few" (at most FEW_ROWS query rows a kv head: tensor-parallel head counts) or "many",
#   cache  "bf16", "quantized" (any FP8/FP4 main cache) or a format's name where it has a tile of its own,
# and "*" (ANY) matches every value. tile_row looks up the kind's own rows first, then DEFAULT's, and within
# them the most specific key (op, then rows, then cache). A row's block_h is the most rows a program takes:
# a call with fewer gets the next power of two (16 at least) instead.

ANY = "*"
DEFAULT = "default"
FEW_ROWS = 32  # fewer rows than one 64-row program: the rows regime "few"


@dataclass(frozen=True)
class TileRow:
    tile: TileConfig
    reason: str  # the measurement or compile check behind the tile


# 99 KB of shared memory a block (sm_86/89, sm_120): the H200's few-head tiles (compile_report numbers: Triton 3.7.1).
_SMALL_SMEM_SPARSE = TileConfig(16, 32, 4, 6, False)
_SMALL_SMEM_DENSE = TileConfig(16, 32, 4, 6, True)
_SMALL_SMEM = ("the H200's few-head tile (DEFAULT), which compile_report --arch {arch} --shipped finds within "
               "99 KB for every kernel but MODEL1's; not measured on such a GPU")
# MODEL1 rows stage more than 99 KB at any depth of 64-key blocks, and at 2 or more stages of 32-key ones.
_SMALL_SMEM_MODEL1 = TileConfig(16, 32, 8, 1, False)
_SMALL_SMEM_MODEL1_WHY = ("compile_report --arch 86 / 120 --shipped: 82 KB with a MODEL1 extra cache, no spills (the "
                          "other formats' 6-stage tile needs 181 KB, 4 warps at one stage spill 16-32 B); 8 warps "
                          "and one stage as on the H200 (DEFAULT's MODEL1 row), 32-key blocks to fit; not measured")
# On sm_120 these tiles spill 32 B in sparse decoding and 52 B in dense decoding; on sm_90, where they were measured
# fastest, 32 and 36 B. Kept: the spill-free variants (8 warps) lose the gather prefetch, and were 1.4-2x slower on
# the H200 for few-head decoding (sparse_mla/NOTES.md run 29).
_SM120_SPILLS = "; spills 32-52 B, as the same tiles do on the H200, where they were measured fastest"
# Blackwell datacenter GPUs (sm_100): Triton lowers Hopper's 64-key tiles with more staging there (345 KB).
_SM100_TILE = TileConfig(64, 32, 8, 3, False)
_SM100 = ("32 keys and 3 stages fit the 227 KB with gathers prefetched (compile_report --arch 100 --shipped); "
          "Hopper's 64-key tile needs 345 KB on sm_100; not measured")

TILES: dict[tuple[str, str, str, str], TileRow] = {
    ("interpret", ANY, ANY, ANY): TileRow(
        TileConfig(64, 64, 4, 1), "Triton's interpreter costs per operation, not per element: few, large tiles"),

    # 64 KB of LDS a block (MI300X gfx942, MI250 gfx90a): the largest head blocks that fit without spills in
    # compile_report --arch gfx942 / gfx90a --shipped (Triton 3.7.1); never run on an AMD GPU.
    ("rocm", ANY, "many", ANY): TileRow(TileConfig(64, 16, 4, 1), "fits 64 KB without spills"),
    ("rocm", "sparse", "many", "quantized"): TileRow(
        TileConfig(32, 16, 4, 1), "the 64-row tile spills 188 / 332 B (gfx90a / gfx942) in V3.2 decoding and "
                                  "80 / 132 B in V4.1 + FP4 decoding, in every 64-row variant tried; 32 rows spill "
                                  "none (twice the programs, each gathering its rows: time both on an AMD GPU)"),
    ("rocm", ANY, "few", ANY): TileRow(TileConfig(16, 32, 4, 2), "fits 64 KB without spills"),
    ("rocm", "dense", "few", ANY): TileRow(
        TileConfig(16, 16, 4, 2), "32-key blocks spill 36 B on gfx942 (136 B with Triton 3.6.0), 16-key blocks "
                                  "none"),

    ("npu", ANY, ANY, "bf16"): TileRow(
        TileConfig(16, 32, 1, 1), "unified buffer (192 KB on A2/A3): a [16, 512] fp32 accumulator plus a 32-row "
                                  "latent tile (triton-ascend compile check, ascend_compile_check.py)"),
    ("npu", ANY, ANY, "quantized"): TileRow(
        TileConfig(16, 8, 1, 1), "the triton-ascend compile check found that dequantizing 32 rows overflows the "
                                 "unified buffer for every quantized format, and that 8 rows fit every format "
                                 "and extra-cache pairing"),

    ("cuda_small_smem", "sparse", ANY, ANY): TileRow(_SMALL_SMEM_SPARSE, _SMALL_SMEM.format(arch="86")),
    ("cuda_small_smem", "sparse", ANY, "MODEL1_FP8"): TileRow(_SMALL_SMEM_MODEL1, _SMALL_SMEM_MODEL1_WHY),
    ("cuda_small_smem", "dense", ANY, ANY): TileRow(_SMALL_SMEM_DENSE, _SMALL_SMEM.format(arch="86")),

    ("cuda_sm120", "sparse", ANY, ANY): TileRow(_SMALL_SMEM_SPARSE, _SMALL_SMEM.format(arch="120") + _SM120_SPILLS),
    ("cuda_sm120", "sparse", ANY, "MODEL1_FP8"): TileRow(_SMALL_SMEM_MODEL1, _SMALL_SMEM_MODEL1_WHY),
    ("cuda_sm120", "dense", ANY, ANY): TileRow(_SMALL_SMEM_DENSE, _SMALL_SMEM.format(arch="120") + _SM120_SPILLS),

    ("cuda", "sparse", "many", "quantized"): TileRow(
        TileConfig(64, 64, 8, 1, False), "compile_report --arch 80 --shipped: DEFAULT's 3-stage tile needs 223-264 KB "
                                         "of the 163; one stage fits (106-164 KB); not measured"),
    ("cuda", "sparse", "many", "MODEL1_FP8"): TileRow(
        TileConfig(64, 16, 8, 1, False), "compile_report --arch 80 --shipped: 98 KB, 40 B spilled; DEFAULT's 64-key "
                                         "tile needs 192 KB of the 163 (8.5 KB spilled), the 32-key one the launch "
                                         "would shrink it to spills 6.6 KB; not measured"),

    ("cuda_sm100", "sparse", "many", "bf16"): TileRow(_SM100_TILE, _SM100),
    ("cuda_sm100", "dense", "many", ANY): TileRow(_SM100_TILE, _SM100),

    # BLOCK_H 64 needs 8 warps: its [64, 512] fp32 accumulator alone is 256 registers a thread with 4.
    (DEFAULT, "sparse", "many", "bf16"): TileRow(
        TileConfig(64, 64, 8, 3, False), "H200 sweep, 2026-11-29 (sparse_mla/NOTES.md): per-row lazy rescale beats "
                                         "the block-wide branch by 19-27 %; bf16 best with 3 stages"),
    (DEFAULT, "sparse", "many", "quantized"): TileRow(
        TileConfig(64, 64, 8, 3, False), "H200, 2026-12-07 (run 136, same call): 3 stages with the indices asked "
                                         "for by hand, so the codes travel while a block is attended: V3.2 b128 "
                                         "s_q 2 h128 772 vs 905 µs, b64 h64 134 vs 155, V4.1 + FP4 h64 310 vs 322 "
                                         "with the 1-stage tile (which spilled 488 B; this one 68, 231 KB)"),
    (DEFAULT, "sparse", "many", "MODEL1_FP8"): TileRow(
        TileConfig(64, 64, 8, 1, False), "one stage, as every quantized cache before (H200 sweep, 2026-11-29); "
                                         "MODEL1's 3-stage tile needs 320 KB (compile_report --arch 90)"),
    (DEFAULT, "sparse", "few", "bf16"): TileRow(
        TileConfig(32, 64, 4, 2, False), "H200 sweep run 13: bf16 prefill at 16 heads best of four tiles with "
                                         "64-key blocks and 2 stages (4.08 ms)"),
    (DEFAULT, "sparse", "few", "quantized"): TileRow(
        TileConfig(32, 32, 4, 6, False), "H200 sweep run 13: few-head decoding is bound by the latency of the "
                                         "gathered rows; 6 stages keep several blocks in flight (the pipeliner "
                                         "prefetches gathers from 5 stages on), 1.2-1.9x faster than 64 rows and "
                                         "2 stages"),
    (DEFAULT, "sparse", "few", "MODEL1_FP8"): TileRow(
        TileConfig(32, 64, 8, 1, False), "H200 tp sweep, 2026-12-01 (sparse_mla/NOTES.md): MODEL1 at 16 heads "
                                         "(+512 extra) 292 µs with 64-key blocks on 8 warps (one stage: two do not "
                                         "fit), 437 µs with the 32-key, 6-stage tile of the other formats"),
    (DEFAULT, "dense", "many", ANY): TileRow(
        TileConfig(64, 64, 8, 2, False), "H200 sweeps, 2026-11-29 (dense_decode/NOTES.md): 64 keys a block with "
                                         "2 TMA stages for the compute-bound regime (32 keys, 4 stages: 3336 vs "
                                         "2054 µs)"),
    (DEFAULT, "dense", "few", ANY): TileRow(
        TileConfig(32, 32, 4, 6, True), "H200 sweep run 12: memory-bound, 32 keys and 6 TMA stages reach 0.97x "
                                        "copy (4 stages 0.72x)"),
}


def tile_row(kind: str, op: str, rows: int, quantized: bool = False, fmt: str = "") -> TileRow:
    """The row of ``TILES`` for ``op`` ("sparse" or "dense") on device kind ``kind`` with ``rows`` query rows
    a kv head over a ``quantized`` (or bf16) main cache of format ``fmt`` (its name; "" when none applies)."""
    regime = "few" if rows <= FEW_ROWS else "many"
    caches = [c for c in (fmt, "quantized" if quantized else "bf16") if c] + [ANY]
    for key in itertools.product((kind, DEFAULT), (op, ANY), (regime, ANY), caches):
        row = TILES.get(key)
        if row is not None:
            return row
    raise ValueError(f"op must be 'sparse' or 'dense', got {op!r}")


def _tile(kind: str, op: str, rows: int, quantized: bool = False, fmt: str = "") -> TileConfig:
    """A forced tile, else the table's, with no more query rows a program than the call has."""
    tile = forced_tile()
    if tile is not None:
        return tile
    tile = tile_row(kind, op, rows, quantized, fmt).tile
    return dataclasses.replace(tile, block_h=_rows_block(rows, tile.block_h))


def sparse_config(kind: str, heads_per_group: int, quantized: bool, fmt: str = "") -> TileConfig:
    """Tiles of the sparse kernel for ``heads_per_group`` query heads sharing one index list (``fmt``: the
    main cache's format name, for the formats whose few-head tile differs)."""
    return _tile(kind, "sparse", heads_per_group, quantized, fmt)


def dense_config(kind: str, rows_per_kv_head: int) -> TileConfig:
    """Tiles of the dense decode kernel for ``rows_per_kv_head = s_q * h_q / h_kv`` packed query rows."""
    return _tile(kind, "dense", rows_per_kv_head)


# The warp-specialized Hopper kernels (hopper/): 64 query rows, three 4-warp partitions, lazy rescale per
# row; 64-key blocks in 2 stages fill the 227 KB of shared memory with the queries (H200, 2026-11-29, dense:
# 32-key blocks in 4 stages were 40 % slower, dense_decode/NOTES.md).
_WARP_SPECIALIZED = TileConfig(64, 64, 12, 2, False)


# The fewest query rows a kv head the Hopper kernels take, as the portable tile's row block (16, 32 or 64: a
# call of at most half of it keeps the portable kernel), masking the rest of their 64-row tile (tensor-parallel
# head counts), and the measurement behind each.
HOPPER_FEWEST_ROWS = {
    "sparse_prefill": (16, "H200, 2026-12-01: h_q 16 d_qk 576 2911 µs on the Hopper kernel with heads padded to 64 "
                           "vs 3332 portable; h_q 32 d_qk 512 2502 vs 4084"),
    "sparse_decode": (16, "H200, 2026-12-01, b128 s_q 1 topk 2048: V3.2 h_q 16 127 µs on the Hopper kernel vs 217 "
                          "portable, h_q 8 125 vs 212; V4.1 + 512 FP4 extra h_q 16 264 vs 283"),
    "dense_decode": (32, "H200, 2026-12-01, GPU µs portable vs Hopper: h_q 16 b8 s_k 4096 30.6 vs 37.8, b32 s_k 8192 "
                         "98.9 vs 107, b128 304 vs 317; h_q 32 b8 s_k 4096 47.4 vs 43.0, b128 s_k 8192 525 vs 327"),
}


# Heads a program of the Hopper sparse kernels takes, per op: the smallest entry that holds the call's heads, with
# the measurement behind it (the few-head kernels of hopper/few_heads.py, for 16 and 32), else 64 (the 64-row
# kernels, their tile masking the heads past h_q). A forced 12-warp tile's block_h picks one instead.
HOPPER_PROGRAM_HEADS = {
    "sparse_decode": (
        (8, "H200, 2026-12-02, b64 s_q 1 topk 2048: V3.2 h_q 8 56.9 µs with 8-head programs vs 59.4 with 16; "
            "V4.1 + FP4 extra 85.9 vs 88.2"),
        (16, "H200, 2026-12-01, b128 s_q 1: V3.2 h_q 16 96-98 µs with 16-head programs vs 114 with 32 and 127 with "
             "64, h_q 8 95-97 vs 127; MODEL1 + 512 extra h_q 16 103-110 vs 178; V4.1 + FP4 extra 147-151 vs 256"),
        (32, "H200, 2026-12-01, b128 s_q 1: V3.2 h_q 32 113-117 µs with 32-head programs vs 128 with 64 and 158 with "
             "two of 16"),
    ),
    "sparse_prefill": (
        (8, "H200, 2026-12-02, s_q 4096 topk 2048: h_q 8 d 576 1585 µs with 8-head programs vs 1717 with 16, "
            "d 512 1376 vs 1544"),
        (16, "H200, 2026-12-01, s_q 4096 topk 2048 d 576: h_q 16 1719 µs with 16-head programs vs 2255 with 32 and "
             "2776 with 64"),
        (32, "H200, 2026-12-01, s_q 4096 topk 2048 d 512: h_q 32 2110 µs with 32-head programs vs 2412 with 64 and "
             "3068 with two of 16"),
    ),
}


def hopper_program_heads(op: str, h_q: int) -> tuple[int, str]:
    """(heads a program of the Hopper ``op`` kernel takes, why) for ``h_q`` query heads a token."""
    tile = forced_tile()
    if tile is not None and tile.num_warps == 12:
        if tile.block_h not in (8, 16, 32, 64):
            raise ValueError(f"tuning.forced(tile=...): a 12-warp (Hopper) tile's block_h is the heads a program "
                             f"takes, 8, 16, 32 or 64; got {tile.block_h}")
        return tile.block_h, "forced"
    for heads, why in HOPPER_PROGRAM_HEADS.get(op, ()):
        if h_q <= heads:
            return heads, why
    return 64, "64-head programs"


def warp_specialized_config() -> Optional[TileConfig]:
    """The tile of the Hopper kernels, or None when a tile meant for the portable kernels is forced (the
    Hopper kernels' tiles are told apart by their 12 warps)."""
    tile = forced_tile() or _WARP_SPECIALIZED
    return tile if tile.num_warps == 12 else None
