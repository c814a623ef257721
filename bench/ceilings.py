"""The device's ceilings, measured in the same run as the kernels: a large copy and a large bf16 matmul.

Absolute rates drift between machines of one kind (the H200 anchors saw 686 to 790 TFLOP/s), so every
ratio the report gives is against these same-run numbers. A stand-in run (the portable kernels as other GPUs
get them) takes as its compute ceiling a plain Triton matmul compiled with the run's own settings
(:mod:`.triton_matmul`), torch.mm's rate named beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .timing import Timer

# Accelerators: 1 GiB device-to-device copy and an 8192^3 product. The CPU gets sizes that take
# milliseconds there, and the labels say so.
_ACCELERATOR_SIZES = (1 << 30, 8192)
_CPU_SIZES = (64 << 20, 1024)


@dataclass(frozen=True)
class Ceilings:
    copy_gbps: float  # bytes read + bytes written per second, 1e9
    matmul_tflops: float
    copy_label: str
    matmul_label: str

    def describe(self) -> str:
        return (f"copy {self.copy_gbps:,.0f} GB/s ({self.copy_label}), "
                f"matmul {self.matmul_tflops:,.1f} TFLOP/s ({self.matmul_label})")


def better(a: Ceilings, b: Ceilings) -> Ceilings:
    """The higher rate of each ceiling: a run measures them at its start and end, and a device that was
    slow for one of them (clocks ramping, a neighbour's load) must not make every ratio look better."""
    return Ceilings(max(a.copy_gbps, b.copy_gbps), max(a.matmul_tflops, b.matmul_tflops), a.copy_label,
                    a.matmul_label)


def measure_ceilings(device: torch.device, timer: Timer, stand_in: str = "") -> Ceilings:
    """``stand_in``: the stand-in of the run (``machine.stand_in``), "" for the shipped path."""
    copy_bytes, n = _CPU_SIZES if device.type == "cpu" else _ACCELERATOR_SIZES
    where = "host" if device.type == "cpu" else "device-to-device"
    src = torch.ones(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    # Never from a CUDA graph: a graph turns the copy into a DMA-engine node, measured at 2.8 TB/s on an H200
    # where the eager copy (and kernels) reach 4.2 TB/s.
    copy = timer.measure(lambda: dst.copy_(src), graph=False)
    del src, dst
    # Random operands: on zeros the tensor cores draw less power and run faster than on real data.
    a = torch.randn(n, n, device=device).to(torch.bfloat16)
    b = torch.randn(n, n, device=device).to(torch.bfloat16)
    c = torch.empty_like(a)
    product = timer.measure(lambda: torch.mm(a, b, out=c), graph=False)
    matmul = 2 * n ** 3 / (product.median_us * 1e-6) / 1e12
    label = f"bf16 {n}x{n}x{n} torch.mm on {device.type}"
    if stand_in and device.type == "cuda":
        from .triton_matmul import CONFIGS, best_tflops
        torch_mm = matmul
        matmul = best_tflops(a, b, c, lambda fn: timer.measure(fn, graph=False).median_us)
        label = (f"bf16 {n}x{n}x{n} Triton tl.dot matmul with this run's settings ({stand_in}), best of "
                 f"{len(CONFIGS)} tiles; torch.mm {torch_mm:,.1f} TFLOP/s")
    return Ceilings(
        copy_gbps=2 * copy_bytes / (copy.median_us * 1e-6) / 1e9,
        matmul_tflops=matmul,
        copy_label=f"{copy_bytes >> 20} MiB {where} copy, read + write",
        matmul_label=label)
