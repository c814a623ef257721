"""Build an :class:`MLAAttention` from a Hugging Face ``DeepseekV3Attention`` / ``DeepseekV32Attention``, and a
:class:`V4Attention` from a ``DeepseekV4Attention`` of a sliding-window layer.

Reads only the module's attributes and weights, so anymla never imports ``transformers``.
"""

from __future__ import annotations

from typing import Optional

import torch

from .attention import MLAAttention
from .config import MLAConfig
from .v4 import V4Attention, V4Config

__all__ = ["from_hf", "config_from_hf", "from_hf_v4", "config_from_hf_v4"]


def _rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None)
    if params:  # transformers >= 5
        return dict(params)
    legacy = dict(getattr(config, "rope_scaling", None) or {})  # transformers 4.x: rope_scaling + rope_theta
    if "type" in legacy and "rope_type" not in legacy:
        legacy["rope_type"] = legacy.pop("type")
    legacy.setdefault("rope_type", "default")
    legacy["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    return legacy


def config_from_hf(attn, config=None) -> MLAConfig:
    """The :class:`MLAConfig` of a Hugging Face DeepSeek V3 / V3.2 attention module (``config`` defaults to
    ``attn.config``). ``rope_interleave=False`` configs (weights already permuted) rotate halves."""
    cfg = attn.config if config is None else config
    q_lora = getattr(attn, "q_lora_rank", None)
    return MLAConfig(
        hidden_size=cfg.hidden_size, num_heads=attn.num_heads, q_lora_rank=q_lora,
        qk_nope_head_dim=attn.qk_nope_head_dim, v_head_dim=attn.v_head_dim, kv_lora_rank=attn.kv_lora_rank,
        qk_rope_head_dim=attn.qk_rope_head_dim, rope_parameters=_rope_parameters(cfg),
        max_position_embeddings=cfg.max_position_embeddings,
        rope_style="interleaved" if getattr(cfg, "rope_interleave", True) else "neox",
        q_norm_eps=attn.q_a_layernorm.variance_epsilon if q_lora else 1e-6,
        kv_norm_eps=attn.kv_a_layernorm.variance_epsilon, attention_bias=bool(getattr(cfg, "attention_bias", False)))


def from_hf(attn, config=None, *, dtype: torch.dtype = torch.bfloat16, device=None,
            max_positions: Optional[int] = None) -> MLAAttention:
    """An :class:`MLAAttention` holding ``attn``'s weights (absorbed once, here) in ``dtype`` on ``device``
    (default: the weights' device), with the module's own softmax scale (YaRN's mscale included)."""
    mla_config = config_from_hf(attn, config)
    weights = dict(attn.state_dict())
    device = next(iter(weights.values())).device if device is None else device
    return MLAAttention.from_weights(mla_config, weights, dtype=dtype, device=device, max_positions=max_positions,
                                     softmax_scale=float(attn.scaling))


def config_from_hf_v4(attn) -> V4Config:
    """The :class:`V4Config` of a Hugging Face ``DeepseekV4Attention`` of a ``sliding_attention`` layer (the
    compressed layers' compressors and indexer are not built: those raise)."""
    cfg = attn.config
    if attn.layer_type != "sliding_attention":
        raise ValueError(f"attn: a {attn.layer_type} layer; anymla builds V4's sliding_attention layers only (the "
                         "compressed layers' compressor and indexer are not built)")
    if attn.head_dim != 512:
        raise ValueError(f"attn: V4's kernels hold a 512-channel head, got head_dim {attn.head_dim}")
    rope = dict(cfg.rope_parameters[attn.rope_layer_type])
    if int(round(rope.get("partial_rotary_factor", 64 / 512) * attn.head_dim)) != 64:
        raise ValueError(f"attn: expected 64 rope channels a head, got partial_rotary_factor "
                         f"{rope.get('partial_rotary_factor')} of {attn.head_dim}")
    return V4Config(hidden_size=cfg.hidden_size, num_heads=attn.num_heads, q_lora_rank=cfg.q_lora_rank,
                    o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank, sliding_window=attn.sliding_window,
                    rope_parameters=rope, max_position_embeddings=cfg.max_position_embeddings,
                    rms_norm_eps=attn.kv_norm.variance_epsilon)


def from_hf_v4(attn, *, dtype: torch.dtype = torch.bfloat16, device=None,
               max_positions: Optional[int] = None) -> V4Attention:
    """A :class:`V4Attention` holding ``attn``'s weights in ``dtype`` (norm weights and sinks in fp32) on
    ``device`` (default: the weights' device)."""
    weights = dict(attn.state_dict())
    device = next(iter(weights.values())).device if device is None else device
    return V4Attention.from_weights(config_from_hf_v4(attn), weights, dtype=dtype, device=device,
                                    max_positions=max_positions)
