"""``python -m anymla.bench.standins SHIPPED PORTABLE MMA_SYNC [MMA_SYNC_TRITON]``: one table of the Triton tier's
canonical shapes on the shipped path and on the stand-ins for the GPUs without Hopper's kernels (issue 13's table),
from the ``results.csv`` of four ``python -m anymla.bench --suite canonical --backends triton`` runs of one machine:
the shipped path, ``--portable`` (wgmma), ``--mma-sync`` (mma.sync, the mma_v2 kernels where they serve) and,
optionally, ``--mma-sync`` with ``ANYMLA_MMA_V2=0`` (the portable Triton kernel alone). Each stand-in's time comes
with its ratio to the ceiling that binds it, measured in its own run with its own settings (``x`` = matmul or copy).
"""

from __future__ import annotations

import argparse
import csv
import math
from typing import Optional


def _rows(path: str) -> dict[str, dict]:
    """The Triton tier's rows of one run, by case name; every row must come from one stand-in setting."""
    with open(path, newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["backend"] == "triton"]
    settings = {r["stand_in"] for r in rows}
    if len(settings) > 1:
        raise SystemExit(f"{path}: expected one run's rows, got stand-in settings {sorted(settings)}")
    return {r["case"]: r for r in rows}


def _us(row: Optional[dict]) -> float:
    return float(row["median_us"]) if row and row["status"] == "ok" else math.nan


def _shown(us: float) -> str:
    return f"{us:.0f}" if us >= 100 else f"{us:.3g}"


def _ratio(row: Optional[dict]) -> str:
    """``(0.46 matmul)``: the row's fraction of the ceiling that binds it."""
    if not row or row["status"] != "ok":
        return ""
    key = "ratio_to_matmul" if row["bound"] == "compute" else "ratio_to_copy"
    return f" ({float(row[key]):.3g} {'matmul' if key == 'ratio_to_matmul' else 'copy'})"


def _cell(row: Optional[dict]) -> str:
    return f"{_shown(_us(row))}{_ratio(row)}" if row and row["status"] == "ok" else (row["status"] if row else "—")


def table(shipped: str, portable: str, mma_sync: str, mma_sync_triton: Optional[str] = None) -> str:
    paths = [p for p in (shipped, portable, mma_sync, mma_sync_triton) if p]
    runs = [_rows(p) for p in paths]
    names = ["shipped", "portable, wgmma", "mma.sync", "mma.sync, portable Triton kernel"][:len(runs)]
    header = ["canonical case", *names[:2], "portable / shipped", *names[2:]]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for case in runs[0]:
        got = [run.get(case) for run in runs]
        slower = _us(got[1]) / _us(got[0])
        cells = [case, _shown(_us(got[0])), _cell(got[1]), f"{slower:.2f}x" if slower == slower else "—",
                 _cell(got[2])] + [_cell(g) for g in got[3:]]
        lines.append("| " + " | ".join(cells) + " |")
    first = next(iter(runs[0].values()))
    ceilings = "; ".join(f"{name}: matmul {float(next(iter(run.values()))['matmul_tflops']):.1f} TFLOP/s"
                         for name, run in zip(names, runs))
    return (f"{first['device_name']}, torch {first['torch']}, Triton {first['triton']}, GPU µs; ceilings of each "
            f"run ({ceilings}; copy {float(first['copy_gbps']):.0f} GB/s)\n\n" + "\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shipped")
    ap.add_argument("portable")
    ap.add_argument("mma_sync")
    ap.add_argument("mma_sync_triton", nargs="?")
    a = ap.parse_args()
    print(table(a.shipped, a.portable, a.mma_sync, a.mma_sync_triton))


if __name__ == "__main__":
    main()
