"""Bookkeeping of the paged KV pool: pages, reference counts, prefix cache. No tensors.

A *page* holds ``page_size`` consecutive tokens of one sequence in every layer. Pages are
handed out from a free list in O(1); a page filled with a known token prefix is registered
under a hash chained with the hash of the page before it, so a later sequence with the same
prefix reuses it instead of recomputing it. Pages whose reference count drops to zero stay
cached (evictable, least recently released first) until the free list runs dry.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence


class OutOfPages(RuntimeError):
    """The pool has no free or evictable page left."""


def page_hash(parent: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Content hash of one full page, chained with the hash of the prefix before it."""
    digest = hashlib.blake2b(parent or b"root", digest_size=16)
    digest.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in token_ids))
    return digest.digest()


class PagePool:
    """Free list, reference counts and the prefix-hash table of ``num_pages`` pages."""

    def __init__(self, num_pages: int):
        if num_pages < 0:
            raise ValueError(f"a page pool cannot have {num_pages} pages")
        self.num_pages = num_pages
        self.ref_counts = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))  # never-cached pages, FIFO
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU
        self._page_by_hash: dict[bytes, int] = {}
        self._hash_by_page: dict[int, bytes] = {}

    def renumbered(self, num_pages: int, mapping: dict[int, int]) -> PagePool:
        """A pool of ``num_pages`` pages in which each held page ``p`` of this one is page
        ``mapping[p]`` (same holders, same cached prefix); unreferenced cached pages are
        forgotten."""
        pool = PagePool(num_pages)
        for old, new in mapping.items():
            pool.ref_counts[new] = self.ref_counts[old]
            content = self._hash_by_page.get(old)
            if content is not None:
                pool._page_by_hash[content], pool._hash_by_page[new] = new, content
        held = set(mapping.values())
        pool._free = deque(p for p in range(num_pages) if p not in held)
        return pool

    def grow(self, num_pages: int) -> None:
        """Add pages ``self.num_pages .. num_pages - 1`` (free) to the pool."""
        assert num_pages >= self.num_pages
        self._free.extend(range(self.num_pages, num_pages))
        self.ref_counts += [0] * (num_pages - self.num_pages)
        self.num_pages = num_pages

    def shrink(self, num_pages: int) -> None:
        """Drop pages ``num_pages ..`` from the pool (each free: none held or cached), as
        when their memory could not be had after all."""
        gone = range(num_pages, self.num_pages)
        assert all(self.ref_counts[p] == 0 and p not in self._hash_by_page for p in gone)
        self._free = deque(p for p in self._free if p < num_pages)
        del self.ref_counts[num_pages:]
        self.num_pages = min(self.num_pages, num_pages)

    def drop_cache(self) -> None:
        """Forget every cached prefix: unreferenced cached pages become free."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._page_by_hash.clear()
        self._hash_by_page.clear()

    @property
    def num_kept(self) -> int:
        """Pages whose contents matter: held by a sequence or kept by the prefix cache."""
        return self.num_pages - len(self._free)

    @property
    def num_free(self) -> int:
        """Pages that ``allocate`` can hand out (free or evictable)."""
        return len(self._free) + len(self._evictable)

    def allocate(self) -> int:
        """A page with reference count 1: a free one, else the least recently released cached."""
        if self._free:
            page = self._free.popleft()
        elif self._evictable:
            page, _ = self._evictable.popitem(last=False)
            del self._page_by_hash[self._hash_by_page.pop(page)]
        else:
            raise OutOfPages("no free page left in the KV pool")
        assert self.ref_counts[page] == 0
        self.ref_counts[page] = 1
        return page

    def allocate_below(self, num_pages: int) -> int | None:
        """A free (never cached) page below ``num_pages`` with reference count 1 (None:
        there is none)."""
        page = next((p for p in self._free if p < num_pages), None)
        if page is not None:
            self._free.remove(page)
            self.ref_counts[page] = 1
        return page

    def retain(self, page: int) -> None:
        """One more holder of ``page`` (a prefix-cache hit or a fork)."""
        if self.ref_counts[page] == 0:
            assert page in self._evictable, "retaining a page that is neither held nor cached"
            del self._evictable[page]
        self.ref_counts[page] += 1

    def release(self, page: int) -> None:
        """One holder fewer; at zero the page becomes evictable (if cached) or free."""
        assert self.ref_counts[page] > 0, f"page {page} released more often than held"
        self.ref_counts[page] -= 1
        if self.ref_counts[page] == 0:
            if page in self._hash_by_page:
                self._evictable[page] = None
            else:
                self._free.append(page)

    def is_cached(self, page: int) -> bool:
        """Whether ``page`` holds a cached prefix (held or not)."""
        return page in self._hash_by_page

    def lookup(self, content_hash: bytes) -> int | None:
        """The cached page holding this content, if any."""
        return self._page_by_hash.get(content_hash)

    def register(self, page: int, content_hash: bytes) -> None:
        """Record that held ``page`` is full with this content (first registration wins)."""
        assert self.ref_counts[page] > 0
        if content_hash not in self._page_by_hash and page not in self._hash_by_page:
            self._page_by_hash[content_hash] = page
            self._hash_by_page[page] = content_hash
