"""What a run ran on: device, its name, library versions, date and any stand-in; stamped on every CSV row."""

from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
from dataclasses import dataclass

import torch

import anymla
from anymla.triton_kernels.runtime import mma_v3_disabled


@dataclass(frozen=True)
class RunInfo:
    timestamp: str
    device: str
    device_name: str
    torch: str
    triton: str
    anymla: str
    source: str  # source_digest(): which code ran, where the tree has no version control (a device's copy)
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


SUBPACKAGES = ("triton_kernels", "ascendc_kernels", "bench")
SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".sh")


def source_digest() -> str:
    """The first 12 hex digits of ``digest_of`` the installed package: equal digests, the same code. The
    subpackages are found where Python imports them from (``pip install -e`` maps folders of the repository's
    top onto them)."""
    roots = {"": os.path.dirname(anymla.__file__)}
    for name in SUBPACKAGES:
        roots[name] = importlib.util.find_spec(f"anymla.{name}").submodule_search_locations[0]
    return digest_of(roots)[:12]


def digest_of(roots: dict[str, str]) -> str:
    """SHA-256 over the source files below each of ``roots`` (name -> folder; paths and bytes, in path order),
    caches, built libraries and committed results left out, and the top root's folders named after the others
    (a layout whose top folder links to them) counted once."""
    digest = hashlib.sha256()
    for name, root in sorted(roots.items()):
        for folder, subfolders, files in os.walk(root, followlinks=True):
            at_top = folder == root
            subfolders[:] = sorted(d for d in subfolders if d not in ("__pycache__", "results", "lib")
                                   and not (at_top and name == "" and d in roots))
            for file in sorted(f for f in files if f.endswith(SOURCE_SUFFIXES)):
                path = os.path.join(folder, file)
                digest.update(os.path.join(name, os.path.relpath(path, root)).encode() + b"\0")
                with open(path, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()


# The stand-ins for the GPUs other than Hopper that an H200 can measure (python -m anymla.bench --portable,
# --mma-sync), and what each changes.
STAND_INS = {"portable": "the Hopper kernels switched off (tuning.forced(warp_specialized=False), or "
                         "ANYMLA_HOPPER_KERNELS=0 for the whole process)",
             "mma.sync": "DISABLE_MMA_V3=1: Triton lowers tl.dot to mma.sync (Ampere-class) instead of wgmma, and "
                         "the mma_v2 kernels (triton_kernels/ampere/) take the calls they serve, as on those GPUs"}


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
        source=source_digest(), interpreter=device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1",
        stand_in=stand_in(portable))
