"""The hybrid tier's sparse mode (HGCA, ``cpu_sparsity=beta``): CPU threads attend, for each
(layer, kv head) and sequence, only the older tokens judged salient.

Salience is a moving average of attention weights (MAW) per token and kv head (a kv head's
weight of a token: the largest over its query heads). While a token is on the GPU side (the
window) its MAW is tracked on the device, ``maw <- (1 - alpha) maw + alpha w`` from its first
weight on. When the window moves past a page, the page's tokens leave with their MAW and are
kept for the CPU when ``maw > beta / n`` (``n``: the tokens on the GPU side then).

After each append (a prompt, then every page that leaves the window), the CPU attends the
whole history once, densely and exactly, writing every token's weight ``A_cpu``. One query's
weights miss the tokens later queries attend (the embedded model lost 9% of perplexity that
way), so a token's weight is the most any of several queries gives it: the step's query, at a
sequence's first selection also the prompt's last ``OBSERVED_QUERIES`` queries (SnapKV's
observation window, kept as the prompt's last chunk ran), and the largest weight of every
earlier re-evaluation (a running maximum, in multiples of ``1 / n`` as ``n``, the CPU-side
tokens, grows). A background thread keeps, per (layer, kv head), the tokens with ``maw >
beta / n`` and re-normalises their MAW to sum to 1 (HGCA's 3.2.2; never lowering them).
The new selection takes over ``SELECTION_DELAY`` steps later (waiting for it if it
is late, so that results never depend on thread timing); until the first one the steps are
dense. Nothing is freed: a dropped token stays in its host page, so a later re-evaluation
reinstates it when its weight rises.
"""

from __future__ import annotations

import statistics
from concurrent.futures import ThreadPoolExecutor

import torch

from headspace.budgets.spec import WINDOW as OBSERVED_QUERIES
from headspace.kv.paged_store import token_slots
from headspace.kv.spec import KVSpec
from headspace.kv.transfer import device_ints, shared_stream
from headspace.tiers.cpu_timings import CpuTimings, timed
from headspace.tiers.hybrid_blocks import KeyBoxes, add_query_blocks, spare_columns
from headspace.tiers.settings import HybridSettings

SELECTION_DELAY = 2  # steps from the dense pass that writes the weights to the first sparse one


def salient(weights: torch.Tensor, beta: float, count: int) -> torch.Tensor:
    """HGCA's rule: entries whose weight exceeds ``beta`` times the uniform ``1 / count``."""
    return weights > beta / max(count, 1)


def renormalise(maw: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """HGCA's re-normalisation after selection: the kept tokens' MAW ``[heads, n]`` (in
    multiples of the uniform weight ``1 / n``) scaled so that their weights sum to 1 per
    head; dropped tokens keep theirs (a later re-evaluation may reinstate them). Weights
    here are the most any of several queries gave, whose kept sum can pass 1: those are
    left as they are, never lowered under the threshold that kept them."""
    kept = torch.where(keep, maw, 0.0).sum(-1, keepdim=True)  # [heads, 1]
    scale = (maw.shape[-1] / kept.clamp_min(1e-30)).clamp_min(1.0)
    return torch.where(keep, maw * scale, maw)


class SparseState:
    """One sequence's kept positions per (layer, kv head): the last re-evaluation's (``base``,
    over tokens ``0 .. end - 1``) and, after it, what each page leaving the window kept."""

    def __init__(self, layers: list[int], cpu_end: int):
        self.layers = layers  # the layers that have hybrid heads
        self.base: dict[int, tuple[int, dict[int, torch.Tensor]]] = {}  # layer -> (end, heads)
        self.chunks: list[tuple[int, torch.Tensor]] = []  # (first position, keep [L, H, n])
        self.evicted_end = cpu_end  # tokens 0 .. evicted_end - 1 are on the CPU side
        self.pending: dict[int, tuple[int, dict[int, torch.Tensor]]] = {}  # being selected
        self.apply_at: int | None = None  # the selector's step that takes ``pending`` over
        self.stale = True  # appended to since the last re-evaluation was asked for
        self.version = 0
        self.maw: dict[tuple[int, int], torch.Tensor] = {}  # (layer, first head) -> [heads, n]
        self.boxes = KeyBoxes()  # its CPU-side keys' boxes, for the query-aware blocks
        self.admission = 0  # which admission to the selector this is (tables' cache key)

    @property
    def ready(self) -> bool:
        """Whether every hybrid layer has a selection (until then the CPU attends densely)."""
        return all(layer in self.base for layer in self.layers)

    def reevaluate(self, layer: int, heads: range, weights: torch.Tensor, beta: float) -> None:
        """A new selection for ``layer`` from each kv head's weights ``[heads, n]`` of tokens
        ``0 .. n - 1`` (each normalised over them; the most any query gave), folded into
        their running maximum, pending until :meth:`apply`."""
        count = weights.shape[1]
        maw = weights.float() * count  # in multiples of the uniform weight, as n grows
        prior = self.maw.get((layer, heads.start))  # [heads, tokens weighed before]
        if prior is not None and prior.shape[0] == len(heads):
            seen = min(prior.shape[1], count)
            maw[:, :seen] = torch.maximum(prior[:, :seen], maw[:, :seen])
        keep = salient(maw, beta, 1)
        self.maw[(layer, heads.start)] = renormalise(maw, keep)
        self.pending[layer] = (count, {h: keep[i].nonzero()[:, 0].int()
                                       for i, h in enumerate(heads)})  # fmt: skip

    def apply(self) -> None:
        """The pending selections replace what was kept of their tokens."""
        self.base.update(self.pending)
        self.pending, self.apply_at = {}, None
        self.version += 1

    def evict(self, start: int, maw: torch.Tensor, beta: float, num_gpu_tokens: int) -> None:
        """Tokens ``start ..`` (``maw [layers, kv heads, n]``) leave the GPU window."""
        self.chunks.append((start, salient(maw, beta, num_gpu_tokens)))
        self.evicted_end = start + maw.shape[-1]
        self.stale = True
        self.version += 1

    def kept(self, layer: int, head: int) -> torch.Tensor:
        """Positions (int32, ascending) the CPU attends for (``layer``, ``head``)."""
        end, heads = self.base.get(layer, (0, {}))
        parts = [heads[head]] if head in heads else []
        parts += [first + keep[layer, head].nonzero()[:, 0].int()
                  for first, keep in self.chunks if first >= end]  # fmt: skip
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)

    def fractions(self, kv_heads: dict[int, range]) -> list[float]:
        """Kept share of the CPU-side tokens per hybrid (layer, kv head)."""
        total = max(self.evicted_end, 1)
        return [len(self.kept(layer, h)) / total
                for layer, heads in kv_heads.items() for h in heads]  # fmt: skip


class SparseSelector:
    """MAW tracking on the device, selection on a background thread, and the CPU kernel's
    token tables, for the sequences of the running batch. ``timings``: a benchmark's record
    of the host time in ``track``, ``begin`` and ``token_tables``, and whether the GPU side's
    weights are tracked at all (:class:`CpuTimings`; None: nothing recorded, tracked)."""

    def __init__(self, settings: HybridSettings, spec: KVSpec, kv_heads: dict[int, range],
                 max_rows: int, device: torch.device,
                 timings: CpuTimings | None = None):  # fmt: skip
        """The selector of ``settings`` (``sparsity``: beta, ``maw_alpha``, ``gpu_window``,
        ``query_blocks``) over pages of ``spec``'s shape: per layer, its offloaded kv heads
        (``kv_heads``), for ``max_rows`` sequences at most."""
        self.beta, self.alpha, self.kv_heads = settings.sparsity, settings.maw_alpha, kv_heads
        self.query_blocks = settings.query_blocks  # blocks each step's query adds
        self.timings = timings
        self.tracks = timings is None or timings.track_weights  # the GPU side's MAW updated
        self.ring = settings.gpu_window + 2 * spec.page_size  # the GPU side spans no more
        rows = (max_rows, spec.num_layers, spec.num_kv_heads, self.ring)
        self.maw = torch.full(rows, -1.0, device=device)  # [rows, layers, kv heads, ring]
        self.states: dict[int, SparseState] = {}
        self.rows: dict[int, int] = {}
        self.summaries: dict[int, tuple[float, float, float]] = {}
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="headspace-select")
        # (layer, kv range, slots, sequences, their admissions and versions, query blocks)
        # -> (tables, kept counts, kept positions per row, full blocks per sequence's first
        # row): the current batch's only
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor, list, dict]] = {}
        self._admissions = 0
        self.observed: dict[int, dict[int, tuple]] = {}  # seq -> layer -> (q, event, end)
        self._copies: torch.cuda.Stream | None = None  # the prompt queries' copies
        self._aranges: dict[tuple[int, int], torch.Tensor] = {}
        self.step = 0

    @classmethod
    def over_groups(cls, settings: HybridSettings, spec: KVSpec,
                    groups: list[list[tuple[int, int]]], max_rows: int, device: torch.device,
                    timings: CpuTimings | None = None) -> SparseSelector:  # fmt: skip
        """The selector of the hybrid tier's ``settings`` (``sparsity``, ``maw_alpha``,
        ``gpu_window``, ``query_blocks``) over each layer's offloaded kv-head ``groups``
        (ranges); a benchmark's ``timings`` (whose ``tables`` include the query blocks'
        bound and boxes), if any."""
        kv_heads = {layer: range(ranges[0][0], ranges[-1][1])
                    for layer, ranges in enumerate(groups) if ranges}  # fmt: skip
        return cls(settings, spec, kv_heads, max_rows, device, timings)

    # -- the step ------------------------------------------------------------------------
    @timed("begin")
    def begin(self, seq_ids: list[int], positions: list[int], cpu_ends: list[int]) -> None:
        """A decode step of ``seq_ids`` (new tokens at ``positions``, CPU tokens
        ``cpu_ends``): evicts the pages that left the window, sorts the rows into dense
        (no selection yet) and sparse."""
        for seq_id in [s for s in self.states if s not in seq_ids]:
            self.release(seq_id)
        for seq_id, position, end in zip(seq_ids, positions, cpu_ends, strict=True):
            state = self.states.get(seq_id)
            if state is None:
                self._admit(seq_id, end)
            elif end > state.evicted_end:
                self._evict(seq_id, state, end, position + 1 - state.evicted_end)
        self.seq_ids, self.step = seq_ids, self.step + 1
        states = [self.states[s] for s in seq_ids]
        due = [s for s in states if s.apply_at is not None and self.step >= s.apply_at]
        if due:
            self.drain()  # a selection that is late: wait, so timing never changes a result
            for state in due:
                state.apply()
        # a step after an append attends densely and writes the weights to select by
        self.weigh = [i for i, state in enumerate(states)
                      if state.stale and state.apply_at is None and cpu_ends[i]]  # fmt: skip
        self.dense = [i for i, state in enumerate(states) if not state.ready or i in self.weigh]
        self.sparse = [i for i in range(len(states)) if i not in self.dense]
        rows = [self.rows[s] for s in seq_ids]
        self.row_index = device_ints(rows, self.maw.device)

    def observe(self, seq_id: int, layer: int, q: torch.Tensor, end: int) -> None:
        """A prefill chunk's queries ``q [tokens, heads, dim]`` of ``layer``'s hybrid heads,
        at positions ``end - tokens .. end - 1``: the last ``OBSERVED_QUERIES`` so far are
        kept (the prompt's, once its last chunk ran), on the device, until the sequence's
        first selection reads them or it ends."""
        held = self.observed.setdefault(seq_id, {})
        before = held.get(layer)
        # [<= 32, heads, dim]; after a short chunk, the one before's last queries lead
        tail = q[-OBSERVED_QUERIES:].clone() if before is None else \
            torch.cat([before[0], q[-OBSERVED_QUERIES:]])[-OBSERVED_QUERIES:]  # fmt: skip
        ready = None
        if tail.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tail.device))
        held[layer] = (tail, ready, end)

    def prompt_queries(self, row: int, layer: int, end: int) -> torch.Tensor | None:
        """This step's ``row``'s prompt queries ``[queries, heads, dim]`` (fp32, host) of
        ``layer`` that see every one of its first ``end`` tokens (at positions ``end - 1``
        on), once (None after, or where none was observed or none sees them all)."""
        seq_id = self.seq_ids[row]
        held = self.observed.get(seq_id, {}).pop(layer, None)
        if held is None:
            return None
        if not self.observed[seq_id]:
            del self.observed[seq_id]
        tail, ready, last_end = held
        tail = tail[max(0, end - 1 - (last_end - len(tail))) :]  # positions >= end - 1
        if not len(tail):
            return None
        if ready is None:
            return tail.float()
        ready.synchronize()  # the clone is done; the copy runs on a stream of its own, so
        if self._copies is None:  # it does not wait for the step queued on the main one
            self._copies = shared_stream(tail.device)
        with torch.cuda.stream(self._copies):
            return tail.float().cpu()

    def _admit(self, seq_id: int, cpu_end: int) -> None:
        row = min(set(range(self.maw.shape[0])) - set(self.rows.values()))
        self.rows[seq_id] = row
        self.maw[row] = -1.0
        self.states[seq_id] = SparseState(list(self.kv_heads), cpu_end)
        self._admissions += 1
        self.states[seq_id].admission = self._admissions

    def _evict(self, seq_id: int, state: SparseState, end: int, num_gpu_tokens: int) -> None:
        start = state.evicted_end
        index = torch.arange(start, end, device=self.maw.device) % self.ring
        row = self.rows[seq_id]
        maw = self.maw[row][:, :, index].cpu()  # [layers, kv heads, tokens]
        self.maw[row, :, :, index] = -1.0  # the ring's places go to new tokens
        state.evict(start, maw, self.beta, num_gpu_tokens)

    def release(self, seq_id: int) -> None:
        """Forget a sequence that left the batch (its kept shares stay for its summary)."""
        self.observed.pop(seq_id, None)
        state = self.states.pop(seq_id)
        self.summaries[seq_id] = _summary(state.fractions(self.kv_heads))
        self.rows.pop(seq_id)

    def forget(self, seq_id: int) -> None:
        """Drop all of a sequence that ended or was aborted (its summary too)."""
        self.drain()  # selections in flight read its state
        self.observed.pop(seq_id, None)
        if seq_id in self.states:
            self.release(seq_id)
        self.summaries.pop(seq_id, None)

    def summary(self, seq_id: int) -> tuple[float, float, float] | None:
        """(min, median, max) kept share of the CPU-side tokens over the hybrid heads."""
        if seq_id in self.states:
            return _summary(self.states[seq_id].fractions(self.kv_heads))
        return self.summaries.get(seq_id)

    # -- the GPU side --------------------------------------------------------------------
    @timed("track")
    def track(self, layer: int, kv_range: tuple[int, int], probs: torch.Tensor,
              offsets: torch.Tensor, lengths: torch.Tensor) -> None:  # fmt: skip
        """Fold one step's weights of the GPU-side tokens into their MAW: ``probs [seqs,
        heads, width]`` of tokens ``offsets[s] + j`` for ``j < lengths[s]``."""
        num_seqs, num_heads, width = probs.shape
        if width > self.ring:
            raise ValueError(f"{width} GPU-side tokens exceed the MAW ring of {self.ring}")
        lo, hi = kv_range
        weights = probs.view(num_seqs, hi - lo, num_heads // (hi - lo), width).amax(2)
        columns = self._arange(width)
        index = ((offsets[:, None] + columns) % self.ring)[:, None, :]  # [seqs, 1, width]
        heads = self._arange(hi, lo)[None, :, None]
        where = (self.row_index[:, None, None], layer, heads, index)
        current = self.maw[where]  # [seqs, heads, width]
        moved = torch.where(current < 0, weights, (1 - self.alpha) * current + self.alpha * weights)
        valid = (columns < lengths[:, None])[:, None, :]
        self.maw[where] = torch.where(valid, moved, current)

    def _arange(self, end: int, start: int = 0) -> torch.Tensor:
        key = (start, end)
        if key not in self._aranges:
            self._aranges[key] = torch.arange(start, end, device=self.maw.device)
        return self._aranges[key]

    # -- the CPU side (worker thread) ----------------------------------------------------
    def reevaluate(self, row: int, layer: int, kv_range: tuple[int, int], probs: torch.Tensor,
                   end: int, prompt_probs: torch.Tensor | None = None) -> None:  # fmt: skip
        """Select on the background thread from ``probs [heads, >= end]`` (row ``row`` of
        this step's dense pass, which attended tokens ``0 .. end - 1``) and, at a first
        selection, the prompt's last queries' ``prompt_probs [queries, heads, >= end]``."""
        state, heads = self.states[self.seq_ids[row]], range(*kv_range)
        if state.apply_at is None:  # the step's first layer
            state.apply_at, state.stale = self.step + SELECTION_DELAY, False

        def select():
            group = probs.shape[0] // len(heads)
            weights = probs[:, :end].view(len(heads), group, end).amax(1)  # [kv heads, end]
            if prompt_probs is not None:
                queries = prompt_probs.shape[0]
                prompt = prompt_probs[:, :, :end].view(queries, len(heads), group, end)
                weights = torch.maximum(weights, prompt.amax(2).amax(0))
            state.reevaluate(layer, heads, weights, self.beta)

        self.worker.submit(select)

    @timed("tables")
    def token_tables(
        self,
        layer: int,
        kv_range: tuple[int, int],
        host_pages: list[list[int]],
        slots_per_head: int,
        page_size: int,
        q: torch.Tensor | None = None,
        host_kv: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's inputs for this step's sparse rows, one row per (sequence, kv head):
        int32 tables of rows ``2 h slots_per_head + slot`` into a layer's flat ``[heads * 2
        * slots, dim]`` K view (V: ``slots_per_head`` rows on), and the kept counts. With
        ``query_blocks``, each row's kept tokens and the blocks the step's query ``q [sparse
        rows, query heads of kv_range, dim]`` bounds highest (keys boxed from the layer's
        host pages ``host_kv [kv heads, 2, slots, dim]``)."""
        blocks = self.query_blocks if q is not None else 0
        states = [self.states[self.seq_ids[i]] for i in self.sparse]
        key = (layer, kv_range, slots_per_head, tuple(self.seq_ids[i] for i in self.sparse),
               tuple((s.admission, s.version) for s in states), blocks)  # fmt: skip
        if key not in self._tables:  # (a sequence swapped out and back is admitted anew)
            self._tables = {k: v for k, v in self._tables.items()
                            if k[3:5] == key[3:5] and k[:3] != key[:3]}  # fmt: skip
            rows, kept = [], []
            for i, state in zip(self.sparse, states, strict=True):
                pages = torch.tensor(host_pages[i], dtype=torch.int64)
                for h in range(*kv_range):
                    positions = state.kept(layer, h).long()  # ascending
                    slots = token_slots(pages, positions, page_size)
                    rows.append((slots + 2 * h * slots_per_head).int())
                    kept.append(positions)
            counts = torch.tensor([len(r) for r in rows], dtype=torch.int32)
            # with query blocks, room after each row's kept tokens for the step's blocks
            spare = max(spare_columns(blocks, state.evicted_end) for state in states)
            width = int(counts.max()) + (spare if blocks else 0)
            tables = torch.zeros(len(rows), max(1, width), dtype=torch.int32)
            for j, r in enumerate(rows):
                tables[j, : len(r)] = r
            self._tables[key] = (tables, counts, kept, {})
        tables, counts, kept, full = self._tables[key]
        if not blocks:
            return tables, counts
        rows = [(states[j], host_pages[i]) for j, i in enumerate(self.sparse)]
        return tables, add_query_blocks(rows, layer, kv_range, slots_per_head, page_size, q,
                                        host_kv, (tables, counts, kept, full), blocks)  # fmt: skip

    def drain(self) -> None:
        """Wait for the selections in flight (tests, and before reading summaries)."""
        self.worker.submit(lambda: None).result()


def _summary(fractions: list[float]) -> tuple[float, float, float]:
    if not fractions:
        return (1.0, 1.0, 1.0)
    return (min(fractions), statistics.median(fractions), max(fractions))
