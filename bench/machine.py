"""What a run ran on: device, its name, library versions, date; stamped on every CSV row."""

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


def describe(device: torch.device) -> RunInfo:
    return RunInfo(
        timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=str(device), device_name=device_name(device), torch=torch.__version__,
        triton=_distribution_version("triton", "triton-ascend"), anymla=anymla.__version__,
        interpreter=device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
