"""Verify rows (speculative decoding): R rows of one sequence in one step, and `commit`.

A verify step takes, per sequence b, R tokens at consecutive positions positions[b, 0] + r
(the last accepted token and R - 1 drafted ones) and returns, per row, the logits and the
target's next token. Row r attends to its sequence's cache and to rows 0..r (causal); the
KV of all R rows is written into the cache. A KV cache needs no commit: the entries of rows
past the accepted length stay in the cache, are never read (a row at position p reads keys
<= p only) and are overwritten by the next step, which starts at the first rejected position.

State that is not indexed by position (recurrent state: delta rule, gated delta net, short
convolutions) cannot be rolled back that way, so in a verify step it has a slot per row: its
batch dimension is B*R, slot b*R + r holding sequence b's state after row r, and each step
reads sequence b's state from slot b*R + R - 1. `commit` copies slot accepted[b] - 1 into that
slot: a selection, no recompute. With R = 1 the layout is the plain one.

The reference here reuses the prefill's op rules (mkdsl/ops/prefill.py): a verify step is a
prefill over R tokens that starts at positions[:, 0], keeps every recurrent state
(`Rows.row_states`) and runs the epilogue on every row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mkdsl.lang.ir import Model
from mkdsl.lang.quant import register_pytree
from mkdsl.lazy import jax, jnp
from mkdsl.ops.prefill import Rows
from mkdsl.run.prefill import _caller, reference_weights
from mkdsl.run.reference import _no_nesting, _run_graph

MAX_ROWS = 16


def check_rows(rows: int) -> None:
    """Raise ValueError unless `rows` is an int in 1..MAX_ROWS."""
    if not isinstance(rows, int) or isinstance(rows, bool) or not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"rows must be an int in 1..{MAX_ROWS}, got {rows!r}")


def row_state_axes(model: Model) -> dict[str, int]:
    """State tensors with a slot per verify row -> the axis of their batch dimension."""
    return model.row_states()


def verify_state(model: Model, state: dict, rows: int) -> dict:
    """A plain state (B rows, e.g. from the prefill) in the verify layout for `rows` rows: each
    recurrent state's row repeated into its R slots."""
    check_rows(rows)
    out = dict(state)
    for name, axis in row_state_axes(model).items():
        out[name] = jnp.repeat(jnp.asarray(state[name]), rows, axis=axis)
    return out


def plain_state(model: Model, state: dict, rows: int) -> dict:
    """A committed verify state back in the plain layout: each sequence's slot R - 1."""
    out = dict(state)
    for name, axis in row_state_axes(model).items():
        x = jnp.asarray(state[name])
        out[name] = jnp.take(x, jnp.arange(rows - 1, x.shape[axis], rows), axis=axis)
    return out


def commit(model: Model, state: dict, accepted) -> dict:
    """The state as if only the first accepted[b] rows of each sequence had been decoded:
    recurrent slot b*R + accepted[b] - 1 copied into slot b*R + R - 1 (R from the shapes);
    caches unchanged (see the module docstring). `accepted`: int [B], each in 1..R."""
    accepted = jnp.asarray(accepted, jnp.int32).reshape(-1)
    out = dict(state)
    for name, axis in row_state_axes(model).items():
        x = jnp.asarray(state[name])
        batch = accepted.shape[0]
        rows = x.shape[axis] // batch
        if rows * batch != x.shape[axis]:
            raise ValueError(f"state `{name}` has {x.shape[axis]} row slots, not a multiple of {batch} sequences")
        seqs = jnp.arange(batch, dtype=jnp.int32)
        src = jnp.clip(accepted, 1, rows) - 1
        index = jnp.arange(x.shape[axis], dtype=jnp.int32)
        index = index.at[seqs * rows + rows - 1].set(seqs * rows + src)
        out[name] = jnp.take(x, index, axis=axis)
    return out


def _verify_inputs(model: Model, tokens, positions) -> tuple[Rows, dict]:
    tokens, positions = jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32)
    if tokens.ndim != 2 or tokens.shape != positions.shape:
        raise ValueError(f"tokens and positions must be int32 [batch, rows], got {tokens.shape} and {positions.shape}")
    batch, rows = tokens.shape
    flat = positions.reshape(-1)
    grid = Rows(batch, rows, flat, jnp.ones((batch * rows,), bool), row_states=True)
    token_name, position_name = (v.name for v in model.inputs)
    return grid, {token_name: tokens.reshape(-1), position_name: flat}


def run_verify(model: Model, weights, state, tokens, positions, context_layers: Sequence[int] = (), feed=None):
    """The verify step, unjitted: (logits [B, R, V], next_tokens [B, R], new_state[, context
    [B, R, len(context_layers), H]]). `feed(index, carries) -> carries` replaces what layer
    `index` receives (a hook for the layer-by-layer check)."""
    weights = reference_weights(model, weights)
    grid, inputs = _verify_inputs(model, tokens, positions)
    state, call, seen = dict(state), _caller([grid]), {}
    feed = feed or (lambda _, carries: carries)

    def run_layers(carries):
        for layer, kind in enumerate(model.schedule):
            carries = feed(layer, carries)
            carries = _run_graph(model, model.kind(kind), carries, weights, state, inputs, layer, run_layers, call)
            seen[layer] = carries[0]
        return feed(len(model.schedule), carries)

    logits, greedy = _run_graph(model, model.step, [], weights, state, inputs, None, run_layers, call)
    b, r = grid.batch, grid.length
    out = (logits.reshape(b, r, -1), greedy.reshape(b, r), state)
    if not context_layers:
        return out
    context = jnp.stack([seen[layer].astype(jnp.float32).reshape(b, r, -1) for layer in context_layers], axis=2)
    return (*out, context)


def check_context_layers(model: Model, context_layers: Sequence[int]) -> tuple[int, ...]:
    """The layers as a tuple, each checked to be a layer index."""
    layers = tuple(context_layers)
    n = len(model.schedule)
    bad = [x for x in layers if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x < n]
    if bad:
        raise ValueError(f"context layers must be layer indices 0..{n - 1}, got {bad}")
    return layers


def build_verify_reference(model: Model, rows: int, context_layers: Sequence[int] = (), jit: bool = True) -> Callable:
    """`step(weights, state, tokens [B, R], positions [B, R]) -> (logits [B, R, V], next_tokens
    [B, R], new_state[, context])`, the state in the verify layout (`verify_state`)."""
    check_rows(rows)
    layers = check_context_layers(model, context_layers)

    def step(weights, state, tokens, positions):
        if tokens.shape[-1] != rows:
            raise ValueError(f"tokens must have {rows} rows per sequence, got shape {tokens.shape}")
        return run_verify(model, weights, state, tokens, positions, layers)

    register_pytree()
    return jax.jit(step) if jit else step


def run_verify_layer(model: Model, index: int, weights, state, tokens, positions, carries) -> tuple[list, dict]:
    """Layer `index` alone over the B*R verify rows, unjitted: (its carries out, the state after
    its writes); what mkdsl/verify/kernel.py compares a verify kernel's layer with."""
    grid, inputs = _verify_inputs(model, tokens, positions)
    state, graph = dict(state), model.kind(model.schedule[index])
    weights = reference_weights(model, weights)
    out = _run_graph(model, graph, list(carries), weights, state, inputs, index, _no_nesting, _caller([grid]))
    return out, state


def build_layered_verify(model: Model):
    """The verify reference cut at the layer stack, as `build_layered_reference` cuts the plain
    one (a `LayeredReference` over the B*R rows: tokens and positions [B, R], logits [B*R, V])."""
    from functools import partial

    from mkdsl.run.reference import LayeredReference, _Cut

    register_pytree()

    def run_step(weights, state, tokens, positions, layers):
        grid, inputs = _verify_inputs(model, tokens, positions)
        weights = reference_weights(model, weights)
        return _run_graph(model, model.step, [], weights, dict(state), inputs, None, layers, _caller([grid]))

    def prologue(weights, state, tokens, positions):
        def cut(carries):
            raise _Cut(carries)

        try:
            run_step(weights, state, tokens, positions, cut)
        except _Cut as stop:
            return stop.carries
        raise ValueError(f"model `{model.name}` has no layer stack")

    def epilogue(weights, state, tokens, positions, carries):
        logits, next_tokens = run_step(weights, state, tokens, positions, lambda _: carries)
        return logits, next_tokens

    layers = [jax.jit(partial(run_verify_layer, model, i)) for i in range(len(model.schedule))]

    def layer(index, weights, state, tokens, positions, carries):
        return layers[index](weights, state, tokens, positions, list(carries))

    return LayeredReference(model, jax.jit(prologue), layer, jax.jit(epilogue))
