"""Timing one call three ways: its GPU time (device events per repetition, an L2 flush outside the timed
region, CUDA-graph replay for short calls, the median with its 20th-80th percentile spread), its eager wall
time per call when called back to back as a decode loop calls it (what a user without CUDA graphs gets:
the larger of the host's enqueue time and the GPU time), and the host's enqueue time of one call.

One code path serves every device: CUDA and Ascend NPUs through their own ``Event`` classes
(``torch.cuda.Event``, ``torch.npu.Event``), the CPU through a wall-clock stand-in with the same interface.
"""

from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

# Writing this much before each repetition evicts the previous call's data from the last-level cache
# (an H200 has 60 MB of L2; Ascend 910B about 192 MB). On the CPU a smaller write evicts the LLC.
_FLUSH_BYTES = {"cpu": 32 << 20}
_DEFAULT_FLUSH_BYTES = 256 << 20
# Calls whose eager time is under this are timed as CUDA-graph replays, where the host's launch gaps cannot
# enter the timing. The eager time includes the host's launch work (anymla's dispatch, several kernels), so
# decode-sized calls of a few hundred microseconds of device time fall under it.
GRAPH_BELOW_US = 1000.0
# Timing the host's enqueue: rounds of calls queued behind a spinning kernel of this many GPU cycles (~10 ms on an
# H200, longer than a round's host work for calls of up to ~0.6 ms of it), the first of a round after a drain.
_ENQUEUE_ROUNDS, _ENQUEUE_ROUND, _SPIN_CYCLES = 5, 16, 20_000_000


@dataclass(frozen=True)
class Timing:
    """Per-call time of ``reps`` repetitions, in microseconds, and how it was taken."""

    median_us: float
    p20_us: float
    p80_us: float
    reps: int
    timer: str  # "cuda-graph", "cuda-events", "npu-events" or "wall-clock"
    note: str = ""
    eager_us: float = float("nan")  # wall time per call of back-to-back eager calls (accelerators only)
    host_us: float = float("nan")  # host time to enqueue one call, no synchronization: the lowest round median
    host_first_us: float = float("nan")  # the same for the first call after a synchronization (median)
    host_all_us: float = float("nan")  # the median enqueue time over every round's calls

    @property
    def spread(self) -> float:
        """p80 / p20: how far apart the repetitions were."""
        return self.p80_us / self.p20_us if self.p20_us > 0 else float("inf")


class _WallClockEvent:
    """The CPU stand-in for a device event: ``record()`` and ``elapsed_time()`` (ms) on the host clock."""

    def record(self) -> None:
        self.at = time.perf_counter()

    def elapsed_time(self, end: "_WallClockEvent") -> float:
        return (end.at - self.at) * 1e3


def device_module(device: torch.device):
    """``torch.cuda`` or ``torch.npu`` (present once torch_npu is imported); None for the host."""
    return getattr(torch, device.type) if device.type in ("cuda", "npu") else None


def new_event(device: torch.device):
    module = device_module(device)
    return module.Event(enable_timing=True) if module is not None else _WallClockEvent()


def synchronize(device: torch.device) -> None:
    module = device_module(device)
    if module is not None:
        module.synchronize()


# Repetitions whose 80th percentile exceeds the 20th by more than this are flagged in the note.
UNSTABLE_SPREAD = 1.5


def summarize(times_us: list[float], timer: str, note: str = "") -> Timing:
    q = torch.tensor(times_us, dtype=torch.float64).quantile(torch.tensor([0.2, 0.5, 0.8], dtype=torch.float64))
    t = Timing(float(q[1]), float(q[0]), float(q[2]), len(times_us), timer, note)
    if t.spread > UNSTABLE_SPREAD:
        flag = f"unstable: p80 is {t.spread:.1f}x p20 over {t.reps} reps (a busy machine?), take with care"
        t = Timing(t.median_us, t.p20_us, t.p80_us, t.reps, timer, "; ".join(filter(None, (note, flag))))
    return t


class Timer:
    """Times calls on one device.

    Args:
        reps: the most timed repetitions per call (on the CPU: exactly this many).
        budget_ms: on accelerators, fewer repetitions are taken when ``reps`` of them would run longer
            than this (never fewer than ``min_reps``): slow backends such as the reference stay affordable.
        warmup_ms: warm-up calls after the first (which compiles and builds plans) fill about this long.
        use_graphs: replay calls shorter than :data:`GRAPH_BELOW_US` from a CUDA graph.
    """

    def __init__(self, device: torch.device, reps: int, *, min_reps: int = 10, budget_ms: float = 500.0,
                 warmup_ms: float = 25.0, use_graphs: bool = True):
        if reps < 1:
            raise ValueError(f"reps: expected at least 1, got {reps}")
        self.device = device
        self.reps = reps
        self.min_reps = reps if device.type == "cpu" else min(min_reps, reps)
        self.budget_ms = budget_ms
        self.warmup_ms = warmup_ms if device.type != "cpu" else 0.0
        self.use_graphs = use_graphs and device.type == "cuda"
        self._flush = torch.empty(_FLUSH_BYTES.get(device.type, _DEFAULT_FLUSH_BYTES), dtype=torch.int8,
                                  device=device)
        self._events = device.type + "-events" if device.type != "cpu" else "wall-clock"

    def _time_once(self, fn: Callable[[], object]) -> float:
        start, end = new_event(self.device), new_event(self.device)
        start.record()
        fn()
        end.record()
        synchronize(self.device)
        return start.elapsed_time(end) * 1e3

    def _warm_up(self, fn: Callable[[], object]) -> float:
        """Run ``fn`` until compiled, planned and warm; return an estimate of one call in µs."""
        fn()
        synchronize(self.device)
        estimate = self._time_once(fn)
        for _ in range(min(100, int(self.warmup_ms * 1e3 / max(estimate, 1.0)))):
            fn()
        synchronize(self.device)
        return estimate

    def _graph(self, fn: Callable[[], object]) -> Callable[[], object]:
        """``fn`` captured in a CUDA graph, as the graph's replay; raises when the call cannot be captured."""
        graph = torch.cuda.CUDAGraph()
        with warnings.catch_warnings():
            # A capture that fails part-way ends as an empty graph, and torch warns about that too.
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
            with torch.cuda.graph(graph):
                fn()
        graph.replay()  # the first replay uploads the graph to the device: keep it out of the timing
        synchronize(self.device)
        return graph.replay

    def measure(self, fn: Callable[[], object], *, graph: bool = True) -> Timing:
        """Per-call timing of ``fn`` (which must have run once successfully on these inputs).

        ``graph=False`` keeps ``fn`` out of CUDA graphs whatever its length.
        """
        estimate = self._warm_up(fn)
        run, timer, note = fn, self._events, ""
        if graph and self.use_graphs and estimate < GRAPH_BELOW_US:
            try:
                run, timer = self._graph(fn), "cuda-graph"
            except RuntimeError as err:  # e.g. a backend that synchronizes (reads sizes back to the host)
                synchronize(self.device)
                note = f"not graph-capturable ({str(err).splitlines()[0][:80]}); eager launches timed"
        reps = self.reps
        if self.device.type != "cpu":
            reps = max(self.min_reps, min(self.reps, int(self.budget_ms * 1e3 / max(estimate, 1.0))))
        starts = [new_event(self.device) for _ in range(reps)]
        ends = [new_event(self.device) for _ in range(reps)]
        for start, end in zip(starts, ends):
            # The flush is queued first: while the device writes it, the host enqueues the call, so a graph
            # replay (one launch) is queued before the device reaches the start event. An eager call whose
            # host work outlasts the flush still shows the gap: hence graphs for short calls.
            self._flush.zero_()
            start.record()
            run()
            end.record()
        synchronize(self.device)
        timing = summarize([s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)], timer, note)
        if self.device.type == "cpu":
            return timing
        return Timing(timing.median_us, timing.p20_us, timing.p80_us, timing.reps, timing.timer, timing.note,
                      *self._eager(fn, estimate))

    def _eager(self, fn: Callable[[], object], estimate_us: float) -> tuple[float, float, float, float]:
        """(wall µs per call of back-to-back eager calls, host µs to enqueue one call, median host µs of the first
        call after a synchronization, median host µs to enqueue one call over every round).

        Back to back, no flush and no synchronization between calls, as a decode loop calls them: per call,
        the larger of the host's enqueue time and the GPU time. The enqueue time is each call's own host time
        in rounds of calls queued behind a kernel that keeps the GPU busy for the whole round (CUDA), so
        that neither the device's progress nor a full launch queue enters it: what the host spends on a call
        in a model's forward pass. The host figure is the lowest of the rounds' medians: a slower stretch of
        the host lasts whole rounds (run 108 timed one call at a 41.0 µs median in one suite and 25.5 in the
        next), so the lowest round is the call's own cost; the median over every call is kept beside it. The
        first call of a round is kept apart: after a synchronization the host is slower to start a call (a
        long wait more so), which a serving step pays once, not once a layer."""
        spin = getattr(torch.cuda, "_sleep", None) if self.device.type == "cuda" else None
        rounds, first = [], []
        for _ in range(_ENQUEUE_ROUNDS):
            synchronize(self.device)
            if spin is not None:
                spin(_SPIN_CYCLES)
            rounds.append([])
            for i in range(_ENQUEUE_ROUND):
                t0 = time.perf_counter()
                fn()
                (rounds[-1] if i else first).append((time.perf_counter() - t0) * 1e6)
        n = max(10, min(self.reps, int(self.budget_ms * 1e3 / max(estimate_us, 1.0))))
        synchronize(self.device)
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        synchronize(self.device)
        return ((time.perf_counter() - t0) * 1e6 / n, min(statistics.median(r) for r in rounds),
                statistics.median(first), statistics.median([t for r in rounds for t in r]))
