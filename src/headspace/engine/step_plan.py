"""What a step runs: how a lane's scheduler batches, the sequences inside a lane and the plan
the scheduler hands the runner. Plain data, no tensors."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from headspace.kv.block_table import Pages, PoolLayout
from headspace.planner.plan import Plan


@dataclass(frozen=True)
class SchedulerSettings:
    """How a lane's scheduler batches: at most ``max_batch`` sequences in ``num_slots`` token
    slots; ``chunk`` prompt tokens a step when nothing decodes; beside decoding sequences at
    most the work of a prompt's first ``step_tokens`` tokens through every layer (with layer
    slices: a chunk keeps its size and runs a few of its ``num_layers`` layers a step, a
    token's attention over ``attention_prefix`` earlier tokens costing as much as its linear
    layers), else pieces of ``piece_tokens`` (default ``step_tokens``) through every layer;
    while other prompts wait their turn, more: up to ``prefill_slowdown`` times the decode
    step's own work (``decode_rates``: a layer's weights and a context token's K/V read, in
    prompt work, :func:`decode_work`). Where a piece rides in the decode rows' forward and
    requests arrive one by one (the scheduler's ``paced``), it takes up to
    ``mixed_slowdown`` times their decode step alone whether prompts wait or not, at least
    ``mixed_floor`` tokens' work (the step tokens where the user gave them, else none: a
    page). ``swaps``: a sequence may be swapped out to host pages in the all-resident
    layout. ``passes``: the shortest waiting prompt is admitted first, but none is passed
    over by more than this many later ones (0: in arrival order; :func:`in_line`)."""

    max_batch: int
    num_slots: int
    prefix_caching: bool = True
    chunk: int = 8192
    step_tokens: int = 8192
    num_layers: int = 1
    attention_prefix: int = 1 << 30
    piece_tokens: int | None = None
    swaps: bool = False
    decode_rates: tuple[float, float] = (0.0, 0.0)
    prefill_slowdown: float = 1.0
    mixed_slowdown: float = 1.0
    mixed_floor: int = 0
    passes: int = 0


@dataclass
class Sequence:
    """One request inside a lane."""

    seq_id: int
    prompt_ids: list[int]
    max_tokens: int  # prompt + generated, at most
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # leading prompt tokens found in the prefix cache
    finish_reason: str | None = None
    slot: int = -1  # where its last sampled token lives on the device
    num_pending: int = 0  # tokens sampled on the device, not read yet
    num_swaps: int = 0
    reuse_prefix: bool = True  # whether its prompt may start from the prefix cache
    num_passed: int = 0  # later arrivals admitted while it waited

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Tokens known on the host (prompt and read outputs)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def started(self) -> bool:
        """Whether its prompt is computed (a first token exists, read or on the device)."""
        return bool(self.output_ids) or self.num_pending > 0

    @property
    def num_scheduled(self) -> int:
        """Tokens that exist, read or still on the device."""
        return self.num_tokens + self.num_pending


@dataclass
class PrefillPiece:
    """Prompt tokens ``start .. end-1`` of ``seq`` to compute in this step over its
    ``pages``, through decoder ``layers`` (first, end) of ``num_layers``; ``recurs``: it is
    a whole chunk (compiled once for that length), where a shorter piece (the last, a
    step's tokens beside decoding sequences, a chunk halved deep in a long prompt) runs the
    shape compiled for any length."""

    seq: Sequence
    start: int
    end: int
    pages: Pages = field(default_factory=dict)
    layers: tuple[int, int] = (0, 1)
    num_layers: int = 1
    recurs: bool = True

    @property
    def through(self) -> bool:
        """Whether its tokens have passed every layer after this step."""
        return self.layers[1] == self.num_layers

    @property
    def last(self) -> bool:
        """Whether the prompt is complete after it (its first token is sampled)."""
        return self.through and self.end == len(self.seq.prompt_ids)


@dataclass(frozen=True)
class Resize:
    """The resident pool resized under the pages its sequences hold: ``num_pages`` from now
    on, held pages renumbered by ``moves`` ((old, new) pairs), every held page below
    ``held``."""

    num_pages: int
    moves: tuple[tuple[int, int], ...]
    held: int


@dataclass
class StepPlan:
    """Every change one step makes, in the order the runner makes them: a new ``layout`` of
    the lane's part of the arena (nothing holds GPU pages; such a step carries nothing
    else), or the resident pool's ``resize``; host pages grown to ``host_pages``; page
    copies in (a swapped-out sequence back); page copies out; one decode token for each of
    ``decode`` over ``decode_pages`` (their tables, the new token's place included); a piece
    of a prompt (``mixed``: in the same forward as the decode rows). ``admitted``: whose
    prefill begins now. The only thing the scheduler hands the runner: the block tables
    stay the scheduler's."""

    layout: Plan | None = None
    resize: Resize | None = None
    host_pages: int = 0  # the host arena holds at least this many pages (0: as it is)
    host_kept: bool = True  # whether host pages hold data (a reallocation copies them)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host page, GPU page)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (GPU page, host page)
    decode: list[Sequence] = field(default_factory=list)
    decode_pages: Pages = field(default_factory=dict)
    prefill: PrefillPiece | None = None
    mixes: bool = False  # a piece beside decode rows would run in their forward (the layout)
    admitted: Sequence | None = None
    # sequences the scheduler ended for want of pages (none free on the GPU and no room in
    # the host budget to swap them out, or host pages refused): their pages went back;
    # their requests end alone
    ended: list[Sequence] = field(default_factory=list)

    @property
    def mixed(self) -> bool:
        """Whether its piece and its decode rows run through the layers as one forward:
        the layout mixes them and the step has both (after any the scheduler ended)."""
        return self.mixes and bool(self.decode) and self.prefill is not None

    @property
    def computes(self) -> bool:
        """Whether it runs the model (decode tokens or a prompt piece)."""
        return bool(self.decode) or self.prefill is not None

    def summary(self) -> dict:
        """What it does, in counts (an engine view's last step)."""
        piece = self.prefill
        return {"layout": self.layout.offload if self.layout is not None else None,
                "resize": self.resize.num_pages if self.resize is not None else None,
                "host_pages": self.host_pages, "swap_in": len(self.swap_in),
                "swap_out": len(self.swap_out), "decode": [s.seq_id for s in self.decode],
                "ended": [s.seq_id for s in self.ended],
                "prefill": None if piece is None else
                (piece.seq.seq_id, piece.start, piece.end, piece.layers),
                "mixed": self.mixed}  # fmt: skip


@dataclass(frozen=True)
class LayoutResult:
    """What laying a plan out made, for the scheduler: how the page pools follow
    (``pools``: None when the layout's tensors stay), whether a prefill chunk may run a few
    layers a step (``layer_slices``), the pages the host arena holds (``host_pages``) and
    whether it was made anew (``host_reset``: per-entry pages offloading another number of
    heads a layer; nothing was in it); whether a step may run a prompt piece and decode rows
    in one forward (``mixes``)."""

    pools: PoolLayout | None
    layer_slices: bool
    host_pages: int
    host_reset: bool = False
    mixes: bool = False


__all__ = [
    "LayoutResult",
    "PrefillPiece",
    "Resize",
    "SchedulerSettings",
    "Sequence",
    "StepPlan",
    "in_line",
]


def in_line(waiting: Iterable[Sequence], passes: int) -> list[Sequence]:
    """``waiting`` (in arrival order) in the order they are admitted: with ``passes`` 0 as
    they came; else the shortest prompt first (a burst's first tokens come sooner on the
    whole: the mean wait of shortest-job-first), except that a sequence passed over by
    ``passes`` later arrivals goes first, those in arrival order (no prompt waits for
    ever)."""
    if not passes:
        return list(waiting)
    overdue = (0, 0)  # (sorted is stable: ties stay as they came)
    return sorted(
        waiting, key=lambda s: overdue if s.num_passed >= passes else (1, len(s.prompt_ids))
    )
