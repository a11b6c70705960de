"""Per-sequence block tables over a PagePool: prompts with prefix reuse, growth, fork, free.

A sequence owns one :class:`BlockTable` per *head key*: ``ALL_HEADS`` (every layer and kv
head share the same pages, the default) or a ``(layer, kv_head)`` pair, so that later work
can give a head its own page list and its own length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from headspace.kv.page_pool import OutOfPages, PagePool, page_hash

ALL_HEADS = "all"


@dataclass
class BlockTable:
    """Pages of one sequence (for one head key), in logical order, and its token count."""

    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0
    hashes: list[bytes] = field(default_factory=list)  # of the leading full pages


class BlockManager:
    """Allocates and frees the pages of sequences; owns their block tables. No tensors."""

    def __init__(self, num_pages: int, page_size: int):
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.pool = PagePool(num_pages)
        self.page_size = page_size
        self.tables: dict[int, dict[str, BlockTable]] = {}

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def table(self, seq_id: int, key=ALL_HEADS) -> BlockTable:
        return self.tables[seq_id][key]

    def allocate_prompt(
        self, seq_id: int, token_ids: Sequence[int], key=ALL_HEADS, *, reuse: bool = True
    ) -> int:
        """Give ``seq_id`` pages for its prompt, reusing cached full pages of its prefix
        (unless ``reuse`` is False).

        Returns how many leading tokens are already in the pool (a multiple of the page
        size, and less than the prompt, so at least one token is computed). Raises
        OutOfPages, leaving the pool unchanged, when the rest does not fit.
        """
        assert key not in self.tables.get(seq_id, {}), f"sequence {seq_id} already has pages"
        table, parent = BlockTable(), None
        num_full = (len(token_ids) - 1) // self.page_size if reuse else 0  # last one computed
        for i in range(num_full):
            content = page_hash(parent, token_ids[i * self.page_size : (i + 1) * self.page_size])
            page = self.pool.lookup(content)
            if page is None:
                break
            table.pages.append(page)
            table.hashes.append(content)
            parent = content
        num_new = self.pages_for(len(token_ids)) - len(table.pages)
        if num_new > self.pool.num_free - self._evictable_among(table.pages):
            raise OutOfPages(f"sequence {seq_id} needs {num_new} more pages")
        for page in table.pages:
            self.pool.retain(page)
        table.pages += [self.pool.allocate() for _ in range(num_new)]
        table.num_tokens = len(token_ids)
        self.tables.setdefault(seq_id, {})[key] = table
        return len(table.hashes) * self.page_size

    def _evictable_among(self, pages: list[int]) -> int:
        return sum(1 for p in pages if self.pool.ref_counts[p] == 0)

    def append_token(self, seq_id: int, key=ALL_HEADS) -> None:
        """Room for one more token (a new page when the last one is full)."""
        table = self.table(seq_id, key)
        if table.num_tokens == len(table.pages) * self.page_size:
            table.pages.append(self.pool.allocate())
        table.num_tokens += 1

    def cache_full_pages(self, seq_id: int, token_ids: Sequence[int], key=ALL_HEADS) -> None:
        """Register the full pages of ``seq_id`` (whose K/V are now computed) for reuse."""
        table = self.table(seq_id, key)
        size = self.page_size
        num_full = min(len(token_ids), table.num_tokens) // size
        for i in range(len(table.hashes), num_full):
            parent = table.hashes[-1] if table.hashes else None
            content = page_hash(parent, token_ids[i * size : (i + 1) * size])
            self.pool.register(table.pages[i], content)
            table.hashes.append(content)

    def fork(self, seq_id: int, child_id: int, key=ALL_HEADS) -> tuple[int, int] | None:
        """Let ``child_id`` share the pages of ``seq_id``.

        Full pages are shared; a partly filled last page is copied into a new page of the
        child. Returns ``(source page, child page)`` for the caller to copy, or None.
        """
        parent = self.table(seq_id, key)
        child = BlockTable(list(parent.pages), parent.num_tokens, list(parent.hashes))
        copy = None
        if parent.num_tokens % self.page_size:
            child.pages[-1] = self.pool.allocate()
            copy = (parent.pages[-1], child.pages[-1])
        for page in child.pages[: len(child.pages) - (copy is not None)]:
            self.pool.retain(page)
        self.tables.setdefault(child_id, {})[key] = child
        return copy

    def free(self, seq_id: int) -> None:
        """Release every page of ``seq_id``; tail pages first, so they are evicted first."""
        for table in self.tables.pop(seq_id).values():
            for page in reversed(table.pages):
                self.pool.release(page)


__all__ = ["ALL_HEADS", "BlockManager", "BlockTable", "OutOfPages"]
