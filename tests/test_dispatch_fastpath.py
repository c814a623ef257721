"""The per-call part of the dispatcher: what a cached decision must not hide. Tensor metadata changed in place
is read anew, scales of every accepted kind still pass and every rejected kind still raises after the
decision is cached, and the environment readers follow ``os.environ`` call by call.
"""

import math
import os

import numpy as np
import pytest
import torch

import anymla
from anymla import environment
from anymla.kvcache import KVCacheFormat as F
from anymla.testing import dense_decode_inputs, prefill_inputs, sparse_decode_inputs


def _dense(device):
    return dict(dense_decode_inputs(2, 1, 4, 1, 9, page=4, seed=2, device=device), tile_scheduler_metadata=None)


def test_a_cache_restrided_in_place_after_a_cached_call_is_validated_again(device):
    args = _dense(device)
    anymla.flash_mla_with_kvcache(**args, backend="reference")  # decided and cached
    cache = args["k_cache"]
    n, page, h_kv, d = cache.shape
    # The same elements of each block, column-major: the last dim no longer contiguous, the storage unchanged.
    cache.as_strided_(cache.shape, (page * h_kv * d, 1, page, page * h_kv))
    with pytest.raises(ValueError, match="^k_cache: the last dim must be contiguous"):
        anymla.flash_mla_with_kvcache(**args, backend="reference")


def test_indices_resized_in_place_after_a_cached_call_are_validated_again(device):
    args = dict(sparse_decode_inputs(2, 1, 4, 20, 8, fmt=F.V32_FP8, page=4, seed=1, device=device),
                tile_scheduler_metadata=None)
    anymla.flash_mla_with_kvcache(**args, backend="reference")
    args["indices"].resize_(2, 2, 4)  # s_q 2 against q's 1
    with pytest.raises(ValueError, match=r"^indices: expected shape \[b, s_q, topk\]"):
        anymla.flash_mla_with_kvcache(**args, backend="reference")


@pytest.mark.parametrize("scale", [1, np.float64(0.1), 0.1], ids=["int", "numpy-float64", "float"])
def test_every_accepted_kind_of_scale_runs_after_a_cached_call(scale, device):
    a = prefill_inputs(3, 4, 512, 16, 8, seed=3, device=device)
    anymla.flash_mla_sparse_fwd(**a, backend="reference")
    got = anymla.flash_mla_sparse_fwd(**dict(a, sm_scale=scale), backend="reference")
    want = anymla.flash_mla_sparse_fwd(**dict(a, sm_scale=float(scale)), backend="reference")
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("scale, exc", [(True, TypeError), (np.float32(0.1), TypeError), (-math.inf, ValueError),
                                        (-0.0, ValueError), (0, ValueError), (float("nan"), ValueError)],
                         ids=["bool", "numpy-float32", "minus-inf", "minus-zero", "int-zero", "nan"])
def test_every_rejected_kind_of_scale_raises_after_a_cached_call(scale, exc, device):
    args = _dense(device)
    anymla.flash_mla_with_kvcache(**args, backend="reference")
    with pytest.raises(exc, match="^softmax_scale:"):
        anymla.flash_mla_with_kvcache(**dict(args, softmax_scale=scale), backend="reference")


def test_an_environment_reader_follows_every_change(monkeypatch):
    name = "ANYMLA_TEST_READER"
    monkeypatch.delenv(name, raising=False)
    read = environment.reader(name)
    assert read() is None
    monkeypatch.setenv(name, "a")
    assert read() == "a"
    os.environ[name] = "b,c"
    assert read() == "b,c"
    del os.environ[name]
    assert read() is None
