"""Shared by the test suite and the benchmark's correctness gate: FlashMLA's comparison method, its
tolerances, and its input generators (fresh random data, NaN in every row a call must not read).

Comparison (FlashMLA ``tests/kernelkit/compare.py``): shapes and dtypes equal; the positions of +inf, -inf
and NaN equal exactly; every other element within ``abs_tol`` **or** ``rel_tol`` (``|a-r| / (|r| + 1e-6)``);
and ``cos_diff = 1 - 2 sum(a r) / (sum a^2 + sum r^2)`` (float64) at most ``cos_diff_tol``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .kvcache import KVCacheFormat, cache_slots, quantize

__all__ = ["Tolerance", "TOLERANCES", "check_close", "compare_outputs", "prefill_inputs", "sparse_decode_inputs",
           "dense_decode_inputs", "poison_", "non_contiguous", "device_under_test"]


@dataclass(frozen=True)
class Tolerance:
    abs_tol: float
    rel_tol: float
    cos_diff_tol: float = 1.0


# FlashMLA's tolerances (contract section 4.7); "2.01/128" is two bf16 ulps, "8.01/65536" eight 2^-16 steps.
TOLERANCES = {
    "dense_decode": {"out": Tolerance(8e-4, 2.01 / 128, 5e-6), "lse": Tolerance(1e-6, 8.01 / 65536)},
    "sparse_decode": {"out": Tolerance(1e-3, 2.01 / 128, 5e-6), "lse": Tolerance(1e-6, 8.01 / 65536)},
    "sparse_prefill": {"out": Tolerance(8e-4, 3.01 / 128, 7e-6), "lse": Tolerance(1e-6, 2.01 / 65536),
                       "max_logits": Tolerance(1e-6, 2.01 / 65536)},
    # k amplifier data (2 % of rows scaled up to 2^8) stresses the lazy rescale; FlashMLA loosens these.
    "sparse_prefill_amplified": {"out": Tolerance(1.0, 1.0, 7e-6), "lse": Tolerance(1e-5, 4.01 / 65536),
                                 "max_logits": Tolerance(1.0, 1.0)},
}
OUTPUT_NAMES = {"sparse_prefill": ("out", "max_logits", "lse"), "sparse_decode": ("out", "lse"),
                "dense_decode": ("out", "lse")}


def check_close(name: str, ans: torch.Tensor, ref: torch.Tensor, tol: Tolerance, scale: float = 1.0) -> None:
    """Raise AssertionError with a report unless ``ans`` matches ``ref`` by FlashMLA's method.

    ``scale`` multiplies the element tolerances (used for the Triton interpreter, whose fp32 -> bf16 casts
    truncate instead of rounding).
    """
    if ans.shape != ref.shape or ans.dtype != ref.dtype:
        raise AssertionError(f"{name}: shape/dtype {tuple(ans.shape)} {ans.dtype} != expected {tuple(ref.shape)} {ref.dtype}")
    a, r = ans.double().cpu(), ref.double().cpu()
    for kind, f in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        fa, fr = f(a), f(r)
        if not torch.equal(fa, fr):
            bad = (fa != fr).nonzero()[:5].tolist()
            raise AssertionError(f"{name}: {kind} positions differ ({int((fa != fr).sum())} elements, first at {bad}; "
                                 f"got {[a[tuple(i)].item() for i in bad]}, expected {[r[tuple(i)].item() for i in bad]})")
    special = ~torch.isfinite(r)
    a, r = a.masked_fill(special, 0.0), r.masked_fill(special, 0.0)
    err = (a - r).abs()
    rel = err / (r.abs() + 1e-6)
    fail = (err > tol.abs_tol * scale) & (rel > tol.rel_tol * scale)
    if fail.any():
        worst = int(torch.argmax(torch.where(fail, err, 0.0)))
        idx = tuple(torch.unravel_index(torch.tensor(worst), a.shape))
        raise AssertionError(f"{name}: {int(fail.sum())}/{fail.numel()} elements outside abs {tol.abs_tol * scale:g} "
                             f"and rel {tol.rel_tol * scale:g}; worst at {tuple(int(i) for i in idx)}: "
                             f"got {a[idx].item():.6g}, expected {r[idx].item():.6g}")
    denom = (a * a).sum() + (r * r).sum()
    cos_diff = 0.0 if denom == 0 else float(1 - 2 * (a * r).sum() / denom)
    if cos_diff > tol.cos_diff_tol * scale:
        raise AssertionError(f"{name}: cosine difference {cos_diff:.3g} > {tol.cos_diff_tol * scale:.3g}")


def compare_outputs(op: str, got: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], *,
                    amplified: bool = False, scale: float = 1.0) -> None:
    """Check every output of ``op`` (e.g. ``(out, max_logits, lse)`` for prefill) against the reference's."""
    tols = TOLERANCES["sparse_prefill_amplified" if amplified else op]
    for name, a, r in zip(OUTPUT_NAMES[op], got, expected):
        check_close(f"{op}.{name}", a, r, tols[name], scale)


def device_under_test() -> torch.device:
    """The accelerator the suite checks (cuda, then npu), else the CPU (Triton through its interpreter)."""
    from .selection import default_device
    return default_device()


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN (floats) or 0xFF bytes so unwritten elements cannot pass."""
    return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-1)


def _generator(seed: int, device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _rand_subsets(rows: int, n: int, k: int, g: torch.Generator, device) -> torch.Tensor:
    """``[rows, min(k, n)]`` int64: a random ordered subset of range(n) per row, without repeats."""
    out = torch.empty(rows, min(k, n), dtype=torch.long, device=device)
    step = max(1, (32 << 20) // max(1, n * 4))
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        out[r0:r1] = torch.rand(r1 - r0, n, generator=g, device=device).argsort(-1)[:, : min(k, n)]
    return out


_PREFILL_INVALID = (-2147483648, -123456, -1, 114514, 1919810, 2147480000, 2147483647)


def prefill_inputs(s_q: int, h_q: int, d_qk: int, s_kv: int, topk: int, *, h_kv: int = 1, sink: bool = False,
                   topk_length: bool = False, all_invalid_rows: bool = False, shuffle_invalid: bool = False,
                   amplify: bool = False, poison: bool = True, dtype=torch.bfloat16, device="cpu",
                   seed: int = 0) -> dict:
    """Arguments of ``flash_mla_sparse_fwd`` drawn as FlashMLA's tests draw them.

    Indices are distinct random rows; slots past ``s_kv`` hold the invalid values FlashMLA tests
    (negative, ``s_kv`` and beyond); ``shuffle_invalid`` moves them anywhere in the row (leading padding);
    ``all_invalid_rows`` makes ~2.3 % of tokens entirely invalid; ``amplify`` scales 2 % of kv rows by up to
    2^8; ``poison`` sets every kv row that no counted index reads to NaN.
    """
    g = _generator(seed, device)

    def randn(*shape):
        x = torch.randn(*shape, generator=g, device=device) / 10
        return (x + (torch.rand(*shape, generator=g, device=device) - 0.5) / 10).clamp(-10, 10)

    q = randn(s_q, h_q, d_qk).to(dtype)
    kv = randn(s_kv, h_kv, d_qk)
    if amplify:
        rows = torch.rand(s_kv, generator=g, device=device) < 0.02
        kv[rows] *= 1 + torch.rand(int(rows.sum()), 1, 1, generator=g, device=device) * 255
    idx = torch.empty(s_q, h_kv, topk, dtype=torch.long, device=device)
    for h in range(h_kv):
        sub = _rand_subsets(s_q, max(s_kv, 1), topk, g, device)[:, : min(topk, s_kv)]
        bad = torch.tensor(_PREFILL_INVALID + (s_kv,), device=device)
        fill = bad[torch.randint(len(bad), (s_q, topk), generator=g, device=device)]
        fill[:, : sub.shape[1]] = sub
        if shuffle_invalid:
            fill = torch.gather(fill, 1, torch.rand(s_q, topk, generator=g, device=device).argsort(-1))
        idx[:, h] = fill
    if all_invalid_rows:
        rows = torch.randn(s_q, generator=g, device=device) < -2
        idx[rows] = bad[torch.randint(len(bad), (1,), generator=g, device=device)]
    length = None
    if topk_length:
        length = torch.randint(0, max(topk + 1, 64), (s_q,), generator=g, device=device).clamp_max(topk).to(torch.int32)
    if poison:
        used = torch.zeros(s_kv, h_kv, dtype=torch.bool, device=device)
        counted = (idx >= 0) & (idx < s_kv)
        if length is not None:
            counted &= torch.arange(topk, device=device) < length[:, None, None]
        heads = torch.arange(h_kv, device=device)[None, :, None].expand_as(idx)
        used[idx[counted], heads[counted]] = True
        kv[~used] = float("nan")
    return dict(q=q, kv=kv.to(dtype), indices=idx.to(torch.int32), sm_scale=0.5,
                attn_sink=_sink(h_q, g, device) if sink else None, topk_length=length)


def _sink(h_q: int, g: torch.Generator, device) -> torch.Tensor:
    s = torch.randn(h_q, generator=g, device=device)
    s = torch.where(s > 0.5, float("inf"), s)
    return torch.where(s < -0.5, float("-inf"), s)


def _seqlens(b: int, s_k: int, s_q: int, varlen: bool, zero_frac: float, g, device) -> torch.Tensor:
    if varlen:
        lens = (torch.randn(b, generator=g, device=device) * s_k / 2 + s_k).round().clamp_min(s_q)
    else:
        lens = torch.full((b,), float(s_k), device=device)
    if zero_frac:
        lens[torch.rand(b, generator=g, device=device) < zero_frac] = 0
    return lens.to(torch.int32)


def _paged(b: int, lens: torch.Tensor, page: int, g, device, pad_to: int) -> tuple[torch.Tensor, int]:
    """A shuffled block table covering ``max(lens)`` padded to ``pad_to``; unused entries are huge."""
    max_len = max(int(lens.max()) if b else 0, 1)
    blocks_per_seq = math.ceil(math.ceil(max_len / pad_to) * pad_to / page)
    n_blocks = b * blocks_per_seq
    table = torch.randperm(n_blocks, generator=g, device=device).view(b, blocks_per_seq).to(torch.int32)
    used = torch.arange(blocks_per_seq, device=device) * page < lens[:, None]
    return torch.where(used, table, 2147480000), n_blocks


def dense_decode_inputs(b: int, s_q: int, h_q: int, h_kv: int, s_k: int, *, page: int = 64, d_qk: int = 576,
                        varlen: bool = False, zero_len_frac: float = 0.0, causal: bool = False, sink: bool = False,
                        dtype=torch.bfloat16, device="cpu", seed: int = 0) -> dict:
    """Arguments of dense ``flash_mla_with_kvcache`` as FlashMLA's tests draw them: a shuffled block table
    whose unused entries are 2147480000 and NaN in every cache row past each request's length."""
    g = _generator(seed, device)
    lens = _seqlens(b, s_k, s_q, varlen, zero_len_frac, g, device)
    table, n_blocks = _paged(b, lens, page, g, device, pad_to=256)
    values = (torch.randn(n_blocks, page, h_kv, d_qk, generator=g, device=device) / 10).clamp(-1, 1)
    pos = torch.arange(table.shape[1] * page, device=device)
    inside = pos[None, :] < lens[:, None]
    blk = table.long()[:, pos // page]
    off = (pos % page).expand(b, -1)
    cache = torch.full_like(values, float("nan"))
    cache[blk[inside], off[inside]] = values[blk[inside], off[inside]]
    q = (torch.randn(b, s_q, h_q, d_qk, generator=g, device=device) / 10).clamp(-1, 1).to(dtype)
    return dict(q=q, k_cache=cache.to(dtype), block_table=table, cache_seqlens=lens, head_dim_v=512,
                causal=causal, attn_sink=_sink(h_q, g, device) if sink else None)


def _decode_indices(b: int, s_q: int, topk: int, lens: torch.Tensor, table: torch.Tensor, page: int,
                    all_invalid: bool, shuffle_invalid: bool, g, device) -> torch.Tensor:
    """``[b, s_q, topk]`` slots: distinct random positions below each length, -1 padded (FlashMLA's recipe)."""
    pos = torch.full((b, s_q, topk), -1, dtype=torch.long, device=device)
    if not all_invalid:
        for i, n in enumerate(lens.tolist()):
            if n:
                sub = _rand_subsets(s_q, n, topk, g, device)
                pos[i, :, : sub.shape[1]] = sub
    if shuffle_invalid:
        pos = torch.gather(pos, 2, torch.rand(b, s_q, topk, generator=g, device=device).argsort(-1))
    return cache_slots(pos, table, page)


def sparse_decode_inputs(b: int, s_q: int, h_q: int, s_k: int, topk: int, *, fmt: KVCacheFormat,
                         page: int = 64, varlen: bool = True, zero_len_frac: float = 0.0, all_invalid: bool = False,
                         shuffle_invalid: bool = False, sink: bool = False, topk_length: bool = False,
                         extra: Optional[dict] = None, block_pad: int = 0, poison: bool = True,
                         magnitude: float = 1.0, device="cpu", seed: int = 0) -> dict:
    """Arguments of sparse ``flash_mla_with_kvcache`` as FlashMLA's tests draw them.

    ``extra`` = ``dict(fmt=, page=, s_k=, topk=, topk_length=bool)`` adds the extra cache. ``block_pad``
    extra tokens of stride between blocks make the cache non-packed. Every cache row that no counted
    index reads is NaN (poisoned before quantization, so data and scale bytes are NaN patterns).
    ``magnitude`` (a power of two): the cache rows are multiplied by it and q divided by it, which leaves the
    logits as they are and scales out by exactly ``magnitude`` (a test of a kernel's number range).
    """
    g = _generator(seed, device)
    d_qk = fmt.spec.d_qk
    lens = _seqlens(b, s_k, s_q, varlen, zero_len_frac, g, device)
    q = (torch.randn(b, s_q, h_q, d_qk, generator=g, device=device).clamp(-1, 1) / magnitude).to(torch.bfloat16)

    def one_cache(fmt_, page_, lens_, topk_, with_len):
        table, n_blocks = _paged(b, lens_, page_, g, device, pad_to=4 * page_)
        idx = _decode_indices(b, s_q, topk_, lens_, table, page_, all_invalid, shuffle_invalid, g, device)
        length = torch.randint(0, topk_ + 1, (b,), generator=g, device=device).to(torch.int32) if with_len else None
        rows = (0.1 * torch.randn(n_blocks, page_ + block_pad, 1, d_qk, generator=g, device=device)).clamp(-1, 1)
        rows = rows * magnitude
        if poison:
            counted = idx >= 0
            if length is not None:
                counted &= torch.arange(topk_, device=device) < length[:, None, None]
            keep = torch.zeros(n_blocks * page_, dtype=torch.bool, device=device)
            keep[idx[counted].long()] = True
            body = rows[:, :page_].reshape(n_blocks * page_, 1, d_qk)
            body[~keep] = float("nan")
            rows[:, :page_] = body.view(n_blocks, page_, 1, d_qk)
            rows[:, page_:] = float("nan")
        rows = rows.to(torch.bfloat16)
        cache = rows if fmt_ is KVCacheFormat.BF16 else quantize(rows, fmt_)
        return cache[:, :page_], idx, length

    k_cache, indices, length = one_cache(fmt, page, lens, topk, topk_length)
    args = dict(q=q, k_cache=k_cache, block_table=None, cache_seqlens=None, head_dim_v=512,
                softmax_scale=d_qk ** -0.55, is_fp8_kvcache=fmt.is_quantized, indices=indices,
                attn_sink=_sink(h_q, g, device) if sink else None, topk_length=length)
    if extra:
        e_lens = _seqlens(b, extra["s_k"], s_q, varlen, zero_len_frac, g, device)
        e_cache, e_idx, e_len = one_cache(extra["fmt"], extra["page"], e_lens, extra["topk"],
                                          extra.get("topk_length", False))
        args.update(extra_k_cache=e_cache, extra_indices_in_kvcache=e_idx, extra_topk_length=e_len)
    return args


def non_contiguous(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """FlashMLA's ``non_contiguousify``: the same values in a buffer whose last dim is +128 and others +1."""
    if t is None:
        return None
    big = torch.empty([s + 1 for s in t.shape[:-1]] + [t.shape[-1] + 128], dtype=t.dtype, device=t.device)
    poison_(big)
    view = big[tuple(slice(0, s) for s in t.shape)]
    view.copy_(t)
    return view
