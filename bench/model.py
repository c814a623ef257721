"""The performance model of one call: the fewest bytes it must move, the FLOPs it must do, and the floor
time the device's ceilings imply.

FLOPs = 2 · (queries) · h_q · (keys each query attends) · (d_qk + d_v), counting only keys a call really
attends (valid indices within ``topk_length``; the causal window for dense decoding), as FlashMLA's and
the kernel issues' numbers do.
Bytes = q read + out written + the KV the call must read once:

* sparse decode: every counted index of every query token reads its row (``bytes_per_token`` of its
  cache's format: 656 V3.2 FP8, 528 V4.1 FP8, 288 V4.1 FP4, 2·d_qk bf16);
* dense decode: ``sum(cache_seqlens) · h_kv · d_qk`` elements;
* sparse prefill: each distinct kv row any token reads, once (rows are shared across tokens).

The floor is ``max(bytes / copy rate, FLOPs / matmul rate)``; a backend's ``frac_of_floor`` is
floor / measured time (1.0 means it runs at the floor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .ceilings import Ceilings


@dataclass(frozen=True)
class Cost:
    flops: float
    bytes: float


def _counted(indices: torch.Tensor, rows: int, length: Optional[torch.Tensor]) -> torch.Tensor:
    """Which index slots a call attends: in range, and left of the per-row ``length`` if given."""
    ok = (indices >= 0) & (indices < rows)
    if length is not None:
        ok &= torch.arange(indices.shape[-1], device=indices.device) < length.view(-1, *[1] * (indices.dim() - 1))
    return ok


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _q_and_out_bytes(q: torch.Tensor, d_v: int) -> int:
    return _nbytes(q) + q[..., 0].numel() * d_v * q.element_size()


def _flops(query_keys: int, heads: int, d_qk: int, d_v: int) -> float:
    """``query_keys``: sum over queries of the keys each attends (shared by ``heads`` heads)."""
    return 2.0 * query_keys * heads * (d_qk + d_v)


def sparse_prefill_cost(q, kv, indices, d_v=512, topk_length=None, **_) -> Cost:
    s_kv, h_kv, d = kv.shape
    counted = _counted(indices, s_kv, topk_length)
    rows = indices.long() * h_kv + torch.arange(h_kv, device=indices.device)[:, None]  # (row, kv head) pairs
    distinct_rows = int(torch.unique(rows[counted]).numel())
    return Cost(_flops(int(counted.sum()), q.shape[1] // h_kv, d, d_v),
                distinct_rows * d * kv.element_size() + _q_and_out_bytes(q, d_v))


def sparse_decode_cost(q, k_cache, indices, head_dim_v=512, topk_length=None, extra_k_cache=None,
                       extra_indices_in_kvcache=None, extra_topk_length=None, **_) -> Cost:
    keys = 0
    kv_bytes = 0
    for cache, idx, length in ((k_cache, indices, topk_length),
                               (extra_k_cache, extra_indices_in_kvcache, extra_topk_length)):
        if cache is None:
            continue
        n = int(_counted(idx, cache.shape[0] * cache.shape[1], length).sum())
        keys += n
        kv_bytes += n * cache.shape[-1] * cache.element_size()
    return Cost(_flops(keys, q.shape[2], q.shape[3], head_dim_v), kv_bytes + _q_and_out_bytes(q, head_dim_v))


def dense_decode_cost(q, k_cache, cache_seqlens, head_dim_v=512, causal=False, **_) -> Cost:
    b, s_q, h_q, d = q.shape
    lens = cache_seqlens.long()
    if causal and s_q > 1:
        # query i of a request sees keys j <= s_k - s_q + i (bottom-right aligned), at least none
        seen = (lens[:, None] - s_q + 1 + torch.arange(s_q, device=lens.device)).clamp(min=0)
        seen = torch.minimum(seen, lens[:, None])
    else:
        seen = lens[:, None].expand(b, s_q)
    kv_bytes = int(lens.sum()) * k_cache.shape[2] * d * k_cache.element_size()
    return Cost(_flops(int(seen.sum()), h_q, d, head_dim_v), kv_bytes + _q_and_out_bytes(q, head_dim_v))


COSTS = {"sparse_prefill": sparse_prefill_cost, "sparse_decode": sparse_decode_cost,
         "dense_decode": dense_decode_cost}


def cost(op: str, args: dict) -> Cost:
    """The cost of one call of ``op`` with the public function's keyword arguments ``args``."""
    return COSTS[op](**args)


def floor_us(c: Cost, ceilings: Ceilings) -> tuple[float, str]:
    """The floor time in µs and which ceiling sets it (``"memory"`` or ``"compute"``)."""
    memory = c.bytes / (ceilings.copy_gbps * 1e9) * 1e6
    compute = c.flops / (ceilings.matmul_tflops * 1e12) * 1e6
    return (memory, "memory") if memory >= compute else (compute, "compute")


@dataclass(frozen=True)
class Rates:
    tflops: float
    gbps: float
    floor_us: float
    bound: str
    frac_of_floor: float  # floor / time: 1.0 = at the floor
    ratio_to_matmul: float  # achieved TFLOP/s / same-run matmul TFLOP/s
    ratio_to_copy: float  # achieved GB/s / same-run copy GB/s


def rates(c: Cost, time_us: float, ceilings: Ceilings) -> Rates:
    floor, bound = floor_us(c, ceilings)
    tflops = c.flops / (time_us * 1e-6) / 1e12
    gbps = c.bytes / (time_us * 1e-6) / 1e9
    return Rates(tflops, gbps, floor, bound, floor / time_us, tflops / ceilings.matmul_tflops,
                 gbps / ceilings.copy_gbps)
