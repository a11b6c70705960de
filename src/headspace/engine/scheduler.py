"""Continuous batching: which sequences prefill or decode next. Pure bookkeeping, no tensors.

A waiting prompt is admitted when the pool can hold it *and* the pages every running
sequence may still need to reach its token limit, so a running batch never runs out of
pages. Finished sequences free their pages at once, which admits the next prompts.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from headspace.errors import UserError
from headspace.kv.block_table import BlockManager


@dataclass
class Sequence:
    """One request inside the engine."""

    seq_id: int
    prompt_ids: list[int]
    max_tokens: int  # prompt + generated, at most
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # leading prompt tokens found in the prefix cache
    finish_reason: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)


class Scheduler:
    """Admits waiting sequences into the running batch as pages allow."""

    def __init__(self, blocks: BlockManager, max_batch: int, prefix_caching: bool = True):
        self.blocks = blocks
        self.max_batch = max_batch
        self.prefix_caching = prefix_caching
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        """Queue a sequence; refuses one that could never fit the pool."""
        needed = self.blocks.pages_for(seq.max_tokens)
        if needed > self.blocks.pool.num_pages:
            raise UserError(
                f"a request of up to {seq.max_tokens} tokens needs {needed} KV pages but the "
                f"pool has {self.blocks.pool.num_pages}; raise the memory budget or shorten it"
            )
        self.waiting.append(seq)

    def _future_pages(self) -> int:
        """Pages the running sequences may still allocate before they hit their limits."""
        return sum(
            self.blocks.pages_for(s.max_tokens) - len(self.blocks.table(s.seq_id).pages)
            for s in self.running
        )

    def admit(self) -> Sequence | None:
        """Move the next waiting sequence into the batch if it fits; returns it (to prefill)."""
        if not self.waiting or len(self.running) >= self.max_batch:
            return None
        seq = self.waiting[0]
        pages = self.blocks.pages_for(seq.max_tokens)
        if pages + self._future_pages() > self.blocks.pool.num_free:
            return None
        seq.num_cached = self.blocks.allocate_prompt(
            seq.seq_id, seq.prompt_ids, reuse=self.prefix_caching
        )
        self.waiting.popleft()
        self.running.append(seq)
        return seq

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.running.remove(seq)
        self.blocks.free(seq.seq_id)

    @property
    def done(self) -> bool:
        return not self.waiting and not self.running
