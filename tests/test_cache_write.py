"""The cache writer and the prolog kernels against their PyTorch references (Triton in the interpreter on
a CPU): byte-identical cache writes in every format, the fused prolog and the q assembly within rounding,
the DSA indices' cache slots exactly."""

import pytest
import torch

from anymla import kvcache
from anymla.kvcache import KVCacheFormat as F
from anymla.layers import (RopeTable, assemble_q, assemble_q_reference, explain_write_cache, kernels, mla_prolog,
                           mla_prolog_reference, sparse_slots, write_cache, write_cache_reference)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRITON = kernels.choose(DEVICE)[0] == "triton"
needs_triton = pytest.mark.skipif(not TRITON, reason=kernels.choose(DEVICE)[1])
FORMATS = [F.BF16, F.V32_FP8, F.MODEL1_FP8, F.V41_FP8, F.V41_FP4]
POISON = 0xA5


def _rows(n: int, d: int, dtype, g) -> torch.Tensor:
    """Rows with tiles of very different magnitudes (scales from 2^-12 to 2^8), a zero row and a row whose
    tile maxima are exact powers of two times 448 (scale boundaries)."""
    x = torch.randn(n, d, generator=g) * torch.exp2(torch.randint(-12, 9, (n, d // 16), generator=g).float()
                                                    ).repeat_interleave(16, 1)
    x[0] = 0
    x[1] = torch.randn(d, generator=g) * 0.1
    x[1, ::32] = 448.0 * 2.0 ** -5
    return x.to(dtype).to(DEVICE)


def _empty_cache(fmt: F, nb: int, page: int, d: int, pad_blocks: bool = False) -> torch.Tensor:
    """A poisoned cache laid out as anymla.kvcache.quantize lays it (optionally with padded blocks)."""
    if fmt is F.BF16:
        raw = torch.full((nb, page + pad_blocks, 1, d), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        return raw[:, :page]
    like = kvcache.quantize(torch.zeros(nb, page, 1, fmt.spec.d_qk, device=DEVICE), fmt)
    block = like.stride(0) + (656 if pad_blocks else 0)
    raw = torch.full((nb * block,), POISON, dtype=torch.uint8, device=DEVICE)
    return raw.as_strided(like.shape, (block,) + like.stride()[1:])


def _storage(cache: torch.Tensor) -> torch.Tensor:
    return torch.as_strided(cache.view(torch.uint8), (cache.untyped_storage().nbytes(),), (1,), 0)


@needs_triton
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_writer_matches_reference_and_quantize(fmt, dtype):
    g = torch.Generator().manual_seed(1)
    nb, page = 4, 5
    d = 576 if fmt in (F.BF16, F.V32_FP8) else 512
    rows = _rows(nb * page, d, dtype, g)
    slots = torch.randperm(nb * page, generator=g).to(DEVICE)
    ours, ref = _empty_cache(fmt, nb, page, d), _empty_cache(fmt, nb, page, d)
    write_cache(ours, rows[slots], slots)
    write_cache_reference(ref, rows[slots], slots)
    assert torch.equal(_storage(ours), _storage(ref))
    # every slot written: the cache is quantize() of the rows in slot order (bf16: the rows rounded)
    if fmt is F.BF16:
        assert torch.equal(ours, rows.view(nb, page, 1, d).to(torch.bfloat16))
    else:
        whole = kvcache.quantize(rows.view(nb, page, 1, d), fmt)
        # MODEL1 blocks end in padding that quantize() zeroes and a writer leaves alone: compare the fields
        used = page * fmt.spec.bytes_per_token
        blocks = lambda c: _storage(c).view(nb, c.stride(0))[:, :used]  # noqa: E731
        assert torch.equal(blocks(ours), blocks(whole))


_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_BELOW_6 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0)


def _fp4_tie_rows(n: int, dtype, g) -> torch.Tensor:
    """Rows of 32 FP4 tiles built on their scales: a tile's amax is 6 s for an e4m3 value s (any, subnormals
    too), so s is its scale; its other elements are the midpoints m * s between e2m1 values (ties) and the
    values themselves, each exact or one ulp of ``dtype`` above or below, with random signs (-0.0 for zeros).
    Tile k with k % 17 = 1 saturates (amax 6.5 s), = 2 has its scale clamped at 448, = 3, 4, 5 holds inf,
    -inf, NaN, = 6 is zeros and -0.0, = 7 is scaled down to a scale clamped at 2^-9."""
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    scales = e4m3[(e4m3 >= 2.0 ** -9) & (e4m3 <= 448)]
    tiles = n * 32
    s = scales[torch.randint(len(scales), (tiles, 1), generator=g)]
    kind = torch.arange(tiles)[:, None] % 17
    s = torch.where(kind == 2, 448.0, s)
    grid = torch.tensor(_E2M1_MIDPOINTS + _E2M1_BELOW_6)
    x = (grid[torch.randint(len(grid), (tiles, 16), generator=g)] * s).to(dtype)
    step = torch.randint(-1, 2, x.shape, generator=g)
    x = torch.where(step > 0, torch.nextafter(x, torch.full_like(x, float("inf"))),
                    torch.where(step < 0, torch.nextafter(x, torch.zeros_like(x)), x))
    amax_at = torch.nn.functional.one_hot(torch.randint(16, (tiles,), generator=g), 16).bool()
    x = torch.where(amax_at, (torch.where(kind == 1, 6.5, 6.0) * s).to(dtype), x)
    x = torch.where(kind == 2, x * 4, x)  # amax 24 * 448: most codes saturate
    x = torch.where(kind == 6, torch.zeros_like(x), x)
    x = torch.where(kind == 7, x * 2.0 ** -12, x)
    x = torch.where(torch.randint(0, 2, x.shape, generator=g).bool(), -x, x)
    for k, special in ((3, float("inf")), (4, -float("inf")), (5, float("nan"))):
        x = torch.where((kind == k) & amax_at.roll(1, 1), torch.tensor(special, dtype=dtype), x)
    return x.reshape(n, 512).to(DEVICE)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_fp4_writer_at_ties_and_special_values(dtype):
    """The FP4 writer compares values with midpoint-times-scale thresholds where quantize() rounds a quotient:
    the same bytes on ties, their one-ulp neighbours (fp32 ones the closest), signs, zeros, -0.0, saturation,
    clamped scales, inf and NaN."""
    g = torch.Generator().manual_seed(8)
    nb, page = 6, 8
    rows = _fp4_tie_rows(nb * page, dtype, g)
    slots = torch.randperm(nb * page, generator=g).to(DEVICE)
    ours, ref = _empty_cache(F.V41_FP4, nb, page, 512), _empty_cache(F.V41_FP4, nb, page, 512)
    write_cache(ours, rows[slots], slots)
    write_cache_reference(ref, rows[slots], slots)
    assert torch.equal(_storage(ours), _storage(ref))
    # the rows probe what they are meant to: a tie in about one element of ten, every code (but 8: a zero
    # is written unsigned)
    q = kvcache.quantize(rows.view(nb, page, 1, 512), F.V41_FP4).view(-1, 288)
    s = q[:, 256:].contiguous().view(torch.float8_e4m3fn).float().repeat_interleave(16, 1)
    ties = sum((rows.float().abs() == m * s) for m in _E2M1_MIDPOINTS)
    assert ties.float().mean() > 0.08
    codes = torch.stack([q[:, :256] & 0xF, q[:, :256] >> 4])
    assert set(codes.unique().tolist()) == set(range(16)) - {8}


def test_e2m1_thresholds_order_as_the_rounded_quotient():
    """The FP4 writer's premise (kernel.e2m1_code): for every e4m3 scale s and e2m1 midpoint m, fl(x / s)
    compares with m as x does with m * s, for the fp32 values within 1000 ulps of m * s (past them both sides
    are far from a tie)."""
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    s = e4m3[(e4m3 >= 2.0 ** -9) & (e4m3 <= 448)]
    m = torch.tensor(_E2M1_MIDPOINTS).repeat_interleave(len(s))[:, None]
    s = s.repeat(len(_E2M1_MIDPOINTS))[:, None]
    t = m * s
    assert torch.equal(t.double(), m.double() * s.double())  # exact
    x = (t.view(torch.int32) + torch.arange(-1000, 1001)).view(torch.float32)
    assert torch.equal(x / s > m, x > t) and torch.equal(x / s >= m, x >= t)


@needs_triton
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_writer_skips_invalid_slots_and_keeps_other_bytes(fmt):
    g = torch.Generator().manual_seed(2)
    nb, page = 3, 7
    d = 576 if fmt in (F.BF16, F.V32_FP8) else 512
    rows = _rows(9, d, torch.bfloat16, g)
    slots = torch.tensor([3, -1, 20, nb * page, 0, -7, 11, 2 ** 30, 14], device=DEVICE)
    ours, ref = _empty_cache(fmt, nb, page, d, pad_blocks=True), _empty_cache(fmt, nb, page, d, pad_blocks=True)
    before = _storage(ours).clone()
    write_cache(ours, rows, slots.int())
    write_cache_reference(ref, rows, slots)
    assert torch.equal(_storage(ours), _storage(ref))
    valid = slots[(slots >= 0) & (slots < nb * page)]
    got = kvcache.gather_rows(ours, valid)
    if fmt is F.BF16:
        got, want = got[:, 0], rows[(slots >= 0) & (slots < nb * page)].to(torch.bfloat16)
    else:
        want = kvcache.quantize(rows[(slots >= 0) & (slots < nb * page)].view(-1, 1, 1, d), fmt)
        want = kvcache.dequantize(want)[:, 0, 0]
    assert torch.equal(got, want)
    changed = (_storage(ours) != before).sum().item()
    per_token = fmt.spec.bytes_per_token if fmt.is_quantized else 2 * d
    assert 0 < changed <= len(valid) * per_token  # nothing outside the valid slots' fields was touched


def test_writer_errors_name_the_argument():
    cache = torch.zeros(2, 4, 1, 656, dtype=torch.uint8)
    with pytest.raises(ValueError, match="latent"):
        write_cache(cache, torch.zeros(3, 512), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="slots"):
        write_cache(cache, torch.zeros(3, 576), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(TypeError, match="slots"):
        write_cache(cache, torch.zeros(3, 576), torch.zeros(3))
    with pytest.raises(ValueError, match="cache"):
        write_cache(torch.zeros(2, 4, 1, 600, dtype=torch.uint8), torch.zeros(3, 576),
                    torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="backend"):
        write_cache(cache, torch.zeros(3, 576), torch.zeros(3, dtype=torch.int32), backend="cuda")
    huge = torch.empty(656, dtype=torch.uint8).as_strided((1 << 25, 64, 1, 656), (0, 0, 0, 1))  # 2^31 slots
    with pytest.raises(ValueError, match="2\\^31"):
        write_cache(huge, torch.zeros(1, 576), torch.zeros(1, dtype=torch.int32))


def test_explain_names_the_choice():
    text = explain_write_cache(DEVICE)
    assert ("triton" if TRITON else "torch") in text
    assert "torch (forced" in explain_write_cache(DEVICE, "torch")


def _table(style: str) -> RopeTable:
    params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32,
              "mscale": 1.0, "mscale_all_dim": 0.7}
    return RopeTable.build(64, params, 300, style, 256, DEVICE)


@needs_triton
@pytest.mark.parametrize("fmt", [F.BF16, F.V32_FP8], ids=lambda f: f.name)
@pytest.mark.parametrize("style", ["interleaved", "neox"])
@pytest.mark.parametrize("q_rank", [0, 24])
def test_prolog_matches_reference(fmt, style, q_rank):
    g = torch.Generator().manual_seed(3)
    n, nb, page = 19, 6, 4
    a = (torch.randn(n, q_rank + 576 + 8, generator=g) * 3).bfloat16().to(DEVICE)  # wider rows: strided slices
    kv_a, q_lat = a[:, q_rank:q_rank + 576], (a[:, :q_rank] if q_rank else None)
    w = (1 + 0.2 * torch.randn(576 + q_rank, generator=g)).bfloat16().to(DEVICE)
    q_w = w[512:512 + q_rank].contiguous() if q_rank else None
    pos = torch.randint(0, 300, (n,), generator=g).to(DEVICE)
    slots = torch.randperm(nb * page, generator=g)[:n].to(DEVICE)
    slots[5] = -1
    table = _table(style)
    ours, ref = _empty_cache(fmt, nb, page, 576), _empty_cache(fmt, nb, page, 576)
    q_ours = mla_prolog(kv_a, w[:512], 1e-6, pos, table, ours, slots, q_lat=q_lat, q_norm_weight=q_w)
    q_ref = mla_prolog_reference(kv_a, w[:512], 1e-6, pos, table, ref, slots, q_lat=q_lat, q_norm_weight=q_w)
    # The norms may round an element differently from torch's rsqrt (one bf16 ulp); everything else is exact.
    ulp = 2.0 ** -7
    if q_rank:
        torch.testing.assert_close(q_ours.float(), q_ref.float(), atol=0, rtol=ulp)
    else:
        assert q_ours is None and q_ref is None
    keep = slots[slots >= 0]
    got, want = kvcache.gather_rows(ours, keep, fmt).float(), kvcache.gather_rows(ref, keep, fmt).float()
    got, want = got.reshape(len(keep), 576), want.reshape(len(keep), 576)
    torch.testing.assert_close(got[:, 512:], want[:, 512:], atol=0, rtol=ulp)  # roped k_pe (bf16 in both)
    quant_ulp = ulp if fmt is F.BF16 else 2.0 ** -3
    torch.testing.assert_close(got[:, :512], want[:, :512], atol=1e-6, rtol=quant_ulp)
    assert (_storage(ours) != _storage(ref)).float().mean() < 0.01


@needs_triton
@pytest.mark.parametrize("style", ["interleaved", "neox"])
def test_assemble_q_matches_reference(style):
    g = torch.Generator().manual_seed(4)
    h, n = 5, 7
    q_nope = torch.randn(h, n, 512, generator=g).bfloat16().to(DEVICE)
    q = torch.randn(n, h, 96, generator=g).bfloat16().to(DEVICE)
    pos = torch.randint(0, 300, (n,), generator=g).to(DEVICE)
    table = _table(style)
    out = torch.full((n, h, 576), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    assemble_q(q_nope, q[..., 32:], pos, table, out=out)
    ref = assemble_q_reference(q_nope, q[..., 32:], pos, table)
    assert torch.equal(out[..., :512], ref[..., :512])
    torch.testing.assert_close(out.float(), ref.float(), atol=0, rtol=2.0 ** -7)


def test_kernels_compile_for_hopper_and_ampere_without_spills():
    """Every shipped instantiation builds for sm_90 and sm_80 with Triton's own compilers (no GPU needed)."""
    import os
    import subprocess
    import sys
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "anymla.triton_kernels.cache_write.compile_check",
                          "--arch", "90", "80"], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("sm/")]
    assert len(lines) == 32 and all(" spills    0 B" in ln and "fits" in ln for ln in lines), run.stdout


def _fenced_table() -> RopeTable:
    """``_table("interleaved")`` between NaN rows: a kernel reading outside its 300 rows gets NaN."""
    t = _table("interleaved")

    def fenced(x):
        wide = torch.full((x.shape[0] + 16, x.shape[1]), float("nan"), device=DEVICE)
        wide[8:-8] = x
        return wide[8:-8]
    return RopeTable(fenced(t.cos), fenced(t.sin), t.style)


@needs_triton
def test_the_layer_kernels_read_the_rope_table_only_at_its_rows():
    """Positions outside the RoPE table (-3, 300, 305 beside valid ones: invalid input) never make a kernel read
    past the table (NaN rows fence it): every output stays finite. With the debug checks on, they raise."""
    import anymla
    from anymla.layers.v4_kernels import run_v4_heads, run_v4_prolog
    table = _fenced_table()
    pos = torch.tensor([5, -3, 300, 17, 305, 299, 0, 42, 8, 9], device=DEVICE)
    g = torch.Generator().manual_seed(13)
    kv_a = torch.randn(10, 576, generator=g).bfloat16().to(DEVICE)
    cache = _empty_cache(F.V32_FP8, 4, 4, 576)
    slots = torch.arange(10, device=DEVICE)
    mla_prolog(kv_a, torch.ones(512, dtype=torch.bfloat16, device=DEVICE), 1e-6, pos, table, cache, slots)
    assert torch.isfinite(kvcache.gather_rows(cache, slots, F.V32_FP8).float()).all()
    q = torch.randn(10, 4, 576, generator=g).bfloat16().to(DEVICE)
    assert torch.isfinite(assemble_q(None, q[..., 512:], pos, table, out=q).float()).all()
    kv, kv_w, q_lat, q_w, _, bt = _v4_step_inputs(13)
    v4_cache = _empty_cache(F.BF16, 8, 4, 512)
    q_out = run_v4_prolog("triton", F.BF16, kv, kv_w, 1e-6, q_lat, q_w, pos, table, v4_cache, bt)
    heads = torch.randn(10, 4, 512, generator=g).bfloat16().to(DEVICE)
    for eps in (1e-6, None):
        assert torch.isfinite(run_v4_heads("triton", heads, pos, table, eps)[0].float()).all()
    assert torch.isfinite(q_out.float()).all()
    written = kvcache.cache_slots(pos.view(2, 5).clamp(0, 15), bt, 4).view(-1)[(pos >= 0) & (pos < 16)]
    assert torch.isfinite(kvcache.gather_rows(v4_cache, written, F.BF16).float()).all()
    with anymla.debug_checks(), pytest.raises(ValueError, match=r"positions: element \(1,\) is -3"):
        mla_prolog(kv_a, torch.ones(512, dtype=torch.bfloat16, device=DEVICE), 1e-6, pos, table, cache, slots)
    with anymla.debug_checks(), pytest.raises(ValueError, match=r"positions: element \(2,\) is 300.*\[0, 300\)"):
        assemble_q(None, q[..., 512:], pos.clamp(min=0), table, out=q)


V4_FORMATS = [F.BF16, F.MODEL1_FP8, F.V41_FP8, F.V41_FP4]


def _v4_step_inputs(seed: int, dtype=torch.bfloat16):
    """Two requests of 5 new tokens over a 4 x 4-slot block table (request 1's last position is past it), the
    fused [q latent | kv row] projection output (a strided view each, as the layer passes them), fp32 weights."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(10, 24 + 512, generator=g) * 3).to(dtype).to(DEVICE)
    pos = torch.cat([torch.arange(3, 8), torch.arange(12, 17)]).to(DEVICE)
    table = torch.randperm(8, generator=g)[:8].view(2, 4).int().to(DEVICE)
    kv_w, q_w = (1 + 0.2 * torch.randn(512 + 24, generator=g)).to(DEVICE).split([512, 24])
    return qkv[:, 24:], kv_w, qkv[:, :24], q_w, pos, table


@needs_triton
@pytest.mark.parametrize("fmt", V4_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_v4_prolog_kernel_writes_what_the_model_ops_write(fmt, dtype):
    """V4's fused prolog against its torch ops (the norms, RoPE of the trailing 64, the reference writer at the
    block table's slots): the q latent within one rounding, the cache rows equal after decoding (one ulp where a
    norm rounds differently), nothing written outside the written slots (a position past the table: none)."""
    from anymla.layers.v4_kernels import run_v4_prolog
    kv, kv_w, q_lat, q_w, pos, table = _v4_step_inputs(11, dtype)
    rope = _table("interleaved")
    ours, ref = _empty_cache(fmt, 8, 4, 512), _empty_cache(fmt, 8, 4, 512)
    if fmt is F.BF16:  # the layer's dtype
        ours, ref = ours.to(dtype), ref.to(dtype)
    q_ours = run_v4_prolog("triton", fmt, kv, kv_w, 1e-6, q_lat, q_w, pos, rope, ours, table)
    q_ref = run_v4_prolog("torch", fmt, kv, kv_w, 1e-6, q_lat, q_w, pos, rope, ref, table)
    ulp = 2.0 ** -7
    torch.testing.assert_close(q_ours.float(), q_ref.float(), atol=0, rtol=ulp)
    written = kvcache.cache_slots(pos.view(2, 5).clamp(max=15), table, 4).view(-1)[:-1]  # 16 is past the table
    got = kvcache.gather_rows(ours, written, fmt).float().reshape(9, 512)
    want = kvcache.gather_rows(ref, written, fmt).float().reshape(9, 512)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=ulp if fmt in (F.BF16, F.MODEL1_FP8) else 2.0 ** -2)
    assert (_storage(ours) != _storage(ref)).float().mean() < 0.01
    untouched = torch.ones(8 * 4, dtype=torch.bool)
    untouched[written.long().cpu()] = False
    blank = _empty_cache(fmt, 8, 4, 512)
    blank = blank.to(dtype) if fmt is F.BF16 else blank
    for cache in (ours, ref):
        assert torch.equal(kvcache.gather_rows(cache, untouched.nonzero()[:, 0].to(DEVICE), fmt).view(torch.uint8),
                           kvcache.gather_rows(blank, untouched.nonzero()[:, 0].to(DEVICE), fmt).view(torch.uint8))


@needs_triton
@pytest.mark.parametrize("norm", [True, False], ids=["query", "output"])
def test_v4_heads_kernel_matches_the_model_ops_and_writes_the_window_slots(norm):
    """The V4 heads kernel in place against the torch ops: the query form (per-head norm without a weight, the
    factor rounded, then RoPE of the trailing 64, with each query's window slots exactly as sparse_slots gives
    them), and the output form (the rotation back alone, every other channel untouched)."""
    from anymla.layers.v4_kernels import run_v4_heads
    g = torch.Generator().manual_seed(12)
    h, window = 20, 6
    x = (torch.randn(10, h, 512, generator=g) * 2).bfloat16().to(DEVICE)
    _, _, _, _, pos, table = _v4_step_inputs(12)
    rope = _table("interleaved")
    rope = rope if norm else RopeTable(rope.cos, -rope.sin, rope.style)
    eps = 1e-6 if norm else None
    window_of = (table, torch.arange(window, device=DEVICE), 4) if norm else None
    ours, slots = run_v4_heads("triton", x.clone(), pos, rope, eps, window_of=window_of)
    want, want_slots = run_v4_heads("torch", x.clone(), pos, rope, eps, window_of=window_of)
    torch.testing.assert_close(ours.float(), want.float(), atol=0, rtol=2.0 ** -7)
    if norm:
        assert (ours != want).float().mean() < 0.01
        oracle = _slots_oracle(pos.view(2, 5, 1).cpu() - torch.arange(window), pos.view(2, 5).cpu(), table.cpu(), 4)
        assert slots.dtype == torch.int32 and torch.equal(slots.cpu(), oracle) and (oracle < 0).any()
    else:
        assert slots is None and torch.equal(ours[..., :448], x[..., :448])


def test_layer_kernels_run_their_torch_ops_on_npus(monkeypatch):
    """triton-ascend lowers few of the layer kernels (ascend_compile_check.py --layers), so on an NPU with the
    Triton tier available the layers still choose their torch ops, saying why; an explicit choice is kept."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Npu:  # torch.device("npu") needs torch_npu; the choice reads only .type
        type: str = "npu"

    monkeypatch.setattr(kernels, "_triton_reasons", lambda device: ())
    name, why = kernels.choose(Npu())
    assert name == "torch" and "triton-ascend" in why and "--layers" in why, why
    assert kernels.choose(Npu(), "triton")[0] == "triton"


def _slots_oracle(indices, positions, table, page):
    """The cache slot of each index, element by element (what sparse_slots must return)."""
    out = torch.full(indices.shape, -1, dtype=torch.int32)
    for (i, j, k), p in zip(torch.cartesian_prod(*(torch.arange(n) for n in indices.shape)).tolist(),
                            indices.flatten().tolist()):
        if 0 <= p <= positions[i, j] and p < table.shape[1] * page:
            out[i, j, k] = table[i, p // page] * page + p % page
    return out


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_sparse_slots_drop_what_a_query_may_not_attend(impl, dtype):
    if impl == "triton" and not TRITON:
        pytest.skip(kernels.choose(DEVICE)[1])
    g = torch.Generator().manual_seed(5)
    b, s, topk, page, max_blocks = 3, 2, 37, 4, 5
    table = torch.randperm(40, generator=g)[: 2 * b * max_blocks].view(b, 2 * max_blocks).int()[:, ::2]  # strided
    positions = torch.tensor([[5, 6], [18, 19], [0, 1]])
    wide = torch.randint(-3, max_blocks * page + 6, (b, s, 2 * topk), generator=g)
    wide[..., 0] = -1
    wide[..., 2] = max_blocks * page  # one past the block table
    wide[..., 4] = 1 << 30
    indices = wide[..., ::2]  # strided: the kernel reads any layout
    want = _slots_oracle(indices, positions, table, page)
    assert (want >= 0).sum() > 10 and (want < 0).sum() > 10  # both kinds occur
    got = sparse_slots(indices.to(dtype).to(DEVICE), positions.to(DEVICE), table.to(DEVICE), page, backend=impl)
    assert got.dtype == torch.int32 and torch.equal(got.cpu(), want)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("topk", [37, 1500])
def test_the_assembly_launch_writes_the_slots_a_sparse_step_reads(impl, topk):
    """A layer's sparse step takes its DSA slots from the q assembly's launch (its grid goes on past the head
    blocks): the slots equal sparse_slots' element by element (here over two slot blocks when topk > 1024),
    and the query is what the assembly alone writes."""
    if impl == "triton" and not TRITON:
        pytest.skip(kernels.choose(DEVICE)[1])
    from anymla.layers.prolog import run_assemble_q
    g = torch.Generator().manual_seed(8)
    b, s, h, page, max_blocks = 3, 2, 20, 64, 6
    table = torch.randperm(40, generator=g)[: 2 * b * max_blocks].view(b, 2 * max_blocks).int()[:, ::2]
    positions = torch.tensor([[70, 71], [250, 251], [0, 1]])
    wide = torch.randint(-3, max_blocks * page + 6, (b, s, 2 * topk), generator=g)
    wide[..., 2] = max_blocks * page
    indices = wide[..., ::2]
    want = _slots_oracle(indices, positions, table, page)
    q = torch.randn(b * s, h, 96, generator=g).bfloat16().to(DEVICE)
    table_rope = _table("interleaved")
    alone = torch.randn(b * s, h, 576, generator=g).bfloat16().to(DEVICE)
    fused = alone.clone()
    pos = positions.reshape(-1).to(DEVICE)
    assert run_assemble_q(impl, None, q[..., 32:], pos, table_rope, alone) is None
    got = run_assemble_q(impl, None, q[..., 32:], pos, table_rope, fused,
                         slots_of=(indices.to(DEVICE), table.to(DEVICE), page))
    assert got.dtype == torch.int32 and torch.equal(got.cpu(), want)
    assert (want >= 0).sum() > 10 and (want < 0).sum() > 10
    assert torch.equal(fused, alone)


def test_sparse_slots_errors_name_the_argument():
    idx, pos, table = torch.zeros(2, 1, 4, dtype=torch.int32), torch.zeros(2, 1), torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="positions"):
        sparse_slots(idx, pos, table, 4)
    with pytest.raises(ValueError, match="block_table"):
        sparse_slots(idx, pos.long(), table.long(), 4)
    with pytest.raises(ValueError, match="indices"):
        sparse_slots(idx[0], pos.long(), table, 4)
    with pytest.raises(ValueError, match="page_size"):
        sparse_slots(idx, pos.long(), table, 0)


@needs_triton
@pytest.mark.parametrize("fmt", [F.BF16, F.V32_FP8], ids=lambda f: f.name)
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_prolog_takes_slots_from_the_block_table(fmt, impl):
    """With block_table instead of slots the prolog writes the same bytes as with the slots cache_slots gives,
    and nothing for a position past the table."""
    g = torch.Generator().manual_seed(6)
    b, s, nb, page = 3, 4, 9, 4
    a = (torch.randn(b * s, 24 + 576, generator=g) * 3).bfloat16().to(DEVICE)
    q_w = (1 + 0.2 * torch.randn(24, generator=g)).bfloat16().to(DEVICE)
    w = (1 + 0.2 * torch.randn(512, generator=g)).bfloat16().to(DEVICE)
    table = torch.randperm(nb, generator=g)[: b * 2].view(2, b).t().int().to(DEVICE)  # a transposed view
    positions = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [5, 6, 7, 8]], device=DEVICE)  # 8: past the table
    expect_slots = kvcache.cache_slots(positions.clamp(max=7), table, page).view(-1)
    expect_slots[-1] = -1
    table_cache, slot_cache = _empty_cache(fmt, nb, page, 576), _empty_cache(fmt, nb, page, 576)
    args = dict(q_lat=a[:, :24], q_norm_weight=q_w, backend=impl)
    q_table = mla_prolog(a[:, 24:], w, 1e-6, positions.view(-1), _table("interleaved"), table_cache, None,
                         block_table=table, **args)
    q_slots = mla_prolog(a[:, 24:], w, 1e-6, positions.view(-1), _table("interleaved"), slot_cache, expect_slots,
                         **args)
    assert torch.equal(_storage(table_cache), _storage(slot_cache)) and torch.equal(q_table, q_slots)
    written = (_storage(table_cache) != _storage(_empty_cache(fmt, nb, page, 576))).sum().item()
    assert written > 0.9 * (b * s - 1) * (656 if fmt.is_quantized else 1152)  # every token but the last
    with pytest.raises(ValueError, match="slots / block_table"):
        mla_prolog(a[:, 24:], w, 1e-6, positions.view(-1), _table("interleaved"), slot_cache, expect_slots,
                   block_table=table)
    with pytest.raises(ValueError, match="block_table"):
        mla_prolog(a[:, 24:], w, 1e-6, positions.view(-1), _table("interleaved"), slot_cache, None,
                   block_table=torch.zeros(5, 2, dtype=torch.int32, device=DEVICE))  # 12 tokens, 5 requests?


@needs_triton
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_assemble_q_rotates_in_place_after_the_bmm(impl):
    """The layer's form: the absorbing bmm writes into the query (out=) and the assembly only rotates q_pe;
    the result equals the copying assembly's bit for bit."""
    g = torch.Generator().manual_seed(7)
    h, n = 5, 7
    q = torch.randn(n, h, 96, generator=g).bfloat16().to(DEVICE)
    w_uk = torch.randn(h, 32, 512, generator=g).bfloat16().to(DEVICE)
    pos = torch.randint(0, 300, (n,), generator=g).to(DEVICE)
    table = _table("interleaved")
    copied = assemble_q(torch.bmm(q[..., :32].transpose(0, 1), w_uk), q[..., 32:], pos, table, backend=impl)
    out = torch.full((n, h, 576), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    torch.bmm(q[..., :32].transpose(0, 1), w_uk, out=out[..., :512].transpose(0, 1))
    assert assemble_q(None, q[..., 32:], pos, table, out=out, backend=impl) is out
    assert torch.equal(out, copied)
    with pytest.raises(ValueError, match="out"):
        assemble_q(None, q[..., 32:], pos, table)
