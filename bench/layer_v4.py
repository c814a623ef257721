"""The ``layer`` suite's V4 rows: one decode step of a DeepSeek V4 sliding-window layer
(:class:`anymla.layers.V4Attention`) with its fused Triton kernels against the same layer with the model code's
torch ops around the same GEMMs and attention (``kernel_backend = "torch"``), eager and under CUDA graphs, after
a check that both give the same step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from anymla.kvcache import KVCacheFormat
from anymla.layers import V4Attention, V4Config, write_cache

from .timing import Timer

_BYTES = {KVCacheFormat.BF16: 512, KVCacheFormat.MODEL1_FP8: 584, KVCacheFormat.V41_FP8: 528,
          KVCacheFormat.V41_FP4: 288}


@dataclass(frozen=True)
class V4Case:
    b: int
    s_k: int
    h_q: int
    o_groups: int
    fmt: KVCacheFormat
    hidden: int = 4096  # DeepSeek V4's (its Hugging Face config's defaults)
    q_lora_rank: int = 1024
    o_lora_rank: int = 1024
    window: int = 128
    page: int = 64

    @property
    def name(self) -> str:
        return f"V4 b{self.b} s_k{self.s_k} h{self.h_q} {self.fmt.name} window {self.window}"


def v4_cases(small: bool) -> list[V4Case]:
    if small:
        return [V4Case(2, 64, 4, 2, KVCacheFormat.V41_FP4, hidden=64, q_lora_rank=32, o_lora_rank=16, window=8,
                       page=16)]
    # all 64 heads, and a tensor-parallel share of them (TP 4)
    return [V4Case(128, 8192, 64, 8, KVCacheFormat.MODEL1_FP8), V4Case(128, 8192, 16, 2, KVCacheFormat.V41_FP4)]


def _v4_setup(case: V4Case, device, g: torch.Generator):
    cfg = V4Config(hidden_size=case.hidden, num_heads=case.h_q, q_lora_rank=case.q_lora_rank, o_groups=case.o_groups,
                   o_lora_rank=case.o_lora_rank, sliding_window=case.window, max_position_embeddings=case.s_k)
    layer = V4Attention(cfg, device=device)
    with torch.no_grad():
        for name, buf in layer.named_buffers():
            if not name.startswith("rope_"):
                rnd = torch.randn(buf.shape, generator=g, device=device)
                buf.copy_(1 + 0.1 * rnd if "norm" in name else rnd / math.sqrt(buf.shape[-1]))
    b, per_seq = case.b, case.s_k // case.page
    nb = b * per_seq
    last = _BYTES[case.fmt]
    cache = (torch.empty(nb, case.page, 1, last, dtype=torch.bfloat16, device=device) if case.fmt is KVCacheFormat.BF16
             else torch.empty(nb, case.page, 1, last, dtype=torch.uint8, device=device))
    for lo in range(0, nb * case.page, 1 << 18):  # chunks keep the random rows' memory small
        n = min(1 << 18, nb * case.page - lo)
        write_cache(cache, torch.randn(n, 512, generator=g, device=device).bfloat16(),
                    torch.arange(lo, lo + n, device=device))
    inp = dict(hidden_states=torch.randn(b, 1, case.hidden, generator=g, device=device).bfloat16(),
               positions=torch.full((b, 1), case.s_k - 1, dtype=torch.int32, device=device), kv_cache=cache,
               block_table=torch.randperm(nb, generator=g, device=device).view(b, per_seq).int(),
               residual=torch.randn(b, 1, case.hidden, generator=g, device=device).bfloat16())
    return layer, inp


def bench_v4_layer(case: V4Case, timer: Timer, device, time_both) -> list[dict]:
    """Rows ``v4 layer`` (its kernels as dispatched) and ``v4 layer, torch ops`` of one decode step;
    ``time_both`` is the layer suite's (eager, graph, host, note) timer."""
    g = torch.Generator(device=device).manual_seed(2)
    layer, inp = _v4_setup(case, device, g)
    with torch.no_grad():
        got = [layer(**inp).float() for _ in range(2)]  # the first call's path, then the repeated one's
        layer.kernel_backend = "torch"
        want = layer(**inp).float()
        layer.kernel_backend = None
    rel = max(((g - want).norm() / want.norm()).item() for g in got)
    check = f"fused vs torch ops rel err {rel:.2e} (first and repeated call)" + ("" if rel < 2e-2 else " FAILED")
    rows = []
    for component, backend in (("v4 layer", None), ("v4 layer, torch ops", "torch")):
        def step(backend=backend):
            layer.kernel_backend = backend
            return layer(**inp)
        with torch.no_grad():
            eager, graph, host, note = time_both(timer, step)
        rows.append(dict(group="layer", case=case.name, component=component, eager_us=eager, graph_us=graph,
                         host_us=host, note="; ".join(filter(None, (check, note)))))
    layer.kernel_backend = None
    for k in ("eager", "graph"):  # how much faster the fused kernels make the step
        rows[0][f"eager_torch_speedup_{k}"] = rows[1][f"{k}_us"] / rows[0][f"{k}_us"]
    if rel >= 2e-2:
        raise RuntimeError(f"{case.name}: {check}")
    return rows
