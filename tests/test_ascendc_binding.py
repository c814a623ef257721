"""The host binding (ascendc_kernels/sparse_attention_v41/host/binding.cpp) compiled and linked against torch and
the torch_npu wheel of the same version, which is unpacked, never installed next to CPU torch (.ci/run does it).

Set ANYMLA_TORCH_NPU_ROOT to the unpacked wheel's ``torch_npu/`` folder (``include/``, ``lib/``); without it the tests
skip, unless ANYMLA_REQUIRE_TORCH_NPU_CHECK=1 (CI), where a missing wheel or compiler is a failure.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from torch.utils.cpp_extension import include_paths, library_paths

BINDING = Path(__file__).resolve().parent.parent / "ascendc_kernels" / "sparse_attention_v41" / "host" / "binding.cpp"
# Symbols the binding may leave to others: CANN's runtime (libascendcl) and the kernel object, which only a CANN
# build produces. Everything else must be defined by torch's or torch_npu's libraries (or the C/C++ runtime).
LEFT_TO_CANN_BUILD = {"aclrtGetDeviceInfo", "anymla_sparse_attention_v41_launch"}
_SYSTEM_VERSION = re.compile(r"@(GLIBC|GLIBCXX|CXXABI|GCC)_")


@pytest.fixture(scope="module")
def torch_npu_root() -> Path:
    root = os.environ.get("ANYMLA_TORCH_NPU_ROOT")
    missing = [why for why, bad in (("ANYMLA_TORCH_NPU_ROOT is not set", not root), ("g++ is not installed",
                                    not shutil.which("g++")), ("nm is not installed", not shutil.which("nm"))) if bad]
    if root and not (Path(root) / "include" / "torch_npu").is_dir():
        missing.append(f"{root} has no include/torch_npu (expected the unpacked wheel's torch_npu/ folder)")
    if missing:
        if os.environ.get("ANYMLA_REQUIRE_TORCH_NPU_CHECK") == "1":
            pytest.fail("ANYMLA_REQUIRE_TORCH_NPU_CHECK=1 but " + "; ".join(missing))
        pytest.skip("; ".join(missing))
    return Path(root)


def _flags(root: Path) -> list[str]:
    includes = [*include_paths(), str(root / "include"), str(root / "include" / "third_party" / "acl" / "inc")]
    return ["g++", "-std=c++20", *[f"-I{p}" for p in includes]]


def test_binding_compiles_against_torch_npu_headers(torch_npu_root):
    result = subprocess.run([*_flags(torch_npu_root), "-fsyntax-only", str(BINDING)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]


def _dynamic_symbols(lib: Path, which: str) -> set:
    """Dynamic symbols of ``lib``; for --undefined-only the strong ones (weak references such as
    ``__gmon_start__`` may stay unresolved)."""
    out = subprocess.run(["nm", "-D", which, str(lib)], capture_output=True, text=True, check=True).stdout
    rows = [line.split() for line in out.splitlines() if line.strip()]
    return {row[-1] for row in rows if which != "--undefined-only" or row[-2] == "U"}


def test_binding_links_against_libtorch_npu(torch_npu_root, tmp_path):
    lib = tmp_path / "libbinding.so"
    libs = [*library_paths(), str(torch_npu_root / "lib")]
    cmd = [*_flags(torch_npu_root), "-shared", "-fPIC", "-O0", str(BINDING), "-o", str(lib),
           *[f"-L{p}" for p in libs], "-ltorch_npu", "-ltorch", "-ltorch_cpu", "-lc10"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    needed = {s.split("@")[0] for s in _dynamic_symbols(lib, "--undefined-only") if not _SYSTEM_VERSION.search(s)}
    provided = set()
    for directory in libs:
        for so in Path(directory).glob("lib*.so"):
            if so.name.startswith(("libtorch", "libc10")):
                provided |= {s.split("@")[0] for s in _dynamic_symbols(so, "--defined-only")}
    unresolved = needed - provided
    assert unresolved == LEFT_TO_CANN_BUILD, f"symbols neither torch nor torch_npu defines: {sorted(unresolved)}"
