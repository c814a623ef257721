"""The mma_v2 sparse prefill kernel (``triton_kernels/ampere/``) against the PyTorch reference.

The kernel is Gluon, which Triton's interpreter does not run: its agreement tests need an NVIDIA GPU (any
from sm_80; on Hopper and Blackwell it runs as a stand-in for the GPUs without wgmma). Inputs are fresh random
data with NaN in every kv row no counted index reads, invalid indices (negative, ``s_kv`` and beyond, and
leading padding), and NaN-poisoned outputs (conftest). The tile choice and the launch's checks run anywhere.
"""

import zlib

import pytest
import torch

import anymla
from anymla.testing import compare_outputs, prefill_inputs
from anymla.triton_kernels.ampere.launch import TILES, choose_tile, shared_bytes

ON_NVIDIA = torch.cuda.is_available() and torch.version.hip is None
needs_gpu = pytest.mark.skipif(not ON_NVIDIA, reason="Gluon kernels do not run in Triton's interpreter: needs an "
                                                     "NVIDIA GPU")

CASES = [dict(d_qk=d, h_q=h, s_kv=s_kv, topk=k, s_q=s_q)
         for d in (576, 512) for h in (128, 64, 16) for s_kv, k, s_q in ((95, 128, 3), (300, 100, 5), (1000, 256, 7))]
CASES += [
    dict(d_qk=576, h_q=128, s_kv=1592, topk=384, s_q=33, sink=True, topk_length=True),
    dict(d_qk=512, h_q=64, s_kv=300, topk=128, s_q=40, sink=True, topk_length=True, all_invalid_rows=True),
    dict(d_qk=576, h_q=16, s_kv=200, topk=192, s_q=3, shuffle_invalid=True),  # leading invalid padding
    dict(d_qk=576, h_q=64, s_kv=1000, topk=256, s_q=5, dtype=torch.float16),
    dict(d_qk=512, h_q=40, s_kv=64, topk=96, s_q=2, sink=True),  # 40 heads: a masked tail of 24 rows
    dict(d_qk=576, h_q=64, s_kv=32, topk=2048, s_q=1),  # s_kv << topk: most blocks hold no valid key
    dict(d_qk=576, h_q=64, s_kv=1, topk=64, s_q=2),
    dict(d_qk=576, h_q=64, s_kv=0, topk=64, s_q=2),
]


def _id(case):
    return "-".join(f"{k}{int(v) if isinstance(v, bool) else v}" for k, v in case.items())


def _args(case):
    c = dict(case)
    return prefill_inputs(c.pop("s_q"), c.pop("h_q"), c.pop("d_qk"), c.pop("s_kv"), c.pop("topk"), device="cuda",
                          seed=zlib.crc32(_id(case).encode()), **c)


def _run(args, tile=None):
    from anymla.triton_kernels.ampere.launch import sparse_prefill
    return sparse_prefill(args["q"], args["kv"], args["indices"], args["sm_scale"], topk_length=args["topk_length"],
                          attn_sink=args["attn_sink"], tile=tile)


def _compare(args, got, amplified=False):
    ref = anymla.flash_mla_sparse_fwd(**args, backend="reference")
    compare_outputs("sparse_prefill", got, ref, amplified=amplified)


@needs_gpu
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_ampere_sparse_prefill_agrees(case):
    args = _args(case)
    _compare(args, _run(args))


@needs_gpu
@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"bn{t[0]}x{t[1]}")
@pytest.mark.parametrize("d_qk", (576, 512))
def test_ampere_sparse_prefill_every_tile(tile, d_qk):
    """Every tile of ``TILES`` that fits this GPU, whatever it would pick (the sm_80 and 99 KB tiles on a
    Hopper stand-in): a tail block, lengths, sinks, invalid indices."""
    if shared_bytes(d_qk, *tile) > torch.cuda.get_device_properties(0).shared_memory_per_block_optin:
        pytest.skip(f"tile {tile} needs {shared_bytes(d_qk, *tile)} bytes of shared memory, more than this GPU has")
    args = prefill_inputs(9, 128, d_qk, 700, 200, sink=True, topk_length=True, device="cuda", seed=11)
    _compare(args, _run(args, tile))


@needs_gpu
@pytest.mark.parametrize("d_qk,h_q", [(512, 64), (576, 128)])
def test_ampere_sparse_prefill_k_amplifier(d_qk, h_q):
    """2 % of kv rows scaled by up to 2^8: logits jump, exercising the lagging (skip-scale) rescale."""
    args = prefill_inputs(213, h_q, d_qk, 1592, 384, amplify=True, sink=True, topk_length=True, device="cuda", seed=7)
    _compare(args, _run(args), amplified=True)


@needs_gpu
@pytest.mark.parametrize("d_qk", (576, 512))
def test_ampere_sparse_prefill_all_invalid(d_qk):
    args = prefill_inputs(3, 64, d_qk, 256, 256, device="cuda", seed=5)
    args["indices"].fill_(-1)
    out, max_logits, lse = _run(args)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isneginf(max_logits).all() and torch.isposinf(lse).all()


def test_ampere_tile_fits_each_gpu_generation():
    """64 keys double-buffered where 227 KB allow (sm_90, sm_100), 32 on sm_80, 16 on the 99 KB GPUs."""
    assert choose_tile(576, 232448) == (64, 2) and choose_tile(512, 232448) == (64, 2)
    assert choose_tile(576, 166912) == (32, 2) and choose_tile(512, 166912) == (32, 2)
    assert choose_tile(576, 101376) == (16, 1) and choose_tile(512, 101376) == (16, 2)
    with pytest.raises(ValueError):
        choose_tile(576, 65536)


def test_ampere_launch_rejects_what_the_kernel_cannot_read():
    from anymla.triton_kernels.ampere.launch import sparse_prefill
    q = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    kv = torch.zeros(10, 1, 576, dtype=torch.bfloat16)
    idx = torch.zeros(2, 1, 64, dtype=torch.int32)
    for bad in (dict(kv=kv.float()), dict(kv=torch.zeros(10, 2, 576, dtype=torch.bfloat16)),
                dict(indices=idx.long()), dict(q=q[:, :, :512]), dict(d_v=256),
                dict(topk_length=torch.zeros(2, dtype=torch.int64)), dict(attn_sink=torch.zeros(63))):
        call = {**dict(q=q, kv=kv, indices=idx, sm_scale=0.1), **bad}
        with pytest.raises(ValueError):
            sparse_prefill(**call)
