"""The input contract the reference and the prefill share with the generated kernel's step
(templates/wrapper/checks.py.jinja: `guard_inputs`, `flag_rows`), which holds under any outer
`jax.jit`, where values cannot be checked before the call:

- a token id outside the vocabulary or a position outside the cache is clamped into it, so
  nothing reads or writes out of bounds (and nothing waits on a slot that does not exist);
- the row is flagged in the outputs: its logits are NaN and its next token is -1. Its cache may
  have been written at the clamped position; the caller discards the row.
"""

from __future__ import annotations

from mkdsl.lang.ir import Model
from mkdsl.lazy import jnp


def vocab(model: Model) -> int:
    """The token ids the step takes (the embedding table's rows), as the kernel's VOCAB_SIZE."""
    from mkdsl.backends.tpu.wrapper import wrapper_context

    return wrapper_context(model, 1)["vocab"]


def cache_length(model: Model, state: dict) -> int | None:
    """The cache length of `state` (the first state tensor with a cache dim), None without one."""
    seq = {d.name for d in model.dims[1:]}
    for t in model.states:
        for axis, d in enumerate(t.type.shape):
            if d in seq and t.name in state:
                return int(state[t.name].shape[axis + (1 if t.stacked else 0)])
    return None


def guard(tokens, positions, vocab_size: int, room: int | None):
    """(tokens, positions) clamped into the vocabulary and the first `room` cache slots, and the
    rows that were outside (bool, the shape of `tokens`)."""
    bad = (tokens < 0) | (tokens >= vocab_size) | (positions < 0)
    tokens, positions = jnp.clip(tokens, 0, vocab_size - 1), jnp.maximum(positions, 0)
    if room is not None:
        bad = bad | (positions >= room)
        positions = jnp.minimum(positions, room - 1)
    return tokens, positions, bad


def flag(bad, logits, next_tokens):
    """The outputs of a flagged row: NaN logits, next token -1. `bad`: bool [batch]."""
    logits = jnp.where(bad.reshape(-1, *([1] * (logits.ndim - 1))), jnp.nan, logits)
    return logits, jnp.where(bad.reshape(-1, *([1] * (next_tokens.ndim - 1))), -1, next_tokens)
