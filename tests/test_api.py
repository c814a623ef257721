"""The public API as a FlashMLA drop-in (contract sections 1.2-1.5, 9): output layouts, argument validation,
the legacy call style, scheduling-metadata semantics, non-contiguous inputs, empty work, torch.compile and
the torch.library custom ops.
"""

import math

import pytest
import torch

import anymla
from anymla.kvcache import KVCacheFormat
from anymla.testing import (compare_outputs, dense_decode_inputs, device_under_test, non_contiguous, prefill_inputs,
                            sparse_decode_inputs)

F = KVCacheFormat
DEVICE = device_under_test()
# The reference and every other backend the suite checks (as conftest's ``backend`` fixture, plus the oracle).
LAYOUT_BACKENDS = ["reference"] + [n for n in anymla.available_backends(DEVICE)
                                   if n != "reference" and anymla.get_backend(n).auto_select]


def sparse_args(device="cpu", **kw):
    opts = dict(b=2, s_q=2, h_q=4, s_k=20, topk=8, fmt=F.V41_FP8, page=4, seed=1)
    opts.update(kw)
    return sparse_decode_inputs(opts.pop("b"), opts.pop("s_q"), opts.pop("h_q"), opts.pop("s_k"), opts.pop("topk"),
                                device=device, **opts)


def dense_args(device="cpu", **kw):
    opts = dict(b=2, s_q=2, h_q=4, h_kv=2, s_k=9, page=4, seed=2)
    opts.update(kw)
    return dense_decode_inputs(opts.pop("b"), opts.pop("s_q"), opts.pop("h_q"), opts.pop("h_kv"), opts.pop("s_k"),
                               device=device, **opts)


def prefill_args(device="cpu", **kw):
    opts = dict(s_q=3, h_q=4, d_qk=512, s_kv=16, topk=8, seed=3)
    opts.update(kw)
    return prefill_inputs(opts.pop("s_q"), opts.pop("h_q"), opts.pop("d_qk"), opts.pop("s_kv"), opts.pop("topk"),
                          device=device, **opts)


def decode(args, **kw):
    merged = dict(tile_scheduler_metadata=None)
    merged.update(args)
    merged.update(kw)
    return anymla.flash_mla_with_kvcache(**merged)


def assert_bitwise(got, expected):
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        assert torch.equal(g.nan_to_num(), e.nan_to_num()) and torch.equal(g.isnan(), e.isnan())


# ---------------------------------------------------------------- output layouts

@pytest.mark.parametrize("which", LAYOUT_BACKENDS)
def test_prefill_output_shapes_dtypes_strides(which, device):
    args = prefill_args(device, h_q=5, s_q=3)
    out, max_logits, lse = anymla.flash_mla_sparse_fwd(**args, backend=which)
    assert out.shape == (3, 5, 512) and out.dtype == torch.bfloat16 and out.is_contiguous()
    for t in (max_logits, lse):
        assert t.shape == (3, 5) and t.dtype == torch.float32 and t.is_contiguous()
    assert out.device == max_logits.device == lse.device == args["q"].device  # "cuda:0", not the fixture's "cuda"


@pytest.mark.parametrize("which", LAYOUT_BACKENDS)
def test_sparse_decode_lse_is_a_transposed_view_of_a_contiguous_buffer(which, device):
    out, lse = decode(sparse_args(device, b=3, s_q=2, h_q=5), backend=which)
    assert out.shape == (3, 2, 5, 512) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert lse.shape == (3, 5, 2) and lse.dtype == torch.float32
    assert lse.transpose(1, 2).is_contiguous() and not lse.is_contiguous(), lse.stride()


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("which", LAYOUT_BACKENDS)
def test_dense_decode_output_shapes_dtypes_strides(which, dtype, device):
    out, lse = decode(dense_args(device, b=3, s_q=2, h_q=6, h_kv=3, dtype=dtype), backend=which)
    assert out.shape == (3, 2, 6, 512) and out.dtype == dtype and out.is_contiguous()
    assert lse.shape == (3, 6, 2) and lse.dtype == torch.float32 and lse.is_contiguous()


# ---------------------------------------------------------------- bad input, table-driven

META = "meta"  # a second device that allocates nothing


def huge_strided(shape, dtype, dim, device=META):
    """A tensor whose stride along ``dim`` is 2^31 (beyond int32), on the meta device: no memory is used."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    strides[dim] = 2 ** 31
    return torch.empty(2 ** 40, dtype=dtype, device=device).as_strided(shape, strides)


def on_meta(args):
    return {k: v.to(META) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def _prefill_bad():
    def case(name, exc, match, **changes):
        return pytest.param(changes, exc, match, id=name)

    return [
        case("q-float32", TypeError, "q", q=lambda a: a["q"].float()),
        case("q-2d", ValueError, "q", q=lambda a: a["q"][0]),
        case("q-d256", ValueError, "q", q=lambda a: a["q"][..., :256]),
        case("q-not-tensor", TypeError, "q", q=lambda a: a["q"].tolist()),
        case("kv-fp16", TypeError, "kv", kv=lambda a: a["kv"].half()),
        case("kv-d576", ValueError, "kv", kv=lambda a: torch.zeros(16, 1, 576, dtype=torch.bfloat16)),
        case("kv-other-device", ValueError, "kv", kv=lambda a: a["kv"].to(META)),
        case("kv-h_kv-3-for-h_q-4", ValueError, "kv", kv=lambda a: a["kv"].expand(16, 3, 512)),
        case("kv-not-tensor", TypeError, "kv", kv=lambda a: 0),
        case("indices-int64", TypeError, "indices", indices=lambda a: a["indices"].long()),
        case("indices-wrong-s_q", ValueError, "indices", indices=lambda a: a["indices"][:2]),
        case("indices-2d", ValueError, "indices", indices=lambda a: a["indices"][:, 0]),
        case("indices-other-device", ValueError, "indices", indices=lambda a: a["indices"].to(META)),
        case("sm_scale-zero", ValueError, "sm_scale", sm_scale=lambda a: 0.0),
        case("sm_scale-negative", ValueError, "sm_scale", sm_scale=lambda a: -0.5),
        case("sm_scale-inf", ValueError, "sm_scale", sm_scale=lambda a: math.inf),
        case("sm_scale-nan", ValueError, "sm_scale", sm_scale=lambda a: math.nan),
        case("sm_scale-str", TypeError, "sm_scale", sm_scale=lambda a: "0.5"),
        case("sm_scale-bool", TypeError, "sm_scale", sm_scale=lambda a: True),
        case("sm_scale-tensor", TypeError, "sm_scale", sm_scale=lambda a: torch.tensor(0.5)),
        case("d_v-256", ValueError, "d_v", d_v=lambda a: 256),
        case("attn_sink-bf16", TypeError, "attn_sink", attn_sink=lambda a: torch.zeros(4, dtype=torch.bfloat16)),
        case("attn_sink-wrong-length", ValueError, "attn_sink", attn_sink=lambda a: torch.zeros(5)),
        case("attn_sink-other-device", ValueError, "attn_sink", attn_sink=lambda a: torch.zeros(4, device=META)),
        case("topk_length-int64", TypeError, "topk_length", topk_length=lambda a: torch.zeros(3, dtype=torch.long)),
        case("topk_length-per-batch-shape", ValueError, "topk_length",
             topk_length=lambda a: torch.zeros(1, dtype=torch.int32)),
    ]


@pytest.mark.parametrize("changes,exc,match", _prefill_bad())
def test_prefill_rejects_bad_input_naming_the_argument(changes, exc, match):
    a = prefill_args()
    a.update({k: f(a) for k, f in changes.items()})
    with pytest.raises(exc, match=rf"^{match}:"):
        anymla.flash_mla_sparse_fwd(**a)


def _decode_bad():
    def case(name, exc, match, kind="sparse", **changes):
        return pytest.param(kind, changes, exc, match, id=f"{kind}-{name}")

    v32 = lambda a: sparse_args(fmt=F.V32_FP8)["k_cache"]  # noqa: E731  (d_qk 576 cache for a 512 q)
    return [
        # both paths
        case("q-float32", TypeError, "q", q=lambda a: a["q"].float()),
        case("q-3d", ValueError, "q", q=lambda a: a["q"][0]),
        case("q-d256", ValueError, "q", q=lambda a: a["q"][..., :256]),
        case("q-not-tensor-with-scale", TypeError, "q", q=lambda a: a["q"].tolist(), softmax_scale=lambda a: 0.1),
        case("head_dim_v-576", ValueError, "head_dim_v", head_dim_v=lambda a: 576),
        case("softmax_scale-zero", ValueError, "softmax_scale", softmax_scale=lambda a: 0.0),
        case("softmax_scale-negative", ValueError, "softmax_scale", softmax_scale=lambda a: -1.0),
        case("softmax_scale-str", TypeError, "softmax_scale", softmax_scale=lambda a: "x"),
        case("num_splits-given", ValueError, "num_splits", num_splits=lambda a: torch.zeros(3, dtype=torch.int32)),
        case("metadata-not-FlashMLASchedMeta", TypeError, "tile_scheduler_metadata",
             tile_scheduler_metadata=lambda a: torch.zeros(4, 8, dtype=torch.int32)),
        case("metadata-tuple", TypeError, "tile_scheduler_metadata",
             tile_scheduler_metadata=lambda a: anymla.get_mla_metadata()),
        case("attn_sink-fp16", TypeError, "attn_sink", attn_sink=lambda a: torch.zeros(4, dtype=torch.float16)),
        case("attn_sink-wrong-length", ValueError, "attn_sink", attn_sink=lambda a: torch.zeros(3)),
        # sparse
        case("k_cache-600-bytes", ValueError, "k_cache",
             k_cache=lambda a: torch.zeros(5, 4, 1, 600, dtype=torch.uint8)),
        case("k_cache-float32", TypeError, "k_cache", k_cache=lambda a: torch.zeros(5, 4, 1, 512)),
        case("k_cache-h_kv-2", ValueError, "k_cache", k_cache=lambda a: a["k_cache"].expand(-1, -1, 2, -1)),
        case("k_cache-3d", ValueError, "k_cache", k_cache=lambda a: a["k_cache"][:, :, 0]),
        case("k_cache-format-for-d576", ValueError, "k_cache", k_cache=v32),
        case("k_cache-bf16-wrong-d", ValueError, "k_cache",
             k_cache=lambda a: torch.zeros(5, 4, 1, 576, dtype=torch.bfloat16), is_fp8_kvcache=lambda a: False),
        case("k_cache-bf16-wrong-dtype", TypeError, "k_cache",
             k_cache=lambda a: torch.zeros(5, 4, 1, 512, dtype=torch.float16), is_fp8_kvcache=lambda a: False),
        case("k_cache-last-dim-strided", ValueError, "k_cache", k_cache=lambda a: a["k_cache"].view(
            torch.uint8).repeat_interleave(2, -1)[..., ::2]),
        case("k_cache-other-device", ValueError, "k_cache", k_cache=lambda a: a["k_cache"].to(META)),
        case("k_cache-not-tensor", TypeError, "k_cache", k_cache=lambda a: [0]),
        case("indices-int64", TypeError, "indices", indices=lambda a: a["indices"].long()),
        case("indices-batch-mismatch", ValueError, "indices", indices=lambda a: a["indices"][:1]),
        case("indices-2d", ValueError, "indices", indices=lambda a: a["indices"][:, 0]),
        case("indices-other-device", ValueError, "indices", indices=lambda a: a["indices"].to(META)),
        case("causal-with-indices", ValueError, "causal", causal=lambda a: True),
        case("is_fp8-true-for-bf16-cache", ValueError, "is_fp8_kvcache",
             k_cache=lambda a: torch.zeros(5, 4, 1, 512, dtype=torch.bfloat16), is_fp8_kvcache=lambda a: True),
        case("is_fp8-false-for-fp8-cache", ValueError, "is_fp8_kvcache", is_fp8_kvcache=lambda a: False),
        case("topk_length-int64", TypeError, "topk_length", topk_length=lambda a: torch.zeros(2, dtype=torch.long)),
        case("topk_length-batch-mismatch", ValueError, "topk_length",
             topk_length=lambda a: torch.zeros(3, dtype=torch.int32)),
        case("extra_indices-without-extra_k_cache", ValueError, "extra_indices_in_kvcache",
             extra_indices_in_kvcache=lambda a: a["indices"]),
        case("extra_k_cache-without-extra_indices", ValueError, "extra_indices_in_kvcache",
             extra_k_cache=lambda a: a["k_cache"]),
        case("extra_topk_length-without-extra_k_cache", ValueError, "extra_topk_length",
             extra_topk_length=lambda a: torch.zeros(2, dtype=torch.int32)),
        case("extra_k_cache-bad-bytes", ValueError, "extra_k_cache",
             extra_k_cache=lambda a: torch.zeros(5, 4, 1, 300, dtype=torch.uint8),
             extra_indices_in_kvcache=lambda a: a["indices"]),
        case("extra_k_cache-float32", TypeError, "extra_k_cache",
             extra_k_cache=lambda a: torch.zeros(5, 4, 1, 512), extra_indices_in_kvcache=lambda a: a["indices"]),
        case("extra_indices-int64", TypeError, "extra_indices_in_kvcache", extra_k_cache=lambda a: a["k_cache"],
             extra_indices_in_kvcache=lambda a: a["indices"].long()),
        case("extra_topk_length-int64", TypeError, "extra_topk_length", extra_k_cache=lambda a: a["k_cache"],
             extra_indices_in_kvcache=lambda a: a["indices"], extra_topk_length=lambda a: torch.zeros(2).long()),
        # dense
        case("q-float32", TypeError, "q", kind="dense", q=lambda a: a["q"].float()),
        case("q-d256", ValueError, "q", kind="dense", q=lambda a: a["q"][..., :256]),
        case("head_dim_v-256", ValueError, "head_dim_v", kind="dense", head_dim_v=lambda a: 256),
        case("k_cache-fp16-for-bf16-q", TypeError, "k_cache", kind="dense", k_cache=lambda a: a["k_cache"].half()),
        case("k_cache-fp8-without-indices", TypeError, "k_cache", kind="dense",
             k_cache=lambda a: torch.zeros(5, 4, 1, 656, dtype=torch.uint8)),
        case("k_cache-h_kv-3-for-h_q-4", ValueError, "k_cache", kind="dense",
             k_cache=lambda a: a["k_cache"][:, :, :1].expand(-1, -1, 3, -1)),
        case("k_cache-d512-for-q-d576", ValueError, "k_cache", kind="dense", k_cache=lambda a: a["k_cache"][..., :512]),
        case("k_cache-other-device", ValueError, "k_cache", kind="dense", k_cache=lambda a: a["k_cache"].to(META)),
        case("k_cache-not-tensor", TypeError, "k_cache", kind="dense", k_cache=lambda a: None),
        case("is_fp8_kvcache-dense", ValueError, "is_fp8_kvcache", kind="dense", is_fp8_kvcache=lambda a: True),
        case("topk_length-without-indices", ValueError, "topk_length", kind="dense",
             topk_length=lambda a: torch.zeros(2, dtype=torch.int32)),
        case("extra_k_cache-without-indices", ValueError, "extra_k_cache", kind="dense",
             extra_k_cache=lambda a: a["k_cache"]),
        case("extra_indices-without-indices", ValueError, "extra_indices_in_kvcache", kind="dense",
             extra_indices_in_kvcache=lambda a: torch.zeros(2, 2, 4, dtype=torch.int32)),
        case("extra_topk_length-without-indices", ValueError, "extra_topk_length", kind="dense",
             extra_topk_length=lambda a: torch.zeros(2, dtype=torch.int32)),
        case("block_table-int64", TypeError, "block_table", kind="dense",
             block_table=lambda a: a["block_table"].long()),
        case("block_table-batch-mismatch", ValueError, "block_table", kind="dense",
             block_table=lambda a: a["block_table"][:1]),
        case("block_table-none", TypeError, "block_table", kind="dense", block_table=lambda a: None),
        case("block_table-other-device", ValueError, "block_table", kind="dense",
             block_table=lambda a: a["block_table"].to(META)),
        case("block_table-column-major", ValueError, "block_table", kind="dense",
             block_table=lambda a: a["block_table"].t().contiguous().t()),
        case("cache_seqlens-int64", TypeError, "cache_seqlens", kind="dense",
             cache_seqlens=lambda a: a["cache_seqlens"].long()),
        case("cache_seqlens-batch-mismatch", ValueError, "cache_seqlens", kind="dense",
             cache_seqlens=lambda a: a["cache_seqlens"][:1]),
        case("cache_seqlens-none", ValueError, "cache_seqlens", kind="dense", cache_seqlens=lambda a: None),
        case("cache_seqlens-other-device", ValueError, "cache_seqlens", kind="dense",
             cache_seqlens=lambda a: a["cache_seqlens"].to(META)),
        # Validation comes first whatever else is passed: a FlashMLA-style call always passes metadata (its
        # Config must not be built from unvalidated shapes), and the default softmax_scale reads q.shape.
        case("q-3d-with-metadata", ValueError, "q", kind="dense", q=lambda a: a["q"][0],
             tile_scheduler_metadata=lambda a: anymla.get_mla_metadata()[0]),
        case("q-3d-with-metadata", ValueError, "q", q=lambda a: a["q"][0],
             tile_scheduler_metadata=lambda a: anymla.get_mla_metadata()[0]),
        case("k_cache-not-tensor-with-metadata", TypeError, "k_cache", kind="dense", k_cache=lambda a: None,
             tile_scheduler_metadata=lambda a: anymla.get_mla_metadata()[0]),
        case("k_cache-not-tensor-with-metadata", TypeError, "k_cache", k_cache=lambda a: None,
             tile_scheduler_metadata=lambda a: anymla.get_mla_metadata()[0]),
        case("q-not-tensor-default-scale", TypeError, "q", kind="dense", q=lambda a: a["q"].tolist()),
        case("q-not-tensor-default-scale", TypeError, "q", q=lambda a: a["q"].tolist(), softmax_scale=lambda a: None),
    ]


@pytest.mark.parametrize("kind,changes,exc,match", _decode_bad())
def test_decode_rejects_bad_input_naming_the_argument(kind, changes, exc, match):
    a = sparse_args(fmt=F.V41_FP8, h_q=4) if kind == "sparse" else dense_args(h_q=4, h_kv=2, d_qk=576)
    a.setdefault("tile_scheduler_metadata", None)
    a.update({k: f(a) for k, f in changes.items()})
    with pytest.raises(exc, match=rf"^{match}:"):
        anymla.flash_mla_with_kvcache(**a)


def _stride_cases():
    """(op, build meta args, argument name) with one argument's stride at 2^31."""
    def prefill(name):
        def build():
            a = on_meta(prefill_args())
            shapes = dict(q=((3, 4, 512), torch.bfloat16, 0), kv=((16, 1, 512), torch.bfloat16, 0),
                          indices=((3, 1, 8), torch.int32, 1))
            shape, dtype, dim = shapes[name]
            a[name] = huge_strided(shape, dtype, dim)
            return anymla.flash_mla_sparse_fwd, a
        return pytest.param(build, name, id=f"prefill-{name}")

    def sparse(name):
        def build():
            a = on_meta(sparse_args(fmt=F.V32_FP8))
            nb = a["k_cache"].shape[0]
            shapes = dict(q=((2, 2, 4, 576), torch.bfloat16, 1), k_cache=((nb, 4, 1, 656), torch.uint8, 0),
                          indices=((2, 2, 8), torch.int32, 0))
            shape, dtype, dim = shapes[name]
            a[name] = huge_strided(shape, dtype, dim)
            return anymla.flash_mla_with_kvcache, dict(a, tile_scheduler_metadata=None)
        return pytest.param(build, name, id=f"sparse-{name}")

    def dense(name):
        def build():
            a = on_meta(dense_args())
            shapes = dict(q=((2, 2, 4, 576), torch.bfloat16, 0), k_cache=(tuple(a["k_cache"].shape), torch.bfloat16, 1),
                          block_table=(tuple(a["block_table"].shape), torch.int32, 0))
            shape, dtype, dim = shapes[name]
            a[name] = huge_strided(shape, dtype, dim)
            return anymla.flash_mla_with_kvcache, dict(a, tile_scheduler_metadata=None)
        return pytest.param(build, name, id=f"dense-{name}")

    return [prefill("q"), prefill("kv"), prefill("indices"), sparse("q"), sparse("k_cache"), sparse("indices"),
            dense("q"), dense("k_cache"), dense("block_table")]


@pytest.mark.parametrize("build,name", _stride_cases())
def test_strides_beyond_int32_are_rejected_naming_the_argument(build, name):
    fn, args = build()
    with pytest.raises(ValueError, match=rf"^{name}: strides must fit in int32"):
        fn(**args)


def test_strides_at_the_int32_limit_are_accepted():
    """2^31 - 1 still fits: validation passes and the dispatcher decides (nothing runs: explain)."""
    a = on_meta(prefill_args())
    a["kv"] = torch.empty(2 ** 40, dtype=torch.bfloat16, device=META).as_strided((16, 1, 512), (2 ** 31 - 1, 512, 1))
    assert anymla.explain(anymla.flash_mla_sparse_fwd, **a).backend == "reference"


# ---------------------------------------------------------------- legacy call style and metadata

@pytest.mark.parametrize("causal", (False, True))
def test_legacy_positional_dense_call_with_legacy_metadata(backend, causal, tol_scale, device):
    a = dense_args(device, b=2, s_q=2, h_q=4, h_kv=2, s_k=30, causal=causal)
    q, k_cache, block_table, cache_seqlens = a["q"], a["k_cache"], a["block_table"], a["cache_seqlens"]
    s_q, h_q, h_kv = 2, 4, 2
    meta, num_splits = anymla.get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv)
    assert isinstance(meta, anymla.FlashMLASchedMeta) and num_splits is None and not meta.have_initialized
    got = anymla.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, meta, num_splits, causal=causal,
                                        backend=backend)
    assert meta.have_initialized and meta.config.causal == causal and meta.config.b == 2
    ref = anymla.flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, None, None, causal=causal,
                                        backend="reference")
    compare_outputs("dense_decode", got, ref, scale=tol_scale)


def test_legacy_positional_sparse_fp8_call(backend, tol_scale, device):
    a = sparse_args(device, fmt=F.V32_FP8, h_q=4, s_q=1)
    q, k_cache, indices = a["q"], a["k_cache"], a["indices"]
    cache_seqlens = torch.full((2,), 20, dtype=torch.int32, device=device)
    meta, num_splits = anymla.get_mla_metadata(cache_seqlens, 1 * 4, 1, 4, True, 8)
    got = anymla.flash_mla_with_kvcache(q, k_cache, None, cache_seqlens, 512, meta, num_splits, a["softmax_scale"],
                                        False, True, indices, backend=backend)
    assert meta.config.is_fp8_kvcache and meta.config.topk == 8
    ref = decode(a, backend="reference")
    compare_outputs("sparse_decode", got, ref, scale=tol_scale)


def _reuse_ops(device):
    return {
        "dense": dense_args(device, b=2, s_q=2, h_q=4, h_kv=1, s_k=40, causal=True, varlen=True),
        "sparse": sparse_args(device, fmt=F.V41_FP8, h_q=4, topk=16, topk_length=True,
                              extra=dict(fmt=F.V41_FP4, page=2, s_k=10, topk=4, topk_length=True)),
    }


@pytest.mark.parametrize("op", ("dense", "sparse"))
@pytest.mark.parametrize("which", LAYOUT_BACKENDS)
def test_metadata_reuse_gives_bitwise_identical_results(op, which, device):
    a = _reuse_ops(device)[op]
    meta, _ = anymla.get_mla_metadata()
    first = decode(a, tile_scheduler_metadata=meta, backend=which)
    config = meta.config
    for _ in range(2):
        again = decode(a, tile_scheduler_metadata=meta, backend=which)
        assert_bitwise(again, first)
    assert meta.config is config


@pytest.mark.parametrize("op", ("dense", "sparse"))
def test_metadata_reuse_with_new_lengths_matches_a_fresh_call(backend, op, tol_scale, device):
    """The plan depends on the configuration only: new cache_seqlens / topk_length values on the same metadata
    (every layer of a decoding step, or the next step) give what a fresh call gives."""
    a = _reuse_ops(device)[op]
    meta, _ = anymla.get_mla_metadata()
    decode(a, tile_scheduler_metadata=meta, backend=backend)
    b = dict(a, q=-a["q"])
    if op == "dense":
        b["cache_seqlens"] = a["cache_seqlens"] // 3
    else:  # shorter lengths only: the rows past the generated lengths are NaN
        b["topk_length"] = a["topk_length"] // 2
        b["extra_topk_length"] = a["extra_topk_length"] // 2
    reused = decode(b, tile_scheduler_metadata=meta, backend=backend)
    fresh = decode(b, tile_scheduler_metadata=anymla.get_mla_metadata()[0], backend=backend)
    assert_bitwise(reused, fresh)
    compare_outputs(f"{op}_decode", reused, decode(b, backend="reference"), scale=tol_scale)


def _config_changes():
    def dense(field, old, new, **kw):
        return pytest.param("dense", kw, field, old, new, id=f"dense-{field}")

    def sparse(field, old, new, **kw):
        return pytest.param("sparse", kw, field, old, new, id=f"sparse-{field}")

    return [
        dense("b", 2, 3, b=3), dense("s_q", 2, 1, s_q=1), dense("h_q", 4, 8, h_q=8),
        dense("page_block_size", 4, 5, page=5), dense("h_k", 1, 2, h_kv=2), dense("causal", True, False, causal=False),
        dense("enable_batch_invariant", False, True, enable_batch_invariant=True),
        sparse("topk", 16, 8, topk=8), sparse("page_block_size", 4, 2, page=2),
        sparse("extra_topk", 4, 6, extra=dict(fmt=F.V41_FP4, page=2, s_k=10, topk=6)),
        sparse("extra_page_block_size", 2, 3, extra=dict(fmt=F.V41_FP4, page=3, s_k=10, topk=4)),
        sparse("is_fp8_kvcache", True, False, fmt=F.BF16, cut_to_512=True),
        sparse("enable_batch_invariant", False, True, enable_batch_invariant=True),
    ]


@pytest.mark.parametrize("op,changes,field,old,new", _config_changes())
def test_metadata_reuse_with_another_configuration_names_the_field(op, changes, field, old, new):
    base = dict(b=2, s_q=2, h_q=4, h_kv=1, s_k=40, causal=True, page=4) if op == "dense" else \
        dict(fmt=F.V41_FP8, h_q=4, topk=16, page=4, extra=dict(fmt=F.V41_FP4, page=2, s_k=10, topk=4))
    make = dense_args if op == "dense" else sparse_args
    meta, _ = anymla.get_mla_metadata()
    decode(make(**base), tile_scheduler_metadata=meta, backend="reference")
    changes = dict(changes)
    batch_invariant = changes.pop("enable_batch_invariant", False)
    if changes.pop("cut_to_512", False):  # the generator's bf16 cache has d_qk 576: cut it and q to 512, no extra
        other = make(**dict(base, extra=None, **changes))
        other["q"] = other["q"][..., :512].contiguous()
        other["k_cache"] = other["k_cache"][..., :512].contiguous()
    else:
        other = make(**dict(base, **changes))
    with pytest.raises(ValueError, match=rf"^tile_scheduler_metadata: .*{field} {old!r} -> {new!r}"):
        decode(other, tile_scheduler_metadata=meta, enable_batch_invariant=batch_invariant, backend="reference")


# ---------------------------------------------------------------- non-contiguous inputs

def _nc_cases():
    return {
        "prefill": ("sparse_prefill", lambda d: prefill_args(d, h_q=5, sink=True, topk_length=True),
                    ("q", "kv", "indices")),
        "sparse-v32": ("sparse_decode", lambda d: sparse_args(d, fmt=F.V32_FP8, h_q=5),
                       ("q", "indices", "k_cache")),
        "sparse-v41+fp4": ("sparse_decode", lambda d: sparse_args(
            d, fmt=F.V41_FP8, h_q=4, topk_length=True, extra=dict(fmt=F.V41_FP4, page=2, s_k=10, topk=4)),
            ("q", "indices", "k_cache", "extra_k_cache", "extra_indices_in_kvcache")),
        "sparse-model1": ("sparse_decode", lambda d: sparse_args(d, fmt=F.MODEL1_FP8, h_q=4), ("q", "indices")),
        "dense": ("dense_decode", lambda d: dense_args(d, h_q=6, h_kv=2, causal=True), ("q", "k_cache", "block_table")),
    }


def _call(op, args, backend):
    if op == "sparse_prefill":
        return anymla.flash_mla_sparse_fwd(**args, backend=backend)
    return decode(args, backend=backend)


@pytest.mark.parametrize("case", _nc_cases().keys())
def test_non_contiguous_inputs_give_the_contiguous_results(backend, case, tol_scale, device):
    op, make, names = _nc_cases()[case]
    a = make(device)
    strided = dict(a, **{n: non_contiguous(a[n]) for n in names})
    for n in names:
        assert not strided[n].is_contiguous() and torch.equal(strided[n].nan_to_num(), a[n].nan_to_num())
    got = _call(op, strided, backend)
    assert_bitwise(got, _call(op, a, backend))
    compare_outputs(op, got, _call(op, a, "reference"), scale=tol_scale)


@pytest.mark.parametrize("case", _nc_cases().keys())
def test_reference_on_non_contiguous_inputs_is_bitwise_the_same(case, device):
    op, make, names = _nc_cases()[case]
    a = make(device)
    assert_bitwise(_call(op, dict(a, **{n: non_contiguous(a[n]) for n in names}), "reference"),
                   _call(op, a, "reference"))


# ---------------------------------------------------------------- empty work and page sizes

@pytest.mark.parametrize("which", LAYOUT_BACKENDS)
def test_dense_decode_where_every_request_is_empty(which, device):
    a = dense_args(device, b=3, s_q=2, h_q=4, h_kv=2, s_k=9)
    a["cache_seqlens"].zero_()
    out, lse = decode(a, backend=which)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all()


@pytest.mark.parametrize("which", LAYOUT_BACKENDS)
def test_dense_decode_zero_length_requests_next_to_long_ones(which, device):
    a = dense_args(device, b=4, s_q=1, h_q=4, h_kv=1, s_k=70, page=8)
    a["cache_seqlens"] = torch.tensor([0, 70, 0, 3], dtype=torch.int32, device=device)
    out, lse = decode(a, backend=which)
    assert torch.equal(out[[0, 2]], torch.zeros_like(out[[0, 2]])) and torch.isposinf(lse[[0, 2]]).all()
    compare_outputs("dense_decode", (out, lse), decode(a, backend="reference"), scale=2.0 if which == "triton" else 1.0)


@pytest.mark.parametrize("which", LAYOUT_BACKENDS)
def test_prefill_with_empty_kv(which, device):
    a = prefill_args(device, s_kv=0, h_q=4, h_kv=2, topk=8, sink=True, topk_length=True)
    out, max_logits, lse = anymla.flash_mla_sparse_fwd(**a, backend=which)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isposinf(lse).all() and torch.isneginf(max_logits).all()


@pytest.mark.parametrize("which", LAYOUT_BACKENDS)
def test_sparse_decode_with_only_padding_indices(which, device):
    a = sparse_args(device, fmt=F.MODEL1_FP8, b=2, s_q=2, h_q=4, sink=True)
    a["indices"].fill_(-1)
    out, lse = decode(a, backend=which)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all()


@pytest.mark.parametrize("page", (1, 53))
def test_dense_decode_any_page_size_gqa_d512(backend, page, tol_scale, device):
    a = dense_args(device, b=2, s_q=2, h_q=6, h_kv=2, s_k=60, page=page, d_qk=512, causal=True, varlen=True)
    meta, _ = anymla.get_mla_metadata()
    got = decode(a, tile_scheduler_metadata=meta, backend=backend)
    compare_outputs("dense_decode", got, decode(a, backend="reference"), scale=tol_scale)


# ---------------------------------------------------------------- torch.compile and custom ops

def _compiled_cases(device):
    pre = prefill_args(device, h_q=4, sink=True, topk_length=True)
    sp = sparse_args(device, fmt=F.V41_FP8, h_q=4, topk_length=True, sink=True,
                     extra=dict(fmt=F.V41_FP4, page=2, s_k=10, topk=4))
    de = dense_args(device, h_q=4, h_kv=2, causal=True)

    def prefill_fn(q, kv, indices, sink, length):
        return anymla.flash_mla_sparse_fwd(q, kv, indices, 0.5, 512, sink, length)

    def sparse_fn(q, cache, indices, sink, length, extra, extra_indices):
        return anymla.flash_mla_with_kvcache(q, cache, None, None, 512, None, softmax_scale=0.07,
                                             is_fp8_kvcache=True, indices=indices, attn_sink=sink, topk_length=length,
                                             extra_k_cache=extra, extra_indices_in_kvcache=extra_indices)

    def dense_fn(q, cache, block_table, seqlens):
        return anymla.flash_mla_with_kvcache(q, cache, block_table, seqlens, 512, None, causal=True)

    return {
        "prefill": (prefill_fn, (pre["q"], pre["kv"], pre["indices"], pre["attn_sink"], pre["topk_length"])),
        "sparse": (sparse_fn, (sp["q"], sp["k_cache"], sp["indices"], sp["attn_sink"], sp["topk_length"],
                               sp["extra_k_cache"], sp["extra_indices_in_kvcache"])),
        "dense": (dense_fn, (de["q"], de["k_cache"], de["block_table"], de["cache_seqlens"])),
    }


@pytest.mark.parametrize("op", ("prefill", "sparse", "dense"))
def test_torch_compile_fullgraph_matches_eager(op, device):
    fn, args = _compiled_cases(device)[op]
    eager = fn(*args)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(*args)
    assert_bitwise(compiled, eager)
    assert [t.stride() for t in compiled] == [t.stride() for t in eager]  # incl. decode lse's transposed view


def test_torch_compile_passes_the_backend_keyword(device):
    a = prefill_args(device)

    def fn(q, kv, indices):
        return anymla.flash_mla_sparse_fwd(q, kv, indices, 0.5, backend="reference")

    assert_bitwise(torch.compile(fn, backend="aot_eager", fullgraph=True)(a["q"], a["kv"], a["indices"]),
                   anymla.flash_mla_sparse_fwd(**a, backend="reference"))


def test_custom_op_outputs_never_share_memory_under_inference_mode(device):
    """The Triton plan returns prefill's max_logits and lse as halves of one allocation; views made under
    inference mode have no ``_base``, and torch rejects custom-op outputs that alias each other."""
    a = prefill_args(device, h_q=4, poison=False)
    with torch.inference_mode():
        outs = torch.ops.anymla.sparse_prefill(a["q"], a["kv"], a["indices"], 0.5, 512, None, None, "triton")
    assert len({t.untyped_storage().data_ptr() for t in outs}) == 3
    assert_bitwise(outs, anymla.flash_mla_sparse_fwd(a["q"], a["kv"], a["indices"], 0.5, backend="triton"))


def test_opcheck_sparse_prefill():
    a = prefill_args(h_q=4, sink=True, topk_length=True, poison=False)
    torch.library.opcheck(torch.ops.anymla.sparse_prefill.default,
                          (a["q"], a["kv"], a["indices"], 0.5, 512, a["attn_sink"], a["topk_length"], "reference"))


@pytest.mark.parametrize("fmt", (F.V41_FP8, F.MODEL1_FP8), ids=lambda f: f.name)
def test_opcheck_sparse_decode(fmt):
    extra = dict(fmt=F.V41_FP4 if fmt is F.V41_FP8 else F.MODEL1_FP8, page=2, s_k=10, topk=4, topk_length=True)
    a = sparse_args(fmt=fmt, h_q=4, topk_length=True, sink=True, extra=extra, poison=False)
    torch.library.opcheck(torch.ops.anymla.decode.default,
                          (a["q"], a["k_cache"], None, None, 512, 0.07, False, True, a["indices"], a["attn_sink"],
                           a["extra_k_cache"], a["extra_indices_in_kvcache"], a["topk_length"], a["extra_topk_length"],
                           False, "reference"))


def test_opcheck_dense_decode():
    a = dense_args(h_q=4, h_kv=2, causal=True, sink=True)
    torch.library.opcheck(torch.ops.anymla.decode.default,
                          (a["q"], a["k_cache"], a["block_table"], a["cache_seqlens"], 512, 0.05, True, False, None,
                           a["attn_sink"], None, None, None, None, False, "reference"))
