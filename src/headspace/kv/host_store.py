"""Host pages: one page-locked arena ``[layers, rows, 2, num_pages * page_size, head_dim]``.

Host page ``p`` holds tokens ``p * page_size ..`` of one sequence for *every* (layer, kv
head) entry, so a whole sequence can be swapped out and any entry can stream without a new
layout (``rows`` = kv heads). Per-entry pages (budgets, streaming heads) offload single
entries: their arena holds only as many rows a layer as the layout offloads at most.
Within an entry a page's K (or V) is one contiguous ``[page_size, head_dim]`` block
and a sequence's consecutive pages are adjacent: a CPU thread attends over them in place,
and GPU kernels read and write them through unified addressing (see ``kv.transfer``).

The arena is one buffer, page-locked by registering it with CUDA (torch's pinned allocator
rounds every allocation up to a power of two). It is allocated when a batch first needs host
pages, with half again as many spare (within the budget) for requests that join later, and
grows when a larger batch needs more: copying what it holds, the old and the new arena both
counted against the budget, or freeing the old one first when no page matters.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable

import torch

from headspace.errors import UserError
from headspace.kv.spec import KVSpec, byte_size
from headspace.model.llama import DEVICE_LOCK

log = logging.getLogger("headspace.kv")


class HostLedger:
    """A host budget (``total`` bytes, None: no bound) that several arenas share (one per
    lane): each may hold what the others leave, counting what each has claimed for a growth
    planned but not yet made (lanes schedule on their own threads: a claim is checked and
    made under ``lock``, so two lanes never plan the same bytes). It holds its arenas weakly
    (an arena holds its ledger): an engine dropped frees their page-locked memory by
    reference counts, with no collection, as a server whose heap is frozen after its
    warm-up needs."""

    def __init__(self, total: int | None):
        self.total = total
        self.arenas: weakref.WeakSet[HostKVArena] = weakref.WeakSet()
        self.lock = threading.Lock()

    def left_for(self, arena: HostKVArena) -> int | None:
        """Bytes ``arena`` may hold beside the others and their claims (None: no bound)."""
        if self.total is None:
            return None
        others = sum(max(a.num_bytes, a.claimed) for a in self.arenas if a is not arena)
        return max(self.total - others, 0)


class HostKVArena:
    """The host tier's pages (``data`` is None until the first page is needed): ``num_pages``
    for sequences and one scratch page after them (padded rows of a CUDA-graph step write
    there). ``budget``: its bytes at most (None: no bound), or a :class:`HostLedger` it
    shares with other arenas."""

    def __init__(self, spec: KVSpec, dtype: torch.dtype, *, pin: bool,
                 budget: int | None | HostLedger):  # fmt: skip
        self.spec, self.dtype, self.pin = spec, dtype, pin
        self.ledger = budget if isinstance(budget, HostLedger) else HostLedger(budget)
        self.ledger.arenas.add(self)
        self.data: torch.Tensor | None = None
        self.num_pages = 0
        self.rows = spec.num_kv_heads  # kv heads a layer's page holds
        self.generation = 0  # counts reallocations (captured pointers go stale)
        self.claimed = 0  # bytes a planned growth will hold at most (0: none planned)

    @property
    def budget(self) -> int | None:
        """Bytes this arena may hold (what the ledger's other arenas leave)."""
        return self.ledger.left_for(self)

    def claim(self, num_pages: int, rows: int | None = None, keep: bool = True,
              agree: Callable[[int], int] | None = None) -> bool:  # fmt: skip
        """Whether the arena may grow to ``num_pages`` pages (of ``rows`` kv heads a layer;
        default: as now) within what the other arenas hold and claim; if so, the bytes are
        claimed until the growth is made (:meth:`ensure`), so no other lane plans them
        meanwhile. ``keep``: its pages are copied over, the old arena counted while they
        are (new rows: never); else it is freed first. ``agree``: the most pages every rank
        may hold, from this rank's (under torchrun; called once a claim, on every rank)."""
        new_rows = rows is not None and rows != self.rows
        page_bytes = self.spec.host_page_bytes(rows) if new_rows else self.page_bytes
        held = self.num_bytes if keep and not new_rows else 0
        with self.ledger.lock:
            most = self._room(held, page_bytes)
            if not new_rows:  # what it holds needs no room
                most = max(most, self.num_pages)
            most = most if agree is None else agree(most)
            if num_pages > most:
                return False
            if new_rows or num_pages > self.num_pages:
                self.claimed = max(self.claimed, held + (num_pages + 1) * page_bytes)
            return True

    def _room(self, held: int, page_bytes: int) -> int:
        """The most pages of ``page_bytes`` (and the scratch page) the budget leaves beside
        ``held`` bytes of this arena (read under the ledger's lock)."""
        budget = self.budget
        return (1 << 40) if budget is None else (budget - held) // page_bytes - 1

    def _end_claim(self) -> None:
        """The claimed growth was made or refused: its bytes go back to the ledger (under
        its lock, after the new arena is in place, so no reader sees neither)."""
        with self.ledger.lock:
            self.claimed = 0

    @property
    def page_bytes(self) -> int:
        """Bytes of one host page (K and V of its rows in every layer)."""
        return self.spec.host_page_bytes(self.rows)

    @property
    def num_bytes(self) -> int:
        data = self.data  # (read once: another thread may be reallocating it)
        return data.nbytes if data is not None else 0

    @property
    def scratch_slot(self) -> int:
        return self.num_pages * self.spec.page_size

    def ensure(self, num_pages: int, *, keep: bool = True, rows: int | None = None) -> bool:
        """See :meth:`_ensure`; under the device lock (it may synchronise the device and
        page-lock memory, which another thread's CUDA-graph capture must not meet)."""
        with DEVICE_LOCK:
            return self._ensure(num_pages, keep=keep, rows=rows)

    def _ensure(self, num_pages: int, *, keep: bool = True, rows: int | None = None) -> bool:
        """Hold at least ``num_pages`` pages; returns whether the arena was reallocated.
        It takes up to half again as many, within the budget, so that requests joining
        later need no copy. ``keep``: the old pages are copied over, and both arenas
        count against the budget while the copy runs; else the old one is freed first.
        ``rows``: kv heads a layer's page holds from now on (default: as before; a new
        number drops the arena first, and leaves it empty if the new one fails). Raises
        UserError beyond the host budget."""
        if rows is not None and rows != self.rows:
            assert not keep, "host pages change rows only when none holds data"
            if self.data is not None and self.pin:  # queued copies may read old pages
                torch.cuda.synchronize()
            self.data, self.num_pages, self.rows = None, 0, rows
        if num_pages <= self.num_pages:
            self._end_claim()
            return False
        try:
            grown = self._claim_growth(num_pages, keep)
            self._reallocate(grown, keep)
        finally:
            self._end_claim()
        return True

    def _claim_growth(self, num_pages: int, keep: bool) -> int:
        """The pages to grow to for ``num_pages`` (up to half again, within what the other
        arenas hold and claim), its bytes claimed under the ledger's lock while the arena
        is allocated. Raises UserError beyond the host budget."""
        grown = num_pages + num_pages // 2
        held = self.num_bytes if keep else 0  # both live while pages are copied
        with self.ledger.lock:
            limit = self._room(held, self.page_bytes)
            if num_pages > limit:
                raise UserError(self._over_budget(num_pages, held, self.budget))
            grown = min(grown, limit)
            self.claimed = held + (grown + 1) * self.page_bytes
        return grown

    def _reallocate(self, grown: int, keep: bool) -> None:
        """A page-locked arena of ``grown`` pages in place of this one (its pages copied
        over when ``keep``, else the old one freed first)."""
        started = time.perf_counter()
        if self.data is not None and self.pin:  # queued copies may read or write old pages
            torch.cuda.synchronize()
        waited = time.perf_counter() - started
        if keep:
            self._allocate(grown)
        else:
            old_pages, self.data, self.num_pages = self.num_pages, None, 0  # freed first
            try:
                self._allocate(grown)
            except BaseException:
                if old_pages:  # the pool still hands out the old pages: hold them again
                    self._allocate(old_pages)
                raise
        log.info("host KV arena: %s for %d tokens in %.2f s (%.2f s waiting for the device)",
                 byte_size(self.num_bytes), grown * self.spec.page_size,
                 time.perf_counter() - started, waited)  # fmt: skip

    def _allocate(self, num_pages: int) -> None:
        """A page-locked arena of ``num_pages`` pages (+ scratch) in place of the current
        one, whose pages are copied over (this one is kept if it fails)."""
        spec = self.spec
        shape = (spec.num_layers, self.rows, 2, (num_pages + 1) * spec.page_size,
                 spec.head_dim)  # fmt: skip
        data = torch.zeros(shape, dtype=self.dtype)  # a parallel fill touches every page
        if self.data is not None:
            data[..., : self.data.shape[3], :].copy_(self.data)
        if self.pin and data.numel() > 0:
            page_lock(data, "KV pages", "lower --host-memory, the context, or")
        self.data, self.num_pages = data, num_pages
        self.generation += 1

    def _over_budget(self, num_pages: int, held: int, budget: int) -> str:
        spec = self.spec
        need = f"{byte_size(num_pages * self.page_bytes)}"
        if held:
            need += f" beside the {byte_size(held)} arena they are copied from"
        return (f"host pages for {num_pages * spec.page_size} tokens need {need}, more "
                f"than the {byte_size(budget)} host budget (--host-memory)")  # fmt: skip

    def layer(self, layer: int) -> torch.Tensor:
        """``[rows, 2, slots, head_dim]`` of one layer (a view)."""
        return self.data[layer]


def page_lock(buffer: torch.Tensor, what: str, remedy: str) -> None:
    """Page-lock ``buffer`` (exactly its bytes) so copies reach it at full PCIe speed; it is
    unlocked when collected. ``what`` and ``remedy`` word the error: "cannot page-lock N
    GiB of host memory for {what}; {remedy} raise the locked-memory limit"."""
    num_bytes = buffer.nbytes
    status = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), num_bytes, 0)
    if int(status) != 0:
        raise UserError(
            f"cannot page-lock {byte_size(num_bytes)} of host memory for {what} "
            f"(CUDA error {int(status)}); {remedy} raise the locked-memory limit"
        )
    weakref.finalize(buffer, _unregister, buffer.data_ptr())


def _unregister(pointer: int) -> None:
    for device in range(torch.cuda.device_count()):  # no copy may still read or write it
        torch.cuda.synchronize(device)
    torch.cuda.cudart().cudaHostUnregister(pointer)
