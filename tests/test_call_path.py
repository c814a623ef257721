"""The call path: values checked on every call (not only once per signature), compiled and eager calls
rejecting the same inputs, debug-mode data checks, a short block table read safely, the cached decision
following every setting it depends on, warm-up, and (on a GPU) the direct launch of compiled kernels.
"""

import math

import pytest
import torch

import anymla
from anymla import selection
from anymla.kvcache import KVCacheFormat as F
from anymla.testing import compare_outputs, dense_decode_inputs, device_under_test, prefill_inputs, sparse_decode_inputs

DEVICE = device_under_test()
TIERS = ["reference"] + [n for n in ("triton",) if n in anymla.available_backends(DEVICE)]


def prefill(device, **kw):
    return prefill_inputs(3, 4, 512, 16, 8, seed=3, device=device, **kw)


def sparse(device, **kw):
    return dict(sparse_decode_inputs(2, 1, 4, 20, 8, fmt=F.V32_FP8, page=4, seed=1, device=device, **kw),
                tile_scheduler_metadata=None)


def dense(device, **kw):
    return dict(dense_decode_inputs(2, 1, 4, 1, 9, page=4, seed=2, device=device, **kw), tile_scheduler_metadata=None)


def _scale(tier: str) -> float:
    """The interpreter truncates fp32 -> bf16 casts: twice FlashMLA's tolerances there (conftest.tol_scale)."""
    return 2.0 if tier == "triton" and DEVICE.type == "cpu" else 1.0


CALLS = {"prefill": (anymla.flash_mla_sparse_fwd, prefill, "sm_scale"),
         "sparse": (anymla.flash_mla_with_kvcache, sparse, "softmax_scale"),
         "dense": (anymla.flash_mla_with_kvcache, dense, "softmax_scale")}


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("op", CALLS)
@pytest.mark.parametrize("bad, exc", [(math.nan, ValueError), (-1.0, ValueError), (math.inf, ValueError),
                                      (0.0, ValueError), ("0.1", TypeError)])
def test_an_invalid_scale_raises_after_a_valid_call_of_the_same_signature(tier, op, bad, exc, device):
    fn, make, name = CALLS[op]
    args = make(device)
    fn(**args, backend=tier)  # decided, planned and cached
    with pytest.raises(exc, match=f"^{name}:"):
        fn(**dict(args, **{name: bad}), backend=tier)


def _rejections(device):
    """(name, fn, args, message) of calls every path must reject."""
    sp, de, pre = sparse(device), dense(device), prefill(device)
    return [
        ("causal-with-indices", anymla.flash_mla_with_kvcache, dict(sp, causal=True), "^causal:"),
        ("fp8-cache-said-bf16", anymla.flash_mla_with_kvcache, dict(sp, is_fp8_kvcache=False), "^is_fp8_kvcache:"),
        ("nan-scale-decode", anymla.flash_mla_with_kvcache, dict(sp, softmax_scale=math.nan), "^softmax_scale:"),
        ("negative-scale-dense", anymla.flash_mla_with_kvcache, dict(de, softmax_scale=-0.1), "^softmax_scale:"),
        ("topk_length-dense", anymla.flash_mla_with_kvcache,
         dict(de, topk_length=torch.zeros(2, dtype=torch.int32, device=device)), "^topk_length:"),
        ("d_v-256", anymla.flash_mla_sparse_fwd, dict(pre, d_v=256), "^d_v:"),
        ("inf-scale-prefill", anymla.flash_mla_sparse_fwd, dict(pre, sm_scale=math.inf), "^sm_scale:"),
        ("indices-int64", anymla.flash_mla_sparse_fwd, dict(pre, indices=pre["indices"].long()), "^indices:"),
    ]


@pytest.mark.parametrize("case", range(8))
def test_compiled_and_eager_calls_reject_the_same_inputs(case, device):
    name, fn, args, message = _rejections(device)[case]
    tensors = {k: v for k, v in args.items() if isinstance(v, torch.Tensor)}
    rest = {k: v for k, v in args.items() if k not in tensors}

    def call(**t):
        return fn(**t, **rest)

    with pytest.raises((ValueError, TypeError), match=message):
        call(**tensors)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=message.lstrip("^")):  # raised while tracing, by the op's checks
        torch.compile(call, backend="aot_eager", fullgraph=True)(**tensors)


@pytest.mark.parametrize("tier", TIERS)
def test_debug_mode_names_an_out_of_range_index(tier, device, monkeypatch):
    for fn, args, idx in ((anymla.flash_mla_sparse_fwd, prefill(device), "indices"),
                          (anymla.flash_mla_with_kvcache, sparse(device), "indices")):
        bad = args[idx].clone()
        bad.view(-1)[3] = 10 ** 6
        args = dict(args, **{idx: bad})
        fn(**args, backend=tier)  # by default skipped, never read
        with anymla.debug_checks():
            with pytest.raises(ValueError, match=rf"^{idx}: element \(.*\) is 1000000, expected -1 or"):
                fn(**args, backend=tier)
        monkeypatch.setenv("ANYMLA_DEBUG", "1")
        with pytest.raises(ValueError, match=rf"^{idx}:"):
            fn(**args, backend=tier)
        with anymla.debug_checks(False):
            fn(**args, backend=tier)
        monkeypatch.delenv("ANYMLA_DEBUG")


@pytest.mark.parametrize("tier", TIERS)
def test_a_short_block_table_is_named_in_debug_mode_and_read_safely_otherwise(tier, device):
    args = dense(device)
    short = dict(args, block_table=args["block_table"][:, :2], cache_seqlens=torch.full_like(args["cache_seqlens"], 9))
    with anymla.debug_checks():
        with pytest.raises(ValueError, match=r"^cache_seqlens: element \(0,\) is 9, expected a length in \[0, 8\]"):
            anymla.flash_mla_with_kvcache(**short, backend=tier)
        corrupt = args["block_table"].clone()
        corrupt[1, 0] = 10 ** 5
        with pytest.raises(ValueError, match=r"^block_table: element \(1, 0\) is 100000"):
            anymla.flash_mla_with_kvcache(**dict(args, block_table=corrupt), backend=tier)
    # Off: the length is cut to the row's 8 slots, nothing past the row is read.
    got = anymla.flash_mla_with_kvcache(**short, backend=tier)
    cut = dict(short, cache_seqlens=torch.full_like(args["cache_seqlens"], 8))
    compare_outputs("dense_decode", got, anymla.flash_mla_with_kvcache(**cut, backend="reference"), scale=_scale(tier))
    assert torch.isfinite(got[0]).all()


@pytest.fixture
def no_cached_decisions():
    selection.clear_decision_cache()
    yield
    selection.clear_decision_cache()


@pytest.mark.skipif("triton" not in TIERS, reason=f"the Triton tier cannot run on {DEVICE}")
def test_the_cached_decision_follows_forced_settings_and_the_registry(no_cached_decisions, device):
    from anymla.triton_kernels import tuning
    args = sparse(device)
    plain = anymla.explain(anymla.flash_mla_with_kvcache, **args, backend="triton")
    assert anymla.explain(anymla.flash_mla_with_kvcache, **args, backend="triton") is plain
    with tuning.forced(tuning.TileConfig(16, 16, 4, 1), num_splits=3):
        forced = anymla.explain(anymla.flash_mla_with_kvcache, **args, backend="triton")
        assert forced is not plain and forced.plan.num_splits == 3 and "16 rows x 16 keys" in forced.kernel
        got = anymla.flash_mla_with_kvcache(**args, backend="triton")
    assert anymla.explain(anymla.flash_mla_with_kvcache, **args, backend="triton") is plain, "the block is scoped"
    compare_outputs("sparse_decode", got, anymla.flash_mla_with_kvcache(**args, backend="reference"),
                    scale=_scale("triton"))
    anymla.register_backend(anymla.get_backend("triton"))  # the registry changed: decide afresh
    assert anymla.explain(anymla.flash_mla_with_kvcache, **args, backend="triton") is not plain


def test_warmup_makes_every_decision_of_a_batch_size_range(no_cached_decisions, device):
    args = sparse(device)
    report = anymla.warmup(anymla.flash_mla_with_kvcache, sizes=range(1, 6), **args)
    assert (report.sizes, report.decisions) == (5, 5) and "5 sizes" in str(report)
    made = selection.decisions_made()
    for b in (1, 3, 5):
        fresh = sparse_decode_inputs(b, 1, 4, 20, 8, fmt=F.V32_FP8, page=4, seed=b, device=device)
        slots = args["k_cache"].shape[0] * args["k_cache"].shape[1]
        anymla.flash_mla_with_kvcache(**dict(fresh, k_cache=args["k_cache"], indices=fresh["indices"] % slots,
                                             tile_scheduler_metadata=None))
    assert selection.decisions_made() == made, "a warmed-up batch size decides nothing new"
    again = anymla.warmup("flash_mla_with_kvcache", sizes=range(1, 6), **args)
    assert (again.decisions, again.kernels) == (0, 0)
    with pytest.raises(ValueError, match="^sizes:"):
        anymla.warmup(anymla.flash_mla_with_kvcache, sizes=[0], **args)
    with pytest.raises(TypeError, match="^indices:"):
        anymla.warmup(anymla.flash_mla_with_kvcache, **dict(args, indices=args["indices"].long()))


@pytest.mark.skipif(DEVICE.type != "cuda" or "triton" not in TIERS, reason="direct launches need a GPU")
def test_direct_launches_keep_one_compiled_kernel_per_alignment(no_cached_decisions, device):
    """The second call of a signature bypasses Triton's launcher; a misaligned input of the same signature
    gets the kernel compiled for it, and both match the reference."""
    args = prefill(device)
    for _ in range(3):
        compare_outputs("sparse_prefill", anymla.flash_mla_sparse_fwd(**args, backend="triton"),
                        anymla.flash_mla_sparse_fwd(**args, backend="reference"))
    q = args["q"]
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype, device=device)[1:].view(q.shape)
    shifted.copy_(q)
    assert shifted.data_ptr() % 16 and shifted.stride() == q.stride()
    moved = dict(args, q=shifted)
    for _ in range(2):
        compare_outputs("sparse_prefill", anymla.flash_mla_sparse_fwd(**moved, backend="triton"),
                        anymla.flash_mla_sparse_fwd(**moved, backend="reference"))
    plan = anymla.explain(anymla.flash_mla_sparse_fwd, **args, backend="triton").plan
    launcher = plan.launch.launcher if plan.hopper else plan.launch.kernel.launcher
    assert len(launcher._compiled) == 2


def _shifted(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its strides, one element past a 16-byte boundary."""
    out = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 16 and out.stride() == t.stride()
    return out


@pytest.mark.parametrize("tier", TIERS)
def test_a_misaligned_cache_gets_a_plan_of_its_own(tier, device):
    """A cache at an address that is not 16-byte aligned, of a signature planned for an aligned one, gets its own
    decision (the Hopper kernels read caches with 16-byte copies and tensor-memory descriptors, which such an
    address would break), and both calls, in either order, agree with the reference."""
    calls = (
        (anymla.flash_mla_sparse_fwd, prefill_inputs(3, 16, 512, 200, 64, seed=5, device=device), "kv", "sparse_prefill"),
        (anymla.flash_mla_with_kvcache, dict(dense_decode_inputs(2, 1, 64, 1, 200, page=64, seed=6, device=device),
                                            tile_scheduler_metadata=None), "k_cache", "dense_decode"),
    )
    for fn, args, cache, op in calls:
        moved = dict(args, **{cache: _shifted(args[cache])})
        assert anymla.explain(fn, **args, backend=tier) is not anymla.explain(fn, **moved, backend=tier)
        for call in (args, moved, args):
            compare_outputs(op, fn(**call, backend=tier), fn(**call, backend="reference"), scale=_scale(tier))


def test_one_metadata_object_serves_block_tables_of_other_widths(device):
    """FlashMLA's configuration leaves the block table's width out, and the split count can depend on it: the
    workspaces a metadata object keeps must follow the split count of each call, not the first one's."""
    meta, _ = anymla.get_mla_metadata()
    wide = dense_decode_inputs(1, 1, 4, 1, 512, page=64, seed=4, device=device)  # 8 blocks a row
    narrow = dict(wide, block_table=wide["block_table"][:, :4].contiguous(),
                  cache_seqlens=wide["cache_seqlens"].clamp(max=256))  # 4 blocks a row
    for args in (wide, narrow, wide):
        for tier in TIERS:
            got = anymla.flash_mla_with_kvcache(**args, tile_scheduler_metadata=meta, backend=tier)
            compare_outputs("dense_decode", got, anymla.flash_mla_with_kvcache(**args, tile_scheduler_metadata=None,
                                                                               backend="reference"),
                            scale=_scale(tier))
    if "triton" in TIERS:
        splits = {anymla.explain(anymla.flash_mla_with_kvcache, **a, tile_scheduler_metadata=None,
                                 backend="triton").plan.num_splits for a in (wide, narrow)}
        assert len(splits) == 2 and min(splits) > 1, f"the case needs two split counts above 1, got {splits}"


@pytest.mark.parametrize("tier", TIERS)
def test_a_prefill_with_no_kv_row_gives_every_token_the_empty_result(tier, device):
    """s_kv 0: no row to attend (the Triton tier launches nothing): out 0, max_logits -inf, lse +inf."""
    args = prefill_inputs(3, 4, 512, 0, 8, seed=5, device=device)
    out, max_logits, lse = anymla.flash_mla_sparse_fwd(**args, backend=tier)
    assert out.shape == (3, 4, 512) and torch.equal(out, torch.zeros_like(out))
    assert bool((max_logits == -math.inf).all()) and bool((lse == math.inf).all())
    compare_outputs("sparse_prefill", (out, max_logits, lse),
                    anymla.flash_mla_sparse_fwd(**args, backend="reference"))


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("h_q", [16, 64])
def test_repeated_dense_calls_follow_the_cache_they_are_given(tier, h_q, device):
    """Later calls of a signature launch directly, with the tensor-memory descriptors of the cache encoded
    once: a second cache of the same shape must be read, not the first one's descriptors (GPU: the portable
    kernel at 16 heads, the Hopper one at 64)."""
    first = dense_decode_inputs(2, 1, h_q, 1, 200, page=64, seed=6, device=device)
    second = dict(first, k_cache=torch.randn_like(first["k_cache"]))
    meta, _ = anymla.get_mla_metadata()
    for args in (first, first, second, second, first):
        got = anymla.flash_mla_with_kvcache(**args, tile_scheduler_metadata=meta, backend=tier)
        compare_outputs("dense_decode", got, anymla.flash_mla_with_kvcache(**args, tile_scheduler_metadata=None,
                                                                           backend="reference"), scale=_scale(tier))
