"""Attention executors, one per tier of the head map. For each layer, an executor attends the
query heads of its (layer, kv head) entries and returns ``(out, lse)``.

The runner calls ``submit`` on every executor of a layer, then ``collect``: GPU work is queued
at submit, so a tier whose work runs elsewhere (CPU threads, next) overlaps the others. Each
executor owns contiguous kv-head ranges of a layer (the planner keeps resident heads first
and streamed groups after them), so its query heads are views, never gathered copies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from headspace.attention import attend, merge_attention
from headspace.attention.cpu_decode import cpu_paged_decode
from headspace.attention.entry_decode import new_token_slots
from headspace.attention.paged import flex_paged_attention, gather_pages, prefix_block_mask
from headspace.kv.paged_store import PagedKVStore

HeadRange = tuple[int, int]  # kv heads lo..hi-1 of a layer
MIN_WIDTH = 8  # pages per block-table row, at least


def block_table(rows: list[list[int]], width: int = 1) -> torch.Tensor:
    """``[rows, max(width, longest row)]`` int32 block table of page lists (padded with
    page 0, which a row's length never reaches)."""
    width = max(width, max(map(len, rows), default=1))
    table = torch.zeros(len(rows), width, dtype=torch.int32)
    for row, pages in enumerate(rows):
        table[row, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    return table


def bucket(n: int, floor: int = 1) -> int:
    """The power of two at or above ``max(n, floor)``: block tables are padded to it, so
    the decode kernel compiles once per bucket, not once per length."""
    return 1 << (max(n, floor) - 1).bit_length()


@dataclass
class StepInputs:
    """One forward pass, as the executors see it.

    Prefill (one sequence): ``positions [tokens]``, ``start`` its first position, ``pages``
    the sequence's pages per tier. Decode (one token per sequence): ``positions`` per
    sequence, ``tables`` per tier ``[seqs, width]`` int32 and ``lengths [seqs]`` (positions
    + 1) on the device, ``pages`` per tier and sequence.
    """

    decode: bool
    positions: torch.Tensor
    positions_list: list[int]
    pages: dict[str, list[list[int]]]
    tables: dict[str, torch.Tensor] = field(default_factory=dict)
    lengths: torch.Tensor | None = None
    start: int = 0
    seq_ids: list[int] = field(default_factory=list)


def q_heads(kv_range: HeadRange, q_per_kv: int) -> slice:
    return slice(kv_range[0] * q_per_kv, kv_range[1] * q_per_kv)


def attend_tiers(executors: list, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Every tier's heads of ``layer``: ``q [T, H, D]``, ``kv [2, T, Hkv, D]`` -> ``[T, H, D]``
    (all executors submit, then all collect)."""
    out = torch.empty_like(q)
    for executor in executors:
        executor.submit(layer, q, kv, out)
    for executor in executors:
        executor.collect(layer)
    return out


class ResidentExecutor:
    """Entries resident in the GPU pool's pages: FlexAttention over pages at prefill, the
    Triton split-K paged kernel (which also appends the new K/V) at decode. On the CPU,
    prefill gathers pages for the reference backends and decode runs the CPU kernel over the
    pages in place."""

    def __init__(self, store: PagedKVStore, ranges: list[HeadRange | None], q_per_kv: int,
                 backend: str):  # fmt: skip
        self.store, self.ranges, self.q_per_kv, self.backend = store, ranges, q_per_kv, backend
        self.on_gpu = store.buffer.is_cuda
        self.page_size = store.page_size
        self._results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def begin(self, step: StepInputs) -> None:
        self.step = step
        device = self.store.buffer.device
        if not step.decode:
            self.pages = torch.tensor(step.pages["gpu"][0], device=device)
            self.slots = self.store.slots(self.pages, step.positions)
        elif not self.on_gpu and "gpu" in step.tables:  # the CPU kernel's inputs, per step
            self.ends = step.lengths.to(torch.int32)
            self.slots = new_token_slots(step.tables["gpu"], self.ends - 1, self.page_size)

    def submit(self, layer: int, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor) -> None:
        """``q [tokens, heads, dim]``, ``kv [2, tokens, kv_heads, dim]`` of the whole layer;
        the result goes into this tier's heads of ``out``."""
        kv_range = self.ranges[layer]
        if kv_range is None:
            return
        heads = q_heads(kv_range, self.q_per_kv)
        q_part, kv_part, out_part = q[:, heads], kv[:, :, slice(*kv_range)], out[:, heads]
        if self.step.decode:
            result = self._decode(layer, q_part, kv_part, out_part)
        else:
            result = self._prefill(layer, q_part, kv_part)
            out_part.copy_(result[0])
        self._results[layer] = result

    def collect(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._results.pop(layer, None)

    def _prefill(self, layer: int, q, kv):
        self.store.write(layer, self.slots, kv)
        q_heads_first = q.transpose(0, 1)
        k, v = kv[0].transpose(0, 1), kv[1].transpose(0, 1)
        out, lse = attend(q_heads_first, k, v, causal=True, backend=self.backend)
        if self.step.start > 0:
            prefix = self._prefix(layer, q_heads_first, self.step.start)
            out, lse = merge_attention([out, prefix[0]], [lse, prefix[1]])
        return out.transpose(0, 1), lse

    def _prefix(self, layer: int, q: torch.Tensor, prefix: int):
        """Attention of chunk queries ``q [heads, tokens, dim]`` to the pool's first
        ``prefix`` tokens of the sequence."""
        store_kv, page_size = self.store.kv[layer], self.store.page_size
        if not self.on_gpu:  # the CPU twin: gather the pages, dense attention
            k, v = gather_pages(store_kv, self.pages, prefix, page_size)
            return attend(q, k, v, backend=self.backend)
        num_q = q.shape[1]
        padded = max(128, 1 << (num_q - 1).bit_length())  # few compiled query shapes
        num_slots = store_kv.shape[2]
        mask = prefix_block_mask(self.pages, prefix, padded, num_slots, page_size)
        q4 = torch.nn.functional.pad(q, (0, 0, 0, padded - num_q))[None]
        out, lse = flex_paged_attention(q4, store_kv[0], store_kv[1], mask)
        return out[0, :, :num_q], lse[0, :, :num_q]

    def _decode(self, layer: int, q, kv, out):
        store_kv, step = self.store.kv[layer], self.step
        if self.on_gpu:  # the kernel appends the new K/V itself
            from headspace.attention.triton_decode import paged_decode_attention

            _, lse = paged_decode_attention(q, store_kv[0], store_kv[1], step.tables["gpu"],
                                            step.lengths, self.store.page_size, new_kv=kv,
                                            out=out)  # fmt: skip
            return out, lse.transpose(0, 1)
        store_kv[:, :, self.slots] = kv.transpose(1, 2)  # [2, heads, seqs, dim]
        result, lse = cpu_paged_decode(q, store_kv[0], store_kv[1], step.tables["gpu"], self.ends,
                                       self.page_size)  # fmt: skip
        out.copy_(result)
        return out, lse.transpose(0, 1)
