"""What the Triton tier needs to know about the device it launches on."""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def interpreting() -> bool:
    """True when Triton's interpreter is active. It is fixed when the kernels are decorated, which is
    when this tier's kernel modules are first imported (TRITON_INTERPRET=1 must be set before that);
    cached because every launch asks."""
    from .common import attend_block
    return type(attend_block).__name__ == "InterpretedFunction"


def unavailable_reasons(device: torch.device) -> list[str]:
    """Why the Triton tier cannot run on ``device``; empty when it can."""
    if not _triton_installed():
        return ["the triton package is not installed (pip install 'anymla[triton]', or triton-ascend on Ascend)"]
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1" or not interpreting():
            return ["Triton has no CPU code generator: set TRITON_INTERPRET=1 before importing anymla to run "
                    "the kernels in Triton's interpreter (slow; meant for tests)"]
        return interpreter_reasons()
    if interpreting():
        return [f"Triton's interpreter is active (TRITON_INTERPRET=1): it runs CPU tensors only, not {device.type}"]
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return ["torch sees no CUDA device"]
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8 and not rocm():
            return [f"bf16 tensor-core dots need compute capability 8.0 or newer, this GPU is {major}.{minor}"]
        return []
    if device.type == "npu":
        if importlib.util.find_spec("triton.backends.ascend") is None:
            return ["Ascend NPUs need triton-ascend (found PyPI's triton, which has no Ascend backend)"]
        return []
    return [f"the Triton tier targets cuda, npu and (interpreted) cpu devices, not {device.type}"]


def interpreter_reasons() -> list[str]:
    """Why Triton's interpreter cannot run the kernels with the installed Triton and NumPy; empty when it can.
    Before 3.7 the interpreter turns a loaded scalar (a one-element array there) into a loop bound with
    ``int()``, which NumPy 2 refuses for arrays that are not 0-dimensional (found with Triton 3.6.0, NumPy 2.4)."""
    import numpy
    import triton
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) >= (3, 7):
        return []
    try:
        int(numpy.zeros(1, dtype=numpy.int32))
    except TypeError:
        return [f"Triton {triton.__version__}'s interpreter cannot run the kernels with NumPy {numpy.__version__} "
                "(it converts one-element arrays to int, which NumPy 2 refuses): use Triton 3.7 or newer for the "
                "interpreter"]
    return []


# Below this much shared memory a block (sm_86, sm_89: 99 KB) the 64-head tiles fit at no pipeline depth.
_SMALL_SHARED_MEMORY = 128 * 1024


@functools.lru_cache(maxsize=None)
def device_kind(device: torch.device) -> str:
    """``interpret``, ``cuda_sm90`` (Hopper), ``cuda_sm100`` (Blackwell datacenter), ``cuda_sm120`` (consumer
    Blackwell: 99 KB of shared memory a block, mma.sync but TMA), ``cuda_small_smem`` (other NVIDIA with < 128 KB
    of shared memory a block: sm_86/89), ``cuda`` (other NVIDIA), ``rocm`` (AMD through torch's ROCm build,
    which calls its GPUs ``cuda`` too) or ``npu``: keys of the tuning table (``tuning.TILES``)."""
    if device.type == "cpu":
        return "interpret"
    if device.type == "npu":
        return "npu"
    if rocm():
        return "rocm"
    major, _ = torch.cuda.get_device_capability(device)
    if major == 9:
        return "cuda_sm90"
    if major == 10:
        return "cuda_sm100"
    if major == 12:
        return "cuda_sm120"
    return "cuda_small_smem" if max_shared_memory(device) < _SMALL_SHARED_MEMORY else "cuda"


def tile_kind(device: torch.device) -> str:
    """The device kind whose tiles the portable kernels take: ``device_kind``, but on sm_90 with
    ``DISABLE_MMA_V3`` (the mma.sync stand-in) ``cuda``, the large-shared-memory GPUs it stands in for. Hopper's
    own tiles assume wgmma: with mma.sync, Triton 3.6 compiles its 3-stage quantized tile at 128 registers and
    4.8 KB of spills a thread, 12x slower than one stage (run 137, sparse_mla/NOTES.md)."""
    kind = device_kind(device)
    return "cuda" if kind == "cuda_sm90" and mma_v3_disabled() else kind


@functools.lru_cache(maxsize=None)
def rocm() -> bool:
    """torch built for ROCm: AMD GPUs appear as ``cuda`` devices, and their capability numbers are not
    NVIDIA's (an MI300X reports 9.4)."""
    return torch.version.hip is not None


def max_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one block may use on a CUDA device, as Triton checks it at launch."""
    import triton
    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])


# The interpreter pretends to be a 4-core device, so small test shapes exercise split-KV and the combine.
_INTERPRETER_CORES = 4


@functools.lru_cache(maxsize=None)
def num_cores(device: torch.device) -> int:
    """Streaming multiprocessors (CUDA) or AI cores (Ascend): how many programs run at once."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    if device.type == "npu":
        import triton
        props = triton.runtime.driver.active.utils.get_device_properties(device.index or 0)
        return int(props["num_aicore"])
    return _INTERPRETER_CORES


@functools.lru_cache(maxsize=None)
def tensor_memory_copies(device: torch.device) -> bool:
    """TMA tile copies: Hopper and newer; the interpreter emulates them (so CI runs that code path too)."""
    if device.type == "cpu":
        return True
    return device.type == "cuda" and not rocm() and torch.cuda.get_device_capability(device) >= (9, 0)


# Gluon's API still moves between releases (3.5's warp_specialize took its arguments in another order): the
# Hopper kernels are run on 3.6 (H200) and compile-checked on 3.7.
_GLUON_VERSIONS = ((3, 6), (3, 7))


@functools.lru_cache(maxsize=None)
def gluon_hopper() -> bool:
    """Triton's Gluon dialect with Hopper warp specialization, in a version the Hopper kernels were checked
    with; other Tritons (and triton-ascend) keep the portable kernels."""
    import triton
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) not in _GLUON_VERSIONS:
        return False
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
    except ImportError:
        return False
    return hasattr(gl, "warp_specialize")


@functools.lru_cache(maxsize=None)
def gluon_ampere() -> bool:
    """Triton's Gluon dialect with ``mma_v2`` and ``cp.async`` (the kernels of ``ampere/``), in a version they
    were checked with (the same as the Hopper kernels')."""
    import triton
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) not in _GLUON_VERSIONS:
        return False
    try:
        from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2  # noqa: F401
    except ImportError:
        return False
    return True


def mma_v3_disabled() -> bool:
    """DISABLE_MMA_V3 as Triton reads it (1, true or on, any case): tl.dot lowered to mma.sync, not wgmma."""
    return os.environ.get("DISABLE_MMA_V3", "").lower() in ("1", "true", "on")


def portable_loads(device: torch.device) -> bool:
    """Byte-assembled loads instead of pointer casts, a select instead of join-and-reshape (Ascend)."""
    from .tuning import forced_portable
    forced = forced_portable()
    return device.type == "npu" if forced is None else forced


@functools.lru_cache(maxsize=None)
def native_fp8(device: torch.device) -> bool:
    """Hardware e4m3 conversion (sm89+). Elsewhere, AMD included (MI300's hardware fp8 is the other e4m3
    variant, "fnuz"), the kernels decode fp8 bytes with exact bit arithmetic."""
    return device.type == "cuda" and not rocm() and torch.cuda.get_device_capability(device) >= (8, 9)


# How far the tier has been checked per device kind (README, "What has been run where"); Hopper needs no caveat.
_UNRUN = "compile-checked but never run on one: run the test suite here before trusting results"
_VERIFICATION = {
    "interpret": "Triton's interpreter: the reference grids pass in CI, but it is slow (meant for tests)",
    "cuda": f"A100-class GPUs (sm_80): tiles {_UNRUN}",
    "cuda_sm100": f"Blackwell (sm_100): tiles {_UNRUN}",
    "cuda_sm120": f"consumer Blackwell (sm_120: RTX 50xx, RTX PRO 6000): tiles {_UNRUN}",
    "cuda_small_smem": f"99 KB-shared-memory GPUs (sm_86/89): tiles {_UNRUN}",
    "rocm": f"AMD GPUs (gfx942/gfx90a): tiles {_UNRUN}",
}
# The SoCs triton_kernels/ascend_compile_check.py compiles every variant for (triton-ascend 3.2.0, A2/A3 only).
_ASCEND_COMPILE_CHECKED = ("Ascend910B3", "Ascend910B4", "Ascend910_9382")


def _ascend_verification(soc: str) -> str:
    """The caveat for an Ascend NPU named ``soc``: only the compile-checked SoCs are named as checked."""
    checked = ", ".join(_ASCEND_COMPILE_CHECKED)
    if soc.startswith("Ascend950"):
        return (f"Ascend 950 ({soc}): nothing of the Triton tier was compiled or run for a 950 (the compile check "
                f"covers {checked} only; triton-ascend's PyPI build does not target the 950); never run on an NPU")
    scope = "this SoC" if soc in _ASCEND_COMPILE_CHECKED else f"not this {soc}"
    return (f"Ascend {soc}: every kernel variant is compile-checked (lowers and fits UB/L1) for {checked} only "
            f"({scope}) and never run on an NPU: run the test suite here before trusting results")


def verification(device: torch.device) -> list[str]:
    """The caveat ``explain`` shows for the Triton tier on ``device``; empty where it was run and measured."""
    if device.type not in ("cuda", "npu", "cpu"):
        return []
    kind = device_kind(device)
    if kind == "cuda_sm90" and not gluon_hopper():
        import triton
        return [f"Hopper: Triton {triton.__version__} is not a version the warp-specialized kernels were checked "
                "with (3.6, 3.7), so the portable kernels run: about half the speed on compute-bound shapes"]
    if kind == "npu":
        return [_ascend_verification(str(torch.npu.get_device_name(device)))]
    note = _VERIFICATION.get(kind)
    return [note] if note else []
