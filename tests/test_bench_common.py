"""bench/common.py's record of which code ran: the digest of the imported package's sources."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import headspace

BENCH = Path(__file__).parents[1] / "bench"
# run in a fresh interpreter: bench/ from argv, headspace from PYTHONPATH
VERSION = ("import sys, json; sys.path.insert(0, sys.argv[1]); import common; "
           "print(json.dumps(common.code_version()))")  # fmt: skip


def _version(pythonpath: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    run = subprocess.run([sys.executable, "-c", VERSION, str(BENCH)], env=env, text=True,
                         capture_output=True, check=True)  # fmt: skip
    return json.loads(run.stdout)


def _digest(pythonpath: Path) -> str:
    return _version(pythonpath)["src_sha256"]


def test_the_digest_names_the_imported_sources_wherever_they_lie(tmp_path):
    """A copy of the package on PYTHONPATH gives the checkout's digest; the same copy with
    one source changed gives another (the script's own tree no longer decides)."""
    package = Path(headspace.__file__).resolve().parent
    shutil.copytree(package, tmp_path / "headspace", ignore=shutil.ignore_patterns("__pycache__"))
    here = _digest(package.parent)
    assert _digest(tmp_path) == here
    with open(tmp_path / "headspace" / "errors.py", "a") as source:
        source.write("\n# changed\n")
    assert _digest(tmp_path) != here


def test_the_commit_is_marked_where_the_sources_differ_from_it(tmp_path):
    """A checkout whose sources are the commit's gives the commit; one whose sources differ
    (edited, or a copy laid over an older HEAD) says so, so that only the digest names it."""
    package = Path(headspace.__file__).resolve().parent
    shutil.copytree(package, tmp_path / "headspace", ignore=shutil.ignore_patterns("__pycache__"))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    for command in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "c"]):
        subprocess.run([*git, *command], check=True, capture_output=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], text=True,
                          capture_output=True, check=True).stdout.strip()  # fmt: skip
    assert _version(tmp_path)["commit"] == head
    with open(tmp_path / "headspace" / "errors.py", "a") as source:
        source.write("\n# changed\n")
    assert _version(tmp_path)["commit"] == head + "+changes"
