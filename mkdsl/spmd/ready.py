"""Order ready-together collectives next to each other: the last step of the shard pass.

Collectives of one graph that are ready together (none needs another's result) can share one
exchange (plan/collectives.py `fuse_ready`, the runtime's `Comm.together`) only when nothing runs
between them. The pass groups each graph's all-reduces and all-gathers greedily, as
plan/levers.py's `groups` does (a collective joins the open group when it needs none of the
group's results), and rewrites each group's span of nodes as: the nodes a later member needs
(its producers since the first member), then the members in their order, then every other node
of the span in its order. The planner and the emitter both read the new order, so the weight
ring's tiles, the plan's phases and the kernel's code follow it alike.

Dependencies are values and state: a node that writes a state tensor stays after every earlier
node that reads or writes it, and a reader after the earlier writers.
"""

from __future__ import annotations

import dataclasses

from mkdsl.lang.ir import Graph, Model, Node
from mkdsl.ops import OPS

FUSABLE = ("sum", "gather")  # the exchanges Comm.together runs (an argmax's `best` is the step's last)


def order_ready_together(model: Model) -> Model:
    """The model with every graph's ready-together collectives next to each other."""
    kinds = tuple(order_graph(g) for g in model.kinds)
    step = order_graph(model.step)
    if all(a is b for a, b in zip((*kinds, step), (*model.kinds, model.step), strict=True)):
        return model
    return dataclasses.replace(model, kinds=kinds, step=step)


def is_exchange(node: Node) -> bool:
    op = OPS.get(node.op)
    return op is not None and op.exchange in FUSABLE and bool(node.attr.get(op.exchange_axes))


def exchanges(node: Node) -> bool:
    """Devices exchange the node's value (any collective: the ones Comm.together runs and the others)."""
    op = OPS.get(node.op)
    return op is not None and bool(op.exchange) and bool(node.attr.get(op.exchange_axes))


def direct_deps(nodes: tuple[Node, ...]) -> list[set[int]]:
    """Node index -> the earlier nodes it must follow: producers of its values, and the state
    tensors' earlier writers (for a reader or writer) and readers (for a writer)."""
    made: dict[str, int] = {}
    writers: dict[str, list[int]] = {}
    readers: dict[str, list[int]] = {}
    out: list[set[int]] = []
    for i, node in enumerate(nodes):
        deps = {made[r.name] for r in node.inputs if r.kind == "value" and r.name in made}
        touched = {r.name for r in node.inputs if r.kind == "tensor"} | set(node.writes)
        for t in touched:
            deps.update(writers.get(t, ()))
        for t in node.writes:
            deps.update(readers.get(t, ()))
        for t in touched - set(node.writes):
            readers.setdefault(t, []).append(i)
        for t in node.writes:
            writers.setdefault(t, []).append(i)
        for v in node.outputs:
            made[v.name] = i
        out.append(deps)
    return out


def closure(direct: list[set[int]]) -> list[set[int]]:
    """Node index -> every earlier node it depends on, transitively."""
    out: list[set[int]] = []
    for deps in direct:
        full = set(deps)
        for d in deps:
            full |= out[d]
        out.append(full)
    return out


def ready_groups(nodes: tuple[Node, ...], needs: list[set[int]]) -> list[list[int]]:
    """The node indices of the collectives in order, grouped greedily (groups of one included)."""
    out: list[list[int]] = []
    for i, node in enumerate(nodes):
        if not is_exchange(node):
            continue
        if out and not any(m in needs[i] for m in out[-1]):
            out[-1].append(i)
        else:
            out.append([i])
    return out


def order_graph(g: Graph) -> Graph:
    """g with each group's members next to each other after the nodes they need. One group at a
    time, leftmost first: a gathered group and everything before it keep their grouping, so each
    round gathers one more group."""
    nodes = g.nodes
    for _ in range(len(nodes)):
        needs = closure(direct_deps(nodes))
        group = next((m for m in ready_groups(nodes, needs) if m[-1] - m[0] >= len(m)), None)
        if group is None:
            break
        nodes = _gathered(nodes, needs, group)
    return g if nodes == g.nodes else dataclasses.replace(g, nodes=nodes)


def _gathered(nodes: tuple[Node, ...], needs: list[set[int]], group: list[int]) -> tuple[Node, ...]:
    first, last = group[0], group[-1]
    span = range(first, last + 1)
    members = set(group)
    wanted = {d for m in group[1:] for d in needs[m] if first <= d and d not in members}
    hoisted = [i for i in span if i in wanted]
    rest = [i for i in span if i not in wanted and i not in members]
    order = [*range(first), *hoisted, *group, *rest, *range(last + 1, len(nodes))]
    return tuple(nodes[i] for i in order)
