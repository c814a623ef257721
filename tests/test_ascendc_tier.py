"""The Ascend C tier on CPU: tiling, buffer budgets, the kernel's emulation against the reference, admission,
availability reasons, the op's fake implementation and the verification manifest.

Nothing here runs device code (there is no NPU or CANN); the emulation models the kernel's blocking order.
"""

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import anymla.ascendc_kernels as tier
from anymla import reference
from anymla.ascendc_kernels import hot_shapes, manifest, op_args, ops, tiling
from anymla.ascendc_kernels.sparse_attention_v41 import emulation
from anymla.backends.ascendc import AscendCBackend
from anymla.kvcache import KVCacheFormat
from anymla.problems import DenseDecode, SparseDecode, SparsePrefill
from anymla.testing import compare_outputs, dense_decode_inputs, prefill_inputs, sparse_decode_inputs

FP8, FP4, BF16 = KVCacheFormat.V41_FP8, KVCacheFormat.V41_FP4, KVCacheFormat.BF16
KERNEL_DIR = Path(tiling.__file__).parent / "sparse_attention_v41"


def prefill_problem(**kw):
    a = prefill_inputs(**kw)
    p = SparsePrefill(a["q"], a["kv"], a["indices"], a["sm_scale"], 512, a["attn_sink"], a["topk_length"])
    p.validate()
    return p


def decode_problem(*args, **kw):
    a = sparse_decode_inputs(*args, **kw)
    p = SparseDecode(a["q"], a["k_cache"], a["indices"], a["softmax_scale"], 512, a["attn_sink"], a["topk_length"],
                     a.get("extra_k_cache"), a.get("extra_indices_in_kvcache"), a.get("extra_topk_length"))
    p.validate()
    return p


# ---- tiling: work split ----

def check_split(ranges, units, cores):
    assert len(ranges) == min(units, cores)
    covered = [u for start, end in ranges for u in range(start, end)]
    assert covered == list(range(units)), "every unit exactly once, in order"
    sizes = [end - start for start, end in ranges]
    assert not sizes or max(sizes) - min(sizes) <= 1, f"unbalanced split {sizes}"


@settings(max_examples=200, deadline=None)
@given(units=st.integers(0, 200_000), cores=st.integers(1, 72))
def test_split_units_covers_every_unit_once_and_balances(units, cores):
    check_split(tiling.split_units(units, cores), units, cores)


def test_split_units_rejects_zero_cores():
    with pytest.raises(ValueError, match="cores"):
        tiling.split_units(10, 0)


# An admitted-shape grid: prefill (bf16 rows) and decode (FP8 main, optional FP8/FP4 extra), odd topk,
# h_q multiples of 64, decode batches up to 321 (s_q folded in).
ADMITTED_SHAPES = [
    tiling.KernelShape(tokens, heads, topk, main, extra_topk, extra)
    for tokens in (1, 7, 321, 321 * 2, 4096)
    for heads in (64, 128)
    for topk, main, extra_topk, extra in (
        (1, BF16, 0, None), (77, BF16, 0, None), (2048, BF16, 0, None),
        (64, FP8, 0, None), (131, FP8, 0, None), (128, FP8, 100, FP4), (576, FP8, 123, FP8), (16384, FP8, 512, FP4),
    )
]


@pytest.mark.parametrize("soc", list(tiling.SOCS))
def test_plan_splits_all_work_exactly_once(soc):
    for shape in ADMITTED_SHAPES:
        t = tiling.plan(shape, soc)
        check_split(t.core_ranges, shape.units, t.soc.aic_cores)
        data = t.tiling_data()
        assert data["num_units"] == shape.units == shape.tokens * shape.heads // 64
        assert data["main_blocks"] * 64 >= shape.topk > (data["main_blocks"] - 1) * 64
        assert data["extra_blocks"] * 64 >= shape.extra_topk


@pytest.mark.parametrize("soc", list(tiling.SOCS))
def test_every_static_buffer_fits_every_admitted_shape(soc):
    for shape in ADMITTED_SHAPES:
        t = tiling.plan(shape, soc)
        for memory in ("L1", "L0A", "L0B", "L0C", "UB"):
            assert 0 < t.used(memory) <= t.capacity(memory), f"{memory} over budget for {shape} on {soc}"
        if t.soc.l1_banks > 1:
            for bank in range(t.soc.l1_banks):
                assert t.used("L1", bank) <= t.capacity("L1", bank), f"L1 bank {bank} over budget"
        for b in t.buffers:
            assert b.bytes > 0 and b.bytes % 32 == 0, f"{b.name} is not a positive multiple of 32 bytes"
        assert t.workspace_bytes() == t.used("GM") * t.cores_used


def test_plan_choices_follow_the_hardware():
    fp8 = tiling.KernelShape(4, 64, 2048, FP8, 512, FP4)
    bf16 = tiling.KernelShape(4, 64, 2048, BF16)
    on_950, on_a3 = tiling.plan(fp8, "Ascend950PR_9589"), tiling.plan(fp8, "Ascend910_9382")
    assert on_950.partial_resident and not on_a3.partial_resident  # O_partial fits L0C only at 256 KB
    assert on_950.gather_chunk > tiling.plan(bf16, "Ascend950PR").gather_chunk  # wider rows, smaller chunks
    assert on_950.gather_chunk > on_a3.gather_chunk  # 248 KB vs 184 KB of UB
    assert on_a3.workspace_bytes() > on_950.workspace_bytes()  # A2/A3 exchange through GM
    assert tiling.plan(fp8, "Ascend950PR", cores=3).cores_used == 3


def test_soc_table_names_unknown_socs():
    with pytest.raises(ValueError, match="Ascend310P"):
        tiling.soc_spec("Ascend310P3")


def _header_constants():
    text = (KERNEL_DIR / "op_kernel" / "tiling_data.h").read_text()
    constants = {m[0]: float(m[1].rstrip("f")) for m in re.findall(r"constexpr \w+ (k\w+) = ([0-9.]+f?);", text)}
    struct = re.search(r"struct SparseAttentionV41Tiling \{(.*?)\};", text, re.S).group(1)
    return constants, re.findall(r"uint32_t (\w+);", struct)


def test_kernel_header_mirrors_the_950_plan():
    constants, fields = _header_constants()
    fp8 = tiling.plan(tiling.KernelShape(4, 64, 100, FP8, 70, FP4), "Ascend950PR")
    bf16 = tiling.plan(tiling.KernelShape(4, 64, 100, BF16), "Ascend950PR")
    expected = {"kHeadsPerTile": tiling.HEADS_PER_TILE, "kBlockTopk": tiling.B_TOPK, "kHeadDim": tiling.D_QK,
                "kHeadsPerVectorCore": tiling.HEADS_PER_VECTOR_CORE, "kKeysPerVectorCore": tiling.KEYS_PER_VECTOR_CORE,
                "kKvStages": fp8.kv_stages, "kGatherChunkBf16": bf16.gather_chunk, "kGatherChunkFp8": fp8.gather_chunk,
                "kDrainChunk": fp8.drain_chunk, "kMailboxSlots": tiling.MAILBOX_SLOTS,
                "kMailboxEntryBytes": tiling.MAILBOX_ENTRY_BYTES, "kRescaleThreshold": tiling.RESCALE_THRESHOLD}
    assert {k: constants.get(k) for k in expected} == expected
    assert bf16.kv_stages == fp8.kv_stages and fp8.partial_resident  # the kernel implements the resident plan
    assert fields == list(fp8.tiling_data())


# ---- emulation of the kernel vs the reference ----

@pytest.mark.parametrize("kw", [
    dict(s_q=12, h_q=64, s_kv=300, topk=200, sink=True, topk_length=True),
    dict(s_q=9, h_q=128, s_kv=257, topk=77, all_invalid_rows=True, shuffle_invalid=True),
    dict(s_q=5, h_q=64, s_kv=50, topk=100),  # topk > s_kv: the tail is all invalid indices
], ids=["sink-length", "h128-odd-topk-invalid", "topk-over-s_kv"])
def test_emulation_matches_reference_prefill(kw):
    p = prefill_problem(d_qk=512, seed=1, **kw)
    got = emulation.sparse_attention_v41(**op_args.prefill_args(p), cores=3)
    compare_outputs("sparse_prefill", got, reference.sparse_prefill(p))


@pytest.mark.parametrize("soc", ["Ascend950PR", "Ascend910B"])  # O_partial resident / drained every block
def test_emulation_matches_reference_with_amplified_keys(soc):
    p = prefill_problem(s_q=24, h_q=64, d_qk=512, s_kv=400, topk=150, amplify=True, sink=True, seed=2)
    got = emulation.sparse_attention_v41(**op_args.prefill_args(p), soc=soc)
    compare_outputs("sparse_prefill", got, reference.sparse_prefill(p), amplified=True)


def test_amplified_keys_do_trigger_skip_scale_rescales(monkeypatch):
    p = prefill_problem(s_q=8, h_q=64, d_qk=512, s_kv=400, topk=150, amplify=True, seed=2)
    rescales = []
    original = emulation._VectorCore.softmax

    def spy(self, *args):
        probs, rescale = original(self, *args)
        rescales.append(rescale)
        return probs, rescale

    monkeypatch.setattr(emulation._VectorCore, "softmax", spy)
    emulation.sparse_attention_v41(**op_args.prefill_args(p), cores=1)
    blocks = torch.stack(rescales)  # [block x vector core, units]
    assert blocks[2:].any(), "no rescale after the first block: the data does not exercise skip scale"
    assert not blocks[2:].all(), "every block rescales: skip scale never skips"


@pytest.mark.parametrize("kw", [
    dict(b=3, s_q=2, h_q=64, s_k=300, topk=100, sink=True, topk_length=True),
    dict(b=2, s_q=1, h_q=128, s_k=200, topk=64, extra=dict(fmt=FP4, page=16, s_k=150, topk=70, topk_length=True)),
    dict(b=2, s_q=3, h_q=64, s_k=260, topk=65, page=5, extra=dict(fmt=FP8, page=64, s_k=100, topk=30)),
    dict(b=4, s_q=1, h_q=64, s_k=128, topk=64, zero_len_frac=0.5, sink=True, block_pad=3),
    dict(b=2, s_q=2, h_q=64, s_k=64, topk=64, all_invalid=True),
], ids=["fp8-sink-length", "fp4-extra-h128", "fp8-extra-page5", "zero-len-padded-blocks", "all-invalid"])
def test_emulation_matches_reference_decode(kw):
    p = decode_problem(fmt=FP8, seed=3, **kw)
    got = op_args.decode_outputs(p, *emulation.sparse_attention_v41(**op_args.decode_args(p)))
    compare_outputs("sparse_decode", got, reference.sparse_decode(p))


# ---- admission ----

def test_hot_shapes_admit_the_kernel_shapes():
    assert hot_shapes.shape_reasons(prefill_problem(s_q=2, h_q=128, d_qk=512, s_kv=64, topk=33)) == []
    extra = dict(fmt=FP4, page=16, s_k=64, topk=10)
    assert hot_shapes.shape_reasons(decode_problem(2, 2, 64, 64, 17, fmt=FP8, extra=extra)) == []


@pytest.mark.parametrize("make, expected", [
    (lambda: prefill_problem(s_q=2, h_q=64, d_qk=576, s_kv=64, topk=64), "d_qk = 576"),
    (lambda: prefill_problem(s_q=2, h_q=32, d_qk=512, s_kv=64, topk=64), "h_q = 32"),
    (lambda: prefill_problem(s_q=2, h_q=64, d_qk=512, s_kv=64, topk=64, h_kv=2), "h_kv = 2"),
    (lambda: prefill_problem(s_q=2, h_q=64, d_qk=512, s_kv=64, topk=64, dtype=torch.float16), "float16"),
    (lambda: prefill_problem(s_q=2, h_q=64, d_qk=512, s_kv=64, topk=0), "topk is 0"),
    (lambda: decode_problem(2, 1, 64, 64, 64, fmt=KVCacheFormat.MODEL1_FP8), "MODEL1_FP8"),
    (lambda: decode_problem(2, 1, 64, 64, 64, fmt=KVCacheFormat.V32_FP8), "V32_FP8"),
    (lambda: decode_problem(2, 1, 64, 64, 64, fmt=FP8, extra=dict(fmt=BF16, page=16, s_k=64, topk=8)),
     "extra_k_cache"),
], ids=["d576", "h32", "hkv2", "fp16", "topk0", "model1", "v32", "bf16-extra"])
def test_hot_shapes_reject_other_shapes_naming_the_value(make, expected):
    reasons = hot_shapes.shape_reasons(make())
    assert reasons and any(expected in r for r in reasons), reasons


def test_hot_shapes_reject_other_ops():
    a = dense_decode_inputs(1, 1, 64, 1, 64, d_qk=512)
    p = DenseDecode(a["q"], a["k_cache"], a["block_table"], a["cache_seqlens"], 0.1)
    assert "dense_decode" in hot_shapes.shape_reasons(p)[0]


# ---- availability on this CPU-only machine ----

def test_backend_explains_why_it_cannot_run_on_cpu():
    p = prefill_problem(s_q=2, h_q=64, d_qk=512, s_kv=64, topk=64)
    backend = AscendCBackend()
    assert backend.name == "ascendc" and backend.device_types == ("npu",)
    assert backend.ops == frozenset({"sparse_decode", "sparse_prefill"})
    reasons = backend.not_supported_reasons(p)
    assert reasons == ["runs on npu devices, not on cpu"], "on another device type, that alone"
    assert any("torch_npu" in r for r in backend.unavailable_reasons(p.device)), "the details, for --list"
    dense = dense_decode_inputs(1, 1, 64, 1, 64, d_qk=512)
    assert "does not implement dense_decode" in backend.not_supported_reasons(
        DenseDecode(dense["q"], dense["k_cache"], dense["block_table"], dense["cache_seqlens"], 0.1))[0]


def test_unavailable_reasons_cover_library_and_verification(monkeypatch, tmp_path):
    monkeypatch.setenv(tier.runtime.ENV_LIBRARY, str(tmp_path / "missing.so"))
    monkeypatch.delenv(tier.runtime.ENV_ALLOW_UNVERIFIED, raising=False)
    reasons = tier.unavailable_reasons(torch.device("cpu"))
    assert any("missing.so" in r for r in reasons)
    assert any("unverified" in r and "ANYMLA_ASCENDC_ALLOW_UNVERIFIED" in r for r in reasons)
    monkeypatch.setenv(tier.runtime.ENV_ALLOW_UNVERIFIED, "1")
    assert not any("unverified" in r for r in tier.unavailable_reasons(torch.device("cpu")))


def test_importing_anymla_does_not_load_the_library():
    assert tier.load_library.cache_info().currsize == 0


# ---- the op: schema and fake implementation ----

def test_fake_impl_gives_output_shapes_under_fake_tensors():
    p = decode_problem(2, 3, 128, 64, 40, fmt=FP8, extra=dict(fmt=FP4, page=16, s_k=64, topk=20))
    args = op_args.decode_args(p)
    with FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        out, max_logits, lse = ops.sparse_attention_v41(**fake)
        assert out.shape == (6, 128, 512) and out.dtype == torch.bfloat16
        assert max_logits.shape == lse.shape == (6, 128) and lse.dtype == torch.float32
        out4, lse3 = op_args.decode_outputs(p, out, max_logits, lse)
        assert out4.shape == (2, 3, 128, 512) and lse3.shape == (2, 3, 128)


def test_op_schema_matches_the_binding():
    schema = torch.ops.anymla_ascendc.sparse_attention_v41.default._schema
    names = [a.name for a in schema.arguments]
    binding = (KERNEL_DIR / "host" / "binding.cpp").read_text()
    signature = re.search(r"SparseAttentionV41\((.*?)\)\n\{", binding, re.S).group(1)
    params = re.findall(r"&\s*(\w+)|double (\w+)", signature)
    assert names == [ref or value for ref, value in params]


# ---- the verification manifest ----

def test_manifest_hashes_are_current_and_kernel_unverified():
    assert manifest.main(["--check"]) == 0
    verified, why = manifest.kernel_status("sparse_attention_v41")
    assert not verified and "unverified" in why
    names = {name for name, _ in manifest.hashed_files("sparse_attention_v41")}
    tier = {"__init__.py", "runtime.py", "launch.py", "manifest.py", "ops.py", "op_args.py", "hot_shapes.py",
            "tiling.py"}
    assert tier | {"anymla.backends.ascendc", "CMakeLists.txt"} <= {n.split("/")[-1] for n in names}
    kernel = {n.split("/")[-1] for n in names if n.startswith("sparse_attention_v41/op_kernel/")}
    assert {"sparse_attention_v41.asc", "tiling_data.h", "data_paths.h", "layout.h", "platform.h"} <= kernel
    assert "verification_manifest.json" not in {n.split("/")[-1] for n in names}


def _verified_manifest(**run):
    record = dict(soc="Ascend950PR_9589", cann="9.2.0", torch_npu="2.13.0", date="2027-01-01",
                  test_command="ANYMLA_ASCENDC_ALLOW_UNVERIFIED=1 python -m pytest -q tests", tests_passed=812,
                  tests_failed=0)
    record.update(run)
    return {"kernels": {"sparse_attention_v41": {"sha256": manifest.source_hash("sparse_attention_v41"),
                                                 "status": "verified",
                                                 "hardware_run": dict.fromkeys(manifest.HARDWARE_FIELDS) | record}}}


def test_verified_needs_a_complete_hardware_record():
    verified, why = manifest.kernel_status("sparse_attention_v41", _verified_manifest())
    assert verified and "Ascend950PR_9589" in why and "812 passed" in why and "pytest" in why
    for bad, expected in [(dict(soc=None), "soc is missing"), (dict(test_command=""), "test_command is missing"),
                          (dict(tests_passed=None), "tests_passed is missing"), (dict(tests_failed=2), "must be 0"),
                          (dict(tests_passed=0), "positive count"), (dict(soc="Ascend910B3"), "not a SoC")]:
        verified, why = manifest.kernel_status("sparse_attention_v41", _verified_manifest(**bad))
        assert not verified and expected in why and "claims status 'verified'" in why, (bad, why)


def test_manifest_check_fails_on_an_incomplete_verified_record(monkeypatch):
    monkeypatch.setattr(manifest, "load", lambda: _verified_manifest(cann=None))
    assert manifest.main(["--check"]) == 1
    monkeypatch.setattr(manifest, "load", lambda: _verified_manifest())
    assert manifest.main(["--check"]) == 0


@dataclass(frozen=True)
class FakeNpu:
    """A hashable stand-in for an NPU torch.device (torch.device("npu") needs torch_npu)."""
    type: str = "npu"
    index: int = 0


def test_backend_caveats_say_the_kernel_never_ran_and_what_was_checked():
    notes = AscendCBackend().caveats(FakeNpu())
    assert len(notes) == 1 and "never compiled or run on an NPU" in notes[0]
    assert "on CPU only" in notes[0] and "data movement" in notes[0] and "Ascend 950" in notes[0]


def test_backend_caveats_name_the_verified_soc(monkeypatch):
    monkeypatch.setattr(manifest, "load", lambda: _verified_manifest())
    monkeypatch.setattr(tier.runtime, "_torch_npu_installed", lambda: True)
    monkeypatch.setattr(tier.runtime, "_soc_name", lambda device: "Ascend950DT_9571")
    notes = AscendCBackend().caveats(FakeNpu())
    assert len(notes) == 1 and "Ascend950PR_9589" in notes[0] and "this NPU is Ascend950DT_9571" in notes[0]
    monkeypatch.setattr(tier.runtime, "_soc_name", lambda device: "Ascend950PR_9589")
    assert AscendCBackend().caveats(FakeNpu()) == []


def test_explain_with_the_override_shows_the_tier_caveat(monkeypatch):
    import anymla
    monkeypatch.setattr(AscendCBackend, "not_supported_reasons", lambda self, problem: [])
    a = prefill_inputs(s_q=2, h_q=64, d_qk=512, s_kv=64, topk=64, seed=0)
    d = anymla.explain(anymla.flash_mla_sparse_fwd, a["q"], a["kv"], a["indices"], a["sm_scale"], backend="ascendc")
    assert any("never compiled or run on an NPU" in c for c in d.caveats), d.caveats
    assert "caveat: Ascend C sparse_attention_v41 was never compiled" in str(d)


@pytest.mark.parametrize("soc, expected, absent", [
    ("Ascend950PR_9589", "nothing of the Triton tier was compiled or run for a 950", "(this SoC)"),
    ("Ascend910B3", "(this SoC)", "950"),
    ("Ascend910B2", "(not this Ascend910B2)", "950"),
])
def test_triton_caveat_names_the_socs_its_ascend_check_covered(monkeypatch, soc, expected, absent):
    from anymla.triton_kernels import runtime as triton_runtime
    monkeypatch.setattr(torch, "npu", SimpleNamespace(get_device_name=lambda device: soc), raising=False)
    monkeypatch.setattr(triton_runtime, "gluon_hopper", lambda: False)
    notes = triton_runtime.verification(FakeNpu())
    assert len(notes) == 1 and expected in notes[0] and absent not in notes[0], notes
    assert "Ascend910B3, Ascend910B4, Ascend910_9382" in notes[0]


def test_manifest_notices_a_changed_source(tmp_path, monkeypatch):
    copy = tmp_path / "pkg"
    shutil.copytree(manifest.PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__", "lib"))
    monkeypatch.setattr(manifest, "PACKAGE_DIR", copy)
    monkeypatch.setattr(manifest, "MANIFEST_PATH", copy / "verification_manifest.json")
    assert manifest.stale_kernels() == []
    kernel = copy / "sparse_attention_v41" / "op_kernel" / "sparse_attention_v41.asc"
    kernel.write_text(kernel.read_text() + "\n// edited\n")
    assert manifest.stale_kernels() == ["sparse_attention_v41"]
    verified, why = manifest.kernel_status("sparse_attention_v41")
    assert not verified and "changed" in why
    assert manifest.update_hashes() == ["sparse_attention_v41"] and manifest.stale_kernels() == []
