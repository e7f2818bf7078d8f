"""The oracle: the graph IR evaluated op by op with each op's plain-jnp reference.

Unfused and straightforward on purpose: a Python loop over layers, every intermediate
materialised. Generated kernels are tested against this function.
"""

from __future__ import annotations

from collections.abc import Callable

from mkdsl.ir import Graph, LayerExpr, Model, Ref
from mkdsl.lazy import jax
from mkdsl.ops import OPS
from mkdsl.quant import QTensor, register_pytree


def _slot(array, slot: int):
    if isinstance(array, QTensor):
        return QTensor(array.codes[slot], array.scales[slot], array.fmt, array.group)
    return array[slot]


def build_reference(model: Model, jit: bool = True) -> Callable:
    """`step(weights, state, tokens, positions) -> (logits, next_tokens, new_state)`.

    weights: name -> array (a `QTensor` for quantised formats); state: name -> array.
    Stacked tensors carry a leading layer-slot axis, as declared.
    """

    def run_graph(graph: Graph, carries, weights, state, inputs, layer: int | None):
        env = {v.name: c for v, c in zip(graph.params, carries)}

        def read(ref: Ref):
            if ref.kind == "value":
                return env[ref.name]
            if ref.kind == "input":
                return inputs[ref.name]
            t = model.tensor(ref.name)
            source = weights if t.kind == "weight" else state
            return _slot(source[t.name], t.slots[layer]) if t.stacked else source[t.name]

        for node in graph.nodes:
            if node.op == "layers":
                outs = run_layers([read(r) for r in node.inputs], weights, state, inputs)
            else:
                op = OPS[node.op]
                attrs = {k: v.at(layer) if isinstance(v, LayerExpr) else v for k, v in node.attrs}
                outs = op.reference(*[read(r) for r in node.inputs], **attrs)
                for name, new in zip(node.writes, outs[op.outputs :]):
                    t = model.tensor(name)
                    state[name] = state[name].at[t.slots[layer]].set(new) if t.stacked else new
            for v, out in zip(node.outputs, outs):
                env[v.name] = out
        return [read(r) for r in graph.results]

    def run_layers(carries, weights, state, inputs):
        for layer, kind in enumerate(model.schedule):
            carries = run_graph(model.kind(kind), carries, weights, state, inputs, layer)
        return carries

    def step(weights, state, tokens, positions):
        state = dict(state)
        names = [v.name for v in model.inputs]
        inputs = dict(zip(names, (tokens, positions)))
        logits, next_tokens = run_graph(model.step, [], weights, state, inputs, None)
        return logits, next_tokens, state

    register_pytree()
    return jax.jit(step) if jit else step
