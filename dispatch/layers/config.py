"""The shape and numerics of one DeepSeek V3 / V3.2 MLA attention layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .rope import STYLES, yarn_mscale

LATENT = 512   # kv_lora_rank: the cache formats and kernels hold a 512-wide latent
ROPE = 64      # qk_rope_head_dim


@dataclass(frozen=True)
class MLAConfig:
    """One MLA attention layer (DeepSeek V3 / V3.2 naming).

    ``q_lora_rank`` None means a direct q projection (V2-Lite style). ``rope_parameters`` is Hugging Face's
    dict (``rope_type`` "default" or "yarn", ``rope_theta``, YaRN's ``factor``, ``mscale``,
    ``mscale_all_dim``, ...). ``rope_style`` is the checkpoint's channel layout (see :mod:`.rope`).
    """

    hidden_size: int
    num_heads: int
    q_lora_rank: Optional[int]
    qk_nope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int = LATENT
    qk_rope_head_dim: int = ROPE
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 4096
    rope_style: str = "interleaved"
    q_norm_eps: float = 1e-6
    kv_norm_eps: float = 1e-6
    attention_bias: bool = False

    def __post_init__(self):
        if self.kv_lora_rank != LATENT or self.qk_rope_head_dim != ROPE:
            raise ValueError(f"kv_lora_rank / qk_rope_head_dim: the MLA kernels hold a {LATENT} + {ROPE} latent "
                             f"row (d_qk 576), got {self.kv_lora_rank} + {self.qk_rope_head_dim}")
        if self.rope_style not in STYLES:
            raise ValueError(f"rope_style: expected one of {STYLES}, got {self.rope_style!r}")
        for name in ("hidden_size", "num_heads", "qk_nope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: expected a positive size, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"q_lora_rank: expected None or a positive rank, got {self.q_lora_rank}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def d_qk(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``qk_head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2`` where the config has
        YaRN with ``mscale_all_dim`` (DeepSeek's rule; absorption leaves the logits, hence the scale, as is)."""
        scale = self.qk_head_dim ** -0.5
        p = self.rope_parameters
        if p.get("rope_type", "default") != "default" and p.get("mscale_all_dim"):
            scale *= yarn_mscale(p["factor"], p["mscale_all_dim"]) ** 2
        return scale
