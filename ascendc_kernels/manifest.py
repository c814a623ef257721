"""The verification manifest: which Ascend C kernels have been checked on real hardware, for which sources.

``verification_manifest.json`` records per kernel a sha256 over every file of the tier that decides what runs
on the device (availability and loading, admission, argument adaptation, schema, tiling, launch, this check,
the backend class, host binding, kernel, build) and the record of a run on an NPU. A kernel counts as verified
only while its status is ``"verified"``, its sources still hash to the recorded value **and** the record is
complete: the SoC (a 950, the only family the kernel is built for), CANN and torch_npu versions, date, the test
command that ran and its pass count, with no failure. The tier refuses other kernels unless
``ANYMLA_ASCENDC_ALLOW_UNVERIFIED=1``.

Not hashed: the shared ``anymla`` modules the tier imports (``anymla.kvcache``, ``anymla.problems``, the
registry), which change with the rest of the package; a hardware record is for the tier's own files.

    python -m anymla.ascendc_kernels.manifest --check        # CI: a stale hash or an incomplete record fails
    python -m anymla.ascendc_kernels.manifest --update-hash  # after editing sources: new hash, "unverified"
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
MANIFEST_PATH = PACKAGE_DIR / "verification_manifest.json"

# Paths relative to this package (a folder stands for every file below it), and modules outside it by name.
KERNEL_SOURCES: dict[str, tuple[str, ...]] = {
    "sparse_attention_v41": (
        "sparse_attention_v41/op_kernel",
        "sparse_attention_v41/host",
        "sparse_attention_v41/CMakeLists.txt",
        "__init__.py",
        "runtime.py",
        "launch.py",
        "manifest.py",
        "tiling.py",
        "hot_shapes.py",
        "op_args.py",
        "ops.py",
    ),
}
KERNEL_MODULES: dict[str, tuple[str, ...]] = {"sparse_attention_v41": ("anymla.backends.ascendc",)}

# What a run on real hardware fills in; all None until then. The first group must be filled for "verified".
REQUIRED_FIELDS = ("soc", "cann", "torch_npu", "date", "test_command", "tests_passed", "tests_failed")
HARDWARE_FIELDS = REQUIRED_FIELDS + ("shapes", "max_abs_error", "max_rel_error", "us",
                                     "us_npu_sparse_flash_attention")
VERIFIABLE_SOCS = ("Ascend950",)  # SoC families the kernels are built for (runtime.BUILT_FOR)


def hashed_files(kernel: str) -> list[tuple[str, Path]]:
    """(name in the hash, path) of every hashed file: package-relative paths, then modules by dotted name."""
    files = []
    for rel in KERNEL_SOURCES[kernel]:
        path = PACKAGE_DIR / rel
        if path.is_dir():
            files += [f for f in path.rglob("*") if f.is_file() and "__pycache__" not in f.parts]
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"manifest: source {rel!r} of kernel {kernel!r} does not exist")
    named = sorted((f.relative_to(PACKAGE_DIR).as_posix(), f) for f in files)
    for module in KERNEL_MODULES.get(kernel, ()):
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            raise FileNotFoundError(f"manifest: module {module!r} of kernel {kernel!r} cannot be found")
        named.append((module, Path(spec.origin)))
    return named


def source_files(kernel: str) -> list[Path]:
    return [path for _, path in hashed_files(kernel)]


def source_hash(kernel: str) -> str:
    """sha256 over (name, content) of every hashed file; line endings normalized to LF."""
    h = hashlib.sha256()
    for name, f in hashed_files(kernel):
        h.update(name.encode() + b"\0")
        h.update(f.read_bytes().replace(b"\r\n", b"\n") + b"\0")
    return h.hexdigest()


def load() -> dict:
    with open(MANIFEST_PATH) as f:
        return json.load(f)


def kernel_status(kernel: str, manifest: dict | None = None) -> tuple[bool, str]:
    """(verified, explanation) for ``kernel``."""
    entry = (manifest or load())["kernels"].get(kernel)
    if entry is None:
        return False, f"kernel {kernel} has no entry in {MANIFEST_PATH.name}"
    if entry["sha256"] != source_hash(kernel):
        return False, (f"the sources of kernel {kernel} changed since {MANIFEST_PATH.name} was recorded "
                       "(run python -m anymla.ascendc_kernels.manifest --update-hash, then verify on hardware)")
    if entry["status"] != "verified":
        return False, (f"kernel {kernel} is unverified: no run on Ascend hardware is recorded in "
                       f"{MANIFEST_PATH.name}")
    problems = record_problems(entry.get("hardware_run") or {})
    if problems:
        return False, (f"kernel {kernel} claims status 'verified' in {MANIFEST_PATH.name} without a complete "
                       f"hardware run record: {'; '.join(problems)}")
    run = entry["hardware_run"]
    return True, (f"kernel {kernel} verified on {run['soc']} (CANN {run['cann']}, torch_npu {run['torch_npu']}, "
                  f"{run['date']}: `{run['test_command']}`, {run['tests_passed']} passed, 0 failed)")


def record_problems(run: dict) -> list[str]:
    """What keeps a hardware run record from backing ``verified``; empty when it is complete."""
    problems = [f"{name} is missing" for name in REQUIRED_FIELDS if run.get(name) in (None, "")]
    soc = run.get("soc")
    if soc and not str(soc).startswith(VERIFIABLE_SOCS):
        problems.append(f"soc {soc!r} is not a SoC the kernel is built for ({', '.join(VERIFIABLE_SOCS)})")
    passed, failed = run.get("tests_passed"), run.get("tests_failed")
    if passed is not None and (not isinstance(passed, int) or passed < 1):
        problems.append(f"tests_passed must be a positive count, got {passed!r}")
    if failed is not None and failed != 0:
        problems.append(f"tests_failed must be 0, got {failed!r}")
    return problems


def hardware_run(kernel: str, manifest: dict | None = None) -> dict:
    return dict((manifest or load())["kernels"][kernel].get("hardware_run") or {})


def stale_kernels(manifest: dict | None = None) -> list[str]:
    """Kernels whose recorded hash no longer matches their sources."""
    manifest = manifest or load()
    return [k for k in KERNEL_SOURCES if manifest["kernels"].get(k, {}).get("sha256") != source_hash(k)]


def update_hashes() -> list[str]:
    """Record the current hashes; a kernel whose sources changed loses its hardware result. Returns those."""
    manifest = load()
    changed = stale_kernels(manifest)
    for kernel in changed:
        manifest["kernels"][kernel] = {"sha256": source_hash(kernel), "status": "unverified",
                                       "hardware_run": dict.fromkeys(HARDWARE_FIELDS)}
    with open(MANIFEST_PATH, "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    return changed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m anymla.ascendc_kernels.manifest",
                                     description=__doc__.split("\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--check", action="store_true",
                        help="exit 1 if a recorded source hash is stale or a 'verified' record is incomplete")
    action.add_argument("--update-hash", action="store_true",
                        help="record current hashes (changed kernels -> unverified)")
    args = parser.parse_args(argv)
    if args.update_hash:
        changed = update_hashes()
        print(f"updated: {', '.join(changed)}" if changed else "all hashes current")
        return 0
    manifest = load()
    stale = stale_kernels(manifest)
    incomplete = [k for k in KERNEL_SOURCES if manifest["kernels"].get(k, {}).get("status") == "verified"
                  and record_problems(manifest["kernels"][k].get("hardware_run") or {})]
    for kernel in KERNEL_SOURCES:
        print(f"{kernel}: {'STALE hash' if kernel in stale else 'hash current'}; {kernel_status(kernel, manifest)[1]}")
    return 1 if stale or incomplete else 0


if __name__ == "__main__":
    sys.exit(main())
