"""Compile the cache-writer and prolog kernels for GPUs this machine does not have (Triton's own compilers,
no device needed) and report registers, spills and shared memory per instantiation:

    python -m anymla.triton_kernels.cache_write.compile_check [--arch 90 80 gfx942]

Run without TRITON_INTERPRET (the interpreter replaces the kernels)."""

from __future__ import annotations

import argparse

from ..compile_report import ARCHS, report
from .kernel import cache_write_kernel, mla_prolog_kernel, q_assemble_kernel
from .launch import GPU_TILE

_BYTE = {"cache_ptr": "*u8"}
_BF16 = {"cache_ptr": "*bf16"}
_IN = {"src_ptr": "*bf16", "slots_ptr": "*i64"}
_PROLOG = {"kv_ptr": "*bf16", "kv_w_ptr": "*bf16", "q_ptr": "*bf16", "q_w_ptr": "*bf16", "q_out_ptr": "*bf16",
           "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slots_ptr": "*i32"}
_FLOATS = ("kv_eps", "q_eps")


def jobs():
    """(label, kernel, pointer types, constexprs) of every shipped instantiation."""
    out = []
    for fmt, name, d in ((0, "BF16", 576), (1, "V32_FP8", 576), (2, "MODEL1_FP8", 512), (3, "V41_FP8", 512),
                         (4, "V41_FP4", 512)):
        ptrs = {**_IN, **(_BF16 if fmt == 0 else _BYTE)}
        out.append((f"write {name}", cache_write_kernel, ptrs, dict(FMT=fmt, D=d, BLOCK_T=GPU_TILE[0])))
    for fmt, name in ((0, "BF16"), (1, "V32_FP8")):
        ptrs = {**_PROLOG, **(_BF16 if fmt == 0 else _BYTE)}
        out.append((f"prolog {name} q1536", mla_prolog_kernel, ptrs,
                    dict(FMT=fmt, ROPE_STYLE=0, Q_RANK=1536, Q_BLOCK=2048, BLOCK_T=GPU_TILE[0])))
    out.append(("q assembly", q_assemble_kernel, {"qn_ptr": "*bf16", "qpe_ptr": "*bf16", "pos_ptr": "*i64",
                                                 "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": "*bf16"},
                dict(D_LAT=512, ROPE_STYLE=0, BLOCK_H=16)))
    return out


def main(argv=None) -> list[tuple[str, str, dict]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", nargs="+", default=["90"], choices=sorted(ARCHS))
    args = ap.parse_args(argv)
    import anymla.triton_kernels.compile_report as cr
    results = []
    for arch in args.arch:
        for label, kernel, ptrs, consts in jobs():
            saved = cr._FLOAT_ARGS
            cr._FLOAT_ARGS = set(saved) | set(_FLOATS)  # the eps arguments are floats
            try:
                r = report(kernel, ptrs, consts, GPU_TILE[1], ARCHS[arch])
            finally:
                cr._FLOAT_ARGS = saved
            results.append((arch, label, r))
            print(f"sm/{arch:7s} {label:22s} regs {r['regs']:4d} spills {r['spill_bytes']:4d} B "
                  f"smem {r['smem']:6d} B {'fits' if r['fits'] else 'DOES NOT FIT'} ({r['compile_s']} s)")
    return results


if __name__ == "__main__":
    main()
