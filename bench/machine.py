"""What a run ran on: device, its name, library versions, date and any stand-in; stamped on every CSV row."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
from dataclasses import dataclass

import torch

import anymla


@dataclass(frozen=True)
class RunInfo:
    timestamp: str
    device: str
    device_name: str
    torch: str
    triton: str
    anymla: str
    interpreter: bool  # the Triton tier ran in Triton's interpreter (CPU): its times are interpreter times
    stand_in: str = ""  # what the run measured instead of the shipped path (stand_in()); "" for the shipped path


def _distribution_version(*names: str) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    if device.type in ("cuda", "npu"):
        return getattr(torch, device.type).get_device_name(device)
    return f"{_cpu_name()} ({os.cpu_count()} cores)"


def mma_v3_disabled() -> bool:
    """DISABLE_MMA_V3 as Triton reads it (1, true or on, any case): tl.dot lowered to mma.sync, not wgmma."""
    return os.environ.get("DISABLE_MMA_V3", "").lower() in ("1", "true", "on")


# The stand-ins for the GPUs other than Hopper that an H200 can measure (python -m anymla.bench --portable,
# --mma-sync), and what each changes.
STAND_INS = {"portable": "the Hopper kernels switched off (tuning.forced(warp_specialized=False), or "
                         "ANYMLA_HOPPER_KERNELS=0 for the whole process)",
             "mma.sync": "DISABLE_MMA_V3=1: Triton lowers tl.dot to mma.sync (Ampere-class) instead of wgmma"}


def stand_in(portable: bool) -> str:
    """The stand-ins in force, joined by "+" ("portable", "mma.sync", "portable+mma.sync"); "" for the shipped
    path. ``portable``: the run switches the Hopper kernels off (ANYMLA_HOPPER_KERNELS=0 does it too)."""
    portable = portable or os.environ.get("ANYMLA_HOPPER_KERNELS") == "0"
    return "+".join(name for name, on in (("portable", portable), ("mma.sync", mma_v3_disabled())) if on)


def describe(device: torch.device, portable: bool = False) -> RunInfo:
    return RunInfo(
        timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=str(device), device_name=device_name(device), torch=torch.__version__,
        triton=_distribution_version("triton", "triton-ascend"), anymla=anymla.__version__,
        interpreter=device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1",
        stand_in=stand_in(portable))
