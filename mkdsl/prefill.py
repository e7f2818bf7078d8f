"""Prefill: the step's graphs over a whole prompt at once, as plain XLA, from the same spec.

`build_prefill(model)` returns `prefill(weights, state, tokens, lengths=None, start=None,
seed=0) -> (logits, next_tokens, new_state)`: tokens i32 [B, T] (row b's tokens at cache
positions start[b] .. start[b] + lengths[b] - 1; the rest of the row is padding), the logits and
next tokens of each row's last token, and every cache and recurrent state written exactly as
lengths[b] decode steps would leave them, in the decode state's layout (the generated module's
`STATE`, global arrays). The decode step then continues from position start + lengths.

Each op says how it prefills (`OpDef.prefill`, mkdsl/ops/prefill.py): row-wise ops run their
decode reference over the B*T rows, attention and MLA write all positions and are causal over
the cache, recurrent ops scan their one-token reference. Only each row's last token goes through
the step's epilogue (final norm, output head). A sharded spec's prefill runs whole, partitioned
by XLA: given a mesh, its outputs are placed as the kernel's `STATE_SPLIT` says
(`state_shardings`), so the kernel's step takes them as they are.
"""

from __future__ import annotations

from collections.abc import Callable

from mkdsl.ir import Model
from mkdsl.lazy import jax, jnp
from mkdsl.ops import OPS
from mkdsl.ops.prefill import Rows
from mkdsl.quant import register_pytree
from mkdsl.reference import _run_graph
from mkdsl.sampling import Sampling, sample_tokens


class PrefillError(ValueError):
    """A spec with a stateful op that declares no prefill rule, or inputs of the wrong shape."""


def check_prefill(model: Model) -> None:
    """Raise PrefillError unless every op that updates state declares its prefill rule."""
    nodes = [n for g in (*model.kinds, model.step) for n in g.nodes if n.op != "layers"]
    missing = sorted({n.op for n in nodes if OPS[n.op].inout and OPS[n.op].prefill is None})
    if missing:
        raise PrefillError(f"no prefill rule for {', '.join(missing)} (it updates state: see mkdsl/ops/prefill.py)")


def _caller(rows: list[Rows]) -> Callable:
    """Run one op over the current rows (`rows[0]`): its prefill rule, or its reference row-wise."""

    def call(op, arrays, attrs):
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


def build_prefill(
    model: Model,
    *,
    sampling: Sampling | None = None,
    state_shardings: dict | None = None,
    jit: bool = True,
    donate: bool = True,
) -> Callable:
    """The prefill of `model` (see the module docstring). `sampling` chooses next_tokens as the
    kernel's step does (default greedy); `state_shardings` (name -> sharding, e.g. the generated
    module's `state_shardings(mesh)`) places the new state; `donate` donates the input state."""
    check_prefill(model)
    sampling = Sampling() if sampling is None else sampling
    token_name, position_name = (v.name for v in model.inputs)

    def prefill(weights, state, tokens, lengths=None, start=None, seed=0):
        tokens = jnp.asarray(tokens)
        rows, lengths, start = _prompt_rows(tokens, lengths, start)
        state = dict(state)
        current = [rows]
        inputs = {token_name: tokens.reshape(-1).astype(jnp.int32), position_name: rows.positions}
        last = jnp.arange(rows.batch) * rows.length + lengths - 1  # each row's last token
        call = _caller(current)

        def run_layers(carries):
            for layer, kind in enumerate(model.schedule):
                carries = _run_graph(model, model.kind(kind), carries, weights, state, inputs, layer, run_layers, call)
            # the epilogue sees one row per prompt row: its last token
            inputs.update({token_name: inputs[token_name][last], position_name: start + lengths - 1})
            current[0] = Rows(rows.batch, 1, inputs[position_name], jnp.ones((rows.batch,), bool))
            return [c[last] for c in carries]

        logits, greedy = _run_graph(model, model.step, [], weights, state, inputs, None, run_layers, call)
        next_tokens = sample_tokens(logits, inputs[position_name], seed, sampling, greedy)
        return logits, next_tokens, state

    register_pytree()
    if not jit:
        return prefill
    options = {"donate_argnums": (1,)} if donate else {}
    if state_shardings is not None:
        options["out_shardings"] = (None, None, state_shardings)
    return jax.jit(prefill, **options)
