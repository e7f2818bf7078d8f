"""The oracle: the graph IR evaluated op by op with each op's plain-jnp reference.

Unfused and straightforward on purpose: a Python loop over layers, every intermediate
materialised. Generated kernels are tested against this function, whole (`build_reference`) or
one layer at a time (`build_layered_reference`), so that a layer-by-layer check feeds both
sides the same input and differences cannot compound through the stack.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mkdsl.lang.ir import Graph, LayerExpr, Model, Ref
from mkdsl.lang.quant import QTensor, register_pytree, slot_of
from mkdsl.lazy import jax, jnp
from mkdsl.ops import OPS
from mkdsl.run import guard

LayersFn = Callable[[list], list]  # carries entering the layer stack -> carries leaving it


def _slot(array, slot: int):
    if isinstance(array, QTensor):
        return slot_of(array, slot)
    return array[slot]


def _call_reference(op, arrays, attrs):
    return op.reference(*arrays, **attrs)


def _run_graph(
    model: Model, graph: Graph, carries, weights, state, inputs, layer: int | None, layers: LayersFn, call=None
):
    """Evaluate one graph; `state` (a dict) receives the state writes; a `layers` node calls `layers`.
    `call(op, arrays, attrs)` runs one op (default: its reference; prefill passes its rules)."""
    call = call or _call_reference
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
            outs = layers([read(r) for r in node.inputs])
        else:
            op = OPS[node.op]
            attrs = {k: v.at(layer) if isinstance(v, LayerExpr) else v for k, v in node.attrs}
            outs = call(op, [read(r) for r in node.inputs], attrs)
            for name, new in zip(node.writes, outs[op.outputs :]):
                t = model.tensor(name)
                state[name] = state[name].at[t.slots[layer]].set(new) if t.stacked else new
        for v, out in zip(node.outputs, outs):
            env[v.name] = out
    return [read(r) for r in graph.results]


def _inputs(model: Model, tokens, positions) -> dict:
    return dict(zip([v.name for v in model.inputs], (tokens, positions)))


def build_reference(model: Model, jit: bool = True) -> Callable:
    """`step(weights, state, tokens, positions) -> (logits, next_tokens, new_state)`.

    weights: name -> array (a `QTensor` for quantised formats); state: name -> array.
    Stacked tensors carry a leading layer-slot axis, as declared. A token id or position out of
    range is clamped and its row flagged (NaN logits, next token -1), as the kernel's step does
    (mkdsl/run/guard.py).
    """
    vocab = guard.vocab(model)

    def step(weights, state, tokens, positions):
        state = dict(state)
        tokens, positions, bad = guard.guard(
            jnp.asarray(tokens), jnp.asarray(positions), vocab, guard.cache_length(model, state)
        )
        inputs = _inputs(model, tokens, positions)

        def run_layers(carries):
            for layer, kind in enumerate(model.schedule):
                carries = _run_graph(model, model.kind(kind), carries, weights, state, inputs, layer, run_layers)
            return carries

        logits, next_tokens = _run_graph(model, model.step, [], weights, state, inputs, None, run_layers)
        return (*guard.flag(bad, logits, next_tokens), state)

    register_pytree()
    return jax.jit(step) if jit else step


class _Cut(Exception):
    """Raised at the layer stack to stop the prologue there, with the carries it receives."""

    def __init__(self, carries):
        self.carries = carries


@dataclass(frozen=True)
class LayeredReference:
    """The reference cut at the layer stack: the step's prologue, each layer, the epilogue.

    Each piece takes the carries (the values the layer kinds pass on, in the order of their
    parameters) explicitly, so a caller can feed layer l the kernel's own carries after layer
    l - 1. All three are jitted (layer pieces per layer index, which fixes kind, slots and
    per-layer attributes).
    """

    model: Model
    prologue: Callable  # (weights, state, tokens, positions) -> carries entering layer 0
    layer: Callable  # (index, weights, state, tokens, positions, carries) -> (carries, new_state)
    epilogue: Callable  # (weights, state, tokens, positions, carries) -> (logits, next_tokens)


def build_layered_reference(model: Model) -> LayeredReference:
    register_pytree()

    def prologue(weights, state, tokens, positions):
        def cut(carries):
            raise _Cut(carries)

        try:
            _run_graph(model, model.step, [], weights, dict(state), _inputs(model, tokens, positions), None, cut)
        except _Cut as stop:
            return stop.carries
        raise ValueError(f"model `{model.name}` has no layer stack")

    def epilogue(weights, state, tokens, positions, carries):
        inputs = _inputs(model, tokens, positions)
        logits, next_tokens = _run_graph(model, model.step, [], weights, dict(state), inputs, None, lambda _: carries)
        return logits, next_tokens

    def one_layer(index: int) -> Callable:
        return jax.jit(lambda *args: run_layer(model, index, *args))

    layers = [one_layer(i) for i in range(len(model.schedule))]

    def layer(index, weights, state, tokens, positions, carries):
        return layers[index](weights, state, tokens, positions, list(carries))

    return LayeredReference(model, jax.jit(prologue), layer, jax.jit(epilogue))


def run_layer(model: Model, index: int, weights, state, tokens, positions, carries) -> tuple[list, dict]:
    """Layer `index` alone, unjitted: (carries it passes on, state after its writes)."""
    state = dict(state)
    inputs = _inputs(model, tokens, positions)
    graph = model.kind(model.schedule[index])
    return _run_graph(model, graph, list(carries), weights, state, inputs, index, _no_nesting), state


def _no_nesting(carries):
    raise ValueError("a layer stack inside a layer")


def build_mtp_reference(model: Model, jit: bool = True) -> Callable:
    """The spec's `mtp` head: `mtp(weights, state, hidden, tokens, positions) -> (hidden, logits,
    new_state)`; its state (its attention's caches) is read and written as the step's is."""
    if model.mtp is None:
        raise ValueError(f"model `{model.name}` declares no `mtp` head")
    names = [v.name for v in model.mtp_inputs]
    register_pytree()

    def mtp(weights, state, hidden, tokens, positions):
        state = dict(state)
        inputs = dict(zip(names, (tokens, positions)))
        out, logits = _run_graph(model, model.mtp, [hidden], weights, state, inputs, None, _no_layers)
        return out, logits, state

    return jax.jit(mtp) if jit else mtp


def _no_layers(carries):
    raise ValueError("an `mtp` head calls no layer stack")
