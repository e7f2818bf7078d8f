"""Where the modeled step time goes: the cost model's phases (plan/cost_model.py, plan/timeline.py)
split by graph (each layer kind, and the step outside the layer stack) and by cost kind.

Each phase's modeled time is charged to what it waits for: its stream (bytes not yet landed),
its compute, or its exchange; the device call's dispatch is charged to the step as fixed. The
shares sum to the modeled step time. Every figure is *modeled*.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mkdsl.lang.ir import Model
from mkdsl.plan.types import Plan

COST_KINDS = ("stream", "compute", "collectives", "fixed")


@dataclass(frozen=True)
class Cost:
    """One charged item: `us` is per step, all `runs` of its graph together."""

    graph: str  # a layer kind, or the step
    kind: str  # one of COST_KINDS
    what: str
    line: int  # spec line (0: the kernel's own)
    runs: int
    us: float


@dataclass(frozen=True)
class Breakdown:
    modeled_us: float
    bound: str  # "stream" or "compute": the one more of the step waits for
    graphs: tuple[str, ...]  # layer kinds in dispatch order, then the step
    costs: tuple[Cost, ...]  # every item, in graph order

    def us(self, graph: str | None = None, kind: str | None = None) -> float:
        return sum(c.us for c in self.costs if graph in (None, c.graph) and kind in (None, c.kind))

    def top(self, n: int = 5) -> list[Cost]:
        return sorted(self.costs, key=lambda c: (-c.us, self.graphs.index(c.graph), c.what))[:n]

    def share(self, us: float) -> str:
        return f"{100 * us / self.modeled_us:.1f}%"

    def as_dict(self) -> dict:
        return {
            "modeled_us": self.modeled_us,
            "bound": self.bound,
            "by_graph": {g: {k: self.us(g, k) for k in COST_KINDS} for g in self.graphs},
            "costs": [dataclasses.asdict(c) for c in self.top(len(self.costs))],  # largest first
        }


def breakdown(model: Model, plan: Plan) -> Breakdown:
    """The plan's modeled time split into charged items (their sum is `plan.timing.modeled_us`)."""
    t = plan.timing
    costs: list[Cost] = []
    for p in plan.phases:
        for kind, us in (("stream", p.stream_us), ("compute", p.compute_us), ("collectives", p.comm_us)):
            if us > 0:
                costs.append(Cost(p.graph, kind, p.what, p.line, p.runs, us))
    per = f" ({t.steps_per_call} steps per call)" if t.steps_per_call > 1 else ""
    costs.append(Cost(model.step.name, "fixed", f"dispatch of the device call{per}", 0, 1, t.fixed_us))
    order = [k.name for k in model.kinds if model.schedule.count(k.name)] + [model.step.name]
    costs.sort(key=lambda c: order.index(c.graph))
    stream, compute = (sum(c.us for c in costs if c.kind == k) for k in ("stream", "compute"))
    bound = "compute" if compute > stream else "stream"
    return Breakdown(t.modeled_us, bound, tuple(order), tuple(costs))
