"""The tiers of the head map behind one contract (:class:`Tier`): resident, streamed from
host pages, hybrid (the CPU attends the older part), per-entry pages under KV budgets, and
a rank's copies of shared heads. :func:`build_tiers` reads the table from the head map's
entries to the classes (``tiers.table``).

The names below load on first use, so that the tiers' settings (``tiers.settings``) import
without torch.
"""

from headspace.lazy import lazy_names

_HOMES = {"HybridSettings": ".settings", "StepInputs": ".base", "Tier": ".base",
          "TierSite": ".base", "attend_tiers": ".base", "build_tiers": ".table"}  # fmt: skip
__all__ = list(_HOMES)
__getattr__ = lazy_names(__name__, _HOMES)
