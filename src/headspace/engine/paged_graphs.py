"""CUDA graphs of the batched paged decode step: one per (batch, table width) bucket.

Rows past the real batch point at a scratch page that no sequence owns, so the padded rows
of a replay write and read only there. Buffers are static; a replay copies the step's
tokens, positions and block tables in and returns the logits rows of the real batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headspace.attention.triton_decode import num_splits_for, paged_decode_attention

MIN_WIDTH = 8  # pages per block-table row, at least


def bucket(n: int, floor: int = 1) -> int:
    """The power of two at or above ``max(n, floor)``."""
    return 1 << (max(n, floor) - 1).bit_length()


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # [batch, 2 + width] int64: token, position, block table
    staging: torch.Tensor  # the same in pinned host memory: one copy per step
    logits: torch.Tensor  # [batch, vocab]


class DecodeGraphs:
    """Captures and replays the decode step of a PagedRunner (whose store has a scratch page)."""

    def __init__(self, model, store, page_size: int, scratch_page: int, blocks_mode: str):
        self.model, self.store, self.page_size = model, store, page_size
        self.scratch_page, self.blocks_mode = scratch_page, blocks_mode
        self.device = store.kv[0].device
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def _step(self, tokens, positions, tables) -> torch.Tensor:
        lengths = positions + 1
        # A graph serves sequences from half its table width up: twice the slices that fill
        # the GPU at full width keeps it filled at half width.
        num_programs = tokens.shape[0] * self.store.kv[0].shape[1]
        num_splits = 2 * num_splits_for(tables.shape[1] * self.page_size, num_programs)

        def attention(layer: int, q, kv):  # q [B, H, D], kv [2, B, Hkv, D]
            store_kv = self.store.kv[layer]
            out, _ = paged_decode_attention(
                q, store_kv[0], store_kv[1], tables, lengths, self.page_size,
                new_kv=kv, num_splits=num_splits,
            )  # fmt: skip
            return out

        return self.model.logits(self.model(tokens, positions, attention, self.blocks_mode))

    def _capture(self, batch: int, width: int) -> _Captured:
        inputs = torch.full((batch, 2 + width), self.scratch_page, device=self.device)
        inputs[:, :2] = 0
        tokens, positions, tables = inputs[:, 0], inputs[:, 1], inputs[:, 2:]
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up (compiles); writes go to the scratch page
            for _ in range(2):
                self._step(tokens, positions, tables)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._step(tokens, positions, tables)
        staging = torch.empty(inputs.shape, dtype=inputs.dtype, pin_memory=True)
        return _Captured(graph, inputs, staging, logits)

    @torch.inference_mode()
    def run(self, tokens: list[int], positions: list[int], pages: list[list[int]]) -> torch.Tensor:
        """Logits ``[len(tokens), vocab]`` of one decode step (overwritten by the next call)."""
        num_seqs = len(tokens)
        key = (bucket(num_seqs), bucket(max(map(len, pages)), MIN_WIDTH))
        if key not in self._graphs:
            self._graphs[key] = self._capture(*key)
        captured = self._graphs[key]
        batch, width = key
        scratch = self.scratch_page
        rows = [[t, p, *pg, *[scratch] * (width - len(pg))]
                for t, p, pg in zip(tokens, positions, pages, strict=True)]  # fmt: skip
        rows += [[0, 0, *[scratch] * width]] * (batch - num_seqs)
        captured.staging.copy_(torch.tensor(rows))
        captured.inputs.copy_(captured.staging, non_blocking=True)
        captured.graph.replay()
        return captured.logits[:num_seqs]
