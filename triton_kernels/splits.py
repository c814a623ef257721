"""Split-KV: how many splits a configuration gets, the fixed-size workspaces, and the combine launch.

The number of splits is a function of the configuration only (batch, heads, cache capacity, device), never
of the values in ``cache_seqlens`` or ``topk_length``: each program derives its own key range from them
on the device. So it is part of the launch plan of a call signature, and the workspaces of a configuration
can be allocated once per FlashMLASchedMeta, reused by every layer, and are CUDA-graph safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from anymla import buffers
import triton

from .common import combine_kernel
from .launcher import Launcher
from .tuning import forced_splits

MAX_SPLITS = 64
_MIN_BLOCKS_PER_SPLIT = 2


@dataclass
class Workspaces:
    """Where the splits write their partials before the combine merges them."""

    partial_out: torch.Tensor  # [tokens, splits, heads, 512] fp32
    partial_lse: torch.Tensor  # [tokens, splits, heads] fp32, log2 domain


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


def workspaces(num_splits: int, tokens: int, heads: int, device) -> Optional[Workspaces]:
    """The partials' buffers of ``num_splits`` splits (None for one split: nothing to merge)."""
    if num_splits == 1:
        return None
    return Workspaces(buffers.empty(tokens, num_splits, heads, 512, dtype=torch.float32, device=device),
                      buffers.empty(tokens, num_splits, heads, dtype=torch.float32, device=device))


class Combine:
    """The merge of one plan's split partials into ``out`` / ``lse``, launched through a kept :class:`Launcher`."""

    BLOCK_D = 128

    def __init__(self, num_splits: int):
        self.num_splits = num_splits
        self.launcher = Launcher(combine_kernel, num_warps=4)

    def __call__(self, ws: Workspaces, out: torch.Tensor, lse: torch.Tensor, tokens_per_batch: int,
                 out_strides: tuple, lse_strides: tuple, sink: Optional[torch.Tensor]) -> None:
        """``*_strides`` = strides of (batch, query, head) of ``out`` / ``lse``."""
        tokens, splits, heads = ws.partial_lse.shape
        grid = (tokens * heads, 512 // self.BLOCK_D, 1)
        self.launcher.bind(grid, (ws.partial_out, ws.partial_lse, out, lse, sink), lambda: [
            ws.partial_out, ws.partial_lse, out, lse, sink, splits, heads, tokens_per_batch, *out_strides,
            *lse_strides, sink is not None, self.BLOCK_D, triton.next_power_of_2(splits)])
