"""The multi-GPU benchmark's work folder (``bench/multigpu.py --work``): the settings and
machine it was begun with, the profile, and each GPU count's run of each solver, so one
invocation can be split over several calls and resumed where one was cut short."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from common import environment, gpu_tag

RUN_KEYS = (
    "model",
    "layers",
    "scenario",
    "context",
    "decode",
    "sharpen",
    "batch",
    "balance_phase",
    "copy_seconds",
    "balance_batch",
    "kv_budget",
    "warmup_batch",
    "stand_in",
    "served_rate",
)


def prepare_work(work: Path, args, measure: Callable[[Path], dict]) -> dict:
    """The folder that keeps the profile and each GPU count's runs (``--work``): measures
    the profile (``measure(path)`` writes it and returns its summary) unless the folder
    holds one from the same settings and GPU kind; returns the summary. The environment of
    the machine that began it is kept beside them (``environment.json``)."""
    work.mkdir(parents=True, exist_ok=True)
    settings = {key: getattr(args, key) for key in RUN_KEYS}
    kept, began = work / "settings.json", work / "environment.json"
    # (a key added since the folder began reads as unset there)
    if kept.exists() and {k: None for k in RUN_KEYS} | json.loads(kept.read_text()) != settings:
        raise SystemExit(f"{work} holds runs of other settings: {kept.read_text()}")
    here = environment()
    if began.exists() and gpu_tag(json.loads(began.read_text())) != gpu_tag(here):
        raise SystemExit(f"{work} holds runs measured on another GPU kind: {began.read_text()}")
    kept.write_text(json.dumps(settings))
    if not began.exists():
        began.write_text(json.dumps(here))
    summary = work / "profile_summary.json"
    if not summary.exists():
        summary.write_text(json.dumps(measure(work / "profile.json")))
    return json.loads(summary.read_text())


def wanted_solvers(num_gpus: int, args) -> list[str]:
    """The runs a GPU count makes: every solver asked, or ``single`` on one GPU."""
    return list(args.solvers) if num_gpus > 1 else ["single"]


def kept_runs(num_gpus: int, work: Path) -> dict[str, dict]:
    """The runs of ``num_gpus`` GPUs already in ``work``, by solver."""
    done = work / f"runs{num_gpus}.json"
    return {r["solver"]: r for r in json.loads(done.read_text())} if done.exists() else {}


def missing_runs(num_gpus: int, args, work: Path) -> list[str]:
    """The wanted solvers whose runs on ``num_gpus`` GPUs ``work`` lacks."""
    kept = kept_runs(num_gpus, work)
    return [s for s in wanted_solvers(num_gpus, args) if s not in kept]
