"""Host cost of anymla's dispatch per call, without any kernel: ``python -m anymla.bench.overhead``.

A backend that returns preallocated outputs is registered for the measurement, so the time per call is the
public function, the problem record, the signature, the decision-cache lookup and the backend call: what a
decode step pays on the CPU before any launch. Shapes: the canonical V3.2 sparse decode (b 128, s_q 2,
h_q 128, FP8 cache) and dense decode (b 128, h_q 16), on the meta device (no memory, no kernels).
"""

from __future__ import annotations

import time

import torch

import anymla
from anymla.registry import OPS, Backend


class _Preallocated(Backend):
    name = "overhead-probe"
    ops = frozenset(OPS)
    device_types = ("meta", "cpu", "cuda")

    def __init__(self, outputs: dict):
        self.outputs = outputs

    def unavailable_reasons(self, device):
        return []

    def run(self, problem):
        return self.outputs[problem.op]


def _per_call_us(fn, n: int = 20000) -> float:
    for _ in range(200):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def measure() -> dict:
    dev = "meta"
    b, s_q, h_q = 128, 2, 128
    q = torch.empty(b, s_q, h_q, 576, dtype=torch.bfloat16, device=dev)
    cache = torch.empty(b * 512, 64, 1, 656, dtype=torch.uint8, device=dev)
    idx = torch.empty(b, s_q, 2048, dtype=torch.int32, device=dev)
    dq = torch.empty(b, 1, 16, 576, dtype=torch.bfloat16, device=dev)
    dcache = torch.empty(b * 128, 64, 1, 576, dtype=torch.bfloat16, device=dev)
    table = torch.empty(b, 128, dtype=torch.int32, device=dev)
    lens = torch.empty(b, dtype=torch.int32, device=dev)
    probe = _Preallocated({
        "sparse_decode": (torch.empty(b, s_q, h_q, 512, device=dev), torch.empty(b, s_q, h_q, device=dev)),
        "dense_decode": (torch.empty(b, 1, 16, 512, device=dev), torch.empty(b, 16, 1, device=dev)),
        "sparse_prefill": (None, None, None)})
    anymla.register_backend(probe)
    try:
        meta_s, _ = anymla.get_mla_metadata()
        meta_d, _ = anymla.get_mla_metadata()
        sparse = _per_call_us(lambda: anymla.flash_mla_with_kvcache(
            q, cache, None, None, 512, meta_s, indices=idx, is_fp8_kvcache=True, backend=probe.name))
        dense = _per_call_us(lambda: anymla.flash_mla_with_kvcache(
            dq, dcache, table, lens, 512, meta_d, backend=probe.name))
    finally:
        anymla.unregister_backend(probe.name)
    return {"sparse_decode_us": sparse, "dense_decode_us": dense}


def main() -> None:
    r = measure()
    print(f"host cost of one call through the dispatcher (no kernel), {torch.__version__}: "
          f"sparse decode {r['sparse_decode_us']:.1f} µs, dense decode {r['dense_decode_us']:.1f} µs")


if __name__ == "__main__":
    main()
