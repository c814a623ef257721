"""The PyTorch reference as a backend: every op, on every device torch runs on."""

from __future__ import annotations

from .. import reference
from ..registry import OPS, Backend


class ReferenceBackend(Backend):
    name = "reference"
    ops = frozenset(OPS)
    device_types = ("cpu", "cuda", "npu", "xpu", "mps")
    any_device = True  # plain torch: runs wherever the tensors live

    def sparse_prefill(self, problem):
        return reference.sparse_prefill(problem)

    def sparse_decode(self, problem):
        return reference.sparse_decode(problem)

    def dense_decode(self, problem):
        return reference.dense_decode(problem)
