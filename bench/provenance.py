"""``python -m anymla.bench.provenance DIGEST...``: which commits of this repository a result's source digest names.

Every bench table and CSV row carries ``source``, the digest of the code that ran (``machine.source_digest``),
because a device machine gets a copy of the working tree, not a commit. This maps a digest back to the commits
whose package folders hash to it, or says that none of the last ``--depth`` commits does: the run then measured
uncommitted code, and a summary naming a commit for it is wrong.

    python -m anymla.bench.provenance 55ffb60c5d63            # the commits that hold exactly that code
    python -m anymla.bench.provenance --rev HEAD --rev 83a11c6  # the digest of each revision
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from .ab import PACKAGE_DIRS, extract_revision
from .machine import SUBPACKAGES, digest_of

# The repository's folder of each root of ``source_digest`` (pyproject.toml's package-dir)
_FOLDERS = {"": "dispatch", **{name: name for name in SUBPACKAGES}}
assert set(_FOLDERS.values()) == set(PACKAGE_DIRS)


def revision_digest(rev: str, repo: str = ".") -> str:
    """``source_digest`` as a run of git revision ``rev`` of ``repo`` reports it."""
    with tempfile.TemporaryDirectory() as tree:
        extract_revision(rev, tree, repo)
        return digest_of({name: os.path.join(tree, folder) for name, folder in _FOLDERS.items()})[:12]


def commits_with(digests: list[str], repo: str = ".", depth: int = 200) -> dict[str, list[str]]:
    """For each of ``digests``, the commits among the last ``depth`` of ``repo``'s HEAD whose code it is."""
    revs = subprocess.run(["git", "-C", repo, "rev-list", f"--max-count={depth}", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.split()
    found: dict[str, list[str]] = {d: [] for d in digests}
    for rev in revs:
        digest = revision_digest(rev, repo)
        if digest in found:
            found[digest].append(rev[:12])
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m anymla.bench.provenance", description=__doc__.split("\n")[0])
    parser.add_argument("digests", nargs="*", help="source digests (12 hex digits) from bench tables or CSVs")
    parser.add_argument("--rev", action="append", default=[], help="print this revision's digest instead")
    parser.add_argument("--repo", default=".", help="the git checkout (default: here)")
    parser.add_argument("--depth", type=int, default=200, help="how many commits back from HEAD to search")
    args = parser.parse_args(argv)
    if not args.digests and not args.rev:
        parser.error("give source digests, or --rev")
    for rev in args.rev:
        print(rev, revision_digest(rev, args.repo))
    status = 0
    found = commits_with(args.digests, args.repo, args.depth) if args.digests else {}
    for digest, revs in found.items():
        if revs:
            print(digest, " ".join(revs))
        else:
            print(digest, f"no commit of the last {args.depth}: uncommitted code, or older")
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
