"""PyTorch reference: the oracle every tier is tested against, and a real backend on any torch device.

Math in fp32 (FlashMLA's ``tests/ref.py`` recipe): gather rows, ``P = q k^T sm_scale``, invalid keys -> -inf,
``lse = logsumexp(P)`` (natural log), ``out = softmax(P) V`` with V the first 512 dims of each row, the sink
factor ``1 / (1 + exp(sink - lse))``, and rows with no attendable key give out 0, lse +inf, max_logits -inf.
Invalid rows are zeroed before any product so NaN in unreferenced memory cannot leak. Work is chunked over
query tokens so ``[tokens, topk, d]`` gathers stay within a fixed memory budget (one request per chunk when
batch invariance is asked for).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import buffers
from .kvcache import KVCacheFormat, gather_rows
from .problems import DenseDecode, SparseDecode, SparsePrefill

_GATHER_BUDGET_BYTES = 256 << 20


def attend(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sm_scale: float, d_v: int,
           attn_sink: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of each token's heads over that token's own keys, in fp32.

    Args:
        q: ``[N, H, D]``; keys: ``[N, K, D]``; valid: ``[N, K]`` (same for every head) or ``[N, H, K]`` bool.
        attn_sink: ``[H]`` fp32 or None.
    Returns:
        out ``[N, H, d_v]`` fp32, lse ``[N, H]`` (natural log, +inf when empty), max_logits ``[N, H]`` (-inf when empty).
    """
    n, h = q.shape[:2]
    if keys.shape[1] == 0:
        return (q.new_zeros(n, h, d_v, dtype=torch.float32), q.new_full((n, h), float("inf"), dtype=torch.float32),
                q.new_full((n, h), float("-inf"), dtype=torch.float32))
    mask = valid[:, None, :] if valid.dim() == 2 else valid
    keys = torch.where(valid[..., None] if valid.dim() == 2 else valid.any(1)[..., None], keys.float(), 0.0)
    scores = torch.einsum("nhd,nkd->nhk", q.float(), keys) * sm_scale
    scores = scores.masked_fill(~mask, float("-inf"))
    max_logits = scores.amax(-1)
    lse = torch.logsumexp(scores, -1)
    empty = torch.isneginf(lse)
    probs = torch.exp(scores - torch.where(empty, 0.0, lse)[..., None])
    out = torch.einsum("nhk,nkd->nhd", probs, keys[..., :d_v])
    if attn_sink is not None:
        out = out * torch.sigmoid(lse - attn_sink.float())[..., None]
    out = torch.where(empty[..., None], 0.0, out)
    return out, torch.where(empty, float("inf"), lse), max_logits


def _token_chunk(k: int, d: int) -> int:
    return max(1, _GATHER_BUDGET_BYTES // max(1, k * d * 4))


def _masked_slots(indices: torch.Tensor, n_rows: int, length: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots with invalid entries replaced by 0, validity) for ``indices [..., topk]``; ``length`` broadcasts."""
    valid = (indices >= 0) & (indices < n_rows)
    if length is not None:
        valid &= torch.arange(indices.shape[-1], device=indices.device) < length[..., None]
    return torch.where(valid, indices, 0), valid


def sparse_prefill(p: SparsePrefill) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s_q, h_q, d = p.q.shape
    s_kv, h_kv, _ = p.kv.shape
    group = h_q // h_kv
    topk = p.indices.shape[-1]
    out = buffers.empty(s_q, h_q, p.d_v, dtype=p.q.dtype, device=p.device)
    lse = buffers.empty(s_q, h_q, dtype=torch.float32, device=p.device)
    max_logits = buffers.empty(*lse.shape, dtype=lse.dtype, device=lse.device)
    length = None if p.topk_length is None else p.topk_length[:, None]
    step = _token_chunk(topk, d)
    for t0 in range(0, s_q, step):
        t = slice(t0, min(s_q, t0 + step))
        slots, valid = _masked_slots(p.indices[t], s_kv, None if length is None else length[t])
        for g in range(h_kv):
            heads = slice(g * group, (g + 1) * group)
            keys = p.kv[:, g][slots[:, g]] if s_kv else p.kv.new_zeros(*slots[:, g].shape, d)
            sink = None if p.attn_sink is None else p.attn_sink[heads]
            o, l, m = attend(p.q[t, heads], keys, valid[:, g], p.sm_scale, p.d_v, sink)
            out[t, heads], lse[t, heads], max_logits[t, heads] = o.to(out.dtype), l, m
    return out, max_logits, lse


def _cache_rows(cache: torch.Tensor) -> int:
    return cache.shape[0] * cache.shape[1]


def sparse_decode(p: SparseDecode) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns out ``[b, s_q, h_q, 512]`` and lse ``[b, s_q, h_q]`` (contiguous; the API transposes)."""
    b, s_q, h_q, d = p.q.shape
    q = p.q.reshape(b * s_q, h_q, d)

    def flat(t: Optional[torch.Tensor]):
        return None if t is None else t.reshape(b * s_q, t.shape[-1])

    def per_token(length: Optional[torch.Tensor]):
        return None if length is None else length.repeat_interleave(s_q)

    parts = [(p.k_cache, p.fmt, flat(p.indices), per_token(p.topk_length))]
    if p.extra_k_cache is not None:
        parts.append((p.extra_k_cache, p.extra_fmt, flat(p.extra_indices), per_token(p.extra_topk_length)))
    topk = sum(part[2].shape[-1] for part in parts)
    out = buffers.empty(b * s_q, h_q, p.d_v, dtype=p.q.dtype, device=p.device)
    lse = buffers.empty(b * s_q, h_q, dtype=torch.float32, device=p.device)
    step = _token_chunk(topk, d)
    if p.batch_invariant:
        # One request per chunk: the shapes of every product, hence the library kernels that compute them
        # and their summation order, then never depend on the rest of the batch.
        step = s_q
    for t0 in range(0, b * s_q, step):
        t = slice(t0, min(b * s_q, t0 + step))
        keys, valid = [], []
        for cache, fmt, idx, length in parts:
            slots, ok = _masked_slots(idx[t], _cache_rows(cache), None if length is None else length[t])
            rows = gather_rows(cache, slots, fmt)
            keys.append(rows[..., 0, :] if fmt is KVCacheFormat.BF16 else rows)
            valid.append(ok)
        o, l, _ = attend(q[t], torch.cat(keys, 1), torch.cat(valid, 1), p.sm_scale, p.d_v, p.attn_sink)
        out[t], lse[t] = o.to(out.dtype), l
    return out.view(b, s_q, h_q, p.d_v), lse.view(b, s_q, h_q)


def dense_decode(p: DenseDecode) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns out ``[b, s_q, h_q, 512]`` and lse ``[b, h_q, s_q]``."""
    b, s_q, h_q, d = p.q.shape
    page, h_kv = p.k_cache.shape[1], p.k_cache.shape[2]
    group = h_q // h_kv
    out = buffers.empty(b, s_q, h_q, p.d_v, dtype=p.q.dtype, device=p.device)
    lse = buffers.empty(b, h_q, s_q, dtype=torch.float32, device=p.device)
    capacity = p.block_table.shape[1] * page  # a length past its block-table row is cut to the row (kernels too)
    for i, s_k in enumerate(p.cache_seqlens.clamp(max=capacity).tolist()):
        pos = torch.arange(s_k, device=p.device)
        blocks = p.block_table[i, pos // page].long()
        keys = p.k_cache[blocks, pos % page]  # [s_k, h_kv, d]
        valid = torch.ones(s_q, s_k, dtype=torch.bool, device=p.device)
        if p.causal and s_q > 1:
            valid = torch.tril(valid, diagonal=s_k - s_q)
        for g in range(h_kv):
            heads = slice(g * group, (g + 1) * group)
            sink = None if p.attn_sink is None else p.attn_sink[heads]
            o, l, _ = attend(p.q[i, :, heads], keys[None, :, g].expand(s_q, s_k, d),
                             valid[:, None, :].expand(s_q, group, s_k), p.sm_scale, p.d_v, sink)
            out[i, :, heads], lse[i, heads] = o.to(out.dtype), l.transpose(0, 1)
    return out, lse
