"""Launch with the shipped tile config, or the largest smaller one that fits the device.

Shared-memory needs differ between Triton versions and between specializations of one kernel (strides that
are not multiples of 16 change the layouts), so a tuned config can exceed the limit on some inputs. Rather
than fail, a launch retries with fewer pipeline stages, then with smaller key blocks, and remembers what fit.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, Iterator

from triton.runtime.errors import OutOfResources

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


def launch_fitting(key: Hashable, tile: TileConfig, launch: Callable[[TileConfig], None]) -> TileConfig:
    """Run ``launch(t)`` for the first ``t`` of :func:`shrinking` that fits; ``key`` names the specialization."""
    error = None
    for t in shrinking(_FITTED.get((key, tile), tile)):
        try:
            launch(t)
        except OutOfResources as e:
            error = e
            continue
        _FITTED[(key, tile)] = t
        return t
    raise error


def shrunk_to(tile: TileConfig) -> set:
    """The configs ``tile`` was replaced with because it did not fit (empty when it always fit)."""
    return {t for (_, asked), t in _FITTED.items() if asked == tile and t != tile}
