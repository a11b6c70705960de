"""The hybrid tier (HGCA): entries whose K/V live in host pages, the older part of each
history attended by CPU threads where it lies
(:class:`~headspace.tiers.cpu_attention.CpuAttention`), the rest (at least the GPU window of
recent tokens) staged to the GPU as the stream tier's, or kept in GPU pages (the window);
the two parts merged exactly by LSE. In sparse mode the CPU attends only the tokens its
selection keeps, tracked from the GPU side's weights."""

from __future__ import annotations

import torch

from headspace.attention import merge_attention
from headspace.tiers.base import HeadRange, StepInputs, TierSite, q_heads
from headspace.tiers.hybrid import CpuSplit, cpu_ends, cpu_split
from headspace.tiers.hybrid_sparse import SparseSelector
from headspace.tiers.hybrid_window import GpuWindow
from headspace.tiers.streamed import StreamedTier


class HybridTier(StreamedTier):
    """Attention of the hybrid (layer, kv head) entries: ``cpu`` (``cpu_split``) attends the
    older part of each history; ``window``: the GPU window kept in GPU pages (None: staged)."""

    runs_outside_graphs = True  # the CPU part

    def __init__(self, site: TierSite, groups: list[list[HeadRange]], sized: tuple[int, int],
                 cpu: CpuSplit, window: GpuWindow | None = None):  # fmt: skip
        """As :class:`StreamedTier`'s, with the CPU side (``cpu``) and the GPU window."""
        super().__init__(site, groups, sized)
        self.cpu_split, self.window = cpu, window  # (the engine's share search sets its share)
        self._cpu_job = None  # the CPU part of the layer being attended

    @classmethod
    def from_plan(cls, plan, site: TierSite) -> HybridTier | None:
        """The plan's hybrid entries: the stream tier's groups and staging, the CPU side at
        the plan's share, the GPU window in GPU pages where the plan keeps it there."""
        if plan.staging is None or plan.offload != "hybrid":
            return None
        groups = cls.offloaded_groups(plan, site)
        cpu, window = cpu_split(plan, site, groups), None
        if plan.gpu_window is not None:
            window = GpuWindow.over_groups(site.store.window, groups, plan.gpu_window.pages,
                                           cpu.gpu_window, site.host)  # fmt: skip
        return cls(site, groups, cls.sized(plan), cpu, window)

    @property
    def sparse(self) -> SparseSelector | None:
        return self.cpu_split.attention.sparse

    @property
    def layer_slices(self) -> bool:
        """A prefill chunk may run a few layers a step (not in sparse mode)."""
        return self.sparse is None

    def kept_summary(self, seq_id: int) -> tuple[float, float, float] | None:
        if self.sparse is None:
            return None
        self.sparse.drain()
        return self.sparse.summary(seq_id)

    def forget(self, seq_id: int) -> None:
        if self.sparse is not None:
            self.sparse.forget(seq_id)
        if self.window is not None:
            self.window.forget(seq_id)

    def _streamed_pages(self, step: StepInputs) -> tuple[list[int], list[int] | None]:
        """Tokens ``0 .. end - 1`` of each sequence go to the CPU; the rest before the GPU
        window streams; the window is kept in GPU pages (where it is)."""
        size, cpu = self.page_size, self.cpu_split
        ends = cpu_ends(step.positions_list, cpu.share, cpu.gpu_window, size)
        cpu.attention.begin(step.pages["host"], ends)
        if self.sparse is not None:
            self.sparse.begin(step.seq_ids, step.positions_list, ends)
        first_pages, last_pages = [end // size for end in ends], None
        if self.window is not None:
            last_pages = self.window.begin(step.seq_ids, step.positions_list,
                                           step.pages["host"], first_pages)  # fmt: skip
            self.window_piece = self.window.piece
        return first_pages, last_pages

    def submit(self, layer: int, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor) -> None:
        """The CPU starts first, with one job for all the layer's groups (adjacent kv heads);
        then the GPU window's fill and the stream tier's groups; the sparse mode's moving
        averages follow the GPU side's weights."""
        if self.groups[layer]:
            heads = (self.groups[layer][0][0], self.groups[layer][-1][1])
            q_part = q[:, q_heads(heads, self.q_per_kv)]
            if self.step.decode:
                self._cpu_job = self.cpu_split.attention.submit(layer, heads, q_part)
            elif self.sparse is not None:  # the prompt's queries, for a first selection
                self.sparse.observe(self.step.seq_ids[0], layer, q_part,
                                    self.step.start + q.shape[0])  # fmt: skip
        if self.window_piece is not None:
            self.counters.window_fill_pages += self.window.fill(layer)
        super().submit(layer, q, kv, out)
        if self._scored:
            self._track(layer)

    def collect(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The GPU side's results with the CPU's merged in by LSE."""
        results = super().collect(layer)
        job, self._cpu_job = self._cpu_job, None
        if job is None:
            return results
        cpu_out, cpu_lse = self.cpu_split.attention.result(job, results[0][0].device)
        first = self.groups[layer][0][0]  # the job's first kv head
        for i, (lo, hi) in enumerate(self.groups[layer]):
            out, lse = results[i]  # [seqs, heads, dim], [heads, seqs]
            heads = slice((lo - first) * self.q_per_kv, (hi - first) * self.q_per_kv)
            _, lse = merge_attention([out.transpose(0, 1), cpu_out[:, heads].transpose(0, 1)],
                                     [lse, cpu_lse[:, heads].transpose(0, 1)],
                                     out=out.transpose(0, 1))  # fmt: skip
            results[i] = (out, lse)
        return results

    def _track(self, layer: int) -> None:
        """The sparse mode's moving averages: weights of this step's GPU-side tokens of all
        the layer's groups (adjacent kv heads), normalised over the GPU side (``lse``)."""
        scored, self._scored = self._scored, []
        kv_range = (scored[0][0][0], scored[-1][0][1])
        lse = torch.cat([s[2] for s in scored], dim=1).float()[..., None]  # [seqs, heads, 1]
        tracker = self.sparse
        pieces = self.pieces + ([self.window_piece] if self.window_piece is not None else [])
        for p, piece in enumerate(pieces):
            probs = torch.exp(torch.cat([s[1][p] for s in scored], dim=1) - lse)
            tracker.track(layer, kv_range, probs, piece.offsets, piece.lengths)
        if not self.fused and self.window_piece is None:  # the new token, at its position
            probs = torch.exp(torch.cat([s[1][-1] for s in scored], dim=1) - lse)
            tracker.track(layer, kv_range, probs, self.step.positions,
                          torch.ones_like(self.step.lengths))  # fmt: skip


__all__ = ["HybridTier"]
