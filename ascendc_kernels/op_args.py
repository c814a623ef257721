"""The kernel's token view: problem records -> arguments of ``anymla_ascendc::sparse_attention_v41``, and
the op's outputs -> what the reference returns.

One op serves prefill and decoding. A *token* is one query row: prefill's ``s_q`` tokens, decode's
``b * s_q`` (s_q folded into the batch, per-batch ``topk_length`` repeated per token). Every key source is
a paged cache ``[num_blocks, page_size, 1, row]``: decode caches as they are, prefill's ``kv [s_kv, 1, d]``
as ``s_kv`` pages of one row. An index is attended iff ``0 <= index < num_blocks * page_size`` and its
position is below the token's length, as in :mod:`anymla.reference`.
"""

from __future__ import annotations

from typing import Optional

import torch

from anymla.kvcache import detect_format
from anymla.problems import SparseDecode, SparsePrefill

from .tiling import KernelShape


def prefill_args(p: SparsePrefill) -> dict:
    return dict(q=p.q.contiguous(), kv=p.kv.unsqueeze(1), indices=p.indices[:, 0].contiguous(),
                topk_length=p.topk_length, extra_kv=None, extra_indices=None, extra_topk_length=None,
                attn_sink=p.attn_sink, sm_scale=float(p.sm_scale))


def decode_args(p: SparseDecode) -> dict:
    b, s_q, h_q, d = p.q.shape

    def per_token(length: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if length is None else length.repeat_interleave(s_q)

    def flat(indices: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if indices is None else indices.reshape(b * s_q, indices.shape[-1]).contiguous()

    return dict(q=p.q.reshape(b * s_q, h_q, d).contiguous(), kv=p.k_cache, indices=flat(p.indices),
                topk_length=per_token(p.topk_length), extra_kv=p.extra_k_cache, extra_indices=flat(p.extra_indices),
                extra_topk_length=per_token(p.extra_topk_length), attn_sink=p.attn_sink, sm_scale=float(p.sm_scale))


def decode_outputs(p: SparseDecode, out, max_logits, lse) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's ``(out, max_logits, lse)`` per token -> decode's ``(out [b, s_q, h_q, 512], lse [b, s_q, h_q])``.

    Prefill needs no such step: its tokens are already the op's tokens."""
    b, s_q, h_q, _ = p.q.shape
    return out.view(b, s_q, h_q, out.shape[-1]), lse.view(b, s_q, h_q)


def kernel_shape(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, extra_kv: Optional[torch.Tensor] = None,
                 extra_indices: Optional[torch.Tensor] = None, **_) -> KernelShape:
    """The :class:`KernelShape` of the op's arguments (accepts the whole argument dict as keywords)."""
    tokens, heads, _ = q.shape
    extra = extra_kv is not None
    return KernelShape(tokens, heads, indices.shape[-1], detect_format(kv),
                       extra_indices.shape[-1] if extra else 0, detect_format(extra_kv) if extra else None)
