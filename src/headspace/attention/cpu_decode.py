"""Decode attention by CPU threads over K/V pages in place: the compiled kernel
(``cpu_kernel.cpp``, a C ABI called through ctypes), its background jobs (``cpu_jobs.cpp``:
a native thread that starts a job when its query lands) and its reference twin.

The kernel is built once per source version with the system C++ compiler into the cache
directory (``make`` set-up builds it up front; otherwise the first call does). The hot loop
is compiled for AVX-512, AVX2 and the baseline x86-64 and chosen when the library loads;
other machines get the portable build. Without a compiler the reference twin runs.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from headspace.model.source import cache_root

SOURCES = [Path(__file__).with_name(name) for name in ("cpu_kernel.cpp", "cpu_jobs.cpp")]
FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-pthread"]
BLOCK_TOKENS = 256  # tokens per task: K and V of a block stay in the core's L2
# query heads per kv head one call takes at BLOCK_TOKENS (the kernel's kMaxGroup, and its
# kMaxScores over the block)
MAX_KERNEL_GROUP = min(64, 16384 // BLOCK_TOKENS)
ISA_NAMES = {0: "portable", 1: "x86-64", 2: "AVX2", 3: "AVX-512"}
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def library_path() -> Path:
    """Where the library of this source version lives (built or not)."""
    text = b"".join(source.read_bytes() for source in SOURCES) + " ".join(FLAGS).encode()
    digest = hashlib.sha256(text).hexdigest()[:16]
    return cache_root() / "native" / f"cpu_kernel-{digest}.so"


def build() -> Path:
    """Compile the kernel into the cache (atomically; a no-op when it is there)."""
    target = library_path()
    if target.exists():
        return target
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ or c++) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", str(built)], check=True,
                       capture_output=True, text=True)  # fmt: skip
        os.replace(built, target)
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        warnings.warn(f"CPU attention kernel unavailable, using the reference: {detail}",
                      stacklevel=3)  # fmt: skip
        return None
    pointer, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.hs_paged_decode.argtypes = [pointer, pointer, pointer, i32, i64, pointer, i64,
                                    pointer, pointer, i32, i32, i32, i32, i32, ctypes.c_float,
                                    i32, i32, i32, pointer, pointer, pointer, i64]  # fmt: skip
    lib.hs_paged_decode.restype = i32
    lib.hs_isa.restype = i32
    lib.hs_runner_new.restype = pointer
    lib.hs_runner_free.argtypes = [pointer]
    lib.hs_runner_submit.argtypes = [pointer, pointer, i64, pointer, pointer, pointer, i32, i64,
                                     pointer, i64, pointer, i32, i32, i32, i32, i32,
                                     ctypes.c_float, i32, i32, pointer, pointer]  # fmt: skip
    lib.hs_runner_submit.restype = i64
    lib.hs_runner_wait.argtypes = [pointer, i64, i32]
    lib.hs_runner_wait.restype = i32
    return lib


def kernel_isa() -> str | None:
    """The instruction set the kernel runs with here, or None without the kernel."""
    lib = _library()
    return None if lib is None else ISA_NAMES[lib.hs_isa()]


def _check(q, k, v, tables, ends, starts, page_size: int) -> None:
    if v.dtype != k.dtype:
        raise ValueError(f"K and V dtypes differ: {k.dtype}, {v.dtype}")
    if q.shape[1] % k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"query heads {tuple(q.shape)} do not group over kv {tuple(k.shape)}")
    for index in (ends, starts):
        if index is not None and index.numel() != q.shape[0]:
            raise ValueError("starts and ends need one value per sequence")
    if tables.shape[0] != q.shape[0]:
        raise ValueError("block tables need one row per sequence")
    if ends.numel() and int(ends.max()) > tables.shape[1] * page_size:
        raise ValueError("a sequence's tokens run past its block table")
    if k.stride() != v.stride() or k.stride(2) != 1 or k.stride(1) != k.shape[2]:
        raise ValueError("K and V need the same strides and contiguous [slots, dim] rows")
    if tables.dtype != torch.int32 or tables.stride(1) != 1:
        raise ValueError("block tables must be int32 with contiguous rows")
    for index in (ends, starts):
        if index is not None and (index.dtype != torch.int32 or not index.is_contiguous()):
            raise ValueError("starts and ends must be contiguous int32")
    if q.device.type != "cpu" or k.device.type != "cpu":
        raise ValueError("the CPU kernel reads CPU tensors")


def _check_probs(probs, q, ends, starts) -> None:
    counts = ends if starts is None else ends - starts
    width = int(counts.max()) if counts.numel() else 0
    dense = probs.dim() == 3 and probs.stride(2) == 1
    dense = dense and probs.stride(0) == q.shape[1] * probs.stride(1)
    if (probs.dtype != torch.float32 or probs.device.type != "cpu" or not dense
            or tuple(probs.shape[:2]) != tuple(q.shape[:2]) or probs.shape[2] < width):  # fmt: skip
        raise ValueError(f"probs must be fp32 [seqs, heads, >= {width}] with dense rows")


def cpu_paged_decode(
    q: torch.Tensor,  # [seqs, heads, dim]
    k: torch.Tensor,  # [kv_heads, slots, dim] (any head stride; rows contiguous)
    v: torch.Tensor,  # like k, same strides
    block_tables: torch.Tensor,  # [seqs, max_pages] int32
    ends: torch.Tensor,  # [seqs] int32: attend tokens start..end-1 of each sequence
    page_size: int,
    *,
    starts: torch.Tensor | None = None,  # [seqs] int32, default 0
    scale: float | None = None,
    num_threads: int | None = None,  # default: torch's intra-op threads
    block_tokens: int = BLOCK_TOKENS,
    portable: bool = False,
    probs: torch.Tensor | None = None,  # [seqs, heads, width] fp32, filled when given
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of one query token per sequence over its pages, read in place by
    CPU threads. Returns fp32 ``out [seqs, heads, dim]`` and natural-log ``lse [seqs,
    heads]``; a sequence with no token gives out 0 and lse -inf. Falls back to
    :func:`cpu_paged_decode_reference` where the kernel cannot be built and for float16.
    ``portable`` runs the compiler-vectorised loops instead of the AVX-512 ones (tests).

    With ``probs``, each query head's softmax weight of token ``start + j`` is written to
    ``probs[seq, head, j]`` (what the hybrid tier's sparse selection reads); the columns
    past a sequence's count are left as they were."""
    _check(q, k, v, block_tables, ends, starts, page_size)
    if probs is not None:
        _check_probs(probs, q, ends, starts)
    lib = _library() if k.dtype in _DTYPES else None  # float16 pages: the twin
    if lib is None:
        return cpu_paged_decode_reference(q, k, v, block_tables, ends, page_size,
                                          starts=starts, scale=scale, probs=probs)  # fmt: skip
    num_seqs, num_heads, dim = q.shape
    num_kv_heads = k.shape[0]
    scale = dim**-0.5 if scale is None else scale
    q32 = q.float().contiguous()
    out = torch.empty(num_seqs, num_heads, dim)
    lse = torch.empty(num_seqs, num_heads)
    status = lib.hs_paged_decode(
        q32.data_ptr(), k.data_ptr(), v.data_ptr(), _DTYPES[k.dtype], k.stride(0),
        block_tables.data_ptr(), block_tables.stride(0),
        None if starts is None else starts.data_ptr(), ends.data_ptr(), num_seqs,
        num_kv_heads, num_heads // num_kv_heads, dim, page_size, scale, block_tokens,
        num_threads or torch.get_num_threads(), int(not portable), out.data_ptr(), lse.data_ptr(),
        None if probs is None else probs.data_ptr(), 0 if probs is None else probs.stride(1),
    )  # fmt: skip
    if status != 0:
        raise ValueError(f"CPU kernel refused the shapes (dim {dim}, group "
                         f"{num_heads // num_kv_heads}, block {block_tokens})")  # fmt: skip
    return out, lse


def cpu_paged_decode_reference(
    q: torch.Tensor,  # [seqs, heads, dim]
    k: torch.Tensor,  # [kv_heads, slots, dim]
    v: torch.Tensor,
    block_tables: torch.Tensor,  # [seqs, max_pages]
    ends: torch.Tensor,  # [seqs]
    page_size: int,
    *,
    starts: torch.Tensor | None = None,
    scale: float | None = None,
    probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin: gather tokens ``start..end-1`` of each sequence, the fp32 reference
    (``probs`` filled as the kernel fills it)."""
    from headspace.attention.reference import reference_attention
    from headspace.kv.paged_store import token_slots

    outs, lses = [], []
    for row in range(q.shape[0]):
        start = 0 if starts is None else int(starts[row])
        positions = torch.arange(start, max(int(ends[row]), start))
        slots = token_slots(block_tables[row], positions, page_size)
        keys = k.index_select(1, slots)  # [kv_heads, tokens, dim]
        out, lse = reference_attention(q[row][:, None].float(), keys, v.index_select(1, slots),
                                       scale=scale)  # fmt: skip
        if probs is not None and len(positions):
            group = q.shape[1] // k.shape[0]
            scores = torch.einsum("hd,htd->ht", q[row].float(),
                                  keys.float().repeat_interleave(group, 0))  # fmt: skip
            scores *= q.shape[-1] ** -0.5 if scale is None else scale
            probs[row, :, : len(positions)] = torch.exp(scores - lse[:, 0, None])
        outs.append(out[:, 0])
        lses.append(lse[:, 0])
    return torch.stack(outs), torch.stack(lses)
