"""Compile-check the Triton kernels for Ascend A2/A3 (triton-ascend) on a machine without an NPU or CANN.

    python triton_kernels/ascend_compile_check.py [LABEL_SUBSTRING]
    python triton_kernels/ascend_compile_check.py --layers   # the layer kernels: a report, not a check

Run it from a venv of its own (triton-ascend replaces the ``triton`` package; never install it next to PyPI's):

    python3.11 -m venv /tmp/venv-ascend
    /tmp/venv-ascend/bin/pip install triton-ascend==3.2.0 ascendnpu-ir==1.2.0 pybind11 "numpy<2.4"

Each variant goes through triton-ascend's front end, the Triton->Linalg/HIVM adapter and ``bishengir-compile``
(HFusion, HIVM, on-chip memory planning) for one SoC. The last step, CANN's ``hivmc``, is absent, so a run
that stops only there is a PASS: the kernel lowers and its buffers fit the unified buffer (UB) and L1 of that
SoC. A PASS is not a binary, not a run and says nothing about numerics or speed (see ascend_notes.md §8/§9).
Only the tile ``tuning.py`` ships for Ascend counts: a shipped tile that overflows is a FAIL (smaller key blocks
are then tried and printed as a hint, never as a pass). Before the table, the tool checks itself: a tile known
not to fit must FAIL, or it exits 2. Exit status: 0 only when every (variant, SoC) pair passes.

``--layers`` compiles the layer kernels (``cache_write/``: the writer in every format, the prologs, the q
assembly, the slots, V4's kernels) for the first SoC and prints which lower. It is a report (exit status 0):
the layers run their torch ops on NPUs (``anymla.layers.kernels.NPU_REASON`` says why, from this table).

Loads the kernel files by path under a synthetic package, so neither torch nor ``anymla`` is imported.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
import shutil
import sys
import tempfile
import time
import types
from typing import Callable, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))
_WORK = tempfile.mkdtemp(prefix="ascend_check_")
# Every variant is compiled afresh (never from a cache shared with other Triton installs).
os.environ["TRITON_ALWAYS_COMPILE"] = "1"
os.environ["TRITON_CACHE_DIR"] = os.path.join(_WORK, "cache")
sys.modules["torch"] = None  # proves the check is torch-free: any `import torch` raises ImportError

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import ASTSource, make_backend  # noqa: E402

SOCS = ("Ascend910B3", "Ascend910B4", "Ascend910_9382")
_PKG = "_anymla_ascend_check"


def _load_kernels():
    """Import common/tuning/kernel modules from this folder as ``_PKG.*`` (the kernels use relative imports)."""
    pkg = types.ModuleType(_PKG)
    pkg.__path__ = [_HERE]  # the real __init__ is skipped: it would pull in the runtime module
    sys.modules[_PKG] = pkg
    common, tuning, sparse, dense = [importlib.import_module(f"{_PKG}.{m}")
                                     for m in ("common", "tuning", "sparse_mla.kernel", "dense_decode.kernel")]
    # The shipped tiles, never a user's forced ones: tuning would ask anymla's settings, which are not loaded.
    tuning._forced = lambda name: None
    return common, tuning, sparse, dense


def _install_compiler_wrapper() -> str:
    """Put a ``bishengir-compile`` on PATH that also saves its last IR (``--save-temps``) into
    ``$ASCEND_CHECK_SAVE``, where the buffer offsets are read. Returns the folder of the real compiler."""
    import ascendnpuir
    real = os.path.join(os.path.dirname(ascendnpuir.__file__), "bin", "bishengir-compile")
    wrapper = os.path.join(_WORK, "bin", "bishengir-compile")
    os.makedirs(os.path.dirname(wrapper))
    with open(wrapper, "w") as f:
        # only compilations (an .mlir input) get the flag: the backend also probes `--help` for options
        f.write(f'#!/bin/sh\ncase "$*" in *.mlir*) exec {real} "$@" --save-temps="$ASCEND_CHECK_SAVE";; esac\n'
                f'exec {real} "$@"\n')
    os.chmod(wrapper, 0o755)
    os.environ["PATH"] = os.path.dirname(wrapper) + os.pathsep + os.environ["PATH"]
    return os.path.dirname(real)


# --- one compilation -------------------------------------------------------------------------------------

_DTYPE_BITS = {"f32": 32, "i32": 32, "f16": 16, "bf16": 16, "i16": 16, "i8": 8, "ui8": 8, "i1": 8, "i64": 64,
               "f64": 64}
_CAST = re.compile(r"hivm\.hir\.pointer_cast\(([^)]*)\).*?memref<([^>]*?)x?([a-z]+\d+)(?:,[^>]*)?,"
                   r" #hivm\.address_space<(\w+)>>")
_SPACES = {"ub": "UB", "cbuf": "L1", "cc": "L0C"}
_HIVMC = "External hivmc run fails"
_OVERFLOW = re.compile(r"(\w+) overflow, requires (\d+) bits while (\d+) bits available")


def _high_water(mlir: str) -> dict:
    """Bytes used per on-chip space: max(offset + size) over the planned buffers (``hivm.hir.pointer_cast``
    with constant offsets; approximate under multibuffer, where one buffer has several offsets)."""
    top = {}
    for offsets, dims, dtype, space in _CAST.findall(mlir):
        size = _DTYPE_BITS.get(dtype, 32) // 8
        for d in filter(None, dims.split("x")):
            size *= int(d) if d.isdigit() else 0
        for off in re.findall(r"%c(\d+)_i64", offsets):
            top[space] = max(top.get(space, 0), int(off) + size)
    return top


def _first_error(e: Exception) -> str:
    """The innermost front-end error (kernel source line + message), else the first located ``error:`` of
    the adapter, else a compiler abort (LLVM ERROR, assertion), else the exception's last line."""
    while isinstance(e.__cause__, triton.compiler.errors.CompilationError):
        e = e.__cause__
    if isinstance(e, triton.compiler.errors.CompilationError):
        line = e.src.split("\n")[e.node.lineno - 1].strip() if e.src and hasattr(e.node, "lineno") else ""
        return f"`{line}`: {(e.error_message or '').strip().splitlines()[-1]}"
    msg = str(e)
    located = re.search(r"([\w.]+):(\d+):\d+: error: (.*)", msg)
    if located:
        return "{}:{}: {}".format(*located.groups())
    # BiShengHIR's own errors (loc("file":line:col): error: ...), the pipeline's summary line aside
    hir = [m for m in re.findall(r'loc\("[^"]*":\d+:\d+\): error: (.*)', msg) if "Failed to run" not in m]
    if hir:
        return hir[0].strip()[:200]
    abort = re.search(r"LLVM ERROR: .*|Assertion .*", msg)
    if abort:
        return abort.group(0).strip()[:200]
    return f"{type(e).__name__}: {msg.strip().splitlines()[-1] if msg.strip() else ''}"


def check(fn, signature: dict, constants: dict, soc: str) -> tuple:
    """Compile ``fn`` for ``soc`` up to the missing ``hivmc``: (PASS|FAIL, high-water or error, overflowed)."""
    target = GPUTarget("npu", soc, 0)

    class _Arch:  # stands in for NPUUtils, whose get_arch() builds a CANN program and ignores the target
        def get_arch(self):
            return soc

    type(make_backend(target)).add_stages.__globals__["NPUUtils"] = _Arch
    save = os.environ["ASCEND_CHECK_SAVE"] = tempfile.mkdtemp(dir=_WORK)
    try:
        triton.compile(ASTSource(fn, signature, constants), target=target)  # succeeds only where CANN is installed
    except Exception as e:  # every failure is a row of the table, not a crash
        msg = str(e)
        over = _OVERFLOW.findall(msg)
        if over:
            return "FAIL", "; ".join(f"{_SPACES.get(s, s)} overflow: needs {int(n)} bits > {int(a)}"
                                     for s, n, a in dict.fromkeys(over)), True
        # A PASS stops at the missing hivmc and nowhere before (no other error, no compiler abort).
        others = [l for l in msg.splitlines() if re.search(r": error: |LLVM ERROR|Assertion", l) and _HIVMC not in l]
        if _HIVMC not in msg or others:
            return "FAIL", _first_error(e), False
    path = os.path.join(save, "module.hivm.opt.mlir")
    top = _high_water(open(path).read()) if os.path.exists(path) else {}
    return "PASS", " ".join(f"{_SPACES[s]} {top[s] / 1024:.1f}K" for s in _SPACES if s in top) or "-", False


# --- the variants ------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Variant:
    kernel: str
    label: str
    fn: object  # the @triton.jit function
    pointers: dict  # element types of the pointer arguments that are not fp32
    constexprs: Callable  # tile (or None) -> the launcher's constexprs
    tile: Optional[object] = None  # the npu TileConfig of tuning.py; None for the untiled combine


_FLOAT_ARGS = ("scale_log2", "kv_eps", "q_eps", "eps")


def _signature(fn, pointers: dict, constants: dict) -> dict:
    """Triton 3.2 signature: constexprs (and the None TMA descriptors, which the launcher's None arguments
    specialize as constexprs) as "constexpr", pointers typed from ``pointers`` (else fp32), the rest i32."""
    sig = {}
    for name in fn.arg_names:
        if name in constants:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = pointers.get(name, "*fp32")
        else:
            sig[name] = "fp32" if name in _FLOAT_ARGS else "i32"
    return sig


_FMT_NAMES = {0: "BF16", 1: "V32_FP8", 2: "MODEL1_FP8", 3: "V41_FP8", 4: "V41_FP4"}


def variants(common, tuning, sparse, dense) -> list:
    """What the Ascend launchers pass: no fp8 types (NATIVE_FP8 False), byte-assembled loads (PORTABLE), no
    interpreter, no TMA descriptors, the npu tiles of tuning.py (SKIP_SCALE = the block-wide lazy rescale). Optional inputs (lengths, sink)
    are on, so every branch a format can take is compiled."""
    def sparse_variant(label, d_qk, fmt, x_fmt, split, prefill):
        kv = {f: "*bf16" if f == 0 else "*u8" for f in (fmt, x_fmt)}  # quantized caches are byte views
        pointers = {"q_ptr": "*bf16", "out_ptr": "*bf16", "kv_ptr": kv[fmt], "x_kv_ptr": kv[x_fmt or fmt],
                    "idx_ptr": "*i32", "x_idx_ptr": "*i32", "len_ptr": "*i32", "x_len_ptr": "*i32"}
        has_x = x_fmt is not None
        return Variant("sparse_mla", label, sparse.sparse_mla_kernel, pointers, lambda t: dict(
            D_QK=d_qk, FMT=fmt, X_FMT=x_fmt or fmt, HAS_X=has_x, HAS_LEN=True, HAS_X_LEN=has_x, HAS_SINK=True,
            WRITE_MAX=prefill, SPLIT=split, BLOCK_H=t.block_h, BLOCK_N=t.block_n, SKIP_SCALE=t.skip_scale,
            NATIVE_FP8=False, PORTABLE=True, INTERPRET=False, NUM_STAGES=t.num_stages),
            tuning.sparse_config("npu", 128, fmt != 0))

    def dense_variant(causal, split):
        pointers = {"q_ptr": "*bf16", "out_ptr": "*bf16", "kv_ptr": "*bf16", "bt_ptr": "*i32", "lens_ptr": "*i32"}
        label = f"d576 {'causal' if causal else 'noncausal'} {'split' if split else 'nosplit'}"
        return Variant("dense_decode", label, dense.dense_decode_kernel, pointers, lambda t: dict(
            D_QK=576, CAUSAL=causal, HAS_SINK=True, SPLIT=split, USE_TMA=False, k_desc=None, r_desc=None,
            BLOCK_H=t.block_h, BLOCK_N=t.block_n, SKIP_SCALE=t.skip_scale, INTERPRET=False,
            NUM_STAGES=t.num_stages), tuning.dense_config("npu", 128))

    out = [sparse_variant(f"prefill bf16 d{d}", d, 0, None, False, True) for d in (576, 512)]
    for fmt in (1, 2, 3, 4):
        # An extra cache has the main cache's d_qk: V32_FP8 for d576, V41_FP4 (V4.1's extra format) for d512.
        for x_fmt in (None, 1 if fmt == 1 else 4):
            for split in (False, True):
                extra = f"+{_FMT_NAMES[x_fmt]}" if x_fmt else ""
                out.append(sparse_variant(f"decode {_FMT_NAMES[fmt]}{extra} {'split' if split else 'nosplit'}",
                                          576 if fmt == 1 else 512, fmt, x_fmt, split, False))
    out += [dense_variant(causal, split) for causal in (False, True) for split in (False, True)]
    # splits.combine launches BLOCK_D 128 and MAX_SPLITS = next_pow2(splits) <= 64: 64 is its largest tile.
    out.append(Variant("combine", "sink BLOCK_D128 MAX_SPLITS64", common.combine_kernel, {"out_ptr": "*bf16"},
                       lambda t: dict(HAS_SINK=True, BLOCK_D=128, MAX_SPLITS=64)))
    return out


def layer_variants() -> list:
    """The layer kernels as the layers launch them on a device without native fp8 (slots from the block
    table, the q assembly rotating q_pe only, V4's q rank 1024): one tile each, the GPUs' (4 tokens a program)."""
    cw, v4 = (importlib.import_module(f"{_PKG}.cache_write.{m}") for m in ("kernel", "v4_kernel"))
    b16, byte = "*bf16", "*u8"
    out = []
    for fmt, d in ((0, 576), (1, 576), (2, 512), (3, 512), (4, 512)):
        out.append(Variant("cache_write", f"write {_FMT_NAMES[fmt]}", cw.cache_write_kernel,
                           {"src_ptr": b16, "slots_ptr": "*i32", "cache_ptr": b16 if fmt == 0 else byte},
                           lambda t, fmt=fmt, d=d: dict(FMT=fmt, D=d, NATIVE_FP8=False, BLOCK_T=4)))
    prolog = {"kv_ptr": b16, "kv_w_ptr": b16, "q_ptr": b16, "q_w_ptr": b16, "q_out_ptr": b16, "pos_ptr": "*i32",
              "slots_ptr": "*i32", "bt_ptr": "*i32"}
    for fmt in (0, 1):
        out.append(Variant("mla_prolog", f"{_FMT_NAMES[fmt]} q1536", cw.mla_prolog_kernel,
                           {**prolog, "cache_ptr": b16 if fmt == 0 else byte},
                           lambda t, fmt=fmt: dict(FMT=fmt, ROPE_STYLE=0, Q_RANK=1536, Q_BLOCK=2048,
                                                   SLOTS_FROM_TABLE=True, NATIVE_FP8=False, BLOCK_T=4)))
    query = {"qn_ptr": b16, "qpe_ptr": b16, "pos_ptr": "*i32", "out_ptr": b16, "idx_ptr": "*i32", "bt_ptr": "*i32",
             "slots_ptr": "*i32"}
    for slots in (False, True):
        out.append(Variant("q_assemble", "with slots" if slots else "rope only", cw.q_assemble_kernel, query,
                           lambda t, slots=slots: dict(D_LAT=512, ROPE_STYLE=0, COPY_NOPE=False, BLOCK_H=16,
                                                       SLOTS=slots, BLOCK_K=1024 if slots else 1)))
    out.append(Variant("sparse_slots", "BLOCK_K 1024", cw.sparse_slots_kernel,
                       {"idx_ptr": "*i32", "pos_ptr": "*i32", "bt_ptr": "*i32", "out_ptr": "*i32"},
                       lambda t: dict(BLOCK_K=1024)))
    for fmt in (0, 2, 3, 4):
        out.append(Variant("v4_prolog", f"{_FMT_NAMES[fmt]} q1024", v4.v4_prolog_kernel,
                           {**prolog, "kv_w_ptr": "*fp32", "q_w_ptr": "*fp32", "cache_ptr": b16 if fmt == 0 else byte},
                           lambda t, fmt=fmt: dict(FMT=fmt, Q_RANK=1024, Q_BLOCK=1024, NATIVE_FP8=False,
                                                   BLOCK_T=4)))
    heads = {"x_ptr": b16, "pos_ptr": "*i32", "bt_ptr": "*i32", "slots_ptr": "*i32"}
    out.append(Variant("v4_heads", "query + window slots", v4.v4_heads_kernel, heads,
                       lambda t: dict(NORM=True, SLOTS=True, BLOCK_H=8, BLOCK_W=128)))
    out.append(Variant("v4_heads", "output", v4.v4_heads_kernel, heads,
                       lambda t: dict(NORM=False, SLOTS=False, BLOCK_H=16, BLOCK_W=1)))
    return out


def report_layers() -> int:
    """Which layer kernels triton-ascend lowers for the first SoC (a report: always exit status 0)."""
    _install_compiler_wrapper()
    _load_kernels()
    print(f"triton-ascend {triton.__version__}: the layer kernels for {SOCS[0]} (the layers run their torch ops "
          "on NPUs; this says which kernels would lower)\n")
    try:
        for v in layer_variants():
            status, info, _ = _check_variant(v, SOCS[0], None)
            print(_row(v.kernel, v.label, SOCS[0], None, status, info), flush=True)
    finally:
        shutil.rmtree(_WORK, ignore_errors=True)
    return 0


def _smaller_tiles(tile):
    """Halved key blocks of ``tile`` down to 8 rows (the big live tiles are [BLOCK_N, 512])."""
    while tile.block_n > 8:
        tile = dataclasses.replace(tile, block_n=tile.block_n // 2)
        yield tile


def _row(kernel: str, label: str, soc: str, tile, status: str, info: str) -> str:
    name = f"H{tile.block_h} N{tile.block_n}" if tile else "-"
    return f"{kernel:13s} {label:34s} {soc:15s} {name:8s} {status:6s}  {info}"


def _check_variant(v: Variant, soc: str, tile) -> tuple:
    constants = v.constexprs(tile)
    return check(v.fn, _signature(v.fn, v.pointers, constants), constants, soc)


def _overflow_fails(variants_: list) -> bool:
    """The check must fail a tile that does not fit: the V4.1 FP8 decode at 32 keys a block overflows the A2/A3
    UB (the first run of this tool found it; 8 keys is the shipped tile)."""
    v = next(v for v in variants_ if v.label == "decode V41_FP8 nosplit")
    status, info, overflow = _check_variant(v, SOCS[0], dataclasses.replace(v.tile, block_n=32))
    print(_row(v.kernel, v.label, SOCS[0], dataclasses.replace(v.tile, block_n=32), status, info)
          + "  (self-check: must fail)")
    return status == "FAIL" and overflow


def main() -> int:
    if sys.argv[1:] == ["--layers"]:
        return report_layers()
    only = sys.argv[1] if len(sys.argv) > 1 else ""
    compiler_dir = _install_compiler_wrapper()
    common, tuning, sparse, dense = _load_kernels()
    print(f"triton-ascend {triton.__version__}, bishengir-compile in {compiler_dir}\n")
    print(f"{'kernel':13s} {'variant':34s} {'SoC':15s} {'tile':8s} result  high-water (K = KiB) or first error")
    t0, failed, checked = time.time(), 0, 0
    try:
        all_variants = variants(common, tuning, sparse, dense)
        if not _overflow_fails(all_variants):
            print("\nthe check did not fail an over-budget tile: its results cannot be trusted")
            return 2
        for v in all_variants:
            if only not in f"{v.kernel} {v.label}":
                continue
            for soc in SOCS:
                # Only the tile tuning.py ships counts: a shipped tile that does not fit is a failure.
                status, info, overflow = _check_variant(v, soc, v.tile)
                print(_row(v.kernel, v.label, soc, v.tile, status, info), flush=True)
                checked += 1
                failed += status != "PASS"
                if overflow:  # a hint for tuning.py: the largest key block that would fit (not shipped, not a pass)
                    for smaller in _smaller_tiles(v.tile):
                        hint, info, overflow = _check_variant(v, soc, smaller)
                        print(_row(v.kernel, v.label, soc, smaller, hint.lower(), info) + "  (hint, not shipped)")
                        if not overflow:
                            break
    finally:
        shutil.rmtree(_WORK, ignore_errors=True)
    print(f"\n{failed} of {checked} (variant, SoC) pairs fail at the shipped tile; {time.time() - t0:.0f} s")
    print(f"compile-check: {checked - failed} passed, {failed} failed")
    return 1 if failed or not checked else 0


if __name__ == "__main__":
    sys.exit(main())
