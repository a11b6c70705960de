"""The resident tier: entries whose K/V stay in the GPU arena's shared pages."""

from __future__ import annotations

import torch

from headspace.attention import attend, merge_attention
from headspace.attention.cpu_decode import cpu_paged_decode
from headspace.attention.flex import (
    chunk_block_mask,
    decode_block_mask,
    flex_paged_decode,
    flex_paged_prefill,
)
from headspace.attention.paged import gather_pages
from headspace.attention.sdpa import unplanned_attention
from headspace.attention.sparse_prefill import prefill_with_patterns
from headspace.kv.paged_store import PagedKVStore, new_token_slots
from headspace.kv.spec import Pattern, prefix_piece
from headspace.tiers.base import (
    HeadRange,
    StepInputs,
    Tier,
    TierSite,
    chunk_slots,
    padded_positions,
    q_heads,
)
from headspace.tiers.layout import head_ranges, prefill_patterns


class ResidentTier(Tier):
    """Entries resident in the GPU pool's pages: at prefill the fused causal kernel over the
    chunk and over the prefix gathered from the pages in pieces; at decode the Triton
    split-K paged kernel (which also appends the new K/V), or the CPU kernel over the pages
    in place. The ``flex`` backend attends over the pages in place at both (FlexAttention
    through a block mask of physical pages). A layer with ``patterns`` (one per query head
    of its range, None where all are full) gathers its keys and attends each head by its
    pattern at prefill."""

    layer_slices = True  # each layer's prefill reads only the step's inputs and its pages
    mixes = True  # a piece's rows and decode rows attend apart, over the same arena

    def __init__(self, store: PagedKVStore, ranges: list[HeadRange | None], q_per_kv: int,
                 backend: str, patterns: list[list[Pattern] | None] | None = None,
                 piece: int | None = None, key_span: int | None = None):  # fmt: skip
        """``ranges``: per layer the resident kv heads (places in the layer's heads; None:
        none); ``piece``: prefix tokens gathered at a time (None: :func:`prefix_piece`);
        ``key_span``: at most this many of them (None: no bound)."""
        self.store, self.ranges, self.q_per_kv, self.backend = store, ranges, q_per_kv, backend
        self.patterns = patterns or [None] * len(ranges)
        self.piece, self.key_span = piece, key_span
        self.on_gpu = store.buffer.is_cuda
        self.page_size = store.page_size
        # a mixed step's piece in a graph: the paged kernel, every length a device value
        self.mixes_in_graphs = backend != "flex" and not any(self.patterns)
        self.piece_views: dict[str, torch.Tensor] | None = None  # (a graph's mixed step)
        self._results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def from_plan(cls, plan, site: TierSite) -> ResidentTier | None:
        """Each layer's resident heads (this rank's own, first in its weights' order)."""
        own = [site.own_heads(layer) for layer in range(site.spec.num_layers)]
        ranges = [head_ranges(plan, layer, heads)[0] for layer, heads in enumerate(own)]
        if not any(ranges):
            return None
        patterns = [r and prefill_patterns(plan, layer, own[layer][: r[1]], site.q_per_kv)
                    for layer, r in enumerate(ranges)]  # fmt: skip
        return cls(site.store, ranges, site.q_per_kv, site.backend, patterns, site.prefix_piece,
                   site.key_span)  # fmt: skip

    def begin(self, step: StepInputs) -> None:
        self.piece_views = None
        if step.decode:
            self.piece_step, self.decode_step = None, step
            self._begin_decode(step)
        else:
            self.piece_step, self.decode_step = step, None
            self._begin_piece(step)

    def begin_mixed(self, piece: StepInputs, decode: StepInputs) -> None:
        self.piece_step, self.decode_step, self.piece_views = piece, decode, None
        self._begin_piece(piece)
        self._begin_decode(decode)

    def begin_graph_mixed(self, piece: StepInputs, decode: StepInputs,
                          views: dict[str, torch.Tensor]) -> None:  # fmt: skip
        self.piece_step, self.decode_step, self.piece_views = piece, decode, views
        self._begin_decode(decode)

    def _begin_piece(self, step: StepInputs) -> None:
        self.pages, self.slots = chunk_slots(self.store, step)
        if self.backend == "flex":  # one mask for every layer of the chunk
            slots = self.store.kv[0].shape[2]
            self.chunk_mask = chunk_block_mask(self.pages, step.start, len(step.positions),
                                               slots, self.page_size)  # fmt: skip
        if any(self.patterns):
            self.num_keys = step.start + len(step.positions)
            positions = padded_positions(self.num_keys, self.store.buffer.device)
            self.key_slots = self.store.slots(self.pages, positions)

    def _begin_decode(self, step: StepInputs) -> None:
        if self.backend == "flex" and "gpu" in step.tables:  # one mask for every layer
            slots = self.store.kv[0].shape[2]
            self.step_mask = decode_block_mask(step.tables["gpu"], step.lengths, slots,
                                               self.page_size)  # fmt: skip
        elif not self.on_gpu and "gpu" in step.tables:  # the CPU kernel's inputs, per step
            self.ends = step.lengths.to(torch.int32)
            self.table = step.tables["gpu"].to(torch.int32).contiguous()  # (graphs': int64)
            self.new_slots = new_token_slots(self.table, self.ends - 1, self.page_size)

    def submit(self, layer: int, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor) -> None:
        """``q [tokens, heads, dim]``, ``kv [2, tokens, kv_heads, dim]`` of the whole layer
        (a mixed step's: the piece's rows, then the decode rows); the result goes into this
        tier's heads of ``out``."""
        kv_range = self.ranges[layer]
        if kv_range is None:
            return
        heads = q_heads(kv_range, self.q_per_kv)
        q_part, kv_part, out_part = q[:, heads], kv[:, :, slice(*kv_range)], out[:, heads]
        rows = 0 if self.piece_step is None else len(self.piece_step.positions)  # the piece's
        results = []
        if rows and self.piece_views is not None:
            results.append(self._graph_piece(layer, q_part[:rows], kv_part[:, :rows],
                                             out_part[:rows]))  # fmt: skip
        elif rows:
            result = self._prefill(layer, q_part[:rows], kv_part[:, :rows])
            out_part[:rows].copy_(result[0])
            results.append(result)
        if self.decode_step is not None:
            results.append(self._decode(layer, q_part[rows:], kv_part[:, rows:],
                                        out_part[rows:]))  # fmt: skip
        if len(results) == 1:
            self._results[layer] = results[0]
        else:  # [rows, heads, dim] and [heads, rows]
            self._results[layer] = (out_part, torch.cat([lse for _, lse in results], dim=1))

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
        if self.backend == "flex":  # the chunk over its sequence's pages, in place
            store_kv = self.store.kv[layer]
            out, lse = flex_paged_prefill(q_heads_first, store_kv[0], store_kv[1],
                                          self.chunk_mask)  # fmt: skip
            return out.transpose(0, 1), lse
        backend = self.backend
        if backend == "sdpa" and self.decode_step is not None:  # a mixed step's piece
            backend = unplanned_attention
        k, v = kv[0].transpose(0, 1), kv[1].transpose(0, 1)
        out, lse = attend(q_heads_first, k, v, causal=True, backend=backend)
        if self.piece_step.start > 0:
            out, lse = self._prefix(layer, q_heads_first, self.piece_step.start, (out, lse),
                                    backend)  # fmt: skip
        return out.transpose(0, 1), lse

    def _graph_piece(self, layer: int, q, kv, out):
        """A graph's piece: its K/V stored (padding rows into a scratch slot), then its
        queries over the sequence's pages by the paged kernel, whose lengths are read on the
        device: ``(out, lse [heads, rows])``."""
        from headspace.attention.triton_piece import paged_piece_attention

        views, store_kv = self.piece_views, self.store.kv[layer]
        self.store.write(layer, views["slots"], kv)
        return paged_piece_attention(q, store_kv[0], store_kv[1], views["table"], views["start"],
                                     views["rows"], self.page_size, out=out)  # fmt: skip

    def _prefix(self, layer: int, q: torch.Tensor, prefix: int, result: tuple, backend):
        """``result`` (the chunk's causal ``(out, lse)``) with the attention of chunk queries
        ``q [heads, tokens, dim]`` to the pool's first ``prefix`` tokens of the sequence
        merged in: the pages gathered in pieces (:func:`prefix_piece`), attended by
        ``backend``'s fused kernel (cuDNN on a GPU: about 1.8x FlexAttention over the pages
        at 128K; flash for a mixed step's piece, whose shapes seldom recur) and
        merged by LSE into the running result, piece after piece as the stream tier merges
        its staged pieces (the same sums in the same order where the pieces agree), so one
        piece and one result are held at a time."""
        store_kv, page_size = self.store.kv[layer], self.store.page_size
        size = prefix_piece(q.shape[1], self.piece)
        size = size if self.key_span is None else min(size, self.key_span)
        for start in range(0, prefix, size):
            k, v = gather_pages(store_kv, self.pages, min(prefix, start + size), page_size,
                                start)  # fmt: skip
            out, lse = attend(q, k, v, backend=backend)
            result = merge_attention([result[0], out], [result[1], lse])
        return result

    def _decode(self, layer: int, q, kv, out):
        store_kv, step = self.store.kv[layer], self.decode_step
        if self.backend == "flex":  # it stores the new K/V itself too
            _, lse = flex_paged_decode(q, store_kv[0], store_kv[1], step.tables["gpu"],
                                       step.lengths, self.page_size, new_kv=kv, out=out,
                                       block_mask=self.step_mask)  # fmt: skip
            return out, lse.transpose(0, 1)
        if self.on_gpu:  # the kernel appends the new K/V itself
            from headspace.attention.triton_decode import paged_decode_attention

            _, lse = paged_decode_attention(q, store_kv[0], store_kv[1], step.tables["gpu"],
                                            step.lengths, self.store.page_size, new_kv=kv,
                                            out=out)  # fmt: skip
            return out, lse.transpose(0, 1)
        store_kv[:, :, self.new_slots] = kv.transpose(1, 2)  # [2, heads, seqs, dim]
        result, lse = cpu_paged_decode(q, store_kv[0], store_kv[1], self.table, self.ends,
                                       self.page_size)  # fmt: skip
        out.copy_(result)
        return out, lse.transpose(0, 1)
