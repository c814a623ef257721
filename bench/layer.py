"""The MLA layer's benchmark (the ``layer`` suite): one decode step of one DeepSeek V3 layer, and the cache
writer on a prefill-sized write.

    python -m anymla.bench.layer --out DIR          # on a GPU: b 128, s_k 8192, h_q 128 and 16
    python -m anymla.bench.layer --out DIR --small  # tiny shapes (a CPU smoke run; the interpreter there)
    TRITON_INTERPRET=1 python -m anymla.bench.layer --host   # the layer's own host work per decode step
    python -m anymla.bench.layer --profile          # where a decode step's host time goes (cProfile)

Layer rows, per head count and cache (bf16: dense decoding; V3.2 FP8: DSA with topk 2048): the layer
(:class:`anymla.layers.MLAAttention`), each of its parts timed alone (its GEMMs and bmms as torch runs them,
and the attention call), their sum, and the same math as plain eager torch ops
(:func:`anymla.layers.mla_forward_eager`), and the parts called one after another as one call ("parts in
sequence": eagerly, what those ops cost the host in a mixed sequence). V4 rows (:mod:`.layer_v4`): one decode
step of a V4 sliding-window layer with its fused kernels and with the model code's torch ops around the same
GEMMs and attention (its ``eager_torch_speedup`` columns: how much faster the kernels make the step). Writer rows:
:func:`anymla.layers.write_cache` at 64k tokens per format, in bytes read + written per second against the
same run's copy bandwidth. Everything is timed both
as eager launches and as a CUDA-graph replay (where capturable), after a correctness check, with the host's
time to enqueue one eager call (``host_us``) on accelerators. Issue targets: layer <= 1.15x the sum of its
parts, >= 2x faster than eager torch; writer >= 0.6x copy bandwidth.

``--host`` times the layers' own host work on any machine: a decode step of a tiny layer on the Triton
tier's path (on a CPU under TRITON_INTERPRET=1) with every Triton kernel's execution and the attention call
replaced by no-ops, so what remains is the Python glue and torch's dispatch of the GEMMs (thread CPU time).
What the replaced launches cost on a GPU's host is the ``host_us`` of the layer rows.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import anymla
from anymla import callpath
from anymla.kvcache import KVCacheFormat, cache_slots, quantize
from anymla.layers import (MLAAttention, MLAConfig, explain_write_cache, mla_forward_eager, write_cache,
                           write_cache_reference)

from .ceilings import measure_ceilings
from .layer_v4 import bench_v4_layer, v4_cases
from .machine import describe
from .timing import Timer

# DeepSeek V3's YaRN (its config.json): the mscale enters the softmax scale.
V3_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
           "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


@dataclass(frozen=True)
class LayerCase:
    b: int
    s_k: int
    h_q: int
    fmt: KVCacheFormat
    topk: Optional[int]  # DSA indices per query (FP8 caches are read sparsely)
    hidden: int = 7168
    q_lora_rank: int = 1536
    page: int = 64

    @property
    def name(self) -> str:
        attn = f"topk {self.topk}" if self.topk else "dense"
        return f"b{self.b} s_k{self.s_k} h{self.h_q} {self.fmt.name} {attn}"


def layer_cases(small: bool) -> list[LayerCase]:
    if small:
        return [LayerCase(2, 64, h, fmt, 16 if fmt.is_quantized else None, hidden=256, q_lora_rank=64, page=16)
                for h in (4, 2) for fmt in (KVCacheFormat.BF16, KVCacheFormat.V32_FP8)]
    return [LayerCase(128, 8192, h, fmt, 2048 if fmt.is_quantized else None)
            for h in (128, 16) for fmt in (KVCacheFormat.BF16, KVCacheFormat.V32_FP8)]


def _graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured in a CUDA graph (after warm-up on a side stream), as the graph's replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph.replay


def time_both(timer: Timer, fn: Callable[[], object]) -> tuple[float, float, float, str]:
    """(eager µs, graph µs or nan, host µs to enqueue one eager call or nan, note) of ``fn``."""
    timing = timer.measure(fn, graph=False)
    eager, host = timing.median_us, timing.host_us
    if timer.device.type != "cuda":
        return eager, math.nan, host, "no CUDA graphs on this device"
    try:
        return eager, timer.measure(_graphed(fn), graph=False).median_us, host, ""
    except RuntimeError as err:
        torch.cuda.synchronize()
        return eager, math.nan, host, f"not graph-capturable: {str(err).splitlines()[0][:70]}"


def _random_layer(case: LayerCase, device, g: torch.Generator) -> MLAAttention:
    cfg = MLAConfig(hidden_size=case.hidden, num_heads=case.h_q, q_lora_rank=case.q_lora_rank, qk_nope_head_dim=128,
                    v_head_dim=128, rope_parameters=V3_ROPE, max_position_embeddings=163840)
    layer = MLAAttention(cfg, device=device, max_positions=case.s_k)
    with torch.no_grad():
        for name, buf in layer.named_buffers():
            if name.startswith("rope_"):
                continue
            rnd = torch.randn(buf.shape, generator=g, device=device)
            buf.copy_(1 + 0.1 * rnd if "norm" in name else rnd / math.sqrt(buf.shape[-1]))
    return layer


def _layer_inputs(case: LayerCase, layer: MLAAttention, device, g: torch.Generator) -> dict:
    """A full cache of random latent rows (written with write_cache), one new token per request at s_k - 1."""
    b, per_seq = case.b, case.s_k // case.page
    table = torch.randperm(b * per_seq, generator=g, device=device).view(b, per_seq).int()
    nb = b * per_seq
    cache = (torch.empty(nb, case.page, 1, 576, dtype=torch.bfloat16, device=device) if not case.fmt.is_quantized
             else torch.empty(nb, case.page, 1, 656, dtype=torch.uint8, device=device))
    for lo in range(0, nb * case.page, 1 << 18):  # chunks keep the random rows' memory small
        n = min(1 << 18, nb * case.page - lo)
        write_cache(cache, torch.randn(n, 576, generator=g, device=device).bfloat16(),
                    torch.arange(lo, lo + n, device=device))
    positions = torch.full((b, 1), case.s_k - 1, dtype=torch.int32, device=device)
    indices = None
    if case.topk:
        picks = torch.rand(b, case.s_k - 1, generator=g, device=device).argsort(-1)[:, : case.topk - 1]
        indices = torch.cat([picks, positions.long()], -1).int()[:, None]  # [b, 1, topk], own token included
    return dict(hidden_states=torch.randn(b, 1, case.hidden, generator=g, device=device).bfloat16(),
                positions=positions, kv_cache=cache, block_table=table,
                cache_seqlens=torch.full((b,), case.s_k, dtype=torch.int32, device=device), indices=indices,
                residual=torch.randn(b, 1, case.hidden, generator=g, device=device).bfloat16())


def _parts(layer: MLAAttention, inp: dict, device, g: torch.Generator) -> dict[str, Callable[[], object]]:
    """The layer's GEMMs and bmms as torch runs them and its attention call, each on inputs of its shape."""
    c, b = layer.config, inp["hidden_states"].shape[0]
    h, t = c.num_heads, b

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device).bfloat16()
    x, q_lat = rnd(t, c.hidden_size), rnd(t, c.q_lora_rank)
    q_nope_t = rnd(t, h, c.qk_head_dim)[..., : c.qk_nope_head_dim].transpose(0, 1)
    q_full, o_t = rnd(b, 1, h, 576), rnd(t, h, 512).transpose(0, 1)
    o_v, res = rnd(t, h * c.v_head_dim), rnd(t, c.hidden_size)
    sched = anymla.get_mla_metadata()[0]
    cache, table, page = inp["kv_cache"], inp["block_table"], inp["kv_cache"].shape[1]
    if inp["indices"] is None:
        def attention():
            return anymla.flash_mla_with_kvcache(q_full, cache, table, inp["cache_seqlens"], 512, sched,
                                                 softmax_scale=layer.softmax_scale)
    else:
        slots = cache_slots(inp["indices"], table, page)

        def attention():
            return anymla.flash_mla_with_kvcache(q_full, cache, None, None, 512, sched,
                                                 softmax_scale=layer.softmax_scale, indices=slots,
                                                 is_fp8_kvcache=inp["kv_cache"].dtype == torch.uint8)
    return {"qkv_a GEMM": lambda: F.linear(x, layer.w_qkv_a),
            "q_b GEMM": lambda: F.linear(q_lat, layer.w_q),
            "W_UK bmm": lambda: torch.bmm(q_nope_t, layer.w_uk),
            "attention": attention,
            "W_UV bmm": lambda: torch.bmm(o_t, layer.w_uv_t),
            "o_proj GEMM": lambda: torch.addmm(res, o_v, layer.w_o.t())}


def bench_layer(case: LayerCase, timer: Timer, device) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(0)
    layer = _random_layer(case, device, g)
    inp = _layer_inputs(case, layer, device, g)
    with torch.no_grad():
        got = [layer(**inp).float() for _ in range(2)]  # the first call's path, then the repeated one's (an entry)
        want = mla_forward_eager(layer, **inp).float()
    rel = max(((g - want).norm() / want.norm()).item() for g in got)
    check = f"layer vs eager torch rel err {rel:.2e} (first and repeated call)" + ("" if rel < 2e-2 else " FAILED")
    rows = []

    def row(component: str, fn) -> dict:
        with torch.no_grad():
            eager, graph, host, note = time_both(timer, fn)
        rows.append(dict(group="layer", case=case.name, component=component, eager_us=eager, graph_us=graph,
                         host_us=host, note="; ".join(filter(None, (check, note)))))
        return rows[-1]

    layer_row = row("layer", lambda: layer(**inp))
    part_fns = _parts(layer, inp, device, g)
    parts = [row(name, fn) for name, fn in part_fns.items()]
    total = {k: sum(p[k] for p in parts) for k in ("eager_us", "graph_us")}
    rows.append(dict(group="layer", case=case.name, component="sum of parts", **total, note=""))
    # The same parts one after another as one call: eagerly, the host cost of these ops in a mixed sequence,
    # which a part repeated alone (hot in the host's caches) does not show.
    row("parts in sequence", lambda: [fn() for fn in part_fns.values()])
    eager_row = row("eager torch", lambda: mla_forward_eager(layer, **inp))
    for k in ("eager_us", "graph_us"):
        layer_row[f"vs_parts_{k[:-3]}"] = layer_row[k] / total[k]
        layer_row[f"eager_torch_speedup_{k[:-3]}"] = eager_row["eager_us"] / layer_row[k]
    if rel >= 2e-2:
        raise RuntimeError(f"{case.name}: {check}")
    return rows


def bench_writer(fmt: KVCacheFormat, tokens: int, timer: Timer, device, copy_gbps: float,
                 tiles: tuple = ()) -> list[dict]:
    """The writer at ``tokens`` tokens (shipped tile), the torch reference, and on GPUs the shipped tile's
    neighbours ``tiles`` (default ``WRITER_TILES``)."""
    g = torch.Generator(device=device).manual_seed(1)
    d, page = (576 if fmt in (KVCacheFormat.BF16, KVCacheFormat.V32_FP8) else 512), 64
    nb = tokens // page
    latent = torch.randn(tokens, d, generator=g, device=device).bfloat16()
    slots = cache_slots(torch.arange(tokens, device=device)[None], torch.randperm(nb, generator=g, device=device)[None]
                        .int(), page)[0]
    if fmt.is_quantized:
        like = quantize(torch.zeros(nb, page, 1, fmt.spec.d_qk, device=device), fmt)
        ours = torch.empty_strided(like.shape, like.stride(), dtype=torch.uint8, device=device)
        ref = torch.empty_strided(like.shape, like.stride(), dtype=torch.uint8, device=device)
    else:
        ours = torch.empty(nb, page, 1, d, dtype=torch.bfloat16, device=device)
        ref = torch.empty_like(ours)
    ours.view(torch.uint8).fill_(0xA5)
    ref.view(torch.uint8).fill_(0xA5)
    write_cache(ours, latent, slots)
    write_cache_reference(ref, latent, slots)
    same = torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))
    check = "bytes equal to the reference writer" if same else "BYTES DIFFER from the reference writer"
    moved = tokens * (2 * d + (fmt.spec.bytes_per_token if fmt.is_quantized else 2 * d))
    rows = []
    variants = [("write_cache", lambda: write_cache(ours, latent, slots)),
                ("torch reference", lambda: write_cache_reference(ref, latent, slots))]
    if device.type == "cuda":  # the shipped tile (launch.writer_tile) against its neighbours
        from anymla.triton_kernels.cache_write import launch
        for tile in tiles or WRITER_TILES:
            variants.append((f"tile {tile[0]} tokens x {tile[1]} warps",
                             lambda tile=tile: launch.write_rows(ours, fmt, latent, slots, tile)))
    for component, fn in variants:
        eager, graph, host, note = time_both(timer, fn)
        best = eager if math.isnan(graph) else min(eager, graph)
        gbps = moved / (best * 1e-6) / 1e9
        rows.append(dict(group="writer", case=f"{fmt.name} {tokens} tokens", component=component, eager_us=eager,
                         graph_us=graph, host_us=host, gbps=gbps, vs_copy=gbps / copy_gbps,
                         note="; ".join(filter(None, (check, note)))))
    if not same:
        raise RuntimeError(f"write_cache {fmt.name}: {check}")
    return rows


class _NoKernel:
    """A Triton kernel whose launches do nothing (``--host``)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _no_attention(q, *args, **kwargs):
    return torch.empty(*q.shape[:3], 512, dtype=q.dtype, device=q.device), None


def host_glue(device, steps: int = 100, rounds: int = 15) -> list[dict]:
    """The layer's own host work per decode step (see the module docstring): tiny layers (2 requests), V3's
    (2 heads, hidden 32) over bf16 dense and V3.2 FP8 with DSA indices, V4's (4 heads of 512) over a bf16
    cache; median over ``rounds`` of ``steps`` steps."""
    from unittest import mock

    from anymla.layers import V4Attention, V4Config, kernels
    from anymla.triton_kernels.cache_write import kernel as cw_kernel, launch
    name, why = kernels.choose(device)
    if name != "triton":
        raise RuntimeError(f"--host times the Triton tier's path, which does not run here: {why}")
    cfg = MLAConfig(hidden_size=32, num_heads=2, q_lora_rank=16, qk_nope_head_dim=16, v_head_dim=16,
                    max_position_embeddings=64)
    stubs = {n: _NoKernel() for n in dir(launch) if isinstance(getattr(launch, n), type(cw_kernel.cache_write_kernel))}
    pos = torch.tensor([[40], [50]], device=device)
    common = dict(hidden_states=torch.randn(2, 1, 32, device=device).bfloat16(), positions=pos,
                  block_table=torch.arange(8, dtype=torch.int32, device=device).view(2, 4),
                  residual=torch.randn(2, 1, 32, device=device).bfloat16())
    cases = []
    for fmt in (KVCacheFormat.BF16, KVCacheFormat.V32_FP8):
        cache = (torch.zeros(8, 16, 1, 576, dtype=torch.bfloat16, device=device) if fmt is KVCacheFormat.BF16
                 else torch.zeros(8, 16, 1, 656, dtype=torch.uint8, device=device))
        inp = dict(common, kv_cache=cache, cache_seqlens=(pos[:, 0] + 1).int(),
                   indices=None if fmt is KVCacheFormat.BF16 else torch.randint(0, 40, (2, 1, 16), device=device))
        cases.append((f"{fmt.name}{' topk 16' if inp['indices'] is not None else ' dense'}",
                      MLAAttention(cfg, device=device), inp))
    v4 = V4Attention(V4Config(hidden_size=32, num_heads=4, q_lora_rank=16, o_groups=2, o_lora_rank=8,
                              sliding_window=4), device=device)
    cases.append(("V4 BF16 window 4", v4, dict(common, kv_cache=torch.zeros(8, 16, 1, 512, dtype=torch.bfloat16,
                                                                             device=device))))
    rows = []
    for case, layer, inp in cases:
        for _, buf in layer.named_buffers():
            buf.normal_()
        per_step = []
        with mock.patch.object(anymla.api, "flash_mla_with_kvcache", _no_attention), \
                mock.patch.multiple(launch, **stubs), torch.no_grad():
            for _ in range(20):
                layer(**inp)
            for _ in range(rounds):
                t0 = time.thread_time()
                for _ in range(steps):
                    layer(**inp)
                per_step.append((time.thread_time() - t0) * 1e6 / steps)
        rows.append(dict(group="host", case=case, component="layer glue (kernels, attention: no-ops)",
                         host_us=statistics.median(per_step), note=f"thread CPU time, {device.type}"))
        print(f"host glue {case}: {rows[-1]['host_us']:.1f} µs per decode step (min {min(per_step):.1f})")
    return rows


def profile_steps(device, steps: int = 200, top: int = 22) -> None:
    """Where the host time of an eager decode step goes, per layer case: µs a step enqueued back to back
    and drained, then cProfile's functions by their own time over ``steps`` steps (on a GPU, every launch
    real)."""
    import cProfile
    import pstats

    g = torch.Generator(device=device).manual_seed(0)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for case in layer_cases(device.type == "cpu"):
        layer = _random_layer(case, device, g)
        inp = _layer_inputs(case, layer, device, g)
        step = lambda: layer(**inp)  # noqa: E731
        for _ in range(20):
            step()
        drained = []
        for _ in range(50):
            sync()
            t0 = time.perf_counter()
            step()
            drained.append((time.perf_counter() - t0) * 1e6)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        stream = (time.perf_counter() - t0) * 1e6 / steps
        print(f"=== {case.name}: host {statistics.median(drained):.1f} µs a step drained, {stream:.1f} back to back")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            step()
        prof.disable()
        sync()
        pstats.Stats(prof).sort_stats("tottime").print_stats(top)


# Writer tiles (tokens per program, warps) timed next to the shipped one (cache_write.launch.writer_tile) on GPUs.
WRITER_TILES = ((2, 1), (4, 2), (2, 2), (4, 4), (8, 4))

COLUMNS = ["group", "case", "component", "eager_us", "graph_us", "host_us", "vs_parts_eager", "vs_parts_graph",
           "eager_torch_speedup_eager", "eager_torch_speedup_graph", "gbps", "vs_copy", "note"]


def _fmt(v) -> str:
    if isinstance(v, float):
        return "-" if math.isnan(v) else (f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}")
    return "" if v is None else str(v)


def print_table(rows: list[dict]) -> None:
    shown = ["case", "component", "eager_us", "graph_us", "host_us", "vs_parts_eager", "vs_parts_graph",
             "eager_torch_speedup_eager", "gbps", "vs_copy"]
    cells = [[_fmt(r.get(k)) for k in shown] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(shown)]
    print("  ".join(k.ljust(w) for k, w in zip(shown, widths)))
    for c in cells:
        print("  ".join(v.ljust(w) for v, w in zip(c, widths)))


def main(argv: Optional[list[str]] = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m anymla.bench.layer", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_out", help="folder for layer.csv")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per call (default 50, --small 2)")
    ap.add_argument("--writer-tokens", type=int, default=None, help="tokens per writer call (default 65536)")
    ap.add_argument("--host", action="store_true", help="only the layer's own host work per decode step")
    ap.add_argument("--profile", action="store_true", help="where a decode step's host time goes (cProfile)")
    ap.add_argument("--writers-only", action="store_true", help="only the cache writer rows (no layer steps)")
    ap.add_argument("--writer-formats", default="", help="comma-separated formats for the writer rows (default all)")
    ap.add_argument("--writer-tiles", default="", help="the writer tiles timed beside the shipped one, "
                    "TOKENSxWARPS,... (default " + ",".join(f"{t}x{w}" for t, w in WRITER_TILES) + ")")
    args = ap.parse_args(argv)
    tiles = tuple(tuple(int(v) for v in t.split("x")) for t in args.writer_tiles.split(",") if t)
    formats = [KVCacheFormat[f] for f in args.writer_formats.split(",") if f] or list(KVCacheFormat)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(callpath.prepare(device), flush=True)
    if args.host:
        return host_glue(device)
    if args.profile:
        with torch.no_grad():
            profile_steps(device)
        return []
    info = describe(device)
    timer = Timer(device, args.reps or (2 if args.small else 50))
    ceilings = measure_ceilings(device, timer)
    print(f"{info.device_name}, torch {info.torch}, triton {info.triton}; {ceilings.describe()}")
    print(explain_write_cache(device))
    rows = []
    for case in () if args.writers_only else layer_cases(args.small):
        rows += bench_layer(case, timer, device)
    for case in () if args.writers_only else v4_cases(args.small):
        rows += bench_v4_layer(case, timer, device, time_both)
    tokens = args.writer_tokens or (256 if args.small else 65536)
    for fmt in formats:
        rows += bench_writer(fmt, tokens, timer, device, ceilings.copy_gbps, tiles)
    print_table(rows)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "layer.csv")
    stamp = dict(timestamp=info.timestamp, device=info.device, device_name=info.device_name, torch=info.torch,
                 triton=info.triton, interpreter=info.interpreter, copy_gbps=ceilings.copy_gbps)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(stamp) + COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({**stamp, **{k: _fmt(r.get(k)) if isinstance(r.get(k), float) else r.get(k, "")
                                    for k in COLUMNS}})
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
