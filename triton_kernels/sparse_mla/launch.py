"""Launchers of the sparse MLA kernel for ``flash_mla_sparse_fwd`` and sparse ``flash_mla_with_kvcache``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton

from anymla import buffers
from anymla.kvcache import KVCacheFormat

from .. import runtime
from ..fit import launch_fitting
from ..hopper import launch as hopper
from ..splits import SplitPlan, choose_num_splits, combine, make_plan
from ..tuning import sparse_config
from .kernel import sparse_mla_kernel

_FMT_CODE = {KVCacheFormat.BF16: 0, KVCacheFormat.V32_FP8: 1, KVCacheFormat.MODEL1_FP8: 2,
             KVCacheFormat.V41_FP8: 3, KVCacheFormat.V41_FP4: 4}


@dataclass
class _Source:
    """One gathered key source: a (paged) cache, its index list per token and optional lengths."""

    kv: torch.Tensor  # bf16/fp16 elements, or uint8 bytes
    fmt: KVCacheFormat
    page: int
    stride_block: int
    stride_row: int
    stride_group: int
    rows: int
    indices: torch.Tensor  # [tokens, groups, topk], last dim contiguous
    length: Optional[torch.Tensor]

    @property
    def code(self) -> int:
        """The format's code in the kernels (``common.FMT_*``)."""
        return _FMT_CODE[self.fmt]

    @classmethod
    def paged(cls, cache: torch.Tensor, fmt: KVCacheFormat, indices: torch.Tensor, length) -> "_Source":
        kv = cache if fmt is KVCacheFormat.BF16 else cache.view(torch.uint8)
        nb, page = cache.shape[:2]
        return cls(kv, fmt, page, kv.stride(0), kv.stride(1), 0, nb * page,
                   _last_dim_contiguous(indices.reshape(-1, 1, indices.shape[-1])), length)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(q: torch.Tensor, main: _Source, extra: Optional[_Source], len_div: int, sink, sm_scale: float,
            out: torch.Tensor, lse: torch.Tensor, max_logits: Optional[torch.Tensor], plan: SplitPlan) -> None:
    tokens, heads, d_qk = q.shape
    groups = main.indices.shape[1]
    per_group = heads // groups
    x = extra or main
    constexprs = dict(D_QK=d_qk, FMT=main.code, X_FMT=x.code, HAS_X=extra is not None,
                      HAS_LEN=main.length is not None, HAS_X_LEN=extra is not None and extra.length is not None,
                      HAS_SINK=sink is not None, WRITE_MAX=max_logits is not None, SPLIT=plan.num_splits > 1,
                      NATIVE_FP8=runtime.native_fp8(q.device), PORTABLE=runtime.portable_loads(q.device),
                      INTERPRET=runtime.interpreting())

    def launch(tile):
        hb = triton.cdiv(per_group, tile.block_h)
        sparse_mla_kernel[(tokens * groups * hb, plan.num_splits)](
            q, q.stride(0), q.stride(1),
            main.indices, main.indices.stride(0), main.indices.stride(1), main.indices.shape[-1], main.length,
            len_div,
            main.kv, main.stride_block, main.stride_row, main.stride_group, main.page, main.rows,
            x.indices, x.indices.stride(0), x.indices.shape[-1], x.length, x.kv, x.stride_block, x.stride_row,
            x.page, x.rows,
            sink, out, out.stride(0), out.stride(1), lse, max_logits, plan.partial_out, plan.partial_lse,
            heads, per_group, hb, plan.num_splits, sm_scale * math.log2(math.e),
            BLOCK_H=tile.block_h, BLOCK_N=tile.block_n, SKIP_SCALE=tile.skip_scale, NUM_STAGES=tile.num_stages,
            num_warps=tile.num_warps, **constexprs)

    launch_fitting(("sparse_mla", tuple(sorted(constexprs.items()))), plan.tile, launch)


def kernel_choice(p) -> str:
    """Which kernel the sparse launchers run for ``p``, and why (``explain()``)."""
    if p.op != "sparse_prefill":
        tile = sparse_config(runtime.device_kind(p.device), p.q.shape[2], p.fmt.is_quantized)
        return hopper.describe(hopper.sparse_decode_reasons(p, tile), "sparse")
    tile = sparse_config(runtime.device_kind(p.q.device), p.q.shape[1] // p.kv.shape[1], False)
    q, kv, indices = (_last_dim_contiguous(t) for t in (p.q, p.kv, p.indices))  # as the launcher passes them
    return hopper.describe(hopper.sparse_prefill_reasons(q, kv, indices, tile), "sparse")


def sparse_prefill(p) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``flash_mla_sparse_fwd`` on the Triton tier (``p``: :class:`anymla.problems.SparsePrefill`)."""
    q = _last_dim_contiguous(p.q)
    kv = _last_dim_contiguous(p.kv)
    s_q, h_q, _ = q.shape
    s_kv, h_kv, _ = kv.shape
    tile = sparse_config(runtime.device_kind(q.device), h_q // h_kv, False)
    # kv is one page holding every row: slot = row, so the paged addressing reduces to row * stride(0).
    main = _Source(kv, KVCacheFormat.BF16, max(s_kv, 1), 0, kv.stride(0), kv.stride(1), s_kv,
                   _last_dim_contiguous(p.indices), p.topk_length)
    out = buffers.empty(s_q, h_q, p.d_v, dtype=q.dtype, device=q.device)
    lse = buffers.empty(s_q, h_q, dtype=torch.float32, device=q.device)
    max_logits = buffers.empty(*lse.shape, dtype=lse.dtype, device=lse.device)
    if s_q and hopper.use(hopper.sparse_prefill_reasons(q, kv, main.indices, tile)):
        hopper.launch_sparse_prefill(q, kv, main.indices, p.topk_length, p.attn_sink, p.sm_scale, out, lse,
                                     max_logits)
    elif s_q:
        _launch(q, main, None, 1, p.attn_sink, p.sm_scale, out, lse, max_logits, SplitPlan(tile, 1))
    return out, max_logits, lse


def _decode_plan(p, tokens: int, h_q: int) -> SplitPlan:
    kind = runtime.device_kind(p.device)
    tile = sparse_config(kind, h_q, p.fmt.is_quantized)
    programs = tokens * triton.cdiv(h_q, tile.block_h)
    keys = p.indices.shape[-1] + (0 if p.extra_indices is None else p.extra_indices.shape[-1])
    splits = choose_num_splits(programs, triton.cdiv(keys, tile.block_n), runtime.num_cores(p.device),
                               tile.programs_per_core, p.batch_invariant)
    return make_plan(tile, splits, tokens, h_q, p.device)


def sparse_decode(p) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse ``flash_mla_with_kvcache`` on the Triton tier (``p``: :class:`anymla.problems.SparseDecode`).

    Returns out ``[b, s_q, h_q, 512]`` and lse ``[b, s_q, h_q]`` (contiguous)."""
    b, s_q, h_q, d = p.q.shape
    tokens = b * s_q
    q = _last_dim_contiguous(p.q).reshape(tokens, h_q, d)
    if p.sched is not None:
        plan = p.sched.plan_for("triton", lambda: _decode_plan(p, tokens, h_q))
    else:
        plan = _decode_plan(p, tokens, h_q)
    main = _Source.paged(p.k_cache, p.fmt, p.indices, p.topk_length)
    extra = None if p.extra_k_cache is None else \
        _Source.paged(p.extra_k_cache, p.extra_fmt, p.extra_indices, p.extra_topk_length)
    out = buffers.empty(b, s_q, h_q, p.d_v, dtype=q.dtype, device=q.device)
    lse = buffers.empty(b, s_q, h_q, dtype=torch.float32, device=q.device)
    o3, l2 = out.view(tokens, h_q, p.d_v), lse.view(tokens, h_q)
    if hopper.use(hopper.sparse_decode_reasons(p, plan.tile)):
        hopper.launch_sparse_decode(q, main, extra, s_q, p.attn_sink, p.sm_scale, o3, l2, plan)
    else:
        _launch(q, main, extra, s_q, p.attn_sink, p.sm_scale, o3, l2, None, plan)
    if plan.num_splits > 1:
        combine(plan, o3, l2, 1, (o3.stride(0), 0, o3.stride(1)), (l2.stride(0), 0, l2.stride(1)), p.attn_sink)
    return out, lse
