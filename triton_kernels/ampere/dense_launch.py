"""Host side of the ``mma_v2`` dense decoding kernel (``dense.py``): its tile (the prefill kernel's: the same
shared memory, q and the key stages), its split count and the launch (a launch plan's, ``DenseLaunch``, with the
interface of the Hopper dense launch, and a standalone call's, ``dense_decode``). ``serve.py`` says when the
dispatcher's plans take it; ``NOTES.md`` what has been checked and measured.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton

from anymla import buffers

from .. import runtime
from ..launcher import Launcher
from ..splits import Combine, choose_num_splits, workspaces
from .launch import HEADS, K_STEP, check_rows, choose_tile


class DenseLaunch:
    """The kernel's launch for one call signature (``p``: a validated DenseDecode of one kv head, 16-bit, rows
    16-byte aligned; ``causal`` where it masks, i.e. s_q > 1) with ``num_splits`` splits along the keys;
    ``tile`` ``(BLOCK_N, NUM_STAGES)`` instead of the device's ``launch.choose_tile``."""

    def __init__(self, p, causal: bool, num_splits: int, tile: Optional[tuple[int, int]] = None):
        from .dense import dense_decode_mma_v2_kernel  # Gluon: imported where it can run
        b, s_q, h_q, d = p.q.shape
        self.tile = tile or choose_tile(d, runtime.max_shared_memory(p.device))
        self.rb = triton.cdiv(s_q * h_q, HEADS)
        self.grid = (b * self.rb, num_splits, 1)
        self.constexprs = [p.k_cache.shape[1], d, causal, p.attn_sink is not None, num_splits > 1, *self.tile, K_STEP]
        self.launcher = Launcher(dense_decode_mma_v2_kernel, num_warps=8)

    def __call__(self, p, num_splits: int, ws, out, lse) -> None:
        """out ``[b, s_q, h_q, 512]``, lse ``[b, h_q, s_q]``, or the split workspaces ``ws``. q is copied where
        its address is not 16-byte aligned (its rows are copied 16 bytes at a time; the signature does not key
        q's address)."""
        _, s_q, h_q, _ = p.q.shape
        q, kv, bt = p.q if p.q.data_ptr() % 16 == 0 else p.q.clone(), p.k_cache, p.block_table
        po, plse = (None, None) if ws is None else (ws.partial_out, ws.partial_lse)
        scale = p.sm_scale * math.log2(math.e)
        self.launcher.bind(self.grid, (q, kv, bt, p.cache_seqlens, p.attn_sink, out, lse, po, plse, scale), lambda: [
            q, q.stride(0), q.stride(1), q.stride(2), kv, kv.stride(0), kv.stride(1), bt, bt.stride(0),
            p.cache_seqlens, p.attn_sink, out, out.stride(0), out.stride(1), out.stride(2), lse, lse.stride(0),
            lse.stride(2), lse.stride(1), po, plse, s_q, h_q, self.rb, num_splits, scale, *self.constexprs])


def dense_decode(p, num_splits: Optional[int] = None,
                 tile: Optional[tuple[int, int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``flash_mla_with_kvcache`` on the ``mma_v2`` kernel for ``p`` (a validated ``problems.DenseDecode``
    of one kv head, bf16/fp16, d_qk 512 or 576, d_v 512): ``(out [b, s_q, h_q, 512], lse [b, h_q, s_q])``.
    ``num_splits``: splits along the keys (default: enough programs for every multiprocessor)."""
    b, s_q, h_q, d = p.q.shape
    if p.k_cache.shape[2] != 1 or d not in (512, 576) or p.d_v != 512:
        raise ValueError(f"q {tuple(p.q.shape)}, k_cache {tuple(p.k_cache.shape)}, d_v {p.d_v}: one kv head, "
                         "d_qk 512 or 576, d_v 512")
    check_rows(q=p.q, k_cache=p.k_cache)
    out = buffers.empty(b, s_q, h_q, 512, dtype=p.q.dtype, device=p.device)
    lse = buffers.empty(b, h_q, s_q, dtype=torch.float32, device=p.device)
    if not (b and s_q and h_q):
        return out, lse
    block_n, stages = tile or choose_tile(d, runtime.max_shared_memory(p.device))
    keys = p.k_cache.shape[1] * p.block_table.shape[1]
    # One program a multiprocessor at a time (~250 registers x 256 threads)
    splits = num_splits or choose_num_splits(b * triton.cdiv(s_q * h_q, HEADS), triton.cdiv(keys, block_n),
                                             runtime.num_cores(p.device), 1, False)
    ws = workspaces(splits, b * s_q, h_q, p.device)
    DenseLaunch(p, p.causal and s_q > 1, splits, (block_n, stages))(p, splits, ws, out, lse)
    if ws is not None:
        Combine(splits)(ws, out, lse, s_q, (out.stride(0), out.stride(1), out.stride(2)),
                        (lse.stride(0), lse.stride(2), lse.stride(1)), p.attn_sink)
    return out, lse
