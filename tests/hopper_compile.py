"""The Triton kernels compiled for a Hopper GPU (sm_90) with Triton's own compiler and
ptxas, no device needed. Run as a script in a process without ``TRITON_INTERPRET`` (the
interpreter's kernels cannot be compiled); prints one JSON line: each case's checks and the
decode kernel's resources (registers, stack, shared memory, blocks an SM holds)."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from headspace.attention import merge_kernel, triton_decode, triton_piece
from headspace.kv import transfer

HOPPER = GPUTarget("cuda", 90, 32)
HOPPER_REGISTERS, HOPPER_SHARED, BLOCK_RESERVED = 65536, 233472, 1024  # an SM's, bytes
CUOBJDUMP = Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"
# (dtype, group, block_n, append, at_index, share_period): the decode kernel's variants
DECODE_CASES = [("bf16", 4, 128, True, False, 0), ("bf16", 1, 64, True, True, 0),
                ("fp16", 3, 32, False, False, 3), ("fp32", 4, 64, True, False, 0)]  # fmt: skip
# the decode launch's integer arguments that are multiples of 16 (contiguous rows of 128
# dims), which Triton marks so where they are specialised, as its pointers
DECODE_ALIGNED = ("stride_qb", "stride_qh", "stride_kh", "stride_kt", "stride_vh", "stride_vt",
                  "stride_nb", "stride_nh", "stride_ob", "stride_oh", "stride_os")  # fmt: skip


def compile_for_hopper(kernel, pointers: dict[str, str], constants: dict, floats=(),
                       aligned=(), **options):  # fmt: skip
    """``kernel`` compiled for sm_90: ``pointers`` name -> element type ("bf16", "i32", ...),
    ``constants`` its constexpr values, ``floats`` its float scalars, the rest int32; the
    pointers, and the integers in ``aligned`` that the kernel specialises, marked multiples
    of 16 as a launch marks them."""
    params = list(inspect.signature(kernel.fn).parameters)
    loose = unspecialised(kernel)
    signature, attrs = {}, {}
    for index, name in enumerate(params):
        if name in constants:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = "*" + pointers[name]
        else:
            signature[name] = "fp32" if name in floats else "i32"
        if name in pointers or (name in aligned and name not in loose):
            attrs[(index,)] = [["tt.divisibility", 16]]
    fixed = {(params.index(name),): value for name, value in constants.items()}
    source = ASTSource(fn=kernel, signature=signature, constexprs=fixed, attrs=attrs)
    return triton.compile(source, target=HOPPER, options=options)


def unspecialised(kernel) -> list[str]:
    """The names of ``kernel``'s arguments that Triton does not specialise on."""
    return sorted(p.name for p in kernel.params if p.do_not_specialize)


def resources(compiled, num_warps: int) -> dict:
    """Registers and stack a thread, shared memory a block, and the blocks an SM holds."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(compiled.asm["cubin"])
        file.flush()
        usage = subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", file.name],
                               capture_output=True, text=True, check=True).stdout  # fmt: skip
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    shared = compiled.metadata.shared
    warp_registers = -(-registers // 8) * 8 * 32  # (a warp's, allocated 256 at a time)
    by_registers = HOPPER_REGISTERS // warp_registers // num_warps
    by_shared = HOPPER_SHARED // (shared + BLOCK_RESERVED)
    return {
        "registers": registers,
        "stack": int(re.search(r"STACK:(\d+)", usage).group(1)),
        "shared": shared,
        "blocks_per_sm": min(by_registers, by_shared, 64 // num_warps),
    }


def decode_kernels(dtype, group, block_n, append, at_index, share_period) -> dict:
    """The partial kernel of one variant and the merge kernel's two blocks."""
    pointers = dict.fromkeys(("Q", "K", "V", "NEW_K", "NEW_V"), dtype)
    pointers |= dict.fromkeys(("TABLE", "LENGTHS", "NEW_INDEX"), "i32")
    pointers |= {"KEY_SHARES": "fp64" if share_period else "fp32", "OUT": "fp32", "LSE": "fp32"}
    constants = dict(GROUP=group, GROUP_PAD=16, DIM=128, PAGE_SIZE=128, BLOCK_N=block_n,
                     APPEND=append, AT_INDEX=at_index, WHILE_LOOP=False,
                     PRECISION="ieee" if dtype == "fp32" else "tf32",
                     SHARE_PERIOD=share_period)  # fmt: skip
    partial = compile_for_hopper(triton_decode._partial_kernel, pointers, constants,
                                 floats=("scale_log2",), aligned=DECODE_ALIGNED, num_warps=4,
                                 num_stages=3)  # fmt: skip
    merges = [compile_for_hopper(
        triton_decode._merge_kernel, dict(PART_OUT="fp32", PART_LSE="fp32", OUT=dtype, LSE="fp32"),
        dict(NUM_HEADS=32, SPLIT_BLOCK=triton_decode.merge_block(splits), DIM=128),
    ) for splits in (32, 300)]  # fmt: skip
    ptx = partial.asm["ptx"]
    return {"checks": {"partial_stores": "st.global" in ptx,
                       "tensor_cores_but_fp32": bool(re.search(r"\b(wg)?mma\.", ptx))
                       == (dtype != "fp32"),  # (ieee: FMAs)
                       "merges_store": all("st.global" in m.asm["ptx"] for m in merges)},
            "partial": resources(partial, num_warps=4)}  # fmt: skip


def copy_kernels(has_count: bool, paired: bool) -> dict:
    """The page gather and the token writer."""
    indices = dict.fromkeys(("SRC_PAGES", "DST_PAGES", "SRC_HEADS", "DST_HEADS", "COUNT"), "i64")
    pages = compile_for_hopper(transfer._pages_kernel, dict(SRC="bf16", DST="bf16") | indices,
                               dict(PAGE_ELEMS=128 * 128, BLOCK=4096, HAS_COUNT=has_count,
                                    PAIRED=paired), num_warps=8)  # fmt: skip
    tokens = compile_for_hopper(transfer._tokens_kernel,
                                dict(DST="bf16", DST_HEADS="i64", SLOTS="i64", KV="bf16"),
                                dict(DIM=128, BLOCK_T=16, PAIRED=paired), num_warps=4)  # fmt: skip
    return {"checks": {"pages_store": "st.global" in pages.asm["ptx"],
                       "tokens_store": "st.global" in tokens.asm["ptx"]}}  # fmt: skip


def merge_pair_kernel(parts: str, out: str) -> dict:
    """The merge of two partial states (parts of dtype ``parts`` into an ``out``)."""
    pointers = dict(A_OUT=parts, B_OUT=parts, OUT=out, A_LSE="fp32", B_LSE="fp32", LSE="fp32")
    compiled = compile_for_hopper(merge_kernel._merge_pair_kernel, pointers,
                                  dict(DIM=128, BLOCK_D=128, BLOCK_R=merge_kernel.BLOCK_ROWS),
                                  num_warps=4)  # fmt: skip
    ptx = compiled.asm["ptx"]
    return {"checks": {"stores": "st.global" in ptx, "exponents": "ex2.approx" in ptx},
            "kernel": resources(compiled, num_warps=4)}  # fmt: skip


def piece_kernel(dtype: str) -> dict:
    """The prompt piece's paged kernel as a mixed step's graph launches it for Llama (groups
    of 4, dims of 128, pages of 128; its table a view of the graph's int64 inputs)."""
    pointers = dict(Q=dtype, K=dtype, V=dtype, OUT=dtype, LSE="fp32", TABLE="i64", START="i64",
                    ROWS="i64")  # fmt: skip
    constants = dict(GROUP=4, GROUP_PAD=4, DIM=128, PAGE_SIZE=128, BLOCK_Q=triton_piece.BLOCK_Q,
                     BLOCK_N=triton_piece.BLOCK_N, WHILE_LOOP=False, PRECISION="tf32")  # fmt: skip
    compiled = compile_for_hopper(triton_piece._piece_kernel, pointers, constants,
                                  floats=("scale_log2",), num_warps=8, num_stages=2)  # fmt: skip
    ptx = compiled.asm["ptx"]
    return {"checks": {"stores": "st.global" in ptx, "tensor_cores": "mma." in ptx},
            "kernel": resources(compiled, num_warps=8)}  # fmt: skip


if __name__ == "__main__":
    results = {f"decode {case}": decode_kernels(*case) for case in DECODE_CASES}
    results |= {f"copies {case}": copy_kernels(*case) for case in [(False, False), (True, True)]}
    results |= {f"merge pair {case}": merge_pair_kernel(*case)
                for case in [("bf16", "bf16"), ("fp32", "fp32")]}  # fmt: skip
    results["piece bf16"] = piece_kernel("bf16")
    results["unspecialised"] = {"partial": unspecialised(triton_decode._partial_kernel),
                                "merge": unspecialised(triton_decode._merge_kernel),
                                "merge_pair": unspecialised(merge_kernel._merge_pair_kernel),
                                "merge_pair_alignment": sorted(
                                    p.name for p in merge_kernel._merge_pair_kernel.params
                                    if p.do_not_specialize_on_alignment),
                                "pages": unspecialised(transfer._pages_kernel)}  # fmt: skip
    print(json.dumps(results))
