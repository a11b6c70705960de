"""The runner's prompt steps: per-sequence chunked prefill over the layout in force, a few
layers a step where every tier allows it, and the budgets' compression after the last chunk.
A mixin of :class:`~headspace.engine.paged_runner.PagedRunner` (its model, tiers, token slots
and hooks); nothing here changes the layout."""

from __future__ import annotations

import torch

from headspace.kv.block_table import Pages
from headspace.model.llama import SliceStates
from headspace.tiers import StepInputs, attend_tiers


class PrefillSteps:
    """Prompt steps of a :class:`~headspace.engine.paged_runner.PagedRunner`."""

    def _attention(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        if self.attention_hook is not None:
            return self.attention_hook(layer, q, kv)
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
        ids = torch.tensor(seq.prompt_ids[start:end], device=self.device)
        positions = torch.arange(start, end, device=self.device)
        first_layer = 0 if layers is None else layers[0]
        step = StepInputs(False, positions, [], pages, start=start, seq_ids=[seq.seq_id],
                          first_layer=first_layer)  # fmt: skip
        self.hybrid_share.other_work = True
        for tier in self.tiers:
            tier.begin(step)
        mode = "eager"
        if self._compiled:  # static shapes for full chunks: one compile per chunk size
            mode = "static" if static else "dynamic"
        return self.model(ids, positions, self._attention, mode, layers, hidden)

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
