"""The stream tier's pieces: history pages gathered into one staging slot together, for a
prefill chunk (one sequence's prefix) or a decode step (every sequence's history,
concatenated)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from headspace.kv.transfer import device_ints
from headspace.tiers.base import MIN_WIDTH, StepInputs, bucket

MAX_COPY_RUNS = 16  # a piece in at most this many runs of adjacent pages uses the copy engine


@dataclass
class Piece:
    """History pages gathered together: host ``pages`` (on the device), the same as runs of
    adjacent pages (first host page, first staging page, count), and at decode each
    sequence's staging pages (``tables``) and keys in the piece (``lengths``)."""

    pages: torch.Tensor
    num_tokens: int
    tables: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    runs: list[tuple[int, int, int]] | None = None
    count: torch.Tensor | None = None  # pages in use, on the device (CUDA-graph steps)
    offsets: torch.Tensor | None = None  # at decode: each sequence's first position in it
    width: int = 0  # at decode: the most keys of one sequence in it
    slots: torch.Tensor | None = None  # sparse hybrid: staging slots of its keys [seqs, width]
    block_mask: object = None  # the flex backend's mask of its decode, built at first use


def page_runs(pages: list[int]) -> list[tuple[int, int, int]]:
    """``pages`` as runs of adjacent pages: (first page, index of it in the list, count)."""
    runs = []
    for index, page in enumerate(pages):
        if runs and page == runs[-1][0] + runs[-1][2]:
            first, at, count = runs[-1]
            runs[-1] = (first, at, count + 1)
        else:
            runs.append((page, index, 1))
    return runs


def history_pieces(pages: list[int], num_tokens: int, piece_pages: int, page_size: int,
                   device: torch.device) -> list[Piece]:  # fmt: skip
    """One sequence's history of ``num_tokens`` in ``pages``, in runs of one slot
    (``piece_pages`` pages)."""
    pieces, size = [], piece_pages * page_size
    for first in range(0, len(pages), piece_pages):
        run = pages[first : first + piece_pages]
        tokens = min(size, num_tokens - first * page_size)
        pieces.append(Piece(device_ints(run, device), tokens, runs=page_runs(run)))
    return pieces


def decode_pieces(step: StepInputs, first_pages: list[int], piece_pages: int, page_size: int,
                  device: torch.device,
                  last_pages: list[int] | None = None) -> tuple[list[Piece], bool]:  # fmt: skip
    """Every sequence's host pages from ``first_pages`` on (up to ``last_pages``, exclusive,
    where given: the rest is in the GPU window), concatenated, in runs of one slot; and
    whether all of it fits one slot, the page of the new token included (the kernel then
    appends it in staging: *fused*; never with ``last_pages``)."""
    positions, host, size = step.positions_list, step.pages["host"], page_size
    staged = [-(-(p + 1) // size) - first for p, first in zip(positions, first_pages, strict=True)]
    fused = last_pages is None and sum(staged) <= piece_pages
    lengths = [p + 1 for p in positions] if fused else positions
    flat, owners = [], []  # each page and its (sequence, index in the sequence)
    for row, (pages, length) in enumerate(zip(host, lengths, strict=True)):
        num_pages = -(-length // size) if last_pages is None else last_pages[row]
        flat += pages[first_pages[row] : num_pages]
        owners += [(row, j) for j in range(first_pages[row], num_pages)]
    pieces = []
    for first in range(0, len(flat), piece_pages):
        run = flat[first : first + piece_pages]
        first_page, counts, rows = {}, [0] * len(positions), [[] for _ in positions]
        for slot_page, (row, j) in enumerate(owners[first : first + piece_pages]):
            first_page.setdefault(row, j)
            rows[row].append(slot_page)
            counts[row] += 1
        tables = torch.zeros(len(positions), bucket(max(counts), MIN_WIDTH), dtype=torch.int32)
        for row, slot_pages in enumerate(rows):
            tables[row, : len(slot_pages)] = torch.tensor(slot_pages, dtype=torch.int32)
        seq_lengths = [
            min(lengths[row], (first_page[row] + counts[row]) * size) - first_page[row] * size
            if counts[row] else 0
            for row in range(len(positions))
        ]  # fmt: skip
        offsets = [first_page.get(row, 0) * size for row in range(len(positions))]
        seq_lengths_on, offsets_on = device_ints([seq_lengths, offsets], device)
        pieces.append(Piece(device_ints(run, device), 0,
                            device_ints(tables, device, torch.int32), seq_lengths_on,
                            runs=page_runs(run), offsets=offsets_on,
                            width=max(seq_lengths)))  # fmt: skip
    return pieces, fused
