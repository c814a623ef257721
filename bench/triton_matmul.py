"""A plain Triton bf16 matmul: the compute ceiling of a stand-in run (``bench --portable`` / ``--mma-sync``).

The portable kernels are Triton code, so on a stand-in their compute rate is compared with what Triton itself
gets from the matrix units under the same settings: with ``DISABLE_MMA_V3=1`` Triton lowers every ``tl.dot``
to mma.sync, this matmul's too, where torch.mm (cuBLAS) keeps wgmma and would make every ratio look worse than
the code path it stands in for. The best of a few tile configurations is the ceiling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from anymla.triton_kernels import runtime
from anymla.triton_kernels.common import dot_acc

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M): large tiles that keep the matrix units busy with
# wgmma (8 warps, 128 x 256) and with mma.sync (128 x 128); grouped rows for L2 reuse.
CONFIGS = ((128, 256, 64, 8, 3, 8), (128, 128, 64, 8, 4, 8), (128, 128, 32, 4, 4, 8), (256, 128, 64, 8, 3, 8))


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, INTERPRET: tl.constexpr):
    """c [M, N] = a [M, K] @ b [K, N], all row-major bf16 (fp32 accumulation); M, N, K multiples of the tile."""
    pid = tl.program_id(0)
    grid_n = N // BLOCK_N
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(M // BLOCK_M - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a = a_ptr + rm[:, None] * K + rk[None, :]
    b = b_ptr + rk[:, None] * N + rn[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for _ in range(0, K, BLOCK_K):
        acc = dot_acc(tl.load(a), tl.load(b), acc, INTERPRET)
        a += BLOCK_K
        b += BLOCK_K * N
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16))


def matmul(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, config: tuple) -> None:
    """``c = a @ b`` with one configuration of :data:`CONFIGS` (shapes multiples of its tile)."""
    bm, bn, bk, warps, stages, group = config
    (m, k), n = a.shape, b.shape[1]
    _matmul_kernel[(m // bm * (n // bn),)](a, b, c, m, n, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group,
                                          INTERPRET=runtime.interpreting(), num_warps=warps, num_stages=stages)


def best_tflops(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, measure) -> float:
    """The best TFLOP/s of :data:`CONFIGS` on ``a @ b`` (``measure(fn)`` -> median µs); a configuration that does
    not fit the device is skipped, one that gives a wrong product raises."""
    expected = torch.mm(a, b)
    best = 0.0
    for config in CONFIGS:
        try:
            matmul(a, b, c, config)
        except triton.runtime.errors.OutOfResources:
            continue
        if not torch.allclose(c.float(), expected.float(), rtol=2e-2, atol=1.0):
            raise RuntimeError(f"the Triton matmul ceiling with config {config} computed a wrong product")
        us = measure(lambda: matmul(a, b, c, config))
        best = max(best, 2 * a.shape[0] * a.shape[1] * b.shape[1] / (us * 1e-6) / 1e12)
    return best
