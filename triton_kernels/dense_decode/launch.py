"""Launch plan of the dense MLA decode kernels (dense ``flash_mla_with_kvcache``), made once per call signature:
the kernel (Hopper or portable, and why), tile, split count, grid and launchers. A call binds its tensors.
"""

from __future__ import annotations

import math

import torch
import triton

from anymla import buffers

from .. import runtime
from ..ampere import serve as mma_v2
from ..fit import FittedKernel
from ..hopper import launch as hopper
from ..launcher import LatestDescriptors
from ..splits import Combine, choose_num_splits, workspaces
from ..tuning import TileConfig, dense_config, forced_tma
from .kernel import dense_decode_kernel


def _tma_layout(kv: torch.Tensor) -> bool:
    """Whether the cache's layout lets tensor-memory copies address it (the tile must also divide the page)."""
    esize = kv.element_size()
    return kv.stride(-1) == 1 and not any(st * esize % 16 for st in kv.stride()[:-1])


def _descriptors(kv: torch.Tensor, block_n: int):
    """TMA descriptors of the cache: [1, block_n, 1, 512] latent and [.., 64] rope boxes."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    shape, strides = list(kv.shape), list(kv.stride())
    k_desc = TensorDescriptor(kv, shape, strides, [1, block_n, 1, 512])
    r_desc = TensorDescriptor(kv, shape, strides, [1, block_n, 1, 64]) if kv.shape[-1] == 576 else None
    return k_desc, r_desc


class _Portable:
    """The portable kernel's launch for one plan."""

    def __init__(self, p, tile: TileConfig, causal: bool, split: bool):
        b, s_q, h_q, d = p.q.shape
        self.h_kv = p.k_cache.shape[2]
        self.rows = s_q * (h_q // self.h_kv)
        self.tail = [d, causal, p.attn_sink is not None, split, runtime.interpreting()]
        self.tma = forced_tma() is not False and runtime.tensor_memory_copies(p.device) and _tma_layout(p.k_cache)
        # One kernel for caches the tensor-memory copies can address, one for the (rare) misaligned ones: the
        # choice is a constexpr of the kernel, so each keeps its own argument layout.
        self.kernels = {aligned: FittedKernel(dense_decode_kernel, ("dense_decode", tuple(self.tail), aligned), tile)
                        for aligned in (True, False)}
        self.descriptors = {}  # block_n -> LatestDescriptors

    def _tma_descriptors(self, kv: torch.Tensor, block_n: int):
        if not self.tma or kv.shape[1] % block_n:
            return None, None
        latest = self.descriptors.get(block_n)
        if latest is None:
            latest = self.descriptors[block_n] = LatestDescriptors(lambda t: _descriptors(t, block_n))
        return latest(kv)

    def __call__(self, p, num_splits: int, ws, out, lse) -> None:
        b, s_q, h_q, _ = p.q.shape
        q, kv, bt = p.q, p.k_cache, p.block_table
        po, plse = (None, None) if ws is None else (ws.partial_out, ws.partial_lse)
        scale = p.sm_scale * math.log2(math.e)
        aligned = kv.data_ptr() % 16 == 0

        def values(tile: TileConfig):
            k_desc, r_desc = self._tma_descriptors(kv, tile.block_n) if aligned else (None, None)
            return q, kv, k_desc, r_desc, bt, p.cache_seqlens, p.attn_sink, out, lse, po, plse, scale

        def full(tile: TileConfig):
            rb = -(-self.rows // tile.block_h)
            _, _, k_desc, r_desc, *_ = values(tile)
            return (b * self.h_kv * rb, num_splits, 1), [
                q, q.stride(0), q.stride(1), q.stride(2),
                kv, k_desc, r_desc, kv.stride(0), kv.stride(1), kv.stride(2), kv.shape[1], kv.shape[0],
                bt, bt.stride(0), bt.shape[1] * kv.shape[1], p.cache_seqlens,
                p.attn_sink, out, out.stride(0), out.stride(1), out.stride(2), lse, lse.stride(0), lse.stride(2),
                lse.stride(1), po, plse,
                s_q, h_q, h_q // self.h_kv, self.h_kv, rb, num_splits, scale,
                *self.tail, k_desc is not None, tile.block_h, tile.block_n, tile.skip_scale, tile.num_stages]

        self.kernels[aligned](values, full)


class DenseDecodePlan:
    """Dense ``flash_mla_with_kvcache`` on the Triton tier for one signature (``p``: a validated DenseDecode).
    A call returns out ``[b, s_q, h_q, 512]`` and lse ``[b, h_q, s_q]``."""

    def __init__(self, p):
        b, s_q, h_q, _ = p.q.shape
        h_kv = p.k_cache.shape[2]
        rows = s_q * (h_q // h_kv)
        tile = dense_config(runtime.tile_kind(p.device), rows)
        reasons = hopper.dense_decode_reasons(p, tile)
        self.hopper = hopper.use(reasons)
        self.mma_v2, mma_device, mma_call = mma_v2.decide(self.hopper, p.device, lambda: mma_v2.dense_reasons(p))
        shape = mma_v2.programs(p.device) if self.mma_v2 else tile  # the programs to fill
        capacity = p.block_table.shape[1] * p.k_cache.shape[1]
        self.num_splits = choose_num_splits(b * h_kv * triton.cdiv(rows, shape.block_h),
                                            triton.cdiv(capacity, shape.block_n), runtime.num_cores(p.device),
                                            shape.programs_per_core, p.batch_invariant)
        split = self.num_splits > 1
        causal = p.causal and s_q > 1
        if self.hopper:
            self.launch = hopper.DenseDecodeLaunch(p, causal, split)
        elif self.mma_v2:
            from ..ampere.dense_launch import DenseLaunch
            self.launch = DenseLaunch(p, causal, self.num_splits)
        else:
            self.launch = _Portable(p, tile, causal, split)
        self.combine = Combine(self.num_splits) if split else None
        if self.mma_v2:
            block_n, stages = self.launch.tile
            self.description = mma_v2.running(f"{block_n} keys a block, {stages} stages", reasons, self.num_splits,
                                              "dense decode")
        else:
            self.description = hopper.describe(reasons, "dense decode", tile, self.num_splits) + \
                mma_v2.not_running(mma_device, mma_call)

    def __call__(self, p) -> tuple[torch.Tensor, torch.Tensor]:
        b, s_q, h_q, _ = p.q.shape
        out = buffers.empty(b, s_q, h_q, p.d_v, dtype=p.q.dtype, device=p.device)
        lse = buffers.empty(b, h_q, s_q, dtype=torch.float32, device=p.device)
        # the partials of each call its own (as FlashMLA allocates them): calls on two streams never share them
        ws = workspaces(self.num_splits, b * s_q, h_q, p.device)
        self.launch(p, self.num_splits, ws, out, lse)
        if self.combine is not None:
            self.combine(ws, out, lse, s_q, (out.stride(0), out.stride(1), out.stride(2)),
                         (lse.stride(0), lse.stride(2), lse.stride(1)), p.attn_sink)
        return out, lse
