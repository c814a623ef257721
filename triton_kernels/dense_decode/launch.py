"""Launcher of the dense MLA decode kernel (dense ``flash_mla_with_kvcache``)."""

from __future__ import annotations

import math

import torch

from anymla import buffers
import triton

from .. import runtime
from ..fit import launch_fitting
from ..hopper import launch as hopper
from ..splits import SplitPlan, choose_num_splits, combine, make_plan
from ..tuning import TileConfig, dense_config, forced_tma
from .kernel import dense_decode_kernel


def _plan(p, rows_per_kv_head: int) -> SplitPlan:
    b, s_q, h_q, _ = p.q.shape
    h_kv = p.k_cache.shape[2]
    tile = dense_config(runtime.device_kind(p.device), rows_per_kv_head)
    programs = b * h_kv * triton.cdiv(rows_per_kv_head, tile.block_h)
    capacity = p.block_table.shape[1] * p.k_cache.shape[1]
    splits = choose_num_splits(programs, triton.cdiv(capacity, tile.block_n), runtime.num_cores(p.device),
                               tile.programs_per_core, p.batch_invariant)
    return make_plan(tile, splits, b * s_q, h_q, p.device)


def _descriptors(kv: torch.Tensor, tile: TileConfig, d: int):
    """TMA descriptors of the cache ([1, BLOCK_N, 1, 512] latent and [.., 64] rope boxes), or (None, None)
    where the device has no tensor-memory copies or the layout does not allow them."""
    if forced_tma() is False or not runtime.tensor_memory_copies(kv.device) or kv.shape[1] % tile.block_n:
        return None, None
    esize = kv.element_size()
    if kv.data_ptr() % 16 or any(st * esize % 16 for st in kv.stride()[:-1]) or kv.stride(-1) != 1:
        return None, None
    from triton.tools.tensor_descriptor import TensorDescriptor
    shape, strides = list(kv.shape), list(kv.stride())
    k_desc = TensorDescriptor(kv, shape, strides, [1, tile.block_n, 1, 512])
    r_desc = TensorDescriptor(kv, shape, strides, [1, tile.block_n, 1, 64]) if d == 576 else None
    return k_desc, r_desc


def kernel_choice(p) -> str:
    """Which kernel :func:`dense_decode` runs for ``p``, and why (``explain()``)."""
    b, s_q, h_q, _ = p.q.shape
    tile = dense_config(runtime.device_kind(p.device), s_q * (h_q // p.k_cache.shape[2]))
    return hopper.describe(hopper.dense_decode_reasons(p, tile), "dense decode")


def dense_decode(p) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``flash_mla_with_kvcache`` on the Triton tier (``p``: :class:`anymla.problems.DenseDecode`).

    Returns out ``[b, s_q, h_q, 512]`` and lse ``[b, h_q, s_q]``."""
    b, s_q, h_q, d = p.q.shape
    h_kv = p.k_cache.shape[2]
    rows = s_q * (h_q // h_kv)
    plan = p.sched.plan_for("triton", lambda: _plan(p, rows)) if p.sched is not None else _plan(p, rows)
    out = buffers.empty(b, s_q, h_q, p.d_v, dtype=p.q.dtype, device=p.device)
    lse = buffers.empty(b, h_q, s_q, dtype=torch.float32, device=p.device)
    q, kv = p.q, p.k_cache
    constexprs = dict(D_QK=d, CAUSAL=p.causal and s_q > 1, HAS_SINK=p.attn_sink is not None,
                      SPLIT=plan.num_splits > 1, INTERPRET=runtime.interpreting())

    def launch(tile):
        rb = triton.cdiv(rows, tile.block_h)
        k_desc, r_desc = _descriptors(kv, tile, d)
        dense_decode_kernel[(b * h_kv * rb, plan.num_splits)](
            q, q.stride(0), q.stride(1), q.stride(2),
            kv, k_desc, r_desc, kv.stride(0), kv.stride(1), kv.stride(2), kv.shape[1], kv.shape[0],
            p.block_table, p.block_table.stride(0), p.cache_seqlens,
            p.attn_sink, out, out.stride(0), out.stride(1), out.stride(2), lse, lse.stride(0), lse.stride(2),
            lse.stride(1), plan.partial_out, plan.partial_lse,
            s_q, h_q, h_q // h_kv, h_kv, rb, plan.num_splits, p.sm_scale * math.log2(math.e),
            USE_TMA=k_desc is not None, BLOCK_H=tile.block_h, BLOCK_N=tile.block_n, SKIP_SCALE=tile.skip_scale,
            NUM_STAGES=tile.num_stages, num_warps=tile.num_warps, **constexprs)

    if hopper.use(hopper.dense_decode_reasons(p, plan.tile)):
        hopper.launch_dense_decode(p, plan, out, lse, constexprs["CAUSAL"], constexprs["SPLIT"])
    else:
        launch_fitting(("dense_decode", tuple(sorted(constexprs.items()))), plan.tile, launch)
    if plan.num_splits > 1:
        combine(plan, out, lse, s_q, (out.stride(0), out.stride(1), out.stride(2)),
                (lse.stride(0), lse.stride(2), lse.stride(1)), p.attn_sink)
    return out, lse
