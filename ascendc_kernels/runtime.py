"""Whether the Ascend C tier can run on a device, and loading its extension library on first use.

Nothing here imports torch_npu or loads the library at ``import anymla``: :func:`unavailable_reasons` only
looks for them, and :func:`load_library` runs when a kernel is first called.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import torch

ENV_LIBRARY = "ANYMLA_ASCENDC_LIB"
ENV_ALLOW_UNVERIFIED = "ANYMLA_ASCENDC_ALLOW_UNVERIFIED"
# Where sparse_attention_v41/CMakeLists.txt installs the library (next to this package).
DEFAULT_LIBRARY = Path(__file__).resolve().parent / "lib" / "libanymla_ascendc.so"
BUILT_FOR = ("Ascend950",)  # SoC families the kernels are compiled for (--npu-arch=dav-3510)


def _torch_npu_installed() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def library_path() -> Path:
    return Path(os.environ.get(ENV_LIBRARY) or DEFAULT_LIBRARY)


def _soc_name(device: torch.device) -> str:
    """The SoC name torch_npu reports, e.g. ``Ascend950PR_9589`` (only called with torch_npu imported)."""
    return str(torch.npu.get_device_name(device))


def unavailable_reasons(device: torch.device) -> list[str]:
    """Why the Ascend C tier cannot run on ``device``; every reason at once, empty when it can."""
    reasons = []
    if not _torch_npu_installed():
        reasons.append("torch_npu is not installed (the Ascend C kernels run on Huawei Ascend NPUs through torch_npu)")
    if device.type != "npu":
        reasons.append(f"the Ascend C kernels run on NPU devices, not on {device.type}")
    elif not reasons:
        soc = _soc_name(device)
        if not soc.startswith(BUILT_FOR):
            reasons.append(f"the kernels are built for {', '.join(BUILT_FOR)} (dav-3510), this NPU is {soc}")
    path = library_path()
    if not path.is_file():
        reasons.append(f"the extension library is not built: {path} does not exist (build "
                       f"ascendc_kernels/sparse_attention_v41 with CANN, or set {ENV_LIBRARY})")
    if os.environ.get(ENV_ALLOW_UNVERIFIED) != "1":
        from . import manifest  # imported here so `python -m anymla.ascendc_kernels.manifest` runs cleanly
        for kernel in manifest.KERNEL_SOURCES:
            verified, why = manifest.kernel_status(kernel)
            if not verified:
                reasons.append(f"{why}; set {ENV_ALLOW_UNVERIFIED}=1 to run it anyway")
    return reasons


# What has run for the tier without an NPU (tests/test_ascendc_*.py, .ci/run), and what only a 950 can show.
CPU_CHECKS = ("on CPU only: the tiling and buffer budgets, an fp32 emulation of the kernel's blocking order against "
              "the reference, a numpy model of its data movement (formats, strides, LoadData and FixPipe modes as "
              "asc-devkit documents them for the 950), its row decoders bit for bit, and the host binding compiled "
              "and linked against the torch_npu 2.13.0 wheel")
ONLY_ON_A_950 = ("that the device code compiles, that the hardware behaves as documented, and its numerics and speed "
                 "need an Ascend 950 with CANN")


def caveats(device) -> list[str]:
    """What ``explain`` shows about the tier on ``device``: how far each kernel was checked, naming the SoCs."""
    from . import manifest
    soc = None
    if getattr(device, "type", None) == "npu" and _torch_npu_installed():
        soc = _soc_name(device)
    notes = []
    for kernel in manifest.KERNEL_SOURCES:
        verified, why = manifest.kernel_status(kernel)
        if not verified:
            notes.append(f"Ascend C {kernel} was never compiled or run on an NPU ({why}); checked {CPU_CHECKS}; "
                         f"{ONLY_ON_A_950}")
            continue
        run_soc = manifest.hardware_run(kernel)["soc"]
        if soc != run_soc:
            notes.append(f"Ascend C {kernel}: {why}; this NPU is {soc or 'unknown'}, on which it was never run")
    return notes


@functools.lru_cache(maxsize=None)
def load_library() -> None:
    """Register the schema (Python) and the NPU implementation (the built library), once."""
    from . import ops  # noqa: F401  (defines anymla_ascendc::sparse_attention_v41)
    torch.ops.load_library(str(library_path()))
