"""Output and workspace allocation for every backend, with an opt-in poison mode for tests.

With poisoning on (``poison_outputs(True)`` or ``ANYMLA_POISON_OUTPUTS=1``) every buffer a backend
allocates is filled with NaN first, so an element a kernel forgot to write can never pass a comparison
(a plain ``torch.empty`` may hand back memory that still holds the right answer from an earlier run).
"""

from __future__ import annotations

import os

import torch

_state = {"poison": os.environ.get("ANYMLA_POISON_OUTPUTS") == "1"}


def poison_outputs(enabled: bool) -> None:
    _state["poison"] = bool(enabled)


def poisoning() -> bool:
    """Whether buffers are poisoned (see :func:`poison_outputs`)."""
    return _state["poison"]


def empty(*shape: int, dtype: torch.dtype, device) -> torch.Tensor:
    t = torch.empty(*shape, dtype=dtype, device=device)
    if _state["poison"]:
        t.fill_(float("nan"))
    return t
