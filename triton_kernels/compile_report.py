"""Offline resource report: compile the kernels for Hopper (sm_90a) on any machine, no GPU needed.

    python -m anymla.triton_kernels.compile_report [LABEL_SUBSTRING]

Triton's wheel ships ptxas, so registers, spills and shared memory of every tile configuration can be read
before spending device time: a config that spills or needs more than the 227 KB of shared memory a Hopper
block may use is not worth timing. Numbers come from the local Triton, which may differ from the device's.
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from .dense_decode.kernel import dense_decode_kernel
from .sparse_mla.kernel import sparse_mla_kernel
from .tuning import TileConfig

_FLOAT_ARGS = {"scale_log2"}
_SMEM_LIMIT = 232448  # bytes of shared memory one block may use on sm_90


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


_STRIDE = re.compile(r"s[a-z]{1,2}_[a-z]|kv_s[bgr]|x_s[br]|sxi_t|sbt_b")


def _ptxas_usage(ptx: str) -> tuple[int, int]:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        res = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.path.join(d, "k.cubin")],
                             capture_output=True, text=True)
    text = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores", text)
    return int(regs.group(1)) if regs else -1, int(spills.group(1)) if spills else -1


def report(kernel, pointer_types: dict, constexprs: dict, num_warps: int) -> dict:
    t0 = time.time()
    src = ASTSource(kernel, _signature(kernel, pointer_types, constexprs), constexprs, _divisibility(kernel, constexprs))
    compiled = triton.compile(src,
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
    regs, spills = _ptxas_usage(compiled.asm["ptx"])
    smem = compiled.metadata.shared
    return dict(regs=regs, spill_bytes=spills, smem=smem, fits=smem <= _SMEM_LIMIT and spills == 0,
                prefetch=_prefetch_groups(compiled.asm["ttgir"]), compile_s=round(time.time() - t0, 1))


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


def sparse_constexprs(tile: TileConfig, d_qk: int, fmt: int, extra_fmt=None, write_max=True) -> dict:
    return dict(D_QK=d_qk, FMT=fmt, X_FMT=fmt if extra_fmt is None else extra_fmt, HAS_X=extra_fmt is not None,
                HAS_LEN=False, HAS_X_LEN=False, HAS_SINK=False, WRITE_MAX=write_max, SPLIT=False,
                BLOCK_H=tile.block_h, BLOCK_N=tile.block_n, SKIP_SCALE=tile.skip_scale, NATIVE_FP8=True,
                PORTABLE=False, INTERPRET=False, NUM_STAGES=tile.num_stages)


def dense_constexprs(tile: TileConfig, d_qk: int, causal: bool, tma: bool = True) -> dict:
    return dict(D_QK=d_qk, CAUSAL=causal, HAS_SINK=False, SPLIT=False, USE_TMA=tma, BLOCK_H=tile.block_h,
                BLOCK_N=tile.block_n, SKIP_SCALE=tile.skip_scale, INTERPRET=False, NUM_STAGES=tile.num_stages)


def dense_pointers(tile: TileConfig) -> dict:
    return {"q_ptr": "*bf16", "out_ptr": "*bf16", "kv_ptr": "*bf16", "bt_ptr": "*i32", "lens_ptr": "*i32",
            "k_desc": f"tensordesc<bf16[1,{tile.block_n},1,512]>", "r_desc": f"tensordesc<bf16[1,{tile.block_n},1,64]>"}


def _sparse_ptrs(fmt: int) -> dict:
    kv = "*bf16" if fmt == 0 else "*u8"
    return {"q_ptr": "*bf16", "out_ptr": "*bf16", "kv_ptr": kv, "x_kv_ptr": kv, "idx_ptr": "*i32",
            "x_idx_ptr": "*i32", "len_ptr": "*i32", "x_len_ptr": "*i32"}


def main() -> None:
    import sys
    from .harness import SWEEP
    only = sys.argv[1] if len(sys.argv) > 1 else ""
    jobs = [("sparse_prefill d576", sparse_mla_kernel, _sparse_ptrs(0), lambda t: sparse_constexprs(t, 576, 0),
             SWEEP["prefill-v32-h128"]),
            ("sparse_decode v32", sparse_mla_kernel, _sparse_ptrs(1), lambda t: sparse_constexprs(t, 576, 1, None, False),
             SWEEP["sdecode-v32-b128-sq2-h128"]),
            ("sparse_decode v41", sparse_mla_kernel, _sparse_ptrs(3), lambda t: sparse_constexprs(t, 512, 3, 4, False),
             SWEEP["sdecode-v41+fp4-b128-h64"]),
            ("dense_decode", dense_decode_kernel, dense_pointers, lambda t: dense_constexprs(t, 576, True),
             SWEEP["ddecode-b128-h16-sk8192"] + SWEEP["ddecode-b128-sq2-h128-sk8192"] + SWEEP["ddecode-b1-h128-sk32768"])]
    seen = set()
    for label, kernel, ptrs, consts, configs in jobs:
        for tile, *_ in configs:
            if only not in label or (label, tile) in seen:
                continue
            seen.add((label, tile))
            try:
                r = report(kernel, ptrs(tile) if callable(ptrs) else ptrs, consts(tile), tile.num_warps)
                print(f"{label:20s} {tile}  regs {r['regs']:3d} spill {r['spill_bytes']:5d} B smem {r['smem']:6d} "
                      f"prefetch {r['prefetch']:2d} {'ok' if r['fits'] else 'NO'}  ({r['compile_s']} s)", flush=True)
            except Exception as e:
                print(f"{label:20s} {tile}  FAILED {type(e).__name__}: {str(e).splitlines()[-1][:100]}", flush=True)


if __name__ == "__main__":
    main()
