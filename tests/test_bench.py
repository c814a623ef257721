"""The benchmark harness itself: its model arithmetic, the CSV schema, the correctness gate, --tune and the CLI.

Everything runs on the CPU in seconds: tiny shapes, the reference plus test-only backends, and one
end-to-end run of the quick suite (the Triton tier in its interpreter).
"""

import csv
import json
import os
import subprocess
import sys

import pytest
import torch

import anymla
from anymla.backends.reference import ReferenceBackend
from anymla.bench import model, report, runner, suites, tune
from anymla.bench.ceilings import Ceilings
from anymla.bench.machine import describe
from anymla.bench.timing import Timer, summarize
from anymla.kvcache import KVCacheFormat as F
from anymla.selection import clear_decision_cache, load_tuning
from anymla.testing import dense_decode_inputs, prefill_inputs, sparse_decode_inputs

CPU = torch.device("cpu")
OUT_BYTES_PER_HEAD = 512 * 2  # one bf16 output row
TINY_DENSE = suites.Case("tiny-dense", "dense_decode", dict(b=2, s_q=1, h_q=16, s_k=128))


def _q_out_bytes(tokens, h_q, d_qk):
    return tokens * h_q * (d_qk * 2 + OUT_BYTES_PER_HEAD)


# ---------------------------------------------------------------- the performance model, by hand

def test_dense_decode_cost():
    args = dense_decode_inputs(2, 1, 16, 1, 256)
    c = model.cost("dense_decode", args)
    assert c.flops == 2 * 2 * 16 * 256 * (576 + 512)
    assert c.bytes == 2 * 256 * 576 * 2 + _q_out_bytes(2, 16, 576)


def test_dense_decode_cost_counts_the_causal_window():
    args = dense_decode_inputs(2, 2, 16, 1, 256, causal=True)
    # query 0 sees 255 keys, query 1 all 256; the cache is read once whatever s_q is
    assert model.cost("dense_decode", args).flops == 2 * 2 * (255 + 256) * 16 * (576 + 512)
    assert model.cost("dense_decode", {**args, "causal": False}).flops == 2 * 2 * 2 * 256 * 16 * (576 + 512)


def test_sparse_decode_cost_per_format():
    args = sparse_decode_inputs(2, 1, 64, 256, 128, fmt=F.V32_FP8, varlen=False)
    c = model.cost("sparse_decode", args)
    assert c.flops == 2 * 2 * 64 * 128 * (576 + 512)
    assert c.bytes == 2 * 128 * 656 + _q_out_bytes(2, 64, 576)

    args = sparse_decode_inputs(2, 1, 64, 256, 128, fmt=F.V41_FP8, varlen=False,
                                extra=dict(fmt=F.V41_FP4, page=64, s_k=128, topk=64))
    c = model.cost("sparse_decode", args)
    assert c.flops == 2 * 2 * 64 * (128 + 64) * (512 + 512)
    assert c.bytes == 2 * 128 * 528 + 2 * 64 * 288 + _q_out_bytes(2, 64, 512)


def test_sparse_decode_cost_skips_padding():
    args = sparse_decode_inputs(1, 1, 64, 100, 128, fmt=F.V32_FP8, varlen=False)  # 28 slots of -1 padding
    assert model.cost("sparse_decode", args).flops == 2 * 64 * 100 * (576 + 512)


def test_sparse_prefill_cost_reads_each_row_once():
    args = prefill_inputs(2, 16, 576, 128, 128)  # both tokens read all 128 rows
    c = model.cost("sparse_prefill", args)
    assert c.flops == 2 * 2 * 16 * 128 * (576 + 512)
    assert c.bytes == 128 * 576 * 2 + _q_out_bytes(2, 16, 576)


def test_floor_and_rates():
    ceilings = Ceilings(copy_gbps=1000.0, matmul_tflops=100.0, copy_label="", matmul_label="")
    c = model.Cost(flops=1e12, bytes=1e9)  # 10 ms of matmul, 1 ms of copy
    assert model.floor_us(c, ceilings) == (pytest.approx(10_000.0), "compute")
    r = model.rates(c, 20_000.0, ceilings)
    assert (r.tflops, r.gbps) == (pytest.approx(50.0), pytest.approx(50.0))
    assert (r.frac_of_floor, r.ratio_to_matmul, r.ratio_to_copy) == (
        pytest.approx(0.5), pytest.approx(0.5), pytest.approx(0.05))
    assert model.floor_us(model.Cost(flops=1.0, bytes=1e9), ceilings)[1] == "memory"


def test_quantiles():
    t = summarize([5.0, 1.0, 3.0, 2.0, 4.0], "wall-clock")
    assert (t.median_us, t.p20_us, t.p80_us, t.reps) == (3.0, pytest.approx(1.8), pytest.approx(4.2), 5)


# ---------------------------------------------------------------- shapes

def test_parse_shape():
    case = suites.parse_shape("sparse_decode:b=2,h_q=64,s_k=256,topk=128,fmt=V41_FP8,sink=true")
    assert case.params["fmt"] == "V41_FP8" and case.params["sink"] is True and case.params["page"] == 64
    assert suites.parse_shape(case.spec()).params == case.params
    for bad, message in (("attention:b=1", "op"), ("dense_decode:b=1,s_k=2", "needs h_q"),
                         ("dense_decode:b=1,h_q=2,s_k=2,warp=3", "warp"), ("sparse_decode:fmt=FP7", "FP7")):
        with pytest.raises(ValueError, match=message):
            suites.parse_shape(bad)


def test_every_suite_builds_valid_cases():
    for name in suites.suite_names():
        assert suites.suite_cases(name), name
    with pytest.raises(ValueError, match="unknown suite"):
        suites.suite_cases("nope")


# ---------------------------------------------------------------- the correctness gate

class _WrongBackend(ReferenceBackend):
    """The reference with its output shifted: the gate must call it wrong and never time it."""

    name = "wrong_for_test"
    calls = 0

    def run(self, problem, plan=None):
        type(self).calls += 1
        out, *rest = super().run(problem, plan)
        return (out + 0.25, *rest)


class _RaisingBackend(ReferenceBackend):
    name = "raising_for_test"

    def run(self, problem, plan=None):
        raise RuntimeError("deliberate failure")


class _GpuOnlyBackend(ReferenceBackend):
    name = "gpu_only_for_test"
    device_types = ("cuda",)
    any_device = False


@pytest.fixture
def test_backends():
    added = [_WrongBackend(), _RaisingBackend(), _GpuOnlyBackend()]
    for b in added:
        anymla.register_backend(b)
    _WrongBackend.calls = 0
    yield [b.name for b in added]
    for b in added:
        anymla.unregister_backend(b.name)
    clear_decision_cache()


def test_gate_rejects_wrong_failing_and_unsupported_backends(test_backends):
    outcome = runner.run_case("test", TINY_DENSE, ["reference"] + test_backends, Timer(CPU, 1))
    status = {r.backend: r for r in outcome.results}
    assert status["reference"].status == runner.OK and status["reference"].timing is not None
    assert status["wrong_for_test"].status == runner.WRONG and status["wrong_for_test"].timing is None
    assert "dense_decode.out" in status["wrong_for_test"].note
    assert _WrongBackend.calls == 1  # the gate's call only: a wrong backend is never timed
    assert status["raising_for_test"].status == runner.ERROR and "deliberate failure" in status["raising_for_test"].note
    assert status["gpu_only_for_test"].status == runner.UNSUPPORTED and "cuda" in status["gpu_only_for_test"].note
    assert outcome.fastest == "reference"


# ---------------------------------------------------------------- CSV, tuning

def _outcomes(backends):
    timer = Timer(CPU, 1)
    return [runner.run_case("test", case, backends, timer, tolerance_scale=2.0)
            for case in (TINY_DENSE, suites.Case("tiny-sparse", "sparse_decode",
                                                  dict(b=1, h_q=16, s_k=128, topk=64)))]


def test_csv_has_one_row_per_shape_and_backend(tmp_path):
    backends = anymla.available_backends(CPU)
    outcomes = _outcomes(backends)
    ceilings = Ceilings(10.0, 0.1, "test copy", "test matmul")
    info = describe(CPU)
    path = tmp_path / "results.csv"
    report.write_csv(str(path), report.csv_rows(outcomes, info, ceilings))
    with open(path) as f:
        rows = list(csv.DictReader(f))
    required = {"timestamp", "device", "device_name", "torch", "triton", "anymla", "source", "suite", "op",
                "shape", "backend", "status", "median_us", "p20_us", "p80_us", "reps", "eager_us", "host_us", "flops",
                "bytes", "tflops", "gbps",
                "floor_us", "frac_of_floor", "copy_gbps", "matmul_tflops", "ratio_to_matmul", "ratio_to_copy",
                "dispatcher_choice", "fastest"}
    assert required <= set(rows[0])
    assert [(r["case"], r["backend"]) for r in rows] == [(o.case.name, b) for o in outcomes for b in backends]
    for r in rows:
        assert r["status"] == "ok", r["note"]
        assert float(r["median_us"]) > 0 and float(r["tflops"]) > 0 and r["shape"].startswith(r["op"])
        assert r["dispatcher_choice"] in backends and r["fastest"] in backends



def test_the_plot_marks_eager_speed_where_it_was_timed(tmp_path, monkeypatch):
    """Each timed bar gets a mark at its eager speed (GPU runs time both; on the CPU there is none to mark)."""
    import dataclasses
    import matplotlib.axes
    from anymla.bench.plot import plot_suite
    outcomes = _outcomes(["reference"])
    ceilings = Ceilings(10.0, 0.1, "test copy", "test matmul")
    r = outcomes[0].results[0]
    r.timing = dataclasses.replace(r.timing, eager_us=2 * r.timing.median_us)
    marked = []
    real = matplotlib.axes.Axes.scatter
    monkeypatch.setattr(matplotlib.axes.Axes, "scatter", lambda ax, x, y, **kw: marked.append((x, y)) or real(ax, x, y, **kw))
    plot_suite(str(tmp_path / "p.png"), "test", outcomes, describe(CPU), ceilings)
    assert (tmp_path / "p.png").stat().st_size > 0
    gpu = 100 * model.rates(outcomes[0].cost, r.timing.median_us, ceilings).frac_of_floor
    assert len(marked) == 1 and len(marked[0][1]) == 1 and marked[0][1][0] == pytest.approx(gpu / 2)

def test_tune_writes_a_file_the_dispatcher_reads(tmp_path):
    outcomes = _outcomes(["reference"])
    path = str(tmp_path / "tuning.json")
    written = tune.write_tuning(path, outcomes, describe(CPU))
    assert len(written) == 2 and set(written.values()) == {"reference"}
    with open(path) as f:
        assert json.load(f)["choices"] == written
    fn, args = suites.build_inputs(TINY_DENSE, CPU)
    try:
        load_tuning(path)
        decision = anymla.explain(fn, **args)
        assert (decision.backend, decision.source) == ("reference", "tuned")
    finally:
        load_tuning(None)
    assert anymla.explain(fn, **args).source == "auto"


# ---------------------------------------------------------------- the command line

# The command-line tests run the Triton tier in Triton's interpreter in a subprocess.
_INTERPRETER = pytest.mark.skipif(bool(anymla.triton_kernels.runtime.interpreter_reasons()),
                                  reason="; ".join(anymla.triton_kernels.runtime.interpreter_reasons()))


@_INTERPRETER
def test_cli_quick_suite_end_to_end(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "anymla.bench", "--device", "cpu", "--suite", "quick", "--reps", "1",
           "--out", str(out), "--shape", "dense_decode:b=1,h_q=16,s_k=128", "--baseline", "reference",
           "--target", "triton"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert "== quick ==" in done.stdout, done.stdout + done.stderr  # the table is printed last: no crash
    table = done.stdout[done.stdout.index("wrote "):]  # the table comes after the files are written
    # Exit status 1 means some backend was wrong or failed (as the table says), not that the harness failed.
    assert done.returncode == 0 or any(s in table for s in (" WRONG ", " ERROR ")), done.stdout + done.stderr
    for text in ("== quick ==", "== cli ==", "GPU µs", "eager µs", "dispatcher picks", "interpreter",
                 "A/B: triton vs reference"):
        assert text in table
    assert {"results.csv", "quick.png", "cli.png", "summary.md"} <= set(os.listdir(out))
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == (len(suites.suite_cases("quick")) + 1) * 2
    assert (out / "quick.png").read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------- stand-ins (--portable, --mma-sync)

TINY_SHAPE = "dense_decode:b=1,h_q=16,s_k=64"


def _cli_run(monkeypatch, tmp_path, *flags):
    """bench's main() in this process on a tiny shape; returns (the forced warp-specialized setting inside
    runner.run, the CSV rows, the summary)."""
    from anymla.bench import __main__ as cli
    from anymla.triton_kernels import tuning
    inside = []
    real_run = runner.run

    def spy(*args, **kwargs):
        inside.append(tuning.forced_warp_specialized())
        return real_run(*args, **kwargs)
    monkeypatch.setattr(runner, "run", spy)
    out = tmp_path / "out"
    assert cli.main(["--device", "cpu", "--backends", "reference,triton", "--shape", TINY_SHAPE, "--reps", "1",
                     "--out", str(out), *flags]) == 0
    assert tuning.forced_warp_specialized() is None, "the setting must not outlive the run"
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    return inside, rows, (out / "summary.md").read_text()


def test_a_plain_run_is_marked_as_the_shipped_path(monkeypatch, tmp_path):
    monkeypatch.delenv("DISABLE_MMA_V3", raising=False)
    inside, rows, summary = _cli_run(monkeypatch, tmp_path)
    assert inside == [None]
    assert {r["stand_in"] for r in rows} == {""} and "stand-in" not in summary


def test_portable_switches_the_hopper_kernels_off_inside_the_run_and_says_so_in_every_row(monkeypatch, tmp_path):
    monkeypatch.delenv("DISABLE_MMA_V3", raising=False)
    inside, rows, summary = _cli_run(monkeypatch, tmp_path, "--portable")
    assert inside == [False]
    assert len(rows) == 2 and {r["stand_in"] for r in rows} == {"portable"}
    triton_row, = [r for r in rows if r["backend"] == "triton"]
    assert triton_row["note"].startswith("stand-in portable, not the shipped path")
    assert "NOTE: stand-in run (portable), not the shipped path: the Hopper kernels switched off" in summary


def test_mma_sync_implies_portable_and_needs_the_variable_set_before_triton(monkeypatch, tmp_path):
    """From Python (main(argv)) --mma-sync can no longer set DISABLE_MMA_V3 before triton is imported: refused
    unless the environment has it; with it, the run is both stand-ins, and --tune is refused for either."""
    from anymla.bench import __main__ as cli
    monkeypatch.delenv("DISABLE_MMA_V3", raising=False)
    with pytest.raises(SystemExit, match="--mma-sync must be on the command line"):
        cli.main(["--mma-sync", "--list"])
    monkeypatch.setenv("DISABLE_MMA_V3", "1")
    inside, rows, summary = _cli_run(monkeypatch, tmp_path, "--mma-sync")
    assert inside == [False] and {r["stand_in"] for r in rows} == {"portable+mma.sync"}
    assert "DISABLE_MMA_V3=1: Triton lowers tl.dot to mma.sync" in summary
    for flag in ("--portable", "--mma-sync"):
        with pytest.raises(SystemExit, match="--tune records the shipped path"):
            cli.main([flag, "--tune", str(tmp_path / "t.json"), "--list"])


_WATCH_TRITON_IMPORT = """
import importlib.abc, os, runpy, sys
seen = {}
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "triton" and "triton" not in seen:
            seen["triton"] = os.environ.get("DISABLE_MMA_V3")
sys.meta_path.insert(0, Watch())
sys.argv = ["anymla.bench"] + sys.argv[1:]
try:
    runpy.run_module("anymla.bench", run_name="__main__")
except SystemExit as done:
    assert not done.code, done.code
print("DISABLE_MMA_V3 when triton was imported:", seen.get("triton", "never imported"))
"""


@_INTERPRETER
def test_mma_sync_on_the_command_line_sets_disable_mma_v3_before_triton_is_imported(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DISABLE_MMA_V3"}
    env["TRITON_INTERPRET"] = "1"
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-c", _WATCH_TRITON_IMPORT, "--mma-sync", "--device", "cpu", "--backends",
                           "reference,triton", "--shape", TINY_SHAPE, "--reps", "1", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert "DISABLE_MMA_V3 when triton was imported: 1" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert "stand-in: portable+mma.sync" in done.stdout
    with open(out / "results.csv") as f:
        assert {r["stand_in"] for r in csv.DictReader(f)} == {"portable+mma.sync"}



@pytest.mark.skipif(not anymla.triton_kernels.runtime.interpreting() and not torch.cuda.is_available(),
                    reason="Triton runs on a GPU or in its interpreter (TRITON_INTERPRET=1)")
def test_the_stand_in_matmul_ceiling_computes_the_product(monkeypatch):
    """The Triton matmul a stand-in run takes as its compute ceiling is a real product (grouped tiles, fp32
    accumulation), and a rate is only reported for a correct one."""
    from anymla.bench import triton_matmul
    device = torch.device("cuda") if torch.cuda.is_available() else CPU
    g = torch.Generator().manual_seed(7)
    a = torch.randn(256, 128, generator=g).to(device, torch.bfloat16)
    b = torch.randn(128, 384, generator=g).to(device, torch.bfloat16)
    c = torch.full((256, 384), float("nan"), dtype=torch.bfloat16, device=device)
    small = (64, 128, 32, 4, 1, 2)
    triton_matmul.matmul(a, b, c, small)
    torch.testing.assert_close(c.float(), a.float() @ b.float(), rtol=1e-2, atol=5e-2)
    monkeypatch.setattr(triton_matmul, "CONFIGS", (small,))
    assert triton_matmul.best_tflops(a, b, c, lambda fn: 1.0) == pytest.approx(2 * 256 * 128 * 384 / 1e-6 / 1e12)
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda x, y: real_mm(x, y) + 100.0)
    with pytest.raises(RuntimeError, match="wrong product"):
        triton_matmul.best_tflops(a, b, c, lambda fn: 1.0)


def test_overhead_skips_launches_however_a_launcher_calls_them(monkeypatch):
    """``bench.overhead``'s launch-free timing replaces the launcher's compiled launch for the call it times and
    puts it back; the stand-in takes every way the launcher calls it (a bound call passes ``owned=``)."""
    from anymla.bench import overhead
    from anymla.triton_kernels.launcher import Launcher
    real = Launcher._launch_compiled
    seen = []
    monkeypatch.setattr(overhead, "_eager", lambda fn, device: (fn(), 0.0, 0.0))

    def call():
        seen.append((Launcher._launch_compiled(None, (1, 1, 1), [], owned=True),
                     Launcher._launch_compiled(None, (1, 1, 1), [])))
    overhead._without_launches(call, torch.device("cpu"))
    assert seen == [(True, True)] and Launcher._launch_compiled is real


def test_overhead_replays_the_launches_a_call_made(monkeypatch):
    """``bench.overhead``'s launches-alone timing records each compiled launch of one call (launcher, grid and
    its own copy of the arguments) and replays exactly those, with the real launch put back."""
    from anymla.bench import overhead
    from anymla.triton_kernels.launcher import Launcher
    real, made = Launcher._launch_compiled, []
    monkeypatch.setattr(Launcher, "_launch_compiled", lambda self, grid, args, owned=False: made.append(
        (self, grid, list(args), owned)) or True)
    monkeypatch.setattr(overhead, "_eager", lambda fn, device: (fn(), 0.0, 0.0))
    a, b = Launcher.__new__(Launcher), Launcher.__new__(Launcher)

    def call():
        args = [1, 2.0]
        Launcher._launch_compiled(a, (2, 1, 1), args, owned=True)
        args[0] = "overwritten by the launch"  # an owned list is the launch's to change
        Launcher._launch_compiled(b, (3, 1, 1), [3])
    overhead._launches_alone(call, torch.device("cpu"))
    assert made == [(a, (2, 1, 1), [1, 2.0], True), (b, (3, 1, 1), [3], False),
                    (a, (2, 1, 1), [1, 2.0], False), (b, (3, 1, 1), [3], False)]


def test_overhead_replays_a_calls_c_launchers_with_its_final_arguments(monkeypatch):
    """``bench.overhead``'s C-launcher timing hands each compiled kernel's own launcher the argument list the call
    built (here: tensor addresses in place of tensors), with the call's grid, and nothing else of anymla's path."""
    from types import SimpleNamespace
    from anymla.bench import overhead
    from anymla.triton_kernels import launcher
    runs = []

    class Kernel:
        function, packed_metadata = "fn", "meta"

        def run(self, *args):
            runs.append(args)
    t = torch.zeros(4)
    launch = launcher.Launcher(None)
    launch._pointers = [0]
    launch._compiled = {int(t.data_ptr() % 16 == 0): launcher._Direct(Kernel())}
    hooks = SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    monkeypatch.setattr(launcher, "_knobs", lambda: hooks)
    monkeypatch.setattr(launcher, "_driver", lambda: (lambda: 0, lambda device: "stream"))
    monkeypatch.setattr(overhead, "_eager", lambda fn, device: (fn(), 0.0, 0.0))
    overhead._c_launches_alone(lambda: launch._launch_compiled((5, 2, 1), [t, 7, 0.5]), torch.device("cpu"))
    assert runs == [(5, 2, 1, "stream", "fn", "meta", None, None, None, t.data_ptr(), 7, 0.5)] * 2


def test_the_source_digest_names_the_code_and_only_the_code(tmp_path):
    """Results carry a digest of the package's sources: it follows any source byte and ignores caches, results and
    a top folder's links to the subpackages (the layout a device's copy uses)."""
    from anymla.bench.machine import digest_of, source_digest
    top, sub = tmp_path / "top", tmp_path / "bench"
    (top / "__pycache__").mkdir(parents=True)
    (sub / "results").mkdir(parents=True)
    (top / "api.py").write_text("x = 1\n")
    (sub / "run.py").write_text("y = 2\n")
    roots = {"": str(top), "bench": str(sub)}
    first = digest_of(roots)
    (top / "__pycache__" / "api.cpython.pyc").write_bytes(b"\0")
    (sub / "results" / "table.py").write_text("z = 3\n")
    (top / "bench").symlink_to(sub)
    assert digest_of(roots) == first
    (sub / "run.py").write_text("y = 3\n")
    assert digest_of(roots) != first
    assert len(source_digest()) == 12 and source_digest() == describe(CPU).source


def test_stall_regions_split_a_source_page_at_each_register_budget(tmp_path):
    """An Nsight Compute source page is cut at every SETMAXREG; samples, executed instructions and stall reasons
    add up within each region, and every mbarrier wait is listed with its count."""
    from anymla.bench import stall_regions
    header = ["Address", "Source", stall_regions.SAMPLES, stall_regions.EXECUTED, "stall_long_sb", "stall_selected",
              "stall_long_sb (Not Issued)"]
    rows = [("0x00", "S2R R0, SR_TID.X", "2", "8", "0", "2", "0"),
            ("0x10", "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0x80", "1", "4", "1", "0", "9"),
            ("0x20", "LDG.E.64 R2, desc[UR4][R4.64]", "30", "40", "25", "5", "9"),
            ("0x30", "USETMAXREG.DEALLOC.CTAPOOL 0xd8", "3", "4", "0", "3", "9"),
            ("0x40", "SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [R194+URZ+0x32700], R153", "64", "1,234", "60", "4", "9")]
    path = tmp_path / "page.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "k"])
        w.writerow(header)
        w.writerows(rows)
    found = stall_regions.regions(stall_regions.read_source_page(str(path)))
    assert [r.start.split(" @")[0] for r in found] == ["kernel entry", "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0x80",
                                                      "USETMAXREG.DEALLOC.CTAPOOL 0xd8"]
    assert [r.samples for r in found] == [2, 31, 67] and [r.executed for r in found] == [8, 44, 1238]
    assert found[1].stalls == {"long_sb": 26, "selected": 5} and found[2].stalls["long_sb"] == 60
    assert stall_regions.barrier_waits(stall_regions.read_source_page(str(path))) == [
        ("0x40", rows[4][1], 1234.0)]
    text = stall_regions.report(str(path), top=1)
    assert "31.0% of the samples" in text and "executed 1234" in text


# ---------------------------------------------------------------- the gather floor

@pytest.mark.parametrize("fmt, extra", [
    (F.V32_FP8, None),
    (F.MODEL1_FP8, dict(fmt=F.MODEL1_FP8, page=64, s_k=192, topk=24, topk_length=True)),
    (F.V41_FP8, dict(fmt=F.V41_FP4, page=64, s_k=192, topk=24, topk_length=False)),
])
def test_the_gather_floor_reads_the_rows_the_call_counts(fmt, extra):
    """The read-only kernel's per-program sums equal torch's over exactly the counted rows (in range, within
    topk_length) of both caches, read as the format's bytes a row."""
    from anymla.bench.gather import RowReads
    args = sparse_decode_inputs(2, 2, 16, 256, 40, fmt=fmt, topk_length=True, extra=extra, seed=5)
    reads = RowReads(args, block_r=8)
    counted = int(model._counted(args["indices"], args["k_cache"].shape[0] * args["k_cache"].shape[1],
                                 args["topk_length"]).sum())
    assert reads.parts[0][1].numel() == counted and len(reads.parts) == (1 if extra is None else 2)
    reads.reads()
    assert reads.sums() == reads.checksum()
    assert all(s != 0 for s in reads.sums())


def test_the_report_gives_the_gather_floor_under_a_decoding_shape():
    outcomes = _outcomes(["reference"])
    ceilings = Ceilings(10.0, 0.1, "test copy", "test matmul")
    sparse = outcomes[1]
    assert sparse.gather_us is None and report.gather_text(sparse, ceilings) is None  # none timed on the CPU
    sparse.gather_us = sparse.results[0].timing.median_us / 2
    text = report.gather_text(sparse, ceilings)
    assert text.startswith("gather floor") and "reference at 0.50x of it" in text
    assert text in report.format_table(outcomes, describe(CPU), ceilings)
    rows = report.csv_rows(outcomes, describe(CPU), ceilings)
    assert float(rows[1]["frac_of_gather"]) == pytest.approx(0.5) and rows[0]["gather_us"] == ""


def test_standins_table_puts_each_stand_in_beside_the_shipped_path(tmp_path):
    """``bench.standins``: a row per canonical case, the stand-ins' times with their own runs' ceiling ratios and
    the portable kernel's slowdown against the shipped path; runs of mixed settings are refused."""
    import csv
    from anymla.bench.standins import table
    fields = ["backend", "stand_in", "case", "status", "median_us", "bound", "ratio_to_matmul", "ratio_to_copy",
              "matmul_tflops", "copy_gbps", "device_name", "torch", "triton"]

    def run(name, stand_in, us, matmul):
        path = tmp_path / f"{name}.csv"
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fields)
            w.writeheader()
            for case, t in us.items():
                common = dict(stand_in=stand_in, case=case, status="ok", median_us=t, bound="compute",
                              ratio_to_matmul=100.0 / t, ratio_to_copy=0.1, matmul_tflops=matmul, copy_gbps=3000,
                              device_name="GPU", torch="2.11", triton="3.6")
                w.writerow(dict(common, backend="triton"))
                w.writerow(dict(common, backend="reference", median_us=1e6))
        return str(path)
    text = table(run("shipped", "", {"a": 100, "b": 50}, 700), run("portable", "portable", {"a": 250, "b": 60}, 650),
                 run("mma", "portable+mma.sync", {"a": 200, "b": 80}, 420))
    assert "| a | 100 | 250 (0.4 matmul) | 2.50x | 200 (0.5 matmul) |" in text
    assert "| b | 50 | 60 (1.67 matmul) | 1.20x | 80 (1.25 matmul) |" in text
    assert "mma.sync: matmul 420.0 TFLOP/s" in text
    mixed = tmp_path / "mixed.csv"
    mixed.write_text(open(run("p2", "portable", {"a": 1}, 1)).read()
                     + "triton,portable+mma.sync,b,ok,1,compute,1,1,1,1,GPU,2.11,3.6\n")
    with pytest.raises(SystemExit, match="one run's rows"):
        table(run("s2", "", {"a": 1}, 1), str(mixed), str(mixed))


def test_ab_times_each_prepared_version_in_its_own_process(tmp_path):
    """``bench.ab``: ``prepare`` puts a git revision's and the working tree's package folders side by side; ``run``
    times each in a process whose ``anymla`` is that version (here the reference backend on the CPU), the first
    again last, each output compared with the reference."""
    from anymla.bench import ab
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    trees = str(tmp_path / "trees")
    assert ab.prepare(trees, ["old=HEAD", "new=WORKTREE"], repo) == ["old", "new"]
    assert os.path.exists(os.path.join(trees, "new", "dispatch", "api.py"))
    assert not os.path.exists(os.path.join(trees, "new", "bench", "results"))
    with pytest.raises(SystemExit, match="given twice"):
        ab.prepare(trees, ["x=HEAD", "x=WORKTREE"], repo)
    ab.prepare(trees, ["old=HEAD", "new=WORKTREE"], repo)
    rows = ab.run(trees, ["sparse_decode:b=1,h_q=16,s_k=64,topk=32"], device="cpu", backend="reference", reps=2)
    assert [r["label"] for r in rows] == ["old", "new", "old (again)"], rows
    assert all(r["agree"] == "ok" and r["us"] > 0 for r in rows), rows
    assert "| sparse_decode:b=1,h_q=16,s_k=64,topk=32 |" in ab.table(rows)


def _repository():
    """The git checkout anymla's sources are in, or a skip: an installed copy has no history."""
    from anymla.bench import machine
    repo = os.path.dirname(os.path.dirname(os.path.abspath(machine.__file__)))
    try:
        in_git = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True).returncode == 0
    except FileNotFoundError:
        in_git = False
    if not in_git:
        pytest.skip("anymla is not run from a git checkout (or git is missing)")
    return repo


def test_a_result_s_source_digest_leads_back_to_its_commit():
    """A run of a clean checkout stamps its results with the digest of HEAD, and provenance finds HEAD for it;
    a digest of no commit is reported as such (exit status 1)."""
    from anymla.bench import machine, provenance
    repo = _repository()
    folders = list(provenance._FOLDERS.values())
    if subprocess.run(["git", "-C", repo, "status", "--porcelain", "--", *folders], capture_output=True,
                      text=True).stdout.strip():
        pytest.skip("the package folders have uncommitted changes: their digest is no commit's")
    head = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    digest = provenance.revision_digest("HEAD", repo)
    assert digest == machine.source_digest()
    assert provenance.commits_with([digest, "0" * 12], repo, depth=1) == {digest: [head[:12]], "0" * 12: []}
    assert provenance.main([digest, "--repo", repo, "--depth", "1"]) == 0
    assert provenance.main(["0" * 12, "--repo", repo, "--depth", "1"]) == 1
