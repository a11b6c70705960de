"""``headspace serve`` with engine hooks, for tests of failures inside the engine (started
as ``python tests/hooked_server.py --port N [serve flags]``).

A prompt of ``POISON`` token ids gets non-finite logits from its third pick on; one of
``FATAL`` token ids makes the engine's step raise, as a bug would."""

from __future__ import annotations

import sys
from collections import Counter

import torch

from headspace.cli.main import build_parser
from headspace.cli.serve import run_serve
from headspace.engine.hooks import EngineHooks

POISON = [7] * 6
FATAL = [8] * 6
POISONED_FROM = 3  # the pick from which a poisoned prompt's logits are NaN


def poisoner():
    """A ``logits_filter`` that poisons ``POISON`` prompts and raises for ``FATAL`` ones."""
    picks: Counter[tuple[int, ...]] = Counter()

    def logits_filter(prompts: list[list[int]], logits: torch.Tensor) -> torch.Tensor:
        poisoned = []
        for row, prompt in enumerate(prompts):
            if prompt == FATAL:
                raise RuntimeError("a fault inside the engine's step (a test's)")
            if prompt == POISON:
                picks[tuple(prompt)] += 1
                if picks[tuple(prompt)] >= POISONED_FROM:
                    poisoned.append(row)
        if not poisoned:
            return logits
        logits = logits.clone()
        logits[poisoned] = float("nan")
        return logits

    return logits_filter


if __name__ == "__main__":
    arguments = build_parser().parse_args(["serve", *sys.argv[1:]])
    run_serve(arguments, EngineHooks(logits_filter=poisoner()))
