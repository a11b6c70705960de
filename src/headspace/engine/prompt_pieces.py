"""Which piece of the prompt being prefilled a step carries beside the decoding batch: the
scheduler's sizing of prompt pieces, over its fields (the arithmetic is
:mod:`headspace.engine.piece_work`'s)."""

from __future__ import annotations

from collections import deque

from headspace.engine.piece_work import (
    decode_work,
    grown_piece,
    layer_cost,
    layers_per_step,
    mixed_piece_work,
    piece_size,
    queued_step_work,
    slice_size,
    step_work,
)
from headspace.engine.step_plan import PrefillPiece, SchedulerSettings, Sequence
from headspace.kv.block_table import BlockManager


class PromptPieces:
    """The prompt pieces of :class:`~headspace.engine.scheduler.Scheduler` (mixed into it:
    these read and advance its prefill fields)."""

    blocks: BlockManager
    settings: SchedulerSettings
    prefilling: Sequence | None
    prefill_next: int
    piece: PrefillPiece | None
    step_tokens: int
    paced: bool
    piece_tokens: int
    chunk_limit: int | None
    layer_slices: bool
    mixes: bool
    prefix_streams: bool
    waiting: deque[Sequence]

    def _next_piece(self, batch: list[Sequence]) -> PrefillPiece:
        """The prompt work of this step beside the decoding ``batch``: the rest of a
        piece's layers, or a new piece."""
        seq, piece, slices = self.prefilling, self.piece, self.layer_slices
        base = step_work(self.step_tokens, self.settings.num_layers,
                         self.settings.attention_prefix)  # fmt: skip
        decoding, work = bool(batch), self._step_work(batch, base)
        chunk = self.settings.chunk
        if piece is not None:  # part-way through its layers
            start, end, first = piece.start, piece.end, piece.layers[1]
        else:
            start, first, size = self.prefill_next, 0, chunk
            if decoding and self.mixes:  # through every layer, beside the decode rows
                size = self._mixed_size(start, len(seq.prompt_ids), batch)
            elif decoding and not slices:  # (it grows with the work while prompts wait)
                size = grown_piece(self.piece_tokens or self.step_tokens, work / base,
                                   self.blocks.page_size)  # fmt: skip
                size = min(chunk, size)
            elif decoding:
                size = self._slice_size(start, len(seq.prompt_ids), work)
            if self.chunk_limit is not None:
                size = min(size, self.chunk_limit)
            end = min(start + size, len(seq.prompt_ids))
        num_layers = self.settings.num_layers
        count = num_layers - first
        if decoding and slices and not self.mixes:
            count = min(count, layers_per_step(start, end, work, self.settings.attention_prefix))
        pages = self.blocks.pages([seq.seq_id])
        piece = PrefillPiece(seq, start, end, pages, (first, first + count), num_layers,
                             end - start == chunk)  # fmt: skip
        self.piece = None if piece.through else piece
        if piece.through:
            self.prefill_next = end
            if piece.last:
                self.prefilling = None
        return piece

    def _mixed_size(self, start: int, num_tokens: int, batch: list[Sequence]) -> int:
        """A piece run in one forward with the decode rows of ``batch``, in whole pages
        (:func:`piece_size`; its work :func:`mixed_piece_work`'s): for requests arriving one
        by one (``paced``), what keeps the step within ``mixed_slowdown`` times their decode
        step alone (at least ``mixed_floor`` tokens' work); for a batch given at once, the
        work of ``step_tokens`` tokens in a layer, more while prompts wait."""
        work = self._mixed_work(len(batch), sum(s.num_scheduled for s in batch))
        most = self.settings.chunk if self.chunk_limit is None else self.chunk_limit
        return piece_size(start, num_tokens, work, self.blocks.page_size, most,
                          self.settings.attention_prefix)  # fmt: skip

    def _mixed_work(self, rows: int, context_tokens: int) -> float:
        """A mixed piece's work in a layer beside ``rows`` decode rows of ``context_tokens``
        in all (:meth:`_mixed_size`)."""
        settings, prefix = self.settings, self.settings.attention_prefix
        if self.paced:
            base, slowdown, capped = settings.mixed_floor, settings.mixed_slowdown, True
        else:
            base, slowdown, capped = self.step_tokens, settings.prefill_slowdown, bool(self.waiting)
        return mixed_piece_work(layer_cost(0, base, prefix), slowdown, settings.decode_rates,
                                rows, context_tokens, capped)  # fmt: skip

    def widest_mixed_piece(self, rows: int, context_tokens: int) -> int:
        """The most tokens a mixed piece takes beside ``rows`` decode rows of
        ``context_tokens`` in all, for requests arriving one by one (a prompt's first piece:
        its attention over no prefix): what a server's warm-up captures graphs for."""
        chunk = self.settings.chunk
        return piece_size(0, chunk, self._mixed_work(rows, context_tokens),
                          self.blocks.page_size, chunk, self.settings.attention_prefix)  # fmt: skip

    def _step_work(self, batch: list[Sequence], base: float) -> float:
        """A step's prompt work beside ``batch``: ``base`` (the work of ``step_tokens``),
        more while prompts wait (:func:`queued_step_work`)."""
        settings = self.settings
        if not self.waiting or not batch or settings.prefill_slowdown <= 1:
            return base
        context = sum(s.num_scheduled for s in batch)
        decode = decode_work(settings.num_layers, *settings.decode_rates, context)
        return queued_step_work(base, settings.prefill_slowdown, decode)

    def _slice_size(self, start: int, num_tokens: int, work: float) -> int:
        """A chunk run in layer slices (:func:`slice_size`); never halved where the prefix
        streams from host pages: each piece stages its whole prefix, so halving would
        multiply what crosses PCIe."""
        if self.prefix_streams:
            return self.settings.chunk
        return slice_size(start, num_tokens, self.settings.chunk, self.blocks.page_size,
                          work, self.settings.attention_prefix)  # fmt: skip
