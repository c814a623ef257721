"""Published H200 figures for the canonical shapes (/work/shared/reference/h200_anchors.md, 2026-11-29).

They are anchors, not measurements of this run: FlashMLA v1.0.0 (CUDA) and the best public Triton kernel,
timed on another H200 with ``triton.testing.do_bench``. Reports show them beside the measured backends,
labelled as such; compare ratios (to each run's own ceilings), not absolute times, across machines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

LABEL = "anchor, not measured in this run"
# The anchor run's own ceilings (run 2), for the anchors' ratios.
ANCHOR_COPY_GBPS = 4225.0
ANCHOR_MATMUL_TFLOPS = 686.0


@dataclass(frozen=True)
class Anchor:
    flashmla_us: float
    triton_name: str = ""  # the best public Triton kernel for the shape ("" when none exists)
    triton_us: Optional[float] = None


# Keyed by the canonical case names of suites.py.
ANCHORS = {
    "prefill-v32-h128": Anchor(4130.0, "vLLM", 21200.0),
    "prefill-v4-h64": Anchor(2000.0, "FlagGems", 20300.0),
    "sdecode-v32-b128-sq2-h128": Anchor(368.0),
    "sdecode-v32-b64-sq1-h64": Anchor(80.1),
    "ddecode-b128-h16-sk8192": Anchor(310.0, "FlagGems", 662.0),
    "ddecode-b128-sq2-h128-sk8192": Anchor(919.0, "FlagGems", 1162.0),
    "ddecode-b1-h128-sk32768": Anchor(49.4, "vLLM", 198.0),
}
