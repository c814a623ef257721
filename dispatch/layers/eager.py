"""The MLA layer's math in plain eager PyTorch ops (no anymla kernel, no fusion): the baseline the layer's
benchmark compares against, and a second oracle for the layer's tests."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..kvcache import KVCacheFormat, cache_slots, detect_format, gather_rows
from .attention import MLAAttention
from .cache_write import _write_reference
from .prolog import rms_norm
from .rope import apply_rope

__all__ = ["mla_forward_eager"]


def mla_forward_eager(layer: MLAAttention, hidden_states: torch.Tensor, positions: torch.Tensor,
                      kv_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor, *,
                      indices: Optional[torch.Tensor] = None, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """What :meth:`MLAAttention.forward` computes (same arguments, same cache writes), as eager torch ops:
    RMSNorm and RoPE op by op, the reference cache writer, and attention as gather + matmul + softmax (fp32)
    over every candidate key (every position up to the query's, or ``indices``)."""
    c, h = layer.config, layer.config.num_heads
    b, s, _ = hidden_states.shape
    t, dtype, page = b * s, hidden_states.dtype, kv_cache.shape[1]
    fmt = detect_format(kv_cache, "kv_cache")
    x = hidden_states.reshape(t, c.hidden_size)
    pos = positions.reshape(t)
    rope = layer.rope

    a = F.linear(x, layer.w_qkv_a, layer.b_qkv_a)
    r = c.q_lora_rank or 0
    latent = rms_norm(a[:, r:r + 512], layer.kv_norm_weight, c.kv_norm_eps)
    k_pe = apply_rope(a[:, r + 512:], pos, rope)
    _write_reference(kv_cache, fmt, torch.cat([latent.float(), k_pe], -1),
                     cache_slots(positions, block_table, page).reshape(t))

    q_in = rms_norm(a[:, :r], layer.q_norm_weight, c.q_norm_eps) if r else x
    q = F.linear(q_in, layer.w_q).view(t, h, c.qk_head_dim)
    q_abs = torch.einsum("thn,hnc->thc", q[..., : c.qk_nope_head_dim], layer.w_uk)
    q_pe = apply_rope(q[..., c.qk_nope_head_dim:], pos[:, None], rope).to(dtype)
    q_full = torch.cat([q_abs, q_pe], -1).view(b, s, h, c.d_qk)

    if indices is None:
        capacity = block_table.shape[1] * page
        indices = torch.arange(capacity, device=x.device).expand(b, s, capacity)
    skip = (indices < 0) | (indices > positions[..., None])
    rows = gather_rows(kv_cache, cache_slots(torch.where(skip, 0, indices), block_table, page), fmt)
    if fmt is KVCacheFormat.BF16:
        rows = rows[..., 0, :]
    rows = rows.float()
    logits = torch.einsum("bshd,bsld->bshl", q_full.float(), rows) * layer.softmax_scale
    logits = logits.masked_fill(skip[:, :, None, :], float("-inf"))
    o = torch.einsum("bshl,bsld->bshd", torch.softmax(logits, -1), rows[..., :512]).to(dtype)

    o_v = torch.einsum("thc,hcv->thv", o.reshape(t, h, 512), layer.w_uv_t).reshape(t, h * c.v_head_dim)
    out = F.linear(o_v, layer.w_o, layer.b_o)
    if residual is not None:
        out = out + residual.reshape(t, c.hidden_size)
    return out.view(b, s, c.hidden_size)
