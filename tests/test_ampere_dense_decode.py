"""The mma_v2 dense decoding kernel (``triton_kernels/ampere/dense.py``) against the PyTorch reference.

Gluon does not run in Triton's interpreter: the agreement tests need an NVIDIA GPU (any from sm_80; Hopper and
Blackwell run it as a stand-in). Inputs are FlashMLA's test recipe: fresh random rows, NaN in every cache row
past a request's length, a shuffled block table whose unused entries are out of range, and NaN-poisoned
outputs (conftest). The launch's checks run anywhere.
"""

import zlib

import pytest
import torch

import anymla
from anymla.problems import DenseDecode
from anymla.testing import compare_outputs, dense_decode_inputs
from anymla.triton_kernels.ampere.launch import TILES, shared_bytes

ON_NVIDIA = torch.cuda.is_available() and torch.version.hip is None
needs_gpu = pytest.mark.skipif(not ON_NVIDIA, reason="Gluon kernels do not run in Triton's interpreter: needs an "
                                                     "NVIDIA GPU")

CASES = [
    dict(b=2, s_q=1, h_q=128, s_k=300),
    dict(b=3, s_q=2, h_q=128, s_k=1000, causal=True),
    dict(b=2, s_q=2, h_q=64, s_k=777, causal=True, varlen=True, sink=True),
    dict(b=1, s_q=1, h_q=128, s_k=5000),  # one request: split along the keys
    dict(b=2, s_q=4, h_q=16, s_k=200, causal=True),  # a 64-row program holds 4 queries' rows, each its own mask
    dict(b=2, s_q=3, h_q=40, s_k=150, causal=True, sink=True),  # rows of two queries in one program, a tail
    dict(b=3, s_q=1, h_q=64, s_k=400, page=16),
    dict(b=2, s_q=2, h_q=64, s_k=500, dtype=torch.float16),
    dict(b=4, s_q=1, h_q=128, s_k=300, varlen=True, zero_len_frac=0.5),  # empty requests
    dict(b=2, s_q=1, h_q=64, s_k=600, d_qk=512),
    dict(b=2, s_q=2, h_q=128, s_k=3, causal=True),  # fewer keys than queries: the first query sees none
]


def _id(case):
    return "-".join(f"{k}{v}" for k, v in case.items()).replace("torch.", "")


def _problem(args):
    return DenseDecode(args["q"], args["k_cache"], args["block_table"], args["cache_seqlens"],
                       args["q"].shape[-1] ** -0.5, causal=args["causal"], attn_sink=args["attn_sink"])


def _args(case):
    c = dict(case)
    return dense_decode_inputs(c.pop("b"), c.pop("s_q"), c.pop("h_q"), 1, c.pop("s_k"), device="cuda",
                               seed=zlib.crc32(_id(case).encode()), **c)


def _compare(args, **kw):
    from anymla.triton_kernels.ampere.dense_launch import dense_decode
    got = dense_decode(_problem(args), **kw)
    ref = anymla.flash_mla_with_kvcache(**args, tile_scheduler_metadata=None, backend="reference")
    compare_outputs("dense_decode", got, ref)


@needs_gpu
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_ampere_dense_decode_agrees(case):
    _compare(_args(case))


@needs_gpu
@pytest.mark.parametrize("splits", (1, 3))
@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"bn{t[0]}x{t[1]}")
def test_ampere_dense_decode_every_tile(tile, splits):
    """Every tile that fits this GPU (the sm_80 and 99 KB tiles on a Hopper stand-in), with and without splits:
    causal rows of two queries, sinks, a page that is not a multiple of the tile."""
    if shared_bytes(576, *tile) > torch.cuda.get_device_properties(0).shared_memory_per_block_optin:
        pytest.skip(f"tile {tile} needs {shared_bytes(576, *tile)} bytes of shared memory, more than this GPU has")
    args = dense_decode_inputs(3, 2, 64, 1, 700, page=48, causal=True, sink=True, varlen=True, device="cuda", seed=3)
    _compare(args, num_splits=splits, tile=tile)


def test_ampere_dense_decode_states_what_it_takes():
    from anymla.triton_kernels.ampere.dense_launch import dense_decode
    args = dense_decode_inputs(1, 1, 16, 2, 64)
    with pytest.raises(ValueError, match="one kv head"):
        dense_decode(_problem(args))
