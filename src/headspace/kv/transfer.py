"""Moving KV between the GPU arena, staging slots and host pages.

Every tier is seen as ``[heads, 2, slots, head_dim]`` (K then V per head; a page is
``page_size`` consecutive slots, one contiguous block per head and K/V). On a GPU the copies
are Triton kernels that read and write page-locked host memory in place through unified
addressing: one launch moves a whole head group's pages, whatever their order (measured on
an H200: 50.6 GB/s gathering 32-256 KiB pages, against 55.3 GB/s for one contiguous copy
through the copy engine and 34 GB/s for one copy-engine call per page). On the CPU the same
operations are torch indexing, and the kernels run there through Triton's interpreter in
the tests.
"""

from __future__ import annotations

import ctypes
import functools
import math
from itertools import chain

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU twin needs no Triton
    triton = None


# a 2-D list of ints goes through numpy: a step's per-entry lengths (256 sequences x 101
# entries) take 0.9 ms this way against 2.9-3.9 ms through torch.as_tensor on a CPU, host
# work each decode step repeats for its entries
_NUMPY_INTS = {torch.long: np.int64, torch.int32: np.int32}


def _int_table(values, dtype: torch.dtype) -> torch.Tensor:
    """``values`` (a host tensor or nested lists of ints) as a host tensor of ``dtype``."""
    rectangular = (
        dtype in _NUMPY_INTS
        and isinstance(values, list)
        and values
        and type(values[0]) is list
        and all(type(row) is list and len(row) == len(values[0]) for row in values)
    )
    if not rectangular:  # (ragged lists, 1-D lists and tensors: torch's own conversion)
        return torch.as_tensor(values, dtype=dtype)
    shape = (len(values), len(values[0]))
    flat = np.fromiter(chain.from_iterable(values), dtype=_NUMPY_INTS[dtype],
                       count=shape[0] * shape[1])  # fmt: skip
    return torch.from_numpy(flat.reshape(shape))


def device_ints(values, device: torch.device | str,
                dtype: torch.dtype = torch.long) -> torch.Tensor:  # fmt: skip
    """A small int table (nested lists or a host tensor, any shape) as ``dtype`` on
    ``device``, without waiting for the device: a blocking copy drains the stream, so the
    host could not prepare the next step (or a layer's next chunk) while the GPU runs this
    one. On a GPU the values go through a fresh page-locked buffer (never the caller's),
    which the caching host allocator keeps until the copy has run."""
    table = _int_table(values, dtype)
    if torch.device(device).type == "cuda":
        table = torch.empty(table.shape, dtype=dtype, pin_memory=True).copy_(table)
    return table.to(device, non_blocking=True)


def as_heads(tier_view: torch.Tensor, kv_first: bool) -> torch.Tensor:
    """``[heads, 2, slots, dim]`` view of a tier: ``kv_first`` for ``[2, heads, slots, dim]``
    (GPU pages, staging), else the host layout already is head-major."""
    return tier_view.transpose(0, 1) if kv_first else tier_view


def _use_kernel(*tensors: torch.Tensor) -> bool:
    return any(t.is_cuda for t in tensors)


def copy_pages(src: torch.Tensor, dst: torch.Tensor, src_pages: torch.Tensor,
               dst_pages: torch.Tensor, src_heads: torch.Tensor, dst_heads: torch.Tensor,
               page_size: int, *, kernel: bool | None = None,
               count: torch.Tensor | None = None, paired: bool = False,
               programs: int | None = None) -> None:  # fmt: skip
    """``dst[dst_heads[j], :, page dst_pages[i]] = src[src_heads[j], :, page src_pages[i]]``
    for every page pair ``i`` and head ``j``; ``paired``: one head per page pair instead
    (``j = i``: each (head, page) of a ragged set, as per-head budgets keep them).

    ``src``, ``dst``: ``[heads, 2, slots, dim]`` views whose slots are contiguous rows;
    page and head index tensors live where the work runs (the GPU when either side is).
    ``count`` (a one-element device tensor): copy only the first ``count`` page pairs, so
    one launch serves every step of a CUDA graph (read on the host off the GPU).
    ``programs``: the kernel's grid (default :func:`gather_programs`).
    """
    if kernel if kernel is not None else _use_kernel(src, dst):
        return _copy_pages_kernel(src, dst, src_pages, dst_pages, src_heads, dst_heads,
                                  page_size, count, paired, programs)  # fmt: skip
    if count is not None:  # the CPU twin of a graph's step
        src_pages, dst_pages = src_pages[: int(count)], dst_pages[: int(count)]
        if paired:  # a head per page pair
            src_heads, dst_heads = src_heads[: int(count)], dst_heads[: int(count)]
    src_p, dst_p = src.unflatten(2, (-1, page_size)), dst.unflatten(2, (-1, page_size))
    src_h, dst_h = src_heads.long(), dst_heads.long()
    src_i, dst_i = src_pages.long(), dst_pages.long()
    if not paired:  # every head with every page
        src_h, dst_h, src_i, dst_i = src_h[:, None], dst_h[:, None], src_i[None], dst_i[None]
    dst_p[dst_h, :, dst_i] = src_p[src_h, :, src_i]


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[i] = src[i]`` for every row ``i`` of two ``[rows, ...]`` views of one shape and
    dtype whose rows are each one contiguous block (the stride between rows free): a run of
    a head group's pages, between host pages and a staging slot. Where the GPU is one side,
    one 2-D copy through the copy engine on the current stream (asynchronous where the
    host side is page-locked) in place of one copy a row; else, or without CUDA's runtime
    at hand, one copy a row."""
    assert dst.shape == src.shape and dst.dtype == src.dtype, (dst.shape, src.shape)
    rows, row_elements = dst.shape[0], math.prod(dst.shape[1:])
    if rows == 0 or row_elements == 0:
        return
    memcpy_2d = _memcpy_2d() if (dst.is_cuda or src.is_cuda) else None
    if memcpy_2d is None or not (_rows_contiguous(dst) and _rows_contiguous(src)):
        for row in range(rows):
            dst[row].copy_(src[row], non_blocking=True)
        return
    size = dst.element_size()
    stream = torch.cuda.current_stream(dst.device if dst.is_cuda else src.device)
    status = memcpy_2d(dst.data_ptr(), dst.stride(0) * size, src.data_ptr(),
                       src.stride(0) * size, row_elements * size, rows,
                       _CUDA_MEMCPY_DEFAULT, stream.cuda_stream)  # fmt: skip
    if status != 0:
        raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {status}")


def _rows_contiguous(view: torch.Tensor) -> bool:
    """Whether each row (``view[i]``) is one contiguous block, read from the strides
    (no view made: the stream tier calls this twice a run)."""
    expected = 1
    for length, stride in zip(reversed(view.shape[1:]), reversed(view.stride()[1:]),
                              strict=True):  # fmt: skip
        if length != 1 and stride != expected:
            return False
        expected *= length
    return True


_CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction read from unified addresses


@functools.cache
def _memcpy_2d():
    """``cudaMemcpy2DAsync`` of the CUDA runtime torch has loaded (None when not found)."""
    if torch.version.cuda is None:
        return None
    major = torch.version.cuda.split(".")[0]
    for name in (f"libcudart.so.{major}", "libcudart.so"):
        try:
            function = ctypes.CDLL(name).cudaMemcpy2DAsync
        except (OSError, AttributeError):
            continue
        size_t, pointer = ctypes.c_size_t, ctypes.c_void_p
        function.argtypes = [pointer, size_t, pointer, size_t, size_t, size_t, ctypes.c_int,
                             pointer]  # fmt: skip
        function.restype = ctypes.c_int
        return function
    return None


def write_tokens(dst: torch.Tensor, dst_heads: torch.Tensor, slots: torch.Tensor,
                 kv: torch.Tensor, *, kernel: bool | None = None,
                 paired: bool = False) -> None:  # fmt: skip
    """Store new tokens: ``dst[dst_heads[j], :, slots[t]] = kv[:, t, j]``; ``paired``: one
    head per token instead, ``dst[dst_heads[t], :, slots[t]] = kv[:, t, 0]``.

    ``dst``: ``[heads, 2, slots, dim]``; ``kv``: ``[2, tokens, len(dst_heads), dim]``
    (token-major, as the model makes them; ``[2, tokens, 1, dim]`` paired); ``slots``:
    ``[tokens]`` (any stride).
    """
    if kernel if kernel is not None else _use_kernel(dst, kv):
        return _write_tokens_kernel(dst, dst_heads, slots, kv, paired)
    if paired:
        dst[dst_heads.long(), :, slots.long()] = kv[:, :, 0].transpose(0, 1).to(dst.dtype)
        return
    index_h, index_t = dst_heads.long()[:, None], slots.long()[None, :]
    dst[index_h, :, index_t] = kv.permute(2, 1, 0, 3).to(dst.dtype)


if triton is not None:

    @triton.jit(do_not_specialize=["num_pages", "num_heads"])
    def _pages_kernel(
        SRC, DST, SRC_PAGES, DST_PAGES, SRC_HEADS, DST_HEADS, COUNT, num_pages, num_heads,
        src_stride_h, src_stride_c, dst_stride_h, dst_stride_c,
        PAGE_ELEMS: tl.constexpr, BLOCK: tl.constexpr, HAS_COUNT: tl.constexpr,
        PAIRED: tl.constexpr,
    ):  # fmt: skip
        # a fixed grid walks the (page pair, head, K/V) items: the pages' reads wait on the
        # PCIe link, and a grid of one program per item would hold every SM while they wait
        items = num_pages * num_heads * 2
        if HAS_COUNT:  # the first ``COUNT`` page pairs
            items = tl.load(COUNT).to(tl.int32) * num_heads * 2
        item = tl.program_id(0)
        while item < items:  # (a while loop: the interpreter ranges over no tensor bounds)
            c, i, j = item % 2, item // (2 * num_heads), (item // 2) % num_heads
            if PAIRED:  # one head per page pair
                j = i
            src_page = tl.load(SRC_PAGES + i).to(tl.int64)
            dst_page = tl.load(DST_PAGES + i).to(tl.int64)
            src_head = tl.load(SRC_HEADS + j).to(tl.int64)
            dst_head = tl.load(DST_HEADS + j).to(tl.int64)
            src = SRC + src_head * src_stride_h + c * src_stride_c + src_page * PAGE_ELEMS
            dst = DST + dst_head * dst_stride_h + c * dst_stride_c + dst_page * PAGE_ELEMS
            for start in tl.static_range(0, PAGE_ELEMS, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                tl.store(dst + offs, tl.load(src + offs))
            item += tl.num_programs(0)

    @triton.jit
    def _tokens_kernel(
        DST, DST_HEADS, SLOTS, KV, num_tokens, slots_stride,
        dst_stride_h, dst_stride_c, kv_stride_c, kv_stride_t, kv_stride_h,
        DIM: tl.constexpr, BLOCK_T: tl.constexpr, PAIRED: tl.constexpr,
    ):  # fmt: skip
        block, j, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_t = block * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_d = tl.arange(0, DIM)
        ok = offs_t < num_tokens
        slot = tl.load(SLOTS + offs_t * slots_stride, mask=ok, other=0).to(tl.int64)
        if PAIRED:  # one head per token
            head = tl.load(DST_HEADS + offs_t, mask=ok, other=0).to(tl.int64)[:, None]
        else:
            head = tl.load(DST_HEADS + j).to(tl.int64)
        src = KV + c * kv_stride_c + offs_t[:, None].to(tl.int64) * kv_stride_t + j * kv_stride_h
        x = tl.load(src + offs_d[None, :], mask=ok[:, None])
        dst = DST + head * dst_stride_h + c * dst_stride_c + slot[:, None] * DIM
        tl.store(dst + offs_d[None, :], x.to(DST.dtype.element_ty), mask=ok[:, None])


def _check_rows(view: torch.Tensor) -> None:
    dim = view.shape[-1]
    assert view.stride(-1) == 1 and view.stride(-2) == dim, "slots must be contiguous rows"


def gather_programs(device: torch.device) -> int:
    """Programs of a page-gather launch: half the GPU's SMs (the interpreter on the CPU: 3,
    so that the tests walk several items per program).

    Measured on an H200 (streamed decode steps at 48K and 64K, ms a step): one program per
    item 23.0-23.8 and 67.2-69.5; 132 programs 19.6 and 66.5-68.3; 264: 23.5 and 68.8; 66:
    17.2-17.6 and 60.0-62.0; 33: 17.4 and 63.1; 16: 18.4 and 61.6. The gather's programs
    wait on the PCIe link and, issued from a high-priority stream, held the SMs the compute
    stream's kernels needed (at 48K: its token writes 4.5 ms a step and its small copies
    8.3 ms, the compute stream busy 21.2 ms of a 22.8 ms step).
    """
    if device.type != "cuda":
        return 3
    return max(1, sm_count(device) // 2)


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of the GPU ``device``."""
    return _sm_count(_index(device))


def _index(device: torch.device) -> int:
    """The CUDA device ``device`` names (the current one where it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _copy_pages_kernel(src, dst, src_pages, dst_pages, src_heads, dst_heads, page_size,
                       count=None, paired=False, programs=None):  # fmt: skip
    _check_rows(src)
    _check_rows(dst)
    num_pages, num_heads = src_pages.numel(), 1 if paired else src_heads.numel()
    if num_pages == 0 or num_heads == 0:
        return
    page_elems = page_size * src.shape[-1]
    block = min(4096, page_elems & -page_elems)  # a power of two dividing the page
    programs = programs or gather_programs(src_pages.device)
    _pages_kernel[(min(programs, num_pages * num_heads * 2),)](
        src, dst, src_pages, dst_pages, src_heads, dst_heads,
        count if count is not None else src_pages, num_pages, num_heads,
        src.stride(0), src.stride(1), dst.stride(0), dst.stride(1),
        PAGE_ELEMS=page_elems, BLOCK=block, HAS_COUNT=count is not None, PAIRED=paired,
        num_warps=8,
    )  # fmt: skip


def _write_tokens_kernel(dst, dst_heads, slots, kv, paired=False):
    _check_rows(dst)
    assert kv.stride(-1) == 1
    num_tokens, num_heads = kv.shape[1], kv.shape[2]
    assert not paired or num_heads == 1, "paired: kv holds one head per token"
    assert kv.shape[-1] & (kv.shape[-1] - 1) == 0, "head_dim must be a power of two"
    if num_tokens == 0 or num_heads == 0:
        return
    block_t = 16
    _tokens_kernel[(triton.cdiv(num_tokens, block_t), num_heads, 2)](
        dst, dst_heads, slots, kv, num_tokens, slots.stride(0),
        dst.stride(0), dst.stride(1), kv.stride(0), kv.stride(1), kv.stride(2),
        DIM=kv.shape[-1], BLOCK_T=block_t, PAIRED=paired, num_warps=4,
    )  # fmt: skip


def swap_pages(arena_layers: list[torch.Tensor], host_layer,
               host_places: list[tuple[int, int]], pairs: list[tuple[int, int]],
               to_host: bool, page_size: int) -> None:  # fmt: skip
    """Copy the entries of page ``pairs`` (GPU page, host page), to the host or back, for
    every arena layer ``i`` (``arena_layers[i] [2, heads, slots, dim]``): its heads sit in
    host layer ``host_places[i][0]`` (``host_layer(l)``) from head ``host_places[i][1]`` on
    (a rank's copies follow its own heads)."""
    if not pairs:
        return
    device = arena_layers[0].device
    src_pages, dst_pages = device_ints(list(zip(*pairs, strict=True)), device)
    for store_kv, (layer, first) in zip(arena_layers, host_places, strict=True):
        heads = torch.arange(store_kv.shape[1], device=device)
        gpu = as_heads(store_kv, kv_first=True), heads
        host = host_layer(layer), heads + first
        (src, src_heads), (dst, dst_heads) = (gpu, host) if to_host else (host, gpu)
        copy_pages(src, dst, src_pages, dst_pages, src_heads, dst_heads, page_size)


def shared_stream(device: torch.device, priority: int = 0) -> torch.cuda.Stream:
    """The one side stream of ``priority`` on the GPU ``device`` that copies (and captures)
    run on, made at first use. torch hands out a new stream from a pool of 32 a priority,
    in turn, at each ``torch.cuda.Stream()``: one made per layout would, within 32 layouts,
    be the very CUDA stream another thread or lane works on, its work then queued behind
    theirs (or recorded by their capture)."""
    return _shared_stream(_index(device), priority)


@functools.cache
def _shared_stream(index: int, priority: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(torch.device("cuda", index), priority=priority)
