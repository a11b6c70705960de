"""Per-entry page lists for KV budgets: every (layer, kv head) entry of a sequence owns its
pages and its length, so a head that keeps fewer tokens holds fewer pages and the rest go
back to the pool. Bookkeeping only, no tensors.

Entry ``e = layer * num_kv_heads + kv_head``. A page of this pool holds ``page_size``
tokens of one entry (K and V of one head), so a prompt of ``n`` tokens takes ``entries *
ceil(n / page_size)`` pages until it is compressed; afterwards each entry holds
``ceil(kept / page_size)`` pages and grows by one token per decode step, except a ring
entry (a ``streaming(sink, window)`` head), which stops at ``sink + window`` tokens and then
writes each new token over its oldest window token. While its prompt is prefilled, a ring
entry holds no more than its sink pages and a ring of pages that later prompt pages
overwrite (``kv.spec.prefill_ring``; ``EntryLists.wraps``), so a streaming head of a
2M-token prompt never holds the prompt. The sequence's GPU
:class:`BlockTable` lists all its pages (the scheduler counts them); its ``num_tokens`` stays
the sequence's logical length (positions), while each entry has its own length.

Offloaded entries (the head map's ``stream`` tier) hold no GPU pages: their tokens lie in
the sequence's host pages, one list shared by all of them (a host page holds a span of
slots for every entry, ``kv.host_store``), each entry's kept tokens at the front. The list
spans the longest offloaded entry, so compression gives host pages back too, and decode
streams each entry's own length only. Ring entries are never offloaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from headspace.kv.block_table import GPU, HOST, BlockManager, BlockTable, PoolLayout
from headspace.kv.page_pool import OutOfPages


@dataclass
class EntryLists:
    """One sequence's pages and kept token count per entry."""

    pages: list[list[int]]  # [entries][pages], in logical order
    lengths: list[int]  # [entries] tokens held
    compressed: bool = False
    added: list[tuple[int, int, int]] = field(default_factory=list)  # (entry, index, page)
    rings: dict[int, tuple[int, int]] = field(default_factory=dict)  # entry -> (sink, window)
    newest: list[int] = field(default_factory=list)  # [entries] index of the latest token
    host: list[int] = field(default_factory=list)  # host pages of the offloaded entries
    # until compressed, the ring entries whose prompt wraps their pages: entry -> (sink
    # pages, ring pages); logical page p >= sink pages lies in sink + (p - sink) % ring
    wraps: dict[int, tuple[int, int]] = field(default_factory=dict)
    # once compressed with every entry resident and growing: the sequence's token count at
    # which each entry's last page fills -> those entries (a step then visits only the
    # entries due a page, not all of them); None: unknown, or some entry is another kind
    due: dict[int, list[int]] | None = None

    def __post_init__(self):
        self.newest = self.newest or [n - 1 for n in self.lengths]

    def capacity(self, entry: int) -> int | None:
        """Most tokens ``entry`` holds (a ring's ``sink + window``; None: unbounded)."""
        ring = self.rings.get(entry)
        return None if ring is None else ring[0] + ring[1]

    def grows(self, entry: int) -> bool:
        """Whether one more token lengthens ``entry`` (a full ring does not)."""
        cap = self.capacity(entry)
        return cap is None or self.lengths[entry] < cap


class EntryBlockManager(BlockManager):
    """A :class:`BlockManager` whose GPU pages belong to single (layer, kv head) entries.
    No prefix reuse, no swapping: a compressed entry depends on its whole prompt."""

    per_entry = True

    def __init__(self, page_size: int, num_gpu_pages: int, num_entries: int):
        super().__init__(page_size, num_gpu_pages)
        self.num_entries = num_entries
        self.entries: dict[int, EntryLists] = {}
        self.offloaded: frozenset[int] = frozenset()
        self.rings: dict[int, tuple[int, int]] = {}  # entry -> (sink pages, ring pages)

    def reset(self, layout: PoolLayout) -> None:
        """A new GPU pool; ``layout.offloaded``: the entries kept in host pages from now on,
        ``layout.rings``: the streaming entries' prefill rings."""
        super().reset(layout)
        self.offloaded = frozenset(layout.offloaded)
        self.rings = {entry: (sink, ring) for entry, sink, ring in layout.rings}

    def _resident(self, entry: int) -> bool:
        return entry not in self.offloaded

    def _prompt_pages(self, entry: int, pages: int) -> int:
        """GPU pages ``entry`` takes for a prompt of ``pages`` pages (a ring: at most its
        sink and ring)."""
        return min(pages, sum(self.rings.get(entry, (pages, 0))))

    def pages_for(self, num_tokens: int) -> int:
        """GPU pages of an uncompressed sequence of ``num_tokens`` (every resident entry
        holds them all, a ring entry at most its prefill ring)."""
        pages = super().pages_for(num_tokens)
        if not self.rings:
            return (self.num_entries - len(self.offloaded)) * pages
        return sum(self._prompt_pages(e, pages) for e in range(self.num_entries)
                   if self._resident(e))  # fmt: skip

    def held(self, seq_id: int) -> tuple[int, int]:
        """(tokens ``seq_id``'s entries hold, summed over entries; what they would hold
        uncompressed)."""
        lengths = self.entries[seq_id].lengths
        return sum(lengths), len(lengths) * self.table(seq_id).num_tokens

    def host_pages(self, seq_id: int) -> list[int]:
        """The host pages of ``seq_id``'s offloaded entries, in logical order."""
        return self.entries[seq_id].host

    def future_pages(self, seq_id: int, max_tokens: int) -> int:
        """Pages ``seq_id`` may still take before it reaches ``max_tokens`` tokens."""
        lists = self.entries[seq_id]
        if not lists.compressed:
            return super().future_pages(seq_id, max_tokens)
        more = max_tokens - self.tables[seq_id][GPU].num_tokens
        size, total = self.page_size, 0
        for e, (length, pages) in enumerate(zip(lists.lengths, lists.pages, strict=True)):
            cap = lists.capacity(e)
            if self._resident(e):
                total += -(-min(length + more, cap or length + more) // size) - len(pages)
        return total

    def allocate_prompt(self, seq_id: int, token_ids: Sequence[int], tiers=(GPU,), *,
                        reuse: bool = False) -> int:  # fmt: skip
        """Pages for the whole prompt in every entry: GPU pages for each resident one, host
        pages shared by the offloaded ones (nothing is reused: returns 0)."""
        assert seq_id not in self.tables, f"sequence {seq_id} already has pages"
        if tuple(tiers) != (GPU,):
            raise ValueError("per-entry pages are planned by entry, not by tier")
        per_entry = super().pages_for(len(token_ids))
        pool, host = self.pools[GPU], self.pools[HOST]
        if self.pages_for(len(token_ids)) > pool.num_free:
            raise OutOfPages(f"sequence {seq_id} needs {self.pages_for(len(token_ids))} pages")
        if self.offloaded and per_entry > host.num_free:
            raise OutOfPages(f"sequence {seq_id} needs {per_entry} host pages")
        pages = [[pool.allocate() for _ in range(self._prompt_pages(e, per_entry))]
                 if self._resident(e) else [] for e in range(self.num_entries)]  # fmt: skip
        hosted = sorted(host.allocate() for _ in range(per_entry)) if self.offloaded else []
        wraps = {e: ring for e, ring in self.rings.items() if sum(ring) < per_entry}
        self.entries[seq_id] = EntryLists(pages, [len(token_ids)] * self.num_entries,
                                          host=hosted, wraps=wraps)  # fmt: skip
        self.tables[seq_id] = {GPU: BlockTable(_flat(pages), len(token_ids))}
        return 0

    def pages_needed(self, seq_id: int) -> int:
        """New GPU pages one more token of ``seq_id`` takes (one per full, growing resident
        entry)."""
        lists = self.entries[seq_id]
        if lists.due is not None:
            return len(lists.due.get(self.tables[seq_id][GPU].num_tokens, ()))
        return sum(length == len(pages) * self.page_size and lists.grows(e) and self._resident(e)
                   for e, (length, pages) in enumerate(zip(lists.lengths, lists.pages,
                                                           strict=True)))  # fmt: skip

    def needs_page(self, seq_id: int) -> bool:
        return self.pages_needed(seq_id) > 0

    def append_token(self, seq_id: int) -> None:
        """Room for one more token in every entry. Raises OutOfPages, changing nothing,
        when the pool has too few pages."""
        lists, pool = self.entries[seq_id], self.pools[GPU]
        if lists.due is not None:
            return self._append_due(seq_id, lists, self.tables[seq_id][GPU])
        if self.pages_needed(seq_id) > pool.num_free:
            raise OutOfPages(f"no free page for sequence {seq_id}")
        longest = max((lists.lengths[e] for e in self.offloaded), default=0)
        host_page = longest == len(lists.host) * self.page_size and self.offloaded
        if host_page and self.pools[HOST].num_free == 0:
            raise OutOfPages(f"no free host page for sequence {seq_id}")
        if host_page:
            lists.host.append(self.pools[HOST].allocate())
        table = self.tables[seq_id][GPU]  # its pages in no particular order after compress
        for e, pages in enumerate(lists.pages):
            if not self._resident(e):  # in the host pages
                lists.newest[e] = lists.lengths[e]
                lists.lengths[e] += 1
                continue
            if not lists.grows(e):  # a full ring: over its oldest window token
                sink, window = lists.rings[e]
                lists.newest[e] = sink + (lists.newest[e] + 1 - sink) % window
                continue
            if lists.lengths[e] == len(pages) * self.page_size:
                lists.added.append((e, len(pages), pool.allocate()))
                pages.append(lists.added[-1][2])
                table.pages.append(pages[-1])
            lists.newest[e] = lists.lengths[e]
            lists.lengths[e] += 1
        table.num_tokens += 1
        if lists.compressed and not (self.offloaded or lists.rings):  # from now on by due
            lists.due = {}
            for e, (n, pages) in enumerate(zip(lists.lengths, lists.pages, strict=True)):
                lists.due.setdefault(table.num_tokens + len(pages) * self.page_size - n,
                                     []).append(e)  # fmt: skip

    def _append_due(self, seq_id: int, lists: EntryLists, table: BlockTable) -> None:
        """One more token in every entry (all resident and growing): a page for each entry
        whose last page is full (due now, then again a page later), the lengths shifted."""
        pool, size = self.pools[GPU], self.page_size
        due = lists.due.get(table.num_tokens, [])
        if len(due) > pool.num_free:
            raise OutOfPages(f"no free page for sequence {seq_id}")
        for e in due:
            lists.added.append((e, len(lists.pages[e]), pool.allocate()))
            lists.pages[e].append(lists.added[-1][2])
            table.pages.append(lists.added[-1][2])
        if due:  # their next pages fill a page later
            del lists.due[table.num_tokens]
            lists.due.setdefault(table.num_tokens + size, []).extend(due)
        lists.newest, lists.lengths = lists.lengths, [n + 1 for n in lists.lengths]
        table.num_tokens += 1

    def compress(self, seq_id: int, kept: Sequence[int],
                 rings: dict[int, tuple[int, int]] | None = None) -> list[int]:  # fmt: skip
        """Entry ``e`` now holds its first ``kept[e]`` tokens (the caller moved them to the
        front, oldest first); the pages past them return to the pool. ``rings`` makes
        entries rings of ``(sink, window)`` (at most ``sink + window`` kept). Returns the
        freed pages."""
        lists, pool = self.entries[seq_id], self.pools[GPU]
        if len(kept) != self.num_entries:
            raise ValueError(f"{len(kept)} kept counts for {self.num_entries} entries")
        for e, (sink, window) in (rings or {}).items():
            if window < 1 or sink < 0 or kept[e] > sink + window or not self._resident(e):
                raise ValueError(f"entry {e} keeps {kept[e]} tokens in a ring of {sink}+{window}"
                                 " (rings stay resident)")  # fmt: skip
        for e, (sink_pages, ring_pages) in lists.wraps.items():  # kept first: pages unwrap
            if -(-kept[e] // self.page_size) > sink_pages + ring_pages:
                raise ValueError(f"entry {e} keeps {kept[e]} tokens of a wrapped prompt")
        freed = []
        for e, count in enumerate(kept):
            if not 0 <= count <= lists.lengths[e]:
                raise ValueError(f"entry {e} keeps {count} of {lists.lengths[e]} tokens")
            num_pages = -(-count // self.page_size)
            freed += reversed(lists.pages[e][num_pages:])
            lists.pages[e], lists.lengths[e] = lists.pages[e][:num_pages], count
        for page in freed:
            pool.release(page)
        longest = max((kept[e] for e in self.offloaded), default=0)
        num_host = -(-longest // self.page_size)
        for page in reversed(lists.host[num_host:]):
            self.pools[HOST].release(page)
        lists.host = lists.host[:num_host]
        lists.compressed, lists.added, lists.rings = True, [], dict(rings or {})
        lists.due = None  # found again at the next token
        lists.wraps = {}
        lists.newest = [n - 1 for n in lists.lengths]
        self.tables[seq_id][GPU].pages = _flat(lists.pages)
        return freed

    def has_pages_to_cache(self, seq_id: int, num_known_tokens: int) -> bool:
        return False

    def cache_full_pages(self, seq_id: int, token_ids: Sequence[int]) -> None:
        pass

    def _move(self, seq_id: int, source: str, target: str) -> list[tuple[int, int]]:
        raise OutOfPages("sequences under a KV budget are not swapped")

    def free(self, seq_id: int) -> None:
        lists = self.entries.pop(seq_id, None)
        for page in reversed(lists.host if lists else []):
            self.pools[HOST].release(page)
        super().free(seq_id)


def _flat(pages: list[list[int]]) -> list[int]:
    return [page for entry in pages for page in entry]


__all__ = ["EntryBlockManager", "EntryLists"]


def block_manager(page_size: int, num_entries: int | None) -> BlockManager:
    """The block manager of a KV arena: pages shared by every (layer, kv head), or with
    ``num_entries`` each entry in pages of its own."""
    if num_entries is None:
        return BlockManager(page_size, 0)
    return EntryBlockManager(page_size, 0, num_entries)
