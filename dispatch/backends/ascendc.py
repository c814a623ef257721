"""The hand-written Ascend C tier as a backend (kernels in ``anymla.ascendc_kernels``).

Serves DeepSeek Sparse Attention prefill and decoding on Ascend 950 for the shapes of
:mod:`anymla.ascendc_kernels.hot_shapes`; the package is imported on first use, and its extension library
is loaded on the first kernel call. It stays unavailable until the kernel is verified on hardware (see
``ascendc_kernels/verification_manifest.json``) unless ``ANYMLA_ASCENDC_ALLOW_UNVERIFIED=1``.
"""

from __future__ import annotations

import torch

from ..registry import Backend


class AscendCBackend(Backend):
    name = "ascendc"
    ops = frozenset({"sparse_decode", "sparse_prefill"})
    device_types = ("npu",)

    def unavailable_reasons(self, device: torch.device) -> list[str]:
        from anymla.ascendc_kernels import unavailable_reasons
        return unavailable_reasons(device)

    def caveats(self, device: torch.device) -> list[str]:
        from anymla.ascendc_kernels.runtime import caveats
        return caveats(device)

    def shape_reasons(self, problem) -> list[str]:
        from anymla.ascendc_kernels.hot_shapes import shape_reasons
        return shape_reasons(problem)

    def sparse_prefill(self, problem):
        from anymla.ascendc_kernels.launch import sparse_prefill
        return sparse_prefill(problem)

    def sparse_decode(self, problem):
        from anymla.ascendc_kernels.launch import sparse_decode
        return sparse_decode(problem)
