"""CUDA graphs of a mixed step: a prompt piece and the decode rows in one forward, replayed.

Eager, a mixed step waits for the host: about 30 ms of launches a step for Llama-3.1-8B on
an H100, several times its GPU work (bench/NOTES.md, "One forward for a piece and the decode
rows"); graphed, a step of 550 prompt tokens beside 8 decode rows took about 19 ms, the host
waiting for the GPU ("The mixed step in a CUDA graph"). A graph of it is keyed by the decode
rows' batch bucket and the piece's rows in whole pages; the piece's first position, its
length and its pages are device values (the piece's attention reads them:
``attention.triton_piece``), so one graph serves every piece of its bucket, wherever it
falls in its prompt. Padding rows of the piece store their K/V into a scratch slot that no
sequence owns and attend nothing. Every table, the piece's and the decode rows', is packed
at one width (``mixed_width``), which keeps the width out of the key.
"""

from __future__ import annotations

import torch

from headspace.engine.paged_graphs import CapturedStep, DecodeGraphs, GraphSite
from headspace.model.llama import DEVICE_LOCK
from headspace.tiers import StepInputs, Tier
from headspace.tiers.base import bucket

# the most rows a graphed piece has: a larger one runs eagerly (each bucket is a graph of
# its own for every decode key, and its activations sit in the graphs' pool)
MOST_GRAPHED_PIECE = 1024
# the most keys a graphed piece's sequence holds: the piece kernel does not split its keys,
# so a piece of a page deep in a long prompt (a step's work there is a page or two) would
# run in a few programs over all of them, a fraction of the SMs, the decode rows waiting;
# past this the step runs eagerly (flash, over the prefix in pieces)
MOST_GRAPHED_KEYS = 16384


class MixedGraphs(DecodeGraphs):
    """The decode step's graphs (:class:`DecodeGraphs`) and the mixed step's: ``run_mixed``
    replays a piece and decode rows in one captured forward. Both kinds of graph share
    one table, a mixed step's key tagged "mixed" (its inputs: the decode rows' as
    :class:`DecodeGraphs` packs them, then the piece's)."""

    def __init__(self, site: GraphSite, tiers: list[Tier], pool) -> None:
        """As :class:`DecodeGraphs`; ``site.piece_width``: pages of the longest sequence
        (see :attr:`mixed_width`)."""
        super().__init__(site, tiers, pool)
        self.piece_width = site.piece_width
        # made at the first mixed step: the piece rows' offsets from its first position, and
        # its last-layer states, written by every mixed graph (one buffer, where an output
        # per graph would keep its rows in the graphs' pool)
        self._offsets: torch.Tensor | None = None  # [rows]
        self.piece_hidden: torch.Tensor | None = None  # [rows, hidden]

    @property
    def num_mixed(self) -> int:
        """Mixed steps' graphs captured (or, in a twin, keys met)."""
        return sum(key[0] == "mixed" for key in self._graphs)

    @property
    def mixed_width(self) -> int:
        """Pages of every table a mixed graph packs, the piece's and the decode rows': the
        most a graphed sequence holds (``piece_width``, within :data:`MOST_GRAPHED_KEYS`
        keys). One width for every step keeps the width out of the key: a burst's requests
        grow through several widths while prompts arrive, and each key is a capture."""
        return min(self.piece_width, MOST_GRAPHED_KEYS // self.page_size)

    def accepts_mixed(self, piece_rows: int, piece_pages: int, decode_pages: int) -> bool:
        """Whether a mixed step with a piece of ``piece_rows`` (of a sequence of
        ``piece_pages`` pages) and decode rows of at most ``decode_pages`` pages runs as a
        graph: every tier mixes in graphs, nothing staged or attended outside them, the
        blocks compiled once for every row count (not tuned per count: each new piece would
        compile while serving), the piece not past :data:`MOST_GRAPHED_PIECE`, every
        sequence within :attr:`mixed_width` pages."""
        tiers_mix = all(tier.mixes_in_graphs for tier in self.tiers)
        widest = max(piece_pages, decode_pages)
        fits = 0 < piece_rows <= MOST_GRAPHED_PIECE and 0 < widest <= self.mixed_width
        return tiers_mix and self.plain and fits and self.blocks_mode != "tuned"

    def _mixed_key(self, piece_rows: int, num_seqs: int) -> tuple:
        rows = -(-piece_rows // self.page_size) * self.page_size  # whole pages
        return "mixed", bucket(num_seqs), self.mixed_width, rows

    def _mixed_columns(self, key) -> tuple[int, int]:
        """(int64 values of the decode rows, of the piece) in the inputs of ``key``."""
        _, batch, gpu_width, piece_rows = key
        per_row, _ = self._columns((batch, gpu_width, 0))
        return batch * per_row, 2 * piece_rows + 2 + gpu_width

    def _mixed_views(self, inputs: torch.Tensor, key) -> tuple[dict, dict]:
        _, batch, gpu_width, rows = key
        decode_values, _ = self._mixed_columns(key)
        decode = self._views(inputs[:decode_values], (batch, gpu_width, 0))
        piece = inputs[decode_values:]
        return decode, {"ids": piece[:rows], "slots": piece[rows : 2 * rows],
                        "start": piece[2 * rows : 2 * rows + 1],
                        "rows": piece[2 * rows + 1 : 2 * rows + 2],
                        "table": piece[2 * rows + 2 :]}  # fmt: skip

    def _mixed_pack(self, piece_ids: list[int], start: int, piece_pages: list[int],
                    slots: list[int], positions: list[int], pages: dict,
                    key) -> list[int]:  # fmt: skip
        """A mixed step's inputs as one flat list of int64 values (see ``_mixed_views``)."""
        _, batch, gpu_width, rows = key
        values = self._pack(slots, positions, pages, (batch, gpu_width, 0))
        size, scratch = self.page_size, self.scratch_page * self.page_size
        kv_slots = [piece_pages[p // size] * size + p % size
                    for p in range(start, start + len(piece_ids))]  # fmt: skip
        values += list(piece_ids) + [0] * (rows - len(piece_ids))
        values += kv_slots + [scratch] * (rows - len(piece_ids))
        values += [start, len(piece_ids)]
        padding = [self.scratch_page] * (gpu_width - len(piece_pages))
        return values + list(piece_pages) + padding

    def _mixed_step(self, views: tuple[dict, dict], key) -> None:
        """The captured work: the piece's rows and the decode rows through the model, the
        piece's last-layer states into :attr:`piece_hidden`, the decode rows' logits into
        the shared buffer and their greedy picks into their slots."""
        decode_views, piece_views = views
        rows = key[3]
        positions = decode_views["positions"]
        decode = StepInputs(True, positions, [], {}, {"gpu": decode_views["gpu"]}, positions + 1)
        piece_positions = piece_views["start"] + self._offsets[:rows]
        piece = StepInputs(False, piece_positions, [], {})
        for tier in self.tiers:
            tier.begin_graph_mixed(piece, decode, piece_views)
        slots = decode_views["slots"]
        ids = torch.cat([piece_views["ids"], self.tokens.index_select(0, slots)])
        hidden = self.model(ids, torch.cat([piece_positions, positions]), self._attention,
                            self.blocks_mode)  # fmt: skip
        logits = self.logits[: slots.shape[0]]
        logits.copy_(self.model.logits(hidden[rows:]))
        self.tokens.index_copy_(0, slots, logits.argmax(-1))
        self.piece_hidden[:rows].copy_(hidden[:rows])

    def _capture(self, key) -> CapturedStep:
        return self._capture_mixed(key) if key[0] == "mixed" else super()._capture(key)

    def _capture_name(self, key) -> str:
        if key[0] != "mixed":
            return super()._capture_name(key)
        _, batch, width, piece_rows = key
        return f"mixed step CUDA graph: batch {batch}, {width} pages a row, piece {piece_rows}"

    def _piece_buffers(self) -> None:
        """Made before the first mixed capture: the piece rows' offsets and the buffer of
        its last-layer states."""
        if self.piece_hidden is not None:
            return
        most = -(-MOST_GRAPHED_PIECE // self.page_size) * self.page_size  # a bucket's rows
        self._offsets = torch.arange(most, device=self.device)
        self.piece_hidden = torch.empty(most, self.model.config.hidden_size, device=self.device,
                                        dtype=self.model.lm_head.weight.dtype)  # fmt: skip

    @torch.inference_mode()
    def capture_mixed(self, piece_rows: int, num_seqs: int) -> bool:
        """Capture now the mixed step of a piece of ``piece_rows`` beside ``num_seqs`` decode
        rows (every row padding), where such a step runs as a graph; False where it was
        captured already or would not run as one (a server's warm-up: the pieces its
        scheduler gives a burst)."""
        key = self._mixed_key(piece_rows, num_seqs)
        if key in self._graphs or not self.accepts_mixed(piece_rows, 1, 1):
            return False
        self._piece_buffers()
        self._captured(key, 0)
        return True

    def _capture_mixed(self, key) -> CapturedStep:
        decode_values, piece_values = self._mixed_columns(key)
        inputs = torch.zeros(decode_values + piece_values, dtype=torch.long, device=self.device)
        staging = [torch.empty(inputs.shape, dtype=torch.long, pin_memory=True) for _ in range(2)]
        staging[0].copy_(torch.tensor(self._mixed_pack([], 0, [], [], [], {}, key)))
        inputs.copy_(staging[0])  # every row padding: writes go to scratch slots
        views = self._mixed_views(inputs, key)
        with DEVICE_LOCK:
            if not self._rows_compiled:
                self._compile_rows()
            # after the first, one warm-up step: the blocks' rows are symbolic and the piece
            # kernel's lengths run-time values, so a new key compiles nothing (a burst's
            # first steps captured new keys at 48 ms a step against 19: bench/NOTES.md)
            graph = self._capture_into(views, key, self._mixed_step,
                                       warm_ups=1 if self.num_mixed else 2)  # fmt: skip
        return CapturedStep(graph, inputs, staging)

    def _replay_mixed(self, captured: CapturedStep, key, values: list[int]) -> None:
        """The captured step of ``key`` over ``values`` (its packed inputs; the tests'
        twin runs the step instead)."""
        self._replay(captured, values)

    @torch.inference_mode()
    def run_mixed(self, piece_ids: list[int], start: int, piece_pages: list[int],
                  slots: list[int], positions: list[int],
                  pages: dict[str, list[list[int]]]) -> tuple[torch.Tensor, tuple]:  # fmt: skip
        """One mixed step: prompt tokens ``piece_ids`` from position ``start`` of a sequence
        whose pages are ``piece_pages`` (their K/V stored there), and one decode token for
        each of ``slots`` as :meth:`run` takes them. Returns the piece's hidden states
        ``[tokens, hidden]`` and the decode rows' ``(logits, slots on the device)``, each
        overwritten by the next call."""
        num_seqs = len(slots)
        key = self._mixed_key(len(piece_ids), num_seqs)
        self._piece_buffers()
        captured = self._captured(key, num_seqs)
        values = self._mixed_pack(piece_ids, start, piece_pages, slots, positions, pages, key)
        self._replay_mixed(captured, key, values)
        per_row, _ = self._columns((key[1], key[2], 0))
        decode = (self.logits[:num_seqs], captured.inputs[: num_seqs * per_row : per_row])
        return self.piece_hidden[: len(piece_ids)], decode


__all__ = ["MOST_GRAPHED_KEYS", "MOST_GRAPHED_PIECE", "MixedGraphs"]
