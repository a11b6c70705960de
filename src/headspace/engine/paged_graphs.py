"""CUDA graphs of the batched decode step of one layout: one per (batch, table widths) bucket.

A step reads each sequence's input token from the runner's token slots on the device, runs
the model through the layout's tiers, writes the fp32 logits into one shared buffer and
the greedy pick back into the slots: the next step can be launched before the host has read
this one's tokens. With streamed heads the step also gathers their history from host pages
(one kernel per head group, as many pages as the step's count says) into staging, when it
fits one staging slot. Rows past the real batch point at scratch pages and a scratch slot
that no sequence owns. Inputs are double-buffered in pinned memory, so the host fills one
while the copy of the other is queued.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from headspace.kv.transfer import shared_stream
from headspace.model.compile_meter import COMPILE_METER
from headspace.model.llama import DEVICE_LOCK
from headspace.planner.memory import graph_step_faster
from headspace.tiers import StepInputs, Tier, attend_tiers
from headspace.tiers.base import MIN_WIDTH, bucket


def _queries_as_output(layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    return q  # [tokens, heads, dim]: an attention stand-in of the right shape


def _capture_name(key: tuple) -> str:
    batch, gpu_width, staging_width = key
    staged = f", {staging_width} staged pages a row" if staging_width else ""
    return f"decode step CUDA graph: batch {batch}, {gpu_width} pages a row{staged}"


def graphs_allowed(runtime, plan, streamed_weights: bool) -> bool:
    """Whether a layout's decode step may be captured: CUDA graphs asked for, no new
    FlexAttention block mask each step, resident weights, a layout in force whose
    offloaded entries (if any) stage whole pages, not by their lengths step by step."""
    if not runtime.cuda_graph or runtime.attention_backend == "flex":
        return False
    return plan is not None and not streamed_weights and not plan.entry_staging


# The decode graphs' capture stream: one a device (:func:`shared_stream`), of a priority no
# other stream of the engine uses, so that no other thread's work is ever queued on it (a
# capture records whatever its stream is given); one stream for every capture, so that the
# graphs' memory pool reuses its blocks.
CAPTURE_PRIORITY = -3


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream the decode graphs of ``device`` are captured on (made at first use)."""
    return shared_stream(device, CAPTURE_PRIORITY)


@dataclass
class CapturedStep:
    graph: torch.cuda.CUDAGraph
    inputs: torch.Tensor  # flat int64: rows [batch, columns], then count and host pages
    staging: list[torch.Tensor]  # the same twice in pinned host memory
    copied: list[torch.cuda.Event | None] = field(default_factory=lambda: [None, None])
    turn: int = 0


@dataclass(frozen=True)
class GraphSite:
    """What a runner's decode graphs are captured over, whatever its layout."""

    model: object  # the model whose layers the graphs replay
    tokens: torch.Tensor  # the runner's token slots (the last one the graphs' scratch)
    page_size: int  # tokens a page
    scratch_page: int  # the GPU page padded rows point at
    host_scratch_slot: int  # the host page slot padded rows point at
    max_batch: int  # the most rows a step decodes
    blocks_mode: str  # the decode blocks: "eager", "rows" or "tuned" (compiled)
    # ``attention(tiers, layer, q, kv) -> out``: what each captured layer calls in place of
    # the tiers' (a benchmark's timed one; None: the tiers'); not a bound method of the
    # graphs, so that no cycle holds the KV
    attention: object = None
    piece_width: int = 0  # pages of the longest sequence (a mixed step's tables)


class DecodeGraphs:
    """Captures and replays the decode step over the tiers of one layout."""

    def __init__(self, site: GraphSite, tiers: list[Tier], pool) -> None:
        """Over ``site``, the ``tiers`` of one layout; ``pool``: the memory pool its graphs
        capture into (None: a CPU twin's)."""
        self.model, self.tiers, self.tokens = site.model, list(tiers), site.tokens
        self.attention = site.attention
        # the tiers whose decode inputs the graph packs beside the block tables
        self.stream = next((t for t in tiers if t.stages_history), None)
        self.budget = next((t for t in tiers if t.entry_rows), None)
        self.outside = any(t.runs_outside_graphs for t in tiers)
        self.scratch_page, self.scratch_slot = site.scratch_page, site.tokens.numel() - 1
        self.host_scratch_slot, self.blocks_mode = site.host_scratch_slot, site.blocks_mode
        self.page_size = site.page_size
        self.device = site.tokens.device
        vocab = site.model.lm_head.weight.shape[0]
        self.logits = torch.empty(bucket(site.max_batch), vocab, device=self.device)
        self.top_rows = bucket(site.max_batch)  # the largest batch bucket
        self._graphs: dict[tuple[int, int, int], CapturedStep] = {}
        self._rows_compiled = site.blocks_mode != "rows"
        self._pool = pool

    @property
    def captured(self) -> frozenset[tuple]:
        """The keys of the steps captured so far (read only)."""
        return frozenset(self._graphs)

    def accepts(self, positions: list[int]) -> bool:
        """Whether a step at ``positions`` runs as a graph: always when nothing streams;
        with streamed heads when their history fits one staging slot and is short enough
        that the eager step's host work costs more than the copy engine's lead over the
        gather kernels wins back (:func:`graph_step_faster`)."""
        if self.outside:  # the hybrid tier's CPU part runs outside graphs
            return False
        if self.stream is None:
            return True
        num_pages = sum(-(-(p + 1) // self.page_size) for p in positions)
        if num_pages > self.stream.piece_pages:
            return False
        streamed = num_pages * self.stream.num_heads * self.stream.entry_page_bytes
        return self.step_faster(streamed, self.stream.num_groups)

    @property
    def plain(self) -> bool:
        """Whether the layout's graphs are keyed by batch and table width alone: nothing
        staged or streamed, no KV budget, nothing attended outside them."""
        return self.stream is None and self.budget is None and not self.outside

    def step_faster(self, streamed_bytes: int, num_groups: int) -> bool:
        """Whether a graph's step beats the eager one when it streams ``streamed_bytes`` of
        history in ``num_groups`` groups (:func:`graph_step_faster`; a test's twin may
        decide otherwise)."""
        return graph_step_faster(streamed_bytes, num_groups)

    def _packed_width(self, key) -> int:
        """Block-table columns packed per row: none under KV budgets, whose per-entry tables
        stay on the device (``key``'s width then sizes the rows the step gathers)."""
        return 0 if self.budget is not None else key[1]

    def _columns(self, key) -> tuple[int, int]:
        """(int64 values per row, values after the rows) of the inputs of ``key``."""
        batch, _, staging_width = key
        gpu_width = self._packed_width(key)
        per_row = 2 + gpu_width + staging_width + (1 if self.stream else 0)
        return per_row, (1 + self.stream.piece_pages) if self.stream else 0

    def _views(self, inputs: torch.Tensor, key) -> dict[str, torch.Tensor]:
        batch, _, staging_width = key
        gpu_width = self._packed_width(key)
        per_row, _ = self._columns(key)
        rows = inputs[: batch * per_row].view(batch, per_row)
        views = {"slots": rows[:, 0], "positions": rows[:, 1],
                 "gpu": rows[:, 2 : 2 + gpu_width],
                 "host": rows[:, 2 + gpu_width : 2 + gpu_width + staging_width]}  # fmt: skip
        if self.stream:
            views["new_slots"] = rows[:, -1]
            views["count"], views["pages"] = (
                inputs[batch * per_row :][:1],
                inputs[batch * per_row + 1 :],
            )
        return views

    def _attention(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        if self.attention is not None:  # a benchmark's timed attention
            return self.attention(self.tiers, layer, q, kv)
        return attend_tiers(self.tiers, layer, q, kv)

    def _step(self, views: dict[str, torch.Tensor], key) -> None:
        positions = views["positions"]
        tables = {tier: views[tier] for tier in ("gpu", "host") if views[tier].shape[1]}
        step = StepInputs(True, positions, [], {}, tables, positions + 1)
        for tier in self.tiers:  # (copies find their key ranges on the device)
            tier.begin_graph(step, views, key)
        slots = views["slots"]
        hidden = self.model(self.tokens.index_select(0, slots), positions, self._attention,
                            self.blocks_mode)  # fmt: skip
        logits = self.logits[: slots.shape[0]]
        logits.copy_(self.model.logits(hidden))
        self.tokens.index_copy_(0, slots, logits.argmax(-1))

    def _capture(self, key) -> CapturedStep:
        batch, gpu_width, staging_width = key
        per_row, tail = self._columns(key)
        inputs = torch.zeros(batch * per_row + tail, dtype=torch.long, device=self.device)
        staging = [torch.empty(inputs.shape, dtype=torch.long, pin_memory=True) for _ in range(2)]
        staging[0].copy_(torch.tensor(self._pack([], [], {}, key)))
        inputs.copy_(staging[0])  # every row padding: writes go to scratch pages
        views = self._views(inputs, key)
        with DEVICE_LOCK:  # (no other thread compiles or synchronises the device meanwhile)
            if batch > 1 and not self._rows_compiled:
                self._compile_rows()
            graph = self._capture_into(views, key)
        return CapturedStep(graph, inputs, staging)

    def _compile_rows(self) -> None:
        """Compile the blocks of symbolic rows at the largest bucket first (Inductor sizes
        its kernels by the first count it meets; max-autotune's timed at 2 rows and run at
        64 took 44% longer at 2: bench/NOTES.md). The layers run over dummy tokens with the
        queries for attention (no K/V written)."""
        rows = self.top_rows
        ids = torch.zeros(rows, dtype=torch.long, device=self.device)
        self.model(ids, ids, _queries_as_output, self.blocks_mode)
        self._rows_compiled = True

    def _capture_into(self, views: dict[str, torch.Tensor], key, step=None,
                      warm_ups: int = 2) -> torch.cuda.CUDAGraph:  # fmt: skip
        """``warm_ups`` steps (they compile), then the step (``step(views, key)``, default
        the decode step) captured, on the capture stream
        (:func:`capture_stream`), without torch.cuda.graph's device-wide synchronisation and
        cache release: those waited for the offload lane's prompt piece in flight, a stall of
        every resident stream of 1.2-2.5 s when the arena split (bench/NOTES.md). Where the
        capture finds no memory (no cached block is released while one runs), the cache is
        released and it is captured once more."""
        step = step or self._step
        stream, current = capture_stream(self.device), torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            for _ in range(warm_ups):
                step(views, key)
            try:
                graph = self._recorded(views, key, step)
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()  # (the caller holds DEVICE_LOCK)
                graph = self._recorded(views, key, step)
        current.wait_stream(stream)
        return graph

    def _recorded(self, views: dict[str, torch.Tensor], key, step) -> torch.cuda.CUDAGraph:
        """``step`` captured on the current stream (thread_local: the offload lane's thread
        goes on working meanwhile, on streams of its own)."""
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(self._pool, capture_error_mode="thread_local")
        try:
            step(views, key)
        except BaseException:
            with contextlib.suppress(RuntimeError):  # (it ends invalid; the step's error raised)
                graph.capture_end()
            raise
        graph.capture_end()
        return graph

    def _pack(self, slots: list[int], positions: list[int], pages: dict, key) -> list[int]:
        """The step's inputs as one flat list of int64 values (see ``_views``)."""
        batch, _, staging_width = key
        gpu_width = self._packed_width(key)
        size, values, host_pages, staged = self.page_size, [], [], 0
        for row, (slot, position) in enumerate(zip(slots, positions, strict=True)):
            values += [slot, position]
            if gpu_width:
                gpu = pages["gpu"][row]
                values += gpu + [self.scratch_page] * (gpu_width - len(gpu))
            if self.stream:
                num_pages = -(-(position + 1) // size)
                host = pages["host"][row]
                values += list(range(staged, staged + num_pages))
                values += [self.stream.piece_pages] * (staging_width - num_pages)
                values.append(host[position // size] * size + position % size)
                host_pages += host[:num_pages]
                staged += num_pages
        pad = [self.scratch_slot, 0] + [self.scratch_page] * gpu_width
        if self.stream:
            pad += [self.stream.piece_pages] * staging_width + [self.host_scratch_slot]
        values += pad * (batch - len(slots))
        if self.stream:
            values += [len(host_pages)] + host_pages
            values += [0] * (self.stream.piece_pages - len(host_pages))
        return values

    def _key(self, positions: list[int], pages: dict[str, list[list[int]]]) -> tuple:
        """The graph of a step: (batch bucket, block-table width, staging width)."""
        gpu_width = bucket(max(map(len, pages["gpu"])), MIN_WIDTH) if "gpu" in pages else 0
        if self.budget is not None:  # the widest entry's pages
            gpu_width = bucket(self.budget.widest, MIN_WIDTH)
        staging_width = 0
        if self.stream:
            widest = max(-(-(p + 1) // self.page_size) for p in positions)
            staging_width = bucket(widest, MIN_WIDTH)
        return bucket(len(positions)), gpu_width, staging_width

    def _captured(self, key, num_seqs: int) -> CapturedStep:
        """The graph of ``key``, captured if new; the ``attention`` hook, where it has a
        ``graph_step(graphs, key, capture, num_seqs)``, is told first (a benchmark's timer
        reads a replay's events by the graph that recorded them, for the step's sequences)."""
        graph_step = getattr(self.attention, "graph_step", None)
        if graph_step is not None:
            graph_step(self, key, key not in self._graphs, num_seqs)
        if key not in self._graphs:  # timed and named once the lock is held (an RLock: the
            with DEVICE_LOCK, COMPILE_METER.timing(self._capture_name(key)):  # capture's own)
                self._graphs[key] = self._capture(key)
        return self._graphs[key]

    @torch.inference_mode()
    def capture(self, key: tuple[int, int, int]) -> bool:
        """Capture the decode step of ``key`` (batch bucket, block-table width, staging
        width) now, every row padding, as its first step would (no sequence needed); False
        where it was captured already. A server's warm-up captures the keys its prompts
        will meet, so that no capture stands between a client and its tokens."""
        if key in self._graphs:
            return False
        self._captured(key, 0)
        return True

    def _capture_name(self, key) -> str:
        """What the compile meter's listener is told a capture of ``key`` is."""
        return _capture_name(key)

    def _replay(self, captured: CapturedStep, values: list[int]) -> None:
        """The graph of ``captured`` replayed over ``values`` (its packed inputs), copied in
        through the pinned buffer that the copy before last read."""
        turn = captured.turn
        if captured.copied[turn] is not None:  # the copy that read this buffer is done
            captured.copied[turn].synchronize()
        staging = captured.staging[turn]
        staging.copy_(torch.tensor(values))
        captured.inputs.copy_(staging, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        captured.copied[turn], captured.turn = event, 1 - turn
        captured.graph.replay()

    def release(self) -> None:
        """Free every captured graph now (before the process group goes: see
        :func:`headspace.parallel.dist.release_before_leaving`); later steps capture anew."""
        for captured in self._graphs.values():
            if captured.graph is not None:
                captured.graph.reset()
        self._graphs.clear()

    @torch.inference_mode()
    def run(self, slots: list[int], positions: list[int],
            pages: dict[str, list[list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Logits ``[len(slots), vocab]`` of one decode step (overwritten by the next call)
        and the slots on the device; each row's greedy token is written into its slot."""
        num_seqs, key = len(slots), self._key(positions, pages)
        captured = self._captured(key, num_seqs)
        self._replay(captured, self._pack(slots, positions, pages, key))
        per_row, _ = self._columns(key)
        return self.logits[:num_seqs], captured.inputs[: num_seqs * per_row : per_row]
