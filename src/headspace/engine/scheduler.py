"""Continuous batching over the tiers: who is admitted, who grows, who is swapped out and
back in, which piece of a prompt is prefilled. Pure bookkeeping, no tensors: ``schedule()``
returns a :class:`StepPlan`, the only thing the engine's runner is handed.

Admission follows the current plan. In the all-resident layout, with the host tier allowed,
a prompt is admitted when its pages fit (plus a page of headroom per running sequence),
like vLLM: a sequence that later finds no page for its next token swaps the most recently
admitted one out to host pages (its K/V copied, not recomputed) and that one resumes when
pages free up. Without a host tier, and while heads stream, a prompt is admitted only when
the pages it may ever need fit beside those the running sequences may still need.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from headspace.errors import UserError
from headspace.kv.block_table import GPU, HOST, BlockManager, OutOfPages, Pages


@dataclass
class Sequence:
    """One request inside the engine."""

    seq_id: int
    prompt_ids: list[int]
    max_tokens: int  # prompt + generated, at most
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # leading prompt tokens found in the prefix cache
    finish_reason: str | None = None
    slot: int = -1  # where its last sampled token lives on the device
    num_pending: int = 0  # tokens sampled on the device, not read yet
    num_swaps: int = 0

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


@dataclass
class StepPlan:
    """What one step runs, in order: page copies in, page copies out, one decode token for
    each of ``decode`` over ``decode_pages`` (their tables, the new token's place included),
    a piece of a prompt. ``admitted``: whose prefill begins now. The only thing the
    scheduler hands the runner: the block tables stay the scheduler's."""

    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host page, GPU page)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (GPU page, host page)
    decode: list[Sequence] = field(default_factory=list)
    decode_pages: Pages = field(default_factory=dict)
    prefill: PrefillPiece | None = None
    admitted: Sequence | None = None


class Scheduler:
    """Waiting, running and swapped-out sequences over a BlockManager.

    ``tiers``: the tiers a sequence takes pages in under the current plan; ``optimistic``:
    admit on the prompt's pages and swap out on shortage (else reserve up to max_tokens);
    ``grow_host(n)``: grow the host pool to ``n`` free pages; None when it did, else why not
    (the budget, page-locking). A prompt is prefilled one piece a step, one prompt at a time:
    ``chunk`` tokens through every layer when no sequence decodes. When some do (their
    tokens keep coming), a step carries at most the work of a prompt's first
    ``step_tokens`` tokens through every layer: with ``layer_slices`` (the layout allows
    it) a chunk keeps its size and runs a few of its ``num_layers`` layers a step, as many
    as that work allows at its position (a token's attention over ``attention_prefix``
    earlier tokens costs as much as its linear layers), at least one, the chunk halved
    where one layer of it would cost more (unless ``prefix_streams``); without, a piece is
    ``piece_tokens`` tokens (default ``step_tokens``) through every layer.
    """

    def __init__(self, blocks: BlockManager, max_batch: int, num_slots: int,
                 prefix_caching: bool = True, agree: Callable[[bool], bool] = bool,
                 chunk: int = 8192, step_tokens: int = 8192, num_layers: int = 1,
                 attention_prefix: int = 1 << 30, piece_tokens: int | None = None):  # fmt: skip
        self.blocks, self.max_batch, self.prefix_caching = blocks, max_batch, prefix_caching
        self.chunk, self.step_tokens = chunk, step_tokens
        self.piece_tokens = step_tokens if piece_tokens is None else piece_tokens
        self.num_layers, self.attention_prefix = num_layers, attention_prefix
        self.layer_slices = False  # whether the layout lets a chunk run a few layers a step
        self.prefix_streams = False  # whether a piece's prefix is staged from host pages
        self.prefilling: Sequence | None = None  # the prompt being computed, piece by piece
        self.prefill_next = 0  # its first token not yet computed
        self.piece: PrefillPiece | None = None  # a piece part-way through its layers
        self.agree = agree  # whether a page check holds everywhere (ranks with own pools)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.free_slots = list(range(num_slots))
        self.num_swaps = 0  # sequences swapped out, counted over the scheduler's life
        self.tiers: tuple[str, ...] = (GPU,)
        self.optimistic = False
        self.grow_host: Callable[[int], str | None] = lambda n: "no host tier"

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def idle(self) -> bool:
        """No sequence holds pages: the layout may change."""
        return not self.running and not self.swapped

    def _future_pages(self) -> int:
        """Pages the running sequences may still allocate before they hit their limits."""
        return sum(self.blocks.future_pages(s.seq_id, s.max_tokens) for s in self.running)

    def _fits(self, seq: Sequence) -> bool:
        pools = self.blocks.pools
        if self.optimistic:
            needed = self.blocks.pages_for(len(seq.prompt_ids)) + len(self.running)
            fits_alone = self.blocks.pages_for(seq.max_tokens) <= pools[GPU].num_pages
            return fits_alone and needed <= pools[GPU].num_free
        needed = self.blocks.pages_for(seq.max_tokens) + self._future_pages()
        return self.agree(all(needed <= pools[tier].num_free or
                              (tier == HOST and self.grow_host(needed) is None)
                              for tier in self.tiers))  # fmt: skip

    def schedule(self, accept: Callable[[Sequence], bool] = lambda s: True) -> StepPlan:
        """The next step: a swapped-out sequence back in when it fits; the next waiting one
        admitted (if ``accept`` agrees) when no prompt is being prefilled; one token for
        every running sequence past its prompt (growing their pages, swapping the latest
        out on shortage); the next piece of the prompt being prefilled."""
        plan = StepPlan()
        resumed = self.resume()
        if resumed is not None:
            plan.swap_in = resumed[1]
        if self.prefilling is None:
            plan.admitted = self.admit(accept)
            if plan.admitted is not None:
                self.prefilling, self.prefill_next = plan.admitted, plan.admitted.num_cached
        batch = [s for s in self.running if s.started and s.num_scheduled < s.max_tokens]
        if batch:
            plan.decode, plan.swap_out = self.grow(batch)
        if plan.decode:
            plan.decode_pages = self.blocks.pages([s.seq_id for s in plan.decode])
        if self.prefilling is not None:
            plan.prefill = self._next_piece(decoding=bool(plan.decode))
        return plan

    def _next_piece(self, decoding: bool) -> PrefillPiece:
        """The prompt work of this step: the rest of a piece's layers, or a new piece."""
        seq, piece, slices = self.prefilling, self.piece, self.layer_slices
        if piece is not None:  # part-way through its layers
            start, end, first = piece.start, piece.end, piece.layers[1]
        else:
            start, first, size = self.prefill_next, 0, self.chunk
            if decoding and not slices:
                size = min(self.chunk, self.piece_tokens)
            elif decoding:
                size = self._slice_size(start, len(seq.prompt_ids))
            end = min(start + size, len(seq.prompt_ids))
        count = self.num_layers - first
        if decoding and slices:
            count = min(count, self._layers_per_step(start, end))
        pages = self.blocks.pages([seq.seq_id])
        piece = PrefillPiece(seq, start, end, pages, (first, first + count), self.num_layers,
                             end - start == self.chunk)  # fmt: skip
        self.piece = None if piece.through else piece
        if piece.through:
            self.prefill_next = end
            if piece.last:
                self.prefilling = None
        return piece

    def _step_work(self) -> float:
        """One step's prompt work beside decoding sequences: tokens ``0 .. step_tokens-1``
        through every layer."""
        return self.num_layers * self._layer_cost(0, self.step_tokens)

    def _layers_per_step(self, start: int, end: int) -> int:
        """Layers of tokens ``start .. end-1`` that fit one step's prompt work (at least
        one)."""
        return max(1, int(self._step_work() // self._layer_cost(start, end)))

    def _slice_size(self, start: int, num_tokens: int) -> int:
        """The length of a chunk run in layer slices from ``start`` (of a prompt of
        ``num_tokens``): ``chunk``, halved (down to a page) while one layer of what it
        covers costs more than a step's prompt work, so that deep in a long prompt a step
        still fits its work. Never halved where the prefix streams from host pages: each
        piece stages its whole prefix, so halving would multiply what crosses PCIe."""
        size, page = self.chunk, self.blocks.page_size
        if self.prefix_streams:
            return size
        work = self._step_work()
        while size > page and self._layer_cost(start, min(start + size, num_tokens)) > work:
            size = max(page, size // 2 // page * page)
        return size

    def _layer_cost(self, start: int, end: int) -> float:
        """Relative cost of tokens ``start .. end-1`` in one layer: their linear layers and
        their attention over the tokens before (on average ``start`` + half of them)."""
        return (end - start) * (1 + (start + end) / 2 / self.attention_prefix)

    def abort(self, seq: Sequence) -> None:
        """Drop ``seq`` wherever it is; its pages return to their pools."""
        if seq is self.prefilling:
            self.prefilling, self.piece = None, None
        if seq in self.waiting:
            self.waiting.remove(seq)
            seq.finish_reason = "abort"
        else:
            self.finish(seq, "abort")

    def admit(self, accept: Callable[[Sequence], bool] = lambda s: True) -> Sequence | None:
        """Move the next waiting sequence into the batch if it fits (and ``accept`` agrees);
        returns it (to prefill)."""
        if not self.waiting or self.swapped or not self.free_slots:
            return None
        seq = self.waiting[0]
        if len(self.running) >= self.max_batch or not self._fits(seq) or not accept(seq):
            return None
        try:
            seq.num_cached = self.blocks.allocate_prompt(
                seq.seq_id, seq.prompt_ids, self.tiers, reuse=self.prefix_caching
            )
        except OutOfPages:  # reused pages were counted as free
            return None
        self.waiting.popleft()
        seq.slot = self.free_slots.pop()
        self.running.append(seq)
        return seq

    def grow(self, batch: list[Sequence]) -> tuple[list[Sequence], list[tuple[int, int]]]:
        """A slot for one more token of every sequence of ``batch``; on shortage the most
        recently admitted sequences past their prompts are swapped out first (never one
        being prefilled). Returns (the sequences that step,
        (GPU page, host page) pairs the caller copies before anything reuses them)."""
        pairs, stepping, pools = [], list(batch), self.blocks.pools
        while True:
            needed = sum(self.blocks.pages_needed(s.seq_id) for s in stepping)
            if self.agree(all(needed <= pools[tier].num_free for tier in self.tiers)):
                break
            victims = [s for s in self.running if s.started]
            if not self.optimistic or not victims:
                raise OutOfPages(f"{needed} pages needed, fewer free")
            victim = victims[-1]
            pairs += self._swap_out(victim)
            if victim in stepping:
                stepping.remove(victim)
        for seq in stepping:
            self.blocks.append_token(seq.seq_id)
        return stepping, pairs

    def _swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        num_pages = len(self.blocks.table(seq.seq_id, GPU).pages)
        refused = None
        if num_pages > self.blocks.pools[HOST].num_free:
            refused = self.grow_host(num_pages)
        if refused is not None:
            raise UserError(f"no host pages for a swapped-out sequence ({num_pages}): {refused}")
        pairs = self.blocks.swap_out(seq.seq_id)
        self.running.remove(seq)
        self.swapped.appendleft(seq)
        seq.num_swaps += 1
        self.num_swaps += 1
        return pairs

    def resume(self) -> tuple[Sequence, list[tuple[int, int]]] | None:
        """Swap the first swapped-out sequence back in when its pages (and a page of
        headroom per running sequence) fit: (sequence, (host page, GPU page) pairs)."""
        if not self.swapped:
            return None
        seq = self.swapped[0]
        num_pages = len(self.blocks.table(seq.seq_id, HOST).pages)
        if num_pages + len(self.running) + 1 > self.blocks.pools[GPU].num_free:
            return None
        self.swapped.popleft()
        pairs = self.blocks.swap_in(seq.seq_id)
        self.running.append(seq)
        return seq, pairs

    def resume_all(self) -> None:
        """Every swapped-out sequence runs again (a new layout gave it pages in every tier,
        its K/V copied back by the caller)."""
        self.running += self.swapped
        self.swapped.clear()

    def finish(self, seq: Sequence, reason: str) -> None:
        """``seq`` ended: its pages and slot go back (once; a second call does nothing)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
        else:
            return
        seq.finish_reason = reason
        self.blocks.free(seq.seq_id)
        self.free_slots.append(seq.slot)
