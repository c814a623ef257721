"""Host cost of a call as users make it: ``python -m anymla.bench.overhead [--csv FILE]``.

Three measurements:

- ``dispatch``: the public function, the problem record, the signature, the decision-cache lookup and the
  backend call, with a backend that returns preallocated outputs (no launch; the meta device): what every
  call pays on the CPU, AMD GPUs and NPUs before its kernels (the Python path). On an NVIDIA GPU also the
  compiled call path's share of a repeated call (its key, the entry lookup and the entry's call of the probe's
  own form, which returns the outputs): what a call pays there before its launches.
- ``host`` (CUDA): the whole eager path of real calls on the GPU, launches included: host µs to enqueue one
  call (the device drained before each sample) and wall µs per call back to back (a decode loop without CUDA
  graphs), for anymla (through the compiled call path, as users get it) and, where ``flash_mla`` imports,
  FlashMLA called directly; and for anymla's Python path (``anymla-python``, :func:`anymla.callpath.python_path`)
  also its host time with the kernel launches skipped, which separates the launches from the Python work and
  allocations, and (``--steps``) the inclusive host µs per call of each step of that path.
- ``primitive`` (CUDA): the host cost of the torch operations a call makes (an allocation, a view, ...).
- ``cold`` (CUDA): a server's first call at every batch size 1..256 in a new process: how many kernels
  that compiles (or loads from Triton's cache) without :func:`anymla.warmup`, and, for another
  configuration warmed up first, the first call at each size against a repeated one (the median of 5), on
  five servers of different cache lengths: a first call's own cost shows at that size in all, host noise in
  one or two (the best of the five is the figure).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import gc
import importlib.util
import time
from typing import NamedTuple

import torch

import anymla
from anymla import callpath
from anymla.kvcache import KVCacheFormat
from anymla.registry import OPS, Backend
from anymla.testing import dense_decode_inputs, prefill_inputs, sparse_decode_inputs


class _Preallocated(Backend):
    name = "overhead-probe"
    ops = frozenset(OPS)
    device_types = ("meta", "cpu", "cuda")

    def __init__(self, outputs: dict):
        self.outputs = outputs

    def unavailable_reasons(self, device):
        return []

    def run(self, problem, plan=None):
        return self.outputs[problem.op]

    def entry(self, problem, plan):
        outputs = self.outputs[problem.op]
        return lambda *_: outputs


def _per_call_us(fn, n: int = 4000, blocks: int = 5) -> float:
    """µs per call of ``fn``: the best of ``blocks`` means of ``n`` calls each (as ``timeit`` advises: what
    slows a block down is the host's doing, not the call's; one 20000-call mean measured 7.9 µs and, on the
    same machine a minute later, 14.9, in runs 97 and 99)."""
    for _ in range(200):
        fn()
    best = float("inf")
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def dispatch(dev: str = "meta") -> dict:
    """µs per call through the dispatcher alone (no kernel), V3.2 sparse decode and dense decode, on ``dev``:
    the Python path on the meta device; on an NVIDIA GPU the compiled call path (the calls' entries made by
    the first call)."""
    b, s_q, h_q = 128, 2, 128
    q = torch.empty(b, s_q, h_q, 576, dtype=torch.bfloat16, device=dev)
    cache = torch.empty(b * 512, 64, 1, 656, dtype=torch.uint8, device=dev)
    idx = torch.empty(b, s_q, 2048, dtype=torch.int32, device=dev)
    dq = torch.empty(b, 1, 16, 576, dtype=torch.bfloat16, device=dev)
    dcache = torch.empty(b * 128, 64, 1, 576, dtype=torch.bfloat16, device=dev)
    table = torch.empty(b, 128, dtype=torch.int32, device=dev)
    lens = torch.empty(b, dtype=torch.int32, device=dev)
    probe = _Preallocated({
        "sparse_decode": (torch.empty(b, s_q, h_q, 512, device=dev), torch.empty(b, s_q, h_q, device=dev)),
        "dense_decode": (torch.empty(b, 1, 16, 512, device=dev), torch.empty(b, 16, 1, device=dev)),
        "sparse_prefill": (None, None, None)})
    anymla.register_backend(probe)
    try:
        meta_s, _ = anymla.get_mla_metadata()
        meta_d, _ = anymla.get_mla_metadata()
        sparse = _per_call_us(lambda: anymla.flash_mla_with_kvcache(
            q, cache, None, None, 512, meta_s, indices=idx, is_fp8_kvcache=True, backend=probe.name))
        dense = _per_call_us(lambda: anymla.flash_mla_with_kvcache(
            dq, dcache, table, lens, 512, meta_d, backend=probe.name))
    finally:
        anymla.unregister_backend(probe.name)
    return {"sparse_decode_us": sparse, "dense_decode_us": dense}


def _dispatch_rows(path: str, r: dict) -> list[dict]:
    print(f"dispatch, {path}: one call through the dispatcher without a kernel, torch {torch.__version__}: "
          f"sparse decode {r['sparse_decode_us']:.1f} µs, dense decode {r['dense_decode_us']:.1f} µs", flush=True)
    return [dict(part="dispatch", case=f"sparse decode ({path})", who="anymla", host_us=r["sparse_decode_us"]),
            dict(part="dispatch", case=f"dense decode ({path})", who="anymla", host_us=r["dense_decode_us"])]


# The calls of the host-cost table (issue 16): (name, op, builder of the keyword arguments).
def _host_cases(device):
    F = KVCacheFormat
    return [
        ("dense b1 h128 s_k 32768", "dense", lambda: dense_decode_inputs(1, 1, 128, 1, 32768, device=device)),
        ("dense b64 h128 s_k 4096", "dense", lambda: dense_decode_inputs(64, 1, 128, 1, 4096, device=device)),
        ("dense b8 h16 s_k 4096", "dense", lambda: dense_decode_inputs(8, 1, 16, 1, 4096, device=device)),
        ("sparse V3.2 b64 h64 topk 2048", "sparse",
         lambda: sparse_decode_inputs(64, 1, 64, 8192, 2048, fmt=F.V32_FP8, device=device)),
        # the canonical suite's one call whose dispatcher choice is FlashMLA's op with over 40 µs of host (run 87):
        # FlashMLA alone at that shape says how much of it is FlashMLA's own
        ("sparse V3.2 b128 s_q 2 h128 topk 2048", "sparse",
         lambda: sparse_decode_inputs(128, 2, 128, 32768, 2048, fmt=F.V32_FP8, device=device)),
        ("sparse V3.2 b4 h64 topk 512", "sparse",
         lambda: sparse_decode_inputs(4, 1, 64, 4096, 512, fmt=F.V32_FP8, device=device)),
        ("prefill s_q 256 h128 topk 512", "prefill",
         lambda: prefill_inputs(256, 128, 576, 8192, 512, device=device)),
        ("prefill s_q 4096 h128 topk 2048", "prefill",  # the canonical suite's: large outputs
         lambda: prefill_inputs(4096, 128, 576, 32768, 2048, device=device)),
    ]


def _flash_mla_call(op: str, a: dict):
    """FlashMLA v1.0.0 called directly (no anymla in between), as a serving engine calls it."""
    import flash_mla
    if op == "prefill":
        return lambda: flash_mla.flash_mla_sparse_fwd(a["q"], a["kv"], a["indices"], a["sm_scale"])
    meta = flash_mla.get_mla_metadata()[0]
    if op == "dense":
        return lambda: flash_mla.flash_mla_with_kvcache(a["q"], a["k_cache"], a["block_table"], a["cache_seqlens"],
                                                        512, meta, None, causal=False)
    return lambda: flash_mla.flash_mla_with_kvcache(a["q"], a["k_cache"], None, None, 512, meta, None,
                                                    is_fp8_kvcache=True, indices=a["indices"])


def _anymla_call(op: str, a: dict, backend=None):
    if op == "prefill":
        return lambda: anymla.flash_mla_sparse_fwd(**a, backend=backend)
    meta = anymla.get_mla_metadata()[0]
    return lambda: anymla.flash_mla_with_kvcache(**a, tile_scheduler_metadata=meta, backend=backend)


def _eager(fn, device) -> tuple[float, float, float]:
    """(host µs to enqueue one call, median of 50 with the device drained before each; wall µs per call of
    200 back-to-back calls; host µs per call of enqueuing those 200, the device kept busy as in a model's
    forward pass, the best of 3 such streams)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize(device)
    host = []
    for _ in range(50):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
    stream, wall = [], []
    for _ in range(3):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(200):
            fn()
        stream.append((time.perf_counter() - t0) * 1e6 / 200)
        torch.cuda.synchronize(device)
        wall.append((time.perf_counter() - t0) * 1e6 / 200)
    return sorted(host)[len(host) // 2], min(wall), min(stream)


def _profile(name: str, fn) -> None:
    """Where the host time of 200 calls goes (cProfile, the top functions by own time)."""
    import cProfile
    import pstats
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        fn()
    profile.disable()
    print(f"profile of 200 calls: {name}")
    pstats.Stats(profile).sort_stats("tottime").print_stats(14)


def _without_launches(fn, device) -> tuple[float, float]:
    """Host µs of ``fn`` with every Triton launch skipped (the calls are planned and compiled already): what
    the Python path and torch's allocations and views cost without the launches themselves (after a drain,
    in a stream: as :func:`_eager`)."""
    from anymla.triton_kernels.launcher import Launcher
    launch = Launcher._launch_compiled
    Launcher._launch_compiled = lambda self, grid, args, **options: True
    try:
        drained, _, stream = _eager(fn, device)
        return drained, stream
    finally:
        Launcher._launch_compiled = launch


def _launches_alone(fn, device) -> tuple[float, float]:
    """Host µs of the launches of one call of ``fn`` replayed with the call's own arguments (the launcher's
    Python, Triton's C launcher and the driver), without the rest of the call (after a drain, in a stream)."""
    from anymla.triton_kernels.launcher import Launcher
    launch, seen = Launcher._launch_compiled, []

    def record(self, grid, args, owned=False):
        seen.append((self, grid, list(args)))
        return launch(self, grid, args, owned)
    Launcher._launch_compiled = record
    try:
        out = fn()
    finally:
        Launcher._launch_compiled = launch

    def replay():
        for launcher_, grid, args in seen:
            launcher_._launch_compiled(grid, args)
    drained, _, stream = _eager(replay, device)
    del out
    return drained, stream


def _c_launches_alone(fn, device) -> float:
    """Host µs in a stream of the compiled kernels' own launchers (Triton's C launcher and the driver) for the
    launches of one call of ``fn``, each handed the final argument list the call built (addresses, encoded
    descriptors): the launch without anymla's Python."""
    from anymla.triton_kernels import launcher
    encoded, seen = launcher._Direct.encoded, []

    def record(self, args):
        flat = encoded(self, args)
        seen.append((self, list(flat)))
        return flat
    grids = []
    launch = launcher.Launcher._launch_compiled

    def record_grid(self, grid, args, owned=False):
        grids.append(grid)
        return launch(self, grid, args, owned)
    launcher._Direct.encoded, launcher.Launcher._launch_compiled = record, record_grid
    try:
        out = fn()
    finally:
        launcher._Direct.encoded, launcher.Launcher._launch_compiled = encoded, launch
    knobs = launcher._knobs()
    device_of, stream_of = launcher._driver()
    stream = stream_of(device_of())
    calls = [(d.run, g, d.kernel, flat) for (d, flat), g in zip(seen, grids)]

    def replay():
        for run, g, kernel, flat in calls:
            run(g[0], g[1], g[2], stream, kernel.function, kernel.packed_metadata, None, knobs.launch_enter_hook,
                knobs.launch_exit_hook, *flat)
    us = _eager(replay, device)[2]
    del out
    return us


@functools.lru_cache(maxsize=None)
def _tiny_kernels():
    """Two Triton kernels that store one value: of 1 argument, and of 33 (triton imported here: it is optional)."""
    import triton
    import triton.language as tl

    @triton.jit
    def one_pointer(x_ptr):
        tl.store(x_ptr, 1.0)

    @triton.jit
    def many_arguments(x_ptr, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18,
                       a19, a20, a21, a22, a23, a24, a25, a26, a27, a28, a29, a30, a31):
        tl.store(x_ptr, (a0 + a31).to(tl.float32))
    return one_pointer, many_arguments


def _launch_sizes(device) -> list[dict]:
    """Host µs in a stream of one launch through anymla's Launcher of a kernel with 1 and with 33 arguments
    (odd integers, so none is specialized away), and of those kernels' C launchers alone."""
    from anymla.triton_kernels.launcher import Launcher
    x = torch.zeros(1, device=device)
    one_pointer, many_arguments = _tiny_kernels()
    rows = []
    for name, kernel, args in (("1 argument", one_pointer, [x]),
                               ("33 arguments", many_arguments, [x] + [2 * i + 3 for i in range(32)])):
        launcher_ = Launcher(kernel, num_warps=1)
        call = lambda: launcher_((1, 1, 1), list(args))  # noqa: E731
        call()
        via = _eager(call, device)[2]
        alone = _c_launches_alone(call, device)
        rows.append(dict(part="primitive", case=f"a launch of a kernel of {name}", who="anymla",
                         host_stream_us=via, c_launcher_stream_us=alone))
        print(f"primitive  launch, a kernel of {name:13s}  Launcher {via:5.2f} µs, its C launcher alone {alone:5.2f} µs",
              flush=True)
    return rows


def _step_targets():
    """(owner, attribute, label) of the steps on the path of a call, outermost first."""
    from anymla import api, buffers, metadata, selection
    from anymla.triton_kernels import fit, launcher, splits
    from anymla.triton_kernels.dense_decode import launch as dense
    from anymla.triton_kernels.hopper import launch as hopper
    from anymla.triton_kernels.sparse_mla import launch as sparse
    return [(api, "decode_problem", "decode_problem"), (api, "select", "select"),
            (metadata.FlashMLASchedMeta, "bind", "sched.bind"), (selection.Decision, "run", "Decision.run"),
            (sparse.SparseDecodePlan, "__call__", "SparseDecodePlan"), (dense.DenseDecodePlan, "__call__", "DenseDecodePlan"),
            (sparse.SparsePrefillPlan, "__call__", "SparsePrefillPlan"), (sparse.Source, "paged", "Source.paged"),
            (buffers, "empty", "buffers.empty"), (metadata.FlashMLASchedMeta, "plan_for", "sched.plan_for"),
            (hopper.SparseDecodeLaunch, "__call__", "hopper sparse decode launch"),
            (hopper.DenseDecodeLaunch, "__call__", "hopper dense decode launch"),
            (hopper.SparsePrefillLaunch, "__call__", "hopper prefill launch"),
            (sparse._Portable, "__call__", "portable sparse launch"), (dense._Portable, "__call__", "portable dense launch"),
            (fit.FittedKernel, "__call__", "FittedKernel"), (splits.Combine, "__call__", "Combine"),
            (launcher.LatestDescriptors, "__call__", "LatestDescriptors"), (launcher.Launcher, "bind", "Launcher.bind"),
            (launcher.Launcher, "_launch_compiled", "the launch (Launcher._launch_compiled)")]


def _steps(fn, n: int = 200) -> dict:
    """Inclusive host µs per call of each step of ``fn``'s path (steps it does not take are left out). Every
    step is wrapped in a timer (~0.2 µs each), so the sum of the parts exceeds the whole a little."""
    totals, saved = {}, []

    def timed(f, label):
        def wrapper(*a, **k):
            t0 = time.perf_counter_ns()
            try:
                return f(*a, **k)
            finally:
                totals[label] = totals.get(label, 0) + time.perf_counter_ns() - t0
        return wrapper

    for owner, attr, label in _step_targets():
        raw = owner.__dict__[attr]
        saved.append((owner, attr, raw))
        if isinstance(raw, (classmethod, staticmethod)):
            setattr(owner, attr, staticmethod(timed(getattr(owner, attr), label)))
        else:
            setattr(owner, attr, timed(raw, label))
    try:
        for _ in range(20):
            fn()
        t0 = time.perf_counter_ns()
        totals.clear()
        for _ in range(n):
            fn()
        totals["whole call"] = time.perf_counter_ns() - t0
    finally:
        for owner, attr, raw in saved:
            setattr(owner, attr, raw)
    return {label: ns / n / 1e3 for label, ns in totals.items()}


def primitives(device) -> list[dict]:
    """µs per call of the torch operations a call makes on the host (median of 2000)."""
    t = torch.empty(64, 1, 64, 512, dtype=torch.bfloat16, device=device)
    ops = {"torch.empty [64, 1, 64, 512] bf16": lambda: torch.empty(64, 1, 64, 512, dtype=torch.bfloat16,
                                                                     device=device),
           "tensor.view": lambda: t.view(64, 64, 512), "tensor.reshape": lambda: t.reshape(64, 64, 512),
           "tensor.data_ptr": t.data_ptr, "tensor.stride": t.stride,
           "torch.cuda.current_device": torch.cuda.current_device,
           "triton driver current stream": _triton_stream(), "torch.zeros_like (one kernel)": lambda: torch.zeros_like(t)}
    rows = []
    for name, op in ops.items():
        samples = []
        for _ in range(2000):
            t0 = time.perf_counter_ns()
            op()
            samples.append(time.perf_counter_ns() - t0)
        us = sorted(samples)[len(samples) // 2] / 1e3
        rows.append(dict(part="primitive", case=name, who="torch", host_us=us))
        print(f"primitive  {name:36s} {us:6.2f} µs", flush=True)
    # One kernel as torch launches it, timed as the calls are (after a drain, in a stream): the yardstick of
    # what the host's state alone adds to a launch after the device was drained.
    drained, _, stream = _eager(lambda: torch.zeros_like(t), device)
    rows.append(dict(part="primitive", case="torch.zeros_like as the calls are timed", who="torch",
                     host_us=drained, host_stream_us=stream))
    print(f"primitive  {'torch.zeros_like, drained / stream':36s} {drained:6.2f} / {stream:.2f} µs", flush=True)
    return rows


def _triton_stream():
    import triton
    driver = triton.runtime.driver.active
    return lambda: driver.get_current_stream(driver.get_current_device())


def host(device, profile: bool = False, steps: bool = False) -> list[dict]:
    have_flash_mla = importlib.util.find_spec("flash_mla") is not None
    rows = []
    for name, op, build in _host_cases(device):
        a = build()
        if op != "prefill":
            a.pop("tile_scheduler_metadata", None)
        calls = {"anymla": _anymla_call(op, a)}
        if have_flash_mla:  # the dispatcher may pick FlashMLA then: the Triton tier's own path too
            calls["anymla-triton"] = _anymla_call(op, a, "triton")
            calls["flashmla"] = _flash_mla_call(op, a)
        # the Python path (the compiled call path off): where its host time goes, with and without launches
        calls["anymla-python"] = _anymla_call(op, a, "triton" if have_flash_mla else None)
        for who, fn in calls.items():
            python = who == "anymla-python"
            with callpath.python_path() if python else contextlib.nullcontext():
                host_us, eager_us, stream_us = _eager(fn, device)
                row = dict(part="host", case=name, who=who, host_us=host_us, eager_us=eager_us,
                           host_stream_us=stream_us)
                text = ""
                if python:
                    row["host_without_launches_us"], row["host_stream_without_launches_us"] = \
                        _without_launches(fn, device)
                    row["launches_alone_us"], row["launches_alone_stream_us"] = _launches_alone(fn, device)
                    row["c_launchers_alone_stream_us"] = _c_launches_alone(fn, device)
                    text = (f"   without the launches {row['host_without_launches_us']:.1f} / "
                            f"{row['host_stream_without_launches_us']:.1f}   the launches alone "
                            f"{row['launches_alone_us']:.1f} / {row['launches_alone_stream_us']:.1f}   their C "
                            f"launchers alone {row['c_launchers_alone_stream_us']:.1f}")
            rows.append(row)
            print(f"host  {name:32s} {who:13s} host {host_us:7.1f} µs/call (in a stream {stream_us:6.1f})   "
                  f"eager {eager_us:8.1f} µs/call" + text, flush=True)
            if profile and who.startswith("anymla"):
                with callpath.python_path() if python else contextlib.nullcontext():
                    _profile(name, fn)
            if steps and python:
                with callpath.python_path():
                    timed = _steps(fn)
                for label, us in timed.items():
                    rows.append(dict(part="step", case=name, who=label, host_us=us))
                    print(f"step  {name:32s} {label:34s} {us:7.1f} µs/call", flush=True)
        del a, calls
        torch.cuda.empty_cache()
    return rows


_PER_REQUEST = ("q", "indices")


def _server(h_q: int, sizes, device, s_k: int = 4096) -> dict:
    """One cache and the per-request tensors of the largest batch: a batch of b is their first b rows."""
    big = sparse_decode_inputs(max(sizes), 1, h_q, s_k, 512, fmt=KVCacheFormat.V32_FP8, device=device)
    big["tile_scheduler_metadata"] = None
    return big


_REPEATS = 5  # a repeated call's time: the median of this many, after the first


# Written before every timed call, so that a repeated call does not find its cache rows in L2: a first call
# cannot, and neither can a decoding step, whose rows are new every layer.
_L2_FLUSH_BYTES = 256 << 20


class FirstCall(NamedTuple):
    """One size's calls in a server (µs): wall times with a synchronization each side, and the first call's
    host part (until it returned, before the synchronization) beside a repeated call's."""
    first: float
    repeat: float  # median of _REPEATS
    fresh_rows: float
    first_enqueue: float
    repeat_enqueue: float  # of the median repeat
    collections: int  # Python garbage collections that started during the first call


def _first_calls(big: dict, elsewhere: torch.Tensor, flush: torch.Tensor, sizes,
                 device) -> tuple[list[FirstCall], int, int]:
    """Per size, its ``FirstCall``, L2 flushed before each call; kernels compiled and memory segments the
    caching allocator asked the driver for (each a cudaMalloc) during those calls. A repeated call reads the
    rows the first one read; a fresh-rows call has the same signature but other requests' indices (half the
    server's batch away), so it reads rows as new to the device as the first call's were, as every decoding
    step's are: the first call's cost beyond a fresh-rows call is what a new size adds, beyond it what
    touching new rows adds. ``elsewhere`` holds those indices and ``flush`` the L2 flush's buffer: made before
    any warmup, as a server's buffers are, so that no allocation of the harness's own lands between a warmup
    and its calls."""
    from anymla.triton_kernels.launcher import compiled_kernels
    kernels0, times = compiled_kernels(), []
    # The GPU kept busy for a while first (after a warmup's seconds of host work its clocks are down, and the
    # first sizes would be timed while they come up again), and the server's tensors read once (a serving
    # process touches its cache every step; a warmup's replays read one row of it).
    for t in big.values():
        if isinstance(t, torch.Tensor):
            t.view(torch.uint8).sum() if t.is_contiguous() else t.sum()
    for _ in range(200):
        flush.zero_()
    # ... then a few short waits: after a long one (those flushes take ~20 ms) the host is slow to start its next
    # call, whatever it calls (the bench's host_first_us), which is not what a new size costs
    torch.cuda.synchronize(device)
    for _ in range(20):
        flush[:4096].zero_()
        torch.cuda.synchronize(device)

    collections = [0]

    def count_collections(phase, info):
        collections[0] += phase == "start"

    def timed(a) -> tuple[float, float]:
        """(wall µs, host µs until the call returned)"""
        flush.zero_()
        torch.cuda.synchronize(device)
        gc.callbacks.append(count_collections)
        t0 = time.perf_counter()
        anymla.flash_mla_with_kvcache(**a)
        t1 = time.perf_counter()
        torch.cuda.synchronize(device)
        t2 = time.perf_counter()
        gc.callbacks.remove(count_collections)
        return (t2 - t0) * 1e6, (t1 - t0) * 1e6

    segments0 = torch.cuda.memory_stats(device).get("segment.all.allocated", 0)
    for b in sizes:
        a = {k: (v[:b] if k in _PER_REQUEST else v) for k, v in big.items()}
        seen = collections[0]
        first = timed(a)
        collected = collections[0] - seen
        repeat = sorted(timed(a) for _ in range(_REPEATS))[_REPEATS // 2]
        fresh = timed({**a, "indices": elsewhere[:b]})
        times.append(FirstCall(first[0], repeat[0], fresh[0], first[1], repeat[1], collected))
    segments = torch.cuda.memory_stats(device).get("segment.all.allocated", 0) - segments0
    return times, compiled_kernels() - kernels0, segments


def _elsewhere(big: dict) -> torch.Tensor:
    """Other requests' indices for each request (half the batch away): the fresh-rows calls'."""
    return big["indices"].roll(big["indices"].shape[0] // 2, dims=0)


def _warmed(h_q: int, s_k: int, sizes, device, flush) -> tuple[list[FirstCall], int, int, str]:
    """``_first_calls``'s results for a server warmed up first (``anymla.warmup``), and the warmup's report."""
    big = _server(h_q, sizes, device, s_k)
    elsewhere = _elsewhere(big)
    example = {k: (v[:1] if k in _PER_REQUEST else v) for k, v in big.items()}
    report = anymla.warmup(anymla.flash_mla_with_kvcache, sizes=sizes, **example)
    return (*_first_calls(big, elsewhere, flush, sizes, device), str(report))


# Servers warmed up alike, (cache length, the order their sizes are timed in): their caches differ in length,
# so their calls are different signatures. A first call costs once per signature, so a cost that comes with a
# new size shows in every server at that size, while a host hiccup hits one of them. Each server starts at
# another size, every other one descending: the first call timed after a warmup pays a once-per-server host
# cost (runs 85-97), which no size then meets in more than one server. Five servers, not three: single calls
# of ~50 µs each take 1.2-3x longer in ~9 % of the samples (run 97, every size of three servers), so with
# three servers some size of 256 has all three hit in about one run of six (run 97: 1.22x at b = 83, whose
# three servers took 1.22x, 3.1x and 1.40x); with five, in about one of a thousand.
_SERVERS = 5


def _orders(sizes) -> tuple:
    sizes = list(sizes)
    orders = []
    for k in range(_SERVERS):
        at = k * len(sizes) // _SERVERS
        order = sizes[at:] + sizes[:at]
        orders.append((4096 + 64 * k, order[::-1] if k % 2 else order))
    return tuple(orders)


def cold(device) -> list[dict]:
    sizes = range(1, 257)
    rows = []
    flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
    big = _server(64, sizes, device)
    times, kernels, segments = _first_calls(big, _elsewhere(big), flush, sizes, device)
    del big
    worst = max(range(len(times)), key=lambda i: times[i].first)
    rows.append(dict(part="cold", case="sparse V3.2 h64, b 1..256, no warmup", who="anymla", kernels=kernels,
                     segments_allocated=segments,
                     worst_first_us=times[worst].first, worst_b=sizes[worst],
                     median_first_over_repeat=sorted(t.first / t.repeat for t in times)[len(times) // 2]))
    servers, firsts, kernels, segments = [], [], 0, 0
    for s_k, order in _orders(sizes):
        t, k, seg, report = _warmed(32, s_k, order, device, flush)
        by_size = dict(zip(order, t))
        servers.append([by_size[b] for b in sizes])
        firsts.append(t[0])
        kernels, segments = kernels + k, segments + seg
    ratios = [[t.first / t.repeat for t in server] for server in servers]
    over_fresh = [[t.first / t.fresh_rows for t in server] for server in servers]
    best, best_fresh = [min(r) for r in zip(*ratios)], [min(r) for r in zip(*over_fresh)]
    worst_at = [max(range(len(r)), key=r.__getitem__) for r in ratios]

    def argmax(values):
        return sizes[max(range(len(values)), key=values.__getitem__)]

    rows.append(dict(part="cold", case=f"sparse V3.2 h32, b 1..256, after warmup, {len(servers)} servers",
                     who="anymla", kernels=kernels, segments_allocated=segments, warmup=report,
                     worst_first_over_repeat_each_server=" / ".join(f"{max(r):.2f}" for r in ratios),
                     worst_b_each_server=" / ".join(str(sizes[i]) for i in worst_at),
                     worst_of_the_best_of_servers=max(best), worst_b=argmax(best),
                     median_first_over_repeat=sorted(ratios[0])[len(ratios[0]) // 2],
                     worst_over_fresh_of_the_best_of_servers=max(best_fresh), worst_over_fresh_b=argmax(best_fresh),
                     first_repeat_fresh_us_at_b1=" / ".join(f"{x:.0f}" for x in servers[0][0][:3]),
                     # where each server's worst first call spent its time: host (until it returned) or device
                     enqueue_first_repeat_us_at_worst=" / ".join(
                         f"{s[i].first_enqueue:.0f}:{s[i].repeat_enqueue:.0f}" for s, i in zip(servers, worst_at)),
                     # each server's first timed call: its host part beside a repeat's (the once-per-server cost)
                     first_timed_call_enqueue_first_repeat_us=" / ".join(
                         f"{t.first_enqueue:.0f}:{t.repeat_enqueue:.0f}" for t in firsts),
                     gc_in_first_calls=sum(t.collections for server in servers for t in server)))
    # every size of every warmed server, for the CSV (where a ratio comes from: which server, which call)
    rows += [dict(part="cold-size", case=f"after warmup, server {n} (s_k {s_k}, from b = {order[0]})",
                  who="anymla", b=b, **t._asdict())
             for n, ((s_k, order), server) in enumerate(zip(_orders(sizes), servers))
             for b, t in zip(sizes, server)]
    for r in rows[:2]:
        print("cold  " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                                   if k != "part"), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--csv", help="write every row to this CSV file")
    ap.add_argument("--profile", action="store_true", help="print where anymla's host time goes (cProfile)")
    ap.add_argument("--steps", action="store_true", help="time each step of anymla's call path (inclusive µs)")
    parts = ap.add_mutually_exclusive_group()
    parts.add_argument("--no-cold", action="store_true", help="leave out the cold-start measurement")
    parts.add_argument("--cold-only", action="store_true", help="the cold-start measurement only")
    args = ap.parse_args()
    rows = _dispatch_rows("Python path, meta", dispatch())
    if torch.cuda.is_available():
        device = torch.device("cuda")
        print(callpath.prepare(device), flush=True)
        if callpath.recordable_on(device) and not callpath.native.reason():
            rows += _dispatch_rows("compiled call path, cuda", dispatch("cuda"))
        if not args.no_cold:
            rows += cold(device)  # first: a new process whose kernels are not compiled yet
        if not args.cold_only:
            rows += primitives(device) + _launch_sizes(device) + host(device, args.profile, args.steps)
    if args.csv:
        fields = sorted({k for row in rows for k in row}, key=lambda k: (k not in ("part", "case", "who"), k))
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
