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


def library_path() -> Path:
    return Path(os.environ.get(ENV_LIBRARY) or DEFAULT_LIBRARY)


def _soc_name(device: torch.device) -> str:
    """The SoC name torch_npu reports, e.g. ``Ascend950PR_9589`` (only called with torch_npu imported)."""
    return str(torch.npu.get_device_name(device))


def unavailable_reasons(device: torch.device) -> list[str]:
    """Why the Ascend C tier cannot run on ``device``; every reason at once, empty when it can."""
    reasons = []
    if importlib.util.find_spec("torch_npu") is None:
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


@functools.lru_cache(maxsize=None)
def load_library() -> None:
    """Register the schema (Python) and the NPU implementation (the built library), once."""
    from . import ops  # noqa: F401  (defines anymla_ascendc::sparse_attention_v41)
    torch.ops.load_library(str(library_path()))
