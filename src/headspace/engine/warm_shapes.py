"""What a warm-up runs: its request and decode batches (:func:`warm_up_request`,
:func:`warm_up_batches`), and the shapes a server's warm-up meets beyond its own requests:
the decode step's CUDA graph of every batch bucket and block-table width a prompt of up to
a chunk meets, with mixed steps the graph of every piece the scheduler's cap gives beside
each batch bucket, and cuDNN's plan of every causal square such a prompt's prefill runs.

Without them a fresh server's first burst (16 requests of 1K-8K tokens, pages of 128, on an
H100) captured a graph of each new (batch, width) pair (about 0.1 s each) and built a plan
for each new prompt length's square (about 0.05 s each) while users waited: its first
tokens 1.9x a warm server's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from headspace.attention.sdpa import causal_plan_rows, cudnn_runs, warm_causal_plans
from headspace.engine.mixed_graphs import MOST_GRAPHED_KEYS
from headspace.tiers.base import MIN_WIDTH, bucket

if TYPE_CHECKING:
    from headspace.engine.lanes import Lanes
    from headspace.model.llama import LlamaModel


WARM_UP_DECODE_TOKENS = 4  # decode steps a warm-up request takes (the graph of its batch)
# tokens of a warm-up piece of no chunk's length: above 1, which compiled code specialises
WARM_UP_PIECE = 17


def warm_up_request(prompt_len: int, chunk: int, decode: bool) -> tuple[int, int]:
    """(prompt tokens, new tokens) of the request a warm-up runs (``Engine.warm_up``); 0
    tokens stands for the short text "Warm-up.". Without ``prompt_len`` (or for one of at
    most 16 tokens), that short request; else one of synthetic tokens whose prefill takes the
    shapes of a ``prompt_len`` prompt in chunks of ``chunk``: a full chunk (which compiles
    for its own size) and the last piece (for any), at most two chunks. It decodes
    WARM_UP_DECODE_TOKENS tokens with ``decode``, else stops at its first token."""
    length = min(prompt_len, chunk + (prompt_len % chunk or chunk))
    return (length if length > 16 else 0), (WARM_UP_DECODE_TOKENS if decode else 1)


def warm_up_batches(batch: int, max_batch: int) -> list[int]:
    """The decode batch sizes a warm-up runs after its first request so that every batch
    bucket up to ``batch`` (at most ``max_batch``) has its decode step compiled and
    captured: 2, 4, 8, ... (each a bucket of its own; 1 is the first request's)."""
    top, sizes, size = min(batch, max_batch), [], 2
    while size // 2 < top:  # the bucket of ``size`` holds more than the one before
        sizes.append(min(size, top))
        size *= 2
    return sizes


def batch_buckets(sizes: list[int]) -> list[int]:
    """The batch buckets of 1 and ``sizes`` (the warm-up's decode batches,
    :func:`warm_up_batches`), in order."""
    return sorted({bucket(size) for size in [1, *sizes]})


def decode_graph_keys(prompt_len: int, page_size: int, sizes: list[int]) -> list[tuple[int, int]]:
    """``(batch bucket, block-table width in pages)`` of every decode step that a batch of
    at most ``max(sizes)`` sequences (1 and ``sizes``: the warm-up's decode batches,
    :func:`warm_up_batches`) of up to ``prompt_len`` tokens each
    (``page_size`` tokens a page) meets: each batch bucket at each width bucket from
    :data:`MIN_WIDTH` to the prompt's."""
    widest = bucket(-(-prompt_len // page_size), MIN_WIDTH)
    widths = [MIN_WIDTH << shift for shift in range((widest // MIN_WIDTH).bit_length())]
    return [(batch, width) for batch in batch_buckets(sizes) for width in widths]


def mixed_pieces(widest: Callable[[int, int], int], row_tokens: int, arena_tokens: int,
                 page_size: int, sizes: list[int]) -> list[tuple[int, int]]:  # fmt: skip
    """``(piece rows, decode rows)`` of every mixed step that a batch of at most
    ``max(sizes)`` decoding sequences (1 and ``sizes``, as :func:`decode_graph_keys`) of up
    to ``row_tokens`` tokens each (the longest a mixed graph takes), ``arena_tokens`` in all,
    meets: at each batch bucket, pieces of every whole number of pages up to ``widest(rows,
    context tokens)`` (the scheduler's
    :meth:`~headspace.engine.prompt_pieces.PromptPieces.widest_mixed_piece`, which grows with
    the rows' context: their K/V read is as long whatever the piece) beside that many rows
    at their longest, and one page more: a prompt's last piece, of fewer tokens than whole
    pages hold, may cost within the cap with its last page partly filled (a fresh server's
    burst captured such keys while serving, pieces of 256 rows beside a widest piece of one
    128-token page: H100)."""
    pieces = []
    for batch in batch_buckets(sizes):
        most = widest(batch, min(batch * row_tokens, arena_tokens)) + page_size
        pieces += [(rows, batch) for rows in range(page_size, most + 1, page_size)]
    return pieces


def warm_shapes(lanes: Lanes, model: LlamaModel, prompt_len: int, sizes: list[int],
                report: Callable[[str], None] | None, started: float) -> int:  # fmt: skip
    """Capture the resident lane's decode graphs of :func:`decode_graph_keys` (where its
    layout's graphs are plain: :meth:`PagedRunner.capture_decode_graphs`), then, under the
    sdpa backend where cuDNN runs, build the plan of every causal square of a prompt of up
    to a chunk (:func:`warm_causal_plans`, on this thread: the one the resident lane
    prefills on), each told to ``report`` (a progress line, seconds since ``started``): the
    graphs once captured (where any were new), the plans as they start. Returns the graphs
    and plans that were new."""
    runner, runtime = lanes.resident.runner, lanes.config.runtime

    def told(what: str) -> None:
        if report is not None:
            report(f"warm-up: {what} ({time.perf_counter() - started:.0f} s so far)")

    scheduler, page = lanes.resident.scheduler, lanes.spec.page_size
    keys = decode_graph_keys(prompt_len, page, sizes) if sizes else []
    made = runner.capture_decode_graphs(keys)
    if made:
        widths = sorted({width for _, width in keys})
        told(f"decode graphs of {len(widths)} widths, {widths[0]} to {widths[-1]} pages a "
             f"row, batch buckets 1 to {keys[-1][0]}: {made} captured")  # fmt: skip
    row_tokens = min(lanes.max_context, MOST_GRAPHED_KEYS)  # (a graph's packed width)
    arena_tokens = scheduler.blocks.pool.num_pages * page
    pieces = mixed_pieces(scheduler.widest_mixed_piece, row_tokens, arena_tokens, page,
                          sizes) if sizes and scheduler.mixes else []  # fmt: skip
    mixed = runner.capture_mixed_graphs(pieces)
    if mixed:
        told(f"mixed step graphs of {len(pieces)} pieces, {pieces[0][0]} to "
             f"{max(rows for rows, _ in pieces)} rows beside 1 to {pieces[-1][1]} decode rows: "
             f"{mixed} captured")  # fmt: skip
    made += mixed
    dtype, device = runtime.torch_dtype, runner.device
    if runtime.attention_backend != "sdpa" or not cudnn_runs(dtype, device):
        return made
    rows = causal_plan_rows(lanes.chunk)
    if not rows:  # (a chunk of at most 3 tokens: no square cuDNN pads)
        return made
    told(f"cuDNN attention plans of {len(rows)} causal squares, {rows[0]} to {rows[-1]} rows")
    shapes = {layer.shape for layer in model.layers if layer.shape[1]}  # (a rank's heads)
    for heads, kv_heads, head_dim in sorted(shapes):
        made += warm_causal_plans(heads, kv_heads, head_dim, dtype, device, lanes.chunk)
    return made


__all__ = ["batch_buckets", "decode_graph_keys", "mixed_pieces", "warm_shapes"]
