"""Which calls the hand-written Ascend C kernel serves (its "hot shapes"), as a pure-Python predicate.

The kernel follows FlashMLA's Ascend 950 design: tiles of 64 query heads, d_qk = 512 (DeepSeek V4.1),
bf16 queries. Prefill gathers bf16 rows of ``kv`` (h_kv = 1); decoding gathers V4.1 FP8 rows
(528 B/token) from the main cache and optionally FP8 or FP4 (288 B/token) rows from an extra cache.
Decode folds s_q into the batch; any topk (the tail block is masked), topk_length and attn_sink.
Every other call goes to another backend; each reason names the value seen.
"""

from __future__ import annotations

import torch

from anymla.kvcache import KVCacheFormat

from .tiling import D_QK, HEADS_PER_TILE

_UINT32_MAX = 2 ** 32 - 1
_EXTRA_FORMATS = (KVCacheFormat.V41_FP8, KVCacheFormat.V41_FP4)


def _common_reasons(q: torch.Tensor, tokens: int, topk_total: int) -> list[str]:
    reasons = []
    if q.dtype != torch.bfloat16:
        reasons.append(f"q: the kernel multiplies bf16 operands only, got dtype {str(q.dtype).replace('torch.', '')}")
    d = q.shape[-1]
    if d != D_QK:
        reasons.append(f"q: the kernel serves d_qk = {D_QK} (DeepSeek V4.1), got d_qk = {d}")
    h_q = q.shape[-2]
    if h_q % HEADS_PER_TILE or h_q == 0:
        reasons.append(f"q: h_q must be a positive multiple of {HEADS_PER_TILE} (the kernel's head tile), "
                       f"got h_q = {h_q}")
    elif tokens * (h_q // HEADS_PER_TILE) > _UINT32_MAX:
        reasons.append(f"q: {tokens} tokens x {h_q // HEADS_PER_TILE} head tiles exceed the kernel's uint32 work count")
    if topk_total == 0:
        reasons.append("indices: topk is 0, nothing to gather (the reference returns the empty-row result)")
    return reasons


def _prefill_reasons(p) -> list[str]:
    s_q = p.q.shape[0]
    reasons = _common_reasons(p.q, s_q, p.indices.shape[-1])
    h_kv = p.kv.shape[1]
    if h_kv != 1:
        reasons.append(f"kv: the kernel gathers one latent row per index (h_kv = 1), got h_kv = {h_kv}")
    if p.kv.stride(-1) != 1:
        reasons.append(f"kv: the last dim must be contiguous (stride 1) for row gathers, got strides {p.kv.stride()}")
    return reasons


def _decode_reasons(p) -> list[str]:
    b, s_q = p.q.shape[:2]
    extra_topk = 0 if p.extra_indices is None else p.extra_indices.shape[-1]
    reasons = _common_reasons(p.q, b * s_q, p.indices.shape[-1] + extra_topk)
    if p.fmt is not KVCacheFormat.V41_FP8:
        reasons.append(f"k_cache: the kernel reads the V4.1 FP8 main cache (528 bytes per token), got {p.fmt.name} "
                       f"({p.k_cache.shape[-1]} per token)")
    extra = p.extra_fmt
    if extra is not None and extra not in _EXTRA_FORMATS:
        reasons.append(f"extra_k_cache: the kernel reads a V4.1 FP8 (528 B) or FP4 (288 B) extra cache, "
                       f"got {extra.name} ({p.extra_k_cache.shape[-1]} per token)")
    return reasons


def shape_reasons(problem) -> list[str]:
    """Why the Ascend C kernel does not serve ``problem`` (a validated record); empty when it does."""
    if problem.op == "sparse_prefill":
        return _prefill_reasons(problem)
    if problem.op == "sparse_decode":
        return _decode_reasons(problem)
    return [f"the Ascend C kernel serves sparse_prefill and sparse_decode, not {problem.op}"]
