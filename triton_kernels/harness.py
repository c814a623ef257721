"""The Triton tier's own harness: tile configurations of the kernels on the bench's shapes.

    python -m anymla.triton_kernels.harness [--suite NAME] [--case NAME ...] [--sweep] [--portable] [--mma-v2]
                                            [--csv FILE]

For each case of a suite of ``python -m anymla.bench`` (default: canonical; same inputs, cost model, timer and
same-run ceilings) it checks every configuration in :data:`SWEEP` against the PyTorch reference (FlashMLA's
tolerances) and only then times it. Without ``--sweep`` it times the shipped configuration. ``--portable`` sweeps
the portable kernels' tiles instead (:data:`PORTABLE_SWEEP`, the Hopper kernels off), the stand-in for the GPUs
without them; with ``DISABLE_MMA_V3=1`` in the environment Triton lowers their ``tl.dot`` to mma.sync and the
Gluon mma_v2 kernels (``ampere/``) take the calls they serve, as on the Ampere-class GPUs. ``--mma-v2`` times each
configuration twice there, with the mma_v2 kernels forced on and off, checked and timed the same way (where they
cannot serve a case, the row says why). Under a stand-in the compute ceiling is the same-setting Triton matmul, as in the bench. The user-facing
comparison across backends is ``python -m anymla.bench``; this harness tunes the kernels themselves (see each
NOTES.md).
"""

from __future__ import annotations

import argparse
import csv
from typing import NamedTuple, Optional

import torch

import anymla
from anymla.bench import machine, model
from anymla.bench.ceilings import measure_ceilings
from anymla.bench.suites import build_inputs, suite_cases
from anymla.bench.timing import Timer
from anymla.testing import compare_outputs

from . import fit, tuning
from .tuning import TileConfig


class Config(NamedTuple):
    """One configuration of a sweep; None leaves that choice to the launcher."""
    tile: Optional[TileConfig] = None
    splits: Optional[int] = None
    tma: Optional[bool] = None
    warp_specialized: Optional[bool] = None
    mma_v2: Optional[bool] = None


# Configurations tried by --sweep, per case. Earlier sweeps and their outcomes: ../bench/results/h200/sweeps/
# and each kernel's NOTES.md. Gathers prefetch only from 5 stages on (compile_report's "prefetch" column),
# hence the BN 32/16 deep configs.
# The 64-row cases: the warp-specialized Hopper kernels against the portable ones.
_HOPPER_AB = [Config(warp_specialized=True), Config(warp_specialized=False)]
SWEEP = {
    "prefill-v32-h128": _HOPPER_AB, "prefill-v4-h64": _HOPPER_AB,
    "sdecode-v32-b128-sq2-h128": _HOPPER_AB,
    "sdecode-v41+fp4-b128-h64": [Config(splits=sp, warp_specialized=True) for sp in (None, 2)] +
                                [Config(warp_specialized=False)],
    "sdecode-v32-b64-sq1-h64": [Config(splits=sp, warp_specialized=True) for sp in (None, 1, 3)] +
                               [Config(warp_specialized=False)],
    "ddecode-b128-h16-sk8192": [Config(TileConfig(16, bn, 4, st, True), sp, True) for bn, st, sp in
                                ((32, 6, None), (32, 8, None), (32, 6, 3), (64, 4, None))],
    "ddecode-b128-sq2-h128-sk8192": _HOPPER_AB,
    "ddecode-b1-h128-sk32768": _HOPPER_AB,
}
# Tensor-parallel head counts (16 or 8 heads a GPU): one 16-row tile, memory-bound.
_FEW_HEADS = [Config(TileConfig(16, bn, 4, st, False)) for bn, st in ((64, 2), (32, 4), (32, 6), (16, 8))]
SWEEP.update({name: _FEW_HEADS for name in ("v32-decode-h16", "v4-decode-h16", "v32-prefill-h16")})
# The tp suite (issue 14): the Hopper sparse kernels' programs of 8, 16, 32 (hopper/few_heads.py) or 64 heads (a
# forced 12-warp tile's block_h picks them), decoding with and without 2 splits.
_FEW_HEAD_DECODE = [Config(), Config(splits=2)] + [Config(TileConfig(h, 64, 12, 2, False), sp, warp_specialized=True)
                                                   for h in (16, 32, 64) for sp in (None, 2)]
_FEW_HEAD_PREFILL = [Config()] + [Config(TileConfig(h, 64, 12, 2, False), warp_specialized=True) for h in (16, 32)]
# 64 and 128 heads as programs of 32 (or 16), whose two workers dequantize (the few-head form)
_FEW_HEAD_PROGRAMS = [Config(TileConfig(h, 64, 12, 2, False), warp_specialized=True) for h in (32, 16)]
SWEEP.update({name: _FEW_HEAD_DECODE for name in ("tp-sdecode-v32-b128-h16", "tp-sdecode-v32-b128-h8",
                                                  "tp-sdecode-v41+fp4-b128-h16", "tp-sdecode-model1-b128-h16")})
# At most 8 heads: programs of 8 heads against 16 (deepseek suite: V3.2 and V4 at TP 16 and 8)
_EIGHT_OR_SIXTEEN = [Config()] + [Config(TileConfig(h, 64, 12, 2, False), warp_specialized=True) for h in (8, 16)]
SWEEP.update({name: _EIGHT_OR_SIXTEEN for name in ("v32-decode-h8", "v4-decode-h8", "v32-prefill-h8", "v4-prefill-h8",
                                                   "tp-sdecode-v32-b128-h8")})
SWEEP.update({"tp-prefill-h16-d576": _FEW_HEAD_PREFILL,
              "tp-prefill-h32-d512": _FEW_HEAD_PREFILL, "tp-prefill-h32-d576": _FEW_HEAD_PREFILL,
              "tp-sdecode-v32-b128-h32": _FEW_HEAD_DECODE,
              "model1-config1-b128-sq2-h64": [Config(), Config(warp_specialized=False), Config(splits=1),
                                              Config(splits=2)] + _FEW_HEAD_PROGRAMS,
              "model1-config2-b128-sq2-h128": [Config(), Config(warp_specialized=False), Config(splits=1)] +
                                              _FEW_HEAD_PROGRAMS[:1]})

# The portable kernels on the canonical shapes (--portable): the shipped tile (Config()), then tiles that fit the
# 163 KB of an sm_80 block and spill less there (compile_report --arch 80, Triton 3.7.1: the shipped 64-row V3.2
# decoding tile spills 1936 B with mma.sync, whose A operand, q, lives in registers), for the mma.sync stand-in.
_P = lambda bh, bn, w, st, skip=False: Config(TileConfig(bh, bn, w, st, skip))  # noqa: E731
PORTABLE_SWEEP = {
    "prefill-v32-h128": [Config(), _P(64, 32, 8, 3), _P(32, 64, 4, 2), _P(16, 64, 4, 2)],
    # the shipped 3-stage tile, the one-stage tile it replaced in run 136, and 2 stages
    "sdecode-v32-b128-sq2-h128": [Config(), _P(64, 64, 8, 1), _P(64, 64, 8, 2), _P(64, 32, 8, 1), _P(32, 32, 4, 6),
                                  _P(16, 32, 4, 6)],
    "ddecode-b128-sq2-h128-sk8192": [Config(), _P(64, 32, 8, 3), _P(32, 32, 4, 6, True)],
    "ddecode-b128-h16-sk8192": [Config(), _P(16, 32, 4, 8, True), _P(16, 64, 4, 4, True)],
    # 5-6 % short of issue 13's 1.4x of the Hopper kernels in run 137: split counts (the shipped one fills each
    # SM once) and the stage count of the quantized loop
    "ddecode-b1-h128-sk32768": [Config()] + [Config(splits=sp) for sp in (32, 48, 66, 96)] + [_P(64, 32, 8, 3)],
    "sdecode-v32-b64-sq1-h64": [Config()] + [Config(splits=sp) for sp in (1, 3, 4)] +
                               [_P(64, 64, 8, 2), _P(64, 32, 8, 3), _P(64, 32, 8, 5)],
}


def _describe(config: Config) -> str:
    tile, splits, tma, ws, mma = config
    if tile is None:
        text = "shipped"
    else:
        text = f"bh{tile.block_h} bn{tile.block_n} w{tile.num_warps} s{tile.num_stages} " + \
            ("branch" if tile.skip_scale else "select")
    text += "" if splits is None else f" sp{splits}"
    text += "" if tma is None else (" tma" if tma else " gather")
    text += "" if ws is None else (" warp-specialized" if ws else " portable")
    return text + ("" if mma is None else (" mma_v2" if mma else " mma_v2 off"))


def _kernel(fn, args: dict, scope) -> str:
    """Which kernel of the Triton tier the dispatcher's plan runs for the call (``explain()``'s first words)."""
    try:
        with scope():
            return anymla.explain(fn, **args, backend="triton").kernel.split(" (")[0].removeprefix("the ")
    except Exception as e:
        return f"none: {type(e).__name__}"


def _timed_row(row: dict, call, op: str, expected, timer: Timer, cost, ceilings, scope) -> None:
    """Check ``call()`` against ``expected`` (FlashMLA's tolerances), then time it, both inside ``scope()``; a
    wrong or failing call is reported in ``row``'s status, never timed."""
    try:
        with scope():
            compare_outputs(op, call(), expected)
            t = timer.measure(call)
        r = model.rates(cost, t.median_us, ceilings)
        row.update(status="ok", us=t.median_us, tflops=r.tflops, gbps=r.gbps, x_matmul=r.ratio_to_matmul,
                   x_copy=r.ratio_to_copy)
    except Exception as e:
        row.update(status=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")


def run(suite: str, case_names, sweep: bool, reps: int, csv_path, portable: bool = False,
        mma_v2: bool = False) -> list[dict]:
    device = torch.device("cuda")
    timer = Timer(device, reps)
    ceilings = measure_ceilings(device, timer, machine.stand_in(portable))
    print(f"ceilings: {ceilings.describe()}", flush=True)
    rows = []
    sink = _CsvSink(csv_path, ceilings)

    def emit(row: dict) -> None:
        rows.append(row)
        sink.write(row)
        print(_fmt(row), flush=True)

    for case in suite_cases(suite):
        if case_names and case.name not in case_names:
            continue
        fn, args = build_inputs(case, device)
        expected = fn(**{**args, "tile_scheduler_metadata": None} if "tile_scheduler_metadata" in args else args,
                      backend="reference")
        cost = model.cost(case.op, args)
        configs = (PORTABLE_SWEEP if portable else SWEEP).get(case.name, []) if sweep else [Config()]
        if mma_v2:
            configs = [c for config in configs for c in (config._replace(mma_v2=True), config._replace(mma_v2=False))]
        for config in configs:
            if portable:
                config = config._replace(warp_specialized=False)
            row = dict(case=case.name, config=_describe(config))
            tile = config.tile
            call_args = dict(args)
            if "tile_scheduler_metadata" in call_args:
                call_args["tile_scheduler_metadata"], _ = anymla.get_mla_metadata()
            def scope(config=config):
                return tuning.forced(config.tile, config.splits, config.tma,
                                     warp_specialized=config.warp_specialized, mma_v2=config.mma_v2)

            row["kernel"] = _kernel(fn, call_args, scope)
            _timed_row(row, lambda: fn(**call_args, backend="triton"), case.op, expected, timer, cost, ceilings, scope)
            shrunk = fit.shrunk_to(tile) if tile is not None and row["status"] == "ok" else set()
            if shrunk:  # timed, but not as the config asked for
                row["config"] += " (ran as " + ", ".join(_describe(Config(t)) for t in shrunk) + ")"
            emit(row)
        del args, expected
        torch.cuda.empty_cache()
    print()
    for r in rows:
        print(_fmt(r))
    return rows


class _CsvSink:
    """Rows written as they come, so a run stopped by a time limit keeps what it measured."""

    FIELDS = ["device", "copy_gbps", "matmul_tflops", "case", "config", "kernel", "status", "us", "tflops", "gbps",
              "x_matmul", "x_copy"]

    def __init__(self, path, ceilings):
        self.file = open(path, "w", newline="") if path else None
        self.common = dict(device=torch.cuda.get_device_name(), copy_gbps=round(ceilings.copy_gbps),
                           matmul_tflops=round(ceilings.matmul_tflops))
        if self.file:
            self.writer = csv.DictWriter(self.file, fieldnames=self.FIELDS)
            self.writer.writeheader()

    def write(self, row: dict) -> None:
        if self.file:
            self.writer.writerow({**self.common, **row})
            self.file.flush()


def _fmt(r: dict) -> str:
    head = f"{r['case']:30s} {r['config']:34s} {r.get('kernel', ''):28s}"
    if r["status"] != "ok":
        return f"{head} {r['status']}"
    return (f"{head} {r['us']:9.1f} us {r['tflops']:6.1f} TF/s {r['gbps']:7.0f} GB/s  "
            f"x_matmul {r['x_matmul']:.3f} x_copy {r['x_copy']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="canonical", help="a suite of python -m anymla.bench (default: canonical)")
    ap.add_argument("--case", action="append", help="case name(s) of the suite (default: all)")
    ap.add_argument("--sweep", action="store_true", help="try every configuration in SWEEP")
    ap.add_argument("--portable", action="store_true", help="the portable kernels only (PORTABLE_SWEEP with --sweep)")
    ap.add_argument("--mma-v2", action="store_true",
                    help="each configuration with the Gluon mma_v2 kernels (ampere/) forced on and off")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--csv")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the harness times CUDA kernels; no CUDA device here (CPU correctness: the test suite)")
    run(a.suite, a.case, a.sweep, a.reps, a.csv, a.portable, a.mma_v2)


if __name__ == "__main__":
    main()
