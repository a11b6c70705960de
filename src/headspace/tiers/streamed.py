"""The stream tier (and the hybrid tier's GPU side): entries whose K/V live in host pages
are gathered into GPU staging slots one head group at a time and attended there.

Order of work in one forward pass (a prefill chunk or a decode step of the whole batch):
the (layer, group, piece) items in layer order. One gather kernel per item moves the
group's pages of every sequence (a *piece* of the history when it exceeds a slot) from
host pages into a staging slot, on a high-priority copy stream, ``depth - 1`` items ahead
of the attention; the compute stream waits on the item's event, attends (one launch for the
group and the whole batch), frees the slot, and writes the new tokens' K/V to host pages in
place. On the CPU the same code runs synchronously.
"""

from __future__ import annotations

import torch

from headspace.attention import attend, attend_spans, merge_attention
from headspace.attention.flex import decode_block_mask, flex_paged_decode
from headspace.attention.paged import (
    paged_decode_reference,
    paged_token_scores,
    paged_token_slots,
)
from headspace.kv.transfer import (
    as_heads,
    copy_pages,
    copy_rows,
    device_ints,
    shared_stream,
    write_tokens,
)
from headspace.tiers.base import (
    COPY_PRIORITY,
    HeadRange,
    StepInputs,
    Tier,
    TierSite,
    q_heads,
)
from headspace.tiers.hybrid_sparse import SparseSelector
from headspace.tiers.layout import head_ranges
from headspace.tiers.pieces import MAX_COPY_RUNS, Piece, decode_pieces, history_pieces


class StreamedTier(Tier):
    """Attention of the streamed (layer, kv head) entries over host pages."""

    stages_history = True

    def __init__(self, site: TierSite, groups: list[list[HeadRange]], sized: tuple[int, int]):
        """Over ``site``'s host pages and its arena's staging slots (``[2, groups, pages x
        page size, dim]`` each), the head groups of each layer (``groups``: kv-head ranges,
        places in this rank's heads); ``sized``: the streamed entries and groups a CUDA
        graph's step is weighed by (under torchrun the most any rank may stream, so that
        every rank decides alike)."""
        staging, page_size = site.store.staging, site.spec.page_size
        self.host, self.staging, self.q_per_kv = site.host, staging, site.q_per_kv
        self.key_span = site.key_span  # the most keys a prompt piece's kernel reads (None: all)
        self.window, self.window_piece = None, None  # (the hybrid tier's GPU window)
        self.counters = site.counters
        self.page_size, self.backend = page_size, site.backend
        self.groups = groups  # per layer: contiguous kv-head ranges, one per group
        self.num_heads, self.num_groups = sized
        self.entry_page_bytes = (2 * page_size * staging[0].shape[-1]
                                 * staging[0].element_size())  # fmt: skip
        self.order = [(layer, r) for layer, ranges in enumerate(groups) for r in ranges]
        self.index = {item: i for i, item in enumerate(self.order)}
        self.device = staging[0].device
        # the last page of each slot is its scratch page
        self.depth, self.piece_pages = len(staging), staging[0].shape[2] // page_size - 1
        on_gpu = self.device.type == "cuda"
        self.copy_stream = shared_stream(self.device, COPY_PRIORITY) if on_gpu else None
        self._results: dict[int, list] = {}
        self._scored: list = []  # sparse hybrid: this layer's GPU-side scores, per group
        self._aranges: dict[int, torch.Tensor] = {}

    @classmethod
    def from_plan(cls, plan, site: TierSite) -> StreamedTier | None:
        """Each layer's offloaded groups (places in this rank's heads), gathered into the
        arena's staging slots (not the hybrid tier's: :class:`HybridTier`). A graph's step
        is weighed by the plan's map, under torchrun the sized one (no rank streams more:
        all decide alike, so their collectives pair up)."""
        if plan.staging is None or plan.offload == "hybrid":
            return None
        return cls(site, cls.offloaded_groups(plan, site), cls.sized(plan))

    @staticmethod
    def offloaded_groups(plan, site: TierSite) -> list[list[HeadRange]]:
        """Per layer, the offloaded groups' kv-head ranges (places in this rank's heads)."""
        return [head_ranges(plan, layer, site.own_heads(layer))[1]
                for layer in range(site.spec.num_layers)]  # fmt: skip

    @staticmethod
    def sized(plan) -> tuple[int, int]:
        """The streamed entries and groups a graph's step is weighed by."""
        sized = plan.head_map if plan.rank_map is None else plan.rank_map
        return sized.num_offloaded, sized.num_offloaded_groups

    @property
    def sparse(self) -> SparseSelector | None:
        """The sparse hybrid mode's selection (the hybrid tier's); None here."""
        return None

    def _arange(self, n: int, start: int = 0) -> torch.Tensor:
        key = (n, start)
        if key not in self._aranges:
            self._aranges[key] = torch.arange(start, start + n, device=self.device)
        return self._aranges[key]

    # -- the pass ----------------------------------------------------------------------
    def begin(self, step: StepInputs) -> None:
        self.step = step
        self.fused, self.window_piece = False, None
        size = self.page_size
        if step.decode:
            first_pages, last_pages = self._streamed_pages(step)
            self.pieces, self.fused = decode_pieces(step, first_pages, self.piece_pages,
                                                    self.page_size, self.device,
                                                    last_pages)  # fmt: skip
            rows = zip(step.pages["host"], step.positions_list, strict=True)
            slots = [pages[pos // size] * size + pos % size for pages, pos in rows]
            self.new_slots = device_ints(slots, self.device)
        else:
            pages = step.pages["host"][0]
            self.pieces = history_pieces(pages[: -(-step.start // size)], step.start,
                                         self.piece_pages, size, self.device)  # fmt: skip
            host_pages = device_ints(pages, self.device)
            self.new_slots = host_pages[step.positions // size] * size + step.positions % size
        self._start(self._first_item(step.first_layer))

    def _streamed_pages(self, step: StepInputs) -> tuple[list[int], list[int] | None]:
        """Per sequence of a decode step, the first page its staged history starts at and
        the page it ends before (None: its last)."""
        return [0] * len(step.positions_list), None

    def begin_graph(self, step: StepInputs, views: dict[str, torch.Tensor], key: tuple) -> None:
        self.begin_static(step, views["pages"], views["count"], views["new_slots"])

    def begin_static(self, step: StepInputs, pages: torch.Tensor, count: torch.Tensor,
                     new_slots: torch.Tensor) -> None:  # fmt: skip
        """A decode step whose inputs live in device buffers (a CUDA graph captures it): one
        piece holding every sequence's pages (``pages [piece_pages]``, the first ``count``
        in use), ``step.tables["host"]`` into the staging slot, the new tokens' host
        ``new_slots``; the kernel appends each new token in staging."""
        self.step, self.fused = step, True
        self.pieces = [Piece(pages, 0, step.tables["host"], step.lengths, count=count)]
        self.new_slots = new_slots
        self._start()

    layer_slices = True  # a prefill chunk may run a few layers a step

    def _first_item(self, layer: int) -> int:
        """The first (group, piece) item of ``layer`` or a later one (their count: none)."""
        group = next((g for g, (at, _) in enumerate(self.order) if at >= layer), len(self.order))
        return group * len(self.pieces)

    def _start(self, first: int = 0) -> None:
        """Items in order from item ``first`` (the pass's first layer) on, the first ones
        issued ahead."""
        self.items = [(g, p) for g in range(len(self.order)) for p in range(len(self.pieces))]
        self._arrived: dict[int, torch.cuda.Event] = {}
        self._released: list[torch.cuda.Event | None] = [None] * self.depth
        if self.copy_stream is not None:  # history written by earlier passes is complete
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            for i in range(first, first + self.depth - 1):
                self._issue(i)

    # -- staging -------------------------------------------------------------------------
    def _gather(self, i: int) -> None:
        """Item ``i``'s pages into its slot: through the copy engine when the pages lie in a
        few runs (as a fresh sequence's do), two 2-D copies a run (K and V of the group's
        heads), else one gather kernel."""
        group, piece_index = self.items[i]
        layer, (lo, hi) = self.order[group]
        piece, slot = self.pieces[piece_index], self.staging[i % self.depth]
        host = self.host.layer(layer)
        if self.step.decode and piece.count is None:
            self.counters.staged_entry_pages += piece.pages.numel() * (hi - lo)
        if self.copy_stream is not None and piece.runs and len(piece.runs) <= MAX_COPY_RUNS:
            size = self.page_size
            for first, at, count in piece.runs:  # [heads, run's slots, dim] each
                for kv in range(2):
                    copy_rows(slot[kv, : hi - lo, at * size : (at + count) * size],
                              host[lo:hi, kv, first * size : (first + count) * size])  # fmt: skip
            return
        copy_pages(host, as_heads(slot, kv_first=True), piece.pages,
                   self._arange(piece.pages.numel()), self._arange(hi - lo, lo),
                   self._arange(hi - lo), self.page_size, count=piece.count)  # fmt: skip

    def _issue(self, i: int) -> None:
        """Start gathering item ``i`` into slot ``i % depth`` once that slot is free."""
        if i >= len(self.items) or i in self._arrived or self.copy_stream is None:
            return
        released = self._released[i % self.depth]
        with torch.cuda.stream(self.copy_stream):
            if released is not None:
                self.copy_stream.wait_event(released)
            self._gather(i)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        self._arrived[i] = event

    def _staged(self, i: int, num_heads: int, num_tokens: int):
        """K and V ``[heads, tokens, dim]`` of item ``i`` in its staging slot."""
        if self.copy_stream is None:
            self._gather(i)
        else:
            for ahead in range(i, i + self.depth):
                self._issue(ahead)
            torch.cuda.current_stream(self.device).wait_event(self._arrived.pop(i))
        slot = self.staging[i % self.depth]
        return slot[0, :num_heads, :num_tokens], slot[1, :num_heads, :num_tokens]

    def _release(self, i: int) -> None:
        if self.copy_stream is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._released[i % self.depth] = event

    # -- attention -----------------------------------------------------------------------
    def submit(self, layer: int, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor) -> None:
        """Attend every streamed group of ``layer``; results go into their heads of ``out``
        (the hybrid tier's CPU part is merged in at :meth:`collect`)."""
        results = []
        for kv_range in self.groups[layer]:
            heads = q_heads(kv_range, self.q_per_kv)
            q_part, kv_part = q[:, heads], kv[:, :, slice(*kv_range)]
            group = self.index[(layer, kv_range)]
            attend_fn = self._decode if self.step.decode else self._prefill
            results.append(attend_fn(group, kv_range, q_part, kv_part, out[:, heads]))
            write_tokens(self.host.layer(layer), self._arange(kv_range[1] - kv_range[0],
                         kv_range[0]), self.new_slots, kv_part)  # fmt: skip
        self._results[layer] = results

    def collect(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self._results.pop(layer, [])

    def _history(self, group: int, num_heads: int, fn) -> tuple[list, list]:
        """``fn(piece, k, v) -> (out, lse)`` over every piece of the group's history."""
        outs, lses = [], []
        for p, piece in enumerate(self.pieces):
            i = group * len(self.pieces) + p
            tokens = self.staging[0].shape[2] if self.step.decode else piece.num_tokens
            k, v = self._staged(i, num_heads, tokens)
            out, lse = fn(piece, k, v)
            self._release(i)
            outs.append(out)
            lses.append(lse)
        return outs, lses

    def _prefill(self, group: int, kv_range: HeadRange, q, kv, out):
        """The chunk's causal part, then each staged piece of the history merged into an fp32
        running state one kv head at a time (a group of many heads would otherwise hold
        every piece's output for all its query heads at once)."""
        q_first = q.transpose(0, 1)  # [heads, tokens, dim]
        k_new, v_new = kv[0].transpose(0, 1), kv[1].transpose(0, 1)
        merged, lse = attend(q_first, k_new, v_new, causal=True, backend=self.backend)
        if self.step.start > 0:
            merged, per_kv = merged.float(), self.q_per_kv

            def over(_, k, v):  # k, v: [group heads, tokens, dim]
                for j in range(k.shape[0]):
                    heads = slice(j * per_kv, (j + 1) * per_kv)
                    part = attend_spans(q_first[heads], k[j : j + 1], v[j : j + 1],
                                        self.key_span, backend=self.backend)  # fmt: skip
                    merge_attention([merged[heads], part[0]], [lse[heads], part[1]],
                                    out=merged[heads], lse_out=lse[heads])  # fmt: skip
                return None, None

            self._history(group, kv_range[1] - kv_range[0], over)
        out.copy_(merged.transpose(0, 1))
        return out, lse

    def _decode(self, group: int, kv_range: HeadRange, q, kv, out):
        """The group's staged pieces of the history, then its GPU window (hybrid, kept in
        GPU pages), merged by LSE; the new token is in the one piece that holds it all
        (*fused*: staged with it), or the window, or attended apart."""
        window = self.window_piece
        final = self.fused or (window is not None and not self.pieces)  # one part: ``out``
        tracked = self.sparse is not None and self.sparse.tracks
        scores = []  # sparse mode: each piece's scores of its keys

        def piece_attention(piece: Piece, k, v, new_kv=None, target=None):
            if tracked and piece.slots is None:  # the same for every group
                piece.slots = paged_token_slots(piece.tables, piece.width, self.page_size)
            if self.backend == "flex":  # one mask per piece, for every group and layer
                if piece.block_mask is None:
                    piece.block_mask = decode_block_mask(piece.tables, piece.lengths,
                                                         k.shape[1], self.page_size)  # fmt: skip
                result = flex_paged_decode(q, k, v, piece.tables, piece.lengths,
                                           self.page_size, new_kv=new_kv, out=target,
                                           block_mask=piece.block_mask)  # fmt: skip
            elif k.is_cuda:
                from headspace.attention.triton_decode import paged_decode_attention

                size = self.page_size
                result = paged_decode_attention(q, k, v, piece.tables, piece.lengths, size,
                                                new_kv=new_kv, out=target)  # fmt: skip
            else:
                result = paged_decode_reference(q, k, v, piece.tables, piece.lengths.tolist(),
                                                self.page_size, new_kv=new_kv)  # fmt: skip
                if target is not None:
                    result = (target.copy_(result[0]), result[1])
            if tracked:
                scores.append(paged_token_scores(q, k, piece.slots))
            return result

        fused = (kv, out) if self.fused else (None, None)

        def staged(piece: Piece, k, v):
            return piece_attention(piece, k, v, *fused)

        outs, lses = self._history(group, kv_range[1] - kv_range[0], staged)
        if window is not None:  # the window's keys, the new token appended there
            k, v = self.window.keys(self.order[group][0], kv_range)
            result = piece_attention(window, k, v, kv, out if final else None)
            outs.append(result[0])
            lses.append(result[1])
        if final:
            lse = lses[0].transpose(0, 1)
        else:
            if window is None:  # the new token's own key: softmax over one score
                scale = q.shape[-1] ** -0.5
                k_new = kv[0].repeat_interleave(self.q_per_kv, dim=1).float()
                outs.append(kv[1].repeat_interleave(self.q_per_kv, dim=1).to(q.dtype))
                lses.append((q.float() * k_new).sum(-1) * scale)
                scores.append(lses[-1][..., None])  # the new token's score
            _, lse = merge_attention([o.transpose(0, 1) for o in outs],
                                     [x.transpose(0, 1) for x in lses],
                                     out=out.transpose(0, 1))  # fmt: skip
        if tracked:
            self._scored.append((kv_range, scores, lse.transpose(0, 1)))
        return out, lse
