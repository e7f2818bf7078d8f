"""Prefill: the step's graphs over a whole prompt at once, as plain XLA, from the same spec.

`build_prefill(model)` returns `prefill(weights, state, tokens, lengths=None, start=None,
seed=0) -> (logits, next_tokens, new_state)`: weights in the reference's or the kernel's layout
(`QTensor`s or `w_codes`/`w_scales`), tokens i32 [B, T] (row b's tokens at cache
positions start[b] .. start[b] + lengths[b] - 1; the rest of the row is padding), the logits and
next tokens of each row's last token, and every cache and recurrent state written exactly as
lengths[b] decode steps would leave them, in the decode state's layout (the generated module's
`STATE`, global arrays). The decode step then continues from position start + lengths.

Each op says how it prefills (`OpDef.prefill`, mkdsl/ops/prefill.py): row-wise ops run their
decode reference over the B*T rows, attention and MLA write all positions and are causal over
the cache, recurrent ops scan their one-token reference. Only each row's last token goes through
the step's epilogue (final norm, output head). A sharded spec's prefill runs on the whole model
where its inputs are (host arrays: one device; XLA would partition it over arrays placed on a
mesh, but it sums in another order then, and Kimi's MoE routing amplifies that); given
`state_shardings` (the generated module's `state_shardings(mesh)`), the new state is then placed
as the kernel's `STATE_SPLIT` says, so the kernel's step takes it as it is. The prefill per device under
`shard_map`, with the kernel's collectives, is mkdsl/run/prefill_spmd.py (`spmd` here: each op's `OpDef.spmd_prefill`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mkdsl.lang.dtypes import storage
from mkdsl.lang.ir import Model
from mkdsl.lang.quant import from_storage, register_pytree
from mkdsl.lazy import jax, jnp
from mkdsl.ops import OPS
from mkdsl.ops.prefill import Rows
from mkdsl.run import guard
from mkdsl.run.reference import _no_nesting, _run_graph
from mkdsl.run.sampling import Sampling, sample_tokens


class PrefillError(ValueError):
    """A spec with a stateful op that declares no prefill rule, or inputs of the wrong shape."""


def check_prefill(model: Model) -> None:
    """Raise PrefillError unless every op that updates state declares its prefill rule."""
    nodes = [n for g in (*model.kinds, model.step) for n in g.nodes if n.op != "layers"]
    missing = sorted({n.op for n in nodes if OPS[n.op].inout and OPS[n.op].prefill is None})
    if missing:
        raise PrefillError(f"no prefill rule for {', '.join(missing)} (it updates state: see mkdsl/ops/prefill.py)")


def reference_weights(model: Model, weights: dict) -> dict:
    """Weights as the reference takes them, from either layout: a quantised `w` given as the
    kernel's `w_codes`, `w_scales` (what a loader writes) becomes a `QTensor` again."""
    out = dict(weights)
    for t in model.weights:
        if t.type.dtype.quantised and t.name not in out:
            parts = storage(t.type.dtype, tuple(t.full_shape))
            out[t.name] = from_storage(t.type.dtype, [out.pop(f"{t.name}_{p.suffix}") for p in parts])
    return out


def _caller(rows: list[Rows], spmd: bool = False) -> Callable:
    """Run one op over the current rows (`rows[0]`): per device (`spmd`, under `shard_map`) its
    `OpDef.spmd_prefill` where it has one and does not decline, else its prefill rule, or its
    reference row-wise."""

    def call(op, arrays, attrs):
        rule = op.spmd_prefill if spmd else None
        out = None if rule is None else rule(rows[0], arrays, attrs)
        if out is not None:
            return out
        if op.prefill is None:
            return op.reference(*arrays, **attrs)
        return op.prefill(rows[0], *arrays, **attrs)

    return call


def _prompt_rows(tokens, lengths, start) -> tuple[Rows, object, object]:
    """The B*T rows of a prompt, each row's length and start (defaults: T and 0)."""
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise PrefillError(f"tokens must be integers of shape [batch, length], got {tokens.dtype}{list(tokens.shape)}")
    batch, length = tokens.shape
    lengths = jnp.full((batch,), length, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    start = jnp.zeros((batch,), jnp.int32) if start is None else jnp.asarray(start, jnp.int32)
    t = jnp.arange(length, dtype=jnp.int32)[None, :]
    positions = (start[:, None] + t).reshape(-1)
    return Rows(batch, length, positions, (t < lengths[:, None]).reshape(-1)), lengths, start


def _prompt_inputs(
    model: Model, tokens, lengths, start, room=None, vocab=None
) -> tuple[Rows, dict, object, object, object]:
    """The prompt's rows, the step's inputs over them (tokens, positions), lengths and start.
    Token ids and positions out of range are clamped (mkdsl/run/guard.py); `rows.bad` flags
    each prompt row that had one among its valid tokens (`room`: the cache length): the fifth value."""
    tokens = jnp.asarray(tokens)
    rows, lengths, start = _prompt_rows(tokens, lengths, start)
    token_name, position_name = (v.name for v in model.inputs)
    vocab = guard.vocab(model) if vocab is None else vocab
    flat, positions, bad = guard.guard(tokens.reshape(-1).astype(jnp.int32), rows.positions, vocab, room)
    bad = jnp.any((bad & rows.valid).reshape(rows.batch, rows.length), axis=1)
    rows = Rows(rows.batch, rows.length, positions, rows.valid)
    return rows, {token_name: flat, position_name: positions}, lengths, start, bad


def run_prefill_layer(model: Model, index: int, weights, state, tokens, carries, lengths=None, start=None, spmd=False):
    """Layer `index` alone over a prompt's B*T rows, unjitted: (the carries it passes on, each
    [B*T, ...], and the state after its writes). Fed the carries token-by-token decoding enters
    the layer with, it checks one layer's prefill rules in place, where rounding differences
    cannot compound through the stack (as mkdsl/verify/kernel.py checks a kernel)."""
    rows, inputs, *_ = _prompt_inputs(model, tokens, lengths, start)
    state, graph = dict(state), model.kind(model.schedule[index])
    weights = reference_weights(model, weights)
    out = _run_graph(model, graph, list(carries), weights, state, inputs, index, _no_nesting, _caller([rows], spmd))
    return out, state


def run_prefill(
    model: Model,
    sampling,
    weights,
    state,
    tokens,
    lengths=None,
    start=None,
    seed=0,
    feed=None,
    spmd=False,
    vocab=None,
    context_layers=(),
):
    """The prefill, unjitted (build_prefill's body). `feed(index, carries) -> carries` replaces
    what layer `index` (the epilogue: index L) receives: a debug hook, to feed the prefill the
    carries token-by-token decoding has there (run_prefill_layer's check, for the epilogue).
    `spmd`: per device under `shard_map`, each op's `OpDef.spmd_prefill` first (see `_caller`).
    `vocab`: the token ids allowed (default: the model's; a per-device model passes the whole one).
    `context_layers`: also return the first carry (the residual stream) after each listed layer
    for every prompt token, f32 [B, T, len, H] (the hidden states a drafter reads)."""
    weights = reference_weights(model, weights)
    room = guard.cache_length(model, state)
    rows, inputs, lengths, start, bad = _prompt_inputs(model, tokens, lengths, start, room, vocab)
    token_name, position_name = (v.name for v in model.inputs)
    state, current = dict(state), [rows]
    last = jnp.arange(rows.batch) * rows.length + lengths - 1  # each row's last token
    call = _caller(current, spmd)
    feed, seen = feed or (lambda _, carries: carries), {}

    def run_layers(carries):
        for layer, kind in enumerate(model.schedule):
            carries = feed(layer, carries)
            carries = _run_graph(model, model.kind(kind), carries, weights, state, inputs, layer, run_layers, call)
            seen[layer] = carries[0]
        carries = feed(len(model.schedule), carries)
        # the epilogue sees one row per prompt row: its last token
        inputs.update({token_name: inputs[token_name][last], position_name: inputs[position_name][last]})
        current[0] = Rows(rows.batch, 1, inputs[position_name], jnp.ones((rows.batch,), bool))
        return [c[last] for c in carries]

    logits, greedy = _run_graph(model, model.step, [], weights, state, inputs, None, run_layers, call)
    seed = np.uint32(seed % 2**32) if isinstance(seed, int) else seed
    next_tokens = sample_tokens(logits, inputs[position_name], seed, sampling, greedy)
    out = (*guard.flag(bad, logits, next_tokens), state)
    if not context_layers:
        return out
    b, t = rows.batch, rows.length
    hidden = [seen[layer].astype(jnp.float32).reshape(b, t, -1) for layer in context_layers]
    return (*out, jnp.stack(hidden, axis=2))


def build_prefill(
    model: Model,
    *,
    sampling: Sampling | None = None,
    state_shardings: dict | None = None,
    jit: bool = True,
    donate: bool = True,
    context_layers: tuple[int, ...] = (),
) -> Callable:
    """The prefill of `model` (see the module docstring). `sampling` chooses next_tokens as the
    kernel's step does (default greedy); `state_shardings` (name -> sharding, e.g. the generated
    module's `state_shardings(mesh)`) places the new state; `donate` donates the input state;
    `context_layers`: a fourth output, the prompt's hidden states after those layers (run_prefill)."""
    check_prefill(model)
    sampling = Sampling() if sampling is None else sampling
    layers = tuple(context_layers)

    def prefill(weights, state, tokens, lengths=None, start=None, seed=0):
        return run_prefill(model, sampling, weights, state, tokens, lengths, start, seed, context_layers=layers)

    register_pytree()
    if not jit:
        return prefill
    jitted = jax.jit(prefill, **({"donate_argnums": (1,)} if donate else {}))
    if state_shardings is None:
        return jitted

    def placed(*args, **kwargs):
        logits, next_tokens, new_state, *context = jitted(*args, **kwargs)
        return logits, next_tokens, jax.device_put(new_state, {k: state_shardings[k] for k in new_state}), *context

    return placed
