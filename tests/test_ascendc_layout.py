"""The Ascend C kernel's data movement, replayed by the numpy layout model with the parameters of its own headers.

The model (``ascendc_kernels/sparse_attention_v41/layout_model``) replays one key block per instantiation through
every memory of a 950 AI core as the Ascend C documentation describes the paths, and compares the key tile, the
logits and the O drains with ``anymla.kvcache.gather_rows`` and float64 products. It must pass on the kernel as it
is and fail on each data-path defect of b8ab794.
"""

import pytest

from anymla.ascendc_kernels import tiling
from anymla.ascendc_kernels.sparse_attention_v41.layout_model import headers as hdr
from anymla.ascendc_kernels.sparse_attention_v41.layout_model import replay
from anymla.ascendc_kernels.sparse_attention_v41.layout_model.b8ab794 import DEFECTS
from anymla.kvcache import KVCacheFormat

HEADERS = hdr.kernel_headers()
CURRENT_FIXPIPE = hdr.fixpipe_config((hdr.OP_KERNEL / "platform.h").read_text(), HEADERS)
BLOCKS = [(m, e, x) for m, e in replay.INSTANTIATIONS for x in ((False, True) if e else (False,))]
_FMT = {1: KVCacheFormat.BF16, 2: KVCacheFormat.V41_FP8, 3: KVCacheFormat.V41_FP4}


@pytest.mark.parametrize("main, extra, from_extra", BLOCKS)
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_moves_a_block_like_the_reference(main, extra, from_extra, seed):
    assert replay.replay_block(HEADERS, CURRENT_FIXPIPE, main, extra, from_extra, seed) == []


def test_the_kernel_fixpipes_to_ub_with_nz2nd():
    assert CURRENT_FIXPIPE == ("ROW_MAJOR", True)


@pytest.mark.parametrize("old", DEFECTS, ids=lambda d: d.title.split(":")[0])
def test_layout_model_fails_on_each_b8ab794_defect(old):
    fixpipe = hdr.fixpipe_config(old.fixpipe_call, HEADERS) if old.fixpipe_call else CURRENT_FIXPIPE
    results = replay.replay_kernel(HEADERS, fixpipe, old.overrides)
    failed = {label for label, failures in results.items() if failures}
    if old.title.startswith("1"):
        assert fixpipe == ("ROW_MAJOR", False) and failed == set(results)
        assert all(any("overwritten" in f for f in v) and any("logits in UB" in f for f in v) for v in results.values())
    elif old.title.startswith("2"):
        assert failed == set(results)
        # Q K^T is right with the old loads; only the P V operand was wrong
        assert all(not any("logits" in f or "key tile" in f for f in v) for v in results.values())
    else:
        assert failed == {"FP8+FP4 extra block"}
        assert any("L1 key tile" in f for f in results["FP8+FP4 extra block"])


@pytest.mark.parametrize("main, extra", replay.INSTANTIATIONS)
def test_ub_layout_matches_the_tiling_plan(main, extra):
    ub = HEADERS.struct("UbLayout", MAIN=main, EXTRA=extra)
    shape = tiling.KernelShape(4, 64, 100, _FMT[main], 70 if extra else 0, _FMT.get(extra))
    plan = tiling.plan(shape, "Ascend950PR")
    assert ub["kEnd"] == plan.used("UB") <= HEADERS["kUbBytes"] == plan.capacity("UB")
    assert ub["kChunk"] == plan.gather_chunk
    assert ub["kPitch"] == max(tiling.ub_row_bytes(f) for f in shape.formats)
    for f in shape.formats:
        assert HEADERS["GmRowBytes"]({v: k for k, v in _FMT.items()}[f]) == tiling.row_bytes(f)


def test_l1_and_l0_layouts_fit_and_do_not_overlap():
    l1, l0 = HEADERS.struct("L1Layout"), HEADERS.struct("L0Layout")
    stages = HEADERS["kKvStages"]
    regions = [(l1["Q"](s, h), l1["kQHalf"]) for s in range(2) for h in range(2)]
    regions += [(l1["Kv"](s, h), l1["kKvHalf"]) for s in range(stages) for h in range(2)]
    regions += [(l1["Probs"](s, h), l1["kProbsHalf"]) for s in range(2) for h in range(2)]
    regions.sort()
    assert all(a + n <= b for (a, n), (b, _) in zip(regions, regions[1:])) and regions[-1][0] + regions[-1][1] <= \
        HEADERS["kL1Bytes"]
    assert l0["Logits"](1) + 64 * 64 * 4 <= l0["kPartial"]
    assert l0["kPartial"] + 64 * 512 * 4 <= HEADERS["kL0cBytes"]


def test_cmake_enables_the_hardware_ub_to_l1_channel():
    cmake = (hdr.OP_KERNEL.parent / "CMakeLists.txt").read_text()
    assert "-DENABLE_CV_COMM_VIA_SSBUF=true" in cmake


def test_header_parser_follows_c_semantics():
    h = hdr.parse(["constexpr int32_t kA = -7 / 2; constexpr uint32_t kB = 1 + 2 * 3 == 7 ? 10 : 20;",
                   "enum class F : uint32_t { kX = 0, kY = 4 };",
                   "__aicore__ constexpr uint32_t G(F f, uint32_t n) { return f == F::kY ? n << 2 : n % 3; }",
                   "template <F T> struct S { static constexpr uint32_t kV = G(T, 5) + kB; };"])
    assert h["kA"] == -3 and h["kB"] == 10 and h["G"](4, 3) == 12 and h["G"](0, 5) == 2
    assert h.struct("S", T=4)["kV"] == 30
    with pytest.raises(KeyError, match="kMissing"):
        hdr.parse(["constexpr uint32_t kC = kMissing + 1;"])["kC"]
    with pytest.raises(ValueError, match="neither documented nor defined"):
        hdr.fixpipe_config("Fixpipe<float, float, kUnknown>(d, s, p);", h)
