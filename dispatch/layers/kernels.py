"""Which implementation the layer kernels (cache writer, prolog, q assembly) run on a device, and why.

Triton where the Triton tier can run (cuda, npu, or the CPU under ``TRITON_INTERPRET=1``), the PyTorch
reference otherwise. ``backend="triton"`` / ``"torch"`` forces one; forcing Triton where it cannot run raises
with the reasons.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

BACKENDS = ("triton", "torch")


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
    return "triton", f"Triton kernels run on {device.type}"
