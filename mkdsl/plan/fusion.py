"""Collectives of one layer that are ready together (none needs another's result), priced as one
exchange: phase by phase, one message to every peer of any member, one latency for the union of
their peers, all their bytes. The planner prices its `fuse_ready` option with it, and
plan/levers.py's `fuse` lever re-plans with that option."""

from __future__ import annotations

from mkdsl.lang.ir import Graph, Model
from mkdsl.plan import collectives
from mkdsl.spmd import ready


def _depends(g: Graph) -> dict[str, set[str]]:
    """Value -> every value of g it is computed from, transitively (mkdsl/spmd/ready.py's dependency
    closure, which orders the ready-together collectives: one notion of "needs" for both)."""
    needs = ready.closure(ready.direct_deps(g.nodes))
    made = [{v.name for v in n.outputs} for n in g.nodes]
    return {v: set().union(*(made[d] for d in needs[i])) for i, n in enumerate(g.nodes) for v in made[i]}


def groups(g: Graph, found: list) -> list[list]:
    """g's collectives in graph order, grouped greedily: a collective joins the open group when it
    needs none of the group's results, else it starts the next. A collective the plan already runs
    ready together with others (`Collective.joined`) counts with all their values."""
    deps, out = _depends(g), []
    for c in (c for c in found if c.graph == g.name):
        needs = set().union(*(deps.get(v, ()) for v in c.values))
        if out and not any(v in needs or v in c.values for m in out[-1] for v in m.values):
            out[-1].append(c)
        else:
            out.append([c])
    return out


def fused_us(members: list) -> float:
    """One exchange for all `members`: their k-th phases together, for every k."""
    total = 0.0
    for k in range(max(len(c.phases) for c in members)):
        ps = [c.phases[k] for c in members if k < len(c.phases)]
        if len(ps) == 1:
            total += ps[0].time_us()
            continue
        peers = collectives.union_peers([p.mask for p in ps])
        total += collectives.phase_us("direct", peers, sum(p.bytes for p in ps))
    return total


def ready_together(model: Model, found: list) -> dict[tuple[str, str], float]:
    """(graph, value) -> its exchange's modeled us when ready-together collectives are fused: the
    group's last collective carries the fused exchange, the others 0."""
    out = {}
    for g in (*model.kinds, model.step):
        for group in groups(g, found):
            for c in group[:-1]:
                out[c.graph, c.value] = 0.0
            out[group[-1].graph, group[-1].value] = fused_us(_members(group))
    return out


def _members(group: list) -> list:
    """The group's collectives as each runs alone (a plan's shared phase split back)."""
    return [m for c in group for m in c.apart()]


def fused_phases(model: Model, found: list) -> int:
    """Exchange phases per step with ready-together collectives fused."""
    runs = {g.name: model.schedule.count(g.name) for g in model.kinds} | {model.step.name: 1}
    g_of = {g.name: g for g in (*model.kinds, model.step)}
    return sum(
        runs[name] * sum(max(len(c.phases) for c in _members(group)) for group in groups(g_of[name], found))
        for name in runs
    )
