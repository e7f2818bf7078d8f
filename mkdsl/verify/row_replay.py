"""One prefill row of a layer computed again, alone (`verify --against transformers`' near-tie rerun).

A routing near tie changes what its row computes from the op that chooses (`OpDef.near_tie`) on;
everything before that op, and every other row, is unchanged. Running the whole prefill layer
again for each tied row (a recurrence over every token: minutes for 1,000 tokens) is therefore
not needed: the layer is run once with every value it computes recorded, and a tied row is
replayed from the first choosing op on, over that one row, each op taking the recorded values of
the row for operands the choice does not reach. That is the layer's own arithmetic for the row
when every op from the choice on is row-wise (no prefill rule of its own, no state read or
written: the MoE ops, norms, adds); where one is not (`replayable` None), the caller runs the
whole layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mkdsl.lang.ir import Graph, Model, Node
from mkdsl.lazy import jnp
from mkdsl.ops import OPS


@dataclass
class Recorded:
    """A prefill layer's values over its T rows: value name -> array [T, ...]; the step inputs."""

    model: Model
    index: int
    weights: dict  # as the reference takes them (`reference_weights`)
    values: dict
    inputs: dict
    rows: int


def record_layer(model: Model, index: int, weights, carry_in, tokens: np.ndarray, dtype) -> Recorded:
    """Layer `index`'s prefill over `tokens` (one prompt row), fed `carry_in`, every value kept."""
    from mkdsl.run.prefill import _caller, _prompt_inputs, reference_weights
    from mkdsl.run.reference import _no_nesting, _run_graph
    from mkdsl.verify.oracle_trace import zero_state

    rows, inputs, *_ = _prompt_inputs(model, jnp.asarray(np.asarray(tokens)[None]), None, None)
    graph, base, seen = model.kind(model.schedule[index]), _caller([rows]), []

    def call(op, arrays, attrs):
        outs = base(op, arrays, attrs)
        seen.append(outs)
        return outs

    ref_w = reference_weights(model, weights)
    state = dict(zero_state(model, len(tokens) + 1))
    carries = [jnp.asarray(carry_in, dtype)]
    _run_graph(model, graph, carries, ref_w, state, inputs, index, _no_nesting, call)
    values = {v.name: c for v, c in zip(graph.params, carries)}
    for node, outs in zip(graph.nodes, seen):
        values.update({v.name: o for v, o in zip(node.outputs, outs)})
    return Recorded(model, index, ref_w, values, inputs, len(tokens))


def _replayed(graph: Graph, states: set[str]) -> list[Node] | None:
    """The nodes a near tie reaches (the choosing ops and all that depend on them), in order, or
    None when one of them cannot run on one row alone."""
    reached: set[str] = set()
    nodes = []
    for node in graph.nodes:
        op = OPS[node.op]
        if op.near_tie is None and not any(r.kind == "value" and r.name in reached for r in node.inputs):
            continue
        if (
            op.prefill is not None
            or op.inout
            or node.writes
            or any(r.kind == "tensor" and r.name in states for r in node.inputs)
        ):
            return None
        reached.update(v.name for v in node.outputs)
        nodes.append(node)
    return nodes


def replayable(model: Model, index: int) -> list[Node] | None:
    """The nodes of layer `index` a near tie reaches, or None when they are not all row-wise."""
    states = {t.name for t in model.tensors if t.kind == "state"}
    return _replayed(model.kind(model.schedule[index]), states)


def replay(rec: Recorded, row: int):
    """The layer's first carry at prefill row `row` ([1, ...]) recomputed from the near-tie ops
    on, under whatever references OPS holds now (`OpDef.near_tie`'s, flipping local row 0)."""
    from mkdsl.lang.ir import LayerExpr
    from mkdsl.run.reference import _slot

    model, graph = rec.model, rec.model.kind(rec.model.schedule[rec.index])
    nodes = replayable(model, rec.index)
    if nodes is None:
        raise ValueError(f"layer {rec.index}: an op after its near-tie op is not row-wise; run the whole layer")
    local: dict = {}

    def one(x):
        return x[row : row + 1] if getattr(x, "ndim", 0) >= 1 and x.shape[0] == rec.rows else x

    def read(ref):
        if ref.kind == "value":
            return local[ref.name] if ref.name in local else one(rec.values[ref.name])
        if ref.kind == "input":
            return one(rec.inputs[ref.name])
        t = model.tensor(ref.name)
        return _slot(rec.weights[t.name], t.slots[rec.index]) if t.stacked else rec.weights[t.name]

    for node in nodes:
        attrs = {k: v.at(rec.index) if isinstance(v, LayerExpr) else v for k, v in node.attrs}
        outs = OPS[node.op].reference(*[read(r) for r in node.inputs], **attrs)
        local.update({v.name: o for v, o in zip(node.outputs, outs)})
    return read(graph.results[0])
