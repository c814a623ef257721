"""Offline resource report: compile the kernels for a GPU architecture on any machine, no GPU needed.

    python -m anymla.triton_kernels.compile_report [--arch 90|100|120|80|86|89|gfx942|gfx90a] [--shipped] [LABEL]
    python -m anymla.triton_kernels.compile_report --ampere [--arch 80|86|89|90|120] [--sass]

Triton's wheel ships ptxas and the AMD linker, so registers, spills and shared memory of every tile
configuration can be read before spending device time: a config that spills or needs more than the shared
memory a block may use (227 KB on Hopper) is not worth timing. Numbers come from the local Triton, which may
differ from the device's.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Optional, Union

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from .dense_decode.kernel import dense_decode_kernel
from .sparse_mla.kernel import sparse_mla_kernel
from .tuning import TileConfig

_FLOAT_ARGS = {"scale_log2"}


@dataclass(frozen=True)
class Arch:
    backend: str  # "cuda" or "hip"
    name: Union[int, str]  # compute capability as an int (90) or an AMD gfx name
    warp: int
    smem: int  # bytes of shared memory (LDS) one block may use, opt-in maximum
    kind: str  # runtime.device_kind of such a GPU: the key of its tuning tables
    native_fp8: bool  # what runtime.native_fp8 says there
    tma: bool  # what runtime.tensor_memory_copies says there
    # Bytes a shipped config may spill (--shipped fails above it), None: not checked. The few-head tiles spill a
    # few bytes on every NVIDIA target, as on the H200, where they were measured fastest (tuning.py); the H200's
    # 32- and 64-row tiles, which sm_80, sm_90 and sm_100 run, spill up to ~2 KB there: not checked.
    spill_budget: Optional[int] = None


# The spill budgets were set on this Triton (the version CI pins): another version's register allocation moves
# by some tens of bytes (Triton 3.6: 44 B on gfx942, 96 B on sm_120 for tiles that spill 0 / 32 B on 3.7), so
# there --shipped still fails a config that does not fit, but only reports its spills.
SPILL_BUDGET_TRITON = "3.7."

ARCHS = {
    "90": Arch("cuda", 90, 32, 232448, "cuda_sm90", True, True),  # H100, H200
    "100": Arch("cuda", 100, 32, 232448, "cuda_sm100", True, True),  # B200
    "120": Arch("cuda", 120, 32, 101376, "cuda_sm120", True, True, 64),  # RTX 50xx, RTX PRO 6000 Blackwell
    "80": Arch("cuda", 80, 32, 166912, "cuda", False, False),  # A100
    "86": Arch("cuda", 86, 32, 101376, "cuda_small_smem", False, False, 64),  # RTX 30xx, A10
    "89": Arch("cuda", 89, 32, 101376, "cuda_small_smem", True, False, 64),  # RTX 40xx, L40S
    "gfx942": Arch("hip", "gfx942", 64, 65536, "rocm", False, False, 0),  # MI300X
    "gfx90a": Arch("hip", "gfx90a", 64, 65536, "rocm", False, False, 0),  # MI250
}


def _signature(kernel, pointer_types: dict, constexprs: dict) -> dict:
    sig = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointer_types:
            sig[name] = pointer_types[name]
        elif name.endswith("_ptr"):
            sig[name] = pointer_types.get(name, "*fp32")
        else:
            sig[name] = "fp32" if name in _FLOAT_ARGS else "i32"
    return sig


def _divisibility(kernel, constexprs: dict) -> dict:
    """Mark pointers and strides 16-divisible, as Triton's launcher specializes them on real (aligned)
    tensors; without this the report would miss vectorized and asynchronous loads."""
    attrs = {}
    for i, name in enumerate(inspect.signature(kernel.fn).parameters):
        if name not in constexprs and (name.endswith("_ptr") or _STRIDE.fullmatch(name)) and "desc" not in name:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


# (The block table's row stride is left out: the kernels do not specialize on it, see dense_decode/kernel.py.
# The cache writer's and prolog's ``*_stride`` arguments are 16-divisible in the layer's calls, whose rows are
# 512 / 576-element latents, 288 / 528 / 656-byte cache rows and 64-float RoPE tables; MODEL1's 584-byte token
# stride is not, but its rows are addressed 576 bytes apart: without these the report would build unvectorized
# byte-wise stores.)
_STRIDE = re.compile(r"s[a-z]{1,2}_[a-z]|kv_s[bgr]|x_s[br]|sxi_t|[a-z_]+_stride")


def _usage(compiled, arch: Arch) -> tuple[int, int]:
    """(registers a thread, bytes spilled) from ptxas (NVIDIA) or the AMD assembly's metadata."""
    if arch.backend == "hip":
        asm = compiled.asm["amdgcn"]
        vgprs = re.search(r"\.vgpr_count:\s*(\d+)", asm)
        spills = re.search(r"\.vgpr_spill_count:\s*(\d+)", asm)
        return int(vgprs.group(1)) if vgprs else -1, 4 * int(spills.group(1)) if spills else -1
    # Triton's wheel ships a separate, newer ptxas for Blackwell (sm_100, sm_120): Triton picks it for them and
    # writes PTX of a version the older one rejects (for sm_120a: PTX 9.1 with Triton 3.7.1, CUDA 12.8's ptxas
    # reads up to 8.7).
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                         "ptxas-blackwell" if arch.name >= 100 else "ptxas")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(compiled.asm["ptx"])
        gpu = f"sm_{arch.name}{'a' if arch.name >= 90 else ''}"
        res = subprocess.run([ptxas, f"-arch={gpu}", "-v", path, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True)
    text = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    return int(regs.group(1)) if regs else -1, int(spills.group(1)) if spills else -1


def report(kernel, pointer_types: dict, constexprs: dict, num_warps: int, arch: Arch = ARCHS["90"],
           source=ASTSource, sass: bool = False, **options) -> dict:
    """``sass``: also count the main loop's instructions (``loop_counts``; NVIDIA only)."""
    t0 = time.time()
    src = source(kernel, _signature(kernel, pointer_types, constexprs), constexprs, _divisibility(kernel, constexprs))
    compiled = triton.compile(src, target=GPUTarget(arch.backend, arch.name, arch.warp),
                              options=dict(num_warps=num_warps, **options))
    regs, spills = _usage(compiled, arch)
    smem = compiled.metadata.shared
    r = dict(regs=regs, spill_bytes=spills, smem=smem, fits=smem <= arch.smem,
             prefetch=_prefetch_groups(compiled.asm["ttgir"]), compile_s=round(time.time() - t0, 1))
    if sass:
        r["loop"] = loop_counts(compiled.asm["cubin"])
    return r


_LOOP_OPS = ("HMMA", "LDSM", "LDG", "LDGSTS", "BAR", "LDS", "STS", "STSM", "SHFL", "MUFU", "LDL", "STL")
_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def loop_counts(cubin: bytes) -> dict:
    """Instructions a warp issues in one iteration of the kernel's longest loop (the span of its longest
    backward branch in the SASS, read with the wheel's ``cuobjdump``): ``total`` and, by opcode (the part
    before the first dot), those of ``_LOOP_OPS``; ``LDSM_bytes``: what its ``ldmatrix`` read from shared memory.
    Never-executed ``@!PT`` instructions are left out."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    code = [(int(addr, 16), op, args) for addr, pred, op, args in _SASS_LINE.findall(sass)
            if pred.strip() != "@!PT"]
    # (a loop's branch may be predicated on a uniform register: ``BRA.U UP0, 0x...``)
    loops = [(int(t.group(1), 16), addr) for addr, op, args in code if op.split(".")[0] == "BRA"
             for t in [re.search(r"0x([0-9a-f]+)\s*$", args)] if t and int(t.group(1), 16) < addr]
    if not loops:
        return {}
    start, end = max(loops, key=lambda b: b[1] - b[0])
    body = [op for addr, op, _ in code if start <= addr <= end and op != "NOP"]
    kinds = [op.split(".")[0] for op in body]
    # ldmatrix moves 8 x 8 16-bit values (128 bytes) a matrix, .x1 / .x2 / .x4 matrices an instruction
    ldsm_bytes = sum(128 * int(op.rsplit(".", 1)[1]) for op in body if op.startswith("LDSM"))
    return {"total": len(body), **{name: kinds.count(name) for name in _LOOP_OPS}, "LDSM_bytes": ldsm_bytes}


def _prefetch_groups(ttgir: str) -> int:
    """Copy groups a main loop leaves in flight when it waits for its gathered rows: 0 means every iteration
    waits for the rows it has just asked for (no overlap of loads with work), -1 that no loop copies
    asynchronously (TMA tiles wait on barriers instead). The smallest over the kernel's loops."""
    depths = []
    for body in ttgir.split("scf.for")[1:]:
        waits = re.findall(r"ttg\.async_wait[^\n]*\{num = (\d+)", body.split("scf.yield", 1)[0])
        if waits:
            depths.append(min(int(n) for n in waits))
    return min(depths, default=-1)


def sparse_constexprs(tile: TileConfig, d_qk: int, fmt: int, extra_fmt=None, write_max=True,
                      arch: Arch = ARCHS["90"]) -> dict:
    return dict(D_QK=d_qk, FMT=fmt, X_FMT=fmt if extra_fmt is None else extra_fmt, HAS_X=extra_fmt is not None,
                HAS_LEN=False, HAS_X_LEN=False, HAS_SINK=False, WRITE_MAX=write_max, SPLIT=False,
                BLOCK_H=tile.block_h, BLOCK_N=tile.block_n, SKIP_SCALE=tile.skip_scale, NATIVE_FP8=arch.native_fp8,
                PORTABLE=False, INTERPRET=False, NUM_STAGES=tile.num_stages)


def dense_constexprs(tile: TileConfig, d_qk: int, causal: bool, arch: Arch = ARCHS["90"]) -> dict:
    c = dict(D_QK=d_qk, CAUSAL=causal, HAS_SINK=False, SPLIT=False, USE_TMA=arch.tma, BLOCK_H=tile.block_h,
             BLOCK_N=tile.block_n, SKIP_SCALE=tile.skip_scale, INTERPRET=False, NUM_STAGES=tile.num_stages)
    if not arch.tma:  # no tensor-memory copies: the launcher passes no descriptors
        c.update(k_desc=None, r_desc=None)
    return c


def dense_pointers(tile: TileConfig) -> dict:
    return {"q_ptr": "*bf16", "out_ptr": "*bf16", "kv_ptr": "*bf16", "bt_ptr": "*i32", "lens_ptr": "*i32",
            "k_desc": f"tensordesc<bf16[1,{tile.block_n},1,512]>", "r_desc": f"tensordesc<bf16[1,{tile.block_n},1,64]>"}


def _sparse_ptrs(fmt: int) -> dict:
    kv = "*bf16" if fmt == 0 else "*u8"
    return {"q_ptr": "*bf16", "out_ptr": "*bf16", "kv_ptr": kv, "x_kv_ptr": kv, "idx_ptr": "*i32",
            "x_idx_ptr": "*i32", "len_ptr": "*i32", "x_len_ptr": "*i32"}


# Query rows a kv head that reach every rows regime of tuning.TILES: many, and few at both head-block sizes.
_SHIPPED_ROWS = (128, 32, 16)


def _jobs(shipped: bool, arch: Arch) -> list:
    """(label, kernel, pointer types, constexprs of a tile, tiles): the sweep's configs, or the ones shipped
    for ``arch`` at each of _SHIPPED_ROWS."""
    from .harness import PORTABLE_SWEEP, SWEEP
    from .tuning import dense_config, sparse_config
    kind = arch.kind

    def tiles(sweep_cases, fmt):
        if shipped:
            return [dense_config(kind, rows) if fmt is None else sparse_config(kind, rows, fmt != "BF16", fmt)
                    for rows in _SHIPPED_ROWS]
        return [c.tile for case in sweep_cases for c in SWEEP[case] + PORTABLE_SWEEP.get(case, []) if c.tile]
    return [
        ("sparse_prefill d576", sparse_mla_kernel, _sparse_ptrs(0), lambda t: sparse_constexprs(t, 576, 0, arch=arch),
         tiles(["prefill-v32-h128"], "BF16")),
        ("sparse_decode v32", sparse_mla_kernel, _sparse_ptrs(1),
         lambda t: sparse_constexprs(t, 576, 1, None, False, arch), tiles(["sdecode-v32-b128-sq2-h128"], "V32_FP8")),
        ("sparse_decode v41+fp4", sparse_mla_kernel, _sparse_ptrs(3),
         lambda t: sparse_constexprs(t, 512, 3, 4, False, arch), tiles(["sdecode-v41+fp4-b128-h64"], "V41_FP8")),
        # MODEL1 has a few-head tile of its own, measured with a MODEL1 extra cache (sparse_mla/NOTES.md run 29).
        ("sparse_decode model1+x", sparse_mla_kernel, _sparse_ptrs(2),
         lambda t: sparse_constexprs(t, 512, 2, 2, False, arch), tiles(["tp-sdecode-model1-b128-h16"], "MODEL1_FP8")),
        ("dense_decode", dense_decode_kernel, dense_pointers, lambda t: dense_constexprs(t, 576, True, arch),
         tiles(["ddecode-b128-h16-sk8192", "ddecode-b128-sq2-h128-sk8192", "ddecode-b1-h128-sk32768"], None)),
    ]


def hopper_reports() -> list:
    """(label, report, spill budget in bytes) of the Gluon kernels of ``hopper/`` compiled for sm_90 with their shipped tile: they
    exist for Hopper only, and Gluon's API moves between Triton releases, so this also checks that the
    installed Triton still builds them."""
    import torch
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type
    from .hopper import kernels
    from .hopper.launch import _shared_layout
    from .hopper.few_heads import launch_regs
    from .hopper.partitions import REGS
    from .tuning import warp_specialized_config
    tile = warp_specialized_config()
    rows = torch.empty(64 * tile.block_n, 576, dtype=torch.bfloat16)  # a stand-in: only shape and dtype matter

    def desc(cols):
        block = [tile.block_n, cols]
        return mangle_type(TensorDescriptor(rows, list(rows.shape), list(rows.stride()), block,
                                            _shared_layout(block, rows.dtype)))
    ints = {n: "*i32" for n in ("bt_ptr", "lens_ptr", "idx_ptr", "len_ptr")}
    bf16 = {n: "*bf16" for n in ("q_ptr", "out_ptr", "kv_ptr")}
    decode_ptrs = {**ints, **bf16, "kv_ptr": "*u8", "x_kv_ptr": "*u8", "x_idx_ptr": "*i32", "x_len_ptr": "*i32"}
    decode = dict(HAS_SINK=True, SPLIT=True, BLOCK_N=tile.block_n, HEADS=64,
                  K_LAYOUT=_shared_layout([tile.block_n, 512], rows.dtype),
                  R_LAYOUT=_shared_layout([tile.block_n, 64], rows.dtype))
    jobs = [("hopper dense d576", kernels.dense_decode_hopper_kernel, {**ints, **bf16, "k_desc": desc(512),
             "r_desc": desc(64)}, dict(D_QK=576, CAUSAL=True, HAS_SINK=True, SPLIT=True, NUM_STAGES=tile.num_stages)),
            ("hopper sparse prefill", kernels.sparse_prefill_hopper_kernel, {**ints, **bf16},
             dict(D_QK=576, HAS_LEN=True, HAS_SINK=True, BLOCK_N=tile.block_n, NUM_STAGES=tile.num_stages, HEADS=64,
                  K_LAYOUT=_shared_layout([tile.block_n, 512], rows.dtype),
                  R_LAYOUT=_shared_layout([tile.block_n, 64], rows.dtype))),
            ("hopper decode v32", kernels.sparse_decode_hopper_kernel, decode_ptrs,
             dict(D_QK=576, FMT=1, X_FMT=1, HAS_X=False, HAS_LEN=True, HAS_X_LEN=False, **decode)),
            ("hopper decode v41+fp4", kernels.sparse_decode_hopper_kernel, decode_ptrs,
             dict(D_QK=512, FMT=3, X_FMT=4, HAS_X=True, HAS_LEN=True, HAS_X_LEN=True, **decode)),
            ("hopper decode model1", kernels.sparse_decode_hopper_kernel, decode_ptrs,
             dict(D_QK=512, FMT=2, X_FMT=2, HAS_X=False, HAS_LEN=True, HAS_X_LEN=False, **decode)),
            ("hopper decode model1+x", kernels.sparse_decode_hopper_kernel, decode_ptrs,
             dict(D_QK=512, FMT=2, X_FMT=2, HAS_X=True, HAS_LEN=True, HAS_X_LEN=True, **decode))]
    # V3.2 as most calls come: no split, no sink (their pointers None, as a launch passes them: constexprs)
    unsplit = dict(SPLIT=False, HAS_SINK=False, po_ptr=None, plse_ptr=None, sink_ptr=None, x_len_ptr=None)
    few = kernels.sparse_decode_hopper_kernel
    jobs += [(f"hopper few-head {label} h{heads}", few, decode_ptrs,
              {**decode, **dict(D_QK=d, FMT=fmt, X_FMT=x_fmt, HAS_X=has_x, HAS_LEN=True, HAS_X_LEN=has_x,
                                HEADS=heads), **(unsplit if label == "v32" else {})})
             for label, d, fmt, x_fmt, has_x in (("v32", 576, 1, 1, False), ("v41+fp4", 512, 3, 4, True),
                                                 ("model1+x", 512, 2, 2, True))
             for heads in (8, 16, 32)]
    # bf16 caches: the few-head form's workers gather rows by 16-byte copies, no conversion
    bf16_decode_ptrs = {**decode_ptrs, "kv_ptr": "*bf16", "x_kv_ptr": "*bf16"}
    jobs += [(f"hopper few-head bf16 decode h{heads}", few, bf16_decode_ptrs,
              {**decode, **dict(D_QK=576, FMT=0, X_FMT=0, HAS_X=False, HAS_LEN=True, HAS_X_LEN=False, HEADS=heads)})
             for heads in (8, 16, 32)]
    jobs += [(f"hopper few-head prefill d{d} h{heads}", kernels.sparse_prefill_hopper_kernel, {**ints, **bf16},
              dict(D_QK=d, HAS_LEN=True, HAS_SINK=True, BLOCK_N=tile.block_n, NUM_STAGES=2, HEADS=heads,
                   K_LAYOUT=_shared_layout([tile.block_n, 512], rows.dtype),
                   R_LAYOUT=_shared_layout([tile.block_n, 64], rows.dtype)))
             for d, heads in ((576, 16), (512, 32), (576, 8), (512, 8))]
    # Spills allowed: a few bytes, except in the V4.1 + FP4 decoding kernel, whose FP4 loop spills ~0.4-0.7 KB
    # and still beat the portable kernel on the H200 (sparse_mla/NOTES.md run 27). More is a regression. (A second
    # loop for a MODEL1 extra cache spilled ~200 B and cost CONFIG1 18 %: run 120; both caches now share one loop.)
    # The few-head kernel's FP4 workers hold a whole block's fp32 values at once: 1.0-1.5 KB spilled by 4-warp
    # workers (32 heads), 56 / 140 B by the 8-warp ones of 8 / 16 heads (Triton 3.7.1). The 64-head kernel's
    # dequantizing warpgroup spills 72 B over a MODEL1 + MODEL1 pair on Triton 3.7.1 (36 B on 3.6, where it
    # decodes CONFIG1 as fast as FlashMLA: run 122).
    budgets = {"hopper decode v41+fp4": 1024, "hopper decode model1+x": 128, "hopper few-head v41+fp4 h8": 256,
               "hopper few-head v41+fp4 h16": 512, "hopper few-head v41+fp4 h32": 2048}

    def regs(consts):  # as SparseDecodeLaunch launches them
        few = consts.get("HEADS", 64) < 64 and "FMT" in consts
        return launch_regs(consts["HEADS"], consts["FMT"]) if few else REGS.value
    return [(label, report(kernel, ptrs, consts, 4, ARCHS["90"], GluonASTSource, maxnreg=regs(consts)),
             budgets.get(label, 64)) for label, kernel, ptrs, consts in jobs]


AMPERE_ARCHS = ("80", "86", "89", "90", "120")


# The mma_v2 V3.2 decoding kernel may spill a few bytes: its row sums kept in each thread (ampere/NOTES.md, run
# 133) spill 8-16 B at sm_90 (4 B at sm_80 on Triton 3.7.1), one or two local stores an iteration of two blocks,
# and made it 7.6 % faster on the mma.sync stand-in all the same. More is a regression.
AMPERE_DECODE_SPILL_BUDGET = 16


def ampere_reports(arch: Arch, sass: bool = False) -> list:
    """(label, report, expected shared memory, spill budget in bytes) of the ``mma_v2`` kernels (``ampere/``)
    with the tile their launches pick for ``arch`` (``launch.choose_tile``, ``decode_launch.choose_decode_tile``):
    sparse prefill at d_qk 576 and 512, sparse decoding over V3.2 FP8 (split, with lengths and sinks; fp8
    conversions as ``arch`` has them) and dense decoding at d_qk 576 (causal, split, with sinks). The expected
    bytes are the launch's own estimate, which must match what the compiler allocated."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from .ampere.decode import sparse_decode_mma_v2_kernel
    from .ampere.dense import dense_decode_mma_v2_kernel
    from .ampere.decode_launch import choose_decode_tile, decode_shared_bytes
    from .ampere.kernel import sparse_prefill_mma_v2_kernel
    from .ampere.launch import K_STEP, choose_tile, shared_bytes
    ptrs = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "out_ptr": "*bf16", "idx_ptr": "*i32", "len_ptr": "*i32",
            "sink_ptr": "*fp32", "lse_ptr": "*fp32", "max_ptr": "*fp32", "po_ptr": "*fp32", "plse_ptr": "*fp32"}
    jobs = []
    for d in (576, 512):
        block_n, stages = choose_tile(d, arch.smem)
        consts = dict(D_QK=d, HAS_LEN=True, HAS_SINK=True, BLOCK_N=block_n, NUM_STAGES=stages, K_STEP=K_STEP)
        r = report(sparse_prefill_mma_v2_kernel, ptrs, consts, 8, arch, GluonASTSource, sass=sass)
        jobs.append((f"mma_v2 prefill d{d} BN {block_n} x{stages}", r, shared_bytes(d, block_n, stages), 0))
    tile = choose_decode_tile(arch.smem, arch.native_fp8)
    consts = dict(HAS_LEN=True, HAS_SINK=True, SPLIT=True, NATIVE_FP8=arch.native_fp8, BLOCK_N=tile[0],
                  LATENT_TILES=tile[1], K_STEP=K_STEP)
    r = report(sparse_decode_mma_v2_kernel, {**ptrs, "kv_ptr": "*u8"}, consts, 8, arch, GluonASTSource, sass=sass)
    jobs.append((f"mma_v2 decode v32 BN {tile[0]} x{tile[1]}", r, decode_shared_bytes(tile),
                 AMPERE_DECODE_SPILL_BUDGET))
    block_n, stages = choose_tile(576, arch.smem)
    consts = dict(PAGE=64, D_QK=576, CAUSAL=True, HAS_SINK=True, SPLIT=True, BLOCK_N=block_n, NUM_STAGES=stages, K_STEP=K_STEP)
    r = report(dense_decode_mma_v2_kernel, {**ptrs, "bt_ptr": "*i32", "lens_ptr": "*i32"}, consts, 8, arch,
               GluonASTSource, sass=sass)
    jobs.append((f"mma_v2 dense d576 BN {block_n} x{stages}", r, shared_bytes(576, block_n, stages), 0))
    return jobs


def _line(label: str, tile: Optional[TileConfig], r: dict) -> str:
    """``tile``: None for the Hopper kernels, whose label names their form."""
    return (f"{label:30s} {tile or ''}  regs {r['regs']:3d} spill {r['spill_bytes']:5d} B smem {r['smem']:6d} "
            f"prefetch {r['prefetch']:2d} {'fits' if r['fits'] else 'TOO BIG'}  ({r['compile_s']} s)")


def main() -> None:
    import argparse
    from .fit import shrinking
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="90", choices=list(ARCHS))
    ap.add_argument("--shipped", action="store_true",
                    help="the configs the tuning table ships for --arch, each followed down the fit ladder until "
                         "it fits; exit status 1 if a shipped config does not fit as shipped or spills more than "
                         "the arch's budget")
    ap.add_argument("--hopper", action="store_true", help="the Gluon kernels of hopper/ (sm_90, shipped tile)")
    ap.add_argument("--ampere", action="store_true",
                    help="the Gluon mma_v2 kernels of ampere/ (sparse prefill, V3.2 FP8 sparse and dense decoding) for --arch "
                         "(one of %s) with the tiles their launches pick; exit status 1 if one spills (the V3.2 decoding "
                         "kernel: more than AMPERE_DECODE_SPILL_BUDGET bytes), does not fit or "
                         "its launch misjudges its shared memory" % ", ".join(AMPERE_ARCHS))
    ap.add_argument("--sass", action="store_true", help="with --ampere: instructions a warp issues a key block")
    ap.add_argument("only", nargs="?", default="", help="only kernels whose label contains this")
    a = ap.parse_args()
    arch = ARCHS[a.arch]
    print(f"{a.arch} ({arch.kind}): a block may use {arch.smem} bytes of shared memory", flush=True)
    if a.ampere:
        if a.arch not in AMPERE_ARCHS:
            raise SystemExit(f"--ampere builds for {', '.join(AMPERE_ARCHS)}")
        for label, r, expected, spill_budget in ampere_reports(arch, a.sass):
            print(_line(label, None, r) + (f"  loop {r['loop']}" if a.sass else ""), flush=True)
            if not r["fits"] or r["spill_bytes"] > spill_budget or r["smem"] != expected:
                raise SystemExit(f"{label}: spills more than {spill_budget} B, does not fit sm_{a.arch} or needs "
                                 f"{r['smem']} bytes of shared memory where its launch expects {expected}")
        return
    if a.hopper:
        for label, r, spill_budget in hopper_reports():
            print(_line(label, None, r), flush=True)
            if not r["fits"] or r["spill_bytes"] > spill_budget:
                raise SystemExit(f"{label}: does not fit sm_90 as shipped")
        return
    seen, misfits = set(), 0
    for label, kernel, ptrs, consts, configs in _jobs(a.shipped, arch):
        for tile in configs:
            if a.only not in label or (label, tile) in seen:
                continue
            seen.add((label, tile))
            for t in shrinking(tile) if a.shipped else [tile]:
                try:
                    r = report(kernel, ptrs(t) if callable(ptrs) else ptrs, consts(t), t.num_warps, arch)
                except Exception as e:
                    print(f"{label:22s} {t}  FAILED {type(e).__name__}: {str(e).splitlines()[-1][:100]}", flush=True)
                    misfits += 1
                    break
                spills = a.shipped and arch.spill_budget is not None and r["spill_bytes"] > arch.spill_budget
                print(_line(label, t, r) + (f"  SPILLS over {arch.spill_budget} B" if spills else ""), flush=True)
                spills = spills and triton.__version__.startswith(SPILL_BUDGET_TRITON)
                misfits += t == tile and (spills or not r["fits"])
                if r["fits"]:  # what the launch-time ladder would settle on
                    break
    if a.shipped and misfits:
        raise SystemExit(f"{misfits} shipped config(s) fail to compile, do not fit {a.arch} as shipped or spill more "
                         f"than {arch.spill_budget} B")


if __name__ == "__main__":
    main()
