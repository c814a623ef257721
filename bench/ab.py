"""``python -m anymla.bench.ab``: the same cases timed on several versions of anymla's source in one device call,
each version in a process of its own, the first timed again last (how far the machine drifted meanwhile).

    # here, in the git checkout: each revision's package folders into DIR/LABEL (DIR: a folder git ignores);
    # WORKTREE stands for the working tree's files as they are
    python -m anymla.bench.ab prepare DIR main=HEAD new=WORKTREE exp=some-branch
    # on the device machine, DIR carried along: every version on every case, checked, then timed (``run`` needs
    # no installed anymla: ``python3 bench/ab.py run ...`` from a checkout does the same)
    python -m anymla.bench.ab run DIR prefill-v32-h128 'sparse_decode:b=128,h_q=16,topk=2048' --stand-in mma-sync

A case is a bench suite's case name or a shape spec (``python -m anymla.bench --list``). Each version's output is
compared with the reference's first (computed once, by the first version, and reported, not gated: a timing-only
variant may be wrong on purpose), then timed by the bench's timer (GPU time, graph replay for short calls, L2
flushed). ``--stand-in``: ``portable`` (the Hopper kernels off) or ``mma-sync`` (also ``tl.dot`` as mma.sync),
set in every version's process.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

PACKAGE_DIRS = ("dispatch", "triton_kernels", "ascendc_kernels", "bench")
WORKTREE = "WORKTREE"
STAND_INS = {"portable": {"ANYMLA_HOPPER_KERNELS": "0"},
             "mma-sync": {"ANYMLA_HOPPER_KERNELS": "0", "DISABLE_MMA_V3": "1"}}
_ORDER = "ORDER"  # the versions' labels, one a line, in the order given to prepare


def extract_revision(rev: str, dest: str, repo: str = ".") -> None:
    """The package folders of git revision ``rev`` of ``repo`` into ``dest`` (committed results left out)."""
    archive = subprocess.run(["git", "-C", repo, "archive", rev, *PACKAGE_DIRS], capture_output=True)
    if archive.returncode:
        raise SystemExit(f"versions: git archive {rev}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", dest, "--exclude=bench/results"], input=archive.stdout, check=True)


def prepare(out: str, versions: list[str], repo: str = ".") -> list[str]:
    """Each ``LABEL=REV`` (or ``REV``, labelled by itself) of ``versions`` as ``out/LABEL``: the package folders
    of git revision REV, or of the working tree for ``WORKTREE``. Returns the labels."""
    labels = []
    for spec in versions:
        label, _, rev = spec.rpartition("=")
        label = label or re.sub(r"[^A-Za-z0-9_.-]", "_", rev)
        if label in labels:
            raise SystemExit(f"versions: the label {label!r} is given twice")
        dest = os.path.join(out, label)
        shutil.rmtree(dest, ignore_errors=True)
        os.makedirs(dest)
        if rev == WORKTREE:
            for d in PACKAGE_DIRS:
                shutil.copytree(os.path.join(repo, d), os.path.join(dest, d),
                                ignore=shutil.ignore_patterns("__pycache__", "results"))
        else:
            extract_revision(rev, dest, repo)
        labels.append(label)
    with open(os.path.join(out, _ORDER), "w") as f:
        f.write("\n".join(labels) + "\n")
    return labels


def _site(tree: str) -> str:
    """A folder for PYTHONPATH in which ``anymla`` is ``tree``'s source, mapped as pyproject.toml maps it."""
    site = tempfile.mkdtemp(prefix="anymla_ab_")
    shutil.copytree(os.path.join(tree, "dispatch"), os.path.join(site, "anymla"))
    for d in PACKAGE_DIRS[1:]:
        os.symlink(os.path.abspath(os.path.join(tree, d)), os.path.join(site, "anymla", d))
    return site


def _time_cases(cases: list[str], refs: str, device: str, backend: str, reps: int) -> None:
    """In a version's own process (its anymla first on the path): one JSON line a case."""
    import torch
    import anymla
    from anymla.bench.suites import build_inputs, parse_shape, suite_cases, suite_names
    from anymla.bench.timing import Timer
    from anymla.testing import compare_outputs
    named = {c.name: c for s in suite_names() for c in suite_cases(s)}
    dev = torch.device(device)
    timer = Timer(dev, reps)
    for i, name in enumerate(cases):
        case = named[name] if name in named else parse_shape(name)
        fn, args = build_inputs(case, dev, 0)
        ref = os.path.join(refs, f"{i}.pt")
        if not os.path.exists(ref):
            torch.save(tuple(fn(**args, backend="reference")), ref)
        expected = torch.load(ref)
        got = tuple(fn(**args, backend=backend))
        try:
            compare_outputs(case.op, got, expected)
            agree = "ok"
        except AssertionError as err:
            agree = "WRONG: " + str(err).strip().splitlines()[-1][:160]
        kernel = str(anymla.explain(fn, **args, backend=backend)).splitlines()[0]
        t = timer.measure(lambda: fn(**args, backend=backend))
        print(json.dumps(dict(case=name, us=t.median_us, p20=t.p20_us, p80=t.p80_us, agree=agree, kernel=kernel)),
              flush=True)
        del args, got, expected
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def run(trees: str, cases: list[str], stand_in: str = "", device: str = "cuda", backend: str = "triton",
        reps: int = 30) -> list[dict]:
    """Every version prepared in ``trees`` (and the first again at the end) on ``cases``; one row a version and
    case (``label``, ``case``, ``us``, ``p20``, ``p80``, ``agree``, ``kernel``, or ``error``)."""
    with open(os.path.join(trees, _ORDER)) as f:
        labels = f.read().split()
    refs = tempfile.mkdtemp(prefix="anymla_ab_refs_")
    env = {**os.environ, **STAND_INS.get(stand_in, {}), "PYTHONUNBUFFERED": "1"}
    rows = []
    for n, label in enumerate(labels + labels[:1]):
        shown = label if n < len(labels) else f"{label} (again)"
        site = _site(os.path.join(trees, label))
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "_time", refs, device, backend, str(reps),
                               *cases], env={**env, "PYTHONPATH": site}, capture_output=True, text=True)
        got = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        done = [dict(label=shown, **r) for r in got]
        if proc.returncode:
            error = (proc.stderr.strip().splitlines() or ["exit status %d" % proc.returncode])[-1][:200]
            done += [dict(label=shown, case=c, error=error) for c in cases[len(got):]]
        for row in done:  # as each version ends: a run cut short by a time limit keeps what it finished
            print(json.dumps(row), flush=True)
        rows += done
        shutil.rmtree(site, ignore_errors=True)
    shutil.rmtree(refs, ignore_errors=True)
    return rows


def table(rows: list[dict]) -> str:
    """A row a case, a column a version: µs and the change against the first version."""
    labels = list(dict.fromkeys(r["label"] for r in rows))
    by = {(r["label"], r["case"]): r for r in rows}
    lines = ["| case | " + " | ".join(labels) + " |", "|" + " --- |" * (len(labels) + 1)]
    for case in dict.fromkeys(r["case"] for r in rows):
        base = by.get((labels[0], case), {}).get("us")
        cells = []
        for label in labels:
            r = by.get((label, case), {})
            if "us" not in r:
                cells.append(r.get("error", "—"))
                continue
            change = f" ({100 * (r['us'] / base - 1):+.1f} %)" if base and label != labels[0] else ""
            cells.append(f"{r['us']:.1f}{change}" + ("" if r["agree"] == "ok" else " " + r["agree"]))
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == ["_time"]:
        # Run as a script: its folder (this bench/) must not shadow top-level modules for the version timed.
        here = os.path.dirname(os.path.abspath(__file__))
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
        refs, device, backend, reps, *cases = sys.argv[2:]
        _time_cases(cases, refs, device, backend, int(reps))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="the versions' source into DIR (here, in the git checkout)")
    p.add_argument("dir")
    p.add_argument("versions", nargs="+", metavar="LABEL=REV")
    r = sub.add_parser("run", help="time every prepared version on the cases")
    r.add_argument("dir")
    r.add_argument("cases", nargs="+")
    r.add_argument("--stand-in", choices=sorted(STAND_INS), default="")
    r.add_argument("--device", default="cuda")
    r.add_argument("--backend", default="triton")
    r.add_argument("--reps", type=int, default=30)
    r.add_argument("--csv", help="also write the rows here")
    a = ap.parse_args()
    if a.command == "prepare":
        print("prepared:", ", ".join(prepare(a.dir, a.versions)))
        return
    rows = run(a.dir, a.cases, a.stand_in, a.device, a.backend, a.reps)
    if a.csv:
        import csv
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, ["label", "case", "us", "p20", "p80", "agree", "kernel", "error"])
            w.writeheader()
            w.writerows(rows)
    print(table(rows))


if __name__ == "__main__":
    main()
