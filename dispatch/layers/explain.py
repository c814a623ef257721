"""What one call signature of a layer runs, as :meth:`MLAAttention.explain` / :meth:`V4Attention.explain`
return it: the plan the layer keeps for that signature (cache format, how it attends, which implementation
its kernels have and why) and the dispatcher's decision for its attention call, the very object that call
runs with (:func:`anymla.explain` of the step's own query and slot shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kvcache import KVCacheFormat
from ..selection import Decision


@dataclass(frozen=True)
class StepExplanation:
    layer: str  # the layer's class
    fmt: KVCacheFormat
    attends: str  # how the attention call reads the cache
    kernels: str  # the layer kernels' implementation: "triton" or "torch"
    kernels_reason: str
    launches: str  # what one step launches besides the attention call
    attention: Decision

    def __str__(self) -> str:
        lines = [f"{self.layer} step over a {self.fmt.name} cache: {self.attends}",
                 f"  layer kernels: {self.kernels} ({self.kernels_reason})",
                 f"  a step: {self.launches}, then the attention call:"]
        return "\n".join(lines + ["    " + line for line in str(self.attention).splitlines()])
