"""Shared-memory bank conflicts of the dequantizing workers' stores into a key stage, offline (no GPU):

    python -m anymla.triton_kernels.hopper.store_conflicts   # one JSON line: {"FORMAT/WARPS/LOADS": {store: count}}

Compiles a probe for sm_90 that builds a block's codes and scales in the layouts ``dequant`` loads them in,
converts them with ``dequant.dequantized`` and stores the result (V3.2: its rope values too) into stages laid
out as the kernels' (``launch._shared_layout``), and reads Triton's own count (``gl.bank_conflicts``: the
excess accesses a wavefront of each store instruction). ``"control"``: the V3.2 probe storing from a layout
that conflicts, to show the count is live. Run without ``TRITON_INTERPRET`` (the probe is compiled, not run).
"""

from __future__ import annotations

import io
import json
import tempfile
from contextlib import redirect_stdout

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from ..common import FMT_MODEL1_FP8, FMT_V32_FP8, FMT_V41_FP4, FMT_V41_FP8
from . import dequant
from .launch import _shared_layout

FORMATS = {"V32_FP8": FMT_V32_FP8, "V41_FP8": FMT_V41_FP8, "V41_FP4": FMT_V41_FP4, "MODEL1_FP8": FMT_MODEL1_FP8}
# (warps, 16-byte loads) of the workers the kernels have (``few_heads.fill_warps``, ``few_heads.wide_loads``): the
# 64-head kernel's dequantizing warpgroup and the few-head 4-warp workers at <= 16 heads, those at 32 heads, and
# V4.1's 8-warp workers at <= 16 heads
WORKERS = ((4, True), (4, False), (8, True))
ROWS = gl.constexpr(64)  # the Hopper kernels' key block


@gluon.constexpr_function
def _conflicting(warps):
    """32 bytes a lane, a warp along one row: the 8 lanes of a 16-byte store phase write 128 columns of one
    row, the same 16-byte columns of two 64-column swizzle tiles (2-way)."""
    return gl.BlockedLayout([1, 16], [1, 32], [warps, 1], [1, 0])


@gluon.jit
def _probe(FMT: gl.constexpr, TILES: gl.constexpr, TILE_BYTES: gl.constexpr, STAGE: gl.constexpr,
           ROPE_STAGE: gl.constexpr, CONFLICT: gl.constexpr, WIDE: gl.constexpr):
    layout: gl.constexpr = dequant._codes_layout(FMT, gl.num_warps(), WIDE)
    codes = gl.full([ROWS, TILES, TILE_BYTES], 0, gl.uint8, layout)
    if FMT == FMT_MODEL1_FP8:
        scales = (gl.full([ROWS], 0, gl.uint64, dequant._slots_layout(FMT, gl.num_warps(), WIDE)),
                  gl.full([ROWS, 1, TILE_BYTES], 0, gl.bfloat16, layout))
    elif FMT == FMT_V32_FP8:
        scales = gl.full([ROWS, TILES], 0, gl.float32, gl.SliceLayout(2, layout))
    else:
        scales = gl.full([ROWS, TILES], 0, gl.uint8, gl.SliceLayout(2, layout))
    values = dequant.dequantized(codes, scales, FMT, gl.bfloat16)
    if CONFLICT:
        values = gl.convert_layout(values, _conflicting(gl.num_warps()))
    stage = gl.allocate_shared_memory(gl.bfloat16, [ROWS, 512], STAGE)
    gl.static_print("latent bank conflicts:", gl.bank_conflicts(values.type, stage.type))
    stage.store(values)
    if FMT == FMT_V32_FP8:
        rope = gl.full([ROWS, 64], 0, gl.bfloat16, dequant._rope_layout(gl.num_warps(), WIDE))
        rope_stage = gl.allocate_shared_memory(gl.bfloat16, [ROWS, 64], ROPE_STAGE)
        gl.static_print("rope bank conflicts:", gl.bank_conflicts(rope.type, rope_stage.type))
        rope_stage.store(rope)


def conflicts(fmt: str, warps: int, wide: bool, conflicting: bool = False) -> dict:
    """``{store: bank conflicts}`` of the probe for format ``fmt`` (a ``FORMATS`` key) on ``warps`` warps, with
    ``wide`` (16-byte) code loads or not, compiled in a Triton cache of its own (a cached kernel is not traced
    again, so it would print nothing)."""
    code = FORMATS[fmt].value
    tiles, tile_bytes = dequant._tiles(code)[:2]
    consts = dict(FMT=code, TILES=tiles, TILE_BYTES=tile_bytes,
                  STAGE=_shared_layout([ROWS.value, 512], torch.bfloat16),
                  ROPE_STAGE=_shared_layout([ROWS.value, 64], torch.bfloat16), CONFLICT=conflicting, WIDE=wide)
    printed = io.StringIO()
    with tempfile.TemporaryDirectory() as cache, triton.knobs.cache.scope(), redirect_stdout(printed):
        triton.knobs.cache.dir = cache
        triton.compile(GluonASTSource(_probe, {k: "constexpr" for k in consts}, consts),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    lines = printed.getvalue().splitlines()
    counts = [line.split(" bank conflicts:") for line in lines if "bank conflicts:" in line]
    return {store.strip(): int(n) for store, n in counts}


def key(fmt: str, warps: int, wide: bool) -> str:
    return f"{fmt}/{warps}/{'wide' if wide else 'narrow'}"


def main() -> None:
    report = {key(fmt, warps, wide): conflicts(fmt, warps, wide) for fmt in FORMATS for warps, wide in WORKERS}
    report["control"] = conflicts("V32_FP8", 4, False, conflicting=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
