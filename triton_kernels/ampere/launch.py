"""Host side of the ``mma_v2`` sparse prefill kernel: its tile for a GPU's shared memory, and the launch (a
launch plan's, ``PrefillLaunch``, and a standalone call's, ``sparse_prefill``). ``serve.py`` says when the
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

HEADS = 64  # query heads a program (the kernel's BLOCK_H)
# (BLOCK_N, NUM_STAGES), preferred first: 64 keys double-buffered fit sm_90 / sm_100 (227 KB), 32 fit sm_80
# (163 KB); the 99 KB GPUs (sm_86/89/120) take 16 keys, double-buffered at d_qk 512, single at 576.
TILES = ((64, 2), (32, 2), (16, 2), (16, 1))
K_STEP = 16  # columns of d each ldmatrix / HMMA step of q·kᵀ covers


def shared_bytes(d_qk: int, block_n: int, stages: int) -> int:
    """Shared memory the kernel allocates (as ``compile_report`` reads it from the compiled kernel): q, the key
    stages and P in 16-bit, plus the cross-warp row reduction's scratch (4 bytes x 64 rows x warp columns)."""
    cols = d_qk  # 512 latent columns, and for 576 the rope tail
    warp_cols = min(4, block_n // 8)
    return 2 * (HEADS * cols + stages * block_n * cols + HEADS * block_n) + 4 * HEADS * warp_cols


def choose_tile(d_qk: int, smem_limit: int) -> tuple[int, int]:
    """The first of ``TILES`` whose shared memory fits ``smem_limit`` bytes (a block's opt-in maximum)."""
    for block_n, stages in TILES:
        if shared_bytes(d_qk, block_n, stages) <= smem_limit:
            return block_n, stages
    raise ValueError(f"no tile of the mma_v2 prefill kernel fits {smem_limit} bytes of shared memory (d_qk {d_qk})")


def rows_aligned(t: torch.Tensor) -> bool:
    """Whether ``t``'s rows lie 16 bytes apart at a multiple of 16, contiguous along d (its address aside)."""
    return t.stride(-1) == 1 and not any(s * t.element_size() % 16 for s in t.stride()[:-1])


def check_rows(**tensors: torch.Tensor) -> None:
    """The kernels copy 16 bytes at a time: rows (and the tensors) 16-byte aligned, contiguous along d."""
    for name, t in tensors.items():
        if t.data_ptr() % 16 or not rows_aligned(t):
            raise ValueError(f"{name}: rows must be contiguous along the last dim and 16-byte aligned")


def _check(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, d_v: int, topk_length, attn_sink) -> None:
    if q.dim() != 3 or kv.dim() != 3 or indices.dim() != 3:
        raise ValueError("expected q [s_q, h_q, d_qk], kv [s_kv, 1, d_qk], indices [s_q, 1, topk]")
    s_q, h_q, d = q.shape
    if d not in (512, 576) or d_v != 512 or kv.shape[1:] != (1, d) or indices.shape[:2] != (s_q, 1):
        raise ValueError(f"shapes q {tuple(q.shape)}, kv {tuple(kv.shape)}, indices {tuple(indices.shape)}, "
                         f"d_v {d_v}: d_qk 512 or 576, d_v 512, one kv head")
    if q.dtype not in (torch.bfloat16, torch.float16) or kv.dtype != q.dtype or indices.dtype != torch.int32:
        raise ValueError(f"q {q.dtype}, kv {kv.dtype}, indices {indices.dtype}: bf16/fp16 for both, int32 indices")
    check_rows(q=q, kv=kv)
    if topk_length is not None and (topk_length.shape != (s_q,) or topk_length.dtype != torch.int32):
        raise ValueError("topk_length: expected [s_q] int32")
    if attn_sink is not None and (attn_sink.shape != (h_q,) or attn_sink.dtype != torch.float32):
        raise ValueError("attn_sink: expected [h_q] fp32")


class PrefillLaunch:
    """The kernel's launch for one call signature: q ``[s_q, h_q, d_qk]``, kv ``[s_kv, 1, d_qk]`` (16-bit, rows
    16-byte aligned), whether lengths and sinks come; ``tile`` ``(BLOCK_N, NUM_STAGES)`` instead of the
    device's ``choose_tile``."""

    def __init__(self, q: torch.Tensor, kv: torch.Tensor, has_len: bool, has_sink: bool,
                 tile: Optional[tuple[int, int]] = None):
        from .kernel import sparse_prefill_mma_v2_kernel  # Gluon: imported where it can run
        s_q, h_q, d = q.shape
        self.tile = tile or choose_tile(d, runtime.max_shared_memory(q.device))
        self.hb = triton.cdiv(h_q, HEADS)
        self.grid = (s_q * self.hb, 1, 1)
        self.constexprs = [d, has_len, has_sink, *self.tile, K_STEP]
        self.launcher = Launcher(sparse_prefill_mma_v2_kernel, num_warps=8)

    def __call__(self, q, kv, indices, topk_length, sink, sm_scale: float, out, lse, max_logits) -> None:
        """indices ``[s_q, 1, topk]`` (topk contiguous), topk_length ``[s_q]``; out ``[s_q, h_q, 512]``, lse and
        max_logits ``[s_q, h_q]``, contiguous. q is copied where its address is not 16-byte aligned (the kernel
        copies its rows 16 bytes at a time, and the signature does not key q's address)."""
        q = q if q.data_ptr() % 16 == 0 else q.clone()
        scale = sm_scale * math.log2(math.e)
        self.launcher.bind(self.grid, (q, kv, indices, topk_length, sink, out, lse, max_logits, scale), lambda: [
            q, q.stride(0), q.stride(1), kv, kv.stride(0), kv.shape[0], indices, indices.stride(0),
            indices.shape[-1], topk_length, sink, out, out.stride(0), out.stride(1), lse, max_logits, q.shape[1],
            self.hb, scale, *self.constexprs])


def sparse_prefill(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float, d_v: int = 512,
                   topk_length: Optional[torch.Tensor] = None,
                   attn_sink: Optional[torch.Tensor] = None, *,
                   tile: Optional[tuple[int, int]] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``flash_mla_sparse_fwd`` on the ``mma_v2`` kernel: ``(out [s_q, h_q, 512], max_logits, lse [s_q, h_q])``.
    ``tile``: ``(BLOCK_N, NUM_STAGES)`` instead of the device's ``choose_tile`` (tests run every tile on one GPU)."""
    _check(q, kv, indices, d_v, topk_length, attn_sink)
    s_q, h_q, d = q.shape
    indices = indices.contiguous()
    out = buffers.empty(s_q, h_q, 512, dtype=q.dtype, device=q.device)
    lse = buffers.empty(s_q, h_q, dtype=torch.float32, device=q.device)
    max_logits = buffers.empty(s_q, h_q, dtype=torch.float32, device=q.device)
    if s_q and h_q:
        PrefillLaunch(q, kv, topk_length is not None, attn_sink is not None, tile)(
            q, kv, indices, topk_length, attn_sink, sm_scale, out, lse, max_logits)
    return out, max_logits, lse
