"""FlashMLA's own CUDA kernels (the ``flash_mla`` module) as an external peer backend.

A peer is not in any device's priority list (``auto_select = False``): it runs when asked for by name
(``backend="flashmla"``), when ``python -m anymla.bench --tune`` measured it fastest for a shape, or, when
installed, in the regimes where anymla's own measurements found it faster than the Triton tier
(``_FASTER_ON_SM90``, ``measured_faster``). It lets the benchmark time FlashMLA behind the very inputs and
correctness gate of anymla's own tiers.

Sparse calls with a head count FlashMLA does not take (tensor parallelism: 8, 16, 32 heads) are run the way
serving engines run them: q (and attn_sink) padded with zero heads to 64 (or 128), the outputs sliced back;
the padding is part of the timed call, and ``explain()`` says so.

The shape limits below are FlashMLA v1.0.0's (``csrc/api/*.h`` and its kernels' asserts; see the project's
FlashMLA contract notes) plus the 2026-09-30 release's V4.1 formats. Run on an H200 with v1.0.0 built for
sm_90a (the benchmark gates its outputs against the reference); the 2026-09-30 release's calls follow its
documented interface only (no SM100 GPU here).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect

import torch
import torch.nn.functional as F

from ..kvcache import KVCacheFormat
from ..registry import OPS, Backend

_SPARSE_HEADS = (64, 128)


def _padded_heads(h_q: int):
    """The head count FlashMLA's sparse kernels run ``h_q`` heads at (None: more than it takes)."""
    return next((h for h in _SPARSE_HEADS if h_q <= h), None)


class _Padding:
    """The peer's plan for one signature: how many heads FlashMLA runs the call with."""

    def __init__(self, h_q: int, padded: int):
        self.h_q, self.padded = h_q, padded
        self.description = f"FlashMLA's kernel with q padded by zero heads from {h_q} to {padded} (as serving " \
                           "engines call it), outputs sliced back" if padded != h_q else "FlashMLA's kernel"

    def pad(self, t, dim: int):
        """``t`` with zero heads appended along ``dim`` (None stays None)."""
        if t is None or self.padded == self.h_q:
            return t
        # one op (torch.cat of a new_zeros is three: ~5 µs more host time on a CPU); F.pad's pairs run from
        # the last dimension back
        return F.pad(t, (0, 0) * (t.dim() - 1 - dim) + (0, self.padded - self.h_q))


# Formats each FlashMLA generation decodes sparsely: v1.0.0 (SM90 and SM100) and the 2026-09-30 release
# (SM100 only), told apart by the fused kernel only the later one exports.
_V1_FORMATS = (KVCacheFormat.V32_FP8, KVCacheFormat.MODEL1_FP8)
_V41_FORMATS = (KVCacheFormat.V41_FP8,)
_V41_EXTRA_FORMATS = (KVCacheFormat.V41_FP8, KVCacheFormat.V41_FP4)


@functools.lru_cache(maxsize=None)
def _flash_mla():
    """The imported ``flash_mla`` module, or the reason it cannot be used."""
    if importlib.util.find_spec("flash_mla") is None:
        return None, "flash_mla is not importable (FlashMLA is not installed: build it from deepseek-ai/FlashMLA)"
    try:
        module = importlib.import_module("flash_mla")
    except Exception as err:  # a broken build raises anything from ImportError to OSError
        return None, f"flash_mla is not importable: {type(err).__name__}: {err}"
    required = [p for p in inspect.signature(module.get_mla_metadata).parameters.values()
                if p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
    if required:
        return None, ("flash_mla is older than v1.0.0 (its get_mla_metadata needs arguments); the peer speaks "
                      "v1.0.0's interface")
    return module, ""


def _is_v41(module) -> bool:
    return hasattr(module, "fused_norm_rope_attn_rope_cast")


def _decode_op(module, name: str):
    """v1.0.0's decoding op ``name`` (``flash_mla.cuda.sparse_decode_fwd`` or ``dense_decode_fwd``, which its
    ``flash_mla_with_kvcache`` calls after checking the arguments against the metadata's configuration), or None
    for another release."""
    if _is_v41(module):
        return None
    return getattr(getattr(getattr(module, "flash_mla_interface", None), "flash_mla_cuda", None), name, None)


def _arch(device: torch.device) -> int:
    major, _ = torch.cuda.get_device_capability(device)
    return major


# Regimes where FlashMLA v1.0.0 on sm_90 was measured faster than anymla's Triton tier (torch 2.11, Triton 3.6, GPU
# time, both in the same run, heads padded to 64 for FlashMLA as serving engines do; H200: bench/results/h200/
# run54_final, run59_fp16_keys, run62_bench, run91_bench, run122_dequant_warpgroup and run136_record; H100:
# bench/results/h100/run132_record): where this says nothing, the Triton tier was the faster (sparse prefill at 32
# heads or fewer, H200 2026-12-07: h16 d576 1676 vs 2061 µs, h32 d512 1795 vs 2046, and h32 d576 a tie, 2241 vs
# 2197 on the H200, 2233 vs 2292 on an H100; sparse decoding at 32 heads or fewer: V3.2 b128 h8 / h16 / h32 84.5 /
# 88.8 / 112 vs 128 / 130 / 132 µs, MODEL1 h16 102 vs 167 (H200, 2026-12-07), and MODEL1 at 64 heads: FlashMLA's
# CONFIG1 92.5 vs 95.5 (H200, 2026-12-07); dense decoding of 16 query rows a kv head: b128 h16 304 vs 315, and b1
# h128 39.6 vs 43.6, below the GPU-bound size). Each entry: (the most query heads, or for dense decoding query rows
# a kv head, anymla keeps, for sparse decoding by cache format; why).
_FASTER_ON_SM90 = {
    "sparse_prefill": (32, "FlashMLA v1.0.0 measured faster on sm_90 above 32 heads a token (H200, 2026-12-01, "
                           "same run: h64 d512 1941 vs 2544 µs, h128 d576 4068 vs 5704)"),
    "sparse_decode": ({KVCacheFormat.V32_FP8: 32, KVCacheFormat.MODEL1_FP8: 64},
                      "FlashMLA v1.0.0 measured faster on sm_90 above 32 heads a token of a V32_FP8 cache and above "
                      "64 of a MODEL1_FP8 cache (H200, 2026-12-01, same run: V3.2 b64 h64 80.0 vs 93.1 µs, b128 s_q 2 "
                      "h128 369 vs 503; H100, 2026-12-07, same run: MODEL1 h128 with an extra cache 213 vs 263)"),
    "dense_decode": (16, "FlashMLA v1.0.0 measured faster on sm_90 for dense decoding of more than 16 query rows a "
                         "kv head (each pair from one run: b128 h32 s_k 8192 310 vs 322 µs on an H200 and 428 vs 437 "
                         "on an H100, 2026-12-07, 316 vs 328 on an H200 before; b128 s_q 2 h128 843 vs 1085 and 891 "
                         "vs 1059 on 2026-12-02, 900 vs 1123 on 2026-12-01; b64 h128 s_k 4096 121 vs 143 on "
                         "2026-12-01; between 32 and 128 rows not measured)"),
}


# Where FlashMLA's kernels are faster, they are so on the GPU; called eagerly, a call through the peer also
# pays FlashMLA's host cost and anymla's Python path (55-75 µs a call on an H200's host, 2026-12-02, where
# anymla's own kernels through the compiled call path take 20-32). So the peer is chosen only for calls whose
# GPU time hides that: at least this many (query row, key) pairs, the extra cache's keys counted too, ~60 µs of
# anymla's GPU time (V3.2 decoding b64 h64 topk 2048 has 8.4 M and takes 87-94 µs; b4 h64 topk 512, 0.13 M,
# 20 µs; FlashMLA's CONFIG1, 10.5 M).
_GPU_BOUND_PAIRS = 6 << 20


class FlashMLAPeer(Backend):
    name = "flashmla"
    ops = frozenset(OPS)
    device_types = ("cuda",)
    auto_select = False

    def unavailable_reasons(self, device: torch.device) -> list[str]:
        reasons = super().unavailable_reasons(device)
        if reasons:
            return reasons
        module, why = _flash_mla()
        if module is None:
            return [why]
        if not torch.cuda.is_available():
            return ["torch sees no CUDA device"]
        major = _arch(device)
        if major not in (9, 10):
            return [f"FlashMLA's kernels need an SM90 (Hopper) or SM100 (Blackwell) GPU, this one is sm{major}x"]
        if _is_v41(module) and major != 10:
            return ["this flash_mla is the 2026-09-30 release, which runs on SM100 only"]
        return []

    def measured_faster(self, problem) -> str:
        regime = _FASTER_ON_SM90.get(problem.op)
        if regime is None or problem.device.type != "cuda" or _arch(problem.device) != 9:
            return ""
        most, why = regime
        if isinstance(most, dict):
            most = most.get(problem.fmt)
            if most is None:  # a format v1.0.0 does not decode
                return ""
        q = problem.q
        if problem.op == "dense_decode":
            # the query rows of a kv head (FlashMLA's tile rows) and, as keys, the block table's capacity (a call
            # signature fixes no cache length)
            wide = q.shape[1] * q.shape[2] // problem.k_cache.shape[2]
            keys = problem.block_table.shape[1] * problem.k_cache.shape[1]
        else:
            wide = q.shape[1] if problem.op == "sparse_prefill" else q.shape[2]
            extra = getattr(problem, "extra_indices", None)
            keys = problem.indices.shape[-1] + (0 if extra is None else extra.shape[-1])
        if q.numel() // q.shape[-1] * keys < _GPU_BOUND_PAIRS or wide <= most:
            return ""
        return why

    def shape_reasons(self, problem) -> list[str]:
        module, _ = _flash_mla()
        return getattr(self, f"_{problem.op}_reasons")(problem, module, _arch(problem.device))

    @staticmethod
    def _sparse_prefill_reasons(p, module, major) -> list[str]:
        s_q, h_q, d = p.q.shape
        topk = p.indices.shape[-1]
        reasons = []
        if p.q.dtype != torch.bfloat16:
            reasons.append(f"q must be bf16, got {p.q.dtype}")
        if _padded_heads(h_q) is None:
            reasons.append(f"h_q must be at most 128 (padded to 64 or 128), got {h_q}")
        if p.kv.shape[1] != 1:
            reasons.append(f"h_kv must be 1, got {p.kv.shape[1]}")
        if _is_v41(module) and d != 512:
            reasons.append(f"the 2026-09-30 release takes d_qk 512 only, got {d}")
        granule = 128 if major == 9 or (h_q == 128 and topk > 1280) else 64
        if topk % granule:
            reasons.append(f"topk must be a multiple of {granule} on sm{major}x, got {topk}")
        return reasons

    @staticmethod
    def _sparse_decode_reasons(p, module, major) -> list[str]:
        h_q = p.q.shape[2]
        reasons = []
        if _padded_heads(h_q) is None:
            reasons.append(f"h_q must be at most 128 (padded to 64 or 128), got {h_q}")
        if p.q.dtype != torch.bfloat16:
            reasons.append(f"q must be bf16, got {p.q.dtype}")
        formats = _V41_FORMATS if _is_v41(module) else _V1_FORMATS
        if p.fmt not in formats:
            reasons.append(f"this flash_mla decodes {', '.join(f.name for f in formats)} caches sparsely, "
                           f"not {p.fmt.name}")
        if p.fmt.is_quantized and p.k_cache.stride(1) != p.fmt.spec.bytes_per_token:
            reasons.append(f"k_cache rows must be packed (stride(1) == {p.fmt.spec.bytes_per_token} bytes per token), "
                           f"got stride(1) = {p.k_cache.stride(1)}")
        if p.indices.shape[-1] % 64:
            reasons.append(f"topk must be a multiple of 64, got {p.indices.shape[-1]}")
        if p.extra_k_cache is not None:
            if not _is_v41(module) and p.fmt is KVCacheFormat.V32_FP8:
                reasons.append("V32_FP8 decoding takes no extra cache")
            elif _is_v41(module) and p.extra_fmt not in _V41_EXTRA_FORMATS:
                reasons.append(f"the extra cache must be V41_FP8 or V41_FP4, got {p.extra_fmt.name}")
            if major == 10 and h_q == 64 and p.extra_indices.shape[-1] % 64:
                reasons.append(f"extra_topk must be a multiple of 64 on sm100 with 64 heads, "
                               f"got {p.extra_indices.shape[-1]}")
        if p.fmt is KVCacheFormat.V32_FP8 and major == 9 and p.topk_length is not None:
            reasons.append("V32_FP8 decoding on sm90 takes no topk_length")
        takes = inspect.signature(module.flash_mla_with_kvcache).parameters
        if p.batch_invariant and "enable_batch_invariant" not in takes:
            reasons.append("enable_batch_invariant needs the 2026-09-30 flash_mla")
        return reasons

    @staticmethod
    def _dense_decode_reasons(p, module, major) -> list[str]:
        reasons = []
        if _is_v41(module):
            reasons.append("the 2026-09-30 flash_mla removed dense decoding")
        if major != 9:
            reasons.append(f"dense decoding runs on sm90 only, this GPU is sm{major}x")
        if p.q.shape[-1] != 576:
            reasons.append(f"d_qk must be 576, got {p.q.shape[-1]}")
        if p.k_cache.shape[1] != 64:
            reasons.append(f"the page size must be 64, got {p.k_cache.shape[1]}")
        if p.attn_sink is not None:
            reasons.append("dense decoding takes no attn_sink")
        if p.batch_invariant:
            reasons.append("dense decoding has no batch-invariant mode")
        return reasons

    @staticmethod
    def _metadata(sched, module):
        """FlashMLA's own scheduling metadata, kept in anymla's so every call of a configuration reuses it."""
        if sched is None:
            return module.get_mla_metadata()[0]
        return sched.plan_for("flashmla", lambda: module.get_mla_metadata()[0])

    def plan(self, problem):
        if problem.op == "dense_decode":
            return None
        h_q = problem.q.shape[-2]
        return _Padding(h_q, _padded_heads(h_q))

    def run(self, problem, plan=None):
        return getattr(self, problem.op)(problem, plan or self.plan(problem))

    def entry(self, problem, plan):
        """FlashMLA called with the public call's own arguments (the compiled call path's form of a signature's
        calls), as :meth:`run` calls it."""
        module, _ = _flash_mla()
        sm_scale = problem.sm_scale
        if problem.op == "sparse_prefill":
            return lambda sched, q, kv, indices, _scale, d_v, attn_sink, topk_length: _prefill(
                module, plan, q, kv, indices, sm_scale, d_v, attn_sink, topk_length)
        if problem.op == "dense_decode":
            causal = problem.causal
            raw = _decode_op(module, "dense_decode_fwd")

            def dense(sched, q, k_cache, block_table, cache_seqlens, d_v, *_):
                meta = self._metadata(sched, module)
                if raw is None or not meta.have_initialized:  # FlashMLA's interface fills its metadata
                    return _dense(module, meta, q, k_cache, block_table, cache_seqlens, d_v, sm_scale, causal)
                # FlashMLA's op itself, as its interface calls it once the metadata holds this configuration
                out, lse, meta.tile_scheduler_metadata, meta.num_splits = raw(
                    q, k_cache, d_v, cache_seqlens, block_table, sm_scale, causal, meta.tile_scheduler_metadata,
                    meta.num_splits)
                return out, lse
            return dense

        extra = {"enable_batch_invariant": True} if problem.batch_invariant else {}
        raw = None if extra else _decode_op(module, "sparse_decode_fwd")

        def sparse(sched, q, k_cache, _table, _lens, d_v, _splits, _scale, _causal, _fp8, indices, attn_sink,
                   extra_k_cache, extra_indices, topk_length, extra_topk_length, _invariant):
            meta = self._metadata(sched, module)
            if raw is None or not meta.have_initialized:  # FlashMLA's interface fills its metadata's configuration
                out, lse = _sparse(module, plan, meta, q, k_cache, d_v, sm_scale, indices, attn_sink, extra_k_cache,
                                   extra_indices, topk_length, extra_topk_length, extra)
                return out, lse.mT  # the public lse: a [b, h_q, s_q] view, as the dispatcher's path hands it back
            # FlashMLA's op itself: what its interface calls once the metadata holds this configuration (the entry's
            # key and the metadata's binding already hold everything its checks compare), its lse [b, h_q, s_q]
            out, lse, meta.tile_scheduler_metadata, meta.num_splits = raw(
                plan.pad(q, 2), k_cache, indices, topk_length, plan.pad(attn_sink, 0), meta.tile_scheduler_metadata,
                meta.num_splits, extra_k_cache, extra_indices, extra_topk_length, d_v, sm_scale)
            h = plan.h_q
            return (out, lse) if plan.padded == h else (out[:, :, :h], lse[:, :h])
        return sparse

    def sparse_prefill(self, p, pad):
        module, _ = _flash_mla()
        return _prefill(module, pad, p.q, p.kv, p.indices, p.sm_scale, p.d_v, p.attn_sink, p.topk_length)

    def sparse_decode(self, p, pad):
        module, _ = _flash_mla()
        extra = {"enable_batch_invariant": True} if p.batch_invariant else {}
        return _sparse(module, pad, self._metadata(p.sched, module), p.q, p.k_cache, p.d_v, p.sm_scale, p.indices,
                       p.attn_sink, p.extra_k_cache, p.extra_indices, p.topk_length, p.extra_topk_length, extra)

    def dense_decode(self, p, plan=None):
        module, _ = _flash_mla()
        return _dense(module, self._metadata(p.sched, module), p.q, p.k_cache, p.block_table, p.cache_seqlens, p.d_v,
                      p.sm_scale, p.causal)


def _prefill(module, pad: _Padding, q, kv, indices, sm_scale, d_v, attn_sink, topk_length):
    out, max_logits, lse = module.flash_mla_sparse_fwd(pad.pad(q, 1), kv, indices, sm_scale, d_v,
                                                       pad.pad(attn_sink, 0), topk_length)
    h = pad.h_q
    if pad.padded == h:  # a slice is a view op: ~3 µs of host time each on an H200's host
        return out, max_logits, lse
    return out[:, :h], max_logits[:, :h], lse[:, :h]


def _sparse(module, pad: _Padding, meta, q, k_cache, d_v, sm_scale, indices, attn_sink, extra_k_cache, extra_indices,
            topk_length, extra_topk_length, extra: dict):
    """out ``[b, s_q, h_q, 512]`` and lse ``[b, s_q, h_q]`` (as anymla's backends return it)."""
    out, lse = module.flash_mla_with_kvcache(
        pad.pad(q, 2), k_cache, None, None, d_v, meta, None, softmax_scale=sm_scale, is_fp8_kvcache=True,
        indices=indices, attn_sink=pad.pad(attn_sink, 0), extra_k_cache=extra_k_cache,
        extra_indices_in_kvcache=extra_indices, topk_length=topk_length, extra_topk_length=extra_topk_length,
        **extra)
    lse = lse.mT  # FlashMLA's lse is a [b, h_q, s_q] view of a contiguous [b, s_q, h_q]
    h = pad.h_q
    return (out, lse) if pad.padded == h else (out[:, :, :h], lse[:, :, :h])


def _dense(module, meta, q, k_cache, block_table, cache_seqlens, d_v, sm_scale, causal):
    return module.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, d_v, meta, None,
                                         softmax_scale=sm_scale, causal=causal)
