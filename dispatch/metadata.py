"""Scheduling metadata, FlashMLA-compatible (``get_mla_metadata`` / ``FlashMLASchedMeta``).

As in FlashMLA v1.0.0 the metadata is created empty and filled by the first ``flash_mla_with_kvcache``
call: that call records the configuration, and the backend that runs builds its *plan* (how many
splits along the keys, and the fixed-size workspaces the split kernels write into). Later calls must
have the same configuration (checked field by field) and reuse the plan, so one metadata object serves
every layer of a decoding step and is safe to capture in a CUDA graph (the plan holds no value that
depends on ``cache_seqlens`` or ``topk_length``: split ranges are computed on the device from them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class FlashMLASchedMeta:
    """Scheduling metadata for :func:`anymla.flash_mla_with_kvcache`; create one per configuration."""

    @dataclass(frozen=True)
    class Config:
        b: int
        s_q: int
        h_q: int
        page_block_size: int
        h_k: int
        causal: bool
        is_fp8_kvcache: bool
        topk: Optional[int]
        extra_page_block_size: Optional[int]
        extra_topk: Optional[int]
        enable_batch_invariant: bool = False

    have_initialized: bool = False
    config: Optional[Config] = None
    tile_scheduler_metadata: Optional[torch.Tensor] = None
    num_splits: Optional[torch.Tensor] = None
    # anymla: per-backend plans built on the first call that backend serves (never shared across backends).
    plans: dict = field(default_factory=dict)

    def bind(self, config: "FlashMLASchedMeta.Config") -> None:
        """Record ``config`` on first use; afterwards raise if a call's configuration differs."""
        if not self.have_initialized:
            self.config = config
            self.have_initialized = True
            return
        # A decision carries one Config object per call signature: the identity test spares each decode call
        # the field-by-field comparison.
        if self.config is not config and self.config != config:
            diffs = [f"{f.name} {getattr(self.config, f.name)!r} -> {getattr(config, f.name)!r}"
                     for f in dataclasses.fields(config) if getattr(self.config, f.name) != getattr(config, f.name)]
            raise ValueError("tile_scheduler_metadata: this FlashMLASchedMeta was initialised for another "
                             f"configuration ({', '.join(diffs)}); use one metadata object per configuration")

    def plan_for(self, key, build) -> Any:
        """What a backend keeps for this configuration under ``key`` (its name, or a tuple starting with it),
        built once by ``build()``."""
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = build()
        return plan


def get_mla_metadata(*args, **kwargs) -> tuple[FlashMLASchedMeta, None]:
    """Return fresh scheduling metadata, filled lazily by the first decoding call.

    Accepts both call styles: v1.0.0's ``get_mla_metadata()`` and the legacy
    ``get_mla_metadata(cache_seqlens, num_q_tokens_per_head_k, num_heads_k, num_heads_q=None,
    is_fp8_kvcache=False, topk=None)``. Like FlashMLA v1.0.0 it ignores the arguments: the schedule depends
    only on the configuration the first call brings, and split ranges are derived from ``cache_seqlens``
    on the device in every call. Returns ``(metadata, None)``; pass the pair on as
    ``tile_scheduler_metadata, num_splits``.
    """
    return FlashMLASchedMeta(), None
