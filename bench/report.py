"""Reports of a run: the long-format CSV (one row per shape and backend), the terminal table, the A/B
speed-ups and the markdown summary. Plots: plot.py.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from typing import Optional

from . import anchors, model
from .ceilings import Ceilings
from .machine import STAND_INS, RunInfo
from .runner import OK, CaseOutcome

TRITON_TIER = "triton"
COLUMNS = ("timestamp", "device", "device_name", "torch", "triton", "anymla", "source", "stand_in", "suite", "case",
           "op", "shape", "backend", "status", "note", "timer", "median_us", "p20_us", "p80_us", "reps", "eager_us",
           "host_us", "host_first_us", "host_all_us", "flops", "bytes",
           "tflops", "gbps", "floor_us", "bound", "frac_of_floor", "copy_gbps", "matmul_tflops", "ratio_to_matmul",
           "ratio_to_copy", "dispatcher_choice", "fastest", "anchor_flashmla_us", "anchor_triton",
           "anchor_triton_us", "gather_us", "frac_of_gather")
HEADERS = ("case", "backend", "status", "GPU µs", "p20-p80", "eager µs", "host µs", "% floor", "x ceiling", "note")


def _note(result, info: RunInfo) -> str:
    """The result's note, with how its time was taken when that needs saying."""
    parts = [result.note]
    if result.timing is not None:
        parts.append(result.timing.note)
        if info.interpreter and result.backend == TRITON_TIER:
            parts.insert(0, "Triton interpreter timing")
    if info.stand_in and result.backend == TRITON_TIER:
        parts.insert(0, f"stand-in {info.stand_in}, not the shipped path")
    return "; ".join(filter(None, parts))


def csv_rows(outcomes: list[CaseOutcome], info: RunInfo, ceilings: Ceilings) -> list[dict]:
    rows = []
    for o in outcomes:
        anchor = anchors.ANCHORS.get(o.case.name)
        for r in o.results:
            row = dict.fromkeys(COLUMNS, "")
            row.update({k: v for k, v in dataclasses.asdict(info).items() if k in row})
            row.update(suite=o.suite, case=o.case.name, op=o.case.op, shape=o.shape, backend=r.backend,
                       status=r.status, note=_note(r, info), copy_gbps=ceilings.copy_gbps,
                       matmul_tflops=ceilings.matmul_tflops, dispatcher_choice=o.dispatcher_choice,
                       fastest=o.fastest)
            if o.cost is not None:
                row.update(flops=o.cost.flops, bytes=o.cost.bytes)
                row.update(zip(("floor_us", "bound"), model.floor_us(o.cost, ceilings)))
            if r.timing is not None:
                t = r.timing
                row.update(timer=t.timer, median_us=t.median_us, p20_us=t.p20_us, p80_us=t.p80_us, reps=t.reps,
                           eager_us=_maybe(t.eager_us), host_us=_maybe(t.host_us),
                           host_first_us=_maybe(t.host_first_us), host_all_us=_maybe(t.host_all_us))
                row.update(dataclasses.asdict(model.rates(o.cost, t.median_us, ceilings)))
                if o.gather_us is not None:
                    row.update(frac_of_gather=o.gather_us / t.median_us)
            if o.gather_us is not None:
                row.update(gather_us=o.gather_us)
            if anchor is not None:
                row.update(anchor_flashmla_us=anchor.flashmla_us, anchor_triton=anchor.triton_name,
                           anchor_triton_us=anchor.triton_us if anchor.triton_us is not None else "")
            rows.append(row)
    return rows


def _maybe(x: float):
    """A measurement, or "" where it was not taken (NaN)."""
    return "" if math.isnan(x) else x


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def _cells(o: CaseOutcome, r, info: RunInfo, ceilings: Ceilings) -> list[str]:
    cells = [o.case.name, r.backend, r.status.upper() if r.status != OK else OK]
    if r.timing is None:
        return cells + [""] * 7 + [_note(r, info)]
    t = r.timing
    rates = model.rates(o.cost, t.median_us, ceilings)
    ceiling = f"{rates.ratio_to_matmul:.3g} matmul" if rates.bound == "compute" else f"{rates.ratio_to_copy:.3g} copy"
    eager = "" if math.isnan(t.eager_us) else _num(t.eager_us)
    host = "" if math.isnan(t.host_us) else _num(t.host_us)
    return cells + [_num(t.median_us), f"{_num(t.p20_us)}-{_num(t.p80_us)}", eager, host,
                    f"{100 * rates.frac_of_floor:.3g}%", ceiling, _note(r, info)]


_SOURCES = {"auto": "by the device's priority list", "tuned": "from the tuning file's measurement",
            "measured": "measured faster for this regime on this device kind (anymla's shipped measurements)",
            "keyword": "as the call asked", "context": "inside use_backend", "env": "from ANYMLA_BACKEND"}


def verdict(o: CaseOutcome) -> str:
    """The user's question for one shape: which backend the dispatcher picks, and is it the fastest measured?"""
    if o.decision is None:
        return "dispatcher: no decision (the inputs could not be built)"
    head = f"dispatcher picks {o.dispatcher_choice} ({_SOURCES.get(o.decision.source, o.decision.source)})"
    fastest = o.fastest
    if not fastest:
        return head + "; no backend was timed"
    if fastest == o.dispatcher_choice:
        return head + "; it was also the fastest in this run"
    chosen = o.result(o.dispatcher_choice)
    if chosen is None or chosen.timing is None:
        return head + f" (not timed here); fastest measured: {fastest}"
    gain = chosen.timing.median_us / o.result(fastest).timing.median_us
    return head + f"; fastest measured: {fastest}, {gain:.2f}x faster (--tune would pick it)"


def _anchor_text(o: CaseOutcome) -> Optional[str]:
    """The H200 anchor figures of a canonical shape (FlashMLA and the best public Triton kernel)."""
    anchor = anchors.ANCHORS.get(o.case.name)
    if anchor is None or o.cost is None:
        return None
    text = f"FlashMLA CUDA {_num(anchor.flashmla_us)} µs ({_anchor_ratio(o.cost, anchor.flashmla_us)})"
    if anchor.triton_us is not None:
        text += f", best public Triton ({anchor.triton_name}) {_num(anchor.triton_us)} µs"
    return text


def gather_text(o: CaseOutcome, ceilings: Ceilings) -> Optional[str]:
    """The gather floor's line under a sparse decoding shape (``gather.py``): its time and rate, and how close
    the fastest backend comes to it."""
    if o.gather_us is None:
        return o.gather_note or None
    floor, _ = model.floor_us(o.cost, ceilings)
    text = (f"gather floor (a read-only kernel gathering this call's rows): {_num(o.gather_us)} µs, "
            f"{100 * floor / o.gather_us:.3g}% floor")
    fastest = o.result(o.fastest) if o.fastest else None
    if fastest is not None:
        text += f"; {o.fastest} at {o.gather_us / fastest.timing.median_us:.2f}x of it"
    return text


def _anchor_ratio(cost: model.Cost, time_us: float) -> str:
    """The anchor's achieved rate against the anchor run's own ceilings, for the ceiling that binds."""
    anchor_ceilings = Ceilings(anchors.ANCHOR_COPY_GBPS, anchors.ANCHOR_MATMUL_TFLOPS, "", "")
    rates = model.rates(cost, time_us, anchor_ceilings)
    if rates.bound == "memory":
        return f"{_num(rates.gbps)} GB/s, {rates.ratio_to_copy:.2f}x copy"
    return f"{_num(rates.tflops)} TFLOP/s, {rates.ratio_to_matmul:.2f}x matmul"


def speedups(outcomes: list[CaseOutcome], baseline: str, target: str) -> list[tuple]:
    """``(outcome, speed-up, low, high)`` per case where both were timed: speed-up = baseline time / target
    time; low..high pairs the slow and fast ends of the two p20-p80 spreads."""
    out = []
    for o in outcomes:
        a, b = o.result(baseline), o.result(target)
        if a is None or b is None or a.timing is None or b.timing is None:
            continue
        ta, tb = a.timing, b.timing
        out.append((o, ta.median_us / tb.median_us, ta.p20_us / tb.p80_us, ta.p80_us / tb.p20_us))
    return out


def ab_lines(outcomes: list[CaseOutcome], baseline: str, target: str) -> list[str]:
    rows = speedups(outcomes, baseline, target)
    lines = [f"A/B: {target} vs {baseline} (speed-up = {baseline} time / {target} time, p20-p80 spread)"]
    lines += [f"  {o.case.name}: {s:.2f}x [{lo:.2f}-{hi:.2f}]" for o, s, lo, hi in rows]
    if rows:
        geomean = math.exp(sum(math.log(s) for _, s, _, _ in rows) / len(rows))
        lines.append(f"  geometric mean over {len(rows)} shapes: {geomean:.2f}x")
    else:
        lines.append("  no shape where both were timed")
    return lines


def header_lines(info: RunInfo, ceilings: Ceilings) -> list[str]:
    lines = [f"anymla.bench on {info.device} ({info.device_name}); torch {info.torch}, triton {info.triton}, "
             f"anymla {info.anymla} (source {info.source}); {info.timestamp}",
             f"ceilings measured in this run (the better of its start and end): {ceilings.describe()}",
             "GPU µs: CUDA-graph replay (calls under 1 ms) or device events, L2 flushed; eager µs: wall time per call "
             "of back-to-back eager calls; host µs: enqueueing one call with the GPU kept busy, the lowest of five "
             "rounds' medians (the CSV's host_all_us: the median over every round; host_first_us: the first call "
             "after a synchronization)",
             "% floor = floor time / GPU time, floor = max(bytes / copy rate, FLOPs / matmul rate); x ceiling: "
             "against the ceiling that binds"]
    if info.interpreter:
        lines.append("NOTE: on the CPU the Triton tier runs in Triton's interpreter: its times are interpreter "
                     "times, not kernel performance")
    if info.stand_in:
        what = "; ".join(STAND_INS[name] for name in info.stand_in.split("+"))
        lines.append(f"NOTE: stand-in run ({info.stand_in}), not the shipped path: {what}. The matmul ceiling is "
                     "a plain Triton matmul compiled with the run's settings, torch.mm's rate named beside it")
    return lines


def format_table(outcomes: list[CaseOutcome], info: RunInfo, ceilings: Ceilings,
                 ab: Optional[tuple] = None) -> str:
    """The terminal report: one row per shape and backend, the dispatcher's verdict under each shape."""
    blocks = []
    for o in outcomes:
        rows = [_cells(o, r, info, ceilings) for r in o.results]
        anchor = _anchor_text(o)
        gather = gather_text(o, ceilings)
        extra = [verdict(o)] + ([gather] if gather else []) + ([f"{anchors.LABEL}: {anchor}"] if anchor else [])
        blocks.append((o.suite, rows, extra))
    widths = [max([len(h)] + [len(row[i]) for _, rows, _ in blocks for row in rows]) for i, h in enumerate(HEADERS)]

    def line(cells):
        return "  ".join(c.ljust(w) if i < 3 or i == len(cells) - 1 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = header_lines(info, ceilings)
    suite = None
    for name, rows, extra in blocks:
        if name != suite:
            suite = name
            out += ["", f"== {name} ==", line(HEADERS)]
        out += [line(row) for row in rows] + [f"    {text}" for text in extra]
    if ab is not None:
        out += [""] + ab_lines(outcomes, *ab)
    return "\n".join(out)


def _md_row(cells) -> str:
    return "| " + " | ".join(c.replace("|", "/") for c in cells) + " |"


def summary_markdown(outcomes: list[CaseOutcome], info: RunInfo, ceilings: Ceilings, files: list[str],
                     ab: Optional[tuple] = None) -> str:
    suites = list(dict.fromkeys(o.suite for o in outcomes))
    out = [f"# anymla.bench: {', '.join(suites)} on {info.device_name}", ""]
    out += [f"- {text}" for text in header_lines(info, ceilings)]
    out += [f"- files: {', '.join(files)}", ""]
    for suite in suites:
        mine = [o for o in outcomes if o.suite == suite]
        out += [f"## {suite}", "", _md_row(HEADERS), _md_row(["---"] * len(HEADERS))]
        out += [_md_row(_cells(o, r, info, ceilings)) for o in mine for r in o.results]
        out += ["", "Dispatcher's choice per shape:", ""] + [f"- {o.case.name}: {verdict(o)}" for o in mine]
        gathers = [(o, text) for o in mine if (text := gather_text(o, ceilings))]
        if gathers:
            out += ["", "Gather floors (sparse decoding):", ""] + [f"- {o.case.name}: {text}" for o, text in gathers]
        anchored = [(o, text) for o in mine if (text := _anchor_text(o))]
        if anchored:
            out += ["", f"H200 anchors ({anchors.LABEL}; ratios against the anchor run's ceilings, "
                        f"{anchors.ANCHOR_COPY_GBPS:,.0f} GB/s copy and "
                        f"{anchors.ANCHOR_MATMUL_TFLOPS:,.0f} TFLOP/s matmul):", ""]
            out += [f"- {o.case.name}: {text}" for o, text in anchored]
        out.append("")
    if ab is not None:
        out += ["## A/B", ""] + [f"    {text}" for text in ab_lines(outcomes, *ab)] + [""]
    return "\n".join(out)
