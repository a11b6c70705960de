"""The tiers of the head map behind one contract (:class:`Tier`): resident, streamed from
host pages, hybrid (the CPU attends the older part), per-entry pages under KV budgets, and
a rank's copies of shared heads. :func:`build_tiers` reads the table from the head map's
entries to the classes (``tiers.table``)."""

from headspace.tiers.base import HybridSettings, StepInputs, Tier, TierSite, attend_tiers
from headspace.tiers.table import build_tiers

__all__ = ["HybridSettings", "StepInputs", "Tier", "TierSite", "attend_tiers", "build_tiers"]
