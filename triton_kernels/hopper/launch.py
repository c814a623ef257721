"""Host side of the Hopper kernels: whether a call fits them, and their launches.

They serve sm_90 GPUs when Triton has Gluon (3.6+), for 64-row tiles (the compute-bound regime), one kv head
and 16-bit values; everything else keeps the portable kernels. ``tuning.forced(warp_specialized=...)`` turns
them off or insists on them (an error when the call does not fit).
"""

from __future__ import annotations

import math

import torch
import triton

from .. import runtime
from ..splits import SplitPlan
from ..tuning import TileConfig, forced_tma, forced_warp_specialized, warp_specialized_config


def _wanted(device: torch.device, tile: TileConfig) -> bool:
    return (forced_warp_specialized() is not False and tile.block_h == 64 and warp_specialized_config() is not None
            and runtime.device_kind(device) == "cuda_sm90" and runtime.gluon_hopper())


def _fits(wanted: bool, ok: bool) -> bool:
    if wanted and not ok and forced_warp_specialized():
        raise ValueError("the warp-specialized Hopper kernel was forced, but this call does not fit it")
    return wanted and ok


def _sixteen_bit(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == tensors[0].dtype for t in tensors) and tensors[0].dtype in (torch.bfloat16, torch.float16)


def dense_decode_fits(p, tile: TileConfig) -> bool:
    """Dense decoding: also pages of whole key blocks and cache rows the TMA can address flat."""
    kv = p.k_cache
    num_blocks, page, h_kv, d = kv.shape
    flat = kv.stride(3) == 1 and kv.stride(1) == d and kv.stride(0) == page * d
    ws = warp_specialized_config()
    ok = (h_kv == 1 and ws is not None and page % ws.block_n == 0 and _sixteen_bit(p.q, kv) and flat
          and kv.data_ptr() % 16 == 0 and num_blocks * page < 2 ** 31 and p.q.stride(3) == 1
          and forced_tma() is not False)
    return _fits(_wanted(p.device, tile), ok)


def sparse_prefill_fits(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, tile: TileConfig) -> bool:
    """Sparse prefill: also rows the 16-byte copies can address (aligned base and row stride)."""
    ok = (kv.shape[1] == 1 and indices.shape[1] == 1 and _sixteen_bit(q, kv) and q.stride(-1) == 1
          and kv.stride(-1) == 1 and kv.data_ptr() % 16 == 0 and kv.stride(0) * kv.element_size() % 16 == 0
          and indices.stride(-1) == 1)
    return _fits(_wanted(q.device, tile), ok)


def _gl_dtype(t: torch.Tensor):
    from triton.experimental.gluon import language as gl
    return gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16


def _shared_layout(block, t: torch.Tensor):
    from triton.experimental.gluon import language as gl
    return gl.NVMMASharedLayout.get_default_for(block, _gl_dtype(t))


def launch_dense_decode(p, plan: SplitPlan, out, lse, causal: bool, split: bool) -> None:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from .kernels import BLOCK_H, REGS, dense_decode_hopper_kernel
    b, s_q, h_q, d = p.q.shape
    kv = p.k_cache
    tile = warp_specialized_config()
    flat = kv.view(kv.shape[0] * kv.shape[1], d)

    def descriptor(cols):
        return TensorDescriptor.from_tensor(flat, [tile.block_n, cols], _shared_layout([tile.block_n, cols], kv))

    rb = triton.cdiv(s_q * h_q, BLOCK_H.value)
    dense_decode_hopper_kernel[(b * rb, plan.num_splits)](
        p.q, p.q.stride(0), p.q.stride(1), p.q.stride(2), descriptor(512), descriptor(64) if d == 576 else None,
        kv.shape[1], kv.shape[0],
        p.block_table, p.block_table.stride(0), p.cache_seqlens, p.attn_sink,
        out, out.stride(0), out.stride(1), out.stride(2), lse, lse.stride(0), lse.stride(2), lse.stride(1),
        plan.partial_out, plan.partial_lse, s_q, h_q, rb, plan.num_splits, p.sm_scale * math.log2(math.e),
        D_QK=d, CAUSAL=causal, HAS_SINK=p.attn_sink is not None, SPLIT=split, NUM_STAGES=tile.num_stages,
        num_warps=4, maxnreg=REGS.value)


def launch_sparse_prefill(q, kv, indices, topk_length, sink, sm_scale: float, out, lse, max_logits) -> None:
    from .kernels import BLOCK_H, REGS, sparse_prefill_hopper_kernel
    s_q, h_q, d = q.shape
    tile = warp_specialized_config()
    hb = triton.cdiv(h_q, BLOCK_H.value)
    sparse_prefill_hopper_kernel[(s_q * hb,)](
        q, q.stride(0), q.stride(1), kv, kv.stride(0), kv.shape[0], indices, indices.stride(0), indices.shape[-1],
        topk_length, sink, out, out.stride(0), out.stride(1), lse, max_logits, h_q, hb,
        sm_scale * math.log2(math.e),
        D_QK=d, HAS_LEN=topk_length is not None, HAS_SINK=sink is not None, BLOCK_N=tile.block_n,
        NUM_STAGES=tile.num_stages, K_LAYOUT=_shared_layout([tile.block_n, 512], kv),
        R_LAYOUT=_shared_layout([tile.block_n, 64], kv), num_warps=4, maxnreg=REGS.value)
