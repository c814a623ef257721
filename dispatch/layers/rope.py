"""RoPE for the MLA layer: the cos / sin table (default or YaRN frequencies, YaRN's attention factor folded
in, as DeepSeek and Hugging Face compute them) and the rotation in either channel layout.

DeepSeek's checkpoints rotate *interleaved* pairs ``(x[2i], x[2i+1])`` by frequency ``i`` (``rope_style
"interleaved"``); Hugging Face's ``rope_interleave=True`` path computes the same rotation but returns it
de-interleaved (``[evens | odds]``), and configs with ``rope_interleave=False`` (weights already permuted)
rotate halves ``(x[i], x[i+32])`` (``"neox"``). Here a rotation keeps its input's layout, so q_pe and k_pe
meet in the same layout (the score is unchanged by a permutation applied to both) and the cache holds
DeepSeek's own interleaved rope part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..problems import first_bad

__all__ = ["RopeTable", "rope_frequencies", "yarn_mscale", "apply_rope"]

STYLES = ("interleaved", "neox")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(dim: int, params: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dim // 2] fp32, attention_factor)`` for Hugging Face-style ``rope_parameters``:
    ``rope_type`` ``"default"`` (``rope_theta`` only) or ``"yarn"`` (``factor``,
    ``original_max_position_embeddings``, ``beta_fast`` 32, ``beta_slow`` 1, ``mscale``, ``mscale_all_dim``,
    ``attention_factor``, ``truncate`` True)."""
    base = float(params.get("rope_theta", 10000.0))
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    if rope_type != "yarn":
        raise ValueError(f"rope_parameters: rope_type must be 'default' or 'yarn' (DeepSeek's), got {rope_type!r}")
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(params.get("beta_fast") or 32), correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1 where the original frequency is kept
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


@dataclass
class RopeTable:
    """Precomputed rotation angles: ``cos`` / ``sin`` ``[max_positions, rope_dim // 2]`` fp32, YaRN's
    attention factor folded in (as the model scales its cos / sin), and the channel layout."""

    cos: torch.Tensor
    sin: torch.Tensor
    style: str

    @classmethod
    def build(cls, dim: int, params: dict, max_positions: int, style: str = "interleaved",
              max_position_embeddings: Optional[int] = None, device=None) -> "RopeTable":
        if style not in STYLES:
            raise ValueError(f"style: expected one of {STYLES}, got {style!r}")
        inv_freq, factor = rope_frequencies(dim, params, max_position_embeddings or max_positions)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        return cls((freqs.cos() * factor).to(device), (freqs.sin() * factor).to(device), style)

    def to(self, device) -> "RopeTable":
        return RopeTable(self.cos.to(device), self.sin.to(device), self.style)


def _pairs(style: str, dim: int) -> tuple[slice, slice]:
    return (slice(0, dim, 2), slice(1, dim, 2)) if style == "interleaved" else (slice(0, dim // 2),
                                                                                 slice(dim // 2, dim))


def apply_rope(x: torch.Tensor, positions: torch.Tensor, table: RopeTable) -> torch.Tensor:
    """Rotate ``x [..., rope_dim]`` at ``positions`` (broadcastable to ``x.shape[:-1]``) in fp32, keeping the
    layout; returns fp32 (callers round once)."""
    cos, sin = table.cos[positions.long()], table.sin[positions.long()]
    a_at, b_at = _pairs(table.style, x.shape[-1])
    x = x.float()
    a, b = x[..., a_at], x[..., b_at]
    out = torch.empty_like(x)
    out[..., a_at] = a * cos - b * sin
    out[..., b_at] = b * cos + a * sin
    return out


def check_positions(positions: torch.Tensor, table: RopeTable, name: str = "positions") -> None:
    """A debug check (it reads ``positions``, :func:`anymla.debug_checks`): every position is a row of the
    table (``[0, max_positions)``). Off, the kernels read the table only at such rows."""
    first_bad(name, (positions < 0) | (positions >= table.cos.shape[0]), positions,
              f"a token position in [0, {table.cos.shape[0]}) (the layer's RoPE table: max_positions)")
