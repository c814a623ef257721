"""The verification manifest: which Ascend C kernels have been checked on real hardware, for which sources.

``verification_manifest.json`` records per kernel a sha256 over every source that decides what runs on
the device (admission, argument adaptation, schema, tiling, host binding, kernel, build) and the result of
a run on an NPU (SoC, CANN and torch_npu versions, date, errors against ``anymla.reference``, timings
against torch_npu's ``npu_sparse_flash_attention``). A kernel counts as verified only while its status is
``"verified"`` **and** its sources still hash to the recorded value; the tier refuses other kernels unless
``ANYMLA_ASCENDC_ALLOW_UNVERIFIED=1``.

    python -m anymla.ascendc_kernels.manifest --check        # CI: fail when a recorded hash is stale
    python -m anymla.ascendc_kernels.manifest --update-hash  # after editing sources: new hash, "unverified"
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
MANIFEST_PATH = PACKAGE_DIR / "verification_manifest.json"

# Paths relative to this package; a folder stands for every file below it.
KERNEL_SOURCES: dict[str, tuple[str, ...]] = {
    "sparse_attention_v41": (
        "sparse_attention_v41/op_kernel",
        "sparse_attention_v41/host",
        "sparse_attention_v41/CMakeLists.txt",
        "tiling.py",
        "hot_shapes.py",
        "op_args.py",
        "ops.py",
    ),
}

# What a run on real hardware fills in; all None until then.
HARDWARE_FIELDS = ("soc", "cann", "torch_npu", "date", "shapes", "max_abs_error", "max_rel_error",
                   "us", "us_npu_sparse_flash_attention")


def source_files(kernel: str) -> list[Path]:
    files = []
    for rel in KERNEL_SOURCES[kernel]:
        path = PACKAGE_DIR / rel
        if path.is_dir():
            files += [f for f in path.rglob("*") if f.is_file() and "__pycache__" not in f.parts]
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"manifest: source {rel!r} of kernel {kernel!r} does not exist")
    return sorted(files, key=lambda f: f.relative_to(PACKAGE_DIR).as_posix())


def source_hash(kernel: str) -> str:
    """sha256 over (relative path, content) of every source; line endings normalized to LF."""
    h = hashlib.sha256()
    for f in source_files(kernel):
        h.update(f.relative_to(PACKAGE_DIR).as_posix().encode() + b"\0")
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
    run = entry["hardware_run"]
    return True, (f"kernel {kernel} verified on {run['soc']} (CANN {run['cann']}, torch_npu {run['torch_npu']}, "
                  f"{run['date']})")


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
    action.add_argument("--check", action="store_true", help="exit 1 if a recorded source hash is stale")
    action.add_argument("--update-hash", action="store_true",
                        help="record current hashes (changed kernels -> unverified)")
    args = parser.parse_args(argv)
    if args.update_hash:
        changed = update_hashes()
        print(f"updated: {', '.join(changed)}" if changed else "all hashes current")
        return 0
    stale = stale_kernels()
    for kernel in KERNEL_SOURCES:
        print(f"{kernel}: {'STALE hash' if kernel in stale else 'hash current'}; {kernel_status(kernel)[1]}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
