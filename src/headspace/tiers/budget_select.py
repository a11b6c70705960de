"""Which tokens each entry of the KV-budget tier keeps after a prompt: every layer's
observation scores (SnapKV's window of the prompt's last queries over its keys), ranked
where they lie, and the policy's pick per entry (:class:`BudgetSelection`, a part of
:class:`~headspace.tiers.budget.BudgetTier`; under torchrun the ranked scores are every
rank's, :class:`~headspace.tiers.budget_ranks.RankBudgetTier`)."""

from __future__ import annotations

import torch

from headspace.budgets import LAYER_LOCAL, kept_positions, observation_scores, selected_counts
from headspace.tiers.entry_slots import EntrySlots


class BudgetSelection:
    """The budget tier's selection, over the tier's ``budget``, ``head_scores`` (the
    profile's), ``plane``, ``staging``, ``window_q`` (each layer's last prompt queries),
    ``first`` (each layer's first entry), ``layer_heads`` and ``_keys``."""

    def _budget_positions(self, slots: EntrySlots, prompt_len: int) -> list[torch.Tensor]:
        """Positions each entry keeps by the budget's policy (all without a budget), on the
        CPU. Each layer's scores are ranked where they are as soon as they are scored (on a
        GPU: milliseconds, not the CPU's seconds at 128K): a layer-local policy divides the
        layer's budget by them, headkv by the profile, once for every layer."""
        if not self._picks(prompt_len):
            return [torch.arange(prompt_len)] * self.first[-1]
        heads = self._heads()
        local = self.budget.policy in LAYER_LOCAL
        counts = None if local else self._profile_counts(prompt_len)
        kept = []
        for layer in range(self.num_layers):
            ranked = self._ranked_scores(layer, self._layer_scores(layer, slots, prompt_len))
            layer_heads = None if heads is None else heads[layer : layer + 1]
            layer_counts = None if local else counts[layer : layer + 1]  # local: from ranked
            (rows,) = kept_positions(self.budget, [ranked], prompt_len, heads=layer_heads,
                                     counts=layer_counts)  # fmt: skip
            kept += torch.cat(rows).cpu().split([len(r) for r in rows]) if rows else []
        return kept

    def _picks(self, prompt_len: int) -> bool:
        """Whether the budget keeps less than a prompt of ``prompt_len`` tokens."""
        return self.budget is not None and self.budget.tokens(prompt_len) < prompt_len

    def _profile_counts(self, prompt_len: int) -> list[torch.Tensor]:
        """headkv's counts per layer, before any layer is scored: they follow from the
        profile's head scores and the ranked scores' shape alone (``[kv heads of the model,
        prompt - window]`` every layer, here meta tensors)."""
        window = min(self.budget.window, prompt_len)
        num_heads = self.head_scores.shape[1] if self.head_scores is not None else 0
        shape = torch.empty(num_heads, prompt_len - window, device="meta")
        return selected_counts(self.budget, [shape] * self.num_layers, prompt_len,
                               self.head_scores)  # fmt: skip

    def _layer_scores(self, layer: int, slots: EntrySlots, prompt_len: int) -> torch.Tensor:
        """This tier's observation scores of ``layer`` ``[kv_heads, prompt - window]``
        (on the device)."""
        window = min(self.budget.window, prompt_len)
        if not self.layer_heads[layer]:  # a rank with none of the layer's heads
            return torch.empty(0, prompt_len - window, device=self.plane.device)
        if self.staging is not None and self.staging.any(layer):  # [kv_heads, prompt, dim]
            keys = self._keys(layer, slots[layer], 0, prompt_len, True)[0]
        else:
            keys = self.plane[0][slots[layer]]
        q_window = self.window_q[layer][-window:].transpose(0, 1)
        return observation_scores(q_window, keys, pool=self.budget.pool)

    def _ranked_scores(self, layer: int, scores: torch.Tensor) -> torch.Tensor:
        """The scores the policy ranks ``layer``'s heads by, from this tier's ``scores
        [kv_heads, prompt - window]`` (on the device, where the policy runs): the same."""
        return scores

    def _heads(self) -> list[list[int]] | None:
        """Per layer, the heads of the ranked scores this tier holds (None: all)."""
        return None
