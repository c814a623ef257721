"""Launcher of the dense MLA decode kernel (dense ``flash_mla_with_kvcache``)."""

from __future__ import annotations

import math

import torch

from anymla import buffers
import triton

from .. import runtime
from ..fit import launch_fitting
from ..tuning import TileConfig, forced_tma, forced_warp_specialized, warp_specialized_dense_config
from ..splits import SplitPlan, choose_num_splits, combine, make_plan
from ..tuning import dense_config
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


def _warp_specialized(p, tile: TileConfig) -> bool:
    """Whether the warp-specialized Hopper kernel (``hopper.py``) serves this call: an sm_90 GPU, Gluon, a
    64-row tile (the compute-bound regime: with fewer rows the portable kernel already runs at the copy
    rate), one kv head, pages of whole key blocks, 16-bit values and cache rows the TMA can address flat."""
    forced = forced_warp_specialized()
    if forced is False or runtime.device_kind(p.device) != "cuda_sm90" or not runtime.gluon_hopper():
        return False
    kv = p.k_cache
    num_blocks, page, h_kv, d = kv.shape
    flat = kv.stride(1) == d and kv.stride(0) == page * d and kv.stride(3) == 1
    ws = warp_specialized_dense_config()
    ok = (tile.block_h == 64 and ws.block_h == 64 and h_kv == 1 and page % ws.block_n == 0
          and kv.dtype in (torch.bfloat16, torch.float16) and p.q.dtype == kv.dtype and flat and kv.data_ptr() % 16 == 0 and num_blocks * page < 2 ** 31
          and p.q.stride(3) == 1 and forced_tma() is not False)
    if forced and not ok:
        raise ValueError("the warp-specialized dense kernel was forced, but this call does not fit it")
    return ok


def _launch_warp_specialized(p, plan: SplitPlan, out, lse, constexprs: dict) -> None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from .hopper import BLOCK_H, REGS, dense_decode_hopper_kernel
    b, s_q, h_q, d = p.q.shape
    kv = p.k_cache
    ws = warp_specialized_dense_config()
    flat = kv.view(kv.shape[0] * kv.shape[1], d)
    dtype = gl.bfloat16 if kv.dtype == torch.bfloat16 else gl.float16

    def descriptor(cols):
        block = [ws.block_n, cols]
        return TensorDescriptor.from_tensor(flat, block, gl.NVMMASharedLayout.get_default_for(block, dtype))

    rb = triton.cdiv(s_q * h_q, BLOCK_H.value)
    dense_decode_hopper_kernel[(b * rb, plan.num_splits)](
        p.q, p.q.stride(0), p.q.stride(1), p.q.stride(2), descriptor(512), descriptor(64) if d == 576 else None,
        kv.shape[1], kv.shape[0],
        p.block_table, p.block_table.stride(0), p.cache_seqlens, p.attn_sink,
        out, out.stride(0), out.stride(1), out.stride(2), lse, lse.stride(0), lse.stride(2), lse.stride(1),
        plan.partial_out, plan.partial_lse, s_q, h_q, rb, plan.num_splits, p.sm_scale * math.log2(math.e),
        D_QK=d, CAUSAL=constexprs["CAUSAL"], HAS_SINK=constexprs["HAS_SINK"], SPLIT=constexprs["SPLIT"],
        NUM_STAGES=ws.num_stages, num_warps=4, maxnreg=REGS.value)


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

    if _warp_specialized(p, plan.tile):
        _launch_warp_specialized(p, plan, out, lse, constexprs)
    else:
        launch_fitting(("dense_decode", tuple(sorted(constexprs.items()))), plan.tile, launch)
    if plan.num_splits > 1:
        combine(plan, out, lse, s_q, (out.stride(0), out.stride(1), out.stride(2)),
                (lse.stride(0), lse.stride(2), lse.stride(1)), p.attn_sink)
    return out, lse
