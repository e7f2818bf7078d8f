"""Defer an all-reduced value's RMS norm past the row-parallel projection it feeds: a shard-pass step.

The per-device model often sums partials only to normalise the whole row and then take this
device's slice for a projection split by rows (Kimi K3's latent MoE: the experts' partial sums,
their norm, the up-projection). The norm's row scale s = rsqrt(mean(r²) + eps) is the same on
every device and commutes with the projection and with the sum of its partials, so

    r = all_reduce(p); z = shard_slice(rmsnorm(r, w)); y = linear(z, W) [+ b]; all_reduce(y)

equals

    m = reduce_scatter(p); z' = m · w_mine; y' = linear(z', W); all_reduce_scaled(y', m [, b])

where all_reduce_scaled sums y' (and b) and each device's sum of squares of m in the same
exchanges and applies s to the summed chunk before gathering it (Comm.all_reduce_scaled). The
value's all-reduce (two or three phases) becomes one reduce-scatter phase; the projection's
all-reduce keeps its two, its first carrying b's chunks and the squares beside y''s.

The step applies only where each value of the chain has exactly that one use, the slice, the
reduce-scatter and the projection's all-reduce are over the same mesh axes, and the norm is over
whole rows (one head). Every graph is rewritten alike; a one-device model has no collectives.
"""

from __future__ import annotations

import dataclasses

from mkdsl.lang.ir import Graph, Model, Node, Ref, TensorType, Value
from mkdsl.ops.collective import SCALED_SUM, SCATTER_SUMS, SUM_PARTIALS, TAKE_MINE, WEIGH_MINE


def defer_norms(model: Model) -> Model:
    """The model with every deferrable norm chain of every graph rewritten (see the module doc)."""
    kinds = tuple(defer_graph(g) for g in model.kinds)
    step = defer_graph(model.step)
    if all(a is b for a, b in zip((*kinds, step), (*model.kinds, model.step), strict=True)):
        return model
    return dataclasses.replace(model, kinds=kinds, step=step)


def defer_graph(g: Graph) -> Graph:
    """g with each chain rewritten, leftmost first."""
    nodes = g.nodes
    while (chain := _find_chain(nodes, g.results)) is not None:
        nodes = _rewrite(nodes, chain)
    return g if nodes == g.nodes else dataclasses.replace(g, nodes=nodes)


def _uses(nodes: tuple[Node, ...], results: tuple[Ref, ...]) -> dict[str, list[int]]:
    """Value name -> indices of the nodes that read it (len(nodes) for a graph result)."""
    out: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        for r in node.inputs:
            if r.kind == "value":
                out.setdefault(r.name, []).append(i)
    for r in results:
        out.setdefault(r.name, []).append(len(nodes))
    return out


def _only_use(nodes, uses, i: int, op: str) -> int | None:
    """The index of the one node reading node i's value, if it is an `op` node."""
    found = uses.get(nodes[i].outputs[0].name, [])
    if len(found) != 1 or found[0] >= len(nodes) or nodes[found[0]].op != op:
        return None
    return found[0]


def _find_chain(nodes: tuple[Node, ...], results) -> tuple[int, ...] | None:
    """(all_reduce, rmsnorm, shard_slice, linear, add or -1, all_reduce) node indices of the
    first deferrable chain, or None."""
    uses = _uses(nodes, results)
    for i, node in enumerate(nodes):
        if node.op != SUM_PARTIALS:
            continue
        norm = _only_use(nodes, uses, i, "rmsnorm")
        if norm is None or nodes[norm].attr["heads"] != 1 or nodes[norm].inputs[0].name != node.outputs[0].name:
            continue
        if len(nodes[norm].inputs) < 2:  # a weightless norm has no weight to multiply into the slice
            continue
        mine = _only_use(nodes, uses, norm, TAKE_MINE)
        proj = _only_use(nodes, uses, mine, "linear") if mine is not None else None
        if proj is None or nodes[mine].attr["axes"] != node.attr["axes"] or nodes[proj].inputs[0].kind != "value":
            continue
        add = _only_use(nodes, uses, proj, "add")
        last = _only_use(nodes, uses, proj if add is None else add, SUM_PARTIALS)
        if last is not None and nodes[last].attr["axes"] == node.attr["axes"]:
            return (i, norm, mine, proj, -1 if add is None else add, last)
    return None


def _rewrite(nodes: tuple[Node, ...], chain: tuple[int, ...]) -> tuple[Node, ...]:
    """The nodes with one chain rewritten: the reduce-scatter at the all-reduce's place, the
    weight multiply at the slice's, the projection unchanged, the scaled all-reduce at the last."""
    first, norm, mine, proj, add, last = chain
    a, n, m = nodes[first], nodes[norm], nodes[mine]
    axes, ways = a.attr["axes"], m.attr["ways"]
    part = m.outputs[0].type
    split = Value(f"{a.inputs[0].name}__mine", TensorType(part.dtype, part.shape), a.span)
    scatter = Node(SCATTER_SUMS, a.inputs, (("axes", axes), ("ways", ways)), (split,), (), a.span, a.block)
    weigh = Node(
        WEIGH_MINE,
        (Ref("value", split.name), n.inputs[1]),
        (("axes", axes), ("ways", ways), ("offset", n.attr["offset"])),
        m.outputs,
        (),
        n.span,
        n.block,
    )
    width = n.outputs[0].type.shape[-1]
    y = nodes[proj].outputs[0].name
    others = tuple(r for r in nodes[add].inputs if r.name != y) if add >= 0 else ()
    end = nodes[last]
    scaled = Node(
        SCALED_SUM,
        (Ref("value", y), Ref("value", split.name), *others),
        (("axes", axes), ("n", width), ("eps", n.attr["eps"])),
        end.outputs,
        (),
        end.span,
        end.block,
    )
    out = list(nodes)
    out[first], out[mine], out[last] = scatter, weigh, scaled
    dropped = {norm, add}
    return tuple(node for i, node in enumerate(out) if i not in dropped)
