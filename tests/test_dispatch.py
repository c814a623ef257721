"""The dispatcher: automatic choice per device, ``explain``, override precedence, ``use_backend``, errors for
backends that cannot run or do not exist, fallback, custom backends, and the per-signature decision cache.
"""

import dataclasses
import json
import os
from types import SimpleNamespace

import pytest
import torch

import anymla
import anymla.api
import anymla.selection as selection
from anymla.problems import SparsePrefill
from anymla.registry import OPS, Backend
from anymla.testing import compare_outputs, dense_decode_inputs, non_contiguous, prefill_inputs, sparse_decode_inputs


class Probe(Backend):
    """A test backend: runs the reference (optionally corrupted) and counts its calls."""

    ops = frozenset(OPS)
    device_types = ("cpu", "meta")

    def __init__(self, name, *, reasons=(), corrupt=None):
        self.name, self.reasons, self.corrupt, self.calls = name, list(reasons), corrupt, 0

    def shape_reasons(self, problem):
        return list(self.reasons)

    def run(self, problem, plan=None):
        self.calls += 1
        outs = anymla.get_backend("reference").run(problem)
        return outs if self.corrupt is None else self.corrupt(problem.op, outs)


@pytest.fixture
def fresh_dispatch(monkeypatch):
    """No cached decisions, no tuning and no ANYMLA_* overrides in, and none left behind."""
    monkeypatch.delenv(selection.ENV_BACKEND, raising=False)
    monkeypatch.delenv(selection.ENV_TUNING, raising=False)
    selection.load_tuning(None)
    yield
    selection.load_tuning(None)
    selection.clear_decision_cache()


@pytest.fixture
def probes(fresh_dispatch):
    added = {n: anymla.register_backend(Probe(n)) for n in ("probe_a", "probe_b")}
    yield added
    for n in added:
        anymla.unregister_backend(n)
    selection.clear_decision_cache()


# Tests that run the Triton tier on CPU tensors need its interpreter (TRITON_INTERPRET=1, as CI sets it; on a GPU
# machine the suite runs without it).
interpreted_triton = pytest.mark.skipif("triton" not in anymla.available_backends(torch.device("cpu")),
                                        reason="the Triton tier runs CPU tensors only in Triton's interpreter")


def prefill_args(seed=0, **kw):
    return prefill_inputs(2, 4, 512, 20, 8, seed=seed, **kw)


def explain_prefill(a, **kw):
    return anymla.explain(anymla.flash_mla_sparse_fwd, **a, **kw)


# ---------------------------------------------------------------- automatic choice and explain

def test_cpu_chooses_the_reference_first_and_says_why_not_the_others(fresh_dispatch):
    d = explain_prefill(prefill_args())
    assert (d.op, d.backend, d.source, d.device) == ("sparse_prefill", "reference", "auto", "cpu")
    assert d.shape.startswith("sparse_prefill:s_q=2,h_q=4,d_qk=512")
    rejected = dict(d.rejected)
    assert "reference" not in rejected
    assert set(rejected) == set(anymla.registered_backends()) - {"reference"}
    assert any("npu" in r.lower() for r in rejected["ascendc"]), rejected["ascendc"]
    if "triton" in anymla.available_backends("cpu"):
        assert rejected["triton"] == ("supported, but reference comes first on cpu",)
    text = str(d)
    assert "reference (chosen by auto)" in text and "not ascendc:" in text


def test_priority_orders_per_device():
    """Accelerators put their fastest tier first; the CPU puts the reference first (Triton is interpreted there)."""
    names = anymla.registered_backends()
    # torch.device("npu") needs torch_npu; the priority only reads ``.type``.
    order = {dev: [n for n in selection._priority(SimpleNamespace(type=dev)) if n in ("reference", "triton", "ascendc")]
             for dev in ("cpu", "cuda", "npu")}
    assert order["cpu"] == ["reference", "triton", "ascendc"]  # ascendc only as one of "the rest"
    assert order["cuda"] == ["triton", "reference", "ascendc"]
    assert order["npu"] == ["ascendc", "triton", "reference"]
    assert sorted(selection._priority(SimpleNamespace(type="cpu"))) == sorted(names), "every backend is tried"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_chooses_triton_automatically():
    a = prefill_inputs(2, 4, 512, 20, 8, device="cuda")
    assert explain_prefill(a).backend == "triton"


def test_a_device_without_a_priority_list_falls_back_to_the_reference(fresh_dispatch):
    a = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in prefill_args().items()}
    d = explain_prefill(a)
    assert (d.backend, d.device) == ("reference", "meta")
    assert dict(d.rejected)["triton"], "triton cannot run on meta and says why"


@interpreted_triton
def test_explain_returns_the_decision_the_call_uses(fresh_dispatch, monkeypatch):
    """explain() returns the very decision object the call runs with, launch plan and kernel line included."""
    a = prefill_args()
    d1 = explain_prefill(a, backend="triton")
    assert explain_prefill(prefill_args(seed=1), backend="triton") is d1, "same signature -> same decision"
    used = []
    real_select = anymla.api.select
    monkeypatch.setattr(anymla.api, "select", lambda *args: used.append(real_select(*args)) or used[-1])
    anymla.flash_mla_sparse_fwd(**a, backend="triton")
    assert d1.kernel and d1.plan is not None and d1.kernel == d1.plan.description
    assert used == [d1] and used[0] is d1, "the call runs the decision explain() returned"
    assert real_select(SparsePrefill(**a), "triton") is d1


def test_explain_accepts_the_op_name_and_raises_like_the_call(fresh_dispatch):
    a = sparse_decode_inputs(1, 1, 4, 20, 8, fmt=anymla.kvcache.KVCacheFormat.V41_FP8, page=4)
    d = anymla.explain("flash_mla_with_kvcache", **a, tile_scheduler_metadata=None)
    assert d.op == "sparse_decode" and d.backend == "reference"
    with pytest.raises(ValueError, match="^indices:"):
        anymla.explain("flash_mla_with_kvcache", **dict(a, indices=a["indices"][:, :, None]),
                       tile_scheduler_metadata=None)
    with pytest.raises(ValueError, match="op: expected one of"):
        anymla.explain("flash_mla_fwd", **a)
    with pytest.raises(ValueError, match="op: expected one of"):
        anymla.explain(print, **a)


def test_explain_does_not_run_the_backend(probes):
    d = explain_prefill(prefill_args(), backend="probe_a")
    assert (d.backend, d.source) == ("probe_a", "keyword") and probes["probe_a"].calls == 0


@interpreted_triton
def test_explain_says_how_far_the_chosen_backend_was_verified_on_the_device(fresh_dispatch, monkeypatch):
    d = explain_prefill(prefill_args(), backend="triton")
    assert d.caveats and "interpreter" in d.caveats[0] and "caveat: Triton's interpreter" in str(d)
    assert explain_prefill(prefill_args(), backend="reference").caveats == ()
    from anymla.triton_kernels import runtime
    monkeypatch.setattr(runtime, "device_kind", lambda device: "rocm")
    assert "never run" in runtime.verification(torch.device("cuda"))[0]
    monkeypatch.setattr(runtime, "device_kind", lambda device: "cuda_sm90")
    monkeypatch.setattr(runtime, "gluon_hopper", lambda: True)
    assert runtime.verification(torch.device("cuda")) == []
    monkeypatch.setattr(runtime, "gluon_hopper", lambda: False)  # a Triton whose Gluon was not checked
    assert "portable kernels run" in runtime.verification(torch.device("cuda"))[0]


@interpreted_triton
def test_explain_names_the_triton_kernel_and_why(fresh_dispatch):
    d = explain_prefill(prefill_args(), backend="triton")
    assert d.kernel.startswith("the portable sparse kernel (tile 16 rows x 64 keys, 1 stages, 4 warps); "
                               "not the Hopper one: they run on sm_90 GPUs only")
    assert "  kernel: the portable sparse kernel" in str(d)
    assert explain_prefill(prefill_args(), backend="reference").kernel == ""


# ---------------------------------------------------------------- precedence

def tuning_file(tmp_path, decision, backend):
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"choices": {f"{decision.device}|{decision.shape}": backend}}))
    return str(path)


def test_precedence_keyword_context_env_tuned_auto(probes, monkeypatch, tmp_path):
    a = prefill_args()
    auto = explain_prefill(a)
    assert (auto.backend, auto.source) == ("reference", "auto")
    selection.load_tuning(tuning_file(tmp_path, auto, "probe_a"))
    assert (explain_prefill(a).backend, explain_prefill(a).source) == ("probe_a", "tuned")
    monkeypatch.setenv(selection.ENV_BACKEND, "probe_b")
    assert (explain_prefill(a).backend, explain_prefill(a).source) == ("probe_b", "env")
    with anymla.use_backend("reference"):
        assert (explain_prefill(a).backend, explain_prefill(a).source) == ("reference", "context")
        d = explain_prefill(a, backend="probe_a")
        assert (d.backend, d.source) == ("probe_a", "keyword")
    monkeypatch.setenv(selection.ENV_BACKEND, "auto")  # "auto" means no override
    assert explain_prefill(a).source == "tuned"
    selection.load_tuning(None)
    assert (explain_prefill(a).backend, explain_prefill(a).source) == ("reference", "auto")


def test_tuning_file_from_the_environment(probes, monkeypatch, tmp_path):
    a = prefill_args()
    path = tuning_file(tmp_path, explain_prefill(a), "probe_b")
    selection.clear_decision_cache()
    monkeypatch.setenv(selection.ENV_TUNING, path)
    d = explain_prefill(a)
    assert (d.backend, d.source) == ("probe_b", "tuned")
    anymla.flash_mla_sparse_fwd(**a)
    assert probes["probe_b"].calls == 1


def test_a_tuned_choice_that_cannot_run_falls_back(probes, tmp_path):
    a = prefill_args()
    selection.load_tuning(tuning_file(tmp_path, explain_prefill(a), "probe_a"))
    probes["probe_a"].reasons.append("probe_a: deliberately unsupported")
    selection.clear_decision_cache()
    d = explain_prefill(a)
    assert (d.backend, d.source) == ("reference", "auto")
    assert dict(d.rejected)["probe_a"] == ("probe_a: deliberately unsupported",)


def test_setting_anymla_tuning_applies_to_signatures_already_decided(probes, monkeypatch, tmp_path):
    """The environment is read on every call, like ANYMLA_BACKEND: a cached decision must not hide it."""
    a = prefill_args()
    path = tuning_file(tmp_path, explain_prefill(a), "probe_b")
    monkeypatch.setenv(selection.ENV_TUNING, path)
    assert explain_prefill(a).backend == "probe_b"


def test_unsetting_anymla_tuning_returns_to_automatic_choice(probes, monkeypatch, tmp_path):
    a = prefill_args()
    monkeypatch.setenv(selection.ENV_TUNING, tuning_file(tmp_path, explain_prefill(a), "probe_b"))
    assert explain_prefill(a).backend == "probe_b"
    monkeypatch.delenv(selection.ENV_TUNING)
    assert explain_prefill(a).source == "auto"


def test_env_override_is_read_on_every_call(probes, monkeypatch):
    a = prefill_args()
    assert explain_prefill(a).source == "auto"
    monkeypatch.setenv(selection.ENV_BACKEND, "probe_a,reference")
    assert (explain_prefill(a).backend, explain_prefill(a).source) == ("probe_a", "env")
    monkeypatch.delenv(selection.ENV_BACKEND)
    assert explain_prefill(a).source == "auto"


# ---------------------------------------------------------------- use_backend

@pytest.mark.parametrize("choice", ["probe_b", "probe_b,probe_a", ["probe_b", "probe_a"], ("probe_b",),
                                    " probe_b , reference "], ids=repr)
def test_use_backend_accepts_names_lists_and_comma_strings(probes, choice):
    a = prefill_args()
    with anymla.use_backend(choice):
        d = explain_prefill(a)
        anymla.flash_mla_sparse_fwd(**a)
    assert (d.backend, d.source) == ("probe_b", "context")
    assert probes["probe_b"].calls == 1 and probes["probe_a"].calls == 0
    assert explain_prefill(a).source == "auto"


def test_use_backend_list_skips_a_backend_that_cannot_run(probes):
    probes["probe_a"].reasons.append("no")
    with anymla.use_backend(["probe_a", "probe_b"]):
        d = explain_prefill(prefill_args())
    assert d.backend == "probe_b" and dict(d.rejected)["probe_a"] == ("no",)


def test_use_backend_nests_and_restores_on_exit_and_on_exception(probes):
    a = prefill_args()
    with anymla.use_backend("probe_a"):
        with anymla.use_backend("probe_b"):
            assert explain_prefill(a).backend == "probe_b"
        assert explain_prefill(a).backend == "probe_a"
        with anymla.use_backend(None):  # None: automatic selection inside the block
            assert explain_prefill(a).source == "auto"
        with pytest.raises(KeyError):
            with anymla.use_backend("probe_b"):
                raise KeyError("boom")
        assert explain_prefill(a).backend == "probe_a"
    assert explain_prefill(a).source == "auto"


@pytest.mark.parametrize("choice", ["", [], ",", "nope", ["reference", "nope"]], ids=repr)
def test_use_backend_rejects_empty_and_unknown_choices_at_once(choice):
    with pytest.raises(ValueError):
        with anymla.use_backend(choice):
            pytest.fail("the block must not run")


# ---------------------------------------------------------------- errors

def test_an_explicit_backend_that_cannot_run_raises_with_its_reasons(fresh_dispatch):
    a = prefill_args()
    with pytest.raises(anymla.BackendNotSupported) as err:
        anymla.flash_mla_sparse_fwd(**a, backend="ascendc")
    msg = str(err.value)
    assert "ascendc" in msg and "from keyword" in msg and "sparse_prefill" in msg and "cpu" in msg
    assert "npu" in msg.lower(), msg


def test_ascendc_does_not_implement_dense_decoding(fresh_dispatch):
    a = dense_decode_inputs(1, 1, 4, 1, 10, page=4)
    with pytest.raises(anymla.BackendNotSupported, match="does not implement dense_decode"):
        anymla.flash_mla_with_kvcache(**a, tile_scheduler_metadata=None, backend="ascendc")


def test_every_backend_of_a_list_is_reported(probes):
    probes["probe_a"].reasons.append("reason A")
    probes["probe_b"].reasons.append("reason B")
    with pytest.raises(anymla.BackendNotSupported) as err:
        with anymla.use_backend("probe_a,probe_b"):
            anymla.flash_mla_sparse_fwd(**prefill_args())
    msg = str(err.value)
    assert "from context" in msg and "probe_a: reason A" in msg and "probe_b: reason B" in msg


@pytest.mark.parametrize("where", ["keyword", "env"])
def test_unknown_backend_name_lists_the_registered_ones(fresh_dispatch, monkeypatch, where):
    a = prefill_args()
    if where == "env":
        monkeypatch.setenv(selection.ENV_BACKEND, "cudnn")
    with pytest.raises(ValueError) as err:
        anymla.flash_mla_sparse_fwd(**a, **({"backend": "cudnn"} if where == "keyword" else {}))
    msg = str(err.value)
    assert "cudnn" in msg and all(n in msg for n in anymla.registered_backends()), msg


def test_unknown_backend_in_get_backend():
    with pytest.raises(ValueError, match="registered: reference"):
        anymla.get_backend("nope")


def test_register_backend_rejects_a_backend_without_name_or_with_unknown_ops():
    class NoName(Backend):
        ops = frozenset(OPS)

    class BadOps(Backend):
        name = "bad_ops"
        ops = frozenset({"dense_prefill"})

    for b in (NoName(), BadOps()):
        with pytest.raises(ValueError, match="backend"):
            anymla.register_backend(b)
    assert "bad_ops" not in anymla.registered_backends()


# ---------------------------------------------------------------- fallback and availability

@pytest.fixture
def broken_first(fresh_dispatch, monkeypatch):
    """A backend that always reports a reason, registered and put first in the CPU priority order."""
    broken = anymla.register_backend(Probe("broken", reasons=["broken: always refuses (test backend)"]))
    monkeypatch.setitem(selection.PRIORITY, "cpu", ("broken",) + selection.PRIORITY["cpu"])
    yield broken
    anymla.unregister_backend("broken")
    selection.clear_decision_cache()


def test_automatic_selection_falls_back_past_a_backend_that_refuses(broken_first):
    a = prefill_args()
    d = explain_prefill(a)
    assert (d.backend, d.source) == ("reference", "auto")
    assert dict(d.rejected)["broken"] == ("broken: always refuses (test backend)",)
    assert "not broken: broken: always refuses" in str(d)
    out = anymla.flash_mla_sparse_fwd(**a)
    compare_outputs("sparse_prefill", out, anymla.flash_mla_sparse_fwd(**a, backend="reference"))
    assert broken_first.calls == 0


def test_when_no_backend_can_run_the_error_lists_every_reason(broken_first, monkeypatch):
    monkeypatch.setitem(selection.PRIORITY, "cpu", ("broken",))
    for name in anymla.registered_backends():
        if name != "broken":
            monkeypatch.setattr(anymla.get_backend(name), "not_supported_reasons",
                                lambda problem, name=name: [f"{name} switched off by the test"])
    with pytest.raises(anymla.BackendNotSupported, match="no backend can run") as err:
        anymla.flash_mla_sparse_fwd(**prefill_args())
    assert "broken: always refuses" in str(err.value) and "reference switched off" in str(err.value)


def test_external_peers_are_never_chosen_automatically(fresh_dispatch, monkeypatch):
    peer = Probe("peer_for_test")
    peer.auto_select = False
    anymla.register_backend(peer)
    monkeypatch.setitem(selection.PRIORITY, "cpu", ("peer_for_test",) + selection.PRIORITY["cpu"])
    try:
        d = explain_prefill(prefill_args())
        assert d.backend == "reference" and "external peer" in dict(d.rejected)["peer_for_test"][0]
        assert explain_prefill(prefill_args(), backend="peer_for_test").backend == "peer_for_test"
    finally:
        anymla.unregister_backend("peer_for_test")


def test_available_backends_on_cpu():
    names = anymla.available_backends("cpu")
    assert names[0] == "reference" and "ascendc" not in names
    # Triton runs on the CPU only through its interpreter (conftest sets TRITON_INTERPRET=1 when there is no GPU).
    assert ("triton" in names) == (os.environ.get("TRITON_INTERPRET") == "1")
    assert anymla.available_backends(torch.device("cpu")) == names
    assert anymla.available_backends("meta") == ["reference"]
    assert anymla.available_backends() == anymla.available_backends(selection.default_device())


def test_an_unregistered_backend_is_never_called_again(fresh_dispatch, monkeypatch):
    fast = anymla.register_backend(Probe("fast_for_test"))
    monkeypatch.setitem(selection.PRIORITY, "cpu", ("fast_for_test",) + selection.PRIORITY["cpu"])
    a = prefill_args()
    anymla.flash_mla_sparse_fwd(**a)
    assert fast.calls == 1
    anymla.unregister_backend("fast_for_test")
    anymla.flash_mla_sparse_fwd(**a)
    assert fast.calls == 1 and explain_prefill(a).backend == "reference"


def test_replacing_a_backend_takes_effect_for_signatures_already_decided(fresh_dispatch):
    a = prefill_args()
    old = anymla.register_backend(Probe("swap_for_test"))
    try:
        anymla.flash_mla_sparse_fwd(**a, backend="swap_for_test")
        new = anymla.register_backend(Probe("swap_for_test"))  # same name, new object
        anymla.flash_mla_sparse_fwd(**a, backend="swap_for_test")
        assert (old.calls, new.calls) == (1, 1)
    finally:
        anymla.unregister_backend("swap_for_test")


# ---------------------------------------------------------------- wrong numbers are caught

def _scaled(factor):
    return lambda op, outs: (outs[0] * factor,) + tuple(outs[1:])


def _lse_shifted(op, outs):
    lse_at = 2 if op == "sparse_prefill" else 1
    return tuple(o + 1e-3 if i == lse_at else o for i, o in enumerate(outs))


def _one_nan(op, outs):
    out = outs[0].clone()
    out.view(-1)[out.numel() // 2] = float("nan")  # one unwritten element
    return (out,) + tuple(outs[1:])


def _heads_swapped(op, outs):
    out = outs[0].clone()
    out[..., 0, :], out[..., 1, :] = outs[0][..., 1, :], outs[0][..., 0, :]
    return (out,) + tuple(outs[1:])


def _empty_row_not_inf(op, outs):
    at = 2 if op == "sparse_prefill" else 1
    lse = outs[at].clone()
    assert torch.isposinf(lse).any(), "the inputs have an empty row"
    lse[torch.isposinf(lse)] = 0.0
    return tuple(lse if i == at else o for i, o in enumerate(outs))


CORRUPTIONS = {"out-x1.02": _scaled(1.02), "lse+1e-3": _lse_shifted, "one-nan": _one_nan,
               "heads-swapped": _heads_swapped, "empty-lse-not-inf": _empty_row_not_inf}


def _op_args():
    pre = prefill_args(seed=5)
    pre["indices"][0] = -1  # one empty row, so the inf positions matter
    dec = sparse_decode_inputs(2, 1, 4, 20, 8, fmt=anymla.kvcache.KVCacheFormat.V32_FP8, page=4, seed=6)
    dec["indices"][0] = -1
    den = dense_decode_inputs(2, 1, 4, 1, 10, page=4, seed=7)
    den["cache_seqlens"][0] = 0
    return {"sparse_prefill": (anymla.flash_mla_sparse_fwd, pre),
            "sparse_decode": (anymla.flash_mla_with_kvcache, dict(dec, tile_scheduler_metadata=None)),
            "dense_decode": (anymla.flash_mla_with_kvcache, dict(den, tile_scheduler_metadata=None))}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
@pytest.mark.parametrize("op", OPS)
def test_compare_outputs_catches_a_backend_returning_wrong_numbers(fresh_dispatch, op, corruption):
    wrong = anymla.register_backend(Probe("wrong_for_test", corrupt=CORRUPTIONS[corruption]))
    try:
        fn, args = _op_args()[op]
        got = fn(**args, backend="wrong_for_test")
        ref = fn(**args, backend="reference")
        compare_outputs(op, ref, fn(**args, backend="reference"))  # the reference agrees with itself
        with pytest.raises(AssertionError, match=op):
            compare_outputs(op, got, ref)
        assert wrong.calls == 1
    finally:
        anymla.unregister_backend("wrong_for_test")


# ---------------------------------------------------------------- decision cache

def test_one_signature_is_validated_once(fresh_dispatch, monkeypatch):
    calls = []
    real = SparsePrefill.validate
    monkeypatch.setattr(SparsePrefill, "validate", lambda self: calls.append(1) or real(self))
    a = prefill_args()
    for seed in range(6):  # new values, same signature
        anymla.flash_mla_sparse_fwd(**prefill_args(seed=seed))
    assert len(calls) == 1
    anymla.flash_mla_sparse_fwd(**prefill_inputs(1, 4, 512, 20, 8))  # another shape
    anymla.flash_mla_sparse_fwd(**dict(a, kv=non_contiguous(a["kv"])))  # other strides
    anymla.flash_mla_sparse_fwd(**a, backend="reference")  # another override
    assert len(calls) == 4
    anymla.flash_mla_sparse_fwd(**a, backend="reference")
    assert len(calls) == 4


def test_a_rejected_signature_is_not_cached(fresh_dispatch):
    a = prefill_args()
    for _ in range(2):  # validation runs (and raises) every time for bad input
        with pytest.raises(ValueError, match="^sm_scale:"):
            anymla.flash_mla_sparse_fwd(**dict(a, sm_scale=-1.0))


def test_load_tuning_clears_the_decision_cache(probes, tmp_path):
    a = prefill_args()
    before = explain_prefill(a)
    selection.load_tuning(tuning_file(tmp_path, before, "probe_a"))
    after = explain_prefill(a)
    assert after is not before and after.backend == "probe_a"


def test_a_peer_measured_faster_is_chosen_and_explain_says_why(fresh_dispatch, monkeypatch):
    peer = Probe("measured_peer")
    peer.auto_select = False
    peer.measured_faster = lambda problem: "measured faster for the test's regime"
    anymla.register_backend(peer)
    try:
        d = explain_prefill(prefill_args())
        assert (d.backend, d.source) == ("measured_peer", "measured")
        assert d.measured == "measured faster for the test's regime"
        assert "measured: measured faster for the test's regime" in str(d)
        compare_outputs("sparse_prefill", anymla.flash_mla_sparse_fwd(**prefill_args()),
                        anymla.flash_mla_sparse_fwd(**prefill_args(), backend="reference"))
        assert peer.calls == 1
        # A measured peer that cannot run the call is passed over, with its reasons.
        peer.reasons = ["not this shape"]
        selection.clear_decision_cache()
        d = explain_prefill(prefill_args())
        assert (d.backend, d.source) == ("reference", "auto")
        assert dict(d.rejected)["measured_peer"] == ("not this shape",)
        # An explicit choice still wins over the measurement.
        peer.reasons = []
        assert explain_prefill(prefill_args(), backend="reference").backend == "reference"
    finally:
        anymla.unregister_backend("measured_peer")


def test_flashmla_peer_measured_regimes(monkeypatch):
    """The regimes where FlashMLA v1.0.0 beat the Triton tier on sm_90: sparse prefill above 32 heads, sparse
    decoding above 32 heads of V3.2 caches and above 64 of MODEL1 caches, dense decoding above 16 query rows a kv
    head, each only for calls large enough to be GPU-bound (below, anymla's compiled call path is the faster
    eagerly); nothing on other GPUs, formats or ops."""
    from types import SimpleNamespace
    from anymla.backends import flashmla_peer
    from anymla.kvcache import KVCacheFormat as F
    peer = anymla.get_backend("flashmla")
    monkeypatch.setattr(flashmla_peer, "_arch", lambda device: 9)
    cuda = torch.device("cuda")

    def faster(op, q_shape, fmt=None, device=cuda, topk=2048, extra_topk=None, s_k=8192, h_kv=1):
        extra = None if extra_topk is None else torch.empty(extra_topk, device="meta")
        dense = dict(k_cache=torch.empty(1, 64, h_kv, 576, device="meta"),
                     block_table=torch.empty(q_shape[0], s_k // 64, device="meta"))
        return bool(peer.measured_faster(SimpleNamespace(op=op, device=device, fmt=fmt,
                                                         q=torch.empty(q_shape, device="meta"),
                                                         indices=torch.empty(topk, device="meta"), extra_indices=extra,
                                                         **dense)))
    assert not faster("sparse_prefill", (4096, 32, 512)) and faster("sparse_prefill", (4096, 33, 576))
    assert faster("sparse_prefill", (4096, 128, 512))
    assert not faster("sparse_decode", (128, 1, 32, 576), F.V32_FP8)
    assert faster("sparse_decode", (128, 1, 64, 576), F.V32_FP8)
    assert faster("sparse_decode", (128, 2, 128, 512), F.MODEL1_FP8)
    assert faster("sparse_decode", (64, 1, 64, 576), F.V32_FP8) and \
        not faster("sparse_decode", (4, 1, 64, 576), F.V32_FP8, topk=512), "a host-bound call: anymla's own"
    assert not faster("sparse_prefill", (256, 128, 576), topk=128)
    assert not faster("sparse_decode", (128, 2, 64, 512), F.MODEL1_FP8, topk=128, extra_topk=512), \
        "FlashMLA's CONFIG1 (MODEL1 at 64 heads): anymla's own"
    assert faster("sparse_decode", (128, 2, 128, 512), F.MODEL1_FP8, topk=128, extra_topk=1024), "CONFIG2"
    assert not faster("sparse_decode", (128, 2, 128, 512), F.MODEL1_FP8, topk=16, extra_topk=16), \
        "a host-bound call, the extra cache's keys counted: anymla's own"
    assert not faster("sparse_decode", (128, 1, 64, 512), F.V41_FP8)
    # dense: FlashMLA above 16 query rows a kv head, where the call is GPU-bound
    assert faster("dense_decode", (128, 2, 128, 576)) and faster("dense_decode", (64, 1, 128, 576), s_k=4096)
    assert faster("dense_decode", (128, 1, 32, 576)) and not faster("dense_decode", (128, 1, 16, 576))
    assert faster("dense_decode", (128, 1, 128, 576), h_kv=2), "64 rows a kv head"
    assert not faster("dense_decode", (8, 1, 32, 576), s_k=4096), "b8 h32 s_k 4096: host-bound, anymla's own"
    assert not faster("dense_decode", (1, 1, 128, 576), s_k=32768), "b1 h128 s_k 32768: host-bound, anymla's own"
    assert not faster("sparse_prefill", (4096, 128, 576), device=torch.device("cpu"))
    monkeypatch.setattr(flashmla_peer, "_arch", lambda device: 10)
    assert not faster("sparse_prefill", (4096, 128, 576))


@pytest.mark.parametrize("h_q", [16, 64])
def test_flashmla_peer_pads_heads_and_slices_them_back(monkeypatch, h_q):
    """The peer runs FlashMLA at 64 heads (q and attn_sink padded with zero heads) and hands back the first h_q
    heads of each output, with lse as anymla's backends return it ([b, s_q, h_q]); at 64 heads it hands FlashMLA's
    outputs back as they came (CPU, a stand-in for flash_mla that records what it was given)."""
    from anymla.backends import flashmla_peer
    from anymla.kvcache import KVCacheFormat as F
    from anymla.problems import decode_problem
    seen = {}

    def with_kvcache(q, k_cache, block_table, cache_seqlens, d_v, meta, num_splits, **kw):
        b, s_q, h, _ = q.shape
        seen.update(q=q, sink=kw["attn_sink"])
        out = torch.randn(b, s_q, h, d_v, dtype=q.dtype)
        lse = torch.randn(b, s_q, h).transpose(1, 2)  # FlashMLA's layout: a [b, h, s_q] view
        seen.update(out=out, lse=lse)
        return out, lse
    fake = SimpleNamespace(flash_mla_with_kvcache=with_kvcache, get_mla_metadata=lambda: (object(), None))
    monkeypatch.setattr(flashmla_peer, "_flash_mla", lambda: (fake, ""))
    a = sparse_decode_inputs(2, 1, h_q, 256, 64, fmt=F.V32_FP8, device=torch.device("cpu"))
    a["attn_sink"] = torch.randn(h_q)
    p = decode_problem(a["q"], a["k_cache"], None, None, 512, None, False, True, a["indices"], a["attn_sink"],
                       None, None, None, None, False, None, None)
    out, lse = anymla.get_backend("flashmla").run(p)
    assert seen["q"].shape[2] == 64 and seen["sink"].shape == (64,)
    assert torch.equal(seen["q"][:, :, :h_q], a["q"]) and torch.equal(seen["sink"][:h_q], a["attn_sink"])
    assert not seen["q"][:, :, h_q:].any() and not seen["sink"][h_q:].any()
    assert out.shape == (2, 1, h_q, 512) and lse.shape == (2, 1, h_q)
    assert torch.equal(out, seen["out"][:, :, :h_q]) and torch.equal(lse, seen["lse"].transpose(1, 2)[:, :, :h_q])
    if h_q == 64:
        assert out is seen["out"] and lse.data_ptr() == seen["lse"].data_ptr()


@pytest.mark.parametrize("shape, dim", [((3, 2, 16, 576), 2), ((5, 16, 576), 1), ((16,), 0)])
def test_flashmla_peer_padding_appends_zero_heads_along_the_head_dimension(shape, dim):
    """Decoding q [b, s_q, h, d], prefill q [s_q, h, d] and attn_sink [h]: zero heads appended up to 64."""
    from anymla.backends.flashmla_peer import _Padding
    t = torch.randn(shape)
    padded = _Padding(16, 64).pad(t, dim)
    assert padded.shape == (*shape[:dim], 64, *shape[dim + 1:])
    assert torch.equal(padded.narrow(dim, 0, 16), t) and not padded.narrow(dim, 16, 48).any()
    assert _Padding(64, 64).pad(t, dim) is t and _Padding(16, 64).pad(None, dim) is None
