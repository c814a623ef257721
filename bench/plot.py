"""One PNG per suite: bars per backend per shape, each backend's speed as % of the roofline floor (GPU time),
with a marker at its eager speed (wall time per call of back-to-back eager calls) where that was timed."""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402

from . import model  # noqa: E402
from .ceilings import Ceilings  # noqa: E402
from .machine import RunInfo  # noqa: E402
from .runner import OK, CaseOutcome  # noqa: E402


def plot_suite(path: str, suite: str, outcomes: list[CaseOutcome], info: RunInfo, ceilings: Ceilings) -> None:
    mine = [o for o in outcomes if o.suite == suite]
    backends = list(dict.fromkeys(r.backend for o in mine for r in o.results))
    eager_labelled = False
    width = 0.8 / max(1, len(backends))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(mine) + 2), 4.5))
    for j, name in enumerate(backends):
        xs, ys, eager, missing = [], [], [], []
        for i, o in enumerate(mine):
            r = o.result(name)
            x = i + (j - (len(backends) - 1) / 2) * width
            if r is not None and r.status == OK and r.timing is not None:
                xs.append(x)
                ys.append(100 * model.rates(o.cost, r.timing.median_us, ceilings).frac_of_floor)
                if not math.isnan(r.timing.eager_us):
                    eager.append((x, 100 * model.rates(o.cost, r.timing.eager_us, ceilings).frac_of_floor))
            elif r is not None:
                missing.append((x, r.status))
        color = f"C{j}"
        ax.bar(xs, ys, width, label=name, color=color)
        if eager:
            ax.scatter(*zip(*eager), marker="_", s=220 * width, color="black", zorder=3,
                       label=None if eager_labelled else "eager (wall time per call)")
            eager_labelled = True
        for x, status in missing:  # a gap in the bars says why it is there
            ax.annotate(status, (x, 0), xycoords=("data", "axes fraction"), xytext=(0, 3), textcoords="offset points",
                        rotation=90, ha="center", va="bottom", fontsize=7, color=color)
    ax.set_yscale("log")
    ax.set_ylabel("% of floor (floor time / GPU time; marks: eager)")
    ax.set_xticks(range(len(mine)), [o.case.name for o in mine], rotation=30, ha="right", fontsize=8)
    interpreted = " (Triton: interpreter)" if info.interpreter else ""
    ax.set_title(f"{suite} on {info.device_name}{interpreted}\n{ceilings.describe()}", fontsize=8)
    ax.axhline(100, color="grey", linewidth=0.8, linestyle="--")
    if backends:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
