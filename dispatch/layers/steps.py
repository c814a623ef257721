"""A layer's decode step through the compiled call path (:mod:`anymla.callpath`): the same code for every
layer class, so that what a step's entry is keyed on and when it is made are decided in one place."""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from .. import callpath
from ..buffers import poisoning


def compiled_step(layer: torch.nn.Module, args: tuple, device: torch.device, plan_of: Callable[[], object],
                  run: Callable[[object], torch.Tensor], constants: Callable[[object], Iterable[torch.Tensor]]
                  ) -> torch.Tensor:
    """``layer``'s step for the call arguments ``args`` (tensors or None): the entry of their signature where
    there is one, else the Python path ``run(plan_of())``, which on the Triton tier is watched once and made an
    entry whose constants are ``constants(plan)`` (the layer's weights and tables; the entries go with the
    layer). The key holds the layer, its kernel and attention overrides and every argument's signature."""
    entry = callpath.entry_point(None)
    key = (id(layer), callpath.number((layer.kernel_backend, layer.attention_backend)), *args)
    if entry is not None:
        out = entry[0](callpath.MLA_STEP, poisoning(), None, entry[1], *key)
        if out is not None:
            return out[0]
    plan = plan_of()
    if plan.kernels != "triton" or not callpath.recordable_on(device):
        return run(plan)
    return callpath.record_step(entry, layer, list(constants(plan)), callpath.MLA_STEP, key, lambda: run(plan))
