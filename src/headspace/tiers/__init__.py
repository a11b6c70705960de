"""The tiers of the head map behind one contract (:class:`Tier`): resident, streamed from
host pages, hybrid (the CPU attends the older part), per-entry pages under KV budgets, and
a rank's copies of shared heads. :func:`build_tiers` reads the table from the head map's
entries to the classes (``tiers.table``).

The names below load on first use, so that the tiers' settings (``tiers.settings``) import
without torch.
"""

import importlib

_HOMES = {"HybridSettings": "settings", "StepInputs": "base", "Tier": "base", "TierSite": "base",
          "attend_tiers": "base", "build_tiers": "table"}  # fmt: skip
__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'headspace.tiers' has no attribute {name!r}")
    return getattr(importlib.import_module(f"headspace.tiers.{_HOMES[name]}"), name)
