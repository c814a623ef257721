"""``anymla.warmup``: make every decision and compile every kernel a serving configuration can reach, before
the first request.

A server meets a new batch size every few steps. Each new call signature costs one validation and one
launch plan, and the first plan of a kernel regime costs a compile (hundreds of ms to seconds); both land
on a request's latency. :func:`warmup` takes the arguments of one real call and replays it at every batch size
of a range (for prefill: every token count), with inputs of the same layouts, so that afterwards no call of
that configuration validates a new signature, plans or compiles on first use, each has an entry on the
compiled call path (:mod:`anymla.callpath`, built first if it is not), and the caching allocator already
holds blocks of every output size. Cache lengths (``cache_seqlens``, ``topk_length`` values) are not
part of a signature: any value reuses the same plan.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Union

import torch

from . import selection
from . import callpath
from .api import _OPS, _problem


def _compiled_kernels() -> int:
    """Distinct compiled Triton kernels anymla has launched in this process (0 without triton)."""
    try:
        from anymla.triton_kernels.launcher import compiled_kernels
    except ImportError:
        return 0
    return compiled_kernels()

# Arguments whose first dimension is the batch (decoding) or the token count (prefill), per op.
_BATCHED = {
    "flash_mla_with_kvcache": ("q", "block_table", "cache_seqlens", "indices", "topk_length",
                               "extra_indices_in_kvcache", "extra_topk_length"),
    "flash_mla_sparse_fwd": ("q", "indices", "topk_length"),
}
# Values for the replayed calls: one attendable row a query, slot 0 (block 0, row 0) of its cache, so that each
# kernel's main loop runs once before the first real call while the replays read next to nothing; a cache of
# no rows gets nothing attendable (-1 everywhere).
_FILL = {"indices": -1, "extra_indices_in_kvcache": -1, "cache_seqlens": 1, "topk_length": 1,
         "extra_topk_length": 1, "block_table": 0}
_CACHE_OF = {"indices": ("k_cache", "kv"), "extra_indices_in_kvcache": ("extra_k_cache",)}


@dataclass(frozen=True)
class WarmupReport:
    op: str
    sizes: int  # batch sizes (token counts for prefill) replayed
    decisions: int  # new call signatures validated and planned
    kernels: int  # kernels compiled (or loaded from Triton's cache) for the first time in this process; 0 under
    # Triton's interpreter, which compiles nothing
    seconds: float

    def __str__(self) -> str:
        return (f"anymla.warmup {self.op}: {self.sizes} sizes, {self.decisions} new decisions, {self.kernels} "
                f"kernels compiled or loaded, {self.seconds:.2f} s")


def _resized(name: str, t: torch.Tensor, n: int, example: dict) -> torch.Tensor:
    """``t`` with ``n`` rows in the same layout (strides) as the example, filled with harmless values."""
    out = torch.empty_strided((n, *t.shape[1:]), t.stride(), dtype=t.dtype, device=t.device)
    out.fill_(_FILL.get(name, 0))
    caches = [example.get(c) for c in _CACHE_OF.get(name, ())]
    if any(isinstance(c, torch.Tensor) and c.shape[0] > 0 for c in caches) and out.shape[-1]:
        out[..., 0] = 0
    return out


def warmup(op: Union[str, Callable], sizes: Iterable[int] = range(1, 257), **example) -> WarmupReport:
    """Replay the call ``op(**example)`` at every batch size in ``sizes`` (prefill: every token count).

    ``example`` holds the keyword arguments of one real call of the configuration (the cache, head count,
    formats, page size and the layouts of the per-request tensors are taken from it; its values are not
    used). Runs each replay twice for real on the device (each query attending one row, slot 0 of the cache:
    fast, and every kernel's main loop has run once) and synchronizes once at the end. Returns how many new
    decisions and kernels that took.
    """
    fn = _OPS.get(op) if isinstance(op, str) else op
    if fn not in _OPS.values():
        raise ValueError(f"op: expected one of {', '.join(_OPS)} (or the function), got {op!r}")
    name = next(k for k, v in _OPS.items() if v is fn)
    sizes = sorted(set(int(s) for s in sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"sizes: expected positive batch sizes, got {sizes[:4]}...")
    _problem(fn, (), example).validate()  # a bad example fails here, naming the argument
    cache = example.get("k_cache", example.get("kv"))
    if isinstance(cache, torch.Tensor):
        callpath.prepare(cache.device)  # so that each replay leaves the compiled call path an entry
    decisions0, kernels0, t0 = selection.decisions_made(), _compiled_kernels(), time.perf_counter()
    device = None
    for n in sizes:
        args = dict(example)
        for key in _BATCHED[name]:
            if isinstance(args.get(key), torch.Tensor):
                args[key] = _resized(key, args[key], n, example)
        if "tile_scheduler_metadata" in args:
            args["tile_scheduler_metadata"] = None
        # Twice: the first call plans and records the size's entry on the compiled call path, the second runs
        # that entry, the form every later call of this size takes. The entry code's first run in a process costs
        # more (on a CPU with stand-in launches the first call after a warmup took ~50 µs, ~120 when each size
        # was replayed once: the C++ path had then never run to its end).
        for _ in range(2):
            out = fn(**args)
        device = out[0].device
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return WarmupReport(name, len(sizes), selection.decisions_made() - decisions0, _compiled_kernels() - kernels0,
                        time.perf_counter() - t0)
