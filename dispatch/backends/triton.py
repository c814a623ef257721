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

    def plan(self, problem):
        """The launch plan of ``problem``'s signature: the Hopper or the portable kernel (and why), tile,
        splits, grid and launchers (``triton_kernels/*/launch.py``)."""
        if problem.op == "dense_decode":
            from anymla.triton_kernels.dense_decode.launch import DenseDecodePlan
            return DenseDecodePlan(problem)
        from anymla.triton_kernels.sparse_mla import launch
        return launch.SparsePrefillPlan(problem) if problem.op == "sparse_prefill" else launch.SparseDecodePlan(problem)

    def run(self, problem, plan=None):
        return (plan or self.plan(problem))(problem)
