"""Decode over pages at the lengths a KV budget keeps, without the prompts' compute
(``bench/multigpu.py --stand-in``): the counts the budget's policy keeps of some of the
run's own prompts, measured once on one GPU through the model
(:func:`headspace.eval.profile.kept_counts`, which the tests hold equal to what the engine
keeps), and the engine hook that gives each prompt of a run its counts
(:attr:`headspace.engine.hooks.EngineHooks.prompt_stand_in`). An exact decode step's work
depends on the lengths it reads, not on the values in the pages, so the decode figures are
the run's; its prefill is not measured."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

KEPT_FILE = "kept_counts.json"  # beside the profile: [prompt][layer][kv head] tokens kept
MEASURED_PROMPTS = 4  # the run's first prompts whose counts are measured; the others cycle
KEY_TOKENS = 32  # a prompt's first tokens name it (the run's prompts are random)


def measure_kept(model, prompts: list[list[int]], budget, path: Path) -> dict:
    """Writes each of ``prompts``' kept counts ``[layers][kv heads]`` under ``budget``
    (a :class:`headspace.budgets.KVBudget`) on ``model`` to ``path``; returns a summary."""
    from tqdm import tqdm

    from headspace.eval.profile import kept_counts

    kept = [kept_counts(model, p, budget) for p in tqdm(prompts, desc="kept counts")]
    path.write_text(json.dumps([k.tolist() for k in kept]))
    return {"prompts": len(kept), "prompt_tokens": len(prompts[0]),
            "mean_kept": [k.float().mean().item() for k in kept],
            "min_kept": [k.min().item() for k in kept],
            "max_kept": [k.max().item() for k in kept]}  # fmt: skip


def stand_in(path: Path, prompts: list[list[int]]) -> Callable[[list[int]], list[list[int]]]:
    """``EngineHooks.prompt_stand_in`` over the counts at ``path``: the i-th of ``prompts``
    keeps measured prompt ``i mod count``'s, any other (a warm-up's) the first's."""
    kept = json.loads(path.read_text())
    index = {tuple(p[:KEY_TOKENS]): i % len(kept) for i, p in enumerate(prompts)}
    return lambda ids: kept[index.get(tuple(ids[:KEY_TOKENS]), 0)]
