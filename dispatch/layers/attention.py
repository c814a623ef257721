"""``MLAAttention``: DeepSeek V3 / V3.2 multi-head latent attention for inference over a paged cache.

Per call: one GEMM for the q and kv down-projections, the fused prolog (RMSNorm of both latents, RoPE of
k_pe, the cache write in the cache's format at the block table's slots), the q up-projection, the absorbed
q (``q_nope @ W_UK`` per head, a bmm writing into the query), then one kernel rotating q_pe beside it and
turning the DSA indices into cache slots, anymla's attention in the 512-wide latent space, ``W_UV`` (a bmm writing
``o_proj``'s input layout) and ``o_proj`` (with the residual added in the same GEMM). ``W_UK`` / ``W_UV``
are split out of ``kv_b_proj`` and laid out for the bmms once, at load; what a call signature fixes is
checked and planned once per signature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional

import torch
import torch.nn.functional as F

from .. import api
from ..debug import debug_enabled
from ..kvcache import KVCacheFormat
from ..metadata import FlashMLASchedMeta, get_mla_metadata
from . import kernels
from .config import MLAConfig
from .explain import StepExplanation
from .prolog import check_prolog_cache, run_assemble_q, run_prolog
from .rope import RopeTable, check_positions
from .slots import check_block_table, check_slot_inputs
from .steps import compiled_step

if TYPE_CHECKING:
    from anymla.triton_kernels.cache_write.launch import StepLaunchers

__all__ = ["MLAAttention"]


def _signature(*args) -> tuple:
    """What a call's plan depends on: each tensor's shape, dtype, device and strides, None, or a setting."""
    return tuple((a.shape, a.dtype, a.device, a.stride()) if isinstance(a, torch.Tensor) else a for a in args)


@dataclass(frozen=True)
class _StepPlan:
    """What one call signature of :meth:`MLAAttention.forward` fixes."""

    fmt: KVCacheFormat
    kernels: str  # the prolog / assembly / slot kernels' implementation: "triton" or "torch"
    kernels_reason: str
    sparse: bool  # sparse decoding (indices given, or a quantized cache) rather than dense
    sched: FlashMLASchedMeta
    every_position: Optional[torch.Tensor]  # [max_blocks * page] int32: the indices of sparse calls without any
    launchers: Optional["StepLaunchers"]  # the Triton kernels' launchers bound to this signature, or None (torch)


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
        # call signature -> _StepPlan; kept (a CUDA graph of a step replays into its metadata's workspaces)
        self._plans: dict = {}

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

    @torch.no_grad()
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
                indexer's top-k); ``-1``, positions after the query's own and positions past the block table
                are skipped. Without indices a bf16 cache is attended densely (causal) and an FP8 cache through
                every position up to the query's (sparse attention over all of them: FP8 caches are read
                sparsely).
            residual: ``[b, s, hidden_size]`` added to the output inside the o_proj GEMM.
        Returns:
            ``[b, s, hidden_size]`` in the layer's dtype.

        What a call signature fixes (shapes, dtypes, strides, devices, which optional inputs are given) is
        checked and planned on its first call (:meth:`_plan`); later calls launch only: on the Triton tier a
        decode step is five torch GEMMs, two Triton kernels and the attention call, which after the first
        call of a signature run from one compiled entry (:mod:`anymla.callpath`) without Python.
        """
        return compiled_step(
            self, (hidden_states, positions, kv_cache, block_table, cache_seqlens, indices, residual), kv_cache.device,
            lambda: self._plan_for(hidden_states, positions, kv_cache, block_table, cache_seqlens, indices, residual),
            lambda plan: self._step(plan, hidden_states, positions, kv_cache, block_table, cache_seqlens, indices,
                                    residual),
            lambda plan: [*self.buffers(), *(() if plan.every_position is None else (plan.every_position,))])

    def _step(self, plan: "_StepPlan", hidden_states, positions, kv_cache, block_table, cache_seqlens, indices,
              residual) -> torch.Tensor:
        """:meth:`forward`'s Python path for a call of ``plan``'s signature."""
        c, h = self.config, self.config.num_heads
        b, s, _ = hidden_states.shape
        t, nope = b * s, c.qk_nope_head_dim
        x = hidden_states.reshape(t, c.hidden_size)
        pos = positions.reshape(t)
        rope = self.rope
        if debug_enabled():
            check_positions(positions, rope)

        a = F.linear(x, self.w_qkv_a, self.b_qkv_a)
        r = c.q_lora_rank or 0
        bound = plan.launchers
        q_lat = run_prolog(plan.kernels, plan.fmt, a[:, r:], self.kv_norm_weight, c.kv_norm_eps, pos, rope, kv_cache,
                           None, block_table, a[:, :r] if r else None, self.q_norm_weight, c.q_norm_eps,
                           None if bound is None else bound.prolog)
        q = F.linear(q_lat if r else x, self.w_q).view(t, h, c.qk_head_dim)
        q_full = torch.empty(t, h, c.d_qk, dtype=x.dtype, device=x.device)
        # The absorbed q_nope (W_UK per head) goes straight into the query's first 512 columns (cuBLAS writes
        # the transposed view in place); the assembly then only rotates q_pe into the last 64.
        torch.bmm(q[..., :nope].transpose(0, 1), self.w_uk, out=q_full[..., :c.kv_lora_rank].transpose(0, 1))
        slots_of = None
        if plan.sparse:  # the DSA indices' cache slots come from the assembly's launch
            slots_of = (plan.every_position.expand(b, s, -1) if indices is None else indices, block_table,
                        kv_cache.shape[1])
        slots = run_assemble_q(plan.kernels, None, q[..., nope:], pos, rope, q_full,
                               None if bound is None else bound.assemble, slots_of)

        o = self._attend(plan, q_full.view(b, s, h, c.d_qk), kv_cache, block_table, cache_seqlens, slots)
        o_v = torch.empty(t, h * c.v_head_dim, dtype=x.dtype, device=x.device)
        torch.bmm(o.reshape(t, h, c.kv_lora_rank).transpose(0, 1), self.w_uv_t,
                  out=o_v.view(t, h, c.v_head_dim).transpose(0, 1))               # [h, t, v] written as [t, h * v]
        if residual is None:
            out = F.linear(o_v, self.w_o, self.b_o)
        else:
            res = residual.reshape(t, c.hidden_size)
            out = torch.addmm(res if self.b_o is None else res + self.b_o, o_v, self.w_o.t())
        return out.view(b, s, c.hidden_size)

    def _attend(self, plan: "_StepPlan", q, kv_cache, block_table, cache_seqlens, slots):
        """anymla's attention over the cache: dense decoding for a bf16 cache without indices, sparse
        decoding at the DSA indices' cache ``slots`` otherwise. Returns ``[b, s, h, 512]``."""
        args, kwargs = self._attention_call(plan, q, kv_cache, block_table, cache_seqlens, slots)
        return api.flash_mla_with_kvcache(*args, **kwargs)[0]

    def _attention_call(self, plan: "_StepPlan", q, kv_cache, block_table, cache_seqlens, slots) -> tuple:
        """The arguments of a step's attention call (``q [b, s, h, 576]``; ``slots`` for sparse decoding)."""
        if not plan.sparse:
            return (q, kv_cache, block_table, cache_seqlens, 512, plan.sched), dict(
                softmax_scale=self.softmax_scale, causal=q.shape[1] > 1, backend=self.attention_backend)
        return (q, kv_cache, None, None, 512, plan.sched), dict(
            softmax_scale=self.softmax_scale, is_fp8_kvcache=plan.fmt.is_quantized, indices=slots,
            backend=self.attention_backend)

    def explain(self, hidden_states: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                block_table: torch.Tensor, cache_seqlens: torch.Tensor, *, indices: Optional[torch.Tensor] = None,
                residual: Optional[torch.Tensor] = None) -> StepExplanation:
        """What :meth:`forward` runs for these arguments' call signature (checked and planned as forward plans
        it; nothing is computed or written): the cache format, how the step attends, its kernels'
        implementation and why, and the dispatcher's decision for its attention call. ``print()`` it."""
        plan = self._plan_for(hidden_states, positions, kv_cache, block_table, cache_seqlens, indices, residual)
        b, s, _ = hidden_states.shape
        q = torch.empty(b, s, self.config.num_heads, self.config.d_qk, dtype=hidden_states.dtype,
                        device=kv_cache.device)
        slots = None
        if plan.sparse:  # the slots the q assembly's launch writes: [b, s, topk] int32
            topk = plan.every_position.shape[0] if indices is None else indices.shape[-1]
            slots = torch.empty(b, s, topk, dtype=torch.int32, device=kv_cache.device)
        args, kwargs = self._attention_call(plan, q, kv_cache, block_table, cache_seqlens, slots)
        if not plan.sparse:
            attends = "dense decoding" + (" (causal)" if s > 1 else "")
        elif indices is None:
            attends = "sparse decoding over every earlier position (a quantized cache is read sparsely)"
        else:
            attends = f"sparse decoding at the DSA indices (topk {indices.shape[-1]})"
        launches = ("five GEMMs / bmms and two Triton kernels (the prolog; the q assembly" +
                    (" with the DSA slots)" if plan.sparse else ")") if plan.kernels == "triton" else
                    "five GEMMs / bmms and the prolog's, the q assembly's and the slots' torch ops")
        return StepExplanation("MLAAttention", plan.fmt, attends, plan.kernels, plan.kernels_reason, launches,
                               api.explain(api.flash_mla_with_kvcache, *args, **kwargs))

    def _plan_for(self, hidden_states, positions, kv_cache, block_table, cache_seqlens, indices,
                  residual) -> "_StepPlan":
        """The plan of the arguments' call signature, checked and made on its first call (:meth:`_plan`)."""
        plan = self._plans.get(_signature(hidden_states, positions, kv_cache, block_table, cache_seqlens, indices,
                                          residual, self.kernel_backend, self.attention_backend))
        if plan is None:
            plan = self._plan(hidden_states, positions, kv_cache, block_table, cache_seqlens, indices, residual)
        return plan

    def _plan(self, hidden_states, positions, kv_cache, block_table, cache_seqlens, indices, residual) -> "_StepPlan":
        """Check a new call signature and fix what it determines: the cache format, the kernels' implementation
        and the scheduling metadata (FlashMLA's reuse rule: one object per configuration, so a decode step
        that runs the same shapes again, and a CUDA graph of it, reuses its plan)."""
        self._check(hidden_states, positions, kv_cache, block_table, cache_seqlens, indices, residual)
        fmt = check_prolog_cache(kv_cache)
        check_block_table(block_table, hidden_states.shape[0], kv_cache.device)
        if indices is not None:
            check_slot_inputs(indices, positions, block_table, kv_cache.shape[1])
        for name, t in (("hidden_states", hidden_states), ("positions", positions), ("cache_seqlens", cache_seqlens),
                        ("residual", residual)):
            if t is not None and t.device != kv_cache.device:
                raise ValueError(f"{name}: expected a tensor on {kv_cache.device} (the cache's device), got {t.device}")
        if self.w_o.device != kv_cache.device:
            raise ValueError(f"kv_cache: expected a tensor on the layer's device {self.w_o.device}, got "
                             f"{kv_cache.device}")
        sparse = indices is not None or fmt is not KVCacheFormat.BF16
        every_position = None
        if sparse and indices is None:
            every_position = torch.arange(block_table.shape[1] * kv_cache.shape[1], dtype=torch.int32,
                                          device=kv_cache.device)
        impl, reason = kernels.choose(kv_cache.device, self.kernel_backend)
        launchers = None
        if impl == "triton":
            from anymla.triton_kernels.cache_write import launch
            launchers = launch.step_launchers(kv_cache.device)
        plan = _StepPlan(fmt, impl, reason, sparse, get_mla_metadata()[0], every_position, launchers)
        key = _signature(hidden_states, positions, kv_cache, block_table, cache_seqlens, indices, residual,
                         self.kernel_backend, self.attention_backend)
        self._plans[key] = plan
        return plan

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
