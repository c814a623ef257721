"""Shared fixtures: the device under test, the backends to check against the reference, output poisoning.

Without a GPU the Triton tier runs in Triton's interpreter; TRITON_INTERPRET must be set before any kernel
module is imported, which is why it is set here, at collection time.
"""

import os

import pytest
import torch

if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

import anymla  # noqa: E402
from anymla import buffers  # noqa: E402
from anymla.testing import device_under_test  # noqa: E402

DEVICE = device_under_test()
# Every backend usable here except the oracle itself and external peers (those are checked by the bench).
BACKENDS = [n for n in anymla.available_backends(DEVICE) if n != "reference" and anymla.get_backend(n).auto_select]


def pytest_generate_tests(metafunc):
    if "backend" in metafunc.fixturenames:
        metafunc.parametrize("backend", BACKENDS or [pytest.param(None, marks=pytest.mark.skip(
            reason=f"no backend besides the reference can run on {DEVICE}"))])


def pytest_report_header(config):
    return f"anymla device under test: {DEVICE}; backends checked against the reference: {BACKENDS}"


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def poisoned_outputs():
    """Every buffer a backend allocates starts as NaN, so unwritten elements fail the comparison."""
    buffers.poison_outputs(True)
    yield
    buffers.poison_outputs(False)
    if DEVICE.type == "cuda":
        # Parallel workers share one GPU: a worker that keeps a large case's blocks cached starves the others.
        torch.cuda.empty_cache()


@pytest.fixture
def tol_scale(backend):
    """The interpreter truncates fp32 -> bf16 casts (triton_notes 4.4): allow twice FlashMLA's tolerances."""
    return 2.0 if backend == "triton" and DEVICE.type == "cpu" else 1.0
