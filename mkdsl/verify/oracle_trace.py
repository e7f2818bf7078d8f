"""What `verify --against transformers` records on both sides (mkdsl/verify/transformers.py):
transformers' hidden states entering and leaving each decoder layer and every module output
inside it (forward hooks), and the spec's value of every op of one layer over a prompt."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mkdsl.lang.ir import Model
from mkdsl.lazy import jnp


@dataclass
class HFTrace:
    logits: np.ndarray  # [T, V] f32
    layer_in: list[np.ndarray]  # per decoder layer, [T, H]: the hidden state entering it
    layer_out: list[np.ndarray]  # [T, H]: leaving it
    modules: list[list[tuple[str, np.ndarray]]]  # per layer, in call order: (module name, [T, X])


def decoder_layers(hf):
    """The model's list of decoder layers: the module list as long as config.num_hidden_layers."""
    import torch

    count = hf.config.num_hidden_layers
    for _, m in hf.named_modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) == count:
            return m
    raise ValueError(f"no module list of {count} decoder layers in {type(hf).__name__}")


def _first_tensor(x):
    import torch

    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, tuple | list) and x and isinstance(x[0], torch.Tensor):
        return x[0]
    return None


def _rows(x, tokens: int) -> np.ndarray | None:
    """A module output as [tokens, features] when its leading axes are (1, tokens) or (tokens,)."""
    t = _first_tensor(x)
    if t is None or not t.is_floating_point() or t.ndim < 2:
        return None
    if t.shape[0] == 1 and t.shape[1] == tokens:
        return t.detach().float().reshape(tokens, -1).numpy().copy()
    if t.shape[0] == tokens:
        return t.detach().float().reshape(tokens, -1).numpy().copy()
    return None


def hf_trace(hf, ids: np.ndarray, **inputs) -> HFTrace:
    """One forward of `hf` over `ids` (no cache; `inputs`: the forward's other arguments, a
    stand-in's), recording what HFTrace holds."""
    import torch

    layers = decoder_layers(hf)
    tokens = len(ids)
    layer_in: list = [None] * len(layers)
    layer_out: list = [None] * len(layers)
    modules: list[list] = [[] for _ in layers]
    hooks = []
    for i, layer in enumerate(layers):

        def pre(mod, args, kwargs, i=i):
            x = args[0] if args else kwargs.get("hidden_states")
            layer_in[i] = _rows(x, tokens)

        def post(mod, args, out, i=i):
            layer_out[i] = _rows(out, tokens)

        hooks += [layer.register_forward_pre_hook(pre, with_kwargs=True), layer.register_forward_hook(post)]
        for name, sub in layer.named_modules():
            if name:

                def record(mod, args, out, i=i, name=name):
                    rows = _rows(out, tokens)
                    if rows is not None:
                        modules[i].append((f"layers.{i}.{name}", rows))

                hooks.append(sub.register_forward_hook(record))
    try:
        with torch.no_grad():
            out = hf(input_ids=torch.as_tensor(ids[None], dtype=torch.long), use_cache=False, **inputs)
    finally:
        for h in hooks:
            h.remove()
    return HFTrace(out.logits[0].float().numpy(), layer_in, layer_out, modules)


def mk_op_values(model: Model, index: int, weights, carry_in: np.ndarray, tokens: np.ndarray, dtype):
    """(node, value as [T, X]) of every op of layer `index` over the prompt `tokens`, fed `carry_in`
    (the layer's prefill, as `mkdsl.run.prefill.run_prefill_layer` runs it)."""
    from mkdsl.run.prefill import _caller, _prompt_inputs, reference_weights
    from mkdsl.run.reference import _no_nesting, _run_graph

    rows, inputs, *_ = _prompt_inputs(model, jnp.asarray(tokens[None]), None, None)
    graph = model.kind(model.schedule[index])
    base, seen = _caller([rows]), []

    def call(op, arrays, attrs):
        outs = base(op, arrays, attrs)
        seen.append(outs)
        return outs

    state = dict(zero_state(model, len(tokens) + 1))
    carries = [jnp.asarray(carry_in, dtype)]
    _run_graph(model, graph, carries, reference_weights(model, weights), state, inputs, index, _no_nesting, call)
    out = []
    for node, outs in zip(graph.nodes, seen):
        for v in outs[: len(node.outputs)]:
            a = np.asarray(v, np.float32)
            if a.ndim >= 1 and a.shape[0] == len(tokens):
                out.append((node, a.reshape(len(tokens), -1)))
    return out


def step_op_values(model: Model, index: int, weights, state, tokens, positions, carries):
    """(node, value as [B, X]) of every op of layer `index` in one step of B rows (the reference's
    decode step, `mkdsl.run.reference.run_layer`), from `state` and the layer's input `carries`."""
    from mkdsl.run.reference import _inputs, _no_nesting, _run_graph

    graph, rows, seen = model.kind(model.schedule[index]), len(tokens), []

    def call(op, arrays, attrs):
        outs = op.reference(*arrays, **attrs)
        seen.append(outs)
        return outs

    inputs = _inputs(model, jnp.asarray(tokens), jnp.asarray(positions))
    _run_graph(model, graph, list(carries), weights, dict(state), inputs, index, _no_nesting, call)
    out = []
    for node, outs in zip(graph.nodes, seen):
        for v in outs[: len(node.outputs)]:
            a = np.asarray(v, np.float32)
            if a.ndim >= 1 and a.shape[0] == rows:
                out.append((node, a.reshape(rows, -1)))
    return out


def zero_state(model: Model, seq_len: int) -> dict:
    from mkdsl.lang.dtypes import numpy_dtype
    from mkdsl.run.random_params import concrete_shape

    sizes = {model.dims[0].name: 1, **{d.name: seq_len for d in model.dims[1:]}}
    return {
        t.name: jnp.zeros(concrete_shape(t.full_shape, sizes), numpy_dtype(t.type.dtype.numpy))
        for t in model.tensors
        if t.kind == "state"
    }
