"""Launch with the shipped tile config, or the largest smaller one that fits the device.

Shared-memory needs differ between Triton versions and between specializations of one kernel (strides that
are not multiples of 16 change the layouts), so a tuned config can exceed the limit on some inputs. Rather
than fail, a plan's first launch retries with fewer pipeline stages, then with smaller key blocks, and
remembers what fit.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, Iterator

from triton.runtime.errors import OutOfResources

from .launcher import Launcher
from .tuning import TileConfig

_FITTED: dict = {}


def shrinking(tile: TileConfig) -> Iterator[TileConfig]:
    """``tile``, then halved pipeline depths (down to one stage), then halved key blocks (down to 16), then
    halved head blocks on 4 warps (down to 16 rows: the one tile that fits every GPU the tier supports)."""
    yield tile
    t = tile
    while t.num_stages > 1:
        t = dataclasses.replace(t, num_stages=t.num_stages // 2)
        yield t
    while t.block_n > 16:
        t = dataclasses.replace(t, block_n=t.block_n // 2)
        yield t
    while t.block_h > 16:
        t = dataclasses.replace(t, block_h=t.block_h // 2, num_warps=4)
        yield t


class FittedKernel:
    """A portable kernel launched with a plan's tile, or the largest smaller one that fits (found by the
    plan's first launch, then kept with its :class:`Launcher`). ``key`` names the kernel's specialization;
    tiles that had to shrink are remembered across plans under it."""

    def __init__(self, fn, key: Hashable, tile: TileConfig):
        self.fn, self.key, self.asked = fn, key, tile
        self.tile = _FITTED.get((key, tile), tile)
        self.launcher = None

    def __call__(self, values: Callable[[TileConfig], tuple], full: Callable[[TileConfig], tuple]) -> None:
        """Launch with a call's own ``values(tile)`` (see :meth:`Launcher.bind`); ``full(tile) -> (grid, args)``
        builds the whole list (the first call, and a call with a new alignment pattern)."""
        if self.launcher is not None:
            self.launcher.bind(self.grid, values(self.tile), lambda: full(self.tile)[1])
            return
        error = None
        for t in shrinking(self.tile):
            launcher = Launcher(self.fn, num_warps=t.num_warps)
            grid, args = full(t)
            try:
                launcher(grid, args)
            except OutOfResources as e:
                error = e
                continue
            launcher.adopt(args, values(t))
            self.tile, self.launcher, self.grid = t, launcher, grid
            _FITTED[(self.key, self.asked)] = t
            return
        raise error


def shrunk_to(tile: TileConfig) -> set:
    """The configs ``tile`` was replaced with because it did not fit (empty when it always fit)."""
    return {t for (_, asked), t in _FITTED.items() if asked == tile and t != tile}
