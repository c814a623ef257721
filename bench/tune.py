"""``--tune FILE``: write the fastest correct backend per shape where the dispatcher reads it.

The file is the dispatcher's tuning format, ``{"choices": {tuning_key: backend}}`` (read by
:func:`anymla.load_tuning` or through ``ANYMLA_TUNING``). Choices already in the file are kept unless
this run measured the same shape again. A measured peer (FlashMLA, torch_npu) enters the file like any
backend: that is the only way the dispatcher picks a peer on its own.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch

from anymla.selection import tuning_key

from .machine import RunInfo
from .runner import CaseOutcome


def _key(outcome: CaseOutcome) -> str:
    decision = outcome.decision
    return tuning_key(SimpleNamespace(device=torch.device(decision.device), shape_key=lambda: decision.shape))


def write_tuning(path: str, outcomes: list[CaseOutcome], info: RunInfo) -> dict:
    """Merge this run's fastest backend per shape into ``path``; return the new choices."""
    document = {"choices": {}}
    if os.path.exists(path):
        with open(path) as f:
            document = json.load(f)
    new = {_key(o): o.fastest for o in outcomes if o.decision is not None and o.fastest}
    document["choices"].update(new)
    document["measured_on"] = (f"{info.device_name}, torch {info.torch}, triton {info.triton}, anymla source "
                               f"{info.source}, {info.timestamp}")
    with open(path, "w") as f:
        json.dump(document, f, indent=1, sort_keys=True)
    return new
