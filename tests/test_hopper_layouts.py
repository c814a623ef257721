"""The Hopper dequantizing workers' stores of a converted block (and V3.2's rope values) into a key stage are
free of shared-memory bank conflicts, for every quantized format at the worker widths the kernels use, by
Triton's own count while compiling a probe for sm_90 (``hopper/store_conflicts.py``; offline, no GPU, in a
process of its own: the probe is compiled, never interpreted)."""

import json
import os
import subprocess
import sys

import pytest

from anymla.triton_kernels import runtime

pytestmark = pytest.mark.skipif(not runtime.gluon_hopper(),
                                reason="this Triton's Gluon is not a version the Hopper kernels were checked with")

FORMATS = ("V32_FP8", "V41_FP8", "V41_FP4", "MODEL1_FP8")

# FP4 in 4-warp workers keeps 4 rows a warp (8 spill past the budget): the 8 lanes of a store phase write 128
# columns of one row, two swizzle tiles' same 16-byte columns (triton_kernels/sparse_mla/NOTES.md, "16-byte code
# loads")
FP4_CONFLICT = pytest.mark.xfail(strict=True, reason="FP4's store is 2-way bank-conflicted (sparse_mla NOTES)")


@pytest.fixture(scope="module")
def report():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "anymla.triton_kernels.hopper.store_conflicts"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return json.loads(res.stdout.splitlines()[-1])


# (warps, loads) of the kernels' workers, as ``store_conflicts.WORKERS`` (not imported: this Triton may lack Gluon)
WORKERS = ((4, "wide"), (4, "narrow"), (8, "wide"))
CASES = [pytest.param(f, w, loads, marks=FP4_CONFLICT) if (f, w) == ("V41_FP4", 4) else (f, w, loads)
         for f in FORMATS for w, loads in WORKERS]


@pytest.mark.parametrize("fmt, warps, loads", CASES)
def test_dequantized_block_stores_without_bank_conflicts(report, fmt, warps, loads):
    counts = report[f"{fmt}/{warps}/{loads}"]
    assert counts and all(n == 0 for n in counts.values()), counts
    assert ("rope" in counts) == (fmt == "V32_FP8"), counts


def test_the_probe_covers_exactly_these_workers(report):
    assert set(report) == {f"{f}/{w}/{loads}" for f in FORMATS for w, loads in WORKERS} | {"control"}, sorted(report)


def test_the_count_sees_a_conflicting_store(report):
    assert report["control"]["latent"] > 0, report["control"]
