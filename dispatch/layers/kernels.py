"""Which implementation the layer kernels (cache writer, prolog, q assembly) run on a device, and why.

Triton where the Triton tier can run (cuda, npu, or the CPU under ``TRITON_INTERPRET=1``), the PyTorch
reference otherwise. ``backend="triton"`` / ``"torch"`` forces one; forcing Triton where it cannot run raises
with the reasons.
"""

from __future__ import annotations

from typing import Optional

import torch

BACKENDS = ("triton", "torch")


def choose(device: torch.device, backend: Optional[str] = None) -> tuple[str, str]:
    """``(backend, reason)`` for the layer kernels on ``device``; ``backend`` forces one of :data:`BACKENDS`."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)} or None, got {backend!r}")
    if backend == "torch":
        return "torch", "forced (backend='torch')"
    from anymla.triton_kernels import unavailable_reasons
    reasons = unavailable_reasons(device)
    if backend == "triton":
        if reasons:
            raise RuntimeError(f"backend='triton' cannot run on {device}: " + "; ".join(reasons))
        return "triton", "forced (backend='triton')"
    if reasons:
        return "torch", "PyTorch reference: " + "; ".join(reasons)
    return "triton", f"Triton kernels run on {device.type}"
