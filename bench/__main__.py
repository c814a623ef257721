"""``python -m anymla.bench``: every available backend on named suites of shapes, behind one correctness gate,
timed against the device's own ceilings.

    python -m anymla.bench                        # the quick suite on the best device (cuda > npu > cpu)
    python -m anymla.bench --suite canonical      # the three kernel issues' canonical shapes
    python -m anymla.bench --shape 'dense_decode:b=4,h_q=16,s_k=1024' --baseline reference --target triton
    python -m anymla.bench --list                 # suites, shapes and backends
    python -m anymla.bench --suite canonical --portable   # stand-in: the Hopper kernels off (what other GPUs run)
    python -m anymla.bench --suite canonical --mma-sync   # stand-in: those, with tl.dot as mma.sync (Ampere-class)

Writes ``results.csv`` (long format), one ``<suite>.png`` per suite and ``summary.md`` into ``--out``, then
prints the table. Exits 1 when a backend was wrong or failed on some shape.
"""

import importlib.util
import os
import sys


def _accelerator_present() -> bool:
    import torch
    if torch.cuda.is_available():
        return True
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers the npu device and torch.npu)
    return torch.npu.is_available()


# Triton decides between compiling and interpreting when a kernel is decorated, i.e. when anymla first imports
# its Triton kernels. With no GPU or NPU the Triton tier can only run in the interpreter, so ask for it now,
# before anything imports triton.
if "TRITON_INTERPRET" not in os.environ and not _accelerator_present():
    os.environ["TRITON_INTERPRET"] = "1"

# --mma-sync: Triton lowers tl.dot to mma.sync where DISABLE_MMA_V3 is set. Set it here, before anything imports
# triton, so that no part of the run sees Triton without it (the variable is part of Triton's cache key: no
# wgmma build is reused). main() checks that it was.
MMA_SYNC_FLAG = "--mma-sync"
if MMA_SYNC_FLAG in sys.argv[1:]:
    os.environ["DISABLE_MMA_V3"] = "1"

import argparse  # noqa: E402
import contextlib  # noqa: E402

import torch  # noqa: E402

try:
    import matplotlib  # noqa: F401
    import tqdm  # noqa: F401
except ImportError as missing:
    raise SystemExit(f"python -m anymla.bench needs matplotlib and tqdm ({missing}): pip install 'anymla[bench]'")

import anymla  # noqa: E402
from anymla import callpath  # noqa: E402
from anymla.selection import default_device  # noqa: E402

from . import machine, runner, suites  # noqa: E402
from .ceilings import better, measure_ceilings  # noqa: E402
from .plot import plot_suite  # noqa: E402
from .report import csv_rows, format_table, summary_markdown, write_csv  # noqa: E402
from .timing import Timer  # noqa: E402
from .tune import write_tuning  # noqa: E402

DEFAULT_SUITE = "quick"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m anymla.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", action="append", default=[], metavar="NAME",
                   help=f"a named suite (repeatable): {', '.join(suites.suite_names())}; default {DEFAULT_SUITE} "
                        "when no --shape is given")
    p.add_argument("--shape", action="append", default=[], metavar="SPEC",
                   help="a shape 'op:key=val,...' (repeatable), e.g. 'sparse_decode:b=2,h_q=64,s_k=256,topk=128'")
    p.add_argument("--backends", metavar="A,B", help="backends to run (default: every backend available on the "
                                                     "device); the reference always runs as the correctness oracle")
    p.add_argument("--baseline", metavar="A", help="A/B: the baseline backend (with --target; default: the reference)")
    p.add_argument("--target", metavar="B", help="A/B: the backend whose speed-up over --baseline is printed "
                                                "(default: the first other backend that runs here)")
    p.add_argument("--tune", metavar="FILE",
                   help="write the fastest correct backend per shape into FILE, the tuning file the dispatcher "
                        "reads (anymla.load_tuning / ANYMLA_TUNING)")
    p.add_argument("--out", metavar="DIR", default="bench_out", help="where results.csv, <suite>.png and "
                                                                         "summary.md go (default: %(default)s)")
    p.add_argument("--reps", type=int, metavar="N",
                   help="timed repetitions per call: at most N on accelerators (default 100, fewer for slow "
                        "calls), exactly N on the CPU (default 3)")
    p.add_argument("--device", help="torch device to run on (default: cuda, else npu, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default: %(default)s)")
    p.add_argument("--list", action="store_true", help="list suites, their shapes and the backends, then exit")
    p.add_argument("--portable", action="store_true",
                   help="stand-in for the GPUs without Hopper's kernels: the Triton tier runs its portable kernels "
                        "only (tuning.forced(warp_specialized=False)); every row says so")
    p.add_argument(MMA_SYNC_FLAG, action="store_true",
                   help="stand-in for Ampere/Ada-class code: DISABLE_MMA_V3=1 (set before triton is imported), so "
                        "Triton lowers tl.dot to mma.sync instead of wgmma; implies --portable (the Hopper kernels "
                        "issue wgmma themselves); every row says so")
    return p


def _print_list(device: torch.device) -> None:
    for name in suites.suite_names():
        print(f"{name}:")
        for case in suites.suite_cases(name):
            print(f"  {case.name:30s} {case.spec()}")
    available = anymla.available_backends(device)
    print(f"backends on {device}:")
    for name in anymla.registered_backends():
        reasons = anymla.get_backend(name).unavailable_reasons(device)
        state = "available" if name in available else "unavailable: " + "; ".join(reasons)
        if name == "triton" and name in available and device.type == "cpu":
            state += " (in Triton's interpreter, which the bench turns on where there is no GPU or NPU)"
        print(f"  {name:12s} {state}")


def _backends(args, device: torch.device) -> list[str]:
    names = args.backends.split(",") if args.backends else anymla.available_backends(device)
    names = [n.strip() for n in names if n.strip()]
    for extra in (args.baseline, args.target):
        if extra and extra not in names:
            names.append(extra)
    for name in names:
        anymla.get_backend(name)  # an unknown name raises with the registered ones
    return names


def _plan(args) -> list[tuple]:
    names = args.suite or ([] if args.shape else [DEFAULT_SUITE])
    plan = [(name, case) for name in names for case in suites.suite_cases(name)]
    return plan + [("cli", suites.parse_shape(spec)) for spec in args.shape]


def _write_reports(out: str, outcomes: list, info, ceilings, ab) -> list[str]:
    """results.csv, one PNG per suite and summary.md in ``out``; returns their names."""
    os.makedirs(out, exist_ok=True)
    suites_run = list(dict.fromkeys(o.suite for o in outcomes))
    files = ["results.csv"] + [f"{s}.png" for s in suites_run] + ["summary.md"]
    write_csv(os.path.join(out, files[0]), csv_rows(outcomes, info, ceilings))
    for suite, png in zip(suites_run, files[1:-1]):
        plot_suite(os.path.join(out, png), suite, outcomes, info, ceilings)
    with open(os.path.join(out, files[-1]), "w") as f:
        f.write(summary_markdown(outcomes, info, ceilings, files, ab))
    return files


def _default_ab(backends: list[str]):
    """The reference against the first other backend that runs here (the dispatcher's tier on a GPU)."""
    others = [n for n in backends if n != runner.REFERENCE]
    return (runner.REFERENCE, others[0]) if runner.REFERENCE in backends and others else None


def _stand_in(args):
    """The scope of a --portable/--mma-sync run (the Hopper kernels off), or of a plain run."""
    if args.mma_sync and not machine.mma_v3_disabled():
        raise SystemExit(f"python -m anymla.bench: {MMA_SYNC_FLAG} must be on the command line of "
                         "python -m anymla.bench (it sets DISABLE_MMA_V3=1 before triton is imported), or set "
                         "DISABLE_MMA_V3=1 in the environment yourself")
    if args.tune and (args.portable or args.mma_sync):
        raise SystemExit("python -m anymla.bench: --tune records the shipped path's fastest backends; a stand-in's "
                         "timings are not theirs (drop --portable / --mma-sync)")
    if not (args.portable or args.mma_sync):
        return contextlib.nullcontext()
    from anymla.triton_kernels import tuning
    return tuning.forced(warp_specialized=False)


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if (args.baseline is None) != (args.target is None):
        raise SystemExit("--baseline and --target go together")
    stand_in = _stand_in(args)
    device = torch.device(args.device) if args.device else default_device()
    if args.list:
        _print_list(device)
        return 0
    try:
        plan = _plan(args)
        backends = _backends(args, device)
    except ValueError as err:
        raise SystemExit(f"python -m anymla.bench: {err}") from None
    timer = Timer(device, args.reps or (3 if device.type == "cpu" else 100))
    info = machine.describe(device, portable=args.portable or args.mma_sync)
    skipped = [n for n in anymla.registered_backends() if n not in backends and not args.backends]
    print(f"anymla.bench: {len(plan)} shapes x {', '.join(backends)} on {device} ({info.device_name})"
          + (f"; not available here: {', '.join(skipped)} (why: --list)" if skipped else "")
          + (f"; stand-in: {info.stand_in}" if info.stand_in else ""), flush=True)
    print(callpath.prepare(device), flush=True)
    ceilings = measure_ceilings(device, timer, info.stand_in)
    scale = runner.INTERPRETER_TOLERANCE_SCALE if info.interpreter else 1.0
    os.makedirs(args.out, exist_ok=True)
    partial = os.path.join(args.out, "results.csv")

    def keep(outcomes):  # a run stopped before its end keeps the rows of the cases it finished
        write_csv(partial, csv_rows(outcomes, info, ceilings))

    with stand_in:
        outcomes = runner.run(plan, backends, timer, tolerance_scale=scale, seed=args.seed, on_case=keep)
    ceilings = better(ceilings, measure_ceilings(device, timer, info.stand_in))

    ab = (args.baseline, args.target) if args.baseline else _default_ab(backends)
    files = _write_reports(args.out, outcomes, info, ceilings, ab)
    print(f"wrote {', '.join(os.path.join(args.out, f) for f in files)}")
    if args.tune:
        chosen = write_tuning(args.tune, outcomes, info)
        print(f"wrote {len(chosen)} tuned choice(s) to {args.tune} (use: ANYMLA_TUNING={args.tune} "
              "or anymla.load_tuning)")
    print(format_table(outcomes, info, ceilings, ab))
    failed = any(r.status in (runner.WRONG, runner.ERROR) for o in outcomes for r in o.results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
