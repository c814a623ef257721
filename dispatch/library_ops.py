"""``torch.ops.anymla.*``: the public functions as torch.library custom ops, so ``torch.compile`` can trace a
model that calls anymla (the public functions become one of these ops when traced). Eager calls do not come
here: the dispatcher calls backends directly, which costs less host time.

Each op builds the same problem record as the eager call. Its fake implementation validates that record
(signature and values) while tracing static shapes, so a compiled call rejects exactly what an eager call
rejects, with the same message, before anything runs; when the compiled graph runs, the op validates and
dispatches exactly like an eager call (so dynamic shapes are checked then). ``backend`` is the explicit choice (``""`` = automatic: the ``use_backend``
context and ``ANYMLA_BACKEND`` still apply).
"""

from __future__ import annotations

from typing import Optional

import torch

from .problems import SparsePrefill, decode_problem
from .selection import select

Tensor = torch.Tensor


def _run(problem, backend: str):
    """Custom ops may not return views of their inputs or of each other: any output that shares memory (a
    part of a larger allocation, or another output's) goes back as a copy. Told by storage, not ``_base``:
    views made under inference mode have none."""
    decision = select(problem, backend or None)
    fresh, taken = [], set()
    for t in decision.run(problem):
        storage = t.untyped_storage()
        if storage.data_ptr() in taken or storage.nbytes() != t.numel() * t.element_size():
            t = t.clone()
        taken.add(t.untyped_storage().data_ptr())
        fresh.append(t)
    return tuple(fresh)


def _checked(problem):
    """Validate while tracing. With symbolic (dynamic) shapes the checks wait for the run, where the op's
    eager path makes them: they compare concrete sizes."""
    tensors = [v for v in vars(problem).values() if isinstance(v, torch.Tensor)]
    if all(isinstance(n, int) for t in tensors for n in (*t.shape, *t.stride())):
        problem.validate()
        problem.check_values()


@torch.library.custom_op("anymla::sparse_prefill", mutates_args=())
def sparse_prefill(q: Tensor, kv: Tensor, indices: Tensor, sm_scale: float, d_v: int, attn_sink: Optional[Tensor],
                   topk_length: Optional[Tensor], backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return _run(SparsePrefill(q, kv, indices, sm_scale, d_v, attn_sink, topk_length), backend)


@sparse_prefill.register_fake
def _(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, backend):
    _checked(SparsePrefill(q, kv, indices, sm_scale, d_v, attn_sink, topk_length))
    s_q, h_q, _ = q.shape
    return q.new_empty(s_q, h_q, d_v), q.new_empty(s_q, h_q, dtype=torch.float32), \
        q.new_empty(s_q, h_q, dtype=torch.float32)


@torch.library.custom_op("anymla::decode", mutates_args=())
def decode(q: Tensor, k_cache: Tensor, block_table: Optional[Tensor], cache_seqlens: Optional[Tensor], head_dim_v: int,
           softmax_scale: Optional[float], causal: bool, is_fp8_kvcache: bool, indices: Optional[Tensor],
           attn_sink: Optional[Tensor], extra_k_cache: Optional[Tensor], extra_indices: Optional[Tensor],
           topk_length: Optional[Tensor], extra_topk_length: Optional[Tensor], batch_invariant: bool,
           backend: str) -> tuple[Tensor, Tensor]:
    """``flash_mla_with_kvcache`` without scheduling metadata (plans are per signature). Returns out
    ``[b, s_q, h_q, d_v]`` and lse ``[b, h_q, s_q]`` (dense) or ``[b, s_q, h_q]`` (sparse: the public API
    returns its transposed view)."""
    return _run(decode_problem(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal,
                               is_fp8_kvcache, indices, attn_sink, extra_k_cache, extra_indices, topk_length,
                               extra_topk_length, batch_invariant, None), backend)


@decode.register_fake
def _(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, is_fp8_kvcache, indices, attn_sink,
      extra_k_cache, extra_indices, topk_length, extra_topk_length, batch_invariant, backend):
    _checked(decode_problem(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, is_fp8_kvcache,
                            indices, attn_sink, extra_k_cache, extra_indices, topk_length, extra_topk_length,
                            batch_invariant, None))
    b, s_q, h_q, _ = q.shape
    lse_shape = (b, h_q, s_q) if indices is None else (b, s_q, h_q)
    return q.new_empty(b, s_q, h_q, head_dim_v), q.new_empty(*lse_shape, dtype=torch.float32)
