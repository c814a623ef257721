"""The Triton tier as a backend (kernels in ``anymla.triton_kernels``; triton is imported on first use)."""

from __future__ import annotations

import torch

from ..registry import OPS, Backend


class TritonBackend(Backend):
    name = "triton"
    ops = frozenset(OPS)
    device_types = ("cuda", "npu", "cpu")

    def unavailable_reasons(self, device: torch.device) -> list[str]:
        from anymla.triton_kernels import unavailable_reasons
        return super().unavailable_reasons(device) or unavailable_reasons(device)

    def caveats(self, device: torch.device) -> list[str]:
        from anymla.triton_kernels.runtime import verification
        return verification(device)

    def kernel(self, problem) -> str:
        if problem.op == "dense_decode":
            from anymla.triton_kernels.dense_decode.launch import kernel_choice
        else:
            from anymla.triton_kernels.sparse_mla.launch import kernel_choice
        return kernel_choice(problem)

    def sparse_prefill(self, problem):
        from anymla.triton_kernels.sparse_mla.launch import sparse_prefill
        return sparse_prefill(problem)

    def sparse_decode(self, problem):
        from anymla.triton_kernels.sparse_mla.launch import sparse_decode
        return sparse_decode(problem)

    def dense_decode(self, problem):
        from anymla.triton_kernels.dense_decode.launch import dense_decode
        return dense_decode(problem)
