"""The compiled call path (``anymla.callpath``): a repeated call runs in C++ what the Python path runs.

On the CPU (Triton's interpreter) no kernel is compiled, so these tests stand in for compiled kernels: a
first launch runs the kernel in the interpreter and hands back a stand-in whose launcher records what it is
given; the C++ entry point's launches go to a stand-in for the driver, which records each parameter's bytes.
A call through the C++ entry point must then launch the same kernels, over the same grids, with the same
parameters as the Python path given the same tensors: the call's own addresses where the Python path puts
them, every other parameter equal. On a GPU the same calls are compared by their results (further below).
"""

import functools
import inspect
import itertools
import math
import os
import struct
import types

import pytest
import torch

import anymla
from anymla import buffers, callpath, kvcache, selection
from anymla.callpath import native
from anymla.callpath.watch import ptx_param_sizes
from anymla.testing import device_under_test, sparse_decode_inputs

DEVICE = device_under_test()
cpu_only = pytest.mark.skipif(DEVICE.type != "cpu", reason="stand-in kernels are for the interpreter (CPU)")
_ids = itertools.count(1000)
_PTX_TYPE = {"i1": ".u8", "i32": ".u32", "i64": ".u64", "fp32": ".f32"}


def _param_type(annotation, value) -> str:
    """The type Triton's signature gives an argument (None and constexprs are constants of the kernel)."""
    import triton.language as tl
    if annotation is tl.constexpr or value is None:
        return "constexpr"
    if isinstance(value, torch.Tensor):
        return "*" + str(value.dtype).removeprefix("torch.")
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    return "fp32"


class _Kernel:
    """Stands for a compiled kernel: its signature, metadata and PTX entry as Triton's would read; its
    launcher records the arguments of each launch."""

    def __init__(self, fn, args, options, launches):
        params = inspect.signature(fn.fn).parameters
        self.types = [_param_type(p.annotation, a) for p, a in zip(params.values(), args)]
        self.src = types.SimpleNamespace(signature=dict(zip(params, self.types)))
        self.function, self.packed_metadata = next(_ids), (options.get("num_warps", 4), 1, 0)
        self.metadata = types.SimpleNamespace(num_warps=options.get("num_warps", 4), num_ctas=1, shared=0,
                                              global_scratch_size=0, profile_scratch_size=0, tensordesc_meta=None)
        decls = [".u64 .ptr .global .align 1" if t.startswith("*") else _PTX_TYPE[t]
                 for t in self.types if t != "constexpr"] + [".u64 .ptr .global .align 1"] * 2
        self.asm = {"ptx": ".visible .entry k(\n" + ",\n".join(f"\t.param {d} k_param_{i}" for i, d in
                                                              enumerate(decls)) + "\n)\n{\n}\n"}
        self.launches = launches

    def run(self, gx, gy, gz, stream, function, packed, meta, enter, leave, *args):
        values = [a for t, a in zip(self.types, args) if t != "constexpr"]
        self.launches.append((function, (gx, gy, gz), values + [0, 0]))

    def launch_metadata(self, grid, stream, *args):
        return None


class _StandIn:
    """Stands for a ``@triton.jit`` function compiled for a GPU: ``fn[grid](*args)`` runs the kernel in the
    interpreter (outside any watch: the interpreter's own torch ops are no part of the call) and hands back a
    stand-in compiled kernel."""

    def __init__(self, fn, launches):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        def launch(*args, **options):
            from torch.utils._python_dispatch import _disable_current_modes
            with _disable_current_modes():
                self.fn[grid](*args, num_warps=options.get("num_warps", 4))
            return _Kernel(self.fn, args, options, self.launches)
        return launch


@pytest.fixture
def compiled_path(monkeypatch):
    """The extension built, entries made for CPU calls, a stand-in for the driver; yields the C++ launches."""
    why = native._why_not_buildable()
    if why:
        pytest.skip(why)
    native.build(wait=True)
    assert native.module() is not None, native.reason()
    cpp_launches = []
    monkeypatch.setitem(callpath._state, "test_device", True)
    native.configure(native.module(), lambda function, grid, block, shared, stream, params:
                     cpp_launches.append((function, grid, [_value(p) for p in params])))
    selection.clear_decision_cache()
    yield cpp_launches
    selection.clear_decision_cache()
    native.configure(native.module())


@pytest.fixture
def stand_ins(compiled_path, monkeypatch):
    """Stand-in compiled kernels too; yields (Python-path launches, C++ launches)."""
    from anymla.triton_kernels import launcher
    python_launches = []
    init = launcher.Launcher.__init__
    monkeypatch.setattr(launcher.Launcher, "__init__", lambda self, fn, **o: init(self, _StandIn(fn, python_launches), **o))
    monkeypatch.setattr(launcher, "_driver", lambda: (lambda: 0, lambda device: 0))
    yield python_launches, compiled_path


def _value(raw: bytes):
    return struct.unpack({8: "<Q", 4: "<i", 1: "<b"}[len(raw)], raw)[0]


def _sparse_decode_args(fmt=kvcache.KVCacheFormat.V32_FP8, h=16, topk=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, s_q, nb, page = 2, 1, 8, 64
    d = fmt.spec.d_qk
    kv = torch.randn(nb, page, 1, d, generator=g).to(torch.bfloat16)
    cache = kv if fmt is kvcache.KVCacheFormat.BF16 else kvcache.quantize(kv, fmt)
    q = torch.randn(b, s_q, h, d, generator=g).to(torch.bfloat16)
    idx = torch.randint(0, nb * page, (b, s_q, topk), generator=g, dtype=torch.int32)
    return (q, cache, None, None, 512, anymla.get_mla_metadata()[0]), dict(softmax_scale=0.07, indices=idx,
                                                                        is_fp8_kvcache=fmt.is_quantized)


def _dense_decode_args(seed=0, h=16):
    g = torch.Generator().manual_seed(seed)
    b, s_q, nb, page = 2, 2, 6, 64
    q = torch.randn(b, s_q, h, 576, generator=g).to(torch.bfloat16)
    cache = torch.randn(nb, page, 1, 576, generator=g).to(torch.bfloat16)
    table = torch.randperm(nb, generator=g).to(torch.int32).view(b, nb // b)
    lens = torch.tensor([150, 97], dtype=torch.int32)
    return (q, cache, table, lens, 512, anymla.get_mla_metadata()[0]), dict(causal=True)


def _prefill_args(seed=0, s_kv=256, topk=64):
    g = torch.Generator().manual_seed(seed)
    s_q, h = 8, 16
    q = torch.randn(s_q, h, 576, generator=g).to(torch.bfloat16)
    kv = torch.randn(s_kv, 1, 576, generator=g).to(torch.bfloat16)
    idx = torch.randint(-1, max(s_kv, 1), (s_q, 1, topk), generator=g, dtype=torch.int32)
    return (q, kv, idx, 0.07), {}


CALLS = {
    "sparse decode V3.2": (anymla.flash_mla_with_kvcache, _sparse_decode_args, {}),
    "sparse decode V3.2, 2 splits": (anymla.flash_mla_with_kvcache, _sparse_decode_args, dict(num_splits=2)),
    "dense decode, 3 splits": (anymla.flash_mla_with_kvcache, _dense_decode_args, dict(num_splits=3)),
    # on Hopper the kernels of tensor-memory descriptors (dense, 64 heads) and of the MODEL1 cache
    "dense decode h64": (anymla.flash_mla_with_kvcache, functools.partial(_dense_decode_args, h=64), {}),
    "sparse decode MODEL1 h64": (anymla.flash_mla_with_kvcache, functools.partial(
        _sparse_decode_args, kvcache.KVCacheFormat.MODEL1_FP8, 64), {}),
    "sparse prefill": (anymla.flash_mla_sparse_fwd, _prefill_args, {}),
    # on Hopper bf16 caches: the few-head decoding kernel (split), and at 64 heads the prefill kernel (one key
    # block: no split)
    "sparse decode bf16 h16, 2 splits": (anymla.flash_mla_with_kvcache, functools.partial(
        _sparse_decode_args, kvcache.KVCacheFormat.BF16, 16), dict(num_splits=2)),
    "sparse decode bf16 h64": (anymla.flash_mla_with_kvcache, functools.partial(
        _sparse_decode_args, kvcache.KVCacheFormat.BF16, 64), {}),
}


def _roles(launches, tensors: dict):
    """Each launch parameter of a call as the Python path and the C++ path must agree on it: an address as
    (which of the call's tensors, offset) where it lies in one, an address in none (a workspace the call
    allocated) by the order it first appears in, anything else as its value."""
    spans = [(name, t.data_ptr(), t.untyped_storage().nbytes()) for name, t in tensors.items()]
    internal, out = {}, []
    for values in launches:
        for v in values:
            hit = [(name, v - base) for name, base, size in spans if v and base <= v < base + size]
            if not hit and v > 2 ** 32:  # no scalar parameter is this large: an address
                hit = [("workspace", internal.setdefault(v, len(internal)))]
            out.append(hit[0] if hit else ("value", v))
    return out


def _tensors(args, kwargs, outputs) -> dict:
    named = {f"arg{i}": a for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    named.update({k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
    named.update({f"out{i}": o for i, o in enumerate(outputs)})
    return named


@cpu_only
@pytest.mark.parametrize("name", list(CALLS))
def test_a_repeated_call_launches_in_cpp_what_the_python_path_launches(stand_ins, name):
    python_launches, cpp_launches = stand_ins
    fn, make, forced = CALLS[name]
    from anymla.triton_kernels import tuning
    # Tensor-memory descriptors are encoded by Triton's launcher, which these stand-ins do not have: the
    # interpreter's calls pass none (on a GPU the descriptor kernels are checked by their results, below).
    with anymla.use_backend("triton"), tuning.forced(tma=False, **forced):
        args, kwargs = make()
        fn(*args, **kwargs)  # the first call: planned, compiled (interpreted here), made an entry
        assert native.module().size() == 1, callpath.refusals()
        args, kwargs = make(seed=1)
        python_launches.clear()
        with anymla.debug_checks():  # debug checks keep the Python path
            expected = fn(*args, **kwargs)
        assert not cpp_launches and python_launches
        got = fn(*args, **kwargs)
    assert [(f, tuple(g)) for f, g, _ in python_launches] == [(f, tuple(g)) for f, g, _ in cpp_launches]

    def as_ints(values):  # a float parameter (the scale) comes back from the C++ path as its 32-bit pattern
        values = [v.data_ptr() if isinstance(v, torch.Tensor) else 0 if v is None else v for v in values]
        return [struct.unpack("<i", struct.pack("<f", v))[0] if isinstance(v, float) else int(v) for v in values]

    assert _roles([as_ints(v) for _, _, v in python_launches], _tensors(args, kwargs, expected)) == \
        _roles([v for _, _, v in cpp_launches], _tensors(args, kwargs, got))
    for e, g in zip(expected, got):
        assert (e.shape, e.stride(), e.dtype) == (g.shape, g.stride(), g.dtype)
        assert e.untyped_storage().data_ptr() != g.untyped_storage().data_ptr()


@cpu_only
def test_after_warmup_every_sizes_first_call_runs_its_entry(stand_ins):
    """``anymla.warmup`` leaves each batch size an entry: a server's first call at any size of the range, with
    its own tensors (views of its largest batch, as a serving engine slices them), runs in C++."""
    sizes = range(1, 5)
    big = sparse_decode_inputs(max(sizes), 1, 16, 256, 64, fmt=kvcache.KVCacheFormat.V32_FP8, device="cpu")
    big.update(tile_scheduler_metadata=None, backend="triton")

    def batch(b):
        return {k: (v[:b] if k in ("q", "indices") else v) for k, v in big.items()}

    report = anymla.warmup(anymla.flash_mla_with_kvcache, sizes=sizes, **batch(1))
    assert report.decisions == len(sizes) and native.module().size() == len(sizes), callpath.refusals()
    for b in sizes:
        hits = native.module().hits()
        out, _ = anymla.flash_mla_with_kvcache(**batch(b))
        assert native.module().hits() == hits + 1, f"b = {b}: the first call took the Python path"
        assert out.shape[0] == b


@cpu_only
def test_poisoned_outputs_on_the_compiled_path(stand_ins):
    """In poison mode (every test here) the entry's buffers start as NaN too: the stand-in launches write
    nothing, so the outputs must be all NaN."""
    assert buffers.poisoning()
    with anymla.use_backend("triton"):
        args, kwargs = _sparse_decode_args()
        anymla.flash_mla_with_kvcache(*args, **kwargs)
        out, lse = anymla.flash_mla_with_kvcache(*args, **kwargs)
    assert stand_ins[1] and out.isnan().all() and lse.isnan().all()


@cpu_only
def test_no_entry_where_the_python_path_does_more_than_launch(stand_ins):
    """Prefill over an empty kv fills its outputs with torch ops and launches nothing: no entry (it would not
    repeat the fills), the refusal says why, and every call keeps the Python path's results."""
    with anymla.use_backend("triton"):
        args, _ = _prefill_args(s_kv=0)
        for _ in range(2):
            out, max_logits, lse = anymla.flash_mla_sparse_fwd(*args)
            assert (out == 0).all() and (lse == math.inf).all() and (max_logits == -math.inf).all()
    assert native.module().size() == 0
    assert any("aten.zero_" in r or "aten.fill_" in r for r in callpath.refusals()), callpath.refusals()


@cpu_only
def test_entries_follow_the_call_key_and_the_selection_scope(stand_ins):
    _, cpp_launches = stand_ins
    args, kwargs = _sparse_decode_args()
    mod = native.module()

    def call(**changes):
        cpp_launches.clear()
        anymla.flash_mla_with_kvcache(*args, **{**kwargs, **changes})
        return len(cpp_launches)

    with anymla.use_backend("triton"):
        assert call() == 0 and call() == 1
        assert call(softmax_scale=0.08) == 0 and mod.size() == 2, "another scale: another key"
        with pytest.raises(ValueError, match="softmax_scale"):
            call(softmax_scale=float("nan"))
        with anymla.debug_checks():
            assert call() == 0, "debug checks read the data: the Python path"
    with anymla.use_backend("triton,reference"):
        assert call() == 0 and call() == 1 and mod.size() == 3, "another scope: its own entry"
    anymla.load_tuning(None)  # a new tuning version: the dispatcher decides afresh, and every entry goes
    with anymla.use_backend("triton"):
        assert call() == 0 and mod.size() == 1
        anymla.register_backend(_Extra())  # so does a change of the registry
        try:
            assert call() == 0 and mod.size() == 1 and call() == 1
        finally:
            anymla.unregister_backend(_Extra.name)


class _Extra(anymla.Backend):
    name, ops, device_types = "callpath-test-extra", frozenset(), ("cpu",)


@cpu_only
def test_scheduling_metadata_is_bound_as_the_python_path_binds_it(stand_ins):
    _, cpp_launches = stand_ins
    args, kwargs = _sparse_decode_args()
    with anymla.use_backend("triton"):
        anymla.flash_mla_with_kvcache(*args, **kwargs)
        fresh = anymla.get_mla_metadata()[0]
        anymla.flash_mla_with_kvcache(*args[:5], fresh, **kwargs)
        assert cpp_launches and fresh.have_initialized and fresh.config is args[5].config
        other_args, other_kwargs = _sparse_decode_args(h=32)
        with pytest.raises(ValueError, match="tile_scheduler_metadata"):
            anymla.flash_mla_with_kvcache(*other_args[:5], fresh, **other_kwargs)


@cpu_only
@pytest.mark.parametrize("h_q", [16, 64])
def test_a_peers_own_form_runs_its_repeated_calls(compiled_path, monkeypatch, h_q):
    """A backend with its own form of a signature's calls (the FlashMLA peer: FlashMLA called with the call's
    arguments) gets an entry that runs it: a repeated call reaches FlashMLA (here a stand-in recording what it
    is given) with what the dispatcher's path gives it, heads padded to 64, and returns outputs of the same
    layout. Once FlashMLA's metadata holds the configuration (its interface fills it on the first call), the
    entry calls FlashMLA's op itself, as the interface would."""
    from anymla.backends import flashmla_peer
    seen = []

    def outputs(q, d_v):
        b, s_q, h, _ = q.shape
        g = torch.Generator().manual_seed(len(seen) // 2)  # a call and its repeat get the same outputs
        return torch.randn(b, s_q, h, d_v, generator=g), torch.randn(b, s_q, h, generator=g).transpose(1, 2)

    def with_kvcache(q, k_cache, block_table, cache_seqlens, d_v, meta, num_splits, **kw):
        seen.append(("interface", q, kw.get("indices", block_table), kw["softmax_scale"]))
        meta.have_initialized, meta.tile_scheduler_metadata, meta.num_splits = True, torch.zeros(4), torch.ones(1)
        return outputs(q, d_v)

    def dense_decode_fwd(q, k_cache, d_v, cache_seqlens, block_table, sm_scale, causal, scheduling, splits):
        assert scheduling.shape == (4,) and splits.shape == (1,), "the metadata's tensors, as the interface passes them"
        seen.append(("op", q, block_table, sm_scale))
        return (*outputs(q, d_v), scheduling, splits)

    def sparse_decode_fwd(q, k_cache, indices, topk_length, attn_sink, scheduling, splits, extra_k_cache,
                          extra_indices, extra_topk_length, d_v, sm_scale):
        assert scheduling.shape == (4,) and splits.shape == (1,), "the metadata's tensors, as the interface passes them"
        seen.append(("op", q, indices, sm_scale))
        return (*outputs(q, d_v), scheduling, splits)

    def sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length):
        s_q, h, _ = q.shape
        return torch.zeros(s_q, h, d_v), torch.zeros(s_q, h), torch.ones(s_q, h)

    def metadata():
        return types.SimpleNamespace(have_initialized=False, tile_scheduler_metadata=None, num_splits=None), None

    fake = types.SimpleNamespace(flash_mla_with_kvcache=with_kvcache, get_mla_metadata=metadata,
                                 flash_mla_sparse_fwd=sparse_fwd, flash_mla_interface=types.SimpleNamespace(
                                     flash_mla_cuda=types.SimpleNamespace(sparse_decode_fwd=sparse_decode_fwd,
                                                                          dense_decode_fwd=dense_decode_fwd)))
    monkeypatch.setattr(flashmla_peer, "_flash_mla", lambda: (fake, ""))
    monkeypatch.setattr(flashmla_peer.FlashMLAPeer, "device_types", ("cpu",))
    monkeypatch.setattr(flashmla_peer.FlashMLAPeer, "unavailable_reasons", lambda self, device: [])
    monkeypatch.setattr(flashmla_peer, "_arch", lambda device: 9)
    args, kwargs = _sparse_decode_args(h=h_q)
    hits = native.module().hits()
    calls = [anymla.flash_mla_with_kvcache(*args, **kwargs, backend="flashmla") for _ in range(3)]
    assert native.module().hits() == hits + 2, callpath.refusals()
    assert [s[0] for s in seen] == ["interface", "op", "op"]
    (_, q0, i0, s0), (_, q1, i1, s1), (_, q2, i2, s2) = seen
    assert q1.shape[2] == 64 and torch.equal(q0, q1) and torch.equal(q1, q2)
    assert i0 is i1 is i2 is kwargs["indices"] and s0 == s1 == s2 == 0.07
    for first, python, compiled in zip(*calls):
        assert first.shape == compiled.shape and first.stride() == compiled.stride() and torch.equal(python, compiled)
    assert calls[2][0].shape[2] == h_q and calls[2][1].shape[1] == h_q
    prefill, _ = _prefill_args(topk=128)
    outputs_ = [anymla.flash_mla_sparse_fwd(*prefill, backend="flashmla") for _ in range(2)]
    assert native.module().hits() == hits + 3 and [o.shape[1] for o in outputs_[1]] == [16, 16, 16]
    # dense decoding: the same, FlashMLA's dense op once the metadata is initialized (no head padding)
    seen.clear()
    args, kwargs = _dense_decode_args(h=h_q)
    dense = [anymla.flash_mla_with_kvcache(*args, **kwargs, backend="flashmla") for _ in range(3)]
    assert native.module().hits() == hits + 5, callpath.refusals()
    assert [s[0] for s in seen] == ["interface", "op", "op"]
    assert all(s[1] is args[0] and s[2] is args[2] and s[3] == args[0].shape[-1] ** -0.5 for s in seen)
    for first, python, compiled in zip(*dense):
        assert first.stride() == compiled.stride() and torch.equal(python, compiled)


def _layer_and_inputs(fmt, seed=0, device="cpu", topk=16):
    from anymla.layers import MLAAttention, MLAConfig
    g = torch.Generator().manual_seed(seed)
    cfg = MLAConfig(hidden_size=32, num_heads=2, q_lora_rank=16, qk_nope_head_dim=16, v_head_dim=16,
                    max_position_embeddings=64)
    layer = MLAAttention(cfg)
    for b in layer.buffers():
        b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    pos = torch.tensor([[40], [50]])
    cache = torch.randn(8, 16, 1, 576, generator=g).bfloat16()
    if fmt is kvcache.KVCacheFormat.V32_FP8:  # (random bytes would hold NaN codes and scales)
        cache = kvcache.quantize(cache, fmt)
    inp = dict(hidden_states=torch.randn(2, 1, 32, generator=g).bfloat16(), positions=pos,
               block_table=torch.arange(8, dtype=torch.int32).view(2, 4), kv_cache=cache,
               cache_seqlens=(pos[:, 0] + 1).int(), residual=torch.randn(2, 1, 32, generator=g).bfloat16(),
               indices=torch.randint(0, 40, (2, 1, topk), generator=g) if fmt is kvcache.KVCacheFormat.V32_FP8 else None)
    return layer.to(device), {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inp.items()}


def _v4_layer_and_inputs(fmt, seed=0, device="cpu"):
    from anymla.layers import V4Attention, V4Config
    g = torch.Generator().manual_seed(seed)
    layer = V4Attention(V4Config(hidden_size=32, num_heads=4, q_lora_rank=16, o_groups=2, o_lora_rank=8,
                                 sliding_window=4))
    for b in layer.buffers():
        b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    rows = torch.randn(8, 16, 1, 512, generator=g).bfloat16()
    inp = dict(hidden_states=torch.randn(2, 1, 32, generator=g).bfloat16(), positions=torch.tensor([[40], [50]]),
               kv_cache=kvcache.quantize(rows, fmt), block_table=torch.arange(8, dtype=torch.int32).view(2, 4),
               residual=torch.randn(2, 1, 32, generator=g).bfloat16())
    return layer.to(device), {k: v.to(device) for k, v in inp.items()}


# The layers whose decode steps become entries: V3 / V3.2 (MLAAttention) and V4 (V4Attention).
LAYERS = {"MLA BF16": functools.partial(_layer_and_inputs, kvcache.KVCacheFormat.BF16),
          "MLA V32_FP8": functools.partial(_layer_and_inputs, kvcache.KVCacheFormat.V32_FP8),
          "V4 MODEL1_FP8": functools.partial(_v4_layer_and_inputs, kvcache.KVCacheFormat.MODEL1_FP8),
          "V4 V41_FP4": functools.partial(_v4_layer_and_inputs, kvcache.KVCacheFormat.V41_FP4)}




@cpu_only
@pytest.mark.parametrize("name", list(LAYERS))
def test_a_layer_step_runs_in_cpp_what_its_python_path_runs(stand_ins, name):
    """A layer's decode step as one entry: its GEMMs through ATen's dispatcher, its kernels and its
    attention call's kernels launched with the parameters the Python path gives them (the layer's weights
    and tables as the entry's constants); the entry goes when the layer does."""
    import gc
    python_launches, cpp_launches = stand_ins
    make = LAYERS[name]
    layer, inp = make()
    mod = native.module()
    with anymla.use_backend("triton"), torch.no_grad():
        layer(**inp)
        assert mod.size() == 1, callpath.refusals()
        _, fresh = make(seed=1)
        fresh["kv_cache"] = inp["kv_cache"]  # the layer writes the cache it was given
        python_launches.clear()
        with callpath.python_path():  # (debug checks would read the slots the stand-in kernels never write)
            expected = layer(**fresh)
        hits = mod.hits()
        got = layer(**fresh)
    assert mod.hits() == hits + 1 and len(cpp_launches) == len(python_launches) >= 3
    tensors = {**{k: v for k, v in fresh.items() if isinstance(v, torch.Tensor)},
               **{f"buffer{i}": b for i, b in enumerate(layer.buffers())}}

    def as_ints(values):
        values = [v.data_ptr() if isinstance(v, torch.Tensor) else 0 if v is None else v for v in values]
        return [struct.unpack("<i", struct.pack("<f", v))[0] if isinstance(v, float) else int(v) for v in values]

    assert _roles([as_ints(v) for _, _, v in python_launches], {**tensors, "out": expected}) == \
        _roles([v for _, _, v in cpp_launches], {**tensors, "out": got})
    assert (got.shape, got.dtype, got.stride()) == (expected.shape, expected.dtype, expected.stride())
    del layer
    gc.collect()
    assert mod.size() == 0


@cpu_only
def test_a_step_calls_the_peers_own_form_where_its_attention_runs_on_a_peer(stand_ins, monkeypatch):
    """A layer step whose attention call runs on another backend (FlashMLA here: a stand-in recording its
    calls), whose kernels a watch does not see, is an entry still: its attention a call of the peer's own form
    (FlashMLA called as the dispatcher's path calls it), the rest launched from C++; each call reaches the
    peer once and the step's output is the Python path's."""
    from anymla.backends import flashmla_peer
    seen = []

    def with_kvcache(q, k_cache, block_table, cache_seqlens, d_v, meta, num_splits, **kw):
        seen.append((q.shape, kw["indices"].shape, kw["softmax_scale"]))
        b, s_q, h, _ = q.shape
        return torch.full((b, s_q, h, d_v), 0.5, dtype=q.dtype), torch.zeros(b, s_q, h).transpose(1, 2)

    fake = types.SimpleNamespace(flash_mla_with_kvcache=with_kvcache, get_mla_metadata=lambda: (object(), None))
    monkeypatch.setattr(flashmla_peer, "_flash_mla", lambda: (fake, ""))
    monkeypatch.setattr(flashmla_peer.FlashMLAPeer, "device_types", ("cpu",))
    monkeypatch.setattr(flashmla_peer.FlashMLAPeer, "unavailable_reasons", lambda self, device: [])
    monkeypatch.setattr(flashmla_peer, "_arch", lambda device: 9)
    layer, inp = _layer_and_inputs(kvcache.KVCacheFormat.V32_FP8, topk=64)  # (FlashMLA: topk in 64s)
    layer.attention_backend = "flashmla"
    mod = native.module()
    with anymla.use_backend("triton"), torch.no_grad():
        with callpath.python_path():  # (the first call's validation and planning run torch ops of their own)
            expected = layer(**inp)
        layer(**inp)  # watched: the step's entry
        hits = mod.hits()
        got = [layer(**inp) for _ in range(2)]
    assert mod.hits() == hits + 2 and mod.size() == 1, callpath.refusals()
    assert len(seen) == 4 and len(set(seen)) == 1, seen
    assert all(torch.equal(expected, g) for g in got)
    assert not callpath.refusals()


@cpu_only
def test_an_entrys_aten_ops_compute_what_the_python_path_computes(compiled_path):
    """The ATen steps of an entry, run for real on the CPU: a layer step's glue (GEMMs into views of
    allocations, transposed operands, a residual through addmm) watched once, then replayed from C++ on fresh
    inputs, gives the Python function's result bit for bit."""
    g = torch.Generator().manual_seed(3)
    w_a, w_uk, w_o = (torch.randn(*shape, generator=g) for shape in ((24, 16), (4, 3, 8), (10, 4 * 8)))

    def glue(x, residual):
        t = x.shape[0]
        a = torch.nn.functional.linear(x, w_a).view(t, 4, 6)
        q = torch.empty(t, 4, 8)
        torch.bmm(a[..., :3].transpose(0, 1), w_uk, out=q.transpose(0, 1))
        return torch.addmm(residual, q.reshape(t, 32), w_o.t()).view(t, 1, 10)

    mod = native.module()
    args = (7, torch.randn(5, 16, generator=g), torch.randn(5, 10, generator=g))  # (a scope, then the inputs)
    result, watch = callpath._watched(lambda: glue(*args[1:]))
    callpath._make(mod, None, callpath.MLA_STEP, args, (result,), watch, "test", [w_a, w_uk, w_o], 0, "glue")
    assert mod.has(callpath.MLA_STEP, args), callpath.refusals()
    fresh = (7, torch.randn(5, 16, generator=g), torch.randn(5, 10, generator=g))
    (got,) = mod.call(callpath.MLA_STEP, False, None, *fresh)
    expected = glue(*fresh[1:])
    assert torch.equal(got, expected) and got.stride() == expected.stride()


def test_ptx_parameters_are_read_in_order_with_their_sizes():
    """The form of Triton's PTX entries (pointers, 32-bit ints and floats, bytes, 64-bit ints, a 128-byte
    tensor map)."""
    ptx = """//
.visible .entry sparse_kernel(
\t.param .u64 .ptr .global .align 1 sparse_kernel_param_0,
\t.param .u32 sparse_kernel_param_1,
\t.param .align 64 .b8 sparse_kernel_param_2[128],
\t.param .f32 sparse_kernel_param_3,
\t.param .u8 sparse_kernel_param_4,
\t.param .u64 sparse_kernel_param_5,
\t.param .u64 .ptr .global .align 1 sparse_kernel_param_6
)
.reqntid 128
{
\t.reg .pred \t%p<2>;
"""
    assert ptx_param_sizes(ptx) == [8, 4, 128, 4, 1, 8, 8]


_PEER_CALLS = {"sparse decode V3.2 h64": (anymla.flash_mla_with_kvcache, functools.partial(_sparse_decode_args, h=64), {}),
               "sparse prefill": (anymla.flash_mla_sparse_fwd, functools.partial(_prefill_args, topk=128), {})}


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA GPU: compiled kernels")
@pytest.mark.parametrize("name, kernels", [(n, k) for n in CALLS for k in ("default", "portable")] +
                         [(n, "flashmla") for n in _PEER_CALLS])
def test_the_compiled_path_gives_the_python_paths_results_bit_for_bit(name, kernels):
    """On the GPU: a call through the entry point returns exactly what the Python path returns for the same
    inputs (the same kernels and parameters, or FlashMLA's own form where the peer runs the call), and both
    agree with the reference."""
    native.build(wait=True)
    assert native.module() is not None, native.reason()
    from anymla.triton_kernels import tuning
    backend = "flashmla" if kernels == "flashmla" else "triton"
    if backend not in anymla.available_backends(DEVICE):
        pytest.skip("flash_mla is not installed")
    fn, make, forced = (_PEER_CALLS if backend == "flashmla" else CALLS)[name]
    forced = dict(forced, warp_specialized=False) if kernels == "portable" else forced

    def on_gpu(args, kwargs):
        move = lambda a: a.to(DEVICE) if isinstance(a, torch.Tensor) else a  # noqa: E731
        return [move(a) for a in args], {k: move(v) for k, v in kwargs.items()}

    with anymla.use_backend(backend), tuning.forced(**forced):
        args, kwargs = on_gpu(*make())
        fn(*args, **kwargs)
        args, kwargs = on_gpu(*make(seed=1))
        fn(*args, **kwargs)  # a new cache: kernels of tensor-memory descriptors (which encode it) record it
        with anymla.debug_checks():
            expected = fn(*args, **kwargs)
        hits = native.module().hits()
        got = fn(*args, **kwargs)
        assert native.module().hits() == hits + 1, callpath.refusals()
    with anymla.use_backend("reference"):
        reference = fn(*args, **kwargs)
    for e, g, r in zip(expected, got, reference):
        assert torch.equal(e, g) or (e.isnan() == g.isnan()).all() and torch.equal(e.nan_to_num(), g.nan_to_num())
        finite = r.isfinite()
        assert torch.equal(finite, g.isfinite())
        torch.testing.assert_close(g[finite].float(), r[finite].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA GPU: compiled kernels")
@pytest.mark.parametrize("name", [*LAYERS, "MLA V32_FP8, attention on FlashMLA"])
def test_a_layer_step_through_the_compiled_path_gives_its_python_paths_output(name):
    """On the GPU: a repeated layer step through its entry returns exactly the Python path's output for the
    same inputs, and writes the cache as it does; also with its attention on the FlashMLA peer (a call of its
    own form inside the step)."""
    on_peer = name not in LAYERS
    if on_peer:
        from anymla.backends import flashmla_peer
        why = flashmla_peer.FlashMLAPeer().unavailable_reasons(DEVICE)
        if why:
            pytest.skip(f"FlashMLA cannot run here: {'; '.join(why)}")
    native.build(wait=True)
    make = functools.partial(_layer_and_inputs, kvcache.KVCacheFormat.V32_FP8, topk=64) if on_peer else \
        LAYERS[name]  # (FlashMLA: topk in 64s)
    make = functools.partial(make, device=DEVICE)
    layer, inp = make()
    layer.attention_backend = "flashmla" if on_peer else None
    with torch.no_grad():
        layer(**inp)
        _, fresh = make(seed=1)
        cache = fresh["kv_cache"]
        with callpath.python_path():
            expected = layer(**fresh)
        written = cache.clone()
        cache.copy_(make(seed=1)[1]["kv_cache"])
        hits = native.module().hits()
        got = layer(**fresh)
        assert native.module().hits() == hits + 1, callpath.refusals()
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(cache, written)


def test_the_overhead_benchs_compiled_dispatch_probe_runs_on_entries(compiled_path):
    """``bench.overhead.dispatch`` on a device whose calls have entries times the compiled call path (its probe
    backend's own form of the calls), not the Python path: every timed call after the first of each op hits."""
    from anymla.bench import overhead
    hits = native.module().hits()
    made = selection.decisions_made()
    r = overhead.dispatch("cpu")
    assert r["sparse_decode_us"] > 0 and r["dense_decode_us"] > 0
    assert selection.decisions_made() == made + 2  # one decision an op: the first call of each
    assert native.module().hits() - hits >= 2 * (200 + 5 * 4000 - 1), callpath.refusals()


def test_build_ignores_a_lock_left_behind_and_reuses_its_library(tmp_path):
    """A process that exited mid-build leaves torch's lock file in its extension directory; a build that honoured it
    would wait forever. The library it builds is kept and loaded by the next process without building again."""
    import subprocess
    import sys
    why = native._why_not_buildable()
    if why:
        pytest.skip(why)
    stale = tmp_path / native.NAME
    stale.mkdir()
    (stale / "lock").touch()
    probe = ("import torch, anymla.callpath as c; from anymla.callpath import native; "
             "print(native.cached_library().exists(), c.prepare(torch.device('cuda')))")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=600)
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr
    assert [run.stdout.split()[0] for run in runs] == ["False", "True"], [run.stdout for run in runs]
    assert all(run.stdout.strip().endswith("in use") for run in runs), [run.stdout for run in runs]
    built = [p.name for p in stale.iterdir()]
    assert built and all(not name.startswith(native.NAME + "-") for name in built), built  # no private directory left


def test_prepare_waits_for_the_build_at_most_its_timeout(monkeypatch):
    """A build that does not end (a stuck compiler) leaves prepare's caller on the Python path after the timeout,
    saying so, instead of waiting forever."""
    import threading
    release = threading.Event()
    monkeypatch.setattr(native, "_why_not_buildable", lambda: None)
    monkeypatch.setattr(native, "_build", lambda: release.wait(60))
    for key, value in (("module", None), ("thread", None), ("reason", "not built yet")):
        monkeypatch.setitem(native._state, key, value)
    said = callpath.prepare(torch.device("cuda"), timeout=0.2)
    release.set()
    native._state["thread"].join()
    assert said == "compiled call path: not in use (still being built after 0.2 s)", said
