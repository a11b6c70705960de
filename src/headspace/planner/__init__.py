"""The head map and the pure planner that fills it (no CUDA, CPU-testable)."""

from headspace.planner.head_map import HeadEntry, HeadMap
from headspace.planner.plan import Hardware, Plan, PlanRequest, make_plan

__all__ = ["Hardware", "HeadEntry", "HeadMap", "Plan", "PlanRequest", "make_plan"]
