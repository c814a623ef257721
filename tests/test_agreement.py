"""Every backend against the PyTorch reference on FlashMLA's test grids (contract sections 4.3-4.5, 9).

Inputs are fresh random data with NaN in every cache row the call must not read; outputs are poisoned
(conftest). On the CPU the grids are subsets sized for Triton's interpreter; on a GPU they are the full
grids of the contract.
"""

import itertools
import math
import os
import zlib

import pytest
import torch

import anymla
from anymla.kvcache import KVCacheFormat as F
from anymla.testing import compare_outputs, dense_decode_inputs, device_under_test, prefill_inputs, sparse_decode_inputs

DEVICE = device_under_test()
# FlashMLA's full grids on an accelerator; interpreter-sized subsets on the CPU (or ANYMLA_TEST_GRID=small).
ON_GPU = DEVICE.type != "cpu" and os.environ.get("ANYMLA_TEST_GRID", "full") == "full"
ON_ACCELERATOR = DEVICE.type != "cpu"  # shapes sized for a device, whatever the grid


def _decode_pair(args, backend):
    meta, _ = anymla.get_mla_metadata()
    got = anymla.flash_mla_with_kvcache(**args, tile_scheduler_metadata=meta, backend=backend)
    ref = anymla.flash_mla_with_kvcache(**args, tile_scheduler_metadata=None, backend="reference")
    return got, ref


# ---------------------------------------------------------------- sparse prefill
if ON_GPU:
    PREFILL = [dict(d_qk=d, h_q=h, s_kv=s_kv, topk=k, s_q=s_q, sink=sink, topk_length=tl)
               for d, h, (s_kv, k), s_q, sink, tl in itertools.product(
                   (576, 512), (128, 64), ((128, 128), (256, 256), (512, 512), (592, 128), (1840, 256), (1592, 384),
                                           (1521, 512), (95, 128), (153, 256), (114, 384)),
                   (1, 62, 213), (False, True), (False, True))]
else:
    PREFILL = [dict(d_qk=d, h_q=h, s_kv=s_kv, topk=k, s_q=2, sink=sink, topk_length=sink)
               for d, h, (s_kv, k), sink in itertools.product(
                   (576, 512), (64, 128), ((128, 128), (95, 128), (300, 100)), (False, True))]
PREFILL += [
    dict(d_qk=576, h_q=16, s_kv=200, topk=64, s_q=3, shuffle_invalid=True),  # leading invalid padding, TP16
    dict(d_qk=512, h_q=8, s_kv=64, topk=96, s_q=2, sink=True),  # TP8 heads, topk > s_kv, tail block
    dict(d_qk=512, h_q=4, s_kv=150, topk=64, s_q=2, topk_length=True),  # V4's 64 heads at TP16
    dict(d_qk=576, h_q=96, s_kv=150, topk=64, s_q=2, sink=True),  # an odd count: 64-head programs, one half empty
    dict(d_qk=512, h_q=32, s_kv=100, topk=64, s_q=2, h_kv=2),  # h_kv > 1 (beyond FlashMLA)
    dict(d_qk=576, h_q=64, s_kv=32, topk=2048 if ON_GPU else 512, s_q=1),  # s_kv << topk
    dict(d_qk=512, h_q=64, s_kv=300, topk=128, s_q=4, all_invalid_rows=True, topk_length=True),
    dict(d_qk=576, h_q=64, s_kv=1, topk=64, s_q=2),
    dict(d_qk=576, h_q=64, s_kv=0, topk=64, s_q=2),
]
PREFILL_ALL_INVALID = [(1, 128, 128), (1, 256, 256)] + ([(1234, 4321, 4096), (4096, 2048, 2048)] if ON_GPU else [])


def _prefill_id(c):
    return "-".join(f"{k}{int(v) if isinstance(v, bool) else v}" for k, v in c.items())


def _prefill_args(case, device):
    """``prefill_inputs`` for a case dict (seeded by the case's id)."""
    c = dict(case)
    return prefill_inputs(c.pop("s_q"), c.pop("h_q"), c.pop("d_qk"), c.pop("s_kv"), c.pop("topk"), device=device,
                          seed=zlib.crc32(_prefill_id(case).encode()), **c)


def _dense_args(case, device):
    """``dense_decode_inputs`` for a case dict (seeded by the case's id)."""
    c = dict(case)
    return dense_decode_inputs(c.pop("b"), c.pop("s_q"), c.pop("h_q"), c.pop("h_kv"), c.pop("s_k"), device=device,
                               seed=zlib.crc32(_prefill_id(case).encode()), **c)


@pytest.mark.parametrize("case", PREFILL, ids=_prefill_id)
def test_sparse_prefill(backend, case, tol_scale, device):
    args = _prefill_args(case, device)
    compare_outputs("sparse_prefill", anymla.flash_mla_sparse_fwd(**args, backend=backend),
                    anymla.flash_mla_sparse_fwd(**args, backend="reference"), scale=tol_scale)


@pytest.mark.parametrize("s_q,s_kv,topk", PREFILL_ALL_INVALID)
@pytest.mark.parametrize("d_qk", (576, 512))
def test_sparse_prefill_all_invalid(backend, s_q, s_kv, topk, d_qk, device):
    args = prefill_inputs(s_q, 64, d_qk, s_kv, topk, device=device, seed=5)
    args["indices"].fill_(-1)
    out, max_logits, lse = anymla.flash_mla_sparse_fwd(**args, backend=backend)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(max_logits).all() and torch.isposinf(lse).all()


@pytest.mark.parametrize("d_qk,h_q", [(512, 64), (576, 128)] if ON_GPU else [(512, 64)])
def test_sparse_prefill_k_amplifier(backend, d_qk, h_q, tol_scale, device):
    """2 % of kv rows scaled by up to 2^8: logits jump, exercising the lazy (skip-scale) rescale."""
    args = prefill_inputs(3 if not ON_GPU else 213, h_q, d_qk, 1592, 384, amplify=True, sink=True, topk_length=True,
                          device=device, seed=7)
    compare_outputs("sparse_prefill", anymla.flash_mla_sparse_fwd(**args, backend=backend),
                    anymla.flash_mla_sparse_fwd(**args, backend="reference"), amplified=True, scale=tol_scale)


@pytest.mark.skipif(not ON_ACCELERATOR, reason="70000 query tokens take hours in the interpreter; run on a GPU")
def test_sparse_prefill_large_grid(backend, device):
    """s_q = 70000 overflows a 65535 grid dimension if tokens were mapped to one; it must simply run."""
    args = prefill_inputs(70000, 64, 512, 256, 64, device=device, seed=8, poison=False)
    out, max_logits, lse = anymla.flash_mla_sparse_fwd(**args, backend=backend)
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()


# ---------------------------------------------------------------- sparse decode
def _decode_cases():
    if ON_GPU:
        grid = [dict(fmt=fmt, h_q=h, s_k=s_k, topk=k, page=page, b=b, s_q=s_q, varlen=b != 74,
                     topk_length=fmt is not F.V32_FP8, sink=True)
                # FlashMLA's grid has 64 and 128 heads; 4-32 are the tensor-parallel shares it refuses, 40 and 96
                # counts that are no multiple of a program's heads
                for fmt in (F.V32_FP8, F.MODEL1_FP8, F.V41_FP8, F.BF16) for h in (4, 8, 16, 32, 40, 64, 96, 128)
                for (s_k, k, page) in ((512, 64, 2), (512, 64, 64), (512, 64, 69), (1024, 576, 2), (1024, 576, 61),
                                       (2046, 2048, 2), (2046, 2048, 64), (2046, 2048, 576), (512, 64, 61),
                                       (650, 576, 53))
                for b in (4, 74) for s_q in (1, 3)]
    else:
        grid = [dict(fmt=fmt, h_q=64, s_k=s_k, topk=k, page=page, b=2, s_q=s_q, topk_length=fmt is not F.V32_FP8,
                     sink=s_q == 2)
                for fmt in (F.V32_FP8, F.MODEL1_FP8, F.V41_FP8, F.BF16)
                for (s_k, k, page), s_q in zip(((300, 64, 2), (200, 128, 61), (200, 64, 5), (300, 100, 53)), (1, 2, 3, 1))]
    grid += [
        dict(fmt=F.V41_FP8, h_q=64, s_k=300, topk=128, page=64, b=2, s_q=1,
             extra=dict(fmt=F.V41_FP4, page=2, s_k=200, topk=64, topk_length=True)),
        dict(fmt=F.MODEL1_FP8, h_q=128, s_k=300, topk=64, page=64, b=2, s_q=1,
             extra=dict(fmt=F.MODEL1_FP8, page=1, s_k=150, topk=64)),
        dict(fmt=F.V41_FP8, h_q=128, s_k=300, topk=128, page=123, b=2, s_q=1,
             extra=dict(fmt=F.V41_FP8, page=5, s_k=150, topk=100)),  # partial extra block (not a multiple of 64)
        dict(fmt=F.V32_FP8, h_q=16, s_k=300, topk=64, page=256, b=3, s_q=2, shuffle_invalid=True),  # leading -1
        dict(fmt=F.V41_FP8, h_q=8, s_k=200, topk=64, page=576, b=2, s_q=1, sink=True),  # TP8
        dict(fmt=F.V41_FP8, h_q=4, s_k=200, topk=64, page=64, b=2, s_q=2, sink=True,
             extra=dict(fmt=F.V41_FP4, page=64, s_k=100, topk=64)),  # V4's 64 heads at TP16
        dict(fmt=F.V32_FP8, h_q=96, s_k=200, topk=64, page=64, b=2, s_q=1, topk_length=True),  # an odd count
        dict(fmt=F.V32_FP8, h_q=64, s_k=300, topk=64, page=16, b=4, s_q=1, zero_len_frac=0.5, sink=True),
        dict(fmt=F.V41_FP8, h_q=64, s_k=300, topk=64, page=16, b=2, s_q=3, all_invalid=True, sink=True),
        dict(fmt=F.V32_FP8, h_q=64, s_k=100, topk=64, page=16, b=2, s_q=1, block_pad=3),  # non-packed blocks
        dict(fmt=F.V41_FP8, h_q=32, s_k=100, topk=64, page=8, b=2, s_q=2, block_pad=1, topk_length=True),
        dict(fmt=F.V32_FP8, h_q=64, s_k=1000, topk=512, page=64, b=1, s_q=1),  # one request: split over topk
        dict(fmt=F.V41_FP8, h_q=64, s_k=1000, topk=384, page=64, b=1, s_q=1, topk_length=True, sink=True,
             extra=dict(fmt=F.V41_FP4, page=64, s_k=300, topk=128, topk_length=True)),  # split spanning both caches
    ]
    return grid


def _decode_id(c):
    return "-".join(f"{k}{v.name if isinstance(v, F) else ('X' if isinstance(v, dict) else v)}" for k, v in c.items())


@pytest.mark.parametrize("case", _decode_cases(), ids=_decode_id)
def test_sparse_decode(backend, case, tol_scale, device):
    c = dict(case)
    args = sparse_decode_inputs(c.pop("b"), c.pop("s_q"), c.pop("h_q"), c.pop("s_k"), c.pop("topk"), device=device,
                                seed=zlib.crc32(_decode_id(case).encode()), **c)
    got, ref = _decode_pair(args, backend)
    compare_outputs("sparse_decode", got, ref, scale=tol_scale)


# ---------------------------------------------------------------- dense decode
def _dense_cases():
    heads = [(h_q, h_kv) for h_q in (1, 3, 9, 63, 64, 126, 128) for h_kv in (1, 2, 3, 8) if h_q % h_kv == 0]
    if ON_GPU:
        return [dict(b=b, s_q=s_q, s_k=s_k, h_q=h, h_kv=k, varlen=v, causal=c)
                for b in (1, 2, 6, 64) for s_q in (1, 2, 4) for s_k in (20, 140, 4096) for h, k in heads
                for v in (False, True) for c in (False, True)]
    # CPU: every head pair once, cycling through the other axes.
    cycle = itertools.cycle(itertools.product((1, 2), (1, 2, 4), (20, 140), (False, True), (False, True)))
    return [dict(b=b, s_q=s_q, s_k=s_k, h_q=h, h_kv=k, varlen=v, causal=c)
            for (h, k), (b, s_q, s_k, v, c) in zip(heads, cycle)]


DENSE_EXTRA = [
    dict(b=4, s_q=2, s_k=300, h_q=16, h_kv=1, varlen=True, causal=True, zero_len_frac=0.5),
    dict(b=2, s_q=1, s_k=140, h_q=16, h_kv=1, page=53),  # any page size (FlashMLA: 64 only)
    dict(b=2, s_q=2, s_k=140, h_q=8, h_kv=1, page=1, causal=True),
    dict(b=1, s_q=1, s_k=1000, h_q=64, h_kv=1, sink=True),  # one long request: many splits
    dict(b=2, s_q=3, s_k=5, h_q=16, h_kv=1, causal=True),  # s_k < s_q: leading queries see nothing
    dict(b=2, s_q=1, s_k=140, h_q=16, h_kv=1, d_qk=512),
    dict(b=2, s_q=2, s_k=140, h_q=16, h_kv=2, dtype=torch.float16, causal=True),
]


@pytest.mark.parametrize("case", _dense_cases() + DENSE_EXTRA, ids=_prefill_id)
def test_dense_decode(backend, case, tol_scale, device):
    args = _dense_args(case, device)
    got, ref = _decode_pair(args, backend)
    compare_outputs("dense_decode", got, ref, scale=tol_scale)


@pytest.mark.skipif(not ON_ACCELERATOR, reason="FlashMLA's corner shape (b 128, s_k 4096) is sized for a GPU")
def test_dense_decode_corner(backend, device):
    args = dense_decode_inputs(128, 2, 128, 1, 4096, varlen=True, zero_len_frac=0.5, causal=True, device=device)
    got, ref = _decode_pair(args, backend)
    compare_outputs("dense_decode", got, ref)


def _warp_specialized_cases():
    base = dict(b=2, s_q=1, s_k=140, h_q=64, h_kv=1)
    grid = [dict(base, s_q=s_q, h_q=h_q, s_k=s_k, causal=True, varlen=True)
            for s_q, h_q in ((1, 64), (1, 128), (2, 128), (3, 33), (4, 16)) for s_k in (1, 63, 64, 65, 4096)]
    return grid + [
        dict(base, b=6, s_k=4096, varlen=True, zero_len_frac=0.5, sink=True),
        dict(base, s_q=2, d_qk=512, causal=True),
        dict(base, s_q=2, dtype=torch.float16, causal=True, sink=True),
        dict(base, page=128, s_k=1000, varlen=True),
        dict(base, page=256, s_k=1000, causal=True, s_q=2),
    ]


def _warp_specialized_only(backend, device):
    """The Gluon kernels for Hopper (triton_kernels/hopper/), forced: they run on sm_90 GPUs only."""
    if backend != "triton":
        pytest.skip("a kernel of the Triton tier")
    from anymla.triton_kernels import runtime, tuning
    if device.type != "cuda" or runtime.device_kind(device) != "cuda_sm90" or not runtime.gluon_hopper():
        pytest.skip("the warp-specialized kernels run on sm_90 GPUs with Triton's Gluon (3.6+) only")
    return tuning


@pytest.mark.parametrize("splits", (1, 3, 16), ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("case", _warp_specialized_cases(), ids=_prefill_id)
def test_warp_specialized_dense_decode(backend, case, splits, tol_scale, device):
    tuning = _warp_specialized_only(backend, device)
    args = _dense_args(case, device)
    with tuning.forced(num_splits=splits, warp_specialized=True):
        got, ref = _decode_pair(args, backend)
    compare_outputs("dense_decode", got, ref, scale=tol_scale)


WARP_SPECIALIZED_PREFILL = [dict(d_qk=d, h_q=h, s_kv=s_kv, topk=k, s_q=s_q, sink=sink, topk_length=tl)
                            for d, h, (s_kv, k), s_q, sink, tl in itertools.product(
                                (576, 512), (128, 64, 40), ((592, 128), (1840, 256), (95, 128), (300, 100),
                                                            (4096, 2048)), (1, 62), (False, True), (False, True))]
# Tensor-parallel head counts: the few-head form (16 or 32 heads a program, rows gathered by two warpgroups), forced
WARP_SPECIALIZED_PREFILL += [dict(d_qk=d, h_q=h, s_kv=s_kv, topk=k, s_q=s_q, sink=sink, topk_length=tl)
                             for d, h, (s_kv, k), s_q, sink, tl in itertools.product(
                                 (576, 512), (32, 16, 5), ((592, 128), (95, 128), (300, 100), (4096, 2048)), (1, 62),
                                 (False, True), (False, True)) if sink == tl]
WARP_SPECIALIZED_PREFILL += [
    dict(d_qk=576, h_q=16, s_kv=200, topk=192, s_q=3, shuffle_invalid=True),
    dict(d_qk=512, h_q=24, s_kv=300, topk=128, s_q=40, all_invalid_rows=True, topk_length=True),
    dict(d_qk=576, h_q=8, s_kv=1592, topk=384, s_q=33, amplify=True, sink=True, topk_length=True),
    dict(d_qk=576, h_q=16, s_kv=1000, topk=256, s_q=5, dtype=torch.float16),
    dict(d_qk=576, h_q=64, s_kv=200, topk=192, s_q=3, shuffle_invalid=True),  # leading invalid padding
    dict(d_qk=512, h_q=64, s_kv=300, topk=128, s_q=40, all_invalid_rows=True, topk_length=True),
    dict(d_qk=576, h_q=128, s_kv=1592, topk=384, s_q=33, amplify=True, sink=True, topk_length=True),
    dict(d_qk=576, h_q=64, s_kv=1000, topk=256, s_q=5, dtype=torch.float16),
]


@pytest.mark.parametrize("case", WARP_SPECIALIZED_PREFILL, ids=_prefill_id)
def test_warp_specialized_sparse_prefill(backend, case, tol_scale, device):
    tuning = _warp_specialized_only(backend, device)
    args = _prefill_args(case, device)
    # at most 32 heads: the few-head form, forced whatever the tile table picks
    heads = next(h for h in (8, 16, 32, 64) if case["h_q"] <= h or h == 64)
    with tuning.forced(tuning.TileConfig(heads, 64, 12, 2, False), warp_specialized=True):
        got = anymla.flash_mla_sparse_fwd(**args, backend=backend)
    compare_outputs("sparse_prefill", got, anymla.flash_mla_sparse_fwd(**args, backend="reference"),
                    amplified=case.get("amplify", False), scale=tol_scale)


WARP_SPECIALIZED_DECODE = [dict(fmt=F.V32_FP8, h_q=h, s_k=s_k, topk=k, page=page, b=4, s_q=s_q, sink=extras,
                                topk_length=extras)
                           for h in (128, 64, 40) for (s_k, k, page) in ((512, 64, 2), (1024, 576, 61),
                                                                         (2046, 2048, 64), (650, 100, 53))
                           for s_q, extras in ((1, False), (2, True))]
WARP_SPECIALIZED_DECODE += [
    dict(fmt=F.V32_FP8, h_q=128, s_k=1000, topk=256, page=64, b=74, s_q=3, sink=True),
    dict(fmt=F.V32_FP8, h_q=64, s_k=300, topk=128, page=16, b=6, s_q=1, zero_len_frac=0.5, sink=True),
    dict(fmt=F.V32_FP8, h_q=64, s_k=300, topk=64, page=16, b=2, s_q=3, all_invalid=True, sink=True),
    dict(fmt=F.V32_FP8, h_q=128, s_k=300, topk=192, page=256, b=3, s_q=2, shuffle_invalid=True),  # leading -1
    dict(fmt=F.V32_FP8, h_q=64, s_k=100, topk=64, page=16, b=2, s_q=1, block_pad=3),  # non-packed blocks
    dict(fmt=F.V32_FP8, h_q=128, s_k=200, topk=128, page=1, b=2, s_q=2, topk_length=True),
]
# V4.1 FP8 main caches, alone or with an FP4 or FP8 extra cache (its blocks follow the main cache's)
WARP_SPECIALIZED_DECODE += [dict(fmt=F.V41_FP8, h_q=h, s_k=s_k, topk=k, page=page, b=4, s_q=s_q, sink=extras,
                                 topk_length=extras, extra=x)
                            for h in (128, 40) for (s_k, k, page) in ((512, 64, 2), (1024, 576, 61), (2046, 2048, 64))
                            for s_q, extras in ((1, False), (2, True))
                            for x in (None, dict(fmt=F.V41_FP4, page=64, s_k=600, topk=512, topk_length=True),
                                      dict(fmt=F.V41_FP8, page=5, s_k=150, topk=100))]
WARP_SPECIALIZED_DECODE += [
    dict(fmt=F.V41_FP8, h_q=64, s_k=300, topk=64, page=16, b=2, s_q=3, all_invalid=True, sink=True,
         extra=dict(fmt=F.V41_FP4, page=2, s_k=200, topk=64)),
    dict(fmt=F.V41_FP8, h_q=64, s_k=300, topk=128, page=16, b=6, s_q=1, zero_len_frac=0.5, block_pad=1,
         extra=dict(fmt=F.V41_FP4, page=16, s_k=200, topk=100, topk_length=True)),
]
# MODEL1 (V4) FP8 main caches, alone or with a MODEL1 extra cache of its own page size (FlashMLA's CONFIG1/2:
# pages 256 and 64); odd pages put a block's scales at offsets that are no multiple of anything but 8
WARP_SPECIALIZED_DECODE += [dict(fmt=F.MODEL1_FP8, h_q=h, s_k=s_k, topk=k, page=page, b=4, s_q=s_q, sink=extras,
                                 topk_length=extras, extra=x)
                            for h in (128, 40) for (s_k, k, page) in ((512, 64, 2), (1024, 576, 61), (2046, 2048, 64),
                                                                      (1024, 128, 256))
                            for s_q, extras in ((1, False), (2, True))
                            for x in (None, dict(fmt=F.MODEL1_FP8, page=64, s_k=600, topk=512, topk_length=True),
                                      dict(fmt=F.MODEL1_FP8, page=32, s_k=150, topk=100))]
WARP_SPECIALIZED_DECODE += [
    dict(fmt=F.MODEL1_FP8, h_q=64, s_k=4096, topk=128, page=256, b=8, s_q=2, topk_length=True, sink=True,
         extra=dict(fmt=F.MODEL1_FP8, page=64, s_k=2048, topk=512, topk_length=True)),  # CONFIG1, smaller batch
    dict(fmt=F.MODEL1_FP8, h_q=128, s_k=4096, topk=128, page=256, b=4, s_q=2,
         extra=dict(fmt=F.MODEL1_FP8, page=2, s_k=2048, topk=1024)),  # CONFIG2, extra pages of 2
    dict(fmt=F.MODEL1_FP8, h_q=64, s_k=300, topk=64, page=16, b=2, s_q=3, all_invalid=True, sink=True,
         extra=dict(fmt=F.MODEL1_FP8, page=1, s_k=200, topk=64)),
    dict(fmt=F.MODEL1_FP8, h_q=64, s_k=300, topk=128, page=64, b=6, s_q=1, zero_len_frac=0.5, sink=True,
         extra=dict(fmt=F.MODEL1_FP8, page=32, s_k=200, topk=100, topk_length=True)),
    dict(fmt=F.MODEL1_FP8, h_q=128, s_k=300, topk=192, page=5, b=3, s_q=2, shuffle_invalid=True,  # leading -1
         extra=dict(fmt=F.MODEL1_FP8, page=64, s_k=200, topk=64)),
]


# Tensor-parallel head counts: the few-head form (16 or 32 heads a program, hopper/few_heads.py), its heads past
# h_q masked, every format and pairing, tails, splits, empty and invalid-only tokens
WARP_SPECIALIZED_DECODE += [dict(fmt=F.V32_FP8, h_q=h, s_k=s_k, topk=k, page=page, b=3, s_q=s_q, sink=extras,
                                 topk_length=extras)
                            for h in (32, 16, 8, 5) for (s_k, k, page) in ((512, 64, 2), (2046, 2048, 64), (650, 100, 53))
                            for s_q, extras in ((1, False), (2, True))]
WARP_SPECIALIZED_DECODE += [dict(fmt=F.V41_FP8, h_q=h, s_k=1024, topk=576, page=61, b=3, s_q=s_q, sink=extras,
                                 topk_length=extras, extra=x)
                            for h in (16, 8) for s_q, extras in ((1, False), (2, True))
                            for x in (None, dict(fmt=F.V41_FP4, page=64, s_k=600, topk=512, topk_length=True),
                                      dict(fmt=F.V41_FP8, page=5, s_k=150, topk=100))]
WARP_SPECIALIZED_DECODE += [dict(fmt=F.MODEL1_FP8, h_q=h, s_k=s_k, topk=k, page=page, b=3, s_q=2, sink=True,
                                 topk_length=True, extra=x)
                            for h in (32, 16, 3) for (s_k, k, page) in ((1024, 128, 256), (2046, 2048, 64))
                            for x in (None, dict(fmt=F.MODEL1_FP8, page=64, s_k=600, topk=512, topk_length=True))]
WARP_SPECIALIZED_DECODE += [
    dict(fmt=F.V32_FP8, h_q=16, s_k=300, topk=64, page=16, b=2, s_q=3, all_invalid=True, sink=True),
    dict(fmt=F.V32_FP8, h_q=8, s_k=300, topk=128, page=16, b=6, s_q=1, zero_len_frac=0.5, sink=True),
    dict(fmt=F.V32_FP8, h_q=16, s_k=300, topk=192, page=256, b=3, s_q=2, shuffle_invalid=True),  # leading -1
    dict(fmt=F.V32_FP8, h_q=24, s_k=100, topk=64, page=16, b=2, s_q=1, block_pad=3),  # non-packed blocks
    dict(fmt=F.V41_FP8, h_q=16, s_k=300, topk=64, page=16, b=2, s_q=3, all_invalid=True, sink=True,
         extra=dict(fmt=F.V41_FP4, page=2, s_k=200, topk=64)),
    dict(fmt=F.MODEL1_FP8, h_q=16, s_k=300, topk=192, page=5, b=3, s_q=2, shuffle_invalid=True,
         extra=dict(fmt=F.MODEL1_FP8, page=64, s_k=200, topk=64)),
]


@pytest.mark.parametrize("splits", (1, 3, 16), ids=lambda n: f"splits{n}")
@pytest.mark.parametrize("case", WARP_SPECIALIZED_DECODE, ids=_decode_id)
def test_warp_specialized_sparse_decode(backend, case, splits, tol_scale, device):
    tuning = _warp_specialized_only(backend, device)
    c = dict(case)
    args = sparse_decode_inputs(c.pop("b"), c.pop("s_q"), c.pop("h_q"), c.pop("s_k"), c.pop("topk"), device=device,
                                seed=zlib.crc32(_decode_id(case).encode()), **c)
    with tuning.forced(num_splits=splits, warp_specialized=True):
        got, ref = _decode_pair(args, backend)
    compare_outputs("sparse_decode", got, ref, scale=tol_scale)


# bf16 caches, read as one flat kv (a slot is a row): at most 32 heads the few-head decoding kernel, whose workers
# gather the rows (every split count), more heads the prefill kernel (no split); tails, lengths kept per request at
# s_q > 1, empty and invalid-only tokens, page 1, fp16
WARP_SPECIALIZED_BF16_DECODE = [dict(fmt=F.BF16, h_q=h, s_k=s_k, topk=k, page=page, b=3, s_q=s_q, sink=extras,
                                     topk_length=extras)
                                for h in (128, 64, 40, 32, 16, 5)
                                for (s_k, k, page) in ((512, 64, 2), (2046, 2048, 64), (650, 100, 53))
                                for s_q, extras in ((1, False), (2, True), (3, True))]
WARP_SPECIALIZED_BF16_DECODE += [
    dict(fmt=F.BF16, h_q=16, s_k=300, topk=64, page=16, b=2, s_q=3, all_invalid=True, sink=True),
    dict(fmt=F.BF16, h_q=64, s_k=300, topk=128, page=16, b=6, s_q=1, zero_len_frac=0.5, sink=True),
    dict(fmt=F.BF16, h_q=8, s_k=300, topk=128, page=16, b=6, s_q=1, zero_len_frac=0.5, sink=True),
    dict(fmt=F.BF16, h_q=128, s_k=300, topk=192, page=256, b=3, s_q=2, shuffle_invalid=True),  # leading -1
    dict(fmt=F.BF16, h_q=24, s_k=300, topk=192, page=256, b=3, s_q=2, shuffle_invalid=True),
    dict(fmt=F.BF16, h_q=8, s_k=200, topk=128, page=1, b=2, s_q=2, topk_length=True),
    dict(fmt=F.BF16, h_q=16, s_k=600, topk=256, page=64, b=3, s_q=2, topk_length=True, fp16=True),
    dict(fmt=F.BF16, h_q=64, s_k=600, topk=256, page=64, b=3, s_q=2, topk_length=True, fp16=True),
]


def _bf16_decode_args(case, device):
    c = dict(case)
    fp16 = c.pop("fp16", False)
    args = sparse_decode_inputs(c.pop("b"), c.pop("s_q"), c.pop("h_q"), c.pop("s_k"), c.pop("topk"), device=device,
                                seed=zlib.crc32(_decode_id(case).encode()), **c)
    if fp16:  # bf16 values are exact in fp16 at these magnitudes; the NaN rows stay NaN
        args.update(q=args["q"].half(), k_cache=args["k_cache"].half())
    return args


# every case unsplit; the few-head ones (<= 32 heads) also at forced split counts: more heads run on the prefill
# kernel, which has no split (forcing one raises: test_bf16_sparse_decode_forced_split_over_32_heads_raises)
_BF16_DECODE_RUNS = [(case, splits) for case in WARP_SPECIALIZED_BF16_DECODE
                     for splits in ((None, 3, 16) if case["h_q"] <= 32 else (None,))]


@pytest.mark.parametrize("case,splits", _BF16_DECODE_RUNS,
                         ids=[f"{_decode_id(c)}-splits{n}" for c, n in _BF16_DECODE_RUNS])
def test_warp_specialized_bf16_sparse_decode(backend, case, splits, tol_scale, device):
    tuning = _warp_specialized_only(backend, device)
    args = _bf16_decode_args(case, device)
    with tuning.forced(num_splits=splits, warp_specialized=True):
        kernel = anymla.explain("flash_mla_with_kvcache", **args, tile_scheduler_metadata=None, backend=backend).kernel
        form = "sparse prefill kernel over the cache's rows" if case["h_q"] > 32 else "few-head form"
        assert form in kernel and (not splits or f"{splits} splits" in kernel), kernel
        got, ref = _decode_pair(args, backend)
    compare_outputs("sparse_decode", got, ref, scale=tol_scale)


def test_bf16_sparse_decode_forced_split_over_32_heads_raises(backend, device):
    """More than 32 heads of bf16 decoding run on the prefill kernel, which has no split: forcing splits with the
    Hopper kernels forced is refused with that reason, not run some other way."""
    tuning = _warp_specialized_only(backend, device)
    args = _bf16_decode_args(WARP_SPECIALIZED_BF16_DECODE[0] | dict(h_q=64), device)
    with tuning.forced(num_splits=3, warp_specialized=True), \
            pytest.raises(ValueError, match="3 splits forced: the prefill kernel.*does not split the keys"):
        anymla.flash_mla_with_kvcache(**args, tile_scheduler_metadata=None, backend=backend)


def test_bf16_sparse_decode_dispatch(backend, tol_scale, device):
    """Unforced: at most 32 heads the few-head decoding kernel takes bf16 sparse decoding, with splits where the
    tokens are few; at 64 heads the prefill kernel takes a call whose tokens fill the GPU without a split, and
    the portable kernel one that needs splits; a cache whose blocks do not lie back to back is the portable
    kernel's."""
    tuning = _warp_specialized_only(backend, device)
    if tuning.forced_warp_specialized() is False:
        pytest.skip("the Hopper kernels are switched off for this process (ANYMLA_HOPPER_KERNELS=0): the "
                    "dispatcher's choice among them is not what runs")
    cores = torch.cuda.get_device_properties(device).multi_processor_count
    cases = ((cores // 2 + 1, 64, {}, "sparse prefill kernel over the cache's rows"), (4, 64, {}, "portable"),
             (4, 16, {}, "few-head form"), (cores, 16, {}, "few-head form"), (cores, 16, dict(block_pad=2), "portable"))
    for b, h_q, extra, kernel_named in cases:
        args = sparse_decode_inputs(b, 1, h_q, 600, 256, fmt=F.BF16, topk_length=True, sink=True, device=device,
                                    seed=b + h_q, **extra)
        kernel = anymla.explain("flash_mla_with_kvcache", **args, tile_scheduler_metadata=None, backend=backend).kernel
        assert kernel_named in kernel, (b, h_q, extra, kernel)
        got, ref = _decode_pair(args, backend)
        compare_outputs("sparse_decode", got, ref, scale=tol_scale)


@pytest.mark.parametrize("forced", (None, True), ids=("dispatched", "warp-specialized"))
@pytest.mark.parametrize("magnitude", (2.0 ** -30, 2.0 ** -12, 2.0 ** 12, 2.0 ** 40), ids=lambda m: f"kv2^{int(math.log2(m))}")
def test_sparse_decode_number_range(backend, magnitude, forced, tol_scale, device):
    """V3.2 keys far outside [-1, 1] (down to 2^-34, up to 2^44: beyond fp16's range) against queries scaled
    the other way: the logits are those of the usual data and out scales exactly with the keys, so a kernel
    whose arithmetic depends on the magnitude (a 16-bit type with fp16's range, a fixed scale) fails here."""
    if forced:
        tuning = _warp_specialized_only(backend, device)
    args = sparse_decode_inputs(2, 2, 16, 600, 512, fmt=F.V32_FP8, page=64, topk_length=True, magnitude=magnitude,
                                device=device, seed=int(math.log2(magnitude)) + 100)
    if forced:
        with tuning.forced(warp_specialized=True):
            got, ref = _decode_pair(args, backend)
    else:
        got, ref = _decode_pair(args, backend)
    compare_outputs("sparse_decode", (got[0].float() / magnitude, got[1]), (ref[0].float() / magnitude, ref[1]),
                    scale=tol_scale)


@pytest.mark.parametrize("skip_scale", (True, False), ids=("block-branch", "row-select"))
def test_both_lazy_rescale_variants(backend, skip_scale, tol_scale, device):
    """The Triton tier ships the lazy rescale as a block-wide branch (interpreter, Ascend) and as a per-row
    select (CUDA); both must hold on data whose logits jump (k amplifier), prefill and decode alike."""
    if backend != "triton":
        pytest.skip("tile configurations belong to the Triton tier")
    from anymla.triton_kernels import tuning
    with tuning.forced(tuning.TileConfig(64, 64, 8, 1, skip_scale)):
        args = prefill_inputs(3, 64, 512, 600, 192, amplify=True, sink=True, device=device, seed=11)
        compare_outputs("sparse_prefill", anymla.flash_mla_sparse_fwd(**args, backend=backend),
                        anymla.flash_mla_sparse_fwd(**args, backend="reference"), amplified=True, scale=tol_scale)
        args = sparse_decode_inputs(2, 1, 64, 300, 192, fmt=F.V41_FP8, topk_length=True, device=device, seed=12)
        got, ref = _decode_pair(args, backend)
        compare_outputs("sparse_decode", got, ref, scale=tol_scale)
        args = dense_decode_inputs(2, 2, 32, 1, 300, causal=True, device=device, seed=13)
        got, ref = _decode_pair(args, backend)
        compare_outputs("dense_decode", got, ref, scale=tol_scale)


@pytest.mark.parametrize("stages", (1, 3, 6), ids=("unpipelined", "pipelined-3", "pipelined-6"))
def test_both_index_fetch_paths(backend, stages, tol_scale, device):
    """Sparse loops of one stage, and quantized caches' loops of fewer than 5, ask for a block's indices one
    block ahead; the others (bf16 at 3 stages, every cache at 6) let the compiler do it: both over topk tails,
    topk_length, leading -1 padding and a key range crossing into the extra cache (the interpreter and NPUs only
    ever ship one stage)."""
    if backend != "triton":
        pytest.skip("tile configurations belong to the Triton tier")
    from anymla.triton_kernels import tuning
    with tuning.forced(tuning.TileConfig(16, 32, 4, stages, False), num_splits=2):
        args = prefill_inputs(3, 16, 576, 200, 100, shuffle_invalid=True, topk_length=True, device=device, seed=31)
        compare_outputs("sparse_prefill", anymla.flash_mla_sparse_fwd(**args, backend=backend),
                        anymla.flash_mla_sparse_fwd(**args, backend="reference"), scale=tol_scale)
        extra = dict(fmt=F.V41_FP4, page=5, s_k=150, topk=40, topk_length=True)
        args = sparse_decode_inputs(2, 2, 16, 300, 70, fmt=F.V41_FP8, extra=extra, topk_length=True, device=device,
                                    seed=32)
        got, ref = _decode_pair(args, backend)
        compare_outputs("sparse_decode", got, ref, scale=tol_scale)


@pytest.mark.parametrize("fmt", (F.V32_FP8, F.MODEL1_FP8, F.V41_FP8), ids=lambda f: f.name)
def test_ascend_portable_loads(backend, fmt, tol_scale, device):
    """The loads Ascend compiles (byte-assembled fp32/bf16 fields, FP4 nibbles by select) against the
    reference here, since no NPU runs them: every format with its rope/scale fields, FP4 as an extra cache."""
    if backend != "triton":
        pytest.skip("load variants belong to the Triton tier")
    from anymla.triton_kernels import tuning
    extra = dict(fmt=F.V41_FP4, page=5, s_k=150, topk=64, topk_length=True) if fmt is not F.V32_FP8 else None
    args = sparse_decode_inputs(2, 1, 32, 300, 100, fmt=fmt, extra=extra, sink=True, device=device, seed=21)
    with tuning.forced(portable=True):
        got, ref = _decode_pair(args, backend)
    compare_outputs("sparse_decode", got, ref, scale=tol_scale)
