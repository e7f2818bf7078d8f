"""Where the modeled step time goes: the cost model's sum (plan/cost_model.py) split by graph
(each layer kind, and the step outside the layer stack) and by cost kind, item by item.

    modeled = max(stream, mxu) + fixed + bubbles + issue + comm

Only the larger of stream and MXU time counts (the other is hidden under it), so every item of
the bounding one is charged and the other's are not. Each schedule item's bytes, each graph's
flops, each collective, each data-dependent wait and each DMA's issue cost is charged to the
graph it runs in, times the runs of that graph per step; the kernel's entry and first tile go
to the step. The shares sum to the modeled step time. Every figure is *modeled*.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mkdsl.ir import Model
from mkdsl.ops import OPS
from mkdsl.plan import cost_model
from mkdsl.plan.planner import graph_runs
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
    bound: str  # "stream" or "compute": the larger of the two, the one charged
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
    t, runs = plan.timing, graph_runs(model)
    bound = "compute" if t.mxu_us > t.stream_us else "stream"
    costs: list[Cost] = []
    for g in (*(k.name for k in model.kinds), model.step.name):
        costs += _graph_costs(model, plan, g, runs[g], bound)
    kernel = Cost(model.step.name, "fixed", "kernel entry and the first weight tile", 0, 1, t.fixed_us)
    graphs = tuple(k.name for k in model.kinds if runs[k.name]) + (model.step.name,)
    return Breakdown(t.modeled_us, bound, graphs, tuple(c for c in [*costs, kernel] if c.runs))


def _graph_costs(model: Model, plan: Plan, g: str, runs: int, bound: str) -> list[Cost]:
    t = plan.timing
    items = [i for i in plan.schedule_items if i.graph == g]
    out = []
    if bound == "stream":
        out += [Cost(g, "stream", i.what, i.line, runs, i.bytes * runs / t.hbm_bytes_per_s * 1e6) for i in items]
    else:
        flops = dict(plan.graph_flops).get(g, 0)
        out.append(Cost(g, "compute", "matmuls and vector ops", 0, runs, flops / cost_model.PEAK_BF16_FLOPS * 1e6))
    for c in plan.collectives:
        if c.graph == g:
            what = f"{c.op}{' (two-level)' if c.two_level else ''} of `{c.value}`"
            out.append(Cost(g, "collectives", what, c.line, runs, c.time_us() * runs))
    if g != model.step.name:  # the cost model charges data-dependent waits in the layers only
        for n in model.kind(g).nodes:
            if OPS[n.op].data_dependent:
                what = f"{n.op} waits for data-dependent DMAs"
                out.append(Cost(g, "fixed", what, n.span.line, runs, cost_model.DMA_LATENCY_US * runs))
    dmas = sum(i.dmas for i in items)
    if dmas:
        out.append(Cost(g, "fixed", f"issuing {dmas} DMAs", 0, runs, dmas * runs * cost_model.ISSUE_US))
    return out
