"""Compile the cache-writer and prolog kernels for GPUs this machine does not have (Triton's own compilers,
no device needed) and report registers, spills and shared memory per instantiation:

    python -m anymla.triton_kernels.cache_write.compile_check [--arch 90 80 gfx942]

Run without TRITON_INTERPRET (the interpreter replaces the kernels)."""

from __future__ import annotations

import argparse

from ..compile_report import ARCHS, Arch, report
from .kernel import cache_write_kernel, mla_prolog_kernel, q_assemble_kernel, sparse_slots_kernel
from .v4_kernel import v4_heads_kernel, v4_prolog_kernel
from .launch import GPU_TILE, writer_tile

_BYTE = {"cache_ptr": "*u8"}
_BF16 = {"cache_ptr": "*bf16"}
_IN = {"src_ptr": "*bf16", "slots_ptr": "*i64"}
_PROLOG = {"kv_ptr": "*bf16", "kv_w_ptr": "*bf16", "q_ptr": "*bf16", "q_w_ptr": "*bf16", "q_out_ptr": "*bf16",
           "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slots_ptr": "*i32", "bt_ptr": "*i32"}
_FLOATS = ("kv_eps", "q_eps", "eps")


def jobs(arch: Arch = ARCHS["90"]):
    """(label, kernel, pointer types, constexprs, warps) of every shipped instantiation on ``arch`` (the layer's:
    prolog slots from the block table, the q assembly rotating q_pe only, with and without a sparse step's
    slots; V4's prolog in each of its formats and its heads kernel in both forms; unit strides are constants, as
    Triton's launcher specializes them)."""
    out, writer = [], writer_tile(arch.kind)
    for fmt, name, d in ((0, "BF16", 576), (1, "V32_FP8", 576), (2, "MODEL1_FP8", 512), (3, "V41_FP8", 512),
                         (4, "V41_FP4", 512)):
        ptrs = {**_IN, **(_BF16 if fmt == 0 else _BYTE)}
        out.append((f"write {name}", cache_write_kernel, ptrs,
                    dict(FMT=fmt, D=d, NATIVE_FP8=arch.native_fp8, BLOCK_T=writer[0]), writer[1]))
    for fmt, name in ((0, "BF16"), (1, "V32_FP8")):
        ptrs = {**_PROLOG, **(_BF16 if fmt == 0 else _BYTE)}
        out.append((f"prolog {name} q1536", mla_prolog_kernel, ptrs,
                    dict(FMT=fmt, ROPE_STYLE=0, Q_RANK=1536, Q_BLOCK=2048, SLOTS_FROM_TABLE=True,
                         NATIVE_FP8=arch.native_fp8, BLOCK_T=GPU_TILE[0], bt_s_k=1), GPU_TILE[1]))
    query = {"qn_ptr": "*bf16", "qpe_ptr": "*bf16", "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
             "out_ptr": "*bf16"}
    out.append(("q assembly", q_assemble_kernel, query,
                dict(D_LAT=512, ROPE_STYLE=0, COPY_NOPE=False, BLOCK_H=16, SLOTS=False, BLOCK_K=1), 4))
    out.append(("q assembly + slots", q_assemble_kernel,
                {**query, "idx_ptr": "*i32", "bt_ptr": "*i32", "slots_ptr": "*i32"},
                dict(D_LAT=512, ROPE_STYLE=0, COPY_NOPE=False, BLOCK_H=16, SLOTS=True, BLOCK_K=1024, idx_s_k=1,
                     bt_s_k=1), 4))
    for fmt, name in ((0, "BF16"), (2, "MODEL1_FP8"), (3, "V41_FP8"), (4, "V41_FP4")):
        ptrs = {**_PROLOG, "kv_w_ptr": "*fp32", "q_w_ptr": "*fp32", **(_BF16 if fmt == 0 else _BYTE)}
        out.append((f"v4 prolog {name} q1024", v4_prolog_kernel, ptrs,
                    dict(FMT=fmt, Q_RANK=1024, Q_BLOCK=1024, NATIVE_FP8=arch.native_fp8, BLOCK_T=GPU_TILE[0],
                         bt_s_k=1), GPU_TILE[1]))
    heads = {"x_ptr": "*bf16", "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "bt_ptr": "*i32",
             "slots_ptr": "*i32"}
    out.append(("v4 query heads + window", v4_heads_kernel, heads,
                dict(NORM=True, SLOTS=True, BLOCK_H=8, BLOCK_W=128, bt_s_k=1), 4))
    out.append(("v4 output heads", v4_heads_kernel, heads, dict(NORM=False, SLOTS=False, BLOCK_H=16, BLOCK_W=1), 4))
    out.append(("sparse slots", sparse_slots_kernel, {"idx_ptr": "*i32", "pos_ptr": "*i64", "bt_ptr": "*i32",
                                                      "out_ptr": "*i32"}, dict(BLOCK_K=1024, idx_s_k=1, bt_s_k=1), 4))
    return out


def main(argv=None) -> list[tuple[str, str, dict]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", nargs="+", default=["90"], choices=sorted(ARCHS))
    args = ap.parse_args(argv)
    import anymla.triton_kernels.compile_report as cr
    results = []
    for arch in args.arch:
        for label, kernel, ptrs, consts, warps in jobs(ARCHS[arch]):
            saved = cr._FLOAT_ARGS
            cr._FLOAT_ARGS = set(saved) | set(_FLOATS)  # the eps arguments are floats
            try:
                r = report(kernel, ptrs, consts, warps, ARCHS[arch])
            finally:
                cr._FLOAT_ARGS = saved
            results.append((arch, label, r))
            print(f"sm/{arch:7s} {label:22s} regs {r['regs']:4d} spills {r['spill_bytes']:4d} B "
                  f"smem {r['smem']:6d} B {'fits' if r['fits'] else 'DOES NOT FIT'} ({r['compile_s']} s)")
    return results


if __name__ == "__main__":
    main()
