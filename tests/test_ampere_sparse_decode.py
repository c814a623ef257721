"""The mma_v2 sparse decoding kernel over V3.2 FP8 caches (``triton_kernels/ampere/decode.py``) against the
PyTorch reference.

The kernel is Gluon, which Triton's interpreter does not run: its agreement tests need an NVIDIA GPU (any
from sm_80; on Hopper and Blackwell it runs as a stand-in for the GPUs without wgmma, and with ``native_fp8
=False`` it takes the bit arithmetic of sm_80/86 there too). Inputs are ``anymla.testing``'s, as FlashMLA's
tests draw them: NaN in every cache row no counted index reads, -1 padding, and here also slots at and past
the cache's end; outputs are NaN-poisoned (conftest). The e4m3 bit arithmetic, the tile choice and the launch's
checks run anywhere.
"""

import zlib

import pytest
import torch
import triton
import triton.language as tl

import anymla
from anymla.kvcache import KVCacheFormat
from anymla.testing import compare_outputs, sparse_decode_inputs
from anymla.triton_kernels.ampere.decode_launch import ONE_TILE, TILES, choose_decode_tile, decode_shared_bytes
from anymla.triton_kernels.common import e4m3x2_to_f16x2, e4m3x4_has_nan

ON_NVIDIA = torch.cuda.is_available() and torch.version.hip is None
needs_gpu = pytest.mark.skipif(not ON_NVIDIA, reason="Gluon kernels do not run in Triton's interpreter: needs an "
                                                     "NVIDIA GPU")

CASES = [dict(h_q=h, s_q=s_q, b=b, s_k=s_k, topk=k, page=page, topk_length=tl_, sink=sink)
         for h in (128, 64, 16) for s_q in (1, 2)
         for b, s_k, k, page, tl_, sink in ((4, 512, 64, 64, False, False), (3, 1024, 576, 61, True, True),
                                            (2, 2046, 2048, 2, True, False))]
CASES += [
    dict(h_q=64, s_q=2, b=3, s_k=300, topk=64, page=256, shuffle_invalid=True),  # leading -1 padding
    dict(h_q=64, s_q=1, b=4, s_k=300, topk=64, page=16, zero_len_frac=0.5, sink=True),  # empty requests
    dict(h_q=64, s_q=2, b=2, s_k=300, topk=64, page=16, all_invalid=True, sink=True),
    dict(h_q=128, s_q=1, b=2, s_k=100, topk=64, page=16, block_pad=3),  # blocks not back to back
    dict(h_q=40, s_q=2, b=2, s_k=200, topk=128, page=64, sink=True),  # 40 heads: a masked tail of 24 rows
    dict(h_q=128, s_q=1, b=1, s_k=1000, topk=512, page=64, topk_length=True),  # one request: split by default
]


def _id(case):
    return "-".join(f"{k}{int(v) if isinstance(v, bool) else v}" for k, v in case.items())


def _beyond_cache(args):
    """Every third -1 entry becomes a slot at or past the cache's end (the reference and the kernel skip them)."""
    idx, cache = args["indices"], args["k_cache"]
    n_rows = cache.shape[0] * cache.shape[1]
    pad = (idx < 0).nonzero(as_tuple=True)
    pick = tuple(p[::3] for p in pad)
    far = torch.tensor([n_rows, n_rows + 7, 2 ** 31 - 1], dtype=torch.int32, device=idx.device)
    idx[pick] = far[torch.arange(pick[0].numel(), device=idx.device) % 3]
    return args


def _args(case, seed=None):
    c = dict(case)
    args = sparse_decode_inputs(c.pop("b"), c.pop("s_q"), c.pop("h_q"), c.pop("s_k"), c.pop("topk"),
                                fmt=KVCacheFormat.V32_FP8, device="cuda",
                                seed=zlib.crc32(_id(case).encode()) if seed is None else seed, **c)
    return _beyond_cache(args)


def _run(args, **kw):
    from anymla.triton_kernels.ampere.decode_launch import sparse_decode
    return sparse_decode(args["q"], args["k_cache"], args["indices"], args["softmax_scale"],
                         topk_length=args["topk_length"], attn_sink=args["attn_sink"], **kw)


def _reference(args):
    return anymla.flash_mla_with_kvcache(**args, tile_scheduler_metadata=None, backend="reference")


def _native_choices():
    """The conversions to test here: the bit arithmetic always, the fp8 instructions where the GPU has them."""
    from anymla.triton_kernels import runtime
    return [False] + ([True] if ON_NVIDIA and runtime.native_fp8(torch.device("cuda")) else [])


@needs_gpu
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_ampere_sparse_decode_agrees(case):
    args = _args(case)
    compare_outputs("sparse_decode", _run(args), _reference(args))


@needs_gpu
@pytest.mark.parametrize("splits", (1, 3))
@pytest.mark.parametrize("native", (False, True), ids=("bits", "fp8"))
@pytest.mark.parametrize("tile", TILES + ONE_TILE, ids=lambda t: f"bn{t[0]}x{t[1]}")
def test_ampere_sparse_decode_every_tile(tile, native, splits):
    """Every tile of ``TILES`` and ``ONE_TILE`` that fits this GPU, whatever it would pick (the sm_80 and 99 KB
    tiles on a Hopper stand-in), both conversions, unsplit and split: a tail block, lengths (odd and even block
    counts a split: the loop goes two blocks an iteration), sinks, skipped slots."""
    if decode_shared_bytes(tile) > torch.cuda.get_device_properties(0).shared_memory_per_block_optin:
        pytest.skip(f"tile {tile} needs {decode_shared_bytes(tile)} bytes of shared memory, more than this GPU has")
    if native not in _native_choices():
        pytest.skip("this GPU has no fp8 conversion instructions")
    args = _args(dict(h_q=128, s_q=2, b=3, s_k=1024, topk=600, page=61, topk_length=True, sink=True), seed=11)
    compare_outputs("sparse_decode", _run(args, tile=tile, native_fp8=native, num_splits=splits), _reference(args))


@needs_gpu
@pytest.mark.parametrize("native", (False, True), ids=("bits", "fp8"))
def test_ampere_sparse_decode_nan_code(native):
    """A NaN code (0x7F) in a row a token attends makes that token's out and lse NaN, as in the reference; the
    other tokens are untouched."""
    if native not in _native_choices():
        pytest.skip("this GPU has no fp8 conversion instructions")
    args = _args(dict(h_q=64, s_q=1, b=2, s_k=256, topk=128, page=64), seed=3)
    slot = int(args["indices"][0, 0, 0])
    assert slot >= 0
    page = args["k_cache"].shape[1]
    args["k_cache"][slot // page, slot % page, 0, 200] = 0x7F
    out, lse = _run(args, native_fp8=native, num_splits=1)
    ref_out, ref_lse = _reference(args)
    assert torch.isnan(ref_out[0]).all() and torch.isnan(out[0]).all() and torch.isnan(lse[0]).all()
    compare_outputs("sparse_decode", (out[1:], lse[1:]), (ref_out[1:], ref_lse[1:]))


@triton.jit
def _e4m3_bits_kernel(t_ptr, h_ptr, nan_ptr, N: tl.constexpr):
    o = tl.arange(0, N)
    t = tl.load(t_ptr + o).to(tl.uint32, bitcast=True)
    tl.store(h_ptr + o, e4m3x2_to_f16x2(t).to(tl.int32, bitcast=True))
    tl.store(nan_ptr + o, e4m3x4_has_nan(t).to(tl.int32))


def test_ampere_e4m3_bit_arithmetic_is_exact():
    """Every pair of codes (in bits 8-15 and 24-31, as the kernel places them) against torch's e4m3fn: exact
    values, subnormals and signed zeros included; NaN codes are what ``e4m3x4_has_nan`` reports, nothing else."""
    dev = "cuda" if ON_NVIDIA else "cpu"
    codes = torch.arange(65536, dtype=torch.int64, device=dev)
    lo, hi = codes & 0xFF, codes >> 8
    word = (lo << 8) | (hi << 24)
    t = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)
    h, nan = torch.empty_like(t), torch.empty_like(t)
    _e4m3_bits_kernel[(1,)](t, h, nan, N=65536)
    got = h.view(torch.float16).view(-1, 2).float() * 256
    ref = torch.stack([lo, hi], -1).to(torch.uint8).view(torch.float8_e4m3fn).float()
    finite = ~ref.isnan()
    assert torch.equal(got[finite], ref[finite])
    assert torch.equal(torch.signbit(got[finite]), torch.signbit(ref[finite]))
    assert torch.equal(nan.bool(), ~finite.all(-1))


def test_ampere_decode_tile_fits_each_gpu_generation():
    """64 keys and two latent tiles on the 227 KB GPUs (fp8 conversions), 32 and two on sm_80's 163 KB, 16 and
    one on the 99 KB GPUs; the launch's shared memory counts, one latent tile included."""
    assert choose_decode_tile(232448, True) == (64, 2) and decode_shared_bytes((64, 2)) == 230400
    assert choose_decode_tile(166912, False) == (32, 2) and choose_decode_tile(166912, True) == (32, 2)
    assert decode_shared_bytes((32, 2)) == 152576 and decode_shared_bytes((64, 1)) == 164864
    assert choose_decode_tile(101376, False) == (16, 1) and choose_decode_tile(101376, True) == (16, 1)
    assert decode_shared_bytes((16, 1)) == 96768
    with pytest.raises(ValueError):
        choose_decode_tile(65536, True)


def test_ampere_decode_launch_rejects_what_the_kernel_cannot_read():
    from anymla.triton_kernels.ampere.decode_launch import sparse_decode
    q = torch.zeros(2, 1, 64, 576, dtype=torch.bfloat16)
    cache = torch.zeros(4, 64, 1, 656, dtype=torch.uint8)
    idx = torch.zeros(2, 1, 64, dtype=torch.int32)
    for bad in (dict(q=q[..., :512]), dict(q=q.half()), dict(kv_cache=torch.zeros(4, 64, 1, 528, dtype=torch.uint8)),
                dict(kv_cache=torch.zeros(5 * 64 * 656, dtype=torch.uint8).as_strided((4, 64, 1, 656),
                                                                                      (64 * 656 + 8, 656, 656, 1))),
                dict(indices=idx.long()), dict(indices=idx[:1]), dict(topk_length=torch.zeros(2, dtype=torch.int64)),
                dict(attn_sink=torch.zeros(63))):
        call = {**dict(q=q, kv_cache=cache, indices=idx, sm_scale=0.1), **bad}
        with pytest.raises(ValueError):
            sparse_decode(**call)
