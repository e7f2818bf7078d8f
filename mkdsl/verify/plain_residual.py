"""A spec with its residual-stream ops replaced by the plain residual add (`x + block(x)`), for
`verify --against transformers` on a model whose own residual stream transformers lacks (Kimi K3's
attention residuals against KimiLinear's plain adds).

Each op with an `OpDef.plain_residual` rule is dropped and each of its outputs becomes the operand
the rule names (res_mix: the running prefix; res_snapshot: blocks and prefix unchanged; res_init:
the embedding). A layer carry that then passes through every layer untouched (K3's `blocks`) is
dropped from the layer kinds and from the step's `layers` call, so the stack carries one value,
the residual stream, as the oracle compares it. Everything else is the spec's own graph.
"""

from __future__ import annotations

import dataclasses

from mkdsl.lang.ir import Graph, Model, Node, Ref
from mkdsl.ops import OPS


def replaced_ops(model: Model) -> list[str]:
    """The ops the plain residual stands in for, in order of first use (empty: nothing to replace)."""
    seen: list[str] = []
    for n in (n for g in (*model.kinds, model.step) for n in g.nodes):
        if n.op in OPS and OPS[n.op].plain_residual and n.op not in seen:
            seen.append(n.op)
    return seen


def _substitute(graph: Graph) -> Graph:
    alias: dict[str, Ref] = {}

    def resolve(r: Ref) -> Ref:
        return alias.get(r.name, r) if r.kind == "value" else r

    nodes: list[Node] = []
    for n in graph.nodes:
        rule = OPS[n.op].plain_residual if n.op in OPS else ()  # `layers`: the stack call
        if rule:
            for out, operand in zip(n.outputs, rule):
                alias[out.name] = resolve(n.arg(operand))
            continue
        nodes.append(dataclasses.replace(n, inputs=tuple(resolve(r) for r in n.inputs)))
    return dataclasses.replace(graph, nodes=tuple(nodes), results=tuple(resolve(r) for r in graph.results))


def _idle_carries(kinds: list[Graph]) -> set[int]:
    """Carry positions every kind returns unchanged and reads nowhere."""
    idle = set(range(len(kinds[0].params)))
    for g in kinds:
        used = {r.name for n in g.nodes for r in n.inputs if r.kind == "value"}
        idle &= {i for i, p in enumerate(g.params) if p.name not in used and g.results[i] == Ref("value", p.name)}
    return idle


def plain_residual_model(model: Model) -> Model:
    """`model` with the plain residual add in place of its residual-stream ops (module docstring)."""
    kinds = [_substitute(g) for g in model.kinds]
    idle = _idle_carries(kinds)

    def keep(items):
        return tuple(x for i, x in enumerate(items) if i not in idle)

    kinds = [dataclasses.replace(g, params=keep(g.params), results=keep(g.results)) for g in kinds]
    step = _substitute(model.step)
    nodes = tuple(
        dataclasses.replace(n, inputs=keep(n.inputs), outputs=keep(n.outputs)) if n.op == "layers" else n
        for n in step.nodes
    )
    return dataclasses.replace(model, kinds=tuple(kinds), step=dataclasses.replace(step, nodes=nodes))
