"""From the head map to the tiers that attend it: one table from each kind of entry to the
class that executes it (as vLLM maps each KV-cache spec type to its manager), read in the
order the runner submits them.

| the arena's pages | entry | class |
| --- | --- | --- |
| shared (one block table per sequence) | ``gpu`` | :class:`ResidentTier` |
| | a rank's copy of a shared head | :class:`CopyTier` |
| | ``stream`` (host pages) | :class:`StreamedTier` |
| | ``hybrid`` (host pages, the older tokens on the CPU) | :class:`HybridTier` |
| per entry (budgets, per-head patterns) | any, one process | :class:`BudgetTier` |
| | any, one rank of several | :class:`RankBudgetTier` |
"""

from __future__ import annotations

from headspace.tiers.base import Tier, TierSite
from headspace.tiers.budget import BudgetTier
from headspace.tiers.budget_ranks import RankBudgetTier
from headspace.tiers.copies import CopyTier
from headspace.tiers.hybrid_tier import HybridTier
from headspace.tiers.resident import ResidentTier
from headspace.tiers.streamed import StreamedTier

# the head map's entry kinds in shared pages -> the class that attends them
SHARED_PAGES: dict[str, type[Tier]] = {
    "gpu": ResidentTier,
    "copy": CopyTier,
    "stream": StreamedTier,
    "hybrid": HybridTier,
}
# every entry in its own pages: one class attends them all (by whether ranks share heads)
PER_ENTRY_PAGES: dict[bool, type[Tier]] = {False: BudgetTier, True: RankBudgetTier}


def tier_classes(site: TierSite) -> list[type[Tier]]:
    """The classes that may attend a plan's entries on ``site``, in submit order."""
    if site.per_entry_pages:
        return [PER_ENTRY_PAGES[site.layout is not None]]
    return list(dict.fromkeys(SHARED_PAGES.values()))


def build_tiers(plan, site: TierSite) -> list[Tier]:
    """The tiers of ``plan`` on ``site``: each class of the table that has entries to
    attend (its ``from_plan`` returns None otherwise)."""
    built = (cls.from_plan(plan, site) for cls in tier_classes(site))
    return [tier for tier in built if tier is not None]
