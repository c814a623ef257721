"""``enable_batch_invariant=True`` (contract 1.5, checklist 14): a request's results do not depend on the rest of
the batch. Every request run alone (a batch slice of 1) must give bitwise the rows it gets inside the full batch,
with fresh or reused scheduling metadata.
"""

import pytest
import torch

import anymla
from anymla.kvcache import KVCacheFormat
from anymla.testing import compare_outputs, dense_decode_inputs, device_under_test, sparse_decode_inputs

F = KVCacheFormat
DEVICE = device_under_test()
BATCH = 5
# The backends under test (conftest's ``backend``) and the reference, which is also a real backend.
BACKENDS = ["reference"] + [n for n in anymla.available_backends(DEVICE)
                            if n != "reference" and anymla.get_backend(n).auto_select]

# Per-request tensors (batch dim 0) of each op; everything else (the caches, sink) is shared.
PER_REQUEST = ("q", "indices", "topk_length", "extra_indices_in_kvcache", "extra_topk_length", "block_table",
               "cache_seqlens")


def cases(device):
    return {
        # topk 256 vs lengths around 180: -1 padding, and enough key blocks that a lone request would be split.
        "sparse-v32": sparse_decode_inputs(BATCH, 2, 16, 180, 256, fmt=F.V32_FP8, page=16, sink=True, device=device,
                                           seed=1),
        "sparse-v41+fp4": sparse_decode_inputs(BATCH, 1, 16, 200, 192, fmt=F.V41_FP8, page=8, topk_length=True,
                                               sink=True, device=device, seed=2,
                                               extra=dict(fmt=F.V41_FP4, page=4, s_k=100, topk=64, topk_length=True)),
        "dense": dense_decode_inputs(BATCH, 2, 16, 1, 150, page=16, varlen=True, causal=True, device=device, seed=3),
    }


def request(args, i):
    return {k: (v[i:i + 1] if k in PER_REQUEST and v is not None else v) for k, v in args.items()}


def run(args, backend, meta=None, **kw):
    return anymla.flash_mla_with_kvcache(**args, tile_scheduler_metadata=meta, backend=backend,
                                         enable_batch_invariant=True, **kw)


def lengths(args):
    """Work per request: sequence length (dense) or counted indices (sparse)."""
    if args.get("indices") is None:
        return args["cache_seqlens"].tolist()
    counted = (args["indices"] >= 0).sum((1, 2))
    if args["topk_length"] is not None:
        counted = torch.minimum(counted, args["topk_length"] * args["indices"].shape[1])
    return counted.tolist()


@pytest.mark.parametrize("case", ["sparse-v32", "sparse-v41+fp4", "dense"])
@pytest.mark.parametrize("which", BACKENDS)
def test_requests_alone_equal_their_rows_in_the_batch(which, case, device):
    args = cases(device)[case]
    assert len(set(lengths(args))) > 1, "the requests must differ in length"
    out, lse = run(args, which, anymla.get_mla_metadata()[0])
    shared_meta, _ = anymla.get_mla_metadata()  # one b=1 metadata reused for every request (same configuration)
    for i in range(BATCH):
        alone = request(args, i)
        for meta in (anymla.get_mla_metadata()[0], shared_meta):
            o, l = run(alone, which, meta)
            where = f"request {i} (shared metadata: {meta is shared_meta})"
            assert torch.equal(o[0], out[i]), f"{where}: out differs alone vs in the batch"
            assert torch.equal(l[0], lse[i]), f"{where}: lse differs alone vs in the batch"
    # And the batch is right in the first place.
    compare_outputs(case.split("-")[0] + "_decode", (out, lse), run(args, "reference"),
                    scale=2.0 if which == "triton" and device.type == "cpu" else 1.0)


@pytest.mark.parametrize("case", ["sparse-v32", "sparse-v41+fp4", "dense"])
@pytest.mark.parametrize("which", BACKENDS)
def test_reordered_batch_gives_permuted_rows(which, case, device):
    """Another batch composition (reversed order, one request duplicated) leaves each request's rows unchanged."""
    args = cases(device)[case]
    out, lse = run(args, which)
    order = [4, 3, 3, 1, 0, 2]
    shuffled = {k: (v[order] if k in PER_REQUEST and v is not None else v) for k, v in args.items()}
    o, l = run(shuffled, which)
    assert torch.equal(o, out[order]) and torch.equal(l, lse[order])


@pytest.mark.parametrize("case", ["sparse-v32", "sparse-v41+fp4", "dense"])
@pytest.mark.parametrize("which", BACKENDS)
def test_metadata_reuse_in_batch_invariant_mode_is_bitwise_identical(which, case, device):
    args = cases(device)[case]
    meta, _ = anymla.get_mla_metadata()
    first = run(args, which, meta)
    assert meta.config.enable_batch_invariant
    for _ in range(2):
        again = run(args, which, meta)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


def test_triton_splits_a_lone_request_unless_batch_invariant(device):
    """What makes the tests above bite: without the flag, Triton splits a lone short request's keys over more
    programs than it gives the full batch; with the flag it never splits."""
    if "triton" not in BACKENDS:
        pytest.skip(f"the Triton tier cannot run on {DEVICE}")
    args = request(cases(device)["sparse-v32"], 0)
    loose = anymla.explain(anymla.flash_mla_with_kvcache, **args, tile_scheduler_metadata=None, backend="triton")
    strict = anymla.explain(anymla.flash_mla_with_kvcache, **args, tile_scheduler_metadata=None,
                            enable_batch_invariant=True, backend="triton")
    assert strict.plan.num_splits == 1
    if device.type == "cpu":  # the interpreter pretends to have 4 cores: a lone request is split
        assert loose.plan.num_splits > 1
