"""The public, FlashMLA-compatible functions. Each builds a problem record and hands it to the dispatcher.

The path of a call: public function -> :mod:`anymla.problems` record -> :func:`anymla.selection.select`
(validate once per signature, pick a backend) -> ``backend.run(problem)``. Under ``torch.compile`` the call
becomes one ``torch.ops.anymla`` custom op (see :mod:`anymla.library_ops`) that takes this same path when
the compiled graph runs.
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Callable, Optional, Tuple, Union

import torch

from .metadata import FlashMLASchedMeta
from .problems import HEAD_DIM_V, DenseDecode, SparseDecode, SparsePrefill
from . import library_ops  # noqa: F401  (registers torch.ops.anymla.*)
from .selection import BackendChoice, Decision, select

__all__ = ["flash_mla_with_kvcache", "flash_mla_sparse_fwd", "explain"]

_EXPLAINING: contextvars.ContextVar[bool] = contextvars.ContextVar("anymla_explaining", default=False)


class _Explained(Exception):
    def __init__(self, decision: Decision, problem):
        self.decision = decision
        self.problem = problem


def _execute(problem, backend: BackendChoice):
    """Validate and select (cached per signature), bind the scheduling metadata's configuration (decode
    calls that pass metadata: this reads shapes, so only after validation) and run."""
    decision = select(problem, backend)
    if _EXPLAINING.get():
        raise _Explained(decision, problem)
    sched = getattr(problem, "sched", None)
    if sched is not None:
        sched.bind(_config(problem))
    return decision.impl.run(problem)


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = HEAD_DIM_V,
    attn_sink: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    *,
    backend: BackendChoice = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sparse attention prefill (DeepSeek Sparse Attention), as ``flash_mla.flash_mla_sparse_fwd``.

    Args:
        q: ``[s_q, h_q, d_qk]`` bf16 (or fp16); d_qk 576 (V3.2) or 512 (V4 family). Any h_q.
        kv: ``[s_kv, h_kv, d_qk]``, same dtype; h_q must be a multiple of h_kv (FlashMLA: h_kv = 1).
            V is the first ``d_v`` dims of each row.
        indices: ``[s_q, h_kv, topk]`` int32 rows of ``kv`` per query token; values ``< 0`` or ``>= s_kv``
            are invalid (skipped). Any topk, also larger than s_kv. Batch by flattening tokens and
            offsetting indices.
        sm_scale: softmax scale applied to ``q k^T``.
        d_v: must be 512.
        attn_sink: ``[h_q]`` fp32; scales out by ``1 / (1 + exp(sink - lse))`` (+inf -> out 0, -inf -> no-op).
        topk_length: ``[s_q]`` int32; only the leftmost ``topk_length[i]`` indices of token i count.
        backend: ``"reference"``, ``"triton"``, ... (or a list tried in order) to override the dispatcher.

    Returns:
        out ``[s_q, h_q, 512]`` (q's dtype), max_logits ``[s_q, h_q]`` fp32 (max of the scaled logits),
        lse ``[s_q, h_q]`` fp32 (natural log). A token with no valid index gets out 0, max_logits -inf,
        lse +inf.
    """
    if torch.compiler.is_compiling():
        return torch.ops.anymla.sparse_prefill(q, kv, indices, float(sm_scale), d_v, attn_sink, topk_length,
                                               _backend_arg(backend))
    return _execute(SparsePrefill(q, kv, indices, sm_scale, d_v, attn_sink, topk_length), backend)


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: Optional[torch.Tensor],
    cache_seqlens: Optional[torch.Tensor],
    head_dim_v: int,
    tile_scheduler_metadata: Optional[FlashMLASchedMeta],
    num_splits: None = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices_in_kvcache: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
    enable_batch_invariant: bool = False,
    *,
    backend: BackendChoice = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """MLA decoding over a paged KV cache, as ``flash_mla.flash_mla_with_kvcache`` (v1.0.0 + 2026-09-30).

    Dense (``indices is None``):
        q ``[b, s_q, h_q, d_qk]`` bf16/fp16, d_qk 576 or 512; k_cache ``[num_blocks, page_size, h_kv, d_qk]``
        in q's dtype (any page size, any h_kv dividing h_q); block_table ``[b, max_blocks_per_seq]`` int32;
        cache_seqlens ``[b]`` int32 (0 allowed). ``causal`` masks ``tril(diagonal = s_k - s_q)``.
    Sparse (``indices`` given, DeepSeek Sparse Attention):
        k_cache ``[num_blocks, page_size, 1, bytes_per_token]`` with the format told by its last dim (656 V3.2
        FP8, 584 MODEL1/V4 FP8, 528 V4.1 FP8, 288 V4.1 FP4; see :mod:`anymla.kvcache`) or a bf16 cache
        ``[num_blocks, page_size, 1, d_qk]``; indices ``[b, s_q, topk]`` int32 slots
        ``block * page_size + offset`` (-1 and any out-of-range value are skipped); topk_length ``[b]``;
        attn_sink ``[h_q]`` fp32; extra_k_cache / extra_indices_in_kvcache ``[b, s_q, extra_topk]`` /
        extra_topk_length ``[b]``: a second cache with its own page size, one softmax over both.
        block_table and cache_seqlens are ignored.

    Args:
        head_dim_v: must be 512.
        tile_scheduler_metadata: from :func:`get_mla_metadata`; reuse it for every call of one configuration.
        num_splits: must be None (anymla schedules splits itself).
        softmax_scale: default ``d_qk ** -0.5``.
        is_fp8_kvcache: True for quantized caches (the format itself is read from the cache).
        enable_batch_invariant: results that do not depend on the rest of the batch (no split across
            the batch-dependent schedule).
        backend: override the dispatcher (see :func:`anymla.use_backend`).

    Returns:
        out ``[b, s_q, h_q, 512]`` in q's dtype and lse ``[b, h_q, s_q]`` fp32 (natural log; +inf for a query
        with no attendable key, whose out is 0). For sparse decoding lse is a transposed view of a
        contiguous ``[b, s_q, h_q]`` buffer, as in FlashMLA.
    """
    if num_splits is not None:
        raise ValueError("num_splits: must be None (FlashMLA v1.0.0 semantics; anymla computes its own splits), "
                         f"got {type(num_splits).__name__}")
    if tile_scheduler_metadata is not None and not isinstance(tile_scheduler_metadata, FlashMLASchedMeta):
        raise TypeError("tile_scheduler_metadata: expected the FlashMLASchedMeta from anymla.get_mla_metadata(), "
                        f"got {type(tile_scheduler_metadata).__name__}")
    if softmax_scale is None and isinstance(q, torch.Tensor):  # else validation reports q
        softmax_scale = q.shape[-1] ** -0.5
    if torch.compiler.is_compiling():
        return _compiled_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, indices,
                                attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length, extra_topk_length,
                                enable_batch_invariant, backend)
    if indices is None:
        for name, value in (("topk_length", topk_length), ("extra_k_cache", extra_k_cache),
                            ("extra_indices_in_kvcache", extra_indices_in_kvcache),
                            ("extra_topk_length", extra_topk_length)):
            if value is not None:
                raise ValueError(f"{name}: only sparse decoding (with indices) takes it; got it without indices")
        if is_fp8_kvcache:
            raise ValueError("is_fp8_kvcache: dense decoding (no indices) needs a bf16/fp16 cache; "
                             "FP8 caches are decoded sparsely (pass indices)")
        problem = DenseDecode(q, k_cache, block_table, cache_seqlens, softmax_scale, head_dim_v, bool(causal),
                              attn_sink, bool(enable_batch_invariant), tile_scheduler_metadata)
        return _execute(problem, backend)
    if causal:
        raise ValueError("causal: sparse decoding (with indices) has no causal mask; got causal=True")
    problem = SparseDecode(q, k_cache, indices, softmax_scale, head_dim_v, attn_sink, topk_length, extra_k_cache,
                           extra_indices_in_kvcache, extra_topk_length, is_fp8_kvcache, bool(enable_batch_invariant),
                           tile_scheduler_metadata)
    out, lse = _execute(problem, backend)
    return out, lse.transpose(1, 2)


def _backend_arg(backend: BackendChoice) -> str:
    """Custom ops take the explicit choice as a string; "" selects at run time, inside the op."""
    return "" if backend is None else (backend if isinstance(backend, str) else ",".join(backend))


def _compiled_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, indices, attn_sink,
                     extra_k_cache, extra_indices, topk_length, extra_topk_length, batch_invariant, backend):
    """Decoding under torch.compile: one opaque custom op (no scheduling metadata; plans are per call)."""
    if indices is None:
        return torch.ops.anymla.dense_decode(q, k_cache, block_table, cache_seqlens, float(softmax_scale), head_dim_v,
                                             bool(causal), attn_sink, bool(batch_invariant), _backend_arg(backend))
    out, lse = torch.ops.anymla.sparse_decode(q, k_cache, indices, float(softmax_scale), head_dim_v, attn_sink,
                                              topk_length, extra_k_cache, extra_indices, extra_topk_length,
                                              bool(batch_invariant), _backend_arg(backend))
    return out, lse.transpose(1, 2)


def _config(p) -> FlashMLASchedMeta.Config:
    """The FlashMLA configuration of a validated decode problem (what a metadata object is bound to)."""
    b, s_q, h_q, _ = p.q.shape
    sparse = p.op == "sparse_decode"
    extra = p.extra_k_cache if sparse else None
    return FlashMLASchedMeta.Config(
        b=b, s_q=s_q, h_q=h_q, page_block_size=p.k_cache.shape[1], h_k=p.k_cache.shape[2],
        causal=not sparse and p.causal, is_fp8_kvcache=sparse and p.fmt.is_quantized,
        topk=p.indices.shape[-1] if sparse else None,
        extra_page_block_size=None if extra is None else extra.shape[1],
        extra_topk=None if extra is None else p.extra_indices.shape[-1],
        enable_batch_invariant=p.batch_invariant)


_OPS: dict[str, Callable] = {"flash_mla_with_kvcache": flash_mla_with_kvcache,
                             "flash_mla_sparse_fwd": flash_mla_sparse_fwd}


def explain(op: Union[str, Callable], *args, **kwargs) -> Decision:
    """The decision the dispatcher makes for ``op(*args, **kwargs)``, without running it.

    ``op`` is :func:`flash_mla_with_kvcache` or :func:`flash_mla_sparse_fwd` (or its name). The returned
    :class:`~anymla.selection.Decision` is the call's (cached) decision plus, where the chosen backend has
    several kernels, the one it would run for these arguments and why; ``print()`` it to read the chosen
    backend, the kernel, and why each other backend was not chosen. Bad arguments raise as the call would.
    """
    fn = _OPS.get(op) if isinstance(op, str) else op
    if fn not in _OPS.values():
        raise ValueError(f"op: expected one of {', '.join(_OPS)} (or the function), got {op!r}")
    token = _EXPLAINING.set(True)
    try:
        fn(*args, **kwargs)
    except _Explained as done:
        return dataclasses.replace(done.decision, kernel=done.decision.impl.kernel(done.problem))
    finally:
        _EXPLAINING.reset(token)
    raise RuntimeError("explain: the op returned without reaching the dispatcher")
