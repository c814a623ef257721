"""The PyTorch reference (the oracle of every other test) against a second, naive float64 oracle written here,
and the semantic facts of the contract (sections 2 and 9) checked on the reference itself.

The naive oracle loops over tokens, heads and keys with plain exp/log: no chunking, no masking tricks, no
shared code with ``anymla.reference`` except the KV-cache codec (tested on its own in test_kvcache.py).
"""

import math
import zlib

import pytest
import torch

import anymla
import anymla.reference
from anymla.kvcache import KVCacheFormat, dequantize
from anymla.testing import dense_decode_inputs, prefill_inputs, sparse_decode_inputs

F = KVCacheFormat
REF = dict(backend="reference")
INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1


# ---------------------------------------------------------------- the naive oracle

def naive_attention(q_heads, keys, sm_scale, sinks):
    """q_heads: list of [D] float64 (one per head); keys: list of [D] float64 rows this token may attend to;
    sinks: list of floats or None.  Returns (out [H, 512], lse [H], max_logit [H]) float64."""
    outs, lses, maxes = [], [], []
    for h, qh in enumerate(q_heads):
        logits = [sm_scale * float(torch.dot(qh, k)) for k in keys]
        if not logits:
            outs.append(torch.zeros(512, dtype=torch.float64))
            lses.append(math.inf)
            maxes.append(-math.inf)
            continue
        m = max(logits)
        lse = m + math.log(sum(math.exp(x - m) for x in logits))
        out = torch.zeros(512, dtype=torch.float64)
        for x, k in zip(logits, keys):
            out += math.exp(x - lse) * k[:512]
        if sinks is not None:
            out *= 1.0 / (1.0 + math.exp(sinks[h] - lse))
        outs.append(out)
        lses.append(lse)
        maxes.append(m)
    return torch.stack(outs), torch.tensor(lses, dtype=torch.float64), torch.tensor(maxes, dtype=torch.float64)


def naive_prefill(a):
    q, kv, idx = a["q"].double().cpu(), a["kv"].double().cpu(), a["indices"].cpu()
    s_q, h_q, _ = q.shape
    s_kv, h_kv, _ = kv.shape
    group = h_q // h_kv
    sink = None if a["attn_sink"] is None else a["attn_sink"].tolist()
    length = None if a["topk_length"] is None else a["topk_length"].tolist()
    out = torch.zeros(s_q, h_q, 512, dtype=torch.float64)
    lse = torch.zeros(s_q, h_q, dtype=torch.float64)
    mx = torch.zeros(s_q, h_q, dtype=torch.float64)
    for t in range(s_q):
        for g in range(h_kv):
            keys = [kv[i, g] for pos, i in enumerate(idx[t, g].tolist())
                    if 0 <= i < s_kv and (length is None or pos < length[t])]
            heads = range(g * group, (g + 1) * group)
            o, l, m = naive_attention([q[t, h] for h in heads], keys, a["sm_scale"],
                                      None if sink is None else sink[g * group:(g + 1) * group])
            out[t, heads], lse[t, heads], mx[t, heads] = o, l, m
    return out, mx, lse


def cache_rows(cache):
    """Every cache slot's latent row, float64 ``[num_blocks * page, d]`` (slot = block * page + offset)."""
    rows = dequantize(cache) if cache.dtype not in (torch.bfloat16, torch.float16) else cache
    return rows[:, :, 0].double().cpu().reshape(-1, rows.shape[-1])


def naive_sparse_decode(a):
    q = a["q"].double().cpu()
    b, s_q, h_q, _ = q.shape
    sources = [(cache_rows(a["k_cache"]), a["indices"].cpu(), a["topk_length"])]
    if a.get("extra_k_cache") is not None:
        extra_idx = a["extra_indices_in_kvcache"].cpu()
        sources.append((cache_rows(a["extra_k_cache"]), extra_idx, a.get("extra_topk_length")))
    sink = None if a["attn_sink"] is None else a["attn_sink"].tolist()
    scale = a.get("softmax_scale") or q.shape[-1] ** -0.5
    out = torch.zeros(b, s_q, h_q, 512, dtype=torch.float64)
    lse = torch.zeros(b, h_q, s_q, dtype=torch.float64)
    for i in range(b):
        for t in range(s_q):
            keys = []
            for rows, idx, length in sources:
                n = None if length is None else int(length[i])
                keys += [rows[s] for pos, s in enumerate(idx[i, t].tolist())
                         if 0 <= s < rows.shape[0] and (n is None or pos < n)]
            o, l, _ = naive_attention([q[i, t, h] for h in range(h_q)], keys, scale, sink)
            out[i, t], lse[i, :, t] = o, l
    return out, lse


def naive_dense_decode(a):
    q, cache, table = a["q"].double().cpu(), a["k_cache"].double().cpu(), a["block_table"].cpu()
    b, s_q, h_q, d = q.shape
    page, h_kv = cache.shape[1], cache.shape[2]
    group = h_q // h_kv
    sink = None if a["attn_sink"] is None else a["attn_sink"].tolist()
    out = torch.zeros(b, s_q, h_q, 512, dtype=torch.float64)
    lse = torch.zeros(b, h_q, s_q, dtype=torch.float64)
    for i in range(b):
        s_k = int(a["cache_seqlens"][i])
        for t in range(s_q):
            last = s_k - 1 if not (a["causal"] and s_q > 1) else s_k - s_q + t  # tril(diagonal = s_k - s_q)
            for g in range(h_kv):
                keys = [cache[int(table[i, j // page]), j % page, g] for j in range(s_k) if j <= last]
                heads = range(g * group, (g + 1) * group)
                o, l, _ = naive_attention([q[i, t, h] for h in heads], keys, d ** -0.5,
                                          None if sink is None else sink[g * group:(g + 1) * group])
                out[i, t, heads], lse[i, heads, t] = o, l
    return out, lse


def assert_matches_oracle(name, got, oracle, *, rtol, atol):
    """Equal inf/NaN positions; elsewhere |got - oracle| <= atol + rtol |oracle|."""
    got = got.double().cpu()
    for f in (torch.isnan, torch.isposinf, torch.isneginf):
        assert torch.equal(f(got), f(oracle)), f"{name}: {f.__name__} positions differ"
    fin = torch.isfinite(oracle)
    err = (got[fin] - oracle[fin]).abs()
    bound = atol + rtol * oracle[fin].abs()
    assert (err <= bound).all(), f"{name}: worst excess {(err - bound).max().item():.3g}"


OUT_TOL = dict(rtol=2 ** -8, atol=1e-5)  # bf16 output: one rounding of an fp32 result
F32_TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 lse / max_logits


# ---------------------------------------------------------------- reference vs naive oracle

PREFILL_CASES = {
    "basic": dict(s_q=3, h_q=4, d_qk=576, s_kv=20, topk=8),
    "d512-sink-len": dict(s_q=3, h_q=3, d_qk=512, s_kv=20, topk=12, sink=True, topk_length=True),
    "topk>s_kv-shuffled": dict(s_q=2, h_q=2, d_qk=576, s_kv=5, topk=9, shuffle_invalid=True),
    "h_kv2": dict(s_q=2, h_q=4, d_qk=512, s_kv=12, topk=6, h_kv=2, sink=True),
    "all-invalid-rows": dict(s_q=4, h_q=2, d_qk=512, s_kv=10, topk=4, all_invalid_rows=True, topk_length=True),
}


@pytest.mark.parametrize("case", PREFILL_CASES.values(), ids=PREFILL_CASES.keys())
def test_reference_prefill_matches_naive_oracle(case, device):
    c = dict(case)
    a = prefill_inputs(c.pop("s_q"), c.pop("h_q"), c.pop("d_qk"), c.pop("s_kv"), c.pop("topk"), device=device,
                       seed=zlib.crc32(repr(case).encode()), **c)
    out, mx, lse = anymla.flash_mla_sparse_fwd(**a, **REF)
    o_out, o_mx, o_lse = naive_prefill(a)
    assert_matches_oracle("out", out, o_out, **OUT_TOL)
    assert_matches_oracle("max_logits", mx, o_mx, **F32_TOL)
    assert_matches_oracle("lse", lse, o_lse, **F32_TOL)


SPARSE_CASES = {
    "v32": dict(fmt=F.V32_FP8, b=2, s_q=2, h_q=4, s_k=30, topk=8, page=4),
    "model1-sink": dict(fmt=F.MODEL1_FP8, b=2, s_q=1, h_q=3, s_k=30, topk=8, page=5, sink=True),
    "v41-len-extra-fp4": dict(fmt=F.V41_FP8, b=2, s_q=2, h_q=2, s_k=20, topk=6, page=3, topk_length=True, sink=True,
                              extra=dict(fmt=F.V41_FP4, page=2, s_k=10, topk=5, topk_length=True)),
    "bf16-extra-bf16": dict(fmt=F.BF16, b=2, s_q=1, h_q=2, s_k=20, topk=6, page=7,
                            extra=dict(fmt=F.BF16, page=1, s_k=9, topk=4)),
    "model1-extra-model1-shuffled": dict(fmt=F.MODEL1_FP8, b=3, s_q=1, h_q=2, s_k=6, topk=9, page=2,
                                         shuffle_invalid=True, extra=dict(fmt=F.MODEL1_FP8, page=3, s_k=4, topk=6)),
}


@pytest.mark.parametrize("case", SPARSE_CASES.values(), ids=SPARSE_CASES.keys())
def test_reference_sparse_decode_matches_naive_oracle(case, device):
    c = dict(case)
    a = sparse_decode_inputs(c.pop("b"), c.pop("s_q"), c.pop("h_q"), c.pop("s_k"), c.pop("topk"), device=device,
                             seed=zlib.crc32(repr(case).encode()), **c)
    out, lse = anymla.flash_mla_with_kvcache(**a, tile_scheduler_metadata=None, **REF)
    o_out, o_lse = naive_sparse_decode(a)
    assert_matches_oracle("out", out, o_out, **OUT_TOL)
    assert_matches_oracle("lse", lse, o_lse, **F32_TOL)


DENSE_CASES = {
    "gqa": dict(b=2, s_q=1, h_q=4, h_kv=2, s_k=9, page=4, varlen=True),
    "gqa-causal": dict(b=2, s_q=3, h_q=6, h_kv=3, s_k=7, page=3, causal=True, varlen=True),
    "causal-s_k<s_q": dict(b=2, s_q=4, h_q=2, h_kv=1, s_k=2, page=1, causal=True),
    "d512-sink-zero-len": dict(b=3, s_q=2, h_q=2, h_kv=1, s_k=5, page=2, d_qk=512, sink=True, zero_len_frac=0.5),
    "fp16": dict(b=1, s_q=2, h_q=4, h_kv=4, s_k=6, page=5, dtype=torch.float16),
}


@pytest.mark.parametrize("case", DENSE_CASES.values(), ids=DENSE_CASES.keys())
def test_reference_dense_decode_matches_naive_oracle(case, device):
    c = dict(case)
    a = dense_decode_inputs(c.pop("b"), c.pop("s_q"), c.pop("h_q"), c.pop("h_kv"), c.pop("s_k"), device=device,
                            seed=zlib.crc32(repr(case).encode()), **c)
    out, lse = anymla.flash_mla_with_kvcache(**a, tile_scheduler_metadata=None, **REF)
    o_out, o_lse = naive_dense_decode(a)
    assert out.dtype == a["q"].dtype
    assert_matches_oracle("out", out, o_out, rtol=2 ** -8 if out.dtype == torch.bfloat16 else 2 ** -11, atol=1e-5)
    assert_matches_oracle("lse", lse, o_lse, **F32_TOL)


def test_causal_with_fewer_keys_than_queries_leaves_leading_queries_empty(device):
    a = dense_decode_inputs(1, 4, 2, 1, 2, page=2, causal=True, device=device, seed=1)
    out, lse = anymla.flash_mla_with_kvcache(**a, tile_scheduler_metadata=None, **REF)
    # s_k = 2, s_q = 4: query t sees keys j <= t - 2, so queries 0 and 1 see nothing.
    assert torch.equal(out[0, :2], torch.zeros_like(out[0, :2])) and torch.isposinf(lse[0, :, :2]).all()
    assert torch.isfinite(lse[0, :, 2:]).all()


# ---------------------------------------------------------------- empty rows

def test_prefill_token_without_valid_index_gives_zero_out_inf_lse_and_neg_inf_max(device):
    a = prefill_inputs(3, 4, 512, 16, 8, device=device, seed=11)
    a["indices"][1] = -1
    a["indices"][2, :, :] = 16  # == s_kv: invalid too
    out, mx, lse = anymla.flash_mla_sparse_fwd(**a, **REF)
    for t in (1, 2):
        assert torch.equal(out[t], torch.zeros_like(out[t]))
        assert torch.isposinf(lse[t]).all() and torch.isneginf(mx[t]).all()
    assert torch.isfinite(lse[0]).all() and torch.isfinite(out[0].float()).all()


@pytest.mark.parametrize("how", ["all-minus-one", "topk_length-0", "main-empty-extra-not"])
def test_sparse_decode_request_without_valid_index_is_empty(how, device):
    extra = dict(fmt=F.V41_FP8, page=2, s_k=8, topk=4, topk_length=True)
    a = sparse_decode_inputs(2, 2, 3, 10, 6, fmt=F.V41_FP8, page=4, topk_length=True, extra=extra, device=device,
                             seed=12, poison=False)  # lengths are overridden below
    if how == "all-minus-one":
        a["indices"][0] = -1
        a["extra_indices_in_kvcache"][0] = -1
    elif how == "topk_length-0":
        a["topk_length"][0] = 0
        a["extra_topk_length"][0] = 0
    else:  # main keys empty but the extra cache still counts: not empty
        a["topk_length"][0] = 0
        a["extra_topk_length"][0] = 4
    out, lse = anymla.flash_mla_with_kvcache(**a, tile_scheduler_metadata=None, **REF)
    if how == "main-empty-extra-not":
        assert torch.isfinite(lse[0]).all()
        o_out, o_lse = naive_sparse_decode(a)
        assert_matches_oracle("out", out, o_out, **OUT_TOL)
        return
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isposinf(lse[0]).all()


def test_dense_decode_zero_length_request_is_empty(device):
    a = dense_decode_inputs(3, 2, 4, 1, 6, page=3, device=device, seed=13)
    a["cache_seqlens"][1] = 0
    out, lse = anymla.flash_mla_with_kvcache(**a, tile_scheduler_metadata=None, **REF)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isposinf(lse[1]).all()
    assert torch.isfinite(lse[[0, 2]]).all()


# ---------------------------------------------------------------- attention sink

def with_sink(a, values):
    return dict(a, attn_sink=torch.tensor(values, dtype=torch.float32, device=a["q"].device))


def test_sink_plus_inf_zeroes_out_minus_inf_is_a_no_op_and_lse_ignores_the_sink(device):
    a = prefill_inputs(3, 4, 576, 20, 8, device=device, seed=20)
    base = anymla.flash_mla_sparse_fwd(**a, **REF)
    mixed = anymla.flash_mla_sparse_fwd(**with_sink(a, [math.inf, -math.inf, 0.3, -2.0]), **REF)
    out, mx, lse = mixed
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0])), "sink +inf -> out 0"
    assert torch.equal(out[:, 1], base[0][:, 1]), "sink -inf -> no effect"
    assert torch.equal(lse, base[2]) and torch.equal(mx, base[1]), "lse and max_logits exclude the sink"
    # A finite sink scales out by 1 / (1 + exp(sink - lse)).
    factor = 1 / (1 + torch.exp(torch.tensor([0.3, -2.0], device=device) - base[2][:, 2:].double()))
    expected = base[0][:, 2:].double() * factor[..., None]
    err = (out[:, 2:].double() - expected).abs()
    assert (err <= 2 ** -7 * expected.abs() + 1e-5).all()


def test_sink_in_decode_keeps_lse_and_follows_the_sink_formula(device):
    a = sparse_decode_inputs(2, 1, 3, 20, 8, fmt=F.V32_FP8, page=4, device=device, seed=21)
    base_out, base_lse = anymla.flash_mla_with_kvcache(**a, tile_scheduler_metadata=None, **REF)
    out, lse = anymla.flash_mla_with_kvcache(**with_sink(a, [math.inf, -math.inf, 0.5]),
                                             tile_scheduler_metadata=None, **REF)
    assert torch.equal(lse, base_lse)
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    assert torch.equal(out[:, :, 1], base_out[:, :, 1])
    assert not torch.equal(out[:, :, 2], base_out[:, :, 2])


def test_sink_on_an_empty_row_keeps_it_empty(device):
    a = prefill_inputs(2, 2, 512, 10, 4, device=device, seed=22)
    a["indices"][0] = -1
    out, mx, lse = anymla.flash_mla_sparse_fwd(**with_sink(a, [-1.0, -math.inf]), **REF)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isposinf(lse[0]).all()


# ---------------------------------------------------------------- topk_length

def test_prefill_topk_length_equals_masking_the_tail_indices(device):
    a = prefill_inputs(4, 2, 576, 30, 10, device=device, seed=30, poison=False)  # lengths set below
    a["topk_length"] = torch.tensor([0, 3, 10, 7], dtype=torch.int32, device=device)
    masked = a["indices"].clone()
    for t, n in enumerate(a["topk_length"].tolist()):
        masked[t, :, n:] = -1
    got = anymla.flash_mla_sparse_fwd(**a, **REF)
    expected = anymla.flash_mla_sparse_fwd(**dict(a, indices=masked, topk_length=None), **REF)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_decode_topk_length_equals_masking_the_tail_indices(device):
    extra = dict(fmt=F.V41_FP4, page=3, s_k=12, topk=6, topk_length=True)
    a = sparse_decode_inputs(3, 2, 2, 16, 8, fmt=F.V41_FP8, page=4, topk_length=True, extra=extra, device=device,
                             seed=31, poison=False)  # lengths are overridden below
    a["topk_length"] = torch.tensor([8, 2, 0], dtype=torch.int32, device=device)
    a["extra_topk_length"] = torch.tensor([1, 6, 3], dtype=torch.int32, device=device)
    masked = dict(a, topk_length=None, extra_topk_length=None, indices=a["indices"].clone(),
                  extra_indices_in_kvcache=a["extra_indices_in_kvcache"].clone())
    for i in range(3):
        masked["indices"][i, :, int(a["topk_length"][i]):] = -1
        masked["extra_indices_in_kvcache"][i, :, int(a["extra_topk_length"][i]):] = -1
    got = anymla.flash_mla_with_kvcache(**a, tile_scheduler_metadata=None, **REF)
    expected = anymla.flash_mla_with_kvcache(**masked, tile_scheduler_metadata=None, **REF)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


# ---------------------------------------------------------------- invalid indices

PREFILL_INVALID = (INT32_MIN, -123456, -1, "s_kv", 114514, 1919810, 2147480000, INT32_MAX)


@pytest.mark.parametrize("bad", PREFILL_INVALID, ids=str)
def test_prefill_skips_every_invalid_index_value(bad, device):
    s_kv = 24
    a = prefill_inputs(3, 2, 512, s_kv, 8, device=device, seed=40)
    value = s_kv if bad == "s_kv" else bad
    # Invalid entries leading, in the middle and trailing; token 2 is entirely invalid.
    a["indices"][0, 0, 0] = value
    a["indices"][1, 0, 3:5] = value
    a["indices"][1, 0, -1] = value
    a["indices"][2] = value
    out, mx, lse = anymla.flash_mla_sparse_fwd(**a, **REF)
    o_out, o_mx, o_lse = naive_prefill(a)
    assert_matches_oracle("out", out, o_out, **OUT_TOL)
    assert_matches_oracle("lse", lse, o_lse, **F32_TOL)
    assert_matches_oracle("max_logits", mx, o_mx, **F32_TOL)
    assert torch.isposinf(lse[2]).all()


@pytest.mark.parametrize("fmt", (F.V32_FP8, F.MODEL1_FP8, F.V41_FP8, F.BF16), ids=lambda f: f.name)
def test_decode_skips_out_of_range_indices(fmt, device):
    a = sparse_decode_inputs(2, 1, 2, 12, 8, fmt=fmt, page=4, device=device, seed=41)
    n_slots = a["k_cache"].shape[0] * a["k_cache"].shape[1]
    a["indices"][0, 0, :4] = torch.tensor([n_slots, n_slots + 7, INT32_MAX, -2], dtype=torch.int32)
    a["indices"][1, 0, 1] = INT32_MIN
    out, lse = anymla.flash_mla_with_kvcache(**a, tile_scheduler_metadata=None, **REF)
    o_out, o_lse = naive_sparse_decode(a)
    assert_matches_oracle("out", out, o_out, **OUT_TOL)
    assert_matches_oracle("lse", lse, o_lse, **F32_TOL)


# ---------------------------------------------------------------- NaN hygiene

def test_nan_in_unreferenced_prefill_rows_never_leaks(device):
    a = prefill_inputs(3, 4, 576, 40, 10, topk_length=True, device=device, seed=50, poison=False)
    a["topk_length"] = torch.tensor([10, 4, 0], dtype=torch.int32, device=device)
    used = torch.zeros(40, dtype=torch.bool)
    for t, n in enumerate(a["topk_length"].tolist()):
        row = a["indices"][t, 0, :n].cpu()
        used[row[(row >= 0) & (row < 40)].long()] = True
    clean = anymla.flash_mla_sparse_fwd(**a, **REF)
    dirty_kv = a["kv"].clone()
    dirty_kv[~used.to(device)] = float("nan")  # includes rows read only past topk_length
    dirty = anymla.flash_mla_sparse_fwd(**dict(a, kv=dirty_kv), **REF)
    for c, d in zip(clean, dirty):
        assert torch.equal(c, d)


def test_nan_in_unreferenced_decode_rows_and_scales_never_leaks(device):
    a = sparse_decode_inputs(2, 2, 2, 20, 6, fmt=F.V32_FP8, page=4, topk_length=True, device=device, seed=51,
                             poison=False)
    clean = anymla.flash_mla_with_kvcache(**a, tile_scheduler_metadata=None, **REF)
    n_blocks, page = a["k_cache"].shape[:2]
    used = torch.zeros(n_blocks * page, dtype=torch.bool)
    for i in range(2):
        row = a["indices"][i, :, :int(a["topk_length"][i])].cpu().flatten()
        used[row[row >= 0].long()] = True
    dirty_cache = a["k_cache"].clone()
    flat = dirty_cache.view(n_blocks * page, 656)
    flat[~used.to(device)] = 0xFF  # e4m3 NaN data and NaN fp32 scales
    dirty = anymla.flash_mla_with_kvcache(**dict(a, k_cache=dirty_cache), tile_scheduler_metadata=None, **REF)
    assert torch.isfinite(dirty[0].float()).all()
    assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])


# ---------------------------------------------------------------- chunking

def test_reference_chunking_gives_the_same_result(monkeypatch):
    """A tiny gather budget makes the reference process one token at a time; results must not change.
    (On the CPU, where the per-token arithmetic is the same whatever the chunk.)"""
    pre = prefill_inputs(5, 4, 512, 30, 12, sink=True, topk_length=True, seed=60)
    dec = sparse_decode_inputs(3, 2, 4, 20, 8, fmt=F.V41_FP8, page=3, topk_length=True, sink=True, seed=61,
                               extra=dict(fmt=F.V41_FP4, page=2, s_k=10, topk=4))
    whole = (anymla.flash_mla_sparse_fwd(**pre, **REF),
             anymla.flash_mla_with_kvcache(**dec, tile_scheduler_metadata=None, **REF))
    assert anymla.reference._token_chunk(12, 512) >= 5  # the default budget covers every token at once
    monkeypatch.setattr(anymla.reference, "_GATHER_BUDGET_BYTES", 1)
    assert anymla.reference._token_chunk(12, 512) == 1
    chunked = (anymla.flash_mla_sparse_fwd(**pre, **REF),
               anymla.flash_mla_with_kvcache(**dec, tile_scheduler_metadata=None, **REF))
    for w, c in zip(whole[0] + whole[1], chunked[0] + chunked[1]):
        assert torch.equal(w, c)
