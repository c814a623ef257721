"""Which implementation the layer kernels (cache writer, prolog, q assembly, slots, V4's kernels) run on a
device, and why.

Triton where the Triton tier can run them (cuda, or the CPU under ``TRITON_INTERPRET=1``), the PyTorch
reference otherwise, and on Ascend NPUs, where triton-ascend does not lower most of them (:data:`NPU_REASON`).
``backend="triton"`` / ``"torch"`` forces one; forcing Triton where the tier cannot run raises with the
reasons.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

BACKENDS = ("triton", "torch")

# The layer kernels through triton-ascend 3.2's compiler for Ascend 910B3 (`python
# triton_kernels/ascend_compile_check.py --layers`, no NPU or CANN: it stops before the last step, so a pass
# is no proof, a failure is): the BF16 writer, the slot kernel and V4's query heads lower; the prologs, the q
# assembly and V4's output heads do not (an assertion in its deinterleave of the strided RoPE pair loads), nor
# does any quantized writer (the integer e4m3 encoder's uint32 -> uint64 casts; V4's BF16 prolog overflows the
# UB at 4 tokens). One layer step needs all of its kernels, so on an NPU the layers run their torch ops.
NPU_REASON = ("triton-ascend 3.2 does not lower most layer kernels (the prologs, the q assembly and V4's output "
              "heads: its deinterleave of the RoPE pair loads; the quantized writers: their uint32 -> uint64 casts; "
              "ascend_compile_check.py --layers)")


@functools.lru_cache(maxsize=None)
def _triton_reasons(device: torch.device) -> tuple[str, ...]:
    """Why the Triton tier cannot run on ``device`` (fixed for a process: the interpreter is chosen at import, the
    GPU does not change), asked once a device: :func:`anymla.layers.write_cache` is called every layer of every
    step, and the question costs microseconds of host time (CUDA availability, compute capability)."""
    from anymla.triton_kernels import unavailable_reasons
    return tuple(unavailable_reasons(device))


def choose(device: torch.device, backend: Optional[str] = None) -> tuple[str, str]:
    """``(backend, reason)`` for the layer kernels on ``device``; ``backend`` forces one of :data:`BACKENDS`."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)} or None, got {backend!r}")
    if backend == "torch":
        return "torch", "forced (backend='torch')"
    reasons = _triton_reasons(device)
    if backend == "triton":
        if reasons:
            raise RuntimeError(f"backend='triton' cannot run on {device}: " + "; ".join(reasons))
        return "triton", "forced (backend='triton')"
    if reasons:
        return "torch", "PyTorch reference: " + "; ".join(reasons)
    if device.type == "npu":
        return "torch", "PyTorch reference: " + NPU_REASON
    return "triton", f"Triton kernels run on {device.type}"
