"""``MLAAttention``: DeepSeek V3 / V3.2 multi-head latent attention for inference over a paged cache.

Per call: one GEMM for the q and kv down-projections, the fused prolog (RMSNorm of both latents, RoPE of
k_pe, the cache write in the cache's format), the q up-projection, the absorbed q (``q_nope @ W_UK`` per
head, a bmm) assembled with the roped q_pe, anymla's attention in the 512-wide latent space, ``W_UV`` (a
bmm) and ``o_proj`` (with the residual added in the same GEMM). ``W_UK`` / ``W_UV`` are split out of
``kv_b_proj`` and laid out for the bmms once, at load.
"""

from __future__ import annotations

from typing import Mapping, Optional

import torch
import torch.nn.functional as F

from .. import api
from ..kvcache import KVCacheFormat, cache_slots, detect_format
from ..metadata import get_mla_metadata
from .config import MLAConfig
from .prolog import assemble_q, mla_prolog
from .rope import RopeTable

__all__ = ["MLAAttention"]


class MLAAttention(torch.nn.Module):
    """One MLA attention layer with absorbed weights (inference only; weights are buffers).

    Build it with :meth:`from_weights` (Hugging Face / DeepSeek parameter names) or
    :func:`anymla.layers.from_hf`. ``kernel_backend`` ("triton" / "torch") forces the prolog kernels,
    ``attention_backend`` the attention call (any anymla backend name); None lets each choose.
    """

    def __init__(self, config: MLAConfig, *, dtype: torch.dtype = torch.bfloat16, device=None,
                 max_positions: Optional[int] = None, softmax_scale: Optional[float] = None):
        super().__init__()
        if dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"dtype: the attention kernels take bfloat16 or float16 queries, got {dtype}")
        self.config = config
        self.softmax_scale = config.softmax_scale if softmax_scale is None else float(softmax_scale)
        c, h = config, config.num_heads
        def empty(*shape):
            return torch.empty(*shape, dtype=dtype, device=device)
        q_rank = c.q_lora_rank
        self.register_buffer("w_qkv_a", empty((q_rank or 0) + c.d_qk, c.hidden_size))
        self.register_buffer("b_qkv_a", empty((q_rank or 0) + c.d_qk) if c.attention_bias else None)
        self.register_buffer("q_norm_weight", empty(q_rank) if q_rank else None)
        self.register_buffer("w_q", empty(h * c.qk_head_dim, q_rank or c.hidden_size))
        self.register_buffer("kv_norm_weight", empty(c.kv_lora_rank))
        self.register_buffer("w_uk", empty(h, c.qk_nope_head_dim, c.kv_lora_rank))
        self.register_buffer("w_uv_t", empty(h, c.kv_lora_rank, c.v_head_dim))
        self.register_buffer("w_o", empty(c.hidden_size, h * c.v_head_dim))
        self.register_buffer("b_o", empty(c.hidden_size) if c.attention_bias else None)
        table = RopeTable.build(c.qk_rope_head_dim, c.rope_parameters, max_positions or c.max_position_embeddings,
                                c.rope_style, c.max_position_embeddings, device)
        self.register_buffer("rope_cos", table.cos)
        self.register_buffer("rope_sin", table.sin)
        self.kernel_backend: Optional[str] = None
        self.attention_backend: Optional[str] = None
        self._sched: dict = {}

    @property
    def rope(self) -> RopeTable:
        return RopeTable(self.rope_cos, self.rope_sin, self.config.rope_style)

    @classmethod
    def from_weights(cls, config: MLAConfig, weights: Mapping[str, torch.Tensor], **kwargs) -> "MLAAttention":
        """Load DeepSeek / Hugging Face attention weights: ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj`` (or
        ``q_proj`` without q LoRA), ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``
        (``.weight``, and ``.bias`` where ``attention_bias``). Other keys (an indexer's) are ignored."""
        layer = cls(config, **kwargs)
        c, h = config, config.num_heads

        def w(name):
            if name not in weights:
                raise KeyError(f"weights: missing {name!r} (have {sorted(weights)[:12]}...)")
            return weights[name].detach()

        with torch.no_grad():
            if c.q_lora_rank:
                layer.w_qkv_a.copy_(torch.cat([w("q_a_proj.weight"), w("kv_a_proj_with_mqa.weight")]))
                layer.q_norm_weight.copy_(w("q_a_layernorm.weight"))
                layer.w_q.copy_(w("q_b_proj.weight"))
                if c.attention_bias:
                    layer.b_qkv_a.copy_(torch.cat([w("q_a_proj.bias"), w("kv_a_proj_with_mqa.bias")]))
            else:
                layer.w_qkv_a.copy_(w("kv_a_proj_with_mqa.weight"))
                layer.w_q.copy_(w("q_proj.weight"))
                if c.attention_bias:
                    layer.b_qkv_a.copy_(w("kv_a_proj_with_mqa.bias"))
            layer.kv_norm_weight.copy_(w("kv_a_layernorm.weight"))
            kv_b = w("kv_b_proj.weight").view(h, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
            layer.w_uk.copy_(kv_b[:, : c.qk_nope_head_dim])                    # k_nope = W_UK @ latent
            layer.w_uv_t.copy_(kv_b[:, c.qk_nope_head_dim:].transpose(1, 2))  # v = W_UV @ latent
            layer.w_o.copy_(w("o_proj.weight"))
            if c.attention_bias:
                layer.b_o.copy_(w("o_proj.bias"))
        return layer

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                block_table: torch.Tensor, cache_seqlens: torch.Tensor, *, indices: Optional[torch.Tensor] = None,
                residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One attention layer for ``s`` new tokens of each of ``b`` requests.

        Args:
            hidden_states: ``[b, s, hidden_size]`` in the layer's dtype (the input-normed activations).
            positions: ``[b, s]`` int token positions; the new tokens are the last ``s`` of each request
                (``positions[i, -1] == cache_seqlens[i] - 1``), written to the cache before attention.
            kv_cache: ``[num_blocks, page_size, 1, 576]`` bf16/fp16 or ``[num_blocks, page_size, 1, 656]``
                V3.2 FP8 bytes (:mod:`anymla.kvcache`).
            block_table: ``[b, max_blocks]`` int32; cache_seqlens: ``[b]`` int32, lengths including the new
                tokens.
            indices: ``[b, s, topk]`` int token positions to attend (DeepSeek Sparse Attention, e.g. an
                indexer's top-k); ``-1`` and positions after the query's own are skipped. Without indices a
                bf16 cache is attended densely (causal) and an FP8 cache through every position up to the
                query's (sparse attention over all of them: FP8 caches are read sparsely).
            residual: ``[b, s, hidden_size]`` added to the output inside the o_proj GEMM.
        Returns:
            ``[b, s, hidden_size]`` in the layer's dtype.
        """
        c, h = self.config, self.config.num_heads
        self._check(hidden_states, positions, kv_cache, block_table, cache_seqlens, indices, residual)
        b, s, _ = hidden_states.shape
        t = b * s
        x = hidden_states.reshape(t, c.hidden_size)
        pos = positions.reshape(t)
        page = kv_cache.shape[1]
        slots = cache_slots(positions, block_table, page).reshape(t)

        a = F.linear(x, self.w_qkv_a, self.b_qkv_a)
        q_rank = c.q_lora_rank or 0
        q_lat = a[:, :q_rank] if q_rank else None
        q_lat = mla_prolog(a[:, q_rank:], self.kv_norm_weight, c.kv_norm_eps, pos, self.rope, kv_cache, slots,
                           q_lat=q_lat, q_norm_weight=self.q_norm_weight, q_eps=c.q_norm_eps,
                           backend=self.kernel_backend)
        q = F.linear(q_lat if q_rank else x, self.w_q).view(t, h, c.qk_head_dim)
        q_nope_abs = torch.bmm(q[..., : c.qk_nope_head_dim].transpose(0, 1), self.w_uk)      # [h, t, 512]
        q_full = assemble_q(q_nope_abs, q[..., c.qk_nope_head_dim:], pos, self.rope, backend=self.kernel_backend)

        o = self._attend(q_full.view(b, s, h, c.d_qk), kv_cache, block_table, cache_seqlens, positions, indices)
        o_v = torch.bmm(o.reshape(t, h, c.kv_lora_rank).transpose(0, 1), self.w_uv_t)        # [h, t, v]
        o_v = o_v.transpose(0, 1).reshape(t, h * c.v_head_dim)
        if residual is None:
            out = F.linear(o_v, self.w_o, self.b_o)
        else:
            res = residual.reshape(t, c.hidden_size)
            out = torch.addmm(res if self.b_o is None else res + self.b_o, o_v, self.w_o.t())
        return out.view(b, s, c.hidden_size)

    def _attend(self, q, kv_cache, block_table, cache_seqlens, positions, indices):
        """anymla's attention over the cache: dense decoding for a bf16 cache without indices, sparse
        decoding (indices turned into cache slots) otherwise. Returns ``[b, s, h, 512]``."""
        b, s = q.shape[:2]
        page = kv_cache.shape[1]
        fmt = detect_format(kv_cache, "kv_cache")
        if indices is None and fmt is KVCacheFormat.BF16:
            sched = self._metadata(("dense", b, s, page, fmt))
            out, _ = api.flash_mla_with_kvcache(q, kv_cache, block_table, cache_seqlens, 512, sched,
                                                softmax_scale=self.softmax_scale, causal=s > 1,
                                                backend=self.attention_backend)
            return out
        if indices is None:
            capacity = block_table.shape[1] * page
            indices = torch.arange(capacity, device=q.device, dtype=torch.int32).expand(b, s, capacity)
        skip = (indices < 0) | (indices > positions[..., None])
        slots = cache_slots(torch.where(skip, -1, indices), block_table, page)
        sched = self._metadata(("sparse", b, s, page, fmt, slots.shape[-1]))
        out, _ = api.flash_mla_with_kvcache(q, kv_cache, None, None, 512, sched, softmax_scale=self.softmax_scale,
                                            is_fp8_kvcache=fmt.is_quantized, indices=slots,
                                            backend=self.attention_backend)
        return out

    def _metadata(self, key):
        """One scheduling metadata object per call configuration (FlashMLA's reuse rule), so a decode step
        that runs the same shapes again (and a CUDA graph of it) reuses its plan."""
        if key not in self._sched:
            self._sched[key] = get_mla_metadata()[0]
        return self._sched[key]

    def _check(self, hidden_states, positions, kv_cache, block_table, cache_seqlens, indices, residual):
        c = self.config
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != c.hidden_size:
            raise ValueError(f"hidden_states: expected [b, s, {c.hidden_size}], got {tuple(hidden_states.shape)}")
        if hidden_states.dtype != self.w_o.dtype:
            raise TypeError(f"hidden_states: expected the layer's dtype {self.w_o.dtype}, got {hidden_states.dtype}")
        b, s, _ = hidden_states.shape
        if positions.shape != (b, s) or positions.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"positions: expected [b, s] = [{b}, {s}] int32/int64, got "
                             f"{tuple(positions.shape)} {positions.dtype}")
        if block_table.dim() != 2 or block_table.shape[0] != b:
            raise ValueError(f"block_table: expected [b, max_blocks] with b = {b}, got {tuple(block_table.shape)}")
        if cache_seqlens.shape != (b,):
            raise ValueError(f"cache_seqlens: expected [b] = [{b}], got {tuple(cache_seqlens.shape)}")
        if indices is not None and (indices.dim() != 3 or indices.shape[:2] != (b, s)):
            raise ValueError(f"indices: expected [b, s, topk] with b = {b}, s = {s}, got {tuple(indices.shape)}")
        if residual is not None and residual.shape != hidden_states.shape:
            raise ValueError(f"residual: expected {tuple(hidden_states.shape)} (as hidden_states), got "
                             f"{tuple(residual.shape)}")
