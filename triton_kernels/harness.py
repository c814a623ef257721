"""The Triton tier's own harness: correctness and speed of tile configurations on the canonical shapes.

    python -m anymla.triton_kernels.harness [--kernel sparse_prefill|sparse_decode|dense_decode] [--sweep]
                                            [--reps N] [--csv FILE]

For each canonical shape of the kernel issues it checks every configuration against the PyTorch reference
(FlashMLA's tolerances) and only then times it, next to the device's ceilings measured in the same run
(a 1 GiB device-to-device copy and a bf16 8192^3 matmul). Without ``--sweep`` it times the shipped
configuration only. Results go to the terminal (a table, printed last) and to ``--csv``. The user-facing
A/B harness across backends is ``python -m anymla.bench``; this one is for tuning the kernels themselves.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import itertools

import torch

import anymla
from anymla.kvcache import KVCacheFormat as F
from anymla.testing import compare_outputs, dense_decode_inputs, prefill_inputs, sparse_decode_inputs

from . import tuning
from .tuning import TileConfig

SHAPES = {
    "sparse_prefill": [
        ("v32_h128", dict(s_q=4096, h_q=128, d_qk=576, s_kv=32768, topk=2048)),
        ("v4_h64", dict(s_q=4096, h_q=64, d_qk=512, s_kv=32768, topk=2048)),
    ],
    "sparse_decode": [
        ("v32_b128_sq2_h128", dict(b=128, s_q=2, h_q=128, s_k=32768, topk=2048, fmt=F.V32_FP8, page=64)),
        ("v32_b64_sq1_h64", dict(b=64, s_q=1, h_q=64, s_k=32768, topk=2048, fmt=F.V32_FP8, page=64)),
        ("v41_b128_h64_fp4x", dict(b=128, s_q=1, h_q=64, s_k=32768, topk=2048, fmt=F.V41_FP8, page=64,
                                   extra=dict(fmt=F.V41_FP4, page=64, s_k=8192, topk=512))),
    ],
    "dense_decode": [
        ("mem_b128_h16", dict(b=128, s_q=1, h_q=16, h_kv=1, s_k=8192)),
        ("compute_b128_sq2_h128", dict(b=128, s_q=2, h_q=128, h_kv=1, s_k=8192, causal=True)),
        ("long_b1_h128", dict(b=1, s_q=1, h_q=128, h_kv=1, s_k=32768)),
    ],
}

# Configurations tried by --sweep, per shape: (tile, forced number of splits or None for the heuristic,
# forced TMA use or None). Earlier sweeps and their outcomes are recorded in each kernel's NOTES.md.
# (compile_report shows that BLOCK_H 64 with 4 warps spills its [64, 512] fp32 accumulator: not swept.)
# Run 6 of NOTES.md: 128 keys a block (a 64-wide N per warpgroup in q k^T) against the best of run 5, and TMA
# tiles against gathered rows in the memory-bound regime (each measured twice, interleaved, against noise).
_PREFILL = [(TileConfig(64, bn, 8, st, False), None, None) for bn, st in ((64, 3), (128, 1))]
_DECODE = [(TileConfig(64, bn, 8, st, False), None, None) for bn, st in ((64, 1), (128, 1), (64, 2))]
_MEM = [(TileConfig(16, bn, w, st), sp, tma) for bn, w, st, sp in ((32, 4, 4, 4), (64, 8, 2, 2))
        for tma in (True, False)]
SWEEP = {
    "v32_h128": _PREFILL, "v4_h64": _PREFILL,
    "v32_b128_sq2_h128": _DECODE, "v32_b64_sq1_h64": _DECODE, "v41_b128_h64_fp4x": _DECODE,
    "mem_b128_h16": _MEM + _MEM,
    "compute_b128_sq2_h128": [(TileConfig(64, 64, 8, 2, sk), None, None) for sk in (True, False)],
    "long_b1_h128": [(TileConfig(64, 64, 8, 2, False), sp, None) for sp in (None, 64)],
}


def _inputs(kernel: str, shape: dict, device) -> dict:
    s = dict(shape)
    if kernel == "sparse_prefill":
        return prefill_inputs(s.pop("s_q"), s.pop("h_q"), s.pop("d_qk"), s.pop("s_kv"), s.pop("topk"), device=device,
                              poison=False, **s)
    if kernel == "sparse_decode":
        return sparse_decode_inputs(s.pop("b"), s.pop("s_q"), s.pop("h_q"), s.pop("s_k"), s.pop("topk"),
                                    device=device, varlen=False, poison=False, **s)
    return dense_decode_inputs(s.pop("b"), s.pop("s_q"), s.pop("h_q"), s.pop("h_kv"), s.pop("s_k"), device=device,
                               **s)


def _work(kernel: str, args: dict) -> tuple[float, float]:
    """(FLOPs, fewest bytes) of one call: 2 * queries * h_q * keys * (d_qk + d_v); each input read once."""
    if kernel == "sparse_prefill":
        s_q, h_q, d = args["q"].shape
        topk = args["indices"].shape[-1]
        return 2.0 * s_q * h_q * topk * (d + 512), s_q * topk * d * 2.0 + 2 * s_q * h_q * (d + 512)
    b, s_q, h_q, d = args["q"].shape
    q_out = b * s_q * h_q * (d + 512) * 2.0
    if kernel == "sparse_decode":
        keys = args["indices"].shape[-1]
        kv = b * s_q * keys * args["k_cache"].shape[-1]
        if args.get("extra_k_cache") is not None:
            keys += args["extra_indices_in_kvcache"].shape[-1]
            kv += b * s_q * args["extra_indices_in_kvcache"].shape[-1] * args["extra_k_cache"].shape[-1]
        return 2.0 * b * s_q * h_q * keys * (d + 512), kv + q_out
    lens = args["cache_seqlens"].double()
    h_kv = args["k_cache"].shape[2]
    keys = float(lens.sum())
    if args["causal"] and s_q > 1:
        keys -= b * (s_q - 1) / 2
    return 2.0 * s_q * h_q * keys * (d + 512), keys * h_kv * d * 2.0 + q_out


def _call(kernel: str, args: dict, meta):
    if kernel == "sparse_prefill":
        return anymla.flash_mla_sparse_fwd(**args, backend="triton")
    return anymla.flash_mla_with_kvcache(**args, tile_scheduler_metadata=meta, backend="triton")


def _reference(kernel: str, args: dict):
    if kernel == "sparse_prefill":
        return anymla.flash_mla_sparse_fwd(**args, backend="reference")
    return anymla.flash_mla_with_kvcache(**args, tile_scheduler_metadata=None, backend="reference")


class _Timer:
    """CUDA events around each repetition, an L2 flush before each, median of the repetitions; calls shorter
    than ``graph_below_us`` are captured ``inner`` times in a CUDA graph and timed by replay."""

    def __init__(self, reps: int, graph_below_us: float = 300.0, inner: int = 20):
        self.reps, self.graph_below_us, self.inner = reps, graph_below_us, inner
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def _events(self, run, per_call: int) -> list[float]:
        times = []
        for _ in range(self.reps):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / per_call)
        return times

    def __call__(self, fn) -> list[float]:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        first = self._events(fn, 1)
        if sorted(first)[len(first) // 2] >= self.graph_below_us:
            return first
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            fn()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(self.inner):
                    fn()
        torch.cuda.current_stream().wait_stream(stream)
        return self._events(graph.replay, self.inner)


def ceilings(timer: _Timer) -> tuple[float, float]:
    """(copy GB/s counting bytes read + written, bf16 matmul TFLOP/s), measured now on random data."""
    src = torch.randint(0, 255, (1 << 30,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_us = _median(timer(lambda: dst.copy_(src)))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_us = _median(timer(lambda: a @ b))
    del src, dst, a, b
    return 2 * (1 << 30) / copy_us / 1e3, 2 * 8192 ** 3 / mm_us / 1e6


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def run(kernels, sweep: bool, reps: int, csv_path) -> list[dict]:
    timer = _Timer(reps)
    copy_gbps, mm_tflops = ceilings(timer)
    print(f"ceilings: copy {copy_gbps:.0f} GB/s, bf16 matmul {mm_tflops:.0f} TFLOP/s", flush=True)
    rows = []
    for kernel in kernels:
        for name, shape in SHAPES[kernel]:
            args = _inputs(kernel, shape, "cuda")
            ref = _reference(kernel, args)
            flops, nbytes = _work(kernel, args)
            for tile, splits, tma in (SWEEP[name] if sweep else [(None, None, None)]):
                row = dict(kernel=kernel, shape=name, tile=(str(tile) if tile else "shipped") + _tma_note(tma),
                           splits=splits)
                try:
                    with tuning.forced(tile, splits, tma):
                        meta, _ = anymla.get_mla_metadata()
                        got = _call(kernel, args, meta)
                        compare_outputs(kernel, got, ref)
                        us = _median(timer(lambda: _call(kernel, args, meta)))
                        plan = meta.plans.get("triton")
                    row.update(status="ok", us=us, tflops=flops / us / 1e6, gbps=nbytes / us / 1e3,
                               splits=plan.num_splits if plan else splits)
                    row.update(x_matmul=row["tflops"] / mm_tflops, x_copy=row["gbps"] / copy_gbps)
                except Exception as e:  # a failing config is reported, never timed
                    row.update(status=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
                rows.append(row)
                print(_fmt(row), flush=True)
            del args, ref
            torch.cuda.empty_cache()
    stamp = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, date=datetime.date.today().isoformat(),
                 copy_gbps=round(copy_gbps), matmul_tflops=round(mm_tflops))
    if csv_path:
        with open(csv_path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(stamp) + ["kernel", "shape", "tile", "splits", "status", "us",
                                                             "tflops", "gbps", "x_matmul", "x_copy"])
            w.writeheader()
            for r in rows:
                w.writerow({**stamp, **r})
    print(f"\n{stamp}")
    for r in rows:
        print(_fmt(r))
    return rows


def _tma_note(tma) -> str:
    return "" if tma is None else (" tma" if tma else " gather")


def _fmt(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['kernel']:15s} {r['shape']:22s} {r['tile']:60s} {r['status']}"
    return (f"{r['kernel']:15s} {r['shape']:22s} {r['tile']:60s} sp={r['splits']!s:4s} {r['us']:9.1f} us "
            f"{r['tflops']:6.1f} TF/s {r['gbps']:7.0f} GB/s  x_mm {r['x_matmul']:.3f} x_copy {r['x_copy']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", action="append", choices=list(SHAPES))
    ap.add_argument("--sweep", action="store_true", help="try every configuration in SWEEP")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--csv")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the harness times CUDA kernels; no CUDA device here (CPU correctness: the test suite)")
    run(a.kernel or list(SHAPES), a.sweep, a.reps, a.csv)


if __name__ == "__main__":
    main()
