"""Launch plans of the sparse MLA kernels for ``flash_mla_sparse_fwd`` and sparse ``flash_mla_with_kvcache``.

A plan is made once per call signature (the dispatcher keeps it in its decision): which kernel runs and why
(the Hopper one or the portable one), the tile, the split count and the grid, with the kernels' launchers.
A call only binds its tensors to the plan and launches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
import triton

from anymla import buffers
from anymla.kvcache import KVCacheFormat

from .. import runtime
from ..ampere import serve as mma_v2
from ..fit import FittedKernel
from ..hopper import launch as hopper
from ..splits import Combine, choose_num_splits, workspaces
from ..tuning import TileConfig, sparse_config
from .kernel import sparse_mla_kernel

_FMT_CODE = {KVCacheFormat.BF16: 0, KVCacheFormat.V32_FP8: 1, KVCacheFormat.MODEL1_FP8: 2,
             KVCacheFormat.V41_FP8: 3, KVCacheFormat.V41_FP4: 4}


@dataclass
class Source:
    """One gathered key source of a call: a (paged) cache, its index list per token and optional lengths."""

    kv: torch.Tensor  # bf16/fp16 elements, or uint8 bytes
    page: int
    stride_block: int
    stride_row: int
    stride_group: int
    rows: int
    indices: torch.Tensor  # [tokens, groups, topk], last dim contiguous
    length: Optional[torch.Tensor]

    @classmethod
    def paged(cls, cache: torch.Tensor, fmt: KVCacheFormat, indices: torch.Tensor, length) -> "Source":
        """A paged cache as a source; ``indices`` ``[tokens, 1, topk]`` slots, topk contiguous."""
        kv = cache if fmt is KVCacheFormat.BF16 or cache.dtype == torch.uint8 else cache.view(torch.uint8)
        nb, page = cache.shape[:2]
        return cls(kv, page, kv.stride(0), kv.stride(1), 0, nb * page, indices, length)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class _Portable:
    """The portable kernel's launch for one plan: its constexprs and fitted tile."""

    def __init__(self, device: torch.device, tile: TileConfig, d_qk: int, fmt: KVCacheFormat,
                 x_fmt: Optional[KVCacheFormat], has_len: bool, has_x_len: bool, has_sink: bool, write_max: bool,
                 split: bool, tokens: int, heads: int, groups: int):
        self.per_group = heads // groups
        self.rows = tokens * groups
        self.constexprs = dict(D_QK=d_qk, FMT=_FMT_CODE[fmt], X_FMT=_FMT_CODE[x_fmt or fmt], HAS_X=x_fmt is not None,
                               HAS_LEN=has_len, HAS_X_LEN=has_x_len, HAS_SINK=has_sink, WRITE_MAX=write_max,
                               SPLIT=split, NATIVE_FP8=runtime.native_fp8(device),
                               PORTABLE=runtime.portable_loads(device), INTERPRET=runtime.interpreting())
        self.kernel = FittedKernel(sparse_mla_kernel, ("sparse_mla", tuple(sorted(self.constexprs.items()))), tile)
        self.tail = list(self.constexprs.values())  # the kernel's constexprs up to the tile's, in its order

    def __call__(self, call: "CallTensors", typed, len_div: int, sm_scale: float, num_splits: int, ws) -> None:
        """``call``: the tensors as the call brought them; ``typed()``: the same as the kernel is compiled for
        (``(q, main, extra, out, lse)`` with the sources' paging), only built when the launcher needs it."""
        po, plse = (None, None) if ws is None else (ws.partial_out, ws.partial_lse)
        scale = sm_scale * math.log2(math.e)
        c = call
        x_kv, x_idx, x_len = c.x_source()
        values = (c.q, c.indices, c.length, c.kv, x_idx, x_len, x_kv, c.sink, c.out, c.lse, c.max_logits, po, plse,
                  scale)

        def full(tile: TileConfig):
            q, main, extra, out, lse = typed()
            x = extra or main
            hb = -(-self.per_group // tile.block_h)
            return (self.rows * hb, num_splits, 1), [
                q, q.stride(0), q.stride(1),
                main.indices, main.indices.stride(0), main.indices.stride(1), main.indices.shape[-1], main.length,
                len_div, main.kv, main.stride_block, main.stride_row, main.stride_group, main.page, main.rows,
                x.indices, x.indices.stride(0), x.indices.shape[-1], x.length, x.kv, x.stride_block, x.stride_row,
                x.page, x.rows,
                c.sink, out, out.stride(0), out.stride(1), lse, c.max_logits, po, plse,
                q.shape[1], self.per_group, hb, num_splits, scale,
                *self.tail, tile.block_h, tile.block_n, tile.skip_scale, tile.num_stages]

        self.kernel(lambda tile: values, full)


class CallTensors(NamedTuple):
    """The tensors of one sparse call as it brought them (or, where the kernel cannot read them at their
    address, as copied for it), in no kernel's order; absent ones are None."""

    q: torch.Tensor
    kv: torch.Tensor
    indices: torch.Tensor
    length: Optional[torch.Tensor]
    x_kv: Optional[torch.Tensor]
    x_indices: Optional[torch.Tensor]
    x_length: Optional[torch.Tensor]
    sink: Optional[torch.Tensor]
    out: torch.Tensor
    lse: torch.Tensor
    max_logits: Optional[torch.Tensor]

    def x_source(self) -> tuple:
        """``(kv, indices, length)`` of the extra cache; the main cache's where there is none (the kernels
        then attend no extra key, but their pointer arguments must still be valid)."""
        return (self.kv, self.indices, self.length) if self.x_kv is None else \
            (self.x_kv, self.x_indices, self.x_length)


def _as_read(t: Optional[torch.Tensor], to_kernel) -> Callable:
    """How a plan passes a call's tensor whose kernel view is ``to_kernel(t)``: as it comes when that view lies
    at its address (fixed by the signature's strides), else through ``to_kernel`` (a copy) on every call."""
    if t is None or to_kernel(t).data_ptr() == t.data_ptr():
        return _itself
    return to_kernel


def _itself(t):
    return t


class SparsePrefillPlan:
    """``flash_mla_sparse_fwd`` on the Triton tier for one signature (``p``: a validated SparsePrefill)."""

    def __init__(self, p):
        # q, kv and indices as the kernels read them: contiguous along their last dim (copied where not)
        self.as_read = [_as_read(t, _last_dim_contiguous) for t in (p.q, p.kv, p.indices)]
        q, kv, indices = (f(t) for f, t in zip(self.as_read, (p.q, p.kv, p.indices)))
        s_q, h_q, d = q.shape
        h_kv = kv.shape[1]
        tile = sparse_config(runtime.tile_kind(q.device), h_q // h_kv, False)
        reasons = hopper.sparse_prefill_reasons(q, kv, indices, tile)
        self.hopper = hopper.use(reasons)
        self.mma_v2, mma_device, mma_call = mma_v2.decide(self.hopper, q.device,
                                                          lambda: mma_v2.prefill_reasons(q, kv, p.d_v))
        form = ""
        has_len, has_sink = p.topk_length is not None, p.attn_sink is not None
        if self.hopper:
            shape, form = hopper.program_shape("sparse_prefill", h_q)
            self.launch = hopper.SparsePrefillLaunch(shape, q, kv, has_len, has_sink)
        elif self.mma_v2:
            from ..ampere.launch import PrefillLaunch
            self.launch = PrefillLaunch(q, kv, has_len, has_sink)
        else:
            self.launch = _Portable(q.device, tile, d, KVCacheFormat.BF16, None, has_len, False, has_sink, True,
                                    False, s_q, h_q, h_kv)
        if self.mma_v2:
            block_n, stages = self.launch.tile
            self.description = mma_v2.running(f"{block_n} keys a block, {stages} stages", reasons, 1)
        else:
            self.description = hopper.describe(reasons, "sparse", tile, 1, form) + mma_v2.not_running(mma_device,
                                                                                                      mma_call)
        # No row to attend (s_kv or topk 0): every token's result is fixed, and Triton 3.6 fails compiling the
        # Hopper kernel for an empty kv (H200, 2026-12-01), so no kernel runs.
        self.nothing_to_attend = kv.shape[0] == 0 or indices.shape[-1] == 0
        if self.nothing_to_attend:
            self.description = "no kernel: no kv row to attend (out 0, max_logits -inf, lse +inf)"

    def __call__(self, p) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        read_q, read_kv, read_idx = self.as_read
        q, kv, indices = read_q(p.q), read_kv(p.kv), read_idx(p.indices)
        s_q, h_q, _ = q.shape
        out = buffers.empty(s_q, h_q, p.d_v, dtype=q.dtype, device=q.device)
        # one allocation for both statistics (each allocation costs the host ~4 µs)
        max_logits, lse = buffers.empty(2, s_q, h_q, dtype=torch.float32, device=q.device).unbind(0)
        if not s_q:
            return out, max_logits, lse
        if self.nothing_to_attend:
            out.zero_()
            max_logits.fill_(-math.inf)
            lse.fill_(math.inf)
        elif self.hopper or self.mma_v2:
            self.launch(q, kv, indices, p.topk_length, p.attn_sink, p.sm_scale, out, lse, max_logits)
        else:
            call = CallTensors(q, kv, indices, p.topk_length, None, None, None, p.attn_sink, out, lse, max_logits)

            def typed():
                # kv is one page holding every row: slot = row, so the paged addressing reduces to row * stride(0).
                s_kv = kv.shape[0]
                main = Source(kv, max(s_kv, 1), 0, kv.stride(0), kv.stride(1), s_kv, indices, p.topk_length)
                return q, main, None, out, lse

            self.launch(call, typed, 1, p.sm_scale, 1, None)
        return out, max_logits, lse


def _flat_indices(indices: torch.Tensor) -> torch.Tensor:
    """Decoding indices ``[b, s_q, topk]`` as the kernels read them: ``[tokens, 1, topk]``, topk contiguous."""
    return _last_dim_contiguous(indices.reshape(-1, 1, indices.shape[-1]))


class SparseDecodePlan:
    """Sparse ``flash_mla_with_kvcache`` on the Triton tier for one signature (``p``: a validated SparseDecode).
    A call returns out ``[b, s_q, h_q, 512]`` and lse ``[b, s_q, h_q]`` (contiguous)."""

    def __init__(self, p):
        b, s_q, h_q, d = p.q.shape
        self.shape = (b, s_q, h_q, d)
        self.tokens = tokens = b * s_q
        self.fmt, self.x_fmt = fmt, x_fmt = p.fmt, p.extra_fmt
        tile = sparse_config(runtime.tile_kind(p.device), h_q, fmt.is_quantized, fmt.name)
        cores = runtime.num_cores(p.device)
        # bf16 caches: the few-head form of the Hopper decoding kernel gathers their rows; at more heads the
        # Hopper prefill kernel serves them (the decoding kernel's 64-head form dequantizes)
        bf16 = fmt is KVCacheFormat.BF16
        reasons = hopper.bf16_decode_reasons(p, tile, cores) if bf16 else hopper.sparse_decode_reasons(p, tile)
        self.hopper = hopper.use(reasons)
        self.as_prefill = bf16 and self.hopper and hopper.bf16_decode_through_prefill(h_q)
        has_x = p.extra_k_cache is not None
        has_len, has_x_len, has_sink = p.topk_length is not None, p.extra_topk_length is not None, \
            p.attn_sink is not None
        self.read_q = _as_read(p.q, self._kernel_q)
        self.read_idx, self.read_x_idx = _as_read(p.indices, _flat_indices), _as_read(p.extra_indices, _flat_indices)
        self.combine = None
        if self.as_prefill:
            self.num_splits = 1
            shape, form = hopper.program_shape("sparse_prefill", h_q)
            self.launch = hopper.SparsePrefillLaunch(shape, self._kernel_q(p.q), p.k_cache, has_len, has_sink)
            self.description = hopper.describe(reasons, "sparse", tile, 1,
                                               f"the sparse prefill kernel over the cache's rows as one kv; {form}")
            return
        self.mma_v2, mma_device, mma_call = mma_v2.decide(self.hopper, p.device, lambda: mma_v2.decode_reasons(p))
        # the programs to fill
        shape, form = hopper.program_shape("sparse_decode", h_q) if self.hopper else \
            (mma_v2.decode_programs(p.device) if self.mma_v2 else tile, "")
        keys = p.indices.shape[-1] + (0 if p.extra_indices is None else p.extra_indices.shape[-1])
        self.num_splits = choose_num_splits(tokens * triton.cdiv(h_q, shape.block_h), triton.cdiv(keys, shape.block_n),
                                            cores, shape.programs_per_core, p.batch_invariant)
        split = self.num_splits > 1
        if self.hopper:
            self.launch = hopper.SparseDecodeLaunch(shape, tokens, h_q, d, _FMT_CODE[fmt], _FMT_CODE[x_fmt or fmt],
                                                    has_x, has_len, has_x_len, has_sink, split, p.q.dtype)
        elif self.mma_v2:
            from ..ampere.decode_launch import DecodeLaunch
            self.launch = DecodeLaunch(p.device, tokens, h_q, has_len, has_sink, self.num_splits,
                                       (shape.block_n, shape.num_stages))
        else:
            self.launch = _Portable(p.device, tile, d, fmt, x_fmt, has_len, has_x_len, has_sink, False, split,
                                    tokens, h_q, 1)
        self.combine = Combine(self.num_splits) if split else None
        if self.mma_v2:
            self.description = mma_v2.running(f"{shape.block_n} keys a block, {shape.num_stages} latent tiles",
                                              reasons, self.num_splits)
        else:
            self.description = hopper.describe(reasons, "sparse", tile, self.num_splits, form) + \
                mma_v2.not_running(mma_device, mma_call)

    def _kernel_q(self, q: torch.Tensor) -> torch.Tensor:
        """q as the kernels read it: ``[tokens, h_q, d_qk]``, d_qk contiguous."""
        _, _, h_q, d = self.shape
        return _last_dim_contiguous(q).reshape(self.tokens, h_q, d)

    def __call__(self, p) -> tuple[torch.Tensor, torch.Tensor]:
        b, s_q, h_q, _ = self.shape
        q, idx = self.read_q(p.q), self.read_idx(p.indices)
        x_idx = None if p.extra_indices is None else self.read_x_idx(p.extra_indices)
        out = buffers.empty(b, s_q, h_q, p.d_v, dtype=p.q.dtype, device=p.q.device)
        lse = buffers.empty(b, s_q, h_q, dtype=torch.float32, device=p.q.device)
        if self.as_prefill:
            if self.tokens:
                kv = p.k_cache.view(-1, 1, p.k_cache.shape[-1])  # blocks back to back: a slot is a row
                max_logits = buffers.empty(self.tokens, h_q, dtype=torch.float32, device=p.q.device)
                self.launch(self._kernel_q(q), kv, _flat_indices(idx), p.topk_length, p.attn_sink, p.sm_scale,
                            out.view(self.tokens, h_q, p.d_v), lse.view(self.tokens, h_q), max_logits, s_q)
            return out, lse
        ws = workspaces(self.num_splits, self.tokens, h_q, p.q.device)  # each call's own, as in dense decoding
        call = CallTensors(q, p.k_cache, idx, p.topk_length, p.extra_k_cache, x_idx, p.extra_topk_length, p.attn_sink,
                           out, lse, None)

        def typed():
            main = Source.paged(p.k_cache, self.fmt, _flat_indices(idx), p.topk_length)
            extra = None if p.extra_k_cache is None else \
                Source.paged(p.extra_k_cache, self.x_fmt, _flat_indices(x_idx), p.extra_topk_length)
            return (self._kernel_q(q), main, extra, out.view(self.tokens, h_q, p.d_v), lse.view(self.tokens, h_q))

        self.launch(call, typed, s_q, p.sm_scale, self.num_splits, ws)
        if self.combine is not None:
            # out [tokens, h_q, 512] and lse [tokens, h_q] (contiguous): strides of (batch, query, head)
            self.combine(ws, out, lse, 1, (h_q * p.d_v, 0, p.d_v), (h_q, 0, 1), p.attn_sink)
        return out, lse
