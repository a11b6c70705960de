"""The Triton kernels compile for a Hopper GPU (sm_90) on a machine without one. CPU tests
run the kernels under Triton's interpreter, which never compiles them: a kernel that the
interpreter runs but the compiler refuses would stop every GPU decode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_the_decode_and_copy_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("hopper_compile.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == 6
    for case, checks in results.items():
        assert all(checks.values()), (case, checks)
