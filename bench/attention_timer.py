"""Each rank's attention time in a benchmark: CUDA events around every layer's tiers'
submits, per phase, through eager steps and CUDA-graph replays alike (``bench/multigpu.py``)."""

from __future__ import annotations

import weakref

import torch


def _steps(layer_ms: list[float], num_layers: int) -> list[list[float]]:
    """Eager decode steps' attention: consecutive layers' times, a list per step."""
    return [layer_ms[i : i + num_layers] for i in range(0, len(layer_ms) - num_layers + 1,
                                                         num_layers)]  # fmt: skip


def _per_layer(layer_ms: list[float], num_layers: int) -> list[float]:
    """Each layer's seconds summed over the passes ``layer_ms`` (in ms) holds in order."""
    return [sum(layer_ms[layer::num_layers]) / 1000 for layer in range(num_layers)]


class AttentionTimer:
    """Wraps the runners' attention (``EngineHooks(attention_hook=timer)``): CUDA events
    around every layer's submits, per phase.

    Given when the engine is made (before the warm-up request), so the decode graphs
    captured then hold its events (external ones, recorded again at every replay; about 64
    event nodes a step). The graphs call ``graph_step`` before each graph step, naming the
    graph it captures or replays: a capture's eager warm-up steps (padding) are skipped, and
    a replay's events are read just before the next graph step (the step between them
    waited for its sampled tokens, so no extra wait): every graph step is timed, as every
    eager step is. Events are kept per graphs object (one a layout, made anew when the
    tables grow), for as long as it lives."""

    def __init__(self):
        self.events = {"prefill": [], "decode": []}
        # graphs object -> graph key -> its layers' events (start, end)
        self.captured: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.capturing, self.last, self.warming = None, None, False
        self.replayed_ms: list[list[float]] = []  # each timed graph step's layers, in ms
        self.num_steps = 0  # the decode steps the last reading averaged
        self.rows, self.step_rows = None, None  # decode steps timed: all, or of ``rows``

    def graph_step(self, graphs, key, capture: bool, num_seqs: int) -> None:
        """``graphs`` is about to replay the graph of ``key`` for ``num_seqs`` sequences,
        capturing it first if ``capture``: the last replay's events read, this one's noted."""
        self.read_replay()
        self.step_rows = num_seqs
        events = self.captured.setdefault(graphs, {})
        if capture:
            self.warming = True  # until the capture's first layer
            self.capturing = events[key] = []
        # (None: captured before this timer, or a step of other than the rows timed)
        self.last = events.get(key) if self._counted() else None

    def restart(self, rows: int | None = None) -> None:
        """Forget the steps timed so far (the graphs' events stay theirs); with ``rows``, time
        from now on only the decode steps of that many sequences (a batch's, once every
        prompt is in: the smaller steps while the prompts come in would dilute the mean)."""
        self.events = {"prefill": [], "decode": []}
        self.replayed_ms, self.last = [], None
        self.rows, self.step_rows = rows, None

    def _counted(self) -> bool:
        """Whether the decode step running now is one timed."""
        return self.rows is None or self.step_rows == self.rows

    def read_replay(self) -> None:
        """The last replayed graph's attention (its layers' events), before they record again."""
        replayed, self.last = self.last, None
        if not replayed:
            return
        replayed[-1][1].synchronize()
        self.replayed_ms.append([s.elapsed_time(e) for s, e in replayed])

    def __call__(self, tiers, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)
        capturing = torch.cuda.is_current_stream_capturing()
        start, end = (torch.cuda.Event(enable_timing=True, external=capturing) for _ in "se")
        start.record()
        for tier in tiers:
            tier.submit(layer, q, kv, out)
        end.record()
        for tier in tiers:
            tier.collect(layer)
        if capturing:
            self.warming = False  # the capture's warm-up steps are done
            self.capturing.append((start, end))
        elif not self.warming:
            phase = "decode" if tiers[0].step.decode else "prefill"
            self.step_rows = q.shape[0]  # an eager decode step: a token a sequence
            if phase == "prefill" or self._counted():
                self.events[phase].append((start, end))
        return out

    def close(self) -> None:
        """Drop the events kept (the graphs' too)."""
        self.captured, self.capturing, self.last = {}, None, None

    def seconds(self, num_layers: int) -> dict[str, float | list[float]]:
        """Attention seconds: the prompt's chunks in all, its last chunk (what the cost model
        prices for prefill) and one decode step (the mean over the eager and replayed steps
        timed), each also per layer (``*_layers``: a step waits for each layer's slowest rank)."""
        torch.cuda.synchronize()
        self.read_replay()
        ms = {phase: [s.elapsed_time(e) for s, e in pairs] for phase, pairs in self.events.items()}
        steps = [*self.replayed_ms, *_steps(ms["decode"], num_layers)]
        self.num_steps = len(steps)  # the decode steps the mean is over
        decode = [sum(layer) / 1000 / len(steps) for layer in zip(*steps, strict=True)]
        last = ms["prefill"][-num_layers:]
        return {"prefill": sum(ms["prefill"]) / 1000, "prefill_last_chunk": sum(last) / 1000,
                "decode_step": sum(decode),
                "prefill_layers": _per_layer(ms["prefill"], num_layers),
                "prefill_last_chunk_layers": [x / 1000 for x in last],
                "decode_step_layers": decode}  # fmt: skip
