"""Launchers of the cache writer, the MLA prolog, the q assembly, the DSA slot kernels and V4's prolog and heads
kernels (called by :mod:`anymla.layers`, which validates the arguments first).

Every launch goes through anymla's direct :class:`~anymla.triton_kernels.launcher.Launcher`: after a kernel's
first call with a given set of non-tensor arguments, later calls skip Triton's per-call binding and
specialization (tens of microseconds of host time each, more than these kernels take on the GPU in a decode
step). A caller that makes the same call signature again and again (a layer's plan) passes its own bound
launchers (:func:`step_launchers`): a call then hands only its tensors and floats to the compiled kernel, without
building the argument list and the key a launcher is found by.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from anymla.kvcache import KVCacheFormat

from .. import runtime
from ..launcher import Launcher
from .kernel import (ROPE_INTERLEAVED, ROPE_NEOX, cache_write_kernel, mla_prolog_kernel, q_assemble_kernel,
                     sparse_slots_kernel)
from .v4_kernel import v4_heads_kernel, v4_prolog_kernel

_FMT_CODE = {KVCacheFormat.BF16: 0, KVCacheFormat.V32_FP8: 1, KVCacheFormat.MODEL1_FP8: 2,
             KVCacheFormat.V41_FP8: 3, KVCacheFormat.V41_FP4: 4}
_ROPE_CODE = {"interleaved": ROPE_INTERLEAVED.value, "neox": ROPE_NEOX.value}


# (tokens per program, warps) on GPUs. The prolog: 4 tokens and 4 warps keep it near 100 registers on sm_90
# (8 tokens take 124-216, 16 up to 254: fewer resident blocks for a memory-bound kernel). The writer: two tokens
# a warp, the fewest instructions per token in the offline sm_90 build and the fastest tile of the H200 sweep
# for every quantized format (run 32), see NOTES.md; on sm_90 four tokens a warp, measured faster there for
# every format but MODEL1 (even) in two sweeps (H200, runs 64-65: FP4 0.594-0.601x copy vs 0.556-0.570x, V3.2
# 0.696 vs 0.673, V4.1 FP8 0.765 vs 0.735, BF16 0.808 vs 0.798), at 64-105 registers there without spills;
# other GPUs keep the two-warp tile: neither was measured on them (the one-warp tile compiles for sm_80 at
# 58-105 registers, no spills).
GPU_TILE = (4, 4)
GPU_WRITER_TILE = (4, 2)
WRITER_TILES = {"cuda_sm90": (4, 1)}

# Launchers by kernel, warps and every argument that is not a tensor (with the tensors' dtypes and device):
# Triton specializes on integer values (1, multiples of 16), a Launcher only on pointer alignment. Bounded:
# prefills of ever new lengths would add one each.
_LAUNCHERS: dict = {}
_LAUNCHER_LIMIT = 4096
_Tensor = torch.Tensor  # a module global: one attribute lookup less per argument of every launch
_NO_EPS = 0.0  # the q epsilon of a prolog without a q latent (one object: a bound launch's float slot)


def _launch(kernel, grid: tuple, args: list, num_warps: int, device: torch.device) -> None:
    key = (kernel, num_warps, device, *[a.dtype if isinstance(a, _Tensor) else a for a in args])
    launcher = _LAUNCHERS.get(key)
    if launcher is None:
        if len(_LAUNCHERS) >= _LAUNCHER_LIMIT:
            _LAUNCHERS.clear()
        launcher = _LAUNCHERS[key] = Launcher(kernel, num_warps=num_warps)
    launcher(grid + (1,) * (3 - len(grid)), args)


def _run(kernel, grid: tuple, values: tuple, full, num_warps: int, device: torch.device,
         bound: Optional[Launcher]) -> None:
    """Launch ``kernel`` with the argument list ``full()``: through ``bound`` (a caller's launcher for one call
    signature) handing it only ``values``, the list's tensors, None and floats in order; else by the key."""
    if bound is None:
        _launch(kernel, grid, full(), num_warps, device)
    else:
        bound.bind(grid + (1,) * (3 - len(grid)), values, full)


class StepLaunchers(NamedTuple):
    """Launchers of the kernels of one layer call signature (its plan keeps them), for the ``bound`` argument
    of :func:`mla_prolog` and :func:`assemble_q`."""

    prolog: Launcher
    assemble: Launcher


def step_launchers(device: torch.device) -> StepLaunchers:
    """Fresh launchers for one call signature of a layer on ``device`` (bound by its first call)."""
    return StepLaunchers(Launcher(mla_prolog_kernel, num_warps=_tile(device)[1]),
                         Launcher(q_assemble_kernel, num_warps=4))


class V4StepLaunchers(NamedTuple):
    """Launchers of a V4 layer call signature's kernels: the prolog, the query heads' norm and RoPE (with the
    window slots) and the output heads' RoPE back (:func:`v4_prolog`, :func:`v4_heads`)."""

    prolog: Launcher
    query: Launcher
    output: Launcher


def v4_step_launchers(device: torch.device) -> V4StepLaunchers:
    """Fresh launchers for one call signature of a V4 layer on ``device`` (bound by its first call)."""
    return V4StepLaunchers(Launcher(v4_prolog_kernel, num_warps=_tile(device)[1]),
                           Launcher(v4_heads_kernel, num_warps=4), Launcher(v4_heads_kernel, num_warps=4))


def _cdiv(a: int, b: int) -> int:
    # triton.cdiv and triton.next_power_of_2 are constexpr functions: microseconds of host time per call
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def writer_tile(kind: str) -> tuple[int, int]:
    """The writer's (tokens per program, warps) on a GPU of ``runtime.device_kind`` ``kind``."""
    return WRITER_TILES.get(kind, GPU_WRITER_TILE)


def _tile(device: torch.device, writer: bool = False) -> tuple[int, int]:
    # The interpreter pays per program: fewer, larger programs there.
    if runtime.interpreting():
        return (16, 4)
    return writer_tile(runtime.device_kind(device)) if writer else GPU_TILE


def _native_fp8(device: torch.device) -> bool:
    return not runtime.interpreting() and runtime.native_fp8(device)


def _cache_geometry(cache: torch.Tensor, fmt: KVCacheFormat):
    """(pointer tensor, capacity in slots, page size, block stride, token stride); strides in the pointer's
    elements (bytes for quantized caches, where any byte dtype is viewed as uint8)."""
    nb, page = cache.shape[:2]
    ptr = cache if fmt is KVCacheFormat.BF16 else cache.view(torch.uint8)
    return ptr, nb * page, page, cache.stride(0), cache.stride(1)


def write_rows(cache: torch.Tensor, fmt: KVCacheFormat, latent: torch.Tensor, slots: torch.Tensor,
               tile: tuple[int, int] | None = None) -> None:
    """``latent [T, d_qk]`` (last dim contiguous) quantized into ``cache`` at ``slots [T]``; ``tile``
    (tokens per program, warps) overrides the default (the benchmark's sweep)."""
    n = latent.shape[0]
    if n == 0:
        return
    ptr, capacity, page, sb, st = _cache_geometry(cache, fmt)
    bt, warps = tile or _tile(cache.device, writer=True)
    _launch(cache_write_kernel, (_cdiv(n, bt),),
            [latent, latent.stride(0), slots, ptr, n, capacity, page, sb, st,
             _FMT_CODE[fmt], latent.shape[1], _native_fp8(cache.device), bt], warps, cache.device)


def mla_prolog(kv_a: torch.Tensor, kv_weight: torch.Tensor, kv_eps: float, q_lat, q_weight, q_eps: float, q_out,
               positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots, block_table,
               cache: torch.Tensor, fmt: KVCacheFormat, rope_style: str, bound: Optional[Launcher] = None) -> None:
    """Fused RMSNorm (kv latent, and q latent when ``q_lat`` is given) + RoPE of k_pe + cache write, at
    ``slots [T]`` or (``slots`` None) at the slots of ``block_table [b, max_blocks]`` for the positions."""
    n = kv_a.shape[0]
    if n == 0:
        return
    bt, warps = _tile(cache.device)
    q_values = (kv_a, kv_weight, _NO_EPS, kv_a) if q_lat is None else (q_lat, q_weight, q_eps, q_out)
    from_table = slots is None
    values = (kv_a, kv_weight, kv_eps, *q_values, positions, cos, sin,
              *((None, block_table) if from_table else (slots, None)), cache)

    def full():
        ptr, capacity, page, sb, st = _cache_geometry(cache, fmt)
        q_rank = 0 if q_lat is None else q_lat.shape[1]
        q_args = [kv_a, 0, kv_weight, _NO_EPS, kv_a, 0] if q_lat is None else [q_lat, q_lat.stride(0), q_weight,
                                                                                q_eps, q_out, q_out.stride(0)]
        table_args = ([None, block_table, *block_table.stride(), n // block_table.shape[0], block_table.shape[1]]
                      if from_table else [slots, None, 0, 0, 1, 0])
        return [kv_a, kv_a.stride(0), kv_weight, kv_eps, *q_args, positions, cos, sin, cos.stride(0), cos.shape[0],
                *table_args, ptr, n, capacity, page, sb, st, _FMT_CODE[fmt], _ROPE_CODE[rope_style], q_rank,
                _pow2(max(q_rank, 1)), from_table, _native_fp8(cache.device), bt]

    _run(mla_prolog_kernel, (_cdiv(n, bt),), values, full, warps, cache.device, bound)


class QuerySlots(NamedTuple):
    """DSA cache slots an :func:`assemble_q` launch writes beside the query: those of ``indices [b, s, topk]``
    (token positions) through ``block_table [b, max_blocks]`` with ``page_size`` tokens a block, into
    ``out [b, s, topk]`` int32 (as :func:`sparse_slots`; the query's ``T`` tokens are the ``b * s`` queries)."""

    indices: torch.Tensor
    block_table: torch.Tensor
    page_size: int
    out: torch.Tensor


def _slot_block(topk: int) -> int:
    return min(1024, _pow2(topk))


def _slot_args(slots: Optional[QuerySlots]) -> list:
    """The slot arguments of ``q_assemble_kernel`` (placeholders without slots)."""
    if slots is None:
        return [None, 0, 0, 0, None, 0, 0, None, 1, 0, 0, 1]
    idx, bt = slots.indices, slots.block_table
    return [idx, *idx.stride(), bt, *bt.stride(), slots.out, idx.shape[1], idx.shape[2], bt.shape[1],
            slots.page_size]


def assemble_q(q_nope_abs, q_pe: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               out: torch.Tensor, rope_style: str, bound: Optional[Launcher] = None,
               slots: Optional[QuerySlots] = None) -> None:
    """``out [T, h, 512 + 64] = [q_nope_abs [h, T, 512] | RoPE(q_pe [T, h, 64])]``; with ``q_nope_abs`` None
    the first 512 columns of ``out`` hold the absorbed q already and only q_pe is rotated. ``slots``: the
    queries' DSA cache slots, written by the same launch (``positions`` then in request order)."""
    n, h, d = out.shape
    if n == 0:
        return
    block_h = min(16, _pow2(h))
    slot_blocks = 0 if slots is None else _cdiv(slots.indices.shape[2], _slot_block(slots.indices.shape[2]))
    slot_values = (None, None, None) if slots is None else (slots.indices, slots.block_table, slots.out)

    def full():
        copy = q_nope_abs is not None
        qn = [q_nope_abs, q_nope_abs.stride(0), q_nope_abs.stride(1)] if copy else [None, 0, 0]
        block_k = 1 if slots is None else _slot_block(slots.indices.shape[2])
        return [*qn, q_pe, q_pe.stride(0), q_pe.stride(1), positions, cos, sin, cos.stride(0), cos.shape[0],
                out, out.stride(0), out.stride(1), h, *_slot_args(slots), d - 64, _ROPE_CODE[rope_style], copy,
                block_h, slots is not None, block_k]

    _run(q_assemble_kernel, (n, _cdiv(h, block_h) + slot_blocks),
         (q_nope_abs, q_pe, positions, cos, sin, out, *slot_values), full, 4, out.device, bound)


def sparse_slots(indices: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor, page_size: int,
                 out: torch.Tensor) -> None:
    """``out [b, s, topk]`` int32: the cache slots of ``indices [b, s, topk]`` (token positions; -1 where an
    index is negative, after its query's position in ``positions [b, s]`` or past ``block_table``)."""
    b, s, topk = indices.shape
    if b * s * topk == 0:
        return
    block_k = _slot_block(topk)
    _launch(sparse_slots_kernel, (b * s, _cdiv(topk, block_k)),
            [indices, indices.stride(0), indices.stride(1), indices.stride(2), positions, positions.stride(0),
             positions.stride(1), block_table, *block_table.stride(), out, s, topk, block_table.shape[1],
             page_size, block_k], 4, out.device)


def v4_prolog(kv: torch.Tensor, kv_weight: torch.Tensor, eps: float, q_lat: torch.Tensor, q_weight: torch.Tensor,
              q_out: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              block_table: torch.Tensor, cache: torch.Tensor, fmt: KVCacheFormat,
              bound: Optional[Launcher] = None) -> None:
    """V4's prolog: ``kv [T, 512]`` normed, roped and written into ``cache`` at the block table's slots of
    ``positions [T]``; ``q_lat [T, q_rank]`` normed into ``q_out`` (weights fp32, last dims contiguous)."""
    n = kv.shape[0]
    if n == 0:
        return
    bt, warps = _tile(cache.device)

    def full():
        ptr, capacity, page, sb, st = _cache_geometry(cache, fmt)
        q_rank = q_lat.shape[1]
        return [kv, kv.stride(0), kv_weight, eps, q_lat, q_lat.stride(0), q_weight, q_out, q_out.stride(0),
                positions, cos, sin, cos.stride(0), cos.shape[0], block_table, *block_table.stride(),
                n // block_table.shape[0], block_table.shape[1], ptr, n, capacity, page, sb, st, _FMT_CODE[fmt],
                q_rank, _pow2(q_rank), _native_fp8(cache.device), bt]

    _run(v4_prolog_kernel, (_cdiv(n, bt),),
         (kv, kv_weight, eps, q_lat, q_weight, q_out, positions, cos, sin, block_table, cache), full, warps,
         cache.device, bound)


class WindowSlots(NamedTuple):
    """The sliding-window slots a :func:`v4_heads` launch writes beside the heads: for each of the ``b * s_q``
    queries the block table's slots of its position and the ``window - 1`` before it, into ``out [b, s_q,
    window]`` int32 (-1 where negative or past ``block_table [b, max_blocks]``)."""

    block_table: torch.Tensor
    s_q: int
    window: int
    page_size: int
    out: torch.Tensor


def _window_args(slots: Optional[WindowSlots]) -> list:
    if slots is None:
        return [None, 0, 0, None, 1, 0, 0, 1]
    bt = slots.block_table
    return [bt, *bt.stride(), slots.out, slots.s_q, slots.window, bt.shape[1], slots.page_size]


def v4_heads(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: Optional[float],
             bound: Optional[Launcher] = None, slots: Optional[WindowSlots] = None) -> None:
    """V4's heads ``x [T, h, 512]`` (last dim contiguous) in place: RMS-normed without a weight where ``eps`` is
    given, then the trailing 64 channels rotated at ``positions [T]`` by the table ``cos`` / ``sin``;
    ``slots``: the queries' window slots, written by the same launch."""
    n, h, _ = x.shape
    if n == 0:
        return
    # the norm holds whole heads: 8 a program keep it at 72-80 registers (sm_80, sm_90; 16 take 163-166)
    block_h = min(16 if eps is None else 8, _pow2(h))
    block_w = 1 if slots is None else min(1024, _pow2(slots.window))
    slot_blocks = 0 if slots is None else _cdiv(slots.window, block_w)
    norm_eps = _NO_EPS if eps is None else eps

    def full():
        return [x, x.stride(0), x.stride(1), h, norm_eps, positions, cos, sin, cos.stride(0), cos.shape[0],
                *_window_args(slots), eps is not None, slots is not None, block_h, block_w]

    window_values = (None, None) if slots is None else (slots.block_table, slots.out)
    _run(v4_heads_kernel, (n, _cdiv(h, block_h) + slot_blocks), (x, norm_eps, positions, cos, sin, *window_values),
         full, 4, x.device, bound)
