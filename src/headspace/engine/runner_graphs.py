"""The runner's decode graphs: those of the layout in force, made when a step first needs
them (kept per layout in the runner's :class:`GraphCache`), captured ahead by a server's
warm-up, read by the engine's view. A mixin of
:class:`~headspace.engine.paged_runner.PagedRunner` (its model, tiers, token slots, arena,
host pages and hooks); nothing here changes the layout."""

from __future__ import annotations

import torch
import torch.distributed

from headspace.engine.mixed_graphs import MixedGraphs
from headspace.engine.paged_graphs import GraphSite, graphs_allowed

# layouts whose decode graphs a runner keeps (the most recently used): the resident lane's
# whole arena and a few of its split sizes. Each split size (set by what the resident
# requests hold when a long one arrives) is a layout of its own, with its logits buffer
# (32 MiB for Llama-3.1-8B at batch 64) and graphs: kept all, a server would grow by that
# much with every new size, past its budget and to an out-of-memory error in the end.
KEPT_LAYOUTS = 4


class GraphCache:
    """A runner's decode graphs, one :class:`DecodeGraphs` per layout (by its id), made anew
    when the tensors they address moved (``generation``), those of at most ``kept`` layouts
    (the most recently used; the others freed); one memory pool for the graphs made since
    any were freed (none for the tests' twin, ``twin``)."""

    def __init__(self, twin: bool, kept: int = KEPT_LAYOUTS):
        self.twin, self.kept = twin, kept
        self._graphs: dict[int, tuple[tuple, object]] = {}  # least recently used first
        self._pool = None

    def __bool__(self) -> bool:
        return bool(self._graphs)

    def __len__(self) -> int:
        return len(self._graphs)

    def peek(self, layout_id: int):
        """The graphs kept for ``layout_id`` (None: none), read only: nothing made, freed or
        reordered (a view may read it from another thread)."""
        cached = self._graphs.get(layout_id)
        return None if cached is None else cached[1]

    def get(self, layout_id: int, generation: tuple, make):
        """The graphs of ``layout_id`` at ``generation``; ``make(pool)`` builds them anew
        (freeing those of the least recently used layout past ``kept``)."""
        cached = self._graphs.pop(layout_id, None)
        if cached is not None and cached[0] == generation:
            self._graphs[layout_id] = cached  # the most recently used now
            return cached[1]
        if cached is not None:  # they address tensors that moved
            self._free(cached[1])
        while len(self._graphs) >= self.kept:
            self._free(self._graphs.pop(next(iter(self._graphs)))[1])
        if self._pool is None and not self.twin:
            self._pool = torch.cuda.graph_pool_handle()
        graphs = make(self._pool)
        self._graphs[layout_id] = (generation, graphs)
        return graphs

    def _free(self, graphs) -> None:
        """Free ``graphs`` now; later captures go to a new pool (a capture must not reuse
        the old one, which is freed once no graph uses it)."""
        graphs.release()
        self._pool = None

    def release(self) -> None:
        """Free every layout's graphs (the next step captures anew), and their pool."""
        for _, graphs in self._graphs.values():
            graphs.release()
        self._graphs.clear()
        self._pool = None


class RunnerGraphs:
    """Decode graphs of a :class:`~headspace.engine.paged_runner.PagedRunner`."""

    @property
    def has_graphs(self) -> bool:
        """Whether graphs (CUDA's, or the tests' twin) were built for a layout's decode."""
        return bool(self.graph_cache)

    @property
    def graphs(self):
        """The decode graphs made so far for the layout in force (None: none), read only:
        nothing made or freed (a view, a test or a benchmark may read it)."""
        return self.graph_cache.peek(self._layout_id) if self.graph_cache else None

    @property
    def has_mixed_graphs(self) -> bool:
        """Whether a mixed step (a piece and decode rows) of this layout ran as a graph."""
        graphs = self.graphs
        return isinstance(graphs, MixedGraphs) and graphs.num_mixed > 0

    @property
    def _graphs(self):
        """The CUDA graphs of this layout's decode step, None without CUDA graphs (kept per
        layout while the host pages and the tiers' tensors they address stay where they
        are: ``Tier.graph_version``)."""
        twin = self.graphs_class  # a CPU stand-in in tests; None: real graphs, on a GPU only
        capturable = (twin is not None or self.device.type == "cuda") and (
            self.layout is None or twin is not None
            or torch.distributed.get_backend() == "nccl"  # (gloo's collectives: never)
        )  # fmt: skip
        if not capturable or not graphs_allowed(self.config.runtime, self.plan,
                                                self.model.layer_source is not None):  # fmt: skip
            return None
        generation = (
            self.host.generation if self.plan.staging else 0,  # graphs address host
            tuple(tier.graph_version for tier in self.tiers),
        )  # and tiers' tensors
        return self.graph_cache.get(self._layout_id, generation, self._new_graphs)

    def _new_graphs(self, pool):
        mode = "eager"
        if self._compiled:
            mode = "tuned" if self.config.runtime.tune_decode else "rows"
        site = GraphSite(self.model, self.tokens, self.page_size, self.store.num_pages,
                         self.host.scratch_slot, self.config.runtime.max_batch, mode,
                         self.attention_hook,  # a benchmark's timed attention, if it set one
                         piece_width=-(-self.max_context // self.page_size))  # fmt: skip
        return (self.graphs_class or MixedGraphs)(site, self.tiers, pool)

    def capture_decode_graphs(self, keys: list[tuple[int, int]]) -> int:
        """Capture now the decode step of each ``(batch bucket, block-table width in pages)``
        of ``keys`` for the layout in force, where its graphs are keyed by those alone
        (nothing staged or streamed, no KV budget, nothing attended outside them); how many
        were new (a server's warm-up: every key its prompts will meet)."""
        graphs = self._graphs
        if graphs is None or not graphs.plain:
            return 0
        return sum(graphs.capture((batch, width, 0)) for batch, width in keys)

    def capture_mixed_graphs(self, pieces: list[tuple[int, int]]) -> int:
        """Capture now the mixed step of each ``(piece rows, decode rows)`` of ``pieces``
        where the layout in force runs mixed steps as graphs (:meth:`MixedGraphs.accepts_mixed`);
        how many were new (a server's warm-up: the pieces a burst meets)."""
        graphs = self._graphs
        if not self.mixes or not isinstance(graphs, MixedGraphs):
            return 0
        return sum(graphs.capture_mixed(rows, seqs) for rows, seqs in pieces)

    def release_graphs(self) -> None:
        """Free the decode steps' graphs of every layout (the next step captures anew)."""
        self.graph_cache.release()
