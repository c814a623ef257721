"""Packaging: the wheel installs one package, ``anymla``, with the Triton kernels, the Ascend C sources and the
benchmark inside it, and the repository's folder names (dispatch/, triton_kernels/, ...) never leak as
top-level modules.

The wheel is built offline (no build isolation) from a copy of the sources, so the checkout is left untouched;
it takes a few seconds.
"""

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "dispatch", "triton_kernels", "ascendc_kernels", "bench")
REPO_FOLDERS = ("dispatch", "triton_kernels", "ascendc_kernels", "bench", "tests")


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory):
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "results", "lib"))
        else:
            shutil.copy2(path, src / name)
    dist = tmp_path_factory.mktemp("dist")
    # Offline, without isolation: the venv's setuptools (the test extra asks for >= 77) builds the wheel.
    done = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation",
                           "--outdir", str(dist), str(src)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    wheels = list(dist.glob("anymla-*.whl"))
    assert len(wheels) == 1, wheels
    with zipfile.ZipFile(wheels[0]) as z:
        return z.namelist()


def test_every_file_is_under_anymla_or_the_dist_info(wheel_files):
    tops = {name.split("/")[0] for name in wheel_files}
    dist_info = {t for t in tops if t.endswith(".dist-info")}
    assert len(dist_info) == 1 and tops - dist_info == {"anymla"}, sorted(tops)
    for folder in REPO_FOLDERS:
        assert not any(name.startswith(folder + "/") for name in wheel_files), folder


@pytest.mark.parametrize("path", [
    "anymla/__init__.py",
    "anymla/backends/triton.py",
    "anymla/triton_kernels/sparse_mla/kernel.py",
    "anymla/triton_kernels/dense_decode/kernel.py",
    "anymla/ascendc_kernels/sparse_attention_v41/op_kernel/sparse_attention_v41.asc",
    "anymla/ascendc_kernels/verification_manifest.json",
    "anymla/bench/__main__.py",
])
def test_the_wheel_holds(wheel_files, path):
    assert path in wheel_files


def test_every_source_module_is_packaged(wheel_files):
    """No Python module of the package folders is forgotten by the explicit ``packages`` list."""
    mapping = {"dispatch": "anymla", "triton_kernels": "anymla/triton_kernels",
               "ascendc_kernels": "anymla/ascendc_kernels", "bench": "anymla/bench"}
    missing = []
    for folder, target in mapping.items():
        for py in (ROOT / folder).rglob("*.py"):
            rel = py.relative_to(ROOT / folder)
            if "__pycache__" in rel.parts or (folder == "dispatch" and rel.parts[0] in mapping):
                continue
            if f"{target}/{rel.as_posix()}" not in wheel_files:
                missing.append(f"{folder}/{rel.as_posix()}")
    assert not missing, missing


def test_top_level_name_is_anymla_only(tmp_path):
    """Outside the checkout, the installed package exposes ``anymla`` and no repository folder name (a
    folder of that name elsewhere on the path, e.g. another project's ``tests``, is not this repository's)."""
    code = ("import importlib.util as u, json\n"
            "def ours(n):\n"
            "    s = u.find_spec(n)\n"
            "    places = [] if s is None else list(s.submodule_search_locations or [s.origin])\n"
            f"    return any(str(p).startswith({str(ROOT)!r} + '/' + n) for p in places) if n != 'anymla' else "
            "s is not None\n"
            f"print(json.dumps({{n: ours(n) for n in {list(REPO_FOLDERS) + ['anymla']!r}}}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found.pop("anymla") is True
    assert not any(found.values()), found
