"""anymla.layers against the model code it replaces: Hugging Face transformers' DeepseekV3Attention and
DeepseekV32Attention (eager), loaded into MLAAttention with from_hf, for prefill and token-by-token decoding
over bf16 and V3.2 FP8 paged caches (and V4's over its formats), the layer on the CPU and, where there is one,
on a CUDA GPU; the RoPE tables and layouts against the model's own functions."""

import math
import subprocess
import sys

import pytest
import torch

from anymla.kvcache import KVCacheFormat as F, cache_slots, gather_rows
from anymla.layers import MLAConfig, MLAAttention, RopeTable, apply_rope, config_from_hf, from_hf

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
DEFAULT = {"rope_type": "default", "rope_theta": 10000.0}
# Where the layer runs (the model itself always on the CPU in fp32): on a GPU it is the Triton tier's kernels
_ON_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=_ON_GPU)]
# (name, DeepseekV3Config overrides): q LoRA + YaRN (V3's shape), and no q LoRA + plain RoPE + biases +
# rope_interleave=False (the permuted-weights variant)
VARIANTS = {
    "qlora_yarn": dict(q_lora_rank=32, rope_parameters=YARN),
    "noqlora_neox_bias": dict(q_lora_rank=None, rope_parameters=DEFAULT, rope_interleave=False, attention_bias=True),
}


def _hf():
    return pytest.importorskip("transformers")


def _v3_config(**overrides):
    _hf()
    from transformers import DeepseekV3Config
    args = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=512,
                qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=24, max_position_embeddings=640,
                rope_parameters=DEFAULT, attn_implementation="eager")
    args.update(overrides)
    return DeepseekV3Config(**args)


def _randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights of unit-scale activations (the default init's are tiny), rounded to bf16 so the fp32 model and
    the bf16 layer hold the same numbers."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            p.copy_(p.bfloat16().float())
    return module.float().eval()


def _causal_mask(s: int) -> torch.Tensor:
    return torch.full((s, s), float("-inf")).triu(1)[None, None]


def _reference(attn, rotary, x: torch.Tensor, latent=None) -> torch.Tensor:
    """The Hugging Face module's eager output on ``x [1, S, hidden]`` (fp32, causal); with ``latent
    [S, 512]`` the module's normalized kv latent is replaced by it (the rows a quantized cache returns)."""
    hook = None
    if latent is not None:
        hook = attn.kv_a_layernorm.register_forward_hook(lambda m, i, out: latent.float().view(out.shape))
    try:
        pos = torch.arange(x.shape[1])[None]
        with torch.no_grad():
            out, _ = attn(x, rotary(x, pos), _causal_mask(x.shape[1]), position_ids=pos)
    finally:
        if hook is not None:
            hook.remove()
    return out


def _hf_latent(attn, x: torch.Tensor) -> torch.Tensor:
    """The module's own normalized kv latent ``[S, 512]`` (fp32)."""
    with torch.no_grad():
        kv = attn.kv_a_proj_with_mqa(x)[0, :, :512]
        return attn.kv_a_layernorm(kv)


def _empty_cache(fmt: F, nb: int, page: int, device="cpu") -> torch.Tensor:
    if fmt is F.BF16:
        return torch.full((nb, page, 1, 576), float("nan"), dtype=torch.bfloat16, device=device)
    return torch.full((nb, page, 1, 656), 0xFF, dtype=torch.uint8, device=device)  # e4m3 NaN everywhere unwritten


def _assert_matches(got: torch.Tensor, ref: torch.Tensor, rel_tol: float = 1.5e-2) -> None:
    """bf16 layer vs fp32 model: the relative error of a bf16 pipeline (weights and activations rounded to
    bf16 at each GEMM; measured 0.4-0.7 %, as the same module run in bf16)."""
    got = got.float()
    assert torch.isfinite(got).all()
    rel = ((got - ref).norm() / ref.norm()).item()
    worst = ((got - ref).abs().max() / ref.abs().max()).item()
    assert rel < rel_tol and worst < 2 * rel_tol, f"relative error {rel:.4f}, worst element {worst:.4f} of the max"


def _check_against_hf(attn, rotary, xs, outs, cache, table, fmt, page=4):
    """Each request's outputs against the module: for a bf16 cache as it is; for an FP8 cache, run on the
    latent rows the cache returns (dequantized), after checking those rows are the module's own latent
    within e4m3 rounding. The FP8 outputs also stay near the plain module's (quantization error only)."""
    for i, (x, got) in enumerate(zip(xs, outs)):
        if fmt is F.BF16:
            _assert_matches(got, _reference(attn, rotary, x))
            continue
        slots = cache_slots(torch.arange(x.shape[1])[None], table[i:i + 1], page)[0]
        stored = gather_rows(cache, slots)[:, :512].float()
        own = _hf_latent(attn, x)
        tile_max = own.view(-1, 4, 128).abs().amax(-1, keepdim=True).expand(-1, 4, 128).reshape(own.shape)
        assert ((stored - own).abs() <= tile_max * 2.0 ** -4 + own.abs() * 2.0 ** -7).all()
        _assert_matches(got, _reference(attn, rotary, x, latent=stored))
        _assert_matches(got, _reference(attn, rotary, x), rel_tol=6e-2)


def _run_requests(layer, xs, prompt_lens, fmt, page=4, indices=None, device="cpu"):
    """Prefill each request alone (its prompt), then decode the rest of all requests together, token by
    token, through one paged cache, the layer on ``device``. Returns each request's outputs ``[1, len,
    hidden]``, the cache and the block table (on the CPU)."""
    lens = [x.shape[1] for x in xs]
    blocks = [math.ceil(n / page) for n in lens]
    nb = sum(blocks) + 3
    cache = _empty_cache(fmt, nb, page, device)
    order = torch.randperm(nb, generator=torch.Generator().manual_seed(7))
    table = torch.full((len(xs), max(blocks)), nb - 1, dtype=torch.int32)
    at = 0
    for i, n in enumerate(blocks):
        table[i, :n] = order[at:at + n]
        at += n
    layer = layer.to(device)
    xs, table = [x.to(device) for x in xs], table.to(device)
    indices = None if indices is None else [ind.to(device) for ind in indices]
    outs = []
    with torch.no_grad():
        for i, (x, p) in enumerate(zip(xs, prompt_lens)):
            pos = torch.arange(p, device=device)[None]
            idx = None if indices is None else indices[i][:, :p]
            outs.append([layer(x[:, :p].bfloat16(), pos, cache, table[i:i + 1],
                               torch.tensor([p], dtype=torch.int32, device=device), indices=idx)])
        steps = [n - p for n, p in zip(lens, prompt_lens)]
        assert len(set(steps)) == 1, "requests decode the same number of steps"
        for k in range(steps[0]):
            pos = torch.tensor([[p + k] for p in prompt_lens], device=device)
            x = torch.cat([x[:, p + k:p + k + 1] for x, p in zip(xs, prompt_lens)]).bfloat16()
            idx = None if indices is None else torch.cat([ind[:, p + k:p + k + 1]
                                                          for ind, p in zip(indices, prompt_lens)])
            out = layer(x, pos, cache, table, (pos[:, 0] + 1).int(), indices=idx)
            for i in range(len(xs)):
                outs[i].append(out[i:i + 1])
    return [torch.cat(o, 1).cpu() for o in outs], cache.cpu(), table.cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", [F.BF16, F.V32_FP8], ids=lambda f: f.name)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_matches_hf_deepseek_v3_prefill_and_decode(variant, fmt, device):
    _hf()
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
    cfg = _v3_config(**VARIANTS[variant])
    attn = _randomize(DeepseekV3Attention(cfg, layer_idx=0), seed=11)
    rotary = DeepseekV3RotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(1, n, cfg.hidden_size, generator=g).bfloat16().float() for n in (10, 7)]
    layer = from_hf(attn)
    outs, cache, table = _run_requests(layer, xs, [6, 3], fmt, device=device)
    _check_against_hf(attn, rotary, xs, outs, cache, table, fmt)


@pytest.mark.parametrize("device", DEVICES)
def test_matches_hf_deepseek_v32_sparse_attention_with_its_indexer(device):
    """V3.2: the indices its indexer picks (top 4 of up to 12 tokens), fed to the layer as DSA indices."""
    _hf()
    from transformers import DeepseekV32Config
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Attention, DeepseekV32RotaryEmbedding
    cfg = DeepseekV32Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                            kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=24,
                            max_position_embeddings=640, rope_parameters=YARN, index_topk=4, index_head_dim=96,
                            index_n_heads=2, attn_implementation="eager")
    attn = _randomize(DeepseekV32Attention(cfg, layer_idx=0), seed=12)
    rotary = DeepseekV32RotaryEmbedding(cfg)
    picked = []
    attn.indexer.register_forward_hook(lambda m, i, out: picked.append(out))
    g = torch.Generator().manual_seed(6)
    xs = [torch.randn(1, n, cfg.hidden_size, generator=g).bfloat16().float() for n in (12, 9)]
    for x in xs:
        _reference(attn, rotary, x)
    indices = list(picked)
    assert indices[0].shape == (1, 12, 4) and indices[1].shape == (1, 9, 4)
    layer = from_hf(attn)
    for fmt in (F.BF16, F.V32_FP8):
        outs, cache, table = _run_requests(layer, xs, [8, 5], fmt, indices=indices, device=device)
        _check_against_hf(attn, rotary, xs, outs, cache, table, fmt)
        # the indices matter: dense attention over the same cache gives another answer
        dense, _, _ = _run_requests(layer, xs[:1], [8], fmt, device=device)
        assert (dense[0] - outs[0]).abs().max() > 0.05 * outs[0].abs().max()



def _v4_module(window: int):
    """A Hugging Face DeepseekV4Attention of a sliding-window layer (small: 4 heads of 512, 2 output groups),
    its rotary embedding, random weights and sinks."""
    hf = _hf()
    if not hasattr(hf, "DeepseekV4Config"):
        pytest.skip(f"transformers {hf.__version__} has no DeepSeek V4 model")
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention, DeepseekV4RotaryEmbedding
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125}
    cfg = hf.DeepseekV4Config(hidden_size=64, num_attention_heads=4, q_lora_rank=32, o_groups=2, o_lora_rank=16,
                              sliding_window=window, num_hidden_layers=1, layer_types=["sliding_attention"],
                              max_position_embeddings=256, vocab_size=128,
                              rope_parameters={"main": rope, "compress": dict(rope, rope_theta=160000.0)})
    cfg._attn_implementation = "eager"
    attn = DeepseekV4Attention(cfg, 0)
    with torch.no_grad():
        attn.sinks.copy_(torch.randn(4, generator=torch.Generator().manual_seed(3)))
    return _randomize(attn, seed=13), DeepseekV4RotaryEmbedding(cfg)


def _v4_reference(attn, rotary, x, rows=None):
    """The module's eager output on ``x [1, S, hidden]`` (fp32; causal window mask as transformers builds it:
    key k seen by query q when q - window < k <= q); with ``rows [S, 512]`` its roped kv rows are replaced by
    them (the rows a quantized cache returns), through its kv norm's output rotated back."""
    from anymla.layers.v4 import ROPE
    s, w = x.shape[1], attn.sliding_window
    pos = torch.arange(s)[None]
    q, k = torch.arange(s)[:, None], torch.arange(s)[None, :]
    mask = torch.where((k <= q) & (k > q - w), 0.0, float("-inf"))[None, None]
    hook = None
    if rows is not None:
        cos, sin = rotary(x, pos, layer_type="main")
        unroped = rows.float().clone()
        unroped[:, -ROPE:] = apply_rope(rows[:, -ROPE:], pos[0], RopeTable(cos[0], -sin[0], "interleaved"))
        hook = attn.kv_norm.register_forward_hook(lambda m, i, out: unroped.view(out.shape))
    try:
        with torch.no_grad():
            embeddings = {t: rotary(x, pos, layer_type=t) for t in ("main", "compress")}
            out, _ = attn(x, embeddings, pos, mask)
    finally:
        if hook is not None:
            hook.remove()
    return out


_V4_CACHES = {F.BF16: (512, torch.bfloat16), F.MODEL1_FP8: (584, torch.uint8), F.V41_FP8: (528, torch.uint8),
              F.V41_FP4: (288, torch.uint8)}


# (device, tier): on the CPU the default tier (the reference) and the Triton tier (its interpreter); on a GPU the
# default is the Triton tier
V4_WHERE = [("cpu", "default"), ("cpu", "triton"), pytest.param("cuda", "default", marks=_ON_GPU)]


@pytest.mark.parametrize("device,tier", V4_WHERE)
@pytest.mark.parametrize("fmt", list(_V4_CACHES), ids=lambda f: f.name)
def test_matches_hf_deepseek_v4_sliding_attention_prefill_and_decode(fmt, device, tier):
    """V4 (shared K = V head of 512, sinks, a window of 6, grouped output projection): a prompt of 9 tokens,
    then 7 decoding steps, over a paged cache of each V4 format, against the module (on the rows a quantized
    cache returns); ``triton``: the cache writer, slots and attention on the Triton tier."""
    import anymla
    from anymla.layers import config_from_hf_v4, from_hf_v4
    if tier == "triton" and "triton" not in anymla.available_backends(torch.device("cpu")):
        pytest.skip("the Triton tier runs on the CPU only in its interpreter (TRITON_INTERPRET=1)")
    attn, rotary = _v4_module(window=6)
    assert config_from_hf_v4(attn).sliding_window == 6
    layer = from_hf_v4(attn).to(device)
    if tier == "triton":
        layer.kernel_backend = layer.attention_backend = "triton"
    g = torch.Generator().manual_seed(9)
    x = torch.randn(1, 16, 64, generator=g).bfloat16().float()
    page, nb = 4, 6
    last, dtype = _V4_CACHES[fmt]
    cache = torch.full((nb, page, 1, last), float("nan") if fmt is F.BF16 else 0xFF, dtype=dtype, device=device)
    table = torch.randperm(nb, generator=g)[None].int()
    pos = torch.arange(16)[None]
    xd, posd, tabled = x.to(device), pos.to(device), table.to(device)
    with torch.no_grad():
        outs = [layer(xd[:, :9].bfloat16(), posd[:, :9], cache, tabled)]
        outs += [layer(xd[:, t:t + 1].bfloat16(), posd[:, t:t + 1], cache, tabled) for t in range(9, 16)]
    got, cache = torch.cat(outs, 1).cpu(), cache.cpu()
    rows = None if fmt is F.BF16 else gather_rows(cache, cache_slots(pos, table, page)[0])
    kernels_tier = tier == "triton" or device == "cuda"
    _assert_matches(got, _v4_reference(attn, rotary, x, rows), rel_tol=2e-2 if kernels_tier else 1.5e-2)
    if fmt is not F.BF16:  # the quantization error only
        _assert_matches(got, _v4_reference(attn, rotary, x), rel_tol=0.15 if fmt is F.V41_FP4 else 6e-2)


def test_v4_window_and_sinks_matter_and_compressed_layers_are_refused():
    """A wider window or no sinks gives another answer (the test above could not pass without them); a
    compressed (CSA/HCA) layer is refused by name."""
    from anymla.layers import from_hf_v4
    attn, rotary = _v4_module(window=3)
    x = torch.randn(1, 10, 64, generator=torch.Generator().manual_seed(4)).bfloat16().float()
    cache = torch.full((3, 4, 1, 512), float("nan"), dtype=torch.bfloat16)
    table = torch.arange(3)[None].int()
    layer = from_hf_v4(attn)
    with torch.no_grad():
        got = layer(x.bfloat16(), torch.arange(10)[None], cache, table)
    ref = _v4_reference(attn, rotary, x)
    _assert_matches(got, ref)
    wide, _ = _v4_module(window=10)
    with torch.no_grad():
        no_sinks = from_hf_v4(attn)
        no_sinks.sinks.fill_(-float("inf"))
        for other in (from_hf_v4(wide), no_sinks):
            out = other(x.bfloat16(), torch.arange(10)[None], cache.clone(), table)
            assert ((out.float() - ref).norm() / ref.norm()) > 0.05
    attn.layer_type = "compressed_sparse_attention"
    with pytest.raises(ValueError, match="sliding_attention"):
        from_hf_v4(attn)

@pytest.mark.parametrize("params", [DEFAULT, YARN], ids=["default", "yarn"])
def test_rope_table_and_scale_match_hf(params):
    _hf()
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding
    cfg = _v3_config(rope_parameters=dict(params))
    pos = torch.arange(0, 640, 7)[None]
    cos, sin = DeepseekV3RotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), pos)
    attn = DeepseekV3Attention(cfg, layer_idx=0)
    mla = config_from_hf(attn)
    table = RopeTable.build(64, mla.rope_parameters, 640, mla.rope_style, mla.max_position_embeddings)
    torch.testing.assert_close(table.cos[pos[0]], cos[0, :, :32], atol=2e-6, rtol=0)
    torch.testing.assert_close(table.sin[pos[0]], sin[0, :, :32], atol=2e-6, rtol=0)
    assert mla.softmax_scale == pytest.approx(attn.scaling, rel=1e-12)
    if params is YARN:
        assert mla.softmax_scale > mla.qk_head_dim ** -0.5  # mscale is in the scale


def test_rope_layout_matches_hf():
    """Interleaved (DeepSeek's checkpoints): HF returns the same rotation de-interleaved, so ours (layout kept)
    equals it after gathering evens then odds; neox (rope_interleave=False): identical."""
    _hf()
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3RotaryEmbedding,
                                                                      apply_rotary_pos_emb,
                                                                      apply_rotary_pos_emb_interleave)
    cfg = _v3_config(rope_parameters=dict(YARN))
    g = torch.Generator().manual_seed(8)
    q, k = torch.randn(1, 3, 9, 64, generator=g), torch.randn(1, 1, 9, 64, generator=g)
    pos = torch.randint(0, 640, (1, 9), generator=g)
    cos, sin = DeepseekV3RotaryEmbedding(cfg)(q, pos)
    mla = config_from_hf(_hf().models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(cfg, 0))
    for style, fn in (("interleaved", apply_rotary_pos_emb_interleave), ("neox", apply_rotary_pos_emb)):
        table = RopeTable.build(64, mla.rope_parameters, 640, style, 640)
        hf_q, hf_k = fn(q, k, cos, sin)
        ours_q, ours_k = apply_rope(q, pos[0], table), apply_rope(k, pos[0], table)
        if style == "interleaved":
            perm = torch.cat([torch.arange(0, 64, 2), torch.arange(1, 64, 2)])
            ours_q, ours_k = ours_q[..., perm], ours_k[..., perm]
            assert not torch.allclose(apply_rope(q, pos[0], table), hf_q, atol=1e-3)  # the layouts differ
        torch.testing.assert_close(ours_q, hf_q, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours_k, hf_k, atol=1e-5, rtol=1e-5)


def _small_layer(seed: int = 0) -> MLAAttention:
    cfg = MLAConfig(hidden_size=32, num_heads=2, q_lora_rank=16, qk_nope_head_dim=16, v_head_dim=16,
                    max_position_embeddings=64)
    g = torch.Generator().manual_seed(seed)
    names = {"q_a_proj.weight": (16, 32), "q_a_layernorm.weight": (16,), "q_b_proj.weight": (2 * 80, 16),
             "kv_a_proj_with_mqa.weight": (576, 32), "kv_a_layernorm.weight": (512,),
             "kv_b_proj.weight": (2 * 32, 512), "o_proj.weight": (32, 32)}
    weights = {n: torch.randn(s, generator=g) / math.sqrt(s[-1]) + ("norm" in n) for n, s in names.items()}
    return MLAAttention.from_weights(cfg, weights)


def test_residual_is_added_and_bad_input_names_the_argument():
    layer = _small_layer()
    x = torch.randn(1, 3, 32).bfloat16()
    res = torch.randn(1, 3, 32).bfloat16()
    table = torch.tensor([[1]], dtype=torch.int32)
    args = (torch.arange(3)[None], torch.zeros(2, 4, 1, 576, dtype=torch.bfloat16), table,
            torch.tensor([3], dtype=torch.int32))
    plain = layer(x, *args)
    with_res = layer(x, *args, residual=res)
    torch.testing.assert_close(with_res.float(), plain.float() + res.float(), atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="positions"):
        layer(x, torch.arange(2)[None], *args[1:])
    with pytest.raises(TypeError, match="hidden_states"):
        layer(x.float(), *args)
    with pytest.raises(ValueError, match="indices"):
        layer(x, *args, indices=torch.zeros(1, 2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="kv_lora_rank"):
        MLAConfig(hidden_size=32, num_heads=2, q_lora_rank=None, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=256)


def test_package_imports_without_transformers():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import anymla, anymla.layers\n"
            "assert 'transformers' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
            "print('ok')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


@pytest.mark.parametrize("fmt", [F.BF16, F.V32_FP8], ids=lambda f: f.name)
def test_layer_matches_its_eager_torch_form(fmt):
    """The benchmark's baseline computes what the layer computes (cache writes included)."""
    from anymla.layers import mla_forward_eager
    layer = _small_layer(seed=3)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(2, 3, 32, generator=g).bfloat16()
    pos = torch.tensor([[4, 5, 6], [1, 2, 3]])
    table = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32)
    prefix = torch.randn(2, 4, 32, generator=g).bfloat16()
    caches = [_empty_cache(fmt, 4, 4) for _ in range(2)]
    indices = torch.randint(-1, 7, (2, 3, 5), generator=g)
    indices[..., 0] = pos  # every query sees at least itself
    for cache in caches:  # earlier tokens in both caches
        layer(prefix, torch.arange(4).expand(2, 4), cache, table, torch.tensor([4, 4], dtype=torch.int32))
    seqlens = (pos[:, -1] + 1).int()
    for idx in (None, indices):
        got = layer(x, pos, caches[0], table, seqlens, indices=idx)
        want = mla_forward_eager(layer, x, pos, caches[1], table, seqlens, indices=idx)
        _assert_matches(got, want.float())


def test_bench_layer_runs_small(tmp_path):
    from anymla.bench import layer as bench_layer
    rows = bench_layer.main(["--small", "--reps", "1", "--writer-tokens", "64", "--out", str(tmp_path)])
    assert (tmp_path / "layer.csv").exists()
    assert {r["component"] for r in rows} >= {"layer", "sum of parts", "parts in sequence", "eager torch",
                                              "write_cache", "attention", "v4 layer", "v4 layer, torch ops"}
    assert all("FAILED" not in r["note"] and "DIFFER" not in r["note"] for r in rows)
    from anymla.layers import kernels
    if kernels.choose(torch.device("cpu"))[0] == "triton":
        host = bench_layer.host_glue(torch.device("cpu"), steps=3, rounds=2)
        assert [r["case"] for r in host] == ["BF16 dense", "V32_FP8 topk 16", "V4 BF16 window 4"]
        assert all(r["host_us"] > 0 for r in host)


def _decode_inputs(layer, fmt, seed=10):
    """One decode step of 2 requests over a cache holding 4 earlier tokens each (written by the layer)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32)
    cache = _empty_cache(fmt, 4, 4)
    layer(torch.randn(2, 4, 32, generator=g).bfloat16(), torch.arange(4).expand(2, 4), cache, table,
          torch.tensor([4, 4], dtype=torch.int32))
    indices = torch.tensor([[[0, 2, 4, -1]], [[1, 3, 4, 2]]])
    return dict(hidden_states=torch.randn(2, 1, 32, generator=g).bfloat16(), positions=torch.tensor([[4], [4]]),
                kv_cache=cache, block_table=table, cache_seqlens=torch.tensor([5, 5], dtype=torch.int32),
                indices=indices if fmt is F.V32_FP8 else None, residual=torch.randn(2, 1, 32, generator=g).bfloat16())


def _step_ops_and_launches(layer, inp: dict) -> tuple[list, list]:
    """The torch ops (metadata-only ones aside) and the Triton kernels a planned step issues outside the
    attention call, counted on the CPU in the interpreter."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from anymla import api
    from anymla.triton_kernels.cache_write import launch
    layer(**inp)  # planned
    inside, ops, launched = [0], [], []

    class CountOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not inside[0] and func.overloadpacket not in _METADATA_OPS:
                ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    def excluded(fn, tally=None):
        def run(*args, **kwargs):
            inside[0] += 1
            if tally is not None:
                tally.append(getattr(args[0], "__name__", str(args[0])))
            try:
                return fn(*args, **kwargs)
            finally:
                inside[0] -= 1
        return run

    real_launch, real_attention = launch._run, api.flash_mla_with_kvcache
    launch._run, api.flash_mla_with_kvcache = excluded(real_launch, launched), excluded(real_attention)
    try:
        with CountOps():
            layer(**inp)
    finally:
        launch._run, api.flash_mla_with_kvcache = real_launch, real_attention
    return sorted(ops), sorted(launched)


@pytest.mark.parametrize("fmt", [F.BF16, F.V32_FP8], ids=lambda f: f.name)
def test_decode_step_is_five_gemms_and_the_layer_kernels(fmt):
    """On the Triton tier a decode step issues no torch op besides its five GEMMs / bmms (slots, RoPE, norms,
    the cache write, the query's layout and the DSA indices' cache slots are the layer's two kernels), then the
    attention call. Counted on the CPU, in the interpreter."""
    from anymla.layers import kernels
    if kernels.choose(torch.device("cpu"))[0] != "triton":
        pytest.skip("needs the Triton tier on the CPU (TRITON_INTERPRET=1)")
    layer = _small_layer(seed=4)
    ops, launched = _step_ops_and_launches(layer, _decode_inputs(layer, fmt))
    assert ops == ["aten.addmm", "aten.bmm", "aten.bmm", "aten.mm", "aten.mm"], ops
    assert launched == ["mla_prolog_kernel", "q_assemble_kernel"]


def _small_v4_layer():
    from anymla.layers import V4Attention, V4Config
    layer = V4Attention(V4Config(hidden_size=32, num_heads=4, q_lora_rank=16, o_groups=2, o_lora_rank=8,
                                 sliding_window=4))
    g = torch.Generator().manual_seed(3)
    for _, buf in layer.named_buffers():
        buf.copy_(torch.randn(buf.shape, generator=g))
    return layer


def _v4_step_inputs(fmt, seed: int = 0) -> dict:
    """One decoding token of each of two requests over a small V4 cache of ``fmt`` (random bytes)."""
    g = torch.Generator().manual_seed(seed)
    last = {F.BF16: 512, F.MODEL1_FP8: 584, F.V41_FP8: 528, F.V41_FP4: 288}[fmt]
    cache = torch.randint(0, 256, (4, 4, 1, last), generator=g, dtype=torch.uint8)
    return dict(hidden_states=torch.randn(2, 1, 32, generator=g).bfloat16(),
                positions=torch.randint(4, 8, (2, 1), generator=g),
                kv_cache=torch.randn(4, 4, 1, 512, generator=g).bfloat16() if fmt is F.BF16 else cache,
                block_table=torch.randperm(4, generator=g).view(2, 2).int(),
                residual=torch.randn(2, 1, 32, generator=g).bfloat16())


@pytest.mark.parametrize("kind", ["V3 BF16", "V3.2 FP8 indices", "V4 FP4"])
def test_a_layer_explains_the_step_it_runs(kind, monkeypatch):
    """``layer.explain(...)`` says how the step attends and which kernels it runs, and holds the dispatcher's
    decision that the step's attention call then runs with (the same object); explaining writes nothing."""
    from anymla.selection import Decision
    if kind == "V4 FP4":
        layer, inp = _small_v4_layer(), _v4_step_inputs(F.V41_FP4)
    else:
        layer = _small_layer(seed=4)
        inp = _decode_inputs(layer, F.BF16 if kind == "V3 BF16" else F.V32_FP8)
    before = inp["kv_cache"].clone()
    exp = layer.explain(**inp)
    assert torch.equal(inp["kv_cache"].view(torch.uint8), before.view(torch.uint8))
    text = str(exp)
    assert {"V3 BF16": "dense decoding", "V3.2 FP8 indices": "at the DSA indices",
            "V4 FP4": "window of 4 positions"}[kind] in text, text
    assert f"layer kernels: {exp.kernels} ({exp.kernels_reason})" in text and f"{exp.attention.op} on " in text
    ran = []
    real = Decision.run
    monkeypatch.setattr(Decision, "run", lambda self, problem: ran.append(self) or real(self, problem))
    layer(**inp)
    assert ran and ran[0] is exp.attention


def test_layers_debug_checks_name_a_position_past_the_rope_table():
    """Positions index the layers' RoPE tables: with the debug checks on, one outside the table raises naming
    it (off, the kernels read the table only at its rows: tests/test_cache_write.py)."""
    import anymla
    v4 = _small_v4_layer()
    inp = _v4_step_inputs(F.BF16)
    with anymla.debug_checks(), pytest.raises(ValueError, match=r"positions: element \(1, 0\) is 4096"):
        v4(**{**inp, "positions": torch.tensor([[5], [4096]])})
    v3 = _small_layer(seed=4)
    inp = _decode_inputs(v3, F.BF16)
    rows = v3.rope_cos.shape[0]
    with anymla.debug_checks(), pytest.raises(ValueError, match=f"positions: element \\(0, 0\\) is -1.*{rows}"):
        v3(**{**inp, "positions": torch.full_like(inp["positions"], -1)})


@pytest.mark.parametrize("fmt", [F.BF16, F.V41_FP4], ids=lambda f: f.name)
def test_v4_step_is_four_gemms_and_three_kernels(fmt):
    """A V4 step on the Triton tier: its GEMMs ([q_a | kv] in one, q_b, the grouped o_a bmm, o_b with the
    residual) and three kernels (the prolog with the cache write; the query heads with the window slots; the
    output's rotation back), then the attention call; no other torch op."""
    from anymla.layers import kernels
    if kernels.choose(torch.device("cpu"))[0] != "triton":
        pytest.skip("needs the Triton tier on the CPU (TRITON_INTERPRET=1)")
    ops, launched = _step_ops_and_launches(_small_v4_layer(), _v4_step_inputs(fmt))
    assert ops == ["aten.addmm", "aten.bmm", "aten.mm", "aten.mm"], ops
    assert launched == ["v4_heads_kernel", "v4_heads_kernel", "v4_prolog_kernel"]


@pytest.mark.parametrize("fmt", [F.BF16, F.V32_FP8, F.MODEL1_FP8, F.V41_FP4], ids=lambda f: f.name)
def test_a_layer_plan_binds_its_kernels_to_what_its_signature_fixes(fmt, monkeypatch):
    """A layer's plan launches its kernels through launchers bound on the first call (``Launcher.bind``: later
    calls hand over only their tensors and floats), so every other argument (sizes, strides, codes) and the grid
    must be the same in every call of the signature, whatever the values."""
    from anymla.layers import kernels
    from anymla.triton_kernels import launcher
    if kernels.choose(torch.device("cpu"))[0] != "triton":
        pytest.skip("needs the Triton tier on the CPU (TRITON_INTERPRET=1)")
    seen: dict = {}
    real = launcher.Launcher.bind

    def recording(self, grid, values, full):
        fixed = [None if launcher._per_call(a) else a for a in full()]
        seen.setdefault(id(self), []).append((getattr(self.fn, "__name__", ""), grid, fixed))
        return real(self, grid, values, full)

    monkeypatch.setattr(launcher.Launcher, "bind", recording)
    v4 = fmt in (F.MODEL1_FP8, F.V41_FP4)  # V4's layer (its formats); V3's otherwise
    layer = _small_v4_layer() if v4 else _small_layer(seed=6)
    for seed in (10, 11):  # two decode steps of one signature, different caches and values
        layer(**(_v4_step_inputs(fmt, seed) if v4 else _decode_inputs(layer, fmt, seed=seed)))
    # (the prefill that fills each cache is a signature of its own, repeated too)
    repeated = [calls for calls in seen.values() if len(calls) > 1]
    names = {calls[0][0] for calls in repeated}
    assert names == ({"v4_heads_kernel", "v4_prolog_kernel"} if v4 else {"mla_prolog_kernel", "q_assemble_kernel"}), \
        names
    for calls in repeated:
        assert all(c == calls[0] for c in calls), calls[0][0]


_METADATA_OPS = {getattr(torch.ops.aten, n) for n in ("view", "reshape", "_unsafe_view", "transpose", "slice", "expand",
                                                       "t", "select", "unsqueeze", "alias", "as_strided", "detach",
                                                       "empty", "empty_like", "empty_strided", "split", "squeeze")}


@pytest.mark.parametrize("fmt", [F.BF16, F.V32_FP8], ids=lambda f: f.name)
def test_layer_kernels_agree_on_both_tiers_and_plan_once(fmt):
    """The layer's torch kernels (where Triton cannot run) and its Triton kernels give the same step; each call
    signature is checked and planned once (a new shape plans again, a bad argument still raises)."""
    torch_layer, triton_layer = _small_layer(seed=5), _small_layer(seed=5)
    torch_layer.kernel_backend = "torch"
    from anymla.layers import kernels
    if kernels.choose(torch.device("cpu"))[0] != "triton":
        pytest.skip("needs the Triton tier on the CPU (TRITON_INTERPRET=1)")
    a, b = _decode_inputs(torch_layer, fmt), _decode_inputs(triton_layer, fmt)
    _assert_matches(triton_layer(**b), torch_layer(**a).float())
    written = cache_slots(torch.arange(5).expand(2, 5), b["block_table"], 4).flatten()  # 4 earlier tokens + 1
    got, want = gather_rows(b["kv_cache"], written).float(), gather_rows(a["kv_cache"], written).float()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=2.0 ** -7 if fmt is F.BF16 else 2.0 ** -3)
    plans = len(triton_layer._plans)
    triton_layer(**b)
    assert len(triton_layer._plans) == plans  # the same signature: no new plan
    triton_layer(**{**b, "residual": None})
    assert len(triton_layer._plans) == plans + 1
    with pytest.raises(ValueError, match="block_table"):
        triton_layer(**{**b, "block_table": b["block_table"].long()})


def test_indices_past_the_block_table_are_skipped():
    layer = _small_layer(seed=6)
    inp = _decode_inputs(layer, F.V32_FP8)
    cache = inp["kv_cache"].clone()
    want = layer(**{**inp, "kv_cache": cache.clone()})
    far = inp["indices"].clone()
    far[..., -1] = 8  # block_table covers positions 0..7
    got = layer(**{**inp, "indices": torch.cat([inp["indices"], far[..., -1:]], -1), "kv_cache": cache.clone()})
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
