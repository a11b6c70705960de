"""The Triton kernels compile for a Hopper GPU (sm_90) on a machine without one. CPU tests
run the kernels under Triton's interpreter, which never compiles them: a kernel that the
interpreter runs but the compiler refuses would stop every GPU decode, and one that needs
more registers holds fewer blocks on an SM, reading its keys at a fraction of the rate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
from headspace.attention import merge_kernel  # noqa: E402

# blocks an H100 SM holds of each 16-bit decode variant, as the slice length's compile-time
# version held them (bf16 groups of 4 over blocks of 128 keys: the engine's Llama launch;
# groups of 1 over blocks of 64: ring rows). A run-time slice length first cost the first
# 65 more registers a thread, and a block an SM.
BLOCKS_PER_SM = {"('bf16', 4, 128": 3, "('bf16', 1, 64": 4}
# the arguments a new block-table width changes: never specialised, so nothing compiles
UNSPECIALISED = {
    "partial": ["stride_lb", "stride_lh", "stride_ob", "stride_oh", "stride_tb",
                "tokens_per_split"],
    "merge": ["num_splits", "stride_lh"],
    "merge_pair": sorted(merge_kernel.RUN_TIME),
    "merge_pair_alignment": sorted(merge_kernel.LSE_POINTERS),
    "pages": ["num_heads", "num_pages"],
}  # fmt: skip


@pytest.fixture(scope="module")
def hopper_builds() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("hopper_compile.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_decode_and_copy_kernels_compile_for_hopper(hopper_builds):
    cases = {k: v for k, v in hopper_builds.items() if k != "unspecialised"}
    assert len(cases) == 9
    for case, built in cases.items():
        assert all(built["checks"].values()), (case, built)


def test_the_16_bit_decode_kernels_keep_their_registers_and_blocks(hopper_builds):
    for case, built in hopper_builds.items():
        if not case.startswith("decode") or "fp32" in case:
            continue
        assert built["partial"]["stack"] == 0, (case, built)  # nothing spilled
        for variant, blocks in BLOCKS_PER_SM.items():
            if variant in case:
                assert built["partial"]["blocks_per_sm"] >= blocks, (case, built)


def test_the_merge_of_two_states_fills_an_sm(hopper_builds):
    """A prompt piece's merge is memory-bound: its blocks must fill an SM's 64 warps (16
    rows a program took 144 registers a thread, 3 blocks of 4 warps), spilling nothing."""
    for case, built in hopper_builds.items():
        if case.startswith("merge pair"):
            assert built["kernel"]["stack"] == 0 and built["kernel"]["blocks_per_sm"] == 16, built


def test_the_piece_kernel_spills_nothing(hopper_builds):
    """The prompt piece's paged kernel (a mixed step's graph runs it in every layer): a tile
    of 16 tokens x 4 heads over 64 keys a step, 8 warps, spilling nothing (4 warps spilled
    536 bytes a thread)."""
    built = hopper_builds["piece bf16"]
    assert built["kernel"]["stack"] == 0 and built["kernel"]["blocks_per_sm"] >= 1, built


def test_what_a_new_width_changes_is_never_specialised(hopper_builds):
    assert hopper_builds["unspecialised"] == UNSPECIALISED
