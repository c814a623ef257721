"""``V4Attention``: the attention of a DeepSeek V4 sliding-window layer over a paged cache, on anymla's kernels.

V4 attends with one shared key/value head of 512 channels ``[nope 448 | rope 64]`` (K = V: the cache row is
both), interleaved RoPE on the trailing 64 channels of q and of the row, a learnable sink per head, a causal
window of ``sliding_window`` positions, and a grouped low-rank output projection; the rope part of the output
is rotated back by the query's own angle before it. Per call: the q LoRA GEMMs with their RMSNorms, the kv
GEMM with its RMSNorm and RoPE, the rows written into the cache in its format (bf16 512, MODEL1/V4 FP8 584,
V4.1 FP8 528, V4.1 FP4 288: :func:`anymla.layers.write_cache`), each query's window turned into cache slots,
anymla's sparse decoding over them (``d_qk = d_v = 512``, the sinks as ``attn_sink``), and the grouped output
projection. Prefill and decoding are the same call (``s`` new tokens a request).

On the Triton tier a step is four torch GEMMs / bmms, three Triton kernels (the prolog: both latents'
norms, the row's RoPE and cache write; the query heads' norm and RoPE with each query's window slots; the
output's rotation back) and the attention call (:mod:`anymla.layers.v4_kernels`).

Layers with a compressor (V4's compressed sparse and heavily compressed attention) are not built: their
compressed rows and indexer are not here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Optional

import torch
import torch.nn.functional as F

from .. import api
from ..debug import debug_enabled
from ..kvcache import KVCacheFormat, detect_format
from ..metadata import get_mla_metadata
from . import kernels
from .cache_write import check_slot_count
from .explain import StepExplanation
from .rope import RopeTable, check_positions
from .slots import check_block_table
from .steps import compiled_step
from .v4_kernels import HEAD_DIM, ROPE, run_v4_heads, run_v4_prolog

__all__ = ["V4Attention", "V4Config"]

_FORMATS = (KVCacheFormat.BF16, KVCacheFormat.MODEL1_FP8, KVCacheFormat.V41_FP8, KVCacheFormat.V41_FP4)


@dataclass(frozen=True)
class V4Config:
    """One V4 sliding-window attention layer (Hugging Face ``DeepseekV4Config`` naming); ``rope_parameters``
    is the layer's own rope (V4's ``"main"`` entry: ``rope_theta``, ``rope_type`` "default")."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6

    def __post_init__(self):
        for name in ("hidden_size", "num_heads", "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected a positive size, got {getattr(self, name)}")
        if self.num_heads % self.o_groups:
            raise ValueError(f"o_groups: must divide num_heads = {self.num_heads}, got {self.o_groups}")

    @property
    def softmax_scale(self) -> float:
        return HEAD_DIM ** -0.5


class _V4Plan(NamedTuple):
    """What one call signature of :meth:`V4Attention.forward` fixes."""

    fmt: KVCacheFormat
    sched: object  # the attention call's FlashMLASchedMeta
    kernels: str  # the layer kernels' implementation: "triton" or "torch"
    kernels_reason: str
    launchers: object  # cache_write.launch.V4StepLaunchers bound to this signature, or None (torch)
    back: torch.Tensor  # [sliding_window] offsets 0 .. window - 1 of a query's window (positions' dtype)


class V4Attention(torch.nn.Module):
    """One V4 sliding-window attention layer (inference only; weights are buffers). Build it with
    :meth:`from_weights` (Hugging Face parameter names) or :func:`anymla.layers.from_hf_v4`."""

    def __init__(self, config: V4Config, *, dtype: torch.dtype = torch.bfloat16, device=None,
                 max_positions: Optional[int] = None):
        super().__init__()
        if dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"dtype: the attention kernels take bfloat16 or float16 queries, got {dtype}")
        self.config = c = config
        h = c.num_heads

        def empty(*shape, dt=dtype):
            return torch.empty(*shape, dtype=dt, device=device)

        self.register_buffer("w_qkv_a", empty(c.q_lora_rank + HEAD_DIM, c.hidden_size))  # [q_a_proj; kv_proj]
        self.register_buffer("q_a_norm", empty(c.q_lora_rank, dt=torch.float32))
        self.register_buffer("w_q_b", empty(h * HEAD_DIM, c.q_lora_rank))
        self.register_buffer("kv_norm", empty(HEAD_DIM, dt=torch.float32))
        # o_a: one [o_lora_rank, heads a group x 512] block per group, laid out for one bmm
        self.register_buffer("w_o_a_t", empty(c.o_groups, h * HEAD_DIM // c.o_groups, c.o_lora_rank))
        self.register_buffer("w_o_b", empty(c.hidden_size, c.o_groups * c.o_lora_rank))
        self.register_buffer("sinks", empty(h, dt=torch.float32))
        table = RopeTable.build(ROPE, c.rope_parameters, max_positions or c.max_position_embeddings, "interleaved",
                                c.max_position_embeddings, device)
        self.register_buffer("rope_cos", table.cos)
        self.register_buffer("rope_sin", table.sin)
        self.register_buffer("rope_sin_back", -table.sin)  # the rotation by minus the angle (the output's rope)
        self.kernel_backend: Optional[str] = None
        self.attention_backend: Optional[str] = None
        self._plans: dict = {}  # call signature -> _V4Plan

    @classmethod
    def from_weights(cls, config: V4Config, weights: Mapping[str, torch.Tensor], **kwargs) -> "V4Attention":
        """Load ``q_a_proj``, ``q_a_norm``, ``q_b_proj``, ``kv_proj``, ``kv_norm``, ``o_a_proj``, ``o_b_proj``
        (``.weight``) and ``sinks``, as Hugging Face's ``DeepseekV4Attention`` names them."""
        layer = cls(config, **kwargs)
        c = config

        def w(name):
            if name not in weights:
                raise KeyError(f"weights: missing {name!r} (have {sorted(weights)[:12]}...)")
            return weights[name].detach()

        with torch.no_grad():
            layer.w_qkv_a.copy_(torch.cat([w("q_a_proj.weight"), w("kv_proj.weight")]))
            layer.q_a_norm.copy_(w("q_a_norm.weight"))
            layer.w_q_b.copy_(w("q_b_proj.weight"))
            layer.kv_norm.copy_(w("kv_norm.weight"))
            o_a = w("o_a_proj.weight").view(c.o_groups, c.o_lora_rank, -1)
            layer.w_o_a_t.copy_(o_a.transpose(1, 2))
            layer.w_o_b.copy_(w("o_b_proj.weight"))
            layer.sinks.copy_(w("sinks"))
        return layer

    @torch.no_grad()
    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                block_table: torch.Tensor, *, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One attention layer for ``s`` new tokens of each of ``b`` requests.

        Args:
            hidden_states: ``[b, s, hidden_size]`` in the layer's dtype (the input-normed activations).
            positions: ``[b, s]`` int token positions of the new tokens, written to the cache before attention
                (each query attends its own position and the ``sliding_window - 1`` before it).
            kv_cache: ``[num_blocks, page_size, 1, 512]`` bf16/fp16, or V4-family bytes ``[.., 584 | 528 | 288]``
                (:mod:`anymla.kvcache`).
            block_table: ``[b, max_blocks]`` int32; positions past it are neither written nor read.
            residual: ``[b, s, hidden_size]`` added to the output.
        Returns:
            ``[b, s, hidden_size]`` in the layer's dtype.

        On the Triton tier, after the first call of a signature, a step runs from one compiled entry
        (:mod:`anymla.callpath`): its GEMMs, its three kernels and its attention call without Python.
        """
        return compiled_step(
            self, (hidden_states, positions, kv_cache, block_table, residual), kv_cache.device,
            lambda: self._plan_for(hidden_states, positions, kv_cache, block_table, residual),
            lambda plan: self._step(plan, hidden_states, positions, kv_cache, block_table, residual),
            lambda plan: [*self.buffers(), plan.back])

    def _step(self, plan: _V4Plan, hidden_states, positions, kv_cache, block_table, residual) -> torch.Tensor:
        """:meth:`forward`'s Python path for a call of ``plan``'s signature."""
        impl, bound = plan.kernels, plan.launchers
        c, h = self.config, self.config.num_heads
        b, s, _ = hidden_states.shape
        t, r, eps = b * s, c.q_lora_rank, c.rms_norm_eps
        x = hidden_states.reshape(t, c.hidden_size)
        pos = positions.reshape(t)
        table = RopeTable(self.rope_cos, self.rope_sin, "interleaved")
        if debug_enabled():
            check_positions(positions, table)

        qkv = F.linear(x, self.w_qkv_a)
        q_lat = run_v4_prolog(impl, plan.fmt, qkv[:, r:], self.kv_norm, eps, qkv[:, :r], self.q_a_norm, pos, table,
                              kv_cache, block_table, None if bound is None else bound.prolog)
        # the query heads normed and roped, and each query's window (its position and the sliding_window - 1
        # before it) as cache slots
        q, slots = run_v4_heads(impl, F.linear(q_lat, self.w_q_b).view(t, h, HEAD_DIM), pos, table, eps,
                                None if bound is None else bound.query,
                                (block_table, plan.back, kv_cache.shape[1]))
        args, kwargs = self._attention_call(plan, q.view(b, s, h, HEAD_DIM), kv_cache, slots)
        o, _ = api.flash_mla_with_kvcache(*args, **kwargs)
        # K = V: the output's rope channels carry the keys' rotations; rotate them back by the query's angle
        o, _ = run_v4_heads(impl, o.reshape(t, h, HEAD_DIM), pos, RopeTable(self.rope_cos, self.rope_sin_back,
                                                                          "interleaved"), None,
                            None if bound is None else bound.output)
        g = c.o_groups
        mixed = torch.empty(t, g * c.o_lora_rank, dtype=x.dtype, device=x.device)
        torch.bmm(o.view(t, g, -1).transpose(0, 1), self.w_o_a_t,
                  out=mixed.view(t, g, c.o_lora_rank).transpose(0, 1))  # [groups, t, o_lora_rank] as [t, groups x r]
        out = F.linear(mixed, self.w_o_b) if residual is None else \
            torch.addmm(residual.reshape(t, c.hidden_size), mixed, self.w_o_b.t())
        return out.view(b, s, c.hidden_size)

    def _attention_call(self, plan: _V4Plan, q, kv_cache, slots) -> tuple:
        """The arguments of a step's attention call (``q [b, s, h, 512]``, the window ``slots [b, s, window]``)."""
        return (q, kv_cache, None, None, HEAD_DIM, plan.sched), dict(
            softmax_scale=self.config.softmax_scale, is_fp8_kvcache=plan.fmt.is_quantized, indices=slots,
            attn_sink=self.sinks, backend=self.attention_backend)

    def explain(self, hidden_states: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                block_table: torch.Tensor, *, residual: Optional[torch.Tensor] = None) -> StepExplanation:
        """What :meth:`forward` runs for these arguments' call signature (checked and planned as forward plans
        it; nothing is computed or written); ``print()`` it."""
        plan = self._plan_for(hidden_states, positions, kv_cache, block_table, residual)
        b, s, _ = hidden_states.shape
        w = self.config.sliding_window
        q = torch.empty(b, s, self.config.num_heads, HEAD_DIM, dtype=hidden_states.dtype, device=kv_cache.device)
        slots = torch.empty(b, s, w, dtype=torch.int32, device=kv_cache.device)
        args, kwargs = self._attention_call(plan, q, kv_cache, slots)
        launches = ("four GEMMs / bmms and three Triton kernels (the prolog with the cache write; the query heads "
                    "with the window slots; the output's rotation back)" if plan.kernels == "triton" else
                    "four GEMMs / bmms and the norms', RoPE's, slots' and writer's torch ops")
        return StepExplanation("V4Attention", plan.fmt, f"sparse decoding over a window of {w} positions, sinks",
                               plan.kernels, plan.kernels_reason, launches,
                               api.explain(api.flash_mla_with_kvcache, *args, **kwargs))

    def _plan_for(self, hidden_states, positions, kv_cache, block_table, residual) -> _V4Plan:
        """The plan of the arguments' call signature (shapes, dtypes, strides, devices, the overrides), checked
        and made on its first call."""
        key = tuple((a.shape, a.dtype, a.device, a.stride()) if isinstance(a, torch.Tensor) else a
                    for a in (hidden_states, positions, kv_cache, block_table, residual, self.kernel_backend,
                              self.attention_backend))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._plan(hidden_states, positions, kv_cache, block_table, residual)
        return plan

    def _plan(self, hidden_states, positions, kv_cache, block_table, residual):
        c = self.config
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != c.hidden_size:
            raise ValueError(f"hidden_states: expected [b, s, {c.hidden_size}], got {tuple(hidden_states.shape)}")
        if hidden_states.dtype != self.w_o_b.dtype:
            raise TypeError(f"hidden_states: expected the layer's dtype {self.w_o_b.dtype}, got "
                            f"{hidden_states.dtype}")
        b, s, _ = hidden_states.shape
        if positions.shape != (b, s) or positions.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"positions: expected [b, s] = [{b}, {s}] int32/int64, got {tuple(positions.shape)} "
                             f"{positions.dtype}")
        fmt = detect_format(kv_cache, "kv_cache")
        if fmt not in _FORMATS or kv_cache.dim() != 4 or kv_cache.shape[2] != 1 or \
                (fmt is KVCacheFormat.BF16 and kv_cache.shape[-1] != HEAD_DIM):
            raise ValueError("kv_cache: expected a V4 cache [num_blocks, page_size, 1, 512] bf16/fp16 or "
                             "MODEL1_FP8 / V41_FP8 / V41_FP4 bytes, got "
                             f"{fmt.name} of shape {tuple(kv_cache.shape)}")
        check_slot_count(kv_cache, "kv_cache")
        check_block_table(block_table, b, kv_cache.device)
        if block_table.shape[0] != b:
            raise ValueError(f"block_table: expected [b, max_blocks] with b = {b}, got {tuple(block_table.shape)}")
        if residual is not None and residual.shape != hidden_states.shape:
            raise ValueError(f"residual: expected {tuple(hidden_states.shape)}, got {tuple(residual.shape)}")
        for name, t in (("hidden_states", hidden_states), ("positions", positions), ("residual", residual)):
            if t is not None and t.device != kv_cache.device:
                raise ValueError(f"{name}: expected a tensor on {kv_cache.device} (the cache's device), got {t.device}")
        if self.w_o_b.device != kv_cache.device:
            raise ValueError(f"kv_cache: expected a tensor on the layer's device {self.w_o_b.device}, got "
                             f"{kv_cache.device}")
        impl, reason = kernels.choose(kv_cache.device, self.kernel_backend)
        bound = None
        if impl == "triton":
            from anymla.triton_kernels.cache_write import launch
            bound = launch.v4_step_launchers(kv_cache.device)
        back = torch.arange(c.sliding_window, device=kv_cache.device, dtype=positions.dtype)
        return _V4Plan(fmt, get_mla_metadata()[0], impl, reason, bound, back)
