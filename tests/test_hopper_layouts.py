"""The Hopper dequantizing workers' stores of a converted block (and V3.2's rope values) into a key stage,
checked for shared-memory bank conflicts for every quantized format at the worker widths the kernels use:
counted by Triton's own model (``gl.bank_conflicts``) while compiling a probe for sm_90 (offline, no GPU). A
probe storing from a layout that conflicts shows the count is live."""

import pytest
import torch

from anymla.triton_kernels import runtime

pytestmark = pytest.mark.skipif(not runtime.gluon_hopper(),
                                reason="this Triton's Gluon is not a version the Hopper kernels were checked with")

# (scale tiles a row, code bytes a tile) of each format (``dequant._tiles``)
TILES = {"V32_FP8": (4, 128), "V41_FP8": (16, 32), "V41_FP4": (32, 8), "MODEL1_FP8": (8, 64)}

if runtime.gluon_hopper():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from anymla.triton_kernels.common import FMT_MODEL1_FP8, FMT_V32_FP8, FMT_V41_FP4, FMT_V41_FP8
    from anymla.triton_kernels.hopper import dequant

    FORMATS = {"V32_FP8": FMT_V32_FP8, "V41_FP8": FMT_V41_FP8, "V41_FP4": FMT_V41_FP4, "MODEL1_FP8": FMT_MODEL1_FP8}

    @gluon.constexpr_function
    def _conflicting(warps):
        """32 bytes a lane, a warp along one row: the 8 lanes of a 16-byte store phase write 128 columns of one
        row, the same 16-byte columns of two 64-column swizzle tiles (2-way)."""
        return gl.BlockedLayout([1, 16], [1, 32], [warps, 1], [1, 0])

    @gluon.jit
    def _probe(out_ptr, FMT: gl.constexpr, ROWS: gl.constexpr, TILES: gl.constexpr, TILE_BYTES: gl.constexpr,
               STAGE: gl.constexpr, ROPE_STAGE: gl.constexpr, CONFLICT: gl.constexpr):
        layout: gl.constexpr = dequant._codes_layout(FMT, gl.num_warps())
        codes = gl.full([ROWS, TILES, TILE_BYTES], 0, gl.uint8, layout)
        if FMT == FMT_MODEL1_FP8:
            scales = (gl.full([ROWS], 0, gl.uint64, dequant._slots_layout(FMT, gl.num_warps())),
                      gl.full([ROWS, 1, TILE_BYTES], 0, gl.bfloat16, layout))
        elif FMT == FMT_V32_FP8:
            scales = gl.full([ROWS, TILES], 0, gl.float32, gl.SliceLayout(2, layout))
        else:
            scales = gl.full([ROWS, TILES], 0, gl.uint8, gl.SliceLayout(2, layout))
        values = dequant.dequantized(codes, scales, FMT, gl.bfloat16)
        if CONFLICT:
            values = gl.convert_layout(values, _conflicting(gl.num_warps()))
        stage = gl.allocate_shared_memory(gl.bfloat16, [ROWS, 512], STAGE)
        gl.static_print("bank conflicts:", gl.bank_conflicts(values.type, stage.type))
        stage.store(values)
        if FMT == FMT_V32_FP8:
            rope = gl.full([ROWS, 64], 0, gl.bfloat16, dequant._rope_layout(gl.num_warps()))
            rope_stage = gl.allocate_shared_memory(gl.bfloat16, [ROWS, 64], ROPE_STAGE)
            gl.static_print("rope bank conflicts:", gl.bank_conflicts(rope.type, rope_stage.type))
            rope_stage.store(rope)


def _conflicts(capfd, tmp_path, monkeypatch, fmt, warps, conflict=False) -> dict:
    """The bank conflicts Triton counts for the probe's stores, by what they store (compiled in a cache of its
    own: a cached kernel prints nothing)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from anymla.triton_kernels.hopper.launch import _shared_layout
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    rows = 64
    consts = dict(FMT=FORMATS[fmt].value, ROWS=rows, TILES=TILES[fmt][0], TILE_BYTES=TILES[fmt][1],
                  STAGE=_shared_layout([rows, 512], torch.bfloat16),
                  ROPE_STAGE=_shared_layout([rows, 64], torch.bfloat16), CONFLICT=conflict)
    capfd.readouterr()
    triton.compile(GluonASTSource(_probe, {"out_ptr": "*i32", **{k: "constexpr" for k in consts}}, consts),
                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    out = capfd.readouterr().out.splitlines()
    printed = [line.split("bank conflicts:") for line in out if "bank conflicts:" in line]
    counts = {what.strip() or "latent": int(n) for what, n in printed}
    assert len(counts) == (2 if fmt == "V32_FP8" else 1), printed
    return counts


# FP4's thread holds one 8-byte scale tile, 16 values: the 8 lanes of a store phase write 128 columns of one row,
# two swizzle tiles' same 16-byte columns (triton_kernels/sparse_mla/NOTES.md, "16-byte code loads")
FP4_CONFLICT = pytest.mark.xfail(strict=True, reason="FP4's store is 2-way bank-conflicted (sparse_mla NOTES)")


@pytest.mark.parametrize("warps", (4, 8))
@pytest.mark.parametrize("fmt", [pytest.param(f, marks=FP4_CONFLICT) if f == "V41_FP4" else f for f in TILES])
def test_dequantized_block_stores_without_bank_conflicts(capfd, tmp_path, monkeypatch, fmt, warps):
    counts = _conflicts(capfd, tmp_path, monkeypatch, fmt, warps)
    assert all(n == 0 for n in counts.values()), counts


def test_the_count_sees_a_conflicting_store(capfd, tmp_path, monkeypatch):
    assert _conflicts(capfd, tmp_path, monkeypatch, "V32_FP8", 4, conflict=True)["latent"] > 0
