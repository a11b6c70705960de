"""Per-sequence block tables over the two page pools: prompts with prefix reuse, growth,
swapping between tiers, free. Bookkeeping only, no tensors.

A sequence owns one :class:`BlockTable` per *tier* it occupies: ``GPU`` (pages of the GPU
pool, holding the resident (layer, kv head) entries) and ``HOST`` (pages of the host pool,
holding every entry; streamed entries live only there). Both tables list the sequence's
pages in logical order, so logical page ``i`` of a sequence is ``table.pages[i]`` in each
tier. A swapped-out sequence has only a host table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from headspace.kv.page_pool import OutOfPages, PagePool, page_hash

GPU, HOST = "gpu", "host"
Pages = dict[str, list[list[int]]]  # per tier, each sequence's pages in logical order


@dataclass(frozen=True)
class PoolLayout:
    """How a layout of the arena splits the page pools: ``num_gpu_pages`` GPU pages; with
    per-entry pages, the entries (numbered layer by layer) whose pages are host pages and
    the streaming entries' prefill rings (entry, sink pages, ring pages:
    :func:`~headspace.kv.spec.prefill_ring`); whether the host pages' cached prefixes are
    forgotten (the streamed entries changed)."""

    num_gpu_pages: int
    offloaded: tuple[int, ...] = ()
    drop_host_cache: bool = True
    rings: tuple[tuple[int, int, int], ...] = ()


@dataclass
class BlockTable:
    """Pages of one sequence in one tier, in logical order, and its token count."""

    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0
    hashes: list[bytes] = field(default_factory=list)  # of the leading full pages


class BlockManager:
    """Allocates and frees the pages of sequences in both tiers; owns their block tables."""

    per_entry = False  # pages hold every entry of a sequence (see EntryBlockManager)

    def __init__(self, page_size: int, num_gpu_pages: int, num_host_pages: int = 0):
        if page_size < 1:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.page_size = page_size
        self.pools = {GPU: PagePool(num_gpu_pages), HOST: PagePool(num_host_pages)}
        self.tables: dict[int, dict[str, BlockTable]] = {}

    @property
    def pool(self) -> PagePool:
        """The GPU pool."""
        return self.pools[GPU]

    def reset(self, layout: PoolLayout) -> None:
        """A new GPU pool (a new layout of the GPU arena); no sequence may hold GPU pages
        (sequences swapped out to host pages stay). Host pages keep their data; their cached
        prefixes are forgotten unless the streamed entries stay the same
        (``layout.drop_host_cache`` False)."""
        assert all(GPU not in tables for tables in self.tables.values()), \
            "the layout can change only when no sequence holds GPU pages"  # fmt: skip
        self.pools[GPU] = PagePool(layout.num_gpu_pages)
        if layout.drop_host_cache:
            self.pools[HOST].drop_cache()

    def resize_gpu(self, num_pages: int) -> tuple[list[tuple[int, int]], int]:
        """A GPU pool of ``num_pages`` pages under the sequences that hold GPU pages: a held
        page at or past the new end takes a free number below it (the cached prefixes of
        held pages stay; unreferenced cached pages are forgotten when the pool shrinks).
        Returns the (old, new) page pairs the caller copies, and the pages below which every
        page whose content is kept lies (held ones; when the pool grows, the unreferenced
        cached ones too, which stay in the cache). Raises OutOfPages, changing nothing, when
        the held pages do not fit."""
        pool = self.pools[GPU]
        held = [p for p in range(pool.num_pages) if pool.ref_counts[p] > 0]
        if len(held) > num_pages:
            raise OutOfPages(f"{len(held)} GPU pages are held, more than {num_pages}")
        if num_pages >= pool.num_pages:  # nothing renumbered; the layout moves what is kept
            kept = [p for p in range(pool.num_pages) if pool.ref_counts[p] > 0
                    or pool.is_cached(p)]  # fmt: skip
            pool.grow(num_pages)
            return [], max(kept, default=-1) + 1
        taken = {p for p in held if p < num_pages}
        free = (p for p in range(num_pages) if p not in taken)
        mapping = {p: p if p < num_pages else next(free) for p in held}
        self.pools[GPU] = pool.renumbered(num_pages, mapping)
        for tables in self.tables.values():
            if GPU in tables:  # (the lists themselves: step plans hold them)
                pages = tables[GPU].pages
                pages[:] = [mapping[p] for p in pages]
        moves = [(old, new) for old, new in mapping.items() if old != new]
        return moves, max(mapping.values(), default=-1) + 1

    def grow_host(self, num_pages: int) -> None:
        self.pools[HOST].grow(num_pages)

    def reset_host(self, num_pages: int) -> None:
        """A new host pool of ``num_pages`` free pages (its arena was laid out anew); no
        sequence may hold host pages."""
        pool = self.pools[HOST]
        assert pool.num_free == pool.num_pages, "host pages in use"
        self.pools[HOST] = PagePool(num_pages)

    def holding_host_past(self, num_pages: int) -> set[int]:
        """The sequences that hold a host page at or past ``num_pages``."""
        return {seq_id for seq_id, tables in self.tables.items()
                if HOST in tables and max(tables[HOST].pages, default=-1) >= num_pages}  # fmt: skip

    def host_pages_below(self, seq_id: int, num_pages: int) -> bool:
        """Move the host pages of ``seq_id`` at or past ``num_pages`` (just handed out:
        nothing is written in them yet) to free pages below it; False, and nothing moved,
        where too few are free."""
        pool, pages = self.pools[HOST], self.tables[seq_id][HOST].pages
        moved = [i for i, page in enumerate(pages) if page >= num_pages]
        taken = []
        for _ in moved:
            page = pool.allocate_below(num_pages)
            if page is None:
                for page in taken:
                    pool.release(page)
                return False
            taken.append(page)
        for i, page in zip(moved, taken, strict=True):
            pool.release(pages[i])
            pages[i] = page  # (the list itself: step plans hold it)
        return True

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def table(self, seq_id: int, tier: str = GPU) -> BlockTable:
        return self.tables[seq_id][tier]

    def tiers(self, seq_id: int) -> list[str]:
        return list(self.tables.get(seq_id, {}))

    def pages(self, seq_ids: list[int]) -> Pages:
        """The page lists of ``seq_ids`` (all in the same tiers) per tier, as they stand
        (the lists themselves: they grow with their sequences)."""
        tiers = self.tiers(seq_ids[0])
        return {tier: [self.tables[s][tier].pages for s in seq_ids] for tier in tiers}

    def _prefix_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """Chained hashes of the full pages that may be reused (the last token is always
        computed, so its page never is)."""
        hashes, parent = [], None
        for i in range((len(token_ids) - 1) // self.page_size):
            parent = page_hash(parent, token_ids[i * self.page_size : (i + 1) * self.page_size])
            hashes.append(parent)
        return hashes

    def _hits(self, tier: str, hashes: list[bytes]) -> list[int]:
        pages = []
        for content in hashes:
            page = self.pools[tier].lookup(content)
            if page is None:
                break
            pages.append(page)
        return pages

    def allocate_prompt(self, seq_id: int, token_ids: Sequence[int], tiers=(GPU,), *,
                        reuse: bool = True) -> int:  # fmt: skip
        """Give ``seq_id`` pages for its prompt in each of ``tiers``, reusing cached full
        pages of its prefix (found in every tier) unless ``reuse`` is False.

        Returns how many leading tokens are already computed (a multiple of the page size,
        less than the prompt). Raises OutOfPages, leaving the pools unchanged, when the
        rest does not fit.
        """
        assert seq_id not in self.tables, f"sequence {seq_id} already has pages"
        hashes = self._prefix_hashes(token_ids) if reuse else []
        hits = {tier: self._hits(tier, hashes) for tier in tiers}
        num_hits = min((len(pages) for pages in hits.values()), default=0)
        num_pages = self.pages_for(len(token_ids))
        for tier in tiers:
            pool, reused = self.pools[tier], hits[tier][:num_hits]
            evictable = sum(1 for p in reused if pool.ref_counts[p] == 0)
            if num_pages - num_hits > pool.num_free - evictable:
                raise OutOfPages(f"sequence {seq_id} needs {num_pages - num_hits} more pages")
        tables = {}
        for tier in tiers:
            pool, reused = self.pools[tier], hits[tier][:num_hits]
            for page in reused:
                pool.retain(page)
            new = [pool.allocate() for _ in range(num_pages - num_hits)]
            if tier == HOST:  # ascending: adjacent host pages are copied in one piece
                new.sort()
            pages = reused + new
            tables[tier] = BlockTable(pages, len(token_ids), list(hashes[:num_hits]))
        self.tables[seq_id] = tables
        return num_hits * self.page_size

    def future_pages(self, seq_id: int, max_tokens: int) -> int:
        """Pages ``seq_id`` may still take before it reaches ``max_tokens`` tokens."""
        table = next(iter(self.tables[seq_id].values()))
        return self.pages_for(max_tokens) - len(table.pages)

    def pages_needed(self, seq_id: int) -> int:
        """New pages (per tier) one more token of ``seq_id`` takes."""
        return int(self.needs_page(seq_id))

    def needs_page(self, seq_id: int) -> bool:
        """Whether one more token of ``seq_id`` starts a new page."""
        table = next(iter(self.tables[seq_id].values()))
        return table.num_tokens == len(table.pages) * self.page_size

    def append_token(self, seq_id: int) -> None:
        """Room for one more token in every tier (a new page when the last one is full).
        Raises OutOfPages, changing nothing, when a tier has no page left."""
        tables = self.tables[seq_id]
        if self.needs_page(seq_id):
            if any(self.pools[tier].num_free == 0 for tier in tables):
                raise OutOfPages(f"no free page for sequence {seq_id}")
            for tier, table in tables.items():
                table.pages.append(self.pools[tier].allocate())
        for table in tables.values():
            table.num_tokens += 1

    def has_pages_to_cache(self, seq_id: int, num_known_tokens: int) -> bool:
        """Whether a page of ``seq_id`` became full (of known tokens) since the last
        registration: a cheap check before building the token list for it."""
        table = next(iter(self.tables[seq_id].values()))
        return min(num_known_tokens, table.num_tokens) // self.page_size > len(table.hashes)

    def cache_full_pages(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Register the full pages of ``seq_id`` (whose K/V are computed) for reuse."""
        size = self.page_size
        for tier, table in self.tables[seq_id].items():
            num_full = min(len(token_ids), table.num_tokens) // size
            for i in range(len(table.hashes), num_full):
                parent = table.hashes[-1] if table.hashes else None
                content = page_hash(parent, token_ids[i * size : (i + 1) * size])
                self.pools[tier].register(table.pages[i], content)
                table.hashes.append(content)

    def swap_out(self, seq_id: int) -> list[tuple[int, int]]:
        """Move ``seq_id`` from the GPU pool to host pages: returns (GPU page, host page)
        pairs whose data the caller copies before the GPU pages are reused (same stream).
        Raises OutOfPages when the host pool cannot hold it."""
        return self._move(seq_id, GPU, HOST)

    def swap_in(self, seq_id: int) -> list[tuple[int, int]]:
        """Move a swapped-out ``seq_id`` back into the GPU pool: (host page, GPU page) pairs.
        Raises OutOfPages when the GPU pool cannot hold it."""
        return self._move(seq_id, HOST, GPU)

    def attach(self, seq_id: int) -> list[tuple[int, int]]:
        """Give a swapped-out ``seq_id`` GPU pages for its tokens beside its host pages (a
        layout that streams heads: the resident entries in GPU pages, every entry in host
        pages): (host page, GPU page) pairs whose resident entries the caller copies.
        Raises OutOfPages when the GPU pool cannot hold it."""
        host, pool = self.tables[seq_id][HOST], self.pools[GPU]
        if len(host.pages) > pool.num_free:
            raise OutOfPages(f"the GPU pool cannot hold sequence {seq_id}")
        gpu = BlockTable([pool.allocate() for _ in host.pages], host.num_tokens)
        self.tables[seq_id] = {GPU: gpu, HOST: host}
        return list(zip(host.pages, gpu.pages, strict=True))

    def detach(self, seq_id: int) -> list[tuple[int, int]]:
        """Release the GPU pages of ``seq_id``, held in both tiers (a layout that streams
        heads), keeping its host pages: (GPU page, host page) pairs whose resident entries
        the caller copies first, so that its host pages hold every entry (as a swapped-out
        sequence's do). No pairs when it holds no GPU pages (a layout that streams every
        head)."""
        if GPU not in self.tables[seq_id]:
            return []
        gpu, host = self.tables[seq_id][GPU], self.tables[seq_id][HOST]
        pairs = list(zip(gpu.pages, host.pages, strict=True))
        for page in reversed(gpu.pages):
            self.pools[GPU].release(page)
        self.tables[seq_id] = {HOST: host}
        return pairs

    def _move(self, seq_id: int, source: str, target: str) -> list[tuple[int, int]]:
        old, pool = self.tables[seq_id][source], self.pools[target]
        if len(old.pages) > pool.num_free:
            raise OutOfPages(f"the {target} pool cannot hold sequence {seq_id}")
        new = BlockTable(sorted(pool.allocate() for _ in old.pages), old.num_tokens)
        pairs = list(zip(old.pages, new.pages, strict=True))
        for page in reversed(old.pages):
            self.pools[source].release(page)
        self.tables[seq_id] = {target: new}
        return pairs

    def free(self, seq_id: int) -> None:
        """Release every page of ``seq_id``; tail pages first, so they are evicted first."""
        for tier, table in self.tables.pop(seq_id).items():
            for page in reversed(table.pages):
                self.pools[tier].release(page)


__all__ = ["GPU", "HOST", "BlockManager", "BlockTable", "OutOfPages"]
