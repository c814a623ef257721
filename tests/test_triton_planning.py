"""Host-side planning of the Triton tier: split counts and the fall-back ladder for configs that do not fit."""

import os
import subprocess
import sys
import zlib

import pytest
import torch

from anymla.triton_kernels.fit import shrinking
from anymla.triton_kernels.splits import MAX_SPLITS, choose_num_splits
from anymla.triton_kernels.tuning import TileConfig


@pytest.mark.parametrize("programs, per_core, expected", [
    (64, 1, 2),     # 64 programs of a whole-SM tile on 132 SMs: two splits fill them once
    (64, 2, 4),     # half-SM tiles: two run on each SM
    (128, 1, 1),    # already one round
    (128, 2, 2),
    (2, 1, MAX_SPLITS),  # one long request: as many as allowed
])
def test_splits_fill_every_core_once(programs, per_core, expected):
    assert choose_num_splits(programs, 1024, 132, per_core, False) == expected


def test_splits_keep_two_key_blocks_each_and_never_split_batch_invariant_calls():
    assert choose_num_splits(1, 6, 132, 1, False) == 3
    assert choose_num_splits(1, 1, 132, 1, False) == 1
    assert choose_num_splits(1, 1024, 132, 1, True) == 1


def test_programs_per_core_follow_the_register_file():
    assert TileConfig(64, 64, 8, 1).programs_per_core == 1
    assert TileConfig(16, 32, 4, 6).programs_per_core == 2


def test_shrinking_halves_stages_then_key_blocks_then_head_blocks():
    got = [(t.block_h, t.block_n, t.num_stages, t.num_warps) for t in shrinking(TileConfig(64, 32, 8, 6))]
    assert got == [(64, 32, 6, 8), (64, 32, 3, 8), (64, 32, 1, 8), (64, 16, 1, 8), (32, 16, 1, 4), (16, 16, 1, 4)]


# With an empty Triton cache, two at a time on 2 cores: 80, 90, 100 35-45 s each (15 configs), gfx942 and gfx90a
# ~18 s, 86 and 120 ~10 s (5 configs).
SHIPPED_ARCHS_IN_CI = ("90", "100", "120", "80", "86", "gfx942", "gfx90a")


@pytest.mark.parametrize("arch", SHIPPED_ARCHS_IN_CI)
def test_shipped_tiles_fit_each_gpu_generation(arch):
    """Every config the tuning table ships for Hopper, Blackwell (sm_100), consumer Blackwell (sm_120),
    A100-class, 99 KB (sm_86/89) and AMD MI300/MI250 GPUs compiles for that architecture, fits its shared memory
    as shipped and spills no more than its budget (offline, no GPU)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "anymla.triton_kernels.compile_report", "--shipped", "--arch",
                          arch], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]


def test_hopper_kernels_build_for_sm90_and_fit():
    """The Gluon kernels (triton_kernels/hopper/) compile for sm_90 with the installed Triton, within the
    shared memory of a block and without more than a few spilled bytes (offline, no GPU)."""
    from anymla.triton_kernels import runtime
    if not runtime.gluon_hopper():
        pytest.skip("this Triton's Gluon is not a version the Hopper kernels were checked with (3.6, 3.7)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "anymla.triton_kernels.compile_report", "--hopper"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stdout.count(" fits ") == 22, res.stdout


@pytest.mark.parametrize("arch", ("80", "86", "89", "90", "120"))
def test_ampere_mma_v2_kernels_build_for_each_arch(arch):
    """The Gluon mma_v2 kernels (triton_kernels/ampere/: sparse prefill at d_qk 576 and 512, V3.2 FP8 sparse
    decoding, dense decoding) compile for the GPUs without wgmma (and for sm_90, their stand-in) with the tiles their launches
    pick: no spills (the V3.2 decoding kernel: within its measured allowance, ``AMPERE_DECODE_SPILL_BUDGET``),
    within shared memory, and the launches' estimates of that memory right (offline, no GPU)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.ampere", reason="this Triton has no Gluon mma_v2")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-m", "anymla.triton_kernels.compile_report", "--ampere", "--arch", arch],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stdout.count(" fits ") == 4, res.stdout


def test_harness_names_the_kernel_each_configuration_ran():
    """``harness --mma-v2`` times each configuration also with the mma_v2 kernels off, and every row names the
    kernel the dispatcher's plan ran (explain()'s words), so a stand-in row says whether mma_v2 ran."""
    import anymla
    from anymla.testing import prefill_inputs
    from anymla.triton_kernels import tuning
    from anymla.triton_kernels.harness import Config, _describe, _kernel
    assert _describe(Config(mma_v2=False)) == "shipped mma_v2 off"
    args = prefill_inputs(2, 16, 576, 64, 32)
    assert _kernel(anymla.flash_mla_sparse_fwd, args, lambda: tuning.forced(mma_v2=False)) == "portable sparse kernel"
    assert _kernel(anymla.flash_mla_sparse_fwd, args, lambda: tuning.forced(mma_v2=True)) == "none: ValueError"


def test_mma_v2_kernels_take_calls_only_on_mma_sync_gpus(monkeypatch):
    """sm_80, sm_86/89 and sm_120 (patched in here) are theirs; sm_90 only as the stand-in (DISABLE_MMA_V3=1),
    never sm_100, older GPUs, AMD or the CPU; switched off or a forced portable tile keeps the portable kernel,
    and forcing them where they cannot run raises with the reasons."""
    from anymla.triton_kernels import runtime, tuning
    from anymla.triton_kernels.ampere import serve
    assert serve.device_reasons(torch.device("cpu")) == ["they run on NVIDIA GPUs only"]
    gpu = torch.device("cuda", 0)
    capability = {}
    monkeypatch.setattr(runtime, "rocm", lambda: False)
    monkeypatch.setattr(runtime, "gluon_ampere", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["now"])
    monkeypatch.delenv("DISABLE_MMA_V3", raising=False)
    for cap, theirs in (((8, 0), True), ((8, 6), True), ((8, 9), True), ((12, 0), True), ((7, 5), False),
                        ((9, 0), False), ((10, 0), False)):
        capability["now"] = cap
        assert (serve.device_reasons(gpu) == []) == theirs, cap
    capability["now"] = (9, 0)
    monkeypatch.setenv("DISABLE_MMA_V3", "1")
    assert serve.device_reasons(gpu) == []
    with tuning.forced(mma_v2=False):
        assert serve.device_reasons(gpu)[0].startswith("turned off")
    with tuning.forced(TileConfig(16, 32, 4, 2)):
        assert serve.device_reasons(gpu) == ["a tile of the portable kernel is forced"]
    monkeypatch.setattr(runtime, "rocm", lambda: True)
    assert serve.device_reasons(gpu) == ["they run on NVIDIA GPUs only"]
    assert serve.use([], []) and not serve.use(["x"], [])
    with tuning.forced(mma_v2=True), pytest.raises(ValueError, match="mma_v2 kernel was forced, but: x; y"):
        serve.use(["x"], ["y"])
    # A plan's decision: the call is asked about only on a device of theirs, and only where no Hopper kernel runs.
    monkeypatch.setattr(runtime, "rocm", lambda: False)
    assert serve.decide(False, gpu, lambda: []) == (True, [], [])
    assert serve.decide(False, gpu, lambda: ["too few heads"]) == (False, [], ["too few heads"])
    assert serve.decide(True, gpu, lambda: []) == (False, [], [])
    assert serve.decide(False, torch.device("cpu"), lambda: 1 / 0) == (False, ["they run on NVIDIA GPUs only"], [])


def test_mma_v2_kernels_state_why_they_do_not_take_a_call():
    """Prefill: one kv head, d_qk 512/576 with d_v 512, 16-bit q and kv alike, rows 16-byte aligned, 33 heads or
    more (unless forced); sparse decoding: a V3.2 FP8 cache alone and bf16 q; dense decoding: one kv head and 33
    query rows a request or more. What explain() then says."""
    from anymla.kvcache import KVCacheFormat as F
    from anymla.problems import DenseDecode, decode_problem
    from anymla.testing import dense_decode_inputs, prefill_inputs, sparse_decode_inputs
    from anymla.triton_kernels import tuning
    from anymla.triton_kernels.ampere import serve

    def prefill(h_q=64, d=576, **kw):
        a = prefill_inputs(2, h_q, d, 64, 32, **kw)
        return serve.prefill_reasons(a["q"], a["kv"], 512)

    assert prefill() == [] and prefill(d=512) == [] and prefill(h_q=40) == []
    assert "16 heads a token" in prefill(h_q=16)[0]
    with tuning.forced(mma_v2=True):
        assert prefill(h_q=16) == []
    assert any("h_kv 2" in r for r in prefill(h_q=128, h_kv=2))
    assert any("float32" in r for r in prefill(dtype=torch.float32))

    def decode(fmt, h_q=64, **kw):
        a = sparse_decode_inputs(1, 1, h_q, 64, 32, fmt=fmt, poison=False, **kw)
        return serve.decode_reasons(decode_problem(
            a["q"], a["k_cache"], None, None, 512, None, False, False, a["indices"], None, a.get("extra_k_cache"),
            a.get("extra_indices_in_kvcache"), None, None, False, None))

    assert decode(F.V32_FP8) == [] and decode(F.V32_FP8, h_q=128) == []
    for fmt in (F.MODEL1_FP8, F.V41_FP8, F.BF16):
        assert f"a {fmt.name} cache" in decode(fmt)[0], fmt
    assert "with an extra cache" in decode(F.V32_FP8, extra=dict(fmt=F.V32_FP8, page=64, s_k=64, topk=32))[0]
    assert serve.running("64 keys a block", ["r"], 3) == ("the mma_v2 sparse kernel (triton_kernels/ampere/: 64 query "
                                                          "rows a program, 64 keys a block, 8 warps); not the "
                                                          "Hopper one: r; 3 splits along the keys")
    assert serve.not_running([], ["y"]) == "; not the mma_v2 one: y" and serve.not_running(["x"], ["y"]) == ""
    a = prefill_inputs(2, 64, 576, 64, 32)
    wide = torch.zeros(2, 64, 580, dtype=a["q"].dtype)[..., :576]  # rows 1160 bytes apart
    assert any("rows are not 16-byte aligned" in r for r in serve.prefill_reasons(wide, a["kv"], 512))

    def dense(s_q, h_q, h_kv=1):
        a = dense_decode_inputs(2, s_q, h_q, h_kv, 64)
        return serve.dense_reasons(DenseDecode(a["q"], a["k_cache"], a["block_table"], a["cache_seqlens"], 0.1))

    assert dense(1, 64) == [] and dense(2, 32) == []  # 64 query rows a request either way
    assert "32 query rows a request" in dense(1, 32)[0] and any("h_kv 2" in r for r in dense(1, 64, 2))


def test_hopper_kernels_are_chosen_only_where_they_were_checked(monkeypatch):
    """Their tile is told apart from the portable kernels' (a forced portable tile turns them off); Gluon
    versions outside the checked ones, and devices other than sm_90, keep the portable kernels."""
    import triton
    from anymla.triton_kernels import runtime, tuning
    assert tuning.warp_specialized_config() == tuning.TileConfig(64, 64, 12, 2, False)
    with tuning.forced(tuning.TileConfig(64, 64, 8, 1)):
        assert tuning.warp_specialized_config() is None
    with tuning.forced(tuning.TileConfig(64, 32, 12, 4)):
        assert tuning.warp_specialized_config().block_n == 32
    runtime.gluon_hopper.cache_clear()
    monkeypatch.setattr(triton, "__version__", "3.5.1")
    try:
        assert not runtime.gluon_hopper()
    finally:
        runtime.gluon_hopper.cache_clear()
    from anymla.triton_kernels.hopper import launch
    assert launch._device_reasons(torch.device("cpu"), tuning.TileConfig(64, 64, 8, 3))


def _dense_problem(h_kv=1, page=64, dtype=torch.bfloat16):
    from anymla.problems import DenseDecode
    from anymla.testing import dense_decode_inputs
    a = dense_decode_inputs(2, 2, 64, h_kv, 140, page=page, dtype=dtype)
    return DenseDecode(a["q"], a["k_cache"], a["block_table"], a["cache_seqlens"], 0.1, causal=True)


def test_hopper_kernels_state_why_they_do_not_take_a_call(monkeypatch):
    """On an sm_90 GPU with a checked Gluon (patched in here), the reasons name what does not fit: kv heads,
    page size, dtype, packing; forcing the kernel then raises with those reasons."""
    from anymla.triton_kernels import runtime, tuning
    from anymla.triton_kernels.hopper import launch
    monkeypatch.setattr(runtime, "device_kind", lambda device: "cuda_sm90")
    monkeypatch.setattr(runtime, "gluon_hopper", lambda: True)
    tile = tuning.TileConfig(64, 64, 8, 2)
    assert launch.dense_decode_reasons(_dense_problem(), tile) == []
    assert "h_kv 2" in launch.dense_decode_reasons(_dense_problem(h_kv=2), tile)[0]
    assert "page size 53" in launch.dense_decode_reasons(_dense_problem(page=53), tile)[0]
    assert "float32" in launch.dense_decode_reasons(_dense_problem(dtype=torch.float32), tile)[0]
    # few rows a kv head: 16 keep the portable kernel, 32 (tensor-parallel h_q 32) take the Hopper one
    assert "at most 16 query rows" in launch.dense_decode_reasons(_dense_problem(), tuning.TileConfig(16, 32, 4, 6))[0]
    assert launch.dense_decode_reasons(_dense_problem(), tuning.TileConfig(32, 32, 4, 6)) == []
    with tuning.forced(warp_specialized=True):
        with pytest.raises(ValueError, match="forced, but: h_kv 2"):
            launch.use(launch.dense_decode_reasons(_dense_problem(h_kv=2), tile))
    assert launch.describe([], "dense decode", tile, 1).startswith("the warp-specialized Hopper kernel")


def _bf16_decode_problem(b, h_q, **kw):
    from anymla.kvcache import KVCacheFormat
    from anymla.problems import decode_problem
    from anymla.testing import sparse_decode_inputs
    a = sparse_decode_inputs(b, 1, h_q, 1100, 1024, fmt=KVCacheFormat.BF16, page=16, poison=False, **kw)
    return decode_problem(a["q"], a["k_cache"], None, None, 512, None, False, False, a["indices"], None,
                          a.get("extra_k_cache"), a.get("extra_indices_in_kvcache"), None, None, False, None)


def test_bf16_sparse_decoding_picks_its_hopper_kernel(monkeypatch):
    """On an sm_90 GPU (patched in here): at most 32 heads the few-head decoding kernel takes any bf16 call whose
    cache blocks lie back to back, whatever its split count; more heads go to the prefill kernel only where the
    decoding kernels would not split (132 multiprocessors, 16 key blocks: more than 66 programs) or when forced,
    never with forced splits; an extra cache or non-packed blocks keep the portable kernel."""
    from anymla.kvcache import KVCacheFormat
    from anymla.triton_kernels import runtime, tuning
    from anymla.triton_kernels.hopper import launch
    monkeypatch.setattr(runtime, "device_kind", lambda device: "cuda_sm90")
    monkeypatch.setattr(runtime, "gluon_hopper", lambda: True)
    tile, cores = tuning.TileConfig(64, 64, 8, 1), 132
    assert not launch.bf16_decode_through_prefill(16) and not launch.bf16_decode_through_prefill(32)
    assert launch.bf16_decode_through_prefill(40) and launch.bf16_decode_through_prefill(128)
    assert launch.bf16_decode_reasons(_bf16_decode_problem(4, 16), tile, cores) == []
    assert launch.bf16_decode_reasons(_bf16_decode_problem(67, 64), tile, cores) == []
    assert "the portable kernel splits the keys" in launch.bf16_decode_reasons(_bf16_decode_problem(66, 64), tile,
                                                                               cores)[0]
    with tuning.forced(warp_specialized=True):
        assert launch.bf16_decode_reasons(_bf16_decode_problem(4, 64), tile, cores) == []
    with tuning.forced(num_splits=3):
        assert "splits forced" in launch.bf16_decode_reasons(_bf16_decode_problem(67, 64), tile, cores)[0]
        assert launch.bf16_decode_reasons(_bf16_decode_problem(4, 16), tile, cores) == []
    assert "not packed" in launch.bf16_decode_reasons(_bf16_decode_problem(4, 16, block_pad=1), tile, cores)[0]
    extra = dict(fmt=KVCacheFormat.BF16, page=16, s_k=100, topk=64)
    assert "an extra cache" in launch.bf16_decode_reasons(_bf16_decode_problem(4, 16, extra=extra), tile, cores)[0]


def test_compile_report_reads_prefetch_depth_per_loop():
    from anymla.triton_kernels.compile_report import _prefetch_groups
    loop = "scf.for %i {{\n  %t = ttg.async_wait %a {{num = {} : i32}}\n  scf.yield %x\n}}\n"
    drain = "%d = ttg.async_wait {num = 0 : i32}\n"  # after the loop: not a prefetch depth
    assert _prefetch_groups("module {\n" + loop.format(5) + drain + loop.format(2) + drain) == 2
    assert _prefetch_groups("module {\n" + loop.format(0) + drain) == 0
    assert _prefetch_groups("module { scf.for %i { scf.yield } }") == -1


def test_amd_gpus_get_their_own_tiles_and_no_nvidia_only_paths(monkeypatch):
    """Under torch's ROCm build AMD GPUs are ``cuda`` devices whose capability numbers mean something else
    (an MI300X says 9.4): they must not be taken for Hopper (TMA tiles, 227 KB configs, OCP fp8 hardware)."""
    import torch
    from anymla.triton_kernels import runtime
    from anymla.triton_kernels.tuning import dense_config, sparse_config
    monkeypatch.setattr(runtime, "rocm", lambda: True)
    gpu = torch.device("cuda", 0)
    assert runtime.device_kind.__wrapped__(gpu) == "rocm"
    assert not runtime.tensor_memory_copies.__wrapped__(gpu)
    assert not runtime.native_fp8.__wrapped__(gpu)
    assert sparse_config("rocm", 128, True) == TileConfig(32, 16, 4, 1)
    assert dense_config("rocm", 16) == TileConfig(16, 16, 4, 2)


def _sparse_decode_problem(fmt, **kw):
    from anymla.problems import SparseDecode
    from anymla.testing import sparse_decode_inputs
    a = sparse_decode_inputs(2, 1, 64, 200, 64, fmt=fmt, **kw)
    return SparseDecode(a["q"], a["k_cache"], a["indices"], 0.1, extra_k_cache=a.get("extra_k_cache"))


def test_hopper_sparse_decode_takes_v32_v41_and_model1_caches(monkeypatch):
    """The Hopper decoding kernel dequantizes V3.2 FP8 caches alone, V4.1 FP8 ones with or without a V4.1
    extra cache and MODEL1 FP8 ones with or without a MODEL1 extra cache; other formats and pairings are named."""
    from anymla.kvcache import KVCacheFormat
    from anymla.triton_kernels import runtime, tuning
    from anymla.triton_kernels.hopper import launch
    monkeypatch.setattr(runtime, "device_kind", lambda device: "cuda_sm90")
    monkeypatch.setattr(runtime, "gluon_hopper", lambda: True)
    tile = tuning.TileConfig(64, 64, 8, 1)
    F = KVCacheFormat
    assert launch.sparse_decode_reasons(_sparse_decode_problem(F.V32_FP8), tile) == []
    assert launch.sparse_decode_reasons(_sparse_decode_problem(F.V32_FP8, block_pad=1), tile) == []
    assert launch.sparse_decode_reasons(_sparse_decode_problem(F.MODEL1_FP8), tile) == []
    assert "BF16 cache" in launch.sparse_decode_reasons(_sparse_decode_problem(F.BF16), tile)[0]
    fp4 = dict(fmt=F.V41_FP4, page=64, s_k=100, topk=64)
    assert launch.sparse_decode_reasons(_sparse_decode_problem(F.V41_FP8, extra=fp4), tile) == []
    assert launch.sparse_decode_reasons(_sparse_decode_problem(F.V41_FP8), tile) == []
    model1 = dict(fmt=F.MODEL1_FP8, page=64, s_k=100, topk=64)
    assert "MODEL1_FP8 extra" in launch.sparse_decode_reasons(_sparse_decode_problem(F.V41_FP8, extra=model1),
                                                              tile)[0]
    # MODEL1 rows lie 576 bytes apart inside a block although the container view's row stride is 584
    assert launch.sparse_decode_reasons(_sparse_decode_problem(F.MODEL1_FP8, page=256, extra=model1), tile) == []
    assert "V41_FP4 extra" in launch.sparse_decode_reasons(_sparse_decode_problem(F.MODEL1_FP8, extra=fp4), tile)[0]
    # Few heads (tensor parallelism): taken, the 64-row tile masks the rest (tuning.HOPPER_FEWEST_ROWS says why)
    assert launch.sparse_decode_reasons(_sparse_decode_problem(F.V32_FP8), tuning.TileConfig(16, 32, 4, 6)) == []


def test_hopper_sparse_programs_take_8_16_32_or_64_heads():
    """Tensor-parallel head counts get the few-head form of the Hopper sparse kernels (8, 16 or 32 heads a
    program, hopper/few_heads.py), more heads 64-head programs; a forced 12-warp tile picks the form for either op."""
    from anymla.triton_kernels import tuning
    from anymla.triton_kernels.hopper import launch
    assert "few-head" in launch.program_shape("sparse_decode", 16)[1]
    assert "few-head" not in launch.program_shape("sparse_decode", 64)[1]
    for op in ("sparse_decode", "sparse_prefill"):
        heads = {h: launch.program_shape(op, h)[0].block_h for h in (1, 8, 9, 16, 17, 32, 33, 40, 64, 128)}
        assert heads == {1: 8, 8: 8, 9: 16, 16: 16, 17: 32, 32: 32, 33: 64, 40: 64, 64: 64, 128: 64}, op
    for op in ("sparse_decode", "sparse_prefill"):
        for forced in (64, 16, 8):
            with tuning.forced(tuning.TileConfig(forced, 64, 12, 2, False)):
                assert launch.program_shape(op, 8)[0].block_h == forced
        with tuning.forced(tuning.TileConfig(48, 64, 12, 2, False)), pytest.raises(ValueError, match="8, 16, 32 or 64"):
            launch.program_shape(op, 8)


class _Compiled:
    """Stands for a compiled Triton kernel: records what its C launcher is handed."""

    packed_metadata, function = "meta", "fn"

    def __init__(self):
        self.launches = []

    def run(self, *args):
        self.launches.append(args)

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid, stream)


class _Jit:
    """Stands for a ``@triton.jit`` function: ``fn[grid](*args)`` compiles (counted) and returns the kernel."""

    def __init__(self):
        self.calls, self.kernels, self.compiled_with = 0, [], []

    def __getitem__(self, grid):
        def call(*args, **options):
            self.calls += 1
            self.compiled_with.append(args)
            self.kernels.append(_Compiled())
            return self.kernels[-1]
        return call


def test_a_launcher_hands_later_calls_straight_to_the_compiled_kernel(monkeypatch):
    """The first call of an alignment pattern goes through ``fn[grid]``; later ones call the compiled kernel's
    own launcher with every argument (tensors as their addresses) and Triton's launch hooks (launch metadata only while a hook is installed:
    this Triton's real knobs keep them in empty chains rather than None); a new alignment compiles its own."""
    import triton
    from anymla.triton_kernels import launcher

    monkeypatch.setattr(launcher, "_driver", lambda: (lambda: 0, lambda device: 1234))
    fn = _Jit()
    run = launcher.Launcher(fn, num_warps=4)
    aligned, shifted = torch.zeros(8), torch.zeros(9)[1:]
    run((2, 1, 1), [aligned, 7, True])
    run((3, 1, 1), [aligned, 7, True])
    knobs = triton.knobs.runtime
    hooks = (knobs.launch_enter_hook, knobs.launch_exit_hook)
    assert fn.calls == 1 and fn.kernels[0].launches == [(3, 1, 1, 1234, "fn", "meta", None, *hooks, aligned.data_ptr(), 7,
                                                                 True)]
    run((3, 1, 1), [shifted, 7, True])
    assert fn.calls == 2, "another alignment: Triton specializes on it, so it compiles its own kernel"
    hook = lambda *a: None  # noqa: E731
    if hasattr(knobs.launch_enter_hook, "add"):
        knobs.launch_enter_hook.add(hook)
        try:
            run((4, 1, 1), [aligned, 7, True])
        finally:
            knobs.launch_enter_hook.remove(hook)
        assert fn.calls == 2 and fn.kernels[0].launches[-1][6] == ("metadata", (4, 1, 1), 1234), \
            "a hook gets the launch's metadata"
        assert fn.kernels[0].launches[-1][9] is aligned, "and, with a hook, the tensors themselves"



def test_a_bound_launch_passes_a_call_s_tensors_and_rebuilds_its_list_for_a_new_alignment(monkeypatch):
    """``Launcher.bind``: a call may bring a tensor at the address of the list's view of it (a float8 cache for
    its byte view: the kernel was compiled for the view); a new alignment pattern builds the whole list again
    with ``full()`` and compiles; values that do not fill the list's slots are refused."""
    from anymla.triton_kernels import launcher
    monkeypatch.setattr(launcher, "_driver", lambda: (lambda: 0, lambda device: 7))
    fn = _Jit()
    run = launcher.Launcher(fn, num_warps=4)
    cache, out, built = torch.zeros(64, dtype=torch.float8_e4m3fn), torch.empty(32), []

    def full(out):
        built.append(out)
        return [cache.view(torch.uint8), 64, out, 2.0, True]

    run.bind((1, 1, 1), (cache, out, 2.0), lambda: full(out))
    assert fn.calls == 1 and fn.compiled_with[0][0].dtype == torch.uint8
    run.bind((2, 1, 1), (cache, out, 3.0), lambda: full(out))
    assert len(built) == 1 and fn.kernels[0].launches[-1][:3] == (2, 1, 1)
    assert fn.kernels[0].launches[-1][-5:] == (cache.data_ptr(), 64, out.data_ptr(), 3.0, True)
    shifted = torch.empty(33)[1:]
    run.bind((1, 1, 1), (cache, shifted, 2.0), lambda: full(shifted))
    assert len(built) == 2 and fn.calls == 2 and fn.compiled_with[1][2] is shifted
    import triton
    knobs = triton.knobs.runtime
    if hasattr(knobs.launch_enter_hook, "add"):  # with a hook installed, the launch hands on the tensors themselves
        hook = lambda *a: None  # noqa: E731
        knobs.launch_enter_hook.add(hook)
        try:
            run.bind((3, 1, 1), (cache, out, 4.0), lambda: full(out))
        finally:
            knobs.launch_enter_hook.remove(hook)
        assert fn.kernels[0].launches[-1][6] == ("metadata", (3, 1, 1), 7)
        assert fn.kernels[0].launches[-1][-3] is out and len(built) == 2
    with pytest.raises(RuntimeError, match="per-call values"):
        launcher.Launcher(_Jit()).bind((1, 1, 1), (torch.empty(64, dtype=torch.uint8), out, 2.0), lambda: full(out))


def _keyed_and_bound(monkeypatch, names, calls, step, launchers):
    """What each stand-in compiled kernel of ``names`` is handed when ``step(a, bound)`` runs the ``calls``
    through the keyed launches (``bound`` None), then through fresh bound launchers: ``{mode: {name: [its
    launches]}}``; the first call of each launch compiles (through ``fn[grid]``), later ones launch directly."""
    from anymla.triton_kernels import launcher
    from anymla.triton_kernels.cache_write import launch
    monkeypatch.setattr(launcher, "_driver", lambda: (lambda: 0, lambda device: 7))
    handed, jits = {}, {}
    for mode in ("keyed", "bound"):
        jits = {n: _Jit() for n in names}
        for n, jit in jits.items():
            monkeypatch.setattr(launch, n, jit)
        bound = launchers(torch.device("cpu")) if mode == "bound" else None
        for a in calls:
            step(a, bound)
        handed[mode] = {n: [x for k in j.kernels for x in k.launches] for n, j in jits.items()}
    return handed, jits, bound


@pytest.mark.parametrize("with_q", [True, False], ids=["q_latent", "no_q_latent"])
def test_bound_layer_kernel_launches_hand_the_compiled_kernel_what_keyed_ones_do(monkeypatch, with_q):
    """The layer kernels' launches bound to a plan (``cache_write.launch.step_launchers``: a call hands over only
    its tensors and floats) give the compiled kernel the same grid and arguments as the keyed launches, which
    build the whole list every call: here for a later call with new tensors, and one with a new epsilon."""
    from anymla.kvcache import KVCacheFormat
    from anymla.triton_kernels.cache_write import launch

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        t, r = 8, torch.randn(8, 576 + 48, generator=g).bfloat16()
        return dict(kv_a=r[:, 48:], w=torch.randn(512, generator=g).bfloat16(), q_lat=r[:, :48] if with_q else None,
                    q_w=torch.randn(48, generator=g).bfloat16() if with_q else None,
                    q_out=torch.empty(t, 48).bfloat16() if with_q else None, pos=torch.arange(t, dtype=torch.int32),
                    cos=torch.randn(64, 32), sin=torch.randn(64, 32), bt=torch.arange(8, dtype=torch.int32).view(4, 2),
                    cache=torch.zeros(8, 16, 1, 656, dtype=torch.uint8), q_full=torch.empty(t, 4, 576).bfloat16(),
                    q=torch.randn(t, 4, 192, generator=g).bfloat16(), idx=torch.randint(-1, 30, (4, 2, 8), generator=g),
                    slots=torch.empty(4, 2, 8, dtype=torch.int32), eps=1e-6)

    def step(a, bound):
        launch.mla_prolog(a["kv_a"], a["w"], a["eps"], a["q_lat"], a["q_w"], 2 * a["eps"], a["q_out"], a["pos"],
                          a["cos"], a["sin"], None, a["bt"], a["cache"], KVCacheFormat.V32_FP8, "interleaved",
                          bound and bound.prolog)
        launch.assemble_q(None, a["q"][..., 128:], a["pos"], a["cos"], a["sin"], a["q_full"], "interleaved",
                          bound and bound.assemble, launch.QuerySlots(a["idx"], a["bt"], 16, a["slots"]))

    calls = [inputs(0), inputs(1)]
    names = ("mla_prolog_kernel", "q_assemble_kernel")
    handed, jits, bound = _keyed_and_bound(monkeypatch, names, calls, step, launch.step_launchers)
    assert all(j.calls == 1 and len(handed["bound"][n]) == 1 for n, j in jits.items())
    assert handed["bound"] == handed["keyed"]
    assert calls[1]["cache"].data_ptr() in handed["bound"]["mla_prolog_kernel"][0]
    step({**inputs(2), "eps": 3e-6}, bound)  # a float is the call's own too (the keyed launch keys on it)
    assert 3e-6 in jits["mla_prolog_kernel"].kernels[0].launches[-1] and jits["mla_prolog_kernel"].calls == 1


def test_bound_v4_layer_kernel_launches_hand_the_compiled_kernel_what_keyed_ones_do(monkeypatch):
    """The same for a V4 layer's kernels (``v4_step_launchers``): the prolog, and the heads kernel in its two
    forms (query heads with window slots, output heads), each bound to its own launcher."""
    from anymla.kvcache import KVCacheFormat
    from anymla.triton_kernels.cache_write import launch

    def inputs(seed):
        g = torch.Generator().manual_seed(seed)
        r = torch.randn(8, 512 + 48, generator=g).bfloat16()
        return dict(kv=r[:, 48:], w=torch.randn(512, generator=g), q_lat=r[:, :48], q_w=torch.randn(48, generator=g),
                    q_out=torch.empty(8, 48).bfloat16(), pos=torch.arange(8), cos=torch.randn(64, 32),
                    sin=torch.randn(64, 32), sin_back=torch.randn(64, 32),
                    bt=torch.arange(8, dtype=torch.int32).view(4, 2),
                    cache=torch.zeros(8, 16, 1, 288, dtype=torch.uint8), q=torch.randn(8, 4, 512).bfloat16(),
                    o=torch.randn(8, 4, 512).bfloat16(), slots=torch.empty(4, 2, 6, dtype=torch.int32))

    def step(a, bound):
        launch.v4_prolog(a["kv"], a["w"], 1e-6, a["q_lat"], a["q_w"], a["q_out"], a["pos"], a["cos"], a["sin"],
                         a["bt"], a["cache"], KVCacheFormat.V41_FP4, bound and bound.prolog)
        launch.v4_heads(a["q"], a["pos"], a["cos"], a["sin"], 1e-6, bound and bound.query,
                        launch.WindowSlots(a["bt"], 2, 6, 16, a["slots"]))
        launch.v4_heads(a["o"], a["pos"], a["cos"], a["sin_back"], None, bound and bound.output)

    calls = [inputs(0), inputs(1)]
    handed, jits, _ = _keyed_and_bound(monkeypatch, ("v4_prolog_kernel", "v4_heads_kernel"), calls, step,
                                       launch.v4_step_launchers)
    assert jits["v4_prolog_kernel"].calls == 1 and jits["v4_heads_kernel"].calls == 2  # the heads' two forms
    assert len(handed["bound"]["v4_heads_kernel"]) == 2  # the later call's two launches, straight
    assert handed["bound"] == handed["keyed"]
    assert calls[1]["slots"].data_ptr() in handed["bound"]["v4_heads_kernel"][0]


def test_a_direct_launch_encodes_each_tensor_memory_descriptor_once(monkeypatch):
    """Under Triton's descriptor wrapper (this Triton's own ``wrap_handle_tensordesc``), the direct launch hands
    the inner launcher exactly what the wrapper would, and encodes a descriptor object once, not per launch."""
    from triton.backends.nvidia import driver
    from triton.tools.tensor_descriptor import TensorDescriptor
    from anymla.triton_kernels import launcher
    encodings = []

    def encode(arg, meta):
        encodings.append(arg)
        return real(arg, meta)

    real = driver.make_tensordesc_arg
    monkeypatch.setattr(driver, "make_tensordesc_arg", encode)
    raw_calls = []
    signature = {"q": "*bf16", "desc": "tensordesc<bf16[1, 16, 1, 64]>", "n": "i32", "FLAG": "constexpr"}
    wrapper = driver.wrap_handle_tensordesc(lambda *a: raw_calls.append(a), signature, None)

    flat = "_BASE_ARGS_FORMAT_LEN" in wrapper.__code__.co_names  # Triton 3.6's layout; 3.7 passes a list

    class Run:  # stands for this Triton's CudaLauncher: hands its arguments to self.launch as it does
        def __init__(self):
            self.launch = wrapper

        def __call__(self, gx, gy, gz, stream, function, *rest):
            if flat:
                self.launch(gx, gy, gz, stream, function, False, False, None, None, *rest)
            else:
                self.launch(gx, gy, gz, stream, function, *rest[:4], None, None, "annotations", "signature",
                            rest[4:])

    class Kernel:
        run, function, packed_metadata = Run(), "fn", "meta"

    cache = torch.zeros(4, 64, 1, 576, dtype=torch.bfloat16)
    desc = TensorDescriptor(cache, list(cache.shape), list(cache.stride()), [1, 16, 1, 64])
    direct = launcher._Direct(Kernel())
    assert direct.positions == [1]
    args = [123, desc, 7, True]
    Kernel.run(1, 1, 1, 0, "fn", "meta", None, None, None, *args)  # Triton's own path: the wrapper encodes
    for _ in range(3):
        direct.run(1, 1, 1, 0, "fn", "meta", None, None, None, *direct.encoded(args))
    assert len(encodings) == 2, "one encoding for Triton's own launch, one for three direct launches"

    def same(a, b):
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a is b or (not isinstance(a, torch.Tensor) and a == b)

    assert len(raw_calls) == 4 and all(same(call, raw_calls[0]) for call in raw_calls[1:])

# The tiles tuning.py chose in code before they became a table: computed at commit 0b0929d by calling its
# sparse_config and dense_config for every device kind, cache class and 1..299 query rows a kv head, and
# hard-coded here so that the table must give exactly these. (kind, op, cache class) -> the tiles at 16, 32 and
# 128 rows, each (block_h, block_n, num_warps, num_stages, skip_scale); 1..16 rows got the first, 17..32 the
# second, 33 and more the third.
T, F = True, False
_TILES_IN_CODE_AT_0B0929D = {
    ('interpret', 'sparse', 'bf16'): ((16, 64, 4, 1, T), (32, 64, 4, 1, T), (64, 64, 4, 1, T)),
    ('interpret', 'sparse', 'quantized'): ((16, 64, 4, 1, T), (32, 64, 4, 1, T), (64, 64, 4, 1, T)),
    ('interpret', 'sparse', 'MODEL1_FP8'): ((16, 64, 4, 1, T), (32, 64, 4, 1, T), (64, 64, 4, 1, T)),
    ('interpret', 'dense', 'bf16'): ((16, 64, 4, 1, T), (32, 64, 4, 1, T), (64, 64, 4, 1, T)),
    ('cuda', 'sparse', 'bf16'): ((16, 64, 4, 2, F), (32, 64, 4, 2, F), (64, 64, 8, 3, F)),
    ('cuda', 'sparse', 'quantized'): ((16, 32, 4, 6, F), (32, 32, 4, 6, F), (64, 64, 8, 1, F)),
    ('cuda', 'sparse', 'MODEL1_FP8'): ((16, 64, 8, 1, F), (32, 64, 8, 1, F), (64, 64, 8, 1, F)),
    ('cuda', 'dense', 'bf16'): ((16, 32, 4, 6, T), (32, 32, 4, 6, T), (64, 64, 8, 2, F)),
    ('cuda_small_smem', 'sparse', 'bf16'): ((16, 32, 4, 6, F), (16, 32, 4, 6, F), (16, 32, 4, 6, F)),
    ('cuda_small_smem', 'sparse', 'quantized'): ((16, 32, 4, 6, F), (16, 32, 4, 6, F), (16, 32, 4, 6, F)),
    ('cuda_small_smem', 'sparse', 'MODEL1_FP8'): ((16, 32, 4, 6, F), (16, 32, 4, 6, F), (16, 32, 4, 6, F)),
    ('cuda_small_smem', 'dense', 'bf16'): ((16, 32, 4, 6, T), (16, 32, 4, 6, T), (16, 32, 4, 6, T)),
    ('cuda_sm90', 'sparse', 'bf16'): ((16, 64, 4, 2, F), (32, 64, 4, 2, F), (64, 64, 8, 3, F)),
    ('cuda_sm90', 'sparse', 'quantized'): ((16, 32, 4, 6, F), (32, 32, 4, 6, F), (64, 64, 8, 1, F)),
    ('cuda_sm90', 'sparse', 'MODEL1_FP8'): ((16, 64, 8, 1, F), (32, 64, 8, 1, F), (64, 64, 8, 1, F)),
    ('cuda_sm90', 'dense', 'bf16'): ((16, 32, 4, 6, T), (32, 32, 4, 6, T), (64, 64, 8, 2, F)),
    ('cuda_sm100', 'sparse', 'bf16'): ((16, 64, 4, 2, F), (32, 64, 4, 2, F), (64, 32, 8, 3, F)),
    ('cuda_sm100', 'sparse', 'quantized'): ((16, 32, 4, 6, F), (32, 32, 4, 6, F), (64, 64, 8, 1, F)),
    ('cuda_sm100', 'sparse', 'MODEL1_FP8'): ((16, 64, 8, 1, F), (32, 64, 8, 1, F), (64, 64, 8, 1, F)),
    ('cuda_sm100', 'dense', 'bf16'): ((16, 32, 4, 6, T), (32, 32, 4, 6, T), (64, 32, 8, 3, F)),
    ('rocm', 'sparse', 'bf16'): ((16, 32, 4, 2, T), (16, 32, 4, 2, T), (64, 16, 4, 1, T)),
    ('rocm', 'sparse', 'quantized'): ((16, 32, 4, 2, T), (16, 32, 4, 2, T), (64, 16, 4, 1, T)),
    ('rocm', 'sparse', 'MODEL1_FP8'): ((16, 32, 4, 2, T), (16, 32, 4, 2, T), (64, 16, 4, 1, T)),
    ('rocm', 'dense', 'bf16'): ((16, 32, 4, 2, T), (16, 32, 4, 2, T), (64, 16, 4, 1, T)),
    ('npu', 'sparse', 'bf16'): ((16, 32, 1, 1, T), (16, 32, 1, 1, T), (16, 32, 1, 1, T)),
    ('npu', 'sparse', 'quantized'): ((16, 8, 1, 1, T), (16, 8, 1, 1, T), (16, 8, 1, 1, T)),
    ('npu', 'sparse', 'MODEL1_FP8'): ((16, 8, 1, 1, T), (16, 8, 1, 1, T), (16, 8, 1, 1, T)),
    ('npu', 'dense', 'bf16'): ((16, 32, 1, 1, T), (16, 32, 1, 1, T), (16, 32, 1, 1, T)),
}
# (quantized, main cache format name) of the calls in each cache class: prefill passes no format name.
_CACHE_CLASSES = {"bf16": [(F, ""), (F, "BF16")], "MODEL1_FP8": [(T, "MODEL1_FP8")],
                  "quantized": [(T, ""), (T, "V32_FP8"), (T, "V41_FP8"), (T, "V41_FP4")]}


# The rows changed since, each after compile_report --shipped found the old tile spilling or too big for a target
# that has never run it (tuning.TILES says what it found): (kind, op, cache class, 16 | 32 | 128 rows) -> tile.
_CHANGED_AFTER_THE_TABLE = {
    **{("rocm", "sparse", cache, 128): (32, 16, 4, 1, T) for cache in ("quantized", "MODEL1_FP8")},  # spilled
    **{("rocm", "dense", "bf16", rows): (16, 16, 4, 2, T) for rows in (16, 32)},  # spilled on gfx942
    **{("cuda_small_smem", "sparse", "MODEL1_FP8", rows): (16, 32, 8, 1, F) for rows in (16, 32, 128)},  # 181 KB
    ("cuda", "sparse", "MODEL1_FP8", 128): (64, 16, 8, 1, F),  # 192 KB on sm_80's 163
    # 3 stages with the indices asked for by hand: the gathered codes travel while the previous block is attended
    **{(kind, "sparse", "quantized", 128): (64, 64, 8, 3, F) for kind in ("cuda_sm90", "cuda_sm100")},
}


def _tiles_in_code(kind: str, op: str, cache: str, rows: int) -> TileConfig:
    at = 16 if rows <= 16 else 32 if rows <= 32 else 128
    changed = _CHANGED_AFTER_THE_TABLE.get((kind, op, cache, at))
    return TileConfig(*(changed or _TILES_IN_CODE_AT_0B0929D[kind, op, cache][(16, 32, 128).index(at)]))


@pytest.mark.parametrize("kind", sorted({k for k, _, _ in _TILES_IN_CODE_AT_0B0929D}))
def test_every_device_kind_gets_the_tiles_it_got_before_the_table(kind):
    """The table gives every kind what the code gave it, but for the rows changed since (named above)."""
    from anymla.triton_kernels.tuning import dense_config, sparse_config, tile_row
    for rows in range(1, 300):
        for cache, calls in _CACHE_CLASSES.items():
            for quantized, fmt in calls:
                want = _tiles_in_code(kind, "sparse", cache, rows)
                assert sparse_config(kind, rows, quantized, fmt) == want, (rows, fmt, quantized)
                assert tile_row(kind, "sparse", rows, quantized, fmt).tile.block_n == want.block_n
        assert dense_config(kind, rows) == _tiles_in_code(kind, "dense", "bf16", rows), rows


def test_sm120_gets_the_99_kb_tiles_and_its_own_device_kind(monkeypatch):
    """Consumer Blackwell (major 12) has a device kind of its own, whose rows are the 99 KB GPUs' tiles (sm_86/89
    still tell themselves by shared memory); the other NVIDIA kinds are unchanged."""
    from anymla.triton_kernels import runtime
    from anymla.triton_kernels.tuning import dense_config, sparse_config
    monkeypatch.setattr(runtime, "rocm", lambda: False)
    gpu = torch.device("cuda", 0)
    for capability, shared, kind in (((12, 0), 101376, "cuda_sm120"), ((8, 6), 101376, "cuda_small_smem"),
                                     ((8, 9), 101376, "cuda_small_smem"), ((8, 0), 166912, "cuda"),
                                     ((9, 0), 232448, "cuda_sm90"), ((10, 0), 232448, "cuda_sm100")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        monkeypatch.setattr(runtime, "max_shared_memory", lambda device, s=shared: s)
        assert runtime.device_kind.__wrapped__(gpu) == kind, capability
    for rows in (1, 16, 17, 32, 33, 128):
        for calls in _CACHE_CLASSES.values():
            for quantized, fmt in calls:
                assert sparse_config("cuda_sm120", rows, quantized, fmt) == \
                    sparse_config("cuda_small_smem", rows, quantized, fmt)
        assert dense_config("cuda_sm120", rows) == dense_config("cuda_small_smem", rows)
    monkeypatch.setattr(runtime, "device_kind", lambda device: "cuda_sm120")
    assert "sm_120" in runtime.verification(gpu)[0] and "never run" in runtime.verification(gpu)[0]


def test_the_mma_sync_stand_in_takes_the_tiles_of_the_gpus_it_stands_in_for(monkeypatch):
    """On sm_90 with DISABLE_MMA_V3 the portable kernels take the ``cuda`` kind's tiles (A100-class), not
    Hopper's, whose 3-stage quantized tile Triton 3.6 spills by kilobytes once tl.dot is mma.sync; every other
    kind, and sm_90 with wgmma, keeps its own."""
    from anymla.triton_kernels import runtime
    from anymla.triton_kernels.tuning import sparse_config
    gpu = torch.device("cuda", 0)
    for kind in ("cuda_sm90", "cuda_sm100", "cuda_sm120", "cuda_small_smem", "cuda", "rocm"):
        monkeypatch.setattr(runtime, "device_kind", lambda device, k=kind: k)
        for flag, stand_in in (("", False), ("1", True), ("on", True)):
            monkeypatch.setenv("DISABLE_MMA_V3", flag)
            assert runtime.tile_kind(gpu) == ("cuda" if stand_in and kind == "cuda_sm90" else kind), (kind, flag)
    monkeypatch.setattr(runtime, "device_kind", lambda device: "cuda_sm90")
    monkeypatch.setenv("DISABLE_MMA_V3", "1")
    assert sparse_config(runtime.tile_kind(gpu), 128, True, "V32_FP8").num_stages == 1
    monkeypatch.delenv("DISABLE_MMA_V3")
    assert sparse_config(runtime.tile_kind(gpu), 128, True, "V32_FP8").num_stages == 3


def _queries():
    """Every (kind, op, rows, quantized, format) a launch can ask the table, a few rows per regime."""
    from anymla.triton_kernels import tuning
    kinds = {k for k, *_ in tuning.TILES} - {tuning.DEFAULT} | {"cuda_sm90"}
    calls = [c for cs in _CACHE_CLASSES.values() for c in cs]
    return ([(k, "sparse", rows, q, fmt) for k in kinds for rows in (16, 32, 128) for q, fmt in calls] +
            [(k, "dense", rows, False, "") for k in kinds for rows in (16, 32, 128)])


def test_every_tile_row_has_a_reason_and_is_reached():
    """No row of the table is shadowed by a more specific one (each is some call's answer), each says what
    it rests on, and a wrong op is named."""
    from anymla.triton_kernels import tuning
    reached = {id(tuning.tile_row(*q)) for q in _queries()}
    for key, row in tuning.TILES.items():
        assert id(row) in reached, f"{key} is never looked up"
        assert len(row.reason) > 20 and row.tile.block_h in (16, 32, 64), key
    with pytest.raises(ValueError, match="op must be 'sparse' or 'dense', got 'prefill'"):
        tuning.tile_row("cuda", "prefill", 16)


def test_a_forced_tile_wins_on_every_device_kind():
    from anymla.triton_kernels import tuning
    tile = TileConfig(32, 16, 4, 3, False)
    with tuning.forced(tile):
        assert {tuning.sparse_config(k, rows, q, fmt) if op == "sparse" else tuning.dense_config(k, rows)
                for k, op, rows, q, fmt in _queries()} == {tile}


def test_every_kind_with_rows_of_its_own_is_compile_checked():
    """compile_report --shipped covers every GPU kind the table has rows for (Ascend: ascend_compile_check.py),
    and CI runs it for one arch of each."""
    from anymla.triton_kernels import compile_report, tuning
    own = {k for k, *_ in tuning.TILES} - {tuning.DEFAULT, "interpret", "npu"}
    in_ci = {compile_report.ARCHS[a].kind for a in SHIPPED_ARCHS_IN_CI}
    assert own | {"cuda_sm90"} <= in_ci


def _table_cases():
    """One small call per row of the table (GPU rows only) whose tile it forces: (row key, op, tile, args)."""
    from anymla.kvcache import KVCacheFormat as KV
    from anymla.testing import dense_decode_inputs, prefill_inputs, sparse_decode_inputs
    from anymla.triton_kernels import tuning
    cases = []
    for key, row in tuning.TILES.items():
        kind, op, _, cache = key
        if kind == "interpret":
            continue
        h, seed = row.tile.block_h, zlib.crc32(repr(key).encode())
        name = "-".join(key).replace("*", "any")
        if op in ("sparse", tuning.ANY) and cache in ("bf16", tuning.ANY):
            cases.append((name + "-prefill", row.tile, lambda dev, h=h, s=seed: (
                "sparse_prefill", prefill_inputs(2, h, 576, 150, 70, topk_length=True, seed=s, device=dev))))
        if op in ("sparse", tuning.ANY) and cache != "bf16":
            fmt = KV.MODEL1_FP8 if cache == "MODEL1_FP8" else KV.V41_FP8
            extra = dict(fmt=KV.MODEL1_FP8 if cache == "MODEL1_FP8" else KV.V41_FP4, page=64, s_k=90, topk=40)
            cases.append((name + "-decode", row.tile, lambda dev, h=h, s=seed, f=fmt, x=extra: (
                "sparse_decode", sparse_decode_inputs(2, 1, h, 150, 70, fmt=f, extra=x, seed=s, device=dev))))
        if op in ("dense", tuning.ANY) and cache in ("bf16", tuning.ANY):
            cases.append((name + "-dense", row.tile, lambda dev, h=h, s=seed: (
                "dense_decode", dense_decode_inputs(2, 1, h, 1, 150, causal=True, seed=s, device=dev))))
    return cases


_TABLE_CASES = _table_cases()


@pytest.mark.parametrize("name, tile, make", _TABLE_CASES, ids=[c[0] for c in _TABLE_CASES])
def test_every_gpu_tile_of_the_table_agrees_with_the_reference(backend, name, tile, make, tol_scale, device):
    """The kernels at each shipped tile (forced: the interpreter, or this GPU, runs them at its sizes and
    stage counts) against the reference, over topk tails, extra caches and causal masks."""
    if backend != "triton":
        pytest.skip("tile configurations belong to the Triton tier")
    import anymla
    from anymla.testing import compare_outputs
    from anymla.triton_kernels import tuning
    if device.type == "cuda" and tile.block_n < 16:
        pytest.skip(f"{name}: key blocks of {tile.block_n} (an Ascend tile): GPU dots take K >= 16; the "
                    "interpreter checks this tile in CI")
    op, args = make(device)
    with tuning.forced(tile):
        if op == "sparse_prefill":
            got = anymla.flash_mla_sparse_fwd(**args, backend=backend)
            ref = anymla.flash_mla_sparse_fwd(**args, backend="reference")
        else:
            meta, _ = anymla.get_mla_metadata()
            got = anymla.flash_mla_with_kvcache(**args, tile_scheduler_metadata=meta, backend=backend)
            ref = anymla.flash_mla_with_kvcache(**args, tile_scheduler_metadata=None, backend="reference")
    compare_outputs(op, got, ref, scale=tol_scale)


def test_a_launcher_keeps_no_tensor_of_the_calls_it_launched(monkeypatch):
    """A plan outlives its calls: its argument template must not hold their tensors (a prefill output can be
    gigabytes, and every call signature keeps a plan)."""
    import gc
    import weakref
    from anymla.triton_kernels import launcher

    class Jit:
        def __getitem__(self, grid):
            return lambda *args, **options: None

    run = launcher.Launcher(Jit(), num_warps=4)
    out = torch.zeros(8)
    gone = weakref.ref(out)
    run.bind((1, 1, 1), (out, 0.5), lambda: [out, 3, 0.5, True])
    del out
    gc.collect()
    assert gone() is None


def test_the_hopper_kernels_can_be_switched_off_for_a_whole_process():
    """ANYMLA_HOPPER_KERNELS=0 (read at import): no Hopper kernel unless a scoped setting insists, and a bench run
    calls itself the portable stand-in."""
    code = ("from anymla.triton_kernels import tuning\n"
            "from anymla.bench.machine import stand_in\n"
            "assert tuning.forced_warp_specialized() is False\n"
            "with tuning.forced(warp_specialized=True):\n"
            "    assert tuning.forced_warp_specialized() is True\n"
            "assert stand_in(False).startswith('portable')\n"
            "print('ok')")
    env = dict(os.environ, ANYMLA_HOPPER_KERNELS="0")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    from anymla.triton_kernels import tuning
    assert tuning.forced_warp_specialized() is (False if os.environ.get("ANYMLA_HOPPER_KERNELS") == "0" else None)
