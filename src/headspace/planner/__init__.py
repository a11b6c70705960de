"""The head map and the pure planner that fills it (no CUDA, CPU-testable)."""

from headspace.kv.spec import KVSpec
from headspace.planner.context import PlanRequest, make_plan
from headspace.planner.head_map import HeadEntry, HeadMap
from headspace.planner.memory import Hardware
from headspace.planner.plan import Plan, plan_batch

__all__ = [
    "Hardware", "HeadEntry", "HeadMap", "KVSpec", "Plan", "PlanRequest", "make_plan",
    "plan_batch",
]  # fmt: skip
