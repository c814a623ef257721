"""Building and loading ``callpath.cpp``, the compiled call path, with why it is not there when it is not.

It is a small CPython extension against torch's headers, built on first need with torch's own extension
builder (a C++ compiler and ninja; ~20 s). The build runs in a background thread so that no call waits for it:
until it is done, calls take the Python path. ``ANYMLA_CALLPATH=0`` turns it off.

Each build runs in a private directory and its library is then moved into a cache (under torch's extension root,
``~/.cache/torch_extensions`` or ``$TORCH_EXTENSIONS_DIR``) named by the source, torch and Python, from which
later processes load it at once. Why not torch's own cache: its build directory is guarded by a lock file, and
a process that exits while it builds (a short script, a test worker, a killed job) leaves the lock behind, so
every later build waits on it forever.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib
import shutil
import sysconfig
import tempfile
import threading
from typing import Optional

import torch

SOURCE = pathlib.Path(__file__).with_name("callpath.cpp")
_state: dict = {"module": None, "reason": "not built yet", "thread": None}
_lock = threading.Lock()


def module():
    """The loaded extension, or None (see :func:`reason`)."""
    return _state["module"]


def reason() -> str:
    """Why there is no loaded extension ("" when there is)."""
    return "" if _state["module"] is not None else _state["reason"]


def _why_not_buildable() -> Optional[str]:
    if os.environ.get("ANYMLA_CALLPATH") == "0":
        return "turned off (ANYMLA_CALLPATH=0)"
    try:
        import ninja  # the PyPI package puts its binary beside itself, not on PATH
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    if shutil.which("ninja") is None:
        return "ninja is not installed (pip install ninja), which torch's extension builder needs"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (c++, or $CXX) to build callpath.cpp with"
    return None


NAME = "anymla_callpath"
CFLAGS = ["-O2"]


def cached_library() -> pathlib.Path:
    """Where the built library of this source, torch and Python is kept."""
    from torch.utils import cpp_extension
    key = hashlib.sha256(SOURCE.read_bytes() + repr((torch.__version__, CFLAGS)).encode()).hexdigest()[:16]
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()  # as torch reads it
    return (pathlib.Path(root) / NAME / key
            / (NAME + sysconfig.get_config_var("EXT_SUFFIX")))


def _load(library: pathlib.Path):
    spec = importlib.util.spec_from_file_location(NAME, library)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _compile_into(library: pathlib.Path):
    """Build in a private directory (no lock another process could leave behind), then move the library into
    place in one step, so a reader sees all of it or none of it."""
    from torch.utils import cpp_extension
    library.parent.mkdir(parents=True, exist_ok=True)
    private = tempfile.mkdtemp(prefix=NAME + "-", dir=library.parent)
    try:
        mod = cpp_extension.load(name=NAME, sources=[str(SOURCE)], extra_cflags=CFLAGS, build_directory=private,
                                 verbose=False)
        os.replace(mod.__file__, library)
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return mod


def _build() -> None:
    library = cached_library()
    try:
        mod = _load(library) if library.exists() else _compile_into(library)
    except Exception as e:  # a failed build leaves the Python path, which always works, and says why
        _state["reason"] = f"building {SOURCE.name} failed: {str(e).strip().splitlines()[-1] if str(e) else e!r}"
        return
    configure(mod)
    _state["module"] = mod


def configure(mod, test_launcher=None) -> None:
    """Hand the extension the current device's and stream's readers (CUDA builds of torch) and, for tests on
    the CPU only, a stand-in for the driver's launch: ``test_launcher(function, grid, block, shared, stream,
    params)`` with each parameter's bytes."""
    get_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
    get_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or \
        (lambda index: torch.cuda.current_stream(index).cuda_stream)
    mod.configure(get_device, get_stream, test_launcher)


def build(wait: bool = False, timeout: Optional[float] = None) -> None:
    """Start building the extension (once; nothing when it is built or cannot be); ``wait`` for it, at most
    ``timeout`` seconds (the build goes on in the background after that, and :func:`reason` says so)."""
    with _lock:
        if _state["module"] is None and _state["thread"] is None:
            why = _why_not_buildable()
            if why:
                _state["reason"] = why
                return
            _state["reason"] = "being built"
            _state["thread"] = threading.Thread(target=_build, name="anymla-callpath-build", daemon=True)
            _state["thread"].start()
        thread = _state["thread"]
    if wait and thread is not None:
        thread.join(timeout)
        if thread.is_alive():
            _state["reason"] = f"still being built after {timeout:g} s"
