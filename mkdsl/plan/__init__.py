"""Planning: from the graph IR to a `Plan` (tiles, ring, VMEM budget, traffic, modeled time)."""

from mkdsl.plan.planner import make_plan
from mkdsl.plan.types import Plan

__all__ = ["Plan", "make_plan"]
