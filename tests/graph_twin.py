"""The CPU twin of the decode step's CUDA graphs, for tests (passed as
``EngineHooks(graphs=EagerGraphTwin)``)."""

from __future__ import annotations

import torch

from headspace.engine.paged_graphs import CapturedStep, DecodeGraphs


class EagerGraphTwin(DecodeGraphs):
    """The CPU twin of :class:`DecodeGraphs` for tests: the same keys, padded rows, packed
    inputs and two warm-up steps of all-padding rows when a key is new, each "replay" the
    captured step run eagerly over those inputs (what a graph replays, bugs included)."""

    def _capture(self, key) -> CapturedStep:
        inputs = torch.tensor(self._pack([], [], {}, key), dtype=torch.long, device=self.device)
        views = self._views(inputs, key)
        for _ in range(2):  # the warm-up steps a capture runs, every row padding
            self._step(views, key)
        return CapturedStep(None, inputs, [])

    @torch.inference_mode()
    def run(self, slots: list[int], positions: list[int],
            pages: dict[str, list[list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        num_seqs, key = len(slots), self._key(positions, pages)
        captured = self._captured(key, num_seqs)
        captured.inputs.copy_(torch.tensor(self._pack(slots, positions, pages, key)))
        self._step(self._views(captured.inputs, key), key)
        per_row, _ = self._columns(key)
        # a copy: on the CPU nothing else would copy the shared buffer before the next step
        return self.logits[:num_seqs].clone(), captured.inputs[: num_seqs * per_row : per_row]
