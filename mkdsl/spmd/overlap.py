"""Work that runs while an exchange's messages travel: a shard-pass step and the planner's windows.

A collective's first phase starts its sends and then waits for the peers' messages; a node that
needs none of its results (and none of a later collective's) can run in between. The shard pass's
step (`order_independent`, after mkdsl/spmd/ready.py) moves such nodes of each layer kind right after
each group of collectives, in their order; the planner's `windows` then names, per collective
the kernel calls, the run of nodes right after its members that need none of them. The kernel
runs that run inside the call (the runtime's `during`, between the first phase's sends and its
waits) and the cost model charges the exchange only for what the run does not cover.

Only layer kinds are reordered: the step's nodes around the layer stack stay where they are.
"""

from __future__ import annotations

import dataclasses

from mkdsl.lang.ir import Graph, Model, Node
from mkdsl.spmd.ready import closure, direct_deps, exchanges


def order_independent(model: Model) -> Model:
    """The model with every layer kind's independent nodes right after the collectives they need not."""
    kinds = tuple(order_graph(g) for g in model.kinds)
    if all(a is b for a, b in zip(kinds, model.kinds, strict=True)):
        return model
    return dataclasses.replace(model, kinds=kinds)


def order_graph(g: Graph) -> Graph:
    """g with, after each run of adjacent collectives (leftmost first), the later nodes that need
    none of them and no later collective, in their order."""
    nodes, at = g.nodes, 0
    while (group := _next_group(nodes, at)) is not None:
        first, last = group
        needs = closure(direct_deps(nodes))
        later = range(last + 1, len(nodes))
        free = [
            j
            for j in later
            if not exchanges(nodes[j]) and not any(d >= first and exchanges(nodes[d]) for d in needs[j])
        ]
        nodes = (*nodes[: last + 1], *(nodes[j] for j in free), *(nodes[j] for j in later if j not in free))
        at = last + 1
    return g if nodes == g.nodes else dataclasses.replace(g, nodes=nodes)


def _next_group(nodes: tuple[Node, ...], at: int) -> tuple[int, int] | None:
    """(first, last) of the next run of adjacent collectives at or after `at`."""
    first = next((i for i in range(at, len(nodes)) if exchanges(nodes[i])), None)
    if first is None:
        return None
    last = first
    while last + 1 < len(nodes) and exchanges(nodes[last + 1]):
        last += 1
    return first, last


def windows(model: Model, found) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    """(graph, the collective's value, node indices) per collective of a layer kind with work to
    run during its first exchange: the nodes right after its last member (and its fused and
    joined values' nodes) that need none of them, up to the first that does or that exchanges."""
    kinds = {k.name: k for k in model.kinds}
    needs_of: dict[str, list[set[int]]] = {}  # per layer kind with collectives, computed once
    out = []
    for c in found:
        g = kinds.get(c.graph)
        if g is None:
            continue
        members = {i for i, n in enumerate(g.nodes) if n.outputs and n.outputs[0].name in c.values}
        if c.graph not in needs_of:
            needs_of[c.graph] = closure(direct_deps(g.nodes))
        needs = needs_of[c.graph]
        run = []
        for j in range(max(members) + 1, len(g.nodes)):
            if exchanges(g.nodes[j]) or needs[j] & members:
                break
            run.append(j)
        if run:
            out.append((c.graph, c.value, tuple(run)))
    return tuple(out)
