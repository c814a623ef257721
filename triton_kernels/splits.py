"""Split-KV: how many splits a configuration gets, the fixed-size workspaces, and the combine launch.

The number of splits is a function of the configuration only (batch, heads, cache capacity, device), never
of the values in ``cache_seqlens`` or ``topk_length``: each program derives its own key range from them
on the device. So a plan is built once per FlashMLASchedMeta, reused by every layer, and CUDA-graph safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from anymla import buffers
import triton

from .common import combine_kernel
from .tuning import TileConfig, forced_splits

MAX_SPLITS = 64
_MIN_BLOCKS_PER_SPLIT = 2


@dataclass
class SplitPlan:
    tile: TileConfig
    num_splits: int
    partial_out: Optional[torch.Tensor] = None  # [tokens, splits, heads, 512] fp32
    partial_lse: Optional[torch.Tensor] = None  # [tokens, splits, heads] fp32, log2 domain


def choose_num_splits(programs: int, max_key_blocks: int, cores: int, per_core: int, batch_invariant: bool) -> int:
    """Enough programs to fill every core once (``per_core`` programs a core run at once), at least two key
    blocks per split, at most MAX_SPLITS. A second round of programs would only queue behind the first.

    Batch-invariant mode never splits: a request's sums then never depend on the rest of the batch.
    """
    if forced_splits() is not None:
        return forced_splits()
    slots = per_core * cores
    if batch_invariant or programs >= slots:
        return 1
    by_cores = slots // max(programs, 1)
    by_work = max(1, max_key_blocks // _MIN_BLOCKS_PER_SPLIT)
    return max(1, min(MAX_SPLITS, by_cores, by_work))


def make_plan(tile: TileConfig, num_splits: int, tokens: int, heads: int, device) -> SplitPlan:
    if num_splits == 1:
        return SplitPlan(tile, 1)
    return SplitPlan(tile, num_splits,
                     buffers.empty(tokens, num_splits, heads, 512, dtype=torch.float32, device=device),
                     buffers.empty(tokens, num_splits, heads, dtype=torch.float32, device=device))


def combine(plan: SplitPlan, out: torch.Tensor, lse: torch.Tensor, tokens_per_batch: int,
            out_strides: tuple, lse_strides: tuple, sink: Optional[torch.Tensor]) -> None:
    """Merge ``plan``'s partials into ``out`` / ``lse``; ``*_strides`` = strides of (batch, query, head)."""
    tokens, splits, heads = plan.partial_lse.shape
    block_d = 128
    grid = (tokens * heads, 512 // block_d)
    combine_kernel[grid](plan.partial_out, plan.partial_lse, out, lse, sink, splits, heads, tokens_per_batch,
                         *out_strides, *lse_strides, HAS_SINK=sink is not None, BLOCK_D=block_d,
                         MAX_SPLITS=triton.next_power_of_2(splits), num_warps=4)
