"""CUDA-graph safety of decoding (contract 1.2): with metadata filled by a warm-up call, a captured call replays
correctly after the *contents* of its inputs change in place (new q, new lengths, new indices), because nothing
in the plan depends on those values.
"""

import pytest
import torch

import anymla
from anymla.kvcache import KVCacheFormat
from anymla.testing import compare_outputs, dense_decode_inputs, sparse_decode_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

F = KVCacheFormat


def capture(args, backend):
    """Warm up (fills the metadata, compiles kernels), then capture one call on the same static buffers."""
    meta, _ = anymla.get_mla_metadata()
    anymla.flash_mla_with_kvcache(**args, tile_scheduler_metadata=meta, backend=backend)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = anymla.flash_mla_with_kvcache(**args, tile_scheduler_metadata=meta, backend=backend)
    return graph, out, lse, meta


def refill(static, fresh, names):
    """Copy the new contents into the captured tensors (same shapes), in place."""
    for n in names:
        assert static[n].shape == fresh[n].shape, n
        static[n].copy_(fresh[n])


def check_replay(graph, out, lse, static, backend, scale):
    # twice: a replay must leave what the next one reuses (the metadata's workspaces) as it found it
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    eager = anymla.flash_mla_with_kvcache(**static, tile_scheduler_metadata=anymla.get_mla_metadata()[0],
                                          backend=backend)
    assert torch.equal(out, eager[0]) and torch.equal(lse, eager[1]), "replay differs from eager on the new contents"
    compare_outputs("dense_decode" if static.get("indices") is None else "sparse_decode", (out, lse),
                    anymla.flash_mla_with_kvcache(**static, tile_scheduler_metadata=None, backend="reference"),
                    scale=scale)


@pytest.mark.parametrize("fmt", [F.V41_FP8, F.V32_FP8], ids=lambda f: f.name)
def test_sparse_decode_graph_replays_new_contents(backend, fmt, tol_scale, device):
    extra = dict(fmt=F.V41_FP4, page=64, s_k=300, topk=128, topk_length=True) if fmt is F.V41_FP8 else None
    def make(seed):
        return sparse_decode_inputs(4, 1, 64, 1000, 512, fmt=fmt, page=64, varlen=False, sink=True,
                                    topk_length=fmt is F.V41_FP8, extra=extra, device=device, seed=seed)

    static = make(0)
    graph, out, lse, meta = capture(static, backend)
    before = out.clone()
    fresh = make(1)  # varlen=False keeps every shape, the caches included
    names = ["q", "indices", "k_cache"] + (["topk_length", "extra_indices_in_kvcache", "extra_k_cache",
                                            "extra_topk_length"] if extra else [])
    refill(static, fresh, names)
    check_replay(graph, out, lse, static, backend, tol_scale)
    assert not torch.equal(out, before), "the replay must have computed something new"


def test_dense_decode_graph_replays_new_contents_and_lengths(backend, tol_scale, device):
    def make(seed):
        return dense_decode_inputs(4, 2, 64, 1, 1000, page=64, causal=True, device=device, seed=seed)

    static = make(0)
    graph, out, lse, meta = capture(static, backend)
    fresh = make(1)
    # New lengths, at most the captured ones (rows past a length are NaN, and the block table covers them).
    fresh["cache_seqlens"] = torch.tensor([1000, 1, 517, 0], dtype=torch.int32, device=device)
    refill(static, fresh, ["q", "k_cache", "block_table", "cache_seqlens"])
    check_replay(graph, out, lse, static, backend, tol_scale)
    assert torch.isposinf(lse[3]).all() and torch.equal(out[3], torch.zeros_like(out[3]))
