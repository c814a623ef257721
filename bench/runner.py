"""Run suites: per case, build the inputs once, gate every backend against the reference on them, and time
only the backends whose outputs agree.

A backend that cannot take a shape is ``unsupported`` (with the dispatcher's reasons), one that raises is
``error``, one whose outputs differ from the reference's by FlashMLA's method is ``wrong``: none of them is
timed. The reference is the oracle, so it is timed without a gate.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from tqdm import tqdm

import anymla
from anymla import buffers
from anymla.selection import BackendNotSupported, Decision
from anymla.testing import compare_outputs, poison_

from . import model
from .suites import Case, build_inputs
from .timing import Timer, Timing, device_module, synchronize

REFERENCE = "reference"
OK, WRONG, ERROR, UNSUPPORTED = "ok", "wrong", "error", "unsupported"
# Triton's interpreter casts fp32 to bf16 by truncation, not rounding: under it the gate doubles FlashMLA's
# tolerances (a deliberately wrong output still fails by orders of magnitude).
INTERPRETER_TOLERANCE_SCALE = 2.0


@dataclass
class BackendResult:
    backend: str
    status: str
    note: str = ""
    timing: Optional[Timing] = None


@dataclass
class CaseOutcome:
    """Everything measured for one case: its cost, the dispatcher's automatic decision, one result per backend."""

    suite: str
    case: Case
    shape: str  # the problem's shape_key (the case's spec when its inputs could not be built)
    cost: Optional[model.Cost]
    decision: Optional[Decision]
    results: list = field(default_factory=list)
    gather_us: Optional[float] = None  # sparse decoding on an accelerator: the gather floor (gather.py)
    gather_note: str = ""  # why there is none, where it failed

    @property
    def dispatcher_choice(self) -> str:
        return self.decision.backend if self.decision is not None else ""

    @property
    def fastest(self) -> str:
        timed = [r for r in self.results if r.status == OK and r.timing is not None]
        return min(timed, key=lambda r: r.timing.median_us).backend if timed else ""

    def result(self, backend: str) -> Optional[BackendResult]:
        return next((r for r in self.results if r.backend == backend), None)


def _first_line(err: BaseException, limit: int = 160) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:limit] if text else ''}"


def _unsupported_reasons(err: BackendNotSupported, name: str) -> str:
    """The reasons ``name`` gave, from the dispatcher's message (its last line lists them)."""
    return str(err).strip().splitlines()[-1].strip().removeprefix(f"- {name}:").strip()


def _gate_and_time(name: str, op: str, call: Callable, expected: tuple, timer: Timer, scale: float) -> BackendResult:
    if name != REFERENCE:
        # anymla's tiers allocate outputs and workspaces NaN-filled during the gate, so an element a kernel
        # forgets to write cannot pass; the timed calls allocate plainly.
        buffers.poison_outputs(True)
        try:
            got = tuple(call())
            synchronize(timer.device)
        except Exception as err:  # a backend's failure is reported, never fatal to the run
            return BackendResult(name, ERROR, _first_line(err))
        finally:
            buffers.poison_outputs(False)
        try:
            compare_outputs(op, got, expected, scale=scale)
        except AssertionError as err:
            return BackendResult(name, WRONG, _first_line(err))
        finally:
            # Memory this backend returned may be handed to the next one (peers allocate their own outputs):
            # poisoned, it cannot pass for an answer.
            for t in got:
                poison_(t)
    try:
        return BackendResult(name, OK, "" if name != REFERENCE else "the oracle (not gated)", timer.measure(call))
    except Exception as err:
        return BackendResult(name, ERROR, "while timing: " + _first_line(err))


def run_case(suite: str, case: Case, backends: list[str], timer: Timer, *, tolerance_scale: float = 1.0,
             seed: int = 0, on_backend: Callable[[str], None] = lambda name: None) -> CaseOutcome:
    """Gate and time every backend of ``backends`` on one case (the reference always runs, as the oracle).

    ``on_backend(name)`` is called as each backend starts (for progress display).
    """
    device = timer.device
    try:
        fn, args = build_inputs(case, device, seed)
        decision = anymla.explain(fn, **args)
        cost = model.cost(case.op, args)
        expected = tuple(fn(**args, backend=REFERENCE))
        synchronize(device)
    except Exception as err:
        note = "the case could not be set up (inputs, cost or the reference's output): " + _first_line(err)
        for name in backends:
            on_backend(name)
        return CaseOutcome(suite, case, case.spec(), None, None, [BackendResult(n, ERROR, note) for n in backends])
    outcome = CaseOutcome(suite, case, decision.shape, cost, decision)
    if case.op == "sparse_decode" and device.type != "cpu":
        try:
            from .gather import gather_floor_us
            outcome.gather_us = gather_floor_us(args, lambda fn: timer.measure(fn).median_us)
        except Exception as err:  # a floor that cannot be measured is reported, never fatal to the run
            outcome.gather_note = "gather floor not measured: " + _first_line(err)
    for name in backends:
        on_backend(name)
        try:
            anymla.explain(fn, **args, backend=name)
        except BackendNotSupported as err:
            outcome.results.append(BackendResult(name, UNSUPPORTED, _unsupported_reasons(err, name)))
            continue
        call = functools.partial(fn, **args, backend=name)
        outcome.results.append(_gate_and_time(name, case.op, call, expected, timer, tolerance_scale))
    return outcome


def _release(device: torch.device) -> None:
    module = device_module(device)
    if module is not None:
        module.empty_cache()


def run(plan: list[tuple[str, Case]], backends: list[str], timer: Timer, *, tolerance_scale: float = 1.0,
        seed: int = 0, on_case: Callable[[list], None] = lambda outcomes: None) -> list[CaseOutcome]:
    """Run ``plan`` (``(suite name, case)`` pairs) with a progress bar; problems are reported as they happen,
    and ``on_case(outcomes so far)`` is called after each case."""
    outcomes = []
    with tqdm(total=len(plan) * len(backends), desc="anymla.bench", unit="run", dynamic_ncols=True) as bar:
        for suite, case in plan:
            started = []

            def starting(name: str) -> None:
                bar.update(1 if started else 0)  # the previous backend of this case is done
                started.append(name)
                bar.set_postfix_str(f"{case.name} / {name}")

            outcome = run_case(suite, case, backends, timer, tolerance_scale=tolerance_scale, seed=seed,
                               on_backend=starting)
            bar.update(1)
            for r in outcome.results:
                if r.status in (WRONG, ERROR):
                    bar.write(f"{case.name}: {r.backend} {r.status.upper()}: {r.note}")
            outcomes.append(outcome)
            _release(timer.device)
            on_case(outcomes)
    return outcomes
