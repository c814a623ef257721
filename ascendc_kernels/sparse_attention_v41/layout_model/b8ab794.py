"""The kernel's data-path parameters at commit b8ab794, before issue 15's fixes, in the layout model's terms: the
old source line of each defect and what replaying it takes (header overrides, or the old FixPipe call to parse)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class OldPath:
    title: str
    source: str  # the line at b8ab794
    overrides: dict = field(default_factory=dict)
    fixpipe_call: Optional[str] = None  # platform.h's FixPipe call at b8ab794, parsed like today's


DEFECTS = (
    OldPath("1: FixPipe to UB instantiated with CFG_ROW_MAJOR (isToUB false)",
            "platform.h:73    Fixpipe<float, float, CFG_ROW_MAJOR>(dst, src, p);",
            fixpipe_call="Fixpipe<float, float, CFG_ROW_MAJOR>(dst, src, p);"),
    OldPath("2: V of P V loaded in K^T's fractal order (one sequential transposed load)",
            "cube_core.h:144  LoadFractals(L0b(..), L1(Kv(kv, half)), kBlockTopk * (kHeadDim / 2) / 256, true);"
            "  // startIndex 0, srcStride 1",
            overrides=dict(kVLoads=1, kVStartStep=0, kVRepeat=64, kVSrcStride=1, kVDstStep=0, kVTranspose=1)),
    OldPath("3: FP4 rows of a pair 288 B apart while decoded at the 544 B pitch (dstStride 0)",
            "vector_core.h:182  DataCopyExtParams p{rows, gm_row, gap, 0, 0};",
            overrides=dict(PairDstGap=lambda row, main, extra: 0)),
)
