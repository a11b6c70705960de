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
from headspace.attention.paged import gather_pages
from headspace.attention.sparse_prefill import prefill_with_patterns
from headspace.kv.paged_store import PagedKVStore
from headspace.kv.spec import Pattern, padded_length
from headspace.kv.transfer import device_ints

HeadRange = tuple[int, int]  # kv heads lo..hi-1 of a layer
MIN_WIDTH = 8  # pages per block-table row, at least
PREFIX_PIECE = 32768  # prefix tokens gathered at a time, at least, for a chunk's attention
PREFIX_CHUNKS = 4  # ... or this many chunks' worth


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


class Tier:
    """What a step needs from a tier of the head map; one executor per tier of a layout.

    Every step: ``begin(step)`` with the step's inputs (a CUDA graph's step: ``begin_graph``
    with views of its device buffers), then per layer ``submit(layer, q, kv, out)`` (GPU work
    queued, other work started) and ``collect(layer)`` (the tier's ``(out, lse)``, its heads
    of ``out`` written). Around them, for tiers that keep per-sequence state on the device:
    ``before_decode(seq_ids, slots)`` brings it up to the sequences of a decode step, and
    ``after_prefill(seq_id, prompt_len)`` follows a prompt (budgets compress it). A CUDA
    graph packs what a tier's decode step reads: ``stages_history`` (host pages staged into
    a slot) and ``entry_rows`` (per-entry tables on the device, no block table).
    """

    stages_history = False
    entry_rows = False

    def begin(self, step: StepInputs) -> None:
        raise NotImplementedError

    def submit(self, layer: int, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor) -> None:
        raise NotImplementedError

    def collect(self, layer: int):
        raise NotImplementedError

    def before_decode(self, seq_ids: list[int], slots: list[int]) -> None:
        """Per-sequence device state for a decode step of ``seq_ids`` in token ``slots``."""

    def after_prefill(self, seq_id: int, prompt_len: int):
        """After the last chunk of a prompt of ``prompt_len`` tokens."""

    def begin_graph(self, step: StepInputs, views: dict[str, torch.Tensor], key: tuple) -> None:
        """A captured decode step over the graph's buffers (``views``, graph ``key``)."""
        self.begin(step)


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


def chunk_slots(store: PagedKVStore, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill chunk's sequence pages ``[pages]`` on the device and its tokens' slots
    ``[tokens]`` in them."""
    pages = device_ints(step.pages["gpu"][0], store.buffer.device)
    return pages, store.slots(pages, step.positions)


def padded_positions(num_keys: int, device) -> torch.Tensor:
    """Positions ``0 .. num_keys - 1`` padded to :func:`padded_length` by repeating the last
    one (a patterned prefill gathers its keys there; padding keys are never seen)."""
    return torch.arange(padded_length(num_keys), device=device).clamp(max=num_keys - 1)


class ResidentExecutor(Tier):
    """Entries resident in the GPU pool's pages: at prefill the fused causal kernel over the
    chunk and over the prefix gathered from the pages in pieces; at decode the Triton
    split-K paged kernel (which also appends the new K/V), or the CPU kernel over the pages
    in place. A layer with ``patterns`` (one per query head of its range, None where
    all are full) gathers its keys and attends each head by its pattern at prefill."""

    def __init__(self, store: PagedKVStore, ranges: list[HeadRange | None], q_per_kv: int,
                 backend: str, patterns: list[list[Pattern] | None] | None = None):  # fmt: skip
        self.store, self.ranges, self.q_per_kv, self.backend = store, ranges, q_per_kv, backend
        self.patterns = patterns or [None] * len(ranges)
        self.on_gpu = store.buffer.is_cuda
        self.page_size = store.page_size
        self._results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def begin(self, step: StepInputs) -> None:
        self.step = step
        device = self.store.buffer.device
        if not step.decode:
            self.pages, self.slots = chunk_slots(self.store, step)
            if any(self.patterns):
                self.num_keys = step.start + len(step.positions)
                positions = padded_positions(self.num_keys, device)
                self.key_slots = self.store.slots(self.pages, positions)
        elif not self.on_gpu and "gpu" in step.tables:  # the CPU kernel's inputs, per step
            self.ends = step.lengths.to(torch.int32)
            self.table = step.tables["gpu"].to(torch.int32).contiguous()  # (graphs': int64)
            self.slots = new_token_slots(self.table, self.ends - 1, self.page_size)

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
        patterns = self.patterns[layer]
        if patterns is not None:  # [2, kv_heads, capacity, dim]
            keys = self.store.kv[layer].index_select(2, self.key_slots)
            out, lse = prefill_with_patterns(q_heads_first, keys[0], keys[1], self.num_keys,
                                             patterns, backend=self.backend)  # fmt: skip
            return out.transpose(0, 1), lse
        k, v = kv[0].transpose(0, 1), kv[1].transpose(0, 1)
        out, lse = attend(q_heads_first, k, v, causal=True, backend=self.backend)
        if self.step.start > 0:
            prefix = self._prefix(layer, q_heads_first, self.step.start)
            out, lse = merge_attention([out, prefix[0]], [lse, prefix[1]])
        return out.transpose(0, 1), lse

    def _prefix(self, layer: int, q: torch.Tensor, prefix: int):
        """Attention of chunk queries ``q [heads, tokens, dim]`` to the pool's first
        ``prefix`` tokens of the sequence: the pages gathered in pieces of ``PREFIX_CHUNKS``
        chunks, at least ``PREFIX_PIECE`` tokens (Llama-3-8B: 16 KiB of K/V per chunk token, against
        ~100 KiB of the chunk's activations), attended by the fused kernel (cuDNN on a GPU:
        about 1.8x FlexAttention over the pages at 128K) and merged by LSE into the running
        result, so one piece and one result are held at a time."""
        store_kv, page_size = self.store.kv[layer], self.store.page_size
        size = max(PREFIX_PIECE, PREFIX_CHUNKS * q.shape[1])
        result = None
        for start in range(0, prefix, size):
            k, v = gather_pages(store_kv, self.pages, min(prefix, start + size), page_size,
                                start)  # fmt: skip
            out, lse = attend(q, k, v, backend=self.backend)
            if result is not None:
                out, lse = merge_attention([result[0], out], [result[1], lse])
            result = out, lse
        return result

    def _decode(self, layer: int, q, kv, out):
        store_kv, step = self.store.kv[layer], self.step
        if self.on_gpu:  # the kernel appends the new K/V itself
            from headspace.attention.triton_decode import paged_decode_attention

            _, lse = paged_decode_attention(q, store_kv[0], store_kv[1], step.tables["gpu"],
                                            step.lengths, self.store.page_size, new_kv=kv,
                                            out=out)  # fmt: skip
            return out, lse.transpose(0, 1)
        store_kv[:, :, self.slots] = kv.transpose(1, 2)  # [2, heads, seqs, dim]
        result, lse = cpu_paged_decode(q, store_kv[0], store_kv[1], self.table, self.ends,
                                       self.page_size)  # fmt: skip
        out.copy_(result)
        return out, lse.transpose(0, 1)
