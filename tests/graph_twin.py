"""The CPU twin of the decode and mixed steps' CUDA graphs, for tests (passed as
``EngineHooks(graphs=EagerGraphTwin)``)."""

from __future__ import annotations

import torch

from headspace.engine.mixed_graphs import MixedGraphs
from headspace.engine.paged_graphs import CapturedStep


class EagerGraphTwin(MixedGraphs):
    """The CPU twin of :class:`MixedGraphs` for tests: the same keys, padded rows, packed
    inputs and two warm-up steps of all-padding rows when a key is new, each "replay" the
    captured step run eagerly over those inputs (what a graph replays, bugs included)."""

    def _capture(self, key) -> CapturedStep:
        if key[0] == "mixed":
            return self._capture_mixed(key)
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

    def _capture_mixed(self, key) -> CapturedStep:
        values = self._mixed_pack([], 0, [], [], [], {}, key)
        inputs = torch.tensor(values, dtype=torch.long, device=self.device)
        for _ in range(1 if self.num_mixed else 2):  # the warm-up steps a capture runs
            self._mixed_step(self._mixed_views(inputs, key), key)
        return CapturedStep(None, inputs, [])

    def _replay_mixed(self, captured: CapturedStep, key, values: list[int]) -> None:
        captured.inputs.copy_(torch.tensor(values))
        self._mixed_step(self._mixed_views(captured.inputs, key), key)

    @torch.inference_mode()
    def run_mixed(self, *args) -> tuple[torch.Tensor, tuple]:
        hidden, (logits, slots) = super().run_mixed(*args)
        return hidden, (logits.clone(), slots)  # (a copy, as ``run`` makes: the buffers
        # are the next step's to overwrite; the piece's states are read before it)
