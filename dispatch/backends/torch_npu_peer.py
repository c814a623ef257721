"""torch_npu's built-in DeepSeek sparse attention (``torch_npu.npu_sparse_flash_attention``) as an external
peer backend on Ascend NPUs: the main baseline anymla's Ascend tiers are measured against.

UNVERIFIED: written from torch_npu's operator documentation, with no NPU and no torch_npu at hand. The
argument mapping (layouts, index padding, the layout of the softmax statistics) must be checked on
hardware; until then the benchmark's correctness gate is what catches a mistake (it reports the peer as
wrong and never times it).

Mapping. The op takes the 576-dim latent row as a 512-dim key (also the value) plus a 64-dim rope part.
Both ops run as one call in the TND layout: the query tokens are one sequence, the keys another, with no
mask (sparse_mode 0). Decoding views the paged cache as a flat ``[slots, 1, 576]`` key sequence, so
anymla's slot indices (``block * page_size + offset``) are key positions as they stand. Invalid indices
become -1, the op's padding value. Like any peer it runs when asked for by name, when ``--tune`` measured
it fastest, or where anymla's measurements found it faster (none yet: it has not run on an NPU).
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from ..kvcache import KVCacheFormat
from ..registry import Backend

_D_LATENT, _D_ROPE = 512, 64


def _torch_npu():
    return importlib.import_module("torch_npu")


def _attend(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float):
    """q ``[T, h, 576]``, kv ``[S, 1, 576]``, indices ``[T, 1, topk]`` -> out ``[T, h, 512]``, max, lse ``[T, h]``."""
    tokens, heads, _ = q.shape
    valid = (indices >= 0) & (indices < kv.shape[0])
    key = kv[..., :_D_LATENT]
    out, softmax_max, softmax_sum = _torch_npu().npu_sparse_flash_attention(
        q[..., :_D_LATENT], key, key, torch.where(valid, indices, -1), sm_scale,
        actual_seq_lengths_query=torch.tensor([tokens], dtype=torch.int32, device=q.device),
        actual_seq_lengths_kv=torch.tensor([kv.shape[0]], dtype=torch.int32, device=q.device),
        query_rope=q[..., _D_LATENT:], key_rope=kv[..., _D_LATENT:], sparse_block_size=1,
        layout_query="TND", layout_kv="TND", sparse_mode=0, return_softmax_lse=True)
    # Assumed: max and sum of exp(scaled logit - max) per (token, head), natural log base.
    row_max = softmax_max.reshape(tokens, heads).float()
    row_sum = softmax_sum.reshape(tokens, heads).float()
    empty = row_sum == 0  # anymla's convention for a row with no valid key: out 0, lse +inf, max -inf
    lse = torch.where(empty, float("inf"), row_max + torch.log(row_sum))
    out = torch.where(empty[..., None], 0.0, out.reshape(tokens, heads, _D_LATENT)).to(q.dtype)
    return out, torch.where(empty, float("-inf"), row_max), lse


class TorchNpuPeer(Backend):
    name = "torch_npu"
    ops = frozenset({"sparse_prefill", "sparse_decode"})
    device_types = ("npu",)
    auto_select = False

    def unavailable_reasons(self, device: torch.device) -> list[str]:
        reasons = super().unavailable_reasons(device)
        if reasons:
            return reasons
        if importlib.util.find_spec("torch_npu") is None:
            return ["torch_npu is not importable (install Ascend's torch_npu; this adapter is also unverified "
                    "on hardware)"]
        if not hasattr(_torch_npu(), "npu_sparse_flash_attention"):
            return ["this torch_npu has no npu_sparse_flash_attention (needs a release with DSA operators)"]
        return []

    def shape_reasons(self, p) -> list[str]:
        reasons = []
        if p.q.shape[-1] != _D_LATENT + _D_ROPE:
            reasons.append(f"d_qk must be 576 (512 latent + 64 rope), got {p.q.shape[-1]}")
        if p.attn_sink is not None:
            reasons.append("attn_sink is not mapped to the op")
        if p.topk_length is not None:
            reasons.append("topk_length is not mapped to the op")
        if p.op == "sparse_prefill" and p.kv.shape[1] != 1:
            reasons.append(f"h_kv must be 1, got {p.kv.shape[1]}")
        if p.op == "sparse_decode":
            if p.fmt is not KVCacheFormat.BF16:
                reasons.append(f"the op reads bf16/fp16 caches, not {p.fmt.name} (quantized caches have their "
                               "own operator, not mapped)")
            if p.extra_k_cache is not None:
                reasons.append("the op takes no extra cache")
        return reasons

    def sparse_prefill(self, p):
        return _attend(p.q, p.kv, p.indices, p.sm_scale)

    def sparse_decode(self, p):
        b, s_q, h_q, d = p.q.shape
        slots = p.k_cache.shape[0] * p.k_cache.shape[1]
        out, _, lse = _attend(p.q.reshape(b * s_q, h_q, d), p.k_cache.reshape(slots, 1, d),
                              p.indices.reshape(b * s_q, 1, -1), p.sm_scale)
        return out.view(b, s_q, h_q, _D_LATENT), lse.view(b, s_q, h_q)
