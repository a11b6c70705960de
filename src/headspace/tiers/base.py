"""The contract every tier of the head map implements, and what the tiers share.

A tier attends, for each layer, the query heads of its (layer, kv head) entries and returns
``(out, lse)``. The runner calls ``submit`` on every tier of a layer, then ``collect``: GPU
work is queued at submit, so a tier whose work runs elsewhere (CPU threads, next) overlaps
the others. Each tier owns contiguous kv-head ranges of a layer (the planner keeps resident
heads first and streamed groups after them), so its query heads are views, never gathered
copies. ``tiers.table`` maps the head map's tiers to the classes that attend them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from headspace.budgets import KVBudget
from headspace.kv.block_table import BlockManager
from headspace.kv.entry_table import EntryBlockManager
from headspace.kv.host_store import HostKVArena
from headspace.kv.paged_store import PagedKVStore
from headspace.kv.spec import KVSpec, padded_length
from headspace.kv.transfer import device_ints
from headspace.parallel.dist import all_gather_stack
from headspace.parallel.placement import RankLayout
from headspace.tiers.cpu_timings import CpuTimings
from headspace.tiers.settings import HybridSettings

if TYPE_CHECKING:
    from headspace.tiers.cpu_attention import CpuAttention

HeadRange = tuple[int, int]  # kv heads lo..hi-1 of a layer
# the CUDA priority of the stream that stages a tier's history from host pages (above the
# default: its copies are what the step's attention waits for)
COPY_PRIORITY = -1
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
    """One forward pass, as the tiers see it.

    Prefill (one sequence): ``positions [tokens]``, ``start`` its first position, ``pages``
    the sequence's pages per tier, ``first_layer`` the first decoder layer this pass runs
    (a chunk run a few layers a step: ``Tier.layer_slices``). Decode (one token per
    sequence): ``positions`` per sequence, ``tables`` per tier ``[seqs, width]`` int32 and
    ``lengths [seqs]`` (positions + 1) on the device, ``pages`` per tier and sequence.
    """

    decode: bool
    positions: torch.Tensor
    positions_list: list[int]
    pages: dict[str, list[list[int]]]
    tables: dict[str, torch.Tensor] = field(default_factory=dict)
    lengths: torch.Tensor | None = None
    start: int = 0
    seq_ids: list[int] = field(default_factory=list)
    first_layer: int = 0


@dataclass
class TierCounters:
    """Running totals of what the tiers copied since the engine started (never reset; tests
    and benchmarks read them)."""

    run_pages: int = 0  # host pages per-entry staging copied by the copy engine, in runs
    kernel_pages: int = 0  # host pages per-entry staging gathered by the page kernel
    # entry pages (one kv head's page) the stream and hybrid tiers staged at decode, and
    # their GPU windows' fills (eager steps: a CUDA graph's copies are not counted)
    staged_entry_pages: int = 0
    window_fill_pages: int = 0


@dataclass
class TierSite:
    """What the tiers of one runner are built over: its GPU arena (``store``), host pages
    and their page bookkeeping (``blocks``: shared pages, or ``per_entry_pages``), and the
    settings that pick each tier's kernels and sizes."""

    store: PagedKVStore
    host: HostKVArena
    blocks: BlockManager | EntryBlockManager
    spec: KVSpec
    q_per_kv: int  # query heads per kv head
    backend: str  # the attention backend's name
    max_slots: int  # token slots: batch rows and the graphs' scratch one
    per_entry_pages: bool = False  # every (layer, kv head) in its own pages
    layout: RankLayout | None = None  # one rank's heads under torch.distributed; None: all
    budget: KVBudget | None = None  # what each entry keeps of a prompt (None: all)
    head_scores: torch.Tensor | None = None  # [layers, kv heads] the profile's retrieval
    hybrid: HybridSettings = field(default_factory=HybridSettings)
    # every rank's tensor stacked ``[world, ...]`` (an all-gather), for copies and budgets
    exchange: Callable[[torch.Tensor], torch.Tensor] = all_gather_stack
    prefix_piece: int | None = None  # prefix tokens gathered at a time (None: the rule)
    key_span: int | None = None  # most keys a prompt piece's attention kernel reads (None: all)
    cpu_attention: CpuAttention | None = None  # the hybrid tier's threads, kept across plans
    cpu_timings: CpuTimings | None = None  # a benchmark's profile of them (None: none)
    counters: TierCounters = field(default_factory=TierCounters)

    def own_heads(self, layer: int) -> Sequence[int]:
        """This rank's own kv heads of ``layer`` in its weights' order (all of them in one
        process)."""
        return range(self.spec.num_kv_heads) if self.layout is None else self.layout.own[layer]

    def heads(self, layer: int) -> Sequence[int]:
        """The kv heads of ``layer`` this rank holds entries of: its own, then its copies."""
        return range(self.spec.num_kv_heads) if self.layout is None else self.layout.heads(layer)


class Tier:
    """What a step needs from a tier of the head map.

    Built by ``from_plan(plan, site)`` (:class:`headspace.tiers.table.TierSite`: the arena,
    host pages and settings it runs over), one object per tier of a layout. Every step:
    ``begin(step)`` with the step's inputs (a CUDA graph's step: ``begin_graph`` with views
    of its device buffers), then per layer ``submit(layer, q, kv, out)`` (GPU work queued,
    other work started) and ``collect(layer)`` (the tier's ``(out, lse)``, its heads of
    ``out`` written). Around them, for tiers that keep per-sequence state on the device:
    ``before_decode(seq_ids, slots)`` brings it up to the sequences of a decode step,
    ``after_prefill(seq_id, prompt_len, stand_in_counts)`` follows a prompt (budgets
    compress it; a benchmark's stand-in prompt gives the counts kept), and
    ``forget(seq_id)`` drops what the tier keeps of a sequence that ended. A CUDA graph
    packs what a tier's decode step reads: ``stages_history`` (host pages staged into a
    slot) and ``entry_rows`` (per-entry tables on the device, no block table);
    ``runs_outside_graphs``: part of its decode step cannot be captured (CPU threads).
    ``cpu_split``: the hybrid tier's CPU side, whose share the engine may search (None
    elsewhere); ``kept_summary(seq_id)``: the sparse hybrid mode's kept shares.
    ``layer_slices``: a prefill chunk may run a few layers a step, other steps between its
    slices (``begin`` is called again with the chunk's inputs before each slice; a tier
    that stages the chunk's history ahead across layers cannot). ``mixes``: a step may
    carry a prompt piece and decode rows through the layers in one forward, the piece's
    rows first (``begin_mixed(piece, decode)`` in place of ``begin``; each ``submit`` then
    attends the first ``len(piece.positions)`` rows as the piece, the rest as the decode
    rows). ``mixes_in_graphs``: such a step may also be captured in a CUDA graph
    (``begin_graph_mixed(piece, decode, views)`` in place of ``begin_mixed``: the piece's
    lengths are device values in ``views``). ``graph_version``: counts
    moves of the device tensors a captured step reads (graphs are captured again).
    """

    stages_history = False
    entry_rows = False
    runs_outside_graphs = False
    layer_slices = False
    mixes = False
    mixes_in_graphs = False
    graph_version = 0
    cpu_split = None  # the hybrid tier's CPU side (its share searched by the engine)

    def kept_summary(self, seq_id: int) -> tuple[float, float, float] | None:
        """The sparse hybrid mode's (min, median, max) share of the CPU-side tokens kept per
        (layer, kv head) of ``seq_id``; None for other tiers."""
        return None

    @classmethod
    def from_plan(cls, plan, site) -> Tier | None:
        """The tier over ``plan``'s entries of this kind on ``site``; None when it has
        none."""
        raise NotImplementedError

    def begin(self, step: StepInputs) -> None:
        raise NotImplementedError

    def begin_mixed(self, piece: StepInputs, decode: StepInputs) -> None:
        """A step of a prompt ``piece`` (its rows first) and ``decode`` rows (see
        ``mixes``)."""
        raise NotImplementedError

    def begin_graph_mixed(self, piece: StepInputs, decode: StepInputs,
                          views: dict[str, torch.Tensor]) -> None:  # fmt: skip
        """A captured step of a prompt ``piece`` (a bucket's rows, its positions on the
        device) and ``decode`` rows (see ``mixes_in_graphs``); ``views``: the piece's
        ``slots [rows]`` (padding rows: a scratch slot), ``table [pages]``, ``start [1]``
        and ``rows [1]`` on the device."""
        raise NotImplementedError

    def submit(self, layer: int, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor) -> None:
        raise NotImplementedError

    def collect(self, layer: int):
        raise NotImplementedError

    def before_decode(self, seq_ids: list[int], slots: list[int]) -> None:
        """Per-sequence device state for a decode step of ``seq_ids`` in token ``slots``."""

    def after_prefill(self, seq_id: int, prompt_len: int,
                      stand_in_counts: list[list[int]] | None = None):  # fmt: skip
        """After the last chunk of a prompt of ``prompt_len`` tokens; ``stand_in_counts``:
        the tokens each (layer, kv head) of the model keeps in place of what a budget's
        policy would pick (a benchmark's stand-in for a prompt never computed)."""

    def forget(self, seq_id: int) -> None:
        """Drop what the tier keeps of ``seq_id`` (ended or aborted; its pages are the
        scheduler's to free)."""

    def begin_graph(self, step: StepInputs, views: dict[str, torch.Tensor], key: tuple) -> None:
        """A captured decode step over the graph's buffers (``views``, graph ``key``)."""
        self.begin(step)


def q_heads(kv_range: HeadRange, q_per_kv: int) -> slice:
    return slice(kv_range[0] * q_per_kv, kv_range[1] * q_per_kv)


def attend_tiers(tiers: list[Tier], layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Every tier's heads of ``layer``: ``q [T, H, D]``, ``kv [2, T, Hkv, D]`` -> ``[T, H, D]``
    (all tiers submit, then all collect)."""
    out = torch.empty_like(q)
    for tier in tiers:
        tier.submit(layer, q, kv, out)
    for tier in tiers:
        tier.collect(layer)
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
