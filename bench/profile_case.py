"""Run one case of a bench suite a few times, for a kernel profiler (Nsight Compute) to observe:

    ncu --clock-control none -k regex:KERNEL --launch-skip 2 --launch-count 1 \\
        python -m anymla.bench.profile_case --suite tp --case tp-sdecode-v32-b128-h16

The first calls plan and compile (skip them with ``--launch-skip``); ``--backend`` and ``--portable`` pick
what runs, as in the bench.
"""

from __future__ import annotations

import argparse

import torch

from anymla.bench.suites import build_inputs, suite_cases
from anymla.triton_kernels import tuning


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default="canonical")
    ap.add_argument("--case", required=True)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--portable", action="store_true", help="the portable kernels (no Hopper kernel)")
    args = ap.parse_args()
    cases = {c.name: c for c in suite_cases(args.suite)}
    if args.case not in cases:
        raise SystemExit(f"--case: expected one of {', '.join(cases)}, got {args.case!r}")
    fn, kwargs = build_inputs(cases[args.case], torch.device("cuda"))
    with tuning.forced(warp_specialized=False if args.portable else None):
        for _ in range(args.calls):
            fn(**kwargs)
    torch.cuda.synchronize()
    print(f"{args.case}: {args.calls} calls")


if __name__ == "__main__":
    main()
