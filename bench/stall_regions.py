"""Where a warp-specialized kernel waits, from an Nsight Compute SASS source page:

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > REPORT.sass.csv
    python -m anymla.bench.stall_regions REPORT.sass.csv

Each partition of a Gluon warp-specialized kernel starts with a ``SETMAXREG`` (its register budget), so the SASS
between two of them is one partition's code (or the shared prologue and epilogue). Per such region: its share of
the warp stall samples, its instructions executed and its stall reasons; then every ``mbarrier`` wait
(``SYNCS.PHASECHK``) with how often it executed: a wait's retry loop executes once per retry, so the partition
that retries most is the one waiting on the others, and one that never retries is the one they wait for.
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter
from dataclasses import dataclass, field

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


@dataclass
class Region:
    """SASS from one ``SETMAXREG`` to the next (``start``: its first instruction)."""
    start: str
    samples: float = 0.0
    executed: float = 0.0
    stalls: Counter = field(default_factory=Counter)
    lines: list = field(default_factory=list)  # (samples, address, instruction)


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_source_page(path: str) -> list[dict]:
    """The page's instruction rows as dicts keyed by its header (the line after the kernel's name)."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next(i for i, r in enumerate(rows) if "Source" in r and "Address" in r)
    header = rows[start]
    return [dict(zip(header, r)) for r in rows[start + 1:] if len(r) >= len(header)]


def regions(rows: list[dict]) -> list[Region]:
    """The rows split at every ``SETMAXREG``, in address order."""
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k] if rows else []
    out = [Region(start="kernel entry")]
    for r in rows:
        source = r["Source"].strip()
        if "SETMAXREG" in source:
            out.append(Region(start=f"{source} @{r['Address']}"))
        region = out[-1]
        samples = _number(r.get(SAMPLES, ""))
        region.samples += samples
        region.executed += _number(r.get(EXECUTED, ""))
        region.stalls.update({k[len("stall_"):]: _number(r[k]) for k in reasons})
        region.lines.append((samples, r["Address"], source))
    return out


def barrier_waits(rows: list[dict]) -> list[tuple[str, str, float]]:
    """``(address, instruction, times executed)`` of every mbarrier wait."""
    return [(r["Address"], r["Source"].strip(), _number(r.get(EXECUTED, ""))) for r in rows
            if "SYNCS.PHASECHK" in r["Source"]]


def report(path: str, top: int = 8, least: float = 0.005) -> str:
    rows = read_source_page(path)
    found = regions(rows)
    total = sum(x.samples for x in found) or 1.0
    out = []
    for x in found:
        if x.samples < least * total:
            continue
        reasons = ", ".join(f"{k} {v / x.samples:.0%}" for k, v in x.stalls.most_common(6) if v)
        out.append(f"== {x.start}: {x.samples / total:.1%} of the samples, {len(x.lines)} instructions, "
                   f"{x.executed:.3g} warp-instructions executed")
        out.append(f"   {reasons}")
        for samples, address, source in sorted(x.lines, reverse=True)[:top]:
            out.append(f"   {samples / total:6.1%}  {address}  {source[:80]}")
    out.append("mbarrier waits (a retry loop executes once per retry):")
    out += [f"   {address}  {source[:80]}  executed {n:.0f}" for address, source, n in barrier_waits(rows)]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="an Nsight Compute source page: ncu -i R --page source --csv --print-source sass")
    ap.add_argument("--top", type=int, default=8, help="instructions listed a region, most samples first")
    args = ap.parse_args()
    print(report(args.csv, args.top))


if __name__ == "__main__":
    main()
