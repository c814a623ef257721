"""The three problems anymla solves, as validated argument records that every backend receives.

A public call builds one record (decoding through :func:`decode_problem`); its :meth:`signature` (shapes,
dtypes, devices, strides and flags) keys the dispatcher's decision cache. Validation has three parts, all here:
:meth:`validate` checks what the signature fixes (once per signature), :meth:`check_values` what it does not
(scalars such as the softmax scale: every call), and :meth:`check_data` what needs the tensors' contents
(index ranges, block tables long enough for ``cache_seqlens``: only in debug mode, see :mod:`anymla.debug`).
The eager path, the ``torch.compile`` custom ops and ``explain()`` all go through these.
Bad input raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong shape, value or device) naming
the argument, what was expected and what came.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .kvcache import KVCacheFormat, detect_format
from .metadata import FlashMLASchedMeta

HEAD_DIM_V = 512
_INT32_MAX = 2 ** 31 - 1
_FLOAT_DTYPES = (torch.bfloat16, torch.float16)
_Tensor = torch.Tensor  # a module global: one attribute lookup less per tensor of every call


def _tensor_sig(t: Optional[torch.Tensor]):
    """A tensor's part of a signature, read anew on every call (``resize_`` and ``as_strided_`` change it in
    place); an argument of another kind keys by its type, so validation reports it. None, the commonest
    optional argument, is tested first."""
    if t is None:
        return None
    return (t.shape, t.dtype, t.device, t.stride()) if isinstance(t, _Tensor) else type(t)


def _cache_sig(t: Optional[torch.Tensor]):
    """A kv cache's part of a signature: as :func:`_tensor_sig`, and whether its address is 16-byte aligned,
    which decides whether the Hopper kernels (16-byte copies, tensor-memory descriptors) can read it: a view
    of the same shape and strides at another offset must get a plan of its own."""
    if t is None:
        return None
    return (t.shape, t.dtype, t.device, t.stride(), t.data_ptr() % 16 == 0) if isinstance(t, _Tensor) else type(t)


def _need_tensor(name: str, t, ndim: int, dims_doc: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor {dims_doc}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims {dims_doc}, got shape {tuple(t.shape)}")


def _need_dtype(name: str, t: torch.Tensor, dtypes: tuple) -> None:
    if t.dtype not in dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: expected dtype {names}, got {str(t.dtype).replace('torch.', '')}")


def _need_shape(name: str, t: torch.Tensor, expected: tuple, dims_doc: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {dims_doc} = {tuple(expected)}, got {tuple(t.shape)}")


def _need_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} (the device of q), got one on {t.device}")


def _need_int32_strides(name: str, t: torch.Tensor) -> None:
    if any(abs(s) > _INT32_MAX for s in t.stride()):
        raise ValueError(f"{name}: strides must fit in int32 (at most {_INT32_MAX} elements), got {t.stride()}")


def _check_optional_vector(name: str, t, length: int, dtype: torch.dtype, device, doc: str) -> None:
    if t is None:
        return
    _need_tensor(name, t, 1, doc)
    _need_dtype(name, t, (dtype,))
    _need_shape(name, t, (length,), doc)
    _need_device(name, t, device)


def check_scale(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a Python float, got {type(value).__name__}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name}: expected a positive finite scale, got {value}")


def _check_head_dim_v(name: str, value) -> None:
    if value != HEAD_DIM_V:
        raise ValueError(f"{name}: only {HEAD_DIM_V} is supported (the MLA latent width), got {value}")


def _check_d_qk(name: str, d: int) -> None:
    if d not in (576, 512):
        raise ValueError(f"{name}: the last dim (d_qk) must be 576 (V3/V3.2) or 512 (V4 family), got {d}")


def first_bad(name: str, bad: torch.Tensor, values: torch.Tensor, expected: str) -> None:
    """Raise naming the first element of ``values`` where ``bad`` holds (debug checks: this synchronizes)."""
    where = bad.nonzero()
    if where.numel():
        at = tuple(where[0].tolist())
        raise ValueError(f"{name}: element {at} is {values[at].item()}, expected {expected} "
                         f"({where.shape[0]} such elements)")


class _Problem:
    """What every problem record shares: the device of its query (every tensor must live there) and the
    checks of the values its signature does not fix."""

    q: torch.Tensor
    sm_scale: float
    scale_name = "softmax_scale"

    @property
    def device(self) -> torch.device:
        return self.q.device

    def check_values(self) -> None:
        """Every call: the arguments that are not part of :meth:`signature`. A positive finite float, the
        usual scale, passes with two comparisons; any other value gets :func:`check_scale`'s full check."""
        scale = self.sm_scale
        if not (type(scale) is float and 0.0 < scale < math.inf):
            check_scale(self.scale_name, scale)


@dataclass
class SparsePrefill(_Problem):
    """``flash_mla_sparse_fwd``: every query token attends to its own top-k rows of a bf16 ``kv``.

    q ``[s_q, h_q, d_qk]``; kv ``[s_kv, h_kv, d_qk]``; indices ``[s_q, h_kv, topk]`` int32 (invalid: < 0 or
    >= s_kv); attn_sink ``[h_q]`` fp32; topk_length ``[s_q]`` int32.
    """

    q: torch.Tensor
    kv: torch.Tensor
    indices: torch.Tensor
    sm_scale: float
    d_v: int = HEAD_DIM_V
    attn_sink: Optional[torch.Tensor] = None
    topk_length: Optional[torch.Tensor] = None

    op = "sparse_prefill"
    scale_name = "sm_scale"

    def signature(self) -> tuple:
        return (self.op, _tensor_sig(self.q), _cache_sig(self.kv), _tensor_sig(self.indices), self.d_v,
                _tensor_sig(self.attn_sink), _tensor_sig(self.topk_length))

    def shape_key(self) -> str:
        s_q, h_q, d = self.q.shape
        return (f"sparse_prefill:s_q={s_q},h_q={h_q},d_qk={d},h_kv={self.kv.shape[1]},s_kv={self.kv.shape[0]},"
                f"topk={self.indices.shape[-1]},sink={self.attn_sink is not None},len={self.topk_length is not None}")

    def validate(self) -> None:
        _need_tensor("q", self.q, 3, "[s_q, h_q, d_qk]")
        _need_dtype("q", self.q, _FLOAT_DTYPES)
        s_q, h_q, d = self.q.shape
        _check_d_qk("q", d)
        dev = self.q.device
        _need_tensor("kv", self.kv, 3, "[s_kv, h_kv, d_qk]")
        _need_dtype("kv", self.kv, (self.q.dtype,))
        _need_device("kv", self.kv, dev)
        s_kv, h_kv, d_kv = self.kv.shape
        if d_kv != d:
            raise ValueError(f"kv: expected last dim d_qk = {d} (as q), got {d_kv}")
        if h_kv < 1 or h_q % h_kv:
            raise ValueError(f"kv: h_q = {h_q} must be a multiple of h_kv, got h_kv = {h_kv}")
        _need_tensor("indices", self.indices, 3, "[s_q, h_kv, topk]")
        _need_dtype("indices", self.indices, (torch.int32,))
        _need_device("indices", self.indices, dev)
        if self.indices.shape[:2] != (s_q, h_kv):
            raise ValueError(f"indices: expected shape [s_q, h_kv, topk] with s_q = {s_q}, h_kv = {h_kv}, "
                             f"got {tuple(self.indices.shape)}")
        _check_head_dim_v("d_v", self.d_v)
        _check_optional_vector("attn_sink", self.attn_sink, h_q, torch.float32, dev, "[h_q]")
        _check_optional_vector("topk_length", self.topk_length, s_q, torch.int32, dev, "[s_q]")
        for name in ("q", "kv", "indices"):
            _need_int32_strides(name, getattr(self, name))

    def check_data(self) -> None:
        """Debug mode: every index is -1 or a row of kv (others are skipped, but usually a bug)."""
        s_kv = self.kv.shape[0]
        first_bad("indices", (self.indices < -1) | (self.indices >= s_kv), self.indices, f"-1 or in [0, {s_kv})")


@dataclass
class SparseDecode(_Problem):
    """``flash_mla_with_kvcache`` with ``indices``: DSA decoding over a paged (usually quantized) cache.

    q ``[b, s_q, h_q, d_qk]``; k_cache ``[num_blocks, page_size, 1, bytes_per_token]`` (format from
    ``shape[-1]``) or bf16 ``[num_blocks, page_size, 1, d_qk]``; indices ``[b, s_q, topk]`` int32 slots
    (``block * page_size + offset``, -1 invalid); topk_length ``[b]``; attn_sink ``[h_q]``; an optional
    extra cache with its own page size, indices ``[b, s_q, extra_topk]`` and extra_topk_length ``[b]``.
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    indices: torch.Tensor
    sm_scale: float
    d_v: int = HEAD_DIM_V
    attn_sink: Optional[torch.Tensor] = None
    topk_length: Optional[torch.Tensor] = None
    extra_k_cache: Optional[torch.Tensor] = None
    extra_indices: Optional[torch.Tensor] = None
    extra_topk_length: Optional[torch.Tensor] = None
    is_fp8_kvcache: Optional[bool] = None
    batch_invariant: bool = False
    sched: Optional[FlashMLASchedMeta] = None

    op = "sparse_decode"

    @property
    def fmt(self) -> KVCacheFormat:
        return detect_format(self.k_cache)

    @property
    def extra_fmt(self) -> Optional[KVCacheFormat]:
        return None if self.extra_k_cache is None else detect_format(self.extra_k_cache)

    def signature(self) -> tuple:
        return (self.op, _tensor_sig(self.q), _cache_sig(self.k_cache), _tensor_sig(self.indices), self.d_v,
                _tensor_sig(self.attn_sink), _tensor_sig(self.topk_length), _cache_sig(self.extra_k_cache),
                _tensor_sig(self.extra_indices), _tensor_sig(self.extra_topk_length), self.is_fp8_kvcache,
                self.batch_invariant)

    def shape_key(self) -> str:
        b, s_q, h_q, d = self.q.shape
        extra = "" if self.extra_k_cache is None else \
            f",extra={self.extra_fmt.name}:{self.extra_indices.shape[-1]}@{self.extra_k_cache.shape[1]}"
        return (f"sparse_decode:b={b},s_q={s_q},h_q={h_q},d_qk={d},fmt={self.fmt.name},"
                f"page={self.k_cache.shape[1]},topk={self.indices.shape[-1]}{extra},"
                f"sink={self.attn_sink is not None},len={self.topk_length is not None}")

    def _check_cache(self, name: str, cache, idx_name: str, idx, d: int, b: int, s_q: int, dev) -> KVCacheFormat:
        _need_tensor(name, cache, 4, "[num_blocks, page_size, 1, bytes_per_token]")
        fmt = detect_format(cache, name)
        _need_device(name, cache, dev)
        if cache.shape[2] != 1:
            raise ValueError(f"{name}: sparse decoding needs h_kv = 1 (dim 2), got shape {tuple(cache.shape)}")
        if fmt is KVCacheFormat.BF16:
            _need_dtype(name, cache, (self.q.dtype,))
            if cache.shape[3] != d:
                raise ValueError(f"{name}: expected last dim d_qk = {d} (as q), got {cache.shape[3]}")
        elif fmt.spec.d_qk != d:
            raise ValueError(f"{name}: format {fmt.name} holds d_qk = {fmt.spec.d_qk} but q has d_qk = {d}")
        if cache.stride(-1) != 1:
            raise ValueError(f"{name}: the last dim must be contiguous (stride 1), got strides {cache.stride()}")
        _need_int32_strides(name, cache)
        _need_tensor(idx_name, idx, 3, "[b, s_q, topk]")
        _need_dtype(idx_name, idx, (torch.int32,))
        _need_device(idx_name, idx, dev)
        if idx.shape[:2] != (b, s_q):
            raise ValueError(f"{idx_name}: expected shape [b, s_q, topk] with b = {b}, s_q = {s_q}, got {tuple(idx.shape)}")
        _need_int32_strides(idx_name, idx)
        return fmt

    def validate(self) -> None:
        _need_tensor("q", self.q, 4, "[b, s_q, h_q, d_qk]")
        _need_dtype("q", self.q, _FLOAT_DTYPES)
        b, s_q, h_q, d = self.q.shape
        _check_d_qk("q", d)
        _need_int32_strides("q", self.q)
        dev = self.q.device
        fmt = self._check_cache("k_cache", self.k_cache, "indices", self.indices, d, b, s_q, dev)
        if self.is_fp8_kvcache is not None and self.is_fp8_kvcache != fmt.is_quantized:
            raise ValueError(f"is_fp8_kvcache: got {self.is_fp8_kvcache} but k_cache is {fmt.name} "
                             f"({'quantized' if fmt.is_quantized else 'not quantized'})")
        if (self.extra_k_cache is None) != (self.extra_indices is None):
            raise ValueError("extra_indices_in_kvcache: must be given if and only if extra_k_cache is given, got "
                             f"extra_k_cache={'None' if self.extra_k_cache is None else 'a tensor'}, "
                             f"extra_indices_in_kvcache={'None' if self.extra_indices is None else 'a tensor'}")
        if self.extra_k_cache is not None:
            self._check_cache("extra_k_cache", self.extra_k_cache, "extra_indices_in_kvcache", self.extra_indices,
                              d, b, s_q, dev)
        elif self.extra_topk_length is not None:
            raise ValueError("extra_topk_length: given without an extra_k_cache")
        _check_head_dim_v("head_dim_v", self.d_v)
        _check_optional_vector("attn_sink", self.attn_sink, h_q, torch.float32, dev, "[h_q]")
        _check_optional_vector("topk_length", self.topk_length, b, torch.int32, dev, "[b]")
        _check_optional_vector("extra_topk_length", self.extra_topk_length, b, torch.int32, dev, "[b]")

    def check_data(self) -> None:
        """Debug mode: every slot is -1 or a slot of its cache (others are skipped, but usually a bug)."""
        for name, idx, cache in (("indices", self.indices, self.k_cache),
                                 ("extra_indices_in_kvcache", self.extra_indices, self.extra_k_cache)):
            if idx is not None:
                slots = cache.shape[0] * cache.shape[1]
                first_bad(name, (idx < -1) | (idx >= slots), idx, f"-1 or a slot in [0, {slots})")

    def sched_config(self) -> FlashMLASchedMeta.Config:
        """The FlashMLA configuration a scheduling metadata object is bound to (fixed by the signature)."""
        b, s_q, h_q, _ = self.q.shape
        extra = self.extra_k_cache
        return FlashMLASchedMeta.Config(
            b=b, s_q=s_q, h_q=h_q, page_block_size=self.k_cache.shape[1], h_k=self.k_cache.shape[2], causal=False,
            is_fp8_kvcache=self.fmt.is_quantized, topk=self.indices.shape[-1],
            extra_page_block_size=None if extra is None else extra.shape[1],
            extra_topk=None if extra is None else self.extra_indices.shape[-1],
            enable_batch_invariant=self.batch_invariant)


@dataclass
class DenseDecode(_Problem):
    """``flash_mla_with_kvcache`` without ``indices``: MLA decoding over a paged bf16/fp16 latent cache.

    q ``[b, s_q, h_q, d_qk]``; k_cache ``[num_blocks, page_size, h_kv, d_qk]`` (same dtype as q); block_table
    ``[b, max_blocks_per_seq]`` int32; cache_seqlens ``[b]`` int32. h_q must be a multiple of h_kv; with
    ``causal`` and s_q > 1 query i sees keys ``j <= s_k - s_q + i`` (bottom-right aligned).
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    block_table: torch.Tensor
    cache_seqlens: torch.Tensor
    sm_scale: float
    d_v: int = HEAD_DIM_V
    causal: bool = False
    attn_sink: Optional[torch.Tensor] = None
    batch_invariant: bool = False
    sched: Optional[FlashMLASchedMeta] = None

    op = "dense_decode"

    def signature(self) -> tuple:
        return (self.op, _tensor_sig(self.q), _cache_sig(self.k_cache), _tensor_sig(self.block_table),
                _tensor_sig(self.cache_seqlens), self.d_v, self.causal, _tensor_sig(self.attn_sink),
                self.batch_invariant)

    def shape_key(self) -> str:
        b, s_q, h_q, d = self.q.shape
        return (f"dense_decode:b={b},s_q={s_q},h_q={h_q},h_kv={self.k_cache.shape[2]},d_qk={d},"
                f"page={self.k_cache.shape[1]},max_blocks={self.block_table.shape[1]},causal={self.causal},"
                f"dtype={str(self.q.dtype).replace('torch.', '')}")

    def validate(self) -> None:
        _need_tensor("q", self.q, 4, "[b, s_q, h_q, d_qk]")
        _need_dtype("q", self.q, _FLOAT_DTYPES)
        b, s_q, h_q, d = self.q.shape
        _check_d_qk("q", d)
        dev = self.q.device
        _need_tensor("k_cache", self.k_cache, 4, "[num_blocks, page_size, h_kv, d_qk]")
        if self.k_cache.dtype != self.q.dtype:
            raise TypeError(f"k_cache: dense decoding needs the cache in q's dtype "
                            f"({str(self.q.dtype).replace('torch.', '')}), got {str(self.k_cache.dtype).replace('torch.', '')}"
                            " (quantized caches need indices: there is no FP8 dense decoding)")
        _need_device("k_cache", self.k_cache, dev)
        _, page, h_kv, d_k = self.k_cache.shape
        if d_k != d:
            raise ValueError(f"k_cache: expected last dim d_qk = {d} (as q), got {d_k}")
        if h_kv < 1 or h_q % h_kv:
            raise ValueError(f"k_cache: h_q = {h_q} must be a multiple of h_kv (dim 2), got h_kv = {h_kv}")
        if page < 1:
            raise ValueError(f"k_cache: page_size (dim 1) must be positive, got {page}")
        _need_tensor("block_table", self.block_table, 2, "[b, max_blocks_per_seq]")
        _need_dtype("block_table", self.block_table, (torch.int32,))
        _need_device("block_table", self.block_table, dev)
        if self.block_table.shape[0] != b:
            raise ValueError(f"block_table: expected {b} rows (the batch size of q), got shape {tuple(self.block_table.shape)}")
        _check_optional_vector("cache_seqlens", self.cache_seqlens, b, torch.int32, dev, "[b]")
        if self.cache_seqlens is None:
            raise ValueError("cache_seqlens: required for dense decoding (no indices given)")
        _check_head_dim_v("head_dim_v", self.d_v)
        _check_optional_vector("attn_sink", self.attn_sink, h_q, torch.float32, dev, "[h_q]")
        for name in ("q", "k_cache", "block_table"):
            t = getattr(self, name)
            _need_int32_strides(name, t)
            if t.stride(-1) != 1:
                raise ValueError(f"{name}: the last dim must be contiguous (stride 1), got strides {t.stride()}")

    def check_data(self) -> None:
        """Debug mode: every length fits its block table row, and every block it reaches is a cache block.
        (By default a length past the row is cut to the row's capacity and a bad block is skipped.)"""
        num_blocks, page = self.k_cache.shape[:2]
        lens, table = self.cache_seqlens, self.block_table
        capacity = table.shape[1] * page
        first_bad("cache_seqlens", (lens < 0) | (lens > capacity), lens,
                   f"a length in [0, {capacity}] (block_table has {table.shape[1]} blocks of {page} per row)")
        used = torch.arange(table.shape[1], device=table.device)[None, :] * page < lens[:, None]
        first_bad("block_table", used & ((table < 0) | (table >= num_blocks)), table,
                   f"a block in [0, {num_blocks}) where the row's length reaches it")

    def sched_config(self) -> FlashMLASchedMeta.Config:
        """The FlashMLA configuration a scheduling metadata object is bound to (fixed by the signature)."""
        b, s_q, h_q, _ = self.q.shape
        return FlashMLASchedMeta.Config(
            b=b, s_q=s_q, h_q=h_q, page_block_size=self.k_cache.shape[1], h_k=self.k_cache.shape[2],
            causal=self.causal, is_fp8_kvcache=False, topk=None, extra_page_block_size=None, extra_topk=None,
            enable_batch_invariant=self.batch_invariant)


def check_num_splits(num_splits) -> None:
    if num_splits is not None:
        raise ValueError("num_splits: must be None (FlashMLA v1.0.0 semantics; anymla computes its own splits), "
                         f"got {type(num_splits).__name__}")


def _reject_sparse_only(**arguments) -> None:
    for name, value in arguments.items():
        if value is not None:
            raise ValueError(f"{name}: only sparse decoding (with indices) takes it; got it without indices")


def decode_problem(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, is_fp8_kvcache,
                   indices, attn_sink, extra_k_cache, extra_indices, topk_length, extra_topk_length,
                   batch_invariant, sched, num_splits=None) -> "DenseDecode | SparseDecode":
    """The record of one ``flash_mla_with_kvcache`` call: dense without ``indices``, sparse with them.

    Checks how the arguments go together (the records check each argument); ``softmax_scale=None`` means
    ``d_qk ** -0.5``. Shared by the eager call, the ``torch.compile`` custom op and ``explain()``.
    """
    check_num_splits(num_splits)
    if sched is not None and not isinstance(sched, FlashMLASchedMeta):
        raise TypeError("tile_scheduler_metadata: expected the FlashMLASchedMeta from anymla.get_mla_metadata(), "
                        f"got {type(sched).__name__}")
    if softmax_scale is None and isinstance(q, _Tensor):  # else validation reports q
        softmax_scale = q.shape[-1] ** -0.5
    if indices is None:
        if not (topk_length is None and extra_k_cache is None and extra_indices is None and extra_topk_length is None):
            _reject_sparse_only(topk_length=topk_length, extra_k_cache=extra_k_cache,
                                extra_indices_in_kvcache=extra_indices, extra_topk_length=extra_topk_length)
        if is_fp8_kvcache:
            raise ValueError("is_fp8_kvcache: dense decoding (no indices) needs a bf16/fp16 cache; "
                             "FP8 caches are decoded sparsely (pass indices)")
        return DenseDecode(q, k_cache, block_table, cache_seqlens, softmax_scale, head_dim_v, bool(causal), attn_sink,
                           bool(batch_invariant), sched)
    if causal:
        raise ValueError("causal: sparse decoding (with indices) has no causal mask; got causal=True")
    return SparseDecode(q, k_cache, indices, softmax_scale, head_dim_v, attn_sink, topk_length, extra_k_cache,
                        extra_indices, extra_topk_length, bool(is_fp8_kvcache), bool(batch_invariant), sched)
