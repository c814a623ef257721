"""The public, FlashMLA-compatible functions. Each builds a problem record and hands it to the dispatcher.

The path of a call: the compiled entry point (:mod:`anymla.callpath`: a call whose key it has seen runs there,
in C++) or else public function -> :mod:`anymla.problems` record -> :func:`anymla.selection.select`
(validate and plan once per signature, check the values on every call) -> ``decision.run(problem)``: the
chosen backend launches with the cached plan, watched the first time to make the entry. Under ``torch.compile`` the call becomes one ``torch.ops.anymla``
custom op (see :mod:`anymla.library_ops`) that builds the same record and takes this same path when the
compiled graph runs; its fake implementation runs the same validation while tracing.
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Tuple, Union

import torch

from . import callpath
from .buffers import poisoning
from .metadata import FlashMLASchedMeta
from .problems import HEAD_DIM_V, SparsePrefill, check_num_splits, check_scale, decode_problem
from . import library_ops  # noqa: F401  (registers torch.ops.anymla.*)
from .selection import BackendChoice, Decision, select

__all__ = ["flash_mla_with_kvcache", "flash_mla_sparse_fwd", "explain"]


def _execute(decision: Decision, problem):
    """Run ``problem`` with its decision; decode calls that pass metadata bind it first (its configuration is
    fixed by the signature, so the decision carries it)."""
    sched = getattr(problem, "sched", None)
    if sched is not None:
        sched.bind(decision.sched_config)
    return decision.run(problem)


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
        _check_scale_type("sm_scale", sm_scale)
        return torch.ops.anymla.sparse_prefill(q, kv, indices, sm_scale, d_v, attn_sink, topk_length,
                                               _backend_arg(backend))
    entry = callpath.entry_point(backend)
    if entry is not None:
        outputs = entry[0](callpath.PREFILL, poisoning(), None, entry[1], q, kv, indices, sm_scale, d_v, attn_sink,
                           topk_length)
        if outputs is not None:
            return outputs
    problem = SparsePrefill(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
    decision = select(problem, backend)
    if not callpath.recording(q.device):
        return _execute(decision, problem)
    return callpath.record(entry, decision, callpath.PREFILL, problem,
                           (q, kv, indices, sm_scale, d_v, attn_sink, topk_length), lambda: _execute(decision, problem))


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
    if torch.compiler.is_compiling():
        check_num_splits(num_splits)
        if softmax_scale is not None:
            _check_scale_type("softmax_scale", softmax_scale)
        out, lse = torch.ops.anymla.decode(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale,
                                           bool(causal), bool(is_fp8_kvcache), indices, attn_sink, extra_k_cache,
                                           extra_indices_in_kvcache, topk_length, extra_topk_length,
                                           bool(enable_batch_invariant), _backend_arg(backend))
        return (out, lse) if indices is None else (out, lse.transpose(1, 2))
    entry = callpath.entry_point(backend)
    if entry is not None:
        outputs = entry[0](callpath.DECODE, poisoning(), tile_scheduler_metadata, entry[1], q, k_cache, block_table,
                           cache_seqlens, head_dim_v, num_splits, softmax_scale, causal, is_fp8_kvcache, indices,
                           attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length, extra_topk_length,
                           enable_batch_invariant)
        if outputs is not None:
            return outputs
    problem = decode_problem(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal,
                             is_fp8_kvcache, indices, attn_sink, extra_k_cache, extra_indices_in_kvcache,
                             topk_length, extra_topk_length, enable_batch_invariant, tile_scheduler_metadata,
                             num_splits)
    decision = select(problem, backend)
    if not callpath.recording(q.device):
        return _decode_outputs(_execute(decision, problem), indices)
    return callpath.record(entry, decision, callpath.DECODE, problem, (
        q, k_cache, block_table, cache_seqlens, head_dim_v, num_splits, softmax_scale, causal, is_fp8_kvcache, indices,
        attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length, extra_topk_length, enable_batch_invariant),
        lambda: _decode_outputs(_execute(decision, problem), indices))


def _decode_outputs(outputs: tuple, indices) -> Tuple[torch.Tensor, torch.Tensor]:
    """A decoding call's (out, lse): sparse decoding's lse is [b, s_q, h_q], returned as its transpose(1, 2) (`.mT`,
    without the argument parsing: ~0.3 µs less a call), as FlashMLA returns it."""
    out, lse = outputs
    return (out, lse) if indices is None else (out, lse.mT)


def _check_scale_type(name: str, value) -> None:
    """Under torch.compile: a scale the op's float schema would reject with a message of its own is reported
    here, as the eager call reports it (the op's fake implementation checks the value itself)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        check_scale(name, value)


def _backend_arg(backend: BackendChoice) -> str:
    """Custom ops take the explicit choice as a string; "" selects at run time, inside the op."""
    return "" if backend is None else (backend if isinstance(backend, str) else ",".join(backend))


_OPS: dict[str, Callable] = {"flash_mla_with_kvcache": flash_mla_with_kvcache,
                             "flash_mla_sparse_fwd": flash_mla_sparse_fwd}


def explain(op: Union[str, Callable], *args, backend: BackendChoice = None, **kwargs) -> Decision:
    """The decision the dispatcher makes for ``op(*args, **kwargs)``, without running it.

    ``op`` is :func:`flash_mla_with_kvcache` or :func:`flash_mla_sparse_fwd` (or its name). The returned
    :class:`~anymla.selection.Decision` is the very object the call would run with: the chosen backend, its
    kernel and why (from the launch plan), how far it was verified on the device, and why each other backend
    was not chosen; ``print()`` it. Bad arguments raise as the call would.
    """
    fn = _OPS.get(op) if isinstance(op, str) else op
    if fn not in _OPS.values():
        raise ValueError(f"op: expected one of {', '.join(_OPS)} (or the function), got {op!r}")
    return select(_problem(fn, args, kwargs), backend)


def _problem(fn: Callable, args: tuple, kwargs: dict):
    """The record ``fn(*args, **kwargs)`` would build (its arguments checked as the call checks them)."""
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    if fn is flash_mla_sparse_fwd:
        return SparsePrefill(a["q"], a["kv"], a["indices"], a["sm_scale"], a["d_v"], a["attn_sink"], a["topk_length"])
    return decode_problem(a["q"], a["k_cache"], a["block_table"], a["cache_seqlens"], a["head_dim_v"],
                          a["softmax_scale"], a["causal"], a["is_fp8_kvcache"], a["indices"], a["attn_sink"],
                          a["extra_k_cache"], a["extra_indices_in_kvcache"], a["topk_length"], a["extra_topk_length"],
                          a["enable_batch_invariant"], a["tile_scheduler_metadata"], a["num_splits"])
