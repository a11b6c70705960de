"""The runner's prompt steps: per-sequence chunked prefill over the layout in force, a few
layers a step where every tier allows it, a piece and the decode rows in one forward where
every tier mixes them, and the budgets' compression after the last chunk. A mixin of
:class:`~headspace.engine.paged_runner.PagedRunner` (its model, tiers, token slots and
hooks); nothing here changes the layout."""

from __future__ import annotations

from functools import partial

import torch

from headspace.engine.mixed_graphs import MixedGraphs
from headspace.engine.step_plan import PrefillPiece
from headspace.kv.block_table import Pages
from headspace.kv.transfer import device_ints
from headspace.model.llama import SliceStates
from headspace.tiers import StepInputs, attend_tiers


class PrefillSteps:
    """Prompt steps of a :class:`~headspace.engine.paged_runner.PagedRunner`."""

    def _attention(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        if self.attention_hook is not None:
            return self.attention_hook(self.tiers, layer, q, kv)
        return attend_tiers(self.tiers, layer, q, kv)

    @torch.inference_mode()
    def prefill(self, seq, chunk: int, pages: Pages, *, all_logits: bool = False,
                slot: int | None = None) -> torch.Tensor:  # fmt: skip
        """The prompt tokens of ``seq`` not in the prefix cache, ``chunk`` at a time, over its
        ``pages``: the last token's fp32 logits ``[vocab]`` on the device (its greedy pick
        into token ``slot``), or with ``all_logits`` every computed token's ``[tokens,
        vocab]`` on the CPU."""
        hidden, rows = None, []
        for start in range(seq.num_cached, len(seq.prompt_ids), chunk):
            end = min(start + chunk, len(seq.prompt_ids))
            hidden = self.prefill_chunk(seq, start, end, pages, static=end - start == chunk)
            if all_logits:
                rows.append(self.model.logits(hidden).cpu())
        if all_logits:
            self.end_prefill(seq, None, None)
            return torch.cat(rows)
        return self.end_prefill(seq, hidden, slot)

    @property
    def layer_slices(self) -> bool:
        """Whether a prefill chunk may run a few layers a step under this layout (every
        tier allows it; not with streamed weights or under torchrun)."""
        if self.model.layer_source is not None or self.layout is not None:
            return False
        return all(tier.layer_slices for tier in self.tiers)

    @property
    def mixes(self) -> bool:
        """Whether a step may run a prompt piece and the decode rows through the layers in
        one forward under this layout (:meth:`mixed`): asked for (``mixed_steps``), every
        tier mixes (``Tier.mixes``), the prompt computed (no benchmark's stand-in); not yet
        with streamed weights or under torchrun (untested there)."""
        if self.model.layer_source is not None or self.layout is not None:
            return False
        return (self.config.runtime.mixed_steps and self.prompt_stand_in is None
                and bool(self.tiers) and all(tier.mixes for tier in self.tiers))  # fmt: skip

    @torch.inference_mode()
    def mixed(self, piece: PrefillPiece, seq_ids: list[int], positions: list[int],
              slots: list[int], pages: Pages) -> tuple[torch.Tensor, tuple]:  # fmt: skip
        """One forward over a prompt ``piece`` (through every layer) and one decode token
        for each of ``seq_ids`` (as :meth:`decode` takes them): the linear layers read the
        weights once for both. Returns the piece's last-layer hidden states ``[tokens,
        hidden]`` and the decode rows' result (fp32 logits ``[seqs, vocab]``, the slots on
        the device; each greedy pick written into its slot). Runs through ``decode_hooks``
        as a decode step of ``seq_ids``."""
        held: dict[str, torch.Tensor] = {}
        step = partial(self._mixed, piece, seq_ids, positions, slots, pages, held)
        for hook in self.decode_hooks:
            step = partial(hook, seq_ids, step)
        result = step()
        return held["hidden"], result

    def runs_mixed(self, piece: PrefillPiece, pages: Pages) -> bool:
        """Whether a planned mixed step of ``piece`` beside decode rows of ``pages`` runs as
        one forward: as a graph where this layout's decode steps are graphs, eagerly where
        there are none. Where the graphs refuse it (a piece past ``MOST_GRAPHED_PIECE``
        rows, a sequence past their packed width, blocks tuned per row count), False: two
        forwards, the decode step's a graph (an eager forward of an 8B model costs about
        30 ms of launches, bench/NOTES.md)."""
        return self._graphs is None or self._mixed_graphs(piece, pages) is not None

    def _mixed_graphs(self, piece: PrefillPiece, pages: Pages) -> MixedGraphs | None:
        """This layout's graphs where one of them takes the mixed step of ``piece`` beside
        decode rows of ``pages`` (:meth:`MixedGraphs.accepts_mixed`), else None."""
        graphs = self._graphs
        widest = max(map(len, pages.get("gpu", [[]])))
        takes = isinstance(graphs, MixedGraphs) and graphs.accepts_mixed(
            piece.end - piece.start, len(piece.pages["gpu"][0]), widest)  # fmt: skip
        return graphs if takes else None

    def _mixed(self, piece: PrefillPiece, seq_ids: list[int], positions: list[int],
               slots: list[int], pages: Pages, held: dict) -> tuple:  # fmt: skip
        for tier in self.tiers:
            tier.before_decode(seq_ids, slots)
        graphs = self._mixed_graphs(piece, pages)
        if graphs is not None:
            self.hybrid_share.other_work = True
            held["hidden"], result = graphs.run_mixed(
                piece.seq.prompt_ids[piece.start : piece.end], piece.start,
                piece.pages["gpu"][0], slots, positions, pages)  # fmt: skip
            return result
        prompt, piece_step = self._piece_inputs(piece.seq, piece.start, piece.end, piece.pages)
        decode_step = self._decode_inputs(seq_ids, positions, pages)
        for tier in self.tiers:
            tier.begin_mixed(piece_step, decode_step)
        slot_index = device_ints(slots, self.device)
        ids = torch.cat([prompt, self.tokens[slot_index]])  # [piece + seqs]
        mode = "dynamic" if self._compiled else "eager"
        hidden = self.model(ids, torch.cat([piece_step.positions, decode_step.positions]),
                            self._attention, mode)  # fmt: skip
        rows = len(prompt)
        held["hidden"] = hidden[:rows]
        return self._picks(hidden[rows:], slot_index)

    def _piece_inputs(self, seq, start: int, end: int, pages: Pages,
                      first_layer: int = 0) -> tuple[torch.Tensor, StepInputs]:  # fmt: skip
        """Prompt tokens ``start .. end-1`` of ``seq`` on the device ``[tokens]`` and the
        tiers' inputs of their piece (a prompt step: other work than a decode step's)."""
        self.hybrid_share.other_work = True
        ids = torch.tensor(seq.prompt_ids[start:end], device=self.device)
        positions = torch.arange(start, end, device=self.device)
        return ids, StepInputs(False, positions, [], pages, start=start, seq_ids=[seq.seq_id],
                               first_layer=first_layer)  # fmt: skip

    @torch.inference_mode()
    def prefill_chunk(self, seq, start: int, end: int, pages: Pages, static: bool = True,
                      layers: tuple[int, int] | None = None,
                      hidden: SliceStates | None = None) -> torch.Tensor | SliceStates:  # fmt: skip
        """Compute prompt tokens ``start .. end-1`` of ``seq`` (those before are in its
        ``pages``, one table per tier); returns their last layer's hidden states ``[tokens,
        hidden]``. ``static``: the chunk's length recurs (compiled once for it). ``layers``
        (first, end): only those decoder layers, from ``hidden`` (the previous slice's
        result) where ``first`` > 0 (see :attr:`layer_slices`); a slice before the last
        returns the :data:`~headspace.model.llama.SliceStates` the next one starts from."""
        if self.prompt_stand_in is not None:  # a benchmark's: nothing computed
            return torch.zeros(end - start, self.model.config.hidden_size, device=self.device,
                               dtype=self.config.runtime.torch_dtype)  # fmt: skip
        first_layer = 0 if layers is None else layers[0]
        ids, step = self._piece_inputs(seq, start, end, pages, first_layer)
        for tier in self.tiers:
            tier.begin(step)
        mode = "eager"
        if self._compiled:  # static shapes for full chunks: one compile per chunk size
            mode = "static" if static else "dynamic"
        return self.model(ids, step.positions, self._attention, mode, layers, hidden)

    @torch.inference_mode()
    def end_prefill(self, seq, hidden: torch.Tensor | None, slot: int | None):
        """After the last chunk of ``seq``: per-head budgets compress it; returns the last
        token's fp32 logits ``[vocab]`` from ``hidden`` (its greedy pick goes into token
        ``slot``), or None without."""
        stand_in = self.prompt_stand_in
        counts = None if stand_in is None else stand_in(seq.prompt_ids)
        for tier in self.tiers:  # budgets compress what the prompt left
            tier.after_prefill(seq.seq_id, len(seq.prompt_ids), counts)
        if hidden is None:
            return None
        logits = self.model.logits(hidden[-1:])[0]
        if slot is not None:
            self.tokens[slot] = logits.argmax()
        return logits


__all__ = ["PrefillSteps"]
