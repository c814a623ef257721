"""Replay every instantiation's key block with the kernel's parameters, then with each of b8ab794's defects.

    python -m anymla.ascendc_kernels.sparse_attention_v41.layout_model

Exit 0 when the kernel as it is passes every check and each old defect fails at least one.
"""

from __future__ import annotations

import sys

from .b8ab794 import DEFECTS
from .headers import OP_KERNEL, fixpipe_config, kernel_headers
from .replay import replay_kernel


def _report(title: str, results: dict) -> int:
    failed = {k: v for k, v in results.items() if v}
    print(f"{title}: {len(results) - len(failed)} of {len(results)} blocks pass")
    for label, failures in failed.items():
        print(f"  {label}: {len(failures)} failed checks, first: {failures[0]}")
    return len(failed)


def main() -> int:
    headers = kernel_headers()
    current = fixpipe_config((OP_KERNEL / "platform.h").read_text(), headers)
    ok = _report(f"kernel as it is (FixPipe config {current})", replay_kernel(headers, current)) == 0
    for old in DEFECTS:
        fixpipe = fixpipe_config(old.fixpipe_call, headers) if old.fixpipe_call else current
        print(f"\nb8ab794 defect {old.title}\n  {old.source}")
        ok &= _report("  replayed", replay_kernel(headers, fixpipe, old.overrides)) > 0
    print("\nlayout model: " + ("the kernel passes and every old defect is caught" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
