"""``torch.ops.anymla.*``: the three ops as torch.library custom ops with fake (meta) implementations, so
``torch.compile`` can trace a model that calls anymla (the public functions become one of these ops when
traced). Eager calls do not come here: the dispatcher calls backends directly, which costs less host time.
When a compiled graph runs, each op validates and dispatches exactly like an eager call; ``backend`` is the
explicit choice (``""`` = automatic, the ``use_backend`` context and ``ANYMLA_BACKEND`` still apply).
"""

from __future__ import annotations

from typing import Optional

import torch

from .problems import DenseDecode, SparseDecode, SparsePrefill
from .selection import select

Tensor = torch.Tensor


def _run(problem, backend: str):
    # Custom ops may not return views of their inputs or of each other: hand back fresh tensors.
    outs = select(problem, backend or None).impl.run(problem)
    return tuple(t.clone() if t._base is not None else t for t in outs)


@torch.library.custom_op("anymla::sparse_prefill", mutates_args=())
def sparse_prefill(q: Tensor, kv: Tensor, indices: Tensor, sm_scale: float, d_v: int, attn_sink: Optional[Tensor],
                   topk_length: Optional[Tensor], backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return _run(SparsePrefill(q, kv, indices, sm_scale, d_v, attn_sink, topk_length), backend)


@sparse_prefill.register_fake
def _(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, backend):
    s_q, h_q, _ = q.shape
    return q.new_empty(s_q, h_q, d_v), q.new_empty(s_q, h_q, dtype=torch.float32), \
        q.new_empty(s_q, h_q, dtype=torch.float32)


@torch.library.custom_op("anymla::sparse_decode", mutates_args=())
def sparse_decode(q: Tensor, k_cache: Tensor, indices: Tensor, sm_scale: float, d_v: int, attn_sink: Optional[Tensor],
                  topk_length: Optional[Tensor], extra_k_cache: Optional[Tensor], extra_indices: Optional[Tensor],
                  extra_topk_length: Optional[Tensor], batch_invariant: bool, backend: str) -> tuple[Tensor, Tensor]:
    """Returns out ``[b, s_q, h_q, d_v]`` and lse ``[b, s_q, h_q]`` (the public API transposes the view)."""
    return _run(SparseDecode(q, k_cache, indices, sm_scale, d_v, attn_sink, topk_length, extra_k_cache, extra_indices,
                             extra_topk_length, None, batch_invariant), backend)


@sparse_decode.register_fake
def _(q, k_cache, indices, sm_scale, d_v, attn_sink, topk_length, extra_k_cache, extra_indices, extra_topk_length,
      batch_invariant, backend):
    b, s_q, h_q, _ = q.shape
    return q.new_empty(b, s_q, h_q, d_v), q.new_empty(b, s_q, h_q, dtype=torch.float32)


@torch.library.custom_op("anymla::dense_decode", mutates_args=())
def dense_decode(q: Tensor, k_cache: Tensor, block_table: Tensor, cache_seqlens: Tensor, sm_scale: float, d_v: int,
                 causal: bool, attn_sink: Optional[Tensor], batch_invariant: bool, backend: str) -> tuple[Tensor, Tensor]:
    """Returns out ``[b, s_q, h_q, d_v]`` and lse ``[b, h_q, s_q]``."""
    return _run(DenseDecode(q, k_cache, block_table, cache_seqlens, sm_scale, d_v, causal, attn_sink, batch_invariant),
                backend)


@dense_decode.register_fake
def _(q, k_cache, block_table, cache_seqlens, sm_scale, d_v, causal, attn_sink, batch_invariant, backend):
    b, s_q, h_q, _ = q.shape
    return q.new_empty(b, s_q, h_q, d_v), q.new_empty(b, h_q, s_q, dtype=torch.float32)
